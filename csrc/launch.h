// launch.h — the host entry points of every kernel tier (no torch, no CUDA kernels here).
//
// The binding includes only this file and flash_params.h. Each entry point launches
// on `stream`, never allocates, and throws std::runtime_error naming the kernel when a
// launch fails. The templates are explicitly instantiated in csrc/instances/*.cu, one
// (dtype, head-dim bucket) per file so that ninja builds them in parallel.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>

#include "flash_params.h"

namespace flash_cuda {

// Head dims are served by buckets: a kernel built for kHeadDim handles every
// d <= kHeadDim (multiple of 8) by zero-filling the missing columns.
// SIMT (fp32) buckets: 32, 64, 128, 256.
// MMA (fp16/bf16) buckets: 32, 64, 96, 128, 192, 256.

// ---- fp32 SIMT tier ----
// plan_fwd_simt decides whether the forward splits key ranges (sets params.split_begin and
// num_splits) and returns how many floats of workspace that needs (0: none); the caller points
// params.o_accum at that many floats, then calls run_fwd_simt with the same params.
template <int kHeadDim> int64_t plan_fwd_simt(FwdParams& params);
template <int kHeadDim> void run_fwd_simt(const FwdParams& params, cudaStream_t stream);
// plan_bwd_simt does the same for the fp32 backward's dK/dV kernel (params.dkv_accum).
template <int kHeadDim> int64_t plan_bwd_simt(BwdParams& params);
template <int kHeadDim> void run_bwd_simt(const BwdParams& params, cudaStream_t stream);

// ---- fp16/bf16 tensor-core tier; kDType is static_cast<int>(DType), kVariant a Variant
//      (flash_params.h: kPlain, kExtended, and for the backward kSoftcapGrad) ----
template <int kDType, int kHeadDim, int kVariant> void run_fwd_mma(const FwdParams& params, cudaStream_t stream);
template <int kDType, int kHeadDim, int kVariant> void run_bwd_mma(const BwdParams& params, cudaStream_t stream);

// ---- fp16/bf16 Hopper tier (wgmma): the cp.async forward at buckets 64 / 128, the backward at 64 / 96 / 128 ----
// Launch and return true when the device is sm_90 and the kernel was built for sm_90a;
// return false (nothing launched) otherwise, so the caller can fall back to the MMA tier.
// kVariant: kPlain or kExtended, and for the backward kSoftcapGrad, which only its
// warp-specialized kernel serves (deterministic=False, FLASH_CUDA_SM90_BWD=ws): elsewhere
// run_bwd_sm90<.., kSoftcapGrad> returns false and the mma.sync tier serves it.
template <int kDType, int kHeadDim, int kVariant> bool run_fwd_sm90(const FwdParams& params, cudaStream_t stream);
template <int kDType, int kHeadDim, int kVariant> bool run_bwd_sm90(const BwdParams& params, cudaStream_t stream);
// The wide warp-specialized backward (sm90_bwd_ws_wide.cuh), head-dim buckets 192 / 256, kPlain,
// kExtended (packed batches, ALiBi) and kSoftcapGrad, deterministic=False; false (nothing
// launched) where it does not apply. Not with FLASH_CUDA_SM90_BWD_D256=0 (sm90_bwd_wide below).
template <int kDType, int kHeadDim, int kVariant> bool run_bwd_sm90_wide(const BwdParams& params, cudaStream_t stream);
// The warp-specialized forward (TMA + mbarrier ring, producer warp, two consumer warpgroups),
// head-dim buckets 64 / 96 / 128 / 192 / 256 for kPlain, 64 / 96 / 128 / 192 for kExtended
// (packed batches, softcap, ALiBi; 96: the 128-wide tiles); false (nothing launched) where it does
// not apply.
template <int kDType, int kHeadDim, int kVariant> bool run_fwd_sm90_ws(const FwdParams& params, cudaStream_t stream);
// Its GQA-packed tiles (a tile holds 128 / G queries of all G = hq / hkv query heads of a KV
// group), head-dim buckets 64 / 96 / 128, kPlain: false (nothing launched) where they do not
// apply (G not a divisor > 1 of 128, a packed batch or a score modifier). The binding tries it
// first where ws_pack_gqa (below) says packing pays, then run_fwd_sm90_ws.
template <int kDType, int kHeadDim> bool run_fwd_sm90_ws_gqa(const FwdParams& params, cudaStream_t stream);

// Its ablation switches, for the optimization record's ladder (read at every launch, a few
// tens of nanoseconds):
//   FLASH_CUDA_WS_SCHEDULE=overlap (default) | serial | off   the consumer schedule; "off":
//       kernel='auto' / 'wgmma' forwards run the cp.async Hopper forward instead
//   FLASH_CUDA_WS_PERSISTENT=1 (default) | 0                  one CTA per SM looping over tiles,
//       or one CTA per tile
inline std::string ws_schedule_name() {
  const char* v = std::getenv("FLASH_CUDA_WS_SCHEDULE");
  return v != nullptr ? std::string(v) : std::string("overlap");
}
inline bool ws_enabled() { return ws_schedule_name() != "off"; }
inline bool ws_persistent() {
  const char* v = std::getenv("FLASH_CUDA_WS_PERSISTENT");
  return !(v != nullptr && std::string(v) == "0");
}
// The shape switches below are integers, 0 when unset (the default shape).
inline int ws_env_int(const char* name, int unset = 0) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoi(v) : unset;
}
// FLASH_CUDA_WS_BLOCK_N=192: the d = 64 kPlain forward steps over 192 keys instead of 128.
inline int ws_block_n_override() { return ws_env_int("FLASH_CUDA_WS_BLOCK_N"); }
// FLASH_CUDA_WS_STAGES=4: the d = 64 kPlain forward with 4 K/V stages in its ring instead of 2.
inline int ws_stages_override() { return ws_env_int("FLASH_CUDA_WS_STAGES"); }
// FLASH_CUDA_WS_BLOCK_M=128 | 192: the d = 64 kPlain forward's tiles, 128 x 128 or 192 rows
// (three consumer warpgroups) x 96 keys; unset: 192 rows from Sq = 2048 on.
inline int ws_block_m_override() { return ws_env_int("FLASH_CUDA_WS_BLOCK_M"); }
// FLASH_CUDA_WS_TMA_STORE=0: the forward's consumer warps copy their staged O rows to global
// memory lane by lane (16-byte stores) instead of one TMA store per 64-column slab (the default, 1).
inline bool ws_tma_store() { return ws_env_int("FLASH_CUDA_WS_TMA_STORE", 1) != 0; }
// FLASH_CUDA_WS_EXP2_POLY=N (4 or 8): in the d 64 / 128 kPlain forward every N-th 8-key tile
// of P is exponentiated on the FMA pipe (poly_exp2) instead of MUFU.
inline int ws_exp2_poly_every() { return ws_env_int("FLASH_CUDA_WS_EXP2_POLY"); }
// FLASH_CUDA_WS_PACK_GQA=1 | 0: GQA packing in the kPlain forward (run_fwd_sm90_ws_gqa) wherever
// it can run, or never; unset: for Sq <= 64. A tile of one head holds min(Sq, 128) of its 128
// rows in its last query block, and the G heads of a group stream the same K/V: G * ceil(Sq / 128)
// tiles per group, where ceil(Sq * G / 128) packed tiles do the same work with full rows. That
// at least halves the tiles exactly when Sq <= 64; beyond, packing saves at most the partial
// last query blocks (G = 4 at Sq = 65..96: 3 tiles for 4), a share left to the kernel without
// packing, whose O and lse stores stay whole rows of one head. Packing can run for
// hq / hkv = G > 1 dividing 128, d <= 128, a dense batch without softcap or ALiBi, the
// overlapped schedule and the default tile shape (no ablation switch above set).
inline bool ws_pack_gqa(const FwdParams& p) {
  if (p.hkv <= 0 || p.hq % p.hkv != 0 || p.d > 128 || variant_of(p, /*backward=*/false) != kPlain) return false;
  const int g = p.hq / p.hkv;
  if (g < 2 || 128 % g != 0 || ws_schedule_name() == "serial") return false;
  if (ws_exp2_poly_every() != 0 || ws_block_n_override() != 0 || ws_stages_override() != 0 ||
      ws_block_m_override() != 0) {
    return false;
  }
  const int force = ws_env_int("FLASH_CUDA_WS_PACK_GQA", -1);
  return force >= 0 ? force != 0 : p.sq <= 64;
}
// The Hopper backward (deterministic=False; deterministic=True always runs the two-kernel path, or
// for softcap the mma.sync backward):
//   FLASH_CUDA_SM90_BWD=ws (default)  the warp-specialized kernel (sm90_bwd_ws.cuh): TMA producer,
//       5 products per block pair, dQ added into an fp32 workspace by a writer warp's bulk
//       reductions; dense and packed (varlen) batches
//   FLASH_CUDA_SM90_BWD=atomic        the cp.async dK/dV kernel adding dQ with atomics
//   FLASH_CUDA_SM90_BWD=split         the cp.async dK/dV kernel and a separate dQ kernel (7 products)
// (softcap's backward has only the first: with atomic or split it runs on the mma.sync tier)
inline std::string sm90_bwd_mode() {
  const char* v = std::getenv("FLASH_CUDA_SM90_BWD");
  return v != nullptr ? std::string(v) : std::string("ws");
}
inline bool sm90_bwd_ws() { return sm90_bwd_mode() == "ws"; }
inline bool sm90_dq_atomic() { return sm90_bwd_mode() == "atomic"; }
// FLASH_CUDA_SM90_BWD_DQ_RED=1: the warp-specialized backward adds dQ with red.global atomics from
// the consumers' registers instead of staging it for the writer warp's bulk reductions.
inline bool sm90_bwd_dq_red() { return ws_env_int("FLASH_CUDA_SM90_BWD_DQ_RED") != 0; }
// kernel='auto' backwards at d = 129..256 (dense or packed, deterministic=False) run the wide
// warp-specialized backward (sm90_bwd_ws_wide.cuh: 64 keys per CTA, the consumer warpgroups
// splitting dK, dV, dQ by head-dim columns and S^T, dP^T by queries). FLASH_CUDA_SM90_BWD_D256=0
// runs the mma.sync backward there instead; =2 the wide kernel with S^T and dP^T computed by both
// warpgroups (7 products per block pair, no exchange between them: consume_redundant), measured
// 3-7% slower than the default (OPTIMIZATION.md); packed batches, ALiBi and softcap run the
// query split there too.
inline bool sm90_bwd_wide() { return ws_env_int("FLASH_CUDA_SM90_BWD_D256", 1) != 0; }
inline bool sm90_bwd_wide_redundant() { return ws_env_int("FLASH_CUDA_SM90_BWD_D256", 1) == 2; }
// Query rows per step of the Hopper backward's dK/dV kernels at a head-dim bucket (sm90_bwd.cuh:
// BwdTraits::kKVBlockM, which sm90_bwd_ws.cuh static_asserts against this): the height of the
// warp-specialized backward's dQ tiles.
constexpr int sm90_bwd_block_m(int bucket_d) { return bucket_d <= 64 ? 128 : 64; }

