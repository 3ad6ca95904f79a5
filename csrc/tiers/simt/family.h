// tiers/simt/family.h — the fp32 family (true fp32 FFMA on the CUDA cores: no TF32, no tensor
// cores): its entry points and the contract the binding calls (plan, run). Host code.
//
//   forward   fwd.cuh, fwd_outer.cuh   register-blocked products with the online softmax between
//                                      them; the outer-product kernel at head dims 97..128 where
//                                      the shared memory allows; the last wave's blocks may be
//                                      split over key ranges and merged (core/combine.cuh)
//   backward  bwd.cuh                  delta, dK/dV (dQ by atomics, or a dQ kernel when
//                                      deterministic), its last wave split likewise; a call
//                                      that wants one side only runs that side's kernel
// Head-dim buckets 32, 64, 128, 256.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../../include/dispatch.h"
#include "../../include/params.h"

namespace flash_cuda {

// ---- entry points (csrc/instances/simt_*.cu) ----
// plan_fwd_simt decides whether the forward splits key ranges (sets params.split_begin and
// num_splits) and returns how many floats of workspace that needs (0: none); the caller points
// params.o_accum at that many floats, then calls run_fwd_simt with the same params.
template <int kHeadDim> int64_t plan_fwd_simt(FwdParams& params);
template <int kHeadDim> void run_fwd_simt(const FwdParams& params, cudaStream_t stream);
// plan_bwd_simt does the same for the backward's dK/dV kernel (params.dkv_accum).
template <int kHeadDim> int64_t plan_bwd_simt(BwdParams& params);
template <int kHeadDim> void run_bwd_simt(const BwdParams& params, cudaStream_t stream);

namespace simt {

// Whether the dK/dV kernel adds dQ with atomics into params.dq (fp32), which must then start at
// zero (the binding zero-fills it): deterministic=False with every gradient wanted. A call that
// wants only dQ runs the dQ kernel, which writes each element once; one that wants only dK / dV
// runs the dK/dV kernel without atomics (include/params.h: bwd_wants_dq / _dkdv).
inline bool dq_by_atomics(const BwdParams& p) { return !p.deterministic && bwd_wants_all(p); }

// The entry points by direction (overloads on the params), behind one bucket switch each.
template <int kD> int64_t plan(FwdParams& p) { return plan_fwd_simt<kD>(p); }
template <int kD> int64_t plan(BwdParams& p) { return plan_bwd_simt<kD>(p); }
template <int kD> void run(const FwdParams& p, cudaStream_t s) { run_fwd_simt<kD>(p, s); }
template <int kD> void run(const BwdParams& p, cudaStream_t s) { run_bwd_simt<kD>(p, s); }
struct Plan {
  template <int kD, typename Params> static int64_t run(Params& p) { return plan<kD>(p); }
};
struct Run {
  template <int kD, typename Params> static bool run(const Params& p, cudaStream_t s) {
    simt::run<kD>(p, s);
    return true;
  }
};

}  // namespace simt

// fp32 calls (the binding resolves kernel='auto' to this family for float32 inputs). The
// workspace: the partial results of the last wave's split blocks, where the plan splits them.
struct SimtFamily {
  static bool applies(const FwdParams&, Tier tier) { return tier == Tier::kSimt; }
  template <typename Params>
  static Workspace plan(Params& p, Tier) {
    Workspace ws;
    ws.floats = with_bucket<simt::Plan>(p.d, tiles::SimtBuckets{}, p);
    return ws;
  }
  static void attach(FwdParams& p, float* floats, int*) { p.o_accum = floats; }
  static void attach(BwdParams& p, float* floats, int*) { p.dkv_accum = floats; }
  template <typename Params>
  static bool run(const Params& p, Tier, cudaStream_t stream) {
    return with_bucket<simt::Run>(p.d, tiles::SimtBuckets{}, p, stream);
  }
};

}  // namespace flash_cuda
