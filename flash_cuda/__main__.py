"""Checks a flash_cuda installation and shows what it does on this machine's GPU:

    python3 -m flash_cuda            # versions, GPUs, the kernels' build, a self-test
    python3 -m flash_cuda --json     # the same as one JSON object on stdout
    python3 -m flash_cuda --bench    # also a short benchmark against SDPA (and FlashAttention-4)
    python3 -m flash_cuda --bench --quick   # one shape; the self-test's first two cases

It loads the kernels as their first use does (compiling them once when no build serves this
GPU: the one line that says so goes to stderr), then runs the forward and backward of a few
small problems against flash_cuda.reference in float64 (flash_cuda/_selftest.py has the rule).
Progress goes to stderr, the report to stdout.

Exit status: 0 when the kernels load and every self-test case (and every flash_cuda cell of
--bench) passes; 1 when the kernels cannot be loaded or run here (the report names the reason
and the fix: a CPU-only torch, no GPU, a GPU below compute capability 8.0, nvcc missing or of
another CUDA major version than torch's, CUDA_HOME wrong, toolkit headers missing, a failed
build); 2 when a self-test case or a flash_cuda benchmark cell fails.

``--json`` prints one object (schema 1):

    {"schema": 1,
     "ok": bool, "exit_code": 0 | 1 | 2, "problem": null | str,        # why ok is false
     "versions": {"flash_cuda", "torch", "cuda" (torch's; null for a CPU-only torch), "cudnn",
                  "driver", "driver_cuda" (the CUDA version the driver supports), "cuda_home",
                  "nvcc" (path or null), "nvcc_version", "python"},
     "gpus": [{"index", "name", "capability" ("9.0"), "sms", "memory_gib",
               "smem_per_block_optin_kib", "gpu_class", "smem_budget_kib", "emulated_arch",
               "supported", "kernels": {"float16": [...], "bfloat16": [...], "float32": [...]}}],
     "build": {"available", "origin": "wheel" | "cache" | "compiled" | null, "module",
               "directory", "archs", "cache_root", "sources", "reason" (null when available),
               "toolkit_problem" (what a build at first use would lack here; null when nothing
               or torch is CPU-only)},
     "selftest": null | [{"name", "passed", "seconds", "problem", "errors": {output: {"error",
                          "naive", "tol"}}}],              # a non-finite error is null
     "bench": null | {"dtype", "providers", "fa4_reason", "rows": [{"D", "S", "B", "H", "causal",
                      "mode", "<provider>_tflops", "ratio_sdpa", "ratio_fa4" (with fa4)}]}}

Kernel names are those of ``flash_cuda.attention(kernel=...)``: "wgmma" (the Hopper tier: the
warp-specialized TMA kernels and wgmma), "mma" (mma.sync tensor cores), "simt" (float32).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path
from typing import List, Optional

SCHEMA = 1
OK, UNAVAILABLE, FAILED = 0, 1, 2


def _problem(build: dict, gpus: List[dict], cuda_ok: bool) -> Optional[str]:
    """Why the kernels cannot run here (None when they can)."""
    if not build["available"]:
        return build["reason"]
    if not cuda_ok or not gpus:
        return ("flash_cuda's kernels are loaded, but torch sees no GPU (torch.cuda.is_available() is False: "
                "no NVIDIA GPU, a driver older than this torch's CUDA, or CUDA_VISIBLE_DEVICES hides them)")
    if not gpus[0]["supported"]:
        return (f"flash_cuda needs an NVIDIA GPU of compute capability 8.0 or newer; GPU 0 ({gpus[0]['name']}) "
                f"has {gpus[0]['capability']}")
    return None


def collect(bench: bool = False, quick: bool = False, with_fa4: bool = True) -> dict:
    """The report as a dict (the --json schema)."""
    import torch

    from . import _report

    report = {"schema": SCHEMA, "ok": False, "exit_code": UNAVAILABLE, "problem": None,
              "versions": _report.versions()}
    report["build"] = _report.build(report["versions"])  # loads the kernels (compiling them at first use)
    report["gpus"] = _report.gpus(report["build"]["archs"])
    report["selftest"] = report["bench"] = None
    problem = _problem(report["build"], report["gpus"], torch.cuda.is_available())
    code = UNAVAILABLE if problem else OK
    if not problem:
        from . import _selftest

        print("flash_cuda: self-test ...", file=sys.stderr, flush=True)
        report["selftest"] = _selftest.run(quick=quick)
        failed = [c["name"] for c in report["selftest"] if not c["passed"]]
        if failed:
            code, problem = FAILED, f"self-test failed: {', '.join(failed)}"
        if bench:
            from . import _bench

            report["bench"] = _bench.run(quick=quick, with_fa4=with_fa4)
            broken = [r for r in report["bench"]["rows"] if r.get("flash_cuda_error")]
            if broken:
                code = FAILED
                problem = "; ".join(filter(None, [problem, f"flash_cuda failed in {len(broken)} benchmark cells: "
                                                           f"{broken[0]['flash_cuda_error']}"]))
    report.update(ok=code == OK, exit_code=code, problem=problem)
    return report


# ---------------------------------------------------------------------------------------
# The text report
# ---------------------------------------------------------------------------------------


def _or(value, missing: str = "none") -> str:
    return missing if value is None else str(value)


def _versions_text(v: dict) -> List[str]:
    nvcc = (f"{v['nvcc']} (CUDA {_or(v['nvcc_version'], '?')}; CUDA_HOME {v['cuda_home']})" if v["nvcc"]
            else f"not found (CUDA_HOME: {_or(v['cuda_home'])})")
    return ["versions",
            f"  flash_cuda   {v['flash_cuda']}",
            f"  torch        {v['torch']} (CUDA {_or(v['cuda'], 'none: a CPU-only build')}, cuDNN {_or(v['cudnn'])})",
            f"  driver       {_or(v['driver'], 'none found')} (supports CUDA {_or(v['driver_cuda'], '-')})",
            f"  nvcc         {nvcc}",
            f"  python       {v['python']}"]


def _kernels_text(kernels: dict) -> str:
    half = " + ".join(kernels["float16"]) or "none"
    return f"fp16/bf16: {half}; fp32: {' + '.join(kernels['float32']) or 'none'}"


def _gpus_text(gpus: List[dict]) -> List[str]:
    lines = ["GPUs"]
    if not gpus:
        return lines + ["  none visible to torch"]
    for g in gpus:
        smem = g["smem_per_block_optin_kib"]
        lines.append(f"  [{g['index']}] {g['name']}: compute capability {g['capability']}, {g['sms']} SMs, "
                     f"{g['memory_gib']} GiB, {_or(smem, '?')} KiB shared memory per block (opt-in)")
        emulated = f", chosen as sm_{g['emulated_arch']} (FLASH_CUDA_EMULATE_ARCH)" if g["emulated_arch"] else ""
        budget = f" (tiles for {g['smem_budget_kib']} KiB)" if g["smem_budget_kib"] else ""
        lines.append(f"      class {g['gpu_class']}{budget}{emulated}")
        lines.append(f"      kernels {_kernels_text(g['kernels'])}")
    from ._report import KERNEL_NOTES

    used = [k for k in KERNEL_NOTES if any(k in g["kernels"][dt] for g in gpus for dt in g["kernels"])]
    lines.append("  (" + "; ".join(f"{k}: {KERNEL_NOTES[k]}" for k in used) + ")")
    return lines


ORIGINS = {"wheel": "built into the installed package (flash_cuda._C)",
           "cache": "loaded from the cache (compiled earlier)",
           "compiled": "compiled now into the cache"}


def _build_text(b: dict) -> List[str]:
    lines = ["build"]
    if b["available"]:
        lines.append(f"  kernels      {ORIGINS.get(b['origin'], b['origin'])}")
        lines.append(f"  module       {b['module']}")
        if b["directory"]:
            lines.append(f"  directory    {b['directory']}")
        archs = ", ".join(f"sm_{a}" for a in b["archs"]) if b["archs"] else "not recorded"
        lines.append(f"  archs        {archs}")
    else:
        lines.append("  kernels      not available")
    if b["available"]:
        toolkit = b["toolkit_problem"].split(". ")[0] if b["toolkit_problem"] else "ready to compile"
        lines.append(f"  toolkit      {toolkit} (needed only for a build for other GPUs or after an upgrade)")
    lines.append(f"  cache        {b['cache_root']}")
    lines.append(f"  sources      {_or(b['sources'], 'not installed')}")
    return lines


def _selftest_text(cases: List[dict]) -> List[str]:
    lines = ["self-test (error vs float64 <= 2 x the naive same-dtype error + a small abs term)"]
    for c in cases:
        worst = max(c["errors"].items(), key=lambda kv: kv[1]["error"] / kv[1]["tol"] if kv[1]["tol"] else 0,
                    default=None)
        detail = (f"worst {worst[0]} {worst[1]['error']:.1e} (tol {worst[1]['tol']:.1e})" if worst else "")
        lines.append(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['name']}  {detail}  {c['seconds']:.2f} s")
        if c["problem"]:
            lines.append(f"        {c['problem']}")
    return lines


def _bench_text(bench: dict) -> List[str]:
    names = bench["providers"]
    ratios = [n for n in ("sdpa", "fa4") if n in names]
    head = ["D", "S", "B", "H", "causal", "mode"] + [f"{n} TFLOPS" for n in names] + [f"fc/{n}" for n in ratios]
    rows = []
    for r in bench["rows"]:
        cells = [str(r["D"]), str(r["S"]), str(r["B"]), str(r["H"]), "yes" if r["causal"] else "no", r["mode"]]
        cells += ["err" if r.get(f"{n}_tflops") is None else f"{r[f'{n}_tflops']:.1f}" for n in names]
        cells += ["-" if r.get(f"ratio_{n}") is None else f"{r[f'ratio_{n}']:.2f}" for n in ratios]
        rows.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [f"benchmark ({bench['dtype']}, same run, median of CUDA-event timings; fc = flash_cuda, "
             f"sdpa = torch's scaled_dot_product_attention with its default backend)",
             "  " + "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(cells, widths)) for cells in rows]
    if bench["fa4_reason"]:
        lines.append(f"  FlashAttention-4 not compared: {bench['fa4_reason']}")
    for r in bench["rows"]:
        for n in names:
            if r.get(f"{n}_error"):
                lines.append(f"  {n} D={r['D']} S={r['S']} {r['mode']}: {r[f'{n}_error']}")
    return lines


def render(report: dict) -> str:
    import flash_cuda

    lines = [f"flash_cuda {report['versions']['flash_cuda']} ({Path(flash_cuda.__file__).parent})", ""]
    for part in (_versions_text(report["versions"]), _gpus_text(report["gpus"]), _build_text(report["build"])):
        lines += part + [""]
    if report["selftest"] is not None:
        lines += _selftest_text(report["selftest"]) + [""]
    if report["bench"] is not None:
        lines += _bench_text(report["bench"]) + [""]
    if report["ok"]:
        lines.append("OK: flash_cuda works here.")
    else:
        verdict = "NOT USABLE HERE" if report["exit_code"] == UNAVAILABLE else "FAILED"
        lines.append(f"{verdict} (exit {report['exit_code']}):")
        for paragraph in str(report["problem"]).split("\n\n"):
            lines += ["  " + line for line in textwrap.wrap(" ".join(paragraph.split()), 96)]
    return "\n".join(lines)


def _strict(value):
    """``value`` with NaN and infinities as null, so that the output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m flash_cuda",
        description="Check a flash_cuda installation: versions, GPUs, the kernels' build and a self-test.")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object (schema in "
                                                            "flash_cuda/__main__.py)")
    parser.add_argument("--bench", action="store_true", help="also time flash_cuda, SDPA and FlashAttention-4 "
                                                             "(when flash_attn.cute imports) on a few shapes")
    parser.add_argument("--quick", action="store_true", help="a shorter self-test and benchmark (one shape)")
    parser.add_argument("--no-fa4", action="store_true", help="leave FlashAttention-4 out of --bench")
    args = parser.parse_args(argv)
    report = collect(bench=args.bench, quick=args.quick, with_fa4=not args.no_fa4)
    print(json.dumps(_strict(report), indent=1, allow_nan=False) if args.json else render(report))
    return report["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
