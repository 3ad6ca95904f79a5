"""The self-test of ``python3 -m flash_cuda``: the forward and backward of a few small problems
(causal, grouped-query, packed sequences, a KV-cache decode step, float32, head dim 256) on
the GPU against :mod:`flash_cuda.reference` in float64.

The accuracy rule is FlashAttention's (the one tests/attn_check.py applies to the whole suite):
for every output X (out, lse, dq, dk, dv)

    max|X_flash - X_ref64|  <=  2 * max|X_naive - X_ref64|  +  atol

where X_ref64 is the reference on float64 copies of the inputs, X_naive the same reference in
the inputs' dtype, and atol = magnitude * (base + 2^-24 * (8 * max|lse| + 16 * sqrt(D))), the
magnitude max(1, max|X_ref64|), the base 1e-2 (bf16), 1e-3 (fp16), 1e-5 (fp32); 1e-4 for the lse
of 16-bit inputs.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import flash_cuda
from .reference import attention_naive, attention_varlen_naive

ATOL_BASE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
LSE_ATOL_BASE = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4}
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def rule(x: Tensor, ref64: Tensor, naive: Tensor, base: float, score_mag: float = 0.0,
         head_dim: int = 0) -> Dict[str, float]:
    """{"error", "naive", "tol"} of one output under the rule (error NaN when x is not finite)."""
    x = x.detach().to(torch.float64)
    finite = torch.isfinite(ref64)
    if not bool(torch.isfinite(x[finite]).all()):
        return {"error": float("nan"), "naive": float("nan"), "tol": 0.0}

    def max_abs(t: Tensor) -> float:
        return float(t[finite].abs().max()) if bool(finite.any()) else 0.0

    err = max_abs(x - ref64)
    err_naive = max_abs(naive.detach().to(torch.float64) - ref64)
    if not math.isfinite(err_naive):
        err_naive = 0.0
    atol = (base + 2.0 ** -24 * (8 * score_mag + 16 * math.sqrt(head_dim))) * max(1.0, max_abs(ref64))
    return {"error": err, "naive": err_naive, "tol": 2.0 * err_naive + atol}


def _randn(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> Tensor:
    """Standard-normal values on the generator's device."""
    return torch.randn(tuple(shape), generator=gen, device=gen.device, dtype=torch.float32).to(dtype)


def _compare(flash: Sequence[Tensor], refs: Dict[torch.dtype, Sequence[Tensor]], names: Sequence[str],
             dtype: torch.dtype, head_dim: int) -> Dict[str, Dict[str, float]]:
    """Applies the rule to each output named in ``names`` (the second one is lse)."""
    ref64, naive = refs[torch.float64], refs[dtype]
    lse64 = ref64[1]
    score_mag = float(lse64[torch.isfinite(lse64)].abs().max()) if bool(torch.isfinite(lse64).any()) else 0.0
    out = {}
    for i, name in enumerate(names):
        if name == "lse":
            out[name] = rule(flash[i], ref64[i], naive[i], LSE_ATOL_BASE[dtype])
        else:
            out[name] = rule(flash[i], ref64[i], naive[i], ATOL_BASE[dtype], score_mag, head_dim)
    return out


def _with_grads(fn: Callable, inputs: Sequence[Tensor], dout: Tensor) -> List[Tensor]:
    """(out, lse, dq, dk, dv) of ``fn(q, k, v) -> (out, lse)`` with the gradient ``dout``."""
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out, lse = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return [out.detach(), lse.detach(), *grads]


def _check_autograd(dtype: torch.dtype, inputs: Sequence[Tensor], flash_fn: Callable, ref_fn: Callable,
                    gen: torch.Generator) -> Dict[str, Dict[str, float]]:
    """flash_fn and ref_fn (q, k, v) -> (out, lse): forward and backward against the reference in
    float64 and in ``dtype``."""
    dout = _randn(inputs[0].shape, dtype, gen)  # out has q's shape
    flash = _with_grads(flash_fn, inputs, dout)
    refs = {}
    for rdtype in {torch.float64, dtype}:
        refs[rdtype] = _with_grads(ref_fn, [t.to(rdtype) for t in inputs], dout.to(rdtype))
    return _compare(flash, refs, ("out", "lse", "dq", "dk", "dv"), dtype, inputs[0].shape[-1])


def _dense_case(B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int, dtype: torch.dtype, causal: bool,
                window: Tuple[int, int] = (-1, -1)):
    def run(gen: torch.Generator) -> Dict[str, Dict[str, float]]:
        q = _randn((B, Hq, Sq, D), dtype, gen)
        k, v = (_randn((B, Hkv, Sk, D), dtype, gen) for _ in range(2))
        opts = dict(is_causal=causal, window_size=window)
        return _check_autograd(dtype, (q, k, v),
                               lambda q, k, v: flash_cuda.attention(q, k, v, return_lse=True, **opts),
                               lambda q, k, v: attention_naive(q, k, v, **opts), gen)
    return run


