// simt_bwd.cuh — the fp32 tier of flash_cuda: FlashAttention-2 backward on CUDA cores.
//
// True fp32 FFMA arithmetic throughout (no TF32, no tensor cores). With P = softmax(scale*QK^T)
// recomputed from the forward's lse:
//   P  = exp(scale * Q K^T - lse) = 2^(Q K^T * scale * log2 e - lse * log2 e)
//   dV = P^T dO        dP = dO V^T        dS = P * (dP - delta)
//   dK = scale * dS^T Q                    dQ = scale * dS K
// where delta_i = rowsum(dO_i * O_i) - dlse_i comes from bwd_preprocess.cuh.
//
// run_bwd_simt<kHeadDim> launches three kernels, deterministic by construction (no atomics,
// every gradient element is written exactly once by one thread):
//   1. bwd_preprocess_delta_kernel<float>                       delta
//   2. flash_bwd_dkdv_simt_kernel: a CTA owns a block of keys of one (batch, kv head). It keeps
//      its K and V tiles in shared memory and dK, dV in registers, loops over the query heads of
//      its GQA group and over the query blocks that can see its keys, and writes dK, dV once.
//   3. flash_bwd_dq_simt_kernel: a CTA owns a block of query rows of one (batch, query head),
//      keeps Q and dO in shared memory and dQ in registers, loops over the key blocks the rows
//      can see (recomputing P and dP), and writes dQ once.
// Kernel 3 recomputes two of the five products of kernel 2; that is the price of writing dQ
// without atomics.
//
// Both kernels reuse the thread grid, loaders and register-blocked products of simt_fwd.cuh
// (read that file first): "rows" are the operand a CTA owns (keys in kernel 2, queries in
// kernel 3), "cols" the operand it streams.
#pragma once

#include "bwd_preprocess.cuh"
#include "simt_fwd.cuh"

