"""The custom ops behind :func:`flash_cuda.attention_with_kvcache` and the extension calls they
make, which the eager path makes too (without the op's dispatch).

* ``flash_cuda::fwd_kvcache``: the ``torch.library`` custom op, declared as mutating
  ``k_cache`` and ``v_cache`` (so functionalization under ``torch.compile`` keeps the append),
  with a fake implementation: ``torch.compile(fullgraph=True)`` traces a decode step without
  a graph break. It always returns ``(out, lse)``; lse is an empty float32 ``(0,)`` tensor
  unless ``return_lse``. :func:`run_kvcache` is its call: the split-KV decode kernels for up to
  :data:`DECODE_MAX_QUERIES` queries per sequence; for a prompt chunk (more) the query-tiled
  forward of :func:`flash_cuda.attention` after the append: here over the cache's rows for a
  dense cache with an int length, else (pages, tensor lengths) in the binding, over the cache laid
  out densely on the device (csrc/core/kv_gather.cuh; no sync, so CUDA graphs capture it).
* ``flash_cuda::fwd_kvcache_packed``: the same for packed (varlen) queries (``cu_seqlens_q``),
  today a scatter for the appends and one binding call per distinct chunk length
  (:func:`run_kvcache_packed`).

The arguments come validated by :mod:`flash_cuda.kvcache_checks`; what only a run can see (the
caches' addresses, and with ``check_inputs`` the values of the lengths and page ids) is
checked here.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _ext
from .kvcache_checks import (ENV_CHECK, PAGE_SIZE_MULTIPLE, check_alignment, check_cu_seqlens_q, check_enabled,
                             check_values)
from .ops import fwd_impl
from .validation import ENVIRON, ScoreOptions, env_key

__all__ = ["DECODE_MAX_QUERIES", "ENV_CHECK_KEY", "cache_slots", "fwd_kvcache", "fwd_kvcache_packed", "run_kvcache",
           "run_kvcache_fp8", "run_kvcache_packed"]

# Queries per sequence up to which the split-KV decode kernels run a KV-cache call
# (tiers/mma/family.h: decode::kMaxDecodeQueries, the bound attention() uses too).
DECODE_MAX_QUERIES = 16
# ENV_CHECK as a key of validation.ENVIRON: ``ENV_CHECK_KEY in ENVIRON`` tells at once whether the
# variable is set at all (kvcache_checks.check_enabled then reads its value).
ENV_CHECK_KEY = env_key(ENV_CHECK)


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


_side_streams: dict = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for the prefill path's cache writes."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


# ---------------------------------------------------------------------------------------
# The extension call (and its routes) behind the op and the eager path
# ---------------------------------------------------------------------------------------


def _check_cache_values(q, k_cache, k, lens, cache_len, block_table, check_inputs) -> None:
    """check_inputs=True (or FLASH_CUDA_CHECK_KVCACHE=1): the cached lengths and the page ids they
    use read back and checked against the cache (kvcache_checks.check_values)."""
    if check_enabled(check_inputs):
        B, s_new = q.shape[0], 0 if k is None else k.shape[2]
        capacity = k_cache.shape[2] * (1 if block_table is None else block_table.shape[1])
        check_values(lens.tolist() if lens is not None else [cache_len] * B, block_table, s_new, capacity,
                     k_cache.shape[0])


def run_kvcache(C, q, k_cache, v_cache, k, v, lens, cache_len, block_table, scale, window_left, window_right,
                softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks=None):
    """The validated call: (out, lse), lse None unless ``return_lse``. ``lens`` (the tensor
    ``cache_seqlens``, contiguous) or ``cache_len`` (the int) gives the cached lengths; ``sinks``
    float32 and contiguous, or None."""
    if check_inputs or ENV_CHECK_KEY in ENVIRON:
        _check_cache_values(q, k_cache, k, lens, cache_len, block_table, check_inputs)
    if lens is None and block_table is None and q.shape[2] > DECODE_MAX_QUERIES:
        # Prefill against a dense cache whose length the host knows: the append is a copy, and the
        # attention is attention()'s query-tiled forward over the filled rows, which runs
        # prompt-sized work at that forward's speed (the decode kernels stream keys for few rows).
        opts = ScoreOptions(scale, window_left, window_right, softcap, alibi_slopes)
        s_new = 0 if k is None else k.shape[2]
        total = cache_len + s_new
        if cache_len == 0 and s_new and q.is_cuda:
            # An empty cache: the keys are k / v themselves. The append runs on a side stream
            # beside the (compute-bound) attention instead of before it; the call's stream waits
            # for it before returning (a fork and a join, which CUDA graph capture keeps).
            main = torch.cuda.current_stream(q.device)
            side = _side_stream(q.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                k_cache[:, :, :s_new].copy_(k)
                v_cache[:, :, :s_new].copy_(v)
            out, lse, _ = fwd_impl(q, k, v, opts, 0, sinks)
            main.wait_stream(side)
        else:
            if s_new:
                k_cache[:, :, cache_len:total].copy_(k)
                v_cache[:, :, cache_len:total].copy_(v)
            out, lse, _ = fwd_impl(q, k_cache[:, :, :total], v_cache[:, :, :total], opts, 0, sinks)
        return out, (lse if return_lse else None)
    if sinks is None:  # (the binding's sinks argument is optional; leaving it out keeps older stand-ins working)
        return C.fwd_kvcache(q, k_cache, v_cache, k, v, lens, cache_len, block_table, scale, window_left,
                             window_right, softcap, alibi_slopes, num_splits, return_lse)
    return C.fwd_kvcache(q, k_cache, v_cache, k, v, lens, cache_len, block_table, scale, window_left, window_right,
                         softcap, alibi_slopes, num_splits, return_lse, sinks)


def run_kvcache_fp8(C, q, k_cache, v_cache, k, v, lens, cache_len, block_table, scale, window_left, window_right,
                    softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks, k_descale, v_descale):
    """The validated FP8 cache call (kvcache_checks.validate_fp8): (out, lse) as
    :func:`run_kvcache`, every query count through the decode kernels (they quantize the new rows
    as they store them); k_descale / v_descale float32 (batch, kv_heads), contiguous."""
    if check_inputs or ENV_CHECK_KEY in ENVIRON:
        _check_cache_values(q, k_cache, k, lens, cache_len, block_table, check_inputs)
    return C.fwd_kvcache(q, k_cache, v_cache, k, v, lens, cache_len, block_table, scale, window_left, window_right,
                         softcap, alibi_slopes, num_splits, return_lse, sinks, k_descale=k_descale,
                         v_descale=v_descale)


@torch.library.custom_op("flash_cuda::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                cache_seqlens: Optional[Tensor], cache_len: int, block_table: Optional[Tensor], scale: float,
                window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                num_splits: int, return_lse: bool, check_inputs: bool,
                sinks: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                v_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention against a KV cache after appending k / v to it in place: (out, lse), lse empty
    (0,) unless ``return_lse``. The arguments are the extension's (``cache_seqlens`` a
    contiguous int32 tensor or None, then ``cache_len`` the int length of every sequence),
    validated by :func:`flash_cuda.attention_with_kvcache`, plus ``check_inputs``: the values of
    cache_seqlens and block_table checked here, at run time (also inside a compiled graph);
    ``sinks`` float32 (heads,) or None; ``k_descale`` / ``v_descale`` float32 (batch, kv_heads),
    contiguous, for FP8 caches (:func:`run_kvcache_fp8`), else None."""
    check_alignment(k_cache, v_cache)  # the addresses, which tracing could not see
    if k_descale is not None:
        out, lse = run_kvcache_fp8(_ext.require(), q, k_cache, v_cache, k, v, cache_seqlens, cache_len, block_table,
                                   scale, window_left, window_right, softcap, alibi_slopes, num_splits, return_lse,
                                   check_inputs, sinks, k_descale, v_descale)
    else:
        out, lse = run_kvcache(_ext.require(), q, k_cache, v_cache, k, v, cache_seqlens, cache_len, block_table,
                               scale, window_left, window_right, softcap, alibi_slopes, num_splits, return_lse,
                               check_inputs, sinks)
    return out, (lse if lse is not None else q.new_empty((0,), dtype=torch.float32))


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_len, block_table, scale, window_left,
                      window_right, softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks=None,
                      k_descale=None, v_descale=None):
    lse_shape = tuple(q.shape[:3]) if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Packed (varlen) queries: prompt chunks and decode tokens of different sequences in one call
