// arch/fp8.cuh — the e4m3 (float8_e4m3fn) conversions of the FP8 KV cache: e4m3 to 16-bit values
// (exact: every e4m3 value is an fp16 and a bf16 value) and float to e4m3 (round to nearest even,
// saturating at +-448, NaN kept), by the cvt instructions of sm_89 and newer. Elsewhere they trap:
// the launcher asks for compute capability 8.9 before it runs an FP8 kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace flash_cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define FLASH_FP8_CVT 1
#else
#define FLASH_FP8_CVT 0
#endif

// Two e4m3 values (the low byte first) as two fp16 values (the low half first).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint16_t x) {
#if FLASH_FP8_CVT
  uint32_t r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(x));
  return r;
#else
  __trap();
  return x;
#endif
}

// Four e4m3 values (a 32-bit word, the low byte first) as four values of T (two words).
// Both halves of x are split inside one asm block, so that the conversion reads the high half of
// the register in place (a shift per pair otherwise).
template <typename T>
__device__ __forceinline__ uint2 e4m3x4_to(uint32_t x) {
#if FLASH_FP8_CVT
  uint32_t lo, hi;
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
#else
  __trap();
  const uint32_t lo = x, hi = x;
#endif
  if constexpr (std::is_same<T, __half>::value) {
    return make_uint2(lo, hi);
  } else {
    static_assert(std::is_same<T, __nv_bfloat16>::value, "fp16 or bf16");
    // fp16 -> fp32 -> bf16 is exact for e4m3 values (3 mantissa bits, exponents within both).
    auto to_bf16x2 = [](uint32_t h2) {
      const __half2 h = *reinterpret_cast<const __half2*>(&h2);
      const __nv_bfloat162 b = __floats2bfloat162_rn(__low2float(h), __high2float(h));
      return *reinterpret_cast<const uint32_t*>(&b);
    };
    return make_uint2(to_bf16x2(lo), to_bf16x2(hi));
  }
}

// A word of four e4m3 values (b0, b1, b2, b3) as the registers (b0, b2) and (b1, b3) of two values
// of T each: what ldmatrix.trans delivers of a row-major e4m3 tile (two keys' column pairs) regrouped
// into one register per column (arch: one byte permutation, then the two conversions).
template <typename T>
__device__ __forceinline__ uint2 e4m3x4_even_odd_to(uint32_t x) {
  return e4m3x4_to<T>(__byte_perm(x, 0, 0x3120));
}

// Two floats as e4m3 (lo in the low byte): round to nearest even, +-inf and values beyond 448
// saturated to +-448, NaN kept.
__device__ __forceinline__ uint16_t f32x2_to_e4m3x2(float lo, float hi) {
#if FLASH_FP8_CVT
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));  // (first operand: high byte)
  return r;
#else
  __trap();
  return static_cast<uint16_t>(lo + hi);
#endif
}

}  // namespace flash_cuda
