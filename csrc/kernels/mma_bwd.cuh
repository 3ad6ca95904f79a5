// mma_bwd.cuh — the fp16/bf16 tensor-core backward of flash_cuda (FlashAttention-2).
//
// Math (per query head; scores are kept in the log2 domain, scale_log2 = scale * log2 e):
//   P  = exp2(S * scale_log2 - lse * log2 e)      S = Q K^T, lse saved by the forward
//   dV = P^T dO
//   dP = dO V^T
//   dS = P * (dP - delta)                           delta = rowsum(dO * O) - dlse
//   dK = scale * dS^T Q
//   dQ = scale * dS K
//
// Three launches (four when the dK/dV kernel is split, see kSplitDKDV):
//   1. bwd_preprocess_delta  delta, one warp per query row (bwd_preprocess.cuh).
//   2. bwd_dkdv              one CTA per block of keys; each warp owns 16 * kMTiles keys and
//                            keeps their rows of dK and dV in registers while it walks over
//                            every query block (and, for GQA, every query head of the group)
//                            that can see them. dK/dV are written once.
//   3. bwd_dq                one CTA per block of queries; each warp owns 16 * kMTiles query
//                            rows and keeps their rows of dQ in registers while it walks over
//                            the key blocks they can see. dQ is written once.
// Nothing is accumulated with atomics, so gradients are bitwise reproducible and
// params.deterministic holds whatever its value (params.dq_accum is not used). The price of
// the separate dQ kernel is recomputing S and dP there: 7 matrix products per (query block,
// key block) pair instead of the 5 of an atomic-dQ design.
//
// Fragment choreography (why no tile is ever transposed through shared memory).
//   mma.sync m16n8k16 computes C[16 x 8] += A[16 x 16] B[16 x 8] (common.cuh documents which
//   thread holds what). Two adjacent 8-column C tiles, rounded to 16 bits, are *exactly* the
//   A fragment of a 16 x 16 operand. So a product whose rows are the warp's rows feeds the
//   next product as its A operand straight from registers, as long as that next product
//   reduces over the C columns. The dK/dV kernel therefore computes everything transposed,
//   with its keys as the MMA rows:
//     S^T  = K  Q^T    A: K rows (ldmatrix)        B: Q rows (ldmatrix; B[k=d][n=query])
//     P^T  = exp2(S^T * scale_log2 - lse[query])  (lse indexed by column)
//     dV  += P^T dO    A: P^T from registers       B: dO rows (ldmatrix.trans; B[k=query][n=d])
//     dP^T = V  dO^T   A: V rows (ldmatrix)        B: dO rows (ldmatrix)
//     dS^T = P^T * (dP^T - delta[query])
//     dK  += dS^T Q    A: dS^T from registers      B: Q rows (ldmatrix.trans)
//   and the dQ kernel computes the untransposed products with its queries as the rows:
//     S = Q K^T, P, dP = dO V^T, dS, dQ += dS K    (B of the last one: K rows, ldmatrix.trans).
//   Only two warp-level GEMM shapes occur: gemm_rows_by_rows_t (both operands are rows in
//   shared memory, C = A B^T) and gemm_regs_by_rows (A in registers, C = A B).
//
// Cost model. Each B fragment read from shared memory (one ldmatrix.x4 = two 8-column tiles
// x 16) feeds 2 * kMTiles mma.sync, so a warp owning 32 rows (kMTiles = 2) needs about half
// the shared-memory bandwidth per MMA of a warp owning 16. An ldmatrix.x4 takes 4 cycles of an
// SM's shared-memory bandwidth (128 B/cycle) and the SM retires an m16n8k16 about every 1.5-2
// cycles, so with kMTiles = 1 (~0.58 ldmatrix per mma) the kernels are bound by shared memory;
// kMTiles = 2 (~0.33-0.42) is used wherever its accumulators fit in 255 registers.
//
// Data movement. The tiles a CTA owns (K and V for dK/dV; Q, dO, lse, delta for dQ) are copied
// once into shared memory; the tiles it walks over (Q, dO, lse, delta, or K, V) stream through a
// two-stage cp.async ring, so block j+1 is in flight while block j is computed, with one
// __syncthreads per block. Shared-memory rows are padded by 8 elements (16 bytes): the 8 row
// addresses of every ldmatrix then hit 8 different 16-byte bank groups, for every bucket.
//
// Masking and modifiers (core/mask.cuh). Rows past sq / sk load as zeros and columns
// d..kHeadDim-1 load as zeros (they add nothing to any dot product and are never written). The
// block ranges come from AttnMask / BlockRange (causal, sliding window, varlen lengths); a tile is
// masked element-wise only when AttnMask::needs_mask says a warp's part of it is not entirely
// visible; blocks none of a warp's rows can see are skipped. Softcap and ALiBi are applied to
// the recomputed scores (ScoreMod), and with softcap dS gets the factor 1 - tanh^2 (kSoftcap
// kernels keep it in one more register tile). A row whose lse is -inf (it saw no key) gets
// P = 0 through lse_log2 = +inf, never exp(-inf + inf) = NaN.
#pragma once

#include "../launch.h"
#include "../core/seqlen.cuh"
#include "bwd_preprocess.cuh"
#include "common.cuh"

