"""The FP8 (e4m3) spec in flash_cuda.reference, on CPU.

* Quantization: e4m3_round / quantize_e4m3 against an independent rounding (the e4m3 grid
  listed from its bit patterns, nearest value, ties to the even mantissa), saturation at
  +-448 (inf included), NaN kept, the descale's direction (stored * descale = real) and
  its per-tensor / per-(batch, KV head) forms (fp8_descale).
* The blocked FP8 forward against float64 attention on the dequantized inputs, held to the
  2x rule: its error must be at most twice the naive FP8 attention's (attention_fp8_naive)
  plus a tiny absolute term, for head dims 64 / 128 / 256, causal, windows, softcap, ALiBi,
  sinks, GQA, Sq != Sk, per-tensor and per-(B, Hkv) descales, descales that saturate the
  inputs and logits that span a wide range; the lse to float32 rounding (the rounding of P
  never reaches it). The rule catches a descale applied to the wrong (batch, KV head).
* P is rounded to e4m3 after the 2^8 offset: with one key block the spec equals the naive
  attention that rounds P and is far from the one that does not; two-key problems whose
  output is known exactly in both the rounded and the offset-free forms.
* Packed batches: each sequence equals the dense spec on it (bit for bit), with row b of
  (B, Hkv) descales; the 2x rule against float64.
* The FP8 KV cache (dense and paged, split or not): the append stores e4m3(k / k_descale)
  in the right rows and nothing else; with power-of-two descales the result equals the
  16-bit KV-cache spec on the dequantized cache bit for bit; paged equals dense; the 2x
  rule against float64.
* Bad inputs: mixed FP8 / non-FP8, e5m2, mis-shaped or mistyped descales, bad options.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_cuda import reference as R
from flash_cuda.reference import (E4M3_MAX, attention_fp8_forward_blocked, attention_fp8_naive,
                                  attention_fp8_varlen_forward_blocked, attention_fp8_varlen_naive,
                                  attention_naive, attention_with_kvcache_fp8_reference,
                                  attention_with_kvcache_reference, dequantize_e4m3, e4m3_round,
                                  fp8_descale, quantize_e4m3)

from attn_check import cu_seqlens_from_lengths, make_alibi_slopes

F32, F64, E4M3 = torch.float32, torch.float64, torch.float8_e4m3fn
NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, ascending, computed from the bit layout (1 sign, 4 exponent
    bits with bias 7, 3 mantissa bits; exponent 0 subnormal; S.1111.111 is NaN, no inf):
    independent of torch's float8 conversion."""
    vals = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            mag = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            vals.update((mag, -mag))
    return torch.tensor(sorted(vals), dtype=F64)


GRID = e4m3_grid()


def round_e4m3_independent(x: torch.Tensor) -> torch.Tensor:
    """Nearest grid value, ties to the even mantissa (the even step of the grid, counted
    from 0), saturating at +-448, NaN kept; float64."""
    x = x.to(F64)
    xs = x.clamp(-E4M3_MAX, E4M3_MAX)
    idx = torch.searchsorted(GRID, xs).clamp(1, len(GRID) - 1)
    lo, hi = GRID[idx - 1], GRID[idx]
    d_lo, d_hi = xs - lo, hi - xs
    # The mantissa's last bit: the grid's magnitudes alternate even / odd codes, 0 even.
    code = lambda g: torch.searchsorted(GRID[GRID >= 0], g.abs())  # noqa: E731
    hi_even = code(hi) % 2 == 0
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & hi_even)
    out = torch.where(pick_hi, hi, lo)
    out = torch.where(xs == lo, lo, out)
    return torch.where(torch.isnan(x), x, out)


def heads_view(d: torch.Tensor, H: int) -> torch.Tensor:
    """(B, Hkv) descales -> (B, H, 1, 1), each KV head's value repeated over its group."""
    return d.repeat_interleave(H // d.shape[1], dim=1)[..., None, None]


def make_fp8(B, Hq, Hkv, Sq, Sk, D, *, kind="bhkv", seed=0, amp=1.0, v_amp=1.0, headroom=1.0):
    """Random float32 q, k, v quantized to e4m3 with descales of ``kind``: "one" (None),
    "tensor" (one float32 () per tensor: amax / 448), "bhkv" ((B, Hkv): amax of each batch
    entry's KV head group / 448, varied by batch and head) and "saturate" (the bhkv
    descales divided by 4: the largest inputs clamp to +-448). ``headroom`` multiplies the
    descales. Returns ((q8, k8, v8), (qd, kd, vd)) with qd ... as passed to the spec."""
    g = torch.Generator().manual_seed(1000 + seed)
    q = torch.randn(B, Hq, Sq, D, generator=g) * amp
    k = torch.randn(B, Hkv, Sk, D, generator=g) * amp
    v = torch.randn(B, Hkv, Sk, D, generator=g) * v_amp
    # A different magnitude per (batch, KV head), so that per-(B, Hkv) descales matter.
    spread = 2.0 ** torch.randint(-3, 4, (B, Hkv), generator=g).to(F32)
    q = q * heads_view(spread, Hq)
    k = k * spread[..., None, None]
    v = v * spread.flip(0)[..., None, None]
    if kind == "one":
        return tuple(quantize_e4m3(t) for t in (q, k, v)), (None, None, None)

    def descale(t, H):
        if kind == "tensor":
            return (t.abs().amax() / E4M3_MAX * headroom).reshape(())
        per = t.abs().reshape(B, Hkv, -1).amax(dim=-1) / E4M3_MAX * headroom
        return per / 4 if kind == "saturate" else per

    ds = (descale(q, Hq), descale(k, Hkv), descale(v, Hkv))
    out = []
    for t, d in zip((q, k, v), ds):
        dv = d if d.dim() == 0 else heads_view(d, t.shape[1])
        out.append(quantize_e4m3(t, dv))
    return tuple(out), ds


def dequant64(x8, d):
    """The real values of an e4m3 (B, H, S, D) tensor in float64 (the ground truth's input)."""
    if d is None:
        return x8.to(F64)
    d = d.to(F64)
    return x8.to(F64) * (d if d.dim() == 0 else heads_view(d, x8.shape[1]))


def max_err(x, ref, mask=None):
    d = (x.to(F64) - ref).abs()
    if mask is not None:
        d = d[mask]
    return float(d.max()) if d.numel() else 0.0


def assert_rule(name, x, ref, naive, atol_rel=2.0 ** -12, mask=None):
    """The 2x rule: max|x - ref| <= 2 max|naive - ref| + atol_rel * max(1, max|ref|)."""
    if mask is None:
        mask = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(x), torch.isfinite(ref)), f"{name}: finiteness differs"
    assert torch.equal(x[~mask].to(F64), ref[~mask]), f"{name}: non-finite values differ"
    err, err_naive = max_err(x, ref, mask), max_err(naive, ref, mask)
    mag = max(1.0, float(ref[mask].abs().max()) if mask.any() else 0.0)
    tol = 2 * err_naive + atol_rel * mag
    assert err <= tol, f"{name}: err {err:.3e} > tol {tol:.3e} (naive err {err_naive:.3e}, max|ref| {mag:.2e})"
    return err, err_naive


