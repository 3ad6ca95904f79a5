"""Input validation for flash_cuda's entry points: every check, with the message it raises.

Each check is a separate function so that every error can be exercised on a machine without a
GPU (CPU or meta tensors, or a patched capability lookup). :func:`validate` and
:func:`validate_varlen` run them in order for :func:`flash_cuda.attention` and
:func:`flash_cuda.varlen_attention`; :mod:`flash_cuda.kvcache_checks`,
:mod:`flash_cuda.distributed` and :mod:`flash_cuda.integrations.sdpa` call the single checks
they share.

The checks of the options (scale, window, softcap, ALiBi slopes, sinks, dropout, kernel) live in
:mod:`flash_cuda.options` and are named here too; the validated score options travel as one
:class:`ScoreOptions` from here to the custom ops, which take its fields as plain values
(``*opts``). :mod:`flash_cuda.signature` keeps the outcome of these checks per signature of the
arguments, so that a repeated call skips them.
"""

from __future__ import annotations

import os
from typing import Tuple

import torch
from torch import Tensor

from .options import (KERNELS, MAX_SEQLEN, PREFIX, VARLEN_PREFIX, ScoreOptions, check_alibi, check_dropout,
                      check_kernel, check_score_options, check_scale, check_sinks, check_softcap, check_window,
                      dtype_name, is_int, is_traced, validate_options)

__all__ = ["ScoreOptions", "validate", "validate_varlen", "SUPPORTED_DTYPES", "KERNELS", "MIN_HEAD_DIM",
           "MAX_HEAD_DIM", "check_alibi", "check_dropout", "check_kernel", "check_score_options", "check_scale",
           "check_sinks", "check_softcap", "check_window", "dtype_name", "ENVIRON", "env_key"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM = 8
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
MAX_GRID_YZ = 65535  # batch and query heads index gridDim.z / gridDim.y
MIN_CAPABILITY = (8, 0)

_ACCEPTED_DTYPES = "torch.float16, torch.bfloat16 or torch.float32"


def check_types(q, k, v, is_causal, return_lse, deterministic, prefix: str = PREFIX,
                **more_flags) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{prefix}{name} must be a torch.Tensor, got {type(t).__name__}")
    flags = {"is_causal": is_causal, "return_lse": return_lse, "deterministic": deterministic}
    flags.update(more_flags)
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{prefix}{name} must be a bool, got {type(flag).__name__}")


def check_dtypes(q: Tensor, k: Tensor, v: Tensor, prefix: str = PREFIX) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            fp8 = " (FP8 e4m3 inputs: flash_cuda.attention_fp8, forward only, on Hopper)" \
                if t.dtype == torch.float8_e4m3fn else ""
            raise TypeError(
                f"{prefix}{name} has unsupported dtype {t.dtype}; "
                f"supported dtypes are {_ACCEPTED_DTYPES}{fp8}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{prefix}q, k and v must have the same dtype, got q: {dtype_name(q.dtype)}, "
            f"k: {dtype_name(k.dtype)}, v: {dtype_name(v.dtype)}"
        )


def _check_heads_and_head_dim(Hq: int, Hkv: int, D: int, prefix: str) -> None:
    """The rules on head counts and head dim, shared by the dense and the packed layout."""
    if Hq < 1 or Hkv < 1:
        raise ValueError(
            f"{prefix}the number of heads must be at least 1, got q heads {Hq}, kv heads {Hkv}"
        )
    if Hq % Hkv != 0:
        raise ValueError(
            f"{prefix}the number of query heads ({Hq}) must be a multiple of the number of "
            f"key/value heads ({Hkv}) (grouped-query attention: query head h uses kv head "
            f"h // (Hq // Hkv))"
        )
    if D < MIN_HEAD_DIM or D > MAX_HEAD_DIM or D % HEAD_DIM_MULTIPLE != 0:
        raise ValueError(
            f"{prefix}unsupported head dim {D}; the head dim must be a multiple of "
            f"{HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
        )


def _check_rank(q: Tensor, k: Tensor, v: Tensor, layouts: dict, note: str, prefix: str) -> None:
    """The rank rule of the dense (4-D) and packed (3-D) layouts; ``layouts`` names each
    tensor's dimensions, ``note`` explains the layout."""
    ndim = len(layouts["q"].split(","))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != ndim:
            raise ValueError(
                f"{prefix}{name} must be a {ndim}-D tensor {layouts[name]}{note}, "
                f"got {t.dim()}-D with shape {tuple(t.shape)}"
            )


def _check_head_dim_and_kv(q: Tensor, k: Tensor, v: Tensor, layouts: dict, prefix: str) -> None:
    """One head dim for q, k, v and one shape for k and v (both layouts)."""
    ndim = q.dim()
    D = q.shape[-1]
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(
            f"{prefix}q, k and v must have the same head dim (dim {ndim - 1}), got "
            f"q: {q.shape[-1]}, k: {k.shape[-1]}, v: {v.shape[-1]}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{prefix}k and v must have the same shape {layouts['k']}, "
            f"got k: {tuple(k.shape)}, v: {tuple(v.shape)}"
        )


def _check_int32_sizes(what: str, name_q: str, size_q: int, name_k: str, size_k: int, prefix: str) -> None:
    """Sequence positions are int32 inside the kernels."""
    if size_q > MAX_SEQLEN or size_k > MAX_SEQLEN:
        raise ValueError(f"{prefix}{what} must be below 2^31, got {name_q} {size_q}, {name_k} {size_k}")


def check_shapes(q: Tensor, k: Tensor, v: Tensor, prefix: str = PREFIX) -> None:
    layouts = {"q": "(batch, heads, seqlen_q, head_dim)", "k": "(batch, kv_heads, seqlen_k, head_dim)",
               "v": "(batch, kv_heads, seqlen_k, head_dim)"}
    _check_rank(q, k, v, layouts, "", prefix)
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"{prefix}q, k and v must have the same batch size (dim 0), got "
            f"q: {q.shape[0]}, k: {k.shape[0]}, v: {v.shape[0]}"
        )
    _check_head_dim_and_kv(q, k, v, layouts, prefix)
    _check_heads_and_head_dim(Hq, k.shape[1], D, prefix)
    if B > MAX_GRID_YZ or Hq > MAX_GRID_YZ:
        raise ValueError(
            f"{prefix}batch size ({B}) and number of query heads ({Hq}) must each be at most "
            f"{MAX_GRID_YZ} (CUDA grid limit); split the batch into several calls"
        )
    _check_int32_sizes("sequence lengths", "seqlen_q", Sq, "seqlen_k", k.shape[2], prefix)