namespace flash_cuda {
namespace bwd_mma {

// ---------------------------------------------------------------------------------
// Tile configuration per head-dim bucket.
// ---------------------------------------------------------------------------------
// dK/dV kernel:
//   kKVWarps, kKVMTiles  warps per CTA, 16-row MMA tiles (of keys) per warp; the CTA owns
//                        kKVBlockN = 16 * kKVMTiles * kKVWarps keys.
//   kKVBlockM            queries per pipeline step (the N of S^T).
//   kSplitDKDV           run the kernel twice, computing dV only and then dK only, so a thread
//                        never holds both accumulators: needed where kMTiles * d floats of
//                        dK+dV plus kMTiles * kKVBlockM floats of P^T, dP^T exceed the
//                        255-register budget (d = 192, 256). Costs one more S^T = K Q^T product
//                        (5 instead of 4 in this kernel) and a second pass over Q, dO, lse.
// dQ kernel:
//   kQWarps, kQMTiles    the CTA owns kQBlockM = 16 * kQMTiles * kQWarps queries.
//   kQBlockN             keys per pipeline step.
// kMinBlocks are __launch_bounds__ hints. Shared memory stays within the 163 KiB an sm_80
// CTA can opt into.
template <int kHeadDim_, int kKVWarps_, int kKVMTiles_, int kKVBlockM_, bool kSplitDKDV_,
          int kKVMinBlocks_, int kQWarps_, int kQMTiles_, int kQBlockN_, int kQMinBlocks_>
struct Config {
  static constexpr bool kSm90Only = false;  // see Sm90Only below
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kPitch = kHeadDim + 8;  // padded shared-memory row, in elements
  static constexpr int kElemBytes = 2;         // fp16 / bf16

  static constexpr int kKVWarps = kKVWarps_;
  static constexpr int kKVMTiles = kKVMTiles_;
  static constexpr int kKVThreads = 32 * kKVWarps;
  static constexpr int kKVBlockN = 16 * kKVMTiles * kKVWarps;
  static constexpr int kKVBlockM = kKVBlockM_;
  static constexpr bool kSplitDKDV = kSplitDKDV_;
  static constexpr int kKVMinBlocks = kKVMinBlocks_;

  static constexpr int kQWarps = kQWarps_;
  static constexpr int kQMTiles = kQMTiles_;
  static constexpr int kQThreads = 32 * kQWarps;
  static constexpr int kQBlockM = 16 * kQMTiles * kQWarps;
  static constexpr int kQBlockN = kQBlockN_;
  static constexpr int kQMinBlocks = kQMinBlocks_;

  static_assert(kHeadDim % 32 == 0, "buckets are multiples of 32 (conflict-free padded rows)");
  static_assert(kKVBlockM % 16 == 0 && kQBlockN % 16 == 0, "MMA k-steps are 16 wide");
  static_assert(kKVBlockM <= kKVThreads && kQBlockM <= kQThreads, "one thread per lse / delta entry");

