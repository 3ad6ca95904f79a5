// tiers/simt/fwd.cuh — the fp32 tier of flash_cuda: FlashAttention forward on CUDA cores.
//
// Every multiply-add here is a true fp32 FFMA (no TF32, no tensor cores). The kernel is
// organised like a register-blocked SGEMM with an online softmax between its two products:
//
//   for each key/value block n of the (batch, kv head) that the query block can see:
//     S   = Q K_n^T * scale * log2(e)         compute_qk_scores_and_max   (product 1, "NT")
//           then softcap / ALiBi (when on) and the mask, both from core/mask.cuh
//     m'  = max(m, rowmax S); O *= 2^(m-m')    merge_block_stats
//     P   = 2^(S - m');  l += rowsum P;        compute_block_softmax_and_weighted_v
//           then dropout (kExtended, when on: P times the keep mask and 1 / keep rate)
//     O  += P V_n                                                        (product 2, "NN")
//   O /= l;  lse = (m + log2 l) * ln 2         normalize_output
// m and l of a thread's rows are a ThreadRowStats (core/softmax.cuh).
//
// File layout, top-down:
//   1. TileConfig — the tile shapes and the thread grid, and SimtFwdTraits per head dim.
//   2. Building blocks shared with the backward (bwd.cuh includes this file):
//      tile loaders (16-byte cp.async with zero fill), the two register-blocked shared-memory
//      products gemm_nt / gemm_nn, the mask and score modifiers (AttnMask / ScoreMod of
//      core/mask.cuh applied to a thread's score tile), the tile store, the query block a CTA
//      owns (its order in the grid: core/scheduler.cuh).
//   3. The four forward device functions.
//   4. The kernel and its launcher helpers (run_fwd_simt<kHeadDim>, which also chooses the
//      outer-product kernel of fwd_outer.cuh for D=128, is defined in that file).
//
// Masks, modifiers, packed batches. A CTA's sequence (dense or varlen) is a SeqInfo
// (core/seqlen.cuh), its visibility rule an AttnMask: the key blocks it visits are
// BlockRange::keys_of (a sliding window also skips the blocks left of it), and only the blocks
// for which AttnMask::needs_mask holds pay for the per-element test. Every kernel is built per
// Variant (include/params.h): kPlain (dense, no modifier) reads the sequence and its mask from
// the kernel parameters and carries no code for softcap / ALiBi; kExtended (packed batches,
// ALiBi, softcap) keeps its per-CTA values in shared memory (CtaFacts).
//
// Thread grid (used by every fp32 kernel). A CTA owns kRows rows of one "row operand" (the
// query block here) and streams blocks of kCols rows of the other operand (keys / values).
// Its kThreads threads form a kRowGroups x kG grid: thread t has
//     rg = t / kG  (row group)        cg = t % kG  (column group)
// and owns
//     rows            rg + kRowGroups * i        i < kTM    (of Q, S, P, O)
//     score columns   cg + kG * j                j < kTN    (of S, P: key index in the block)
//     output columns  4*cg + 4*kG*h + e          h < kTD/4, e < 4   (of O: float4 chunks)
// The kG threads of a row group are kG consecutive lanes of one warp, so row reductions
// (max, sum) are kG-wide shuffles (group_max / group_sum) and need no shared memory.
// Worked example, the shape <D = 128, kRows 128, kCols 64, kTM 8, kG 16> (-> kRowGroups 16,
// kThreads 256, kTN 4, kTD 8): thread 37 has rg = 2, cg = 5 and owns query rows
// 2, 18, 34, ..., 114 (2 + 16 i), key columns 5, 21, 37, 53 (5 + 16 j) of each 64-key block,
// and output columns 20..23 and 84..87 (4*5 + 64 h + e). Every (row, key) and (row, column)
// pair of the block belongs to exactly one thread: 16 x 8 rows, 16 x 4 keys, 16 x 8 columns.
//
// Why these index patterns (bank-conflict reasoning, 32 banks of 4 bytes):
//   * Rows are strided by kRowGroups, so the 32/kG row groups of a warp read *consecutive*
//     rows of Q (or P). With a row pitch = 4 (mod 32) floats (Q) or = kG (mod 32) (P), those
//     rows start in different banks, and their float4 reads at the same column do not collide.
//   * Score columns are strided by kG, so the kG lanes of a row group read kG consecutive
//     K rows; with K's row pitch = 4 (mod 32), 8 consecutive rows cover all 32 banks: one
//     128-byte wavefront per 8 distinct float4 addresses, the minimum possible.
//   * Output columns are float4 chunks 4*cg: the kG lanes of a row group read one contiguous
//     run of V (kG * 16 bytes) — conflict-free without padding, and coalesced in global memory.
//
// Shared-memory reads are float4 (LDS.128). Per 4-wide k step a thread issues kTM + kTN
// LDS.128 and 4 * kTM * kTN FFMA (product 1), or kTM + kTD LDS.128 and 4 * kTM * kTD FFMA
// (product 2): with the tile sizes below, more than 90% of the inner-loop instructions are FFMA.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "../../arch/host.h"
#include "../../arch/sm80.cuh"
#include "../../core/block.cuh"
#include "../../core/dropout.cuh"
#include "../../core/mask.cuh"
#include "../../core/scheduler.cuh"
#include "../../core/seqlen.cuh"
#include "../../core/softmax.cuh"
#include "../../include/params.h"
#include "../../include/tiles.h"

namespace flash_cuda {
namespace simt {

// =================================================================================
// 1. Tile configuration
// =================================================================================

// A tile shape (include/tiles.h, tiles::SimtShape): kHeadDim, the head-dim bucket (a multiple
// of 32); kRows, rows a CTA owns; kCols, rows of the streamed operand per step (keys per block
// in the forward); kTM, rows per thread; kG, threads per row group (a power of two <= 32);
// kMinBlocksPerSm, the __launch_bounds__ hint. TileConfig adds the thread grid and the
// shared-memory layout that follow from it.
template <typename Shape>
struct TileConfig : Shape {
  static constexpr int kRowGroups = Shape::kRows / Shape::kTM;
  static constexpr int kThreads = kRowGroups * Shape::kG;
  static constexpr int kTN = Shape::kCols / Shape::kG;     // score columns per thread
  static constexpr int kTD = Shape::kHeadDim / Shape::kG;  // output columns per thread (float4s)

