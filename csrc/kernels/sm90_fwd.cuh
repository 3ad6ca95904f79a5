// sm90_fwd.cuh — the Hopper (sm_90a) forward of flash_cuda: the same online softmax as
// mma_fwd.cuh, with its two products on warpgroup MMA (wgmma) instead of mma.sync.
//
// Why. On an H100/H200 mma.sync reaches only about two thirds of the tensor cores' peak;
// wgmma, issued by a warpgroup (4 warps, 128 threads) and reading its B operand (and
// optionally A) straight from shared memory, is the only way to the rest. A thread no longer
// loads fragments with ldmatrix: the instruction reads the swizzled tiles itself
// (sm90_common.cuh), so the shared-memory traffic that bounds the mma.sync kernels goes away.
//
// Work split. A CTA owns kBlockM = 64 * kWarpGroups query rows; warpgroup w owns rows
// 64w..64w+63 (wgmma's M is 64), and within it warp w' owns 16 rows, exactly as an
// mma.sync warp does: the accumulator of m64nNk16 has the m16n8 layout per warp. So the
// softmax helpers of mma_fwd.cuh (mask_and_block_max, merge_block_stats, exponentiate_block,
// normalize_output) run unchanged on wgmma accumulators; only the products differ:
//   S = Q K^T   wgmma m64 n kBlockN k16, A = Q (shared, K-major), B = K block (shared, K-major)
//   O += P V    wgmma m64 n kHeadDim k16, A = P (registers: the S accumulator rounded to 16
//               bits is already the A fragment), B = V block (shared, N-major: transposed)
//
// Data movement: Q once, then K/V blocks through a two-stage cp.async ring into swizzled
// tiles (block j+1 is copied while block j is computed), one barrier per block.
#pragma once

#include "../launch.h"
#include "mma_fwd.cuh"
#include "sm90_common.cuh"

