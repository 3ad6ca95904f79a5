// mma_fwd.cuh — the fp16/bf16 tensor-core forward of flash_cuda (FlashAttention-2 style).
//
// Work split. One CTA owns kBlockM query rows of one (batch, query head); its kNWarps
// warps split those rows (FlashAttention-2: warps split queries, never keys, so the
// softmax statistics of a row live in one warp and need no shared-memory exchange).
// Each warp owns kWarpRows = 16 * kMTiles rows: with two 16-row MMA tiles per warp every
// K/V fragment read from shared memory feeds two tensor-core instructions.
//
// Per K/V block (kBlockN keys) the loop runs the four steps of the online softmax:
//   1. compute_qk_scores_and_max            S = Q K^T (mma.sync), mask, row max
//   2. merge_block_stats                    new running max, rescale l and the O accumulator
//   3. compute_block_softmax_and_weighted_v P = exp2(S - m), l += rowsum(P), O += P V (mma.sync)
// and after the last block
//   4. normalize_output                     O /= l, lse = (m + log2 l) * ln 2, store
//
// Data movement. Q is copied once into shared memory; K and V blocks stream through a
// two-stage ring filled by cp.async (LDGSTS), so block j+1 is in flight while block j is
// computed. Shared-memory rows are padded by 8 elements (16 bytes): the 8 row addresses of
// every ldmatrix then fall into 8 different 16-byte bank groups, for any head dim.
//
// Scores are kept in the log2 domain: s2 = (q . k) * scale * log2(e), so each softmax
// element costs one FMUL, one FADD and one MUFU.EX2.
#pragma once

#include "../core/seqlen.cuh"
#include "common.cuh"

namespace flash_cuda {
namespace fwd_mma {

// ---------------------------------------------------------------------------------
// Tile configuration per head-dim bucket.
// ---------------------------------------------------------------------------------
template <int kHeadDim>
struct Traits;
// kBlockM, kBlockN, kNWarps, kMinBlocksPerSM. Measured on the H200 (OPTIMIZATION.md):
// 128x64 tiles, 4 warps of 32 rows, 2 CTAs per SM, for head dims up to 128; beyond that the
// O accumulator needs one 16-row tile per warp (64-row CTAs).
template <> struct Traits<32>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kMinBlocks = 2; };
template <> struct Traits<64>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kMinBlocks = 2; };
template <> struct Traits<96>  { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kMinBlocks = 2; };
template <> struct Traits<128> { static constexpr int kBlockM = 128, kBlockN = 64,  kNWarps = 4, kMinBlocks = 2; };
template <> struct Traits<192> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 4, kMinBlocks = 1; };
template <> struct Traits<256> { static constexpr int kBlockM = 64,  kBlockN = 64,  kNWarps = 4, kMinBlocks = 1; };

// Where a block may opt into less shared memory than Traits needs (d = 128 on 99 KiB consumer
// cards, d = 192 there, d = 256 on an A100 too), run_fwd_mma takes CompactTraits: the K/V steps
// shrink to 32 keys, which keeps the 16-row tiles per warp (tensor-core work per fragment read)
// that the rows would lose; FlashAttention-2 makes the same choice on sm_86 / sm_89.
template <int kHeadDim> struct CompactTraits : Traits<kHeadDim> {};
template <> struct CompactTraits<128> { static constexpr int kBlockM = 128, kBlockN = 32, kNWarps = 4, kMinBlocks = 1; };
template <> struct CompactTraits<192> { static constexpr int kBlockM = 64,  kBlockN = 32, kNWarps = 4, kMinBlocks = 1; };
template <> struct CompactTraits<256> { static constexpr int kBlockM = 64,  kBlockN = 32, kNWarps = 4, kMinBlocks = 1; };

