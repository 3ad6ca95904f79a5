// tiers/wgmma/bwd_ws.cuh — the Hopper backward, warp-specialized: the dK/dV kernel of bwd.cuh
// (read its header first) with its loads moved to a producer warp, and dQ added from the same
// pass, so that one kernel does the 5 products of each (query block, key block) pair.
//
// Why. The cp.async backward runs 7 products per block pair (its dQ kernel recomputes S and dP),
// and in both of its kernels every warp copies the next block and then meets the others at a
// block-wide barrier before it computes. Here:
//   * a producer warp loads K and V of the CTA's keys once (TMA), then Q, dO (TMA) and lse, delta
//     (its lanes) of each query block into a ring of kStages stages, each guarded by a full and
//     an empty mbarrier: a consumer waits only for the stage it needs;
//   * two consumer warpgroups (setmaxnreg: the producer's registers go to them) own 64 keys
//     each and accumulate dK, dV in registers, as in bwd.cuh;
//   * dQ += dS K per query block: both warpgroups stage their keys' rows of dS^T in shared
//     memory, meet at one named barrier of the 256 consumer threads and split the product. Two
//     dS^T buffers where they fit, so that one warpgroup may stage block i + 1 while the other
//     still reads block i; else one, which a warpgroup claims for block i + 1 once both have
//     waited for their dQ products of block i (the ds_empty mbarrier: by then they usually have).
//     The block's dQ is added into the fp32 workspace params.dq_accum, which the launcher then
//     scales and converts into dq: the consumers stage it in shared memory (two buffers) in the
//     order of their accumulators, and a writer thread adds the whole tile with one bulk
//     reduction (cp.reduce.async.bulk .add.f32: the TMA unit reads shared memory, L2 does the
//     adds). The summation order varies: deterministic=True runs the two-kernel path (bwd.cuh).
//
// Per query block, consumer warpgroup w (keys n0 + 64w ..):
//   S^T = K Q^T, dP^T = V dO^T (shared operands)  -> P^T, dS^T in registers
//   dV += P^T dO, dK += dS^T Q (register A operands) ; stage dS^T ; barrier ; dQ = dS K ;
//   dQ to the writer
// with the steps overlapped: block i + 1's S^T is issued as soon as block i's dV and dK are
// done, behind its dQ product, and computes while block i's dQ is staged (bwd_ws_block).
//
// Packed (varlen) batches (kExtended, kSoftcapGrad): one CTA per (128 keys of a sequence, KV
// head, sequence), grid sized by max_seqlen_k; a CTA whose keys start past its sequence's end
// does nothing but stop the dQ writer. The tensor maps span the packed rows (batch extent 1), so
// a box at a sequence's end reads the first rows of the next sequence: those rows are zeroed in
// shared memory before the consumers see the tiles (load_pair), which restores exactly what TMA's
// zero fill gives a dense batch, and keeps one sequence's NaN / Inf out of every other's
// gradients.
// dQ tiles are one per (sequence, head, query block) (config.h: dq_tile).
//
// Softcap (kSoftcapGrad: dS gets the factor dtanh = 1 - tanh^2). A full fp32 tile of dtanh, as
// the mma.sync backward keeps, would cost kBlockM / 2 registers the consumers do not have; even
// folded into P (P to the dV product as 16-bit fragments at once, P * dtanh kept in fp32) while
// dP^T is in flight, ptxas spills 112-196 bytes at d = 64 and 24-32 at d = 128. So S^T and dP^T
// are both awaited and P^T, dS^T computed 16 queries at a time (softcap_probs_and_ds): the
// derivative lives in an 8-register slice, and each fp32 slice dies as it is packed into the
// products' A fragments. The price: P's exponentials no longer run under the dP^T product.
//
// Scope: dense batches (kPlain, and kExtended / kSoftcapGrad with ALiBi, softcap) and packed ones
// (kExtended, kSoftcapGrad), head dims 64, 96 and 128 (33..128 through the buckets), fp16 / bf16,
// causal, windows, Sq != Sk, GQA (the CTA walks the query heads of its KV head), views TMA can
// address; the launcher returns false otherwise and the caller runs bwd.cuh (kSoftcapGrad:
// the mma.sync backward, run_bwd_sm90).
#pragma once

#include <type_traits>

#include "../../core/dropout.cuh"
#include "../../core/scheduler.cuh"
#include "ablation.h"
#include "bwd.cuh"
#include "bwd_smem.h"
#include "tma_maps.h"

