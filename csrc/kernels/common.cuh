// common.cuh — small device building blocks shared by every flash_cuda kernel tier:
// launch checking, warp reductions, 16-byte async copies, ldmatrix, mma.sync, type
// conversion. Each wrapper is one PTX instruction (or a few), named after it, so the
// SASS (LDGSTS, LDSM, HMMA) can be matched back to the source line by line.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include "../core/exp2.cuh"
#include "../core/gpu_class.h"
#include "../flash_params.h"

namespace flash_cuda {

// ---------------------------------------------------------------------------------
// Host side: launch checking.
// ---------------------------------------------------------------------------------

// Throws std::runtime_error("flash_cuda: kernel <name> ...") when the last launch (or an
// earlier asynchronous error) failed. Called right after every <<<...>>>. With the
// environment variable FLASH_CUDA_SYNC_CHECK=1 it also waits for the kernel, so that a
// fault inside it (an illegal address, say) is reported with this kernel's name.
inline void check_launch(const char* kernel_name) {
  static const bool sync_check = [] {
    const char* env = std::getenv("FLASH_CUDA_SYNC_CHECK");
    return env != nullptr && env[0] != '\0' && env[0] != '0';
  }();
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && sync_check) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("flash_cuda: kernel ") + kernel_name +
                             " failed: " + cudaGetErrorString(err));
  }
}

// The answer of a per-kernel host query on the current device, computed once per (kernel,
// device, key) and remembered: cudaFuncGetAttributes and cudaFuncSetAttribute cost
// microseconds each, and a small call's step is bound by the host, not the GPU. `compute`
// may throw; nothing is remembered then.
template <typename Compute>
inline int memo_per_kernel(const void* kernel, int key, Compute&& compute) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int>, int> memo;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return compute();
  }
  const std::lock_guard<std::mutex> lock(mutex);
  const auto at = std::make_tuple(kernel, dev, key);
  const auto it = memo.find(at);
  if (it != memo.end()) return it->second;
  const int value = compute();
  memo.emplace(at, value);
  return value;
}

// Raises the dynamic shared-memory limit of `kernel` when it needs more than 48 KiB (once per
// kernel, device and size).
template <typename Kernel>
inline void set_smem_limit(Kernel kernel, size_t smem_bytes, const char* kernel_name) {
  if (smem_bytes > 48 * 1024) {
    memo_per_kernel(reinterpret_cast<const void*>(kernel), static_cast<int>(smem_bytes), [&] {
      cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem_bytes));
      if (err != cudaSuccess) {
        throw std::runtime_error(std::string("flash_cuda: kernel ") + kernel_name + " needs " +
                                 std::to_string(smem_bytes) +
                                 " bytes of shared memory: " + cudaGetErrorString(err));
      }
      return 1;
    });
  }
}

// Largest dynamic shared memory one block may opt into on the current device (227 KiB on
// sm_90, 163 KiB on sm_80, 99 KiB on sm_86/89/120), queried once per device and cached, so the
// launchers can pick the largest tile configuration that fits; capped under emulation.
inline size_t device_smem_optin() {
  static std::atomic<int> cache[64];  // zero-initialised: 0 = not queried yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  const bool cacheable = dev >= 0 && dev < 64;
  int bytes = cacheable ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (bytes == 0) {
    if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // leave no error behind for check_launch to misreport
      bytes = 48 * 1024;
    }
    if (cacheable) cache[dev].store(bytes, std::memory_order_relaxed);
  }
  const size_t real = static_cast<size_t>(bytes);
  return emulated_arch() > 0 ? std::min(real, smem_budget_of_arch(emulated_arch())) : real;
}

FLASH_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// ---------------------------------------------------------------------------------
// Element types.
// ---------------------------------------------------------------------------------

template <int kDType> struct ElementOf;
template <> struct ElementOf<static_cast<int>(DType::kFloat32)> { using type = float; };
template <> struct ElementOf<static_cast<int>(DType::kFloat16)> { using type = __half; };
template <> struct ElementOf<static_cast<int>(DType::kBFloat16)> { using type = __nv_bfloat16; };

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

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

// One 32-bit register of two 16-bit values -> two floats.
template <typename T> __device__ __forceinline__ float2 unpack2(uint32_t r);
template <> __device__ __forceinline__ float2 unpack2<__half>(uint32_t r) {
  return __half22float2(*reinterpret_cast<__half2*>(&r));
}
template <> __device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t r) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r));
}

// ---------------------------------------------------------------------------------
// Warp-level reductions (shuffles, no shared memory).
// ---------------------------------------------------------------------------------

// Reduce over the `kWidth` consecutive lanes that share a row (kWidth a power of 2).
template <int kWidth>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
template <int kWidth>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Softmax stabiliser that never produces NaN: a row whose running max is still -inf
// (every key masked so far) subtracts 0 instead, giving exp2(-inf) = 0.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// ---------------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+: LDGSTS).
// ---------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Copies 16 bytes when `valid`, otherwise writes 16 zero bytes (src-size = 0 reads nothing,
// so `gmem` may then point anywhere mapped; callers pass the tensor base).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// ---------------------------------------------------------------------------------
// ldmatrix (LDSM): four 8x8 tiles of 16-bit values from shared memory into registers.
// Lane i supplies the address of row (i % 8) of tile (i / 8); register j of every lane
// then holds tile j's elements (row lane/4, columns 2*(lane%4) and 2*(lane%4)+1).
// The .trans form hands out the transposed tile instead.
// ---------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}

// ---------------------------------------------------------------------------------
// mma.sync m16n8k16 (HMMA), fp32 accumulate: D = A (16x16, row) * B (16x8, col) + D.
// Fragment ownership, with g = lane / 4 and t = lane % 4:
//   A: a[0] = (row g,   k 2t..2t+1)   a[1] = (row g+8, k 2t..2t+1)
//      a[2] = (row g,   k 2t+8..+9)   a[3] = (row g+8, k 2t+8..+9)
//   B: b[0] = (k 2t..2t+1, col g)     b[1] = (k 2t+8..+9, col g)
//   C: c[0], c[1] = (row g,   cols 2t, 2t+1)   c[2], c[3] = (row g+8, cols 2t, 2t+1)
// ---------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                  uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace flash_cuda
