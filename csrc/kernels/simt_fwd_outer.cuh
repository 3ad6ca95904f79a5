// simt_fwd_outer.cuh — the fp32 forward for head dims 97-128 on GPUs with >= 192 KiB of shared
// memory per block (H100/H200): the same algorithm and blocks as simt_fwd.cuh, but both products
// are written as register *outer products* over transposed shared-memory operands.
//
// Why a second formulation. The products of simt_fwd.cuh read float4s along the reduction
// dimension (4 consecutive head-dim columns of a Q row and of a K row). Inside such a step,
// component c of a Q float4 always meets component c of a K float4, and the registers of a
// float4 are 4 consecutive registers starting at a multiple of 4. The register file has two
// banks (even / odd register numbers); an FFMA whose three source registers are not all
// served by the operand-reuse cache can read at most one register per bank per cycle, so
// "Q.x * K.x + acc" costs an extra cycle whenever acc has the parity of x. No accumulator
// layout avoids it, because the parity of the operands flips every step. Nsight Compute shows
// the cost as "dispatch stall": 15% of all warp samples in that kernel at D=128.
//
// Here the reduction index k is the *row* of both shared operands:
//   sQt[k][query]  (Q transposed, scaled by scale * log2 e)     sKt[k][key]  (K transposed)
// so one k step loads the thread's 8 query values (two float4 of consecutive queries) and its
// 4 key values (one float4) and does the 8x4 outer product acc[i][j] += q[i] * k[j]. The
// parity of q[i] depends only on i and that of k[j] only on j, so ptxas can place the 32
// accumulators in registers that never collide with the operand they meet, and the products
// are issued in "snake" order (row i even: j ascending, odd: descending) so that one operand
// is always in the reuse cache. PV is the same: sPt[key][query] (P transposed) times V[key][d].
// Dispatch stalls fall to 5% and the forward runs ~6% faster (OPTIMIZATION.md, "fp32 outer").
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
// (Q's staging tile, [128][D], lives in sV + sPt during the prologue.)
//
// Pipeline per key block n (two barriers, like simt_fwd.cuh):
//   barrier A  -> sKt holds K_n; every warp finished PV(n-1), so sV and sPt are free
//   start V_n copy;  S = Q K_n^T; merge stats; P = 2^(S - m); store P^T
//   wait (V_n, K_{n+1} copies); barrier B -> sPt, sV visible; every warp finished S(n)
//   transpose own K_{n+1} blocks into sKt; start K_{n+2} copy into the own staging slots
//   O += P V_n
#pragma once

