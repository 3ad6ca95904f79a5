"""The executable specification of flash_cuda, in plain PyTorch (any device, any dtype).

Semantics shared by every function here and by the CUDA kernels:

* q is (B, Hq, Sq, D); k and v are (B, Hkv, Sk, D) with Hq % Hkv == 0; query head h uses
  key/value head h // (Hq // Hkv) (grouped-query attention).
* scores S = scale * q @ k^T, scale defaulting to 1 / sqrt(D).
* causal masking is bottom-right aligned: query i sees key j iff j <= i + Sk - Sq.
* lse_i = log(sum over visible j of exp(S_ij)) (natural log). A row that sees no key has
  output 0 and lse = -inf, never NaN; it contributes nothing to any gradient.

Three implementations:

* :func:`attention_naive` materialises S in the inputs' dtype. Run on float64 copies it
  is the ground truth of the tests; run in the inputs' own dtype it is the "naive
  attention in the same precision" whose error sets the tolerance of the kernels.
* :func:`attention_forward_blocked` is the kernels' forward algorithm step by step: query
  blocks of ``block_m`` rows, key/value blocks of ``block_n`` rows, online softmax in the
  log2 domain, causal block skipping, and the same four steps under the same names as
  the ``__device__`` functions (compute_qk_scores_and_max, merge_block_stats,
  compute_block_softmax_and_weighted_v, normalize_output).
* :func:`attention_backward_blocked` is the FlashAttention-2 backward the kernels use:
  the delta preprocess, dK/dV per key/value block (looping over query blocks and over
  the query heads of a GQA group), dQ per query block.

Every (batch, head) pair runs the same block loop, so the blocked functions vectorise
over batch and heads and loop in Python only over blocks.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "attention_naive",
    "attention_forward_blocked",
    "attention_backward_blocked",
    "compute_qk_scores_and_max",
    "merge_block_stats",
    "compute_block_softmax_and_weighted_v",
    "normalize_output",
    "causal_visible",
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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the kernels: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _round_like_kernel(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Operands that the tensor-core kernels feed to an MMA are rounded to the 16-bit input
    dtype (P before P @ V, dS before dS @ K); fp32/fp64 keep full precision."""
    if dtype in (torch.float16, torch.bfloat16):
        return x.to(dtype).to(x.dtype)
    return x


def causal_visible(rows: Tensor, cols: Tensor, sq: int, sk: int) -> Tensor:
    """Bool (len(rows), len(cols)): query row i sees key j iff j <= i + sk - sq."""
    return cols.view(1, -1) <= rows.view(-1, 1) + (sk - sq)


def _key_visible(rows: Tensor, cols: Tensor, sq: int, sk: int, is_causal: bool) -> Tensor:
    """The kernels' key_visible(): inside the keys and, under causal masking, not above
    the (bottom-right aligned) diagonal."""
    vis = (cols < sk).view(1, -1).expand(rows.numel(), cols.numel())
    if is_causal:
        vis = vis & causal_visible(rows, cols, sq, sk)
    return vis


def _safe_max(m: Tensor) -> Tensor:
    """The kernels' safe_max(): a running max of -inf (no visible key yet) is used as 0,
    so that exp2(-inf - (-inf)) = NaN never happens."""
    return torch.where(m == NEG_INF, torch.zeros_like(m), m)