  // dK/dV kernel: K [kKVBlockN], V [kKVBlockN] (not in the dV-only pass), then two stages of
  // Q [kKVBlockM], dO [kKVBlockM], then two stages of lse [kKVBlockM], delta [kKVBlockM].
  static constexpr size_t dkdv_smem_bytes(bool with_v) {
    return static_cast<size_t>((with_v ? 2 : 1) * kKVBlockN + 2 * 2 * kKVBlockM) * kPitch * kElemBytes +
           2 * 2 * kKVBlockM * sizeof(float);
  }
  // dQ kernel: Q [kQBlockM], dO [kQBlockM], then two stages of K [kQBlockN], V [kQBlockN],
  // then lse [kQBlockM], delta [kQBlockM].
  static constexpr size_t dq_smem_bytes() {
    return static_cast<size_t>(2 * kQBlockM + 2 * 2 * kQBlockN) * kPitch * kElemBytes +
           2 * kQBlockM * sizeof(float);
  }
  static constexpr size_t max_smem_bytes() {
    return dkdv_smem_bytes(true) > dq_smem_bytes() ? dkdv_smem_bytes(true) : dq_smem_bytes();
  }
};

template <int kHeadDim> struct Traits;
// Long-lived fp32 registers per thread: dK/dV kernel kKVMTiles * (d [dK + dV; d/2 when split]
// + kKVBlockM [P^T, dP^T]); dQ kernel kQMTiles * (d/2 [dQ] + kQBlockN [P, dP]). Up to about
// 176-192 leaves ptxas room for fragments, addresses and loop state without spilling
// (d = 128 with kKVBlockM = 64, 192 live, spills a few bytes: hence 48).
//                                  d    --------- dK/dV ---------    -------- dQ --------
//                                       warps mt  M   split minB     warps mt  N  minB
template <> struct Traits<32>  : Config<32,  4, 2, 48, false, 2,      4, 2, 64, 2> {};
template <> struct Traits<64>  : Config<64,  4, 2, 32, false, 2,      4, 2, 64, 2> {};
template <> struct Traits<96>  : Config<96,  8, 1, 64, false, 1,      4, 2, 32, 2> {};
template <> struct Traits<128> : Config<128, 4, 1, 48, false, 2,      8, 1, 64, 1> {};
template <> struct Traits<192> : Config<192, 8, 1, 32, true,  1,      8, 1, 32, 1> {};
template <> struct Traits<256> : Config<256, 4, 1, 32, true,  1,      4, 1, 32, 1> {};

// Traits fit the 163 KiB of shared memory an sm_80 CTA can opt into. run_bwd_mma switches at
// run time to Large where the device allows 227 KiB (sm_90), and to Compact where it allows
// only 99 KiB (sm_86, sm_89). Where a tier would be the same as Traits, it is Traits.
template <int kHeadDim> struct Large { using type = Traits<kHeadDim>; };
// A configuration whose kernels are launched only on sm_90 (run_bwd_mma checks the arch):
// their sm_80 builds compile to a trap, so that registers they would spill there cost nothing.
// (d = 128 had 32-row dQ warps here; with the window / varlen bookkeeping they spill on sm_90
// too, so d = 128 uses Traits: OPTIMIZATION.md.)
template <typename Cfg> struct Sm90Only : Cfg { static constexpr bool kSm90Only = true; };
template <int kHeadDim> struct Compact { using type = Traits<kHeadDim>; };
//                                                   d    warps mt  M  split minB    warps mt  N  minB
template <> struct Large<256>   { using type = Sm90Only<Config<256, 8, 1, 32, true,  1,      8, 1, 32, 1>>; };
template <> struct Compact<96>  { using type = Config<96,  4, 1, 48, false, 2,      4, 2, 32, 2>; };
template <> struct Compact<128> { using type = Config<128, 4, 1, 48, false, 2,      4, 1, 48, 2>; };
template <> struct Compact<192> { using type = Config<192, 4, 1, 16, true,  2,      4, 1, 16, 2>; };
template <> struct Compact<256> { using type = Config<256, 3, 1, 16, true,  2,      3, 1, 16, 2>; };
template <int kHeadDim>
constexpr bool kTiersFit = Compact<kHeadDim>::type::max_smem_bytes() <= kSmemConsumer &&
                           Traits<kHeadDim>::max_smem_bytes() <= kSmemA100 &&
                           Large<kHeadDim>::type::max_smem_bytes() <= kSmemHopper;
static_assert(kTiersFit<32> && kTiersFit<64> && kTiersFit<96> && kTiersFit<128> && kTiersFit<192> &&
                  kTiersFit<256>,
              "tiles fit the shared memory of their GPUs");

// ---------------------------------------------------------------------------------
// Global -> shared copies (cp.async).
// ---------------------------------------------------------------------------------

// Copies rows [0, kRows) x columns [0, kHeadDim) of a row-major slice into a padded
// shared tile, 16 bytes per cp.async. Rows >= rows_valid and columns >= d are zero-filled.
template <int kRows, int kHeadDim, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t row_stride,
                                                int rows_valid, int d) {
  constexpr int kPitch = kHeadDim + 8;
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int pass = 0; pass < ceil_div(kChunks, kThreads); ++pass) {
    const int c = pass * kThreads + static_cast<int>(threadIdx.x);
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const bool valid = r < rows_valid && col < d;
      cp_async_16(smem + r * kPitch + col, valid ? gmem + r * row_stride + col : gmem, valid);
    }
  }
}

// 4-byte cp.async (.ca: the only variant that allows 4 bytes), zero-filling when !valid.
// The per-row statistics lse / delta start at arbitrary offsets, so 16-byte copies would
// not be aligned.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_size));
}

// Copies kN consecutive floats (entries >= n_valid become 0).
template <int kN>
__device__ __forceinline__ void load_row_stats_async(float* smem, const float* gmem, int n_valid) {
  const int i = threadIdx.x;
  if (i < kN) cp_async_4(smem + i, i < n_valid ? gmem + i : gmem, i < n_valid);
}

// lse in the log2 domain. A row that saw no key has lse = -inf; it maps to +inf so that
// exp2(s - lse_log2) = exp2(-inf) = 0 instead of NaN.
__device__ __forceinline__ float lse_to_log2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
}

// ---------------------------------------------------------------------------------
// The two warp-level GEMMs. A warp's rows are kMTiles 16-row tiles; accumulators are mma C
// fragments: acc[mt][j] is the 16 x 8 tile of rows 16mt..16mt+15, columns 8j..8j+7, and
// thread (g = lane/4, t = lane%4) holds its rows g, g+8 and columns 2t, 2t+1.
// ---------------------------------------------------------------------------------