#include "simt_fwd.cuh"

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
  // Unrolled chunk lengths of the two products (k steps of QK^T, keys of PV): measured on the
  // H200; the larger chunk halves the loop-carried prefetch boundaries (+0.5%).
  static constexpr int kChunkK = 64;
  static constexpr int kChunkC = 32;

  static constexpr int kQt = kHeadDim * kRows;
  static constexpr int kKt = kHeadDim * kCols;
  static constexpr int kKs = kCols * kHeadDim;
  static constexpr int kV = kCols * kHeadDim;
  static constexpr int kPt = kCols * kRows;
  static constexpr size_t kSmemBytes = sizeof(float) * (kQt + kKt + kKs + kV + kPt);

  static_assert(kHeadDim == 64 || kHeadDim == 128, "O columns are 4*cg + 64*h");
  static_assert(kRows * kHeadDim <= kV + kPt, "Q's staging tile fits in sV + sPt");
  static_assert(kChunkC % 16 == 0, "sPt swizzle phase is constant per 16 keys");
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
// Rows >= rows_valid and columns >= d are zero-filled.
template <int kTileRows, int kHeadDim, int kThreads>
__device__ __forceinline__ void load_quad_blocks_async(float* stage, const float* gmem,
                                                       int64_t row_stride, int rows_valid, int d,
                                                       int tid) {
  using B = QuadBlocks<kTileRows, kHeadDim, kThreads>;
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

// acc[i][j] += a[i] * b[j] in snake order: consecutive FFMAs share a[i] (same row) or, at a
// row change, b[j], so one source register always comes from the operand-reuse cache.
template <int kM, int kN>
__device__ __forceinline__ void outer_product(float (&acc)[kM][kN], const float (&a)[kM],
                                              const float (&b)[kN]) {
#pragma unroll
  for (int i = 0; i < kM; ++i) {
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
// entries -inf, and each row's block max (over the 16 lanes of the row group).
// qt = sQt + 4*rg, kt = sKt + 4*cg. k runs in chunks of kChunkK while k < d (rows of sQt/sKt
// past d are zero). The next step's three float4s (two per chunk boundary) are loaded before
// the current step's 32 FFMAs, across chunk boundaries too.
template <typename Cfg>
__device__ __forceinline__ void compute_qk_scores_and_max(float (&s)[Cfg::kTM][Cfg::kTN],
                                                          float (&block_max)[Cfg::kTM],
                                                          const float* qt, const float* kt, int d,
                                                          bool mask_active, int q0, int k0,
                                                          int sk, int causal_offset, bool causal,
                                                          int rg, int cg) {
  constexpr int kRows = Cfg::kRows, kCols = Cfg::kCols, kChunk = Cfg::kChunkK;
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i)
#pragma unroll
    for (int j = 0; j < Cfg::kTN; ++j) s[i][j] = 0.f;

  // Two k steps per iteration, prefetching the next two.
  float4 qa[2], qb[2], kv[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    qa[u] = lds4(qt + u * kRows);
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
          nqa[u] = lds4(qt + (k + 2 + u) * kRows);
          nqb[u] = lds4(qt + (k + 2 + u) * kRows + 64);
          nkv[u] = lds4(kt + (k + 2 + u) * kCols);
        }
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        float a[Cfg::kTM], b[Cfg::kTN];
        unpack4(a, 0, qa[u]);
        unpack4(a, 4, qb[u]);
        unpack4(b, 0, kv[u]);
        outer_product<Cfg::kTM, Cfg::kTN>(s, a, b);
      }
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        qa[u] = nqa[u];
        qb[u] = nqb[u];
        kv[u] = nkv[u];
      }
    }
    qt += kChunk * kRows;
    kt += kChunk * kCols;
  }

  if (mask_active) {
#pragma unroll
    for (int i = 0; i < Cfg::kTM; ++i)
#pragma unroll
      for (int j = 0; j < Cfg::kTN; ++j)
        if (!key_visible(q0 + query_row(rg, i), k0 + 4 * cg + j, sk, causal_offset, causal))
          s[i][j] = -INFINITY;
  }
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) {
    block_max[i] = group_max<Cfg::kG>(fmaxf(fmaxf(s[i][0], s[i][1]), fmaxf(s[i][2], s[i][3])));
  }
}

// m' = max(m, block max); l and O (relative to the old max) are rescaled by 2^(m - m').
// Once the running maxima settle, a block rarely raises any of them: a warp whose 16 rows all
// keep their max skips the 8 x kTD FMULs (warp-uniform branch; alpha would be exactly 1).
// A row with no visible key keeps m = -inf and alpha = 2^(-inf) = 0 via safe_max, as in the
// other tiers.
template <typename Cfg>
__device__ __forceinline__ void merge_block_stats(const float (&block_max)[Cfg::kTM],
                                                  float (&row_max)[Cfg::kTM],
                                                  float (&row_sum)[Cfg::kTM],
                                                  float (&o)[Cfg::kTM][Cfg::kTD]) {
  bool grew = false;
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) grew |= block_max[i] > row_max[i];
  if (__any_sync(0xffffffffu, grew)) simt::merge_block_stats<Cfg>(block_max, row_max, row_sum, o);
}

// P = 2^(S - m), l += row sums, P^T -> sPt, then O += P V.
// sPt is [key][query]; key row c stores query chunk q4 at chunk q4 ^ ((c / 4) % 4), so the 8
// lanes of a store phase (8 consecutive key quads, one query chunk) hit different banks.
// pt_store = sPt + 4*cg*kRows + 4*(rg ^ (cg % 4)): this thread's 4 key rows, first chunk.
// `on_p_stored` waits for V, runs the barrier, and moves the next K block (see the kernel).
template <typename Cfg, typename OnPStored>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(
    float (&s)[Cfg::kTM][Cfg::kTN], const float (&row_max)[Cfg::kTM], float (&row_sum)[Cfg::kTM],
    float (&o)[Cfg::kTM][Cfg::kTD], float* pt_store, const float* sPt, const float* sV, int rg,
    int cg, OnPStored&& on_p_stored) {
  constexpr int kRows = Cfg::kRows, kD = Cfg::kHeadDim, kChunk = Cfg::kChunkC;
  exponentiate_rows<Cfg::kTM, Cfg::kTN>(s, row_max, row_sum);
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
  pa = lds4(pt + 4 * rg);
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
        npa = lds4(pt + (c + 1) * kRows + 4 * q4);
        npb = lds4(pt + (c + 1) * kRows + 4 * q4 + 64);
#pragma unroll
        for (int h = 0; h < Cfg::kTD / 4; ++h) nvv[h] = lds4(v + (c + 1) * kD + 64 * h);
      }
      float a[Cfg::kTM], b[Cfg::kTD];
      unpack4(a, 0, pa);
      unpack4(a, 4, pb);