namespace flash_cuda {
namespace sm90 {
namespace bwd_ws {

struct TmaMaps {
  CUtensorMap q, dout, k, v;
  // Q and dO in boxes of block_m rows (dO has Q's rows: tma_maps.h, MapRows), K and V of
  // block_n, each box as wide as its tile's slabs (Cfg::QSlabs, KSlabs, VSlabs: 64 columns, at
  // d = 96 natively 32 and 16); false where TMA cannot address a view (the launcher then
  // launches nothing).
  bool make(const BwdParams& p, int block_m, int block_n, int q_cols = kSlabCols, int k_cols = kSlabCols,
            int v_cols = kSlabCols) {
    const MapRows rows = MapRows::of(p);
    return make_qkv_tensor_maps(p, &q, &k, &v, block_m, block_n, /*q_group=*/1, v_cols, q_cols, k_cols) &&
           make_row_tensor_map(&dout, p.dout, p.dtype == DType::kBFloat16, p.d, rows.q, p.hq, rows.batch,
                               p.do_row_stride, p.do_head_stride, p.do_batch_stride, block_m, /*box_heads=*/1,
                               q_cols);
  }
};

// Named barrier 1 (0 is __syncthreads): both consumer warpgroups staged their rows of dS^T.
constexpr int kDsBarrier = 1;
constexpr int kConsumerThreads = 256;

// bwd.cuh's tiles (BwdTraits) kWidth wide: the native d = 96 tiles (tile_policy.h: bwd_ws_width)
// are the 128-wide bucket's shape, 96 wide. A type of its own, so that the other instances keep
// their names.
template <typename Traits, int kWidth>
struct TilesOfWidth : Traits {
  static constexpr int kHeadDim = kWidth;
  static_assert(kWidth == 96 && Traits::kHeadDim == 128, "the native d = 96 tiles");
};

// 80-query steps (tile_policy.h: kBwdSteps80MinSq): the 128-wide tiles stepping over 80 queries
// instead of 64, as FlashAttention-4's sm90 backward does at d = 128 without a mask. 80 rows are
// no multiple of wgmma's M = 64, so the dQ product runs transposed, dQ^T = K^T dS^T: each
// warpgroup computes 64 of d's rows for all 80 queries (M = d, N = 80), reading K as the MN-major
// A operand and dS^T as the MN-major B operand, staged in five 16-query slabs with the 32-byte
// swizzle (a 160-byte row has no wider swizzle). The dQ workspace's tiles are then transposed
// too (DqTile). Shared memory holds one dQ staging buffer (two dS^T buffers and one dQ buffer:
// 231,784 bytes); the consumers need 240 registers, which leaves the producer warpgroup 24,
// where a writer thread beside the producer would spill: the first consumer thread issues the dQ
// reductions itself.
template <typename Traits>
struct TilesOf80Queries : Traits {
  static constexpr int kKVBlockM = 80;
  static_assert(Traits::kHeadDim == 128 && Traits::kKVBlockN == 128, "the 128-wide tiles, 128 keys per CTA");
};

// Options as wrappers of any of the tiles above, each adding its bit to kOptions (one detector,
// OptionsOf, reads them, and wrappers nest):
//   BulkStats (the kPlain kernels' default, config.h: bwd_bulk_stats): a query block's (lse in
//     log2 units, delta) pairs, written by the delta preprocess into BwdParams::bwd_stats, land
//     in the stage's lse / delta words (read as pairs) by one bulk copy of the producer's lane 0
//     on the stage's barrier, counted with Q and dO, as FlashAttention-4's sm90 backward loads
//     LSE and dPsum. Without it (the ablation rung FLASH_CUDA_SM90_BWD_STATS=lanes, and the
//     other variants, whose packed batches have no dense rows of pairs) the producer's 32 lanes
//     load, convert and store them every step.
//   WarpRelease (the ablation rung FLASH_CUDA_SM90_BWD_RELEASE=warp, ablation.h): a consumer warp
//     releases a Q / dO stage with one arrival (lane 0, after __syncwarp) instead of one per
//     thread, as CUTLASS's pipelines release a stage once per consumer. The per-thread form
//     stands because compute-sanitizer's racecheck does not follow __syncwarp's ordering of the
//     other lanes' lse / delta reads.
enum : int { kOptWarpRelease = 1, kOptBulkStats = 2 };
template <typename Tiles, typename = void>
struct OptionsOf : std::integral_constant<int, 0> {};
template <typename Tiles>
struct OptionsOf<Tiles, std::void_t<decltype(Tiles::kOptions)>> : std::integral_constant<int, Tiles::kOptions> {};
template <typename Tiles, int kOption>
constexpr bool kHasOption = (OptionsOf<Tiles>::value & kOption) != 0;
template <typename Traits>
struct WarpRelease : Traits {
  static constexpr int kOptions = OptionsOf<Traits>::value | kOptWarpRelease;
};
template <typename Traits>
struct BulkStats : Traits {
  static constexpr int kOptions = OptionsOf<Traits>::value | kOptBulkStats;
};

// The tiles of bwd.cuh's dK/dV kernel (BwdTraits, TilesOfWidth or TilesOf80Queries, maybe in
// BulkStats or WarpRelease), plus the ring's own sizes.
// kDepth: the head dims the instance serves (<= kD): the products that reduce over d (S^T, dP^T)
// stop after its k-steps; the tiles keep their width, TMA filling the columns past d with zeros
// (d = 96 on the 128-wide tiles: 6 of their 8 k-steps). The tiles are 128-byte-swizzled
// 64-column slabs, except where they are 96 wide (kNarrowSlabs): there Q, dO and V are 32-column
// slabs with the 64-byte swizzle and K is 16-column slabs with the 32-byte swizzle (QSlabs,
// KSlabs, VSlabs; arch/sm90.cuh has the layouts, tile_policy.h: kBwdD96Native the reasons).
template <typename Traits, int kStages_ = 2, int kDepth = Traits::kHeadDim>
struct WsBwdConfig : Traits {
  static constexpr int kD = Traits::kHeadDim;
  static constexpr int kQKSteps = (kDepth + 15) / 16;
  static_assert(kDepth <= kD, "the tiles hold the instance's head dims");
  static constexpr int kBlockN = Traits::kKVBlockN;  // keys of the CTA, 64 per consumer warpgroup
  static constexpr int kBlockM = Traits::kKVBlockM;  // queries per step
  // 80-query steps (TilesOf80Queries): dQ^T = K^T dS^T, one dQ staging buffer, written by the
  // first consumer thread.
  static constexpr bool kTransposedDq = kBlockM % 64 != 0;
  static constexpr int kDqBuffers = kTransposedDq ? 1 : 2;
  static constexpr int kStages = kStages_;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr bool kNarrowSlabs = kD % kSlabCols != 0;  // d = 96: 32- and 16-column slabs
  using QSlabs = Slabs<kBlockM, kNarrowSlabs ? 32 : kSlabCols, kD / (kNarrowSlabs ? 32 : kSlabCols)>;  // Q, dO
  using KSlabs = Slabs<kBlockN, kNarrowSlabs ? 16 : kSlabCols, kD / (kNarrowSlabs ? 16 : kSlabCols)>;
  using VSlabs = Slabs<kBlockN, kNarrowSlabs ? 32 : kSlabCols, kD / (kNarrowSlabs ? 32 : kSlabCols)>;
  // The consumers hold dK, dV (64 x d each), the P^T and dS^T fragments and the dQ accumulator.
  // setmaxnreg.inc takes registers only from those the CTA's own warps gave back with
  // setmaxnreg.dec (the CTA starts at 168 each, 65536 / 384 rounded down to 8), so the
  // producer's give-back must cover the consumers' gain: 128 x (168 - 24) >= 256 x (240 - 168).
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  // The split, from ptxas -v (no spills): with the dQ writer beside the producer that warpgroup
  // needs 32 (it spills at 24), and at d = 64 (128-query steps) 40 (the extended variant's, with
  // a packed batch's row zeroing, spills at 32), while the extended and softcap variants'
  // consumers need 232.
  template <int kVariant>
  static constexpr int producer_regs() {
    return kTransposedDq ? 24 : kD == 64 ? 40 : 32;
  }
  template <int kVariant>
  static constexpr int consumer_regs() {
    return kTransposedDq ? 240 : (kD == 64 && kVariant == kPlain) ? 224 : 232;
  }
  template <int kVariant>
  static constexpr bool regs_balance() {
    return 128 * (kLaunchRegs - producer_regs<kVariant>()) >=
           kConsumerThreads * (consumer_regs<kVariant>() - kLaunchRegs);
  }
  static_assert(regs_balance<kPlain>() && regs_balance<kExtended>() && regs_balance<kSoftcapGrad>(),
                "the consumers' registers come from the producer's");
  static_assert(Traits::kKVWarpGroups == 2, "two consumer warpgroups of 64 keys");
  static_assert(kBlockM == wgmma::bwd_block_m(kD) || kTransposedDq,
                "the dQ workspace is sized with this tile height (tile_policy.h; 80-query steps: family.h)");
  static_assert(kBlockM % 16 == 0 && kBlockN <= 256 && kBlockM <= 256, "k-steps of 16 queries, TMA boxes of <= 256 rows");
  // The layout (bwd_smem.h: WsStorage, this kernel's part WsExchange: dS^T and the two dQ staging
  // buffers, a query block's kBlockM x d floats in the order of the accumulator fragments, DqTile,
  // as the workspace holds them). Two dS^T buffers unless they do not fit: d = 64 (128-query
  // steps: its two 32 KiB dQ buffers and the ring leave 32 KiB for dS^T). Any 16-bit T gives the
  // same bytes.
  template <typename T, int kBuffers>
  using StorageWith =
      WsStorage<T, kD, kBlockN, kBlockM, kStages, WsExchange<T, kD, kBlockN, kBlockM, kBuffers, kDqBuffers>>;
  static constexpr int kDsBuffers = smem_request_bytes<StorageWith<uint16_t, 2>>() <= kSmemHopper ? 2 : 1;
  template <typename T>
  using Storage = StorageWith<T, kDsBuffers>;
  static constexpr bool kStagesDq = true;  // the dQ writer's buffers (Smem::dq)
};

// The kernel's view of its shared memory (Cfg::Storage, bwd_smem.h: the members say what each
// holds), for bwd_ws.cuh and bwd_wide.cuh alike: pointers taken from the members once, stages and
// buffers addressed from their first (nvcc schedules indexing of the member arrays differently,
// and this is the code measured).
template <typename T, typename Cfg>
struct Smem {
  using Storage = typename Cfg::template Storage<T>;
  static constexpr int kQTile = Cfg::kBlockM * Cfg::kD;  // elements of one Q or dO stage
  static constexpr int kDsTile = std::extent<decltype(Storage::exchange.ds), 1>::value;  // of one dS^T buffer
  static constexpr int kDqTile = Cfg::kBlockM * Cfg::kD;  // floats of one dQ staging buffer
  T* sK;
  T* sV;
  T* sQ;    // [kStages]
  T* sdO;   // [kStages]
  T* sdS;   // [Cfg::kDsBuffers]
  float* sdQ = nullptr;  // [Cfg::kDqBuffers] (Cfg::kStagesDq)
  float* lse;    // [kStages][kBlockM] (BulkStats: [kStages][kBlockM][2] pairs over both)
  float* delta;  // [kStages][kBlockM]
  uint64_t* kv_full;
  uint64_t* q_full;   // [kStages]
  uint64_t* q_empty;  // [kStages]
  uint64_t* dq_full;   // [2]
  uint64_t* dq_empty;  // [2]
  uint64_t* ds_empty;
  uint64_t* tail;
  float** dq_dst;  // [2]
  __device__ __forceinline__ explicit Smem(unsigned char* base) {
    Storage& st = *reinterpret_cast<Storage*>(base);
    sK = st.k;
    sV = st.v;
    sQ = st.q[0];
    sdO = st.dout[0];
    sdS = st.exchange.ds[0];
    if constexpr (Cfg::kStagesDq) sdQ = st.exchange.dq[0];
    lse = st.lse[0];
    delta = st.delta[0];
    kv_full = &st.kv_full;
    q_full = st.q_full;
    q_empty = st.q_empty;
    dq_full = st.dq_full;
    dq_empty = st.dq_empty;
    ds_empty = &st.ds_empty;
    tail = &st.tail;
    dq_dst = st.dq_dst;
  }
  // The barriers, by thread 0, published by the CTA's one __syncthreads (kDqWriter: with the dQ
  // writer's hand-over pair).
  template <bool kDqWriter>
  __device__ __forceinline__ void init_barriers() const {
    if (threadIdx.x == 0) {
      mbarrier_init(kv_full, 32);
      mbarrier_init(tail, 1);
      for (int s = 0; s < Cfg::kStages; ++s) {
        mbarrier_init(&q_full[s], 32);
        mbarrier_init(&q_empty[s], kHasOption<Cfg, kOptWarpRelease> ? Cfg::kConsumerWarps : kConsumerThreads);
      }
      if constexpr (kDqWriter) {
        for (int b = 0; b < 2; ++b) {
          mbarrier_init(&dq_full[b], Cfg::kConsumerWarps);
          mbarrier_init(&dq_empty[b], 1);
        }
      }
      mbarrier_init(ds_empty, kConsumerThreads);
      fence_barrier_init();
    }
    __syncthreads();
  }
  __device__ __forceinline__ float* dq(int b) const { return sdQ + b * kDqTile; }
  __device__ __forceinline__ T* q(int s) const { return sQ + s * kQTile; }
  __device__ __forceinline__ T* dout(int s) const { return sdO + s * kQTile; }
  __device__ __forceinline__ T* ds(int i) const { return sdS + (i % Cfg::kDsBuffers) * kDsTile; }
};

// Two tiles (K and V, or Q and dO) of kRows rows, in the slabs S0 and S1 (Cfg::KSlabs and VSlabs,
// or QSlabs twice: one box per slab) from row `row` of head h, batch entry b of their
// maps, published on `full`, which counts the 32 producer lanes (and the bytes). Only the first
// `valid` rows belong to the block's sequence. valid == kRows (every dense block; a packed one
// inside its sequence): lane 0 announces the bytes, the TMA completes them on `full`, the other
// lanes arrive (after their lse / delta stores). valid < kRows (a packed block at its sequence's
// end): the rows past it are the next sequence's, where a dense batch has TMA's zero fill. The
// kernel relies on zeros there (zero Q, dO rows with lse = delta = 0 give finite P and dS that
// the mask then zeroes; zero K, V rows add nothing to dQ), and a NaN or Inf of another sequence
// would reach this one's gradients through 0 * NaN. So the tiles land on the producer's own
// `tail` barrier first; the lanes zero those rows, fence them towards the async proxy (the
// consumers' wgmma reads them) and then arrive on `full`, which carries no bytes this time.
// extra_tx: bytes of another copy lane 0 issues onto `full` itself (a dense block only).
template <typename S0, typename S1, typename T>
__device__ __forceinline__ void load_pair(T* dst0, const CUtensorMap* map0, T* dst1, const CUtensorMap* map1,
                                          uint64_t* full, uint64_t* tail, int& tail_phase, int row, int h, int b,
                                          int valid, int lane, uint32_t extra_tx = 0) {
#if FLASH_SM90_ENABLED
  constexpr int kRows = S0::kRows;
  static_assert(S1::kRows == kRows, "two tiles of the same rows");
  const bool partial = valid < kRows;
  uint64_t* bar = partial ? tail : full;
  if (lane == 0) {
    mbarrier_arrive_expect_tx(bar, S0::kBytes + S1::kBytes + extra_tx);
    if constexpr (std::is_same_v<S0, S1>) {
#pragma unroll
      for (int c = 0; c < S0::kSlabs; ++c) {
        tma_load_4d(dst0 + c * S0::kSlabElems, map0, bar, c * S0::kCols, row, h, b);
        tma_load_4d(dst1 + c * S1::kSlabElems, map1, bar, c * S1::kCols, row, h, b);
      }
    } else {
#pragma unroll
      for (int c = 0; c < S0::kSlabs; ++c) tma_load_4d(dst0 + c * S0::kSlabElems, map0, bar, c * S0::kCols, row, h, b);
#pragma unroll
      for (int c = 0; c < S1::kSlabs; ++c) tma_load_4d(dst1 + c * S1::kSlabElems, map1, bar, c * S1::kCols, row, h, b);
    }
  }
  if (partial) {
    mbarrier_wait(tail, tail_phase);
    tail_phase ^= 1;
    zero_rows<kRows, S0::kSlabs, S0::kLineBytes>(dst0, valid, lane);
    zero_rows<kRows, S1::kSlabs, S1::kLineBytes>(dst1, valid, lane);
    fence_proxy_async();  // generic-proxy zeros, read next by the consumers' wgmma (async proxy)
    __syncwarp();         // every lane is past this phase of `tail` before lane 0 arms the next
    mbarrier_arrive(full);
  } else if (lane != 0) {
    mbarrier_arrive(full);  // releases this lane's lse / delta stores (Q, dO)
  }
#endif
}

// The producer warp of the CTA of keys n0.. of KV head hkv, sequence bi. It derives its sequence
// and steps itself, after the register split, so that nothing computed before the split stays
// live in its few registers.
template <typename T, typename Cfg, bool kVarlen>
__device__ __forceinline__ void produce(const BwdParams& p, const TmaMaps& maps, const Smem<T, Cfg>& sm, int n0,
                                        int hkv, int bi, int lane) {
#if FLASH_SM90_ENABLED
  const SeqInfo seq = SeqInfo::make<kVarlen>(p, bi);
  const KeyTileSteps steps = KeyTileSteps::make(seq.mask<kVarlen>(p), n0, Cfg::kBlockN, Cfg::kBlockM, hkv, p.hq / p.hkv);
  if (steps.count == 0) return;  // no query sees these keys, or none are left: nothing to load
  // A packed batch's maps span the packed rows (batch extent 1): rows from the sequence's first,
  // batch coordinate 0, and the blocks at its end have rows to zero (load_pair).
  const bool packed = kVarlen && p.cu_seqlens_q != nullptr;
  const int tb = packed ? 0 : seq.bi;
  int tail_phase = 0;
  load_pair<typename Cfg::KSlabs, typename Cfg::VSlabs>(sm.sK, &maps.k, sm.sV, &maps.v, sm.kv_full, sm.tail,
                                                        tail_phase, seq.k_start + n0, hkv, tb,
                                                        packed ? seq.sk - n0 : Cfg::kBlockN, lane);
  // Steps in the consumers' order (heads outer), the stage and its parity carried along rather
  // than divided out: this warp runs on producer_regs() registers.
  const uint32_t stats = smem_addr(sm.lse) + lane * 4;
  int s = 0, phase = 0;
#pragma unroll 1
  for (int h = steps.h_begin; h < steps.h_end; ++h) {
    const float* lse = p.softmax_lse + seq.stat_offset(p, h);
    const float* delta = p.delta + seq.stat_offset(p, h);
#pragma unroll 1
    for (int mb = steps.m_range.begin; mb < steps.m_range.end; ++mb) {
      const int m0 = mb * Cfg::kBlockM;
      mbarrier_wait(&sm.q_empty[s], phase ^ 1);  // the first pass finds it free
      if constexpr (kHasOption<Cfg, kOptBulkStats>) {
        // The block's pairs in one bulk copy into the stage's lse / delta words (rows past the
        // sequence are the workspace's zeros), counted on q_full with Q and dO.
        constexpr uint32_t kStatBytes = Cfg::kBlockM * 2 * sizeof(float);
        load_pair<typename Cfg::QSlabs, typename Cfg::QSlabs>(sm.q(s), &maps.q, sm.dout(s), &maps.dout, &sm.q_full[s],
                                                              sm.tail, tail_phase, seq.q_start + m0, h, tb,
                                                              Cfg::kBlockM, lane, kStatBytes);
        if (lane == 0) {
          const float* src = p.bwd_stats + ((int64_t(seq.bi) * p.hq + h) * p.stats_rows + m0) * 2;
          bulk_load(sm.lse + s * Cfg::kBlockM * 2, src, kStatBytes, &sm.q_full[s]);
        }
      } else {
        // Rows past the sequence read as lse = delta = 0: their Q and dO rows are zero (TMA's
        // fill, or load_pair's zeroing in a packed batch), so P = 1 there multiplies zeros, and
        // their dQ is never added. lse is staged in log2 units (lse_to_log2, the consumers'
        // compute_probs with kLseLog2): converted once here rather than by every consumer thread
        // that reads it.
#pragma unroll
        for (int r = 0; r < Cfg::kBlockM; r += 32) {
          if (Cfg::kBlockM % 32 != 0 && r + lane >= Cfg::kBlockM) break;  // 80 queries: 16 lanes in the last pass
          const bool valid = m0 + r + lane < seq.sq;
          const float l = valid ? lse_to_log2(lse[m0 + r + lane]) : 0.f, dl = valid ? delta[m0 + r + lane] : 0.f;
          const uint32_t at = stats + (s * Cfg::kBlockM + r) * 4;
          st_shared_f32_pair<Cfg::kStages * Cfg::kBlockM * 4>(at, l, dl);
        }
        load_pair<typename Cfg::QSlabs, typename Cfg::QSlabs>(sm.q(s), &maps.q, sm.dout(s), &maps.dout, &sm.q_full[s],
                                                              sm.tail, tail_phase, seq.q_start + m0, h, tb,
                                                              packed ? seq.sq - m0 : Cfg::kBlockM, lane);
      }
      if (++s == Cfg::kStages) {
        s = 0;
        phase ^= 1;
      }
    }
  }
#endif
}

// The dQ product: dS^T goes through shared memory, where each warpgroup holds 64 keys of it
// while the product needs all kBlockN keys for its queries. stage_ds_transposed writes this
// warp's rows of dS^T (its keys) from the A fragments of dS^T into the shared tile [kBlockN
// keys][kBlockM queries], in the swizzled layout the dQ product reads as its (transposed) A
// operand: one stmatrix per k-step. A fragment kk holds, per warp, four 8x8 matrices: word m is
// keys 8 (m % 2) + (0..7) of the warp's 16 and queries 16kk + 8 (m / 2) + (0..7), i.e. one
// 16-byte chunk of 8 key rows each, chunk (2kk + m / 2) % 8 of the 128-byte line before the
// swizzle. Lane l gives row l % 8 of matrix l / 8; its key row has r % 8 = l % 8, so its
// swizzled chunk is (2kk % 8) ^ (m / 2) ^ (l % 8): the lane's own part once, XORed per k-step
// with a constant (the tile is 1024-byte aligned, so bits 4..6 of the address are the chunk's).
// The lane's part is recomputed per block from %tid.x, which the compiler cannot hoist: kept
// across the loop it would be one more register next to the accumulators (the dropout
// instance has none to spare), the four XORed addresses four more.
template <typename Cfg>
__device__ __forceinline__ void stage_ds_transposed(void* sdS, const uint32_t (&a_ds)[Cfg::kKVBlockM / 16][4]) {
  constexpr int kBlockN = Cfg::kKVBlockN;
  const uint32_t ct = thread_index_opaque() - (Cfg::kThreads - kConsumerThreads);  // consumer thread
  const uint32_t lane = ct % 32, warp = ct / 32;
  const uint32_t m = lane / 8, row = lane % 8;
  if constexpr (Cfg::kTransposedDq) {
    // 80 queries: k-step kk is slab kk, [kBlockN keys][16 queries] in 32-byte lines whose two
    // 16-byte chunks swap where bit 2 of the key row is set (the 32-byte swizzle: address bit 4
    // ^= bit 7); the lane's key row has that bit in row / 4.
    constexpr uint32_t kLine = 32;
    const uint32_t at = smem_addr(sdS) + (16 * warp + 8 * (m % 2) + row) * kLine + (((m / 2) ^ (row / 4)) << 4);
#pragma unroll
    for (int kk = 0; kk < Cfg::kKVBlockM / 16; ++kk) stmatrix_x4(at + kk * kBlockN * kLine, a_ds[kk]);
  } else {
    const uint32_t lane_bytes = (16 * warp + 8 * (m % 2) + row) * kSwizzleBytes + (((m / 2) ^ row) << 4);
    const uint32_t at = smem_addr(sdS) + lane_bytes;
#pragma unroll
    for (int kk = 0; kk < Cfg::kKVBlockM / 16; ++kk) {
      stmatrix_x4((at ^ ((2 * kk % 8) << 4)) + (kk / 4) * kBlockN * kSwizzleBytes, a_ds[kk]);
    }
  }
}

// Zeroes warpgroup wg's 64 rows of dS^T: its keys see none of the block's queries.
template <typename Cfg>
__device__ __forceinline__ void zero_ds_rows(void* sdS, int wg, int tid) {
  constexpr int kBlockN = Cfg::kKVBlockN;
  unsigned char* base = reinterpret_cast<unsigned char*>(sdS);
#pragma unroll
  for (int slab = 0; slab < Cfg::kKVBlockM / 64; ++slab) {
    uint4* rows = reinterpret_cast<uint4*>(base + slab * kBlockN * kSwizzleBytes + 64 * wg * kSwizzleBytes);
#pragma unroll
    for (int i = tid % 128; i < 64 * kSwizzleBytes / 16; i += 128) rows[i] = make_uint4(0, 0, 0, 0);
  }
}

// The dQ product of one query block, dQ = dS K, split between the two warpgroups: kBlockM = 64
// queries x two halves of d (d = 128; the native d = 96: 48 columns each, K's slabs 16 wide so
// that the second half starts on one), or two 64-query halves x all of d (d = 64). Issued as
// one commit group after both warpgroups staged their keys' rows of dS^T (the caller waits).
// 80-query steps (kTransposed): dQ^T = K^T dS^T, each warpgroup 64 of d's rows (K's slab wg)
// for all 80 queries.
template <typename Cfg>
struct DqSplit {
  static constexpr bool kTransposed = Cfg::kKVBlockM % 64 != 0;
  // dQ columns of one warpgroup (kTransposed: the N of dQ^T, the queries)
  static constexpr int kN = kTransposed ? Cfg::kKVBlockM : Cfg::kHeadDim * (Cfg::kKVBlockM / 64) / 2;
  static_assert(kTransposed ? Cfg::kHeadDim == 2 * Cfg::KSlabs::kCols
                            : Cfg::kKVWarpGroups == 2 && (Cfg::kKVBlockM / 64) * (Cfg::kHeadDim / kN) == 2 &&
                                  kN % Cfg::KSlabs::kCols == 0,
                "two warpgroups split the dQ product, each from a slab of K on");
  __device__ __forceinline__ static int row0(int wg) { return Cfg::kKVBlockM == 64 ? 0 : 64 * wg; }
  __device__ __forceinline__ static int col0(int wg) { return Cfg::kKVBlockM == 64 ? kN * wg : 0; }
};

template <typename T, typename Cfg>
__device__ __forceinline__ void issue_dq_product(float (&acc)[1][DqSplit<Cfg>::kN / 8][4], const T* sdS, const T* sK,
                                                 int wg) {
  using Split = DqSplit<Cfg>;
  using KS = typename Cfg::KSlabs;
  constexpr int kBlockN = Cfg::kKVBlockN;
  wgmma_fence();
  if constexpr (Split::kTransposed) {
    // A = K^T (M = d's rows of K's slab wg, K = keys), B = dS^T (K = keys, N = queries, the
    // 16-query slabs), both MN-major.
    wgmma_ss<kBlockN / 16, false, T>(acc[0], MNMajor<kBlockN>{sK + wg * KS::kSlabElems, 0},
                                     SlabOperand<kBlockN, 32, true>{sdS, 0});
  } else {
    const T* a_tile = sdS + (Split::row0(wg) / 64) * kBlockN * 64;           // dS^T slab: keys x 64 queries
    const T* b_tile = sK + (Split::col0(wg) / KS::kCols) * KS::kSlabElems;  // K slab(s): keys x kN columns
    // A = dS (M = queries, K = keys) read transposed from dS^T; B = K (N-major).
    wgmma_ss<kBlockN / 16, false, T>(acc[0], MNMajor<kBlockN>{a_tile, 0}, MNMajorIn<kBlockN, KS::kLineBytes>{b_tile, 0});
  }
  wgmma_commit();
}

// The dQ workspace: per (sequence, query head, query block) one tile of kBlockM x d floats
// (which tile, for dense and packed batches: config.h, dq_tile) in the
// order the two consumer warpgroups hold their dQ accumulators, so that a staged block leaves
// shared memory as one contiguous bulk reduction and each thread writes 16-byte vectors. Tile
// element (wg, j, ct, e) is fragment j of thread ct of warpgroup wg:
//   float4 index (wg * kN / 8 + j) * 128 + ct;  e = 0, 1: row g, columns 2t, 2t + 1 of the
//   fragment's 8 columns; e = 2, 3: row g + 8 (g = lane / 4, t = lane % 4, rows of warp ct / 32).
// convert_dq_tiles_kernel reads it back into dq.
// 80-query steps (kTransposed): the same order of dQ^T's fragments, whose rows are d and columns
// queries: e = 0, 1 are queries 2t, 2t + 1 of column g of d, e = 2, 3 the same queries 8 columns
// further right.
template <typename Cfg>
struct DqTile {
  using Split = DqSplit<Cfg>;
  static constexpr bool kTransposed = Split::kTransposed;
  static constexpr int kFloats = Cfg::kBlockM * Cfg::kD;
  template <bool kVarlen = true>
  __device__ __forceinline__ static int64_t offset(const BwdParams& p, const SeqInfo& seq, int h, int m_block) {
    return wgmma::dq_tile<kVarlen>(p, seq.bi, h, seq.q_start, m_block, Cfg::kBlockM) * kFloats;
  }
  // Where float4 v of a tile sits in the block: its first row (query) and column (the second
  // pair of floats is 8 rows further down; kTransposed: the first pair is two rows, the second 8
  // columns further right).
  __device__ __forceinline__ static void place(int v, int& row, int& col) {
    constexpr int kJ = Split::kN / 8;
    const int wg = v / (kJ * 128), j = v / 128 % kJ, ct = v % 128;
    const int lane = ct % 32;
    if constexpr (kTransposed) {
      row = 8 * j + 2 * (lane % 4);
      col = 64 * wg + 16 * (ct / 32) + lane / 4;
    } else {
      row = Split::row0(wg) + 16 * (ct / 32) + lane / 4;
      col = Split::col0(wg) + 8 * j + 2 * (lane % 4);
    }
  }
};

// The dQ writer, one thread: each time the consumers staged a block's dQ in sdQ[b], it
// adds the whole tile into dq_accum with one bulk reduction, waits until sdQ[b] has been read
// and hands it back. Exchange x uses buffer b = x % 2 and phase x / 2 of its barriers.
template <typename T, typename Cfg>
__device__ __forceinline__ void write_dq(const Smem<T, Cfg>& sm) {
#if FLASH_SM90_ENABLED
  for (int x = 0;; ++x) {
    const int b = x & 1;
    mbarrier_wait(&sm.dq_full[b], (x >> 1) & 1);
    float* dst = sm.dq_dst[b];
    if (dst == nullptr) break;
    bulk_reduce_add_f32(dst, sm.dq(b), Smem<T, Cfg>::kDqTile * sizeof(float));
    bulk_commit();
    bulk_wait_read<0>();
    mbarrier_arrive(&sm.dq_empty[b]);
  }
  bulk_wait<0>();  // the adds themselves are done before the CTA retires
#endif
}

// The hand-over of exchange x to the writer: the block staged in sdQ[x % 2] goes to the tile dst
// (nullptr: no more blocks). Each consumer warp arrives once its part of sdQ is written and fenced.
template <typename T, typename Cfg>
__device__ __forceinline__ void hand_over_dq(const Smem<T, Cfg>& sm, float* dst, int x, int ct) {
  if (ct == 0) sm.dq_dst[x & 1] = dst;
  __syncwarp();
  if (ct % 32 == 0) mbarrier_arrive(&sm.dq_full[x & 1]);
}

// A consumer warpgroup's dQ accumulator into sdQ[x % 2] (DqTile order: 16-byte vectors, 128
// threads side by side, no bank conflicts), once the writer is done with the block staged there
// two exchanges ago.
template <typename T, typename Cfg>
__device__ __forceinline__ void stage_dq(const Smem<T, Cfg>& sm, const float (&acc)[1][DqSplit<Cfg>::kN / 8][4],
                                         float* dst, int x, int wg, int ct) {
#if FLASH_SM90_ENABLED
  constexpr int kJ = DqSplit<Cfg>::kN / 8;
  mbarrier_wait(&sm.dq_empty[x & 1], ((x >> 1) & 1) ^ 1);  // the first pass finds both free
  // DqTile order; the thread's part from %tid.x, not kept across the loop (as in stage_ds_transposed)
  const uint32_t at = smem_addr(sm.dq(x & 1)) + ((wg * kJ) * 128 + thread_index_opaque() % 128) * 16;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    st_shared_v4_f32(at + j * 128 * 16, acc[0][j][0], acc[0][j][1], acc[0][j][2], acc[0][j][3]);
  }
  fence_proxy_async();  // generic-proxy writes, read next by the bulk reduction (async proxy)
  hand_over_dq<T, Cfg>(sm, dst, x, ct);
#endif
}

// The 80-query steps' dQ hand-over, with one staging buffer and no writer thread: the first
// consumer thread waits until the reduction of exchange x - 1 has read the buffer and frees it
// (dq_empty), every consumer warpgroup stages its accumulator there (DqTile order), and once all
// eight warps arrived on dq_full that thread issues exchange x's bulk reduction into dst. Its read
// of the buffer then runs under the next block's products.
template <typename T, typename Cfg>
__device__ __forceinline__ void stage_dq_self(const Smem<T, Cfg>& sm, const float (&acc)[1][DqSplit<Cfg>::kN / 8][4],
                                              float* dst, int x, int wg, int ct) {
#if FLASH_SM90_ENABLED
  constexpr int kJ = DqSplit<Cfg>::kN / 8;
  if (x > 0) {
    if (ct == 0) {
      bulk_wait_read<0>();
      mbarrier_arrive(sm.dq_empty);
    }
    mbarrier_wait(sm.dq_empty, (x - 1) & 1);
  }
  const uint32_t at = smem_addr(sm.dq(0)) + ((wg * kJ) * 128 + thread_index_opaque() % 128) * 16;
#pragma unroll
  for (int j = 0; j < kJ; ++j) {
    st_shared_v4_f32(at + j * 128 * 16, acc[0][j][0], acc[0][j][1], acc[0][j][2], acc[0][j][3]);
  }
  fence_proxy_async();  // generic-proxy writes, read next by the bulk reduction (async proxy)
  __syncwarp();
  if (ct % 32 == 0) mbarrier_arrive(sm.dq_full);
  if (ct == 0) {
    mbarrier_wait(sm.dq_full, x & 1);
    bulk_reduce_add_f32(dst, sm.dq(0), Smem<T, Cfg>::kDqTile * sizeof(float));
    bulk_commit();
  }
#endif
}

// A single dS^T buffer is written for step i only after both warpgroups' dQ products of step
// i - 1 have read it (each thread arrives on ds_empty after its wgmma wait). With two buffers the
// named barrier of step i - 1 already orders it: a warpgroup past that barrier knows the other
// has waited for its products of step i - 2.
template <typename T, typename Cfg>
__device__ __forceinline__ void claim_ds(const Smem<T, Cfg>& sm, int i) {
  if constexpr (Cfg::kDsBuffers == 1) {
    if (i > 0) mbarrier_wait(sm.ds_empty, (i - 1) & 1);
  }
}

// kDrop: attention dropout (the dropout instances: dense batches without score modifiers, kPlain).
template <typename T, typename Cfg, int kVariant, bool kDrop = false>
__device__ __forceinline__ void bwd_ws_block(const BwdParams& p, const TmaMaps& maps) {
  static_assert(!(kDrop && kVariant != kPlain), "dropout instances: dense, no score modifier");
  constexpr int kD = Cfg::kD;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ unsigned char smem_raw[];
  const Smem<T, Cfg> sm(aligned_smem_base<true>(smem_raw));

  // Packed batches (kExtended or kSoftcapGrad, include/params.h: variant_of) read their sequence's
  // offsets and mask from cu_seqlens; kPlain folds all of it to the dense constants.
  constexpr bool kVarlen = kVariant != kPlain;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  sm.template init_barriers</*kDqWriter=*/true>();

  // The CTA's keys, its KV head and batch, and the (head, query block) steps: each role derives
  // them after the split, so that nothing computed before it stays live in the producer's 24
  // registers.
  // Dense batches take their key blocks longest first over sections of pairs (p.tile_section,
  // launch_bwd_ws_main's; 1: the grid's own order, pair by pair).
  int n_block = blockIdx.x, hkv = blockIdx.y, bi = blockIdx.z;
  if constexpr (kVariant == kPlain) {
    int pair;
    key_block_longest_first(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), gridDim.x,
                            gridDim.y * gridDim.z, p.tile_section, n_block, pair);
    hkv = pair % gridDim.y;
    bi = pair / gridDim.y;
  }
  const int n0 = n_block * Cfg::kBlockN;
  if (warp < 4) {
    setmaxnreg_dec<Cfg::template producer_regs<kVariant>()>();
    if (warp == 0) {
      produce<T, Cfg, kVarlen>(p, maps, sm, n0, hkv, bi, lane);
    } else if (warp == 1 && lane == 0 && !Cfg::kTransposedDq) {
      write_dq<T, Cfg>(sm);
    }
    return;
  }

