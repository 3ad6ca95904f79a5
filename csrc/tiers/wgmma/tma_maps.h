// tiers/wgmma/tma_maps.h — the tensor maps of a call's Q, K, V and O for the warp-specialized
// Hopper kernels (fwd.cuh, bwd_ws.cuh): which rows, heads and strides of the params each map
// spans; arch/tma.h encodes a map from them.
#pragma once

#include "../../arch/tma.h"
#include "../../include/params.h"

namespace flash_cuda {

// The row extents of a call's maps. A packed batch's maps cover all rows of the packed tensors
// with batch extent 1 (the batch strides, 0, are then never used): a kernel tells the sequences
// apart by cu_seqlens and adds a sequence's first row to its coordinates.
struct MapRows {
  int q, k, batch;
  static MapRows of(const FwdParams& p) {
    const bool packed = p.cu_seqlens_q != nullptr;
    return {packed ? p.total_q : p.sq, packed ? p.total_k : p.sk, packed ? 1 : p.b};
  }
};

// The maps of a call's Q (boxes of block_m rows; q_group > 1: of block_m / q_group rows of
// q_group heads each, the GQA-packed tiles), K and V (block_n rows); false where TMA cannot
// address one of the views. v_box_cols: the columns of V's boxes, 64 (128-byte swizzle, the
// slabs of Q and K) or 32 (64-byte swizzle: the forward's native 96-wide V, fwd/config.cuh);
// q_box_cols, k_box_cols likewise for Q and K (the backward's native 96-wide tiles, bwd_ws.cuh:
// Q in 32-column boxes, K in 16-column boxes with the 32-byte swizzle).
inline bool make_qkv_tensor_maps(const FwdParams& p, CUtensorMap* q, CUtensorMap* k, CUtensorMap* v, int block_m,
                                 int block_n, int q_group = 1, int v_box_cols = 64, int q_box_cols = 64,
                                 int k_box_cols = 64) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  const MapRows rows = MapRows::of(p);
  return make_row_tensor_map(q, p.q, bf16, p.d, rows.q, p.hq, rows.batch, p.q_row_stride, p.q_head_stride,
                             p.q_batch_stride, block_m, q_group, q_box_cols) &&
         make_row_tensor_map(k, p.k, bf16, p.d, rows.k, p.hkv, rows.batch, p.k_row_stride, p.k_head_stride,
                             p.k_batch_stride, block_n, /*box_heads=*/1, k_box_cols) &&
         make_row_tensor_map(v, p.v, bf16, p.d, rows.k, p.hkv, rows.batch, p.v_row_stride, p.v_head_stride,
                             p.v_batch_stride, block_n, /*box_heads=*/1, v_box_cols);
}

// The map of a call's O, written in boxes of box_rows rows (TMA stores); false where TMA cannot
// address the view.
inline bool make_o_tensor_map(const FwdParams& p, CUtensorMap* o, int box_rows) {
  const MapRows rows = MapRows::of(p);
  return make_row_tensor_map(o, p.o, p.dtype == DType::kBFloat16, p.d, rows.q, p.hq, rows.batch, p.o_row_stride,
                             p.o_head_stride, p.o_batch_stride, box_rows);
}

// The FP8 forward's maps (p.q_descale != nullptr; tiers/wgmma/fwd: WsConfig's kFp8): Q and K
// over their e4m3 bytes (a packed batch's over all its rows: MapRows), V^T over
// [b][hkv][d][v_row_stride] (core/fp8_v_layout.cuh; a packed batch's one slot per sequence) in
// boxes of v_rows head dims x v_cols keys; Q's and K's boxes qk_cols wide (128, or 64 at d = 64).
// O's map is make_o_tensor_map's (p.dtype: O's type).
inline bool make_fp8_tensor_maps(const FwdParams& p, CUtensorMap* q, CUtensorMap* k, CUtensorMap* v, int block_m,
                                 int block_n, int qk_cols, int v_rows, int v_cols) {
  const MapRows rows = MapRows::of(p);
  return make_e4m3_row_tensor_map(q, p.q, p.d, rows.q, p.hq, rows.batch, p.q_row_stride, p.q_head_stride,
                                  p.q_batch_stride, block_m, qk_cols) &&
         make_e4m3_row_tensor_map(k, p.k, p.d, rows.k, p.hkv, rows.batch, p.k_row_stride, p.k_head_stride,
                                  p.k_batch_stride, block_n, qk_cols) &&
         make_e4m3_row_tensor_map(v, p.v, static_cast<int>(p.v_row_stride), p.d, p.hkv, p.b, p.v_row_stride,
                                  p.v_head_stride, p.v_batch_stride, v_rows, v_cols);
}

}  // namespace flash_cuda
