// tiers/simt/fwd_outer.cuh — the fp32 forward for head dims 97-128 on GPUs with >= 192 KiB of
// shared memory per block (H100/H200): the same algorithm and blocks as fwd.cuh, but both
// products are written as register *outer products* over transposed shared-memory operands.
//
// Why a second formulation. The products of fwd.cuh read float4s along the reduction
// dimension (4 consecutive head-dim columns of a Q row and of a K row). Inside such a step,
// component c of a Q float4 always meets component c of a K float4, and the registers of a
// float4 are 4 consecutive registers starting at a multiple of 4. The register file has two
// banks (even / odd register numbers); an FFMA whose three source registers are not all
// served by the operand-reuse cache can read at most one register per bank per cycle, so
// "Q.x * K.x + acc" costs an extra cycle whenever acc has the parity of x. No accumulator
// layout avoids it, because the parity of the operands flips every step. Nsight Compute shows
// the cost as "dispatch stall".
//
// Here the reduction index k is the *row* of both shared operands:
//   sQt[k][query]  (Q transposed, scaled by scale * log2 e)     sKt[k][key]  (K transposed)
// so one k step loads the thread's 8 query values (two float4 of consecutive queries) and its
// 4 key values (one float4) and does the 8x4 outer product acc[i][j] += q[i] * k[j]. The
// parity of q[i] depends only on i and that of k[j] only on j, so ptxas can place the 32
// accumulators in registers that never collide with the operand they meet, and the products
// are issued in "snake" order (row i even: j ascending, odd: descending) so that one operand
// is always in the reuse cache. PV is the same: sPt[key][query] (P transposed) times V[key][d].
// Dispatch stalls mostly disappear (OPTIMIZATION.md, "fp32 forward at D=128: outer products").
//
// Thread grid (256 threads = 16 row groups x 16 lanes; rg = t / 16, cg = t % 16):
//   query rows   4*rg + r + 64*h          r < 4, h < 2      (S, P, O rows: i = 4h + r)
//   key columns  4*cg + j                 j < 4             (S, P columns of the 64-key block)
//   O columns    4*cg + 64*h + e          e < 4, h < D/64
// Per k step a warp reads 2 distinct Q float4s (broadcast) and 16 consecutive K float4s:
// the minimum number of shared-memory wavefronts.
//
// K arrives row-major from global memory and cp.async cannot transpose, so K goes through a
// staging tile: thread t copies four 16-byte pieces that form a 4x4 block (4 keys x 4 head-dim
// columns), and once its own copies have landed (visible to itself without a barrier) reads
// that block back, transposes it in registers and writes 4 float4s into sKt. The staging slots
// are the thread's own, so the next block's copy can start right away. Q takes the same path
// once per CTA. Blocks are assigned so that each 8-lane phase of a warp writes 8 consecutive
// float4s of one sKt row (no bank conflict), and staging chunks are XOR-swizzled by the row
// quad so that the 8 lanes' reads of 8 different rows also hit distinct banks.
//
// Shared memory, floats (D = 128: 192 KiB):
//   sQt [D][128] | sKt [D][64] | sKs [64][D] staging | sV [64][D] | sPt [64][128]
//   | CtaFacts (kExtended)
// (Q's staging tile, [128][D], lives in sV + sPt during the prologue.)
//
// Pipeline per key block n (two barriers, like fwd.cuh):
//   barrier A  -> sKt holds K_n; every warp finished PV(n-1), so sV and sPt are free
//   start V_n copy;  S = Q K_n^T; merge stats; P = 2^(S - m); store P^T
//   wait (V_n, K_{n+1} copies); barrier B -> sPt, sV visible; every warp finished S(n)
//   transpose own K_{n+1} blocks into sKt; start K_{n+2} copy into the own staging slots
//   O += P V_n
//
// Three refinements (each measured in OPTIMIZATION.md, "fp32 forward at D=128"):
// - Causal diagonal half-blocks. With 128 query rows and 64-key blocks, the second key block
//   of a causal diagonal is invisible to rows 0-63; there each thread multiplies only its rows
//   4-7 (kLowBlind). The kPlain kernel is built twice (kCausal: a right side and no left side
//   to the mask, i.e. causal or a window open to the left; or not), so the other one carries no
//   half-block code; the causal one uses a shorter QK^T chunk and a one-sided per-element test
//   to stay within the instruction cache. Windows with both sides run the other build, packed
//   batches, softcap and ALiBi a third (kExtended, without half-blocks: any mask is still exact
//   through needs_mask).
// - A lagging reference max (merge_block_stats): a warp rescales O only when some row's max
//   grows by more than 2^16, and it tests that on each thread's own scores, so the 16-lane
//   max reductions run only on those rare blocks.
// - The last, partial wave is split (plan_tail_split, core/scheduler.cuh): its query blocks are
//   cut into key ranges, run as extra CTAs, and merged by combine_splits_kernel
//   (core/combine.cuh).
#pragma once

#include <type_traits>

#include "../../core/combine.cuh"
#include "fwd.cuh"

