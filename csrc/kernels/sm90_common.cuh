// sm90_common.cuh — what the Hopper (sm_90a) tier adds to common.cuh: warpgroup MMA
// (wgmma) descriptors and synchronisation, and the 128-byte-swizzled shared-memory tiles
// that wgmma reads.
//
// Tile layout. A tile of R rows x D columns (16-bit elements, D a multiple of 64) is stored
// as D / 64 column slabs, one after the other; slab c holds columns 64c..64c+63 of every row,
// one 128-byte line per row:
//     byte offset of (r, col) = (col / 64) * R * 128 + r * 128 + 16 * ((col % 64) / 8 ^ r % 8)
//                               + 2 * (col % 8)
// i.e. the eight 16-byte chunks of a line are permuted by XOR with the row index mod 8
// (the hardware's "128B swizzle"). Every slab starts on a 1024-byte boundary, so the
// swizzle pattern (8 lines of 128 bytes) is aligned and the descriptor's base offset is 0.
// The permutation spreads the 8 rows of any 8 x 16-byte access over all 32 banks, for the
// cp.async writes as for wgmma's reads.
//
// One tile serves both operand roles, through two descriptors:
//   * K-major (the reduction runs along the columns: S = Q K^T reads Q and K this way).
//     Rows are the M (or N) dimension; 8-row groups are 1024 bytes apart (SBO); a 16-column
//     k-step is 32 bytes inside a 128-byte line, so k-step ks starts at
//     slab (ks / 4) + 32 * (ks % 4) bytes. LBO is unused for swizzled K-major layouts.
//   * MN-major (the reduction runs along the rows: O = P V reads V this way, with the
//     instruction's transpose bit). Columns are the N dimension: 64-column slabs are
//     R * 128 bytes apart (LBO); 8-row groups along K are 1024 bytes apart (SBO); a 16-row
//     k-step starts 16 * 128 bytes further.
// (PTX ISA, "Asynchronous Warpgroup Level Matrix Shared Memory Layout".)
#pragma once

#include "common.cuh"
#include "wgmma_ops.cuh"

namespace flash_cuda {
namespace sm90 {

// The sm_90a instructions below exist only in the sm_90a build; elsewhere these helpers
// compile to nothing and the kernels that use them trap (they are never launched there:
// the launcher checks that the kernel was built for the device, see sm90_kernel_available).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH_SM90_ENABLED 1
#else
#define FLASH_SM90_ENABLED 0
#endif

constexpr int kSwizzleBytes = 128;  // one line of a slab
constexpr int kSlabCols = 64;       // 16-bit columns per line

// Byte offset of element (r, col) in a swizzled tile of kRows rows (see the file comment).
template <int kRows>
__device__ __forceinline__ uint32_t swizzled_offset(int r, int col) {
  return static_cast<uint32_t>((col / kSlabCols) * kRows * kSwizzleBytes + r * kSwizzleBytes +
                               ((((col % kSlabCols) / 8) ^ (r % 8)) * 16) + (col % 8) * 2);
}

// Copies rows [0, kRows) x columns [0, kHeadDim) of a row-major slice (16-bit elements,
// row_stride in elements) into a swizzled tile, 16 bytes per cp.async; rows >= rows_valid and
// columns >= d are zero-filled. Consecutive threads take consecutive 16-byte chunks of a row,
// so a warp reads whole lines of global memory. A thread keeps its column chunk and walks
// down the rows kThreads / (kHeadDim / 8) at a time, a multiple of 8, so its swizzled
// position within a line never changes: one add per copy on each side (few live registers
// next to the accumulators).
template <int kRows, int kHeadDim, int kThreads, typename T>
__device__ __forceinline__ void load_tile_swizzled(T* smem, const T* gmem, int64_t row_stride,
                                                   int rows_valid, int d, int thread) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kRowsPerPass = kThreads / kChunksPerRow;
  static_assert(kThreads % kChunksPerRow == 0 && kRowsPerPass % 8 == 0, "passes keep the swizzle phase");
  const int col = (thread % kChunksPerRow) * 8;
  int r = thread / kChunksPerRow;
  const bool col_valid = col < d;
  unsigned char* dst = reinterpret_cast<unsigned char*>(smem) + swizzled_offset<kRows>(r, col);
  const T* src = gmem + r * row_stride + col;
#pragma unroll
  for (int pass = 0; pass < ceil_div(kRows, kRowsPerPass); ++pass) {
    if (kRows % kRowsPerPass != 0 && r >= kRows) break;  // last, partial pass
    const bool valid = col_valid && r < rows_valid;
    cp_async_16(dst, valid ? src : gmem, valid);
    r += kRowsPerPass;
    dst += kRowsPerPass * kSwizzleBytes;
    src += kRowsPerPass * row_stride;
  }
}

// The dynamic shared-memory base rounded up to the 1024-byte alignment of the swizzle
// pattern (kernels request 1024 bytes more than their tiles need). kSharedSpace: as an offset
// added to raw rather than an integer round trip, so that the compiler still knows every pointer
// derived from the base is shared memory and emits STS / LDS instead of generic ST.E / LD.E
// (the backward); the forward keeps the round trip: with the shared form its 160-register
// configurations (d = 64 with three consumer warpgroups, d = 256) spill 8 bytes. The shared
// window's address decides the alignment; the generic window is aligned far beyond 1024 bytes,
// so both forms give the same base.
template <bool kSharedSpace = false>
__device__ __forceinline__ unsigned char* aligned_smem_base(unsigned char* raw) {
  if constexpr (kSharedSpace) {
    const uint32_t misalign = static_cast<uint32_t>(__cvta_generic_to_shared(raw)) & 1023u;
    return raw + ((1024u - misalign) & 1023u);
  } else {
    return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                            ~static_cast<uintptr_t>(1023));
  }
}

