// core/combine.cuh — merges the partial results of split key ranges: split query blocks of the
// fp32 forward, the split-KV decode's rows (tiers/mma/decode.cuh), and the partials of context-parallel
// attention's ring steps (MergeParams, at the end). A query block whose key range was
// cut into num_splits pieces (the fp32 forward's last wave: plan_tail_split,
// core/scheduler.cuh) left, per piece r, its O_r normalized by its own l_r and its row
// statistics (m_r, log2 l_r) (store_row_stats, core/softmax.cuh) in fp32 workspace:
//   o_accum     [piece][kRows][d]      piece = (split block - split_begin) * num_splits + r
//   stats_accum [piece][kRows][2]
// (FwdParams, include/params.h). With m = max_r m_r and l = sum_r l_r 2^(m_r - m):
//   O = sum_r w_r O_r,  w_r = l_r 2^(m_r - m) / l = 2^((m_r - m) + log2 l_r - log2 l)
// and the row's statistics are (m, l) (store_row_stats: lse, and the pair where the call keeps
// it). The merge is in fp32 whatever the output's element type T (fp32, fp16, bf16): O is
// rounded to T once, when written. The attention sink (FwdParams::sinks), which the pieces
// leave out, enters here once per row: one more piece with (m, log2 l) = (sink, 0) and no O.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../arch/host.h"
#include "../arch/sm80.cuh"
#include "../arch/types.cuh"
#include "../include/dispatch.h"
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

// Four consecutive values as floats: one 16-byte load for fp32, one 8-byte load otherwise.
template <typename T>
__device__ __forceinline__ float4 load4(const T* src) {
  if constexpr (std::is_same<T, float>::value) {
    return *reinterpret_cast<const float4*>(src);
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    const T* x = reinterpret_cast<const T*>(&v);
    return make_float4(to_float(x[0]), to_float(x[1]), to_float(x[2]), to_float(x[3]));
  }
}