namespace flash_cuda {
namespace sm90 {

template <int kHeadDim> struct FwdTraits;
// kBlockN (keys per step), kWarpGroups (query rows = 64 per warpgroup), kMinBlocks (CTAs per
// SM the registers are budgeted for). Measured on the H200 (OPTIMIZATION.md, bf16, S = 4k and
// 16k): at d = 64 the softmax outweighs the products, and two CTAs per SM (64-key steps,
// 128 registers) overlap one CTA's exponentials with the other's wgmma: 298 -> 383 TFLOPS at
// S = 4k over one CTA of 128-key steps. At d = 128 one CTA of 128 x 128 tiles is fastest.
template <> struct FwdTraits<64>  { static constexpr int kBlockN = 64,  kWarpGroups = 2, kMinBlocks = 2; };
template <> struct FwdTraits<128> { static constexpr int kBlockN = 128, kWarpGroups = 2, kMinBlocks = 1; };

template <typename T_, int kHeadDim_, int kBlockN_ = FwdTraits<kHeadDim_>::kBlockN,
          int kWarpGroups_ = FwdTraits<kHeadDim_>::kWarpGroups,
          int kMinBlocks_ = FwdTraits<kHeadDim_>::kMinBlocks>
struct FwdConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarpGroups = kWarpGroups_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kBlockM = 64 * kWarpGroups;
  static constexpr int kThreads = 128 * kWarpGroups;
  // The fields the shared softmax helpers read (one 16-row tile per warp).
  static constexpr int kMTiles = 1;
  static constexpr int kWarpRows = 16;
  static constexpr int kNTiles = kBlockN / 8;
  static constexpr int kDTiles = kHeadDim / 8;
  static constexpr int kStride = kHeadDim + 8;  // padded rows of the O staging tile
  static constexpr int kStages = 2;
  static constexpr size_t kTileQ = size_t(kBlockM) * kHeadDim * sizeof(T);
  static constexpr size_t kTileKV = size_t(kBlockN) * kHeadDim * sizeof(T);
  // + 1024: the dynamic shared memory base is rounded up to the swizzle pattern's alignment.
  static constexpr size_t kSmemBytes = kTileQ + 2 * kStages * kTileKV + 1024;
  static_assert(kHeadDim % 64 == 0, "swizzled slabs are 64 columns wide");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N");
  static_assert(size_t(kBlockM) * kStride * sizeof(T) <= 2 * kStages * kTileKV,
                "the O staging tile fits in the K/V ring");
};

// Step 1: S = Q K^T (wgmma), then the shared mask / row-max helper (`rows`: as there).
template <typename Cfg, typename Rows = OneQueryPerRow>
__device__ __forceinline__ void compute_qk_scores_and_max(float (&s)[1][Cfg::kNTiles][4],
                                                          float (&block_max)[1][2],
                                                          const typename Cfg::T* sQ, int wg_row0,
                                                          const typename Cfg::T* sK, bool needs_mask,
                                                          int row_base, int key_base, const AttnMask& mask,
                                                          const ScoreMod& mod, float scale_log2,
                                                          const Rows& rows = {}) {
  using T = typename Cfg::T;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < Cfg::kHeadDim / 16; ++ks) {
    Wgmma<T, Cfg::kBlockN>::template ss<0>(s[0], desc_k_major<Cfg::kBlockM>(sQ, wg_row0, ks),
                                           desc_k_major<Cfg::kBlockN>(sK, 0, ks), ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulator(s[0]);
  fwd_mma::mask_and_block_max<Cfg>(s, block_max, needs_mask, row_base, key_base, mask, mod, scale_log2, rows);
}

// Step 3: P = exp2(S - m), row sums, O += P V (wgmma, P from registers).
template <typename Cfg>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(
    float (&s)[1][Cfg::kNTiles][4], float (&row_sum)[1][2], float (&acc_o)[1][Cfg::kDTiles][4],
    const float (&row_max)[1][2], const typename Cfg::T* sV, float scale_log2) {
  using T = typename Cfg::T;
  fwd_mma::exponentiate_block<Cfg>(s, row_sum, row_max, scale_log2);
  // P rounded to 16 bits, all of it before the first wgmma: registers an in-flight wgmma
  // reads must not be written in between.
  uint32_t a[Cfg::kBlockN / 16][4];
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) accumulator_to_a<T>(a[kk], s[0], kk);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    Wgmma<T, Cfg::kHeadDim>::template rs<1>(acc_o[0], a[kk], desc_mn_major<Cfg::kBlockN>(sV, 0, kk), 1);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulator(acc_o[0]);
}

template <typename Cfg, int kVariant>
__device__ __forceinline__ void fwd_sm90_block(const FwdParams& p) {
  using T = typename Cfg::T;
  constexpr int kD = Cfg::kHeadDim;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem_base<true>(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = reinterpret_cast<T*>(smem + Cfg::kTileQ);                               // [kStages] tiles
  T* sV = reinterpret_cast<T*>(smem + Cfg::kTileQ + Cfg::kStages * Cfg::kTileKV);  // [kStages] tiles
  constexpr int kKVElems = Cfg::kBlockN * kD;

  const int h = blockIdx.y;
  constexpr bool kExt = kVariant != kPlain;
  const SeqInfo seq = SeqInfo::make<kExt>(p, blockIdx.z);
  const AttnMask mask = seq.mask<kExt>(p);
  const int m_block = mask.right_bounded() ? gridDim.x - 1 - blockIdx.x : blockIdx.x;  // long rows first
  const int row0 = m_block * Cfg::kBlockM;
  if (row0 >= seq.sq) return;  // varlen: this sequence is shorter than max_seqlen_q
  const ScoreMod mod = seq.score_mod<kExt>(p, h);
  const float exp_scale = mod.exp_scale(p.scale_log2);
  const int h_kv = h / (p.hq / p.hkv);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int wg_row0 = (warp / 4) * 64;  // first row of this warpgroup within the tile
  const int rows_valid = min(Cfg::kBlockM, seq.sq - row0);

  const T* q = seq.q_rows(static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride, p.q_row_stride, h) +
               static_cast<int64_t>(row0) * p.q_row_stride;
  const T* k = seq.k_rows(static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride, p.k_row_stride, h_kv);
  const T* v = seq.k_rows(static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride, p.v_row_stride, h_kv);
  T* o = seq.q_rows(static_cast<T*>(p.o), p.o_batch_stride, p.o_head_stride, p.o_row_stride, h) +
         static_cast<int64_t>(row0) * p.o_row_stride;
  float* lse = p.softmax_lse + seq.stat_offset(p, h) + row0;

  const BlockRange range = BlockRange::keys_of(mask, row0, row0 + rows_valid, Cfg::kBlockN);
  const int n_begin = range.begin, n_end = range.end;

  auto load_kv = [&](int nb, int stage) {
    const int64_t key0 = static_cast<int64_t>(nb) * Cfg::kBlockN;
    load_tile_swizzled<Cfg::kBlockN, kD, Cfg::kThreads>(sK + stage * kKVElems, k + key0 * p.k_row_stride,
                                                        p.k_row_stride, seq.sk - static_cast<int>(key0), p.d, tid);
    load_tile_swizzled<Cfg::kBlockN, kD, Cfg::kThreads>(sV + stage * kKVElems, v + key0 * p.v_row_stride,
                                                        p.v_row_stride, seq.sk - static_cast<int>(key0), p.d, tid);
  };

  load_tile_swizzled<Cfg::kBlockM, kD, Cfg::kThreads>(sQ, q, p.q_row_stride, rows_valid, p.d, tid);
  if (n_begin < n_end) load_kv(n_begin, n_begin % Cfg::kStages);  // block n in ring slot n % 2
  cp_async_commit();

  float acc_o[1][Cfg::kDTiles][4];
  float row_max[1][2], row_sum[1][2];
  fwd_mma::start_online_softmax<Cfg>(acc_o, row_max, row_sum);

  const int warp_row0 = row0 + 16 * warp;  // first query row of this warp
  const int warp_row_end = min(warp_row0 + 16, seq.sq);
  for (int nb = n_begin; nb < n_end; ++nb) {
    // Block nb has landed (and is visible to wgmma's proxy); every warpgroup is done with
    // the stage that the next copy overwrites.
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    const int stage = nb % Cfg::kStages;
    if (nb + 1 < n_end) load_kv(nb + 1, stage ^ 1);
    cp_async_commit();

    const int key_base = nb * Cfg::kBlockN;
    const bool needs_mask = mask.needs_mask(warp_row0, warp_row_end, key_base, key_base + Cfg::kBlockN);
    float s[1][Cfg::kNTiles][4];
    float block_max[1][2];
    compute_qk_scores_and_max<Cfg>(s, block_max, sQ, wg_row0, sK + stage * kKVElems, needs_mask, warp_row0,
                                   key_base, mask, mod, p.scale_log2);
    fwd_mma::merge_block_stats<Cfg>(row_max, row_sum, acc_o, block_max);
    compute_block_softmax_and_weighted_v<Cfg>(s, row_sum, acc_o, row_max, sV + stage * kKVElems, exp_scale);
  }
  cp_async_wait<0>();
  __syncthreads();  // every warpgroup is done with the K/V ring, reused below to stage O

  // Step 4 (shared helper): O through padded rows of the K/V ring, 16-byte stores.
  const int warp_rows_valid = min(16, rows_valid - 16 * warp);
  fwd_mma::normalize_output<Cfg>(acc_o, row_sum, row_max, sK + warp * 16 * Cfg::kStride,
                                 o + static_cast<int64_t>(16 * warp) * p.o_row_stride, p.o_row_stride,
                                 lse + 16 * warp, warp_rows_valid, p.d);
}

template <typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) fwd_sm90_kernel(const __grid_constant__ FwdParams p) {
#if FLASH_SM90_ENABLED
  fwd_sm90_block<Cfg, kVariant>(p);
#else
  __trap();  // never launched: see sm90_kernel_built
#endif
}

}  // namespace sm90

template <typename Cfg, int kVariant>
bool launch_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  auto kernel = sm90::fwd_sm90_kernel<Cfg, kVariant>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  set_smem_limit(kernel, Cfg::kSmemBytes, "fwd_sm90");
  const dim3 grid(ceil_div(p.sq, Cfg::kBlockM), p.hq, p.b);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  check_launch("fwd_sm90");
  return true;
}

template <int kDType, int kHeadDim, int kVariant>
bool run_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd_sm90<sm90::FwdConfig<typename ElementOf<kDType>::type, kHeadDim>, kVariant>(p, stream);
}

}  // namespace flash_cuda
