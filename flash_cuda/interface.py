"""The public entry points :func:`attention` and :func:`varlen_attention`, their input
validation, and the custom ops.

Layering:

* :func:`attention` / :func:`varlen_attention` validate every input (clear errors, before
  anything is allocated or launched; the checks are shared helpers, the two differ only
  in the layout checks), then call the custom op ``torch.ops.flash_cuda.fwd`` (dense) or
  ``torch.ops.flash_cuda.varlen_fwd`` (packed sequences with cu_seqlens).
* ``flash_cuda::fwd`` / ``::bwd`` / ``::varlen_fwd`` / ``::varlen_bwd`` are
  ``torch.library`` custom ops around the compiled extension's two entry points
  (``_C.fwd`` / ``_C.bwd``, which take the dense or the packed layout). Each has a fake
  (meta) implementation, so ``torch.compile(fullgraph=True)`` traces through them without
  a graph break, and the forward ops have an autograd formula that calls the backward op
  for the gradients autograd asks for alone (dQ, or dK and dV, or all three).
* Empty problems (no batch entry, no query row or no key) are answered here without a
  kernel launch.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import _ext

__all__ = ["attention", "varlen_attention", "SUPPORTED_DTYPES", "KERNELS", "MIN_HEAD_DIM",
           "MAX_HEAD_DIM"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# kernel name -> tier id understood by the extension (0 = pick by dtype).
KERNELS = {"auto": 0, "simt": 1, "mma": 2, "wgmma": 3}
MIN_HEAD_DIM = 8
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
MAX_GRID_YZ = 65535  # batch and query heads index gridDim.z / gridDim.y
MAX_SEQLEN = 2**31 - 1  # sequence positions are int32 inside the kernels
MIN_CAPABILITY = (8, 0)

_ACCEPTED_DTYPES = "torch.float16, torch.bfloat16 or torch.float32"
_PREFIX = "flash_cuda.attention: "
_VARLEN_PREFIX = "flash_cuda.varlen_attention: "


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------
# Validation. Each step is a separate function so that every error can be exercised on
# a machine without a GPU (CPU or meta tensors, or a patched capability lookup).
# ---------------------------------------------------------------------------------------


def _check_types(q, k, v, is_causal, return_lse, deterministic, prefix: str = _PREFIX,
                 **more_flags) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{prefix}{name} must be a torch.Tensor, got {type(t).__name__}")
    flags = {"is_causal": is_causal, "return_lse": return_lse, "deterministic": deterministic}
    flags.update(more_flags)
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{prefix}{name} must be a bool, got {type(flag).__name__}")


def _check_dtypes(q: Tensor, k: Tensor, v: Tensor, prefix: str = _PREFIX) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{prefix}{name} has unsupported dtype {t.dtype}; "
                f"supported dtypes are {_ACCEPTED_DTYPES}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{prefix}q, k and v must have the same dtype, got q: {_dtype_name(q.dtype)}, "
            f"k: {_dtype_name(k.dtype)}, v: {_dtype_name(v.dtype)}"
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


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, prefix: str = _PREFIX) -> None:
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
    Sk = k.shape[2]
    if Sq > MAX_SEQLEN or Sk > MAX_SEQLEN:
        raise ValueError(
            f"{prefix}sequence lengths must be below 2^31, got seqlen_q {Sq}, seqlen_k {Sk}"
        )


def _check_varlen_shapes(q: Tensor, k: Tensor, v: Tensor, prefix: str = _VARLEN_PREFIX) -> None:
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
    total_k = k.shape[0]
    if total_q > MAX_SEQLEN or total_k > MAX_SEQLEN:
        raise ValueError(
            f"{prefix}the packed row counts must be below 2^31, got total_q {total_q}, "
            f"total_k {total_k}"
        )


def _check_strides(q: Tensor, k: Tensor, v: Tensor, prefix: str = _PREFIX) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{prefix}{name} must have a contiguous last dimension (stride(-1) == 1), got "
                f"strides {tuple(t.stride())}; call .contiguous() or pass a view whose last "
                f"dim is contiguous (any other strides are fine)"
            )


def _is_traced(x) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat)) or torch.compiler.is_compiling()


def _check_scale(scale, head_dim: int, prefix: str = _PREFIX) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(
            f"{prefix}scale must be a finite real number (Python float or int) or None, "
            f"got {type(scale).__name__}"
        )
    # Written as a comparison (not math.isfinite) so that torch.compile can trace it when
    # it treats the scale as a symbolic float; NaN fails both comparisons.
    if not (-math.inf < scale < math.inf):
        raise ValueError(f"{prefix}scale must be a finite real number, got {scale}")
    return scale if _is_traced(scale) else float(scale)


def _is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def _check_window(window_size, is_causal: bool, prefix: str = _PREFIX) -> Tuple[int, int]:
    """Returns (window_left, window_right) as the extension takes them: -1 is unbounded and
    is_causal is window_right = 0."""
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(
            f"{prefix}window_size must be a tuple (left, right) of two ints (-1: unbounded on "
            f"that side), got {type(window_size).__name__}"
        )
    if len(window_size) != 2:
        raise ValueError(
            f"{prefix}window_size must have exactly 2 entries (left, right), got "
            f"{len(window_size)}: {tuple(window_size)!r}"
        )
    sides = []
    for side, w in zip(("left", "right"), window_size):
        if not _is_int(w):
            raise TypeError(
                f"{prefix}window_size {side} must be a Python int (-1 for unbounded, or a "
                f"number of keys >= 0), got {type(w).__name__}"
            )
        if not (-1 <= w <= MAX_SEQLEN):
            raise ValueError(
                f"{prefix}window_size {side} must be -1 (unbounded) or a number of keys in "
                f"[0, 2^31 - 1], got {w}"
            )
        sides.append(w if _is_traced(w) else int(w))
    left, right = sides
    if is_causal:
        if right > 0:
            raise ValueError(
                f"{prefix}is_causal=True means no key after the query's diagonal "
                f"(window_size right = 0), but window_size is ({left}, {right}); pass "
                f"is_causal=False with window_size=({left}, {right}) for a window that reaches "
                f"{right} keys ahead, or a right side of 0 or -1 with is_causal=True"
            )
        right = 0
    return left, right


def _check_softcap(softcap, prefix: str = _PREFIX) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (numbers.Real, torch.SymFloat,
                                                             torch.SymInt)):
        raise TypeError(
            f"{prefix}softcap must be a finite real number >= 0 (0 disables it), got "
            f"{type(softcap).__name__}"
        )
    if not (0 <= softcap < math.inf):  # NaN fails too
        raise ValueError(
            f"{prefix}softcap must be a finite real number >= 0 (0 disables it; the logits "
            f"become softcap * tanh(logits / softcap)), got {softcap}"
        )
    return softcap if _is_traced(softcap) else float(softcap)


def _check_alibi(alibi_slopes, batch: int, heads: int, prefix: str = _PREFIX) -> Optional[Tensor]:
    """Type, dtype and shape of the ALiBi slopes (the device is checked with the others);
    returns them detached (no gradient flows to the slopes) and contiguous."""
    if alibi_slopes is None:
        return None
    accepted = f"float32 slopes of shape ({heads},) or ({batch}, {heads})"
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(
            f"{prefix}alibi_slopes must be None or a torch.Tensor of {accepted}, got "
            f"{type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(
            f"{prefix}alibi_slopes must be a float32 tensor, got {_dtype_name(alibi_slopes.dtype)}"
        )
    shape = tuple(alibi_slopes.shape)
    if shape != (heads,) and shape != (batch, heads):
        raise ValueError(
            f"{prefix}alibi_slopes must have shape ({heads},) (one slope per query head) or "
            f"({batch}, {heads}) (per batch entry and query head), got {shape}"
        )
    return alibi_slopes.detach().contiguous()


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, prefix: str = _VARLEN_PREFIX) -> int:
    """Type, dtype and shape of cu_seqlens_q / cu_seqlens_k; returns the batch size B."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, Tensor):
            raise TypeError(
                f"{prefix}{name} must be a torch.Tensor of int32 sequence start offsets "
                f"(shape (batch + 1,)), got {type(t).__name__}"
            )
        if t.dtype != torch.int32:
            raise TypeError(f"{prefix}{name} must be an int32 tensor, got {_dtype_name(t.dtype)}")
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


