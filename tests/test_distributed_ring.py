"""flash_cuda.distributed on CPU: gloo process groups of 1 to 4 ranks, flash_cuda.reference as
the block kernel, float64.

Every rank builds the same full-sequence inputs from a seed, cuts its slice with shard(), runs
ring_attention (forward, and backward of sum(out * dout) [+ sum(lse * dlse)]), and compares its
slice of out / lse / dq / dk / dv with attention_naive on the whole sequence (float64 autograd),
cut the same way. With attention sinks, d(sinks) is each rank's own part: it is compared with
the reference's gradient of the loss over this rank's rows alone, and its sum over the ranks
with the whole sequence's. One set of worker processes per world size runs every case (a spawn
costs seconds); each test then reads its case's result. The block plans (which kernel calls cover a
(query chunk, key chunk) pair) are also checked cell by cell against the global mask, without
processes.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from flash_cuda import distributed as fcd
from flash_cuda import ring as fcr
from flash_cuda.cpu_backend import ReferenceBlocks
from flash_cuda.reference import attention_naive, combine_splits
from flash_cuda.ring import NoComm
from flash_cuda.validation import ScoreOptions
from spawn_ranks import run_cases, spawn_ranks

WORLD_SIZES = (1, 2, 3, 4)
TIMEOUT_S = 240  # the workers of one world size, all cases; a hang fails instead of blocking CI
TOL = 1e-10  # float64 blocks and merges against float64 naive attention: rounding only


# ---------------------------------------------------------------------------------------
# The cases: name -> options. Shapes are small (S_local 16..32, D 16 / 32).
# ---------------------------------------------------------------------------------------

def _case(B=2, Hq=2, Hkv=2, S_local=16, D=16, dtype="float64", grads="qkv", lse_loss=False, sinks=None, **opts):
    """grads: which of q, k (k and v), s (the sinks) require a gradient. sinks: None, "mixed"
    (about the rows' lse, one head -inf) or "large" (far above every logit)."""
    return dict(B=B, Hq=Hq, Hkv=Hkv, S_local=S_local, D=D, dtype=dtype, grads=grads, lse_loss=lse_loss, sinks=sinks,
                opts=opts)


CASES = {
    "zigzag_causal": _case(is_causal=True, layout="zigzag", method="ring"),
    "contiguous_causal": _case(is_causal=True, layout="contiguous", method="ring"),
    "zigzag_full": _case(layout="zigzag", method="ring"),
    "contiguous_full": _case(layout="contiguous", method="ring", S_local=24, D=32),
    "gqa_ring_causal": _case(Hq=4, Hkv=2, is_causal=True, method="ring"),
    "gqa_allgather_causal": _case(Hq=4, Hkv=2, is_causal=True, method="allgather"),
    "gqa_allgather_contiguous_full": _case(Hq=4, Hkv=2, layout="contiguous", method="allgather"),
    "mqa_uneven_heads": _case(Hq=3, Hkv=1, is_causal=True, method="ring", D=32),
    "auto_method": _case(Hq=4, Hkv=1, is_causal=True, method="auto"),
    "return_lse_with_lse_loss": _case(is_causal=True, return_lse=True, lse_loss=True, method="ring"),
    "return_lse_allgather": _case(Hq=4, Hkv=2, return_lse=True, lse_loss=True, method="allgather"),
    "window_causal_ring": _case(is_causal=True, window_size=(5, 0), method="ring", S_local=32),
    "window_causal_allgather": _case(is_causal=True, window_size=(5, 0), method="allgather", S_local=32),
    "window_two_sided_ring": _case(window_size=(3, 7), method="ring", layout="contiguous"),
    "window_two_sided_allgather": _case(window_size=(11, 2), method="allgather"),
    "softcap_scale": _case(is_causal=True, softcap=3.0, scale=0.5, method="ring"),
    "dq_only": _case(is_causal=True, grads="q", method="ring"),
    "dkdv_only_allgather": _case(Hq=4, Hkv=2, grads="kv", method="allgather"),
    "no_grad": _case(is_causal=True, grads="", method="ring"),
    "float32": _case(dtype="float32", is_causal=True, method="ring"),
    # attention sinks: merged once per row after the blocks; d(sinks) per rank
    "sinks_zigzag_causal": _case(Hq=4, is_causal=True, method="ring", sinks="mixed", grads="qkvs"),
    "sinks_contiguous_causal_lse": _case(Hq=4, is_causal=True, layout="contiguous", method="ring", sinks="mixed",
                                         grads="qkvs", return_lse=True, lse_loss=True),
    "sinks_zigzag_full": _case(Hq=4, method="ring", sinks="mixed", grads="qkvs"),
    "sinks_contiguous_full_lse": _case(Hq=4, layout="contiguous", method="ring", sinks="mixed", grads="qkvs",
                                       return_lse=True, lse_loss=True),
    "sinks_gqa_ring_causal": _case(Hq=4, Hkv=2, is_causal=True, method="ring", sinks="mixed", grads="qkvs"),
    "sinks_gqa_allgather_causal_lse": _case(Hq=4, Hkv=2, is_causal=True, method="allgather", sinks="mixed",
                                            grads="qkvs", return_lse=True, lse_loss=True),
    "sinks_gqa_allgather_full": _case(Hq=4, Hkv=2, method="allgather", sinks="mixed", grads="qkvs"),
    "sinks_large_window": _case(Hq=2, is_causal=True, window_size=(5, 0), method="ring", S_local=32, sinks="large",
                                grads="qkvs", return_lse=True, lse_loss=True),
    "sinks_grad_only": _case(Hq=4, Hkv=2, is_causal=True, method="ring", sinks="mixed", grads="s",
                             return_lse=True, lse_loss=True),
    "sinks_without_their_grad": _case(Hq=4, is_causal=True, method="ring", sinks="mixed", grads="qkv"),
    "sinks_float32": _case(Hq=4, Hkv=2, dtype="float32", is_causal=True, method="ring", sinks="mixed", grads="qkvs"),
}


def _full_inputs(case, world: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, case["dtype"])
    S = case["S_local"] * world
    B, Hq, Hkv, D = case["B"], case["Hq"], case["Hkv"], case["D"]
    q, do = (torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64).to(dt) for _ in range(2))
    k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64).to(dt) for _ in range(2))
    dlse = torch.randn(B, Hq, S, generator=g, dtype=torch.float64)
    return q, k, v, do, dlse


