// tiers/mma/decode.cuh — split-KV decode ("flash-decoding") on the tensor cores of every GPU
// (mma.sync, ldmatrix, cp.async): few query rows against a long key range, the shape of serving,
// where the work is streaming K and V once at the memory's speed.
//
// Rows. A CTA owns the rows of one KV group: the decode_heads query heads that share a KV head,
// each with its Sq queries, packed into one tile (tile row R is query R / decode_heads of head
// h0 + R % decode_heads), so K and V are read once per group instead of once per query head. A
// tile holds kRows = 16 kWarpsM rows; more rows (long speculative drafts, prefill through the
// cache) take several row chunks.
//
// Keys. Each step brings kBlockN keys into shared memory through a cp.async ring of kStages
// stages (on GPUs whose shared memory holds less than two steps, one stage whose K and V halves
// take turns: HalfStepConfig), and the kWarpsN warps that share a 16-row slice split the step's keys, 16 each: with
// one 16-row tile (Sq * G <= 16, the common decode) all four warps stream keys. Each warp runs
// the online softmax on its own keys (core/softmax.cuh, the four named steps), and at the end
// the warps of a slice merge their (m, l, O) through shared memory. The key range of a row chunk
// is cut into num_splits ranges (core/scheduler.cuh: plan_key_splits), one CTA each; with more
// than one, every range leaves its normalized O and (m, log2 l) in fp32 and core/combine.cuh
// merges them.
//
// The cache. Position pos of sequence bi is row pos of the dense cache, or row pos % page_size of
// page block_table[bi][pos / page_size]; positions from len_b on are the new keys k_new / v_new,
// read from there (and written into the cache by this kernel, once, by the CTAs of split s for
// their share of the new rows) so that no CTA reads a cache row another one is writing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../arch/host.h"
#include "../../arch/fp8.cuh"
#include "../../arch/sm80.cuh"
#include "../../arch/sm90.cuh"
#include "../../arch/tile.cuh"
#include "../../arch/tma.h"
#include "../../arch/types.cuh"
#include "../../core/block.cuh"
#include "../../core/combine.cuh"
#include "../../core/mask.cuh"
#include "../../core/scheduler.cuh"
#include "../../core/softmax.cuh"
#include "../../include/ablation.h"
#include "gemm.cuh"

