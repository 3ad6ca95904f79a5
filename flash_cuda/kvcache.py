"""The KV-cache entry point :func:`attention_with_kvcache`: decode and prefill against a dense or
paged cache, with the new keys appended in place (FlashAttention's ``flash_attn_with_kvcache``
semantics in flash_cuda's (batch, heads, seq, head_dim) layout).

Inference only: no autograd graph is recorded. The launch plan depends on shapes alone (the
cache's capacity, never the lengths in ``cache_seqlens``), so one CUDA graph captured around a
decode step serves every later step. :func:`flash_cuda.reference.attention_with_kvcache_reference`
is the executable specification (pure PyTorch, runs on CPU).

* ``flash_cuda::fwd_kvcache``: the ``torch.library`` custom op behind it, declared as mutating
  ``k_cache`` and ``v_cache`` (so functionalization under ``torch.compile`` keeps the append),
  with a fake implementation: ``torch.compile(fullgraph=True)`` traces a decode step without
  a graph break. It always returns ``(out, lse)``; lse is an empty float32 ``(0,)`` tensor
  unless ``return_lse``.
* ``flash_cuda::fwd_kvcache_packed``: the same for packed (varlen) queries (``cu_seqlens_q``),
  today a scatter for the appends and one binding call per distinct chunk length.
* The host path: a decode step calls this with the same shapes, strides and options every
  time, so the outcome of the checks is kept per signature of the arguments (their metadata,
  never their values) and a repeated signature skips them. Plain eager tensors then run the
  extension call without the op's dispatch; anything the op exists for (tracing, fake or
  functional tensors, tensor subclasses, dispatch or function modes) takes the op.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _ext
from .ops import eager_ok, fwd_impl
from .validation import (MAX_GRID_YZ, MAX_HEAD_DIM, MAX_SEQLEN, MIN_CAPABILITY, MIN_HEAD_DIM, ScoreOptions,
                         check_alibi, check_capability, check_cu_seqlens_values, check_score_options, check_sinks,
                         device_capability, dtype_name)

__all__ = ["attention_with_kvcache", "fwd_kvcache", "fwd_kvcache_packed", "PAGE_SIZE_MULTIPLE", "MAX_NUM_SPLITS"]

_PREFIX = "flash_cuda.attention_with_kvcache: "
_DTYPES = (torch.float16, torch.bfloat16)
PAGE_SIZE_MULTIPLE = 16  # a paged cache's page size: any multiple of this
MAX_NUM_SPLITS = 256
# Queries per head up to which the split-KV decode kernels run a call (tiers/mma/family.h:
# decode::kMaxDecodeQueries); longer prompts against a dense cache take attention()'s forward.
_DECODE_MAX_QUERIES = 16


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


_side_streams: dict = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One side stream per device for the prefill path's cache writes."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


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


def _check_alignment(k_cache: Tensor, v_cache: Tensor) -> None:
    if not (_aligned_rows(k_cache) and _aligned_rows(v_cache)):
        _fail(ValueError, "the caches are written in place, so their rows must be 16-byte aligned: a base "
                          "address and strides (in bytes) that are multiples of 16")


def _check_device(q: Tensor, dev: int) -> None:
    """q on a CUDA device (index ``dev``, -1 for any other device) of capability 8.0 or newer."""
    if dev < 0:
        _fail(RuntimeError, f"inputs must be CUDA tensors, got device '{q.device}'; flash_cuda runs only on "
                            f"NVIDIA GPUs (flash_cuda.reference.attention_with_kvcache_reference runs anywhere)")
    # The capability query cannot be traced; the extension checks it again on every launch.
    if not torch.compiler.is_compiling() and device_capability(dev) < MIN_CAPABILITY:
        check_capability(q.device, _PREFIX)


def _check_cache_len(cache_len: int, s_new: int, capacity: int) -> None:
    if cache_len < 0 or cache_len + s_new > capacity:
        _fail(ValueError, f"cache_seqlens = {cache_len} with {s_new} new tokens needs {cache_len + s_new} "
                          f"positions, but the cache holds {capacity} per sequence (cache_seqlens must be >= 0)")


_ENV_CHECK = "FLASH_CUDA_CHECK_KVCACHE"


def _check_enabled(flag: bool) -> bool:
    env = os.environ.get(_ENV_CHECK, "").strip().lower()
    return bool(flag) or env not in ("", "0", "false", "no", "off")


def _check_values(lens: list, block_table: Optional[Tensor], s_new, capacity: int,
                  num_pages: int) -> None:
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


class _Plan(NamedTuple):
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


def _validate(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size, softcap,
              alibi_slopes, num_splits, return_lse, sinks=None) -> _Plan:
    """Every check of :func:`attention_with_kvcache`'s arguments but the per-call ones (an int
    ``cache_seqlens``'s value, ``check_inputs``), in the order the errors are documented."""
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
    dev = q.get_device()
    if k_cache.dtype is not dt or k_cache.get_device() != dev:
        _check_same("k_cache", k_cache, q)
    if v_cache.dtype is not dt or v_cache.get_device() != dev:
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
    if Sq < 1:
        _fail(ValueError, "q must hold at least one query (seqlen_q >= 1, dim 2)")
    if B > MAX_GRID_YZ or Hq > MAX_GRID_YZ:
        _fail(ValueError, f"batch size ({B}) and query heads ({Hq}) must each be at most {MAX_GRID_YZ}")
    # Under torch.compile the tensors are fake (no address): the op checks the rows when it runs.
    if not torch.compiler.is_compiling():
        _check_alignment(k_cache, v_cache)
    if paged:
        if not isinstance(block_table, Tensor):
            _fail(TypeError, f"block_table must be None or an int32 tensor (batch, max_pages), got "
                             f"{type(block_table).__name__}")
        if block_table.dtype != torch.int32:
            _fail(TypeError, f"block_table must be an int32 tensor, got {dtype_name(block_table.dtype)}")
        if block_table.dim() != 2 or block_table.shape[0] != B:
            _fail(ValueError, f"block_table must have shape ({B}, max_pages_per_sequence), got "
                              f"{tuple(block_table.shape)}")
        if block_table.get_device() != dev:
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
            if t.dtype is not dt or t.get_device() != dev:
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
        if cache_seqlens.get_device() != dev:
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
        if alibi_slopes.get_device() != dev:
            _fail(RuntimeError, f"alibi_slopes must be on q's device {q.device}, got {alibi_slopes.device}")
    if sinks is not None:
        check_sinks(sinks, Hq, _PREFIX)
        if sinks.device != q.device:
            _fail(RuntimeError, f"sinks must be on q's device {q.device}, got {sinks.device}")
    _check_device(q, dev)
    return _Plan(opts.scale, opts.window_left, opts.window_right, opts.softcap, capacity, s_new,
                 isinstance(cache_seqlens, Tensor) and cache_seqlens.stride(0) != 1,
                 paged and block_table.stride(1) != 1)


