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

#include "../arch/host.h"
#include "../arch/sm80.cuh"
#include "../arch/types.cuh"
#include "softmax.cuh"

namespace flash_cuda {

// kStats: also each row's (lse in log2 units, delta) pair into p.bwd_stats (include/params.h;
// the Hopper backward's kPlain kernels read them: tiers/wgmma/config.h, bwd_bulk_stats).
template <typename T, int kLanes, bool kStats = false>
__global__ void __launch_bounds__(256) bwd_preprocess_delta_kernel(BwdParams p) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
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

  float acc = 0.f;
  // d is a multiple of 8, so a 16-byte vector never straddles the row end for 16-bit
  // types; fp32 uses 4-element vectors, and d % 4 == 0 as well.
  for (int c = lane * kVec; valid && c < p.d; c += kLanes * kVec) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o_row + c);
    const uint4 dv = *reinterpret_cast<const uint4*>(do_row + c);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc += to_float(oe[e]) * to_float(de[e]);
  }
  acc = group_sum<kLanes>(acc);
  if (valid && lane == 0) {
    const float dl = p.dlse != nullptr ? p.dlse[stat] : 0.f;
    // A row that saw no key has lse = -inf and O = 0; its delta is irrelevant but finite.
    p.delta[stat] = acc - dl;
    if constexpr (kStats) {
      const int64_t pair = ((static_cast<int64_t>(bi) * p.hq + h) * p.stats_rows + i) * 2;
      *reinterpret_cast<float2*>(p.bwd_stats + pair) = make_float2(lse_to_log2(p.softmax_lse[stat]), acc - dl);
    }
  }
}

// Launches the delta kernel. Requires 16-byte aligned rows (the binding checks pointer
// and stride alignment, and copies inputs that are not aligned).
template <typename T>
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
  auto launch = [&](auto kernel, int lanes) {
    const int64_t rows_per_block = 256 / lanes;
    const int64_t blocks = (total_rows + rows_per_block - 1) / rows_per_block;
    kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  };
  if (p.bwd_stats != nullptr) {
    if (vectors <= 8) {
      launch(bwd_preprocess_delta_kernel<T, 8, true>, 8);
    } else if (vectors <= 16) {
      launch(bwd_preprocess_delta_kernel<T, 16, true>, 16);
    } else {
      launch(bwd_preprocess_delta_kernel<T, 32, true>, 32);
    }
    check_launch("bwd_preprocess_delta");
    return;
  }
  if (vectors <= 8) {
    launch(bwd_preprocess_delta_kernel<T, 8>, 8);
  } else if (vectors <= 16) {
    launch(bwd_preprocess_delta_kernel<T, 16>, 16);
  } else {
    launch(bwd_preprocess_delta_kernel<T, 32>, 32);
  }
  check_launch("bwd_preprocess_delta");
}

}  // namespace flash_cuda