namespace flash_cuda {
namespace decode {

// Shared memory for the K / V ring: 96 KiB, two steps of 64 keys at d = 128. It fits the 99 KiB
// of consumer GPUs (sm_86 / 89 / 120) at every head dim up to 128, and an H100 runs three CTAs
// (twelve warps) per SM. Warps, not ring depth, set the speed: a three-step ring with two CTAs
// per SM, or four steps with one, streamed the cache more slowly (OPTIMIZATION.md).
constexpr size_t kRingBytes = 96 * 1024;
constexpr int kMaxStages = 4;

// The shapes of a decode tile; kStages_ = 1 is the one-stage ring whose K and V halves are
// pipelined against each other (the kernel's half-step loop). kSubN_: keys per warp per step (32
// only in the FP8 rung Fp8WideStepPolicy).
template <typename T_, int kHeadDim_, int kWarpsM_, int kStages_, int kSubN_ = 16>
struct Tile {
  // The key copies ask the L2 for 256 bytes around each 16-byte request (cp_async_16_stream):
  // whole rows of keys come from DRAM in one request.
  static constexpr int kPrefetch = 256;
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarpsM = kWarpsM_;         // 16-row slices of the tile
  static constexpr int kWarpsN = 4 / kWarpsM;      // warps sharing a slice, splitting its keys
  static constexpr int kThreads = 128;
  static constexpr int kRows = 16 * kWarpsM;
  static constexpr int kSubN = kSubN_;             // keys per warp per step
  static constexpr int kBlockN = kSubN * kWarpsN;  // keys per step
  static constexpr int kPitch = kHeadDim + 8;      // padded rows: conflict-free ldmatrix
  // The cache's elements as the ring holds them (Fp8Config: e4m3 bytes), its row pitch in them,
  // and how many one 16-byte copy moves.
  using TC = T;
  using TM = T;  // the products' 16-bit operands (Q, P, the converted K and V)
  static constexpr bool kFp8 = false;
  static constexpr bool kQToHalf = false;  // Fp8Config: a bf16 Q tile converted to fp16
  static constexpr int kPitchC = kPitch;
  static constexpr int kChunkElems = 8;
  static constexpr size_t kStageBytes = size_t(2) * kBlockN * kPitch * sizeof(T);  // K and V
  static constexpr int kStages = kStages_;
  static constexpr bool kHalfSteps = kStages == 1;
  static constexpr bool kWarpRows = false;  // KeyCopier's warp-owned rows (Config at d = 256)
  static constexpr int kMergePitch = kHeadDim + 4;
  // Shared memory: Q, then the K / V ring, over which the warps merge their final O and (m, l),
  // fp32, once the keys are done; then one mbarrier per stage, on which the Hopper build's bulk
  // copies of a step land (the kernel's kBulk variant).
  struct Storage {
    T q[kRows * kPitch];
    union {
      T kv[kStages][2][kBlockN * kPitch];  // a step's K, then its V
      struct {
        float o[kWarpsN][kRows * kMergePitch];
        float stats[kWarpsN][kRows][2];
      } merge;
    };
    uint64_t full[kStages];
  };
  // Steps of cached keys in pages smaller than a step come in by the TMA unit on Hopper (the
  // kernel's kBulk variant, launch_decode): one bulk copy per K or V row of the step, issued by
  // as many threads, completing on the stage's mbarrier, where cp.async takes a page lookup and
  // 16 copies of 16 bytes per thread and step (every warp issues an equal share of the rows:
  // bulk_key_block). Not for the one-stage ring.
  static constexpr bool kBulkEligible = kStages_ != 1;
  // Which fill takes cached steps from pages smaller than a step on Hopper (OPTIMIZATION.md steps
  // 54, 55): tensor-map boxes (box_key_block; a box spans a padded line: kPitchC <= 256 elements)
  // for 32-key steps, bulk copies for d = 256's 512-byte rows, else cp.async with the step's page
  // ids read before its copies (load_key_block), which streamed 64-key steps at d 64 / 128 at
  // 0.92-0.97 of the dense cache's time.
  static constexpr bool kBoxable = kBulkEligible && kPitchC <= 256;  // (the ablation rung's reach)
  static constexpr bool kPageBoxes = kBoxable && kBlockN < 64;
  static constexpr bool kBulkPages = kBulkEligible && kHeadDim * sizeof(TC) > 256;
  static constexpr size_t kSmemBytes = sizeof(Storage);
  // Q's A fragments stay in registers for the whole key loop where they fit next to O's
  // accumulators (d <= 128: 32 registers); at d = 256 they are read from shared memory per step.
  static constexpr bool kQInRegs = kHeadDim <= 128;
  static constexpr int kQFrags = kQInRegs ? kHeadDim / 16 : 1;  // (one unused where they do not)
  static_assert(kWarpsM * kWarpsN == 4, "four warps");
  static_assert(kStages >= 1 && kStages <= kMaxStages, "ring depth");
};

// The full tiles: what every GPU class runs where its opt-in shared memory holds them (all of them
// on Hopper and the A100; up to d = 128 and the 32- / 64-row tiles at d = 256 on the 99 KiB class).
// Their ring: as many whole steps as kRingBytes holds, two to kMaxStages.
template <typename T, int kHeadDim, int kWarpsM>
constexpr int kFullStages = static_cast<int>(
    std::min<size_t>(kMaxStages, std::max<size_t>(2, kRingBytes / Tile<T, kHeadDim, kWarpsM, 1>::kStageBytes)));
template <typename T, int kHeadDim, int kWarpsM>
struct Config : Tile<T, kHeadDim, kWarpsM, kFullStages<T, kHeadDim, kWarpsM>> {
  // d = 256 (one 16-row slice, cp.async steps): each warp copies the key rows its own products read
  // and waits for them alone (KeyCopier::kOwned), where a CTA-wide wait per step held the dense
  // cache at 0.92-0.97 of this time (OPTIMIZATION.md step 66); flat at d = 64 / 128.
  static constexpr bool kWarpRows = kHeadDim == 256;
};

// Ablation rung (FLASH_CUDA_ABLATIONS, FLASH_CUDA_DECODE_RING=deep; launch_decode): the full
// tiles with a deeper ring where the grid leaves an SM fewer CTAs than the two-step ring was
// sized for (three per SM at d = 128): three steps with two CTAs per SM, four with one, so that
// as many bytes stay in flight per SM. A type of its own, so that its kernels' names say so.
template <typename T, int kHeadDim, int kWarpsM, int kStages>
struct DeepRingConfig : Tile<T, kHeadDim, kWarpsM, kStages> {};

// The 99 KiB class in the d = 256 bucket (head dims 129..256) with one 16-row slice (the common
// decode: Sq * group <= 16): two whole steps of 64 keys (132 KiB) do not fit next to Q, so the
// ring is one step whose K and V are loaded as two halves: a step's V streams in while S is
// computed from its K, and the next step's K while P V runs. One half-step (32 KiB of cache) is in
// flight per CTA, as much as a step of the d = 128 tiles keeps in flight on that class; the same
// 64 keys per step, four warps and merge, so the split planner and the numerics are those of the
// full tiles.
template <typename T, int kHeadDim, int kWarpsM>
struct HalfStepConfig : Tile<T, kHeadDim, kWarpsM, 1> {};

// FP8 caches (FwdParams::cache_fp8, sm_89 and newer): the ring holds each step's e4m3 K and V rows,
// padded to d + 16 bytes (conflict-free ldmatrix), and the two products read them straight from
// there, converting in registers (tiers/mma/gemm.cuh: the e4m3 B operands): a step costs the
// shared memory half the bytes of a 16-bit one. kFp8RingBytes sets the ring's steps (3 at d = 128:
// as many bytes in flight per CTA as the 16-bit ring's, at three CTAs per SM).
constexpr size_t kFp8RingBytes = 56 * 1024;
template <typename T, int kHeadDim, int kWarpsM, int kSubN>
struct Fp8Sizes {
  using Base = Tile<T, kHeadDim, kWarpsM, 2, kSubN>;
  static constexpr int kPitchC = kHeadDim + 16;
  static constexpr size_t kStageBytes = size_t(2) * Base::kBlockN * kPitchC;
  static constexpr int kStages =
      static_cast<int>(std::min<size_t>(kMaxStages, std::max<size_t>(2, kFp8RingBytes / kStageBytes)));
};
template <typename T_, int kHeadDim_, int kWarpsM_, int kSubN_ = 16>
struct Fp8Config : Tile<T_, kHeadDim_, kWarpsM_, Fp8Sizes<T_, kHeadDim_, kWarpsM_, kSubN_>::kStages, kSubN_> {
  using Sizes = Fp8Sizes<T_, kHeadDim_, kWarpsM_, kSubN_>;
  using Base = Tile<T_, kHeadDim_, kWarpsM_, Sizes::kStages, kSubN_>;
  using T = T_;
  using TC = uint8_t;
  // The products run in fp16 whatever q's type: an e4m3 pair becomes an fp16 pair in one
  // instruction, a bf16 pair in four (through fp16 and fp32), and the conversions were most of
  // the FP8 kernel's instructions. A bf16 Q tile is converted once (q_slice_to_fp16).
  using TM = __half;
  static constexpr bool kFp8 = true;
  static constexpr bool kQToHalf = !std::is_same<T_, __half>::value;
  // Pages smaller than a step come in by bulk copies of d bytes per row, as for 16-bit caches
  // (bulk_key_block), where a row is 128 bytes or more: cp.async's per-copy page lookups held
  // pages of 16 to 0.60-0.75 of the dense FP8 cache's time at d = 128, while 64-byte rows copied
  // one by one were slower than cp.async's (OPTIMIZATION.md step 49).
  static constexpr bool kBulkEligible = kHeadDim_ >= 128 && kSubN_ == 16;  // (the rung's steps: no bulk copies)
  static constexpr int kPitchC = Sizes::kPitchC;
  // Boxes at every head dim whose padded line a box spans (d = 64, 128): e4m3 rows are short;
  // bulk copies at d = 256.
  static constexpr bool kBoxable = kPitchC <= 256;
  static constexpr bool kPageBoxes = kBoxable;
  static constexpr bool kBulkPages = kBulkEligible;
  static constexpr int kChunkElems = 16;
  static constexpr size_t kStageBytes = Sizes::kStageBytes;
  struct Storage {
    T q[Base::kRows * Base::kPitch];
    union {
      uint8_t kv[Base::kStages][2][Base::kBlockN * kPitchC];  // e4m3: a step's K, then its V
      struct {
        float o[Base::kWarpsN][Base::kRows * Base::kMergePitch];
        float stats[Base::kWarpsN][Base::kRows][2];
      } merge;
    };
    uint64_t full[Base::kStages];  // the bulk variant's per-stage barriers
    float q_unscale[Base::kWarpsM];  // each Q slice's 2^-e (q_slice_to_fp16)
  };
  static constexpr size_t kSmemBytes = sizeof(Storage);
  static_assert(kHeadDim_ % 32 == 0, "pairs of 16-byte chunks of e4m3 per row");
};

// The decode config per GPU class (arch/gpu_class.h): Full where the device's opt-in shared memory
// holds it, else Compact, which fits every class. Compact is Full wherever Full fits 99 KiB, so
// the instances of those head dims hold one kernel per row count.
// Between the two, the full tiles with one stage fewer where that fits 99 KiB (d = 256's 64-row
// tile: four stages and their mbarriers pass it by 32 bytes).
template <typename T, int kHeadDim, int kWarpsM>
struct ShallowConfig : Tile<T, kHeadDim, kWarpsM, std::max(2, kFullStages<T, kHeadDim, kWarpsM> - 1)> {};
template <typename T, int kHeadDim, int kWarpsM>
struct ConfigPolicy {
  using Full = Config<T, kHeadDim, kWarpsM>;
  using Shallow = ShallowConfig<T, kHeadDim, kWarpsM>;
  using Compact = std::conditional_t<
      Full::kSmemBytes <= kSmemConsumer, Full,
      std::conditional_t<(Shallow::kStages < Full::kStages && Shallow::kSmemBytes <= kSmemConsumer), Shallow,
                         HalfStepConfig<T, kHeadDim, kWarpsM>>>;
};
// FP8 caches: one config for every class (a device whose shared memory does not hold it has no
// FP8 decode at that head dim: with_decode_config). At d = 64 a warp takes 32 keys per step on
// sm_90: an e4m3 row is 64 bytes, and 16 keys per warp left as many steps (and barriers) per byte
// of cache as a 16-bit cache of half the head dim. Elsewhere 16 (not measured there, and sm_120's
// ptxas spills the 32-key tile of one row warp); at d = 128 the 32-key tile spills, so it keeps 16.
// Ablation rung (FLASH_CUDA_ABLATIONS, FLASH_CUDA_DECODE_FP8_SUBN=16): 16 keys per warp on sm_90.
template <typename T, int kHeadDim, int kWarpsM, int kSubN = kHeadDim == 64 ? 32 : 16>
struct Fp8ConfigPolicy {
  using Full = Fp8Config<T, kHeadDim, kWarpsM, kSubN>;
  using Compact = Full;
};

// Ablation rung (FLASH_CUDA_ABLATIONS, FLASH_CUDA_DECODE_WARP_ROWS=0 / 1; with_decode_config):
// 16-bit caches with the CTA-wide wait per step at every head dim (CtaRows), or each warp copying
// its own keys' rows at every head dim (WarpRows).
template <typename Cfg>
struct WarpRows : Cfg {
  static constexpr bool kWarpRows = true;
};
template <typename Cfg>
struct CtaRows : Cfg {
  static constexpr bool kWarpRows = false;
};
template <template <typename> class Rows, typename T, int kHeadDim, int kWarpsM>
struct RowsPolicy {
  using Full = Rows<typename ConfigPolicy<T, kHeadDim, kWarpsM>::Full>;
  using Compact = Rows<typename ConfigPolicy<T, kHeadDim, kWarpsM>::Compact>;
};

// A policy per row count: Family::At<kWarpsM> for 1, 2 or 4 16-row slices (with_decode_config
// picks the slice count once for every family).
template <typename T, int kHeadDim>
struct Policies {
  template <int kWarpsM>
  using At = ConfigPolicy<T, kHeadDim, kWarpsM>;
};
template <template <typename> class Rows, typename T, int kHeadDim>
struct RowsPolicies {
  template <int kWarpsM>
  using At = RowsPolicy<Rows, T, kHeadDim, kWarpsM>;
};
template <typename T, int kHeadDim, int... kSubN>  // (none: Fp8ConfigPolicy's keys per warp)
struct Fp8Policies {
  template <int kWarpsM>
  using At = Fp8ConfigPolicy<T, kHeadDim, kWarpsM, kSubN...>;
};

template <typename T, int kHeadDim, int kWarpsM>
constexpr bool kFitsEveryClass = ConfigPolicy<T, kHeadDim, kWarpsM>::Compact::kSmemBytes <= kSmemConsumer &&
                                 ConfigPolicy<T, kHeadDim, kWarpsM>::Full::kSmemBytes <= kSmemA100;
template <typename T, int kHeadDim>
constexpr bool kBucketFits =
    kFitsEveryClass<T, kHeadDim, 1> && kFitsEveryClass<T, kHeadDim, 2> && kFitsEveryClass<T, kHeadDim, 4>;
// The 99 KiB class has a decode config at every head-dim bucket and row count; the A100 and
// Hopper classes run the full tiles everywhere.
static_assert(kBucketFits<__half, 64> && kBucketFits<__half, 128> && kBucketFits<__half, 256>,
              "every head dim has a decode configuration for each GPU class");

// The decode tile config for Sq * decode_heads rows: the fewest 16-row slices that hold them (up
// to 4; more rows take several chunks of 64).
inline int warps_m_for(int rows) { return rows <= 16 ? 1 : rows <= 32 ? 2 : 4; }

// The new rows [r0, r1) of k_new / v_new into the cache at positions len + r, 16 bytes a thread.
template <typename Cfg>
__device__ __forceinline__ void append_new_rows(const FwdParams& p, const CacheSeq& seq, int bi, int h_kv, int r0,
                                                int r1) {
  using T = typename Cfg::T;
  constexpr int kChunks = Cfg::kHeadDim / 8;
  const int chunks = p.d / 8;
  for (int idx = threadIdx.x; idx < (r1 - r0) * kChunks; idx += Cfg::kThreads) {
    const int r = r0 + idx / kChunks, c = (idx % kChunks) * 8;
    if (c >= chunks * 8) continue;
    const int pos = seq.len + r;
    const T* kn = static_cast<const T*>(p.k_new) + bi * p.knew_batch_stride + h_kv * p.knew_head_stride +
                  r * p.knew_row_stride + c;
    const T* vn = static_cast<const T*>(p.v_new) + bi * p.vnew_batch_stride + h_kv * p.vnew_head_stride +
                  r * p.vnew_row_stride + c;
    T* kc = cache_row(p, static_cast<T*>(const_cast<void*>(p.k)), p.k_batch_stride, p.k_head_stride, p.k_row_stride,
                      bi, h_kv, pos) + c;
    T* vc = cache_row(p, static_cast<T*>(const_cast<void*>(p.v)), p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                      bi, h_kv, pos) + c;
    *reinterpret_cast<uint4*>(kc) = *reinterpret_cast<const uint4*>(kn);
    *reinterpret_cast<uint4*>(vc) = *reinterpret_cast<const uint4*>(vn);
  }
}

// Where this thread's copies of a step start: its 16-byte column chunk c of key rows r_first,
// r_first + kRowsPerPass, ... (kRowsPerPass = threads / chunks per row, at most a step: an FP8
// step of 16 keys at d = 64 is 64 copies, and threads from r_first = kBlockN on copy nothing).
template <typename Cfg>
struct KeyCopier {
  static constexpr int kChunks = Cfg::kHeadDim / Cfg::kChunkElems;
  // Warp-owned rows (Cfg::kWarpRows, one 16-row slice, whole steps): warp w copies the kSubN rows
  // of each step that its own products read, so the key loop's wait for a step needs no other
  // warp (decode_block: __syncwarp after the first step).
  static constexpr int kWarpRowsPerPass = 32 / kChunks;
  static constexpr bool kOwned = Cfg::kWarpRows && Cfg::kWarpsM == 1 && !Cfg::kHalfSteps && 32 % kChunks == 0 &&
                                 Cfg::kSubN % kWarpRowsPerPass == 0;
  static constexpr int kRowsPerPass = kOwned ? kWarpRowsPerPass : std::min(Cfg::kThreads / kChunks, Cfg::kBlockN);
  static constexpr int kPasses = kOwned ? Cfg::kSubN / kRowsPerPass : Cfg::kBlockN / kRowsPerPass;
  static_assert(Cfg::kThreads % kChunks == 0 && Cfg::kBlockN % kRowsPerPass == 0, "whole rows, whole passes");
  int r_first, c;
  bool col_valid;
  __device__ __forceinline__ static KeyCopier make(const FwdParams& p) {
    KeyCopier k;
    k.r_first = kOwned ? (threadIdx.x / 32) * Cfg::kSubN + (threadIdx.x % 32) / kChunks : threadIdx.x / kChunks;
    k.c = (threadIdx.x % kChunks) * Cfg::kChunkElems;
    k.col_valid = k.c < p.d;
    return k;
  }
};

// FP8 caches: 16 values of T (two 16-byte words at src) as 16 e4m3 values e4m3(x / descale).
template <typename T>
__device__ __forceinline__ uint4 quantize16(const T* src, float descale) {
  const uint4 w[2] = {*reinterpret_cast<const uint4*>(src), *reinterpret_cast<const uint4*>(src + 8)};
  const T* x = reinterpret_cast<const T*>(w);
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = f32x2_to_e4m3x2(__fdiv_rn(to_float(x[4 * i]), descale),
                                        __fdiv_rn(to_float(x[4 * i + 1]), descale));
    const uint16_t hi = f32x2_to_e4m3x2(__fdiv_rn(to_float(x[4 * i + 2]), descale),
                                        __fdiv_rn(to_float(x[4 * i + 3]), descale));
    out[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Keys [n0, n0 + kBlockN) of KV head h_kv into a stage: cached positions from the cache, new ones
// from k_new / v_new, positions past the sequence (and columns past d) as zeros. Steps wholly
// inside the cached tokens (all but the last) take the short paths: one pointer per step for a
// dense cache and for pages that hold whole steps, else each row's page id, all read before the
// first copy. kK / kV: which of the two to copy (the half-step loop copies them apart). An FP8
// ring (Cfg::kFp8) takes the cache's e4m3 bytes by the same copies, and its new rows quantized
// as the append stores them (quantize16), so that every CTA attends the values the cache will
// hold; the descales serve only those.
template <typename Cfg, bool kK = true, bool kV = true>
__device__ __forceinline__ void load_key_block(const FwdParams& p, const CacheSeq& seq, const KeyCopier<Cfg>& cp,
                                               int bi, int h_kv, int n0, typename Cfg::TC* sK, typename Cfg::TC* sV,
                                               float k_descale = 1.f, float v_descale = 1.f) {
  using T = typename Cfg::T;
  using TC = typename Cfg::TC;
  using Copier = KeyCopier<Cfg>;
  const TC* k = static_cast<const TC*>(p.k);
  const TC* v = static_cast<const TC*>(p.v);
  if (Cfg::kThreads / Copier::kChunks > Cfg::kBlockN && cp.r_first >= Cfg::kBlockN) return;  // (no rows left)
  TC* sk = sK + cp.r_first * Cfg::kPitchC + cp.c;
  TC* sv = sV + cp.r_first * Cfg::kPitchC + cp.c;
  const bool cached = n0 + Cfg::kBlockN <= seq.len;
  const bool whole_pages = p.block_table == nullptr || p.page_size % Cfg::kBlockN == 0;
  if (cached && whole_pages && cp.col_valid) {
    // One base for the step: rows r_first + pass * kRowsPerPass are equally spaced from it.
    int64_t kb, vb;
    const int row0 = n0 + cp.r_first;
    if (p.block_table == nullptr) {  // (dense rows; a packed batch's from its first row)
      const int64_t row = row0 + seq.k_start;
      kb = bi * p.k_batch_stride + row * p.k_row_stride;
      vb = bi * p.v_batch_stride + row * p.v_row_stride;
    } else {
      const int page = cache_page(p, bi, n0);
      const int row = row0 % p.page_size;
      kb = page * p.k_batch_stride + static_cast<int64_t>(row) * p.k_row_stride;
      vb = page * p.v_batch_stride + static_cast<int64_t>(row) * p.v_row_stride;
    }
    const TC* ks = k + kb + h_kv * p.k_head_stride + cp.c;
    const TC* vs = v + vb + h_kv * p.v_head_stride + cp.c;
#pragma unroll
    for (int pass = 0; pass < Copier::kPasses; ++pass) {
      const int r = pass * Copier::kRowsPerPass;
      if constexpr (kK) cp_async_16_stream<Cfg::kPrefetch>(sk + r * Cfg::kPitchC, ks + r * p.k_row_stride, true);
      if constexpr (kV) cp_async_16_stream<Cfg::kPrefetch>(sv + r * Cfg::kPitchC, vs + r * p.v_row_stride, true);
    }
    return;
  }
  if (cached && cp.col_valid) {
    // Pages smaller than a step: every page id this thread's rows need is read before the first
    // copy is issued, so the lookups' latencies overlap (read per copy, each copy waited for its
    // own: the copies are asm with a memory clobber, which no load may cross); clamped as
    // cache_page does, once all are read (the code measured).
    int page[Copier::kPasses];
#pragma unroll
    for (int pass = 0; pass < Copier::kPasses; ++pass) {
      const int pos = n0 + cp.r_first + pass * Copier::kRowsPerPass + seq.k_start;
      page[pass] = p.block_table[bi * p.block_table_stride + pos / p.page_size];
    }
    const TC* ks = k + h_kv * p.k_head_stride + cp.c;
    const TC* vs = v + h_kv * p.v_head_stride + cp.c;
#pragma unroll
    for (int pass = 0; pass < Copier::kPasses; ++pass) {
      const int pos = n0 + cp.r_first + pass * Copier::kRowsPerPass + seq.k_start;
      const int64_t pg = min(max(page[pass], 0), p.num_pages - 1);
      const int64_t row = pos % p.page_size;
      const int r = pass * Copier::kRowsPerPass;
      if constexpr (kK) {
        cp_async_16_stream<Cfg::kPrefetch>(sk + r * Cfg::kPitchC, ks + pg * p.k_batch_stride + row * p.k_row_stride,
                                           true);
      }
      if constexpr (kV) {
        cp_async_16_stream<Cfg::kPrefetch>(sv + r * Cfg::kPitchC, vs + pg * p.v_batch_stride + row * p.v_row_stride,
                                           true);
      }
    }
    return;
  }
#pragma unroll
  for (int pass = 0; pass < Copier::kPasses; ++pass) {
    const int pos = n0 + cp.r_first + pass * Copier::kRowsPerPass;
    const TC* ksrc = k;
    const TC* vsrc = v;
    const bool valid = cp.col_valid && pos < seq.total;
    if (valid) {
      if (pos < seq.len) {
        const int row = pos + seq.k_start;
        ksrc = cache_row(p, k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, bi, h_kv, row) + cp.c;
        vsrc = cache_row(p, v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, bi, h_kv, row) + cp.c;
      } else {
        const int r_new = pos - seq.len;
        const T* kn = static_cast<const T*>(p.k_new) + bi * p.knew_batch_stride + h_kv * p.knew_head_stride +
                      r_new * p.knew_row_stride + cp.c;
        const T* vn = static_cast<const T*>(p.v_new) + bi * p.vnew_batch_stride + h_kv * p.vnew_head_stride +
                      r_new * p.vnew_row_stride + cp.c;
        if constexpr (Cfg::kFp8) {
          const int r = pass * Copier::kRowsPerPass * Cfg::kPitchC;
          if constexpr (kK) *reinterpret_cast<uint4*>(sk + r) = quantize16(kn, k_descale);
          if constexpr (kV) *reinterpret_cast<uint4*>(sv + r) = quantize16(vn, v_descale);
          continue;
        } else {
          ksrc = kn;
          vsrc = vn;
        }
      }
    }
    if constexpr (kK) cp_async_16_stream<Cfg::kPrefetch>(sk + pass * Copier::kRowsPerPass * Cfg::kPitchC, ksrc, valid);
    if constexpr (kV) cp_async_16_stream<Cfg::kPrefetch>(sv + pass * Copier::kRowsPerPass * Cfg::kPitchC, vsrc, valid);
  }
}

// The Hopper fill of a step wholly inside the cached tokens (and d == kHeadDim: the rows fill
// the padded lines up to their pad, as cp.async's zero-filled columns would): each of the step's
// K and V rows is one bulk copy of d elements (16-bit values, or e4m3 bytes for an FP8 ring) from
// its cache row (dense, paged or packed, looked up per row as cache_row does), all completing on
// the stage's mbarrier `full`, which announces the step's bytes once.
template <typename Cfg>
__device__ __forceinline__ void bulk_key_block(const FwdParams& p, const CacheSeq& seq, int bi, int h_kv, int n0,
                                               typename Cfg::TC* sK, typename Cfg::TC* sV, uint64_t* full) {
  using T = typename Cfg::TC;
  constexpr uint32_t kRowBytes = Cfg::kHeadDim * sizeof(T);
  static_assert(kRowBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  // Every warp issues an equal share of the rows: a bulk copy takes its addresses from uniform
  // registers, so a warp issues its lanes' copies one after another, and a step waits for the
  // largest share (with the rows of 32-key steps on warps 0-1 alone, Sq 4's steps streamed at
  // half the speed of Sq 1's).
  constexpr int kWarps = Cfg::kThreads / 32;
  constexpr int kRowsPerWarp = 2 * Cfg::kBlockN / kWarps;
  static_assert(2 * Cfg::kBlockN % kWarps == 0 && kRowsPerWarp <= 32, "whole shares of at most a warp");
  if (threadIdx.x == 0) sm90::mbarrier_arrive_expect_tx(full, 2 * Cfg::kBlockN * kRowBytes);
  const int lane = threadIdx.x % 32;
  if (lane < kRowsPerWarp) {
    const int i = threadIdx.x / 32 * kRowsPerWarp + lane;
    const bool is_v = i >= Cfg::kBlockN;
    const int r = is_v ? i - Cfg::kBlockN : i;
    const int row = n0 + r + seq.k_start;
    const T* src = is_v ? cache_row(p, static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride,
                                    p.v_row_stride, bi, h_kv, row)
                        : cache_row(p, static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride,
                                    p.k_row_stride, bi, h_kv, row);
    sm90::bulk_load((is_v ? sV : sK) + r * Cfg::kPitchC, src, kRowBytes, full);
  }
}

// The tensor maps of a paged cache's K and V pools (arch/tma.h: make_page_tensor_map), for
// box_key_block: boxes of kPitchC columns x kBoxRows rows of one page and KV head.
struct PageMaps {
  static constexpr int kBoxRows = 16;
  CUtensorMap k, v;
};

// The Hopper fill of a cached step from pages of a multiple of 16 rows smaller than the step
// (Cfg::kPageBoxes, launch_decode): each 16-row run of the step lies in one page and is one
// tensor-map box per K and V, landing as 16 whole padded lines of the ring (the columns past d
// as zeros), where bulk_key_block issues a copy per row. Lane 0 of warp w issues the runs w,
// w + 4, ...: kBlockN / 8 boxes a step, their page ids read in parallel. The stage's mbarrier
// `full` expects the boxes' bytes, pads included (TMA counts a box whole).
template <typename Cfg>
__device__ __forceinline__ void box_key_block(const FwdParams& p, const PageMaps& maps, int bi, int h_kv, int n0,
                                              typename Cfg::TC* sK, typename Cfg::TC* sV, uint64_t* full) {
  constexpr int kRuns = Cfg::kBlockN / PageMaps::kBoxRows;
  constexpr int kWarps = Cfg::kThreads / 32;
  constexpr uint32_t kBoxBytes = PageMaps::kBoxRows * Cfg::kPitchC * sizeof(typename Cfg::TC);
  static_assert(Cfg::kBlockN % PageMaps::kBoxRows == 0, "whole runs of 16 rows");
  static_assert(kBoxBytes % 128 == 0, "TMA boxes land on 128-byte boundaries");
  if (threadIdx.x == 0) sm90::mbarrier_arrive_expect_tx(full, 2 * kRuns * kBoxBytes);
  if (threadIdx.x % 32 != 0) return;
  for (int run = threadIdx.x / 32; run < kRuns; run += kWarps) {
    const int pos = n0 + run * PageMaps::kBoxRows;
    const int page = cache_page(p, bi, pos);
    const int row = pos % p.page_size;
    const int line = run * PageMaps::kBoxRows * Cfg::kPitchC;
    sm90::tma_load_4d(sK + line, &maps.k, full, 0, row, h_kv, page);
    sm90::tma_load_4d(sV + line, &maps.v, full, 0, row, h_kv, page);
  }
}

// FP8 caches with bf16 queries: one warp turns a 16-row slice of the Q tile (pitch kPitch) into
// fp16 in place, times 2^e, where e puts the slice's largest |q| in [2^14, 2^15): below fp16's
// largest value, and every bf16 value within 2^-28 of it exact (8 significant bits in 11). Returns
// 2^-e, which the scores' scale takes. e stays within +-100 (a slice of all zeros or non-finite
// values keeps e = 0: NaN and inf go on as they would in bf16).
template <typename Cfg>
__device__ __forceinline__ float q_slice_to_fp16(typename Cfg::T* sQ_slice) {
  constexpr int kChunks = 16 * Cfg::kHeadDim / 8;  // 8 values each
  static_assert(kChunks % 32 == 0, "whole chunks per lane");
  const int lane = threadIdx.x % 32;
  auto chunk = [&](int i) { return reinterpret_cast<uint4*>(sQ_slice + (i / (Cfg::kHeadDim / 8)) * Cfg::kPitch +
                                                            (i % (Cfg::kHeadDim / 8)) * 8); };
  float amax = 0.f;
#pragma unroll
  for (int i = lane; i < kChunks; i += 32) {
    const uint4 w = *chunk(i);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]));
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  int ex = 0;
  const bool finite_nonzero = amax > 0.f && amax <= 3.402823466e38f;
  if (finite_nonzero) frexpf(amax, &ex);  // amax < 2^ex
  const int e = finite_nonzero ? max(-100, min(100, 15 - ex)) : 0;
  const float up = __int_as_float((127 + e) << 23), down = __int_as_float((127 - e) << 23);
#pragma unroll
  for (int i = lane; i < kChunks; i += 32) {
    uint4 w = *chunk(i);
    uint32_t* words = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[j]));
      const __half2 h = __floats2half2_rn(f.x * up, f.y * up);
      words[j] = *reinterpret_cast<const uint32_t*>(&h);
    }
    *chunk(i) = w;
  }
  __syncwarp();
  return down;
}

