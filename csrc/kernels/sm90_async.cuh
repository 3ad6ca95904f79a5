// sm90_async.cuh — the Hopper (sm_90a) instructions of a warp-specialized pipeline: the
// tensor memory accelerator (TMA, cp.async.bulk.tensor), transaction-counting mbarriers,
// setmaxnreg and named barriers, plus the host side of TMA (tensor maps).
//
// The pattern they serve (PTX ISA, "Asynchronous data movement" and "mbarrier"):
//   producer:  wait(empty[s]) ; arrive.expect_tx(full[s], bytes) ; TMA -> smem[s], complete_tx on full[s]
//   consumer:  wait(full[s])  ; read smem[s] (wgmma) ; arrive(empty[s])
// A barrier's phase completes when its pending arrivals reach zero and its transaction count
// (bytes announced by expect_tx, retired by the TMA unit as data lands) is back to zero.
// try_wait.parity(P) returns once the phase of parity P has completed; on a fresh barrier
// (phase 0 running) waiting on parity 1 returns at once, which is how a producer's first
// pass over the ring skips its waits.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "sm90_common.cuh"

namespace flash_cuda {
namespace sm90 {

// ---------------------------------------------------------------------------------
// mbarrier
// ---------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
#if FLASH_SM90_ENABLED
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
#endif
}

// Makes the initialized barriers visible to the async proxy (the TMA unit) before first use.
__device__ __forceinline__ void fence_barrier_init() {
#if FLASH_SM90_ENABLED
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if FLASH_SM90_ENABLED
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
#if FLASH_SM90_ENABLED
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// Spins until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
#if FLASH_SM90_ENABLED
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

// ---------------------------------------------------------------------------------
// TMA: one box of a 4-d tensor map into shared memory, completing on an mbarrier, and back
// ---------------------------------------------------------------------------------
// (c0, c1, c2, c3): the box's first element, innermost dimension first.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
#if FLASH_SM90_ENABLED
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
#endif
}

// The reverse: one box of shared memory (in the map's swizzled layout) into a 4-d tensor, as a
// bulk group of this thread (bulk_commit, then bulk_wait_read before the source is written
// again). The box's elements outside the tensor's extent are not written. The source must have
// been written before: generic-proxy writes fenced with fence_proxy_async by every writing
// thread, then a barrier with the issuing one.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                             int c3) {
#if FLASH_SM90_ENABLED
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
#endif
}

// Zeroes rows [valid, kRows) of a TMA-loaded tile of kSlabs slabs, each kRows rows of 128 bytes
// (64 columns): the rows a box read past a packed sequence's end, which belong to the next
// sequence (its NaN or Inf would otherwise reach this one through 0 x NaN). The 128-byte swizzle
// permutes the 16-byte chunks within a row, never across rows, so whole rows are zeroed whatever
// the pattern. One warp (lane = 0..31), 16-byte stores; the caller fences them for the async
// proxy before a wgmma reads the tile.
template <int kRows, int kSlabs>
__device__ __forceinline__ void zero_rows(const void* tile, int valid, int lane) {
#if FLASH_SM90_ENABLED
  const uint32_t first = smem_addr(tile) + valid * kSwizzleBytes;
  const int chunks = (kRows - valid) * (kSwizzleBytes / 16);
#pragma unroll
  for (int slab = 0; slab < kSlabs; ++slab) {
#pragma unroll 1
    for (int i = lane; i < chunks; i += 32) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(first + slab * kRows * kSwizzleBytes + i * 16),
                   "r"(0)
                   : "memory");
    }
  }
#endif
}

// ---------------------------------------------------------------------------------
// Bulk reduction: shared memory added into global memory by the TMA unit, in L2
// ---------------------------------------------------------------------------------
// dst[0 .. bytes / 4) += src[0 .. bytes / 4) (float32), asynchronously; bytes, dst and src are
// multiples of 16. The source must have been written before (generic-proxy writes fenced with
// fence_proxy_async and published through a barrier). Completion is tracked per thread in bulk
// groups: commit, then wait until the source has been read (it may be overwritten) or until the
// writes are done.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, uint32_t bytes) {
#if FLASH_SM90_ENABLED
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if FLASH_SM90_ENABLED
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
#if FLASH_SM90_ENABLED
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
#if FLASH_SM90_ENABLED
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// ---------------------------------------------------------------------------------
// Register reallocation between warpgroups, and barriers over a subset of warps
// ---------------------------------------------------------------------------------
// A warpgroup that only issues TMA needs few registers; giving them to the math warpgroups
// lets those hold the S and O accumulators without spilling. kRegs: a multiple of 8 in
// [24, 256]; every thread of the warpgroup executes the same call.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
#if FLASH_SM90_ENABLED
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
#if FLASH_SM90_ENABLED
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// bar.sync on hardware barrier `id` (1..15; 0 is __syncthreads) for `threads` threads, whole
// warps: synchronizes the consumer warpgroups without the producer.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts this warp's threads towards barrier `id` without waiting for it.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace sm90