def _sinks(case, seed: int):
    """(Hq,) sinks in the inputs' dtype, or None: "mixed" about the size of the rows' lse (a
    few dozen keys) with head Hq // 2 at -inf (no sink); "large" ~10 above it."""
    if case["sinks"] is None:
        return None
    g = torch.Generator().manual_seed(seed)
    base = {"mixed": 3.0, "large": 14.0}[case["sinks"]]
    s = base + torch.randn(case["Hq"], generator=g, dtype=torch.float64)
    if case["sinks"] == "mixed":
        s[case["Hq"] // 2] = -math.inf
    return s.to(getattr(torch, case["dtype"]))


def _reference(case, q, k, v, do, dlse, sinks=None):
    """attention_naive in float64 on the whole sequence: (out, lse, dq, dk, dv, dsinks), dsinks
    None without sinks."""
    opts = {n: case["opts"][n] for n in ("is_causal", "scale", "window_size", "softcap") if n in case["opts"]}
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    leaves = (q, k, v)
    if sinks is not None:
        sinks = sinks.detach().double().requires_grad_()
        leaves = leaves + (sinks,)
    out, lse = attention_naive(q, k, v, sinks=sinks, **opts)
    loss = (out * do.double()).sum()
    if case["lse_loss"]:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()
    grads = torch.autograd.grad(loss, leaves)
    return (out.detach(), lse.detach(), *grads[:3], grads[3] if sinks is not None else None)


def _rows_of_rank(x, layout):
    """x (B, H, S[, D]) with every position this rank does not hold set to 0."""
    S = x.shape[2]
    held = torch.zeros(S, dtype=torch.bool)
    held[fcd.shard(torch.arange(S), 0, layout=layout)] = True
    return torch.where(held.view(1, 1, S, *([1] * (x.dim() - 3))), x, torch.zeros_like(x))


def _max_err(x, ref):
    return float((x.double() - ref.double()).abs().max()) if x.numel() else 0.0


def _run_case(name, case, world, rank):
    layout = case["opts"].get("layout", "zigzag")
    q, k, v, do, dlse = _full_inputs(case, world, seed=1000 + len(name))
    sinks = _sinks(case, seed=2000 + len(name))
    ref = _reference(case, q, k, v, do, dlse, sinks)
    mine = [fcd.shard(t, 2, layout=layout) for t in (q, k, v, do, dlse)]
    ql, kl, vl, dol, dlsel = (t.clone() for t in mine)
    sl = None if sinks is None else sinks.clone()
    for t, flag in ((ql, "q"), (kl, "k"), (vl, "k"), (sl, "s")):
        if t is not None and flag in case["grads"]:
            t.requires_grad_()
    opts = dict(case["opts"])
    if sl is not None:
        opts["sinks"] = sl
    res = fcd.ring_attention(ql, kl, vl, **opts)
    out, lse = res if opts.get("return_lse") else (res, None)
    tol = TOL if case["dtype"] == "float64" else 2e-5
    errors = {}
    errors["out"] = _max_err(out, fcd.shard(ref[0], 2, layout=layout))
    if lse is not None:
        ref_lse = fcd.shard(ref[1], 2, layout=layout)
        errors["lse"] = _max_err(lse, ref_lse)
    if case["grads"]:
        loss = (out * dol).sum()
        if case["lse_loss"]:
            loss = loss + (lse * dlsel).sum()
        loss.backward()
        for nm, t, r in (("dq", ql, ref[2]), ("dk", kl, ref[3]), ("dv", vl, ref[4])):
            if t.requires_grad:
                errors[nm] = _max_err(t.grad, fcd.shard(r, 2, layout=layout))
            elif t.grad is not None:
                errors[nm + " (not asked)"] = math.inf
        if sl is not None and sl.requires_grad:
            errors.update(_dsinks_errors(case, q, k, v, do, dlse, sinks, sl.grad, ref[5], layout))
        elif sl is not None and sl.grad is not None:
            errors["dsinks (not asked)"] = math.inf
    # the whole sequence back: unshard inverts shard
    full_out = fcd.unshard(out.detach(), 2, layout=layout)
    errors["unshard(out)"] = _max_err(full_out, ref[0])
    bad = {n: e for n, e in errors.items() if not e <= tol * max(1.0, float(ref[0].abs().max()))}
    return None if not bad else f"rank {rank}: errors above {tol}: {bad}"


def _dsinks_errors(case, q, k, v, do, dlse, sinks, got, ref_full, layout):
    """d(sinks) of this rank: its own rows' part (the reference's gradient of the loss over the
    rows this rank holds), and summed over the ranks, the whole sequence's gradient; -inf
    sinks get exactly 0."""
    if got is None or got.dtype != sinks.dtype or got.shape != sinks.shape:
        return {"dsinks (missing or wrong dtype / shape)": math.inf}
    part = _reference(case, q, k, v, _rows_of_rank(do, layout), _rows_of_rank(dlse, layout), sinks)[5]
    total = got.detach().clone()
    dist.all_reduce(total)
    none = torch.isinf(sinks)
    return {"dsinks (this rank's rows)": _max_err(got, part), "dsinks (sum over ranks)": _max_err(total, ref_full),
            "dsinks of -inf sinks": math.inf if bool((got[none] != 0).any()) else 0.0}


def _ring_vs_allgather(world, rank):
    """The two methods agree with each other to rounding (GQA, causal, zigzag)."""
    case = _case(Hq=4, Hkv=2, is_causal=True)
    q, k, v, do, _ = _full_inputs(case, world, seed=7)
    outs = []
    for method in ("ring", "allgather"):
        ql, kl, vl = (fcd.shard(t, 2).clone().requires_grad_() for t in (q, k, v))
        out = fcd.ring_attention(ql, kl, vl, is_causal=True, method=method)
        (out * fcd.shard(do, 2)).sum().backward()
        outs.append((out.detach(), ql.grad, kl.grad, vl.grad))
    err = max(_max_err(a, b) for a, b in zip(*outs))
    return None if err <= TOL else f"rank {rank}: ring vs allgather differ by {err}"


def _round_trip(world, rank):
    x = torch.arange(2 * 3 * (4 * world) * 5, dtype=torch.float64).view(2, 3, 4 * world, 5)
    for layout, dim in itertools.product(fcd.LAYOUTS, (2, 1, -2)):
        y = x.movedim(2, dim) if dim != -2 else x
        local = fcd.shard(y, dim, layout=layout)
        if local.shape[dim] != y.shape[dim] // world:
            return f"shard({layout}, dim {dim}) has length {local.shape[dim]}"
        if not torch.equal(fcd.unshard(local, dim, layout=layout), y):
            return f"rank {rank}: unshard(shard(x)) != x for layout {layout}, dim {dim}"
    return None


def _bad_shapes(world, rank):
    """One rank's inputs are wrong: every rank must raise, with a message naming the problem.
    Returns a dict kind -> (exception type, message) per rank; checked by the test."""
    seen = {}
    ok = lambda: [torch.randn(1, 2, 8, 16, dtype=torch.float64) for _ in range(3)]  # noqa: E731
    bad_rank = world - 1
    # 1. a local length that differs from the other ranks'
    q, k, v = ok()
    if rank == bad_rank and world > 1:
        q, k, v = (torch.randn(1, 2, 12, 16, dtype=torch.float64) for _ in range(3))
    # 2. a tensor that fails the checks of flash_cuda.attention (head dim not a multiple of 8)
    q2, k2, v2 = ok()
    if rank == bad_rank:
        k2 = torch.randn(1, 2, 8, 12, dtype=torch.float64)
    # 3. an option that differs
    causal3 = rank == bad_rank and world > 1
    # 4. one rank wants gradients, the others not (its backward would wait for them forever)
    q4, k4, v4 = ok()
    q4.requires_grad_(rank == bad_rank and world > 1)
    for kind, call in (("length", lambda: fcd.ring_attention(q, k, v)),
                       ("head_dim", lambda: fcd.ring_attention(q2, k2, v2)),
                       ("option", lambda: fcd.ring_attention(*ok(), is_causal=causal3)),
                       ("grad", lambda: fcd.ring_attention(q4, k4, v4))):
        try:
            call()
            seen[kind] = None
        except Exception as exc:  # noqa: BLE001  (the test checks type and message)
            seen[kind] = [type(exc).__name__, str(exc)]
    # the group still works afterwards (no rank was left half-way through a transfer)
    fcd.ring_attention(*ok(), is_causal=True)
    return seen


def _speculation(world, rank):
    """The first transfer sent before the check returns (a group that agreed before): a repeated
    call, a change made alike on every rank, a change on one rank, a failing local check, each
    followed by the next. Returns, per call, the placeholder hops this rank sent, whether its
    output equals the same call without speculation (distributed.SPECULATE off), or the error."""
    seen = {}
    hops = []
    real_hop = fcd._placeholder_hop

    def counted(*args):
        hops.append(1)
        # Late, so that a rank that sent its first block before the check sees the check fail
        # while its receive is still pending: it must wait for the hop before it raises.
        time.sleep(0.2)
        return real_hop(*args)

    gen = torch.Generator().manual_seed(7 + rank)
    inputs = {n: [torch.randn(1, 2, n, 16, dtype=torch.float64, generator=gen) for _ in range(3)] for n in (8, 12)}
    bad_rank = world - 1
    calls = (("first", 8), ("again", 8), ("all_changed", 12), ("again_changed", 12),
             ("one_changed", 8 if rank != bad_rank else 12), ("after", 8), ("head_dim", 8), ("last", 8))
    fcd._placeholder_hop = counted
    try:
        for name, n in calls:
            q, k, v = inputs[n]
            if name == "head_dim" and rank == bad_rank:
                k = torch.randn(1, 2, n, 12, dtype=torch.float64, generator=gen)
            del hops[:]
            try:
                out = fcd.ring_attention(q, k, v, is_causal=True, method="ring")
                fcd.SPECULATE = False
                try:
                    plain = fcd.ring_attention(q, k, v, is_causal=True, method="ring")
                finally:
                    fcd.SPECULATE = True
                seen[name] = [len(hops), bool(torch.equal(out, plain))]
            except Exception as exc:  # noqa: BLE001  (the test checks type and message)
                seen[name] = [len(hops), type(exc).__name__, str(exc)]
    finally:
        fcd._placeholder_hop = real_hop
    return seen


def _bad_shapes_without_numpy(world, rank):
    """_bad_shapes where numpy is missing (Tensor.numpy raises as it does then): the ranks'
    messages still travel, and every rank raises its own error, not numpy's."""
    def no_numpy(self, *args, **kwargs):
        raise RuntimeError("Numpy is not available")

    real = torch.Tensor.numpy
    torch.Tensor.numpy = no_numpy
    try:
        return _bad_shapes(world, rank)
    finally:
        torch.Tensor.numpy = real


def _bad_sinks(world, rank):
    """Sinks that attention() rejects, on every rank or on the last one only, and sinks on some
    ranks only: every rank raises before any block is attended. Returns kind -> (exception
    type, message, blocks attended) per rank; checked by the test."""
    seen = {}
    ok = lambda: [torch.randn(1, 2, 8, 16, dtype=torch.float64) for _ in range(3)]  # noqa: E731
    good = torch.zeros(2, dtype=torch.float64)
    last = rank == world - 1
    calls = []
    real_forward = ReferenceBlocks.forward

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real_forward(self, *args, **kwargs)

    cases = (("shape_everywhere", torch.zeros(3, dtype=torch.float64)),
             ("shape_2d_last", torch.zeros(1, 2, dtype=torch.float64) if last else good),
             ("integer_last", torch.zeros(2, dtype=torch.int64) if last else good),
             ("not_a_tensor_last", [0.0, 0.0] if last else good),
             ("device_last", torch.zeros(2, dtype=torch.float64, device="meta") if last else good),
             ("missing_last", None if last and world > 1 else good))
    ReferenceBlocks.forward = counted
    try:
        for kind, sinks in cases:
            del calls[:]
            try:
                fcd.ring_attention(*ok(), is_causal=True, sinks=sinks)
                seen[kind] = None
            except Exception as exc:  # noqa: BLE001  (the test checks type and message)
                seen[kind] = [type(exc).__name__, str(exc), len(calls)]
    finally:
        ReferenceBlocks.forward = real_forward
    # the group still works afterwards, and good sinks of any floating dtype are taken
    fcd.ring_attention(*ok(), is_causal=True, sinks=good.to(torch.bfloat16))
    return seen


# The cases run again with flash_cuda.ring.HOP_FIRST set.
HOP_FIRST_CASES = ("zigzag_causal", "window_two_sided_ring", "no_grad")


def _worker(rank, world, store_path, out_dir):
    torch.set_num_threads(1)
    results = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        run_cases(results, CASES, _run_case, world, rank)
        fcr.HOP_FIRST = True  # the forward's first hop before the local block: the same results
        try:
            run_cases(results, {f"hop_first_{n}": CASES[n] for n in HOP_FIRST_CASES}, _run_case, world, rank)
        finally:
            fcr.HOP_FIRST = False
        for name, fn in (("ring_vs_allgather", _ring_vs_allgather), ("round_trip", _round_trip),
                         ("bad_shapes", _bad_shapes), ("bad_shapes_without_numpy", _bad_shapes_without_numpy),
                         ("bad_sinks", _bad_sinks), ("speculation", _speculation)):
            try:
                results[name] = fn(world, rank)
            except Exception:  # noqa: BLE001
                results[name] = f"rank {rank}: {traceback.format_exc()}"
        dist.destroy_process_group()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)


