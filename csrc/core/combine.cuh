// core/combine.cuh — merges the partial results of split query blocks. A query block whose key
// range was cut into num_splits pieces (the fp32 forward's last wave: plan_tail_split,
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

// The split query blocks of a dense batch (splits run only there), kRows queries each, in the
// grid order of query_block_order: split block b is block p.split_begin + b of that order.
// Pieces that saw no key (m_r = +inf) are skipped; a row no piece saw gets O = 0 and
// lse = -inf. A warp per row, lane c handling the 4-column chunks c, c + 32, ...
template <typename T, int kRows>
__global__ void __launch_bounds__(kCombineThreads) combine_splits_kernel(const FwdParams p) {
  constexpr int kCtasPerBlock = kRows / kCombineRowsPerCta;
  const int split_block = static_cast<int>(blockIdx.x) / kCtasPerBlock;
  const int r = static_cast<int>(blockIdx.x) % kCtasPerBlock * kCombineRowsPerCta +
                static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  int m_block, bh;
  query_block_order(p.split_begin + split_block, ceil_div(p.sq, kRows), p.b * p.hq, longest_first(p), m_block,
                    bh);
  const int bi = bh / p.hq;
  const int h = bh - bi * p.hq;
  const SeqInfo seq = SeqInfo::make<false>(p, bi);
  const int m0 = m_block * kRows;
  if (r >= seq.sq - m0) return;

  const int n = p.num_splits;
  const int64_t first_piece = static_cast<int64_t>(split_block) * n;
  auto piece_stats = [&](int i) {
    return reinterpret_cast<const float2*>(p.stats_accum)[(first_piece + i) * kRows + r];
  };
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) {
    const float mi = piece_stats(i).x;
    if (mi != INFINITY) m = fmaxf(m, mi);
  }
  const bool empty = m == -INFINITY;  // no range saw a key
  float l = 0.f;
  if (!empty) {
    for (int i = 0; i < n; ++i) {
      const float2 st = piece_stats(i);
      if (st.x != INFINITY) l += ex2_approx((st.x - m) + st.y);
    }
  }
  const float log2l = empty ? 0.f : log2f(l);

  T* o_row = seq.q_rows(static_cast<T*>(p.o), p.o_batch_stride, p.o_head_stride, p.o_row_stride, h) +
             (m0 + r) * p.o_row_stride;
  for (int c = 4 * lane; c < p.d; c += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (!empty) {
      for (int i = 0; i < n; ++i) {
        const float2 st = piece_stats(i);
        if (st.x == INFINITY) continue;
        const float w = ex2_approx((st.x - m) + st.y - log2l);
        const float4 x = *reinterpret_cast<const float4*>(p.o_accum + ((first_piece + i) * kRows + r) * p.d + c);
        acc.x = fmaf(w, x.x, acc.x);
        acc.y = fmaf(w, x.y, acc.y);
        acc.z = fmaf(w, x.z, acc.z);
        acc.w = fmaf(w, x.w, acc.w);
      }
    }
    store4(o_row + c, acc);
  }
  if (lane == 0) {
    const int64_t stat0 = seq.stat_offset(p, h) + m0;
    store_row_stats(p.softmax_lse + stat0, stats_tile(p.softmax_stats, stat0), r, m, empty ? 0.f : l);
  }
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

#endif  // __CUDACC__

}  // namespace flash_cuda
