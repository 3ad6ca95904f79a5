// tiers/wgmma/fwd/epilogue.cuh — the warp-specialized forward's output: O leaves the way Q came
// in, each consumer warp staging its normalized rows in the O tile and one of its lanes storing
// them with TMA (store_o_tma); lse beside it (core/epilogue.cuh: normalize_output).
#pragma once

#include "../../../arch/sm90.cuh"
#include "../../../arch/tile.cuh"
#include "../../../arch/tma.h"
#include "../../../core/epilogue.cuh"
#include "../../../core/mask.cuh"
#include "../../../core/scheduler.cuh"
#include "../../../core/softmax.cuh"
#include "config.cuh"
#include "mainloop.cuh"  // QueryTile

namespace flash_cuda {
namespace sm90 {
namespace ws {

// Moves a consumer warp's staged O rows to global memory: one TMA store per 64-column slab (box:
// 64 columns x 16 rows, at coordinates (column, row, head, batch) of map o), one bulk group,
// issued by lane 0. The TMA unit leaves out the box's rows and columns past the tensor's extent
// (a dense batch's last rows, d below the tile's width). Per warp rather than per warpgroup: the
// staged rows are the warp's own, so a __syncwarp orders every lane's writes before the issuing
// lane, and no warp waits at a named barrier for the slowest of its warpgroup. Before the rows
// are written again (the next tile's normalize_output) that lane waits until the unit has read
// them (wait_o_staging), and before the CTA retires until the stores are done.
template <typename Cfg>
__device__ __forceinline__ void store_o_tma(const CUtensorMap* map, const typename Cfg::Out* sO_warp, int row, int h,
                                            int b) {
  fence_proxy_async();  // this lane's staging writes, before the async proxy reads them
  __syncwarp();
  if (threadIdx.x % 32 != 0) return;
#pragma unroll
  for (int c = 0; c < Cfg::kOSlabs; ++c) {
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

// Step 4 of a consumer warp's tile, through this warp's own 16 rows of the O staging tile (O's
// own tile, kStageO; or at d = 256 the warp's own rows of Q, kStageOInQ, released to the producer
// at the end), or straight from registers where neither serves. Before the rows are rewritten,
// the previous tile's reads of them are done: the lanes' copies (normalize_output's __syncwarp
// and the one in wait_o_staging), the TMA unit's (wait_o_staging). Only the sequence's rows are
// stored (rows_valid): a packed tile's rows past its end hold another sequence's queries, so a
// warp whose rows cross its sequence's end copies lane by lane; a TMA store would write all 16
// rows (its map runs over every packed row). A dense batch's map ends with the sequence: the
// store leaves out the rows past it. A GQA-packed tile's rows go to their own heads and queries,
// lane by lane (O's map has one head per box). w: the tile's QueryTilePlan; cwarp: the consumer
// warp (0 .. kConsumerWarps - 1); shift: log2 G of GQA packing.
template <typename Cfg, bool kExt, bool kPackGqa, typename Work>
__device__ __forceinline__ void store_tile_output(float (&acc_o)[1][Cfg::kDTiles][4], const RowStats<1>& stats,
                                                  typename Cfg::Out* sO, const QueryTile& qt, const FwdParams& p,
                                                  const TmaMaps& maps,
                                                  const TileScheduler::Tile& tile, const Work& w, int cwarp,
                                                  int shift) {
  using T = typename Cfg::Out;
  if constexpr (Cfg::kStagedO) {
    wait_o_staging();
  } else {
    __syncwarp();
  }
  const int h = kPackGqa ? tile.h << shift : tile.h;  // the tile's (first) query head
  T* o = w.seq.q_rows(static_cast<T*>(p.o), p.o_batch_stride, p.o_head_stride, p.o_row_stride, h) +
         static_cast<int64_t>(w.q0) * p.o_row_stride;
  float* lse = p.softmax_lse + w.seq.stat_offset(p, h) + w.q0;
  const int warp_rows_valid = min(16, w.rows_valid - 16 * cwarp);
  // The sinks from the tile's first query head on (a GQA-packed row's head is its GqaOutRows::head).
  const float* sinks = p.sinks == nullptr ? nullptr : p.sinks + h;
  // e4m3 inputs: O = acc (1 / l) v_descale of the tile's (batch, KV head).
  float out_scale = 1.f;
  if constexpr (Cfg::kFp8) {
    static_assert(!kPackGqa, "the FP8 forward: one head per tile");
    out_scale = p.v_descale[tile.b * p.hkv + int(unsigned(tile.h) / (unsigned(p.hq) / unsigned(p.hkv)))];
  }
  T* sO_warp = sO + cwarp * 16 * kSlabCols;
  // A consumer warp's 16 rows of the O staging tile (whose slabs hold all kBlockM rows): row r
  // of the warp is row 16 w + r of the tile, which has the same swizzle phase (r % 8), so the
  // warp's rows are addressed as those of a kBlockM-row tile from its first row on.
  using Staging = SwizzledTile<Cfg::kBlockM>;
  if constexpr (kPackGqa) {
    normalize_output<T, Staging, Cfg::kStagedO, /*kInTileLoop=*/true>(
        acc_o, stats, sO_warp, o, p.o_row_stride, lse, warp_rows_valid, p.d, /*copy=*/true,
        GqaOutRows{16 * cwarp, shift, p.o_head_stride, p.stat_head_stride}, sinks);
  } else {
    const bool packed = kExt && p.cu_seqlens_q != nullptr;
    const bool by_tma =
        Cfg::kStagedO && maps.o_by_tma != 0 && (warp_rows_valid == 16 || (!packed && warp_rows_valid > 0));
    normalize_output<T, Staging, Cfg::kStagedO, /*kInTileLoop=*/true>(
        acc_o, stats, sO_warp, o + static_cast<int64_t>(16 * cwarp) * p.o_row_stride, p.o_row_stride,
        lse + 16 * cwarp, warp_rows_valid, p.d, /*copy=*/!by_tma, StridedRows{}, sinks, out_scale);
    if (by_tma) {
      store_o_tma<Cfg>(&maps.o, sO_warp, w.seq.q_start + w.q0 + 16 * cwarp, tile.h, packed ? 0 : tile.b);
    }
  }
  if constexpr (Cfg::kStageOInQ) {
    // The staged rows are Q's: the next tile's Q may land on them once the TMA unit (or the
    // lanes' copy) has read them and this warp's generic writes are ordered before the
    // producer's load (the async proxy).
    fence_proxy_async();
    wait_o_staging();
    qt.release();
  }
}

// The last tile's stores are done (not only their reads of shared memory) before the CTA
// retires.
template <typename Cfg>
__device__ __forceinline__ void finish_output_stores() {
  if constexpr (Cfg::kStagedO) {
    if (threadIdx.x % 32 == 0) bulk_wait<0>();
  }
}

}  // namespace ws
}  // namespace sm90
}  // namespace flash_cuda
