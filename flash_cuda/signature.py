"""Validation that costs next to nothing once a call's signature is known.

A training or decode loop calls attention with the same shapes, strides, dtypes, devices and
options every step, and the full checks of :mod:`flash_cuda.validation` (some twenty functions)
cost more host time than the kernels' launch. So the outcome of the checks, a :class:`Plan`, is
kept per signature of the arguments: everything the checks read (each tensor's shape, strides,
dtype and device, the ALiBi slopes' requires_grad, the options' values), never the tensors'
values, which the checks do not read either. Whether q, k, v require grad is no part of it: the
path that depends on it is chosen per call. A known signature skips the checks; a new one (or
one that fails) runs them all, so every error is raised as before, with the same message.

Only plain eager calls use the cache (the caller checks ``ops.eager_ok``) and only with options of
the exact types the checks accept as they are (None / int / float scale, int / float softcap and
dropout, a tuple of two ints, bools, a str kernel, int max_seqlen): anything else, whose equality
may not mean "accepted alike" (``True == 1``), runs the full checks on every call. What a call
must still do per call (the ALiBi slopes' and the sinks' conversions, the values of cu_seqlens
when asked for) the plan says, and the caller does.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _ext, validation
from .options import PREFIX, VARLEN_PREFIX

__all__ = ["Plan", "PlanCache", "dense_plans", "plan_attention", "plan_varlen", "check_attention", "check_varlen"]


class Plan(NamedTuple):
    """What the checks of a call found, in the form the extension takes it (on the eager path the
    score options are the binding's Python float / int already), and what remains per call."""
    scale: float
    window_left: int
    window_right: int
    softcap: float
    deterministic: bool
    tier: int
    dropout_p: float = 0.0
    max_seqlen_q: int = 0  # the packed layout's bounds; 0 for the dense one, as the binding takes it
    max_seqlen_k: int = 0
    varlen: bool = False
    empty: bool = False  # no row, or no key: answered without a launch (eager path only)
    fix_alibi: bool = True  # the slopes need .detach().contiguous()
    fix_sinks: bool = True  # the sinks need .to(float32).contiguous()
    fix_cu: bool = True  # cu_seqlens need .contiguous()
    check_cu_seqlens: bool = False  # the argument (the environment variable is read per call)
    # The extension's arguments after q, k, v (fwd) and after dout, q, k, v, out, lse, aux, dlse up to
    # need_dq / need_dkdv (bwd) for an eager dense call without ALiBi slopes, sinks or dropout that has
    # rows and keys: the direct calls of flash_cuda.interface.attention and flash_cuda.eager. None for
    # any other call (those take the general path).
    fwd_args: Optional[tuple] = None
    bwd_args: Optional[tuple] = None
    # The same options as one object of the extension (_ext.direct_plan), for its fwd_direct /
    # bwd_direct entries, which cost the host less per call; None where the module has none.
    direct: object = None


class PlanCache(dict):
    """Plans by signature. A loop meets a handful of signatures; prompts of many lengths add one
    each, hence the bound: a full cache is emptied and refilled at one full check per signature."""

    def __init__(self, limit: int = 256):
        super().__init__()
        self.limit = limit

    def keep(self, key, plan):
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _simple(scale, window_size, softcap, dropout_p, kernel, is_causal, return_lse, deterministic) -> bool:
    """Whether the options may enter a signature (see the module's docstring)."""
    return ((scale is None or type(scale) is float or type(scale) is int)
            and (type(softcap) is float or type(softcap) is int)
            and (type(dropout_p) is float or type(dropout_p) is int)
            and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int
            and (is_causal is False or is_causal is True) and (return_lse is False or return_lse is True)
            and (deterministic is False or deterministic is True) and type(kernel) is str)


def _sinks_plain(sinks) -> bool:
    return sinks.dtype is torch.float32 and sinks.stride(0) == 1


def _alibi_plain(alibi_slopes) -> bool:
    return not alibi_slopes.requires_grad and alibi_slopes.is_contiguous()


def check_attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes, return_lse, deterministic,
                    kernel, dropout_p, sinks, eager: bool) -> Plan:
    """Every check of :func:`flash_cuda.attention`'s arguments, in the documented order. On the op
    path (``eager`` false, also while tracing) the values stay as the checks return them (maybe
    symbolic) and the side tensors are converted unconditionally."""
    opts, tier = validation.validate(q, k, v, scale=scale, is_causal=is_causal, window_size=window_size,
                                     softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse,
                                     deterministic=deterministic, kernel=kernel)
    dropout_p = validation.check_dropout(dropout_p, kernel)
    if sinks is not None:
        validation.check_aux_devices(q, PREFIX, sinks=validation.check_sinks(sinks, q.shape[1]))
    if not eager:
        return Plan(*opts[:4], deterministic, tier, dropout_p)
    empty = q.shape[0] == 0 or q.shape[2] == 0 or k.shape[2] == 0
    direct = alibi_slopes is None and sinks is None and not dropout_p and not empty
    return Plan(*opts[:4], deterministic, tier, dropout_p, empty=empty,
                fix_alibi=alibi_slopes is not None and not _alibi_plain(alibi_slopes),
                fix_sinks=sinks is not None and not _sinks_plain(sinks), fix_cu=False,
                fwd_args=(*opts[:4], None, None, None, 0, 0, tier) if direct else None,
                bwd_args=(*opts[:4], None, None, None, 0, 0, deterministic, tier) if direct else None,
                direct=_ext.direct_plan(*opts[:4], tier, deterministic) if direct else None)


