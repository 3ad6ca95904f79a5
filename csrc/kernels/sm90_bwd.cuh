// sm90_bwd.cuh — the Hopper (sm_90a) backward of flash_cuda: the algorithm and fragment
// choreography of mma_bwd.cuh (read its header first), with every product on warpgroup MMA.
//
// The mma.sync backward is bound by shared memory: each B fragment a warp loads with ldmatrix
// feeds only 2-4 MMAs. wgmma reads its shared-memory operands itself, for a whole warpgroup
// (64 rows) at once, so the same tile feeds four times as many rows per read.
//
// Kernels (no atomics, bitwise reproducible, params.deterministic holds either way):
//   1. bwd_preprocess_delta   delta = rowsum(dO * O) - dlse (bwd_preprocess.cuh)
//   2. dK/dV                  a CTA owns kBlockN = 64 * kWarpGroups keys, warpgroup w the keys
//                             64w..64w+63; it walks over every query block (and GQA head)
//                             that sees them. Per block of kBlockM queries:
//        S^T  = K Q^T       wgmma m64 n kBlockM, A = K (shared, K-major), B = Q (K-major)
//        dP^T = V dO^T      wgmma m64 n kBlockM, A = V, B = dO (both K-major)
//        P^T, dS^T          element-wise on the accumulators (mma_bwd.cuh helpers)
//        dV  += P^T dO      wgmma m64 n d, A = P^T (registers), B = dO (N-major)
//        dK  += dS^T Q      wgmma m64 n d, A = dS^T (registers), B = Q (N-major)
//   3. dQ                     a CTA owns 64 * kWarpGroups queries and walks over the key blocks:
//        S = Q K^T, dP = dO V^T (A and B in shared memory), P, dS, dQ += dS K (A = dS in
//        registers, B = K N-major).
// Or, with params.dq_accum (FLASH_CUDA_SM90_BWD=atomic, or a call the warp-specialized kernel of
// sm90_bwd_ws.cuh cannot take; never deterministic), kernel 2 also computes dQ += dS K per query
// block from dS^T staged in shared memory and adds it to dq_accum with float atomics, and
// convert_dq_rows writes dq from it instead of kernel 3.
// The wgmma accumulator has the mma.sync C layout per warp (wgmma_ops.cuh), so the
// element-wise helpers of mma_bwd.cuh run unchanged with one 16-row tile per warp.
#pragma once

#include "../launch.h"
#include "mma_bwd.cuh"
#include "sm90_common.cuh"

namespace flash_cuda {
namespace sm90 {

template <int kHeadDim_, int kKVWarpGroups_, int kKVBlockM_, int kQWarpGroups_, int kQBlockN_,
          int kKVMinBlocks_ = 1, int kQMinBlocks_ = 1>
struct BwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kKVMinBlocks = kKVMinBlocks_;  // CTAs per SM the registers are budgeted for
  static constexpr int kQMinBlocks = kQMinBlocks_;
  static constexpr int kElemBytes = 2;
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

  // K, V tiles [kKVBlockN]; two stages of Q, dO tiles [kKVBlockM]; two stages of lse, delta.
  static constexpr size_t kDkdvTiles = size_t(2 * kKVBlockN + 2 * 2 * kKVBlockM) * kHeadDim * kElemBytes;
  static constexpr size_t kDkdvSmem = kDkdvTiles + 2 * 2 * kKVBlockM * sizeof(float) + 1024;
  // The atomic-dQ variant adds dS^T [kKVBlockN keys][kKVBlockM queries] after the statistics.
  static constexpr size_t kDkdvSmemAtomicDq = kDkdvSmem + size_t(kKVBlockN) * kKVBlockM * kElemBytes;
  static_assert((kDkdvTiles + 2 * 2 * kKVBlockM * sizeof(float)) % 1024 == 0, "dS^T tile stays aligned");
  static_assert(kKVBlockM % 64 == 0, "dS^T slabs are 64 queries wide");
  // Q, dO tiles [kQBlockM]; two stages of K, V tiles [kQBlockN]; lse, delta.
  static constexpr size_t kDqTiles = size_t(2 * kQBlockM + 2 * 2 * kQBlockN) * kHeadDim * kElemBytes;
  static constexpr size_t kDqSmem = kDqTiles + 2 * kQBlockM * sizeof(float) + 1024;
};

template <int kHeadDim> struct BwdTraits;
// Measured on the H200 (OPTIMIZATION.md, bf16, S = 4k and 16k, causal and not): larger steps
// help while the accumulators fit (d = 64: 128 queries / keys per step, 255 -> 285 TFLOPS at
// S = 4k; d = 128: 96 keys per dQ step, 339 -> 348).
//                                              d  KV wgs  M    Q wgs  N
template <> struct BwdTraits<64>  : BwdConfig<64,  2,      128, 2,     128> {};
template <> struct BwdTraits<128> : BwdConfig<128, 2,      64,  2,     96> {};

// ---------------------------------------------------------------------------------
// dK/dV kernel. grid (ceil(sk / kKVBlockN), hkv, b).
// ---------------------------------------------------------------------------------
// red.global.add.v2.f32: two consecutive floats added in L2, no value returned.
__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
#if FLASH_SM90_ENABLED
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
#endif
}

