"""flash_cuda.integrations.sdpa: flash_cuda behind scaled_dot_product_attention's flash backend.

Without a GPU (CPU CI): the registration with torch's flash-attention registry, activation and
restore (which kernel the dispatcher holds for each aten flash op), the reading of the ops'
causal flag and window sizes against PyTorch's own definitions (math SDPA, causal_lower_right),
the errors for what flash_cuda does not support, and the aten ops end to end through PyTorch's
autograd formulas: the kernels are registered for the CPU dispatch key and run on the
reference-backed stand-in of the extension (conftest's mock_extension).

On a GPU (marked gpu, skipped without one, without the extension or without the registry):
F.scaled_dot_product_attention under sdpa_kernel(FLASH_ATTENTION) with flash_cuda active, forward
and backward, against math SDPA in float64 with the project's rule (error at most twice the error
of naive attention in the same dtype plus a tiny atol; tests/attn_check.py), with the profiler
confirming that flash_cuda's kernels ran and PyTorch's did not; the lower-right causal bias,
varlen_attn, dropout, restore and torch.compile.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flash_cuda import _ext, ops
from flash_cuda.integrations import sdpa
from flash_cuda.reference import attention_naive, attention_varlen_naive, key_visible

from attn_check import (ATOL_BASE, LSE_ATOL_BASE, cu_seqlens_from_lengths, dtype_name, make_inputs,
                        rule_error)

F16, BF16 = torch.float16, torch.bfloat16
needs_registry = pytest.mark.skipif(
    not sdpa.is_supported(),
    reason=f"torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl "
           f"(PyTorch {sdpa.MIN_TORCH_VERSION}+)")


def _dispatch_kernel(op: str, key: str):
    """Where the kernel the dispatcher holds for aten::op at ``key`` was registered (None if
    there is none)."""
    for line in torch._C._dispatch_dump(f"aten::{op}").splitlines():
        if line.startswith(f"{key}: "):
            return line
    return None


def _installed_ops():
    return [name for name, _ in sdpa._KERNELS if hasattr(torch.ops.aten, name)]


# ---------------------------------------------------------------------------------------
# Registration, activation, restore
# ---------------------------------------------------------------------------------------


@needs_registry
def test_registered_on_import():
    assert sdpa.IMPL_NAME in torch.nn.attention.list_flash_attention_impls()
    assert torch.nn.attention.current_flash_attention_impl() != sdpa.IMPL_NAME, \
        "importing must not activate"
    sdpa.register()  # again: harmless
    assert torch.nn.attention.list_flash_attention_impls().count(sdpa.IMPL_NAME) == 1


def test_without_registry_the_error_names_the_version(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl", raising=False)
    assert not sdpa.is_supported()
    for fn in (sdpa.register, sdpa.activate, sdpa.deactivate):
        with pytest.raises(RuntimeError, match=rf"PyTorch {sdpa.MIN_TORCH_VERSION}"):
            fn()


@needs_registry
def test_activation_needs_the_extension(no_extension):
    with pytest.raises(RuntimeError) as err:
        torch.nn.attention.activate_flash_attention_impl(sdpa.IMPL_NAME)
    assert _ext.unavailable_message() in str(err.value)
    assert torch.nn.attention.current_flash_attention_impl() != sdpa.IMPL_NAME
    for op in _installed_ops():
        assert "sdpa.py" not in str(_dispatch_kernel(op, "CUDA")), op


@needs_registry
@pytest.mark.parametrize("how", ["module", "torch"])
def test_activate_then_restore_swaps_the_cuda_kernels(mock_extension, how):
    ops = _installed_ops()
    assert {"_scaled_dot_product_flash_attention",
            "_scaled_dot_product_flash_attention_backward"} <= set(ops)
    before = {op: _dispatch_kernel(op, "CUDA") for op in ops}
    assert not any("sdpa.py" in str(k) for k in before.values())
    if how == "module":
        sdpa.activate()
    else:
        torch.nn.attention.activate_flash_attention_impl(sdpa.IMPL_NAME)
    try:
        assert torch.nn.attention.current_flash_attention_impl() == sdpa.IMPL_NAME
        for op in ops:
            assert "sdpa.py" in str(_dispatch_kernel(op, "CUDA")), op
    finally:
        if how == "module":
            sdpa.deactivate()
        else:
            torch.nn.attention.restore_flash_attention_impl()
    assert torch.nn.attention.current_flash_attention_impl() is None
    assert {op: _dispatch_kernel(op, "CUDA") for op in ops} == before
    sdpa.deactivate()  # nothing active: does nothing


# ---------------------------------------------------------------------------------------
# The ops' causal flag and windows (pure mapping, CPU)
# ---------------------------------------------------------------------------------------


def _visible(Sq, Sk, window):
    return key_visible(torch.arange(Sq), torch.arange(Sk), Sq, Sk, *window)


@pytest.mark.parametrize("Sq,Sk", [(7, 7), (1, 9), (5, 12), (12, 5), (9, 1)])
def test_causal_flag_is_bottom_right_like_pytorchs_lower_right_bias(Sq, Sk):
    """The ops' is_causal means PyTorch's causal_lower_right (what its own flash kernels do, and
    what the bias relies on); for Sq == Sk that is SDPA's (top-left) is_causal, the only causal
    case SDPA sends to the flash backend."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    mask = _visible(Sq, Sk, sdpa.flash_window(True, None, None, Sk))
    with pytest.warns(UserWarning) if Sq > Sk else contextlib.nullcontext():
        lower_right = causal_lower_right(Sq, Sk)._materialize()
    assert torch.equal(mask, lower_right)
    assert torch.equal(mask, causal_upper_left(Sq, Sk)._materialize()) == (Sq == Sk)


