// sm90_fwd_ws.cuh — the Hopper forward, warp-specialized: TMA loads into a K/V ring of
// mbarrier-guarded stages, a producer warp that only issues those loads, and two consumer
// warpgroups that only compute (FlashAttention-3's recipe, first rungs: TMA + mbarrier ring,
// warp specialization with setmaxnreg). Not yet chosen by kernel="auto": OPTIMIZATION.md,
// "Hopper forward, warp-specialized", says what has been verified.
//
// Why. In sm90_fwd.cuh every warp copies K/V with cp.async and then computes, and a block-wide
// barrier per key block orders the two; the Nsight profile has that barrier as the top stall
// with the tensor pipe at 46%. Here the copies are one thread's TMA instructions, completion is
// counted in bytes on a per-stage mbarrier, and a consumer warpgroup waits only for the stage
// it needs; the producer refills a stage as soon as both consumer warpgroups released it.
//
// CTA: 3 warpgroups (384 threads). Warpgroup 0 is the producer: it gives up registers
// (setmaxnreg.dec to 24) and one of its threads issues the loads. Warpgroups 1 and 2 own query
// rows 0-63 and 64-127 of the block (setmaxnreg.inc to 240): the accumulators of S (64 x
// kBlockN) and O (64 x kHeadDim) live in their registers. Each consumer runs the four steps of
// the online softmax through sm90_fwd.cuh's functions, unchanged:
//   wait K[s] -> compute_qk_scores_and_max -> merge_block_stats -> wait V[s] ->
//   compute_block_softmax_and_weighted_v -> release stage s ... normalize_output.
//
// Shared memory: Q (kBlockM x kHeadDim) | K[kStages] | V[kStages] | mbarriers, every tile in
// the 128-byte-swizzled slab layout of sm90_common.cuh, which is what TMA's 128-byte swizzle
// writes for a box of 64 columns (one slab) when the slab starts on a 1024-byte boundary.
// Barriers: q_full; k_full[s] and v_full[s] (producer arrival + transaction bytes: V may still
// be landing while S = Q K^T runs); empty[s] (one arrival per consumer warp).
//
// Two consumer schedules (WsSchedule), chosen at launch, so that each rung of the ladder is
// measured against the one before on the same build:
//   kSerial:  per key block, S = Q K^T, softmax, O += P V, each product waited for at once.
//   kOverlap: FlashAttention-3's intra-warpgroup overlap plus inter-warpgroup ping-pong. Each
//             step issues S(j) = Q K(j)^T and O += P(j-1) V(j-1) as one group, then waits for
//             S(j) alone and runs its mask / max while P V is still on the tensor cores. Named
//             barriers order the two warpgroups' product groups (one issues while the other
//             runs its softmax), so the tensor cores always have a group queued.
//
// Scope of this version: dense batches, fp16 / bf16, head dims 64 and 128, the kPlain variant
// (causal, windows, Sq != Sk, GQA); views whose base and strides TMA can address (16-byte
// multiples). The launcher returns false otherwise.
#pragma once

#include <cstdlib>
#include <string>

#include "sm90_async.cuh"
#include "sm90_fwd.cuh"

