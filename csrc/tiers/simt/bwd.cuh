// tiers/simt/bwd.cuh — the fp32 tier of flash_cuda: FlashAttention-2 backward on CUDA cores.
//
// True fp32 FFMA arithmetic throughout (no TF32, no tensor cores). With P = softmax(scale*QK^T)
// recomputed from the forward's row statistics (m, log2 l) (params.softmax_stats; lse itself
// would carry the rounding of m + log2 l, see store_row_stats in core/softmax.cuh):
//   P  = 2^((Q K^T * scale * log2 e - m) - log2 l)
//   dV = P^T dO        dP = dO V^T        dS = P * (dP - delta)
//   dK = scale * dS^T Q                    dQ = scale * dS K
// where delta_i = rowsum(dO_i * O_i) - dlse_i comes from bwd_preprocess.cuh.
//
// run_bwd_simt<kHeadDim> has two paths, chosen by params.deterministic. A call that wants only
// dQ, or only dK / dV (include/params.h: bwd_wants_dq / _dkdv), runs kernels 1 and 3, or 1 and
// 2, of the deterministic path, whatever params.deterministic says.
//
// deterministic = true: three kernels, bitwise reproducible (no atomics, every gradient element
// is written exactly once by one thread):
//   1. bwd_preprocess_delta_kernel<float>                       delta
//   2. flash_bwd_dkdv_simt_kernel<Cfg, false>: a CTA owns a block of keys of one (batch, kv
//      head). It keeps its K and V tiles in shared memory and dK, dV in registers, loops over the
//      query heads of its GQA group and over the query blocks that can see its keys, and writes
//      dK, dV once.
//   3. flash_bwd_dq_simt_kernel: a CTA owns a block of query rows of one (batch, query head),
//      keeps Q and dO in shared memory and dQ in registers, loops over the key blocks the rows
//      can see (recomputing P and dP), and writes dQ once.
//   Kernel 3 recomputes two of the products of kernel 2 (S and dP): 7 matrix products per
//   (key block, query block) pair. That is the price of writing dQ without atomics.
//
// deterministic = false (the default): two kernels, 5 products per pair:
//   1. bwd_preprocess_delta_kernel<float>                       delta
//   2. flash_bwd_dkdv_simt_kernel<Cfg, true>: kernel 2 above plus, at every step, the partial
//      dQ of the step's query block over this CTA's keys, scale * dS K, from the dS^T and K
//      tiles the CTA already holds in shared memory, added into params.dq with float atomics
//      (red.global.add.f32; the 4-wide vector form on sm_90). params.dq must be zero-filled
//      before the launch (the binding does it); no dQ kernel runs.
//   dK and dV are still written once per element by one thread (reproducible), but each dQ
//   element is the sum of up to ceil(sk / kRows) atomic contributions (one per CTA, i.e. per
//   key block the row sees) in an order that depends on scheduling, and fp32 addition is not
//   associative: dQ is not bitwise reproducible run to run (it differs in the last bits).
//
// Both kernels reuse the thread grid, loaders and register-blocked products of fwd.cuh
// (read that file first): "rows" are the operand a CTA owns (keys in kernel 2, queries in
// kernel 3), "cols" the operand it streams. Masks, packed batches, the Variants and the
// per-CTA facts in shared memory (CtaFacts) work as in the forward: the dK/dV kernel visits the
// query blocks BlockRange::queries_of its keys, the dQ kernel the key blocks BlockRange::keys_of
// its rows, and only the tiles AttnMask::needs_mask picks pay for the per-element test.
//
// Softcap and ALiBi (kExtended kernels): with x the score in log2 units of the scaled logit and
// x' = ScoreMod::apply(x),
//   P = 2^((x' - m) - log2 l)        dS = P * (dP - delta) * dtanh(x)
// (dtanh = d x' / d x = 1 - tanh^2(x / C), 1 without softcap); dK and dQ keep their `scale`.
// These kernels keep P * dtanh(x) in the registers that hold P (the dK/dV kernel stores P^T
// for dV right away), so softcap's derivative costs no tile of registers here: kSoftcapGrad
// calls run the kExtended kernels.
#pragma once

#include "../../core/bwd_preprocess.cuh"
#include "family.h"
#include "fwd.cuh"

