#!/usr/bin/env python
"""Host time per call: flash_cuda against SDPA on a shape small enough that the GPU work is a
few microseconds, so the loop runs at the pace of the host (Python, the op layers, the
binding, the launches). Many calls are queued and synchronized once; the printed time per
call is what a training or serving step pays per attention call when the GPU is not the
bound (short sequences, many small layers, decoding).

    python bench/host_overhead.py                  # B = H = 1, S = 128, D = 64, bf16, causal
    python bench/host_overhead.py --seqlen 512 --d 128 --calls 2000

Both modes are measured: the forward under torch.no_grad(), and forward + backward:
``--backward sum`` (default; the numbers in OPTIMIZATION.md) runs ``out.sum().backward()``,
so both providers also pay the broadcast gradient's copy and the accumulation into the
leaves' .grad; ``--backward dout`` runs torch.autograd.grad with a contiguous random
upstream gradient (neither of those).
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--causal", type=int, choices=[0, 1], default=1)
    ap.add_argument("--calls", type=int, default=500, help="timed calls per measurement")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--backward", choices=["sum", "dout"], default="sum")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("host_overhead.py: needs a CUDA GPU (nothing measured)", file=sys.stderr)
        return 2
    import flash_cuda

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    shape = (args.batch, args.heads, args.seqlen, args.d)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=dtype)
    causal = bool(args.causal)
    providers = {
        "flash_cuda": lambda: flash_cuda.attention(q, k, v, is_causal=causal),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }

    def timed(step) -> float:
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.calls * 1e6

    print(f"B={args.batch} H={args.heads} S={args.seqlen} D={args.d} {args.dtype} causal={args.causal}, "
          f"{args.calls} calls, one synchronize, backward: {args.backward}")
    print(f"{'provider':12s} {'fwd us/call':>12s} {'fwd+bwd us/call':>16s}")
    for name, fn in providers.items():
        def fwd():
            with torch.no_grad():
                fn()

        def fwd_bwd():
            if args.backward == "sum":
                fn().sum().backward()
            else:
                torch.autograd.grad(fn(), (q, k, v), dout)

        print(f"{name:12s} {timed(fwd):12.1f} {timed(fwd_bwd):16.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