namespace flash_cuda {
namespace sm90 {
namespace ws {

// The tensor maps of one call (a kernel parameter, read by the TMA unit; CUtensorMap carries
// its own alignment).
struct TmaMaps {
  CUtensorMap q, k, v;
};

constexpr int kProducerRegs = 24;   // one thread issues TMA; the rest of its warpgroup exits
constexpr int kConsumerRegs = 240;  // 128 x 24 + 256 x 240 <= 65536 registers per SM
constexpr int kConsumerThreads = 256;
constexpr int kConsumerWarps = kConsumerThreads / 32;
// Named barriers (0 is __syncthreads): both consumer warpgroups left the ring; warpgroup w's
// turn to issue its products (kOverlap), kTurnBarrier + w.
constexpr int kConsumersDoneBarrier = 1;
constexpr int kTurnBarrier = 2;

enum WsSchedule : int { kSerial = 0, kOverlap = 1 };

// Tiles as in sm90_fwd.cuh (its helpers read these fields), plus the pipeline's own sizes.
template <typename T_, int kHeadDim_>
struct WsConfig : FwdConfig<T_, kHeadDim_, /*kBlockN=*/128, /*kWarpGroups=*/2, /*kMinBlocks=*/1> {
  using Base = FwdConfig<T_, kHeadDim_, 128, 2, 1>;
  static constexpr int kStages = 2;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kSlabs = kHeadDim_ / kSlabCols;
  static constexpr size_t kBarrierBytes = sizeof(uint64_t) * (1 + 3 * kStages);
  static constexpr size_t kSmemBytes = Base::kTileQ + 2 * kStages * Base::kTileKV + kBarrierBytes + 1024;
  static_assert(Base::kTileQ % 1024 == 0 && Base::kTileKV % 1024 == 0, "slabs stay 1024-byte aligned");
  static_assert(Base::kBlockM <= 256 && Base::kBlockN <= 256, "a TMA box has at most 256 rows");
  static_assert(kSmemBytes <= 227 * 1024, "fits a Hopper block");
};

// The ring of one CTA: where stage s of K and V lives, and its barriers.
template <typename Cfg>
struct Ring {
  using T = typename Cfg::T;
  static constexpr int kKVElems = Cfg::kBlockN * Cfg::kHeadDim;
  T* sK;
  T* sV;
  uint64_t* k_full;
  uint64_t* v_full;
  uint64_t* empty;
  __device__ __forceinline__ const T* k(int s) const { return sK + s * kKVElems; }
  __device__ __forceinline__ const T* v(int s) const { return sV + s * kKVElems; }
  // Key block number i of this CTA (counted from 0) sits in stage i % kStages; its barriers
  // complete once per pass over the ring, so the parity of the phase to wait for is the pass's.
  __device__ __forceinline__ static int stage(int i) { return i % Cfg::kStages; }
  __device__ __forceinline__ static int parity(int i) { return (i / Cfg::kStages) & 1; }
  // This warp is done with stage s (its products that read K[s] and V[s] have completed).
  __device__ __forceinline__ void release(int s) const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&empty[s]);
  }
};

// The producer: one thread issues Q once, then K and V of every key block of the CTA, each as
// soon as the consumers released the stage it goes to.
template <typename Cfg>
__device__ __forceinline__ void produce(const TmaMaps& maps, const Ring<Cfg>& ring, typename Cfg::T* sQ,
                                        uint64_t* q_full, const BlockRange& range, int row0, int h, int h_kv,
                                        int bi) {
  mbarrier_arrive_expect_tx(q_full, Cfg::kTileQ);
#pragma unroll
  for (int c = 0; c < Cfg::kSlabs; ++c) {
    tma_load_4d(sQ + c * Cfg::kBlockM * kSlabCols, &maps.q, q_full, c * kSlabCols, row0, h, bi);
  }
  for (int nb = range.begin, i = 0; nb < range.end; ++nb, ++i) {
    const int s = ring.stage(i);
    mbarrier_wait(&ring.empty[s], ring.parity(i) ^ 1);  // the first pass finds every stage free
    mbarrier_arrive_expect_tx(&ring.k_full[s], Cfg::kTileKV);
#pragma unroll
    for (int c = 0; c < Cfg::kSlabs; ++c) {
      tma_load_4d(ring.sK + s * ring.kKVElems + c * Cfg::kBlockN * kSlabCols, &maps.k, &ring.k_full[s],
                  c * kSlabCols, nb * Cfg::kBlockN, h_kv, bi);
    }
    mbarrier_arrive_expect_tx(&ring.v_full[s], Cfg::kTileKV);
#pragma unroll
    for (int c = 0; c < Cfg::kSlabs; ++c) {
      tma_load_4d(ring.sV + s * ring.kKVElems + c * Cfg::kBlockN * kSlabCols, &maps.v, &ring.v_full[s],
                  c * kSlabCols, nb * Cfg::kBlockN, h_kv, bi);
    }
  }
}

// What a consumer warp needs to know about its rows and keys.
struct ConsumerView {
  AttnMask mask;
  ScoreMod mod;
  BlockRange range;
  int wg;         // consumer warpgroup: 0 or 1
  int wg_row0;    // its first row within the CTA's tile
  int warp_row0;  // this warp's first query row (sequence index)
  int warp_row_end;
  float scale_log2, exp_scale;
  __device__ __forceinline__ bool needs_mask(int nb, int block_n) const {
    return mask.needs_mask(warp_row0, warp_row_end, nb * block_n, (nb + 1) * block_n);
  }
};

// kSerial: the four steps of sm90_fwd.cuh per key block, each product waited for at once.
template <typename Cfg>
__device__ __forceinline__ void consume_serial(const Ring<Cfg>& ring, const typename Cfg::T* sQ,
                                               const ConsumerView& cv, float (&acc_o)[1][Cfg::kDTiles][4],
                                               float (&row_max)[1][2], float (&row_sum)[1][2]) {
  for (int nb = cv.range.begin, i = 0; nb < cv.range.end; ++nb, ++i) {
    const int s = ring.stage(i);
    float sc[1][Cfg::kNTiles][4];
    float block_max[1][2];
    mbarrier_wait(&ring.k_full[s], ring.parity(i));
    compute_qk_scores_and_max<Cfg>(sc, block_max, sQ, cv.wg_row0, ring.k(s), cv.needs_mask(nb, Cfg::kBlockN),
                                   cv.warp_row0, nb * Cfg::kBlockN, cv.mask, cv.mod, cv.scale_log2);
    fwd_mma::merge_block_stats<Cfg>(row_max, row_sum, acc_o, block_max);
    mbarrier_wait(&ring.v_full[s], ring.parity(i));
    compute_block_softmax_and_weighted_v<Cfg>(sc, row_sum, acc_o, row_max, ring.v(s), cv.exp_scale);
    ring.release(s);
  }
}

// ---- kOverlap: the products are issued a step ahead of the softmax that needs them ----
// Issues S = Q K^T (one commit group).
template <typename Cfg>
__device__ __forceinline__ void issue_qk(float (&sc)[1][Cfg::kNTiles][4], const typename Cfg::T* sQ, int wg_row0,
                                         const typename Cfg::T* sK) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Cfg::kHeadDim / 16; ++ks) {
    Wgmma<typename Cfg::T, Cfg::kBlockN>::template ss<0>(sc[0], desc_k_major<Cfg::kBlockM>(sQ, wg_row0, ks),
                                                          desc_k_major<Cfg::kBlockN>(sK, 0, ks), ks > 0);
  }
  wgmma_commit();
}

