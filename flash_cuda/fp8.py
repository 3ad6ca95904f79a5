"""The FP8 (e4m3) forward: :func:`attention_fp8`.

q, k and v come as ``torch.float8_e4m3fn`` with their descales (a stored value x8 stands for
x8 * descale), the output in bfloat16 or float16. The algorithm, with every rounding, is
:func:`flash_cuda.reference.attention_fp8_forward_blocked`; the kernel is the Hopper
warp-specialized forward on e4m3 tiles (csrc/tiers/wgmma/fwd, WsConfig's kFp8), which lays V out
for its P V product first (csrc/core/fp8_v_layout.cuh). This module checks the arguments (every
error before anything is allocated or launched) and calls the extension.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _ext
from .kvcache_checks import OTHER_FP8, fp8_descales
from .options import check_score_options, dtype_name
from .validation import MAX_GRID_YZ, check_cu_seqlens_tensors, check_cu_seqlens_values, check_max_seqlen

__all__ = ["attention_fp8", "varlen_attention_fp8", "FP8_HEAD_DIMS", "FP8_OUT_DTYPES"]

PREFIX = "flash_cuda.attention_fp8: "
VARLEN_PREFIX = "flash_cuda.varlen_attention_fp8: "
FP8_HEAD_DIMS = (64, 128, 256)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)


def _fail(kind, msg: str, prefix: str = PREFIX):
    raise kind(prefix + msg)


def _check(q, k, v, q_descale, k_descale, v_descale, is_causal, scale, window_size, softcap, out_dtype,
           return_lse, varlen: Optional[tuple] = None) -> Tuple[Tuple[Tensor, Tensor, Tensor], tuple]:
    """Every check of attention_fp8's (varlen None) or varlen_attention_fp8's arguments (varlen:
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_cu_seqlens)); returns the
    descales as (batch, kv_heads) float32 tensors and the extension's (scale, window_left,
    window_right, softcap, out_dtype)."""
    prefix = PREFIX if varlen is None else VARLEN_PREFIX
    fail = lambda kind, msg: _fail(kind, msg, prefix)  # noqa: E731
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            fail(TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dts = ", ".join(dtype_name(t.dtype) for t in (q, k, v))
    if any(t.dtype in OTHER_FP8 for t in (q, k, v)):
        fail(TypeError, f"only the e4m3 FP8 format (torch.float8_e4m3fn) is supported, got {dts}")
    if any(t.dtype != torch.float8_e4m3fn for t in (q, k, v)):
        fail(TypeError, f"q, k and v must all be torch.float8_e4m3fn (mixed FP8 / 16-bit operands are not "
                        f"supported; 16-bit inputs take flash_cuda.attention), got {dts}")
    ndim, layout = (4, "(batch, heads, seqlen, head_dim)") if varlen is None else (3, "(total, heads, head_dim)")
    if q.dim() != ndim or k.dim() != ndim or v.dim() != ndim:
        fail(ValueError, f"q, k, v must be {ndim}-d {layout}, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if k.shape != v.shape:
        fail(ValueError, f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if varlen is None:
        B, Hq, _, D = q.shape
        if k.shape[0] != B or k.shape[3] != D:
            fail(ValueError, f"q and k / v must have the same batch and head_dim, got {tuple(q.shape)} and "
                             f"{tuple(k.shape)}")
        Hkv = k.shape[1]
    else:
        _, Hq, D = q.shape
        if k.shape[2] != D:
            fail(ValueError, f"q and k / v must have the same head_dim, got {tuple(q.shape)} and {tuple(k.shape)}")
        Hkv = k.shape[1]
        B = check_cu_seqlens_tensors(varlen[0], varlen[1], prefix)
        check_max_seqlen(varlen[2], varlen[3], prefix)
        if not (varlen[4] is True or varlen[4] is False):
            fail(TypeError, f"check_cu_seqlens must be a bool, got {type(varlen[4]).__name__}")
    if Hkv == 0 or Hq % Hkv != 0:
        fail(ValueError, f"the number of query heads ({Hq}) must be a multiple of the number of key/value "
                         f"heads ({Hkv})")
    if D not in FP8_HEAD_DIMS:
        fail(ValueError, f"head_dim must be one of {FP8_HEAD_DIMS} for FP8 inputs, got {D}")
    if B * Hkv > MAX_GRID_YZ:  # V's layout launch has a block per (batch, KV head) in its grid's z
        fail(ValueError, f"batch * kv_heads ({B} * {Hkv}) must be at most {MAX_GRID_YZ} for FP8 inputs; split the "
                         f"batch into several calls")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        fail(ValueError, "the last dimension of q, k, v must be contiguous (stride(-1) == 1)")
    if out_dtype not in FP8_OUT_DTYPES:
        fail(TypeError, f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if not (return_lse is True or return_lse is False):
        fail(TypeError, f"return_lse must be a bool, got {type(return_lse).__name__}")
    if not (is_causal is True or is_causal is False):
        fail(TypeError, f"is_causal must be a bool, got {type(is_causal).__name__}")
    opts = check_score_options(D, scale, is_causal, window_size, softcap, prefix)
    if opts.scale < 0:
        fail(ValueError, f"scale must be >= 0 for FP8 inputs, got {opts.scale}")
    if any(t.requires_grad for t in (q, k, v)):
        fail(RuntimeError, "the FP8 forward has no backward; call it under torch.no_grad() or on tensors that "
                           "do not require grad")
    if not (q.is_cuda and k.is_cuda and v.is_cuda) or not (q.device == k.device == v.device):
        fail(RuntimeError, f"q, k, v must be CUDA tensors on one device, got {q.device}, {k.device}, {v.device}")
    if varlen is not None and (varlen[0].device != q.device or varlen[1].device != q.device):
        fail(RuntimeError, f"cu_seqlens_q and cu_seqlens_k must be on q's device ({q.device}), got "
                           f"{varlen[0].device} and {varlen[1].device}")
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        fail(RuntimeError, f"the FP8 forward runs on Hopper GPUs (compute capability 9.0), got {major}.{minor}")
    ds = tuple(fp8_descales(d, name, B, Hkv, q.device, prefix=prefix)
               for d, name in ((q_descale, "q_descale"), (k_descale, "k_descale"), (v_descale, "v_descale")))
    if varlen is not None and varlen[4]:
        check_cu_seqlens_values(varlen[0], varlen[1], q.shape[0], k.shape[0], varlen[2], varlen[3], prefix)
    return ds, (float(opts.scale), int(opts.window_left), int(opts.window_right), float(opts.softcap), out_dtype)


def attention_fp8(q: Tensor, k: Tensor, v: Tensor, q_descale=None, k_descale=None, v_descale=None, *,
                  is_causal: bool = False, scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, out_dtype: torch.dtype = torch.bfloat16,
                  return_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Attention on FP8 (e4m3) inputs, forward only, on Hopper GPUs.

    Args:
        q: ``(batch, heads, seqlen_q, head_dim)`` ``torch.float8_e4m3fn``.
        k, v: ``(batch, kv_heads, seqlen_k, head_dim)`` ``torch.float8_e4m3fn``, the same shape
            (GQA as in :func:`flash_cuda.attention`). head_dim 64, 128 or 256; any strides with
            ``stride(-1) == 1``.
        q_descale, k_descale, v_descale: what a stored value stands for is ``x8 * descale``:
            None (1), a float or a float32 tensor of shape () / (1,) per tensor, or a float32
            ``(batch, kv_heads)`` tensor on q's device (the query heads of a group share their KV
            head's), as FlashAttention-3 takes them.
        is_causal, scale, window_size, softcap: as :func:`flash_cuda.attention` (softcap on
            the dequantized logits: ``c * tanh(scale * q.k / c)``).
        out_dtype: ``torch.bfloat16`` (default) or ``torch.float16``.
        return_lse: also return the float32 ``(batch, heads, seqlen_q)`` log-sum-exp of the
            scaled logits (in the dequantized values' units).

    Returns:
        ``out`` ``(batch, heads, seqlen_q, head_dim)`` in ``out_dtype``, or ``(out, lse)``.

    The scores are those of the stored values times ``scale * q_descale * k_descale``; P is
    rounded to e4m3 relative to the row's running max lowered by 2^8 (so that small
    probabilities keep their precision), the row sums use the unrounded P, and O is scaled by
    ``v_descale`` (:func:`flash_cuda.reference.attention_fp8_forward_blocked` states each
    rounding). No backward: inputs that require grad are refused.

    Raises:
        TypeError, ValueError: a dtype, shape, stride, head dim, descale or option is not
            accepted (mixed FP8 / 16-bit operands and the e5m2 format included).
        RuntimeError: not CUDA tensors on one device, a GPU other than Hopper, inputs that
            require grad, or the extension is not built.
    """
    (qd, kd, vd), args = _check(q, k, v, q_descale, k_descale, v_descale, is_causal, scale, window_size, softcap,
                                out_dtype, return_lse)
    out, lse = _ext.require().fwd_fp8(q, k, v, qd, kd, vd, *args)
    return (out, lse) if return_lse else out


