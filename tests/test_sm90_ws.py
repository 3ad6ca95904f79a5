"""The warp-specialized Hopper forward (csrc/tiers/wgmma/fwd/: TMA loads into an mbarrier
ring, a producer warp, two consumer warpgroups, persistent CTAs). kernel='auto' runs it on sm_90
wherever it applies, so every GPU test file exercises it; these tests call the extension's
forward and hold it to the same float64 rule as every other kernel (tests/attn_check.py), each
call profiled to prove that the warp-specialized kernel ran (attn_check.ws_fwd). In a build with
the ablation rungs (FLASH_CUDA_ABLATIONS=1) they also run under each ablation switch
(csrc/tiers/wgmma/ablation.h); elsewhere those cases skip.
GPU-only, sm_90 only."""

import math
import os

import pytest
import torch

from attn_check import DECODE_MAX_QUERIES, WS_FORWARD_KERNELS, _check_against_references, assert_ws_forward, \
    check_attention, check_varlen_attention, climb_scores, hopper_skip_reason, make_alibi_slopes, make_inputs, \
    make_varlen_inputs, profiled, ws_fwd, ws_fwd_traced
from flash_cuda import _ext
from flash_cuda.reference import attention_naive, attention_varlen_naive

F16, BF16 = torch.float16, torch.bfloat16


_SKIP = hopper_skip_reason("the warp-specialized forward")
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))


def _ablation(monkeypatch, **env):
    """Sets ablation switches (csrc/include/ablation.h), or skips where the build has no rungs."""
    if not _ext.ablations():
        pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
    for name, value in env.items():
        monkeypatch.setenv(name, value)

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
    # d = 64 from Sq = 2048: 192-row tiles by default (three consumer warpgroups), with GQA,
    # windows, Sq != Sk and the views above.
    (1, 2, 1, 4200, 4300, 64, True, (-1, -1), "bshd"),
    (2, 6, 2, 2100, 2300, 64, False, (-1, -1), "strided"),
    (1, 2, 2, 2500, 2048, 64, True, (100, -1), "offset"),
    # Head dims above 128 (64 keys per step; d = 256 stages O in Q's tile), their buckets
    # below the full width, and more tiles than SMs.
    (1, 4, 4, 1000, 1000, 192, False, (-1, -1), "strided"),
    (2, 4, 2, 700, 900, 256, True, (-1, -1), "bshd"),
    (1, 2, 2, 300, 500, 160, True, (64, -1), "bhsd"),
    (1, 3, 1, 257, 129, 200, False, (-1, -1), "offset"),
    (2, 20, 4, 600, 600, 256, False, (-1, -1), "bhsd"),
    # d = 256's 80-key steps (tile_policy.h: kFwdD256KeySteps80) where a step meets the keys'
    # end: Sk = 80k - 1, 80k and 80k + 1 (a last block of 79, 80 and 1 keys), causal (bottom-right,
    # Sq != Sk both ways), a window whose edges fall inside 80-key blocks, GQA, more tiles than
    # SMs (the consumers re-derive their tile state per tile: kLeanTileLoop).
    (1, 4, 2, 319, 319, 256, True, (-1, -1), "bshd"),
    (2, 4, 4, 161, 320, 256, False, (-1, -1), "bhsd"),
    (1, 2, 1, 400, 321, 256, True, (-1, -1), "offset"),
    (1, 4, 2, 481, 479, 256, False, (81, 79), "strided"),
    (2, 4, 4, 80, 81, 256, True, (-1, -1), "bhsd"),
    (2, 24, 8, 799, 801, 256, True, (-1, -1), "bshd"),
    # Head dims 65..96: Q and K on the 128-wide tiles (TMA fills the columns past d with zeros),
    # V, P V and O natively 96 wide (three 64-byte-swizzled 32-column V slabs); odd lengths,
    # windows, GQA, d below 96 (the last V slab partly TMA's zeros), more tiles than SMs.
    (2, 4, 2, 1000, 1100, 96, True, (-1, -1), "bshd"),
    (1, 3, 3, 300, 257, 72, False, (-1, -1), "offset"),
    (1, 6, 2, 1531, 1283, 96, False, (200, 50), "bhsd"),
    (2, 16, 4, 999, 1001, 96, True, (-1, -1), "strided"),
    (1, 2, 2, 333, 777, 80, True, (64, -1), "bshd"),
    (3, 4, 1, 65, 129, 96, False, (-1, -1), "offset"),
]


# (FLASH_CUDA_WS_SCHEDULE, FLASH_CUDA_WS_PERSISTENT): the default (the overlapped schedule, a
# persistent grid), and as ablation rungs the serial schedule and one CTA per tile.
SWITCHES = [("overlap", "1"), ("serial", "1"), ("overlap", "0")]


@pytest.fixture(params=SWITCHES, ids=lambda sw: f"{sw[0]}-persistent{sw[1]}")
def schedule(request, monkeypatch):
    if request.param != SWITCHES[0]:
        _ablation(monkeypatch, FLASH_CUDA_WS_SCHEDULE=request.param[0], FLASH_CUDA_WS_PERSISTENT=request.param[1])
    return "-".join(request.param)


