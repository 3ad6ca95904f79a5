#!/usr/bin/env python
"""Summarise an Nsight Compute report per kernel from ncu's raw page (bench/README.md). Metric names differ between
ncu versions: each quantity has candidates, and a missing one prints n/a."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402 (bench/common.py)

_P = "avg.pct_of_peak_sustained_active"
# quantity: (candidate metrics, the unit kind a candidate must have (None: any), factor to the printed unit)
QUANTITIES = {
    "duration_us": (["gpu__time_duration.sum", "gpu__time_duration.avg"], "time", 1e6),
    "occupancy_pct": ([f"sm__warps_active.{_P}"], "%", 1),
    "registers": (["launch__registers_per_thread"], None, 1),
    "smem_static_b": (["launch__shared_mem_per_block_static"], "bytes", 1),
    "smem_dynamic_b": (["launch__shared_mem_per_block_dynamic"], "bytes", 1),
    "smem_total_b": (["launch__shared_mem_per_block"], "bytes", 1),
    "fma_pipe_pct": ([f"sm__pipe_fma_cycles_active.{_P}", f"sm__inst_executed_pipe_fma.{_P}"], None, 1),
    "dram_pct": (["dram__throughput.avg.pct_of_peak_sustained_elapsed",
                  "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"], "%", 1),
    "dram_gbs": (["dram__bytes.sum.per_second"], "rate", 1e-9),
    "l2_hit_pct": (["lts__t_sector_hit_rate.pct"], "%", 1),
    # The SMs' read sectors at the L2 against the sectors read from DRAM: 1.0 for a kernel that asks
    # for each byte it streams once (the decode's fill asked for 1.56x, cuDNN's 1.00x: the L2, not
    # DRAM, was the bound; bench/results/decode-h200/producer-warp-ab.md).
    "l2_read_sectors": (["lts__t_sectors_srcunit_tex_op_read.sum"], None, 1),
    "dram_read_sectors": (["dram__sectors_read.sum"], None, 1),
    # Work issued, beside the time: two kernels at the same tensor-pipe share and stalls per
    # instruction differ by how many instructions carry the same products.
    "inst_m": (["smsp__inst_executed.sum", "sm__inst_executed.sum"], "inst", 1e-6),
    "issue_pct": ([f"smsp__issue_active.{_P}", f"sm__inst_issued.{_P}"], "%", 1),
}
NUMERIC_FIELDS = [q for q in QUANTITIES if q != "smem_total_b"] + ["tensor_pipe_pct", "smem_b", "l2_reads_per_dram"]
# Tensor-pipe metrics are named by ncu version and MMA kind (hmma, gmma): the busiest one the report has.
TENSOR_PIPE = r"^sm__(?:pipe|inst_executed_pipe)_tensor\w*\.avg\.pct_of_peak_sustained_(?:active|elapsed)$"
# Warp-stall families in order of preference (group 1: the reason) and their unit.
STALL_FAMILIES = [
    (r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$", "cycles per issued instruction"),
    (r"^smsp__average_warp_latency_issue_stalled_(\w+?)(?:\.ratio|\.avg|\.sum)?$", "cycles per issued instruction"),
    (r"^smsp__warp_issue_stalled_(\w+?)_per_warp_active\.pct$", "% of active warp cycles"),
    (r"^smsp__average_warps_issue_stalled_(\w+?)(?:_per_\w+)?\.(?:pct|ratio)$", "as reported by ncu"),
    (r"^smsp__pcsamp_warps_issue_stalled_(\w+?)(?:\.sum)?$", "% of samples"),  # sample counts
]
ID_COLUMNS = {"ID": "id", "Kernel Name": "name", "Grid Size": "grid", "Block Size": "block"}
NOT_METRICS = {"Process ID", "Process Name", "Host Name", "Context", "Stream", "Device", "CC", *ID_COLUMNS.values()}
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "Ki": 2.0**10, "Mi": 2.0**20,
           "Gi": 2.0**30, "Ti": 2.0**40}
_SECONDS = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0,
            "second": 1.0}


def unit_scale(unit: str) -> tuple[str, float]:
    """(kind, factor to seconds / bytes / bytes per second) of an ncu unit: 'Kbyte' -> ('bytes', 1e3), ncu's K
    being decimal."""
    u = str(unit).strip().removesuffix("/block")
    num, _, den = u.partition("/")
    size = re.fullmatch(r"([KMGTP]i?|k)?(?:bytes?|B)", num)
    inst = re.fullmatch(r"([KMGT])?inst", num)
    if u in ("%", ""):
        return u, 1.0
    if u in _SECONDS:
        return "time", _SECONDS[u]
    if size and den.strip() in _SECONDS:
        return "rate", _PREFIX[size.group(1) or ""] / _SECONDS[den.strip()]
    if inst and not den:
        return "inst", _PREFIX[inst.group(1) or ""]
    return ("bytes", _PREFIX[size.group(1) or ""]) if size and not den else ("other", 1.0)


def read_ncu_csv(text: str) -> pd.DataFrame:
    """The raw page (a units row under the header, one row per launch) as one row per (launch, metric)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith(('"ID"', "ID,"))), None)
    if start is None:
        raise ValueError('no ncu CSV header (a row starting with "ID") found')
    body = "\n".join(ln for ln in lines[start:] if ln.strip() and not ln.startswith("=="))
    df = pd.read_csv(io.StringIO(body), dtype=str, keep_default_na=False)
    df = df.assign(**{c: "" for c in ID_COLUMNS if c not in df}).rename(columns=ID_COLUMNS)
    has_units = len(df) > 0 and not df.id.iat[0].strip()  # the units row has no ID
    units, df = (df.iloc[0], df.iloc[1:]) if has_units else (pd.Series(dtype=str), df)
    long = df.melt(id_vars=list(ID_COLUMNS.values()), value_vars=[c for c in df if c not in NOT_METRICS],
                   var_name="metric")
    long["unit"] = long.metric.map(units).fillna("")
    long["number"] = pd.to_numeric(long.value.str.replace(",", ""), errors="coerce")
    long[["kind", "scale"]] = pd.DataFrame(long.unit.map(unit_scale).tolist(), index=long.index)
    return long