// The FP8 append: the new rows [r0, r1) quantized into the cache (e4m3 with the sequence's KV
// head's descales), 16 values a thread.
template <typename Cfg>
__device__ __forceinline__ void append_new_rows_fp8(const FwdParams& p, const CacheSeq& seq, int bi, int h_kv, int r0,
                                                    int r1, float k_descale, float v_descale) {
  using T = typename Cfg::T;
  constexpr int kChunks = Cfg::kHeadDim / 16;
  for (int idx = threadIdx.x; idx < (r1 - r0) * kChunks; idx += Cfg::kThreads) {
    const int r = r0 + idx / kChunks, c = (idx % kChunks) * 16;
    if (c >= p.d) continue;
    const int pos = seq.len + r;
    const T* kn = static_cast<const T*>(p.k_new) + bi * p.knew_batch_stride + h_kv * p.knew_head_stride +
                  r * p.knew_row_stride + c;
    const T* vn = static_cast<const T*>(p.v_new) + bi * p.vnew_batch_stride + h_kv * p.vnew_head_stride +
                  r * p.vnew_row_stride + c;
    uint8_t* kc = cache_row(p, static_cast<uint8_t*>(const_cast<void*>(p.k)), p.k_batch_stride, p.k_head_stride,
                            p.k_row_stride, bi, h_kv, pos) + c;
    uint8_t* vc = cache_row(p, static_cast<uint8_t*>(const_cast<void*>(p.v)), p.v_batch_stride, p.v_head_stride,
                            p.v_row_stride, bi, h_kv, pos) + c;
    *reinterpret_cast<uint4*>(kc) = quantize16(kn, k_descale);
    *reinterpret_cast<uint4*>(vc) = quantize16(vn, v_descale);
  }
}

