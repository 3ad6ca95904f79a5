// tiers/wgmma/fwd.cuh — the Hopper forward, warp-specialized (FlashAttention-3's recipe): TMA
// loads into a K/V ring of mbarrier-guarded stages, a producer warp that only issues those
// loads, two consumer warpgroups that only compute, with the products of one key block issued
// under the softmax of the previous one, ping-pong between the warpgroups, and persistent CTAs
// drawing tiles from a counter. kernel='auto' (and 'wgmma') runs it on sm_90 wherever it
// applies; OPTIMIZATION.md, "Hopper forward, warp-specialized", has the measured ladder.
//
// Why. wgmma reads its operands from shared memory for a whole warpgroup at once, which is the
// only way to the tensor cores' peak on Hopper; and when every warp copies K/V with cp.async and
// then computes, a block-wide barrier per key block orders the two (the first wgmma forward's
// Nsight profile had that barrier as its top stall, the tensor pipe at 46%: OPTIMIZATION.md).
// Here the copies are one thread's TMA instructions, completion is counted in bytes on a
// per-stage mbarrier, and a consumer warpgroup waits only for the stage it needs; the producer
// refills a stage as soon as both consumer warpgroups released it.
//
// CTA: 3 warpgroups (384 threads), one per SM; 4 at d = 64 from Sq = 2048 (192-row tiles).
// Warpgroup 0 is the producer: it gives up registers (setmaxnreg.dec), one of its warps walks
// the tiles and that warp's lane 0 issues the loads. Consumer warpgroup w (1, 2, and 3 with 192-row tiles) owns query rows
// 64(w-1) .. 64(w-1)+63 of the tile (setmaxnreg.inc): the accumulators of S (64 x kBlockN)
// and O (64 x kHeadDim) live in its registers; wgmma's accumulator has the C fragment layout per
// warp (core/fragment.cuh), so the online softmax of core/softmax.cuh runs on it unchanged. The
// consumer loop is its four steps, split where the pipeline needs it:
//   compute_qk_scores_and_max -> merge_block_stats -> compute_block_softmax(_and_weighted_v)
//   ... normalize_output.
//
// Shared memory: Q (kBlockM x kHeadDim) | K[kStages] | V[kStages] | O staging | mbarriers |
// tile slots. Q, K, V and O are in the 128-byte-swizzled slab layout of arch/sm90.cuh, which
// is what TMA's 128-byte swizzle writes (and reads) for a box of 64 columns (one slab) when the
// slab starts on a 1024-byte boundary. O leaves the way Q came in: each consumer warp stages its
// normalized rows there and one of its lanes stores them with TMA (store_o_tma). Barriers:
// q_full / q_empty (Q of the current tile), and per stage k_full, v_full (producer arrival +
// transaction bytes: V may still be landing while S = Q K^T runs), k_empty, v_empty (one
// arrival per consumer warp; K is freed as soon as S is done); v_tail, the producer's own, on
// which a packed sequence's partial last V block lands.
//
// Two consumer schedules (WsSchedule):
//   kSerial:  per key block, S = Q K^T, softmax, O += P V, each product waited for at once.
//   kOverlap: FlashAttention-3's intra-warpgroup overlap plus inter-warpgroup ping-pong. Each
//             step issues S(j) = Q K(j)^T and O += P(j-1) V(j-1), then waits for S(j) alone and
//             runs its mask, max and exponentials while P V is still on the tensor cores. Named
//             barriers order the two warpgroups' product groups (one issues while the other
//             runs its softmax), so the tensor cores always have a group queued.
//
// Packed (varlen) batches, in the kExtended instances. The tensor maps then run over all rows of
// the packed tensors (batch extent 1): sequence b's boxes start at its q_start / k_start rows
// (SeqInfo), and each tile takes its sequence's own mask. The scheduler counts max_seqlen_q's
// query blocks for every sequence; a tile that starts past its sequence's end has no work and
// the producer skips it (QueryTilePlan), so the consumers only ever see tiles with rows. A box that
// crosses a sequence's end reads the next sequence's rows: their scores are masked by selection
// (-inf, whatever they were), their Q rows give outputs that are never stored, and the V rows
// of the one partial key block are zeroed before the consumers see them (load_v_zero_tail), so
// that a NaN or Inf of one sequence never reaches another's output through 0 x NaN in P V.
//
// GQA packing (kPackGqa, the kernel fwd_sm90_ws_gqa_kernel). With G = hq / hkv query heads per
// KV group and a short Sq (chunked prefill, speculative decoding), a tile of one head has only
// Sq of its 128 rows, and the G heads of a group each stream the same K and V. A packed tile
// holds 128 / G queries of all G heads instead: tile row r is query q0 + r / G of the group's
// head r % G (core/mask.cuh: GqaPackedRows). The scheduler counts (batch, KV head, packed query
// block); the producer loads the group's K/V once per tile, and Q with one box per slab from a
// map whose dimensions run (d, head, row, batch) (arch/tma.h: make_row_tensor_map's
// box_heads), which lands exactly as those rows. A row's mask is its query's; the tile's key
// blocks are those of its queries [q0, q0 + 128 / G); O and lse go out row by row to their head
// and query (core/epilogue.cuh: GqaOutRows). G is a power of two (it divides 128), so r / G and
// r % G are a shift and a mask. Dense kPlain batches only (ALiBi's slope is per head, i.e. per
// row here), with the overlapped schedule; family.h (pack_gqa) says when the family takes it.
//
// Scope of this version: fp16 / bf16, head dims 64, 128, 192 and 256 (64 keys per step above
// 128), causal, windows, Sq != Sk, GQA, and in the kExtended instances packed batches, softcap
// and ALiBi (at d = 256 with the serial schedule: run_fwd_sm90_ws); views whose base and
// strides TMA can address (16-byte multiples). The launcher returns false otherwise and
// the caller runs the mma.sync forward (tiers/mma). kernel='auto' uses every instance
// (family.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../arch/host.h"
#include "../../arch/sm90.cuh"
#include "../../arch/tile.cuh"
#include "../../core/block.cuh"
#include "../../core/dropout.cuh"
#include "../../core/epilogue.cuh"
#include "../../core/scheduler.cuh"
#include "../../core/softmax.cuh"
#include "../../include/tiles.h"
#include "config.h"
#include "tma_maps.h"

