"""Input validation for flash_cuda's entry points: every check, with the message it raises.

Each check is a separate function so that every error can be exercised on a machine without a
GPU (CPU or meta tensors, or a patched capability lookup). :func:`validate` and
:func:`validate_varlen` run them in order for :func:`flash_cuda.attention` and
:func:`flash_cuda.varlen_attention`; :mod:`flash_cuda.kvcache`, :mod:`flash_cuda.distributed` and
:mod:`flash_cuda.integrations.sdpa` call the single checks they share.

The validated score options travel as one :class:`ScoreOptions` (scale, window, softcap, ALiBi
slopes) from here to the custom ops, which take its fields as plain values (``*opts``).
"""

from __future__ import annotations

import math
import numbers
import os
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["ScoreOptions", "validate", "validate_varlen", "SUPPORTED_DTYPES", "KERNELS", "MIN_HEAD_DIM",
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
PREFIX = "flash_cuda.attention: "
VARLEN_PREFIX = "flash_cuda.varlen_attention: "


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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
            raise TypeError(
                f"{prefix}{name} has unsupported dtype {t.dtype}; "
                f"supported dtypes are {_ACCEPTED_DTYPES}"
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


def _is_traced(x) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat)) or torch.compiler.is_compiling()


def check_scale(scale, head_dim: int, prefix: str = PREFIX) -> float:
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


def check_window(window_size, is_causal: bool, prefix: str = PREFIX) -> Tuple[int, int]:
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


def check_softcap(softcap, prefix: str = PREFIX) -> float:
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


def check_alibi(alibi_slopes, batch: int, heads: int, prefix: str = PREFIX) -> Optional[Tensor]:
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
            f"{prefix}alibi_slopes must be a float32 tensor, got {dtype_name(alibi_slopes.dtype)}"
        )
    shape = tuple(alibi_slopes.shape)
    if shape != (heads,) and shape != (batch, heads):
        raise ValueError(
            f"{prefix}alibi_slopes must have shape ({heads},) (one slope per query head) or "
            f"({batch}, {heads}) (per batch entry and query head), got {shape}"
        )
    return alibi_slopes.detach().contiguous()


def check_sinks(sinks, heads: int, prefix: str = PREFIX) -> Optional[Tensor]:
    """Type, dtype and shape of the attention sinks (the device is checked with the others):
    one logit per query head, shape ``(heads,)``, any floating dtype (gpt-oss keeps them in the
    model's dtype). Returns them as the kernels take them, float32 and contiguous; the
    conversion is differentiable, so a gradient reaches the sinks in their own dtype."""
    if sinks is None:
        return None
    accepted = f"a floating tensor of shape ({heads},) (one logit per query head)"
    if not isinstance(sinks, Tensor):
        raise TypeError(f"{prefix}sinks must be None or {accepted}, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"{prefix}sinks must be {accepted}, got dtype {dtype_name(sinks.dtype)}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"{prefix}sinks must be {accepted}, got shape {tuple(sinks.shape)}")
    return sinks.to(torch.float32).contiguous()


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
        if not _is_int(m):
            raise TypeError(
                f"{prefix}{name} must be a Python int (an upper bound on the sequence "
                f"lengths), got {type(m).__name__}"
            )
        if not (0 <= m <= MAX_SEQLEN):
            raise ValueError(f"{prefix}{name} must be in [0, 2^31 - 1], got {m}")
        res.append(m if _is_traced(m) else int(m))
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


def check_cu_seqlens_enabled(flag: bool) -> bool:
    env = os.environ.get("FLASH_CUDA_CHECK_CU_SEQLENS", "").strip().lower()
    return bool(flag) or env not in ("", "0", "false", "no", "off")


def check_kernel(kernel, dtype: torch.dtype, features: Sequence[str] = (),
                 prefix: str = PREFIX) -> int:
    """The tier id for ``kernel``; ``features`` names the options in use that the Hopper
    (wgmma) tier does not support yet (softcap with deterministic=True: its backward)."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(
            f"{prefix}kernel must be one of 'auto', 'simt', 'mma', 'wgmma', got {kernel!r}"
        )
    if kernel == "simt" and dtype != torch.float32:
        raise ValueError(
            f"{prefix}kernel='simt' is the float32 kernel, but the inputs are "
            f"{dtype_name(dtype)}; use kernel='mma' or 'auto' for float16/bfloat16"
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


def check_dropout(dropout_p, kernel, prefix: str = PREFIX) -> float:
    """dropout_p as a float in [0, 1]; with dropout, float16 / bfloat16 calls run the mma.sync
    kernels and float32 ones the simt kernels (kernel='wgmma' has no dropout)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{prefix}dropout_p must be a number in [0, 1], got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if dropout_p and kernel == "wgmma":
        raise ValueError(f"{prefix}dropout_p > 0 runs on kernel='auto', 'mma' (float16 / bfloat16) or 'simt' "
                         f"(float32), got kernel='wgmma'")
    return dropout_p


class ScoreOptions(NamedTuple):
    """The validated options that shape the logits, in the form (and the order) the custom ops
    and the extension take them: ``scale``; the window sides (-1 unbounded, is_causal is
    ``window_right = 0``); ``softcap`` (0: off); the ALiBi slopes (None, or float32 and
    contiguous). One value travels from validation to the op call, where ``*opts`` spreads it
    into the op's plain arguments (a torch.library schema takes no Python objects)."""
    scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None

    def ext_args(self) -> tuple:
        """The extension's arguments for these options, as the binding's types."""
        return (float(self.scale), int(self.window_left), int(self.window_right), float(self.softcap),
                self.alibi_slopes)


def check_score_options(head_dim: int, scale, is_causal: bool, window_size, softcap,
                        prefix: str) -> ScoreOptions:
    """Scale, window and softcap checked (no ALiBi slopes). The defaults take the short way: a
    small call (a decode step) pays for every microsecond."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale(scale, head_dim, prefix)
    if type(window_size) is tuple and window_size == (-1, -1):
        left, right = -1, 0 if is_causal else -1
    else:
        left, right = check_window(window_size, is_causal, prefix)
    if softcap != 0.0 or type(softcap) is not float:
        softcap = check_softcap(softcap, prefix)
    return ScoreOptions(scale, left, right, softcap)


def validate_options(q: Tensor, *, batch: int, scale, is_causal: bool, window_size, softcap,
                     alibi_slopes, kernel, varlen: bool, prefix: str,
                     deterministic: bool = False) -> Tuple[ScoreOptions, int]:
    """The checks shared by attention and varlen_attention once the tensors' types, dtypes,
    shapes and strides are known good: scale, window, softcap, ALiBi slopes, kernel. Returns
    (options, tier), tier the extension's kernel id."""
    opts = check_score_options(q.shape[-1], scale, is_causal, window_size, softcap, prefix)
    if alibi_slopes is not None:
        heads = q.shape[-2] if varlen else q.shape[1]
        opts = ScoreOptions(opts.scale, opts.window_left, opts.window_right, opts.softcap,
                            check_alibi(alibi_slopes, batch, heads, prefix))
    if kernel == "auto" and type(kernel) is str:
        return opts, 0
    # The Hopper tier runs windows, softcap, ALiBi and packed batches; softcap's backward only
    # on its warp-specialized kernel, which adds dQ in a varying order: not deterministic=True
    # (kernel='auto' then takes the mma.sync backward).
    features = ["softcap with deterministic=True"] if opts.softcap > 0 and deterministic else []
    return opts, check_kernel(kernel, q.dtype, features, prefix)


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
