#!/usr/bin/env python
"""Benchmark flash_cuda against PyTorch SDPA's backends and, with `--providers ... fa4`, FlashAttention-4: TFLOPS per
(D, causal, mode, S) cell (bench/README.md)."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402 (bench/common.py)
import measure as M  # noqa: E402 (bench/measure.py: providers, check, timing)

sys.path.append(str(C.REPO_ROOT))  # flash_cuda.reference of this checkout where flash_cuda is not installed

DEFAULT_D, DEFAULT_CAUSAL, MODES = [64, 128], [0, 1], ["fwd", "bwd", "fwd_bwd"]
DEFAULT_SEQLENS, QUICK_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384], [1024, 4096, 16384]
GRID_KEYS = ["D", "causal", "mode", "S", "B", "H"]
ANCHOR_KEYS = ["dtype", "D", "causal", "S", "B", "H", "mode"]
CSV_COLUMNS = ["provider", *ANCHOR_KEYS, "ms", "tflops", "peak_gib", "status"]  # the anchors' columns + status
BUDGET_MS, QUICK_BUDGET_MS = (25.0, 100.0), (10.0, 30.0)  # do_bench (warm-up, timing) per cell


def build_grid(d_list, causal_list, modes, seqlens, batch=None, heads=None) -> pd.DataFrame:
    """Every config in output order (D, causal, mode, then S)."""
    return pd.DataFrame([(D, int(c), m, S, batch or max(1, M.TOKENS // S), heads or max(1, M.HIDDEN // D))
                         for D, c, m, S in itertools.product(d_list, causal_list, modes, seqlens)], columns=GRID_KEYS)


def default_providers(dtype) -> list[str]:
    return ["flash_cuda", "flash_cuda_simt" if dtype == torch.float32 else "flash_cuda_mma", *M.SDPA_BACKEND]


def math_backend_gib(provider, B, H, S, mode) -> float:
    """Rough peak of SDPA's math backend: 2.4 (fwd) / 4.2 (bwd) float32 S x S score buffers, fitted to the anchors."""
    return (2.4 if mode == "fwd" else 4.2) * B * H * S * S * 4 / 2**30 if provider == "sdpa_math" else 0.0


def run_grid(args, grid: pd.DataFrame, providers, dtype, timer, device="cuda") -> pd.DataFrame:
    """One row per (config, provider) cell; sdpa_math skipped where its S x S buffers would pass the limit."""
    cells, flops, skipped = [], {}, {}
    for cfg, p in itertools.product(grid.itertuples(index=False), providers):
        D, S, B, H = int(cfg.D), int(cfg.S), int(cfg.B), int(cfg.H)
        call = M.Call(p, D, H, bool(cfg.causal), cfg.mode, (S,) * B)
        cells.append((cfg, call))
        gib = math_backend_gib(p, B, H, S, cfg.mode)
        if gib > args.max_quadratic_gib:
            skipped[call] = {"status": f"skipped: O(S^2) memory (~{gib:.0f} GiB)"}
        else:
            flops[call] = M.attention_flops(B, H, S, S, D, cfg.causal, cfg.mode)
    results = {**M.measure_all(flops, dtype, timer, args.seed, not args.no_check, device), **skipped}
    records = [{**cfg._asdict(), "provider": call.provider, **results[call]} for cfg, call in cells]
    res = pd.DataFrame(records, columns=[*GRID_KEYS, "provider", "ms", "tflops", "peak_gib", "status"])
    return res.assign(dtype=str(dtype).removeprefix("torch."))


