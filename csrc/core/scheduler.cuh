// core/scheduler.cuh — the order in which CTAs take their tiles: longest first where tiles
// differ in length, the tiles of one head adjacent so that they share its K / V in L2, a
// persistent loop drawing tiles from a counter, and GQA packing (the query heads of a KV group
// in one tile).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>

#include "../arch/host.h"
#include "../include/params.h"
#include "mask.cuh"

namespace flash_cuda {

// The L2 share the forward's tile order plans for (an H100 / H200 has 50 MB).
constexpr int64_t kL2Budget = int64_t(32) << 20;

#if defined(__CUDACC__)

// The tiles of a call and how persistent CTAs take them. Order: (batch, head) outer, query blocks
// inner, so the CTAs running at one time share a head's K and V in L2. With a bounded right side
// (causal, window) later query blocks see more keys, and the tiles go longest first over a
// section of `section` (batch, head) pairs whose K and V fit in L2 together (kL2Budget): query
// block m_blocks - 1 of every head of the section, then m_blocks - 2, ..., then the next section.
// The longest tiles of a section thus start first and its shortest end it, so the call's last
// tiles are short ones and the CTAs finish together (in a head-by-head order the last heads' long
// tiles come late and set the end). Each CTA starts
// with tile blockIdx.x; then, given a zeroed counter (FwdParams::tile_counter), it draws the next
// unclaimed tile (gridDim.x + counter++): the CTA that finishes first takes more. Without a
// counter it takes every gridDim.x-th tile. With one CTA per tile both are the plain grid.
// (FlashAttention-3's persistent scheduler orders causal tiles the same way, with 32 MB of L2.)
struct TileScheduler {
  int m_blocks, heads, batch;
  bool longest_first;
  int section;  // (batch, head) pairs per section when longest_first
  int* counter;
  struct Tile {
    int m_block, h, b;
  };
  __device__ __forceinline__ int total() const { return m_blocks * heads * batch; }
  // Unsigned divisions (t, m_blocks, heads, section > 0): fewer instructions and live registers
  // than signed ones, which a producer warp on few registers notices.
  __device__ __forceinline__ Tile at(int t) const {
    unsigned mi, bh;
    if (longest_first) {
      const unsigned per_section = unsigned(section) * unsigned(m_blocks);
      const unsigned first_bh = unsigned(t) / per_section * unsigned(section);
      const unsigned r = unsigned(t) % per_section;
      const unsigned pairs = min(unsigned(section), unsigned(heads * batch) - first_bh);  // the last may be short
      mi = unsigned(m_blocks) - 1u - r / pairs;
      bh = first_bh + r % pairs;
    } else {
      mi = unsigned(t) % unsigned(m_blocks);
      bh = unsigned(t) / unsigned(m_blocks);
    }
    return {int(mi), int(bh % unsigned(heads)), int(bh / unsigned(heads))};
  }
  // Longest first where a later query block sees more keys: a bounded right side (causal, or a
  // window's right edge), which every sequence of a packed batch shares with the call. Each role
  // of a warp-specialized kernel makes its own (after setmaxnreg): nothing computed before the
  // split stays live across it. kPackGqa: tiles of kBlockM >> shift queries of the 2^shift heads
  // of a KV group; Tile::h is then the KV head.
  // The section comes with the params (tile_section, from the launcher): a value the kernel reads
  // from its parameters, not one it computes and keeps in a register.
  template <int kBlockM, bool kPackGqa = false>
  __device__ __forceinline__ static TileScheduler of(const FwdParams& p, int shift = 0) {
    return {ceil_div(p.sq, kBlockM >> shift), kPackGqa ? p.hkv : p.hq, p.b, p.window_right >= 0, p.tile_section,
            p.tile_counter};
  }
  __device__ __forceinline__ int first() const { return blockIdx.x; }
  __device__ __forceinline__ int next(int t) const {
    return counter != nullptr ? static_cast<int>(gridDim.x) + atomicAdd(counter, 1) : t + static_cast<int>(gridDim.x);
  }
};

// log2 G, G = hq / hkv query heads per KV group (a power of two where packing runs).
__device__ __forceinline__ int gqa_shift(const FwdParams& p) {
  return __ffs(static_cast<int>(unsigned(p.hq) / unsigned(p.hkv))) - 1;
}

#endif  // __CUDACC__

// FwdParams::tile_section for a persistent forward whose tiles hold `group` query heads (GQA
// packing) or 1 and block_m query rows: the (batch, head) pairs whose K and V fit in kL2Budget
// together (a KV head's K and V, shared by the query heads of its group), at least 1, at most all
// of them; 1 (a head after another) below kMinSectionBlocks query blocks, where the tail the
// head order leaves is short and CTAs in flight together gain more from reading the same head's
// K and V (sections measured -3..-9% at S = 1k / 2k, +2..+5% from 32 query blocks on:
// OPTIMIZATION.md, "Longest first across heads").
constexpr int kMinSectionBlocks = 32;
inline int tile_section(const FwdParams& p, int group, int block_m) {
  if (ceil_div(p.sq, block_m) < kMinSectionBlocks) return 1;
  const int64_t pairs = int64_t(p.hq / group) * p.b;
  const int64_t elem_bytes = p.q_descale != nullptr ? 1 : 2;  // e4m3 K and V (the FP8 forward), else 16-bit
  const int64_t kv_bytes = 2 * elem_bytes * p.sk * p.d * group / (p.hkv > 0 ? p.hq / p.hkv : 1);
  const int64_t fit = kv_bytes > 0 ? kL2Budget / kv_bytes : pairs;
  return static_cast<int>(std::max<int64_t>(1, std::min(fit, pairs)));
}

// The section of the backward's longest-first key blocks (key_block_longest_first): the
// (KV head, batch) pairs whose queries' Q and dO (the group's query heads) fit in kL2Budget
// together, at most kMaxKeySection, at least 1 (one pair after another, the plain grid's order).
// Longer sections let the long CTAs of more pairs start before any short one, which a GQA call,
// whose CTAs walk a group of query heads, needs; past L2 the CTAs in flight read too many pairs'
// Q and dO.
constexpr int kMaxKeySection = 8;
inline int key_section(const FwdParams& p) {
  const int64_t pairs = int64_t(p.hkv) * p.b;
  const int64_t q_do_bytes = int64_t(4) * p.sq * p.d * (p.hkv > 0 ? p.hq / p.hkv : 1);
  const int64_t fit = q_do_bytes > 0 ? kL2Budget / q_do_bytes : pairs;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({fit, pairs, kMaxKeySection})));
}

