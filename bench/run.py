#!/usr/bin/env python
"""Benchmark flash_cuda against PyTorch SDPA's backends: TFLOPS per (D, causal, mode, S) cell (bench/README.md)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import itertools
import math
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402 (bench/common.py)

sys.path.append(str(C.REPO_ROOT))  # flash_cuda.reference of this checkout where flash_cuda is not installed

DEFAULT_D, DEFAULT_CAUSAL, MODES = [64, 128], [0, 1], ["fwd", "bwd", "fwd_bwd"]
DEFAULT_SEQLENS, QUICK_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384], [1024, 4096, 16384]
TOKENS, HIDDEN = 16384, 2048  # B * S and H * D of every config unless --batch / --heads (FlashAttention's)
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # a backward = 2.5 forwards
FLASH_KERNEL = {"flash_cuda": "auto", "flash_cuda_simt": "simt", "flash_cuda_mma": "mma", "flash_cuda_det": "auto"}
SDPA_BACKEND = {"sdpa": None, "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}
PROVIDERS = [*FLASH_KERNEL, *SDPA_BACKEND]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_SHORT = {t: name for name, t in DTYPES.items()}
# Relative L2 error allowed against the float32 reference: (output, gradients).
TOLERANCE = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (1e-2, 2e-2), torch.float32: (2e-3, 5e-3)}
GRID_KEYS = ["D", "causal", "mode", "S", "B", "H"]
ANCHOR_KEYS = ["dtype", "D", "causal", "S", "B", "H", "mode"]
CSV_COLUMNS = ["provider", *ANCHOR_KEYS, "ms", "tflops", "peak_gib", "status"]  # the anchors' columns + status
BUDGET_MS, QUICK_BUDGET_MS = (25.0, 100.0), (10.0, 30.0)  # do_bench (warm-up, timing) per cell
UNSUPPORTED_WORDS = ("not supported", "unsupported", "only supports", "no available kernel", "no viable backend")
STATUS_TAGS = {"WRONG": "WRONG", "OOM": "OOM", "unsupported": "n/s", "unavailable": "n/a", "skipped": "skip",
               "error": "err"}


def attention_flops(B, H, S_q, S_k, D, causal, mode="fwd") -> float:
    """4*B*H*S_q*S_k*D for the forward (two matmuls), halved when causal."""
    return 4.0 * B * H * S_q * S_k * D / (2.0 if causal else 1.0) * MODE_FLOP_FACTOR[mode]


def build_grid(d_list, causal_list, modes, seqlens, batch=None, heads=None) -> pd.DataFrame:
    """Every config in output order (D, causal, mode, then S)."""
    return pd.DataFrame([(D, int(c), m, S, batch or max(1, TOKENS // S), heads or max(1, HIDDEN // D))
                         for D, c, m, S in itertools.product(d_list, causal_list, modes, seqlens)], columns=GRID_KEYS)


def default_providers(dtype) -> list[str]:
    return ["flash_cuda", "flash_cuda_simt" if dtype == torch.float32 else "flash_cuda_mma", *SDPA_BACKEND]


def math_backend_gib(provider, B, H, S, mode) -> float:
    """Rough peak of SDPA's math backend: 2.4 (fwd) / 4.2 (bwd) float32 S x S score buffers, fitted to the anchors."""
    return (2.4 if mode == "fwd" else 4.2) * B * H * S * S * 4 / 2**30 if provider == "sdpa_math" else 0.0


def status_tag(status: str) -> str:
    return next((tag for prefix, tag in STATUS_TAGS.items() if status.startswith(prefix)), "?")


def short_text(text, width: int = 80) -> str:  # the first non-empty line
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


@dataclass(frozen=True)
class Call:
    """One measured call: len(seqlens) sequences, dense (B, H, S, D) or packed (total, H, D)."""
    provider: str
    D: int
    H: int
    causal: bool
    mode: str
    seqlens: tuple
    varlen: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    dropout: float = 0.0

    def options(self) -> dict:
        """attention()'s options but alibi_slopes; defaults left out, so plain calls need no feature support."""
        return {"is_causal": self.causal, **({"window_size": self.window} if self.window != (-1, -1) else {}),
                **({"softcap": self.softcap} if self.softcap else {}),
                **({"dropout_p": self.dropout} if self.dropout else {})}


