// tiers/wgmma/fwd/ablation.cuh — the warp-specialized forward's ablation launcher, compiled only in
// a build with FLASH_CUDA_ABLATIONS (launch.cuh includes it there and asks it first). Each rung is
// one configuration OPTIMIZATION.md measured against the default, chosen by its switch
// (tiers/wgmma/ablation.h): the poly-exp2 share (d 64 / 128), and at d = 64 192-key steps, a
// 4-stage ring, the tile height and the 192-row tiles' key step; at d = 96 P through shared memory; the serial schedule beside the overlapped one wherever both fit;
// one CTA per tile instead of the persistent grid; the FP8 forward's key step at d = 128. Where no
// switch is set it launches what a production build does (launch.cuh: with_fwd_tiles).
#pragma once

#include "../ablation.h"
#include "launch.cuh"

namespace flash_cuda {
namespace sm90 {
namespace ws {
namespace ablation {

namespace switches = wgmma::ablation;

inline WsLaunch launch_options() {
  WsLaunch opt;
  opt.persistent = switches::ws_persistent();
  return opt;
}

// launch_fwd_sm90_ws with FLASH_CUDA_WS_SCHEDULE=serial where the instance has room for both
// schedules: the 128-row tiles with two stages and MUFU's exponentials.
template <typename Cfg, int kVariant>
bool launch_rung(const FwdParams& p, cudaStream_t stream, const WsLaunch& opt) {
  constexpr bool kSerialRung = !Cfg::kSerialOnly && Cfg::kPolyEvery == 0 && Cfg::kStages == 2 &&
                               Cfg::kConsumerWGs == 2;
  if constexpr (kSerialRung) {
    if (switches::ws_serial()) return launch_fwd_sm90_ws<Cfg, kVariant, kSerial>(p, stream, opt);
  }
  return launch_fwd_sm90_ws<Cfg, kVariant>(p, stream, opt);
}

template <int kDType, int kHeadDim, int kVariant>
bool run_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  const WsLaunch opt = launch_options();
  // The rungs with tiles of their own: the d 64 / 128 kPlain forward.
  if constexpr ((kHeadDim == 64 || kHeadDim == 128) && kVariant == kPlain) {
    constexpr int kBlockN = wgmma::fwd_block_n(kHeadDim);
    switch (switches::ws_exp2_poly_every()) {
      case 4: return launch_rung<WsConfig<T, kHeadDim, kBlockN, 4>, kVariant>(p, stream, opt);
      case 8: return launch_rung<WsConfig<T, kHeadDim, kBlockN, 8>, kVariant>(p, stream, opt);
      default: break;
    }
    if constexpr (kHeadDim == 64) {
      if (switches::ws_block_n_override() == 192) return launch_rung<WsConfig<T, 64, 192>, kVariant>(p, stream, opt);
      if (switches::ws_stages_override() == 4) {
        return launch_rung<WsConfig<T, 64, 128, 0, 4>, kVariant>(p, stream, opt);
      }
      if (switches::ws_block_m_override() == 128 || switches::ws_serial()) {
        return launch_rung<WsConfig<T, 64>, kVariant>(p, stream, opt);
      }
    }
  }
  // The production tiles, FLASH_CUDA_WS_BLOCK_M=192 taking the 192-row tiles (d 64 / 96) below
  // their threshold too, =128 keeping d = 96 on its 128-row ones above it.
  const int block_m = switches::ws_block_m_override();
  const bool tall = block_m == 192 || (block_m != 128 && wgmma::fwd_tall_tiles(kHeadDim, p.sq, masks_keys(p)));
  // FLASH_CUDA_WS_TALL_BLOCK_N=96: d 64's 192-row tiles in 96-key steps (d > 32), as before step 58.
  if constexpr (kHeadDim == 64 && kVariant == kPlain) {
    if (tall && p.d > wgmma::kNarrowDepth && switches::ws_tall_block_n_override() == 96) {
      return launch_rung<WsConfig<T, 64, 96, 0, wgmma::FwdTile<64>::kStages, wgmma::kFwdTallConsumerWGs>, kVariant>(
          p, stream, opt);
    }
  }
  return with_fwd_tiles<T, kHeadDim, kVariant>(
      p, tall, [&](auto cfg) { return launch_rung<decltype(cfg), kVariant>(p, stream, opt); });
}

// The GQA-packed and dropout instances: their production tiles, with the switches' grid.
template <typename Cfg>
bool run_fwd_sm90_ws_gqa(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd_sm90_ws_gqa<Cfg>(p, stream, launch_options());
}
template <typename Cfg>
bool run_fwd_sm90_ws_dropout(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd_sm90_ws_dropout<Cfg>(p, stream, launch_options());
}

// The FP8 forward with FLASH_CUDA_SM90_FP8_BLOCK_N=128 | 224 at d = 128: the key step before
// OPTIMIZATION.md step 61, or FlashAttention-3's FP8 step (V^T in 32-key slabs, the consumers at
// 240 registers); else the production step (tile_policy.h: fwd_fp8_block_n).
template <int kOutDType, int kHeadDim>
bool run_fwd_sm90_fp8(const FwdParams& p, cudaStream_t stream) {
  if (variant_of(p, /*backward=*/false) == kExtended) {
    return launch_fwd_sm90_fp8<kOutDType, kHeadDim, wgmma::fwd_fp8_block_n(kHeadDim), true>(p, stream);
  }
  if constexpr (kHeadDim == 128) {
    switch (switches::fp8_block_n_override()) {
      case 128: return launch_fwd_sm90_fp8<kOutDType, 128, 128, false>(p, stream);
      case 224: return launch_fwd_sm90_fp8<kOutDType, 128, 224, false>(p, stream);
      default: break;
    }
  }
  return launch_fwd_sm90_fp8<kOutDType, kHeadDim, wgmma::fwd_fp8_block_n(kHeadDim), false>(p, stream);
}

}  // namespace ablation
}  // namespace ws
}  // namespace sm90
}  // namespace flash_cuda