namespace flash_cuda {
namespace simt {
namespace outer {

template <int kHeadDim_>
struct OuterConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kRows = 128;  // queries per CTA
  static constexpr int kCols = 64;   // keys per block
  static constexpr int kThreads = 256;
  static constexpr int kG = 16;      // lanes per row group (one row's reductions are 16-wide)
  static constexpr int kTM = 8;      // query rows per thread
  static constexpr int kTN = 4;      // key columns per thread
  static constexpr int kTD = kHeadDim / 16;  // O columns per thread
  // Unrolled chunk lengths of the two products (k steps of QK^T, keys of PV): the larger chunk
  // halves the loop-carried prefetch boundaries. The causal kernel also carries the half-block
  // products of the diagonal (kLowBlind); with its QK^T chunk at 64 the code of its loops
  // outgrows the instruction cache, so it uses 32. The half-block loops use short chunks for the same reason.
  static constexpr int kChunkK = 64;
  static constexpr int kChunkKCausal = 32;
  static constexpr int kChunkC = 32;
  static constexpr int kChunkBlind = 16;

  static constexpr int kQt = kHeadDim * kRows;
  static constexpr int kKt = kHeadDim * kCols;
  static constexpr int kKs = kCols * kHeadDim;
  static constexpr int kV = kCols * kHeadDim;
  static constexpr int kPt = kCols * kRows;
  static constexpr size_t kSmemBytes = sizeof(float) * (kQt + kKt + kKs + kV + kPt);
  static constexpr size_t kSmemBytesExt = kSmemBytes + kFactsBytes;  // kExtended: + CtaFacts

  static_assert(kHeadDim == 64 || kHeadDim == 128, "O columns are 4*cg + 64*h");
  static_assert(kRows * kHeadDim <= kV + kPt, "Q's staging tile fits in sV + sPt");
  static_assert(kChunkC % 16 == 0 && kChunkBlind % 16 == 0,
                "sPt swizzle phase is constant per 16 keys");
};

// The 4x4-block assignment of a [kTileRows][kHeadDim] tile to threads (see the file comment).
// Block b = t + kThreads * p covers rows 4*rb .. 4*rb+3 and head-dim chunk db (columns
// 4*db .. 4*db+3), with rb % 8 = b % 8 and db = (b / 8) % (kHeadDim / 4): the 8 lanes of a
// phase take 8 consecutive row quads of one chunk, a warp 8 row quads x 4 chunks (64
// contiguous bytes of 8 rows per copy instruction).
template <int kTileRows, int kHeadDim, int kThreads>
struct QuadBlocks {
  static constexpr int kChunks = kHeadDim / 4;
  static constexpr int kBlocks = (kTileRows / 4) * kChunks;
  static_assert(kTileRows % 32 == 0 && kBlocks % kThreads == 0, "whole blocks per thread");
  static constexpr int kPerThread = kBlocks / kThreads;

  __device__ __forceinline__ static int row_quad(int t, int p) {
    const int b = t + kThreads * p;
    return (b / 8 / kChunks) * 8 + b % 8;
  }
  __device__ __forceinline__ static int chunk(int t, int p) { return (t + kThreads * p) / 8 % kChunks; }
  // Staging layout [kTileRows][kHeadDim]: chunk db of row r is stored at chunk db ^ (r/4 % 8).
  __device__ __forceinline__ static int staged(int row, int db) {
    return row * kHeadDim + 4 * (db ^ ((row >> 2) & 7));
  }
};

// Starts the copies of this thread's 4x4 blocks of a row-major global tile into staging.
// Rows >= rows_valid and columns >= d are zero-filled. With kWholeTiles, a whole tile (every
// row valid, d = kHeadDim: all but the last key block) takes a path without predicates: when
// the blocks of a thread all share its chunk and its swizzle (kThreads a multiple of 8
// kChunks, e.g. 256 threads at D = 128), its copies are one base address plus constant row
// steps (Nsight Compute: the generic path spent about 14 integer instructions per copy).
// The causal kernel does without: its code is near the instruction cache's size, and the
// longer copy loops cost it more than the saved integer work (OPTIMIZATION.md).
template <int kTileRows, int kHeadDim, int kThreads, bool kWholeTiles = false>
__device__ __forceinline__ void load_quad_blocks_async(float* stage, const float* gmem,
                                                       int64_t row_stride, int rows_valid, int d,
                                                       int tid) {
  using B = QuadBlocks<kTileRows, kHeadDim, kThreads>;
  constexpr int kRowQuadStep = kThreads / B::kChunks;  // row quads between a thread's blocks
  if constexpr (kWholeTiles && kThreads % (8 * B::kChunks) == 0 && kRowQuadStep % 8 == 0) {
    if (rows_valid >= kTileRows && d == kHeadDim) {
      const int rq = B::row_quad(tid, 0), db = B::chunk(tid, 0);
      const float* src = gmem + 4 * rq * row_stride + 4 * db;
      float* dst = stage + B::staged(4 * rq, db);  // same chunk swizzle for every block
#pragma unroll
      for (int p = 0; p < B::kPerThread; ++p) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          cp_async_16(dst + (4 * kRowQuadStep * p + e) * kHeadDim, src, true);
          src += row_stride;
        }
        src += (4 * kRowQuadStep - 4) * row_stride;
      }
      return;
    }
  }
#pragma unroll
  for (int p = 0; p < B::kPerThread; ++p) {
    const int rq = B::row_quad(tid, p), db = B::chunk(tid, p);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = 4 * rq + e;
      const bool valid = row < rows_valid && 4 * db < d;
      cp_async_16(stage + B::staged(row, db), valid ? gmem + row * row_stride + 4 * db : gmem,
                  valid);
    }
  }
}

