// core/softmax.cuh — the online softmax of the tensor-core tiers (mma.sync and wgmma: the C
// fragment of core/fragment.cuh), its row statistics, and the backward's recomputation of P and
// dS from them.
//
// Forward, per block of keys (the four named steps every forward tier's main loop shows):
//   1. compute_qk_scores_and_max            S = Q K^T (the tier's product), then here:
//                                           modifiers and mask (core/mask.cuh), block_row_max
//   2. merge_block_stats                    m' = max(m, block max), l and O rescaled by 2^(m - m')
//   3. compute_block_softmax_and_weighted_v P = 2^(S - m') (exponentiate_block), l += rowsum P,
//                                           then O += P V (the tier's product)
//   4. normalize_output                     O / l and lse = (m + log2 l) ln 2 (core/epilogue.cuh)
// Scores stay in the log2 domain: without modifiers S is the raw q.k and scale * log2 e
// ("exp_scale", ScoreMod::exp_scale) is folded into the exponential's FFMA, so each element
// costs one FFMA and one MUFU.EX2; with modifiers S already holds modified log2 units and
// exp_scale is 1.
//
// Row statistics (RowStats): a thread's running max m and partial sum l of its rows, in the
// shape of the fragment's rows: [kM][2] for rows g and g + 8 of each 16-row tile. l is this
// thread's share (its columns); the four threads of a row (a quad) add theirs only at the end.
//
// Backward: P = 2^(S scale_log2 - lse log2 e) from the forward's lse (compute_probs), with the
// same modifiers and mask, and dS = P (dP - delta) (compute_ds), in either orientation: rows as
// queries (the dQ products) or as keys (the dK/dV products, which work on S^T).
#pragma once

#include <cmath>
#include <type_traits>

#include "../arch/sm80.cuh"
#include "exp2.cuh"
#include "fragment.cuh"
#include "mask.cuh"
#include "seqlen.cuh"

namespace flash_cuda {

template <int kM>
struct RowStats {
  float max[kM][2];  // m, log2 units of the scaled (modified) logits; -inf until a key is seen
  float sum[kM][2];  // l, this thread's part
};

#if defined(__CUDACC__)

// Softmax stabiliser that never produces NaN: a row whose running max is still -inf
// (every key masked so far) subtracts 0 instead, giving exp2(-inf) = 0.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// ---------------------------------------------------------------------------------
// Step 1's second half: the block's row maxima in the exp2 domain, after the tier's product
// and modify_and_mask (core/mask.cuh). Without modifiers S is the raw q.k, and exp_scale =
// scale_log2 is applied once per row here and once per element inside the exp2's FFMA (the
// scale is positive: the binding folds a negative scale into q, so max(scale * s) =
// scale * max(s)).
// ---------------------------------------------------------------------------------
template <int kM, int kN>
__device__ __forceinline__ void block_row_max(const float (&s)[kM][kN][4], float (&block_max)[kM][2],
                                              float exp_scale) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // A pairwise tree, not a running max: 4-5 dependent FMNMX instead of kN on the
      // softmax's critical path (max is exact in any order: same result).
      float m[kN];
#pragma unroll
      for (int nt = 0; nt < kN; ++nt) m[nt] = fmaxf(s[mt][nt][half * 2], s[mt][nt][half * 2 + 1]);
#pragma unroll
      for (int stride = 1; stride < kN; stride *= 2)
#pragma unroll
        for (int nt = 0; nt + stride < kN; nt += 2 * stride) m[nt] = fmaxf(m[nt], m[nt + stride]);
      const float mx = fmaxf(m[0], -INFINITY);  // a row of NaN scores: -inf, as the running max gave
      // Rounding is monotonic, so bm = round(max_j s_j * exp_scale) is also the largest
      // of the rounded per-element products round(s_j * exp_scale): the exact-max path of
      // step 3 relies on this.
      block_max[mt][half] = group_max<4>(mx) * exp_scale;  // the 4 lanes of a quad share a row
    }
  }
}

