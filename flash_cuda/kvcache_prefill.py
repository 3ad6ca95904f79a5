"""The prefill route of :func:`flash_cuda.attention_with_kvcache` for the calls the split-KV decode
kernels would otherwise run: a prompt chunk (more than :data:`DECODE_MAX_QUERIES` queries per
sequence) against a paged cache, or with the cached lengths in a tensor ``cache_seqlens``.

The decode kernels pack a KV group's query rows into tiles of at most 64 and stream every key of
the sequence once per tile: the right plan for a few rows, but a 2k-token chunk re-reads the keys
dozens of times where attention()'s query-tiled forward reads them once per query tile at tensor
core speed. This route therefore

1. appends the new keys / values in place (one scatter per cache, the slots computed on the
   device: position ``p`` of sequence ``b`` is row ``p % page_size`` of page
   ``block_table[b, p // page_size]``, or row ``p`` of entry ``b`` of a dense cache);
2. gathers each sequence's keys ``0 .. L_b - 1`` (``L_b = cache_seqlens[b] + seqlen_new``) from
   the cache into a packed ``(sum L_b, kv_heads, head_dim)`` K and V (one gather per cache);
3. runs attention()'s forward on them: the dense forward when every sequence has the same
   length (q and out stay in the caller's layout, nothing else is copied), else the packed
   (varlen) forward with ``cu_seqlens_q = arange(B + 1) * seqlen_q`` and ``cu_seqlens_k`` the
   running sum of the ``L_b``. When every sequence starts empty (a prompt's first chunk) the
   keys are k / v themselves: nothing is gathered.

Both forwards align every mask bottom-right per sequence (query ``i`` of a sequence of ``Sq``
queries and ``Sk`` keys sits on diagonal ``i + Sk - Sq``: ``reference.key_visible``), which with
``Sk = L_b`` is attention_with_kvcache's own definition (``reference.attention_with_kvcache_reference``),
windows and the ALiBi distance included. So every option passes through unchanged: scale, window,
softcap, ALiBi slopes (per head or per sequence), sinks. ``num_splits`` (the decode kernels' key
ranges) has no meaning here and is ignored, as on the dense-cache prefill route.

Values the decode kernels would clamp are clamped the same way here, so wrong ones give wrong
results, never an access outside the cache: a length to ``[0, capacity - seqlen_new]``, a page
id to ``[0, num_pages - 1]``.

Costs: the gather reads and writes each element of K and V once (4 bytes of traffic per 16-bit
element) where the forward does about ``4 * Sq * Hq / Hkv`` flops per element: at a 2k-token
chunk and Hq / Hkv = 4 about 5% of the forward's time (estimated from an H100's flops per byte,
not measured), more for short chunks. The
packed forward also copies q into rows and out back (the dense one does not, nor does either for
q and out in (B, S, H, D) memory). The gathered K and V take ``2 * sum L_b * kv_heads *
head_dim`` elements: sequences are taken in consecutive groups of at most
:data:`GATHER_BUDGET_BYTES` of gathered keys (one forward per group; a single longer sequence is
a group alone), so a large batch of long sequences does not need its whole cache twice.
With a tensor ``cache_seqlens`` the lengths are read to the host to size the gather: one device
sync per call (an int length needs none), so this route is not CUDA-graph capturable; under
capture the call keeps the decode kernels (:func:`takes_route`), whose launch depends on shapes
alone: decode steps and captured prompt chunks replay as before.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .ops import fwd_impl, varlen_fwd_impl
from .validation import ScoreOptions

__all__ = ["DECODE_MAX_QUERIES", "GATHER_BUDGET_BYTES", "takes_route", "cache_slots", "gathered_prefill"]

# Queries per sequence up to which the split-KV decode kernels run a KV-cache call
# (tiers/mma/family.h: decode::kMaxDecodeQueries, the bound attention() uses too).
DECODE_MAX_QUERIES = 16

# Gathered K + V bytes per forward at most (sequences in consecutive groups): 1 GiB is about
# 260k keys at 8 KV heads of 128, so every group's forward is still long next to its gather.
GATHER_BUDGET_BYTES = 1 << 30


def takes_route(q: Tensor, lens: Optional[Tensor], block_table: Optional[Tensor]) -> bool:
    """Whether a validated call runs here: a prompt chunk against a paged cache or with a tensor
    ``cache_seqlens`` (``lens``), outside CUDA graph capture. (A dense cache with an int length
    has its own prefill route, in :func:`flash_cuda.kvcache_ops.run_kvcache`.)"""
    if q.shape[2] <= DECODE_MAX_QUERIES or (lens is None and block_table is None):
        return False
    # The route sizes its buffers by the lengths read on the host, which a capture cannot record:
    # a captured prefill step keeps the decode kernels (slower, but a graph replays them right).
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def cache_slots(block_table: Optional[Tensor], num_pages: int, page_size: int, seq: Tensor,
                pos: Tensor) -> Tuple[Tensor, Tensor]:
    """Where position ``pos`` of sequence ``seq`` lives in a cache seen as (first, head, second,
    dim): (first, second) = (seq, pos) in a dense cache; in a paged one (page, row) with page =
    ``block_table[seq, pos // page_size]`` and row = ``pos % page_size``. Page ids are clamped to
    the pool, as the kernels clamp them: a wrong id reads or writes a wrong page, never memory
    outside the pool. ``seq`` and ``pos`` are int64 tensors of one broadcast shape."""
    if block_table is None:
        return seq, pos
    pages = block_table.long()[seq, pos // page_size].clamp_(0, num_pages - 1)
    return pages, pos % page_size


def _words(*ts: Tensor) -> Tuple[Tensor, ...]:
    """The tensors viewed as int64 words along their last dimension (a row of D 16-bit values as
    D / 4 words) when every one of them allows it, else unchanged. The index kernels that append
    and gather move one element per thread step: 8-byte elements move the same rows in a quarter
    of the steps. The caches' rows are 16-byte aligned (checked), so for them the view exists;
    k / v need not be."""
    def viewable(t: Tensor) -> bool:
        es = t.element_size()
        return (t.shape[-1] * es % 8 == 0 and t.storage_offset() * es % 8 == 0
                and all(s * es % 8 == 0 for s in t.stride()[:-1]))

    if all(viewable(t) for t in ts):
        return tuple(t.view(torch.int64) for t in ts)
    return ts


def _append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, block_table: Optional[Tensor],
            start) -> None:
    """k / v (B, Hkv, s_new, D) written in place at positions start[b] .. start[b] + s_new - 1
    (``start``: an int64 (B, 1) tensor, or an int for every sequence)."""
    B, _, s_new, _ = k.shape
    dev = k.device
    seq = torch.arange(B, device=dev).view(B, 1)
    pos = start + torch.arange(s_new, device=dev)  # (B, s_new), or (s_new,) broadcast against seq
    first, second = cache_slots(block_table, k_cache.shape[0], k_cache.shape[2], seq, pos)
    for cache, new in ((k_cache, k), (v_cache, v)):
        cache_w, new_w = _words(cache, new)
        # Indices split by the head slice index the leading dims: (B, s_new, Hkv, W) = k's rows.
        cache_w[first, :, second] = new_w.transpose(1, 2)


def _gather(cache: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """The cache rows (first[i], :, second[i]) as a contiguous (n, Hkv, D) tensor."""
    (cache_w,) = _words(cache)
    return cache_w[first, :, second].view(cache.dtype)


def _groups(lengths: List[int], row_bytes: int) -> List[Tuple[int, int]]:
    """[b0, b1) ranges of consecutive sequences whose gathered keys take at most
    GATHER_BUDGET_BYTES together (``row_bytes`` per key); at least one sequence each."""
    groups, first, used = [], 0, 0
    for b, n in enumerate(lengths):
        if b > first and used + n * row_bytes > GATHER_BUDGET_BYTES:
            groups.append((first, b))
            first, used = b, 0
        used += n * row_bytes
    groups.append((first, len(lengths)))
    return groups


def _attend(q: Tensor, k_rows: Tensor, v_rows: Tensor, lengths: List[int], lk: Tensor, opts: ScoreOptions,
            sinks: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """attention()'s forward of q (G, Hq, Sq, D) over the gathered rows of G sequences (lengths
    on the host, ``lk`` the same as an int64 tensor on the device): (out (G, Hq, Sq, D), lse
    (G, Hq, Sq))."""
    G, Hq, Sq, D = q.shape
    Hkv = k_rows.shape[1]
    if all(n == lengths[0] for n in lengths):
        # One length: a dense batch, q and out in the caller's layout (no copy of either).
        L = lengths[0]
        k_dense = k_rows.view(G, L, Hkv, D).transpose(1, 2)
        v_dense = v_rows.view(G, L, Hkv, D).transpose(1, 2)
        out, lse, _ = fwd_impl(q, k_dense, v_dense, opts, 0, sinks)
        return out, lse
    dev = q.device
    cu_q = torch.arange(0, (G + 1) * Sq, Sq, dtype=torch.int32, device=dev)
    cu_k = torch.zeros(G + 1, dtype=torch.int32, device=dev)
    torch.cumsum(lk, 0, dtype=torch.int32, out=cu_k[1:])
    q_rows = q.transpose(1, 2).reshape(G * Sq, Hq, D)  # a view when q is (B, Sq, Hq, D) in memory
    out, lse, _ = varlen_fwd_impl(q_rows, k_rows, v_rows, cu_q, cu_k, Sq, max(lengths), opts, 0, False, sinks)
    return out.view(G, Sq, Hq, D).transpose(1, 2), lse.view(Hq, G, Sq).transpose(0, 1)


def gathered_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                     lens: Optional[Tensor], cache_len: int, block_table: Optional[Tensor], opts: ScoreOptions,
                     sinks: Optional[Tensor], return_lse: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """The route (see the module docstring) for a validated call: (out like ``torch.empty_like(q)``,
    lse float32 (B, Hq, Sq) or None unless ``return_lse``), the caches appended in place.
    ``lens``: the tensor cache_seqlens (int32, contiguous), or None and ``cache_len`` the int."""
    B, Hq, Sq, D = q.shape
    s_new = 0 if k is None else k.shape[2]
    dev = q.device
    capacity = k_cache.shape[2] * (1 if block_table is None else block_table.shape[1])
    top = capacity - s_new  # the most tokens a sequence may hold before this call
    if lens is None:
        cached = [cache_len] * B
        start = cache_len
        lk = torch.full((B,), cache_len + s_new, dtype=torch.int64, device=dev)
    else:
        # The route's one device sync: the gathered K / V and the forward's grid are sized by the
        # lengths (the packed-queries route syncs likewise; a decode step never comes here).
        cached = [min(max(n, 0), top) for n in lens.tolist()]
        start = lens.clamp(0, top).long().view(B, 1)
        lk = start.view(B) + s_new
    if s_new:
        _append(k_cache, v_cache, k, v, block_table, start)
        if not any(cached):
            # Every sequence started empty (a prompt's first chunk): its keys are k / v themselves.
            out, lse, _ = fwd_impl(q, k, v, opts, 0, sinks)
            return out, (lse if return_lse else None)
    lengths = [n + s_new for n in cached]
    Hkv = k_cache.shape[1]
    results = []
    for b0, b1 in _groups(lengths, 2 * Hkv * D * k_cache.element_size()):
        lengths_g, lk_g = lengths[b0:b1], lk[b0:b1]
        total = sum(lengths_g)
        # Key r of the group belongs to sequence seq[r] at its position r - (its first key).
        seq = torch.repeat_interleave(torch.arange(b1 - b0, device=dev), lk_g, output_size=total)
        firsts = torch.cumsum(lk_g, 0, dtype=torch.int64) - lk_g
        pos = torch.arange(total, device=dev) - firsts[seq]
        first, second = cache_slots(block_table, k_cache.shape[0], k_cache.shape[2], seq + b0, pos)
        slopes = opts.alibi_slopes
        if slopes is not None and slopes.dim() == 2:  # per sequence: the group's rows
            slopes = slopes[b0:b1]
        opts_g = ScoreOptions(opts.scale, opts.window_left, opts.window_right, opts.softcap, slopes)
        results.append(_attend(q[b0:b1], _gather(k_cache, first, second), _gather(v_cache, first, second),
                               lengths_g, lk_g, opts_g, sinks))
    out_g, lse_g = results[0]
    if len(results) == 1 and out_g.stride() == torch.empty_like(q, device="meta").stride():
        out = out_g
    else:  # the packed forward's rows, or several groups: into q's layout, as the decode route returns it
        out = torch.empty_like(q)
        b0 = 0
        for o, _ in results:
            out[b0:b0 + o.shape[0]].copy_(o)
            b0 += o.shape[0]
    if not return_lse:
        return out, None
    lse = torch.cat([l for _, l in results]) if len(results) > 1 else lse_g
    return out, lse.contiguous()
