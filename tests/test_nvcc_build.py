"""Compile every kernel instance with nvcc alone (no torch, no GPU) for sm_80 and sm_90a
and fail on register spills or local-memory stack frames reported by ptxas.

Runs wherever nvcc is on PATH (CI has it; no GPU needed). Kernels include no torch
header, which is what makes this check possible; a test below keeps it that way.
"""

import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTANCES = sorted((ROOT / "csrc" / "instances").glob("*.cu"))
ARCHS = {"sm_80": "-gencode=arch=compute_80,code=sm_80", "sm_90a": "-gencode=arch=compute_90a,code=sm_90a"}

# Kernels allowed to spill, with the measured reason. Empty: nothing spills.
SPILL_ALLOW = {}

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)

_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_report(src: Path, arch: str):
    """Returns [(kernel, stack, spill_stores, spill_loads)] for one instance file."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, "-std=c++17", "-cubin", ARCHS[arch], "-Xptxas", "-v", "--expt-relaxed-constexpr",
               "-I", str(ROOT / "csrc"), str(src), "-o", os.path.join(tmp, "out.cubin")]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise AssertionError(f"nvcc failed for {src.name} ({arch}):\n{res.stderr[-4000:]}")
    rows, current = [], None
    for line in res.stderr.splitlines():
        m = _FUNC.search(line)
        if m:
            current = m.group(1)
            continue
        m = _SPILL.search(line)
        if m and current:
            rows.append((current, *map(int, m.groups())))
            current = None
    return rows


@pytest.fixture(scope="module")
def reports():
    if NVCC is None:
        pytest.skip("nvcc not found: the kernel compile check needs the CUDA toolkit (no GPU needed)")
    jobs = [(src, arch) for src in INSTANCES for arch in ARCHS]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda j: (j, _ptxas_report(*j)), jobs))
    return {(src.name, arch): rows for (src, arch), rows in results}


def test_instances_exist():
    names = {p.name for p in INSTANCES}
    for tier in ("mma_fwd", "mma_bwd"):
        for dt in ("fp16", "bf16"):
            for d in (32, 64, 96, 128, 192, 256):
                assert f"{tier}_{dt}_d{d}.cu" in names
    for tier in ("simt_fwd", "simt_bwd"):
        for d in (32, 64, 128, 256):
            assert f"{tier}_d{d}.cu" in names
    for tier in ("sm90_fwd", "sm90_bwd"):
        for dt in ("fp16", "bf16"):
            for d in (64, 128):
                assert f"{tier}_{dt}_d{d}.cu" in names


def test_wgmma_ops_header_is_generated():
    """wgmma_ops.cuh is the output of gen_wgmma_ops.py: regenerating it changes nothing."""
    import importlib.util
    kernels = ROOT / "csrc" / "kernels"
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(kernels / "gen_wgmma_ops.py", tmp)
        spec = importlib.util.spec_from_file_location("gen_wgmma_ops", Path(tmp) / "gen_wgmma_ops.py")
        gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen)
        gen.main()
        fresh = (Path(tmp) / "wgmma_ops.cuh").read_text()
    assert fresh == (kernels / "wgmma_ops.cuh").read_text(), "run csrc/kernels/gen_wgmma_ops.py"


def test_no_spills(reports):
    bad = []
    for (name, arch), rows in sorted(reports.items()):
        assert rows, f"ptxas reported no kernel for {name} ({arch})"
        for kernel, stack, stores, loads in rows:
            if (stack or stores or loads) and (name, arch) not in SPILL_ALLOW:
                bad.append(f"{name} [{arch}] {kernel}: stack {stack} B, spill stores {stores} B, loads {loads} B")
    assert not bad, "register spills / stack frames:\n" + "\n".join(bad)


def test_kernels_include_no_torch():
    for path in list((ROOT / "csrc" / "kernels").glob("*")) + INSTANCES + [ROOT / "csrc" / "flash_params.h",
                                                                          ROOT / "csrc" / "launch.h"]:
        text = path.read_text()
        assert not re.search(r"#include\s*[<\"](torch|ATen|c10)/", text), f"{path.name} includes a torch header"
