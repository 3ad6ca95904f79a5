"""The attention features next to the plain call: `python bench/run.py --features`.

Rows (bf16 unless --dtype; H*D = 2048; every row is fwd and bwd, --d / --causal / --mode
narrow them):
  window        B=1, S=16k, window_size=(1024, 0) with is_causal=True  vs  causal, same S
                (goal: ratio >= 0.85), D in {128, 64}
  varlen        8 packed sequences of 2k (16k tokens)  vs  dense B=8, S=2k (goal >= 0.95),
                D in {128, 64}, causal 0 / 1
  varlen mixed  8 packed sequences, lengths drawn (seed 0) from 128..4096  vs  the same
                dense call (reported, no goal)
  softcap / alibi  B=4, S=4k, D=128, softcap=50.0 / ALiBi slopes 2^(-8(h+1)/H)  vs  plain
The last column is SDPA with no backend forced on the baseline ("vs") call.

TFLOPS count the VISIBLE (query, key) pairs exactly: 4 * H * D * pairs for the forward, 2.5x
for bwd, 3.5x for fwd_bwd (full causal is S(S+1)/2 pairs per sequence, not run.py's S^2/2).
Each call is checked once against flash_cuda.reference.attention_naive in float32 (TF32
off) on heads 0 and H-1 of the last batch entry (varlen: of the last packed sequence), then
timed with run.py's timer (median, L2 flushed) and time_call, on fresh random inputs per
shape. Writes features.csv and features.md in the results folder.
"""

from __future__ import annotations

import functools
import itertools
import random
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as R  # noqa: E402 (bench/run.py: timer, checks, inputs, environment)

WINDOW = (1024, 0)
WINDOW_S = 16384
VARLEN_B, VARLEN_S = 8, 2048
MIXED_RANGE, MIXED_SEED = (128, 4096), 0
SMALL_S, SMALL_D = 4096, 128  # softcap / ALiBi rows
SOFTCAP = 50.0
GOAL_WINDOW, GOAL_VARLEN = 0.85, 0.95  # the issue: within 15% / 5% of the baseline

CSV_COLUMNS = ["feature", "provider", "dtype", "D", "H", "causal", "mode", "layout", "B",
               "seqlens", "total_tokens", "window_left", "window_right", "softcap", "alibi",
               "visible_pairs", "ms", "tflops", "peak_gib", "status", "baseline_tflops",
               "ratio", "goal"]


