// tiers/wgmma/family.h — the Hopper (sm_90a) family: its entry points, the contract the binding
// calls (applies / plan / run) and its dQ workspace; in an ablation build, where the backward's
// ablation switches (ablation.h) are consulted. Host code only.
//
//   forward   fwd/          warp-specialized: TMA producer warp, consumer warpgroups, ping-pong,
//                           persistent tiles, GQA packing; head dims 33..256
//   backward  bwd_ws.cuh    warp-specialized, dQ by bulk reductions into an fp32 workspace;
//                           head dims 33..128 (deterministic=False)
//             bwd_wide.cuh  warp-specialized, head-dim columns split between the consumers;
//                           head dims 129..256 (deterministic=False, kernel='auto')
//             bwd.cuh       cp.async, dK/dV and dQ kernels, no atomics (deterministic=True);
//                           head dims 33..128
//   A backward that wants only dQ, or only dK / dV (include/params.h: bwd_wants_dq / _dkdv),
//   runs that side's kernel of bwd.cuh alone (d 33..128) or, where bwd.cuh has no instance
//   (d 129..256, softcap's derivative), declines to the mma.sync family, which skips the same
//   way: the warp-specialized kernels compute dQ beside dK / dV in one pass, so they run only for
//   all three.
// Every launcher returns false, having launched nothing, where it does not apply (a GPU other
// than sm_90, a build without the 90a target, a view TMA cannot address): the caller falls back
// to the mma.sync family.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../../include/dispatch.h"
#include "../../include/params.h"
#include "ablation.h"
#include "config.h"

namespace flash_cuda {

// ---- entry points (csrc/instances/wgmma_*.cu): kVariant kPlain or kExtended, and for the
//      backwards kSoftcapGrad ----
template <int kDType, int kHeadDim, int kVariant> bool run_fwd_sm90_ws(const FwdParams& params, cudaStream_t stream);
// The forward's GQA-packed tiles (a tile holds 128 / G queries of all G = hq / hkv query heads of a
// KV group), kPlain.
template <int kDType, int kHeadDim> bool run_fwd_sm90_ws_gqa(const FwdParams& params, cudaStream_t stream);
// The forward with attention dropout (dense batches, no softcap / ALiBi), head-dim buckets 64 / 96 / 128.
template <int kDType, int kHeadDim> bool run_fwd_sm90_ws_dropout(const FwdParams& params, cudaStream_t stream);
template <int kDType, int kHeadDim, int kVariant> bool run_bwd_sm90(const BwdParams& params, cudaStream_t stream);
// The warp-specialized backward with attention dropout (dense batches, no softcap / ALiBi), head-dim
// buckets 64 / 96 / 128 (all on the 128-wide tiles).
template <int kDType, int kHeadDim> bool run_bwd_sm90_dropout(const BwdParams& params, cudaStream_t stream);
template <int kDType, int kHeadDim, int kVariant> bool run_bwd_sm90_wide(const BwdParams& params, cudaStream_t stream);

namespace wgmma {

template <int kDType, int kVariant> struct FwdEntry {
  template <int kD> static bool run(const FwdParams& p, cudaStream_t s) {
    if (has_dropout(p)) {  // (variant_of: kExtended) only the dropout instances draw
      if constexpr (kVariant == kExtended && kD <= 128) return run_fwd_sm90_ws_dropout<kDType, kD>(p, s);
      return false;
    }
    if constexpr (kVariant == kPlain && kD <= 128) {
      // GQA-packed tiles where they pay; the launcher may decline.
      bool pack;
      if constexpr (kAblations) {
        pack = ablation::pack_gqa(p);
      } else {
        pack = pack_gqa(p);
      }
      if (pack && run_fwd_sm90_ws_gqa<kDType, kD>(p, s)) return true;
    }
    return run_fwd_sm90_ws<kDType, kD, kVariant>(p, s);
  }
};
template <int kDType, int kVariant> struct BwdEntry {
  template <int kD> static bool run(const BwdParams& p, cudaStream_t s) {
    if (has_dropout(p)) {  // (variant_of: kExtended) only the dropout instances draw
      if constexpr (kVariant == kExtended) return run_bwd_sm90_dropout<kDType, kD>(p, s);
      return false;
    }
    return run_bwd_sm90<kDType, kD, kVariant>(p, s);
  }
};
template <int kDType, int kVariant> struct WideBwdEntry {
  template <int kD> static bool run(const BwdParams& p, cudaStream_t s) {
    return run_bwd_sm90_wide<kDType, kD, kVariant>(p, s);
  }
};

}  // namespace wgmma

// fp16 / bf16 on sm_90.
//   Forward: kernel='auto' at every head dim it has (d <= 32: dense calls without score modifiers
//   or dropout, config.h), kernel='wgmma' at the head dims its backward also has. Workspace: the
//   tile scheduler's counter (FwdParams::tile_counter), one zeroed int, where the grid may have
//   more tiles than SMs.
//   Backward: kernel='auto' and 'wgmma' at d 33..128, kernel='auto' at d 129..256 with
//   deterministic=False (the wide kernel) and at d <= 32 for the calls of
//   config.h: narrow_bwd_applies. Workspace, with deterministic=False
//   and every gradient wanted (the warp-specialized kernels run only then):
//   the fp32 dQ the warp-specialized kernels add into, zero-filled: tiles of 64, 80 (config.h:
//   bwd_steps80) or 128 rows at the head-dim bucket's width (bwd_ws.cuh: DqTile, bwd_wide.cuh: WideDqTile). Softcap's derivative with deterministic=True is declined (the
//   mma.sync family has it).
struct WgmmaFamily {
  static bool applies(const FwdParams& p, Tier tier) {
    // Dropout: the dropout instances where they apply, else the mma.sync family.
    if (p.sm_arch != 90 || (has_dropout(p) && !wgmma::fwd_dropout_applies(p))) return false;
    if (wgmma::narrow_fwd_applies(p)) return tier == Tier::kAuto;
    if (!wgmma::fwd_head_dim(p.d)) return false;
    if (tier == Tier::kWgmma) return wgmma::bwd_head_dim(p.d);
    return tier == Tier::kAuto;
  }
  static bool applies(const BwdParams& p, Tier tier) {
    if constexpr (kAblations) {
      if (p.d > 128 && !wgmma::ablation::bwd_wide_enabled()) return false;
      return applies_bwd(wgmma::ablation::bwd_call(p), tier);
    } else {
      return applies_bwd(p, tier);
    }
  }
  // The counter only where the persistent grid can have fewer CTAs than tiles: with at most one
  // tile per SM every CTA runs its first tile (blockIdx.x) alone and never draws (core/scheduler.cuh),
  // and a small call then costs the host no allocation and no memset. Counted with the shortest
  // tile (kFwdRowsPerConsumer rows, at most any kernel's): a kernel's own tiles are no more. (A
  // call without the counter that had more tiles would still be right: the CTAs then take every
  // gridDim.x-th tile.)
  static Workspace plan(FwdParams& p, Tier) {
    Workspace ws;
    const int64_t most_tiles = int64_t(ceil_div(p.sq, wgmma::kFwdRowsPerConsumer)) * p.hq * p.b;
    ws.ints = most_tiles > p.num_sms ? 1 : 0;
    return ws;
  }
  static Workspace plan(BwdParams& p, Tier) {
    if constexpr (kAblations) {
      return plan_bwd(wgmma::ablation::bwd_call(p));
    } else {
      return plan_bwd(p);
    }
  }
  static void attach(FwdParams& p, float*, int* ints) { p.tile_counter = ints; }
  static void attach(BwdParams& p, float* floats, int*) {
    p.dq_accum = floats;
    if (floats != nullptr && wgmma::ablation::bwd_bulk_stats(p)) {  // the pairs after the dQ tiles (plan_bwd)
      p.stats_rows = ceil_div(p.sq, bwd_block_m_of(p)) * bwd_block_m_of(p);
      p.bwd_stats = floats + dq_floats(p);
    }
  }
  static bool run(const FwdParams& p, Tier, cudaStream_t stream) {
    return with_dtype_variant<wgmma::FwdEntry, tiles::WgmmaFwdBuckets>(p, variant_of(p, /*backward=*/false), stream);
  }
  static bool run(const BwdParams& p, Tier tier, cudaStream_t stream) {
    if constexpr (kAblations) {
      return run_bwd(wgmma::ablation::bwd_call(p), tier, stream);
    } else {
      return run_bwd(p, tier, stream);
    }
  }
  // Whether the backward of a call runs the one-pass warp-specialized kernels (which alone have
  // softcap's derivative) rather than the deterministic two-kernel ones.
  static bool one_pass_backward(bool deterministic) {
    if constexpr (kAblations) {
      return !deterministic && !wgmma::ablation::bwd_split();
    } else {
      return !deterministic;
    }
  }