def grid_table(res: pd.DataFrame) -> list[str]:
    """Markdown: TFLOPS per provider, the first flash_cuda provider / each SDPA one and FA4, the reasons of empty
    cells."""
    providers = list(dict.fromkeys(res.provider))
    order = pd.MultiIndex.from_frame(res[GRID_KEYS].drop_duplicates())

    def wide(values):
        return res.assign(v=values).set_index(GRID_KEYS + ["provider"]).v.unstack().reindex(order)[providers]
    table = wide(C.fmt(res.tflops, ".1f").where(res.status == "ok", res.status.map(M.status_tag)))
    tflops = wide(res.tflops.where(res.status == "ok"))
    num = next((p for p in providers if p in M.FLASH_KERNEL), None)
    for p in (p for p in [*M.SDPA_BACKEND, *M.OTHER] if p in providers and num):
        label = {"sdpa_efficient": "eff"}.get(p, p.removeprefix("sdpa_"))
        table[f"{'fc' if num == 'flash_cuda' else num}/{label}"] = C.fmt(tflops[num] / tflops[p], ".2f")
    table = table.reset_index().assign(S=lambda t: t.S.map(C.fmt_size))
    lines = C.markdown(table, align="---:").splitlines()
    bad = res[res.status != "ok"].groupby(["provider", "status"], sort=False).size()
    if len(bad):
        lines += ["", "Cells without a number (n/s = unsupported, skip, OOM, WRONG, err, n/a = unavailable):"]
        lines += [f"- {p}: {s} ({n} config{'s' if n > 1 else ''})" for (p, s), n in bad.items()]
    return lines


def csv_frame(res: pd.DataFrame) -> pd.DataFrame:
    return res[CSV_COLUMNS].assign(ms=C.fmt(res.ms, ".4f"), tflops=C.fmt(res.tflops, ".1f"),
                                   peak_gib=C.fmt(res.peak_gib, ".3f"))


def shape_text(g: pd.DataFrame) -> str:
    if ((g.B * g.S == M.TOKENS) & (g.H * g.D == M.HIDDEN)).all():
        return f"B*S={M.TOKENS}, H*D={M.HIDDEN}"
    return f"B={g.B.iat[0]}, H={g.H.iat[0]}" if g[["B", "H"]].nunique().max() == 1 else "B, H vary"


