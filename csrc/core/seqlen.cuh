// core/seqlen.cuh — where the rows of one batch entry live, for dense and packed (varlen) batches.
//
// Dense:  q is [b][hq][sq][d]: sequence bi starts at row 0 of batch bi (q_batch_stride apart).
// Varlen: q is [total_q][hq][d] with q_batch_stride = 0: sequence bi owns rows
//         cu_seqlens_q[bi] .. cu_seqlens_q[bi + 1] (likewise k, v with cu_seqlens_k), and
//         params.sq / params.sk hold max_seqlen_q / max_seqlen_k (the grid is sized by them).
// Either way a row i of sequence bi, head h is at
//     base + bi * batch_stride + h * head_stride + (q_start + i) * row_stride,
// and its row statistics (lse, delta, the fp32 softmax stats) at
//     stat_offset(h) + i = bi * stat_batch_stride + h * stat_head_stride + q_start + i.
//
// cu_seqlens values are trusted for correctness, not for memory safety: each sequence is
// clamped to the rows the tensors have and to max_seqlen, so wrong values give wrong results
// but never an access outside q, k, v, o or the statistics.
#pragma once

#include <cstdint>

#include "../include/params.h"
#include "mask.cuh"

namespace flash_cuda {

// 32-bit fields on purpose: the backward kernels keep a SeqInfo live next to 255 registers of
// accumulators (row counts are < 2^31; 64-bit products are formed where an address is).
struct SeqInfo {
  int bi;                // batch entry
  int sq, sk;            // this sequence's lengths (<= params.sq / params.sk)
  int q_start, k_start;  // first row in the packed tensors (0 when dense)

  // kVarlen = false (a kPlain kernel): dense for sure, every field a constant or a parameter.
  template <bool kVarlen = true>
  FLASH_HOST_DEVICE static SeqInfo make(const FwdParams& p, int bi) {
    SeqInfo s;
    s.bi = bi;
    if (!kVarlen || p.cu_seqlens_q == nullptr) {
      s.sq = p.sq;
      s.sk = p.sk;
      s.q_start = 0;
      s.k_start = 0;
    } else {
      const int q0 = clamp_to_int(p.cu_seqlens_q[bi], 0, p.total_q);
      const int q1 = clamp_to_int(p.cu_seqlens_q[bi + 1], q0, p.total_q);
      const int k0 = clamp_to_int(p.cu_seqlens_k[bi], 0, p.total_k);
      const int k1 = clamp_to_int(p.cu_seqlens_k[bi + 1], k0, p.total_k);
      s.sq = q1 - q0 < p.sq ? q1 - q0 : p.sq;
      s.sk = k1 - k0 < p.sk ? k1 - k0 : p.sk;
      s.q_start = q0;
      s.k_start = k0;
    }
    if (kVarlen && p.seqused_k != nullptr) s.sk = clamp_to_int(p.seqused_k[bi], 0, s.sk);
    return s;
  }

  FLASH_HOST_DEVICE int64_t stat_offset(const FwdParams& p, int h) const {
    return static_cast<int64_t>(bi) * p.stat_batch_stride + static_cast<int64_t>(h) * p.stat_head_stride + q_start;
  }

  // Row 0 of this sequence for head h of a [batch][head][row] tensor.
  template <typename T>
  FLASH_HOST_DEVICE T* q_rows(T* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride,
                              int h) const {
    return base + bi * batch_stride + h * head_stride + static_cast<int64_t>(q_start) * row_stride;
  }
  template <typename T>
  FLASH_HOST_DEVICE T* k_rows(T* base, int64_t batch_stride, int64_t head_stride, int64_t row_stride,
                              int h) const {
    return base + bi * batch_stride + h * head_stride + static_cast<int64_t>(k_start) * row_stride;
  }

