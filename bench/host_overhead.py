#!/usr/bin/env python
"""Host time per call: flash_cuda against SDPA on a shape small enough that the GPU work is a
few microseconds, so the loop runs at the pace of the host (Python, the op layers, the
binding, the launches). Many calls are queued and synchronized once; the printed time per
call is what a training or serving step pays per attention call when the GPU is not the
bound (short sequences, many small layers, decoding).

    python bench/host_overhead.py                  # B = H = 1, S = 128, D = 64, bf16, causal
    python bench/host_overhead.py --seqlen 512 --d 128 --calls 2000
    python bench/host_overhead.py --decode          # one new token against a KV cache
    python bench/host_overhead.py --parts           # where a no_grad forward's host time goes

Each printed time is the median of ``--rounds`` rounds (3) that take every provider and mode in turn.

``--ablation NAME=VALUE`` (a build with the rungs: FLASH_CUDA_ABLATIONS=1) adds flash_cuda with that
switch set as another provider, timed in the same process right after the default, e.g.
``--ablation FLASH_CUDA_WS_PERSISTENT=0``.

``--decode`` times a decode step instead (forward only, no autograd): q (B, 32, 1, D) against a
cache of ``--seqlen`` tokens with 8 KV heads, through attention_with_kvcache (with and without
appending the new key), attention() on the cache's filled rows, and SDPA (enable_gqa) on the
same rows.

``--parts`` splits a ``torch.no_grad()`` forward (the shape above, and the decode shape's attention())
into what it is made of: the whole call; the extension's entry alone (``fwd_direct`` with the signature's
checked plan: the outputs' allocation, the binding and the launch); flash_cuda's Python layer alone (the
same call with the extension's entry replaced by one returning ready outputs); and, as the host's own
floor, two outputs allocated through torch (``empty_like``, ``empty``) and a one-kernel torch op
(``x.zero_()``). Each is timed both as queued (the loop's time before the synchronize) and synchronized.

Three modes are measured: the forward under torch.no_grad(), the forward with autograd recording
its graph (inputs that require gradients; no backward: the graph is dropped), and forward + backward:
``--backward sum`` (default; the numbers in OPTIMIZATION.md) runs ``out.sum().backward()``,
so both providers also pay the broadcast gradient's copy and the accumulation into the
leaves' .grad; ``--backward dout`` runs torch.autograd.grad with a contiguous random
upstream gradient (neither of those).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402 (bench/common.py: sizes, the host-time loop)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--seqlen", type=C.parse_size, default=128)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--causal", type=int, choices=[0, 1], default=1)
    ap.add_argument("--calls", type=int, default=500, help="timed calls per measurement")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds over every provider and mode, interleaved; the median is printed (the first "
                         "cell of a process otherwise pays the host's own warm-up)")
    ap.add_argument("--backward", choices=["sum", "dout"], default="sum")
    ap.add_argument("--decode", action="store_true", help="time a decode step against a KV cache")
    ap.add_argument("--parts", action="store_true",
                    help="split a no_grad forward's host time into the Python layer, the extension's entry and "
                         "torch's own allocation and launch costs")
    ap.add_argument("--trace", action="store_true",
                    help="also list where each provider's host time goes: the CPU-side ops and CUDA runtime "
                         "calls of --calls calls (torch.profiler), per call")
    ap.add_argument("--ablation", default=None, metavar="NAME=VALUE",
                    help="also time flash_cuda with this ablation switch set (an ablation build's rungs)")
    args = ap.parse_args(argv)
    if args.ablation is not None and (args.ablation.count("=") != 1 or not args.ablation.startswith("FLASH_CUDA_")):
        ap.error("--ablation takes NAME=VALUE with a FLASH_CUDA_ switch")

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("host_overhead.py: needs a CUDA GPU (nothing measured)", file=sys.stderr)
        return 2
    import flash_cuda

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.decode:
        return decode(args, torch, F, flash_cuda, dtype)
    if args.parts:
        return parts(args, torch, F, flash_cuda, dtype)
    shape = (args.batch, args.heads, args.seqlen, args.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dtype)
    causal = bool(args.causal)
    providers = {
        "flash_cuda": lambda: flash_cuda.attention(q, k, v, is_causal=causal),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }
    providers = with_ablation(args, providers, flash_cuda)

    print(f"B={args.batch} H={args.heads} S={args.seqlen} D={args.d} {args.dtype} causal={args.causal}, "
          f"{args.calls} calls, one synchronize, backward: {args.backward}")
    print(f"{'provider':12s} {'fwd us/call':>12s} {'fwd autograd':>13s} {'fwd+bwd us/call':>16s}")
    def steps(fn):
        def fwd():
            with torch.no_grad():
                fn()

        def fwd_bwd():
            if args.backward == "sum":
                fn().sum().backward()
            else:
                torch.autograd.grad(fn(), (q, k, v), dout)
        return fwd, fwd_bwd

    cells = {}
    for name, fn in providers.items():
        fwd, fwd_bwd = steps(fn)
        cells.update({(name, 0): fwd, (name, 1): fn, (name, 2): fwd_bwd})
    us = interleaved(cells, args)
    for name in providers:
        print(f"{name:12s} {us[name, 0]:12.1f} {us[name, 1]:13.1f} {us[name, 2]:16.1f}")
    if args.trace:
        for name, fn in providers.items():
            fwd, fwd_bwd = steps(fn)
            trace(torch, f"{name}, forward under no_grad", fwd, args)
            trace(torch, f"{name}, forward + backward ({args.backward})", fwd_bwd, args)
    return 0


def interleaved(cells: dict, args) -> dict:
    """Host us per call of each cell: the median of --rounds rounds, each timing every cell once in turn."""
    import statistics

    times = {key: [] for key in cells}
    for _ in range(max(1, args.rounds)):
        for key, step in cells.items():
            times[key].append(C.host_us_per_call(step, args.calls, args.warmup))
    return {key: statistics.median(t) for key, t in times.items()}


def with_ablation(args, providers, flash_cuda):
    """With --ablation: a copy of the first provider (flash_cuda's) whose calls run with the switch
    set, placed right after it (the extension reads a rung's switch at each call)."""
    if args.ablation is None:
        return providers
    if not flash_cuda._ext.ablations():
        raise SystemExit("host_overhead.py: --ablation needs a build with the ablation rungs (FLASH_CUDA_ABLATIONS=1)")
    import os

    name, value = args.ablation.split("=")
    first, fn = next(iter(providers.items()))

    def switched():
        os.environ[name] = value
        try:
            return fn()
        finally:
            del os.environ[name]

    out = {}
    for key, f in providers.items():
        out[key] = f
        if key == first:
            out[f"{first} {args.ablation}"] = switched
    return out


def trace(torch, title, step, args, rows: int = 14) -> None:
    """The CPU-side events of ``args.calls`` calls of ``step``: each op's and CUDA runtime call's own
    host time per call (self time; a child's time is not counted in its parent's)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0 and e.key != "cudaDeviceSynchronize"]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / args.calls
    print(f"\n{title}: {total:.1f} us of profiled host time per call (the profiler adds its own)")
    print(f"  {'event':52s} {'calls/call':>10s} {'self us/call':>13s}")
    for e in events[:rows]:
        print(f"  {e.key[:52]:52s} {e.count / args.calls:10.2f} {e.self_cpu_time_total / args.calls:13.2f}")


def parts(args, torch, F, flash_cuda, dtype) -> int:
    """--parts: a no_grad forward's host time, part by part (module docstring)."""
    from flash_cuda import _ext, signature
    ext = _ext.require()
    shape = (args.batch, args.heads, args.seqlen, args.d)
    q1, k1, v1 = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    q2 = torch.randn(args.batch, 32, 1, args.d, device="cuda", dtype=dtype)
    k2, v2 = (torch.randn(args.batch, 8, args.seqlen, args.d, device="cuda", dtype=dtype) for _ in range(2))
    cases = [(f"B={args.batch} H={args.heads} S={args.seqlen} D={args.d} causal={args.causal}", q1, k1, v1,
              bool(args.causal)),
             (f"decode shape: q (B, 32, 1, D), {args.seqlen} keys, 8 KV heads", q2, k2, v2, False)]
    print(f"{args.dtype}, {args.calls} calls; us per call, queued / synchronized")
    print("| call | part | queued | synchronized |\n|---|---|---:|---:|")
    with torch.no_grad():
        for title, q, k, v, causal in cases:
            call = lambda: flash_cuda.attention(q, k, v, is_causal=causal)  # noqa: E731
            call()
            # The checked plan that attention()'s fast path finds for this signature (the same lookup).
            plan = signature.plan_attention(q, k, v, causal, None, (-1, -1), 0.0, None, False, False, "auto", 0.0,
                                            None)
            if plan is None or plan.direct is None:
                raise SystemExit("host_overhead.py --parts: this call has no direct plan (the fast path does not "
                                 "take it)")
            direct = plan.direct
            ready = ext.fwd_direct(q, k, v, direct)

            class Ready:  # the extension, except that fwd_direct returns outputs made before
                def __getattr__(self, name):
                    return getattr(ext, name)

                def fwd_direct(self, *unused):
                    return ready

            x = torch.empty(16, device="cuda")
            rows = {
                "the whole call": call,
                "the extension's entry alone": lambda: ext.fwd_direct(q, k, v, direct),
                "torch: empty_like + empty": lambda: (torch.empty_like(q),
                                                      torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)),
                "torch: one kernel (x.zero_())": lambda: x.zero_(),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True),
            }
            for name, step in rows.items():
                queued, synced = C.host_us_queued_and_synced(step, args.calls, args.warmup)
                print(f"| {title} | {name} | {queued:.2f} | {synced:.2f} |")
            real = _ext.require
            _ext.require = lambda: Ready()
            try:
                queued, synced = C.host_us_queued_and_synced(call, args.calls, args.warmup)
            finally:
                _ext.require = real
            print(f"| {title} | the Python layer alone (the entry returns ready outputs) | {queued:.2f} | {synced:.2f} |")
    return 0


def decode(args, torch, F, flash_cuda, dtype) -> int:
    B, Hq, Hkv, L, D = args.batch, 32, 8, args.seqlen, args.d
    k_cache = torch.randn(B, Hkv, L + 1, D, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dtype)
    k_new = torch.randn(B, Hkv, 1, D, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    k, v = k_cache[:, :, :L], v_cache[:, :, :L]
    providers = {
        "flash_cuda.attention_with_kvcache (+append)": lambda: flash_cuda.attention_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens),
        "flash_cuda.attention_with_kvcache": lambda: flash_cuda.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens),
        "flash_cuda.attention": lambda: flash_cuda.attention(q, k, v),
        "sdpa (enable_gqa)": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    }
    providers = with_ablation(args, providers, flash_cuda)
    print(f"decode: B={B} Hq={Hq} Hkv={Hkv} cache={L} D={D} {args.dtype}, {args.calls} calls, one synchronize")
    print(f"{'provider':46s} {'us/call':>8s}")
    with torch.no_grad():
        us = interleaved(providers, args)
        for name in providers:
            print(f"{name:46s} {us[name]:8.1f}")
        if args.trace:
            for name, fn in providers.items():
                trace(torch, name, fn, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
