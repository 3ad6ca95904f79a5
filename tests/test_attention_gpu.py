"""flash_cuda.attention on the GPU against the float64 reference (skipped without a GPU).

The main grid is the full product dtype x head dim x causal; for each of those 48
combinations ten cases draw the other axes (sequence lengths, GQA ratio, layout, scale)
from balanced, independently shuffled lists, so every value of every axis appears many
times without running the full product. Every case checks out, lse, dq, dk, dv with the
rule of attn_check (and a random dlse on about a third of them).
"""

from __future__ import annotations

import math
import random

import os

import pytest
import torch

import flash_cuda
from flash_cuda.reference import attention_naive

from attn_check import (ATOL_BASE, LSE_ATOL_BASE, assert_ws_forward, check_attention, climb_scores, dtype_name,
                        hopper_skip_reason, make_inputs, naive_chunked, profiled, rule_error)

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPES = (F16, BF16, F32)
HEAD_DIMS = (8, 40, 64, 72, 96, 128, 160, 256)
SEQ_PAIRS = ((1, 1), (1, 17), (17, 1), (17, 17), (113, 127), (127, 113), (128, 128), (113, 113),
             (1, 1000), (1000, 1), (127, 1000), (1000, 128), (1000, 1000), (17, 2048),
             (2048, 113), (128, 2048), (2048, 2048))
GQA_RATIOS = (1, 2, 8)
LAYOUTS = ("bhsd", "bshd", "strided", "offset")
SCALES = (None, 0.1, 1.0)
CASES_PER_COMBO = 10


def _balanced(values, n, rng):
    out = [values[i % len(values)] for i in range(n)]
    rng.shuffle(out)
    return out


def _grid():
    combos = [(dt, d, c) for dt in DTYPES for d in HEAD_DIMS for c in (False, True)]
    n = len(combos) * CASES_PER_COMBO
    rng = random.Random(20240611)
    seqs = _balanced(SEQ_PAIRS, n, rng)
    gqas = _balanced(GQA_RATIOS, n, rng)
    layouts = _balanced(LAYOUTS, n, rng)
    scales = _balanced(SCALES, n, rng)
    cases = []
    for i in range(n):
        dt, d, causal = combos[i // CASES_PER_COMBO]
        sq, sk = seqs[i]
        big = max(sq, sk) >= 1000
        B, hkv = (1, 1) if big else (2, 2)
        case = (dt, d, causal, B, hkv * gqas[i], hkv, sq, sk, layouts[i], scales[i], i)
        cid = (f"{i:03d}-{dtype_name(dt)}-d{d}-{'causal' if causal else 'full'}-{sq}x{sk}-g{gqas[i]}-"
               f"{layouts[i]}-s{scales[i]}")
        cases.append(pytest.param(*case, id=cid))
    return cases


@pytest.mark.parametrize("dtype,D,is_causal,B,Hq,Hkv,Sq,Sk,layout,scale,seed", _grid())
def test_grid(dtype, D, is_causal, B, Hq, Hkv, Sq, Sk, layout, scale, seed):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=seed)
    check_attention(q, k, v, is_causal=is_causal, scale=scale, label=f"grid#{seed} {layout}",
                    seed=seed)


# ---------------------------------------------------------------------------------------
# Kernel choice
# ---------------------------------------------------------------------------------------


def _is_sm90() -> bool:
    # FLASH_CUDA_EMULATE_ARCH makes the dispatcher treat the GPU as that class (no Hopper tier).
    emulated = int(os.environ.get("FLASH_CUDA_EMULATE_ARCH", "0") or 0)
    if emulated > 0:
        return emulated == 90
    return torch.cuda.get_device_capability() == (9, 0)


def _wgmma_applies(dtype, D) -> bool:
    """Where kernel='auto' picks the Hopper tier (and kernel='wgmma' is accepted)."""
    return dtype != F32 and _is_sm90() and 32 < D <= 128


def _ws_forward_only(dtype, D) -> bool:
    """Where kernel='auto' runs the warp-specialized Hopper forward, which no kernel name selects
    (a call without score modifiers at D <= 32)."""
    return dtype != F32 and _is_sm90() and (D <= 32 or 128 < D <= 256)


