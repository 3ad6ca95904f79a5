// core/kv_gather.cuh — a KV cache's keys laid out for the query-tiled forwards: the prefill
// route of fwd_kvcache (a prompt chunk of more than decode::kMaxDecodeQueries queries against a
// paged cache, or with the cached lengths in a device tensor).
//
// The split-KV decode kernels stream every key of a sequence once per 64 packed query rows: the
// right plan for a few rows, but a 2k-token chunk would re-read its keys dozens of times. The
// query-tiled forwards (Hopper's, mma.sync's) read them once per query tile at tensor-core speed
// from a dense [b][hkv][sk][d] K / V with each sequence's key count in FwdParams::seqused_k. One
// launch here makes that input (KvGatherTarget, include/params.h), with nothing read back to the
// host, so the route is CUDA-graph capturable:
//   - the new rows k_new / v_new are appended to the cache in place (positions len_b ..);
//   - key_counts[b] = len_b + s_new, the forward's seqused_k;
//   - a paged cache's keys 0 .. len_b + s_new - 1 are copied into the dense target (the new ones
//     straight from k_new / v_new), and the rows after them up to the next multiple of kZeroRows
//     are zeroed: the forwards read whole key blocks, and a stale value there (a NaN or an Inf)
//     would survive its zero probability (0 * Inf). A dense cache is read in place: there the
//     forwards zero a partial last block themselves (TMA's producer, cp.async's zero fill).
// Lengths and page ids are clamped as the decode kernels clamp them (core/seqlen.cuh: CacheSeq,
// cache_row): wrong values give wrong results, never an access outside the tensors.
#pragma once

#include <cstdint>

#include "../arch/host.h"
#include "../include/dispatch.h"
#include "../include/params.h"
#include "seqlen.cuh"

namespace flash_cuda {

constexpr int kGatherRows = 32;  // rows of one (sequence, KV head) per CTA
constexpr int kGatherThreads = 128;
constexpr int kZeroRows = 256;  // at least every forward's widest key block

#if defined(__CUDACC__)

// grid (ceil(sk / kGatherRows), hkv, b): CTA x covers rows [x * kGatherRows, ..) of its
// (sequence, KV head), of which it moves those that are keys (a copy) or new rows (in place).
template <typename T>
__global__ void __launch_bounds__(kGatherThreads) kv_gather_kernel(const FwdParams p, const KvGatherTarget g) {
  const int bi = blockIdx.z, h = blockIdx.y;
  const CacheSeq seq = CacheSeq::make(p, bi);
  if (blockIdx.x == 0 && h == 0 && threadIdx.x == 0) g.key_counts[bi] = seq.total;
  const bool copy = g.k != nullptr;
  const int begin = copy ? 0 : seq.len;
  const int end = copy ? min(p.sk, (seq.total + kZeroRows - 1) / kZeroRows * kZeroRows) : seq.total;
  const int row0 = max(begin, static_cast<int>(blockIdx.x) * kGatherRows);
  const int row1 = min(end, static_cast<int>(blockIdx.x + 1) * kGatherRows);
  if (row0 >= row1) return;
  T* const k = static_cast<T*>(const_cast<void*>(p.k));
  T* const v = static_cast<T*>(const_cast<void*>(p.v));
  const T* const k_new = static_cast<const T*>(p.k_new);
  const T* const v_new = static_cast<const T*>(p.v_new);
  const int64_t off = bi * g.batch_stride + h * g.head_stride;
  T* const kd = copy ? static_cast<T*>(g.k) + off : nullptr;
  T* const vd = copy ? static_cast<T*>(g.v) + off : nullptr;
  constexpr int kWord = 16 / sizeof(T);
  // Every load of a thread is issued before its first store (kItems words of K and of V in
  // flight): a CTA moves only kGatherRows rows, so the copy is bound by the loads' latency.
  constexpr int kItems = kGatherRows * (256 / kWord) / kGatherThreads;
  const int words = p.d / kWord;
  const int items = (row1 - row0) * words;
  uint4 xk[kItems], xv[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int e = static_cast<int>(threadIdx.x) + j * kGatherThreads;
    const int r = row0 + e / words, c = (e % words) * kWord;
    xk[j] = xv[j] = make_uint4(0u, 0u, 0u, 0u);
    if (e >= items) continue;
    if (r < seq.len) {
      xk[j] = *reinterpret_cast<const uint4*>(
          cache_row(p, k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, bi, h, r) + c);
      xv[j] = *reinterpret_cast<const uint4*>(
          cache_row(p, v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, bi, h, r) + c);
    } else if (r < seq.total) {  // a new row: copied from k_new / v_new, and appended below
      const int64_t n = r - seq.len;
      xk[j] = *reinterpret_cast<const uint4*>(k_new + bi * p.knew_batch_stride + h * p.knew_head_stride +
                                              n * p.knew_row_stride + c);
      xv[j] = *reinterpret_cast<const uint4*>(v_new + bi * p.vnew_batch_stride + h * p.vnew_head_stride +
                                              n * p.vnew_row_stride + c);
    }
  }
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int e = static_cast<int>(threadIdx.x) + j * kGatherThreads;
    const int r = row0 + e / words, c = (e % words) * kWord;
    if (e >= items) continue;
    if (r >= seq.len && r < seq.total) {
      *reinterpret_cast<uint4*>(cache_row(p, k, p.k_batch_stride, p.k_head_stride, p.k_row_stride, bi, h, r) + c) =
          xk[j];
      *reinterpret_cast<uint4*>(cache_row(p, v, p.v_batch_stride, p.v_head_stride, p.v_row_stride, bi, h, r) + c) =
          xv[j];
    }
    if (copy) {
      *reinterpret_cast<uint4*>(kd + static_cast<int64_t>(r) * g.row_stride + c) = xk[j];
      *reinterpret_cast<uint4*>(vd + static_cast<int64_t>(r) * g.row_stride + c) = xv[j];
    }
  }
}

// kBytes: the element size of the cache (2: fp16 / bf16; the rows move as 16-byte words).
template <int kBytes>
void run_kv_gather(const FwdParams& p, const KvGatherTarget& g, cudaStream_t stream) {
  static_assert(kBytes == 2, "KV caches hold 16-bit elements");
  const dim3 grid((p.sk + kGatherRows - 1) / kGatherRows, p.hkv, p.b);
  kv_gather_kernel<uint16_t><<<grid, kGatherThreads, 0, stream>>>(p, g);
  check_launch("flash_kv_gather");
}

#endif  // __CUDACC__

}  // namespace flash_cuda
