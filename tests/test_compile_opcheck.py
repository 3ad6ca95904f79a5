"""The custom ops under torch.compile and torch.library.opcheck, and the autograd wiring.

* GPU tests (skipped without a GPU): torch.compile(fullgraph=True) forward + backward
  equals eager, also inside a small model and with dynamic shapes; opcheck of
  flash_cuda::fwd and flash_cuda::bwd over dtypes, causal, GQA, layouts, dlse.
* CPU tests (always run): the same Python layer driven by the mock extension of
  conftest.py (the blocked reference behind the ``_C`` contract): opcheck, compile with
  the aot_eager backend, gradcheck of the registered autograd formula, dlse / dout
  handling, and empty sizes answered without a kernel call.
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda.reference import attention_naive

from attn_check import make_inputs

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
gpu = pytest.mark.gpu

FWD = torch.ops.flash_cuda.fwd.default
BWD = torch.ops.flash_cuda.bwd.default


def _leaf(*ts):
    return tuple(t.detach().requires_grad_() for t in ts)


def _opcheck_all(q, k, v, scale, is_causal, tier, with_dlse):
    """opcheck of fwd (with and without requires_grad) and of bwd (with/without dlse)."""
    torch.library.opcheck(FWD, (q, k, v, scale, is_causal, False, tier))
    torch.library.opcheck(FWD, _leaf(q, k, v) + (scale, is_causal, False, tier))
    out, lse = torch.ops.flash_cuda.fwd(q, k, v, scale, is_causal, False, tier)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(BWD, (dout, q, k, v, out, lse, dlse, scale, is_causal, False, tier))
    torch.library.opcheck(BWD, (dout, q, k, v, out, lse, dlse, scale, is_causal, True, tier))


def _compile_vs_eager(q, k, v, *, is_causal, backend, dynamic=False):
    """The compiled graph runs the same ops on the same tensors: the forward must match
    bitwise; the gradients too up to (never expected) reordering in the compiled backward."""
    def f(q, k, v):
        return flash_cuda.attention(q, k, v, is_causal=is_causal, return_lse=True)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend=backend, dynamic=dynamic)
    qe, ke, ve = _leaf(q, k, v)
    qc, kc, vc = _leaf(q, k, v)
    out_e, lse_e = f(qe, ke, ve)
    out_c, lse_c = cf(qc, kc, vc)
    assert out_c.shape == out_e.shape and out_c.dtype == out_e.dtype
    assert out_c.stride() == out_e.stride()
    assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e)
    dout = torch.randn_like(out_e)
    dlse = torch.randn_like(lse_e)
    ge = torch.autograd.grad((out_e, lse_e), (qe, ke, ve), (dout, dlse))
    gc = torch.autograd.grad((out_c, lse_c), (qc, kc, vc), (dout, dlse))
    for a, b in zip(gc, ge):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------

GPU_CASES = [(F16, False, 1, "bhsd"), (F16, True, 4, "bshd"), (BF16, True, 2, "strided"),
             (BF16, False, 8, "bshd"), (F32, True, 2, "bhsd"), (F32, False, 1, "offset")]


@gpu
@pytest.mark.parametrize("dtype,is_causal,groups,layout", GPU_CASES)
def test_compile_fullgraph_matches_eager_gpu(dtype, is_causal, groups, layout):
    q, k, v = make_inputs(2, 2 * groups, 2, 100, 130, 64, dtype, "cuda", layout=layout, seed=groups)
    _compile_vs_eager(q, k, v, is_causal=is_causal, backend="inductor")


@gpu
@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_compile_dynamic_shapes_gpu(dtype):
    for sq, sk in ((64, 64), (100, 37), (37, 300)):
        q, k, v = make_inputs(1, 4, 2, sq, sk, 64, dtype, "cuda", seed=sq)
        _compile_vs_eager(q, k, v, is_causal=True, backend="inductor", dynamic=True)


class _TinyAttentionBlock(torch.nn.Module):
    def __init__(self, dim=128, heads=4, kv_heads=2):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.d)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.d).transpose(1, 2)
        kv = self.kv(x).view(B, S, 2, self.hkv, self.d)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        y = flash_cuda.attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, S, -1))


@gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_compile_model_gpu(dtype):
    torch.manual_seed(0)
    model = _TinyAttentionBlock().cuda().to(dtype)
    x = torch.randn(2, 77, 128, device="cuda", dtype=dtype)
    torch._dynamo.reset()
    cmodel = torch.compile(model, fullgraph=True)
    y_e = model(x)
    y_e.float().square().mean().backward()
    grads_e = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y_c = cmodel(x)
    y_c.float().square().mean().backward()
    tol = 1e-4 if dtype == F32 else 2e-2
    torch.testing.assert_close(y_c, y_e, rtol=tol, atol=tol)
    for a, p in zip(grads_e, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=tol, atol=tol * a.abs().max().item())


@gpu
@pytest.mark.parametrize("dtype,is_causal,groups,layout", GPU_CASES)
def test_opcheck_gpu(dtype, is_causal, groups, layout):
    q, k, v = make_inputs(2, 2 * groups, 2, 70, 45, 64, dtype, "cuda", layout=layout, seed=groups)
    _opcheck_all(q, k, v, 0.125, is_causal, 0, with_dlse=groups % 2 == 0)


@gpu
@pytest.mark.parametrize("dtype,tier", [(F32, 1), (F16, 2), (BF16, 2)])
def test_opcheck_explicit_tier_gpu(dtype, tier):
    q, k, v = make_inputs(1, 4, 1, 33, 65, 128, dtype, "cuda", seed=tier)
    _opcheck_all(q, k, v, 0.3, True, tier, with_dlse=True)


@gpu
@pytest.mark.parametrize("B,Sq,Sk", [(0, 8, 8), (1, 0, 8), (1, 8, 0)])
def test_opcheck_empty_gpu(B, Sq, Sk):
    q, k, v = make_inputs(B, 2, 1, Sq, Sk, 64, F16, "cuda")
    _opcheck_all(q, k, v, 0.125, True, 0, with_dlse=True)


# ---------------------------------------------------------------------------------------
# CPU, through the mock extension
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,is_causal,groups,layout",
                         [(F16, True, 2, "bshd"), (F32, False, 1, "strided")])
def test_opcheck_cpu_mock(mock_extension, dtype, is_causal, groups, layout):
    q, k, v = make_inputs(1, 2 * groups, 2, 21, 34, 16, dtype, "cpu", layout=layout, seed=1)
    _opcheck_all(q, k, v, 0.25, is_causal, 0, with_dlse=True)


def test_opcheck_empty_cpu_mock(mock_extension):
    q, k, v = make_inputs(1, 2, 1, 8, 0, 16, F16, "cpu")
    _opcheck_all(q, k, v, 0.25, True, 0, with_dlse=True)
    assert mock_extension.fwd_calls == 0 and mock_extension.bwd_calls == 0


@pytest.mark.parametrize("dtype,is_causal,layout", [(BF16, True, "bshd"), (F32, False, "bhsd")])
def test_compile_fullgraph_cpu_mock(mock_extension, dtype, is_causal, layout):
    q, k, v = make_inputs(2, 4, 2, 40, 23, 16, dtype, "cpu", layout=layout, seed=2)
    _compile_vs_eager(q, k, v, is_causal=is_causal, backend="aot_eager")


def test_compile_dynamic_and_scale_argument_cpu_mock(mock_extension):
    def f(q, k, v, scale):
        return flash_cuda.attention(q, k, v, is_causal=True, scale=scale)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for sq, sk, scale in ((16, 16, 0.3), (21, 40, 0.7), (40, 21, None), (9, 9, 2)):
        q, k, v = make_inputs(1, 2, 1, sq, sk, 16, F32, "cpu", seed=sq)
        torch.testing.assert_close(cf(q, k, v, scale), f(q, k, v, scale), rtol=0, atol=0)


def test_compile_rejects_bad_input_cpu_mock(mock_extension):
    """Validation still runs while tracing."""
    def f(q, k, v):
        return flash_cuda.attention(q, k, v)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    q, k, v = make_inputs(1, 3, 2, 8, 8, 16, F32, "cpu")
    with pytest.raises(Exception, match="multiple of the number of key/value heads"):
        cf(q, k, v)


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck_registered_autograd_cpu_mock(mock_extension, is_causal):
    """Numerical gradients of the fwd op (float64 through the mock) match the registered
    backward, for out and lse (dlse path) together."""
    q, k, v = make_inputs(1, 2, 1, 6, 5, 8, F64, "cpu", seed=3)
    q, k, v = _leaf(q, k, v)

    def f(q, k, v):
        out, lse = torch.ops.flash_cuda.fwd(q, k, v, 0.4, is_causal, False, 0)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    # lse is float32 whatever the input dtype, so the finite differences use a large eps
    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-3,
                                    fast_mode=True)


def test_autograd_matches_reference_cpu_mock(mock_extension):
    q, k, v = make_inputs(2, 4, 2, 30, 45, 16, F32, "cpu", layout="bshd", seed=4)
    qf, kf, vf = _leaf(q, k, v)
    out, lse = flash_cuda.attention(qf, kf, vf, is_causal=True, scale=0.2, return_lse=True)
    q64, k64, v64 = _leaf(q.double(), k.double(), v.double())
    o64, l64 = attention_naive(q64, k64, v64, is_causal=True, scale=0.2)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    g = torch.autograd.grad((out, lse), (qf, kf, vf), (dout, dlse))
    g64 = torch.autograd.grad((o64, l64), (q64, k64, v64), (dout.double(), dlse.double()))
    for a, b in zip(g, g64):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_dlse_none_when_lse_unused_cpu_mock(mock_extension):
    q, k, v = _leaf(*make_inputs(1, 2, 2, 10, 10, 16, F32, "cpu"))
    out, lse = flash_cuda.attention(q, k, v, return_lse=True)
    out.sum().backward()
    assert mock_extension.last_bwd_dlse is None
    out, lse = flash_cuda.attention(q, k, v, return_lse=True)
    (out.sum() + lse.sum()).backward()  # expanded (stride-0) dlse arrives contiguous
    assert isinstance(mock_extension.last_bwd_dlse, torch.Tensor)


def test_lse_only_loss_cpu_mock(mock_extension):
    """A loss on lse alone: dout is None in the backward and becomes zeros."""
    q, k, v = _leaf(*make_inputs(1, 2, 1, 12, 9, 16, F64, "cpu", seed=6))
    _, lse = torch.ops.flash_cuda.fwd(q, k, v, 0.25, False, False, 0)
    g = torch.autograd.grad(lse.sum(), (q, k, v))
    q64, k64, v64 = _leaf(q, k, v)
    _, l64 = attention_naive(q64, k64, v64, scale=0.25)
    g64 = torch.autograd.grad(l64.sum(), (q64, k64))
    assert (g[2] == 0).all()  # lse does not depend on v
    for a, b in zip(g, g64):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # lse is stored in float32


def test_noncontiguous_dout_cpu_mock(mock_extension):
    q, k, v = _leaf(*make_inputs(1, 2, 2, 12, 12, 16, F32, "cpu"))
    out = flash_cuda.attention(q, k, v)
    w = torch.randn(1, 2, 16, 12).transpose(-1, -2)  # stride(-1) != 1
    g = torch.autograd.grad(out, (q, k, v), w)  # the mock asserts dout.stride(-1) == 1
    out2 = flash_cuda.attention(q, k, v)
    g2 = torch.autograd.grad(out2, (q, k, v), w.contiguous())
    for a, b in zip(g, g2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("B,Sq,Sk", [(0, 5, 5), (2, 0, 5), (2, 5, 0), (0, 0, 0)])
def test_empty_sizes_cpu_mock(mock_extension, B, Sq, Sk):
    q, k, v = _leaf(*make_inputs(B, 4, 2, Sq, Sk, 16, BF16, "cpu", layout="bshd"))
    out, lse = flash_cuda.attention(q, k, v, is_causal=True, return_lse=True)
    assert out.shape == q.shape and out.dtype == BF16 and out.stride() == torch.empty_like(q).stride()
    assert lse.shape == (B, 4, Sq) and lse.dtype == F32
    assert (out == 0).all() and (lse == -math.inf).all()
    (out.float().sum() + lse.clamp(min=0).sum()).backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()
    assert mock_extension.fwd_calls == 0 and mock_extension.bwd_calls == 0


def test_scale_and_tier_reach_extension_cpu_mock(mock_extension, monkeypatch):
    seen = {}
    fwd = mock_extension.fwd

    def spy(q, k, v, scale, is_causal, tier):
        seen.update(scale=scale, is_causal=is_causal, tier=tier)
        return fwd(q, k, v, scale, is_causal, tier)

    from flash_cuda import _ext
    monkeypatch.setattr(_ext._C, "fwd", spy)
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64, F32, "cpu")
    flash_cuda.attention(q, k, v)
    assert seen == {"scale": 1 / math.sqrt(64), "is_causal": False, "tier": 0}
    flash_cuda.attention(q, k, v, scale=2, is_causal=True, kernel="simt")
    assert seen == {"scale": 2.0, "is_causal": True, "tier": 1}
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64, F16, "cpu")
    flash_cuda.attention(q, k, v, kernel="mma")
    assert seen["tier"] == 2
