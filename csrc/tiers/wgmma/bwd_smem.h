// tiers/wgmma/bwd_smem.h — the shared-memory layout of the warp-specialized Hopper backwards
// (bwd_ws.cuh, bwd_wide.cuh: one layout, with a part of each kernel's own; bwd.cuh's two kernels
// use core/bwd_smem.h's). A launcher requests sizeof (arch/sm90.cuh: smem_request_bytes), the
// kernel reads the members from the aligned base: no byte sums, no pointer carving.
//
// Every 16-bit tile is a run of 64-column slabs that wgmma and TMA address with the 128-byte
// swizzle (arch/sm90.cuh), so each starts on a 1024-byte boundary: the tiles come first, from
// the aligned base, each a whole number of KiB (asserted below). They are not declared
// alignas(1024): sizeof would then round up to whole KiB past the barrier words that end the
// warp-specialized layout, and the launch would ask for up to 1 KiB the kernel never uses.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../arch/tile.cuh"

namespace flash_cuda {
namespace sm90 {

// The warp-specialized kernels (bwd_ws.cuh, bwd_wide.cuh): the CTA's keys, the producer's ring
// of kStages query blocks, the kernel's own tiles (Exchange: WsExchange, WideExchange), the ring's
// lse and delta, and the mbarriers. The words are the same in both kernels; bwd_wide.cuh leaves
// dq_full and dq_empty unused.
template <typename T, int kD, int kBlockN, int kBlockM, int kStages, typename Exchange>
struct WsStorage {
  T k[kBlockN * kD];
  T v[kBlockN * kD];
  T q[kStages][kBlockM * kD];
  T dout[kStages][kBlockM * kD];
  Exchange exchange;
  float lse[kStages][kBlockM];    // in log2 units (core/softmax.cuh: lse_to_log2), as bwd_ws::produce stages it
  float delta[kStages][kBlockM];  // right after lse: the producer stores a row's pair at one address
  uint64_t kv_full;               // K, V (bytes) and the producer's 32 lanes (load_pair)
  uint64_t q_full[kStages];       // Q, dO (bytes) and the producer's 32 lanes, which wrote lse, delta
  uint64_t q_empty[kStages];      // one arrival per consumer thread
  uint64_t dq_full[2];   // bwd_ws: one arrival per consumer warp: exchange.dq[b] holds a block's dQ
  uint64_t dq_empty[2];  // bwd_ws: the writer's arrival: the bulk reduction has read exchange.dq[b]
  // bwd_ws with one dS^T buffer: one arrival per consumer thread: its dQ product has read it;
  // bwd_wide: the exchange barrier.
  uint64_t ds_empty;
  uint64_t tail;  // the producer's own: a packed block's tiles landed (bytes), before it zeroes rows
  union {
    // bwd_ws: where the block staged in exchange.dq[b] goes, published with dq_full[b]: its tile
    // of dq_accum (nullptr: no more blocks).
    float* dq_dst[2];
    int dq_tile[4];  // bwd_wide: per stage, the dq_accum tile of the block it holds
  };
  static_assert(sizeof(k) % kSwizzleAlign == 0 && sizeof(q[0]) % kSwizzleAlign == 0 &&
                    sizeof(Exchange) % kSwizzleAlign == 0,
                "slabs stay aligned");
};

// bwd_ws.cuh's own tiles: dS^T [kBlockN keys][kBlockM queries] (one or two buffers) and the
// dQ staging buffers (kBlockM x kD floats each, in the order of DqTile; two, or one for the
// 80-query steps).
template <typename T, int kD, int kBlockN, int kBlockM, int kDsBuffers, int kDqBuffers = 2>
struct WsExchange {
  T ds[kDsBuffers][kBlockN * kBlockM];
  float dq[kDqBuffers][kBlockM * kD];
  static_assert(sizeof(ds[0]) % kSwizzleAlign == 0, "slabs stay aligned");
};

// bwd_wide.cuh's own tiles: two exchange buffers, each P^T then dS^T [kBlockN keys][kBlockM
// queries] (one swizzled slab each at 64 queries).
template <typename T, int kBlockN, int kBlockM>
struct WideExchange {
  T ds[2][2 * kBlockN * kBlockM];
  static_assert(kBlockN * kBlockM * sizeof(T) % kSwizzleAlign == 0, "slabs stay aligned");
};

}  // namespace sm90
}  // namespace flash_cuda
