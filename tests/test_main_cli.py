"""`python3 -m flash_cuda`, the installation check: the report without a GPU (its reason, a
non-zero exit, the --json schema), the toolkit checks that a build at first use runs before it
compiles (fake toolkits), the GPU classes and kernel families it reports, the self-test's rule
(on CPU through the mock extension), and on a GPU the self-test and the short benchmark."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flash_cuda
from fake_toolkit import ALL_HEADERS, make_toolkit
from flash_cuda import __main__ as cli
from flash_cuda import _bench, _build, _ext, _report, _selftest

ROOT = Path(__file__).resolve().parents[1]

TOP_KEYS = {"schema", "ok", "exit_code", "problem", "versions", "gpus", "build", "selftest", "bench"}
VERSION_KEYS = {"flash_cuda", "torch", "cuda", "cudnn", "driver", "driver_cuda", "cuda_home", "nvcc",
                "nvcc_version", "python"}
BUILD_KEYS = {"available", "origin", "module", "directory", "archs", "cache_root", "sources", "reason",
              "toolkit_problem"}
GPU_KEYS = {"index", "name", "capability", "sms", "memory_gib", "smem_per_block_optin_kib", "gpu_class",
            "smem_budget_kib", "emulated_arch", "supported", "kernels"}
CASE_KEYS = {"name", "passed", "seconds", "errors", "problem"}


def _cli(*args, timeout=900):
    # `-m` puts the working directory first on sys.path: run from the tested copy's parent, or a
    # suite started in the checkout would run an installed copy's CLI on the checkout's sources.
    root = str(Path(flash_cuda.__file__).parents[1])
    return subprocess.run([sys.executable, "-m", "flash_cuda", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=root, env=dict(os.environ, PYTHONPATH=root))


def _flat(text: str) -> str:
    """The message on one line (the build's messages are wrapped)."""
    return " ".join(text.split())


needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available() and flash_cuda.is_available(),
                                  reason="the kernels run here: the no-GPU report is not what this machine gives")


# ---------------------------------------------------------------------------------------
# The report where the kernels cannot run
# ---------------------------------------------------------------------------------------


@needs_no_gpu
def test_report_names_the_reason_and_fails():
    proc = _cli()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    for section in ("versions", "GPUs", "build", "NOT USABLE HERE (exit 1)"):
        assert section in out, out
    reason = flash_cuda.unavailable_reason()
    assert reason is not None
    assert _flat(reason)[:60] in _flat(out), out
    assert f"torch        {torch.__version__}" in out


@needs_no_gpu
def test_json_schema():
    proc = _cli("--json")
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == TOP_KEYS
    assert report["schema"] == cli.SCHEMA and report["ok"] is False and report["exit_code"] == 1
    assert set(report["versions"]) == VERSION_KEYS and set(report["build"]) == BUILD_KEYS
    assert report["versions"]["torch"] == torch.__version__ and report["versions"]["cuda"] == torch.version.cuda
    assert report["versions"]["flash_cuda"] == flash_cuda.__version__
    assert report["build"]["available"] is False and report["build"]["reason"] == flash_cuda.unavailable_reason()
    assert report["problem"] == report["build"]["reason"]
    assert report["selftest"] is None and report["bench"] is None
    assert all(set(g) == GPU_KEYS for g in report["gpus"])


def test_unavailable_reason(monkeypatch):
    assert (flash_cuda.unavailable_reason() is None) == flash_cuda.is_available()
    if not flash_cuda.is_available():
        assert flash_cuda.unavailable_reason() == _ext.unavailable_message()
    monkeypatch.setattr(_ext, "_AVAILABLE", False)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", _ext.BuildError("flash_cuda: no way"))
    assert flash_cuda.unavailable_reason() == "flash_cuda: no way"
    monkeypatch.setattr(_ext, "_AVAILABLE", True)
    assert flash_cuda.unavailable_reason() is None
    assert "unavailable_reason" in flash_cuda.__all__


# ---------------------------------------------------------------------------------------
# The toolkit checks
# ---------------------------------------------------------------------------------------


@pytest.fixture
def clean_include_env(monkeypatch):
    for var in ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH", "CUDA_INC_PATH", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    if any(os.path.isfile(os.path.join(d, h)) for d in ("/usr/include", "/usr/local/include") for h in ALL_HEADERS):
        pytest.skip("this machine's system include directories hold CUDA toolkit headers")


