"""The custom ops under torch.compile and torch.library.opcheck, and the autograd wiring.

* GPU tests (skipped without a GPU): torch.compile(fullgraph=True) forward + backward
  equals eager, also inside a small model and with dynamic shapes; opcheck of
  flash_cuda::fwd / ::bwd over dtypes, causal, GQA, layouts, dlse, and with a sliding
  window, softcap and ALiBi; opcheck and compile of flash_cuda::varlen_fwd / ::varlen_bwd.
* CPU tests (always run): the same Python layer driven by the mock extension of
  conftest.py (the blocked reference behind the ``_C`` contract): opcheck, compile with
  the aot_eager backend (also with the new options and for varlen_attention), gradcheck
  of the registered autograd formulas, dlse / dout handling, empty sizes answered
  without a kernel call, and the gradients asked for alone (the need_dq / need_dkdv flags
  that reach ``_C.bwd`` from autograd's needs_input_grad, eager, through the ops, compiled
  and under torch.func).
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda.reference import attention_naive

from attn_check import make_alibi_slopes, make_inputs, make_varlen_inputs

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
gpu = pytest.mark.gpu

FWD = torch.ops.flash_cuda.fwd.default
BWD = torch.ops.flash_cuda.bwd.default
VFWD = torch.ops.flash_cuda.varlen_fwd.default
VBWD = torch.ops.flash_cuda.varlen_bwd.default


def _leaf(*ts):
    return tuple(t.detach().requires_grad_() for t in ts)


def _op_options(scale, is_causal, window=(-1, -1), softcap=0.0, alibi=None):
    """(scale, window_left, window_right, softcap, alibi_slopes) as the ops take them."""
    left, right = window
    if is_causal:
        right = 0
    return (scale, left, right, float(softcap), alibi)


def _opcheck_all(q, k, v, scale, is_causal, tier, with_dlse, window=(-1, -1), softcap=0.0,
                 alibi=None):
    """opcheck of fwd (with and without requires_grad) and of bwd (with/without dlse)."""
    opts = _op_options(scale, is_causal, window, softcap, alibi)
    torch.library.opcheck(FWD, (q, k, v) + opts + (False, tier))
    torch.library.opcheck(FWD, _leaf(q, k, v) + opts + (False, tier))
    out, lse, aux = torch.ops.flash_cuda.fwd(q, k, v, *opts, False, tier)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(BWD, (dout, q, k, v, out, lse, aux, dlse) + opts + (False, tier))
    torch.library.opcheck(BWD, (dout, q, k, v, out, lse, aux, dlse) + opts + (True, tier))


def _opcheck_varlen_all(q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, tier, with_dlse,
                        window=(-1, -1), softcap=0.0, alibi=None):
    """opcheck of varlen_fwd (with and without requires_grad) and of varlen_bwd."""
    opts = _op_options(scale, is_causal, window, softcap, alibi)
    seq = (cu_q, cu_k, max_q, max_k)
    torch.library.opcheck(VFWD, (q, k, v) + seq + opts + (False, tier, False))
    torch.library.opcheck(VFWD, _leaf(q, k, v) + seq + opts + (False, tier, True))
    out, lse, aux = torch.ops.flash_cuda.varlen_fwd(q, k, v, *seq, *opts, False, tier, False)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    for det in (False, True):
        torch.library.opcheck(VBWD, (dout, q, k, v, out, lse, aux, dlse) + seq + opts + (det, tier))


def _compile_vs_eager(q, k, v, *, is_causal, backend, dynamic=False, **options):
    """The compiled graph runs the same ops on the same tensors: the forward must match
    bitwise; the gradients too up to (never expected) reordering in the compiled backward.
    ``options``: window_size, softcap, alibi_slopes for flash_cuda.attention."""
    def f(q, k, v):
        return flash_cuda.attention(q, k, v, is_causal=is_causal, return_lse=True, **options)

    _compare_compiled(f, (q, k, v), backend=backend, dynamic=dynamic)


def _compare_compiled(f, qkv, *, backend, dynamic=False, extra=()):
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend=backend, dynamic=dynamic)
    qe, ke, ve = _leaf(*qkv)
    qc, kc, vc = _leaf(*qkv)
    out_e, lse_e = f(qe, ke, ve, *extra)
    out_c, lse_c = cf(qc, kc, vc, *extra)
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


def _compile_vs_eager_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, backend, dynamic=False,
                             **options):
    def f(q, k, v, cu_q, cu_k, max_q, max_k):
        return flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True,
                                           **options)

    _compare_compiled(f, (q, k, v), backend=backend, dynamic=dynamic,
                      extra=(cu_q, cu_k, max_q, max_k))


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


# ---- GPU: the new options and packed batches ----

# (dtype, is_causal, window, softcap, alibi kind, groups)
GPU_FEATURE_CASES = [(F16, True, (32, -1), 0.0, "heads", 2), (BF16, False, (17, 9), 5.0, None, 1),
                     (F32, True, (-1, -1), 2.0, "batch", 4), (F32, False, (8, 0), 0.0, "heads", 1)]


def _alibi(kind, B, Hq, device):
    if kind is None:
        return None
    return make_alibi_slopes(Hq, batch=B if kind == "batch" else None, device=device)


@gpu
@pytest.mark.parametrize("dtype,is_causal,window,softcap,alibi,groups", GPU_FEATURE_CASES)
def test_opcheck_features_gpu(dtype, is_causal, window, softcap, alibi, groups):
    q, k, v = make_inputs(2, 2 * groups, 2, 70, 95, 64, dtype, "cuda", layout="bshd", seed=groups)
    _opcheck_all(q, k, v, 0.125, is_causal, 0, with_dlse=groups % 2 == 0, window=window,
                 softcap=softcap, alibi=_alibi(alibi, 2, 2 * groups, "cuda"))


@gpu
@pytest.mark.parametrize("dtype,is_causal,window,softcap,alibi,groups", GPU_FEATURE_CASES)
def test_opcheck_varlen_gpu(dtype, is_causal, window, softcap, alibi, groups):
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((0, 17, 1, 70), (5, 33, 1, 60), 2 * groups, 2,
                                                     64, dtype, "cuda", seed=groups)
    _opcheck_varlen_all(q, k, v, cu_q, cu_k, mq, mk, 0.125, is_causal, 0, with_dlse=True,
                        window=window, softcap=softcap, alibi=_alibi(alibi, 4, 2 * groups, "cuda"))


@gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_compile_features_gpu(dtype):
    q, k, v = make_inputs(2, 4, 2, 100, 130, 64, dtype, "cuda", layout="bshd", seed=5)
    _compile_vs_eager(q, k, v, is_causal=True, backend="inductor", window_size=(40, -1),
                      softcap=3.0, alibi_slopes=make_alibi_slopes(4, batch=2, device="cuda"))


@gpu
@pytest.mark.parametrize("dtype", [F16, F32])
def test_compile_varlen_gpu(dtype):
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((30, 0, 1, 100), (45, 3, 1, 100), 4, 2, 64,
                                                     dtype, "cuda", seed=6)
    _compile_vs_eager_varlen(q, k, v, cu_q, cu_k, mq, mk, backend="inductor", is_causal=True,
                             window_size=(20, -1))


@gpu
def test_compile_varlen_dynamic_gpu():
    """One compiled graph for packed batches of different sizes and max lengths."""
    for lens_q, lens_k in (((30, 1, 64), (30, 1, 64)), ((5, 200), (7, 150)), ((0, 9, 9, 9), (1, 9, 9, 9))):
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, 4, 1, 64, BF16, "cuda",
                                                         seed=len(lens_q))
        _compile_vs_eager_varlen(q, k, v, cu_q, cu_k, mq, mk, backend="inductor", dynamic=True,
                                 is_causal=True)


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


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_eager_path_matches_ops_cpu_mock(mock_extension, monkeypatch, varlen):
    """Plain eager tensors take eager.EagerAttention (no custom-op dispatch);
    the ops, which tracing, fake tensors, subclasses and modes take, must give the same out,
    lse and gradients, bitwise, with dlse flowing too."""
    from flash_cuda import ops

    if varlen:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((7, 0, 19), (11, 5, 13), 4, 2, 16, F32, "cpu", seed=4)

        def run(leaves):
            return flash_cuda.varlen_attention(*leaves, cu_q, cu_k, mq, mk, is_causal=True, window_size=(6, 0),
                                               return_lse=True)
    else:
        q, k, v = make_inputs(2, 4, 2, 19, 23, 16, F32, "cpu", layout="bshd", seed=4)

        def run(leaves):
            return flash_cuda.attention(*leaves, is_causal=True, softcap=3.0, return_lse=True)

    def outputs_and_grads(eager):
        monkeypatch.setattr(ops, "eager_ok", lambda *ts: eager)
        calls = mock_extension.fwd_calls
        leaves = _leaf(q, k, v)
        out, lse = run(leaves)
        assert mock_extension.fwd_calls == calls + 1
        assert type(out.grad_fn).__name__.startswith("Eager") == eager, type(out.grad_fn).__name__
        g = torch.Generator().manual_seed(0)
        grads = torch.autograd.grad((out, lse), leaves, (torch.randn(out.shape, generator=g),
                                                         torch.randn(lse.shape, generator=g)))
        return out, lse, grads

    eager = outputs_and_grads(True)
    ops = outputs_and_grads(False)
    for a, b in zip(eager[:2] + tuple(eager[2]), ops[:2] + tuple(ops[2])):
        assert torch.equal(a, b)
    assert len(eager[2]) == 3


def test_func_grad_matches_autograd_cpu_mock(mock_extension):
    """torch.func.grad through flash_cuda.attention (the eager path's setup_context) gives the
    gradients that torch.autograd.grad gives."""
    q, k, v = make_inputs(1, 2, 1, 9, 13, 16, F32, "cpu", seed=6)

    def loss(q, k, v):
        return (flash_cuda.attention(q, k, v, is_causal=True) ** 2).sum()

    g_func = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = _leaf(q, k, v)
    g_auto = torch.autograd.grad(loss(*leaves), leaves)
    for a, b in zip(g_func, g_auto):
        assert torch.equal(a, b)


def test_eager_path_only_for_plain_eager_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_cuda import ops

    x = torch.zeros(2)
    assert ops.eager_ok(x, None, x)
    with FakeTensorMode():
        assert not ops.eager_ok(torch.zeros(2))
    with torch.overrides.TorchFunctionMode():
        assert not ops.eager_ok(x)


def test_eager_call_binds_no_signature_cpu_mock(mock_extension, monkeypatch):
    """The eager path skips Function.apply's per-call inspect.signature binding (tens of
    microseconds of host time per call; eager.EagerAttention.run), forward and backward,
    dense and packed, and its gradients stay those of the ops."""
    import inspect

    q, k, v = make_inputs(1, 2, 1, 9, 13, 16, F32, "cpu", seed=7)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 13], dtype=torch.int32)
    qv, kv, vv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))

    def calls():
        leaves = _leaf(q, k, v, qv, kv, vv)
        out = flash_cuda.attention(*leaves[:3], is_causal=True)
        out_v = flash_cuda.varlen_attention(*leaves[3:], cu, cu_k, 9, 13, is_causal=True)
        return torch.autograd.grad(out.square().sum() + out_v.square().sum(), leaves)

    expected = calls()

    def no_binding(*args, **kwargs):
        raise AssertionError("inspect.signature called on the eager path")

    monkeypatch.setattr(inspect, "signature", no_binding)
    for a, b in zip(calls(), expected):
        assert torch.equal(a, b)


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
        out, lse, _ = torch.ops.flash_cuda.fwd(q, k, v, *_op_options(0.4, is_causal), False, 0)
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
    _, lse, _ = torch.ops.flash_cuda.fwd(q, k, v, *_op_options(0.25, False), False, 0)
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

    def spy(q, k, v, scale, window_left, window_right, softcap, alibi, cu_q, cu_k, max_q, max_k,
            tier):
        seen.update(scale=scale, window=(window_left, window_right), softcap=softcap,
                    alibi=alibi, tier=tier)
        return fwd(q, k, v, scale, window_left, window_right, softcap, alibi, cu_q, cu_k, max_q,
                   max_k, tier)

    from flash_cuda import _ext
    monkeypatch.setattr(_ext._C, "fwd", spy)
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64, F32, "cpu")
    flash_cuda.attention(q, k, v)
    assert seen == {"scale": 1 / math.sqrt(64), "window": (-1, -1), "softcap": 0.0, "alibi": None,
                    "tier": 0}
    flash_cuda.attention(q, k, v, scale=2, is_causal=True, kernel="simt")
    assert seen == {"scale": 2.0, "window": (-1, 0), "softcap": 0.0, "alibi": None, "tier": 1}
    flash_cuda.attention(q, k, v, is_causal=True, window_size=(5, -1), softcap=3)
    assert seen["window"] == (5, 0) and seen["softcap"] == 3.0 and type(seen["softcap"]) is float
    flash_cuda.attention(q, k, v, window_size=[2, 7])
    assert seen["window"] == (2, 7)
    slopes = torch.tensor([0.5, 0.25])[None].expand(1, 2)  # not contiguous
    flash_cuda.attention(q, k, v, alibi_slopes=slopes)
    assert seen["alibi"].is_contiguous() and torch.equal(seen["alibi"], slopes)
    q, k, v = make_inputs(1, 2, 2, 8, 8, 64, F16, "cpu")
    flash_cuda.attention(q, k, v, kernel="mma")
    assert seen["tier"] == 2


# ---- CPU (mock): the new options and packed batches ----


@pytest.mark.parametrize("dtype,is_causal,window,softcap,alibi", [
    (F16, True, (5, -1), 2.0, "batch"), (F32, False, (3, 4), 0.0, "heads"),
])
def test_opcheck_features_cpu_mock(mock_extension, dtype, is_causal, window, softcap, alibi):
    q, k, v = make_inputs(2, 4, 2, 21, 34, 16, dtype, "cpu", layout="bshd", seed=1)
    _opcheck_all(q, k, v, 0.25, is_causal, 0, with_dlse=True, window=window, softcap=softcap,
                 alibi=_alibi(alibi, 2, 4, "cpu"))


@pytest.mark.parametrize("dtype,is_causal,window,softcap,alibi", [
    (BF16, True, (-1, -1), 0.0, None), (F32, False, (6, 2), 1.5, "batch"),
])
def test_opcheck_varlen_cpu_mock(mock_extension, dtype, is_causal, window, softcap, alibi):
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((0, 9, 1, 20), (4, 13, 1, 17), 4, 2, 16, dtype,
                                                     "cpu", layout="strided", seed=2)
    _opcheck_varlen_all(q, k, v, cu_q, cu_k, mq, mk, 0.3, is_causal, 0, with_dlse=True,
                        window=window, softcap=softcap, alibi=_alibi(alibi, 4, 4, "cpu"))


def test_opcheck_varlen_empty_cpu_mock(mock_extension):
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((3, 4), (0, 0), 2, 1, 16, F32, "cpu")
    _opcheck_varlen_all(q, k, v, cu_q, cu_k, mq, mk, 0.25, True, 0, with_dlse=True)
    assert mock_extension.fwd_calls == 0 and mock_extension.bwd_calls == 0


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_compile_features_cpu_mock(mock_extension, dtype):
    q, k, v = make_inputs(2, 4, 2, 40, 23, 16, dtype, "cpu", layout="bshd", seed=2)
    _compile_vs_eager(q, k, v, is_causal=True, backend="aot_eager", window_size=(9, -1),
                      softcap=2.5, alibi_slopes=make_alibi_slopes(4, batch=2, device="cpu"))


@pytest.mark.parametrize("dtype", [F16, F32])
def test_compile_varlen_cpu_mock(mock_extension, dtype):
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((11, 0, 1, 30), (20, 3, 1, 30), 4, 2, 16, dtype,
                                                     "cpu", seed=3)
    _compile_vs_eager_varlen(q, k, v, cu_q, cu_k, mq, mk, backend="aot_eager", is_causal=True,
                             window_size=(5, -1), softcap=1.0,
                             alibi_slopes=make_alibi_slopes(4, device="cpu"))


def test_compile_varlen_dynamic_cpu_mock(mock_extension):
    """dynamic=True: cu_seqlens sizes and max_seqlen ints traced symbolically."""
    def f(q, k, v, cu_q, cu_k, max_q, max_k):
        return flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for lens_q, lens_k in (((3, 9), (3, 9)), ((5, 0, 12), (7, 2, 12)), ((1,), (20,))):
        args = make_varlen_inputs(lens_q, lens_k, 2, 1, 16, F32, "cpu", seed=len(lens_q))
        torch.testing.assert_close(cf(*args), f(*args), rtol=0, atol=0)


def test_compile_varlen_rejects_bad_input_cpu_mock(mock_extension):
    def f(q, k, v, cu_q, cu_k):
        return flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, 9, 9)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    q, k, v, cu_q, cu_k, _, _ = make_varlen_inputs((3, 9), (3, 9), 2, 1, 16, F32, "cpu")
    with pytest.raises(Exception, match="must be an int32 tensor"):
        cf(q, k, v, cu_q.long(), cu_k)


@pytest.mark.parametrize("is_causal,window,softcap,alibi", [(True, (2, -1), 0.0, "heads"),
                                                            (False, (1, 2), 0.8, "batch")])
def test_gradcheck_features_cpu_mock(mock_extension, is_causal, window, softcap, alibi):
    """Numerical gradients of the fwd op with the new options (float64 through the mock)."""
    q, k, v = _leaf(*make_inputs(2, 2, 1, 6, 5, 8, F64, "cpu", seed=3))
    opts = _op_options(0.7, is_causal, window, softcap, _alibi(alibi, 2, 2, "cpu"))

    def f(q, k, v):
        out, lse, _ = torch.ops.flash_cuda.fwd(q, k, v, *opts, False, 0)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-3, fast_mode=True)


def test_gradcheck_varlen_cpu_mock(mock_extension):
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((0, 3, 1, 5), (2, 4, 1, 0), 2, 1, 8, F64, "cpu",
                                                     seed=4)
    q, k, v = _leaf(q, k, v)
    opts = _op_options(0.5, True, (2, -1), 1.0, make_alibi_slopes(2, batch=4, device="cpu"))

    def f(q, k, v):
        out, lse, _ = torch.ops.flash_cuda.varlen_fwd(q, k, v, cu_q, cu_k, mq, mk, *opts, False, 0,
                                                      False)
        return out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-3, fast_mode=True)


def test_aux_is_saved_and_returned_unchanged_cpu_mock(mock_extension):
    """The fp32 forward's aux reaches the backward untouched (the mock asserts it); 16-bit
    inputs get an empty aux."""
    for dtype, aux_shape in ((F32, (1, 2, 9, 2)), (F16, (0,)), (BF16, (0,))):
        q, k, v = _leaf(*make_inputs(1, 2, 1, 9, 12, 16, dtype, "cpu"))
        out, lse, aux = torch.ops.flash_cuda.fwd(q, k, v, *_op_options(0.3, True), False, 0)
        assert tuple(aux.shape) == aux_shape and aux.dtype == F32 and not aux.requires_grad
        torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
        args = make_varlen_inputs((4, 5), (6, 7), 2, 1, 16, dtype, "cpu")
        out, lse, aux = torch.ops.flash_cuda.varlen_fwd(*args, *_op_options(0.3, False), False, 0,
                                                        False)
        assert tuple(aux.shape) == ((2, 9, 2) if dtype == F32 else (0,))


# ---- CPU (mock): only the gradients autograd asks for ----

# Which of (q, k, v) require grad, and the (need_dq, need_dkdv) the extension must then get:
# dK and dV come from the same products, so either one asks for both.
GRAD_SUBSETS = [((True, False, False), (True, False)), ((False, True, False), (False, True)),
                ((False, False, True), (False, True)), ((False, True, True), (False, True)),
                ((True, False, True), (True, True)), ((True, True, True), (True, True))]


def _subset_leaves(tensors, wanted):
    return tuple(t.detach().requires_grad_(w) for t, w in zip(tensors, wanted))


@pytest.mark.parametrize("path", ["eager", "ops"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("wanted,needs", GRAD_SUBSETS)
def test_grad_subsets_reach_extension_cpu_mock(mock_extension, monkeypatch, path, varlen, wanted, needs):
    """The flags reach _C.bwd, the gradients not asked for stay None (and are not computed:
    the mock returns None for them), the others equal the all-gradients run's, with dlse too."""
    from flash_cuda import ops

    monkeypatch.setattr(ops, "eager_ok", lambda *ts: path == "eager")
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((7, 0, 19), (11, 5, 13), 4, 2, 16, F32, "cpu", seed=8)

        def run(leaves):
            return flash_cuda.varlen_attention(*leaves, cu_q, cu_k, mq, mk, is_causal=True, return_lse=True)
    else:
        q, k, v = make_inputs(2, 4, 2, 19, 23, 16, F32, "cpu", layout="bshd", seed=8)

        def run(leaves):
            return flash_cuda.attention(*leaves, is_causal=True, return_lse=True)

    def backward(flags):
        leaves = _subset_leaves((q, k, v), flags)
        out, lse = run(leaves)
        g = torch.Generator().manual_seed(1)
        (out * torch.randn(out.shape, generator=g)).sum().add(
            (lse * torch.randn(lse.shape, generator=g)).sum()).backward()
        return [t.grad for t in leaves]

    full = backward((True, True, True))
    assert mock_extension.last_bwd_needs == (True, True)
    calls = mock_extension.bwd_calls
    part = backward(wanted)
    assert mock_extension.bwd_calls == calls + 1
    assert mock_extension.last_bwd_needs == needs
    for got, ref, w in zip(part, full, wanted):
        if w:
            assert torch.equal(got, ref)
        else:
            assert got is None


