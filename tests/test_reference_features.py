"""The reference's sliding window, softcap, ALiBi and packed (varlen) batches, on CPU.

* ``spec_attention`` below states the semantics independently of flash_cuda.reference:
  an explicit visibility matrix and an explicit ALiBi distance matrix built element by
  element in Python, k / v repeated over the GQA group, a plain softmax. In float64:
  attention_naive (forward and autograd gradients) and the blocked forward / backward
  (the kernels' algorithm, several block sizes, with dlse) must match it for every
  feature alone and all combined, with GQA, causal, Sq != Sk, odd lengths, and rows that
  see no key.
* Block skipping: the blocked forward and backward visit exactly the tiles that meet the
  window and mask exactly the tiles that a window edge or the end of the keys cuts.
* Lower precisions: the blocked algorithm with the features obeys attn_check's rule.
* Packed batches: attention_varlen_naive and the blocked varlen forward / backward
  against the spec per sequence, with empty and length-1 sequences, and against a dense
  batch when every sequence has the same length.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_cuda import reference as R
from flash_cuda.reference import (attention_backward_blocked, attention_forward_blocked,
                                  attention_naive, attention_varlen_backward_blocked,
                                  attention_varlen_forward_blocked, attention_varlen_naive)

from attn_check import cu_seqlens_from_lengths, make_alibi_slopes, make_inputs
from test_reference import assert_close64  # one float64 comparison for both reference suites

F64 = torch.float64
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------
# The independent statement of the semantics
# ---------------------------------------------------------------------------------------


def spec_visible(Sq, Sk, is_causal, window):
    left, right = window
    if is_causal:
        right = 0
    rows = []
    for i in range(Sq):
        d = i + Sk - Sq
        rows.append([(left < 0 or j >= d - left) and (right < 0 or j <= d + right)
                     for j in range(Sk)])
    return torch.tensor(rows, dtype=torch.bool).reshape(Sq, Sk)


def spec_distance(Sq, Sk):
    return torch.tensor([[abs(i + Sk - Sq - j) for j in range(Sk)] for i in range(Sq)],
                        dtype=F64).reshape(Sq, Sk)


def spec_attention(q, k, v, *, is_causal=False, scale=None, window=(-1, -1), softcap=0.0,
                   alibi=None):
    """float64, (B, H, S, D); differentiable, NaN-free for rows that see no key."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    if Sk == 0:
        return q.new_zeros(q.shape), q.new_full((B, Hq, Sq), NEG_INF)
    kr = k.repeat_interleave(Hq // Hkv, dim=1)
    vr = v.repeat_interleave(Hq // Hkv, dim=1)
    x = torch.einsum("bhid,bhjd->bhij", q, kr) * scale
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    if alibi is not None:
        x = x - alibi.to(F64).reshape(-1, Hq, 1, 1) * spec_distance(Sq, Sk)
    x = torch.where(spec_visible(Sq, Sk, is_causal, window), x, torch.full_like(x, NEG_INF))
    m = x.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(x - m)
    l = w.sum(dim=-1, keepdim=True)
    has = l > 0
    l_safe = torch.where(has, l, torch.ones_like(l))
    out = (w @ vr) / l_safe
    lse = torch.where(has, m + torch.log(l_safe), torch.full_like(l, NEG_INF)).squeeze(-1)
    return out, lse




def _slopes(kind, B, Hq, seed=0):
    if kind is None:
        return None
    return make_alibi_slopes(Hq, batch=B if kind == "batch" else None, device="cpu", seed=seed)


# (id, B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap, alibi kind, scale)
CASES = [
    ("window-left", 2, 4, 2, 37, 53, 16, False, (7, -1), 0.0, None, None),
    ("window-right", 1, 2, 2, 45, 29, 8, False, (-1, 3), 0.0, None, None),
    ("window-both", 1, 4, 4, 65, 65, 16, False, (5, 9), 0.0, None, 0.5),
    ("window-diag-sq>sk", 1, 2, 1, 33, 17, 8, False, (0, 0), 0.0, None, None),
    ("window-right0", 1, 2, 1, 23, 40, 8, False, (3, 0), 0.0, None, None),
    ("window-causal", 1, 2, 1, 70, 70, 8, True, (10, -1), 0.0, None, None),
    ("window-causal-sq>sk", 2, 2, 2, 90, 31, 8, True, (4, 0), 0.0, None, None),
    ("window-wider-than-seq", 1, 2, 2, 20, 30, 8, False, (100, 100), 0.0, None, None),
    ("window-sq<sk-no-key", 1, 2, 2, 9, 40, 8, False, (-1, -1), 0.0, None, None),
    ("softcap", 2, 4, 2, 41, 39, 16, False, (-1, -1), 0.7, None, 1.0),
    ("softcap-causal", 1, 2, 2, 30, 50, 16, True, (-1, -1), 5.0, None, 2.0),
    ("alibi-heads", 2, 4, 2, 37, 45, 8, False, (-1, -1), 0.0, "heads", None),
    ("alibi-batch-causal", 2, 4, 4, 50, 33, 8, True, (-1, -1), 0.0, "batch", None),
    ("alibi-sq>sk", 1, 2, 1, 60, 20, 8, False, (-1, -1), 0.0, "heads", None),
    ("all-causal-gqa", 2, 8, 2, 67, 131, 24, True, (33, -1), 1.5, "batch", 0.9),
    ("all-window-both", 2, 6, 3, 99, 47, 16, False, (20, 6), 2.0, "heads", None),
    ("all-sq>sk", 1, 4, 1, 129, 63, 8, True, (17, 0), 0.5, "batch", None),
    ("all-mqa-odd", 1, 3, 1, 1, 77, 8, False, (5, 2), 3.0, "heads", 0.4),
]
CASE_IDS = [c[0] for c in CASES]


def _case(case, seed, requires_grad=False):
    _, B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap, alibi_kind, scale = case
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, F64, "cpu", seed=seed)
    q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
    opts = dict(is_causal=is_causal, scale=scale, window_size=window, softcap=softcap,
                alibi_slopes=_slopes(alibi_kind, B, Hq, seed))
    spec_opts = dict(is_causal=is_causal, scale=scale, window=window, softcap=softcap,
                     alibi=opts["alibi_slopes"])
    return q, k, v, opts, spec_opts


def _grads(fn, q, k, v, with_dlse, seed):
    out, lse = fn(q, k, v)
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, dtype=F64, generator=g)
    dlse = torch.randn(lse.shape, dtype=F64, generator=g)
    if with_dlse:
        grads = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse), allow_unused=True)
    else:
        grads = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
    grads = tuple(torch.zeros_like(t) if gr is None else gr for gr, t in zip(grads, (q, k, v)))
    return out.detach(), lse.detach(), grads, dout, (dlse if with_dlse else None)


