// core/dropout.cuh — attention dropout's random numbers, as flash_cuda.reference states them
// (section "Attention dropout"): a pure function of (seed, offset, batch b, query head h, query
// row i, key column j). One Philox4x32-10 draw gives four 32-bit words = eight 16-bit numbers,
// those of the eight elements one thread of a tensor-core tile holds in a 16 x 16 block of the
// scores (rows r and r + 8, columns 2c and 2c + 1 of two 8-column tiles), so a kernel draws once
// per eight elements:
//   counter = ((j / 16) * 4 + (j % 8) / 2, (i / 16) * 8 + i % 8, b * H + h, offset mod 2^32)
//   key     = (seed mod 2^32, (seed / 2^32 xor offset / 2^32) mod 2^32)
//   word    = ((i % 16) / 8) * 2 + (j % 16) / 8,  number = 16-bit half j % 2 of that word
// An element is kept iff its number is below the threshold t = round((1 - p) 2^16), and a kept
// probability is scaled by 2^16 / t.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../arch/host.h"
#include "../include/params.h"

namespace flash_cuda {

// What a launch needs to draw: the key words and the counter's last word from (seed, offset),
// and the threshold (0 .. 65536).
struct DropoutKey {
  uint32_t k0 = 0, k1 = 0, c3 = 0;
  uint32_t threshold = 65536;
};

FLASH_HOST_DEVICE inline DropoutKey make_dropout_key(uint64_t seed, uint64_t offset, uint32_t threshold) {
  DropoutKey key;
  key.k0 = static_cast<uint32_t>(seed);
  key.k1 = static_cast<uint32_t>((seed >> 32) ^ (offset >> 32));
  key.c3 = static_cast<uint32_t>(offset);
  key.threshold = threshold;
  return key;
}

// The whole-tensor mask (the kernels' mask for a dense batch, for tests that compare a kernel
// against the reference exactly): mask[bh][i][j] = 1 where element (bh, i, j) is kept.
struct DropoutMaskParams {
  uint8_t* mask = nullptr;  // [heads_total][sq][sk], contiguous
  int64_t heads_total = 0;  // batch * query heads
  int sq = 0, sk = 0;
  DropoutKey key;
};

#if defined(__CUDACC__)

struct PhiloxWords {
  uint32_t x, y, z, w;
};

// Philox4x32 with 10 rounds (Salmon et al., SC'11): the round multiplies two counter words by
// the constants, keeps both halves of each product and mixes in the key, which is bumped by the
// Weyl constants between rounds.
__device__ __forceinline__ PhiloxWords philox4x32_10(PhiloxWords c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = PhiloxWords{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
  }
  return c;
}

// The draw that holds element (i, j) of head slot b * H + h.
__device__ __forceinline__ PhiloxWords dropout_draw(const DropoutKey& key, uint32_t head_slot, uint32_t i,
                                                    uint32_t j) {
  return philox4x32_10(PhiloxWords{(j / 16) * 4 + (j % 8) / 2, (i / 16) * 8 + i % 8, head_slot, key.c3}, key.k0,
                       key.k1);
}

// Element (i, j)'s 16-bit number in its draw.
__device__ __forceinline__ uint32_t dropout_number(const PhiloxWords& d, uint32_t i, uint32_t j) {
  const uint32_t which = ((i % 16) / 8) * 2 + (j % 16) / 8;
  const uint32_t w = which == 0 ? d.x : which == 1 ? d.y : which == 2 ? d.z : d.w;
  return (w >> (16 * (j % 2))) & 0xFFFFu;
}

__device__ __forceinline__ bool dropout_keeps(const DropoutKey& key, uint32_t number) {
  return number < key.threshold;
}

// Whether element (i, j) of head slot b * H + h is kept, from its own draw (kernels whose
// threads do not hold a tensor-core tile's eight elements of a draw: the fp32 tier, tests).
__device__ __forceinline__ bool dropout_keeps_element(const DropoutKey& key, uint32_t head_slot, uint32_t i,
                                                      uint32_t j) {
  return dropout_keeps(key, dropout_number(dropout_draw(key, head_slot, i, j), i, j));
}

// The keep mask of a thread's kTM x kTN tile whose element (i, j) sits at row row0 + kRowStep i,
// column col0 + kColStep j (the fp32 tier's thread tiles): bit i kTN + j set where kept. Rows are
// queries (kRowsAreQueries) or keys. The draws run in a loop that is not unrolled, so that a
// tile's many Philox rounds cost registers once; the caller applies the bits with constant
// indices.
template <int kTM, int kTN, int kRowStep, int kColStep, bool kRowsAreQueries>
__device__ __forceinline__ uint64_t dropout_keep_bits(const DropoutKey& key, uint32_t head_slot, int row0,
                                                      int col0) {
  static_assert(kTM * kTN <= 64, "a thread tile of at most 64 elements");
  uint64_t bits = 0;
#pragma unroll 1
  for (int e = 0; e < kTM * kTN; ++e) {
    const uint32_t r = row0 + kRowStep * (e / kTN), c = col0 + kColStep * (e % kTN);
    if (dropout_keeps_element(key, head_slot, kRowsAreQueries ? r : c, kRowsAreQueries ? c : r)) {
      bits |= uint64_t{1} << e;
    }
  }
  return bits;
}

// The launch's (seed, offset): from the params, or read on the device (DropoutParams).
__device__ __forceinline__ void dropout_seed_offset(const DropoutParams& d, uint64_t& seed, uint64_t& offset) {
  seed = d.seed;
  offset = d.offset;
  if (d.seed_ptr != nullptr) {
    seed = static_cast<uint64_t>(*d.seed_ptr);
    offset = static_cast<uint64_t>(*d.offset_ptr) + d.offset_extra;
  }
}

__device__ __forceinline__ DropoutKey dropout_key(const DropoutParams& d) {
  uint64_t seed, offset;
  dropout_seed_offset(d, seed, offset);
  return make_dropout_key(seed, offset, d.threshold);
}

// The forward's record of its (seed, offset) for the backward (rng_state), written once by
// thread 0 of CTA (0, 0, 0); every forward kernel with dropout calls this before any role split
// or early return.
__device__ __forceinline__ void dropout_record(const DropoutParams& d) {
  if (d.rng_state != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) {
    uint64_t seed, offset;
    dropout_seed_offset(d, seed, offset);
    d.rng_state[0] = static_cast<int64_t>(seed);
    d.rng_state[1] = static_cast<int64_t>(offset);
  }
}

// The keep mask of a warp's tile of C fragments x[kM][kN][4] (the mma.sync / wgmma accumulator
// layout: element (mt, nt, e) at fragment row row0 + 16 mt + g + 8 (e / 2), column col0 + 8 nt +
// 2 t + e % 2, g = lane / 4, t = lane % 4; row0 and col0 multiples of 16): one byte per 16 x 16
// block (mt, np) of the thread's eight elements, bit 4 h + e for element (mt, 2 np + h, e), four
// blocks per word. Made once, it can drop several tiles of the same elements (the dK / dV
// kernel's dP^T and P^T).
template <int kM, int kN>
struct KeepTile {
  static_assert(kN % 2 == 0, "whole 16-column blocks");
  static constexpr int kBlocks = kM * kN / 2;
  uint32_t bits[(kBlocks + 3) / 4];
  __device__ __forceinline__ bool kept(int mt, int nt, int e) const {
    const int b = mt * (kN / 2) + nt / 2;
    return (bits[b / 4] >> (8 * (b % 4) + 4 * (nt % 2) + e)) & 1u;
  }
};

// The keep bits of one 16 x 16 block from the four words of its draw: `word(h, e)` picks the word
// and `half` the 16 bits of element (2 np + h, e).
__device__ __forceinline__ uint32_t keep_byte(const DropoutKey& key, const uint32_t (&w)[4], bool transposed,
                                              int half_t) {
  uint32_t byte = 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // Not transposed (rows are queries): word (e / 2) * 2 + h, half e % 2. Transposed (rows are
      // keys; the caller passes the draw of query 2 t + e % 2): word 2 h + e / 2, half g % 2.
      const uint32_t word = transposed ? w[2 * h + e / 2] : w[(e / 2) * 2 + h];
      const int half = transposed ? half_t : e % 2;
      byte |= uint32_t(dropout_keeps(key, (word >> (16 * half)) & 0xFFFFu)) << (4 * h + e);
    }
  }
  return byte;
}

