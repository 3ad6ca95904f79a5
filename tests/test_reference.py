"""The pure-PyTorch reference (flash_cuda.reference) on CPU.

* attention_naive float64 against an independent definition (explicit per-row softmax).
* the blocked forward / backward (the kernels' algorithm) against the naive float64
  forward and torch autograd through it: causal and not, Sq != Sk both ways, GQA 1/2/4,
  odd sizes, block sizes that do and do not divide the lengths, fully masked rows, dlse.
* lower precisions: the blocked algorithm obeys the tolerance rule of attn_check.
* self-tests of the attn_check harness, run on CPU through the mock extension.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_cuda import reference as R
from flash_cuda.reference import (attention_backward_blocked, attention_forward_blocked,
                                  attention_naive)

from attn_check import check_attention, climb_scores, make_inputs, naive_chunked

F64 = torch.float64
SIZES = (1, 17, 63, 65, 130)
SEQ_PAIRS = [(1, 1), (1, 17), (17, 1), (17, 17), (63, 65), (65, 63), (130, 17), (17, 130),
             (130, 130), (63, 130), (130, 63), (65, 1), (1, 130)]


def inputs64(B, Hq, Hkv, Sq, Sk, D, seed=0, requires_grad=False):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, F64, "cpu", seed=seed)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def spec_attention(q, k, v, is_causal, scale):
    """Row-by-row definition, independent of the vectorised code (float64, small sizes)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    out = torch.zeros(B, Hq, Sq, D, dtype=F64)
    lse = torch.full((B, Hq, Sq), -math.inf, dtype=F64)
    for b in range(B):
        for h in range(Hq):
            hk = h // (Hq // Hkv)
            for i in range(Sq):
                n_vis = Sk if not is_causal else max(0, min(Sk, i + Sk - Sq + 1))
                if n_vis == 0:
                    continue
                s = (k[b, hk, :n_vis] @ q[b, h, i]) * scale
                m = s.max()
                w = torch.exp(s - m)
                out[b, h, i] = (w / w.sum()) @ v[b, hk, :n_vis]
                lse[b, h, i] = m + torch.log(w.sum())
    return out, lse


def assert_close64(a, b, name, atol=1e-10):
    assert a.shape == b.shape, (name, a.shape, b.shape)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb), f"{name}: finiteness pattern differs"
    assert torch.equal(a[~fa], b[~fb]), f"{name}: non-finite values differ"
    err = (a[fa].double() - b[fb].double()).abs().max().item() if fa.any() else 0.0
    assert err <= atol, f"{name}: max abs err {err:.3e} > {atol:.1e}"


# ---------------------------------------------------------------------------------------
# attention_naive
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(1, 1), (5, 9), (9, 5), (7, 7), (1, 6), (6, 1)])
@pytest.mark.parametrize("groups", [1, 2])
def test_naive_matches_row_definition(is_causal, Sq, Sk, groups):
    q, k, v = inputs64(2, 2 * groups, 2, Sq, Sk, 8, seed=Sq * 10 + Sk)
    scale = 0.7
    out, lse = attention_naive(q, k, v, is_causal=is_causal, scale=scale)
    out_s, lse_s = spec_attention(q, k, v, is_causal, scale)
    assert_close64(out, out_s, "out")
    assert_close64(lse, lse_s, "lse")


@pytest.mark.parametrize("is_causal", [False, True])
def test_naive_matches_sdpa_when_square(is_causal):
    q, k, v = inputs64(2, 4, 4, 33, 33, 16, seed=5)
    out, _ = attention_naive(q, k, v, is_causal=is_causal)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    assert_close64(out, ref, "out")


def test_naive_fully_masked_rows_no_nan_in_grad():
    q, k, v = inputs64(1, 2, 1, 9, 4, 8, requires_grad=True)
    out, lse = attention_naive(q, k, v, is_causal=True)
    # query i sees keys j <= i + 4 - 9 = i - 5: rows 0..4 see nothing
    assert torch.equal(lse[:, :, :5], torch.full_like(lse[:, :, :5], -math.inf))
    assert torch.isfinite(lse[:, :, 5:]).all()
    assert (out[:, :, :5] == 0).all()
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.randn_like(out), torch.randn_like(lse)))
    for g in grads:
        assert torch.isfinite(g).all()
    assert (grads[0][:, :, :5] == 0).all()