template <typename T_, int kHeadDim_, typename Tile = Traits<kHeadDim_>>
struct Config {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kNWarps = Tile::kNWarps;
  static constexpr int kMinBlocks = Tile::kMinBlocks;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kWarpRows = kBlockM / kNWarps;
  static constexpr int kMTiles = kWarpRows / 16;  // 16-row MMA tiles per warp
  static constexpr int kNTiles = kBlockN / 8;     // 8-key MMA tiles of S per block
  static constexpr int kDTiles = kHeadDim / 8;    // 8-column MMA tiles of O
  static constexpr int kStride = kHeadDim + 8;    // padded shared-memory row (elements)
  static constexpr int kStages = 2;               // K/V ring depth
  static constexpr size_t kSmemQ = size_t(kBlockM) * kStride * sizeof(T);
  static constexpr size_t kSmemKV = size_t(kBlockN) * kStride * sizeof(T);  // one K or V block
  static constexpr size_t kSmemBytes = kSmemQ + 2 * kStages * kSmemKV;
  static_assert(kWarpRows % 16 == 0, "a warp owns whole 16-row MMA tiles");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "MMA k-steps are 16 wide");
};

template <typename T, int kHeadDim>
constexpr bool kTilesFit = Config<T, kHeadDim>::kSmemBytes <= kSmemHopper &&
                           Config<T, kHeadDim, CompactTraits<kHeadDim>>::kSmemBytes <= kSmemConsumer;
static_assert(kTilesFit<__half, 32> && kTilesFit<__half, 64> && kTilesFit<__half, 96> &&
                  kTilesFit<__half, 128> && kTilesFit<__half, 192> && kTilesFit<__half, 256>,
              "every head dim has a configuration for each GPU class");

// ---------------------------------------------------------------------------------
// Global -> shared tile copy: rows [0, kRows) x columns [0, kHeadDim) of a row-major
// tensor slice, 16 bytes per cp.async. Rows >= rows_valid and columns >= d are zero-filled
// (the padded columns then contribute 0 to every dot product).
// ---------------------------------------------------------------------------------
template <typename Cfg, int kRows>
__device__ __forceinline__ void load_tile_async(typename Cfg::T* smem, const typename Cfg::T* gmem,
                                                int64_t row_stride, int rows_valid, int d) {
  // Each thread keeps one 16-byte column chunk and walks down the rows, so the address
  // arithmetic is one add per copy (few live registers next to the accumulators). When
  // the thread count is not a multiple of the chunks per row (head dims 96, 192) the
  // last few threads sit out.
  constexpr int kChunksPerRow = Cfg::kHeadDim / 8;
  constexpr int kRowsPerPass = Cfg::kThreads / kChunksPerRow;
  const int col = (threadIdx.x % kChunksPerRow) * 8;
  int r = threadIdx.x / kChunksPerRow;
  if (Cfg::kThreads % kChunksPerRow != 0 && r >= kRowsPerPass) return;
  const bool col_valid = col < d;
  const typename Cfg::T* src = gmem + r * row_stride + col;
  typename Cfg::T* dst = smem + r * Cfg::kStride + col;
#pragma unroll
  for (int pass = 0; pass < ceil_div(kRows, kRowsPerPass); ++pass) {
    if (kRows % kRowsPerPass == 0 || r < kRows) {
      const bool valid = col_valid && r < rows_valid;
      cp_async_16(dst, valid ? src : gmem, valid);
    }
    r += kRowsPerPass;
    src += kRowsPerPass * row_stride;
    dst += kRowsPerPass * Cfg::kStride;
  }
}

// ---------------------------------------------------------------------------------
// Calls f(element, query row, key) for every score a warp holds: element e of tile (mt, nt) is
// query row_base + 16 mt + g + 8 (e / 2), key key_base + 8 nt + 2 t + e % 2 (g = lane / 4,
// t = lane % 4, the mma.sync C layout, which wgmma's accumulator has per warp too).
template <typename Cfg, typename F>
__device__ __forceinline__ void for_each_element(float (&s)[Cfg::kMTiles][Cfg::kNTiles][4], int row_base,
                                                 int key_base, F&& f) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(s[mt][nt][e], row_base + mt * 16 + g + (e / 2) * 8, key_base + nt * 8 + 2 * t + (e % 2));
}

