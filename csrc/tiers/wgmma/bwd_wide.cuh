// tiers/wgmma/bwd_wide.cuh — the warp-specialized Hopper backward at head-dim buckets 192 and 256
// (d = 129..256). Read bwd_ws.cuh first: this kernel keeps its producer warp, mbarrier ring,
// step walk (core/block.cuh: KeyTileSteps) and TMA loads (it calls its produce()), and changes how
// the two consumer warpgroups share the work, because that kernel's split does not fit at these
// widths.
//
// Why a different split. bwd_ws.cuh gives each consumer warpgroup 64 keys and all d columns
// of dK and dV in fp32 registers: 2 x 64 x d / 128 = d registers per thread, 512 at d = 256
// against the 240 a consumer can have; and K, V of 128 keys (128 KiB at d = 256) plus one stage
// of Q, dO (64 KiB) leave no room for a second stage. Here a CTA owns 64 keys, and the two
// warpgroups split dK, dV and dQ by HEAD-DIM COLUMNS:
//   warpgroup w owns columns [col0(w), col0(w) + kCols(w)) of dK, dV (64 keys x kCols fp32) and of
//   the block's dQ (64 queries x kCols): d = 256: 128 + 128; d = 192: 128 + 64 (a descriptor of an
//   MN-major operand starts on a 64-column slab: 96 + 96 would need a slab split in two).
//   Accumulators at kCols = 128: dV 64 + dK 64 + dQ 64 = 192 registers per thread.
//
// Per query block (64 queries, heads of the KV group outer, as in bwd_ws.cuh):
//   1. S^T = K Q^T and dP^T = V dO^T reduce over all of d, so they cannot be split by columns;
//      they are split by QUERIES instead: warpgroup w computes the 64 keys x 32 queries
//      [32w, 32w + 32) (wgmma m64 n32, both operands K-major in shared memory), then P^T and dS^T
//      of its 32 queries (core/softmax.cuh: compute_probs / compute_ds, unchanged: the
//      accumulator of n32 has the C fragment layout per warp).
//   2. Each warpgroup writes its 16-bit P^T and dS^T halves into shared tiles [64 keys][64
//      queries] (swizzled like every operand tile); fence.proxy.async; one named barrier of the
//      256 consumer threads: now both tiles are whole.
//   3. dV[:, cols] += P^T dO[:, cols]   A = P^T  (shared, K-major), B = dO (N-major)
//      dK[:, cols] += dS^T Q[:, cols]   A = dS^T (shared, K-major), B = Q  (N-major)
//      dQ[:, cols]  = dS K[:, cols]     A = dS   (shared, dS^T read MN-major), B = K (N-major)
//      3 x 4 wgmma (k-steps of 16 queries / keys).
//      dQ is issued first, as its own commit group, dV and dK after it as a second one.
//   4. Once all three have landed, each warpgroup's columns of Q and dO in the stage are read by
//      nothing else, and its dQ (64 x its columns, fp32: as many bytes) is staged there, each
//      warp's part sent by one bulk reduction (cp.reduce.async.bulk .add.f32) into the block's
//      tile of the fp32 workspace p.dq_accum (WideDqTile order), which convert_dq_tiles_kernel
//      scales and converts into dq; the stage is released (q_empty) once the reductions have
//      read it.
// Total tensor work per block pair is the 5 products of bwd_ws.cuh; nothing is computed twice.
// The P^T and dS^T exchange costs one barrier per block and 2 x 8 KiB of shared memory per buffer,
// and the two warpgroups run in lockstep: nothing of one hides the other's exponentials, exchange
// and barrier. Both read all of K and V for S^T, dP^T (wgmma n32 reads as much A per product as
// n64 for half the work), which makes that phase heavy on shared-memory bandwidth.
// The alternative, 2 extra products per block pair (7 instead of 5) for independent warpgroups
// (each computes the whole S^T, dP^T and keeps P^T, dS^T in registers, with a private dS^T copy
// for its dQ), was slower: the extra products cost more than the exchange saves (OPTIMIZATION.md).
//
// Shared memory (bytes, bucket 256 / 192):
//   K, V (64 keys)                        65536 /  49152
//   Q, dO ring of 64-query stages        131072 / 147456   (2 stages / 3 stages)
//   P^T + dS^T, 2 buffers                 32768 /  32768
//   lse, delta (per stage)                 1024 /   1536
//   barrier / pointer words (13 / 15)       104 /    120
//   alignment slack                        1024 /   1024
//   total                                231528 / 232056   (limit 232448)
// At d = 192 the third stage fits and is taken (WideConfig: kStages); at 256 only two do.
// Two exchange buffers, so that a warpgroup may stage block i + 1 while the other still reads
// block i (the argument of bwd_ws.cuh's claim_ds: between two uses of a buffer there is a
// barrier the other warpgroup reached only after waiting for its products). Buffers are taken
// per computed block (a block no key of the CTA sees is skipped by both warpgroups, without a
// barrier), so that the argument holds across skipped blocks.
// dQ cannot leave through the bulk-reduce writer of bwd_ws.cuh here: its fp32 staging buffers
// (64 x 256 x 4 = 64 KiB, even half of one) do not fit next to the ring. But a block's Q and dO
// stage is exactly as large, and each warpgroup's half of it (its columns) is free once its own
// dV, dK products have read it. The atomics this replaced bound the kernel: at d = 256 the L2
// ran at 86% of its throughput, REDG led the stall samples, and the backward without any dQ
// adds took 0.58x the time (OPTIMIZATION.md).
//
// Registers: 384 threads launch at 168 each; the producer warpgroup gives back to 24
// (setmaxnreg.dec) and the consumers take 240: 128 x (168 - 24) = 256 x (240 - 168). ptxas -v,
// nvcc 13.0, sm_90a: no spills at 240 (also at 224, 216 spills), so the consumers have at most
// about 16 registers of room: not enough to keep the next block's S^T and dP^T (32) in flight
// under the dQ reductions. A dQ writer warp beside the producer (as in bwd_ws.cuh) needs 32 in
// that warpgroup, leaving the consumers 232, where softcap's spill; it also measured 8-16%
// slower at d = 256 than each warp sending its own part (the stage waits for all 8 warps). The
// tile a block's dQ goes to comes through shared memory (dq_tile_of): computed at the end of a
// block, where dK, dV and dQ are all live, its offset spilled softcap's consumers.
//
// Softcap (kSoftcapGrad: dS gets the factor dtanh = 1 - tanh^2). As in bwd_ws.cuh, no whole
// tile of dtanh is kept: S^T and dP^T are both awaited, then P^T and dS^T are computed a few
// queries at a time (core/softmax.cuh: softcap_probs_and_ds_by_slices) and each slice goes straight into the
// exchange tiles where the other variants' staging puts it (stage_tiles); from the exchange
// barrier on nothing differs. The exponentials then no longer run under the dP^T product.
// The slices are 8 queries wide: with 16 the consumers spill at 240 registers, as they do unless
// softcap's constants are built per slice rather than kept across the loop (core/mask.cuh:
// ScoreMod::make) and a packed sequence's key rows are read again for the final stores.
//
// Scope: dense batches (kPlain: causal, windows, Sq != Sk, GQA) and, in the kExtended and
// kSoftcapGrad instances, packed (varlen) batches, ALiBi and softcap; fp16 / bf16,
// deterministic=False (the workspace's summation order varies), views TMA can address,
// kernel='auto' (config.h: wide_bwd_applies); the launcher returns
// false otherwise and the caller runs the mma.sync backward. A packed batch is walked as in
// bwd_ws.cuh (one CTA per 64 keys of a sequence, the producer zeroing the rows of a partial
// block that belong to the next sequence).
#pragma once

