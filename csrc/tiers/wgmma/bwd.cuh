// tiers/wgmma/bwd.cuh — the Hopper (sm_90a) cp.async backward: the algorithm and fragment
// choreography of the mma.sync backward (tiers/mma/bwd.cuh: read its header first), with every
// product on warpgroup MMA. It runs deterministic=True (and what the warp-specialized kernels of
// bwd_ws.cuh decline); its dS^T staging and dQ product split are what bwd_ws.cuh builds on.
//
// The mma.sync backward is bound by shared memory: each B fragment a warp loads with ldmatrix
// feeds only 2-4 MMAs. wgmma reads its shared-memory operands itself, for a whole warpgroup
// (64 rows) at once, so the same tile feeds four times as many rows per read.
//
// Kernels (no atomics, bitwise reproducible, params.deterministic holds either way; a call that
// wants only dQ, or only dK / dV, launches only that side's kernel after delta, whatever
// deterministic says: launch_bwd_sm90):
//   1. bwd_preprocess_delta   delta = rowsum(dO * O) - dlse (core/bwd_preprocess.cuh)
//   2. dK/dV                  a CTA owns kBlockN = 64 * kWarpGroups keys, warpgroup w the keys
//                             64w..64w+63; it walks over every query block (and GQA head)
//                             that sees them. Per block of kBlockM queries:
//        S^T  = K Q^T       wgmma m64 n kBlockM, A = K (shared, K-major), B = Q (K-major)
//        dP^T = V dO^T      wgmma m64 n kBlockM, A = V, B = dO (both K-major)
//        P^T, dS^T          element-wise on the accumulators (core/softmax.cuh)
//        dV  += P^T dO      wgmma m64 n d, A = P^T (registers), B = dO (N-major)
//        dK  += dS^T Q      wgmma m64 n d, A = dS^T (registers), B = Q (N-major)
//   3. dQ                     a CTA owns 64 * kWarpGroups queries and walks over the key blocks:
//        S = Q K^T, dP = dO V^T (A and B in shared memory), P, dS, dQ += dS K (A = dS in
//        registers, B = K N-major).
// The wgmma accumulator has the mma.sync C layout per warp (core/fragment.cuh), so the
// element-wise steps of core/softmax.cuh run unchanged with one 16-row tile per warp.
#pragma once

#include "../../arch/host.h"
#include "../../arch/sm90.cuh"
#include "../../arch/tile.cuh"
#include "../../core/block.cuh"
#include "../../core/bwd_preprocess.cuh"
#include "../../core/bwd_smem.h"
#include "../../core/epilogue.cuh"
#include "../../core/softmax.cuh"
#include "../../core/tile_io.cuh"
#include "../../include/tiles.h"
#include "config.h"

namespace flash_cuda {
namespace sm90 {

template <int kHeadDim_, int kKVWarpGroups_, int kKVBlockM_, int kQWarpGroups_, int kQBlockN_,
          int kKVMinBlocks_ = 1, int kQMinBlocks_ = 1>
struct BwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kKVMinBlocks = kKVMinBlocks_;  // CTAs per SM the registers are budgeted for
  static constexpr int kQMinBlocks = kQMinBlocks_;
  // dK/dV kernel
  static constexpr int kKVWarpGroups = kKVWarpGroups_;
  static constexpr int kKVThreads = 128 * kKVWarpGroups;
  static constexpr int kKVBlockN = 64 * kKVWarpGroups;  // keys of a CTA
  static constexpr int kKVBlockM = kKVBlockM_;          // queries per step
  // dQ kernel
  static constexpr int kQWarpGroups = kQWarpGroups_;
  static constexpr int kQThreads = 128 * kQWarpGroups;
  static constexpr int kQBlockM = 64 * kQWarpGroups;  // queries of a CTA
  static constexpr int kQBlockN = kQBlockN_;          // keys per step

  static_assert(kHeadDim % 64 == 0, "swizzled slabs are 64 columns wide");
  static_assert(kKVBlockM % 16 == 0 && kQBlockN % 16 == 0, "wgmma k-steps are 16 wide");
  static_assert(kKVBlockM <= kKVThreads && kQBlockM <= kQThreads, "one thread per lse / delta entry");

