"""The Hopper backward's two routes (csrc/tiers/wgmma/family.h), each held to the float64 rule of
every other kernel (tests/attn_check.py), head dims 33..128 (65..96 on 96-wide tiles in the
warp-specialized kernel, csrc/tiers/wgmma/tile_policy.h: kBwdD96Native, and on the 128-wide ones
with deterministic=True or dropout) and 8..32 on the 64-wide kernels (dense, no score modifiers):
  ws             deterministic=False: the warp-specialized kernel, csrc/tiers/wgmma/bwd_ws.cuh: a
                 TMA producer, 5 products per block pair, dQ into an fp32 workspace (dense and
                 packed batches) by a writer warp's bulk reductions (one dS^T buffer at d = 64,
                 two at d = 128)
  deterministic  deterministic=True: the cp.async dK/dV kernel and a dQ kernel (bwd.cuh)
Softcap's backward (its derivative, kSoftcapGrad) runs on the warp-specialized kernel alone; with
deterministic=True it runs on the mma.sync backward. GPU-only, sm_90 only."""


import pytest
import torch

from attn_check import ATOL_BASE, check_attention, check_varlen_attention, hopper_skip_reason, \
    make_alibi_slopes, make_inputs, make_packed_tensor, make_varlen_inputs, rule_error


_SKIP = hopper_skip_reason("the Hopper backward")
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))

F16, BF16 = torch.float16, torch.bfloat16


MODES = ["ws", "deterministic"]


@pytest.fixture(params=MODES, autouse=True)
def mode(request):
    return request.param


def _det(mode):
    return mode == "deterministic"


# (B, Hq, Hkv, Sq, Sk, D, is_causal, window, alibi, layout): block edges, Sq != Sk both ways,
# GQA (several query heads add into one K/V block's CTA), windows, ALiBi, strided views, a
# head dim below the bucket.
CASES = [
    (2, 4, 4, 1000, 1000, 128, False, (-1, -1), None, "bhsd"),
    (1, 8, 2, 777, 1029, 128, True, (-1, -1), None, "bshd"),
    (2, 4, 1, 1029, 300, 128, True, (-1, -1), "heads", "strided"),
    (1, 4, 2, 513, 700, 112, False, (100, 37), None, "offset"),
    (1, 2, 2, 65, 1, 128, False, (-1, -1), None, "bhsd"),
    (2, 4, 2, 1000, 1000, 64, True, (-1, -1), None, "bhsd"),
    (1, 6, 3, 300, 1200, 48, False, (64, 64), "heads", "strided"),
    # Query blocks no key of a warpgroup sees (Sq > Sk causal: rows with no key at all; a short
    # window), several query heads per CTA with a two-stage ring that wraps many times.
    (1, 4, 1, 1500, 300, 64, True, (-1, -1), None, "bshd"),
    (2, 8, 2, 900, 900, 128, False, (40, 0), None, "bhsd"),
    # Head dims 65..96: the warp-specialized kernel's 96-wide tiles (Q, dO, V in 32-column slabs,
    # K in 16-column ones, dQ split 48 + 48), the deterministic kernels' 128-wide ones; the columns
    # past d arrive as TMA's zeros (at d <= 80 K's last 16-column box lies wholly past d). GQA
    # groups of 2 to 6, windows, ALiBi, Sq != Sk both ways, partial blocks, views, one key.
    (2, 4, 2, 1000, 1100, 96, True, (-1, -1), None, "bshd"),
    (1, 4, 4, 300, 257, 80, False, (-1, -1), "heads", "strided"),
    (1, 6, 1, 1029, 777, 72, True, (-1, -1), None, "offset"),
    (2, 4, 1, 513, 1000, 96, False, (100, 37), "heads", "bhsd"),
    (1, 8, 2, 900, 900, 88, True, (128, 0), None, "bshd"),
    (1, 2, 2, 65, 1, 96, False, (-1, -1), None, "strided"),
    (1, 4, 2, 1500, 300, 72, True, (-1, -1), "heads", "bhsd"),  # 1200 rows see no key
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,alibi,layout", CASES)
def test_sm90_bwd_gradients(mode, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, alibi, layout):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk)
    slopes = make_alibi_slopes(Hq, device="cuda", seed=Sq) if alibi else None
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, alibi_slopes=slopes,
                    deterministic=_det(mode), label=f"sm90 bwd {mode}", seed=Sq)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_sm90_bwd_packed_batch(mode, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((300, 0, 517, 64), (129, 5, 700, 64), 4, 2, 128, dtype,
                                                           seed=11)
    check_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, deterministic=_det(mode),
                           label=f"sm90 bwd {mode} varlen")


