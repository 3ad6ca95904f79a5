// tiers/mma/fwd.cuh — the fp16/bf16 tensor-core forward of flash_cuda (FlashAttention-2 style).
//
// Work split. One CTA owns kBlockM query rows of one (batch, query head); its kNWarps
// warps split those rows (FlashAttention-2: warps split queries, never keys, so the
// softmax statistics of a row live in one warp and need no shared-memory exchange).
// Each warp owns kWarpRows = 16 * kMTiles rows: with two 16-row MMA tiles per warp every
// K/V fragment read from shared memory feeds two tensor-core instructions.
//
// Per K/V block (kBlockN keys) the loop runs the four steps of the online softmax (the
// products are this file's, the rest core/softmax.cuh and core/epilogue.cuh):
//   1. compute_qk_scores_and_max            S = Q K^T (mma.sync), mask, row max
//   2. merge_block_stats                    new running max, rescale l and the O accumulator
//   3. compute_block_softmax_and_weighted_v P = exp2(S - m), l += rowsum(P), O += P V (mma.sync);
//                                           with dropout, P V takes P times the keep mask and scale
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

#include "../../arch/host.h"
#include "../../arch/sm80.cuh"
#include "../../arch/tile.cuh"
#include "../../core/block.cuh"
#include "../../core/dropout.cuh"
#include "../../core/epilogue.cuh"
#include "../../core/softmax.cuh"
#include "../../core/tile_io.cuh"
#include "../../include/tiles.h"
#include "gemm.cuh"