def _ws_dense_run_and_check(desc, q, k, v, is_causal, window, what):
    """The warp-specialized forward (ws_fwd: a failure if it did not run) on a dense batch
    without score modifiers, against float64 with the rule of tests/attn_check.py; returns the
    call for further use."""
    B, Hq, Sq, D = q.shape
    scale = 1.0 / math.sqrt(D)
    wl, wr = window
    if is_causal:
        wr = 0

    def flash_fn(qf, kf, vf):
        out, lse, _ = ws_fwd(qf, kf, vf, scale, wl, wr, 0.0, None, None, None, 0, 0)
        return out, lse

    def ref_fn(qr, kr, vr):
        return attention_naive(qr, kr, vr, is_causal=is_causal, scale=scale, window_size=window)

    _check_against_references(desc, q, k, v, flash_fn, ref_fn, lse_shape=(B, Hq, Sq),
                              out_rows=lambda m: m, check_grad=False, with_dlse=False, seed=0, what=what)
    return flash_fn


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", CASES)
def test_ws_forward_matches_float64(schedule, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk + D)
    desc = (f"schedule={schedule} B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} dtype={dtype} "
            f"causal={is_causal} window={window} layout={layout}")
    _ws_dense_run_and_check(desc, q, k, v, is_causal, window, "warp-specialized forward")


@pytest.mark.parametrize("sched", ["overlap", "serial"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] == 64])
def test_ws_forward_d64_192_key_steps(monkeypatch, sched, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    """The d = 64 ablation FLASH_CUDA_WS_BLOCK_N=192 (192 keys per step) under the same rule."""
    _ablation(monkeypatch, FLASH_CUDA_WS_BLOCK_N="192", FLASH_CUDA_WS_SCHEDULE=sched)
    test_ws_forward_matches_float64(sched, BF16, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] == 64])
def test_ws_forward_d64_four_stages(monkeypatch, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    """The d = 64 ablation FLASH_CUDA_WS_STAGES=4 (a deeper K/V ring) under the same rule."""
    _ablation(monkeypatch, FLASH_CUDA_WS_STAGES="4")
    test_ws_forward_matches_float64("stages4", dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] == 64])
def test_ws_forward_d64_192_row_tiles(monkeypatch, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    """The d = 64 ablation FLASH_CUDA_WS_BLOCK_M=192 (three consumer warpgroups, round-robin
    turns) at every Sq, under the same rule (the default takes them from Sq = 2048)."""
    _ablation(monkeypatch, FLASH_CUDA_WS_BLOCK_M="192")
    test_ws_forward_matches_float64("rows192", dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] == 64])
