// tiers/mma/family.h — the mma.sync family (fp16 / bf16 on the tensor cores of every supported
// GPU, FlashAttention-2's design): its entry points and the contracts the binding calls. Host code.
//
//   forward   fwd.cuh     one CTA per query block, K / V through a two-stage cp.async ring
//   backward  bwd.cuh     delta, a dK/dV kernel and a dQ kernel, no atomics (deterministic)
//   decode    decode.cuh  split-KV decode over a dense or paged KV cache (DecodeFamily below)
// Every head-dim bucket of 32..256, every variant; tiles by the device's shared memory (the
// Hopper, A100 and consumer-card budgets of arch/gpu_class.h). It never declines: it is the
// fallback of the Hopper family.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "../../core/seqlen.cuh"
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

// ---- split-KV decode (DecodeFamily) ----
// It serves two kinds of calls:
//   * every call of flash_cuda.attention_with_kvcache (dense or paged cache, new keys appended
//     in place): the binding calls it directly, nothing else reads a paged cache;
//   * attention()'s and varlen_attention()'s decode-shaped calls (Sq or max_seqlen_q <=
//     kMaxDecodeQueries, kernel='auto'), which the query-tiled forwards would run on a handful of
//     CTAs walking every key: there the cache is k / v itself and every sequence holds all its
//     keys.
// Head-dim buckets 64, 128, 256 (zero-filled columns above d). Workspace: with more than one key
// range, the ranges' fp32 O and (m, log2 l) (core/combine.cuh merges them). FP8 (e4m3) caches
// (FwdParams::cache_fp8) have kernels of their own (kFp8), 16-bit queries as their 16-bit twins.
// ---- entry points (csrc/instances/decode_*.cu, decode_fp8_*.cu) ----
template <int kDType, int kHeadDim, bool kFp8> int plan_decode(const FwdParams& params);
template <int kDType, int kHeadDim, bool kFp8> bool run_decode(const FwdParams& params, cudaStream_t stream);

namespace decode {

// attention() calls with at most this many queries per head go to the decode family.
constexpr int kMaxDecodeQueries = 16;

template <int kDType, bool kFp8> struct PlanEntry {
  template <int kD> static int run(const FwdParams& p, cudaStream_t) { return plan_decode<kDType, kD, kFp8>(p); }
};
template <int kDType, bool kFp8> struct RunEntry {
  template <int kD> static bool run(const FwdParams& p, cudaStream_t s) {
    return run_decode<kDType, kD, kFp8>(p, s);
  }
};

template <template <int, bool> class Entry>
auto with_dtype(const FwdParams& p, cudaStream_t s) {
  const bool f16 = p.dtype == DType::kFloat16;
  if (p.cache_fp8) {
    return f16 ? with_bucket<Entry<kF16, true>>(p.d, tiles::DecodeBuckets{}, p, s)
               : with_bucket<Entry<kBF16, true>>(p.d, tiles::DecodeBuckets{}, p, s);
  }
  return f16 ? with_bucket<Entry<kF16, false>>(p.d, tiles::DecodeBuckets{}, p, s)
             : with_bucket<Entry<kBF16, false>>(p.d, tiles::DecodeBuckets{}, p, s);
}

}  // namespace decode

struct DecodeFamily {
  // A KV-cache call (the binding's fwd_kvcache) or a decode-shaped attention() call.
  static bool kvcache_call(const FwdParams& p) {
    return p.block_table != nullptr || p.k_new != nullptr || p.cache_seqlens != nullptr;
  }
  static bool applies(const FwdParams& p, Tier tier) {
    if (p.dtype == DType::kFloat32 || p.sm_arch < 80) return false;
    if (p.seqused_k != nullptr) return false;  // (its tiles read every key of the cache's length)
    if (kvcache_call(p)) return true;
    if (has_dropout(p)) return false;  // dropout: the mma.sync forward
    return tier == Tier::kAuto && p.sq <= decode::kMaxDecodeQueries;
  }
  static bool applies(const BwdParams&, Tier) { return false; }
  // Packs a KV group's query heads into one tile (ALiBi, a slope per head, takes one head per
  // tile), then plans the key ranges: splits_wanted, or the planner's count. num_splits = 0: no
  // configuration fits this device's shared memory (the call goes to the next family).
  static Workspace plan(FwdParams& p, Tier) {
    p.decode_heads = p.alibi_slopes != nullptr ? 1 : p.hq / p.hkv;
    const int planned = decode::with_dtype<decode::PlanEntry>(p, nullptr);
    p.num_splits = planned == 0 ? 0 : (p.splits_wanted > 0 ? p.splits_wanted : planned);
    Workspace ws;
    if (p.num_splits > 1) ws.floats = int64_t(p.num_splits) * decode_stat_rows(p) * (p.d + 2);
    return ws;
  }
  static Workspace plan(BwdParams&, Tier) { return {}; }
  static void attach(FwdParams& p, float* floats, int*) {
    p.o_accum = floats;
    p.stats_accum = floats == nullptr ? nullptr : floats + int64_t(p.num_splits) * decode_stat_rows(p) * p.d;
  }
  static void attach(BwdParams&, float*, int*) {}
  static bool run(const FwdParams& p, Tier, cudaStream_t stream) {
    if (p.num_splits == 0) return false;
    return decode::with_dtype<decode::RunEntry>(p, stream);
  }
  static bool run(const BwdParams&, Tier, cudaStream_t) { return false; }
};

}  // namespace flash_cuda
