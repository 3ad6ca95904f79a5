// bwd_preprocess.cuh — the first backward step of every tier (FlashAttention-2):
//   delta_i = sum_d dO[i, d] * O[i, d]  -  dlse_i
// delta is the row-wise correction of dS = P * (dP - delta). Computing it once here means
// neither the dK/dV kernel nor the dQ kernel has to read O.
//
// kLanes lanes per query row (8, 16 or 32: the fewest that cover a row of d elements in one
// 16-byte vector each, so that no lane idles at d = 64 and 128), 32 / kLanes rows per warp: each
// lane reads 16-byte vectors of dO and O (coalesced along the row), accumulates in fp32 and the
// row's lanes reduce with shuffles. The rows are walked as [b][hq][sq] of the row-statistics
// layout (include/params.h); a packed (varlen) batch is one long sequence of total_q rows here
// (launch_bwd_preprocess), as delta needs no boundaries.
#pragma once

#include <type_traits>

#include "../arch/host.h"
#include "../arch/sm80.cuh"
#include "../arch/types.cuh"
#include "../include/ablation.h"
#include "softmax.cuh"

namespace flash_cuda {

// kStats: also each row's (lse in log2 units, delta) pair into p.bwd_stats (include/params.h;
// the Hopper backward's kPlain kernels read them: tiers/wgmma/config.h, bwd_bulk_stats):
// kStatsPairs as (lse_i, delta_i); kStatsQuads (an ablation rung: tiers/wgmma/ablation.h,
// bwd_quad_stats) per two rows as (lse_i, lse_i+1, delta_i, delta_i+1).
enum : int { kStatsNone = 0, kStatsPairs = 1, kStatsQuads = 2 };
// Writes row i's (lse in log2 units, delta), rows counted from row0 (its (batch entry, head)'s
// first row in the stats, [b][hq][stats_rows]).
template <int kStats>
__device__ __forceinline__ void store_bwd_stats(float* bwd_stats, int64_t row0, int i, float lse_log2, float delta) {
  if constexpr (kStats == kStatsQuads) {
    float* quad = bwd_stats + (row0 + (i & ~1)) * 2 + (i & 1);
    quad[0] = lse_log2;
    quad[2] = delta;
  } else {
    *reinterpret_cast<float2*>(bwd_stats + (row0 + i) * 2) = make_float2(lse_log2, delta);
  }
}

// sum_d dO[d] * O[d] of a row, by its kLanes lanes (each 16-byte vectors, coalesced along the
// row), reduced over them with shuffles; a lane of a row that is not valid reads nothing but
// takes part in the shuffles (every lane of the warp must).
template <typename T, int kLanes>
__device__ __forceinline__ float row_dot(const T* o_row, const T* do_row, int d, int lane, bool valid) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  float acc = 0.f;
  // d is a multiple of 8, so a 16-byte vector never straddles the row end for 16-bit
  // types; fp32 uses 4-element vectors, and d % 4 == 0 as well.
  for (int c = lane * kVec; valid && c < d; c += kLanes * kVec) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o_row + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(do_row + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc += to_float(oe[e]) * to_float(de[e]);
  }
  return group_sum<kLanes>(acc);
}

template <typename T, int kLanes, int kStats = kStatsNone, bool kTrigger = false>
__global__ void __launch_bounds__(256) bwd_preprocess_delta_kernel(BwdParams p) {
  if constexpr (kTrigger) launch_dependent_grids();  // launch_bwd_preprocess's kTrigger
  constexpr int kRowsPerBlock = 256 / kLanes;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kLanes;
  const int lane = threadIdx.x % kLanes;
  const int64_t total_rows = static_cast<int64_t>(p.b) * p.hq * p.sq;
  // Rows past the end still take part in the shuffles (every lane of the warp must), reading
  // nothing.
  const bool valid = row < total_rows;
  const int64_t r = valid ? row : 0;

  const int i = static_cast<int>(r % p.sq);
  const int64_t bh = r / p.sq;
  const int h = static_cast<int>(bh % p.hq);
  const int bi = static_cast<int>(bh / p.hq);
  const int64_t stat = bi * p.stat_batch_stride + h * p.stat_head_stride + i;

  const T* o_row = static_cast<const T*>(p.o) + bi * p.o_batch_stride + h * p.o_head_stride +
                   i * p.o_row_stride;
  const T* do_row = static_cast<const T*>(p.dout) + bi * p.do_batch_stride + h * p.do_head_stride +
                    i * p.do_row_stride;

  const float acc = row_dot<T, kLanes>(o_row, do_row, p.d, lane, valid);
  if (valid && lane == 0) {
    const float dl = p.dlse != nullptr ? p.dlse[stat] : 0.f;
    // A row that saw no key has lse = -inf and O = 0; its delta is irrelevant but finite.
    p.delta[stat] = acc - dl;
    if constexpr (kStats != kStatsNone) {
      store_bwd_stats<kStats>(p.bwd_stats, (static_cast<int64_t>(bi) * p.hq + h) * p.stats_rows, i,
                              lse_to_log2(p.softmax_lse[stat]), acc - dl);
    }
  }
}