def test_ws_forward_d64_192_row_tiles_96_key_steps(monkeypatch, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window,
                                                   layout):
    """The d = 64 ablation FLASH_CUDA_WS_TALL_BLOCK_N=96 (the 192-row tiles in 96-key steps, the
    default's before 128) at every Sq (FLASH_CUDA_WS_BLOCK_M=192), under the same rule."""
    _ablation(monkeypatch, FLASH_CUDA_WS_BLOCK_M="192", FLASH_CUDA_WS_TALL_BLOCK_N="96")
    test_ws_forward_matches_float64("rows192keys96", dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("every", ["4", "8"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout", [c for c in CASES if c[5] in (64, 128)])
def test_ws_forward_poly_exp2(monkeypatch, every, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout):
    """The ablation FLASH_CUDA_WS_EXP2_POLY (a share of the exponentials as a polynomial on the
    FMA pipe) under the same float64 rule."""
    _ablation(monkeypatch, FLASH_CUDA_WS_EXP2_POLY=every)
    test_ws_forward_matches_float64(f"poly{every}", dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout)


@pytest.mark.parametrize("every", ["0", "4", "8"])
def test_ws_forward_poly_exp2_keeps_nan(monkeypatch, every):
    """A NaN key row poisons every output row (its P is NaN, and 0 * NaN in P V too), whichever
    unit exponentiates it: keys 0..127 in steps of 4 reach every 8-key tile, the polynomial's
    included. (-inf scores, the masked keys, are covered by the causal and window cases.)"""
    if every != "0":
        _ablation(monkeypatch, FLASH_CUDA_WS_EXP2_POLY=every)
    q, k, v = make_inputs(1, 2, 2, 128, 256, 128, BF16, "cuda", seed=11)
    for key in range(0, 128, 4):
        kk = k.clone()
        kk[:, :, key] = float("nan")
        out = ws_fwd(q, kk, v, 0.1, -1, -1, 0.0, None, None, None, 0, 0)[0]
        assert bool(torch.isnan(out).all()), f"key {key}: a NaN key row did not reach every output"


# (B, Hq, Hkv, Sq, Sk, D, is_causal, window, softcap, alibi kind): the kExtended instances
# (dense batches), head dims 64 / 128 / 192 / 256 (and 160 on the 192 bucket, 224 on the 256
# one: tile columns past d as TMA's zeros), more tiles than SMs in the last case.
MOD_CASES = [
    (2, 4, 2, 700, 900, 128, True, (-1, -1), 30.0, None),
    (1, 4, 2, 300, 500, 256, True, (128, 0), 50.0, "heads"),
    (2, 2, 2, 200, 129, 224, False, (-1, -1), 5.0, "batch"),
    (1, 4, 4, 513, 1000, 64, False, (128, 64), 0.0, "heads"),
    (2, 2, 1, 300, 300, 192, True, (-1, -1), 5.0, "batch"),
    (2, 20, 4, 600, 700, 128, False, (-1, -1), 2.0, "heads"),
    (2, 4, 2, 333, 517, 96, True, (-1, -1), 10.0, "heads"),
    (1, 2, 1, 200, 301, 88, False, (64, 32), 0.0, "batch"),
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
        out, lse, _ = ws_fwd(qf, kf, vf, scale, wl, wr, softcap, slopes, None, None, 0, 0)
        return out, lse

    def ref_fn(qr, kr, vr):
        return attention_naive(qr, kr, vr, is_causal=is_causal, scale=scale, window_size=window, softcap=softcap,
                               alibi_slopes=slopes)

    desc = (f"schedule={schedule} B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} dtype={dtype} "
            f"causal={is_causal} window={window} softcap={softcap} alibi={alibi}")
    _check_against_references(desc, q, k, v, flash_fn, ref_fn, lse_shape=(B, Hq, Sq),
                              out_rows=lambda m: m, check_grad=False, with_dlse=False, seed=0,
                              what="warp-specialized forward with score modifiers")


# The running max lags by up to 2^8 before O is rescaled (update_row_stats' kMaxLag): scores
# that climb slowly, steeply or fall along the keys (attn_check.climb_scores).
@pytest.mark.parametrize("rise", [3.0, 7.9, 20.0, -4.0])
@pytest.mark.parametrize("D,is_causal", [(128, False), (64, True), (192, False), (96, True)])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_ws_forward_lagging_max(schedule, dtype, D, is_causal, rise):
    B, Hq, Hkv, Sq, Sk = 1, 2, 1, 300, 1100
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", seed=int(rise * 10) + D)
    scale = 1.0 / math.sqrt(D)
    q, k = climb_scores(q, k, rise, scale)
    wr = 0 if is_causal else -1

    def flash_fn(qf, kf, vf):
        out, lse, _ = ws_fwd(qf, kf, vf, scale, -1, wr, 0.0, None, None, None, 0, 0)
        return out, lse

    def ref_fn(qr, kr, vr):
        return attention_naive(qr, kr, vr, is_causal=is_causal, scale=scale)

    desc = f"schedule={schedule} D={D} dtype={dtype} causal={is_causal} rise={rise}"
    _check_against_references(desc, q, k, v, flash_fn, ref_fn, lse_shape=(B, Hq, Sq),
                              out_rows=lambda m: m, check_grad=False, with_dlse=False, seed=0,
                              what="warp-specialized forward, lagging max")


def test_ws_forward_is_deterministic(schedule):
    q, k, v = make_inputs(2, 4, 4, 1000, 1000, 128, BF16, "cuda", seed=3)
    runs = [ws_fwd(q, k, v, 0.1, -1, 0, 0.0, None, None, None, 0, 0)[0] for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_ws_forward_sm_margin_is_bitwise(schedule, is_causal):
    """sm_margin (the SMs a persistent launch leaves free: the ring's transfers run there) changes
    only how many CTAs share the tiles, not a tile's arithmetic: the same bits from 1 CTA up to one
    per SM; a negative margin is refused."""
    q, k, v = make_inputs(2, 8, 4, 1500, 1500, 128, BF16, "cuda", seed=5)
    args = (q, k, v, 0.1, -1, 0 if is_causal else -1, 0.0, None, None, None, 0, 0)
    base = ws_fwd(*args)
    for margin in (16, 131, 10_000):
        out, lse, _ = ws_fwd(*args, sm_margin=margin)
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1]), f"sm_margin={margin}"
    with pytest.raises(RuntimeError, match="sm_margin must be >= 0"):
        ws_fwd(*args, sm_margin=-1)


@pytest.mark.parametrize("D", [96, 80])
def test_ws_forward_d96_value_layout(schedule, D):
    """At d 65..96 V lands as three 64-byte-swizzled 32-column slabs that P V reads with one
    m64n96k16 per k-step (csrc/tiers/wgmma/tile_policy.h: fwd_value_width). With q = 0 every
    row weighs the keys it sees equally, so a structured V names what a wrong layout read:
    V[k, c] = c gives O[i, c] = c (the column each output column came from), and V[k, c] =
    k % 32 with a causal mask gives each row the mean over its keys 0..i (the key rows)."""
    Sq = Sk = 300
    q = torch.zeros(1, 2, Sq, D, dtype=F16, device="cuda")
    k = make_inputs(1, 2, 2, Sq, Sk, D, F16, "cuda", seed=D)[1]  # any keys: every score is 0
    keys = torch.arange(Sk, device="cuda", dtype=torch.float64).view(Sk, 1)
    cols = torch.arange(D, device="cuda", dtype=torch.float64).view(1, D)
    v = (cols + 0 * keys).to(F16).expand(1, 2, Sk, D).contiguous()
    out = ws_fwd(q, k, v, 0.1, -1, -1, 0.0, None, None, None, 0, 0)[0].double()
    got = out.round()[0, 0]
    bad = (got != cols).any(dim=0).nonzero().flatten().tolist()
    assert not bad, f"D={D}: output columns {bad[:16]} read V columns {got[0, bad[:16]].tolist()}"
    v = (keys % 32 + 0 * cols).to(F16).expand(1, 2, Sk, D).contiguous()
    out = ws_fwd(q, k, v, 0.1, -1, 0, 0.0, None, None, None, 0, 0)[0].double()[0, 0]
    want = torch.cumsum(keys % 32, 0) / (keys + 1)
    err = (out - want).abs().amax(dim=1)
    bad = (err > 0.05).nonzero().flatten().tolist()
    assert not bad, f"D={D}: rows {bad[:16]} averaged the wrong key rows (max error {float(err.max()):.3f})"


def test_ws_schedules_agree():
    """The schedules, persistent or not, do the same arithmetic in the same order: bitwise
    equal outputs (512 tiles: several per persistent CTA)."""
    import subprocess
    import sys

    if not _ext.ablations():
        pytest.skip("the schedules and grids other than the default are ablation rungs: this build has none")
    code = ("import torch, flash_cuda; from attn_check import make_inputs, ws_fwd; "
            "q, k, v = make_inputs(4, 16, 4, 1000, 1100, 128, torch.bfloat16, 'cuda', seed=5); "
            "o = ws_fwd(q, k, v, 0.1, -1, 0, 0.0, None, None, None, 0, 0)[0]; "
            "import hashlib; print(hashlib.sha256(o.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest())")
    outs = []
    for sched, persistent in SWITCHES:
        env = dict(os.environ, FLASH_CUDA_WS_SCHEDULE=sched, FLASH_CUDA_WS_PERSISTENT=persistent)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             cwd=os.path.dirname(__file__))
        assert res.returncode == 0, res.stderr[-2000:]
        outs.append(res.stdout.strip())
    assert len(set(outs)) == 1, outs


# (B, Hq, Hkv, Sq, Sk, D, is_causal, layout): the O store, by TMA (FLASH_CUDA_WS_TMA_STORE=1, the
# default) or lane by lane from the same staging tile (=0): last query tiles and last warps'
# 16 rows cut by Sq (the TMA store leaves out the rows past the sequence), head dims below their
# bucket's width (columns left out), GQA, strided views, the 192-row tiles at d = 64, more tiles
# than SMs (the staging rows rewritten while earlier stores may still be reading them), and
# d = 256, where O is staged in Q's tile (the next tile's Q lands on it once the stores have read
# it): more tiles than SMs, and causal rows past Sk (tiles without keys, whose zeros are staged
# there too).
TMA_STORE_CASES = [
    (2, 4, 2, 1000, 1100, 128, True, "bshd"),
    (1, 4, 4, 777, 900, 64, False, "bhsd"),
    (1, 3, 1, 4200, 4300, 64, True, "bshd"),
    (2, 4, 2, 300, 500, 96, False, "strided"),
    (1, 3, 3, 129, 257, 72, True, "offset"),
    (1, 6, 2, 1000, 700, 192, True, "offset"),
    (1, 2, 1, 250, 300, 160, False, "bhsd"),
    (4, 16, 4, 1000, 1000, 128, False, "bhsd"),
    (3, 20, 4, 601, 650, 64, False, "bshd"),
    (2, 4, 2, 700, 900, 256, True, "bshd"),
    (3, 24, 8, 1000, 1000, 256, False, "bhsd"),
    (2, 8, 2, 900, 200, 256, True, "strided"),
]




@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,layout", TMA_STORE_CASES)
def test_ws_tma_store_matches_lane_copy(monkeypatch, schedule, B, Hq, Hkv, Sq, Sk, D, is_causal, layout):
    """FLASH_CUDA_WS_TMA_STORE=1 (the TMA store, the default) and =0 (the lane copy, a diagnostics
    switch) write the same bits (out and lse), and both hold to the float64 rule."""
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, BF16, "cuda", layout=layout, seed=Sq + D)
    wr = 0 if is_causal else -1
    results = {}
    for tma in ("1", "0"):
        monkeypatch.setenv("FLASH_CUDA_WS_TMA_STORE", tma)
        test_ws_forward_matches_float64(f"{schedule}-tma_store{tma}", BF16, B, Hq, Hkv, Sq, Sk, D, is_causal,
                                        (-1, -1), layout)
        out, lse, _ = ws_fwd(q, k, v, 1.0 / math.sqrt(D), -1, wr, 0.0, None, None, None, 0, 0)
        results[tma] = (out, lse)
    for tma, (out, lse) in results.items():
        assert torch.equal(results["1"][0], out), "out differs between the TMA store and the lane copy"
        assert torch.equal(results["1"][1], lse), "lse differs between the TMA store and the lane copy"


# (seqlens_q, seqlens_k, Hq, Hkv, D): packed batches whose sequences end inside a query tile and
# inside a warp's 16 rows (that warp copies lane by lane: a TMA store would write the next
# sequence's rows), sequences of 1 and 0 rows, one that fills whole tiles, GQA, head dims
# 64 / 96 / 128 / 192 / 256 and below their buckets.
TMA_STORE_VARLEN_CASES = [
    ((130, 77, 200, 1, 129, 0, 256), (129, 200, 77, 65, 300, 5, 256), 4, 2, 128),
    ((130, 77, 200, 1, 129, 0, 256), (129, 200, 77, 65, 300, 5, 256), 4, 1, 64),
    ((300, 17, 128, 45), (301, 400, 129, 60), 2, 2, 96),
    ((257, 1, 130, 33), (129, 7, 0, 90), 4, 2, 192),
    ((100, 200, 3), (150, 150, 260), 2, 2, 104),
    ((70, 190, 5), (65, 190, 300), 2, 1, 40),
    ((257, 1, 130, 33), (129, 7, 0, 90), 4, 2, 256),
]


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,D", TMA_STORE_VARLEN_CASES)
def test_ws_varlen_tma_store_matches_lane_copy(monkeypatch, schedule, lens_q, lens_k, Hq, Hkv, D, is_causal):
    """On packed batches too, FLASH_CUDA_WS_TMA_STORE=1 and =0 write the same bits, both to the
    float64 rule: no sequence's stores reach another's rows."""
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, Hq, Hkv, D, BF16, "cuda", seed=sum(lens_q) + D)
    scale = 1.0 / math.sqrt(D)
    wr = 0 if is_causal else -1
    results = {}
    for tma in ("1", "0"):
        monkeypatch.setenv("FLASH_CUDA_WS_TMA_STORE", tma)
        desc = f"schedule={schedule} tma_store={tma} varlen seqlens_q={lens_q} seqlens_k={lens_k} D={D}"
        _ws_varlen_check(desc, q, k, v, cu_q, cu_k, mq, mk, is_causal=is_causal, window=(-1, -1))
        out, lse, _ = ws_fwd(q, k, v, scale, -1, wr, 0.0, None, cu_q, cu_k, mq, mk)
        results[tma] = (out, lse)
    for tma, (out, lse) in results.items():
        assert torch.equal(results["1"][0], out), "out differs between the TMA store and the lane copy"
        assert torch.equal(results["1"][1], lse), "lse differs between the TMA store and the lane copy"