def e4m3_tensor_core_matmul(a, b):
    """a @ b (batch dims broadcast) on the GPU's FP8 tensor cores, for float32 CUDA tensors that
    hold e4m3 values: torch._scaled_mm with unit scales and the plain (fast) accumulation, the
    one the FP8 forward's wgmma products run at. Those sums keep fewer bits than float32's (at
    D 128 and logits near 300 the lse moves by about 0.1, the kernel's and this product's alike),
    so on the GPU the naive FP8 attention takes its products here: the "naive attention in the
    same precision" of the 2x rule."""
    e4m3 = torch.float8_e4m3fn
    a8, b8 = a.to(e4m3), b.to(e4m3)
    assert torch.equal(a8.float(), a) and torch.equal(b8.float(), b), "operands must hold e4m3 values"
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    (M, K), N = a.shape[-2:], b.shape[-1]
    if M == 0 or N == 0 or K == 0:
        return a.new_zeros(*batch, M, N)
    pm, pk, pn = (-M) % 16, (-K) % 16, (-N) % 16  # _scaled_mm's multiples of 16; zeros add nothing
    a8 = torch.nn.functional.pad(a8.expand(*batch, M, K).reshape(-1, M, K).view(torch.uint8), (0, pk, 0, pm)).view(e4m3)
    b8 = torch.nn.functional.pad(b8.expand(*batch, K, N).reshape(-1, K, N).view(torch.uint8), (0, pn, 0, pk)).view(e4m3)
    one = torch.ones((), device=a.device)
    out = torch.stack([torch._scaled_mm(x, y.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                        use_fast_accum=True) for x, y in zip(a8, b8)])
    return out[:, :M, :N].reshape(*batch, M, N)


def naive_fp8_on_gpu(fp8, ds, **opts):
    """attention_fp8_naive on the GPU with the tensor cores' products (e4m3_tensor_core_matmul):
    out and lse on the CPU."""
    dev = [t.to("cuda") for t in fp8]
    dds = [d if d is None else d.to("cuda") for d in ds]
    out, lse = attention_fp8_naive(*dev, *dds, matmul=e4m3_tensor_core_matmul, **opts)
    return out.cpu(), lse.cpu()


def check_forward(fp8, ds, opts, block_m=64, block_n=64, out_dtype=torch.bfloat16, max_lag=0.0):
    """The blocked spec against float64 on the dequantized inputs, next to the naive FP8
    attention (the 2x rule, out and lse). Returns (err, naive err) of out."""
    q8, k8, v8 = fp8
    out, lse = attention_fp8_forward_blocked(q8, k8, v8, *ds, block_m=block_m, block_n=block_n,
                                             out_dtype=out_dtype, max_lag=max_lag, **opts)
    assert out.dtype == out_dtype and lse.dtype == F32
    assert out.shape == q8.shape and lse.shape == q8.shape[:3]
    nout, nlse = attention_fp8_naive(q8, k8, v8, *ds, out_dtype=out_dtype, **opts)
    o64 = {n: (t.to(F64) if isinstance(t, torch.Tensor) else t) for n, t in opts.items()}
    rout, rlse = attention_naive(dequant64(q8, ds[0]), dequant64(k8, ds[1]), dequant64(v8, ds[2]), **o64)
    res = assert_rule("out", out, rout, nout)
    # lse does not see the rounding of P: float32 rounding of the logits' size only.
    assert_rule("lse", lse, rlse, nlse, atol_rel=2.0 ** -18)
    return res


# ---------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------


def test_grid_is_torch_float8_e4m3fn():
    every = torch.arange(256, dtype=torch.uint8).view(E4M3).to(F64)
    finite = every[torch.isfinite(every)]
    assert torch.equal(torch.unique(finite), torch.unique(GRID))  # +0 and -0 compare equal
    assert int(torch.isnan(every).sum()) == 2 and float(finite.abs().max()) == E4M3_MAX