#pragma unroll
      for (int h = 0; h < Cfg::kTD / 4; ++h) unpack4(b, 4 * h, vv[h]);
      outer_product<Cfg::kTM, Cfg::kTD>(o, a, b);
      pa = npa;
      pb = npb;
#pragma unroll
      for (int h = 0; h < Cfg::kTD / 4; ++h) vv[h] = nvv[h];
    }
    pt += kChunk * kRows;
    v += kChunk * kD;
  }
}

// O /= l, lse = (m + log2 l) * ln 2 for the valid rows; a row that saw no key gets O = 0 and
// lse = -inf.
template <typename Cfg>
__device__ __forceinline__ void normalize_output(const float (&o)[Cfg::kTM][Cfg::kTD],
                                                 const float (&row_max)[Cfg::kTM],
                                                 const float (&row_sum)[Cfg::kTM], float* o_tile,
                                                 int64_t o_row_stride, float* lse_tile,
                                                 int rows_valid, int d, int rg, int cg) {
#pragma unroll
  for (int i = 0; i < Cfg::kTM; ++i) {
    const float l = group_sum<Cfg::kG>(row_sum[i]);
    const float inv_l = l == 0.f ? 0.f : 1.f / l;
    const int r = query_row(rg, i);
    if (r < rows_valid) {
      if (cg == 0) lse_tile[r] = l == 0.f ? -INFINITY : (row_max[i] + log2f(l)) * 0.69314718055994531f;
#pragma unroll
      for (int h = 0; h < Cfg::kTD / 4; ++h) {
        const int col = 4 * cg + 64 * h;
        if (col < d) {
          *reinterpret_cast<float4*>(o_tile + r * o_row_stride + col) =
              make_float4(o[i][4 * h] * inv_l, o[i][4 * h + 1] * inv_l, o[i][4 * h + 2] * inv_l,
                          o[i][4 * h + 3] * inv_l);
        }
      }
    }
  }
}

// =================================================================================
// Kernel and launcher
// =================================================================================