# ---------------------------------------------------------------------------------------
# Visibility helpers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("Sq,Sk", [(7, 7), (5, 12), (12, 5), (1, 9), (9, 1)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (2, -1), (-1, 3), (3, 1), (0, 4)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_key_visible_matches_spec(Sq, Sk, window, is_causal):
    if is_causal and window[1] > 0:
        with pytest.raises(ValueError, match="is_causal"):
            R.normalize_window(is_causal, window)
        return
    wl, wr = R.normalize_window(is_causal, window)
    vis = R.key_visible(torch.arange(Sq), torch.arange(Sk), Sq, Sk, wl, wr)
    assert torch.equal(vis, spec_visible(Sq, Sk, is_causal, window))
    # block padding: keys past the end are never visible
    pad = R.key_visible(torch.arange(Sq + 3), torch.arange(Sk + 5), Sq, Sk, wl, wr)
    assert not pad[:, Sk:].any() and torch.equal(pad[:Sq, :Sk], vis)


def test_causal_visible_is_window_minus1_0():
    rows, cols = torch.arange(9), torch.arange(13)
    assert torch.equal(R.causal_visible(rows, cols, 9, 13), R.key_visible(rows, cols, 9, 13, -1, 0))
    assert torch.equal(R.causal_visible(rows, cols, 9, 13), spec_visible(9, 13, True, (-1, -1)))


def test_normalize_window():
    assert R.normalize_window(False, (-1, -1)) == (-1, -1)
    assert R.normalize_window(True, (-1, -1)) == (-1, 0)
    assert R.normalize_window(True, (5, 0)) == (5, 0)
    assert R.normalize_window(False, [3, 4]) == (3, 4)
    with pytest.raises(ValueError):
        R.normalize_window(False, (-2, 0))


