// tiers/wgmma/fwd/kernel.cuh — the Hopper forward, warp-specialized (FlashAttention-3's recipe): TMA
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
// and O (64 x kVWidth: the tile's width, 96 at d = 96) live in its registers; wgmma's accumulator has the C fragment layout per
// warp (core/fragment.cuh), so the online softmax of core/softmax.cuh runs on it unchanged. The
// consumer loop is its four steps, split where the pipeline needs it:
//   compute_qk_scores_and_max -> merge_block_stats -> compute_block_softmax(_and_weighted_v)
//   ... normalize_output.
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
// The parts: mainloop.cuh (producer and consumer step), epilogue.cuh (O and lse out), launch.cuh
// (maps, grid, entry points); this file assigns the warps their roles and walks the tiles.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../../arch/sm90.cuh"
#include "../../../arch/tile.cuh"
#include "../../../core/block.cuh"
#include "../../../core/dropout.cuh"
#include "../../../core/epilogue.cuh"
#include "../../../core/scheduler.cuh"
#include "../../../core/softmax.cuh"
#include "config.cuh"
#include "epilogue.cuh"
#include "mainloop.cuh"

namespace flash_cuda {
namespace sm90 {
namespace ws {

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
  auto& smem = *reinterpret_cast<typename Cfg::SharedStorage*>(aligned_smem_base<Cfg::kSharedBase>(smem_raw));
  T* sQ = smem.tiles.q;
  typename Cfg::Out* sO = smem.o_staging();
  QueryTile qt{&smem.sync.q_full, &smem.sync.q_empty, smem.sync.tile_slot};
  Ring<Cfg> ring;
  ring.point_at(smem);

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
                              packed ? 0 : tile.b, tile.b};
          // Rows of the last block that are the sequence's, where its box would read on into
          // rows that are not its keys: another sequence's, or those past its seqused_k (rows
          // past the tensor's end TMA fills with zeros itself).
          const int last_key = w.range.end * Cfg::kBlockN;
          const int rows_after = packed ? p.total_k - w.seq.k_start : p.sk;  // the tensor's, from its first key
          const int last_rows = kExt && last_key > w.seq.sk && w.seq.sk < rows_after
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
  const int cwarp_all = warp - 4;
  for (int k = 0, first = 0;; ++k) {
    // kLeanTileLoop: an opaque copy of the base (the compiler cannot see through it) and of the
    // thread index, made in the loop, so that every pointer and size derived from them is
    // computed per tile from values that cost no register across the tiles.
    unsigned char* raw_t = smem_raw;
    uint32_t tid_t = threadIdx.x;
    TileScheduler sched_t = sched;
    if constexpr (Cfg::kLeanTileLoop) {
      opaque(raw_t);
      tid_t = thread_index_opaque();
      sched_t = TileScheduler::of<Cfg::kBlockM, kPackGqa>(p, shift);
      opaque(sched_t.m_blocks);
      opaque(sched_t.heads);
      opaque(sched_t.section);
    }
    auto& smem_t = *reinterpret_cast<typename Cfg::SharedStorage*>(aligned_smem_base<Cfg::kSharedBase>(raw_t));
    const QueryTile qt_t =
        Cfg::kLeanTileLoop ? QueryTile{&smem_t.sync.q_full, &smem_t.sync.q_empty, smem_t.sync.tile_slot} : qt;
    Ring<Cfg> ring_t = ring;
    T* const sQ_t = Cfg::kLeanTileLoop ? smem_t.tiles.q : sQ;
    typename Cfg::Out* const sO_t = Cfg::kLeanTileLoop ? smem_t.o_staging() : sO;
    if constexpr (Cfg::kLeanTileLoop) ring_t.point_at(smem_t);
    const int cwarp = Cfg::kLeanTileLoop ? int(tid_t / 32) - 4 : cwarp_all;
    mbarrier_wait(qt_t.full, k & 1);
    // Every thread reads the same t; lane 0's, broadcast, lets ptxas see it as warp-uniform, so
    // the ring positions and the wgmma descriptors derived from it live in uniform registers
    // instead of being rebuilt in ordinary ones and moved (R2UR) for every wgmma.
    const int t = warp_uniform(atomicAdd(&qt_t.slot[k & 1], 0));
    if (t < 0) break;
    const TileScheduler::Tile tile = sched_t.at(t);
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
    if constexpr (Cfg::kFp8) {
      // e4m3 inputs: the scores' factor times fp32(q_descale k_descale) of the tile's (batch, KV
      // head) (flash_cuda/reference.py: attention_fp8_forward_blocked); the modifiers (kExt:
      // softcap) then act on the dequantized logits, as they take this factor first.
      static_assert(!kPackGqa && !kDrop, "the FP8 forward: one head per tile, no dropout");
      const int bkv = tile.b * p.hkv + int(unsigned(tile.h) / (unsigned(p.hq) / unsigned(p.hkv)));
      cv.scale_log2 = p.scale_log2 * (p.q_descale[bkv] * p.k_descale[bkv]);
    }
    cv.exp_scale = cv.mod.exp_scale(cv.scale_log2);

    float acc_o[1][Cfg::kDTiles][4];
    RowStats<1> stats;
    start_online_softmax(acc_o, stats);

    // The consume functions release Q after the tile's last S = Q K^T, so that the next
    // tile's Q loads under the last P V and this epilogue; a tile without keys (for which the
    // producer loaded no Q) releases here. Where O is staged in Q's tile (kStageOInQ), the
    // epilogue releases it once its stores have read the staged rows.
    if constexpr (kSchedule == kOverlap) {
      consume_overlap<Cfg>(ring_t, first, sQ_t, qt_t, cv, acc_o, stats);
    } else {
      consume_serial<Cfg>(ring_t, first, sQ_t, qt_t, cv, acc_o, stats);
    }
    const int n_blocks = cv.range.count();
    if (!Cfg::kStageOInQ && n_blocks == 0) qt_t.release();
    first += n_blocks;

    // Step 4, normalize_output, and the stores.
    if constexpr (Cfg::kLeanTileLoop) {
      // The epilogue's addresses and the tile's coordinates are derived again here rather than
      // kept in registers across the key loop. The slot still holds t: slot k % 2 is next written
      // for tile k + 2, after every consumer warp has released tile k + 1's Q, which this warp
      // does only after this epilogue.
      unsigned char* raw_o = smem_raw;
      opaque(raw_o);
      auto& smem_o = *reinterpret_cast<typename Cfg::SharedStorage*>(aligned_smem_base<Cfg::kSharedBase>(raw_o));
      const QueryTile qt_o{&smem_o.sync.q_full, &smem_o.sync.q_empty, smem_o.sync.tile_slot};
      const int t_out = atomicAdd(&qt_o.slot[k & 1], 0);
      TileScheduler sched_o = TileScheduler::of<Cfg::kBlockM, kPackGqa>(p, shift);
      opaque(sched_o.m_blocks);
      opaque(sched_o.heads);
      opaque(sched_o.section);
      const TileScheduler::Tile tile_o = sched_o.at(t_out);
      const Work w_o = Work::make(p, tile_o.b, tile_o.m_block, shift);
      const int cwarp_o = int(thread_index_opaque() / 32) - 4;
      store_tile_output<Cfg, kExt, kPackGqa>(acc_o, stats, smem_o.o_staging(), qt_o, p, maps, tile_o, w_o, cwarp_o,
                                             shift);
    } else {
      store_tile_output<Cfg, kExt, kPackGqa>(acc_o, stats, sO_t, qt_t, p, maps, tile, w, cwarp, shift);
    }
  }
  finish_output_stores<Cfg>();
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
}  // namespace flash_cuda
