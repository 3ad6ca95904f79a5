"""The attention features next to the plain call: `python bench/run.py --features` (bench/README.md); with
`--providers fa4` also FlashAttention-4 on each feature call."""

from __future__ import annotations

import collections
import functools
import itertools
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402 (bench/common.py)
import measure as M  # noqa: E402 (bench/measure.py: providers, check, timing)

WINDOW, WINDOW_S = (1024, 0), 16384
VARLEN_B, VARLEN_S = 8, 2048
MIXED_RANGE, MIXED_SEED = (128, 4096), 0
SMALL_S, SMALL_D = 4096, 128  # softcap / ALiBi / sinks rows
SOFTCAP = 50.0
GQA_GROUPS = 4  # the gqa rows: SMALL_D's 16 query heads over 4 KV heads
DROPOUT_P, DROPOUT_S = 0.1, 4096
GOAL_WINDOW, GOAL_VARLEN = 0.85, 0.95  # within 15% / 5% of the plain call
GOAL_DROPOUT = 1 / 1.1  # dropout_p = 0.1 within 10% of dropout_p = 0 in time
GOAL_SINKS = 0.97  # the gate: the cost of sinks within 3% of the plain call

CSV_COLUMNS = ["feature", "dtype", "D", "H", "kv_heads", "causal", "mode", "layout", "B", "seqlens", "total_tokens",
               "window_left", "window_right", "softcap", "alibi", "sinks", "dropout_p", "visible_pairs", "ms", "tflops",
               "peak_gib", "status", "baseline_tflops", "ratio", "goal", "sdpa_tflops", "fa4_tflops"]


