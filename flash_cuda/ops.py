"""The custom ops around the compiled extension, their fake (meta) versions and their autograd
formula, whose backward :mod:`flash_cuda.eager` (the same extension calls without the ops'
dispatch, for plain eager tensors) shares.

* ``flash_cuda::fwd`` / ``::bwd`` (dense 4-D inputs), ``::varlen_fwd`` / ``::varlen_bwd``
  (packed 3-D inputs with cu_seqlens), and the forwards with attention dropout
  ``::fwd_dropout`` / ``::varlen_fwd_dropout``: ``torch.library`` custom ops around the
  extension's two entry points (``fwd`` / ``bwd``, which take the dense or the packed
  layout). Each has a fake implementation, so ``torch.compile(fullgraph=True)`` traces
  through them without a graph break, and the forward ops have an autograd formula that
  calls the backward op for the gradients autograd asks for alone (dQ, or dK and dV, or all
  three).
* The forward ops return (out, lse, aux): aux is the extension's opaque per-row softmax
  statistics (float32 lse.shape + (2,) for float32 inputs, empty (0,) otherwise), saved for
  the backward with out and lse and handed back to it unchanged.
* Empty problems (no batch entry, no query row or no key) are answered here without a
  kernel launch.
* Attention sinks (gpt-oss's learned per-head logit, ``sinks``: float32 ``(Hq,)``, the last,
  optional argument of every forward op) enter the kernels' softmax; their gradient needs no
  kernel: the backward ops run unchanged with the sink-including lse, and d(sinks) comes from
  lse, out and dout here (:func:`sinks_grad`).
* The ``*_impl`` functions are the extension calls behind the ops; they take the validated
  :class:`~flash_cuda.validation.ScoreOptions`. The ops' schemas take plain values, so an op
  call spreads the options (``*opts``) and the op body gathers them again.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _ext
from .signature import Plan
from .validation import ScoreOptions, check_cu_seqlens_enabled, check_cu_seqlens_values

__all__ = ["fwd", "bwd", "fwd_dropout", "varlen_fwd", "varlen_bwd", "varlen_fwd_dropout", "attention_grads", "eager_ok"]


def _aux_shape(dtype: torch.dtype, lse_shape) -> Tuple[int, ...]:
    return tuple(lse_shape) + (2,) if dtype == torch.float32 else (0,)


def _fwd_fake_outputs(q: Tensor, lse_shape) -> Tuple[Tensor, Tensor, Tensor]:
    return (torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32),
            q.new_empty(_aux_shape(q.dtype, lse_shape), dtype=torch.float32))


def empty_fwd(q: Tensor, lse_shape, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Every row sees no key (or there are no rows): out 0, lse -inf (with sinks: the row's
    head's sink, the only term of its softmax); nothing launched."""
    if sinks is None:
        lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    else:
        heads = sinks.detach().to(torch.float32)
        lse = (heads.view(1, -1, 1) if len(lse_shape) == 3 else heads.view(-1, 1)).expand(lse_shape).contiguous()
    return (torch.zeros_like(q), lse,
            torch.zeros(_aux_shape(q.dtype, lse_shape), dtype=torch.float32, device=q.device))


def _sinks_kwargs(sinks: Optional[Tensor]) -> dict:
    """The extension's ``sinks`` keyword: none without sinks."""
    return {} if sinks is None else {"sinks": sinks}


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


# ---------------------------------------------------------------------------------------
# The extension calls behind the ops, shared by the ops and the eager path (below)
# ---------------------------------------------------------------------------------------


def fwd_impl(q, k, v, opts: ScoreOptions, tier, sinks: Optional[Tensor] = None, sm_margin: int = 0):
    """sm_margin: SMs a persistent launch leaves free for kernels that run beside it (the ring's
    transfers)."""
    if _is_empty(q, k):
        return empty_fwd(q, _dense_lse_shape(q), sinks)
    kw = _sinks_kwargs(sinks)
    if sm_margin:
        kw["sm_margin"] = int(sm_margin)
    return _ext.require().fwd(q, k, v, *opts.ext_args(), None, None, 0, 0, int(tier), **kw)


# need_dq / need_dkdv: which gradients to compute (dK and dV come from the same products, so
# they go together); one not computed is None, and the extension neither allocates nor works on it.
def _empty_grads(q, k, v, need_dq, need_dkdv):
    """The gradients of a call with no query row or no key: zeros, None where not wanted."""
    return (torch.zeros_like(q) if need_dq else None, torch.zeros_like(k) if need_dkdv else None,
            torch.zeros_like(v) if need_dkdv else None)


