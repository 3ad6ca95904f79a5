"""The public entry points :func:`attention` and :func:`varlen_attention`.

Each validates every input first (:mod:`flash_cuda.validation`: clear errors, before anything
is allocated or launched; for plain eager tensors the outcome is kept per signature of the
arguments, :mod:`flash_cuda.signature`, so a repeated call skips the checks), then runs the
forward: for plain eager tensors the extension call itself (:mod:`flash_cuda.eager`), else the
custom op ``torch.ops.flash_cuda.fwd`` (dense) or ``torch.ops.flash_cuda.varlen_fwd`` (packed
sequences with cu_seqlens) (:mod:`flash_cuda.ops`).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _ext, eager, ops, signature, validation
from .signature import check_attention, check_varlen, plan_attention, plan_varlen
from .validation import KERNELS, MAX_HEAD_DIM, MIN_HEAD_DIM, SUPPORTED_DTYPES

__all__ = ["attention", "varlen_attention", "SUPPORTED_DTYPES", "KERNELS", "MIN_HEAD_DIM",
           "MAX_HEAD_DIM"]

_is_autocast_enabled = torch.is_autocast_enabled
_is_grad_enabled = torch.is_grad_enabled
_F32 = torch.float32
_FULL_WINDOW = (-1, -1)  # attention's default window_size (an identity test passes it at once)
# The fast path's tests, bound once (each attribute chain would cost more than the test).
_eager_ok = ops.eager_ok
_is_compiling = torch.compiler.is_compiling
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
# Whether autocast is on for any device (then the general path casts, or not, as it decides): a
# test without an argument to parse, where torch has it.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: torch.is_autocast_enabled("cuda"))
# The fast path's last found (key, plan) of signature.dense_plans.
_last_dense: tuple = ((), None)


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
            none; with ``sinks`` the sink's term is part of the sum). ``lse`` is
            differentiable too: a loss that uses it sends its gradient
            (``dlse``) through the backward kernels.
        deterministic: ``True`` makes every backward bitwise reproducible run to run.
            By default two backwards add dQ across key blocks in an unordered way (so dq
            can differ in its last bits between runs; dk, dv do not): the float32 one (float
            atomics) and, on sm_90, the float16 / bfloat16 one at head dims 33..256, dense
            and packed (:func:`varlen_attention`) batches alike, and below 33 for dense
            batches without softcap / ALiBi (one warp-specialized kernel
            adding
            dQ into an fp32 workspace of about B * Hq * Sq * D * 4 bytes, D rounded up to 64
            (to 96 at D 65..96 without dropout);
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
            128-wide kernels, the warp-specialized backward 96-wide tiles), a warp-specialized
            backward at 129..256 with
            ``deterministic=False``, and at head dims up to 32 the 64-wide kernels for dense
            batches without softcap, ALiBi or dropout (the backward with
            ``deterministic=False``); else ``"mma"`` (mma.sync tensor-core
            kernels, sm_80 and newer, every head dim and option). Both tensor-core tiers accumulate in fp32. Asking for ``"simt"`` with
            16-bit inputs, ``"mma"`` / ``"wgmma"`` with float32 inputs, or ``"wgmma"`` where
            it does not apply is an error.
        sinks: ``None`` or attention sinks as in gpt-oss: one learned logit per query head,
            a floating tensor of shape ``(heads,)`` on q's device (any floating dtype; the
            kernels take it as float32). Every row's softmax gets one more term,
            ``exp(sinks[h])``, with no value row: ``out_i = sum_j exp(x_ij - lse_i) v_j``
            with ``lse_i = log(exp(sinks[h]) + sum_j exp(x_ij))`` (the returned lse includes
            it), so a row may give attention to "nothing". The sink is in the units of the
            final logits ``x`` (no scale, softcap, ALiBi or mask applies to it); a row that
            sees no key gets output 0 and lse ``sinks[h]``; ``-inf`` is no sink. With
            ``requires_grad`` the sinks get their gradient (in their own dtype).
            Works with every other option, dropout included."""