# Plans of the signatures seen, keyed by _signature. A decode loop meets a handful (one per
# batch shape and query count); prompts of many lengths would add one each, hence the bound.
_plans: dict = {}
_MAX_PLANS = 256


def _signature(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, window_size, softcap,
               alibi_slopes, is_causal, num_splits, return_lse, sinks=None):
    """Everything the checks read, as a hashable key (:func:`_plain` and :func:`_simple_options`
    hold). Values that compare equal across types (1 == 1.0) carry their type, so a key never
    stands for an argument the checks would reject. An int ``cache_seqlens`` enters as None:
    its value is checked on every call."""
    return (q.shape, q.stride(), q.dtype, q.get_device(),
            k_cache.shape, k_cache.stride(), k_cache.dtype, k_cache.get_device(), k_cache.data_ptr() & 15,
            v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.get_device(), v_cache.data_ptr() & 15,
            None if k is None else (k.shape, k.stride(), k.dtype, k.get_device()),
            None if v is None else (v.shape, v.stride(), v.dtype, v.get_device()),
            (cache_seqlens.shape, cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.get_device())
            if type(cache_seqlens) is Tensor else None,
            None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype,
                                              block_table.get_device()),
            None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride(), alibi_slopes.dtype,
                                               alibi_slopes.get_device()),
            None if sinks is None else (sinks.shape, sinks.dtype, sinks.get_device()),
            scale, type(scale), window_size, softcap, type(softcap), is_causal, num_splits, return_lse)


def _plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks=None) -> bool:
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


# ---------------------------------------------------------------------------------------
# The extension call (and its routes) behind the op and the eager path
# ---------------------------------------------------------------------------------------


def _run(C, q, k_cache, v_cache, k, v, lens, cache_len, block_table, scale, window_left, window_right, softcap,
         alibi_slopes, num_splits, return_lse, check_inputs, sinks=None):
    """The validated call: (out, lse), lse None unless ``return_lse``. ``lens`` (the tensor
    ``cache_seqlens``, contiguous) or ``cache_len`` (the int) gives the cached lengths; ``sinks``
    float32 and contiguous, or None."""
    if check_inputs or _ENV_CHECK in os.environ:
        if _check_enabled(check_inputs):
            B, s_new = q.shape[0], 0 if k is None else k.shape[2]
            capacity = k_cache.shape[2] * (1 if block_table is None else block_table.shape[1])
            _check_values(lens.tolist() if lens is not None else [cache_len] * B, block_table, s_new, capacity,
                          k_cache.shape[0])
    if lens is None and block_table is None and q.shape[2] > _DECODE_MAX_QUERIES:
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