// Tile rows counted in packed rows R: R holds query R / heads (of head h0 + R % heads).
struct PackedRows {
  int heads;
  __device__ __forceinline__ int query(int row) const { return row / heads; }
};

// Step 1: S = Q K^T for this warp's 16 rows and its 16 keys of the step, modifiers and mask,
// and the rows' block maxima (log2 units).
template <typename Cfg>
__device__ __forceinline__ void compute_qk_scores_and_max(float (&s)[1][Cfg::kSubN / 8][4], float (&block_max)[1][2],
                                                          const typename Cfg::TM* sQ_warp,
                                                          const uint32_t (&q_frags)[Cfg::kQFrags][4],
                                                          const typename Cfg::TC* sK_warp, bool needs_mask,
                                                          int row_base, int key_base, const AttnMask& mask,
                                                          const ScoreMod& mod, float scale_log2,
                                                          const PackedRows& rows) {
  zero_fill(s);
  if constexpr (Cfg::kFp8) {
    if constexpr (Cfg::kQInRegs) {
      gemm_frags_by_e4m3_rows_t<typename Cfg::TM, Cfg::kHeadDim, Cfg::kSubN, Cfg::kPitchC>(s, q_frags, sK_warp);
    } else {
      gemm_rows_by_e4m3_rows_t<typename Cfg::TM, Cfg::kHeadDim, Cfg::kSubN, Cfg::kPitch, Cfg::kPitchC>(s, sQ_warp,
                                                                                                     sK_warp);
    }
  } else if constexpr (Cfg::kQInRegs) {
    gemm_frags_by_rows_t<typename Cfg::T, Cfg::kHeadDim, Cfg::kSubN, Cfg::kPitch>(s, q_frags, sK_warp);
  } else {
    gemm_rows_by_rows_t<typename Cfg::T, 1, Cfg::kHeadDim, Cfg::kSubN, Cfg::kPitch>(s, sQ_warp, sK_warp);
  }
  modify_and_mask(s, needs_mask, row_base, key_base, mask, mod, scale_log2, rows);
  block_row_max(s, block_max, mod.exp_scale(scale_log2));
}