def check_varlen_shapes(q: Tensor, k: Tensor, v: Tensor, prefix: str = VARLEN_PREFIX) -> None:
    layouts = {"q": "(total_q, heads, head_dim)", "k": "(total_k, kv_heads, head_dim)",
               "v": "(total_k, kv_heads, head_dim)"}
    _check_rank(q, k, v, layouts, " (the sequences packed along dim 0)", prefix)
    _check_head_dim_and_kv(q, k, v, layouts, prefix)
    total_q, Hq, D = q.shape
    _check_heads_and_head_dim(Hq, k.shape[1], D, prefix)
    if Hq > MAX_GRID_YZ:
        raise ValueError(
            f"{prefix}the number of query heads ({Hq}) must be at most {MAX_GRID_YZ} (CUDA "
            f"grid limit)"
        )
    _check_int32_sizes("the packed row counts", "total_q", total_q, "total_k", k.shape[0], prefix)


def check_strides(q: Tensor, k: Tensor, v: Tensor, prefix: str = PREFIX) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{prefix}{name} must have a contiguous last dimension (stride(-1) == 1), got "
                f"strides {tuple(t.stride())}; call .contiguous() or pass a view whose last "
                f"dim is contiguous (any other strides are fine)"
            )


def check_cu_seqlens_tensors(cu_seqlens_q, cu_seqlens_k, prefix: str = VARLEN_PREFIX) -> int:
    """Type, dtype and shape of cu_seqlens_q / cu_seqlens_k; returns the batch size B."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{prefix}{name} must be a torch.Tensor of int32 sequence start offsets "
                f"(shape (batch + 1,)), got {type(t).__name__}"
            )
        if t.dtype != torch.int32:
            raise TypeError(f"{prefix}{name} must be an int32 tensor, got {dtype_name(t.dtype)}")
        if t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(
                f"{prefix}{name} must be 1-D of shape (batch + 1,) (0, then the running sum of "
                f"the sequence lengths), got shape {tuple(t.shape)}"
            )
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"{prefix}cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    B = cu_seqlens_q.shape[0] - 1
    if B > MAX_GRID_YZ:
        raise ValueError(
            f"{prefix}batch size ({B}) must be at most {MAX_GRID_YZ} (CUDA grid limit); split "
            f"the batch into several calls"
        )
    return B


def check_max_seqlen(max_seqlen_q, max_seqlen_k, prefix: str = VARLEN_PREFIX) -> Tuple[int, int]:
    res = []
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not is_int(m):
            raise TypeError(
                f"{prefix}{name} must be a Python int (an upper bound on the sequence "
                f"lengths), got {type(m).__name__}"
            )
        if not (0 <= m <= MAX_SEQLEN):
            raise ValueError(f"{prefix}{name} must be in [0, 2^31 - 1], got {m}")
        res.append(m if is_traced(m) else int(m))
    return res[0], res[1]


def check_cu_seqlens_values(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int,
                            total_k: int, max_seqlen_q: int, max_seqlen_k: int,
                            prefix: str = VARLEN_PREFIX) -> None:
    """The values of cu_seqlens (a device sync): start at 0, non-decreasing, last entry ==
    the packed row count, every length <= max_seqlen."""
    for name, cu, total, max_len, mname in (
            ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k")):
        vals = [int(x) for x in cu.tolist()]
        lens = [b - a for a, b in zip(vals, vals[1:])]
        problem = None
        if vals[0] != 0:
            problem = f"its first entry is {vals[0]}, not 0"
        elif any(n < 0 for n in lens):
            i = next(i for i, n in enumerate(lens) if n < 0)
            problem = f"it decreases at index {i + 1} ({vals[i]} -> {vals[i + 1]})"
        elif vals[-1] != total:
            problem = f"its last entry is {vals[-1]}, not the number of packed rows {total}"
        elif lens and max(lens) > max_len:
            i = max(range(len(lens)), key=lens.__getitem__)
            problem = f"sequence {i} has length {lens[i]} > {mname} = {max_len}"
        if problem:
            shown = vals if len(vals) <= 12 else vals[:6] + ["..."] + vals[-6:]
            raise ValueError(
                f"{prefix}bad {name} {shown}: {problem} (it must start at 0, not decrease, "
                f"end at the row count and give lengths <= {mname})"
            )


# os.environ's own dict of the environment, by encoded name (CPython keeps it in os.environ._data
# and updates it with every change made through os.environ): whether a variable is set at all is
# then one dict lookup, where ``name in os.environ`` costs a microsecond (three Python methods, a
# KeyError raised and caught) on every call that reads a switch that is not set.
ENVIRON = getattr(os.environ, "_data", None)
if not isinstance(ENVIRON, dict) or not hasattr(os.environ, "encodekey"):
    ENVIRON = os.environ


def env_key(name: str):
    """``name`` as a key of :data:`ENVIRON` (``env_key(name) in ENVIRON``: the variable is set)."""
    return name if ENVIRON is os.environ else os.environ.encodekey(name)


_CU_SEQLENS_ENV = "FLASH_CUDA_CHECK_CU_SEQLENS"
_CU_SEQLENS_KEY = env_key(_CU_SEQLENS_ENV)


def check_cu_seqlens_enabled(flag: bool) -> bool:
    """The argument, or the environment variable, read on every call (not at import) so that it
    can be switched on in a running process."""
    if flag:
        return True
    if _CU_SEQLENS_KEY not in ENVIRON:
        return False
    env = os.environ.get(_CU_SEQLENS_ENV, "").strip().lower()
    return env not in ("", "0", "false", "no", "off")


_capability_cache: dict = {}


def device_capability(device) -> Tuple[int, int]:
    """(major, minor) of a CUDA device (a torch.device or its index), cached: the query costs
    microseconds that a decode step cannot spare."""
    if isinstance(device, int):
        index = device
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability_cache.get(index)
    if cap is None:
        cap = tuple(torch.cuda.get_device_capability(index))
        _capability_cache[index] = cap
    return cap


def check_capability(device: torch.device, prefix: str = PREFIX) -> None:
    major, minor = device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise RuntimeError(
            f"{prefix}flash_cuda needs an NVIDIA GPU of compute capability 8.0 or newer "
            f"(Ampere, Ada, Hopper); {device} has compute capability {major}.{minor}"
        )


def check_aux_devices(q: Tensor, prefix: str = PREFIX, **tensors) -> None:
    """The side tensors (ALiBi slopes, cu_seqlens) must be on q's device."""
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise RuntimeError(
                f"{prefix}{name} must be on the same device as q ({q.device}), got {t.device}"
            )


