"""Attention dropout's random numbers on the GPU (csrc/core/dropout.cuh) against the executable
spec (flash_cuda.reference.dropout_keep_mask): the kernels' Philox draws and the mapping of an
element to its draw must give the reference's mask bit for bit, for any shape, 64-bit seeds and
offsets. GPU only.
"""

from __future__ import annotations

import pytest
import torch

from flash_cuda import _ext
from flash_cuda import reference as R

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(1, 1, 16, 16), (2, 3, 37, 53), (1, 2, 130, 257)], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("seed,offset", [(0, 0), (2024, 8), (2 ** 64 - 1, (5 << 32) + 12), (0x1234_5678_9ABC, 4)])
def test_kernel_mask_equals_reference(shape, p, seed, offset):
    B, H, Sq, Sk = shape
    like = torch.empty(0, device="cuda")
    got = _ext.require().dropout_mask(B, H, Sq, Sk, R.dropout_keep_threshold(p), seed, offset, like)
    ref = R.dropout_keep_mask(B, H, Sq, Sk, p, seed=seed, offset=offset, device="cuda")
    assert got.shape == ref.shape and torch.equal(got.bool(), ref)


def test_mask_op_rejects_a_bad_threshold():
    with pytest.raises(RuntimeError, match="threshold must be in \\[0, 65536\\], got 70000"):
        _ext.require().dropout_mask(1, 1, 4, 4, 70000, 0, 0, torch.empty(0, device="cuda"))


# ---------------------------------------------------------------------------------------
# The attention kernels with dropout (the binding's entry points; the mma.sync family), against
# the float64 reference given the kernel's own mask: the (seed, offset) the forward recorded in
# rng_state name the mask exactly (reference.dropout_keep_mask).
# ---------------------------------------------------------------------------------------

from attn_check import ATOL_BASE, hopper_skip_reason, make_inputs, rule_error, ws_fwd_traced  # noqa: E402


def _run(q, k, v, do, p, is_causal, window, kernel_tier=0, deterministic=False, hopper_fwd=False):
    """The extension's forward and backward with dropout. hopper_fwd: the forward through
    attn_check.ws_fwd_traced (profiled: a failure unless the warp-specialized forward's dropout
    kernel ran)."""
    C = _ext.require()
    D = q.shape[-1]
    scale = D ** -0.5
    wl, wr = window
    if is_causal:
        wr = 0
    rng = torch.empty(2, dtype=torch.int64, device="cuda")
    if hopper_fwd:
        (out, lse, aux), names = ws_fwd_traced(q, k, v, scale, wl, wr, 0.0, None, None, None, 0, 0, dropout_p=p,
                                               rng_state=rng)
        assert "fwd_sm90_ws_dropout_kernel" in names, names[:800]
    else:
        out, lse, aux = C.fwd(q, k, v, scale, wl, wr, 0.0, None, None, None, 0, 0, kernel_tier, dropout_p=p,
                              rng_state=rng)
    dq, dk, dv = C.bwd(do, q, k, v, out, lse, aux, None, scale, wl, wr, 0.0, None, None, None, 0, 0, deterministic,
                       kernel_tier, dropout_p=p, rng_state=rng)
    return (out, lse, dq, dk, dv), rng, scale, (wl, wr)


DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DTYPE_IDS = ["fp16", "bf16", "fp32"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("shape,is_causal,window", [((2, 4, 2, 200, 200), False, (-1, -1)),
                                                    ((1, 3, 3, 128, 300), True, (-1, -1)),
                                                    ((2, 2, 1, 257, 257), False, (40, 8))], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("hopper_fwd", [False, True], ids=["auto", "hopper_fwd"])
def test_attention_with_dropout_matches_reference(dtype, D, shape, is_causal, window, p, deterministic, hopper_fwd):
    if deterministic and (p != 0.1 or D != 64):
        pytest.skip("the deterministic backward: one p and head dim suffice")
    if hopper_fwd and (dtype == torch.float32 or deterministic or hopper_skip_reason("hopper_fwd") is not None):
        pytest.skip("hopper_fwd: the Hopper forward's dropout instances, profiled, fp16 / bf16 on sm_90")
    B, Hq, Hkv, Sq, Sk = shape
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", seed=D + Sq)
    do = make_inputs(B, Hq, Hq, Sq, Sq, D, dtype, "cuda", seed=7)[0]
    got, rng, scale, win = _run(q, k, v, do, p, is_causal, window, deterministic=deterministic, hopper_fwd=hopper_fwd)
    seed, offset = (int(x) for x in rng.tolist())
    mask = R.dropout_keep_mask(B, Hq, Sq, Sk, p, seed=seed, offset=offset, device="cuda")

    def reference(dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out, lse = R.attention_naive(*leaves, scale=scale, window_size=win, dropout_p=p, dropout_mask=mask)
        grads = torch.autograd.grad((out * do.to(dt)).sum(), leaves)
        return (out, lse, *grads)

    ref, naive = reference(torch.float64), reference(dtype)
    problems = []
    for name, x, r, n in zip(("out", "lse", "dq", "dk", "dv"), got, ref, naive):
        fin = torch.isfinite(r) if name == "lse" else None
        _, problem = rule_error(name, x.double(), r.double(), n.double(), ATOL_BASE[dtype], mask=fin)
        if problem:
            problems.append(problem)
    assert not problems, problems


def test_dropout_draws_new_numbers_per_call_and_reproduces_with_the_seed():
    q, k, v = make_inputs(1, 2, 2, 128, 128, 64, torch.bfloat16, "cuda", seed=1)
    do = torch.randn_like(q)
    torch.manual_seed(123)
    a, rng_a, _, _ = _run(q, k, v, do, 0.3, False, (-1, -1))
    b, rng_b, _, _ = _run(q, k, v, do, 0.3, False, (-1, -1))
    assert not torch.equal(rng_a, rng_b) and not torch.equal(a[0], b[0])  # the generator moved on
    torch.manual_seed(123)
    c, rng_c, _, _ = _run(q, k, v, do, 0.3, False, (-1, -1))
    assert torch.equal(rng_a, rng_c)
    for x, y in zip(a, c):
        assert torch.equal(x, y)  # same seed: bitwise the same forward and backward


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_packed_attention_with_dropout_matches_reference(dtype, is_causal):
    """A packed batch draws per sequence as entry b of a dense batch with its own positions
    (reference.dropout_keep_masks_varlen)."""
    from attn_check import make_varlen_inputs
    p = 0.2
    q, k, v, cq, ck, mq, mk = make_varlen_inputs([70, 1, 130, 0], [90, 17, 130, 5], 4, 2, 64, dtype, seed=5)
    do = torch.randn_like(q)
    C = _ext.require()
    scale = 64 ** -0.5
    wl, wr = -1, (0 if is_causal else -1)
    rng = torch.empty(2, dtype=torch.int64, device="cuda")
    out, lse, aux = C.fwd(q, k, v, scale, wl, wr, 0.0, None, cq, ck, mq, mk, 0, dropout_p=p, rng_state=rng)
    dq, dk, dv = C.bwd(do, q, k, v, out, lse, aux, None, scale, wl, wr, 0.0, None, cq, ck, mq, mk, False, 0,
                       dropout_p=p, rng_state=rng)
    seed, offset = (int(x) for x in rng.tolist())
    masks = R.dropout_keep_masks_varlen(cq.cpu(), ck.cpu(), 4, p, seed=seed, offset=offset, device="cuda")

    def reference(dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = R.attention_varlen_naive(*leaves, cq, ck, scale=scale, is_causal=is_causal, dropout_p=p,
                                        dropout_masks=masks)
        return (o, l, *torch.autograd.grad((o * do.to(dt)).sum(), leaves))

    ref, naive = reference(torch.float64), reference(dtype)
    problems = []
    for name, x, r, n in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref, naive):
        fin = torch.isfinite(r) if name == "lse" else None
        _, problem = rule_error(name, x.double(), r.double(), n.double(), ATOL_BASE[dtype], mask=fin)
        if problem:
            problems.append(problem)
    assert not problems, problems


# ---------------------------------------------------------------------------------------
# The public API with dropout on the GPU: reproducibility (torch.manual_seed, deterministic=True,
# torch.compile against eager) and CUDA-graph capture (each replay draws new numbers, recorded
# in rng_state, and its output is the reference's for those numbers).
# ---------------------------------------------------------------------------------------

import flash_cuda  # noqa: E402


def _leaves(seed=3, B=2, H=4, S=192, D=64, dtype=torch.bfloat16):
    q, k, v = make_inputs(B, H, H, S, S, D, dtype, "cuda", seed=seed)
    return [t.clone().requires_grad_() for t in (q, k, v)], torch.randn_like(q)


def _step(fn, leaves, do):
    for t in leaves:
        t.grad = None
    out = fn(*leaves)
    out.backward(do)
    return [out.detach().clone()] + [t.grad.clone() for t in leaves]


@pytest.mark.parametrize("deterministic", [False, True])
def test_public_api_reproduces_with_the_seed(deterministic):
    leaves, do = _leaves()
    fn = lambda q, k, v: flash_cuda.attention(q, k, v, is_causal=True, dropout_p=0.2,  # noqa: E731
                                              deterministic=deterministic)
    torch.manual_seed(11)
    a = _step(fn, leaves, do)
    b = _step(fn, leaves, do)
    torch.manual_seed(11)
    c = _step(fn, leaves, do)
    assert not torch.equal(a[0], b[0])
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    plain = flash_cuda.attention(*leaves, is_causal=True)
    mean = torch.stack([flash_cuda.attention(*leaves, is_causal=True, dropout_p=0.2) for _ in range(64)]).float()
    # unbiased: the mean over draws approaches the plain output (error ~ 1/sqrt(64) of a draw's spread)
    spread = (a[0].float() - plain.float()).abs().mean()
    assert (mean.mean(0) - plain.float()).abs().mean() < 0.25 * spread


def test_compiled_call_draws_as_eager():
    leaves, do = _leaves(seed=4)
    fn = lambda q, k, v: flash_cuda.attention(q, k, v, dropout_p=0.3)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True)
    torch.manual_seed(5)
    a = _step(fn, leaves, do)
    torch.manual_seed(5)
    b = _step(compiled, leaves, do)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_cuda_graph_replays_draw_new_numbers():
    B, H, S, D, p = 1, 2, 160, 64, 0.25
    q, k, v = make_inputs(B, H, H, S, S, D, torch.float16, "cuda", seed=9)
    scale = D ** -0.5
    op = torch.ops.flash_cuda.fwd_dropout
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        op(q, k, v, scale, -1, -1, 0.0, None, False, 0, p)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, _, rng = op(q, k, v, scale, -1, -1, 0.0, None, False, 0, p)
    results = []
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        results.append((out.clone(), rng.clone()))
    assert not torch.equal(results[0][1], results[1][1])  # the offset moved between replays
    ref_naive = None
    for got, state in results:
        seed, offset = (int(x) for x in state.tolist())
        mask = R.dropout_keep_mask(B, H, S, S, p, seed=seed, offset=offset, device="cuda")
        ref, _ = R.attention_naive(q.double(), k.double(), v.double(), scale=scale, dropout_p=p, dropout_mask=mask)
        ref_naive, _ = R.attention_naive(q, k, v, scale=scale, dropout_p=p, dropout_mask=mask)
        _, problem = rule_error("out", got.double(), ref, ref_naive.double(), ATOL_BASE[torch.float16])
        assert not problem, problem


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper forward's dropout instances run on sm_90")
@pytest.mark.parametrize("D", [64, 96, 128])
def test_hopper_forward_draws_the_dropout(D):
    """On sm_90 a dense call with dropout runs the warp-specialized forward's dropout kernel (the
    backward stays on mma.sync), and its output is the reference's for the recorded draws."""
    q, k, v = make_inputs(2, 4, 2, 300, 300, D, torch.bfloat16, "cuda", seed=D)
    rng = torch.empty(2, dtype=torch.int64, device="cuda")
    C = _ext.require()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse, _ = C.fwd(q, k, v, D ** -0.5, -1, 0, 0.0, None, None, None, 0, 0, 0, dropout_p=0.2, rng_state=rng)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "fwd_sm90_ws_dropout_kernel" in names, names[:500]
    seed, offset = (int(x) for x in rng.tolist())
    mask = R.dropout_keep_mask(2, 4, 300, 300, 0.2, seed=seed, offset=offset, device="cuda")
    ref, _ = R.attention_naive(q.double(), k.double(), v.double(), scale=D ** -0.5, is_causal=True, dropout_p=0.2,
                               dropout_mask=mask)
    naive, _ = R.attention_naive(q, k, v, scale=D ** -0.5, is_causal=True, dropout_p=0.2, dropout_mask=mask)
    _, problem = rule_error("out", out.double(), ref, naive.double(), ATOL_BASE[torch.bfloat16])
    assert not problem, problem


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper backward's dropout instances run on sm_90")
@pytest.mark.parametrize("D,hopper", [(32, False), (40, True), (64, True), (96, True), (128, True)])
def test_hopper_backward_draws_the_dropout(D, hopper):
    """On sm_90 a dense backward with dropout at d 33..128 runs the warp-specialized backward's
    dropout kernel (its 128-wide tiles at every d; d <= 32: mma.sync), and its gradients are the
    reference's for the recorded draws."""
    B, Hq, Hkv, S, p = 2, 4, 2, 300, 0.2
    q, k, v = make_inputs(B, Hq, Hkv, S, S, D, torch.bfloat16, "cuda", seed=D + 1)
    do = make_inputs(B, Hq, Hq, S, S, D, torch.bfloat16, "cuda", seed=3)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got, rng, scale, win = _run(q, k, v, do, p, True, (-1, -1))
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert ("bwd_sm90_ws_dropout_kernel" in names) == hopper, names[:800]
    seed, offset = (int(x) for x in rng.tolist())
    mask = R.dropout_keep_mask(B, Hq, S, S, p, seed=seed, offset=offset, device="cuda")

    def reference(dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        out, lse = R.attention_naive(*leaves, scale=scale, window_size=win, dropout_p=p, dropout_mask=mask)
        return (out, lse, *torch.autograd.grad((out * do.to(dt)).sum(), leaves))

    ref, naive = reference(torch.float64), reference(torch.bfloat16)
    problems = []
    for name, x, r, n in zip(("out", "lse", "dq", "dk", "dv"), got, ref, naive):
        _, problem = rule_error(name, x.double(), r.double(), n.double(), ATOL_BASE[torch.bfloat16],
                                mask=torch.isfinite(r) if name == "lse" else None)
        if problem:
            problems.append(problem)
    assert not problems, problems


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dropout_with_softcap_and_alibi(dtype):
    """Dropout beside the score modifiers (softcap's derivative in the backward, ALiBi slopes per
    head): the kernels' output and gradients against the reference given the recorded mask."""
    from attn_check import make_alibi_slopes
    B, Hq, Hkv, S, D, p, cap = 2, 4, 2, 200, 64, 0.2, 5.0
    q, k, v = make_inputs(B, Hq, Hkv, S, S, D, dtype, "cuda", seed=11)
    do = make_inputs(B, Hq, Hq, S, S, D, dtype, "cuda", seed=12)[0]
    slopes = make_alibi_slopes(Hq, device="cuda", seed=3)
    C = _ext.require()
    scale = D ** -0.5
    rng = torch.empty(2, dtype=torch.int64, device="cuda")
    out, lse, aux = C.fwd(q, k, v, scale, -1, 0, cap, slopes, None, None, 0, 0, 0, dropout_p=p, rng_state=rng)
    dq, dk, dv = C.bwd(do, q, k, v, out, lse, aux, None, scale, -1, 0, cap, slopes, None, None, 0, 0, False, 0,
                       dropout_p=p, rng_state=rng)
    seed, offset = (int(x) for x in rng.tolist())
    mask = R.dropout_keep_mask(B, Hq, S, S, p, seed=seed, offset=offset, device="cuda")

    def reference(dt):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        o, l = R.attention_naive(*leaves, scale=scale, is_causal=True, softcap=cap, alibi_slopes=slopes,
                                 dropout_p=p, dropout_mask=mask)
        return (o, l, *torch.autograd.grad((o * do.to(dt)).sum(), leaves))

    ref, naive = reference(torch.float64), reference(dtype)
    problems = []
    for name, x, r, n in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref, naive):
        _, problem = rule_error(name, x.double(), r.double(), n.double(), ATOL_BASE[dtype],
                                mask=torch.isfinite(r) if name == "lse" else None)
        if problem:
            problems.append(problem)
    assert not problems, problems