namespace flash_cuda {
namespace simt {

// =================================================================================
// Tile configurations
// =================================================================================
//
// dK/dV kernel (rows = keys, cols = queries). Registers hold dK and dV (2 * kTM * kTD), the
// P tile and the dP tile (kTM * kTN each). Shared memory holds K, V, two query-side buffers
// (Q or dO, each with a row vector: the (m, log2 l) pairs or delta) and the P^T, dS^T tiles:
//   D=32 : 64 keys x 64 queries, 128 threads, thread tiles 4x8 (scores) / 4x4 (dK, dV)  (73 KB)
//   D=64 : 64 keys x 64 queries, 128 threads, thread tiles 4x8 / 4x8      (105 KB: 2 CTAs/SM)
//   D=128: 64 keys x 64 queries, 256 threads, thread tiles 4x4 / 4x8      (173 KB)
//   D=256: 64 keys x 32 queries, 256 threads, thread tiles 4x2 / 4x16     (219 KB)
//
// dQ kernel (rows = queries, cols = keys). Registers hold dQ (kTM * kTD), P and dP.
// Shared memory holds Q, dO, two key-side buffers (K or V) and the dS tile:
//   D=32 : 64 queries x 64 keys, 128 threads, thread tiles 4x8 / 4x4      (54 KB)
//   D=64 : 64 queries x 64 keys, 128 threads, thread tiles 4x8 / 4x8      (86 KB: 2 CTAs/SM)
//   D=128: 128 queries x 32 keys, 256 threads, thread tiles 4x4 / 4x16    (185 KB)
//   D=256: 64 queries x 32 keys, 256 threads, thread tiles 4x2 / 4x16     (207 KB)
//
// dK/dV kernel with atomic dQ (deterministic = false): AtomicDkdvConfig and
// CompactAtomicDkdvConfig. The same tiles as the deterministic kernel (D=256 Compact: same
// tile, another register bound), for these reasons:
//   * Shared memory: none extra. The dQ product (P5 in the kernel) reads the sdS (dS^T) and sK
//     tiles the kernel already holds (K just stays unscaled), so whatever fits the
//     deterministic kernel fits this one, and the Compact tiles are already the largest key
//     blocks that fit in 99 KB.
//   * Registers: P5 accumulates kCols * D / kThreads floats per thread (16 or 32 for every
//     config here), live only after P2, when the S and dP tiles (2 * kTM * kTN) are dead.
//     ptxas fits every config without spilling (simt_bwd in tests/test_nvcc_build.py).
//   * Atomic traffic: a step does 5 * 2 * kRows * kCols * D flops and adds kCols * D floats
//     into dq: 1 float (4 bytes) per 10 * kRows flops, whatever kCols and D. With 64-key
//     blocks that is 4 bytes per 640 flops: even at the forward's 43 TFLOPS (63% of an
//     H200's FFMA peak) under 270 GB/s of red.global.add into the L2, small next to its
//     bandwidth (several TB/s). Doubling the key block would halve that but cost
//     2 * kRows * D / kThreads more registers of dK and dV: not worth it at fp32 FFMA rates.
//     The Compact tiles have 16 to 64 keys, so up to 4x the traffic per flop (D=256: 16
//     keys); that matters most where FFMA is fast but shared memory small (sm_89), and
//     there red has no vector form (4 scalar adds per float4).
//   * Contention: the CTAs of one (batch, kv head) walk the query blocks in the same order,
//     so every resident CTA may add into the same kCols x D block of dq at about the same
//     time: at most one add per resident CTA per dq element per step, and a step is over
//     20k cycles of FFMA (D=128: 2.6 M FFMA per CTA at 128 FFMA/clk/SM).
//   * D=256 Compact: the atomic kernel asks for 2 CTAs/SM (<= 128 registers; ptxas: 123, no
//     spill), the occupancy the deterministic kernel gets by itself (125 registers) on
//     sm_80's 164 KB; with a bound of 1 it would use 254 registers and 1 CTA/SM.
//
// The Compact* configurations fit in 99 KB (sm_86 / sm_89; sm_80 for D >= 128); the launcher
// uses them only when the device cannot give the first ones their shared memory.
template <int kHeadDim>
struct SimtBwdTraits {
  using Table = tiles::SimtBwd<kHeadDim>;  // include/tiles.h
  using DkdvConfig = TileConfig<typename Table::Dkdv>;
  using DqConfig = TileConfig<typename Table::Dq>;
  using CompactDkdvConfig = TileConfig<typename Table::CompactDkdv>;
  using CompactDqConfig = TileConfig<typename Table::CompactDq>;
  using AtomicDkdvConfig = TileConfig<typename Table::AtomicDkdv>;
  using CompactAtomicDkdvConfig = TileConfig<typename Table::CompactAtomicDkdv>;
};

// P recomputed from a score s (log2 units) and its row's forward statistics (m, log2 l)
// (store_row_stats in core/softmax.cuh): 2^((s - m) - log2 l), the two subtractions in this order
// (see store_row_stats for why). A row that saw no key stored (+inf, 0): P = 0 for every key,
// masked s = -inf included (never NaN). Rows past sq read (0, 0): finite P, never written.
__device__ __forceinline__ float recompute_p(float s, float m, float log2l) {
  return ex2_approx((s - m) - log2l);
}

// The same in a kExtended kernel, for the score x (log2 units) of query qi and key kj: the
// modifiers (when `modded`), then the mask (when `mask_active`), then P. `dt` receives
// softcap's derivative d x' / d x (1 without softcap), which dS needs.
__device__ __forceinline__ float recompute_p_extended(float x, const ScoreMod& mod, bool modded,
                                                      const AttnMask& mask, bool mask_active, int qi, int kj,
                                                      float m, float log2l, float& dt) {
  dt = 1.f;
  if (modded) {
    dt = mod.dtanh<true>(x);
    x = mod.apply<true>(x, qi, kj);
  }
  if (mask_active & !mask.visible(qi, kj)) x = -INFINITY;
  return recompute_p(x, m, log2l);
}

// The two kernels recompute P and dS on the same kind of tile, from either side: the dK/dV
// kernel on S^T (rows = keys, columns = queries: kRowsAreQueries = false), the dQ kernel on S
// (rows = queries). Thread (rg, cg) holds elements (i, j) = row rg + kRowGroups * i, column
// cg + kG * j of the tile; q0 and k0 are the sequence indices of the tile's first query and
// key. The thread's query u is its row u (dQ) or its column u (dK/dV): each kernel walks its
// own queries, whose statistics it keeps in registers (dQ) or reads from shared memory (dK/dV),
// and hands each one's over by value.

// This thread's element for its query u and key v: (u, v) of S, (v, u) of S^T.
template <bool kRowsAreQueries, int kTM, int kTN>
__device__ __forceinline__ float& query_key(float (&s)[kTM][kTN], int u, int v) {
  if constexpr (kRowsAreQueries) {
    return s[u][v];
  } else {
    return s[v][u];
  }
}

// Step 1 of the backward, tile-wide: S = A B^T (score_tile, in log2 units: the Q tile holds
// Q * scale * log2 e; A = Q and B = K_n in the dQ kernel, A = K and B = Q_t in the dK/dV
// kernel), the CTA's mask and whether the tile needs the per-element test (MaskedTile). A kPlain
// kernel applies the mask here; a kExtended one applies it after the modifiers, element by
// element (recompute_probs_extended).
// Keys past sk must be masked (their zero K rows would give s = 0 and P = 2^(-m - log2 l), which
// can overflow to inf for a very negative m; inf * 0 would then be NaN, in dS and, through the
// dK/dV kernel's atomic dQ, in dq). Queries past sq need no mask: their Q, dO, statistics and
// delta were zero-filled, so they give finite P and dS = P * (0 - 0) = 0, add nothing (their Q
// and dO rows are 0) and are never written; the mask test need not count them.
struct MaskedTile {
  AttnMask mask;  // the CTA's
  bool active;    // AttnMask::needs_mask of the tile
};
template <typename Cfg, bool kRowsAreQueries, bool kExt>
__device__ __forceinline__ MaskedTile masked_scores(float (&s)[Cfg::kTM][Cfg::kTN],
                                                    const float* a_row0, const float* b_row0,
                                                    const BwdParams& p, const CtaFacts* facts,
                                                    int q0, int k0, int rg, int cg) {
  constexpr int kQueries = kRowsAreQueries ? Cfg::kRows : Cfg::kCols;  // of the tile
  constexpr int kKeys = kRowsAreQueries ? Cfg::kCols : Cfg::kRows;
  score_tile<Cfg>(s, a_row0, b_row0, p.d);
  const AttnMask mask = cta_mask<kExt>(p, facts);
  const int q1 = min(q0 + kQueries, mask.sq);
  const bool mask_active = mask.needs_mask(q0, q1, k0, k0 + kKeys);
  if constexpr (!kExt) {
    if (mask_active) {
      apply_mask<kRowsAreQueries, Cfg::kTM, Cfg::kTN, Cfg::kRowGroups, Cfg::kG>(
          s, mask, (kRowsAreQueries ? q0 : k0) + rg, (kRowsAreQueries ? k0 : q0) + cg,
          left_diagonal_in(mask, q1, k0));
    }
  }
  return {mask, mask_active};
}

// Step 1 for this thread's query u, in place: P = recompute_p with the query's forward
// statistics (m, log2 l).
template <typename Cfg, bool kRowsAreQueries>
__device__ __forceinline__ void recompute_probs(float (&s)[Cfg::kTM][Cfg::kTN], int u, float m,
                                                float log2l) {
#pragma unroll
  for (int v = 0; v < (kRowsAreQueries ? Cfg::kTN : Cfg::kTM); ++v) {
    float& x = query_key<kRowsAreQueries>(s, u, v);
    x = recompute_p(x, m, log2l);
  }
}

// The same in a kExtended kernel: the modifiers (when `modded`), the mask (when mask_active) and
// P, element by element (recompute_p_extended). The registers then hold P * dtanh(x), which is
// what dS needs; with kStoreP, P itself goes into sP ([kRows][kScorePitch], at this thread's
// elements: the dK/dV kernel's P^T, for dV).
template <typename Cfg, bool kRowsAreQueries, bool kStoreP>
__device__ __forceinline__ void recompute_probs_extended(
    float (&s)[Cfg::kTM][Cfg::kTN], int u, float m, float log2l, const ScoreMod& mod, bool modded,
    const AttnMask& mask, bool mask_active, int q0, int k0, int rg, int cg, float* sP) {
  constexpr int kRG = Cfg::kRowGroups, kG = Cfg::kG;
  const int qi = kRowsAreQueries ? q0 + rg + kRG * u : q0 + cg + kG * u;
#pragma unroll
  for (int v = 0; v < (kRowsAreQueries ? Cfg::kTN : Cfg::kTM); ++v) {
    const int kj = kRowsAreQueries ? k0 + cg + kG * v : k0 + rg + kRG * v;
    float& x = query_key<kRowsAreQueries>(s, u, v);
    float dt;
    const float pr = recompute_p_extended(x, mod, modded, mask, mask_active, qi, kj, m, log2l, dt);
    if constexpr (kStoreP) {
      const int i = kRowsAreQueries ? u : v, j = kRowsAreQueries ? v : u;
      sP[(rg + kRG * i) * Cfg::kScorePitch + cg + kG * j] = pr;
    }
    x = pr * dt;
  }
}

// dS = P * (dP - delta) for this thread's query u, into sdS ([kRows][kScorePitch], at this
// thread's elements); with kStoreP, P goes into sP at the same places (the dK/dV kernel's P^T,
// for dV). p_tile: what recompute_probs(_extended) left; dp: dO V^T (dQ) or V dO^T (dK/dV).
template <typename Cfg, bool kRowsAreQueries, bool kStoreP>
__device__ __forceinline__ void store_ds(const float (&p_tile)[Cfg::kTM][Cfg::kTN],
                                         const float (&dp)[Cfg::kTM][Cfg::kTN], int u, float delta,
                                         float* sP, float* sdS, int rg, int cg) {
#pragma unroll
  for (int v = 0; v < (kRowsAreQueries ? Cfg::kTN : Cfg::kTM); ++v) {
    const int i = kRowsAreQueries ? u : v, j = kRowsAreQueries ? v : u;
    const int off = (rg + Cfg::kRowGroups * i) * Cfg::kScorePitch + cg + Cfg::kG * j;
    if constexpr (kStoreP) sP[off] = p_tile[i][j];
    sdS[off] = p_tile[i][j] * (dp[i][j] - delta);
  }
}

// The same with dropout (kExtended kernels): dS = P * (dP * z - delta), z = 1 / keep rate where
// the element is kept (bit i kTN + j of `keep`, dropout_keep_bits) and 0 elsewhere; with kScaleP,
// this thread's P^T elements already in sP (the dK/dV kernel's, stored in P1) become P^T * z, the
// dropped probabilities dV takes.
template <typename Cfg, bool kRowsAreQueries, bool kScaleP>
__device__ __forceinline__ void store_ds_dropout(const float (&p_tile)[Cfg::kTM][Cfg::kTN],
                                                 const float (&dp)[Cfg::kTM][Cfg::kTN], int u, float delta,
                                                 float* sP, float* sdS, int rg, int cg, uint64_t keep,
                                                 float drop_scale) {
#pragma unroll
  for (int v = 0; v < (kRowsAreQueries ? Cfg::kTN : Cfg::kTM); ++v) {
    const int i = kRowsAreQueries ? u : v, j = kRowsAreQueries ? v : u;
    const int off = (rg + Cfg::kRowGroups * i) * Cfg::kScorePitch + cg + Cfg::kG * j;
    const float z = (keep >> (i * Cfg::kTN + j)) & 1 ? drop_scale : 0.f;
    if constexpr (kScaleP) sP[off] *= z;
    sdS[off] = p_tile[i][j] * (dp[i][j] * z - delta);
  }
}

// =================================================================================
// Atomic dQ: the fifth product of the dK/dV kernel (deterministic = false)
// =================================================================================
//
// At step t (query block m0 .. m0 + kCols - 1 of query head h) the dK/dV kernel holds, in
// shared memory, dS^T [kRows keys][kCols queries] (sdS, row pitch kScorePitch) and K
// [kRows keys][D] (sK, row pitch kPitch). This CTA's share of the query block's dQ is
//   dQ_t[q][c] = scale * sum_{key < kRows} dS^T[key][q] * K[key][c]        (a kCols x D tile)
// a product whose reduction runs over the rows of both shared tiles ("TN": A is read
// transposed). Keys past sk have zero K rows and dS = 0 (P = 0), so they add exactly 0.
//
// Its own thread grid (the result is a different tile from the kernel's [keys] x [D] ones):
// kDG threads along D, each owning kTD columns as float4 chunks 4*dg + 4*kDG*h (as in
// gemm_nn), times kQG query groups, each owning kTQ queries as chunks of 4 consecutive ones,
// 4*qg + 4*kQG*u + e. For one key the thread reads kTQ/4 float4 of the dS^T row (its queries)
// and kTD/4 float4 of the K row (its columns), and does kTQ * kTD FFMA: with kTQ = 4 and
// kTD = 8, 3 LDS.128 per 32 FFMA, the ratio of the 4x8 dK and dV products. All lanes of a
// warp read the same two shared rows: the dS^T reads are a few consecutive float4
// (broadcasts), the K reads one contiguous run (kDG * 16 bytes), so no bank conflicts.
//   dg = tid % kDG, qg = tid / kDG: consecutive lanes own consecutive 16-byte chunks of one
// dq row, so a warp's atomic adds cover contiguous runs of kDG * 16 bytes.
// Every config of SimtBwdTraits has kCols * D / kThreads = 16 or 32 results per thread:
// kTQ = 4 and kTD = 4 or 8.
template <typename Cfg>
struct DqPartialGrid {
  static constexpr int kTQ = 4;
  static constexpr int kTD = Cfg::kCols * Cfg::kHeadDim / (kTQ * Cfg::kThreads);
  static constexpr int kDG = Cfg::kHeadDim / kTD;
  static constexpr int kQG = Cfg::kThreads / kDG;
  static_assert(kTD % 4 == 0 && kTD > 0, "whole float4 chunks of D per thread");
  static_assert(Cfg::kHeadDim % kTD == 0 && Cfg::kThreads % kDG == 0, "D splits over the grid");
  static_assert(kQG * kTQ == Cfg::kCols, "the grid covers the query block exactly");
};

// Product "TN": acc[4u + e][4h + f] += sum_{c < kC} A[c][col(u) + e] * B[c][col(h) + f], both
// operands stored [c][...] (row c = one key): the rows of the result are columns of A.
//   a: this thread's first A column (sA + 4 * qg); its chunk u starts at a + u * kChunkStrideA
//   b: this thread's first B column (sB + 4 * dg); its chunk h starts at b + h * kChunkStrideB
// Per c: kTQ/4 + kTD/4 LDS.128 and kTQ * kTD FFMA, unrolled in chunks of about 1024 FFMA as in
// gemm_nn.
template <int kTQ, int kTD, int kPitchA, int kChunkStrideA, int kPitchB, int kChunkStrideB, int kC>
__device__ __forceinline__ void gemm_tn(float (&acc)[kTQ][kTD], const float* a, const float* b) {
  constexpr int kChunk = unroll_chunk(kC, kTQ * kTD);
  static_assert(kC % kChunk == 0, "c chunking");
#pragma unroll 1
  for (int c0 = 0; c0 < kC; c0 += kChunk) {
#pragma unroll
    for (int c = 0; c < kChunk; ++c) {
      float4 av[kTQ / 4], bv[kTD / 4];
#pragma unroll
      for (int u = 0; u < kTQ / 4; ++u) av[u] = lds4(a + c * kPitchA + u * kChunkStrideA);
#pragma unroll
      for (int h = 0; h < kTD / 4; ++h) bv[h] = lds4(b + c * kPitchB + h * kChunkStrideB);
#pragma unroll
      for (int u = 0; u < kTQ / 4; ++u) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float w = e == 0 ? av[u].x : e == 1 ? av[u].y : e == 2 ? av[u].z : av[u].w;
          float* row = acc[4 * u + e];
#pragma unroll
          for (int h = 0; h < kTD / 4; ++h) {
            row[4 * h + 0] = fmaf(w, bv[h].x, row[4 * h + 0]);
            row[4 * h + 1] = fmaf(w, bv[h].y, row[4 * h + 1]);
            row[4 * h + 2] = fmaf(w, bv[h].z, row[4 * h + 2]);
            row[4 * h + 3] = fmaf(w, bv[h].w, row[4 * h + 3]);
          }
        }
      }
    }
    a += kChunk * kPitchA;
    b += kChunk * kPitchB;
  }
}