  // Shared-memory row pitches, in floats (all multiples of 4: every row starts 16-byte aligned).
  //  kPitch     : tiles read along the head dim (Q, K, and in the backward Q, dO, K, V): +4
  //               floats so that consecutive rows start 4 banks apart.
  //  kScorePitch: score tiles (P, dS), [kRows][kCols]: padded to = kG (mod 32) floats so that
  //               (a) the 32/kG rows a warp reads at once start in different banks and (b) the
  //               scalar stores of a warp (32/kG rows x kG consecutive columns) hit 32 different
  //               banks. (kCols = 64, kG = 16: 80 floats; rows r and r+1 start 16 banks apart.)
  static constexpr int kPitch = Shape::kHeadDim + 4;
  static constexpr int kScorePitch = Shape::kCols + (Shape::kG - Shape::kCols % 32 + 32) % 32;

  static_assert(Shape::kHeadDim % 32 == 0, "head-dim buckets are multiples of 32");
  static_assert(Shape::kG >= 1 && Shape::kG <= 32 && (Shape::kG & (Shape::kG - 1)) == 0,
                "a row group is a power-of-two group of lanes");
  static_assert(Shape::kRows % Shape::kTM == 0 && Shape::kCols % Shape::kG == 0,
                "tile must split evenly over the thread grid");
  static_assert(Shape::kHeadDim % (4 * Shape::kG) == 0,
                "output columns are whole float4 chunks per thread");
  static_assert(Shape::kCols % 16 == 0 && Shape::kCols <= kThreads,
                "streamed blocks of 16, 32, 48, ... rows");
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
};

// Forward tiles per head-dim bucket (rows = queries, cols = keys). `Config` is tuned for
// H100/H200 (up to 227 KB of shared memory per CTA):
//   D=32 : 128 queries x 64 keys, 128 threads, thread tile S 8x8, O 8x4   (71 KB smem)
//   D=64 : 128 queries x 64 keys, 128 threads, thread tile S 8x8, O 8x8   (103 KB: 2 CTAs/SM)
//   D=256:  64 queries x 64 keys, 256 threads, thread tile S 4x4, O 4x16  (214 KB: 1 CTA/SM)
//   D=128: kOuter — the outer-product kernel of fwd_outer.cuh (128 queries x 64 keys,
//          256 threads, S 8x4, O 8x8, transposed operands, 192 KB), faster than this file's
//          kernel with 128 x 64 tiles (171 KB), so `Config` is the compact one.
// Each thread keeps S (kTM x kTN) and O (kTM x kTD) in registers: up to ~250 of them, which is
// why the CTAs are small (8 warps per SM) and the products are register-blocked.
// `CompactConfig` fits the 99 KB per CTA of sm_86 / sm_89 (and is what sm_80's 163 KB gets for
// D >= 128); the launcher picks `Config` whenever the device can give it its shared memory:
//   D=32 : same as Config;  D=64: 128 x 32 keys (72 KB);  D=128: 64 x 32 keys, 256 threads
//   (79 KB);  D=256: 32 x 16 keys, 256 threads (69 KB).
template <int kHeadDim>
struct SimtFwdTraits {
  using Table = tiles::SimtFwd<kHeadDim>;  // include/tiles.h
  using Config = TileConfig<typename Table::Config>;
  using CompactConfig = TileConfig<typename Table::Compact>;
  static constexpr bool kOuter = Table::kOuter;
};

// =================================================================================
// 2. Building blocks (also used by bwd.cuh)
// =================================================================================

__device__ __forceinline__ float4 lds4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}

// Issues 16-byte cp.async copies of a kTileRows x kHeadDim fp32 tile. Global row r of the tile
// is gmem + r * row_stride; shared row r is smem + r * kPitch. Rows >= rows_valid and columns
// >= d are zero-filled instead of read (d % 4 == 0, so a float4 chunk is either fully inside
// or fully outside the row). Thread t copies chunk (t % kChunksPerRow) of rows
// t / kChunksPerRow + kRowsPerPass * pass: consecutive threads take consecutive 16-byte chunks
// of a row, so a warp reads whole contiguous rows (or 512 contiguous bytes of one row when
// kHeadDim >= 128). The source pointer just advances by kRowsPerPass rows per pass: two 64-bit
// values of per-thread state, whatever the number of passes.
template <int kTileRows, int kHeadDim, int kPitch, int kThreads>
__device__ __forceinline__ void load_tile_async(float* smem, const float* gmem, int64_t row_stride,
                                                int rows_valid, int d, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 4;
  static_assert(kThreads % kChunksPerRow == 0, "a pass covers whole rows");
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(kTileRows % kRowsPerPass == 0, "whole passes");
  const int row = tid / kChunksPerRow;
  const int col = (tid % kChunksPerRow) * 4;
  const bool col_ok = col < d;
  const float* src = gmem + row * row_stride + col;
  float* dst = smem + row * kPitch + col;
#pragma unroll
  for (int pass = 0; pass < kTileRows / kRowsPerPass; ++pass) {
    const bool valid = col_ok && row + pass * kRowsPerPass < rows_valid;
    // When not valid, src-size 0 reads nothing: pass the (mapped) tile base.
    cp_async_16(dst + pass * kRowsPerPass * kPitch, valid ? src : gmem, valid);
    src += kRowsPerPass * row_stride;
  }
}

// load_tile_async of kTileRows rows of Q, K, V or dO into a [kTileRows][kPitch] tile of Cfg.
template <typename Cfg, int kTileRows>
__device__ __forceinline__ void load_rows_async(float* smem, const float* gmem, int64_t row_stride,
                                                int rows_valid, int d, int tid) {
  load_tile_async<kTileRows, Cfg::kHeadDim, Cfg::kPitch, Cfg::kThreads>(smem, gmem, row_stride,
                                                                        rows_valid, d, tid);
}

// Multiplies, in place, the chunks of a tile that this thread copied with the load_tile_async
// call of the same shape (same chunk mapping). Valid right after cp_async_wait: a thread's own
// copies are complete and visible to itself; a __syncthreads() then publishes the result.
// Used to fold scale * log2(e) into the operand that is used only for S (Q in the forward).
template <int kTileRows, int kHeadDim, int kPitch, int kThreads>
__device__ __forceinline__ void scale_own_chunks(float* smem, float factor, int tid) {
  constexpr int kChunksPerRow = kHeadDim / 4;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  float* dst = smem + (tid / kChunksPerRow) * kPitch + (tid % kChunksPerRow) * 4;
#pragma unroll
  for (int pass = 0; pass < kTileRows / kRowsPerPass; ++pass) {
    float4* p4 = reinterpret_cast<float4*>(dst + pass * kRowsPerPass * kPitch);
    float4 x = *p4;
    x.x *= factor;
    x.y *= factor;
    x.z *= factor;
    x.w *= factor;
    *p4 = x;
  }
}

// The head-dim reduction of a score (Q K^T, and dO V^T in the backward) is summed as partial
// chains of at most kScoreChain columns, added in order. Why: a sequential fp32 chain's rounding
// error grows with the length of the chain times the size of its partial sums; at D >= 128 with
// large logits (scale 1, |s| ~ sqrt(D)) the chain's error is the dominant error of P, hence of
// O, dQ and dK. Two chains of 64 instead of one of 128 halve it (OPTIMIZATION.md, "fp32
// precision") for kTM * kTN extra registers. The forward and the backward use the same partition,
// so the recomputed scores stay bitwise equal to the forward's.
constexpr int kScoreChain = 64;

// Inner-loop unrolling of the two products below: a chunk of the reduction dimension is fully
// unrolled (all shared-memory offsets become compile-time immediates of one base register per
// operand) and holds about 1024 FFMA: long enough to hide shared-memory latency, short enough
// (~17 KB of code) to stay friendly to the instruction cache. Returns the chunk length (a power
// of two dividing `total`) for `fma_per_step` FFMA per reduction index.
__host__ __device__ constexpr int unroll_chunk(int total, int fma_per_step) {
  return total < 1024 / fma_per_step ? total : (1024 / fma_per_step < 8 ? 8 : 1024 / fma_per_step);
}

// Product 1, "NT": acc[i][j] += sum_k A[row i][k] * B[col j][k], both operands row-major
// along k (Q K^T: both Q and K are stored [row][head dim]).
//   a: this thread's first A row (sA + rg * A's pitch); its row i is a + i * kStrideA
//   b: this thread's first B row (sB + cg * B's pitch); its column j is b + j * kStrideB
// k runs over [0, kK) in unrolled chunks, stopping after the chunk that contains k_end: the
// columns past the real head dim d are zero in shared memory, so skipping them is exact.
// Reductions longer than kScoreChain run as partial chains of kScoreChain columns, each in
// its own accumulator, added to acc in order (see kScoreChain).
template <int kTM, int kTN, int kStrideA, int kStrideB, int kK>
__device__ __forceinline__ void gemm_nt(float (&acc)[kTM][kTN], const float* a, const float* b,
                                        int k_end) {
  constexpr int kSeg = kK < kScoreChain ? kK : kScoreChain;
  constexpr int kChunk = unroll_chunk(kK, kTM * kTN) < kSeg ? unroll_chunk(kK, kTM * kTN) : kSeg;
  static_assert(kK % kSeg == 0 && kSeg % kChunk == 0 && kChunk % 4 == 0, "k chunking");
  auto chunk = [&](float (&c)[kTM][kTN]) {
#pragma unroll
    for (int k = 0; k < kChunk; k += 4) {
      float4 av[kTM], bv[kTN];
#pragma unroll
      for (int i = 0; i < kTM; ++i) av[i] = lds4(a + i * kStrideA + k);
#pragma unroll
      for (int j = 0; j < kTN; ++j) bv[j] = lds4(b + j * kStrideB + k);
#pragma unroll
      for (int i = 0; i < kTM; ++i) {
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
          float x = c[i][j];
          x = fmaf(av[i].x, bv[j].x, x);
          x = fmaf(av[i].y, bv[j].y, x);
          x = fmaf(av[i].z, bv[j].z, x);
          x = fmaf(av[i].w, bv[j].w, x);
          c[i][j] = x;
        }
      }
    }
    a += kChunk;
    b += kChunk;
  };
  if constexpr (kSeg == kK) {
#pragma unroll 1
    for (int k0 = 0; k0 < k_end; k0 += kChunk) chunk(acc);
  } else {
#pragma unroll 1
    for (int k0 = 0; k0 < k_end; k0 += kSeg) {
      float part[kTM][kTN];
#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) part[i][j] = 0.f;
#pragma unroll 1
      for (int kc = 0; kc < kSeg && k0 + kc < k_end; kc += kChunk) chunk(part);
#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) acc[i][j] += part[i][j];
    }
  }
}

