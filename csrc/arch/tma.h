// arch/tma.h — the host side of TMA: tensor maps over [batch][head][row][d] views given by their
// base, extents and strides (no kernels here; the device side is arch/sm90.cuh; the maps of a
// call's tensors are built in tiers/wgmma/tma_maps.h).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flash_cuda {

// cuTensorMapEncodeTiled lives in the driver library; the runtime hands out its entry point,
// so the extension needs no link against libcuda. nullptr when the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &status);
#endif
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A map over the rows of a [batch][heads][rows][d] view of 16-bit elements (strides in
// elements, any order), read in boxes of 64 columns x box_rows rows with the 128-byte swizzle:
// exactly one column slab of the swizzled tile layout (arch/sm90.cuh). Rows past `rows` and
// columns past `d` are filled with zeros. Returns false (nothing to use) when TMA cannot
// address the view: a base or a stride that is not a multiple of 16 bytes.
// box_heads > 1 (the GQA-packed Q of the Hopper forward, tiers/wgmma/fwd/): the map orders the dimensions
// (d, head, row, batch) instead, and a box is 64 columns x box_heads heads x box_rows / box_heads
// rows, with its first head and row given as coordinates 1 and 2. TMA writes a box innermost
// dimension first, so its 128-byte lines land as tile rows q * box_heads + g (row q of the box,
// head g): box_rows lines, the same slab as above. (The strides may be in any order here too:
// TMA steps each dimension by its own stride, as the (d, row, head) map of a bshd view relies on.)
// box_cols 32 (the native 96-wide V of the Hopper forward, tiers/wgmma/fwd/config.cuh): boxes of
// 32 columns with the 64-byte swizzle, one 32-column slab of 64-byte lines per box, the swizzle
// whose span is exactly such a line (TMA's swizzle span may not be narrower than the box's rows).
// box_cols 16 (the K of the Hopper backward at d = 96, tiers/wgmma/bwd_ws.cuh): boxes of 16
// columns with the 32-byte swizzle, likewise. A box may lie wholly past d (at d <= 80 the last
// 16-column box of a 96-wide tile): TMA fills all of it with zeros and still counts its bytes.
inline bool make_row_tensor_map(CUtensorMap* map, const void* base, bool bf16, int d, int rows, int heads,
                                int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                                int box_rows, int box_heads = 1, int box_cols = 64) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  constexpr int64_t kElem = 2;
  // A dimension of extent 1 is never stepped along; its stride (which a view may leave at any
  // value) becomes the packed one, the span of the dimensions inside it.
  const int64_t row_bytes = rows > 1 ? row_stride * kElem : (d * kElem + 15) / 16 * 16;
  const int64_t head_bytes = heads > 1 ? head_stride * kElem : row_bytes * rows;
  const int64_t batch_bytes = batch > 1 ? batch_stride * kElem : head_bytes * heads;
  const bool heads_inside = box_heads > 1;
  if (heads_inside && (box_rows % box_heads != 0 || heads % box_heads != 0)) return false;
  if (box_cols != 64 && box_cols != 32 && box_cols != 16) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d),
                              static_cast<cuuint64_t>(heads_inside ? heads : rows),
                              static_cast<cuuint64_t>(heads_inside ? rows : heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(heads_inside ? head_bytes : row_bytes),
                                 static_cast<cuuint64_t>(heads_inside ? row_bytes : head_bytes),
                                 static_cast<cuuint64_t>(batch_bytes)};
  for (cuuint64_t s : strides) {
    if (s % 16 != 0 || s >= (cuuint64_t{1} << 40)) return false;
  }
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols),
                             static_cast<cuuint32_t>(heads_inside ? box_heads : box_rows),
                             static_cast<cuuint32_t>(heads_inside ? box_rows / box_heads : 1), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUtensorMapSwizzle swizzle = box_cols == 64   ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : box_cols == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                      : CU_TENSOR_MAP_SWIZZLE_32B;
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                            const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// The map of a (column, row, head, batch) tensor, strides in bytes, boxes of box_cols x box_rows
// of one head and batch entry. A dimension of extent 1 is never stepped along: its stride (which
// a view may leave at any value) becomes the packed span of the dimensions inside it. False where
// TMA cannot address the tensor (a stride not a multiple of 16 bytes, or beyond 2^40).
inline bool encode_rows_map(CUtensorMap* map, const void* base, CUtensorMapDataType type, int elem_bytes, int cols,
                            int rows, int heads, int batch, int64_t row_bytes, int64_t head_bytes,
                            int64_t batch_bytes, int box_cols, int box_rows, CUtensorMapSwizzle swizzle,
                            CUtensorMapL2promotion l2) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  row_bytes = rows > 1 ? row_bytes : (int64_t(cols) * elem_bytes + 15) / 16 * 16;
  head_bytes = heads > 1 ? head_bytes : row_bytes * rows;
  batch_bytes = batch > 1 ? batch_bytes : head_bytes * heads;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(row_bytes), static_cast<cuuint64_t>(head_bytes),
                                 static_cast<cuuint64_t>(batch_bytes)};
  for (cuuint64_t s : strides) {
    if (s % 16 != 0 || s >= (cuuint64_t{1} << 40)) return false;
  }
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, type, 4, const_cast<void*>(base), dims, strides, box, unit,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, l2, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// An e4m3 tensor's rows for the FP8 forward (tiers/wgmma/fwd: WsConfig's kFp8): dimensions
// (column, row, head, batch) of bytes, boxes of box_cols (128, 64 or 32) columns x box_rows rows of
// one head, with the swizzle of that line width: one slab of box_cols-byte lines (arch/sm90.cuh:
// Slabs with 1-byte elements). Q and K (columns: head dims) and V^T (columns: keys, rows: head
// dims; core/fp8_v_layout.cuh). Columns and rows past the extents land as zeros. False where TMA
// cannot address the view.
inline bool make_e4m3_row_tensor_map(CUtensorMap* map, const void* base, int cols, int rows, int heads, int batch,
                                     int64_t row_stride, int64_t head_stride, int64_t batch_stride, int box_rows,
                                     int box_cols = 128) {
  if (box_rows < 1 || box_rows > 256 || (box_cols != 128 && box_cols != 64 && box_cols != 32)) return false;
  const CUtensorMapSwizzle swizzle = box_cols == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : box_cols == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                      : CU_TENSOR_MAP_SWIZZLE_32B;
  return encode_rows_map(map, base, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, cols, rows, heads, batch, row_stride,
                         head_stride, batch_stride, box_cols, box_rows, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
}

// A map over a paged KV cache's rows for the split-KV decode (tiers/mma/decode.cuh:
// box_key_block): dimensions (d, row in page, head, page) with the strides of the pool (any
// order), elements of elem_bytes bytes (2: fp16 / bf16, 1: e4m3), boxes of box_cols columns x
// box_rows rows of one page and head, unswizzled. box_cols may exceed d (the decode ring's padded
// lines): TMA fills the columns past d with zeros, so a box lands as box_rows whole lines of the
// ring. Returns false where TMA cannot address the pool (base or strides not multiples of 16
// bytes, a box wider than 256 elements).
inline bool make_page_tensor_map(CUtensorMap* map, const void* base, int elem_bytes, int d, int page_size, int heads,
                                 int num_pages, int64_t row_stride, int64_t head_stride, int64_t page_stride,
                                 int box_cols, int box_rows) {
  if (elem_bytes != 1 && elem_bytes != 2) return false;
  if (box_cols > 256 || box_rows > 256 || (box_cols * elem_bytes) % 16 != 0 || box_rows > page_size) return false;
  return encode_rows_map(map, base, elem_bytes == 2 ? CU_TENSOR_MAP_DATA_TYPE_UINT16 : CU_TENSOR_MAP_DATA_TYPE_UINT8,
                         elem_bytes, d, page_size, heads, num_pages, row_stride * elem_bytes,
                         head_stride * elem_bytes, page_stride * elem_bytes, box_cols, box_rows,
                         CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

}  // namespace flash_cuda
