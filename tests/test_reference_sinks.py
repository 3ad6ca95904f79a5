"""Attention sinks in the reference (flash_cuda.reference, ``sinks=``), on CPU.

* The definition: attention_naive and the blocked forward against an independent float64
  formulation (a column of sink logits concatenated to the scores, softmax, the column
  dropped) for dense, GQA, causal, windowed, soft-capped and ALiBi problems, with sinks
  that are ordinary, dominant, negligible or -inf; rows that see no key (out 0, lse = the
  sink); a -inf sink is no sink (the blocked results bit for bit).
* Where the sink enters: merged in normalize_output (the blocked functions) and, as the
  equivalent form, the running statistics started at (m = sink, l = 1); both equal the
  naive form to float64 rounding. A sink past the float32 range of exp stays finite.
* Gradients: autograd through attention_naive against finite differences (gradcheck) and
  against the independent formulation; the blocked backward's (dq, dk, dv, dsinks) against
  autograd through attention_naive, with an lse gradient, dropout, rows that see no key
  and -inf sinks (gradient 0, no NaN).
* Packed batches (varlen) and the KV cache (decode, split-KV, a sequence with no key).
* Against transformers' gpt-oss eager attention when it imports.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_cuda import reference as R
from flash_cuda.reference import (attention_backward_blocked, attention_forward_blocked,
                                  attention_naive, attention_varlen_backward_blocked,
                                  attention_varlen_forward_blocked, attention_varlen_naive,
                                  attention_with_kvcache_reference)

from attn_check import cu_seqlens_from_lengths, make_alibi_slopes, make_inputs
from test_reference import assert_close64

F64 = torch.float64
NEG_INF = float("-inf")

# name -> (B, Hq, Hkv, Sq, Sk, D, options)
CASES = {
    "dense": (2, 2, 2, 33, 47, 16, {}),
    "gqa": (1, 6, 2, 29, 29, 8, {}),
    "causal_no_key_rows": (1, 4, 2, 40, 23, 8, {"is_causal": True}),
    "window": (2, 4, 1, 37, 41, 8, {"window_size": (6, 3)}),
    "window_left_only": (1, 2, 1, 20, 45, 8, {"window_size": (4, -1)}),
    "window_no_key_rows": (1, 2, 2, 30, 12, 8, {"window_size": (3, 2)}),
    "softcap_alibi": (1, 4, 2, 21, 35, 8, {"softcap": 3.0, "scale": 0.9}),
}

# name -> sinks for Hq heads (cycled)
SINKS = {
    "ordinary": [0.3, -1.2, 2.0, 0.0, -0.4, 1.1],
    "dominant": [30.0, 12.0, 45.0, 25.0, 18.0, 60.0],
    "negligible": [-30.0, -60.0, -25.0, -45.0, -100.0, -35.0],
    "with_minus_inf": [1.5, NEG_INF, -2.0, NEG_INF, 0.7, NEG_INF],
}


def make_sinks(name, Hq, dtype=F64):
    vals = SINKS[name]
    return torch.tensor([vals[h % len(vals)] for h in range(Hq)], dtype=dtype)


def problem(case, seed=0, requires_grad=False):
    B, Hq, Hkv, Sq, Sk, D, opts = CASES[case]
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, F64, "cpu", seed=seed)
    opts = dict(opts)
    if case == "softcap_alibi":
        opts["alibi_slopes"] = make_alibi_slopes(Hq, device="cpu")
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v)), opts


def spec_with_sinks(q, k, v, sinks, *, is_causal=False, scale=None, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None):
    """The definition written the other way: the scores with the key/value heads repeated
    for GQA, -inf where invisible, one column of sink logits appended, a softmax, the column
    dropped before the product with V. Differentiable; float64."""
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    g = Hq // k.shape[1]
    kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    x = (q @ kr.transpose(-1, -2)) * (1 / math.sqrt(D) if scale is None else scale)
    if softcap > 0:
        x = softcap * torch.tanh(x / softcap)
    i = torch.arange(Sq).view(-1, 1) + (Sk - Sq)  # each query's key position
    j = torch.arange(Sk).view(1, -1)
    if alibi_slopes is not None:
        x = x - alibi_slopes.to(F64).view(1, Hq, 1, 1) * (i - j).abs()
    left, right = window_size
    if is_causal:
        right = 0
    hidden = torch.zeros(Sq, Sk, dtype=torch.bool)
    if left >= 0:
        hidden |= j < i - left
    if right >= 0:
        hidden |= j > i + right
    x = x.masked_fill(hidden, NEG_INF)
    col = sinks.to(F64).view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)
    col = col.masked_fill(col == NEG_INF, NEG_INF)  # no gradient (NaN) into a -inf sink
    logits = torch.cat([x, col], dim=-1)
    m = logits.amax(dim=-1, keepdim=True)
    empty = m == NEG_INF  # no key and a -inf sink: out 0, lse -inf
    m = torch.where(empty, torch.zeros_like(m), m)
    probs = torch.softmax(logits - m, dim=-1)
    probs = torch.where(empty, torch.zeros_like(probs), probs)
    lse = (m + torch.log(torch.exp(logits - m).sum(dim=-1, keepdim=True))).squeeze(-1)
    return probs[..., :-1] @ vr, lse


# ---------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sinks_name", list(SINKS))
@pytest.mark.parametrize("case", list(CASES))
def test_forward_matches_definition(case, sinks_name):
    (q, k, v), opts = problem(case, seed=len(case))
    sinks = make_sinks(sinks_name, q.shape[1])
    out_s, lse_s = spec_with_sinks(q, k, v, sinks, **opts)
    out_n, lse_n = attention_naive(q, k, v, sinks=sinks, **opts)
    assert_close64(out_n, out_s, "naive out")
    assert_close64(lse_n, lse_s, "naive lse")
    for bm, bn in ((16, 16), (64, 64), (8, 32)):
        out_b, lse_b = attention_forward_blocked(q, k, v, sinks=sinks, block_m=bm, block_n=bn, **opts)
        assert_close64(out_b, out_s, f"blocked out {bm}x{bn}")
        assert_close64(lse_b, lse_s, f"blocked lse {bm}x{bn}")


@pytest.mark.parametrize("case", ["causal_no_key_rows", "window_no_key_rows"])
def test_rows_without_keys_get_the_sink(case):
    (q, k, v), opts = problem(case)
    Sq, Sk = q.shape[2], k.shape[2]
    sinks = make_sinks("ordinary", q.shape[1])
    vis = R.key_visible(torch.arange(Sq), torch.arange(Sk), Sq, Sk,
                        *R.normalize_window(opts.get("is_causal", False), opts.get("window_size", (-1, -1))))
    empty = ~vis.any(dim=1)
    assert empty.any()
    for out, lse in (attention_naive(q, k, v, sinks=sinks, **opts),
                     attention_forward_blocked(q, k, v, sinks=sinks, block_m=16, block_n=16, **opts)):
        assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
        want = sinks.view(1, -1, 1).expand_as(lse[:, :, empty])
        assert_close64(lse[:, :, empty], want, "lse of rows without keys", atol=1e-14)


@pytest.mark.parametrize("case", list(CASES))
def test_minus_inf_sinks_are_no_sinks(case):
    (q, k, v), opts = problem(case, seed=7)
    none = torch.full((q.shape[1],), NEG_INF, dtype=F64)
    for bm, bn in ((16, 16), (64, 64)):
        plain = attention_forward_blocked(q, k, v, block_m=bm, block_n=bn, max_lag=8.0, **opts)
        with_none = attention_forward_blocked(q, k, v, block_m=bm, block_n=bn, max_lag=8.0, sinks=none,
                                              **opts)
        assert torch.equal(plain[0], with_none[0]) and torch.equal(plain[1], with_none[1])
    for a, b, name in zip(attention_naive(q, k, v, **opts), attention_naive(q, k, v, sinks=none, **opts),
                          ("out", "lse")):
        assert_close64(b, a, f"naive {name}", atol=1e-14)


def test_sink_as_initial_statistics_is_the_same():
    """The other place the sink could enter: the running statistics started at (m = sink,
    l = 1) instead of (-inf, 0), normalize_output without a sink. Equal to the naive form."""
    (q, k, v), opts = problem("gqa", seed=3)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    sinks = make_sinks("ordinary", Hq)
    scale_log2 = D ** -0.5 * R.LOG2E
    qg = q.reshape(B, Hkv, Hq // Hkv, Sq, D)
    row_max = (sinks * R.LOG2E).view(1, Hkv, Hq // Hkv, 1).expand(B, Hkv, Hq // Hkv, Sq)
    row_sum = torch.ones_like(row_max)
    acc_o = torch.zeros(B, Hkv, Hq // Hkv, Sq, D, dtype=F64)
    for key_base in range(0, Sk, 8):
        k_blk = k[:, :, key_base:key_base + 8].unsqueeze(2)
        v_blk = v[:, :, key_base:key_base + 8].unsqueeze(2)
        s, block_max = R.compute_qk_scores_and_max(qg, k_blk, scale_log2, None)
        row_max, row_sum, acc_o = R.merge_block_stats(row_max, row_sum, acc_o, block_max)
        row_sum, acc_o = R.compute_block_softmax_and_weighted_v(s, row_sum, acc_o, row_max, v_blk, F64)
    out, lse = R.normalize_output(acc_o, row_sum, row_max, F64)
    out_n, lse_n = attention_naive(q, k, v, sinks=sinks)
    assert_close64(out.reshape(B, Hq, Sq, D), out_n, "out")
    assert_close64(lse.reshape(B, Hq, Sq), lse_n, "lse")


@pytest.mark.parametrize("sink", [200.0, 1e4, -200.0, -1e4])
def test_sinks_past_the_float32_exp_range(sink):
    """exp2(sink - m) overflows or underflows float32 here: the merge against max(m, sink)
    keeps lse and out finite and right."""
    q, k, v = make_inputs(1, 2, 1, 19, 27, 16, F64, "cpu", seed=5)
    sinks = torch.tensor([sink, 0.5], dtype=torch.float32)
    out_n, lse_n = attention_naive(q, k, v, sinks=sinks.double(), is_causal=True)
    out_b, lse_b = attention_forward_blocked(q.float(), k.float(), v.float(), sinks=sinks, is_causal=True,
                                             block_m=16, block_n=16)
    assert torch.isfinite(out_b).all() and torch.isfinite(lse_b).all()
    assert (out_b.double() - out_n).abs().max().item() < 1e-5
    assert ((lse_b.double() - lse_n).abs() / lse_n.abs().clamp(min=1)).max().item() < 1e-6


def test_sinks_shape_is_checked():
    q, k, v = make_inputs(1, 4, 2, 5, 5, 8, F64, "cpu")
    for bad in (torch.zeros(2, dtype=F64), torch.zeros(1, 4, dtype=F64), torch.zeros(4, dtype=torch.int64)):
        with pytest.raises(ValueError, match="sinks"):
            attention_naive(q, k, v, sinks=bad)
        with pytest.raises(ValueError, match="sinks"):
            attention_forward_blocked(q, k, v, sinks=bad)


# ---------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------


def test_naive_sink_gradient_gradcheck():
    (q, k, v), _ = problem("causal_no_key_rows", requires_grad=True)
    q, k, v = (t[:, :, :9].detach().requires_grad_() for t in (q, k, v))  # Sq = Sk = 9
    sinks = make_sinks("ordinary", q.shape[1]).requires_grad_()

    def f(q, k, v, sinks):
        out, lse = attention_naive(q, k, v, sinks=sinks, window_size=(3, 0))
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def _loss_parts(out, lse, seed):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    dlse = torch.randn(lse.shape, generator=g, dtype=F64)
    return dout, dlse


def _loss(out, lse, dout, dlse):
    finite = torch.isfinite(lse)  # rows with lse = -inf carry no gradient
    return (out * dout).sum() + (torch.where(finite, lse, torch.zeros_like(lse)) * dlse).sum()


@pytest.mark.parametrize("sinks_name", list(SINKS))
@pytest.mark.parametrize("case", list(CASES))
def test_gradients(case, sinks_name):
    (q, k, v), opts = problem(case, seed=11, requires_grad=True)
    sinks = make_sinks(sinks_name, q.shape[1]).requires_grad_()
    out, lse = attention_naive(q, k, v, sinks=sinks, **opts)
    dout, dlse = _loss_parts(out, lse, seed=len(case))
    want = torch.autograd.grad(_loss(out, lse, dout, dlse), (q, k, v, sinks))
    assert all(torch.isfinite(g).all() for g in want)
    assert torch.equal(want[3][sinks.isneginf()], torch.zeros_like(want[3][sinks.isneginf()]))

    out_s, lse_s = spec_with_sinks(q, k, v, sinks, **opts)
    spec = torch.autograd.grad(_loss(out_s, lse_s, dout, dlse), (q, k, v, sinks))
    for a, b, name in zip(spec, want, ("dq", "dk", "dv", "dsinks")):
        assert_close64(b, a, f"naive vs definition {name}", atol=1e-9)

    with torch.no_grad():
        out_b, lse_b = attention_forward_blocked(q, k, v, sinks=sinks, block_m=16, block_n=16, **opts)
        got = attention_backward_blocked(dout, q, k, v, out_b, lse_b, dlse=dlse, sinks=sinks,
                                         block_m=16, block_n=16, **opts)
    assert len(got) == 4
    for a, b, name in zip(got, want, ("dq", "dk", "dv", "dsinks")):
        assert_close64(a, b, f"blocked {name}", atol=1e-9)


def test_gradients_with_dropout():
    (q, k, v), opts = problem("gqa", seed=2, requires_grad=True)
    B, Hq, Sq, _ = q.shape
    Sk = k.shape[2]
    mask = R.dropout_keep_mask(B, Hq, Sq, Sk, 0.3, seed=9)
    sinks = make_sinks("ordinary", Hq).requires_grad_()
    out, lse = attention_naive(q, k, v, sinks=sinks, dropout_p=0.3, dropout_mask=mask)
    dout, dlse = _loss_parts(out, lse, seed=1)
    want = torch.autograd.grad(_loss(out, lse, dout, dlse), (q, k, v, sinks))
    with torch.no_grad():
        out_b, lse_b = attention_forward_blocked(q, k, v, sinks=sinks, dropout_p=0.3, dropout_mask=mask,
                                                 block_m=16, block_n=16)
        assert_close64(out_b, out, "out")
        assert_close64(lse_b, lse, "lse")  # dropout leaves lse alone, sink included
        got = attention_backward_blocked(dout, q, k, v, out_b, lse_b, dlse=dlse, sinks=sinks, dropout_p=0.3,
                                         dropout_mask=mask, block_m=16, block_n=16)
    for a, b, name in zip(got, want, ("dq", "dk", "dv", "dsinks")):
        assert_close64(a, b, name, atol=1e-9)


def test_backward_without_sinks_returns_three():
    (q, k, v), _ = problem("dense")
    out, lse = attention_forward_blocked(q, k, v)
    assert len(attention_backward_blocked(torch.ones_like(out), q, k, v, out, lse)) == 3


# ---------------------------------------------------------------------------------------
# Packed batches and the KV cache
# ---------------------------------------------------------------------------------------


def test_varlen():
    lens_q, lens_k = [5, 0, 17, 30, 3], [9, 4, 17, 12, 0]
    Hq, Hkv, D = 4, 2, 8
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q), Hq, D, generator=g, dtype=F64).requires_grad_()
    k = torch.randn(sum(lens_k), Hkv, D, generator=g, dtype=F64).requires_grad_()
    v = torch.randn(sum(lens_k), Hkv, D, generator=g, dtype=F64).requires_grad_()
    cq, ck = cu_seqlens_from_lengths(lens_q, "cpu"), cu_seqlens_from_lengths(lens_k, "cpu")
    sinks = make_sinks("with_minus_inf", Hq).requires_grad_()
    opts = {"is_causal": True}

    out, lse = attention_varlen_naive(q, k, v, cq, ck, sinks=sinks, **opts)
    for b in range(len(lens_q)):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        o_s, l_s = spec_with_sinks(qs, ks, vs, sinks, **opts)
        assert_close64(out[cq[b]:cq[b + 1]], o_s[0].transpose(0, 1), f"out of sequence {b}")
        assert_close64(lse[:, cq[b]:cq[b + 1]], l_s[0], f"lse of sequence {b}")

    dout, dlse = _loss_parts(out, lse, seed=3)
    want = torch.autograd.grad(_loss(out, lse, dout, dlse), (q, k, v, sinks))
    with torch.no_grad():
        out_b, lse_b = attention_varlen_forward_blocked(q, k, v, cq, ck, sinks=sinks, block_m=8, block_n=8,
                                                        **opts)
        assert_close64(out_b, out, "blocked out")
        assert_close64(lse_b, lse, "blocked lse")
        got = attention_varlen_backward_blocked(dout, q, k, v, out_b, lse_b, cq, ck, dlse=dlse, sinks=sinks,
                                                block_m=8, block_n=8, **opts)
    for a, b, name in zip(got, want, ("dq", "dk", "dv", "dsinks")):
        assert_close64(a, b, f"blocked {name}", atol=1e-9)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("Sq,S_new", [(1, 0), (1, 1), (3, 3), (6, 2)])
def test_kvcache(Sq, S_new, num_splits):
    """Decode and chunked-prefill shapes over a dense cache, a sequence with nothing cached
    (and, for S_new = 0, nothing to see: out 0, lse = the sink)."""
    B, Hq, Hkv, D, S_max = 3, 4, 2, 8, 48
    cached = [0, 19, 40]
    g = torch.Generator().manual_seed(Sq * 10 + S_new)
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=F64)
    k_cache = torch.randn(B, Hkv, S_max, D, generator=g, dtype=F64)
    v_cache = torch.randn(B, Hkv, S_max, D, generator=g, dtype=F64)
    k_new = torch.randn(B, Hkv, S_new, D, generator=g, dtype=F64) if S_new else None
    v_new = torch.randn(B, Hkv, S_new, D, generator=g, dtype=F64) if S_new else None
    sinks = make_sinks("ordinary", Hq)
    opts = {"is_causal": True, "window_size": (20, -1), "softcap": 4.0}
    out, lse = attention_with_kvcache_reference(q, k_cache, v_cache, k_new, v_new,
                                                cache_seqlens=torch.tensor(cached, dtype=torch.int32),
                                                num_splits=num_splits, return_lse=True, block_n=8,
                                                sinks=sinks, **opts)
    for b, c in enumerate(cached):
        L = c + S_new
        o_s, l_s = spec_with_sinks(q[b:b + 1], k_cache[b:b + 1, :, :L], v_cache[b:b + 1, :, :L], sinks, **opts)
        assert_close64(out[b:b + 1], o_s, f"out of sequence {b}")
        assert_close64(lse[b:b + 1], l_s, f"lse of sequence {b}")
    if S_new == 0:
        assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_kvcache_minus_inf_sinks_are_no_sinks():
    B, Hq, Hkv, Sq, D = 2, 2, 1, 2, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=F64)
    k_cache = torch.randn(B, Hkv, 40, D, generator=g, dtype=F64)
    v_cache = torch.randn(B, Hkv, 40, D, generator=g, dtype=F64)
    none = torch.full((Hq,), NEG_INF, dtype=F64)
    for num_splits in (1, 3):
        kw = dict(cache_seqlens=torch.tensor([0, 37], dtype=torch.int32), num_splits=num_splits,
                  return_lse=True, block_n=8, is_causal=True)
        plain = attention_with_kvcache_reference(q, k_cache, v_cache, **kw)
        with_none = attention_with_kvcache_reference(q, k_cache, v_cache, sinks=none, **kw)
        assert torch.equal(plain[0], with_none[0]) and torch.equal(plain[1], with_none[1])


# ---------------------------------------------------------------------------------------
# transformers' gpt-oss
# ---------------------------------------------------------------------------------------


def test_matches_transformers_gpt_oss_eager():
    """gpt-oss's eager attention (scores * scaling, additive mask, the sinks concatenated as a
    last column, softmax, the column dropped) equals attention_naive with the same sinks."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss",
                                  reason="transformers with gpt-oss is not installed")
    eager = getattr(gpt_oss, "eager_attention_forward", None)
    if eager is None:
        pytest.skip("this transformers has no gpt-oss eager_attention_forward")
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 7, 12, 16
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, F64, "cpu", seed=6)
    sinks = make_sinks("ordinary", Hq)
    scaling = D ** -0.5

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sinks = torch.nn.Parameter(sinks.clone())
            self.num_key_value_groups = Hq // Hkv

    hidden = ~R.causal_visible(torch.arange(Sq), torch.arange(Sk), Sq, Sk)
    mask = torch.zeros(B, 1, Sq, Sk, dtype=F64).masked_fill(hidden, torch.finfo(F64).min)
    module = Module().eval()
    try:
        theirs, _ = eager(module, q, k, v, mask, scaling=scaling, dropout=0.0)
    except Exception as e:  # a signature of another version
        pytest.skip(f"gpt-oss eager_attention_forward is not callable standalone here: {e!r}")
    ours, _ = attention_naive(q, k, v, sinks=sinks, is_causal=True, scale=scaling)
    assert_close64(ours, theirs.transpose(1, 2), "out", atol=1e-12)