namespace flash_cuda {
namespace simt {

// =================================================================================
// Tile configurations
// =================================================================================
//
// dK/dV kernel (rows = keys, cols = queries). Registers hold dK and dV (2 * kTM * kTD), the
// P tile and the dP tile (kTM * kTN each). Shared memory holds K, V, two query-side buffers
// (Q or dO, each with a row vector: lse or delta) and the P^T, dS^T tiles:
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
// The Compact* configurations fit in 99 KB (sm_86 / sm_89; sm_80 for D >= 128); the launcher
// uses them only when the device cannot give the first ones their shared memory.
template <int kHeadDim> struct SimtBwdTraits;
template <> struct SimtBwdTraits<32> {
  using DkdvConfig = TileConfig<32, 64, 64, 4, 8, 2>;
  using DqConfig = TileConfig<32, 64, 64, 4, 8, 2>;
  using CompactDkdvConfig = DkdvConfig;
  using CompactDqConfig = DqConfig;
};
template <> struct SimtBwdTraits<64> {
  using DkdvConfig = TileConfig<64, 64, 64, 4, 8, 2>;
  using DqConfig = TileConfig<64, 64, 64, 4, 8, 2>;
  using CompactDkdvConfig = TileConfig<64, 64, 32, 4, 8, 2>;  // 73 KB
  using CompactDqConfig = DqConfig;
};
template <> struct SimtBwdTraits<128> {
  using DkdvConfig = TileConfig<128, 64, 64, 4, 16, 1>;
  using DqConfig = TileConfig<128, 128, 32, 4, 8, 1>;
  using CompactDkdvConfig = TileConfig<128, 32, 32, 2, 16, 1>;  // 80 KB
  using CompactDqConfig = TileConfig<128, 32, 32, 2, 16, 1>;    // 74 KB
};
template <> struct SimtBwdTraits<256> {
  using DkdvConfig = TileConfig<256, 64, 32, 4, 16, 1>;
  using DqConfig = TileConfig<256, 64, 32, 4, 16, 1>;
  using CompactDkdvConfig = TileConfig<256, 16, 16, 1, 16, 1>;  // 71 KB
  using CompactDqConfig = TileConfig<256, 16, 16, 1, 16, 1>;    // 69 KB
};

// 4-byte cp.async (cp.async.ca supports 4, 8 and 16 bytes) with zero fill: loads the per-row
// vectors lse and delta, whose blocks start at arbitrary (4-byte aligned) addresses.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_size));
}

// lse (natural log) -> the exponent offset in log2 units. A row that saw no key in the forward
// has lse = -inf; mapping it to +inf makes P = 2^(s - inf) = 0 for every key (never NaN, and
// for masked s = -inf too: 2^(-inf - inf) = 0).
__device__ __forceinline__ float lse_to_log2_offset(float lse) {
  return lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
}

// =================================================================================
// dK / dV kernel
// =================================================================================
//
// Shared memory: sK [kRows][kLdHead] | sV [kRows][kLdHead] | buf0 | buf1 | sP [kRows][kLdScore]
//                | sdS [kRows][kLdScore],  buf = [kCols][kLdHead] tile + kCols row vector.
// Step t (one query block m of one query head h) uses Q_t (+ its lse) in buf[t % 2] and dO_t
// (+ its delta) in buf[(t + 1) % 2]; the two buffers swap roles every step:
//
//   P1  S^T = K Q_t^T -> P^T = 2^(S^T - lse)                    [reads sK, Q_t]
//       wait dO_t, barrier
//   P2  dP^T = V dO_t^T -> dS^T = P^T * (dP^T - delta); store P^T, dS^T     [sV, dO_t]
//       barrier                        (sP, sdS complete)
//   P3  dV += P^T dO_t                                           [sP, dO_t]
//       barrier -> dO_t's buffer is free: start Q_{t+1} there    (lands during P4)
//   P4  dK += dS^T Q_t                                           [sdS, Q_t]
//       wait Q_{t+1}, barrier -> Q_t's buffer is free: start dO_{t+1} there (lands during P1)
//
// K is stored pre-multiplied by scale * log2(e) (it is only used for S), so S^T comes out in
// log2 units. Q (used for S and for dK) and dO stay unscaled. dK gets its factor `scale` once,
// when written.
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    flash_bwd_dkdv_simt_kernel(const BwdParams p) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kTD = Cfg::kTD;
  constexpr int kRows = Cfg::kRows, kCols = Cfg::kCols, kD = Cfg::kHeadDim;
  constexpr int kLdH = Cfg::kLdHead, kLdS = Cfg::kLdScore;
  constexpr int kRG = Cfg::kRowGroups, kG = Cfg::kG;
  constexpr int kBufFloats = kCols * kLdH + kCols;  // a multiple of 4: buffers stay 16-byte aligned

  extern __shared__ float4 smem_f4[];
  float* sK = reinterpret_cast<float*>(smem_f4);
  float* sV = sK + kRows * kLdH;
  float* sBuf = sV + kRows * kLdH;  // buf b at sBuf + b * kBufFloats, its vector after the tile
  float* sP = sBuf + 2 * kBufFloats;
  float* sdS = sP + kRows * kLdS;

  const int tid = static_cast<int>(threadIdx.x);
  const int rg = tid / kG;
  const int cg = tid % kG;

  // Grid order: under causal masking the first key blocks are seen by the most queries; they
  // get the low block indices and start first. Otherwise the blocks of one (batch, kv head) are
  // adjacent (they share Q and dO in L2).
  const int num_n_blocks = ceil_div(p.sk, kRows);
  const int bh_count = p.b * p.hkv;
  const int idx = static_cast<int>(blockIdx.x);
  const int n_block = p.is_causal ? idx / bh_count : idx % num_n_blocks;
  const int bh = p.is_causal ? idx % bh_count : idx / num_n_blocks;
  const int bi = bh / p.hkv;
  const int hk = bh - bi * p.hkv;
  const int group = p.hq / p.hkv;  // query heads hk*group .. hk*group + group - 1 read kv head hk
  const int n0 = n_block * kRows;
  const int keys_valid = p.sk - n0;  // >= 1

