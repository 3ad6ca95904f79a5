// tiers/wgmma/bwd_smem.h — the shared-memory layouts of the Hopper backward kernels, one struct
// per kernel: bwd.cuh's dK/dV and dQ kernels. A launcher requests sizeof of its kernel's struct
// (arch/sm90.cuh: smem_request_bytes), the kernel reads its members from the aligned base: no
// byte sums, no pointer carving.
//
// Every 16-bit tile is a run of 64-column slabs that wgmma and TMA address with the 128-byte
// swizzle (arch/sm90.cuh), so each starts on a 1024-byte boundary: the tiles come first, from
// the aligned base, each a whole number of KiB (asserted below).
#pragma once

#include <cstddef>
#include <cstdint>

#include "../../arch/tile.cuh"

namespace flash_cuda {
namespace sm90 {

// bwd.cuh's dK/dV kernel: the CTA's keys (K, V) and two stages of the query blocks it walks
// (Q, dO and their rows' lse, delta).
template <typename T, int kD, int kBlockN, int kBlockM>
struct DkdvStorage {
  T k[kBlockN * kD];
  T v[kBlockN * kD];
  T q[2][kBlockM * kD];
  T dout[2][kBlockM * kD];
  float lse[2][kBlockM];
  float delta[2][kBlockM];
  static_assert(sizeof(k) % kSwizzleAlign == 0 && sizeof(q[0]) % kSwizzleAlign == 0, "slabs stay aligned");
};

// bwd.cuh's dQ kernel: the CTA's queries (Q, dO, lse, delta after the tiles) and two stages of
// the key blocks it walks.
template <typename T, int kD, int kBlockM, int kBlockN>
struct DqStorage {
  static_assert(kBlockM * kD * sizeof(T) % kSwizzleAlign == 0, "slabs stay aligned");
  T q[kBlockM * kD];
  T dout[kBlockM * kD];
  static_assert(kBlockN * kD * sizeof(T) % kSwizzleAlign == 0, "slabs stay aligned");
  T k[2][kBlockN * kD];
  T v[2][kBlockN * kD];
  float lse[kBlockM];
  float delta[kBlockM];
};

}  // namespace sm90
}  // namespace flash_cuda