// The CTAs of a persistent launch over `tiles` tiles: one per SM (each fits one CTA per SM), or
// one per tile when `persistent` is off; 0 when the tile loop's numbers would not fit an int.
inline int persistent_grid(int64_t tiles, int num_sms, bool persistent) {
  if (tiles > INT32_MAX / 2) return 0;  // the tile loop steps t past the last tile
  return persistent && num_sms > 0 ? static_cast<int>(std::min<int64_t>(tiles, num_sms)) : static_cast<int>(tiles);
}

// ---------------------------------------------------------------------------------
// A 1-D grid of one CTA per block (the fp32 kernels): the order of its blocks, and the split of
// its last wave.
// ---------------------------------------------------------------------------------

// Whether a launch orders its blocks longest first: with a right-bounded mask (causal, or a
// window with a right side) later query blocks see more keys, and earlier key blocks are seen by
// more queries. Decided from the launch's parameters (for varlen, max_seqlen_q / k): a block
// needs its place in the order before it knows its sequence.
FLASH_HOST_DEVICE inline bool longest_first(const FwdParams& p) {
  return AttnMask::make(p.sq, p.sk, p.window_left, p.window_right).right_bounded();
}

#if defined(__CUDACC__)

// Grid order of the kernels whose CTA owns a block of query rows (forward, dQ, the merge of
// split blocks). The grid is 1-D (batch * heads * blocks can pass 65535). With a right-bounded
// mask the late query blocks see the most keys: they get the low block indices so the GPU
// starts them first and the short blocks fill the tail. Otherwise every block costs about the
// same, and the blocks of one (batch, head) are kept adjacent so they share its K/V in L2.
// `idx` is the block's place in that order (blockIdx.x unless the grid also runs pieces of
// blocks).
__device__ __forceinline__ void query_block_order(int idx, int num_m_blocks, int bh_count,
                                                  bool longest_first, int& m_block, int& bh) {
  if (longest_first) {
    m_block = num_m_blocks - 1 - idx / bh_count;
    bh = idx % bh_count;
  } else {
    bh = idx / num_m_blocks;
    m_block = idx % num_m_blocks;
  }
}

