// arch/tma.h — the host side of TMA: tensor maps over flash_cuda's [batch][head][row][d] views
// (no kernels here; the device side is arch/sm90.cuh).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../include/params.h"

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
// box_heads > 1 (the GQA-packed Q of tiers/wgmma/fwd.cuh): the map orders the dimensions
// (d, head, row, batch) instead, and a box is 64 columns x box_heads heads x box_rows / box_heads
// rows, with its first head and row given as coordinates 1 and 2. TMA writes a box innermost
// dimension first, so its 128-byte lines land as tile rows q * box_heads + g (row q of the box,
// head g): box_rows lines, the same slab as above. (The strides may be in any order here too:
// TMA steps each dimension by its own stride, as the (d, row, head) map of a bshd view relies on.)
inline bool make_row_tensor_map(CUtensorMap* map, const void* base, bool bf16, int d, int rows, int heads,
                                int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                                int box_rows, int box_heads = 1) {
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
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d),
                              static_cast<cuuint64_t>(heads_inside ? heads : rows),
                              static_cast<cuuint64_t>(heads_inside ? rows : heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(heads_inside ? head_bytes : row_bytes),
                                 static_cast<cuuint64_t>(heads_inside ? row_bytes : head_bytes),
                                 static_cast<cuuint64_t>(batch_bytes)};
  for (cuuint64_t s : strides) {
    if (s % 16 != 0 || s >= (cuuint64_t{1} << 40)) return false;
  }
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(heads_inside ? box_heads : box_rows),
                             static_cast<cuuint32_t>(heads_inside ? box_rows / box_heads : 1), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                            const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

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
// address one of the views.
inline bool make_qkv_tensor_maps(const FwdParams& p, CUtensorMap* q, CUtensorMap* k, CUtensorMap* v, int block_m,
                                 int block_n, int q_group = 1) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  const MapRows rows = MapRows::of(p);
  return make_row_tensor_map(q, p.q, bf16, p.d, rows.q, p.hq, rows.batch, p.q_row_stride, p.q_head_stride,
                             p.q_batch_stride, block_m, q_group) &&
         make_row_tensor_map(k, p.k, bf16, p.d, rows.k, p.hkv, rows.batch, p.k_row_stride, p.k_head_stride,
                             p.k_batch_stride, block_n) &&
         make_row_tensor_map(v, p.v, bf16, p.d, rows.k, p.hkv, rows.batch, p.v_row_stride, p.v_head_stride,
                             p.v_batch_stride, block_n);
}

// The map of a call's O, written in boxes of box_rows rows (TMA stores); false where TMA cannot
// address the view.
inline bool make_o_tensor_map(const FwdParams& p, CUtensorMap* o, int box_rows) {
  const MapRows rows = MapRows::of(p);
  return make_row_tensor_map(o, p.o, p.dtype == DType::kBFloat16, p.d, rows.q, p.hq, rows.batch, p.o_row_stride,
                             p.o_head_stride, p.o_batch_stride, box_rows);
}

}  // namespace flash_cuda