// Step 3: P = exp2(S - m), l += rowsum(P), O += P V for the warp's 16 keys.
template <typename Cfg>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(float (&s)[1][Cfg::kSubN / 8][4],
                                                                    RowStats<1>& stats,
                                                                    float (&acc_o)[1][Cfg::kHeadDim / 8][4],
                                                                    const typename Cfg::TC* sV_warp,
                                                                    float exp_scale) {
  exponentiate_block<typename Cfg::TM>(s, stats, exp_scale);
  if constexpr (Cfg::kFp8) {
    gemm_regs_by_e4m3_rows<typename Cfg::TM, Cfg::kSubN, Cfg::kHeadDim, Cfg::kPitchC>(acc_o, s, sV_warp);
  } else {
    gemm_regs_by_rows<typename Cfg::T, 1, Cfg::kSubN, Cfg::kHeadDim, Cfg::kPitch>(acc_o, s, sV_warp);
  }
}

// Row r's statistics merged over the warps of its slice, from their (m, l) pairs in shared memory:
// the largest m, each warp's weight 2^(m_w - m) (0 for a warp that saw no key) and l.
template <typename Cfg>
__device__ __forceinline__ void merge_warp_stats(const float* sStats, int r, float& m, float& l,
                                                 float (&weight)[Cfg::kWarpsN]) {
  m = -INFINITY;
#pragma unroll
  for (int w = 0; w < Cfg::kWarpsN; ++w) m = fmaxf(m, sStats[(w * Cfg::kRows + r) * 2]);
  l = 0.f;
#pragma unroll
  for (int w = 0; w < Cfg::kWarpsN; ++w) {
    const float mw = sStats[(w * Cfg::kRows + r) * 2], lw = sStats[(w * Cfg::kRows + r) * 2 + 1];
    weight[w] = lw == 0.f ? 0.f : ex2_approx(mw - safe_max(m));
    l += lw * weight[w];
  }
}

// Step 4, after the warps of a slice left their (m, l) and O rows in shared memory: the rows'
// merged statistics, then O / l and lse into the output (one range; the sink merged in), or the
// range's normalized O and (m, log2 l) into the split workspace.
template <typename Cfg>
__device__ __forceinline__ void normalize_output(const FwdParams& p, const CacheSeq& seq, const float* sO,
                                                 const float* sStats, int bi, int h0, int r0, int rows_valid,
                                                 int split, float v_descale) {
  using T = typename Cfg::T;
  constexpr int kRowStride = Cfg::kMergePitch;
  constexpr int kSliceFloats = Cfg::kRows * kRowStride;
  const int heads = p.decode_heads;
  const int64_t all_rows = decode_stat_rows(p);
  // A warp per row, its lanes over the 4-column chunks.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows_valid; r += Cfg::kThreads / 32) {
    float m, l, weight[Cfg::kWarpsN];
    merge_warp_stats<Cfg>(sStats, r, m, l, weight);
    const int R = r0 + r, i = R / heads, h = h0 + R % heads;
    const int64_t row = seq.stat_row(p, bi, h, i);
    const bool split_out = p.num_splits > 1;
    // The head's sink joins a whole range's statistics here; a split's range leaves it to the
    // merge of the splits (core/combine.cuh: combine_key_splits_kernel), which adds it once.
    float o_scale = 1.f;
    if (p.sinks != nullptr && !split_out) o_scale = merge_sink(m, l, sink_log2_of(p.sinks, h));
    float inv = l == 0.f ? 0.f : o_scale / l;
    if constexpr (Cfg::kFp8) inv *= v_descale;  // (the values' descale, as the specification applies it)
    T* o = static_cast<T*>(p.o) + bi * p.o_batch_stride + h * p.o_head_stride +
           static_cast<int64_t>(seq.q_start + i) * p.o_row_stride;
    float* o_piece = p.o_accum + (split * all_rows + row) * p.d;
    for (int c = 4 * lane; c < p.d; c += 128) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < Cfg::kWarpsN; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(sO + w * kSliceFloats + r * kRowStride + c);
        acc.x = fmaf(weight[w], x.x, acc.x);
        acc.y = fmaf(weight[w], x.y, acc.y);
        acc.z = fmaf(weight[w], x.z, acc.z);
        acc.w = fmaf(weight[w], x.w, acc.w);
      }
      acc = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      if (split_out) {
        *reinterpret_cast<float4*>(o_piece + c) = acc;
      } else {
        store4(o + c, acc);
      }
    }
    if (lane == 0) {
      if (split_out) {
        // (m, log2 l) as store_row_stats writes pairs: (+inf, 0) for a range that saw no key.
        reinterpret_cast<float2*>(p.stats_accum)[split * all_rows + row] =
            l == 0.f ? make_float2(INFINITY, 0.f) : make_float2(m, log2f(l));
      } else if (p.softmax_lse != nullptr) {  // (KV-cache calls that do not return it pass none)
        p.softmax_lse[row] = l == 0.f ? -INFINITY : (m + log2f(l)) * 0.69314718055994531f;
      }
    }
  }
}

// Ablation rung FLASH_CUDA_DECODE_MERGE=cluster (launch_decode): the num_splits CTAs of a row
// chunk are one thread-block cluster, and its rank 0 merges their ranges through distributed
// shared memory, instead of the split workspace and the merge kernel. Each CTA first folds its
// warps' (m, l, O) into slice 0 of its merge area (O relative to the range's m, unnormalized);
// after the cluster barrier rank 0 weighs every range's rows as combine_key_splits_kernel does
// and writes O and lse; the second barrier keeps every CTA's shared memory until it has read.
constexpr int kMaxClusterSplits = 8;  // (the portable cluster size)

template <typename Cfg>
__device__ __forceinline__ void cluster_merge_output(const FwdParams& p, const CacheSeq& seq, float* sO,
                                                     float* sStats, int bi, int h0, int r0, int rows_valid,
                                                     float v_descale) {
  using T = typename Cfg::T;
  constexpr int kRowStride = Cfg::kMergePitch;
  constexpr int kSliceFloats = Cfg::kRows * kRowStride;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows_valid; r += Cfg::kThreads / 32) {
    float m, l, weight[Cfg::kWarpsN];
    merge_warp_stats<Cfg>(sStats, r, m, l, weight);
    for (int c = 4 * lane; c < p.d; c += 128) {  // (slice 0's chunk c is read by this lane alone)
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < Cfg::kWarpsN; ++w) {
        const float4 x = *reinterpret_cast<const float4*>(sO + w * kSliceFloats + r * kRowStride + c);
        acc = make_float4(fmaf(weight[w], x.x, acc.x), fmaf(weight[w], x.y, acc.y), fmaf(weight[w], x.z, acc.z),
                          fmaf(weight[w], x.w, acc.w));
      }
      *reinterpret_cast<float4*>(sO + r * kRowStride + c) = acc;
    }
    __syncwarp();  // every lane has read slot 0's (m, l) of row r
    if (lane == 0) *reinterpret_cast<float2*>(sStats + r * 2) = make_float2(m, l);
  }
  __syncthreads();
  sm90::cluster_sync();
  if (sm90::cluster_ctarank() == 0) {
    const int heads = p.decode_heads, splits = p.num_splits;
    for (int r = warp; r < rows_valid; r += Cfg::kThreads / 32) {
      float ms[kMaxClusterSplits], ls[kMaxClusterSplits];
      float m = -INFINITY;
#pragma unroll
      for (int s = 0; s < kMaxClusterSplits; ++s) {
        const float2 st = s < splits ? sm90::cluster_load2(sm90::cluster_address(sStats + r * 2, s))
                                     : make_float2(-INFINITY, 0.f);
        ms[s] = st.x;
        ls[s] = st.y;
        m = fmaxf(m, st.x);
      }
      float l = 0.f;
#pragma unroll
      for (int s = 0; s < kMaxClusterSplits; ++s) {
        ms[s] = ls[s] == 0.f ? 0.f : ex2_approx(ms[s] - safe_max(m));  // (now the range's weight)
        l += ls[s] * ms[s];
      }
      const int R = r0 + r, i = R / heads, h = h0 + R % heads;
      float o_scale = 1.f;
      if (p.sinks != nullptr) o_scale = merge_sink(m, l, sink_log2_of(p.sinks, h));
      float inv = l == 0.f ? 0.f : o_scale / l;
      if constexpr (Cfg::kFp8) inv *= v_descale;
      T* o = static_cast<T*>(p.o) + bi * p.o_batch_stride + h * p.o_head_stride +
             static_cast<int64_t>(seq.q_start + i) * p.o_row_stride;
      for (int c = 4 * lane; c < p.d; c += 128) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s = 0; s < kMaxClusterSplits; ++s) {
          if (s < splits && ms[s] != 0.f) {
            const float4 x = sm90::cluster_load4(sm90::cluster_address(sO + r * kRowStride + c, s));
            acc = make_float4(fmaf(ms[s], x.x, acc.x), fmaf(ms[s], x.y, acc.y), fmaf(ms[s], x.z, acc.z),
                              fmaf(ms[s], x.w, acc.w));
          }
        }
        store4(o + c, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
      }
      if (lane == 0 && p.softmax_lse != nullptr) {
        p.softmax_lse[seq.stat_row(p, bi, h, i)] = l == 0.f ? -INFINITY : (m + log2f(l)) * 0.69314718055994531f;
      }
    }
  }
  sm90::cluster_sync();
}