namespace flash_cuda {
namespace sm90 {
namespace ws {

// The tensor maps of one call (a kernel parameter, read by the TMA unit; CUtensorMap carries
// its own alignment). o_by_tma: O leaves the staging tile through TMA stores on map o (16-row
// boxes: one consumer warp's rows); 0 where O is not staged, where its view is one TMA cannot
// address (and in the ablation build with FLASH_CUDA_WS_TMA_STORE=0): the warps' lanes copy it
// (normalize_output).
struct TmaMaps {
  CUtensorMap q, k, v, o;
  int o_by_tma;
};

// Named barriers (0 is __syncthreads): warpgroup w's turn to issue its products (kOverlap) is
// kTurnBarrier + w; each phase counts two warpgroups (the one handing over, the one taking).
constexpr int kTurnBarrier = 1;
constexpr int kTurnThreads = 256;

enum WsSchedule : int { kSerial = 0, kOverlap = 1 };

// Keys per step: 128 up to d = 128; 64 beyond, where two stages of 128-key K/V tiles and Q
// would not fit next to each other (d = 256: Q 64 KiB + 4 x 32 KiB at 64 keys).
constexpr int ws_block_n(int head_dim) { return tiles::wgmma_fwd_block_n(head_dim); }

// The tiles and the pipeline's sizes. kBlockN_: keys per step.
// kPolyEvery_: the share of exponentials taken on the FMA pipe (core/softmax.cuh:
// exponentiate_scores; an ablation rung).
// kStages_: K/V stages of the ring (2 fit every head dim; more only at d = 64).
// kConsumerWGs_: consumer warpgroups, 64 query rows each (3 only at d = 64: 192-row tiles).
// kDepth_: the head dims the instance serves (<= kHeadDim_): S = Q K^T stops after its k-steps,
// the tiles keep the bucket's width with TMA's zeros past d (d = 96: 6 of the 128-wide tile's 8).
// kSerialOnly_: the instance has the serial schedule alone (launch_fwd_sm90_ws), whose consumers
// hold one S tile, not two: at d = 256 they fit in 232 registers and the producer gets 40.
template <typename T_, int kHeadDim_, int kBlockN_ = ws_block_n(kHeadDim_), int kPolyEvery_ = 0, int kStages_ = 2,
          int kConsumerWGs_ = 2, int kDepth_ = kHeadDim_, bool kSerialOnly_ = false>
struct WsConfig {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kBlockM = 64 * kConsumerWGs_;  // 64 query rows per consumer warpgroup
  static constexpr int kNTiles = kBlockN / 8;         // C-fragment tiles of S (core/fragment.cuh)
  static constexpr int kDTiles = kHeadDim / 8;        // of O
  static constexpr size_t kTileQ = size_t(kBlockM) * kHeadDim * sizeof(T);
  static constexpr size_t kTileKV = size_t(kBlockN) * kHeadDim * sizeof(T);
  static_assert(kHeadDim % 64 == 0, "swizzled slabs are 64 columns wide");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "wgmma N");
  static constexpr int kQKSteps = (kDepth_ + 15) / 16;
  static_assert(kDepth_ <= kHeadDim_, "the tiles hold the instance's head dims");
  static constexpr int kPolyEvery = kPolyEvery_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr bool kSerialOnly = kSerialOnly_;
  static constexpr int kConsumerThreads = 128 * kConsumerWGs;
  static constexpr int kConsumerWarps = kConsumerThreads / 32;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kSlabs = kHeadDim_ / kSlabCols;
  // Registers per thread after setmaxnreg (see the static_assert below for the total). One
  // producer warp walks the tile loop (the rest of its warpgroup exits); a dense batch's loop
  // fits in 24 with little to spare (one more live value spilled it), a packed one's (its
  // sequence's offsets, lengths and mask per tile) in 40, which up to d = 192 it keeps. At
  // d = 256 the overlapped consumers need 240 for the 64 x 256 O accumulator beside two S tiles
  // (232 spills), which leaves the producer 24, enough for a dense batch only; the serial-only
  // instances (the extended ones, packed batches among them) keep 232 / 40. Three consumer
  // warpgroups (d = 64): 24 / 160.
  static constexpr bool kWideOverlap = kHeadDim_ > 192 && !kSerialOnly_;
  static constexpr int kProducerRegs = kConsumerWGs == 3 ? 24 : (kWideOverlap ? 24 : 40);
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : (kWideOverlap ? 240 : 232);
  static_assert(kConsumerWGs == 2 || (kConsumerWGs == 3 && kHeadDim_ == 64), "measured shapes");
  // setmaxnreg moves registers within what the CTA was launched with: kThreads x the per-thread
  // count that __launch_bounds__(kThreads, 1) allows (65536 / kThreads, a multiple of 8).
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kThreads * (65536 / kThreads / 8 * 8),
                "the registers the CTA is launched with");
  // Shared-memory pointers that the compiler knows as such (aligned_smem_base), except where
  // that form spills (three consumer warpgroups, d = 256: 8 bytes).
  static constexpr bool kSharedBase = kConsumerWGs == 2 && kHeadDim_ <= 192;
  // q_full, q_empty, k_full / v_full / k_empty / v_empty per stage, v_tail, then the two tile
  // slots.
  static constexpr int kBarriers = 3 + 4 * kStages;
  static constexpr size_t kBarrierBytes = sizeof(uint64_t) * kBarriers + 2 * sizeof(int);
  static constexpr size_t kRingBytes = kTileQ + 2 * kStages * kTileKV;
  // O is staged in its own tile, so that a persistent CTA's producer may already fill the ring
  // with the next tile's K/V while the consumers write this tile's O. The tile has Q's swizzled
  // slab layout (no padding: the swizzle keeps the fragment writes conflict-free), which is
  // what a TMA store of 64-column boxes reads; the lanes' 16-byte copies (a packed sequence's
  // last rows, FLASH_CUDA_WS_TMA_STORE=0) read it too. Where that tile does not fit (d = 256),
  // each thread stores its own pairs.
  static constexpr size_t kStagedO = size_t(kBlockM) * kHeadDim_ * sizeof(T_);
  static constexpr bool kStageO = kRingBytes + kStagedO + kBarrierBytes + 1024 <= kSmemHopper;
  static constexpr size_t kTileO = kStageO ? kStagedO : 0;
  static constexpr size_t kSmemBytes = kRingBytes + kTileO + kBarrierBytes + 1024;
  static_assert(kTileQ % 1024 == 0 && kTileKV % 1024 == 0, "slabs stay 1024-byte aligned");
  static_assert(kTileO % 1024 == 0, "the O tile's slabs stay 1024-byte aligned, and the barriers after it 8");
  static_assert(kBlockM <= 256 && kBlockN <= 256, "a TMA box has at most 256 rows");
  static_assert(kSmemBytes <= kSmemHopper, "fits a Hopper block");
};

// The ring of one CTA: where stage s of K and V lives, and its barriers.
template <typename Cfg>
struct Ring {
  using T = typename Cfg::T;
  static constexpr int kKVElems = Cfg::kBlockN * Cfg::kHeadDim;
  T* sK;
  T* sV;
  uint64_t* k_full;
  uint64_t* v_full;
  uint64_t* k_empty;
  uint64_t* v_empty;
  uint64_t* v_tail;  // the producer's: a partial V block lands here first (load_v_zero_tail)
  __device__ __forceinline__ const T* k(int s) const { return sK + s * kKVElems; }
  __device__ __forceinline__ const T* v(int s) const { return sV + s * kKVElems; }
  // The i-th key block this CTA loads (counted from 0 over all its tiles) sits in stage
  // i % kStages; its barriers complete once per pass over the ring, so the parity of the phase
  // to wait for is the pass's.
  __device__ __forceinline__ static int stage(int i) { return i % Cfg::kStages; }
  __device__ __forceinline__ static int parity(int i) { return (i / Cfg::kStages) & 1; }
  // This warp is done with K[s] (the product S = Q K^T that read it has completed), or with
  // V[s]. K and V are freed separately: the overlapped schedule holds V of block i-1 while it
  // already computes S of block i, and K's stage can then be refilled a whole step earlier.
  __device__ __forceinline__ void release_k(int s) const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&k_empty[s]);
  }
  __device__ __forceinline__ void release_v(int s) const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(&v_empty[s]);
  }
};