class Unavailable(Exception):
    """flash_cuda cannot run at all; the message is the cell's status."""


def load_flash_cuda():
    try:
        import flash_cuda
    except Exception as exc:  # ImportError, a broken extension, ...
        raise Unavailable(f"unavailable: {type(exc).__name__}: {short_text(exc)}") from None
    if not flash_cuda.is_available():
        raise Unavailable("unavailable: flash_cuda.is_available() is False")
    return flash_cuda


def alibi_slopes(H: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32)


def make_inputs(call: Call, dtype, seed: int, device="cuda"):
    """Random q, k, v, dout and cu_seqlens (None when dense); None when they do not fit."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (sum(call.seqlens), call.H, call.D) if call.varlen else (len(call.seqlens), call.H, call.seqlens[0], call.D)
    cu = torch.tensor([0, *itertools.accumulate(call.seqlens)], dtype=torch.int32, device=device)
    try:
        return (*(torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4)),
                cu if call.varlen else None)
    except torch.cuda.OutOfMemoryError:
        return None


def make_fn(call: Call, cu, device):
    """(q, k, v) -> out of the call's provider (measure() forces SDPA's backend)."""
    if call.provider in SDPA_BACKEND:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=call.causal, dropout_p=call.dropout)
    fc, opts = load_flash_cuda(), call.options()
    if FLASH_KERNEL[call.provider] != "auto":
        opts["kernel"] = FLASH_KERNEL[call.provider]
    if call.provider == "flash_cuda_det":
        opts["deterministic"] = True
    if call.alibi:
        opts["alibi_slopes"] = alibi_slopes(call.H).to(device)
    if call.varlen:
        m = max(call.seqlens)
        return lambda q, k, v: fc.varlen_attention(q, k, v, cu, cu, m, m, **opts)
    return lambda q, k, v: fc.attention(q, k, v, **opts)


def check(call: Call, fwd, q, k, v, dout, cu, dtype) -> str:
    """'ok' or 'WRONG (...)' against the float32 reference on heads 0 and H-1 of the last sequence: cheap at any S,
    and a wrong batch or head offset still shows."""
    from flash_cuda.reference import attention_naive, dropout_keep_mask
    heads = torch.tensor(sorted({0, call.H - 1}), device=q.device)
    a, b = (int(cu[-2]), int(cu[-1])) if call.varlen else (None, None)

    def view(t):  # -> (1, heads, S, D) float32
        if call.varlen:
            return t.detach()[a:b].index_select(1, heads).transpose(0, 1).unsqueeze(0).float()
        return t.detach()[-1:].index_select(1, heads).float()
    opts, need_grad, ref_in = call.options(), call.mode != "fwd", [view(t).requires_grad_() for t in (q, k, v)]
    if call.alibi:
        opts["alibi_slopes"] = alibi_slopes(call.H)[heads.cpu()].to(q.device)
    if call.dropout:
        if call.provider != "flash_cuda" or call.varlen:
            raise ValueError("the bench checks dropout on flash_cuda's dense calls only (their random numbers)")
        # The call draws with the generator's next (seed, offset): its mask for the checked heads.
        seed, offset = next_philox(q.device)
        mask = dropout_keep_mask(1, call.H, call.seqlens[-1], call.seqlens[-1], call.dropout, seed, offset,
                                 q.device, first_batch=len(call.seqlens) - 1)
        opts["dropout_mask"] = mask.index_select(1, heads)
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.enable_grad():
            ref = attention_naive(*ref_in, **opts)[0]
            want = [ref.detach(), *(torch.autograd.grad(ref, ref_in, view(dout)) if need_grad else ())]
    except torch.cuda.OutOfMemoryError:
        tqdm.write(f"no memory for the reference of {call}: not checked", sys.stderr)
        return "ok"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    out = fwd(q, k, v)
    if out.shape != q.shape:
        return f"WRONG (output shape {tuple(out.shape)})"
    got = [view(out)]
    if need_grad:
        out.backward(dout)
        got += [view(t.grad) for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    for i, (name, x, w) in enumerate(zip(("out", "dq", "dk", "dv"), got, want)):
        tol = TOLERANCE[dtype][min(i, 1)]
        err = float((x - w).norm() / w.norm().clamp_min(1e-30)) if x.isfinite().all() else math.inf
        if not err <= tol:
            return f"WRONG ({name} rel err {err:.3g} > {tol:g})"
    return "ok"


def next_philox(device) -> tuple[int, int]:
    """(seed, offset) the next dropout call on ``device`` draws with: torch's CUDA generator's
    current seed and Philox offset (flash_cuda's binding takes them as torch's kernels do)."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return gen.initial_seed(), gen.get_offset()


