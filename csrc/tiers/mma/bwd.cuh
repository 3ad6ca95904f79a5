// tiers/mma/bwd.cuh — the fp16/bf16 tensor-core backward of flash_cuda (FlashAttention-2).
//
// Math (per query head; scores are kept in the log2 domain, scale_log2 = scale * log2 e):
//   P  = exp2(S * scale_log2 - lse * log2 e)      S = Q K^T, lse saved by the forward
//   dV = P^T dO
//   dP = dO V^T
//   dS = P * (dP - delta)                           delta = rowsum(dO * O) - dlse
//   dK = scale * dS^T Q
//   dQ = scale * dS K
//
// Three launches (four when the dK/dV kernel is split, see kSplitDKDV; a call that wants only dQ,
// or only dK / dV, skips the other side's kernel: launch_bwd_gradients):
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
//   mma.sync m16n8k16 computes C[16 x 8] += A[16 x 16] B[16 x 8] (arch/sm80.cuh documents which
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

#include <type_traits>

#include "../../arch/host.h"
#include "../../arch/sm80.cuh"
#include "../../arch/tile.cuh"
#include "../../core/block.cuh"
#include "../../core/bwd_preprocess.cuh"
#include "../../core/bwd_smem.h"
#include "../../core/dropout.cuh"
#include "../../core/epilogue.cuh"
#include "../../core/softmax.cuh"
#include "../../core/tile_io.cuh"
#include "../../include/tiles.h"
#include "gemm.cuh"

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

  // The kernels' shared memory (core/bwd_smem.h), padded rows of kPitch; kWithV: V is left out
  // of the dV-only pass. Any 16-bit T gives the same bytes.
  template <typename T, bool kWithV = true>
  using DkdvSmem = DkdvStorage<T, kPitch, kKVBlockN, kKVBlockM, kWithV ? 2 : 1>;
  template <typename T>
  using DqSmem = DqStorage<T, kPitch, kQBlockM, kQBlockN>;
  static constexpr size_t max_smem_bytes() {
    return sizeof(DkdvSmem<uint16_t>) > sizeof(DqSmem<uint16_t>) ? sizeof(DkdvSmem<uint16_t>) : sizeof(DqSmem<uint16_t>);
  }
};

// The tiles per head-dim bucket come from the tile table (include/tiles.h: MmaBwd). Long-lived
// fp32 registers per thread: dK/dV kernel kKVMTiles * (d [dK + dV; d/2 when split] + kKVBlockM
// [P^T, dP^T]); dQ kernel kQMTiles * (d/2 [dQ] + kQBlockN [P, dP]). Up to about 176-192 leaves
// ptxas room for fragments, addresses and loop state without spilling (d = 128 with
// kKVBlockM = 64, 192 live, spills a few bytes: hence 48).
template <int kHeadDim, typename S>
using ConfigOf = Config<kHeadDim, S::kKVWarps, S::kKVMTiles, S::kKVBlockM, S::kSplitDKDV, S::kKVMinBlocks, S::kQWarps,
                        S::kQMTiles, S::kQBlockN, S::kQMinBlocks>;
template <int kHeadDim>
using Traits = ConfigOf<kHeadDim, typename tiles::MmaBwd<kHeadDim>::Tile>;

