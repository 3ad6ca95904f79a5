// core/combine.cuh — merges the partial results of split key ranges: split query blocks of the
// fp32 forward, and the split-KV decode's rows (tiers/decode). A query block whose key range was
// cut into num_splits pieces (the fp32 forward's last wave: plan_tail_split,
// core/scheduler.cuh) left, per piece r, its O_r normalized by its own l_r and its row
// statistics (m_r, log2 l_r) (store_row_stats, core/softmax.cuh) in fp32 workspace:
//   o_accum     [piece][kRows][d]      piece = (split block - split_begin) * num_splits + r
//   stats_accum [piece][kRows][2]
// (FwdParams, include/params.h). With m = max_r m_r and l = sum_r l_r 2^(m_r - m):
//   O = sum_r w_r O_r,  w_r = l_r 2^(m_r - m) / l = 2^((m_r - m) + log2 l_r - log2 l)
// and the row's statistics are (m, l) (store_row_stats: lse, and the pair where the call keeps
// it). The merge is in fp32 whatever the output's element type T (fp32, fp16, bf16): O is
// rounded to T once, when written.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../arch/host.h"
#include "../arch/sm80.cuh"
#include "../arch/types.cuh"
#include "../include/params.h"
#include "scheduler.cuh"
#include "seqlen.cuh"
#include "softmax.cuh"

namespace flash_cuda {

// One warp merges one row; a CTA takes kCombineRowsPerCta rows of a split query block.
constexpr int kCombineRowsPerCta = 8;
constexpr int kCombineThreads = 32 * kCombineRowsPerCta;

#if defined(__CUDACC__)

// Four consecutive outputs from fp32 values: one 16-byte store for fp32, one 8-byte store of
// two packed pairs for the 16-bit types (rows start 16-byte aligned, columns are multiples of 4).
template <typename T>
__device__ __forceinline__ void store4(T* dst, const float4& v) {
  if constexpr (std::is_same<T, float>::value) {
    *reinterpret_cast<float4*>(dst) = v;
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(v.x, v.y), pack2<T>(v.z, v.w));
  }
}

// Merges the n pieces of one row, a warp per row (lane c handles the 4-column chunks c, c + 32,
// ...): piece i's statistics are stats(i) = (m_i, log2 l_i) (m_i = +inf: the piece saw no key,
// skipped) and its normalized O row starts at o_piece(i) (fp32, d columns). Writes the row of O
// as T at o_row and, from lane 0, its lse / (m, l) pair through store_row_stats (either may be
// nullptr). A row no piece saw gets O = 0 and lse = -inf.
template <typename T, typename Stats, typename Piece>
__device__ __forceinline__ void merge_row_pieces(int n, int d, Stats&& stats, Piece&& o_piece, T* o_row,
                                                 float* lse, float* stats_out, int r) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) {
    const float mi = stats(i).x;
    if (mi != INFINITY) m = fmaxf(m, mi);
  }
  const bool empty = m == -INFINITY;  // no range saw a key
  float l = 0.f;
  if (!empty) {
    for (int i = 0; i < n; ++i) {
      const float2 st = stats(i);
      if (st.x != INFINITY) l += ex2_approx((st.x - m) + st.y);
    }
  }
  const float log2l = empty ? 0.f : log2f(l);
  for (int c = 4 * lane; c < d; c += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (!empty) {
      for (int i = 0; i < n; ++i) {
        const float2 st = stats(i);
        if (st.x == INFINITY) continue;
        const float w = ex2_approx((st.x - m) + st.y - log2l);
        const float4 x = *reinterpret_cast<const float4*>(o_piece(i) + c);
        acc.x = fmaf(w, x.x, acc.x);
        acc.y = fmaf(w, x.y, acc.y);
        acc.z = fmaf(w, x.z, acc.z);
        acc.w = fmaf(w, x.w, acc.w);
      }
    }
    store4(o_row + c, acc);
  }
  if (lane == 0) store_row_stats(lse, stats_out, r, m, empty ? 0.f : l);
}

