// include/params.h — the plain parameter structs every flash_cuda kernel receives.
//
// No torch header here or in any kernel: the binding (csrc/api/flash_api.cpp) is the only
// file that sees tensors. It fills these structs (pointers, strides, sizes, scale,
// flags) and dispatches on dtype / head dim / arch. nvcc alone compiles every kernel.
//
// Layout convention, for every 4-d tensor X in [batch][head][row][dim] order:
//   element (b, h, i, d) lives at X + b*x_batch_stride + h*x_head_stride + i*x_row_stride + d
// i.e. the last dimension is always contiguous (stride 1) and every other stride is an
// element count (int64: offsets can pass 2^31).
#pragma once

#include <climits>
#include <cstdint>

#if defined(__CUDACC__)
#define FLASH_HOST_DEVICE __host__ __device__
#else
#define FLASH_HOST_DEVICE
#endif

namespace flash_cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Which kernel family runs the call (csrc/tiers/<family>/): the user's kernel= option, one id per
// name of flash_cuda.validation.KERNELS; the binding rejects any other id (resolve_tier).
enum class Tier : int {
  kAuto = 0,  // the binding picks: fp32 -> kSimt; fp16/bf16 -> kWgmma where it applies, else kMma
  kSimt = 1,  // fp32 on the CUDA cores (true fp32 FMA arithmetic): tiers/simt
  kMma = 2,   // fp16/bf16 on the tensor cores of every GPU (mma.sync, ldmatrix, cp.async): tiers/mma
  kWgmma = 3, // fp16/bf16 on Hopper (wgmma, TMA, swizzled shared memory), sm_90 only: tiers/wgmma
};

// Attention dropout (core/dropout.cuh; flash_cuda.reference, "Attention dropout"): an element of
// P is kept iff its 16-bit random number is below `threshold` and then scaled by `scale`.
// threshold 65536: no dropout. The (seed, offset) of the draws are values, or, where seed_ptr is
// set (the CUDA generator's state under graph capture; the backward reading the forward's
// record), read on the device: seed = *seed_ptr, offset = *offset_ptr + offset_extra. The
// forward writes the pair it used to rng_state (int64 [2]) for the backward.
struct DropoutParams {
  uint32_t threshold = 65536;
  float scale = 1.f;
  uint64_t seed = 0, offset = 0;
  const int64_t* seed_ptr = nullptr;
  const int64_t* offset_ptr = nullptr;
  uint64_t offset_extra = 0;
  int64_t* rng_state = nullptr;
};

struct FwdParams {
  // ---- inputs (element type given by `dtype`) ----
  const void* q = nullptr;  // [b][hq][sq][d]
  const void* k = nullptr;  // [b][hkv][sk][d]
  const void* v = nullptr;  // [b][hkv][sk][d]
  int64_t q_batch_stride = 0, q_head_stride = 0, q_row_stride = 0;
  int64_t k_batch_stride = 0, k_head_stride = 0, k_row_stride = 0;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;

  // ---- outputs ----
  void* o = nullptr;  // [b][hq][sq][d], dtype of q
  int64_t o_batch_stride = 0, o_head_stride = 0, o_row_stride = 0;
  // Log-sum-exp of the (modified) logits, natural log, float32. A row that sees no key gets -inf
  // (with sinks: its sink).
  // Row statistics (lse here; delta, the fp32 softmax stats and dq_accum rows in BwdParams) are
  // indexed by SeqInfo::stat_offset(h) + row (core/seqlen.cuh):
  //   dense  [b][hq][sq]:   stat_batch_stride = hq * sq, stat_head_stride = sq
  //   varlen [hq][total_q]: stat_batch_stride = 0,       stat_head_stride = total_q
  float* softmax_lse = nullptr;
  int64_t stat_batch_stride = 0, stat_head_stride = 0;
  // fp32 tier only (nullptr otherwise): the forward's own row max m (log2 units) and log2 of its
  // row sum l, two floats per row at 2 * (stat_offset + row); a row that saw no key stores
  // (+inf, 0). The backward recomputes P = 2^((s * scale_log2 - m) - log2 l) from them:
  // going through lse instead (m + log2 l rounded at the size of the logits) would put an
  // error of ulp(|m|) on every P of the row (tiers/simt/fwd.cuh: store_row_stats).
  float* softmax_stats = nullptr;