def _spawn(world: int):
    """Runs every case on ``world`` gloo ranks; returns one results dict per rank."""
    return spawn_ranks(_worker, world, TIMEOUT_S, prefix="fc_ring_")


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = _spawn(world)
        return cache[world]
    return get


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CASES) + [f"hop_first_{n}" for n in HOP_FIRST_CASES]
                         + ["ring_vs_allgather", "round_trip"])
def test_against_reference(results, world, name):
    problems = [r[name] for r in results(world) if r.get(name)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_first_transfer_before_the_check(results, world):
    """A call like the group's last sends its first block at once; a changed rank sends
    placeholders of the agreed size, so nobody waits on a transfer: a change made alike goes on,
    one rank's change or bad input makes every rank raise, and the next call works."""
    per_rank = [r["speculation"] for r in results(world)]
    assert all(isinstance(p, dict) for p in per_rank), per_rank
    bad = world - 1
    for rank, seen in enumerate(per_rank):
        # "one_changed" fails on every rank, so the group's agreed length stays 12 and "after"
        # is a change made alike again
        for name in ("first", "again", "all_changed", "again_changed", "after", "last"):
            assert len(seen[name]) == 2, (rank, name, seen)
            placeholders, equal = seen[name]
            assert equal, (rank, name, seen)
            changed = name in ("all_changed", "after")
            assert placeholders == (1 if changed and world > 1 else 0), (rank, name, seen)
        if world > 1:
            placeholders, kind, msg = seen["one_changed"]
            assert kind == "ValueError" and "disagree on q shape" in msg, (rank, seen)
            # the agreed length is 12 there: the bad rank's call matches it, the others' changed
            assert placeholders == (0 if rank == bad else 1), (rank, seen)
        placeholders, kind, msg = seen["head_dim"]
        if rank == bad:
            assert kind == "ValueError" and "head dim" in msg and placeholders == (1 if world > 1 else 0), (rank, seen)
        else:
            assert kind == "RuntimeError" and f"rank(s) [{bad}]" in msg and placeholders == 0, (rank, seen)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "without_numpy"])