// The query tile of the CTA's current work tile, its barriers, and the slot through which the
// producer tells the consumers which tile that is (-1: no more tiles). Tile k of the CTA
// (counted from 0) uses phase k of q_full and of q_empty and slot k % 2.
struct QueryTile {
  uint64_t* full;   // the producer's arrival + the bytes of Q
  uint64_t* empty;  // one arrival per consumer warp: every product that reads Q has completed
  int* slot;        // [2]
  __device__ __forceinline__ void release() const {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbarrier_arrive(empty);
  }
};

// Moves a consumer warp's staged O rows to global memory: one TMA store per 64-column slab (box:
// 64 columns x 16 rows, at coordinates (column, row, head, batch) of map o), one bulk group,
// issued by lane 0. The TMA unit leaves out the box's rows and columns past the tensor's extent
// (a dense batch's last rows, d below the tile's width). Per warp rather than per warpgroup: the
// staged rows are the warp's own, so a __syncwarp orders every lane's writes before the issuing
// lane, and no warp waits at a named barrier for the slowest of its warpgroup. Before the rows
// are written again (the next tile's normalize_output) that lane waits until the unit has read
// them (wait_o_staging), and before the CTA retires until the stores are done.
template <typename Cfg>
__device__ __forceinline__ void store_o_tma(const CUtensorMap* map, const typename Cfg::T* sO_warp, int row, int h,
                                            int b) {
  fence_proxy_async();  // this lane's staging writes, before the async proxy reads them
  __syncwarp();
  if (threadIdx.x % 32 != 0) return;
#pragma unroll
  for (int c = 0; c < Cfg::kSlabs; ++c) {
    tma_store_4d(map, sO_warp + c * Cfg::kBlockM * kSlabCols, c * kSlabCols, row, h, b);
  }
  bulk_commit();
}

// The previous tile's TMA store of this warp's staged rows has read them (lane 0 issued it and
// waits; the __syncwarp holds the other lanes' writes back until then). Nothing pending: at once.
__device__ __forceinline__ void wait_o_staging() {
  if (threadIdx.x % 32 == 0) bulk_wait_read<0>();
  __syncwarp();
}

// The producer warp walks its tile loop together, so that all of it can zero the rows past a
// packed sequence's end (load_v_zero_tail); lane 0 alone issues the loads and the arrivals.
__device__ __forceinline__ bool issuing_lane() { return threadIdx.x % 32 == 0; }

// Where a tile's boxes start in the tensor maps: its first query row, the first row of its
// sequence's keys, the heads and the batch coordinate. A dense map has a batch dimension and
// rows per sequence; a packed map runs over every row (batch extent 1), where a sequence
// starts at its q_start / k_start.
struct TileCoords {
  int q_row, k_row, h, h_kv, b;
};

// Loads K or V of key block nb into ring position i, as soon as the consumers freed its stage.
template <typename Cfg>
__device__ __forceinline__ void load_kv(const CUtensorMap* map, typename Cfg::T* tiles, uint64_t* full,
                                        uint64_t* empty, const Ring<Cfg>& ring, int i, int nb, const TileCoords& at) {
  const int s = ring.stage(i);
  mbarrier_wait(&empty[s], ring.parity(i) ^ 1);  // the first pass finds every stage free
  if (!issuing_lane()) return;
  mbarrier_arrive_expect_tx(&full[s], Cfg::kTileKV);
#pragma unroll
  for (int c = 0; c < Cfg::kSlabs; ++c) {
    tma_load_4d(tiles + s * ring.kKVElems + c * Cfg::kBlockN * kSlabCols, map, &full[s], c * kSlabCols,
                at.k_row + nb * Cfg::kBlockN, at.h_kv, at.b);
  }
}

// V of a packed sequence's last key block nb, of which only rows [0, rows) are the sequence's:
// the box also reads the next sequence's first rows. Their scores are masked by selection, so
// their P is exactly 0 and K needs nothing; but P V multiplies that 0 by V, and 0 x NaN or
// 0 x Inf is NaN: one sequence's non-finite values would reach another's output. So V lands
// on the producer's own barrier, the warp zeroes rows [rows, kBlockN) of every slab, fences
// the stores for the async proxy (wgmma reads V through it), and only then completes the
// stage's v_full, with an arrival that carries no bytes. One block per tile at most, and only
// where a box crosses into another sequence: full blocks take load_kv.
template <typename Cfg>
__device__ __forceinline__ void load_v_zero_tail(const CUtensorMap* map, const Ring<Cfg>& ring, int& tail_phase,
                                                 int i, int nb, const TileCoords& at, int rows) {
  const int s = ring.stage(i);
  typename Cfg::T* tile = ring.sV + s * ring.kKVElems;
  mbarrier_wait(&ring.v_empty[s], ring.parity(i) ^ 1);
  if (issuing_lane()) {
    mbarrier_arrive_expect_tx(ring.v_tail, Cfg::kTileKV);
#pragma unroll
    for (int c = 0; c < Cfg::kSlabs; ++c) {
      tma_load_4d(tile + c * Cfg::kBlockN * kSlabCols, map, ring.v_tail, c * kSlabCols, at.k_row + nb * Cfg::kBlockN,
                  at.h_kv, at.b);
    }
  }
  mbarrier_wait(ring.v_tail, tail_phase);
  tail_phase ^= 1;
  zero_rows<Cfg::kBlockN, Cfg::kSlabs>(tile, rows, static_cast<int>(threadIdx.x % 32));
  fence_proxy_async();
  __syncwarp();
  if (issuing_lane()) mbarrier_arrive(&ring.v_full[s]);
}

