"""Attention sinks (``sinks=``) through the Python layer on CPU: validation and its messages,
the conversion to what the binding takes (float32, contiguous), the custom ops and the eager
path, d(sinks) from lse / out / dout against torch.autograd on flash_cuda.reference, the empty
problems answered without a launch, torch.compile and opcheck. The extension is the CPU
stand-in of tests/conftest.py (mock_extension: the blocked reference behind the ``_C``
contract, its ``fwd`` taking ``sinks``).
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda import ops
from flash_cuda import reference as R

from attn_check import make_inputs, make_varlen_inputs

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def _sinks(Hq, seed=0, dtype=F32, with_minus_inf=True):
    g = torch.Generator().manual_seed(seed)
    s = 1.0 + 1.5 * torch.randn(Hq, generator=g, dtype=torch.float64)
    if with_minus_inf and Hq > 1:
        s[-1] = float("-inf")
    return s.to(dtype)


def _leaves(*ts):
    return tuple(t.detach().clone().requires_grad_() for t in ts)


def _paths(monkeypatch, path):
    if path == "op":  # the torch.library ops instead of the eager autograd Functions
        monkeypatch.setattr(ops, "eager_ok", lambda *t: False)


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("bad,exc,words", [
    ([0.0, 1.0, 2.0, 3.0], TypeError, "sinks must be None or a floating tensor of shape (4,)"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "got dtype int32"),
    (torch.zeros(5), ValueError, "got shape (5,)"),
    (torch.zeros(1, 4), ValueError, "got shape (1, 4)"),
    (torch.zeros(()), ValueError, "got shape ()"),
])
def test_sinks_are_validated(mock_extension, varlen, bad, exc, words):
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((5, 7), (6, 3), 4, 2, 16, F32, "cpu")
        call = lambda s: flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, sinks=s)  # noqa: E731
        prefix = "flash_cuda.varlen_attention: "
    else:
        q, k, v = make_inputs(1, 4, 2, 5, 6, 16, F32, "cpu")
        call = lambda s: flash_cuda.attention(q, k, v, sinks=s)  # noqa: E731
        prefix = "flash_cuda.attention: "
    with pytest.raises(exc) as info:
        call(bad)
    assert str(info.value).startswith(prefix) and words in str(info.value), str(info.value)
    assert mock_extension.fwd_calls == 0


def test_sinks_on_another_device_are_refused(mock_extension):
    q, k, v = make_inputs(1, 4, 2, 5, 6, 16, F32, "cpu")
    with pytest.raises(RuntimeError, match="sinks must be on the same device as q"):
        flash_cuda.attention(q, k, v, sinks=torch.zeros(4, device="meta"))


def test_binding_gets_float32_contiguous_sinks(mock_extension):
    """Any floating dtype and stride is accepted; the binding gets float32 and contiguous."""
    q, k, v = make_inputs(1, 4, 2, 9, 11, 16, F32, "cpu", seed=3)
    wide = _sinks(8, seed=1, dtype=BF16, with_minus_inf=False)
    strided = wide[::2]
    out = flash_cuda.attention(q, k, v, sinks=strided)
    got = mock_extension.last_fwd_sinks
    assert got.dtype == F32 and got.is_contiguous() and torch.equal(got, strided.float())
    ref, _ = R.attention_naive(q.double(), k.double(), v.double(), sinks=strided.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    flash_cuda.attention(q, k, v)
    assert mock_extension.last_fwd_sinks is None  # no sinks: the binding's default


# ---------------------------------------------------------------------------------------
# Forward and d(sinks) against torch.autograd on the reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("is_causal,window,Sq,Sk", [(False, (-1, -1), 19, 23), (True, (-1, -1), 30, 17),
                                                    (False, (4, 0), 26, 12)])
def test_dense_forward_and_gradients(mock_extension, monkeypatch, path, with_dlse, is_causal, window, Sq, Sk):
    """GQA; rows without a key (causal / window with Sq > Sk) included: their out is 0, their
    lse the sink, and their sink's share 1 enters d(sinks)."""
    _paths(monkeypatch, path)
    q, k, v = make_inputs(2, 6, 2, Sq, Sk, 16, F32, "cpu", layout="bshd", seed=Sq)
    s = _sinks(6, seed=Sq)
    lq, lk, lv, ls = _leaves(q, k, v, s)
    out, lse = flash_cuda.attention(lq, lk, lv, is_causal=is_causal, window_size=window, sinks=ls, return_lse=True)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    outs, gouts = ((out, lse), (dout, dlse)) if with_dlse else ((out,), (dout,))
    grads = torch.autograd.grad(outs, (lq, lk, lv, ls), gouts)

    rq, rk, rv, rs = _leaves(q.double(), k.double(), v.double(), s.double())
    ro, rl = R.attention_naive(rq, rk, rv, is_causal=is_causal, window_size=window, sinks=rs)
    routs = (ro, rl) if with_dlse else (ro,)
    rgrads = torch.autograd.grad(routs, (rq, rk, rv, rs), tuple(t.double() for t in gouts))
    torch.testing.assert_close(out.double(), ro, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], rl[finite], rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        assert a.dtype == F32, name
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=name)
    assert float(grads[3][-1]) == 0.0  # a -inf sink
    assert float(grads[3][:-1].abs().min()) > 0


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["plain", "dropout"])
def test_packed_forward_and_gradients(mock_extension, monkeypatch, path, dropout):
    """A packed batch with an empty sequence and one without keys; with dropout the mock draws
    the kernels' mask (the reference is given the same one)."""
    _paths(monkeypatch, path)
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((7, 0, 9, 13), (11, 5, 0, 13), 4, 2, 16, F32, "cpu", seed=4)
    s = _sinks(4, seed=2)
    lq, lk, lv, ls = _leaves(q, k, v, s)
    out, lse = flash_cuda.varlen_attention(lq, lk, lv, cu_q, cu_k, mq, mk, is_causal=True, sinks=ls, return_lse=True,
                                           dropout_p=dropout)
    g = torch.Generator().manual_seed(6)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    grads = torch.autograd.grad((out, lse), (lq, lk, lv, ls), (dout, dlse))

    drop = {}
    if dropout:
        seed, offset = (int(x) for x in mock_extension.last_rng.tolist())
        drop = dict(dropout_p=dropout, dropout_masks=R.dropout_keep_masks_varlen(cu_q, cu_k, 4, dropout, seed=seed,
                                                                                 offset=offset))
    rq, rk, rv, rs = _leaves(q.double(), k.double(), v.double(), s.double())
    ro, rl = R.attention_varlen_naive(rq, rk, rv, cu_q, cu_k, is_causal=True, sinks=rs, **drop)
    rgrads = torch.autograd.grad((ro, rl), (rq, rk, rv, rs), (dout.double(), dlse.double()))
    torch.testing.assert_close(out.double(), ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), rl, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=name)
    # the third sequence has no key: out 0, lse its head's sink (-inf for the last head)
    rows = slice(7, 16)
    assert bool((out[rows] == 0).all())
    assert torch.equal(lse[:, rows], s.view(4, 1).expand(4, 9))