# ---------------------------------------------------------------------------------------


def _pool_of(cache: Tensor) -> Optional[Tensor]:
    """A dense cache (B, Hkv, S, D) is already a paged pool of B pages of S rows (page b is
    sequence b) when S is a page size the kernels take: subsets of the batch then run by
    block table, without copying their cache rows."""
    return cache if cache.shape[2] % PAGE_SIZE_MULTIPLE == 0 and cache.shape[2] > 0 else None


def run_kvcache_packed(C, q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, lens, block_table, scale,
                       window_left, window_right, softcap, alibi_slopes, num_splits, return_lse, check_inputs,
                       sinks=None):
    """The validated packed call: (out (total_q, heads, D), lse (heads, total_q) or None).

    Today's route, built from the existing binding: (1) every chunk appended by one scatter,
    its (page, row) or (sequence, position) slots computed on the device; (2) the sequences
    grouped by chunk length, one binding call per distinct length on the group's gathered
    queries (a (G, heads, n, D) view), attending to the filled cache (no new keys: the
    lengths are cache_seqlens + n). Grouping needs the chunk lengths on the host: the one
    device sync of the call, which also checks cu_seqlens_q (free once read)."""
    total_q, Hq, D = q.shape
    B = cu_seqlens_q.shape[0] - 1
    dev = q.device
    cu_host = cu_seqlens_q.cpu()  # the sync; the checks below then read host memory
    check_cu_seqlens_q(cu_host, total_q, max_seqlen_q)
    cu = [int(x) for x in cu_host.tolist()]
    chunks = [b - a for a, b in zip(cu, cu[1:])]
    paged = block_table is not None
    capacity = k_cache.shape[2] * (block_table.shape[1] if paged else 1)
    if check_enabled(check_inputs):
        check_values(lens.tolist(), block_table, chunks if k is not None else 0, capacity, k_cache.shape[0])
    cu_long = cu_seqlens_q.long()
    if k is not None and total_q:
        # Row r belongs to sequence seq[r] and lands at its position lens[seq] + (r - cu[seq]).
        seq = torch.repeat_interleave(torch.arange(B, device=dev), cu_long.diff(), output_size=total_q)
        pos = lens.long()[seq] + torch.arange(total_q, device=dev) - cu_long[seq]
        first, second = cache_slots(block_table, k_cache.shape[0], k_cache.shape[2], seq, pos)
        k_cache[first, :, second] = k
        v_cache[first, :, second] = v
        lens = lens + cu_seqlens_q.diff()  # int32 + int32: the filled lengths
    out = q.new_empty((total_q, Hq, D))
    lse = torch.empty((Hq, total_q), dtype=torch.float32, device=dev) if return_lse else None
    groups: dict = {}
    for b, n in enumerate(chunks):
        if n:
            groups.setdefault(n, []).append(b)
    pool_k, pool_v = (None, None) if paged else (_pool_of(k_cache), _pool_of(v_cache))
    for n, members in sorted(groups.items()):
        G = len(members)
        idx = torch.tensor(members, dtype=torch.long, device=dev)
        rows = (cu_long[idx][:, None] + torch.arange(n, device=dev)).reshape(-1)
        q_g = q[rows].view(G, n, Hq, D).transpose(1, 2)
        lens_g = lens[idx].contiguous()
        if paged:
            kc, vc, table = k_cache, v_cache, block_table[idx].contiguous()
        elif pool_k is not None and pool_v is not None:
            kc, vc, table = pool_k, pool_v, idx.to(torch.int32).view(G, 1)
        else:  # an unpaged length: the group's cache rows gathered (read only: the append is done)
            kc, vc, table = k_cache[idx], v_cache[idx], None
        slopes = alibi_slopes[idx].contiguous() if alibi_slopes is not None and alibi_slopes.dim() == 2 \
            else alibi_slopes
        args = (q_g, kc, vc, None, None, lens_g, 0, table, scale, window_left, window_right, softcap, slopes,
                num_splits, return_lse)
        o_g, lse_g = C.fwd_kvcache(*args) if sinks is None else C.fwd_kvcache(*args, sinks)
        out[rows] = o_g.transpose(1, 2).reshape(G * n, Hq, D)
        if return_lse:
            lse[:, rows] = lse_g.transpose(0, 1).reshape(Hq, G * n)
    return out, lse


