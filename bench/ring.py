#!/usr/bin/env python3
"""Context-parallel attention (flash_cuda.distributed.ring_attention) across the GPUs of a torchrun job.

    torchrun --nproc-per-node 4 bench/ring.py                     # 8k and 32k tokens per GPU
    torchrun --nproc-per-node 2 bench/ring.py --tokens 8k --causal 1 --mode fwd_bwd
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:29500 bench/ring.py

For each cell (tokens per GPU x causal x mode), with B = 1, 16 heads, D = 128, bf16 by default:

* ring: the per-GPU time of ring_attention (the slowest rank's, CUDA events around ITERS calls
  after WARMUP, every rank in step: a barrier before each timed loop), calls queued back to back
  (pipelined: one call's host work runs under the previous call's kernels); ring_sync: the same
  with a synchronize after every call, as a step that reads its result at once sees it (the
  host's work per call is then added to the GPU's), and `efficiency_sync` = ideal / ring_sync;
* ideal: flash_cuda.attention on the whole sequence (W x tokens) on rank 0 alone, divided by
  W; `efficiency` = ideal / ring (1.0: the sequence split over W GPUs runs W times faster);
* compute: the same ring steps with the blocks kept in hand instead of exchanged
  (flash_cuda.ring.NoComm: the kernels and merges alone, plus a device-local copy in place of
  each transfer), comm: the ring's transfers alone (W - 1 hops of K and V; the backward also
  W - 1 hops of K, V and W - 1 of dK, dV, in the input dtype on two GPUs where the ring sends them
  so, else float32);
  `hidden` = (compute + comm - ring) / comm, the share of the transfer time that overlaps
  compute (1.0: all of it).

--check gloo nccl, --hop-first 0 1, --speculate 0 1 and --graphs 0 1 measure each way of starting
a call (the input check's transport, the first hop before or after the local block, the first
hop sent before the check returns, the speculative forward replayed from a CUDA graph; `check`,
`hop_first`, `speculate`, `graphs` columns), with every --sm-margin.
--sm-margin 0 16 measures the ring with each number of SMs the forward's persistent kernels
leave free for a transfer beside them (flash_cuda.ring.SM_MARGIN; an `sm_margin` column; compute
is measured per margin). --trace DIR records, per cell and rank, three synchronized calls under
torch.profiler (DIR/trace_*.json, Chrome format) and prints rank 0's timeline summary per call:
the host's time in the call, the GPU's busy span, its idle time inside the span, the NCCL
kernels' time and the part of it under the attention kernels.

NCCL_NVLS_ENABLE=0 is set unless the environment sets it. Rank 0 prints a markdown table; with
--out DIR it also writes DIR/ring_w<W>.csv and .md (bench/common.py's environment stamp).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402 (bench/common.py)
import flash_cuda  # noqa: E402
from flash_cuda import distributed as fcd  # noqa: E402
from flash_cuda import ring as fcr  # noqa: E402
from flash_cuda.validation import ScoreOptions  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def timed(fn, iters: int, warmup: int, everyone: bool = True) -> float:
    """ms per call; with ``everyone`` the slowest rank's (every rank must call it)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if everyone:
        dist.barrier()
    ms = common.loop_ms(fn, iters)
    if everyone:
        t = torch.tensor([ms], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = float(t)
    return ms


def synchronized(step):
    """``step`` followed by a synchronize: no call's host work overlaps the previous call's kernels."""
    def run():
        step()
        torch.cuda.synchronize()
    return run


def make_step(fn, q, k, v, do, mode):
    if mode == "fwd":
        def step():
            with torch.no_grad():
                fn(q, k, v)
        return step

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        out = fn(*leaves)
        torch.autograd.backward(out, do)
        for t in leaves:
            t.grad = None
    return step


def _union(intervals):
    """Sorted, merged [start, end) intervals."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _overlap(xs, ys) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def trace_calls(step, path: str, calls: int = 3) -> list:
    """``calls`` synchronized calls of ``step`` under torch.profiler, the trace written to
    ``path``; per call (us): the host's time in it, the GPU's span (first kernel start to last
    kernel end), the idle time inside that span, NCCL kernel time, and the part of it that
    overlaps the other kernels."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("ring_call"):
                step()
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    events = prof.events()
    # the host's ranges only (the profiler also marks each range on the GPU's timeline)
    calls_ = [(e.time_range.start, e.time_range.end) for e in events
              if e.name == "ring_call" and e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [(e.time_range.start, e.time_range.end, "nccl" in e.name.lower()) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    return summarize_trace(calls_, kernels)


def summarize_trace(calls, kernels) -> list:
    """trace_calls' rows from the calls' host ranges (start, end) and the kernels' (start, end,
    is_nccl), in one clock: a kernel belongs to the call during or after whose host range it
    starts, up to the next call's start."""
    calls = sorted(calls)
    kernels = [k for k in kernels if k[1] > k[0]]
    rows = []
    for n, (c0, c1) in enumerate(calls):
        end = calls[n + 1][0] if n + 1 < len(calls) else float("inf")
        mine = [k for k in kernels if c0 <= k[0] < end]
        if not mine:
            continue
        nccl = _union([(a, b) for a, b, is_nccl in mine if is_nccl])
        other = _union([(a, b) for a, b, is_nccl in mine if not is_nccl])
        busy = _union([(a, b) for a, b, _ in mine])
        span = busy[-1][1] - busy[0][0]
        rows.append(dict(call=n, host_us=c1 - c0, first_kernel_us=busy[0][0] - c0, gpu_span_us=span,
                         gpu_idle_us=span - sum(b - a for a, b in busy), nccl_us=sum(b - a for a, b in nccl),
                         nccl_under_compute_us=_overlap(nccl, other)))
    return rows


def comm_only(cfg, k, v, mode):
    """The ring's transfers alone, in the same order and sizes (double-buffered like the ring)."""
    ring, W = cfg.ring, cfg.world

    def hops(n, with_grads):
        bufs = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(2)]
        kv = (k, v)
        # dK / dV travel in the input dtype or float32, as the ring's backward sends them
        travel = (k.dtype if fcr.dkv_travels_in_input_dtype(cfg.layout, W, k.shape[2], cfg.left, cfg.right)
                  else torch.float32)
        dkv = (torch.zeros(k.shape, dtype=travel, device=k.device), torch.zeros(v.shape, dtype=travel, device=v.device))
        for s in range(n):
            handles = ring.exchange(kv, bufs[s % 2]) if s + 1 < W else []
            if with_grads and s > 0:  # dK / dV hop after every step but the first, the last to the owner
                incoming = (torch.empty_like(dkv[0]), torch.empty_like(dkv[1]))
                handles += ring.exchange(dkv, incoming, tag0=2)
                dkv = incoming
            fcr.Ring.wait(handles)
            kv = bufs[s % 2]

    def step():
        hops(W - 1, False)
        if mode == "fwd_bwd":
            hops(W, True)
    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", nargs="+", default=["8k", "32k"], help="tokens per GPU (8k, 32768, ...)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="GQA: K/V heads (default: --heads)")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[1, 0])
    ap.add_argument("--mode", nargs="+", choices=("fwd", "fwd_bwd"), default=["fwd", "fwd_bwd"])
    ap.add_argument("--layout", choices=fcd.LAYOUTS, default="zigzag")
    ap.add_argument("--method", choices=fcd.METHODS, default="ring")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sm-margin", type=int, nargs="+", default=[fcr.SM_MARGIN],
                    help="SMs the forward's kernels leave free beside a transfer (flash_cuda.ring.SM_MARGIN), "
                         "each measured in turn")
    ap.add_argument("--check", nargs="+", choices=fcd.CHECK_TRANSPORTS, default=[fcd.CHECK_TRANSPORT],
                    help="how the input check travels (flash_cuda.distributed.CHECK_TRANSPORT), each measured in turn")
    ap.add_argument("--hop-first", type=int, nargs="+", choices=(0, 1), default=[int(fcr.HOP_FIRST)],
                    help="the forward's first hop before the local block (flash_cuda.ring.HOP_FIRST), each in turn")
    ap.add_argument("--speculate", type=int, nargs="+", choices=(0, 1), default=[int(fcd.SPECULATE)],
                    help="the first hop sent before the check returns once the group has agreed "
                         "(flash_cuda.distributed.SPECULATE), each in turn")
    ap.add_argument("--graphs", type=int, nargs="+", choices=(0, 1), default=[int(fcr.GRAPHS)],
                    help="speculative forwards replayed from a CUDA graph per shape (flash_cuda.ring.GRAPHS), "
                         "each in turn")
    ap.add_argument("--trace", default=None, help="folder for torch.profiler traces of synchronized calls")
    ap.add_argument("--out", default=None, help="folder for ring_w<W>.csv / .md (rank 0)")
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    W, rank = dist.get_world_size(), dist.get_rank()
    dt = DTYPES[args.dtype]
    hkv = args.kv_heads or args.heads
    rows = []
    defaults = fcd.CHECK_TRANSPORT, fcr.HOP_FIRST, fcd.SPECULATE, fcr.GRAPHS
    for tokens in map(common.parse_size, args.tokens):
        for causal in map(bool, args.causal):
            for mode in args.mode:
                g = torch.Generator(device="cuda").manual_seed(rank)
                q, do = (torch.randn(args.batch, args.heads, tokens, args.d, device="cuda", dtype=dt, generator=g)
                         for _ in range(2))
                k, v = (torch.randn(args.batch, hkv, tokens, args.d, device="cuda", dtype=dt, generator=g)
                        for _ in range(2))
                opts = dict(is_causal=causal, layout=args.layout, method=args.method)
                ring_step = make_step(lambda a, b, c: fcd.ring_attention(a, b, c, **opts), q, k, v, do, mode)
                by_variant = {}
                for check, hop_first, spec, graphs, margin in itertools.product(
                        args.check, args.hop_first, args.speculate, args.graphs, args.sm_margin):
                    fcd.CHECK_TRANSPORT, fcr.HOP_FIRST, fcd.SPECULATE = check, bool(hop_first), bool(spec)
                    fcr.SM_MARGIN, fcr.GRAPHS = margin, bool(graphs)
                    by_variant[check, hop_first, spec, graphs, margin] = (timed(ring_step, args.iters, args.warmup),
                                                            timed(synchronized(ring_step), args.iters, args.warmup))
                    if args.trace:
                        os.makedirs(args.trace, exist_ok=True)
                        name = (f"trace_w{W}_{common.fmt_size(tokens)}_c{int(causal)}_{mode}_{check}"
                                f"_hop{hop_first}_spec{spec}_graphs{graphs}_margin{margin}_rank{rank}.json")
                        trace = trace_calls(ring_step, os.path.join(args.trace, name))
                        if rank == 0:
                            import pandas as pd

                            print(f"trace {name} (us):\n" + common.markdown(pd.DataFrame(trace), floatfmt=".1f"),
                                  flush=True)
                        dist.barrier()
                fcd.CHECK_TRANSPORT, fcr.HOP_FIRST, fcd.SPECULATE, fcr.GRAPHS = defaults
                fcr.drop_graphs()
                method = fcr.pick_method(args.method, args.heads, hkv, tokens, W)
                cfg = fcr.Config(fcr.CudaBlocks(q, ScoreOptions(args.d ** -0.5), False, 0), fcr.Ring(None, W, rank),
                                 method, args.layout, -1, 0 if causal else -1, mode == "fwd_bwd",
                                 mode == "fwd_bwd")
                comm_ms = float("nan")
                compute = {m: float("nan") for m in args.sm_margin}
                if method == "ring" and W > 1:
                    still = cfg._replace(ring=fcr.NoComm(W, rank))
                    for margin in args.sm_margin:
                        fcr.SM_MARGIN = margin
                        compute[margin] = timed(make_step(lambda a, b, c: fcr.RingAttention.apply(a, b, c, still)[0],
                                                          q, k, v, do, mode), args.iters, args.warmup)
                    comm_ms = timed(comm_only(cfg, k.contiguous(), v.contiguous(), mode), args.iters, args.warmup)
                single_ms = float("nan")
                if rank == 0:
                    # the whole sequence on one GPU (every rank's slice shape, W times longer)
                    qf, dof = (torch.randn(args.batch, args.heads, W * tokens, args.d, device="cuda", dtype=dt)
                               for _ in range(2))
                    kf, vf = (torch.randn(args.batch, hkv, W * tokens, args.d, device="cuda", dtype=dt)
                              for _ in range(2))
                    single_ms = timed(make_step(lambda a, b, c: flash_cuda.attention(a, b, c, is_causal=causal),
                                                qf, kf, vf, dof, mode), max(1, args.iters // 2), 1, everyone=False)
                    del qf, kf, vf, dof
                dist.barrier()
                ideal = single_ms / W
                for (check, hop_first, spec, graphs, margin), (ring_ms, ring_sync_ms) in by_variant.items():
                    compute_ms, hidden = compute[margin], float("nan")
                    if not math.isnan(comm_ms):
                        hidden = min(1.0, max(0.0, (compute_ms + comm_ms - ring_ms) / comm_ms))
                    rows.append(dict(tokens_per_gpu=tokens, seq=W * tokens, causal=int(causal), mode=mode,
                                     method=method, check=check, hop_first=hop_first, speculate=spec,
                                     graphs=graphs, sm_margin=margin,
                                     ring_ms=ring_ms,
                                     ring_sync_ms=ring_sync_ms, ideal_ms=ideal, efficiency=ideal / ring_ms,
                                     efficiency_sync=ideal / ring_sync_ms, compute_ms=compute_ms, comm_ms=comm_ms,
                                     hidden=hidden))
                    if rank == 0:
                        r = rows[-1]
                        print(f"W={W} tokens/GPU={tokens} causal={int(causal)} {mode} check={check} "
                              f"hop_first={hop_first} speculate={spec} graphs={graphs} sm_margin={margin}: ring "
                              f"{ring_ms:.2f} ms (synchronized {ring_sync_ms:.2f}), ideal {ideal:.2f} ms (efficiency "
                              f"{r['efficiency']:.2f} / {r['efficiency_sync']:.2f}), compute {compute_ms:.2f} ms, "
                              f"comm {comm_ms:.2f} ms, hidden {hidden:.2f}", flush=True)
                del q, k, v, do
                torch.cuda.empty_cache()
    if rank == 0:
        import pandas as pd

        df = pd.DataFrame(rows)
        env = common.environment(world_size=W, heads=args.heads, kv_heads=hkv, d=args.d, batch=args.batch,
                                 dtype=args.dtype, layout=args.layout,
                                 nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"),
                                 timer=f"CUDA events, {args.iters} calls after {args.warmup}, slowest rank")
        table = common.markdown(df, floatfmt=".3f")
        print("\n" + table)
        if args.out:
            common.write_results(args.out, f"ring_w{W}", df, f"ring_attention on {W} GPUs", env, [table])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
