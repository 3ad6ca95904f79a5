"""flash_cuda.distributed on GPUs: NCCL process groups of 2 to 4 ranks (one GPU each), flash_cuda's
kernels per block.

Every rank builds the same full-sequence inputs, cuts its slice with shard(), runs ring_attention
forward and backward (sum(out * dout) [+ sum(lse * dlse)]) and checks its slices of out, lse, dq,
dk, dv with the accuracy rule of tests/attn_check.py against attention_naive in float64 on the
whole sequence. The baseline error is the larger of flash_cuda.attention's own error on the whole
sequence (one GPU) and naive attention's in the inputs' dtype: the ring rounds each block's output
and gradients to the inputs' dtype before it merges them in float32, which single-GPU flash_cuda
does not. Also: two runs are bitwise equal (the ring order and the merges are fixed; the backward
with deterministic=True).

Runs with NCCL_NVLS_ENABLE=0 (no NVLink multicast). FLASH_CUDA_RING_WORLD picks the number of
ranks (default: min(4, number of GPUs)).
"""

from __future__ import annotations

import json
import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import flash_cuda
from flash_cuda import distributed as fcd
from flash_cuda.reference import attention_naive

from spawn_ranks import run_cases, spawn_ranks
from attn_check import ATOL_BASE, LSE_ATOL_BASE, gpu_skip_reason, rule_error

pytestmark = pytest.mark.gpu

TIMEOUT_S = 600


def _world() -> int:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return int(os.environ.get("FLASH_CUDA_RING_WORLD", min(4, n)))


def _skip_reason():
    reason = gpu_skip_reason()
    if reason is None and _world() < 2:
        reason = f"needs at least 2 CUDA GPUs, found {torch.cuda.device_count()}"
    if reason is None and not dist.is_nccl_available():
        reason = "torch.distributed has no NCCL backend"
    return reason


def _case(dtype, D, layout="zigzag", is_causal=True, Hq=8, Hkv=8, method="ring", S_local=256, **opts):
    return dict(dtype=dtype, D=D, B=2, Hq=Hq, Hkv=Hkv, S_local=S_local,
                opts=dict(layout=layout, is_causal=is_causal, method=method, **opts))


CASES = {}
for _dt in ("float16", "bfloat16"):
    for _D in (64, 128):
        for _name, _kw in (("zigzag_causal", {}), ("contiguous_causal", dict(layout="contiguous")),
                           ("zigzag_full", dict(is_causal=False)),
                           ("gqa_ring_causal", dict(Hq=8, Hkv=2)),
                           ("gqa_allgather_causal", dict(Hq=8, Hkv=2, method="allgather")),
                           ("gqa_allgather_contiguous_full", dict(Hq=8, Hkv=2, method="allgather",
                                                                  layout="contiguous", is_causal=False))):
            CASES[f"{_dt}_d{_D}_{_name}"] = _case(_dt, _D, **_kw)
CASES["bfloat16_d128_window_ring_lse"] = _case("bfloat16", 128, window_size=(100, 0), return_lse=True)
CASES["bfloat16_d64_window_allgather"] = _case("bfloat16", 64, Hq=8, Hkv=2, method="allgather",
                                               window_size=(100, 0), return_lse=True)
CASES["float16_d64_softcap_lse"] = _case("float16", 64, softcap=20.0, return_lse=True)
CASES["float32_d64_zigzag_causal"] = _case("float32", 64, return_lse=True)  # the fp32 statistics merge


def _inputs(case, world, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, case["dtype"])
    B, Hq, Hkv, D, S = case["B"], case["Hq"], case["Hkv"], case["D"], case["S_local"] * world
    q, do = (torch.randn(B, Hq, S, D, generator=g, device="cuda", dtype=dt) for _ in range(2))
    k, v = (torch.randn(B, Hkv, S, D, generator=g, device="cuda", dtype=dt) for _ in range(2))
    dlse = torch.randn(B, Hq, S, generator=g, device="cuda")
    return q, k, v, do, dlse