def test_ws_forward_sections_of_heads():
    """Causal calls of 32 or more query blocks take their tiles longest first over sections of
    (batch, head) pairs whose K and V fit in L2 together (core/scheduler.cuh): here 20 pairs of
    2.15 MB, sections of 15 and a short last one of 5; every tile exactly once."""
    q, k, v = make_inputs(4, 5, 5, 4200, 4200, 128, BF16, "cuda", seed=7)
    check_attention(q, k, v, is_causal=True, scale=None, check_grad=False, label="sections of heads")
    q, k, v = make_inputs(1, 8, 2, 6200, 6300, 64, F16, "cuda", layout="bshd", seed=8)
    check_attention(q, k, v, is_causal=True, scale=None, window_size=(2000, 0), check_grad=False,
                    label="sections of heads, GQA, window")


def test_ws_forward_declines_what_it_does_not_serve():
    """Head dims up to 32 run on the warp-specialized forward only without score modifiers
    (config.h: narrow_fwd_applies): with softcap, kernel='auto' runs the mma.sync forward instead,
    under the same float64 rule."""
    import flash_cuda

    q, k, v = make_inputs(1, 2, 2, 64, 64, 32, BF16, "cuda")
    _, names = profiled(lambda: flash_cuda.attention(q, k, v, softcap=5.0))
    assert "fwd_mma_kernel" in names, names
    assert not any(name in names for name in WS_FORWARD_KERNELS), names
    check_attention(q, k, v, is_causal=False, scale=None, softcap=5.0, check_grad=False,
                    label="d 32 softcap: the mma.sync forward")


