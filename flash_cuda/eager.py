"""The eager path of :func:`flash_cuda.attention` and :func:`flash_cuda.varlen_attention`: the
extension calls of :mod:`flash_cuda.ops` without the custom ops' dispatch.

Outside torch.compile the ops' dispatch (custom-op wrappers, default filling, the generated autograd
node) costs several times what the extension call itself does, and a short sequence's step is then
bound by the host, not the GPU. Plain eager tensors (``ops.eager_ok``) therefore take this path, with
the :class:`~flash_cuda.signature.Plan` that validation left: :func:`forward` is the extension call
alone (no gradient wanted, e.g. a decode step under ``torch.no_grad()``), :class:`EagerAttention` the
same call inside an autograd Function whose backward is the ops' (``ops.attention_grads``). Both
layouts, with and without dropout, go through the one Function; a test holds this path and the ops
bitwise equal. A plan with ``fwd_args`` (a dense call without ALiBi slopes, sinks or dropout, the
common training step) takes the extension's ``attention_direct`` instead, the same calls with fewer
inputs and saved tensors in an autograd node written in C++ (the plan's ``direct`` options), or, where
the module in use has no such entry (a test's stand-in), its Python form :class:`EagerAttentionDirect`
(:func:`flash_cuda.attention`'s fast path calls them too).
"""

from __future__ import annotations

import torch

from . import _ext
from .ops import attention_grads, empty_fwd, new_rng_state
from .signature import Plan
from .validation import check_cu_seqlens_enabled, check_cu_seqlens_values

__all__ = ["forward", "EagerAttention", "EagerAttentionStep", "EagerAttentionDirect", "apply_direct"]


def forward(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, plan: Plan):
    """(out, lse, aux, rng_state) of a validated call (alibi_slopes, sinks and cu_seqlens as the
    extension takes them; cu_seqlens None for the dense layout); rng_state None without dropout.
    The values of cu_seqlens are checked first when asked for (a device sync)."""
    if plan.fwd_args is not None:  # dense, no slopes, sinks or dropout, some row and key: the call alone
        out, lse, aux = _ext.require().fwd(q, k, v, *plan.fwd_args)
        return out, lse, aux, None
    if plan.varlen and check_cu_seqlens_enabled(plan.check_cu_seqlens):
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], plan.max_seqlen_q,
                                plan.max_seqlen_k)
    dropout_p = plan.dropout_p
    # Every forward with dropout records where its draws start, for its own backward: a tensor of
    # its own, never a shared one, as several forwards may await their backwards.
    rng_state = new_rng_state(q) if dropout_p else None
    if plan.empty:
        lse_shape = (q.shape[1], q.shape[0]) if plan.varlen else (q.shape[0], q.shape[1], q.shape[2])
        out, lse, aux = empty_fwd(q, lse_shape, sinks)
        return out, lse, aux, rng_state
    args = (q, k, v, plan.scale, plan.window_left, plan.window_right, plan.softcap, alibi_slopes, cu_seqlens_q,
            cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k, plan.tier)
    if dropout_p:
        kw = {"dropout_p": dropout_p, "rng_state": rng_state}
        if sinks is not None:
            kw["sinks"] = sinks
        out, lse, aux = _ext.require().fwd(*args, **kw)
    elif sinks is not None:
        out, lse, aux = _ext.require().fwd(*args, sinks=sinks)
    else:
        out, lse, aux = _ext.require().fwd(*args)
    return out, lse, aux, rng_state


def _grads(ctx, dout, dlse):
    """(dq, dk, dv, dsinks) of either form, whose first four inputs are q, k, v, sinks."""
    need_q, need_k, need_v, need_sinks = ctx.needs_input_grad[:4]
    if not (need_q or need_k or need_v or need_sinks):
        return None, None, None, None
    q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks = ctx.saved_tensors
    aux, rng_state, plan = ctx.side
    return attention_grads(plan, (q, k, v, out, lse, aux, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state, sinks),
                           need_q, need_k, need_v, need_sinks, dout, dlse, eager=True)