def dropout_kwargs(dropout_p, rng_state) -> dict:
    """The extension's dropout keywords for a backward: none without dropout."""
    return {"dropout_p": float(dropout_p), "rng_state": rng_state} if dropout_p else {}


def new_rng_state(q: Tensor) -> Tensor:
    """Where a forward with dropout records the (seed, offset) of its draws for the backward."""
    return torch.zeros(2, dtype=torch.int64, device=q.device)


def bwd_impl(dout, q, k, v, out, lse, aux, dlse, opts: ScoreOptions, deterministic, tier, need_dq=True,
             need_dkdv=True, dropout_p=0.0, rng_state=None):
    if _is_empty(q, k):
        return _empty_grads(q, k, v, need_dq, need_dkdv)
    return _ext.require().bwd(dout, q, k, v, out, lse, aux, dlse, *opts.ext_args(), None, None, 0, 0,
                              bool(deterministic), int(tier), bool(need_dq), bool(need_dkdv),
                              **dropout_kwargs(dropout_p, rng_state))


def fwd_dropout_impl(q, k, v, opts: ScoreOptions, tier, dropout_p, sinks: Optional[Tensor] = None):
    """The forward with dropout: (out, lse, aux, rng_state), rng_state the (seed, offset) of the
    draws (int64 [2]) for the backward."""
    rng_state = new_rng_state(q)
    if _is_empty(q, k):
        return (*empty_fwd(q, _dense_lse_shape(q), sinks), rng_state)
    out, lse, aux = _ext.require().fwd(q, k, v, *opts.ext_args(), None, None, 0, 0, int(tier),
                                       dropout_p=float(dropout_p), rng_state=rng_state, **_sinks_kwargs(sinks))
    return out, lse, aux, rng_state


def varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts: ScoreOptions, tier,
                    check_cu_seqlens, sinks: Optional[Tensor] = None):
    if check_cu_seqlens_enabled(check_cu_seqlens):
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                max_seqlen_q, max_seqlen_k)
    if _is_empty_varlen(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        return empty_fwd(q, _varlen_lse_shape(q), sinks)
    return _ext.require().fwd(q, k, v, *opts.ext_args(), cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                              int(max_seqlen_k), int(tier), **_sinks_kwargs(sinks))


def varlen_fwd_dropout_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts: ScoreOptions,
                            tier, check_cu_seqlens, dropout_p, sinks: Optional[Tensor] = None):
    """The packed forward with dropout: (out, lse, aux, rng_state)."""
    rng_state = new_rng_state(q)
    if check_cu_seqlens_enabled(check_cu_seqlens):
        check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                max_seqlen_q, max_seqlen_k)
    if _is_empty_varlen(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        return (*empty_fwd(q, _varlen_lse_shape(q), sinks), rng_state)
    out, lse, aux = _ext.require().fwd(q, k, v, *opts.ext_args(), cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                       int(max_seqlen_k), int(tier), dropout_p=float(dropout_p),
                                       rng_state=rng_state, **_sinks_kwargs(sinks))
    return out, lse, aux, rng_state


def varlen_bwd_impl(dout, q, k, v, out, lse, aux, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, opts: ScoreOptions, deterministic, tier, need_dq=True, need_dkdv=True,
                    dropout_p=0.0, rng_state=None):
    if _is_empty_varlen(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k):
        return _empty_grads(q, k, v, need_dq, need_dkdv)
    return _ext.require().bwd(dout, q, k, v, out, lse, aux, dlse, *opts.ext_args(), cu_seqlens_q, cu_seqlens_k,
                              int(max_seqlen_q), int(max_seqlen_k), bool(deterministic), int(tier),
                              bool(need_dq), bool(need_dkdv), **dropout_kwargs(dropout_p, rng_state))


# ---------------------------------------------------------------------------------------
# The custom ops (plain-valued schemas) and their fakes
# ---------------------------------------------------------------------------------------


@torch.library.custom_op("flash_cuda::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, scale: float, window_left: int, window_right: int,
        softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
        tier: int, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Forward: returns (out, lse, aux). ``deterministic`` is only read by the backward.
    ``sinks``: None or the attention sinks, float32 (Hq,), contiguous."""
    opts = ScoreOptions(scale, window_left, window_right, softcap, alibi_slopes)
    out, lse, aux = fwd_impl(q, k, v, opts, tier, sinks)
    return out, lse, aux


@fwd.register_fake
def _fwd_fake(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic,
              tier, sinks=None):
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
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: Tensor,
        dlse: Optional[Tensor], scale: float, window_left: int, window_right: int,
        softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool,
        tier: int, need_dq: bool = True, need_dkdv: bool = True, dropout_p: float = 0.0,
        rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Backward: returns (dq, dk, dv); ``dlse`` is the optional upstream gradient of lse.
    ``need_dq`` / ``need_dkdv`` say which gradients to compute; the others are empty (0,).
    With dropout, ``rng_state`` is the forward's record of its draws."""
    opts = ScoreOptions(scale, window_left, window_right, softcap, alibi_slopes)
    grads = bwd_impl(dout, q, k, v, out, lse, aux, dlse, opts, deterministic, tier, need_dq, need_dkdv,
                     dropout_p, rng_state)
    return _op_grads(q, k, v, grads, need_dq, need_dkdv)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap,
              alibi_slopes, deterministic, tier, need_dq=True, need_dkdv=True, dropout_p=0.0, rng_state=None):
    return _bwd_fake_outputs(q, k, v, need_dq, need_dkdv)


@torch.library.custom_op("flash_cuda::fwd_dropout", mutates_args=())
def fwd_dropout(q: Tensor, k: Tensor, v: Tensor, scale: float, window_left: int, window_right: int,
                softcap: float, alibi_slopes: Optional[Tensor], deterministic: bool, tier: int,
                dropout_p: float, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward with attention dropout: (out, lse, aux, rng_state)."""
    opts = ScoreOptions(scale, window_left, window_right, softcap, alibi_slopes)
    return fwd_dropout_impl(q, k, v, opts, tier, dropout_p, sinks)


@fwd_dropout.register_fake
def _fwd_dropout_fake(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier,
                      dropout_p, sinks=None):
    return (*_fwd_fake_outputs(q, _dense_lse_shape(q)), q.new_empty((2,), dtype=torch.int64))


@torch.library.custom_op("flash_cuda::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, scale: float, window_left: int,
               window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
               deterministic: bool, tier: int,
               check_cu_seqlens: bool, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Packed forward: returns (out (total_q, Hq, D), lse (Hq, total_q), aux).

    With ``check_cu_seqlens`` (or FLASH_CUDA_CHECK_CU_SEQLENS=1) the values of cu_seqlens
    are checked here, at run time (also inside a compiled graph), before any launch."""
    opts = ScoreOptions(scale, window_left, window_right, softcap, alibi_slopes)
    out, lse, aux = varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, tier,
                                    check_cu_seqlens, sinks)
    return out, lse, aux


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                     window_left, window_right, softcap, alibi_slopes, deterministic, tier,
                     check_cu_seqlens, sinks=None):
    return _fwd_fake_outputs(q, _varlen_lse_shape(q))


@torch.library.custom_op("flash_cuda::varlen_bwd", mutates_args=())
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               aux: Tensor, dlse: Optional[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, scale: float, window_left: int,
               window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
               deterministic: bool, tier: int, need_dq: bool = True,
               need_dkdv: bool = True, dropout_p: float = 0.0,
               rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Packed backward: returns (dq, dk, dv) shaped like (q, k, v), empty (0,) where not
    wanted (``need_dq`` / ``need_dkdv``)."""
    opts = ScoreOptions(scale, window_left, window_right, softcap, alibi_slopes)
    grads = varlen_bwd_impl(dout, q, k, v, out, lse, aux, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, opts, deterministic, tier, need_dq, need_dkdv, dropout_p, rng_state)
    return _op_grads(q, k, v, grads, need_dq, need_dkdv)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, aux, dlse, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, scale, window_left, window_right, softcap,
                     alibi_slopes, deterministic, tier, need_dq=True, need_dkdv=True, dropout_p=0.0,
                     rng_state=None):
    return _bwd_fake_outputs(q, k, v, need_dq, need_dkdv)


@torch.library.custom_op("flash_cuda::varlen_fwd_dropout", mutates_args=())
def varlen_fwd_dropout(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                       max_seqlen_q: int, max_seqlen_k: int, scale: float, window_left: int,
                       window_right: int, softcap: float, alibi_slopes: Optional[Tensor],
                       deterministic: bool, tier: int, check_cu_seqlens: bool,
                       dropout_p: float, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Packed forward with attention dropout: (out, lse, aux, rng_state)."""
    opts = ScoreOptions(scale, window_left, window_right, softcap, alibi_slopes)
    return varlen_fwd_dropout_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, opts, tier,
                                   check_cu_seqlens, dropout_p, sinks)


