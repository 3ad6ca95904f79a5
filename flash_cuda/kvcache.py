"""The KV-cache entry point :func:`attention_with_kvcache`: decode and prefill against a dense or
paged cache, with the new keys appended in place (FlashAttention's ``flash_attn_with_kvcache``
semantics in flash_cuda's (batch, heads, seq, head_dim) layout).

Inference only: no autograd graph is recorded. A decode step's launch plan depends on shapes
alone (the cache's capacity, never the lengths in ``cache_seqlens``), so one CUDA graph captured
around a decode step serves every later step. :func:`flash_cuda.reference.attention_with_kvcache_reference`
is the executable specification (pure PyTorch, runs on CPU).

The work is split by concern:

* :mod:`flash_cuda.kvcache_checks`: the checks of the arguments and the outcome kept per
  signature of the arguments (their metadata, never their values): a decode step calls with
  the same shapes, strides and options every time, and a repeated signature skips the checks.
* :mod:`flash_cuda.kvcache_ops`: the custom ops ``flash_cuda::fwd_kvcache`` and
  ``flash_cuda::fwd_kvcache_packed`` (mutating ``k_cache`` and ``v_cache``, with fake
  implementations for ``torch.compile``) and the extension calls they make.
* Here, the dispatch: plain eager tensors run the extension call without the op's dispatch;
  anything the op exists for (tracing, fake or functional tensors, tensor subclasses, dispatch
  or function modes) takes the op.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _ext, kvcache_checks
from .kvcache_checks import MAX_NUM_SPLITS, PAGE_SIZE_MULTIPLE, Plan, plain, plan_call, validate_packed
from .kvcache_ops import ENV_CHECK_KEY, fwd_kvcache, fwd_kvcache_packed, run_kvcache, run_kvcache_fp8, run_kvcache_packed
from .validation import ENVIRON

__all__ = ["attention_with_kvcache", "fwd_kvcache", "fwd_kvcache_packed", "PAGE_SIZE_MULTIPLE", "MAX_NUM_SPLITS"]


_FULL_WINDOW = (-1, -1)  # the default window_size (an identity test passes it at once)
# The fast path's tests, bound once (each attribute chain would cost more than the test).
_is_compiling = torch.compiler.is_compiling
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
# The fast path's last found (kvcache_checks.plans, key, plan): the dict too, as tests replace it.
_last: tuple = (None, (), None)


def _prepared(plan: Plan, block_table, alibi_slopes, sinks):
    """The validated call's tensors as the kernels read them: the block table's rows
    contiguous, the ALiBi slopes detached and contiguous, the sinks float32 and contiguous."""
    if plan.fix_table:
        block_table = block_table.contiguous()
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().contiguous()
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    return block_table, alibi_slopes, sinks


def _dispatch(eager: bool, run, op, args: tuple, return_lse: bool):
    """``run`` (the extension call) for a plain eager call, else the custom op ``op``."""
    if eager:
        out, lse = run(_ext.require(), *args)  # require() compiles the kernels at their first use
    else:
        if not _ext.is_available():
            raise RuntimeError(_ext.unavailable_message())
        out, lse = op(*args)
    if return_lse:
        return out, lse
    return out


def _attention_packed(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, is_causal,
                      scale, window_size, softcap, alibi_slopes, sinks, num_splits, return_lse, check_inputs):
    """attention_with_kvcache with cu_seqlens_q: checked on every call (no kept signature)."""
    plan = validate_packed(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table,
                           is_causal, scale, window_size, softcap, alibi_slopes, num_splits, return_lse, sinks)
    lens = cache_seqlens.contiguous() if plan.fix_lens else cache_seqlens
    block_table, alibi_slopes, sinks = _prepared(plan, block_table, alibi_slopes, sinks)
    args = (q, k_cache, v_cache, k, v, cu_seqlens_q.contiguous(), max_seqlen_q, lens, block_table, plan.scale,
            plan.window_left, plan.window_right, plan.softcap, alibi_slopes, num_splits, return_lse, check_inputs,
            sinks)
    eager = plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks) \
        and type(cu_seqlens_q) is Tensor
    return _dispatch(eager, run_kvcache_packed, fwd_kvcache_packed, args, return_lse)


def attention_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    *,
    cache_seqlens: Union[int, Tensor],
    block_table: Optional[Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = _FULL_WINDOW,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    num_splits: int = 0,
    return_lse: bool = False,
    check_inputs: bool = False,
    cu_seqlens_q: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    k_descale=None,
    v_descale=None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Attention of new queries against a KV cache, appending the new keys to it first.

    For each batch entry ``b`` with ``L_b = cache_seqlens[b] + seqlen_new`` this writes ``k[b]``
    / ``v[b]`` (if given) into the cache at positions ``cache_seqlens[b] .. L_b - 1`` (in place)
    and returns ``attention(q[b], K_b, V_b)`` over the cache's positions ``0 .. L_b - 1``; masks
    are bottom-right aligned to ``L_b``: with ``is_causal`` query ``i`` sees key ``j <= i + L_b -
    seqlen_q``. ``cache_seqlens`` itself is not modified (advance it yourself).

    Args:
        q: ``(batch, heads, seqlen_q, head_dim)``, float16 or bfloat16; ``seqlen_q >= 1`` (1 for
            plain decoding, a few for speculative decoding, the prompt for prefill).
        k_cache, v_cache: the cache, q's dtype and device, the same shape. Dense:
            ``(batch, kv_heads, max_seqlen, head_dim)``. Paged (with ``block_table``):
            ``(num_pages, kv_heads, page_size, head_dim)``, ``page_size`` a multiple of 16.
            Any strides with ``stride(-1) == 1`` and rows 16-byte aligned, e.g. a pool allocated
            as ``(num_pages, page_size, kv_heads, head_dim)`` and passed as ``.transpose(1, 2)``.
            ``heads`` must be a multiple of ``kv_heads`` (GQA).
        k, v: ``None``, or the new keys / values ``(batch, kv_heads, seqlen_new, head_dim)``,
            both or neither.
        cache_seqlens: the tokens already in the cache: a Python int (every sequence) or an int32
            tensor ``(batch,)`` on q's device. Tensor values are trusted (see ``check_inputs``):
            the kernels clamp them to the cache, so wrong ones give wrong results, never an
            access outside it.
        block_table: ``None`` (dense cache) or an int32 tensor ``(batch, max_pages_per_seq)`` on
            q's device: position ``p`` of sequence ``b`` lives in page ``block_table[b, p //
            page_size]``, row ``p % page_size``.
        is_causal, scale, window_size, softcap, alibi_slopes: as in :func:`flash_cuda.attention`
            (bottom-right aligned to ``L_b``).
        sinks: ``None`` or attention sinks as in :func:`flash_cuda.attention`: one logit per
            query head, shape ``(heads,)``, any floating dtype; each row's softmax denominator
            gets ``exp(sinks[h])`` (gpt-oss). No gradient flows through this function.
        num_splits: key ranges per query row: ``0`` (default) picks from the shapes alone (more
            ranges when few (batch, KV head) pairs would leave the GPU idle), ``1`` none, ``n``
            exactly ``n`` (at most 256).
        return_lse: also return ``lse`` float32 ``(batch, heads, seqlen_q)``, natural log.
        check_inputs: also read ``cache_seqlens`` and ``block_table`` back to the host and check
            that every sequence fits the cache and every page id used exists (a device sync).
            Also switched on by ``FLASH_CUDA_CHECK_KVCACHE=1``.
        cu_seqlens_q, max_seqlen_q: packed (varlen) queries, both or neither; see below.
        k_descale, v_descale: FP8 caches (``k_cache`` / ``v_cache`` in ``torch.float8_e4m3fn``),
            where a stored value ``x8`` stands for ``x8 * descale``: ``None`` (1), a float or a
            float32 tensor of shape ``()`` / ``(1,)`` (per tensor), or float32 ``(batch,
            kv_heads)`` on q's device (per sequence and KV head). q and the new k / v stay float16
            or bfloat16; the new rows are stored as ``e4m3(k / k_descale)`` (round to nearest
            even, saturating at +-448) and attended as stored. Head dims that are multiples of
            16, compute capability 8.9 or newer; no packed queries yet (``torch.compile`` and CUDA
            graphs as for 16-bit caches: the op takes the descales). Specified by
            :func:`flash_cuda.reference.attention_with_kvcache_fp8_reference`.

    Packed queries (``cu_seqlens_q`` given): prompt chunks of some sequences and decode tokens of
    others in one call. ``q`` is ``(total_q, heads, head_dim)``, ``k`` / ``v`` ``(total_q,
    kv_heads, head_dim)`` or both None, ``cu_seqlens_q`` an int32 tensor ``(batch + 1,)`` on q's
    device (0, then the running sum of the chunk lengths), ``max_seqlen_q`` a Python int >= 1
    (the longest chunk) and ``cache_seqlens`` an int32 tensor ``(batch,)``. Chunk ``b`` (rows
    ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]``, possibly none) is exactly the call above on
    sequence ``b`` alone: its keys appended at ``cache_seqlens[b] ..``, its rows attending to
    positions ``0 .. cache_seqlens[b] + n_b - 1``, bottom-right aligned. Returns ``out`` packed
    like q and, with ``return_lse``, ``lse`` float32 ``(heads, total_q)``. Specified by
    :func:`flash_cuda.reference.attention_with_kvcache_packed_reference`.

    What runs today for packed queries: one scatter appends every chunk (slots computed on the
    device), then the existing KV-cache kernels run once per distinct chunk length (all decode
    tokens together, each prompt length together) over the filled cache. Grouping reads
    ``cu_seqlens_q`` on the host (a device sync per call, so no CUDA graph capture of this form);
    having read it, the route checks its values on every call (starts at 0, does not decrease,
    ends at ``q.shape[0]``, chunks <= ``max_seqlen_q``); ``check_inputs`` adds the fit of every
    chunk in its cache. The next step is a single kernel reading packed queries against the
    pages (no sync, no grouping); the signature stays. Under ``torch.compile`` the packed form is
    the op ``torch.ops.flash_cuda.fwd_kvcache_packed``.

    Returns:
        ``out`` with q's shape and dtype (laid out like ``torch.empty_like(q)``), or ``(out,
        lse)`` with ``return_lse``.

    What runs (one result, up to rounding; ``num_splits`` applies to the decode kernels only):

    * ``seqlen_q <= 16`` (decode, speculative decoding): the split-KV decode kernels, which
      append k / v and read the cache (dense or paged) in one launch whose plan depends on
      shapes alone.
    * ``seqlen_q > 16`` (a prompt chunk), dense cache, int ``cache_seqlens``: the append as a
      copy, then :func:`flash_cuda.attention`'s query-tiled forward over the cache's first
      ``L`` rows.
    * ``seqlen_q > 16``, paged cache or tensor ``cache_seqlens``: one kernel appends k / v and
      lays a paged cache's keys out densely (``(batch, kv_heads, capacity, head_dim)``, each
      sequence's ``L_b`` keys copied; a dense cache is read in place), then attention()'s
      query-tiled forward runs with each sequence's key count ``L_b`` read on the device (every
      mask bottom-right aligned per sequence, as defined above; scale, window, softcap, ALiBi
      and sinks as given). Nothing is read back to the host. A paged call costs a transient
      dense copy of the keys and values of ``capacity`` rows per sequence. The decode kernels
      would stream every key once per 64 query rows (about a third of attention()'s speed at
      2k tokens).

    Works under ``torch.compile(fullgraph=True)`` (the custom op
    ``torch.ops.flash_cuda.fwd_kvcache``, declared as mutating the caches, so the append is
    kept) and inside CUDA graphs (captured by hand or by ``mode="reduce-overhead"``): with a
    tensor ``cache_seqlens`` one captured step serves every length, decode step or prompt
    chunk (no route reads the lengths on the host). Repeated calls with the
    same shapes, strides, dtypes, devices and options are checked once (the outcome is kept
    per signature); an int ``cache_seqlens`` is checked on every call.

    Raises:
        TypeError, ValueError, RuntimeError: a bad argument, named with what is accepted, before
            anything is written or launched.
    """
    global _last
    # The fast path of a repeated decode step: plain eager tensors (kvcache_checks.plain's test,
    # inlined), no ALiBi slopes, sinks or packed queries, options of the types a signature takes
    # (kvcache_checks.plan_call's test), no check_inputs (nor its environment variable) and a
    # signature whose plan needs nothing converted. The plan answers for every check the general
    # path would run; an int cache_seqlens is checked here as plan_call checks it. So the outcome
    # is the general path's: the same extension call, the same errors (a call that fails any part
    # of this test, or whose signature is new, takes the general path and its checks).
    if (cu_seqlens_q is None and max_seqlen_q is None and alibi_slopes is None and sinks is None
            and k_descale is None and v_descale is None and check_inputs is False and not _is_compiling()
            and type(q) is Tensor and type(k_cache) is Tensor and type(v_cache) is Tensor
            and (k is None or type(k) is Tensor) and (v is None or type(v) is Tensor)
            and (block_table is None or type(block_table) is Tensor)
            and (type(cache_seqlens) is Tensor or type(cache_seqlens) is int)
            and (is_causal is False or is_causal is True) and (return_lse is False or return_lse is True)
            and type(num_splits) is int
            and (window_size is _FULL_WINDOW or (type(window_size) is tuple and len(window_size) == 2
                                                and type(window_size[0]) is int and type(window_size[1]) is int))
            and (scale is None or type(scale) is float or type(scale) is int)
            and (type(softcap) is float or type(softcap) is int)
            and ENV_CHECK_KEY not in ENVIRON and not _dispatch_stack_len() and not _function_mode_enabled()):
        lens = cache_seqlens if type(cache_seqlens) is Tensor else None
        # kvcache_checks._signature's key, built here (a test holds both the same)
        key = (q.shape, q.stride(), q.dtype, q.device,
               k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.data_ptr() & 15,
               v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.data_ptr() & 15,
               None if k is None else (k.shape, k.stride(), k.dtype, k.device),
               None if v is None else (v.shape, v.stride(), v.dtype, v.device),
               None if lens is None else (lens.shape, lens.stride(), lens.dtype, lens.device),
               None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                                 block_table.device),
               None, None, scale, type(scale), window_size, softcap, type(softcap), is_causal, num_splits, return_lse)
        plans = kvcache_checks.plans
        last_plans, last_key, plan = _last
        if key != last_key or plans is not last_plans:  # (a comparison costs half a lookup's hash)
            plan = plans.get(key)
            if plan is not None:
                _last = (plans, key, plan)
        if plan is not None and not plan.fix_lens and not plan.fix_table:
            C = _ext.require()
            if lens is not None:
                direct = plan.direct
                if direct is not None:
                    out, lse = C.fwd_kvcache_direct(q, k_cache, v_cache, k, v, lens, block_table, direct)
                else:
                    out, lse = C.fwd_kvcache(q, k_cache, v_cache, k, v, lens, 0, block_table, plan.scale,
                                             plan.window_left, plan.window_right, plan.softcap, None, num_splits,
                                             return_lse)
                return (out, lse) if return_lse else out
            if 0 <= cache_seqlens and cache_seqlens + plan.s_new <= plan.capacity:
                out, lse = run_kvcache(C, q, k_cache, v_cache, k, v, None, cache_seqlens, block_table, plan.scale,
                                       plan.window_left, plan.window_right, plan.softcap, None, num_splits, return_lse,
                                       False)
                return (out, lse) if return_lse else out
    return _attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale,
                                   window_size, softcap, alibi_slopes, sinks, num_splits, return_lse, check_inputs,
                                   cu_seqlens_q, max_seqlen_q, k_descale, v_descale)


