// core/fp8_v_layout.cuh — V of an FP8 (e4m3) forward laid out for its P V product.
//
// The e4m3 tensor-core product takes both operands K-major (arch/sm90_wgmma.cuh: no transpose for
// 8-bit types), and in O = P V the reduction runs over keys: the B operand must hold each head
// dim's keys contiguously, V^T, where V comes with each key's head dims contiguous. This launch
// writes V^T once per call, its keys in the order of P's A fragments (core/fragment.cuh:
// e4m3_pv_key, a permutation within each 32-key k-step), so that P goes from the accumulator to
// the product without moving between lanes. The rows sk .. sk_pad - 1 of a head (the last k-step's
// keys past the sequence) are written as zeros: their probabilities are 0, and 0 x NaN of a stale
// byte would not be. A packed batch (cu_seqlens) gets one slot of sk_pad keys per sequence, as if
// dense with sk its longest length: each sequence's keys from position 0, zeros after them, so a
// key block never reads another sequence's values.
//
// One CTA moves a 64-key x 64-dim block of one (batch, KV head): each thread loads 16 bytes of V
// (a row's 16 dims), the block is transposed through shared memory, and each thread stores 16
// bytes of V^T (16 key positions of one dim).
#pragma once

#include <cstdint>

#include "../arch/host.h"
#include "../include/dispatch.h"
#include "../include/params.h"
#include "fragment.cuh"

namespace flash_cuda {

constexpr int kFp8VBlock = 64;  // keys and dims of one CTA
constexpr int kFp8VThreads = 256;

#if defined(__CUDACC__)

// grid (sk_pad / kFp8VBlock rounded up, ceil(d / kFp8VBlock), b * hkv). T: the bytes.
template <typename T>
__global__ void __launch_bounds__(kFp8VThreads) fp8_v_layout_kernel(const Fp8VLayoutParams p) {
  // [key][dim], each key's row padded by 16 bytes so that the transposed reads of one warp (32
  // keys of one dim) fall into different banks more often than not.
  __shared__ T tile[kFp8VBlock][kFp8VBlock + 16];
  const int bh = blockIdx.z, bi = bh / p.hkv, h = bh % p.hkv;
  const int key0 = blockIdx.x * kFp8VBlock, dim0 = blockIdx.y * kFp8VBlock;
  int64_t first = int64_t(bi) * p.v_batch_stride;  // the sequence's first row, as an offset
  int len = p.sk;
  if (p.cu_seqlens != nullptr) {
    const int start = min(max(p.cu_seqlens[bi], 0), p.rows);
    len = min(min(p.cu_seqlens[bi + 1], p.rows) - start, p.sk);
    first = int64_t(start) * p.v_row_stride;
  }
  const T* v = static_cast<const T*>(p.v) + first + h * p.v_head_stride;
  {
    const int r = threadIdx.x / 4, c = (threadIdx.x % 4) * 16;  // 64 rows x 4 chunks of 16 bytes
    const int key = key0 + r, dim = dim0 + c;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (key < len && dim < p.d) x = *reinterpret_cast<const uint4*>(v + key * p.v_row_stride + dim);
    *reinterpret_cast<uint4*>(&tile[r][c]) = x;
  }
  __syncthreads();
  const int dd = threadIdx.x / 4, j0 = (threadIdx.x % 4) * 16;  // 64 dims x 4 chunks of 16 key positions
  const int dim = dim0 + dd;
  if (dim >= p.d || key0 + j0 >= p.sk_pad) return;
  uint32_t w[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t word = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + 4 * q + e;                     // position within the block (a multiple of 32 from key0)
      const int key = (j & ~31) + e4m3_pv_key(j & 31);  // the key at that position
      word |= uint32_t(tile[key][dd]) << (8 * e);
    }
    w[q] = word;
  }
  T* vt = static_cast<T*>(p.vt) + (int64_t(bh) * p.d + dim) * p.sk_pad + key0 + j0;
  *reinterpret_cast<uint4*>(vt) = make_uint4(w[0], w[1], w[2], w[3]);
}

#endif  // __CUDACC__

// The launch (csrc/instances/fp8_v_layout.cu instantiates it for bytes).
template <typename T>
void run_fp8_v_layout(const Fp8VLayoutParams& p, cudaStream_t stream) {
  static_assert(sizeof(T) == 1, "e4m3 bytes");
#if defined(__CUDACC__)
  if (p.b == 0 || p.hkv == 0 || p.d == 0 || p.sk_pad == 0) return;
  const dim3 grid(ceil_div(p.sk_pad, kFp8VBlock), ceil_div(p.d, kFp8VBlock), p.b * p.hkv);
  fp8_v_layout_kernel<T><<<grid, kFp8VThreads, 0, stream>>>(p);
  check_launch("fp8_v_layout");
#else
  (void)p;
  (void)stream;
#endif
}

}  // namespace flash_cuda