// kDqAtomic: the CTA also adds this key block's share of dQ, dQ += dS K, into params.dq_accum
// (float32, zero-filled) with atomics, and the dQ kernel is not launched: 5 products per block
// pair instead of 7, at the price of float atomics (non-deterministic summation order).
// dS^T goes through shared memory: each warpgroup holds 64 keys of it, the product needs all
// kBlockN keys for its queries. The helpers below are that path's steps; the warp-specialized
// backward (sm90_bwd_ws.cuh) runs the same ones.

// Writes this warp's rows of dS^T (its keys) from the A fragments of dS^T into the shared tile
// [kBlockN keys][kBlockM queries], in the swizzled layout the dQ product reads as its
// (transposed) A operand. A fragment kk holds columns 16kk + 2t (words 0, 1: rows g, g + 8)
// and 16kk + 8 + 2t (words 2, 3). Rows r and r + 8 share r % 8, so one XOR pattern serves
// both. The pattern is made opaque per block: hoisted out of the loop, the 4 x kBlockM / 16
// addresses would stay live next to the accumulators.
template <typename Cfg>
__device__ __forceinline__ void stage_ds_transposed(void* sdS, const uint32_t (&a_ds)[Cfg::kKVBlockM / 16][4],
                                                    int tid) {
  constexpr int kBlockN = Cfg::kKVBlockN;
  const int lane = tid % 32, warp = tid / 32;
  const int r = 16 * warp + lane / 4;  // warp w of the consumers holds keys 16w .. 16w + 15
  int rx = r % 8;
  asm volatile("" : "+r"(rx));
  unsigned char* row = reinterpret_cast<unsigned char*>(sdS) + r * kSwizzleBytes + 4 * (lane % 4);
#pragma unroll
  for (int kk = 0; kk < Cfg::kKVBlockM / 16; ++kk) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // columns 16kk + 8 half + 2t
      unsigned char* at = row + (kk / 4) * kBlockN * kSwizzleBytes + (((2 * kk + half) % 8) ^ rx) * 16;
      *reinterpret_cast<uint32_t*>(at) = a_ds[kk][2 * half];
      *reinterpret_cast<uint32_t*>(at + 8 * kSwizzleBytes) = a_ds[kk][2 * half + 1];
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
// queries x two halves of d (d = 128), or two 64-query halves x all of d (d = 64). Issued as
// one commit group after both warpgroups staged their keys' rows of dS^T (the caller waits).
template <typename Cfg>
struct DqSplit {
  static constexpr int kN = Cfg::kHeadDim * (Cfg::kKVBlockM / 64) / 2;  // dQ columns of one warpgroup
  static_assert(Cfg::kKVWarpGroups == 2 && (Cfg::kKVBlockM / 64) * (Cfg::kHeadDim / kN) == 2 && kN % 64 == 0,
                "two warpgroups split the dQ product");
  __device__ __forceinline__ static int row0(int wg) { return Cfg::kKVBlockM == 64 ? 0 : 64 * wg; }
  __device__ __forceinline__ static int col0(int wg) { return Cfg::kKVBlockM == 64 ? kN * wg : 0; }
};

template <typename T, typename Cfg>
__device__ __forceinline__ void issue_dq_product(float (&acc)[1][DqSplit<Cfg>::kN / 8][4], const T* sdS, const T* sK,
                                                 int wg) {
  using Split = DqSplit<Cfg>;
  constexpr int kBlockN = Cfg::kKVBlockN;
  const T* a_tile = sdS + (Split::row0(wg) / 64) * kBlockN * 64;  // dS^T slab: keys x 64 queries
  const T* b_tile = sK + (Split::col0(wg) / 64) * kBlockN * 64;   // K slab(s): keys x kN columns
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    // A = dS (M = queries, K = keys) read transposed from dS^T; B = K (N-major).
    Wgmma<T, Split::kN>::template ss<1, 1>(acc[0], desc_mn_major<kBlockN>(a_tile, 0, kk),
                                           desc_mn_major<kBlockN>(b_tile, 0, kk), kk > 0);
  }
  wgmma_commit();
}