def test_round_matches_independent_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-3, 0.05, 1.0, 30.0, 300.0)])
    mids = (GRID[1:] + GRID[:-1]) / 2  # every tie, exactly representable in float32
    x = torch.cat([x, mids.to(F32), GRID.to(F32), torch.tensor([2.0 ** -10, -2.0 ** -10, 2.0 ** -11])])
    got = e4m3_round(x).to(F64)
    want = round_e4m3_independent(x)
    bad = got != want
    assert not bad.any(), f"{int(bad.sum())} differ, e.g. x={x[bad][:4].tolist()} got {got[bad][:4].tolist()} " \
                          f"want {want[bad][:4].tolist()}"
    assert torch.equal(quantize_e4m3(x).to(F64), want)


def test_saturation_nan_and_signed_zero():
    x = torch.tensor([448.0, 460.0, 464.0, 479.0, 480.0, 500.0, 1e30, float("inf"),
                      -449.0, -1e9, float("-inf"), float("nan"), -0.0, 2.0 ** -11, -2.0 ** -11])
    want = [448.0] * 8 + [-448.0] * 3
    got = e4m3_round(x)
    assert got[:11].tolist() == want
    assert math.isnan(got[11].item())
    assert got[12].item() == 0.0 and math.copysign(1.0, got[12].item()) == -1.0
    assert got[13].item() == 0.0 and got[14].item() == 0.0
    assert quantize_e4m3(x).to(F32)[:11].tolist() == want
    assert torch.isnan(quantize_e4m3(x).to(F32)[11])


def test_quantize_divides_by_the_descale():
    """stored * descale = real: quantize divides (float32), dequantize multiplies."""
    x = torch.tensor([3.0, -0.75, 96.0, 1e4])
    d = 0.25
    x8 = quantize_e4m3(x, d)
    assert x8.dtype == E4M3
    assert x8.to(F32).tolist() == [12.0, -3.0, 384.0, 448.0]  # 1e4 / 0.25 saturates
    assert dequantize_e4m3(x8, d).tolist() == [3.0, -0.75, 96.0, 112.0]
    # The division is float32's, correctly rounded: 1400 / 7 = 200 is the tie of 192 and 208
    # (to even: 192), where a multiplication by fp32(1 / 7) lands above it (208).
    assert quantize_e4m3(torch.tensor([1400.0]), torch.tensor(7.0)).to(F32).item() == 192.0
    assert e4m3_round(torch.tensor([1400.0]) * (1 / torch.tensor(7.0))).item() == 208.0


def test_quantize_per_batch_kv_head():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 8, generator=g)
    d = torch.tensor([[0.5, 0.01, 2.0], [0.125, 1.0, 0.02]])
    x8 = quantize_e4m3(x, d[..., None, None])
    for b in range(2):
        for h in range(3):
            assert torch.equal(x8[b, h].to(F32), quantize_e4m3(x[b, h], float(d[b, h])).to(F32))
    back = dequantize_e4m3(x8, d[..., None, None])
    rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[(x.abs() / d[..., None, None] > 2 ** -6)
                                                        & (x.abs() / d[..., None, None] < 448)]
    assert float(rel.max()) <= 2.0 ** -4  # half a step of 3 mantissa bits, relative


@pytest.mark.parametrize("given,expect", [
    (None, [[1.0, 1.0, 1.0]] * 2),
    (0.5, [[0.5, 0.5, 0.5]] * 2),
    (torch.tensor(0.25), [[0.25] * 3] * 2),
    (torch.tensor([4.0]), [[4.0] * 3] * 2),
    (torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),
])
def test_fp8_descale_forms(given, expect):
    d = fp8_descale(given, 2, 3)
    assert d.dtype == F32 and d.shape == (2, 3) and d.tolist() == expect


@pytest.mark.parametrize("given,exc,words", [
    (torch.ones(2, 6), ValueError, "(2, 3)"),  # per query head: not FlashAttention-3's layout
    (torch.ones(3), ValueError, "per (batch, KV head)"),
    (torch.ones(3, 2), ValueError, "got shape (3, 2)"),
    (torch.ones(2, 3, dtype=F64), TypeError, "float32"),
    (torch.ones(2, 3, dtype=torch.bfloat16), TypeError, "float32"),
    (True, TypeError, "bool"),
    ("1.0", TypeError, "str"),
])
def test_fp8_descale_rejects(given, exc, words):
    with pytest.raises(exc, match=None) as info:
        fp8_descale(given, 2, 3, "k_descale")
    assert words in str(info.value) and "k_descale" in str(info.value)


# ---------------------------------------------------------------------------------------
# The blocked FP8 forward: the 2x rule against float64
# ---------------------------------------------------------------------------------------

# name -> (B, Hq, Hkv, Sq, Sk, options)
CASES = {
    "dense": (2, 2, 2, 67, 150, {}),
    "gqa_causal": (1, 6, 2, 80, 80, {"is_causal": True}),
    "causal_sq_gt_sk": (1, 4, 2, 90, 40, {"is_causal": True}),  # rows that see no key
    "window": (2, 4, 1, 70, 129, {"window_size": (33, 5)}),
    "softcap": (1, 4, 2, 50, 100, {"softcap": 5.0, "scale": 0.3}),
    "decode": (2, 8, 2, 1, 200, {}),
}


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["tensor", "bhkv"])
def test_forward_2x_rule(D, case, kind):
    B, Hq, Hkv, Sq, Sk, opts = CASES[case]
    fp8, ds = make_fp8(B, Hq, Hkv, Sq, Sk, D, kind=kind, seed=D + len(case))
    check_forward(fp8, ds, opts)


