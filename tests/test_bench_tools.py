"""CPU-only tests of the benchmark tools: the ncu CSV summariser (bench/ncu_summary.py) on a
synthetic report, the shared helpers (bench/common.py: sizes, tables, CSV stamp), and the
CPU side of bench/run.py (grid, tables, anchor join, plots, --dry-run) / bench/ncu_profile.py."""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


def _load(name: str, path: Path):
    """Import a script by path (bench/ is not a package). Registered in sys.modules before
    running it, as dataclasses need."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def common():
    return _load("flash_cuda_bench_common", BENCH / "common.py")


@pytest.fixture(scope="module")
def ncu():
    return _load("flash_cuda_bench_ncu_summary", BENCH / "ncu_summary.py")


@pytest.fixture(scope="module")
def run():
    pytest.importorskip("torch")
    return _load("flash_cuda_bench_run", BENCH / "run.py")


# ---------------------------------------------------------------------------------------
# Synthetic ncu CSV, raw page: header of metric names, a units row, one row per launch.
# Launches 0 and 2 are the same forward kernel (merged, median), launch 1 a small kernel.
# ---------------------------------------------------------------------------------------

RAW_HEADER = [
    "ID", "Process ID", "Process Name", "Host Name",
    "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg",
    "Kernel Name", "Context", "Stream", "Block Size", "Grid Size", "Device", "CC",
    "gpu__time_duration.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_static",
    "launch__shared_mem_per_block_dynamic",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes.sum.per_second",
    "lts__t_sector_hit_rate.pct",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
]
RAW_UNITS = ["", "", "", "", "", "", "", "", "", "", "", "",
             "msecond", "%", "register/thread", "Kbyte", "byte", "%", "%", "Tbyte/second", "%",
             "inst", "inst", "inst", "inst", "inst"]
FWD_NAME = ("void flash_cuda::fwd_mma_kernel<(flash_cuda::DType)2, 128, 64>"
            "(flash_cuda::FwdParams)")
PRE_NAME = ("void flash_cuda::(anonymous namespace)::bwd_preprocess_kernel<128>"
            "(flash_cuda::BwdParams)")


def _row(i, name, grid, values):
    return [str(i), "4242", "python", "h200", "flash_cuda", name, "1", "7", "(128, 1, 1)",
            grid, "0", "9.0"] + values


RAW_ROWS = [
    _row(0, FWD_NAME, "(32, 16, 4)",
         ["1.50", "24.80", "168", "0", "49,152", "61.20", "12.50", "0.60", "70.10",
          "0.90", "2.10", "1.30", "1.00", "0.40"]),
    _row(1, PRE_NAME, "(64, 16, 4)",
         ["0.012", "80.00", "32", "0.50", "0", "0.00", "75.00", "3.20", "n/a",
          "0.10", "5.00", "0.00", "1.00", "0.70"]),
    _row(2, FWD_NAME, "(32, 16, 4)",
         ["1.70", "25.20", "168", "0", "49,152", "63.20", "13.50", "0.62", "71.10",
          "1.10", "2.30", "1.10", "1.00", "0.60"]),
]


def _csv_text(rows, prefix="==PROF== Connected to process 4242\n"):
    import csv
    import io
    buf = io.StringIO()
    writer = csv.writer(buf, quoting=csv.QUOTE_ALL)
    for row in rows:
        writer.writerow(row)
    return prefix + buf.getvalue()


RAW_CSV = _csv_text([RAW_HEADER, RAW_UNITS] + RAW_ROWS)


def test_raw_csv_reads_launches_and_units(ncu):
    long = ncu.read_ncu_csv(RAW_CSV)
    assert list(long.drop_duplicates("id").id) == ["0", "1", "2"]
    dur = long[(long.id == "0") & (long.metric == "gpu__time_duration.sum")].iloc[0]
    assert dur["name"] == FWD_NAME and dur.grid == "(32, 16, 4)"
    assert (dur.value, dur.unit, dur.kind) == ("1.50", "msecond", "time")
    assert dur.number * dur.scale == pytest.approx(1.5e-3)
    smem = long[(long.id == "0") & (long.metric == "launch__shared_mem_per_block_dynamic")]
    assert smem.number.iat[0] == 49152  # thousands separator
    # identity columns are not metrics; the NVTX column is one (non-numeric)
    assert not long.metric.isin(["Process ID", "Kernel Name", "Grid Size"]).any()


def test_raw_csv_summary_numbers(ncu):
    groups = ncu.summarize_csv_text(RAW_CSV)
    assert len(groups) == 2
    fwd, pre = groups
    assert fwd["launches"] == 2 and pre["launches"] == 1
    # medians over the two launches of the forward kernel
    assert fwd["duration_us"] == pytest.approx(1600.0)
    assert fwd["occupancy_pct"] == pytest.approx(25.0)
    assert fwd["registers"] == 168
    assert fwd["smem_b"] == pytest.approx(49152.0)
    assert fwd["tensor_pipe_pct"] == pytest.approx(62.2)
    assert fwd["dram_pct"] == pytest.approx(13.0)
    assert fwd["dram_gbs"] == pytest.approx(610.0)  # 0.61 Tbyte/s
    assert fwd["l2_hit_pct"] == pytest.approx(70.6)
    # stalls: long_scoreboard 2.2 > math_pipe_throttle 1.2 > barrier 1.0; "selected" is not
    # a stall and is left out
    assert [k for k, _ in fwd["stalls"]] == ["long_scoreboard", "math_pipe_throttle", "barrier"]
    assert fwd["stalls"][0][1] == pytest.approx(2.2)
    # the small kernel: 0.012 ms = 12 us, static smem 0.5 Kbyte = 500 bytes, L2 hit missing
    assert pre["duration_us"] == pytest.approx(12.0)
    assert pre["smem_b"] == pytest.approx(500.0)
    assert pre["l2_hit_pct"] is None
    assert pre["dram_gbs"] == pytest.approx(3200.0)
    assert [k for k, _ in pre["stalls"]] == ["long_scoreboard", "wait", "barrier"]


def test_per_launch_keeps_launches_apart(ncu):
    rows = ncu.summarize_csv_text(RAW_CSV, per_launch=True)
    assert [r["duration_us"] for r in rows] == pytest.approx([1500.0, 12.0, 1700.0])


def test_missing_metrics_print_na(ncu):
    header = RAW_HEADER[:12] + ["gpu__time_duration.sum"]
    units = [""] * 12 + ["usecond"]
    row = _row(0, FWD_NAME, "(1, 1, 1)", ["3.5"])
    groups = ncu.summarize_csv_text(_csv_text([header, units, row], prefix=""))
    g = groups[0]
    assert g["duration_us"] == pytest.approx(3.5)
    for field in ("occupancy_pct", "registers", "smem_b", "tensor_pipe_pct", "dram_pct",
                  "dram_gbs", "l2_hit_pct"):
        assert g[field] is None
    assert g["stalls"] == []
    text = ncu.format_summary(groups)
    assert "3.5 us" in text and "n/a" in text


def test_instructions_and_issue_slots(ncu):
    """Instructions executed (millions, whatever prefix ncu's unit has) and issue-slot use."""
    header = RAW_HEADER[:12] + ["gpu__time_duration.sum", "smsp__inst_executed.sum",
                                "smsp__issue_active.avg.pct_of_peak_sustained_active"]
    units = [""] * 12 + ["usecond", "Minst", "%"]
    g = ncu.summarize_csv_text(_csv_text([header, units, _row(0, FWD_NAME, "(1, 1, 1)", ["3.5", "812.5", "41.0"])],
                                         prefix=""))[0]
    assert g["inst_m"] == pytest.approx(812.5) and g["issue_pct"] == pytest.approx(41.0)
    assert "812.5 M" in ncu.format_summary([g])


def test_l2_reads_per_dram_sector(ncu):
    """The SMs' L2 read sectors over DRAM's read sectors: 1.5x where each sector is asked for 1.5 times;
    n/a without a DRAM read (no division by zero)."""
    header = RAW_HEADER[:12] + ["gpu__time_duration.sum", "lts__t_sectors_srcunit_tex_op_read.sum",
                                "dram__sectors_read.sum"]
    units = [""] * 12 + ["usecond", "sector", "sector"]
    rows = [_row(0, FWD_NAME, "(1, 1, 1)", ["3.5", "402,700,000", "268,466,667"]),
            _row(1, PRE_NAME, "(1, 1, 1)", ["1.0", "1,000", "0"])]
    fwd, pre = ncu.summarize_csv_text(_csv_text([header, units] + rows, prefix=""))
    assert fwd["l2_reads_per_dram"] == pytest.approx(1.5, rel=1e-6)
    assert pre["l2_reads_per_dram"] is None
    text = ncu.format_summary([fwd, pre])
    assert "L2 reads / DRAM" in text and "1.50x" in text


def test_alternative_metric_names(ncu):
    """Fallback candidates: pcsamp stall counts, tensor pipe _v2 spelling, nsecond."""
    header = RAW_HEADER[:12] + [
        "gpu__time_duration.sum",
        "sm__pipe_tensor_cycles_active_v2.avg.pct_of_peak_sustained_active",
        "smsp__pcsamp_warps_issue_stalled_barrier",
        "smsp__pcsamp_warps_issue_stalled_barrier_not_issued",
        "smsp__pcsamp_warps_issue_stalled_long_scoreboard",
        "smsp__pcsamp_warps_issue_stalled_selected",
        "smsp__pcsamp_warps_issue_stalled_short_scoreboard",
        "smsp__pcsamp_warps_issue_stalled_wait",
    ]
    units = [""] * 12 + ["nsecond", "%", "", "", "", "", "", ""]
    row = _row(0, FWD_NAME, "(1, 1, 1)",
               ["2,500", "40.0", "300", "999", "500", "100", "50", "50"])
    g = ncu.summarize_csv_text(_csv_text([header, units, row], prefix=""))[0]
    assert g["duration_us"] == pytest.approx(2.5)
    assert g["tensor_pipe_pct"] == pytest.approx(40.0)
    # percentages of all samples (1000), selected excluded from the ranking, _not_issued ignored
    assert g["stall_unit"] == "% of samples"
    assert g["stalls"] == [("long_scoreboard", pytest.approx(50.0)),
                           ("barrier", pytest.approx(30.0)),
                           ("short_scoreboard", pytest.approx(5.0))]


def test_units(ncu):
    assert ncu.unit_scale("msecond") == ("time", 1e-3)
    assert ncu.unit_scale("nsecond") == ("time", 1e-9)
    assert ncu.unit_scale("Kbyte") == ("bytes", 1e3)  # ncu's K is decimal
    assert ncu.unit_scale("KiB") == ("bytes", 1024.0)
    assert ncu.unit_scale("Kbyte/block") == ("bytes", 1e3)
    assert ncu.unit_scale("byte") == ("bytes", 1.0)
    assert ncu.unit_scale("Tbyte/second") == ("rate", 1e12)
    assert ncu.unit_scale("inst") == ("inst", 1.0)
    assert ncu.unit_scale("Minst") == ("inst", 1e6)
    assert ncu.unit_scale("Gbyte/s") == ("rate", 1e9)
    kind, scale = ncu.unit_scale("byte/usecond")
    assert kind == "rate" and scale == pytest.approx(1e6)
    assert ncu.unit_scale("%") == ("%", 1.0)
    assert ncu.unit_scale("register/thread") == ("other", 1.0)
    assert ncu.unit_scale("") == ("", 1.0)


def test_short_kernel_name(ncu):
    assert ncu.short_kernel_name(FWD_NAME) == "fwd_mma_kernel<(DType)2, 128, 64>"
    assert ncu.short_kernel_name(PRE_NAME) == "bwd_preprocess_kernel<128>"
    assert ncu.short_kernel_name("plain_kernel") == "plain_kernel"
    assert len(ncu.short_kernel_name("k" * 200, width=40)) == 40


def test_cli_csv_in(ncu, tmp_path, capsys):
    path = tmp_path / "report.csv"
    path.write_text(RAW_CSV)
    assert ncu.main(["--csv-in", str(path)]) == 0
    out = capsys.readouterr().out
    assert "fwd_mma_kernel<(DType)2, 128, 64>" in out
    assert "1.600 ms" in out
    assert "long_scoreboard 2.20" in out
    assert "48.0 KiB" in out
    # a .csv given as the positional argument works the same
    assert ncu.main([str(path), "--json"]) == 0
    assert '"duration_us": 1600.0' in capsys.readouterr().out


def test_no_header_is_an_error(ncu, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("==ERROR== nothing profiled\n")
    assert ncu.main(["--csv-in", str(path)]) == 2


def test_saved_csv_with_stamp_reads_back(ncu, tmp_path, capsys):
    """--save-csv puts '# key: value' lines above ncu's export; reading it back skips them."""
    path = tmp_path / "saved.csv"
    path.write_text("# gpu: NVIDIA H100\n# git commit: abc1234\n" + RAW_CSV)
    assert ncu.main(["--csv-in", str(path)]) == 0
    assert "1.600 ms" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# bench/run.py and bench/ncu_profile.py (CPU: helpers, --help, --dry-run)
# ---------------------------------------------------------------------------------------

def test_flops_formula(run):
    # FlashAttention convention: fwd = 4*B*H*S*S*D, halved when causal; bwd 2.5x, fwd_bwd 3.5x
    B, H, S, D = 4, 8, 1024, 64
    fwd = 4 * B * H * S * S * D
    assert run.M.attention_flops(B, H, S, S, D, False, "fwd") == fwd
    assert run.M.attention_flops(B, H, S, S, D, True, "fwd") == fwd / 2
    assert run.M.attention_flops(B, H, S, S, D, False, "bwd") == 2.5 * fwd
    assert run.M.attention_flops(B, H, S, S, D, True, "fwd_bwd") == 3.5 * fwd / 2
    # anchor check: sdpa_cudnn bf16 D=64 S=16384 B=1 H=32 fwd 4.7510 ms -> 462.9 TFLOPS
    flops = run.M.attention_flops(1, 32, 16384, 16384, 64, False, "fwd")
    assert flops / 4.7510e-3 / 1e12 == pytest.approx(462.9, abs=0.1)


def test_sizes(common):
    assert common.parse_size("4k") == 4096 and common.parse_size("16K") == 16384
    assert common.parse_size("512") == 512 and common.parse_size(" 1024 ") == 1024
    with pytest.raises(Exception, match="not a size"):
        common.parse_size("4m")
    assert common.fmt_size(4096) == "4k" and common.fmt_size(512) == "512"
    assert common.fmt_size(1536) == "1536"


def test_grid_and_shapes(run):
    grid = run.build_grid(run.DEFAULT_D, run.DEFAULT_CAUSAL, run.MODES, run.DEFAULT_SEQLENS)
    assert len(grid) == 2 * 2 * 3 * 6 and list(grid.columns) == run.GRID_KEYS
    assert ((grid.B * grid.S == 16384) & (grid.H * grid.D == 2048)).all()
    # output order: D, causal, mode, then S
    assert list(grid.S[:6]) == run.DEFAULT_SEQLENS and list(grid["mode"][:13:6]) == run.MODES
    assert list(grid.D.unique()) == [64, 128]
    forced = run.build_grid([64, 128], [1], ["fwd"], [2048], batch=2)
    assert list(zip(forced.B, forced.H)) == [(2, 32), (2, 16)]
    assert list(run.build_grid([64], [1], ["fwd"], [4096], heads=8).H) == [8]
    assert run.shape_text(grid) == "B*S=16384, H*D=2048" and run.shape_text(forced) == "B, H vary"
    assert run.shape_text(forced[forced.D == 64]) == "B=2, H=32"


def test_parse_args_sizes_and_defaults(run):
    args = run.parse_args(["--seqlen", "4k", "512", "--quick"])
    assert args.seqlens == [4096, 512] and args.budget_ms == (10.0, 30.0)
    args = run.parse_args([])
    assert args.seqlens == run.DEFAULT_SEQLENS and args.budget_ms == (25.0, 100.0)
    args = run.parse_args(["--dtype", "bf16", "bf16", "fp32", "--out", "o"])
    assert args.dtype == ["bf16", "fp32"]
    assert [str(p) for p in args.out_dirs.values()] == ["o/bf16", "o/fp32"]
    assert run.parse_args(["--features"]).mode == ["fwd", "bwd"]
    with pytest.raises(SystemExit):
        run.parse_args(["--d", "100"])
    with pytest.raises(SystemExit):
        run.parse_args(["--seqlen", "4x"])


def test_classify_error(run):
    import torch
    assert run.M.classify_error(run.M.Unavailable("unavailable: no GPU")) == "unavailable: no GPU"
    assert run.M.classify_error(torch.cuda.OutOfMemoryError("CUDA out of memory.")) == "OOM"
    assert run.M.classify_error(RuntimeError("No available kernel. Aborting execution.\nmore")) == (
        "unsupported: No available kernel. Aborting execution.")
    assert run.M.classify_error(ValueError("head dim 72 " + "x" * 200)).startswith("unsupported: head dim 72 x")
    assert len(run.M.classify_error(ValueError("x" * 200))) == len("unsupported: ") + 80
    assert run.M.classify_error(KeyError("k")) == "error: KeyError: 'k'"


def test_default_providers_follow_dtype(run):
    import torch
    bf16 = run.default_providers(torch.bfloat16)
    fp32 = run.default_providers(torch.float32)
    assert "flash_cuda_mma" in bf16 and "flash_cuda_simt" not in bf16
    assert "flash_cuda_simt" in fp32 and "flash_cuda_mma" not in fp32
    assert bf16[0] == "flash_cuda" and bf16[2:] == ["sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"]


def test_math_backend_memory_skip(run):
    # SDPA's math backend at S=16k, D=64 (B=1, H=32) backward needs far more than 40 GiB, the others nothing
    assert run.math_backend_gib("sdpa_math", 1, 32, 16384, "bwd") > 40
    assert run.math_backend_gib("sdpa_math", 16, 32, 1024, "bwd") < 40
    assert run.math_backend_gib("sdpa_math", 1, 32, 16384, "fwd") < run.math_backend_gib("sdpa_math", 1, 32, 16384,
                                                                                          "bwd")
    assert run.math_backend_gib("flash_cuda", 1, 32, 16384, "bwd") == 0


def _results(run):
    """A small result frame: one config, four providers, two of them without a number."""
    import pandas as pd
    cfg = dict(workload="tokens", D=64, causal=1, mode="fwd", S=4096, B=4, H=32, dtype="bfloat16")
    rows = [("flash_cuda", 1.0, 300.0, 0.1, "ok"), ("sdpa", 0.8, 400.0, 0.1, "ok"),
            ("sdpa_flash", None, None, None, "unsupported: fp32"),
            ("sdpa_math", None, None, None, "WRONG (out rel err 0.5 > 0.02)")]
    return pd.DataFrame([{**cfg, "provider": p, "ms": ms, "tflops": t, "peak_gib": g,
                          "status": s} for p, ms, t, g, s in rows])


def test_grid_table(run):
    table = "\n".join(run.grid_table(_results(run)))
    assert table.splitlines()[0] == ("| D | causal | mode | S | B | H | flash_cuda | sdpa | "
                                     "sdpa_flash | sdpa_math | fc/sdpa | fc/flash | fc/math |")
    assert "| 64 | 1 | fwd | 4k | 4 | 32 | 300.0 | 400.0 | n/s | WRONG | 0.75 |  |  |" in table
    assert "- sdpa_math: WRONG (out rel err 0.5 > 0.02) (1 config)" in table


def test_csv_carries_environment(run, common, tmp_path):
    import pandas as pd
    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "git commit": "abc1234+dirty"}
    path = tmp_path / "results.csv"
    common.write_csv(run.csv_frame(_results(run)), path, env)
    text = path.read_text()
    assert text.startswith("# gpu: NVIDIA H100 80GB HBM3\n# torch: 2.11.0\n"
                           "# git commit: abc1234+dirty\n" + ",".join(run.CSV_COLUMNS) + "\n")
    assert "flash_cuda,bfloat16,64,1,4096,4,32,fwd,1.0000,300.0,0.100,ok" in text
    back = pd.read_csv(path, comment="#")
    assert list(back.columns) == run.CSV_COLUMNS and len(back) == 4
    assert back.status[2] == "unsupported: fp32" and back.ms.isna()[2]


def test_git_commit_format(common):
    import re
    commit = common.git_commit()
    assert re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", commit) or commit.startswith("unknown")


def test_source_digest_names_the_code(common, tmp_path):
    """The digest follows the sources' paths and bytes (csrc/, flash_cuda/, bench/*.py) and nothing
    else; the checkout's own is 12 hex digits, the same each time, and `--digest` prints it."""
    import re
    for rel, text in (("csrc/core/a.cuh", "int a;"), ("flash_cuda/b.py", "b = 1"), ("bench/c.py", "c = 1"),
                      ("csrc/notes.md", "words"), ("tests/t.py", "t = 1")):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    base = common.source_digest(tmp_path)
    (tmp_path / "csrc/notes.md").write_text("other words")
    (tmp_path / "tests/t.py").write_text("t = 2")
    assert common.source_digest(tmp_path) == base
    for rel in ("csrc/core/a.cuh", "flash_cuda/b.py", "bench/c.py"):
        before = (tmp_path / rel).read_text()
        (tmp_path / rel).write_text(before + " ")
        assert common.source_digest(tmp_path) != base, rel
        (tmp_path / rel).write_text(before)
    (tmp_path / "flash_cuda/b.py").rename(tmp_path / "flash_cuda/b2.py")
    assert common.source_digest(tmp_path) != base
    mine = common.source_digest()
    assert re.fullmatch(r"[0-9a-f]{12}", mine) and common.source_digest() == mine
    proc = subprocess.run([sys.executable, str(BENCH / "common.py"), "--digest"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == mine, proc.stderr


def test_markdown_writer(common):
    import pandas as pd
    df = pd.DataFrame({"name": ["a", None], "x": [1.5, float("nan")], "n": [3, 4]})
    assert common.markdown(df, floatfmt=".2f").splitlines() == [
        "| name | x | n |", "|---|---:|---:|", "| a | 1.50 | 3 |", "|  |  | 4 |"]
    assert common.markdown(df, align="---:").splitlines()[1] == "|---:|---:|---:|"


def test_anchor_join(run, tmp_path):
    """Same provider (sdpa <-> sdpa_default) and, for flash_cuda, the best SDPA backend of each
    anchor file; files of another shape and configs of no anchor are left out."""
    head = "provider,dtype,D,causal,S,B,H,mode,ms,tflops,peak_gib\n"
    (tmp_path / "a_h200.csv").write_text(
        "# gpu: H200\n" + head + "sdpa_default,bfloat16,64,1,4096,4,32,fwd,1,500.0,0.3\n"
        "sdpa_flash,bfloat16,64,1,4096,4,32,fwd,1,250.0,0.3\n"
        "sdpa_default,bfloat16,64,1,8192,2,32,fwd,1,999.0,0.3\n")
    (tmp_path / "b_h100.csv").write_text(
        head + "flash_cuda,bfloat16,64,1,4096,4,32,fwd,1,200.0,0.3\n"
        "sdpa_flash,bfloat16,64,1,4096,4,32,fwd,1,160.0,0.3\n")
    (tmp_path / "c_beyond.csv").write_text("case,provider,mode,ms,rate,unit\nx,flash_cuda,fwd,1,2,GB/s\n")
    folder, anchors = run.load_anchors(str(tmp_path))
    assert folder == tmp_path
    assert len(anchors) == 5 and set(anchors.source) == {"a_h200.csv", "b_h100.csv"}
    comp = run.anchor_comparison(_results(run), anchors)
    got = list(zip(comp.provider, comp.anchor, comp.ratio, comp.source))
    assert got == [("flash_cuda", "200.0", "1.50", "b_h100.csv"),
                   ("flash_cuda vs sdpa_default", "500.0", "0.60", "a_h200.csv"),
                   ("flash_cuda vs sdpa_flash", "160.0", "1.88", "b_h100.csv"),
                   ("sdpa vs sdpa_default", "500.0", "0.80", "a_h200.csv")]
    assert list(comp.S) == ["4k"] * 4
    assert run.anchor_comparison(_results(run).assign(S=512), anchors).empty


def test_plots_carry_environment(run, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image
    import pandas as pd
    import torch
    res = pd.concat([_results(run), _results(run).assign(S=8192, B=2,
                                                          tflops=[310.0, 420.0, None, None])])
    env = {"gpu": "NVIDIA H100 80GB HBM3, 132 SMs", "torch": "2.11.0, CUDA 13.0",
           "git commit": "abc1234"}
    paths = run.write_plots(res, tmp_path, torch.bfloat16, env)
    assert [p.name for p in paths] == ["D64_causal1_fwd.png"]
    info = Image.open(paths[0]).info
    assert "gpu: NVIDIA H100 80GB HBM3" in info["Description"]
    assert "git commit: abc1234" in info["Description"]


class _WrongFlash:
    """flash_cuda stand-in on CPU whose output is off by 10% (the check must say WRONG)."""
    __version__ = "test"

    def is_available(self):
        return True

    def attention(self, q, k, v, is_causal=False, **_):
        import torch.nn.functional as F
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal) * 1.1


def test_grid_end_to_end_on_cpu(run, monkeypatch, tmp_path, capsys):
    """run_grid on small CPU shapes (inputs, reference check, the O(S^2) skip, statuses), then report(): table,
    results.csv / results.md with the environment, anchors."""
    import argparse
    import torch
    monkeypatch.setattr(run.M, "load_flash_cuda", lambda: _WrongFlash())
    monkeypatch.setattr(run.M, "time_call", lambda fwd, q, k, v, dout, mode, timer: (2.0, 0.5))
    grid = run.build_grid([16], [0, 1], ["fwd", "bwd"], [64], batch=2, heads=3)
    # SDPA's math backend here: about 2.2e-4 GiB forward, 3.8e-4 backward
    args = argparse.Namespace(no_check=False, seed=0, max_quadratic_gib=3.0e-4, out_dirs={torch.bfloat16: tmp_path},
                              compare_anchors=str(tmp_path), no_plots=True)
    res = run.run_grid(args, grid, ["flash_cuda", "sdpa", "sdpa_math"], torch.bfloat16, None, device="cpu")
    status = dict(zip(zip(res.provider, res.causal, res["mode"]), res.status))
    assert len(res) == 12 and set(res.dtype) == {"bfloat16"}
    for causal in (0, 1):
        for mode in ("fwd", "bwd"):
            assert status[("flash_cuda", causal, mode)].startswith("WRONG (out rel err ")
            assert status[("sdpa", causal, mode)] == "ok"
        assert status[("sdpa_math", causal, "fwd")] == "ok"
        assert status[("sdpa_math", causal, "bwd")].startswith("skipped: O(S^2) memory")
    ok = res[res.status == "ok"]
    flops = [run.M.attention_flops(2, 3, 64, 64, 16, c, m) for c, m in zip(ok.causal, ok["mode"])]
    assert list(ok.tflops) == pytest.approx([f / 2.0e-3 / 1e12 for f in flops])
    (tmp_path / "anchors.csv").write_text("provider,dtype,D,causal,S,B,H,mode,ms,tflops,peak_gib\n"
                                          "sdpa_default,bfloat16,16,0,64,2,3,fwd,1,1e-6,0.1\n")
    env = {"gpu": "none (CPU test)", "torch": torch.__version__, "git commit": "abc1234"}
    run.report(args, res, torch.bfloat16, env, 1.0)
    out = capsys.readouterr().out
    assert "| 16 | 1 | bwd | 64 | 2 | 3 | WRONG | " in out and "sdpa vs sdpa_default" in out
    csv = (tmp_path / "results.csv").read_text().splitlines()
    assert csv[:4] == ["# gpu: none (CPU test)", f"# torch: {torch.__version__}", "# git commit: abc1234",
                       ",".join(run.CSV_COLUMNS)] and len(csv) == 4 + 12
    md = (tmp_path / "results.md").read_text()
    assert md.startswith("# flash_cuda benchmark, bf16, B=2, H=3, 4 configs x 3 providers")
    assert "gpu: none (CPU test)" in md and "Anchors from" in md and "- flash_cuda: WRONG" in md


class _RightFlash(_WrongFlash):
    def attention(self, q, k, v, is_causal=False, **_):
        import torch.nn.functional as F
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _bshd_time_call(fwd, q, k, v, dout, mode, timer):
    """Runs the call; 1 ms on FA4's (B, S, H, D) tensors (S = 64 > H = 3), 2 ms on (B, H, S, D) ones."""
    out = fwd(q, k, v)
    if mode != "fwd":
        out.backward(dout)
    return (1.0 if q.shape[1] > q.shape[2] else 2.0), 0.0


@pytest.mark.parametrize("bshd", [True, False])
def test_fa4_grid_on_cpu(run, monkeypatch, bshd):
    """fa4 through a stand-in flash_attn.cute: contiguous (B, S, H, D) tensors in, the output and gradients
    checked after the transposes back (a stand-in that misreads the layout is WRONG), the fc/fa4 column."""
    import argparse
    import torch
    import fake_fa4
    calls = []
    fake_fa4.install(monkeypatch, fake_fa4.make_module(bshd=bshd, calls=calls))
    monkeypatch.setattr(run.M, "load_flash_cuda", lambda: _RightFlash())
    monkeypatch.setattr(run.M, "time_call", _bshd_time_call)
    grid = run.build_grid([16], [0, 1], ["fwd", "bwd"], [64], batch=2, heads=3)
    args = argparse.Namespace(no_check=False, seed=0, max_quadratic_gib=40.0)
    res = run.run_grid(args, grid, ["flash_cuda", "fa4", "sdpa_cudnn"], torch.bfloat16, None, device="cpu")
    fa4 = res[res.provider == "fa4"]
    if not bshd:
        assert all(s.startswith("WRONG (out rel err") for s in fa4.status), list(fa4.status)
        return
    assert list(res[res.provider != "sdpa_cudnn"].status) == ["ok"] * 8, list(res.status)
    assert {c[:3] for c in calls} == {("flash_attn_func", (2, 64, 3, 16), True)}
    assert [c[3]["causal"] for c in calls[::2]] == [False, False, True, True]  # check + timing, fwd then bwd
    assert all(c[3]["window_size"] == (None, None) and c[3]["softcap"] == 0.0 for c in calls)
    table = run.grid_table(res)
    assert table[0] == "| D | causal | mode | S | B | H | flash_cuda | fa4 | sdpa_cudnn | fc/cudnn | fc/fa4 |"
    assert all(line.endswith("|  | 0.50 |") for line in table[2:6])  # fc: 2 ms, fa4: 1 ms; cuDNN n/a on CPU


def test_fa4_unsupported_dtype(run, monkeypatch):
    import argparse
    import torch
    import fake_fa4
    fake_fa4.install(monkeypatch, fake_fa4.make_module())
    monkeypatch.setattr(run.M, "time_call", _bshd_time_call)
    grid = run.build_grid([16], [1], ["fwd"], [64], batch=2, heads=3)
    args = argparse.Namespace(no_check=False, seed=0, max_quadratic_gib=40.0)
    res = run.run_grid(args, grid, ["fa4"], torch.float32, None, device="cpu")
    assert list(res.status) == ["unsupported: FlashAttention-4 takes fp16 / bf16, not fp32"]
    assert "- fa4: unsupported: FlashAttention-4 takes fp16 / bf16, not fp32 (1 config)" in run.grid_table(res)


def test_fa4_missing_is_skipped_with_reason(run, monkeypatch, tmp_path, capsys):
    """Without flash_attn.cute the fa4 cells are skipped with the reason (not measured) and main() returns 0: the
    whole driver on CPU (CUDA's presence, the timer and the environment stood in for)."""
    import argparse
    import functools
    import torch
    import fake_fa4
    fake_fa4.install(monkeypatch, None)
    monkeypatch.setattr(run.M, "load_flash_cuda", lambda: _RightFlash())
    monkeypatch.setattr(run.M, "time_call", _bshd_time_call)
    monkeypatch.setattr(run.M, "fa4_fn", lambda *a: pytest.fail("fa4 was measured"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(run.C, "Timer", lambda *a: argparse.Namespace(name="stand-in timer"))
    monkeypatch.setattr(run.C, "environment", lambda **kw: {"gpu": "none (CPU test)", **kw})
    monkeypatch.setattr(run, "run_grid", functools.partial(run.run_grid, device="cpu"))
    argv = ["--d", "16", "--causal", "1", "--mode", "fwd", "--seqlen", "64", "--batch", "2", "--heads", "3",
            "--providers", "flash_cuda", "fa4", "--out", str(tmp_path), "--no-plots"]
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    reason = "skipped: flash_attn.cute is not importable (ModuleNotFoundError: "
    assert f"fa4: {reason}" in out  # the environment line
    assert "| 16 | 1 | fwd | 64 | 2 | 3 | " in out and "| skip |  |" in out
    assert f"- fa4: {reason}" in out and "pip install flash-attn-4) (1 config)" in out
    csv = (tmp_path / "results.csv").read_text()
    assert f"# fa4: {reason}" in csv and f",{reason}" in csv


def test_run_help_and_dry_run():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for opt in ("--quick", "--d", "--causal", "--mode", "--seqlen", "--dtype", "--providers",
                "--batch", "--heads", "--out", "--compare-anchors", "--features", "--dry-run"):
        assert opt in proc.stdout
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "72 configs x 7 providers = 504 cells (14 skipped for O(S^2) memory)" in proc.stdout
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--dry-run", "--quick",
                           "--dtype", "fp32", "--providers", "flash_cuda", "sdpa"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "fp32: 36 configs x 2 providers = 72 cells (0 skipped" in proc.stdout


def test_profile_help_and_ncu_command():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH / "ncu_profile.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--profile-from-start off" in proc.stdout
    proc = subprocess.run([sys.executable, str(BENCH / "ncu_profile.py"), "--print-ncu-cmd",
                           "--d", "64", "--seqlen", "8k", "--mode", "bwd", "--report", "r"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    cmd = proc.stdout.strip()
    assert cmd.startswith("ncu --profile-from-start off --set full "
                          "--clock-control none -o r -f python bench/ncu_profile.py")
    assert cmd.endswith("--d 64 --seqlen 8k --mode bwd")


def test_profile_decode_mode_names_its_report_and_refuses_other_providers():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH / "ncu_profile.py"), "--print-ncu-cmd", "--mode", "decode",
                           "--kv", "fp8", "--seqlen", "32k", "--cache", "paged16"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "-o ncu_flash_cuda_decode_d128_s32768_c0_bf16_b64_kvfp8_paged16 " in proc.stdout
    proc = subprocess.run([sys.executable, str(BENCH / "ncu_profile.py"), "--print-ncu-cmd", "--mode", "decode",
                           "--provider", "sdpa"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "-o ncu_sdpa_decode_d128_s4096_c0_bf16_b64_kv16_dense " in proc.stdout, proc.stderr
    expected = "--mode decode profiles flash_cuda, or an sdpa provider on a dense 16-bit cache"
    for other in (["--provider", "fa4"], ["--provider", "sdpa", "--kv", "fp8"],
                  ["--provider", "sdpa", "--cache", "paged16"]):
        proc = subprocess.run([sys.executable, str(BENCH / "ncu_profile.py"), "--mode", "decode", *other],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and expected in proc.stderr, (other, proc.stderr)


def test_host_overhead_help_and_no_gpu_message():
    torch = pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH / "host_overhead.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for opt in ("--seqlen", "--d", "--calls", "--backward", "--parts"):
        assert opt in proc.stdout
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(BENCH / "host_overhead.py")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_host_overhead_parts_on_gpu():
    """--parts: each case lists the whole call, the extension's entry, the Python layer and torch's floor."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    proc = subprocess.run([sys.executable, str(BENCH / "host_overhead.py"), "--parts", "--calls", "5",
                           "--warmup", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 12, proc.stdout
    for part in ("the whole call", "the extension's entry alone", "the Python layer alone", "x.zero_()", "sdpa"):
        assert sum(part in r for r in rows) == 2, (part, proc.stdout)
    for r in rows:
        queued, synced = (float(c) for c in r.strip("| ").split(" | ")[-2:])
        assert 0 < queued <= synced, r


def test_decode_bench_help_and_no_gpu_message():
    torch = pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH / "decode.py"), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for opt in ("--seqlen", "--cache", "--sq", "--prefill", "--quick"):
        assert opt in proc.stdout
    assert "--decode" in subprocess.run([sys.executable, str(BENCH / "host_overhead.py"), "--help"],
                                        capture_output=True, text=True, timeout=120).stdout
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(BENCH / "decode.py")], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_ring_bench_help_and_trace_summary():
    """bench/ring.py's options, and its trace summary on a made-up timeline: call 0's kernels run
    from 10 to 40 and 50 to 90 (an NCCL kernel 30-70 overlapping both), call 1 starts at 200."""
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH / "ring.py"), "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    for opt in ("--sm-margin", "--trace", "--tokens", "--mode", "--check", "--hop-first", "--speculate", "--graphs"):
        assert opt in proc.stdout
    ring = _load("flash_cuda_bench_ring", BENCH / "ring.py")
    rows = ring.summarize_trace([(200, 230), (0, 25)],
                                [(10, 40, False), (50, 90, False), (30, 70, True), (205, 260, False), (5, 5, True)])
    assert rows[0] == dict(call=0, host_us=25, first_kernel_us=10, gpu_span_us=80, gpu_idle_us=0,
                           nccl_us=40, nccl_under_compute_us=30)
    assert rows[1]["first_kernel_us"] == 5 and rows[1]["nccl_us"] == 0 and rows[1]["gpu_span_us"] == 55
    assert ring._union([(5, 6), (1, 3), (2, 4)]) == [[1, 4], [5, 6]]
    assert ring._overlap([[0, 10]], [[2, 3], [9, 12]]) == 2


def test_decode_bench_ablation_switch_is_checked():
    """--ablation takes FLASH_CUDA_NAME=VALUE; anything else is refused before any GPU work."""
    proc = subprocess.run([sys.executable, str(BENCH / "decode.py"), "--ablation", "RING=deep"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "expected FLASH_CUDA_NAME=VALUE" in proc.stderr


def test_decode_bench_paged_cells_against_their_dense_cell():
    """bench/decode.py's dense_refs: a paged cell takes SDPA's time from the dense cell of its
    shape and reports the dense cache's time over its own; cells without a dense twin keep theirs."""
    pd = pytest.importorskip("pandas")
    decode = _load("flash_cuda_bench_decode", BENCH / "decode.py")
    nan = float("nan")
    cell = dict(dtype="bf16", D=128, ratio=4, B=1, Sq=1, splits=0, kv="16")
    df = pd.DataFrame([
        dict(cell, Sk=8192, cache="dense", us=20.0, sdpa_us=18.0, vs_sdpa=0.9),
        dict(cell, Sk=8192, cache="paged16", us=25.0, sdpa_us=nan, vs_sdpa=nan),
        dict(cell, Sk=8192, cache="paged256", us=20.0, sdpa_us=nan, vs_sdpa=nan),
        dict(cell, Sk=32768, cache="paged16", us=50.0, sdpa_us=45.0, vs_sdpa=0.9),  # no dense twin
    ])
    out = decode.dense_refs(df)
    assert out.vs_dense.tolist()[:3] == [1.0, 0.8, 1.0] and math.isnan(out.vs_dense.iloc[3])
    assert out.sdpa_us.tolist() == [18.0, 18.0, 18.0, 45.0]
    assert out.vs_sdpa.tolist() == [0.9, 18.0 / 25.0, 18.0 / 20.0, 0.9]
    assert df.vs_sdpa.isna().sum() == 2  # (the input is left as it was)
    fp8 = decode.dense_refs(pd.concat([df, pd.DataFrame([dict(cell, Sk=8192, kv="fp8", cache="dense", us=10.0,
                                                              sdpa_us=nan, vs_sdpa=nan)])], ignore_index=True))
    assert fp8.vs_16bit.iloc[4] == 2.0 and fp8.vs_16bit.iloc[:4].isna().all()
    assert fp8.sdpa_us.iloc[4] != fp8.sdpa_us.iloc[4]  # (an FP8 cell is not the 16-bit dense cell's twin)


def test_ab_switch_cells_and_arguments():
    ab = _load("flash_cuda_bench_ab_switch", BENCH / "ab_switch.py")
    args = ab.parse_args(["--switch", "FLASH_CUDA_WS_BLOCK_M=128", "--d", "96", "--seqlen", "2k", "16k",
                          "--causal", "no"])
    assert (args.switch_name, args.switch_value) == ("FLASH_CUDA_WS_BLOCK_M", "128")
    # B * S = 16k tokens and H * D = 2048 in every cell
    assert ab.cells(args) == [(8, 21, 2048, 96, False), (1, 21, 16384, 96, False)]
    with pytest.raises(SystemExit):
        ab.parse_args(["--switch", "BLOCK_M"])
    # several rungs, one of two switches: each against the same default, which unsets them all
    many = ab.parse_args(["--switch", "FLASH_CUDA_A=1", "--switch", "FLASH_CUDA_B=x,FLASH_CUDA_C=2"])
    assert many.rungs == [[("FLASH_CUDA_A", "1")], [("FLASH_CUDA_B", "x"), ("FLASH_CUDA_C", "2")]]
    saved = {n: os.environ.pop(n, None) for n in many.names}
    try:
        ab.set_switch(many, 2)
        assert [os.environ.get(n) for n in many.names] == [None, "x", "2"]
        ab.set_switch(many, 0)
        assert all(n not in os.environ for n in many.names)
    finally:
        for n, v in saved.items():
            if v is not None:
                os.environ[n] = v
    assert [ab.side_order(2, r) for r in range(2)] == [[0, 1], [1, 0]]
    assert sorted(map(tuple, (ab.side_order(3, r)[0:1] for r in range(3)))) == [(0,), (1,), (2,)]
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(BENCH / "ab_switch.py"), "--switch", "FLASH_CUDA_WS_BLOCK_M=128"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


def test_ab_builds_one_process_checks_each_build_ran_its_own_kernels():
    ab = _load("flash_cuda_bench_ab_builds", BENCH / "ab_builds.py")
    own = "void flash_cuda_ab_new::sm90::ws::fwd_kernel<Cfg>(flash_cuda_ab_new::FwdParams)"
    ab.check_namespace("new", "flash_cuda_ab_new", [own, "void at::native::vectorized_elementwise_kernel<4>()"])
    for names in ([own.replace("_ab_new", "_ab_base")], [own.replace("_ab_new", "")], []):
        with pytest.raises(SystemExit, match="instead of kernels in namespace flash_cuda_ab_new"):
            ab.check_namespace("new", "flash_cuda_ab_new", names)


def test_ab_builds_paired_times_alternate_the_builds_call_by_call():
    import types

    ab = _load("flash_cuda_bench_ab_builds_paired", BENCH / "ab_builds.py")
    log = []  # what the "GPU" saw, in order: flushes, event records and calls

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = len(log)
            log.append("event")

        def elapsed_time(self, other):
            calls = [x for x in log[self.at:other.at] if x != "event"]
            return sum({"zero": 0.0, "base": 1.0, "new": 3.0}[c] for c in calls)

    class Flush:
        def zero_(self):
            log.append("zero")

    cuda = types.SimpleNamespace(Event=Event, synchronize=lambda: None)
    fake_torch = types.SimpleNamespace(cuda=cuda, int8=None, empty=lambda *a, **k: Flush())
    base_ms, new_ms = ab.paired_times(fake_torch, [lambda: log.append("base"), lambda: log.append("new")],
                                      rep_ms=40.0, warmup=2)
    assert (base_ms, new_ms) == (1.0, 3.0)
    calls = [x for x in log if x in ("base", "new")]
    assert calls[:4] == ["base", "new"] * 2  # the warm-up turns
    timed = calls[6:]  # after the warm-up and the turn that sizes the loop
    assert len(timed) == 2 * 10 and timed == ["base", "new"] * 10  # 40 ms / (1 + 3) ms per turn


def test_fp8_provider_refuses_what_the_fp8_forward_lacks(run):
    """flash_cuda_fp8 is a forward-only, dense provider with softcap the one score modifier: other
    calls become 'unsupported' cells."""
    M = run.M

    assert "flash_cuda_fp8" in M.PROVIDERS
    for call in (M.Call("flash_cuda_fp8", 128, 16, False, "bwd", (1024,)),
                 M.Call("flash_cuda_fp8", 128, 16, False, "fwd", (512, 512), varlen=True),
                 M.Call("flash_cuda_fp8", 128, 16, True, "fwd", (1024,), alibi=True)):
        with pytest.raises(NotImplementedError):
            M.fp8_fn(call)
        assert M.classify_error(NotImplementedError("x")).startswith("unsupported")


@pytest.mark.parametrize("mode", ["calls", "decode"])
def test_host_overhead_rounds_on_gpu(mode):
    """Each provider's row holds one positive time per mode, the median of the interleaved rounds."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    extra = ["--decode"] if mode == "decode" else []
    proc = subprocess.run([sys.executable, str(BENCH / "host_overhead.py"), *extra, "--calls", "5", "--warmup", "1",
                           "--rounds", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    rows = [line for line in lines[2:] if line.strip()]
    assert len(rows) == (4 if mode == "decode" else 2), proc.stdout
    for r in rows:
        times = [float(x) for x in r.split()[-(1 if mode == "decode" else 3):]]
        assert all(t > 0 for t in times), r
