// tiers/wgmma/config.h — what the Hopper family's kernels and its contract (family.h) share:
// the ablation switches, GQA packing's rule, the backward's dQ workspace, the head dims served.
#pragma once

#include <cstdint>
#include <cstdlib>

#include "../../include/ablation.h"
#include "../../include/params.h"

namespace flash_cuda {
namespace wgmma {

// ---- ablation switches (include/ablation.h: read only in a build with FLASH_CUDA_ABLATIONS) ----
// FLASH_CUDA_WS_SCHEDULE=serial: the forward's serial schedule (each product waited for at once)
//     instead of the overlapped one (intra-warpgroup overlap and ping-pong).
inline bool ws_serial() { return ablation_is("FLASH_CUDA_WS_SCHEDULE", "serial"); }
// FLASH_CUDA_WS_PERSISTENT=0: one CTA per tile instead of one per SM looping over tiles.
inline bool ws_persistent() { return ablation_int("FLASH_CUDA_WS_PERSISTENT", 1) != 0; }
// FLASH_CUDA_WS_BLOCK_N=192: the d = 64 kPlain forward steps over 192 keys instead of 128.
inline int ws_block_n_override() { return ablation_int("FLASH_CUDA_WS_BLOCK_N", 0); }
// FLASH_CUDA_WS_STAGES=4: the d = 64 kPlain forward with 4 K/V stages in its ring instead of 2.
inline int ws_stages_override() { return ablation_int("FLASH_CUDA_WS_STAGES", 0); }
// FLASH_CUDA_WS_BLOCK_M=128 | 192: the d = 64 kPlain forward's tiles, 128 x 128 or 192 rows
// (three consumer warpgroups) x 96 keys; unset: 192 rows from Sq = 2048 on.
inline int ws_block_m_override() { return ablation_int("FLASH_CUDA_WS_BLOCK_M", 0); }
// FLASH_CUDA_WS_TMA_STORE=0 (every build: a diagnostics switch, not a rung): the forward's consumer
// warps copy their staged O rows to global memory lane by lane (16-byte stores) instead of one TMA
// store per 64-column slab. compute-sanitizer's initcheck does not see TMA stores
// (tests/sanitize.py runs it so).
inline bool ws_tma_store() {
  static const bool tma = [] {
    const char* v = std::getenv("FLASH_CUDA_WS_TMA_STORE");
    return v == nullptr || std::atoi(v) != 0;
  }();
  return tma;
}
// FLASH_CUDA_WS_EXP2_POLY=N (4 or 8): in the d 64 / 128 kPlain forward every N-th 8-key tile of
// P is exponentiated on the FMA pipe (poly_exp2) instead of MUFU.
inline int ws_exp2_poly_every() { return ablation_int("FLASH_CUDA_WS_EXP2_POLY", 0); }
// FLASH_CUDA_WS_PACK_GQA=1 | 0: GQA packing wherever it can run, or never (unset: pack_gqa).
inline int ws_pack_gqa_force() { return ablation_int("FLASH_CUDA_WS_PACK_GQA", -1); }
// FLASH_CUDA_SM90_BWD=split: the deterministic two-kernel backward also for deterministic=False.
inline bool bwd_split() { return ablation_is("FLASH_CUDA_SM90_BWD", "split"); }
// FLASH_CUDA_SM90_BWD_D256=0: head dims 129..256 run the mma.sync backward instead of the wide one.
inline bool bwd_wide_enabled() { return ablation_int("FLASH_CUDA_SM90_BWD_D256", 1) != 0; }

// GQA packing in the kPlain forward (run_fwd_sm90_ws_gqa): for Sq <= 64. A tile of one head
// holds min(Sq, 128) of its 128 rows in its last query block, and the G heads of a group stream
// the same K/V: G * ceil(Sq / 128) tiles per group, where ceil(Sq * G / 128) packed tiles do the
// same work with full rows. That at least halves the tiles exactly when Sq <= 64; beyond,
// packing saves at most the partial last query blocks (G = 4 at Sq = 65..96: 3 tiles for 4), a
// share left to the unpacked kernel, whose O and lse stores stay whole rows of one head. Packing
// can run for hq / hkv = G > 1 dividing 128, d <= 128, a dense batch without softcap or ALiBi,
// the overlapped schedule and the default tile shape.
inline bool pack_gqa(const FwdParams& p) {
  if (p.hkv <= 0 || p.hq % p.hkv != 0 || p.d > 128 || variant_of(p, /*backward=*/false) != kPlain) return false;
  const int g = p.hq / p.hkv;
  if (g < 2 || 128 % g != 0 || ws_serial()) return false;
  if (ws_exp2_poly_every() != 0 || ws_block_n_override() != 0 || ws_stages_override() != 0 ||
      ws_block_m_override() != 0) {
    return false;
  }
  const int force = ws_pack_gqa_force();
  return force >= 0 ? force != 0 : p.sq <= 64;
}

// ---- the backward's dQ workspace ----
// Query rows per step of the warp-specialized backward at a head-dim bucket (bwd_ws.cuh:
// WsBwdConfig::kBlockM static_asserts against this): the height of its dQ tiles.
constexpr int bwd_block_m(int bucket_d) { return bucket_d <= 64 ? 128 : 64; }

// The width of the warp-specialized backward's tiles for a call: its head-dim bucket's, except
// that a call with dropout runs the 128-wide dropout instances at every d (bwd_ws.cuh:
// run_bwd_sm90_dropout), so its dQ workspace has their tiles.
constexpr int kBwdDropoutTileWidth = 128;
inline int bwd_tile_width(const BwdParams& p) {
  return has_dropout(p) && p.d <= 128 ? kBwdDropoutTileWidth : (p.d + 63) / 64 * 64;
}

// The tiles of the warp-specialized backward's dQ workspace (bwd_ws.cuh: DqTile, block_m x
// bucket-d floats each), one per (sequence, query head, query block of block_m rows):
//   dense:   tile (bi * hq + h) * ceil(sq / block_m) + m_block
//   packed:  tile h * tiles_per_head + q_start / block_m + bi + m_block,
//            tiles_per_head = total_q / block_m + b + 1   (integer divisions round down)
// Packed, with M = block_m: sequence bi (first row a = q_start, n rows) takes ceil(n / M) tiles
// from a / M + bi on, and a / M + ceil(n / M) <= (a + n) / M + 1 ends them at or before the next
// sequence's first tile, (a + n) / M + bi + 1. So the tiles are unique without a table of prefix
// sums, and, as a + n <= total_q also for cu_seqlens clamped into range (core/seqlen.cuh), every
// index stays below total_q / M + b: tiles_per_head bounds them (the + 1 is slack).
FLASH_HOST_DEVICE inline int64_t dq_tile_count(const FwdParams& p, int block_m) {
  if (p.cu_seqlens_q != nullptr) return static_cast<int64_t>(p.hq) * (p.total_q / block_m + p.b + 1);
  return static_cast<int64_t>(p.b) * p.hq * ((p.sq + block_m - 1) / block_m);
}
// kVarlen = false (a kPlain kernel): dense for sure, as in SeqInfo::make.
template <bool kVarlen = true>
FLASH_HOST_DEVICE inline int64_t dq_tile(const FwdParams& p, int bi, int h, int q_start, int m_block, int block_m) {
  if (kVarlen && p.cu_seqlens_q != nullptr) {
    return static_cast<int64_t>(h) * (p.total_q / block_m + p.b + 1) + q_start / block_m + bi + m_block;
  }
  return (static_cast<int64_t>(bi) * p.hq + h) * ((p.sq + block_m - 1) / block_m) + m_block;
}

// Head dims: the forward serves 33..256; the backward 33..128 (bwd_ws.cuh, bwd.cuh) and, for
// kernel='auto' with deterministic=False, 129..256 (bwd_wide.cuh). d 65..96 runs the 128-wide
// tiles (TMA filling the columns past d with zeros), which at d = 96 still beats the mma.sync
// kernels of the 96 bucket by far (OPTIMIZATION.md). d <= 32 (kNarrowDepth) runs the 64-wide
// tiles the same way, the products over d 32 deep, for what was measured there: dense batches
// without score modifiers or dropout (kPlain) and, backward, the one-pass kernel
// (deterministic=False, every gradient wanted); the rest of d <= 32 stays on mma.sync.
constexpr int kNarrowDepth = 32;
inline bool fwd_head_dim(int d) { return d > kNarrowDepth && d <= 256; }
inline bool bwd_head_dim(int d) { return d > kNarrowDepth && d <= 128; }
inline bool narrow_fwd_applies(const FwdParams& p) {
  return p.d <= kNarrowDepth && variant_of(p, /*backward=*/false) == kPlain;
}
inline bool narrow_bwd_applies(const BwdParams& p) {
  return p.d <= kNarrowDepth && variant_of(p, /*backward=*/true) == kPlain && !p.deterministic && !bwd_split() &&
         bwd_wants_all(p);
}
inline bool wide_bwd_applies(const BwdParams& p, Tier tier) {
  return tier == Tier::kAuto && !p.deterministic && p.sm_arch == 90 && p.d > 128 && p.d <= 256 && bwd_wide_enabled();
}

// Dropout: the forward's dropout instances serve dense batches without softcap / ALiBi at head
// dims 33..128; the backward's (bwd_ws.cuh: run_bwd_sm90_dropout) the same calls with
// deterministic=False and every gradient wanted (the cp.async kernels, which the others take,
// have no dropout). Both on 128-wide tiles from d = 65, the backward's at every d (its dQ
// workspace: bwd_tile_width). The rest runs on mma.sync. The family's applies() and the
// launchers both ask these.
inline bool fwd_dropout_applies(const FwdParams& p) {
  return p.cu_seqlens_q == nullptr && !has_score_mod(p) && fwd_head_dim(p.d) && p.d <= 128;
}
inline bool bwd_dropout_applies(const BwdParams& p) {
  return p.cu_seqlens_q == nullptr && !has_score_mod(p) && bwd_head_dim(p.d) && !p.deterministic && !bwd_split() &&
         bwd_wants_all(p);
}

}  // namespace wgmma
}  // namespace flash_cuda