  // ---- sizes ----
  int b = 0;     // batch
  int hq = 0;    // query heads
  int hkv = 0;   // key/value heads; hq % hkv == 0, query head h reads kv head h / (hq/hkv)
  int sq = 0;    // query length  (>= 1 when a kernel is launched)
  int sk = 0;    // key length    (>= 1 when a kernel is launched)
  int d = 0;     // head dim: a multiple of 8 in [8, 256]

  // ---- softmax ----
  float scale = 0.f;       // multiplies q.k
  float scale_log2 = 0.f;  // scale * log2(e): kernels work with exp2

  // ---- masking and score modifiers (core/mask.cuh has the rule and its derivation) ----
  // Query i sees key j iff 0 <= j < sk and i + sk - sq - window_left <= j <= i + sk - sq +
  // window_right; -1 leaves a side unbounded. Causal is window_right = 0. A query row that sees
  // no key gets output 0 and lse -inf.
  int window_left = -1;
  int window_right = -1;
  // The same rule on the diagonal index j - i of a dense batch, diag_lo <= j - i <= diag_hi
  // (core/mask.cuh derives them; the binding fills them). Kernels of a dense batch read them
  // here, where they cost no register; a packed batch derives them per sequence.
  int diag_lo = INT_MIN;
  int diag_hi = INT_MAX;
  float softcap = 0.f;                  // logits = softcap * tanh(logits / softcap); 0: off
  const float* alibi_slopes = nullptr;  // logits -= slope[bi, h] * |i + sk - sq - j|; nullptr: off
  int64_t alibi_batch_stride = 0;       // 0 for slopes of shape (hq,), hq for (b, hq)
  // Attention sinks (gpt-oss): one logit per query head, [hq], in the units of the final logits
  // (scale * q.k after softcap and ALiBi, natural log; no mask hides it). Every row's softmax
  // gets exp(sinks[h]) as one more term with no value row, so lse includes it and a row that
  // sees no key gets O = 0 and lse = sinks[h]. Merged once per row into the finished statistics
  // (core/softmax.cuh: merge_sink; split pieces leave it to their merge). nullptr: off.
  const float* sinks = nullptr;

  // ---- variable-length (packed) batches: core/seqlen.cuh (nullptr: dense) ----
  // sq / sk above then hold max_seqlen_q / max_seqlen_k; total_q / total_k are the row counts
  // of the packed q and k / v tensors, the bounds every sequence is clamped to.
  const int32_t* cu_seqlens_q = nullptr;  // [b + 1]
  const int32_t* cu_seqlens_k = nullptr;  // [b + 1]
  int total_q = 0, total_k = 0;
  // Keys used per sequence, [b] (nullptr: all of them): sequence bi attends only its first
  // seqused_k[bi] keys (clamped to the ones it has), masks aligned bottom-right to that count.
  // A dense batch with it holds K / V of sk rows, the rows past each count are not read as keys
  // (a KV cache's prompt chunk: fwd_kvcache's prefill route, the counts computed on the device).
  // Served by the kExtended instances (variant_of).
  const int32_t* seqused_k = nullptr;

  // ---- split key ranges (fp32 forward: the last, partial wave; split-KV decode) ----
  // Query blocks from split_begin on (in the kernel's block order) are each cut into
  // num_splits key ranges; every range (a "piece") leaves its normalized O and its row
  // statistics (m, log2 l) in fp32 workspace, o_accum [piece][block rows][d] then stats_accum
  // [piece][block rows][2], and a merge kernel writes o, softmax_lse and softmax_stats.
  // The decode family splits every row's keys (split_begin = 0): o_accum [split][row][d] and
  // stats_accum [split][row][2] over the rows (bi, h, i) of lse's dense layout.
  // Off: num_splits = 1. The tier's plan function sets split_begin and num_splits and sizes the
  // workspace; the caller allocates it and sets o_accum; the launcher derives stats_accum.
  int num_splits = 1;
  int split_begin = INT_MAX;
  float* o_accum = nullptr;
  float* stats_accum = nullptr;