def test_bad_inputs_raise_on_every_rank(results, world, numpy):
    per_rank = [r["bad_shapes" if numpy else "bad_shapes_without_numpy"] for r in results(world)]
    assert all(isinstance(p, dict) for p in per_rank), per_rank
    bad = world - 1
    for rank, seen in enumerate(per_rank):
        # head dim 12 is not accepted: the bad rank raises flash_cuda's own ValueError, the
        # others a RuntimeError that names that rank and repeats its message
        kind, msg = seen["head_dim"]
        if rank == bad:
            assert kind == "ValueError" and "head dim" in msg, (rank, seen)
        else:
            assert kind == "RuntimeError" and f"rank(s) [{bad}]" in msg and "head dim" in msg, (rank, seen)
        if world > 1:
            kind, msg = seen["length"]
            assert kind == "ValueError" and "disagree on q shape" in msg and "(1, 2, 12, 16)" in msg, (rank, seen)
            kind, msg = seen["option"]
            assert kind == "ValueError" and "disagree on is_causal" in msg, (rank, seen)
            kind, msg = seen["grad"]
            assert kind == "ValueError" and "disagree on which inputs need a gradient" in msg, (rank, seen)
        else:
            assert seen["length"] is None and seen["option"] is None and seen["grad"] is None, seen


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_bad_sinks_raise_before_any_work(results, world):
    """attention()'s checks of the sinks, with its messages: the rank with bad sinks raises its
    own error, the others a RuntimeError that names it, and no rank attends a block; sinks on
    some ranks only: every rank raises a ValueError naming the ranks' choices."""
    per_rank = [r["bad_sinks"] for r in results(world)]
    assert all(isinstance(p, dict) for p in per_rank), per_rank
    bad = world - 1
    prefix = "flash_cuda.distributed.ring_attention: sinks must be"
    expected = {"shape_2d_last": ("ValueError", "a floating tensor of shape (2,) (one logit per query head), "
                                                "got shape (1, 2)"),
                "integer_last": ("TypeError", "got dtype int64"),
                "not_a_tensor_last": ("TypeError", "got list"),
                "device_last": ("RuntimeError", "sinks must be on the same device as q (cpu), got meta")}
    for rank, seen in enumerate(per_rank):
        # Rejected sinks: no block attended. (Ranks that disagree find out while the local block
        # runs, before anything is sent: "missing_last" may have attended it.)
        assert all(v[2] == 0 for c, v in seen.items() if c != "missing_last"), (rank, seen)
        kind, msg, _ = seen["shape_everywhere"]
        assert kind == "ValueError" and msg.startswith(prefix) and "got shape (3,)" in msg, (rank, seen)
        for case, (exc, text) in expected.items():
            kind, msg, _ = seen[case]
            if rank == bad:
                assert kind == exc and msg.startswith("flash_cuda.distributed.ring_attention: ") and text in msg, \
                    (rank, case, seen)
            else:
                assert kind == "RuntimeError" and f"rank(s) [{bad}]" in msg and text in msg, (rank, case, seen)
        if world > 1:
            kind, msg, _ = seen["missing_last"]
            assert kind == "ValueError" and "disagree on sinks" in msg and f"rank {bad}: None" in msg, (rank, seen)
        else:
            assert seen["missing_last"] is None, seen