// The producer of tile k (number t, or t = -1: none left). K of the tile's first block goes
// first: its stage is usually free well before the consumers are done with the previous tile's
// Q, so the new tile's first product can start as soon as Q lands. `first`: the ring position
// of the tile's block 0. A tile without keys (its rows see none) gets no loads at all: the
// consumers write its zeros and -inf without reading Q. `last_rows`: the rows of the last
// block that are its sequence's when a box would cross into another sequence, else kBlockN.
// kPackGqa: the Q map runs (d, head, row, batch) (make_row_tensor_map's box_heads), and at.h is
// the group's first query head.
template <typename Cfg, bool kPackGqa = false>
__device__ __forceinline__ void produce(const TmaMaps& maps, const Ring<Cfg>& ring, int first, typename Cfg::T* sQ,
                                        const QueryTile& qt, int k, int t, const BlockRange& range,
                                        const TileCoords& at, int last_rows, int& tail_phase) {
  const bool loads = t >= 0 && range.count() > 0;
  if (loads) load_kv<Cfg>(&maps.k, ring.sK, ring.k_full, ring.k_empty, ring, first, range.begin, at);
  mbarrier_wait(qt.empty, (k & 1) ^ 1);
  if (issuing_lane()) {
    // Published by the arrival below (release), read after its wait (acquire). Atomic accesses:
    // the ordering is the mbarrier's, which compute-sanitizer's racecheck does not model.
    atomicExch(&qt.slot[k & 1], t);
    if (loads) {
      mbarrier_arrive_expect_tx(qt.full, Cfg::kTileQ);
#pragma unroll
      for (int c = 0; c < Cfg::kSlabs; ++c) {
        if constexpr (kPackGqa) {
          tma_load_4d(sQ + c * Cfg::kBlockM * kSlabCols, &maps.q, qt.full, c * kSlabCols, at.h, at.q_row, at.b);
        } else {
          tma_load_4d(sQ + c * Cfg::kBlockM * kSlabCols, &maps.q, qt.full, c * kSlabCols, at.q_row, at.h, at.b);
        }
      }
    } else {
      mbarrier_arrive(qt.full);
    }
  }
  if (!loads) return;
  for (int nb = range.begin, i = first; nb < range.end; ++nb, ++i) {
    if (nb > range.begin) load_kv<Cfg>(&maps.k, ring.sK, ring.k_full, ring.k_empty, ring, i, nb, at);
    if (nb == range.end - 1 && last_rows < Cfg::kBlockN) {
      load_v_zero_tail<Cfg>(&maps.v, ring, tail_phase, i, nb, at, last_rows);
    } else {
      load_kv<Cfg>(&maps.v, ring.sV, ring.v_full, ring.v_empty, ring, i, nb, at);
    }
  }
}

// What a consumer warp needs to know about its rows and keys. Rows: which query each row holds
// (core/mask.cuh): OneQueryPerRow, or GqaPackedRows in the GQA-packed kernel.
// Dropout's state in a consumer (the dropout instances): the launch's key, the tile's (batch,
// head) slot of the draws and the kept probabilities' scale.
struct DropoutState {
  DropoutKey key;
  uint32_t head_slot;
  float scale;
};
struct NoDropout {};

template <typename Rows, bool kDropout_ = false>
struct ConsumerView {
  static constexpr bool kDropout = kDropout_;
  std::conditional_t<kDropout_, DropoutState, NoDropout> drop;
  AttnMask mask;  // of the tile's sequence
  ScoreMod mod;
  BlockRange range;
  Rows rows;
  int wg;         // consumer warpgroup: 0 or 1
  int wg_row0;    // its first row within the CTA's tile
  int row_base;   // this warp's first row as `rows` counts them (the query itself, or the tile row)
  int warp_row0;  // the first query of this warp's rows (sequence index)
  int warp_row_end;  // one past the last (at most the sequence's end)
  float scale_log2, exp_scale;
  __device__ __forceinline__ bool needs_mask(int nb, int block_n) const {
    return mask.needs_mask(warp_row0, warp_row_end, nb * block_n, (nb + 1) * block_n);
  }
};

// ---- The steps, as both schedules issue and wait for them ----
// Issues S = Q K^T (one commit group).
template <typename Cfg>
__device__ __forceinline__ void issue_qk(float (&sc)[1][Cfg::kNTiles][4], const typename Cfg::T* sQ, int wg_row0,
                                         const typename Cfg::T* sK) {
  wgmma_fence();
  wgmma_ss<Cfg::kQKSteps, false, typename Cfg::T>(sc[0], KMajor<Cfg::kBlockM>{sQ, wg_row0}, KMajor<Cfg::kBlockN>{sK, 0});
  wgmma_commit();
}

// Issues O += P V with P already in A fragments (one commit group).
template <typename Cfg>
__device__ __forceinline__ void issue_weighted_v(float (&acc_o)[1][Cfg::kDTiles][4],
                                                 const uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                                 const typename Cfg::T* sV) {
  wgmma_fence();
  wgmma_rs<typename Cfg::T>(acc_o[0], pa, MNMajor<Cfg::kBlockN>{sV, 0});
  wgmma_commit();
}

// Step 1: S was issued (issue_qk), possibly followed by kNewer more groups (the previous
// block's P V); wait for S alone, then the modifiers, the mask and the block's row maxima.
template <typename Cfg, int kNewer, typename View>
__device__ __forceinline__ void compute_qk_scores_and_max(float (&sc)[1][Cfg::kNTiles][4], float (&block_max)[1][2],
                                                          const View& cv, int nb) {
  wgmma_wait<kNewer>();
  fence_accumulator(sc[0]);
  modify_and_mask(sc, cv.needs_mask(nb, Cfg::kBlockN), cv.row_base, nb * Cfg::kBlockN, cv.mask, cv.mod, cv.scale_log2,
                  cv.rows);
  block_row_max(sc, block_max, cv.mod.exp_scale(cv.scale_log2));
}

// Step 2, overlapped: the new running statistics now; O, which the previous block's P V may
// still be accumulating, is rescaled by the returned alpha later, right before the next P V
// is issued (Rescale::apply). (The serial schedule takes core/softmax.cuh's merge_block_stats.)
struct Rescale {
  float alpha[1][2];
  bool pending = false;
  template <int kD>
  __device__ __forceinline__ void apply(float (&acc_o)[1][kD][4]) {
    if (pending) rescale_output(acc_o, alpha);
    pending = false;
  }
};
__device__ __forceinline__ void merge_block_stats(RowStats<1>& stats, const float (&block_max)[1][2],
                                                  Rescale& rescale) {
  rescale.pending = update_row_stats(stats, block_max, rescale.alpha);
}

// Step 3 in two halves: P = 2^(S - m) in place and the row sums (overlapped: while the previous
// P V still runs); then, once that has landed, P rounded to 16 bits into the A fragments that
// the next O += P V reads (to_a_fragments).
template <typename Cfg>
__device__ __forceinline__ void compute_block_softmax(float (&sc)[1][Cfg::kNTiles][4], RowStats<1>& stats,
                                                      float exp_scale) {
  exponentiate_block<typename Cfg::T, Cfg::kPolyEvery>(sc, stats, exp_scale);
}
template <typename Cfg>
__device__ __forceinline__ void to_a_fragments(uint32_t (&pa)[Cfg::kBlockN / 16][4],
                                               const float (&sc)[1][Cfg::kNTiles][4]) {
  accumulator_to_a<typename Cfg::T>(pa, sc[0]);
}

// Dropout (the dropout instances): P of key block nb times the keep mask and scale, after the row
// sums (which are those before it). In the overlapped schedule it runs while the previous
// block's P V is on the tensor cores, so the draws' integer work overlaps that product.
template <typename Cfg, typename View>
__device__ __forceinline__ void drop_probs(float (&sc)[1][Cfg::kNTiles][4], const View& cv, int nb) {
  if constexpr (View::kDropout) {
    dropout_tile<false>(sc, cv.drop.key, cv.drop.head_slot, cv.warp_row0, nb * Cfg::kBlockN, cv.drop.scale);
  }
}