// Traits fit the 163 KiB of shared memory an sm_80 CTA can opt into. run_bwd_mma switches at
// run time to Large where the device allows 227 KiB (sm_90), and to Compact where it allows
// only 99 KiB (sm_86, sm_89). Where a tier would be the same as Traits, it is Traits.
// A Large configuration of its own is launched only on sm_90 (run_bwd_mma checks the arch):
// its sm_80 builds compile to a trap, so that registers they would spill there cost nothing.
// (d = 128 had 32-row dQ warps here; with the window / varlen bookkeeping they spill on sm_90
// too, so d = 128 uses Traits: OPTIMIZATION.md.)
template <typename Cfg> struct Sm90Only : Cfg { static constexpr bool kSm90Only = true; };
template <int kHeadDim>
struct Large {
  using Table = tiles::MmaBwd<kHeadDim>;
  using type = std::conditional_t<Table::kLargeSm90Only, Sm90Only<ConfigOf<kHeadDim, typename Table::Large>>,
                                  Traits<kHeadDim>>;
};
template <int kHeadDim>
struct Compact {
  using type = ConfigOf<kHeadDim, typename tiles::MmaBwd<kHeadDim>::Compact>;
};
template <int kHeadDim>
constexpr bool kTiersFit = Compact<kHeadDim>::type::max_smem_bytes() <= kSmemConsumer &&
                           Traits<kHeadDim>::max_smem_bytes() <= kSmemA100 &&
                           Large<kHeadDim>::type::max_smem_bytes() <= kSmemHopper;
static_assert(kTiersFit<32> && kTiersFit<64> && kTiersFit<96> && kTiersFit<128> && kTiersFit<192> &&
                  kTiersFit<256>,
              "tiles fit the shared memory of their GPUs");


// The two halves of every block pair, for a warp's kMTiles 16-row tiles against kN rows of the
// other operand (kTransposed: the warp's rows are keys, the dK/dV kernel's S^T; otherwise queries):
//   scores_to_probs  S = A B^T, then P (core/softmax.cuh: compute_probs), with softcap's derivative
//   grads_to_ds      dP = A B^T, then dS = P (dP - delta) in place (compute_ds)
template <bool kTransposed, int kVariant, typename T, int kD, int kPitch, int kMTiles, int kNT>
__device__ __forceinline__ void scores_to_probs(float (&s)[kMTiles][kNT][4], DtanhTile<kVariant, kMTiles, kNT>& dtanh,
                                                const T* sA, const T* sB, const float* sLse, bool needs_mask,
                                                int row0, int col0, const AttnMask& mask, const BwdParams& p,
                                                const SeqInfo& seq, int h) {
  zero_fill(s);
  gemm_rows_by_rows_t<T, kMTiles, kD, 8 * kNT, kPitch>(s, sA, sB);
  compute_probs<kTransposed, kVariant>(s, dtanh, sLse, needs_mask, row0, col0, mask, p, seq, h);
}
// on_dp(dP) runs before dS (dropout: dP becomes the gradient of P, dP * keep * scale).
template <bool kTransposed, int kVariant, typename T, int kD, int kPitch, int kMTiles, int kNT, typename OnDp>
__device__ __forceinline__ void grads_to_ds(float (&ds)[kMTiles][kNT][4], const float (&probs)[kMTiles][kNT][4],
                                            const DtanhTile<kVariant, kMTiles, kNT>& dtanh, const T* sA, const T* sB,
                                            const float* sDelta, OnDp&& on_dp) {
  zero_fill(ds);
  gemm_rows_by_rows_t<T, kMTiles, kD, 8 * kNT, kPitch>(ds, sA, sB);
  on_dp(ds);
  compute_ds<kTransposed, kVariant>(ds, probs, dtanh, sDelta);
}