# ---------------------------------------------------------------------------------------
# Without processes: the plans, cell by cell
# ---------------------------------------------------------------------------------------


def _covered(calls, q_chunks, k_chunks, s_local_k):
    """Global (query pos, key pos) cells the calls attend, each with its multiplicity."""
    def glob(chunks, local):
        for c in chunks:
            if c.local <= local < c.local + c.length:
                return c.start + local - c.local
        raise AssertionError(local)
    cells = {}
    for c in calls:
        sq, sk = c.q1 - c.q0, c.k1 - c.k0
        for i in range(sq):
            for j in range(sk):
                lo, hi = fcr._window_band(c.wl, c.wr, sq, sk)
                if lo <= j - i <= hi:
                    key = (glob(q_chunks, c.q0 + i), glob(k_chunks, c.k0 + j))
                    cells[key] = cells.get(key, 0) + 1
    return cells


@pytest.mark.parametrize("layout", fcd.LAYOUTS)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, 0), (0, 0), (3, 7), (20, -1), (-1, 9), (1, 40)])
def test_plans_cover_the_mask_exactly(layout, window):
    for world in (1, 2, 3, 4):
        s_local = 12
        S = s_local * world
        left, right = window
        for rank in range(world):
            mine = fcr._rank_chunks(layout, world, rank, s_local)
            cells = {}
            for src in range(world):
                theirs = fcr._rank_chunks(layout, world, src, s_local)
                calls = fcr._plan(mine, theirs, left, right)
                for key, n in _covered(calls, mine, theirs, s_local).items():
                    cells[key] = cells.get(key, 0) + n
                if window == (-1, -1):
                    assert len(calls) == 1, calls  # unmasked: one call per block
            # all-gather: the same cells against the whole sequence
            ag = fcr._plan(mine, [fcr._Chunk(0, 0, S)], left, right)
            assert _covered(ag, mine, [fcr._Chunk(0, 0, S)], S) == cells
            expected = {(c.start + i, t) for c in mine for i in range(c.length) for t in range(S)
                        if (left < 0 or t >= c.start + i - left) and (right < 0 or t <= c.start + i + right)}
            assert set(cells) == expected and all(n == 1 for n in cells.values()), (world, rank)


