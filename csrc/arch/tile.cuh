// arch/tile.cuh — the layouts of shared-memory tiles, and the one tile copier of the cp.async
// kernels: rows [0, kRows) x columns
// [0, kCols) of a row-major slice in global memory into a shared-memory tile, 16 bytes per
// cp.async (LDGSTS); rows >= rows_valid and columns >= d are zero-filled, so padded columns add 0
// to every dot product and rows past a sequence read as zeros.
//
// Each thread keeps one 16-byte column chunk and walks down the rows, kThreads / (kCols per
// chunk) at a time: consecutive threads take consecutive chunks of a row (a warp reads whole
// lines of global memory), and the address arithmetic is one add per copy on each side (few
// live registers next to the accumulators). When the thread count is not a multiple of the
// chunks per row (head dims 96, 192) the last few threads sit out.
//
// The tile's layout is a type: PaddedTile<kPitch> (row r at r * kPitch elements: rows padded by
// 16 bytes, so the 8 row addresses of an ldmatrix fall into 8 different bank groups) or
// SwizzledTile<kRows> (the 128-byte-swizzled slabs wgmma reads, arch/sm90.cuh); a pass moves a
// thread's position by a constant either way (for the swizzle, a whole number of its 8-row
// phases).
#pragma once

#include <cstdint>

#include "host.h"
#include "sm80.cuh"

namespace flash_cuda {

// Rows of kPitch elements of T.
template <int kPitch>
struct PaddedTile {
  __device__ __forceinline__ static int at(int r, int col) { return r * kPitch + col; }  // elements
  template <typename T>
  __device__ __forceinline__ static uint32_t offset(int r, int col) {
    return static_cast<uint32_t>((r * kPitch + col) * sizeof(T));
  }
  template <typename T>
  static constexpr uint32_t rows_bytes(int rows) {
    return static_cast<uint32_t>(rows * kPitch * sizeof(T));
  }
};

// The 128-byte-swizzled slab layout of a tile of kRows rows of 16-bit elements (the layout
// wgmma reads and TMA writes; arch/sm90.cuh documents it): byte offset of (r, col)
//     (col / 64) * kRows * 128 + r * 128 + 16 * ((col % 64) / 8 ^ r % 8) + 2 * (col % 8).
constexpr int kSwizzleBytes = 128;  // one line of a slab
constexpr int kSlabCols = 64;       // 16-bit columns per line
constexpr int kSwizzleAlign = 8 * kSwizzleBytes;  // one period of the pattern: where a slab starts
template <int kRows>
struct SwizzledTile {
  __device__ __forceinline__ static int at(int r, int col) { return static_cast<int>(offset(r, col) / 2); }  // elements
  template <typename T = uint16_t>
  __device__ __forceinline__ static uint32_t offset(int r, int col) {
    static_assert(sizeof(T) == 2, "swizzled tiles hold 16-bit elements");
    return static_cast<uint32_t>((col / kSlabCols) * kRows * kSwizzleBytes + r * kSwizzleBytes +
                                 ((((col % kSlabCols) / 8) ^ (r % 8)) * 16) + (col % 8) * 2);
  }
  template <typename T>
  static constexpr uint32_t rows_bytes(int rows) {
    return static_cast<uint32_t>(rows * kSwizzleBytes);
  }
};

template <int kRows, int kCols, int kThreads, typename Layout, typename T>
__device__ __forceinline__ void copy_tile_async(T* smem, const T* gmem, int64_t row_stride, int rows_valid, int d,
                                                int thread) {
  constexpr int kChunkElems = 16 / sizeof(T);
  constexpr int kChunksPerRow = kCols / kChunkElems;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(kRowsPerPass > 0, "a pass covers at least one row");
  const int col = (thread % kChunksPerRow) * kChunkElems;
  int r = thread / kChunksPerRow;
  if (kThreads % kChunksPerRow != 0 && r >= kRowsPerPass) return;
  const bool col_valid = col < d;
  unsigned char* dst = reinterpret_cast<unsigned char*>(smem) + Layout::template offset<T>(r, col);
  const T* src = gmem + r * row_stride + col;
#pragma unroll
  for (int pass = 0; pass < ceil_div(kRows, kRowsPerPass); ++pass) {
    if (kRows % kRowsPerPass == 0 || r < kRows) {
      const bool valid = col_valid && r < rows_valid;
      cp_async_16(dst, valid ? src : gmem, valid);
    }
    r += kRowsPerPass;
    dst += Layout::template rows_bytes<T>(kRowsPerPass);
    src += kRowsPerPass * row_stride;
  }
}

// Copies kN consecutive floats (per-row statistics: lse, delta) with 4-byte cp.async, one per
// thread; entries >= n_valid become 0.
template <int kN>
__device__ __forceinline__ void copy_row_stats_async(float* smem, const float* gmem, int n_valid) {
  const int i = threadIdx.x;
  if (i < kN) cp_async_4(smem + i, i < n_valid ? gmem + i : gmem, i < n_valid);
}

}  // namespace flash_cuda