// dV += P^T dO, dK += dS^T Q for one query block, one commit group: A operands are the
// warpgroup's P^T, dS^T fragments, B operands N-major (the reduction runs over queries).
template <typename T, int kD, int kBlockM>
__device__ __forceinline__ void issue_dv_dk(float (&acc_dv)[1][kD / 8][4], float (&acc_dk)[1][kD / 8][4],
                                            const uint32_t (&a_pt)[kBlockM / 16][4],
                                            const uint32_t (&a_ds)[kBlockM / 16][4], const T* sdO, const T* sQ) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk)
    Wgmma<T, kD>::template rs<1>(acc_dv[0], a_pt[kk], desc_mn_major<kBlockM>(sdO, 0, kk), 1);
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk)
    Wgmma<T, kD>::template rs<1>(acc_dk[0], a_ds[kk], desc_mn_major<kBlockM>(sQ, 0, kk), 1);
  wgmma_commit();
}

// Adds a warpgroup's dQ accumulator (rows of query block m0, unscaled: convert_dq_rows_kernel
// applies the scale) to dq_accum, two consecutive floats per atomic. The layout: the rows of the
// statistics (flash_params.h), d floats each.
template <typename Cfg>
__device__ __forceinline__ void add_dq_atomic(const BwdParams& p, const SeqInfo& seq,
                                              const float (&acc)[1][DqSplit<Cfg>::kN / 8][4], int h, int m0, int wg,
                                              int tid) {
  using Split = DqSplit<Cfg>;
  const int lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int q = m0 + Split::row0(wg) + 16 * (warp % 4) + g + 8 * half;
    if (q >= seq.sq) continue;
    float* row = p.dq_accum + (seq.stat_offset(p, h) + q) * p.d + Split::col0(wg);
#pragma unroll
    for (int j = 0; j < Split::kN / 8; ++j) {
      const int col = 8 * j + 2 * t;
      if (Split::col0(wg) + col < p.d) red_add_v2(row + col, acc[0][j][2 * half], acc[0][j][2 * half + 1]);
    }
  }
}

// A warp's 16 keys of dK (scaled) and dV, rows past the sequence left out; through the warp's
// own staging rows swarp (bwd_mma::store_rows_staged) where the kernel has them, else straight
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
      bwd_mma::store_rows_staged<T, kD>(acc, swarp, rows, row_stride, rows_valid, p.d, scale);
    } else {
      bwd_mma::store_rows<T, 1, kD>(acc, rows, row_stride, rows_valid, p.d, scale);
    }
  };
  store(acc_dv, p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, 1.f);
  store(acc_dk, p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, p.scale);
}

// dq = scale * dq_accum for the row layout of add_dq_atomic, one warp per row; a packed batch
// is one sequence of total_q rows, as in the delta preprocess.
template <typename T>
__global__ void __launch_bounds__(256) convert_dq_rows_kernel(const __grid_constant__ BwdParams p, int rows_per_head) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= static_cast<int64_t>(p.b) * p.hq * rows_per_head) return;
  const int i = static_cast<int>(row % rows_per_head);
  const int h = static_cast<int>(row / rows_per_head % p.hq);
  const int bi = static_cast<int>(row / rows_per_head / p.hq);
  const float* acc = p.dq_accum + (bi * p.stat_batch_stride + h * p.stat_head_stride + i) * p.d;
  T* dq = static_cast<T*>(p.dq) + bi * p.dq_batch_stride + h * p.dq_head_stride + i * p.dq_row_stride;
  for (int c = 4 * lane; c < p.d; c += 128) {  // d % 8 == 0
    const float4 a = *reinterpret_cast<const float4*>(acc + c);
    *reinterpret_cast<uint32_t*>(dq + c) = pack2<T>(a.x * p.scale, a.y * p.scale);
    *reinterpret_cast<uint32_t*>(dq + c + 2) = pack2<T>(a.z * p.scale, a.w * p.scale);
  }
}