def test_sinks_grad_formula_matches_the_reference():
    """ops.sinks_grad (dense and packed layouts) against reference._sinks_grad."""
    g = torch.Generator().manual_seed(0)
    B, Hq, Sq, D = 2, 3, 5, 8
    out = torch.randn(B, Hq, Sq, D, generator=g)
    dout = torch.randn(B, Hq, Sq, D, generator=g)
    lse = torch.randn(B, Hq, Sq, generator=g) + 2
    lse[0, 1, 2] = float("-inf")
    dlse = torch.randn(B, Hq, Sq, generator=g)
    s = torch.tensor([0.5, -1.0, float("-inf")])
    TOL = dict(rtol=1e-5, atol=1e-5)  # float32 against float64
    delta = (dout.double() * out.double()).sum(-1) - dlse.double()
    expected = R._sinks_grad(s.double(), lse.double(), delta)
    torch.testing.assert_close(ops.sinks_grad(s, out, dout, lse, dlse, varlen=False).double(), expected, **TOL)
    # packed: out (total_q, Hq, D), lse (Hq, total_q); the batch's rows side by side
    packed_out = out.permute(0, 2, 1, 3).reshape(B * Sq, Hq, D)
    packed_dout = dout.permute(0, 2, 1, 3).reshape(B * Sq, Hq, D)
    packed = lambda t: t.permute(1, 0, 2).reshape(Hq, B * Sq)  # noqa: E731
    torch.testing.assert_close(
        ops.sinks_grad(s, packed_out, packed_dout, packed(lse), packed(dlse), varlen=True).double(), expected, **TOL)
    # no dout (only lse used) and no dlse (only out used)
    torch.testing.assert_close(ops.sinks_grad(s, out, None, lse, dlse, varlen=False).double(),
                               R._sinks_grad(s.double(), lse.double(), -dlse.double()), **TOL)
    torch.testing.assert_close(ops.sinks_grad(s, out, dout, lse, None, varlen=False).double(),
                               R._sinks_grad(s.double(), lse.double(), delta + dlse.double()), **TOL)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_gradient_of_the_sinks_alone(mock_extension, monkeypatch, path):
    """Only the sinks require a gradient: it comes from lse, out and dout, with no backward
    launch; in the sinks' own dtype."""
    _paths(monkeypatch, path)
    q, k, v = make_inputs(1, 4, 2, 12, 9, 16, F32, "cpu", seed=8)
    s = _sinks(4, seed=3, dtype=BF16).requires_grad_()
    out, lse = flash_cuda.attention(q, k, v, sinks=s, return_lse=True)
    (out.sum() + 0.5 * lse.sum()).backward()
    assert mock_extension.bwd_calls == 0
    assert s.grad is not None and s.grad.dtype == BF16
    rs = s.detach().double().requires_grad_()
    ro, rl = R.attention_naive(q.double(), k.double(), v.double(), sinks=rs)
    (ro.sum() + 0.5 * rl.sum()).backward()
    torch.testing.assert_close(s.grad.double(), rs.grad, rtol=1e-2, atol=1e-2)