def _auto_kernel(dtype, D) -> str:
    return "simt" if dtype == F32 else ("wgmma" if _wgmma_applies(dtype, D) else "mma")


@pytest.mark.parametrize("dtype,kernel", [(F32, "simt"), (F16, "mma"), (BF16, "mma"), (F16, "wgmma"),
                                          (BF16, "wgmma")])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_explicit_kernel(dtype, kernel, D, is_causal):
    if kernel == "wgmma" and not _wgmma_applies(dtype, D):
        pytest.skip("the wgmma tier serves sm_90 GPUs and head dims 33..128 "
                    "(test_wgmma_rejected_where_it_does_not_apply covers the error)")
    for shape in ((2, 4, 2, 77, 150), (1, 3, 1, 300, 257)):
        q, k, v = make_inputs(*shape, D, dtype, "cuda", layout="bshd", seed=D)
        check_attention(q, k, v, is_causal=is_causal, scale=None, kernel=kernel, label=kernel)
    out_auto = flash_cuda.attention(q, k, v, is_causal=is_causal)
    if _ws_forward_only(dtype, D):
        # No kernel name selects the warp-specialized forward above d = 128 or below 33
        # (kernel='wgmma' is the tier of head dims 33..128): the profiler tells what auto ran.
        out_profiled, names = profiled(lambda: flash_cuda.attention(q, k, v, is_causal=is_causal))
        assert_ws_forward(names, f"kernel='auto' at D={D} dtype={dtype_name(dtype)}")
        assert torch.equal(out_auto, out_profiled), "kernel='auto' must give the same bits call after call"
        return
    out_explicit = flash_cuda.attention(q, k, v, is_causal=is_causal, kernel=_auto_kernel(dtype, D))
    assert torch.equal(out_auto, out_explicit), f"kernel='auto' must pick {_auto_kernel(dtype, D)!r}"


# The tensor-core forwards keep a lagging running max (2^8, update_row_stats): scores that climb
# slowly (P up to 2^8 against a stale max), steeply (rescaled every block) or fall along the
# keys, on each 16-bit tier, forward and backward against float64.
@pytest.mark.parametrize("rise", [3.0, 20.0, -4.0])
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
@pytest.mark.parametrize("D,is_causal", [(64, True), (128, False), (256, False)])
def test_lagging_running_max(kernel, D, is_causal, rise):
    if kernel == "wgmma" and not _wgmma_applies(BF16, D):
        pytest.skip("the wgmma tier serves sm_90 GPUs and head dims 33..128")
    dtype = F16 if rise > 0 else BF16
    q, k, v = make_inputs(1, 2, 1, 300, 1100, D, dtype, "cuda", layout="bshd", seed=D + int(rise))
    q, k = climb_scores(q, k, rise, 1.0 / math.sqrt(D))
    check_attention(q, k, v, is_causal=is_causal, scale=None, kernel=kernel, label=f"{kernel} rise={rise}")


@pytest.mark.parametrize("D", [32, 96, 256, 64])
def test_wgmma_rejected_where_it_does_not_apply(D):
    q, k, v = make_inputs(1, 2, 2, 64, 64, D, BF16, "cuda", seed=3)
    if _wgmma_applies(BF16, D):
        pytest.skip("the wgmma tier applies here (covered by test_explicit_kernel)")
    with pytest.raises(RuntimeError, match="kernel='wgmma' needs an sm_90 GPU"):
        flash_cuda.attention(q, k, v, kernel="wgmma")