// acc[16 kMTiles x kN] += A[16 kMTiles x kK] * B[kN x kK]^T, where A is the warp's rows of a
// padded shared tile starting at sA and B is kN consecutive rows starting at sB (both
// row-major along the reduction dimension kK).
template <typename T, int kMTiles, int kK, int kN, int kPitch>
__device__ __forceinline__ void gemm_rows_by_rows_t(float (&acc)[kMTiles][kN / 8][4], const T* sA,
                                                    const T* sB) {
  const int lane = threadIdx.x % 32;
  // A (16 x 16 per k-step), ldmatrix.x4: lanes 0-15 address rows 0-15 at column 0, lanes
  // 16-31 the same rows at column 8; the registers come out as a[0..3] of the mma A layout.
  const T* a_row = sA + (lane % 16) * kPitch + (lane / 16) * 8;
  // B (two 8-column n-tiles x 16 k per ldmatrix.x4): lane i addresses B-row (n)
  // 8 * (i / 16) + i % 8 at k-offset 8 * ((i / 8) % 2); registers {0,1} are b0, b1 of
  // n-tile 2np and {2,3} those of n-tile 2np+1 (non-transposed: B[k][n] = sB[n][k]).
  const T* b_row = sB + ((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4(a[mt], a_row + mt * 16 * kPitch + ks * 16);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4(b, b_row + np * 16 * kPitch + ks * 16);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// acc[16 kMTiles x kN] += A[16 kMTiles x kK] * B[kK x kN], where A is held as fp32 C
// fragments (P^T, dS^T or dS) and B is kK consecutive rows of a padded shared tile starting
// at sB (row-major along kN).
template <typename T, int kMTiles, int kK, int kN, int kPitch>
__device__ __forceinline__ void gemm_regs_by_rows(float (&acc)[kMTiles][kN / 8][4],
                                                  const float (&a_frag)[kMTiles][kK / 8][4], const T* sB) {
  const int lane = threadIdx.x % 32;
  // B (16 k x two 8-column n-tiles per ldmatrix.x4.trans): lanes 0-15 address k-rows 0-15
  // at column 0, lanes 16-31 the same rows at column 8. Transposed delivery turns the
  // row-major [k][n] tiles into b0 (k 0-7), b1 (k 8-15) of n-tile 2np (registers 0, 1) and
  // of n-tile 2np+1 (registers 2, 3).
  const T* b_row = sB + (lane % 16) * kPitch + (lane / 16) * 8;
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    // C tiles 2ks and 2ks+1 (columns 16ks..16ks+15) form the A fragment of k-step ks.
    uint32_t a[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      a[mt][0] = pack2<T>(a_frag[mt][2 * ks][0], a_frag[mt][2 * ks][1]);          // row g,   k 2t, 2t+1
      a[mt][1] = pack2<T>(a_frag[mt][2 * ks][2], a_frag[mt][2 * ks][3]);          // row g+8, k 2t, 2t+1
      a[mt][2] = pack2<T>(a_frag[mt][2 * ks + 1][0], a_frag[mt][2 * ks + 1][1]);  // row g,   k 2t+8, +9
      a[mt][3] = pack2<T>(a_frag[mt][2 * ks + 1][2], a_frag[mt][2 * ks + 1][3]);  // row g+8, k 2t+8, +9
    }
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_row + ks * 16 * kPitch + np * 16);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<T>(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

template <int kMTiles, int kNTiles>
__device__ __forceinline__ void zero_fill(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;
}

// ---------------------------------------------------------------------------------
// Element-wise steps of the dK/dV kernel (transposed: rows = keys, columns = queries).
// Element e of C tile [mt][j] sits at key row 16mt + g + 8 * (e / 2) and query column
// 8j + 2t + e % 2.
// ---------------------------------------------------------------------------------

// Recomputes P from the raw scores, in place, the same way for both kernels:
//   x = s * scale_log2 (log2 units of the scaled logit); with modifiers x = mod.apply(x)
//   P = exp2(x * exp_scale - lse_log2)      (exp_scale: scale_log2 without modifiers, folded
//                                            into the FFMA as in the forward; 1 with them)
// and, with softcap (kSoftcap), keeps dtanh = 1 - tanh^2, the factor dS gets. Masked pairs are
// zeroed after the exponential when `needs_mask` (core/mask.cuh decides where that is needed).
// kTransposed: rows are keys and columns queries (dK/dV kernel: P^T, lse indexed by column);
// otherwise rows are queries (dQ kernel). Element e of C tile [mt][j] sits at row
// row0 + 16mt + g + 8 (e / 2) and column col0 + 8j + 2t + e % 2.
template <bool kTransposed, int kVariant, int kMTiles, int kNTiles, bool kSoftcap = kVariant == kSoftcapGrad>
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
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = s[mt][j][e] * scale_log2;
          if constexpr (kSoftcap) dtanh[mt][j][e] = mod.dtanh(x);
          s[mt][j][e] = mod.apply(x, query_of(mt, j, e), key_of(mt, j, e));
        }
  }
  const float exp_scale = modded ? 1.f : scale_log2;  // ScoreMod::exp_scale
  if constexpr (kTransposed) {  // lse indexed by column (query)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      const float2 lse = *reinterpret_cast<const float2*>(sLse + 8 * j + 2 * t);
      const float lse_log2[2] = {lse_to_log2(lse.x), lse_to_log2(lse.y)};
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = fast_exp2(fmaf(s[mt][j][e], exp_scale, -lse_log2[e % 2]));
    }
  } else {  // lse indexed by row (query)
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      const float lse_log2[2] = {lse_to_log2(sLse[16 * mt + g]), lse_to_log2(sLse[16 * mt + g + 8])};
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][j][e] = fast_exp2(fmaf(s[mt][j][e], exp_scale, -lse_log2[e / 2]));
    }
  }
  if (needs_mask) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int j = 0; j < kNTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (!mask.visible(query_of(mt, j, e), key_of(mt, j, e))) s[mt][j][e] = 0.f;
  }
}

// dS = P * (dP - delta) (times dtanh with softcap), in place in dp. kTransposed as above:
// delta indexed by column (dK/dV kernel) or by row (dQ kernel).
template <bool kTransposed, int kVariant, int kMTiles, int kNTiles, bool kSoftcap = kVariant == kSoftcapGrad>
__device__ __forceinline__ void compute_ds(float (&dp)[kMTiles][kNTiles][4],
                                           const float (&p)[kMTiles][kNTiles][4],
                                           const float (&dtanh)[kSoftcap ? kMTiles : 1][kSoftcap ? kNTiles : 1][4],
                                           const float* sDelta) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
      float delta[2];
      if constexpr (kTransposed) {
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
    }
}

