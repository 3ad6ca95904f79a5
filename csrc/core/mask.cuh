// core/mask.cuh — which keys a query sees, and what happens to a score before the softmax.
//
// Every tier asks these questions through this file and nothing else:
//   * is the pair (query i, key j) visible?                         AttnMask::visible
//   * which keys can a range of queries see?                          AttnMask::key_begin / key_end
//   * which queries can see a range of keys? (backward)               AttnMask::query_begin / query_end
//     (in blocks: core/block.cuh)
//   * does a (query range x key range) tile need the per-element test at all?  AttnMask::needs_mask
//   * which keys does one query see, which queries one key? (a fragment row)  AttnMask::keys_of / queries_of
//   * which query does a row of a tile hold? (GQA-packed tiles)      OneQueryPerRow / GqaPackedRows
//   * softcap and ALiBi on a score, and softcap's derivative        ScoreMod
//   * both on a whole accumulator fragment (core/fragment.cuh)     modify_and_mask
//
// The rule (FlashAttention's, bottom-right aligned). Query i of a sequence with sq queries and
// sk keys sits at key position i + (sk - sq). With a window (left, right), -1 meaning unbounded:
//     query i sees key j  iff  0 <= j < sk  and  i + sk - sq - left <= j <= i + sk - sq + right.
// Causal attention is right = 0. Written on the diagonal index j - i this is
//     diag_lo <= j - i <= diag_hi,   diag_lo = sk - sq - left,   diag_hi = sk - sq + right,
// with an unbounded side at INT_MIN / INT_MAX: two integer compares per element, the same
// code with and without a window, and the block ranges follow from the same two numbers.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include "../include/params.h"

#if defined(__CUDACC__)
#include "../arch/sm80.cuh"
#include "fragment.cuh"
#endif

namespace flash_cuda {

FLASH_HOST_DEVICE inline int min_int(int a, int b) { return a < b ? a : b; }
FLASH_HOST_DEVICE inline int max_int(int a, int b) { return a > b ? a : b; }
FLASH_HOST_DEVICE inline int clamp_to_int(int64_t x, int lo, int hi) {
  return x < lo ? lo : (x > hi ? hi : static_cast<int>(x));
}

// The columns a row of a tile sees: the half-open range [lo, hi) (empty when lo >= hi).
struct ColumnRange {
  int lo, hi;
};

struct AttnMask {
  int sq, sk;            // this sequence's lengths
  int diag_lo, diag_hi;  // visible iff diag_lo <= j - i <= diag_hi (and i < sq, j < sk)

  FLASH_HOST_DEVICE static AttnMask make(int sq, int sk, int window_left, int window_right) {
    AttnMask m;
    m.sq = sq;
    m.sk = sk;
    const int64_t offset = static_cast<int64_t>(sk) - sq;
    // A bounded side is >= 0: widened as unsigned, it leaves no sign word for a kernel to keep
    // live (the Hopper forward's producer warp runs this per tile on 40 registers).
    m.diag_lo = window_left < 0 ? INT_MIN
                                : clamp_to_int(offset - static_cast<uint32_t>(window_left), INT_MIN, INT_MAX);
    m.diag_hi = window_right < 0 ? INT_MAX
                                 : clamp_to_int(offset + static_cast<uint32_t>(window_right), INT_MIN, INT_MAX);
    return m;
  }

  // The right side is bounded (causal, or a window): later query blocks see more keys.
  FLASH_HOST_DEVICE bool right_bounded() const { return diag_hi != INT_MAX; }

  // i, j >= 0 and < 2^31, so j - i cannot overflow an int (nor can the differences below).
  FLASH_HOST_DEVICE bool visible(int i, int j) const {
    const int dij = j - i;
    return i < sq && j < sk && dij >= diag_lo && dij <= diag_hi;
  }