  template <bool kVarlen = true>
  FLASH_HOST_DEVICE AttnMask mask(const FwdParams& p) const {
    if (kVarlen && (p.cu_seqlens_q != nullptr || p.seqused_k != nullptr)) {
      return AttnMask::make(sq, sk, p.window_left, p.window_right);  // this sequence's own lengths
    }
    return AttnMask{sq, sk, p.diag_lo, p.diag_hi};
  }
  // The modifiers of head h; the inactive default for a kPlain kernel (folds away).
  // kOpaqueSoftcap: ScoreMod::make's.
  template <bool kModded = true, bool kOpaqueSoftcap = false>
  FLASH_HOST_DEVICE ScoreMod score_mod(const FwdParams& p, int h) const {
    return kModded ? ScoreMod::make<kOpaqueSoftcap>(p, bi, h, sk - sq) : ScoreMod{};
  }
};

// The rows of the row statistics (lse) of a call: dense b * hq * sq, packed hq * total_q.
FLASH_HOST_DEVICE inline int64_t decode_stat_rows(const FwdParams& p) {
  return p.cu_seqlens_q != nullptr ? static_cast<int64_t>(p.hq) * p.total_q : static_cast<int64_t>(p.b) * p.hq * p.sq;
}

// ---------------------------------------------------------------------------------
// A KV cache (FwdParams' KV-cache fields): the tokens a sequence already holds, the keys a call
// attends, and where a key position lives in a dense or a paged cache.
// ---------------------------------------------------------------------------------
#if defined(__CUDACC__)
// The page holding position pos of sequence bi in a paged cache: its id from the block table,
// clamped to the pool (ids from the device are trusted but never used to leave the tensors).
__device__ __forceinline__ int cache_page(const FwdParams& p, int bi, int pos) {
  return min(max(p.block_table[bi * p.block_table_stride + pos / p.page_size], 0), p.num_pages - 1);
}

// Where key position `pos` of sequence bi, KV head h lives in the cache (a row of d elements).
template <typename T>
__device__ __forceinline__ T* cache_row(const FwdParams& p, T* base, int64_t batch_stride, int64_t head_stride,
                                        int64_t row_stride, int bi, int h, int pos) {
  if (p.block_table == nullptr) {  // (a packed batch passes pos counted from its first row)
    return base + bi * batch_stride + h * head_stride + static_cast<int64_t>(pos) * row_stride;
  }
  const int page = cache_page(p, bi, pos);
  return base + page * batch_stride + h * head_stride + static_cast<int64_t>(pos % p.page_size) * row_stride;
}

// What a decode CTA knows about its sequence: its queries, the tokens already cached, and the
// keys attended. A packed batch (varlen_attention's decode-shaped calls) has no cache: sequence
// bi's keys are its rows of the packed k / v, all of them "cached", its queries its rows of q.
struct CacheSeq {
  int sq;       // this sequence's queries
  int len;      // tokens cached before this call (len_b)
  int total;    // len + s_new: the keys attended
  int q_start;  // first row of q / o (packed batch; 0 when dense)
  int k_start;  // first row of k / v (packed batch; 0 when dense)
  __device__ __forceinline__ static CacheSeq make(const FwdParams& p, int bi) {
    if (p.cu_seqlens_q != nullptr) {
      const SeqInfo seq = SeqInfo::make<true>(p, bi);
      return {seq.sq, seq.sk, seq.sk, seq.q_start, seq.k_start};
    }
    const int cached = p.cache_seqlens != nullptr ? p.cache_seqlens[bi] : p.cache_len;
    const int len = min(max(cached, 0), p.sk - p.s_new);
    return {p.sq, len, len + p.s_new, 0, 0};
  }
  // Row statistics' index of query i of head h (lse; the split pieces' rows): dense [b][hq][sq],
  // packed [hq][total_q].
  __device__ __forceinline__ int64_t stat_row(const FwdParams& p, int bi, int h, int i) const {
    return static_cast<int64_t>(bi) * p.stat_batch_stride + static_cast<int64_t>(h) * p.stat_head_stride + q_start + i;
  }
};

#endif  // __CUDACC__

}  // namespace flash_cuda
