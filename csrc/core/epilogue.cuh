// core/epilogue.cuh — what a kernel writes at the end of a tile: the forward's O and lse from the
// online softmax's accumulators and row statistics (normalize_output, step 4), and a gradient
// tile from its accumulators (store_rows, store_rows_staged), for the C fragment of the
// tensor-core tiers (core/fragment.cuh).
#pragma once

#include <cmath>
#include <cstdint>

#include "../arch/sm80.cuh"
#include "../arch/tile.cuh"
#include "../arch/types.cuh"
#include "softmax.cuh"

namespace flash_cuda {

#if defined(__CUDACC__)

// Where row r of a warp's output goes: row r of a head (StridedRows), or of a GQA-packed tile
// (GqaOutRows): o(r, o_row_stride) elements from the warp's first row of O, lse(r) from its first
// lse entry.
// head(r): row r's query head, counted from the warp's first (the index of its sink).
struct StridedRows {
  __device__ __forceinline__ int64_t o(int r, int64_t o_row_stride) const { return r * o_row_stride; }
  __device__ __forceinline__ int lse(int r) const { return r; }
  __device__ __forceinline__ int head(int) const { return 0; }
};

// The GQA-packed tiles of the Hopper forward, counted from the tile's first query of the group's
// first head: the warp's tile row t = row0 + r is query t >> shift of head t & (G - 1).
struct GqaOutRows {
  int row0, shift;
  int64_t o_head_stride, lse_head_stride;
  __device__ __forceinline__ int64_t o(int r, int64_t o_row_stride) const {
    const int t = row0 + r;
    return (t >> shift) * o_row_stride + (t & ((1 << shift) - 1)) * o_head_stride;
  }
  __device__ __forceinline__ int64_t lse(int r) const {
    const int t = row0 + r;
    return (t & ((1 << shift) - 1)) * lse_head_stride + (t >> shift);
  }
  __device__ __forceinline__ int head(int r) const { return (row0 + r) & ((1 << shift) - 1); }
};

// ---------------------------------------------------------------------------------
// Step 4: finish the row sums across the quad, divide, write O (through this warp's own
// rows of a staging tile, so the global stores are 16-byte and coalesced) and the lse.
// kStaged = false (a kernel without shared memory to spare; sO_warp unused): every thread
// stores its own pairs of columns, 4 bytes each. kInTileLoop: called once per tile of a
// persistent kernel. Stage: where element (r, col) of the warp's staged rows lives,
// sO_warp + Stage::at(r, col) (arch/tile.cuh: PaddedTile, SwizzledTile; 16-byte chunks stay
// whole). copy = false: the rows are only staged, and the caller moves them to global memory
// itself (the warp-specialized Hopper forward's TMA store; it orders the staging writes before
// it). `out` places the warp's row r in o and lse (StridedRows, GqaOutRows). sinks: the attention
// sinks from the warp's first query head on (row r's is sinks[out.head(r)]), merged into the
// row's finished statistics (merge_sink); nullptr: none (a warp-uniform branch, once per tile).
// out_scale: a factor of every output, after 1 / l (the FP8 forward's V descale).
// ---------------------------------------------------------------------------------
template <typename T, typename Stage, bool kStaged = true, bool kInTileLoop = false, typename OutRows = StridedRows,
          int kM, int kD>
__device__ __forceinline__ void normalize_output(float (&acc_o)[kM][kD][4], const RowStats<kM>& stats, T* sO_warp,
                                                 T* o_rows, int64_t o_row_stride, float* lse_rows, int rows_valid,
                                                 int d, bool copy = true, const OutRows& out = {},
                                                 const float* sinks = nullptr, float out_scale = 1.f) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float l = group_sum<4>(stats.sum[mt][half]);
      float m = stats.max[mt][half];
      const int r = mt * 16 + g + half * 8;
      float o_scale = 1.f;
      if (sinks != nullptr) o_scale = merge_sink(m, l, sink_log2_of(sinks, out.head(r)));
      // l == 0 only for a row that saw no key (and has no sink): output 0, lse -inf. (Testing
      // l > 0 instead would also send a NaN row to -inf and hide the NaN from the backward.)
      const float inv = l == 0.f ? 0.f : o_scale / l * out_scale;
#pragma unroll
      for (int dt = 0; dt < kD; ++dt) {
        const uint32_t packed = pack2<T>(acc_o[mt][dt][half * 2] * inv, acc_o[mt][dt][half * 2 + 1] * inv);
        if constexpr (kStaged) {
          *reinterpret_cast<uint32_t*>(sO_warp + Stage::at(r, dt * 8 + 2 * t)) = packed;
        } else if (r < rows_valid && dt * 8 + 2 * t < d) {
          *reinterpret_cast<uint32_t*>(o_rows + out.o(r, o_row_stride) + dt * 8 + 2 * t) = packed;
        }
      }
      if (t == 0 && r < rows_valid) {
        lse_rows[out.lse(r)] = l == 0.f ? -INFINITY : (m + __log2f(l)) * kLn2;
      }
    }
  }
  if constexpr (!kStaged) return;
  if (!copy) return;
  __syncwarp();
  constexpr int kChunksPerRow = kD;  // 8 columns (16 bytes) each
  // kInTileLoop: the lane read again, opaquely, so that the compiler cannot hoist this copy's
  // per-lane rows and columns out of a persistent kernel's tile loop and keep them live through
  // its main loop (at d = 192, 24 chunks per row, a dozen registers). Elsewhere the lane above
  // serves (a second one costs a register where there is no loop to hoist from).
  int copy_lane = lane;
  if constexpr (kInTileLoop) copy_lane = lane_id_opaque();