def varlen_attention_fp8(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, q_descale=None, k_descale=None, v_descale=None, *,
                         is_causal: bool = False, scale: Optional[float] = None,
                         window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                         out_dtype: torch.dtype = torch.bfloat16, return_lse: bool = False,
                         check_cu_seqlens: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r""":func:`attention_fp8` over a packed batch of sequences, as :func:`flash_cuda.varlen_attention`
    takes them: q ``(total_q, heads, head_dim)``, k / v ``(total_k, kv_heads, head_dim)``, all
    ``torch.float8_e4m3fn``, sequence ``b`` owning rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q
    and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k and v (int32 ``(batch + 1,)`` tensors on q's
    device); ``max_seqlen_q`` / ``max_seqlen_k`` bound the lengths (``check_cu_seqlens=True``
    checks them, a device sync). Descales: as :func:`attention_fp8`, ``(batch, kv_heads)`` with
    one row per sequence. Returns out ``(total_q, heads, head_dim)`` in ``out_dtype``, or
    ``(out, lse)`` with lse float32 ``(heads, total_q)``. V is laid out per call in one slot of
    ``max_seqlen_k`` keys per sequence (``batch * kv_heads * head_dim * max_seqlen_k`` bytes).
    Specified by :func:`flash_cuda.reference.attention_fp8_varlen_forward_blocked`.
    """
    varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, check_cu_seqlens)
    (qd, kd, vd), args = _check(q, k, v, q_descale, k_descale, v_descale, is_causal, scale, window_size, softcap,
                                out_dtype, return_lse, varlen)
    out, lse = _ext.require().fwd_fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                             int(max_seqlen_k), qd, kd, vd, *args)
    return (out, lse) if return_lse else out