def _attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size,
                            softcap, alibi_slopes, sinks, num_splits, return_lse, check_inputs, cu_seqlens_q,
                            max_seqlen_q, k_descale=None, v_descale=None):
    """:func:`attention_with_kvcache`'s general path: every call the fast path does not answer."""
    if kvcache_checks.is_fp8_call(k_cache, v_cache, k_descale, v_descale):
        return _attention_fp8(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size,
                              softcap, alibi_slopes, sinks, num_splits, return_lse, check_inputs, cu_seqlens_q,
                              max_seqlen_q, k_descale, v_descale)
    if cu_seqlens_q is not None or max_seqlen_q is not None:
        return _attention_packed(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table,
                                 is_causal, scale, window_size, softcap, alibi_slopes, sinks, num_splits, return_lse,
                                 check_inputs)
    eager = plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks)
    plan = plan_call(eager, q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size,
                     softcap, alibi_slopes, num_splits, return_lse, sinks)
    if isinstance(cache_seqlens, Tensor):
        lens, cache_len = (cache_seqlens.contiguous() if plan.fix_lens else cache_seqlens), 0
    else:
        lens, cache_len = None, cache_seqlens
    block_table, alibi_slopes, sinks = _prepared(plan, block_table, alibi_slopes, sinks)
    args = (q, k_cache, v_cache, k, v, lens, cache_len, block_table, plan.scale, plan.window_left,
            plan.window_right, plan.softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks)
    return _dispatch(eager, run_kvcache, fwd_kvcache, args, return_lse)