template <typename T>
void launch_convert_dq_rows(const BwdParams& params, cudaStream_t stream) {
  BwdParams p = params;
  if (p.cu_seqlens_q != nullptr) p.b = 1;  // packed: rows [h][0, total_q)
  const int rows_per_head = p.cu_seqlens_q != nullptr ? p.total_q : p.sq;
  const int64_t rows = static_cast<int64_t>(p.b) * p.hq * rows_per_head;
  if (rows == 0) return;
  convert_dq_rows_kernel<T><<<static_cast<unsigned>((rows + 7) / 8), 256, 0, stream>>>(p, rows_per_head);
  check_launch("convert_dq_rows");
}

// dQ[m0 .., :] += dS K for one query block (kDqAtomic), after both warpgroups wrote their
// keys' rows of dS^T (a warpgroup that skipped the block writes zeros).
template <typename T, typename Cfg>
__device__ __forceinline__ void accumulate_dq_atomic(const BwdParams& p, const SeqInfo& seq, T* sdS, const T* sK,
                                                     bool wg_sees_block, bool cta_sees_block, int h, int m0,
                                                     int tid) {
  const int wg = tid / 128;
  if (!wg_sees_block) zero_ds_rows<Cfg>(sdS, wg, tid);
  fence_proxy_async();  // the generic-proxy writes of dS^T, before the tensor cores read them
  __syncthreads();
  if (!cta_sees_block) return;
  float acc[1][DqSplit<Cfg>::kN / 8][4];
  issue_dq_product<T, Cfg>(acc, sdS, sK, wg);
  wgmma_wait<0>();
  fence_accumulator(acc[0]);
  add_dq_atomic<Cfg>(p, seq, acc, h, m0, wg, tid);
}