def test_naive_empty_keys():
    q, k, v = inputs64(1, 1, 1, 3, 0, 8)
    out, lse = attention_naive(q, k, v)
    assert out.shape == (1, 1, 3, 8) and (out == 0).all()
    assert (lse == -math.inf).all()


# ---------------------------------------------------------------------------------------
# Blocked forward / backward versus the naive float64 reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_blocked_forward_matches_naive(is_causal, Sq, Sk, groups):
    D = 8 * (1 + (Sq + Sk + groups) % 3)
    q, k, v = inputs64(2, 2 * groups, 2, Sq, Sk, D, seed=Sq + 7 * Sk + groups)
    out_ref, lse_ref = attention_naive(q, k, v, is_causal=is_causal)
    for bm, bn in ((64, 64), (16, 32), (32, 16)):
        out, lse = attention_forward_blocked(q, k, v, is_causal=is_causal, block_m=bm, block_n=bn)
        assert out.dtype == F64 and lse.dtype == F64
        assert_close64(out, out_ref, f"out bm={bm} bn={bn}")
        assert_close64(lse, lse_ref, f"lse bm={bm} bn={bn}")


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", SEQ_PAIRS)
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_blocked_backward_matches_autograd(is_causal, Sq, Sk, groups):
    D = 8 * (1 + (Sq * 3 + Sk + groups) % 3)
    with_dlse = (Sq + Sk + groups) % 2 == 0
    q, k, v = inputs64(1, 2 * groups, 2, Sq, Sk, D, seed=3 * Sq + Sk + groups, requires_grad=True)
    scale = 0.3 if groups == 2 else None
    out, lse = attention_naive(q, k, v, is_causal=is_causal, scale=scale)
    g = torch.Generator().manual_seed(Sq * 1000 + Sk)
    dout = torch.randn(out.shape, dtype=F64, generator=g)
    dlse = torch.randn(lse.shape, dtype=F64, generator=g) if with_dlse else None
    if with_dlse:
        ref = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    else:
        ref = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out_b, lse_b = attention_forward_blocked(qd, kd, vd, is_causal=is_causal, scale=scale)
    for bm, bn in ((64, 64), (16, 32)):
        grads = attention_backward_blocked(dout, qd, kd, vd, out_b, lse_b, is_causal=is_causal,
                                           scale=scale, dlse=dlse, block_m=bm, block_n=bn)
        for name, a, b in zip(("dq", "dk", "dv"), grads, ref):
            assert a.shape == b.shape and a.dtype == F64
            assert_close64(a, b, f"{name} bm={bm} bn={bn} dlse={with_dlse}")


def test_blocked_fully_masked_rows():
    """Sq > Sk under causal masking: the first Sq - Sk rows see no key."""
    q, k, v = inputs64(1, 4, 2, 130, 17, 16, seed=11)
    out, lse = attention_forward_blocked(q, k, v, is_causal=True, block_m=32, block_n=16)
    assert (lse[:, :, :113] == -math.inf).all() and torch.isfinite(lse[:, :, 113:]).all()
    assert (out[:, :, :113] == 0).all()
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse)
    dq, dk, dv = attention_backward_blocked(dout, q, k, v, out, lse, is_causal=True, dlse=dlse,
                                            block_m=32, block_n=16)
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()
    assert (dq[:, :, :113] == 0).all()


