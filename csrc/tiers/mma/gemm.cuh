// tiers/mma/gemm.cuh — the two warp-level products of the mma.sync family (mma.sync m16n8k16
// fed by ldmatrix from padded shared-memory tiles), which every product of its forward and
// backward is one of. A warp's rows are kMTiles 16-row tiles; accumulators are C fragments
// (core/fragment.cuh). Each B fragment read from shared memory (one ldmatrix.x4: two 8-column
// tiles x 16) feeds 2 kMTiles mma.sync.
#pragma once

#include <cstdint>

#include "../../arch/fp8.cuh"
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

// ---------------------------------------------------------------------------------
// e4m3 (FP8) B operands from shared memory, converted in registers (the decode's FP8 caches,
// tiers/mma/decode.cuh: Fp8Config). Rows of e4m3 values are padded to a pitch of kPitchB bytes
// (16 more than a row: conflict-free ldmatrix).
//
// Products over d (S = Q K^T): within each 16-wide k-step the reduction index is relabeled so that
// lane t's k = 2t, 2t + 1, 2t + 8, 2t + 9 are columns 4t .. 4t + 3. A 16-bit ldmatrix row of an
// e4m3 tile then hands lane (g, t) bytes 4t .. 4t + 3 of row g: its whole k-step of one key, two
// B registers after the conversion. A's fragments take the same relabeling (load_a_frags_k4).
//
// Products over keys (O = P V): ldmatrix.trans of an e4m3 tile delivers, per 16-bit element, a
// column pair of a key: lane (g, t) gets columns 2g, 2g + 1 of keys 2t and 2t + 1. Its bytes
// regrouped by column (e4m3x4_even_odd_to) are the B registers of two 8-column tiles: the even
// columns of a 16-column chunk c (C tile 2c) and its odd ones (C tile 2c + 1). So C tile 2c's
// column n is column 16c + 2n of V and tile 2c + 1's is 16c + 2n + 1: lane t holds columns
// 16c + 4t .. 16c + 4t + 3 of O as (tile 2c, element 0), (2c + 1, 0), (2c, 1), (2c + 1, 1).
// ---------------------------------------------------------------------------------

// The relabeled A fragments of 16 rows of a padded 16-bit tile (the decode's Q), kK / 16 k-steps.
template <int kK, int kPitch, typename T>
__device__ __forceinline__ void load_a_frags_k4(uint32_t (&a)[kK / 16][4], const T* sA) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    // One 32-bit load per register: a 64-bit load would put a[ks][0] and a[ks][2] side by side,
    // where the mma wants a[ks][0..3] in consecutive registers, so every product would first move
    // its four (as it did: a fifth of the FP8 decode's instructions).
    const T* top = sA + g * kPitch + 16 * ks + 4 * t;
    const T* bottom = sA + (g + 8) * kPitch + 16 * ks + 4 * t;
    a[ks][0] = lds_u32(top);
    a[ks][1] = lds_u32(bottom);
    a[ks][2] = lds_u32(top + 2);
    a[ks][3] = lds_u32(bottom + 2);
  }
}

// The two k-steps ks, ks + 1 of one 16-key slice np of S += A K^T, K an e4m3 tile (keys as rows).
template <typename T, int kNT, int kPitchB>
__device__ __forceinline__ void mma_e4m3_rows_t(float (&acc)[1][kNT][4], const uint32_t (&a0)[4],
                                                const uint32_t (&a1)[4], const uint8_t* b_row, int ks, int np) {
  uint32_t r[4];  // keys 0-7 / 8-15 of the slice at k-step ks, then the same at ks + 1
  ldmatrix_x4(r, b_row + np * 16 * kPitchB + ks * 16);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint2 lo = e4m3x4_to<T>(r[2 * h]), hi = e4m3x4_to<T>(r[2 * h + 1]);
    const uint32_t b[4] = {lo.x, lo.y, hi.x, hi.y};
    mma_tile_pair<T>(acc, *reinterpret_cast<const uint32_t(*)[1][4]>(h == 0 ? &a0 : &a1), b, np);
  }
}

