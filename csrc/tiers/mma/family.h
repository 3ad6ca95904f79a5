// tiers/mma/family.h — the mma.sync family (fp16 / bf16 on the tensor cores of every supported
// GPU, FlashAttention-2's design): its entry points and the contract the binding calls. Host code.
//
//   forward   fwd.cuh   one CTA per query block, K / V through a two-stage cp.async ring
//   backward  bwd.cuh   delta, a dK/dV kernel and a dQ kernel, no atomics (deterministic)
// Every head-dim bucket of 32..256, every variant; tiles by the device's shared memory (the
// Hopper, A100 and consumer-card budgets of arch/gpu_class.h). It never declines: it is the
// fallback of the Hopper family.
#pragma once

#include <cuda_runtime_api.h>

#include "../../include/dispatch.h"
#include "../../include/params.h"

namespace flash_cuda {

// ---- entry points (csrc/instances/mma_*.cu): kVariant kPlain, kExtended, and for the
//      backward kSoftcapGrad ----
template <int kDType, int kHeadDim, int kVariant> void run_fwd_mma(const FwdParams& params, cudaStream_t stream);
template <int kDType, int kHeadDim, int kVariant> void run_bwd_mma(const BwdParams& params, cudaStream_t stream);

namespace mma {

template <int kDType, int kVariant> struct FwdEntry {
  template <int kD> static bool run(const FwdParams& p, cudaStream_t s) {
    run_fwd_mma<kDType, kD, kVariant>(p, s);
    return true;
  }
};
template <int kDType, int kVariant> struct BwdEntry {
  template <int kD> static bool run(const BwdParams& p, cudaStream_t s) {
    run_bwd_mma<kDType, kD, kVariant>(p, s);
    return true;
  }
};

}  // namespace mma

// fp16 / bf16 on every GPU: kernel='auto' where the Hopper family declines, and kernel='mma'. No
// workspace, no plan: the kernels write every output element exactly once.
struct MmaFamily {
  static bool applies(const FwdParams&, Tier tier) { return tier == Tier::kAuto || tier == Tier::kMma; }
  template <typename Params>
  static Workspace plan(Params&, Tier) {
    return {};
  }
  static void attach(FwdParams&, float*, int*) {}
  static bool run(const FwdParams& p, Tier, cudaStream_t stream) {
    return with_dtype_variant<mma::FwdEntry, tiles::MmaBuckets>(p, variant_of(p, /*backward=*/false), stream);
  }
  static bool run(const BwdParams& p, Tier, cudaStream_t stream) {
    return with_dtype_variant<mma::BwdEntry, tiles::MmaBuckets, /*kWithSoftcapGrad=*/true>(
        p, variant_of(p, /*backward=*/true), stream);
  }
};

}  // namespace flash_cuda