def time_call(fwd, q, k, v, dout, mode: str, timer) -> tuple[float, float]:
    """(median ms, peak GiB above the allocation before); bwd alone runs after a forward outside the timed region."""
    grads = (q, k, v) if mode != "fwd" else ()
    if mode == "bwd":
        out = fwd(q, k, v)
        fn = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
    else:
        fn = (lambda: fwd(q, k, v)) if mode == "fwd" else (lambda: fwd(q, k, v).backward(dout))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = max(torch.cuda.max_memory_allocated() - base, 0) / 2**30
    ms = timer(fn, grad_to_none=grads)
    for t in grads:
        t.grad = None
    return ms, peak


def classify_error(exc: BaseException) -> str:
    msg = str(exc)
    if isinstance(exc, Unavailable):
        return msg
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in msg.lower():
        return "OOM"
    if isinstance(exc, (NotImplementedError, ValueError)) or any(w in msg.lower() for w in UNSUPPORTED_WORDS):
        return "unsupported: " + short_text(msg)
    return f"error: {type(exc).__name__}: {short_text(msg)}"


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def measure(call: Call, inputs, flops: float, dtype, timer, check_first: bool = True) -> dict:
    """{ms, tflops, peak_gib, status} of the call on new leaves of inputs; a failure becomes the status."""
    if inputs is None:
        return {"status": "OOM (inputs)"}
    q, k, v = (t.detach().requires_grad_(call.mode != "fwd") for t in inputs[:3])
    dout, cu = inputs[3:]
    with warnings.catch_warnings():  # SDPA warns why each backend refused; the status says it is unsupported
        warnings.simplefilter("ignore")
        try:
            backend = SDPA_BACKEND.get(call.provider)
            with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
                fwd = make_fn(call, cu, q.device)
                status = check(call, fwd, q, k, v, dout, cu, dtype) if check_first else "ok"
                if status == "ok":
                    ms, peak = time_call(fwd, q, k, v, dout, call.mode, timer)
        except Exception as exc:  # noqa: BLE001 -- every failure becomes a status
            status = classify_error(exc)
    if status != "ok":
        free_memory()
        return {"status": status}
    return {"ms": ms, "tflops": flops / ms / 1e9, "peak_gib": peak, "status": "ok"}


def measure_all(flops: dict, dtype, timer, seed: int, check_first: bool, device="cuda") -> dict:
    """{call: measure()} for flops ({call: FLOP count}); the calls of one shape share one set of inputs."""
    groups, results = collections.defaultdict(list), {}
    for c in flops:
        groups[c.varlen, c.D, c.H, c.seqlens].append(c)
    bar = tqdm(total=len(flops), disable=None, file=sys.stderr, dynamic_ncols=True)  # off where not a terminal
    for i, group in enumerate(groups.values()):
        inputs = make_inputs(group[0], dtype, seed + i, device)
        for c in group:
            bar.set_description_str(f"{c.provider} D={c.D} S={max(c.seqlens)} {c.mode}", refresh=False)
            bar.update()
            results[c] = measure(c, inputs, flops[c], dtype, timer, check_first)
        del inputs
        free_memory()
    bar.close()
    return results


