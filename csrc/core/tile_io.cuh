// core/tile_io.cuh — what the cp.async kernels copy per block, in any tile layout
// (arch/tile.cuh: PaddedTile, SwizzledTile): a key block's K and V rows, a query block's Q and
// dO rows with their lse and delta. Rows past the sequence and columns past d arrive as zeros
// (the copier's zero fill), as do the statistics past the sequence.
#pragma once

#include <cstdint>

#include "../arch/tile.cuh"
#include "../include/params.h"
#include "block.cuh"
#include "seqlen.cuh"

namespace flash_cuda {

#if defined(__CUDACC__)

// Keys [n0, n0 + kRows) of KV head hkv: K into sK, V into sV (nullptr: K alone).
template <int kRows, int kD, int kThreads, typename Layout, typename T>
__device__ __forceinline__ void copy_key_block_async(const FwdParams& p, const SeqInfo& seq, int hkv, int n0, T* sK,
                                                     T* sV, int thread) {
  const T* k = seq.k_rows(static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride, p.k_row_stride, hkv) +
               static_cast<int64_t>(n0) * p.k_row_stride;
  copy_tile_async<kRows, kD, kThreads, Layout>(sK, k, p.k_row_stride, seq.sk - n0, p.d, thread);
  if (sV == nullptr) return;
  const T* v = seq.k_rows(static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride, p.v_row_stride, hkv) +
               static_cast<int64_t>(n0) * p.v_row_stride;
  copy_tile_async<kRows, kD, kThreads, Layout>(sV, v, p.v_row_stride, seq.sk - n0, p.d, thread);
}

// Queries [m0, m0 + kRows) of query head h for a backward: Q into sQ, dO into sdO, their lse into
// sLse and delta into sDelta (nullptr: no delta).
template <int kRows, int kD, int kThreads, typename Layout, typename T>
__device__ __forceinline__ void copy_query_block_async(const BwdParams& p, const SeqInfo& seq, int h, int m0, T* sQ,
                                                       T* sdO, float* sLse, float* sDelta, int thread) {
  const T* q = seq.q_rows(static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride, p.q_row_stride, h) +
               static_cast<int64_t>(m0) * p.q_row_stride;
  const T* dout = seq.q_rows(static_cast<const T*>(p.dout), p.do_batch_stride, p.do_head_stride, p.do_row_stride, h) +
                  static_cast<int64_t>(m0) * p.do_row_stride;
  copy_tile_async<kRows, kD, kThreads, Layout>(sQ, q, p.q_row_stride, seq.sq - m0, p.d, thread);
  copy_tile_async<kRows, kD, kThreads, Layout>(sdO, dout, p.do_row_stride, seq.sq - m0, p.d, thread);
  const int64_t row0 = seq.stat_offset(p, h) + m0;
  copy_row_stats_async<kRows>(sLse, p.softmax_lse + row0, seq.sq - m0);
  if (sDelta != nullptr) copy_row_stats_async<kRows>(sDelta, p.delta + row0, seq.sq - m0);
}

// The cp.async walk of a key tile over its (query head, query block) steps (core/block.cuh:
// KeyTileSteps' order) through a two-stage ring: once every thread has step (h, m_block) in stage
// `stage` and is done with the other stage, the next step's copies go there (load(h, m_block,
// stage), one commit group), if there is a next step.
template <typename Load>
__device__ __forceinline__ void prefetch_next_query_block(const BlockRange& m_range, int h_end, int h, int m_block,
                                                          int stage, Load&& load) {
  if (KeyTileSteps::next(m_range, h_end, h, m_block)) {
    load(h, m_block, stage ^ 1);
    cp_async_commit();
  }
}

#endif  // __CUDACC__

}  // namespace flash_cuda
