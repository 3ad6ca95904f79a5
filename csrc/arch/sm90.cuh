// arch/sm90.cuh — the Hopper (sm_90a) instructions: warpgroup MMA (wgmma) descriptors and
// synchronisation over the 128-byte-swizzled shared-memory tiles that wgmma and TMA read and
// write; the tensor memory accelerator (TMA, cp.async.bulk.tensor) and bulk reductions;
// transaction-counting mbarriers; setmaxnreg and named barriers. One thin wrapper per
// instruction; the wgmma instructions themselves are in sm90_wgmma.cuh (generated).
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
//
// The 64-byte-swizzled slab layout (the Hopper forward's V at head dim 96: a 96-column row is
// 192 bytes, 1.5 lines of the 128-byte swizzle, but exactly three 64-byte lines). A tile of R
// rows x D columns (D a multiple of 32) is D / 32 slabs of 32 columns, one 64-byte line per row:
//     byte offset of (r, col) = (col / 32) * R * 64 + r * 64 + 16 * ((col % 32) / 8 ^ (r / 2) % 4)
//                               + 2 * (col % 8)
// i.e. address bits 4-5 XORed with bits 7-8 (the hardware's "64B swizzle", period 512 bytes),
// which is what TMA's 64-byte swizzle writes for a box of 32 columns when the slab starts on a
// 512-byte boundary. Only the MN-major role is used (O = P V reads V with N along the columns):
// the canonical layout ((8,4,m),(8,k)) : ((1,8,LBO),(32,SBO)) in elements, i.e. a swizzle atom
// of 32 N-columns x 8 K-rows (8 lines, 512 bytes), atoms along N LBO = R * 64 bytes apart (the
// next slab) and along K SBO = 512 bytes apart (the next 8 lines); a 16-row k-step starts
// 16 * 64 bytes further, still on a 512-byte boundary (base offset 0). Every 8 lines of 16-byte
// chunks that wgmma reads at one K (a core matrix) fall on 8 different 16-byte bank groups:
// lines 2i and 2i + 1 are 64 bytes apart and pairs of lines are permuted by (r / 2) % 4.
// The backward at head dim 96 (tiers/wgmma/bwd_ws.cuh) also reads such tiles K-major: the
// canonical ((8,m),(8,2k)) : ((32,SBO),(1,8)), rows 64 bytes apart, 8-row groups SBO = 512
// bytes apart, and one 32-column atom holds two k-steps, so k-step ks starts in slab ks / 2,
// 32 * (ks % 2) bytes into the line (the hardware XORs the address bits, as for the 128-byte
// swizzle's k-steps at 32-byte offsets).
//
// The 32-byte-swizzled slab layout (the backward's K at head dim 96): slabs of 16 columns, one
// 32-byte line per row, address bits 4 XORed with bit 7 (period 256 bytes):
//     byte offset of (r, col) = (col / 16) * R * 32 + r * 32 + 16 * ((col % 16) / 8 ^ (r / 4) % 2)
//                               + 2 * (col % 8)
// which is what TMA's 32-byte swizzle writes for a box of 16 columns. One slab is one k-step of
// the K-major role (SBO = 8 lines = 256 bytes) and one atom of 16 N-columns of the MN-major role
// (((8,2,m),(8,k)) : ((1,8,LBO),(16,SBO)): LBO = R * 32 bytes to the next slab, SBO = 256), so
// an MN-major operand may start at any slab: N = 48 from column 0 or 48 (the dQ product's two
// halves of 96 columns, which no 32- or 64-column slab boundary splits). The 8 lines of a core
// matrix are 32 bytes apart: lines r and r + 4 fall 128 bytes apart, and the XOR moves the
// second to the other 16 bytes of its line, so the 8 chunks hit 8 different 16-byte bank groups.
//
// The pipeline the asynchronous instructions serve (PTX ISA, "Asynchronous data movement" and
// "mbarrier"):
//   producer:  wait(empty[s]) ; arrive.expect_tx(full[s], bytes) ; TMA -> smem[s], complete_tx on full[s]
//   consumer:  wait(full[s])  ; read smem[s] (wgmma) ; arrive(empty[s])
// A barrier's phase completes when its pending arrivals reach zero and its transaction count
// (bytes announced by expect_tx, retired by the TMA unit as data lands) is back to zero.
// try_wait.parity(P) returns once the phase of parity P has completed; on a fresh barrier
// (phase 0 running) waiting on parity 1 returns at once, which is how a producer's first
// pass over the ring skips its waits.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "sm80.cuh"
#include "sm90_wgmma.cuh"
#include "tile.cuh"
#include "types.cuh"