@pytest.mark.parametrize("wanted,needs", GRAD_SUBSETS[:2])
def test_grad_subsets_compiled_cpu_mock(mock_extension, wanted, needs):
    """Under torch.compile the traced backward asks for the same subset."""
    q, k, v = make_inputs(1, 4, 2, 21, 17, 16, F32, "cpu", seed=9)

    def f(q, k, v):
        return flash_cuda.attention(q, k, v, is_causal=True)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (f, cf):
        leaves = _subset_leaves((q, k, v), wanted)
        fn(*leaves).square().sum().backward()
        assert mock_extension.last_bwd_needs == needs
        grads.append([t.grad for t in leaves])
    for a, b, w in zip(*grads, wanted):
        assert (a is None) == (b is None) == (not w)
        if w:
            torch.testing.assert_close(a, b)


def test_grad_subsets_func_grad_cpu_mock(mock_extension):
    """torch.func.grad with respect to q alone asks for dQ alone."""
    q, k, v = make_inputs(1, 2, 1, 9, 13, 16, F32, "cpu", seed=10)

    def loss(q, k, v):
        return (flash_cuda.attention(q, k, v, is_causal=True) ** 2).sum()

    g_q = torch.func.grad(loss, argnums=0)(q, k, v)
    assert mock_extension.last_bwd_needs == (True, False)
    g_all = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert mock_extension.last_bwd_needs == (True, True)
    assert torch.equal(g_q, g_all[0])


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_grad_subsets_empty_sizes_cpu_mock(mock_extension, varlen):
    """No key at all: zeros for what is asked, None for the rest, no extension call."""
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((3, 4), (0, 0), 2, 1, 16, F32, "cpu")
        q, k, v = _subset_leaves((q, k, v), (False, True, False))
        out = flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, mq, mk)
    else:
        q, k, v = _subset_leaves(make_inputs(1, 2, 1, 5, 0, 16, F32, "cpu"), (False, True, False))
        out = flash_cuda.attention(q, k, v)
    out.sum().backward()
    assert q.grad is None and v.grad is None
    assert k.grad.shape == k.shape and (k.grad == 0).all()
    assert mock_extension.bwd_calls == 0