// Product 2, "NN": acc[i][4h + e] += sum_{c < kC} A[row i][c] * B[c][col(h) + e], with A a
// score tile [row][c] and B a tile [c][head dim] (P V, and in the backward P^T dO, dS^T Q, dS K).
//   a: this thread's first A row (sA + rg * A's pitch); its row i is a + i * kStrideA
//   b: this thread's first B column (sB + 4 * cg); row c, chunk h is b + c * kPitchB + h * 4 * kG
// One float4 of A gives 4 consecutive c for one row; for each of those c the thread reads its
// kTD / 4 float4 chunks of B's row c (all lanes of the warp read the same row c: contiguous).
template <int kTM, int kTD, int kStrideA, int kPitchB, int kChunkStrideB, int kC>
__device__ __forceinline__ void gemm_nn(float (&acc)[kTM][kTD], const float* a, const float* b) {
  constexpr int kChunk = unroll_chunk(kC, kTM * kTD);  // c values per unrolled chunk
  static_assert(kC % kChunk == 0 && kChunk % 4 == 0, "c chunking");
#pragma unroll 1
  for (int c0 = 0; c0 < kC; c0 += kChunk) {
#pragma unroll
    for (int c = 0; c < kChunk; c += 4) {
      float4 av[kTM];
#pragma unroll
      for (int i = 0; i < kTM; ++i) av[i] = lds4(a + i * kStrideA + c);
#pragma unroll
      for (int cc = 0; cc < 4; ++cc) {
        float4 bv[kTD / 4];
#pragma unroll
        for (int h = 0; h < kTD / 4; ++h) bv[h] = lds4(b + (c + cc) * kPitchB + h * kChunkStrideB);
#pragma unroll
        for (int i = 0; i < kTM; ++i) {
          const float w = cc == 0 ? av[i].x : cc == 1 ? av[i].y : cc == 2 ? av[i].z : av[i].w;
#pragma unroll
          for (int h = 0; h < kTD / 4; ++h) {
            acc[i][4 * h + 0] = fmaf(w, bv[h].x, acc[i][4 * h + 0]);
            acc[i][4 * h + 1] = fmaf(w, bv[h].y, acc[i][4 * h + 1]);
            acc[i][4 * h + 2] = fmaf(w, bv[h].z, acc[i][4 * h + 2]);
            acc[i][4 * h + 3] = fmaf(w, bv[h].w, acc[i][4 * h + 3]);
          }
        }
      }
    }
    a += kChunk;
    b += kChunk * kPitchB;
  }
}