@pytest.mark.parametrize("Sq,Sk", [(7, 7), (5, 12), (12, 5)])
def test_causal_square_matches_sdpa_math_top_left(Sq, Sk):
    """Numerically, on CPU: attention with the ops' causal mapping equals math SDPA with
    is_causal=True exactly when Sq == Sk, and math SDPA with the lower-right bias always."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = make_inputs(2, 4, 2, Sq, Sk, 16, torch.float64, "cpu", seed=Sq * Sk)
    ours, _ = attention_naive(q, k, v, window_size=sdpa.flash_window(True, None, None, Sk))
    with sdpa_kernel(SDPBackend.MATH):
        top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with pytest.warns(UserWarning) if Sq > Sk else contextlib.nullcontext():
            bias = causal_lower_right(Sq, Sk)
        lower_right = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    torch.testing.assert_close(ours, lower_right, rtol=1e-12, atol=1e-12)
    assert torch.allclose(ours, top_left, rtol=1e-12, atol=1e-12) == (Sq == Sk)


def test_window_reading_follows_pytorchs_flash_kernels():
    w = sdpa.flash_window
    assert w(False, None, None, 10) == (-1, -1)
    assert w(True, None, None, 10) == (-1, 0)
    assert w(True, 3, 5, 10) == (3, 0)  # causal overrides the right side
    assert w(False, 3, 5, 10) == (3, 5)
    assert w(False, -7, -2, 10) == (-1, -1)  # any negative side is unbounded
    assert w(False, 10, 9, 10) == (-1, 9)  # a side of seqlen_k keys or more is unbounded
    assert w(False, 0, 0, 10) == (0, 0)


# ---------------------------------------------------------------------------------------
# Errors (CPU, no launch)
# ---------------------------------------------------------------------------------------


def _sdpa_call(q, k, v, **kw):
    return sdpa._sdpa_flash_forward(q, k, v, **kw)


@pytest.mark.parametrize("case,match", [
    ("dropout", "dropout_p must be a number in \\[0, 1\\], got 1.5"),
    ("fp32", "float16 or bfloat16 inputs, got float32"),
    ("debug_mask", "return_debug_mask"),
    ("alibi", "alibi_slopes is not supported"),
    ("seqused_k", "seqused_k is not supported"),
    ("block_table", "block_table is not supported"),
    ("head_dim", "head dim"),
])
def test_unsupported_options_raise(mock_extension, case, match):
    dtype = torch.float32 if case == "fp32" else F16
    D = 12 if case == "head_dim" else 16
    q, k, v = make_inputs(1, 2, 2, 4, 4, D, dtype, "cpu")
    bshd = [t.transpose(1, 2) for t in (q, k, v)]
    with pytest.raises((RuntimeError, ValueError), match=match):
        if case == "dropout":
            _sdpa_call(q, k, v, dropout_p=1.5)
        elif case == "debug_mask":
            _sdpa_call(q, k, v, return_debug_mask=True)
        elif case in ("alibi", "seqused_k", "block_table"):
            extra = ({"alibi_slopes": torch.ones(2, dtype=torch.float32)} if case == "alibi"
                     else {case: torch.ones(1, dtype=torch.int32)})
            sdpa._flash_forward(*bshd, None, None, 4, 4, 0.0, False, False, **extra)
        else:
            _sdpa_call(q, k, v)
    assert mock_extension.fwd_calls == 0
    backward_match = match if case == "fp32" else "dropout_p=0.5 needs the forward's rng_state"
    with pytest.raises(RuntimeError, match=backward_match):
        sdpa._sdpa_flash_backward(q, q, k, v, q, q.new_zeros(1, 2, 4, dtype=torch.float32), None,
                                  None, 4, 4, 0.5, False, None, None)
    assert mock_extension.bwd_calls == 0


def test_num_splits_hint_is_accepted(mock_extension):
    q, k, v = (t.transpose(1, 2) for t in make_inputs(1, 2, 2, 5, 6, 16, F16, "cpu"))
    out, lse, *_ = sdpa._flash_forward(q, k, v, None, None, 5, 6, 0.0, True, False, num_splits=4)
    assert out.shape == q.shape and lse.shape == (1, 2, 5) and mock_extension.fwd_calls == 1


def test_deterministic_algorithms_reach_the_backward(mock_extension, monkeypatch):
    seen = []
    real = ops.bwd_impl

    def spy(*args, **kwargs):
        seen.append(args[9])  # deterministic
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "bwd_impl", spy)
    q, k, v = make_inputs(1, 2, 2, 5, 5, 16, F16, "cpu")
    out, lse, *_ = _sdpa_call(q, k, v, is_causal=True)
    prev = torch.are_deterministic_algorithms_enabled()
    for flag in (False, True):
        torch.use_deterministic_algorithms(flag)
        try:
            sdpa._sdpa_flash_backward(torch.ones_like(out), q, k, v, out, lse, None, None, 5, 5, 0.0,
                                      True, None, None)
        finally:
            torch.use_deterministic_algorithms(prev)
    assert seen == [False, True]


# ---------------------------------------------------------------------------------------
# The aten ops end to end on CPU: PyTorch's autograd formulas around this module's kernels
# ---------------------------------------------------------------------------------------


@pytest.fixture
def cpu_kernels(mock_extension):
    """This module's kernels as the CPU kernels of the aten flash ops (CPU has none of its own),
    on the reference-backed extension stand-in."""
    before = {op: _dispatch_kernel(op, "CPU") for op in _installed_ops()}
    handle = sdpa._install("CPU")
    yield mock_extension
    handle.remove()
    assert {op: _dispatch_kernel(op, "CPU") for op in _installed_ops()} == before


def _apply_rule(label, got, ref64, naive, dtype, D):
    problems = []
    for name in got:
        base = LSE_ATOL_BASE[dtype] if name == "lse" else ATOL_BASE[dtype]
        mask = torch.isfinite(ref64[name]) if name == "lse" else None
        x, r = got[name].detach(), ref64[name].detach()
        if name == "lse":
            assert torch.equal(x == float("-inf"), r == float("-inf")), f"{label}: lse -inf rows"
        _, problem = rule_error(name, x, r, naive[name].detach(), base, mask=mask,
                                  head_dim=0 if name == "lse" else D)
        if problem:
            problems.append(problem)
    assert not problems, f"{label}:\n  " + "\n  ".join(problems)


def _grads(out, inputs, dout):
    return dict(zip(("dq", "dk", "dv"), torch.autograd.grad(out, inputs, dout)))


def _run_reference(q, k, v, dout, window, scale, dtype):
    qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = attention_naive(qr, kr, vr, window_size=window, scale=scale)
    return dict(out=out, lse=lse, **_grads(out, (qr, kr, vr), dout.to(dtype)))


DENSE_CASES = [
    # B, Hq, Hkv, Sq, Sk, D, is_causal, scale, window (left, right) or None
    (2, 4, 4, 33, 33, 32, True, None, None),
    (1, 4, 2, 17, 40, 16, True, None, None),  # bottom-right causal, GQA
    (2, 2, 1, 40, 17, 24, True, 0.3, None),  # rows that see no key
    (1, 6, 2, 9, 31, 40, False, 0.5, None),
    (2, 2, 2, 30, 30, 16, False, None, (6, 3)),
    (1, 2, 2, 20, 30, 16, True, None, (4, 7)),  # causal overrides the right side
]


@pytest.mark.parametrize("op", ["sdpa", "flash"])
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_dense_ops_through_autograd(cpu_kernels, op, case):
    B, Hq, Hkv, Sq, Sk, D, is_causal, scale, window = case
    if op == "sdpa" and window is not None:
        pytest.skip("the SDPA op has no window arguments")
    dtype = BF16
    layout = "bhsd" if op == "sdpa" else "bshd"
    q, k, v = (t.requires_grad_() for t in make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cpu", layout,
                                                         seed=Sq + Sk))
    wl, wr = window or (None, None)
    if op == "sdpa":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False,
                                                                 scale=scale)
        out, lse = res[0], res[1]
        assert (res[4], res[5]) == (Sq, Sk)
    else:
        # the op's layout is (B, S, H, D): q, k, v above are its transposes
        res = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, Sq, Sk, 0.0,
            is_causal, False, scale=scale, window_size_left=wl, window_size_right=wr)
        out, lse = res[0].transpose(1, 2), res[1]
    assert out.stride() == torch.empty_like(q).stride()
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, Sq) and lse.is_contiguous()
    assert cpu_kernels.fwd_calls == 1
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = dict(out=out, lse=lse, **_grads(out, (q, k, v), dout))
    assert cpu_kernels.bwd_calls == 1
    win = sdpa.flash_window(is_causal, wl, wr, Sk)
    ref64 = _run_reference(q, k, v, dout, win, scale, torch.float64)
    naive = _run_reference(q, k, v, dout, win, scale, dtype)
    if op == "sdpa" and not (is_causal and Sq > Sk):
        # and PyTorch's own math SDPA with the op's (bottom-right) mask agrees with the spec
        mask = _visible(Sq, Sk, win) if win != (-1, -1) else None
        with sdpa_kernel(SDPBackend.MATH):
            math = F.scaled_dot_product_attention(*(t.detach().double() for t in (q, k, v)),
                                                  attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv)
        torch.testing.assert_close(ref64["out"], math, rtol=1e-10, atol=1e-10)
    _apply_rule(f"{op} {case}", got, ref64, naive, dtype, D)


@pytest.mark.parametrize("op", ["sdpa", "flash"])
def test_dropout_through_the_ops(cpu_kernels, op):
    """dropout_p > 0: the forward's rng_state output names the draws, and the backward that gets
    it back regenerates the same mask (the reference with that mask gives out and the grads)."""
    from flash_cuda import reference as R
    B, H, S, D, p = 2, 4, 24, 16, 0.3
    q, k, v = (t.requires_grad_() for t in make_inputs(B, H, H, S, S, D, BF16, "cpu", seed=3))
    if op == "sdpa":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, p, True, False)
        out, rng = res[0], res[6]
    else:
        res = torch.ops.aten._flash_attention_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      None, None, S, S, p, True, False)
        out, rng = res[0].transpose(1, 2), res[2]
    assert rng.dtype == torch.uint64 and rng.shape == (2,)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(BF16)
    got = dict(out=out, **_grads(out, (q, k, v), dout))
    seed, offset = (int(x) for x in rng.view(torch.int64).tolist())
    mask = R.dropout_keep_mask(B, H, S, S, p, seed=seed, offset=offset)

    def reference(dt):
        qr, kr, vr = (t.detach().to(dt).requires_grad_() for t in (q, k, v))
        o, _ = attention_naive(qr, kr, vr, is_causal=True, dropout_p=p, dropout_mask=mask)
        return dict(out=o, **_grads(o, (qr, kr, vr), dout.to(dt)))

    _apply_rule(f"{op} dropout", got, reference(torch.float64), reference(BF16), BF16, D)


@pytest.mark.parametrize("is_causal,window", [(False, None), (True, None), (False, (5, 2))])
def test_packed_op_through_autograd(cpu_kernels, is_causal, window):
    dtype = F16
    lens_q, lens_k = (7, 0, 19, 3), (7, 5, 11, 16)
    Hq, Hkv, D = 4, 2, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), Hq, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(sum(lens_k), Hkv, D, generator=g).to(dtype).requires_grad_()
    cu_q, cu_k = cu_seqlens_from_lengths(lens_q, "cpu"), cu_seqlens_from_lengths(lens_k, "cpu")
    wl, wr = window or (None, None)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.0,
                                                  is_causal, False, window_size_left=wl,
                                                  window_size_right=wr)
    out, lse = res[0], res[1]
    assert lse.shape == (Hq, sum(lens_q)) and lse.dtype == torch.float32
    dout = torch.randn(out.shape, generator=g).to(dtype)
    got = dict(out=out, lse=lse, **_grads(out, (q, k, v), dout))
    assert (cpu_kernels.fwd_calls, cpu_kernels.bwd_calls) == (1, 1)
    win = sdpa.flash_window(is_causal, wl, wr, max(lens_k))

    def reference(rdtype):
        qr, kr, vr = (t.detach().to(rdtype).requires_grad_() for t in (q, k, v))
        o, l = attention_varlen_naive(qr, kr, vr, cu_q, cu_k, window_size=win)
        return dict(out=o, lse=l, **_grads(o, (qr, kr, vr), dout.to(rdtype)))

    _apply_rule(f"packed causal={is_causal} window={window}", got, reference(torch.float64),
                reference(dtype), dtype, D)


def test_inplace_forward_writes_out(cpu_kernels):
    if not hasattr(torch.ops.aten, "_flash_attention_forward_no_dropout_inplace"):
        pytest.skip(f"torch {torch.__version__} has no _flash_attention_forward_no_dropout_inplace")
    q, k, v = (t.transpose(1, 2) for t in make_inputs(1, 2, 2, 6, 6, 16, F16, "cpu"))
    out = torch.full_like(q, float("nan"))
    lse = torch.ops.aten._flash_attention_forward_no_dropout_inplace(out, q, k, v, None, None, 6, 6,
                                                                     0.0, True, False)
    ref, ref_lse = attention_naive(*(t.transpose(1, 2).double() for t in (q, k, v)), is_causal=True)
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-3)


def test_non_dense_bshd_view_gets_the_promised_layout(mock_extension):
    """A (B, S, H, D) view that is not dense (every other head of a wider buffer): out is laid
    out like torch.empty_like(query), as the op's meta function says."""
    buf = torch.randn(1, 6, 4, 16).to(F16)
    q = buf[:, :, ::2]
    k = v = torch.randn(1, 6, 2, 16).to(F16)
    out, *_ = sdpa._flash_forward(q, k, v, None, None, 6, 6, 0.0, False, False)
    assert out.stride() == torch.empty_like(q).stride()