# ---- packed (varlen) batches: the kExtended instances, head dims 33..256 ----
# (seqlens_q, seqlens_k, Hq, Hkv, D, is_causal, window, softcap, alibi kind, layout): lengths 1,
# lengths that are not multiples of the query (128) or key (128; 64 above d = 128) blocks, so
# that boxes cross into the next sequence, empty sequences (no queries; no keys: rows that see
# nothing), Sq != Sk per sequence both ways, causal and windows (bottom-right aligned per
# sequence), GQA / MQA, softcap and ALiBi, head dims below their bucket, strided and offset views.
VARLEN_CASES = [
    ((1, 127, 300, 0, 129), (1, 200, 300, 5, 128), 4, 2, 128, False, (-1, -1), 0.0, None, "contiguous"),
    ((1, 127, 300, 0, 129), (1, 200, 300, 5, 128), 4, 2, 64, True, (-1, -1), 0.0, None, "strided"),
    ((513, 17, 0, 1000), (200, 129, 3, 1000), 8, 2, 128, True, (-1, -1), 0.0, None, "offset"),
    ((700, 64, 33), (900, 64, 1), 4, 4, 64, False, (100, 37), 0.0, None, "contiguous"),
    ((257, 1, 130), (129, 7, 0), 2, 1, 192, True, (64, -1), 0.0, None, "contiguous"),
    ((300, 45), (301, 400), 2, 2, 160, False, (-1, -1), 0.0, None, "strided"),
    ((100, 200, 3), (150, 150, 260), 2, 2, 104, True, (-1, -1), 0.0, None, "contiguous"),
    ((129, 1, 500), (300, 2, 129), 4, 2, 128, True, (-1, -1), 20.0, "heads", "contiguous"),
    ((64, 191, 7), (65, 190, 300), 2, 2, 64, False, (32, 16), 5.0, "batch", "offset"),
    ((200, 33), (100, 257), 2, 1, 192, False, (-1, -1), 0.0, "batch", "contiguous"),
    ((257, 1, 0, 130), (129, 7, 3, 200), 4, 2, 256, True, (-1, -1), 50.0, "heads", "contiguous"),
    # d = 256, key lengths 80k - 1, 80k, 80k + 1 (where the dense instances' 80-key steps end;
    # packed batches take the extended instances' 64-key steps): causal, window, none.
    ((159, 81, 240), (159, 160, 241), 4, 2, 256, True, (-1, -1), 0.0, None, "contiguous"),
    ((300, 79, 1), (319, 81, 80), 2, 1, 256, False, (90, 70), 0.0, None, "strided"),
    ((81, 400), (79, 401), 2, 2, 256, False, (-1, -1), 0.0, None, "offset"),
    ((100, 65), (150, 64), 2, 1, 200, False, (32, 8), 0.0, None, "strided"),
    ((1, 127, 300, 0, 129), (1, 200, 300, 5, 128), 4, 2, 96, True, (-1, -1), 0.0, None, "contiguous"),
    ((257, 33, 90), (130, 301, 1), 2, 1, 96, False, (40, 8), 5.0, "heads", "strided"),
]


