// arch/host.h — the host side of every launch: checking a launch, remembering per-kernel
// attribute queries, raising a kernel's shared-memory limit, the device's shared-memory budget,
// and whether a kernel was built for the device (no torch, no kernels here).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "../include/params.h"
#include "gpu_class.h"

namespace flash_cuda {

FLASH_HOST_DEVICE constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

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

// True when `kernel` was compiled for sm_90a (its code runs, rather than trapping, on this
// device). Builds without the 90a target (FLASH_CUDA_ARCHS="80") keep the portable tiers.
template <typename Kernel>
inline bool sm90_kernel_built(Kernel kernel) {
  return memo_per_kernel(reinterpret_cast<const void*>(kernel), /*key=*/-1, [&] {
           cudaFuncAttributes attr;
           if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
             (void)cudaGetLastError();
             return 0;
           }
           return attr.binaryVersion == 90 ? 1 : 0;
         }) != 0;
}

}  // namespace flash_cuda