// Reads back this thread's own (landed) blocks and writes them transposed, times `factor`:
// dst[column][row], rows of kTileRows floats.
template <int kTileRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void transpose_quad_blocks(float* dst, const float* stage, float factor,
                                                      int tid) {
  using B = QuadBlocks<kTileRows, kHeadDim, kThreads>;
#pragma unroll
  for (int p = 0; p < B::kPerThread; ++p) {
    const int rq = B::row_quad(tid, p), db = B::chunk(tid, p);
    float4 r[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) r[e] = lds4(stage + B::staged(4 * rq + e, db));
    float* out = dst + 4 * db * kTileRows + 4 * rq;
    *reinterpret_cast<float4*>(out) =
        make_float4(r[0].x * factor, r[1].x * factor, r[2].x * factor, r[3].x * factor);
    *reinterpret_cast<float4*>(out + kTileRows) =
        make_float4(r[0].y * factor, r[1].y * factor, r[2].y * factor, r[3].y * factor);
    *reinterpret_cast<float4*>(out + 2 * kTileRows) =
        make_float4(r[0].z * factor, r[1].z * factor, r[2].z * factor, r[3].z * factor);
    *reinterpret_cast<float4*>(out + 3 * kTileRows) =
        make_float4(r[0].w * factor, r[1].w * factor, r[2].w * factor, r[3].w * factor);
  }
}

// acc[i][j] += a[i] * b[j] for rows i >= kRow0, in snake order: consecutive FFMAs share a[i]
// (same row) or, at a row change, b[j], so one source register always comes from the
// operand-reuse cache.
template <int kM, int kN, int kRow0 = 0>
__device__ __forceinline__ void outer_product(float (&acc)[kM][kN], const float (&a)[kM],
                                              const float (&b)[kN]) {
#pragma unroll
  for (int i = kRow0; i < kM; ++i) {
#pragma unroll
    for (int jj = 0; jj < kN; ++jj) {
      const int j = i % 2 == 0 ? jj : kN - 1 - jj;
      acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }
}

template <int kN>
__device__ __forceinline__ void unpack4(float (&dst)[kN], int at, float4 x) {
  dst[at] = x.x;
  dst[at + 1] = x.y;
  dst[at + 2] = x.z;
  dst[at + 3] = x.w;
}

// Query row (within the CTA's block) of this thread's row i.
__device__ __forceinline__ int query_row(int rg, int i) { return 4 * rg + (i % 4) + 64 * (i / 4); }

// =================================================================================
// The four forward device functions
// =================================================================================

// S = Q K^T (log2 units: sQt holds Q * scale * log2 e) for this thread's 8 x 4 scores, masked
// entries -inf, and this thread's max of each of its rows over its 4 keys (the partial block
// max: merge_block_stats reduces it over the row group's 16 lanes only when it needs it).
// qt = sQt + 4*rg, kt = sKt + 4*cg. k runs in unrolled chunks of kChunk while k < d (rows of sQt/sKt
// past d are zero). The next step's three float4s (two per chunk boundary) are loaded before
// the current step's 32 FFMAs, across chunk boundaries too.
// kLowBlind: rows 0-63 of the block see none of these keys (a causal diagonal block), so only
// the thread's rows 4-7 are multiplied; the mask (always active on such a block: needs_mask
// holds) sets rows 0-3 to -inf.
// kExt: softcap / ALiBi on the scores (log2 units) before the mask, when the CTA's ScoreMod is
// active. (q0, k0): sequence indices of the block's query row 0 and key 0; mask_active:
// AttnMask::needs_mask of the block, mask_left: left_diagonal_in (see apply_mask).
template <typename Cfg, int kChunk, bool kLowBlind, bool kExt>
__device__ __forceinline__ void compute_qk_scores_and_max(
    float (&s)[Cfg::kTM][Cfg::kTN], float (&block_max)[Cfg::kTM], const float* qt,
    const float* kt, int d, bool mask_active, bool mask_left, const AttnMask& mask,
    const ScoreMod& mod, int q0, int k0, int rg, int cg) {
  constexpr int kRows = Cfg::kRows, kCols = Cfg::kCols;
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kTN; ++j) s[i][j] = 0.f;

  // The chain of each kScoreChain columns runs in `part`, then adds to s (fwd.cuh: the
  // same partition as every other fp32 score, so the backward recomputes these bits).
  static_assert(kScoreChain % kChunk == 0, "a chunk never straddles two partial chains");
  float part[Cfg::kTM][Cfg::kTN];
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kTN; ++j) part[i][j] = 0.f;

  // Two k steps per iteration, prefetching the next two.
  float4 qa[2], qb[2], kv[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    if (!kLowBlind) qa[u] = lds4(qt + u * kRows);
    qb[u] = lds4(qt + u * kRows + 64);
    kv[u] = lds4(kt + u * kCols);
  }