// The split query blocks of a dense batch (the fp32 forward's last wave), kRows queries each,
// in the grid order of query_block_order: split block b is block p.split_begin + b of that order.
template <typename T, int kRows>
__global__ void __launch_bounds__(kCombineThreads) combine_splits_kernel(const FwdParams p) {
  constexpr int kCtasPerBlock = kRows / kCombineRowsPerCta;
  const int split_block = static_cast<int>(blockIdx.x) / kCtasPerBlock;
  const int r = static_cast<int>(blockIdx.x) % kCtasPerBlock * kCombineRowsPerCta +
                static_cast<int>(threadIdx.x) / 32;
  int m_block, bh;
  query_block_order(p.split_begin + split_block, ceil_div(p.sq, kRows), p.b * p.hq, longest_first(p), m_block,
                    bh);
  const int bi = bh / p.hq;
  const int h = bh - bi * p.hq;
  const SeqInfo seq = SeqInfo::make<false>(p, bi);
  const int m0 = m_block * kRows;
  if (r >= seq.sq - m0) return;

  const int64_t first_piece = static_cast<int64_t>(split_block) * p.num_splits;
  T* o_row = seq.q_rows(static_cast<T*>(p.o), p.o_batch_stride, p.o_head_stride, p.o_row_stride, h) +
             (m0 + r) * p.o_row_stride;
  const int64_t stat0 = seq.stat_offset(p, h) + m0;
  merge_row_pieces(
      p.num_splits, p.d,
      [&](int i) { return reinterpret_cast<const float2*>(p.stats_accum)[(first_piece + i) * kRows + r]; },
      [&](int i) { return p.o_accum + ((first_piece + i) * kRows + r) * p.d; }, o_row,
      p.softmax_lse + stat0, stats_tile(p.softmax_stats, stat0), r);
}

// Merges the split_blocks split query blocks of a launch with p's split fields (p.stats_accum
// set), writing O as T.
template <typename T, int kRows>
void launch_combine_splits(const FwdParams& p, int64_t split_blocks, cudaStream_t stream) {
  static_assert(kRows % kCombineRowsPerCta == 0, "whole CTAs per split block");
  const int64_t grid = split_blocks * (kRows / kCombineRowsPerCta);
  combine_splits_kernel<T, kRows><<<static_cast<unsigned>(grid), kCombineThreads, 0, stream>>>(p);
  check_launch("flash_fwd_combine_splits");
}