// One CTA of the decode grid: (row chunks * num_splits, hq / decode_heads, b). kBulk: cached steps
// by bulk copies (Cfg::kBulkEligible, pages smaller than a step, d == kHeadDim: launch_decode);
// kBoxes: by tensor-map boxes of `maps` (Cfg::kPageBoxes, pages of a multiple of 16 rows).
template <typename Cfg, bool kBulk, bool kBoxes = false, bool kClusterMerge = false>
__device__ __forceinline__ void decode_block(const FwdParams& p, const PageMaps* maps = nullptr) {
  using T = typename Cfg::T;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::Storage*>(smem_raw);
  // Stages are addressed as offsets from the first (tiers/wgmma/bwd.cuh says why).
  T* sQ = smem.q;
  typename Cfg::TC* sKV = smem.kv[0][0];
  constexpr int kStageElems = 2 * Cfg::kBlockN * Cfg::kPitchC;
  // The first stage's K and V halves, which the half-step loop refills apart.
  [[maybe_unused]] typename Cfg::TC* const sK = sKV;
  [[maybe_unused]] typename Cfg::TC* const sV = sKV + Cfg::kBlockN * Cfg::kPitchC;

  const int split = blockIdx.x % p.num_splits, chunk = blockIdx.x / p.num_splits;
  const int heads = p.decode_heads;
  const int h0 = blockIdx.y * heads, bi = blockIdx.z;
  const int group = p.hq / p.hkv;
  const int h_kv = h0 / group;
  const CacheSeq seq = CacheSeq::make(p, bi);
  // An FP8 cache's descales for this KV head: the keys' one joins the scores' scale, the values'
  // one the output's normalization.
  float k_descale = 1.f, v_descale = 1.f;
  // A bf16 Q tile's conversion to fp16 scales this warp's slice by 2^e (q_slice_to_fp16); the
  // scores' scale takes 2^-e back.
  float q_unscale = 1.f;
  if constexpr (Cfg::kFp8) {
    k_descale = p.k_descale[bi * p.hkv + h_kv];
    v_descale = p.v_descale[bi * p.hkv + h_kv];
  }
  // (read where it is used, as the 16-bit kernels always read p.scale_log2)
  auto scale_log2 = [&] {
    if constexpr (Cfg::kFp8) {
      return p.scale_log2 * k_descale * q_unscale;
    } else {
      return p.scale_log2;
    }
  };

  // The new rows go into the cache first: split s of row chunk 0 of the group's first tile
  // writes its share; every CTA reads new positions from k_new / v_new, never from the cache.
  if (p.s_new > 0 && chunk == 0 && h0 % group == 0) {
    const int a0 = static_cast<int>(int64_t(p.s_new) * split / p.num_splits);
    const int a1 = static_cast<int>(int64_t(p.s_new) * (split + 1) / p.num_splits);
    if constexpr (Cfg::kFp8) {
      append_new_rows_fp8<Cfg>(p, seq, bi, h_kv, a0, a1, k_descale, v_descale);
    } else {
      append_new_rows<Cfg>(p, seq, bi, h_kv, a0, a1);
    }
  }

  const int r0 = chunk * Cfg::kRows;
  const int rows_valid = min(Cfg::kRows, seq.sq * heads - r0);
  if (rows_valid <= 0) return;  // a packed batch's shorter sequence: no rows in this chunk
  const AttnMask mask = AttnMask::make(seq.sq, seq.total, p.window_left, p.window_right);
  const int q_lo = r0 / heads, q_hi = (r0 + rows_valid - 1) / heads + 1;
  const BlockRange all = BlockRange::keys_of(mask, q_lo, q_hi, Cfg::kBlockN);
  const int count = all.count();
  const int nb_begin = all.begin + static_cast<int>(int64_t(count) * split / p.num_splits);
  const int nb_end = all.begin + static_cast<int>(int64_t(count) * (split + 1) / p.num_splits);

  // Q: tile row R = r0 + r is query R / heads of head h0 + R % heads.
  {
    constexpr int kChunks = Cfg::kHeadDim / 8;
    const T* q = static_cast<const T*>(p.q);
    for (int idx = threadIdx.x; idx < Cfg::kRows * kChunks; idx += Cfg::kThreads) {
      const int r = idx / kChunks, c = (idx % kChunks) * 8;
      const int R = r0 + r;
      const bool valid = r < rows_valid && c < p.d;
      const T* src = valid ? q + bi * p.q_batch_stride + (h0 + R % heads) * p.q_head_stride +
                                 static_cast<int64_t>(seq.q_start + R / heads) * p.q_row_stride + c
                           : q;
      cp_async_16(sQ + r * Cfg::kPitch + c, src, valid);
    }
    // A Q tile converted to fp16 (q_slice_to_fp16) lands in a group of its own, before the
    // steps, so that it is converted while they are still in flight; else it lands with step 0.
    if constexpr (Cfg::kQToHalf) cp_async_commit();
  }
  const KeyCopier<Cfg> copier = KeyCopier<Cfg>::make(p);
  // Which steps the bulk copies fill (kBulk): the steps wholly inside the cached tokens. They are
  // a prefix of [nb_begin, nb_end), so the k-th fill of a stage completes its barrier's phase k
  // and step nb waits on parity ((nb - nb_begin) / kStages) % 2.
  auto is_bulk = [&](int nb) { return (kBulk || kBoxes) && (nb + 1) * Cfg::kBlockN <= seq.len; };
  if constexpr (kBulk || kBoxes) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < Cfg::kStages; ++s) sm90::mbarrier_init(&smem.full[s], 1);
      sm90::fence_barrier_init();
    }
    __syncthreads();
  }
  auto load = [&](int nb) {
    auto* stage = sKV + (nb % Cfg::kStages) * kStageElems;
    if constexpr (kBoxes) {
      if (is_bulk(nb)) {
        box_key_block<Cfg>(p, *maps, bi, h_kv, nb * Cfg::kBlockN, stage, stage + Cfg::kBlockN * Cfg::kPitchC,
                           &smem.full[nb % Cfg::kStages]);
        return;
      }
    } else if constexpr (kBulk) {
      if (is_bulk(nb)) {
        bulk_key_block<Cfg>(p, seq, bi, h_kv, nb * Cfg::kBlockN, stage, stage + Cfg::kBlockN * Cfg::kPitchC,
                            &smem.full[nb % Cfg::kStages]);
        return;
      }
    }
    load_key_block<Cfg>(p, seq, copier, bi, h_kv, nb * Cfg::kBlockN, stage, stage + Cfg::kBlockN * Cfg::kPitchC,
                        k_descale, v_descale);
  };
  // Prologue: Q with the first step, then kStages - 2 more steps in flight (the half-step loop:
  // Q with the first step's K).
  if constexpr (Cfg::kHalfSteps) {
    if (nb_begin < nb_end) {
      load_key_block<Cfg, true, false>(p, seq, copier, bi, h_kv, nb_begin * Cfg::kBlockN, sK, sV);
    }
    cp_async_commit();
  } else {
#pragma unroll
    for (int i = 0; i < Cfg::kStages - 1; ++i) {
      if (nb_begin + i < nb_end) load(nb_begin + i);
      cp_async_commit();
    }
  }

  const int warp = threadIdx.x / 32;
  const int wm = warp / Cfg::kWarpsN, wn = warp % Cfg::kWarpsN;
  const ScoreMod mod = ScoreMod::make(p, bi, h0, seq.total - seq.sq);
  float exp_scale = mod.exp_scale(scale_log2());
  const PackedRows rows{heads};
  const int row_base = r0 + wm * 16;  // packed rows of this warp's slice
  const int warp_q_lo = row_base / heads;
  const int warp_q_hi = min((row_base + 15) / heads + 1, seq.sq);
  const auto* sQ_warp = reinterpret_cast<const typename Cfg::TM*>(sQ + wm * 16 * Cfg::kPitch);

  float acc_o[1][Cfg::kHeadDim / 8][4];
  RowStats<1> stats;
  start_online_softmax(acc_o, stats);

  uint32_t q_frags[Cfg::kQFrags][4];
  // S = Q K^T of step nb for this warp's keys (the step's K rows at sK_step) and its row maxima,
  // merged into the running statistics. (The caller declares s and block_max: with block_max
  // declared here, ptxas numbered some registers differently.)
  auto scores_of_step = [&](int nb, const typename Cfg::TC* sK_step, float (&s)[1][Cfg::kSubN / 8][4],
                            float (&block_max)[1][2]) {
    const int key_base = nb * Cfg::kBlockN + wn * Cfg::kSubN;
    const bool needs_mask = mask.needs_mask(warp_q_lo, warp_q_hi, key_base, key_base + Cfg::kSubN);
    compute_qk_scores_and_max<Cfg>(s, block_max, sQ_warp, q_frags, sK_step + wn * Cfg::kSubN * Cfg::kPitchC,
                                   needs_mask, row_base, key_base, mask, mod, scale_log2(), rows);
    merge_block_stats(stats, block_max, acc_o);
  };
  if constexpr (Cfg::kHalfSteps) {
    // The one stage's K and V halves in turn (HalfStepConfig): each wait leaves nothing else in
    // flight, so a half is overwritten only after the barrier that follows every warp's last read.
    for (int nb = nb_begin; nb < nb_end; ++nb) {
      cp_async_wait<0>();
      __syncthreads();  // step nb's K landed for all; every warp is done with step nb - 1's V
      load_key_block<Cfg, false, true>(p, seq, copier, bi, h_kv, nb * Cfg::kBlockN, sK, sV);
      cp_async_commit();
      if constexpr (Cfg::kQInRegs) {
        if (nb == nb_begin) load_a_frags<Cfg::kHeadDim, Cfg::kPitch>(q_frags, sQ_warp);  // Q landed with K
      }
      float s[1][Cfg::kSubN / 8][4];
      float block_max[1][2];
      scores_of_step(nb, sK, s, block_max);
      cp_async_wait<0>();
      __syncthreads();  // step nb's V landed for all; every warp is done with its K
      if (nb + 1 < nb_end) {
        load_key_block<Cfg, true, false>(p, seq, copier, bi, h_kv, (nb + 1) * Cfg::kBlockN, sK, sV);
      }
      cp_async_commit();
      compute_block_softmax_and_weighted_v<Cfg>(s, stats, acc_o, sV + wn * Cfg::kSubN * Cfg::kPitch, exp_scale);
    }
  } else {
    if constexpr (Cfg::kQToHalf) {
      // Q's group has landed (kStages - 1 steps may still be in flight): one warp per 16-row
      // slice converts it, outside the key loop, whose registers O's accumulators hold.
      cp_async_wait<Cfg::kStages - 1>();
      __syncthreads();
      if (wn == 0) {
        const float unscale = q_slice_to_fp16<Cfg>(sQ + wm * 16 * Cfg::kPitch);
        if (threadIdx.x % 32 == 0) smem.q_unscale[wm] = unscale;
      }
      __syncthreads();
      q_unscale = smem.q_unscale[wm];
      exp_scale = mod.exp_scale(scale_log2());
    }
    for (int nb = nb_begin; nb < nb_end; ++nb) {
      cp_async_wait<Cfg::kStages - 2>();  // one commit group per step, empty ones included
      if constexpr (kBulk || kBoxes) {
        if (is_bulk(nb)) sm90::mbarrier_wait(&smem.full[nb % Cfg::kStages], ((nb - nb_begin) / Cfg::kStages) % 2);
      }
      if (KeyCopier<Cfg>::kOwned && !kBulk && !kBoxes && nb > nb_begin) {
        __syncwarp();  // this warp's rows of step nb landed; it alone read them in step nb - 1's stage
      } else {
        __syncthreads();  // step nb landed for all; step nb - 1's stage is free
      }
      if (nb + Cfg::kStages - 1 < nb_end) load(nb + Cfg::kStages - 1);
      cp_async_commit();
      if constexpr (Cfg::kQInRegs) {
        if (nb == nb_begin) {  // Q landed with step 0
          if constexpr (Cfg::kFp8) {
            load_a_frags_k4<Cfg::kHeadDim, Cfg::kPitch>(q_frags, sQ_warp);
          } else {
            load_a_frags<Cfg::kHeadDim, Cfg::kPitch>(q_frags, sQ_warp);
          }
        }
      }

      const typename Cfg::TC* stage = sKV + (nb % Cfg::kStages) * kStageElems;
      float s[1][Cfg::kSubN / 8][4];
      float block_max[1][2];
      scores_of_step(nb, stage, s, block_max);
      compute_block_softmax_and_weighted_v<Cfg>(s, stats, acc_o,
                                                stage + (Cfg::kBlockN + wn * Cfg::kSubN) * Cfg::kPitchC, exp_scale);
    }
  }
  cp_async_wait<0>();
  // The keys are read: the merge of the split ranges may launch now (it waits for this grid's
  // results before reading them: grid_dependency_wait), so its launch overlaps this tail.
  launch_dependent_grids();
  __syncthreads();  // the ring is free for the merge

  // Each warp's rows: (m, l) and its unnormalized O, fp32, in its slot of the merge area.
  float* sO = smem.merge.o[0];
  float* sStats = smem.merge.stats[0][0];
  {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    float* o_slot = sO + wn * Cfg::kRows * Cfg::kMergePitch;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = wm * 16 + g + 8 * half;
      const float l = group_sum<4>(stats.sum[0][half]);
      if constexpr (Cfg::kFp8) {
        // C tiles 2c and 2c + 1 hold O's even and odd columns of chunk c (tiers/mma/gemm.cuh).
#pragma unroll
        for (int c = 0; c < Cfg::kHeadDim / 16; ++c) {
          *reinterpret_cast<float4*>(o_slot + r * Cfg::kMergePitch + 16 * c + 4 * t) =
              make_float4(acc_o[0][2 * c][2 * half], acc_o[0][2 * c + 1][2 * half], acc_o[0][2 * c][2 * half + 1],
                          acc_o[0][2 * c + 1][2 * half + 1]);
        }
      } else {
#pragma unroll
        for (int dt = 0; dt < Cfg::kHeadDim / 8; ++dt) {
          *reinterpret_cast<float2*>(o_slot + r * Cfg::kMergePitch + dt * 8 + 2 * t) =
              make_float2(acc_o[0][dt][2 * half], acc_o[0][dt][2 * half + 1]);
        }
      }
      if (t == 0) {
        sStats[(wn * Cfg::kRows + r) * 2] = stats.max[0][half];
        sStats[(wn * Cfg::kRows + r) * 2 + 1] = l;
      }
    }
  }
  __syncthreads();
  if constexpr (kClusterMerge) {
    cluster_merge_output<Cfg>(p, seq, sO, sStats, bi, h0, r0, rows_valid, v_descale);
  } else {
    normalize_output<Cfg>(p, seq, sO, sStats, bi, h0, r0, rows_valid, split, v_descale);
  }
}