  // ---- consumers: thread ct of 256; warpgroup wg owns keys n0 + 64 wg .. n0 + 64 wg + 63 ----
  setmaxnreg_inc<Cfg::template consumer_regs<kVariant>()>();
  const SeqInfo seq = SeqInfo::make<kVarlen>(p, bi);
  const AttnMask mask = seq.mask<kVarlen>(p);
  const KeyTileSteps steps = KeyTileSteps::make(mask, n0, Cfg::kBlockN, kBlockM, hkv, p.hq / p.hkv);
  const int ct = threadIdx.x - 128;
  // Warp-uniform (arch/sm80.cuh): the products' descriptors, made from wg, and this warp's
  // block ranges below in uniform registers.
  const int cwarp = warp_uniform(ct / 32);
  const int wg = cwarp / 4;
  const int warp_key0 = n0 + 16 * cwarp;

  float acc_dv[1][kD / 8][4];
  float acc_dk[1][kD / 8][4];
  zero_fill(acc_dv);
  zero_fill(acc_dk);
  int x = 0;  // blocks handed to the dQ writer

  // Which query blocks this warp's keys see whole (no per-element mask), asked once
  // (core/block.cuh). Every step's block is seen by some key of the CTA (steps.m_range); a block
  // one warpgroup's keys do not see at all runs through the same products, masked whole (P and
  // dS come out zero): a wgmma under a warpgroup's branch, as a skip would need, makes ptxas
  // serialize every product of the overlapped loop.
  const BlockRange unmasked_blocks = BlockRange::unmasked_queries(mask, warp_key0, warp_key0 + 16, kBlockM);
  using KOp = KMajorIn<Cfg::kBlockN, Cfg::KSlabs::kLineBytes>;
  using VOp = KMajorIn<Cfg::kBlockN, Cfg::VSlabs::kLineBytes>;
  using QOp = KMajorIn<kBlockM, Cfg::QSlabs::kLineBytes>;
  constexpr int kMSteps = kBlockM / 16;
  // The next step's S^T computes under this step's dQ product and its staging, except for
  // softcap at d = 64 (128-query steps), whose consumers spill with S^T's 64 accumulators live
  // next to dQ's: there it is issued once the dQ accumulator is staged.
  constexpr bool kScoresUnderDq = !(kVariant == kSoftcapGrad && kBlockM > 64);

