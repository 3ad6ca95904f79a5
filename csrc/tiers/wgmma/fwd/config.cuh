// tiers/wgmma/fwd/config.cuh — the warp-specialized forward's instance configuration: tile shapes,
// pipeline depth, register budgets and shared-memory size (WsConfig; the layout is smem.h's), the
// schedules, and the tensor maps a launch hands its kernel.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "../../../arch/gpu_class.h"
#include "../../../arch/sm90.cuh"
#include "../../../arch/tile.cuh"
#include "../../../core/softmax.cuh"
#include "../tile_policy.h"
#include "smem.h"

namespace flash_cuda {
namespace sm90 {
namespace ws {

// The tensor maps of one call (a kernel parameter, read by the TMA unit; CUtensorMap carries
// its own alignment). o_by_tma: O leaves the staging tile through TMA stores on map o (16-row
// boxes: one consumer warp's rows); 0 where O is not staged, where its view is one TMA cannot
// address (and with FLASH_CUDA_WS_TMA_STORE=0, config.h: ws_tma_store): the warps' lanes copy it
// (normalize_output).
struct TmaMaps {
  CUtensorMap q, k, v, o;
  int o_by_tma;
};

// Named barriers (0 is __syncthreads): warpgroup w's turn to issue its products (kOverlap) is
// kTurnBarrier + w; each phase counts two warpgroups (the one handing over, the one taking).
constexpr int kTurnBarrier = 1;
constexpr int kTurnThreads = 256;

enum WsSchedule : int { kSerial = 0, kOverlap = 1 };

// The tiles and the pipeline's sizes (tile_policy.h chooses them per head dim and call).
// kHeadDim_: the tiles' width. kBlockN_: keys per step.
// kPolyEvery_: the share of exponentials taken on the FMA pipe (core/softmax.cuh:
// exponentiate_scores; an ablation rung).
// kStages_: K/V stages of the ring.
// kConsumerWGs_: consumer warpgroups, 64 query rows each.
// kDepth_: the head dims the instance serves (<= kHeadDim_): S = Q K^T stops after its k-steps,
// the tiles keep the bucket's width with TMA's zeros past d (d = 96: 6 of the 128-wide tile's 8).
// V, P V and O are kVWidth wide (tile_policy.h: fwd_value_width): kHeadDim_, or 96 at d = 96.
// kSerialOnly_: the instance has the serial schedule alone (launch_fwd_sm90_ws), whose consumers
// hold one S tile, not two: at d = 256 they fit in 232 registers and the producer gets 40.
// Out_: O's type, T_'s but for e4m3 inputs (T_ = __nv_fp8_e4m3, the FP8 forward, kFp8): there
// Q and K are 128-column slabs of bytes (one 64-column slab at d = 64), V comes as V^T (core/fp8_v_layout.cuh: head dims as
// rows, each row 128 keys of a step in the order of P's A fragments), the products take 32-deep
// k-steps of e4m3 (arch/sm90_wgmma.cuh), P is rounded to e4m3 relative to the running max lowered
// by kFp8POffset (flash_cuda/reference.py: attention_fp8_forward_blocked) with an exact running
// max, and O leaves as Out_ scaled by V's descale.
template <typename T_, int kHeadDim_, int kBlockN_ = wgmma::fwd_block_n(kHeadDim_), int kPolyEvery_ = 0,
          int kStages_ = wgmma::FwdTile<kHeadDim_>::kStages,
          int kConsumerWGs_ = wgmma::FwdTile<kHeadDim_>::kConsumerWGs, int kDepth_ = kHeadDim_,
          bool kSerialOnly_ = false, typename Out_ = T_>
struct WsConfig {
  using T = T_;
  using Out = Out_;
  static constexpr bool kFp8 = sizeof(T_) == 1;
  static_assert(kFp8 || std::is_same<Out_, T_>::value, "16-bit inputs give O in their type");
  static_assert(!kFp8 || ((kHeadDim_ == 64 || kHeadDim_ % 128 == 0) && kBlockN_ % 32 == 0 && kDepth_ == kHeadDim_ &&
                           kPolyEvery_ == 0),
                "e4m3 tiles: 128-byte lines of Q and K (64 at d = 64), 128-, 64- or 32-byte lines of V^T, the whole depth");
  // Q's and K's slab width in elements: 128 bytes, or the whole row where it is shorter (e4m3 at
  // d = 64: one slab of 64-byte lines, the 64-byte swizzle).
  static constexpr int kQSlabCols = std::min(kSlabCols * 2 / int(sizeof(T_)), kHeadDim_);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = wgmma::kFwdRowsPerConsumer * kConsumerWGs_;
  static constexpr int kVWidth = wgmma::fwd_value_width(kHeadDim_, kDepth_);
  static constexpr int kNTiles = kBlockN / 8;         // C-fragment tiles of S (core/fragment.cuh)
  static constexpr int kDTiles = kVWidth / 8;         // of O
  static constexpr size_t kTileQ = size_t(kBlockM) * kHeadDim * sizeof(T);
  static_assert(kHeadDim % 64 == 0, "swizzled slabs are 128 bytes wide");
  static_assert(kVWidth <= kHeadDim && kVWidth >= kDepth_ && kVWidth % 32 == 0, "V holds the head dims");
  // A K / V stage (arch/sm90.cuh: Slabs): K in Q's 64-column slabs; V in the same, or where it is
  // narrower than the tiles (d = 96) in 32-column slabs with the 64-byte swizzle, whose three make
  // exactly 96 columns.
  // e4m3: V^T, kVWidth rows (head dims) of the step's keys, in 128-key slabs (the 128-byte
  // swizzle), or in 64- or 32-key ones (the 64- / 32-byte swizzle) where the step is no multiple
  // of 128 (of 64) keys.
  using KSlabs = Slabs<kBlockN_, kQSlabCols, kHeadDim_ / kQSlabCols, int(sizeof(T_))>;
  static constexpr int kVtSlabKeys = kBlockN_ % 128 == 0 ? 128 : (kBlockN_ % 64 == 0 ? 64 : 32);
  using VSlabs = std::conditional_t<
      kFp8, Slabs<kVWidth, kVtSlabKeys, kBlockN_ / kVtSlabKeys, 1>,
      std::conditional_t<kVWidth == kHeadDim_, KSlabs, Slabs<kBlockN_, kSlabCols / 2, kVWidth / (kSlabCols / 2)>>>;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N");
  // k-steps of S = Q K^T (16 elements, 32 of e4m3) and of O += P V (P's A fragments).
  static constexpr int kKStep = kFp8 ? 32 : 16;
  static constexpr int kQKSteps = (kDepth_ + kKStep - 1) / kKStep;
  static constexpr int kPSteps = kBlockN_ / kKStep;
  // The running max (core/softmax.cuh: update_row_stats): lagging by up to kMaxLag for 16-bit P
  // (2^8 is far inside fp16's range), exact for e4m3, whose P already reaches 2^kFp8POffset.
  static constexpr int kLag = kFp8 ? 0 : kMaxLag;
  static_assert(kDepth_ <= kHeadDim_, "the tiles hold the instance's head dims");
  static constexpr int kPolyEvery = kPolyEvery_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr bool kSerialOnly = kSerialOnly_;
  // The overlapped schedule's turn barriers between the consumer warpgroups (tile_policy.h).
  static constexpr bool kTurnBarriers = wgmma::fwd_turn_barriers(kHeadDim_);
  static constexpr int kConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kSlabs = kHeadDim_ / kQSlabCols;  // of Q and K
  static constexpr int kOSlabs = kHeadDim_ / kSlabCols;   // of the O staging tile (16-bit O)
  // Registers per thread after setmaxnreg (see the static_assert below for the total). One
  // producer warp walks the tile loop (the rest of its warpgroup exits); a dense batch's loop
  // fits in 24 with little to spare (one more live value spilled it), a packed one's (its
  // sequence's offsets, lengths and mask per tile) in 40, which up to d = 192 it keeps. At
  // d = 256 the overlapped consumers need 240 for the 64 x 256 O accumulator beside two S tiles
  // (232 spills), which leaves the producer 24, enough for a dense batch only; the serial-only
  // instances (the extended ones, packed batches among them) keep 232 / 40. So do the FP8
  // forward's 224-key steps at d = 128 (an ablation rung; 232 spills beside O, S and P). Three
  // consumer warpgroups (d = 64): 24 / 160.
  static constexpr bool kWideOverlap = (kHeadDim_ > 192 || (kFp8 && kBlockN_ > 192)) && !kSerialOnly_;
  static constexpr int kProducerRegs = kConsumerWGs == 3 ? 24 : (kWideOverlap ? 24 : 40);
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : (kWideOverlap ? 240 : 232);
  // The consumers re-derive per tile what their tile loop would otherwise keep live across it
  // (the shared-memory pointers, their warp, the scheduler's sizes, and after the key loop the
  // tile's coordinates and the epilogue's addresses): at d = 256 with 80-key steps those words
  // beside O, two S tiles and P spilled, and so did three consumer warpgroups' 160 registers with
  // 128-key steps (d = 64's tall tiles). Elsewhere the loop keeps them.
  static constexpr bool kLeanTileLoop = (kWideOverlap && kBlockN_ > 64) || (kConsumerWGs_ == 3 && kBlockN_ == 128);
  static_assert(kConsumerWGs == 2 || (kConsumerWGs == 3 && (kHeadDim_ == 64 || kVWidth == 96)), "measured shapes");
  // setmaxnreg moves registers within what the CTA was launched with: kThreads x the per-thread
  // count that __launch_bounds__(kThreads, 1) allows (65536 / kThreads, a multiple of 8).
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * (65536 / kThreads / 8 * 8),
                "the registers the CTA is launched with");
  // Shared-memory pointers that the compiler knows as such (aligned_smem_base), except where
  // that form spills (three consumer warpgroups, d = 256: 8 bytes).
  static constexpr bool kSharedBase = kConsumerWGs == 2 && kHeadDim_ <= 192;
  // Shared memory (smem.h), with the O staging tile where it fits. kSmemBytes: the storage and
  // the 1024 bytes by which aligned_smem_base may move the dynamic base to the swizzle's period.
  template <bool kWithO>
  using Storage = FwdSharedStorage<T_, kBlockM, kBlockN_, kHeadDim_, kVWidth, kStages_, kWithO, false, Out_>;
  static constexpr bool kStageO = Storage<true>::kBytes + kSwizzleAlign <= kSmemHopper;
  // Else, where V is as wide as Q, O is staged in Q's tile (tile_policy.h: kFwdStageOInQ); Q is
  // then released after the epilogue's stores have read it, not after the last S.
  static constexpr bool kStageOInQ = !kStageO && wgmma::kFwdStageOInQ && kVWidth == kHeadDim_ && !kFp8;
  static constexpr bool kStagedO = kStageO || kStageOInQ;
  using SharedStorage =
      FwdSharedStorage<T_, kBlockM, kBlockN_, kHeadDim_, kVWidth, kStages_, kStageO, kStageOInQ, Out_>;
  static constexpr size_t kSmemBytes = SharedStorage::kBytes + kSwizzleAlign;
  static_assert(kTileQ % 1024 == 0 && KSlabs::kBytes % 1024 == 0 && VSlabs::kBytes % 1024 == 0,
                "TMA's boxes fill whole slabs");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "a TMA box has at most 256 rows");
  static_assert(kSmemBytes <= kSmemHopper, "fits a Hopper block");
};

}  // namespace ws
}  // namespace sm90
}  // namespace flash_cuda