// A score tile of this thread, S = A B^T over the head dim (gemm_nt; the same partial chains
// in every kernel, so that the backward's recomputed scores are the forward's bits): rows of A
// are the CTA's rows (a_row0 = sA + rg * kPitch), rows of B its streamed block's
// (b_row0 = sB + cg * kPitch). Q K^T in log2 units when the Q tile holds Q * scale * log2 e;
// likewise K Q^T, and dO V^T or V dO^T in the backward.
template <typename Cfg>
__device__ __forceinline__ void score_tile(float (&s)[Cfg::kTM][Cfg::kTN], const float* a_row0,
                                           const float* b_row0, int d) {
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kTN; ++j) s[i][j] = 0.f;
  gemm_nt<Cfg::kTM, Cfg::kTN, Cfg::kRowGroups * Cfg::kPitch, Cfg::kG * Cfg::kPitch,
          Cfg::kHeadDim>(s, a_row0, b_row0, d);
}

// AttnMask::visible(i, j) for the keys j of one query i, as the inclusive range [lo, hi]:
// i + diag_lo <= j <= min(i + diag_hi, sk - 1). Per element that is one compare (hi) or two
// (lo too, only for blocks that reach past a left diagonal, see left_diagonal_in): a causal
// block costs what the causal test cost before. Queries past sq are not tested: their Q / dO
// rows, lse and delta are zero-filled and their results never written. 32-bit arithmetic:
// i >= 0 and diag_lo <= sk, so neither i + diag_lo nor i + min(diag_hi, sk) overflows.
struct QueryKeys {
  int lo, hi;
  __device__ __forceinline__ static QueryKeys of(const AttnMask& m, int i) {
    return {i + m.diag_lo, min(i + min(m.diag_hi, m.sk), m.sk - 1)};
  }
};

// The left-diagonal term of AttnMask::needs_mask for the tile of queries [r0, r1) x keys
// [c0, c1): some query's window starts after key c0. Warp-uniform (block indices only).
__device__ __forceinline__ bool left_diagonal_in(const AttnMask& m, int r1, int c0) {
  return c0 - (r1 - 1) < m.diag_lo;
}

// Sets the scores of the pairs AttnMask hides (core/mask.cuh) to -inf. kRowsAreQueries: the
// score tile is [query][key] (forward, dQ) or, when false, [key][query] (dK/dV kernel, which
// works on S^T). row0 / col0: sequence indices of this thread's element (0, 0); its element
// (i, j) is (row0 + i * kRowStep, col0 + j * kColStep). Called only for the blocks where
// AttnMask::needs_mask holds (those that straddle a diagonal of the window or pass the end of
// the keys): the common, entirely visible block pays nothing. `left`: left_diagonal_in for the
// block. `mask_ref` may live in shared memory (CtaFacts): it is read once, here.
template <bool kRowsAreQueries, int kTM, int kTN, int kRowStep, int kColStep>
__device__ __forceinline__ void apply_mask(float (&s)[kTM][kTN], const AttnMask& mask_ref,
                                           int row0, int col0, bool left) {
  const AttnMask mask = mask_ref;
  constexpr int kQueries = kRowsAreQueries ? kTM : kTN;
  QueryKeys keys[kQueries];  // this thread's queries
#pragma unroll
  for (int u = 0; u < kQueries; ++u) {
    keys[u] = QueryKeys::of(mask, kRowsAreQueries ? row0 + u * kRowStep : col0 + u * kColStep);
  }
  auto apply = [&](auto two_sided) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        const QueryKeys& qk = keys[kRowsAreQueries ? i : j];
        const int k = kRowsAreQueries ? col0 + j * kColStep : row0 + i * kRowStep;
        const bool hidden = decltype(two_sided)::value ? (k > qk.hi) | (k < qk.lo) : k > qk.hi;
        s[i][j] = hidden ? -INFINITY : s[i][j];
      }
    }
  };
  if (left) {
    apply(std::true_type{});
  } else {
    apply(std::false_type{});
  }
}

// Softcap and ALiBi on every score of a tile that holds log2 units of the scaled logit
// (x = scale * q.k * log2 e): x -> ScoreMod::apply(x, query, key). Same index layout as
// apply_mask, and applied before it (a masked score must end at -inf, which softcap would
// turn into -C). kPrecise: the libm tanhf, since this tier is compared with references that
// compute the logits in fp32. Only kExtended kernels call it, for blocks of a (batch, head)
// whose ScoreMod is active (a warp-uniform branch).
template <bool kRowsAreQueries, int kTM, int kTN, int kRowStep, int kColStep>
__device__ __forceinline__ void apply_score_mod(float (&s)[kTM][kTN], const ScoreMod& mod_ref,
                                                int row0, int col0) {
  const ScoreMod mod = mod_ref;  // read once (CtaFacts)
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
#pragma unroll
    for (int j = 0; j < kTN; ++j) {
      const int row = row0 + i * kRowStep;
      const int col = col0 + j * kColStep;
      const int q = kRowsAreQueries ? row : col;
      const int k = kRowsAreQueries ? col : row;
      s[i][j] = mod.apply<true>(s[i][j], q, k);
    }
  }
}