  static_assert(kKVBlockM % 64 == 0, "dS^T slabs (bwd_ws.cuh) are 64 queries wide");

  // The kernels' shared memory (core/bwd_smem.h), rows of kHeadDim: every tile is whole 8-row
  // swizzle periods (its rows and kQBlockN a multiple of 8), so each slab starts aligned.
  template <typename T>
  using DkdvSmem = DkdvStorage<T, kHeadDim, kKVBlockN, kKVBlockM>;
  template <typename T>
  using DqSmem = DqStorage<T, kHeadDim, kQBlockM, kQBlockN>;
};

// The tiles per head-dim bucket come from the tile policy (tile_policy.h: BwdTile).
template <int kHeadDim, typename E = wgmma::BwdTile<kHeadDim>>
using BwdTraits = BwdConfig<E::kWidth, E::Tile::kKVWarpGroups, E::Tile::kKVBlockM, E::Tile::kQWarpGroups,
                            E::Tile::kQBlockN>;

// dV += P^T dO, dK += dS^T Q for one query block, one commit group: A operands are the
// warpgroup's P^T, dS^T fragments, B operands N-major (the reduction runs over queries), in slabs
// of kLineBytes-byte lines (bwd_ws.cuh's native d = 96 tiles: 64; else the 128-byte swizzle).
template <typename T, int kD, int kBlockM, int kLineBytes = kSwizzleBytes>
__device__ __forceinline__ void issue_dv_dk(float (&acc_dv)[1][kD / 8][4], float (&acc_dk)[1][kD / 8][4],
                                            const uint32_t (&a_pt)[kBlockM / 16][4],
                                            const uint32_t (&a_ds)[kBlockM / 16][4], const T* sdO, const T* sQ) {
  wgmma_fence();
  wgmma_rs<T>(acc_dv[0], a_pt, MNMajorIn<kBlockM, kLineBytes>{sdO, 0});
  wgmma_rs<T>(acc_dk[0], a_ds, MNMajorIn<kBlockM, kLineBytes>{sQ, 0});
  wgmma_commit();
}

// P and dS of a block pair: S = A B^T and dP = C D^T (every operand K-major in shared memory,
// kSteps k-steps; one commit group, waited for), then P (compute_probs) and dS = P (dP - delta)
// in place in dp (compute_ds). kTransposed: the warpgroup's rows are keys (S^T, dP^T).
// Softcap's derivative is not kept here: bwd_ws.cuh computes it by slices, or the mma.sync family.
template <bool kTransposed, int kVariant, int kSteps, typename T, int kNT, typename A, typename B, typename C,
          typename D>
__device__ __forceinline__ void probs_and_ds(float (&s)[1][kNT][4], float (&dp)[1][kNT][4], const A& a, const B& b,
                                             const C& c, const D& d, const float* lse, const float* delta,
                                             bool needs_mask, int row0, int col0, const AttnMask& mask,
                                             const BwdParams& p, const SeqInfo& seq, int h) {
  wgmma_fence();
  wgmma_ss<kSteps, false, T>(s[0], a, b);
  wgmma_ss<kSteps, false, T>(dp[0], c, d);
  wgmma_commit();
  wgmma_wait<0>();
  fence_accumulator(s[0]);
  fence_accumulator(dp[0]);
  DtanhTile<kVariant, 1, 1> no_dtanh;
  compute_probs<kTransposed, kVariant>(s, no_dtanh, lse, needs_mask, row0, col0, mask, p, seq, h);
  compute_ds<kTransposed, kVariant>(dp, s, no_dtanh, delta);
}

// A warp's 16 keys of dK (scaled) and dV, rows past the sequence left out; through the warp's
// own staging rows swarp (core/epilogue.cuh: store_rows_staged) where the kernel has them, else straight
// from registers.
template <typename T, int kD, bool kStaged = false>
__device__ __forceinline__ void store_dk_dv(const BwdParams& p, const SeqInfo& seq,
                                            const float (&acc_dk)[1][kD / 8][4],
                                            const float (&acc_dv)[1][kD / 8][4], int hkv, int warp_key0,
                                            T* swarp = nullptr) {
  const int rows_valid = seq.sk - warp_key0;
  auto store = [&](const float(&acc)[1][kD / 8][4], void* base, int64_t batch_stride, int64_t head_stride,
                   int64_t row_stride, float scale) {
    T* rows = seq.k_rows(static_cast<T*>(base), batch_stride, head_stride, row_stride, hkv) +
              static_cast<int64_t>(warp_key0) * row_stride;
    if constexpr (kStaged) {
      store_rows_staged<T>(acc, swarp, rows, row_stride, rows_valid, p.d, scale);
    } else {
      store_rows<T>(acc, rows, row_stride, rows_valid, p.d, scale);
    }
  };
  store(acc_dv, p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, 1.f);
  store(acc_dk, p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, p.scale);
}

// ---------------------------------------------------------------------------------
// dK/dV kernel. grid (ceil(sk / kKVBlockN), hkv, b).
// ---------------------------------------------------------------------------------
template <typename T, typename Cfg, int kVariant>
__device__ __forceinline__ void bwd_dkdv_block(const BwdParams& p) {
  constexpr int kD = Cfg::kHeadDim, kThreads = Cfg::kKVThreads;
  constexpr int kBlockN = Cfg::kKVBlockN, kBlockM = Cfg::kKVBlockM;  // keys of the CTA, queries per step
  // Stages are addressed as offsets from the first: nvcc schedules indexing of the member arrays
  // differently, and this is the code measured.
  constexpr int kQTile = kBlockM * kD;  // elements of one Q or dO stage
  extern __shared__ unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::template DkdvSmem<T>*>(aligned_smem_base<true>(smem_raw));
  T* sQ = smem.q[0];
  T* sdO = smem.dout[0];
  float* sLse = smem.lse[0];
  float* sDelta = smem.delta[0];

  const int tid = threadIdx.x, warp = tid / 32, wg = warp / 4;
  const int hkv = blockIdx.y;
  const SeqInfo seq = SeqInfo::make<kVariant != kPlain>(p, blockIdx.z);
  const int n0 = blockIdx.x * kBlockN;
  if (n0 >= seq.sk) return;               // varlen: a sequence shorter than max_seqlen_k
  const int wg_key0 = n0 + 64 * wg;       // first key of this warpgroup
  const int warp_key0 = n0 + 16 * warp;   // first key of this warp
  const int group = p.hq / p.hkv;
  const AttnMask mask = seq.mask<kVariant != kPlain>(p);

  const BlockRange m_range = BlockRange::queries_of(mask, n0, n0 + kBlockN, kBlockM);
  const int h_begin = hkv * group, h_end = h_begin + group;

  auto load_query_block = [&](int h, int m_block, int stage) {
    copy_query_block_async<kBlockM, kD, kThreads, SwizzledTile<kBlockM>>(p, seq, h, m_block * kBlockM, sQ + stage * kQTile,
                                                                         sdO + stage * kQTile, sLse + stage * kBlockM,
                                                                         sDelta + stage * kBlockM, tid);
  };


  int h = h_begin, m_block = m_range.begin, stage = 0;
  if (m_range.count() == 0) h = h_end;  // no query sees these keys
  if (h < h_end) {
    copy_key_block_async<kBlockN, kD, kThreads, SwizzledTile<kBlockN>>(p, seq, hkv, n0, smem.kv[0], smem.kv[1], tid);
    load_query_block(h, m_block, 0);
    cp_async_commit();
  }

  float acc_dv[1][kD / 8][4];
  float acc_dk[1][kD / 8][4];
  zero_fill(acc_dv);
  zero_fill(acc_dk);

  for (; h < h_end; KeyTileSteps::next(m_range, h_end, h, m_block), stage ^= 1) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    prefetch_next_query_block(m_range, h_end, h, m_block, stage, load_query_block);

    const int m0 = m_block * kBlockM;
    // Warpgroup-uniform skip (wgmma is a warpgroup instruction); masking is per warp.
    const bool wg_sees_block = mask.any_visible(m0, m0 + kBlockM, wg_key0, wg_key0 + 64);
    if (wg_sees_block) {
      const bool needs_mask = mask.needs_mask(m0, m0 + kBlockM, warp_key0, warp_key0 + 16);
      const T* sQ_s = sQ + stage * kQTile;
      const T* sdO_s = sdO + stage * kQTile;

      // S^T = K Q^T and dP^T = V dO^T, P^T and dS^T.
      float pt[1][kBlockM / 8][4];
      float dst[1][kBlockM / 8][4];
      probs_and_ds<true, kVariant, kD / 16, T>(pt, dst, KMajor<kBlockN>{smem.kv[0], 64 * wg}, KMajor<kBlockM>{sQ_s, 0},
                                               KMajor<kBlockN>{smem.kv[1], 64 * wg}, KMajor<kBlockM>{sdO_s, 0},
                                               sLse + stage * kBlockM, sDelta + stage * kBlockM, needs_mask,
                                               warp_key0, m0, mask, p, seq, h);
      uint32_t a_pt[kBlockM / 16][4];
      accumulator_to_a<T>(a_pt, pt[0]);
      uint32_t a_ds[kBlockM / 16][4];
      accumulator_to_a<T>(a_ds, dst[0]);

      issue_dv_dk<T, kD, kBlockM>(acc_dv, acc_dk, a_pt, a_ds, sdO_s, sQ_s);
      wgmma_wait<0>();
      fence_accumulator(acc_dv[0]);
      fence_accumulator(acc_dk[0]);
    }
  }