namespace flash_cuda {
namespace fwd_mma {

// ---------------------------------------------------------------------------------
// Tile configuration per head-dim bucket.
// ---------------------------------------------------------------------------------
// Tiles per head-dim bucket (the tile table, include/tiles.h: kBlockM, kBlockN, kNWarps,
// kMinBlocks): 128 x 64 tiles, 4 warps of 32 rows, 2 CTAs per SM, for head dims up to 128;
// beyond that the O accumulator needs one 16-row tile per warp (64-row CTAs). Where a block may
// opt into less shared memory than that needs (d = 128 on 99 KiB consumer cards, d = 192 there,
// d = 256 on an A100 too), run_fwd_mma takes the compact tile: the K/V steps shrink to 32 keys,
// which keeps the 16-row tiles per warp (tensor-core work per fragment read) that the rows would
// lose; FlashAttention-2 makes the same choice on sm_86 / sm_89.
template <int kHeadDim>
using Traits = typename tiles::MmaFwd<kHeadDim>::Tile;
template <int kHeadDim>
using CompactTraits = typename tiles::MmaFwd<kHeadDim>::Compact;

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
  static constexpr int kPitch = kHeadDim + 8;    // padded shared-memory row (elements)
  static constexpr int kStages = 2;               // K/V ring depth
  // Shared memory: Q, then the K / V ring, in padded rows of kPitch.
  struct Storage {
    T q[kBlockM * kPitch];
    T k[kStages][kBlockN * kPitch];
    T v[kStages][kBlockN * kPitch];
  };
  static constexpr size_t kSmemBytes = sizeof(Storage);
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
// Step 1: S = Q K^T for this warp's rows and one K block, masked, scaled to the log2
// domain; returns the block's row maxima (two rows per thread per m-tile: g and g+8).
// ---------------------------------------------------------------------------------
template <typename Cfg>
__device__ __forceinline__ void compute_qk_scores_and_max(
    float (&s)[Cfg::kMTiles][Cfg::kNTiles][4], float (&block_max)[Cfg::kMTiles][2],
    const typename Cfg::T* sQ_warp, const typename Cfg::T* sK, bool needs_mask, int row_base,
    int key_base, const AttnMask& mask, const ScoreMod& mod, float scale_log2) {
  // (block_max is returned in the log2 domain: max_j(s_j) * scale * log2(e).)
  zero_fill(s);
  gemm_rows_by_rows_t<typename Cfg::T, Cfg::kMTiles, Cfg::kHeadDim, Cfg::kBlockN, Cfg::kPitch>(s, sQ_warp, sK);
  modify_and_mask(s, needs_mask, row_base, key_base, mask, mod, scale_log2);
  block_row_max(s, block_max, mod.exp_scale(scale_log2));
}

// ---------------------------------------------------------------------------------
// Step 3: P = exp2(S - m) (masked entries are -inf -> 0), accumulate the row sums
// (per thread; the quad reduction waits until normalize_output) and O += P V.
// The S accumulator fragments of two neighbouring 8-key tiles are exactly the A fragment
// of one 16-key MMA step, so P goes from registers to the tensor cores without touching
// shared memory. V is read with ldmatrix.trans: lane i addresses key (i % 8) +
// 8 * ((i / 8) % 2), column block i / 16.
// ---------------------------------------------------------------------------------
// on_probs(P) runs between the two (dropout: after the row sums, which are those before it).
template <typename Cfg, typename OnProbs>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(float (&s)[Cfg::kMTiles][Cfg::kNTiles][4],
                                                                    RowStats<Cfg::kMTiles>& stats,
                                                                    float (&acc_o)[Cfg::kMTiles][Cfg::kDTiles][4],
                                                                    const typename Cfg::T* sV, float exp_scale,
                                                                    OnProbs&& on_probs) {
  exponentiate_block<typename Cfg::T>(s, stats, exp_scale);
  on_probs(s);
  gemm_regs_by_rows<typename Cfg::T, Cfg::kMTiles, Cfg::kBlockN, Cfg::kHeadDim, Cfg::kPitch>(acc_o, s, sV);
}

// ---------------------------------------------------------------------------------
// The kernel. Grid: (query blocks, query heads, batch).
// ---------------------------------------------------------------------------------
template <typename Cfg, int kVariant>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) fwd_mma_kernel(const FwdParams p) {
  constexpr bool kExt = kVariant != kPlain;
  using T = typename Cfg::T;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::Storage*>(smem_raw);
  // Stages are addressed as offsets from the first (tiers/wgmma/bwd.cuh says why).
  T* sQ = smem.q;
  T* sK = smem.k[0];
  T* sV = smem.v[0];
  using Padded = PaddedTile<Cfg::kPitch>;

  const int h = blockIdx.y;
  // Dropout's key, read (and recorded for the backward) before any CTA may return early.
  DropoutKey drop;
  if constexpr (kExt) {
    if (has_dropout(p)) {
      dropout_record(p.dropout);
      drop = dropout_key(p.dropout);
    }
  }
  const SeqInfo seq = SeqInfo::make<kExt>(p, blockIdx.z);
  const AttnMask mask = seq.mask(p);
  const int m_block = query_block_of_cta(mask);  // longest first
  const int row0 = m_block * Cfg::kBlockM;
  if (row0 >= seq.sq) return;  // varlen: this sequence is shorter than max_seqlen_q
  const ScoreMod mod = seq.score_mod<kExt>(p, h);
  const float exp_scale = mod.exp_scale(p.scale_log2);
  const int h_kv = h / (p.hq / p.hkv);
  const int warp = threadIdx.x / 32;
  const int rows_valid = min(Cfg::kBlockM, seq.sq - row0);
  const uint32_t head_slot = blockIdx.z * p.hq + h;  // dropout's (batch, head) of the draws

  const T* q = seq.q_rows(static_cast<const T*>(p.q), p.q_batch_stride, p.q_head_stride, p.q_row_stride, h) +
               static_cast<int64_t>(row0) * p.q_row_stride;
  T* o = seq.q_rows(static_cast<T*>(p.o), p.o_batch_stride, p.o_head_stride, p.o_row_stride, h) +
         static_cast<int64_t>(row0) * p.o_row_stride;
  float* lse = p.softmax_lse + seq.stat_offset(p, h) + row0;

  // Key blocks some row of this block can see (core/mask.cuh): blocks entirely above the
  // diagonal, or left of a sliding window, are never loaded.
  const BlockRange range = BlockRange::keys_of(mask, row0, row0 + rows_valid, Cfg::kBlockN);
  const int n_begin = range.begin, n_end = range.end;
  auto load_kv = [&](int nb, int stage) {
    copy_key_block_async<Cfg::kBlockN, Cfg::kHeadDim, Cfg::kThreads, Padded>(
        p, seq, h_kv, nb * Cfg::kBlockN, sK + stage * Cfg::kBlockN * Cfg::kPitch,
        sV + stage * Cfg::kBlockN * Cfg::kPitch, threadIdx.x);
  };


  // Prologue: Q and the first K/V block.
  copy_tile_async<Cfg::kBlockM, Cfg::kHeadDim, Cfg::kThreads, Padded>(sQ, q, p.q_row_stride, rows_valid, p.d,
                                                                   threadIdx.x);
  if (n_begin < n_end) load_kv(n_begin, n_begin % Cfg::kStages);  // block n in ring slot n % 2
  cp_async_commit();

  float acc_o[Cfg::kMTiles][Cfg::kDTiles][4];
  RowStats<Cfg::kMTiles> stats;
  start_online_softmax(acc_o, stats);

  const T* sQ_warp = sQ + warp * Cfg::kWarpRows * Cfg::kPitch;
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
    compute_qk_scores_and_max<Cfg>(s, block_max, sQ_warp, sK + stage * Cfg::kBlockN * Cfg::kPitch,
                                   needs_mask, warp_row0, key_base, mask, mod, p.scale_log2);
    merge_block_stats(stats, block_max, acc_o);
    compute_block_softmax_and_weighted_v<Cfg>(s, stats, acc_o, sV + stage * Cfg::kBlockN * Cfg::kPitch, exp_scale,
                                              [&](auto& probs) {
                                                if constexpr (kExt) {
                                                  if (has_dropout(p)) {
                                                    dropout_tile<false>(probs, drop, head_slot,
                                                                        warp_row0, key_base, p.dropout.scale);
                                                  }
                                                }
                                              });
  }
  cp_async_wait<0>();  // nothing may stay in flight into the Q tile we reuse below
  __syncthreads();     // (covers an empty key range, where Q's copy is still the last one)

  const int warp_rows_valid = min(Cfg::kWarpRows, rows_valid - warp * Cfg::kWarpRows);
  normalize_output<T, Padded>(acc_o, stats, sQ + warp * Cfg::kWarpRows * Cfg::kPitch,
                              o + static_cast<int64_t>(warp * Cfg::kWarpRows) * p.o_row_stride, p.o_row_stride,
                              lse + warp * Cfg::kWarpRows, warp_rows_valid, p.d, /*copy=*/true, StridedRows{},
                              p.sinks == nullptr ? nullptr : p.sinks + h);
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