// ---------------------------------------------------------------------------------
// Descriptors.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32;
  desc |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle; base offset 0 (aligned slabs)
  return desc;
}

// A descriptor whose start address is `bytes` further (a multiple of 16). Shared-memory
// addresses stay below 2^18, so the 14-bit address field never carries: one 32-bit add on the
// low word. The k-steps of a product differ only by such constant offsets, so their
// descriptors are one make_desc (a common subexpression) plus an add each, which keeps the
// integer work between a warpgroup taking its turn and issuing its products short.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// K-major operand: rows [row0, row0 + 64 or N) of a tile of kRows rows, k-step ks (16 columns).
template <int kRows>
__device__ __forceinline__ uint64_t desc_k_major(const void* tile, int row0, int ks) {
  return desc_advance(make_desc(smem_addr(tile) + row0 * kSwizzleBytes, 16, 1024),
                      (ks / 4) * kRows * kSwizzleBytes + (ks % 4) * 32);
}

// MN-major operand: k-step ks covers rows [row0 + 16 ks, row0 + 16 ks + 16) of a tile of kRows
// rows; N runs along all its columns.
template <int kRows>
__device__ __forceinline__ uint64_t desc_mn_major(const void* tile, int row0, int ks) {
  return desc_advance(make_desc(smem_addr(tile) + row0 * kSwizzleBytes, kRows * kSwizzleBytes, 1024),
                      16 * ks * kSwizzleBytes);
}

// ---------------------------------------------------------------------------------
// Synchronisation of the asynchronous tensor-core pipe.
// ---------------------------------------------------------------------------------
// Orders this thread's earlier register writes (accumulators, A fragments) before the
// wgmma that follows.
__device__ __forceinline__ void wgmma_fence() {
#if FLASH_SM90_ENABLED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if FLASH_SM90_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most kPending committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if FLASH_SM90_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// wgmma reads shared memory through the async proxy; writes made by ordinary stores or
// cp.async (the generic proxy) must be fenced before a barrier makes them visible to it.
__device__ __forceinline__ void fence_proxy_async() {
#if FLASH_SM90_ENABLED
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Register fences, placed right after a wgmma_wait. Accumulators pass through wgmma as "+f"
// asm operands: the compiler must not move their reads above the wait. A fragments pass as
// inputs: while the wgmma that reads them is in flight (other work runs between issue and
// wait), their registers must not be handed to anything else. Tying each register to a point
// after the wait does both.
template <int kN>
__device__ __forceinline__ void fence_accumulator(float (&d)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e]));
}
template <int kK>
__device__ __forceinline__ void fence_fragments(uint32_t (&a)[kK][4]) {
#pragma unroll
  for (int k = 0; k < kK; ++k)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[k][e]));
}

// Zeroes an accumulator with instructions the compiler keeps in program order among the other
// asm statements (wgmma, fences): plain zero stores may sink past a wgmma_fence into a window
// where other products are in flight, and ptxas then serializes every wgmma (C7515).
template <int kN>
__device__ __forceinline__ void zero_accumulator(float (&d)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("mov.b32 %0, 0;\n" : "=f"(d[j][e]));
}

// Packs two neighbouring 8-column accumulator tiles (16 columns: k-step kk of the next
// product) into the A fragment of a register-sourced wgmma.
template <typename T, int kN>
__device__ __forceinline__ void accumulator_to_a(uint32_t (&a)[4], const float (&d)[kN][4], int kk) {
  a[0] = pack2<T>(d[2 * kk][0], d[2 * kk][1]);
  a[1] = pack2<T>(d[2 * kk][2], d[2 * kk][3]);
  a[2] = pack2<T>(d[2 * kk + 1][0], d[2 * kk + 1][1]);
  a[3] = pack2<T>(d[2 * kk + 1][2], d[2 * kk + 1][3]);
}

}  // namespace sm90

// True when `kernel` was compiled for sm_90a (its code runs, rather than trapping, on this
// device). Builds without the 90a target (FLASH_CUDA_ARCHS="80") keep the portable tiers.
template <typename Kernel>
inline bool sm90_kernel_built(Kernel kernel) {
  return memo_per_kernel(reinterpret_cast<const void*>(kernel), /*key=*/-1, [&] {
           cudaFuncAttributes attr;
           if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
             (void)cudaGetLastError();
             return 0;
           }
           return attr.binaryVersion == 90 ? 1 : 0;
         }) != 0;
}

}  // namespace flash_cuda