template <typename T, typename Cfg, int kVariant, bool kDqAtomic>
__device__ __forceinline__ void bwd_dkdv_block(const BwdParams& p) {
  constexpr int kD = Cfg::kHeadDim;
  constexpr int kBlockN = Cfg::kKVBlockN;
  constexpr int kBlockM = Cfg::kKVBlockM;
  constexpr int kThreads = Cfg::kKVThreads;
  constexpr int kQTile = kBlockM * kD;  // elements of one Q or dO stage

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem_base<true>(smem_raw);
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kBlockN * kD;
  T* sQ = sV + kBlockN * kD;   // [2] stages
  T* sdO = sQ + 2 * kQTile;    // [2] stages
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kQTile);  // [2][kBlockM]
  float* sDelta = sLse + 2 * kBlockM;                         // [2][kBlockM]
  T* sdS = reinterpret_cast<T*>(sDelta + 2 * kBlockM);        // [kBlockN][kBlockM] (kDqAtomic)

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int wg = warp / 4;
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
    const int m0 = m_block * kBlockM;
    const T* q = seq.q_rows(static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride, p.q_row_stride, h) +
                 static_cast<int64_t>(m0) * p.q_row_stride;
    const T* dout = seq.q_rows(static_cast<const T*>(p.dout), p.do_batch_stride, p.do_head_stride,
                               p.do_row_stride, h) + static_cast<int64_t>(m0) * p.do_row_stride;
    load_tile_swizzled<kBlockM, kD, kThreads>(sQ + stage * kQTile, q, p.q_row_stride, seq.sq - m0, p.d, tid);
    load_tile_swizzled<kBlockM, kD, kThreads>(sdO + stage * kQTile, dout, p.do_row_stride, seq.sq - m0, p.d, tid);
    const int64_t row0 = seq.stat_offset(p, h) + m0;
    bwd_mma::load_row_stats_async<kBlockM>(sLse + stage * kBlockM, p.softmax_lse + row0, seq.sq - m0);
    bwd_mma::load_row_stats_async<kBlockM>(sDelta + stage * kBlockM, p.delta + row0, seq.sq - m0);
  };

  int h = h_begin, m_block = m_range.begin, stage = 0;
  if (m_range.count() == 0) h = h_end;  // no query sees these keys
  if (h < h_end) {
    const T* k = seq.k_rows(static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride, p.k_row_stride, hkv) +
                 static_cast<int64_t>(n0) * p.k_row_stride;
    const T* v = seq.k_rows(static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride, p.v_row_stride, hkv) +
                 static_cast<int64_t>(n0) * p.v_row_stride;
    load_tile_swizzled<kBlockN, kD, kThreads>(sK, k, p.k_row_stride, seq.sk - n0, p.d, tid);
    load_tile_swizzled<kBlockN, kD, kThreads>(sV, v, p.v_row_stride, seq.sk - n0, p.d, tid);
    load_query_block(h, m_block, 0);
    cp_async_commit();
  }

  float acc_dv[1][kD / 8][4];
  float acc_dk[1][kD / 8][4];
  bwd_mma::zero_fill(acc_dv);
  bwd_mma::zero_fill(acc_dk);

  while (h < h_end) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    int next_h = h, next_m_block = m_block + 1;
    if (next_m_block == m_range.end) {
      next_m_block = m_range.begin;
      ++next_h;
    }
    if (next_h < h_end) {
      load_query_block(next_h, next_m_block, stage ^ 1);
      cp_async_commit();
    }

    const int m0 = m_block * kBlockM;
    // Warpgroup-uniform skip (wgmma is a warpgroup instruction); masking is per warp.
    const bool wg_sees_block = mask.any_visible(m0, m0 + kBlockM, wg_key0, wg_key0 + 64);
    if (wg_sees_block) {
      const bool needs_mask = mask.needs_mask(m0, m0 + kBlockM, warp_key0, warp_key0 + 16);
      const T* sQ_s = sQ + stage * kQTile;
      const T* sdO_s = sdO + stage * kQTile;

      // S^T = K Q^T and dP^T = V dO^T, one commit group.
      float pt[1][kBlockM / 8][4];
      float dst[1][kBlockM / 8][4];
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        Wgmma<T, kBlockM>::template ss<0>(pt[0], desc_k_major<kBlockN>(sK, 64 * wg, ks),
                                          desc_k_major<kBlockM>(sQ_s, 0, ks), ks > 0);
      }
#pragma unroll
      for (int ks = 0; ks < kD / 16; ++ks) {
        Wgmma<T, kBlockM>::template ss<0>(dst[0], desc_k_major<kBlockN>(sV, 64 * wg, ks),
                                          desc_k_major<kBlockM>(sdO_s, 0, ks), ks > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_accumulator(pt[0]);
      fence_accumulator(dst[0]);

      float no_dtanh[1][1][4];  // softcap's derivative: sm90_bwd_ws.cuh or mma.sync (run_bwd_sm90)
      bwd_mma::compute_probs<true, kVariant>(pt, no_dtanh, sLse + stage * kBlockM, needs_mask, warp_key0, m0, mask,
                                          p, seq, h);
      uint32_t a_pt[kBlockM / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) accumulator_to_a<T>(a_pt[kk], pt[0], kk);
      bwd_mma::compute_ds<true, kVariant>(dst, pt, no_dtanh, sDelta + stage * kBlockM);
      uint32_t a_ds[kBlockM / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) accumulator_to_a<T>(a_ds[kk], dst[0], kk);
      if constexpr (kDqAtomic) stage_ds_transposed<Cfg>(sdS, a_ds, tid);

      issue_dv_dk<T, kD, kBlockM>(acc_dv, acc_dk, a_pt, a_ds, sdO_s, sQ_s);
      wgmma_wait<0>();
      fence_accumulator(acc_dv[0]);
      fence_accumulator(acc_dk[0]);
    }
    if constexpr (kDqAtomic) {
      accumulate_dq_atomic<T, Cfg>(p, seq, sdS, sK, wg_sees_block, mask.any_visible(m0, m0 + kBlockM, n0, n0 + kBlockN),
                                   h, m0, tid);
    }
    h = next_h;
    m_block = next_m_block;
    stage ^= 1;
  }

  store_dk_dv<T, kD>(p, seq, acc_dk, acc_dv, hkv, warp_key0);
}