  // S^T = K Q^T of the block in stage st, one commit group.
  auto issue_scores = [&](float (&pt)[1][kBlockM / 8][4], int st) {
    wgmma_fence();
    wgmma_ss<Cfg::kQKSteps, false, T>(pt[0], KOp{sm.sK, 64 * wg}, QOp{sm.q(st), 0});
    wgmma_commit();
  };
  // The rest of a step's scores, S^T having been issued: dP^T = V dO^T behind it, one commit
  // group; P's exponentials run while the tensor cores still compute dP^T (except with softcap:
  // softcap_probs_and_ds); then P^T and dS^T as the A fragments of the dV and dK products.
  auto probs_and_ds = [&](float (&pt)[1][kBlockM / 8][4], int st, int h, int m_block, uint32_t (&a_pt)[kMSteps][4],
                          uint32_t (&a_ds)[kMSteps][4]) {
    const int m0 = m_block * kBlockM;
    const bool needs_mask = !unmasked_blocks.contains(m_block);
    float dst[1][kBlockM / 8][4];
    wgmma_fence();
    wgmma_ss<Cfg::kQKSteps, false, T>(dst[0], VOp{sm.sV, 64 * wg}, QOp{sm.dout(st), 0});
    wgmma_commit();
    wgmma_wait<1>();
    fence_accumulator(pt[0]);
    if constexpr (kVariant == kSoftcapGrad) {
      wgmma_wait<0>();
      fence_accumulator(dst[0]);
      // P^T and dS^T straight into the A fragments of the dV and dK products, 16 queries (two
      // C tiles) at a time: softcap's derivative lives in an 8-register slice of dtanh instead
      // of the full tile (kBlockM / 2 registers) the consumers have no room for.
      softcap_probs_and_ds_by_slices<2>(pt, dst, sm.lse + st * kBlockM, sm.delta + st * kBlockM, needs_mask,
                                        warp_key0, m0, mask, p, seq, h,
                                        [&](int j0, const float (&p_slice)[1][2][4], const float (&ds_slice)[1][2][4]) {
                                          accumulator_to_a<T>(a_pt[j0 / 2], p_slice[0], 0);
                                          accumulator_to_a<T>(a_ds[j0 / 2], ds_slice[0], 0);
                                        });
    } else {
      DtanhTile<kVariant, 1, 1> no_dtanh;
      // BulkStats: the stage holds (lse, delta) pairs (the producer's bulk copy).
      constexpr bool kPairs = kHasOption<Cfg, kOptBulkStats>;
      const float* stage_lse = sm.lse + st * kBlockM * (kPairs ? 2 : 1);
      const float* stage_delta = kPairs ? stage_lse : sm.delta + st * kBlockM;
      compute_probs<true, kVariant, true, kPairs>(pt, no_dtanh, stage_lse, needs_mask, warp_key0, m0, mask, p,
                                                  seq, h);
      // Dropout: the block's keep mask, drawn while dP^T is still on the tensor cores; it drops
      // dP^T before dS^T = P^T (dP^T keep - delta) and then P^T for dV (the forward's key, from
      // its record, read here).
      KeepTile<1, kBlockM / 8> keep;
      if constexpr (kDrop) {
        dropout_keep_tile<true>(keep, dropout_key(p.dropout), uint32_t(bi * p.hq + h), warp_key0, m0);
      }
      wgmma_wait<0>();
      fence_accumulator(dst[0]);
      if constexpr (kDrop) dropout_apply_tile(dst, keep, p.dropout.scale);
      compute_ds<true, kVariant, kPairs>(dst, pt, no_dtanh, stage_delta);
      if constexpr (kDrop) dropout_apply_tile(pt, keep, p.dropout.scale);
      accumulator_to_a<T>(a_pt, pt[0]);
      accumulator_to_a<T>(a_ds, dst[0]);
    }
  };