# Packed batches: (seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, alibi, layout). Lengths 0
# and 1, none a multiple of the 64 / 128-row blocks (a block's box then runs into the next
# sequence, whose rows the producer zeroes), Sq != Sk both ways within one batch, key blocks that
# start past a short sequence (max_seqlen_k spans several), many sequences inside one 128-row
# block (the dQ tiles of each are distinct), GQA, ALiBi per head and per sequence, windows.
VARLEN_CASES = [
    ((1, 0, 130, 64, 257), (1, 7, 130, 200, 257), 4, 2, 128, True, (-1, -1), None, "contiguous"),
    ((300, 17, 129, 0), (200, 517, 129, 5), 4, 1, 64, False, (-1, -1), "heads", "strided"),
    ((513, 65, 1000), (700, 1, 999), 6, 2, 96, True, (64, 0), None, "offset"),
    ((127, 128, 129), (129, 128, 127), 2, 2, 128, False, (100, 37), "batch", "contiguous"),
    ((3, 5, 60, 1, 1, 130, 2, 64, 9), (7, 5, 1, 33, 2, 300, 2, 64, 200), 4, 2, 48, True, (-1, -1), None,
     "contiguous"),
    ((900, 40), (100, 300), 2, 1, 128, True, (-1, -1), "heads", "strided"),  # 800 rows see no key
    ((77, 300), (300, 77), 8, 8, 80, False, (16, 16), None, "contiguous"),
    ((300, 1, 129, 0, 65), (129, 200, 65, 3, 300), 4, 2, 72, False, (-1, -1), "batch", "strided"),
    ((129, 1000, 64), (1000, 129, 1), 6, 3, 96, True, (-1, -1), "heads", "offset"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlens_q,seqlens_k,Hq,Hkv,D,is_causal,window,alibi,layout", VARLEN_CASES)
def test_sm90_bwd_packed_batches(mode, dtype, seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, alibi, layout):
    _check_packed(mode, dtype, seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, alibi, layout,
                  seed=sum(seqlens_q) + D)


def _check_packed(mode, dtype, seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, alibi, layout, *, seed,
                  softcap=0.0):
    """A packed batch of these lengths (alibi: None, "heads" or "batch" slopes) against float64."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs(seqlens_q, seqlens_k, Hq, Hkv, D, dtype, "cuda",
                                                           layout=layout, seed=seed)
    slopes = None
    if alibi:
        slopes = make_alibi_slopes(Hq, batch=len(seqlens_q) if alibi == "batch" else None, device="cuda", seed=seed)
    label = f"sm90 bwd {mode} varlen" + (f" softcap={softcap}" if softcap else "")
    check_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal, window_size=window,
                           softcap=softcap, alibi_slopes=slopes, deterministic=_det(mode), label=label, seed=seed)


# Softcap (the derivative 1 - tanh^2 in dS): (B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap,
# alibi, layout). Large caps (50: nearly the plain softmax) and small ones (5, 2, 1: many logits
# in tanh's flat part, where the derivative is small), with ALiBi (after the cap), GQA, causal,
# windows, rows that see no key, each head-dim bucket (64, 96 on the 96-wide tiles, 128) and a
# head dim below its bucket.
SOFTCAP_CASES = [
    (2, 4, 4, 1000, 1000, 128, False, (-1, -1), 50.0, None, "bhsd"),
    (1, 8, 2, 777, 1029, 128, True, (-1, -1), 5.0, "heads", "bshd"),
    (2, 4, 2, 1000, 1000, 64, True, (-1, -1), 5.0, None, "bhsd"),
    (1, 6, 3, 300, 1200, 64, False, (64, 64), 50.0, "heads", "strided"),
    (2, 4, 2, 1000, 1100, 96, True, (-1, -1), 30.0, None, "bshd"),
    (1, 4, 4, 300, 257, 80, False, (-1, -1), 5.0, "heads", "strided"),
    (1, 4, 1, 1500, 300, 48, True, (-1, -1), 2.0, None, "bshd"),  # 1200 rows see no key
    (2, 8, 2, 900, 900, 128, False, (40, 0), 1.0, "heads", "offset"),
    (1, 2, 2, 65, 1, 112, False, (-1, -1), 5.0, None, "bhsd"),
    (1, 6, 2, 333, 444, 72, True, (64, 0), 10.0, None, "offset"),
    (2, 4, 4, 257, 129, 96, False, (-1, -1), 2.0, "heads", "bhsd"),
]


def _softcap_on_ws(mode):
    if mode != "ws":
        pytest.skip("softcap's backward runs on the mma.sync kernels with deterministic=True (route test below)")


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,softcap,alibi,layout", SOFTCAP_CASES)
def test_sm90_bwd_softcap(mode, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap, alibi, layout):
    _softcap_on_ws(mode)
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk + 1)
    slopes = make_alibi_slopes(Hq, device="cuda", seed=Sq) if alibi else None
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, softcap=softcap,
                    alibi_slopes=slopes, label=f"sm90 bwd {mode} softcap={softcap}", seed=Sq)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("softcap", [5.0, 50.0])
def test_sm90_bwd_softcap_large_logits(mode, dtype, D, softcap):
    """Logits far past the cap (q scaled by 4, scale 0.5): most of tanh saturated, its
    derivative down to ~1e-6, next to logits in its steep part; dlse too."""
    _softcap_on_ws(mode)
    q, k, v = make_inputs(1, 4, 2, 600, 700, D, dtype, "cuda", seed=D + int(softcap))
    check_attention(q * 4, k, v, is_causal=True, scale=0.5, softcap=softcap, with_dlse=True,
                    label=f"sm90 bwd {mode} softcap={softcap} large logits", seed=D)


# Packed batches with softcap: (seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, softcap,
# alibi, layout), lengths 0 and 1 and blocks running into the next sequence as above.
SOFTCAP_VARLEN_CASES = [
    ((1, 0, 130, 64, 257), (1, 7, 130, 200, 257), 4, 2, 128, True, (-1, -1), 5.0, None, "contiguous"),
    ((300, 17, 129, 0), (200, 517, 129, 5), 4, 1, 64, False, (-1, -1), 50.0, "heads", "strided"),
    ((513, 65, 1000), (700, 1, 999), 6, 2, 96, True, (64, 0), 2.0, "batch", "offset"),
    ((77, 0, 300), (300, 4, 77), 4, 4, 80, False, (-1, -1), 5.0, None, "contiguous"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlens_q,seqlens_k,Hq,Hkv,D,is_causal,window,softcap,alibi,layout", SOFTCAP_VARLEN_CASES)
def test_sm90_bwd_softcap_packed_batches(mode, dtype, seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, softcap,
                                         alibi, layout):
    _softcap_on_ws(mode)
    _check_packed(mode, dtype, seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, alibi, layout,
                  seed=sum(seqlens_q) + D + 1, softcap=softcap)


# The NaN isolation case: sequence 1 is poisoned; sequence 0's last query block (100 rows) and
# last key block (90 keys) run into it, and sequences 2, 3 follow it.
_ISO_Q, _ISO_K = (100, 77, 200, 50), (90, 150, 33, 260)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
def test_sm90_bwd_packed_nonfinite_stays_in_its_sequence(mode, which, value, D):
    """NaN or Inf in every row of one sequence's q, k, v or dout: every other sequence's dq, dk,
    dv are finite and hold the float64 rule (in the packed tensors a TMA box at a sequence's end
    reads the next sequence's rows, which must act as zeros)."""
    import flash_cuda
    from flash_cuda.reference import attention_varlen_naive

    dtype, Hq, Hkv, poisoned = BF16, 4, 2, 1
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs(_ISO_Q, _ISO_K, Hq, Hkv, D, dtype, "cuda", seed=D)
    dout = make_packed_tensor(sum(_ISO_Q), Hq, D, dtype, "cuda", seed=D + 1)
    opts = dict(is_causal=False)

    def rows(cu, b):
        return slice(int(cu[b]), int(cu[b + 1]))

    bad = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "dout": dout.clone()}
    bad[which][rows(cu_q if which in ("q", "dout") else cu_k, poisoned)] = value
    qf, kf, vf = (bad[n].detach().requires_grad_() for n in ("q", "k", "v"))
    out = flash_cuda.varlen_attention(qf, kf, vf, cu_q, cu_k, max_q, max_k, deterministic=_det(mode), **opts)
    grads = torch.autograd.grad(out, (qf, kf, vf), bad["dout"])

    # References on the clean inputs: the other sequences do not depend on sequence 1.
    refs, lse64 = {}, None
    for name, rdtype in (("ref64", torch.float64), ("naive", dtype)):
        qr, kr, vr = (t.detach().to(rdtype).requires_grad_() for t in (q, k, v))
        o_r, l_r = attention_varlen_naive(qr, kr, vr, cu_q, cu_k, **opts)
        refs[name] = torch.autograd.grad(o_r, (qr, kr, vr), dout.to(rdtype))
        lse64 = l_r.detach() if lse64 is None else lse64
    keep_q = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    keep_k = torch.ones(k.shape[0], dtype=torch.bool, device="cuda")
    keep_q[rows(cu_q, poisoned)] = False
    keep_k[rows(cu_k, poisoned)] = False
    keeps = (keep_q, keep_k, keep_k)
    grad_mag = max([1.0] + [float(g[m].abs().max()) for g, m in zip(refs["ref64"], keeps)])
    score_mag = float(lse64[:, keep_q].abs().max())  # every kept row sees a key (not causal)
    problems = []
    for name, g, g64, gn, keep in zip(("dq", "dk", "dv"), grads, refs["ref64"], refs["naive"], keeps):
        if not bool(torch.isfinite(g[keep]).all()):
            problems.append(f"{name}: {int((~torch.isfinite(g[keep])).sum())} non-finite values outside "
                            f"sequence {poisoned}")
            continue
        _, problem = rule_error(name, g, g64, gn, ATOL_BASE[dtype], mask=keep, min_mag=grad_mag,
                                score_mag=score_mag, head_dim=D)
        if problem:
            problems.append(problem)
    assert not problems, f"[{mode}] {which} = {value} in sequence {poisoned}, D={D}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("D", [96, 80, 72])
def test_sm90_bwd_d96_layout(mode, D):
    """At d 65..96 the warp-specialized backward reads Q, dO, V as three 64-byte-swizzled
    32-column slabs and K as six 32-byte-swizzled 16-column slabs, runs dV, dK as m64n96k16 and dQ
    as two m64n48k16 halves (csrc/tiers/wgmma/tile_policy.h: kBwdD96Native), and writes 96-wide
    dQ workspace tiles. With all scores 0 (q = 0, or k = 0) every key weighs 1 / Sk, and with
    f(k) = k % 4 (mean 1.5, variance 1.25) the gradients have closed forms in which each column c
    carries the factor c, so a structured input names the column a wrong layout read:
      q = 0, K[k, c] = c f(k), V[k, c] = f(k), dO[i, c] = c:
          dV[k, c] = c Sq / Sk,  dQ[i, c] = scale c (sum of dO's row) var(f)
      k = 0, Q[i, c] = c, V[k, c] = f(k), dO = 1:
          dK[k, c] = scale c Sq D (f(k) - 1.5) / Sk
    (dS = P (dP - delta) with dP = f(k) times the sum of dO's row and delta its mean over the
    keys.) fp16: every input exact, P and dS within a few ulps, columns told apart by rounding."""
    import flash_cuda

    Sq = Sk = 300  # partial last query and key blocks; Sk % 4 == 0 keeps f's mean 1.5
    scale = 2.0 ** -8  # keeps dQ inside fp16's range
    rows_q = torch.arange(Sq, device="cuda", dtype=torch.float64).view(Sq, 1)
    rows_k = torch.arange(Sk, device="cuda", dtype=torch.float64).view(Sk, 1)
    cols = torch.arange(D, device="cuda", dtype=torch.float64).view(1, D)
    f = rows_k % 4

    def grads(q, k, v, dout):
        qf, kf, vf = (t.to(F16).expand(1, 2, -1, D).contiguous().requires_grad_() for t in (q, k, v))
        out = flash_cuda.attention(qf, kf, vf, scale=scale, deterministic=_det(mode))
        g = torch.autograd.grad(out, (qf, kf, vf), dout.to(F16).expand(1, 2, -1, D).contiguous())
        return [x.double()[0, 1] for x in g]  # the second head: its dQ tiles follow the first's

    def check(name, got, unit):
        idx = (got / unit).round()
        bad = (idx != cols).any(dim=0).nonzero().flatten().tolist()
        assert not bad, (f"[{mode}] D={D}: {name} columns {bad[:16]} carry the factors "
                         f"{idx[0, bad[:16]].tolist()} (row 0)")

    dq, _, dv = grads(0 * rows_q * cols, cols * f, f + 0 * cols, cols + 0 * rows_q)
    check("dv", dv, Sq / Sk)
    check("dq", dq, scale * D * (D - 1) / 2 * 1.25)
    _, dk, _ = grads(cols + 0 * rows_q, 0 * rows_k * cols, f + 0 * cols, 1 + 0 * rows_q * cols)
    check("dk", dk, scale * Sq * D * (f - 1.5) / Sk)


def test_sm90_bwd_negative_scale_and_large_values(mode):
    q, k, v = make_inputs(1, 4, 2, 600, 600, 128, BF16, "cuda", seed=5)
    check_attention(q * 4, k, v, is_causal=False, scale=-0.2, deterministic=_det(mode), label=f"sm90 bwd {mode} scale<0",
                    seed=5)


def test_deterministic_is_bitwise(mode):
    """deterministic=True runs the two-kernel path: bitwise equal gradients across runs."""
    import flash_cuda

    if mode != "deterministic":
        pytest.skip("one run is enough")
    q, k, v = make_inputs(1, 4, 2, 1000, 1000, 128, BF16, "cuda", seed=9)
    grads = []
    for _ in range(2):
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_cuda.attention(qf, kf, vf, is_causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (qf, kf, vf), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _backward_kernels(out, inputs):
    """The names of the CUDA kernels one backward of `out` ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(out, inputs, torch.ones_like(out))
        torch.cuda.synchronize()
    return " ".join(e.name for e in prof.events())


# Head dims 8..32 (csrc/tiers/wgmma/config.h: narrow_fwd_applies / narrow_bwd_applies): kernel='auto'
# runs the warp-specialized forward and, with deterministic=False, backward on the 64-wide tiles,
# the products over d 32 deep, TMA's zeros past d; deterministic=True stays on mma.sync. Block
# edges, Sq != Sk both ways, GQA, windows, views, the forward's 192-row tiles (Sq >= 2048), a
# single key.
NARROW_CASES = [
    (2, 4, 2, 1000, 1000, 32, True, (-1, -1), "bhsd"),
    (1, 4, 4, 777, 1029, 32, False, (-1, -1), "bshd"),
    (1, 4, 2, 2100, 2100, 16, True, (-1, -1), "bhsd"),
    (1, 4, 1, 513, 300, 24, True, (-1, -1), "strided"),
    (1, 2, 2, 300, 700, 8, False, (64, 32), "offset"),
    (1, 6, 3, 65, 1, 32, False, (-1, -1), "bhsd"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", NARROW_CASES)
def test_sm90_narrow_head_dims(mode, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + D)
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, deterministic=_det(mode),
                    label=f"sm90 narrow d {mode}", seed=Sq)


@pytest.mark.parametrize("D", [8, 32])
def test_narrow_head_dims_run_the_hopper_kernels(mode, D):
    """d <= 32: the warp-specialized forward, and the warp-specialized backward with
    deterministic=False (mma.sync with deterministic=True); softcap keeps both on mma.sync."""
    import flash_cuda

    q, k, v = make_inputs(1, 4, 2, 512, 512, D, BF16, "cuda", seed=5)
    for softcap in (0.0, 5.0):
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = flash_cuda.attention(qf, kf, vf, is_causal=True, softcap=softcap, deterministic=_det(mode))
            torch.cuda.synchronize()
        fwd_names = " ".join(e.name for e in prof.events())
        if not fwd_names:
            pytest.skip("torch.profiler recorded no CUDA kernel here (no CUPTI)")
        names = _backward_kernels(out, (qf, kf, vf))
        plain = softcap == 0.0
        assert ("fwd_sm90_ws_kernel" in fwd_names) == plain, fwd_names
        assert ("bwd_sm90_ws_kernel" in names) == (plain and mode == "ws"), names
        assert "bwd_dkdv_sm90_kernel" not in names, names


@pytest.mark.parametrize("D", [64, 96, 128])
def test_each_mode_runs_its_kernels(mode, D):
    """The route: the warp-specialized kernel and its dQ tile converter with deterministic=False,
    the dK/dV and dQ kernels of the cp.async path with deterministic=True."""
    import flash_cuda

    q, k, v = make_inputs(1, 4, 2, 512, 512, D, BF16, "cuda", seed=3)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.attention(qf, kf, vf, is_causal=True, deterministic=_det(mode))
    names = _backward_kernels(out, (qf, kf, vf))
    ws = mode == "ws"
    assert ("bwd_sm90_ws_kernel" in names) == ws, names
    assert ("convert_dq_tiles_kernel" in names) == ws, names
    assert ("bwd_dkdv_sm90_kernel" in names) == (not ws), names
    assert ("bwd_dq_sm90_kernel" in names) == (not ws), names


def _ws_variant(names):
    """The Variant (csrc/include/params.h: 0 plain, 1 extended, 2 softcap gradient) of the
    warp-specialized backward kernel the profiler saw, None if it did not run."""
    import re

    m = re.search(r"bwd_sm90_ws_kernel<.*?,\s*(\d)>\(flash_cuda::BwdParams", names)
    return int(m.group(1)) if m else None


@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_softcap_runs_its_kernels(mode, D, packed):
    """The route of softcap's backward: the warp-specialized kernel's softcap variant with
    deterministic=False, with kernel='auto' and kernel='wgmma'; the mma.sync backward (no Hopper
    kernel at all) with deterministic=True, where kernel='wgmma' is an error (ValueError from
    validation)."""
    import flash_cuda

    deterministic = _det(mode)
    for kernel in ("auto", "wgmma"):
        if packed:
            q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((300, 0, 129, 64), (200, 5, 300, 64), 4, 2, D, BF16,
                                                                   "cuda", seed=3)
            qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))

            def call():
                return flash_cuda.varlen_attention(qf, kf, vf, cu_q, cu_k, max_q, max_k, is_causal=True, softcap=5.0,
                                                   deterministic=deterministic, kernel=kernel)
        else:
            q, k, v = make_inputs(1, 4, 2, 512, 512, D, BF16, "cuda", seed=3)
            qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))

            def call():
                return flash_cuda.attention(qf, kf, vf, is_causal=True, softcap=5.0, deterministic=deterministic,
                                            kernel=kernel)
        if kernel == "wgmma" and deterministic:
            with pytest.raises(ValueError, match="softcap with deterministic=True"):
                call()
            continue
        names = _backward_kernels(call(), (qf, kf, vf))
        assert _ws_variant(names) == (None if deterministic else 2), (kernel, names)
        assert "bwd_dkdv_sm90_kernel" not in names and "bwd_dq_sm90_kernel" not in names, (kernel, names)
        assert ("bwd_dkdv_kernel" in names) == deterministic, (kernel, names)  # the mma.sync backward


@pytest.mark.parametrize("D", [64, 128])
def test_packed_batch_runs_its_kernels(mode, D):
    """The route of a packed batch's backward (varlen_attention): the warp-specialized kernel and
    its dQ tile converter with deterministic=False, the two-kernel cp.async path with
    deterministic=True."""
    import flash_cuda

    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((300, 0, 129, 64), (200, 5, 300, 64), 4, 2, D, BF16,
                                                           "cuda", seed=3)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.varlen_attention(qf, kf, vf, cu_q, cu_k, max_q, max_k, is_causal=True,
                                      deterministic=_det(mode))
    names = _backward_kernels(out, (qf, kf, vf))
    ws = mode == "ws"
    assert ("bwd_sm90_ws_kernel" in names) == ws, names
    assert ("bwd_dq_sm90_kernel" in names) == (not ws), names
    assert ("convert_dq_tiles_kernel" in names) == ws, names


def test_packed_batch_deterministic_is_bitwise(mode):
    """deterministic=True on a packed batch keeps the two-kernel path: bitwise equal gradients."""
    import flash_cuda

    if mode != "deterministic":
        pytest.skip("one run is enough")
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((300, 1, 129), (200, 77, 300), 4, 2, 128, F16, "cuda", seed=4)
    grads = []
    for _ in range(2):
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_cuda.varlen_attention(qf, kf, vf, cu_q, cu_k, max_q, max_k, is_causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (qf, kf, vf), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# 80-query steps (csrc/tiers/wgmma/tile_policy.h: kBwdSteps80MinSq): d 97..128 dense calls
# without score modifiers step over 80 queries from Sq 4096 on, dQ^T = K^T dS^T into transposed
# workspace tiles. Query counts around multiples of 80 (a last block of 1, 79 or 80 rows), Sq !=
# Sk both ways, causal and windowed masks (blocks the diagonal cuts anywhere), GQA with the ring
# wrapping, views, head dims below the bucket. The short cases take them through the ablation
# switch FLASH_CUDA_SM90_BWD_STEP=80 (csrc/tiers/wgmma/ablation.h) and skip in builds without it.
STEP80_CASES = [
    (2, 4, 4, 1000, 1000, 128, False, (-1, -1), "bhsd"),
    (1, 8, 2, 801, 1029, 128, True, (-1, -1), "bshd"),
    (1, 4, 1, 159, 700, 112, False, (100, 37), "strided"),
    (2, 4, 2, 160, 161, 128, True, (-1, -1), "offset"),
    (1, 2, 2, 81, 1, 104, False, (-1, -1), "bhsd"),
    (1, 4, 1, 1500, 300, 128, True, (-1, -1), "bshd"),  # 1200 rows see no key
    (2, 8, 2, 900, 900, 128, False, (40, 0), "bhsd"),
    # From Sq 4096 the default takes them.
    (1, 2, 2, 4096, 4096, 128, False, (-1, -1), "bhsd"),
    (1, 4, 2, 4177, 4100, 128, True, (-1, -1), "bshd"),
    (1, 2, 1, 4100, 3000, 112, False, (300, 0), "strided"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", STEP80_CASES)
def test_sm90_bwd_80_query_steps(monkeypatch, mode, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    from flash_cuda import _ext

    if mode != "ws":
        pytest.skip("80-query steps are the warp-specialized kernel's (deterministic=False)")
    if Sq < 4096:
        if not _ext.ablations():
            pytest.skip("below Sq 4096 an ablation switch: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
        monkeypatch.setenv("FLASH_CUDA_SM90_BWD_STEP", "80")
    else:
        monkeypatch.delenv("FLASH_CUDA_SM90_BWD_STEP", raising=False)
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk + 80)
    _check_ws_kernel(q, k, v, is_causal, window, "TilesOf80Queries", "sm90 bwd 80-query steps", seed=Sq)


def _ws_rung(monkeypatch, mode, **env):
    """An ablation rung of the warp-specialized backward: skips in the deterministic mode and in
    builds without rungs, else sets its switches."""
    from flash_cuda import _ext

    if mode != "ws":
        pytest.skip("the rung is the warp-specialized kernel's (deterministic=False)")
    if not _ext.ablations():
        pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def _check_ws_kernel(q, k, v, is_causal, window, marker, label, *, seed, present=True):
    """check_attention's float64 rule on the call, then that its backward ran a kernel whose name
    holds `marker` (the tiles or an option's wrapper, csrc/tiers/wgmma/bwd_ws.cuh), or with
    present=False that no kernel of it does."""
    import flash_cuda

    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, label=label, seed=seed)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.attention(qf, kf, vf, is_causal=is_causal, window_size=window)
    names = _backward_kernels(out, (qf, kf, vf))
    if not names:
        pytest.skip("torch.profiler recorded no CUDA kernel here (no CUPTI): the gradients held, the route is unchecked")
    assert (marker in names) == present, names


@pytest.mark.parametrize("Sq,D,deterministic,steps80", [(4095, 128, False, False), (4096, 128, False, True),
                                                        (4096, 96, False, False), (4096, 128, True, False)])
def test_80_query_steps_route(monkeypatch, mode, Sq, D, deterministic, steps80):
    """The default takes 80-query steps exactly at d 97..128 from Sq 4096 with deterministic=False."""
    import flash_cuda

    if mode != "ws":
        pytest.skip("one route test")
    monkeypatch.delenv("FLASH_CUDA_SM90_BWD_STEP", raising=False)
    q, k, v = make_inputs(1, 2, 2, Sq, 512, D, BF16, "cuda", seed=4)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.attention(qf, kf, vf, deterministic=deterministic)
    names = _backward_kernels(out, (qf, kf, vf))
    if not names:
        pytest.skip("torch.profiler recorded no CUDA kernel here (no CUPTI)")
    assert ("TilesOf80Queries" in names) == steps80, names


# The (lse, delta) pairs (config.h: bwd_bulk_stats; bwd_ws.cuh: BulkStats): the delta preprocess
# writes each query's (lse in log2 units, delta) into the workspace, the producer takes a block's
# pairs by one bulk copy; the ablation rung FLASH_CUDA_SM90_BWD_STATS=lanes stages them by the
# producer's lanes instead. Every tile shape of the kPlain kernels (d 32 and 64: 128-query steps;
# 96: native 96-wide; 128: 64-query and, from Sq 4096, 80-query steps), partial last blocks (the
# workspace's zero rows), masks, GQA, views.
STATS_CASES = [
    (2, 4, 2, 1000, 1100, 64, True, (-1, -1), "bshd"),
    (1, 4, 4, 300, 257, 96, False, (100, 37), "strided"),
    (2, 8, 2, 777, 1029, 128, True, (-1, -1), "bhsd"),
    (1, 4, 2, 4177, 4100, 128, True, (-1, -1), "offset"),
    (1, 6, 3, 65, 1, 32, False, (-1, -1), "bhsd"),
    (1, 4, 1, 1500, 300, 112, True, (-1, -1), "bshd"),  # 1200 rows see no key
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", STATS_CASES)
@pytest.mark.parametrize("stats", ["bulk", "lanes"])
def test_sm90_bwd_stats(monkeypatch, mode, stats, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    if stats == "lanes":
        _ws_rung(monkeypatch, mode, FLASH_CUDA_SM90_BWD_STATS="lanes")
    else:
        if mode != "ws":
            pytest.skip("the pairs are the warp-specialized kernel's (deterministic=False)")
        monkeypatch.delenv("FLASH_CUDA_SM90_BWD_STATS", raising=False)
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + D + 7)
    _check_ws_kernel(q, k, v, is_causal, window, "BulkStats", f"sm90 bwd stats {stats}", seed=Sq,
                     present=stats == "bulk")


# The order of the backward's CTAs (csrc/tiers/wgmma/bwd_ws.cuh: bwd_tile_section; core/scheduler.cuh:
# key_block_longest_first, key_section): under a right-bounded mask the dense CTAs go longest first,
# ascending key blocks over sections of (KV head, batch) pairs. The rung FLASH_CUDA_SM90_BWD_SECTION=N
# sets the section: 1 is the grid's own order, pair by pair; 3 leaves a short last section. Each CTA's
# work is the default's, so dK and dV are bitwise the default's (dQ's adds land in another order).
# GQA with long CTAs, the 80-query steps, partial blocks, Sq != Sk, a window bounded on the right; views.
ORDER_CASES = [
    (2, 16, 4, 1000, 1000, 128, True, (-1, -1), "bshd"),
    (1, 4, 4, 4177, 4100, 128, True, (-1, -1), "bhsd"),
    (2, 8, 2, 777, 1029, 64, True, (-1, -1), "strided"),
    (1, 4, 2, 300, 500, 96, False, (100, 0), "offset"),
]


@pytest.mark.parametrize("section", ["1", "3"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", ORDER_CASES)
def test_sm90_bwd_key_sections_rung(monkeypatch, mode, section, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    import flash_cuda

    _ws_rung(monkeypatch, mode)
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, BF16, "cuda", layout=layout, seed=Sq + D + 11)
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device, generator=torch.Generator("cuda").manual_seed(Sq))
    grads = {}
    for order in ("default", "rung"):
        if order == "rung":
            monkeypatch.setenv("FLASH_CUDA_SM90_BWD_SECTION", section)
        else:
            monkeypatch.delenv("FLASH_CUDA_SM90_BWD_SECTION", raising=False)
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_cuda.attention(qf, kf, vf, is_causal=is_causal, window_size=window)
        grads[order] = torch.autograd.grad(out, (qf, kf, vf), dout)
    assert torch.equal(grads["default"][1], grads["rung"][1]) and torch.equal(grads["default"][2], grads["rung"][2])
    # the switch still set: the float64 rule on the rung
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, label=f"sm90 bwd section {section}",
                    seed=Sq)
