"""CPU tests of bench/features.py (`python bench/run.py --features`): the visible-pair count
against a brute-force mask, the FLOP count, the row plan, the table / CSV and --dry-run."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def feat():
    spec = importlib.util.spec_from_file_location("flash_cuda_bench_features",
                                                  BENCH / "features.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def brute_force_pairs(sq, sk, left, right):
    """Count of the mask written from the rule itself: query i sees key j iff
    i + sk - sq - left <= j <= i + sk - sq + right (-1: that side unbounded)."""
    n = 0
    for i in range(sq):
        for j in range(sk):
            d = i + sk - sq
            if (left < 0 or j >= d - left) and (right < 0 or j <= d + right):
                n += 1
    return n


@pytest.mark.parametrize("sq", [1, 5, 17, 64])
@pytest.mark.parametrize("sk", [1, 7, 17, 64])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (0, 0), (3, 0), (0, 2), (4, 9),
                                    (-1, 5), (6, -1), (100, 0), (0, 100)])
def test_visible_pairs_match_brute_force(feat, sq, sk, window):
    assert feat.visible_pairs(sq, sk, *window) == brute_force_pairs(sq, sk, *window)


def test_visible_pairs_closed_forms(feat):
    S, W = 16384, 1024
    assert feat.visible_pairs(S, S) == S * S
    assert feat.visible_pairs(S, S, -1, 0) == S * (S + 1) // 2
    assert feat.visible_pairs(S, S, W, 0) == (W + 1) * W // 2 + (S - W) * (W + 1)
    assert feat.visible_pairs(0, 5) == 0 and feat.visible_pairs(5, 0, 1, 1) == 0


def test_call_pairs_and_flops(feat):
    M, Call = feat.M, feat.M.Call
    # dense non-causal: same FLOPs as run.py's convention
    plain = Call("flash_cuda", 128, 16, False, "fwd", (4096,) * 4)
    assert feat.flops(plain) == M.attention_flops(4, 16, 4096, 4096, 128, False, "fwd")
    # causal: exact S(S+1)/2 per sequence, bwd 2.5x
    causal = Call("flash_cuda", 64, 32, True, "bwd", (2048,) * 8)
    assert feat.pairs(causal) == 8 * 2048 * 2049 // 2
    assert feat.flops(causal) == 2.5 * 4 * 32 * 64 * feat.pairs(causal)
    # window with is_causal: right side 0, left side 1024
    win = Call("flash_cuda", 128, 16, True, "fwd", (16384,), window=(1024, 0))
    assert feat.sides(win) == (1024, 0)
    assert feat.pairs(win) == 1025 * 1024 // 2 + (16384 - 1024) * 1025
    assert feat.pairs(Call("flash_cuda", 128, 16, True, "fwd", (300,), window=(40, 0))) == \
        brute_force_pairs(300, 300, 40, 0)
    # varlen: sum over the sequences
    lens = (3, 10, 1, 7)
    var = Call("flash_cuda", 64, 2, True, "fwd", lens, varlen=True)
    assert feat.pairs(var) == sum(brute_force_pairs(s, s, -1, 0) for s in lens)
    # options at their defaults are not passed
    assert plain.options() == {"is_causal": False}
    assert Call("flash_cuda", 64, 2, True, "fwd", (8,), window=(4, 0), softcap=5.0).options() == {
        "is_causal": True, "window_size": (4, 0), "softcap": 5.0}
    assert Call("flash_cuda", 64, 2, False, "fwd", (8,), dropout=0.1).options() == {"is_causal": False, "dropout_p": 0.1}
    # the sinks are a tensor, made by make_fn / check like the ALiBi slopes: not among the options
    assert Call("flash_cuda", 64, 2, True, "fwd", (8,), sinks=True).options() == {"is_causal": True}
    assert feat.flops(replace(plain, sinks=True)) == feat.flops(plain)  # no pairs of its own


def test_sink_logits(feat):
    """One float32 logit per query head, the same every call; on head H-1 at S = 4k (D = 128, N(0, 1) inputs)
    the sink moves the output past the bf16 tolerance, so the check (heads 0 and H-1) sees a dropped sink."""
    sys.path.append(str(ROOT))
    attention_naive = pytest.importorskip("flash_cuda.reference").attention_naive
    M = feat.M
    s = M.sink_logits(16)
    assert s.dtype == torch.float32 and s.shape == (16,) and not s.requires_grad
    assert torch.equal(s, M.sink_logits(16)) and float(s[0]) == -1.0 and float(s[-1]) == 10.0
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, sq, 128, generator=gen) for sq in (64, 4096, 4096))  # 64 rows, 4k keys each
    plain = attention_naive(q, k, v)[0]
    sunk = attention_naive(q, k, v, sinks=s[[0, -1]])[0]
    err = float((plain - sunk).norm() / sunk.norm())
    assert err > 10 * M.TOLERANCE[torch.bfloat16][0]


def test_mixed_seqlens_fixed(feat):
    a = feat.mixed_seqlens(8, 128, 4096, 0)
    assert a == feat.mixed_seqlens(8, 128, 4096, 0) and len(a) == 8
    assert all(128 <= s <= 4096 for s in a) and len(set(a)) > 1


def test_rows_plan(feat):
    rows = feat.build_rows([64, 128], [0, 1], ["fwd", "bwd"])
    by = {}
    for r in rows:
        by.setdefault(r.feature, []).append(r)
    assert len(by["window"]) == 4 and len(by["varlen"]) == 8 and len(by["varlen mixed"]) == 8
    assert len(by["softcap"]) == 4 and len(by["alibi"]) == 4 and len(by["dropout"]) == 8
    assert len(by["sinks"]) == 4 and len(by["gqa"]) == 4
    for r in rows:
        c = r.call
        assert c.H * c.D == 2048 and r.base.provider == "flash_cuda" and r.sdpa.provider == "sdpa"
        assert r.base == feat.M.Call("flash_cuda", c.D, c.H, c.causal, c.mode, r.base.seqlens)
    for r in by["window"]:
        assert r.call.causal and r.call.window == (1024, 0) and r.call.seqlens == (16384,)
        assert r.goal == 0.85
    for r in by["varlen"]:
        assert r.call.varlen and sum(r.call.seqlens) == 16384 and r.base.seqlens == (2048,) * 8
        assert r.goal == 0.95
    for r in by["softcap"] + by["alibi"] + by["sinks"] + by["gqa"]:
        assert r.call.D == 128 and r.call.seqlens == (4096,) * 4
    for r in by["gqa"]:  # the GQA row: 16 query heads over 4 KV heads, against the same call without GQA
        assert r.call == replace(r.base, groups=4) and r.base.groups == 1 and r.sdpa.groups == 1
        assert (r.call.H, r.call.kv_heads) == (16, 4) and r.goal is None
        assert feat.label(r.call) == "B=4 S=4k GQA 16/4" and feat.label(r.other("fa4")) == "B=4 S=4k GQA 16/4 [fa4]"
    assert by["softcap"][0].call.softcap == 50.0 and by["alibi"][0].call.alibi
    for r in by["sinks"]:
        assert r.call == replace(r.base, sinks=True) and not r.base.sinks and not r.sdpa.sinks
        assert r.goal == 0.97 and feat.label(r.call) == "B=4 S=4k sinks"
        assert feat.label(r.other("fa4")) == "B=4 S=4k sinks [fa4]"
    assert [(r.call.causal, r.call.mode) for r in by["sinks"]] == [(False, "fwd"), (False, "bwd"), (True, "fwd"),
                                                                   (True, "bwd")]
    for r in by["dropout"]:
        assert r.call.dropout == 0.1 and r.call.seqlens == (4096,) * 4 and r.base.dropout == 0.0
        assert r.goal == pytest.approx(1 / 1.1)
    assert not feat.build_rows([64], [0], ["fwd"])[0].feature == "window"
    # every distinct call once: 4 window rows -> 12 calls, ...; dropout at D 128 shares the
    # softcap rows' plain calls; the sinks and gqa rows add only their 4 feature calls each (plain and SDPA shared)
    assert len(feat.distinct_calls(rows)) == 84
    assert len(feat.distinct_calls(rows, ["fa4"])) == 84 + 44
    assert not any(r.feature == "sinks" for r in feat.build_rows([64], [0, 1], ["fwd"]))


def test_table_and_csv(feat):
    rows = feat.build_rows([128], [1], ["fwd"])
    w = rows[0]
    results = {w.call: {"ms": 1.0, "tflops": 300.0, "peak_gib": 0.1, "status": "ok"},
               w.base: {"ms": 0.75, "tflops": 400.0, "peak_gib": 0.1, "status": "ok"},
               w.sdpa: {"status": "unsupported: no"}}
    table = "\n".join(feat.markdown_table(rows, results))
    assert ("| window | 128 | 1 | fwd | B=1 S=16k window (1024, 0) | 300.0 | B=1 S=16k | 400.0 "
            "| 0.75 | >= 0.85 NO | n/s |") in table
    assert "|---|---:|---:|---|---|---:|---|---:|---:|---|---:|" in table
    assert "- B=1 S=16k [sdpa] (1x): unsupported: no" in table
    csv = feat.csv_frame([w], results, torch.bfloat16)
    assert list(csv.columns) == feat.CSV_COLUMNS and len(csv) == 1
    first = csv.iloc[0]
    assert first.feature == "window" and first.ratio == "0.750" and first.goal == "0.85"
    assert first.baseline_tflops == "400.0" and first.ms == "1.0000" and first.sdpa_tflops == ""
    assert first.visible_pairs == feat.visible_pairs(16384, 16384, 1024, 0)
    assert first.window_left == 1024 and first.window_right == 0 and first["dtype"] == "bfloat16"
    assert first.layout == "dense" and first.seqlens == "16384x1"
    assert first.sinks == 0 and first.H == 16 and first.kv_heads == 16


def test_flash_cuda_gets_sinks(feat, monkeypatch):
    """flash_cuda's sinks call passes sink_logits(H) as sinks=, float32 on the device and not requiring grad (the
    backward times dq / dk / dv only); the plain call passes no sinks."""
    M, seen = feat.M, []

    class Fake:
        def attention(self, q, k, v, **opts):
            seen.append(opts)
            return q
    monkeypatch.setattr(M, "load_flash_cuda", lambda: Fake())
    q = torch.randn(1, 3, 8, 16)
    for sinks in (True, False):
        M.make_fn(M.Call("flash_cuda", 16, 3, True, "bwd", (8,), sinks=sinks), None, q.device, torch.bfloat16)(q, q, q)
    sinks = seen[0].pop("sinks")
    assert torch.equal(sinks, M.sink_logits(3)) and seen[0] == seen[1] == {"is_causal": True}
    assert sinks.dtype == torch.float32 and sinks.device == q.device and not sinks.requires_grad


def test_table_and_csv_sinks_row(feat):
    """The sinks row: its label, goal 0.97 and the sinks column; SDPA with sinks is n/s with its reason."""
    rows = [r for r in feat.build_rows([128], [0], ["fwd"]) if r.feature == "sinks"]
    assert len(rows) == 1
    s = rows[0]
    results = {s.call: {"ms": 1.0, "tflops": 388.0, "peak_gib": 0.1, "status": "ok"},
               s.base: {"ms": 0.75, "tflops": 400.0, "peak_gib": 0.1, "status": "ok"},
               s.sdpa: {"ms": 2.0, "tflops": 200.0, "peak_gib": 0.1, "status": "ok"}}
    table = "\n".join(feat.markdown_table(rows, results))
    assert "| sinks | 128 | 0 | fwd | B=4 S=4k sinks | 388.0 | B=4 S=4k | 400.0 | 0.97 | >= 0.97 yes | 200.0 |" in table
    # SDPA on a sinks call (the table's SDPA column is on the vs call): unsupported, the reason as the status
    M = feat.M
    sdpa_sinks = M.Call("sdpa", 16, 2, False, "bwd", (8,) * 2, sinks=True)
    r = M.measure(sdpa_sinks, M.make_inputs(sdpa_sinks, torch.float32, 0, "cpu"), 1.0, torch.float32, None)
    assert r == {"status": "unsupported: SDPA has no attention sinks"} and M.status_tag(r["status"]) == "n/s"
    lines = feat.markdown_table([feat.Row("sinks", sdpa_sinks, replace(sdpa_sinks, sinks=False))], {sdpa_sinks: r})
    assert "- B=2 S=8 sinks [sdpa] (1x): unsupported: SDPA has no attention sinks" in lines
    csv = feat.csv_frame(rows, results, torch.bfloat16)
    first = csv.iloc[0]
    assert first.feature == "sinks" and first.sinks == 1 and first.alibi == 0 and first.goal == "0.97"
    assert first.ratio == "0.970" and first.sdpa_tflops == "200.0"


def test_features_dry_run():
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--features", "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "44 rows, 84 timed calls" in proc.stdout
    assert "features.csv" in proc.stdout


def test_features_dry_run_d128_has_sinks():
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--features", "--d", "128", "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    sinks = [ln for ln in lines if ln.startswith("sinks ")]
    assert sinks == [f"sinks         D=128 causal={c} {m:7s} B=4 S=4k sinks  vs  B=4 S=4k"
                     for c in (0, 1) for m in ("fwd", "bwd")]
    # right after the ALiBi row of the same (causal, mode)
    assert all(lines[lines.index(ln) - 1].startswith("alibi ") for ln in sinks)
    assert "30 rows, 50 timed calls" in proc.stdout


_PHILOX = (1234, 8)  # the (seed, offset) the stand-in draws dropout with, as the bench reads it


class _FakeFlash:
    """flash_cuda stand-in on CPU built on flash_cuda.reference; `broken` drops the window,
    softcap, ALiBi and dropout options (the check must then say WRONG)."""

    def __init__(self, ref, broken=False):
        self.ref, self.broken = ref, broken

    def _opts(self, opts):
        return {"is_causal": opts.get("is_causal", False)} if self.broken else opts

    def attention(self, q, k, v, **opts):
        opts = self._opts(opts)
        if opts.get("dropout_p"):
            B, H, S, _ = q.shape
            opts["dropout_mask"] = self.ref.dropout_keep_mask(B, H, S, S, opts["dropout_p"], *_PHILOX)
        return self.ref.attention_naive(q, k, v, **opts)[0]

    def varlen_attention(self, q, k, v, cu_q, cu_k, max_q, max_k, **opts):
        return self.ref.attention_varlen_naive(q, k, v, cu_q, cu_k, **self._opts(opts))[0]


@pytest.mark.parametrize("broken", [False, True])
def test_features_end_to_end_on_cpu(feat, monkeypatch, tmp_path, capsys, broken):
    """The whole --features driver on small CPU shapes: inputs (dense and packed), the
    check against the reference on the last sequence, the table and the CSV."""
    import argparse
    sys.path.append(str(ROOT))
    ref = pytest.importorskip("flash_cuda.reference")
    M = feat.M
    monkeypatch.setattr(M, "TOKENS", 128)
    monkeypatch.setattr(M, "HIDDEN", 64)
    monkeypatch.setattr(feat, "WINDOW_S", 64)
    monkeypatch.setattr(feat, "WINDOW", (9, 0))
    monkeypatch.setattr(feat, "VARLEN_B", 3)
    monkeypatch.setattr(feat, "VARLEN_S", 24)
    monkeypatch.setattr(feat, "MIXED_RANGE", (5, 40))
    monkeypatch.setattr(feat, "SMALL_S", 32)
    monkeypatch.setattr(feat, "SMALL_D", 32)
    monkeypatch.setattr(feat, "SOFTCAP", 1.0)  # 50 barely moves N(0, 1) logits
    monkeypatch.setattr(feat, "GQA_GROUPS", 2)  # H = 2 here: both query heads over one KV head
    monkeypatch.setattr(M, "load_flash_cuda", lambda: _FakeFlash(ref, broken))
    monkeypatch.setattr(feat, "DROPOUT_S", 32)
    monkeypatch.setattr(feat, "DROPOUT_P", 0.3)
    monkeypatch.setattr(M, "next_philox", lambda device: _PHILOX)

    def fake_time_call(fwd, q, k, v, dout, mode, timer):
        out = fwd(q, k, v)
        if mode != "fwd":
            out.backward(dout)
        return 2.0, 0.0
    monkeypatch.setattr(M, "time_call", fake_time_call)
    rows = feat.build_rows([32], [1], ["fwd", "bwd"])
    args = argparse.Namespace(no_check=False, seed=0, out_dirs={torch.float32: tmp_path})
    env = {"gpu": "none (CPU test)", "git commit": "abc1234"}
    results = feat.run_features(args, rows, torch.float32, None, env, device="cpu")
    for row in rows:
        for call in (row.base, row.sdpa):
            assert results[call]["status"] == "ok", (call, results[call])
        r = results[row.call]
        if broken and row.feature in ("window", "softcap", "alibi", "sinks", "dropout"):
            assert r["status"].startswith("WRONG"), (row.call, r)
        else:
            assert r["status"] == "ok", (row.call, r)
            assert r["tflops"] == pytest.approx(feat.flops(row.call) / 2.0e-3 / 1e12)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("varlen mixed lengths") or broken
    csv = (tmp_path / "features.csv").read_text()
    assert csv.startswith("# gpu: none (CPU test)\n# git commit: abc1234\nfeature,dtype,D,")
    assert csv.count("\n") == len(env) + 1 + len(rows)
    md = (tmp_path / "features.md").read_text()
    assert "| window | 32 | 1 | fwd | B=2 S=64 window (9, 0) |" in md
    assert "gpu: none (CPU test)" in md and "git commit: abc1234" in md


def test_features_fa4_on_cpu(feat, monkeypatch, tmp_path, capsys):
    """--features --providers fa4 with a stand-in flash_attn.cute: FA4 on each feature call (window, softcap, sinks as
    learnable_sink, varlen through its own layouts and keywords; ALiBi and dropout unsupported, with the reason), its
    column and fc/fa4."""
    import argparse
    import fake_fa4
    sys.path.append(str(ROOT))
    ref = pytest.importorskip("flash_cuda.reference")
    M = feat.M
    calls = []
    fake_fa4.install(monkeypatch, fake_fa4.make_module(calls=calls))
    for name, value in (("TOKENS", 128), ("HIDDEN", 64)):
        monkeypatch.setattr(M, name, value)
    for name, value in (("WINDOW_S", 64), ("WINDOW", (9, 0)), ("VARLEN_B", 3), ("VARLEN_S", 24),
                        ("MIXED_RANGE", (5, 40)), ("SMALL_S", 32), ("SMALL_D", 32), ("SOFTCAP", 1.0),
                        ("DROPOUT_S", 32), ("GQA_GROUPS", 2)):
        monkeypatch.setattr(feat, name, value)
    monkeypatch.setattr(M, "load_flash_cuda", lambda: _FakeFlash(ref))
    monkeypatch.setattr(M, "next_philox", lambda device: _PHILOX)
    monkeypatch.setattr(M, "time_call", lambda fwd, q, k, v, dout, mode, timer: (
        1.0 if q.dim() == 4 and q.shape[1] > q.shape[2] else 2.0, 0.0))  # FA4's dense (B, S, H, D): 1 ms
    rows = feat.build_rows([32], [1], ["fwd", "bwd"])
    args = argparse.Namespace(no_check=False, seed=0, out_dirs={torch.bfloat16: tmp_path}, providers=["fa4"])
    results = feat.run_features(args, rows, torch.bfloat16, None, {"gpu": "none (CPU test)"}, device="cpu")
    for row in rows:
        r = results[row.other("fa4")]
        if row.feature in ("alibi", "dropout"):
            name = "ALiBi" if row.feature == "alibi" else "dropout"
            assert r["status"] == f"unsupported: FlashAttention-4 has no {name}"
        else:
            assert r["status"] == "ok", (row.call, r)
    kw = {c[0]: c[3] for c in calls}
    assert set(kw) == {"flash_attn_func", "flash_attn_varlen_func"}
    assert any(c[3]["window_size"] == (9, 0) and c[3]["causal"] for c in calls)
    assert any(c[3]["softcap"] == 1.0 for c in calls)
    sunk = [c for c in calls if "learnable_sink" in c[3]]
    assert sunk and all(c[0] == "flash_attn_func" and c[1] == (4, 32, 2, 32) for c in sunk)
    for c in sunk:  # float32 (H,) on q's device, the same logits as flash_cuda's; no d(sinks) asked for
        sink = c[3]["learnable_sink"]
        assert sink.dtype == torch.float32 and torch.equal(sink, M.sink_logits(2)) and not sink.requires_grad
    assert all(c[2] for c in calls) and {c[1] for c in calls if c[0] == "flash_attn_func"} == {(2, 64, 2, 32),
                                                                                            (4, 32, 2, 32)}
    table = "\n".join(feat.markdown_table(rows, results, ["fa4"]))
    assert "| SDPA default (vs call) | fa4 (same call) | fc/fa4 |" in table.splitlines()[0]
    assert "| window | 32 | 1 | fwd | B=2 S=64 window (9, 0) | " in table
    window = next(line for line in table.splitlines() if line.startswith("| window | 32 | 1 | fwd |"))
    assert window.endswith("| 0.50 |")  # fc 2 ms, FA4 1 ms on the same call
    assert next(line for line in table.splitlines() if line.startswith("| alibi |")).endswith("| n/s |  |")
    assert next(line for line in table.splitlines() if line.startswith("| sinks |")).endswith("| 0.50 |")
    assert "- B=4 S=32 alibi [fa4] (2x): unsupported: FlashAttention-4 has no ALiBi" in table
    csv = (tmp_path / "features.csv").read_text().splitlines()
    assert csv[1].endswith(",sdpa_tflops,fa4_tflops")
    assert csv[2].startswith("window,") and csv[2].split(",")[-1] != ""


def test_features_without_fa4_skip_it(feat, monkeypatch, capsys):
    import argparse
    import fake_fa4
    fake_fa4.install(monkeypatch, None)
    rows = feat.build_rows([128], [1], ["fwd"])
    calls = feat.distinct_calls(rows, ["fa4"])
    results = feat.M.measure_all({c: feat.flops(c) for c in calls if c.provider == "fa4"}, torch.bfloat16, None, 0,
                                 True, device="cpu")
    assert {r["status"] for r in results.values()} == {
        "skipped: flash_attn.cute is not importable (ModuleNotFoundError: import of flash_attn.cute halted; None in "
        "sys.modules; pip install flash-attn-4)"}
    assert feat.others(argparse.Namespace(providers=["flash_cuda", "fa4"])) == ["fa4"]
    assert feat.others(argparse.Namespace(providers=None)) == [] and feat.others(argparse.Namespace()) == []


def test_check_gqa_heads(feat):
    """The check of a GQA call compares each KV head's query heads with the reference: a kernel that pairs query
    head h with KV head h % kv_heads (interleaved) instead of h // groups is WRONG, in the output and in dk / dv."""
    sys.path.append(str(ROOT))
    ref = pytest.importorskip("flash_cuda.reference")
    M = feat.M
    call = M.Call("flash_cuda", 16, 4, True, "bwd", (24, 24), groups=2)
    assert call.kv_heads == 2
    q, k, v, dout, cu = M.make_inputs(call, torch.float32, 0, device="cpu")
    assert q.shape == dout.shape == (2, 4, 24, 16) and k.shape == v.shape == (2, 2, 24, 16)

    def grouped(q, k, v):
        return ref.attention_naive(q, k, v, is_causal=True)[0]

    def interleaved(q, k, v):
        idx = torch.arange(q.shape[1]) % k.shape[1]
        return ref.attention_naive(q, k.index_select(1, idx), v.index_select(1, idx), is_causal=True)[0]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert M.check(call, grouped, *leaves, dout, cu, torch.float32) == "ok"
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    assert M.check(call, interleaved, *leaves, dout, cu, torch.float32).startswith("WRONG")