def _ws_varlen_check(desc, q, k, v, cu_q, cu_k, mq, mk, *, is_causal, window, softcap=0.0, slopes=None):
    """The warp-specialized forward (ws_fwd: a failure if it did not run) on a packed batch,
    against attention_varlen_naive in float64 with the rule of tests/attn_check.py."""
    total_q, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D)
    wl, wr = window
    if is_causal:
        wr = 0

    def flash_fn(qf, kf, vf):
        out, lse, _ = ws_fwd(qf, kf, vf, scale, wl, wr, softcap, slopes, cu_q, cu_k, mq, mk)
        return out, lse

    def ref_fn(qr, kr, vr):
        return attention_varlen_naive(qr, kr, vr, cu_q, cu_k, is_causal=is_causal, scale=scale,
                                      window_size=window, softcap=softcap, alibi_slopes=slopes)

    _check_against_references(desc, q, k, v, flash_fn, ref_fn, lse_shape=(Hq, total_q),
                              out_rows=lambda m: m.transpose(0, 1), check_grad=False, with_dlse=False, seed=0,
                              what="warp-specialized forward, packed batch")


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv,D,is_causal,window,softcap,alibi,layout", VARLEN_CASES)
def test_ws_varlen_matches_float64(schedule, dtype, lens_q, lens_k, Hq, Hkv, D, is_causal, window, softcap, alibi,
                                   layout):
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, Hq, Hkv, D, dtype, "cuda", layout=layout,
                                                     seed=sum(lens_q) + D)
    slopes = None
    if alibi is not None:
        slopes = make_alibi_slopes(Hq, batch=len(lens_q) if alibi == "batch" else None, device="cuda", seed=D)
    desc = (f"schedule={schedule} varlen seqlens_q={lens_q} seqlens_k={lens_k} Hq={Hq} Hkv={Hkv} D={D} "
            f"dtype={dtype} causal={is_causal} window={window} softcap={softcap} alibi={alibi} layout={layout}")
    _ws_varlen_check(desc, q, k, v, cu_q, cu_k, mq, mk, is_causal=is_causal, window=window, softcap=softcap,
                     slopes=slopes)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_ws_varlen_many_tiles(schedule, is_causal):
    """More tiles than SMs (persistent CTAs run many, the ring and the tail barrier's phase carry
    on from tile to tile), most of them past their sequence's end (a max_seqlen_q beyond the
    longest sequence: tiles the producer skips), and key blocks that end inside a sequence."""
    gen = torch.Generator().manual_seed(17)
    lens_q = [int(x) for x in torch.randint(0, 700, (24,), generator=gen)] + [1500]
    lens_k = [int(x) for x in torch.randint(1, 700, (24,), generator=gen)] + [1300]
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, 16, 4, 128, BF16, "cuda", seed=5)
    desc = f"schedule={schedule} varlen many tiles causal={is_causal} max_seqlen=({mq + 300}, {mk + 77})"
    _ws_varlen_check(desc, q, k, v, cu_q, cu_k, mq + 300, mk + 77, is_causal=is_causal, window=(-1, -1))


@pytest.mark.parametrize("poison", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("D,is_causal", [(64, False), (128, True), (192, False), (128, False), (96, False),
                                         (96, True)])
def test_ws_varlen_nonfinite_stays_in_its_sequence(schedule, poison, D, is_causal):
    """A NaN or Inf in one sequence's q, k and v rows never reaches another sequence's output or
    lse, though the boxes of the sequence before it read those rows (key lengths are not
    multiples of the key block): its masked keys' P = 0 must not meet them in P V (0 x NaN),
    and its query rows past its end are never stored. Every other sequence's out and lse stay
    bitwise those of the clean batch, which itself holds to the float64 rule."""
    lens_q = (130, 77, 200, 1, 129)
    lens_k = (129, 200, 77, 65, 300)
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, 4, 2, D, BF16, "cuda", seed=D)
    scale = 1.0 / math.sqrt(D)
    wr = 0 if is_causal else -1

    def run(qf, kf, vf):
        return ws_fwd(qf, kf, vf, scale, -1, wr, 0.0, None, cu_q, cu_k, mq, mk)[:2]

    _ws_varlen_check(f"schedule={schedule} clean batch D={D} causal={is_causal}", q, k, v, cu_q, cu_k, mq, mk,
                     is_causal=is_causal, window=(-1, -1))
    clean_out, clean_lse = run(q, k, v)
    rows_q, rows_k = cu_q.tolist(), cu_k.tolist()
    value = float(poison)
    for j in range(len(lens_q)):
        qq, kk, vv = q.clone(), k.clone(), v.clone()
        qq[rows_q[j]:rows_q[j + 1]] = value
        kk[rows_k[j]:rows_k[j + 1]] = value
        vv[rows_k[j]:rows_k[j + 1]] = value
        out, lse = run(qq, kk, vv)
        for i in range(len(lens_q)):
            if i == j:
                continue
            a, b = rows_q[i], rows_q[i + 1]
            where = f"{poison} in sequence {j} (schedule={schedule} D={D} causal={is_causal}): sequence {i}"
            assert bool(torch.isfinite(out[a:b]).all()), f"{where}: non-finite out"
            assert not bool(torch.isnan(lse[:, a:b]).any()), f"{where}: NaN lse"
            assert torch.equal(out[a:b], clean_out[a:b]), f"{where}: out differs from the clean batch"
            assert torch.equal(lse[:, a:b], clean_lse[:, a:b]), f"{where}: lse differs from the clean batch"


