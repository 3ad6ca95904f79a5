"""The checks of :func:`flash_cuda.attention_with_kvcache`'s arguments, with the messages they
raise, and the outcome kept per signature of the arguments.

:func:`validate` checks a call's metadata (shapes, strides, dtypes, devices, options) in the
order the errors are documented and returns a :class:`Plan`; :func:`validate_packed` does the
same for packed queries. A decode step calls with the same shapes, strides and options every
time, so :func:`plan_call` keeps the plan of a plain eager call per signature of its arguments
(their metadata, never their values) and a repeated signature skips the checks. The values the
kernels otherwise trust (``cache_seqlens``, ``block_table``, ``cu_seqlens_q``) are checked by
:func:`check_values` and :func:`check_cu_seqlens_q` when the custom ops of
:mod:`flash_cuda.kvcache_ops` run.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _ext
from .ops import eager_ok
from .validation import (MAX_GRID_YZ, MAX_HEAD_DIM, MAX_SEQLEN, MIN_CAPABILITY, MIN_HEAD_DIM, check_alibi,
                         check_capability, check_cu_seqlens_values, check_score_options, check_sinks,
                         device_capability, dtype_name)

__all__ = ["Plan", "validate", "validate_packed", "plan_call", "plain", "plans", "check_alignment", "check_enabled",
           "check_values", "check_cu_seqlens_q", "is_fp8_call", "validate_fp8", "plan_fp8_call", "fp8_descales", "PAGE_SIZE_MULTIPLE",
           "MAX_NUM_SPLITS", "ENV_CHECK", "FP8_MIN_CAPABILITY", "PREFIX"]

PREFIX = "flash_cuda.attention_with_kvcache: "  # every message of the KV-cache checks starts so
_PREFIX = PREFIX
PAGE_SIZE_MULTIPLE = 16  # a paged cache's page size: any multiple of this
MAX_NUM_SPLITS = 256
ENV_CHECK = "FLASH_CUDA_CHECK_KVCACHE"  # set (not to 0 / false / no / off): check_inputs on every call
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 conversions (cvt ... e4m3x2): Ada, Hopper and newer
# The FP8 formats other than e4m3, named in the message that rejects them.
# The FP8 formats other than e4m3 (refused with a message that names e4m3; flash_cuda/fp8.py too).
OTHER_FP8 = tuple(getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
                   if hasattr(torch, n))


def _fail(kind, msg: str):
    raise kind(_PREFIX + msg)


def _check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        _fail(TypeError, f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(ValueError, f"{name} must be a {ndim}-D tensor {layout}, got {t.dim()}-D with shape "
                          f"{tuple(t.shape)}")
    if t.stride(-1) != 1:
        _fail(ValueError, f"{name} must have a contiguous last dimension (stride(-1) == 1), got strides "
                          f"{tuple(t.stride())}")


def _check_same(name: str, t: Tensor, q: Tensor) -> None:
    if t.dtype != q.dtype:
        _fail(TypeError, f"{name} must have q's dtype {dtype_name(q.dtype)}, got {dtype_name(t.dtype)}")
    if t.device != q.device:
        _fail(RuntimeError, f"{name} must be on q's device {q.device}, got {t.device}")


def _aligned_rows(t: Tensor) -> bool:
    """Every row starts 16 bytes apart from the base, which is 16-byte aligned."""
    es = t.element_size()
    n0, n1, n2, _ = t.shape
    s0, s1, s2, _ = t.stride()
    return (t.data_ptr() % 16 == 0 and (n0 <= 1 or s0 * es % 16 == 0) and (n1 <= 1 or s1 * es % 16 == 0)
            and (n2 <= 1 or s2 * es % 16 == 0))


def check_alignment(k_cache: Tensor, v_cache: Tensor) -> None:
    """The caches' rows 16-byte aligned (their addresses: the custom ops check them again when
    they run, as tracing sees no address)."""
    if not (_aligned_rows(k_cache) and _aligned_rows(v_cache)):
        _fail(ValueError, "the caches are written in place, so their rows must be 16-byte aligned: a base "
                          "address and strides (in bytes) that are multiples of 16")


def _check_device(q: Tensor, dev: torch.device) -> None:
    """q on a CUDA device (``dev``, q's device) of capability 8.0 or newer."""
    if dev.type != "cuda":
        _fail(RuntimeError, f"inputs must be CUDA tensors, got device '{q.device}'; flash_cuda runs only on "
                            f"NVIDIA GPUs (flash_cuda.reference.attention_with_kvcache_reference runs anywhere)")
    # The capability query cannot be traced; the extension checks it again on every launch.
    if not torch.compiler.is_compiling() and device_capability(dev) < MIN_CAPABILITY:
        check_capability(q.device, _PREFIX)


def _check_cache_len(cache_len: int, s_new: int, capacity: int) -> None:
    if cache_len < 0 or cache_len + s_new > capacity:
        _fail(ValueError, f"cache_seqlens = {cache_len} with {s_new} new tokens needs {cache_len + s_new} "
                          f"positions, but the cache holds {capacity} per sequence (cache_seqlens must be >= 0)")


def check_enabled(flag: bool) -> bool:
    """Whether :func:`check_values` runs: ``check_inputs``, or the environment variable
    :data:`ENV_CHECK` set to anything but off."""
    env = os.environ.get(ENV_CHECK, "").strip().lower()
    return bool(flag) or env not in ("", "0", "false", "no", "off")


def check_values(lens: list, block_table: Optional[Tensor], s_new, capacity: int, num_pages: int) -> None:
    """The device values the kernels otherwise trust, read back to the host (a device sync).
    ``s_new``: the new tokens of every sequence (an int), or one count per sequence (a list,
    packed queries)."""
    news = s_new if isinstance(s_new, list) else [s_new] * len(lens)
    for b, n in enumerate(lens):
        if n < 0 or n + news[b] > capacity:
            _fail(ValueError, f"cache_seqlens[{b}] = {n}: with {news[b]} new tokens the sequence needs "
                              f"{n + news[b]} positions, but the cache holds {capacity} per sequence "
                              f"(cache_seqlens must be >= 0)")
    if block_table is not None:
        page_size = capacity // max(block_table.shape[1], 1)
        for b, n in enumerate(lens):
            used = -(-(n + news[b]) // page_size) if page_size else 0
            ids = block_table[b, :used].tolist()
            bad = [p for p in ids if not 0 <= p < num_pages]
            if bad:
                _fail(ValueError, f"block_table[{b}] names page {bad[0]}, outside [0, {num_pages}) "
                                  f"(the cache has {num_pages} pages)")


class Plan(NamedTuple):
    """What the checks of one signature found: the score options (without the ALiBi slopes,
    a tensor of the call) and the sizes the per-call checks need."""
    scale: float
    window_left: int
    window_right: int
    softcap: float
    capacity: int  # positions per sequence
    s_new: int
    fix_lens: bool  # a tensor cache_seqlens that needs .contiguous()
    fix_table: bool  # a block_table whose rows need .contiguous()
    # The score options, num_splits and return_lse as one object of the extension
    # (_ext.kvcache_direct_plan) for its fwd_kvcache_direct entry, which costs the host less per
    # call: plans kept for eager calls without ALiBi slopes or sinks; else None.
    direct: object = None


def validate(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size, softcap,
             alibi_slopes, num_splits, return_lse, sinks=None, fp8: bool = False) -> Plan:
    """Every check of :func:`attention_with_kvcache`'s arguments but the per-call ones (an int
    ``cache_seqlens``'s value, ``check_inputs``), in the order the errors are documented.
    ``fp8``: the caches are float8_e4m3fn (:func:`validate_fp8` checked their dtype and the
    descales), q and the new k / v 16-bit as always."""
    # A call with a new signature (and every traced call) comes here: the checks are plain
    # comparisons on the tensors' metadata, and the error helpers build a message only on failure.
    paged = block_table is not None
    cache_layout = ("(num_pages, kv_heads, page_size, head_dim)" if paged
                    else "(batch, kv_heads, max_seqlen, head_dim)")
    for name, t, layout in (("q", q, "(batch, heads, seqlen_q, head_dim)"), ("k_cache", k_cache, cache_layout),
                            ("v_cache", v_cache, cache_layout)):
        if not isinstance(t, Tensor) or t.dim() != 4 or t.stride(-1) != 1:
            _check_tensor(name, t, 4, layout)
    dt = q.dtype
    if dt is not torch.float16 and dt is not torch.bfloat16:
        _fail(TypeError, f"q has dtype {dtype_name(dt)}; the KV-cache kernels take float16 or bfloat16")
    dev = q.device
    if fp8:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.device != dev:
                _fail(RuntimeError, f"{name} must be on q's device {q.device}, got {t.device}")
    else:
        if k_cache.dtype is not dt or k_cache.device != dev:
            _check_same("k_cache", k_cache, q)
        if v_cache.dtype is not dt or v_cache.device != dev:
            _check_same("v_cache", v_cache, q)
    B, Hq, Sq, D = q.shape
    cshape = k_cache.shape
    if cshape != v_cache.shape:
        _fail(ValueError, f"k_cache and v_cache must have the same shape, got {tuple(k_cache.shape)} and "
                          f"{tuple(v_cache.shape)}")
    Hkv = cshape[1]
    if cshape[3] != D:
        _fail(ValueError, f"the caches' head dim {cshape[3]} differs from q's {D}")
    if Hkv < 1 or Hq % Hkv:
        _fail(ValueError, f"the number of query heads ({Hq}) must be a multiple of the caches' kv heads "
                          f"({Hkv}) (dim 1)")
    if D < MIN_HEAD_DIM or D > MAX_HEAD_DIM or D % 8:
        _fail(ValueError, f"unsupported head dim {D}; the head dim must be a multiple of 8 in "
                          f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if fp8 and D % 16:
        _fail(ValueError, f"unsupported head dim {D} for FP8 caches: a multiple of 16 (16 e4m3 values per "
                          f"16-byte row chunk)")
    if Sq < 1:
        _fail(ValueError, "q must hold at least one query (seqlen_q >= 1, dim 2)")
    if B > MAX_GRID_YZ or Hq > MAX_GRID_YZ:
        _fail(ValueError, f"batch size ({B}) and query heads ({Hq}) must each be at most {MAX_GRID_YZ}")
    # Under torch.compile the tensors are fake (no address): the op checks the rows when it runs.
    if not torch.compiler.is_compiling():
        check_alignment(k_cache, v_cache)
    if paged:
        if not isinstance(block_table, Tensor):
            _fail(TypeError, f"block_table must be None or an int32 tensor (batch, max_pages), got "
                             f"{type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            _fail(TypeError, f"block_table must be an int32 tensor, got {dtype_name(block_table.dtype)}")
        if block_table.dim() != 2 or block_table.shape[0] != B:
            _fail(ValueError, f"block_table must have shape ({B}, max_pages_per_sequence), got "
                              f"{tuple(block_table.shape)}")
        if block_table.device != dev:
            _fail(RuntimeError, f"block_table must be on q's device {q.device}, got {block_table.device}")
        page_size = cshape[2]
        if page_size % PAGE_SIZE_MULTIPLE or page_size == 0:
            _fail(ValueError, f"the page size (k_cache dim 2) must be a positive multiple of "
                              f"{PAGE_SIZE_MULTIPLE}, got {page_size}")
        if cshape[0] < 1:
            _fail(ValueError, "a paged cache needs at least one page (k_cache dim 0)")
        capacity = block_table.shape[1] * page_size
    else:
        if cshape[0] != B:
            _fail(ValueError, f"a dense cache must have q's batch size {B} (dim 0), got {cshape[0]}; "
                              f"pass block_table for a paged cache")
        capacity = cshape[2]
    if capacity > MAX_SEQLEN:
        _fail(ValueError, f"the cache holds {capacity} positions per sequence; at most 2^31 - 1 are supported")
    s_new = 0
    if k is not None or v is not None:
        if k is None or v is None:
            _fail(ValueError, "pass both k and v (the new keys and values), or neither")
        layout = "(batch, kv_heads, seqlen_new, head_dim)"
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4 or t.stride(-1) != 1:
                _check_tensor(name, t, 4, layout)
            if t.dtype is not dt or t.device != dev:
                _check_same(name, t, q)
        kshape = k.shape
        if kshape != v.shape or kshape[0] != B or kshape[1] != Hkv or kshape[3] != D:
            _fail(ValueError, f"k and v must both have shape ({B}, {Hkv}, seqlen_new, {D}), got "
                              f"{tuple(k.shape)} and {tuple(v.shape)}")
        s_new = kshape[2]
    if isinstance(cache_seqlens, Tensor):
        if cache_seqlens.dtype is not torch.int32:
            _fail(TypeError, f"cache_seqlens must be an int or an int32 tensor, got "
                             f"{dtype_name(cache_seqlens.dtype)}")
        if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != B:
            _fail(ValueError, f"cache_seqlens must have shape ({B},), got {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != dev:
            _fail(RuntimeError, f"cache_seqlens must be on q's device {q.device}, got {cache_seqlens.device}")
        if s_new > capacity:
            _fail(ValueError, f"{s_new} new tokens do not fit a cache of {capacity} positions per sequence")
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        _check_cache_len(cache_seqlens, s_new, capacity)
    else:
        _fail(TypeError, f"cache_seqlens must be an int or an int32 tensor (batch,), got "
                         f"{type(cache_seqlens).__name__}")
    if is_causal is not False and is_causal is not True:
        _fail(TypeError, f"is_causal must be a bool, got {type(is_causal).__name__}")
    if return_lse is not False and return_lse is not True:
        _fail(TypeError, f"return_lse must be a bool, got {type(return_lse).__name__}")
    if type(num_splits) is not int or not 0 <= num_splits <= MAX_NUM_SPLITS:
        _fail(ValueError, f"num_splits must be an int in [0, {MAX_NUM_SPLITS}] (0: chosen from the shapes), "
                          f"got {num_splits!r}")
    opts = check_score_options(D, scale, is_causal, window_size, softcap, _PREFIX)
    if alibi_slopes is not None:
        alibi_slopes = check_alibi(alibi_slopes, B, Hq, _PREFIX)
        if alibi_slopes.device != dev:
            _fail(RuntimeError, f"alibi_slopes must be on q's device {q.device}, got {alibi_slopes.device}")
    if sinks is not None:
        check_sinks(sinks, Hq, _PREFIX)
        if sinks.device != q.device:
            _fail(RuntimeError, f"sinks must be on q's device {q.device}, got {sinks.device}")
    _check_device(q, dev)
    return Plan(opts.scale, opts.window_left, opts.window_right, opts.softcap, capacity, s_new,
                isinstance(cache_seqlens, Tensor) and cache_seqlens.stride(0) != 1,
                paged and block_table.stride(1) != 1)


# Plans of the signatures seen, keyed by _signature. A decode loop meets a handful (one per
# batch shape and query count); prompts of many lengths would add one each, hence the bound.
# Public: flash_cuda.kvcache.attention_with_kvcache looks a repeated call's plan up here itself.
plans: dict = {}
_MAX_PLANS = 256


def _signature(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, window_size, softcap,
               alibi_slopes, is_causal, num_splits, return_lse, sinks=None):
    """Everything the checks read, as a hashable key (:func:`plain` and :func:`_simple_options`
    hold; flash_cuda.kvcache.attention_with_kvcache's fast path builds it too, and a test holds both
    the same). Values that compare equal across types (1 == 1.0) carry their type, so a key never
    stands for an argument the checks would reject. An int ``cache_seqlens`` enters as None:
    its value is checked on every call."""
    return (q.shape, q.stride(), q.dtype, q.device,
            k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.device, k_cache.data_ptr() & 15,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, v_cache.data_ptr() & 15,
            None if k is None else (k.shape, k.stride(), k.dtype, k.device),
            None if v is None else (v.shape, v.stride(), v.dtype, v.device),
            (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device)
            if type(cache_seqlens) is Tensor else None,
            None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                              block_table.device),
            None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                               alibi_slopes.device),
            None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),
            scale, type(scale), window_size, softcap, type(softcap), is_causal, num_splits, return_lse)


def plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks=None) -> bool:
    """Whether a call may skip the op's dispatch: plain tensors, outside tracing and modes."""
    return (type(q) is Tensor and type(k_cache) is Tensor and type(v_cache) is Tensor
            and (k is None or type(k) is Tensor) and (v is None or type(v) is Tensor)
            and (type(cache_seqlens) is Tensor or type(cache_seqlens) is int)
            and (block_table is None or type(block_table) is Tensor)
            and (alibi_slopes is None or type(alibi_slopes) is Tensor)
            and (sinks is None or type(sinks) is Tensor) and eager_ok())


def _simple_options(scale, window_size, softcap, is_causal, num_splits, return_lse) -> bool:
    """Whether the options may enter a signature: of the types the checks accept, hashable
    (anything else takes the checks, which name the problem)."""
    return ((scale is None or type(scale) is float or type(scale) is int)
            and (type(softcap) is float or type(softcap) is int)
            and type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and (is_causal is True or is_causal is False)
            and (return_lse is True or return_lse is False) and type(num_splits) is int)


def plan_call(eager: bool, q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size,
              softcap, alibi_slopes, num_splits, return_lse, sinks=None) -> Plan:
    """:func:`validate`'s plan for a call. ``eager``: :func:`plain` holds; such a call with
    options of the plain types takes the plan kept for its signature, and only an int
    ``cache_seqlens`` (not part of the signature) is checked again."""
    if eager and _simple_options(scale, window_size, softcap, is_causal, num_splits, return_lse):
        key = _signature(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, window_size, softcap,
                         alibi_slopes, is_causal, num_splits, return_lse, sinks)
        plan = plans.get(key)
        if plan is None:
            plan = validate(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size,
                            softcap, alibi_slopes, num_splits, return_lse, sinks)
            if alibi_slopes is None and sinks is None:
                plan = plan._replace(direct=_ext.kvcache_direct_plan(plan.scale, plan.window_left, plan.window_right,
                                                                     plan.softcap, num_splits, return_lse))
            if len(plans) >= _MAX_PLANS:
                plans.clear()
            plans[key] = plan
        elif type(cache_seqlens) is int:
            _check_cache_len(cache_seqlens, plan.s_new, plan.capacity)
        return plan
    return validate(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size, softcap,
                    alibi_slopes, num_splits, return_lse, sinks)


# ---------------------------------------------------------------------------------------
# Packed (varlen) queries
# ---------------------------------------------------------------------------------------


def validate_packed(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, is_causal,
                    scale, window_size, softcap, alibi_slopes, num_splits, return_lse, sinks) -> Plan:
    """The metadata checks of a packed call. The packed tensors' own rules come first; the
    cache, options and device rules are :func:`validate`'s, run on stand-ins of q's batched
    shape (an expanded one-element tensor: no memory), so both layouts keep one wording."""
    if cu_seqlens_q is None or max_seqlen_q is None:
        _fail(ValueError, "packed queries need both cu_seqlens_q and max_seqlen_q")
    _check_tensor("q", q, 3, "(total_q, heads, head_dim)")
    if not isinstance(cu_seqlens_q, Tensor):
        _fail(TypeError, f"cu_seqlens_q must be a torch.Tensor of int32 sequence start offsets (shape "
                         f"(batch + 1,)), got {type(cu_seqlens_q).__name__}")
    if cu_seqlens_q.dtype is not torch.int32:
        _fail(TypeError, f"cu_seqlens_q must be an int32 tensor, got {dtype_name(cu_seqlens_q.dtype)}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        _fail(ValueError, f"cu_seqlens_q must be 1-D of shape (batch + 1,) with batch >= 1 (0, then the running "
                          f"sum of the chunk lengths), got shape {tuple(cu_seqlens_q.shape)}")
    if cu_seqlens_q.device != q.device:
        _fail(RuntimeError, f"cu_seqlens_q must be on q's device {q.device}, got {cu_seqlens_q.device}")
    if type(max_seqlen_q) is not int:
        _fail(TypeError, f"max_seqlen_q must be a Python int (the longest chunk), got {type(max_seqlen_q).__name__}")
    if not 1 <= max_seqlen_q <= MAX_SEQLEN:
        _fail(ValueError, f"max_seqlen_q must be in [1, 2^31 - 1], got {max_seqlen_q}")
    if not isinstance(cache_seqlens, Tensor):
        _fail(TypeError, f"with cu_seqlens_q, cache_seqlens must be an int32 tensor (batch,) (one length per "
                         f"sequence), got {type(cache_seqlens).__name__}")
    B = cu_seqlens_q.shape[0] - 1
    total_q, Hq, D = q.shape
    if k is not None or v is not None:
        if k is None or v is None:
            _fail(ValueError, "pass both k and v (the new keys and values), or neither")
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t, 3, "(total_q, kv_heads, head_dim)")
            _check_same(name, t, q)
        if isinstance(k_cache, Tensor) and k_cache.dim() == 4:
            want = (total_q, k_cache.shape[1], D)
            if tuple(k.shape) != want or tuple(v.shape) != want:
                _fail(ValueError, f"packed k and v must both have shape (total_q, kv_heads, head_dim) = {want} (one "
                                  f"row per query row), got {tuple(k.shape)} and {tuple(v.shape)}")
    # Only the batched stand-in's metadata is read (no element), hence one element expanded.
    q4 = q.new_empty((1, 1, 1, D)).expand(B, Hq, 1, D)
    plan = validate(q4, k_cache, v_cache, None, None, cache_seqlens, block_table, is_causal, scale, window_size,
                    softcap, alibi_slopes, num_splits, return_lse, sinks)
    if max_seqlen_q > plan.capacity:
        _fail(ValueError, f"max_seqlen_q = {max_seqlen_q} does not fit a cache of {plan.capacity} positions per "
                          f"sequence")
    return plan


def check_cu_seqlens_q(cu_host: Tensor, total_q: int, max_seqlen_q: int) -> None:
    """The values of a packed call's cu_seqlens_q, read to the host by the route that groups
    the chunks: 0 first, never decreasing, ``total_q`` last, chunks <= ``max_seqlen_q``."""
    check_cu_seqlens_values(cu_host, cu_host, total_q, total_q, max_seqlen_q, max_seqlen_q, _PREFIX)


# ---------------------------------------------------------------------------------------
# FP8 (e4m3) caches
# ---------------------------------------------------------------------------------------


def is_fp8_call(k_cache, v_cache, k_descale, v_descale) -> bool:
    """Whether a call asks for the FP8 cache: descales given, or a cache in an FP8 dtype."""
    if k_descale is not None or v_descale is not None:
        return True
    return any(isinstance(t, Tensor) and (t.dtype == torch.float8_e4m3fn or t.dtype in OTHER_FP8)
               for t in (k_cache, v_cache))


def validate_fp8(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size, softcap,
                 alibi_slopes, num_splits, return_lse, sinks, k_descale, v_descale) -> tuple:
    """The checks of an FP8 cache call: both caches float8_e4m3fn (e5m2 and the other formats
    named as unsupported, a 16-bit cache with descales as a mix), q and the new k / v float16 or
    bfloat16, a GPU of compute capability 8.9 or newer, then every check of :func:`validate` and
    the descales' (:func:`fp8_descales`). Returns (plan, k_descale, v_descale), the descales as the
    kernels read them."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor):
            _check_tensor(name, t, 4, "(batch, kv_heads, max_seqlen, head_dim)")
    dts = f"k_cache {dtype_name(k_cache.dtype)}, v_cache {dtype_name(v_cache.dtype)}"
    if k_cache.dtype in OTHER_FP8 or v_cache.dtype in OTHER_FP8:
        _fail(TypeError, f"only the e4m3 FP8 format (torch.float8_e4m3fn) is supported for caches, got {dts}")
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        _fail(TypeError, f"k_descale / v_descale go with FP8 caches: k_cache and v_cache must both be "
                         f"torch.float8_e4m3fn, got {dts}")
    if isinstance(q, Tensor) and q.dtype not in (torch.float16, torch.bfloat16):
        _fail(TypeError, f"q has dtype {dtype_name(q.dtype)}; over an FP8 cache the queries (and the new k / v) "
                         f"are float16 or bfloat16")
    plan = validate(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size, softcap,
                    alibi_slopes, num_splits, return_lse, sinks, fp8=True)
    if q.is_cuda and device_capability(q.device) < FP8_MIN_CAPABILITY:
        major, minor = device_capability(q.device)
        _fail(RuntimeError, f"FP8 (e4m3) KV caches need a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                            f"Blackwell); {q.device} is {major}.{minor}")
    B, Hkv = q.shape[0], k_cache.shape[1]
    return (plan, fp8_descales(k_descale, "k_descale", B, Hkv, q.device),
            fp8_descales(v_descale, "v_descale", B, Hkv, q.device))


def fp8_descales(descale, name: str, batch: int, kv_heads: int, device, prefix: str = None) -> Tensor:
    """A descale as the contiguous float32 (batch, kv_heads) tensor on ``device`` the kernels read
    (a stored e4m3 value x8 stands for x8 * descale): None is 1; a float, or a float32 tensor of
    shape () or (1,), is per tensor; (batch, kv_heads) is per (batch entry, KV head), as
    flash_cuda.reference.fp8_descale defines them. A tensor must be on ``device``. ``prefix``: the
    messages' (the calling function's name; this module's by default)."""
    def _fail(kind, msg: str):
        raise kind((_PREFIX if prefix is None else prefix) + msg)

    if descale is None:
        return torch.ones((batch, kv_heads), dtype=torch.float32, device=device)
    if isinstance(descale, bool) or not isinstance(descale, (int, float, Tensor)):
        _fail(TypeError, f"{name} must be None, a float or a float32 tensor, got {type(descale).__name__}")
    if not isinstance(descale, Tensor):
        return torch.full((batch, kv_heads), float(descale), dtype=torch.float32, device=device)
    if descale.dtype != torch.float32:
        _fail(TypeError, f"{name} must be float32 (the kernels read float32 descales), got {dtype_name(descale.dtype)}")
    if descale.device != device:
        _fail(RuntimeError, f"{name} must be on q's device {device}, got {descale.device}")
    shape = tuple(descale.shape)
    if shape in ((), (1,)):
        return descale.reshape(1, 1).expand(batch, kv_heads).contiguous()
    if shape != (batch, kv_heads):
        _fail(ValueError, f"{name} must be per tensor (a float, or a float32 tensor of shape () or (1,)) or per "
                          f"(batch, KV head) of shape ({batch}, {kv_heads}); got shape {shape} (query heads of "
                          f"a GQA group share their KV head's descale)")
    return descale.contiguous()


# Plans of the FP8 calls' signatures (the metadata part of validate_fp8), as plans keeps the 16-bit ones.
fp8_plans: dict = {}


def _descale_key(descale):
    """What the checks read of a descale (its form, never its values), or False where it has no
    key (a type the checks reject, or a bool)."""
    if descale is None:
        return None
    if type(descale) is float or type(descale) is int:
        return type(descale)
    if type(descale) is Tensor:
        return (descale.shape, descale.dtype, descale.device, descale.is_contiguous())
    return False


def plan_fp8_call(eager: bool, q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size,
                  softcap, alibi_slopes, num_splits, return_lse, sinks, k_descale, v_descale) -> tuple:
    """:func:`validate_fp8` for a call, its metadata checks kept per signature as :func:`plan_call`
    keeps the 16-bit ones (the descales' forms join the key); the descales are converted on every
    call (:func:`fp8_descales`: a (batch, kv_heads) float32 tensor is taken as it is) and an int
    ``cache_seqlens`` is checked on every call. Returns (plan, k_descale, v_descale)."""
    kd_key, vd_key = _descale_key(k_descale), _descale_key(v_descale)
    if (eager and kd_key is not False and vd_key is not False
            and _simple_options(scale, window_size, softcap, is_causal, num_splits, return_lse)):
        key = (_signature(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, window_size, softcap,
                          alibi_slopes, is_causal, num_splits, return_lse, sinks), kd_key, vd_key)
        plan = fp8_plans.get(key)
        if plan is None:
            plan, kd, vd = validate_fp8(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale,
                                        window_size, softcap, alibi_slopes, num_splits, return_lse, sinks, k_descale,
                                        v_descale)
            if len(fp8_plans) >= _MAX_PLANS:
                fp8_plans.clear()
            fp8_plans[key] = plan
            return plan, kd, vd
        if type(cache_seqlens) is int:
            _check_cache_len(cache_seqlens, plan.s_new, plan.capacity)
        B, Hkv = q.shape[0], k_cache.shape[1]
        return (plan, fp8_descales(k_descale, "k_descale", B, Hkv, q.device),
                fp8_descales(v_descale, "v_descale", B, Hkv, q.device))
    return validate_fp8(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size, softcap,
                        alibi_slopes, num_splits, return_lse, sinks, k_descale, v_descale)