def _attention_fp8(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size, softcap,
                   alibi_slopes, sinks, num_splits, return_lse, check_inputs, cu_seqlens_q, max_seqlen_q, k_descale,
                   v_descale):
    """An FP8 cache call: checked once per signature (kvcache_checks.plan_fp8_call); plain eager
    tensors run the extension call, anything else (torch.compile, fake tensors) the op with the
    descales."""
    if cu_seqlens_q is not None or max_seqlen_q is not None:
        raise NotImplementedError(f"{kvcache_checks.PREFIX}packed queries (cu_seqlens_q) over an FP8 cache are not "
                                  f"supported yet; call once per chunk length, or use a 16-bit cache")
    eager = plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks) and not _is_compiling()
    plan, kd, vd = kvcache_checks.plan_fp8_call(eager, q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                                is_causal, scale, window_size, softcap, alibi_slopes, num_splits,
                                                return_lse, sinks, k_descale, v_descale)
    if isinstance(cache_seqlens, Tensor):
        lens, cache_len = (cache_seqlens.contiguous() if plan.fix_lens else cache_seqlens), 0
    else:
        lens, cache_len = None, cache_seqlens
    block_table, alibi_slopes, sinks = _prepared(plan, block_table, alibi_slopes, sinks)
    args = (q, k_cache, v_cache, k, v, lens, cache_len, block_table, plan.scale, plan.window_left, plan.window_right,
            plan.softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks, kd, vd)
    return _dispatch(eager, run_kvcache_fp8, fwd_kvcache, args, return_lse)