// The tiles of the warp-specialized backward's dQ workspace (sm90_bwd_ws.cuh: DqTile, block_m x
// bucket-d floats each), one per (sequence, query head, query block of block_m rows):
//   dense:   tile (bi * hq + h) * ceil(sq / block_m) + m_block
//   packed:  tile h * tiles_per_head + q_start / block_m + bi + m_block,
//            tiles_per_head = total_q / block_m + b + 1   (integer divisions round down)
// Packed, with M = block_m: sequence bi (first row a = q_start, n rows) takes ceil(n / M) tiles
// from a / M + bi on, and a / M + ceil(n / M) <= (a + n) / M + 1 ends them at or before the next
// sequence's first tile, (a + n) / M + bi + 1. So the tiles are unique without a table of prefix
// sums, and, as a + n <= total_q also for cu_seqlens clamped into range (core/seqlen.cuh), every
// index stays below total_q / M + b: tiles_per_head bounds them (the + 1 is slack).
FLASH_HOST_DEVICE inline int64_t sm90_dq_tile_count(const FwdParams& p, int block_m) {
  if (p.cu_seqlens_q != nullptr) return static_cast<int64_t>(p.hq) * (p.total_q / block_m + p.b + 1);
  return static_cast<int64_t>(p.b) * p.hq * ((p.sq + block_m - 1) / block_m);
}
// kVarlen = false (a kPlain kernel): dense for sure, as in SeqInfo::make.
template <bool kVarlen = true>
FLASH_HOST_DEVICE inline int64_t sm90_dq_tile(const FwdParams& p, int bi, int h, int q_start, int m_block,
                                              int block_m) {
  if (kVarlen && p.cu_seqlens_q != nullptr) {
    return static_cast<int64_t>(h) * (p.total_q / block_m + p.b + 1) + q_start / block_m + bi + m_block;
  }
  return (static_cast<int64_t>(bi) * p.hq + h) * ((p.sq + block_m - 1) / block_m) + m_block;
}

// The floats of the Hopper backward's dQ workspace (params.dq_accum): the rows of the statistics
// (lse_rows) x d for the atomic layout, or the tiles above at the head-dim bucket's width for
// the bulk reductions (sm90_bwd_ws.cuh, DqTile), whichever is larger: a launcher that cannot run
// the tile layout (a view TMA cannot address) falls back to the row layout in the same workspace.
inline int64_t sm90_dq_accum_floats(const BwdParams& p, int64_t lse_rows) {
  const int bucket_d = (p.d + 63) / 64 * 64;
  const int block_m = sm90_bwd_block_m(bucket_d);
  const int64_t tiles = sm90_dq_tile_count(p, block_m) * block_m * bucket_d;
  const int64_t rows = lse_rows * p.d;
  return rows > tiles ? rows : tiles;
}

}  // namespace flash_cuda