  // Query blocks that can see a key of this block: under causal masking query i sees key j iff
  // i >= j - causal_offset, so the first is m_begin = max(0, n0 - causal_offset).
  // Example: sq = sk = 256, 64-key blocks: key block n0 = 128 is seen from query 128 on, i.e.
  // from query block 128 / kCols. With sq = 64 < sk = 256 (offset 192), key block 0 is seen by
  // every query (m_begin = 0) and key block 192 too (192 - 192 = 0).
  const int causal_offset = p.sk - p.sq;
  const int m_begin = p.is_causal ? max(0, n0 - causal_offset) : 0;
  const int num_m_blocks = ceil_div(p.sq, kCols);
  const int m_first = m_begin < p.sq ? m_begin / kCols : num_m_blocks;
  const int steps_per_head = num_m_blocks - m_first;
  const int num_steps = steps_per_head * group;

  const float* k = static_cast<const float*>(p.k) + bi * p.k_batch_stride + hk * p.k_head_stride +
                   n0 * p.k_row_stride;
  const float* v = static_cast<const float*>(p.v) + bi * p.v_batch_stride + hk * p.v_head_stride +
                   n0 * p.v_row_stride;

  // Step t -> (query head, first query row): the steps run over the query blocks m_first ..
  // num_m_blocks - 1 of the first head of the group, then of the next head, and so on.
  // The kCols-float row vector of each buffer holds lse (next to Q) or delta (next to dO) for
  // the step's query rows.
  auto step_head = [&](int t) { return hk * group + t / steps_per_head; };
  auto step_m0 = [&](int t) { return (m_first + t % steps_per_head) * kCols; };
  static_assert(kCols <= Cfg::kThreads, "one thread per row-vector element");
  auto load_row_vector = [&](float* dst, const float* src_rows, int rows_valid) {
    if (tid < kCols) {
      const bool valid = tid < rows_valid;
      cp_async_4(dst + tid, valid ? src_rows + tid : src_rows, valid);
    }
  };
  auto load_q = [&](int h, int m0, float* buf) {
    const float* q = static_cast<const float*>(p.q) + bi * p.q_batch_stride + h * p.q_head_stride +
                     m0 * p.q_row_stride;
    load_tile_async<kCols, kD, kLdH, Cfg::kThreads>(buf, q, p.q_row_stride, p.sq - m0, p.d, tid);
    load_row_vector(buf + kCols * kLdH, p.softmax_lse + lse_offset(p, bi, h) + m0, p.sq - m0);
  };
  auto load_do = [&](int h, int m0, float* buf) {
    const float* dO = static_cast<const float*>(p.dout) + bi * p.do_batch_stride +
                      h * p.do_head_stride + m0 * p.do_row_stride;
    load_tile_async<kCols, kD, kLdH, Cfg::kThreads>(buf, dO, p.do_row_stride, p.sq - m0, p.d, tid);
    load_row_vector(buf + kCols * kLdH, p.delta + lse_offset(p, bi, h) + m0, p.sq - m0);
  };

  float dk[kTM][kTD], dv[kTM][kTD];
#pragma unroll
  for (int i = 0; i < kTM; ++i)
#pragma unroll
    for (int c = 0; c < kTD; ++c) dk[i][c] = dv[i][c] = 0.f;