// Issues O += P V with P already in A fragments (one commit group).
template <typename Cfg>
__device__ __forceinline__ void issue_weighted_v(float (&acc_o)[1][Cfg::kDTiles][4],
                                                 const uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                                 const typename Cfg::T* sV) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    Wgmma<typename Cfg::T, Cfg::kHeadDim>::template rs<1>(acc_o[0], pa[kk], desc_mn_major<Cfg::kBlockN>(sV, 0, kk),
                                                          1);
  }
  wgmma_commit();
}

// Step 1 (overlapped): S was issued earlier, possibly followed by kNewer more groups (the
// previous block's P V); wait for S alone, then the mask and the block's row maxima.
template <typename Cfg, int kNewer>
__device__ __forceinline__ void compute_qk_scores_and_max(float (&sc)[1][Cfg::kNTiles][4], float (&block_max)[1][2],
                                                          const ConsumerView& cv, int nb) {
  wgmma_wait<kNewer>();
  fence_accumulator(sc[0]);
  fwd_mma::mask_and_block_max<Cfg>(sc, block_max, cv.needs_mask(nb, Cfg::kBlockN), cv.warp_row0,
                                   nb * Cfg::kBlockN, cv.mask, cv.mod, cv.scale_log2);
}

// Step 3 (overlapped): P = 2^(S - m), the row sums, P rounded to 16 bits into A fragments;
// O += P V is issued with the next block's S (or alone after the last block).
template <typename Cfg>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(float (&sc)[1][Cfg::kNTiles][4],
                                                                     float (&row_sum)[1][2],
                                                                     const float (&row_max)[1][2],
                                                                     uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                                                     float exp_scale) {
  fwd_mma::exponentiate_block<Cfg>(sc, row_sum, row_max, exp_scale);
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) accumulator_to_a<typename Cfg::T>(pa[kk], sc[0], kk);
}

