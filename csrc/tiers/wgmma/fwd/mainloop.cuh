// tiers/wgmma/fwd/mainloop.cuh — the warp-specialized forward's main loop: the producer, which
// fills the TMA ring (K/V stages guarded by mbarriers) and Q, and the consumer step, S = Q K^T,
// the online softmax and O += P V, in two schedules. The tiles and barriers they share are
// smem.h's.
//
// Two consumer schedules (WsSchedule):
//   kSerial:  per key block, S = Q K^T, softmax, O += P V, each product waited for at once.
//   kOverlap: FlashAttention-3's intra-warpgroup overlap plus inter-warpgroup ping-pong. Each
//             step issues S(j) = Q K(j)^T and O += P(j-1) V(j-1), then waits for S(j) alone and
//             runs its mask, max and exponentials while P V is still on the tensor cores. Named
//             barriers order the two warpgroups' product groups (one issues while the other
//             runs its softmax), so the tensor cores always have a group queued; below d = 256
//             only (tile_policy.h: fwd_turn_barriers).
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
#pragma once

#include <cstdint>
#include <type_traits>

#include "../../../arch/sm90.cuh"
#include "../../../arch/tile.cuh"
#include "../../../arch/tma.h"
#include "../../../core/block.cuh"
#include "../../../core/dropout.cuh"
#include "../../../core/softmax.cuh"
#include "config.cuh"