#pragma unroll
  for (int c = copy_lane; c < 16 * kM * kChunksPerRow; c += 32) {
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    if (r < rows_valid && col < d) {
      *reinterpret_cast<uint4*>(o_rows + out.o(r, o_row_stride) + col) =
          *reinterpret_cast<const uint4*>(sO_warp + Stage::at(r, col));
    }
  }
}

// ---------------------------------------------------------------------------------
// Writes a warp's accumulator rows (times `scale`) to rows 0.. of a row-major slice; rows
// >= rows_valid and columns >= d are skipped. Two elements (4 bytes) per store: for a kernel
// that writes a tile once, not worth staging through shared memory.
// ---------------------------------------------------------------------------------
template <typename T, int kM, int kN>
__device__ __forceinline__ void store_rows(const float (&acc)[kM][kN][4], T* gmem, int64_t row_stride, int rows_valid,
                                           int d, float scale) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  for_each_tile<kM, kN>([&](int mt, int j) {
    const int col = 8 * j + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 16 * mt + g + 8 * half;
      if (col < d && r < rows_valid) {
        *reinterpret_cast<uint32_t*>(gmem + r * row_stride + col) =
            pack2<T>(acc[mt][j][2 * half] * scale, acc[mt][j][2 * half + 1] * scale);
      }
    }
  });
}

// store_rows for a warp's 16 rows through its own rows of shared memory (swarp: 16 rows of
// kStagedPitch<kHeadDim> elements, padded so that the fragment writes of a warp hit 32 different
// banks): the global stores become 16-byte vectors, two whole 128-element rows per warp
// instruction, instead of 4-byte pairs spread over 8 rows (half-used 32-byte sectors). The
// destination rows must be 16-byte aligned (d and the row stride multiples of 8 elements, as
// for every output flash_cuda allocates).
template <int kHeadDim>
constexpr int kStagedPitch = kHeadDim + 8;
template <typename T, int kN>
__device__ __forceinline__ void store_rows_staged(const float (&acc)[1][kN][4], T* swarp, T* gmem, int64_t row_stride,
                                                  int rows_valid, int d, float scale) {
  constexpr int kHeadDim = 8 * kN;
  using Stage = PaddedTile<kStagedPitch<kHeadDim>>;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      *reinterpret_cast<uint32_t*>(swarp + Stage::at(g + 8 * half, 8 * j + 2 * t)) =
          pack2<T>(acc[0][j][2 * half] * scale, acc[0][j][2 * half + 1] * scale);
  __syncwarp();
  constexpr int kChunks = kHeadDim / 8;
#pragma unroll
  for (int c = lane; c < 16 * kChunks; c += 32) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    if (r < rows_valid && col < d) {
      *reinterpret_cast<uint4*>(gmem + r * row_stride + col) = *reinterpret_cast<const uint4*>(swarp + Stage::at(r, col));
    }
  }
  __syncwarp();  // the rows are read before the warp writes them again
}

#endif  // __CUDACC__

}  // namespace flash_cuda