// ---------------------------------------------------------------------------------
// Writes a warp's accumulator rows (times `scale`) to rows 0.. of a row-major slice; rows
// >= rows_valid and columns >= d are skipped. Two elements (4 bytes) per store: this runs
// once per CTA, so it is not worth staging through shared memory.
// ---------------------------------------------------------------------------------
template <typename T, int kMTiles, int kHeadDim>
__device__ __forceinline__ void store_rows(const float (&acc)[kMTiles][kHeadDim / 8][4], T* gmem,
                                           int64_t row_stride, int rows_valid, int d, float scale) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
      const int col = 8 * j + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * mt + g + 8 * half;
        if (col < d && r < rows_valid) {
          *reinterpret_cast<uint32_t*>(gmem + r * row_stride + col) =
              pack2<T>(acc[mt][j][2 * half] * scale, acc[mt][j][2 * half + 1] * scale);
        }
      }
    }
}

// store_rows for a warp's 16 rows through its own rows of shared memory (swarp: 16 x
// kStagedStride elements, padded so that the fragment writes of a warp hit 32 different
// banks): the global stores become 16-byte vectors, two whole 128-element rows per warp
// instruction, instead of 4-byte pairs spread over 8 rows (half-used 32-byte sectors). The
// destination rows must be 16-byte aligned (d and the row stride multiples of 8 elements, as
// for every output flash_cuda allocates).
template <int kHeadDim>
constexpr int kStagedStride = kHeadDim + 8;
template <typename T, int kHeadDim>
__device__ __forceinline__ void store_rows_staged(const float (&acc)[1][kHeadDim / 8][4], T* swarp, T* gmem,
                                                  int64_t row_stride, int rows_valid, int d, float scale) {
  constexpr int kStride = kStagedStride<kHeadDim>;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j)
#pragma unroll
    for (int half = 0; half < 2; ++half)
      *reinterpret_cast<uint32_t*>(swarp + (g + 8 * half) * kStride + 8 * j + 2 * t) =
          pack2<T>(acc[0][j][2 * half] * scale, acc[0][j][2 * half + 1] * scale);
  __syncwarp();
  constexpr int kChunks = kHeadDim / 8;
#pragma unroll
  for (int c = lane; c < 16 * kChunks; c += 32) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    if (r < rows_valid && col < d) {
      *reinterpret_cast<uint4*>(gmem + r * row_stride + col) = *reinterpret_cast<const uint4*>(swarp + r * kStride + col);
    }
  }
  __syncwarp();  // the rows are read before the warp writes them again
}