template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) flash_fwd_simt_outer_kernel(const FwdParams p) {
  constexpr int kD = Cfg::kHeadDim, kRows = Cfg::kRows, kCols = Cfg::kCols;
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kTD = Cfg::kTD, kThreads = Cfg::kThreads;

  extern __shared__ float4 smem_f4[];
  float* sQt = reinterpret_cast<float*>(smem_f4);
  float* sKt = sQt + Cfg::kQt;
  float* sKs = sKt + Cfg::kKt;
  float* sV = sKs + Cfg::kKs;
  float* sPt = sV + Cfg::kV;
  float* sQs = sV;  // Q staging, prologue only

  const int tid = static_cast<int>(threadIdx.x);
  const int rg = tid / Cfg::kG;
  const int cg = tid % Cfg::kG;

  const FwdQueryBlock blk = FwdQueryBlock::make<kRows, kCols>(p);
  const int bi = blk.bi, hi = blk.hi, m0 = blk.m0, rows_valid = blk.rows_valid;
  const int causal_offset = blk.causal_offset, num_n_blocks = blk.num_n_blocks;
  const float *q = blk.q, *k = blk.k, *v = blk.v;

  float o[kTM][kTD];
  float row_max[kTM], row_sum[kTM];
  init_row_state(o, row_max, row_sum);

  if (num_n_blocks > 0) {
    // Prologue: Q and K_0 through staging, transposed (Q scaled); K_1 starts at once.
    load_quad_blocks_async<kRows, kD, kThreads>(sQs, q, p.q_row_stride, rows_valid, p.d, tid);
    load_quad_blocks_async<kCols, kD, kThreads>(sKs, k, p.k_row_stride, p.sk, p.d, tid);
    cp_async_commit();
    cp_async_wait<0>();
    transpose_quad_blocks<kRows, kD, kThreads>(sQt, sQs, p.scale_log2, tid);
    transpose_quad_blocks<kCols, kD, kThreads>(sKt, sKs, 1.f, tid);
    if (num_n_blocks > 1) {
      load_quad_blocks_async<kCols, kD, kThreads>(sKs, k + kCols * p.k_row_stride, p.k_row_stride,
                                                  p.sk - kCols, p.d, tid);
    }
    cp_async_commit();

    const float* qt = sQt + 4 * rg;
    const float* kt = sKt + 4 * cg;
    float* pt_store = sPt + 4 * cg * kRows + 4 * (rg ^ (cg % 4));

    for (int n_block = 0; n_block < num_n_blocks; ++n_block) {
      const int n0 = n_block * kCols;
      __syncthreads();  // A: sKt = K_n; sV, sPt (and, for n = 0, Q's staging) free
      load_tile_async<kCols, kD, kD, kThreads>(sV, v + n0 * p.v_row_stride, p.v_row_stride,
                                               p.sk - n0, p.d, tid);
      cp_async_commit();

      const bool mask_active =
          (n0 + kCols > p.sk) || (p.is_causal && n0 + kCols - 1 > m0 + causal_offset);
      float s[kTM][kTN];
      float block_max[kTM];
      compute_qk_scores_and_max<Cfg>(s, block_max, qt, kt, p.d, mask_active, m0, n0, p.sk,
                                     causal_offset, p.is_causal, rg, cg);
      merge_block_stats<Cfg>(block_max, row_max, row_sum, o);

      const bool has_next = n_block + 1 < num_n_blocks;
      compute_block_softmax_and_weighted_v<Cfg>(s, row_max, row_sum, o, pt_store, sPt, sV, rg, cg,
                                                [&]() {
        cp_async_wait<0>();  // V_n and K_{n+1} landed
        __syncthreads();     // B: P^T and V_n visible; every warp is done with sKt
        if (has_next) {
          transpose_quad_blocks<kCols, kD, kThreads>(sKt, sKs, 1.f, tid);
          if (n_block + 2 < num_n_blocks) {
            load_quad_blocks_async<kCols, kD, kThreads>(
                sKs, k + (n0 + 2 * kCols) * p.k_row_stride, p.k_row_stride, p.sk - n0 - 2 * kCols,
                p.d, tid);
          }
          cp_async_commit();
        }
      });
    }
  }

  float* o_tile = static_cast<float*>(p.o) + bi * p.o_batch_stride + hi * p.o_head_stride +
                  m0 * p.o_row_stride;
  float* lse_tile = p.softmax_lse + lse_offset(p, bi, hi) + m0;
  normalize_output<Cfg>(o, row_max, row_sum, o_tile, p.o_row_stride, lse_tile, rows_valid, p.d, rg,
                        cg);
}

template <typename Cfg>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  launch_simt(flash_fwd_simt_outer_kernel<Cfg>, params, Cfg::kThreads, Cfg::kSmemBytes, params.sq,
              Cfg::kRows, params.hq, "flash_fwd_simt_outer", stream);
}

}  // namespace outer
}  // namespace simt

// fp32 forward entry point for one head-dim bucket: the outer-product kernel where the
// traits ask for it and the device has its shared memory, else the largest TileConfig that fits.
template <int kHeadDim>
void run_fwd_simt(const FwdParams& params, cudaStream_t stream) {
  using Traits = simt::SimtFwdTraits<kHeadDim>;
  simt::check_simt_args(params, kHeadDim, "flash_fwd_simt");
  if constexpr (Traits::kOuter) {
    using Outer = simt::outer::OuterConfig<kHeadDim>;
    if (Outer::kSmemBytes <= device_smem_optin()) {
      simt::outer::launch_fwd<Outer>(params, stream);
      return;
    }
  }
  if (simt::fwd_smem_bytes<typename Traits::Config>() <= device_smem_optin()) {
    simt::launch_fwd<typename Traits::Config>(params, stream);
  } else {
    simt::launch_fwd<typename Traits::CompactConfig>(params, stream);
  }
}

}  // namespace flash_cuda