def test_complete_toolkit(tmp_path, clean_include_env):
    home = make_toolkit(tmp_path / "cuda", "12.8")
    assert _build.nvcc_release(_build.nvcc_of(str(home))) == "12.8"
    assert _build.toolkit_problem(str(home), "12.8", "2.9.0+cu128") is None
    # Another minor version of the same major compiles (torch's builder only warns).
    assert _build.toolkit_problem(str(make_toolkit(tmp_path / "c126", "12.6")), "12.8", "2.9.0+cu128") is None


def test_cuda_home_pointing_nowhere(tmp_path, clean_include_env, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nothing"))
    problem = _flat(_build.toolkit_problem(str(tmp_path / "nothing"), "12.8", "2.9.0+cu128"))
    assert "does not exist" in problem and "$CUDA_HOME" in problem and "Set CUDA_HOME" in problem


def test_nvcc_missing_from_cuda_home(tmp_path, clean_include_env):
    home = make_toolkit(tmp_path / "cuda", release=None)
    problem = _flat(_build.toolkit_problem(str(home), "12.8", "2.9.0+cu128"))
    assert "has no bin/nvcc" in problem and str(home) in problem


def test_nvcc_of_another_major_version(tmp_path, clean_include_env):
    home = make_toolkit(tmp_path / "cuda", "11.8")
    problem = _flat(_build.toolkit_problem(str(home), "12.8", "2.9.0+cu128"))
    assert "CUDA 11.8" in problem and "CUDA 12.8" in problem and "major version" in problem
    assert "2.9.0+cu128" in problem and "toolkit 12.x" in problem


def test_nvcc_too_old_for_a_target(tmp_path, clean_include_env):
    home = make_toolkit(tmp_path / "cuda", "12.4")
    assert _build.toolkit_problem(str(home), "12.8", "2.9", archs=["80", "90a"]) is None
    problem = _flat(_build.toolkit_problem(str(home), "12.8", "2.9", archs=["90a", "120"]))
    assert "sm_120" in problem and "12.8 or newer" in problem and "sm_90a" not in problem


def test_missing_headers(tmp_path, clean_include_env, monkeypatch):
    home = make_toolkit(tmp_path / "cuda", "12.8", headers=["cuda_runtime_api.h", "cublas_v2.h", "cublasLt.h"])
    assert _build.toolkit_problem(str(home), "12.8", "2.9.0+cu128") is None  # named when a compile fails
    problem = _flat(_build.header_problem(str(home)))
    assert "cusparse.h" in problem and "cusolverDn.h" in problem and "cublas_v2.h" not in problem
    assert "libcusparse-dev-12-8" in problem and "libcusolver-dev-12-8" in problem and "CPATH" in problem
    # NVIDIA's pip packages hold them: the message says how to use those.
    site = tmp_path / "site"
    for pkg, header in (("cusparse", "cusparse.h"), ("cusolver", "cusolverDn.h")):
        (site / "nvidia" / pkg / "include").mkdir(parents=True)
        (site / "nvidia" / pkg / "include" / header).write_text("")
    monkeypatch.setattr(sys, "path", [str(site)] + sys.path)
    problem = _flat(_build.header_problem(str(home)))
    assert f"export CPATH={site / 'nvidia' / 'cusolver' / 'include'}" in problem
    # ... and once they are on CPATH, nothing is missing.
    monkeypatch.setenv("CPATH", os.pathsep.join(str(site / "nvidia" / p / "include") for p in ("cusparse", "cusolver")))
    assert _build.header_problem(str(home)) is None


@pytest.mark.parametrize("text,match", [
    ("In file included from ATen/cuda/CUDAContextLight.h:10:\n/x.h:3:10: fatal error: cusparse.h: No such file "
     "or directory", "libcusparse-dev"),
    ("nvcc fatal   : Unsupported gpu architecture 'compute_120'", "cannot compile for sm_120"),
    ("#error -- unsupported GNU version! gcc versions later than 13 are not supported!", "-ccbin"),
    ("error: expected ';' before '}' token", None),
])
def test_compile_error_hint(text, match):
    hint = _build.compile_error_hint(text)
    assert hint is None if match is None else match in hint


def _first_use(monkeypatch, tmp_path, cuda_home, caps=((9, 0),)):
    """flash_cuda just imported without flash_cuda._C, on a CUDA torch (12.8) with these GPUs and
    CUDA_HOME, an empty cache; compiling fails the test unless patched."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", None)
    monkeypatch.setattr(_ext, "_ORIGIN", None)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", ModuleNotFoundError("No module named 'flash_cuda._C'",
                                                                   name="flash_cuda._C"))
    monkeypatch.setenv("FLASH_CUDA_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("FLASH_CUDA_ARCHS", "FLASH_CUDA_ABLATIONS", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: caps[i])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cuda_home)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("compiled although the toolkit is wrong"))


@pytest.mark.parametrize("case,match", [
    ("mismatch", "major version"),
    ("nowhere", "does not exist"),
    ("too old", "sm_90a"),
])
def test_first_use_names_the_toolkit_problem(monkeypatch, tmp_path, clean_include_env, case, match):
    """The first use checks the toolkit before compiling and raises with the fix, not with a
    compiler error."""
    home = {"mismatch": lambda: make_toolkit(tmp_path / "cuda", "13.0"),
            "nowhere": lambda: tmp_path / "nowhere",
            "too old": lambda: make_toolkit(tmp_path / "cuda", "11.8")}[case]()
    _first_use(monkeypatch, tmp_path, str(home))
    if case == "too old":
        monkeypatch.setattr(torch.version, "cuda", "11.8")
    assert flash_cuda.is_available() is False
    assert match in _flat(flash_cuda.unavailable_reason())
    with pytest.raises(RuntimeError, match=re.escape(match)):
        _ext.require()


def test_failed_compile_names_the_cause(monkeypatch, tmp_path, clean_include_env):
    """Toolkit headers that seem missing do not stop a build (the compiler may be told of another
    place); when the compile fails on one, the error says what to install."""
    from torch.utils import cpp_extension

    home = make_toolkit(tmp_path / "cuda", "12.8", headers=["cuda_runtime_api.h", "cusparse.h"])
    _first_use(monkeypatch, tmp_path, str(home))

    def load(**kwargs):
        raise RuntimeError("Error building extension 'flash_cuda_kernels'\n"
                           "/usr/include/x.h:11:10: fatal error: cublas_v2.h: No such file or directory")

    monkeypatch.setattr(cpp_extension, "load", load)
    assert flash_cuda.is_available() is False
    reason = _flat(flash_cuda.unavailable_reason())
    assert "failed" in reason and "fatal error: cublas_v2.h" in reason
    assert f"The CUDA toolkit in {home} lacks cublas_v2.h, cublasLt.h, cusolverDn.h" in reason
    assert "libcublas-dev-12-8, libcusolver-dev-12-8" in reason


def test_load_info_says_where_the_kernels_came_from(monkeypatch, tmp_path, clean_include_env):
    """Compiled now, then (another process) loaded from the cache."""
    from torch.utils import cpp_extension

    _first_use(monkeypatch, tmp_path, str(make_toolkit(tmp_path / "cuda", "12.8")))

    def load(name, build_directory, **kwargs):
        path = Path(build_directory) / f"{name}.py"
        path.write_text("fake = True\n")
        import importlib.util
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    monkeypatch.setattr(cpp_extension, "load", load)
    assert _ext.load_info()["origin"] is None
    assert flash_cuda.is_available()
    info = _ext.load_info()
    assert info["origin"] == "compiled" and info["archs"] == ["90a"]
    assert Path(info["directory"]).name == "sm_90a" and info["module"].startswith(info["directory"])
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", None)
    assert flash_cuda.is_available() and _ext.load_info()["origin"] == "cache"
    assert _ext.load_info()["directory"] == info["directory"]


# ---------------------------------------------------------------------------------------
# GPU classes and kernel families
# ---------------------------------------------------------------------------------------


def test_gpu_classes_match_the_kernels_budgets():
    """The budgets of _report.GPU_CLASSES are csrc's (gpu_class.h): smem_budget_of_arch's."""
    header = next(iter(sorted(ROOT.glob("csrc/**/gpu_class.h"))), None)
    if header is None:
        pytest.skip("no csrc/**/gpu_class.h in this tree")
    text = header.read_text()
    kib = {name: int(n) for name, n in re.findall(r"constexpr size_t (kSmem\w+) = (\d+) \* 1024", text)}
    body = text[text.index("smem_budget_of_arch"):]
    checks = re.findall(r"if \(([^)]*)\) return (kSmem\w+);", body)
    assert kib and checks, f"{header} changed its form: check _report.GPU_CLASSES against it and update this test"
    for line in checks:
        for arch in re.findall(r"arch == (\d+)", line[0]):
            assert _report.gpu_class(int(arch))[1] == kib[line[1]], arch
    for arch in (86, 89, 120, 121):
        assert _report.gpu_class(arch)[1] == kib["kSmemConsumer"], arch


@pytest.mark.parametrize("arch,name,half", [
    (90, "Hopper", ["wgmma", "mma"]), (80, "Ampere datacenter", ["mma"]), (86, "Ampere / Ada consumer", ["mma"]),
    (89, "Ampere / Ada consumer", ["mma"]), (120, "Blackwell consumer", ["mma"]), (100, "Blackwell datacenter", ["mma"]),
])
def test_gpu_class_table(arch, name, half):
    got_name, _, got_half, single = _report.gpu_class(arch)
    assert got_name == name and list(got_half) == half and list(single) == ["simt"]
    assert set(got_half) | set(single) <= set(flash_cuda.KERNELS)
    assert _report.gpu_class(75)[2:] == ((), ())


def _fake_gpu(monkeypatch, major, minor, optin=232448):
    props = SimpleNamespace(name="Fake GPU", major=major, minor=minor, multi_processor_count=132,
                            total_memory=80 * 2**30, shared_memory_per_block_optin=optin)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)


def test_gpus(monkeypatch):
    monkeypatch.delenv("FLASH_CUDA_EMULATE_ARCH", raising=False)
    _fake_gpu(monkeypatch, 9, 0)
    (g,) = _report.gpus(["90a"])
    assert set(g) == GPU_KEYS
    assert g["gpu_class"] == "Hopper" and g["smem_per_block_optin_kib"] == 227 and g["capability"] == "9.0"
    assert g["kernels"] == {"float16": ["wgmma", "mma"], "bfloat16": ["wgmma", "mma"], "float32": ["simt"]}
    assert _report.gpus(["80"])[0]["kernels"]["bfloat16"] == ["mma"]  # a build without sm_90a
    monkeypatch.setenv("FLASH_CUDA_EMULATE_ARCH", "86")
    (g,) = _report.gpus(None)
    assert g["gpu_class"] == "Ampere / Ada consumer" and g["emulated_arch"] == 86 and g["kernels"]["float16"] == ["mma"]
    monkeypatch.delenv("FLASH_CUDA_EMULATE_ARCH")
    _fake_gpu(monkeypatch, 7, 5)
    assert _report.gpus(None)[0]["supported"] is False


# ---------------------------------------------------------------------------------------
# The report's assembly, the self-test's rule, the benchmark's shapes (CPU)
# ---------------------------------------------------------------------------------------


def _fake_parts(monkeypatch, cases_pass=True, bench_error=None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_report, "versions", lambda: {k: "1" for k in VERSION_KEYS})
    monkeypatch.setattr(_report, "build", lambda found=None: {
        "available": True, "origin": "cache", "module": "/c/m.so", "directory": "/c", "archs": ["90a"],
        "cache_root": "/c", "sources": "/s", "reason": None, "toolkit_problem": None})
    monkeypatch.setattr(_report, "gpus", lambda archs: [{
        "index": 0, "name": "Fake", "capability": "9.0", "sms": 132, "memory_gib": 79.1,
        "smem_per_block_optin_kib": 227, "gpu_class": "Hopper", "smem_budget_kib": 227, "emulated_arch": None,
        "supported": True, "kernels": {"float16": ["wgmma", "mma"], "bfloat16": ["wgmma", "mma"],
                                       "float32": ["simt"]}}])
    case = {"name": "case one", "passed": cases_pass, "seconds": 0.1, "problem": None if cases_pass else "out: bad",
            "errors": {"out": {"error": 1e-3, "naive": 1e-3, "tol": 3e-3}}}
    monkeypatch.setattr(_selftest, "run", lambda quick=False: [case])
    row = {"D": 128, "S": 1024, "B": 16, "H": 16, "causal": True, "mode": "fwd", "flash_cuda_tflops": 500.0,
           "sdpa_tflops": 400.0, "ratio_sdpa": 1.25}
    if bench_error:
        row.update(flash_cuda_tflops=None, flash_cuda_error=bench_error, ratio_sdpa=None)
    monkeypatch.setattr(_bench, "run", lambda quick=False, with_fa4=True: {
        "dtype": "bfloat16", "providers": ["flash_cuda", "sdpa"], "fa4_reason": "flash_attn.cute is not importable",
        "rows": [row]})


def test_report_on_a_working_gpu(monkeypatch, capsys):
    _fake_parts(monkeypatch)
    assert cli.main(["--bench"]) == 0
    out = capsys.readouterr().out
    assert "OK: flash_cuda works here." in out and "PASS  case one" in out
    assert "class Hopper (tiles for 227 KiB)" in out and "fp16/bf16: wgmma + mma; fp32: simt" in out
    assert "loaded from the cache" in out and "sm_90a" in out
    assert re.search(r"flash_cuda TFLOPS\s+sdpa TFLOPS\s+fc/sdpa", out) and re.search(r"500\.0\s+400\.0\s+1\.25", out)
    assert "FlashAttention-4 not compared: flash_attn.cute is not importable" in out
    assert cli.main(["--json", "--bench"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == TOP_KEYS and report["ok"] and all(set(c) == CASE_KEYS for c in report["selftest"])
    assert cli._strict({"a": [float("nan"), 1.0, {"b": float("inf")}]}) == {"a": [None, 1.0, {"b": None}]}


@pytest.mark.parametrize("failure", ["selftest", "bench"])
def test_report_on_a_failing_gpu(monkeypatch, capsys, failure):
    _fake_parts(monkeypatch, cases_pass=failure != "selftest",
                bench_error="RuntimeError: boom" if failure == "bench" else None)
    assert cli.main(["--bench"]) == 2
    out = capsys.readouterr().out
    assert "FAILED (exit 2)" in out
    assert ("FAIL  case one" in out and "out: bad" in out) if failure == "selftest" else "RuntimeError: boom" in out


def test_rule():
    ref = torch.randn(64, dtype=torch.float64)
    naive = ref + 1e-3
    assert _selftest.rule(ref + 2e-3, ref, naive, 1e-3)["error"] <= _selftest.rule(ref + 2e-3, ref, naive, 1e-3)["tol"]
    bad = _selftest.rule(ref + 0.1, ref, naive, 1e-3)
    assert not bad["error"] <= bad["tol"]
    nan = ref.clone()
    nan[3] = float("nan")
    assert not _selftest.rule(nan, ref, naive, 1e-3)["error"] <= 1.0
    lse = torch.tensor([float("-inf"), 1.0], dtype=torch.float64)  # masked rows are left out
    assert _selftest.rule(lse.float(), lse, lse, 1e-4)["error"] == 0.0


def test_selftest_on_the_cpu_mock(mock_extension):
    """The dense and packed cases pass against the CPU implementation of the extension, and a
    wrong output fails with what was wrong."""
    results = {c["name"]: c for c in _selftest.run(device="cpu")}
    assert len(results) == len(_selftest.cases())
    for name, c in results.items():
        assert set(c) == CASE_KEYS
        if "KV-cache" not in name:  # attention_with_kvcache takes CUDA tensors alone
            assert c["passed"], c
            assert set(c["errors"]) == {"out", "lse", "dq", "dk", "dv"}
    fwd = mock_extension.fwd

    def wrong(*args, **kwargs):
        out, lse, aux = fwd(*args, **kwargs)
        return out * 1.2, lse, aux

    mock_extension.fwd = wrong
    from flash_cuda import _ext as ext
    ext._C.fwd = wrong
    (first, *_) = _selftest.run(quick=True, device="cpu")
    assert not first["passed"] and first["problem"].startswith("out:")


def test_bench_shapes():
    cells = _bench.shapes()
    assert len(cells) == 16 and all(c["B"] * c["S"] == 16384 and c["H"] * c["D"] == 2048 for c in cells)
    assert {(c["D"], c["S"], c["causal"], c["mode"]) for c in cells} == {
        (d, s, c, m) for d in (64, 128) for s in (1024, 4096) for c in (False, True) for m in ("fwd", "fwd_bwd")}
    assert len(_bench.shapes(quick=True)) == 2
    cell = {"B": 16, "H": 16, "S": 1024, "D": 128, "causal": True, "mode": "fwd_bwd"}
    assert _bench.flops(cell) == 4 * 16 * 16 * 1024 ** 2 * 128 / 2 * 3.5


def test_fa4_is_optional(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    found, reason = _bench.providers()
    assert list(found) == ["flash_cuda", "sdpa"] and "flash_attn.cute is not importable" in reason
    assert _bench.providers(with_fa4=False)[1] == "left out (--no-fa4)"


# ---------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_selftest_passes_on_the_gpu():
    proc = _cli()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: flash_cuda works here." in proc.stdout and "FAIL" not in proc.stdout
    assert proc.stdout.count("  PASS  ") == len(_selftest.cases())
    proc = _cli("--json")
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"] and report["build"]["available"] and report["build"]["origin"]
    assert all(c["passed"] for c in report["selftest"]) and report["gpus"][0]["supported"]
    major, minor = torch.cuda.get_device_capability()
    assert report["gpus"][0]["capability"] == f"{major}.{minor}"


@pytest.mark.gpu
def test_quick_bench_on_the_gpu():
    proc = _cli("--bench", "--quick", "--no-fa4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"flash_cuda TFLOPS\s+sdpa TFLOPS\s+fc/sdpa", proc.stdout), proc.stdout
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\s+128\s+1024\s+16\s+16\s+yes\s+fwd", line)]
    assert len(rows) == 2, proc.stdout
    for line in rows:
        tflops, sdpa, ratio = (float(x) for x in line.split()[-3:])
        assert tflops > 0 and sdpa > 0 and abs(ratio - tflops / sdpa) < 0.01 + 0.01 * ratio


class _WallClockEvent:
    """torch.cuda.Event on the host clock, for the benchmark's loop on CPU."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        import time
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_bench_loop_on_the_cpu_mock(mock_extension, monkeypatch):
    """The benchmark's loop, timing and table on CPU (flash_cuda through the mock extension, SDPA),
    at a tiny shape; a provider that fails a cell is reported and the others go on."""
    monkeypatch.setattr(torch.cuda, "Event", _WallClockEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(_bench, "shapes", lambda quick=False: [
        {"D": 16, "S": 32, "B": 1, "H": 2, "causal": c, "mode": m} for c in (False, True) for m in ("fwd", "fwd_bwd")])
    monkeypatch.setattr(_bench, "MIN_REPS", 1)
    monkeypatch.setattr(_bench, "TARGET_MS", 0.0)
    monkeypatch.setattr(_bench, "WARMUP", 1)
    monkeypatch.setattr(_bench, "fa4", lambda: (None, "not here"))
    import io

    progress = io.StringIO()
    result = _bench.run(progress=progress, device="cpu")
    assert result["providers"] == ["flash_cuda", "sdpa"] and result["fa4_reason"] == "not here"
    assert len(result["rows"]) == 4 and progress.getvalue().count("\n") == 8
    for row in result["rows"]:
        assert row["flash_cuda_tflops"] > 0 and row["sdpa_tflops"] > 0, row
        assert row["ratio_sdpa"] == pytest.approx(row["flash_cuda_tflops"] / row["sdpa_tflops"])
    assert mock_extension.bwd_calls > 0
    text = "\n".join(cli._bench_text(result))
    assert re.search(r"\n\s+16\s+32\s+1\s+2\s+yes\s+fwd_bwd\s+[\d.]+\s+[\d.]+\s+[\d.]+", text), text

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(mock_extension, "fwd", broken)
    monkeypatch.setattr(_ext._C, "fwd", broken)
    result = _bench.run(progress=io.StringIO(), device="cpu")
    row = result["rows"][0]
    assert row["flash_cuda_tflops"] is None and "no kernel for this" in row["flash_cuda_error"]
    assert row["sdpa_tflops"] > 0 and row["ratio_sdpa"] is None
    assert "flash_cuda D=16 S=32 fwd: RuntimeError: no kernel for this" in "\n".join(cli._bench_text(result))