// Writes this thread's part of a [kRows][kHeadDim] accumulator tile, row i scaled by
// factor[i]: rows < rows_valid and columns < d only (columns >= d are never written).
// g is the global address of the tile's row 0; float4 stores need 16-byte aligned rows.
template <typename Cfg>
__device__ __forceinline__ void store_row_tile(float* g, int64_t row_stride, int rows_valid, int d,
                                               const float (&acc)[Cfg::kTM][Cfg::kTD],
                                               const float (&factor)[Cfg::kTM], int rg, int cg) {
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) {
    const int r = rg + i * Cfg::kRowGroups;
    if (r < rows_valid) {
#pragma unroll
      for (int h = 0; h < Cfg::kTD / 4; ++h) {
        const int col = 4 * cg + h * 4 * Cfg::kG;
        if (col < d) {
          const float f = factor[i];
          *reinterpret_cast<float4*>(g + r * row_stride + col) =
              make_float4(acc[i][4 * h] * f, acc[i][4 * h + 1] * f, acc[i][4 * h + 2] * f,
                          acc[i][4 * h + 3] * f);
        }
      }
    }
  }
}

// What a forward CTA needs to know about its query block: its sequence (SeqInfo: batch entry,
// lengths, rows in packed tensors), the mask, the query head, the first row m0, the valid rows,
// the tile pointers and the key blocks of kCols it must visit, keys.begin .. keys.end - 1
// (BlockRange::keys_of: the keys that at least one valid row of the block sees).
// kExt (a kExtended kernel) reads packed sequences; rows_valid <= 0 then means the block starts
// past its sequence's end (the grid is sized by max_seqlen_q) and has nothing to do.
// Example (causal): sq = 3, sk = 5 (offset 2), one block: keys [0, 5), all; row 0 sees keys
// 0..2 and the mask hides 3, 4. With sq = 5, sk = 3 (offset -2), rows 0 and 1 see nothing
// (i - 2 < 0): they end with l = 0 -> O = 0, lse = -inf. A sliding window of left size 64 on
// sq = sk = 1024 with 64-key blocks: query block [512, 640) sees keys [448, 640), blocks 7..9.
struct FwdQueryBlock {
  SeqInfo seq;
  AttnMask mask;
  int hi, m0, rows_valid;
  BlockRange keys;
  const float *q, *k, *v;  // Q at row m0; K and V at row 0 of the kv head (GQA: hi / group)

  template <int kRows, int kCols, bool kExt>
  __device__ __forceinline__ static FwdQueryBlock make(const FwdParams& p,
                                                       int idx = static_cast<int>(blockIdx.x)) {
    FwdQueryBlock b;
    int m_block, bh;
    query_block_order(idx, ceil_div(p.sq, kRows), p.b * p.hq, longest_first(p), m_block, bh);
    const int bi = bh / p.hq;
    b.hi = bh - bi * p.hq;
    const int hk = b.hi / (p.hq / p.hkv);
    b.seq = SeqInfo::make<kExt>(p, bi);
    b.mask = b.seq.template mask<kExt>(p);
    b.m0 = m_block * kRows;
    b.rows_valid = b.seq.sq - b.m0;
    b.q = b.seq.q_rows(static_cast<const float*>(p.q), p.q_batch_stride, p.q_head_stride,
                       p.q_row_stride, b.hi) +
          b.m0 * p.q_row_stride;
    b.k = b.seq.k_rows(static_cast<const float*>(p.k), p.k_batch_stride, p.k_head_stride,
                       p.k_row_stride, hk);
    b.v = b.seq.k_rows(static_cast<const float*>(p.v), p.v_batch_stride, p.v_head_stride,
                       p.v_row_stride, hk);
    b.keys = BlockRange::keys_of(b.mask, b.m0, b.m0 + kRows, kCols);
    return b;
  }
};

// What a kExtended CTA knows about its sequence, in shared memory. The kernels of this tier run
// at up to 255 registers per thread, nearly all of them accumulators. A kPlain kernel finds its
// sequence's lengths and mask in the kernel parameters (constant memory: no register held
// across the loop). A kExtended kernel's values differ per CTA (packed lengths and row offsets
// come from cu_seqlens, the ALiBi slope from memory) but a loop needs them once per block at
// most (the mask test, the few masked blocks, the modifiers, the next tile's bounds, the row
// offsets of the epilogue). Held in registers across the loop they pushed the tightest kernels
// into spills; here thread 0 writes them once (publish_facts: one more barrier per CTA) and
// every use re-reads them after a barrier, where the compiler cannot keep them in registers.
struct CtaFacts {
  SeqInfo seq;
  AttnMask mask;
  ScoreMod mod;  // the CTA's query head (the dK/dV kernel makes one per step instead)
};
// Bytes appended to a kExtended kernel's shared memory for its CtaFacts (a multiple of 16: the
// tiles before it keep their 16-byte alignment). Every config of this tier has kilobytes of
// margin to the shared-memory sizes the launchers choose by, so the choice ignores them.
constexpr size_t kFactsBytes = (sizeof(CtaFacts) + 15) / 16 * 16;

// Thread 0 stores `f`, and a barrier publishes it: every thread may read *dst from here on.
__device__ __forceinline__ void publish_facts(CtaFacts* dst, const CtaFacts& f, int tid) {
  if (tid == 0) *dst = f;
  __syncthreads();
}

// The start of a kExtended query block's CTA (forward, dQ): it publishes its facts, or has
// nothing to compute or write when its block starts past its sequence's end (false: uniform,
// before any barrier). (A kPlain kernel has no facts and no such block, and does not call it.)
__device__ __forceinline__ bool publish_block_facts(CtaFacts* facts, const FwdQueryBlock& blk,
                                                    const FwdParams& p, int tid) {
  if (blk.rows_valid <= 0) return false;
  publish_facts(facts, CtaFacts{blk.seq, blk.mask, blk.seq.score_mod(p, blk.hi)}, tid);
  return true;
}