  // ---- KV cache and split-KV decode (tiers/mma/decode.cuh) ----
  // The decode family reads keys through these fields; the others leave them at their defaults.
  // k / v above are then the cache: dense [b][hkv][sk][d] with sk = its capacity S_max, or paged
  // [num_pages][hkv][page_size][d] (k_batch_stride is then the page stride) with sk = the
  // capacity of one sequence's block_table row (max_pages * page_size). Sequence bi holds
  // len_b = cache_seqlens[bi] (or cache_len for every bi when cache_seqlens is nullptr) tokens,
  // then the s_new rows of k_new / v_new ([b][hkv][s_new][d]), which the kernel also writes
  // into the cache at positions len_b .. len_b + s_new - 1; attention covers positions
  // 0 .. len_b + s_new - 1, masks bottom-right aligned to that length. Values from the device
  // are trusted but clamped (lengths to the capacity, page ids to [0, num_pages)): wrong ones
  // give wrong results, never an access outside the tensors.
  const int32_t* cache_seqlens = nullptr;
  int cache_len = 0;
  const int32_t* block_table = nullptr;  // [b][block_table_stride]: page ids; nullptr: dense cache
  int64_t block_table_stride = 0;
  int page_size = 0;
  int num_pages = 0;
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t knew_batch_stride = 0, knew_head_stride = 0, knew_row_stride = 0;
  int64_t vnew_batch_stride = 0, vnew_head_stride = 0, vnew_row_stride = 0;
  int s_new = 0;
  // Query heads per decode tile: hq / hkv (a KV group's heads packed with their Sq rows, so
  // that K and V are read once per group), or 1 (ALiBi: one slope per tile).
  int decode_heads = 1;
  // The caller's number of key ranges: 0 = the planner's choice (core/scheduler.cuh:
  // plan_key_splits), n >= 1 = n. The plan turns it into num_splits.
  int splits_wanted = 0;

  // ---- dispatch facts ----
  DType dtype = DType::kFloat16;
  int sm_arch = 0;  // e.g. 80, 90
  int num_sms = 0;
  // A zeroed int from which the CTAs of the warp-specialized Hopper forward draw their tiles
  // (dynamic persistent scheduling); nullptr: each CTA takes every gridDim.x-th tile.
  int* tile_counter = nullptr;
  // (batch, head) pairs per longest-first section of the persistent forward's tile order
  // (core/scheduler.cuh: tile_section, which its launcher sets; 1: one head after another).
  int tile_section = 1;

  DropoutParams dropout;

  // ---- FP8 KV cache (tiers/mma/decode.cuh: Fp8Config; after the other fields, which keep their
  // offsets) ----
  // k / v hold float8_e4m3fn values (1 byte each; the strides above count them), a stored value
  // x8 standing for x8 * descale; k_descale / v_descale: [b][hkv] float32. The new rows (k_new /
  // v_new, in q's dtype) are stored as e4m3(x / descale) and attended as stored.
  bool cache_fp8 = false;
  const float* k_descale = nullptr;
  const float* v_descale = nullptr;
  // ---- the FP8 forward (tiers/wgmma/fwd: WsConfig's kFp8): q, k e4m3 as above, v its V^T
  // (core/fp8_v_layout.cuh: [b][hkv][d][sk rounded up to 32], v_row_stride counting a head dim's
  // keys), o in the call's output type; q_descale, k_descale, v_descale [b][hkv] float32. ----
  const float* q_descale = nullptr;
};