  // The steps overlap: step i + 1's S^T is issued behind step i's dQ product and computes while
  // step i's dQ accumulator is staged; its dP^T, P^T and dS^T follow in step i's iteration, so
  // that no product is in flight across the loop's back edge (ptxas then serializes them all).
  // An iteration starts with the block's P^T and dS^T fragments ready. The last iteration runs
  // the scores of one more step on the other stage's stale rows (dropped).
  // Step i's head and query block, walked alongside i: head(i) and m_block(i) divide by the
  // query range, an integer division (some 50 instructions) per block.
  int h = steps.h_begin, m_block = steps.m_range.begin;
  uint32_t a_pt[kMSteps][4];
  uint32_t a_ds[kMSteps][4];
  if (steps.count > 0) {
    mbarrier_wait(sm.kv_full, 0);
    mbarrier_wait(&sm.q_full[0], 0);  // step 0: stage 0, parity 0
    float pt[1][kBlockM / 8][4];
    issue_scores(pt, 0);
    probs_and_ds(pt, 0, h, m_block, a_pt, a_ds);
  }
  for (int i = 0; i < steps.count; ++i) {
    const int s = KeyTileSteps::stage(i, kStages);
    T* sdS = sm.ds(i);
    // K for the dQ product, made opaque per block: hoisted out of the loop, that product's k-step
    // descriptors hold uniform registers the packed-batch instances lack (softcap, d = 128,
    // spilled 212 bytes when ptxas gave up on them).
    T* sK_dq = sm.sK;
    opaque(sK_dq);
    // The dQ accumulator is defined (zeroed) before its product overwrites it: an accumulator
    // the asm sees undefined stays live across the whole loop (its registers spill), and one
    // defined while other products are in flight serializes every wgmma (ptxas C7515). So it is
    // zeroed while no product is in flight, before dV and dK are issued.
    float acc_dq[1][DqSplit<Cfg>::kN / 8][4];
    zero_accumulator(acc_dq[0]);
    // dV += P^T dO, dK += dS^T Q run while dS^T is staged for the dQ product.
    issue_dv_dk<T, kD, kBlockM, Cfg::QSlabs::kLineBytes>(acc_dv, acc_dk, a_pt, a_ds, sm.dout(s), sm.q(s));
    claim_ds<T, Cfg>(sm, i);
    stage_ds_transposed<Cfg>(sdS, a_ds);
    fence_proxy_async();  // the generic-proxy writes of dS^T, before the tensor cores read them
    named_barrier_sync(kDsBarrier, kConsumerThreads);
    issue_dq_product<T, Cfg>(acc_dq, sdS, sK_dq, wg);
    wgmma_wait<1>();  // dV and dK of this block
    fence_accumulator(acc_dv[0]);
    fence_accumulator(acc_dk[0]);
    fence_fragments(a_pt);
    fence_fragments(a_ds);
    // Q, dO, lse, delta of stage s are no longer read. Every thread arrives for its own reads of
    // lse and delta (the producer rewrites them with ordinary stores): an arrival per warp after
    // __syncwarp orders them as well, but compute-sanitizer's racecheck does not follow that chain.
    if constexpr (kHasOption<Cfg, kOptWarpRelease>) {
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&sm.q_empty[s]);
    } else {
      mbarrier_arrive(&sm.q_empty[s]);
    }