def test_alibi_bias_distance():
    assert torch.equal(R.alibi_bias(torch.arange(4), torch.arange(6), 4, 6).double(),
                       spec_distance(4, 6))


# ---------------------------------------------------------------------------------------
# float64: naive and blocked against the spec
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_naive_matches_spec(case):
    seed = CASE_IDS.index(case[0])
    q, k, v, opts, spec_opts = _case(case, seed, requires_grad=True)
    with_dlse = seed % 2 == 0
    out, lse, grads, dout, dlse = _grads(lambda *t: attention_naive(*t, **opts), q, k, v,
                                         with_dlse, seed)
    out_s, lse_s, grads_s, _, _ = _grads(lambda *t: spec_attention(*t, **spec_opts), q, k, v,
                                         with_dlse, seed)
    assert_close64(out, out_s, "out")
    assert_close64(lse, lse_s, "lse")
    for name, a, b in zip(("dq", "dk", "dv"), grads, grads_s):
        assert torch.isfinite(a).all(), f"{name}: NaN/inf"
        assert_close64(a, b, name)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_blocked_forward_matches_spec(case):
    seed = CASE_IDS.index(case[0])
    q, k, v, opts, spec_opts = _case(case, seed)
    out_s, lse_s = spec_attention(q, k, v, **spec_opts)
    for bm, bn in ((64, 64), (16, 32), (32, 16)):
        out, lse = attention_forward_blocked(q, k, v, block_m=bm, block_n=bn, **opts)
        assert out.dtype == F64 and lse.dtype == F64
        assert_close64(out, out_s, f"out bm={bm} bn={bn}")
        assert_close64(lse, lse_s, f"lse bm={bm} bn={bn}")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_blocked_backward_matches_spec_autograd(case):
    seed = CASE_IDS.index(case[0])
    q, k, v, opts, spec_opts = _case(case, seed, requires_grad=True)
    with_dlse = seed % 2 == 1
    _, _, grads_s, dout, dlse = _grads(lambda *t: spec_attention(*t, **spec_opts), q, k, v,
                                       with_dlse, seed)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = attention_forward_blocked(qd, kd, vd, **opts)
    for bm, bn in ((64, 64), (16, 32)):
        grads = attention_backward_blocked(dout, qd, kd, vd, out, lse, dlse=dlse, block_m=bm,
                                           block_n=bn, **opts)
        for name, a, b in zip(("dq", "dk", "dv"), grads, grads_s):
            assert a.dtype == F64 and torch.isfinite(a).all()
            assert_close64(a, b, f"{name} bm={bm} bn={bn} dlse={with_dlse}")


def test_rows_without_keys_in_a_window():
    """A window that leaves some rows without a key: out 0, lse -inf, zero dq, no NaN."""
    q, k, v = make_inputs(1, 2, 1, 40, 12, 8, F64, "cpu", seed=3)
    opts = dict(window_size=(2, 1), softcap=1.0, alibi_slopes=make_alibi_slopes(2, device="cpu"))
    # query i sits at key i - 28 and sees keys i - 30 .. i - 27: rows 0..26 see nothing
    vis = spec_visible(40, 12, False, (2, 1))
    empty = ~vis.any(dim=1)
    assert empty[:27].all() and not empty[27:].any()
    out, lse = attention_forward_blocked(q, k, v, block_m=16, block_n=8, **opts)
    assert (lse[..., empty] == NEG_INF).all() and torch.isfinite(lse[..., ~empty]).all()
    assert (out[..., empty, :] == 0).all()
    dq, dk, dv = attention_backward_blocked(torch.randn_like(out), q, k, v, out, lse,
                                            dlse=torch.randn_like(lse), block_m=16, block_n=8,
                                            **opts)
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[..., empty, :] == 0).all()


def test_softcap_limits_logits():
    """With softcap c every logit lies in (-c, c): lse <= c + log(Sk)."""
    q, k, v = make_inputs(1, 2, 2, 20, 30, 16, F64, "cpu", seed=5)
    _, lse = attention_naive(q * 10, k * 10, v, softcap=2.0, scale=1.0)
    assert (lse <= 2.0 + math.log(30)).all() and (lse >= -2.0 + math.log(30)).all()