namespace flash_cuda {
namespace sm90 {

// The sm_90a instructions below exist only in the sm_90a build; elsewhere these helpers
// compile to nothing and the kernels that use them trap (they are never launched there:
// the launcher checks that the kernel was built for the device, see sm90_kernel_built in arch/host.h).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FLASH_SM90_ENABLED 1
#define FLASH_SM90_ASM(...) asm volatile(__VA_ARGS__)
// The body of a kernel that exists in the sm_90a build alone (elsewhere it traps).
#define FLASH_SM90_KERNEL_BODY(...) __VA_ARGS__
#else
#define FLASH_SM90_ENABLED 0
#define FLASH_SM90_ASM(...) ((void)0)
#define FLASH_SM90_KERNEL_BODY(...) __trap()
#endif

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

// The dynamic shared memory a kernel whose layout is the struct Storage requests: its bytes and
// the room aligned_smem_base may skip.
constexpr size_t kSmemBaseSlack = kSwizzleAlign;
template <typename Storage>
constexpr size_t smem_request_bytes() {
  return sizeof(Storage) + kSmemBaseSlack;
}

// ---------------------------------------------------------------------------------
// Descriptors.
// ---------------------------------------------------------------------------------
// The descriptor's swizzle field (bits 62-63).
constexpr int kDescSwizzle128B = 1;
constexpr int kDescSwizzle64B = 2;
constexpr int kDescSwizzle32B = 3;
// The swizzle of slabs of kLineBytes-byte lines (128, 64 or 32: 64, 32 or 16 columns).
template <int kLineBytes>
constexpr int desc_swizzle_of() {
  static_assert(kLineBytes == 128 || kLineBytes == 64 || kLineBytes == 32, "a swizzled slab's line");
  return kLineBytes == 128 ? kDescSwizzle128B : kLineBytes == 64 ? kDescSwizzle64B : kDescSwizzle32B;
}
template <int kSwizzleMode = kDescSwizzle128B>
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_byte_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32;
  desc |= static_cast<uint64_t>(kSwizzleMode) << 62;  // base offset 0 (slabs on the pattern's period)
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

// MN-major operand in the 64-byte-swizzled layout (above): k-step ks covers rows
// [16 ks, 16 ks + 16) of a tile of kRows rows; N runs along all its 32-column slabs.
template <int kRows>
__device__ __forceinline__ uint64_t desc_mn_major_64b(const void* tile, int ks) {
  constexpr uint32_t kLine = 64;
  return desc_advance(make_desc<kDescSwizzle64B>(smem_addr(tile), kRows * kLine, 8 * kLine), 16 * ks * kLine);
}

// A swizzled tile as a wgmma operand (its descriptor per k-step, and the instruction's transpose
// bit): K-major rows [row0, row0 + 64 or N) of a tile of kRows rows, or MN-major from row0 on.
template <int kRows, bool kMNMajor>
struct Operand {
  static constexpr int kTrans = kMNMajor ? 1 : 0;
  const void* tile;
  int row0;
  __device__ __forceinline__ uint64_t desc(int ks) const {
    return kMNMajor ? desc_mn_major<kRows>(tile, row0, ks) : desc_k_major<kRows>(tile, row0, ks);
  }
};
template <int kRows>
using KMajor = Operand<kRows, false>;
template <int kRows>
using MNMajor = Operand<kRows, true>;
// A tile in the 64-byte-swizzled layout as the MN-major B operand.
template <int kRows>
struct MNMajor64B {
  static constexpr int kTrans = 1;
  const void* tile;
  __device__ __forceinline__ uint64_t desc(int ks) const { return desc_mn_major_64b<kRows>(tile, ks); }
};

// A tile of kRows rows in slabs of kLineBytes-byte lines (any of the three layouts above) as a
// wgmma operand, K-major rows [row0, row0 + 64 or N) or MN-major from row0 on: the descriptors of
// Operand, with the line's width for the 128 bytes. KMajorIn / MNMajorIn name Operand itself for
// 128-byte lines, so the kernels on those tiles keep their code.
template <int kRows, int kLineBytes, bool kMNMajor>
struct SlabOperand {
  static constexpr int kTrans = kMNMajor ? 1 : 0;
  const void* tile;
  int row0;
  __device__ __forceinline__ uint64_t desc(int ks) const {
    constexpr int kMode = desc_swizzle_of<kLineBytes>();
    const uint32_t start = smem_addr(tile) + row0 * kLineBytes;
    if constexpr (kMNMajor) {
      return desc_advance(make_desc<kMode>(start, kRows * kLineBytes, 8 * kLineBytes), 16 * ks * kLineBytes);
    } else {
      // k-step ks: columns [16 ks, 16 ks + 16), 32 ks bytes into the row: slab 32 ks / kLineBytes.
      return desc_advance(make_desc<kMode>(start, 16, 8 * kLineBytes),
                          (32 * ks / kLineBytes) * kRows * kLineBytes + (32 * ks) % kLineBytes);
    }
  }
};
template <int kRows, int kLineBytes>
using KMajorIn = std::conditional_t<kLineBytes == kSwizzleBytes, KMajor<kRows>, SlabOperand<kRows, kLineBytes, false>>;
template <int kRows, int kLineBytes>
using MNMajorIn = std::conditional_t<kLineBytes == kSwizzleBytes, MNMajor<kRows>, SlabOperand<kRows, kLineBytes, true>>;

// The slabs of one TMA-filled tile of kRows rows: kSlabs boxes of kCols columns, each kRows lines
// of kElemBytes kCols bytes, one after the other. 16-bit elements: kCols 64, the 128-byte swizzle
// (every tile but those below); 32: the 64-byte swizzle (the forward's V and the backward's Q,
// dO, V at d = 96); 16: the 32-byte swizzle (the backward's K at d = 96). e4m3 (kElemBytes 1):
// 128 columns per 128-byte line. kElems: the tile's elements; kBytes: what its boxes deliver
// (columns past d included: TMA counts the zeros it fills).
template <int kRows_, int kCols_, int kSlabs_, int kElemBytes_ = 2>
struct Slabs {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kSlabs = kSlabs_;
  static constexpr int kElemBytes = kElemBytes_;
  static constexpr int kLineBytes = kElemBytes * kCols;
  static constexpr int kSlabElems = kRows * kCols;
  static constexpr int kElems = kSlabs * kSlabElems;
  static constexpr size_t kBytes = size_t(kElems) * kElemBytes;
  static_assert(kLineBytes == 128 || kLineBytes == 64 || kLineBytes == 32, "one line per row: 128-, 64- or 32-byte swizzle");
  static_assert(kSlabElems * kElemBytes % 1024 == 0, "every slab starts on the swizzle's period");
};

// The products of a warpgroup over kSteps k-steps of 16, issued (the caller fences, commits and
// waits): d (+)= A B with both operands in shared memory (the first step overwrites d unless
// kAccumulate), or with A in registers (k-step fragments, core/fragment.cuh: accumulator_to_a),
// accumulating. d has N = 8 kNT columns.
template <int kSteps, bool kAccumulate, typename T, int kNT, typename A, typename B>
__device__ __forceinline__ void wgmma_ss(float (&d)[kNT][4], const A& a, const B& b) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    Wgmma<T, 8 * kNT>::template ss<B::kTrans, A::kTrans>(d, a.desc(ks), b.desc(ks), kAccumulate ? 1 : ks > 0);
  }
}
template <typename T, int kNT, int kSteps, typename B>
__device__ __forceinline__ void wgmma_rs(float (&d)[kNT][4], const uint32_t (&a)[kSteps][4], const B& b) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) Wgmma<T, 8 * kNT>::template rs<B::kTrans>(d, a[ks], b.desc(ks), 1);
}