def _check_max_seqlen(max_seqlen_q, max_seqlen_k, prefix: str = _VARLEN_PREFIX) -> Tuple[int, int]:
    res = []
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(m):
            raise TypeError(
                f"{prefix}{name} must be a Python int (an upper bound on the sequence "
                f"lengths), got {type(m).__name__}"
            )
        if not (0 <= m <= MAX_SEQLEN):
            raise ValueError(f"{prefix}{name} must be in [0, 2^31 - 1], got {m}")
        res.append(m if _is_traced(m) else int(m))
    return res[0], res[1]


def _check_cu_seqlens_values(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int,
                             total_k: int, max_seqlen_q: int, max_seqlen_k: int,
                             prefix: str = _VARLEN_PREFIX) -> None:
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


def _check_cu_seqlens_enabled(flag: bool) -> bool:
    env = os.environ.get("FLASH_CUDA_CHECK_CU_SEQLENS", "").strip().lower()
    return bool(flag) or env not in ("", "0", "false", "no", "off")


def _check_kernel(kernel, dtype: torch.dtype, features: Sequence[str] = (),
                  prefix: str = _PREFIX) -> int:
    """The tier id for ``kernel``; ``features`` names the options in use that the Hopper
    (wgmma) tier does not support yet (softcap with deterministic=True: its backward)."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(
            f"{prefix}kernel must be one of 'auto', 'simt', 'mma', 'wgmma', got {kernel!r}"
        )
    if kernel == "simt" and dtype != torch.float32:
        raise ValueError(
            f"{prefix}kernel='simt' is the float32 kernel, but the inputs are "
            f"{_dtype_name(dtype)}; use kernel='mma' or 'auto' for float16/bfloat16"
        )
    if kernel in ("mma", "wgmma") and dtype == torch.float32:
        raise ValueError(
            f"{prefix}kernel={kernel!r} is a float16/bfloat16 tensor-core kernel, but the "
            f"inputs are float32; use kernel='simt' or 'auto' for float32"
        )
    if kernel == "wgmma" and features:
        raise ValueError(
            f"{prefix}kernel='wgmma' (the Hopper tier) does not support {', '.join(features)} "
            f"yet; use kernel='mma' or 'auto' (which picks a tier that does)"
        )
    return KERNELS[kernel]


_capability_cache: dict = {}


def _device_capability(device: torch.device) -> Tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability_cache.get(index)
    if cap is None:
        cap = tuple(torch.cuda.get_device_capability(index))
        _capability_cache[index] = cap
    return cap


def _check_capability(device: torch.device, prefix: str = _PREFIX) -> None:
    major, minor = _device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise RuntimeError(
            f"{prefix}flash_cuda needs an NVIDIA GPU of compute capability 8.0 or newer "
            f"(Ampere, Ada, Hopper); {device} has compute capability {major}.{minor}"
        )


def _check_aux_devices(q: Tensor, prefix: str = _PREFIX, **tensors) -> None:
    """The side tensors (ALiBi slopes, cu_seqlens) must be on q's device."""
    for name, t in tensors.items():
        if t is not None and t.device != q.device:
            raise RuntimeError(
                f"{prefix}{name} must be on the same device as q ({q.device}), got {t.device}"
            )


def _check_device(q: Tensor, k: Tensor, v: Tensor, prefix: str = _PREFIX) -> None:
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
        _check_capability(q.device, prefix)


