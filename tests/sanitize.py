"""Run the flash_cuda kernels under NVIDIA compute-sanitizer and summarise the findings.

Usage:
    python tests/sanitize.py [--tools memcheck,racecheck,synccheck,initcheck] [--out DIR]
                             [--workload cases|kvcache] [--only I,J]
                             [--compute-sanitizer PATH] [--all-kernels]
                             [--timeout SECONDS] [--dry-run]

For each tool this runs

    compute-sanitizer --tool <tool> --error-exitcode 1 --report-api-errors no [tool options] \\
        python tests/sanitize_cases.py [--only I,J]      (--workload cases, the default)
        python tests/sanitize_kvcache.py                  (--workload kvcache)

with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every tensor is its own cudaMalloc, so memcheck and
initcheck see the real allocation bounds) and CUDA_MODULE_LOADING=LAZY. The workload
(tests/sanitize_cases.py) runs every kernel tier forward and backward on small odd-sized
problems and checks the results against float64, so a sanitized run is also a test
(memcheck, synccheck; racecheck and initcheck run it without the comparison, see
NO_CHECK_TOOLS).

Tool options:
  memcheck   --padding 256 (red zones after every allocation) and, unless --all-kernels,
             --kernel-name kns=flash_cuda (only flash_cuda's kernels are instrumented:
             PyTorch's reference kernels run at full speed).
  racecheck  --racecheck-report all, kernel filter as above.
  synccheck  kernel filter as above.
  initcheck  no kernel filter: initcheck learns which bytes are initialised by watching
             every kernel's stores, so PyTorch's kernels must be instrumented too. Only
             reports inside flash_cuda kernels count as findings; reports inside other
             kernels are listed in the "other" column (and in the log) but do not fail.
             It runs with FLASH_CUDA_WS_TMA_STORE=0 (see INITCHECK_ENV).

Every tool's full output goes to DIR/<tool>.log (default DIR: sanitize-logs). The script
prints a table (tool, cases passed, findings, other, exit code, seconds) and exits 1 when
a tool reports a finding in a flash_cuda kernel (for racecheck: any hazard, error or
warning), a case fails, or a tool cannot run (2: compute-sanitizer not found).
Each tool takes a few minutes on an H200 (the sanitizer slows kernels 10-100x).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

HERE = Path(__file__).resolve().parent
# The workloads: every tier's forward and backward, and the KV-cache kernels (decode, append,
# the prefill route). Each prints "<name>: P/N cases passed" last.
WORKLOADS = {"cases": HERE / "sanitize_cases.py", "kvcache": HERE / "sanitize_kvcache.py"}
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
KERNEL_FILTER = "kns=flash_cuda"  # every flash_cuda kernel lives in namespace flash_cuda

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
_RACE_SUMMARY = re.compile(
    r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")
_CASES_LINE = re.compile(r"sanitize_(?:cases|kvcache):\s*(\d+)/(\d+) cases passed")
_RECORD_PREFIX = "========= "
# Lines of the sanitizer's own output that do not open an error record.
_NOT_A_RECORD = re.compile(
    r"^(ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER|LEAK SUMMARY|Target application"
    r"|Program hit|Saved host backtrace|Note:|Warning:|Error: process didn't terminate)")


@dataclasses.dataclass
class ToolResult:
    tool: str
    command: List[str]
    log: Path
    exit_code: Optional[int] = None
    seconds: float = 0.0
    error_summary: Optional[int] = None
    race_hazards: Optional[int] = None
    race_errors: int = 0
    race_warnings: int = 0
    records: int = 0  # error records in the log
    flash_records: int = 0  # ... whose first lines name a flash_cuda kernel
    cases_passed: Optional[int] = None
    cases_total: Optional[int] = None
    filtered: bool = True
    note: str = ""

    @property
    def findings(self) -> int:
        """Reports that concern flash_cuda's kernels."""
        if not self.filtered:
            return self.flash_records
        n = self.error_summary or 0
        if self.race_hazards is not None:
            n = max(n, self.race_errors + self.race_warnings)
        return max(n, self.flash_records)

    @property
    def other(self) -> int:
        """Reports in other kernels (only counted when the tool saw every kernel)."""
        if self.filtered:
            return 0
        return max(0, max(self.records, self.error_summary or 0) - self.flash_records)

    @property
    def workload_ok(self) -> bool:
        return (self.cases_total is not None and self.cases_total > 0
                and self.cases_passed == self.cases_total)

    @property
    def ok(self) -> bool:
        return not self.note and self.findings == 0 and self.workload_ok

    @property
    def cases(self) -> str:
        if self.cases_total is None:
            return "-"
        return f"{self.cases_passed}/{self.cases_total}"