// ---------------------------------------------------------------------------------
// dQ kernel. grid (ceil(sq / kQBlockM), hq, b).
// ---------------------------------------------------------------------------------
template <typename T, typename Cfg, int kVariant>
__device__ __forceinline__ void bwd_dq_block(const BwdParams& p) {
  constexpr int kD = Cfg::kHeadDim;
  constexpr int kBlockM = Cfg::kQBlockM;
  constexpr int kBlockN = Cfg::kQBlockN;
  constexpr int kThreads = Cfg::kQThreads;
  constexpr int kKTile = kBlockN * kD;

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem_base<true>(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + kBlockM * kD;
  T* sK = sdO + kBlockM * kD;  // [2] stages
  T* sV = sK + 2 * kKTile;     // [2] stages
  float* sLse = reinterpret_cast<float*>(sV + 2 * kKTile);  // [kBlockM]
  float* sDelta = sLse + kBlockM;                            // [kBlockM]

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int wg = warp / 4;
  const int h = blockIdx.y;
  const SeqInfo seq = SeqInfo::make<kVariant != kPlain>(p, blockIdx.z);
  const AttnMask mask = seq.mask<kVariant != kPlain>(p);
  const int m_block = mask.right_bounded() ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = m_block * kBlockM;
  if (m0 >= seq.sq) return;  // varlen: a sequence shorter than max_seqlen_q
  const int hkv = h / (p.hq / p.hkv);
  const int wg_q0 = m0 + 64 * wg;
  const int warp_q0 = m0 + 16 * warp;
  const int warp_q_end = min(warp_q0 + 16, seq.sq);

  const BlockRange n_range = BlockRange::keys_of(mask, m0, m0 + kBlockM, kBlockN);

  auto load_key_block = [&](int n_block, int stage) {
    const int n0 = n_block * kBlockN;
    const T* k = seq.k_rows(static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride, p.k_row_stride, hkv) +
                 static_cast<int64_t>(n0) * p.k_row_stride;
    const T* v = seq.k_rows(static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride, p.v_row_stride, hkv) +
                 static_cast<int64_t>(n0) * p.v_row_stride;
    load_tile_swizzled<kBlockN, kD, kThreads>(sK + stage * kKTile, k, p.k_row_stride, seq.sk - n0, p.d, tid);
    load_tile_swizzled<kBlockN, kD, kThreads>(sV + stage * kKTile, v, p.v_row_stride, seq.sk - n0, p.d, tid);
  };

  if (n_range.count() > 0) {
    const T* q = seq.q_rows(static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride, p.q_row_stride, h) +
                 static_cast<int64_t>(m0) * p.q_row_stride;
    const T* dout = seq.q_rows(static_cast<const T*>(p.dout), p.do_batch_stride, p.do_head_stride,
                               p.do_row_stride, h) + static_cast<int64_t>(m0) * p.do_row_stride;
    load_tile_swizzled<kBlockM, kD, kThreads>(sQ, q, p.q_row_stride, seq.sq - m0, p.d, tid);
    load_tile_swizzled<kBlockM, kD, kThreads>(sdO, dout, p.do_row_stride, seq.sq - m0, p.d, tid);
    const int64_t row0 = seq.stat_offset(p, h) + m0;
    bwd_mma::load_row_stats_async<kBlockM>(sLse, p.softmax_lse + row0, seq.sq - m0);
    bwd_mma::load_row_stats_async<kBlockM>(sDelta, p.delta + row0, seq.sq - m0);
    load_key_block(n_range.begin, n_range.begin & 1);  // block n lives in ring slot n % 2
    cp_async_commit();
  }

  float acc_dq[1][kD / 8][4];
  bwd_mma::zero_fill(acc_dq);

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

    // S = Q K^T and dP = dO V^T, one commit group.
    float s[1][kBlockN / 8][4];
    float ds[1][kBlockN / 8][4];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      Wgmma<T, kBlockN>::template ss<0>(s[0], desc_k_major<kBlockM>(sQ, 64 * wg, ks),
                                        desc_k_major<kBlockN>(sK_s, 0, ks), ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      Wgmma<T, kBlockN>::template ss<0>(ds[0], desc_k_major<kBlockM>(sdO, 64 * wg, ks),
                                        desc_k_major<kBlockN>(sV_s, 0, ks), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulator(s[0]);
    fence_accumulator(ds[0]);

    float no_dtanh[1][1][4];  // softcap's derivative: sm90_bwd_ws.cuh or mma.sync (run_bwd_sm90)
    bwd_mma::compute_probs<false, kVariant>(s, no_dtanh, sLse + 16 * warp, needs_mask, warp_q0, n0, mask, p, seq, h);
    bwd_mma::compute_ds<false, kVariant>(ds, s, no_dtanh, sDelta + 16 * warp);
    uint32_t a_ds[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) accumulator_to_a<T>(a_ds[kk], ds[0], kk);

    // dQ += dS K (B = K N-major: the reduction runs over keys).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      Wgmma<T, kD>::template rs<1>(acc_dq[0], a_ds[kk], desc_mn_major<kBlockN>(sK_s, 0, kk), 1);
    wgmma_commit();
    wgmma_wait<0>();
    fence_accumulator(acc_dq[0]);
  }

  T* dq = seq.q_rows(static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, h) +
          static_cast<int64_t>(warp_q0) * p.dq_row_stride;
  bwd_mma::store_rows<T, 1, kD>(acc_dq, dq, p.dq_row_stride, seq.sq - warp_q0, p.d, p.scale);
}

template <typename T, typename Cfg, int kVariant, bool kDqAtomic>
__global__ void __launch_bounds__(Cfg::kKVThreads, Cfg::kKVMinBlocks) bwd_dkdv_sm90_kernel(const __grid_constant__ BwdParams p) {
#if FLASH_SM90_ENABLED
  bwd_dkdv_block<T, Cfg, kVariant, kDqAtomic>(p);
#else
  __trap();  // never launched: see sm90_kernel_built
#endif
}

template <typename T, typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kQThreads, Cfg::kQMinBlocks) bwd_dq_sm90_kernel(const __grid_constant__ BwdParams p) {
#if FLASH_SM90_ENABLED
  bwd_dq_block<T, Cfg, kVariant>(p);
#else
  __trap();
#endif
}

}  // namespace sm90