#pragma unroll 1
  for (int c0 = 0; c0 < d; c0 += kChunk) {
    const bool more = c0 + kChunk < d;
#pragma unroll
    for (int k = 0; k < kChunk; k += 2) {
      float4 nqa[2], nqb[2], nkv[2];
      if (k + 2 < kChunk || more) {
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (!kLowBlind) nqa[u] = lds4(qt + (k + 2 + u) * kRows);
          nqb[u] = lds4(qt + (k + 2 + u) * kRows + 64);
          nkv[u] = lds4(kt + (k + 2 + u) * kCols);
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float a[Cfg::kTM], b[Cfg::kTN];
        if (!kLowBlind) unpack4(a, 0, qa[u]);
        unpack4(a, 4, qb[u]);
        unpack4(b, 0, kv[u]);
        outer_product<Cfg::kTM, Cfg::kTN, kLowBlind ? 4 : 0>(part, a, b);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        if (!kLowBlind) qa[u] = nqa[u];
        qb[u] = nqb[u];
        kv[u] = nkv[u];
      }
    }
    if ((c0 + kChunk) % kScoreChain == 0 || !more) {
#pragma unroll
      for (int i = kLowBlind ? 4 : 0; i < Cfg::kTM; ++i)
#pragma unroll
        for (int j = 0; j < Cfg::kTN; ++j) {
          s[i][j] += part[i][j];
          part[i][j] = 0.f;
        }
    }
    qt += kChunk * kRows;
    kt += kChunk * kCols;
  }

  if constexpr (kExt) {
    const ScoreMod m = mod;  // read once (CtaFacts)
    if (m.active()) {
#pragma unroll
      for (int i = 0; i < Cfg::kTM; ++i)
#pragma unroll
        for (int j = 0; j < Cfg::kTN; ++j)
          s[i][j] = m.apply<true>(s[i][j], q0 + query_row(rg, i), k0 + 4 * cg + j);
    }
  }
  if (mask_active) {
    const AttnMask m = mask;  // read once (CtaFacts)
    auto apply = [&](auto two_sided) {  // as simt::apply_mask, in this kernel's layout
#pragma unroll
      for (int i = 0; i < Cfg::kTM; ++i) {
        const QueryKeys qk = QueryKeys::of(m, q0 + query_row(rg, i));
#pragma unroll
        for (int j = 0; j < Cfg::kTN; ++j) {
          const int k = k0 + 4 * cg + j;
          const bool hidden =
              decltype(two_sided)::value ? (k > qk.hi) | (k < qk.lo) : k > qk.hi;
          s[i][j] = hidden ? -INFINITY : s[i][j];
        }
      }
    };
    if (mask_left) {
      apply(std::true_type{});
    } else {
      apply(std::false_type{});
    }
  }
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) {
    block_max[i] = fmaxf(fmaxf(s[i][0], s[i][1]), fmaxf(s[i][2], s[i][3]));
  }
}

// m' = max(m, block max); l and O (relative to the old max) are rescaled by 2^(m - m').
// The reference max may lag: while no row's block max exceeds it by more than kMaxLag (log2
// units), a warp keeps its references and skips the rescale (8 x kTD FMULs and the exp2s;
// warp-uniform branch). P = 2^(S - m) is then at most 2^kMaxLag = 65536, harmless in fp32
// (l < sk * 2^16), and the result is unchanged: l and O share the same reference, and
// lse = m + log2 l. Without the lag nearly every one of a row's first few dozen key blocks
// raises some max of the warp (16 rows), so short rows (S ~ 1k) paid a rescale per block.
// block_max comes in as each thread's partial (its 4 keys). A row's 16 lanes are lanes of one
// warp, so "some lane's partial exceeds its reference + kMaxLag" over the warp is the same test
// as over the reduced block maxima; the 4-step shuffle reductions of the 8 rows (32 SHFL and
// their latency, every block) are left to the rare blocks that move a reference.
// A row with no visible key keeps m = -inf (-inf + kMaxLag = -inf, so any finite block max
// takes over) and alpha = 2^(-inf) = 0 via safe_max, as in the other tiers.
template <typename Cfg>
__device__ __forceinline__ void merge_block_stats(ThreadRowStats<Cfg::kTM>& stats,
                                                  float (&block_max)[Cfg::kTM],
                                                  float (&o)[Cfg::kTM][Cfg::kTD]) {
  constexpr float kMaxLag = 16.f;
  bool grew = false;
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) grew |= block_max[i] > stats.max[i] + kMaxLag;
  if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
    for (int i = 0; i < Cfg::kTM; ++i) block_max[i] = group_max<Cfg::kG>(block_max[i]);
    simt::merge_block_stats<Cfg>(stats, block_max, o);
  }
}