// The CTA's sequence and mask at a point of use: kPlain rebuilds them from the parameters (dense
// batch, mask from params.diag_lo / diag_hi, all constant memory), kExtended reads its CtaFacts.
template <bool kExt>
__device__ __forceinline__ SeqInfo cta_seq(const FwdParams& p, const CtaFacts* f, int bi) {
  if constexpr (kExt) {
    return f->seq;
  } else {
    return SeqInfo::make<false>(p, bi);
  }
}
template <bool kExt>
__device__ __forceinline__ AttnMask cta_mask(const FwdParams& p, const CtaFacts* f) {
  if constexpr (kExt) {
    return f->mask;
  } else {
    return SeqInfo::make<false>(p, 0).mask<false>(p);
  }
}

// Where a query block's results go: its O rows (o, o_row_stride apart) and the row statistics
// of store_row_stats (lse and the (m, log2 l) pairs; nullptr: not written). A whole block writes
// the outputs of its (batch, query head) (of_block); a split piece its own rows of the fp32
// workspace, O and the pairs, which core/combine.cuh merges (of_piece: o_accum
// [piece][kRows][d], stats_accum [piece][kRows][2]). sink_log2: the head's attention sink in
// log2 units (merge_sink), -inf for none; a piece leaves it to the merge of the pieces.
struct QueryBlockOut {
  float* o;
  int64_t o_row_stride;
  float* lse;
  float* stats;
  float sink_log2;

  __device__ __forceinline__ static QueryBlockOut of_block(const FwdParams& p, const SeqInfo& seq,
                                                           int hi, int m0) {
    float* o = seq.q_rows(static_cast<float*>(p.o), p.o_batch_stride, p.o_head_stride,
                          p.o_row_stride, hi) +
               m0 * p.o_row_stride;
    const int64_t stat0 = seq.stat_offset(p, hi) + m0;
    return {o, p.o_row_stride, p.softmax_lse + stat0, stats_tile(p.softmax_stats, stat0), sink_log2_of(p.sinks, hi)};
  }
  template <int kRows>
  __device__ __forceinline__ static QueryBlockOut of_piece(const FwdParams& p, int piece) {
    return {p.o_accum + static_cast<int64_t>(piece) * kRows * p.d, p.d, nullptr,
            p.stats_accum + static_cast<int64_t>(piece) * kRows * 2, -INFINITY};
  }
};

// =================================================================================
// 3. The forward, as four device functions
// =================================================================================

// S = Q K^T * scale * log2(e) for this thread's kTM x kTN scores, modified (kExt: softcap,
// ALiBi when the CTA's ScoreMod is active), masked entries -inf, and the row max of the whole
// block (reduced over the kG threads of the row group).
// The shared Q tile already holds Q * scale * log2(e) (scaled once, when loaded), so S comes
// out of the product in log2 units, the units ScoreMod::apply takes; the max is taken on
// scaled (and modified) scores, right for either sign of the scale.
// sQ_row0 = sQ + rg * kPitch, sK_col0 = sK + cg * kPitch; (row0, col0) = sequence indices of
// this thread's score (0, 0); mask_active = AttnMask::needs_mask for the block, mask_left =
// left_diagonal_in.
template <typename Cfg, bool kExt>
__device__ __forceinline__ void compute_qk_scores_and_max(
    float (&s)[Cfg::kTM][Cfg::kTN], float (&block_max)[Cfg::kTM], const float* sQ_row0,
    const float* sK_col0, int d, bool mask_active, bool mask_left, const AttnMask& mask,
    const ScoreMod& mod, int row0, int col0) {
  score_tile<Cfg>(s, sQ_row0, sK_col0, d);

  if constexpr (kExt) {
    if (mod.active()) {
      apply_score_mod<true, Cfg::kTM, Cfg::kTN, Cfg::kRowGroups, Cfg::kG>(s, mod, row0, col0);
    }
  }
  if (mask_active) {
    apply_mask<true, Cfg::kTM, Cfg::kTN, Cfg::kRowGroups, Cfg::kG>(s, mask, row0, col0, mask_left);
  }

#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) {
    float mx = s[i][0];
#pragma unroll
    for (int j = 1; j < Cfg::kTN; ++j) mx = fmaxf(mx, s[i][j]);
    block_max[i] = group_max<Cfg::kG>(mx);
  }
}

// Online-softmax bookkeeping: the running max m becomes max(m, block max), exactly; the running
// sum l and the output accumulator o, both relative to the old max, are rescaled by
// alpha = 2^(m_old - m_new). m is in log2 units of the scaled scores.
// A row with no visible key so far keeps m = -inf; safe_max turns it into 0 in the exponent, so
// alpha = 2^(-inf) = 0 (o and l are 0 anyway) and nothing becomes NaN.
// l here is this thread's partial row sum (over its own kTN columns); the kG partials of a row
// are added only once, in normalize_output, which is exact because alpha is the same for all.
template <typename Cfg>
__device__ __forceinline__ void merge_block_stats(ThreadRowStats<Cfg::kTM>& stats,
                                                  const float (&block_max)[Cfg::kTM],
                                                  float (&o)[Cfg::kTM][Cfg::kTD]) {
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) {
    const float m_new = fmaxf(stats.max[i], block_max[i]);
    const float alpha = ex2_approx(stats.max[i] - safe_max(m_new));
    stats.max[i] = m_new;
    stats.sum[i] *= alpha;
#pragma unroll
    for (int c = 0; c < Cfg::kTD; ++c) o[i][c] *= alpha;
  }
}