# ---------------------------------------------------------------------------------------
# API behaviour
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,Sq,Sk", [(0, 16, 16), (2, 0, 16), (2, 16, 0), (0, 0, 0)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_sizes(dtype, B, Sq, Sk, is_causal):
    q, k, v = make_inputs(B, 4, 2, Sq, Sk, 64, dtype, "cuda", seed=1)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    out, lse = flash_cuda.attention(q, k, v, is_causal=is_causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    assert lse.shape == (B, 4, Sq) and lse.dtype == F32
    assert (out == 0).all()
    assert (lse == -math.inf).all()  # no key at all (or no rows)
    (out.float().sum() + lse.clamp(min=0).sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()


def test_return_lse_flag():
    q, k, v = make_inputs(1, 2, 2, 33, 33, 64, F16, "cuda")
    out = flash_cuda.attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    out2, lse = flash_cuda.attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 33) and lse.dtype == F32
    assert lse.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_strides_follow_q(dtype):
    q, k, v = make_inputs(2, 4, 2, 40, 50, 64, dtype, "cuda", layout="bshd")
    out = flash_cuda.attention(q, k, v)
    assert out.stride() == q.stride()  # dense q: out has q's layout (empty_like semantics)
    q2, k2, v2 = make_inputs(2, 4, 2, 40, 50, 64, dtype, "cuda", layout="strided")
    out2 = flash_cuda.attention(q2, k2, v2)
    # not dense: empty_like's dense layout in q's dimension order (what the fake op says)
    assert out2.stride() == torch.empty_like(q2).stride()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("Sq,Sk", [(100, 100), (100, 37), (37, 100)])
def test_dlse_gradient_path(dtype, is_causal, Sq, Sk):
    """(out.sum() + lse.sum()).backward(): expanded (stride-0) dout and dlse."""
    q, k, v = make_inputs(2, 4, 2, Sq, Sk, 64, dtype, "cuda", seed=Sq + Sk)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_cuda.attention(qf, kf, vf, is_causal=is_causal, return_lse=True)
    (out.sum() + lse.sum()).backward()  # lse.sum() is -inf with masked rows; its grad is fine
    grads = {}
    for name, rdtype in (("ref64", torch.float64), ("naive", dtype)):
        qr, kr, vr = (t.detach().to(rdtype).requires_grad_() for t in (q, k, v))
        o_r, l_r = attention_naive(qr, kr, vr, is_causal=is_causal)
        (o_r.sum() + l_r.sum()).backward()
        grads[name] = (qr.grad, kr.grad, vr.grad)
    problems = []
    for i, (name, g) in enumerate(zip(("dq", "dk", "dv"), (qf.grad, kf.grad, vf.grad))):
        _, problem = rule_error(name, g, grads["ref64"][i], grads["naive"][i], ATOL_BASE[dtype])
        if problem:
            problems.append(problem)
    assert not problems, f"dlse path {dtype_name(dtype)} causal={is_causal} {Sq}x{Sk}: {problems}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_with_noncontiguous_dout(dtype):
    """dout whose last dim is not contiguous is made contiguous before the kernel."""
    q, k, v = make_inputs(1, 2, 1, 64, 80, 32, dtype, "cuda", seed=5)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.attention(qf, kf, vf, is_causal=True)
    w = torch.randn(1, 2, 32, 64, device="cuda", dtype=dtype).transpose(-1, -2)  # stride(-1) = 64
    grads = torch.autograd.grad(out, (qf, kf, vf), w)
    ref = torch.autograd.grad(flash_cuda.attention(qf, kf, vf, is_causal=True), (qf, kf, vf),
                              w.contiguous())
    for a, b in zip(grads, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_partial_requires_grad(which):
    q, k, v = make_inputs(2, 4, 2, 50, 60, 64, BF16, "cuda", seed=9)
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].detach().requires_grad_()
    out = flash_cuda.attention(args["q"], args["k"], args["v"], is_causal=True)
    dout = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, args[which], dout)
    full = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(flash_cuda.attention(*full, is_causal=True), full, dout)
    assert torch.equal(g, ref["qkv".index(which)])


