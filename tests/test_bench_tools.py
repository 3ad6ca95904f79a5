"""CPU-only tests of the benchmark tools: the ncu CSV summariser (bench/ncu_summary.py) on a
synthetic report, and the pure helpers of bench/run.py / bench/ncu_profile.py. No CUDA needed."""

import importlib.util
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


def test_raw_csv_parses_launches(ncu):
    launches = ncu.parse_ncu_csv(RAW_CSV)
    assert [l["id"] for l in launches] == ["0", "1", "2"]
    assert launches[0]["name"] == FWD_NAME
    assert launches[0]["grid"] == "(32, 16, 4)"
    assert launches[0]["metrics"]["gpu__time_duration.sum"] == [("1.50", "msecond")]


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


def test_long_details_shape(ncu):
    """`--page details` shape: one row per metric with human-readable names."""
    head = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
            "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name",
            "Metric Unit", "Metric Value"]
    base = ["0", "1", "python", "h", FWD_NAME, "1", "7", "(128, 1, 1)", "(8, 1, 1)", "0", "9.0"]
    rows = [head] + [base + r for r in [
        ["GPU Speed Of Light Throughput", "Duration", "usecond", "812.35"],
        ["GPU Speed Of Light Throughput", "DRAM Throughput", "%", "22.10"],
        ["GPU Speed Of Light Throughput", "Memory Throughput", "%", "40.00"],
        ["Memory Workload Analysis", "Memory Throughput", "Gbyte/second", "1,050.00"],
        ["Memory Workload Analysis", "L2 Hit Rate", "%", "66.60"],
        ["Launch Statistics", "Registers Per Thread", "register/thread", "128"],
        ["Launch Statistics", "Static Shared Memory Per Block", "byte/block", "0"],
        ["Launch Statistics", "Dynamic Shared Memory Per Block", "Kbyte/block", "73.73"],
        ["Occupancy", "Achieved Occupancy", "%", "18.75"],
    ]]
    g = ncu.summarize_csv_text(_csv_text(rows, prefix=""))[0]
    assert g["duration_us"] == pytest.approx(812.35)
    assert g["dram_pct"] == pytest.approx(22.1)
    assert g["dram_gbs"] == pytest.approx(1050.0)  # the rate, not the % of the SOL section
    assert g["l2_hit_pct"] == pytest.approx(66.6)
    assert g["registers"] == 128
    assert g["occupancy_pct"] == pytest.approx(18.75)
    assert g["smem_b"] == pytest.approx(73730.0)  # 0 byte/block + 73.73 Kbyte/block
    assert g["tensor_pipe_pct"] is None


def test_units_and_numbers(ncu):
    assert ncu.parse_number("1,234.5") == 1234.5
    assert ncu.parse_number("n/a") is None
    assert ncu.parse_number("(128, 1, 1)") is None
    assert ncu.to_bytes(2.0, "Kbyte") == 2000.0
    assert ncu.to_bytes(2.0, "KiB") == 2048.0
    assert ncu.to_bytes_per_second(1.5, "Tbyte/second") == pytest.approx(1.5e12)
    assert ncu.to_bytes_per_second(3.0, "Gbyte/s") == pytest.approx(3e9)
    assert ncu.to_seconds(7.0, "usecond") == pytest.approx(7e-6)


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


# ---------------------------------------------------------------------------------------
# bench/run.py and bench/ncu_profile.py (CPU: helpers, --help, --dry-run)
# ---------------------------------------------------------------------------------------

def test_flops_formula(run):
    # FlashAttention convention: fwd = 4*B*H*S*S*D, halved when causal; bwd 2.5x, fwd_bwd 3.5x
    B, H, S, D = 4, 8, 1024, 64
    fwd = 4 * B * H * S * S * D
    assert run.attention_flops(B, H, S, S, D, False, "fwd") == fwd
    assert run.attention_flops(B, H, S, S, D, True, "fwd") == fwd / 2
    assert run.attention_flops(B, H, S, S, D, False, "bwd") == 2.5 * fwd
    assert run.attention_flops(B, H, S, S, D, True, "fwd_bwd") == 3.5 * fwd / 2
    # 1 TFLOP in 1 ms = 1000 TFLOPS
    assert run.tflops_from_ms(1e12, 1.0) == pytest.approx(1000.0)
    # anchor check: sdpa_cudnn bf16 D=64 S=16384 B=1 H=32 fwd 4.7510 ms -> 462.9 TFLOPS
    flops = run.attention_flops(1, 32, 16384, 16384, 64, False, "fwd")
    assert run.tflops_from_ms(flops, 4.7510) == pytest.approx(462.9, abs=0.1)
    with pytest.raises(ValueError):
        run.attention_flops(1, 1, 1, 1, 8, False, "sideways")