// g[0..3] += (x, y, z, w) as fire-and-forget reductions at the L2 (RED, no value returned).
// sm_90 has a 16-byte vector form (one instruction; g must be 16-byte aligned, which holds as
// for store_row_tile's float4 stores: dq rows start 16-byte aligned and col % 4 == 0); older
// GPUs add the four floats one by one. Either way each float add is atomic on its own, rounds
// to nearest and flushes subnormal inputs and results to zero (the PTX rule for red.add.f32).
__device__ __forceinline__ void red_add_f32x4(float* g, float x, float y, float z, float w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  red_add_v4_f32(g, x, y, z, w);
#else
  red_add_f32(g, x);
  red_add_f32(g + 1, y);
  red_add_f32(g + 2, z);
  red_add_f32(g + 3, w);
#endif
}

// dq[row][col] += factor * acc for this thread's part of a DqPartialGrid tile: rows
// < rows_valid and columns < d only. g is the global address of the tile's row 0 (query m0 of
// one (batch, query head)).
template <typename Grid>
__device__ __forceinline__ void red_add_dq_tile(float* g, int64_t row_stride, int rows_valid,
                                                int d, const float (&acc)[Grid::kTQ][Grid::kTD],
                                                float factor, int qg, int dg) {
#pragma unroll
  for (int u = 0; u < Grid::kTQ / 4; ++u) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = 4 * qg + 4 * Grid::kQG * u + e;
      if (r < rows_valid) {
        float* g_row = g + r * row_stride;
#pragma unroll
        for (int h = 0; h < Grid::kTD / 4; ++h) {
          const int col = 4 * dg + 4 * Grid::kDG * h;
          if (col < d) {
            const float* v = acc[4 * u + e] + 4 * h;
            red_add_f32x4(g_row + col, v[0] * factor, v[1] * factor, v[2] * factor,
                          v[3] * factor);
          }
        }
      }
    }
  }
}