def _varlen_case(lengths: Sequence[int], Hq: int, Hkv: int, D: int, dtype: torch.dtype, causal: bool):
    def run(gen: torch.Generator) -> Dict[str, Dict[str, float]]:
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=gen.device)
        q = _randn((total, Hq, D), dtype, gen)
        k, v = (_randn((total, Hkv, D), dtype, gen) for _ in range(2))
        m = max(lengths)
        return _check_autograd(
            dtype, (q, k, v),
            lambda q, k, v: flash_cuda.varlen_attention(q, k, v, cu, cu, m, m, is_causal=causal, return_lse=True),
            lambda q, k, v: attention_varlen_naive(q, k, v, cu, cu, is_causal=causal), gen)
    return run


def _kvcache_case(B: int, Hq: int, Hkv: int, capacity: int, lengths: Sequence[int], D: int, dtype: torch.dtype):
    """One decode step: a new token appended to a dense cache, its query attending causally."""
    def run(gen: torch.Generator) -> Dict[str, Dict[str, float]]:
        k_cache, v_cache = (_randn((B, Hkv, capacity, D), dtype, gen) for _ in range(2))
        k_new, v_new = (_randn((B, Hkv, 1, D), dtype, gen) for _ in range(2))
        q = _randn((B, Hq, 1, D), dtype, gen)
        seqlens = torch.tensor(lengths, dtype=torch.int32, device=gen.device)
        before = (k_cache.clone(), v_cache.clone())
        out, lse = flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                     is_causal=True, return_lse=True)
        for b, n in enumerate(lengths):
            written = torch.equal(k_cache[b, :, n:n + 1], k_new[b]) and torch.equal(v_cache[b, :, n:n + 1], v_new[b])
            kept = all(torch.equal(c[b, :, :n], o[b, :, :n]) for c, o in zip((k_cache, v_cache), before))
            if not (written and kept):
                raise AssertionError(f"the cache of sequence {b} does not hold its {n} old and 1 new keys / values")
        refs = {}
        for rdtype in {torch.float64, dtype}:
            outs = [attention_naive(q[b:b + 1].to(rdtype), k_cache[b:b + 1, :, :n + 1].to(rdtype),
                                    v_cache[b:b + 1, :, :n + 1].to(rdtype), is_causal=True) for b, n in enumerate(lengths)]
            refs[rdtype] = [torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])]
        return _compare((out, lse), refs, ("out", "lse"), dtype, D)
    return run


def cases(quick: bool = False) -> List[Tuple[str, Callable]]:
    """(description, run(generator) -> {output: {"error", "naive", "tol"}}) of every case."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    all_cases = [
        ("causal bf16 B=2 H=4 S=200 D=64, fwd+bwd", _dense_case(2, 4, 4, 200, 200, 64, bf16, True)),
        ("GQA fp16 Hq=8 Hkv=2 Sq=96 Sk=257 D=128, fwd+bwd", _dense_case(1, 8, 2, 96, 257, 128, fp16, False)),
        ("varlen bf16 seqlens 37,128,1,64 Hq=4 Hkv=2 D=64 causal, fwd+bwd",
         _varlen_case((37, 128, 1, 64), 4, 2, 64, bf16, True)),
        ("KV-cache decode bf16 B=2 Hq=8 Hkv=2 cache 100,37 of 256 D=128, fwd",
         _kvcache_case(2, 8, 2, 256, (100, 37), 128, bf16)),
        ("fp32 causal window (64, 0) B=1 H=2 S=130 D=32, fwd+bwd",
         _dense_case(1, 2, 2, 130, 130, 32, fp32, True, (64, 0))),
        ("causal bf16 B=1 H=2 S=160 D=256, fwd+bwd", _dense_case(1, 2, 2, 160, 160, 256, bf16, True)),
    ]
    return all_cases[:2] if quick else all_cases


def run(quick: bool = False, seed: int = 0, device: str = "cuda") -> List[dict]:
    """Runs every case (``quick``: the first two) on ``device`` (the current GPU): [{"name",
    "passed", "seconds", "errors": {output: {"error", "naive", "tol"}}, "problem": None or what
    failed}]."""
    results = []
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references in true float32
    try:
        for i, (name, case) in enumerate(cases(quick)):
            gen = torch.Generator(device=device)
            gen.manual_seed(seed * 1000 + i)
            start = time.perf_counter()
            errors: Dict[str, Dict[str, float]] = {}
            problem: Optional[str] = None
            try:
                errors = case(gen)
                bad = [f"{k}: {e['error']:.2e} > tol {e['tol']:.2e}" for k, e in errors.items()
                       if not e["error"] <= e["tol"]]
                problem = "; ".join(bad) or None
            except Exception as exc:  # a failing case is reported, the others still run
                problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            results.append({"name": name, "passed": problem is None, "seconds": round(time.perf_counter() - start, 3),
                            "errors": errors, "problem": problem})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return results