# ---------------------------------------------------------------------------------------
# Block skipping: exactly the tiles that meet the window, masked only where needed
# ---------------------------------------------------------------------------------------


def _expected_tiles(Sq, Sk, bm, bn, vis, pad_cols):
    """(visited, masked) tile counts by brute force over the spec's visibility matrix.
    ``pad_cols``: a tile spans block_n columns (forward), else only the keys (backward)."""
    visited = masked = 0
    for r0 in range(0, Sq, bm):
        for c0 in range(0, Sk, bn):
            tile = vis[r0:r0 + bm, c0:c0 + bn]
            if not tile.any():
                continue
            visited += 1
            if not tile.all() or (pad_cols and c0 + bn > Sk):
                masked += 1
    return visited, masked


@pytest.mark.parametrize("Sq,Sk,is_causal,window", [
    (256, 256, True, (40, -1)), (200, 256, False, (30, 20)), (256, 200, True, (-1, -1)),
    (130, 130, False, (0, 0)), (96, 300, False, (-1, 10)), (300, 96, False, (64, -1)),
    (128, 128, False, (-1, -1)),
])
def test_block_skipping_and_masking(monkeypatch, Sq, Sk, is_causal, window):
    bm, bn = 32, 16
    q, k, v = make_inputs(1, 2, 1, Sq, Sk, 8, F64, "cpu", seed=Sq + Sk)
    vis = spec_visible(Sq, Sk, is_causal, window)
    calls = {"fwd": [0, 0], "bwd": [0, 0]}
    step1, recompute = R.compute_qk_scores_and_max, R._recompute_p_ds

    def count_fwd(q_blk, k_blk, scale_log2, visible, *args):
        calls["fwd"][0] += 1
        calls["fwd"][1] += visible is not None
        return step1(q_blk, k_blk, scale_log2, visible, *args)

    def count_bwd(*args):
        calls["bwd"][0] += 1
        calls["bwd"][1] += args[7] is not None
        return recompute(*args)

    monkeypatch.setattr(R, "compute_qk_scores_and_max", count_fwd)
    monkeypatch.setattr(R, "_recompute_p_ds", count_bwd)
    out, lse = R.attention_forward_blocked(q, k, v, is_causal=is_causal, window_size=window,
                                           block_m=bm, block_n=bn)
    R.attention_backward_blocked(torch.randn_like(out), q, k, v, out, lse, is_causal=is_causal,
                                 window_size=window, block_m=bm, block_n=bn)
    assert tuple(calls["fwd"]) == _expected_tiles(Sq, Sk, bm, bn, vis, pad_cols=True)
    visited, masked = _expected_tiles(Sq, Sk, bm, bn, vis, pad_cols=False)
    assert tuple(calls["bwd"]) == (2 * visited, 2 * masked)  # the dK/dV pass and the dQ pass
    if window != (-1, -1) or is_causal:
        n_tiles = -(-Sq // bm) * -(-Sk // bn)
        assert calls["fwd"][0] < n_tiles  # something was skipped
    out_s, lse_s = spec_attention(q, k, v, is_causal=is_causal, window=window)
    assert_close64(out, out_s, "out")
    assert_close64(lse, lse_s, "lse")


# ---------------------------------------------------------------------------------------
# Lower precisions: the blocked algorithm with the features obeys attn_check's rule
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("feature", ["window", "softcap", "alibi", "all"])
def test_blocked_low_precision_tolerance_features(dtype, feature):
    Sq, Sk = 97, 130
    q, k, v = make_inputs(1, 4, 2, Sq, Sk, 32, dtype, "cpu", seed=len(feature))
    opts = {"window": dict(window_size=(20, 5)),
            "softcap": dict(softcap=1.5, scale=0.5),
            "alibi": dict(alibi_slopes=make_alibi_slopes(4, device="cpu"), is_causal=True),
            "all": dict(window_size=(40, -1), is_causal=True, softcap=4.0,
                        alibi_slopes=make_alibi_slopes(4, batch=1, device="cpu"))}[feature]
    out, lse = attention_forward_blocked(q, k, v, **opts)
    assert out.dtype == dtype and lse.dtype == torch.float32
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out64, lse64 = attention_naive(q64, k64, v64, **opts)
    outn, lsen = attention_naive(q, k, v, **opts)
    base = {torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]

    def check(name, x, ref, naive):
        fin = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(x), fin), f"{name}: finiteness pattern"
        err = (x.double() - ref)[fin].abs().max().item()
        err_n = (naive.double() - ref)[fin].abs().max().item()
        tol = 2 * err_n + base * max(ref[fin].abs().max().item(), 1.0)
        assert err <= tol, f"{name}: {err:.3e} > {tol:.3e} (naive {err_n:.3e})"

    check("out", out, out64, outn)
    check("lse", lse, lse64, lsen)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = attention_backward_blocked(dout, q, k, v, out, lse, **opts)
    ref = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    qn, kn, vn = (t.clone().requires_grad_() for t in (q, k, v))
    on, _ = attention_naive(qn, kn, vn, **opts)
    naive = torch.autograd.grad(on, (qn, kn, vn), dout)
    for name, a, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert a.dtype == dtype
        check(name, a, r, n)


