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
    if (kVarlen && p.cu_seqlens_q != nullptr) return AttnMask::make(sq, sk, p.window_left, p.window_right);
    return AttnMask{sq, sk, p.diag_lo, p.diag_hi};
  }
  // The modifiers of head h; the inactive default for a kPlain kernel (folds away).
  // kOpaqueSoftcap: ScoreMod::make's.
  template <bool kModded = true, bool kOpaqueSoftcap = false>
  FLASH_HOST_DEVICE ScoreMod score_mod(const FwdParams& p, int h) const {
    return kModded ? ScoreMod::make<kOpaqueSoftcap>(p, bi, h, sk - sq) : ScoreMod{};
  }
};

}  // namespace flash_cuda