// ---------------------------------------------------------------------------------
// dK/dV kernel. grid (ceil(sk / kKVBlockN), hkv, b). kDoDV / kDoDK select what this launch
// accumulates (both, or one of them when Cfg::kSplitDKDV).
// ---------------------------------------------------------------------------------
template <typename T, typename Cfg, bool kDoDV, bool kDoDK, int kVariant>
__global__ void __launch_bounds__(Cfg::kKVThreads, Cfg::kKVMinBlocks)
    bwd_dkdv_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kD = Cfg::kHeadDim;
  constexpr int kPitch = Cfg::kPitch;
  constexpr int kMTiles = Cfg::kKVMTiles;
  constexpr int kWarpKeys = 16 * kMTiles;  // keys per warp
  constexpr int kBlockN = Cfg::kKVBlockN;  // keys of this CTA
  constexpr int kBlockM = Cfg::kKVBlockM;  // queries per step
  constexpr int kThreads = Cfg::kKVThreads;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);       // [kBlockN][kPitch]
  T* sV = sK + kBlockN * kPitch;                // [kBlockN][kPitch] (kDoDK only)
  T* sQ = sV + (kDoDK ? kBlockN * kPitch : 0);  // [2][kBlockM][kPitch]
  T* sdO = sQ + 2 * kBlockM * kPitch;           // [2][kBlockM][kPitch]
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kBlockM * kPitch);  // [2][kBlockM]
  float* sDelta = sLse + 2 * kBlockM;                                   // [2][kBlockM]

  const int warp = threadIdx.x / 32;
  const int hkv = blockIdx.y;
  const SeqInfo seq = SeqInfo::make<kVariant != kPlain>(p, blockIdx.z);
  const int n0 = blockIdx.x * kBlockN;          // first key of the CTA
  if (n0 >= seq.sk) return;                     // varlen: a sequence shorter than max_seqlen_k
  const int warp_key0 = n0 + kWarpKeys * warp;  // first key of this warp
  const int group = p.hq / p.hkv;
  const AttnMask mask = seq.mask<kVariant != kPlain>(p);

  // Query blocks that can see a key of this CTA (core/mask.cuh), and the queries that see this
  // warp's keys (AttnMask::any_visible would recompute them per block: registers are tight here).
  const BlockRange m_range = BlockRange::queries_of(mask, n0, n0 + kBlockN, kBlockM);
  const int warp_q_begin = mask.query_begin(warp_key0), warp_q_end = mask.query_end(warp_key0 + kWarpKeys);
  const int h_begin = hkv * group, h_end = h_begin + group;

  // Issues the copies of query block m_block of query head h into ring slot `stage`.
  auto load_query_block = [&](int h, int m_block, int stage) {
    const int m0 = m_block * kBlockM;
    const T* q = seq.q_rows(static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride, p.q_row_stride, h) +
                 static_cast<int64_t>(m0) * p.q_row_stride;
    const T* dout = seq.q_rows(static_cast<const T*>(p.dout), p.do_batch_stride, p.do_head_stride,
                               p.do_row_stride, h) + static_cast<int64_t>(m0) * p.do_row_stride;
    load_tile_async<kBlockM, kD, kThreads>(sQ + stage * kBlockM * kPitch, q, p.q_row_stride, seq.sq - m0, p.d);
    load_tile_async<kBlockM, kD, kThreads>(sdO + stage * kBlockM * kPitch, dout, p.do_row_stride,
                                           seq.sq - m0, p.d);
    const int64_t row0 = seq.stat_offset(p, h) + m0;
    load_row_stats_async<kBlockM>(sLse + stage * kBlockM, p.softmax_lse + row0, seq.sq - m0);
    if constexpr (kDoDK) load_row_stats_async<kBlockM>(sDelta + stage * kBlockM, p.delta + row0, seq.sq - m0);
  };

  // The CTA walks over (query head, query block) pairs, the query heads of its GQA group
  // outer; (h, m_block) is the pair being computed, `stage` its ring slot.
  int h = h_begin, m_block = m_range.begin, stage = 0;
  if (m_range.count() == 0) h = h_end;  // no query sees these keys
  if (h < h_end) {
    const T* k = seq.k_rows(static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride, p.k_row_stride, hkv) +
                 static_cast<int64_t>(n0) * p.k_row_stride;
    load_tile_async<kBlockN, kD, kThreads>(sK, k, p.k_row_stride, seq.sk - n0, p.d);
    if constexpr (kDoDK) {
      const T* v = seq.k_rows(static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride, p.v_row_stride,
                              hkv) + static_cast<int64_t>(n0) * p.v_row_stride;
      load_tile_async<kBlockN, kD, kThreads>(sV, v, p.v_row_stride, seq.sk - n0, p.d);
    }
    load_query_block(h, m_block, 0);
    cp_async_commit();
  }

  // This warp's rows of dV and dK (fp32 C fragments).
  float acc_dv[kDoDV ? kMTiles : 1][kDoDV ? kD / 8 : 1][4];
  float acc_dk[kDoDK ? kMTiles : 1][kDoDK ? kD / 8 : 1][4];
  zero_fill(acc_dv);
  zero_fill(acc_dk);

  while (h < h_end) {
    // This block has landed, and every warp is done with the previous one, whose ring slot
    // the next copies overwrite.
    cp_async_wait<0>();
    __syncthreads();
    int next_h = h, next_m_block = m_block + 1;
    if (next_m_block == m_range.end) {
      next_m_block = m_range.begin;
      ++next_h;
    }
    if (next_h < h_end) {
      load_query_block(next_h, next_m_block, stage ^ 1);
      cp_async_commit();
    }

    const int m0 = m_block * kBlockM;
    // Skip the block when no query of it sees any of this warp's keys (or the keys are all
    // past sk); mask element-wise only where the warp's part is not entirely visible (a
    // diagonal or window edge, the end of the queries).
    const bool warp_sees_block = warp_key0 < seq.sk && m0 < warp_q_end && m0 + kBlockM > warp_q_begin;
    if (warp_sees_block) {
      const bool needs_mask = mask.needs_mask(m0, m0 + kBlockM, warp_key0, warp_key0 + kWarpKeys);

      const T* sQ_s = sQ + stage * kBlockM * kPitch;
      const T* sdO_s = sdO + stage * kBlockM * kPitch;

      // S^T = K Q^T, then P^T (kept in fp32: dS^T needs it at full precision).
      float pt[kMTiles][kBlockM / 8][4];
      constexpr bool kSoftcap = kVariant == kSoftcapGrad;
      float dtanh[kSoftcap ? kMTiles : 1][kSoftcap ? kBlockM / 8 : 1][4];
      zero_fill(pt);
      gemm_rows_by_rows_t<T, kMTiles, kD, kBlockM, kPitch>(pt, sK + kWarpKeys * warp * kPitch, sQ_s);
      compute_probs<true, kVariant>(pt, dtanh, sLse + stage * kBlockM, needs_mask, warp_key0, m0, mask, p, seq, h);

      // dV += P^T dO.
      if constexpr (kDoDV) gemm_regs_by_rows<T, kMTiles, kBlockM, kD, kPitch>(acc_dv, pt, sdO_s);

      if constexpr (kDoDK) {
        // dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
        float dst[kMTiles][kBlockM / 8][4];
        zero_fill(dst);
        gemm_rows_by_rows_t<T, kMTiles, kD, kBlockM, kPitch>(dst, sV + kWarpKeys * warp * kPitch, sdO_s);
        compute_ds<true, kVariant>(dst, pt, dtanh, sDelta + stage * kBlockM);
        gemm_regs_by_rows<T, kMTiles, kBlockM, kD, kPitch>(acc_dk, dst, sQ_s);
      }
    }
    h = next_h;
    m_block = next_m_block;
    stage ^= 1;
  }

  // Write once: dV = sum P^T dO, dK = scale * sum dS^T Q (keys no query sees get zeros).
  const int rows_valid = seq.sk - warp_key0;
  if constexpr (kDoDV) {
    T* dv = seq.k_rows(static_cast<T*>(p.dv), p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, hkv) +
            static_cast<int64_t>(warp_key0) * p.dv_row_stride;
    store_rows<T, kMTiles, kD>(acc_dv, dv, p.dv_row_stride, rows_valid, p.d, 1.f);
  }
  if constexpr (kDoDK) {
    T* dk = seq.k_rows(static_cast<T*>(p.dk), p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, hkv) +
            static_cast<int64_t>(warp_key0) * p.dk_row_stride;
    store_rows<T, kMTiles, kD>(acc_dk, dk, p.dk_row_stride, rows_valid, p.d, p.scale);
  }
}