def run_grid(args, grid: pd.DataFrame, providers, dtype, timer, device="cuda") -> pd.DataFrame:
    """One row per (config, provider) cell; sdpa_math skipped where its S x S buffers would pass the limit."""
    cells, flops, skipped = [], {}, {}
    for cfg, p in itertools.product(grid.itertuples(index=False), providers):
        D, S, B, H = int(cfg.D), int(cfg.S), int(cfg.B), int(cfg.H)
        call = Call(p, D, H, bool(cfg.causal), cfg.mode, (S,) * B)
        cells.append((cfg, call))
        gib = math_backend_gib(p, B, H, S, cfg.mode)
        if gib > args.max_quadratic_gib:
            skipped[call] = {"status": f"skipped: O(S^2) memory (~{gib:.0f} GiB)"}
        else:
            flops[call] = attention_flops(B, H, S, S, D, cfg.causal, cfg.mode)
    results = {**measure_all(flops, dtype, timer, args.seed, not args.no_check, device), **skipped}
    records = [{**cfg._asdict(), "provider": call.provider, **results[call]} for cfg, call in cells]
    res = pd.DataFrame(records, columns=[*GRID_KEYS, "provider", "ms", "tflops", "peak_gib", "status"])
    return res.assign(dtype=str(dtype).removeprefix("torch."))