// P = 2^(S - m), l += row sums (exponentiate_rows), P^T -> sPt, then O += P V.
// sPt is [key][query]; key row c stores query chunk q4 at chunk q4 ^ ((c / 4) % 4), so the 8
// lanes of a store phase (8 consecutive key quads, one query chunk) hit different banks.
// pt_store = sPt + 4*cg*kRows + 4*(rg ^ (cg % 4)): this thread's 4 key rows, first chunk.
// `on_p_stored` waits for V, runs the barrier, and moves the next K block (see the kernel).
// kLowBlind: rows 0-3 of the thread have P = 0 here (see compute_qk_scores_and_max); their
// FFMAs are skipped.
template <typename Cfg, int kChunk, bool kLowBlind, typename OnPStored>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(
    float (&s)[Cfg::kTM][Cfg::kTN], ThreadRowStats<Cfg::kTM>& stats,
    float (&o)[Cfg::kTM][Cfg::kTD], const float* sV, const float* sPt, float* pt_store, int rg,
    int cg, OnPStored&& on_p_stored) {
  constexpr int kRows = Cfg::kRows, kD = Cfg::kHeadDim;
  exponentiate_rows(s, stats);
#pragma unroll
  for (int j = 0; j < Cfg::kTN; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<float4*>(pt_store + j * kRows + 64 * h) =
          make_float4(s[4 * h][j], s[4 * h + 1][j], s[4 * h + 2][j], s[4 * h + 3][j]);
    }
  }

  on_p_stored();

  // O[i][4h+e] += sum_c P[row i][c] * V[c][4cg + 64h + e], one key c per step, the next key's
  // float4s loaded before the current key's 8 x kTD FFMAs.
  const float* pt = sPt;
  const float* v = sV + 4 * cg;
  float4 pa, pb, vv[Cfg::kTD / 4];
  if (!kLowBlind) pa = lds4(pt + 4 * rg);
  pb = lds4(pt + 4 * rg + 64);
#pragma unroll
  for (int h = 0; h < Cfg::kTD / 4; ++h) vv[h] = lds4(v + 64 * h);
#pragma unroll 1
  for (int c0 = 0; c0 < Cfg::kCols; c0 += kChunk) {
    const bool more = c0 + kChunk < Cfg::kCols;
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      float4 npa, npb, nvv[Cfg::kTD / 4];
      if (c + 1 < kChunk || more) {
        const int q4 = rg ^ (((c + 1) >> 2) & 3);  // swizzled chunk of key c0 + c + 1
        if (!kLowBlind) npa = lds4(pt + (c + 1) * kRows + 4 * q4);
        npb = lds4(pt + (c + 1) * kRows + 4 * q4 + 64);
#pragma unroll
        for (int h = 0; h < Cfg::kTD / 4; ++h) nvv[h] = lds4(v + (c + 1) * kD + 64 * h);
      }
      float a[Cfg::kTM], b[Cfg::kTD];
      if (!kLowBlind) unpack4(a, 0, pa);
      unpack4(a, 4, pb);
#pragma unroll
      for (int h = 0; h < Cfg::kTD / 4; ++h) unpack4(b, 4 * h, vv[h]);
      outer_product<Cfg::kTM, Cfg::kTD, kLowBlind ? 4 : 0>(o, a, b);
      if (!kLowBlind) pa = npa;
      pb = npb;
#pragma unroll
      for (int h = 0; h < Cfg::kTD / 4; ++h) vv[h] = nvv[h];
    }
    pt += kChunk * kRows;
    v += kChunk * kD;
  }
}

// 1/x by the approximate reciprocal and one Newton step (about 1 ulp for normal x).
__device__ __forceinline__ float reciprocal(float x) {
  const float r = rcp_approx(x);
  return fmaf(fmaf(-x, r, 1.f), r, r);
}

// O /= l and the row statistics (store_row_stats) for the valid rows; a row that saw no key gets
// O = 0 and lse = -inf. Paid once per query block, so it is written to be short: the 16-lane sums of
// the thread's 8 rows are reduced together (their shuffles overlap instead of running as 8
// dependent chains), 1/l needs no division subroutine (l >= 1 once a key was seen: the row's
// max element contributes 2^(s - m) >= 1), and the stores follow without branches between
// rows (its cost matters at short sequences, where there are few key blocks per query block).
template <typename Cfg>
__device__ __forceinline__ void normalize_output(const float (&o)[Cfg::kTM][Cfg::kTD],
                                                 const ThreadRowStats<Cfg::kTM>& stats,
                                                 const QueryBlockOut& out, int rows_valid, int d,
                                                 int rg, int cg) {
  constexpr int kTM = Cfg::kTM;
  float l[kTM], inv_l[kTM];
#pragma unroll
  for (int i = 0; i < kTM; ++i) l[i] = stats.sum[i];
#pragma unroll
  for (int off = Cfg::kG / 2; off > 0; off /= 2) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) l[i] += __shfl_xor_sync(0xffffffffu, l[i], off);
  }
  // The head's sink (a uniform branch: one head per block), into the finished sums; l stays >= 1
  // once a key or the sink counts (the larger of the two contributes 2^0).
  float m[kTM];