// Step 3 whole: P, its row sums, then O += P V, waited for at once (the serial schedule).
template <typename Cfg, typename View>
__device__ __forceinline__ void compute_block_softmax_and_weighted_v(float (&sc)[1][Cfg::kNTiles][4],
                                                                    RowStats<1>& stats,
                                                                    float (&acc_o)[1][Cfg::kDTiles][4],
                                                                    const typename Cfg::T* sV, const View& cv,
                                                                    int nb) {
  compute_block_softmax<Cfg>(sc, stats, cv.exp_scale);
  drop_probs<Cfg>(sc, cv, nb);
  // P rounded to 16 bits, all of it before the first wgmma: registers an in-flight wgmma reads
  // must not be written in between.
  uint32_t pa[Cfg::kBlockN / 16][4];
  to_a_fragments<Cfg>(pa, sc);
  issue_weighted_v<Cfg>(acc_o, pa, sV);
  wgmma_wait<0>();
  fence_accumulator(acc_o[0]);
}

// kSerial: per key block the four steps, each product waited for at once (the extended d = 256
// instances, whose consumers hold one S tile; elsewhere an ablation rung).
template <typename Cfg, typename View>
__device__ __forceinline__ void consume_serial(const Ring<Cfg>& ring, int first, const typename Cfg::T* sQ,
                                               const QueryTile& qt, const View& cv, float (&acc_o)[1][Cfg::kDTiles][4],
                                               RowStats<1>& stats) {
  for (int nb = cv.range.begin, i = first; nb < cv.range.end; ++nb, ++i) {
    const int s = ring.stage(i);
    float sc[1][Cfg::kNTiles][4];
    float block_max[1][2];
    mbarrier_wait(&ring.k_full[s], ring.parity(i));
    issue_qk<Cfg>(sc, sQ, cv.wg_row0, ring.k(s));
    compute_qk_scores_and_max<Cfg, 0>(sc, block_max, cv, nb);
    ring.release_k(s);
    if (nb == cv.range.end - 1) qt.release();  // the tile's last product that reads Q is done
    merge_block_stats(stats, block_max, acc_o);
    mbarrier_wait(&ring.v_full[s], ring.parity(i));
    compute_block_softmax_and_weighted_v<Cfg>(sc, stats, acc_o, ring.v(s), cv, nb);
    ring.release_v(s);
  }
}

// Ping-pong: a warpgroup issues its product group only on its turn and then hands the turn to
// the next (round robin over kWGs), so the groups reach the tensor cores in turn while the
// other warpgroups run their softmax. Each warpgroup syncs on its own barrier once per group
// and arrives on the next one's; the last warpgroup opens the first turn for warpgroup 0 and
// skips its own last hand-over, so every barrier phase has exactly 128 waiting and 128
// arriving threads (per tile every warpgroup takes n + 1 turns, so a persistent CTA starts
// every tile in the same state).
template <int kWGs>
struct Turns {
  int wg;
  __device__ __forceinline__ void open() const {
    if (wg == kWGs - 1) named_barrier_arrive(kTurnBarrier + 0, kTurnThreads);
  }
  __device__ __forceinline__ void take() const { named_barrier_sync(kTurnBarrier + wg, kTurnThreads); }
  __device__ __forceinline__ void pass(bool last) const {
    if (!(last && wg == kWGs - 1)) named_barrier_arrive(kTurnBarrier + (wg + 1) % kWGs, kTurnThreads);
  }
};

// FlashAttention-3's order within a warpgroup: per key block i, issue S(i), rescale O for
// block i-1's statistics, issue P(i-1) V(i-1); wait for S(i) alone and run its mask, max,
// statistics and exponentials while P V is on the tensor cores; then wait for P V, free the
// stage and round P(i) into A fragments. `first`: the ring position of this tile's block 0.
template <typename Cfg, typename View>
__device__ __forceinline__ void consume_overlap(const Ring<Cfg>& ring, int first, const typename Cfg::T* sQ,
                                                const QueryTile& qt, const View& cv, float (&acc_o)[1][Cfg::kDTiles][4],
                                                RowStats<1>& stats) {
  const int n = cv.range.count();
  if (n <= 0) return;
  const Turns<Cfg::kConsumerWGs> turns{cv.wg};
  turns.open();
  float sc[1][Cfg::kNTiles][4];
  uint32_t pa[Cfg::kBlockN / 16][4];
  float block_max[1][2];
  Rescale rescale;

  // Block 0: S alone, then its softmax (O is still zero: nothing to rescale).
  mbarrier_wait(&ring.k_full[ring.stage(first)], ring.parity(first));
  turns.take();
  issue_qk<Cfg>(sc, sQ, cv.wg_row0, ring.k(ring.stage(first)));
  turns.pass(false);
  compute_qk_scores_and_max<Cfg, 0>(sc, block_max, cv, cv.range.begin);
  ring.release_k(ring.stage(first));
  if (n == 1) qt.release();  // the tile's last product that reads Q is done
  merge_block_stats(stats, block_max, rescale);
  rescale.pending = false;
  compute_block_softmax<Cfg>(sc, stats, cv.exp_scale);
  drop_probs<Cfg>(sc, cv, cv.range.begin);
  to_a_fragments<Cfg>(pa, sc);

  for (int i = 1; i < n; ++i) {
    const int s = ring.stage(first + i), s_prev = ring.stage(first + i - 1);
    mbarrier_wait(&ring.k_full[s], ring.parity(first + i));
    turns.take();
    issue_qk<Cfg>(sc, sQ, cv.wg_row0, ring.k(s));
    rescale.apply(acc_o);
    mbarrier_wait(&ring.v_full[s_prev], ring.parity(first + i - 1));
    issue_weighted_v<Cfg>(acc_o, pa, ring.v(s_prev));
    turns.pass(false);
    compute_qk_scores_and_max<Cfg, 1>(sc, block_max, cv, cv.range.begin + i);
    ring.release_k(s);
    if (i == n - 1) qt.release();
    merge_block_stats(stats, block_max, rescale);
    compute_block_softmax<Cfg>(sc, stats, cv.exp_scale);
    drop_probs<Cfg>(sc, cv, cv.range.begin + i);
    wgmma_wait<0>();  // P(i-1) V(i-1) landed: pa may be rewritten, O rescaled, the stage freed
    fence_accumulator(acc_o[0]);
    fence_fragments(pa);
    ring.release_v(s_prev);
    to_a_fragments<Cfg>(pa, sc);
  }

  // The last block's P V.
  const int s_last = ring.stage(first + n - 1);
  turns.take();
  rescale.apply(acc_o);
  mbarrier_wait(&ring.v_full[s_last], ring.parity(first + n - 1));
  issue_weighted_v<Cfg>(acc_o, pa, ring.v(s_last));
  turns.pass(true);
  wgmma_wait<0>();
  fence_accumulator(acc_o[0]);
  fence_fragments(pa);
  ring.release_v(s_last);
}