@torch.library.custom_op("flash_cuda::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                cache_seqlens: Optional[Tensor], cache_len: int, block_table: Optional[Tensor], scale: float,
                window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                num_splits: int, return_lse: bool, check_inputs: bool,
                sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Attention against a KV cache after appending k / v to it in place: (out, lse), lse empty
    (0,) unless ``return_lse``. The arguments are the extension's (``cache_seqlens`` a
    contiguous int32 tensor or None, then ``cache_len`` the int length of every sequence),
    validated by :func:`attention_with_kvcache`, plus ``check_inputs``: the values of
    cache_seqlens and block_table checked here, at run time (also inside a compiled graph);
    ``sinks`` float32 (heads,) or None."""
    _check_alignment(k_cache, v_cache)  # the addresses, which tracing could not see
    out, lse = _run(_ext.require(), q, k_cache, v_cache, k, v, cache_seqlens, cache_len, block_table, scale,
                    window_left, window_right, softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks)
    return out, (lse if lse is not None else q.new_empty((0,), dtype=torch.float32))


@fwd_kvcache.register_fake
def _fwd_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, cache_len, block_table, scale, window_left,
                      window_right, softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks=None):
    lse_shape = tuple(q.shape[:3]) if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------
# Packed (varlen) queries: prompt chunks and decode tokens of different sequences in one call
# ---------------------------------------------------------------------------------------


def _validate_packed(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, is_causal,
                     scale, window_size, softcap, alibi_slopes, num_splits, return_lse, sinks) -> _Plan:
    """The metadata checks of a packed call. The packed tensors' own rules come first; the
    cache, options and device rules are :func:`_validate`'s, run on stand-ins of q's batched
    shape (an expanded one-element tensor: no memory), so both layouts keep one wording."""
    _check_tensor("q", q, 3, "(total_q, heads, head_dim)")
    if not isinstance(cu_seqlens_q, Tensor):
        _fail(TypeError, f"cu_seqlens_q must be a torch.Tensor of int32 sequence start offsets (shape "
                         f"(batch + 1,)), got {type(cu_seqlens_q).__name__}")
    if cu_seqlens_q.dtype is not torch.int32:
        _fail(TypeError, f"cu_seqlens_q must be an int32 tensor, got {dtype_name(cu_seqlens_q.dtype)}")
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 2:
        _fail(ValueError, f"cu_seqlens_q must be 1-D of shape (batch + 1,) with batch >= 1 (0, then the running "
                          f"sum of the chunk lengths), got shape {tuple(cu_seqlens_q.shape)}")
    if cu_seqlens_q.get_device() != q.get_device():
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
    plan = _validate(q4, k_cache, v_cache, None, None, cache_seqlens, block_table, is_causal, scale, window_size,
                     softcap, alibi_slopes, num_splits, return_lse, sinks)
    if max_seqlen_q > plan.capacity:
        _fail(ValueError, f"max_seqlen_q = {max_seqlen_q} does not fit a cache of {plan.capacity} positions per "
                          f"sequence")
    return plan


def _pool_of(cache: Tensor) -> Optional[Tensor]:
    """A dense cache (B, Hkv, S, D) is already a paged pool of B pages of S rows (page b is
    sequence b) when S is a page size the kernels take: subsets of the batch then run by
    block table, without copying their cache rows."""
    return cache if cache.shape[2] % PAGE_SIZE_MULTIPLE == 0 and cache.shape[2] > 0 else None


def _run_packed(C, q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, lens, block_table, scale, window_left,
                window_right, softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks=None):
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
    check_cu_seqlens_values(cu_host, cu_host, total_q, total_q, max_seqlen_q, max_seqlen_q, _PREFIX)
    cu = [int(x) for x in cu_host.tolist()]
    chunks = [b - a for a, b in zip(cu, cu[1:])]
    paged = block_table is not None
    capacity = k_cache.shape[2] * (block_table.shape[1] if paged else 1)
    if _check_enabled(check_inputs):
        _check_values(lens.tolist(), block_table, chunks if k is not None else 0, capacity, k_cache.shape[0])
    cu_long = cu_seqlens_q.long()
    if k is not None and total_q:
        # Row r belongs to sequence seq[r] and lands at its position lens[seq] + (r - cu[seq]).
        seq = torch.repeat_interleave(torch.arange(B, device=dev), cu_long.diff(), output_size=total_q)
        pos = lens.long()[seq] + torch.arange(total_q, device=dev) - cu_long[seq]
        if paged:
            page_size = k_cache.shape[2]
            first, second = block_table.long()[seq, pos // page_size], pos % page_size
        else:
            first, second = seq, pos
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
    :func:`attention_with_kvcache`; the values of cu_seqlens_q are checked here, at run time."""
    _check_alignment(k_cache, v_cache)
    out, lse = _run_packed(_ext.require(), q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens,
                           block_table, scale, window_left, window_right, softcap, alibi_slopes, num_splits,
                           return_lse, check_inputs, sinks)
    return out, (lse if lse is not None else q.new_empty((0,), dtype=torch.float32))


