// arch/sm80.cuh — the instructions flash_cuda uses on every GPU it supports (sm_80 and newer),
// one thin wrapper each, named after the PTX instruction, so that the SASS (LDGSTS, LDSM, HMMA,
// MUFU.EX2, RED) can be matched back to the source line by line: asynchronous global -> shared
// copies, ldmatrix, mma.sync m16n8k16, warp shuffles over a row's lanes, the MUFU
// approximations, fire-and-forget reductions into global memory, and the compiler barriers the
// kernels use to keep a value from being hoisted. Tier code writes no inline PTX: it calls these.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flash_cuda {

// ---------------------------------------------------------------------------------
// Warp-level reductions (shuffles, no shared memory).
// ---------------------------------------------------------------------------------

// Reduce over the `kWidth` consecutive lanes that share a row (kWidth a power of 2).
template <int kWidth>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
template <int kWidth>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = kWidth / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// ---------------------------------------------------------------------------------
// Compiler barriers: a value the compiler must treat as unknown at this point, so that it
// neither hoists its uses out of a loop (where they would stay live in registers the kernel
// does not have) nor folds it into a constant.
// ---------------------------------------------------------------------------------
__device__ __forceinline__ void opaque(int& x) { asm volatile("" : "+r"(x)); }
__device__ __forceinline__ void opaque(uint32_t& x) { asm volatile("" : "+r"(x)); }
__device__ __forceinline__ void opaque(float& x) { asm volatile("" : "+f"(x)); }
template <typename T> __device__ __forceinline__ void opaque(T*& x) { asm volatile("" : "+l"(x)); }
// x = 0 by an instruction the compiler keeps in program order among the other asm statements.
__device__ __forceinline__ void zero_in_order(float& x) { asm volatile("mov.b32 %0, 0;\n" : "=f"(x)); }
// f(word) for each of the kN x 4 words of a fragment (an accumulator's or an A operand's).
template <typename W, int kN, typename F>
__device__ __forceinline__ void for_each_word(W (&d)[kN][4], F&& f) {
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(d[j][e]);
}
// x, which the caller knows is the same in every lane of the warp, as a value ptxas knows is:
// lane 0's, broadcast (CUTLASS's canonical_warp_group_idx does the same). Address arithmetic
// on it can then live in uniform registers, e.g. a wgmma descriptor made from a warpgroup
// index, which is otherwise rebuilt in ordinary registers and moved (R2UR) for every wgmma.
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }
// This thread's lane, read from the hardware register (opaque, unlike threadIdx.x % 32).
__device__ __forceinline__ int lane_id_opaque() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// This thread's index in its block, read from the hardware register (opaque, unlike threadIdx.x).
__device__ __forceinline__ uint32_t thread_index_opaque() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

// The n low bits set, n in 0 .. 32 (all 32 at n = 32): one BMSK, where (1u << n) - 1 needs a
// select for n = 32 and keeps its constant in a register.
__device__ __forceinline__ uint32_t low_bits(int n) {
  uint32_t bits;
  asm("bmsk.clamp.b32 %0, 0, %1;" : "=r"(bits) : "r"(n));
  return bits;
}

// ---------------------------------------------------------------------------------
// The MUFU unit and exact-NaN min / max.
// ---------------------------------------------------------------------------------
// 2^x by ex2.approx.ftz (MUFU.EX2): one instruction.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// tanh by tanh.approx.f32 (MUFU.TANH, sm_75 on): one instruction, a relative error of about
// 2^-11, that of an fp16 rounding.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// 1/x by rcp.approx.ftz (MUFU.RCP), about 1 ulp short of a division.
__device__ __forceinline__ float rcp_approx(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
// max / min that return NaN when either operand is NaN (fmaxf returns the other operand).
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float min_nan(float a, float b) {
  float r;
  asm("min.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

// ---------------------------------------------------------------------------------
// Asynchronous global -> shared copies (LDGSTS).
// ---------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One 32-bit word of shared memory, as its own load: the compiler may not fuse neighbouring words
// into one wider load, whose registers would then have to be consecutive.
__device__ __forceinline__ uint32_t lds_u32(const void* p) {
  uint32_t r;
  asm volatile("ld.volatile.shared.b32 %0, [%1];\n" : "=r"(r) : "r"(smem_addr(p)));
  return r;
}

// Copies 16 bytes when `valid`, otherwise writes 16 zero bytes (src-size = 0 reads nothing,
// so `gmem` may then point anywhere mapped; callers pass the tensor base).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_size));
}
// cp_async_16 for a stream read once (the decode's keys): kPrefetchBytes = 128 or 256 lets the L2
// fetch that much around each 16-byte request from DRAM at once (fewer, larger DRAM requests for
// the same bytes in flight); 0 is cp_async_16.
template <int kPrefetchBytes>
__device__ __forceinline__ void cp_async_16_stream(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 16 : 0;
  if constexpr (kPrefetchBytes == 256) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(src_size));
  } else if constexpr (kPrefetchBytes == 128) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
                 "l"(gmem), "r"(src_size));
  } else {
    cp_async_16(smem, gmem, valid);
  }
}
// 4 bytes (.ca: the only variant that allows 4), zero-filling when !valid: the per-row
// statistics start at arbitrary offsets, so 16-byte copies would not be aligned.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Programmatic dependent launch (sm_90; no-ops before): a grid launched with the programmatic
// stream-serialization attribute may start once every CTA of the grid before it has called
// launch_dependent_grids (or exited), and waits in grid_dependency_wait until that grid has
// finished and its writes are visible.
__device__ __forceinline__ void launch_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---------------------------------------------------------------------------------
// ldmatrix (LDSM): four 8x8 tiles of 16-bit values from shared memory into registers.
// Lane i supplies the address of row (i % 8) of tile (i / 8); register j of every lane
// then holds tile j's elements (row lane/4, columns 2*(lane%4) and 2*(lane%4)+1).
// The .trans form hands out the transposed tile instead.
// ---------------------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// ---------------------------------------------------------------------------------
// mma.sync m16n8k16 (HMMA), fp32 accumulate: D = A (16x16, row) * B (16x8, col) + D.
// Fragment ownership, with g = lane / 4 and t = lane % 4:
//   A: a[0] = (row g,   k 2t..2t+1)   a[1] = (row g+8, k 2t..2t+1)
//      a[2] = (row g,   k 2t+8..+9)   a[3] = (row g+8, k 2t+8..+9)
//   B: b[0] = (k 2t..2t+1, col g)     b[1] = (k 2t+8..+9, col g)
//   C: c[0], c[1] = (row g,   cols 2t, 2t+1)   c[2], c[3] = (row g+8, cols 2t, 2t+1)
// ---------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                  uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---------------------------------------------------------------------------------
// Reductions into global memory, done in L2 (RED: no value returned). Each float add is atomic
// on its own, rounds to nearest and flushes subnormal inputs and results to zero (the PTX rule
// for red.add.f32). The vector forms exist from sm_90 on and need 8- / 16-byte alignment. A
// generic address names the same global byte (cvta.to.global is the identity there).
// ---------------------------------------------------------------------------------
__device__ __forceinline__ void red_add_f32(float* addr, float x) {
  asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(addr), "f"(x) : "memory");
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void red_add_v4_f32(float* addr, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}
#endif

}  // namespace flash_cuda
