// arch/types.cuh — the element types flash_cuda computes with and their conversions: the
// C++ type of a DType, 16-bit values as floats, and the packing of two 16-bit values into the
// 32-bit registers the tensor-core instructions take.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../include/params.h"

namespace flash_cuda {

template <int kDType> struct ElementOf;
template <> struct ElementOf<static_cast<int>(DType::kFloat32)> { using type = float; };
template <> struct ElementOf<static_cast<int>(DType::kFloat16)> { using type = __half; };
template <> struct ElementOf<static_cast<int>(DType::kBFloat16)> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Two floats -> one 32-bit register holding two 16-bit values (lo = a, hi = b),
// the operand format of mma.sync.
template <typename T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace flash_cuda