  // Keys that at least one query of [r0, r1) sees: [key_begin(r0), key_end(r1)), empty when
  // begin >= end. r1 is clamped to sq by the caller or here.
  FLASH_HOST_DEVICE int key_begin(int r0) const {
    return clamp_to_int(static_cast<int64_t>(r0) + diag_lo, 0, sk);
  }
  FLASH_HOST_DEVICE int key_end(int r1) const {
    const int last = (r1 < sq ? r1 : sq) - 1;
    return clamp_to_int(static_cast<int64_t>(last) + diag_hi + 1, 0, sk);
  }
  // Queries that see at least one key of [c0, c1): [query_begin(c0), query_end(c1)).
  FLASH_HOST_DEVICE int query_begin(int c0) const {
    return clamp_to_int(static_cast<int64_t>(c0) - diag_hi, 0, sq);
  }
  FLASH_HOST_DEVICE int query_end(int c1) const {
    const int last = (c1 < sk ? c1 : sk) - 1;
    return clamp_to_int(static_cast<int64_t>(last) - diag_lo + 1, 0, sq);
  }

  // The keys query i sees, [key_begin(i), key_end(i + 1)), and the queries that see key j,
  // [query_begin(j), query_end(j + 1)); empty past the sequence (rows of a tile beyond sq or sk
  // count as masked). In 32-bit arithmetic that cannot overflow (the min / max bound each sum by
  // sq or sk before it is formed): a kernel's mask runs them per fragment row, where 64-bit
  // clamps cost registers the consumers do not have (a first form with them spilled 40 bytes).
  FLASH_HOST_DEVICE ColumnRange keys_of(int i) const {
    const int rest = i < sq ? sk - i : -i;  // i + rest: the end of i's keys (0 past sq)
    return {max_int(i + min_int(diag_lo, rest), 0), max_int(i + min_int(diag_hi, rest - 1) + 1, 0)};
  }
  FLASH_HOST_DEVICE ColumnRange queries_of(int j) const {
    const int lo = j - max_int(diag_hi, j - sq);          // <= sq
    const int hi = j - max_int(diag_lo, j - (sq - 1)) + 1;  // <= sq
    return {max_int(lo, 0), j < sk ? max_int(hi, 0) : 0};
  }

  // True when some pair of the tile [r0, r1) x [c0, c1) is visible: lets a warp skip a tile
  // none of its rows sees. The differences j - i over the tile span [c0 - (r1 - 1), (c1 - 1) - r0].
  FLASH_HOST_DEVICE bool any_visible(int r0, int r1, int c0, int c1) const {
    r1 = r1 < sq ? r1 : sq;
    c1 = c1 < sk ? c1 : sk;
    return r0 < r1 && c0 < c1 && static_cast<int64_t>(c1 - 1) - r0 >= diag_lo &&
           static_cast<int64_t>(c0) - (r1 - 1) <= diag_hi;
  }

  // True when some pair of the tile [r0, r1) x [c0, c1) is not visible, i.e. the tile needs
  // the per-element test. Rows >= sq count as invisible: a forward that does not care about
  // its padding rows passes r1 = min(r1, sq).
  FLASH_HOST_DEVICE bool needs_mask(int r0, int r1, int c0, int c1) const {
    return r1 > sq || c1 > sk || (c1 - 1) - r0 > diag_hi || c0 - (r1 - 1) < diag_lo;
  }
};

// Which query a row of a kernel's tile holds: the mask and the score modifiers of a row are
// those of its query. Every kernel that gives each query head its own tiles has one query per
// row and counts rows in query indices (OneQueryPerRow, the helpers' default). The Hopper
// forward's packed GQA tiles (tiers/wgmma/fwd/kernel.cuh) hold the G = 2^shift query heads of one
// KV group side by side: tile row r is query q0 + r / G of the group's head r % G, so rows
// [r0, r1) of a tile cover the queries [query(r0), query(r1 - 1) + 1).
struct OneQueryPerRow {
  FLASH_HOST_DEVICE int query(int row) const { return row; }
};
struct GqaPackedRows {
  int q0;     // the tile's first query
  int shift;  // log2 G: G is a power of two (it divides the tile's rows)
  FLASH_HOST_DEVICE int query(int row) const { return q0 + (row >> shift); }
};

// ---------------------------------------------------------------------------------
// Score modifiers. A kernel hands over x, the score in log2 units of the scaled logit
// (x = scale * q.k * log2 e); with modifiers on it receives
//     x' = C * tanh(x / C) - A * |i + sk - sq - j|,    C = softcap * log2 e,  A = slope * log2 e
// i.e. softcap * tanh(scale q.k / softcap) - slope * distance, in log2 units, and takes
// exp2(x' - m) as usual. Kernels that fold the scale into the exp2 (s * scale_log2 - m) apply
// the scale first when `active` and then use 1 as the exp2 factor: see exp_scale().
// The gradient of x' with respect to x is 1 - tanh^2 (ALiBi adds a constant), so the backward
// multiplies dS by dtanh(); dK and dQ keep their factor `scale`.
// ---------------------------------------------------------------------------------
struct ScoreMod {
  float softcap_log2 = 0.f;      // C; 0: no softcap
  float inv_softcap_log2 = 0.f;  // 1 / C
  float alibi_log2 = 0.f;        // A for this (batch, head); 0: no ALiBi
  int offset = 0;                // sk - sq of this sequence

