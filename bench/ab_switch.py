"""A/B of ablation rungs against the default, in one process of one build.

An ablation build (``FLASH_CUDA_ABLATIONS=1``; csrc/include/ablation.h) holds the default kernels
and the rungs OPTIMIZATION.md measured against them, and reads each rung's environment switch at
every launch. So one process can time the default and every rung on the same inputs, in
interleaved rounds, which takes less device time than two builds (bench/ab_builds.py, for changes
that are not behind a switch):

    FLASH_CUDA_ABLATIONS=1 python3 -m flash_cuda.build
    FLASH_CUDA_ABLATIONS=1 python3 bench/ab_switch.py --switch FLASH_CUDA_WS_BLOCK_M=128 --d 96 \\
        --seqlen 2k 4k 16k --rounds 5

``--switch`` may be given several times, one rung each, and a rung may set several switches
(``NAME=VALUE,NAME=VALUE``); every rung is timed against the same default.

Per cell (bf16 or fp16, B * S = --tokens, H * D = 2048, causal and not, the forward or with
``--mode bwd`` the backward alone, 2.5x the forward's FLOPs): the pooled
median time of each side over the rounds (``triton.testing.do_bench``, L2 flushed; the order of the
sides rotates by round), its TFLOPS, and rung time / default time (above 1: the default is faster;
``--mode fp8``: the FP8 forward on the same inputs rounded to e4m3, descales 1);
before timing, each side's error against float64 on one head beside naive attention's in the same
dtype (FlashAttention's 2x rule; the backward: the largest error of dq, dk, dv). Without a GPU or an
ablation build it says so and exits 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_size  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--switch", required=True, action="append", metavar="NAME=VALUE[,NAME=VALUE]",
                    help="a rung's environment switches (tiers/wgmma/ablation.h lists them); repeat for "
                         "several rungs")
    ap.add_argument("--d", type=int, nargs="+", default=[128], help="head dims (default 128)")
    ap.add_argument("--seqlen", nargs="+", default=["4k"], help="sequence lengths, e.g. 2k 4k 16k")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--tokens", type=parse_size, default=16384, help="B * S of every cell (default 16k)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mode", choices=["fwd", "bwd", "fp8"], default="fwd",
                    help="fp8: the FP8 forward (flash_cuda.attention_fp8) on the cells' inputs rounded to e4m3")
    ap.add_argument("--group", type=int, default=1,
                    help="query heads per KV head (GQA: K and V get H / group heads; default 1)")
    args = ap.parse_args(argv)
    args.rungs = []  # [[(name, value), ...] per rung]
    for rung in args.switch:
        pairs = []
        for item in rung.split(","):
            name, sep, value = item.partition("=")
            if not sep or not name.startswith("FLASH_CUDA_"):
                ap.error("--switch takes NAME=VALUE (comma-separated for several) with FLASH_CUDA_ switches")
            pairs.append((name, value))
        args.rungs.append(pairs)
    # the first rung's first switch (a single-switch call's)
    args.switch_name, args.switch_value = args.rungs[0][0]
    args.names = sorted({name for rung in args.rungs for name, _ in rung})
    args.seqlens = [parse_size(s) for s in args.seqlen]
    args.causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    return args


def cells(args):
    """(B, H, S, D, causal) of every cell: B * S = tokens, H * D = 2048."""
    return [(max(1, args.tokens // s), max(1, 2048 // d), s, d, c)
            for d in args.d for s in args.seqlens for c in args.causals]


def set_switch(args, side: int) -> None:
    """Side 0: the default (every switch of every rung unset); side r: rung r's switches set."""
    for name in args.names:
        os.environ.pop(name, None)
    if side > 0:
        os.environ.update(dict(args.rungs[side - 1]))


def rung_label(args, side: int) -> str:
    return ",".join(f"{n}={v}" for n, v in args.rungs[side - 1])


def accuracy(args, flash_cuda, torch, dtype, S, D, causal) -> str:
    """Max error against float64 of both sides and of naive attention in dtype, one (B 1, 2 KV heads)
    slice."""
    q = torch.randn(1, 2 * args.group, S, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, 2, S, D, device="cuda", dtype=dtype) for _ in range(2))
    mask = torch.ones(S, S, device="cuda", dtype=torch.bool).triu(1) if causal else None

    def rep(t):  # K or V for every query head (GQA)
        return t.repeat_interleave(args.group, dim=1)

    def scores(x, y, t):
        s = (x.to(t) @ rep(y).to(t).transpose(-1, -2)) / D ** 0.5
        return s.masked_fill(mask, float("-inf")) if causal else s

    if args.mode == "bwd":
        dout = torch.randn_like(q)

        def grads(fn, t):
            xs = [x.detach().to(t).requires_grad_() for x in (q, k, v)]
            return torch.autograd.grad(fn(*xs), xs, dout.to(t))

        def naive_fn(t):
            return lambda a, b, c: torch.softmax(scores(a, b, torch.float32), -1).to(t) @ rep(c)

        ref = grads(lambda a, b, c: torch.softmax(scores(a, b, torch.float64), -1) @ rep(c), torch.float64)
        naive = grads(naive_fn(dtype), dtype)
        errs = []
        for side in range(len(args.rungs) + 1):
            set_switch(args, side)
            got = grads(lambda a, b, c: flash_cuda.attention(a, b, c, is_causal=causal), dtype)
            errs.append(max((g.double() - r).abs().max().item() for g, r in zip(got, ref)))
        set_switch(args, 0)
        naive_err = max((g.double() - r).abs().max().item() for g, r in zip(naive, ref))
        return f"grads: {_errs(errs)}, naive {naive_err:.2e}"
    if args.mode == "fp8":  # e4m3 inputs; naive: the FP8 attention of flash_cuda.reference in float32
        from flash_cuda.reference import attention_fp8_naive
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
        naive = attention_fp8_naive(q, k, v, is_causal=causal)[0].double()
        call = flash_cuda.attention_fp8
    else:
        naive = (torch.softmax(scores(q, k, torch.float32), -1).to(dtype) @ rep(v)).double()
        call = flash_cuda.attention
    ref = torch.softmax(scores(q, k, torch.float64), -1) @ rep(v).double()
    errs = []
    for side in range(len(args.rungs) + 1):
        set_switch(args, side)
        errs.append((call(q, k, v, is_causal=causal).double() - ref).abs().max().item())
    set_switch(args, 0)
    return f"{_errs(errs)}, naive {(naive - ref).abs().max().item():.2e}"