// ---------------------------------------------------------------------------------
// Step 2: fold the block maxima into the running statistics. The O accumulator and the
// running sum were computed against the old max, so both are rescaled by
// alpha = exp2(m_old - m_new). A row that has seen only masked keys keeps m = -inf and
// alpha = 0 (its accumulator is still zero).
// ---------------------------------------------------------------------------------
// The online softmax's starting state, per row: O = 0, m = -inf, l = 0.
template <int kM, int kD>
__device__ __forceinline__ void start_online_softmax(float (&acc_o)[kM][kD][4], RowStats<kM>& stats) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int dt = 0; dt < kD; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
    stats.max[mt][0] = stats.max[mt][1] = -INFINITY;
    stats.sum[mt][0] = stats.sum[mt][1] = 0.f;
  }
}

// Step 2 in two halves, so that a pipelined schedule (the warp-specialized Hopper forward) can
// fold the statistics while the previous block's P V is still on the tensor cores and rescale O
// once that product has landed. update_row_stats: m' = max(m, block max), l *= alpha, and alpha
// per row; returns whether any row of the warp moved (otherwise alpha is 1 everywhere).
// kLag > 0 (log2 units): a lagging reference max. A row keeps its m while the block's max
// exceeds it by at most kLag, so its P may reach 2^kLag instead of 1; O and l are then
// both summed against the same stale m and O / l and lse = m + log2(l) stay exact. Once the
// first block has set m, random-like scores almost never move it again, and O's rescale (a
// multiply per accumulator, on the turn's critical path in the warp-specialized forward)
// disappears from the later blocks. 2^8 keeps P far inside fp16's range (65504). Every
// 16-bit forward uses it (kMaxLag = 0: the exact running max).
constexpr int kMaxLag = 8;
// The FP8 forward's P = 2^(S - (m - kFp8POffset)), in [0, 2^8]: rounded to e4m3, a P in [0, 1]
// would flush every logit more than ~6.9 below the max to zero (flash_cuda/reference.py:
// FP8_P_OFFSET). Its running max is exact (kLag 0): a lag would take P past e4m3's 448.
constexpr float kFp8POffset = 8.f;
template <int kLag = kMaxLag, int kM>
__device__ __forceinline__ bool update_row_stats(RowStats<kM>& stats, const float (&block_max)[kM][2],
                                                 float (&alpha)[kM][2]) {
  bool grew = false;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // -inf + kLag = -inf: any finite block max replaces a row's first -inf.
      const bool moves = kLag > 0 ? block_max[mt][half] > stats.max[mt][half] + float(kLag)
                                  : block_max[mt][half] > stats.max[mt][half];
      const float m_new = moves ? block_max[mt][half] : stats.max[mt][half];
      alpha[mt][half] = ex2_approx(stats.max[mt][half] - safe_max(m_new));
      grew |= moves;
      stats.max[mt][half] = m_new;
      stats.sum[mt][half] *= alpha[mt][half];
    }
  }
  return __any_sync(0xffffffffu, grew);
}

// O *= alpha per row.
template <int kM, int kD>
__device__ __forceinline__ void rescale_output(float (&acc_o)[kM][kD][4], const float (&alpha)[kM][2]) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int dt = 0; dt < kD; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] *= alpha[mt][e / 2];
}

template <int kLag = kMaxLag, int kM, int kD>
__device__ __forceinline__ void merge_block_stats(RowStats<kM>& stats, const float (&block_max)[kM][2],
                                                  float (&acc_o)[kM][kD][4]) {
  float alpha[kM][2];
  // Once the running maxima settle (after a few blocks on real data) alpha is 1 for every
  // row of the warp; skipping the multiply saves kHeadDim/2 FMULs per row per block.
  if (update_row_stats<kLag>(stats, block_max, alpha)) rescale_output(acc_o, alpha);
}

// ---------------------------------------------------------------------------------
// Step 3's first half: P = exp2(S - m) in place (masked entries are -inf -> 0), and the
// per-thread row sums (the quad reduction waits until normalize_output).
// ---------------------------------------------------------------------------------
// p = 2^(s * exp_scale - m) in place, and the per-thread row sums. kExactMax: round the
// product first and subtract m exactly (see exponentiate_block). kPolyEvery > 0: every
// kPolyEvery-th 8-key tile takes poly_exp2 (FMA pipe) instead of MUFU.EX2, degree 3 for bf16
// and 4 for fp16 (P's rounding is 8 times finer in fp16).
template <typename T, bool kExactMax, int kPolyEvery = 0, int kM, int kN>
__device__ __forceinline__ void exponentiate_scores(float (&s)[kM][kN][4], RowStats<kM>& stats, float exp_scale) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
    const float m0 = safe_max(stats.max[mt][0]);
    const float m1 = safe_max(stats.max[mt][1]);