@fwd_kvcache_packed.register_fake
def _fwd_kvcache_packed_fake(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table,
                             scale, window_left, window_right, softcap, alibi_slopes, num_splits, return_lse,
                             check_inputs, sinks=None):
    lse_shape = (q.shape[1], q.shape[0]) if return_lse else (0,)
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _attention_packed(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table, is_causal,
                      scale, window_size, softcap, alibi_slopes, sinks, num_splits, return_lse, check_inputs):
    """attention_with_kvcache with cu_seqlens_q: checked on every call (no kept signature)."""
    if cu_seqlens_q is None or max_seqlen_q is None:
        _fail(ValueError, "packed queries need both cu_seqlens_q and max_seqlen_q")
    plan = _validate_packed(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table,
                            is_causal, scale, window_size, softcap, alibi_slopes, num_splits, return_lse, sinks)
    lens = cache_seqlens.contiguous() if plan.fix_lens else cache_seqlens
    if plan.fix_table:
        block_table = block_table.contiguous()
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().contiguous()
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    args = (q, k_cache, v_cache, k, v, cu_seqlens_q.contiguous(), max_seqlen_q, lens, block_table, plan.scale,
            plan.window_left, plan.window_right, plan.softcap, alibi_slopes, num_splits, return_lse, check_inputs,
            sinks)
    if _plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks) \
            and type(cu_seqlens_q) is Tensor:
        out, lse = _run_packed(_ext.require(), *args)
    else:
        if not _ext.is_available():
            raise RuntimeError(_ext.unavailable_message())
        out, lse = fwd_kvcache_packed(*args)
    if return_lse:
        return out, lse
    return out


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
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    num_splits: int = 0,
    return_lse: bool = False,
    check_inputs: bool = False,
    cu_seqlens_q: Optional[Tensor] = None,
    max_seqlen_q: Optional[int] = None,
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

    Works under ``torch.compile(fullgraph=True)`` (the custom op
    ``torch.ops.flash_cuda.fwd_kvcache``, declared as mutating the caches, so the append is
    kept) and inside CUDA graphs (captured by hand or by ``mode="reduce-overhead"``): with a
    tensor ``cache_seqlens`` one captured step serves every length. Repeated calls with the
    same shapes, strides, dtypes, devices and options are checked once (the outcome is kept
    per signature); an int ``cache_seqlens`` is checked on every call.

    Raises:
        TypeError, ValueError, RuntimeError: a bad argument, named with what is accepted, before
            anything is written or launched.
    """
    if cu_seqlens_q is not None or max_seqlen_q is not None:
        return _attention_packed(q, k_cache, v_cache, k, v, cu_seqlens_q, max_seqlen_q, cache_seqlens, block_table,
                                 is_causal, scale, window_size, softcap, alibi_slopes, sinks, num_splits, return_lse,
                                 check_inputs)
    eager = _plain(q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks)
    if eager and _simple_options(scale, window_size, softcap, is_causal, num_splits, return_lse):
        key = _signature(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, window_size, softcap,
                         alibi_slopes, is_causal, num_splits, return_lse, sinks)
        plan = _plans.get(key)
        if plan is None:
            plan = _validate(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size,
                             softcap, alibi_slopes, num_splits, return_lse, sinks)
            if len(_plans) >= _MAX_PLANS:
                _plans.clear()
            _plans[key] = plan
        elif type(cache_seqlens) is int:
            _check_cache_len(cache_seqlens, plan.s_new, plan.capacity)
    else:
        plan = _validate(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale, window_size,
                         softcap, alibi_slopes, num_splits, return_lse, sinks)
    if isinstance(cache_seqlens, Tensor):
        lens, cache_len = (cache_seqlens.contiguous() if plan.fix_lens else cache_seqlens), 0
    else:
        lens, cache_len = None, cache_seqlens
    if plan.fix_table:
        block_table = block_table.contiguous()
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().contiguous()
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
    args = (q, k_cache, v_cache, k, v, lens, cache_len, block_table, plan.scale, plan.window_left,
            plan.window_right, plan.softcap, alibi_slopes, num_splits, return_lse, check_inputs, sinks)
    if eager:
        out, lse = _run(_ext.require(), *args)  # require() compiles the kernels at their first use
    else:
        if not _ext.is_available():
            raise RuntimeError(_ext.unavailable_message())
        out, lse = fwd_kvcache(*args)
    if return_lse:
        return out, lse
    return out