// ---------------------------------------------------------------------------------
// Synchronisation of the asynchronous tensor-core pipe.
// ---------------------------------------------------------------------------------
// Orders this thread's earlier register writes (accumulators, A fragments) before the
// wgmma that follows.
__device__ __forceinline__ void wgmma_fence() {
  FLASH_SM90_ASM("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  FLASH_SM90_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  FLASH_SM90_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// wgmma reads shared memory through the async proxy; writes made by ordinary stores or
// cp.async (the generic proxy) must be fenced before a barrier makes them visible to it.
__device__ __forceinline__ void fence_proxy_async() {
  FLASH_SM90_ASM("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Register fences, placed right after a wgmma_wait. Accumulators pass through wgmma as "+f"
// asm operands: the compiler must not move their reads above the wait. A fragments pass as
// inputs: while the wgmma that reads them is in flight (other work runs between issue and
// wait), their registers must not be handed to anything else. Tying each register to a point
// after the wait does both.
template <int kN>
__device__ __forceinline__ void fence_accumulator(float (&d)[kN][4]) {
  for_each_word(d, [](float& x) { opaque(x); });
}
template <int kK>
__device__ __forceinline__ void fence_fragments(uint32_t (&a)[kK][4]) {
  for_each_word(a, [](uint32_t& x) { opaque(x); });
}

// Zeroes an accumulator with instructions the compiler keeps in program order among the other
// asm statements (wgmma, fences): plain zero stores may sink past a wgmma_fence into a window
// where other products are in flight, and ptxas then serializes every wgmma (C7515).
template <int kN>
__device__ __forceinline__ void zero_accumulator(float (&d)[kN][4]) {
  for_each_word(d, [](float& x) { zero_in_order(x); });
}

// ---------------------------------------------------------------------------------
// mbarrier
// ---------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int arrivals) {
  FLASH_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}

// Makes the initialized barriers visible to the async proxy (the TMA unit) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  FLASH_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  FLASH_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  FLASH_SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Spins until the phase of parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
  FLASH_SM90_ASM(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// ---------------------------------------------------------------------------------
// Thread-block clusters: this CTA's rank, the cluster-wide barrier (release / acquire: shared
// memory written before it is visible to every CTA of the cluster after it), and loads from
// another CTA's shared memory (distributed shared memory) at the address `mapa` gives.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r = 0;
  FLASH_SM90_ASM("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  FLASH_SM90_ASM("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// The address of `local` (this CTA's shared memory) in the window of CTA `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_address(const void* local, uint32_t rank) {
  uint32_t a = 0;
  FLASH_SM90_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(smem_addr(local)), "r"(rank));
  return a;
}

__device__ __forceinline__ float4 cluster_load4(uint32_t addr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  FLASH_SM90_ASM("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
  return v;
}

__device__ __forceinline__ float2 cluster_load2(uint32_t addr) {
  float2 v = make_float2(0.f, 0.f);
  FLASH_SM90_ASM("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// ---------------------------------------------------------------------------------
// Bulk copy: `bytes` contiguous bytes of global memory into shared memory by the TMA unit, no
// tensor map, completing on an mbarrier (complete_tx); bytes, src and dst are multiples of 16.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  FLASH_SM90_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// ---------------------------------------------------------------------------------
// TMA: one box of a 4-d tensor map into shared memory, completing on an mbarrier, and back
// ---------------------------------------------------------------------------------
// (c0, c1, c2, c3): the box's first element, innermost dimension first.
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2, int c3) {
  FLASH_SM90_ASM(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

// The reverse: one box of shared memory (in the map's swizzled layout) into a 4-d tensor, as a
// bulk group of this thread (bulk_commit, then bulk_wait_read before the source is written
// again). The box's elements outside the tensor's extent are not written. The source must have
// been written before: generic-proxy writes fenced with fence_proxy_async by every writing
// thread, then a barrier with the issuing one.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* src, int c0, int c1, int c2,
                                             int c3) {
  FLASH_SM90_ASM("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
               : "memory");
}

// Zeroes rows [valid, kRows) of a TMA-loaded tile of kSlabs slabs, each kRows rows of kLineBytes
// (128: 64 columns; 64, 32: the 64- and 32-byte-swizzled slabs of 32 and 16): the rows a box read past a packed
// sequence's end, which belong to the next sequence (its NaN or Inf would otherwise reach this
// one through 0 x NaN). Every swizzle permutes the 16-byte chunks within a row, never across
// rows, so whole rows are zeroed whatever the pattern. One warp (lane = 0..31), 16-byte stores;
// the caller fences them for the async proxy before a wgmma reads the tile.
template <int kRows, int kSlabs, int kLineBytes = kSwizzleBytes>
__device__ __forceinline__ void zero_rows(const void* tile, int valid, int lane) {
#if FLASH_SM90_ENABLED
  const uint32_t first = smem_addr(tile) + valid * kLineBytes;
  const int chunks = (kRows - valid) * (kLineBytes / 16);
#pragma unroll
  for (int slab = 0; slab < kSlabs; ++slab) {
#pragma unroll 1
    for (int i = lane; i < chunks; i += 32) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(first + slab * kRows * kLineBytes + i * 16),
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
  FLASH_SM90_ASM("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  FLASH_SM90_ASM("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  FLASH_SM90_ASM("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  FLASH_SM90_ASM("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---------------------------------------------------------------------------------
// Register reallocation between warpgroups, and barriers over a subset of warps
// ---------------------------------------------------------------------------------
// A warpgroup that only issues TMA needs few registers; giving them to the math warpgroups
// lets those hold the S and O accumulators without spilling. kRegs: a multiple of 8 in
// [24, 256]; every thread of the warpgroup executes the same call.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  FLASH_SM90_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  FLASH_SM90_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
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


// 16-byte and 2 x 4-byte stores to shared memory by address (the producer's statistics, the
// dQ staging): as plain ST.SHARED, never a generic store.
__device__ __forceinline__ void st_shared_v4_f32(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
// stmatrix .x4: four 8x8 matrices of 16-bit elements, one instruction for what would be four
// 4-byte stores per lane. Register i of lane l holds row l / 4, columns 2 (l % 4), +1 of matrix
// i (an mma / wgmma A fragment's word i); lanes 8i .. 8i + 7 give the addresses of matrix i's
// rows 0..7 (16 bytes each, 16-byte aligned).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  FLASH_SM90_ASM("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
                 "r"(r[2]), "r"(r[3])
                 : "memory");
}
template <int kSecondOffset>
__device__ __forceinline__ void st_shared_f32_pair(uint32_t addr, float first, float second) {
  asm volatile("st.shared.f32 [%0], %1;\nst.shared.f32 [%0 + %3], %2;\n" ::"r"(addr), "f"(first), "f"(second),
               "n"(kSecondOffset)
               : "memory");
}

}  // namespace sm90
}  // namespace flash_cuda
