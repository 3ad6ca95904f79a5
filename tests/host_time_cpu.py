#!/usr/bin/env python
"""Host time per call of flash_cuda's Python layer on CPU, without a GPU: the extension is replaced
by a stand-in that returns preallocated outputs at once (no arithmetic, no allocation), so what is
timed is everything flash_cuda does around the kernels' launch: validation, the choice of path, the
autograd Function, the extension call's argument passing.

    python3 tests/host_time_cpu.py                     # flash_cuda as imported
    python3 tests/host_time_cpu.py --modules flash_cuda,other_copy --rounds 15
    python3 tests/host_time_cpu.py --profile fwd_grad  # cProfile of one case instead

``--modules`` names packages importable under those names (e.g. a copy of another revision whose
``flash_cuda::`` op names were renamed so both can be registered in one process); their cases are
timed alternately, round by round, and the best round of each is printed (a loaded machine's noise
only adds time). The cases: dense forward under no_grad at a decode shape (B 8, H 32, Sq 1, Sk 4096,
D 128) and a 128-token prefill (B 1, H 32, S 128, D 128); forward + backward of a tiny call (B = H =
1, S 128, D 64, causal), its forward alone (the graph recorded, no backward) and forward +
torch.autograd.grad with a given upstream gradient; a packed (varlen)
forward under no_grad (4 sequences, 512 rows, H 16, D 64); a decode step of
attention_with_kvcache (B 1, Hq 32, Hkv 8, a 128-row cache, D 64, a tensor cache_seqlens),
without and with one new key appended. bfloat16 throughout.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import time
from types import SimpleNamespace

import torch


class NoOpExtension:
    """The extension's fwd / bwd contract, answering with tensors allocated once per shape."""

    def __init__(self):
        self._fwd, self._bwd = {}, {}

    def fwd(self, q, k, v, scale, window_left, window_right, softcap, alibi_slopes, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, tier, dropout_p=0.0, rng_state=None, sinks=None,
            sm_margin=0):
        key = (q.shape, q.dtype, cu_seqlens_q is None)
        res = self._fwd.get(key)
        if res is None:
            lse_shape = tuple(q.shape[:3]) if cu_seqlens_q is None else (q.shape[1], q.shape[0])
            res = self._fwd[key] = (torch.empty_like(q), torch.empty(lse_shape), torch.empty(0))
        return res

    def fwd_kvcache(self, q, k_cache, v_cache, k, v, cache_seqlens, cache_len, block_table, scale, window_left,
                    window_right, softcap, alibi_slopes, num_splits, return_lse, sinks=None):
        key = (q.shape, q.dtype, "kvcache")
        res = self._fwd.get(key)
        if res is None:
            res = self._fwd[key] = (torch.empty_like(q), torch.empty(tuple(q.shape[:3])))
        return res[0], (res[1] if return_lse else None)

    def bwd(self, dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap,
            alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic,
            tier, need_dq=True, need_dkdv=True, dropout_p=0.0, rng_state=None):
        key = (q.shape, k.shape, q.dtype)
        res = self._bwd.get(key)
        if res is None:
            res = self._bwd[key] = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        return res


def install(name: str, ext: NoOpExtension):
    """Imports package ``name`` with its extension replaced by ``ext`` and its CUDA-device check
    lifted (the tensors are CPU tensors); returns the package."""
    pkg = importlib.import_module(name)
    ext_mod = importlib.import_module(f"{name}._ext")
    validation = importlib.import_module(f"{name}.validation")
    ext_mod._C = SimpleNamespace(fwd=ext.fwd, bwd=ext.bwd, fwd_kvcache=ext.fwd_kvcache)
    ext_mod._AVAILABLE = True
    ext_mod._IMPORT_ERROR = None

    def same_device_only(q, k, v, prefix=validation.PREFIX):
        if not (q.device == k.device == v.device):
            raise RuntimeError(f"{prefix}q, k and v must be on the same device")

    validation.check_device = same_device_only
    try:  # attention_with_kvcache's CUDA-device check, where the package keeps it
        checks = importlib.import_module(f"{name}.kvcache_checks")
    except ModuleNotFoundError:
        checks = importlib.import_module(f"{name}.kvcache")
    checks._check_device = lambda q, dev: None
    return pkg


