"""The validation outcome kept per signature of the arguments (flash_cuda.signature), on CPU with
the mock extension: a repeated call skips the checks, a known signature still rejects every bad
argument with the message of the full checks, values the checks never read (cu_seqlens' values,
requires_grad) are judged per call, and the side tensors are converted as the kernels take them.
"""

from __future__ import annotations

import pytest
import torch

import flash_cuda
from flash_cuda import interface, ops, signature, validation

from attn_check import cu_seqlens_from_lengths

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DENSE = "flash_cuda.attention: "
VARLEN = "flash_cuda.varlen_attention: "


def qkv(B=2, Hq=4, Hkv=2, Sq=5, Sk=7, D=16, dtype=F32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, h, s, D, generator=g).to(dtype) for h, s in ((Hq, Sq), (Hkv, Sk), (Hkv, Sk)))


def packed(lens_q=(3, 0, 5), lens_k=(4, 2, 5), Hq=4, Hkv=2, D=16, dtype=F32):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lens_q), Hq, D, generator=g).to(dtype)
    k, v = (torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v, cu_seqlens_from_lengths(lens_q, "cpu"), cu_seqlens_from_lengths(lens_k, "cpu"), max(lens_q), max(lens_k)


@pytest.fixture
def count_checks(mock_extension, monkeypatch):
    """Counts the full checks of attention (validate) and varlen_attention (validate_varlen)."""
    counts = {"dense": 0, "varlen": 0}
    real_dense, real_varlen = validation.validate, validation.validate_varlen

    def dense(*args, **kw):
        counts["dense"] += 1
        return real_dense(*args, **kw)

    def varlen(*args, **kw):
        counts["varlen"] += 1
        return real_varlen(*args, **kw)

    monkeypatch.setattr(validation, "validate", dense)
    monkeypatch.setattr(validation, "validate_varlen", varlen)
    yield counts


def test_repeated_call_skips_checks(count_checks):
    q, k, v = qkv()
    for _ in range(3):
        flash_cuda.attention(q, k, v, is_causal=True)
    assert count_checks["dense"] == 1
    flash_cuda.attention(q.clone(), k.clone(), v.clone(), is_causal=True)  # other tensors, same signature
    assert count_checks["dense"] == 1
    flash_cuda.attention(q, k, v, is_causal=False)
    flash_cuda.attention(q[:1], k[:1], v[:1], is_causal=True)
    assert count_checks["dense"] == 3
    args = packed()
    for _ in range(3):
        flash_cuda.varlen_attention(*args, is_causal=True)
    assert count_checks["varlen"] == 1


def test_options_of_other_types_check_every_call(count_checks):
    """A list window or a numpy-like scale is accepted, but never enters a signature."""
    q, k, v = qkv()
    for _ in range(2):
        flash_cuda.attention(q, k, v, window_size=[3, 0])
    assert count_checks["dense"] == 2


def test_op_path_checks_every_call(count_checks, monkeypatch):
    monkeypatch.setattr(ops, "eager_ok", lambda *ts: False)
    q, k, v = qkv()
    for _ in range(2):
        flash_cuda.attention(q, k, v)
    assert count_checks["dense"] == 2


DENSE_BAD = [
    (dict(is_causal=1), TypeError, "is_causal must be a bool"),
    (dict(return_lse=0), TypeError, "return_lse must be a bool"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool"),
    (dict(scale=True), TypeError, "scale must be a finite real number"),
    (dict(scale=float("nan")), ValueError, "scale must be a finite real number, got nan"),
    (dict(window_size=(True, 0)), TypeError, "window_size left must be a Python int"),
    (dict(window_size=(-1, 2), is_causal=True), ValueError, "is_causal=True means no key after"),
    (dict(window_size=(-2, 0)), ValueError, "window_size left must be -1"),
    (dict(softcap=True), TypeError, "softcap must be a finite real number"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite real number >= 0"),
    (dict(kernel="mma"), ValueError, "kernel='mma' is a float16/bfloat16 tensor-core kernel"),
    (dict(kernel="fast"), ValueError, "kernel must be one of"),
    (dict(dropout_p=True), ValueError, "dropout_p must be a number in"),
    (dict(dropout_p=1.5), ValueError, "dropout_p must be a number in"),
    (dict(sinks=torch.zeros(3)), ValueError, "sinks must be a floating tensor of shape \\(4,\\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.int32)), TypeError, "sinks must be a floating tensor"),
    (dict(alibi_slopes=torch.zeros(4, dtype=F16)), TypeError, "alibi_slopes must be a float32 tensor"),
    (dict(alibi_slopes=torch.zeros(3)), ValueError, "alibi_slopes must have shape"),
]


@pytest.mark.parametrize("bad,exc,match", DENSE_BAD)
def test_known_signature_rejects_bad_options(mock_extension, bad, exc, match):
    """Values equal to accepted ones (True == 1, a NaN) and neighbours of accepted ones are
    judged by the full checks, after the good signature is known."""
    q, k, v = qkv()
    good = {name: value for name, value in (("is_causal", False), ("return_lse", False), ("deterministic", False),
                                            ("scale", 1), ("window_size", (1, 0)), ("softcap", 1), ("kernel", "simt"),
                                            ("dropout_p", 1), ("sinks", torch.zeros(4)),
                                            ("alibi_slopes", torch.zeros(4))) if name in bad}
    flash_cuda.attention(q, k, v, **good)
    flash_cuda.attention(q, k, v, **good)
    with pytest.raises(exc, match=match) as info:
        flash_cuda.attention(q, k, v, **bad)
    assert str(info.value).startswith(DENSE)


@pytest.mark.parametrize("which,change,exc,match", [
    ("k", lambda t: t.to(F16), TypeError, "q, k and v must have the same dtype"),
    ("v", lambda t: t[..., :8], ValueError, "same head dim"),
    ("k", lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2), ValueError, "contiguous last dimension"),
    ("q", lambda t: t.to("meta"), RuntimeError, "same device"),
])
def test_known_signature_rejects_bad_tensors(mock_extension, which, change, exc, match):
    q, k, v = qkv()
    flash_cuda.attention(q, k, v)
    args = {"q": q, "k": k, "v": v}
    args[which] = change(args[which])
    with pytest.raises(exc, match=match):
        flash_cuda.attention(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("bad,exc,match", [
    (dict(max_seqlen_q=True), TypeError, "max_seqlen_q must be a Python int"),
    (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be in"),
    (dict(check_cu_seqlens=1), TypeError, "check_cu_seqlens must be a bool"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 3, 8])), TypeError, "cu_seqlens_q must be an int32 tensor"),
    (dict(cu_seqlens_k=torch.tensor([0, 4, 11], dtype=torch.int32)), ValueError, "same length"),
])
def test_known_varlen_signature_rejects_bad_arguments(mock_extension, bad, exc, match):
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=1 if "max_seqlen_q" in bad else max_q,
                max_seqlen_k=max_k)
    args["max_seqlen_q"] = max(args["max_seqlen_q"], max_q)
    flash_cuda.varlen_attention(q, k, v, **args)
    with pytest.raises(exc, match=match) as info:
        flash_cuda.varlen_attention(q, k, v, **{**args, **bad})
    assert str(info.value).startswith(VARLEN)


def test_cu_seqlens_values_checked_every_call(mock_extension):
    """The values of cu_seqlens are no part of a signature: a known one checks them again."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, check_cu_seqlens=True)
    bad = cu_q.clone()
    bad[0] = 1
    with pytest.raises(ValueError, match="bad cu_seqlens_q .*first entry is 1"):
        flash_cuda.varlen_attention(q, k, v, bad, cu_k, max_q, max_k, check_cu_seqlens=True)


def test_replaced_device_check_is_not_served_by_the_cache(no_extension, monkeypatch):
    """An outcome found with one device check never answers for another (the tests replace it to
    run CPU tensors): the real check still rejects CPU tensors afterwards."""
    real = validation.check_device
    q, k, v = qkv()
    monkeypatch.setattr(ops, "eager_ok", lambda *ts: True)
    monkeypatch.setattr(validation, "check_device", lambda q, k, v, prefix=None: None)
    with pytest.raises(RuntimeError, match="not built"):
        flash_cuda.attention(q, k, v)
    monkeypatch.setattr(validation, "check_device", real)
    with pytest.raises(RuntimeError, match="must be CUDA tensors"):
        flash_cuda.attention(q, k, v)


def test_requires_grad_judged_per_call(mock_extension):
    q, k, v = qkv()
    assert flash_cuda.attention(q, k, v).grad_fn is None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_cuda.attention(*leaves)
    assert type(out.grad_fn).__name__.startswith("Eager")
    with torch.no_grad():
        assert flash_cuda.attention(*leaves).grad_fn is None
    dq, dk, dv = torch.autograd.grad(out.sum(), leaves)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_side_tensors_converted_on_known_signatures(mock_extension):
    """The mock asserts what the binding takes: float32 contiguous sinks and slopes, contiguous
    cu_seqlens; slopes that require grad get none."""
    q, k, v = qkv(dtype=BF16)
    slopes = torch.rand(4, 2).t().requires_grad_()  # (2, 4), not contiguous
    sinks = torch.zeros(4, dtype=BF16, requires_grad=True)
    for _ in range(2):
        out = flash_cuda.attention(q, k, v, alibi_slopes=slopes, sinks=sinks)
        assert mock_extension.last_fwd_sinks.dtype == F32
        (ds,) = torch.autograd.grad(out.float().sum(), (sinks,))
        assert ds.dtype == BF16 and slopes.grad is None
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    strided_q = torch.zeros(2 * cu_q.numel(), dtype=torch.int32)[::2].copy_(cu_q)
    for _ in range(2):
        with torch.no_grad():
            flash_cuda.varlen_attention(q, k, v, strided_q, cu_k, max_q, max_k)


def test_plan_cache_is_bounded():
    cache = signature.PlanCache(limit=2)
    for i in range(5):
        cache.keep(i, str(i))
        assert len(cache) <= 2 and cache[i] == str(i)


@pytest.mark.parametrize("options", [dict(), dict(is_causal=True, return_lse=True), dict(window_size=(3, 0), scale=0.5),
                                     dict(softcap=2, deterministic=True, kernel="simt")])
def test_repeated_call_takes_the_fast_path(mock_extension, monkeypatch, options):
    """From the second call of a signature on, attention's own lookup answers (its key is
    signature.plan_attention's, built in flash_cuda.interface): plan_attention, the general path's,
    is not called again, with or without a gradient wanted; and the fast path's outputs and
    gradients are the general path's."""
    calls = []
    real = interface.plan_attention
    monkeypatch.setattr(interface, "plan_attention", lambda *args: calls.append(1) or real(*args))
    q, k, v = qkv()

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        res = flash_cuda.attention(*leaves, **options)
        out = res[0] if isinstance(res, tuple) else res
        with torch.no_grad():
            res_ng = flash_cuda.attention(q, k, v, **options)
        return res, res_ng, torch.autograd.grad(out.sum(), leaves)

    first = run()
    assert len(calls) == 1  # the no_grad call has the autograd call's signature (requires_grad is no part of it)
    for _ in range(2):
        again = run()
        assert len(calls) == 1
    for a, b in zip(first, again):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y)
    res, res_ng = again[:2]
    out, out_ng = (res[0], res_ng[0]) if options.get("return_lse") else (res, res_ng)
    assert type(out.grad_fn).__name__ == "EagerAttentionDirectBackward" and out_ng.grad_fn is None


def test_fast_path_judges_each_call(mock_extension, monkeypatch):
    """A known signature's fast path still takes the general path (and its checks) for anything its
    key does not hold: options of other types, ALiBi slopes, sinks, and a replaced eager_ok."""
    q, k, v = qkv()
    flash_cuda.attention(q, k, v, is_causal=True)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        flash_cuda.attention(q, k, v, is_causal=1)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_cuda.attention(q, k, v, is_causal=True, alibi_slopes=torch.zeros(3))
    monkeypatch.setattr(ops, "eager_ok", lambda *ts: False)
    calls = mock_extension.fwd_calls
    out = flash_cuda.attention(q.clone().requires_grad_(), k, v, is_causal=True)
    assert mock_extension.fwd_calls == calls + 1 and not type(out.grad_fn).__name__.startswith("Eager")