# ---------------------------------------------------------------------------------------
# Packed (varlen) batches
# ---------------------------------------------------------------------------------------


def _packed(seqlens_q, seqlens_k, Hq, Hkv, D, seed, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(seqlens_q), Hq, D, generator=g, dtype=dtype)
    k = torch.randn(sum(seqlens_k), Hkv, D, generator=g, dtype=dtype)
    v = torch.randn(sum(seqlens_k), Hkv, D, generator=g, dtype=dtype)
    return (q, k, v, cu_seqlens_from_lengths(seqlens_q, "cpu"),
            cu_seqlens_from_lengths(seqlens_k, "cpu"))


def _spec_varlen(q, k, v, seqlens_q, seqlens_k, **spec_opts):
    """The spec per sequence, packed: out (total_q, Hq, D), lse (Hq, total_q)."""
    alibi = spec_opts.pop("alibi", None)
    outs, lses = [], []
    qa = ka = 0
    for b, (nq, nk) in enumerate(zip(seqlens_q, seqlens_k)):
        slopes = alibi if alibi is None or alibi.dim() == 1 else alibi[b]
        o, l = spec_attention(q[qa:qa + nq].transpose(0, 1)[None],
                              k[ka:ka + nk].transpose(0, 1)[None],
                              v[ka:ka + nk].transpose(0, 1)[None], alibi=slopes, **spec_opts)
        outs.append(o[0].transpose(0, 1))
        lses.append(l[0])
        qa, ka = qa + nq, ka + nk
    return torch.cat(outs, 0), torch.cat(lses, 1)


# (id, seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, softcap, alibi kind, scale)
VARLEN_CASES = [
    ("plain", [5, 17, 1], [5, 17, 1], 2, 2, 8, False, (-1, -1), 0.0, None, None),
    ("empty-and-len1", [0, 1, 17, 6, 0, 33, 1], [3, 1, 0, 40, 0, 33, 9], 4, 2, 8, True,
     (-1, -1), 0.0, None, None),
    ("window-gqa", [40, 9, 70], [35, 50, 70], 6, 2, 16, False, (7, 3), 0.0, None, 0.6),
    ("causal-window-alibi-batch", [33, 1, 64], [64, 1, 33], 4, 1, 8, True, (12, -1), 0.0,
     "batch", None),
    ("all", [29, 0, 50, 1], [31, 7, 50, 1], 4, 2, 16, True, (9, 0), 1.5, "heads", 0.8),
]
VARLEN_IDS = [c[0] for c in VARLEN_CASES]


def _varlen_case(case, seed):
    _, sq, sk, Hq, Hkv, D, is_causal, window, softcap, alibi_kind, scale = case
    q, k, v, cu_q, cu_k = _packed(sq, sk, Hq, Hkv, D, seed)
    alibi = _slopes(alibi_kind, len(sq), Hq, seed)
    opts = dict(is_causal=is_causal, scale=scale, window_size=window, softcap=softcap,
                alibi_slopes=alibi)
    spec_opts = dict(is_causal=is_causal, scale=scale, window=window, softcap=softcap, alibi=alibi)
    return q, k, v, cu_q, cu_k, opts, spec_opts