    // The next step (past the last: this step's head and block again, on stale rows).
    const bool more = i + 1 < steps.count;
    int h_next = h, m_next = m_block;
    KeyTileSteps::next(steps.m_range, steps.h_end, h_next, m_next);
    if (!more) {
      h_next = h;
      m_next = m_block;
    }
    const int s_next = KeyTileSteps::stage(i + 1, kStages);
    if (more) mbarrier_wait(&sm.q_full[s_next], KeyTileSteps::parity(i + 1, kStages));
    float pt[1][kBlockM / 8][4];
    if constexpr (kScoresUnderDq) issue_scores(pt, s_next);

    wgmma_wait<kScoresUnderDq ? 1 : 0>();  // this block's dQ
    if constexpr (Cfg::kDsBuffers == 1) mbarrier_arrive(sm.ds_empty);  // this thread's dQ product read sdS
    // Every step's block has queries the CTA's keys reach (steps.m_range): each adds a dQ tile.
    fence_accumulator(acc_dq[0]);
    float* dst = p.dq_accum + DqTile<Cfg>::template offset<kVarlen>(p, seq, h, m_block);
    if constexpr (Cfg::kTransposedDq) {
      stage_dq_self<T, Cfg>(sm, acc_dq, dst, x++, wg, ct);
    } else {
      stage_dq<T, Cfg>(sm, acc_dq, dst, x++, wg, ct);
    }