@varlen_fwd_dropout.register_fake
def _varlen_fwd_dropout_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                             window_left, window_right, softcap, alibi_slopes, deterministic, tier,
                             check_cu_seqlens, dropout_p, sinks=None):
    return (*_fwd_fake_outputs(q, _varlen_lse_shape(q)), q.new_empty((2,), dtype=torch.int64))


# ---------------------------------------------------------------------------------------
# Autograd: one backward for both layouts (and for the eager path, flash_cuda.eager)
# ---------------------------------------------------------------------------------------


def sinks_grad(sinks: Tensor, out: Tensor, dout: Optional[Tensor], lse: Tensor, dlse: Optional[Tensor],
               varlen: bool, acc: torch.dtype = torch.float32) -> Tensor:
    """d(sinks) (Hq,) in ``acc`` (float32, as the kernels add up; the CPU ring's float64 blocks
    pass float64) from the forward's out and lse and the upstream gradients
    (either may be None). Each row's sink takes the share P = exp(sink - lse) of its softmax:
    d lse / d sink = P and d p_ij / d sink = -p_ij P, so that
    d sink_h = sum over the rows of head h (every batch entry) of P * (dlse - rowsum(dout * out)).
    A row with lse = -inf (no key and a -inf sink) contributes 0. Dense: out (B, Hq, Sq, D),
    lse (B, Hq, Sq); packed: out (total_q, Hq, D), lse (Hq, total_q)."""
    lse = lse.to(acc)
    heads = sinks.detach().to(acc)
    sink = heads.view(-1, 1) if varlen else heads.view(1, -1, 1)
    no_mass = lse == float("-inf")
    p = torch.where(no_mass, torch.zeros_like(lse), torch.exp(sink - torch.where(no_mass, torch.zeros_like(lse), lse)))
    g = torch.zeros_like(lse) if dlse is None else dlse.to(acc)
    if dout is not None:
        rowsum = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, Hq, Sq) or (total_q, Hq)
        g = g - (rowsum.t() if varlen else rowsum)
    return (p * g).sum(dim=1) if varlen else (p * g).sum(dim=(0, 2))


def attention_grads(plan: Plan, saved, need_q: bool, need_k: bool, need_v: bool, need_sinks: bool,
                    dout: Optional[Tensor], dlse: Optional[Tensor], eager: bool):
    """(dq, dk, dv, dsinks), None where not asked for, from the forward's saved tensors ``(q, k, v,
    out, lse, aux, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state, sinks)`` and the upstream
    gradients (None for an output not differentiated). Only the gradients asked for are computed
    (and allocated): dK and dV together, as they come from the same products. ``eager``: the
    extension directly (plain eager tensors, ``plan`` from flash_cuda.signature), else the ops."""
    q, k, v, out, lse, aux, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state, sinks = saved
    if dout is not None and dout.stride(-1) != 1:
        dout = dout.contiguous()
    if dlse is not None and (dlse.dtype is not torch.float32 or not dlse.is_contiguous()):
        dlse = dlse.to(torch.float32).contiguous()
    dsinks = sinks_grad(sinks, out, dout, lse, dlse, plan.varlen) if need_sinks else None
    need_dkdv = need_k or need_v
    if not (need_q or need_dkdv):
        return None, None, None, dsinks
    if dout is None:
        dout = torch.zeros_like(out)
    if eager:
        if plan.empty:
            dq, dk, dv = _empty_grads(q, k, v, need_q, need_dkdv)
        else:
            dq, dk, dv = _ext.require().bwd(
                dout, q, k, v, out, lse, aux, dlse, plan.scale, plan.window_left, plan.window_right, plan.softcap,
                alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k, plan.deterministic,
                plan.tier, need_q, need_dkdv, **dropout_kwargs(plan.dropout_p, rng_state))
    else:
        opts = (plan.scale, plan.window_left, plan.window_right, plan.softcap, alibi_slopes)
        rest = (plan.deterministic, plan.tier, need_q, need_dkdv, plan.dropout_p, rng_state)
        if plan.varlen:
            dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, aux, dlse, cu_seqlens_q, cu_seqlens_k,
                                    plan.max_seqlen_q, plan.max_seqlen_k, *opts, *rest)
        else:
            dq, dk, dv = bwd(dout, q, k, v, out, lse, aux, dlse, *opts, *rest)
    return dq if need_q else None, dk if need_k else None, dv if need_v else None, dsinks