#pragma unroll
  for (int i = 0; i < kTM; ++i) m[i] = stats.max[i];
  if (out.sink_log2 != -INFINITY) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) inv_l[i] = merge_sink(m[i], l[i], out.sink_log2);
  } else {
#pragma unroll
    for (int i = 0; i < kTM; ++i) inv_l[i] = 1.f;
  }
#pragma unroll
  for (int i = 0; i < kTM; ++i) inv_l[i] = l[i] == 0.f ? 0.f : inv_l[i] * reciprocal(l[i]);  // NaN stays

  float* rows = out.o + 4 * rg * out.o_row_stride + 4 * cg;  // row 4 rg, column 4 cg
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    if (query_row(rg, i) < rows_valid) {
      float* row = rows + (query_row(0, i) * out.o_row_stride);
#pragma unroll
      for (int h = 0; h < Cfg::kTD / 4; ++h) {
        if (4 * cg + 64 * h < d) {
          *reinterpret_cast<float4*>(row + 64 * h) =
              make_float4(o[i][4 * h] * inv_l[i], o[i][4 * h + 1] * inv_l[i],
                          o[i][4 * h + 2] * inv_l[i], o[i][4 * h + 3] * inv_l[i]);
        }
      }
    }
  }
  if (cg == 0) {
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      const int r = query_row(rg, i);
      if (r < rows_valid) store_row_stats(out.lse, out.stats, r, m[i], l[i]);
    }
  }
}

// =================================================================================
// Kernel and launcher
// =================================================================================