def test_no_grad_and_inference_mode():
    q, k, v = make_inputs(1, 2, 2, 40, 40, 64, F16, "cuda")
    q.requires_grad_()
    ref = flash_cuda.attention(q, k, v).detach()
    with torch.no_grad():
        out = flash_cuda.attention(q, k, v)
    assert not out.requires_grad and torch.equal(out, ref)
    with torch.inference_mode():
        out = flash_cuda.attention(q.detach(), k, v)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_bitwise_reproducible(dtype, deterministic):
    q, k, v = make_inputs(2, 8, 2, 300, 333, 64, dtype, "cuda", seed=3)
    dout = torch.randn(q.shape, device="cuda").to(dtype)
    runs = []
    for _ in range(3):
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        out, lse = flash_cuda.attention(qf, kf, vf, is_causal=True, return_lse=True,
                                        deterministic=deterministic)
        runs.append((out, lse) + torch.autograd.grad(out, (qf, kf, vf), dout))
    # deterministic=False adds dQ across key blocks in a varying order where a kernel does so:
    # the fp32 backward, and the Hopper backward of fp16 / bf16 (one pass, dQ into an fp32
    # workspace); dQ then matches to rounding, everything else bitwise.
    atomic_dq = not deterministic and (dtype == F32 or hopper_skip_reason("") is None)
    for r in runs[1:]:
        for i, (a, b) in enumerate(zip(runs[0], r)):
            if i == 2 and atomic_dq:  # fp32 sums that differ in the last bits, then rounded once
                ulp = {F32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
                torch.testing.assert_close(a, b, rtol=2 * ulp, atol=1e-5)
            else:
                assert torch.equal(a, b)


@pytest.mark.parametrize("D,Sq,Sk,layout", [(128, 300, 1000, "bhsd"), (104, 1000, 777, "bshd"),
                                            (120, 129, 4097, "strided")])
def test_fp32_split_last_wave(D, Sq, Sk, layout):
    """The fp32 forward for D 97-128 cuts the query blocks of its last, partial wave into key
    ranges and merges them (on GPUs with 192 KiB of shared memory per block). Here the grid
    has one and a half waves of 128-row query blocks, so the split runs; out, lse and the
    gradients must match float64, and repeated runs must agree bit for bit."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    m_blocks = -(-Sq // 128)
    Hq = -(-(3 * sms // 2 + 3) // m_blocks)  # 1.5 waves (+3 blocks), one CTA per SM
    q, k, v = make_inputs(1, Hq, 1, Sq, Sk, D, F32, "cuda", layout=layout, seed=Sq)
    check_attention(q, k, v, is_causal=False, scale=None, label=f"split d{D} {Sq}x{Sk} Hq={Hq}",
                    seed=Sq)
    with torch.inference_mode():
        first = flash_cuda.attention(q, k, v, return_lse=True)
        again = flash_cuda.attention(q, k, v, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("D,Hkv,group,Sq,Sk", [(128, 1, 4, 300, 1000), (64, 2, 1, 1000, 777),
                                               (32, 1, 2, 129, 4097)])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "deterministic"])
def test_fp32_backward_split_last_wave(D, Hkv, group, Sq, Sk, deterministic):
    """The fp32 dK/dV kernel cuts the key blocks of its last, partial wave into ranges of query
    steps (with GQA, steps run over the group's heads too) and sums the partial dK / dV after.
    Here the grid is a few key blocks more than one CTA per SM, so the split runs; the
    gradients must match float64, and with deterministic=True repeated runs must agree bit
    for bit."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_blocks = -(-Sk // 64)
    B = -(-(sms + 5) // (n_blocks * Hkv))  # just over one wave of 64-key blocks
    q, k, v = make_inputs(B, Hkv * group, Hkv, Sq, Sk, D, F32, "cuda", seed=Sk + D)
    check_attention(q, k, v, is_causal=False, scale=None, deterministic=deterministic,
                    label=f"bwd split d{D} {Sq}x{Sk} B={B} Hkv={Hkv} group={group}", seed=Sk)
    if deterministic:
        grads = []
        for _ in range(2):
            qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
            out = flash_cuda.attention(qq, kk, vv, deterministic=True)
            out.backward(torch.ones_like(out))
            grads.append((qq.grad, kk.grad, vv.grad))
        assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [2, 4, 8])
def test_gqa_equals_repeated_kv(dtype, groups):
    """GQA indexing: the same as multi-head attention with k/v heads repeated."""
    q, k, v = make_inputs(2, 2 * groups, 2, 90, 120, 64, dtype, "cuda", seed=groups)
    kr, vr = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
    qb, kb, vb = (t.detach().requires_grad_() for t in (q, kr, vr))
    out_a, lse_a = flash_cuda.attention(qa, ka, va, is_causal=True, return_lse=True)
    out_b, lse_b = flash_cuda.attention(qb, kb, vb, is_causal=True, return_lse=True)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    dout = torch.randn_like(out_a)
    ga = torch.autograd.grad(out_a, (qa, ka, va), dout)
    gb = torch.autograd.grad(out_b, (qb, kb, vb), dout)
    tol = {F32: 1e-5, F16: 2e-3, BF16: 2e-2}[dtype]
    torch.testing.assert_close(ga[0].float(), gb[0].float(), atol=tol * gb[0].abs().max().item(),
                               rtol=0)
    for a, b in zip(ga[1:], gb[1:]):
        b = b.float().view(2, 2, groups, 120, 64).sum(2)  # dk/dv summed over the group
        torch.testing.assert_close(a.float(), b, atol=tol * b.abs().max().item(), rtol=0)


def test_misaligned_inputs():
    """Data pointers that are not 16-byte aligned (odd storage offsets) still work."""
    for dtype in DTYPES:
        q, k, v = make_inputs(2, 4, 2, 70, 90, 64, dtype, "cuda", layout="misaligned", seed=1)
        check_attention(q, k, v, is_causal=True, scale=None, label="misaligned")


def test_side_stream():
    q, k, v = make_inputs(2, 4, 4, 256, 256, 64, F16, "cuda", seed=4)
    ref = flash_cuda.attention(q, k, v, is_causal=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = flash_cuda.attention(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------
# Large problems: O(S) memory and 64-bit offsets
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("is_causal", [True, False])
def test_long_sequence_memory_and_accuracy(D, is_causal):
    S, H = 16384, 2
    q, k, v = make_inputs(1, H, H, S, S, D, BF16, "cuda", seed=D)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    scores_bytes = H * S * S * 2  # one bf16 score matrix: what O(S) memory avoids
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = flash_cuda.attention(q, k, v, is_causal=is_causal, return_lse=True)
    torch.cuda.synchronize()
    fwd_extra = torch.cuda.max_memory_allocated() - base
    fwd_limit = 2 * q.nbytes + (4 << 20)
    assert fwd_extra <= fwd_limit, f"forward used {fwd_extra / 2**20:.1f} MiB extra"

    dout = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    torch.cuda.synchronize()
    bwd_extra = torch.cuda.max_memory_allocated() - base
    bwd_limit = 8 * q.nbytes + (8 << 20)
    assert bwd_extra <= bwd_limit, f"backward used {bwd_extra / 2**20:.1f} MiB extra"
    assert bwd_limit < scores_bytes / 8
    for g in (dq, dk, dv):
        assert torch.isfinite(g).all()

    # accuracy of the forward against chunked references (rows are independent)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out64, lse64 = naive_chunked(qd, kd, vd, is_causal=is_causal, scale=None, dtype=torch.float64,
                                 chunk=2048)
    outn, lsen = naive_chunked(qd, kd, vd, is_causal=is_causal, scale=None, dtype=BF16, chunk=2048)
    out32, _ = naive_chunked(qd, kd, vd, is_causal=is_causal, scale=None, dtype=F32, chunk=2048)
    problems = [p for p in (
        rule_error("out", out, out64, outn, ATOL_BASE[BF16])[1],
        rule_error("lse", lse, lse64, lsen, LSE_ATOL_BASE[BF16], mask=torch.isfinite(lse64),
                   min_mag=1.0)[1],
    ) if p]
    assert not problems, problems
    err32 = (out.float() - out32).abs().max().item()
    assert err32 <= 2e-2 * out32.abs().max().item(), f"vs float32 chunked reference: {err32:.3e}"


def test_int64_offsets():
    """More than 2^31 elements per tensor: batch offsets need 64-bit arithmetic."""
    B, H, S, D = 8200, 8, 256, 128  # 2.15e9 elements per tensor
    assert B * H * S * D > 2**31
    free, _ = torch.cuda.mem_get_info()
    if free < 48 * 2**30:
        pytest.skip(f"needs ~48 GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=BF16, generator=gen) for _ in range(3))
    q.requires_grad_()
    out, lse = flash_cuda.attention(q, k, v, is_causal=True, return_lse=True)
    dout = torch.zeros_like(out)
    dout[-1] = torch.randn(H, S, D, device="cuda", dtype=BF16, generator=gen)
    (dq,) = torch.autograd.grad(out, q, dout)
    for b in (0, B // 2, B - 1):
        sl = slice(b, b + 1)
        qb = q.detach()[sl].double().requires_grad_()
        o64, l64 = attention_naive(qb, k[sl].double(), v[sl].double(), is_causal=True)
        on, ln = attention_naive(q.detach()[sl], k[sl], v[sl], is_causal=True)
        problems = [rule_error(f"out[{b}]", out[sl], o64, on, ATOL_BASE[BF16])[1],
                    rule_error(f"lse[{b}]", lse[sl], l64, ln, LSE_ATOL_BASE[BF16], min_mag=1.0)[1]]
        if b == B - 1:
            (g64,) = torch.autograd.grad(o64, qb, dout[sl].double())
            qn = q.detach()[sl].clone().requires_grad_()
            (gn,) = torch.autograd.grad(attention_naive(qn, k[sl], v[sl], is_causal=True)[0], qn,
                                        dout[sl])
            problems.append(rule_error("dq[last]", dq[sl], g64, gn, ATOL_BASE[BF16])[1])
        else:
            assert (dq[sl] == 0).all()
        problems = [p for p in problems if p]
        assert not problems, problems


def test_binding_checks_raise():
    """The extension's own checks (behind the Python layer's) raise RuntimeError with their
    values in the message (api/flash_api.cpp: FLASH_CHECK; TORCH_CHECK with values crashed the
    process with some torch builds)."""
    from flash_cuda import _ext
    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=BF16)
    with pytest.raises(RuntimeError, match="unknown kernel tier 99"):
        _ext.require().fwd(q, q, q, 0.125, -1, -1, 0.0, None, None, None, 0, 0, 99)
    # The tier ids are flash_cuda.KERNELS' values (0..3) and no others.
    assert sorted(flash_cuda.KERNELS.values()) == [0, 1, 2, 3]
    for tier in (-1, 4):
        with pytest.raises(RuntimeError, match=f"unknown kernel tier {tier}"):
            _ext.require().fwd(q, q, q, 0.125, -1, -1, 0.0, None, None, None, 0, 0, tier)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wanted", ["qkv", "kv", "q", "lse_only"])
def test_cpp_autograd_node_matches_python_node(monkeypatch, dtype, wanted):
    """A repeated eager call with a gradient runs the extension's C++ autograd node
    (attention_direct); the Python node (EagerAttentionDirect) it stands for gives the same outputs
    and gradients: the same kernels, dK / dV bitwise, dQ up to its atomics' order."""
    from flash_cuda import _ext, interface, signature

    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, h, 300, 64, device="cuda", dtype=dtype, generator=g) for h in (4, 2, 2))
    dout = torch.randn(q.shape, device="cuda", dtype=dtype, generator=g)
    dlse = torch.randn(2, 4, 300, device="cuda", generator=g)

    def run():
        signature.dense_plans.clear()
        monkeypatch.setattr(interface, "_last_dense", ((), None))
        results = []
        for _ in range(2):  # the second call takes the fast path
            leaves = [t.clone().requires_grad_(name in wanted or wanted == "lse_only")
                      for t, name in zip((q, k, v), "qkv")]
            out, lse = flash_cuda.attention(*leaves, is_causal=True, return_lse=True)
            wrt = [t for t in leaves if t.requires_grad]
            if wanted == "lse_only":
                grads = torch.autograd.grad(lse, wrt, dlse)
            else:
                grads = torch.autograd.grad((out, lse), wrt, (dout, dlse))
            results.append((type(out.grad_fn).__name__, out.detach(), lse.detach(), grads))
        return results[-1]

    node, out, lse, grads = run()
    assert not node.startswith("Eager"), node  # the C++ node
    monkeypatch.setattr(_ext, "direct_plan", lambda *a: None)
    node_py, out_py, lse_py, grads_py = run()
    assert node_py == "EagerAttentionDirectBackward", node_py
    assert torch.equal(out, out_py) and torch.equal(lse, lse_py)
    names = [n for n in "qkv" if n in wanted or wanted == "lse_only"]
    for name, a, b in zip(names, grads, grads_py):
        if name == "q":
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)
        else:
            assert torch.equal(a, b), name