def find_compute_sanitizer(explicit: Optional[str]) -> Optional[str]:
    if explicit:
        return explicit
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            cand = Path(root) / "bin" / "compute-sanitizer"
            if cand.exists():
                return str(cand)
            cand = Path(root) / "compute-sanitizer" / "compute-sanitizer"
            if cand.exists():
                return str(cand)
    return None


def build_command(sanitizer: str, tool: str, *, all_kernels: bool, python: str,
                  workload_args: List[str], extra: List[str], workload: str = "cases") -> List[str]:
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", "1", "--report-api-errors", "no"]
    if tool == "memcheck":
        cmd += ["--padding", "256"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "all"]
    if tool != "initcheck" and not all_kernels:
        cmd += ["--kernel-name", KERNEL_FILTER]
    cmd += extra
    cmd += [python, str(WORKLOADS[workload])] + workload_args
    return cmd


def split_records(text: str) -> List[str]:
    """Splits a compute-sanitizer log into error records: a record opens with a line
    '========= <message>' (no indentation after the prefix) and runs until the next one."""
    records: List[List[str]] = []
    current: Optional[List[str]] = None
    for line in text.splitlines():
        if line.startswith(_RECORD_PREFIX):
            body = line[len(_RECORD_PREFIX):]
            if body and not body[0].isspace():
                if _NOT_A_RECORD.match(body):
                    current = None
                    continue
                current = [body]
                records.append(current)
            elif current is not None and body.strip():
                current.append(body.strip())
        else:
            current = None
    return ["\n".join(r) for r in records]


def _names_flash_kernel(record: str) -> bool:
    """True when the record's message or its first 'at <function>' frame is in flash_cuda
    (the host backtrace further down may name flash_cuda for other kernels too)."""
    lines = record.splitlines()
    if "flash_cuda" in lines[0]:
        return True
    for line in lines[1:4]:
        if line.startswith("at ") or line.startswith("in "):
            return "flash_cuda" in line
    return False


def parse_log(text: str, result: ToolResult) -> None:
    m = _ERROR_SUMMARY.findall(text)
    result.error_summary = int(m[-1]) if m else None
    r = _RACE_SUMMARY.findall(text)
    if r:
        result.race_hazards, result.race_errors, result.race_warnings = map(int, r[-1])
    c = _CASES_LINE.findall(text)
    if c:
        result.cases_passed, result.cases_total = map(int, c[-1])
    records = split_records(text)
    result.records = len(records)
    result.flash_records = sum(_names_flash_kernel(rec) for rec in records)


# Tools whose workload runs without the float64 comparison. The comparison's reference
# matmuls go through cuBLAS's Hopper kernels, which write through the tensor-memory
# accelerator: under racecheck they end in "Internal Sanitizer Error: failed to handle a
# hardware exception", and initcheck does not see those writes, so the next PyTorch kernel
# reading the product is reported as an uninitialised read (both seen on the H200; neither
# involves a flash_cuda kernel). The memcheck and synccheck runs keep the comparison.
NO_CHECK_TOOLS = ("racecheck", "initcheck")

# initcheck does not see the writes of TMA stores either: with the Hopper forward's default
# epilogue (O written by cp.async.bulk.tensor from shared memory) every later read of O, the
# backward's delta preprocess first, is reported as uninitialised (seen on the H100: 100
# reports in bwd_preprocess_delta_kernel and 300k+ in PyTorch's kernels for case 37; none
# with the lane copy). initcheck therefore runs the forward's lane copy of O; the TMA store
# stays covered by memcheck, racecheck and synccheck here and by the NaN-poisoned outputs of
# the pytest suite (an element it failed to write fails there).
INITCHECK_ENV = {"FLASH_CUDA_WS_TMA_STORE": "0"}


def workload_args_for(tool: str, args) -> List[str]:
    workload_args = ["--only", args.only] if args.only else []
    if args.no_check or tool in NO_CHECK_TOOLS:
        workload_args.append("--no-check")
    return workload_args