  FLASH_HOST_DEVICE bool active() const { return softcap_log2 != 0.f || alibi_log2 != 0.f; }
  FLASH_HOST_DEVICE bool has_softcap() const { return softcap_log2 != 0.f; }

  // The factor a kernel applies inside its exp2: scale_log2 without modifiers (the raw dot
  // product goes in), 1 with them (apply() already returned log2 units).
  FLASH_HOST_DEVICE float exp_scale(float scale_log2) const { return active() ? 1.f : scale_log2; }

#if defined(__CUDACC__)
  // What matters is the error of C * tanh, an absolute error of the logit. kPrecise uses the
  // libm tanhf (the fp32 tier, whose naive counterpart rounds logits to fp32); the fp16 / bf16
  // kernels, whose naive counterparts round tanh to 11 or 8 bits, take MUFU.TANH (relative error
  // about 2^-11): one instruction where 1 - 2 / (2^(2x log2 e) + 1) took two MUFU instructions
  // and four on the FMA pipe, all on the softmax's dependent chain (OPTIMIZATION.md).
  template <bool kPrecise>
  __device__ __forceinline__ static float tanh_of(float y) {
    if constexpr (kPrecise) {
      return tanhf(y);
    } else {
      return tanh_approx(y);
    }
  }

  // x (log2 units of the scaled logit) -> modified logit (log2 units) for query i, key j.
  template <bool kPrecise = false>
  __device__ __forceinline__ float apply(float x, int i, int j) const {
    return apply_at<kPrecise>(x, static_cast<float>(i + offset - j));
  }
  // The same from the distance d = i + offset - j as a float (exact: |d| < 2^24). The fragment
  // loops (modify_and_mask, compute_probs) pass d as a per-thread base plus a constant, so no
  // element pays an integer-to-float conversion beside its exponential.
  template <bool kPrecise = false>
  __device__ __forceinline__ float apply_at(float x, float d) const {
    if (softcap_log2 != 0.f) x = softcap_log2 * tanh_of<kPrecise>(x * inv_softcap_log2);
    if (alibi_log2 != 0.f) x -= alibi_log2 * fabsf(d);
    return x;
  }

  // d x' / d x = 1 - tanh^2(x / C), from the unmodified x (1 without softcap).
  template <bool kPrecise = false>
  __device__ __forceinline__ float dtanh(float x) const {
    if (softcap_log2 == 0.f) return 1.f;
    const float t = tanh_of<kPrecise>(x * inv_softcap_log2);
    return 1.f - t * t;
  }
#endif