def _grads(fn, q, k, v, do, dlse, use_lse):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse) under loss sum(out*do) [+ sum(lse*dlse)]."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    loss = (out.double() * do.double()).sum()
    if use_lse:
        loss = loss + (lse.double() * dlse.double()).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _run_case(name, case, world, rank):
    opts = dict(case["opts"])
    layout = opts["layout"]
    use_lse = bool(opts.get("return_lse"))
    dt = getattr(torch, case["dtype"])
    q, k, v, do, dlse = _inputs(case, world, seed=len(name) + 17)
    att = {n: opts[n] for n in ("is_causal", "window_size", "softcap") if n in opts}
    # references on the whole sequence: float64 naive, naive in the dtype, flash_cuda on one GPU
    ref = _grads(lambda a, b, c: attention_naive(a.double(), b.double(), c.double(), **att), q, k, v, do, dlse,
                 use_lse)
    naive = _grads(lambda a, b, c: attention_naive(a, b, c, **att), q, k, v, do, dlse, use_lse)
    single = _grads(lambda a, b, c: flash_cuda.attention(a, b, c, return_lse=True, **att), q, k, v, do, dlse,
                    use_lse)
    opts["return_lse"] = True
    mine = [fcd.shard(t, 2, layout=layout) for t in (q, k, v, do, dlse)]
    ring = _grads(lambda a, b, c: fcd.ring_attention(a, b, c, **opts), *mine, use_lse)
    problems = []
    for i, nm in enumerate(("out", "lse", "dq", "dk", "dv")):
        r, n, s = (fcd.shard(t[i], 2, layout=layout) for t in (ref, naive, single))
        # the larger baseline of the two (see the module docstring)
        base = n if (n.double() - r).abs().max() >= (s.double() - r).abs().max() else s
        atol = (LSE_ATOL_BASE if nm == "lse" else ATOL_BASE)[dt]
        _, problem = rule_error(nm, ring[i], r, base, atol)
        if problem:
            problems.append(problem)
    # reproducible: the forward always, the backward with deterministic=True
    opts["deterministic"] = True
    first = _grads(lambda a, b, c: fcd.ring_attention(a, b, c, **opts), *mine, use_lse)
    again = _grads(lambda a, b, c: fcd.ring_attention(a, b, c, **opts), *mine, use_lse)
    for nm, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, again):
        if not torch.equal(a, b):
            problems.append(f"{nm} differs between two runs with deterministic=True")
    if not torch.equal(first[0], ring[0]):
        problems.append("out differs between deterministic=False and True (the forward has no such choice)")
    return None if not problems else f"rank {rank}: " + "; ".join(problems)


def _worker(rank, world, store_path, out_dir):
    results = {}
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        run_cases(results, CASES, _run_case, world, rank)
        # a rank with bad inputs: every rank raises instead of hanging
        x = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, 2, 18 if rank == world - 1 else 16, 64, device="cuda", dtype=torch.bfloat16)
        try:
            fcd.ring_attention(q, x, x)
            results["bad_shapes"] = f"rank {rank}: no error"
        except ValueError as exc:
            results["bad_shapes"] = None if "must hold the same number of local positions" in str(exc) or \
                "rejected their inputs" in str(exc) else f"rank {rank}: unexpected message {exc}"
        except RuntimeError as exc:
            results["bad_shapes"] = None if "rejected their inputs" in str(exc) else f"rank {rank}: {exc}"
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        results["setup"] = f"rank {rank}: {traceback.format_exc()}"
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def results():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    world = _world()
    out = spawn_ranks(_worker, world, TIMEOUT_S, prefix="fc_ring_gpu_")
    setup = [r["setup"] for r in out if r.get("setup")]
    assert not setup, "\n".join(setup)
    return out


@pytest.mark.parametrize("name", list(CASES) + ["bad_shapes"])
def test_ring_attention_gpu(results, name):
    problems = [r[name] for r in results if r.get(name)]
    missing = [i for i, r in enumerate(results) if name not in r]
    assert not missing, f"ranks {missing} did not run {name}"
    assert not problems, "\n".join(problems)