    if constexpr (!kScoresUnderDq) issue_scores(pt, s_next);
    probs_and_ds(pt, s_next, h_next, m_next, a_pt, a_ds);
    h = h_next;
    m_block = m_next;
  }

  if constexpr (Cfg::kTransposedDq) {
    if (ct == 0) bulk_wait<0>();  // the adds themselves are done before the CTA retires
  } else {
    mbarrier_wait(&sm.dq_empty[x & 1], ((x >> 1) & 1) ^ 1);
    hand_over_dq<T, Cfg>(sm, nullptr, x, ct);  // tells the writer to stop
  }

  // At d = 128 the epilogue stages each warp's rows in the Q / dO ring, free once both
  // warpgroups are past their last products (every load they waited for has landed; the
  // producer issues no more), so the stores are whole 16-byte rows. At d = 64 (half the
  // stores) the extra barrier costs as much as the wider stores gain: direct stores there.
  if constexpr (kD > 64) {
    static_assert(Cfg::kConsumerWarps * 16 * kStagedPitch<kD> <= 2 * Cfg::kStages * Smem<T, Cfg>::kQTile,
                  "the staged dK / dV rows fit the Q / dO ring");
    named_barrier_sync(kDsBarrier, kConsumerThreads);
    store_dk_dv<T, kD, true>(p, seq, acc_dk, acc_dv, hkv, warp_key0, sm.q(0) + cwarp * 16 * kStagedPitch<kD>);
  } else {
    store_dk_dv<T, kD>(p, seq, acc_dk, acc_dv, hkv, warp_key0);  // rows past the sequence left out
  }
}

template <typename T, typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_sm90_ws_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ TmaMaps maps) {
  FLASH_SM90_KERNEL_BODY(bwd_ws_block<T, Cfg, kVariant>(p, maps));  // (sm90_kernel_built)
}

// Attention dropout (dense, no score modifier), under a name of its own.
template <typename T, typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    bwd_sm90_ws_dropout_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ TmaMaps maps) {
  FLASH_SM90_KERNEL_BODY(bwd_ws_block<T, Cfg, kPlain, /*kDrop=*/true>(p, maps));  // (sm90_kernel_built)
}

// dq = scale * dq_accum for the tile layout of the workspace (DqTile): grid (query blocks of
// the longest sequence, hq, b); blocks past their sequence, the rows past it and the columns past
// d (the bucket's padding) left out. The tile is in fragment order, in which 8 consecutive
// columns of a row are 4 consecutive float4 (lanes 4g .. 4g + 3 of one C tile, their .x / .y; .z
// / .w are the row 8 further down) and one warp's float4 span 64 rows: written straight to dq,
// every warp store touches 64 rows with 16 bytes each (the first form of this kernel moved half
// the bandwidth the row-layout convert does). So it goes through shared memory: each thread
// converts 4 consecutive float4 into two 16-byte row pieces of a 16-bit row-major tile (rows
// padded by 16 bytes: the 8 rows a quarter-warp writes fall in different banks), then the block
// writes whole rows, 16 bytes per thread, consecutive threads along a row.
// Tile: the workspace's tile order (DqTile here, bwd_wide.cuh's WideDqTile), any in which the 4
// consecutive float4 from a multiple of 4 on hold 8 consecutive columns of one row (and of the
// row 8 further down).
template <typename T, typename Cfg, typename Tile>
__global__ void __launch_bounds__(256) convert_dq_tiles_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kPitch = Cfg::kD + 8;  // padded row of the staging tile
  constexpr int kChunksPerRow = Cfg::kD / 8;
  static_assert(Tile::kFloats % 16 == 0, "whole groups of 4 float4");
  __shared__ __align__(16) T stage[Cfg::kBlockM * kPitch];
  const int mb = blockIdx.x, h = blockIdx.y;
  const SeqInfo seq = SeqInfo::make(p, blockIdx.z);
  const int m0 = mb * Cfg::kBlockM;
  if (m0 >= seq.sq) return;  // a packed batch's shorter sequences (the whole block returns)
  const float4* tile = reinterpret_cast<const float4*>(p.dq_accum + Tile::offset(p, seq, h, mb));
  if constexpr (Tile::kTransposed) {
    // dQ^T's fragments (80-query steps): a float4 holds two queries of two columns 8 apart,
    // written as four 16-bit elements.
    uint16_t* st16 = reinterpret_cast<uint16_t*>(stage);
    for (int v = threadIdx.x; v < Tile::kFloats / 4; v += 256) {
      int row, col;
      Tile::place(v, row, col);
      const float4 a = tile[v];
      const uint32_t first = pack2<T>(a.x * p.scale, a.z * p.scale), second = pack2<T>(a.y * p.scale, a.w * p.scale);
      st16[row * kPitch + col] = static_cast<uint16_t>(first);
      st16[row * kPitch + col + 8] = static_cast<uint16_t>(first >> 16);
      st16[(row + 1) * kPitch + col] = static_cast<uint16_t>(second);
      st16[(row + 1) * kPitch + col + 8] = static_cast<uint16_t>(second >> 16);
    }
  }
  for (int u = threadIdx.x; u < (Tile::kTransposed ? 0 : Tile::kFloats / 16); u += 256) {
    int row, col;
    Tile::place(4 * u, row, col);  // lane t = 0 of the group: columns col .. col + 7
    float4 a[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) a[t] = tile[4 * u + t];
    uint32_t lo[4], hi[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      lo[t] = pack2<T>(a[t].x * p.scale, a[t].y * p.scale);
      hi[t] = pack2<T>(a[t].z * p.scale, a[t].w * p.scale);
    }
    *reinterpret_cast<uint4*>(stage + row * kPitch + col) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    *reinterpret_cast<uint4*>(stage + (row + 8) * kPitch + col) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  }
  __syncthreads();
  T* dq = seq.q_rows(static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, h) +
          static_cast<int64_t>(m0) * p.dq_row_stride;
  const int rows = min(Cfg::kBlockM, seq.sq - m0);
  // dq is allocated by the binding (rows of d elements, d % 8 == 0): 16-byte aligned rows; the
  // 4-byte form keeps any other view correct.
  const bool wide_stores = reinterpret_cast<uintptr_t>(dq) % 16 == 0 && p.dq_row_stride % 8 == 0;
  for (int c = threadIdx.x; c < rows * kChunksPerRow; c += 256) {
    const int row = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    if (col >= p.d) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(stage + row * kPitch + col);
    T* dst = dq + static_cast<int64_t>(row) * p.dq_row_stride + col;
    if (wide_stores) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int t = 0; t < 4; ++t) *reinterpret_cast<uint32_t*>(dst + 2 * t) = w[t];
    }
  }
}

}  // namespace bwd_ws
}  // namespace sm90

// dq from the dQ workspace's tiles (order Tile), after the backward that added into them.
template <typename T, typename Cfg, typename Tile = sm90::bwd_ws::DqTile<Cfg>>
void launch_convert_dq_tiles(const BwdParams& p, cudaStream_t stream) {
  sm90::bwd_ws::convert_dq_tiles_kernel<T, Cfg, Tile><<<dim3(ceil_div(p.sq, Cfg::kBlockM), p.hq, p.b), 256, 0, stream>>>(p);
  check_launch("convert_dq_tiles");
}