// =================================================================================
// dK / dV kernel (and, with kAtomicDQ, atomic dQ)
// =================================================================================
//
// Shared memory: sK [kRows][kPitch] | sV [kRows][kPitch] | buf0 | buf1 | sP [kRows][kScorePitch]
//                | sdS [kRows][kScorePitch] | CtaFacts (kExtended),
//                buf = [kCols][kPitch] tile + 2 kCols row vector.
// Step t (one query block m of one query head h) uses Q_t (+ its (m, log2 l)) in buf[t % 2] and dO_t
// (+ its delta) in buf[(t + 1) % 2]; the two buffers swap roles every step:
//
//   P1  S^T = K Q_t^T -> P^T = 2^((S^T - m) - log2 l)           [reads sK, Q_t]
//       wait dO_t, barrier (B1)
//   P2  dP^T = V dO_t^T -> dS^T = P^T * (dP^T - delta); store P^T, dS^T     [sV, dO_t]
//       barrier (B2)                   (sP, sdS complete)
//   P3  dV += P^T dO_t                                           [sP, dO_t]
//       barrier (B3) -> dO_t's buffer is free: start Q_{t+1} there    (lands during P4, P5)
//   P4  dK += dS^T Q_t                                           [sdS, Q_t]
//   P5  (kAtomicDQ only) dq[h][m0 ..] += scale * dS K, atomics   [sdS, sK]
//       wait Q_{t+1}, barrier (B4) -> Q_t's buffer is free: start dO_{t+1} there (lands during P1)
//
// Shared-memory hazards of P5: it reads sdS, which P2 of step t+1 overwrites; every thread
// finishes P5 before B4 (and B1 of step t+1), and P2 of step t+1 starts after B1, so the tile
// is never overwritten while read. It was complete since B2. sK is never written after the
// prologue.
//
// Q is stored pre-multiplied by scale * log2(e), as the forward stores it, so that S^T comes out
// in log2 units and bitwise equal to the forward's scores: both are the same FFMA chains over the
// head dim (gemm_nt's partial chains of kScoreChain), fmaf(q_d * scale_log2, k_d, s), in the same
// order. Recomputing P from a score that differs from the forward's by a rounding would give P an
// error of ulp(|score|) relative to the statistics the forward normalized with, which at large logits (scale 1, head dim 128: |score| ~ 70 in
// log2 units) costs several bits of dK, dV and dQ (OPTIMIZATION.md). K and V stay unscaled (K is
// also the B operand of P5). dK = scale * sum dS^T Q = (scale / scale_log2) * sum dS^T Q_scaled:
// that factor is applied once, when dK is written; dQ gets `scale` when added.
// kV: kPlain, or kExtended (packed batches, softcap, ALiBi). The kExtended kernel's P1 applies
// the modifiers before the mask, stores P^T into sP at once (sP is free from B4 of the previous
// step on) and keeps P^T * dtanh in registers for P2.
template <typename Cfg, bool kAtomicDQ, Variant kV>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    flash_bwd_dkdv_simt_kernel(const BwdParams p) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kTD = Cfg::kTD;
  constexpr int kRows = Cfg::kRows, kCols = Cfg::kCols, kD = Cfg::kHeadDim;
  constexpr int kPitch = Cfg::kPitch, kScorePitch = Cfg::kScorePitch;
  constexpr int kRG = Cfg::kRowGroups, kG = Cfg::kG;
  // A buffer: the tile, then its row vector (Q: the (m, log2 l) pairs, 2 kCols floats; dO: delta,
  // kCols floats). A multiple of 4: buffers stay 16-byte aligned.
  constexpr int kBufFloats = kCols * kPitch + 2 * kCols;
  constexpr bool kExt = kV != kPlain;

  extern __shared__ float4 smem_f4[];
  float* sK = reinterpret_cast<float*>(smem_f4);
  float* sV = sK + kRows * kPitch;
  float* sBuf = sV + kRows * kPitch;  // buf b at sBuf + b * kBufFloats, its vector after the tile
  float* sP = sBuf + 2 * kBufFloats;
  float* sdS = sP + kRows * kScorePitch;
  CtaFacts* facts = reinterpret_cast<CtaFacts*>(sdS + kRows * kScorePitch);  // kExt only

  const int tid = static_cast<int>(threadIdx.x);
  const int rg = tid / kG;
  const int cg = tid % kG;

  // Grid order: with a right-bounded mask (causal, windows) the first key blocks are seen by
  // the most queries; they get the low block indices and start first. Otherwise the blocks of
  // one (batch, kv head) are adjacent (they share Q and dO in L2).
  // CTAs from p.split_begin on are pieces of the split last wave (plain dense calls only): key
  // block split_begin + piece / num_splits, query-step range piece % num_splits (plan_bwd_simt).
  const int num_n_blocks = ceil_div(p.sk, kRows);
  const int bh_count = p.b * p.hkv;
  int idx = static_cast<int>(blockIdx.x), piece = -1;
  if (idx >= p.split_begin) {
    piece = idx - p.split_begin;
    idx = p.split_begin + piece / p.num_splits;
  }
  const bool by_key = longest_first(p);
  const int n_block = by_key ? idx / bh_count : idx % num_n_blocks;
  const int bh = by_key ? idx % bh_count : idx / num_n_blocks;
  const int bi = bh / p.hkv;
  const int hk = bh - bi * p.hkv;
  const int group = p.hq / p.hkv;  // query heads hk*group .. hk*group + group - 1 read kv head hk
  const int n0 = n_block * kRows;
  const SeqInfo seq = SeqInfo::make<kExt>(p, bi);
  const int keys_valid = seq.sk - n0;

  // Query blocks that can see a key of this block (BlockRange::queries_of).
  // Example (causal): sq = sk = 256, 64-key blocks: key block n0 = 128 is seen from query 128
  // on, i.e. from query block 128 / kCols. With sq = 64 < sk = 256 (offset 192), key block 0 is
  // seen by every query and key block 192 too (192 - 192 = 0).
  const BlockRange m_range = BlockRange::queries_of(seq.mask<kExt>(p), n0, n0 + kRows, kCols);
  const int m_first = m_range.begin;
  const int steps_per_head = m_range.count();
  const int num_steps = steps_per_head * group;
  int t_begin = 0, t_end = num_steps;  // this CTA's steps
  if (piece >= 0) {
    const int range = piece % p.num_splits;
    t_begin = static_cast<int>(static_cast<int64_t>(num_steps) * range / p.num_splits);
    t_end = static_cast<int>(static_cast<int64_t>(num_steps) * (range + 1) / p.num_splits);
  }
  if constexpr (kExt) {
    // Past its sequence's end (the grid is sized by max_seqlen_k): nothing to compute or write
    // (uniform, before any barrier). The ScoreMod is per query head: made per step.
    if (keys_valid <= 0) return;
    publish_facts(facts, CtaFacts{seq, seq.mask<kExt>(p), ScoreMod{}}, tid);
  }

  const float* k = seq.k_rows(static_cast<const float*>(p.k), p.k_batch_stride, p.k_head_stride,
                              p.k_row_stride, hk) +
                   n0 * p.k_row_stride;
  const float* v = seq.k_rows(static_cast<const float*>(p.v), p.v_batch_stride, p.v_head_stride,
                              p.v_row_stride, hk) +
                   n0 * p.v_row_stride;

  // Step t -> (query head, first query row): the steps run over the query blocks m_first ..
  // m_range.end - 1 of the first head of the group, then of the next head, and so on.
  // The row vector of each buffer holds the (m, log2 l) pairs (next to Q) or delta (next to
  // dO) of the step's query rows. Rows past sq are zero-filled (Q, dO, pairs, delta).
  auto step_head = [&](int t) { return hk * group + t / steps_per_head; };
  auto step_m0 = [&](int t) { return (m_first + t % steps_per_head) * kCols; };
  static_assert(2 * kCols <= Cfg::kThreads, "one thread per row-vector element");
  // Floats [0, n) of a row vector, of which [0, n_valid) exist in memory.
  auto load_row_vector = [&](float* dst, const float* src, int n, int n_valid) {
    if (tid < n) {
      const bool valid = tid < n_valid;
      cp_async_4(dst + tid, valid ? src + tid : src, valid);
    }
  };
  auto load_q = [&](int h, int m0, float* buf) {
    const SeqInfo sf = cta_seq<kExt>(p, facts, bi);
    const float* q = sf.q_rows(static_cast<const float*>(p.q), p.q_batch_stride, p.q_head_stride,
                               p.q_row_stride, h) +
                     m0 * p.q_row_stride;
    load_rows_async<Cfg, kCols>(buf, q, p.q_row_stride, sf.sq - m0, p.d, tid);
    load_row_vector(buf + kCols * kPitch, p.softmax_stats + 2 * (sf.stat_offset(p, h) + m0), 2 * kCols,
                    2 * (sf.sq - m0));
  };
  auto load_do = [&](int h, int m0, float* buf) {
    const SeqInfo sf = cta_seq<kExt>(p, facts, bi);
    const float* dO = sf.q_rows(static_cast<const float*>(p.dout), p.do_batch_stride,
                                p.do_head_stride, p.do_row_stride, h) +
                      m0 * p.do_row_stride;
    load_rows_async<Cfg, kCols>(buf, dO, p.do_row_stride, sf.sq - m0, p.d, tid);
    load_row_vector(buf + kCols * kPitch, p.delta + sf.stat_offset(p, h) + m0, kCols, sf.sq - m0);
  };

  float dk[kTM][kTD], dv[kTM][kTD];