@pytest.mark.parametrize("kind", ["one", "saturate"])
@pytest.mark.parametrize("case", ["dense", "gqa_causal", "window"])
def test_forward_saturating_and_unit_descales(kind, case):
    """Descales that clamp the largest inputs to +-448 (the truth is the saturated data) and
    no descales at all (the stored values are the real ones)."""
    B, Hq, Hkv, Sq, Sk, opts = CASES[case]
    fp8, ds = make_fp8(B, Hq, Hkv, Sq, Sk, 64, kind=kind, seed=7, amp=8.0 if kind == "one" else 1.0)
    if kind == "saturate":
        assert all(int((t.to(F32).abs() == E4M3_MAX).sum()) > 10 for t in fp8)
    check_forward(fp8, ds, opts)


@pytest.mark.parametrize("D", [64, 128])
def test_forward_wide_logits(D):
    """Logits spanning hundreds of units (large descales): P of most keys underflows, the
    running max moves a lot between blocks."""
    fp8, ds = make_fp8(2, 4, 2, 70, 300, D, kind="bhkv", seed=3, headroom=6.0)
    check_forward(fp8, ds, {"scale": 1.0}, block_m=32, block_n=48)


@pytest.mark.parametrize("opts", [{"alibi": True, "is_causal": True}, {"sinks": True},
                                  {"sinks": True, "window_size": (10, 0), "softcap": 4.0}])
def test_forward_alibi_and_sinks(opts):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 45, 90, 64
    fp8, ds = make_fp8(B, Hq, Hkv, Sq, Sk, D, kind="bhkv", seed=11)
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = make_alibi_slopes(Hq, batch=B, device="cpu")
    if opts.pop("sinks", False):
        opts["sinks"] = torch.tensor([0.5, 4.0, -3.0, NEG_INF])
    check_forward(fp8, ds, opts)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("blocks", [(16, 16), (64, 128), (128, 32)])
def test_forward_out_dtypes_and_blocks(out_dtype, blocks):
    fp8, ds = make_fp8(1, 4, 2, 77, 133, 64, kind="bhkv", seed=5)
    check_forward(fp8, ds, {"is_causal": True}, *blocks, out_dtype=out_dtype)


def test_forward_max_lag():
    """A lagging max is allowed while P stays <= 448: 8 + 0.8 < log2(448)."""
    fp8, ds = make_fp8(1, 2, 1, 40, 256, 64, kind="bhkv", seed=9, headroom=3.0)
    check_forward(fp8, ds, {"scale": 1.0}, block_n=16, max_lag=0.8)