# ---------------------------------------------------------------------------------------
# GPU: scaled_dot_product_attention with flash_cuda active
# ---------------------------------------------------------------------------------------


@pytest.fixture
def flash_cuda_sdpa():
    """flash_cuda active for one test; PyTorch's kernels again afterwards."""
    if not sdpa.is_supported():
        pytest.skip(f"torch {torch.__version__} has no flash-attention registry "
                    f"(PyTorch {sdpa.MIN_TORCH_VERSION}+)")
    sdpa.activate()
    try:
        yield sdpa._calls
    finally:
        sdpa.deactivate()
    assert "sdpa.py" not in str(_dispatch_kernel("_scaled_dot_product_flash_attention", "CUDA"))


def _kernel_names(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        res = fn()
        torch.cuda.synchronize()
    return res, [e.name for e in prof.events()]


def _assert_flash_cuda_ran(names):
    assert any("flash_cuda::" in n for n in names), names
    assert not any("pytorch_flash" in n for n in names), names


def _sdpa_check(q, k, v, *, is_causal, scale, enable_gqa, backends, label):
    """F.scaled_dot_product_attention under ``backends`` against math SDPA in float64 (out and
    gradients) with the rule; the naive same-dtype error comes from flash_cuda.reference with the
    same (here top-left == bottom-right or no) mask."""
    dtype, D = q.dtype, q.shape[-1]
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(dtype)

    def run():
        with sdpa_kernel(backends):
            out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=is_causal, scale=scale,
                                                 enable_gqa=enable_gqa)
        return dict(out=out, **_grads(out, (qf, kf, vf), dout))

    got, names = _kernel_names(run)
    _assert_flash_cuda_ran(names)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        o64 = F.scaled_dot_product_attention(qr, kr, vr, is_causal=is_causal, scale=scale,
                                             enable_gqa=enable_gqa)
    ref64 = dict(out=o64, **_grads(o64, (qr, kr, vr), dout.double()))
    qn, kn, vn = (t.detach().requires_grad_() for t in (q, k, v))
    on, _ = attention_naive(qn, kn, vn, is_causal=is_causal, scale=scale)
    naive = dict(out=on, **_grads(on, (qn, kn, vn), dout))
    _apply_rule(label, got, ref64, naive, dtype, D)