def _save(ctx, inputs, output, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan: Plan, sinks_at: int):
    """sinks_at: where the op's inputs hold the sinks (their last argument, which may be left out)."""
    out, lse, aux = output[:3]
    rng_state = output[3] if plan.dropout_p else None
    sinks = inputs[sinks_at] if len(inputs) > sinks_at else None
    ctx.save_for_backward(q, k, v, out, lse, aux, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state, sinks)
    ctx.num_inputs = len(inputs)
    ctx.sinks_at = None if sinks is None else sinks_at
    ctx.plan = plan
    if rng_state is not None:
        ctx.mark_non_differentiable(rng_state)
    ctx.mark_non_differentiable(aux)
    # Unused outputs then arrive as None instead of a zero tensor: no dlse is passed
    # (and nothing is allocated for it) when only `out` is differentiated.
    ctx.set_materialize_grads(False)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier = inputs[:10]
    plan = Plan(scale, window_left, window_right, softcap, deterministic, tier)
    _save(ctx, inputs, output, q, k, v, alibi_slopes, None, None, plan, 10)


def _dropout_setup_context(ctx, inputs, output):
    q, k, v, scale, window_left, window_right, softcap, alibi_slopes, deterministic, tier, dropout_p = inputs[:11]
    plan = Plan(scale, window_left, window_right, softcap, deterministic, tier, dropout_p)
    _save(ctx, inputs, output, q, k, v, alibi_slopes, None, None, plan, 11)


def _varlen_setup(ctx, inputs, output, dropout: bool):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
     window_right, softcap, alibi_slopes, deterministic, tier, check_cu_seqlens) = inputs[:15]
    plan = Plan(scale, window_left, window_right, softcap, deterministic, tier, inputs[15] if dropout else 0.0,
                max_seqlen_q, max_seqlen_k, varlen=True)
    _save(ctx, inputs, output, q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k, plan, 16 if dropout else 15)


def _varlen_setup_context(ctx, inputs, output):
    _varlen_setup(ctx, inputs, output, dropout=False)


def _varlen_dropout_setup_context(ctx, inputs, output):
    _varlen_setup(ctx, inputs, output, dropout=True)


def _backward(ctx, dout, dlse, *unused):
    needs = ctx.needs_input_grad
    need_sinks = ctx.sinks_at is not None and needs[ctx.sinks_at]
    grads = [None] * ctx.num_inputs  # the other inputs: no gradient
    if needs[0] or needs[1] or needs[2] or need_sinks:
        dq, dk, dv, dsinks = attention_grads(ctx.plan, ctx.saved_tensors, needs[0], needs[1], needs[2], need_sinks,
                                             dout, dlse, eager=False)
        grads[:3] = dq, dk, dv
        if need_sinks:
            grads[ctx.sinks_at] = dsinks
    return tuple(grads)


fwd.register_autograd(_backward, setup_context=_setup_context)
fwd_dropout.register_autograd(_backward, setup_context=_dropout_setup_context)
varlen_fwd.register_autograd(_backward, setup_context=_varlen_setup_context)
varlen_fwd_dropout.register_autograd(_backward, setup_context=_varlen_dropout_setup_context)


# Bound once: eager_ok runs on every call, and these attribute chains cost more than the checks.
_is_compiling = torch.compiler.is_compiling
_function_mode_enabled = torch._C._is_torch_function_mode_enabled
_dispatch_stack_len = torch._C._len_torch_dispatch_stack


def eager_ok(*tensors) -> bool:
    """Whether a call on these tensors (None allowed) may skip the ops' dispatch
    (:mod:`flash_cuda.eager`): plain tensors, outside tracing, function and dispatch modes. Anything
    the ops exist for (tracing, fake or functional tensors, tensor subclasses, modes) takes the ops."""
    if _is_compiling() or _function_mode_enabled() or _dispatch_stack_len():
        return False
    for t in tensors:
        if t is not None and type(t) is not Tensor:
            return False
    return True