def _errs(errs) -> str:
    """default's error, then each rung's (one rung: "rung", as before)."""
    if len(errs) == 2:
        return f"default {errs[0]:.2e}, rung {errs[1]:.2e}"
    return f"default {errs[0]:.2e}, " + ", ".join(f"rung {i} {e:.2e}" for i, e in enumerate(errs[1:], 1))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("ab_switch.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    import flash_cuda
    if not flash_cuda.is_available():
        print(f"ab_switch.py: the kernels are not available: {flash_cuda.unavailable_reason()}", file=sys.stderr)
        return 2
    if os.environ.get("FLASH_CUDA_ABLATIONS", "0") in ("", "0"):
        print("ab_switch.py: set FLASH_CUDA_ABLATIONS=1 (an ablation build reads the switches)", file=sys.stderr)
        return 2
    import triton.testing as tt
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    torch.manual_seed(0)
    todo = cells(args)
    sides = len(args.rungs) + 1
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, {args.mode}, "
          + (f"GQA group {args.group}, " if args.group > 1 else "")
          + ", ".join(f"rung{'' if sides == 2 else ' ' + str(i)} {rung_label(args, i)}" for i in range(1, sides))
          + f", {args.rounds} interleaved rounds")
    for (_, _, S, D, c) in todo:
        print(f"accuracy D {D} S {S} causal {c}: {accuracy(args, flash_cuda, torch, dtype, min(S, 4096), D, c)}",
              flush=True)
    bwd = args.mode == "bwd"
    inputs = {x: [torch.randn(x[0], x[1] // (1 if i == 0 else args.group), x[2], x[3], device="cuda", dtype=dtype,
                              requires_grad=bwd)
                  for i in range(3)] for x in todo}
    if args.mode == "fp8":
        inputs = {x: [t.to(torch.float8_e4m3fn) for t in ts] for x, ts in inputs.items()}
    times = {x: [[] for _ in range(sides)] for x in todo}
    for r in range(args.rounds):
        for x in todo:
            q, k, v = inputs[x]
            if bwd:  # the backward alone: one forward's graph, its backward timed (the switch read per launch)
                out = flash_cuda.attention(q, k, v, is_causal=x[4])
                dout = torch.randn_like(out)
                fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
            elif args.mode == "fp8":
                fn = lambda: flash_cuda.attention_fp8(q, k, v, is_causal=x[4])  # noqa: E731
            else:
                fn = lambda: flash_cuda.attention(q, k, v, is_causal=x[4])  # noqa: E731
            for side in side_order(sides, r):
                set_switch(args, side)
                times[x][side].append(tt.do_bench(fn, warmup=25, rep=100))
        set_switch(args, 0)
    if sides == 2:  # one rung: the table as it always was
        print("\n| D | B | H | S | causal | default ms | rung ms | default TFLOPS | rung TFLOPS | default / rung speed |")
        print("| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    else:
        print("\n" + "\n".join(f"rung {i}: {rung_label(args, i)}" for i in range(1, sides)))
        print("\n| D | B | H | S | causal | default ms | " + " | ".join(f"rung {i} ms | rung {i} / default"
                                                                   for i in range(1, sides)) + " |")
        print("| ---: | ---: | ---: | ---: | --- | ---: | " + " | ".join("---: | ---:" for _ in range(1, sides)) + " |")
    for x in todo:
        B, H, S, D, c = x
        med = [statistics.median(t) for t in times[x]]
        a = med[0]
        flops = 4 * B * H * S * S * D / (2 if c else 1) * (2.5 if bwd else 1)
        if sides == 2:
            b = med[1]
            print(f"| {D} | {B} | {H} | {S} | {c} | {a:.3f} | {b:.3f} | {flops / a / 1e9:.0f} | {flops / b / 1e9:.0f} "
                  f"| {b / a:.3f} |", flush=True)
        else:
            print(f"| {D} | {B} | {H} | {S} | {c} | {a:.3f} | "
                  + " | ".join(f"{m:.3f} | {m / a:.3f}" for m in med[1:]) + " |", flush=True)
    return 0


def side_order(sides: int, r: int):
    """Round r's order of the sides: rotated by one per round, so that no side always runs first
    (two sides: they alternate)."""
    return [(i + r) % sides for i in range(sides)]


if __name__ == "__main__":
    sys.exit(main())