#pragma unroll
  for (int i = 0; i < kTM; ++i)
#pragma unroll
    for (int c = 0; c < kTD; ++c) dk[i][c] = dv[i][c] = 0.f;

  if (t_end > t_begin) {
    // Two groups: {K, Q_0, stats_0} then {V, dO_0, delta_0}.
    load_rows_async<Cfg, kRows>(sK, k, p.k_row_stride, keys_valid, p.d, tid);
    load_q(step_head(t_begin), step_m0(t_begin), sBuf);
    cp_async_commit();
    load_rows_async<Cfg, kRows>(sV, v, p.v_row_stride, keys_valid, p.d, tid);
    load_do(step_head(t_begin), step_m0(t_begin), sBuf + kBufFloats);
    cp_async_commit();
    cp_async_wait<1>();
    scale_own_chunks<kCols, kD, kPitch, Cfg::kThreads>(sBuf, p.scale_log2, tid);  // Q_0
    __syncthreads();

    const float* sK_row0 = sK + rg * kPitch;
    const float* sV_row0 = sV + rg * kPitch;

    int m0 = step_m0(t_begin);
    for (int t = t_begin; t < t_end; ++t) {
      const int parity = (t - t_begin) & 1;
      float* bq = sBuf + parity * kBufFloats;         // Q_t, (m, log2 l)
      float* bdo = sBuf + (parity ^ 1) * kBufFloats;  // dO_t, delta
      const bool has_next = t + 1 < t_end;
      const int h_next = has_next ? step_head(t + 1) : 0;
      const int m0_next = has_next ? step_m0(t + 1) : 0;

      // ---- P1: S^T = K Q^T (log2 units), mask, P^T = recompute_p(S^T) ----
      // s[i][j]: key n0 + rg + kRG*i, query m0 + cg + kG*j. kExt: P^T goes into sP at once (free
      // since B4 of the previous step), s keeps P^T * dtanh(x) for P2.
      float s[kTM][kTN];
      const MaskedTile tile =
          masked_scores<Cfg, false, kExt>(s, sK_row0, bq + cg * kPitch, p, facts, m0, n0, rg, cg);
      // Dropout (the forward's draws, regenerated; the key is read per step rather than held):
      // bit i kTN + j = element (key n0 + rg + kRG i, query m0 + cg + kG j).
      uint64_t keep = 0;
      if constexpr (kExt) {
        if (has_dropout(p)) {
          keep = dropout_keep_bits<kTM, kTN, kRG, kG, false>(dropout_key(p.dropout), bi * p.hq + step_head(t),
                                                             n0 + rg, m0 + cg);
        }
      }
      if constexpr (!kExt) {
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
          const float2 st = reinterpret_cast<const float2*>(bq + kCols * kPitch)[cg + kG * j];
          recompute_probs<Cfg, false>(s, j, st.x, st.y);
        }
      } else {
        const ScoreMod mod = facts->seq.score_mod(p, step_head(t));
        const bool modded = mod.active();
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
          const float2 st = reinterpret_cast<const float2*>(bq + kCols * kPitch)[cg + kG * j];
          recompute_probs_extended<Cfg, false, true>(
              s, j, st.x, st.y, mod, modded, tile.mask, tile.active, m0, n0, rg, cg, sP);
        }
      }

      cp_async_wait<0>();  // dO_t landed
      __syncthreads();

      // ---- P2: dP^T = V dO^T, dS^T = P^T * (dP^T - delta); publish P^T and dS^T ----
      // (kExt: P^T was stored in P1.)
      float dp[kTM][kTN];
      score_tile<Cfg>(dp, sV_row0, bdo + cg * kPitch, p.d);
      if (kExt && has_dropout(p)) {
#pragma unroll
        for (int j = 0; j < kTN; ++j) {
          store_ds_dropout<Cfg, false, true>(s, dp, j, bdo[kCols * kPitch + cg + kG * j], sP, sdS, rg, cg, keep,
                                             p.dropout.scale);
        }
      } else {
#pragma unroll
        for (int j = 0; j < kTN; ++j)
          store_ds<Cfg, false, !kExt>(s, dp, j, bdo[kCols * kPitch + cg + kG * j], sP, sdS, rg, cg);
      }
      __syncthreads();

      // ---- P3: dV += P^T dO ----
      gemm_nn<kTM, kTD, kRG * kScorePitch, kPitch, 4 * kG, kCols>(dv, sP + rg * kScorePitch,
                                                                  bdo + 4 * cg);
      __syncthreads();  // every warp is done with dO_t: its buffer takes Q_{t+1}
      if (has_next) load_q(h_next, m0_next, bdo);
      cp_async_commit();

      // ---- P4: dK += dS^T Q (the factor `scale` is applied when dK is written) ----
      gemm_nn<kTM, kTD, kRG * kScorePitch, kPitch, 4 * kG, kCols>(dk, sdS + rg * kScorePitch,
                                                                  bq + 4 * cg);

      if constexpr (kAtomicDQ) {
        // ---- P5: dq[h][m0 + q] += scale * sum_{keys of this CTA} dS^T[key][q] * K[key] ----
        // Query rows past sq have dS = 0 but are not written anyway (their dq rows do not
        // exist); columns >= d are 0 in sK and not written either.
        using Grid = DqPartialGrid<Cfg>;
        float dq[Grid::kTQ][Grid::kTD];
#pragma unroll
        for (int i = 0; i < Grid::kTQ; ++i)
#pragma unroll
          for (int c = 0; c < Grid::kTD; ++c) dq[i][c] = 0.f;
        const int qg = tid / Grid::kDG;
        const int dg = tid % Grid::kDG;
        gemm_tn<Grid::kTQ, Grid::kTD, kScorePitch, 4 * Grid::kQG, kPitch, 4 * Grid::kDG, kRows>(
            dq, sdS + 4 * qg, sK + 4 * dg);
        const SeqInfo sf = cta_seq<kExt>(p, facts, bi);
        float* dq_tile = sf.q_rows(static_cast<float*>(p.dq), p.dq_batch_stride, p.dq_head_stride,
                                   p.dq_row_stride, step_head(t)) +
                         m0 * p.dq_row_stride;
        red_add_dq_tile<Grid>(dq_tile, p.dq_row_stride, sf.sq - m0, p.d, dq, p.scale, qg, dg);
      }

      // Q_{t+1} landed (each thread scales the chunks it copied) and, after the barrier, is
      // visible; every warp is done with Q_t, whose buffer takes dO_{t+1}.
      cp_async_wait<0>();
      if (has_next) scale_own_chunks<kCols, kD, kPitch, Cfg::kThreads>(bdo, p.scale_log2, tid);
      __syncthreads();
      if (has_next) load_do(h_next, m0_next, bq);
      cp_async_commit();
      m0 = m0_next;
    }
  }

  // Keys that no query can see (causal, windows, or sq too short) get dK = dV = 0.
  float dk_scale[kTM], one[kTM];
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    dk_scale[i] = p.scale / p.scale_log2;  // Q was scaled by scale_log2
    one[i] = 1.f;
  }
  if (piece >= 0) {  // this range's partial dK and dV, summed by sum_split_dkdv_kernel
    const int64_t pieces = static_cast<int64_t>(gridDim.x) - p.split_begin;
    float* dk_part = p.dkv_accum + static_cast<int64_t>(piece) * kRows * p.d;
    float* dv_part = dk_part + pieces * kRows * p.d;
    store_row_tile<Cfg>(dk_part, p.d, keys_valid, p.d, dk, dk_scale, rg, cg);
    store_row_tile<Cfg>(dv_part, p.d, keys_valid, p.d, dv, one, rg, cg);
    return;
  }
  const SeqInfo sf = cta_seq<kExt>(p, facts, bi);
  float* dk_tile = sf.k_rows(static_cast<float*>(p.dk), p.dk_batch_stride, p.dk_head_stride,
                             p.dk_row_stride, hk) +
                   n0 * p.dk_row_stride;
  float* dv_tile = sf.k_rows(static_cast<float*>(p.dv), p.dv_batch_stride, p.dv_head_stride,
                             p.dv_row_stride, hk) +
                   n0 * p.dv_row_stride;
  store_row_tile<Cfg>(dk_tile, p.dk_row_stride, keys_valid, p.d, dk, dk_scale, rg, cg);
  store_row_tile<Cfg>(dv_tile, p.dv_row_stride, keys_valid, p.d, dv, one, rg, cg);
}