def grid_table(res: pd.DataFrame) -> list[str]:
    """Markdown: TFLOPS per provider, the first flash_cuda provider / each SDPA one, the reasons of empty cells."""
    providers = list(dict.fromkeys(res.provider))
    order = pd.MultiIndex.from_frame(res[GRID_KEYS].drop_duplicates())

    def wide(values):
        return res.assign(v=values).set_index(GRID_KEYS + ["provider"]).v.unstack().reindex(order)[providers]
    table = wide(C.fmt(res.tflops, ".1f").where(res.status == "ok", res.status.map(status_tag)))
    tflops = wide(res.tflops.where(res.status == "ok"))
    num = next((p for p in providers if p in FLASH_KERNEL), None)
    for p in (p for p in SDPA_BACKEND if p in providers and num):
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
    if ((g.B * g.S == TOKENS) & (g.H * g.D == HIDDEN)).all():
        return f"B*S={TOKENS}, H*D={HIDDEN}"
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
                        title=f"{DTYPE_SHORT[dtype]}, D={D}, causal={causal}, {mode} ({shape_text(g)})")
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
    out = pd.concat([same, ok[ok.provider.isin(FLASH_KERNEL)].merge(best, on=ANCHOR_KEYS)])
    out = out.sort_values("order", kind="stable")
    name = out.provider.where(out.provider == out.anchor_provider, out.provider + " vs " + out.anchor_provider)
    return pd.DataFrame({"D": out.D, "causal": out.causal, "mode": out["mode"], "S": out.S.map(C.fmt_size),
                         "provider": name, "ours": C.fmt(out.tflops, ".1f"), "anchor": C.fmt(out.anchor, ".1f"),
                         "ratio": C.fmt(out.tflops / out.anchor, ".2f"), "source": out.source})


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Benchmark flash_cuda against PyTorch SDPA's backends (TFLOPS, median of "
                    "triton.testing.do_bench with the L2 flushed; bench/README.md).")
    a = p.add_argument
    a("--d", type=int, nargs="+", default=DEFAULT_D, metavar="D", help="head dims (default 64 128)")
    a("--causal", type=int, nargs="+", choices=[0, 1], default=DEFAULT_CAUSAL, help="0 and/or 1")
    a("--mode", nargs="+", choices=MODES, help="fwd, bwd, fwd_bwd (default all; --features: fwd bwd)")
    a("--seqlen", nargs="+", type=C.parse_size, metavar="S", help="e.g. 4096 or 4k (default 512 1k 2k 4k 8k 16k)")
    a("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES), help="several: one results folder each")
    a("--providers", nargs="+", choices=PROVIDERS, metavar="P",
      help=f"subset of: {', '.join(PROVIDERS)} (default: flash_cuda, the dtype's tier, every sdpa*)")
    a("--batch", type=int, help="B of every config (default 16384 // S)")
    a("--heads", type=int, help="H of every config (default 2048 // D)")
    a("--quick", action="store_true", help="S in {1k, 4k, 16k}, do_bench budgets 10 / 30 ms instead of 25 / 100")
    a("--max-quadratic-gib", type=float, default=40.0, help="skip sdpa_math where its S^2 buffers pass this GiB")
    a("--no-check", action="store_true", help="skip the correctness check")
    a("--no-plots", action="store_true", help="do not write PNG plots")
    a("--out", help="results folder (default bench/results/<dtype>; several dtypes: OUT/<dtype>)")
    a("--compare-anchors", nargs="?", const="auto", metavar="DIR", help="our numbers next to DIR's (shared/anchors)")
    a("--seed", type=int, default=0, help="random seed for the inputs")
    a("--features", action="store_true", help="window, varlen, softcap, ALiBi rows instead of the grid")
    a("--dry-run", action="store_true", help="print the configs and providers, run nothing")
    args = p.parse_args(argv)
    for D in args.d:
        if D % 8 or not 8 <= D <= 256:
            p.error(f"--d {D}: head dims must be multiples of 8 in [8, 256]")
    args.seqlens = args.seqlen or (QUICK_SEQLENS if args.quick else DEFAULT_SEQLENS)
    args.budget_ms = QUICK_BUDGET_MS if args.quick else BUDGET_MS
    args.mode = args.mode or (["fwd", "bwd"] if args.features else MODES)
    dtypes = list(dict.fromkeys(DTYPES[d] for d in args.dtype))  # unique, in order
    args.dtype = [DTYPE_SHORT[d] for d in dtypes]
    base = Path(args.out) if args.out else C.REPO_ROOT / "bench" / "results"
    args.out_dirs = {d: base if args.out and len(dtypes) == 1 else base / DTYPE_SHORT[d] for d in dtypes}
    return args


def dry_run(args) -> None:
    for dtype, out in args.out_dirs.items():
        providers = args.providers or default_providers(dtype)
        grid = build_grid(args.d, args.causal, args.mode, args.seqlens, args.batch, args.heads)
        skipped = sum(math_backend_gib(p, c.B, c.H, c.S, c.mode) > args.max_quadratic_gib
                      for c in grid.itertuples() for p in providers)
        print(f"{DTYPE_SHORT[dtype]}: {len(grid)} configs x {len(providers)} providers = "
              f"{len(grid) * len(providers)} cells ({skipped} skipped for O(S^2) memory)\n"
              f"  providers: {', '.join(providers)}\n  D {args.d}, causal {args.causal}, modes {args.mode}, "
              f"S {[C.fmt_size(s) for s in args.seqlens]}, {shape_text(grid)}\n  output: {out}")


def report(args, res: pd.DataFrame, dtype, env: dict, elapsed: float) -> None:
    out_dir = Path(args.out_dirs[dtype])
    title = (f"flash_cuda benchmark, {DTYPE_SHORT[dtype]}, {shape_text(res)}, {len(res[GRID_KEYS].drop_duplicates())}"
             f" configs x {res.provider.nunique()} providers ({elapsed:.0f} s)")
    table = grid_table(res)
    print(f"\n## {title}\n\n" + "\n".join(table))
    body = ["TFLOPS (ratios: flash_cuda / SDPA backend; >1 means flash_cuda is faster)", "", *table]
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
    if args.features:  # bench/features.py, on this copy of the module
        sys.modules.setdefault("run", sys.modules[__name__])
        import features
        rows = features.build_rows(args.d, args.causal, args.mode)
        if not rows:
            print("--features: nothing to run (softcap / ALiBi need --d 128, window --causal 1)")
            return 2
    if args.dry_run:
        if args.features:
            features.dry_run(args, rows)
        else:
            dry_run(args)
        return 0
    if not torch.cuda.is_available():
        print("bench/run.py needs a CUDA GPU (use --dry-run to see the plan).", file=sys.stderr)
        return 2
    timer = C.Timer(*args.budget_ms)
    try:
        version = load_flash_cuda().__version__
    except Unavailable as exc:
        version = str(exc)
    env = C.environment(flash_cuda=version, timer=timer.name)
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
