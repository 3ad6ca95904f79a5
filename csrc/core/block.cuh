// core/block.cuh — the plan of one work item: which blocks of the other operand it visits,
// which of them need the per-element mask, and in which order a plain grid's CTAs take their
// query blocks. Every kernel asks these questions here; the answers follow from the sequence's
// lengths and its mask (core/seqlen.cuh, core/mask.cuh).
//   * a query tile (forward, dQ): its first query, its rows, the key blocks its queries see
//     (QueryTilePlan; BlockRange::keys_of);
//   * a key tile (dK/dV): the (query head, query block) steps of its KV group whose queries
//     see its keys (KeyTileSteps; BlockRange::queries_of);
//   * a (rows x keys) tile: any pair visible at all (AttnMask::any_visible), and whether it
//     needs the per-element test (AttnMask::needs_mask); for a walk over query blocks, the
//     same two as block ranges (BlockRange::visible_queries, unmasked_queries).
#pragma once

#include "../include/params.h"
#include "mask.cuh"
#include "seqlen.cuh"

namespace flash_cuda {

// Block-index ranges derived from AttnMask, for a kernel that walks key blocks of kBlockN for a
// query block [r0, r1) (forward, dQ), or query blocks of kBlockM for a key block (dK/dV).
struct BlockRange {
  int begin, end;  // block indices [begin, end); empty when begin >= end
  FLASH_HOST_DEVICE int count() const { return end > begin ? end - begin : 0; }

  FLASH_HOST_DEVICE static BlockRange keys_of(const AttnMask& m, int r0, int r1, int block_n) {
    const int kb = m.key_begin(r0), ke = m.key_end(r1);
    return {kb / block_n, ke > kb ? (ke + block_n - 1) / block_n : kb / block_n};
  }
  FLASH_HOST_DEVICE static BlockRange queries_of(const AttnMask& m, int c0, int c1, int block_m) {
    const int qb = m.query_begin(c0), qe = m.query_end(c1);
    return {qb / block_m, qe > qb ? (qe + block_m - 1) / block_m : qb / block_m};
  }
  FLASH_HOST_DEVICE bool contains(int b) const { return b >= begin && b < end; }

  // The two questions of a (query block x keys [c0, c1)) tile as ranges of query blocks of
  // block_m, for a kernel that asks them of every block of a walk: the range once, then two
  // compares per block instead of AttnMask's 64-bit sums.
  // The blocks for which AttnMask::any_visible holds: queries_of where the keys start inside
  // the sequence (past its end no query sees them, which queries_of alone would not say).
  FLASH_HOST_DEVICE static BlockRange visible_queries(const AttnMask& m, int c0, int c1, int block_m) {
    return c0 < m.sk && c0 < c1 ? queries_of(m, c0, c1, block_m) : BlockRange{0, 0};
  }
  // The blocks for which AttnMask::needs_mask is false: block b needs (b + 1) block_m <= sq,
  // c1 <= sk, (c1 - 1) - b block_m <= diag_hi and c0 - ((b + 1) block_m - 1) >= diag_lo, an
  // interval of b (in 64 bits: a diagonal may be INT_MIN or INT_MAX).
  FLASH_HOST_DEVICE static BlockRange unmasked_queries(const AttnMask& m, int c0, int c1, int block_m) {
    if (c1 > m.sk) return {0, 0};
    const int64_t lo = static_cast<int64_t>(c1) - 1 - m.diag_hi;  // b block_m >= lo
    const int64_t hi = static_cast<int64_t>(c0) + 1 - m.diag_lo;  // (b + 1) block_m <= hi
    return {lo > 0 ? clamp_to_int((lo + block_m - 1) / block_m, 0, INT_MAX) : 0,
            hi > 0 ? clamp_to_int(hi / block_m, 0, m.sq / block_m) : 0};
  }
};

#if defined(__CUDACC__)

// The query block of a CTA in a grid of one CTA per query block (blockIdx.x): with a bounded
// right side (causal, window) late query blocks see the most keys, so they are launched first
// and the short ones fill the tail.
__device__ __forceinline__ int query_block_of_cta(const AttnMask& mask) {
  return mask.right_bounded() ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
}

// What one query tile of kBlockM rows covers: its sequence (kVarlen = false: a dense batch,
// every field a constant or a parameter), that sequence's mask, the tile's first query, how many
// of its rows hold one of the sequence's queries, and the key blocks of kBlockN those queries
// see. In a packed batch a scheduler counts max_seqlen_q's query blocks for every sequence, so a
// tile may start past its sequence's end: rows_valid <= 0, no keys. shift: log2 of the query
// heads a tile packs (GQA packing; 0: one head per tile, row i is query q0 + i).
template <int kBlockM, int kBlockN, bool kVarlen>
struct QueryTilePlan {
  SeqInfo seq;
  AttnMask mask;
  int q0, rows_valid;
  BlockRange range;
  __device__ __forceinline__ static QueryTilePlan make(const FwdParams& p, int bi, int m_block, int shift = 0) {
    QueryTilePlan w;
    w.seq = SeqInfo::make<kVarlen>(p, bi);
    w.mask = w.seq.template mask<kVarlen>(p);
    w.q0 = m_block * (kBlockM >> shift);
    const int queries = min(kBlockM >> shift, w.seq.sq - w.q0);
    w.rows_valid = queries * (1 << shift);  // (a multiplication: queries may be < 0 in a packed batch)
    // (A dense batch's tiles all have rows: the scheduler counts exactly its query blocks.)
    w.range = !kVarlen || queries > 0 ? BlockRange::keys_of(w.mask, w.q0, w.q0 + queries, kBlockN)
                                      : BlockRange{0, 0};
    return w;
  }
};

// The (query head, query block) pairs a key tile walks, the query heads of its KV group outer:
// step i is query block m_block(i) of head head(i).
struct KeyTileSteps {
  BlockRange m_range;
  int h_begin, h_end;
  int count;  // m_range.count() * (h_end - h_begin), 0 when the keys start past the sequence
  __device__ __forceinline__ static KeyTileSteps make(const AttnMask& mask, int n0, int block_n, int block_m, int hkv,
                                             int group) {
    KeyTileSteps st;
    st.m_range = BlockRange::queries_of(mask, n0, n0 + block_n, block_m);
    st.h_begin = hkv * group;
    st.h_end = st.h_begin + group;
    // Keys starting past the sequence (a packed batch's shorter sequences): no step, no load; the
    // query range alone would not say so (without a left bound every query "sees" key n0).
    st.count = n0 < mask.sk ? st.m_range.count() * group : 0;
    return st;
  }
  __device__ __forceinline__ int head(int i) const { return h_begin + i / m_range.count(); }
  // The step after (h, m_block), walked without a division; false when none is left.
  __device__ __forceinline__ static bool next(const BlockRange& m_range, int h_end, int& h, int& m_block) {
    if (++m_block == m_range.end) {
      m_block = m_range.begin;
      ++h;
    }
    return h < h_end;
  }
  __device__ __forceinline__ int m_block(int i) const { return m_range.begin + i % m_range.count(); }
  // A ring of `stages` buffers: step i uses stage i % stages, in that stage's pass (i / stages),
  // whose parity its barriers' phases alternate by.
  __device__ __forceinline__ static int stage(int i, int stages) { return i % stages; }
  __device__ __forceinline__ static int parity(int i, int stages) { return (i / stages) & 1; }
};

#endif  // __CUDACC__

}  // namespace flash_cuda