def pick(long: pd.DataFrame, candidates, kind, factor) -> pd.Series:
    """Per launch id: the first candidate with a number of `kind` (unitless passes for % and bytes), in print units."""
    rank = {name: i for i, name in enumerate(candidates)}
    c = long[long.metric.isin(rank) & long.number.notna()]
    if kind:
        c = c[(c.kind == kind) | ((c.kind == "") & (kind in ("%", "bytes")))]
    c = c.assign(rank=c.metric.map(rank)).sort_values("rank", kind="stable").drop_duplicates("id")
    return (c.number * c.scale * factor).set_axis(c.id)


def stalls(long: pd.DataFrame) -> pd.DataFrame:
    """id, reason, value, unit: warp stalls from the first family a launch has ('selected' is no stall,
    '_not_issued' variants would double count)."""
    out, seen = [], set()
    for pattern, unit in STALL_FAMILIES:
        m = long.assign(reason=long.metric.str.extract(pattern)[0]).dropna(subset=["reason", "number"])
        m = m[~m.reason.str.endswith("not_issued") & ~m.id.isin(seen)]
        if unit == "% of samples":
            m = m.assign(number=100 * m.number / m.groupby("id").number.transform("sum"))
        out.append(m.assign(unit=unit)[["id", "reason", "number", "unit"]])
        seen |= set(m.id)
    s = pd.concat(out).rename(columns={"number": "value"})
    return s[s.reason != "selected"]


def summarize_csv_text(text: str, per_launch: bool = False) -> list[dict]:
    """Per kernel (or launch): name, grid, block, launches, NUMERIC_FIELDS (None: missing), top 3 stalls, stall_unit."""
    long = read_ncu_csv(text)
    k = long.drop_duplicates("id").set_index("id")[["name", "grid", "block"]]
    for q, (names, kind, factor) in QUANTITIES.items():
        k[q] = pick(long, names, kind, factor)
    k["tensor_pipe_pct"] = long[long.metric.str.match(TENSOR_PIPE)].groupby("id").number.max()
    k["smem_b"] = k[["smem_static_b", "smem_dynamic_b"]].sum(axis=1, min_count=1).fillna(k.smem_total_b)
    k["l2_reads_per_dram"] = k.l2_read_sectors / k.dram_read_sectors.where(k.dram_read_sectors > 0)
    keys = ["name", "grid", "block"] + (["id"] if per_launch else [])
    k = k.reset_index()
    g = k.groupby(keys, sort=False)
    out = g[NUMERIC_FIELDS].median().join(g.size().rename("launches"))
    st = stalls(long).merge(k[["id", "name", "grid", "block"]], on="id")
    st = st.groupby(keys + ["reason"], sort=False).agg(value=("value", "median"), unit=("unit", "first"))
    by = st.sort_values("value", ascending=False, kind="stable").groupby(level=keys, sort=False)
    out["stalls"] = pd.Series({key: list(zip(t.index.get_level_values("reason"), t.value))[:3]
                               for key, t in by}, dtype=object)
    out["stall_unit"] = by.unit.first()
    out = out.reset_index().drop(columns="id", errors="ignore")
    records = out.astype(object).where(out.notna(), None).to_dict("records")
    for r in records:
        r.update(launches=int(r["launches"]), stalls=r["stalls"] or [], stall_unit=r["stall_unit"] or "")
    return records