// ---------------------------------------------------------------------------------
// dQ kernel. grid (ceil(sq / kQBlockM), hq, b).
// ---------------------------------------------------------------------------------
template <typename T, typename Cfg, int kVariant>
__device__ __forceinline__ void bwd_dq_block(const BwdParams& p) {
  constexpr int kD = Cfg::kHeadDim;
  constexpr int kPitch = Cfg::kPitch;
  constexpr int kMTiles = Cfg::kQMTiles;
  constexpr int kWarpRows = 16 * kMTiles;  // queries per warp
  constexpr int kBlockM = Cfg::kQBlockM;   // queries of this CTA
  constexpr int kBlockN = Cfg::kQBlockN;   // keys per step
  constexpr int kThreads = Cfg::kQThreads;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [kBlockM][kPitch]
  T* sdO = sQ + kBlockM * kPitch;          // [kBlockM][kPitch]
  T* sK = sdO + kBlockM * kPitch;          // [2][kBlockN][kPitch]
  T* sV = sK + 2 * kBlockN * kPitch;       // [2][kBlockN][kPitch]
  float* sLse = reinterpret_cast<float*>(sV + 2 * kBlockN * kPitch);  // [kBlockM]
  float* sDelta = sLse + kBlockM;                                      // [kBlockM]

  const int warp = threadIdx.x / 32;
  // With a bounded right side the last query blocks see the most keys: launch them first.
  const int h = blockIdx.y;
  const SeqInfo seq = SeqInfo::make<kVariant != kPlain>(p, blockIdx.z);
  const AttnMask mask = seq.mask<kVariant != kPlain>(p);
  const int m_block = mask.right_bounded() ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const int m0 = m_block * kBlockM;  // first query of the CTA
  if (m0 >= seq.sq) return;          // varlen: a sequence shorter than max_seqlen_q
  const int hkv = h / (p.hq / p.hkv);
  const int warp_q0 = m0 + kWarpRows * warp;  // first query of this warp

  // Key blocks that some query of this CTA can see.
  const BlockRange n_range = BlockRange::keys_of(mask, m0, m0 + kBlockM, kBlockN);

  auto load_key_block = [&](int n_block, int stage) {
    const int n0 = n_block * kBlockN;
    const T* k = seq.k_rows(static_cast<const T*>(p.k), p.k_batch_stride, p.k_head_stride, p.k_row_stride, hkv) +
                 static_cast<int64_t>(n0) * p.k_row_stride;
    const T* v = seq.k_rows(static_cast<const T*>(p.v), p.v_batch_stride, p.v_head_stride, p.v_row_stride, hkv) +
                 static_cast<int64_t>(n0) * p.v_row_stride;
    load_tile_async<kBlockN, kD, kThreads>(sK + stage * kBlockN * kPitch, k, p.k_row_stride, seq.sk - n0, p.d);
    load_tile_async<kBlockN, kD, kThreads>(sV + stage * kBlockN * kPitch, v, p.v_row_stride, seq.sk - n0, p.d);
  };

  if (n_range.count() > 0) {
    const T* q = seq.q_rows(static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride, p.q_row_stride, h) +
                 static_cast<int64_t>(m0) * p.q_row_stride;
    const T* dout = seq.q_rows(static_cast<const T*>(p.dout), p.do_batch_stride, p.do_head_stride,
                               p.do_row_stride, h) + static_cast<int64_t>(m0) * p.do_row_stride;
    load_tile_async<kBlockM, kD, kThreads>(sQ, q, p.q_row_stride, seq.sq - m0, p.d);
    load_tile_async<kBlockM, kD, kThreads>(sdO, dout, p.do_row_stride, seq.sq - m0, p.d);
    const int64_t row0 = seq.stat_offset(p, h) + m0;
    // Rows past sq get lse = delta = 0 next to zero Q and dO rows: their dS is finite or not,
    // but they are never written, and each row of dQ depends on its own row of dS only.
    load_row_stats_async<kBlockM>(sLse, p.softmax_lse + row0, seq.sq - m0);
    load_row_stats_async<kBlockM>(sDelta, p.delta + row0, seq.sq - m0);
    load_key_block(n_range.begin, n_range.begin & 1);  // block n lives in ring slot n % 2
    cp_async_commit();
  }

  float acc_dq[kMTiles][kD / 8][4];  // this warp's rows of dQ
  zero_fill(acc_dq);

  for (int n_block = n_range.begin; n_block < n_range.end; ++n_block) {
    const int stage = n_block & 1;
    cp_async_wait<0>();
    __syncthreads();
    if (n_block + 1 < n_range.end) {
      load_key_block(n_block + 1, stage ^ 1);
      cp_async_commit();
    }

    const int n0 = n_block * kBlockN;
    const bool warp_sees_block = mask.any_visible(warp_q0, warp_q0 + kWarpRows, n0, n0 + kBlockN);
    if (!warp_sees_block) continue;
    // (Rows past sq count as masked: only the last query block pays, and they are never written.)
    const bool needs_mask = mask.needs_mask(warp_q0, warp_q0 + kWarpRows, n0, n0 + kBlockN);

    const T* sK_s = sK + stage * kBlockN * kPitch;
    const T* sV_s = sV + stage * kBlockN * kPitch;

    // S = Q K^T, P.
    float s[kMTiles][kBlockN / 8][4];
    constexpr bool kSoftcap = kVariant == kSoftcapGrad;
    float dtanh[kSoftcap ? kMTiles : 1][kSoftcap ? kBlockN / 8 : 1][4];
    zero_fill(s);
    gemm_rows_by_rows_t<T, kMTiles, kD, kBlockN, kPitch>(s, sQ + kWarpRows * warp * kPitch, sK_s);
    compute_probs<false, kVariant>(s, dtanh, sLse + kWarpRows * warp, needs_mask, warp_q0, n0, mask, p, seq, h);

    // dP = dO V^T, dS = P (dP - delta), dQ += dS K.
    float ds[kMTiles][kBlockN / 8][4];
    zero_fill(ds);
    gemm_rows_by_rows_t<T, kMTiles, kD, kBlockN, kPitch>(ds, sdO + kWarpRows * warp * kPitch, sV_s);
    compute_ds<false, kVariant>(ds, s, dtanh, sDelta + kWarpRows * warp);
    gemm_regs_by_rows<T, kMTiles, kBlockN, kD, kPitch>(acc_dq, ds, sK_s);
  }

  // dQ = scale * sum dS K (rows that see no key get zeros).
  T* dq = seq.q_rows(static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, h) +
          static_cast<int64_t>(warp_q0) * p.dq_row_stride;
  store_rows<T, kMTiles, kD>(acc_dq, dq, p.dq_row_stride, seq.sq - warp_q0, p.d, p.scale);
}