// ---------------------------------------------------------------------------------
// Applies the score modifiers (softcap, ALiBi) and the mask to S and returns the block's row
// maxima in the exp2 domain. Shared by every tensor-core forward (mma.sync here, wgmma in
// sm90_fwd.cuh): the accumulator layouts are the same per warp.
// Without modifiers S stays the raw q.k and exp_scale = scale_log2 is applied once per row
// here and once per element inside the exp2's FFMA (the scale is positive: the binding folds
// a negative scale into q, so max(scale * s) = scale * max(s)). With modifiers S becomes the
// modified logit in log2 units and exp_scale is 1 (ScoreMod::exp_scale).
// `rows` maps the warp's rows (row_base + ...) to their queries (core/mask.cuh): the identity
// except in the GQA-packed Hopper forward, whose row_base counts tile rows.
template <typename Cfg, typename Rows = OneQueryPerRow>
__device__ __forceinline__ void mask_and_block_max(float (&s)[Cfg::kMTiles][Cfg::kNTiles][4],
                                                   float (&block_max)[Cfg::kMTiles][2], bool needs_mask,
                                                   int row_base, int key_base, const AttnMask& mask,
                                                   const ScoreMod& mod, float scale_log2, const Rows& rows = {}) {
  // Both passes are one warp-uniform branch around the whole tile: the plain, unmasked block
  // (the common case) runs no per-element test.
  if (mod.active()) {
    for_each_element<Cfg>(s, row_base, key_base, [&](float& x, int row, int col) {
      x = mod.apply(x * scale_log2, rows.query(row), col);
    });
  }
  if (needs_mask) {
    for_each_element<Cfg>(s, row_base, key_base, [&](float& x, int row, int col) {
      if (!mask.visible(rows.query(row), col)) x = -INFINITY;
    });
  }
  const float exp_scale = mod.exp_scale(scale_log2);
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // A pairwise tree, not a running max: 4-5 dependent FMNMX instead of kNTiles on the
      // softmax's critical path (max is exact in any order: same result).
      float m[Cfg::kNTiles];
#pragma unroll
      for (int nt = 0; nt < Cfg::kNTiles; ++nt) m[nt] = fmaxf(s[mt][nt][half * 2], s[mt][nt][half * 2 + 1]);
#pragma unroll
      for (int stride = 1; stride < Cfg::kNTiles; stride *= 2)
#pragma unroll
        for (int nt = 0; nt + stride < Cfg::kNTiles; nt += 2 * stride) m[nt] = fmaxf(m[nt], m[nt + stride]);
      const float mx = fmaxf(m[0], -INFINITY);  // a row of NaN scores: -inf, as the running max gave
      // Rounding is monotonic, so bm = round(max_j s_j * exp_scale) is also the largest
      // of the rounded per-element products round(s_j * exp_scale): the exact-max path of
      // step 3 relies on this.
      block_max[mt][half] = group_max<4>(mx) * exp_scale;  // the 4 lanes of a quad share a row
    }
  }
}

// ---------------------------------------------------------------------------------
// Step 1: S = Q K^T for this warp's rows and one K block, masked, scaled to the log2
// domain; returns the block's row maxima (two rows per thread per m-tile: g and g+8).
// ---------------------------------------------------------------------------------
template <typename Cfg>
__device__ __forceinline__ void compute_qk_scores_and_max(
    float (&s)[Cfg::kMTiles][Cfg::kNTiles][4], float (&block_max)[Cfg::kMTiles][2],
    const typename Cfg::T* sQ_warp, const typename Cfg::T* sK, bool needs_mask, int row_base,
    int key_base, const AttnMask& mask, const ScoreMod& mod, float scale_log2) {
  // (block_max is returned in the log2 domain: max_j(s_j) * scale * log2(e).)
  using T = typename Cfg::T;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

#pragma unroll
  for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
    // A fragments (Q rows): lane i addresses row (i % 8) + 8 * ((i / 8) % 2), column block i / 16.
    uint32_t a[Cfg::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
      const T* p = sQ_warp + (mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * Cfg::kStride + kk * 16 +
                   (lane / 16) * 8;
      ldmatrix_x4(a[mt], p);
    }
    // B fragments (K rows = columns of K^T), two 8-key tiles per ldmatrix.x4:
    // lane i addresses key (i % 8) + 8 * (i / 16), column block (i / 8) % 2.
#pragma unroll
    for (int nt2 = 0; nt2 < Cfg::kNTiles / 2; ++nt2) {
      uint32_t b[4];
      const T* p = sK + (nt2 * 16 + (lane % 8) + (lane / 16) * 8) * Cfg::kStride + kk * 16 +
                   ((lane / 8) % 2) * 8;
      ldmatrix_x4(b, p);
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
        mma_16816<T>(s[mt][2 * nt2], a[mt], b[0], b[1]);
        mma_16816<T>(s[mt][2 * nt2 + 1], a[mt], b[2], b[3]);
      }
    }
  }

  mask_and_block_max<Cfg>(s, block_max, needs_mask, row_base, key_base, mask, mod, scale_log2);
}