#pragma unroll
    for (int nt = 0; nt < kN; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float m = e < 2 ? m0 : m1;
        const float x = kExactMax ? __fmul_rn(s[mt][nt][e], exp_scale) - m : fmaf(s[mt][nt][e], exp_scale, -m);
        if constexpr (kPolyEvery > 0) {
          constexpr int kDegree = std::is_same<T, __half>::value ? 4 : 3;
          s[mt][nt][e] = nt % kPolyEvery == kPolyEvery - 1 ? poly_exp2<kDegree>(x) : ex2_approx(x);
        } else {
          s[mt][nt][e] = ex2_approx(x);
        }
      }
      stats.sum[mt][0] += s[mt][nt][0] + s[mt][nt][1];
      stats.sum[mt][1] += s[mt][nt][2] + s[mt][nt][3];
    }
  }
}

// P = exp2(S - m) in place and the per-thread row sums (kPolyEvery as in exponentiate_scores,
// for the common path: huge logits keep MUFU alone).
template <typename T, int kPolyEvery = 0, int kM, int kN>
__device__ __forceinline__ void exponentiate_block(float (&s)[kM][kN][4], RowStats<kM>& stats, float exp_scale) {
  // p = 2^(s * scale * log2(e) - m), normally as one FFMA + one MUFU.EX2 per element.
  // The FFMA subtracts a rounded m from the exact product, so the row's largest element
  // gets an exponent within ulp(m)/2 of 0: harmless while |m| < 2^20 (p_max within 2^(1/16)
  // of 1), but for huge logits (fp16 inputs near 6e4: |m| ~ 1e10) it could be 2^+-1000.
  // Warps holding such a row round the product first (FMUL) and subtract exactly (FADD):
  // then the largest element gets exactly 2^0.
  bool huge = false;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      huge |= stats.max[mt][half] != -INFINITY && fabsf(stats.max[mt][half]) >= 0x1p20f;
  if (__any_sync(0xffffffffu, huge)) {
    exponentiate_scores<T, true>(s, stats, exp_scale);
  } else {
    exponentiate_scores<T, false, kPolyEvery>(s, stats, exp_scale);
  }
}

// ---------------------------------------------------------------------------------
// Attention sinks (FwdParams::sinks): after the key loop, the sink joins a row's finished
// statistics as one more block of a single logit with P = 1 and no value row:
//   m' = max(m, sink), l' = l 2^(m - m') + 2^(sink - m'), O' = O 2^(m - m').
// Merged at the end rather than as the loop's start (m = sink, l = 1): the loop stays the
// sink-free one, and P = 2^(S - m) keeps the keys' own scale, so a dominant sink cannot push
// P towards underflow before its 16-bit rounding for P V. Taking the max keeps l finite when
// the sink exceeds every logit by more than the float range, and serves a row that saw no key
// (m = -inf: l' = 1, O' = 0, lse = sink). A -inf sink changes nothing, bit for bit.
// l must be the row's whole sum (after the quad / row-group reduction): the sink's term is
// added once per row. Returns the factor O takes (2^(m - m')); m and l become m' and l'.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ float merge_sink(float& m, float& l, float sink_log2) {
  const float m_new = fmaxf(m, sink_log2);  // -inf only when both are (a NaN m: NaN stays in l)
  const float ref = safe_max(m_new);
  const float alpha = exp2f(m - ref);
  l = fmaf(l, alpha, exp2f(sink_log2 - ref));
  m = m_new;
  return alpha;
}

// Query head h's sink in the kernels' log2 units; -inf (no sink) without sinks.
__device__ __forceinline__ float sink_log2_of(const float* sinks, int h) {
  return sinks == nullptr ? -INFINITY : sinks[h] * 1.4426950408889634f;
}

