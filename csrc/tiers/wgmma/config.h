// tiers/wgmma/config.h — what the Hopper family's kernels and its contract (family.h) share: which
// calls each kernel serves (head dims, GQA packing's rule, dropout), the backward's dQ workspace,
// and the O-store diagnostics switch. The tiles are tile_policy.h's, the ablation switches
// ablation.h's (none is read here).
#pragma once

#include <cstdint>
#include <cstdlib>

#include "../../include/params.h"
#include "tile_policy.h"

namespace flash_cuda {
namespace wgmma {

// FLASH_CUDA_WS_TMA_STORE=0 (every build: a diagnostics switch, not an ablation rung): the
// forward's consumer warps copy their staged O rows to global memory lane by lane (16-byte stores)
// instead of one TMA store per 64-column slab. compute-sanitizer's initcheck does not see TMA
// stores (tests/sanitize.py runs it so).
inline bool ws_tma_store() {
  static const bool tma = [] {
    const char* v = std::getenv("FLASH_CUDA_WS_TMA_STORE");
    return v == nullptr || std::atoi(v) != 0;
  }();
  return tma;
}

// GQA packing in the kPlain forward (run_fwd_sm90_ws_gqa): for Sq <= 64 (kPackGqaMaxSq). A tile
// of one head holds min(Sq, 128) of its 128 rows in its last query block, and the G heads of a
// group stream the same K/V: G * ceil(Sq / 128) tiles per group, where ceil(Sq * G / 128) packed
// tiles do the same work with full rows. That at least halves the tiles exactly when Sq <= 64;
// beyond, packing saves at most the partial last query blocks (G = 4 at Sq = 65..96: 3 tiles for
// 4), a share left to the unpacked kernel, whose O and lse stores stay whole rows of one head.
// Packing can run for hq / hkv = G > 1 dividing the default tile's 128 rows, d <= 128, a dense
// batch without softcap or ALiBi, the overlapped schedule and the default tile shape.
inline bool can_pack_gqa(const FwdParams& p) {
  constexpr int kRows = kFwdRowsPerConsumer * FwdTile<128>::kConsumerWGs;
  if (p.hkv <= 0 || p.hq % p.hkv != 0 || p.d > 128 || variant_of(p, /*backward=*/false) != kPlain) return false;
  const int g = p.hq / p.hkv;
  return g >= 2 && kRows % g == 0;
}
inline bool pack_gqa(const FwdParams& p) { return can_pack_gqa(p) && p.sq <= kPackGqaMaxSq; }

// ---- the backward's dQ workspace ----
// The width of the warp-specialized backward's tiles for a call: its head-dim bucket's, except
// that a call with dropout runs the 128-wide dropout instances at every d (bwd_ws.cuh:
// run_bwd_sm90_dropout), so its dQ workspace has their tiles (tile_policy.h: bwd_block_m rows),
// and that d 65..96 runs tiles 96 wide where kBwdD96Native says so (tile_policy.h: bwd_ws_width).
inline int bwd_tile_width(const BwdParams& p) {
  if (has_dropout(p) && p.d <= 128) return kBwdDropoutTileWidth;
  const int width = (p.d + 63) / 64 * 64;
  return p.d > 64 && p.d <= 96 ? bwd_ws_width(width, 96) : width;
}

// The 80-query steps of the warp-specialized backward (tile_policy.h: kBwdSteps80MinSq): where
// they can run (d 97..128 on the 128-wide tiles, kPlain, deterministic=False with every gradient,
// which is when the dQ workspace exists) and where they do by default.
inline bool can_bwd_steps80(const BwdParams& p) {
  return p.d > 96 && p.d <= 128 && !p.deterministic && variant_of(p, /*backward=*/true) == kPlain &&
         bwd_wants_all(p);
}
inline bool bwd_steps80(const BwdParams& p) { return can_bwd_steps80(p) && p.sq >= kBwdSteps80MinSq; }

// The warp-specialized backward's kPlain kernels take each query block's (lse in log2 units,
// delta) pairs from the workspace, where the delta preprocess wrote them (BwdParams::bwd_stats;
// bwd_ws.cuh: BulkStats), wherever those kernels run with a dQ workspace: d <= 128, kPlain,
// deterministic=False with every gradient.
inline bool bwd_bulk_stats(const BwdParams& p) {
  return p.d <= 128 && !p.deterministic && variant_of(p, /*backward=*/true) == kPlain && bwd_wants_all(p);
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
// kernel='auto' with deterministic=False, 129..256 (bwd_wide.cuh). d 65..96 and d <= 32 run wider
// tiles (tile_policy.h: kNarrowDepth, tile_width): d <= 32 for what was measured there, dense
// batches without score modifiers or dropout (kPlain) and, backward, the one-pass kernel
// (deterministic=False, every gradient wanted); the rest of d <= 32 stays on mma.sync.
inline bool fwd_head_dim(int d) { return d > kNarrowDepth && d <= 256; }
inline bool bwd_head_dim(int d) { return d > kNarrowDepth && d <= 128; }
inline bool narrow_fwd_applies(const FwdParams& p) {
  return p.d <= kNarrowDepth && variant_of(p, /*backward=*/false) == kPlain;
}
inline bool narrow_bwd_applies(const BwdParams& p) {
  return p.d <= kNarrowDepth && variant_of(p, /*backward=*/true) == kPlain && !p.deterministic &&
         bwd_wants_all(p);
}
inline bool wide_bwd_applies(const BwdParams& p, Tier tier) {
  return tier == Tier::kAuto && !p.deterministic && p.sm_arch == 90 && p.d > 128 && p.d <= 256;
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
  return p.cu_seqlens_q == nullptr && !has_score_mod(p) && bwd_head_dim(p.d) && !p.deterministic && bwd_wants_all(p);
}

}  // namespace wgmma
}  // namespace flash_cuda