SDPA_CASES = {
    # name: (B, Hq, Hkv, Sq, Sk, is_causal, scale)
    "causal": (2, 4, 4, 257, 257, True, None),
    "noncausal-sq<sk": (2, 4, 4, 100, 300, False, None),
    "noncausal-sq>sk": (1, 4, 4, 300, 77, False, None),
    "gqa-causal": (2, 8, 2, 190, 190, True, None),
    "scale": (2, 4, 4, 128, 200, False, 0.37),
    "decode": (3, 8, 2, 1, 333, False, None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_name)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_flash_backend_runs_flash_cuda(flash_cuda_sdpa, dtype, D, case):
    B, Hq, Hkv, Sq, Sk, is_causal, scale = SDPA_CASES[case]
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", seed=D + Sq)
    calls = dict(flash_cuda_sdpa)
    _sdpa_check(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=Hq != Hkv,
                backends=SDPBackend.FLASH_ATTENTION, label=f"{case} D={D} {dtype_name(dtype)}")
    assert flash_cuda_sdpa["forward"] == calls.get("forward", 0) + 1
    assert flash_cuda_sdpa["backward"] == calls.get("backward", 0) + 1


@pytest.mark.gpu
@pytest.mark.parametrize("layout,D", [("bshd", 128), ("strided", 128), ("bhsd", 100)])
def test_sdpa_flash_backend_layouts_and_padded_head_dim(flash_cuda_sdpa, layout, D):
    """A (B, S, H, D) projection's transposed view, a strided slice, and head dim 100 (SDPA pads
    it to 104 and passes the scale of the unpadded head dim)."""
    q, k, v = make_inputs(2, 4, 4, 150, 150, D, BF16, "cuda", layout=layout, seed=11)
    _sdpa_check(q, k, v, is_causal=True, scale=None, enable_gqa=False,
                backends=SDPBackend.FLASH_ATTENTION, label=f"layout={layout} D={D}")


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,Sk", [(64, 200), (200, 64)])
def test_sdpa_causal_non_square_stays_top_left(flash_cuda_sdpa, Sq, Sk):
    """SDPA's is_causal is top-left aligned; SDPA does not give a causal Sq != Sk call to the
    flash backend (flash_cuda's causal is bottom-right), so with flash_cuda active it still
    matches math SDPA: through another backend, or an error if only flash is allowed."""
    q, k, v = make_inputs(2, 4, 4, Sq, Sk, 64, F16, "cuda", seed=Sq)
    calls = dict(flash_cuda_sdpa)
    with pytest.raises(RuntimeError, match="No available kernel"):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA's reasons for refusing each backend
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=5e-3)
    assert dict(flash_cuda_sdpa) == calls