// Fills `keep` for a warp's tile. Not transposed (rows are queries): the thread's eight elements of
// a block are one draw. kTransposed (the dK/dV products' P^T, rows are keys): the thread's queries
// 2 t and 2 t + 1 are two draws, each holding its query and query + 8 against the keys of one
// pair (2 c, 2 c + 1 and + 8) - the keys g and g + 8 take one half of each word, the lane with
// g xor 1 (lane xor 4) the other. So the two lanes draw one each (g even: query 2 t, g odd:
// 2 t + 1) and swap the words: one draw per eight elements, as without transposition.
template <bool kTransposed, int kM, int kN>
__device__ __forceinline__ void dropout_keep_tile(KeepTile<kM, kN>& keep, const DropoutKey& key,
                                                  uint32_t head_slot, int row0, int col0) {
  const int lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < (KeepTile<kM, kN>::kBlocks + 3) / 4; ++i) keep.bits[i] = 0;
#pragma unroll
  for (int mt = 0; mt < kM; ++mt) {
#pragma unroll
    for (int np = 0; np < kN / 2; ++np) {
      uint32_t byte;
      if constexpr (!kTransposed) {
        const PhiloxWords d = dropout_draw(key, head_slot, row0 + 16 * mt + g, col0 + 16 * np + 2 * t);
        const uint32_t w[4] = {d.x, d.y, d.z, d.w};
        byte = keep_byte(key, w, false, 0);
      } else {
        const int own = g % 2;  // this lane draws query 2 t + own, its partner 2 t + (1 - own)
        const PhiloxWords d = dropout_draw(key, head_slot, col0 + 16 * np + 2 * t + own, row0 + 16 * mt + g);
        const uint32_t mine[4] = {d.x, d.y, d.z, d.w};
        uint32_t theirs[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) theirs[k] = __shfl_xor_sync(0xffffffffu, mine[k], 4);
        // element (h, e) belongs to query 2 t + e % 2: own's draw where e % 2 == own. Bits 4 h + e:
        // e % 2 == 0 from query 2 t, 1 from 2 t + 1; the two bytes are chosen between, not the
        // eight words (fewer registers live next to the accumulators).
        const uint32_t b_mine = keep_byte(key, mine, true, g % 2), b_theirs = keep_byte(key, theirs, true, g % 2);
        byte = own == 0 ? (b_mine & 0x55u) | (b_theirs & 0xAAu) : (b_theirs & 0x55u) | (b_mine & 0xAAu);
      }
      const int b = mt * (kN / 2) + np;
      keep.bits[b / 4] |= byte << (8 * (b % 4));
    }
  }
}