// ---------------------------------------------------------------------------------
// Step 2: fold the block maxima into the running statistics. The O accumulator and the
// running sum were computed against the old max, so both are rescaled by
// alpha = exp2(m_old - m_new). A row that has seen only masked keys keeps m = -inf and
// alpha = 0 (its accumulator is still zero).
// ---------------------------------------------------------------------------------
// The online softmax's starting state, per row: O = 0, m = -inf, l = 0.
template <typename Cfg>
__device__ __forceinline__ void start_online_softmax(float (&acc_o)[Cfg::kMTiles][Cfg::kDTiles][4],
                                                     float (&row_max)[Cfg::kMTiles][2],
                                                     float (&row_sum)[Cfg::kMTiles][2]) {
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Cfg::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
}

// Step 2 in two halves, so that a pipelined schedule (sm90_fwd_ws.cuh) can fold the
// statistics while the previous block's P V is still on the tensor cores and rescale O once
// that product has landed. update_row_stats: m' = max(m, block max), l *= alpha, and alpha
// per row; returns whether any row of the warp moved (otherwise alpha is 1 everywhere).
// kLag > 0 (log2 units): a lagging reference max. A row keeps its m while the block's max
// exceeds it by at most kLag, so its P may reach 2^kLag instead of 1; O and l are then
// both summed against the same stale m and O / l and lse = m + log2(l) stay exact. Once the
// first block has set m, random-like scores almost never move it again, and O's rescale (a
// multiply per accumulator, on the turn's critical path in the warp-specialized forward)
// disappears from the later blocks. 2^8 keeps P far inside fp16's range (65504). Every
// 16-bit forward uses it (kMaxLag = 0: the exact running max).
constexpr int kMaxLag = 8;
template <typename Cfg, int kLag = kMaxLag>
__device__ __forceinline__ bool update_row_stats(float (&row_max)[Cfg::kMTiles][2], float (&row_sum)[Cfg::kMTiles][2],
                                                 const float (&block_max)[Cfg::kMTiles][2],
                                                 float (&alpha)[Cfg::kMTiles][2]) {
  bool grew = false;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // -inf + kLag = -inf: any finite block max replaces a row's first -inf.
      const bool moves = kLag > 0 ? block_max[mt][half] > row_max[mt][half] + float(kLag)
                                  : block_max[mt][half] > row_max[mt][half];
      const float m_new = moves ? block_max[mt][half] : row_max[mt][half];
      alpha[mt][half] = fast_exp2(row_max[mt][half] - safe_max(m_new));
      grew |= moves;
      row_max[mt][half] = m_new;
      row_sum[mt][half] *= alpha[mt][half];
    }
  }
  return __any_sync(0xffffffffu, grew);
}

// O *= alpha per row.
template <typename Cfg>
__device__ __forceinline__ void rescale_output(float (&acc_o)[Cfg::kMTiles][Cfg::kDTiles][4],
                                               const float (&alpha)[Cfg::kMTiles][2]) {
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < Cfg::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] *= alpha[mt][e / 2];
}