// P = 2^(S - m) (masked scores give 2^-inf = 0), l += row sums of P (exponentiate_rows), then
// O += P V. P goes through shared memory (sP, [kRows][kScorePitch]) because product 2 needs,
// for each of this thread's rows, the whole P row, computed by the kG threads of its row group.
// `on_own_p(p_row0)` runs once this thread has stored its P elements, before the barrier
// (dropout: each own element times its keep factor, in shared memory, where the P registers are
// already free; l stays the sum before it). `on_p_stored` runs right after the barrier that
// publishes P: it waits for V and may start the next K load (every warp is then done with this
// block's K).
template <typename Cfg, typename OnOwnP, typename OnPStored>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(
    float (&s)[Cfg::kTM][Cfg::kTN], ThreadRowStats<Cfg::kTM>& stats,
    float (&o)[Cfg::kTM][Cfg::kTD], const float* sV, float* sP, int rg, int cg,
    OnOwnP&& on_own_p, OnPStored&& on_p_stored) {
  exponentiate_rows(s, stats);

  // Thread (rg, cg) stores P[rg + kRowGroups*i][cg + kG*j]: in sP the key index of the block
  // is the column, so product 2 reads P rows in key order and V rows with the same index.
  float* p_row0 = sP + rg * Cfg::kScorePitch + cg;
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kTN; ++j)
      p_row0[i * Cfg::kRowGroups * Cfg::kScorePitch + j * Cfg::kG] = s[i][j];
  on_own_p(p_row0);

  on_p_stored();  // includes __syncthreads(): sP complete and V_n landed

  gemm_nn<Cfg::kTM, Cfg::kTD, Cfg::kRowGroups * Cfg::kScorePitch, Cfg::kHeadDim, 4 * Cfg::kG,
          Cfg::kCols>(o, sP + rg * Cfg::kScorePitch, sV + 4 * cg);
}

// O /= l and the row statistics (store_row_stats), written for the rows < sq of the block.
// A row that saw no key has l = 0: output 0 and lse = -inf (no NaN).
template <typename Cfg>
__device__ __forceinline__ void normalize_output(const float (&o)[Cfg::kTM][Cfg::kTD],
                                                 const ThreadRowStats<Cfg::kTM>& stats,
                                                 const QueryBlockOut& out, int rows_valid, int d,
                                                 int rg, int cg) {
  float inv_l[Cfg::kTM];
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) {
    float l = group_sum<Cfg::kG>(stats.sum[i]);
    float m = stats.max[i];
    float o_scale = 1.f;
    if (out.sink_log2 != -INFINITY) o_scale = merge_sink(m, l, out.sink_log2);  // uniform: one head
    inv_l[i] = l == 0.f ? 0.f : o_scale / l;  // l == 0: no key seen (and no sink); a NaN l stays NaN
    const int r = rg + i * Cfg::kRowGroups;
    if (cg == 0 && r < rows_valid) store_row_stats(out.lse, out.stats, r, m, l);
  }
  store_row_tile<Cfg>(out.o, out.o_row_stride, rows_valid, d, o, inv_l, rg, cg);
}

// =================================================================================
// 4. Kernel and launcher
// =================================================================================

// One CTA = kRows query rows of one (batch, query head).
// Shared memory: sQ [kRows][kPitch] | sK [kCols][kPitch] | sV [kCols][kHeadDim]
//                | sP [kRows][kScorePitch] | CtaFacts (kExtended)
// (V is read one whole row at a time, so it needs no padding.)
//
// Pipeline (single K and V buffers, two barriers per key block n, n from keys.begin on):
//   prologue: start Q, K_first copies; wait, scale own Q chunks by scale * log2 e
//   top:   wait K_n, barrier
//              -> K_n (and Q) visible; every warp finished block n-1, so V and sP are free
//          start V_n copy                               (overlaps S = Q K_n^T)
//          S = Q K_n^T, merge stats, P = 2^(S - m), store P
//          wait V_n, barrier  -> P and V_n visible; every warp finished reading K_n
//          start K_{n+1} copy                           (overlaps O += P V_n)
//          O += P V_n
template <typename Cfg, Variant kV>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    flash_fwd_simt_kernel(const FwdParams p) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kTD = Cfg::kTD;
  constexpr int kRows = Cfg::kRows, kCols = Cfg::kCols, kD = Cfg::kHeadDim;
  constexpr bool kExt = kV != kPlain;

  extern __shared__ float4 smem_f4[];
  float* sQ = reinterpret_cast<float*>(smem_f4);
  float* sK = sQ + kRows * Cfg::kPitch;
  float* sV = sK + kCols * Cfg::kPitch;
  float* sP = sV + kCols * kD;
  CtaFacts* facts = reinterpret_cast<CtaFacts*>(sP + kRows * Cfg::kScorePitch);  // kExt only

  const int tid = static_cast<int>(threadIdx.x);
  const int rg = tid / Cfg::kG;
  const int cg = tid % Cfg::kG;

  const FwdQueryBlock blk = FwdQueryBlock::make<kRows, kCols, kExt>(p);
  const int bi = blk.seq.bi, hi = blk.hi, m0 = blk.m0, rows_valid = blk.rows_valid;
  const int n_begin = blk.keys.begin, n_end = blk.keys.end;
  const float *q = blk.q, *k = blk.k, *v = blk.v;
  if constexpr (kExt) {
    if (has_dropout(p)) dropout_record(p.dropout);  // before any return
    if (!publish_block_facts(facts, blk, p, tid)) return;
  }

  float o[kTM][kTD];
  ThreadRowStats<kTM> stats;
  start_online_softmax(o, stats);

  if (n_end > n_begin) {
    const int first0 = n_begin * kCols;
    load_rows_async<Cfg, kRows>(sQ, q, p.q_row_stride, rows_valid, p.d, tid);
    load_rows_async<Cfg, kCols>(sK, k + first0 * p.k_row_stride, p.k_row_stride,
                                blk.seq.sk - first0, p.d, tid);
    cp_async_commit();
    cp_async_wait<0>();  // Q (and K_first) landed: scale this thread's own Q chunks
    scale_own_chunks<kRows, kD, Cfg::kPitch, Cfg::kThreads>(sQ, p.scale_log2, tid);

    const float* sQ_row0 = sQ + rg * Cfg::kPitch;
    const float* sK_col0 = sK + cg * Cfg::kPitch;

    for (int n_block = n_begin; n_block < n_end; ++n_block) {
      const int n0 = n_block * kCols;

      cp_async_wait<0>();  // K_n landed
      __syncthreads();
      const AttnMask mask = cta_mask<kExt>(p, facts);
      load_tile_async<kCols, kD, kD, Cfg::kThreads>(sV, v + n0 * p.v_row_stride, p.v_row_stride,
                                                    mask.sk - n0, p.d, tid);
      cp_async_commit();

      // Per-element masking only where the block passes the end of the keys or a diagonal of
      // the window (causal: its last key is beyond the first row's diagonal). Rows past sq are
      // never written: the test need not count them.
      const int m1 = min(m0 + kRows, mask.sq);
      const bool mask_active = mask.needs_mask(m0, m1, n0, n0 + kCols);
      const bool mask_left = left_diagonal_in(mask, m1, n0);

      float s[kTM][kTN];
      float block_max[kTM];
      // (kExt: the mask is read again where it is applied, after the product, rather than held.)
      compute_qk_scores_and_max<Cfg, kExt>(s, block_max, sQ_row0, sK_col0, p.d, mask_active,
                                           mask_left, kExt ? facts->mask : mask, facts->mod,
                                           m0 + rg, n0 + cg);
      merge_block_stats<Cfg>(stats, block_max, o);

      const bool has_next = n_block + 1 < n_end;
      // Dropout (kExt): this thread's P elements, in shared memory, times their keep factors,
      // one draw each in a loop that is not unrolled (the key is read here, not held in
      // registers across the loop).
      auto on_own_p = [&](float* p_row0) {
        if constexpr (kExt) {
          if (has_dropout(p)) {
            const DropoutKey drop = dropout_key(p.dropout);
            const uint32_t head_slot = bi * p.hq + hi;
#pragma unroll 1
            for (int e = 0; e < kTM * kTN; ++e) {
              const int i = e / kTN, j = e % kTN;
              float& x = p_row0[i * Cfg::kRowGroups * Cfg::kScorePitch + j * Cfg::kG];
              x = dropout_keeps_element(drop, head_slot, m0 + rg + Cfg::kRowGroups * i, n0 + cg + Cfg::kG * j)
                      ? x * p.dropout.scale
                      : 0.f;
            }
          }
        }
      };
      compute_block_softmax_and_weighted_v<Cfg>(s, stats, o, sV, sP, rg, cg, on_own_p, [&]() {
        cp_async_wait<0>();  // V_n landed
        __syncthreads();
        if (has_next) {
          load_rows_async<Cfg, kCols>(sK, k + (n0 + kCols) * p.k_row_stride, p.k_row_stride,
                                      cta_mask<kExt>(p, facts).sk - n0 - kCols, p.d, tid);
        }
        cp_async_commit();
      });
    }
  }

  normalize_output<Cfg>(o, stats, QueryBlockOut::of_block(p, cta_seq<kExt>(p, facts, bi), hi, m0),
                        rows_valid, p.d, rg, cg);
}

