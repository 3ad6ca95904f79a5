#!/usr/bin/env python3
"""Backward time and peak memory of flash_cuda.attention when autograd asks for dQ alone, dK/dV
alone, or all three. One forward per cell (graph retained), then torch.autograd.grad over the
subset's inputs: CUDA events around each backward, WARMUP untimed calls, the median of ITERS.

Usage: python3 bench/grad_subsets.py [--B 4] [--H 16] [--S 4096] [--D 128]
           [--dtype bf16] [--kernel auto] [--deterministic] [--iters 30] [--warmup 5]
"""
import argparse
import statistics

import torch

import flash_cuda

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SUBSETS = {"q": (True, False, False), "kv": (False, True, True), "all": (True, True, True)}


def bench(args, is_causal, name, wanted):
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.B, args.H, args.S, args.D)
    q, k, v, dout = (torch.randn(shape, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    leaves = [t.requires_grad_(w) for t, w in zip((q, k, v), wanted)]
    inputs = [t for t in leaves if t.requires_grad]
    out = flash_cuda.attention(*leaves, is_causal=is_causal, deterministic=args.deterministic,
                               kernel=args.kernel)

    def step():
        return torch.autograd.grad(out, inputs, dout, retain_graph=True)

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        grads = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        del grads
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    ms = statistics.median(times)
    # Backward FLOPs of all three gradients (2.5x the forward's 4 B H S^2 D), halved when causal:
    # the same yardstick for every subset, so the column compares times.
    flops = 2.5 * 4 * args.B * args.H * args.S * args.S * args.D / (2 if is_causal else 1)
    print(f"{'causal' if is_causal else 'full':>6} {name:>4} {ms:9.3f} ms {flops / ms / 1e9:8.1f} "
          f"TFLOPS-equiv {peak:9.1f} MiB peak")
    return ms


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--S", type=int, default=4096)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}  B={args.B} H={args.H} S={args.S} D={args.D} {args.dtype} "
          f"kernel={args.kernel} deterministic={args.deterministic}")
    for is_causal in (False, True):
        times = {name: bench(args, is_causal, name, wanted) for name, wanted in SUBSETS.items()}
        print(f"{'':>6} q / all {times['q'] / times['all']:.3f}   kv / all {times['kv'] / times['all']:.3f}")


if __name__ == "__main__":
    main()
