#!/usr/bin/env python
"""Run one attention config a few times for Nsight Compute. Each profiled iteration sits
between cudaProfilerStart / cudaProfilerStop (and inside an NVTX range named "flash_cuda"),
so that ncu captures exactly the attention kernels (input creation, warm-up and, for
--mode bwd, the forward stay outside):

    ncu --profile-from-start off --set full --clock-control none \\
        -o report -f python bench/ncu_profile.py --d 128 --seqlen 4096 --mode fwd
    python bench/ncu_summary.py report.ncu-rep

  --profile-from-start off  profile only between cudaProfilerStart and cudaProfilerStop.
                        These are process-wide, which matters for the backward: autograd
                        launches it from its own device thread, outside an NVTX range
                        pushed by this thread (`--nvtx --nvtx-include "flash_cuda/"` therefore
                        captures the forward kernels only).

  --clock-control none  keeps the GPU at its normal boost clocks (ncu locks them to base
                        clocks by default), so durations match bench/run.py.
  --set full            every section, including warp-state sampling and pipe utilisation.
  -f                    overwrite report.ncu-rep.

`python bench/ncu_profile.py --print-ncu-cmd [options]` prints the ncu command for the given
options. Without ncu the script simply runs (and prints the median time of the profiled
iterations), which is a quick way to check a config before profiling it.

Shapes follow bench/run.py: B*S = 16384 tokens and H*D = 2048 unless --batch / --heads are
given. --provider sdpa_cudnn (or sdpa, sdpa_flash, sdpa_efficient, sdpa_math) profiles a
PyTorch backend, and --provider fa4 FlashAttention-4 (`flash_attn.cute`, inputs made in its
(B, S, H, D) layout), under the same range name, for side-by-side reports; --provider
flash_cuda_fp8 the FP8 forward on the same inputs rounded to e4m3. --mode decode profiles
one KV-cache decode step of flash_cuda (bench/decode.py's inputs: --seqlen cached keys, --batch,
--heads query heads, --ratio, --sq, --kv 16|fp8, --cache dense|pagedN); with --provider sdpa (or
an sdpa_* backend) SDPA's step as bench/decode.py times it: the dense 16-bit cache's first
Sk + Sq rows, enable_gqa=True.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from pathlib import Path

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RANGE_NAME = "flash_cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SDPA_BACKENDS = ["sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"]


sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402 (bench/common.py: sizes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python bench/ncu_profile.py",
        description="Run one attention config under NVTX range 'flash_cuda' for ncu.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Profile with:\n  ncu --profile-from-start off --set full "
               "--clock-control none -o report -f python bench/ncu_profile.py [options]\n"
               "then: python bench/ncu_summary.py report.ncu-rep")
    p.add_argument("--d", type=int, default=128, help="head dim (default 128)")
    p.add_argument("--seqlen", default="4096", help="S for q and k/v, e.g. 4096 or 4k")
    p.add_argument("--batch", type=int, default=None, help="B (default 16384 // S)")
    p.add_argument("--heads", type=int, default=None, help="H (default 2048 // D)")
    p.add_argument("--causal", type=int, choices=[0, 1], default=0)
    p.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"),
                   help="flash_cuda's window_size (LEFT, RIGHT); -1 = unbounded")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--mode", choices=["fwd", "bwd", "fwd_bwd", "decode"], default="fwd",
                   help="decode: one attention_with_kvcache step over --seqlen cached keys per sequence "
                        "(--batch default 64, --heads query heads default 32; flash_cuda only)")
    p.add_argument("--ratio", type=int, default=4, help="decode: query heads per KV head (default 4)")
    p.add_argument("--sq", type=int, default=1, help="decode: new tokens per sequence (default 1)")
    p.add_argument("--kv", choices=["16", "fp8"], default="16", help="decode: the cache's type (default 16: q's)")
    p.add_argument("--cache", default="dense", help="decode: dense or pagedN (pages of N tokens)")
    p.add_argument("--kernel", choices=["auto", "simt", "mma"], default="auto",
                   help="flash_cuda tier (default auto)")
    p.add_argument("--deterministic", action="store_true",
                   help="flash_cuda backward without float atomics")
    p.add_argument("--provider", choices=["flash_cuda", "flash_cuda_fp8", "fa4"] + SDPA_BACKENDS, default="flash_cuda",
                   help="what runs inside the range (default flash_cuda)")
    p.add_argument("--warmup", type=int, default=3, help="un-profiled iterations first")
    p.add_argument("--iters", type=int, default=3, help="profiled iterations (NVTX ranges)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-ncu-cmd", action="store_true",
                   help="print the ncu command line for these options and exit")
    p.add_argument("--report", default=None,
                   help="report name used by --print-ncu-cmd (default derived from options)")
    args = p.parse_args(argv)
    args.S = C.parse_size(args.seqlen)
    if args.mode == "decode":
        if args.provider != "flash_cuda" and not (args.provider.startswith("sdpa") and args.kv == "16"
                                                  and args.cache == "dense"):
            p.error("--mode decode profiles flash_cuda, or an sdpa provider on a dense 16-bit cache")
        args.B = args.batch or 64
        args.H = args.heads or 32
        if args.ratio < 1 or args.H % args.ratio:
            p.error(f"--ratio {args.ratio} must divide the {args.H} query heads")
    else:
        args.B = args.batch or max(1, 16384 // args.S)
        args.H = args.heads or max(1, 2048 // args.d)
    return args


def ncu_command(args, argv) -> str:
    """The ncu command line that profiles this script with the same options."""
    report = args.report or (f"ncu_{args.provider}_{args.mode}_d{args.d}_s{args.S}"
                             f"_c{args.causal}_{args.dtype}"
                             + (f"_w{args.window[0]}_{args.window[1]}" if args.window else "")
                             + (f"_b{args.B}_kv{args.kv}_{args.cache}" if args.mode == "decode" else ""))
    script_args = [a for a in argv if a not in ("--print-ncu-cmd",)]
    # drop "--report NAME" (only meaningful to --print-ncu-cmd)
    cleaned, skip = [], False
    for a in script_args:
        if skip:
            skip = False
            continue
        if a == "--report":
            skip = True
            continue
        if a.startswith("--report="):
            continue
        cleaned.append(a)
    script = Path(__file__).resolve()
    try:
        script = script.relative_to(Path.cwd())
    except ValueError:
        pass
    return (f"ncu --profile-from-start off --set full --clock-control none "
            f"-o {shlex.quote(report)} -f python {shlex.quote(str(script))} "
            + " ".join(shlex.quote(a) for a in cleaned)).strip()


def make_forward(args):
    """(q, k, v) -> out for the chosen provider."""
    causal = bool(args.causal)
    if args.provider == "flash_cuda":
        import flash_cuda  # noqa: WPS433 (run-time import on purpose)
        if hasattr(flash_cuda, "is_available") and not flash_cuda.is_available():
            raise SystemExit("flash_cuda.is_available() is False")
        window = tuple(args.window) if args.window else (-1, -1)
        return lambda q, k, v: flash_cuda.attention(q, k, v, is_causal=causal, window_size=window,
                                                    kernel=args.kernel,
                                                    deterministic=args.deterministic)
    if args.provider == "flash_cuda_fp8":
        # The FP8 forward on main()'s inputs rounded to e4m3 (descales 1); V's layout step is
        # inside the range, as in every call.
        from flash_cuda.fp8 import attention_fp8  # noqa: WPS433
        window = tuple(args.window) if args.window else (-1, -1)
        return lambda q, k, v: attention_fp8(q, k, v, is_causal=causal, window_size=window)
    if args.provider == "fa4":
        # FlashAttention-4 takes (B, S, H, D): main() makes its inputs in that layout, so no
        # transpose runs inside the profiled range.
        from flash_attn.cute import flash_attn_func  # noqa: WPS433
        window = tuple(None if w < 0 else w for w in args.window) if args.window else (None, None)

        def fa4(q, k, v):
            out = flash_attn_func(q, k, v, causal=causal, window_size=window, deterministic=args.deterministic)
            return out[0] if isinstance(out, tuple) else out
        return fa4
    if args.window:
        raise SystemExit("--window: flash_cuda and fa4 only (SDPA takes no window)")
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def backend_context(provider: str):
    import contextlib
    if provider in ("flash_cuda", "flash_cuda_fp8", "fa4", "sdpa"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                        "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                        "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "sdpa_math": SDPBackend.MATH}[provider])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.print_ncu_cmd:
        print(ncu_command(args, argv))
        return 0
    if not torch.cuda.is_available():
        print("bench/ncu_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    B, H, S, D = args.B, args.H, args.S, args.d
    if args.mode == "decode":
        import decode  # bench/decode.py: the decode step's inputs
        torch.manual_seed(args.seed)
        step, t = decode.make_step(dtype, D, H, H // args.ratio, B, S, args.sq, args.kv, args.cache)
        if args.provider != "flash_cuda":
            k, v = t.k_cache[:, :, :S + args.sq], t.v_cache[:, :, :S + args.sq]
            step = lambda: F.scaled_dot_product_attention(t.q, k, v, enable_gqa=True)  # noqa: E731
        print(f"config: decode provider={args.provider} dtype={args.dtype} B={B} Hq={H} Hkv={H // args.ratio} "
              f"Sk={S} Sq={args.sq} D={D} kv={args.kv} cache={args.cache} (warmup {args.warmup}, profiled "
              f"{args.iters} inside NVTX range '{RANGE_NAME}')")
        with backend_context(args.provider):
            return profile(step, args, lambda: None)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(args.seed)
    shape = (B, S, H, D) if args.provider == "fa4" else (B, H, S, D)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    if args.provider == "flash_cuda_fp8":
        if args.mode != "fwd":
            raise SystemExit("--provider flash_cuda_fp8: the FP8 forward has no backward (--mode fwd)")
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    need_grad = args.mode != "fwd"
    if need_grad:
        for t in (q, k, v):
            t.requires_grad_()
    fwd = make_forward(args)
    print(f"config: provider={args.provider} kernel={args.kernel} mode={args.mode} "
          f"dtype={args.dtype} B={B} H={H} S={S} D={D} causal={args.causal} window={args.window} "
          f"(warmup {args.warmup}, profiled {args.iters} inside NVTX range '{RANGE_NAME}')")

    def clear_grads():
        for t in (q, k, v):
            t.grad = None

    with backend_context(args.provider):
        out = None
        if args.mode == "fwd":
            def step():
                fwd(q, k, v)
        elif args.mode == "fwd_bwd":
            def step():
                fwd(q, k, v).backward(dout)
        else:
            out = fwd(q, k, v)  # forward once, outside every profiled range

            def step():
                out.backward(dout, retain_graph=True)

        return profile(step, args, clear_grads)


def profile(step, args, before_each) -> int:
    """args.warmup un-profiled calls of step, then args.iters profiled ones, each between
    cudaProfilerStart / Stop inside the NVTX range."""
    for _ in range(args.warmup):
        before_each()
        step()
    torch.cuda.synchronize()

    times = []
    for _ in range(args.iters):
        before_each()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push(RANGE_NAME)
        start.record()
        step()
        end.record()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()  # the backward's kernels come from autograd's thread
        torch.cuda.profiler.stop()
        times.append(start.elapsed_time(end))
    print(f"profiled iterations: median {statistics.median(times):.3f} ms "
          f"(under ncu this includes the profiler's replay overhead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