// kExt: a kExtended kernel, which appends its CtaFacts.
template <typename Cfg>
constexpr size_t fwd_smem_bytes(bool ext = false) {
  return sizeof(float) * (static_cast<size_t>(Cfg::kRows) * Cfg::kPitch +
                          static_cast<size_t>(Cfg::kCols) * Cfg::kPitch +
                          static_cast<size_t>(Cfg::kCols) * Cfg::kHeadDim +
                          static_cast<size_t>(Cfg::kRows) * Cfg::kScorePitch) +
         (ext ? kFactsBytes : 0);
}

// Every head dim has a configuration that fits a 99 KiB block (the consumer cards); the launcher
// takes `Config` wherever the device gives it more.
template <int kHeadDim>
constexpr bool kSimtFwdFits = fwd_smem_bytes<typename SimtFwdTraits<kHeadDim>::CompactConfig>(true) <=
                              kSmemConsumer;
static_assert(kSimtFwdFits<32> && kSimtFwdFits<64> && kSimtFwdFits<128> && kSimtFwdFits<256>,
              "an fp32 forward configuration fits every GPU class");

// Checks shared by the fp32 launchers.
inline void check_simt_args(const FwdParams& p, int head_dim_bucket, const char* name) {
  if (p.d <= 0 || p.d > head_dim_bucket || p.d % 8 != 0 || p.sq < 1 || p.sk < 1 || p.b < 1 ||
      p.hq < 1 || p.hkv < 1 || p.hq % p.hkv != 0) {
    throw std::runtime_error(std::string("flash_cuda: kernel ") + name +
                             ": unsupported sizes (d=" + std::to_string(p.d) + ", bucket " +
                             std::to_string(head_dim_bucket) + ")");
  }
}

// Launches one SIMT kernel over a 1-D grid: ceil(seq / rows_per_cta) CTAs for each
// (batch, head), with `smem` bytes of dynamic shared memory.
template <typename Params, typename Kernel>
inline void launch_simt(Kernel kernel, const Params& params, int threads, size_t smem, int seq,
                        int rows_per_cta, int heads, const char* name, cudaStream_t stream) {
  const int64_t blocks = static_cast<int64_t>(ceil_div(seq, rows_per_cta)) * params.b * heads;
  if (blocks <= 0 || blocks > 0x7fffffffLL) {
    throw std::runtime_error(std::string("flash_cuda: kernel ") + name + ": grid of " +
                             std::to_string(blocks) + " blocks is out of range");
  }
  set_smem_limit(kernel, smem, name);
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(params);
  check_launch(name);
}

// The grid is sized by params.sq (max_seqlen_q for varlen). Packed batches, softcap and ALiBi
// get the kExtended kernel; every other call the kPlain one.
template <typename Cfg>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  if (variant_of(params, false) == kPlain) {
    launch_simt(flash_fwd_simt_kernel<Cfg, kPlain>, params, Cfg::kThreads, fwd_smem_bytes<Cfg>(),
                params.sq, Cfg::kRows, params.hq, "flash_fwd_simt", stream);
  } else {
    launch_simt(flash_fwd_simt_kernel<Cfg, kExtended>, params, Cfg::kThreads,
                fwd_smem_bytes<Cfg>(true), params.sq, Cfg::kRows, params.hq, "flash_fwd_simt",
                stream);
  }
}

}  // namespace simt

// run_fwd_simt (the entry point) is defined in fwd_outer.cuh, which includes this file.

}  // namespace flash_cuda