@functools.lru_cache(maxsize=None)
def visible_pairs(sq: int, sk: int, window_left: int = -1, window_right: int = -1) -> int:
    """(query i, key j) pairs with i + sk - sq - left <= j <= i + sk - sq + right (-1: unbounded), 0 <= j < sk."""
    if sq <= 0 or sk <= 0:
        return 0
    diag = torch.arange(sq, dtype=torch.int64) + (sk - sq)
    lo = (diag - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(diag)
    hi = (diag + window_right).clamp(max=sk - 1) if window_right >= 0 else torch.full_like(diag, sk - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def mixed_seqlens(n: int, lo: int, hi: int, seed: int) -> tuple:
    rng = random.Random(seed)
    return tuple(rng.randint(lo, hi) for _ in range(n))


def sides(call) -> tuple:
    """(left, right) window sides as the kernels see them (causal: right = 0)."""
    return call.window[0], 0 if call.causal else call.window[1]


def pairs(call) -> int:
    return sum(visible_pairs(s, s, *sides(call)) for s in call.seqlens)


def flops(call) -> float:
    return 4.0 * call.H * call.D * pairs(call) * M.MODE_FLOP_FACTOR[call.mode]


def label(call) -> str:
    n, s = len(call.seqlens), call.seqlens[0]
    text = (f"B={n} S={C.fmt_size(s)}" if not call.varlen else f"varlen {n}x{C.fmt_size(s)}"
            if len(set(call.seqlens)) == 1 else f"varlen {n} mixed ({sum(call.seqlens)} tok)")
    text += f" window ({call.window[0]}, {call.window[1]})" if call.window != (-1, -1) else ""
    text += (f" softcap {call.softcap:g}" if call.softcap else "") + (" alibi" if call.alibi else "")
    text += " sinks" if call.sinks else ""
    text += f" GQA {call.H}/{call.kv_heads}" if call.groups > 1 else ""
    text += f" dropout {call.dropout:g}" if call.dropout else ""
    return text + ("" if call.provider == "flash_cuda" else f" [{call.provider}]")


@dataclass(frozen=True)
class Row:
    """The flash_cuda call with the feature vs the plain flash_cuda call."""
    feature: str
    call: M.Call
    base: M.Call
    goal: float | None = None

    @property
    def sdpa(self) -> M.Call:
        return replace(self.base, provider="sdpa")

    def other(self, provider: str) -> M.Call:
        """The feature call on another library's provider (fa4)."""
        return replace(self.call, provider=provider)


def others(args) -> list[str]:
    """The other libraries' providers of --providers (fa4): a column each, on the feature call."""
    return [p for p in M.OTHER if p in (getattr(args, "providers", None) or ())]


def build_rows(d_list, causal_list, modes) -> list:
    def dense(D, causal, mode, B, S):
        return M.Call("flash_cuda", D, M.HIDDEN // D, bool(causal), mode, (S,) * B)

    rows, mixed = [], mixed_seqlens(VARLEN_B, *MIXED_RANGE, MIXED_SEED)
    for D, mode in itertools.product(d_list if 1 in causal_list else [], modes):
        base = dense(D, 1, mode, max(1, M.TOKENS // WINDOW_S), WINDOW_S)
        rows.append(Row("window", replace(base, window=WINDOW), base, GOAL_WINDOW))
    for D, causal, mode in itertools.product(d_list, causal_list, modes):
        base = dense(D, causal, mode, VARLEN_B, VARLEN_S)
        rows += [Row("varlen", replace(base, varlen=True), base, GOAL_VARLEN),
                 Row("varlen mixed", replace(base, varlen=True, seqlens=mixed), base)]
    for causal, mode in itertools.product(causal_list if SMALL_D in d_list else [], modes):
        base = dense(SMALL_D, causal, mode, M.TOKENS // SMALL_S, SMALL_S)
        rows += [Row("softcap", replace(base, softcap=SOFTCAP), base), Row("alibi", replace(base, alibi=True), base),
                 Row("sinks", replace(base, sinks=True), base, GOAL_SINKS),
                 Row("gqa", replace(base, groups=GQA_GROUPS), base)]
    for D, causal, mode in itertools.product(d_list, causal_list, modes):
        base = dense(D, causal, mode, max(1, M.TOKENS // DROPOUT_S), DROPOUT_S)
        rows.append(Row("dropout", replace(base, dropout=DROPOUT_P), base, GOAL_DROPOUT))
    return rows


def distinct_calls(rows, other=()) -> list:
    return list(dict.fromkeys(c for r in rows for c in (r.call, r.base, r.sdpa, *map(r.other, other))))


def tflops(results, call) -> float | None:
    r = results.get(call)
    return r["tflops"] if r is not None and r["status"] == "ok" else None


def ratio_of(row: Row, results) -> float | None:
    a, b = tflops(results, row.call), tflops(results, row.base)
    return a / b if a is not None and b is not None else None


def markdown_table(rows, results, other=()) -> list[str]:
    """One line per row: the feature call, its vs call, the ratio against the goal, SDPA on the vs call; per other
    provider (fa4) its TFLOPS on the feature call and flash_cuda / it."""
    def cell(call):
        r = results.get(call)
        return "" if r is None else M.status_tag(r["status"]) if tflops(results, call) is None else f"{r['tflops']:.1f}"

    def goal(row, ratio):
        text = "" if row.goal is None else f">= {row.goal:.2f}"
        return text + (" yes" if ratio >= row.goal else " NO") if text and ratio is not None else text

    def ratio(a, b):
        return C.fmt(pd.Series([a / b if a is not None and b is not None else None]), ".2f")[0]
    table = pd.DataFrame([(r.feature, r.call.D, int(r.call.causal), r.call.mode, label(r.call), cell(r.call),
                           label(r.base), cell(r.base), ratio(tflops(results, r.call), tflops(results, r.base)),
                           goal(r, ratio_of(r, results)), cell(r.sdpa),
                           *(x for p in other for x in (cell(r.other(p)), ratio(tflops(results, r.call),
                                                                                tflops(results, r.other(p))))))
                          for r in rows],
                         columns=["feature", "D", "causal", "mode", "flash_cuda call", "TFLOPS", "vs (flash_cuda)",
                                  "TFLOPS", "ratio", "goal", "SDPA default (vs call)",
                                  *(x for p in other for x in (f"{p} (same call)", f"fc/{p}"))])
    align = "--- ---: ---: --- --- ---: --- ---: ---: --- ---:".split() + ["---:"] * 2 * len(other)
    lines = C.markdown(table, align=align).splitlines()
    lines += ["", "TFLOPS on visible (query, key) pairs: fwd 4*H*D*pairs, bwd 2.5x; ratio = feature / vs (flash_cuda "
              "both)."]
    lines += [f"varlen mixed lengths (seed {MIXED_SEED}): {', '.join(map(str, m))}."
              for m in dict.fromkeys(r.call.seqlens for r in rows if r.feature == "varlen mixed")]
    notes = collections.Counter((label(c), results[c]["status"]) for c in distinct_calls(rows, other)
                                if c in results and tflops(results, c) is None)
    if notes:
        lines += ["", "Cells without a number:"]
        lines += [f"- {label} ({n}x): {status}" for (label, status), n in notes.items()]
    return lines


def csv_frame(rows, results, dtype) -> pd.DataFrame:
    """features.csv: one line per row, the feature call's shape and result, then the TFLOPS it is compared with."""
    out = []
    for row in rows:
        call, lens = row.call, row.call.seqlens
        out.append({
            "feature": row.feature, "dtype": str(dtype).removeprefix("torch."), "D": call.D, "H": call.H,
            "kv_heads": call.kv_heads,
            "causal": int(call.causal), "mode": call.mode, "layout": "varlen" if call.varlen else "dense",
            "B": len(lens), "seqlens": f"{lens[0]}x{len(lens)}" if len(set(lens)) == 1 else ";".join(map(str, lens)),
            "total_tokens": sum(lens), "window_left": sides(call)[0], "window_right": sides(call)[1],
            "softcap": call.softcap, "alibi": int(call.alibi), "sinks": int(call.sinks), "dropout_p": call.dropout,
            "visible_pairs": pairs(call),
            **results[call],
            "baseline_tflops": tflops(results, row.base), "ratio": ratio_of(row, results), "goal": row.goal,
            "sdpa_tflops": tflops(results, row.sdpa), "fa4_tflops": tflops(results, row.other("fa4"))})
    df = pd.DataFrame(out, columns=CSV_COLUMNS)
    formats = {"ms": ".4f", "tflops": ".1f", "peak_gib": ".3f", "baseline_tflops": ".1f", "ratio": ".3f", "goal": "g",
               "sdpa_tflops": ".1f", "fa4_tflops": ".1f"}
    return df.assign(**{c: C.fmt(df[c], f) for c, f in formats.items()})


def run_features(args, rows, dtype, timer, env, device="cuda") -> dict:
    """Measure every distinct call once, write features.csv / features.md. -> {call: result}."""
    t0, calls = time.time(), distinct_calls(rows, others(args))
    results = M.measure_all({c: flops(c) for c in calls}, dtype, timer, args.seed, not args.no_check, device)
    table = markdown_table(rows, results, others(args))
    title = (f"flash_cuda features, {M.DTYPE_SHORT[dtype]}, {len(rows)} rows, {len(calls)} calls "
             f"({time.time() - t0:.0f} s)")
    C.write_results(args.out_dirs[dtype], "features", csv_frame(rows, results, dtype), title, env, table)
    print(f"\n## {title}\n\n" + "\n".join(table))
    return results


def dry_run(args, rows) -> None:
    for row in rows:
        print(f"{row.feature:13s} D={row.call.D:<3d} causal={int(row.call.causal)} {row.call.mode:7s} "
              f"{label(row.call)}  vs  {label(row.base)}")
    n = len(distinct_calls(rows, others(args)))
    print(f"{len(rows)} rows, {n} timed calls per dtype ({', '.join(args.dtype)}); "
          f"output {', '.join(str(Path(d) / 'features.csv') for d in args.out_dirs.values())}")
