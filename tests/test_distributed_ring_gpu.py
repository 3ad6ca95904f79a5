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

With attention sinks (the cases whose ``sinks`` is set), d(sinks) is each rank's own part: its
sum over the ranks is checked with the same rule against the whole sequence's gradient, and
-inf sinks give the results of no sinks bit for bit.

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
from flash_cuda import ring as fcr
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


def _case(dtype, D, layout="zigzag", is_causal=True, Hq=8, Hkv=8, method="ring", S_local=256, sinks=None, **opts):
    """sinks: None, or the sinks' dtype ("float32"; "bfloat16" as gpt-oss keeps them)."""
    return dict(dtype=dtype, D=D, B=2, Hq=Hq, Hkv=Hkv, S_local=S_local, sinks=sinks,
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
CASES["bfloat16_d128_zigzag_causal_sinks"] = _case("bfloat16", 128, sinks="float32", return_lse=True)
CASES["float16_d64_contiguous_full_sinks"] = _case("float16", 64, layout="contiguous", is_causal=False,
                                                   sinks="float32")
CASES["bfloat16_d64_gqa_ring_causal_bf16_sinks"] = _case("bfloat16", 64, Hq=8, Hkv=2, sinks="bfloat16",
                                                         return_lse=True)
CASES["float16_d128_gqa_allgather_causal_sinks"] = _case("float16", 128, Hq=8, Hkv=2, method="allgather",
                                                         sinks="float32", return_lse=True)
CASES["bfloat16_d64_window_allgather_sinks"] = _case("bfloat16", 64, Hq=8, Hkv=2, method="allgather",
                                                     window_size=(100, 0), sinks="float32")
# the fp32 (m, log2 l) statistics with the sink merged in, read by the fp32 backward
CASES["float32_d64_zigzag_causal_sinks"] = _case("float32", 64, sinks="float32", return_lse=True)


def _inputs(case, world, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, case["dtype"])
    B, Hq, Hkv, D, S = case["B"], case["Hq"], case["Hkv"], case["D"], case["S_local"] * world
    q, do = (torch.randn(B, Hq, S, D, generator=g, device="cuda", dtype=dt) for _ in range(2))
    k, v = (torch.randn(B, Hkv, S, D, generator=g, device="cuda", dtype=dt) for _ in range(2))
    dlse = torch.randn(B, Hq, S, generator=g, device="cuda")
    return q, k, v, do, dlse


def _sinks(case, seed):
    """(Hq,) sinks in the case's sinks dtype, or None: about the size of the rows' lse (a few
    hundred keys), one head -inf (no sink)."""
    if case["sinks"] is None:
        return None
    g = torch.Generator().manual_seed(seed)
    s = 4.0 + 2.0 * torch.randn(case["Hq"], generator=g, dtype=torch.float64)
    s[case["Hq"] // 2] = float("-inf")
    return s.to(getattr(torch, case["sinks"])).cuda()


def _grads(fn, q, k, v, do, dlse, use_lse, sinks=None):
    """(out, lse, dq, dk, dv[, dsinks]) of fn(q, k, v[, sinks]) -> (out, lse) under loss
    sum(out*do) [+ sum(lse*dlse)]."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().clone().requires_grad_())
    out, lse = fn(*leaves)
    loss = (out.double() * do.double()).sum()
    if use_lse:
        loss = loss + (lse.double() * dlse.double()).sum()
    loss.backward()
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def _run_case(name, case, world, rank):
    opts = dict(case["opts"])
    layout = opts["layout"]
    use_lse = bool(opts.get("return_lse"))
    dt = getattr(torch, case["dtype"])
    q, k, v, do, dlse = _inputs(case, world, seed=len(name) + 17)
    sinks = _sinks(case, seed=len(name) + 29)
    att = {n: opts[n] for n in ("is_causal", "window_size", "softcap") if n in opts}
    # references on the whole sequence: float64 naive, naive in the dtype, flash_cuda on one GPU
    # (the sinks as each takes them: float64, the inputs' dtype, the sinks' own)
    ref = _grads(lambda a, b, c, *s: attention_naive(a.double(), b.double(), c.double(),
                                                     sinks=s[0].double() if s else None, **att),
                 q, k, v, do, dlse, use_lse, sinks)
    naive = _grads(lambda a, b, c, *s: attention_naive(a, b, c, sinks=s[0].to(dt) if s else None, **att),
                   q, k, v, do, dlse, use_lse, sinks)
    single = _grads(lambda a, b, c, *s: flash_cuda.attention(a, b, c, return_lse=True, sinks=s[0] if s else None,
                                                             **att), q, k, v, do, dlse, use_lse, sinks)
    opts["return_lse"] = True
    mine = [fcd.shard(t, 2, layout=layout) for t in (q, k, v, do, dlse)]
    ring_fn = lambda a, b, c, *s: fcd.ring_attention(a, b, c, sinks=s[0] if s else None, **opts)  # noqa: E731
    ring = _grads(ring_fn, *mine, use_lse, sinks)
    names = ("out", "lse", "dq", "dk", "dv") + (() if sinks is None else ("dsinks",))
    problems = []
    for i, nm in enumerate(names):
        if nm == "dsinks":
            # each rank's part; their sum is the whole sequence's gradient
            if ring[i].dtype != sinks.dtype or ring[i].shape != sinks.shape:
                problems.append(f"dsinks: dtype {ring[i].dtype}, shape {tuple(ring[i].shape)}")
                continue
            got = ring[i].float().clone()
            dist.all_reduce(got)
            r, n, s = ref[i], naive[i], single[i]
        else:
            got = ring[i]
            r, n, s = (fcd.shard(t[i], 2, layout=layout) for t in (ref, naive, single))
        # the larger baseline of the two (see the module docstring)
        base = n if (n.double() - r).abs().max() >= (s.double() - r).abs().max() else s
        atol = (LSE_ATOL_BASE if nm == "lse" else ATOL_BASE)[dt]
        _, problem = rule_error(nm, got, r, base, atol)
        if problem:
            problems.append(problem)
    # reproducible: the forward always, the backward with deterministic=True
    opts["deterministic"] = True
    first = _grads(ring_fn, *mine, use_lse, sinks)
    again = _grads(ring_fn, *mine, use_lse, sinks)
    for nm, a, b in zip(names, first, again):
        if not torch.equal(a, b):
            problems.append(f"{nm} differs between two runs with deterministic=True")
    if not torch.equal(first[0], ring[0]):
        problems.append("out differs between deterministic=False and True (the forward has no such choice)")
    if sinks is not None:
        # -inf sinks are no sinks, bit for bit
        with torch.no_grad():
            plain = fcd.ring_attention(*mine[:3], **opts)
            none = fcd.ring_attention(*mine[:3], sinks=torch.full_like(sinks, float("-inf")), **opts)
        if not (torch.equal(plain[0], none[0]) and torch.equal(plain[1], none[1])):
            problems.append("-inf sinks change out or lse")
    return None if not problems else f"rank {rank}: " + "; ".join(problems)


# The cases run again with flash_cuda.ring.SM_MARGIN set, and with each other way of starting a
# call (the input check's transport, the first hop before the local block, the first hop sent
# before the check returns). The cases follow one another on one group, so that most calls
# find an agreed entry of another shape (placeholder hops) and the repeated ones their own.
MARGIN_CASES = ("bfloat16_d128_zigzag_causal", "bfloat16_d128_window_ring_lse", "float16_d64_softcap_lse")
STARTS = {"nccl_check": ("nccl", False, True), "hop_first": ("gloo", True, False),
          "nccl_check_hop_first": ("nccl", True, False), "no_speculation": ("gloo", False, False)}


def _bad_inputs(rank, world, disagree):
    """Every rank raises, none hangs: the last rank's q is 18 rows against k's 16 (its local
    check fails), or (``disagree``) its q, k, v are 32 rows where the others' are 16."""
    x = torch.randn(1, 2, 32 if disagree and rank == world - 1 else 16, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 2, 18, 64, device="cuda", dtype=torch.bfloat16) if not disagree and rank == world - 1 else x
    expected = ("disagree on q shape",) if disagree else ("must hold the same number of local positions",
                                                          "rejected their inputs")
    try:
        fcd.ring_attention(q, x, x)
        return f"rank {rank}: no error"
    except (ValueError, RuntimeError) as exc:
        return None if any(e in str(exc) for e in expected) else f"rank {rank}: unexpected message {exc}"


def _graphed(rank, world):
    """flash_cuda.ring.GRAPHS: speculative forwards replayed from a CUDA graph per shape give the
    eager forward's results bit for bit (new values in the same shape, with and without
    gradients); a rank whose shape changes makes every rank raise, nobody waits, and the graphs
    replay again afterwards."""
    problems = []
    g = torch.Generator(device="cuda").manual_seed(11 + rank)

    def fresh(S=512):
        return [torch.randn(1, 8, S, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]

    def call(q, k, v, grad=False):
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        # deterministic: the backward's dQ order fixed, so that two eager backwards agree bit for bit
        out, lse = fcd.ring_attention(*leaves, is_causal=True, method="ring", return_lse=True, deterministic=True)
        if not grad:
            return out.detach(), lse.detach()
        out.float().square().sum().backward()
        return out.detach(), lse.detach(), *(t.grad for t in leaves)

    def eager(*args, **kw):
        fcr.GRAPHS = False
        try:
            return call(*args, **kw)
        finally:
            fcr.GRAPHS = True

    fcr.GRAPHS = True
    try:
        x = fresh()
        for i in range(4):  # agreement, capture, replays
            if i == 3:
                x = fresh()
            got, want = call(*x), eager(*x)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                problems.append(f"no_grad call {i} differs from the eager forward")
        if not any(key[0] == tuple(x[0].shape) for key in fcr._GRAPHS):
            problems.append("no graph was captured")
        for i in range(3):
            got, want = call(*x, grad=True), eager(*x, grad=True)
            if not all(torch.equal(a, b) for a, b in zip(got, want)):
                problems.append(f"call {i} with gradients differs from the eager one")
        y = fresh(256 if rank == world - 1 else 512)
        try:
            call(*y)
            problems.append("no error for disagreeing shapes")
        except ValueError as exc:
            if "disagree on q shape" not in str(exc):
                problems.append(f"unexpected message {exc}")
        got, want = call(*x), eager(*x)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            problems.append("the call after the disagreement differs from the eager forward")
    finally:
        fcr.GRAPHS = False
        fcr.drop_graphs()
    return None if not problems else f"rank {rank}: " + "; ".join(problems)


def _worker(rank, world, store_path, out_dir):
    results = {}
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{store_path}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        run_cases(results, CASES, _run_case, world, rank)
        fcr.SM_MARGIN = 16  # the forward's steps beside a transfer on fewer SMs: the same results
        try:
            run_cases(results, {f"sm_margin_{n}": CASES[n] for n in MARGIN_CASES}, _run_case, world, rank)
        finally:
            fcr.SM_MARGIN = 0
        results["bad_shapes"] = _bad_inputs(rank, world, disagree=False)
        results["disagreeing_shapes"] = _bad_inputs(rank, world, disagree=True)
        try:
            results["graphs"] = _graphed(rank, world)
        except Exception:  # noqa: BLE001
            results["graphs"] = f"rank {rank}: {traceback.format_exc()}"
        defaults = fcd.CHECK_TRANSPORT, fcr.HOP_FIRST, fcd.SPECULATE
        for start, (check, hop_first, speculate) in STARTS.items():
            fcd.CHECK_TRANSPORT, fcr.HOP_FIRST, fcd.SPECULATE = check, hop_first, speculate
            try:
                run_cases(results, {f"{start}_{n}": CASES[n] for n in MARGIN_CASES}, _run_case, world, rank)
                results[f"{start}_bad_shapes"] = _bad_inputs(rank, world, disagree=False)
                results[f"{start}_disagreeing_shapes"] = _bad_inputs(rank, world, disagree=True)
            finally:
                fcd.CHECK_TRANSPORT, fcr.HOP_FIRST, fcd.SPECULATE = defaults
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


@pytest.mark.parametrize("name", list(CASES) + [f"sm_margin_{n}" for n in MARGIN_CASES]
                         + ["bad_shapes", "disagreeing_shapes", "graphs"]
                         + [f"{start}_{n}" for start in STARTS
                            for n in MARGIN_CASES + ("bad_shapes", "disagreeing_shapes")])
def test_ring_attention_gpu(results, name):
    problems = [r[name] for r in results if r.get(name)]
    missing = [i for i, r in enumerate(results) if name not in r]
    assert not missing, f"ranks {missing} did not run {name}"
    assert not problems, "\n".join(problems)
