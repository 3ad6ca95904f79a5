// tiers/wgmma/fwd/smem.h — the warp-specialized forward's shared memory, as one struct.
//
// Q (kBlockM x kHeadDim) | K[kStages] | V[kStages] (kBlockN x kVWidth) | O staging | mbarriers |
// tile slots. Q, K and O are in the 128-byte-swizzled slab layout of arch/sm90.cuh, which is what
// TMA's 128-byte swizzle writes (and reads) for a box of 64 columns (one slab) when the slab
// starts on a 1024-byte boundary; V too, except at d = 96, where it is three 32-column slabs of
// the 64-byte-swizzled layout (config.cuh: VSlabs). Every tile is alignas(1024) and a whole
// number of slabs (each a multiple of 1024 bytes), so no padding falls between them. Nothing
// aliases: O is staged in its own tile, so that a persistent CTA's producer may already fill the
// ring with the next tile's K/V while the consumers write this tile's O. Where that tile does not
// fit (d = 256: WsConfig::kStageO), O is staged in Q's tile (kStageOInQ: the consumers then hold
// Q until their stores have read it), or, with that switched off, each consumer thread stores its
// own pairs.
//
// Barriers (mainloop.cuh): q_full / q_empty (Q of the current tile), and per stage k_full,
// v_full (producer arrival + transaction bytes: V may still be landing while S = Q K^T runs),
// k_empty, v_empty (one arrival per consumer warp; K is freed as soon as S is done); v_tail, the
// producer's own, on which a packed sequence's partial last V block lands. Then the two slots
// through which the producer names the consumers' next tile (QueryTile).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace flash_cuda {
namespace sm90 {
namespace ws {

// 1024 bytes: the swizzle pattern's period (8 lines of 128 bytes).
constexpr size_t kSwizzleAlign = 1024;

template <typename T, int kBlockM, int kBlockN, int kHeadDim, int kVWidth, int kStages>
struct FwdRingTiles {
  alignas(kSwizzleAlign) T q[kBlockM * kHeadDim];
  alignas(kSwizzleAlign) T k[kStages][kBlockN * kHeadDim];
  alignas(kSwizzleAlign) T v[kStages][kBlockN * kVWidth];
};
// The O staging tile after the ring: Q's slab layout (no padding: the swizzle keeps the fragment
// writes conflict-free), which is what a TMA store of 64-column boxes reads. At d = 96 only its
// first kVWidth columns are written: a TMA store leaves out the box's columns past d, and the
// lanes' copy reads none past kVWidth, so whatever the rest holds never reaches memory.
// Out: O's type (T's but for e4m3 inputs).
template <typename T, int kBlockM, int kBlockN, int kHeadDim, int kVWidth, int kStages, typename Out = T>
struct FwdRingAndOTiles : FwdRingTiles<T, kBlockM, kBlockN, kHeadDim, kVWidth, kStages> {
  alignas(kSwizzleAlign) Out o[kBlockM * kHeadDim];
};

template <int kStages>
struct FwdSync {
  uint64_t q_full, q_empty;
  uint64_t k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
  uint64_t v_tail;
  int tile_slot[2];
};

template <typename T, int kBlockM, int kBlockN, int kHeadDim, int kVWidth, int kStages, bool kStageO,
          bool kStageOInQ = false, typename Out = T>
struct FwdSharedStorage {
  static_assert(!(kStageO && kStageOInQ), "one staging tile");
  static_assert(!kStageOInQ || std::is_same<Out, T>::value, "O staged in Q's tile has Q's type");
  using Tiles = std::conditional_t<kStageO, FwdRingAndOTiles<T, kBlockM, kBlockN, kHeadDim, kVWidth, kStages, Out>,
                                   FwdRingTiles<T, kBlockM, kBlockN, kHeadDim, kVWidth, kStages>>;
  using Sync = FwdSync<kStages>;
  Tiles tiles;
  Sync sync;
  // The bytes the CTA uses: sizeof(FwdSharedStorage) would round up to the tiles' alignment.
  static constexpr size_t kBytes = sizeof(Tiles) + sizeof(Sync);
  static_assert(sizeof(Tiles) % kSwizzleAlign == 0, "the words follow the last slab without padding");
  // The O staging tile: its own, or Q's (kStageOInQ); none (nullptr, never written) otherwise.
  __device__ __forceinline__ Out* o_staging() {
    if constexpr (kStageO) {
      return tiles.o;
    } else if constexpr (kStageOInQ) {
      return tiles.q;
    } else {
      return nullptr;
    }
  }
};

}  // namespace ws
}  // namespace sm90
}  // namespace flash_cuda