@pytest.mark.gpu
@pytest.mark.parametrize("Sq,Sk", [(100, 260), (260, 100)])
def test_lower_right_causal_bias_runs_flash_cuda(flash_cuda_sdpa, Sq, Sk):
    """torch.nn.attention.bias.causal_lower_right calls the flash op with is_causal=True meaning
    bottom-right: flash_cuda's own causal, rows that see no key included (output 0)."""
    from torch.nn.attention.bias import causal_lower_right

    dtype, D = BF16, 128
    q, k, v = make_inputs(2, 4, 4, Sq, Sk, D, dtype, "cuda", seed=Sk)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, device="cuda").to(dtype)
    with pytest.warns(UserWarning) if Sq > Sk else contextlib.nullcontext():
        bias = causal_lower_right(Sq, Sk)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=bias)
        return dict(out=out, **_grads(out, (qf, kf, vf), dout))

    got, names = _kernel_names(run)
    _assert_flash_cuda_ran(names)
    ref64 = _run_reference(q, k, v, dout, (-1, 0), None, torch.float64)
    naive = _run_reference(q, k, v, dout, (-1, 0), None, dtype)
    ref64.pop("lse"), naive.pop("lse")
    _apply_rule(f"lower-right Sq={Sq} Sk={Sk}", got, ref64, naive, dtype, D)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attn_runs_flash_cuda(flash_cuda_sdpa, causal):
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if not hasattr(varlen, "varlen_attn"):
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn")
    params = inspect.signature(varlen.varlen_attn).parameters
    if "window_size" in params:
        kw = dict(window_size=(-1, 0) if causal else (-1, -1))
    elif "is_causal" in params:
        kw = dict(is_causal=causal)
    else:
        pytest.skip("varlen_attn takes neither window_size nor is_causal")
    dtype, D = BF16, 128
    lens_q, lens_k = (130, 1, 257, 64), (130, 90, 300, 64)
    g = torch.Generator("cuda").manual_seed(9)
    q = torch.randn(sum(lens_q), 8, D, device="cuda", generator=g).to(dtype)
    k = torch.randn(sum(lens_k), 8, D, device="cuda", generator=g).to(dtype)
    v = torch.randn(sum(lens_k), 8, D, device="cuda", generator=g).to(dtype)
    cu_q, cu_k = cu_seqlens_from_lengths(lens_q, "cuda"), cu_seqlens_from_lengths(lens_k, "cuda")
    dout = torch.randn(q.shape, device="cuda", generator=g).to(dtype)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))

    def run():
        out = varlen.varlen_attn(qf, kf, vf, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
        return dict(out=out, **_grads(out, (qf, kf, vf), dout))

    got, names = _kernel_names(run)
    _assert_flash_cuda_ran(names)

    def reference(rdtype):
        qr, kr, vr = (t.detach().to(rdtype).requires_grad_() for t in (q, k, v))
        o, _ = attention_varlen_naive(qr, kr, vr, cu_q, cu_k, is_causal=causal)
        return dict(out=o, **_grads(o, (qr, kr, vr), dout.to(rdtype)))

    _apply_rule(f"varlen_attn causal={causal}", got, reference(torch.float64), reference(dtype),
                dtype, D)


@pytest.mark.gpu
def test_dropout_runs_flash_cuda_under_the_flash_backend(flash_cuda_sdpa):
    """F.scaled_dot_product_attention(dropout_p=...) on the flash backend: flash_cuda's kernels,
    reproducible with torch.manual_seed, unbiased (the mean over draws approaches p = 0's output)."""
    q, k, v = (t.requires_grad_() for t in make_inputs(1, 2, 2, 64, 64, 64, F16, "cuda"))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        torch.manual_seed(3)
        got, names = _kernel_names(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.25))
        _assert_flash_cuda_ran(names)
        torch.manual_seed(3)
        again = F.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
        again.sum().backward()
        assert torch.equal(got, again) and torch.isfinite(q.grad).all()
        plain = F.scaled_dot_product_attention(q, k, v)
        mean = torch.stack([F.scaled_dot_product_attention(q, k, v, dropout_p=0.25) for _ in range(64)]).float()
    spread = (got.float() - plain.float()).abs().mean()
    assert (mean.mean(0) - plain.float()).abs().mean() < 0.25 * spread


