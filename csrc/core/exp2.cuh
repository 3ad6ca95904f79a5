// core/exp2.cuh — 2^x as a polynomial on the FMA pipe, beside the MUFU unit's ex2.approx (one
// instruction, arch/sm80.cuh: ex2_approx, the default everywhere), for where the MUFU unit would
// be the bound (measured as an ablation of the Hopper forward's softmax, and for softcap's tanh:
// OPTIMIZATION.md has both; neither is a default).
#pragma once

#if defined(__CUDACC__)
#include <cuda_runtime.h>

#include "../arch/sm80.cuh"

namespace flash_cuda {

// exp2 on the FMA pipe, for a share of the softmax's elements where the MUFU unit is the
// bound (at d <= 128 one key block's exponentials take the MUFU about as long as the block's
// two products take the tensor cores; FlashAttention-4 splits them the same way):
// 2^x = 2^floor(x) * 2^f, f = x - floor(x) in [0, 1), 2^f by a minimax polynomial of degree
// kDegree (relative error 7.5e-5 at 3, 2.6e-6 at 4: below the rounding of P to bf16 / fp16),
// 2^floor(x) built from the integer bits of floor(x). x < -126 gives 0 (as ex2.approx.ftz
// does), -inf gives 0, x >= 128 a finite 2^127..2^128 (not inf), NaN stays NaN (max.NaN /
// min.NaN keep it, and it reaches the final product).
template <int kDegree>
__device__ __forceinline__ float poly_exp2(float x) {
  static_assert(kDegree == 3 || kDegree == 4, "fitted degrees");
  const float xc = min_nan(max_nan(x, -127.f), 127.f);  // x clamped to [-127, 127], NaN kept
  // 1.5 * 2^23 + floor(x): the sum's last mantissa bits are floor(x) (two's complement),
  // so its bits shifted left by 23 are floor(x) << 23.
  const float t = __fadd_rd(xc, 0x1.8p23f);
  const float f = xc - (t - 0x1.8p23f);  // both subtractions exact
  float p;
  if constexpr (kDegree == 3) {
    p = fmaf(fmaf(fmaf(0x1.3f9626p-4f, f, 0x1.cefc14p-3f), f, 0x1.644464p-1f), f, 0x1.fff62ep-1f);
  } else {
    p = fmaf(fmaf(fmaf(fmaf(0x1.bb7c76p-7f, f, 0x1.aa13dep-5f), f, 0x1.ee799ap-3f), f, 0x1.62d164p-1f), f,
             0x1.00002cp+0f);
  }
  // 2^floor(x) as a float: exponent field floor(x) + 127 (0 at floor(x) = -127: the product is 0).
  return p * __int_as_float((__float_as_int(t) << 23) + 0x3f800000);
}

}  // namespace flash_cuda

#endif  // __CUDACC__