  store_dk_dv<T, kD>(p, seq, acc_dk, acc_dv, hkv, warp_key0);
}

// ---------------------------------------------------------------------------------
// dQ kernel. grid (ceil(sq / kQBlockM), hq, b).
// ---------------------------------------------------------------------------------
template <typename T, typename Cfg, int kVariant>
__device__ __forceinline__ void bwd_dq_block(const BwdParams& p) {
  constexpr int kD = Cfg::kHeadDim, kThreads = Cfg::kQThreads;
  constexpr int kBlockM = Cfg::kQBlockM, kBlockN = Cfg::kQBlockN;  // queries of the CTA, keys per step
  extern __shared__ unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::template DqSmem<T>*>(aligned_smem_base<true>(smem_raw));
  constexpr int kKTile = kBlockN * kD;  // elements of one K or V stage (addressed as in bwd_dkdv_block)
  T* sK = smem.k[0];
  T* sV = smem.v[0];

  const int tid = threadIdx.x, warp = tid / 32, wg = warp / 4;
  const int h = blockIdx.y;
  const SeqInfo seq = SeqInfo::make<kVariant != kPlain>(p, blockIdx.z);
  const AttnMask mask = seq.mask<kVariant != kPlain>(p);
  const int m_block = query_block_of_cta(mask);
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.sq) return;  // varlen: a sequence shorter than max_seqlen_q
  const int hkv = h / (p.hq / p.hkv);
  const int wg_q0 = m0 + 64 * wg;
  const int warp_q0 = m0 + 16 * warp;
  const int warp_q_end = min(warp_q0 + 16, seq.sq);

  const BlockRange n_range = BlockRange::keys_of(mask, m0, m0 + kBlockM, kBlockN);

  auto load_key_block = [&](int n_block, int stage) {
    copy_key_block_async<kBlockN, kD, kThreads, SwizzledTile<kBlockN>>(p, seq, hkv, n_block * kBlockN,
                                                                       sK + stage * kKTile, sV + stage * kKTile, tid);
  };


  if (n_range.count() > 0) {
    copy_query_block_async<kBlockM, kD, kThreads, SwizzledTile<kBlockM>>(p, seq, h, m0, smem.q, smem.dout, smem.lse,
                                                                         smem.delta, tid);
    load_key_block(n_range.begin, n_range.begin & 1);  // block n lives in ring slot n % 2
    cp_async_commit();
  }

  float acc_dq[1][kD / 8][4];
  zero_fill(acc_dq);

  for (int n_block = n_range.begin; n_block < n_range.end; ++n_block) {
    const int stage = n_block & 1;
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    if (n_block + 1 < n_range.end) {
      load_key_block(n_block + 1, stage ^ 1);
      cp_async_commit();
    }

    const int n0 = n_block * kBlockN;
    const bool wg_sees_block = mask.any_visible(wg_q0, wg_q0 + 64, n0, n0 + kBlockN);
    if (!wg_sees_block) continue;
    const bool needs_mask = mask.needs_mask(warp_q0, warp_q_end, n0, n0 + kBlockN);
    const T* sK_s = sK + stage * kKTile;
    const T* sV_s = sV + stage * kKTile;

    // S = Q K^T and dP = dO V^T, P and dS.
    float s[1][kBlockN / 8][4];
    float ds[1][kBlockN / 8][4];
    probs_and_ds<false, kVariant, kD / 16, T>(s, ds, KMajor<kBlockM>{smem.q, 64 * wg}, KMajor<kBlockN>{sK_s, 0},
                                              KMajor<kBlockM>{smem.dout, 64 * wg}, KMajor<kBlockN>{sV_s, 0},
                                              smem.lse + 16 * warp, smem.delta + 16 * warp, needs_mask, warp_q0, n0,
                                              mask, p, seq, h);
    uint32_t a_ds[kBlockN / 16][4];
    accumulator_to_a<T>(a_ds, ds[0]);

    // dQ += dS K (B = K N-major: the reduction runs over keys).
    wgmma_fence();
    wgmma_rs<T>(acc_dq[0], a_ds, MNMajor<kBlockN>{sK_s, 0});
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulator(acc_dq[0]);
  }

  T* dq = seq.q_rows(static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, h) +
          static_cast<int64_t>(warp_q0) * p.dq_row_stride;
  store_rows<T>(acc_dq, dq, p.dq_row_stride, seq.sq - warp_q0, p.d, p.scale);
}

