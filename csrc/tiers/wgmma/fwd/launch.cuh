// tiers/wgmma/fwd/launch.cuh — the warp-specialized forward's launches: tensor maps, shared
// memory, the persistent grid, and the run_* entry points of the instances.
//
// Scope of this version: fp16 / bf16, head dims 64, 128, 192 and 256 (64 keys per step above
// 128), causal, windows, Sq != Sk, GQA, and in the kExtended instances packed batches, softcap
// and ALiBi (at d = 256 with the serial schedule: tile_policy.h, FwdTile); views whose base and
// strides TMA can address (16-byte multiples). The launcher returns false otherwise and
// the caller runs the mma.sync forward (tiers/mma). kernel='auto' uses every instance
// (family.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../../../arch/host.h"
#include "../tma_maps.h"
#include "../../../core/scheduler.cuh"
#include "../../../include/ablation.h"
#include "../config.h"
#include "../tile_policy.h"
#include "kernel.cuh"

namespace flash_cuda {
namespace sm90 {
namespace ws {

// How a launch runs beyond its tiles. Production launches take the defaults; an ablation build's
// launcher (ablation.cuh) sets them from its switches.
struct WsLaunch {
  bool persistent = true;  // one CTA per SM looping over the tiles, else one CTA per tile
};

// The schedule an instance is built with: the overlapped one, except where the serial one alone
// fits (WsConfig: kSerialOnly).
template <typename Cfg>
constexpr int kDefaultSchedule = Cfg::kSerialOnly ? kSerial : kOverlap;

}  // namespace ws
}  // namespace sm90

// The maps, shared memory and grid of either kernel, whose tiles hold kBlockM / group queries of
// `group` query heads each (group 1: one head per tile), and the launch; false, having launched
// nothing, where TMA cannot address a view.
template <typename Cfg, typename Kernel>
bool launch_ws_tiles(Kernel kernel, const FwdParams& p, cudaStream_t stream, int group,
                     const sm90::ws::WsLaunch& opt) {
  sm90::ws::TmaMaps maps;  // a packed batch's maps span all its rows (tma_maps.h: MapRows)
  // V's boxes are its slabs' width (config.cuh: VSlabs; 32 columns at d = 96).
  if (!make_qkv_tensor_maps(p, &maps.q, &maps.k, &maps.v, Cfg::kBlockM, Cfg::kBlockN, group, Cfg::VSlabs::kCols)) {
    return false;
  }
  // O's map (one head per box) serves the unpacked tiles; without it the lanes copy the staged rows.
  maps.o_by_tma =
      group == 1 && Cfg::kStagedO && wgmma::ws_tma_store() && make_o_tensor_map(p, &maps.o, /*box_rows=*/16) ? 1 : 0;
  set_smem_limit(kernel, Cfg::kSmemBytes, "fwd_sm90_ws");
  // One CTA per SM fits (shared memory and registers): a persistent grid of num_sms CTAs.
  const int64_t tiles = int64_t(ceil_div(p.sq, Cfg::kBlockM / group)) * (p.hq / group) * p.b;
  const int grid = persistent_grid(tiles, p.num_sms, opt.persistent);
  if (grid == 0) return false;
  FwdParams params = p;
  params.tile_section = tile_section(p, group, Cfg::kBlockM / group);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params, maps);
  check_launch("fwd_sm90_ws");
  return true;
}

// Launches the warp-specialized forward and returns true, or returns false having launched
// nothing: not an sm_90 device or not built for sm_90a, a call of another variant, or a view
// TMA cannot address. kSchedule: the instance's (kDefaultSchedule), or in an ablation build the
// serial one beside it.
template <typename Cfg, int kVariant, int kSchedule = sm90::ws::kDefaultSchedule<Cfg>>
bool launch_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream, const sm90::ws::WsLaunch& opt = {}) {
  auto kernel = sm90::ws::fwd_sm90_ws_kernel<Cfg, kSchedule, /*kExt=*/kVariant != kPlain>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (variant_of(p, /*backward=*/false) != kVariant) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, /*group=*/1, opt);
}

// The GQA-packed forward (kPlain only): false, having launched nothing, where G = hq / hkv is
// not a divisor > 1 of the tile's rows or the call is not a plain dense one.
template <typename Cfg>
bool launch_fwd_sm90_ws_gqa(const FwdParams& p, cudaStream_t stream, const sm90::ws::WsLaunch& opt = {}) {
  auto kernel = sm90::ws::fwd_sm90_ws_gqa_kernel<Cfg>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (variant_of(p, /*backward=*/false) != kPlain || p.hkv <= 0 || p.hq % p.hkv != 0) return false;
  const int group = p.hq / p.hkv;
  if (group < 2 || Cfg::kBlockM % group != 0) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, group, opt);
}