@pytest.mark.parametrize("case", VARLEN_CASES, ids=VARLEN_IDS)
def test_varlen_naive_and_blocked_match_spec(case):
    seed = VARLEN_IDS.index(case[0])
    sq, sk = case[1], case[2]
    q, k, v, cu_q, cu_k, opts, spec_opts = _varlen_case(case, seed)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with_dlse = seed % 2 == 0

    out_s, lse_s, grads_s, dout, dlse = _grads(
        lambda *t: _spec_varlen(*t, sq, sk, **dict(spec_opts)), qg, kg, vg, with_dlse, seed)
    out_n, lse_n, grads_n, _, _ = _grads(
        lambda *t: attention_varlen_naive(*t, cu_q, cu_k, **opts), qg, kg, vg, with_dlse, seed)
    assert out_n.shape == q.shape and lse_n.shape == (q.shape[1], q.shape[0])
    assert_close64(out_n, out_s, "naive out")
    assert_close64(lse_n, lse_s, "naive lse")
    for name, a, b in zip(("dq", "dk", "dv"), grads_n, grads_s):
        assert_close64(a, b, f"naive {name}")

    for bm, bn in ((64, 64), (16, 32)):
        out_b, lse_b = attention_varlen_forward_blocked(q, k, v, cu_q, cu_k, block_m=bm,
                                                        block_n=bn, **opts)
        assert_close64(out_b, out_s, f"blocked out bm={bm}")
        assert_close64(lse_b, lse_s, f"blocked lse bm={bm}")
        grads_b = attention_varlen_backward_blocked(dout, q, k, v, out_b, lse_b, cu_q, cu_k,
                                                    dlse=dlse, block_m=bm, block_n=bn, **opts)
        for name, a, b in zip(("dq", "dk", "dv"), grads_b, grads_s):
            assert a.shape == b.shape and torch.isfinite(a).all()
            assert_close64(a, b, f"blocked {name} bm={bm}")


def test_varlen_rows_of_empty_key_sequences():
    """A query sequence whose key sequence is empty: out 0, lse -inf."""
    q, k, v, cu_q, cu_k = _packed([3, 4, 2], [5, 0, 1], 2, 1, 8, seed=1)
    out, lse = attention_varlen_naive(q, k, v, cu_q, cu_k)
    assert (out[3:7] == 0).all() and (lse[:, 3:7] == NEG_INF).all()
    assert torch.isfinite(lse[:, :3]).all() and torch.isfinite(lse[:, 7:]).all()
    out_b, lse_b = attention_varlen_forward_blocked(q, k, v, cu_q, cu_k)
    assert_close64(out_b, out, "out")
    assert_close64(lse_b, lse, "lse")


@pytest.mark.parametrize("is_causal,window,alibi", [(False, (-1, -1), False), (True, (5, -1), True)])
def test_varlen_equal_lengths_equal_dense_batch(is_causal, window, alibi):
    B, Hq, Hkv, Sq, Sk, D = 3, 4, 2, 21, 30, 8
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, F64, "cpu", seed=9)
    slopes = make_alibi_slopes(Hq, batch=B, device="cpu") if alibi else None
    opts = dict(is_causal=is_causal, window_size=window, softcap=2.0, alibi_slopes=slopes)
    out_d, lse_d = attention_naive(q, k, v, **opts)
    packed = [t.transpose(1, 2).reshape(-1, t.shape[1], D) for t in (q, k, v)]
    cu_q = cu_seqlens_from_lengths([Sq] * B, "cpu")
    cu_k = cu_seqlens_from_lengths([Sk] * B, "cpu")
    out_v, lse_v = attention_varlen_forward_blocked(*packed, cu_q, cu_k, block_m=16, block_n=16,
                                                    **opts)
    assert_close64(out_v, out_d.transpose(1, 2).reshape(-1, Hq, D), "out")
    assert_close64(lse_v, lse_d.permute(1, 0, 2).reshape(Hq, -1), "lse")