def test_zigzag_causal_is_one_balanced_call_per_step():
    world, s_local = 4, 16
    for rank in range(world):
        mine = fcr._rank_chunks("zigzag", world, rank, s_local)
        for src in range(world):
            calls = fcr._plan(mine, fcr._rank_chunks("zigzag", world, src, s_local), -1, 0)
            assert len(calls) == 1
            c = calls[0]
            if src == rank:
                assert (c.q1 - c.q0, c.k1 - c.k0, c.wl, c.wr) == (16, 16, -1, 0)
            else:  # half the queries against the whole block, or all against half: no mask
                assert (c.q1 - c.q0) * (c.k1 - c.k0) == 128 and (c.wl, c.wr) == (-1, -1)


def test_pick_method():
    assert fcr.pick_method("ring", 8, 1, 8192, 4) == "ring"
    assert fcr.pick_method("auto", 32, 8, 8192, 4) == "allgather"  # gathered K/V <= local q
    assert fcr.pick_method("auto", 16, 16, 8192, 4) == "ring"
    assert fcr.pick_method("auto", 16, 16, 256, 4) == "allgather"  # too little work per step
    assert fcr.pick_method("auto", 16, 16, 256, 1) == "ring"


def test_shard_without_group_and_bad_lengths():
    x = torch.arange(24).view(1, 1, 24, 1)
    assert fcd.shard(x, 2, world_size=3, rank=1).flatten().tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert fcd.shard(x, 2, layout="contiguous", world_size=3, rank=1).flatten().tolist() == list(range(8, 16))
    with pytest.raises(ValueError, match="multiple of 10"):
        fcd.shard(x, 2, world_size=5, rank=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        fcd.shard(x, 2, layout="striped", world_size=2, rank=0)


# ---------------------------------------------------------------------------------------
# Without processes: the CUDA block kernel's plumbing (through the CPU stand-in of the
# extension, conftest.mock_extension) and the merge schedule
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_cuda_block_calls_match_the_reference_blocks(mock_extension, method, sinks):
    """The ring's steps on one rank of a pretend world of 3 whose blocks never move (NoComm):
    flash_cuda's extension entry points (here the mock, which asserts the binding's argument
    contract) and the reference blocks must give the same result. With sinks (bfloat16, as
    gpt-oss keeps them), the blocks never see them: they are merged after the last block."""
    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(2, 4, 16, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 16, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    dlse = torch.randn(2, 4, 16, generator=g)
    s = torch.tensor([2.0, -math.inf, 4.5, 0.5], dtype=torch.bfloat16) if sinks else None
    got = []
    opts = ScoreOptions(0.25)
    for kernel in (fcr.CudaBlocks(q, opts, False, 0), ReferenceBlocks(q, opts)):
        cfg = fcr.Config(kernel, NoComm(3, 1), "ring", "zigzag", 6, 0, True, True)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ss = None if s is None else s.clone().requires_grad_()
        if method == "allgather":  # the all-gather's calls: q's two chunks against the pretend whole sequence k
            cfg = cfg._replace(method="allgather", ring=NoComm(1, 0))
        out, lse = fcr.RingAttention.apply(qq, kk, vv, cfg, ss)
        ((out.float() * do.float()).sum() + (lse * dlse).sum()).backward()
        got.append((out, lse, qq.grad, kk.grad, vv.grad) + (() if ss is None else (ss.grad,)))
    assert mock_extension.fwd_calls > 0 and mock_extension.bwd_calls > 0
    assert mock_extension.merge_calls > 0 or method == "allgather"
    assert mock_extension.last_fwd_sinks is None
    if sinks:
        assert got[0][5][1] == 0 and got[1][5][1] == 0  # a -inf sink: no gradient
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), *got):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.allclose(a.float(), b.float(), atol=3e-2, rtol=2e-2), (name, (a.float() - b.float()).abs().max())