// acc[16 x kN] += A[16 x kK] * B[kN x kK]^T with A's relabeled fragments in registers
// (load_a_frags_k4) and B kN rows of e4m3 values.
template <typename T, int kK, int kN, int kPitchB>
__device__ __forceinline__ void gemm_frags_by_e4m3_rows_t(float (&acc)[1][kN / 8][4], const uint32_t (&a)[kK / 16][4],
                                                          const uint8_t* sB) {
  static_assert(kK % 32 == 0 && kN % 16 == 0, "k-step pairs, 16-key slices");
  const int lane = threadIdx.x % 32;
  // ldmatrix.x4: matrix m = lane / 8 is keys 8 (m % 2) .. + 7 at k-step ks + m / 2.
  const uint8_t* b_row = sB + ((lane / 8) % 2 * 8 + lane % 8) * kPitchB + (lane / 16) * 16;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ks += 2) {
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) mma_e4m3_rows_t<T, kN / 8, kPitchB>(acc, a[ks], a[ks + 1], b_row, ks, np);
  }
}

// The same with A's fragments read from its padded 16-bit tile per k-step pair (where they do
// not stay in registers: the decode's d = 256).
template <typename T, int kK, int kN, int kPitchA, int kPitchB>
__device__ __forceinline__ void gemm_rows_by_e4m3_rows_t(float (&acc)[1][kN / 8][4], const T* sA, const uint8_t* sB) {
  static_assert(kK % 32 == 0 && kN % 16 == 0, "k-step pairs, 16-key slices");
  const int lane = threadIdx.x % 32;
  const uint8_t* b_row = sB + ((lane / 8) % 2 * 8 + lane % 8) * kPitchB + (lane / 16) * 16;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ks += 2) {
    uint32_t a[2][4];
    load_a_frags_k4<32, kPitchA>(a, sA + 16 * ks);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) mma_e4m3_rows_t<T, kN / 8, kPitchB>(acc, a[0], a[1], b_row, ks, np);
  }
}

// acc[16 x kN] += A[16 x kK] * B[kK x kN], A held as fp32 C fragments (P) and B kK rows of e4m3
// values (row-major along kN); acc's columns as the section's comment relabels them.
template <typename T, int kK, int kN, int kPitchB>
__device__ __forceinline__ void gemm_regs_by_e4m3_rows(float (&acc)[1][kN / 8][4], const float (&a_frag)[1][kK / 8][4],
                                                       const uint8_t* sB) {
  static_assert(kK % 16 == 0 && kN % 32 == 0, "16-key steps, pairs of 16-column chunks");
  const int lane = threadIdx.x % 32;
  // ldmatrix.x4.trans: matrix m = lane / 8 is keys 8 (m % 2) .. + 7 of chunk cp + m / 2.
  const uint8_t* b_row = sB + ((lane / 8) % 2 * 8 + lane % 8) * kPitchB + (lane / 16) * 16;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t a[1][4];
    accumulator_to_a<T>(a[0], a_frag[0], ks);
#pragma unroll
    for (int cp = 0; cp < kN / 16; cp += 2) {
      uint32_t r[4];
      ldmatrix_x4_trans(r, b_row + ks * 16 * kPitchB + cp * 16);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 lo = e4m3x4_even_odd_to<T>(r[2 * h]);      // keys 2t, 2t + 1: (even, odd columns)
        const uint2 hi = e4m3x4_even_odd_to<T>(r[2 * h + 1]);  // keys 2t + 8, 2t + 9
        const uint32_t b[4] = {lo.x, hi.x, lo.y, hi.y};
        mma_tile_pair<T>(acc, a, b, cp + h);
      }
    }
  }
}

}  // namespace flash_cuda
