"""The warp-specialized Hopper forward (csrc/kernels/sm90_fwd_ws.cuh: TMA loads into an mbarrier
ring, a producer warp, two consumer warpgroups, persistent CTAs). kernel='auto' runs it on sm_90
wherever it applies, so every GPU test file exercises it; these tests reach it directly through
the extension's tier 4, under each of its ablation switches, and hold it to the same float64
rule as every other kernel (tests/attn_check.py). GPU-only, sm_90 only."""

import math
import os

import pytest
import torch

from attn_check import _check_against_references, hopper_skip_reason, make_alibi_slopes, make_inputs
from flash_cuda import _ext
from flash_cuda.reference import attention_naive

F16, BF16 = torch.float16, torch.bfloat16
WS_TIER = 4


_SKIP = hopper_skip_reason("the warp-specialized forward")
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))

# (B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout): block edges (Sq, Sk not multiples of
# 128), Sq != Sk both ways, GQA, windows, strided and offset views, several key blocks so the
# two-stage ring wraps.
CASES = [
    (2, 4, 4, 1024, 1024, 128, False, (-1, -1), "bhsd"),
    (1, 4, 2, 777, 1029, 128, True, (-1, -1), "bshd"),
    (2, 6, 2, 300, 300, 64, False, (-1, -1), "strided"),
    (1, 2, 1, 1000, 1000, 64, True, (-1, -1), "offset"),
    (1, 4, 4, 129, 700, 128, False, (100, 37), "bhsd"),
    (1, 2, 2, 1500, 200, 64, True, (64, -1), "bshd"),
    (3, 2, 1, 65, 1, 128, False, (-1, -1), "bhsd"),
    (1, 3, 3, 2048, 2048, 128, True, (-1, -1), "strided"),
    # More tiles than SMs: a persistent CTA runs several tiles, the ring and the turns carry on
    # from one to the next (bottom-right causal with Sq > Sk: tiles whose rows see no key).
    (4, 16, 4, 1000, 1000, 64, True, (-1, -1), "bshd"),
    (2, 32, 8, 640, 1100, 128, False, (-1, -1), "bhsd"),
    (2, 20, 4, 1500, 400, 64, True, (64, -1), "bhsd"),
    # d = 64 from Sq = 2048: 192-row tiles by default (three consumer warpgroups).
    (1, 2, 1, 4200, 4300, 64, True, (-1, -1), "bshd"),
    # Head dims above 128 (64 keys per step; d = 256 writes O from registers), their buckets
    # below the full width, and more tiles than SMs.
    (1, 4, 4, 1000, 1000, 192, False, (-1, -1), "strided"),
    (2, 4, 2, 700, 900, 256, True, (-1, -1), "bshd"),
    (1, 2, 2, 300, 500, 160, True, (64, -1), "bhsd"),
    (1, 3, 1, 257, 129, 200, False, (-1, -1), "offset"),
    (2, 20, 4, 600, 600, 256, False, (-1, -1), "bhsd"),
    # Head dims 65..96 on the 128-wide kernel (TMA fills the columns past d with zeros).
    (2, 4, 2, 1000, 1100, 96, True, (-1, -1), "bshd"),
    (1, 3, 3, 300, 257, 72, False, (-1, -1), "offset"),
]


# (FLASH_CUDA_WS_SCHEDULE, FLASH_CUDA_WS_PERSISTENT): both consumer schedules, and one CTA per
# tile beside the persistent grid (both read at every launch).
SWITCHES = [("overlap", "1"), ("serial", "1"), ("overlap", "0")]


@pytest.fixture(params=SWITCHES, ids=lambda sw: f"{sw[0]}-persistent{sw[1]}")
def schedule(request, monkeypatch):
    monkeypatch.setenv("FLASH_CUDA_WS_SCHEDULE", request.param[0])
    monkeypatch.setenv("FLASH_CUDA_WS_PERSISTENT", request.param[1])
    return "-".join(request.param)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", CASES)
def test_ws_forward_matches_float64(schedule, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk + D)
    scale = 1.0 / math.sqrt(D)
    wl, wr = window
    if is_causal:
        wr = 0

    def flash_fn(qf, kf, vf):
        out, lse, _ = _ext.require().fwd(qf, kf, vf, scale, wl, wr, 0.0, None, None, None, 0, 0, WS_TIER)
        return out, lse

    def ref_fn(qr, kr, vr):
        return attention_naive(qr, kr, vr, is_causal=is_causal, scale=scale, window_size=window)

    desc = (f"schedule={schedule} B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} dtype={dtype} "
            f"causal={is_causal} window={window} layout={layout}")
    _check_against_references(desc, q, k, v, flash_fn, ref_fn, lse_shape=(B, Hq, Sq),
                              out_rows=lambda m: m, check_grad=False, with_dlse=False, seed=0,
                              what="warp-specialized forward")


@pytest.mark.parametrize("sched", ["overlap", "serial"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] == 64])
def test_ws_forward_d64_192_key_steps(monkeypatch, sched, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    """The d = 64 ablation FLASH_CUDA_WS_BLOCK_N=192 (192 keys per step) under the same rule."""
    monkeypatch.setenv("FLASH_CUDA_WS_BLOCK_N", "192")
    monkeypatch.setenv("FLASH_CUDA_WS_SCHEDULE", sched)
    test_ws_forward_matches_float64(sched, BF16, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] == 64])