def run_tool(tool: str, args, sanitizer: str, out_dir: Path) -> ToolResult:
    workload_args = workload_args_for(tool, args)
    cmd = build_command(sanitizer, tool, all_kernels=args.all_kernels, python=args.python,
                        workload_args=workload_args, extra=shlex.split(args.sanitizer_args),
                        workload=args.workload)
    result = ToolResult(tool=tool, command=cmd, log=out_dir / f"{tool}.log",
                        filtered=tool != "initcheck" and not args.all_kernels)
    env = dict(os.environ)
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env.setdefault("CUDA_MODULE_LOADING", "LAZY")
    env["PYTHONUNBUFFERED"] = "1"
    if tool == "initcheck":
        env.update(INITCHECK_ENV)
    print(f"[{tool}] {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    t0 = time.perf_counter()
    with open(result.log, "w") as log:
        log.write(f"# {' '.join(shlex.quote(c) for c in cmd)}\n")
        log.flush()
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=str(HERE.parent), timeout=args.timeout)
            result.exit_code = proc.returncode
        except subprocess.TimeoutExpired:
            result.note = f"timed out after {args.timeout} s"
        except OSError as exc:
            result.note = f"could not start: {exc}"
    result.seconds = time.perf_counter() - t0
    parse_log(result.log.read_text(errors="replace"), result)
    # racecheck closes with "RACECHECK SUMMARY: N hazards ...", the other tools with
    # "ERROR SUMMARY: N errors".
    summary_seen = (result.race_hazards is not None if tool == "racecheck"
                    else result.error_summary is not None)
    if not result.note and not summary_seen:
        result.note = ("no RACECHECK SUMMARY" if tool == "racecheck" else "no ERROR SUMMARY") + \
            " in the log (did the sanitizer run?)"
    status = "ok" if result.ok else "FAIL"
    print(f"[{tool}] {status}: cases {result.cases}, findings {result.findings}, "
          f"exit {result.exit_code}, {result.seconds:.0f} s -> {result.log}", flush=True)
    return result


def print_table(results: List[ToolResult]) -> None:
    header = ("tool", "cases", "findings", "other", "exit", "seconds", "status", "log")
    rows = []
    for r in results:
        status = "ok" if r.ok else ("FAIL: " + (r.note or ("findings" if r.findings else
                                                           "workload failed")))
        rows.append((r.tool, r.cases, str(r.findings), str(r.other) if not r.filtered else "-",
                     "-" if r.exit_code is None else str(r.exit_code), f"{r.seconds:.0f}",
                     status, str(r.log)))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:{w}s}}" for w in widths)
    print()
    print(fmt.format(*header).rstrip())
    print(fmt.format(*("-" * w for w in widths)))
    for row in rows:
        print(fmt.format(*row).rstrip())


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the flash_cuda kernels under compute-sanitizer (memcheck, racecheck, "
                    "synccheck, initcheck) and summarise the findings.",
        epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help=f"comma-separated subset of {','.join(TOOLS)} (default: all)")
    parser.add_argument("--out", default="sanitize-logs", metavar="DIR",
                        help="directory for the full logs (default: sanitize-logs)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cases",
                        help="cases: sanitize_cases.py, every tier forward and backward (default); "
                             "kvcache: sanitize_kvcache.py, decode, append and the prefill route")
    parser.add_argument("--only", metavar="I,J",
                        help="run only these sanitize_cases indices (see: python "
                             "tests/sanitize_cases.py --list)")
    parser.add_argument("--compute-sanitizer", metavar="PATH",
                        help="the compute-sanitizer executable (default: PATH, then "
                             "$CUDA_HOME/bin, /usr/local/cuda/bin)")
    parser.add_argument("--all-kernels", action="store_true",
                        help="instrument every kernel, not only flash_cuda's (slower)")
    parser.add_argument("--no-check", action="store_true",
                        help="workload runs flash_cuda without the float64 comparison")
    parser.add_argument("--sanitizer-args", default="", metavar="ARGS",
                        help="extra compute-sanitizer options, one quoted string")
    parser.add_argument("--python", default=sys.executable,
                        help="python interpreter for the workload (default: this one)")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds per tool before it is stopped (default: 1800)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands without running them")
    args = parser.parse_args(argv)
    if args.only and args.workload != "cases":
        parser.error("--only picks sanitize_cases indices; it applies to --workload cases only")

    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        parser.error(f"unknown tool(s) {unknown}; choose from {','.join(TOOLS)}")

    sanitizer = find_compute_sanitizer(args.compute_sanitizer)
    if args.dry_run:
        for tool in tools:
            cmd = build_command(sanitizer or "compute-sanitizer", tool,
                                all_kernels=args.all_kernels, python=args.python,
                                workload_args=workload_args_for(tool, args),
                                extra=shlex.split(args.sanitizer_args), workload=args.workload)
            print(" ".join(shlex.quote(c) for c in cmd))
        return 0
    if sanitizer is None:
        print("sanitize.py: compute-sanitizer not found (install the CUDA toolkit or pass "
              "--compute-sanitizer PATH)", file=sys.stderr)
        return 2

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = [run_tool(tool, args, sanitizer, out_dir) for tool in tools]
    print_table(results)
    bad = [r.tool for r in results if not r.ok]
    if bad:
        print(f"\nsanitize.py: FAILED ({', '.join(bad)}); see the logs in {out_dir}/")
        return 1
    print(f"\nsanitize.py: all {len(results)} tools clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