// x * scale where kept, else 0, element by element.
template <int kM, int kN>
__device__ __forceinline__ void dropout_apply_tile(float (&x)[kM][kN][4], const KeepTile<kM, kN>& keep, float scale) {
#pragma unroll
  for (int mt = 0; mt < kM; ++mt)
#pragma unroll
    for (int nt = 0; nt < kN; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[mt][nt][e] = keep.kept(mt, nt, e) ? x[mt][nt][e] * scale : 0.f;
}

// Dropout of a warp's tile of C fragments in one step (the keep mask made and applied).
template <bool kTransposed, int kM, int kN>
__device__ __forceinline__ void dropout_tile(float (&x)[kM][kN][4], const DropoutKey& key, uint32_t head_slot,
                                             int row0, int col0, float scale) {
  KeepTile<kM, kN> keep;
  dropout_keep_tile<kTransposed>(keep, key, head_slot, row0, col0);
  dropout_apply_tile(x, keep, scale);
}

// One thread per element (a test op: the attention kernels draw once per eight elements). A
// template, as every kernel in a header is: the attention kernels include this file too.
template <typename Out>
__global__ void dropout_mask_kernel(const DropoutMaskParams p) {
  const int64_t n = p.heads_total * p.sq * p.sk;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t j = static_cast<uint32_t>(e % p.sk);
    const uint32_t i = static_cast<uint32_t>((e / p.sk) % p.sq);
    const uint32_t bh = static_cast<uint32_t>(e / (static_cast<int64_t>(p.sk) * p.sq));
    p.mask[e] = dropout_keeps_element(p.key, bh, i, j) ? 1 : 0;
  }
}

template <typename Out>
void run_dropout_mask(const DropoutMaskParams& p, cudaStream_t stream) {
  static_assert(sizeof(Out) == 1, "the mask is one byte per element");
  const int64_t n = p.heads_total * p.sq * p.sk;
  if (n == 0) return;
  const int64_t blocks = (n + 255) / 256;
  dropout_mask_kernel<Out><<<static_cast<unsigned>(blocks < 65536 ? blocks : 65536), 256, 0, stream>>>(p);
  check_launch("flash_dropout_mask");
}

#endif  // __CUDACC__

// csrc/instances/dropout_mask.cu
template <typename Out> void run_dropout_mask(const DropoutMaskParams& params, cudaStream_t stream);

}  // namespace flash_cuda