def test_grid_and_shapes(run):
    assert run.parse_seqlen("4k") == 4096 and run.parse_seqlen("512") == 512
    assert run.workload_shape("tokens", 2048, 128) == (8, 16)
    assert run.workload_shape("seeds", 2048, 128) == (4, 8)
    assert run.workload_shape("tokens", 2048, 64, batch=2) == (2, 32)
    grid = run.build_grid(run.DEFAULT_D, run.DEFAULT_CAUSAL, run.MODES, run.DEFAULT_SEQLENS,
                          ["tokens"])
    assert len(grid) == 2 * 2 * 3 * 6
    assert all(c.B * c.S == 16384 and c.H * c.D == 2048 for c in grid)


def test_default_providers_follow_dtype(run):
    import torch
    bf16 = run.default_providers(torch.bfloat16)
    fp32 = run.default_providers(torch.float32)
    assert "flash_cuda_mma" in bf16 and "flash_cuda_simt" not in bf16
    assert "flash_cuda_simt" in fp32 and "flash_cuda_mma" not in fp32
    assert {"flash_cuda", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math",
            "naive"} <= set(bf16)


def test_quadratic_memory_skip(run):
    import torch
    # naive bf16 at S=16k, D=64 (B=1, H=32) backward needs far more than 40 GiB
    assert run.quadratic_mem_gib("naive", 1, 32, 16384, torch.bfloat16, "bwd") > 40
    assert run.quadratic_mem_gib("naive", 16, 32, 1024, torch.bfloat16, "bwd") < 40
    assert run.quadratic_mem_gib("flash_cuda", 1, 32, 16384, torch.bfloat16, "bwd") == 0


def test_naive_attention_matches_sdpa_on_cpu(run):
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 17, 16, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        mask = run.causal_mask(17, 17, "cpu") if causal else None
        got = run.naive_attention(q, k, v, causal, 16 ** -0.5, mask)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(got, want, atol=1e-10)


def test_markdown_table_and_csv(run):
    import torch
    cfg = run.Config("tokens", 64, True, "fwd", 4096, 4, 32)
    results = {(cfg, "flash_cuda"): run.Result(1.0, 300.0, 0.1),
               (cfg, "sdpa"): run.Result(0.8, 400.0, 0.1),
               (cfg, "sdpa_flash"): run.Result(status="unsupported: fp32"),
               (cfg, "naive"): run.Result(status="WRONG (out rel err 0.5 > 0.02)")}
    providers = ["flash_cuda", "sdpa", "sdpa_flash", "naive"]
    table = "\n".join(run.markdown_table([cfg], providers, results))
    assert "| 64 | 1 | fwd | 4k | 4 | 32 | 300.0 | 400.0 | n/s | WRONG | 0.75 |" in table
    assert "naive: WRONG (out rel err 0.5 > 0.02)" in table
    rows = list(run.csv_rows([cfg], providers, results, torch.bfloat16))
    assert list(rows[0]) == run.CSV_COLUMNS
    assert rows[0]["dtype"] == "bfloat16" and rows[0]["tflops"] == "300.0"
    assert rows[2]["ms"] == "" and rows[2]["status"] == "unsupported: fp32"


def test_run_help_and_dry_run():
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for opt in ("--quick", "--d", "--causal", "--mode", "--seqlen", "--dtype", "--providers",
                "--workload", "--out", "--compare-anchors"):
        assert opt in proc.stdout
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "72 configs x 8 providers" in proc.stdout


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


def test_host_overhead_help_and_no_gpu_message():
    torch = pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(BENCH / "host_overhead.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for opt in ("--seqlen", "--d", "--calls", "--backward"):
        assert opt in proc.stdout
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, str(BENCH / "host_overhead.py")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


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