#include "bwd_ws.cuh"

namespace flash_cuda {
namespace sm90 {
namespace bwd_wide {

using bwd_ws::kConsumerThreads;
using bwd_ws::Smem;

// Per stage: the dq_accum tile (config.h: dq_tile) of the block whose Q, dO it holds, written
// by consumer thread 0 when the block's step begins and read by each warp's lane 0 when it
// sends the block's dQ: computed there, at the end of a block, its offset spilled softcap's
// consumers. In WsStorage's dq_tile words (bwd_ws.cuh's dq_dst).
template <typename T, typename Cfg>
__device__ __forceinline__ volatile int* dq_tile_of(const Smem<T, Cfg>& sm) {
  static_assert(Cfg::kStages <= std::extent<decltype(Smem<T, Cfg>::Storage::dq_tile)>::value, "a word per stage");
  return reinterpret_cast<volatile int*>(sm.dq_dst);
}

// The exchange barrier (both warpgroups wrote their query halves of P^T, dS^T) is an mbarrier,
// Smem's ds_empty word (free in this layout of two exchange buffers): one arrival per consumer
// thread, one phase per computed block. Not a named barrier: the warpgroups run different
// instantiations of consume (their column shares differ at d = 192), so a bar.sync would be two
// instructions, which compute-sanitizer's synccheck reports as divergent threads of the block.

// kSoftcapGrad: C tiles (8 queries each) of P^T, dS^T computed per slice.
constexpr int kSoftcapSliceTiles = 1;

// The layout of WideConfig<kD> with a ring of kStages Q / dO stages (bwd_smem.h: WsStorage, this
// kernel's part WideExchange; the bytes in the file comment), with tile_policy.h's keys per CTA
// and queries per step.
template <typename T, int kD, int kStages>
using WideStorage = WsStorage<T, kD, wgmma::kWideBlockN, wgmma::kWideBlockM, kStages,
                              WideExchange<T, wgmma::kWideBlockN, wgmma::kWideBlockM>>;

// kD: the bucket, the width of the Q, dO, K, V tiles (TMA zero-fills the columns past d). The
// member names are those bwd_ws::Smem and bwd_ws::produce read. The ring takes 3 stages where
// they fit (d = 192: 232056 bytes of 232448), else 2 (d = 256); any 16-bit T gives the same bytes.
template <int kD_, int kStages_ = smem_request_bytes<WideStorage<uint16_t, kD_, wgmma::kWideMaxStages>>() <= kSmemHopper
                                      ? wgmma::kWideMaxStages
                                      : wgmma::kWideMinStages>
struct WideConfig {
  static constexpr int kD = kD_;
  static constexpr int kSlabs = kD / kSlabCols;
  static constexpr int kQKSteps = kD / 16;
  static constexpr int kBlockN = wgmma::kWideBlockN;  // keys of the CTA, shared by both warpgroups
  static constexpr int kBlockM = wgmma::kWideBlockM;  // queries per step
  // The slabs bwd_ws::produce loads (and the maps' boxes): 64 columns, the 128-byte swizzle.
  using QSlabs = Slabs<kBlockM, kSlabCols, kSlabs>;
  using KSlabs = Slabs<kBlockN, kSlabCols, kSlabs>;
  using VSlabs = KSlabs;
  static constexpr int kHalfM = kBlockM / 2;  // queries of S^T, dP^T per warpgroup
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  // Columns of dK, dV, dQ per warpgroup: whole 64-column slabs, the first warpgroup the larger share.
  static constexpr int kCols0 = (kSlabs + 1) / 2 * kSlabCols;
  static constexpr int kCols1 = kD - kCols0;
  static constexpr int kDsBuffers = 2;      // exchange buffers
  static constexpr bool kStagesDq = false;  // dQ leaves through the Q / dO stage (consume)
  template <typename T>
  using Storage = WideStorage<T, kD, kStages>;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(128 * (kLaunchRegs - kProducerRegs) >= kConsumerThreads * (kConsumerRegs - kLaunchRegs),
                "the consumers' registers come from the producer's");
  static_assert(kD % kSlabCols == 0 && kCols0 <= 128 && kCols1 > 0 && kCols1 <= kCols0, "two column shares");
  static_assert(kBlockM == kSlabCols, "P^T, dS^T tiles are one 64-query slab");
  static_assert(kBlockN == 64 && kBlockM == 64, "the tiles of WideStorage");
};

// Writes C tiles [j0, j0 + kTiles) of a warpgroup's query half of an fp32 tile (P^T or dS^T, 64
// keys x 32 queries, the n32 accumulator; a slice of it with softcap) as 16-bit values into the
// shared tile [64 keys][64 queries] (one swizzled slab), where the dV / dK products read it
// K-major and the dQ product MN-major. Element (key r, query c) sits at
// r * 128 + 16 * ((c / 8) ^ (r % 8)) + 2 * (c % 8); a thread's pair of C tile j0 + j is query
// 32 wg + 8 (j0 + j) + 2 t (rows g and g + 8, which share r % 8 = g). For each tile the warp's 32
// 4-byte stores hit 32 different banks (chunk (4 wg + j0 + j) ^ g differs between the 8 rows).
template <typename T, int kTiles>
__device__ __forceinline__ void stage_tiles(T* tile, const float (&acc)[1][kTiles][4], int wg, int j0, int ct) {
  const int lane = ct % 32, wq = (ct / 32) % 4;
  const int g = lane / 4, t = lane % 4;
  unsigned char* row = reinterpret_cast<unsigned char*>(tile) + (16 * wq + g) * kSwizzleBytes + 4 * t;
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    unsigned char* at = row + (((4 * wg + j0 + j) ^ g) * 16);
    *reinterpret_cast<uint32_t*>(at) = pack2<T>(acc[0][j][0], acc[0][j][1]);
    *reinterpret_cast<uint32_t*>(at + 8 * kSwizzleBytes) = pack2<T>(acc[0][j][2], acc[0][j][3]);
  }
}

// The dQ workspace's tiles (64 queries x kD floats, one per (sequence, query head, query block):
// config.h's dq_tile, as bwd_ws.cuh's DqTile) in the order the consumer WARPS hold their dQ
// accumulators, each warp's part contiguous, so that a warp stages its part with 512-byte
// stores and sends it with one bulk reduction of its own. Float4 v of warpgroup wg's part
// (kJ = its columns / 8 fragments per thread), from warp_first(wg, 0) on:
//   v = (wq * kJ + j) * 32 + lane;  .x, .y: row 16 wq + g, columns col0(wg) + 8 j + 2 t, + 1;
//   .z, .w: the same 8 rows further down (g = lane / 4, t = lane % 4).
// convert_dq_tiles_kernel (bwd_ws.cuh) reads it back into dq.
template <typename Cfg>
struct WideDqTile {
  static constexpr bool kTransposed = false;  // (bwd_ws.cuh: DqTile)
  static constexpr int kFloats = Cfg::kBlockM * Cfg::kD;
  static constexpr int kJ0 = Cfg::kCols0 / 8, kJ1 = Cfg::kCols1 / 8;
  static_assert(4 * 32 * 4 * (kJ0 + kJ1) == kFloats, "the two parts fill the tile");
  // The first float4 of warp wq of warpgroup wg.
  __device__ __forceinline__ static int warp_first(int wg, int wq) {
    return wg * kJ0 * 128 + wq * (wg == 0 ? kJ0 : kJ1) * 32;
  }
  template <bool kVarlen = true>
  __device__ __forceinline__ static int64_t offset(const BwdParams& p, const SeqInfo& seq, int h, int m_block) {
    return wgmma::dq_tile<kVarlen>(p, seq.bi, h, seq.q_start, m_block, Cfg::kBlockM) * kFloats;
  }
  // Where float4 v of a tile sits in the block: its first row and column (the second pair of
  // floats is 8 rows further down).
  __device__ __forceinline__ static void place(int v, int& row, int& col) {
    const int wg = v >= kJ0 * 128 ? 1 : 0;
    const int kj = wg == 0 ? kJ0 : kJ1;
    const int r = v - wg * kJ0 * 128;
    const int wq = r / (kj * 32), j = r / 32 % kj, lane = r % 32;
    row = 16 * wq + lane / 4;
    col = wg * Cfg::kCols0 + 8 * j + 2 * (lane % 4);
  }
};

// A warp's dQ fragments into its chunk of shared memory (WideDqTile order: fragment j of each
// lane at float4 32 j + lane, every store a warp's 512 contiguous bytes), fenced and complete for
// the bulk reduction its lane 0 then issues.
template <int kCols>
__device__ __forceinline__ void stage_dq(float4* chunk, const float (&acc)[1][kCols / 8][4], int lane) {
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
    chunk[32 * j + lane] = make_float4(acc[0][j][0], acc[0][j][1], acc[0][j][2], acc[0][j][3]);
  }
  fence_proxy_async();  // generic-proxy writes, read by the bulk reduction (async proxy)
  __syncwarp();
}

// A warp's 16 keys x columns [col0, col0 + kCols) of dK (scaled) and dV; rows past the sequence
// and columns past d left out.
template <typename T, int kCols>
__device__ __forceinline__ void store_columns(const BwdParams& p, const SeqInfo& seq,
                                              const float (&acc_dk)[1][kCols / 8][4],
                                              const float (&acc_dv)[1][kCols / 8][4], int hkv, int warp_key0,
                                              int col0) {
  const int rows_valid = seq.sk - warp_key0;
  T* dv = seq.k_rows(static_cast<T*>(p.dv), p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, hkv) +
          static_cast<int64_t>(warp_key0) * p.dv_row_stride + col0;
  store_rows<T>(acc_dv, dv, p.dv_row_stride, rows_valid, p.d - col0, 1.f);
  T* dk = seq.k_rows(static_cast<T*>(p.dk), p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, hkv) +
          static_cast<int64_t>(warp_key0) * p.dk_row_stride + col0;
  store_rows<T>(acc_dk, dk, p.dk_row_stride, rows_valid, p.d - col0, p.scale);
}

// Waits for step i's Q, dO, lse, delta (stage i % kStages) and says whether any of the CTA's 64
// keys sees query block m0; a block none sees is released at once by this thread unless it is
// lane 0 of its warp, which releases every step's stage kStages - 1 steps later (consume:
// release_lagged). CTA-uniform (both warpgroups hold all 64 keys): both skip it, the exchange
// barrier included.
template <typename T, typename Cfg>
__device__ __forceinline__ bool wait_visible_block(const Smem<T, Cfg>& sm, const AttnMask& mask, int i, int m0,
                                                   int n0, int lane) {
  const int s = KeyTileSteps::stage(i, Cfg::kStages);
  mbarrier_wait(&sm.q_full[s], KeyTileSteps::parity(i, Cfg::kStages));
  if (mask.any_visible(m0, m0 + Cfg::kBlockM, n0, n0 + Cfg::kBlockN)) return true;
  if (lane != 0) mbarrier_arrive(&sm.q_empty[s]);
  return false;
}

// One consumer warpgroup, owning columns [col0, col0 + kCols) of dK, dV and dQ, and queries
// [32 wg, 32 wg + 32) of each block's S^T and dP^T. ct: thread of the 256 consumers.
template <typename T, typename Cfg, int kVariant, int kCols>
__device__ __forceinline__ void consume(const BwdParams& p, const Smem<T, Cfg>& sm, int n0, int hkv, int bi,
                                        int wg, int col0, int ct) {
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kHalfM = Cfg::kHalfM;
  constexpr int kStages = Cfg::kStages;
  static_assert(kCols % kSlabCols == 0, "the N-major operands start on a slab");
  constexpr bool kVarlen = kVariant != kPlain;  // packed batches come as kExtended (variant_of)
  const SeqInfo seq = SeqInfo::make<kVarlen>(p, bi);
  const AttnMask mask = seq.mask<kVarlen>(p);
  const KeyTileSteps steps = KeyTileSteps::make(mask, n0, kBlockN, kBlockM, hkv, p.hq / p.hkv);
  const int wq = (ct / 32) % 4;             // warp of its warpgroup: keys 16 wq .. 16 wq + 15
  const int warp_key0 = n0 + 16 * wq;
  const int q_half = kHalfM * wg;           // first query of its S^T, dP^T columns
  // Slab offsets (elements) of its columns in the N-major operands.
  const int kv_cols = col0 * kBlockN, q_cols = col0 * kBlockM;

  float acc_dv[1][kCols / 8][4];
  float acc_dk[1][kCols / 8][4];
  zero_fill(acc_dv);
  zero_fill(acc_dk);
  if (steps.count > 0) mbarrier_wait(sm.kv_full, 0);
  int e = 0;  // computed blocks: exchange buffer e % 2
  // dQ leaves through the stage that held the block's Q and dO (below), so lane 0 of each warp,
  // which issues its bulk reduction, releases step i's stage only at step i + kLag (where, see
  // below; or when that step is skipped) or after the loop, once the reduction has read it:
  // `cp.async.bulk.wait_group.read kLag - 1` with one bulk group per step (a skipped step
  // commits an empty one), so that no register tracks which steps computed. kLag is the stage
  // count less one: with two stages (d = 256) the next step, with three (d = 192) the one after. The stage reloaded next is step i + kStages's: never before that release. With three
  // stages the release follows the issue of step i's S^T, dP^T, by when the reduction has long
  // been read; with two (kReleaseLate) the previous step's reduction is often still reading its
  // stage there (a quarter of the consumers' stall samples waited on it), so the release waits
  // until this step's P^T, dS^T are staged (OPTIMIZATION.md).
  const int lane = ct % 32;
  constexpr int kLag = kStages - 1;
  constexpr bool kReleaseLate = kLag == 1;
  const auto release_lagged = [&](int i) {
    if (lane == 0 && i >= kLag) {
      bulk_wait_read<kLag - 1>();
      mbarrier_arrive(&sm.q_empty[KeyTileSteps::stage(i - kLag, kStages)]);
    }
  };

  for (int i = 0; i < steps.count; ++i) {
    const int s = KeyTileSteps::stage(i, kStages);
    const int h = steps.head(i), m0 = steps.m_block(i) * kBlockM;
    if (!wait_visible_block(sm, mask, i, m0, n0, lane)) {
      release_lagged(i);
      if (lane == 0) bulk_commit();  // the step's (empty) group
      continue;
    }
    if (ct == 0) {
      dq_tile_of(sm)[s] = static_cast<int>(wgmma::dq_tile<kVarlen>(p, seq.bi, h, seq.q_start, m0 / kBlockM, kBlockM));
    }
    T* sQ_s = sm.q(s);
    T* sdO_s = sm.dout(s);
    T* sPt = sm.ds(e);
    T* sdSt = sPt + kBlockN * kBlockM;  // the buffer's second tile (WideExchange)
    ++e;

    {
      const bool needs_mask = mask.needs_mask(m0 + q_half, m0 + q_half + kHalfM, warp_key0, warp_key0 + 16);
      const float* lse = sm.lse + s * kBlockM + q_half;
      const float* delta = sm.delta + s * kBlockM + q_half;
      // S^T, dP^T for its 32 queries, one commit group each: P's exponentials and its staging
      // run while the tensor cores compute dP^T (except with softcap: computed by slices).
      float pt[1][kHalfM / 8][4];
      float dst[1][kHalfM / 8][4];
      wgmma_fence();
      wgmma_ss<Cfg::kQKSteps, false, T>(pt[0], KMajor<kBlockN>{sm.sK, 0}, KMajor<kBlockM>{sQ_s, q_half});
      wgmma_commit();
      wgmma_ss<Cfg::kQKSteps, false, T>(dst[0], KMajor<kBlockN>{sm.sV, 0}, KMajor<kBlockM>{sdO_s, q_half});
      wgmma_commit();
      if constexpr (!kReleaseLate) release_lagged(i);
      if constexpr (kVariant == kSoftcapGrad) {
        wgmma_wait<0>();
        fence_accumulator(pt[0]);
        fence_accumulator(dst[0]);
        // The slices are 8 queries wide: with 16 the consumers spill at 240 registers.
        softcap_probs_and_ds_by_slices<kSoftcapSliceTiles>(
            pt, dst, lse, delta, needs_mask, warp_key0, m0 + q_half, mask, p, seq, h,
            [&](int j0, const float (&p_slice)[1][kSoftcapSliceTiles][4],
                const float (&ds_slice)[1][kSoftcapSliceTiles][4]) {
              stage_tiles<T, kSoftcapSliceTiles>(sPt, p_slice, wg, j0, ct);
              stage_tiles<T, kSoftcapSliceTiles>(sdSt, ds_slice, wg, j0, ct);
            });
      } else {
        wgmma_wait<1>();
        fence_accumulator(pt[0]);
        DtanhTile<kVariant, 1, 1> no_dtanh;
        compute_probs<true, kVariant, true>(pt, no_dtanh, lse, needs_mask, warp_key0, m0 + q_half, mask, p, seq,
                                               h);
        stage_tiles<T, kHalfM / 8>(sPt, pt, wg, 0, ct);
        wgmma_wait<0>();
        fence_accumulator(dst[0]);
        compute_ds<true, kVariant>(dst, pt, no_dtanh, delta);
        stage_tiles<T, kHalfM / 8>(sdSt, dst, wg, 0, ct);
      }
    }
    if constexpr (kReleaseLate) release_lagged(i);
    fence_proxy_async();  // the generic-proxy writes of P^T, dS^T, before the tensor cores read them
    mbarrier_arrive(sm.ds_empty);
    mbarrier_wait(sm.ds_empty, (e - 1) & 1);

    // dQ = dS K first (its own commit group), then dV += P^T dO and dK += dS^T Q (one group), all
    // over its columns. The dQ accumulator is defined right before its product (nothing else in
    // flight then: no wgmma serialization, and it is not live across the loop).
    float acc_dq[1][kCols / 8][4];
    zero_accumulator(acc_dq[0]);
    wgmma_fence();
    // A = dS (M = queries, K = keys) read transposed from dS^T; B = K (N-major).
    wgmma_ss<kBlockN / 16, false, T>(acc_dq[0], MNMajor<kBlockN>{sdSt, 0}, MNMajor<kBlockN>{sm.sK + kv_cols, 0});
    wgmma_commit();
    wgmma_ss<kBlockM / 16, true, T>(acc_dv[0], KMajor<kBlockN>{sPt, 0}, MNMajor<kBlockM>{sdO_s + q_cols, 0});
    wgmma_ss<kBlockM / 16, true, T>(acc_dk[0], KMajor<kBlockN>{sdSt, 0}, MNMajor<kBlockM>{sQ_s + q_cols, 0});
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulator(acc_dq[0]);
    fence_accumulator(acc_dv[0]);
    fence_accumulator(acc_dk[0]);
    // Its columns of Q and dO in stage s are read by nothing else now (both warpgroups' S^T,
    // dP^T ended before the exchange barrier; the other warpgroup's dV, dK read its own
    // columns): 128 x kCols bytes each, where its dQ (64 x kCols floats) goes, warps 0, 1 into
    // the Q columns and 2, 3 into the dO columns, each warp's part one bulk reduction into the
    // block's tile of dq_accum (dq_tile_of: thread 0 wrote it before the exchange barrier). The
    // other lanes are done with stage s (each thread arrives for its own reads, as in
    // bwd_ws.cuh); lane 0 arrives once the reduction has read it (release_lagged).
    {
      unsigned char* part = reinterpret_cast<unsigned char*>((wq < 2 ? sQ_s : sdO_s) + q_cols);
      float4* chunk = reinterpret_cast<float4*>(part + (wq % 2) * kCols * 64);
      stage_dq<kCols>(chunk, acc_dq, lane);
      if (lane == 0) {
        float* dst = p.dq_accum + static_cast<int64_t>(dq_tile_of(sm)[s]) * WideDqTile<Cfg>::kFloats +
                     4 * WideDqTile<Cfg>::warp_first(wg, wq);
        bulk_reduce_add_f32(dst, chunk, kCols * 64);
        bulk_commit();
      } else {
        mbarrier_arrive(&sm.q_empty[s]);
      }
    }
    // The exchange buffer is reused two computed blocks later, after the barrier of the block
    // in between.
  }
  if (lane == 0) {
    bulk_wait_read<0>();
    for (int j = steps.count > kLag ? steps.count - kLag : 0; j < steps.count; ++j) {
      mbarrier_arrive(&sm.q_empty[KeyTileSteps::stage(j, kStages)]);
    }
    bulk_wait<0>();  // the adds themselves are done before the CTA retires
  }

  // A packed sequence's key rows are read again for the stores rather than kept across the loop,
  // where the consumers have no register to spare for them (softcap's derivative spills it).
  store_columns<T, kCols>(p, SeqInfo::make<kVarlen>(p, bi), acc_dk, acc_dv, hkv, warp_key0, col0);
}

template <typename T, typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_sm90_wide_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ bwd_ws::TmaMaps maps) {
#if FLASH_SM90_ENABLED
  constexpr bool kVarlen = kVariant != kPlain;
  extern __shared__ unsigned char smem_raw[];
  const Smem<T, Cfg> sm(aligned_smem_base<true>(smem_raw));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  sm.template init_barriers</*kDqWriter=*/false>();

  const int n0 = blockIdx.x * Cfg::kBlockN;
  const int hkv = blockIdx.y, bi = blockIdx.z;
  if (warp < 4) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == 0) bwd_ws::produce<T, Cfg, kVarlen>(p, maps, sm, n0, hkv, bi, lane);
    return;
  }
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int ct = threadIdx.x - 128;
  const int wg = ct / 128;
  if (wg == 0) {
    consume<T, Cfg, kVariant, Cfg::kCols0>(p, sm, n0, hkv, bi, 0, 0, ct);
  } else {
    consume<T, Cfg, kVariant, Cfg::kCols1>(p, sm, n0, hkv, bi, 1, Cfg::kCols0, ct);
  }