template <typename Cfg, int kLag = kMaxLag>
__device__ __forceinline__ void merge_block_stats(float (&row_max)[Cfg::kMTiles][2],
                                                  float (&row_sum)[Cfg::kMTiles][2],
                                                  float (&acc_o)[Cfg::kMTiles][Cfg::kDTiles][4],
                                                  const float (&block_max)[Cfg::kMTiles][2]) {
  float alpha[Cfg::kMTiles][2];
  // Once the running maxima settle (after a few blocks on real data) alpha is 1 for every
  // row of the warp; skipping the multiply saves kHeadDim/2 FMULs per row per block.
  if (update_row_stats<Cfg, kLag>(row_max, row_sum, block_max, alpha)) rescale_output<Cfg>(acc_o, alpha);
}

// p = 2^(s * scale_log2 - m) in place, and the per-thread row sums (scale_log2: the exp2
// factor, ScoreMod::exp_scale). kExactMax: round the
// product first and subtract m exactly (see compute_block_softmax_and_weighted_v).
// kPolyEvery > 0: every kPolyEvery-th 8-key tile takes poly_exp2 (FMA pipe) instead of
// MUFU.EX2, degree 3 for bf16 and 4 for fp16 (P's rounding is 8 times finer in fp16).
template <typename Cfg, bool kExactMax, int kPolyEvery = 0>
__device__ __forceinline__ void exponentiate_scores(float (&s)[Cfg::kMTiles][Cfg::kNTiles][4],
                                                    float (&row_sum)[Cfg::kMTiles][2],
                                                    const float (&row_max)[Cfg::kMTiles][2],
                                                    float scale_log2) {
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
    const float m0 = safe_max(row_max[mt][0]);
    const float m1 = safe_max(row_max[mt][1]);
#pragma unroll
    for (int nt = 0; nt < Cfg::kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float m = e < 2 ? m0 : m1;
        const float x = kExactMax ? __fmul_rn(s[mt][nt][e], scale_log2) - m
                                  : fmaf(s[mt][nt][e], scale_log2, -m);
        if constexpr (kPolyEvery > 0) {
          constexpr int kDegree = std::is_same<typename Cfg::T, __half>::value ? 4 : 3;
          s[mt][nt][e] = nt % kPolyEvery == kPolyEvery - 1 ? poly_exp2<kDegree>(x) : fast_exp2(x);
        } else {
          s[mt][nt][e] = fast_exp2(x);
        }
      }
      row_sum[mt][0] += s[mt][nt][0] + s[mt][nt][1];
      row_sum[mt][1] += s[mt][nt][2] + s[mt][nt][3];
    }
  }
}

// P = exp2(S - m) in place and the per-thread row sums (shared by the tensor-core forwards;
// kPolyEvery as in exponentiate_scores, for the common path: huge logits keep MUFU alone).
template <typename Cfg, int kPolyEvery = 0>
__device__ __forceinline__ void exponentiate_block(float (&s)[Cfg::kMTiles][Cfg::kNTiles][4],
                                                   float (&row_sum)[Cfg::kMTiles][2],
                                                   const float (&row_max)[Cfg::kMTiles][2], float scale_log2) {
  // p = 2^(s * scale * log2(e) - m), normally as one FFMA + one MUFU.EX2 per element.
  // The FFMA subtracts a rounded m from the exact product, so the row's largest element
  // gets an exponent within ulp(m)/2 of 0: harmless while |m| < 2^20 (p_max within 2^(1/16)
  // of 1), but for huge logits (fp16 inputs near 6e4: |m| ~ 1e10) it could be 2^+-1000.
  // Warps holding such a row round the product first (FMUL) and subtract exactly (FADD):
  // then the largest element gets exactly 2^0.
  bool huge = false;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      huge |= row_max[mt][half] != -INFINITY && fabsf(row_max[mt][half]) >= 0x1p20f;
  if (__any_sync(0xffffffffu, huge)) {
    exponentiate_scores<Cfg, true>(s, row_sum, row_max, scale_log2);
  } else {
    exponentiate_scores<Cfg, false, kPolyEvery>(s, row_sum, row_max, scale_log2);
  }
}