// Longest first for the kernels whose CTA owns a block of keys (the Hopper backward: a grid of
// key blocks by (head, batch) pairs, launched pair by pair). Under a right-bounded mask the early
// key blocks are seen by the most queries, so longest first is ascending key blocks, across a
// section of `section` pairs (the forward's sections, mirrored): key block 0 of every pair of the
// section, then key block 1, ..., then the next section. `idx` is the CTA's linear index in the
// grid of n_blocks x pair_count; section >= 1.
__device__ __forceinline__ void key_block_longest_first(int idx, int n_blocks, int pair_count, int section,
                                                        int& n_block, int& pair) {
  const unsigned per_section = unsigned(section) * unsigned(n_blocks);
  const unsigned first = unsigned(idx) / per_section * unsigned(section);
  const unsigned r = unsigned(idx) % per_section;
  const unsigned pairs = min(unsigned(section), unsigned(pair_count) - first);  // the last may be short
  n_block = int(r / pairs);
  pair = int(first + r % pairs);
}

#endif  // __CUDACC__

// Splitting the last wave (host). A kernel that runs one CTA per slot (one or two per SM), and
// whose blocks cost the same without masking: with num_blocks = W * slots + T (0 < T < slots)
// the GPU runs W full waves and then T blocks while slots - T slots idle (the fp32 forward's
// 2048 query blocks on 132 SMs: T = 68, half a wave, ~3% of the run; the fp32 backward's 4096
// key blocks: T = 4, a whole extra CTA time for 4 blocks). The last T blocks are cut into s
// ranges of their steps each (s * T pieces of about 1/s the work: key blocks of a query block in
// the forward, query blocks of a key block in the backward), and a small kernel merges the
// ranges (core/combine.cuh for the forward). s is chosen with a cost model in units of one step:
// a piece costs ceil(n / s) steps plus kPieceOverhead (its prologue and partial output), the
// pieces run in ceil(s T / slots) rounds, and the merge costs kMergeCost. Under a causal mask or
// a window blocks differ in cost (and causal ones go longest first, so the hardware scheduler
// already packs the tail with the shortest ones), and varlen sequences differ in length: the
// model does not hold, no split there (split_allowed). Softcap and ALiBi are not split either:
// those calls run the kExtended kernels, which the plan does not model.
struct SplitPlan {
  int split_begin;  // first split block (num_blocks: none)
  int num_splits;   // step ranges per split block (1: none)
};

inline SplitPlan plan_tail_split(int num_blocks, int n_steps, int slots) {
  constexpr double kPieceOverhead = 0.25, kMergeCost = 1.0;
  constexpr int kMaxSplits = 8;
  SplitPlan plan{num_blocks, 1};
  if (slots <= 0 || n_steps < 2) return plan;
  const int tail = num_blocks % slots;
  if (tail == 0) return plan;
  double best = n_steps + kPieceOverhead;  // the unsplit tail: one round of whole blocks
  for (int s = 2; s <= std::min(kMaxSplits, n_steps); ++s) {
    const int64_t rounds = (static_cast<int64_t>(tail) * s + slots - 1) / slots;
    const double cost = static_cast<double>(rounds) * (ceil_div(n_steps, s) + kPieceOverhead) +
                        kMergeCost;
    if (cost < best) {
      best = cost;
      plan = SplitPlan{num_blocks - tail, s};
    }
  }
  return plan;
}