// kExt: the kExtended instances: packed batches, softcap and ALiBi. A dense call through them
// reads cu_seqlens_q == nullptr and takes the dense path. kPackGqa: GQA-packed tiles (the head
// comment), dense kPlain batches only. kDrop: attention dropout on dense batches without score
// modifiers (the dropout instances; kExt and kPackGqa off).
template <typename Cfg, int kSchedule, bool kExt, bool kPackGqa = false, bool kDrop = false>
__device__ __forceinline__ void fwd_ws_block(const FwdParams& p, const TmaMaps& maps) {
  static_assert(!(kPackGqa && kExt), "a packed tile's rows share no per-head modifier, nor one sequence's offsets");
  static_assert(!(kDrop && (kExt || kPackGqa)), "dropout instances: dense batches, one query per row");
  using T = typename Cfg::T;
  using Work = QueryTilePlan<Cfg::kBlockM, Cfg::kBlockN, kExt>;
  using Rows = std::conditional_t<kPackGqa, GqaPackedRows, OneQueryPerRow>;
  constexpr int kStages = Cfg::kStages;
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = aligned_smem_base<Cfg::kSharedBase>(smem_raw);
  T* sQ = reinterpret_cast<T*>(smem);
  T* sO = reinterpret_cast<T*>(smem + Cfg::kTileQ + 2 * kStages * Cfg::kTileKV);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Cfg::kTileQ + 2 * kStages * Cfg::kTileKV + Cfg::kTileO);
  QueryTile qt{bars, bars + 1, reinterpret_cast<int*>(bars + Cfg::kBarriers)};
  Ring<Cfg> ring;
  ring.sK = reinterpret_cast<T*>(smem + Cfg::kTileQ);
  ring.sV = reinterpret_cast<T*>(smem + Cfg::kTileQ + kStages * Cfg::kTileKV);
  ring.k_full = bars + 2;
  ring.v_full = ring.k_full + kStages;
  ring.k_empty = ring.v_full + kStages;
  ring.v_empty = ring.k_empty + kStages;
  ring.v_tail = ring.v_empty + kStages;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (kDrop) dropout_record(p.dropout);  // the (seed, offset) for the backward

  if (threadIdx.x == 0) {
    mbarrier_init(qt.full, 1);
    mbarrier_init(qt.empty, Cfg::kConsumerWarps);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&ring.k_full[s], 1);
      mbarrier_init(&ring.v_full[s], 1);
      mbarrier_init(&ring.k_empty[s], Cfg::kConsumerWarps);
      mbarrier_init(&ring.v_empty[s], Cfg::kConsumerWarps);
    }
    mbarrier_init(ring.v_tail, 1);
    fence_barrier_init();
  }
  __syncthreads();  // the last CTA-wide barrier: from here on the roles never meet all at once

  if (warp < 4) {
    setmaxnreg_dec<Cfg::kProducerRegs>();
    if (warp == 0) {
      const int shift = kPackGqa ? gqa_shift(p) : 0;
      const TileScheduler sched = TileScheduler::of<Cfg::kBlockM, kPackGqa>(p, shift);
      // Warp 0 loads every tile of this CTA (ring positions run on across tiles) and finally
      // publishes "no more tiles". A tile without rows (past its packed sequence's end) is
      // skipped here and never published: the consumers see only tiles with rows.
      const bool packed = kExt && p.cu_seqlens_q != nullptr;
      int t = sched.first();
      for (int k = 0, first = 0, tail_phase = 0;;) {
        if (t >= sched.total()) {
          produce<Cfg, kPackGqa>(maps, ring, first, sQ, qt, k, -1, BlockRange{0, 0}, TileCoords{}, Cfg::kBlockN,
                                 tail_phase);
          break;
        }
        // Drawn now, used after this tile's loads are issued; lane 0 draws for the warp.
        const int t_next = __shfl_sync(0xffffffffu, lane == 0 ? sched.next(t) : 0, 0);
        const TileScheduler::Tile tile = sched.at(t);
        const Work w = Work::make(p, tile.b, tile.m_block, shift);
        if (w.rows_valid > 0) {
          // A GQA-packed tile's h is its KV head; its Q box starts at the group's first query head.
          const int h_kv = kPackGqa ? tile.h : int(unsigned(tile.h) / (unsigned(p.hq) / unsigned(p.hkv)));
          const TileCoords at{w.seq.q_start + w.q0, w.seq.k_start, kPackGqa ? tile.h << shift : tile.h, h_kv,
                              packed ? 0 : tile.b};
          // Rows of the last block that are the sequence's, where its box would read on into
          // another sequence's rows (rows past the tensor's end TMA fills with zeros itself).
          const int last_key = w.range.end * Cfg::kBlockN;
          const int last_rows = packed && last_key > w.seq.sk && w.seq.k_start + w.seq.sk < p.total_k
                                    ? w.seq.sk - (w.range.end - 1) * Cfg::kBlockN
                                    : Cfg::kBlockN;
          produce<Cfg, kPackGqa>(maps, ring, first, sQ, qt, k, t, w.range, at, last_rows, tail_phase);
          first += w.range.count();
          ++k;
        }
        t = t_next;
      }
    }
    return;
  }

  // ---- consumers: warps 4..11, warpgroup w = (warp - 4) / 4 owns rows 64w .. 64w + 63 ----
  setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int shift = kPackGqa ? gqa_shift(p) : 0;
  const TileScheduler sched = TileScheduler::of<Cfg::kBlockM, kPackGqa>(p, shift);
  const int cwarp = warp - 4;
  for (int k = 0, first = 0;; ++k) {
    mbarrier_wait(qt.full, k & 1);
    const int t = atomicAdd(&qt.slot[k & 1], 0);
    if (t < 0) break;
    const TileScheduler::Tile tile = sched.at(t);
    const Work w = Work::make(p, tile.b, tile.m_block, shift);  // rows_valid > 0: the producer publishes no other tile
    ConsumerView<Rows, kDrop> cv;
    if constexpr (kDrop) cv.drop = DropoutState{dropout_key(p.dropout), uint32_t(tile.b * p.hq + tile.h), p.dropout.scale};
    cv.mask = w.mask;
    cv.mod = w.seq.template score_mod<kExt>(p, tile.h);
    cv.range = w.range;
    cv.wg = cwarp / 4;
    cv.wg_row0 = cv.wg * 64;
    if constexpr (kPackGqa) {
      cv.rows = GqaPackedRows{w.q0, shift};
      cv.row_base = 16 * cwarp;
    } else {
      cv.row_base = w.q0 + 16 * cwarp;
    }
    cv.warp_row0 = cv.rows.query(cv.row_base);
    cv.warp_row_end = min(cv.rows.query(cv.row_base + 15) + 1, w.seq.sq);
    cv.scale_log2 = p.scale_log2;
    cv.exp_scale = cv.mod.exp_scale(p.scale_log2);

    float acc_o[1][Cfg::kDTiles][4];
    RowStats<1> stats;
    start_online_softmax(acc_o, stats);

    // The consume functions release Q after the tile's last S = Q K^T, so that the next
    // tile's Q loads under the last P V and this epilogue; a tile without keys (for which the
    // producer loaded no Q) releases here.
    if constexpr (kSchedule == kOverlap) {
      consume_overlap<Cfg>(ring, first, sQ, qt, cv, acc_o, stats);
    } else {
      consume_serial<Cfg>(ring, first, sQ, qt, cv, acc_o, stats);
    }
    if (cv.range.count() == 0) qt.release();
    first += cv.range.count();

    // Step 4 through this warp's own 16 rows of the O staging tile, or straight from registers
    // where that tile does not fit (kStageO). Before the rows are rewritten, the previous
    // tile's reads of them are done: the lanes' copies (normalize_output's __syncwarp and the
    // one in wait_o_staging), the TMA unit's (wait_o_staging). Only the sequence's rows are
    // stored (rows_valid): a packed tile's rows past its end hold another sequence's queries,
    // so a warp whose rows cross its sequence's end copies lane by lane; a TMA store would
    // write all 16 rows (its map runs over every packed row). A dense batch's map ends with
    // the sequence: the store leaves out the rows past it. A GQA-packed tile's rows go to their
    // own heads and queries, lane by lane (O's map has one head per box).
    if constexpr (Cfg::kStageO) {
      wait_o_staging();
    } else {
      __syncwarp();
    }
    const int h = kPackGqa ? tile.h << shift : tile.h;  // the tile's (first) query head
    T* o = w.seq.q_rows(static_cast<T*>(p.o), p.o_batch_stride, p.o_head_stride, p.o_row_stride, h) +
           static_cast<int64_t>(w.q0) * p.o_row_stride;
    float* lse = p.softmax_lse + w.seq.stat_offset(p, h) + w.q0;
    const int warp_rows_valid = min(16, w.rows_valid - 16 * cwarp);
    T* sO_warp = sO + cwarp * 16 * kSlabCols;
    // A consumer warp's 16 rows of the O staging tile (whose slabs hold all kBlockM rows): row r
    // of the warp is row 16 w + r of the tile, which has the same swizzle phase (r % 8), so the
    // warp's rows are addressed as those of a kBlockM-row tile from its first row on.
    using Staging = SwizzledTile<Cfg::kBlockM>;
    if constexpr (kPackGqa) {
      normalize_output<T, Staging, Cfg::kStageO, /*kInTileLoop=*/true>(
          acc_o, stats, sO_warp, o, p.o_row_stride, lse, warp_rows_valid, p.d, /*copy=*/true,
          GqaOutRows{16 * cwarp, shift, p.o_head_stride, p.stat_head_stride});
    } else {
      const bool packed = kExt && p.cu_seqlens_q != nullptr;
      const bool by_tma =
          Cfg::kStageO && maps.o_by_tma != 0 && (warp_rows_valid == 16 || (!packed && warp_rows_valid > 0));
      normalize_output<T, Staging, Cfg::kStageO, /*kInTileLoop=*/true>(
          acc_o, stats, sO_warp, o + static_cast<int64_t>(16 * cwarp) * p.o_row_stride, p.o_row_stride,
          lse + 16 * cwarp, warp_rows_valid, p.d, /*copy=*/!by_tma);
      if (by_tma) {
        store_o_tma<Cfg>(&maps.o, sO_warp, w.seq.q_start + w.q0 + 16 * cwarp, tile.h, packed ? 0 : tile.b);
      }
    }
  }
  // The last tile's stores are done (not only their reads of shared memory) before the CTA
  // retires.
  if constexpr (Cfg::kStageO) {
    if (threadIdx.x % 32 == 0) bulk_wait<0>();
  }
}

