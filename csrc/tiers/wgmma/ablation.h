// tiers/wgmma/ablation.h — the Hopper family's ablation switches (include/ablation.h): each names
// one configuration OPTIMIZATION.md measured against the default. They are read only in a build
// with FLASH_CUDA_ABLATIONS, and only where that build consults its ablations first: the
// forward's ablation launcher (fwd/ablation.cuh), the family's contract (family.h, the
// backward's switches below) and the backward's launcher (bwd_ws.cuh: the 80-query rung). The production decisions (config.h, tile_policy.h) read none.
// Host code only.
#pragma once

#include "../../include/ablation.h"
#include "../../include/params.h"
#include "config.h"

namespace flash_cuda {
namespace wgmma {
namespace ablation {

// ---- forward (fwd/ablation.cuh) ----
// FLASH_CUDA_WS_SCHEDULE=serial: the forward's serial schedule (each product waited for at once)
//     instead of the overlapped one (intra-warpgroup overlap and ping-pong).
inline bool ws_serial() { return ablation_is("FLASH_CUDA_WS_SCHEDULE", "serial"); }
// FLASH_CUDA_WS_PERSISTENT=0: one CTA per tile instead of one per SM looping over tiles.
inline bool ws_persistent() { return ablation_int("FLASH_CUDA_WS_PERSISTENT", 1) != 0; }
// FLASH_CUDA_WS_BLOCK_N=192: the d = 64 kPlain forward steps over 192 keys instead of 128.
inline int ws_block_n_override() { return ablation_int("FLASH_CUDA_WS_BLOCK_N", 0); }
// FLASH_CUDA_WS_STAGES=4: the d = 64 kPlain forward with 4 K/V stages in its ring instead of 2.
inline int ws_stages_override() { return ablation_int("FLASH_CUDA_WS_STAGES", 0); }
// FLASH_CUDA_WS_BLOCK_M=128 | 192: the d = 64 / 96 kPlain forward's tiles, 128 rows (two
// consumer warpgroups) or 192 (three; 128 keys per step at d = 64, 80 at d = 96); unset: 192 rows
// from Sq = 2048 on.
inline int ws_block_m_override() { return ablation_int("FLASH_CUDA_WS_BLOCK_M", 0); }
// FLASH_CUDA_WS_TALL_BLOCK_N=96: the d = 64 kPlain forward's 192-row tiles step over 96 keys
// instead of 128 (the default before OPTIMIZATION.md step 58), wherever the 192-row tiles run.
inline int ws_tall_block_n_override() { return ablation_int("FLASH_CUDA_WS_TALL_BLOCK_N", 0); }
// FLASH_CUDA_WS_EXP2_POLY=N (4 or 8): in the d 64 / 128 kPlain forward every N-th 8-key tile of
// P is exponentiated on the FMA pipe (poly_exp2) instead of MUFU.
inline int ws_exp2_poly_every() { return ablation_int("FLASH_CUDA_WS_EXP2_POLY", 0); }
// FLASH_CUDA_WS_PACK_GQA=1 | 0: GQA packing wherever it can run, or never (unset: config.h's
// pack_gqa).
inline int ws_pack_gqa_force() { return ablation_int("FLASH_CUDA_WS_PACK_GQA", -1); }
// FLASH_CUDA_SM90_FP8_BLOCK_N=128 | 224: the FP8 forward at d = 128 steps over 128 or 224 keys
// instead of 192 (tile_policy.h: fwd_fp8_block_n).
inline int fp8_block_n_override() { return ablation_int("FLASH_CUDA_SM90_FP8_BLOCK_N", 0); }
// Whether a switch of a forward rung with tiles other than the default is set: GQA packing (which
// runs the default tiles, overlapped) then stays off.
inline bool fwd_rung_set() {
  return ws_serial() || ws_exp2_poly_every() != 0 || ws_block_n_override() != 0 || ws_stages_override() != 0 ||
         ws_block_m_override() != 0;
}
// GQA packing for a call: where it can run, forced on or off, else config.h's rule.
inline bool pack_gqa(const FwdParams& p) {
  if (!can_pack_gqa(p) || fwd_rung_set()) return false;
  const int force = ws_pack_gqa_force();
  return force >= 0 ? force != 0 : wgmma::pack_gqa(p);
}

// ---- backward (family.h) ----
// FLASH_CUDA_SM90_BWD=split: the deterministic two-kernel backward also for deterministic=False:
// the family then decides on a call as on its deterministic=True twin.
inline bool bwd_split() { return ablation_is("FLASH_CUDA_SM90_BWD", "split"); }
inline BwdParams bwd_call(const BwdParams& p) {
  BwdParams q = p;
  if (bwd_split()) q.deterministic = true;
  return q;
}
// FLASH_CUDA_SM90_BWD_D256=0: head dims 129..256 run the mma.sync backward instead of the wide one.
inline bool bwd_wide_enabled() { return ablation_int("FLASH_CUDA_SM90_BWD_D256", 1) != 0; }
// FLASH_CUDA_SM90_BWD_RELEASE=warp: the warp-specialized backward's kPlain kernels release a Q /
// dO stage once per consumer warp instead of once per thread (bwd_ws.cuh: WarpRelease).
inline bool bwd_warp_release() { return ablation_is("FLASH_CUDA_SM90_BWD_RELEASE", "warp"); }
// FLASH_CUDA_SM90_BWD_SECTION=N: the warp-specialized backward's kPlain CTAs go longest first
// over sections of N (KV head, batch) pairs (bwd_ws.cuh: bwd_tile_section); 1 is the grid's own
// order, pair by pair (the default before OPTIMIZATION.md step 60).
inline int bwd_section_override() { return ablation_int("FLASH_CUDA_SM90_BWD_SECTION", 0); }
// FLASH_CUDA_SM90_BWD_STATS=lanes: the warp-specialized backward's kPlain kernels stage a query
// block's lse and delta by the producer's 32 lanes (load, convert to log2 units, store) instead
// of taking the pairs the delta preprocess wrote by one bulk copy (config.h: bwd_bulk_stats;
// bwd_ws.cuh: BulkStats). The launcher (bwd_ws.cuh), the workspace's plan (family.h) and the
// preprocess (core/bwd_preprocess.cuh, through BwdParams::bwd_stats) all follow this answer.
inline bool bwd_bulk_stats(const BwdParams& p) {
  return !ablation_is("FLASH_CUDA_SM90_BWD_STATS", "lanes") && wgmma::bwd_bulk_stats(p);
}
// FLASH_CUDA_SM90_BWD_STEP=64 | 80: the warp-specialized backward at d 97..128 steps over 64
// queries, or over 80 wherever that can run (config.h: can_bwd_steps80); unset: config.h's rule
// (bwd_steps80, from kBwdSteps80MinSq queries). The launcher (bwd_ws.cuh) and the dQ workspace's
// plan (family.h) both ask here, so a production build, which reads no switch, follows the rule.
inline bool bwd_steps80(const BwdParams& p) {
  const int force = ablation_int("FLASH_CUDA_SM90_BWD_STEP", 0);
  return force != 0 ? force == 80 && can_bwd_steps80(p) : wgmma::bwd_steps80(p);
}

}  // namespace ablation
}  // namespace wgmma
}  // namespace flash_cuda