@torch.library.custom_op("flash_cuda::fwd_kvcache_packed", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache_packed(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                       cu_seqlens_q: Tensor, max_seqlen_q: int, cache_seqlens: Tensor, block_table: Optional[Tensor],
                       scale: float, window_left: int, window_right: int, softcap: float,
                       alibi_slopes: Optional[Tensor], num_splits: int, return_lse: bool, check_inputs: bool,
                       sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:func:`fwd_kvcache` for packed queries: q (total_q, heads, D), k / v (total_q, kv_heads,
    D) or None, chunk b the rows cu_seqlens_q[b] : cu_seqlens_q[b + 1]; (out like q, lse
    (heads, total_q) float32, empty (0,) unless ``return_lse``). Validated by
    :func:`flash_cuda.attention_with_kvcache`; the values of cu_seqlens_q are checked here, at run time."""
    check_alignment(k_cache, v_cache)
    out, lse = run_kvcache_packed(_ext.require(), q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q,
                                  cache_seqlens, block_table, scale, window_left, window_right, softcap,
                                  alibi_slopes, num_splits, return_lse, check_inputs, sinks)
    return out, (lse if lse is not None else q.new_empty((0,), dtype=torch.float32))


@fwd_kvcache_packed.register_fake
def _fwd_kvcache_packed_fake(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table,
                             scale, window_left, window_right, softcap, alibi_slopes, num_splits, return_lse,
                             check_inputs, sinks=None):
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)