template <typename Cfg, int kSchedule, bool kExt>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_sm90_ws_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ TmaMaps maps) {
  FLASH_SM90_KERNEL_BODY(fwd_ws_block<Cfg, kSchedule, kExt>(p, maps));  // (sm90_kernel_built)
}

// Attention dropout (dense batches, no score modifier, the overlapped schedule), under a name of
// its own: the dropout-free kernels keep their registers.
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_sm90_ws_dropout_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ TmaMaps maps) {
  FLASH_SM90_KERNEL_BODY(fwd_ws_block<Cfg, kOverlap, /*kExt=*/false, /*kPackGqa=*/false, /*kDrop=*/true>(p, maps));  // (sm90_kernel_built)
}

// The GQA-packed tiles (kPlain, the overlapped schedule), under a name of its own so that a
// profile tells the two routes apart.
template <typename Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_sm90_ws_gqa_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ TmaMaps maps) {
  FLASH_SM90_KERNEL_BODY(fwd_ws_block<Cfg, kOverlap, /*kExt=*/false, /*kPackGqa=*/true>(p, maps));  // (sm90_kernel_built)
}

}  // namespace ws
}  // namespace sm90

// The maps, shared memory and grid of either kernel, whose tiles hold kBlockM / group queries of
// `group` query heads each (group 1: one head per tile), and the launch; false, having launched
// nothing, where TMA cannot address a view.
template <typename Cfg, typename Kernel>
bool launch_ws_tiles(Kernel kernel, const FwdParams& p, cudaStream_t stream, int group) {
  sm90::ws::TmaMaps maps;  // a packed batch's maps span all its rows (tma_maps.h: MapRows)
  if (!make_qkv_tensor_maps(p, &maps.q, &maps.k, &maps.v, Cfg::kBlockM, Cfg::kBlockN, group)) return false;
  // O's map (one head per box) serves the unpacked tiles; without it the lanes copy the staged rows.
  maps.o_by_tma =
      group == 1 && Cfg::kStageO && wgmma::ws_tma_store() && make_o_tensor_map(p, &maps.o, /*box_rows=*/16) ? 1 : 0;
  set_smem_limit(kernel, Cfg::kSmemBytes, "fwd_sm90_ws");
  // One CTA per SM fits (shared memory and registers): a persistent grid of num_sms CTAs.
  const int64_t tiles = int64_t(ceil_div(p.sq, Cfg::kBlockM / group)) * (p.hq / group) * p.b;
  const int grid = persistent_grid(tiles, p.num_sms, wgmma::ws_persistent());
  if (grid == 0) return false;
  FwdParams params = p;
  params.tile_section = tile_section(p, group, Cfg::kBlockM / group);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(params, maps);
  check_launch("fwd_sm90_ws");
  return true;
}

// Launches the warp-specialized forward and returns true, or returns false having launched
// nothing: not an sm_90 device or not built for sm_90a, a call of another variant, or a view
// TMA cannot address. The serial schedule is built for the configurations that have it alone
// (kSerialOnly) and, in an ablation build, beside the overlapped one of the 128-row tiles.
template <typename Cfg, int kVariant>
bool launch_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  constexpr bool kExt = kVariant != kPlain;
  constexpr bool kSerialRung = kAblations && !Cfg::kSerialOnly && Cfg::kPolyEvery == 0 && Cfg::kStages == 2 &&
                               Cfg::kConsumerWGs == 2;
  auto kernel = sm90::ws::fwd_sm90_ws_kernel<Cfg, Cfg::kSerialOnly ? sm90::ws::kSerial : sm90::ws::kOverlap, kExt>;
  if constexpr (kSerialRung) {
    if (wgmma::ws_serial()) kernel = sm90::ws::fwd_sm90_ws_kernel<Cfg, sm90::ws::kSerial, kExt>;
  }
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (variant_of(p, /*backward=*/false) != kVariant) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, /*group=*/1);
}