template <typename T, typename Cfg, int kVariant>
bool launch_bwd_sm90(const BwdParams& p, cudaStream_t stream) {
  auto dkdv = sm90::bwd_dkdv_sm90_kernel<T, Cfg, kVariant, false>;
  auto dkdv_dq = sm90::bwd_dkdv_sm90_kernel<T, Cfg, kVariant, true>;
  auto dq = sm90::bwd_dq_sm90_kernel<T, Cfg, kVariant>;
  if (p.sm_arch != 90 || !sm90_kernel_built(dkdv)) return false;
  launch_bwd_preprocess<T>(p, stream);
  const dim3 grid(ceil_div(p.sk, Cfg::kKVBlockN), p.hkv, p.b);
  if (p.dq_accum != nullptr) {  // dQ by atomics into the zero-filled dq_accum, then into dq
    set_smem_limit(dkdv_dq, Cfg::kDkdvSmemAtomicDq, "bwd_dkdv_sm90");
    dkdv_dq<<<grid, Cfg::kKVThreads, Cfg::kDkdvSmemAtomicDq, stream>>>(p);
    check_launch("bwd_dkdv_sm90");
    sm90::launch_convert_dq_rows<T>(p, stream);
    return true;
  }
  set_smem_limit(dkdv, Cfg::kDkdvSmem, "bwd_dkdv_sm90");
  set_smem_limit(dq, Cfg::kDqSmem, "bwd_dq_sm90");
  dkdv<<<grid, Cfg::kKVThreads, Cfg::kDkdvSmem, stream>>>(p);
  check_launch("bwd_dkdv_sm90");
  dq<<<dim3(ceil_div(p.sq, Cfg::kQBlockM), p.hq, p.b), Cfg::kQThreads, Cfg::kDqSmem, stream>>>(p);
  check_launch("bwd_dq_sm90");
  return true;
}

}  // namespace flash_cuda