 private:
  static bool applies_bwd(const BwdParams& p, Tier tier) {
    if (p.sm_arch != 90) return false;
    if (has_dropout(p)) return tier == Tier::kAuto && wgmma::bwd_dropout_applies(p);
    if (wgmma::narrow_bwd_applies(p)) return tier == Tier::kAuto;
    return ((tier == Tier::kAuto || tier == Tier::kWgmma) && wgmma::bwd_head_dim(p.d)) ||
           wgmma::wide_bwd_applies(p, tier);
  }
  // The dQ workspace's tile height and floats.
  static int bwd_block_m_of(const BwdParams& p) {
    return wgmma::ablation::bwd_steps80(p) ? 80 : wgmma::bwd_block_m(wgmma::bwd_tile_width(p));
  }
  static int64_t dq_floats(const BwdParams& p) {
    const int block_m = bwd_block_m_of(p);
    return wgmma::dq_tile_count(p, block_m) * block_m * wgmma::bwd_tile_width(p);
  }
  static Workspace plan_bwd(const BwdParams& p) {
    Workspace ws;
    if (p.deterministic || !bwd_wants_all(p)) return ws;
    ws.floats = dq_floats(p);
    if (wgmma::ablation::bwd_bulk_stats(p)) {  // the (lse, delta) pairs: [b][hq][sq rounded up to the tile height][2]
      ws.floats += int64_t(p.b) * p.hq * ceil_div(p.sq, bwd_block_m_of(p)) * bwd_block_m_of(p) * 2;
    }
    ws.zero_floats = true;
    return ws;
  }
  static bool run_bwd(const BwdParams& p, Tier tier, cudaStream_t stream) {
    const Variant variant = variant_of(p, /*backward=*/true);
    if ((((tier == Tier::kAuto || tier == Tier::kWgmma) && wgmma::bwd_head_dim(p.d)) ||
         (tier == Tier::kAuto && wgmma::narrow_bwd_applies(p))) &&
        with_dtype_variant<wgmma::BwdEntry, tiles::WgmmaBwdBuckets, /*kWithSoftcapGrad=*/true>(p, variant, stream)) {
      return true;
    }
    return wgmma::wide_bwd_applies(p, tier) && p.dq_accum != nullptr &&
           with_dtype_variant<wgmma::WideBwdEntry, tiles::WgmmaBwdWideBuckets, /*kWithSoftcapGrad=*/true>(
               p, variant, stream);
  }
};

}  // namespace flash_cuda