def _prepared(alibi_slopes, sinks, plan):
    """The extension's forms of the checked slopes and sinks (contiguous; the sinks float32 by a
    differentiable conversion, so their gradient reaches them in their dtype), once the
    extension is known to be there."""
    if not _ext.is_available():
        raise RuntimeError(_ext.unavailable_message())
    if alibi_slopes is not None and plan.fix_alibi:
        alibi_slopes = alibi_slopes.detach().contiguous()
    if sinks is not None and plan.fix_sinks:
        sinks = sinks.to(_F32).contiguous()
    return alibi_slopes, sinks


def _eager_call(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, plan):
    """(out, lse) of a plain eager call: through the autograd Function when a gradient is
    wanted, else (inference, e.g. a decode step under torch.no_grad()) the extension call
    alone, without a Function's bookkeeping."""
    if _is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                               or (sinks is not None and sinks.requires_grad)):
        return eager.EagerAttention.run(q, k, v, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan)
    out, lse, _, _ = eager.forward(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, plan)
    return out, lse


def _op_call(plain, with_dropout, plan, sinks, args):
    """(out, lse) through the custom ops (torch.compile, fake tensors, tensor subclasses): the
    dropout op where the call has dropout, else the plain one."""
    if plan.dropout_p:
        return with_dropout(*args, plan.dropout_p, sinks)[:2]
    return plain(*args, sinks)[:2]


