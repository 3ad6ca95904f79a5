"""Spawned process groups for the distributed tests: each rank writes its results to a JSON file."""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def spawn_ranks(worker, world: int, timeout_s: float, prefix: str = "fc_ranks_"):
    """Runs ``worker(rank, world, store_path, out_dir)`` on ``world`` spawned processes and returns
    the dict each rank wrote to ``out_dir/rank<r>.json``; a group that does not finish within
    ``timeout_s`` is killed and raises TimeoutError (a hang fails instead of blocking)."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    ctx = mp.start_processes(worker, args=(world, os.path.join(tmp, "store"), tmp), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks did not finish within {timeout_s} s (a hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    out = []
    for r in range(world):
        with open(os.path.join(tmp, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def run_cases(results: dict, cases: dict, run_case, world: int, rank: int) -> None:
    """results[name] = run_case(name, case, world, rank) for every case, or this rank's
    traceback where it raised (the other cases still run)."""
    for name, case in cases.items():
        try:
            results[name] = run_case(name, case, world, rank)
        except Exception:  # noqa: BLE001
            results[name] = f"rank {rank}: {traceback.format_exc()}"