def _check_dropout(dropout_p, kernel, prefix: str = _PREFIX) -> float:
    """dropout_p as a float in [0, 1]; with dropout, float16 / bfloat16 calls run the mma.sync
    kernels and float32 ones the simt kernels (kernel='wgmma' has no dropout)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{prefix}dropout_p must be a number in [0, 1], got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if dropout_p and kernel == "wgmma":
        raise ValueError(f"{prefix}dropout_p > 0 runs on kernel='auto', 'mma' (float16 / bfloat16) or 'simt' "
                         f"(float32), got kernel='wgmma'")
    return dropout_p


class _Options(NamedTuple):
    """Validated options, in the form the custom ops take them."""
    scale: float
    window_left: int
    window_right: int
    softcap: float
    alibi_slopes: Optional[Tensor]
    tier: int


def _check_score_options(head_dim: int, scale, is_causal: bool, window_size, softcap,
                         prefix: str) -> Tuple[float, int, int, float]:
    """(scale, window_left, window_right, softcap) as the extension takes them. The defaults
    take the short way: a small call (a decode step) pays for every microsecond."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else _check_scale(scale, head_dim, prefix)
    if type(window_size) is tuple and window_size == (-1, -1):
        left, right = -1, 0 if is_causal else -1
    else:
        left, right = _check_window(window_size, is_causal, prefix)
    if softcap != 0.0 or type(softcap) is not float:
        softcap = _check_softcap(softcap, prefix)
    return scale, left, right, softcap


def _validate_options(q: Tensor, *, batch: int, scale, is_causal: bool, window_size, softcap,
                      alibi_slopes, kernel, varlen: bool, prefix: str,
                      deterministic: bool = False) -> _Options:
    """The checks shared by attention and varlen_attention once the tensors' types, dtypes,
    shapes and strides are known good: scale, window, softcap, ALiBi slopes, kernel."""
    scale, left, right, softcap = _check_score_options(q.shape[-1], scale, is_causal, window_size, softcap,
                                                       prefix)
    if alibi_slopes is not None:
        heads = q.shape[-2] if varlen else q.shape[1]
        alibi_slopes = _check_alibi(alibi_slopes, batch, heads, prefix)
    if kernel == "auto" and type(kernel) is str:
        return _Options(scale, left, right, softcap, alibi_slopes, 0)
    # The Hopper tier runs windows, softcap, ALiBi and packed batches; softcap's backward only
    # on its warp-specialized kernel, which adds dQ in a varying order: not deterministic=True
    # (kernel='auto' then takes the mma.sync backward).
    features = ["softcap with deterministic=True"] if softcap > 0 and deterministic else []
    tier = _check_kernel(kernel, q.dtype, features, prefix)
    return _Options(scale, left, right, softcap, alibi_slopes, tier)


def _validate(q, k, v, *, scale=None, is_causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, return_lse=False, deterministic=False,
              kernel="auto") -> _Options:
    """Validates the arguments of :func:`attention`.

    Order: types, dtypes, shapes, strides, scale, window, softcap, ALiBi slopes, kernel,
    devices, GPU capability. The extension's presence is checked by the caller afterwards.
    """
    _check_types(q, k, v, is_causal, return_lse, deterministic)
    _check_dtypes(q, k, v)
    _check_shapes(q, k, v)
    _check_strides(q, k, v)
    opts = _validate_options(q, batch=q.shape[0], scale=scale, is_causal=is_causal,
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                             kernel=kernel, varlen=False, prefix=_PREFIX,
                             deterministic=deterministic)
    _check_aux_devices(q, alibi_slopes=opts.alibi_slopes)
    _check_device(q, k, v)
    return opts


def _validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     scale=None, is_causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, return_lse=False, deterministic=False, kernel="auto",
                     check_cu_seqlens=False) -> Tuple[_Options, int, int]:
    """Validates the arguments of :func:`varlen_attention`; returns (options, max_seqlen_q,
    max_seqlen_k). Same order as :func:`_validate`, with cu_seqlens and max_seqlen after the
    strides. The values inside cu_seqlens are checked by the op (check_cu_seqlens)."""
    prefix = _VARLEN_PREFIX
    _check_types(q, k, v, is_causal, return_lse, deterministic, prefix,
                 check_cu_seqlens=check_cu_seqlens)
    _check_dtypes(q, k, v, prefix)
    _check_varlen_shapes(q, k, v, prefix)
    _check_strides(q, k, v, prefix)
    B = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, prefix)
    max_q, max_k = _check_max_seqlen(max_seqlen_q, max_seqlen_k, prefix)
    opts = _validate_options(q, batch=B, scale=scale, is_causal=is_causal,
                             window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                             kernel=kernel, varlen=True, prefix=prefix,
                             deterministic=deterministic)
    _check_aux_devices(q, prefix, alibi_slopes=opts.alibi_slopes, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k)
    _check_device(q, k, v, prefix)
    return opts, max_q, max_k


# ---------------------------------------------------------------------------------------
# Custom ops
#
# Four ops around the extension's two entry points: flash_cuda::fwd / ::bwd (dense 4-D
# inputs) and flash_cuda::varlen_fwd / ::varlen_bwd (packed 3-D inputs with cu_seqlens).
# The forward ops return (out, lse, aux): aux is the extension's opaque per-row softmax
# statistics (float32 lse.shape + (2,) for float32 inputs, empty (0,) otherwise), saved
# for the backward with out and lse and handed back to it unchanged.
# ---------------------------------------------------------------------------------------


def _aux_shape(dtype: torch.dtype, lse_shape) -> Tuple[int, ...]:
    return tuple(lse_shape) + (2,) if dtype == torch.float32 else (0,)


def _fwd_fake_outputs(q: Tensor, lse_shape) -> Tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32),
            q.new_empty(_aux_shape(q.dtype, lse_shape), dtype=torch.float32))


def _empty_fwd(q: Tensor, lse_shape) -> Tuple[Tensor, Tensor, Tensor]:
    """Every row sees no key (or there are no rows): out 0, lse -inf; nothing launched."""
    return (torch.zeros_like(q),
            torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device),
            torch.zeros(_aux_shape(q.dtype, lse_shape), dtype=torch.float32, device=q.device))


def _dense_lse_shape(q: Tensor) -> Tuple[int, int, int]:
    return (q.shape[0], q.shape[1], q.shape[2])


def _varlen_lse_shape(q: Tensor) -> Tuple[int, int]:
    return (q.shape[1], q.shape[0])