// Sums the step ranges of the split key blocks, in range order (bitwise reproducible):
// dK = sum_r dK_r, dV = sum_r dV_r (each partial already scaled). One thread per float4 of a
// split block's rows; the block order is the unmasked one of the dK/dV kernel (splits run only
// for plain dense calls, so p.sk is every sequence's length).
template <int kRows>
__global__ void __launch_bounds__(256) sum_split_dkdv_kernel(const BwdParams p, int64_t pieces) {
  const int d4 = p.d / 4;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t split_block = e / (static_cast<int64_t>(kRows) * d4);
  if (split_block * p.num_splits >= pieces) return;
  const int r = static_cast<int>(e / d4 % kRows), c = 4 * static_cast<int>(e % d4);
  const int num_n_blocks = ceil_div(p.sk, kRows);
  const int idx = p.split_begin + static_cast<int>(split_block);
  const int n0 = idx % num_n_blocks * kRows, bh = idx / num_n_blocks;
  if (n0 + r >= p.sk) return;
  const int bi = bh / p.hkv, hk = bh - bi * p.hkv;
  const float* dk_part = p.dkv_accum + (split_block * p.num_splits * kRows + r) * p.d + c;
  const float* dv_part = dk_part + pieces * kRows * p.d;
  float4 dk = make_float4(0.f, 0.f, 0.f, 0.f), dv = dk;
  for (int i = 0; i < p.num_splits; ++i) {
    const float4 a = *reinterpret_cast<const float4*>(dk_part + i * kRows * p.d);
    const float4 b = *reinterpret_cast<const float4*>(dv_part + i * kRows * p.d);
    dk.x += a.x, dk.y += a.y, dk.z += a.z, dk.w += a.w;
    dv.x += b.x, dv.y += b.y, dv.z += b.z, dv.w += b.w;
  }
  *reinterpret_cast<float4*>(static_cast<float*>(p.dk) + bi * p.dk_batch_stride +
                             hk * p.dk_head_stride + (n0 + r) * p.dk_row_stride + c) = dk;
  *reinterpret_cast<float4*>(static_cast<float*>(p.dv) + bi * p.dv_batch_stride +
                             hk * p.dv_head_stride + (n0 + r) * p.dv_row_stride + c) = dv;
}

// =================================================================================
// dQ kernel
// =================================================================================
//
// Shared memory: sQ [kRows][kPitch] | sdO [kRows][kPitch] | buf0 | buf1 | sdS [kRows][kScorePitch]
// | CtaFacts (kExtended), buf = [kCols][kPitch]. Key block n (from keys.begin on) keeps K_n in
// buf[(n - begin) % 2] and V_n in the other buffer:
//
//   S = Q K_n^T -> P = 2^((S - m) - log2 l)                       [sQ, K_n]
//   wait V_n, barrier
//   dP = dO V_n^T -> dS = P * (dP - delta); store dS               [sdO, V_n]
//   barrier -> V_n's buffer is free: start K_{n+1} there          (lands during the dQ product)
//   dQ += dS K_n                                                  [sdS, K_n]
//   wait K_{n+1}, barrier -> K_n's buffer is free: start V_{n+1} there (lands during S)
//
// Q is stored pre-multiplied by scale * log2(e) (it is only used for S). dQ gets `scale` when
// written. kExtended: S gets softcap / ALiBi before the mask, and the P registers hold
// P * dtanh(S) (dS = P * dtanh * (dP - delta); P itself is not needed here).
template <typename Cfg, Variant kV>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    flash_bwd_dq_simt_kernel(const BwdParams p) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kTD = Cfg::kTD, kRG = Cfg::kRowGroups, kG = Cfg::kG;
  constexpr int kRows = Cfg::kRows, kCols = Cfg::kCols, kD = Cfg::kHeadDim;
  constexpr int kPitch = Cfg::kPitch, kScorePitch = Cfg::kScorePitch;
  constexpr int kBufFloats = kCols * kPitch;  // a K or V buffer
  constexpr bool kExt = kV != kPlain;

  extern __shared__ float4 smem_f4[];
  float* sQ = reinterpret_cast<float*>(smem_f4);
  float* sdO = sQ + kRows * kPitch;
  float* sBuf = sdO + kRows * kPitch;
  float* sdS = sBuf + 2 * kBufFloats;
  CtaFacts* facts = reinterpret_cast<CtaFacts*>(sdS + kRows * kScorePitch);  // kExt only

  const int tid = static_cast<int>(threadIdx.x);
  const int rg = tid / kG;
  const int cg = tid % kG;

  // The forward's block order and key-block range (FwdQueryBlock: q, k, v point at this
  // block's Q rows and its kv head's K and V).
  const FwdQueryBlock blk = FwdQueryBlock::make<kRows, kCols, kExt>(p);
  const int bi = blk.seq.bi, hi = blk.hi, m0 = blk.m0, rows_valid = blk.rows_valid;
  const int n_begin = blk.keys.begin, n_end = blk.keys.end;
  const float *k = blk.k, *v = blk.v;
  if constexpr (kExt) {
    // Past its sequence's end: nothing to compute or write (uniform, before any barrier).
    if (rows_valid <= 0) return;
    publish_facts(facts, CtaFacts{blk.seq, blk.mask, blk.seq.score_mod(p, hi)}, tid);
  }
  const float* dO = blk.seq.q_rows(static_cast<const float*>(p.dout), p.do_batch_stride,
                                   p.do_head_stride, p.do_row_stride, hi) +
                    m0 * p.do_row_stride;

  // Per-row forward statistics (m, log2 l) and delta of this thread's rows. Rows past sq: 0
  // (their Q and dO rows are zero, so they produce finite values that are never written).
  float row_m[kTM], row_log2l[kTM], delta[kTM];
  {
    const int64_t row_base = blk.seq.stat_offset(p, hi) + m0;
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      const int r = rg + kRG * i;
      const float2 st = r < rows_valid ? reinterpret_cast<const float2*>(p.softmax_stats)[row_base + r]
                                       : make_float2(0.f, 0.f);
      row_m[i] = st.x;
      row_log2l[i] = st.y;
      delta[i] = r < rows_valid ? p.delta[row_base + r] : 0.f;
    }
  }

  float dq[kTM][kTD];