// Merges the n pieces of one row, a warp per row (lane c handles the 4-column chunks c, c + 32,
// ...): piece i's statistics are stats(i) = (m_i, log2 l_i) (m_i = +inf: the piece saw no key,
// skipped) and columns c .. c + 3 of its normalized O row are load(i, c) (a float4). Writes the
// row of O as T at o_row and, from lane 0, its lse / (m, l) pair through store_row_stats (either
// may be nullptr). sink_log2: the row's attention sink (log2 units; -inf: none), the piece
// (sink, 0) without O. A row that no piece saw gets O = 0 and lse = -inf (with a sink: its sink).
template <typename T, typename Stats, typename Load>
__device__ __forceinline__ void merge_row_pieces(int n, int d, Stats&& stats, Load&& load, T* o_row,
                                                 float* lse, float* stats_out, int r,
                                                 float sink_log2 = -INFINITY) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  float m = sink_log2;
  for (int i = 0; i < n; ++i) {
    const float mi = stats(i).x;
    if (mi != INFINITY) m = fmaxf(m, mi);
  }
  const bool empty = m == -INFINITY;  // no range saw a key, and no sink
  // The sink's share, 2^(sink - m): 0 without a sink (m finite), 1 where it is the max.
  float l = empty ? 0.f : ex2_approx(sink_log2 - m);
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
        const float4 x = load(i, c);
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
      [&](int i, int c) { return load4(p.o_accum + ((first_piece + i) * kRows + r) * p.d + c); }, o_row,
      p.softmax_lse + stat0, stats_tile(p.softmax_stats, stat0), r, sink_log2_of(p.sinks, h));
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
  // The row's place in lse's layout: dense row (bi, h, i) = ((bi hq) + h) sq + i; packed row
  // (h, t) = h total_q + t.
  const bool packed = p.cu_seqlens_q != nullptr;
  const int h = packed ? static_cast<int>(row / p.total_q) : static_cast<int>((row / p.sq) % p.hq);
  // The sink (log2 units; -inf: none), which the pieces leave out: one more piece (sink, 0) with
  // no O, as in merge_row_pieces.
  const float sink_log2 = sink_log2_of(p.sinks, h);
  // m = max over the sink and the pieces that saw a key (m_s = +inf marks one that did not).
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
  m = fmaxf(m, sink_log2);
  const bool empty = m == -INFINITY;  // no range saw a key, and no sink
  // The sink's share 2^(sink - m) (0 without one), counted by one thread.
  float l = threadIdx.x == 0 && !empty ? ex2_approx(sink_log2 - m) : 0.f;
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

  // The row's place in o.
  T* o_row;
  if (packed) {
    const int t = static_cast<int>(row % p.total_q);
    o_row = static_cast<T*>(p.o) + h * p.o_head_stride + static_cast<int64_t>(t) * p.o_row_stride;
  } else {
    const int i = static_cast<int>(row % p.sq);
    const int bi = static_cast<int>(row / p.sq / p.hq);
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

// ---- Two partials of the same rows (MergeParams, include/params.h): the steps of
//      context-parallel attention, where each key block of the ring leaves a partial ----

// A partial's statistics as the (m, log2 l) pair merge_row_pieces weighs: the fp32 kernels' pair
// where it travels with the partial, else from lse (m = lse log2 e, l = 1, so a lone partial
// gets weight 2^0 = 1 exactly; lse = -inf, a row that saw no key: +inf, skipped).
__device__ __forceinline__ float2 partial_stats(const MergeOperand& x, int64_t stat_row) {
  if (x.stats != nullptr) return reinterpret_cast<const float2*>(x.stats)[stat_row];
  const float lse = x.lse[stat_row];
  return lse == -INFINITY ? make_float2(INFINITY, 0.f) : make_float2(lse * 1.4426950408889634f, 0.f);
}

// A warp per row of the batch x heads x rows grid, kCombineRowsPerCta rows per CTA.
template <typename TA, typename TB, typename TO>
__global__ void __launch_bounds__(kCombineThreads) merge_partials_kernel(const MergeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kCombineRowsPerCta + threadIdx.x / 32;
  if (row >= static_cast<int64_t>(p.batch) * p.heads * p.rows) return;
  const int r = static_cast<int>(row % p.rows);
  const int64_t bh = row / p.rows;
  const int h = static_cast<int>(bh % p.heads), bi = static_cast<int>(bh / p.heads);
  auto stat_row = [&](const MergeOperand& x) { return bi * x.stat_batch_stride + h * x.stat_head_stride + r; };
  auto o_row = [&](const MergeOperand& x) { return bi * x.batch_stride + h * x.head_stride + r * x.row_stride; };
  const float2 st_a = partial_stats(p.a, stat_row(p.a)), st_b = partial_stats(p.b, stat_row(p.b));
  const TA* a = static_cast<const TA*>(p.a.o) + o_row(p.a);
  const TB* b = static_cast<const TB*>(p.b.o) + o_row(p.b);
  // Every lane holds the statistics before lane 0 writes the row's (out may be operand a).
  __syncwarp();
  const int64_t out_row = stat_row(p.out);
  merge_row_pieces(
      2, p.d, [&](int i) { return i == 0 ? st_a : st_b; },
      [&](int i, int c) { return i == 0 ? load4(a + c) : load4(b + c); }, static_cast<TO*>(p.out.o) + o_row(p.out),
      p.out.lse + out_row, stats_tile(p.out.stats, out_row), 0);
}

template <typename TA, typename TB, typename TO>
void launch_merge_partials(const MergeParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.rows;
  const int64_t grid = (rows + kCombineRowsPerCta - 1) / kCombineRowsPerCta;
  merge_partials_kernel<TA, TB, TO><<<static_cast<unsigned>(grid), kCombineThreads, 0, stream>>>(p);
  check_launch("flash_merge_partials");
}

// b is a partial of type T (a kernel's output); a and the output are T or float32.
template <int kDType>
void run_merge_partials(const MergeParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  const bool a32 = p.a.dtype == DType::kFloat32, o32 = p.out.dtype == DType::kFloat32;
  if constexpr (std::is_same<T, float>::value) {
    launch_merge_partials<float, float, float>(p, stream);
  } else if (a32) {
    o32 ? launch_merge_partials<float, T, float>(p, stream) : launch_merge_partials<float, T, T>(p, stream);
  } else {
    o32 ? launch_merge_partials<T, T, float>(p, stream) : launch_merge_partials<T, T, T>(p, stream);
  }
}

#endif  // __CUDACC__

}  // namespace flash_cuda