// ---------------------------------------------------------------------------------
// dK/dV kernel. grid (ceil(sk / kKVBlockN), hkv, b). kDoDV / kDoDK select what this launch
// accumulates (both, or one of them when Cfg::kSplitDKDV).
// ---------------------------------------------------------------------------------
template <typename T, typename Cfg, bool kDoDV, bool kDoDK, int kVariant>
__global__ void __launch_bounds__(Cfg::kKVThreads, Cfg::kKVMinBlocks)
    bwd_dkdv_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kD = Cfg::kHeadDim, kPitch = Cfg::kPitch, kThreads = Cfg::kKVThreads;
  constexpr int kMTiles = Cfg::kKVMTiles, kWarpKeys = 16 * kMTiles;  // keys per warp
  constexpr int kBlockN = Cfg::kKVBlockN, kBlockM = Cfg::kKVBlockM;  // keys of this CTA, queries per step
  using Padded = PaddedTile<kPitch>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::template DkdvSmem<T, kDoDK>*>(smem_raw);
  // Stages are addressed as offsets from the first (tiers/wgmma/bwd.cuh says why).
  T* sK = smem.kv[0];
  T* sV = smem.kv[kDoDK ? 1 : 0];  // (kDoDK only)
  T* sQ = smem.q[0];
  T* sdO = smem.dout[0];
  float* sLse = smem.lse[0];
  float* sDelta = smem.delta[0];

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
    copy_query_block_async<kBlockM, kD, kThreads, Padded>(p, seq, h, m_block * kBlockM, sQ + stage * kBlockM * kPitch,
                                                          sdO + stage * kBlockM * kPitch, sLse + stage * kBlockM,
                                                          kDoDK ? sDelta + stage * kBlockM : nullptr, threadIdx.x);
  };


  // The CTA walks over (query head, query block) pairs, the query heads of its GQA group
  // outer; (h, m_block) is the pair being computed, `stage` its ring slot.
  int h = h_begin, m_block = m_range.begin, stage = 0;
  if (m_range.count() == 0) h = h_end;  // no query sees these keys
  if (h < h_end) {
    copy_key_block_async<kBlockN, kD, kThreads, Padded>(p, seq, hkv, n0, sK, kDoDK ? sV : nullptr, threadIdx.x);
    load_query_block(h, m_block, 0);
    cp_async_commit();
  }

  // This warp's rows of dV and dK (fp32 C fragments).
  float acc_dv[kDoDV ? kMTiles : 1][kDoDV ? kD / 8 : 1][4];
  float acc_dk[kDoDK ? kMTiles : 1][kDoDK ? kD / 8 : 1][4];
  zero_fill(acc_dv);
  zero_fill(acc_dk);

  for (; h < h_end; KeyTileSteps::next(m_range, h_end, h, m_block), stage ^= 1) {
    // This block has landed, and every warp is done with the previous one, whose ring slot
    // the next copies overwrite.
    cp_async_wait<0>();
    __syncthreads();
    prefetch_next_query_block(m_range, h_end, h, m_block, stage, load_query_block);

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
      DtanhTile<kVariant, kMTiles, kBlockM / 8> dtanh;
      scores_to_probs<true, kVariant, T, kD, kPitch>(pt, dtanh, sK + kWarpKeys * warp * kPitch, sQ_s,
                                                     sLse + stage * kBlockM, needs_mask, warp_key0, m0, mask, p, seq, h);

      const bool dropout = kVariant != kPlain && has_dropout(p);
      // Dropout: the block's keep mask, drawn once (the forward's key, from its record, read here:
      // no registers held across blocks), drops dP^T before dS^T and then P^T for dV (dS^T needs
      // P^T whole).
      KeepTile<kMTiles, kBlockM / 8> keep;
      if (dropout) dropout_keep_tile<true>(keep, dropout_key(p.dropout), blockIdx.z * p.hq + h, warp_key0, m0);
      auto drop = [&](auto& x) { dropout_apply_tile(x, keep, p.dropout.scale); };

      // dV += P^T dO.
      if constexpr (kDoDV) {
        if (!dropout) gemm_regs_by_rows<T, kMTiles, kBlockM, kD, kPitch>(acc_dv, pt, sdO_s);
      }

      if constexpr (kDoDK) {
        // dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.
        float dst[kMTiles][kBlockM / 8][4];
        grads_to_ds<true, kVariant, T, kD, kPitch>(dst, pt, dtanh, sV + kWarpKeys * warp * kPitch, sdO_s,
                                                   sDelta + stage * kBlockM, [&](auto& dpt) {
                                                     if (dropout) drop(dpt);
                                                   });
        // The dropped dV product before dK's, not after the branch: the keep bits then die before
        // dK's product (after it, the d = 64 extended kernel spills 16 bytes on sm_90a).
        if constexpr (kDoDV) {
          if (dropout) {
            drop(pt);
            gemm_regs_by_rows<T, kMTiles, kBlockM, kD, kPitch>(acc_dv, pt, sdO_s);
          }
        }
        gemm_regs_by_rows<T, kMTiles, kBlockM, kD, kPitch>(acc_dk, dst, sQ_s);
      } else if constexpr (kDoDV) {
        if (dropout) {
          drop(pt);
          gemm_regs_by_rows<T, kMTiles, kBlockM, kD, kPitch>(acc_dv, pt, sdO_s);
        }
      }
    }
  }

  // Write once: dV = sum P^T dO, dK = scale * sum dS^T Q (keys no query sees get zeros).
  const int rows_valid = seq.sk - warp_key0;
  if constexpr (kDoDV) {
    T* dv = seq.k_rows(static_cast<T*>(p.dv), p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride, hkv) +
            static_cast<int64_t>(warp_key0) * p.dv_row_stride;
    store_rows<T>(acc_dv, dv, p.dv_row_stride, rows_valid, p.d, 1.f);
  }
  if constexpr (kDoDK) {
    T* dk = seq.k_rows(static_cast<T*>(p.dk), p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride, hkv) +
            static_cast<int64_t>(warp_key0) * p.dk_row_stride;
    store_rows<T>(acc_dk, dk, p.dk_row_stride, rows_valid, p.d, p.scale);
  }
}