// The forward with attention dropout: false, having launched nothing, where its instances do not
// serve the call (config.h: fwd_dropout_applies; the mma.sync family serves those with dropout).
template <typename Cfg>
bool launch_fwd_sm90_ws_dropout(const FwdParams& p, cudaStream_t stream, const sm90::ws::WsLaunch& opt = {}) {
  auto kernel = sm90::ws::fwd_sm90_ws_dropout_kernel<Cfg>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (!has_dropout(p) || !wgmma::fwd_dropout_applies(p)) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, /*group=*/1, opt);
}

// The tiles of a (head-dim bucket, variant) for a call (tile_policy.h), handed to `launch` as a
// WsConfig value: launch(WsConfig<...>{}). tall: the 192-row tiles of d = 64 / 96 (fwd_tall_tiles).
template <typename T, int kHeadDim, int kVariant, typename Launch>
bool with_fwd_tiles(const FwdParams& p, bool tall, Launch&& launch) {
  using sm90::ws::WsConfig;
  using Tile = wgmma::FwdTile<kHeadDim, /*kExtended=*/kVariant != kPlain>;
  if constexpr (kHeadDim == 64 && kVariant == kPlain) {
    constexpr int kTallN = wgmma::kFwdTallBlockN, kTallWGs = wgmma::kFwdTallConsumerWGs;
    // d <= 32 (config.h: narrow_fwd_applies): these tiles with Q K^T 32 deep, TMA's zeros past d;
    // P V still 64 wide. The shapes of d = 64 and its threshold.
    if (p.d <= wgmma::kNarrowDepth) {
      if (wgmma::fwd_tall_tiles(kHeadDim, p.sq, masks_keys(p))) {
        return launch(WsConfig<T, 64, wgmma::kFwdTallBlockNNarrow, 0, Tile::kStages, kTallWGs, wgmma::kNarrowDepth>{});
      }
      return launch(WsConfig<T, 64, Tile::kBlockN, 0, Tile::kStages, Tile::kConsumerWGs, wgmma::kNarrowDepth>{});
    }
    if (tall) return launch(WsConfig<T, 64, kTallN, 0, Tile::kStages, kTallWGs>{});
  }
  if constexpr (kHeadDim == 96 && kVariant == kPlain) {
    if (tall) {
      return launch(WsConfig<T, Tile::kWidth, wgmma::kFwdTallBlockN96, 0, Tile::kStages, wgmma::kFwdTallConsumerWGs,
                             Tile::kDepth>{});
    }
  }
  return launch(WsConfig<T, Tile::kWidth, Tile::kBlockN, 0, Tile::kStages, Tile::kConsumerWGs, Tile::kDepth,
                         Tile::kSerialOnly>{});
}

// In an ablation build, the entry points below hand the call to fwd/ablation.cuh (its rungs and
// launch options); a production build compiles none of it.
namespace sm90 {
namespace ws {
namespace ablation {
template <int kDType, int kHeadDim, int kVariant>
bool run_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream);
template <typename Cfg>
bool run_fwd_sm90_ws_gqa(const FwdParams& p, cudaStream_t stream);
template <typename Cfg>
bool run_fwd_sm90_ws_dropout(const FwdParams& p, cudaStream_t stream);
}  // namespace ablation
}  // namespace ws
}  // namespace sm90

template <int kDType, int kHeadDim, int kVariant>
bool run_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  if constexpr (kAblations) {
    return sm90::ws::ablation::run_fwd_sm90_ws<kDType, kHeadDim, kVariant>(p, stream);
  } else {
    using T = typename ElementOf<kDType>::type;
    const bool tall = wgmma::fwd_tall_tiles(kHeadDim, p.sq, masks_keys(p));
    return with_fwd_tiles<T, kHeadDim, kVariant>(
        p, tall, [&](auto cfg) { return launch_fwd_sm90_ws<decltype(cfg), kVariant>(p, stream); });
  }
}

// The GQA-packed tiles at the default shape of each bucket (d 65..96: the 128-wide Q and K tiles,
// Q K^T 96 deep, V and O 96 wide).
template <int kDType, int kHeadDim>
bool run_fwd_sm90_ws_gqa(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  using Tile = wgmma::FwdTile<kHeadDim>;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "the buckets with packed instances");
  using Cfg = sm90::ws::WsConfig<T, Tile::kWidth, Tile::kBlockN, 0, Tile::kStages, Tile::kConsumerWGs, Tile::kDepth>;
  if constexpr (kAblations) {
    return sm90::ws::ablation::run_fwd_sm90_ws_gqa<Cfg>(p, stream);
  } else {
    return launch_fwd_sm90_ws_gqa<Cfg>(p, stream);
  }
}