  if (num_steps > 0) {
    // Two groups: {K, Q_0, lse_0} then {V, dO_0, delta_0}.
    load_tile_async<kRows, kD, kLdH, Cfg::kThreads>(sK, k, p.k_row_stride, keys_valid, p.d, tid);
    load_q(step_head(0), step_m0(0), sBuf);
    cp_async_commit();
    load_tile_async<kRows, kD, kLdH, Cfg::kThreads>(sV, v, p.v_row_stride, keys_valid, p.d, tid);
    load_do(step_head(0), step_m0(0), sBuf + kBufFloats);
    cp_async_commit();
    cp_async_wait<1>();
    scale_own_chunks<kRows, kD, kLdH, Cfg::kThreads>(sK, p.scale_log2, tid);
    __syncthreads();

    const float* sK_row0 = sK + rg * kLdH;
    const float* sV_row0 = sV + rg * kLdH;

    int m0 = step_m0(0);
    for (int t = 0; t < num_steps; ++t) {
      float* bq = sBuf + (t & 1) * kBufFloats;         // Q_t, lse
      float* bdo = sBuf + ((t & 1) ^ 1) * kBufFloats;  // dO_t, delta
      const bool has_next = t + 1 < num_steps;
      const int h_next = has_next ? step_head(t + 1) : 0;
      const int m0_next = has_next ? step_m0(t + 1) : 0;

      // ---- P1: S^T = K Q^T (log2 units), mask, P^T = 2^(S^T - lse) ----
      // s[i][j]: key n0 + rg + kRG*i, query m0 + cg + kG*j.
      float s[kTM][kTN];
#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) s[i][j] = 0.f;
      gemm_nt<kTM, kTN, kRG * kLdH, kG * kLdH, kD>(s, sK_row0, bq + cg * kLdH, p.d);

      BlockMask mask;
      mask.active = (n0 + kRows > p.sk) || (p.is_causal && n0 + kRows - 1 > m0 + causal_offset);
      mask.row0 = n0 + rg;
      mask.col0 = m0 + cg;
      mask.sk = p.sk;
      mask.causal_offset = causal_offset;
      mask.causal = p.is_causal;
      if (mask.active) apply_mask<false, kTM, kTN, kRG, kG>(s, mask);

      // Query rows past sq were zero-filled (Q, dO, lse, delta = 0): they give finite P and
      // dS = P * (0 - 0) = 0, and their dO / Q rows are 0, so they add nothing.
#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        const float lse2 = lse_to_log2_offset(bq[kCols * kLdH + cg + kG * j]);
#pragma unroll
        for (int i = 0; i < kTM; ++i) s[i][j] = fast_exp2(s[i][j] - lse2);
      }

      cp_async_wait<0>();  // dO_t landed
      __syncthreads();

      // ---- P2: dP^T = V dO^T, dS^T = P^T * (dP^T - delta); publish P^T and dS^T ----
      float dp[kTM][kTN];
#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) dp[i][j] = 0.f;
      gemm_nt<kTM, kTN, kRG * kLdH, kG * kLdH, kD>(dp, sV_row0, bdo + cg * kLdH, p.d);

#pragma unroll
      for (int j = 0; j < kTN; ++j) {
        const float delta = bdo[kCols * kLdH + cg + kG * j];
#pragma unroll
        for (int i = 0; i < kTM; ++i) {
          const int off = (rg + kRG * i) * kLdS + cg + kG * j;
          sP[off] = s[i][j];
          sdS[off] = s[i][j] * (dp[i][j] - delta);
        }
      }
      __syncthreads();

      // ---- P3: dV += P^T dO ----
      gemm_nn<kTM, kTD, kRG * kLdS, kLdH, 4 * kG, kCols>(dv, sP + rg * kLdS, bdo + 4 * cg);
      __syncthreads();  // every warp is done with dO_t: its buffer takes Q_{t+1}
      if (has_next) load_q(h_next, m0_next, bdo);
      cp_async_commit();

      // ---- P4: dK += dS^T Q (the factor `scale` is applied when dK is written) ----
      gemm_nn<kTM, kTD, kRG * kLdS, kLdH, 4 * kG, kCols>(dk, sdS + rg * kLdS, bq + 4 * cg);
      // Q_{t+1} landed and, after the barrier, is visible; every warp is done with Q_t, whose
      // buffer takes dO_{t+1}.
      cp_async_wait<0>();
      __syncthreads();
      if (has_next) load_do(h_next, m0_next, bq);
      cp_async_commit();
      m0 = m0_next;
    }
  }

  // Keys that no query can see (causal, or sq too short) get dK = dV = 0.
  float dk_scale[kTM], one[kTM];
