"""The wide warp-specialized Hopper backward (csrc/tiers/wgmma/bwd_wide.cuh), head dims 129..256
(buckets 192 and 256), kernel='auto''s backward there (csrc/tiers/wgmma/config.h:
wide_bwd_applies): gradients held to the float64 rule of every other kernel (tests/attn_check.py),
and its route (the profiler sees it for dense and packed batches, ALiBi and softcap included,
with deterministic=False; the mma.sync backward with deterministic=True, and in a build with the
ablation rungs with FLASH_CUDA_SM90_BWD_D256=0).

What the cases aim at: 64 keys per CTA split between two consumer warpgroups by head-dim columns
(d = 256: 128 + 128; the 192 bucket: 128 + 64, at d = 160 the second share mostly past d, as TMA's
zero columns), S^T / dP^T split by queries (32 each, exchanged as 16-bit P^T / dS^T through two
shared buffers), dQ by atomics into the fp32 workspace. Block edges (Sq, Sk not multiples of 64),
Sq != Sk both ways, causal rows that see no key (whole query blocks skipped by both warpgroups,
which must keep the exchange buffers in step), windows, GQA (the CTA walks several query heads
through its 2-stage ring), strided views. Softcap's derivative (kSoftcapGrad: P^T and dS^T computed
8 queries at a time once both S^T and dP^T have landed, each slice written into the exchange
tiles), alone and with ALiBi, dense and packed. GPU-only, sm_90 only."""


import pytest
import torch

from attn_check import check_attention, hopper_skip_reason, make_alibi_slopes, make_inputs, make_varlen_inputs, \
    check_varlen_attention


_SKIP = hopper_skip_reason("the wide Hopper backward")
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))

F16, BF16 = torch.float16, torch.bfloat16
SWITCH = "FLASH_CUDA_SM90_BWD_D256"


# (B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)
CASES = [
    (2, 4, 4, 1000, 1000, 256, False, (-1, -1), "bhsd"),
    (1, 8, 2, 777, 1029, 256, True, (-1, -1), "bshd"),
    (2, 4, 1, 1029, 300, 256, True, (-1, -1), "strided"),  # 729 rows see no key
    (1, 4, 2, 513, 700, 192, False, (100, 37), "offset"),
    (2, 4, 2, 1000, 1100, 192, True, (-1, -1), "bhsd"),
    (1, 6, 3, 300, 1200, 160, False, (64, 64), "strided"),
    (1, 4, 4, 300, 257, 160, True, (-1, -1), "bshd"),
    (1, 2, 2, 65, 1, 256, False, (-1, -1), "bhsd"),
    (2, 8, 2, 900, 900, 224, False, (40, 0), "bhsd"),  # the 256 bucket below its width
    (1, 4, 1, 1500, 300, 136, True, (-1, -1), "bshd"),  # 192 bucket: 8 columns of the second share
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", CASES)
def test_wide_bwd_gradients(dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk + D)
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, kernel="auto",
                    label="sm90 wide bwd", seed=Sq + D)


@pytest.mark.parametrize("D", [192, 256])
def test_wide_bwd_negative_scale_and_large_values(D):
    q, k, v = make_inputs(1, 4, 2, 600, 600, D, BF16, "cuda", seed=5)
    check_attention(q * 4, k, v, is_causal=False, scale=-0.2, kernel="auto", label="sm90 wide bwd scale<0", seed=5)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_wide_bwd_with_dlse(dtype):
    q, k, v = make_inputs(2, 4, 2, 333, 444, 256, dtype, "cuda", seed=8)
    check_attention(q, k, v, is_causal=True, scale=None, kernel="auto", with_dlse=True, label="sm90 wide bwd dlse",
                    seed=8)


def _backward_kernels(q, k, v, **kw):
    import flash_cuda

    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.attention(qf, kf, vf, **kw)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(out, (qf, kf, vf), torch.ones_like(out))
        torch.cuda.synchronize()
    return " ".join(e.name for e in prof.events())


@pytest.mark.parametrize("D", [136, 192, 256])
@pytest.mark.parametrize("route", ["default", "off", "deterministic", "alibi", "softcap"])
def test_wide_bwd_route(route, D, monkeypatch):
    """A backward at d 129..256 runs the wide kernel (ALiBi in its extended instance, softcap in
    its kSoftcapGrad one); with deterministic=True, or the ablation switch at 0, the mma.sync
    backward runs."""
    import flash_cuda

    if route == "off":
        if not flash_cuda._ext.ablations():
            pytest.skip("FLASH_CUDA_SM90_BWD_D256 is an ablation switch: this build has no ablation rungs")
        monkeypatch.setenv(SWITCH, "0")
    q, k, v = make_inputs(1, 4, 2, 512, 512, D, BF16, "cuda", seed=3)
    kw = dict(is_causal=True)
    if route == "deterministic":
        kw["deterministic"] = True
    if route == "alibi":
        kw["alibi_slopes"] = make_alibi_slopes(4, device="cuda", seed=3)
    if route == "softcap":
        kw["softcap"] = 5.0
    names = _backward_kernels(q, k, v, **kw)
    wide = route in ("default", "alibi", "softcap")
    assert ("bwd_sm90_wide_kernel" in names) == wide, names