template <typename T, typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kKVThreads, Cfg::kKVMinBlocks) bwd_dkdv_sm90_kernel(const __grid_constant__ BwdParams p) {
  FLASH_SM90_KERNEL_BODY(bwd_dkdv_block<T, Cfg, kVariant>(p));  // (sm90_kernel_built)
}

template <typename T, typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kQThreads, Cfg::kQMinBlocks) bwd_dq_sm90_kernel(const __grid_constant__ BwdParams p) {
  FLASH_SM90_KERNEL_BODY(bwd_dq_block<T, Cfg, kVariant>(p));  // (sm90_kernel_built)
}

}  // namespace sm90

// The deterministic two-kernel backward (delta, dK/dV, dQ), of the gradients the call wants
// (include/params.h: bwd_wants_dq / _dkdv; the two kernels share nothing but delta); false,
// having launched nothing, off sm_90 or in a build without the 90a target.
template <typename T, typename Cfg, int kVariant>
bool launch_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  auto dkdv = sm90::bwd_dkdv_sm90_kernel<T, Cfg, kVariant>;
  auto dq = sm90::bwd_dq_sm90_kernel<T, Cfg, kVariant>;
  constexpr size_t kDkdvBytes = sm90::smem_request_bytes<typename Cfg::template DkdvSmem<T>>();
  constexpr size_t kDqBytes = sm90::smem_request_bytes<typename Cfg::template DqSmem<T>>();
  if (p.sm_arch != 90 || !sm90_kernel_built(dkdv)) return false;
  launch_bwd_preprocess<T>(p, stream);
  if (bwd_wants_dkdv(p)) {
    set_smem_limit(dkdv, kDkdvBytes, "bwd_dkdv_sm90");
    dkdv<<<dim3(ceil_div(p.sk, Cfg::kKVBlockN), p.hkv, p.b), Cfg::kKVThreads, kDkdvBytes, stream>>>(p);
    check_launch("bwd_dkdv_sm90");
  }
  if (bwd_wants_dq(p)) {
    set_smem_limit(dq, kDqBytes, "bwd_dq_sm90");
    dq<<<dim3(ceil_div(p.sq, Cfg::kQBlockM), p.hq, p.b), Cfg::kQThreads, kDqBytes, stream>>>(p);
    check_launch("bwd_dq_sm90");
  }
  return true;
}

}  // namespace flash_cuda