#pragma unroll
  for (int i = 0; i < kTM; ++i) {
    dk_scale[i] = p.scale;
    one[i] = 1.f;
  }
  float* dk_tile = static_cast<float*>(p.dk) + bi * p.dk_batch_stride + hk * p.dk_head_stride +
                   n0 * p.dk_row_stride;
  float* dv_tile = static_cast<float*>(p.dv) + bi * p.dv_batch_stride + hk * p.dv_head_stride +
                   n0 * p.dv_row_stride;
  store_row_tile<Cfg>(dk_tile, p.dk_row_stride, keys_valid, p.d, dk, dk_scale, rg, cg);
  store_row_tile<Cfg>(dv_tile, p.dv_row_stride, keys_valid, p.d, dv, one, rg, cg);
}

// =================================================================================
// dQ kernel
// =================================================================================
//
// Shared memory: sQ [kRows][kLdHead] | sdO [kRows][kLdHead] | buf0 | buf1 | sdS [kRows][kLdScore],
// buf = [kCols][kLdHead]. Key block n keeps K_n in buf[n % 2] and V_n in buf[(n + 1) % 2]:
//
//   S = Q K_n^T -> P = 2^(S - lse)                                [sQ, K_n]
//   wait V_n, barrier
//   dP = dO V_n^T -> dS = P * (dP - delta); store dS               [sdO, V_n]
//   barrier -> V_n's buffer is free: start K_{n+1} there          (lands during the dQ product)
//   dQ += dS K_n                                                  [sdS, K_n]
//   wait K_{n+1}, barrier -> K_n's buffer is free: start V_{n+1} there (lands during S)
//
// Q is stored pre-multiplied by scale * log2(e) (it is only used for S). dQ gets `scale` when
// written.
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocksPerSm)
    flash_bwd_dq_simt_kernel(const BwdParams p) {
  constexpr int kTM = Cfg::kTM, kTN = Cfg::kTN, kTD = Cfg::kTD;
  constexpr int kRows = Cfg::kRows, kCols = Cfg::kCols, kD = Cfg::kHeadDim;
  constexpr int kLdH = Cfg::kLdHead, kLdS = Cfg::kLdScore;
  constexpr int kRG = Cfg::kRowGroups, kG = Cfg::kG;
  constexpr int kBufFloats = kCols * kLdH;

  extern __shared__ float4 smem_f4[];
  float* sQ = reinterpret_cast<float*>(smem_f4);
  float* sdO = sQ + kRows * kLdH;
  float* sBuf = sdO + kRows * kLdH;
  float* sdS = sBuf + 2 * kBufFloats;

  const int tid = static_cast<int>(threadIdx.x);
  const int rg = tid / kG;
  const int cg = tid % kG;

  int m_block, bh;
  query_block_order(ceil_div(p.sq, kRows), p.b * p.hq, p.is_causal, m_block, bh);
  const int bi = bh / p.hq;
  const int hi = bh - bi * p.hq;
  const int hk = hi / (p.hq / p.hkv);
  const int m0 = m_block * kRows;
  const int rows_valid = p.sq - m0;

  // Key blocks seen by the valid rows of this block (same rule as the forward).
  const int causal_offset = p.sk - p.sq;
  int n_end = p.sk;
  if (p.is_causal) n_end = min(n_end, min(m0 + kRows, p.sq) + causal_offset);
  const int num_n_blocks = n_end > 0 ? ceil_div(n_end, kCols) : 0;

  const float* q = static_cast<const float*>(p.q) + bi * p.q_batch_stride + hi * p.q_head_stride +
                   m0 * p.q_row_stride;
  const float* dO = static_cast<const float*>(p.dout) + bi * p.do_batch_stride +
                    hi * p.do_head_stride + m0 * p.do_row_stride;
  const float* k = static_cast<const float*>(p.k) + bi * p.k_batch_stride + hk * p.k_head_stride;
  const float* v = static_cast<const float*>(p.v) + bi * p.v_batch_stride + hk * p.v_head_stride;

  // Per-row lse (as a log2 offset) and delta of this thread's rows. Rows past sq: 0 (their
  // Q and dO rows are zero, so they produce finite values that are never written).
  float lse2[kTM], delta[kTM];
  {
    const int64_t row_base = lse_offset(p, bi, hi) + m0;
#pragma unroll
    for (int i = 0; i < kTM; ++i) {
      const int r = rg + kRG * i;
      lse2[i] = r < rows_valid ? lse_to_log2_offset(p.softmax_lse[row_base + r]) : 0.f;
      delta[i] = r < rows_valid ? p.delta[row_base + r] : 0.f;
    }
  }

  float dq[kTM][kTD];
#pragma unroll
  for (int i = 0; i < kTM; ++i)
#pragma unroll
    for (int c = 0; c < kTD; ++c) dq[i][c] = 0.f;

  if (num_n_blocks > 0) {
    // Two groups: {Q, dO, K_0} then {V_0}.
    load_tile_async<kRows, kD, kLdH, Cfg::kThreads>(sQ, q, p.q_row_stride, rows_valid, p.d, tid);
    load_tile_async<kRows, kD, kLdH, Cfg::kThreads>(sdO, dO, p.do_row_stride, rows_valid, p.d, tid);
    load_tile_async<kCols, kD, kLdH, Cfg::kThreads>(sBuf, k, p.k_row_stride, p.sk, p.d, tid);
    cp_async_commit();
    load_tile_async<kCols, kD, kLdH, Cfg::kThreads>(sBuf + kBufFloats, v, p.v_row_stride, p.sk,
                                                    p.d, tid);
    cp_async_commit();
    cp_async_wait<1>();
    scale_own_chunks<kRows, kD, kLdH, Cfg::kThreads>(sQ, p.scale_log2, tid);
    __syncthreads();

    const float* sQ_row0 = sQ + rg * kLdH;
    const float* sdO_row0 = sdO + rg * kLdH;

    for (int n_block = 0; n_block < num_n_blocks; ++n_block) {
      const int n0 = n_block * kCols;
      float* bk = sBuf + (n_block & 1) * kBufFloats;         // K_n
      float* bv = sBuf + ((n_block & 1) ^ 1) * kBufFloats;   // V_n

      // ---- S = Q K^T (log2 units), mask, P = 2^(S - lse) ----
      // s[i][j]: query m0 + rg + kRG*i, key n0 + cg + kG*j.
      float s[kTM][kTN];
#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) s[i][j] = 0.f;
      gemm_nt<kTM, kTN, kRG * kLdH, kG * kLdH, kD>(s, sQ_row0, bk + cg * kLdH, p.d);

      // Keys past sk must be masked here: their (zero) K rows give s = 0 and P = 2^(-lse), which
      // can overflow to inf for a very negative lse; inf * 0 would then be NaN.
      BlockMask mask;
      mask.active = (n0 + kCols > p.sk) || (p.is_causal && n0 + kCols - 1 > m0 + causal_offset);
      mask.row0 = m0 + rg;
      mask.col0 = n0 + cg;
      mask.sk = p.sk;
      mask.causal_offset = causal_offset;
      mask.causal = p.is_causal;
      if (mask.active) apply_mask<true, kTM, kTN, kRG, kG>(s, mask);

#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) s[i][j] = fast_exp2(s[i][j] - lse2[i]);

      cp_async_wait<0>();  // V_n landed
      __syncthreads();

      // ---- dP = dO V^T, dS = P * (dP - delta) -> sdS ----
      float dp[kTM][kTN];
#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j) dp[i][j] = 0.f;
      gemm_nt<kTM, kTN, kRG * kLdH, kG * kLdH, kD>(dp, sdO_row0, bv + cg * kLdH, p.d);

#pragma unroll
      for (int i = 0; i < kTM; ++i)
#pragma unroll
        for (int j = 0; j < kTN; ++j)
          sdS[(rg + kRG * i) * kLdS + cg + kG * j] = s[i][j] * (dp[i][j] - delta[i]);
      __syncthreads();  // dS complete; every warp is done with V_n: its buffer takes K_{n+1}
      if (n_block + 1 < num_n_blocks) {
        load_tile_async<kCols, kD, kLdH, Cfg::kThreads>(
            bv, k + (n0 + kCols) * p.k_row_stride, p.k_row_stride, p.sk - n0 - kCols, p.d, tid);
      }
      cp_async_commit();

      // ---- dQ += dS K (the factor `scale` is applied when dQ is written) ----
      gemm_nn<kTM, kTD, kRG * kLdS, kLdH, 4 * kG, kCols>(dq, sdS + rg * kLdS, bk + 4 * cg);
      // K_{n+1} landed and, after the barrier, is visible; every warp is done with K_n, whose
      // buffer takes V_{n+1}.
      cp_async_wait<0>();
      __syncthreads();
      if (n_block + 1 < num_n_blocks) {
        load_tile_async<kCols, kD, kLdH, Cfg::kThreads>(
            bk, v + (n0 + kCols) * p.v_row_stride, p.v_row_stride, p.sk - n0 - kCols, p.d, tid);
      }
      cp_async_commit();
    }
  }

  // Rows that see no key get dQ = 0.
  float dq_scale[kTM];
#pragma unroll
  for (int i = 0; i < kTM; ++i) dq_scale[i] = p.scale;
  float* dq_tile = static_cast<float*>(p.dq) + bi * p.dq_batch_stride + hi * p.dq_head_stride +
                   m0 * p.dq_row_stride;
  store_row_tile<Cfg>(dq_tile, p.dq_row_stride, rows_valid, p.d, dq, dq_scale, rg, cg);
}

