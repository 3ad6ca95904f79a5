// core/bwd_smem.h — the shared memory of the two-kernel backward (tiers/mma/bwd.cuh and
// tiers/wgmma/bwd.cuh), one struct per kernel, in tiles of kRow 16-bit elements per row: the
// head dim (wgmma's swizzled slabs, arch/tile.cuh: SwizzledTile) or a padded pitch (mma.sync's
// PaddedTile). A launcher requests sizeof (the wgmma tier adds its base alignment: arch/sm90.cuh,
// smem_request_bytes); a kernel takes its pointers from the members (core/tile_io.cuh copies
// into them).
#pragma once

namespace flash_cuda {

// The dK/dV kernel: the CTA's keys (kv: K, then V; kKeyTiles = 1 leaves V out, the mma.sync
// backward's dV-only pass), then two stages of the query blocks it walks (Q, dO, and their
// rows' lse, delta).
template <typename T, int kRow, int kBlockN, int kBlockM, int kKeyTiles = 2>
struct DkdvStorage {
  T kv[kKeyTiles][kBlockN * kRow];
  T q[2][kBlockM * kRow];
  T dout[2][kBlockM * kRow];
  float lse[2][kBlockM];
  float delta[2][kBlockM];
};

// The dQ kernel: the CTA's queries (Q, dO; their lse, delta after the tiles) and two stages of
// the key blocks it walks.
template <typename T, int kRow, int kBlockM, int kBlockN>
struct DqStorage {
  T q[kBlockM * kRow];
  T dout[kBlockM * kRow];
  T k[2][kBlockN * kRow];
  T v[2][kBlockN * kRow];
  float lse[kBlockM];
  float delta[kBlockM];
};

}  // namespace flash_cuda