@pytest.mark.parametrize("D,kernel", [(64, "auto"), (128, "auto"), (192, "auto"), (128, "wgmma"), (256, "auto")])
def test_ws_varlen_route(D, kernel):
    """The route of a packed forward: kernel='auto' (and 'wgmma' at its head dims) runs the
    warp-specialized kernel, not the mma.sync one, and holds to the float64 rule."""
    import flash_cuda

    lens_q, lens_k = (300, 1, 129), (257, 64, 1)
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, 4, 2, D, BF16, "cuda", seed=D)
    _, names = profiled(lambda: flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, is_causal=True,
                                                            kernel=kernel))
    assert_ws_forward(names, f"varlen_attention D={D} kernel={kernel}")
    assert "fwd_sm90_ws_kernel" in names, names
    check_varlen_attention(q, k, v, cu_q, cu_k, mq, mk, is_causal=True, kernel=kernel, check_grad=False,
                           label=f"route D={D} kernel={kernel}")


# ---- GQA packing (csrc/tiers/wgmma/fwd/kernel.cuh, fwd_sm90_ws_gqa_kernel): the query heads of a KV group in one
# 128-row tile, row r = query q0 + r / G of head r % G; dense kPlain batches at d 33..128 ----
def _gqa_cases():
    """(B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout, dtype): every group size G in 2, 4, 8, 16
    with every short Sq (1, 7, 16, 33, 64 and 100, which a tile of 128 / G queries splits
    unevenly), the key lengths, masks, head dims and layouts spread over them: a single key,
    key lengths at and around the 128-key blocks, causal with Sq > Sk (rows that see no key),
    windows on either side, head dims below their bucket, bshd (a group's heads adjacent in
    memory), strided and offset views."""
    sks = (1, 1000, 129, 37, 128, 517, 300, 7, 999, 64, 255, 130)
    masks = ((False, (-1, -1)), (True, (-1, -1)), (False, (48, 16)), (True, (100, -1)), (False, (-1, 0)),
             (False, (0, 300)))
    dims = (128, 64, 96, 72, 128, 64, 40, 128)
    layouts = ("bshd", "bhsd", "strided", "offset")
    cases = []
    for gi, G in enumerate((2, 4, 8, 16)):
        for si, Sq in enumerate((1, 7, 16, 33, 64, 100)):
            n = 6 * gi + si
            Hkv = 1 + n % 3
            causal, window = masks[(si + gi) % len(masks)]
            cases.append((1 + n % 2, G * Hkv, Hkv, Sq, sks[(si + 5 * gi) % len(sks)], dims[(si + 3 * gi) % len(dims)],
                          causal, window, layouts[(si + 3 * gi) % len(layouts)], F16 if n % 2 else BF16))
    # G = 32 and 128 (one query per tile: the box is 1 row of 128 heads), MQA.
    cases.append((1, 32, 1, 50, 700, 128, True, (-1, -1), "bshd", BF16))
    cases.append((2, 128, 1, 3, 200, 64, False, (-1, -1), "bhsd", F16))
    return cases


GQA_CASES = _gqa_cases()


def _ws_pack_expected(Hq, Hkv, Sq, D, pack):
    """Whether the packed kernel should run (csrc/tiers/wgmma/config.h: pack_gqa) for a plain dense
    call under the default shape and schedule, FLASH_CUDA_WS_PACK_GQA = pack (None: unset)."""
    G = Hq // Hkv
    if G < 2 or 128 % G != 0 or D > 128 or pack == "0":
        return False
    return pack == "1" or Sq <= 64


def _ws_gqa_run_and_check(desc, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout, dtype, seed):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=seed)
    flash_fn = _ws_dense_run_and_check(desc, q, k, v, is_causal, window, "warp-specialized forward, GQA packing")
    return q, k, v, flash_fn