def _direct_grads(ctx, dout, dlse):
    """(dq, dk, dv) of :class:`EagerAttentionDirect`: what ops.attention_grads does for its calls
    (no sinks, no dropout, rows and keys), without the branches."""
    need_q, need_k, need_v, _ = ctx.needs_input_grad
    need_dkdv = need_k or need_v
    if not (need_q or need_dkdv):
        return None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    aux, plan = ctx.side
    if dout is None:
        dout = torch.zeros_like(out)
    elif dout.stride()[-1] != 1:  # (out is 4-D; stride(-1) parses its argument, a slower call)
        dout = dout.contiguous()
    if dlse is not None and (dlse.dtype is not torch.float32 or not dlse.is_contiguous()):
        dlse = dlse.to(torch.float32).contiguous()
    dq, dk, dv = _ext.require().bwd(dout, q, k, v, out, lse, aux, dlse, *plan.bwd_args, need_q, need_dkdv)
    return dq if need_q else None, dk if need_k else None, dv if need_v else None


class EagerAttention(torch.autograd.Function):
    """:func:`forward` as an autograd Function: ``run(q, k, v, sinks, alibi_slopes, cu_seqlens_q,
    cu_seqlens_k, plan)`` returns ``(out, lse)``; gradients flow to q, k, v and the sinks.

    This class is the split form (forward, then setup_context) that torch.func's transforms need;
    its apply binds the arguments through a signature on every call. Outside the transforms
    :meth:`run` takes :class:`EagerAttentionStep`, the same computation in the one-step form, which binds
    nothing and keeps the forward's internal tensors (aux, rng_state) on the context instead of
    returning them as outputs that autograd would have to wrap (:class:`EagerAttentionDirect` where the
    plan has ``fwd_args``; its C++ twin, the extension's ``attention_direct``, where the plan also has
    the extension's ``direct`` options)."""

    @staticmethod
    def forward(q, k, v, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan):
        out, lse, aux, rng_state = forward(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, plan)
        return (out, lse, aux) if rng_state is None else (out, lse, aux, rng_state)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan = inputs
        out, lse, aux = output[:3]
        rng_state = output[3] if len(output) > 3 else None
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, sinks)
        ctx.side = (aux, rng_state, plan)
        ctx.mark_non_differentiable(*output[2:])
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlse, *unused):
        return (*_grads(ctx, dout, dlse), None, None, None, None)

    @staticmethod
    def run(q, k, v, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan):
        if _functorch_active():
            return EagerAttention.apply(q, k, v, sinks, alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan)[:2]
        if plan.fwd_args is not None:
            if plan.direct is not None:  # the same node in C++ (the extension's attention_direct)
                return _ext.require().attention_direct(q, k, v, plan.direct)
            return apply_direct(q, k, v, plan)
        return apply_step(q, k, v, sinks, (alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan))


class EagerAttentionStep(torch.autograd.Function):
    """The one-step form of :class:`EagerAttention`. Its inputs are q, k, v, sinks (those that may
    get a gradient) and one tuple of the rest: each input costs the apply time, and these get no
    gradient. The slopes and cu_seqlens are still saved (so that a change to them before the
    backward is detected)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, rest):
        alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan = rest
        out, lse, aux, rng_state = forward(q, k, v, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k, plan)
        # The sinks are saved only where their gradient is wanted (sinks_grad reads them).
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                              sinks if sinks is not None and sinks.requires_grad else None)
        ctx.side = (aux, rng_state, plan)
        # Unused outputs then arrive as None instead of a zero tensor: no dlse is passed (and nothing
        # is allocated for it) when only `out` is differentiated.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_grads(ctx, dout, dlse), None)


class EagerAttentionDirect(torch.autograd.Function):
    """The one-step form for a plan with ``fwd_args`` (a dense call without ALiBi slopes, sinks or
    dropout that has rows and keys): inputs q, k, v and the plan (each input costs the apply time,
    forward and backward), the extension called with the plan's arguments, only q, k, v, out, lse
    saved."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        out, lse, aux = _ext.require().fwd(q, k, v, *plan.fwd_args)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.side = (aux, plan)
        ctx.set_materialize_grads(False)  # (as in EagerAttentionStep)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_direct_grads(ctx, dout, dlse), None)


_functorch_active = torch._C._are_functorch_transforms_active
# The C++ apply, as Function.apply calls it outside transforms (the one-step forms have nothing to bind):
# ``apply_step(q, k, v, sinks, (alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan))`` -> (out, lse).
apply_step = super(torch.autograd.Function, EagerAttentionStep).apply
# ``apply_direct(q, k, v, plan)`` -> (out, lse), for a plan with fwd_args. Public for
# flash_cuda.interface.attention's fast path, which checks _are_functorch_transforms_active first.
apply_direct = super(torch.autograd.Function, EagerAttentionDirect).apply