// Ping-pong: a warpgroup issues its product group only on its turn and then hands the turn to
// the other, so the two groups reach the tensor cores alternately while the other warpgroup
// runs its softmax. Each warpgroup syncs on its own barrier once per group and arrives on the
// other's; warpgroup 1 opens the first turn for warpgroup 0 and skips its own last hand-over,
// so every barrier phase has exactly 128 waiting and 128 arriving threads.
struct Turns {
  int wg;
  __device__ __forceinline__ void open() const {
    if (wg == 1) named_barrier_arrive(kTurnBarrier + 0, kConsumerThreads);
  }
  __device__ __forceinline__ void take() const { named_barrier_sync(kTurnBarrier + wg, kConsumerThreads); }
  __device__ __forceinline__ void pass(bool last) const {
    if (!(last && wg == 1)) named_barrier_arrive(kTurnBarrier + (wg ^ 1), kConsumerThreads);
  }
};

template <typename Cfg>
__device__ __forceinline__ void consume_overlap(const Ring<Cfg>& ring, const typename Cfg::T* sQ,
                                                const ConsumerView& cv, float (&acc_o)[1][Cfg::kDTiles][4],
                                                float (&row_max)[1][2], float (&row_sum)[1][2]) {
  const int n = cv.range.count();
  if (n <= 0) return;
  const Turns turns{cv.wg};
  turns.open();
  float sc[1][Cfg::kNTiles][4];
  uint32_t pa[Cfg::kBlockN / 16][4];
  float block_max[1][2];

  // Block 0: S alone, then its softmax (O is still zero: nothing to rescale).
  mbarrier_wait(&ring.k_full[ring.stage(0)], ring.parity(0));
  turns.take();
  issue_qk<Cfg>(sc, sQ, cv.wg_row0, ring.k(ring.stage(0)));
  turns.pass(false);
  compute_qk_scores_and_max<Cfg, 0>(sc, block_max, cv, cv.range.begin);
  fwd_mma::merge_block_stats<Cfg>(row_max, row_sum, acc_o, block_max);
  compute_block_softmax_and_weighted_v<Cfg>(sc, row_sum, row_max, pa, cv.exp_scale);

  // Block i: S(i) and P(i-1) V(i-1) as one turn; S(i)'s mask / max overlaps P V.
  for (int i = 1; i < n; ++i) {
    const int s = ring.stage(i), s_prev = ring.stage(i - 1);
    mbarrier_wait(&ring.k_full[s], ring.parity(i));
    mbarrier_wait(&ring.v_full[s_prev], ring.parity(i - 1));
    turns.take();
    issue_qk<Cfg>(sc, sQ, cv.wg_row0, ring.k(s));
    issue_weighted_v<Cfg>(acc_o, pa, ring.v(s_prev));
    turns.pass(false);
    compute_qk_scores_and_max<Cfg, 1>(sc, block_max, cv, cv.range.begin + i);
    wgmma_wait<0>();  // P(i-1) V(i-1) done: O may be rescaled, pa rewritten, stage i-1 freed
    fence_accumulator(acc_o[0]);
    fence_fragments(pa);
    ring.release(s_prev);
    fwd_mma::merge_block_stats<Cfg>(row_max, row_sum, acc_o, block_max);
    compute_block_softmax_and_weighted_v<Cfg>(sc, row_sum, row_max, pa, cv.exp_scale);
  }

  // The last block's P V.
  const int s_last = ring.stage(n - 1);
  mbarrier_wait(&ring.v_full[s_last], ring.parity(n - 1));
  turns.take();
  issue_weighted_v<Cfg>(acc_o, pa, ring.v(s_last));
  turns.pass(true);
  wgmma_wait<0>();
  fence_accumulator(acc_o[0]);
  fence_fragments(pa);
  ring.release(s_last);
}