def test_rule_catches_a_descale_of_the_wrong_head():
    """The tolerance is tight enough to see a kernel that reads q_descale of another
    (batch, KV head): the same data, with the descales' rows swapped, fails the rule."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 60, 90, 64
    (q8, k8, v8), (qd, kd, vd) = make_fp8(B, Hq, Hkv, Sq, Sk, D, kind="bhkv", seed=2)
    qd = qd * torch.tensor([[1.0, 1.5], [0.7, 1.2]])  # distinct rows whatever the data
    wrong_out, _ = attention_fp8_forward_blocked(q8, k8, v8, qd.flip(1), kd, vd)
    nout, _ = attention_fp8_naive(q8, k8, v8, qd, kd, vd)
    rout, _ = attention_naive(dequant64(q8, qd), dequant64(k8, kd), dequant64(v8, vd))
    with pytest.raises(AssertionError, match="err"):
        assert_rule("out", wrong_out, rout, nout)
    # and v_descale left out of the normalization
    out_no_vd, _ = attention_fp8_forward_blocked(q8, k8, v8, qd, kd, None)
    with pytest.raises(AssertionError, match="err"):
        assert_rule("out", out_no_vd, rout, nout)


def test_rows_without_keys_and_sinks():
    fp8, ds = make_fp8(1, 2, 1, 30, 10, 64, kind="tensor", seed=4)
    out, lse = attention_fp8_forward_blocked(*fp8, *ds, is_causal=True)
    assert torch.all(out[:, :, :20] == 0) and torch.all(lse[:, :, :20] == NEG_INF)
    assert torch.isfinite(lse[:, :, 20:]).all()
    sinks = torch.tensor([1.5, NEG_INF])
    out, lse = attention_fp8_forward_blocked(*fp8, *ds, is_causal=True, sinks=sinks)
    assert torch.all(out[:, :, :20] == 0)
    assert torch.all(lse[0, 0, :20] == 1.5) and torch.all(lse[0, 1, :20] == NEG_INF)


def test_lse_is_that_of_the_unrounded_probabilities():
    """l sums the float32 P before its rounding: lse matches float64 to float32 rounding
    even where the output carries the e4m3 error of P."""
    fp8, ds = make_fp8(2, 4, 2, 64, 192, 128, kind="bhkv", seed=6)
    _, lse = attention_fp8_forward_blocked(*fp8, *ds, block_n=32)
    _, rlse = attention_naive(*(dequant64(t, d) for t, d in zip(fp8, ds)))
    assert max_err(lse, rlse) <= 2e-6 * float(rlse.abs().max())


# ---------------------------------------------------------------------------------------
# P is rounded to e4m3, after the 2^8 offset
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 256])
def test_spec_rounds_p(D):
    """With one key block (no rescale between blocks) the spec is the naive FP8 attention
    up to float32 rounding of P (exp vs exp2, which moves a P across an e4m3 tie only
    rarely), and far from the same attention without the rounding of P."""
    fp8, ds = make_fp8(2, 4, 2, 33, 100, D, kind="bhkv", seed=D)
    out, _ = attention_fp8_forward_blocked(*fp8, *ds, block_n=128, out_dtype=F32)
    rounded, _ = attention_fp8_naive(*fp8, *ds, out_dtype=F32)
    unrounded, _ = attention_fp8_naive(*fp8, *ds, out_dtype=F32, round_p=False)
    d_round = (out - rounded).abs()
    d_unround = float((out - unrounded).abs().max())
    mag = float(out.abs().max())
    assert float(d_round.max()) < d_unround / 20, (float(d_round.max()), d_unround)
    assert float((d_round > 1e-5 * mag).float().mean()) < 0.02  # nearly all rows agree
    assert d_unround > 1e-3 * mag


def two_key_problem(x1_nat):
    """q = e_0, k_0 = 0, k_1 = -e_0 with k_descale x1: row logits (0, -x1) (scale 1); V the
    identity (D = 16, rows e_0 and e_1), so out[0:2] = (P_0, P_1) / l exactly as rounded."""
    D = 16
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 2, D)
    k[0, 0, 1, 0] = -1.0
    v = torch.zeros(1, 1, 2, D)
    v[0, 0, 0, 0] = 1.0
    v[0, 0, 1, 1] = 1.0
    kd = torch.tensor([[float(x1_nat)]])
    return tuple(quantize_e4m3(t) for t in (q, k, v)), (None, kd, None)


def test_p_rounded_exactly():
    """P_1 = 256 * exp(-x) = 200.3 rounds to 208 (e4m3 steps of 16 in [128, 256]); P_0 =
    256; l = 256 + 200.3 (unrounded): out = (256, 208) / 456.3, not (256, 200.3) / 456.3."""
    x = math.log(256 / 200.3)
    fp8, ds = two_key_problem(x)
    out, lse = attention_fp8_forward_blocked(*fp8, *ds, scale=1.0, out_dtype=F32)
    p1 = 256 * math.exp(-x)
    assert abs(out[0, 0, 0, 0].item() - 256 / (256 + p1)) < 1e-6
    assert abs(out[0, 0, 0, 1].item() - 208 / (256 + p1)) < 1e-6
    assert abs(out[0, 0, 0, 1].item() - p1 / (256 + p1)) > 1e-2
    assert abs(lse.item() - math.log(1 + math.exp(-x))) < 1e-6


def test_p_offset_keeps_small_probabilities():
    """A key 10 below the max (natural log): P = 2^8 e^-10 = 0.0116 survives e4m3 (as
    0.01171875), where P in [0, 1] (p_offset 0) would be e^-10 = 4.5e-5 < 2^-10: zero."""
    fp8, ds = two_key_problem(10.0)
    out, _ = attention_fp8_forward_blocked(*fp8, *ds, scale=1.0, out_dtype=F32)
    assert abs(out[0, 0, 0, 1].item() - 0.01171875 / (256 + 256 * math.exp(-10))) < 1e-8
    flushed, _ = attention_fp8_forward_blocked(*fp8, *ds, scale=1.0, out_dtype=F32, p_offset=0.0)
    assert flushed[0, 0, 0, 1].item() == 0.0


# ---------------------------------------------------------------------------------------
# Packed batches
# ---------------------------------------------------------------------------------------


def make_varlen_fp8(lens_q, lens_k, Hq, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q), sum(lens_k)
    B = len(lens_q)
    q, k, v = (torch.randn(n, h, D, generator=g) for n, h in ((tq, Hq), (tk, Hkv), (tk, Hkv)))
    ds = tuple((torch.rand(B, Hkv, generator=g) + 0.5) * s for s in (3.0 / 448, 3.0 / 448, 2.0 / 448))
    cu_q, cu_k = cu_seqlens_from_lengths(lens_q, "cpu"), cu_seqlens_from_lengths(lens_k, "cpu")
    packed = []
    for t, d, cu in zip((q, k, v), ds, (cu_q, cu_k, cu_k)):
        rows = torch.repeat_interleave(torch.arange(B), torch.diff(cu).long())  # sequence of each row
        packed.append(quantize_e4m3(t, heads_view(d, t.shape[1])[rows, :, :, 0]))
    return tuple(packed), ds, cu_q, cu_k


@pytest.mark.parametrize("opts", [{}, {"is_causal": True}, {"window_size": (7, 2), "softcap": 3.0}])
def test_varlen_is_dense_per_sequence(opts):
    lens_q, lens_k = [5, 0, 40, 17], [9, 3, 40, 70]
    (q8, k8, v8), ds, cu_q, cu_k = make_varlen_fp8(lens_q, lens_k, 4, 2, 64, seed=1)
    out, lse = attention_fp8_varlen_forward_blocked(q8, k8, v8, cu_q, cu_k, *ds, block_n=32, **opts)
    nout, nlse = attention_fp8_varlen_naive(q8, k8, v8, cu_q, cu_k, *ds, **opts)
    assert out.shape == q8.shape and out.dtype == torch.bfloat16 and lse.shape == (4, sum(lens_q))
    routs, rlses = [], []
    for b in range(len(lens_q)):
        qa, qb, ka, kb = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        dense = [t[a:e].transpose(0, 1).unsqueeze(0) for t, a, e in ((q8, qa, qb), (k8, ka, kb), (v8, ka, kb))]
        dsb = [d[b:b + 1] for d in ds]
        o, l = attention_fp8_forward_blocked(*dense, *dsb, block_n=32, **opts)
        assert torch.equal(out[qa:qb], o[0].transpose(0, 1)) and torch.equal(lse[:, qa:qb], l[0])
        ro, rl = attention_naive(*(dequant64(t, d) for t, d in zip(dense, dsb)), **opts)
        routs.append(ro[0].transpose(0, 1))
        rlses.append(rl[0])
    assert_rule("varlen out", out, torch.cat(routs), nout)
    assert_rule("varlen lse", lse, torch.cat(rlses, dim=1), nlse, atol_rel=2.0 ** -18)


def test_varlen_descale_rows_follow_sequences():
    """Sequence b reads row b of (B, Hkv) descales: reversing the rows changes exactly the
    sequences whose rows differ."""
    lens = [20, 20]
    (q8, k8, v8), (qd, kd, vd), cu_q, cu_k = make_varlen_fp8(lens, lens, 2, 2, 64, seed=2)
    vd = torch.stack([vd[0], vd[0] * 2])  # sequence 1's v_descale doubled
    out, _ = attention_fp8_varlen_forward_blocked(q8, k8, v8, cu_q, cu_k, qd, kd, vd, out_dtype=F32)
    base, _ = attention_fp8_varlen_forward_blocked(q8, k8, v8, cu_q, cu_k, qd, kd, vd[:1].expand(2, 2),
                                                   out_dtype=F32)
    assert torch.equal(out[:20], base[:20])
    assert torch.equal(out[20:], base[20:] * 2)  # a power of two: exact


# ---------------------------------------------------------------------------------------
# The FP8 KV cache
# ---------------------------------------------------------------------------------------


def kv_problem(B=3, Hq=4, Hkv=2, Sq=1, D=64, capacity=96, cached=(0, 17, 40), S_new=3, seed=0,
               dtype=torch.bfloat16, pow2=False, page_size=None):
    """q (dtype), e4m3 caches filled to ``cached`` (rows past them NaN-free garbage of max
    magnitude, never read), new k / v (dtype), (B, Hkv) descales (powers of two with
    ``pow2``). With ``page_size`` the caches are a shuffled paged pool with a block table."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(dtype)
    kd = (2.0 ** torch.randint(-6, -2, (B, Hkv), generator=g)).float() if pow2 else \
        torch.rand(B, Hkv, generator=g) * 0.02 + 0.005
    vd = (2.0 ** torch.randint(-6, -2, (B, Hkv), generator=g)).float() if pow2 else \
        torch.rand(B, Hkv, generator=g) * 0.02 + 0.005
    k_cache = quantize_e4m3(torch.randn(B, Hkv, capacity, D, generator=g), kd[..., None, None] / 2)
    v_cache = quantize_e4m3(torch.randn(B, Hkv, capacity, D, generator=g), vd[..., None, None] / 2)
    for b, c in enumerate(cached):  # rows past the length: the largest values, which must not leak
        k_cache[b, :, c:] = quantize_e4m3(torch.full((Hkv, capacity - c, D), 1e6))
        v_cache[b, :, c:] = quantize_e4m3(torch.full((Hkv, capacity - c, D), -1e6))
    k = torch.randn(B, Hkv, S_new, D, generator=g).to(dtype) if S_new else None
    v = torch.randn(B, Hkv, S_new, D, generator=g).to(dtype) if S_new else None
    cs = torch.tensor(cached, dtype=torch.int32)
    table = None
    if page_size is not None:
        pages = capacity // page_size
        perm = torch.randperm(B * pages, generator=g)
        table = perm.view(B, pages).to(torch.int32)
        pool_k = torch.empty(B * pages, Hkv, page_size, D, dtype=E4M3)
        pool_v = torch.empty_like(pool_k)
        for b in range(B):
            for p in range(pages):
                pool_k[table[b, p]] = k_cache[b, :, p * page_size:(p + 1) * page_size]
                pool_v[table[b, p]] = v_cache[b, :, p * page_size:(p + 1) * page_size]
        k_cache, v_cache = pool_k, pool_v
    return q, k_cache, v_cache, k, v, cs, table, kd, vd


