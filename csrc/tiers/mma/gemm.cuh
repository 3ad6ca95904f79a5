// tiers/mma/gemm.cuh — the two warp-level products of the mma.sync family (mma.sync m16n8k16
// fed by ldmatrix from padded shared-memory tiles), which every product of its forward and
// backward is one of. A warp's rows are kMTiles 16-row tiles; accumulators are C fragments
// (core/fragment.cuh). Each B fragment read from shared memory (one ldmatrix.x4: two 8-column
// tiles x 16) feeds 2 kMTiles mma.sync.
#pragma once

#include <cstdint>

#include "../../arch/sm80.cuh"
#include "../../core/fragment.cuh"

namespace flash_cuda {

// C tiles 2 np and 2 np + 1 of every 16-row tile += its A fragment times the two 8-column B
// fragments of one ldmatrix.x4 (registers {0, 1} and {2, 3}).
template <typename T, int kMTiles, int kNT>
__device__ __forceinline__ void mma_tile_pair(float (&acc)[kMTiles][kNT][4], const uint32_t (&a)[kMTiles][4],
                                              const uint32_t (&b)[4], int np) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
    mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
  }
}

// acc[16 kMTiles x kN] += A[16 kMTiles x kK] * B[kN x kK]^T, where A is the warp's rows of a
// padded shared tile starting at sA and B is kN consecutive rows starting at sB (both
// row-major along the reduction dimension kK).
template <typename T, int kMTiles, int kK, int kN, int kPitch>
__device__ __forceinline__ void gemm_rows_by_rows_t(float (&acc)[kMTiles][kN / 8][4], const T* sA,
                                                    const T* sB) {
  const int lane = threadIdx.x % 32;
  // A (16 x 16 per k-step), ldmatrix.x4: lanes 0-15 address rows 0-15 at column 0, lanes
  // 16-31 the same rows at column 8; the registers come out as a[0..3] of the mma A layout.
  const T* a_row = sA + (lane % 16) * kPitch + (lane / 16) * 8;
  // B (two 8-column n-tiles x 16 k per ldmatrix.x4): lane i addresses B-row (n)
  // 8 * (i / 16) + i % 8 at k-offset 8 * ((i / 8) % 2); registers {0,1} are b0, b1 of
  // n-tile 2np and {2,3} those of n-tile 2np+1 (non-transposed: B[k][n] = sB[n][k]).
  const T* b_row = sB + ((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], a_row + mt * 16 * kPitch + ks * 16);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, b_row + np * 16 * kPitch + ks * 16);
      mma_tile_pair<T>(acc, a, b, np);
    }
  }
}

// The A fragments of one 16-row tile over all kK / 16 k-steps (a warp's rows of a padded shared
// tile at sA), for a product that reuses them across many B tiles (the decode's Q).
template <int kK, int kPitch, typename T>
__device__ __forceinline__ void load_a_frags(uint32_t (&a)[kK / 16][4], const T* sA) {
  const int lane = threadIdx.x % 32;
  const T* a_row = sA + (lane % 16) * kPitch + (lane / 16) * 8;  // as in gemm_rows_by_rows_t
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) ldmatrix_x4(a[ks], a_row + ks * 16);
}

// acc[16 x kN] += A[16 x kK] * B[kN x kK]^T with A's fragments in registers (load_a_frags) and B
// as in gemm_rows_by_rows_t.
template <typename T, int kK, int kN, int kPitch>
__device__ __forceinline__ void gemm_frags_by_rows_t(float (&acc)[1][kN / 8][4], const uint32_t (&a)[kK / 16][4],
                                                     const T* sB) {
  const int lane = threadIdx.x % 32;
  const T* b_row = sB + ((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    const uint32_t (&ak)[1][4] = *reinterpret_cast<const uint32_t(*)[1][4]>(&a[ks]);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, b_row + np * 16 * kPitch + ks * 16);
      mma_tile_pair<T>(acc, ak, b, np);
    }
  }
}

// acc[16 kMTiles x kN] += A[16 kMTiles x kK] * B[kK x kN], where A is held as fp32 C
// fragments (P^T, dS^T or dS) and B is kK consecutive rows of a padded shared tile starting
// at sB (row-major along kN).
template <typename T, int kMTiles, int kK, int kN, int kPitch>
__device__ __forceinline__ void gemm_regs_by_rows(float (&acc)[kMTiles][kN / 8][4],
                                                  const float (&a_frag)[kMTiles][kK / 8][4], const T* sB) {
  const int lane = threadIdx.x % 32;
  // B (16 k x two 8-column n-tiles per ldmatrix.x4.trans): lanes 0-15 address k-rows 0-15
  // at column 0, lanes 16-31 the same rows at column 8. Transposed delivery turns the
  // row-major [k][n] tiles into b0 (k 0-7), b1 (k 8-15) of n-tile 2np (registers 0, 1) and
  // of n-tile 2np+1 (registers 2, 3).
  const T* b_row = sB + (lane % 16) * kPitch + (lane / 16) * 8;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    // C tiles 2ks and 2ks+1 (columns 16ks..16ks+15) form the A fragment of k-step ks.
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) accumulator_to_a<T>(a[mt], a_frag[mt], ks);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_row + ks * 16 * kPitch + np * 16);
      mma_tile_pair<T>(acc, a, b, np);
    }
  }
}

}  // namespace flash_cuda