def _is_empty(q: Tensor, k: Tensor) -> bool:
    return q.shape[0] == 0 or q.shape[2] == 0 or k.shape[2] == 0


def _is_empty_varlen(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int) -> bool:
    # max_seqlen 0: every sequence is empty (the kernels would get an empty grid).
    return (q.shape[0] == 0 or k.shape[0] == 0 or cu_seqlens_q.shape[0] <= 1
            or max_seqlen_q == 0 or max_seqlen_k == 0)


# The extension calls behind the ops, shared by the ops and the eager path (below).
def _fwd_impl(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, tier):
    if _is_empty(q, k):
        return _empty_fwd(q, _dense_lse_shape(q))
    return _ext.require().fwd(q, k, v, float(scale), int(window_left), int(window_right), float(softcap),
                              alibi_slopes, None, None, 0, 0, int(tier))


def _fwd_impl_inference(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
    return _fwd_impl(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, tier)


# need_dq / need_dkdv: which gradients to compute (dK and dV come from the same products, so
# they go together); one not computed is None, and the extension neither allocates nor works on it.
def _empty_grads(q, k, v, need_dq, need_dkdv):
    """The gradients of a call with no query row or no key: zeros, None where not wanted."""
    return (torch.zeros_like(q) if need_dq else None, torch.zeros_like(k) if need_dkdv else None,
            torch.zeros_like(v) if need_dkdv else None)


def _dropout_kwargs(dropout_p, rng_state) -> dict:
    """The extension's dropout keywords for a backward: none without dropout."""
    return {"dropout_p": float(dropout_p), "rng_state": rng_state} if dropout_p else {}


def _new_rng_state(q: Tensor) -> Tensor:
    """Where a forward with dropout records the (seed, offset) of its draws for the backward."""
    return torch.zeros(2, dtype=torch.int64, device=q.device)


def _bwd_impl(dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap, alibi_slopes,
              deterministic, tier, need_dq=True, need_dkdv=True, dropout_p=0.0, rng_state=None):
    if _is_empty(q, k):
        return _empty_grads(q, k, v, need_dq, need_dkdv)
    return _ext.require().bwd(dout, q, k, v, out, lse, aux, dlse, float(scale), int(window_left),
                              int(window_right), float(softcap), alibi_slopes, None, None, 0, 0,
                              bool(deterministic), int(tier), bool(need_dq), bool(need_dkdv),
                              **_dropout_kwargs(dropout_p, rng_state))


def _fwd_dropout_impl(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, tier, dropout_p):
    """The forward with dropout: (out, lse, aux, rng_state), rng_state the (seed, offset) of the
    draws (int64 [2]) for the backward."""
    rng_state = _new_rng_state(q)
    if _is_empty(q, k):
        return (*_empty_fwd(q, _dense_lse_shape(q)), rng_state)
    out, lse, aux = _ext.require().fwd(q, k, v, float(scale), int(window_left), int(window_right), float(softcap),
                                       alibi_slopes, None, None, 0, 0, int(tier), dropout_p=float(dropout_p),
                                       rng_state=rng_state)
    return out, lse, aux, rng_state


def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                     window_right, softcap, alibi_slopes, tier, check_cu_seqlens):
    if _check_cu_seqlens_enabled(check_cu_seqlens):
        _check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                 max_seqlen_q, max_seqlen_k)
    if _is_empty_varlen(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        return _empty_fwd(q, _varlen_lse_shape(q))
    return _ext.require().fwd(q, k, v, float(scale), int(window_left), int(window_right), float(softcap),
                              alibi_slopes, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                              int(tier))


def _varlen_fwd_dropout_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                             window_right, softcap, alibi_slopes, tier, check_cu_seqlens, dropout_p):
    """The packed forward with dropout: (out, lse, aux, rng_state)."""
    rng_state = _new_rng_state(q)
    if _check_cu_seqlens_enabled(check_cu_seqlens):
        _check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                 max_seqlen_q, max_seqlen_k)
    if _is_empty_varlen(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        return (*_empty_fwd(q, _varlen_lse_shape(q)), rng_state)
    out, lse, aux = _ext.require().fwd(q, k, v, float(scale), int(window_left), int(window_right), float(softcap),
                                       alibi_slopes, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                       int(max_seqlen_k), int(tier), dropout_p=float(dropout_p),
                                       rng_state=rng_state)
    return out, lse, aux, rng_state


def _varlen_bwd_impl(dout, q, k, v, out, lse, aux, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier,
                     need_dq=True, need_dkdv=True, dropout_p=0.0, rng_state=None):
    if _is_empty_varlen(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        return _empty_grads(q, k, v, need_dq, need_dkdv)
    return _ext.require().bwd(dout, q, k, v, out, lse, aux, dlse, float(scale), int(window_left),
                              int(window_right), float(softcap), alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                              int(max_seqlen_q), int(max_seqlen_k), bool(deterministic), int(tier),
                              bool(need_dq), bool(need_dkdv), **_dropout_kwargs(dropout_p, rng_state))


@torch.library.custom_op("flash_cuda::fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, window_left: int, window_right: int,
         softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
         tier: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward: returns (out, lse, aux). ``deterministic`` is only read by the backward."""
    out, lse, aux = _fwd_impl(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, tier)
    return out, lse, aux


@_fwd.register_fake
def _fwd_fake(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic,
              tier):
    return _fwd_fake_outputs(q, _dense_lse_shape(q))


def _op_grads(q, k, v, grads, need_dq, need_dkdv):
    """A custom op returns tensors, never None: a gradient not wanted comes back as an empty
    (0,) tensor (also where the extension computed it anyway), which the autograd formula
    turns into None."""
    dq, dk, dv = grads
    return (dq if need_dq else q.new_empty(0), dk if need_dkdv else k.new_empty(0),
            dv if need_dkdv else v.new_empty(0))


def _bwd_fake_outputs(q, k, v, need_dq, need_dkdv):
    return _op_grads(q, k, v, (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)),
                     need_dq, need_dkdv)


@torch.library.custom_op("flash_cuda::bwd", mutates_args=())
def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Tensor,
         dlse: Optional[Tensor], scale: float, window_left: int, window_right: int,
         softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
         tier: int, need_dq: bool = True, need_dkdv: bool = True, dropout_p: float = 0.0,
         rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward: returns (dq, dk, dv); ``dlse`` is the optional upstream gradient of lse.
    ``need_dq`` / ``need_dkdv`` say which gradients to compute; the others are empty (0,).
    With dropout, ``rng_state`` is the forward's record of its draws."""
    grads = _bwd_impl(dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap,
                      alibi_slopes, deterministic, tier, need_dq, need_dkdv, dropout_p, rng_state)
    return _op_grads(q, k, v, grads, need_dq, need_dkdv)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap,
              alibi_slopes, deterministic, tier, need_dq=True, need_dkdv=True, dropout_p=0.0, rng_state=None):
    return _bwd_fake_outputs(q, k, v, need_dq, need_dkdv)


@torch.library.custom_op("flash_cuda::fwd_dropout", mutates_args=())
def _fwd_dropout(q: Tensor, k: Tensor, v: Tensor, scale: float, window_left: int, window_right: int,
                 softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool, tier: int,
                 dropout_p: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward with attention dropout: (out, lse, aux, rng_state)."""
    return _fwd_dropout_impl(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, tier, dropout_p)


@_fwd_dropout.register_fake
def _fwd_dropout_fake(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier,
                      dropout_p):
    return (*_fwd_fake_outputs(q, _dense_lse_shape(q)), q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op("flash_cuda::varlen_fwd", mutates_args=())
def _varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                max_seqlen_q: int, max_seqlen_k: int, scale: float, window_left: int,
                window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                deterministic: bool, tier: int,
                check_cu_seqlens: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """Packed forward: returns (out (total_q, Hq, D), lse (Hq, total_q), aux).

    With ``check_cu_seqlens`` (or FLASH_CUDA_CHECK_CU_SEQLENS=1) the values of cu_seqlens
    are checked here, at run time (also inside a compiled graph), before any launch."""
    out, lse, aux = _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                     window_left, window_right, softcap, alibi_slopes, tier, check_cu_seqlens)
    return out, lse, aux


@_varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                     window_left, window_right, softcap, alibi_slopes, deterministic, tier,
                     check_cu_seqlens):
    return _fwd_fake_outputs(q, _varlen_lse_shape(q))


@torch.library.custom_op("flash_cuda::varlen_bwd", mutates_args=())
def _varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                aux: Tensor, dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                max_seqlen_q: int, max_seqlen_k: int, scale: float, window_left: int,
                window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                deterministic: bool, tier: int, need_dq: bool = True,
                need_dkdv: bool = True, dropout_p: float = 0.0,
                rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Packed backward: returns (dq, dk, dv) shaped like (q, k, v), empty (0,) where not
    wanted (``need_dq`` / ``need_dkdv``)."""
    grads = _varlen_bwd_impl(dout, q, k, v, out, lse, aux, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, scale, window_left, window_right, softcap, alibi_slopes,
                             deterministic, tier, need_dq, need_dkdv, dropout_p, rng_state)
    return _op_grads(q, k, v, grads, need_dq, need_dkdv)


@_varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, aux, dlse, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, scale, window_left, window_right, softcap,
                     alibi_slopes, deterministic, tier, need_dq=True, need_dkdv=True, dropout_p=0.0,
                     rng_state=None):
    return _bwd_fake_outputs(q, k, v, need_dq, need_dkdv)


@torch.library.custom_op("flash_cuda::varlen_fwd_dropout", mutates_args=())
def _varlen_fwd_dropout(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, scale: float, window_left: int,
                        window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                        deterministic: bool, tier: int, check_cu_seqlens: bool,
                        dropout_p: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Packed forward with attention dropout: (out, lse, aux, rng_state)."""
    return _varlen_fwd_dropout_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                    window_left, window_right, softcap, alibi_slopes, tier, check_cu_seqlens,
                                    dropout_p)


@_varlen_fwd_dropout.register_fake
def _varlen_fwd_dropout_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                             window_left, window_right, softcap, alibi_slopes, deterministic, tier,
                             check_cu_seqlens, dropout_p):
    return (*_fwd_fake_outputs(q, _varlen_lse_shape(q)), q.new_empty((2,), dtype=torch.int64))


# ---- autograd: one backward for both layouts ----


def _save_common(ctx, q, k, v, output, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale,
                 window_left, window_right, softcap, deterministic, tier, dropout_p=0.0) -> None:
    out, lse, aux = output[:3]
    rng_state = output[3] if dropout_p else None
    ctx.save_for_backward(q, k, v, out, lse, aux, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state)
    ctx.dropout_p = dropout_p
    if rng_state is not None:
        ctx.mark_non_differentiable(rng_state)
    ctx.scale = scale
    ctx.window = (window_left, window_right)
    ctx.softcap = softcap
    ctx.deterministic = deterministic
    ctx.tier = tier
    ctx.mark_non_differentiable(aux)
    # Unused outputs then arrive as None instead of a zero tensor: no dlse is passed
    # (and nothing is allocated for it) when only `out` is differentiated.
    ctx.set_materialize_grads(False)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier = inputs
    _save_common(ctx, q, k, v, output, alibi_slopes, None, None, scale, window_left,
                 window_right, softcap, deterministic, tier)
    ctx.varlen = None
    ctx.unused = len(inputs) - 3


def _dropout_setup_context(ctx, inputs, output):
    q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier, dropout_p = inputs
    _save_common(ctx, q, k, v, output, alibi_slopes, None, None, scale, window_left,
                 window_right, softcap, deterministic, tier, dropout_p)
    ctx.varlen = None
    ctx.unused = len(inputs) - 3


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
     window_right, softcap, alibi_slopes, deterministic, tier, check_cu_seqlens) = inputs[:15]
    dropout_p = inputs[15] if len(inputs) > 15 else 0.0
    _save_common(ctx, q, k, v, output, alibi_slopes, cu_seqlens_q, cu_seqlens_k, scale,
                 window_left, window_right, softcap, deterministic, tier, dropout_p)
    ctx.varlen = (max_seqlen_q, max_seqlen_k)
    ctx.unused = len(inputs) - 3


def _backward(ctx, dout, dlse, daux, *drng, eager: bool = False):
    # Only the gradients autograd asks for are computed (and allocated): dK and dV together,
    # as they come from the same products.
    need_q, need_k, need_v = ctx.needs_input_grad[:3]
    need_dkdv = need_k or need_v
    unused = (None,) * ctx.unused  # the other inputs: no gradient
    if not (need_q or need_dkdv):
        return (None, None, None) + unused
    q, k, v, out, lse, aux, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    options = (ctx.scale, *ctx.window, ctx.softcap, alibi_slopes, ctx.deterministic, ctx.tier, need_q,
               need_dkdv)
    if ctx.varlen is None:
        dq, dk, dv = (_bwd_impl if eager else _bwd)(dout, q, k, v, out, lse, aux, dlse, *options, ctx.dropout_p,
                                                    rng_state)
    else:
        dq, dk, dv = (_varlen_bwd_impl if eager else _varlen_bwd)(dout, q, k, v, out, lse, aux, dlse,
                                                                 cu_seqlens_q, cu_seqlens_k, *ctx.varlen,
                                                                 *options, ctx.dropout_p, rng_state)
    return (dq if need_q else None, dk if need_k else None, dv if need_v else None) + unused


_fwd.register_autograd(_backward, setup_context=_setup_context)
_fwd_dropout.register_autograd(_backward, setup_context=_dropout_setup_context)
_varlen_fwd.register_autograd(_backward, setup_context=_varlen_setup_context)
_varlen_fwd_dropout.register_autograd(_backward, setup_context=_varlen_setup_context)


# ---- the eager path ----
# Outside torch.compile the ops' dispatch (custom-op wrappers, default filling, the generated
# autograd node) costs several times what the extension call itself does: on an H100 host a
# small call's forward + backward spent ~0.7 ms more than SDPA's (OPTIMIZATION.md), so a
# short sequence's step was bound by the host, not the GPU. Plain eager tensors therefore go
# through this autograd.Function, which makes the same extension calls, saves the same
# tensors and runs the same backward; anything the ops exist for (tracing, fake or
# functional tensors, tensor subclasses, dispatch or function modes) takes the ops. Its
# forward / setup_context split lets torch.func's gradient transforms run it too.
def _eager_ok(*tensors) -> bool:
    if torch.compiler.is_compiling() or torch._C._is_torch_function_mode_enabled():
        return False
    if torch._C._len_torch_dispatch_stack() > 0:
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


class _EagerFunction(torch.autograd.Function):
    """Function.apply binds its arguments through inspect.signature on every call once
    setup_context is defined: about 40 us of host time per call, more than the rest of this
    layer. The callers pass every argument positionally, so outside torch.func transforms
    `run` calls the C++ apply directly (it runs forward, then setup_context, the same way)."""

    @classmethod
    def run(cls, *args):
        if torch._C._are_functorch_transforms_active():
            return cls.apply(*args)
        return super(torch.autograd.Function, cls).apply(*args)


class _EagerFwd(_EagerFunction):
    @staticmethod
    def forward(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier):
        return _fwd_impl(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, tier)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, dout, dlse, daux):
        return _backward(ctx, dout, dlse, daux, eager=True)


class _EagerFwdDropout(_EagerFunction):
    @staticmethod
    def forward(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier, dropout_p):
        return _fwd_dropout_impl(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, tier, dropout_p)

    setup_context = staticmethod(_dropout_setup_context)

    @staticmethod
    def backward(ctx, dout, dlse, daux, drng):
        return _backward(ctx, dout, dlse, daux, drng, eager=True)


class _EagerVarlenFwd(_EagerFunction):
    @staticmethod
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                window_right, softcap, alibi_slopes, deterministic, tier, check_cu_seqlens):
        return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                window_left, window_right, softcap, alibi_slopes, tier, check_cu_seqlens)

    setup_context = staticmethod(_varlen_setup_context)

    @staticmethod
    def backward(ctx, dout, dlse, daux):
        return _backward(ctx, dout, dlse, daux, eager=True)


class _EagerVarlenFwdDropout(_EagerFunction):
    @staticmethod
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                window_right, softcap, alibi_slopes, deterministic, tier, check_cu_seqlens, dropout_p):
        return _varlen_fwd_dropout_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                        window_left, window_right, softcap, alibi_slopes, tier, check_cu_seqlens,
                                        dropout_p)

    setup_context = staticmethod(_varlen_setup_context)

    @staticmethod
    def backward(ctx, dout, dlse, daux, drng):
        return _backward(ctx, dout, dlse, daux, drng, eager=True)


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def _autocast(q, k, v):
    """Inside ``torch.autocast("cuda", dtype)`` attention runs in the autocast dtype, as SDPA
    does: floating CUDA inputs of another dtype are cast to it (differentiably; gradients come
    back in the inputs' dtypes). Anything else is left for validation to judge."""
    if not torch.is_autocast_enabled("cuda"):
        return q, k, v
    dtype = torch.get_autocast_dtype("cuda")

    def cast(t):
        if isinstance(t, Tensor) and t.is_cuda and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t

    return cast(q), cast(k), cast(v)

_FEATURES_DOC = r"""
        is_causal: causal masking, aligned to the bottom-right corner of the score matrix
            as in FlashAttention: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k -
            seqlen_q`` (for ``seqlen_q == seqlen_k`` this is the usual lower triangle; with
            more queries than keys, the first ``seqlen_q - seqlen_k`` query rows see no key:
            their output is 0 and their lse is ``-inf``, never NaN). The same as
            ``window_size=(-1, 0)``; combined with a window it sets the window's right side
            to 0 (a right side > 0 with ``is_causal=True`` is an error).
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(head_dim)``. Any finite real.
        window_size: ``(left, right)``, sliding-window (local) attention, bottom-right
            aligned: query ``i`` sees key ``j`` iff ``i + seqlen_k - seqlen_q - left <= j
            <= i + seqlen_k - seqlen_q + right`` (and ``0 <= j < seqlen_k``). ``-1`` leaves
            that side unbounded; ``(-1, -1)`` (default) is full attention, ``(-1, 0)``
            causal, ``(w, 0)`` causal limited to the last ``w + 1`` keys. Python ints >= -1.
            A row whose window holds no key gets output 0 and lse ``-inf``.
        softcap: ``> 0`` soft-caps the logits, ``x = softcap * tanh(x / softcap)`` with
            ``x = scale * q . k`` (Gemma-2 / Grok style); ``0`` (default) disables it. Must
            be a finite real >= 0.
        alibi_slopes: ``None`` or a float32 tensor on q's device of shape ``(heads,)`` or
            ``(batch, heads)``: ALiBi, the logit of query ``i`` and key ``j`` becomes
            ``x - slope * |i + seqlen_k - seqlen_q - j|`` (after the softcap, before the
            mask). The slopes get no gradient.
        return_lse: also return ``lse``, float32, the natural log of ``sum_j exp(x_ij)``
            over the visible keys of the final logits ``x`` (``-inf`` for a row that sees
            none). ``lse`` is differentiable too: a loss that uses it sends its gradient
            (``dlse``) through the backward kernels.
        deterministic: ``True`` makes every backward bitwise reproducible run to run.
            By default two backwards add dQ across key blocks in an unordered way (so dq
            can differ in its last bits between runs; dk, dv do not): the float32 one (float
            atomics) and, on sm_90, the float16 / bfloat16 one at head dims 33..256, dense
            and packed (:func:`varlen_attention`) batches alike, and below 33 for dense
            batches without softcap / ALiBi (one warp-specialized kernel
            adding
            dQ into an fp32 workspace of about B * Hq * Sq * D * 4 bytes, D rounded up to 64;
            packed: Hq * (total_q + (B + 1) * M) * D * 4 bytes, M = 128 at D <= 64, else 64).
            ``True`` runs a separate dQ kernel instead (with ``softcap > 0`` the mma.sync
            backward), at a cost in speed measured in OPTIMIZATION.md; the other 16-bit
            backwards are reproducible either way.
        kernel: ``"auto"`` (default) picks by dtype, GPU and options: ``"simt"`` (float32
            CUDA-core kernels, true fp32 arithmetic) for float32; for float16 / bfloat16
            on sm_90 the Hopper kernels: a warp-specialized forward (TMA, persistent) at head
            dims 33..256 (dense and packed batches, softcap, ALiBi),
            ``"wgmma"`` (warpgroup MMA) for the other forwards and the backward at 33..128
            (softcap's backward only with ``deterministic=False``; head dims 65..96 run the
            128-wide kernels), a warp-specialized backward at 129..256 with
            ``deterministic=False``, and at head dims up to 32 the 64-wide kernels for dense
            batches without softcap, ALiBi or dropout (the backward with
            ``deterministic=False``); else ``"mma"`` (mma.sync tensor-core
            kernels, sm_80 and newer, every head dim and option). Both tensor-core tiers accumulate in fp32. Asking for ``"simt"`` with
            16-bit inputs, ``"mma"`` / ``"wgmma"`` with float32 inputs, or ``"wgmma"`` where
            it does not apply is an error."""


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    kernel: str = "auto",
    dropout_p: float = 0.0,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact softmax attention on NVIDIA GPUs, a drop-in for ``scaled_dot_product_attention``.

    Computes ``out = softmax(x) @ v`` in blocks, without materialising the (seqlen_q x
    seqlen_k) logit matrix (memory is O(seqlen)), where the logits are, in this order:
    ``x = scale * q @ k^T``; ``x = softcap * tanh(x / softcap)`` if ``softcap > 0``;
    ``x -= slope * |i + seqlen_k - seqlen_q - j|`` with ALiBi slopes; then the causal /
    sliding-window mask. Key blocks that no query of a block can see are skipped, so a
    window of ``w`` keys costs O(seqlen * w).

    Args:
        q: ``(batch, heads, seqlen_q, head_dim)``.
        k, v: ``(batch, kv_heads, seqlen_k, head_dim)``, both the same shape. ``heads`` must
            be a multiple of ``kv_heads`` (grouped-query / multi-query attention): query
            head ``h`` attends to key/value head ``h // (heads // kv_heads)``; k and v are
            never repeated in memory.

            Any strides are accepted as long as the last dimension is contiguous
            (``stride(-1) == 1``), e.g. ``x.view(B, S, H, D).transpose(1, 2)`` or slices of
            a fused QKV projection. q, k, v must be CUDA tensors on one device with the
            same dtype: ``torch.float16``, ``torch.bfloat16`` or ``torch.float32``.
            ``head_dim`` must be a multiple of 8 in [8, 256]. Sequence lengths may differ
            (``seqlen_q != seqlen_k``) and may be any size >= 0; batch and heads are
            limited to 65535.{features}
        dropout_p: attention dropout, as SDPA's ``dropout_p``: each probability is dropped
            with probability ``dropout_p`` and the kept ones scaled by the inverse of the keep
            rate (exactly unbiased: the keep rate is a multiple of 2^-16). Applied whenever
            it is > 0 (pass 0.0 in evaluation). The random numbers come from the current
            device's CUDA generator (``torch.manual_seed`` reproduces them) and the backward
            regenerates the same mask. ``kernel`` ``"auto"``, ``"mma"`` or ``"simt"``: with
            dropout a float16 / bfloat16 call runs the mma.sync kernels, except on Hopper for
            dense batches without softcap / ALiBi (the warp-specialized dropout kernels: the
            forward and the backward at head dims 33..128, the backward with
            deterministic=False).

    Returns:
        ``out`` with q's shape and dtype (laid out like ``torch.empty_like(q)``: q's strides
        when q is dense, else a dense layout in q's dimension order), or ``(out, lse)`` when
        ``return_lse`` is true, lse float32 ``(batch, heads, seqlen_q)``.

    Gradients flow to q, k and v (autograd); dk / dv are summed over the query heads of a
    group for GQA. The op is a ``torch.library`` custom op (``torch.ops.flash_cuda.fwd`` /
    ``.bwd``) and works under ``torch.compile(fullgraph=True)``; eager calls on plain tensors
    run the same kernels without the op's dispatch.

    Raises:
        TypeError: an argument is not a tensor / bool / int, or a dtype is unsupported or
            mixed (also the ALiBi slopes' dtype).
        ValueError: a shape, stride, head dim, scale, window, softcap, ALiBi shape or kernel
            name is not accepted.
        RuntimeError: the inputs (and ALiBi slopes) are not on one CUDA device, the GPU is
            older than compute capability 8.0, or the compiled extension is not built.
    """
    q, k, v = _autocast(q, k, v)
    opts = _validate(q, k, v, scale=scale, is_causal=is_causal, window_size=window_size,
                     softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse,
                     deterministic=deterministic, kernel=kernel)
    dropout_p = _check_dropout(dropout_p, kernel)
    if not _ext.is_available():
        raise RuntimeError(_ext.unavailable_message())
    if dropout_p:
        fwd = _EagerFwdDropout.run if _eager_ok(q, k, v, opts.alibi_slopes) else _fwd_dropout
        out, lse = fwd(q, k, v, opts.scale, opts.window_left, opts.window_right, opts.softcap, opts.alibi_slopes,
                       deterministic, opts.tier, dropout_p)[:2]
        return (out, lse) if return_lse else out
    if _eager_ok(q, k, v, opts.alibi_slopes):
        # Inference (no gradient wanted, e.g. a decode step under torch.no_grad()): the extension
        # call alone, without the autograd Function's bookkeeping.
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        fwd = _EagerFwd.run if needs_grad else _fwd_impl_inference
    else:
        fwd = _fwd
    out, lse, _ = fwd(q, k, v, opts.scale, opts.window_left, opts.window_right, opts.softcap,
                      opts.alibi_slopes, deterministic, opts.tier)
    if return_lse:
        return out, lse
    return out


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    kernel: str = "auto",
    check_cu_seqlens: bool = False,
    dropout_p: float = 0.0,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Attention over a packed batch of sequences of different lengths (no padding).

    Sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v, and is attended exactly as
    :func:`attention` would attend that one sequence alone (its own bottom-right alignment
    for ``is_causal`` / ``window_size`` / ALiBi with its own lengths ``seqlen_q[b]``,
    ``seqlen_k[b]``); sequences never see each other. Empty sequences are allowed (a query
    sequence with no keys gives output 0 and lse ``-inf``).

    Args:
        q: ``(total_q, heads, head_dim)``, the query sequences packed along dim 0.
        k, v: ``(total_k, kv_heads, head_dim)``, both the same shape; GQA as in
            :func:`attention`. Any strides with ``stride(-1) == 1`` (e.g. slices of a packed
            ``(total, 3, heads, head_dim)`` QKV tensor); dtypes, head dims and devices as
            in :func:`attention`.
        cu_seqlens_q, cu_seqlens_k: int32 tensors of shape ``(batch + 1,)`` on q's device:
            0, then the running sums of the query / key lengths (``torch.cumsum`` with a 0
            in front). Both the same length.
        max_seqlen_q, max_seqlen_k: Python ints >= 0, upper bounds on the query / key
            lengths of the batch (the kernels size their grids by them; a larger bound only
            costs idle blocks).
        check_cu_seqlens: also check the values of cu_seqlens before the launch (they start
            at 0, never decrease, end at ``total_q`` / ``total_k``, and no length exceeds
            ``max_seqlen``); it reads them back to the host, a device sync. Also switched on
            by the environment variable ``FLASH_CUDA_CHECK_CU_SEQLENS=1``.

            Off (the default), the values are trusted: only cu_seqlens' dtype, shape and
            device and the max_seqlen arguments are checked. The kernels clamp every
            sequence to the rows of the tensors, so wrong values never make them read or
            write out of bounds, but they give wrong results.{features}
        dropout_p: as :func:`attention`; sequence ``b`` draws its random numbers as entry
            ``b`` of a dense batch would, with its own positions.

    Returns:
        ``out`` ``(total_q, heads, head_dim)`` in q's dtype (laid out like
        ``torch.empty_like(q)``), or ``(out, lse)`` when ``return_lse`` is true, lse float32
        ``(heads, total_q)``.

    Gradients flow to q, k and v. The ops are ``torch.ops.flash_cuda.varlen_fwd`` /
    ``.varlen_bwd`` and work under ``torch.compile(fullgraph=True)``.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`attention`; besides, cu_seqlens not an
            int32 tensor (TypeError), not 1-D or of different lengths (ValueError), or not
            on q's device (RuntimeError); max_seqlen not an int (TypeError) or negative
            (ValueError); with check_cu_seqlens, bad values (ValueError).
    """
    q, k, v = _autocast(q, k, v)
    opts, max_q, max_k = _validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
        is_causal=is_causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        return_lse=return_lse, deterministic=deterministic, kernel=kernel,
        check_cu_seqlens=check_cu_seqlens)
    dropout_p = _check_dropout(dropout_p, kernel, _VARLEN_PREFIX)
    if not _ext.is_available():
        raise RuntimeError(_ext.unavailable_message())
    eager = _eager_ok(q, k, v, cu_seqlens_q, cu_seqlens_k, opts.alibi_slopes)
    args = (q, k, v, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_q, max_k, opts.scale,
            opts.window_left, opts.window_right, opts.softcap, opts.alibi_slopes, deterministic, opts.tier,
            check_cu_seqlens)
    if dropout_p:
        out, lse = (_EagerVarlenFwdDropout.run if eager else _varlen_fwd_dropout)(*args, dropout_p)[:2]
    else:
        out, lse, _ = (_EagerVarlenFwd.run if eager else _varlen_fwd)(*args)
    if return_lse:
        return out, lse
    return out


attention.__doc__ = attention.__doc__.replace("{features}", _FEATURES_DOC)
varlen_attention.__doc__ = varlen_attention.__doc__.replace("{features}", _FEATURES_DOC)