// ---------------------------------------------------------------------------------
// Backward: P and dS recomputed per tile, element by element on the accumulators.
// ---------------------------------------------------------------------------------

// Softcap's derivative dtanh = 1 - tanh^2 per element, kept where a kSoftcapGrad kernel keeps it
// (a whole tile); a one-element placeholder for every other variant.
template <int kVariant, int kM, int kN>
using DtanhTile = float[kVariant == kSoftcapGrad ? kM : 1][kVariant == kSoftcapGrad ? kN : 1][4];

// lse in the log2 domain. A row that saw no key has lse = -inf; it maps to +inf so that
// exp2(s - lse_log2) = exp2(-inf) = 0 instead of NaN.
__device__ __forceinline__ float lse_to_log2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
}

// Recomputes P from the raw scores, in place, the same way for every backward kernel:
//   x = s * scale_log2 (log2 units of the scaled logit); with modifiers x = mod.apply(x)
//   P = exp2(x * exp_scale - lse_log2)      (exp_scale: scale_log2 without modifiers, folded
//                                            into the FFMA as in the forward; 1 with them)
// and, with softcap (kSoftcap), keeps dtanh = 1 - tanh^2, the factor dS gets. Masked pairs are
// zeroed after the exponential when `needs_mask` (core/mask.cuh decides where that is needed).
// kTransposed: rows are keys and columns queries (dK/dV products: P^T, lse indexed by column);
// otherwise rows are queries (dQ products). Element e of C tile [mt][j] sits at row
// row0 + 16mt + g + 8 (e / 2) and column col0 + 8j + 2t + e % 2.
// kLseLog2: sLse holds lse_to_log2(lse) already (the warp-specialized Hopper backwards' producer
// converts each entry once as it stages it: per block and thread that saves 3 instructions per
// entry, 16 / 32 entries at d = 128 / 64).
// kPairs (kTransposed only): sLse holds (lse, delta) pairs per query, as compute_ds reads them.
template <bool kTransposed, int kVariant, bool kLseLog2 = false, bool kPairs = false, int kMTiles, int kNTiles,
          bool kSoftcap = kVariant == kSoftcapGrad>
__device__ __forceinline__ void compute_probs(float (&s)[kMTiles][kNTiles][4],
                                             float (&dtanh)[kSoftcap ? kMTiles : 1][kSoftcap ? kNTiles : 1][4],
                                             const float* sLse, bool needs_mask, int row0, int col0,
                                             const AttnMask& mask, const FwdParams& p, const SeqInfo& seq,
                                             int h) {
  const float scale_log2 = p.scale_log2;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  auto query_of = [&](int mt, int j, int e) {
    return kTransposed ? col0 + 8 * j + 2 * t + e % 2 : row0 + 16 * mt + g + 8 * (e / 2);
  };
  auto key_of = [&](int mt, int j, int e) {
    return kTransposed ? row0 + 16 * mt + g + 8 * (e / 2) : col0 + 8 * j + 2 * t + e % 2;
  };
  // Each pass is one warp-uniform branch around the tile: the plain path is the exp2 loop alone.
  // The modifiers are read from the params here, inside their branch, rather than kept in
  // registers across the caller's loop: the backward kernels have none to spare.
  const bool modded = kVariant != kPlain && has_score_mod(p);
  if (modded) {
    const ScoreMod mod = seq.score_mod<true, kSoftcap>(p, h);
    // query - key + offset: the thread's first element's, plus a constant per element (ALiBi's
    // distance, core/mask.cuh)
    const float d0 = static_cast<float>(query_of(0, 0, 0) - key_of(0, 0, 0) + mod.offset);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = s[mt][j][e] * scale_log2;
          if constexpr (kSoftcap) dtanh[mt][j][e] = mod.dtanh(x);
          const int rows = fragment_row_offset(mt, e), cols = fragment_col_offset(j, e);
          const int dc = kTransposed ? cols - rows : rows - cols;
          s[mt][j][e] = mod.apply_at(x, d0 + static_cast<float>(dc));
        }
  }
  const float exp_scale = modded ? 1.f : scale_log2;  // ScoreMod::exp_scale
  auto to_log2 = [](float lse) { return kLseLog2 ? lse : lse_to_log2(lse); };
  static_assert(!kPairs || kTransposed, "pairs per column");
  if constexpr (kTransposed) {  // lse indexed by column (query)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      float2 lse;
      if constexpr (kPairs) {
        const float4 pair2 = *reinterpret_cast<const float4*>(sLse + 2 * (8 * j + 2 * t));
        lse = make_float2(pair2.x, pair2.z);
      } else {
        lse = *reinterpret_cast<const float2*>(sLse + 8 * j + 2 * t);
      }
      const float lse_log2[2] = {to_log2(lse.x), to_log2(lse.y)};
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = ex2_approx(fmaf(s[mt][j][e], exp_scale, -lse_log2[e % 2]));
    }
  } else {  // lse indexed by row (query)
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const float lse_log2[2] = {to_log2(sLse[16 * mt + g]), to_log2(sLse[16 * mt + g + 8])};
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = ex2_approx(fmaf(s[mt][j][e], exp_scale, -lse_log2[e / 2]));
    }
  }
  if (needs_mask) mask_fragment<kTransposed>(s, row0, col0, 0.f, mask);
}