// CTA x < split_begin runs query block x over all its keys. The CTAs past it run pieces:
// query block split_begin + (x - split_begin) / num_splits, key range (x - split_begin) %
// num_splits, and leave O and (m, log2 l) of their range in o_accum / stats_accum for
// combine_splits_kernel (core/combine.cuh; see plan_tail_split).
// kCausal: launched for masks with a right side and no left side (causal_like), carries the
// diagonal half-blocks. kV: kPlain, or kExtended (packed batches, softcap, ALiBi; launched
// with kCausal = false for any mask).
template <typename Cfg, bool kCausal, Variant kV>
__global__ void __launch_bounds__(Cfg::kThreads, 1) flash_fwd_simt_outer_kernel(const FwdParams p) {
  constexpr int kD = Cfg::kHeadDim, kRows = Cfg::kRows, kCols = Cfg::kCols;
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kTD = Cfg::kTD, kThreads = Cfg::kThreads;
  constexpr bool kExt = kV != kPlain;
  constexpr bool kWholeTiles = !kCausal;  // see load_quad_blocks_async

  extern __shared__ float4 smem_f4[];
  float* sQt = reinterpret_cast<float*>(smem_f4);
  float* sKt = sQt + Cfg::kQt;
  float* sKs = sKt + Cfg::kKt;
  float* sV = sKs + Cfg::kKs;
  float* sPt = sV + Cfg::kV;
  float* sQs = sV;  // Q staging, prologue only
  CtaFacts* facts = reinterpret_cast<CtaFacts*>(sPt + Cfg::kPt);  // kExt only

  const int tid = static_cast<int>(threadIdx.x);
  const int rg = tid / Cfg::kG;
  const int cg = tid % Cfg::kG;

  int idx = static_cast<int>(blockIdx.x), piece = -1;
  if (idx >= p.split_begin) {
    piece = idx - p.split_begin;
    idx = p.split_begin + piece / p.num_splits;
  }
  const FwdQueryBlock blk = FwdQueryBlock::make<kRows, kCols, kExt>(p, idx);
  const int bi = blk.seq.bi, hi = blk.hi, m0 = blk.m0, rows_valid = blk.rows_valid;
  const float *q = blk.q, *k = blk.k, *v = blk.v;
  if constexpr (kExt) {
    if (!publish_block_facts(facts, blk, p, tid)) return;
  }
  // Key blocks [n_first, n_end) of this CTA. (kCausal: as in the loop below, the mask has no
  // left side, so the range starts at key block 0.)
  const BlockRange keys = kCausal ? BlockRange::keys_of(AttnMask{blk.mask.sq, blk.mask.sk, INT_MIN,
                                                                 blk.mask.diag_hi},
                                                        m0, m0 + kRows, kCols)
                                  : blk.keys;
  int n_first = keys.begin, n_end = keys.end;
  if (piece >= 0) {
    const int range = piece % p.num_splits;
    const int64_t count = keys.count();
    n_first = keys.begin + static_cast<int>(count * range / p.num_splits);
    n_end = keys.begin + static_cast<int>(count * (range + 1) / p.num_splits);
  }

  float o[kTM][kTD];
  ThreadRowStats<kTM> stats;
  start_online_softmax(o, stats);

  if (n_end > n_first) {
    // Prologue: Q and the first K block through staging, transposed (Q scaled); the second K
    // block starts at once.
    const int first0 = n_first * kCols;
    load_quad_blocks_async<kRows, kD, kThreads, kWholeTiles>(sQs, q, p.q_row_stride, rows_valid,
                                                             p.d, tid);
    cp_async_commit();
    load_quad_blocks_async<kCols, kD, kThreads, kWholeTiles>(sKs, k + first0 * p.k_row_stride,
                                                             p.k_row_stride, blk.seq.sk - first0,
                                                             p.d, tid);
    cp_async_commit();
    cp_async_wait<1>();  // Q landed (this thread's copies); K_0 may still be on its way
    transpose_quad_blocks<kRows, kD, kThreads>(sQt, sQs, p.scale_log2, tid);
    cp_async_wait<0>();
    transpose_quad_blocks<kCols, kD, kThreads>(sKt, sKs, 1.f, tid);
    if (n_first + 1 < n_end) {
      load_quad_blocks_async<kCols, kD, kThreads, kWholeTiles>(
          sKs, k + (first0 + kCols) * p.k_row_stride, p.k_row_stride, blk.seq.sk - first0 - kCols,
          p.d, tid);
    }
    cp_async_commit();

    const float* qt = sQt + 4 * rg;
    const float* kt = sKt + 4 * cg;
    float* pt_store = sPt + 4 * cg * kRows + 4 * (rg ^ (cg % 4));

    for (int n_block = n_first; n_block < n_end; ++n_block) {
      const int n0 = n_block * kCols;
      __syncthreads();  // A: sKt = K_n; sV, sPt (and, for n = 0, Q's staging) free
      AttnMask mask = cta_mask<kExt>(p, facts);
      // kCausal (causal_like): the mask has no left side; saying so lets the left-diagonal
      // terms fold away.
      if constexpr (kCausal) mask.diag_lo = INT_MIN;
      load_tile_async<kCols, kD, kD, kThreads>(sV, v + n0 * p.v_row_stride, p.v_row_stride,
                                               mask.sk - n0, p.d, tid);
      cp_async_commit();

      // Rows past sq are never written: the test need not count them.
      const int m1 = min(m0 + kRows, mask.sq);
      const bool mask_active = mask.needs_mask(m0, m1, n0, n0 + kCols);
      // kCausal: the mask has no left side (causal_like), so no block reaches past one.
      const bool mask_left = !kCausal && left_diagonal_in(mask, m1, n0);
      const bool has_next = n_block + 1 < n_end;
      // One key block, with the products over all 8 rows of each thread or (kLowBlind) only
      // over rows 64-127 of the query block.
      auto block_step = [&](auto low_blind) {
        constexpr bool kLowBlind = decltype(low_blind)::value;
        float s[kTM][kTN];
        float block_max[kTM];
        constexpr int kChunkQK = kLowBlind ? Cfg::kChunkBlind
                                 : kCausal ? Cfg::kChunkKCausal
                                           : Cfg::kChunkK;
        constexpr int kChunkPV = kLowBlind ? Cfg::kChunkBlind : Cfg::kChunkC;
        compute_qk_scores_and_max<Cfg, kChunkQK, kLowBlind, kExt>(
            s, block_max, qt, kt, p.d, mask_active, mask_left, kExt ? facts->mask : mask,
            facts->mod, m0, n0, rg, cg);
        merge_block_stats<Cfg>(stats, block_max, o);
        compute_block_softmax_and_weighted_v<Cfg, kChunkPV, kLowBlind>(
            s, stats, o, sV, sPt, pt_store, rg, cg, [&]() {
              cp_async_wait<0>();  // V_n and K_{n+1} landed
              __syncthreads();     // B: P^T and V_n visible; every warp is done with sKt
              if (has_next) {
                transpose_quad_blocks<kCols, kD, kThreads>(sKt, sKs, 1.f, tid);
                if (n_block + 2 < n_end) {
                  load_quad_blocks_async<kCols, kD, kThreads, kWholeTiles>(
                      sKs, k + (n0 + 2 * kCols) * p.k_row_stride, p.k_row_stride,
                      cta_mask<kExt>(p, facts).sk - n0 - 2 * kCols, p.d, tid);
                }
                cp_async_commit();
              }
            });
      };
      // Diagonal half-block: rows 0-63 of the query block see none of this block's keys, its
      // first key lies past the right diagonal of row 63 (causal with sq = sk: the second key
      // block of every diagonal). Rows past sq need not count.
      if constexpr (kCausal) {
        if (static_cast<int64_t>(n0) > static_cast<int64_t>(m0) + (kRows / 2 - 1) + mask.diag_hi) {
          block_step(std::true_type{});
        } else {
          block_step(std::false_type{});
        }
      } else {
        block_step(std::false_type{});
      }
    }
  }

  // (Qualified: QueryBlockOut's namespace brings simt::normalize_output in as well.)
  if (piece < 0) {
    outer::normalize_output<Cfg>(o, stats,
                                 QueryBlockOut::of_block(p, cta_seq<kExt>(p, facts, bi), hi, m0),
                                 rows_valid, p.d, rg, cg);
  } else {
    outer::normalize_output<Cfg>(o, stats, QueryBlockOut::of_piece<kRows>(p, piece), rows_valid,
                                 p.d, rg, cg);
  }
}