# ----------------------------------------------------------------------------------------
# Pure helpers (CPU)
# ----------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def visible_pairs(sq: int, sk: int, window_left: int = -1, window_right: int = -1) -> int:
    """Number of (query i, key j) pairs with 0 <= j < sk and, d = i + sk - sq being the
    bottom-right aligned diagonal, d - window_left <= j <= d + window_right (-1: that side
    unbounded). Causal is window_right = 0."""
    if sq <= 0 or sk <= 0:
        return 0
    diag = torch.arange(sq, dtype=torch.int64) + (sk - sq)
    lo = (diag - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(diag)
    hi = (diag + window_right).clamp(max=sk - 1) if window_right >= 0 else \
        torch.full_like(diag, sk - 1)
    return int((hi - lo + 1).clamp(min=0).sum())


def mixed_seqlens(n: int, lo: int, hi: int, seed: int) -> tuple:
    """n lengths drawn uniformly from lo..hi (inclusive) with a fixed seed."""
    rng = random.Random(seed)
    return tuple(rng.randint(lo, hi) for _ in range(n))


def alibi_slopes(H: int) -> torch.Tensor:
    """The ALiBi paper's slopes 2^(-8 (h+1) / H), float32 (H,)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32)


@dataclass(frozen=True)
class Call:
    """One measured call: len(seqlens) sequences, dense (B, H, S, D) (equal lengths) or
    packed (total, H, D) with cu_seqlens when varlen."""
    provider: str  # "flash_cuda" or "sdpa"
    D: int
    H: int
    causal: bool
    mode: str
    seqlens: tuple
    varlen: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False

    def sides(self) -> tuple:
        """(left, right) window sides as the kernels see them (causal: right = 0)."""
        return self.window[0], 0 if self.causal else self.window[1]

    def pairs(self) -> int:
        return sum(visible_pairs(s, s, *self.sides()) for s in self.seqlens)

    def flops(self) -> float:
        return 4.0 * self.H * self.D * self.pairs() * R.MODE_FLOP_FACTOR[self.mode]

    def label(self) -> str:
        n, s = len(self.seqlens), self.seqlens[0]
        if not self.varlen:
            text = f"B={n} S={R.fmt_seqlen(s)}"
        elif len(set(self.seqlens)) == 1:
            text = f"varlen {n}x{R.fmt_seqlen(s)}"
        else:
            text = f"varlen {n} mixed ({sum(self.seqlens)} tok)"
        if self.window != (-1, -1):
            text += f" window ({self.window[0]}, {self.window[1]})"
        if self.softcap:
            text += f" softcap {self.softcap:g}"
        if self.alibi:
            text += " alibi"
        return text + ("" if self.provider == "flash_cuda" else f" [{self.provider}]")

    def options(self) -> dict:
        """Keyword options of the call, those at their defaults left out (ALiBi apart)."""
        opts = {"is_causal": self.causal}
        if self.window != (-1, -1):
            opts["window_size"] = self.window
        if self.softcap:
            opts["softcap"] = self.softcap
        return opts

    def input_key(self) -> tuple:
        return self.varlen, self.D, self.H, self.seqlens


@dataclass(frozen=True)
class Row:
    """A table row: the flash_cuda call with the feature vs the plain flash_cuda call."""
    feature: str
    call: Call
    base: Call
    goal: float | None = None

    @property
    def sdpa(self) -> Call:
        return replace(self.base, provider="sdpa")


def build_rows(d_list, causal_list, modes) -> list:
    def dense(D, causal, mode, B, S):
        return Call("flash_cuda", D, R.HIDDEN // D, bool(causal), mode, (S,) * B)

    rows = []
    if 1 in causal_list:
        for D in d_list:
            for mode in modes:
                base = dense(D, 1, mode, max(1, R.TOKENS // WINDOW_S), WINDOW_S)
                rows.append(Row("window", replace(base, window=WINDOW), base, GOAL_WINDOW))
    mixed = mixed_seqlens(VARLEN_B, *MIXED_RANGE, MIXED_SEED)
    for D in d_list:
        for causal in causal_list:
            for mode in modes:
                base = dense(D, causal, mode, VARLEN_B, VARLEN_S)
                rows.append(Row("varlen", replace(base, varlen=True), base, GOAL_VARLEN))
                rows.append(Row("varlen mixed", replace(base, varlen=True, seqlens=mixed),
                                base))
    if SMALL_D in d_list:
        for causal in causal_list:
            for mode in modes:
                base = dense(SMALL_D, causal, mode, R.TOKENS // SMALL_S, SMALL_S)
                rows.append(Row("softcap", replace(base, softcap=SOFTCAP), base))
                rows.append(Row("alibi", replace(base, alibi=True), base))
    return rows


def distinct_calls(rows) -> list:
    return list(dict.fromkeys(c for r in rows for c in (r.call, r.base, r.sdpa)))


def ratio_of(row: Row, results) -> float | None:
    a, b = results.get(row.call), results.get(row.base)
    return a.tflops / b.tflops if a and b and a.ok and b.ok else None


def markdown_table(rows, results) -> list:
    head = ["feature", "D", "causal", "mode", "flash_cuda call", "TFLOPS", "vs (flash_cuda)",
            "TFLOPS", "ratio", "goal", "SDPA default (vs call)"]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---:|---|---|---:|---|---:|---:|---|---:|"]
    notes = {}

    def cell(call):
        r = results.get(call)
        if r is None:
            return ""
        if r.ok:
            return f"{r.tflops:.1f}"
        notes.setdefault((call.label(), r.status), []).append(call)
        return R.status_tag(r.status)

    for row in rows:
        c = row.call
        ratio = ratio_of(row, results)
        goal = "" if row.goal is None else f">= {row.goal:.2f}"
        if goal and ratio is not None:
            goal += " yes" if ratio >= row.goal else " NO"
        lines.append(f"| {row.feature} | {c.D} | {int(c.causal)} | {c.mode} | {c.label()} | "
                     f"{cell(c)} | {row.base.label()} | {cell(row.base)} | "
                     f"{'' if ratio is None else f'{ratio:.2f}'} | {goal} | {cell(row.sdpa)} |")
    lines += ["", "TFLOPS on visible (query, key) pairs: fwd 4*H*D*pairs, bwd 2.5x; ratio = "
              "feature / vs (flash_cuda both)."]
    mixed = {r.call.seqlens for r in rows if r.feature == "varlen mixed"}
    lines += [f"varlen mixed lengths (seed {MIXED_SEED}): {', '.join(map(str, m))}."
              for m in mixed]
    if notes:
        lines += ["", "Cells without a number:"]
        lines += [f"- {label} ({len(calls)}x): {status}" for (label, status), calls in notes.items()]
    return lines


def csv_rows(rows, results, dtype: torch.dtype):
    role = {}
    for row in rows:
        for call, name in ((row.call, row.feature), (row.base, "baseline"),
                           (row.sdpa, "sdpa baseline")):
            role.setdefault(call, (name, row))
    for call, (feature, row) in role.items():
        r = results.get(call)
        if r is None:
            continue
        is_feature = call == row.call
        ratio = ratio_of(row, results) if is_feature else None
        base = results.get(row.base)
        lens = call.seqlens
        yield {"feature": feature, "provider": call.provider,
               "dtype": str(dtype).replace("torch.", ""), "D": call.D, "H": call.H,
               "causal": int(call.causal), "mode": call.mode,
               "layout": "varlen" if call.varlen else "dense", "B": len(lens),
               "seqlens": f"{lens[0]}x{len(lens)}" if len(set(lens)) == 1 else
               ";".join(map(str, lens)),
               "total_tokens": sum(lens), "window_left": call.sides()[0],
               "window_right": call.sides()[1], "softcap": call.softcap,
               "alibi": int(call.alibi), "visible_pairs": call.pairs(),
               "ms": f"{r.ms:.4f}" if r.ok else "", "tflops": f"{r.tflops:.1f}" if r.ok else "",
               "peak_gib": f"{r.peak_gib:.3f}" if r.ok else "", "status": r.status,
               "baseline_tflops": f"{base.tflops:.1f}" if is_feature and base and base.ok
               else "",
               "ratio": "" if ratio is None else f"{ratio:.3f}",
               "goal": "" if not is_feature or row.goal is None else f"{row.goal:g}"}


# ----------------------------------------------------------------------------------------
# GPU: inputs, call, check, timing
# ----------------------------------------------------------------------------------------

def make_call_inputs(call: Call, dtype, seed: int, device="cuda"):
    """Fresh q, k, v, dout (dense (B, H, S, D) or packed (total, H, D)) and cu_seqlens."""
    if not call.varlen:
        return (*R.make_inputs(len(call.seqlens), call.H, call.seqlens[0], call.D, dtype,
                               seed, device), None)
    q, k, v, dout = (t[0] for t in R.make_inputs(1, sum(call.seqlens), call.H, call.D, dtype,
                                                   seed, device))
    cu = torch.tensor([0, *itertools.accumulate(call.seqlens)], dtype=torch.int32,
                      device=device)
    return q, k, v, dout, cu


def make_fn(call: Call, cu, device):
    """(q, k, v) -> out; options left at their defaults are not passed."""
    if call.provider == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=call.causal)
    fc = R.load_flash_cuda()
    opts = call.options()
    if call.alibi:
        opts["alibi_slopes"] = alibi_slopes(call.H).to(device)
    if call.varlen:
        m = max(call.seqlens)
        return lambda q, k, v: fc.varlen_attention(q, k, v, cu, cu, m, m, **opts)
    return lambda q, k, v: fc.attention(q, k, v, **opts)


def check_call(call: Call, fwd, q, k, v, dout, cu, dtype) -> str:
    """One call (+ backward) against flash_cuda.reference.attention_naive in float32 on
    heads 0 and H-1 of the last sequence: 'ok' or 'WRONG (...)'."""
    try:
        from flash_cuda.reference import attention_naive  # noqa: WPS433
    except ImportError:  # not installed: the pure-PyTorch reference of this checkout
        sys.path.append(str(R.REPO_ROOT))
        from flash_cuda.reference import attention_naive  # noqa: WPS433
    heads = torch.tensor(sorted({0, call.H - 1}), device=q.device)
    if call.varlen:
        a, b = int(cu[-2]), int(cu[-1])

        def view(t):
            return t.detach()[a:b].index_select(1, heads).transpose(0, 1).unsqueeze(0).float()
    else:
        def view(t):
            return R.take_slice(t, heads)
    need_grad = call.mode != "fwd"
    out = fwd(q, k, v)
    got = [view(out)]
    if need_grad:
        out.backward(dout)
        if any(t.grad is None for t in (q, k, v)):
            return "WRONG (a gradient is None)"
        got += [view(t.grad) for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    del out
    qs, ks, vs = (view(t).requires_grad_() for t in (q, k, v))
    opts = call.options()
    if call.alibi:
        opts["alibi_slopes"] = alibi_slopes(call.H)[heads.cpu()].to(q.device)
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.enable_grad():
            ref, _ = attention_naive(qs, ks, vs, **opts)
            want = [ref.detach()]
            if need_grad:
                want += list(torch.autograd.grad(ref, (qs, ks, vs), view(dout)))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    tol_out, tol_grad = R.TOLERANCE[dtype]
    for name, x, w in zip(("out", "dq", "dk", "dv"), got, want):
        tol = tol_out if name == "out" else tol_grad
        err = R.relative_error(x, w)
        if not err <= tol:  # also catches NaN
            return f"WRONG ({name} rel err {err:.3g} > {tol:g})"
    return "ok"


def measure_call(call: Call, inputs, dtype, timer, check: bool) -> R.Result:
    """Check, then time one call (run.py's time_call); never raises."""
    q0, k0, v0, dout, cu = inputs
    if call.mode != "fwd":  # new leaves sharing the storage
        q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
    else:
        q, k, v = q0, k0, v0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fwd = make_fn(call, cu, q.device)
            status = check_call(call, fwd, q, k, v, dout, cu, dtype) if check else "ok"
            if status == "ok":
                ms, peak = R.time_call(fwd, q, k, v, dout, call.mode, timer)
        except Exception as exc:  # noqa: BLE001 -- every failure becomes a status
            status = R.classify_error(exc, caught)
            exc = None  # noqa: F841 (drop the traceback's tensors)
    if status != "ok":
        R.free_memory()
        return R.Result(status=status)
    return R.Result(ms=ms, tflops=R.tflops_from_ms(call.flops(), ms), peak_gib=peak)


# ----------------------------------------------------------------------------------------
# Driver (called by bench/run.py --features)
# ----------------------------------------------------------------------------------------

def run_features(args, rows, dtype, timer, header, device="cuda") -> dict:
    calls = distinct_calls(rows)
    groups = {}
    for c in calls:
        groups.setdefault(c.input_key(), []).append(c)
    results = {}
    progress = R.Progress(len(calls), enabled=not args.no_progress)
    t0 = time.time()
    for i, group in enumerate(groups.values()):
        try:
            inputs = make_call_inputs(group[0], dtype, args.seed + i, device)
        except torch.cuda.OutOfMemoryError:
            inputs = None
        for c in group:
            progress.step(f"{c.label()} {c.mode}")
            results[c] = (measure_call(c, inputs, dtype, timer, not args.no_check)
                          if inputs is not None else R.Result(status="OOM (inputs)"))
        del inputs
        R.free_memory()
    progress.close()

    out_dir = Path(args.out_dirs[dtype])
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows, results)
    title = (f"## flash_cuda features, {R.DTYPE_SHORT[dtype]}, {len(rows)} rows, "
             f"{len(calls)} calls ({time.time() - t0:.0f} s)")
    R.write_csv(out_dir / "features.csv", csv_rows(rows, results, dtype), CSV_COLUMNS)
    (out_dir / "features.md").write_text("\n".join([f"# {title[3:]}", "", "```", *header,
                                                    "```", "", *table]) + "\n")
    print(f"\nwrote {out_dir / 'features.csv'} and {out_dir / 'features.md'}\n")
    print(title)
    print()
    print("\n".join(table))
    return results


def main(args) -> int:
    rows = build_rows(args.d, args.causal, args.mode)
    dtypes = [R.DTYPES[d] for d in args.dtype]
    if not rows:
        print("--features: nothing to run (softcap / ALiBi need --d 128, window --causal 1)")
        return 2
    if args.dry_run:
        n = len(distinct_calls(rows))
        for row in rows:
            print(f"{row.feature:13s} D={row.call.D:<3d} causal={int(row.call.causal)} "
                  f"{row.call.mode:7s} {row.call.label()}  vs  {row.base.label()}")
        secs = n * ((args.warmup_ms + args.rep_ms) / 1e3 + 0.75)  # + check, inputs (H100)
        print(f"{len(rows)} rows, {n} timed calls per dtype ({', '.join(args.dtype)}); rough "
              f"time {secs * len(dtypes):.0f} s; output "
              f"{', '.join(str(Path(args.out_dirs[d]) / 'features.csv') for d in dtypes)}")
        return 0
    if not torch.cuda.is_available():
        print("bench/run.py --features needs a CUDA GPU (use --dry-run to see the plan).",
              file=sys.stderr)
        return 2
    timer = R.make_timer(args.timer, args.warmup_ms, args.rep_ms)
    header = R.environment_lines(timer.name)
    print("\n".join(header))
    for dtype in dtypes:
        run_features(args, rows, dtype, timer, header)
    return 0