template <typename Cfg, int kSchedule>
__device__ __forceinline__ void fwd_ws_block(const FwdParams& p, const TmaMaps& maps) {
  using T = typename Cfg::T;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem_base(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem);
  uint64_t* q_full = reinterpret_cast<uint64_t*>(smem + Cfg::kTileQ + 2 * kStages * Cfg::kTileKV);
  Ring<Cfg> ring;
  ring.sK = reinterpret_cast<T*>(smem + Cfg::kTileQ);
  ring.sV = reinterpret_cast<T*>(smem + Cfg::kTileQ + kStages * Cfg::kTileKV);
  ring.k_full = q_full + 1;
  ring.v_full = ring.k_full + kStages;
  ring.empty = ring.v_full + kStages;

  const int h = blockIdx.y;
  const int bi = blockIdx.z;
  const SeqInfo seq = SeqInfo::make<false>(p, bi);
  const AttnMask mask = seq.mask<false>(p);
  const int m_block = mask.right_bounded() ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // long rows first
  const int row0 = m_block * Cfg::kBlockM;
  const int rows_valid = min(Cfg::kBlockM, seq.sq - row0);
  const BlockRange range = BlockRange::keys_of(mask, row0, row0 + rows_valid, Cfg::kBlockN);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&ring.k_full[s], 1);
      mbarrier_init(&ring.v_full[s], 1);
      mbarrier_init(&ring.empty[s], kConsumerWarps);
    }
    fence_barrier_init();
  }
  __syncthreads();  // the last CTA-wide barrier: from here on the roles never meet all at once

  if (warp < 4) {
    setmaxnreg_dec<kProducerRegs>();
    if (warp == 0 && lane == 0) produce<Cfg>(maps, ring, sQ, q_full, range, row0, h, h / (p.hq / p.hkv), bi);
    return;
  }

  // ---- consumers: warps 4..11, warpgroup w = (warp - 4) / 4 owns rows 64w .. 64w + 63 ----
  setmaxnreg_inc<kConsumerRegs>();
  const int cwarp = warp - 4;
  ConsumerView cv;
  cv.mask = mask;
  cv.mod = seq.score_mod<false>(p, h);
  cv.range = range;
  cv.wg = cwarp / 4;
  cv.wg_row0 = cv.wg * 64;
  cv.warp_row0 = row0 + 16 * cwarp;
  cv.warp_row_end = min(cv.warp_row0 + 16, seq.sq);
  cv.scale_log2 = p.scale_log2;
  cv.exp_scale = cv.mod.exp_scale(p.scale_log2);

  float acc_o[1][Cfg::kDTiles][4];
  float row_max[1][2] = {{-INFINITY, -INFINITY}}, row_sum[1][2] = {{0.f, 0.f}};