// ---------------------------------------------------------------------------------
// Host: tensor maps
// ---------------------------------------------------------------------------------
// cuTensorMapEncodeTiled lives in the driver library; the runtime hands out its entry point,
// so the extension needs no link against libcuda. nullptr when the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status;
#if CUDART_VERSION >= 12050
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &status);
#endif
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A map over the rows of a [batch][heads][rows][d] view of 16-bit elements (strides in
// elements, any order), read in boxes of 64 columns x box_rows rows with the 128-byte swizzle:
// exactly one column slab of the swizzled tile layout (sm90_common.cuh). Rows past `rows` and
// columns past `d` are filled with zeros. Returns false (nothing to use) when TMA cannot
// address the view: a base or a stride that is not a multiple of 16 bytes.
// box_heads > 1 (the GQA-packed Q of sm90_fwd_ws.cuh): the map orders the dimensions
// (d, head, row, batch) instead, and a box is 64 columns x box_heads heads x box_rows / box_heads
// rows, with its first head and row given as coordinates 1 and 2. TMA writes a box innermost
// dimension first, so its 128-byte lines land as tile rows q * box_heads + g (row q of the box,
// head g): box_rows lines, the same slab as above. (The strides may be in any order here too:
// TMA steps each dimension by its own stride, as the (d, row, head) map of a bshd view relies on.)
inline bool make_row_tensor_map(CUtensorMap* map, const void* base, bool bf16, int d, int rows, int heads,
                                int batch, int64_t row_stride, int64_t head_stride, int64_t batch_stride,
                                int box_rows, int box_heads = 1) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  constexpr int64_t kElem = 2;
  // A dimension of extent 1 is never stepped along; its stride (which a view may leave at any
  // value) becomes the packed one, the span of the dimensions inside it.
  const int64_t row_bytes = rows > 1 ? row_stride * kElem : (d * kElem + 15) / 16 * 16;
  const int64_t head_bytes = heads > 1 ? head_stride * kElem : row_bytes * rows;
  const int64_t batch_bytes = batch > 1 ? batch_stride * kElem : head_bytes * heads;
  const bool heads_inside = box_heads > 1;
  if (heads_inside && (box_rows % box_heads != 0 || heads % box_heads != 0)) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d),
                              static_cast<cuuint64_t>(heads_inside ? heads : rows),
                              static_cast<cuuint64_t>(heads_inside ? rows : heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(heads_inside ? head_bytes : row_bytes),
                                 static_cast<cuuint64_t>(heads_inside ? row_bytes : head_bytes),
                                 static_cast<cuuint64_t>(batch_bytes)};
  for (cuuint64_t s : strides) {
    if (s % 16 != 0 || s >= (cuuint64_t{1} << 40)) return false;
  }
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(heads_inside ? box_heads : box_rows),
                             static_cast<cuuint32_t>(heads_inside ? box_rows / box_heads : 1), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                            const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// The row extents of a call's maps. A packed batch's maps cover all rows of the packed tensors
// with batch extent 1 (the batch strides, 0, are then never used): a kernel tells the sequences
// apart by cu_seqlens and adds a sequence's first row to its coordinates.
struct MapRows {
  int q, k, batch;
  static MapRows of(const FwdParams& p) {
    const bool packed = p.cu_seqlens_q != nullptr;
    return {packed ? p.total_q : p.sq, packed ? p.total_k : p.sk, packed ? 1 : p.b};
  }
};

// The maps of a call's Q (boxes of block_m rows; q_group > 1: of block_m / q_group rows of
// q_group heads each, the GQA-packed tiles), K and V (block_n rows); false where TMA cannot
// address one of the views.
inline bool make_qkv_tensor_maps(const FwdParams& p, CUtensorMap* q, CUtensorMap* k, CUtensorMap* v, int block_m,
                                 int block_n, int q_group = 1) {
  const bool bf16 = p.dtype == DType::kBFloat16;
  const MapRows rows = MapRows::of(p);
  return make_row_tensor_map(q, p.q, bf16, p.d, rows.q, p.hq, rows.batch, p.q_row_stride, p.q_head_stride,
                             p.q_batch_stride, block_m, q_group) &&
         make_row_tensor_map(k, p.k, bf16, p.d, rows.k, p.hkv, rows.batch, p.k_row_stride, p.k_head_stride,
                             p.k_batch_stride, block_n) &&
         make_row_tensor_map(v, p.v, bf16, p.d, rows.k, p.hkv, rows.batch, p.v_row_stride, p.v_head_stride,
                             p.v_batch_stride, block_n);
}

// The map of a call's O, written in boxes of box_rows rows (TMA stores); false where TMA cannot
// address the view.
inline bool make_o_tensor_map(const FwdParams& p, CUtensorMap* o, int box_rows) {
  const MapRows rows = MapRows::of(p);
  return make_row_tensor_map(o, p.o, p.dtype == DType::kBFloat16, p.d, rows.q, p.hq, rows.batch, p.o_row_stride,
                             p.o_head_stride, p.o_batch_stride, box_rows);
}

}  // namespace flash_cuda