  // The modifiers of (batch bi, head h); `seq_offset` = sk - sq of that sequence.
  // kOpaqueSoftcap: softcap read opaquely (arch/sm80.cuh), for a caller that builds the modifiers per
  // tile inside its loop (core/softmax.cuh: compute_probs with softcap's derivative): it keeps the
  // compiler from hoisting C and 1 / C out of that loop into registers the warp-specialized
  // consumers do not have.
  template <bool kOpaqueSoftcap = false>
  FLASH_HOST_DEVICE static ScoreMod make(const FwdParams& p, int bi, int h, int seq_offset) {
    constexpr float kLog2e = 1.4426950408889634f;
    ScoreMod mod;
    float softcap = p.softcap;
#if defined(__CUDA_ARCH__)
    if constexpr (kOpaqueSoftcap) opaque(softcap);
#endif
    if (softcap > 0.f) {
      mod.softcap_log2 = softcap * kLog2e;
      mod.inv_softcap_log2 = 1.f / mod.softcap_log2;
    }
    if (p.alibi_slopes != nullptr) {
      mod.alibi_log2 = p.alibi_slopes[static_cast<int64_t>(bi) * p.alibi_batch_stride + h] * kLog2e;
    }
    mod.offset = seq_offset;
    return mod;
  }
};

#if defined(__CUDACC__)
// Sets the elements of a C fragment (rows from row_base, columns from col_base) that the mask
// hides to `value`: rows are queries and columns keys, or the reverse (kTransposed: the
// backward's S^T). Rows of 16 C tiles (the Hopper forward's 128-key steps, the d <= 64 Hopper
// backward's 128-query steps) take the per-row bit mask (fill_outside_columns: one bit test per
// element instead of the index compares), which gained where masked blocks weigh (OPTIMIZATION.md,
// "The mask as bits"); narrower rows compare each element's indices: at 8 tiles (the d = 128
// backward) the bits measured nothing, and in the mma.sync tiles (sm_120's) and the softcap
// backward's 8-query slices their registers spilled.
template <bool kTransposed, int kM, int kN, typename Rows = OneQueryPerRow>
__device__ __forceinline__ void mask_fragment(float (&s)[kM][kN][4], int row_base, int col_base, float value,
                                              const AttnMask& mask, const Rows& rows = {}) {
  if constexpr (kN >= 16) {
    fill_outside_columns(s, row_base, col_base, value, [&](int row) {
      return kTransposed ? mask.queries_of(row) : mask.keys_of(rows.query(row));
    });
  } else {
    for_each_element(s, row_base, col_base, [&](float& x, int row, int col) {
      if (!(kTransposed ? mask.visible(col, row) : mask.visible(rows.query(row), col))) x = value;
    });
  }
}

// The score modifiers (softcap, ALiBi) and the mask on a warp's C fragment of S (core/
// fragment.cuh), rows from row_base and keys from key_base. Without modifiers S stays the raw
// q.k; with them each score becomes the modified logit in log2 units (scale_log2 applied first:
// ScoreMod::exp_scale is then 1). Masked scores become -inf. Each pass is one warp-uniform branch
// around the whole tile: the plain, unmasked block (the common case) runs no per-element test.
// `rows` maps the warp's rows (row_base + ...) to their queries: the identity except in the
// GQA-packed Hopper forward, whose row_base counts tile rows.
template <int kM, int kN, typename Rows = OneQueryPerRow>
__device__ __forceinline__ void modify_and_mask(float (&s)[kM][kN][4], bool needs_mask, int row_base, int key_base,
                                                const AttnMask& mask, const ScoreMod& mod, float scale_log2,
                                                const Rows& rows = {}) {
  if (mod.active()) {
    if constexpr (std::is_same_v<Rows, OneQueryPerRow>) {
      // An element's distance is the thread's first element's plus a constant (core/fragment.cuh).
      const int lane = threadIdx.x % 32;
      const float d0 =
          static_cast<float>(row_base + fragment_row0(lane) + mod.offset - key_base - fragment_col0(lane));
#pragma unroll
      for (int mt = 0; mt < kM; ++mt)
#pragma unroll
        for (int nt = 0; nt < kN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            s[mt][nt][e] = mod.apply_at(
                s[mt][nt][e] * scale_log2,
                d0 + static_cast<float>(fragment_row_offset(mt, e) - fragment_col_offset(nt, e)));
    } else {
      for_each_element(s, row_base, key_base, [&](float& x, int row, int col) {
        x = mod.apply(x * scale_log2, rows.query(row), col);
      });
    }
  }
  if (needs_mask) mask_fragment<false>(s, row_base, key_base, -INFINITY, mask, rows);
}
#endif  // __CUDACC__

}  // namespace flash_cuda