// The ablation rung FLASH_CUDA_BWD_PREPROCESS=grid (an ablation build reads it): the same sums
// on a grid of (row blocks of a sequence, hq, b), so that a thread's row, head and batch entry
// come from its block's coordinates with no division (the kernel above divides its flat row
// index by sq and hq in 64 bits: a visible share of a kernel of a few dozen instructions per
// 16-byte vector), and the row's lse and dlse read before its vectors, so that their latency
// runs under them.
template <typename T, int kLanes, int kStats, bool kTrigger>
__global__ void __launch_bounds__(256) bwd_preprocess_delta_grid_kernel(BwdParams p) {
  if constexpr (kTrigger) launch_dependent_grids();
  constexpr int kRowsPerBlock = 256 / kLanes;
  const int i = blockIdx.x * kRowsPerBlock + threadIdx.x / kLanes;
  const int h = blockIdx.y;
  const int lane = threadIdx.x % kLanes;
  const int bi = blockIdx.z;  // b and hq are below 65536 (the binding checks)
  // Rows past the end still take part in the shuffles (every lane of the warp must), reading
  // nothing.
  const bool valid = i < p.sq;
  const int64_t stat = bi * p.stat_batch_stride + h * p.stat_head_stride + i;
  // The row's statistics are read before its vectors, so that their latency runs under them.
  const bool first_lane = valid && lane == 0;
  const float dl = first_lane && p.dlse != nullptr ? p.dlse[stat] : 0.f;
  const float lse = kStats != kStatsNone && first_lane ? p.softmax_lse[stat] : 0.f;

  const T* o_row = static_cast<const T*>(p.o) + bi * p.o_batch_stride + h * p.o_head_stride +
                   static_cast<int64_t>(i) * p.o_row_stride;
  const T* do_row = static_cast<const T*>(p.dout) + bi * p.do_batch_stride + h * p.do_head_stride +
                    static_cast<int64_t>(i) * p.do_row_stride;

  const float acc = row_dot<T, kLanes>(o_row, do_row, p.d, lane, valid);
  if (first_lane) {
    // A row that saw no key has lse = -inf and O = 0; its delta is irrelevant but finite.
    p.delta[stat] = acc - dl;
    if constexpr (kStats != kStatsNone) {
      store_bwd_stats<kStats>(p.bwd_stats, (static_cast<int64_t>(bi) * p.hq + h) * p.stats_rows, i,
                              lse_to_log2(lse), acc - dl);
    }
  }
}

// Launches the delta kernel. Requires 16-byte aligned rows (the binding checks pointer
// and stride alignment, and copies inputs that are not aligned). kTrigger: its CTAs let the next
// kernel launch at once (a programmatic dependent launch: arch/host.h, launch_programmatic),
// which waits for these results before it reads them. kStatsLayout: how the (lse, delta) entries
// go into p.bwd_stats where it is set (kStatsPairs, or kStatsQuads for the Hopper backward's
// QuadStats rung).
template <typename T, bool kTrigger = false, int kStatsLayout = kStatsPairs>
inline void launch_bwd_preprocess(const BwdParams& params, cudaStream_t stream) {
  BwdParams p = params;
  if (p.cu_seqlens_q != nullptr) {  // varlen: rows [h][0, total_q), batch stride 0
    p.b = 1;
    p.sq = p.total_q;
  }
  const int64_t total_rows = static_cast<int64_t>(p.b) * p.hq * p.sq;
  if (total_rows == 0) return;
  constexpr int kVec = 16 / sizeof(T);
  const int vectors = (p.d + kVec - 1) / kVec;  // per row
  // run(stats layout, lanes): the row's lanes are the fewest that cover d in one 16-byte vector each.
  auto dispatch = [&](auto&& run) {
    auto with_lanes = [&](auto stats) {
      if (vectors <= 8) {
        run(stats, std::integral_constant<int, 8>{});
      } else if (vectors <= 16) {
        run(stats, std::integral_constant<int, 16>{});
      } else {
        run(stats, std::integral_constant<int, 32>{});
      }
    };
    if (p.bwd_stats == nullptr) {
      with_lanes(std::integral_constant<int, kStatsNone>{});
    } else {
      with_lanes(std::integral_constant<int, kStatsLayout>{});
    }
  };
  // The grid rung's kernels exist only in an ablation build.
  if constexpr (kAblations) {
    if (ablation_is("FLASH_CUDA_BWD_PREPROCESS", "grid")) {
      dispatch([&](auto stats, auto lanes) {
        constexpr int kStats = decltype(stats)::value, kLanes = decltype(lanes)::value;
        constexpr int kRowsPerBlock = 256 / kLanes;
        bwd_preprocess_delta_grid_kernel<T, kLanes, kStats, kTrigger>
            <<<dim3((p.sq + kRowsPerBlock - 1) / kRowsPerBlock, p.hq, p.b), 256, 0, stream>>>(p);
      });
      check_launch("bwd_preprocess_delta");
      return;
    }
  }
  dispatch([&](auto stats, auto lanes) {
    constexpr int kStats = decltype(stats)::value, kLanes = decltype(lanes)::value;
    constexpr int64_t kRowsPerBlock = 256 / kLanes;
    const int64_t blocks = (total_rows + kRowsPerBlock - 1) / kRowsPerBlock;
    bwd_preprocess_delta_kernel<T, kLanes, kStats, kTrigger><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  });
  check_launch("bwd_preprocess_delta");
}

}  // namespace flash_cuda