@pytest.mark.parametrize("blocks", ["cuda", "reference"])
def test_bfloat16_merges_in_float32(mock_extension, blocks):
    """Four non-causal steps on blocks that never move (NoComm): the sequence is the local
    block four times, so the result is attention on the local block. bf16 rows merged four
    times go through the float32 accumulator and are rounded once at the end, dQ too, and dK /
    dV travel in float32: errors against float64 stay at the level of one bf16 attention."""
    g = torch.Generator().manual_seed(11)
    q, k, v, do = (torch.randn(1, 2, 32, 16, generator=g, dtype=torch.float64) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, _ = attention_naive(*ref_in)
    ref = (ref_out, *torch.autograd.grad((ref_out * do).sum(), ref_in))
    naive_in = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    naive_out, _ = attention_naive(*naive_in)
    naive = (naive_out, *torch.autograd.grad((naive_out.float() * do.float()).sum(), naive_in))
    qb, kb, vb = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    opts = ScoreOptions(16 ** -0.5)
    kernel = fcr.CudaBlocks(qb, opts, False, 0) if blocks == "cuda" else ReferenceBlocks(qb, opts)
    cfg = fcr.Config(kernel, NoComm(4, 2), "ring", "zigzag", -1, -1, True, True)
    out, _ = fcr.RingAttention.apply(qb, kb, vb, cfg)
    ((out.float() * do.float()).sum()).backward()
    for name, got, r, nv in zip(("out", "dq", "dk", "dv"), (out, qb.grad, kb.grad, vb.grad), ref, naive):
        assert got.dtype == torch.bfloat16
        err, naive_err = _max_err(got.detach(), r.detach()), _max_err(nv.detach(), r.detach())
        assert err <= 2 * naive_err + 1e-3, (name, err, naive_err)
    if blocks == "cuda":  # bf16 into float32, float32 on, then the last merge into bf16
        bf, f32 = torch.bfloat16, torch.float32
        assert {(bf, bf, f32), (f32, bf, f32), (f32, bf, bf)} <= mock_extension.merge_dtypes


def test_sinks_gradient_alone_runs_no_backward_kernel():
    """Only the sinks require a gradient: the backward computes d(sinks) from out, lse and the
    upstream gradients, with no block backward and no transfer (NoComm would copy; a real ring
    would wait for the other ranks)."""
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, 2, 16, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, 16, 16, generator=g, dtype=torch.float64) for _ in range(2))
    s = torch.tensor([1.5, 3.0], dtype=torch.float64, requires_grad=True)
    exchanges, backwards = [], []

    class Counting(NoComm):
        def exchange(self, send, recv, tag0=0):
            exchanges.append(tag0)
            return super().exchange(send, recv, tag0)

    class CountingBlocks(ReferenceBlocks):
        def backward(self, *args):
            backwards.append(1)
            return super().backward(*args)

    cfg = fcr.Config(CountingBlocks(q, ScoreOptions(0.25)), Counting(2, 1), "ring", "contiguous", -1, 0, False,
                     False)
    out, _ = fcr.attention(q, k, v, cfg, s)
    sent = len(exchanges)
    (out * do).sum().backward()
    assert sent > 0 and len(exchanges) == sent and not backwards
    # rank 1 of a pretend world of 2 whose blocks never move: its queries at positions 16..31
    # see its own keys as those of positions 0..15 too
    k2, v2 = torch.cat([k, k], 2), torch.cat([v, v], 2)
    sr = s.detach().clone().requires_grad_()
    ref, _ = attention_naive(q, k2, v2, scale=0.25, is_causal=True, sinks=sr)
    (ref * do).sum().backward()
    assert torch.allclose(out, ref, atol=1e-12) and torch.allclose(s.grad, sr.grad, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_merge_sink(dtype):
    """merge_sink against a sink merged as one more partial (reference.combine_splits), with the
    fp32 kernels' (m, log2 l) statistics: rows that saw no key ((+inf, 0), lse -inf), -inf
    sinks (bitwise no-ops), a sink far above the keys. The statistics stay those of the
    sink-including row: (m + log2 l) ln 2 = lse and m = max(m, sink log2 e)."""
    g = torch.Generator().manual_seed(2)
    B, H, S, D = 2, 4, 6, 8
    out = torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(dtype)
    lse = (2 + torch.randn(B, H, S, generator=g, dtype=torch.float64)).to(dtype)
    lse[:, :, 0] = -math.inf  # rows that saw no key
    out[:, :, 0] = 0
    m = lse.float() * 1.4426950408889634 + 0.75  # any split of lse log2 e into m + log2 l
    stats = torch.stack((m, lse.float() * 1.4426950408889634 - m), -1)
    stats[:, :, 0] = torch.tensor([math.inf, 0.0])
    sinks = torch.tensor([1.0, -math.inf, 40.0, 2.5], dtype=dtype)
    o2, l2, st2 = fcr.merge_sink(out.clone(), lse.clone(), stats.clone(), sinks, dtype)
    ref_o, ref_l = combine_splits([out], [lse], dtype, sink=sinks.view(1, H, 1))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(o2, ref_o, atol=tol) and torch.allclose(l2, ref_l, atol=tol)
    assert torch.equal(o2[:, 1], out[:, 1]) and torch.equal(l2[:, 1], lse[:, 1]) and torch.equal(st2[:, 1], stats[:, 1])
    assert bool((o2[:, :, 0] == 0).all()) and torch.equal(l2[:, [0, 2, 3], 0], sinks[[0, 2, 3]].expand(B, 3))
    assert torch.equal(st2[:, 1, 0], stats[:, 1, 0])  # no key, no sink: still (+inf, 0)
    seen = torch.ones(B, H, S, dtype=torch.bool)
    seen[:, 1, 0] = False
    assert torch.allclose(((st2[..., 0] + st2[..., 1]) * math.log(2))[seen], l2.float()[seen], atol=1e-5)
    s2 = sinks.float().view(1, H, 1) * 1.4426950408889634
    m_in = torch.where(stats[..., 0] == math.inf, -math.inf, stats[..., 0])
    assert torch.equal(st2[..., 0][seen], torch.maximum(m_in, s2)[seen])


def _row_histories(sched):
    """Per local row: the (src, dst) of every action that touched it, in call order."""
    hist = {}
    for step_actions in sched.actions:
        for actions in step_actions:
            for a in actions:
                for r in range(a.r0, a.r1):
                    hist.setdefault(r, []).append((a.src, a.dst))
    return hist


@pytest.mark.parametrize("layout", fcd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (5, 0), (3, 2), (0, 0), (40, -1)])
def test_merge_schedule(layout, world, window):
    """Every row is stored by the first call that covers it, merged by each later one from
    where the result went before, into the float32 accumulator ("F") until its last merge,
    which writes the output ("T"); rows no call covers are the untouched ones."""
    s_local = 12
    for rank in range(world):
        for sched in (fcr._ring_schedule_of(layout, world, rank, s_local, *window),
                      fcr._allgather_schedule_of(layout, world, rank, s_local, *window)):
            covered = {}
            for step in sched.steps:
                for c in step:
                    for r in range(c.q0, c.q1):
                        covered[r] = covered.get(r, 0) + 1
            hist = _row_histories(sched)
            untouched = {r for r0, r1 in sched.untouched for r in range(r0, r1)}
            assert untouched == set(range(s_local)) - set(covered)
            for r, n in covered.items():
                h = hist[r]
                assert len(h) == n and h[0] == ("", "T"), (r, h)
                for i in range(1, n):
                    assert h[i][0] == h[i - 1][1] and h[i][1] == ("T" if i == n - 1 else "F"), (r, h)
            for step, step_actions in zip(sched.steps, sched.actions):
                for c, actions in zip(step, step_actions):
                    assert all(c.q0 <= a.r0 < a.r1 <= c.q1 for a in actions)


def test_speculation_is_a_function_of_the_agreed_entry():
    """Every rank decides from the group's agreed entry alone: short local blocks on the ring
    method speculate; long ones (32k tokens per GPU), the all-gather method and the switch off do
    not."""
    def agreed(S, method="ring", B=1, H=16, D=128):
        meta = (0, B, H, S, D) + (0,) * (fcd._META_LEN - 5)
        return fcd._Agreed(meta, (B, H, S, D), torch.bfloat16, True, method)
    assert fcd._speculates(agreed(8192))
    assert not fcd._speculates(agreed(32768))
    assert not fcd._speculates(agreed(8192, method="allgather"))
    assert not fcd._speculates(None)
    real = fcd.SPECULATE
    fcd.SPECULATE = False
    try:
        assert not fcd._speculates(agreed(8192))
    finally:
        fcd.SPECULATE = real