namespace flash_cuda {
namespace sm90 {
namespace ws {

// The ring of one CTA: where stage s of K and V lives, and its barriers.
template <typename Cfg>
struct Ring {
  using T = typename Cfg::T;
  T* sK;
  T* sV;
  uint64_t* k_full;
  uint64_t* v_full;
  uint64_t* k_empty;
  uint64_t* v_empty;
  uint64_t* v_tail;  // the producer's: a partial V block lands here first (load_v_zero_tail)
  // Points the ring at a CTA's shared storage (Cfg::SharedStorage). (Assigned member by member:
  // the kernels then compile as they did with the assignments written out at each use.)
  template <typename Storage>
  __device__ __forceinline__ void point_at(Storage& smem) {
    sK = smem.tiles.k[0];
    sV = smem.tiles.v[0];
    k_full = smem.sync.k_full;
    v_full = smem.sync.v_full;
    k_empty = smem.sync.k_empty;
    v_empty = smem.sync.v_empty;
    v_tail = &smem.sync.v_tail;
  }
  __device__ __forceinline__ const T* k(int s) const { return sK + s * Cfg::KSlabs::kElems; }
  __device__ __forceinline__ const T* v(int s) const { return sV + s * Cfg::VSlabs::kElems; }
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

// The producer warp walks its tile loop together, so that all of it can zero the rows past a
// packed sequence's end (load_v_zero_tail); lane 0 alone issues the loads and the arrivals.
__device__ __forceinline__ bool issuing_lane() { return threadIdx.x % 32 == 0; }

// Where a tile's boxes start in the tensor maps: its first query row, the first row of its
// sequence's keys, the heads and the batch coordinate. A dense map has a batch dimension and
// rows per sequence; a packed map runs over every row (batch extent 1), where a sequence
// starts at its q_start / k_start. seq: the sequence (batch entry) itself, by which the FP8
// forward's V^T has its slots, packed batch or not (core/fp8_v_layout.cuh).
struct TileCoords {
  int q_row, k_row, h, h_kv, b, seq;
};

// Loads K or V of key block nb into ring position i, as soon as the consumers freed its stage:
// one box per slab of the tile's layout (Slabs: Cfg::KSlabs or Cfg::VSlabs, whose map has boxes
// of Slabs::kCols columns).
template <typename Cfg, typename Slabs>
__device__ __forceinline__ void load_kv(const CUtensorMap* map, typename Cfg::T* tiles, uint64_t* full,
                                        uint64_t* empty, const Ring<Cfg>& ring, int i, int nb, const TileCoords& at) {
  const int s = ring.stage(i);
  mbarrier_wait(&empty[s], ring.parity(i) ^ 1);  // the first pass finds every stage free
  if (!issuing_lane()) return;
  mbarrier_arrive_expect_tx(&full[s], Slabs::kBytes);
#pragma unroll
  for (int c = 0; c < Slabs::kSlabs; ++c) {
    tma_load_4d(tiles + s * Slabs::kElems + c * Slabs::kSlabElems, map, &full[s], c * Slabs::kCols,
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
  using V = typename Cfg::VSlabs;
  const int s = ring.stage(i);
  typename Cfg::T* tile = ring.sV + s * V::kElems;
  mbarrier_wait(&ring.v_empty[s], ring.parity(i) ^ 1);
  if (issuing_lane()) {
    mbarrier_arrive_expect_tx(ring.v_tail, V::kBytes);
#pragma unroll
    for (int c = 0; c < V::kSlabs; ++c) {
      tma_load_4d(tile + c * V::kSlabElems, map, ring.v_tail, c * V::kCols, at.k_row + nb * Cfg::kBlockN, at.h_kv,
                  at.b);
    }
  }
  mbarrier_wait(ring.v_tail, tail_phase);
  tail_phase ^= 1;
  zero_rows<Cfg::kBlockN, V::kSlabs, V::kLineBytes>(tile, rows, static_cast<int>(threadIdx.x % 32));
  fence_proxy_async();
  __syncwarp();
  if (issuing_lane()) mbarrier_arrive(&ring.v_full[s]);
}

// V^T of key block nb (the FP8 forward: config.cuh, core/fp8_v_layout.cuh) into ring position i:
// one box per 128 keys, all kVWidth head dims of the step, from V^T's map (dimensions: keys,
// head dims, KV heads, batch). Keys past the sequence are zeros there (the layout's own up to a
// multiple of 32, TMA's past the tensor), so no block needs load_v_zero_tail.
template <typename Cfg>
__device__ __forceinline__ void load_vt(const CUtensorMap* map, const Ring<Cfg>& ring, int i, int nb,
                                        const TileCoords& at) {
  using V = typename Cfg::VSlabs;
  const int s = ring.stage(i);
  mbarrier_wait(&ring.v_empty[s], ring.parity(i) ^ 1);
  if (!issuing_lane()) return;
  mbarrier_arrive_expect_tx(&ring.v_full[s], V::kBytes);
#pragma unroll
  for (int c = 0; c < V::kSlabs; ++c) {
    tma_load_4d(ring.sV + s * V::kElems + c * V::kSlabElems, map, &ring.v_full[s], nb * Cfg::kBlockN + c * V::kCols,
                0, at.h_kv, at.seq);
  }
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
  using KSlabs = typename Cfg::KSlabs;
  if (loads) load_kv<Cfg, KSlabs>(&maps.k, ring.sK, ring.k_full, ring.k_empty, ring, first, range.begin, at);
  mbarrier_wait(qt.empty, (k & 1) ^ 1);
  if (issuing_lane()) {
    // Published by the arrival below (release), read after its wait (acquire). Atomic accesses:
    // the ordering is the mbarrier's, which compute-sanitizer's racecheck does not model.
    atomicExch(&qt.slot[k & 1], t);
    if (loads) {
      mbarrier_arrive_expect_tx(qt.full, Cfg::kTileQ);
#pragma unroll
      for (int c = 0; c < Cfg::kSlabs; ++c) {
        constexpr int kCols = Cfg::kQSlabCols;
        if constexpr (kPackGqa) {
          tma_load_4d(sQ + c * Cfg::kBlockM * kCols, &maps.q, qt.full, c * kCols, at.h, at.q_row, at.b);
        } else {
          tma_load_4d(sQ + c * Cfg::kBlockM * kCols, &maps.q, qt.full, c * kCols, at.q_row, at.h, at.b);
        }
      }
    } else {
      mbarrier_arrive(qt.full);
    }
  }
  if (!loads) return;
  for (int nb = range.begin, i = first; nb < range.end; ++nb, ++i) {
    if (nb > range.begin) load_kv<Cfg, KSlabs>(&maps.k, ring.sK, ring.k_full, ring.k_empty, ring, i, nb, at);
    if constexpr (Cfg::kFp8) {
      load_vt<Cfg>(&maps.v, ring, i, nb, at);
    } else if (nb == range.end - 1 && last_rows < Cfg::kBlockN) {
      load_v_zero_tail<Cfg>(&maps.v, ring, tail_phase, i, nb, at, last_rows);
    } else {
      load_kv<Cfg, typename Cfg::VSlabs>(&maps.v, ring.sV, ring.v_full, ring.v_empty, ring, i, nb, at);
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
  constexpr int kLine = Cfg::KSlabs::kLineBytes;  // (Q's slabs are K's: 128-byte lines but e4m3 at d = 64)
  wgmma_ss<Cfg::kQKSteps, false, typename Cfg::T>(sc[0], KMajorIn<Cfg::kBlockM, kLine>{sQ, wg_row0},
                                                  KMajorIn<Cfg::kBlockN, kLine>{sK, 0});
  wgmma_commit();
}

// Issues O += P V with P already in A fragments (one commit group): per k-step one wgmma of
// N = kVWidth, V read MN-major from its slabs (at d = 96 one m64n96k16 over the three 64-byte-
// swizzled 32-column slabs, whose LBO steps N from slab to slab: arch/sm90.cuh); e4m3: V^T read
// K-major from its 128-, 64- or 32-byte lines, 32 keys per k-step.
template <typename Cfg>
__device__ __forceinline__ void issue_weighted_v(float (&acc_o)[1][Cfg::kDTiles][4],
                                                 const uint32_t (&pa)[Cfg::kPSteps][4],
                                                 const typename Cfg::T* sV) {
  wgmma_fence();
  if constexpr (Cfg::kFp8) {
    wgmma_rs<typename Cfg::T>(acc_o[0], pa, KMajorIn<Cfg::kVWidth, Cfg::VSlabs::kLineBytes>{sV, 0});
  } else if constexpr (Cfg::VSlabs::kCols == kSlabCols) {
    wgmma_rs<typename Cfg::T>(acc_o[0], pa, MNMajor<Cfg::kBlockN>{sV, 0});
  } else {
    wgmma_rs<typename Cfg::T>(acc_o[0], pa, MNMajor64B<Cfg::kBlockN>{sV});
  }
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
  if constexpr (Cfg::kFp8) {
    // The reference max m - kFp8POffset (config.cuh: kFp8): the statistics then hold it, and P,
    // l and lse follow from it unchanged (-inf stays -inf).
    block_max[0][0] -= kFp8POffset;
    block_max[0][1] -= kFp8POffset;
  }
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
template <int kLag>
__device__ __forceinline__ void merge_block_stats(RowStats<1>& stats, const float (&block_max)[1][2],
                                                  Rescale& rescale) {
  rescale.pending = update_row_stats<kLag>(stats, block_max, rescale.alpha);
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
__device__ __forceinline__ void to_a_fragments(uint32_t (&pa)[Cfg::kPSteps][4],
                                               const float (&sc)[1][Cfg::kNTiles][4]) {
  if constexpr (Cfg::kFp8) {
    accumulator_to_a_e4m3(pa, sc[0]);  // V^T's keys in the same order (core/fragment.cuh: e4m3_pv_key)
  } else {
    accumulator_to_a<typename Cfg::T>(pa, sc[0]);
  }
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
  // P rounded to 16 bits (e4m3), all of it before the first wgmma: registers an in-flight wgmma
  // reads must not be written in between.
  uint32_t pa[Cfg::kPSteps][4];
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
    if (!Cfg::kStageOInQ && nb == cv.range.end - 1) qt.release();  // the tile's last product that reads Q is done
    merge_block_stats<Cfg::kLag>(stats, block_max, acc_o);
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
// every tile in the same state). kOn false (Cfg::kTurnBarriers, at d = 256): no barriers, each
// warpgroup issues as soon as its operands are ready.
template <int kWGs, bool kOn = true>
struct Turns {
  int wg;
  __device__ __forceinline__ void open() const {
    if (kOn && wg == kWGs - 1) named_barrier_arrive(kTurnBarrier + 0, kTurnThreads);
  }
  __device__ __forceinline__ void take() const {
    if (kOn) named_barrier_sync(kTurnBarrier + wg, kTurnThreads);
  }
  __device__ __forceinline__ void pass(bool last) const {
    if (kOn && !(last && wg == kWGs - 1)) named_barrier_arrive(kTurnBarrier + (wg + 1) % kWGs, kTurnThreads);
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
  const Turns<Cfg::kConsumerWGs, Cfg::kTurnBarriers> turns{cv.wg};
  turns.open();
  float sc[1][Cfg::kNTiles][4];
  uint32_t pa[Cfg::kPSteps][4];
  float block_max[1][2];
  Rescale rescale;

  // Block 0: S alone, then its softmax (O is still zero: nothing to rescale).
  mbarrier_wait(&ring.k_full[ring.stage(first)], ring.parity(first));
  turns.take();
  issue_qk<Cfg>(sc, sQ, cv.wg_row0, ring.k(ring.stage(first)));
  turns.pass(false);
  compute_qk_scores_and_max<Cfg, 0>(sc, block_max, cv, cv.range.begin);
  ring.release_k(ring.stage(first));
  if (!Cfg::kStageOInQ && n == 1) qt.release();  // the tile's last product that reads Q is done
  merge_block_stats<Cfg::kLag>(stats, block_max, rescale);
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
    if (!Cfg::kStageOInQ && i == n - 1) qt.release();
    merge_block_stats<Cfg::kLag>(stats, block_max, rescale);
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

}  // namespace ws
}  // namespace sm90
}  // namespace flash_cuda