#pragma unroll
  for (int i = 0; i < kTM; ++i)
#pragma unroll
    for (int c = 0; c < kTD; ++c) dq[i][c] = 0.f;

  if (n_end > n_begin) {
    // Two groups: {Q, dO, K_first} then {V_first}.
    const int first0 = n_begin * kCols;
    load_rows_async<Cfg, kRows>(sQ, blk.q, p.q_row_stride, rows_valid, p.d, tid);
    load_rows_async<Cfg, kRows>(sdO, dO, p.do_row_stride, rows_valid, p.d, tid);
    load_rows_async<Cfg, kCols>(sBuf, k + first0 * p.k_row_stride, p.k_row_stride,
                                blk.seq.sk - first0, p.d, tid);
    cp_async_commit();
    load_rows_async<Cfg, kCols>(sBuf + kBufFloats, v + first0 * p.v_row_stride, p.v_row_stride,
                                blk.seq.sk - first0, p.d, tid);
    cp_async_commit();
    cp_async_wait<1>();
    scale_own_chunks<kRows, kD, kPitch, Cfg::kThreads>(sQ, p.scale_log2, tid);
    __syncthreads();

    const float* sQ_row0 = sQ + rg * kPitch;
    const float* sdO_row0 = sdO + rg * kPitch;

    for (int n_block = n_begin; n_block < n_end; ++n_block) {
      const int n0 = n_block * kCols;
      const int parity = (n_block - n_begin) & 1;
      float* bk = sBuf + parity * kBufFloats;        // K_n
      float* bv = sBuf + (parity ^ 1) * kBufFloats;  // V_n

      // ---- S = Q K^T (log2 units), modifiers, mask, P = recompute_p(S) ----
      // s[i][j]: query m0 + rg + kRG*i, key n0 + cg + kG*j.
      float s[kTM][kTN];
      const MaskedTile tile =
          masked_scores<Cfg, true, kExt>(s, sQ_row0, bk + cg * kPitch, p, facts, m0, n0, rg, cg);
      uint64_t keep = 0;  // dropout: bit i kTN + j = element (query m0 + rg + kRG i, key n0 + cg + kG j)
      if constexpr (kExt) {
        if (has_dropout(p)) {
          keep = dropout_keep_bits<kTM, kTN, kRG, kG, true>(dropout_key(p.dropout), bi * p.hq + hi, m0 + rg, n0 + cg);
        }
      }
      if constexpr (!kExt) {
#pragma unroll
        for (int i = 0; i < kTM; ++i) recompute_probs<Cfg, true>(s, i, row_m[i], row_log2l[i]);
      } else {
        const ScoreMod mod = facts->mod;
        const bool modded = mod.active();
#pragma unroll
        for (int i = 0; i < kTM; ++i) {
          recompute_probs_extended<Cfg, true, false>(s, i, row_m[i], row_log2l[i], mod, modded,
                                                     tile.mask, tile.active, m0, n0, rg, cg, nullptr);
        }
      }

      cp_async_wait<0>();  // V_n landed
      __syncthreads();

      // ---- dP = dO V^T, dS = P * (dP - delta) -> sdS ----
      float dp[kTM][kTN];
      score_tile<Cfg>(dp, sdO_row0, bv + cg * kPitch, p.d);
      if (kExt && has_dropout(p)) {
#pragma unroll
        for (int i = 0; i < kTM; ++i) {
          store_ds_dropout<Cfg, true, false>(s, dp, i, delta[i], nullptr, sdS, rg, cg, keep, p.dropout.scale);
        }
      } else {
#pragma unroll
        for (int i = 0; i < kTM; ++i) store_ds<Cfg, true, false>(s, dp, i, delta[i], nullptr, sdS, rg, cg);
      }
      __syncthreads();  // dS complete; every warp is done with V_n: its buffer takes K_{n+1}
      if (n_block + 1 < n_end) {
        load_rows_async<Cfg, kCols>(bv, k + (n0 + kCols) * p.k_row_stride, p.k_row_stride,
                                    cta_mask<kExt>(p, facts).sk - n0 - kCols, p.d, tid);
      }
      cp_async_commit();

      // ---- dQ += dS K (the factor `scale` is applied when dQ is written) ----
      gemm_nn<kTM, kTD, kRG * kScorePitch, kPitch, 4 * kG, kCols>(dq, sdS + rg * kScorePitch,
                                                                  bk + 4 * cg);
      // K_{n+1} landed and, after the barrier, is visible; every warp is done with K_n, whose
      // buffer takes V_{n+1}.
      cp_async_wait<0>();
      __syncthreads();
      if (n_block + 1 < n_end) {
        load_rows_async<Cfg, kCols>(bk, v + (n0 + kCols) * p.v_row_stride, p.v_row_stride,
                                    cta_mask<kExt>(p, facts).sk - n0 - kCols, p.d, tid);
      }
      cp_async_commit();
    }
  }

  // Rows that see no key get dQ = 0.
  float dq_scale[kTM];
#pragma unroll
  for (int i = 0; i < kTM; ++i) dq_scale[i] = p.scale;
  float* dq_tile = cta_seq<kExt>(p, facts, bi).q_rows(static_cast<float*>(p.dq), p.dq_batch_stride,
                                                      p.dq_head_stride, p.dq_row_stride, hi) +
                   m0 * p.dq_row_stride;
  store_row_tile<Cfg>(dq_tile, p.dq_row_stride, rows_valid, p.d, dq, dq_scale, rg, cg);
}

// ext: a kExtended kernel, which appends its CtaFacts.
template <typename Cfg>
constexpr size_t bwd_dkdv_smem_bytes(bool ext = false) {
  return sizeof(float) * (2 * static_cast<size_t>(Cfg::kRows) * Cfg::kPitch +
                          2 * (static_cast<size_t>(Cfg::kCols) * Cfg::kPitch + 2 * Cfg::kCols) +
                          2 * static_cast<size_t>(Cfg::kRows) * Cfg::kScorePitch) +
         (ext ? kFactsBytes : 0);
}

template <typename Cfg>
constexpr size_t bwd_dq_smem_bytes(bool ext = false) {
  return sizeof(float) * (2 * static_cast<size_t>(Cfg::kRows) * Cfg::kPitch +
                          2 * static_cast<size_t>(Cfg::kCols) * Cfg::kPitch +
                          static_cast<size_t>(Cfg::kRows) * Cfg::kScorePitch) +
         (ext ? kFactsBytes : 0);
}

