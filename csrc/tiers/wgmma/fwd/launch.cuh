// tiers/wgmma/fwd/launch.cuh — the warp-specialized forward's launches: tensor maps, shared
// memory, the persistent grid, and the run_* entry points of the instances.
//
// Scope of this version: fp16 / bf16, head dims 64, 128, 192 and 256 (64 keys per step above
// 128), causal, windows, Sq != Sk, GQA, and in the kExtended instances packed batches, softcap
// and ALiBi (at d = 256 with the serial schedule: run_fwd_sm90_ws); views whose base and
// strides TMA can address (16-byte multiples). The launcher returns false otherwise and
// the caller runs the mma.sync forward (tiers/mma). kernel='auto' uses every instance
// (family.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../../../arch/host.h"
#include "../../../arch/tma.h"
#include "../../../core/scheduler.cuh"
#include "../config.h"
#include "kernel.cuh"

namespace flash_cuda {

// The maps, shared memory and grid of either kernel, whose tiles hold kBlockM / group queries of
// `group` query heads each (group 1: one head per tile), and the launch; false, having launched
// nothing, where TMA cannot address a view.
template <typename Cfg, typename Kernel>
bool launch_ws_tiles(Kernel kernel, const FwdParams& p, cudaStream_t stream, int group) {
  sm90::ws::TmaMaps maps;  // a packed batch's maps span all its rows (arch/tma.h: MapRows)
  if (!make_qkv_tensor_maps(p, &maps.q, &maps.k, &maps.v, Cfg::kBlockM, Cfg::kBlockN, group)) return false;
  // O's map (one head per box) serves the unpacked tiles; without it the lanes copy the staged rows.
  maps.o_by_tma =
      group == 1 && Cfg::kStageO && wgmma::ws_tma_store() && make_o_tensor_map(p, &maps.o, /*box_rows=*/16) ? 1 : 0;
  set_smem_limit(kernel, Cfg::kSmemBytes, "fwd_sm90_ws");
  // One CTA per SM fits (shared memory and registers): a persistent grid of num_sms CTAs.
  const int64_t tiles = int64_t(ceil_div(p.sq, Cfg::kBlockM / group)) * (p.hq / group) * p.b;
  const int grid = persistent_grid(tiles, p.num_sms, wgmma::ws_persistent());
  if (grid == 0) return false;
  FwdParams params = p;
  params.tile_section = tile_section(p, group, Cfg::kBlockM / group);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params, maps);
  check_launch("fwd_sm90_ws");
  return true;
}

// Launches the warp-specialized forward and returns true, or returns false having launched
// nothing: not an sm_90 device or not built for sm_90a, a call of another variant, or a view
// TMA cannot address. The serial schedule is built for the configurations that have it alone
// (kSerialOnly) and, in an ablation build, beside the overlapped one of the 128-row tiles.
template <typename Cfg, int kVariant>
bool launch_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  constexpr bool kExt = kVariant != kPlain;
  constexpr bool kSerialRung = kAblations && !Cfg::kSerialOnly && Cfg::kPolyEvery == 0 && Cfg::kStages == 2 &&
                               Cfg::kConsumerWGs == 2;
  auto kernel = sm90::ws::fwd_sm90_ws_kernel<Cfg, Cfg::kSerialOnly ? sm90::ws::kSerial : sm90::ws::kOverlap, kExt>;
  if constexpr (kSerialRung) {
    if (wgmma::ws_serial()) kernel = sm90::ws::fwd_sm90_ws_kernel<Cfg, sm90::ws::kSerial, kExt>;
  }
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (variant_of(p, /*backward=*/false) != kVariant) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, /*group=*/1);
}

// The GQA-packed forward (kPlain only): false, having launched nothing, where G = hq / hkv is
// not a divisor > 1 of the tile's rows or the call is not a plain dense one.
template <typename Cfg>
bool launch_fwd_sm90_ws_gqa(const FwdParams& p, cudaStream_t stream) {
  auto kernel = sm90::ws::fwd_sm90_ws_gqa_kernel<Cfg>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (variant_of(p, /*backward=*/false) != kPlain || p.hkv <= 0 || p.hq % p.hkv != 0) return false;
  const int group = p.hq / p.hkv;
  if (group < 2 || Cfg::kBlockM % group != 0) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, group);
}

// The forward with attention dropout: false, having launched nothing, where its instances do not
// serve the call (config.h: fwd_dropout_applies; the mma.sync family serves those with dropout).
template <typename Cfg>
bool launch_fwd_sm90_ws_dropout(const FwdParams& p, cudaStream_t stream) {
  auto kernel = sm90::ws::fwd_sm90_ws_dropout_kernel<Cfg>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (!has_dropout(p) || !wgmma::fwd_dropout_applies(p)) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, /*group=*/1);
}