def cases(fc):
    bf16 = torch.bfloat16
    dq = torch.empty(8, 32, 1, 128, dtype=bf16)
    dk = torch.empty(8, 32, 4096, 128, dtype=bf16)
    pq = torch.empty(1, 32, 128, 128, dtype=bf16)
    tq, tk, tv = (torch.randn(1, 1, 128, 64, dtype=bf16, requires_grad=True) for _ in range(3))
    tdout = torch.randn(1, 1, 128, 64, dtype=bf16)
    vq = torch.empty(512, 16, 64, dtype=bf16)
    cu = torch.tensor([0, 100, 228, 400, 512], dtype=torch.int32)

    kq = torch.empty(1, 32, 1, 64, dtype=bf16)
    kc = torch.empty(1, 8, 128, 64, dtype=bf16)
    knew = torch.empty(1, 8, 1, 64, dtype=bf16)
    lens = torch.tensor([100], dtype=torch.int32)

    def decode():
        with torch.no_grad():
            fc.attention(dq, dk, dk)

    def kvcache_decode():
        fc.attention_with_kvcache(kq, kc, kc, cache_seqlens=lens)

    def kvcache_append():
        fc.attention_with_kvcache(kq, kc, kc, knew, knew, cache_seqlens=lens)

    def prefill():
        with torch.no_grad():
            fc.attention(pq, pq, pq, is_causal=True)

    def fwd_autograd():
        fc.attention(tq, tk, tv, is_causal=True)

    def fwd_grad():
        out = fc.attention(tq, tk, tv, is_causal=True)
        torch.autograd.grad(out, (tq, tk, tv), tdout)

    def varlen():
        with torch.no_grad():
            fc.varlen_attention(vq, vq, vq, cu, cu, 172, 172, is_causal=True)

    return {"fwd_decode": decode, "fwd_prefill": prefill, "fwd_autograd": fwd_autograd, "fwd_grad": fwd_grad,
            "varlen_fwd": varlen, "kvcache_decode": kvcache_decode, "kvcache_append": kvcache_append}


def autograd_floor():
    """The floors of the cases: the tiny call's forward + backward, and its forward alone, through a
    Function that does nothing (no validation, no extension call): what torch's autograd alone
    costs; and the empty ``with torch.no_grad()`` block that the no_grad cases include."""
    tq, tk, tv = (torch.randn(1, 1, 128, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    tdout = torch.randn(1, 1, 128, 64, dtype=torch.bfloat16)
    out, lse = torch.empty_like(tq), torch.empty(1, 1, 128)
    grads = tuple(torch.empty_like(t) for t in (tq, tk, tv))

    class Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            ctx.saved_tensors
            return grads

    def step():
        o, _ = Nothing.apply(tq, tk, tv)
        torch.autograd.grad(o, (tq, tk, tv), tdout)

    def forward_alone():
        Nothing.apply(tq, tk, tv)

    def no_grad_block():
        with torch.no_grad():
            pass

    return {"fwd_grad": step, "fwd_autograd": forward_alone, "the no_grad cases' torch.no_grad()": no_grad_block}


def us_per_call(step, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", default="flash_cuda")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", default=None, help="a case to run under cProfile instead")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.modules.split(",")
    all_cases = {name: cases(install(name, NoOpExtension())) for name in names}
    if args.profile:
        step = all_cases[names[0]][args.profile]
        for _ in range(200):
            step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    best = {(n, c): float("inf") for n in names for c in all_cases[n]}
    floors = autograd_floor()
    best_floor = dict.fromkeys(floors, float("inf"))
    for name in names:  # warm-up: first calls validate, compile nothing, fill caches
        for step in all_cases[name].values():
            for _ in range(200):
                step()
    for _ in range(args.rounds):
        for case in all_cases[names[0]]:
            for name in names:
                t = us_per_call(all_cases[name][case], args.calls)
                best[name, case] = min(best[name, case], t)
        for case, floor in floors.items():
            best_floor[case] = min(best_floor[case], us_per_call(floor, args.calls))
    print(f"host us/call, best of {args.rounds} rounds x {args.calls} calls (CPU, no-op extension)")
    print(f"{'case':14s}" + "".join(f"{n:>18s}" for n in names))
    for case in all_cases[names[0]]:
        print(f"{case:14s}" + "".join(f"{best[n, case]:18.2f}" for n in names))
    print("floors (torch alone): " + ", ".join(f"{case} {t:.2f}" for case, t in best_floor.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