def test_ws_forward_d64_four_stages(monkeypatch, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    """The d = 64 ablation FLASH_CUDA_WS_STAGES=4 (a deeper K/V ring) under the same rule."""
    monkeypatch.setenv("FLASH_CUDA_WS_STAGES", "4")
    test_ws_forward_matches_float64("stages4", dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] == 64])
def test_ws_forward_d64_192_row_tiles(monkeypatch, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    """The d = 64 ablation FLASH_CUDA_WS_BLOCK_M=192 (three consumer warpgroups, round-robin
    turns) under the same rule."""
    monkeypatch.setenv("FLASH_CUDA_WS_BLOCK_M", "192")
    test_ws_forward_matches_float64("rows192", dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("every", ["4", "8"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] in (64, 128)])
def test_ws_forward_poly_exp2(monkeypatch, every, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    """The ablation FLASH_CUDA_WS_EXP2_POLY (a share of the exponentials as a polynomial on the
    FMA pipe) under the same float64 rule."""
    monkeypatch.setenv("FLASH_CUDA_WS_EXP2_POLY", every)
    test_ws_forward_matches_float64(f"poly{every}", dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("every", ["0", "4", "8"])
def test_ws_forward_poly_exp2_keeps_nan(monkeypatch, every):
    """A NaN key row poisons every output row (its P is NaN, and 0 * NaN in P V too), whichever
    unit exponentiates it: keys 0..127 in steps of 4 reach every 8-key tile, the polynomial's
    included. (-inf scores, the masked keys, are covered by the causal and window cases.)"""
    monkeypatch.setenv("FLASH_CUDA_WS_EXP2_POLY", every)
    q, k, v = make_inputs(1, 2, 2, 128, 256, 128, BF16, "cuda", seed=11)
    for key in range(0, 128, 4):
        kk = k.clone()
        kk[:, :, key] = float("nan")
        out = _ext.require().fwd(q, kk, v, 0.1, -1, -1, 0.0, None, None, None, 0, 0, WS_TIER)[0]
        assert bool(torch.isnan(out).all()), f"key {key}: a NaN key row did not reach every output"


# (B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap, alibi kind): the kExtended instances
# (dense batches), head dims 64 / 128 / 192, more tiles than SMs in the last case.
MOD_CASES = [
    (2, 4, 2, 700, 900, 128, True, (-1, -1), 30.0, None),
    (1, 4, 4, 513, 1000, 64, False, (128, 64), 0.0, "heads"),
    (2, 2, 1, 300, 300, 192, True, (-1, -1), 5.0, "batch"),
    (2, 20, 4, 600, 700, 128, False, (-1, -1), 2.0, "heads"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,softcap,alibi", MOD_CASES)
def test_ws_forward_with_score_modifiers(schedule, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap,
                                         alibi):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", seed=Sq + D)
    slopes = None
    if alibi is not None:
        slopes = make_alibi_slopes(Hq, batch=B if alibi == "batch" else None, device="cuda", seed=Sk)
    scale = 1.0 / math.sqrt(D)
    wl, wr = window
    if is_causal:
        wr = 0

    def flash_fn(qf, kf, vf):
        out, lse, _ = _ext.require().fwd(qf, kf, vf, scale, wl, wr, softcap, slopes, None, None, 0, 0, WS_TIER)
        return out, lse

    def ref_fn(qr, kr, vr):
        return attention_naive(qr, kr, vr, is_causal=is_causal, scale=scale, window_size=window, softcap=softcap,
                               alibi_slopes=slopes)

    desc = (f"schedule={schedule} B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} dtype={dtype} "
            f"causal={is_causal} window={window} softcap={softcap} alibi={alibi}")
    _check_against_references(desc, q, k, v, flash_fn, ref_fn, lse_shape=(B, Hq, Sq),
                              out_rows=lambda m: m, check_grad=False, with_dlse=False, seed=0,
                              what="warp-specialized forward with score modifiers")


def test_ws_forward_is_deterministic(schedule):
    q, k, v = make_inputs(2, 4, 4, 1000, 1000, 128, BF16, "cuda", seed=3)
    runs = [_ext.require().fwd(q, k, v, 0.1, -1, 0, 0.0, None, None, None, 0, 0, WS_TIER)[0] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


def test_ws_schedules_agree():
    """The schedules, persistent or not, do the same arithmetic in the same order: bitwise
    equal outputs (512 tiles: several per persistent CTA)."""
    import subprocess
    import sys

    code = ("import torch, flash_cuda; from flash_cuda import _ext; from attn_check import make_inputs; "
            "q, k, v = make_inputs(4, 16, 4, 1000, 1100, 128, torch.bfloat16, 'cuda', seed=5); "
            f"o = _ext.require().fwd(q, k, v, 0.1, -1, 0, 0.0, None, None, None, 0, 0, {WS_TIER})[0]; "
            "import hashlib; print(hashlib.sha256(o.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest())")
    outs = []
    for sched, persistent in SWITCHES:
        env = dict(os.environ, FLASH_CUDA_WS_SCHEDULE=sched, FLASH_CUDA_WS_PERSISTENT=persistent)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             cwd=os.path.dirname(__file__))
        assert res.returncode == 0, res.stderr[-2000:]
        outs.append(res.stdout.strip())
    assert len(set(outs)) == 1, outs


def test_ws_forward_rejects_what_it_does_not_serve():
    q, k, v = make_inputs(1, 2, 2, 64, 64, 32, BF16, "cuda")
    with pytest.raises(RuntimeError, match="warp-specialized"):
        _ext.require().fwd(q, k, v, 0.1, -1, -1, 0.0, None, None, None, 0, 0, WS_TIER)