def _group_view(x: Tensor, hkv: int) -> Tensor:
    """(B, Hq, S, D) -> (B, Hkv, G, S, D): the query heads of one GQA group side by side."""
    B, H, S, D = x.shape
    return x.reshape(B, hkv, H // hkv, S, D)


# ---------------------------------------------------------------------------------------
# Naive attention
# ---------------------------------------------------------------------------------------


def attention_naive(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False,
                    scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """Attention with the full score matrix, computed in the inputs' dtype.

    Returns (out, lse): out like q's shape and dtype, lse (B, Hq, Sq) in the inputs'
    dtype. Differentiable with torch autograd (also through lse), and NaN-free for rows
    that see no key (out 0, lse -inf, zero gradients).
    """
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    scale = _default_scale(scale, D)
    qg = _group_view(q, Hkv)  # (B, Hkv, G, Sq, D)
    kg = k.unsqueeze(2)  # (B, Hkv, 1, Sk, D): broadcast over the group, never repeated
    vg = v.unsqueeze(2)
    s = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # (B, Hkv, G, Sq, Sk)
    if is_causal:
        rows = torch.arange(Sq, device=q.device)
        cols = torch.arange(Sk, device=q.device)
        # masked_fill (not an additive -inf bias) also zeroes the gradient of masked
        # entries, which keeps fully masked rows NaN-free in the backward.
        s = s.masked_fill(~causal_visible(rows, cols, Sq, Sk), NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows without a visible key
    lse_safe = torch.where(lse == NEG_INF, torch.zeros_like(lse), lse)
    p = torch.exp(s - lse_safe.unsqueeze(-1))  # masked entries: exp(-inf) = 0
    out = torch.matmul(p, vg)  # (B, Hkv, G, Sq, D)
    return out.reshape(B, Hq, Sq, D), lse.reshape(B, Hq, Sq)


# ---------------------------------------------------------------------------------------
# Blocked forward: the four steps of the kernels
# ---------------------------------------------------------------------------------------


def compute_qk_scores_and_max(q_blk: Tensor, k_blk: Tensor, scale_log2: float,
                              visible: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Step 1: S = (q_blk @ k_blk^T) * scale * log2(e), masked, and its row maxima.

    q_blk (..., G, bm, D) and k_blk (..., 1, bn, D) in the accumulation dtype; ``visible``
    is a (bm, bn) bool mask or None when the block needs no masking (the kernels skip the
    mask work for blocks strictly below the diagonal and inside the keys).
    Returns (s, block_max) with s in the log2 domain and masked entries at -inf.
    """
    s = torch.matmul(q_blk, k_blk.transpose(-1, -2)) * scale_log2
    if visible is not None:
        s = s.masked_fill(~visible, NEG_INF)
    return s, s.amax(dim=-1)


def merge_block_stats(row_max: Tensor, row_sum: Tensor, acc_o: Tensor,
                      block_max: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Step 2: fold a block's row maxima into the running statistics.

    The running sum and the output accumulator were computed against the old max, so both
    are rescaled by alpha = exp2(m_old - m_new). A row that has seen only masked keys keeps
    m = -inf and gets alpha = 0 (its accumulators are still zero).
    """
    m_new = torch.maximum(row_max, block_max)
    alpha = torch.exp2(row_max - _safe_max(m_new))
    return m_new, row_sum * alpha, acc_o * alpha.unsqueeze(-1)


def compute_block_softmax_and_weighted_v(s: Tensor, row_sum: Tensor, acc_o: Tensor,
                                         row_max: Tensor, v_blk: Tensor,
                                         in_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Step 3: P = exp2(S - m) (masked entries -> 0), l += rowsum(P), O += P @ V.

    The row sum uses P in the accumulation dtype; the P @ V product uses P rounded to the
    16-bit input dtype for fp16/bf16 inputs, as the tensor-core kernels do.
    """
    p = torch.exp2(s - _safe_max(row_max).unsqueeze(-1))
    row_sum = row_sum + p.sum(dim=-1)
    acc_o = acc_o + torch.matmul(_round_like_kernel(p, in_dtype), v_blk)
    return row_sum, acc_o


def normalize_output(acc_o: Tensor, row_sum: Tensor, row_max: Tensor,
                     out_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """Step 4: O /= l and lse = (m + log2 l) * ln 2; a row with l == 0 (no visible key)
    gets O = 0 and lse = -inf."""
    has_keys = row_sum != 0  # NaN rows stay NaN (a NaN input must not look like "no key")
    inv = torch.where(has_keys, 1.0 / torch.where(has_keys, row_sum, torch.ones_like(row_sum)),
                      torch.zeros_like(row_sum))
    out = (acc_o * inv.unsqueeze(-1)).to(out_dtype)
    lse = torch.where(has_keys, (row_max + torch.log2(torch.where(has_keys, row_sum,
                                                                  torch.ones_like(row_sum)))) * LN2,
                      torch.full_like(row_sum, NEG_INF))
    return out, lse


def _query_block_key_end(row0: int, rows: int, sq: int, sk: int, is_causal: bool) -> int:
    """Keys a query block can see: all, or up to the diagonal of its last row (causal)."""
    if not is_causal:
        return sk
    return max(0, min(sk, row0 + rows + sk - sq))


def _needs_mask(key_base: int, block_n: int, row0: int, sq: int, sk: int, is_causal: bool) -> bool:
    return key_base + block_n > sk or (is_causal and key_base + block_n - 1 > row0 + sk - sq)


def attention_forward_blocked(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False,
                              scale: Optional[float] = None, block_m: int = 64,
                              block_n: int = 64) -> Tuple[Tensor, Tensor]:
    """The kernels' forward: returns (out in q's dtype, lse in float32 — float64 for float64
    inputs). Memory per step is O(block_m * block_n), never O(Sq * Sk)."""
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    scale = _default_scale(scale, D)
    scale_log2 = scale * LOG2E
    acc = _acc_dtype(q.dtype)
    G = Hq // Hkv
    dev = q.device

    qg = _group_view(q, Hkv)
    out = torch.empty((B, Hkv, G, Sq, D), dtype=q.dtype, device=dev)
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

        key_end = _query_block_key_end(row0, rows, Sq, Sk, is_causal)
        for key_base in range(0, key_end, block_n):
            cols = min(block_n, Sk - key_base)
            col_idx = torch.arange(key_base, key_base + block_n, device=dev)
            k_blk = k[:, :, key_base:key_base + cols].to(acc).unsqueeze(2)
            v_blk = v[:, :, key_base:key_base + cols].to(acc).unsqueeze(2)
            if cols < block_n:  # zero-filled past the end of the keys (masked anyway)
                k_blk = torch.nn.functional.pad(k_blk, (0, 0, 0, block_n - cols))
                v_blk = torch.nn.functional.pad(v_blk, (0, 0, 0, block_n - cols))
            visible = None
            if _needs_mask(key_base, block_n, row0, Sq, Sk, is_causal):
                visible = _key_visible(row_idx, col_idx, Sq, Sk, is_causal)

            s, block_max = compute_qk_scores_and_max(q_blk, k_blk, scale_log2, visible)
            row_max, row_sum, acc_o = merge_block_stats(row_max, row_sum, acc_o, block_max)
            row_sum, acc_o = compute_block_softmax_and_weighted_v(s, row_sum, acc_o, row_max,
                                                                  v_blk, q.dtype)

        o_blk, lse_blk = normalize_output(acc_o, row_sum, row_max, q.dtype)
        out[:, :, :, row0:row0 + rows] = o_blk[..., :rows, :]
        lse[:, :, :, row0:row0 + rows] = lse_blk[..., :rows]

    return out.reshape(B, Hq, Sq, D), lse.reshape(B, Hq, Sq)


# ---------------------------------------------------------------------------------------
# Blocked backward (FlashAttention-2)
# ---------------------------------------------------------------------------------------


def _recompute_p(q_blk: Tensor, k_blk: Tensor, lse_log2_blk: Tensor, scale_log2: float,
                 visible: Optional[Tensor]) -> Tensor:
    """P = exp2(S * scale * log2(e) - lse * log2(e)) for one (query block, key block) tile.
    Rows with lse = -inf (no visible key) get P = 0 instead of exp2(+inf)."""
    s = torch.matmul(q_blk, k_blk.transpose(-1, -2)) * scale_log2
    if visible is not None:
        s = s.masked_fill(~visible, NEG_INF)
    row_ok = (lse_log2_blk != NEG_INF).unsqueeze(-1)
    p = torch.exp2(s - torch.where(row_ok, lse_log2_blk.unsqueeze(-1), torch.zeros_like(s[..., :1])))
    return torch.where(row_ok, p, torch.zeros_like(p))


def _recompute_p_ds(q_blk: Tensor, do_blk: Tensor, k_blk: Tensor, v_blk: Tensor,
                    lse_log2_blk: Tensor, delta_blk: Tensor, scale_log2: float,
                    visible: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """(P, dS) for one (query block, key block) tile, as both backward kernels recompute
    them: P from lse, dP = dO V^T, dS = P * (dP - delta)."""
    p = _recompute_p(q_blk, k_blk, lse_log2_blk, scale_log2, visible)
    dp = torch.matmul(do_blk, v_blk.transpose(-1, -2))
    return p, p * (dp - delta_blk.unsqueeze(-1))


def _bwd_preprocess(dout: Tensor, out: Tensor, dlse: Optional[Tensor], acc: torch.dtype) -> Tensor:
    """delta_i = rowsum(dO_i * O_i) - dlse_i."""
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    return delta


def attention_backward_blocked(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                               lse: Tensor, *, is_causal: bool = False,
                               scale: Optional[float] = None, dlse: Optional[Tensor] = None,
                               block_m: int = 64, block_n: int = 64) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) in the inputs' dtype, from the forward's out and lse.

    With P = exp(scale * S - lse), dP = dO V^T, dS = P * (dP - delta):
    dV = P^T dO, dK = scale * dS^T Q, dQ = scale * dS K. ``dlse`` (optional, (B, Hq, Sq))
    is the upstream gradient of lse; it enters only through delta.
    """
    B, Hq, Hkv, Sq, Sk, D = _sizes(q, k, v)
    scale = _default_scale(scale, D)
    scale_log2 = scale * LOG2E
    acc = _acc_dtype(q.dtype)
    dt = q.dtype
    dev = q.device

    delta = _group_view(_bwd_preprocess(dout, out, dlse, acc).unsqueeze(-1), Hkv).squeeze(-1)
    lse_log2 = _group_view((lse.to(acc) * LOG2E).unsqueeze(-1), Hkv).squeeze(-1)  # (B,Hkv,G,Sq)
    qg = _group_view(q, Hkv).to(acc)
    dog = _group_view(dout, Hkv).to(acc)
    k_acc = k.to(acc).unsqueeze(2)
    v_acc = v.to(acc).unsqueeze(2)

    dq = torch.empty((B, Hkv, qg.shape[2], Sq, D), dtype=dt, device=dev)
    dk = torch.empty((B, Hkv, Sk, D), dtype=dt, device=dev)
    dv = torch.empty((B, Hkv, Sk, D), dtype=dt, device=dev)

    # ---- dK, dV: one key/value block at a time, looping over the query blocks that can
    #      see it and (summed inside the matmuls) over the query heads of the GQA group.
    for key_base in range(0, Sk, block_n):
        cols = min(block_n, Sk - key_base)
        col_idx = torch.arange(key_base, key_base + cols, device=dev)
        k_blk = k_acc[:, :, :, key_base:key_base + cols]
        v_blk = v_acc[:, :, :, key_base:key_base + cols]
        dk_acc = torch.zeros((B, Hkv, cols, D), dtype=acc, device=dev)
        dv_acc = torch.zeros((B, Hkv, cols, D), dtype=acc, device=dev)
        # Under causal masking the first query that sees key c is i = c - (Sk - Sq).
        first_row = max(0, key_base - (Sk - Sq)) if is_causal else 0
        for row0 in range((first_row // block_m) * block_m, Sq, block_m):
            rows = min(block_m, Sq - row0)
            row_idx = torch.arange(row0, row0 + rows, device=dev)
            visible = _key_visible(row_idx, col_idx, Sq, Sk, is_causal) if is_causal else None
            q_blk = qg[:, :, :, row0:row0 + rows]
            do_blk = dog[:, :, :, row0:row0 + rows]
            p, ds = _recompute_p_ds(q_blk, do_blk, k_blk, v_blk, lse_log2[..., row0:row0 + rows],
                                    delta[..., row0:row0 + rows], scale_log2, visible)
            # dV += P^T dO, summed over the group's query heads
            dv_acc += torch.matmul(_round_like_kernel(p, dt).transpose(-1, -2), do_blk).sum(dim=2)
            # dK += dS^T Q, summed over the group's query heads
            dk_acc += torch.matmul(_round_like_kernel(ds, dt).transpose(-1, -2), q_blk).sum(dim=2)
        dk[:, :, key_base:key_base + cols] = (dk_acc * scale).to(dt)
        dv[:, :, key_base:key_base + cols] = dv_acc.to(dt)

    # ---- dQ: one query block at a time over the key blocks it sees.
    for row0 in range(0, Sq, block_m):
        rows = min(block_m, Sq - row0)
        row_idx = torch.arange(row0, row0 + rows, device=dev)
        q_blk = qg[:, :, :, row0:row0 + rows]
        do_blk = dog[:, :, :, row0:row0 + rows]
        dq_acc = torch.zeros((B, Hkv, qg.shape[2], rows, D), dtype=acc, device=dev)
        key_end = _query_block_key_end(row0, rows, Sq, Sk, is_causal)
        for key_base in range(0, key_end, block_n):
            cols = min(block_n, Sk - key_base)
            col_idx = torch.arange(key_base, key_base + cols, device=dev)
            visible = _key_visible(row_idx, col_idx, Sq, Sk, is_causal) if is_causal else None
            k_blk = k_acc[:, :, :, key_base:key_base + cols]
            v_blk = v_acc[:, :, :, key_base:key_base + cols]
            _, ds = _recompute_p_ds(q_blk, do_blk, k_blk, v_blk, lse_log2[..., row0:row0 + rows],
                                    delta[..., row0:row0 + rows], scale_log2, visible)
            dq_acc += torch.matmul(_round_like_kernel(ds, dt), k_blk)
        dq[:, :, :, row0:row0 + rows] = (dq_acc * scale).to(dt)

    return dq.reshape(B, Hq, Sq, D), dk, dv