// dS = P * (dP - delta) (times dtanh with softcap), in place in dp. kTransposed as above:
// delta indexed by column (dK/dV products) or by row (dQ products). kPairs: sDelta holds
// compute_probs' (lse, delta) pairs.
template <bool kTransposed, int kVariant, bool kPairs = false, int kMTiles, int kNTiles,
          bool kSoftcap = kVariant == kSoftcapGrad>
__device__ __forceinline__ void compute_ds(float (&dp)[kMTiles][kNTiles][4],
                                           const float (&p)[kMTiles][kNTiles][4],
                                           const float (&dtanh)[kSoftcap ? kMTiles : 1][kSoftcap ? kNTiles : 1][4],
                                           const float* sDelta) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  for_each_tile<kMTiles, kNTiles>([&](int mt, int j) {
    float delta[2];
    if constexpr (kTransposed && kPairs) {
      const float4 pair2 = *reinterpret_cast<const float4*>(sDelta + 2 * (8 * j + 2 * t));
      delta[0] = pair2.y;
      delta[1] = pair2.w;
    } else if constexpr (kTransposed) {
      const float2 d2 = *reinterpret_cast<const float2*>(sDelta + 8 * j + 2 * t);
      delta[0] = d2.x;
      delta[1] = d2.y;
    } else {
      delta[0] = sDelta[16 * mt + g];
      delta[1] = sDelta[16 * mt + g + 8];
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float ds = p[mt][j][e] * (dp[mt][j][e] - delta[kTransposed ? e % 2 : e / 2]);
      if constexpr (kSoftcap) ds *= dtanh[mt][j][e];
      dp[mt][j][e] = ds;
    }
  });
}

// P^T and dS^T with softcap's derivative for kernels that cannot keep a whole tile of dtanh
// next to their accumulators (the warp-specialized Hopper backwards): compute_probs /
// compute_ds on slices of kSliceTiles C tiles (8 queries each) at a time, each slice handed to
// on_slice(j0, p_slice, ds_slice) (into A fragments, or into shared memory) and dead after it.
// Both S^T and dP^T must have landed first: the exponentials then no longer overlap the dP^T
// product. lse, delta: the tile's first query's entries (lse in log2 units: compute_probs'
// kLseLog2, as those kernels' producer stages it); q0: that query.
template <int kSliceTiles, int kTiles, typename OnSlice>
__device__ __forceinline__ void softcap_probs_and_ds_by_slices(const float (&pt)[1][kTiles][4],
                                                               const float (&dst)[1][kTiles][4], const float* lse,
                                                               const float* delta, bool needs_mask, int key0, int q0,
                                                               const AttnMask& mask, const FwdParams& p,
                                                               const SeqInfo& seq, int h, OnSlice&& on_slice) {
  static_assert(kTiles % kSliceTiles == 0, "whole slices");
#pragma unroll
  for (int j0 = 0; j0 < kTiles; j0 += kSliceTiles) {
    float p_slice[1][kSliceTiles][4], ds_slice[1][kSliceTiles][4], dtanh[1][kSliceTiles][4];
#pragma unroll
    for (int j = 0; j < kSliceTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p_slice[0][j][e] = pt[0][j0 + j][e];
        ds_slice[0][j][e] = dst[0][j0 + j][e];
      }
    // Queries q0 + 8 j0 ..: their lse and delta from entry 8 j0 on.
    compute_probs<true, kSoftcapGrad, true>(p_slice, dtanh, lse + 8 * j0, needs_mask, key0, q0 + 8 * j0, mask, p, seq,
                                            h);
    compute_ds<true, kSoftcapGrad>(ds_slice, p_slice, dtanh, delta + 8 * j0);
    on_slice(j0, p_slice, ds_slice);
  }
}