// Split-KV ("flash-decoding", tiers/mma/decode.cuh): a launch of `ctas` CTAs per key range,
// each of up to n_blocks steps of block_n keys (from the shapes alone: the cache's capacity,
// never the lengths in it, so that one plan serves every step of a captured decode loop). Every
// row's keys are cut into s ranges, each keeping at least kMinKeysPerSplit keys (a range also
// pays a prologue, a partial output and its share of the merge):
//   * fewer CTAs than the GPU's slots (num_sms * ctas_per_sm): s = slots / ctas, one full wave.
//     A few CTAs per SM cannot reach the memory's speed alone: the split is what lets B = 1 with
//     8 KV heads stream a long cache at full bandwidth;
//   * more, for a launch of one row chunk per KV group (`rows_fit`: decode, not prefill, whose
//     many row chunks would each repeat a split's prologue and merge): the s <= kMaxWaveSplits
//     whose waves ceil(s ctas / slots) / s per unit of work are fewest, which shrinks a partial
//     last wave (512 CTAs on 396 slots run 2 waves for 1.3 of work; cut in 3 they run 4 for 3.9).
inline int plan_key_splits(int64_t ctas, int n_blocks, int block_n, int num_sms, int ctas_per_sm, bool rows_fit) {
  constexpr int kMinKeysPerSplit = 256, kMaxSplits = 128, kMaxWaveSplits = 4;
  const int64_t slots = static_cast<int64_t>(num_sms) * std::max(ctas_per_sm, 1);
  const int64_t by_keys = std::max<int64_t>(int64_t(n_blocks) * block_n / kMinKeysPerSplit, 1);
  if (ctas <= 0 || slots <= 0) return 1;
  if (ctas < slots) {
    return static_cast<int>(std::min<int64_t>({std::max<int64_t>(slots / ctas, 1), by_keys, kMaxSplits}));
  }
  if (!rows_fit) return 1;
  int best = 1;
  double best_waves = static_cast<double>((ctas + slots - 1) / slots);
  for (int s = 2; s <= std::min<int64_t>(kMaxWaveSplits, by_keys); ++s) {
    const double waves = static_cast<double>((ctas * s + slots - 1) / slots) / s;
    if (waves < best_waves - 1e-9) {
      best = s;
      best_waves = waves;
    }
  }
  return best;
}

// Only the plain dense case splits: no window (causal included), no softcap or ALiBi, no
// packed batch.
inline bool split_allowed(const FwdParams& p) {
  return !masks_keys(p) && variant_of(p, false) == kPlain;
}

// plan_tail_split for one launch of `kernel` (num_blocks CTAs of n_steps steps each, where
// split_allowed): its slots come from the occupancy the device gives it. Sets p.split_begin and
// p.num_splits (none: INT_MAX and 1) and returns the number of split pieces (0: none).
template <typename Kernel>
int64_t plan_launch_split(FwdParams& p, Kernel kernel, int threads, size_t smem,
                          int64_t num_blocks, int n_steps, const char* name) {
  p.split_begin = INT_MAX;
  p.num_splits = 1;
  if (!split_allowed(p) || num_blocks <= 0 || num_blocks > 0x7fffffffLL) return 0;
  set_smem_limit(kernel, smem, name);
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const SplitPlan plan = plan_tail_split(static_cast<int>(num_blocks), n_steps, p.num_sms * per_sm);
  if (plan.num_splits == 1) return 0;
  p.split_begin = plan.split_begin;
  p.num_splits = plan.num_splits;
  return (num_blocks - plan.split_begin) * plan.num_splits;
}

}  // namespace flash_cuda