# Packed batches (the extended instances): sequences ending mid-block on both sides (the
# producer zeroes the next sequence's rows of a partial key block), empty ones, a one-row one,
# GQA, causal and windowed, ALiBi per head or per batch entry, the 192 bucket below its width.
VARLEN_CASES = [
    ((300, 0, 517, 64), (129, 5, 700, 64), 4, 2, 256, True, (-1, -1), None, "contiguous"),
    ((1, 200, 129), (70, 1, 300), 4, 1, 192, False, (-1, -1), "heads", "strided"),
    ((333, 64, 65), (400, 64, 130), 2, 2, 160, True, (50, 0), "batch", "contiguous"),
    ((129, 600), (1000, 77), 8, 2, 256, False, (100, 100), None, "strided"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seqlens_q,seqlens_k,Hq,Hkv,D,is_causal,window,alibi,layout", VARLEN_CASES)
def test_wide_bwd_packed_batch(dtype, seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, alibi, layout):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs(seqlens_q, seqlens_k, Hq, Hkv, D, dtype, layout=layout,
                                                           seed=D + Hq)
    slopes = None
    if alibi is not None:
        slopes = make_alibi_slopes(Hq, batch=len(seqlens_q) if alibi == "batch" else None, device="cuda", seed=D)
    check_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal, window_size=window,
                           alibi_slopes=slopes, label="sm90 wide bwd varlen", seed=D)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D,is_causal", [(256, True), (192, False), (144, True)])
def test_wide_bwd_alibi(dtype, D, is_causal):
    q, k, v = make_inputs(2, 4, 2, 700, 900, D, dtype, "cuda", layout="bshd", seed=D)
    slopes = make_alibi_slopes(4, batch=2, device="cuda", seed=D)
    check_attention(q, k, v, is_causal=is_causal, scale=None, alibi_slopes=slopes, kernel="auto",
                    label="sm90 wide bwd alibi", seed=D)


def test_wide_bwd_packed_route():
    """A packed batch at d 129..256 runs the wide kernel's extended instance."""
    import flash_cuda

    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((300, 64), (129, 700), 4, 2, 256, BF16, seed=11)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.varlen_attention(qf, kf, vf, cu_q, cu_k, max_q, max_k, is_causal=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(out, (qf, kf, vf), torch.ones_like(out))
        torch.cuda.synchronize()
    assert "bwd_sm90_wide_kernel" in " ".join(e.name for e in prof.events())


def test_wide_bwd_many_heads_per_cta():
    """GQA 16:1 with short sequences: each CTA's ring wraps many times across query heads, and
    atomics of 16 heads' blocks meet in the workspace."""
    q, k, v = make_inputs(1, 16, 1, 200, 130, 256, F16, "cuda", seed=21)
    check_attention(q, k, v, is_causal=False, scale=None, kernel="auto", label="sm90 wide bwd gqa16", seed=21)


# Softcap's derivative (the kSoftcapGrad instances): both buckets, d = 160 with the second
# warpgroup's columns mostly past d, causal and not, GQA, a window, with ALiBi, a tight softcap
# (5: tanh saturates, dtanh far from 1) and a loose one (30), Sq != Sk both ways.
# (B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap, alibi, layout)
SOFTCAP_CASES = [
    (2, 4, 4, 700, 700, 256, False, (-1, -1), 5.0, None, "bhsd"),
    (1, 8, 2, 777, 1029, 256, True, (-1, -1), 30.0, None, "bshd"),
    (2, 4, 2, 1029, 300, 256, True, (-1, -1), 5.0, "heads", "strided"),  # rows that see no key
    (1, 4, 2, 513, 700, 192, False, (100, 37), 30.0, None, "offset"),
    (2, 4, 1, 600, 650, 192, True, (-1, -1), 5.0, "batch", "bhsd"),
    (1, 6, 3, 300, 1200, 160, False, (64, 64), 5.0, None, "strided"),
    (1, 4, 4, 300, 257, 160, True, (-1, -1), 30.0, "heads", "bshd"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,softcap,alibi,layout", SOFTCAP_CASES)
def test_wide_bwd_softcap(dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap, alibi, layout):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk + D)
    slopes = None
    if alibi is not None:
        slopes = make_alibi_slopes(Hq, batch=B if alibi == "batch" else None, device="cuda", seed=D)
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, softcap=softcap,
                    alibi_slopes=slopes, kernel="auto", label="sm90 wide bwd softcap", seed=Sq + D)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D,alibi", [(256, None), (192, "heads")])
def test_wide_bwd_softcap_packed_batch(dtype, D, alibi):
    """A packed batch with softcap: sequences ending mid-block on both sides, an empty one, GQA,
    causal (the kSoftcapGrad instance reads cu_seqlens like the extended one)."""
    seqlens_q, seqlens_k = (300, 0, 517, 64), (129, 5, 700, 64)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs(seqlens_q, seqlens_k, 4, 2, D, dtype, seed=D + 7)
    slopes = make_alibi_slopes(4, device="cuda", seed=D) if alibi is not None else None
    check_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, softcap=10.0, alibi_slopes=slopes,
                           label="sm90 wide bwd varlen softcap", seed=D)