// The GQA-packed forward (kPlain only): false, having launched nothing, where G = hq / hkv is
// not a divisor > 1 of the tile's rows or the call is not a plain dense one.
template <typename Cfg>
bool launch_fwd_sm90_ws_gqa(const FwdParams& p, cudaStream_t stream) {
  auto kernel = sm90::ws::fwd_sm90_ws_gqa_kernel<Cfg>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (variant_of(p, /*backward=*/false) != kPlain || p.hkv <= 0 || p.hq % p.hkv != 0) return false;
  const int group = p.hq / p.hkv;
  if (group < 2 || Cfg::kBlockM % group != 0) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, group);
}

// The forward with attention dropout: false, having launched nothing, where its instances do not
// serve the call (config.h: fwd_dropout_applies; the mma.sync family serves those with dropout).
template <typename Cfg>
bool launch_fwd_sm90_ws_dropout(const FwdParams& p, cudaStream_t stream) {
  auto kernel = sm90::ws::fwd_sm90_ws_dropout_kernel<Cfg>;
  if (p.sm_arch != 90 || !sm90_kernel_built(kernel)) return false;
  if (!has_dropout(p) || !wgmma::fwd_dropout_applies(p)) return false;
  return launch_ws_tiles<Cfg>(kernel, p, stream, /*group=*/1);
}

// The ablation rungs of the d 64 / 128 kPlain forward (family.h: the switches), each one
// configuration measured against the default in OPTIMIZATION.md: the poly-exp2 share, and at
// d = 64 192-key steps and a 4-stage ring. Declines (false) where no switch is set.
template <typename T, int kHeadDim, int kVariant>
bool launch_fwd_sm90_ws_rung(const FwdParams& p, cudaStream_t stream) {
  using sm90::ws::WsConfig;
  if constexpr (kAblations && (kHeadDim == 64 || kHeadDim == 128) && kVariant == kPlain) {
    constexpr int kBlockN = sm90::ws::ws_block_n(kHeadDim);
    switch (wgmma::ws_exp2_poly_every()) {
      case 4: return launch_fwd_sm90_ws<WsConfig<T, kHeadDim, kBlockN, 4>, kVariant>(p, stream);
      case 8: return launch_fwd_sm90_ws<WsConfig<T, kHeadDim, kBlockN, 8>, kVariant>(p, stream);
      default: break;
    }
    if constexpr (kHeadDim == 64) {
      if (wgmma::ws_block_n_override() == 192) return launch_fwd_sm90_ws<WsConfig<T, 64, 192>, kVariant>(p, stream);
      if (wgmma::ws_stages_override() == 4) return launch_fwd_sm90_ws<WsConfig<T, 64, 128, 0, 4>, kVariant>(p, stream);
      if (wgmma::ws_block_m_override() == 128 || wgmma::ws_serial()) {
        return launch_fwd_sm90_ws<WsConfig<T, 64>, kVariant>(p, stream);
      }
    }
  }
  return false;
}

template <int kDType, int kHeadDim, int kVariant>
bool run_fwd_sm90_ws(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  using sm90::ws::WsConfig;
  if (launch_fwd_sm90_ws_rung<T, kHeadDim, kVariant>(p, stream)) return true;
  if constexpr (kHeadDim == 64 && kVariant == kPlain) {
    // d <= 32 (config.h: narrow_fwd_applies): these tiles with Q K^T 32 deep, TMA's zeros past d;
    // P V still 64 wide. The shapes of d = 64 and its threshold.
    if (p.d <= wgmma::kNarrowDepth) {
      if (p.sq >= 2048) return launch_fwd_sm90_ws<WsConfig<T, 64, 96, 0, 2, 3, wgmma::kNarrowDepth>, kVariant>(p, stream);
      return launch_fwd_sm90_ws<WsConfig<T, 64, 128, 0, 2, 2, wgmma::kNarrowDepth>, kVariant>(p, stream);
    }
  }
  if constexpr (kHeadDim == 64 && kVariant == kPlain) {
    // 192-row tiles: three consumer warpgroups, so three warps per scheduler interleave their
    // dependent softmax chains (d = 64 is latency-bound), with 96-key steps (at 160 registers a
    // consumer holds S of 96 keys beside P and O; 128 spill). Short queries lose with them
    // (fewer, partly empty tiles), hence the threshold (OPTIMIZATION.md, "192-row tiles").
    if (p.sq >= 2048 || wgmma::ws_block_m_override() == 192) {
      return launch_fwd_sm90_ws<WsConfig<T, 64, 96, 0, 2, 3>, kVariant>(p, stream);
    }
  }
  if constexpr (kHeadDim == 96) {
    // d 65..96: the 128-wide tiles, Q K^T 96 deep.
    return launch_fwd_sm90_ws<WsConfig<T, 128, sm90::ws::ws_block_n(128), 0, 2, 2, 96>, kVariant>(p, stream);
  } else if constexpr (kHeadDim == 256 && kVariant != kPlain) {
    // d = 256 with the extended state (softcap's C and 1 / C, ALiBi's slope, a sequence's
    // offsets): the overlapped schedule's second S tile beside O's 128 accumulator registers
    // and those words spill, so the serial schedule alone (WsConfig: kSerialOnly_).
    return launch_fwd_sm90_ws<WsConfig<T, 256, 64, 0, 2, 2, 256, true>, kVariant>(p, stream);
  } else {
    return launch_fwd_sm90_ws<WsConfig<T, kHeadDim>, kVariant>(p, stream);
  }
}

// The GQA-packed tiles at the default shape of each bucket: 128 x 128 tiles, two consumer
// warpgroups (d 65..96: the 128-wide tiles, Q K^T 96 deep).
template <int kDType, int kHeadDim>
bool run_fwd_sm90_ws_gqa(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "the buckets with packed instances");
  constexpr int kWidth = kHeadDim == 96 ? 128 : kHeadDim;
  return launch_fwd_sm90_ws_gqa<sm90::ws::WsConfig<T, kWidth, sm90::ws::ws_block_n(kWidth), 0, 2, 2, kHeadDim>>(
      p, stream);
}

// The dropout instances: 128-row tiles, two consumer warpgroups; at d 64 the default 128-key
// steps, on the 128-wide tiles (d 65..128; 65..96 with Q K^T 96 deep) 96-key steps: with 128 the
// draws' registers beside S, P and O spill 44-56 bytes, with 96 nothing.
template <int kDType, int kHeadDim>
bool run_fwd_sm90_ws_dropout(const FwdParams& p, cudaStream_t stream) {
  using T = typename ElementOf<kDType>::type;
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "the buckets with dropout instances");
  constexpr int kWidth = kHeadDim == 96 ? 128 : kHeadDim;
  constexpr int kBlockN = kWidth == 128 ? 96 : sm90::ws::ws_block_n(kWidth);
  return launch_fwd_sm90_ws_dropout<sm90::ws::WsConfig<T, kWidth, kBlockN, 0, 2, 2, kHeadDim>>(p, stream);
}

}  // namespace flash_cuda