// ---------------------------------------------------------------------------------
// dQ kernel. grid (ceil(sq / kQBlockM), hq, b).
// ---------------------------------------------------------------------------------
template <typename T, typename Cfg, int kVariant>
__device__ __forceinline__ void bwd_dq_block(const BwdParams& p) {
  constexpr int kD = Cfg::kHeadDim, kPitch = Cfg::kPitch, kThreads = Cfg::kQThreads;
  constexpr int kMTiles = Cfg::kQMTiles, kWarpRows = 16 * kMTiles;  // queries per warp
  constexpr int kBlockM = Cfg::kQBlockM, kBlockN = Cfg::kQBlockN;   // queries of this CTA, keys per step
  using Padded = PaddedTile<kPitch>;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::template DqSmem<T>*>(smem_raw);
  T* sK = smem.k[0];  // stages addressed from the first, as in bwd_dkdv_block
  T* sV = smem.v[0];

  const int warp = threadIdx.x / 32;
  // With a bounded right side the last query blocks see the most keys: launch them first.
  const int h = blockIdx.y;
  const SeqInfo seq = SeqInfo::make<kVariant != kPlain>(p, blockIdx.z);
  const AttnMask mask = seq.mask<kVariant != kPlain>(p);
  const int m_block = query_block_of_cta(mask);
  const int m0 = m_block * kBlockM;  // first query of the CTA
  if (m0 >= seq.sq) return;          // varlen: a sequence shorter than max_seqlen_q
  const int hkv = h / (p.hq / p.hkv);
  const int warp_q0 = m0 + kWarpRows * warp;  // first query of this warp

  // Key blocks that some query of this CTA can see.
  const BlockRange n_range = BlockRange::keys_of(mask, m0, m0 + kBlockM, kBlockN);

  auto load_key_block = [&](int n_block, int stage) {
    copy_key_block_async<kBlockN, kD, kThreads, Padded>(p, seq, hkv, n_block * kBlockN, sK + stage * kBlockN * kPitch,
                                                        sV + stage * kBlockN * kPitch, threadIdx.x);
  };

  if (n_range.count() > 0) {
    // Rows past sq get lse = delta = 0 next to zero Q and dO rows: their dS is finite or not,
    // but they are never written, and each row of dQ depends on its own row of dS only.
    copy_query_block_async<kBlockM, kD, kThreads, Padded>(p, seq, h, m0, smem.q, smem.dout, smem.lse, smem.delta,
                                                          threadIdx.x);
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
    DtanhTile<kVariant, kMTiles, kBlockN / 8> dtanh;
    scores_to_probs<false, kVariant, T, kD, kPitch>(s, dtanh, smem.q + kWarpRows * warp * kPitch, sK_s,
                                                    smem.lse + kWarpRows * warp, needs_mask, warp_q0, n0, mask, p, seq, h);

    // dP = dO V^T (with dropout: times keep * scale, the gradient of P), dS = P (dP - delta),
    // dQ += dS K.
    float ds[kMTiles][kBlockN / 8][4];
    grads_to_ds<false, kVariant, T, kD, kPitch>(ds, s, dtanh, smem.dout + kWarpRows * warp * kPitch, sV_s,
                                                smem.delta + kWarpRows * warp, [&](auto& dp) {
                                                  if constexpr (kVariant != kPlain) {
                                                    if (has_dropout(p)) {
                                                      // (the forward's key, from its record)
                                                      dropout_tile<false>(dp, dropout_key(p.dropout),
                                                                          blockIdx.z * p.hq + h, warp_q0, n0,
                                                                          p.dropout.scale);
                                                    }
                                                  }
                                                });
    gemm_regs_by_rows<T, kMTiles, kBlockN, kD, kPitch>(acc_dq, ds, sK_s);
  }

  // dQ = scale * sum dS K (rows that see no key get zeros).
  T* dq = seq.q_rows(static_cast<T*>(p.dq), p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride, h) +
          static_cast<int64_t>(warp_q0) * p.dq_row_stride;
  store_rows<T>(acc_dq, dq, p.dq_row_stride, seq.sq - warp_q0, p.d, p.scale);
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
  constexpr size_t kSmem = sizeof(typename Cfg::template DkdvSmem<T, kDoDK>);
  auto kernel = bwd_dkdv_kernel<T, Cfg, kDoDV, kDoDK, kVariant>;
  set_smem_limit(kernel, kSmem, name);
  const dim3 grid(ceil_div(p.sk, Cfg::kKVBlockN), p.hkv, p.b);
  kernel<<<grid, Cfg::kKVThreads, kSmem, stream>>>(p);
  check_launch(name);
}