// The ablation rungs of the d 64 / 128 kPlain forward (family.h: the switches), each one
// configuration measured against the default in OPTIMIZATION.md: the poly-exp2 share, and at
// d = 64 192-key steps and a 4-stage ring. Declines (false) where no switch is set.
template <typename T, int kHeadDim, int kVariant>
bool launch_fwd_sm90_ws_rung(const FwdParams& p, cudaStream_t stream) {
  using sm90::ws::WsConfig;
  if constexpr (kAblations && (kHeadDim == 64 || kHeadDim == 128) && kVariant == kPlain) {
    constexpr int kBlockN = sm90::ws::ws_block_n(kHeadDim);
    switch (wgmma::ws_exp2_poly_every()) {
      case 4: return launch_fwd_sm90_ws<WsConfig<T, kHeadDim, kBlockN, 4>, kVariant>(p, stream);
      case 8: return launch_fwd_sm90_ws<WsConfig<T, kHeadDim, kBlockN, 8>, kVariant>(p, stream);
      default: break;
    }
    if constexpr (kHeadDim == 64) {
      if (wgmma::ws_block_n_override() == 192) return launch_fwd_sm90_ws<WsConfig<T, 64, 192>, kVariant>(p, stream);
      if (wgmma::ws_stages_override() == 4) return launch_fwd_sm90_ws<WsConfig<T, 64, 128, 0, 4>, kVariant>(p, stream);
      if (wgmma::ws_block_m_override() == 128 || wgmma::ws_serial()) {
        return launch_fwd_sm90_ws<WsConfig<T, 64>, kVariant>(p, stream);
      }
    }
  }
  return false;
}

template <int kDType, int kHeadDim, int kVariant>
bool run_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  using sm90::ws::WsConfig;
  if (launch_fwd_sm90_ws_rung<T, kHeadDim, kVariant>(p, stream)) return true;
  if constexpr (kHeadDim == 64 && kVariant == kPlain) {
    // d <= 32 (config.h: narrow_fwd_applies): these tiles with Q K^T 32 deep, TMA's zeros past d;
    // P V still 64 wide. The shapes of d = 64 and its threshold.
    if (p.d <= wgmma::kNarrowDepth) {
      if (p.sq >= 2048) return launch_fwd_sm90_ws<WsConfig<T, 64, 96, 0, 2, 3, wgmma::kNarrowDepth>, kVariant>(p, stream);
      return launch_fwd_sm90_ws<WsConfig<T, 64, 128, 0, 2, 2, wgmma::kNarrowDepth>, kVariant>(p, stream);
    }
  }
  if constexpr (kHeadDim == 64 && kVariant == kPlain) {
    // 192-row tiles: three consumer warpgroups, so three warps per scheduler interleave their
    // dependent softmax chains (d = 64 is latency-bound), with 96-key steps (at 160 registers a
    // consumer holds S of 96 keys beside P and O; 128 spill). Short queries lose with them
    // (fewer, partly empty tiles), hence the threshold (OPTIMIZATION.md, "192-row tiles").
    if (p.sq >= 2048 || wgmma::ws_block_m_override() == 192) {
      return launch_fwd_sm90_ws<WsConfig<T, 64, 96, 0, 2, 3>, kVariant>(p, stream);
    }
  }
  if constexpr (kHeadDim == 96) {
    // d 65..96: the 128-wide tiles, Q K^T 96 deep.
    return launch_fwd_sm90_ws<WsConfig<T, 128, sm90::ws::ws_block_n(128), 0, 2, 2, 96>, kVariant>(p, stream);
  } else if constexpr (kHeadDim == 256 && kVariant != kPlain) {
    // d = 256 with the extended state (softcap's C and 1 / C, ALiBi's slope, a sequence's
    // offsets): the overlapped schedule's second S tile beside O's 128 accumulator registers
    // and those words spill, so the serial schedule alone (WsConfig: kSerialOnly_).
    return launch_fwd_sm90_ws<WsConfig<T, 256, 64, 0, 2, 2, 256, true>, kVariant>(p, stream);
  } else {
    return launch_fwd_sm90_ws<WsConfig<T, kHeadDim>, kVariant>(p, stream);
  }
}

// The GQA-packed tiles at the default shape of each bucket: 128 x 128 tiles, two consumer
// warpgroups (d 65..96: the 128-wide tiles, Q K^T 96 deep).
template <int kDType, int kHeadDim>
bool run_fwd_sm90_ws_gqa(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "the buckets with packed instances");
  constexpr int kWidth = kHeadDim == 96 ? 128 : kHeadDim;
  return launch_fwd_sm90_ws_gqa<sm90::ws::WsConfig<T, kWidth, sm90::ws::ws_block_n(kWidth), 0, 2, 2, kHeadDim>>(
      p, stream);
}

// The dropout instances: 128-row tiles, two consumer warpgroups; at d 64 the default 128-key
// steps, on the 128-wide tiles (d 65..128; 65..96 with Q K^T 96 deep) 96-key steps: with 128 the
// draws' registers beside S, P and O spill 44-56 bytes, with 96 nothing.
template <int kDType, int kHeadDim>
bool run_fwd_sm90_ws_dropout(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "the buckets with dropout instances");
  constexpr int kWidth = kHeadDim == 96 ? 128 : kHeadDim;
  constexpr int kBlockN = kWidth == 128 ? 96 : sm90::ws::ws_block_n(kWidth);
  return launch_fwd_sm90_ws_dropout<sm90::ws::WsConfig<T, kWidth, kBlockN, 0, 2, 2, kHeadDim>>(p, stream);
}

}  // namespace flash_cuda