@pytest.mark.parametrize("B,Sq,Sk", [(0, 5, 5), (1, 0, 5), (1, 5, 0)])
def test_blocked_empty(B, Sq, Sk):
    q, k, v = inputs64(B, 2, 1, Sq, Sk, 8)
    out, lse = attention_forward_blocked(q, k, v, is_causal=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert (out == 0).all() and (lse == -math.inf).all()
    dq, dk, dv = attention_backward_blocked(torch.randn_like(out), q, k, v, out, lse, is_causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_causal_block_skipping_matches_no_skipping():
    """Skipping key blocks above the diagonal changes nothing (they are fully masked)."""
    q, k, v = inputs64(1, 2, 2, 130, 63, 8, seed=2)
    a = attention_forward_blocked(q, k, v, is_causal=True, block_m=16, block_n=16)
    b = attention_forward_blocked(q, k, v, is_causal=True, block_m=130, block_n=130)
    assert_close64(a[0], b[0], "out")
    assert_close64(a[1], b[1], "lse")


@pytest.mark.parametrize("rise", [3.0, 20.0, -4.0])
def test_lagging_max_changes_nothing(rise):
    """The kernels' lagging running max (merge_block_stats' max_lag) gives the exact result:
    scores that climb slowly (max kept, P up to 2^8), steeply (moved every block) or fall."""
    q, k, v = inputs64(1, 2, 1, 70, 300, 16, seed=5)
    q, k = climb_scores(q, k, rise, 0.25)
    exact = attention_forward_blocked(q, k, v, scale=0.25, block_m=32, block_n=32)
    lagged = attention_forward_blocked(q, k, v, scale=0.25, block_m=32, block_n=32, max_lag=8.0)
    assert_close64(lagged[0], exact[0], "out")
    assert_close64(lagged[1], exact[1], "lse")
    # a lag as large as the climb keeps the first block's max to the end
    m = torch.full((1, 4), -math.inf, dtype=F64)
    m2, _, _ = R.merge_block_stats(m, torch.zeros(1, 4, dtype=F64), torch.zeros(1, 4, 2, dtype=F64),
                                   torch.tensor([[1.0, 2.0, 3.0, -math.inf]], dtype=F64), 8.0)
    assert m2.tolist() == [[1.0, 2.0, 3.0, -math.inf]]
    m3, _, _ = R.merge_block_stats(m2, torch.ones(1, 4, dtype=F64), torch.ones(1, 4, 2, dtype=F64),
                                   torch.tensor([[9.0, 10.5, 4.0, 0.0]], dtype=F64), 8.0)
    assert m3.tolist() == [[1.0, 10.5, 3.0, 0.0]]


def test_step_functions_exist():
    for name in ("compute_qk_scores_and_max", "merge_block_stats",
                 "compute_block_softmax_and_weighted_v", "normalize_output"):
        assert callable(getattr(R, name)), name


def test_online_softmax_steps_by_hand():
    """Two key blocks through the four steps equal one softmax over both."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 4, 8, dtype=F64, generator=g)
    k = torch.randn(1, 1, 1, 6, 8, dtype=F64, generator=g)
    v = torch.randn(1, 1, 1, 6, 8, dtype=F64, generator=g)
    sl2 = 0.5 * R.LOG2E
    m = torch.full((1, 1, 1, 4), -math.inf, dtype=F64)
    l = torch.zeros((1, 1, 1, 4), dtype=F64)
    o = torch.zeros((1, 1, 1, 4, 8), dtype=F64)
    for blk in (slice(0, 3), slice(3, 6)):
        s, bmax = R.compute_qk_scores_and_max(q, k[..., blk, :], sl2, None)
        m, l, o = R.merge_block_stats(m, l, o, bmax)
        l, o = R.compute_block_softmax_and_weighted_v(s, l, o, m, v[..., blk, :], F64)
    out, lse = R.normalize_output(o, l, m, F64)
    s_full = 0.5 * q @ k.transpose(-1, -2)
    assert_close64(out, torch.softmax(s_full, -1) @ v, "out")
    assert_close64(lse, torch.logsumexp(s_full, -1), "lse")


# ---------------------------------------------------------------------------------------
# Lower precisions: the blocked algorithm obeys the accuracy rule of the kernels' tests
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(65, 130), (130, 17), (63, 63)])
def test_blocked_low_precision_tolerance(dtype, is_causal, Sq, Sk):
    q, k, v = make_inputs(1, 4, 2, Sq, Sk, 32, dtype, "cpu", seed=Sq + Sk)
    out, lse = attention_forward_blocked(q, k, v, is_causal=is_causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_naive(q64, k64, v64, is_causal=is_causal)
    outn, lsen = attention_naive(q, k, v, is_causal=is_causal)
    base = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]

    def check(name, x, ref, naive):
        fin = torch.isfinite(ref)
        err = (x.double() - ref)[fin].abs().max().item()
        err_n = (naive.double() - ref)[fin].abs().max().item()
        tol = 2 * err_n + base * max(ref[fin].abs().max().item(), 1.0 if name == "lse" else 1e-3)
        assert err <= tol, f"{name}: {err:.3e} > {tol:.3e} (naive {err_n:.3e})"

    check("out", out, out64, outn)
    check("lse", lse, lse64, lsen)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = attention_backward_blocked(dout, q, k, v, out, lse, is_causal=is_causal)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    qn, kn, vn = (t.clone().requires_grad_() for t in (q, k, v))
    on, _ = attention_naive(qn, kn, vn, is_causal=is_causal)
    naive = torch.autograd.grad(on, (qn, kn, vn), dout)
    for name, a, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert a.dtype == dtype
        check(name, a, r, n)


# ---------------------------------------------------------------------------------------
# attn_check harness self-tests (CPU, through the mock extension)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "strided", "offset", "misaligned"])
def test_make_inputs_layouts(layout):
    q, k, v = make_inputs(2, 4, 2, 5, 7, 16, torch.float16, "cpu", layout=layout, seed=3)
    assert q.shape == (2, 4, 5, 16) and k.shape == v.shape == (2, 2, 7, 16)
    for t in (q, k, v):
        assert t.dtype == torch.float16 and t.stride(-1) == 1
        assert (t != 0).float().mean() > 0.95
    if layout == "bhsd":
        assert q.is_contiguous()
    if layout == "bshd":
        assert not q.is_contiguous() and q.transpose(1, 2).is_contiguous()
    if layout == "strided":
        assert not q.is_contiguous() and q.stride(2) > 16
    if layout == "offset":
        assert q.is_contiguous() and q.storage_offset() > 0 and q.storage_offset() % 8 == 0
    if layout == "misaligned":
        assert q.storage_offset() % 8 != 0
    assert not torch.equal(q[:, :2], k[:, :2, :5])
    q2, _, _ = make_inputs(2, 4, 2, 5, 7, 16, torch.float16, "cpu", layout=layout, seed=3)
    assert torch.equal(q, q2)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(100, 37), (37, 100)])
def test_naive_chunked_equals_naive(is_causal, Sq, Sk):
    q, k, v = make_inputs(1, 2, 1, Sq, Sk, 8, torch.float32, "cpu", seed=4)
    a = naive_chunked(q, k, v, is_causal=is_causal, scale=None, dtype=F64, chunk=16)
    b = attention_naive(q.double(), k.double(), v.double(), is_causal=is_causal)
    assert_close64(a[0], b[0], "out", atol=1e-12)
    assert_close64(a[1], b[1], "lse", atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["bhsd", "bshd", "strided"])
def test_check_attention_accepts_reference_kernel(mock_extension, dtype, is_causal, layout):
    q, k, v = make_inputs(2, 4, 2, 70, 45, 24, dtype, "cpu", layout=layout, seed=1)
    res = check_attention(q, k, v, is_causal=is_causal, scale=None, label="self-test",
                          with_dlse=is_causal)
    assert set(res) == {"out", "lse", "dq", "dk", "dv"}
    assert mock_extension.fwd_calls == 1 and mock_extension.bwd_calls == 1


def test_check_attention_detects_wrong_output(mock_extension):
    fwd = mock_extension.fwd

    def bad_fwd(*args):
        out, lse, aux = fwd(*args)
        out[0, 0, 3, 5] += 0.05  # one wrong element
        return out, lse, aux

    mock_extension.fwd = bad_fwd
    from flash_cuda import _ext
    _ext._C.fwd = bad_fwd
    q, k, v = make_inputs(1, 2, 2, 20, 20, 16, torch.float16, "cpu", seed=2)
    with pytest.raises(AssertionError, match="out: max"):
        check_attention(q, k, v, is_causal=False, scale=None, check_grad=False, label="bad")


def test_check_attention_detects_nan_and_mask_errors(mock_extension):
    from flash_cuda import _ext
    fwd = mock_extension.fwd

    def nan_fwd(*args):
        out, lse, aux = fwd(*args)
        out[0, 0, 0, 0] = float("nan")  # a fully masked row that is NaN instead of 0
        lse[0, 0, 0] = 0.0
        return out, lse, aux

    _ext._C.fwd = nan_fwd
    q, k, v = make_inputs(1, 1, 1, 8, 4, 8, torch.float32, "cpu", seed=2)
    with pytest.raises(AssertionError) as info:
        check_attention(q, k, v, is_causal=True, scale=None, check_grad=False, label="nan")
    msg = str(info.value)
    assert "-inf pattern" in msg and "non-finite" in msg and "Sq=8 Sk=4" in msg


def test_check_attention_detects_wrong_gradient(mock_extension):
    from flash_cuda import _ext
    bwd = mock_extension.bwd

    def bad_bwd(*args):
        dq, dk, dv = bwd(*args)
        return dq, dk * 1.01, dv
    _ext._C.bwd = bad_bwd
    q, k, v = make_inputs(1, 2, 1, 30, 30, 16, torch.float32, "cpu", seed=2)
    with pytest.raises(AssertionError, match="dk: max"):
        check_attention(q, k, v, is_causal=True, scale=0.5, label="bad grad")