def logical_rows(cache, table, b, n):
    """Sequence b's first n cache rows, (Hkv, n, D), dense or through the block table."""
    if table is None:
        return cache[b, :, :n]
    ps = cache.shape[2]
    return torch.cat([cache[int(table[b, p])] for p in range(-(-n // ps))], dim=1)[:, :n]


@pytest.mark.parametrize("page_size", [None, 16])
def test_kvcache_append_quantizes_in_place(page_size):
    q, kc, vc, k, v, cs, table, kd, vd = kv_problem(S_new=5, page_size=page_size)
    kc0, vc0 = kc.clone(), vc.clone()
    attention_with_kvcache_fp8_reference(q, kc, vc, k, v, k_descale=kd, v_descale=vd, cache_seqlens=cs,
                                         block_table=table)
    changed = torch.zeros(kc.shape, dtype=torch.bool)
    for b, c in enumerate(cs.tolist()):
        for cache, cache0, new, d in ((kc, kc0, k, kd), (vc, vc0, v, vd)):
            rows = logical_rows(cache, table, b, c + 5)[:, c:]
            want = quantize_e4m3(new[b].float() / d[b][:, None, None])
            assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))
        for p in range(c, c + 5):  # mark the appended slots
            if table is None:
                changed[b, :, p] = True
            else:
                changed[int(table[b, p // 16]), :, p % 16] = True
    for cache, cache0 in ((kc, kc0), (vc, vc0)):
        assert torch.equal(cache.view(torch.uint8)[~changed], cache0.view(torch.uint8)[~changed])


def test_kvcache_append_saturates():
    q, kc, vc, k, v, cs, table, kd, vd = kv_problem(S_new=2)
    k = k * 0 + 100.0  # 100 / k_descale (< 0.025) > 448
    attention_with_kvcache_fp8_reference(q, kc, vc, k, v, k_descale=kd, v_descale=vd, cache_seqlens=cs)
    for b, c in enumerate(cs.tolist()):
        assert torch.all(kc[b, :, c:c + 2].to(F32) == E4M3_MAX)


@pytest.mark.parametrize("page_size", [None, 16, 32])
@pytest.mark.parametrize("opts", [{}, {"is_causal": True, "num_splits": 3},
                                  {"window_size": (20, 0), "softcap": 5.0, "num_splits": 2},
                                  {"sinks": True, "num_splits": 4}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kvcache_pow2_descales_equal_16bit_spec(page_size, opts, dtype):
    """Power-of-two descales make every descale product exact: the FP8 KV cache spec then
    equals, bit for bit, the 16-bit KV-cache spec over the dequantized cache (which e4m3
    values times 2^e are, exactly, in float16 / bfloat16): the same scores, P rounded to the
    queries' dtype, the same splits and combine. The appended rows are compared after
    quantization (the 16-bit spec gets the dequantized rows as its cache)."""
    opts = dict(opts)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.tensor([0.5, -1.0, 3.0, NEG_INF])
    q, kc, vc, k, v, cs, table, kd, vd = kv_problem(Sq=3, pow2=True, dtype=dtype, page_size=page_size)
    out, lse = attention_with_kvcache_fp8_reference(q, kc, vc, k, v, k_descale=kd, v_descale=vd,
                                                    cache_seqlens=cs, block_table=table, return_lse=True,
                                                    block_n=16, **opts)
    # kc, vc now hold the appended rows; the 16-bit spec attends to their real values.
    if table is None:
        dk = (kc.to(F32) * kd[..., None, None]).to(dtype)
        dv = (vc.to(F32) * vd[..., None, None]).to(dtype)
    else:  # each page takes the descales of the sequence that owns it
        owner = torch.empty(kc.shape[0], dtype=torch.long)
        for b in range(table.shape[0]):
            owner[table[b].long()] = b
        dk = (kc.to(F32) * kd[owner][..., None, None]).to(dtype)
        dv = (vc.to(F32) * vd[owner][..., None, None]).to(dtype)
    cs_total = cs + 3
    out16, lse16 = attention_with_kvcache_reference(q, dk, dv, cache_seqlens=cs_total, block_table=table,
                                                    return_lse=True, block_n=16, **opts)
    assert torch.equal(out, out16)
    assert torch.equal(lse, lse16)


@pytest.mark.parametrize("opts", [{}, {"is_causal": True, "num_splits": 3}, {"softcap": 4.0}])
def test_kvcache_2x_rule(opts):
    """Against float64 attention on the real values (the cache dequantized after the
    append), next to the naive attention in bfloat16 on the real values rounded to
    bfloat16 (the 16-bit rule of the KV-cache kernels)."""
    B, Hq, Hkv, Sq, D = 3, 4, 2, 4, 128
    q, kc, vc, k, v, cs, table, kd, vd = kv_problem(B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, D=D, seed=5)
    out, lse = attention_with_kvcache_fp8_reference(q, kc, vc, k, v, k_descale=kd, v_descale=vd,
                                                    cache_seqlens=cs, return_lse=True, **opts)
    opts.pop("num_splits", None)
    for b, c in enumerate(cs.tolist()):
        L = c + 3
        kr = kc[b:b + 1, :, :L].to(F64) * kd[b][:, None, None].to(F64)
        vr = vc[b:b + 1, :, :L].to(F64) * vd[b][:, None, None].to(F64)
        ro, rl = attention_naive(q[b:b + 1].to(F64), kr, vr, **opts)
        no, nl = attention_naive(q[b:b + 1], kr.to(q.dtype), vr.to(q.dtype), **opts)
        assert_rule(f"kv out {b}", out[b:b + 1], ro, no)
        assert_rule(f"kv lse {b}", lse[b:b + 1], rl, nl.to(F32))


@pytest.mark.parametrize("page_size", [16, 48])
def test_kvcache_paged_equals_dense(page_size):
    args = dict(Sq=2, S_new=4, seed=3)
    qd_, kcd, vcd, k, v, cs, _, kd, vd = kv_problem(**args)
    qp, kcp, vcp, _, _, _, table, _, _ = kv_problem(**args, page_size=page_size)
    od = attention_with_kvcache_fp8_reference(qd_, kcd, vcd, k, v, k_descale=kd, v_descale=vd,
                                              cache_seqlens=cs, num_splits=2, is_causal=True)
    op = attention_with_kvcache_fp8_reference(qp, kcp, vcp, k, v, k_descale=kd, v_descale=vd,
                                              cache_seqlens=cs, block_table=table, num_splits=2,
                                              is_causal=True)
    assert torch.equal(od, op)


def test_kvcache_per_tensor_descales_equal_expanded():
    q, kc, vc, k, v, cs, _, _, _ = kv_problem(seed=8)
    kc2, vc2 = kc.clone(), vc.clone()
    a = attention_with_kvcache_fp8_reference(q, kc, vc, k, v, k_descale=0.01, v_descale=torch.tensor(0.02),
                                             cache_seqlens=cs)
    b = attention_with_kvcache_fp8_reference(q, kc2, vc2, k, v, k_descale=torch.full((3, 2), 0.01),
                                             v_descale=torch.full((3, 2), 0.02), cache_seqlens=cs)
    assert torch.equal(a, b) and torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))


# ---------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------


def _fp8_qkv():
    (q8, k8, v8), ds = make_fp8(1, 2, 1, 8, 8, 16, kind="tensor")
    return q8, k8, v8


@pytest.mark.parametrize("fn", [attention_fp8_forward_blocked, attention_fp8_naive])
def test_forward_rejects_mixed_and_e5m2(fn):
    q8, k8, v8 = _fp8_qkv()
    with pytest.raises(TypeError, match="mixed FP8 and non-FP8"):
        fn(q8, k8.to(F32).to(torch.bfloat16), v8)
    with pytest.raises(TypeError, match="no FP8 input"):
        fn(*(t.to(torch.bfloat16) for t in (q8, k8, v8)))
    with pytest.raises(TypeError, match="e5m2"):
        fn(q8, k8, v8.to(F32).to(torch.float8_e5m2))
    with pytest.raises(TypeError, match="only the e4m3"):
        fn(*(t.to(F32).to(torch.float8_e5m2) for t in (q8, k8, v8)))


@pytest.mark.parametrize("fn", [attention_fp8_forward_blocked, attention_fp8_naive])
def test_forward_rejects_bad_descales_and_options(fn):
    q8, k8, v8 = _fp8_qkv()  # B = 1, Hq = 2, Hkv = 1
    with pytest.raises(ValueError, match="q_descale.*per \\(batch, KV head\\) of shape \\(1, 1\\)"):
        fn(q8, k8, v8, torch.ones(1, 2))  # per query head
    with pytest.raises(ValueError, match="v_descale"):
        fn(q8, k8, v8, None, None, torch.ones(2, 1))
    with pytest.raises(TypeError, match="k_descale must be float32"):
        fn(q8, k8, v8, None, torch.ones(1, 1, dtype=F64))
    with pytest.raises(TypeError, match="out_dtype"):
        fn(q8, k8, v8, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="p_offset"):
        fn(q8, k8, v8, p_offset=9.0)
    if fn is attention_fp8_forward_blocked:
        with pytest.raises(ValueError, match="max_lag"):
            fn(q8, k8, v8, max_lag=1.0)  # 8 + 1 > log2(448): P could saturate


def test_varlen_rejects():
    q8, k8, v8 = (t[0].transpose(0, 1) for t in _fp8_qkv())  # (8, H, 16)
    cu = cu_seqlens_from_lengths([3, 5], "cpu")
    with pytest.raises(TypeError, match="mixed"):
        attention_fp8_varlen_forward_blocked(q8.to(torch.bfloat16), k8, v8, cu, cu)
    with pytest.raises(ValueError, match="shape \\(2, 1\\)"):
        attention_fp8_varlen_forward_blocked(q8, k8, v8, cu, cu, torch.ones(3, 1))
    with pytest.raises(TypeError, match="e5m2"):
        attention_fp8_varlen_naive(q8, k8.to(F32).to(torch.float8_e5m2), v8, cu, cu)


def test_kvcache_rejects():
    q, kc, vc, k, v, cs, _, kd, vd = kv_problem()
    call = attention_with_kvcache_fp8_reference
    with pytest.raises(TypeError, match="e5m2"):
        call(q, kc.to(F32).to(torch.float8_e5m2), vc, cache_seqlens=cs)
    with pytest.raises(TypeError, match="mixed FP8 and non-FP8"):
        call(q, kc, vc.to(F32).to(torch.bfloat16), cache_seqlens=cs)
    with pytest.raises(TypeError, match="FP8 queries over an FP8 cache"):
        call(quantize_e4m3(q), kc, vc, cache_seqlens=cs)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16"):
        call(q.float(), kc, vc, cache_seqlens=cs)
    with pytest.raises(TypeError, match="new k / v must have q's dtype"):
        call(q, kc, vc, k.half(), v.half(), cache_seqlens=cs)
    with pytest.raises(ValueError, match="k_descale.*\\(3, 2\\)"):
        call(q, kc, vc, k, v, k_descale=torch.ones(3, 4), cache_seqlens=cs)
    with pytest.raises(TypeError, match="v_descale must be float32"):
        call(q, kc, vc, v_descale=torch.ones(3, 2, dtype=torch.bfloat16), cache_seqlens=cs)


def test_spec_names_are_exported():
    for name in ("attention_fp8_forward_blocked", "attention_fp8_naive", "attention_fp8_varlen_naive",
                 "attention_fp8_varlen_forward_blocked", "attention_with_kvcache_fp8_reference",
                 "quantize_e4m3", "dequantize_e4m3", "e4m3_round", "fp8_descale", "E4M3_MAX",
                 "FP8_P_OFFSET"):
        assert name in R.__all__
    import flash_cuda
    from flash_cuda.fp8 import attention_fp8
    # The FP8 forward is top-level API (its kernel passes tests/test_fp8_forward_gpu.py on Hopper).
    from flash_cuda.fp8 import varlen_attention_fp8
    assert "attention_fp8" in flash_cuda.__all__ and flash_cuda.attention_fp8 is attention_fp8
    assert "varlen_attention_fp8" in flash_cuda.__all__ and flash_cuda.varlen_attention_fp8 is varlen_attention_fp8


@pytest.mark.parametrize("opts", [{}, {"is_causal": True, "window_size": (30, 0)}, {"softcap": 4.0}])
def test_kvcache_one_split_is_16bit_blocked_forward(opts):
    """num_splits = 1 with power-of-two descales is the 16-bit blocked forward on each
    sequence's real keys and values, bit for bit: P rounded to the queries' dtype (not to
    e4m3), no offset."""
    q, kc, vc, k, v, cs, _, kd, vd = kv_problem(Sq=5, pow2=True, seed=12)
    out, lse = attention_with_kvcache_fp8_reference(q, kc, vc, k, v, k_descale=kd, v_descale=vd,
                                                    cache_seqlens=cs, return_lse=True, block_n=32, **opts)
    for b, c in enumerate(cs.tolist()):
        L = c + 3
        kr = (kc[b:b + 1, :, :L].to(F32) * kd[b][:, None, None]).to(q.dtype)
        vr = (vc[b:b + 1, :, :L].to(F32) * vd[b][:, None, None]).to(q.dtype)
        o, l = R.attention_forward_blocked(q[b:b + 1], kr, vr, block_n=32, **opts)
        assert torch.equal(out[b:b + 1], o) and torch.equal(lse[b:b + 1], l)