// The split-KV decode's pieces (tiers/mma/decode.cuh): every row of lse's layout (dense
// [b][hq][sq], packed [hq][total_q]: decode_stat_rows) was cut into p.num_splits key ranges,
// piece s of row `row` at [s][row] of o_accum ([.][.][d]) and stats_accum ([.][.][2]). Decode
// has few rows and many pieces (a single sequence's 32 query heads, split 50 ways), so a row gets
// a whole CTA: its threads read the pieces' statistics side by side, and each warp adds a quarter
// of the pieces' O (lanes over columns, several loads in flight), the quarters then summed
// through shared memory. A warp per row walking 50 pieces one dependent load after the other
// took longer than the keys' stream.
constexpr int kKeySplitWarps = 4;
template <typename T>
__global__ void __launch_bounds__(32 * kKeySplitWarps) combine_key_splits_kernel(const FwdParams p) {
  constexpr int kThreads = 32 * kKeySplitWarps;
  __shared__ float s_red[kKeySplitWarps];
  __shared__ float4 s_acc[kKeySplitWarps][32];
  grid_dependency_wait();  // launched while the decode grid finishes (launch_combine_key_splits)
  const int64_t rows = decode_stat_rows(p);
  const int64_t row = blockIdx.x;
  const int n = p.num_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float2* stats = reinterpret_cast<const float2*>(p.stats_accum) + row;  // piece s at stats[s * rows]
  // m = max over the pieces that saw a key (m_s = +inf marks one that did not).
  float m = -INFINITY;
  for (int s = threadIdx.x; s < n; s += kThreads) {
    const float ms = stats[s * rows].x;
    if (ms != INFINITY) m = fmaxf(m, ms);
  }
  m = group_max<32>(m);
  if (lane == 0) s_red[warp] = m;
  __syncthreads();
  m = s_red[0];
#pragma unroll
  for (int w = 1; w < kKeySplitWarps; ++w) m = fmaxf(m, s_red[w]);
  __syncthreads();
  const bool empty = m == -INFINITY;  // no range saw a key
  float l = 0.f;
  for (int s = threadIdx.x; s < n && !empty; s += kThreads) {
    const float2 st = stats[s * rows];
    if (st.x != INFINITY) l += ex2_approx((st.x - m) + st.y);
  }
  l = group_sum<32>(l);
  if (lane == 0) s_red[warp] = l;
  __syncthreads();
  l = 0.f;
#pragma unroll
  for (int w = 0; w < kKeySplitWarps; ++w) l += s_red[w];
  const float log2l = empty ? 0.f : log2f(l);

  // The row's place in o: dense row (bi, h, i) = ((bi hq) + h) sq + i; packed row (h, t) = h total_q + t.
  T* o_row;
  if (p.cu_seqlens_q != nullptr) {
    const int h = static_cast<int>(row / p.total_q), t = static_cast<int>(row % p.total_q);
    o_row = static_cast<T*>(p.o) + h * p.o_head_stride + static_cast<int64_t>(t) * p.o_row_stride;
  } else {
    const int i = static_cast<int>(row % p.sq);
    const int64_t bh = row / p.sq;
    const int h = static_cast<int>(bh % p.hq), bi = static_cast<int>(bh / p.hq);
    o_row = static_cast<T*>(p.o) + bi * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride;
  }
  for (int c0 = 0; c0 < p.d; c0 += 128) {
    const int c = c0 + 4 * lane;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < p.d && !empty) {
#pragma unroll 4
      for (int s = warp; s < n; s += kKeySplitWarps) {
        const float2 st = stats[s * rows];
        const float w = st.x == INFINITY ? 0.f : ex2_approx((st.x - m) + st.y - log2l);
        const float4 x = *reinterpret_cast<const float4*>(p.o_accum + (s * rows + row) * p.d + c);
        acc.x = fmaf(w, x.x, acc.x);
        acc.y = fmaf(w, x.y, acc.y);
        acc.z = fmaf(w, x.z, acc.z);
        acc.w = fmaf(w, x.w, acc.w);
      }
    }
    s_acc[warp][lane] = acc;
    __syncthreads();
    if (warp == 0 && c < p.d) {
#pragma unroll
      for (int w = 1; w < kKeySplitWarps; ++w) {
        const float4 x = s_acc[w][lane];
        acc.x += x.x;
        acc.y += x.y;
        acc.z += x.z;
        acc.w += x.w;
      }
      store4(o_row + c, acc);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && p.softmax_lse != nullptr) {
    store_row_stats(p.softmax_lse + row, nullptr, 0, m, empty ? 0.f : l);
  }
}

template <typename T>
void launch_combine_key_splits(const FwdParams& p, cudaStream_t stream) {
  const int64_t rows = decode_stat_rows(p);
  // A programmatic dependent launch on sm_90: the merge's launch overlaps the decode grid's last
  // CTAs (it waits for their results in grid_dependency_wait); a plain stream-ordered launch
  // elsewhere.
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(rows));
  config.blockDim = dim3(32 * kKeySplitWarps);
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  config.numAttrs = p.sm_arch >= 90 ? 1 : 0;
  (void)cudaLaunchKernelEx(&config, combine_key_splits_kernel<T>, p);
  check_launch("flash_decode_combine_splits");
}

#endif  // __CUDACC__

}  // namespace flash_cuda