// The section of pairs over which the kPlain CTAs go longest first (core/scheduler.cuh:
// key_block_longest_first): key_section under a right-bounded mask, where key blocks differ in
// length; else 1, the grid's order. FLASH_CUDA_SM90_BWD_SECTION=N (ablation.h) sets it.
inline int bwd_tile_section(const BwdParams& p) {
  if constexpr (kAblations) {
    const int n = wgmma::ablation::bwd_section_override();
    if (n > 0) return std::min(n, p.hkv * p.b);
  }
  return p.window_right >= 0 ? key_section(p) : 1;
}

// The warp-specialized backwards' main launch (this kernel and the wide one): the TMA maps of Q,
// dO, K and V, delta's preprocess, then one CTA per key block of each (kv head, batch entry).
// False, having launched nothing, where a view TMA cannot address.
template <typename T, typename Cfg, typename Kernel>
bool launch_bwd_ws_main(Kernel kernel, const BwdParams& call, const char* name, cudaStream_t stream) {
  BwdParams p = call;
  p.tile_section = bwd_tile_section(call);
  constexpr size_t kSmemBytes = sm90::smem_request_bytes<typename Cfg::template Storage<T>>();
  static_assert(kSmemBytes <= kSmemHopper, "fits a Hopper block");
  sm90::bwd_ws::TmaMaps maps;
  if (!maps.make(p, Cfg::kBlockM, Cfg::kBlockN, Cfg::QSlabs::kCols, Cfg::KSlabs::kCols, Cfg::VSlabs::kCols)) {
    return false;
  }
  launch_bwd_preprocess<T>(p, stream);
  set_smem_limit(kernel, kSmemBytes, name);
  kernel<<<dim3(ceil_div(p.sk, Cfg::kBlockN), p.hkv, p.b), Cfg::kThreads, kSmemBytes, stream>>>(p, maps);
  check_launch(name);
  return true;
}

// Launches delta's preprocess and the warp-specialized backward and returns true, or returns
// false having launched nothing: no dq_accum workspace (deterministic=True, or a call that wants
// only dQ or only dK / dV: family.h), or a view TMA cannot address.
// The launch on tiles Tiles (launch_bwd_sm90_ws's, maybe in BulkStats or WarpRelease): the
// 80-query steps where they apply, else the 64- / 128-query ones.
template <typename T, typename Tiles, int kVariant, int kDepth>
bool launch_bwd_ws_tiles(const BwdParams& p, cudaStream_t stream) {
  using Cfg = sm90::bwd_ws::WsBwdConfig<Tiles, 2, kDepth>;
  auto kernel = sm90::bwd_ws::bwd_sm90_ws_kernel<T, Cfg, kVariant>;
  if constexpr (kVariant == kPlain && Tiles::kHeadDim == 128 && kDepth == 128) {
    // 80-query steps (config.h: bwd_steps80, through ablation.h's switch; family.h sized the dQ
    // workspace by the same rule).
    if (wgmma::ablation::bwd_steps80(p)) {
      using Cfg80 = sm90::bwd_ws::WsBwdConfig<sm90::bwd_ws::TilesOf80Queries<Tiles>, 2, kDepth>;
      auto kernel80 = sm90::bwd_ws::bwd_sm90_ws_kernel<T, Cfg80, kVariant>;
      if (p.dq_accum == nullptr || !sm90_kernel_built(kernel80)) return false;
      if (!launch_bwd_ws_main<T, Cfg80>(kernel80, p, "bwd_sm90_ws_q80", stream)) return false;
      launch_convert_dq_tiles<T, Cfg80>(p, stream);
      return true;
    }
  }
  const bool packed = p.cu_seqlens_q != nullptr;
  // A kPlain kernel reads no cu_seqlens: packed batches come as kExtended or kSoftcapGrad (variant_of).
  if (p.dq_accum == nullptr || (packed && kVariant == kPlain) || !sm90_kernel_built(kernel)) return false;
  if (!launch_bwd_ws_main<T, Cfg>(kernel, p, "bwd_sm90_ws", stream)) return false;
  launch_convert_dq_tiles<T, Cfg>(p, stream);
  return true;
}

template <typename T, typename Traits, int kVariant, int kDepth>
bool launch_bwd_sm90_ws(const BwdParams& p, cudaStream_t stream) {
  // The tiles' width: the Traits', or natively 96 at d = 96 (tile_policy.h: bwd_ws_width).
  constexpr int kWidth = wgmma::bwd_ws_width(Traits::kHeadDim, kDepth);
  using Tiles = std::conditional_t<kWidth == Traits::kHeadDim, Traits, sm90::bwd_ws::TilesOfWidth<Traits, kWidth>>;
  if constexpr (kVariant == kPlain) {
    // family.h made the (lse, delta) pairs where config.h's bwd_bulk_stats says so (in an ablation
    // build, ablation.h's); without them the launch declines (no dQ workspace), or, in an ablation
    // build, the producer's lanes stage lse and delta (FLASH_CUDA_SM90_BWD_STATS=lanes).
    if (p.bwd_stats == nullptr) {
      if constexpr (kAblations) {
        return launch_bwd_ws_tiles<T, Tiles, kVariant, kDepth>(p, stream);
      } else {
        return false;
      }
    }
    using Bulk = sm90::bwd_ws::BulkStats<Tiles>;
    if constexpr (kAblations) {
      if (wgmma::ablation::bwd_warp_release()) {
        return launch_bwd_ws_tiles<T, sm90::bwd_ws::WarpRelease<Bulk>, kVariant, kDepth>(p, stream);
      }
    }
    return launch_bwd_ws_tiles<T, Bulk, kVariant, kDepth>(p, stream);
  } else {
    return launch_bwd_ws_tiles<T, Tiles, kVariant, kDepth>(p, stream);
  }
}

// The backward with attention dropout: the warp-specialized kernel's dropout instance, or false
// having launched nothing (no dQ workspace, a packed batch or a score modifier, a view TMA cannot
// address): the caller runs the mma.sync backward, which has dropout (bwd.cuh's kernels do not).
template <int kDType, int kHeadDim>
bool run_bwd_sm90_dropout(const BwdParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "the buckets with dropout instances (family.h)");
  using T = typename ElementOf<kDType>::type;
  // Every bucket on the 128-wide tiles, the products over d kHeadDim deep: at d <= 64 the 64-wide
  // tiles' 128-query steps spilled 260 bytes with the keep bits (consumers at 224-232
  // registers); the 128-wide tiles step over 64 queries. The dQ workspace follows
  // (config.h: bwd_tile_width).
  using Cfg = sm90::bwd_ws::WsBwdConfig<sm90::BwdTraits<wgmma::kBwdDropoutTileWidth>, 2, kHeadDim>;
  auto kernel = sm90::bwd_ws::bwd_sm90_ws_dropout_kernel<T, Cfg>;
  if (p.sm_arch != 90 || p.dq_accum == nullptr || !has_dropout(p) || !wgmma::bwd_dropout_applies(p) ||
      !sm90_kernel_built(kernel)) {
    return false;
  }
  if (!launch_bwd_ws_main<T, Cfg>(kernel, p, "bwd_sm90_ws_dropout", stream)) return false;
  launch_convert_dq_tiles<T, Cfg>(p, stream);
  return true;
}

// The Hopper backward of a (dtype, head dim, variant): the warp-specialized kernel where it
// applies (deterministic=False: family.h gives it the dQ workspace), else the cp.async kernels
// of bwd.cuh. kSoftcapGrad runs on the warp-specialized kernel alone: the cp.async kernels have no
// register room for softcap's derivative (their dQ kernel would need a dtanh tile, or the folded
// form and a dS rewrite), so where it does not apply (deterministic=True, a view TMA cannot
// address) this returns false and the caller runs the mma.sync backward.
template <int kDType, int kHeadDim, int kVariant>
bool run_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  // Head dims 65..96: the bucket's Traits are the 128-wide tiles (the cp.async kernels run them
  // with all their k-steps); launch_bwd_sm90_ws runs them 96 wide (tile_policy.h: bwd_ws_width).
  using Traits = sm90::BwdTraits<kHeadDim>;
  if (p.sm_arch != 90) return false;
  if constexpr (kHeadDim == 64 && kVariant == kPlain) {
    // d <= 32 (config.h: narrow_bwd_applies): the one-pass kernel on these tiles with S^T and dP^T
    // 32 deep (TMA's zeros past d), or mma.sync (false) where it declines.
    if (p.d <= wgmma::kNarrowDepth) return launch_bwd_sm90_ws<T, Traits, kVariant, wgmma::kNarrowDepth>(p, stream);
  }
  if (launch_bwd_sm90_ws<T, Traits, kVariant, kHeadDim>(p, stream)) return true;
  if constexpr (kVariant == kSoftcapGrad) {
    return false;  // the caller runs the mma.sync backward
  } else {
    return launch_bwd_sm90<T, Traits, kVariant>(p, stream);
  }
}

}  // namespace flash_cuda