// ---------------------------------------------------------------------------------
// Step 3: P = exp2(S - m) (masked entries are -inf -> 0), accumulate the row sums
// (per thread; the quad reduction waits until normalize_output) and O += P V.
// The S accumulator fragments of two neighbouring 8-key tiles are exactly the A fragment
// of one 16-key MMA step, so P goes from registers to the tensor cores without touching
// shared memory. V is read with ldmatrix.trans: lane i addresses key (i % 8) +
// 8 * ((i / 8) % 2), column block i / 16.
// ---------------------------------------------------------------------------------
template <typename Cfg>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(
    float (&s)[Cfg::kMTiles][Cfg::kNTiles][4], float (&row_sum)[Cfg::kMTiles][2],
    float (&acc_o)[Cfg::kMTiles][Cfg::kDTiles][4], const float (&row_max)[Cfg::kMTiles][2],
    const typename Cfg::T* sV, float scale_log2) {
  using T = typename Cfg::T;
  const int lane = threadIdx.x % 32;
  exponentiate_block<Cfg>(s, row_sum, row_max, scale_log2);

#pragma unroll
  for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
    uint32_t a[Cfg::kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
      a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dt2 = 0; dt2 < Cfg::kDTiles / 2; ++dt2) {
      uint32_t b[4];
      const T* p = sV + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * Cfg::kStride + dt2 * 16 +
                   (lane / 16) * 8;
      ldmatrix_x4_trans(b, p);
#pragma unroll
      for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
        mma_16816<T>(acc_o[mt][2 * dt2], a[mt], b[0], b[1]);
        mma_16816<T>(acc_o[mt][2 * dt2 + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------
// Step 4: finish the row sums across the quad, divide, write O (through this warp's own
// rows of the Q tile, so the global stores are 16-byte and coalesced) and the lse.
// kStaged = false (a kernel without shared memory to spare; sO_warp unused): every thread
// stores its own pairs of columns, 4 bytes each. kInTileLoop: called once per tile of a
// persistent kernel (below). Stage: where element (r, col) of the warp's staged rows lives,
// sO_warp + Stage::at(r, col) (16-byte chunks stay whole); padded rows by default. copy =
// false: the rows are only staged, and the caller moves them to global memory itself (the
// warp-specialized Hopper forward's TMA store; it orders the staging writes before it).
// `out` places the warp's row r in o and lse: row r of a head (StridedRows), or of a GQA-packed
// tile (sm90_fwd_ws.cuh: GqaOutRows).
// ---------------------------------------------------------------------------------
template <typename Cfg>
struct PaddedRows {
  __device__ __forceinline__ static int at(int r, int col) { return r * Cfg::kStride + col; }
};
struct StridedRows {
  __device__ __forceinline__ int64_t o(int r, int64_t o_row_stride) const { return r * o_row_stride; }
  __device__ __forceinline__ int lse(int r) const { return r; }
};

template <typename Cfg, bool kStaged = true, bool kInTileLoop = false, typename Stage = PaddedRows<Cfg>,
          typename OutRows = StridedRows>
__device__ __forceinline__ void normalize_output(float (&acc_o)[Cfg::kMTiles][Cfg::kDTiles][4],
                                                 float (&row_sum)[Cfg::kMTiles][2],
                                                 const float (&row_max)[Cfg::kMTiles][2],
                                                 typename Cfg::T* sO_warp, typename Cfg::T* o_rows,
                                                 int64_t o_row_stride, float* lse_rows,
                                                 int rows_valid, int d, bool copy = true,
                                                 const OutRows& out = {}) {
  using T = typename Cfg::T;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int mt = 0; mt < Cfg::kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float l = group_sum<4>(row_sum[mt][half]);
      // l == 0 only for a row that saw no key: output 0, lse -inf. (Testing l > 0 instead
      // would also send a NaN row to -inf and hide the NaN from the backward.)
      const float inv = l == 0.f ? 0.f : 1.f / l;
      const int r = mt * 16 + g + half * 8;
#pragma unroll
      for (int dt = 0; dt < Cfg::kDTiles; ++dt) {
        const uint32_t packed =
            pack2<T>(acc_o[mt][dt][half * 2] * inv, acc_o[mt][dt][half * 2 + 1] * inv);
        if constexpr (kStaged) {
          *reinterpret_cast<uint32_t*>(sO_warp + Stage::at(r, dt * 8 + 2 * t)) = packed;
        } else if (r < rows_valid && dt * 8 + 2 * t < d) {
          *reinterpret_cast<uint32_t*>(o_rows + out.o(r, o_row_stride) + dt * 8 + 2 * t) = packed;
        }
      }
      if (t == 0 && r < rows_valid) {
        lse_rows[out.lse(r)] = l == 0.f ? -INFINITY : (row_max[mt][half] + __log2f(l)) * kLn2;
      }
    }
  }
  if constexpr (!kStaged) return;
  if (!copy) return;
  __syncwarp();
  constexpr int kChunksPerRow = Cfg::kHeadDim / 8;
  // kInTileLoop: the lane read again, opaquely, so that the compiler cannot hoist this copy's
  // per-lane rows and columns out of a persistent kernel's tile loop and keep them live through
  // its main loop (at d = 192, 24 chunks per row, a dozen registers). Elsewhere the lane above
  // serves (a second one costs a register where there is no loop to hoist from).
  int copy_lane = lane;
  if constexpr (kInTileLoop) asm volatile("mov.u32 %0, %%laneid;" : "=r"(copy_lane));
#pragma unroll
  for (int c = copy_lane; c < Cfg::kWarpRows * kChunksPerRow; c += 32) {
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    if (r < rows_valid && col < d) {
      *reinterpret_cast<uint4*>(o_rows + out.o(r, o_row_stride) + col) =
          *reinterpret_cast<const uint4*>(sO_warp + Stage::at(r, col));
    }
  }
}

// ---------------------------------------------------------------------------------
// The kernel. Grid: (query blocks, query heads, batch).
// ---------------------------------------------------------------------------------
template <typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) fwd_mma_kernel(const FwdParams p) {
  constexpr bool kExt = kVariant != kPlain;
  using T = typename Cfg::T;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Cfg::kBlockM * Cfg::kStride;                      // [kStages][kBlockN][kStride]
  T* sV = sK + Cfg::kStages * Cfg::kBlockN * Cfg::kStride;       // [kStages][kBlockN][kStride]

  // With a bounded right side (causal, window) late query blocks see the most keys: launch
  // them first.
  const int h = blockIdx.y;
  const SeqInfo seq = SeqInfo::make<kExt>(p, blockIdx.z);
  const AttnMask mask = seq.mask(p);
  const int m_block = mask.right_bounded() ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int row0 = m_block * Cfg::kBlockM;
  if (row0 >= seq.sq) return;  // varlen: this sequence is shorter than max_seqlen_q
  const ScoreMod mod = seq.score_mod<kExt>(p, h);
  const float exp_scale = mod.exp_scale(p.scale_log2);
  const int h_kv = h / (p.hq / p.hkv);
  const int warp = threadIdx.x / 32;
  const int rows_valid = min(Cfg::kBlockM, seq.sq - row0);

  const T* q = seq.q_rows(static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride, p.q_row_stride, h) +
               static_cast<int64_t>(row0) * p.q_row_stride;
  const T* k = seq.k_rows(static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride, p.k_row_stride, h_kv);
  const T* v = seq.k_rows(static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride, p.v_row_stride, h_kv);
  T* o = seq.q_rows(static_cast<T*>(p.o), p.o_batch_stride, p.o_head_stride, p.o_row_stride, h) +
         static_cast<int64_t>(row0) * p.o_row_stride;
  float* lse = p.softmax_lse + seq.stat_offset(p, h) + row0;

  // Key blocks some row of this block can see (core/mask.cuh): blocks entirely above the
  // diagonal, or left of a sliding window, are never loaded.
  const BlockRange range = BlockRange::keys_of(mask, row0, row0 + rows_valid, Cfg::kBlockN);
  const int n_begin = range.begin, n_end = range.end;
  auto load_kv = [&](int nb, int stage) {
    const int64_t key0 = static_cast<int64_t>(nb) * Cfg::kBlockN;
    load_tile_async<Cfg, Cfg::kBlockN>(sK + stage * Cfg::kBlockN * Cfg::kStride, k + key0 * p.k_row_stride,
                                       p.k_row_stride, seq.sk - static_cast<int>(key0), p.d);
    load_tile_async<Cfg, Cfg::kBlockN>(sV + stage * Cfg::kBlockN * Cfg::kStride, v + key0 * p.v_row_stride,
                                       p.v_row_stride, seq.sk - static_cast<int>(key0), p.d);
  };

  // Prologue: Q and the first K/V block.
  load_tile_async<Cfg, Cfg::kBlockM>(sQ, q, p.q_row_stride, rows_valid, p.d);
  if (n_begin < n_end) load_kv(n_begin, n_begin % Cfg::kStages);  // block n in ring slot n % 2
  cp_async_commit();

  float acc_o[Cfg::kMTiles][Cfg::kDTiles][4];
  float row_max[Cfg::kMTiles][2], row_sum[Cfg::kMTiles][2];
  start_online_softmax<Cfg>(acc_o, row_max, row_sum);

  const T* sQ_warp = sQ + warp * Cfg::kWarpRows * Cfg::kStride;
  const int warp_row0 = row0 + warp * Cfg::kWarpRows;  // within the sequence

  for (int nb = n_begin; nb < n_end; ++nb) {
    // Block nb has landed for every thread, and every warp has finished reading the
    // stage that the next copy overwrites.
    cp_async_wait<0>();
    __syncthreads();
    const int stage = nb % Cfg::kStages;
    if (nb + 1 < n_end) load_kv(nb + 1, stage ^ 1);
    cp_async_commit();

    const int key_base = nb * Cfg::kBlockN;
    // The per-element mask runs only where this warp's part of the block is not entirely
    // visible (the diagonal, a window edge, the end of the keys; rows past sq count as masked,
    // which only the last query block pays for).
    const bool needs_mask = mask.needs_mask(warp_row0, warp_row0 + Cfg::kWarpRows, key_base, key_base + Cfg::kBlockN);

    float s[Cfg::kMTiles][Cfg::kNTiles][4];
    float block_max[Cfg::kMTiles][2];
    compute_qk_scores_and_max<Cfg>(s, block_max, sQ_warp, sK + stage * Cfg::kBlockN * Cfg::kStride,
                                   needs_mask, warp_row0, key_base, mask, mod, p.scale_log2);
    merge_block_stats<Cfg>(row_max, row_sum, acc_o, block_max);
    compute_block_softmax_and_weighted_v<Cfg>(s, row_sum, acc_o, row_max,
                                              sV + stage * Cfg::kBlockN * Cfg::kStride, exp_scale);
  }
  cp_async_wait<0>();  // nothing may stay in flight into the Q tile we reuse below
  __syncthreads();     // (covers an empty key range, where Q's copy is still the last one)

  const int warp_rows_valid = min(Cfg::kWarpRows, rows_valid - warp * Cfg::kWarpRows);
  normalize_output<Cfg>(acc_o, row_sum, row_max, sQ + warp * Cfg::kWarpRows * Cfg::kStride,
                        o + static_cast<int64_t>(warp * Cfg::kWarpRows) * p.o_row_stride,
                        p.o_row_stride, lse + warp * Cfg::kWarpRows, warp_rows_valid, p.d);
}

}  // namespace fwd_mma

template <typename Cfg, int kVariant>
void launch_fwd_mma(const FwdParams& p, cudaStream_t stream) {
  auto kernel = fwd_mma::fwd_mma_kernel<Cfg, kVariant>;
  set_smem_limit(kernel, Cfg::kSmemBytes, "fwd_mma");
  const dim3 grid(ceil_div(p.sq, Cfg::kBlockM), p.hq, p.b);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  check_launch("fwd_mma");
}

template <int kDType, int kHeadDim, int kVariant>
void run_fwd_mma(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  using Cfg = fwd_mma::Config<T, kHeadDim>;
  using CompactCfg = fwd_mma::Config<T, kHeadDim, fwd_mma::CompactTraits<kHeadDim>>;
  if (device_smem_optin() >= Cfg::kSmemBytes) {
    launch_fwd_mma<Cfg, kVariant>(p, stream);
  } else {
    launch_fwd_mma<CompactCfg, kVariant>(p, stream);
  }
}

}  // namespace flash_cuda