def attention(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = False, scale: Optional[float] = None,
              window_size: Tuple[int, int] = _FULL_WINDOW, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
              return_lse: bool = False, deterministic: bool = False, kernel: str = "auto",
              dropout_p: float = 0.0, sinks: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
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

    Gradients flow to q, k and v (autograd; and to ``sinks`` when it requires them); dk / dv
    are summed over the query heads of a group for GQA. The op is a ``torch.library`` custom
    op (``torch.ops.flash_cuda.fwd`` / ``.bwd``) and works under
    ``torch.compile(fullgraph=True)``; eager calls on plain tensors run the same kernels
    without the op's dispatch, and a repeated signature of the arguments (shapes, strides,
    dtypes, devices, options) skips the checks that it passed before.

    Raises:
        TypeError: an argument is not a tensor / bool / int, or a dtype is unsupported or
            mixed (also the ALiBi slopes' dtype; sinks not floating).
        ValueError: a shape, stride, head dim, scale, window, softcap, ALiBi shape, sinks shape
            or kernel name is not accepted.
        RuntimeError: the inputs (and ALiBi slopes, sinks) are not on one CUDA device, the GPU is
            older than compute capability 8.0, or the compiled extension is not built.
    """
    global _last_dense
    # The fast path of a repeated call (a training or decode step): plain eager tensors (ops.eager_ok's
    # test, inlined while ops.eager_ok is the original: tests replace it to force a path), no ALiBi
    # slopes or sinks, options of the types a signature takes (signature.plan_attention's test) and a
    # signature whose plan says "the extension's forward, directly" (no dropout, some row and key). The
    # plan answers for every check the general path would run, so the outcome is the general path's:
    # the same extension call, the same Function, the same errors (a call that fails any part of
    # this test, or whose signature is new, takes the general path and its checks).
    if (alibi_slopes is None and sinks is None and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and (is_causal is False or is_causal is True) and (return_lse is False or return_lse is True)
            and (deterministic is False or deterministic is True) and type(kernel) is str
            and (window_size is _FULL_WINDOW or (type(window_size) is tuple and len(window_size) == 2
                                                and type(window_size[0]) is int and type(window_size[1]) is int))
            and (scale is None or type(scale) is float or type(scale) is int)
            and (type(softcap) is float or type(softcap) is int) and (type(dropout_p) is float or type(dropout_p) is int)
            and ops.eager_ok is _eager_ok and not _is_compiling() and not _dispatch_stack_len()
            and not _function_mode_enabled() and not _any_autocast()):
        try:  # signature.plan_attention's key, built here (a test holds both the same)
            key = (validation.check_device, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype,
                   k.device, v.shape, v.stride(), v.dtype, v.device, None, None, is_causal, scale, window_size,
                   softcap, return_lse, deterministic, kernel, dropout_p)
        except RuntimeError:  # a layout without strides: the general path's checks say what is wrong
            key = None
        last_key, plan = _last_dense
        if key != last_key:  # (a step's calls repeat one signature: a comparison costs half a lookup's hash)
            plan = signature.dense_plans.get(key)
            if plan is not None:
                _last_dense = (key, plan)
        if plan is not None and plan.fwd_args is not None:
            C = _ext.require()  # (raises as the general path does when the kernels cannot be loaded)
            if not (_is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
                direct = plan.direct
                out, lse, _ = (C.fwd(q, k, v, *plan.fwd_args) if direct is None else
                               C.fwd_direct(q, k, v, direct))
            elif _functorch_active():
                out, lse = eager.EagerAttention.run(q, k, v, None, None, None, None, plan)
            else:  # (the extension's C++ autograd node where the plan has its DirectPlan)
                direct = plan.direct
                out, lse = eager.apply_direct(q, k, v, plan) if direct is None else C.attention_direct(q, k, v, direct)
            return (out, lse) if return_lse else out
    return _attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes, return_lse, deterministic,
                      kernel, dropout_p, sinks)


def _attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes, return_lse, deterministic, kernel,
               dropout_p, sinks):
    """:func:`attention`'s general path: every call the fast path does not answer."""
    if _is_autocast_enabled("cuda"):
        q, k, v = _autocast(q, k, v)
    on_eager = ops.eager_ok(q, k, v, alibi_slopes, sinks)
    plan = (plan_attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes, return_lse, deterministic,
                           kernel, dropout_p, sinks) if on_eager else
            check_attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes, return_lse, deterministic,
                            kernel, dropout_p, sinks, False))
    alibi_slopes, sinks = _prepared(alibi_slopes, sinks, plan)
    if on_eager:
        out, lse = _eager_call(q, k, v, alibi_slopes, sinks, None, None, plan)
    else:
        out, lse = _op_call(ops.fwd, ops.fwd_dropout, plan, sinks,
                            (q, k, v, plan.scale, plan.window_left, plan.window_right, plan.softcap, alibi_slopes,
                             deterministic, plan.tier))
    return (out, lse) if return_lse else out


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, is_causal: bool = False, scale: Optional[float] = None,
                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     alibi_slopes: Optional[Tensor] = None, return_lse: bool = False, deterministic: bool = False,
                     kernel: str = "auto", check_cu_seqlens: bool = False,
                     dropout_p: float = 0.0, sinks: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
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
    if _is_autocast_enabled("cuda"):
        q, k, v = _autocast(q, k, v)
    on_eager = ops.eager_ok(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window_size, softcap,
            alibi_slopes, return_lse, deterministic, kernel, check_cu_seqlens, dropout_p, sinks)
    plan = plan_varlen(*args) if on_eager else check_varlen(*args, False)
    alibi_slopes, sinks = _prepared(alibi_slopes, sinks, plan)
    if plan.fix_cu:
        cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if on_eager:
        out, lse = _eager_call(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, plan)
    else:
        out, lse = _op_call(ops.varlen_fwd, ops.varlen_fwd_dropout, plan, sinks,
                            (q, k, v, cu_seqlens_q, cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k, plan.scale,
                             plan.window_left, plan.window_right, plan.softcap, alibi_slopes, deterministic,
                             plan.tier, check_cu_seqlens))
    return (out, lse) if return_lse else out


attention.__doc__ = attention.__doc__.replace("{features}", _FEATURES_DOC)
varlen_attention.__doc__ = varlen_attention.__doc__.replace("{features}", _FEATURES_DOC)
