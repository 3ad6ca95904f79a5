// core/fragment.cuh — the accumulator fragment of the tensor-core tiers as a type, and what every
// kernel does with it element by element.
//
// mma.sync m16n8k16 and wgmma leave their fp32 results in the same per-warp layout (the C
// fragment; wgmma's m64nN accumulator is that layout per warp, repeated over N / 8 column tiles).
// A warp's accumulator is float[kM][kN][4]: kM 16-row tiles by kN 8-column tiles, and with
// g = lane / 4, t = lane % 4, element e of tile (mt, nt) is
//     row 16 mt + g + 8 (e / 2),   column 8 nt + 2 t + (e % 2)
// so each thread holds two rows per 16-row tile (g and g + 8). Two neighbouring 8-column tiles,
// rounded to 16 bits, are exactly the A fragment of a 16-deep k-step of the next product: P, dS
// and P^T, dS^T go from the registers of one product to the tensor cores of the next without
// touching shared memory (accumulator_to_a).
#pragma once

#include <cstdint>

#include "../arch/fp8.cuh"
#include "../arch/sm80.cuh"
#include "../arch/types.cuh"

namespace flash_cuda {

#if defined(__CUDACC__)

// Calls f(mt, j) for every C tile (16-row tile mt, 8-column tile j) of a [kM][kN] fragment.
template <int kM, int kN, typename F>
__device__ __forceinline__ void for_each_tile(F&& f) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int j = 0; j < kN; ++j) f(mt, j);
}

// The layout above as the thread's first element (row g, column 2 t) and each element's
// constant offset from it, for loops that keep one per-thread base and add constants (ALiBi's
// distances in core/mask.cuh and core/softmax.cuh).
__host__ __device__ constexpr int fragment_row0(int lane) { return lane / 4; }
__host__ __device__ constexpr int fragment_col0(int lane) { return 2 * (lane % 4); }
__host__ __device__ constexpr int fragment_row_offset(int mt, int e) { return 16 * mt + 8 * (e / 2); }
__host__ __device__ constexpr int fragment_col_offset(int nt, int e) { return 8 * nt + e % 2; }

// Calls f(element, row, column) for every element a thread holds, rows counted from row_base
// and columns from col_base.
template <int kM, int kN, typename F>
__device__ __forceinline__ void for_each_element(float (&s)[kM][kN][4], int row_base, int col_base, F&& f) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(s[mt][nt][e], row_base + mt * 16 + g + (e / 2) * 8, col_base + nt * 8 + 2 * t + (e % 2));
}

// Bit 2 i + c set for each of a thread's columns 8 i + c (c = 0, 1; i < 16: its columns of 16
// C tiles, counted from the thread's first) that lies below x.
__device__ __forceinline__ uint32_t columns_below(int x) {
  x = x < 0 ? 0 : (x > 128 ? 128 : x);
  const int r = x & 7;
  const int n = 2 * (x >> 3) + (r < 2 ? r : 2);  // 0 .. 32
  return low_bits(n);
}

// Sets every element whose column lies outside its row's range to `value`: range_of(row) gives
// the row's half-open [lo, hi) (core/mask.cuh: ColumnRange), rows from row_base and columns from
// col_base as in for_each_element. Per row and 16 C tiles the visible columns become one 32-bit
// mask (a few integer instructions); per element a constant bit of it decides, which the
// compiler can move into predicates (R2P, 7 bits at once) instead of comparing indices element
// by element.
template <int kM, int kN, typename RangeOf>
__device__ __forceinline__ void fill_outside_columns(float (&s)[kM][kN][4], int row_base, int col_base, float value,
                                                     RangeOf&& range_of) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const auto r = range_of(row_base + mt * 16 + g + half * 8);
#pragma unroll
      for (int n0 = 0; n0 < kN; n0 += 16) {
        const int c0 = col_base + 8 * n0 + 2 * t;  // the thread's first column of these tiles
        const uint32_t keep = columns_below(r.hi - c0) & ~columns_below(r.lo - c0);
#pragma unroll
        for (int i = 0; i < 16 && n0 + i < kN; ++i)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (!((keep >> (2 * i + c)) & 1u)) s[mt][n0 + i][half * 2 + c] = value;
      }
    }
}