# Public: flash_cuda.interface.attention looks a repeated call's plan up here itself (its fast path).
dense_plans = PlanCache()
_varlen_plans = PlanCache()


def plan_attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes, return_lse, deterministic,
                   kernel, dropout_p, sinks) -> Plan:
    """:func:`check_attention` for plain eager tensors, kept per signature. The device check in
    use is part of the key: replacing it (tests do, to run CPU tensors) never lets an outcome of
    one version serve the other."""
    if not _simple(scale, window_size, softcap, dropout_p, kernel, is_causal, return_lse, deterministic):
        return check_attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes, return_lse,
                               deterministic, kernel, dropout_p, sinks, True)
    try:  # (flash_cuda.interface.attention's fast path builds this key too; a test holds both the same)
        key = (validation.check_device, q.shape, q.stride(), q.dtype, q.device,
               k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device,
               None if alibi_slopes is None else _meta(alibi_slopes), None if sinks is None else _meta(sinks),
               is_causal, scale, window_size, softcap, return_lse, deterministic, kernel, dropout_p)
    except RuntimeError:  # a layout without strides (sparse, nested): the checks say what is wrong
        return check_attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes, return_lse,
                               deterministic, kernel, dropout_p, sinks, True)
    plan = dense_plans.get(key)
    if plan is None:
        plan = dense_plans.keep(key, check_attention(q, k, v, is_causal, scale, window_size, softcap, alibi_slopes,
                                                      return_lse, deterministic, kernel, dropout_p, sinks, True))
    return plan


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window_size,
                 softcap, alibi_slopes, return_lse, deterministic, kernel, check_cu_seqlens, dropout_p, sinks,
                 eager: bool) -> Plan:
    """Every check of :func:`flash_cuda.varlen_attention`'s arguments but the values of cu_seqlens
    (those the forward checks, when asked for), in the documented order; ``eager`` as in
    :func:`check_attention`."""
    opts, tier, max_q, max_k = validation.validate_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, is_causal=is_causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse,
        deterministic=deterministic, kernel=kernel, check_cu_seqlens=check_cu_seqlens)
    dropout_p = validation.check_dropout(dropout_p, kernel, VARLEN_PREFIX)
    if sinks is not None:
        validation.check_aux_devices(q, VARLEN_PREFIX, sinks=validation.check_sinks(sinks, q.shape[1], VARLEN_PREFIX))
    if not eager:
        return Plan(*opts[:4], deterministic, tier, dropout_p, max_q, max_k, True)
    empty = q.shape[0] == 0 or k.shape[0] == 0 or cu_seqlens_q.shape[0] <= 1 or max_q == 0 or max_k == 0
    return Plan(*opts[:4], deterministic, tier, dropout_p, max_q, max_k, True, empty,
                fix_alibi=alibi_slopes is not None and not _alibi_plain(alibi_slopes),
                fix_sinks=sinks is not None and not _sinks_plain(sinks),
                fix_cu=not (cu_seqlens_q.stride(0) == 1 and cu_seqlens_k.stride(0) == 1),
                check_cu_seqlens=check_cu_seqlens)


def plan_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window_size,
                softcap, alibi_slopes, return_lse, deterministic, kernel, check_cu_seqlens, dropout_p,
                sinks) -> Plan:
    """:func:`check_varlen` for plain eager tensors, kept per signature (as :func:`plan_attention`)."""
    if not (_simple(scale, window_size, softcap, dropout_p, kernel, is_causal, return_lse, deterministic)
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int
            and (check_cu_seqlens is False or check_cu_seqlens is True)):
        return check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                            window_size, softcap, alibi_slopes, return_lse, deterministic, kernel, check_cu_seqlens,
                            dropout_p, sinks, True)
    try:
        key = (validation.check_device, q.shape, q.stride(), q.dtype, q.device,
               k.shape, k.stride(), k.dtype, k.device,
               v.shape, v.stride(), v.dtype, v.device, _meta(cu_seqlens_q), _meta(cu_seqlens_k),
               max_seqlen_q, max_seqlen_k, None if alibi_slopes is None else _meta(alibi_slopes),
               None if sinks is None else _meta(sinks),
               is_causal, scale, window_size, softcap, return_lse, deterministic, kernel, check_cu_seqlens, dropout_p)
    except RuntimeError:  # as in plan_attention
        return check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                            window_size, softcap, alibi_slopes, return_lse, deterministic, kernel, check_cu_seqlens,
                            dropout_p, sinks, True)
    plan = _varlen_plans.get(key)
    if plan is None:
        plan = _varlen_plans.keep(key, check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                    is_causal, scale, window_size, softcap, alibi_slopes, return_lse,
                                                    deterministic, kernel, check_cu_seqlens, dropout_p, sinks, True))
    return plan
