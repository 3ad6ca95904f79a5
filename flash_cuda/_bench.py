"""The short benchmark of ``python3 -m flash_cuda --bench``: flash_cuda, PyTorch's
scaled_dot_product_attention (its default backend choice) and, when ``flash_attn.cute`` is
importable, FlashAttention-4, timed in the same run on the same shapes.

The shapes are FlashAttention's benchmark grid in small: bfloat16, batch * seqlen = 16k tokens,
heads * head_dim = 2048, head dims 64 and 128, sequence lengths 1k and 4k, causal and not, the
forward and the forward + backward. Every provider gets fresh random inputs for every shape;
each call is timed with CUDA events after a warm-up (which also compiles FlashAttention-4's
kernels), and the median is reported. TFLOPS count 4 * B * H * S^2 * D for the forward, half of
it when causal, and 3.5 times that for the forward + backward (a backward = 2.5 forwards).
bench/ in the source tree has the full grid and more providers.
"""

from __future__ import annotations

import statistics
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import flash_cuda

TOKENS, HIDDEN = 16384, 2048
MODE_FLOP_FACTOR = {"fwd": 1.0, "fwd_bwd": 3.5}
TARGET_MS = 100.0  # timed calls per cell: about this long, between MIN_REPS and MAX_REPS calls
MIN_REPS, MAX_REPS, WARMUP = 5, 50, 3


def shapes(quick: bool = False) -> List[dict]:
    """The cells: {"D", "S", "B", "H", "causal", "mode"}; ``quick``: one shape, both modes."""
    grid = ([(128, 1024, True)] if quick else
            [(d, s, c) for d in (64, 128) for s in (1024, 4096) for c in (False, True)])
    return [{"D": d, "S": s, "B": max(1, TOKENS // s), "H": max(1, HIDDEN // d), "causal": c, "mode": m}
            for d, s, c in grid for m in ("fwd", "fwd_bwd")]


def flops(cell: dict) -> float:
    return (4.0 * cell["B"] * cell["H"] * cell["S"] ** 2 * cell["D"] / (2.0 if cell["causal"] else 1.0)
            * MODE_FLOP_FACTOR[cell["mode"]])


def fa4() -> Tuple[Optional[Callable], Optional[str]]:
    """(FlashAttention-4's flash_attn_func, None), or (None, why it is not used)."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # not installed, or its runtime does not load
        return None, f"flash_attn.cute is not importable ({type(exc).__name__}: {exc})"
    return flash_attn_func, None


def providers(with_fa4: bool = True) -> Tuple[Dict[str, Tuple[Callable, bool]], Optional[str]]:
    """{name: (attention(q, k, v, causal) -> out, whether it takes (B, S, H, D) tensors)} and why
    FlashAttention-4 is left out (None when it is in)."""
    found = {"flash_cuda": (lambda q, k, v, causal: flash_cuda.attention(q, k, v, is_causal=causal), False),
             "sdpa": (lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal), False)}
    fn, reason = fa4() if with_fa4 else (None, "left out (--no-fa4)")
    if fn is not None:
        def call(q, k, v, causal):
            out = fn(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out
        found["fa4"] = (call, True)
    return found, reason


def time_ms(step: Callable[[], object]) -> float:
    """Median milliseconds of ``step`` over calls timed one by one with CUDA events, after a warm-up."""
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    events = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    reps = int(min(MAX_REPS, max(MIN_REPS, TARGET_MS / max(start.elapsed_time(end), 1e-3))))
    for _ in range(reps):
        pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record()
        step()
        pair[1].record()
        events.append(pair)
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def measure(fn: Callable, bshd: bool, cell: dict, dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> float:
    """Milliseconds of one call (forward, or forward + backward) of ``fn`` on fresh inputs."""
    B, H, S, D = cell["B"], cell["H"], cell["S"], cell["D"]
    shape = (B, S, H, D) if bshd else (B, H, S, D)
    grad = cell["mode"] == "fwd_bwd"
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=grad) for _ in range(3))
    if not grad:
        return time_ms(lambda: fn(q, k, v, cell["causal"]))
    dout = torch.randn(shape, device=device, dtype=dtype)

    def step():
        out = fn(q, k, v, cell["causal"])
        torch.autograd.grad(out, (q, k, v), dout)  # no .grad accumulation in the timing
    return time_ms(step)


def run(quick: bool = False, with_fa4: bool = True, progress=sys.stderr, device: str = "cuda") -> dict:
    """{"dtype", "providers", "fa4_reason", "rows": [cell + {"<provider>_tflops": float or None,
    "<provider>_error": str (failed calls only), "ratio_sdpa", "ratio_fa4"}]}."""
    found, fa4_reason = providers(with_fa4)
    cells = shapes(quick)
    rows = []
    tty = hasattr(progress, "isatty") and progress.isatty()
    total = len(cells) * len(found)
    done = 0
    for cell in cells:
        row = dict(cell)
        for name, (fn, bshd) in found.items():
            done += 1
            label = (f"[{done}/{total}] {name} D={cell['D']} S={cell['S']} "
                     f"{'causal' if cell['causal'] else 'non-causal'} {cell['mode']}")
            print(f"\r\033[K{label}" if tty else label, end="" if tty else "\n", file=progress, flush=True)
            try:
                row[f"{name}_tflops"] = flops(cell) / measure(fn, bshd, cell, device=device) / 1e9
            except Exception as exc:  # a provider that does not run a shape: reported, the rest go on
                row[f"{name}_tflops"] = None
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
            torch.cuda.empty_cache()
        for other in ("sdpa", "fa4"):
            ours, theirs = row.get("flash_cuda_tflops"), row.get(f"{other}_tflops")
            if other in found:
                row[f"ratio_{other}"] = ours / theirs if ours and theirs else None
        rows.append(row)
    if tty:
        print("\r\033[K", end="", file=progress, flush=True)
    return {"dtype": "bfloat16", "providers": list(found), "fa4_reason": fa4_reason, "rows": rows}
