"""The executable specification of flash_cuda, in plain PyTorch (any device, any dtype).

Semantics shared by every function here and by the CUDA kernels:

* q is (B, Hq, Sq, D); k and v are (B, Hkv, Sk, D) with Hq % Hkv == 0; query head h uses
  key/value head h // (Hq // Hkv) (grouped-query attention).
* Positions are bottom-right aligned: query i sits at key position i + Sk - Sq (its
  "diagonal"), so the last query lines up with the last key.
* Logits, in this order (:func:`attention_naive` is the plain statement of it):

  1. x_ij = scale * q_i . k_j, scale defaulting to 1 / sqrt(D);
  2. softcap > 0: x_ij = softcap * tanh(x_ij / softcap);
  3. ALiBi slopes given: x_ij -= slope[b, h] * |i + Sk - Sq - j|;
  4. the mask: query i sees key j iff 0 <= j < Sk and
     i + Sk - Sq - window_left <= j <= i + Sk - Sq + window_right (:func:`key_visible`),
     a window side of -1 being unbounded. is_causal means window_right = 0.

* lse_i = log(sum over visible j of exp(x_ij)) (natural log). A row that sees no key has
  output 0 and lse = -inf, never NaN; it contributes nothing to any gradient.
* Dropout (``dropout_p`` > 0): the probabilities exp(x_ij - lse_i) are multiplied by a
  keep mask and the inverse of the keep rate before the product with V; lse is unchanged.
  The mask comes from counter-based random numbers that the kernels draw alike
  (:func:`dropout_keep_mask`, the section "Attention dropout").
* Variable-length (packed) batches: q is (total_q, Hq, D), k and v (total_k, Hkv, D);
  sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:
  cu_seqlens_k[b+1] of k / v and is attended exactly like a dense batch entry of those
  lengths (its own bottom-right alignment, its own ALiBi slopes row when the slopes are
  (B, Hq)). lse is (Hq, total_q).
* Attention sinks (``sinks``: one logit per query head, (Hq,), float32 for the kernels):
  row i of head h takes its softmax over its visible logits and one more, the sink s_h,
  which has no value row: lse_i = log(exp(s_h) + sum over visible j of exp(x_ij)),
  p_ij = exp(x_ij - lse_i), out_i = sum_j p_ij v_j; the sink's share exp(s_h - lse_i)
  multiplies nothing. s_h is a logit in the units of step 4's x_ij (as gpt-oss defines
  it: it joins scale * q.k after the scale), so the scale, softcap and ALiBi do not apply
  to it, and no mask hides it: a row that sees no key has out 0 and lse = s_h. The query
  heads of a GQA group have their own sinks. Dropout acts on the p_ij as before (the
  sink has no value to drop; lse is unchanged by dropout). s_h = -inf is no sink (the
  results are those without one), and every -inf sink gets the gradient 0. The gradient:
  d s_h = -sum over the rows of head h of exp(s_h - lse_i) * delta_i, with the backward's
  delta_i = rowsum(dO_i * O_i) - dlse_i; dq, dk, dv keep their formulas, with the lse
  that includes the sink.

Implementations:

* :func:`attention_naive` materialises the logits in the inputs' dtype. Run on float64
  copies it is the ground truth of the tests; run in the inputs' own dtype it is the
  "naive attention in the same precision" whose error sets the tolerance of the kernels.
* :func:`attention_forward_blocked` is the kernels' forward algorithm step by step: query
  blocks of ``block_m`` rows, key/value blocks of ``block_n`` rows, online softmax in the
  log2 domain, skipping of the key blocks outside the window (causal included), the mask
  only on blocks that cut the window or the keys' end, and the same four steps under the
  same names as the ``__device__`` functions (compute_qk_scores_and_max,
  merge_block_stats, compute_block_softmax_and_weighted_v, normalize_output).
* :func:`attention_backward_blocked` is the FlashAttention-2 backward the kernels use:
  the delta preprocess, dK/dV per key/value block (looping over the query blocks that
  can see it and over the query heads of a GQA group), dQ per query block; with softcap,
  dS is multiplied by the derivative of the cap, 1 - tanh^2.
* :func:`attention_varlen_naive`, :func:`attention_varlen_forward_blocked` and
  :func:`attention_varlen_backward_blocked`: the packed layout, one sequence at a time.
* FP8 (e4m3), forward only (the section "FP8 (e4m3)" says what is rounded where):
  :func:`attention_fp8_forward_blocked` (and its packed form) is the kernels' FP8 forward,
  the blocked loop above with q, k, v in float8_e4m3fn and float32 descales (stored value
  times descale = real value), P = exp2(S - (m - 8)) rounded to e4m3 for P @ V;
  :func:`attention_fp8_naive` (and its packed form) is the naive FP8 attention whose error
  against float64 on the dequantized inputs sets the tolerance;
  :func:`attention_with_kvcache_fp8_reference` is the KV cache over e4m3 caches with 16-bit
  queries; :func:`quantize_e4m3`, :func:`dequantize_e4m3`, :func:`e4m3_round` and
  :func:`fp8_descale` are the quantization and descale rules.

Every (batch, head) pair runs the same block loop, so the blocked functions vectorise
over batch and heads and loop in Python only over blocks.
"""

from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "attention_naive",
    "attention_forward_blocked",
    "attention_backward_blocked",
    "attention_varlen_naive",
    "attention_varlen_forward_blocked",
    "attention_varlen_backward_blocked",
    "compute_qk_scores_and_max",
    "merge_block_stats",
    "compute_block_softmax_and_weighted_v",
    "normalize_output",
    "normalize_window",
    "key_visible",
    "causal_visible",
    "alibi_bias",
    "philox4x32_10",
    "dropout_keep_threshold",
    "dropout_scale",
    "dropout_random16",
    "dropout_keep_mask",
    "dropout_keep_masks_varlen",
]

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
LN2 = 0.6931471805599453  # ln(2):   log(x) = log2(x) * ln(2)
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def _sizes(q: Tensor, k: Tensor, v: Tensor):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D: (batch, heads, seqlen, head_dim)")
    B, Hq, Sq, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    if k.shape != v.shape or Bk != B or Dk != D:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    return B, Hq, Hkv, Sq, Sk, D