@pytest.mark.gpu
def test_deterministic_backward_is_bitwise_reproducible(flash_cuda_sdpa):
    q, k, v = make_inputs(2, 8, 8, 300, 300, 128, BF16, "cuda", seed=4)
    dout = torch.randn(q.shape, device="cuda").to(BF16)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        grads = []
        for _ in range(3):
            qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
            grads.append(torch.autograd.grad(out, (qf, kf, vf), dout))
    finally:
        torch.use_deterministic_algorithms(prev)
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_restore_gives_back_pytorchs_kernels():
    if not sdpa.is_supported():
        pytest.skip("no flash-attention registry")
    q, k, v = make_inputs(1, 4, 4, 128, 128, 64, F16, "cuda")

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    sdpa.activate()
    try:
        ours, names = _kernel_names(run)
        _assert_flash_cuda_ran(names)
    finally:
        sdpa.deactivate()
    theirs, names = _kernel_names(run)
    assert not any("flash_cuda::" in n for n in names), names
    torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-3)


@pytest.mark.gpu
def test_torch_compile_calls_flash_cuda(flash_cuda_sdpa):
    """Inductor keeps the flash op as an aten call, so a compiled model runs flash_cuda too."""
    q, k, v = make_inputs(2, 4, 4, 200, 200, 64, BF16, "cuda", seed=2)

    @torch.compile(fullgraph=True)
    def f(q, k, v):
        return F.scaled_dot_product_attention(q * 1.0, k, v, is_causal=True)

    torch._dynamo.reset()
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        f(q, k, v)  # compile
        calls = flash_cuda_sdpa["forward"]
        out, names = _kernel_names(lambda: f(q, k, v))
    _assert_flash_cuda_ran(names)
    assert flash_cuda_sdpa["forward"] == calls + 1
    ref, _ = attention_naive(q.double(), k.double(), v.double(), is_causal=True)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-2)