def check_device(q: Tensor, k: Tensor, v: Tensor, prefix: str = PREFIX) -> None:
    if not (q.device == k.device == v.device):
        raise RuntimeError(
            f"{prefix}q, k and v must be on the same device, got q: {q.device}, "
            f"k: {k.device}, v: {v.device}"
        )
    if q.device.type != "cuda":
        raise RuntimeError(
            f"{prefix}inputs must be CUDA tensors, got device '{q.device}'; flash_cuda runs "
            f"only on NVIDIA GPUs (move the inputs with .cuda(), or use "
            f"torch.nn.functional.scaled_dot_product_attention on {q.device.type})"
        )
    # The capability query cannot be traced by torch.compile; the extension checks it
    # again on every launch, so skipping it while tracing loses nothing.
    if not torch.compiler.is_compiling():
        check_capability(q.device, prefix)


def validate(q, k, v, *, scale=None, is_causal=False, window_size=(-1, -1), softcap=0.0,
             alibi_slopes=None, return_lse=False, deterministic=False,
             kernel="auto") -> Tuple[ScoreOptions, int]:
    """Validates the arguments of :func:`flash_cuda.attention`; returns (options, tier).

    Order: types, dtypes, shapes, strides, scale, window, softcap, ALiBi slopes, kernel,
    devices, GPU capability. The extension's presence is checked by the caller afterwards.
    """
    check_types(q, k, v, is_causal, return_lse, deterministic)
    check_dtypes(q, k, v)
    check_shapes(q, k, v)
    check_strides(q, k, v)
    opts, tier = validate_options(q, batch=q.shape[0], scale=scale, is_causal=is_causal,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  kernel=kernel, varlen=False, prefix=PREFIX,
                                  deterministic=deterministic)
    check_aux_devices(q, alibi_slopes=opts.alibi_slopes)
    check_device(q, k, v)
    return opts, tier


def validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    scale=None, is_causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, return_lse=False, deterministic=False, kernel="auto",
                    check_cu_seqlens=False) -> Tuple[ScoreOptions, int, int, int]:
    """Validates the arguments of :func:`flash_cuda.varlen_attention`; returns (options, tier,
    max_seqlen_q, max_seqlen_k). Same order as :func:`validate`, with cu_seqlens and
    max_seqlen after the strides. The values inside cu_seqlens are checked by the op
    (check_cu_seqlens)."""
    prefix = VARLEN_PREFIX
    check_types(q, k, v, is_causal, return_lse, deterministic, prefix,
                check_cu_seqlens=check_cu_seqlens)
    check_dtypes(q, k, v, prefix)
    check_varlen_shapes(q, k, v, prefix)
    check_strides(q, k, v, prefix)
    B = check_cu_seqlens_tensors(cu_seqlens_q, cu_seqlens_k, prefix)
    max_q, max_k = check_max_seqlen(max_seqlen_q, max_seqlen_k, prefix)
    opts, tier = validate_options(q, batch=B, scale=scale, is_causal=is_causal,
                                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                                  kernel=kernel, varlen=True, prefix=prefix,
                                  deterministic=deterministic)
    check_aux_devices(q, prefix, alibi_slopes=opts.alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                      cu_seqlens_k=cu_seqlens_k)
    check_device(q, k, v, prefix)
    return opts, tier, max_q, max_k