// The bulk variant exists in the sm_90a build alone (elsewhere it traps and is never launched:
// launch_decode asks sm90_kernel_built).
// The FP8 kernels exist from sm_89 on (arch/fp8.cuh; elsewhere they trap and are never launched:
// the binding asks for compute capability 8.9).
template <typename Cfg, bool kBulk = false>
__global__ void __launch_bounds__(Cfg::kThreads) decode_kernel(const FwdParams p) {
  if constexpr (kBulk) {
    FLASH_SM90_KERNEL_BODY(decode_block<Cfg, true>(p));
  } else if constexpr (Cfg::kFp8) {
#if FLASH_FP8_CVT
    decode_block<Cfg, false>(p);
#else
    __trap();
#endif
  } else {
    decode_block<Cfg, false>(p);
  }
}

// The cluster-merge rung (cluster_merge_output; sm_90a alone, launched with a cluster of
// num_splits CTAs along x).
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads) decode_kernel_cluster_merge(const FwdParams p) {
  FLASH_SM90_KERNEL_BODY(decode_block<Cfg, false, false, true>(p));
}

// Pages of a multiple of 16 rows by tensor-map boxes (sm_90a alone, like the bulk variant); the
// maps are kernel parameters, where the TMA unit reads them.
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads)
    decode_kernel_page_boxes(const __grid_constant__ FwdParams p, const __grid_constant__ PageMaps maps) {
  FLASH_SM90_KERNEL_BODY(decode_block<Cfg, false, true>(p, &maps));
}

}  // namespace decode

// The cluster-merge rung (FLASH_CUDA_ABLATIONS, FLASH_CUDA_DECODE_MERGE=cluster): 16-bit caches on
// sm_90, no packed batch; the planner then caps the splits at kMaxClusterSplits.
template <typename Cfg>
bool cluster_merge_requested(const FwdParams& p) {
  if constexpr (kAblations && !Cfg::kFp8) {
    return p.sm_arch == 90 && p.cu_seqlens_q == nullptr && ablation_is("FLASH_CUDA_DECODE_MERGE", "cluster");
  }
  return false;
}

// Row chunks and splits of a decode launch with config Cfg (the split count from the shapes: the
// cache's capacity p.sk, never its lengths).
template <typename Cfg>
int plan_decode_splits(const FwdParams& p) {
  auto kernel = decode::decode_kernel<Cfg>;
  const int chunks = ceil_div(p.sq * p.decode_heads, Cfg::kRows);
  const int64_t ctas = int64_t(chunks) * (p.hq / p.decode_heads) * p.b;
  const int per_sm = memo_per_kernel(reinterpret_cast<const void*>(kernel), static_cast<int>(Cfg::kSmemBytes), [&] {
    set_smem_limit(kernel, Cfg::kSmemBytes, "flash_decode");
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Cfg::kThreads, Cfg::kSmemBytes) != cudaSuccess) {
      (void)cudaGetLastError();
      n = 1;
    }
    return n;
  });
  const int splits = plan_key_splits(ctas, ceil_div(p.sk, Cfg::kBlockN), Cfg::kBlockN, p.num_sms, per_sm, chunks == 1);
  return cluster_merge_requested<Cfg>(p) ? std::min(splits, decode::kMaxClusterSplits) : splits;
}

template <typename Cfg>
void launch_decode(const FwdParams& p, cudaStream_t stream);