def test_sinks_without_grad_run_the_inference_path(mock_extension):
    q, k, v = make_inputs(1, 4, 2, 12, 9, 16, F32, "cpu", seed=8)
    out = flash_cuda.attention(q, k, v, sinks=_sinks(4))
    assert out.grad_fn is None and mock_extension.fwd_calls == 1


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_empty_problems_give_the_sink(mock_extension, varlen):
    """No key at all: answered without a launch, out 0 and lse the sinks; d(sinks) is the sum
    of dlse over the head's rows (the sink's share is 1, out is 0)."""
    s = _sinks(4, seed=5).requires_grad_()
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((3, 4), (0, 0), 4, 2, 16, F32, "cpu")
        q.requires_grad_()
        out, lse = flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, sinks=s, return_lse=True)
        expected_lse = s.detach().view(4, 1).expand(4, 7)
    else:
        q, k, v = make_inputs(2, 4, 2, 3, 0, 16, F32, "cpu")
        q.requires_grad_()
        out, lse = flash_cuda.attention(q, k, v, sinks=s, return_lse=True)
        expected_lse = s.detach().view(1, 4, 1).expand(2, 4, 3)
    assert mock_extension.fwd_calls == 0
    assert bool((out == 0).all()) and torch.equal(lse, expected_lse)
    dlse = torch.randn(lse.shape, generator=torch.Generator().manual_seed(1))
    (out.sum() + (lse * dlse).sum()).backward()
    finite = torch.isfinite(s.detach())
    expected = (dlse.sum(dim=1) if varlen else dlse.sum(dim=(0, 2))) * finite
    torch.testing.assert_close(s.grad, expected)
    assert bool((q.grad == 0).all())


def test_minus_inf_sinks_are_no_sinks(mock_extension):
    q, k, v = make_inputs(2, 4, 2, 13, 17, 16, F32, "cpu", seed=9)
    a = flash_cuda.attention(q, k, v, is_causal=True, return_lse=True)
    b = flash_cuda.attention(q, k, v, is_causal=True, return_lse=True, sinks=torch.full((4,), -math.inf))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------
# torch.compile and opcheck
# ---------------------------------------------------------------------------------------


def test_compile_fullgraph_with_sinks_cpu_mock(mock_extension):
    q, k, v = make_inputs(2, 4, 2, 20, 15, 16, F32, "cpu", seed=2)
    s = _sinks(4, seed=6)

    def f(q, k, v, s):
        return flash_cuda.attention(q, k, v, is_causal=True, sinks=s, return_lse=True)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    le, lc = _leaves(q, k, v, s), _leaves(q, k, v, s)
    oe, lse_e = f(*le)
    oc, lse_c = cf(*lc)
    assert torch.equal(oe, oc) and torch.equal(lse_e, lse_c)
    dout, dlse = torch.randn_like(oe), torch.randn_like(lse_e)
    ge = torch.autograd.grad((oe, lse_e), le, (dout, dlse))
    gc = torch.autograd.grad((oc, lse_c), lc, (dout, dlse))
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dropout", [False, True], ids=["fwd", "fwd_dropout"])
def test_opcheck_with_sinks_cpu_mock(mock_extension, dropout):
    q, k, v = make_inputs(1, 4, 2, 11, 14, 16, F16, "cpu", seed=3)
    s = _sinks(4, seed=7)
    opts = (0.25, -1, 0, 0.0, None, False, 0)
    if dropout:  # opcheck compares runs that draw different masks: the draw is the same at p = 1
        torch.library.opcheck(torch.ops.flash_cuda.fwd_dropout.default, (q, k, v) + opts + (1.0, s),
                              test_utils=("test_schema", "test_faketensor"))
        return
    torch.library.opcheck(torch.ops.flash_cuda.fwd.default, (q, k, v) + opts + (s,))
    torch.library.opcheck(torch.ops.flash_cuda.fwd.default, _leaves(q, k, v) + opts + _leaves(s))
    torch.library.opcheck(torch.ops.flash_cuda.fwd.default, (q, k, v) + opts + _leaves(s))