template <typename Cfg>
constexpr size_t bwd_dkdv_smem_bytes() {
  return sizeof(float) * (2 * static_cast<size_t>(Cfg::kRows) * Cfg::kLdHead +
                          2 * (static_cast<size_t>(Cfg::kCols) * Cfg::kLdHead + Cfg::kCols) +
                          2 * static_cast<size_t>(Cfg::kRows) * Cfg::kLdScore);
}

template <typename Cfg>
constexpr size_t bwd_dq_smem_bytes() {
  return sizeof(float) * (2 * static_cast<size_t>(Cfg::kRows) * Cfg::kLdHead +
                          2 * static_cast<size_t>(Cfg::kCols) * Cfg::kLdHead +
                          static_cast<size_t>(Cfg::kRows) * Cfg::kLdScore);
}

template <typename Cfg>
void launch_bwd_dkdv(const BwdParams& params, cudaStream_t stream) {
  launch_simt(flash_bwd_dkdv_simt_kernel<Cfg>, params, Cfg::kThreads, bwd_dkdv_smem_bytes<Cfg>(),
              params.sk, Cfg::kRows, params.hkv, "flash_bwd_dkdv_simt", stream);
}

template <typename Cfg>
void launch_bwd_dq(const BwdParams& params, cudaStream_t stream) {
  launch_simt(flash_bwd_dq_simt_kernel<Cfg>, params, Cfg::kThreads, bwd_dq_smem_bytes<Cfg>(),
              params.sq, Cfg::kRows, params.hq, "flash_bwd_dq_simt", stream);
}

}  // namespace simt

template <int kHeadDim>
void run_bwd_simt(const BwdParams& params, cudaStream_t stream) {
  using Traits = simt::SimtBwdTraits<kHeadDim>;
  simt::check_simt_args(params, kHeadDim, "flash_bwd_simt");
  const size_t smem_optin = device_smem_optin();

  // 1. delta = rowsum(dO * O) - dlse
  launch_bwd_preprocess<float>(params, stream);

  // 2. dK, dV (no atomics: each CTA owns its keys and loops over the whole GQA group)
  if (simt::bwd_dkdv_smem_bytes<typename Traits::DkdvConfig>() <= smem_optin) {
    simt::launch_bwd_dkdv<typename Traits::DkdvConfig>(params, stream);
  } else {
    simt::launch_bwd_dkdv<typename Traits::CompactDkdvConfig>(params, stream);
  }

  // 3. dQ (no atomics: each CTA owns its query rows)
  if (simt::bwd_dq_smem_bytes<typename Traits::DqConfig>() <= smem_optin) {
    simt::launch_bwd_dq<typename Traits::DqConfig>(params, stream);
  } else {
    simt::launch_bwd_dq<typename Traits::CompactDqConfig>(params, stream);
  }
}

}  // namespace flash_cuda