def _default_scale(scale: Optional[float], head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _forward_setup(q: Tensor, scale: Optional[float], is_causal: bool, window_size,
                   Hkv: int) -> Tuple[float, int, int, torch.dtype, int]:
    """What every forward derives from its options: (scale * log2 e, the window's left and
    right sides, the accumulation dtype, query heads per KV head)."""
    scale_log2 = _default_scale(scale, q.shape[-1]) * LOG2E
    wl, wr = normalize_window(is_causal, window_size)
    return scale_log2, wl, wr, _acc_dtype(q.dtype), q.shape[1] // Hkv


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the kernels: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _round_like_kernel(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Operands that the tensor-core kernels feed to an MMA are rounded to the 16-bit input
    dtype (P before P @ V, dS before dS @ K); fp32/fp64 keep full precision. float8_e4m3fn
    (the FP8 forward's P) rounds as :func:`e4m3_round`: saturating, as the kernels convert."""
    if dtype in (torch.float16, torch.bfloat16):
        return x.to(dtype).to(x.dtype)
    if dtype == torch.float8_e4m3fn:
        return e4m3_round(x)
    return x


def normalize_window(is_causal: bool = False,
                     window_size: Sequence[int] = (-1, -1)) -> Tuple[int, int]:
    """(window_left, window_right) as the kernels receive them: is_causal sets the right
    side to 0 (a right side > 0 together with is_causal is an error); -1 is unbounded."""
    left, right = (int(w) for w in window_size)
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= -1, got {tuple(window_size)}")
    if is_causal:
        if right > 0:
            raise ValueError(f"is_causal=True needs window_size[1] in (-1, 0), got {right}")
        right = 0
    return left, right


def key_visible(rows: Tensor, cols: Tensor, sq: int, sk: int, window_left: int = -1,
                window_right: int = -1) -> Tensor:
    """The visibility rule, the kernels' key_visible(): bool (len(rows), len(cols)), query
    row i sees key j iff 0 <= j < sk and, with d = i + sk - sq (the query's bottom-right
    aligned diagonal), d - window_left <= j <= d + window_right; -1 leaves a side open.
    Rows and columns past the ends (block padding) are allowed: such keys are invisible."""
    diag = rows.view(-1, 1) + (sk - sq)
    c = cols.view(1, -1)
    vis = ((c >= 0) & (c < sk)).expand(rows.numel(), cols.numel())
    if window_left >= 0:
        vis = vis & (c >= diag - window_left)
    if window_right >= 0:
        vis = vis & (c <= diag + window_right)
    return vis


def causal_visible(rows: Tensor, cols: Tensor, sq: int, sk: int) -> Tensor:
    """Causal visibility, :func:`key_visible` with window (-1, 0): j <= i + sk - sq."""
    return key_visible(rows, cols, sq, sk, -1, 0)


def alibi_bias(rows: Tensor, cols: Tensor, sq: int, sk: int) -> Tensor:
    """|i + sk - sq - j| for (rows, cols): the ALiBi distance, to be multiplied by a slope."""
    return (rows.view(-1, 1) + (sk - sq) - cols.view(1, -1)).abs()


def _key_range(row_first: int, row_last: int, sq: int, sk: int, wl: int, wr: int) -> Tuple[int, int]:
    """[lo, hi): the keys that at least one query row of [row_first, row_last] sees (the
    union of consecutive rows' windows is one interval). Empty when lo >= hi."""
    off = sk - sq
    lo = max(0, row_first + off - wl) if wl >= 0 else 0
    hi = min(sk, row_last + off + wr + 1) if wr >= 0 else sk
    return lo, hi


def _query_range(col_first: int, col_last: int, sq: int, sk: int, wl: int, wr: int) -> Tuple[int, int]:
    """[lo, hi): the query rows that see at least one key of [col_first, col_last]."""
    off = sk - sq
    lo = max(0, col_first - off - wr) if wr >= 0 else 0
    hi = min(sq, col_last - off + wl + 1) if wl >= 0 else sq
    return lo, hi


def _needs_mask(row_first: int, row_last: int, col_first: int, col_last: int, sq: int, sk: int,
                wl: int, wr: int) -> bool:
    """Whether a tile (rows x cols, both ranges inclusive) holds an invisible entry: a key
    past the end, or a window edge crossing the tile (the kernels skip the mask otherwise)."""
    off = sk - sq
    if col_last >= sk:
        return True
    if wr >= 0 and col_last > row_first + off + wr:  # right edge of the first row
        return True
    if wl >= 0 and col_first < row_last + off - wl:  # left edge of the last row
        return True
    return False


def _safe_max(m: Tensor) -> Tensor:
    """The kernels' safe_max(): a running max of -inf (no visible key yet) is used as 0,
    so that exp2(-inf - (-inf)) = NaN never happens."""
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def _group_view(x: Tensor, hkv: int) -> Tensor:
    """(B, Hq, S, D) -> (B, Hkv, G, S, D): the query heads of one GQA group side by side."""
    B, H, S, D = x.shape
    return x.reshape(B, hkv, H // hkv, S, D)


def _slopes_view(alibi_slopes: Optional[Tensor], B: int, Hq: int, Hkv: int,
                 dtype: torch.dtype) -> Optional[Tensor]:
    """ALiBi slopes (Hq,) or (B, Hq) -> (B or 1, Hkv, G, 1, 1) in ``dtype``, to broadcast
    over a (B, Hkv, G, rows, cols) tile of logits."""
    if alibi_slopes is None:
        return None
    if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
        raise ValueError(f"alibi_slopes must have shape ({Hq},) or ({B}, {Hq}), "
                         f"got {tuple(alibi_slopes.shape)}")
    s = alibi_slopes.detach().to(dtype)
    return s.reshape(-1, Hkv, Hq // Hkv, 1, 1)


def _sinks_view(sinks: Optional[Tensor], Hq: int, Hkv: int, dtype: torch.dtype) -> Optional[Tensor]:
    """Attention sinks (Hq,) -> (1, Hkv, G, 1) in ``dtype`` (differentiable), one per row
    of a (B, Hkv, G, rows) statistic; None without sinks."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (Hq,) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating tensor of shape ({Hq},), got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")
    return sinks.to(dtype).reshape(1, Hkv, Hq // Hkv, 1)


def _sinks_log2(sinks: Optional[Tensor], Hq: int, Hkv: int, dtype: torch.dtype) -> Optional[Tensor]:
    """The blocked loops' form of the sinks: (1, Hkv, G, 1) times log2(e), no autograd."""
    sink = _sinks_view(sinks, Hq, Hkv, dtype)
    return None if sink is None else sink.detach() * LOG2E


# ---------------------------------------------------------------------------------------
# Naive attention
# ---------------------------------------------------------------------------------------


def attention_naive(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False,
                    scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                    softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                    dropout_mask: Optional[Tensor] = None,
                    sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention with the full logit matrix, computed in the inputs' dtype.

    The four steps of the module docstring, literally: x = scale * q @ k^T; softcap;
    minus the ALiBi bias slope * |i + Sk - Sq - j|; masked to the window (is_causal sets
    its right side to 0); softmax. ``alibi_slopes`` (float32 (Hq,) or (B, Hq)) is used
    in the inputs' dtype too and gets no gradient. With ``dropout_p`` > 0, the
    probabilities are multiplied by ``dropout_mask`` ((B, Hq, Sq, Sk) bool, default
    :func:`dropout_keep_mask` with seed 0 and offset 0) and :func:`dropout_scale` before
    the product with V; lse is that of the probabilities before dropout. ``sinks`` ((Hq,)):
    one more logit per row, used in the inputs' dtype, that enters lse and no product with
    V (the module docstring); differentiable.

    Returns (out, lse): out like q's shape and dtype, lse (B, Hq, Sq) in the inputs'
    dtype. Differentiable with torch autograd (also through lse), and NaN-free for rows
    that see no key (out 0, lse -inf, zero gradients).
    """
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    scale = _default_scale(scale, D)
    wl, wr = normalize_window(is_causal, window_size)
    qg = _group_view(q, Hkv)  # (B, Hkv, G, Sq, D)
    kg = k.unsqueeze(2)  # (B, Hkv, 1, Sk, D): broadcast over the group, never repeated
    vg = v.unsqueeze(2)
    s = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # (B, Hkv, G, Sq, Sk)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    rows = torch.arange(Sq, device=q.device)
    cols = torch.arange(Sk, device=q.device)
    slopes = _slopes_view(alibi_slopes, B, Hq, Hkv, s.dtype)
    if slopes is not None:
        s = s - slopes * alibi_bias(rows, cols, Sq, Sk).to(s.dtype)
    if wl >= 0 or wr >= 0:
        # masked_fill (not an additive -inf bias) also zeroes the gradient of masked
        # entries, which keeps fully masked rows NaN-free in the backward.
        s = s.masked_fill(~key_visible(rows, cols, Sq, Sk, wl, wr), NEG_INF)
    sink = _sinks_view(sinks, Hq, Hkv, s.dtype)
    if sink is None:
        lse = torch.logsumexp(s, dim=-1)  # -inf for rows without a visible key
    else:
        # The sink as one more column of logits, seen by every row; the masked_fill leaves
        # the values and zeroes the gradient of -inf sinks (NaN in a row that has nothing
        # else: exp(-inf - (-inf))), as the mask does for the keys.
        col = sink.unsqueeze(-1).expand(B, Hkv, Hq // Hkv, Sq, 1)
        col = col.masked_fill(col == NEG_INF, NEG_INF)
        lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)
    lse_safe = torch.where(lse == NEG_INF, torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe.unsqueeze(-1))  # masked entries: exp(-inf) = 0
    keep = _dropout_keep(dropout_p, dropout_mask, B, Hq, Hkv, Sq, Sk, p.dtype, q.device)
    if keep is not None:
        p = p * keep
    out = torch.matmul(p, vg)  # (B, Hkv, G, Sq, D)
    return out.reshape(B, Hq, Sq, D), lse.reshape(B, Hq, Sq)


# ---------------------------------------------------------------------------------------
# Attention dropout: which probabilities are kept, from counter-based random numbers
# ---------------------------------------------------------------------------------------
#
# The kernels and this reference draw the same numbers, so a test compares them exactly: a
# pure function of (seed, offset, batch b, query head h, query row i, key column j), no state.
# One Philox4x32-10 draw (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11;
# the generator of Random123 and cuRAND) gives four 32-bit words = eight 16-bit numbers, for
# the eight elements one thread of a tensor-core tile holds in a 16 x 16 block of the scores
# (rows r and r + 8, columns 2c, 2c + 1 of two 8-column tiles):
#
#   counter = ((j // 16) * 4 + (j % 8) // 2,  (i // 16) * 8 + i % 8,  b * H + h,  offset mod 2^32)
#   key     = (seed mod 2^32,  (seed // 2^32 xor offset // 2^32) mod 2^32)
#   word    = ((i % 16) // 8) * 2 + (j % 16) // 8,   half = j % 2
#   r       = (word's bits 16 * half .. 16 * half + 15)                  (0 .. 65535)
#
# The element is kept iff r < t, t = round((1 - p) * 2^16) (dropout_keep_threshold), and a kept
# probability is multiplied by 2^16 / t (dropout_scale), the exact inverse of the keep rate
# t / 2^16, so that the expected output is the output without dropout. A packed (varlen) batch
# uses b, i, j of its sequences (positions within the sequence).

PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # the round multipliers of Philox4x32
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # the key increments (Weyl sequence)
_U32 = 0xFFFFFFFF


def _mulhilo32(a: int, b: Tensor) -> Tuple[Tensor, Tensor]:
    """(lo, hi) 32-bit halves of a * b for a 32-bit constant a and int64 tensors b of 32-bit
    values, without overflowing int64 (a is split into 16-bit halves)."""
    t1 = b * (a & 0xFFFF)  # < 2^48
    t2 = b * (a >> 16)  # < 2^48
    s = t1 + ((t2 & 0xFFFF) << 16)  # a * b = (t2 >> 16) * 2^32 + s
    return s & _U32, ((t2 >> 16) + (s >> 32)) & _U32


def philox4x32_10(counter: Sequence[Tensor], key: Sequence) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 with 10 rounds: four int64 tensors (or ints) of 32-bit counter words and two
    32-bit key words (ints or tensors, broadcast) -> the four 32-bit output words (int64)."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) for c in counter)
    k0, k1 = key
    for r in range(10):
        if r > 0:
            k0, k1 = (k0 + PHILOX_W[0]) & _U32, (k1 + PHILOX_W[1]) & _U32
        lo0, hi0 = _mulhilo32(PHILOX_M[0], c0)
        lo1, hi1 = _mulhilo32(PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def dropout_keep_threshold(dropout_p: float) -> int:
    """t: an element is kept iff its 16-bit number is below t (keep rate t / 2^16)."""
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    return min(65536, max(0, int(round((1.0 - dropout_p) * 65536))))


def dropout_scale(dropout_p: float) -> float:
    """What a kept probability is multiplied by: 2^16 / t, the inverse of the exact keep rate
    (0 when everything is dropped)."""
    t = dropout_keep_threshold(dropout_p)
    return 0.0 if t == 0 else 65536.0 / t


def dropout_random16(head_slot: Tensor, rows: Tensor, cols: Tensor, seed: int, offset: int) -> Tensor:
    """The 16-bit numbers (int64) of the elements (head_slot, rows, cols), broadcast together;
    head_slot is b * H + h (the mapping above)."""
    seed, offset = int(seed), int(offset)
    key = (seed & _U32, ((seed >> 32) ^ (offset >> 32)) & _U32)
    i, j = rows.to(torch.int64), cols.to(torch.int64)
    c0 = (j // 16) * 4 + (j % 8) // 2
    c1 = (i // 16) * 8 + i % 8
    c0, c1, c2 = torch.broadcast_tensors(c0, c1, head_slot.to(torch.int64))
    words = philox4x32_10((c0, c1, c2, torch.full_like(c0, offset & _U32)), key)
    which = (((i % 16) // 8) * 2 + (j % 16) // 8).expand_as(c0)
    word = torch.where(which == 0, words[0], torch.where(which == 1, words[1],
                                                         torch.where(which == 2, words[2], words[3])))
    return (word >> (16 * (j % 2))) & 0xFFFF


def dropout_keep_mask(batch: int, heads: int, sq: int, sk: int, dropout_p: float, seed: int = 0,
                      offset: int = 0, device=None, first_batch: int = 0) -> Tensor:
    """The (batch, heads, sq, sk) bool mask of kept attention probabilities (the kernels'
    mask for a dense batch; heads = query heads). ``first_batch``: the batch index of the
    first entry (a sequence of a packed batch: :func:`dropout_keep_masks_varlen`)."""
    t = dropout_keep_threshold(dropout_p)
    rows = torch.arange(sq, device=device).view(sq, 1)
    cols = torch.arange(sk, device=device).view(1, sk)
    mask = torch.empty((batch * heads, sq, sk), dtype=torch.bool, device=device)
    for bh in range(batch * heads):  # one head at a time bounds the int64 temporaries
        slot = torch.tensor(first_batch * heads + bh, device=device)
        mask[bh] = dropout_random16(slot, rows, cols, seed, offset) < t
    return mask.view(batch, heads, sq, sk)


def dropout_keep_masks_varlen(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, heads: int, dropout_p: float,
                              seed: int = 0, offset: int = 0, device=None) -> List[Tensor]:
    """The masks of a packed batch, one (1, heads, seqlen_q[b], seqlen_k[b]) per sequence: sequence
    b draws as entry b of a dense batch, with its own positions."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [dropout_keep_mask(1, heads, cq[b + 1] - cq[b], ck[b + 1] - ck[b], dropout_p, seed, offset, device,
                              first_batch=b) for b in range(len(cq) - 1)]


def _dropout_keep(dropout_p: float, dropout_mask: Optional[Tensor], B: int, Hq: int, Hkv: int, sq: int, sk: int,
                  dtype: torch.dtype, device) -> Optional[Tensor]:
    """The mask times the dropout scale, (B, Hkv, G, sq, sk) in ``dtype``; None without dropout."""
    if dropout_p == 0.0 and dropout_mask is None:
        return None
    scale = dropout_scale(dropout_p)
    if dropout_mask is None:
        dropout_mask = dropout_keep_mask(B, Hq, sq, sk, dropout_p, device=device)
    if tuple(dropout_mask.shape) != (B, Hq, sq, sk) or dropout_mask.dtype != torch.bool:
        raise ValueError(f"dropout_mask must be bool of shape {(B, Hq, sq, sk)}, got {dropout_mask.dtype} "
                         f"{tuple(dropout_mask.shape)}")
    keep = dropout_mask.to(device=device, dtype=dtype) * scale
    return keep.view(B, Hkv, Hq // Hkv, sq, sk)


def _keep_tile(keep: Optional[Tensor], row0: int, rows: int, block_m: int, key_base: int, cols: int,
               block_n: int) -> Optional[Tensor]:
    """The (block_m, block_n) tile of ``keep`` at (row0, key_base), zero past the ends."""
    if keep is None:
        return None
    tile = keep[..., row0:row0 + rows, key_base:key_base + cols]
    return torch.nn.functional.pad(tile, (0, block_n - cols, 0, block_m - rows))


# ---------------------------------------------------------------------------------------
# Blocked forward: the four steps of the kernels
# ---------------------------------------------------------------------------------------


def _tile_logits_log2(q_blk: Tensor, k_blk: Tensor, scale_log2: float, softcap: float,
                      bias_log2: Optional[Tensor],
                      qk_descale: Optional[Tensor] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """The logits of one tile in the log2 domain, before the mask: scale * q.k, capped
    (softcap * tanh(scale * q.k / softcap), computed as c * tanh(q.k * scale_log2 / c) with
    c = softcap * log2(e)), minus the ALiBi bias. Also returns the tanh (None without
    softcap), whose 1 - tanh^2 the backward needs.

    ``qk_descale`` (FP8: q_descale * k_descale, float32, broadcastable to the tile) joins
    the scale: the factor applied to the float32 q.k is fp32(scale_log2 [/ c]) times
    qk_descale, one float32 product, as a kernel folds the descales into its scale once."""
    qk = torch.matmul(q_blk, k_blk.transpose(-1, -2))
    t = None
    if softcap > 0:
        cap_log2 = softcap * LOG2E
        f = scale_log2 / cap_log2
        t = torch.tanh(qk * (f if qk_descale is None else qk_descale * f))
        s = t * cap_log2
    else:
        s = qk * (scale_log2 if qk_descale is None else qk_descale * scale_log2)
    if bias_log2 is not None:
        s = s - bias_log2
    return s, t


def _tile_bias_log2(slopes: Optional[Tensor], rows: Tensor, cols: Tensor, sq: int,
                    sk: int) -> Optional[Tensor]:
    """slope * |i + sk - sq - j| * log2(e) for a tile; None without ALiBi."""
    if slopes is None:
        return None
    return (slopes * LOG2E) * alibi_bias(rows, cols, sq, sk).to(slopes.dtype)


def compute_qk_scores_and_max(q_blk: Tensor, k_blk: Tensor, scale_log2: float,
                              visible: Optional[Tensor], softcap: float = 0.0,
                              bias_log2: Optional[Tensor] = None,
                              qk_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Step 1: the tile's logits in the log2 domain, masked, and their row maxima.

    S = (q_blk @ k_blk^T) * scale * log2(e), soft-capped when ``softcap`` > 0, minus
    ``bias_log2`` (the ALiBi bias times log2(e), broadcastable to S) when given. q_blk
    (..., G, bm, D) and k_blk (..., 1, bn, D) are in the accumulation dtype; ``visible``
    is a (bm, bn) bool mask or None when the block needs no masking (the kernels skip the
    mask work for blocks that no window edge crosses and that lie inside the keys).
    ``qk_descale`` (FP8 inputs: q_descale * k_descale, float32, broadcastable to S) joins
    the scale (:func:`_tile_logits_log2`); q_blk and k_blk then hold the stored e4m3 values.
    Returns (s, block_max) with masked entries at -inf.
    """
    s, _ = _tile_logits_log2(q_blk, k_blk, scale_log2, softcap, bias_log2, qk_descale)
    if visible is not None:
        s = s.masked_fill(~visible, NEG_INF)
    return s, s.amax(dim=-1)


def merge_block_stats(row_max: Tensor, row_sum: Tensor, acc_o: Tensor,
                      block_max: Tensor, max_lag: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """Step 2: fold a block's row maxima into the running statistics.

    The running sum and the output accumulator were computed against the old max, so both
    are rescaled by alpha = exp2(m_old - m_new). A row that has seen only masked keys keeps
    m = -inf and gets alpha = 0 (its accumulators are still zero).

    ``max_lag`` > 0 (log2 units; the 16-bit tensor-core forwards use 8): a row keeps its max
    while the block's exceeds it by at most max_lag, so P may reach 2^max_lag; O and l are
    summed against the same m, so O / l and lse = m + log2 l are unchanged, and O is
    rescaled only on the rare blocks that move m.
    """
    moves = block_max > row_max + max_lag if max_lag > 0 else block_max > row_max
    m_new = torch.where(moves, block_max, row_max)
    alpha = torch.exp2(row_max - _safe_max(m_new))
    return m_new, row_sum * alpha, acc_o * alpha.unsqueeze(-1)


def compute_block_softmax_and_weighted_v(s: Tensor, row_sum: Tensor, acc_o: Tensor,
                                         row_max: Tensor, v_blk: Tensor,
                                         in_dtype: torch.dtype,
                                         keep: Optional[Tensor] = None,
                                         p_offset: float = 0.0) -> Tuple[Tensor, Tensor]:
    """Step 3: P = exp2(S - m) (masked entries -> 0), l += rowsum(P), O += P @ V.

    The row sum uses P in the accumulation dtype; the P @ V product uses P rounded to the
    16-bit input dtype for fp16/bf16 inputs, as the tensor-core kernels do, and to e4m3 for
    the FP8 forward (``in_dtype`` float8_e4m3fn, :func:`e4m3_round`). ``keep`` (dropout: the
    tile's mask times :func:`dropout_scale`, 0 where dropped) multiplies P in the product
    only: the row sum, and so lse, are those before dropout.

    ``p_offset`` (log2 units; the FP8 forward uses :data:`FP8_P_OFFSET`): P = exp2(S - (m -
    p_offset)), the reference max lowered by the offset (m - p_offset is one float32
    subtraction), so P lies in [0, 2^p_offset] and its rounding to e4m3 keeps small
    probabilities that [0, 1] would flush. l and O carry the same factor; the caller passes
    m - p_offset to :func:`normalize_output`, which cancels it.
    """
    m = _safe_max(row_max)
    p = torch.exp2(s - (m if p_offset == 0 else m - p_offset).unsqueeze(-1))
    row_sum = row_sum + p.sum(dim=-1)
    if keep is not None:
        p = p * keep
    acc_o = acc_o + torch.matmul(_round_like_kernel(p, in_dtype), v_blk)
    return row_sum, acc_o


def normalize_output(acc_o: Tensor, row_sum: Tensor, row_max: Tensor,
                     out_dtype: torch.dtype,
                     sink_log2: Optional[Tensor] = None,
                     out_scale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Step 4: O /= l and lse = (m + log2 l) * ln 2; a row with l == 0 (no visible key)
    gets O = 0 and lse = -inf.

    ``out_scale`` (FP8: v_descale, float32, broadcastable to ``row_sum``) multiplies the
    inverse row sum: O = acc * (fp32(1 / l) * v_descale), one factor per row as the kernels
    scale their accumulator once.

    ``sink_log2`` (the attention sink times log2(e), broadcastable to ``row_max``) is
    merged first, as one more block of a single visible logit with P = 1 and no V:
    m' = max(m, sink), l' = l * exp2(m - m') + exp2(sink - m'), O' = O * exp2(m - m').

    The sink enters here, once per row after the key loop, rather than as the start of the
    running statistics (m = sink, l = 1): the loop stays the sink-free one, and P = exp2(S -
    m) keeps the keys' own scale, so a dominant sink cannot push P towards underflow before
    its 16-bit rounding for P @ V (O' is one per-row factor times the exact sum). Taking the
    max, rather than adding exp2(sink - m) to l, keeps l finite when the sink exceeds every
    logit by more than the float range (and serves rows with no key: m = -inf, l' = 1,
    lse = sink). A -inf sink changes nothing, bit for bit: exp2(m - m') = 1 and
    exp2(sink - m') = 0. Split-KV partials leave the sink out; :func:`combine_splits` adds
    it once."""
    if sink_log2 is not None:
        m_new = torch.maximum(row_max, sink_log2)  # -inf only when both are
        alpha = torch.exp2(row_max - _safe_max(m_new))
        row_sum = row_sum * alpha + torch.exp2(sink_log2 - _safe_max(m_new))
        acc_o = acc_o * alpha.unsqueeze(-1)
        row_max = m_new
    has_keys = row_sum != 0  # NaN rows stay NaN (a NaN input must not look like "no key")
    inv = torch.where(has_keys, 1.0 / torch.where(has_keys, row_sum, torch.ones_like(row_sum)),
                      torch.zeros_like(row_sum))
    if out_scale is not None:
        inv = inv * out_scale
    out = (acc_o * inv.unsqueeze(-1)).to(out_dtype)
    lse = torch.where(has_keys, (row_max + torch.log2(torch.where(has_keys, row_sum,
                                                                  torch.ones_like(row_sum)))) * LN2,
                      torch.full_like(row_sum, NEG_INF))
    return out, lse


def attention_forward_blocked(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False,
                              scale: Optional[float] = None,
                              window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, block_m: int = 64,
                              block_n: int = 64, max_lag: float = 0.0, dropout_p: float = 0.0,
                              dropout_mask: Optional[Tensor] = None,
                              sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The kernels' forward: returns (out in q's dtype, lse in float32 — float64 for float64
    inputs). Memory per step is O(block_m * block_n), never O(Sq * Sk). ``max_lag``: the
    running max's lag (:func:`merge_block_stats`). ``dropout_p`` / ``dropout_mask``: as
    :func:`attention_naive` (the mask is read a tile at a time). ``sinks`` ((Hq,)): merged
    by :func:`normalize_output` after each query block's key loop.

    A query block visits only the key blocks that meet the union of its rows' windows
    (:func:`_key_range`; causal is the window (-1, 0)), and masks only the tiles that a
    window edge or the end of the keys cuts (:func:`_needs_mask`).
    """
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    acc = _acc_dtype(q.dtype)
    keep_all = _dropout_keep(dropout_p, dropout_mask, B, Hq, Hkv, Sq, Sk, acc, q.device)
    return _forward_blocked_loop(q, k, v, is_causal=is_causal, scale=scale, window_size=window_size,
                                 softcap=softcap, alibi_slopes=alibi_slopes, block_m=block_m,
                                 block_n=block_n, max_lag=max_lag, keep_all=keep_all, sinks=sinks,
                                 p_dtype=q.dtype, out_dtype=q.dtype)


def _forward_blocked_loop(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float],
                          window_size: Sequence[int], softcap: float, alibi_slopes: Optional[Tensor],
                          block_m: int, block_n: int, max_lag: float, keep_all: Optional[Tensor],
                          sinks: Optional[Tensor], p_dtype: torch.dtype, out_dtype: torch.dtype,
                          qk_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
                          p_offset: float = 0.0) -> Tuple[Tensor, Tensor]:
    """The block loop of :func:`attention_forward_blocked`, shared with the FP8 forward
    (:func:`attention_fp8_forward_blocked`): ``p_dtype`` is what P is rounded to for P @ V,
    ``qk_descale`` ((B, Hkv, 1, 1, 1) float32) joins the scores' scale, ``v_descale``
    ((B, Hkv, 1, 1)) the normalization, ``p_offset`` lowers P's reference max."""
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    scale_log2, wl, wr, acc, G = _forward_setup(q, scale, is_causal, window_size, Hkv)
    dev = q.device
    slopes = _slopes_view(alibi_slopes, B, Hq, Hkv, acc)
    sink_log2 = _sinks_log2(sinks, Hq, Hkv, acc)

    qg = _group_view(q, Hkv)
    out = torch.empty((B, Hkv, G, Sq, D), dtype=out_dtype, device=dev)
    lse = torch.empty((B, Hkv, G, Sq), dtype=acc, device=dev)

    for row0 in range(0, Sq, block_m):
        rows = min(block_m, Sq - row0)
        row_idx = torch.arange(row0, row0 + block_m, device=dev)
        q_blk = qg[:, :, :, row0:row0 + rows].to(acc)
        if rows < block_m:  # the kernels zero-fill the rows past the end of the queries
            q_blk = torch.nn.functional.pad(q_blk, (0, 0, 0, block_m - rows))

        row_max = torch.full((B, Hkv, G, block_m), NEG_INF, dtype=acc, device=dev)
        row_sum = torch.zeros((B, Hkv, G, block_m), dtype=acc, device=dev)
        acc_o = torch.zeros((B, Hkv, G, block_m, D), dtype=acc, device=dev)

        key_lo, key_hi = _key_range(row0, row0 + rows - 1, Sq, Sk, wl, wr)
        for key_base in range((key_lo // block_n) * block_n, key_hi, block_n):
            cols = min(block_n, Sk - key_base)
            col_idx = torch.arange(key_base, key_base + block_n, device=dev)
            k_blk = k[:, :, key_base:key_base + cols].to(acc).unsqueeze(2)
            v_blk = v[:, :, key_base:key_base + cols].to(acc).unsqueeze(2)
            if cols < block_n:  # zero-filled past the end of the keys (masked anyway)
                k_blk = torch.nn.functional.pad(k_blk, (0, 0, 0, block_n - cols))
                v_blk = torch.nn.functional.pad(v_blk, (0, 0, 0, block_n - cols))
            visible = None
            if _needs_mask(row0, row0 + rows - 1, key_base, key_base + block_n - 1, Sq, Sk, wl, wr):
                visible = key_visible(row_idx, col_idx, Sq, Sk, wl, wr)
            bias = _tile_bias_log2(slopes, row_idx, col_idx, Sq, Sk)

            s, block_max = compute_qk_scores_and_max(q_blk, k_blk, scale_log2, visible,
                                                     softcap, bias, qk_descale)
            row_max, row_sum, acc_o = merge_block_stats(row_max, row_sum, acc_o, block_max, max_lag)
            row_sum, acc_o = compute_block_softmax_and_weighted_v(
                s, row_sum, acc_o, row_max, v_blk, p_dtype,
                _keep_tile(keep_all, row0, rows, block_m, key_base, cols, block_n), p_offset)

        # P, l and O were taken against m - p_offset: lse and the sink merge use that max.
        m_ref = row_max if p_offset == 0 else row_max - p_offset
        o_blk, lse_blk = normalize_output(acc_o, row_sum, m_ref, out_dtype, sink_log2, v_descale)
        out[:, :, :, row0:row0 + rows] = o_blk[..., :rows, :]
        lse[:, :, :, row0:row0 + rows] = lse_blk[..., :rows]

    return out.reshape(B, Hq, Sq, D), lse.reshape(B, Hq, Sq)


# ---------------------------------------------------------------------------------------
# Blocked backward (FlashAttention-2)
# ---------------------------------------------------------------------------------------


def _recompute_p_ds(q_blk: Tensor, do_blk: Tensor, k_blk: Tensor, v_blk: Tensor,
                    lse_log2_blk: Tensor, delta_blk: Tensor, scale_log2: float,
                    visible: Optional[Tensor], softcap: float,
                    bias_log2: Optional[Tensor], keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(P, dS) for one (query block, key block) tile, as both backward kernels recompute
    them: P = exp2(S_log2 - lse * log2(e)) from the forward's modified logits (rows with
    lse = -inf, no visible key, get P = 0 instead of exp2(+inf)), dP = dO V^T,
    dS = P * (dP - delta), the gradient of the modified logit; with softcap it is carried
    back through the cap: dS *= 1 - tanh^2 (the ALiBi bias is a constant). dS is then the
    gradient of scale * q.k.

    With dropout (``keep``: the tile's mask times the dropout scale), the forward multiplied
    V by P * keep: dV takes P * keep (returned in place of P), and dP, the gradient of
    P * keep, becomes dP * keep before dS = P * (dP - delta), delta = rowsum(dO * O) being
    that of the dropped-out output."""
    s, t = _tile_logits_log2(q_blk, k_blk, scale_log2, softcap, bias_log2)
    if visible is not None:
        s = s.masked_fill(~visible, NEG_INF)
    row_ok = (lse_log2_blk != NEG_INF).unsqueeze(-1)
    p = torch.exp2(s - torch.where(row_ok, lse_log2_blk.unsqueeze(-1), torch.zeros_like(s[..., :1])))
    p = torch.where(row_ok, p, torch.zeros_like(p))
    dp = torch.matmul(do_blk, v_blk.transpose(-1, -2))
    if keep is not None:
        dp = dp * keep
    ds = p * (dp - delta_blk.unsqueeze(-1))
    if t is not None:
        ds = ds * (1.0 - t * t)
    return (p if keep is None else p * keep), ds


def _bwd_preprocess(dout: Tensor, out: Tensor, dlse: Optional[Tensor], acc: torch.dtype) -> Tensor:
    """delta_i = rowsum(dO_i * O_i) - dlse_i."""
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    return delta


def _sinks_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """d sinks (Hq,) in the sinks' dtype, from lse and delta (..., Hq, rows): the sink's
    probability P_sink = exp(sink - lse) enters lse (d lse / d sink = P_sink) and, through
    the denominator, every p_ij (d p_ij / d sink = -p_ij P_sink), so that
    d sink_h = sum over the head's rows of P_sink * (dlse - rowsum(dO * O)) =
    -sum P_sink * delta. Rows with lse = -inf (no key and a -inf sink) give 0, as does a
    -inf sink. The kernels would add it up in the delta preprocess, which reads each row's
    dO, O and dlse already: one more load (lse), one exp2 per row, one sum per head."""
    acc = delta.dtype
    sink = sinks.detach().to(acc).view(-1, 1)
    lse = lse.to(acc)
    no_mass = lse == NEG_INF
    p_sink = torch.where(no_mass, torch.zeros_like(lse),
                         torch.exp(sink - torch.where(no_mass, torch.zeros_like(lse), lse)))
    return -(p_sink * delta).transpose(0, -2).reshape(sinks.shape[0], -1).sum(dim=1).to(sinks.dtype)


def attention_backward_blocked(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                               lse: Tensor, *, is_causal: bool = False,
                               scale: Optional[float] = None,
                               window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                               alibi_slopes: Optional[Tensor] = None,
                               dlse: Optional[Tensor] = None, block_m: int = 64,
                               block_n: int = 64, dropout_p: float = 0.0,
                               dropout_mask: Optional[Tensor] = None,
                               sinks: Optional[Tensor] = None):
    """Gradients (dq, dk, dv) in the inputs' dtype, from the forward's out and lse (and the
    forward's ``dropout_p`` / ``dropout_mask``, the same mask regenerated).

    With P = exp(x - lse) (x the modified logits), dP = dO V^T, dS = P * (dP - delta)
    [* (1 - tanh^2) with softcap]: dV = P^T dO, dK = scale * dS^T Q, dQ = scale * dS K.
    ``dlse`` (optional, (B, Hq, Sq)) is the upstream gradient of lse; it enters only
    through delta. Only the tiles that meet the window are visited, as in the forward.

    ``sinks`` ((Hq,)): the forward's sinks. lse already holds them, so dq, dk, dv need
    nothing more; the result is (dq, dk, dv, dsinks), dsinks (Hq,) in the sinks' dtype
    (:func:`_sinks_grad`).
    """
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    scale = _default_scale(scale, D)
    scale_log2 = scale * LOG2E
    wl, wr = normalize_window(is_causal, window_size)
    acc = _acc_dtype(q.dtype)
    dt = q.dtype
    dev = q.device
    slopes = _slopes_view(alibi_slopes, B, Hq, Hkv, acc)

    delta_rows = _bwd_preprocess(dout, out, dlse, acc)  # (B, Hq, Sq)
    dsinks = None if sinks is None else _sinks_grad(sinks, lse, delta_rows)
    delta = _group_view(delta_rows.unsqueeze(-1), Hkv).squeeze(-1)
    lse_log2 = _group_view((lse.to(acc) * LOG2E).unsqueeze(-1), Hkv).squeeze(-1)  # (B,Hkv,G,Sq)
    qg = _group_view(q, Hkv).to(acc)
    dog = _group_view(dout, Hkv).to(acc)
    k_acc = k.to(acc).unsqueeze(2)
    v_acc = v.to(acc).unsqueeze(2)
    keep_all = _dropout_keep(dropout_p, dropout_mask, B, Hq, Hkv, Sq, Sk, acc, dev)

    dq = torch.empty((B, Hkv, qg.shape[2], Sq, D), dtype=dt, device=dev)
    dk = torch.empty((B, Hkv, Sk, D), dtype=dt, device=dev)
    dv = torch.empty((B, Hkv, Sk, D), dtype=dt, device=dev)

    def tile(row0, rows, key_base, cols):
        row_idx = torch.arange(row0, row0 + rows, device=dev)
        col_idx = torch.arange(key_base, key_base + cols, device=dev)
        visible = None
        if _needs_mask(row0, row0 + rows - 1, key_base, key_base + cols - 1, Sq, Sk, wl, wr):
            visible = key_visible(row_idx, col_idx, Sq, Sk, wl, wr)
        return _recompute_p_ds(qg[:, :, :, row0:row0 + rows], dog[:, :, :, row0:row0 + rows],
                               k_acc[:, :, :, key_base:key_base + cols],
                               v_acc[:, :, :, key_base:key_base + cols],
                               lse_log2[..., row0:row0 + rows], delta[..., row0:row0 + rows],
                               scale_log2, visible, softcap,
                               _tile_bias_log2(slopes, row_idx, col_idx, Sq, Sk),
                               _keep_tile(keep_all, row0, rows, rows, key_base, cols, cols))

    # ---- dK, dV: one key/value block at a time, looping over the query blocks that can
    #      see it and (summed inside the matmuls) over the query heads of the GQA group.
    for key_base in range(0, Sk, block_n):
        cols = min(block_n, Sk - key_base)
        dk_acc = torch.zeros((B, Hkv, cols, D), dtype=acc, device=dev)
        dv_acc = torch.zeros((B, Hkv, cols, D), dtype=acc, device=dev)
        row_lo, row_hi = _query_range(key_base, key_base + cols - 1, Sq, Sk, wl, wr)
        for row0 in range((row_lo // block_m) * block_m, row_hi, block_m):
            rows = min(block_m, Sq - row0)
            p, ds = tile(row0, rows, key_base, cols)
            q_blk = qg[:, :, :, row0:row0 + rows]
            do_blk = dog[:, :, :, row0:row0 + rows]
            # dV += P^T dO, summed over the group's query heads
            dv_acc += torch.matmul(_round_like_kernel(p, dt).transpose(-1, -2), do_blk).sum(dim=2)
            # dK += dS^T Q, summed over the group's query heads
            dk_acc += torch.matmul(_round_like_kernel(ds, dt).transpose(-1, -2), q_blk).sum(dim=2)
        dk[:, :, key_base:key_base + cols] = (dk_acc * scale).to(dt)
        dv[:, :, key_base:key_base + cols] = dv_acc.to(dt)

    # ---- dQ: one query block at a time over the key blocks it sees.
    for row0 in range(0, Sq, block_m):
        rows = min(block_m, Sq - row0)
        dq_acc = torch.zeros((B, Hkv, qg.shape[2], rows, D), dtype=acc, device=dev)
        key_lo, key_hi = _key_range(row0, row0 + rows - 1, Sq, Sk, wl, wr)
        for key_base in range((key_lo // block_n) * block_n, key_hi, block_n):
            cols = min(block_n, Sk - key_base)
            _, ds = tile(row0, rows, key_base, cols)
            dq_acc += torch.matmul(_round_like_kernel(ds, dt), k_acc[:, :, :, key_base:key_base + cols])
        dq[:, :, :, row0:row0 + rows] = (dq_acc * scale).to(dt)

    if dsinks is not None:
        return dq.reshape(B, Hq, Sq, D), dk, dv, dsinks
    return dq.reshape(B, Hq, Sq, D), dk, dv


# ---------------------------------------------------------------------------------------
# Variable-length (packed) batches: one sequence at a time
# ---------------------------------------------------------------------------------------


def _varlen_spans(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int,
                  total_k: int) -> List[Tuple[int, int, int, int]]:
    """[(q_begin, q_end, k_begin, k_end)] per sequence, with the values checked (the
    reference trusts nothing: it starts at 0, does not decrease and covers every row)."""
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cq) != len(ck) or len(cq) < 1:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have B + 1 >= 1 entries, "
                         f"got {len(cq)} and {len(ck)}")
    for name, cu, total in (("cu_seqlens_q", cq, total_q), ("cu_seqlens_k", ck, total_k)):
        if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name} must start at 0, not decrease and end at {total}, got {cu}")
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _seq_dense(x: Tensor, begin: int, end: int) -> Tensor:
    """Rows begin:end of a packed (total, H, D) tensor as a dense (1, H, S, D) view."""
    return x[begin:end].transpose(0, 1).unsqueeze(0)


def _seq_slopes(alibi_slopes: Optional[Tensor], b: int) -> Optional[Tensor]:
    if alibi_slopes is None or alibi_slopes.dim() == 1:
        return alibi_slopes
    return alibi_slopes[b]


def _varlen_dropout_masks(dropout_p: float, masks: Optional[Sequence[Tensor]], cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor, heads: int, device) -> List[Optional[Tensor]]:
    """One mask (or None) per sequence."""
    n = cu_seqlens_q.shape[0] - 1
    if dropout_p == 0.0 and masks is None:
        return [None] * n
    if masks is None:
        return dropout_keep_masks_varlen(cu_seqlens_q, cu_seqlens_k, heads, dropout_p, device=device)
    if len(masks) != n:
        raise ValueError(f"dropout_masks must hold one mask per sequence ({n}), got {len(masks)}")
    return list(masks)


def _varlen_sizes(q: Tensor, k: Tensor, v: Tensor):
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"varlen: q must be (total_q, Hq, D), k and v (total_k, Hkv, D); got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return q.shape[0], q.shape[1], k.shape[0], k.shape[1], q.shape[2]


def attention_varlen_naive(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, *, is_causal: bool = False,
                           scale: Optional[float] = None, window_size: Sequence[int] = (-1, -1),
                           softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                           dropout_masks: Optional[Sequence[Tensor]] = None,
                           sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:func:`attention_naive` over a packed batch, one sequence at a time (see the module
    docstring). Returns out (total_q, Hq, D) in q's dtype and lse (Hq, total_q) in the
    inputs' dtype; differentiable in q, k, v (and ``sinks``, one per query head, shared by
    the sequences). Empty sequences are allowed. Dropout: one mask per sequence (default
    :func:`dropout_keep_masks_varlen` with seed 0 and offset 0)."""
    total_q, Hq, total_k, Hkv, D = _varlen_sizes(q, k, v)
    scale = _default_scale(scale, D)
    masks = _varlen_dropout_masks(dropout_p, dropout_masks, cu_seqlens_q, cu_seqlens_k, Hq, q.device)
    outs = [q.new_zeros((0, Hq, D))]
    lses = [q.new_zeros((Hq, 0))]
    for b, (qa, qb, ka, kb) in enumerate(_varlen_spans(cu_seqlens_q, cu_seqlens_k, total_q, total_k)):
        o, l = attention_naive(_seq_dense(q, qa, qb), _seq_dense(k, ka, kb), _seq_dense(v, ka, kb),
                               is_causal=is_causal, scale=scale, window_size=window_size,
                               softcap=softcap, alibi_slopes=_seq_slopes(alibi_slopes, b),
                               dropout_p=dropout_p, dropout_mask=masks[b], sinks=sinks)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def attention_varlen_forward_blocked(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                                     cu_seqlens_k: Tensor, *, is_causal: bool = False,
                                     scale: Optional[float] = None,
                                     window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, block_m: int = 64,
                                     block_n: int = 64, dropout_p: float = 0.0,
                                     dropout_masks: Optional[Sequence[Tensor]] = None,
                                     sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:func:`attention_forward_blocked` over a packed batch: out (total_q, Hq, D) in q's
    dtype, lse (Hq, total_q) in float32 (float64 for float64 inputs)."""
    total_q, Hq, total_k, Hkv, D = _varlen_sizes(q, k, v)
    scale = _default_scale(scale, D)
    masks = _varlen_dropout_masks(dropout_p, dropout_masks, cu_seqlens_q, cu_seqlens_k, Hq, q.device)
    out = torch.zeros_like(q)
    lse = torch.full((Hq, total_q), NEG_INF, dtype=_acc_dtype(q.dtype), device=q.device)
    for b, (qa, qb, ka, kb) in enumerate(_varlen_spans(cu_seqlens_q, cu_seqlens_k, total_q, total_k)):
        o, l = attention_forward_blocked(
            _seq_dense(q, qa, qb), _seq_dense(k, ka, kb), _seq_dense(v, ka, kb),
            is_causal=is_causal, scale=scale, window_size=window_size, softcap=softcap,
            alibi_slopes=_seq_slopes(alibi_slopes, b), block_m=block_m, block_n=block_n,
            dropout_p=dropout_p, dropout_mask=masks[b], sinks=sinks)
        out[qa:qb] = o[0].transpose(0, 1)
        lse[:, qa:qb] = l[0]
    return out, lse


def attention_varlen_backward_blocked(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                                      lse: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                                      is_causal: bool = False, scale: Optional[float] = None,
                                      window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                      alibi_slopes: Optional[Tensor] = None,
                                      dlse: Optional[Tensor] = None, block_m: int = 64,
                                      block_n: int = 64, dropout_p: float = 0.0,
                                      dropout_masks: Optional[Sequence[Tensor]] = None,
                                      sinks: Optional[Tensor] = None):
    """:func:`attention_backward_blocked` over a packed batch: (dq, dk, dv) shaped like
    (q, k, v); ``lse`` and ``dlse`` are (Hq, total_q). With ``sinks`` also dsinks (Hq,),
    summed over the sequences."""
    total_q, Hq, total_k, Hkv, D = _varlen_sizes(q, k, v)
    scale = _default_scale(scale, D)
    masks = _varlen_dropout_masks(dropout_p, dropout_masks, cu_seqlens_q, cu_seqlens_k, Hq, q.device)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dsinks = None if sinks is None else torch.zeros_like(sinks)
    for b, (qa, qb, ka, kb) in enumerate(_varlen_spans(cu_seqlens_q, cu_seqlens_k, total_q, total_k)):
        g = attention_backward_blocked(
            _seq_dense(dout, qa, qb), _seq_dense(q, qa, qb), _seq_dense(k, ka, kb),
            _seq_dense(v, ka, kb), _seq_dense(out, qa, qb), lse[:, qa:qb].unsqueeze(0),
            is_causal=is_causal, scale=scale, window_size=window_size, softcap=softcap,
            alibi_slopes=_seq_slopes(alibi_slopes, b),
            dlse=None if dlse is None else dlse[:, qa:qb].unsqueeze(0),
            block_m=block_m, block_n=block_n, dropout_p=dropout_p, dropout_mask=masks[b],
            sinks=sinks)
        dq[qa:qb] = g[0][0].transpose(0, 1)
        dk[ka:kb] = g[1][0].transpose(0, 1)
        dv[ka:kb] = g[2][0].transpose(0, 1)
        if dsinks is not None:
            dsinks += g[3]
    if dsinks is not None:
        return dq, dk, dv, dsinks
    return dq, dk, dv


# ---------------------------------------------------------------------------------------
# KV cache: in-place append, paged storage, split-KV and its combine
# ---------------------------------------------------------------------------------------


def _kvcache_lengths(cache_seqlens, batch: int) -> List[int]:
    """cache_seqlens (an int, or an integer tensor (B,)) as one Python int per sequence."""
    if isinstance(cache_seqlens, Tensor):
        assert not cache_seqlens.is_floating_point() and not cache_seqlens.is_complex(), \
            "cache_seqlens must hold integers"
        assert tuple(cache_seqlens.shape) == (batch,), \
            f"cache_seqlens must be ({batch},), got {tuple(cache_seqlens.shape)}"
        return [int(x) for x in cache_seqlens.tolist()]
    assert isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool), \
        "cache_seqlens must be an int or an integer tensor"
    return [int(cache_seqlens)] * batch


def _paged_slots(block_table: Tensor, b: int, pos: Tensor, page_size: int) -> Tuple[Tensor, Tensor]:
    """(page, row) of the logical positions ``pos`` of sequence b: position p lives in page
    block_table[b, p // page_size], row p % page_size. Only the entries that ``pos`` needs
    are looked up, so the table's entries past a sequence's length may hold anything."""
    pages = block_table[b].to(device=pos.device, dtype=torch.long)[pos // page_size]
    return pages, pos % page_size


def _read_kvcache(cache: Tensor, block_table: Optional[Tensor], b: int, start: int, end: int) -> Tensor:
    """Logical rows [start, end) of sequence b's cache as (Hkv, end - start, D), from a dense
    (B, Hkv, S_max, D) cache or through the block table from a paged
    (num_pages, Hkv, page_size, D) pool (a key block may straddle pages)."""
    if block_table is None:
        return cache[b, :, start:end]
    pos = torch.arange(start, end, device=cache.device)
    pages, rows = _paged_slots(block_table, b, pos, cache.shape[2])
    return cache[pages, :, rows].transpose(0, 1)  # the gather is (rows, Hkv, D)


def _write_kvcache(cache: Tensor, block_table: Optional[Tensor], b: int, start: int, x: Tensor) -> None:
    """Writes x (Hkv, n, D) in place at logical rows [start, start + n) of sequence b.
    Indexed assignment writes through views, so a pool seen through a transpose (or any
    other strided view) receives the rows in its own storage."""
    n = x.shape[1]
    if n == 0:
        return
    if block_table is None:
        cache[b, :, start:start + n] = x
        return
    pos = torch.arange(start, start + n, device=cache.device)
    pages, rows = _paged_slots(block_table, b, pos, cache.shape[2])
    cache[pages, :, rows] = x.transpose(0, 1)


def split_key_ranges(num_keys: int, num_splits: int, block_n: int) -> List[Tuple[int, int]]:
    """[(first_key, end_key)] of each of the ``num_splits`` ranges that split-KV cuts
    [0, num_keys) into: the ceil(num_keys / block_n) key blocks are dealt out as
    count * r // num_splits .. count * (r + 1) // num_splits, as the fp32 forward deals out a
    split query block's key steps. Boundaries fall on key blocks, so a range needs no mask
    of its own (the tiles it visits are those of the unsplit loop); with more splits than
    key blocks some ranges are empty and contribute nothing to the combine."""
    assert num_splits >= 1 and block_n >= 1
    count = -(-num_keys // block_n)
    return [(min(num_keys, count * r // num_splits * block_n),
             min(num_keys, count * (r + 1) // num_splits * block_n)) for r in range(num_splits)]


def combine_splits(o_parts: Sequence[Tensor], lse_parts: Sequence[Tensor],
                   out_dtype: torch.dtype, sink: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Merges the partial results of a split key range (the combine after split-KV).

    Range r left O_r normalized by its own row sum and lse_r = log(sum of its exp(x_ij))
    (natural log; -inf where its rows saw no key). Then lse = log(sum_r exp(lse_r)) and
    O = sum_r exp(lse_r - lse) * O_r: the weights are range r's share of the row's total
    softmax mass. Ranges with lse_r = -inf get weight 0 (computed against a finite
    reference, never as exp(-inf - (-inf)) = NaN); a row that no range saw gets O = 0 and
    lse = -inf. The merge runs in the parts' dtype (the accumulation dtype): O is rounded to
    ``out_dtype`` once, at the end, as the kernel writes its fp32 workspace out once.
    Returns (out in ``out_dtype``, lse in the parts' dtype).

    ``sink`` (natural log, broadcastable to the lse parts; the partials leave it out) is one
    more part with lse_r = sink and O_r = 0: it takes its share of the mass and adds nothing.
    """
    assert len(o_parts) == len(lse_parts) and len(o_parts) >= 1
    lse_parts, o_parts = list(lse_parts), list(o_parts)
    if sink is not None:
        lse_parts.append(sink.to(lse_parts[0].dtype).expand_as(lse_parts[0]))
        o_parts.append(torch.zeros_like(o_parts[0]))
    lse_r = torch.stack(lse_parts)  # (n, ...)
    o_r = torch.stack(o_parts)  # (n, ..., D)
    m = _safe_max(lse_r.amax(dim=0))
    mass = torch.exp(lse_r - m).sum(dim=0)  # in units of exp(m); 0 for a row no range saw
    has_keys = mass != 0  # NaN stays NaN, as in normalize_output
    lse = torch.where(has_keys, m + torch.log(torch.where(has_keys, mass, torch.ones_like(mass))),
                      torch.full_like(mass, NEG_INF))
    lse_safe = torch.where(has_keys, lse, torch.zeros_like(lse))
    w = torch.where(has_keys.unsqueeze(0), torch.exp(lse_r - lse_safe), torch.zeros_like(lse_r))
    out = (w.unsqueeze(-1) * o_r).sum(dim=0)
    return out.to(out_dtype), lse


def _kvcache_range_forward(qg: Tensor, k_cache: Tensor, v_cache: Tensor,
                           block_table: Optional[Tensor], b: int, num_keys: int,
                           key_first: int, key_end: int, scale_log2: float, wl: int, wr: int,
                           softcap: float, slopes: Optional[Tensor], block_m: int, block_n: int,
                           in_dtype: torch.dtype,
                           sink_log2: Optional[Tensor] = None,
                           qk_descale: Optional[Tensor] = None,
                           v_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """One sequence's queries qg (1, Hkv, G, Sq, D) against the keys [key_first, key_end)
    of its cache (block aligned, see :func:`split_key_ranges`), num_keys = L_b being the
    sequence's length for the mask and ALiBi. The loop of :func:`attention_forward_blocked`
    with the key blocks read from the cache and clipped to the range. Returns O normalized
    by the range's own row sum and its lse, both in the accumulation dtype (a split's
    partial stays unrounded until the combine); rows that saw no key: O = 0, lse = -inf.
    ``sink_log2`` ((1, Hkv, G, 1), log2 units): merged by :func:`normalize_output`; given
    only when the range is the whole of [0, L_b) (a split's partial leaves it out).
    ``qk_descale`` / ``v_descale`` ((1, Hkv, 1, 1, 1) / (1, Hkv, 1, 1) float32): an FP8
    cache's descales, in the scores' scale and the normalization (the cache rows are read
    as their stored e4m3 values)."""
    _, Hkv, G, Sq, D = qg.shape
    acc = _acc_dtype(in_dtype)
    dev = qg.device
    out = torch.zeros((1, Hkv, G, Sq, D), dtype=acc, device=dev)
    lse = torch.full((1, Hkv, G, Sq), NEG_INF, dtype=acc, device=dev)
    for row0 in range(0, Sq, block_m):
        rows = min(block_m, Sq - row0)
        row_idx = torch.arange(row0, row0 + block_m, device=dev)
        q_blk = qg[:, :, :, row0:row0 + rows].to(acc)
        if rows < block_m:
            q_blk = torch.nn.functional.pad(q_blk, (0, 0, 0, block_m - rows))

        row_max = torch.full((1, Hkv, G, block_m), NEG_INF, dtype=acc, device=dev)
        row_sum = torch.zeros((1, Hkv, G, block_m), dtype=acc, device=dev)
        acc_o = torch.zeros((1, Hkv, G, block_m, D), dtype=acc, device=dev)

        # The blocks of the range that meet the union of the block's rows' windows.
        key_lo, key_hi = _key_range(row0, row0 + rows - 1, Sq, num_keys, wl, wr)
        first = max(key_first, (key_lo // block_n) * block_n)
        for key_base in range(first, min(key_end, key_hi), block_n):
            cols = min(block_n, num_keys - key_base)
            col_idx = torch.arange(key_base, key_base + block_n, device=dev)
            # Only rows below L_b are read: rows past it (stale or never written cache rows)
            # may hold anything, NaN included, and a masked P = 0 would not cancel them in
            # P @ V (0 * NaN = NaN); the padding is zeros, as in the kernels.
            k_blk = _read_kvcache(k_cache, block_table, b, key_base, key_base + cols).to(acc)
            v_blk = _read_kvcache(v_cache, block_table, b, key_base, key_base + cols).to(acc)
            k_blk = k_blk.unsqueeze(0).unsqueeze(2)  # (1, Hkv, 1, cols, D)
            v_blk = v_blk.unsqueeze(0).unsqueeze(2)
            if cols < block_n:
                k_blk = torch.nn.functional.pad(k_blk, (0, 0, 0, block_n - cols))
                v_blk = torch.nn.functional.pad(v_blk, (0, 0, 0, block_n - cols))
            visible = None
            if _needs_mask(row0, row0 + rows - 1, key_base, key_base + block_n - 1, Sq, num_keys,
                           wl, wr):
                visible = key_visible(row_idx, col_idx, Sq, num_keys, wl, wr)
            bias = _tile_bias_log2(slopes, row_idx, col_idx, Sq, num_keys)

            s, block_max = compute_qk_scores_and_max(q_blk, k_blk, scale_log2, visible, softcap, bias,
                                                     qk_descale)
            row_max, row_sum, acc_o = merge_block_stats(row_max, row_sum, acc_o, block_max)
            row_sum, acc_o = compute_block_softmax_and_weighted_v(s, row_sum, acc_o, row_max,
                                                                  v_blk, in_dtype)

        o_blk, lse_blk = normalize_output(acc_o, row_sum, row_max, acc, sink_log2, v_descale)
        out[:, :, :, row0:row0 + rows] = o_blk[..., :rows, :]
        lse[:, :, :, row0:row0 + rows] = lse_blk[..., :rows]
    return out, lse


def attention_with_kvcache_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                     k: Optional[Tensor] = None, v: Optional[Tensor] = None, *,
                                     cache_seqlens, block_table: Optional[Tensor] = None,
                                     is_causal: bool = False, scale: Optional[float] = None,
                                     window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, num_splits: int = 1,
                                     return_lse: bool = False, block_m: int = 64,
                                     block_n: int = 64, sinks: Optional[Tensor] = None):
    """Attention over a KV cache (FlashAttention's flash_attn_with_kvcache, in the (B, H, S, D)
    layout): append the new keys / values to the cache in place, then attend to the cache.

    * q (B, Hq, Sq, D). The cache is dense, k_cache / v_cache (B, Hkv, S_max, D), or paged
      when ``block_table`` (integer (B, max_pages)) is given: a pool (num_pages, Hkv,
      page_size, D) where position p of sequence b is row p % page_size of page
      block_table[b, p // page_size]. Any strides (a (num_pages, page_size, Hkv, D) pool
      seen through ``.transpose(1, 2)`` included). GQA as everywhere: Hq % Hkv == 0.
    * ``cache_seqlens`` (int, or integer tensor (B,)): tokens already in each sequence's
      cache. The optional k / v (B, Hkv, S_new, D) are written into the cache at positions
      cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 (through the block table when paged)
      before attending; ``cache_seqlens`` itself is not changed (the caller advances it).
    * Sequence b attends to its positions [0, L_b), L_b = cache_seqlens[b] + S_new, and to
      nothing past them (those rows are never read). Every option means what it means for
      :func:`attention_naive` with Sk = L_b: the mask, ALiBi distance and causal diagonal
      are bottom-right aligned to L_b (query i sits at position i + L_b - Sq, so new
      queries that came with the new keys line up with them).
    * ``num_splits`` (split-KV): [0, L_b) is cut into num_splits ranges of whole key blocks
      (:func:`split_key_ranges`); each range runs the blocked loop alone, leaving O_r
      normalized by its own row sum and lse_r, and :func:`combine_splits` merges them.
      num_splits = 1 runs the one range and writes it out without a combine.
    * ``block_m`` / ``block_n``: the query and key block sizes of the loop (they move only
      rounding, and the split boundaries).
    * ``sinks`` ((Hq,)): the attention sinks of the module docstring, entering each row
      once: in :func:`normalize_output` with one range, in :func:`combine_splits` with
      several (a row with L_b = 0 has out 0 and lse = its sink).

    Computed in float32 (float64 for float64 inputs), P rounded to the 16-bit input dtype
    before P @ V as in the kernels. Returns out (B, Hq, Sq, D) in q's dtype, and with
    ``return_lse`` also lse (B, Hq, Sq) (natural log, in the accumulation dtype as
    :func:`attention_forward_blocked` returns it); a row that sees no key (L_b = 0, or
    the mask hides every key from it) has out 0 and lse -inf.
    """
    assert q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        "q must be (B, Hq, Sq, D) and k_cache / v_cache one 4-D shape"
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the cache must have one dtype"
    B, Hq, Hkv, Sq, D, S_new, cached = _kvcache_shapes(q, k_cache, v_cache, k, v, cache_seqlens,
                                                       block_table, num_splits, alibi_slopes)
    scale_log2, wl, wr, acc, _ = _forward_setup(q, scale, is_causal, window_size, Hkv)
    sink_log2 = _sinks_log2(sinks, Hq, Hkv, acc)

    # The append comes first: the new keys are part of what the queries see.
    if S_new > 0:
        for b, c in enumerate(cached):
            _write_kvcache(k_cache, block_table, b, c, k[b].to(k_cache.dtype))
            _write_kvcache(v_cache, block_table, b, c, v[b].to(v_cache.dtype))

    return _kvcache_attend(q, k_cache, v_cache, block_table, cached, S_new, scale_log2, wl, wr,
                           softcap, alibi_slopes, num_splits, block_m, block_n, sink_log2,
                           return_lse)


def _kvcache_shapes(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor],
                    v: Optional[Tensor], cache_seqlens, block_table: Optional[Tensor],
                    num_splits: int, alibi_slopes: Optional[Tensor]):
    """The shape rules of a KV-cache call (dense or paged), checked:
    (B, Hq, Hkv, Sq, D, S_new, cached lengths)."""
    B, Hq, Sq, D = q.shape
    if block_table is None:
        Bc, Hkv, capacity, Dc = k_cache.shape
        assert Bc == B, f"dense cache batch {Bc} != q batch {B}"
    else:
        _, Hkv, page_size, Dc = k_cache.shape
        assert block_table.dim() == 2 and block_table.shape[0] == B, \
            f"block_table must be (B={B}, max_pages)"
        assert not block_table.is_floating_point(), "block_table must hold integers"
        capacity = block_table.shape[1] * page_size
    assert Dc == D and Hkv >= 1 and Hq % Hkv == 0, "head dims differ or Hq % Hkv != 0"
    assert (k is None) == (v is None), "k and v come together"
    S_new = 0 if k is None else k.shape[2]
    if k is not None:
        assert k.shape == v.shape == (B, Hkv, S_new, D), "k / v must be (B, Hkv, S_new, D)"
    cached = _kvcache_lengths(cache_seqlens, B)
    assert all(0 <= c and c + S_new <= capacity for c in cached), \
        f"cache_seqlens + S_new must lie in [0, {capacity}], got {cached} + {S_new}"
    assert isinstance(num_splits, int) and num_splits >= 1, "num_splits must be an int >= 1"
    if alibi_slopes is not None:
        assert tuple(alibi_slopes.shape) in ((Hq,), (B, Hq)), "alibi_slopes must be (Hq,) or (B, Hq)"
    return B, Hq, Hkv, Sq, D, S_new, cached


def _kvcache_attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Optional[Tensor],
                    cached: List[int], S_new: int, scale_log2: float, wl: int, wr: int, softcap: float,
                    alibi_slopes: Optional[Tensor], num_splits: int, block_m: int, block_n: int,
                    sink_log2: Optional[Tensor], return_lse: bool,
                    k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None):
    """The attention half of a KV-cache call, after the append: every sequence over its
    [0, L_b), split or not. ``k_descale`` / ``v_descale`` ((B, Hkv) float32): an FP8 cache's."""
    B, Hq, Sq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    acc = _acc_dtype(q.dtype)
    dev = q.device
    qg = _group_view(q, Hkv)
    out = torch.empty((B, Hkv, G, Sq, D), dtype=q.dtype, device=dev)
    lse = torch.empty((B, Hkv, G, Sq), dtype=acc, device=dev)
    for b in range(B):  # each sequence has its own length, hence its own mask and blocks
        L = cached[b] + S_new
        slopes = _slopes_view(_seq_slopes(alibi_slopes, b), 1, Hq, Hkv, acc)
        kd = None if k_descale is None else k_descale[b:b + 1].view(1, Hkv, 1, 1, 1)
        vd = None if v_descale is None else v_descale[b:b + 1].view(1, Hkv, 1, 1)
        parts = [_kvcache_range_forward(qg[b:b + 1], k_cache, v_cache, block_table, b, L, lo, hi,
                                        scale_log2, wl, wr, softcap, slopes, block_m, block_n,
                                        q.dtype, sink_log2 if num_splits == 1 else None, kd, vd)
                 for lo, hi in split_key_ranges(L, num_splits, block_n)]
        if num_splits == 1:
            o_b, lse_b = parts[0][0].to(q.dtype), parts[0][1]
        else:
            o_b, lse_b = combine_splits([p[0] for p in parts], [p[1] for p in parts], q.dtype,
                                        None if sink_log2 is None else sink_log2 * LN2)
        out[b:b + 1] = o_b
        lse[b:b + 1] = lse_b

    out = out.reshape(B, Hq, Sq, D)
    if return_lse:
        return out, lse.reshape(B, Hq, Sq)
    return out


def attention_with_kvcache_packed_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                            k: Optional[Tensor] = None, v: Optional[Tensor] = None, *,
                                            cu_seqlens_q: Tensor, cache_seqlens: Tensor,
                                            block_table: Optional[Tensor] = None,
                                            alibi_slopes: Optional[Tensor] = None,
                                            return_lse: bool = False, **options):
    """The KV-cache call with packed (varlen) queries, defined sequence by sequence by
    :func:`attention_with_kvcache_reference`: a batch that mixes prompt chunks of some
    sequences with decode tokens of others.

    * q (total_q, Hq, D); sequence b owns rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] (its
      chunk, n_b rows, possibly 0). k / v (total_q, Hkv, D), or None: the chunk's new keys,
      appended to sequence b's cache at positions cache_seqlens[b] .. cache_seqlens[b] + n_b - 1.
    * ``cache_seqlens`` (integer tensor (B,)), ``block_table`` ((B, max_pages), paged) and
      ``alibi_slopes`` ((Hq,) or (B, Hq)) are per sequence as in the dense reference; every
      other keyword (is_causal, scale, window_size, softcap, num_splits, block_m, block_n,
      sinks) is passed on unchanged.
    * Rows of sequence b are exactly ``attention_with_kvcache_reference`` on batch entry b
      alone (q[rows].transpose(0, 1)[None], its cache entry or its block-table row): with
      k / v sequence b attends to [0, cache_seqlens[b] + n_b), bottom-right aligned. A
      0-row chunk reads and writes nothing.

    Returns out (total_q, Hq, D) in q's dtype, and with ``return_lse`` also lse (Hq, total_q).
    """
    assert q.dim() == 3 and k_cache.dim() == 4, "q must be (total_q, Hq, D), the caches 4-D"
    assert (k is None) == (v is None), "k and v come together"
    assert cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] >= 1, "cu_seqlens_q must be (B + 1,)"
    cu = [int(x) for x in cu_seqlens_q.tolist()]
    B = len(cu) - 1
    assert cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] == q.shape[0], \
        f"cu_seqlens_q must start at 0, not decrease and end at total_q = {q.shape[0]}, got {cu}"
    if k is not None:
        assert k.shape == v.shape and k.dim() == 3 and k.shape[0] == q.shape[0], \
            "k / v must be (total_q, Hkv, D)"
    cached = _kvcache_lengths(cache_seqlens, B)
    Hq, D = q.shape[1], q.shape[2]
    acc = _acc_dtype(q.dtype)
    out = q.new_zeros(q.shape)
    lse = torch.empty((Hq, q.shape[0]), dtype=acc, device=q.device)
    for b in range(B):  # the definition: one dense call per sequence
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        seq_cache = (k_cache, v_cache) if block_table is not None else (k_cache[b:b + 1], v_cache[b:b + 1])
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b:b + 1]
        o_b, lse_b = attention_with_kvcache_reference(
            q[lo:hi].transpose(0, 1)[None], *seq_cache,
            None if k is None else k[lo:hi].transpose(0, 1)[None],
            None if v is None else v[lo:hi].transpose(0, 1)[None],
            cache_seqlens=cached[b], block_table=None if block_table is None else block_table[b:b + 1],
            alibi_slopes=slopes, return_lse=True, **options)
        out[lo:hi] = o_b[0].transpose(0, 1)
        lse[:, lo:hi] = lse_b[0]
    if return_lse:
        return out, lse
    return out


__all__ += ["attention_with_kvcache_reference", "split_key_ranges", "combine_splits",
            "attention_with_kvcache_packed_reference"]


# ---------------------------------------------------------------------------------------
# FP8 (e4m3): quantization, the naive and the blocked forward, the FP8 KV cache
# ---------------------------------------------------------------------------------------
#
# Scales. A stored e4m3 value x8 stands for the real value x8 * descale: the *descale* is
# the factor that multiplies a stored value to give the real one, the only scale the
# functions here take. Quantizing divides by it: x8 = e4m3(x / descale) (quantize_e4m3).
# A descale is a Python float, a float32 tensor of shape () or (1,) (per tensor), or a
# float32 (B, Hkv) tensor: one per (batch entry, KV head), FlashAttention-3's layout, which
# the query heads of a GQA group share (q_descale too is (B, Hkv), not (B, Hq): a kernel
# tile holds a whole group's rows). Descales are used as given (no check of their values).
#
# Rounding to e4m3 (e4m3_round, quantize_e4m3): round to nearest, ties to even; a finite
# value beyond the largest e4m3 magnitude 448, and +-inf, saturate to +-448; NaN stays NaN.
# That is the GPUs' cvt.rn.satfinite.e4m3x2.f32. torch's own float32 -> float8_e4m3fn
# conversion rounds alike but has not always saturated (older releases turned magnitudes of
# 480 and more, and inf, into NaN), so the values are clamped to +-448 first: the result does
# not depend on the torch release. Values below half the smallest subnormal (2^-10) round to
# (signed) zero.
#
# The FP8 forward (q, k, v all e4m3, each with its descale; attention_fp8_forward_blocked
# is the kernels' algorithm, attention_fp8_naive the plain statement), what is rounded where:
#
#   1. scores: S = (q8 . k8) in float32 (the products of e4m3 values are exact in float32,
#      the sum is float32), times fp32(scale * log2 e) * fp32(q_descale * k_descale) (one
#      float32 factor per (batch, KV head)); with softcap c the factor inside the tanh is
#      fp32(scale / c) * fp32(q_descale * k_descale) and S = tanh(.) * c log2 e; ALiBi and
#      the mask as for 16-bit inputs, in float32, log2 domain;
#   2. the running max m and its rescale of l and O by exp2(m_old - m_new): float32, as
#      for 16-bit inputs (O is never rounded between blocks);
#   3. P = exp2(S - (m - 8)) in float32: the reference max lowered by FP8_P_OFFSET = 8, so
#      P lies in [0, 256] (FlashAttention-3's FP8 forward scales P by 2^8 the same way: [0, 1]
#      would flush every P < 2^-10 to zero, i.e. every logit more than ~6.9 below the max);
#      l += rowsum(P) with the unrounded float32 P; O += e4m3(P) @ v8 with float32
#      accumulation (V's stored values; a kernel's transposition of V for the FP8 MMA is
#      its own business, users pass (B, Hkv, S, D));
#   4. O = acc * (fp32(1 / l) * v_descale), rounded once to out_dtype (bfloat16 by default);
#      lse = ((m - 8) + log2 l) * ln 2 in float32 (the 2^8 cancels: the lse is that of the
#      unrounded probabilities). Rows that see no key: O = 0, lse = -inf (or the sink).
#
# The FP8 KV cache (attention_with_kvcache_fp8_reference: 16-bit queries, e4m3 caches) is
# the 16-bit KV-cache algorithm on the caches' stored values, which convert exactly to
# float16 and bfloat16 (3 mantissa bits, exponents 2^-9 .. 2^8): the scores' factor is
# fp32(scale * log2 e) * k_descale, P is rounded to the queries' dtype as in every 16-bit
# kernel (the products are 16-bit MMAs of q and the converted cache rows; GPUs before sm_89
# have no FP8 MMA at all), and O = acc * (fp32(1 / l) * v_descale) in each split's
# normalization. The appended keys / values are quantized with the cache's descales:
# k_cache[b, :, pos] = e4m3(k_new[b] / k_descale[b]) (float32 division, correctly rounded).

E4M3_MAX = 448.0
FP8_P_OFFSET = 8.0  # log2 units: P = exp2(S - (m - 8)) lies in [0, 2^8]
_FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OTHER_FP8 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                               "float8_e8m0fnu") if hasattr(torch, n))


def e4m3_round(x: Tensor) -> Tensor:
    """x rounded to the nearest e4m3 value (ties to even), saturating at +-448 (+-inf too),
    NaN kept, returned in x's dtype: the kernels' conversion of P (see the section's
    comment). clamp keeps NaN, so a NaN score still poisons its row as in the 16-bit path."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(x.dtype)


def quantize_e4m3(x: Tensor, descale=None) -> Tensor:
    """x as float8_e4m3fn with the given descale: e4m3(fp32(x) / descale), the division in
    float32 (correctly rounded), then :func:`e4m3_round`'s rounding (saturating). ``descale``:
    None (1), a float, or a float32 tensor broadcastable to x (for a (B, H, S, D) tensor and
    (B, H) descales: ``descale[..., None, None]``)."""
    x32 = x.to(torch.float32)
    if descale is not None:
        x32 = x32 / (descale.to(torch.float32) if isinstance(descale, Tensor) else float(descale))
    return x32.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_e4m3(x8: Tensor, descale=None) -> Tensor:
    """The real values of stored e4m3 values: fp32(x8) * descale (float32; the descale as
    in :func:`quantize_e4m3`)."""
    x = x8.to(torch.float32)
    if descale is None:
        return x
    return x * (descale.to(torch.float32) if isinstance(descale, Tensor) else float(descale))


def fp8_descale(descale, batch: int, kv_heads: int, name: str = "descale", device=None) -> Tensor:
    """A descale as the (batch, kv_heads) float32 tensor it means: None is 1; a float or a
    float32 tensor of shape () or (1,) is per tensor; (batch, kv_heads) is per (batch entry,
    KV head). Anything else is an error (TypeError for the type, ValueError for the shape)."""
    if descale is None:
        return torch.ones((batch, kv_heads), dtype=torch.float32, device=device)
    if isinstance(descale, bool) or not isinstance(descale, (int, float, Tensor)):
        raise TypeError(f"{name} must be a float or a float32 tensor, got {type(descale).__name__}")
    if not isinstance(descale, Tensor):
        return torch.full((batch, kv_heads), float(descale), dtype=torch.float32, device=device)
    if descale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32 (the kernels read float32 descales), got {descale.dtype}")
    shape = tuple(descale.shape)
    if shape in ((), (1,)):
        return descale.reshape(1, 1).expand(batch, kv_heads).to(device)
    if shape == (batch, kv_heads):
        return descale.to(device)
    raise ValueError(f"{name} must be per tensor (a float, or a float32 tensor of shape () or (1,)) or "
                     f"per (batch, KV head) of shape ({batch}, {kv_heads}); got shape {shape} (query "
                     f"heads of a GQA group share their KV head's descale)")


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _check_fp8_inputs(**tensors: Tensor) -> None:
    """Every named tensor must be float8_e4m3fn: e5m2 and the other FP8 formats are named in
    the message, as is a mix of FP8 and non-FP8 inputs."""
    names = ", ".join(f"{n} {_dtype_name(t.dtype)}" for n, t in tensors.items())
    for n, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{n} must be a tensor, got {type(t).__name__}")
    if any(t.dtype in _OTHER_FP8 for t in tensors.values()):
        raise TypeError(f"only the e4m3 FP8 format (torch.float8_e4m3fn) is supported, got {names}: "
                        f"float8_e5m2 and the fnuz / e8m0 formats are not (e5m2's 2 mantissa bits are "
                        f"for gradients); quantize with quantize_e4m3")
    if not all(t.dtype == torch.float8_e4m3fn for t in tensors.values()):
        which = "mixed FP8 and non-FP8 inputs" if any(t.dtype == torch.float8_e4m3fn
                                                      for t in tensors.values()) else "no FP8 input"
        raise TypeError(f"the FP8 attention takes {', '.join(tensors)} all in torch.float8_e4m3fn, got "
                        f"{names} ({which}; the 16-bit inputs go to attention_forward_blocked)")


def _check_fp8_options(out_dtype: torch.dtype, p_offset: float, max_lag: float) -> None:
    if out_dtype not in _FP8_OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of bfloat16, float16, float32, got {out_dtype}")
    if not 0.0 <= p_offset or not 0.0 <= max_lag or p_offset + max_lag > math.log2(E4M3_MAX):
        # P reaches 2^(p_offset + max_lag): beyond 448 it would saturate in its rounding.
        raise ValueError(f"p_offset ({p_offset}) and max_lag ({max_lag}) must be >= 0 with "
                         f"p_offset + max_lag <= log2(448) = {math.log2(E4M3_MAX):.3f}, so that "
                         f"P <= 448 never saturates")


def _fp8_descales(q: Tensor, k: Tensor, q_descale, k_descale, v_descale) -> Tuple[Tensor, Tensor, Tensor]:
    """(q_descale, k_descale, v_descale) as (B, Hkv) float32 tensors."""
    B, Hkv = k.shape[0], k.shape[1]
    return tuple(fp8_descale(d, B, Hkv, n, q.device) for d, n in
                 ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")))


def attention_fp8_naive(q: Tensor, k: Tensor, v: Tensor, q_descale=None, k_descale=None,
                        v_descale=None, *, is_causal: bool = False, scale: Optional[float] = None,
                        window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                        out_dtype: torch.dtype = torch.bfloat16, round_p: bool = True,
                        p_offset: float = FP8_P_OFFSET,
                        matmul: Callable[[Tensor, Tensor], Tensor] = torch.matmul) -> Tuple[Tensor, Tensor]:
    """FP8 attention the plain way: the "naive attention in the same precision" whose error
    sets the FP8 forward's tolerance (the 2x rule against float64).

    q, k, v float8_e4m3fn ((B, Hq, Sq, D), (B, Hkv, Sk, D)); the descales as
    :func:`fp8_descale` takes them. The whole logit matrix x = scale q_descale k_descale
    (q8 @ k8^T) is formed in float32 (the stored values' product, then the descales; softcap,
    ALiBi, mask as in :func:`attention_naive`), and with m the row max of the visible logits (the sink left
    out, as the blocked loop leaves it out of P's reference), p = exp(x - m) * 2^p_offset,
    l = rowsum(p) unrounded, out = (e4m3(p) @ v) / (l + 2^p_offset exp(sink - m)), lse =
    log(exp(m) l 2^-p_offset + exp(sink)). ``round_p=False`` skips the e4m3 rounding of p
    (the float32 attention of the dequantized inputs): the tests' witness that the rounding
    is there. ``matmul`` forms both products (q8 @ k8^T, and e4m3(p) @ v8 before v's descale)
    from float32 tensors that hold e4m3 values: torch.matmul (exact products, float32 sums), or
    on a GPU the FP8 tensor cores' product (tests/test_reference_fp8.py:
    e4m3_tensor_core_matmul), whose sums keep fewer bits than float32's: the naive attention in
    the precision the kernels run at. Returns out (B, Hq, Sq, D) in ``out_dtype``, lse (B, Hq,
    Sq) float32.
    """
    _check_fp8_inputs(q=q, k=k, v=v)
    _check_fp8_options(out_dtype, p_offset, 0.0)
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    qd, kd, vd = _fp8_descales(q, k, q_descale, k_descale, v_descale)
    G = Hq // Hkv
    f32 = torch.float32
    scale = _default_scale(scale, D)
    wl, wr = normalize_window(is_causal, window_size)
    qg = dequantize_e4m3(_group_view(q, Hkv))
    kg = dequantize_e4m3(k).unsqueeze(2)
    vg = dequantize_e4m3(v).unsqueeze(2)
    x = matmul(qg, kg.transpose(-1, -2)) * (qd * kd).view(B, Hkv, 1, 1, 1) * scale  # (B, Hkv, G, Sq, Sk)
    if softcap > 0:
        x = torch.tanh(x / softcap) * softcap
    rows = torch.arange(Sq, device=q.device)
    cols = torch.arange(Sk, device=q.device)
    slopes = _slopes_view(alibi_slopes, B, Hq, Hkv, f32)
    if slopes is not None:
        x = x - slopes * alibi_bias(rows, cols, Sq, Sk).to(f32)
    if wl >= 0 or wr >= 0:
        x = x.masked_fill(~key_visible(rows, cols, Sq, Sk, wl, wr), NEG_INF)
    m = _safe_max(x.amax(dim=-1, keepdim=True))
    p = torch.exp(x - m) * 2.0 ** p_offset
    l = p.sum(dim=-1, keepdim=True)
    sink = _sinks_view(sinks, Hq, Hkv, f32)
    if sink is not None:
        sink = sink.detach().unsqueeze(-1)
        l = l + torch.exp(sink - m) * 2.0 ** p_offset  # inf when the sink dwarfs the keys: out 0
    acc = matmul(e4m3_round(p) if round_p else p, vg) * vd.view(B, Hkv, 1, 1, 1)
    has = l != 0
    out = torch.where(has, acc / torch.where(has, l, torch.ones_like(l)), torch.zeros_like(acc))
    lse = torch.where(has, m + torch.log(torch.where(has, l, torch.ones_like(l))) - p_offset * LN2,
                      torch.full_like(l, NEG_INF))
    if sink is not None:  # lse itself from the keys' mass and the sink, finite where either is
        keys = p.sum(dim=-1, keepdim=True)
        lse_keys = torch.where(keys != 0, m + torch.log(torch.where(keys != 0, keys, torch.ones_like(keys)))
                               - p_offset * LN2, torch.full_like(keys, NEG_INF))
        lse = torch.logaddexp(lse_keys, sink.expand_as(lse_keys))
    return out.to(out_dtype).reshape(B, Hq, Sq, D), lse.reshape(B, Hq, Sq)


def attention_fp8_forward_blocked(q: Tensor, k: Tensor, v: Tensor, q_descale=None, k_descale=None,
                                  v_descale=None, *, is_causal: bool = False,
                                  scale: Optional[float] = None,
                                  window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                  alibi_slopes: Optional[Tensor] = None,
                                  sinks: Optional[Tensor] = None,
                                  out_dtype: torch.dtype = torch.bfloat16, block_m: int = 64,
                                  block_n: int = 64, max_lag: float = 0.0,
                                  p_offset: float = FP8_P_OFFSET) -> Tuple[Tensor, Tensor]:
    """The FP8 (e4m3) forward, the kernels' algorithm: :func:`attention_forward_blocked`'s
    loop and four steps, with the roundings of the section's comment (scores of the stored
    values times fp32(scale log2 e) * fp32(q_descale k_descale); P = exp2(S - (m -
    p_offset)) in float32, its row sum unrounded, e4m3(P) @ v8 accumulated in float32; O =
    acc * (fp32(1 / l) * v_descale) rounded once to ``out_dtype``).

    q, k, v float8_e4m3fn, (B, Hq, Sq, D) and (B, Hkv, Sk, D); q_descale, k_descale,
    v_descale per tensor or (B, Hkv) (:func:`fp8_descale`; None is 1). Causal, window,
    softcap, ALiBi, GQA and sinks mean what they mean for 16-bit inputs (no dropout, no
    backward). ``max_lag`` (:func:`merge_block_stats`) may only be used with p_offset +
    max_lag <= log2(448): P reaches 2^(p_offset + max_lag). Returns out (B, Hq, Sq, D) in
    ``out_dtype`` (bfloat16 by default) and lse (B, Hq, Sq) float32.
    """
    _check_fp8_inputs(q=q, k=k, v=v)
    _check_fp8_options(out_dtype, p_offset, max_lag)
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    qd, kd, vd = _fp8_descales(q, k, q_descale, k_descale, v_descale)
    return _forward_blocked_loop(q, k, v, is_causal=is_causal, scale=scale, window_size=window_size,
                                 softcap=softcap, alibi_slopes=alibi_slopes, block_m=block_m,
                                 block_n=block_n, max_lag=max_lag, keep_all=None, sinks=sinks,
                                 p_dtype=torch.float8_e4m3fn, out_dtype=out_dtype,
                                 qk_descale=(qd * kd).view(B, Hkv, 1, 1, 1),
                                 v_descale=vd.view(B, Hkv, 1, 1), p_offset=p_offset)


def _varlen_fp8(fn, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                q_descale, k_descale, v_descale, out_dtype: torch.dtype,
                alibi_slopes: Optional[Tensor], **opts) -> Tuple[Tensor, Tensor]:
    """A packed FP8 batch one sequence at a time through ``fn`` (the naive or the blocked FP8
    forward); sequence b takes row b of (B, Hkv) descales (and of (B, Hq) ALiBi slopes)."""
    _check_fp8_inputs(q=q, k=k, v=v)
    total_q, Hq, total_k, Hkv, D = _varlen_sizes(q, k, v)
    spans = _varlen_spans(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    B = len(spans)
    ds = [fp8_descale(d, B, Hkv, n, q.device) for d, n in
          ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale"))]
    out = torch.zeros((total_q, Hq, D), dtype=out_dtype, device=q.device)
    lse = torch.full((Hq, total_q), NEG_INF, dtype=torch.float32, device=q.device)
    for b, (qa, qb, ka, kb) in enumerate(spans):
        o, l = fn(_seq_dense(q, qa, qb), _seq_dense(k, ka, kb), _seq_dense(v, ka, kb),
                  *(d[b:b + 1] for d in ds), out_dtype=out_dtype,
                  alibi_slopes=_seq_slopes(alibi_slopes, b), **opts)
        out[qa:qb] = o[0].transpose(0, 1)
        lse[:, qa:qb] = l[0]
    return out, lse


def attention_fp8_varlen_naive(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                               cu_seqlens_k: Tensor, q_descale=None, k_descale=None, v_descale=None, *,
                               is_causal: bool = False, scale: Optional[float] = None,
                               window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                               alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                               out_dtype: torch.dtype = torch.bfloat16, round_p: bool = True,
                               p_offset: float = FP8_P_OFFSET,
                               matmul: Callable[[Tensor, Tensor], Tensor] = torch.matmul) -> Tuple[Tensor, Tensor]:
    """:func:`attention_fp8_naive` over a packed batch (q (total_q, Hq, D), k / v (total_k,
    Hkv, D), all float8_e4m3fn); (B, Hkv) descales have one row per sequence; ``matmul`` as
    there. Returns out (total_q, Hq, D) in ``out_dtype`` and lse (Hq, total_q) float32."""
    return _varlen_fp8(attention_fp8_naive, q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale,
                       v_descale, out_dtype, alibi_slopes, is_causal=is_causal,
                       scale=_default_scale(scale, q.shape[-1]), window_size=window_size,
                       softcap=softcap, sinks=sinks, round_p=round_p, p_offset=p_offset, matmul=matmul)


def attention_fp8_varlen_forward_blocked(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                         q_descale=None, k_descale=None, v_descale=None, *,
                                         is_causal: bool = False, scale: Optional[float] = None,
                                         window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                         alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                                         out_dtype: torch.dtype = torch.bfloat16, block_m: int = 64, block_n: int = 64,
                                         max_lag: float = 0.0,
                                         p_offset: float = FP8_P_OFFSET) -> Tuple[Tensor, Tensor]:
    """:func:`attention_fp8_forward_blocked` over a packed batch, one sequence at a time, each
    attended as a dense batch entry of its lengths with row b of (B, Hkv) descales. Returns
    out (total_q, Hq, D) in ``out_dtype`` and lse (Hq, total_q) float32."""
    return _varlen_fp8(attention_fp8_forward_blocked, q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale,
                       k_descale, v_descale, out_dtype, alibi_slopes, is_causal=is_causal,
                       scale=_default_scale(scale, q.shape[-1]), window_size=window_size,
                       softcap=softcap, sinks=sinks, block_m=block_m, block_n=block_n,
                       max_lag=max_lag, p_offset=p_offset)


def attention_with_kvcache_fp8_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                         k: Optional[Tensor] = None, v: Optional[Tensor] = None, *,
                                         k_descale=None, v_descale=None, cache_seqlens,
                                         block_table: Optional[Tensor] = None,
                                         is_causal: bool = False, scale: Optional[float] = None,
                                         window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                                         alibi_slopes: Optional[Tensor] = None, num_splits: int = 1,
                                         return_lse: bool = False, block_m: int = 64,
                                         block_n: int = 64, sinks: Optional[Tensor] = None):
    """:func:`attention_with_kvcache_reference` over float8_e4m3fn caches, with float16 /
    bfloat16 queries (see the section's comment for every rounding).

    * k_cache / v_cache float8_e4m3fn, dense (B, Hkv, S_max, D) or paged (num_pages, Hkv,
      page_size, D) with ``block_table``, as for 16-bit caches; ``k_descale`` /
      ``v_descale`` per tensor or (B, Hkv) (:func:`fp8_descale`; None is 1). A paged pool's
      rows take the descales of the sequence that reads them, so pages shared between
      sequences need equal descales.
    * The new k / v ((B, Hkv, S_new, D), q's dtype) are appended quantized:
      e4m3(k[b] / k_descale[b]) (:func:`quantize_e4m3`, saturating at +-448), in place.
    * Then the 16-bit KV-cache algorithm on the stored values: S = (q . k8) in float32
      times fp32(scale log2 e) * k_descale; P rounded to q's dtype for P @ v8; each range's
      O = acc * (fp32(1 / l) * v_descale), combined over the splits as for 16-bit caches.

    Returns out (B, Hq, Sq, D) in q's dtype, and with ``return_lse`` lse (B, Hq, Sq) float32.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None and t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"{name} must be float16 or bfloat16 over an FP8 cache, got "
                            f"{_dtype_name(t.dtype)} (FP8 queries over an FP8 cache are not specified yet)")
    _check_fp8_inputs(k_cache=k_cache, v_cache=v_cache)
    if (k is not None and k.dtype != q.dtype) or (v is not None and v.dtype != q.dtype):
        raise TypeError(f"the new k / v must have q's dtype {_dtype_name(q.dtype)}, got "
                        f"{_dtype_name(k.dtype) if k is not None else None} / "
                        f"{_dtype_name(v.dtype) if v is not None else None}")
    assert q.dim() == 4 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        "q must be (B, Hq, Sq, D) and k_cache / v_cache one 4-D shape"
    B, Hq, Hkv, Sq, D, S_new, cached = _kvcache_shapes(q, k_cache, v_cache, k, v, cache_seqlens,
                                                       block_table, num_splits, alibi_slopes)
    kd = fp8_descale(k_descale, B, Hkv, "k_descale", q.device)
    vd = fp8_descale(v_descale, B, Hkv, "v_descale", q.device)
    scale_log2, wl, wr, acc, _ = _forward_setup(q, scale, is_causal, window_size, Hkv)
    sink_log2 = _sinks_log2(sinks, Hq, Hkv, acc)

    # The append comes first, quantized with the descales the attention then reads it with.
    if S_new > 0:
        for b, c in enumerate(cached):
            _write_kvcache(k_cache, block_table, b, c, quantize_e4m3(k[b], kd[b].view(Hkv, 1, 1)))
            _write_kvcache(v_cache, block_table, b, c, quantize_e4m3(v[b], vd[b].view(Hkv, 1, 1)))

    return _kvcache_attend(q, k_cache, v_cache, block_table, cached, S_new, scale_log2, wl, wr,
                           softcap, alibi_slopes, num_splits, block_m, block_n, sink_log2,
                           return_lse, kd, vd)


__all__ += ["E4M3_MAX", "FP8_P_OFFSET", "e4m3_round", "quantize_e4m3", "dequantize_e4m3", "fp8_descale",
            "attention_fp8_naive", "attention_fp8_forward_blocked", "attention_fp8_varlen_naive",
            "attention_fp8_varlen_forward_blocked", "attention_with_kvcache_fp8_reference"]
