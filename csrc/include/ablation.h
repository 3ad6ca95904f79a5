// include/ablation.h — the switches of the optimization record's ablation rungs.
//
// Production builds (the default) compile no ablation rung and read no switch: every function
// below returns the default, and the kernels OPTIMIZATION.md measured against the defaults are not
// built. `FLASH_CUDA_ABLATIONS=1 pip install ...` (setup.py: -DFLASH_CUDA_ABLATIONS) builds them
// and reads each rung's environment switch at launch, so that a rung is measured against the
// default on the same build. The Hopper family's switches are documented in
// tiers/wgmma/ablation.h.
#pragma once

#include <cstdlib>
#include <cstring>

namespace flash_cuda {

#if defined(FLASH_CUDA_ABLATIONS)
constexpr bool kAblations = true;
// The integer value of switch `name`, `unset` when it is not set.
inline int ablation_int(const char* name, int unset) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : unset;
}
// Whether switch `name` is set to `value`.
inline bool ablation_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::strcmp(v, value) == 0;
}
#else
constexpr bool kAblations = false;
inline int ablation_int(const char*, int unset) { return unset; }
inline bool ablation_is(const char*, const char*) { return false; }
#endif

}  // namespace flash_cuda
