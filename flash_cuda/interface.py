"""The public entry point :func:`attention`, its input validation, and the custom ops.

Layering:

* :func:`attention` validates every input (clear errors, before anything is allocated
  or launched), then calls the custom op ``torch.ops.flash_cuda.fwd``.
* ``flash_cuda::fwd`` / ``flash_cuda::bwd`` are ``torch.library`` custom ops around the
  compiled extension (``_C.fwd`` / ``_C.bwd``). Each has a fake (meta) implementation, so
  ``torch.compile(fullgraph=True)`` traces through them without a graph break, and the
  forward op has an autograd formula that calls the backward op.
* Empty problems (batch, query length or key length 0) are answered here without a
  kernel launch.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _ext

__all__ = ["attention", "SUPPORTED_DTYPES", "KERNELS", "MIN_HEAD_DIM", "MAX_HEAD_DIM"]

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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------------------------
# Validation. Each step is a separate function so that every error can be exercised on
# a machine without a GPU (CPU or meta tensors, or a patched capability lookup).
# ---------------------------------------------------------------------------------------


def _check_types(q, k, v, is_causal, return_lse, deterministic) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{_PREFIX}{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, flag in (("is_causal", is_causal), ("return_lse", return_lse),
                       ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_PREFIX}{name} must be a bool, got {type(flag).__name__}")


def _check_dtypes(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{_PREFIX}{name} has unsupported dtype {t.dtype}; "
                f"supported dtypes are {_ACCEPTED_DTYPES}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{_PREFIX}q, k and v must have the same dtype, got q: {_dtype_name(q.dtype)}, "
            f"k: {_dtype_name(k.dtype)}, v: {_dtype_name(v.dtype)}"
        )


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    layouts = {"q": "(batch, heads, seqlen_q, head_dim)", "k": "(batch, kv_heads, seqlen_k, head_dim)",
               "v": "(batch, kv_heads, seqlen_k, head_dim)"}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(
                f"{_PREFIX}{name} must be a 4-D tensor {layouts[name]}, "
                f"got {t.dim()}-D with shape {tuple(t.shape)}"
            )
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"{_PREFIX}q, k and v must have the same batch size (dim 0), got "
            f"q: {q.shape[0]}, k: {k.shape[0]}, v: {v.shape[0]}"
        )
    if k.shape[3] != D or v.shape[3] != D:
        raise ValueError(
            f"{_PREFIX}q, k and v must have the same head dim (dim 3), got "
            f"q: {q.shape[3]}, k: {k.shape[3]}, v: {v.shape[3]}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"{_PREFIX}k and v must have the same shape (batch, kv_heads, seqlen_k, head_dim), "
            f"got k: {tuple(k.shape)}, v: {tuple(v.shape)}"
        )
    Hkv = k.shape[1]
    if Hq < 1 or Hkv < 1:
        raise ValueError(
            f"{_PREFIX}the number of heads must be at least 1, got q heads {Hq}, kv heads {Hkv}"
        )
    if Hq % Hkv != 0:
        raise ValueError(
            f"{_PREFIX}the number of query heads ({Hq}) must be a multiple of the number of "
            f"key/value heads ({Hkv}) (grouped-query attention: query head h uses kv head "
            f"h // (Hq // Hkv))"
        )
    if D < MIN_HEAD_DIM or D > MAX_HEAD_DIM or D % HEAD_DIM_MULTIPLE != 0:
        raise ValueError(
            f"{_PREFIX}unsupported head dim {D}; the head dim must be a multiple of "
            f"{HEAD_DIM_MULTIPLE} in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
        )
    if B > MAX_GRID_YZ or Hq > MAX_GRID_YZ:
        raise ValueError(
            f"{_PREFIX}batch size ({B}) and number of query heads ({Hq}) must each be at most "
            f"{MAX_GRID_YZ} (CUDA grid limit); split the batch into several calls"
        )
    Sk = k.shape[2]
    if Sq > MAX_SEQLEN or Sk > MAX_SEQLEN:
        raise ValueError(
            f"{_PREFIX}sequence lengths must be below 2^31, got seqlen_q {Sq}, seqlen_k {Sk}"
        )


def _check_strides(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{_PREFIX}{name} must have a contiguous last dimension (stride(-1) == 1), got "
                f"strides {tuple(t.stride())}; call .contiguous() or pass a view whose last "
                f"dim is contiguous (any other strides are fine)"
            )


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(
            f"{_PREFIX}scale must be a finite real number (Python float or int) or None, "
            f"got {type(scale).__name__}"
        )
    # Written as a comparison (not math.isfinite) so that torch.compile can trace it when
    # it treats the scale as a symbolic float; NaN fails both comparisons.
    if not (-math.inf < scale < math.inf):
        raise ValueError(f"{_PREFIX}scale must be a finite real number, got {scale}")
    if isinstance(scale, (torch.SymFloat, torch.SymInt)) or torch.compiler.is_compiling():
        return scale
    return float(scale)


def _check_kernel(kernel, dtype: torch.dtype) -> int:
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(
            f"{_PREFIX}kernel must be one of 'auto', 'simt', 'mma', 'wgmma', got {kernel!r}"
        )
    if kernel == "simt" and dtype != torch.float32:
        raise ValueError(
            f"{_PREFIX}kernel='simt' is the float32 kernel, but the inputs are "
            f"{_dtype_name(dtype)}; use kernel='mma' or 'auto' for float16/bfloat16"
        )
    if kernel in ("mma", "wgmma") and dtype == torch.float32:
        raise ValueError(
            f"{_PREFIX}kernel={kernel!r} is a float16/bfloat16 tensor-core kernel, but the "
            f"inputs are float32; use kernel='simt' or 'auto' for float32"
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


def _check_capability(device: torch.device) -> None:
    major, minor = _device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        raise RuntimeError(
            f"{_PREFIX}flash_cuda needs an NVIDIA GPU of compute capability 8.0 or newer "
            f"(Ampere, Ada, Hopper); {device} has compute capability {major}.{minor}"
        )


def _check_device(q: Tensor, k: Tensor, v: Tensor) -> None:
    if not (q.device == k.device == v.device):
        raise RuntimeError(
            f"{_PREFIX}q, k and v must be on the same device, got q: {q.device}, "
            f"k: {k.device}, v: {v.device}"
        )
    if q.device.type != "cuda":
        raise RuntimeError(
            f"{_PREFIX}inputs must be CUDA tensors, got device '{q.device}'; flash_cuda runs "
            f"only on NVIDIA GPUs (move the inputs with .cuda(), or use "
            f"torch.nn.functional.scaled_dot_product_attention on {q.device.type})"
        )
    # The capability query cannot be traced by torch.compile; the extension checks it
    # again on every launch, so skipping it while tracing loses nothing.
    if not torch.compiler.is_compiling():
        _check_capability(q.device)


def _validate(q, k, v, *, scale=None, is_causal=False, return_lse=False, deterministic=False,
              kernel="auto") -> Tuple[float, int]:
    """Validates the arguments of :func:`attention`; returns (scale, tier).

    Order: types, dtypes, shapes, strides, scale, kernel, device, GPU capability. The
    extension's presence is checked by the caller afterwards.
    """
    _check_types(q, k, v, is_causal, return_lse, deterministic)
    _check_dtypes(q, k, v)
    _check_shapes(q, k, v)
    _check_strides(q, k, v)
    scale = _check_scale(scale, q.shape[-1])
    tier = _check_kernel(kernel, q.dtype)
    _check_device(q, k, v)
    return scale, tier


# ---------------------------------------------------------------------------------------
# Custom ops
# ---------------------------------------------------------------------------------------


def _is_empty(q: Tensor, k: Tensor) -> bool:
    return q.shape[0] == 0 or q.shape[2] == 0 or k.shape[2] == 0


@torch.library.custom_op("flash_cuda::fwd", mutates_args=())
def _fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, is_causal: bool, deterministic: bool,
         tier: int) -> Tuple[Tensor, Tensor]:
    """Forward: returns (out, lse). ``deterministic`` is only read by the backward."""
    if _is_empty(q, k):
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[0], q.shape[1], q.shape[2]), float("-inf"),
                         dtype=torch.float32, device=q.device)
        return out, lse
    out, lse = _ext.require().fwd(q, k, v, float(scale), bool(is_causal), int(tier))
    return out, lse


@_fwd.register_fake
def _fwd_fake(q, k, v, scale, is_causal, deterministic, tier):
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[0], q.shape[1], q.shape[2]), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("flash_cuda::bwd", mutates_args=())
def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
         dlse: Optional[Tensor], scale: float, is_causal: bool, deterministic: bool,
         tier: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward: returns (dq, dk, dv); ``dlse`` is the optional upstream gradient of lse."""
    if _is_empty(q, k):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq, dk, dv = _ext.require().bwd(dout, q, k, v, out, lse, dlse, float(scale), bool(is_causal),
                                    bool(deterministic), int(tier))
    return dq, dk, dv


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, dlse, scale, is_causal, deterministic, tier):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, is_causal, deterministic, tier = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale
    ctx.is_causal = is_causal
    ctx.deterministic = deterministic
    ctx.tier = tier
    # Unused outputs then arrive as None instead of a zero tensor: no dlse is passed
    # (and nothing is allocated for it) when only `out` is differentiated.
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.is_causal, ctx.deterministic,
                      ctx.tier)
    return dq, dk, dv, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    kernel: str = "auto",
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Exact softmax attention on NVIDIA GPUs, a drop-in for ``scaled_dot_product_attention``.

    Computes ``out = softmax(scale * q @ k^T [+ causal mask]) @ v`` in blocks, without
    materialising the (seqlen_q x seqlen_k) score matrix: memory is O(seqlen).

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
            limited to 65535.
        is_causal: causal masking, aligned to the bottom-right corner of the score matrix
            as in FlashAttention: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k -
            seqlen_q`` (for ``seqlen_q == seqlen_k`` this is the usual lower triangle; with
            more queries than keys, the first ``seqlen_q - seqlen_k`` query rows see no key:
            their output is 0 and their lse is ``-inf``, never NaN).
        scale: multiplies ``q @ k^T``; default ``1 / sqrt(head_dim)``. Any finite real.
        return_lse: also return ``lse``, float32 ``(batch, heads, seqlen_q)``: the natural
            log of ``sum_j exp(scale * q_i . k_j)`` over the visible keys (``-inf`` for a
            row that sees none). ``lse`` is differentiable too: a loss that uses it sends
            its gradient (``dlse``) through the backward kernels.
        deterministic: ``True`` makes every backward bitwise reproducible run to run.
            The float16 / bfloat16 kernels use no floating-point atomics and are
            reproducible either way. The float32 backward by default adds dQ with float
            atomics (unordered, so dq can differ in the last bits between runs; dk, dv do
            not); ``True`` runs a separate dQ kernel instead, at a cost in speed measured
            in OPTIMIZATION.md.
        kernel: ``"auto"`` (default) picks by dtype and GPU: ``"simt"`` (float32 CUDA-core
            kernels, true fp32 arithmetic) for float32; for float16 / bfloat16 ``"wgmma"``
            (Hopper warpgroup-MMA kernels) on sm_90 for head dims 33..64 and 97..128, else
            ``"mma"`` (mma.sync tensor-core kernels, sm_80 and newer, every head dim). Both
            tensor-core tiers accumulate in fp32. Asking for ``"simt"`` with 16-bit inputs,
            ``"mma"`` / ``"wgmma"`` with float32 inputs, or ``"wgmma"`` where it does not
            apply is an error.

    Returns:
        ``out`` with q's shape and dtype (laid out like ``torch.empty_like(q)``: q's strides
        when q is dense, else a dense layout in q's dimension order), or ``(out, lse)`` when
        ``return_lse`` is true.

    Gradients flow to q, k and v (autograd); dk / dv are summed over the query heads of a
    group for GQA. The op is a ``torch.library`` custom op (``torch.ops.flash_cuda.fwd`` /
    ``.bwd``) and works under ``torch.compile(fullgraph=True)``.

    Raises:
        TypeError: an argument is not a tensor / bool, or a dtype is unsupported or mixed.
        ValueError: a shape, stride, head dim, scale or kernel name is not accepted.
        RuntimeError: the inputs are not on one CUDA device, the GPU is older than
            compute capability 8.0, or the compiled extension is not built.
    """
    scale, tier = _validate(q, k, v, scale=scale, is_causal=is_causal, return_lse=return_lse,
                            deterministic=deterministic, kernel=kernel)
    if not _ext.is_available():
        raise RuntimeError(_ext.unavailable_message())
    out, lse = _fwd(q, k, v, scale, is_causal, deterministic, tier)
    if return_lse:
        return out, lse
    return out