#else
  __trap();  // never launched: see sm90_kernel_built
#endif
}

}  // namespace bwd_wide
}  // namespace sm90

// Launches delta's preprocess, the wide warp-specialized backward and dq's conversion and returns
// true, or returns false having launched nothing: not sm_90 / not built for sm_90a, no dq_accum
// workspace (deterministic=True, or a call that wants only dQ or only dK / dV), a packed batch
// for a kPlain kernel (which reads no cu_seqlens), or a view TMA cannot address.
template <int kDType, int kHeadDim, int kVariant>
bool run_bwd_sm90_wide(const BwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  using Cfg = sm90::bwd_wide::WideConfig<kHeadDim>;
  auto kernel = sm90::bwd_wide::bwd_sm90_wide_kernel<T, Cfg, kVariant>;
  const bool packed = p.cu_seqlens_q != nullptr;
  if (p.sm_arch != 90 || p.deterministic || p.dq_accum == nullptr || (packed && kVariant == kPlain) ||
      p.d > kHeadDim || !sm90_kernel_built(kernel)) {
    return false;
  }
  if (!launch_bwd_ws_main<T, Cfg>(kernel, p, "bwd_sm90_wide", stream)) return false;
  launch_convert_dq_tiles<T, Cfg, sm90::bwd_wide::WideDqTile<Cfg>>(p, stream);
  return true;
}

}  // namespace flash_cuda
