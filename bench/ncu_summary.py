#!/usr/bin/env python
"""Summarise an Nsight Compute report per kernel.

    python bench/ncu_summary.py report.ncu-rep            # runs: ncu --import report.ncu-rep
                                                          #       --csv --page raw
    python bench/ncu_summary.py report.ncu-rep --save-csv report.csv
    python bench/ncu_summary.py --csv-in report.csv       # a CSV saved earlier (no ncu needed)

For every kernel (launches of the same kernel with the same grid and block are merged; the
median is shown, --per-launch keeps them apart) it prints: name (shortened), duration,
achieved occupancy, registers per thread, shared memory per block (static + dynamic),
tensor-pipe utilisation, FMA-pipe utilisation, DRAM throughput (% of peak and GB/s), L2 hit
rate and the top 3 warp-stall reasons. Metric names differ between ncu versions, so each
quantity is looked up through a list of candidate names; a quantity that is missing prints
"n/a".

Both CSV shapes of ncu are understood:
  * raw page (`--page raw`): a header row of metric names, a row of units, one row per
    kernel launch;
  * long shape (`--page details`, or `ncu --csv --metrics ...`): one row per metric with
    "Metric Name", "Metric Unit", "Metric Value" columns. The details page has no pipe or
    stall breakdown; those print n/a.

Only the standard library is used (the parser is unit-tested on CPU).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

# ----------------------------------------------------------------------------------------
# Candidate metric names (first one present wins)
# ----------------------------------------------------------------------------------------

# Each entry: a raw metric name, or (name, unit-kind) where unit-kind restricts a
# human-readable name of the details page to values of that kind ("%", "rate", ...).
CANDIDATES = {
    "duration": ["gpu__time_duration.sum", "gpu__time_duration.avg", ("Duration", "time")],
    "occupancy": ["sm__warps_active.avg.pct_of_peak_sustained_active",
                  ("Achieved Occupancy", "%")],
    "registers": ["launch__registers_per_thread", ("Registers Per Thread", None)],
    "smem_static": ["launch__shared_mem_per_block_static",
                    ("Static Shared Memory Per Block", "bytes")],
    "smem_dynamic": ["launch__shared_mem_per_block_dynamic",
                     ("Dynamic Shared Memory Per Block", "bytes")],
    "smem_total": ["launch__shared_mem_per_block", ("Shared Memory Per Block", "bytes")],
    "tensor_pipe": ["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
                    "sm__pipe_tensor_cycles_active_v2.avg.pct_of_peak_sustained_active",
                    "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",
                    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
                    "sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active",
                    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed",
                    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"],
    "fma_pipe": ["sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
                 "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active"],
    "dram_pct": ["dram__throughput.avg.pct_of_peak_sustained_elapsed",
                 "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
                 ("DRAM Throughput", "%")],
    "dram_rate": ["dram__bytes.sum.per_second", ("Memory Throughput", "rate")],
    "l2_hit": ["lts__t_sector_hit_rate.pct", ("L2 Hit Rate", "%")],
}
# Fallback patterns when no candidate is present (largest matching value wins).
FALLBACK_PATTERNS = {
    "tensor_pipe": re.compile(r"^sm__(pipe|inst_executed_pipe)_tensor.*pct_of_peak_sustained"
                              r"_(active|elapsed)$"),
}

# Warp-stall metric families, in order of preference. Group 1 = the reason.
STALL_FAMILIES = [
    # cycles a warp spends stalled on <reason> per issued instruction (WarpStateStats)
    (re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$"),
     "cycles per issued instruction"),
    (re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)(?:\.ratio|\.avg|\.sum)?$"),
     "cycles per issued instruction"),
    (re.compile(r"^smsp__warp_issue_stalled_(\w+?)_per_warp_active\.pct$"),
     "% of active warp cycles"),
    (re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)(?:_per_\w+)?\.(?:pct|ratio)$"),
     "as reported by ncu"),
    # PC sampling counts (SourceCounters / WarpStateStats sampling); shown as % of samples
    (re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+?)(?:\.sum)?$"), "% of samples"),
]
# "selected" means the warp issued: not a stall. "_not_issued" variants double count.
NOT_A_STALL = {"selected"}

# Identity columns of ncu's CSV (everything else in the raw page is a metric).
ID_COLUMNS = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context",
              "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name",
              "Metric Name", "Metric Unit", "Metric Value", "Rule Name", "Rule Type",
              "Rule Description", "Estimated Speedup Type", "Estimated Speedup"}


# ----------------------------------------------------------------------------------------
# Numbers and units
# ----------------------------------------------------------------------------------------

def parse_number(text) -> float | None:
    """'1,234.5' -> 1234.5; '', 'n/a', '(128, 1, 1)' -> None. (ncu prints thousands
    separators in en-US style.)"""
    if text is None:
        return None
    t = str(text).strip().replace(",", "")
    if not t or t.lower() in ("n/a", "nan", "-"):
        return None
    try:
        return float(t)
    except ValueError:
        return None


_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_TIME = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "msecond": 1e-3,
         "ms": 1e-3, "second": 1.0, "s": 1.0, "sec": 1.0}


def _bytes_factor(unit: str) -> float | None:
    """Bytes per unit: 'byte' 1, 'Kbyte' 1e3 (ncu is decimal), 'KiB' / 'Kibyte' 1024."""
    m = re.fullmatch(r"([KMGTP]i?|k)?(?:byte|bytes|B)", unit.strip())
    if not m:
        return None
    return _PREFIX[m.group(1) or ""]


def to_seconds(value: float | None, unit: str) -> float | None:
    if value is None:
        return None
    factor = _TIME.get(unit.strip())
    return value * factor if factor is not None else None


def to_bytes(value: float | None, unit: str) -> float | None:
    """'byte', 'Kbyte', 'Kbyte/block' (details page), '' -> bytes."""
    if value is None:
        return None
    unit = unit.strip()
    if unit.endswith("/block"):
        unit = unit[: -len("/block")]
    if not unit:  # a unitless count of bytes
        return value
    factor = _bytes_factor(unit)
    return value * factor if factor is not None else None


def to_bytes_per_second(value: float | None, unit: str) -> float | None:
    """'Tbyte/second', 'Gbyte/s', 'byte/usecond', 'GB/s' -> bytes per second."""
    if value is None or "/" not in unit:
        return None
    num, den = unit.split("/", 1)
    nf, df = _bytes_factor(num), _TIME.get(den.strip())
    if nf is None or df is None:
        return None
    return value * nf / df


def unit_kind(unit: str) -> str:
    u = unit.strip()
    if u == "%":
        return "%"
    if u in _TIME:
        return "time"
    if "/" in u and _bytes_factor(u.split("/", 1)[0]) is not None:
        return "rate" if u.split("/", 1)[1].strip() in _TIME else "bytes"
    if _bytes_factor(u) is not None:
        return "bytes"
    return "other"


# ----------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------

def _csv_lines(text: str) -> list[list[str]]:
    """CSV rows from ncu's output, starting at the header (ncu may print ==PROF== / ==WARNING==
    lines or the application's output before it)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith('"ID"')
                  or ln.lstrip().startswith("ID,")), None)
    if start is None:
        raise ValueError("no ncu CSV header (a row starting with \"ID\") found")
    body = [ln for ln in lines[start:] if ln.strip() and not ln.startswith("==")]
    return list(csv.reader(io.StringIO("\n".join(body))))


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernel launches of an ncu CSV (raw or long shape). Each launch is a dict:
    id, name, block, grid, device, metrics {metric name: [(value text, unit), ...]}."""
    rows = _csv_lines(text)
    header = rows[0]
    col = {name: i for i, name in enumerate(header)}

    def cell(row, name):
        i = col.get(name)
        return row[i] if i is not None and i < len(row) else ""

    launches: dict[str, dict] = {}
    order: list[str] = []

    def launch_for(row) -> dict:
        key = cell(row, "ID") or str(len(order))
        if key not in launches:
            launches[key] = {"id": key, "name": cell(row, "Kernel Name"),
                             "block": cell(row, "Block Size"), "grid": cell(row, "Grid Size"),
                             "device": cell(row, "Device"), "metrics": {}}
            order.append(key)
        return launches[key]

    if "Metric Name" in col and "Metric Value" in col:  # long shape: one row per metric
        for row in rows[1:]:
            name = cell(row, "Metric Name")
            if not name:
                continue
            launch = launch_for(row)
            launch["metrics"].setdefault(name, []).append(
                (cell(row, "Metric Value"), cell(row, "Metric Unit")))
    else:  # raw page: metric-name header, units row, one row per launch
        data = rows[1:]
        units = [""] * len(header)
        if data and not cell(data[0], "ID").strip():
            units = data[0] + [""] * (len(header) - len(data[0]))
            data = data[1:]
        for row in data:
            if not any(c.strip() for c in row):
                continue
            launch = launch_for(row)
            for i, name in enumerate(header):
                if name in ID_COLUMNS or i >= len(row):
                    continue
                launch["metrics"].setdefault(name, []).append((row[i], units[i]))
    return [launches[k] for k in order]


def _lookup(metrics: dict, candidates) -> tuple[float | None, str, str | None]:
    """(value, unit, metric name) of the first candidate with a numeric value."""
    for cand in candidates:
        name, kind = (cand, None) if isinstance(cand, str) else cand
        for text, unit in metrics.get(name, []):
            value = parse_number(text)
            if value is None:
                continue
            if kind is not None and unit_kind(unit) != kind and not (
                    kind == "bytes" and not unit.strip()):
                continue
            return value, unit, name
    return None, "", None


def _fallback(metrics: dict, pattern) -> tuple[float | None, str, str | None]:
    best = (None, "", None)
    for name, entries in metrics.items():
        if pattern.match(name):
            for text, unit in entries:
                value = parse_number(text)
                if value is not None and (best[0] is None or value > best[0]):
                    best = (value, unit, name)
    return best


def top_stalls(metrics: dict, n: int = 3) -> tuple[list[tuple[str, float]], str]:
    """The n largest warp-stall reasons of the first metric family present, and its unit."""
    for pattern, unit_text in STALL_FAMILIES:
        values = {}
        for name, entries in metrics.items():
            m = pattern.match(name)
            if not m or m.group(1).endswith("not_issued"):
                continue
            value = next((v for v in (parse_number(t) for t, _ in entries) if v is not None),
                         None)
            if value is not None:
                values[m.group(1)] = value
        if not values:
            continue
        if unit_text == "% of samples":
            total = sum(values.values())
            if total <= 0:
                continue
            values = {k: 100.0 * v / total for k, v in values.items()}
        ranked = sorted(((k, v) for k, v in values.items() if k not in NOT_A_STALL),
                        key=lambda kv: -kv[1])
        return ranked[:n], unit_text
    return [], ""


def summarize_launch(launch: dict) -> dict:
    """Numbers of one launch, in fixed units (None = missing):
    duration_us, occupancy_pct, registers, smem_static_b, smem_dynamic_b, smem_b,
    tensor_pipe_pct, fma_pipe_pct, dram_pct, dram_gbs, l2_hit_pct, stalls, stall_unit."""
    m = launch["metrics"]
    out = {"name": launch["name"], "block": launch["block"], "grid": launch["grid"],
           "launches": 1}
    value, unit, _ = _lookup(m, CANDIDATES["duration"])
    seconds = to_seconds(value, unit)
    out["duration_us"] = seconds * 1e6 if seconds is not None else None
    out["occupancy_pct"] = _lookup(m, CANDIDATES["occupancy"])[0]
    out["registers"] = _lookup(m, CANDIDATES["registers"])[0]
    static = to_bytes(*_lookup(m, CANDIDATES["smem_static"])[:2])
    dynamic = to_bytes(*_lookup(m, CANDIDATES["smem_dynamic"])[:2])
    out["smem_static_b"], out["smem_dynamic_b"] = static, dynamic
    if static is not None or dynamic is not None:
        out["smem_b"] = (static or 0.0) + (dynamic or 0.0)
    else:
        out["smem_b"] = to_bytes(*_lookup(m, CANDIDATES["smem_total"])[:2])
    tensor, _, tensor_name = _lookup(m, CANDIDATES["tensor_pipe"])
    if tensor is None:
        tensor, _, tensor_name = _fallback(m, FALLBACK_PATTERNS["tensor_pipe"])
    out["tensor_pipe_pct"], out["tensor_pipe_metric"] = tensor, tensor_name
    out["fma_pipe_pct"] = _lookup(m, CANDIDATES["fma_pipe"])[0]
    out["dram_pct"] = _lookup(m, CANDIDATES["dram_pct"])[0]
    rate = to_bytes_per_second(*_lookup(m, CANDIDATES["dram_rate"])[:2])
    out["dram_gbs"] = rate / 1e9 if rate is not None else None
    out["l2_hit_pct"] = _lookup(m, CANDIDATES["l2_hit"])[0]
    out["stalls"], out["stall_unit"] = top_stalls(m)
    return out


NUMERIC_FIELDS = ["duration_us", "occupancy_pct", "registers", "smem_static_b",
                  "smem_dynamic_b", "smem_b", "tensor_pipe_pct", "fma_pipe_pct", "dram_pct",
                  "dram_gbs", "l2_hit_pct"]


def group_launches(summaries: list[dict]) -> list[dict]:
    """Merge launches of the same kernel (name, grid, block): median of each number, stall
    reasons ranked by their median. Order of first appearance is kept."""
    groups: dict[tuple, list[dict]] = {}
    for s in summaries:
        groups.setdefault((s["name"], s["grid"], s["block"]), []).append(s)
    merged = []
    for members in groups.values():
        g = dict(members[0])
        g["launches"] = len(members)
        for f in NUMERIC_FIELDS:
            vals = [s[f] for s in members if s[f] is not None]
            g[f] = statistics.median(vals) if vals else None
        reasons: dict[str, list[float]] = {}
        for s in members:
            for k, v in s["stalls"]:
                reasons.setdefault(k, []).append(v)
        g["stalls"] = sorted(((k, statistics.median(v)) for k, v in reasons.items()),
                             key=lambda kv: -kv[1])[:3]
        merged.append(g)
    return merged


def summarize_csv_text(text: str, per_launch: bool = False) -> list[dict]:
    summaries = [summarize_launch(launch) for launch in parse_ncu_csv(text)]
    return summaries if per_launch else group_launches(summaries)


# ----------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------

def short_kernel_name(name: str, width: int = 60) -> str:
    """'void flash_cuda::fwd_kernel<(flash_cuda::DType)2, 128>(flash_cuda::FwdParams)'
    -> 'fwd_kernel<(DType)2, 128>': no return type, no parameter list, no namespaces."""
    n = name.strip()
    if n.startswith("void "):
        n = n[5:]
    if n.endswith(")"):  # drop the parameter list: the last top-level parenthesis group
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            if n[i] == ")":
                depth += 1
            elif n[i] == "(":
                depth -= 1
                if depth == 0:
                    if i > 0:
                        n = n[:i]
                    break
    n = n.replace("(anonymous namespace)::", "")
    n = re.sub(r"\b(?:[A-Za-z_]\w*::)+", "", n)
    n = n.strip()
    return n if len(n) <= width else n[: width - 3] + "..."


def _fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    if b >= 1024:
        return f"{b / 1024:.1f} KiB"
    return f"{b:.0f} B"


def _fmt_duration(us) -> str:
    if us is None:
        return "n/a"
    return f"{us / 1000:.3f} ms" if us >= 1000 else f"{us:.1f} us"


def format_summary(groups: list[dict], name_width: int = 48) -> str:
    """A markdown table (one row per kernel), then the top warp stalls per kernel."""
    head = ["#", "kernel", "n", "duration", "occupancy", "regs", "smem/block", "tensor pipe",
            "fma pipe", "DRAM %", "DRAM GB/s", "L2 hit"]
    align = ["---:", ":---"] + ["---:"] * (len(head) - 2)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    for i, g in enumerate(groups, 1):
        lines.append("| " + " | ".join([
            str(i), short_kernel_name(g["name"], name_width), str(g["launches"]),
            _fmt_duration(g["duration_us"]), _fmt(g["occupancy_pct"], ".1f", " %"),
            _fmt(g["registers"], ".0f"), _fmt_bytes(g["smem_b"]),
            _fmt(g["tensor_pipe_pct"], ".1f", " %"), _fmt(g["fma_pipe_pct"], ".1f", " %"),
            _fmt(g["dram_pct"], ".1f", " %"), _fmt(g["dram_gbs"], ".0f"),
            _fmt(g["l2_hit_pct"], ".1f", " %")]) + " |")
    lines.append("")
    lines.append("Top warp stalls:")
    for i, g in enumerate(groups, 1):
        if g["stalls"]:
            text = ", ".join(f"{k} {v:.2f}" for k, v in g["stalls"])
            lines.append(f"  [{i}] {text}  ({g['stall_unit']})")
        else:
            lines.append(f"  [{i}] n/a")
    smem_detail = [g for g in groups if g["smem_static_b"] is not None
                   or g["smem_dynamic_b"] is not None]
    if smem_detail:
        lines.append("")
        lines.append("Shared memory per block (static + dynamic):")
        for i, g in enumerate(groups, 1):
            if g in smem_detail:
                lines.append(f"  [{i}] {_fmt_bytes(g['smem_static_b'])} + "
                             f"{_fmt_bytes(g['smem_dynamic_b'])}  grid {g['grid'] or '?'} "
                             f"block {g['block'] or '?'}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# ncu invocation and CLI
# ----------------------------------------------------------------------------------------

def find_ncu(explicit: str | None = None) -> str | None:
    for cand in (explicit, os.environ.get("NCU"), shutil.which("ncu"),
                 "/usr/local/cuda/bin/ncu"):
        if cand and (shutil.which(cand) or os.path.isfile(cand)):
            return cand
    return None


def export_csv(report: str, page: str = "raw", ncu: str | None = None) -> str:
    """`ncu --import REPORT --csv --page PAGE` as text."""
    exe = find_ncu(ncu)
    if exe is None:
        raise FileNotFoundError("ncu not found (put it on PATH, set $NCU or pass --ncu)")
    proc = subprocess.run([exe, "--import", report, "--csv", "--page", page],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ncu --import failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python bench/ncu_summary.py",
        description="Per-kernel summary of an Nsight Compute report (or of its CSV export).")
    p.add_argument("report", nargs="?", help="REPORT.ncu-rep (or a .csv export)")
    p.add_argument("--csv-in", help="parse this CSV (from ncu --csv) instead of a report")
    p.add_argument("--page", choices=["raw", "details"], default="raw",
                   help="ncu page to export (default raw: it has pipes and stalls)")
    p.add_argument("--ncu", help="path of the ncu executable (default: $NCU, PATH, "
                                 "/usr/local/cuda/bin/ncu)")
    p.add_argument("--save-csv", help="also write the exported CSV to this file")
    p.add_argument("--per-launch", action="store_true",
                   help="one row per launch instead of merging launches of a kernel")
    p.add_argument("--name-width", type=int, default=48, help="kernel name column width")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = p.parse_args(argv)

    csv_path = args.csv_in or (args.report if args.report and
                               args.report.lower().endswith(".csv") else None)
    if csv_path:
        with open(csv_path, newline="", encoding="utf-8", errors="replace") as f:
            text = f.read()
    elif args.report:
        try:
            text = export_csv(args.report, args.page, args.ncu)
        except (FileNotFoundError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        if args.save_csv:
            with open(args.save_csv, "w", encoding="utf-8") as f:
                f.write(text)
    else:
        p.error("give a REPORT.ncu-rep or --csv-in FILE")
    try:
        groups = summarize_csv_text(text, per_launch=args.per_launch)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not groups:
        print("no kernels in the report (did the NVTX filter match?)")
        return 1
    if args.json:
        print(json.dumps(groups, indent=2))
    else:
        print(format_summary(groups, args.name_width))
    return 0


if __name__ == "__main__":
    sys.exit(main())