struct BwdParams : FwdParams {
  // Upstream gradient of o, same layout rules, dtype of q.
  const void* dout = nullptr;
  int64_t do_batch_stride = 0, do_head_stride = 0, do_row_stride = 0;

  // Optional upstream gradient of lse, float32 contiguous [b][hq][sq] (nullptr: none).
  const float* dlse = nullptr;

  // Gradients, dtype of q; dk/dv are [b][hkv][sk][d] (summed over the query heads of a group).
  // nullptr: not wanted (autograd asked for no gradient of that input), and the family runs none
  // of its work: dq == nullptr skips the dQ kernel (and the dQ accumulation of the one-pass
  // kernels, which then do not run), dk == dv == nullptr the dK/dV kernel. dK and dV come from
  // the same products (dS^T and P^T of one pass), so they are wanted together: both set or both
  // nullptr (bwd_wants_dq / bwd_wants_dkdv below). At least one of dq, dk is set.
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  int64_t dq_batch_stride = 0, dq_head_stride = 0, dq_row_stride = 0;
  int64_t dk_batch_stride = 0, dk_head_stride = 0, dk_row_stride = 0;
  int64_t dv_batch_stride = 0, dv_head_stride = 0, dv_row_stride = 0;

  // Workspaces, allocated by the binding:
  //   delta    : float32 contiguous [b][hq][sq]; delta = rowsum(dO * O) - dlse
  //   dq_accum : float32, zero-filled by the binding (tiers/wgmma/family.h sizes it); the
  //              Hopper backward accumulates dQ there across key blocks, in query-block tiles
  //              (tiers/wgmma/bwd_ws.cuh: DqTile, tiers/wgmma/bwd_wide.cuh: WideDqTile), and
  //              converts it into dq itself.
  //   dkv_accum: float32, the fp32 dK/dV kernel's split key blocks (the FwdParams split fields
  //              num_splits / split_begin, planned by plan_bwd_simt): each piece, a range of
  //              query steps, leaves its dK in [piece][block rows][d], then all the pieces'
  //              dV in the same layout, and a kernel sums them in range order.
  float* delta = nullptr;
  float* dq_accum = nullptr;
  float* dkv_accum = nullptr;

  // true: no floating-point atomics anywhere, gradients are bitwise reproducible.
  bool deterministic = false;

  // The Hopper backward's kPlain kernels (tiers/wgmma/config.h: bwd_bulk_stats; nullptr
  // otherwise): float32 [b][hq][stats_rows][2], each query's (lse in log2 units, delta), rows
  // past sq zero; written by the delta preprocess, a query block's pairs copied by one bulk copy.
  float* bwd_stats = nullptr;
  int stats_rows = 0;
};

// Two partial results of the same query rows over disjoint key sets, merged by their row
// statistics into one (core/combine.cuh: merge_partials_kernel): the steps of context-parallel
// attention (flash_cuda.distributed), where each key block of the ring leaves a partial (O, lse).
// Every operand is a [batch][heads][rows][d] view of O with its own strides and element type, and
// the matching [batch][heads][rows] rows of lse (float32, row stride 1) and, where the fp32
// kernels' per-row (m, log2 l) pairs travel with it, of those pairs (stats, nullptr: none; pair
// strides). The output may be operand a itself (each row is read before it is written).
struct MergeOperand {
  void* o = nullptr;
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0;  // elements of O
  float* lse = nullptr;
  float* stats = nullptr;
  int64_t stat_batch_stride = 0, stat_head_stride = 0;  // rows of lse; pairs of stats
  DType dtype = DType::kFloat32;  // of O: a and out are float32 or the partials' type
};

struct MergeParams {
  MergeOperand a, b, out;
  int batch = 0, heads = 0, rows = 0;
  int d = 0;  // a multiple of 4
};