// The mask has a right side and no left side (causal, or a window open to the left): the
// outer kernel's kCausal build.
inline bool causal_like(const FwdParams& p) { return p.window_left < 0 && p.window_right >= 0; }

// ---------------------------------------------------------------------------------
// Splitting the last wave (host): plan_launch_split, in core/scheduler.cuh
// ---------------------------------------------------------------------------------
template <typename Cfg>
int64_t num_query_blocks(const FwdParams& p) {
  return static_cast<int64_t>(ceil_div(p.sq, Cfg::kRows)) * p.b * p.hq;
}

// The plan for this call, and the fp32 workspace floats it needs.
template <typename Cfg>
int64_t plan_fwd(FwdParams& p) {
  const int64_t pieces = plan_launch_split(p, flash_fwd_simt_outer_kernel<Cfg, false, kPlain>,
                                           Cfg::kThreads, Cfg::kSmemBytes, num_query_blocks<Cfg>(p),
                                           ceil_div(p.sk, Cfg::kCols), "flash_fwd_simt_outer");
  return pieces * Cfg::kRows * (p.d + 2);
}

template <typename Cfg>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  const char* name = "flash_fwd_simt_outer";
  const int64_t num_blocks = num_query_blocks<Cfg>(params);
  const bool split = params.num_splits > 1 && params.split_begin < num_blocks;
  if (split && (params.o_accum == nullptr || !split_allowed(params))) {
    throw std::runtime_error(std::string("flash_cuda: kernel ") + name +
                             ": split key ranges need a workspace, no mask, no softcap or ALiBi "
                             "and a dense batch");
  }
  const int64_t grid =
      split ? params.split_begin + (num_blocks - params.split_begin) * params.num_splits
            : num_blocks;
  if (grid <= 0 || grid > 0x7fffffffLL) {
    throw std::runtime_error(std::string("flash_cuda: kernel ") + name + ": grid of " +
                             std::to_string(grid) + " blocks is out of range");
  }
  FwdParams p = params;
  if (split) {
    p.stats_accum = p.o_accum + (num_blocks - p.split_begin) * p.num_splits * Cfg::kRows * p.d;
  } else {
    p.split_begin = INT_MAX;
    p.num_splits = 1;
  }
  const bool ext = variant_of(p, false) != kPlain;
  auto kernel = ext               ? flash_fwd_simt_outer_kernel<Cfg, false, kExtended>
                : causal_like(p) ? flash_fwd_simt_outer_kernel<Cfg, true, kPlain>
                                  : flash_fwd_simt_outer_kernel<Cfg, false, kPlain>;
  const size_t smem = ext ? Cfg::kSmemBytesExt : Cfg::kSmemBytes;
  set_smem_limit(kernel, smem, name);
  kernel<<<static_cast<unsigned>(grid), Cfg::kThreads, smem, stream>>>(p);
  check_launch(name);
  if (split) launch_combine_splits<float, Cfg::kRows>(p, num_blocks - p.split_begin, stream);
}

}  // namespace outer
}  // namespace simt

// fp32 forward entry points for one head-dim bucket: the outer-product kernel where the
// traits ask for it and the device has its shared memory, else the largest TileConfig that fits.
namespace simt {
// Whether the call runs the outer-product kernel: where the traits ask for it and the device has
// its shared memory; calls with dropout run fwd.cuh's kernel (the outer one has no dropout step).
template <int kHeadDim>
bool uses_outer_fwd(const FwdParams& params) {
  if constexpr (SimtFwdTraits<kHeadDim>::kOuter) {
    return outer::OuterConfig<kHeadDim>::kSmemBytes <= device_smem_optin() && !has_dropout(params);
  }
  return false;
}
}  // namespace simt

template <int kHeadDim>
int64_t plan_fwd_simt(FwdParams& params) {
  params.split_begin = INT_MAX;
  params.num_splits = 1;
  if constexpr (simt::SimtFwdTraits<kHeadDim>::kOuter) {
    if (simt::uses_outer_fwd<kHeadDim>(params)) return simt::outer::plan_fwd<simt::outer::OuterConfig<kHeadDim>>(params);
  }
  return 0;
}

template <int kHeadDim>
void run_fwd_simt(const FwdParams& params, cudaStream_t stream) {
  using Traits = simt::SimtFwdTraits<kHeadDim>;
  simt::check_simt_args(params, kHeadDim, "flash_fwd_simt");
  if constexpr (Traits::kOuter) {
    if (simt::uses_outer_fwd<kHeadDim>(params)) {
      simt::outer::launch_fwd<simt::outer::OuterConfig<kHeadDim>>(params, stream);
      return;
    }
  }
  if (params.num_splits > 1) {
    throw std::runtime_error("flash_cuda: kernel flash_fwd_simt: split key ranges are not served");
  }
  if (simt::fwd_smem_bytes<typename Traits::Config>() <= device_smem_optin()) {
    simt::launch_fwd<typename Traits::Config>(params, stream);
  } else {
    simt::launch_fwd<typename Traits::CompactConfig>(params, stream);
  }
}

}  // namespace flash_cuda