template <int kM, int kN>
__device__ __forceinline__ void zero_fill(float (&acc)[kM][kN][4]) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int j = 0; j < kN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;
}

// The A fragment of k-step kk of the next product: 8-column tiles 2 kk and 2 kk + 1 of one
// 16-row tile, rounded to T.
template <typename T, int kN>
__device__ __forceinline__ void accumulator_to_a(uint32_t (&a)[4], const float (&d)[kN][4], int kk) {
  a[0] = pack2<T>(d[2 * kk][0], d[2 * kk][1]);          // row g,     k 2t, 2t + 1
  a[1] = pack2<T>(d[2 * kk][2], d[2 * kk][3]);          // row g + 8, k 2t, 2t + 1
  a[2] = pack2<T>(d[2 * kk + 1][0], d[2 * kk + 1][1]);  // row g,     k 2t + 8, + 9
  a[3] = pack2<T>(d[2 * kk + 1][2], d[2 * kk + 1][3]);  // row g + 8, k 2t + 8, + 9
}

// Every k-step's A fragment of one 16-row tile (kN 8-column tiles: kN / 2 k-steps of 16).
template <typename T, int kN>
__device__ __forceinline__ void accumulator_to_a(uint32_t (&a)[kN / 2][4], const float (&d)[kN][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 2; ++kk) accumulator_to_a<T>(a[kk], d, kk);
}

#endif  // __CUDACC__

// ---- e4m3 products (Hopper's FP8 forward) ----
// An e4m3 A fragment holds four keys of one row per register (arch/sm90_wgmma.cuh: register i,
// row g + 8 (i % 2), A columns 16 (i / 2) + 4 t .. + 3 of a 32-deep k-step), where the accumulator
// gives thread t keys 2 t, 2 t + 1 of each 8-column tile. Rather than exchange values between the
// lanes of a quad, the thread packs its own keys, 2 t, 2 t + 1, 8 + 2 t, 9 + 2 t (and the same
// 16 keys on), and the other operand, V^T, holds the keys of each 32-key k-step in that order:
// its column c is key e4m3_pv_key(c) of the k-step. A sum over keys does not depend on their
// order, so P V is unchanged (core/fp8_v_layout.cuh lays V^T out so).
__host__ __device__ constexpr int e4m3_pv_key(int c) {
  return 16 * (c / 16) + 8 * ((c % 4) / 2) + 2 * ((c % 16) / 4) + (c % 2);
}

#if defined(__CUDACC__)

// The e4m3 A fragment of k-step kk (8-column tiles 4 kk .. 4 kk + 3 of one 16-row tile; each
// value rounded to nearest even, saturated at +-448: arch/fp8.cuh), in e4m3_pv_key's key order.
template <int kN>
__device__ __forceinline__ void accumulator_to_a_e4m3(uint32_t (&a)[4], const float (&d)[kN][4], int kk) {
  auto pack4 = [](float x0, float x1, float x2, float x3) {
    return uint32_t(f32x2_to_e4m3x2(x0, x1)) | (uint32_t(f32x2_to_e4m3x2(x2, x3)) << 16);
  };
  const int j = 4 * kk;
  a[0] = pack4(d[j][0], d[j][1], d[j + 1][0], d[j + 1][1]);              // row g,     keys 2t, 2t+1, 8+2t, 9+2t
  a[1] = pack4(d[j][2], d[j][3], d[j + 1][2], d[j + 1][3]);              // row g + 8, the same keys
  a[2] = pack4(d[j + 2][0], d[j + 2][1], d[j + 3][0], d[j + 3][1]);      // row g,     16 keys further
  a[3] = pack4(d[j + 2][2], d[j + 2][3], d[j + 3][2], d[j + 3][3]);      // row g + 8
}

// Every k-step's e4m3 A fragment of one 16-row tile (kN 8-column tiles: kN / 4 k-steps of 32).
template <int kN>
__device__ __forceinline__ void accumulator_to_a_e4m3(uint32_t (&a)[kN / 4][4], const float (&d)[kN][4]) {
  static_assert(kN % 4 == 0, "whole 32-key k-steps");
#pragma unroll
  for (int kk = 0; kk < kN / 4; ++kk) accumulator_to_a_e4m3(a[kk], d, kk);
}

#endif  // __CUDACC__

}  // namespace flash_cuda
