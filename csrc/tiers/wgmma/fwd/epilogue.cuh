// tiers/wgmma/fwd/epilogue.cuh — the warp-specialized forward's output: O leaves the way Q came
// in, each consumer warp staging its normalized rows in the O tile and one of its lanes storing
// them with TMA (store_o_tma); lse beside it (core/epilogue.cuh: normalize_output).
#pragma once

#include "../../../arch/sm90.cuh"
#include "../../../arch/tile.cuh"
#include "../../../arch/tma.h"
#include "config.cuh"

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

}  // namespace ws
}  // namespace sm90
}  // namespace flash_cuda