// A KV cache's keys laid out for the query-tiled forwards (core/kv_gather.cuh): with the cache
// fields of a FwdParams (k / v the cache, block_table, cache_seqlens, k_new / v_new), one kernel
// appends k_new / v_new to the cache in place, writes every sequence's key count len_b + s_new
// to key_counts[b] (the forward's seqused_k) and, when k is set, copies each sequence's keys
// 0 .. len_b + s_new - 1 into the dense [b][hkv][sk][d] tensors k / v (rows past the count up
// to the next multiple of kZeroRows are zeroed: a partial key block reads no stale value).
struct KvGatherTarget {
  void* k = nullptr;  // nullptr: no copy (a dense cache is read in place)
  void* v = nullptr;
  int64_t batch_stride = 0, head_stride = 0, row_stride = 0;  // elements, of both k and v
  int32_t* key_counts = nullptr;
};

// V of an FP8 (e4m3) forward laid out for its P V product (core/fp8_v_layout.cuh): vt[b][h][c][j]
// = v[b][h][key(j)][c] for keys below sk, where key(j) permutes each group of 32 keys
// (core/fragment.cuh: e4m3_pv_key), and 0 at the positions of keys sk .. sk_pad - 1. Bytes.
struct Fp8VLayoutParams {
  const void* v = nullptr;
  int64_t v_batch_stride = 0, v_head_stride = 0, v_row_stride = 0;  // elements (bytes)
  void* vt = nullptr;                                                 // contiguous [b][hkv][d][sk_pad]
  int b = 0, hkv = 0, sk = 0, d = 0, sk_pad = 0;                      // sk_pad: sk rounded up to 32
  // A packed batch (v (rows, hkv, d)): sequence bi's keys are rows cu_seqlens[bi] ..
  // cu_seqlens[bi + 1] - 1 (clamped to rows), laid out in slot bi of sk_pad keys; nullptr: dense.
  const int* cu_seqlens = nullptr;
  int rows = 0;
};

// Which gradients the call computes (BwdParams: dq / dk / dv nullptr = not wanted).
FLASH_HOST_DEVICE inline bool bwd_wants_dq(const BwdParams& p) { return p.dq != nullptr; }
FLASH_HOST_DEVICE inline bool bwd_wants_dkdv(const BwdParams& p) { return p.dk != nullptr; }
// Both: the one-pass kernels (dQ accumulated beside dK / dV) run only then; a call that wants one
// side runs the two-kernel paths' kernel of that side alone.
FLASH_HOST_DEVICE inline bool bwd_wants_all(const BwdParams& p) { return bwd_wants_dq(p) && bwd_wants_dkdv(p); }

// Dropout on P at all?
FLASH_HOST_DEVICE inline bool has_dropout(const FwdParams& p) { return p.dropout.threshold < 65536u; }

// Does the mask hide any key (causal or a window)?
FLASH_HOST_DEVICE inline bool masks_keys(const FwdParams& p) { return p.window_left >= 0 || p.window_right >= 0; }

// Any score modifier (softcap, ALiBi) at all?
FLASH_HOST_DEVICE inline bool has_score_mod(const FwdParams& p) {
  return p.softcap > 0.f || p.alibi_slopes != nullptr;
}

// Which per-call features a kernel instance handles: a template parameter (static switch), so
// that the plain kernels carry none of the others' registers. Causal and sliding windows are
// run-time values in every variant (they only move block ranges and the mask's diagonals).
//   kPlain       dense batch, no score modifier
//   kExtended    + packed (varlen) batches, ALiBi, softcap, dropout (the mma.sync family)
//   kSoftcapGrad kExtended + softcap's derivative, which the mma.sync backward keeps in one more
//                tile (the warp-specialized Hopper one, short of registers, in 16-query slices)
enum Variant : int { kPlain = 0, kExtended = 1, kSoftcapGrad = 2 };

inline Variant variant_of(const FwdParams& p, bool backward) {
  if (p.cu_seqlens_q == nullptr && p.seqused_k == nullptr && !has_score_mod(p) && !has_dropout(p)) return kPlain;
  return backward && p.softcap > 0.f ? kSoftcapGrad : kExtended;
}

}  // namespace flash_cuda