#pragma unroll
  for (int dt = 0; dt < Cfg::kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][dt][e] = 0.f;

  mbarrier_wait(q_full, 0);
  if constexpr (kSchedule == kOverlap) {
    consume_overlap<Cfg>(ring, sQ, cv, acc_o, row_max, row_sum);
  } else {
    consume_serial<Cfg>(ring, sQ, cv, acc_o, row_max, row_sum);
  }

  // Step 4 through padded rows of the K/V ring: both consumer warpgroups must be done with it
  // (and every load has landed: each was waited for above).
  named_barrier_sync(kConsumersDoneBarrier, kConsumerThreads);
  fence_proxy_async();
  T* o = seq.q_rows(static_cast<T*>(p.o), p.o_batch_stride, p.o_head_stride, p.o_row_stride, h) +
         static_cast<int64_t>(row0) * p.o_row_stride;
  float* lse = p.softmax_lse + seq.stat_offset(p, h) + row0;
  const int warp_rows_valid = min(16, rows_valid - 16 * cwarp);
  fwd_mma::normalize_output<Cfg>(acc_o, row_sum, row_max, ring.sK + cwarp * 16 * Cfg::kStride,
                                 o + static_cast<int64_t>(16 * cwarp) * p.o_row_stride, p.o_row_stride,
                                 lse + 16 * cwarp, warp_rows_valid, p.d);
}

template <typename Cfg, int kSchedule>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_sm90_ws_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ TmaMaps maps) {
#if FLASH_SM90_ENABLED
  fwd_ws_block<Cfg, kSchedule>(p, maps);
#else
  __trap();  // never launched: see sm90_kernel_built
#endif
}

}  // namespace ws
}  // namespace sm90

// Launches the warp-specialized forward and returns true, or returns false having launched
// nothing: not an sm_90 device or not built for sm_90a, a packed batch or a score modifier
// (kPlain only), or a view TMA cannot address.
// The consumer schedule: kOverlap unless FLASH_CUDA_WS_SCHEDULE=serial (the ablation of the
// optimization record; read at every launch, a few tens of nanoseconds).
inline int ws_schedule() {
  const char* v = std::getenv("FLASH_CUDA_WS_SCHEDULE");
  return v != nullptr && std::string(v) == "serial" ? sm90::ws::kSerial : sm90::ws::kOverlap;
}

// Launches the warp-specialized forward and returns true, or returns false having launched
// nothing: not an sm_90 device or not built for sm_90a, a packed batch or a score modifier
// (kPlain only), or a view TMA cannot address.
template <typename Cfg>
bool launch_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  const bool overlap = ws_schedule() == sm90::ws::kOverlap;
  auto kernel = overlap ? sm90::ws::fwd_sm90_ws_kernel<Cfg, sm90::ws::kOverlap>
                        : sm90::ws::fwd_sm90_ws_kernel<Cfg, sm90::ws::kSerial>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (variant_of(p, /*backward=*/false) != kPlain || p.cu_seqlens_q != nullptr) return false;
  const bool bf16 = p.dtype == DType::kBFloat16;
  sm90::ws::TmaMaps maps;
  if (!make_row_tensor_map(&maps.q, p.q, bf16, p.d, p.sq, p.hq, p.b, p.q_row_stride, p.q_head_stride,
                           p.q_batch_stride, Cfg::kBlockM) ||
      !make_row_tensor_map(&maps.k, p.k, bf16, p.d, p.sk, p.hkv, p.b, p.k_row_stride, p.k_head_stride,
                           p.k_batch_stride, Cfg::kBlockN) ||
      !make_row_tensor_map(&maps.v, p.v, bf16, p.d, p.sk, p.hkv, p.b, p.v_row_stride, p.v_head_stride,
                           p.v_batch_stride, Cfg::kBlockN)) {
    return false;
  }
  set_smem_limit(kernel, Cfg::kSmemBytes, "fwd_sm90_ws");
  const dim3 grid(ceil_div(p.sq, Cfg::kBlockM), p.hq, p.b);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p, maps);
  check_launch("fwd_sm90_ws");
  return true;
}

template <int kDType, int kHeadDim>
bool run_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd_sm90_ws<sm90::ws::WsConfig<typename ElementOf<kDType>::type, kHeadDim>>(p, stream);
}

}  // namespace flash_cuda