def short_kernel_name(name: str, width: int = 60) -> str:
    """'void ns::fwd_kernel<(ns::DType)2, 128>(ns::FwdParams)' -> 'fwd_kernel<(DType)2, 128>'."""
    n = name.strip().removeprefix("void ")
    depth = 0
    for i in range(len(n) - 1, 0, -1) if n.endswith(")") else ():  # the last (...) group
        depth += {")": 1, "(": -1}.get(n[i], 0)
        if depth == 0:
            n = n[:i]
            break
    n = re.sub(r"\b(?:[A-Za-z_]\w*::)+", "", n.replace("(anonymous namespace)::", "")).strip()
    return n if len(n) <= width else n[: width - 3] + "..."


def format_summary(groups: list[dict], name_width: int = 48) -> str:
    """A markdown table (one row per kernel), then the top warp stalls and the shared memory split."""
    def num(v, spec=".1f", suffix=" %"):
        return "n/a" if v is None else f"{v:{spec}}{suffix}"

    def size(b):
        return "n/a" if b is None else f"{b / 1024:.1f} KiB" if b >= 1024 else f"{b:.0f} B"

    def duration(us):
        return "n/a" if us is None else f"{us / 1000:.3f} ms" if us >= 1000 else f"{us:.1f} us"
    table = pd.DataFrame([(i, short_kernel_name(g["name"], name_width), g["launches"], duration(g["duration_us"]),
                           num(g["occupancy_pct"]), num(g["registers"], ".0f", ""), size(g["smem_b"]),
                           num(g["tensor_pipe_pct"]), num(g["fma_pipe_pct"]), num(g["dram_pct"]),
                           num(g["dram_gbs"], ".0f", ""), num(g["l2_hit_pct"]),
                           num(g["l2_reads_per_dram"], ".2f", "x"), num(g["inst_m"], ".1f", " M"),
                           num(g["issue_pct"])) for i, g in enumerate(groups, 1)],
                         columns=["#", "kernel", "n", "duration", "occupancy", "regs", "smem/block", "tensor pipe",
                                  "fma pipe", "DRAM %", "DRAM GB/s", "L2 hit", "L2 reads / DRAM", "instructions",
                                  "issue"])
    lines = [C.markdown(table, align=["---:", ":---"] + ["---:"] * 13), "", "Top warp stalls:"]
    lines += [f"  [{i}] " + (", ".join(f"{k} {v:.2f}" for k, v in g["stalls"]) + f"  ({g['stall_unit']})"
                             if g["stalls"] else "n/a") for i, g in enumerate(groups, 1)]
    split = [(i, g) for i, g in enumerate(groups, 1) if {g["smem_static_b"], g["smem_dynamic_b"]} != {None}]
    if split:
        lines += ["", "Shared memory per block (static + dynamic):"]
        lines += [f"  [{i}] {size(g['smem_static_b'])} + {size(g['smem_dynamic_b'])}  grid {g['grid'] or '?'} block "
                  f"{g['block'] or '?'}" for i, g in split]
    return "\n".join(lines)


def export_csv(report: str) -> str:
    """`ncu --import REPORT --csv --page raw` as text; ncu is $NCU, else on PATH, else in /usr/local/cuda/bin."""
    exe = next((c for c in (os.environ.get("NCU"), "ncu", "/usr/local/cuda/bin/ncu") if c and shutil.which(c)), None)
    if exe is None:
        raise FileNotFoundError("ncu not found (put it on PATH or set $NCU)")
    proc = subprocess.run([exe, "--import", report, "--csv", "--page", "raw"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ncu --import failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/ncu_summary.py",
                                description="Per-kernel summary of an Nsight Compute report (or of its CSV export).")
    p.add_argument("report", nargs="?", help="REPORT.ncu-rep (ncu runs: $NCU, PATH or /usr/local/cuda/bin), or a .csv")
    p.add_argument("--csv-in", help="parse this CSV (from ncu --csv) instead of a report")
    p.add_argument("--save-csv", help="also write the exported CSV, below the environment lines, to this file")
    p.add_argument("--per-launch", action="store_true", help="one row per launch instead of merging a kernel's")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = p.parse_args(argv)
    csv_path = args.csv_in or (args.report if str(args.report).lower().endswith(".csv") else None)
    if not csv_path and not args.report:
        p.error("give a REPORT.ncu-rep or --csv-in FILE")
    try:
        if csv_path:
            text = Path(csv_path).read_text(encoding="utf-8", errors="replace")
        else:
            text = export_csv(args.report)
            if args.save_csv:  # '#' lines are skipped when read back
                env = C.environment(report=os.path.abspath(args.report))
                Path(args.save_csv).write_text("".join(f"# {ln}\n" for ln in C.env_lines(env)) + text)
        groups = summarize_csv_text(text, per_launch=args.per_launch)
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not groups:
        print("no kernels in the report (did the NVTX filter match?)")
        return 1
    print(json.dumps(groups, indent=2) if args.json else format_summary(groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