template <typename T, typename Cfg, int kVariant>
inline void launch_bwd_dq(const BwdParams& p, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(typename Cfg::template DqSmem<T>);
  auto kernel = bwd_dq_kernel<T, Cfg, kVariant>;
  set_smem_limit(kernel, kSmem, "bwd_dq_mma");
  const dim3 grid(ceil_div(p.sq, Cfg::kQBlockM), p.hq, p.b);
  kernel<<<grid, Cfg::kQThreads, kSmem, stream>>>(p);
  check_launch("bwd_dq_mma");
}

// The kernels of the gradients the call wants (include/params.h: bwd_wants_dq / _dkdv): the two
// sides share nothing but delta, so either runs alone. dK and dV are wanted together, also where
// kSplitDKDV computes them in two launches.
template <typename T, typename Cfg, int kVariant>
inline void launch_bwd_gradients(const BwdParams& p, cudaStream_t stream) {
  if (bwd_wants_dkdv(p)) {
    if constexpr (Cfg::kSplitDKDV) {
      launch_bwd_dkdv<T, Cfg, true, false, kVariant>(p, stream, "bwd_dv_mma");
      launch_bwd_dkdv<T, Cfg, false, true, kVariant>(p, stream, "bwd_dk_mma");
    } else {
      launch_bwd_dkdv<T, Cfg, true, true, kVariant>(p, stream, "bwd_dkdv_mma");
    }
  }
  if (bwd_wants_dq(p)) launch_bwd_dq<T, Cfg, kVariant>(p, stream);
}

}  // namespace bwd_mma

// kVariant (include/params.h): kPlain, kExtended (varlen, ALiBi) or kSoftcapGrad (the kernels that
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
