"""A stand-in ``flash_attn.cute`` (FlashAttention-4) on CPU, for the tests of bench/'s fa4 provider:
``flash_attn_func`` / ``flash_attn_varlen_func`` with FA4's layouts and keywords (``learnable_sink`` too), computed by
flash_cuda.reference in float32. ``install(monkeypatch)`` puts it in sys.modules."""

from __future__ import annotations

import sys
import types

from flash_cuda import reference as ref


def _window(window_size) -> tuple:
    return tuple(-1 if w is None else w for w in window_size)


def make_module(bshd: bool = True, calls: list | None = None) -> types.ModuleType:
    """The module; ``bshd=False`` reads (B, S, H, D) tensors as (B, H, S, D) (the bench's check must catch it);
    ``calls`` collects (function name, q's shape, q contiguous, keywords) per call."""
    def flip(t):
        return t.transpose(1, 2) if bshd else t

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                        softcap=0.0, **kw):
        if calls is not None:
            calls.append(("flash_attn_func", tuple(q.shape), q.is_contiguous(),
                          {"causal": causal, "window_size": window_size, "softcap": softcap,
                           **({"learnable_sink": learnable_sink} if learnable_sink is not None else {}), **kw}))
        out, lse = ref.attention_naive(*(flip(t).float() for t in (q, k, v)), is_causal=causal, scale=softmax_scale,
                                       window_size=_window(window_size), softcap=softcap, sinks=learnable_sink)
        return flip(out).to(q.dtype), lse  # FA4 returns (out, lse) here: the bench takes element 0

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                               softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                               softcap=0.0, **kw):
        if calls is not None:
            calls.append(("flash_attn_varlen_func", tuple(q.shape), q.is_contiguous(),
                          {"causal": causal, "window_size": window_size, "softcap": softcap,
                           **({"learnable_sink": learnable_sink} if learnable_sink is not None else {}), **kw}))
        out = ref.attention_varlen_naive(*(t.float() for t in (q, k, v)), cu_seqlens_q, cu_seqlens_k,
                                         is_causal=causal, scale=softmax_scale, window_size=_window(window_size),
                                         softcap=softcap, sinks=learnable_sink)[0]
        return out.to(q.dtype)  # a plain tensor: the bench takes both forms

    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_func, module.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    return module


def install(monkeypatch, module: types.ModuleType | None) -> None:
    """``module`` as flash_attn.cute for the test; None: the import fails (FA4 not installed)."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