@pytest.mark.parametrize("pack", [None, "1", "0"], ids=["default", "packed", "unpacked"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,layout,dtype", GQA_CASES)
def test_ws_gqa_packing_matches_float64(monkeypatch, pack, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout, dtype):
    """By default (packed up to Sq = 64) and, in an ablation build, packed everywhere
    (FLASH_CUDA_WS_PACK_GQA=1) or nowhere (=0), the forward holds to the float64 rule: the mask of
    each row is its query's, O and lse land at each row's own head and query, rows past Sq are
    never stored, and rows that see no key get 0 and -inf."""
    if pack is not None:
        _ablation(monkeypatch, FLASH_CUDA_WS_PACK_GQA=pack)
    desc = (f"pack={pack} B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} dtype={dtype} causal={is_causal} "
            f"window={window} layout={layout}")
    _ws_gqa_run_and_check(desc, B, Hq, Hkv, Sq, Sk, D, is_causal, window, layout, dtype, seed=Sq * 7 + Sk + Hq)


@pytest.mark.parametrize("persistent", ["1", "0"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_ws_gqa_packing_many_tiles(monkeypatch, persistent, is_causal):
    """More packed tiles than SMs (Sq = 33: packed by default; persistent CTAs run several, the ring
    and the turns carry on from one tile to the next), and in an ablation build one CTA per tile."""
    if persistent != "1":
        _ablation(monkeypatch, FLASH_CUDA_WS_PERSISTENT=persistent)
    desc = f"many packed tiles persistent={persistent} causal={is_causal}"
    _ws_gqa_run_and_check(desc, 16, 64, 8, 33, 900, 128, is_causal, (-1, -1), "bshd", BF16, seed=41)


@pytest.mark.parametrize("D,is_causal,window", [(128, False, (-1, -1)), (64, True, (-1, -1)), (96, False, (70, 3))])
def test_ws_gqa_packing_is_bitwise_unpacked(monkeypatch, D, is_causal, window):
    """A row's arithmetic does not depend on the rows it shares a tile with: the same key blocks in
    the same order (a block that only the other tile layout visits is fully masked for the row and
    adds exact zeros), the same products and exponentials. So packed and unpacked outputs and lse
    are bitwise equal (an ablation build forces either)."""
    _ablation(monkeypatch)
    q, k, v = make_inputs(2, 16, 2, 45, 700, D, BF16, "cuda", layout="bshd", seed=D)
    wl, wr = window
    if is_causal:
        wr = 0
    runs = []
    for pack in ("1", "0"):
        monkeypatch.setenv("FLASH_CUDA_WS_PACK_GQA", pack)
        out, lse, _ = ws_fwd(q, k, v, 0.125, wl, wr, 0.0, None, None, None, 0, 0)
        runs.append((out, lse))
    assert torch.equal(runs[0][0], runs[1][0]), "out: packed != unpacked"
    assert torch.equal(runs[0][1], runs[1][1]), "lse: packed != unpacked"


# (B, Hq, Hkv, Sq, Sk, D, FLASH_CUDA_WS_PACK_GQA or None, extra env): the route of a forward.
GQA_ROUTES = [
    (2, 16, 4, 16, 500, 128, None, {}),        # G = 4, Sq = 16: packed by default
    (2, 16, 4, 16, 500, 128, "0", {}),         # ... unless switched off
    (1, 8, 1, 64, 300, 64, None, {}),          # G = 8, Sq = 64
    (1, 16, 2, 65, 300, 96, None, {}),         # G = 8, Sq = 65: 5 tiles for 8, not half
    (1, 16, 2, 129, 300, 96, "1", {}),         # ... packed when asked
    (1, 8, 2, 1000, 1000, 128, None, {}),      # long Sq: not by default ...
    (1, 8, 2, 1000, 1000, 128, "1", {}),       # ... but when asked
    (1, 4, 4, 16, 300, 128, "1", {}),          # MHA: nothing to pack
    (1, 6, 2, 16, 300, 64, "1", {}),           # G = 3 does not divide the tile
    (1, 8, 2, 16, 300, 192, "1", {}),          # d > 128: no packed instance
    (1, 8, 2, 100, 300, 192, "1", {}),         # ... at Sq = 100 too (past the decode kernels' 16 queries)
    (1, 8, 2, 16, 300, 128, "1", {"FLASH_CUDA_WS_SCHEDULE": "serial"}),  # the overlapped schedule only
    (1, 8, 2, 16, 300, 64, "1", {"FLASH_CUDA_WS_STAGES": "4"}),          # nor with a shape ablation
]


@pytest.mark.parametrize("kernel", ["auto", "ws"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,pack,env", GQA_ROUTES)
def test_ws_gqa_route(monkeypatch, kernel, B, Hq, Hkv, Sq, Sk, D, pack, env):
    """The profiler sees fwd_sm90_ws_gqa_kernel exactly where config.h's pack_gqa takes it
    (flash_cuda.attention with kernel='auto', and the extension's forward on the warp-specialized
    kernels, attn_check.ws_fwd, which reaches the decode-shaped calls too), the unpacked
    warp-specialized kernel otherwise, and each route holds to the float64 rule. Softcap (an
    extended call) never packs. The routes with switches run in an ablation build."""
    import flash_cuda

    if kernel == "ws" and Sq <= DECODE_MAX_QUERIES and D > 128:
        pytest.skip("a decode-shaped call above d = 128: kernel='auto' runs the decode kernels and no other "
                    "kernel= reaches the warp-specialized forward (kernel='wgmma' serves d 33..128)")
    if pack is not None or env:
        _ablation(monkeypatch, **({} if pack is None else {"FLASH_CUDA_WS_PACK_GQA": pack}), **env)
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, BF16, "cuda", layout="bshd", seed=Sq + D)
    expected = _ws_pack_expected(Hq, Hkv, Sq, D, pack) and not env
    for softcap in (0.0, 5.0):
        if kernel == "auto":
            _, names = profiled(lambda: flash_cuda.attention(q, k, v, is_causal=True, softcap=softcap))
        else:
            _, names = ws_fwd_traced(q, k, v, 0.1, -1, 0, softcap, None, None, None, 0, 0)
        if kernel == "auto" and Sq <= DECODE_MAX_QUERIES:
            # kernel='auto' sends decode-shaped calls to the split-KV decode kernels instead.
            assert "decode_kernel" in names, names
        else:
            packed = expected and softcap == 0.0
            assert ("fwd_sm90_ws_gqa_kernel" in names) == packed, names
            assert ("fwd_sm90_ws_kernel" in names) == (not packed), names
        check_attention(q, k, v, is_causal=True, scale=None, softcap=softcap, check_grad=False,
                        label=f"GQA route pack={pack} env={env} softcap={softcap}")