// Every head dim has backward configurations that fit a 99 KiB block (the consumer cards).
template <int kHeadDim, typename Tr = SimtBwdTraits<kHeadDim>>
constexpr bool kSimtBwdFits = bwd_dkdv_smem_bytes<typename Tr::CompactDkdvConfig>(true) <= kSmemConsumer &&
                              bwd_dkdv_smem_bytes<typename Tr::CompactAtomicDkdvConfig>(true) <= kSmemConsumer &&
                              bwd_dq_smem_bytes<typename Tr::CompactDqConfig>(true) <= kSmemConsumer;
static_assert(kSimtBwdFits<32> && kSimtBwdFits<64> && kSimtBwdFits<128> && kSimtBwdFits<256>,
              "fp32 backward configurations fit every GPU class");

template <typename Cfg>
int64_t num_key_blocks(const BwdParams& p) {
  return static_cast<int64_t>(ceil_div(p.sk, Cfg::kRows)) * p.b * p.hkv;
}

// The split of the dK/dV kernel's last wave (see plan_tail_split: plain dense calls only), and
// the workspace floats it needs (0: none).
template <typename Cfg, bool kAtomicDQ>
int64_t plan_bwd_dkdv(BwdParams& p) {
  const int64_t pieces = plan_launch_split(
      p, flash_bwd_dkdv_simt_kernel<Cfg, kAtomicDQ, kPlain>, Cfg::kThreads,
      bwd_dkdv_smem_bytes<Cfg>(),
      num_key_blocks<Cfg>(p), ceil_div(p.sq, Cfg::kCols) * (p.hq / p.hkv), "flash_bwd_dkdv_simt");
  return 2 * pieces * Cfg::kRows * p.d;
}

// kAtomicDQ: params.dq must be zero-filled (it is accumulated into, never overwritten).
// The grid is sized by params.sk (max_seqlen_k for varlen). Packed batches, softcap and ALiBi
// get the kExtended kernel (never split).
template <typename Cfg, bool kAtomicDQ>
void launch_bwd_dkdv(const BwdParams& params, cudaStream_t stream) {
  const char* name = kAtomicDQ ? "flash_bwd_dkdv_dq_atomic_simt" : "flash_bwd_dkdv_simt";
  const int64_t num_blocks = num_key_blocks<Cfg>(params);
  const bool split = params.num_splits > 1 && params.split_begin < num_blocks;
  if (!split) {
    BwdParams p = params;
    p.split_begin = INT_MAX;
    p.num_splits = 1;
    if (variant_of(p, true) == kPlain) {
      launch_simt(flash_bwd_dkdv_simt_kernel<Cfg, kAtomicDQ, kPlain>, p, Cfg::kThreads,
                  bwd_dkdv_smem_bytes<Cfg>(), p.sk, Cfg::kRows, p.hkv, name, stream);
    } else {  // kExtended and kSoftcapGrad
      launch_simt(flash_bwd_dkdv_simt_kernel<Cfg, kAtomicDQ, kExtended>, p, Cfg::kThreads,
                  bwd_dkdv_smem_bytes<Cfg>(true), p.sk, Cfg::kRows, p.hkv, name, stream);
    }
    return;
  }
  if (params.dkv_accum == nullptr || !split_allowed(params)) {
    throw std::runtime_error(std::string("flash_cuda: kernel ") + name +
                             ": split query ranges need a workspace, no mask, no softcap or "
                             "ALiBi and a dense batch");
  }
  const int64_t pieces = (num_blocks - params.split_begin) * params.num_splits;
  const int64_t grid = params.split_begin + pieces;
  if (grid > 0x7fffffffLL) {
    throw std::runtime_error(std::string("flash_cuda: kernel ") + name + ": grid of " +
                             std::to_string(grid) + " blocks is out of range");
  }
  auto kernel = flash_bwd_dkdv_simt_kernel<Cfg, kAtomicDQ, kPlain>;
  set_smem_limit(kernel, bwd_dkdv_smem_bytes<Cfg>(), name);
  kernel<<<static_cast<unsigned>(grid), Cfg::kThreads, bwd_dkdv_smem_bytes<Cfg>(), stream>>>(
      params);
  check_launch(name);
  const int64_t threads = (num_blocks - params.split_begin) * Cfg::kRows * (params.d / 4);
  sum_split_dkdv_kernel<Cfg::kRows>
      <<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(params, pieces);
  check_launch("flash_bwd_sum_split_dkdv");
}

template <typename Cfg>
void launch_bwd_dq(const BwdParams& params, cudaStream_t stream) {
  if (variant_of(params, true) == kPlain) {
    launch_simt(flash_bwd_dq_simt_kernel<Cfg, kPlain>, params, Cfg::kThreads,
                bwd_dq_smem_bytes<Cfg>(), params.sq, Cfg::kRows, params.hq, "flash_bwd_dq_simt",
                stream);
  } else {  // kExtended and kSoftcapGrad
    launch_simt(flash_bwd_dq_simt_kernel<Cfg, kExtended>, params, Cfg::kThreads,
                bwd_dq_smem_bytes<Cfg>(true), params.sq, Cfg::kRows, params.hq,
                "flash_bwd_dq_simt", stream);
  }
}

}  // namespace simt

// The dK/dV configuration run_bwd_simt will launch, handed to `fn`.
template <int kHeadDim, typename Fn>
auto with_dkdv_config(const BwdParams& params, Fn&& fn) {
  using Traits = simt::SimtBwdTraits<kHeadDim>;
  const size_t smem_optin = device_smem_optin();
  if (simt::dq_by_atomics(params)) {
    if (simt::bwd_dkdv_smem_bytes<typename Traits::AtomicDkdvConfig>() <= smem_optin)
      return fn(typename Traits::AtomicDkdvConfig{}, std::true_type{});
    return fn(typename Traits::CompactAtomicDkdvConfig{}, std::true_type{});
  }
  if (simt::bwd_dkdv_smem_bytes<typename Traits::DkdvConfig>() <= smem_optin)
    return fn(typename Traits::DkdvConfig{}, std::false_type{});
  return fn(typename Traits::CompactDkdvConfig{}, std::false_type{});
}

template <int kHeadDim>
int64_t plan_bwd_simt(BwdParams& params) {
  if (!bwd_wants_dkdv(params)) return 0;  // no dK/dV kernel, nothing to split
  return with_dkdv_config<kHeadDim>(params, [&](auto cfg, auto atomic) {
    return simt::plan_bwd_dkdv<decltype(cfg), decltype(atomic)::value>(params);
  });
}

template <int kHeadDim>
void run_bwd_simt(const BwdParams& params, cudaStream_t stream) {
  using Traits = simt::SimtBwdTraits<kHeadDim>;
  simt::check_simt_args(params, kHeadDim, "flash_bwd_simt");
  const size_t smem_optin = device_smem_optin();

  // 1. delta = rowsum(dO * O) - dlse
  launch_bwd_preprocess<float>(params, stream);

  // 2. dK, dV: each CTA owns its keys and loops over the whole GQA group (the split last
  //    wave's pieces own a range of its steps and are summed after). Not deterministic: dQ is
  //    added with atomics into params.dq, which the binding zero-filled (5 products; dQ is not
  //    bitwise reproducible run to run), and there is no dQ kernel. Deterministic: 7
  //    products, no atomics, bitwise reproducible. A call that wants one side only runs that
  //    side's kernel, without atomics (simt::dq_by_atomics).
  if (bwd_wants_dkdv(params)) {
    with_dkdv_config<kHeadDim>(params, [&](auto cfg, auto atomic) {
      simt::launch_bwd_dkdv<decltype(cfg), decltype(atomic)::value>(params, stream);
    });
  }
  if (!bwd_wants_dq(params) || simt::dq_by_atomics(params)) return;

  // 3. dQ (no atomics: each CTA owns its query rows)
  if (simt::bwd_dq_smem_bytes<typename Traits::DqConfig>() <= smem_optin) {
    simt::launch_bwd_dq<typename Traits::DqConfig>(params, stream);
  } else {
    simt::launch_bwd_dq<typename Traits::CompactDqConfig>(params, stream);
  }
}

}  // namespace flash_cuda