// The deep-ring rung (DeepRingConfig): the same grid and splits as Cfg's launch (planned from
// Cfg's occupancy), a ring of 3 steps where at most 2 CTAs share an SM, 4 where 1 does; false
// where it does not apply (no switch, FP8, rings already that deep, shared memory short).
template <typename Cfg>
bool launch_decode_deep_ring(const FwdParams& p, cudaStream_t stream) {
  if constexpr (kAblations && !Cfg::kFp8 && Cfg::kStages == 2) {
    if (!ablation_is("FLASH_CUDA_DECODE_RING", "deep")) return false;
    using Deep3 = decode::DeepRingConfig<typename Cfg::T, Cfg::kHeadDim, Cfg::kWarpsM, 3>;
    using Deep4 = decode::DeepRingConfig<typename Cfg::T, Cfg::kHeadDim, Cfg::kWarpsM, 4>;
    const int64_t chunks = ceil_div(p.sq * p.decode_heads, Cfg::kRows);
    const int64_t ctas = chunks * p.num_splits * (p.hq / p.decode_heads) * p.b;
    const int64_t per_sm = (ctas + p.num_sms - 1) / std::max(p.num_sms, 1);
    const size_t optin = device_smem_optin();
    if (per_sm <= 1 && optin >= Deep4::kSmemBytes) {
      launch_decode<Deep4>(p, stream);
      return true;
    }
    if (per_sm <= 2 && optin >= 2 * Deep3::kSmemBytes) {
      launch_decode<Deep3>(p, stream);
      return true;
    }
  }
  return false;
}

template <typename Cfg>
void launch_decode(const FwdParams& p, cudaStream_t stream) {
  if (launch_decode_deep_ring<Cfg>(p, stream)) return;
  const int chunks = ceil_div(p.sq * p.decode_heads, Cfg::kRows);
  const dim3 grid(static_cast<unsigned>(chunks * p.num_splits), p.hq / p.decode_heads, p.b);
  if constexpr (kAblations && !Cfg::kFp8) {
    auto merged = decode::decode_kernel_cluster_merge<Cfg>;
    if (cluster_merge_requested<Cfg>(p) && p.num_splits > 1 && p.num_splits <= decode::kMaxClusterSplits &&
        sm90_kernel_built(merged)) {
      set_smem_limit(merged, Cfg::kSmemBytes, "flash_decode");
      cudaLaunchConfig_t config = {};
      config.gridDim = grid;
      config.blockDim = dim3(Cfg::kThreads);
      config.dynamicSmemBytes = Cfg::kSmemBytes;
      config.stream = stream;
      cudaLaunchAttribute attr[1];
      attr[0].id = cudaLaunchAttributeClusterDimension;
      attr[0].val.clusterDim.x = static_cast<unsigned>(p.num_splits);
      attr[0].val.clusterDim.y = 1;
      attr[0].val.clusterDim.z = 1;
      config.attrs = attr;
      config.numAttrs = 1;
      (void)cudaLaunchKernelEx(&config, merged, p);
      check_launch("flash_decode");
      return;
    }
  }
  // Pages smaller than a step on Hopper: the box variant (Tile::kPageBoxes) or the bulk one
  // (Tile::kBulkPages) where each was measured faster than cp.async; their shared memory and
  // registers give the occupancy the split plan assumed.
  auto kernel = decode::decode_kernel<Cfg, false>;
  bool launched = false;
  const bool small_pages = p.block_table != nullptr && p.page_size % Cfg::kBlockN != 0;
  // Ablation rung FLASH_CUDA_DECODE_PAGES=boxes|bulk|cp_async: that fill for the small pages of
  // every config that can take it (boxes: Tile::kBoxable; bulk: kBulkEligible), cp.async else.
  // Ablation rung FLASH_CUDA_DECODE_WHOLE_PAGES=boxes: pages that hold whole steps (a multiple of
  // 16 rows) by the boxes too, instead of cp.async from one page lookup per step.
  bool boxes_any_page = false;
  bool want_boxes = Cfg::kPageBoxes, want_bulk = Cfg::kBulkPages;
  if constexpr (kAblations) {
    boxes_any_page = p.block_table != nullptr && ablation_is("FLASH_CUDA_DECODE_WHOLE_PAGES", "boxes");
    if (boxes_any_page) want_boxes = true;
    if (ablation_is("FLASH_CUDA_DECODE_PAGES", "boxes") || ablation_is("FLASH_CUDA_DECODE_PAGES", "bulk") ||
        ablation_is("FLASH_CUDA_DECODE_PAGES", "cp_async")) {
      want_boxes = ablation_is("FLASH_CUDA_DECODE_PAGES", "boxes");
      want_bulk = ablation_is("FLASH_CUDA_DECODE_PAGES", "bulk");
    }
  }
  if constexpr (Cfg::kPageBoxes || (kAblations && Cfg::kBoxable)) {
    // Pages of 16, 32, 48 rows: boxes, where TMA can address the pools (else the next fill).
    auto boxes = decode::decode_kernel_page_boxes<Cfg>;
    decode::PageMaps maps;
    if (want_boxes && p.sm_arch == 90 && (small_pages || boxes_any_page) && p.page_size % decode::PageMaps::kBoxRows == 0 &&
        sm90_kernel_built(boxes)) {
      const int elem = static_cast<int>(sizeof(typename Cfg::TC));
      if (make_page_tensor_map(&maps.k, p.k, elem, p.d, p.page_size, p.hkv, p.num_pages, p.k_row_stride,
                               p.k_head_stride, p.k_batch_stride, Cfg::kPitchC, decode::PageMaps::kBoxRows) &&
          make_page_tensor_map(&maps.v, p.v, elem, p.d, p.page_size, p.hkv, p.num_pages, p.v_row_stride,
                               p.v_head_stride, p.v_batch_stride, Cfg::kPitchC, decode::PageMaps::kBoxRows)) {
        set_smem_limit(boxes, Cfg::kSmemBytes, "flash_decode");
        boxes<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, maps);
        launched = true;
      }
    }
  }
  if constexpr (Cfg::kBulkEligible) {
    // (dense caches stay on cp.async: one contiguous step is what it streams best, e4m3 rows
    // too since the fill's short paths, OPTIMIZATION.md step 64)
    const bool bulk_pages = small_pages && want_bulk;
    if (!launched && p.sm_arch == 90 && bulk_pages && p.d == Cfg::kHeadDim &&
        sm90_kernel_built(decode::decode_kernel<Cfg, true>)) {
      kernel = decode::decode_kernel<Cfg, true>;
    }
  }
  if (!launched) {
    set_smem_limit(kernel, Cfg::kSmemBytes, "flash_decode");
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  }
  check_launch("flash_decode");
  if (p.num_splits > 1) launch_combine_key_splits<typename Cfg::T>(p, stream);
}

// Calls f(Cfg{}) with the decode config for this call's rows and this device's class
// (ConfigPolicy: the full tiles where the opt-in shared memory holds them, else the compact ones);
// returns `none` where neither fits (a device below every class's budget).
template <typename T, int kHeadDim, bool kFp8, typename F, typename R>
R with_decode_config(const FwdParams& p, R none, F&& f) {
  auto fits = [&](auto policy) -> R {
    using Policy = decltype(policy);
    const size_t optin = device_smem_optin();
    if (optin >= Policy::Full::kSmemBytes) return f(typename Policy::Full{});
    if constexpr (!std::is_same_v<typename Policy::Full, typename Policy::Compact>) {
      if (optin >= Policy::Compact::kSmemBytes) return f(typename Policy::Compact{});
    }
    return none;
  };
  auto by_rows = [&](auto family) -> R {
    using Family = decltype(family);
    switch (decode::warps_m_for(p.sq * p.decode_heads)) {
      case 1: return fits(typename Family::template At<1>{});
      case 2: return fits(typename Family::template At<2>{});
      default: return fits(typename Family::template At<4>{});
    }
  };
  if constexpr (kFp8) {
    if constexpr (kHeadDim == 64) {
      if (p.sm_arch != 90 || (kAblations && ablation_int("FLASH_CUDA_DECODE_FP8_SUBN", 32) == 16)) {
        return by_rows(decode::Fp8Policies<T, kHeadDim, 16>{});
      }
    }
    return by_rows(decode::Fp8Policies<T, kHeadDim>{});
  } else {
    if constexpr (kAblations) {
      const int warp_rows = ablation_int("FLASH_CUDA_DECODE_WARP_ROWS", -1);
      if (warp_rows == 1) return by_rows(decode::RowsPolicies<decode::WarpRows, T, kHeadDim>{});
      if (warp_rows == 0) return by_rows(decode::RowsPolicies<decode::CtaRows, T, kHeadDim>{});
    }
    return by_rows(decode::Policies<T, kHeadDim>{});
  }
}

// The decode family's two entry points per (dtype, head-dim bucket, FP8 cache or not): the split
// count its launch will use (0: no config fits this device's shared memory), and the launch
// itself, which takes the num_splits and workspace the caller set from it.
template <int kDType, int kHeadDim, bool kFp8>
int plan_decode(const FwdParams& p) {
  using T = typename ElementOf<kDType>::type;
  return with_decode_config<T, kHeadDim, kFp8>(p, 0,
                                               [&](auto cfg) { return plan_decode_splits<decltype(cfg)>(p); });
}

template <int kDType, int kHeadDim, bool kFp8>
bool run_decode(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  return with_decode_config<T, kHeadDim, kFp8>(p, false, [&](auto cfg) {
    launch_decode<decltype(cfg)>(p, stream);
    return true;
  });
}

}  // namespace flash_cuda