template <typename T, typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kQThreads, Cfg::kQMinBlocks)
    bwd_dq_kernel(const __grid_constant__ BwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (Cfg::kSm90Only) {
    __trap();  // never launched below sm_90
  } else {
    bwd_dq_block<T, Cfg, kVariant>(p);
  }
#else
  bwd_dq_block<T, Cfg, kVariant>(p);
#endif
}

// ---------------------------------------------------------------------------------
// Host-side launchers.
// ---------------------------------------------------------------------------------
template <typename T, typename Cfg, bool kDoDV, bool kDoDK, int kVariant>
inline void launch_bwd_dkdv(const BwdParams& p, cudaStream_t stream, const char* name) {
  constexpr size_t kSmem = Cfg::dkdv_smem_bytes(kDoDK);
  auto kernel = bwd_dkdv_kernel<T, Cfg, kDoDV, kDoDK, kVariant>;
  set_smem_limit(kernel, kSmem, name);
  const dim3 grid(ceil_div(p.sk, Cfg::kKVBlockN), p.hkv, p.b);
  kernel<<<grid, Cfg::kKVThreads, kSmem, stream>>>(p);
  check_launch(name);
}

template <typename T, typename Cfg, int kVariant>
inline void launch_bwd_dq(const BwdParams& p, cudaStream_t stream) {
  constexpr size_t kSmem = Cfg::dq_smem_bytes();
  auto kernel = bwd_dq_kernel<T, Cfg, kVariant>;
  set_smem_limit(kernel, kSmem, "bwd_dq_mma");
  const dim3 grid(ceil_div(p.sq, Cfg::kQBlockM), p.hq, p.b);
  kernel<<<grid, Cfg::kQThreads, kSmem, stream>>>(p);
  check_launch("bwd_dq_mma");
}

template <typename T, typename Cfg, int kVariant>
inline void launch_bwd_gradients(const BwdParams& p, cudaStream_t stream) {
  if constexpr (Cfg::kSplitDKDV) {
    launch_bwd_dkdv<T, Cfg, true, false, kVariant>(p, stream, "bwd_dv_mma");
    launch_bwd_dkdv<T, Cfg, false, true, kVariant>(p, stream, "bwd_dk_mma");
  } else {
    launch_bwd_dkdv<T, Cfg, true, true, kVariant>(p, stream, "bwd_dkdv_mma");
  }
  launch_bwd_dq<T, Cfg, kVariant>(p, stream);
}

}  // namespace bwd_mma

// kVariant (flash_params.h): kPlain, kExtended (varlen, ALiBi) or kSoftcapGrad (the kernels that
// keep softcap's derivative in one more register tile); the binding picks it per call.
template <int kDType, int kHeadDim, int kVariant>
void run_bwd_mma(const BwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  using Cfg = bwd_mma::Traits<kHeadDim>;
  using LargeCfg = typename bwd_mma::Large<kHeadDim>::type;
  using CompactCfg = typename bwd_mma::Compact<kHeadDim>::type;
  launch_bwd_preprocess<T>(p, stream);
  // The largest tiles the device's shared memory allows (tiers equal to Traits reuse its kernels).
  const size_t smem_optin = device_smem_optin();
  if ((!LargeCfg::kSm90Only || p.sm_arch >= 90) && smem_optin >= LargeCfg::max_smem_bytes()) {
    bwd_mma::launch_bwd_gradients<T, LargeCfg, kVariant>(p, stream);
  } else if (smem_optin >= Cfg::max_smem_bytes()) {
    bwd_mma::launch_bwd_gradients<T, Cfg, kVariant>(p, stream);
  } else {
    bwd_mma::launch_bwd_gradients<T, CompactCfg, kVariant>(p, stream);
  }
}

}  // namespace flash_cuda
