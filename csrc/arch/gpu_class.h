// arch/gpu_class.h — the GPU classes flash_cuda chooses tile configurations for, and the
// emulation switch that lets one GPU test another class's choices. Host code (no CUDA).
#pragma once

#include <cstddef>
#include <cstdlib>

namespace flash_cuda {

// Dynamic shared memory one block may opt into, by GPU class: the budgets every tier's tile
// configurations are checked against (static_asserts next to each tier's configurations).
constexpr size_t kSmemConsumer = 99 * 1024;  // sm_86, sm_89, sm_120: RTX 30/40/50, A10, L40
constexpr size_t kSmemA100 = 163 * 1024;     // sm_80, sm_87: A100, Orin
constexpr size_t kSmemHopper = 227 * 1024;   // sm_90, sm_100: H100 / H200, B200

inline size_t smem_budget_of_arch(int arch) {
  if (arch == 80 || arch == 87) return kSmemA100;
  if (arch == 90 || arch == 100 || arch == 103) return kSmemHopper;
  return kSmemConsumer;
}

// FLASH_CUDA_EMULATE_ARCH=86 (or 80, 89, 120, ...) makes flash_cuda choose its kernels as on
// that GPU class: the shared memory a block may opt into is capped at that class's budget
// (device_smem_optin) and the binding reports that compute capability to the dispatcher, so
// the Hopper tier is not used off sm_90. The kernels still run on the real GPU: this tests, on
// a Hopper machine, the configurations a consumer card or an A100 would get, not their speed
// there. 0: off.
inline int emulated_arch() {
  static const int arch = [] {
    const char* env = std::getenv("FLASH_CUDA_EMULATE_ARCH");
    return env != nullptr ? static_cast<int>(std::strtol(env, nullptr, 10)) : 0;
  }();
  return arch > 0 ? arch : 0;
}

}  // namespace flash_cuda