@pytest.mark.parametrize("need_dq,need_dkdv", [(True, False), (False, True)])
def test_opcheck_grad_subsets_cpu_mock(mock_extension, need_dq, need_dkdv):
    """The backward ops with a subset: gradients not wanted come back as empty (0,) tensors,
    in the real and the fake implementation alike."""
    q, k, v = make_inputs(1, 4, 2, 21, 34, 16, F16, "cpu", layout="bshd", seed=11)
    opts = _op_options(0.25, True)
    out, lse, aux = torch.ops.flash_cuda.fwd(q, k, v, *opts, False, 0)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    args = (dout, q, k, v, out, lse, aux, dlse) + opts + (False, 0, need_dq, need_dkdv)
    torch.library.opcheck(BWD, args)
    dq, dk, dv = BWD(*args)
    for g, like, w in ((dq, q, need_dq), (dk, k, need_dkdv), (dv, v, need_dkdv)):
        assert g.shape == (like.shape if w else (0,))
    assert mock_extension.last_bwd_needs == (need_dq, need_dkdv)

    qv, kv, vv, cu_q, cu_k, mq, mk = make_varlen_inputs((0, 9, 1, 20), (4, 13, 1, 17), 4, 2, 16, F16, "cpu",
                                                        seed=12)
    seq = (cu_q, cu_k, mq, mk)
    out, lse, aux = torch.ops.flash_cuda.varlen_fwd(qv, kv, vv, *seq, *opts, False, 0, False)
    args = (torch.randn_like(out), qv, kv, vv, out, lse, aux, None) + seq + opts + (True, 0, need_dq, need_dkdv)
    torch.library.opcheck(VBWD, args)
    dq, dk, dv = VBWD(*args)
    for g, like, w in ((dq, qv, need_dq), (dk, kv, need_dkdv), (dv, vv, need_dkdv)):
        assert g.shape == (like.shape if w else (0,))