// The dropout instances: the default tiles but for their keys per step (tile_policy.h:
// fwd_dropout_block_n).
template <int kDType, int kHeadDim>
bool run_fwd_sm90_ws_dropout(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  using Tile = wgmma::FwdTile<kHeadDim>;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "the buckets with dropout instances");
  using Cfg = sm90::ws::WsConfig<T, Tile::kWidth, wgmma::fwd_dropout_block_n(Tile::kWidth), 0, Tile::kStages,
                                 Tile::kConsumerWGs, Tile::kDepth>;
  if constexpr (kAblations) {
    return sm90::ws::ablation::run_fwd_sm90_ws_dropout<Cfg>(p, stream);
  } else {
    return launch_fwd_sm90_ws_dropout<Cfg>(p, stream);
  }
}

// The FP8 forward (p.q_descale != nullptr; WsConfig's kFp8): e4m3 Q, K and V^T (fwd_fp8 in the
// binding lays V out first, core/fp8_v_layout.cuh), O in kOutDType; dense or packed batches, softcap
// the one modifier (the kExt kernel serves both), kBlockN-key steps (tile_policy.h: fwd_fp8_block_n), a
// persistent grid drawing tiles from the binding's counter (core/scheduler.cuh). False, having
// launched nothing, where it does not apply or TMA cannot address a view.
template <int kOutDType, int kHeadDim, int kBlockN, bool kExt>
bool launch_fwd_sm90_fp8(const FwdParams& p, cudaStream_t stream) {
  using Out = typename ElementOf<kOutDType>::type;
  using Cfg = sm90::ws::WsConfig<__nv_fp8_e4m3, kHeadDim, kBlockN, 0, 2, 2, kHeadDim, false, Out>;
  auto kernel = sm90::ws::fwd_sm90_ws_kernel<Cfg, sm90::ws::kDefaultSchedule<Cfg>, kExt>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel) || p.q_descale == nullptr || p.d != kHeadDim) return false;
  if (p.seqused_k != nullptr || p.alibi_slopes != nullptr || has_dropout(p)) return false;
  if ((variant_of(p, /*backward=*/false) == kExtended) != kExt) return false;
  sm90::ws::TmaMaps maps;
  if (!make_fp8_tensor_maps(p, &maps.q, &maps.k, &maps.v, Cfg::kBlockM, Cfg::kBlockN, Cfg::kQSlabCols, Cfg::kVWidth,
                            Cfg::VSlabs::kCols)) return false;
  maps.o_by_tma = Cfg::kStagedO && wgmma::ws_tma_store() && make_o_tensor_map(p, &maps.o, /*box_rows=*/16) ? 1 : 0;
  set_smem_limit(kernel, Cfg::kSmemBytes, "fwd_sm90_fp8");
  const int64_t tiles = int64_t(ceil_div(p.sq, Cfg::kBlockM)) * p.hq * p.b;
  const int grid = persistent_grid(tiles, p.num_sms, /*persistent=*/true);
  if (grid == 0) return false;
  FwdParams params = p;
  params.tile_section = tile_section(p, 1, Cfg::kBlockM);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params, maps);
  check_launch("fwd_sm90_fp8");
  return true;
}

namespace sm90 {
namespace ws {
namespace ablation {
template <int kOutDType, int kHeadDim>
bool run_fwd_sm90_fp8(const FwdParams& p, cudaStream_t stream);
}  // namespace ablation
}  // namespace ws
}  // namespace sm90

template <int kOutDType, int kHeadDim>
bool run_fwd_sm90_fp8(const FwdParams& p, cudaStream_t stream) {
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "the FP8 buckets");
  if constexpr (kAblations) {
    return sm90::ws::ablation::run_fwd_sm90_fp8<kOutDType, kHeadDim>(p, stream);
  } else {
    constexpr int kBlockN = wgmma::fwd_fp8_block_n(kHeadDim);
    return variant_of(p, /*backward=*/false) == kExtended ? launch_fwd_sm90_fp8<kOutDType, kHeadDim, kBlockN, true>(p, stream)
                                                         : launch_fwd_sm90_fp8<kOutDType, kHeadDim, kBlockN, false>(p, stream);
  }
}

}  // namespace flash_cuda

#if defined(FLASH_CUDA_ABLATIONS)
#include "ablation.cuh"
#endif