def test_varlen_no_sequences_and_no_rows():
    q, k, v, cu_q, cu_k = _packed([], [], 2, 2, 8, seed=0)
    assert cu_q.tolist() == [0]
    out, lse = attention_varlen_naive(q, k, v, cu_q, cu_k)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    out, lse = attention_varlen_forward_blocked(q, k, v, cu_q, cu_k)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    q, k, v, cu_q, cu_k = _packed([0, 0], [3, 0], 2, 2, 8, seed=0)
    dq, dk, dv = attention_varlen_backward_blocked(q.new_zeros(q.shape), q, k, v, q.new_zeros(q.shape),
                                                   q.new_zeros((2, 0)), cu_q, cu_k)
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("cu_q,cu_k", [([1, 5], [0, 5]), ([0, 6, 5], [0, 2, 5]), ([0, 4], [0, 5]),
                                       ([0, 5], [0, 5, 5])])
def test_varlen_reference_rejects_bad_cu_seqlens(cu_q, cu_k):
    q = torch.randn(5, 2, 8, dtype=F64)
    k = torch.randn(5, 2, 8, dtype=F64)
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention_varlen_naive(q, k, k, torch.tensor(cu_q, dtype=torch.int32),
                               torch.tensor(cu_k, dtype=torch.int32))


# ---------------------------------------------------------------------------------------
# attn_check harness with the options (CPU, through the mock extension)
# ---------------------------------------------------------------------------------------


FEATURE_OPTS = dict(is_causal=True, scale=None, window_size=(9, -1), softcap=3.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_check_attention_with_options_accepts_reference(mock_extension, dtype):
    from attn_check import check_attention

    q, k, v = make_inputs(2, 4, 2, 50, 37, 16, dtype, "cpu", layout="bshd", seed=1)
    res = check_attention(q, k, v, alibi_slopes=make_alibi_slopes(4, batch=2, device="cpu"),
                          with_dlse=True, label="self-test options", **FEATURE_OPTS)
    assert set(res) == {"out", "lse", "dq", "dk", "dv"}
    assert mock_extension.last_fwd_args["window"] == (9, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens_q,lens_k", [((0, 1, 20, 9), (4, 1, 30, 0)), ((0, 0), (3, 4)),
                                           ((3, 4), (0, 0)), ((12,), (12,))])
def test_check_varlen_attention_accepts_reference(mock_extension, dtype, lens_q, lens_k):
    from attn_check import check_varlen_attention, make_varlen_inputs

    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, 4, 2, 16, dtype, "cpu",
                                                     layout="strided", seed=2)
    check_varlen_attention(q, k, v, cu_q, cu_k, mq, mk, with_dlse=True, check_cu_seqlens=True,
                           alibi_slopes=make_alibi_slopes(4, batch=len(lens_q), device="cpu"),
                           label="self-test varlen", **FEATURE_OPTS)


@pytest.mark.parametrize("dropped", ["window", "softcap", "alibi"])
def test_check_attention_detects_an_ignored_option(mock_extension, dropped):
    """An extension that ignores one option fails the check (the harness really passes
    every option to the reference)."""
    from flash_cuda import _ext

    from attn_check import check_attention

    fwd = mock_extension.fwd

    def forgetful_fwd(q, k, v, scale, wl, wr, softcap, alibi, *rest):
        if dropped == "window":
            wl = -1
        elif dropped == "softcap":
            softcap = 0.0
        else:
            alibi = None
        return fwd(q, k, v, scale, wl, wr, softcap, alibi, *rest)

    _ext._C.fwd = forgetful_fwd
    q, k, v = make_inputs(1, 2, 2, 40, 40, 16, torch.float32, "cpu", seed=3)
    with pytest.raises(AssertionError, match="out: max|lse: max"):
        check_attention(q, k, v, alibi_slopes=make_alibi_slopes(2, device="cpu"), check_grad=False,
                        label="forgetful", **FEATURE_OPTS)


def test_check_varlen_attention_detects_wrong_output(mock_extension):
    from flash_cuda import _ext

    from attn_check import check_varlen_attention, make_varlen_inputs

    fwd = mock_extension.fwd

    def bad_fwd(*args):
        out, lse, aux = fwd(*args)
        out[25, 1, 3] += 0.05  # one wrong element in the third sequence
        return out, lse, aux

    _ext._C.fwd = bad_fwd
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((10, 0, 30), (12, 5, 30), 2, 2, 16,
                                                     torch.float16, "cpu", seed=4)
    with pytest.raises(AssertionError, match="varlen_attention mismatch.*\n.*out: max"):
        check_varlen_attention(q, k, v, cu_q, cu_k, mq, mk, check_grad=False, label="bad")
