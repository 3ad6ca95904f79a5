"""Validation of the sliding-window, softcap and ALiBi arguments and of
flash_cuda.varlen_attention (CPU).

Every bad input raises before anything is launched, with a message naming the argument
and what is accepted: TypeError for a wrong type or dtype, ValueError for a wrong value
or shape, RuntimeError for a wrong device. Accepted inputs on CPU tensors get as far as
the "must be CUDA tensors" check. With the mock extension (conftest.py): the values of
cu_seqlens under check_cu_seqlens / FLASH_CUDA_CHECK_CU_SEQLENS, the empty packed batches
answered without a launch, and varlen_attention against the reference through autograd.
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda import validation
from flash_cuda.reference import attention_varlen_naive

from attn_check import cu_seqlens_from_lengths, make_alibi_slopes

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
I32 = torch.int32
DENSE = "flash_cuda.attention: "
VARLEN = "flash_cuda.varlen_attention: "


def qkv(B=2, Hq=4, Hkv=2, Sq=5, Sk=7, D=16, dtype=F16, device="cpu"):
    q = torch.randn(B, Hq, Sq, D, device=device).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, device=device).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, device=device).to(dtype)
    return q, k, v


def raises(exc, match, *args, **kw):
    with pytest.raises(exc, match=match) as info:
        flash_cuda.attention(*args, **kw)
    assert str(info.value).startswith(DENSE), str(info.value)
    return str(info.value)


def packed(seqlens_q=(3, 0, 5), seqlens_k=(4, 2, 5), Hq=4, Hkv=2, D=16, dtype=F16, device="cpu"):
    q = torch.randn(sum(seqlens_q), Hq, D, device=device).to(dtype)
    k = torch.randn(sum(seqlens_k), Hkv, D, device=device).to(dtype)
    v = torch.randn(sum(seqlens_k), Hkv, D, device=device).to(dtype)
    return (q, k, v, cu_seqlens_from_lengths(seqlens_q, device),
            cu_seqlens_from_lengths(seqlens_k, device), max(seqlens_q, default=0),
            max(seqlens_k, default=0))


def vraises(exc, match, *args, **kw):
    with pytest.raises(exc, match=match) as info:
        flash_cuda.varlen_attention(*args, **kw)
    assert str(info.value).startswith(VARLEN), str(info.value)
    return str(info.value)


CUDA_CHECK = "must be CUDA tensors"


# ---------------------------------------------------------------------------------------
# window_size
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [5, None, "ab", torch.tensor([1, 2]), {1: 2}])
def test_window_not_a_tuple(window):
    msg = raises(TypeError, "window_size must be a tuple", *qkv(), window_size=window)
    assert "-1" in msg


@pytest.mark.parametrize("window", [(), (1,), (1, 2, 3), [4]])
def test_window_wrong_length(window):
    raises(ValueError, "window_size must have exactly 2 entries", *qkv(), window_size=window)


@pytest.mark.parametrize("window,side", [((1.0, 2), "left"), ((1, 2.5), "right"),
                                         ((True, 2), "left"), ((1, False), "right"),
                                         ((None, -1), "left"), ((1, torch.tensor(2)), "right")])
def test_window_entries_must_be_ints(window, side):
    msg = raises(TypeError, f"window_size {side} must be a Python int", *qkv(), window_size=window)
    assert "-1 for unbounded" in msg


@pytest.mark.parametrize("window,side", [((-2, 0), "left"), ((0, -5), "right"),
                                         ((2**31, 0), "left"), ((0, 2**40), "right")])
def test_window_values_out_of_range(window, side):
    raises(ValueError, f"window_size {side} must be -1 \\(unbounded\\)", *qkv(), window_size=window)


@pytest.mark.parametrize("right", [1, 7])
def test_causal_with_right_window(right):
    msg = raises(ValueError, "is_causal=True", *qkv(), is_causal=True, window_size=(3, right))
    assert f"(3, {right})" in msg and "is_causal=False" in msg


@pytest.mark.parametrize("is_causal,window,expected", [
    (False, (-1, -1), (-1, -1)), (True, (-1, -1), (-1, 0)), (True, (4, 0), (4, 0)),
    (True, (4, -1), (4, 0)), (False, [0, 0], (0, 0)), (False, (2**31 - 1, 3), (2**31 - 1, 3)),
])
def test_window_accepted(is_causal, window, expected):
    assert validation.check_window(window, is_causal) == expected
    raises(RuntimeError, CUDA_CHECK, *qkv(), is_causal=is_causal, window_size=window)


# ---------------------------------------------------------------------------------------
# softcap
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("softcap", ["1", None, True, torch.tensor(1.0), [1.0], 1j])
def test_softcap_not_a_real(softcap):
    raises(TypeError, "softcap must be a finite real number >= 0", *qkv(), softcap=softcap)


@pytest.mark.parametrize("softcap", [-1.0, -1e-9, float("nan"), float("inf"), -float("inf")])
def test_softcap_bad_value(softcap):
    msg = raises(ValueError, "softcap must be a finite real number >= 0", *qkv(), softcap=softcap)
    assert "0 disables it" in msg


@pytest.mark.parametrize("softcap", [0, 0.0, 1e-3, 5, 30.0])
def test_softcap_accepted(softcap):
    assert validation.check_softcap(softcap) == float(softcap)
    assert type(validation.check_softcap(softcap)) is float
    raises(RuntimeError, CUDA_CHECK, *qkv(), softcap=softcap)


# ---------------------------------------------------------------------------------------
# alibi_slopes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("slopes", [[0.5, 0.25, 0.1, 0.05], 0.5, (0.1,) * 4])
def test_alibi_not_a_tensor(slopes):
    msg = raises(TypeError, "alibi_slopes must be None or a torch.Tensor", *qkv(),
                 alibi_slopes=slopes)
    assert "float32" in msg and "(4,)" in msg and "(2, 4)" in msg


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_alibi_wrong_dtype(dtype):
    msg = raises(TypeError, "alibi_slopes must be a float32 tensor", *qkv(),
                 alibi_slopes=torch.ones(4, dtype=dtype))
    assert str(dtype).replace("torch.", "") in msg


@pytest.mark.parametrize("shape", [(3,), (5,), (2, 4, 1), (3, 4), (4, 2), (1, 4), (), (2, 2)])
def test_alibi_wrong_shape(shape):
    msg = raises(ValueError, "alibi_slopes must have shape \\(4,\\).*or \\(2, 4\\)", *qkv(),
                 alibi_slopes=torch.ones(shape))
    assert str(tuple(shape)) in msg


def test_alibi_wrong_device():
    msg = raises(RuntimeError, "alibi_slopes must be on the same device as q", *qkv(),
                 alibi_slopes=torch.ones(4, device="meta"))
    assert "meta" in msg and "cpu" in msg


@pytest.mark.parametrize("shape", [(4,), (2, 4)])
def test_alibi_accepted(shape):
    slopes = torch.rand(shape, requires_grad=True)
    raises(RuntimeError, CUDA_CHECK, *qkv(), alibi_slopes=slopes)
    strided = torch.rand(shape[::-1] + (2,))[..., 0]
    strided = strided.t() if len(shape) == 2 else strided  # non-contiguous is fine too
    assert strided.shape == shape and not strided.is_contiguous()
    raises(RuntimeError, CUDA_CHECK, *qkv(), alibi_slopes=strided)


def test_alibi_batch_zero():
    q, k, v = qkv(B=0)
    raises(RuntimeError, CUDA_CHECK, q, k, v, alibi_slopes=torch.ones(0, 4))


# ---------------------------------------------------------------------------------------
# The Hopper tier and the new options
# ---------------------------------------------------------------------------------------


def test_wgmma_rejects_deterministic_softcap():
    """The Hopper tier has softcap's backward in its warp-specialized kernel only, which adds dQ
    in a varying order: asking for it explicitly with deterministic=True is an error."""
    msg = raises(ValueError, "kernel='wgmma' \\(the Hopper tier\\) does not support", *qkv(),
                 kernel="wgmma", softcap=10.0, deterministic=True)
    assert "softcap with deterministic=True" in msg and "'mma'" in msg
    msg = vraises(ValueError, "kernel='wgmma' \\(the Hopper tier\\) does not support", *packed(),
                  kernel="wgmma", softcap=10.0, deterministic=True)
    assert "softcap with deterministic=True" in msg


@pytest.mark.parametrize("kw", [dict(softcap=10.0), dict(softcap=5.0, deterministic=False),
                                dict(softcap=0.0, deterministic=True)])
def test_wgmma_accepts_softcap(kw):
    """Softcap (its backward on the warp-specialized Hopper kernel) passes validation for the
    Hopper tier (the CPU tensors then fail the device check)."""
    raises(RuntimeError, CUDA_CHECK, *qkv(), kernel="wgmma", **kw)
    vraises(RuntimeError, CUDA_CHECK, *packed(), kernel="wgmma", **kw)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(window_size=(-1, 0)), dict(softcap=0.0),
                                dict(window_size=(8, 0)), dict(window_size=(-1, 3)),
                                dict(alibi_slopes=torch.ones(4))])
def test_wgmma_accepts_its_options(kw):
    """Windows and ALiBi pass validation for the Hopper tier (the CPU tensors then fail the
    device check)."""
    raises(RuntimeError, CUDA_CHECK, *qkv(), kernel="wgmma", **kw)


def test_new_options_validated_before_extension_check(no_extension):
    raises(ValueError, "softcap", *qkv(), softcap=-1.0)
    raises(ValueError, "window_size", *qkv(), window_size=(-3, 0))
    vraises(TypeError, "cu_seqlens_q must be an int32", *packed()[:3],
            torch.zeros(4, dtype=torch.int64), packed()[4], 5, 5)


# ---------------------------------------------------------------------------------------
# varlen_attention: layout, cu_seqlens, max_seqlen
# ---------------------------------------------------------------------------------------


def test_varlen_accepted_inputs_reach_device_check():
    vraises(RuntimeError, CUDA_CHECK, *packed())
    q, k, v, cu_q, cu_k, mq, mk = packed(dtype=BF16)
    vraises(RuntimeError, CUDA_CHECK, q, k, v, cu_q, cu_k, mq, mk, is_causal=True,
            window_size=(3, -1), softcap=2.0, alibi_slopes=torch.ones(3, 4), return_lse=True,
            deterministic=True, check_cu_seqlens=True, kernel="mma")
    # views with a contiguous last dim, larger max_seqlen bounds, zero bounds
    qkv_buf = torch.randn(12, 3, 4, 16).to(F16)
    q, k, v = qkv_buf[:, 0], qkv_buf[:, 1, :2], qkv_buf[:, 2, :2]
    cu = cu_seqlens_from_lengths([5, 7], "cpu")
    vraises(RuntimeError, CUDA_CHECK, q, k, v, cu, cu, 100, 100)
    vraises(RuntimeError, CUDA_CHECK, q, k, v, cu, cu, 0, 0)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("ndim", [2, 4])
def test_varlen_ndim(which, ndim):
    q, k, v, *rest = packed()
    args = {"q": q, "k": k, "v": v}
    t = args[which]
    args[which] = t.flatten(1) if ndim == 2 else t.unsqueeze(0)
    msg = vraises(ValueError, f"{which} must be a 3-D tensor", args["q"], args["k"], args["v"], *rest)
    assert f"{ndim}-D" in msg and "total" in msg


def test_varlen_dense_tensors_rejected():
    q, k, v = qkv()
    cu = cu_seqlens_from_lengths([5, 5], "cpu")
    vraises(ValueError, "q must be a 3-D tensor \\(total_q, heads, head_dim\\)", q, k, v, cu, cu, 5, 7)


def test_varlen_shape_rules():
    q, k, v, *rest = packed()
    vraises(ValueError, "same head dim", q, k[..., :8], v[..., :8], *rest)
    vraises(ValueError, "k and v must have the same shape", q, k, v[:-1], *rest)
    vraises(ValueError, "k and v must have the same shape", q, k, v[:, :1], *rest)
    q3, k3, v3, *rest3 = packed(Hq=3, Hkv=2)
    vraises(ValueError, "query heads \\(3\\) must be a multiple", q3, k3, v3, *rest3)
    q12, k12, v12, *rest12 = packed(D=12)
    vraises(ValueError, "unsupported head dim 12", q12, k12, v12, *rest12)
    q0, k0, v0, *rest0 = packed(Hq=0, Hkv=0)
    vraises(ValueError, "at least 1", q0, k0, v0, *rest0)


def test_varlen_last_dim_not_contiguous():
    q, k, v, *rest = packed()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    vraises(ValueError, "q must have a contiguous last dimension", qt, k, v, *rest)


def test_varlen_too_many_rows_and_heads():
    meta = lambda *s: torch.empty(s, dtype=F16, device="meta")  # noqa: E731
    cu = torch.zeros(2, dtype=I32, device="meta")
    vraises(ValueError, "below 2\\^31", meta(2**31, 1, 8), meta(4, 1, 8), meta(4, 1, 8), cu, cu, 4, 4)
    vraises(ValueError, "query heads \\(65536\\).*at most 65535", meta(4, 65536, 8), meta(4, 1, 8),
            meta(4, 1, 8), cu, cu, 4, 4)
    big = torch.zeros(65537, dtype=I32)
    q, k, v, *_ = packed()
    vraises(ValueError, "batch size \\(65536\\).*at most 65535", q, k, v, big, big, 4, 4)


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("bad,exc,match", [
    ([0, 3, 3, 8], TypeError, "must be a torch.Tensor of int32"),
    (None, TypeError, "must be a torch.Tensor of int32"),
    (torch.tensor([0, 3, 3, 8], dtype=torch.int64), TypeError, "must be an int32 tensor, got int64"),
    (torch.tensor([0.0, 3, 3, 8]), TypeError, "must be an int32 tensor, got float32"),
    (torch.tensor([[0, 3, 3, 8]], dtype=I32), ValueError, "must be 1-D of shape \\(batch \\+ 1,\\)"),
    (torch.zeros(0, dtype=I32), ValueError, "must be 1-D of shape \\(batch \\+ 1,\\)"),
    (torch.tensor(0, dtype=I32), ValueError, "must be 1-D"),
])
def test_varlen_bad_cu_seqlens(which, bad, exc, match):
    q, k, v, cu_q, cu_k, mq, mk = packed()
    args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    args[which] = bad
    vraises(exc, f"{which} {match}", q, k, v, args["cu_seqlens_q"], args["cu_seqlens_k"], mq, mk)


def test_varlen_cu_seqlens_length_mismatch():
    q, k, v, cu_q, cu_k, mq, mk = packed()
    msg = vraises(ValueError, "must have the same length", q, k, v, cu_q, cu_k[:-1], mq, mk)
    assert "4 and 3" in msg


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_varlen_cu_seqlens_wrong_device(which):
    q, k, v, cu_q, cu_k, mq, mk = packed()
    args = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    args[which] = args[which].to("meta")
    msg = vraises(RuntimeError, f"{which} must be on the same device as q", q, k, v,
                  args["cu_seqlens_q"], args["cu_seqlens_k"], mq, mk)
    assert "meta" in msg


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("bad,exc,match", [
    (5.0, TypeError, "must be a Python int"), (True, TypeError, "must be a Python int"),
    (None, TypeError, "must be a Python int"), (torch.tensor(5), TypeError, "must be a Python int"),
    (-1, ValueError, "must be in \\[0, 2\\^31 - 1\\]"), (2**31, ValueError, "must be in"),
])
def test_varlen_bad_max_seqlen(which, bad, exc, match):
    q, k, v, cu_q, cu_k, mq, mk = packed()
    args = {"max_seqlen_q": mq, "max_seqlen_k": mk}
    args[which] = bad
    vraises(exc, f"{which} {match}", q, k, v, cu_q, cu_k, args["max_seqlen_q"], args["max_seqlen_k"])


@pytest.mark.parametrize("flag", ["is_causal", "return_lse", "deterministic", "check_cu_seqlens"])
def test_varlen_flags_must_be_bool(flag):
    vraises(TypeError, f"{flag} must be a bool", *packed(), **{flag: 1})


def test_varlen_alibi_shape_uses_batch_of_cu_seqlens():
    args = packed()  # B = 3, Hq = 4
    vraises(RuntimeError, CUDA_CHECK, *args, alibi_slopes=torch.ones(3, 4))
    vraises(RuntimeError, CUDA_CHECK, *args, alibi_slopes=torch.ones(4))
    msg = vraises(ValueError, "alibi_slopes must have shape \\(4,\\).*or \\(3, 4\\)", *args,
                  alibi_slopes=torch.ones(2, 4))
    assert "(2, 4)" in msg
    vraises(TypeError, "alibi_slopes must be a float32", *args,
            alibi_slopes=torch.ones(4, dtype=torch.float64))
    vraises(RuntimeError, "alibi_slopes must be on the same device", *args,
            alibi_slopes=torch.ones(4, device="meta"))


def test_varlen_new_options_validated():
    args = packed()
    vraises(ValueError, "softcap", *args, softcap=float("nan"))
    vraises(TypeError, "window_size", *args, window_size=3)
    vraises(ValueError, "is_causal=True", *args, is_causal=True, window_size=(-1, 2))
    vraises(ValueError, "scale must be a finite", *args, scale=float("inf"))
    vraises(ValueError, "kernel must be one of", *args, kernel="fast")


def test_varlen_without_extension(no_extension, monkeypatch):
    monkeypatch.setattr(validation, "check_device", lambda q, k, v, prefix=None: None)
    with pytest.raises(RuntimeError, match="pip install --no-build-isolation"):
        flash_cuda.varlen_attention(*packed())


# ---------------------------------------------------------------------------------------
# Through the mock extension: values of cu_seqlens, empty batches, results
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cu_q,cu_k,max_q,max_k,match", [
    ([1, 3, 8], [0, 4, 9], 5, 5, "bad cu_seqlens_q .*first entry is 1, not 0"),
    ([0, 3, 8], [0, 5, 4], 5, 5, "bad cu_seqlens_k .*decreases at index 2 \\(5 -> 4\\)"),
    ([0, 3, 7], [0, 4, 9], 5, 5, "bad cu_seqlens_q .*last entry is 7, not the number of packed rows 8"),
    ([0, 3, 8], [0, 4, 10], 5, 5, "bad cu_seqlens_k .*last entry is 10"),
    ([0, 3, 8], [0, 4, 9], 4, 5, "bad cu_seqlens_q .*sequence 1 has length 5 > max_seqlen_q = 4"),
    ([0, 3, 8], [0, 4, 9], 5, 4, "bad cu_seqlens_k .*sequence 1 has length 5 > max_seqlen_k = 4"),
])
def test_check_cu_seqlens_values(mock_extension, monkeypatch, cu_q, cu_k, max_q, max_k, match):
    monkeypatch.delenv("FLASH_CUDA_CHECK_CU_SEQLENS", raising=False)
    q, k, v, *_ = packed((3, 5), (4, 5), dtype=F32)
    cu_q, cu_k = torch.tensor(cu_q, dtype=I32), torch.tensor(cu_k, dtype=I32)
    args = (q, k, v, cu_q, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match=match) as info:
        flash_cuda.varlen_attention(*args, check_cu_seqlens=True)
    assert str(info.value).startswith(VARLEN)
    assert mock_extension.fwd_calls == 0
    monkeypatch.setenv("FLASH_CUDA_CHECK_CU_SEQLENS", "1")
    with pytest.raises(ValueError, match=match):
        flash_cuda.varlen_attention(*args)
    monkeypatch.setenv("FLASH_CUDA_CHECK_CU_SEQLENS", "0")
    if "max_seqlen" in match:  # consistent offsets, only the bound is wrong: trusted when off
        flash_cuda.varlen_attention(*args)
        assert mock_extension.fwd_calls == 1


def test_check_cu_seqlens_accepts_good_values(mock_extension):
    args = packed((0, 1, 6, 0), (3, 1, 0, 0), dtype=F32)
    out = flash_cuda.varlen_attention(*args, check_cu_seqlens=True)
    assert out.shape == args[0].shape and mock_extension.fwd_calls == 1


def test_check_cu_seqlens_inside_compiled_graph(mock_extension):
    q, k, v, cu_q, cu_k, mq, mk = packed((3, 5), (4, 5), dtype=F32)

    def f(q, k, v, cu_q, cu_k):
        return flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, check_cu_seqlens=True)

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(cf(q, k, v, cu_q, cu_k), f(q, k, v, cu_q, cu_k), rtol=0, atol=0)
    with pytest.raises(Exception, match="first entry is 1"):
        cf(q, k, v, torch.tensor([1, 3, 8], dtype=I32), cu_k)


@pytest.mark.parametrize("seqlens_q,seqlens_k,max_q,max_k", [
    ((0, 0), (3, 2), 0, 3),      # no query rows
    ((3, 2), (0, 0), 3, 0),      # no keys: every row sees nothing
    ((), (), 0, 0),              # no sequences (cu_seqlens = [0])
    ((3, 2), (4, 1), 0, 4),      # max_seqlen_q = 0 (every query sequence declared empty)
    ((3, 2), (4, 1), 3, 0),      # max_seqlen_k = 0
])
@pytest.mark.parametrize("dtype", [F16, F32])
def test_varlen_empty_without_launch(mock_extension, seqlens_q, seqlens_k, max_q, max_k, dtype):
    q, k, v, cu_q, cu_k, _, _ = packed(seqlens_q, seqlens_k, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True,
                                           is_causal=True, alibi_slopes=torch.ones(4))
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (4, q.shape[0])
    assert lse.dtype == F32 and (out == 0).all() and (lse == -math.inf).all()
    (out.float().sum() + lse.clamp(min=0).sum()).backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()
    assert mock_extension.fwd_calls == 0 and mock_extension.bwd_calls == 0


@pytest.mark.parametrize("dtype", [F16, F32])
def test_varlen_matches_reference_through_autograd(mock_extension, dtype):
    seqlens_q, seqlens_k = (0, 1, 17, 9, 33), (5, 1, 20, 0, 33)
    q, k, v, cu_q, cu_k, mq, mk = packed(seqlens_q, seqlens_k, Hq=6, Hkv=2, dtype=dtype)
    slopes = make_alibi_slopes(6, batch=5, device="cpu")
    opts = dict(is_causal=True, window_size=(6, -1), softcap=3.0, alibi_slopes=slopes, scale=0.4)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_cuda.varlen_attention(qf, kf, vf, cu_q, cu_k, mq + 3, mk, return_lse=True,
                                           **opts)
    assert mock_extension.last_fwd_args["max_seqlen"] == (mq + 3, mk)
    assert mock_extension.last_fwd_args["window"] == (6, 0)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64, l64 = attention_varlen_naive(q64, k64, v64, cu_q, cu_k, **opts)
    tol = 1e-5 if dtype == F32 else 2e-2
    torch.testing.assert_close(out.double(), o64, atol=tol, rtol=0)
    fin = torch.isfinite(l64)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse[fin].double(), l64[fin], atol=1e-5, rtol=0)
    gen = torch.Generator().manual_seed(0)
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    dlse = torch.randn(lse.shape, generator=gen)
    g = torch.autograd.grad((out, lse), (qf, kf, vf), (dout, dlse))
    g64 = torch.autograd.grad((o64, l64), (q64, k64, v64), (dout.double(), dlse.double()))
    for a, b in zip(g, g64):
        assert a.shape == b.shape and a.dtype == dtype
        torch.testing.assert_close(a.double(), b, atol=tol * max(1.0, b.abs().max().item()), rtol=0)
    assert mock_extension.bwd_calls == 1


def test_alibi_gets_no_gradient(mock_extension):
    q, k, v = qkv(dtype=F32)
    slopes = torch.rand(4, requires_grad=True)
    qf = q.requires_grad_()
    out = flash_cuda.attention(qf, k, v, alibi_slopes=slopes)
    out.sum().backward()
    assert qf.grad is not None and slopes.grad is None
    assert not mock_extension.last_fwd_args["alibi_slopes"].requires_grad