#endif  // __CUDACC__

// ---------------------------------------------------------------------------------
// Row statistics of a thread that owns whole rows (the fp32 tier: kTM rows per thread, each
// row's columns spread over the lanes of its row group), one entry per row. Every lane of a row
// keeps the row's max, so the lanes' partial sums share every rescale and are added only once,
// at the end.
// ---------------------------------------------------------------------------------
template <int kTM>
struct ThreadRowStats {
  float sum[kTM];  // l, this lane's part
  float max[kTM];  // m, log2 units of the scaled (modified) scores; -inf until a key is seen
};

#if defined(__CUDACC__)

// The online softmax's starting state in this layout: O = 0, m = -inf, l = 0.
template <int kTM, int kTD>
__device__ __forceinline__ void start_online_softmax(float (&acc_o)[kTM][kTD], ThreadRowStats<kTM>& stats) {
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    stats.max[i] = -INFINITY;
    stats.sum[i] = 0.f;
#pragma unroll
    for (int c = 0; c < kTD; ++c) acc_o[i][c] = 0.f;
  }
}

// Step 3's first half in this layout: P = 2^(S - m) in place, S in log2 units already (masked
// scores, -inf, give 0), and l += this lane's row sums of P.
template <int kTM, int kTN>
__device__ __forceinline__ void exponentiate_rows(float (&s)[kTM][kTN], ThreadRowStats<kTM>& stats) {
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    const float m = safe_max(stats.max[i]);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kTN; ++j) {
      s[i][j] = ex2_approx(s[i][j] - m);
      sum += s[i][j];
    }
    stats.sum[i] += sum;
  }
}

// The statistics of one row r of a tile as the fp32 forward stores them, from the row's
// (possibly lagging: tiers/simt/fwd_outer.cuh) max m, log2 units, and its sum
// l = sum_j 2^(s_j - m):
//   lse[r] = (m + log2 l) * ln 2 (natural log, what the user gets), when lse != nullptr;
//   stats[2r], stats[2r + 1] = m, log2 l, when stats != nullptr (fp32 backward, split pieces).
// Why both: the backward needs P = 2^(s - m - log2 l). Through lse, m + log2 l is rounded at the
// size of the logits (ulp(64) = 7.6e-6 at scale 1, D = 128), an error every P of the row
// inherits; (s - m) is exact for the scores that matter (Sterbenz) and log2 l <= log2(sk) is
// small, so the pair gives P to within the rounding of P itself (OPTIMIZATION.md, "fp32
// precision"). A row that saw no key (l = 0): lse = -inf, pair (+inf, 0), so P = 2^(s - inf) = 0.
__device__ __forceinline__ void store_row_stats(float* lse, float* stats, int r, float m, float l) {
  const bool empty = l == 0.f;
  const float log2l = empty ? 0.f : log2f(l);
  if (lse != nullptr) lse[r] = empty ? -INFINITY : (m + log2l) * 0.69314718055994531f;
  if (stats != nullptr) {
    reinterpret_cast<float2*>(stats)[r] = empty ? make_float2(INFINITY, 0.f) : make_float2(m, log2l);
  }
}

// The (m, log2 l) pairs of the rows from stat row `row0` on, or nullptr when there are none.
__device__ __forceinline__ float* stats_tile(float* stats, int64_t row0) {
  return stats == nullptr ? nullptr : stats + 2 * row0;
}

#endif  // __CUDACC__

}  // namespace flash_cuda
