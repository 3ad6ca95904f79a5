"""flash_cuda.attention at the edges: sizes, lengths, magnitudes and non-finite values.

* More than 2^31 elements per tensor (bf16/fp16/fp32): every offset must be int64. The
  result is verified on sampled (batch, head) slices, including the heads on either side
  of element 2^31, against float64 computed for just those slices.
* Sk = 1; Sq = 1 with Sk = 65536 (decode); B = 1, S = 65536 forward + backward in O(S)
  memory (peak allocation growth far below S^2) with spot checks of rows and keys.
* Huge and tiny logits: scale = 1e3 and 1e-4 (with gradients); inputs of
  magnitude 1e4 (fp32, bf16) and near the fp16 maximum 6e4, where the naive fp16
  reference itself overflows: flash_cuda is compared with float64 computed from the same
  values and must stay finite wherever float64 is. For those magnitudes only the
  forward is checked: the backward recomputes P = exp(S - lse) from logits of size
  1e8..1e9, where float32 cannot resolve S - lse, and rounds dS to the 16-bit dtype
  before its MMA; both are inherent to the FlashAttention backward.
* NaN / -inf inputs: NaN in one q row, in one k row, in one v element; -inf in a k row
  (scores of +inf and -inf) or a v element. The NaN / +inf / -inf pattern of out and lse
  must be the float64 reference's.
* Causal with Sq > Sk: rows that see no key give out 0, lse -inf, zero dq, and nothing NaN.

The accuracy rule is attn_check's: error vs float64 <= 2x the naive same-dtype error +
a tiny atol. The slow tests (``@pytest.mark.slow``) can be deselected with -m "not slow".
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Optional, Sequence, Tuple

import pytest
import torch

import flash_cuda
from flash_cuda.reference import attention_naive

from attn_check import ATOL_BASE, LSE_ATOL_BASE, check_attention, make_inputs

pytestmark = pytest.mark.gpu  # conftest skips these, with the reason, without a usable GPU

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DT_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
GiB = 1 << 30
MiB = 1 << 20


def _dt(dtype: torch.dtype) -> str:
    return DT_IDS[dtype]


@contextmanager
def _no_tf32():
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _free_cuda():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _need_free_memory(nbytes: int) -> None:
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes:
        pytest.skip(f"needs {nbytes / GiB:.1f} GiB of free GPU memory, {free / GiB:.1f} GiB free")


def _fwd_bwd(fn, q, k, v, dout=None):
    """Runs ``fn(q, k, v) -> (out, lse)`` on leaves that share q/k/v's storage (strides
    kept) and, with ``dout``, the backward of <out, dout>. Returns (out, lse, grads)."""
    want = dout is not None
    qq, kk, vv = (t.detach().requires_grad_(want) for t in (q, k, v))
    out, lse = fn(qq, kk, vv)
    grads = torch.autograd.grad(out, (qq, kk, vv), dout) if want else (None, None, None)
    return out.detach(), lse.detach(), grads


def _flash(is_causal: bool, scale: Optional[float] = None):
    return lambda q, k, v: flash_cuda.attention(q, k, v, is_causal=is_causal, scale=scale,
                                                return_lse=True)


def _naive(is_causal: bool, scale: Optional[float] = None):
    return lambda q, k, v: attention_naive(q, k, v, is_causal=is_causal, scale=scale)


def _references(q, k, v, dout, *, is_causal: bool, scale: Optional[float] = None):
    """(float64 ground truth, naive in the inputs' dtype), each (out, lse, grads)."""
    with _no_tf32():
        ref = _fwd_bwd(_naive(is_causal, scale), q.double(), k.double(), v.double(),
                       None if dout is None else dout.double())
        naive = _fwd_bwd(_naive(is_causal, scale), q, k, v, dout)
    return ref, naive


def _assert_2x(name: str, got, ref, naive, atol_base: float, min_mag: float = 0.0) -> None:
    """attn_check's rule for given results: finite wherever float64 is, identical non-finite
    values elsewhere, and max|got - ref| <= 2 * max|naive - ref| + atol_base * max|ref|."""
    got = got.detach().double()
    ref = ref.detach().double()
    naive = naive.detach().double()
    finite = torch.isfinite(ref)
    n_bad = int((~torch.isfinite(got) & finite).sum())
    assert n_bad == 0, f"{name}: {n_bad} non-finite values where the float64 reference is finite"
    if not bool(finite.all()):
        assert torch.equal(got[~finite], ref[~finite]), f"{name}: non-finite values differ"
    if not bool(finite.any()):
        return
    err = float((got - ref)[finite].abs().max())
    err_naive = float((naive - ref)[finite].abs().max())
    mag = max(float(ref[finite].abs().max()), min_mag)
    atol = atol_base * max(mag, 1e-3)
    if not math.isfinite(err_naive):  # the same-dtype naive overflowed
        err_naive, atol = 0.0, 50 * atol
    tol = 2 * err_naive + atol
    assert err <= tol, (f"{name}: max|flash - ref64| = {err:.3e} > {tol:.3e} (2 * naive "
                        f"{err_naive:.3e} + atol {atol:.3e}, max|ref| {mag:.3e})")


def _check_slice(label, dtype, got, ref, naive, grad_names=("dq", "dk", "dv")):
    """got/ref/naive: (out, lse, grads) of the same slice; grads as named."""
    _assert_2x(f"{label} out", got[0], ref[0], naive[0], ATOL_BASE[dtype])
    _assert_2x(f"{label} lse", got[1], ref[1], naive[1], LSE_ATOL_BASE[dtype], min_mag=1.0)
    for name, g, r, n in zip(grad_names, got[2], ref[2], naive[2]):
        _assert_2x(f"{label} {name}", g, r, n, ATOL_BASE[dtype])


# ---------------------------------------------------------------------------------------
# More than 2^31 elements
# ---------------------------------------------------------------------------------------

# (dtype, layout, B, H, S, D, causal): every q/k/v/out/dq/dk/dv tensor has > 2^31 elements.
#  * bhsd with B*H*S*D > 2^31: batch/head offsets pass 2^31;
#  * bshd (B, S, H, D storage) with B = 1: row offsets i * H * D pass 2^31 for i >= 964.
HUGE_CASES = [
    pytest.param(torch.bfloat16, "bhsd", 17, 1024, 1024, 128, True, id="bf16-bhsd-causal"),
    pytest.param(torch.float16, "bshd", 1, 17408, 1024, 128, False, id="fp16-bshd"),
    pytest.param(torch.float32, "bhsd", 129, 1024, 256, 64, False, id="fp32-bhsd"),
]


def _huge_tensor(B, H, S, D, dtype, layout, gen):
    if layout == "bshd":
        return torch.randn((B, S, H, D), dtype=dtype, device="cuda", generator=gen).transpose(1, 2)
    return torch.randn((B, H, S, D), dtype=dtype, device="cuda", generator=gen)


def _sample_heads(B: int, H: int, S: int, D: int, gen_seed: int) -> Sequence[Tuple[int, int]]:
    """First and last head, the heads on both sides of element 2^31 (contiguous layout), a
    middle one and two random ones."""
    per_head = S * D
    cross = -(-(2**31) // per_head)  # first flat head starting at or after element 2^31
    flat = {0, B * H - 1, (B * H) // 2, cross - 1, min(cross, B * H - 1)}
    rng = torch.Generator().manual_seed(gen_seed)
    flat |= {int(x) for x in torch.randint(0, B * H, (2,), generator=rng)}
    return sorted((f // H, f % H) for f in flat)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,layout,B,H,S,D,is_causal", HUGE_CASES)
def test_more_than_2pow31_elements(dtype, layout, B, H, S, D, is_causal):
    numel = B * H * S * D
    assert numel > 2**31
    esize = torch.tensor([], dtype=dtype).element_size()
    # q, k, v, out, dout, dq, dk, dv + lse/delta + the caching allocator's slack
    _free_cuda()
    _need_free_memory(8 * numel * esize + 2 * GiB)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    q = _huge_tensor(B, H, S, D, dtype, layout, gen)
    k = _huge_tensor(B, H, S, D, dtype, layout, gen)
    v = _huge_tensor(B, H, S, D, dtype, layout, gen)
    dout = torch.randn((B, H, S, D), dtype=dtype, device="cuda", generator=gen)
    assert q.numel() == numel

    out, lse, (dq, dk, dv) = _fwd_bwd(_flash(is_causal), q, k, v, dout)
    torch.cuda.synchronize()
    for name, t in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert t.shape == ((B, H, S) if name == "lse" else (B, H, S, D)), name

    for b, h in _sample_heads(B, H, S, D, gen_seed=B * H):
        sl = (slice(b, b + 1), slice(h, h + 1))
        ref, naive = _references(q[sl], k[sl], v[sl], dout[sl], is_causal=is_causal)
        got = (out[sl], lse[sl], (dq[sl], dk[sl], dv[sl]))
        first = ((b * H + h) * S * D) if layout == "bhsd" else (h * D)
        _check_slice(f"{_dt(dtype)} {layout} head (b={b}, h={h}) [first element {first}]",
                     dtype, got, ref, naive)
    del q, k, v, dout, out, lse, dq, dk, dv
    _free_cuda()


# ---------------------------------------------------------------------------------------
# Extreme lengths
# ---------------------------------------------------------------------------------------


def _max_abs(t) -> float:
    return float(t.detach().abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,D", [(1, 64), (77, 40), (300, 256)])
def test_single_key(dtype, is_causal, Sq, D):
    q, k, v = make_inputs(2, 4, 2, Sq, 1, D, dtype, "cuda", seed=Sq + D)
    # With one key, P = 1 on every row that sees it, so without an lse gradient dq and dk
    # are exactly 0 (dP - delta = 0): a tolerance relative to max|ref| = 0 cannot judge
    # the kernels' rounding noise. With a dlse they are not 0 and the usual rule applies.
    check_attention(q, k, v, is_causal=is_causal, scale=None, with_dlse=True, label="Sk=1")

    dout = torch.randn(q.shape, dtype=dtype, device="cuda",
                       generator=torch.Generator(device="cuda").manual_seed(Sq))
    out, lse, (dq, dk, dv) = _fwd_bwd(_flash(is_causal), q, k, v, dout)
    ref, naive = _references(q, k, v, dout, is_causal=is_causal)
    _check_slice(f"Sk=1 {_dt(dtype)} causal={is_causal}", dtype, (out, lse, (dv,)),
                 ref[:2] + ((ref[2][2],),), naive[:2] + ((naive[2][2],),), grad_names=("dv",))
    # dq, dk: rounding noise of dP - delta (float32 sums of D products) times scale * |k|
    # (dq) or the sum over the Sq rows of scale * |q| (dk). Real errors are O(terms).
    scale = D ** -0.5
    dp_noise = 16 * 2.0**-24 * D * _max_abs(dout) * _max_abs(v)
    for name, g, bound in (("dq", dq, dp_noise * scale * _max_abs(k)),
                           ("dk", dk, dp_noise * scale * Sq * _max_abs(q))):
        assert bool(torch.isfinite(g).all()), f"Sk=1 {name}: non-finite values"
        assert _max_abs(g) <= bound, (f"Sk=1 {_dt(dtype)} causal={is_causal}: max|{name}| = "
                                      f"{_max_abs(g):.3e} > {bound:.3e} (exactly 0 in exact "
                                      f"arithmetic)")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,Sk,D", [(1, 65536, 128), (1, 65537, 256), (3, 65535, 64)])
def test_decode_long_keys(dtype, is_causal, Sq, Sk, D):
    B, Hq, Hkv = (2, 8, 2) if D <= 128 else (1, 4, 1)
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout="bshd", seed=Sk)
    check_attention(q, k, v, is_causal=is_causal, scale=None, label="decode")


def _chunked_key_grads64(q, k, v, dout, key_idx, *, is_causal, scale, chunk=2048):
    """float64 dK, dV of the keys ``key_idx`` for one head (q, k, v, dout: (S, D) each),
    accumulated over chunks of query rows so no (S x S) matrix is ever formed."""
    Sq, Sk = q.shape[0], k.shape[0]
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, dout))
    kw, vw = k64[key_idx], v64[key_idx]
    dk = torch.zeros_like(kw)
    dv = torch.zeros_like(vw)
    cols = torch.arange(Sk, device=q.device)
    for a in range(0, Sq, chunk):
        b = min(Sq, a + chunk)
        s = (q64[a:b] @ k64.T) * scale
        if is_causal:
            rows = torch.arange(a, b, device=q.device)
            s.masked_fill_(cols.view(1, -1) > rows.view(-1, 1) + (Sk - Sq), float("-inf"))
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - lse)
        del s
        o = p @ v64
        delta = (do64[a:b] * o).sum(-1, keepdim=True)
        pw = p[:, key_idx]
        del p
        ds = pw * (do64[a:b] @ vw.T - delta)
        dv += pw.T @ do64[a:b]
        dk += scale * (ds.T @ q64[a:b])
    return dk, dv


# Spot-check tolerance for dK/dV of a 65536-long sum (no same-dtype naive to compare to):
# a fraction of max|ref|. Garbage from a wrong offset is O(max|ref|).
_SPOT_RTOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@pytest.mark.slow
@pytest.mark.parametrize("dtype,is_causal,Hq,Hkv", [
    pytest.param(torch.bfloat16, True, 1, 1, id="bf16-causal"),
    pytest.param(torch.float16, False, 2, 1, id="fp16-gqa"),
    pytest.param(torch.float32, False, 1, 1, id="fp32"),
])
def test_long_sequence_memory_is_linear(dtype, is_causal, Hq, Hkv):
    S, D = 65536, 64
    _free_cuda()
    q, k, v = make_inputs(1, Hq, Hkv, S, S, D, dtype, "cuda", seed=65536)
    gen = torch.Generator(device="cuda").manual_seed(5)
    dout = torch.randn(q.shape, dtype=dtype, device="cuda", generator=gen)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = flash_cuda.attention(qq, kk, vv, is_causal=is_causal, return_lse=True)
    torch.cuda.synchronize()
    fwd_extra = torch.cuda.max_memory_allocated() - base

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), dout)
    torch.cuda.synchronize()
    bwd_extra = torch.cuda.max_memory_allocated() - base

    quadratic = Hq * S * S * q.element_size()  # one score matrix in the input dtype
    linear = 8 * q.numel() * 4 + 16 * MiB  # generous O(B*H*S*D) allowance
    for name, extra in (("forward", fwd_extra), ("backward", bwd_extra)):
        assert extra <= linear and extra < quadratic / 64, (
            f"{name} allocated {extra / MiB:.1f} MiB for S={S}: not O(S) "
            f"(linear allowance {linear / MiB:.1f} MiB, S^2 matrix {quadratic / MiB:.0f} MiB)")

    out, lse = out.detach(), lse.detach()
    scale = D ** -0.5
    G = Hq // Hkv
    # Rows: windows at the start, middle and end; attention_naive on a window of rows
    # [a, b) with the keys [0, b + Sk - Sq) is exact (also for causal alignment).
    for a in (0, S // 2 - 1, S - 3):
        b = a + 3
        kend = b if is_causal else S
        for h in range(Hq):
            hk = h // G
            win = lambda t, hh: t[:, hh:hh + 1, a:b]  # noqa: E731
            ref, naive = _references(win(q, h), k[:, hk:hk + 1, :kend], v[:, hk:hk + 1, :kend],
                                     win(dout, h), is_causal=is_causal, scale=scale)
            got = (win(out, h), lse[:, h:h + 1, a:b], (win(dq, h), None, None))
            label = f"S={S} {_dt(dtype)} rows [{a}, {b}) head {h}"
            _assert_2x(f"{label} out", got[0], ref[0], naive[0], ATOL_BASE[dtype])
            _assert_2x(f"{label} lse", got[1], ref[1], naive[1], LSE_ATOL_BASE[dtype], 1.0)
            _assert_2x(f"{label} dq", got[2][0], ref[2][0], naive[2][0], ATOL_BASE[dtype])

    keys = torch.tensor([0, 1, S // 2, S // 2 + 1, S - 2, S - 1], device="cuda")
    for hk in range(Hkv):
        dk_ref = torch.zeros((keys.numel(), D), dtype=torch.float64, device="cuda")
        dv_ref = torch.zeros_like(dk_ref)
        for h in range(hk * G, (hk + 1) * G):  # dK/dV sum over the group's query heads
            a_, b_ = _chunked_key_grads64(q[0, h], k[0, hk], v[0, hk], dout[0, h], keys,
                                          is_causal=is_causal, scale=scale)
            dk_ref += a_
            dv_ref += b_
        for name, got, ref in (("dk", dk[0, hk, keys], dk_ref), ("dv", dv[0, hk, keys], dv_ref)):
            err = float((got.double() - ref).abs().max())
            tol = _SPOT_RTOL[dtype] * float(ref.abs().max()) + 1e-6
            assert bool(torch.isfinite(got).all()), f"S={S} {name}: non-finite values"
            assert err <= tol, (f"S={S} {_dt(dtype)} {name} of keys {keys.tolist()} (kv head "
                                f"{hk}): max err {err:.3e} > {tol:.3e}")
    del q, k, v, qq, kk, vv, dout, out, lse, dq, dk, dv
    _free_cuda()


# ---------------------------------------------------------------------------------------
# Huge and tiny logits
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_tiny_scale(dtype, is_causal):
    q, k, v = make_inputs(2, 4, 2, 97, 131, 64, dtype, "cuda", layout="bshd", seed=77)
    check_attention(q, k, v, is_causal=is_causal, scale=1e-4, label="scale=1e-4")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_huge_scale(dtype, is_causal):
    """scale = 1e3: logits up to ~4e4, softmax nearly one-hot. The forward follows the
    usual rule. Two errors of the FlashAttention backward that the naive autograd (which
    keeps P) does not have are added to the gradient tolerance, each computed, not guessed:
    P = exp(S - lse) recomputed with lse ~ 4e4 in float32 (~2^-24 * |lse| relative on P),
    and delta = rowsum(dO * O) formed from the rounded output (_delta_from_rounded_out)."""
    scale = 1e3
    q, k, v = make_inputs(2, 4, 2, 97, 131, 64, dtype, "cuda", layout="bshd", seed=77)
    check_attention(q, k, v, is_causal=is_causal, scale=scale, check_grad=False,
                    label="scale=1e3")
    dout = torch.randn(q.shape, dtype=dtype, device="cuda",
                       generator=torch.Generator(device="cuda").manual_seed(78))
    out, lse, grads = _fwd_bwd(_flash(is_causal, scale), q, k, v, dout)
    ref, naive = _references(q, k, v, dout, is_causal=is_causal, scale=scale)
    lse_mag = _max_abs(ref[1])
    delta_terms = _delta_from_rounded_out(q, k, v, dout, out, is_causal=is_causal, scale=scale)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref[2], naive[2]):
        recompute = 4 * 2.0**-24 * lse_mag * _max_abs(r)
        err = float((g.double() - r).abs().max())
        err_naive = float((n.double() - r).abs().max())
        tol = (2 * err_naive + ATOL_BASE[dtype] * _max_abs(r) + recompute
               + 2 * delta_terms[name])
        assert bool(torch.isfinite(g).all()), f"scale=1e3 {name}: non-finite values"
        assert err <= tol, (f"scale=1e3 {_dt(dtype)} causal={is_causal} {name}: err {err:.3e} > "
                            f"{tol:.3e} (2 * naive {err_naive:.3e} + atol + P-recompute "
                            f"{recompute:.3e})")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("rise", [3.0, 12.0, 40.0])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_logits_rising_along_keys(dtype, D, rise, is_causal):
    """Every row's logits grow along the keys by about `rise` (log2 units) per 64 keys, so
    the running max moves on almost every key block: by less than, about, and more than
    the slack of a lagging reference max (a kernel may keep an old max while P stays
    bounded, and rescale only when a block's max pulls away). Forward against float64."""
    B, H, Sq, Sk = 1, 3, 200, 1000
    gen = torch.Generator(device="cuda").manual_seed(int(rise) * 7 + D)
    u = torch.ones(D, device="cuda", dtype=torch.float64)
    q = u + 0.3 * torch.randn(B, H, Sq, D, device="cuda", dtype=torch.float64, generator=gen)
    scale = 1.0 / math.sqrt(D)
    a = rise / (64 * math.log2(math.e))  # logit step per key, natural units
    ramp = a * torch.arange(Sk, device="cuda", dtype=torch.float64) / (scale * D)
    k = ramp[:, None] * u + 0.3 * torch.randn(B, H, Sk, D, device="cuda", dtype=torch.float64,
                                              generator=gen)
    v = torch.randn(B, H, Sk, D, device="cuda", dtype=torch.float64, generator=gen)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    check_attention(q, k, v, is_causal=is_causal, scale=scale, check_grad=False,
                    label=f"logits rising {rise}/64 keys")


def _delta_from_rounded_out(q, k, v, dout, out, *, is_causal: bool, scale: float):
    """How far the exact float64 gradients move when delta = rowsum(dO * O) is computed from
    the output rounded to the inputs' dtype, as every FlashAttention backward does (only O
    and lse are kept from the forward). In a nearly one-hot softmax (scale = 1e3) the
    diagonal of dS = P * (dP - delta) is a cancellation, so this rounding, multiplied by
    the scale, is the dominant error of dq and dk; the naive autograd keeps P and never
    forms delta from O. Returns {name: max|grad(rounded delta) - grad(exact delta)|}."""
    q64, k64, v64, do64 = (t.detach().double() for t in (q, k, v, dout))
    group = q.shape[1] // k.shape[1]
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if is_causal:
        sq, sk = s.shape[-2:]
        i = torch.arange(sq, device=s.device)[:, None]
        j = torch.arange(sk, device=s.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    dp = do64 @ v64.transpose(-1, -2)
    grads = {}
    for key, o in (("exact", p @ v64), ("rounded", out.detach().double())):
        delta = (do64 * o).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq = scale * ds @ k64
        dk = scale * (ds.transpose(-1, -2) @ q64)
        dk = dk.unflatten(1, (k.shape[1], group)).sum(2)
        grads[key] = (dq, dk)
    return {"dq": float((grads["rounded"][0] - grads["exact"][0]).abs().max()),
            "dk": float((grads["rounded"][1] - grads["exact"][1]).abs().max()),
            "dv": 0.0}


def _signed_magnitudes(shape, lo, hi, dtype, gen):
    """Values with |x| in [lo, hi] and random signs."""
    mag = torch.rand(shape, device="cuda", generator=gen) * (hi - lo) + lo
    sign = torch.where(torch.rand(shape, device="cuda", generator=gen) < 0.5, -1.0, 1.0)
    return (mag * sign).to(dtype)


LARGE_INPUTS = [
    # (dtype, q/k magnitude, v magnitude): logits of order 1e8 .. 1e9
    pytest.param(torch.float32, (5e3, 1e4), None, id="fp32-1e4"),
    pytest.param(torch.bfloat16, (5e3, 1e4), None, id="bf16-1e4"),
    pytest.param(torch.float16, (3e4, 6e4), None, id="fp16-6e4-qk"),
    pytest.param(torch.float16, (3e4, 6e4), (3e4, 6e4), id="fp16-6e4-qkv"),
]


@pytest.mark.parametrize("dtype,qk_mag,v_mag", LARGE_INPUTS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_large_inputs_forward(dtype, qk_mag, v_mag, is_causal):
    gen = torch.Generator(device="cuda").manual_seed(11)
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 67, 130, 64
    q = _signed_magnitudes((B, Hq, Sq, D), *qk_mag, dtype, gen)
    k = _signed_magnitudes((B, Hkv, Sk, D), *qk_mag, dtype, gen)
    if v_mag is None:
        v = torch.randn((B, Hkv, Sk, D), device="cuda", generator=gen).to(dtype)
    else:
        v = _signed_magnitudes((B, Hkv, Sk, D), *v_mag, dtype, gen)
    # check_attention compares with float64 from the same values and, where the naive
    # same-dtype attention overflows (fp16), falls back to a magnitude-relative atol; it
    # also requires out finite and lse finite (no row here is fully masked).
    check_attention(q, k, v, is_causal=is_causal, scale=None, check_grad=False,
                    label=f"large inputs {_dt(dtype)} {qk_mag}")
    out = flash_cuda.attention(q, k, v, is_causal=is_causal)
    ref = attention_naive(q.double(), k.double(), v.double(), is_causal=is_causal)[0]
    assert bool(torch.isfinite(ref).all())
    assert bool(torch.isfinite(out).all()), "non-finite output where float64 is finite"


# ---------------------------------------------------------------------------------------
# NaN and -inf inputs
# ---------------------------------------------------------------------------------------

# (what, is_causal). A NaN / -inf in v reaches every row through P @ V (0 * NaN = NaN),
# also the rows that do not see that key in the float64 reference, so v cases are
# non-causal only.
NONFINITE_CASES = [
    ("q_nan", False), ("q_nan", True),
    ("k_nan", False), ("k_nan", True),
    ("v_nan", False),
    ("k_neginf", False), ("k_neginf", True),
    ("v_neginf", False),
]


def _poison(q, k, v, what):
    q, k, v = q.clone(), k.clone(), v.clone()
    value = float("nan") if what.endswith("nan") else float("-inf")
    if what.startswith("q"):
        q[0, 1, 33, 5] = value  # one q row (query head 1)
    elif what.startswith("k"):
        k[0, 1, 40, 7] = value  # one k row (kv head 1 -> query heads 2, 3)
    else:
        v[0, 0, 40, 7] = value  # one v element (kv head 0 -> query heads 0, 1)
    return q, k, v


def _patterns(x):
    x = x.detach().double()
    return torch.isnan(x), torch.isposinf(x), torch.isneginf(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("what,is_causal", NONFINITE_CASES)
def test_nonfinite_inputs_follow_reference(dtype, what, is_causal):
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 70, 90, 64
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", seed=4242)
    q, k, v = _poison(q, k, v, what)
    out, lse = flash_cuda.attention(q, k, v, is_causal=is_causal, return_lse=True)
    with _no_tf32():
        out64, lse64 = attention_naive(q.double(), k.double(), v.double(), is_causal=is_causal)
        outn, lsen = attention_naive(q, k, v, is_causal=is_causal)
    label = f"{what} {_dt(dtype)} causal={is_causal}"

    nan_r, pinf_r, ninf_r = _patterns(out64)
    nan_f, pinf_f, ninf_f = _patterns(out)
    assert nan_r.any() or ninf_r.any(), f"{label}: the case poisons nothing (test bug)"
    for name, f, r in (("NaN", nan_f, nan_r), ("+inf", pinf_f, pinf_r), ("-inf", ninf_f, ninf_r)):
        assert torch.equal(f, r), (f"{label}: out {name} pattern differs from the float64 "
                                   f"reference at {int((f != r).sum())} elements")
    # lse: NaN where the reference is NaN; non-finite exactly where the reference is (a
    # score of +inf gives lse +inf in float64 and may give NaN in the kernels' exp2 domain).
    assert torch.equal(~torch.isfinite(lse), ~torch.isfinite(lse64)), \
        f"{label}: lse finiteness pattern differs from the reference"
    assert bool(torch.isnan(lse)[torch.isnan(lse64)].all()), (
        f"{label}: lse is not NaN on rows whose float64 lse is NaN (a NaN row must not be "
        f"reported as a row without keys: a test like `l > 0` is false for l = NaN)")
    assert bool((lse[torch.isneginf(lse64)] == float("-inf")).all())
    # The values that stay finite are still accurate.
    fin = torch.isfinite(out64)
    _assert_2x(f"{label} out (finite part)", torch.where(fin, out.double(), 0.0),
               torch.where(fin, out64, 0.0), torch.where(fin, outn.double(), 0.0),
               ATOL_BASE[dtype])
    fin = torch.isfinite(lse64)
    _assert_2x(f"{label} lse (finite part)", torch.where(fin, lse.double(), 0.0),
               torch.where(fin, lse64, 0.0), torch.where(fin, lsen.double(), 0.0),
               LSE_ATOL_BASE[dtype], min_mag=1.0)


# ---------------------------------------------------------------------------------------
# Rows that see no key
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("Sq,Sk,D", [(100, 37, 64), (300, 5, 40), (70, 1, 128), (129, 64, 256)])
def test_rows_without_keys(dtype, Sq, Sk, D):
    B, Hq, Hkv = 2, 4, 2
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout="bshd", seed=Sq * Sk)
    gen = torch.Generator(device="cuda").manual_seed(3)
    dout = torch.randn(q.shape, dtype=dtype, device="cuda", generator=gen)
    dlse = torch.randn((B, Hq, Sq), device="cuda", generator=gen)
    empty = Sq - Sk  # rows 0 .. empty-1 see no key
    for with_dlse in (False, True):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = flash_cuda.attention(qq, kk, vv, is_causal=True, return_lse=True)
        outputs, gouts = ((out,), (dout,))
        if with_dlse:  # a dlse on the -inf rows must not turn into NaN either
            outputs, gouts = (out, lse), (dout, dlse)
        dq, dk, dv = torch.autograd.grad(outputs, (qq, kk, vv), gouts)
        label = f"Sq={Sq} Sk={Sk} {_dt(dtype)} dlse={with_dlse}"
        assert bool((out[:, :, :empty] == 0).all()), f"{label}: out of key-less rows not 0"
        assert bool((lse[:, :, :empty] == float("-inf")).all()), f"{label}: lse not -inf"
        assert bool(torch.isfinite(lse[:, :, empty:]).all()), f"{label}: lse of seeing rows"
        assert bool((dq[:, :, :empty] == 0).all()), f"{label}: dq of key-less rows not 0"
        for name, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
            assert bool(torch.isfinite(t).all()), f"{label}: {name} has NaN/inf"
    # With Sk = 1 (and no dlse) dq and dk are exactly 0: test_single_key judges that case.
    for with_dlse in ((True,) if Sk == 1 else (False, True)):
        check_attention(q, k, v, is_causal=True, scale=None, with_dlse=with_dlse,
                        label="rows without keys")
