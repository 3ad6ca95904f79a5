// include/dispatch.h — the static switches from a call's run-time facts (dtype, head dim,
// variant) to the kernel instance built for them, for the families' host code. Head dims are
// served by buckets: an instance built for bucket kHeadDim handles every d <= kHeadDim
// (multiple of 8) by zero-filling the missing columns; each family's buckets are in the tile
// table (csrc/instances/tiles.py, written out as include/tiles.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <utility>

#include "params.h"
#include "tiles.h"

namespace flash_cuda {

// The contract of a kernel family (csrc/tiers/<family>/family.h: a struct of static functions,
// each overloaded for FwdParams and BwdParams):
//   applies(params, tier)            whether the call goes to this family at all
//   plan(params, tier) -> Workspace  what it needs besides the outputs (it may also fill the
//                                    params' plan fields, such as a split of key ranges)
//   attach(params, floats, ints)     points the params at that workspace
//   run(params, tier, stream)        launches; false, having launched nothing, where it declines
//                                    after all (a view TMA cannot address, a build without the
//                                    GPU's target): the binding then asks the next family.
// The workspace: `floats` fp32 words (zero-filled where zero_floats) and `ints` zeroed int32 words.
struct Workspace {
  int64_t floats = 0;
  bool zero_floats = false;
  int64_t ints = 0;
};

constexpr int kF16 = static_cast<int>(DType::kFloat16);
constexpr int kBF16 = static_cast<int>(DType::kBFloat16);

// Calls Fn::template run<Bucket>(args...) for the smallest bucket of `buckets` that holds d (a
// default result when none does).
template <typename Fn, int... kBuckets, typename... Args>
auto with_bucket(int d, std::integer_sequence<int, kBuckets...>, Args&&... args) {
  using R = decltype(Fn::template run<256>(args...));
  R result{};
  bool done = false;
  ((!done && d <= kBuckets ? (result = Fn::template run<kBuckets>(args...), done = true) : false), ...);
  return result;
}

// The switches over dtype and variant, then the bucket: Entry<kDType, kVariant> is a struct with
// `template <int kD> static bool run(params, stream)`. Only the backwards have kSoftcapGrad
// instances (kWithSoftcapGrad).
template <template <int, int> class Entry, typename Buckets, bool kWithSoftcapGrad = false, typename Params>
bool with_dtype_variant(const Params& p, Variant variant, cudaStream_t stream) {
  const bool f16 = p.dtype == DType::kFloat16;
  switch (variant) {
    case kPlain:
      return f16 ? with_bucket<Entry<kF16, kPlain>>(p.d, Buckets{}, p, stream)
                 : with_bucket<Entry<kBF16, kPlain>>(p.d, Buckets{}, p, stream);
    case kExtended:
      return f16 ? with_bucket<Entry<kF16, kExtended>>(p.d, Buckets{}, p, stream)
                 : with_bucket<Entry<kBF16, kExtended>>(p.d, Buckets{}, p, stream);
    default:
      if constexpr (kWithSoftcapGrad) {
        return f16 ? with_bucket<Entry<kF16, kSoftcapGrad>>(p.d, Buckets{}, p, stream)
                   : with_bucket<Entry<kBF16, kSoftcapGrad>>(p.d, Buckets{}, p, stream);
      }
      throw std::runtime_error("flash_cuda: internal error: no softcap-gradient instance for this family");
  }
}

// The partial-result merge (include/params.h: MergeParams; csrc/instances/merge_partials_*.cu),
// one instance per type of the partial b (operand a and the output: that type or float32).
template <int kDType> void run_merge_partials(const MergeParams& params, cudaStream_t stream);

// A KV cache appended to and laid out for the query-tiled forwards (include/params.h:
// KvGatherTarget; core/kv_gather.cuh, csrc/instances/kv_gather.cu); kBytes: the element size.
template <int kBytes> void run_kv_gather(const FwdParams& params, const KvGatherTarget& target, cudaStream_t stream);

// V of an FP8 forward laid out for its P V product (include/params.h: Fp8VLayoutParams;
// core/fp8_v_layout.cuh, csrc/instances/fp8_v_layout.cu).
template <typename T> void run_fp8_v_layout(const Fp8VLayoutParams& params, cudaStream_t stream);

// The FP8 (e4m3) forward on Hopper (tiers/wgmma/fwd/launch.cuh; csrc/instances/wgmma_fwd_fp8_*.cu):
// O in kOutDType (kBF16 or kF16), head dims 128 and 256; false where it does not run.
template <int kOutDType, int kHeadDim> bool run_fwd_sm90_fp8(const FwdParams& params, cudaStream_t stream);

}  // namespace flash_cuda