def write_plots(res: pd.DataFrame, out_dir: Path, dtype, env: dict) -> list[Path]:
    """TFLOPS vs S, one PNG per (D, causal, mode); the environment in a footer and the PNG's Description."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    (out_dir / "plots").mkdir(parents=True, exist_ok=True)
    footer = f"{env['gpu'].split(',')[0]}, torch {env['torch'].split(',')[0]}, {env['git commit']}"
    written = []
    for (D, causal, mode), g in res.groupby(["D", "causal", "mode"], sort=False):
        lines = g.assign(tflops=g.tflops.where(g.status == "ok")).pivot(index="S", columns="provider", values="tflops")
        lines = lines[list(dict.fromkeys(g.provider))].dropna(axis=1, how="all")
        if lines.columns.empty:
            continue
        ax = lines.plot(figsize=(7, 4.5), logx=True, marker="o", grid=True, ylim=(0, None), xlabel="sequence length S",
                        ylabel="TFLOPS", style=["-" if p.startswith("flash_cuda") else "--" for p in lines],
                        title=f"{M.DTYPE_SHORT[dtype]}, D={D}, causal={causal}, {mode} ({shape_text(g)})")
        ax.set_xticks(lines.index, [C.fmt_size(s) for s in lines.index])
        ax.legend(fontsize=8)
        ax.figure.text(0.01, 0.01, footer, fontsize=6, color="gray")
        ax.figure.tight_layout()
        written.append(out_dir / "plots" / f"D{D}_causal{causal}_{mode}.png")
        ax.figure.savefig(written[-1], dpi=120, metadata={"Description": "; ".join(C.env_lines(env))})
        plt.close(ax.figure)
    return written


def load_anchors(where: str | None) -> tuple[Path | None, pd.DataFrame]:
    """(folder, its grid-shaped CSVs with the file name as `source`): `where`, else shared/anchors in or beside
    the checkout."""
    candidates = [Path(where)] if where and where != "auto" else [
        C.REPO_ROOT / "shared" / "anchors", C.REPO_ROOT.parent / "shared" / "anchors"]
    folder = next((c for c in candidates if c.is_dir() and any(c.glob("*.csv"))), None)
    cols = ANCHOR_KEYS + ["provider", "tflops"]
    frames = [df[cols].assign(source=path.name) for path in sorted(folder.glob("*.csv") if folder else [])
              for df in [pd.read_csv(path, comment="#")] if set(cols) <= set(df.columns)]
    return folder, pd.concat(frames, ignore_index=True).dropna(subset=["tflops"]) if frames else pd.DataFrame()


def anchor_comparison(res: pd.DataFrame, anchors: pd.DataFrame) -> pd.DataFrame:
    """Each provider against the same anchor provider (sdpa: sdpa_default), flash_cuda also against the best SDPA
    backend of each anchor file."""
    ok = res[res.status == "ok"].reset_index(drop=True).rename_axis("order").reset_index()
    if ok.empty or anchors.empty:
        return pd.DataFrame()
    anchors = anchors.rename(columns={"provider": "anchor_provider", "tflops": "anchor"})
    same = ok.assign(anchor_provider=ok.provider.replace({"sdpa": "sdpa_default"})).merge(
        anchors, on=ANCHOR_KEYS + ["anchor_provider"])
    sdpa = anchors[anchors.anchor_provider.str.startswith("sdpa")]
    best = sdpa.loc[sdpa.groupby(ANCHOR_KEYS + ["source"]).anchor.idxmax()]
    out = pd.concat([same, ok[ok.provider.isin(M.FLASH_KERNEL)].merge(best, on=ANCHOR_KEYS)])
    out = out.sort_values("order", kind="stable")
    name = out.provider.where(out.provider == out.anchor_provider, out.provider + " vs " + out.anchor_provider)
    return pd.DataFrame({"D": out.D, "causal": out.causal, "mode": out["mode"], "S": out.S.map(C.fmt_size),
                         "provider": name, "ours": C.fmt(out.tflops, ".1f"), "anchor": C.fmt(out.anchor, ".1f"),
                         "ratio": C.fmt(out.tflops / out.anchor, ".2f"), "source": out.source})


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Benchmark flash_cuda against PyTorch SDPA's backends and FlashAttention-4 (TFLOPS, median of "
                    "triton.testing.do_bench with the L2 flushed; bench/README.md).")
    a = p.add_argument
    a("--d", type=int, nargs="+", default=DEFAULT_D, metavar="D", help="head dims (default 64 128)")
    a("--causal", type=int, nargs="+", choices=[0, 1], default=DEFAULT_CAUSAL, help="0 and/or 1")
    a("--mode", nargs="+", choices=MODES, help="fwd, bwd, fwd_bwd (default all; --features: fwd bwd)")
    a("--seqlen", nargs="+", type=C.parse_size, metavar="S", help="e.g. 4096 or 4k (default 512 1k 2k 4k 8k 16k)")
    a("--dtype", nargs="+", default=["bf16"], choices=sorted(M.DTYPES), help="several: one results folder each")
    a("--providers", nargs="+", choices=M.PROVIDERS, metavar="P",
      help=f"subset of: {', '.join(M.PROVIDERS)} (default: flash_cuda, the dtype's tier, every sdpa*; fa4 = "
           "FlashAttention-4, skipped where flash_attn.cute does not import; with --features: fa4 adds its column)")
    a("--batch", type=int, help="B of every config (default 16384 // S)")
    a("--heads", type=int, help="H of every config (default 2048 // D)")
    a("--quick", action="store_true", help="S in {1k, 4k, 16k}, do_bench budgets 10 / 30 ms instead of 25 / 100")
    a("--max-quadratic-gib", type=float, default=40.0, help="skip sdpa_math where its S^2 buffers pass this GiB")
    a("--no-check", action="store_true", help="skip the correctness check")
    a("--no-plots", action="store_true", help="do not write PNG plots")
    a("--out", help="results folder (default bench/results/<dtype>; several dtypes: OUT/<dtype>)")
    a("--compare-anchors", nargs="?", const="auto", metavar="DIR", help="our numbers next to DIR's (shared/anchors)")
    a("--seed", type=int, default=0, help="random seed for the inputs")
    a("--features", action="store_true", help="window, varlen, softcap, ALiBi, sinks, GQA, dropout rows instead of the grid")
    a("--dry-run", action="store_true", help="print the configs and providers, run nothing")
    args = p.parse_args(argv)
    for D in args.d:
        if D % 8 or not 8 <= D <= 256:
            p.error(f"--d {D}: head dims must be multiples of 8 in [8, 256]")
    args.seqlens = args.seqlen or (QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    args.budget_ms = QUICK_BUDGET_MS if args.quick else BUDGET_MS
    args.mode = args.mode or (["fwd", "bwd"] if args.features else MODES)
    dtypes = list(dict.fromkeys(M.DTYPES[d] for d in args.dtype))  # unique, in order
    args.dtype = [M.DTYPE_SHORT[d] for d in dtypes]
    base = Path(args.out) if args.out else C.REPO_ROOT / "bench" / "results"
    args.out_dirs = {d: base if args.out and len(dtypes) == 1 else base / M.DTYPE_SHORT[d] for d in dtypes}
    return args


def dry_run(args) -> None:
    for dtype, out in args.out_dirs.items():
        providers = args.providers or default_providers(dtype)
        grid = build_grid(args.d, args.causal, args.mode, args.seqlens, args.batch, args.heads)
        skipped = sum(math_backend_gib(p, c.B, c.H, c.S, c.mode) > args.max_quadratic_gib
                      for c in grid.itertuples() for p in providers)
        print(f"{M.DTYPE_SHORT[dtype]}: {len(grid)} configs x {len(providers)} providers = "
              f"{len(grid) * len(providers)} cells ({skipped} skipped for O(S^2) memory)\n"
              f"  providers: {', '.join(providers)}\n  D {args.d}, causal {args.causal}, modes {args.mode}, "
              f"S {[C.fmt_size(s) for s in args.seqlens]}, {shape_text(grid)}\n  output: {out}")


def other_versions(providers) -> dict:
    """{"fa4": its version, or why its cells are skipped} when fa4 is among the providers, else {}."""
    return {"fa4": M.fa4_version()} if "fa4" in (providers or ()) else {}


def report(args, res: pd.DataFrame, dtype, env: dict, elapsed: float) -> None:
    out_dir = Path(args.out_dirs[dtype])
    title = (f"flash_cuda benchmark, {M.DTYPE_SHORT[dtype]}, {shape_text(res)}, {len(res[GRID_KEYS].drop_duplicates())}"
             f" configs x {res.provider.nunique()} providers ({elapsed:.0f} s)")
    table = grid_table(res)
    print(f"\n## {title}\n\n" + "\n".join(table))
    body = ["TFLOPS (ratios: flash_cuda / SDPA backend or FA4; >1 means flash_cuda is faster)", "", *table]
    if args.compare_anchors:
        anchor_dir, anchors = load_anchors(args.compare_anchors)
        if anchor_dir is None:
            print("\n(--compare-anchors: no shared/anchors folder with CSVs found; skipped)")
        else:
            comp = anchor_comparison(res, anchors)
            lines = ["", f"Anchors from {anchor_dir} (ours / anchor TFLOPS):", "", C.markdown(comp, align="---:")
                     if len(comp) else "(no config of this run is in the anchors)"]
            print("\n".join(lines))
            body += lines
    C.write_results(out_dir, "results", csv_frame(res), title, env, body)
    if not args.no_plots:
        print(f"wrote {len(write_plots(res, out_dir, dtype, env))} plots in {out_dir / 'plots'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.features:  # bench/features.py
        import features
        rows = features.build_rows(args.d, args.causal, args.mode)
        if not rows:
            print("--features: nothing to run (softcap / ALiBi / sinks need --d 128, window --causal 1)")
            return 2
    if args.dry_run:
        if args.features:
            features.dry_run(args, rows)
        else:
            dry_run(args)
        for line in C.env_lines(other_versions(args.providers)):
            print(line)
        return 0
    if not torch.cuda.is_available():
        print("bench/run.py needs a CUDA GPU (use --dry-run to see the plan).", file=sys.stderr)
        return 2
    timer = C.Timer(*args.budget_ms)
    try:
        version = M.load_flash_cuda().__version__
    except M.Unavailable as exc:
        version = str(exc)
    env = C.environment(flash_cuda=version, **other_versions(args.providers), timer=timer.name)
    print("\n".join(C.env_lines(env)))
    for dtype in args.out_dirs:
        if args.features:
            features.run_features(args, rows, dtype, timer, env)
            continue
        t0, grid = time.time(), build_grid(args.d, args.causal, args.mode, args.seqlens, args.batch, args.heads)
        res = run_grid(args, grid, args.providers or default_providers(dtype), dtype, timer)
        report(args, res, dtype, env, time.time() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
