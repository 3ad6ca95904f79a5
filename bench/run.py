#!/usr/bin/env python
"""Benchmark flash_cuda against PyTorch SDPA (every backend) and a naive attention.

    python bench/run.py                  # default grid, bf16 (a few minutes on an H200)
    python bench/run.py --quick          # S in {1k, 4k, 16k}, fewer repeats (about a minute)
    python bench/run.py --d 128 --causal 0 --mode fwd --seqlen 4096 \\
                        --providers flash_cuda sdpa_cudnn
    python bench/run.py --dtype fp16 fp32          # one results folder per dtype
    python bench/run.py --workload seeds           # fixed B=4, H=8 instead of B*S=16384
    python bench/run.py --dry-run                  # print the plan only (no GPU needed)
    python bench/run.py --compare-anchors          # also print shared/anchors numbers
    python bench/run.py --features                 # window / varlen / softcap / ALiBi rows

Grid (defaults): D in {64, 128} x causal in {0, 1} x mode in {fwd, bwd, fwd_bwd} x
S in {512, 1k, 2k, 4k, 8k, 16k}.

Workloads:
  tokens (default) B*S = 16384 tokens and H*D = 2048 (FlashAttention's benchmark convention)
  seeds            B = 4, H = 8 for every D and S (the fixed workload of the seed write-ups)
  all              both, as two row sets
`--batch` / `--heads` override B / H for every config.

Providers (columns):
  flash_cuda        flash_cuda.attention(kernel="auto")
  flash_cuda_simt   the fp32 CUDA-core tier (default only for fp32)
  flash_cuda_mma    the fp16/bf16 tensor-core tier (default only for fp16/bf16)
  flash_cuda_det    kernel="auto", deterministic=True (not in the default set)
  flash_cuda_ws     the warp-specialized Hopper forward alone (extension tier 4; forward only,
                    sm_90, not in the default set). kernel="auto" runs it too where it applies;
                    a build with FLASH_CUDA_ABLATIONS=1 reads its ablation switches
                    (csrc/tiers/wgmma/config.h), e.g. FLASH_CUDA_WS_SCHEDULE=serial,
                    FLASH_CUDA_WS_PERSISTENT=0
  sdpa              torch.nn.functional.scaled_dot_product_attention, no backend forced
  sdpa_flash / sdpa_cudnn / sdpa_efficient / sdpa_math
                    SDPA forced to one backend with torch.nn.attention.sdpa_kernel
  naive             q @ k^T * scale -> masked softmax -> @ v in the input dtype

Method:
  * Inputs are fresh torch.randn tensors in (B, H, S, D) layout; scale = 1/sqrt(D).
  * Before timing, every provider is checked once per config against SDPA's math backend in
    float32 on a slice (last batch, first and last head); outputs, and for bwd / fwd_bwd
    also dq, dk, dv, must be within a relative L2 error that suits the dtype, otherwise the
    cell says WRONG and no speed is reported.
  * fwd is timed as inference (inputs without requires_grad); bwd is timed alone as
    out.backward(dout, retain_graph=True) with the forward outside the timed region;
    fwd_bwd times forward + backward. Gradients are reset to None between repeats.
  * Timing: triton.testing.do_bench(return_mode="median") when triton is importable (it
    zeroes a 256 MB buffer between repeats, flushing the 60 MB L2), else an equivalent loop of
    CUDA events with the same L2 flush. Median of the repeats.
  * TFLOPS: fwd = 4*B*H*S*S*D (halved when causal), bwd = 2.5x, fwd_bwd = 3.5x.
  * peak_gib: torch.cuda.max_memory_allocated() during one call minus the memory allocated
    just before it (the L2-flush buffer is not counted).
  * naive and sdpa_math materialise S x S scores; a config whose estimated footprint passes
    --max-quadratic-gib (default 40) is reported as "skipped: O(S^2) memory".

Outputs (default folder bench/results/<dtype>/): results.csv (the columns of
shared/anchors/h200_sdpa_*.csv plus status), results.md (header + table) and
plots/<workload>_D<D>_causal<0|1>_<mode>.png (TFLOPS vs S, one line per provider).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------------------
# Grid definitions
# ----------------------------------------------------------------------------------------

DEFAULT_D = [64, 128]
DEFAULT_CAUSAL = [0, 1]
MODES = ["fwd", "bwd", "fwd_bwd"]
DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
QUICK_SEQLENS = [1024, 4096, 16384]
TOKENS = 16384  # B * S for the "tokens" workload
HIDDEN = 2048  # H * D for the "tokens" workload
SEEDS_B, SEEDS_H = 4, 8  # the seeds' fixed workload

# Backward costs 2.5 forwards (FlashAttention's benchmark convention).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}

FLASH_PROVIDERS = ["flash_cuda", "flash_cuda_simt", "flash_cuda_mma", "flash_cuda_det", "flash_cuda_ws"]
SDPA_PROVIDERS = ["sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math"]
ALL_PROVIDERS = FLASH_PROVIDERS + SDPA_PROVIDERS + ["naive"]
# flash_cuda.attention(kernel=...) per provider.
FLASH_KERNEL = {"flash_cuda": "auto", "flash_cuda_simt": "simt", "flash_cuda_mma": "mma",
                "flash_cuda_det": "auto", "flash_cuda_ws": None}
WS_TIER = 4  # the extension's tier number of the warp-specialized forward (csrc/include/params.h)
# Providers whose memory grows with S^2 (they materialise the score matrix).
QUADRATIC_PROVIDERS = {"naive", "sdpa_math"}
# Short labels for the ratio columns of the table.
RATIO_LABEL = {"sdpa": "sdpa", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn",
               "sdpa_efficient": "eff", "sdpa_math": "math"}

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
DTYPE_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPE_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}
# Relative L2 error allowed against the float32 reference: (output, gradients).
TOLERANCE = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (1e-2, 2e-2),
             torch.float32: (2e-3, 5e-3)}

CSV_COLUMNS = ["provider", "dtype", "D", "causal", "S", "B", "H", "mode", "ms", "tflops",
               "peak_gib", "status"]


@dataclass(frozen=True)
class Config:
    """One benchmark point (everything except the provider and dtype)."""
    workload: str
    D: int
    causal: bool
    mode: str
    S: int
    B: int
    H: int

    def label(self) -> str:
        return (f"D={self.D} causal={int(self.causal)} {self.mode} S={self.S} "
                f"B={self.B} H={self.H}")


@dataclass
class Result:
    ms: float | None = None
    tflops: float | None = None
    peak_gib: float | None = None
    status: str = "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ----------------------------------------------------------------------------------------
# Pure helpers (no GPU needed; unit-tested on CPU)
# ----------------------------------------------------------------------------------------

def attention_flops(B: int, H: int, S_q: int, S_k: int, D: int, causal: bool,
                    mode: str = "fwd") -> float:
    """FLOPs of one attention call: 4*B*H*S_q*S_k*D for the forward (two matmuls of
    2*S_q*S_k*D each), halved when causal; bwd = 2.5x and fwd_bwd = 3.5x the forward."""
    if mode not in MODE_FLOP_FACTOR:
        raise ValueError(f"unknown mode {mode!r}")
    flops = 4.0 * B * H * S_q * S_k * D
    if causal:
        flops /= 2.0
    return flops * MODE_FLOP_FACTOR[mode]


def tflops_from_ms(flops: float, ms: float) -> float:
    """Throughput in TFLOPS of `flops` done in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


def parse_seqlen(text: str) -> int:
    """'4096' -> 4096, '4k' -> 4096, '16K' -> 16384."""
    t = str(text).strip().lower()
    if t.endswith("k"):
        return int(float(t[:-1]) * 1024)
    return int(t)


def fmt_seqlen(s: int) -> str:
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def workload_shape(workload: str, S: int, D: int, batch: int | None = None,
                   heads: int | None = None) -> tuple[int, int]:
    """(B, H) of a config: tokens -> B*S = 16384, H*D = 2048; seeds -> B=4, H=8."""
    if workload == "tokens":
        B, H = max(1, TOKENS // S), max(1, HIDDEN // D)
    elif workload == "seeds":
        B, H = SEEDS_B, SEEDS_H
    else:
        raise ValueError(f"unknown workload {workload!r}")
    return (batch or B), (heads or H)


def build_grid(d_list, causal_list, mode_list, seqlens, workloads, batch=None, heads=None):
    """Every Config of the run, in output order."""
    grid = []
    for wl in workloads:
        for D in d_list:
            for causal in causal_list:
                for mode in mode_list:
                    for S in seqlens:
                        B, H = workload_shape(wl, S, D, batch, heads)
                        grid.append(Config(wl, D, bool(causal), mode, S, B, H))
    return grid


def default_providers(dtype: torch.dtype) -> list[str]:
    """Providers measured when --providers is not given: the flash_cuda tier that the dtype
    allows, every SDPA backend (those that cannot run say so) and naive."""
    tier = "flash_cuda_simt" if dtype == torch.float32 else "flash_cuda_mma"
    return ["flash_cuda", tier] + SDPA_PROVIDERS + ["naive"]


def quadratic_mem_gib(provider: str, B: int, H: int, S: int, dtype: torch.dtype,
                      mode: str) -> float:
    """Rough peak memory of the providers that materialise B*H*S*S scores. SDPA's math
    backend computes in float32 even for bf16/fp16 inputs (measured on the H200: bf16 and
    fp32 peaks are equal); naive keeps the input dtype. About 2.4 score-sized buffers live at
    once in the forward, 4.2 in the backward (calibrated on shared/anchors)."""
    if provider not in QUADRATIC_PROVIDERS:
        return 0.0
    elem = 4 if provider == "sdpa_math" else DTYPE_BYTES[dtype]
    factor = 2.4 if mode == "fwd" else 4.2
    return factor * B * H * S * S * elem / 2**30


# Rough throughput guesses (TFLOPS) used only by --dry-run's time estimate.
_GUESS_TFLOPS_LOWP = {"flash_cuda": 250, "flash_cuda_mma": 250, "flash_cuda_det": 200, "flash_cuda_ws": 300,
                      "sdpa": 420, "sdpa_flash": 280, "sdpa_cudnn": 420, "sdpa_efficient": 120,
                      "sdpa_math": 20, "naive": 25}
_GUESS_TFLOPS_FP32 = {"flash_cuda": 20, "flash_cuda_simt": 20, "flash_cuda_det": 18,
                      "sdpa": 35, "sdpa_efficient": 35, "sdpa_math": 18, "naive": 25}


def estimate_task_seconds(cfg: Config, provider: str, dtype: torch.dtype, warmup_ms: float,
                          rep_ms: float, max_quadratic_gib: float) -> float:
    """Very rough wall time of one (config, provider) cell, for --dry-run. Model of
    do_bench: 5 estimation calls, then max(1, warmup/t) + max(1, rep/t) calls, each repeat
    preceded by a ~0.1 ms L2 flush; plus the check call(s) and one memory call."""
    if quadratic_mem_gib(provider, cfg.B, cfg.H, cfg.S, dtype, cfg.mode) > max_quadratic_gib:
        return 0.0
    table = _GUESS_TFLOPS_FP32 if dtype == torch.float32 else _GUESS_TFLOPS_LOWP
    if provider not in table:  # cannot run this dtype: fails fast
        return 0.05
    flops = attention_flops(cfg.B, cfg.H, cfg.S, cfg.S, cfg.D, cfg.causal, cfg.mode)
    t_ms = flops / (table[provider] * 1e12) * 1e3 + 0.02
    n_warm = max(1, int(warmup_ms / t_ms))
    n_rep = max(1, int(rep_ms / t_ms))
    calls = 5 + n_warm + n_rep + 3
    return (calls * t_ms + (n_warm + n_rep + 5) * 0.12) / 1e3 + 0.03


def short_text(text: str, width: int = 90) -> str:
    """First non-empty line of `text`, cut to `width` characters."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def status_tag(status: str) -> str:
    """Short table cell for a non-ok status."""
    for prefix, tag in (("WRONG", "WRONG"), ("OOM", "OOM"), ("unsupported", "n/s"),
                        ("unavailable", "n/a"), ("skipped", "skip"), ("error", "err")):
        if status.startswith(prefix):
            return tag
    return "?"


# ----------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------

def git_commit() -> str:
    """Commit of the flash_cuda checkout this script lives in (+ '-dirty'), or 'unknown'."""
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown (no commit)"
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"


_FLASH_CUDA = None
_FLASH_CUDA_ERROR = None


def load_flash_cuda():
    """Import flash_cuda once; raise RuntimeError('unavailable: ...') if it cannot run."""
    global _FLASH_CUDA, _FLASH_CUDA_ERROR
    if _FLASH_CUDA is None and _FLASH_CUDA_ERROR is None:
        try:
            import flash_cuda  # noqa: WPS433 (imported at run time on purpose)
            available = getattr(flash_cuda, "is_available", lambda: True)()
            if not available:
                _FLASH_CUDA_ERROR = "unavailable: flash_cuda.is_available() is False"
            else:
                _FLASH_CUDA = flash_cuda
        except Exception as exc:  # ImportError, missing extension, ...
            _FLASH_CUDA_ERROR = f"unavailable: {type(exc).__name__}: {short_text(exc, 70)}"
    if _FLASH_CUDA is None:
        raise _Unavailable(_FLASH_CUDA_ERROR)
    return _FLASH_CUDA


class _Unavailable(Exception):
    """The provider cannot be used at all (its status text is the message)."""


def environment_lines(timer_name: str, dry_run: bool = False) -> list[str]:
    lines = [f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"host: {platform.node()}  python {platform.python_version()}"]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(f"GPU: {props.name}, {props.multi_processor_count} SMs, "
                     f"{props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}")
    else:
        lines.append("GPU: none (CUDA not available)")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {cudnn}, "
                 f"tf32 matmul {torch.backends.cuda.matmul.allow_tf32}")
    fc_version = "not imported (dry run)" if dry_run else "not importable"
    if not dry_run:
        try:
            fc = load_flash_cuda()
            fc_version = getattr(fc, "__version__", "?")
        except _Unavailable as exc:
            fc_version = str(exc)
    lines.append(f"flash_cuda {fc_version}, git commit {git_commit()}")
    lines.append(f"timer: {timer_name}")
    return lines


# ----------------------------------------------------------------------------------------
# Providers
# ----------------------------------------------------------------------------------------

def naive_attention(q, k, v, causal: bool, scale: float, mask=None):
    """Textbook attention in the input dtype: scores = q @ k^T * scale, masked softmax, @ v.
    `mask` (bool, True = hidden) is the bottom-right causal mask, built outside the timed
    region by causal_mask()."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        scores.masked_fill_(mask, float("-inf"))  # in place: saves one S x S buffer
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)


def causal_mask(S_q: int, S_k: int, device) -> torch.Tensor:
    """True where query i may NOT see key j (j > i + S_k - S_q: bottom-right aligned)."""
    return torch.ones(S_q, S_k, dtype=torch.bool, device=device).triu_(S_k - S_q + 1)


def sdpa_backend_context(provider: str):
    """sdpa_kernel(<backend>) for the forced-backend providers, a no-op otherwise."""
    if provider not in SDPA_PROVIDERS or provider == "sdpa":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_math": SDPBackend.MATH}[provider]
    return sdpa_kernel(backend)


def make_forward(provider: str, causal: bool, S_q: int, S_k: int, D: int, device):
    """A function (q, k, v) -> out for `provider`; the default scale 1/sqrt(D) everywhere."""
    if provider == "flash_cuda_ws":
        ext = load_flash_cuda()._ext.require()
        scale = 1.0 / math.sqrt(D)

        def ws_forward(q, k, v):
            if q.requires_grad:
                raise NotImplementedError("flash_cuda_ws is forward only (not supported in bwd modes)")
            return ext.fwd(q, k, v, scale, -1, 0 if causal else -1, 0.0, None, None, None, 0, 0, WS_TIER)[0]
        return ws_forward
    if provider in FLASH_PROVIDERS:
        fc = load_flash_cuda()
        kernel = FLASH_KERNEL[provider]
        deterministic = provider == "flash_cuda_det"
        return lambda q, k, v: fc.attention(q, k, v, is_causal=causal, kernel=kernel,
                                            deterministic=deterministic)
    if provider in SDPA_PROVIDERS:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if provider == "naive":
        scale = 1.0 / math.sqrt(D)
        mask = causal_mask(S_q, S_k, device) if causal else None
        return lambda q, k, v: naive_attention(q, k, v, causal, scale, mask)
    raise ValueError(f"unknown provider {provider!r}")


def classify_error(exc: BaseException, caught_warnings) -> str:
    """Status text of a provider that raised."""
    msg = str(exc)
    if isinstance(exc, _Unavailable):
        return msg
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in msg.lower():
        return "OOM"
    if isinstance(exc, (NotImplementedError, ValueError)) or any(
            word in msg.lower() for word in ("not supported", "unsupported", "only supports")):
        return "unsupported: " + short_text(msg, 80)
    if "No available kernel" in msg or "No viable backend" in msg:
        # SDPA explains in warnings why each backend refused; keep the first concrete reason.
        reasons = [short_text(w.message, 80) for w in caught_warnings]
        reasons = [r for r in reasons if r and not r.endswith("because:")
                   and "runtime disabled" not in r]
        return "unsupported: " + (reasons[0] if reasons else "no SDPA kernel for this input")
    return f"error: {type(exc).__name__}: {short_text(msg, 80)}"


# ----------------------------------------------------------------------------------------
# Correctness check
# ----------------------------------------------------------------------------------------

@dataclass
class Reference:
    head_idx: torch.Tensor  # heads of the checked slice
    out: torch.Tensor
    grads: tuple  # dq, dk, dv (float32, same slice)


def take_slice(t: torch.Tensor, head_idx: torch.Tensor) -> torch.Tensor:
    """The checked slice: last batch element, heads head_idx, as float32."""
    return t.detach()[-1:].index_select(1, head_idx).float()


def compute_reference(q, k, v, dout, causal: bool) -> Reference:
    """SDPA's math backend in float32 (TF32 off) on the last batch element and the first
    and last heads: cheap at any S, and it catches batch/head offset bugs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    H = q.shape[1]
    head_idx = torch.tensor(sorted({0, H - 1}), device=q.device)
    qs, ks, vs = (take_slice(t.detach(), head_idx).requires_grad_() for t in (q, k, v))
    dos = take_slice(dout, head_idx)
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with sdpa_kernel(SDPBackend.MATH), torch.enable_grad():
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
            grads = torch.autograd.grad(out, (qs, ks, vs), dos)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    return Reference(head_idx, out.detach(), tuple(g.detach() for g in grads))


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (inf when x has NaN/Inf)."""
    if not torch.isfinite(x).all():
        return float("inf")
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def check_provider(fwd, q, k, v, dout, ref: Reference, need_grad: bool,
                   dtype: torch.dtype) -> str:
    """Run the provider once and compare with the reference: 'ok' or 'WRONG (...)'."""
    tol_out, tol_grad = TOLERANCE[dtype]
    out = fwd(q, k, v)
    if tuple(out.shape) != tuple(q.shape):
        return f"WRONG (output shape {tuple(out.shape)})"
    errors = [("out", relative_error(take_slice(out, ref.head_idx), ref.out), tol_out)]
    if need_grad:
        out.backward(dout)
        for name, t, g in zip(("dq", "dk", "dv"), (q, k, v), ref.grads):
            if t.grad is None:
                return f"WRONG ({name} is None)"
            errors.append((name, relative_error(take_slice(t.grad, ref.head_idx), g), tol_grad))
        for t in (q, k, v):
            t.grad = None
    for name, err, tol in errors:
        if not err <= tol:  # also catches NaN
            return f"WRONG ({name} rel err {err:.3g} > {tol:g})"
    return "ok"


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------

class EventTimer:
    """Median of CUDA-event timings; a 256 MB buffer is zeroed before each repeat (outside
    the timed region) so that every repeat starts with a cold 60 MB L2."""

    name = "cuda events (own loop), median, L2 flushed"

    def __init__(self, warmup_ms: float, rep_ms: float):
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

    def __call__(self, fn, grad_to_none=None) -> float:
        def reset():
            for t in grad_to_none or ():
                t.grad = None

        reset()
        fn()
        torch.cuda.synchronize()
        # Estimate the time of one call from 3 calls.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            reset()
            fn()
        end.record()
        torch.cuda.synchronize()
        est_ms = max(start.elapsed_time(end) / 3, 1e-3)
        n_warm = max(1, int(self.warmup_ms / est_ms))
        n_rep = min(1000, max(3, int(self.rep_ms / est_ms)))
        for _ in range(n_warm):
            reset()
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
        for i in range(n_rep):
            reset()
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


class TritonTimer:
    """triton.testing.do_bench, median (it flushes L2 between repeats by itself)."""

    def __init__(self, warmup_ms: float, rep_ms: float):
        from triton.testing import do_bench  # noqa: WPS433
        import triton
        self.do_bench = do_bench
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.name = f"triton {triton.__version__} do_bench, median, L2 flushed"

    def __call__(self, fn, grad_to_none=None) -> float:
        try:
            return float(self.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                       grad_to_none=grad_to_none, return_mode="median"))
        except TypeError:  # older triton: no return_mode
            return float(self.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                       grad_to_none=grad_to_none, quantiles=[0.5]))


def make_timer(kind: str, warmup_ms: float, rep_ms: float):
    if kind in ("auto", "triton"):
        try:
            return TritonTimer(warmup_ms, rep_ms)
        except ImportError:
            if kind == "triton":
                raise
    return EventTimer(warmup_ms, rep_ms)


def time_call(fwd, q, k, v, dout, mode: str, timer) -> tuple[float, float]:
    """(median ms, peak_gib) of fwd(q, k, v) -> out in `mode`: fwd as inference; bwd alone as
    out.backward(dout, retain_graph=True) after one forward outside the timed region; fwd_bwd
    both. For bwd modes q, k, v must be leaves that require grad; their grads are reset."""
    grads = (q, k, v) if mode != "fwd" else ()
    if mode == "fwd":
        def fn():
            return fwd(q, k, v)
    elif mode == "fwd_bwd":
        def fn():
            fwd(q, k, v).backward(dout)
    else:
        out = fwd(q, k, v)

        def fn():
            out.backward(dout, retain_graph=True)
    peak = measure_peak_gib(fn, grads)
    ms = timer(fn, grad_to_none=list(grads) or None)
    for t in grads:
        t.grad = None
    return ms, peak


def measure_peak_gib(fn, grad_tensors) -> float:
    """Extra memory allocated at the peak of one call of fn, in GiB."""
    for t in grad_tensors:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for t in grad_tensors:
        t.grad = None
    return max(peak, 0) / 2**30


# ----------------------------------------------------------------------------------------
# One (config, provider) cell
# ----------------------------------------------------------------------------------------

def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def run_cell(cfg: Config, provider: str, dtype: torch.dtype, inputs, ref: Reference | None,
             timer, args, check_cache: dict) -> Result:
    """Check, measure memory and time one provider on one config; never raises."""
    est = quadratic_mem_gib(provider, cfg.B, cfg.H, cfg.S, dtype, cfg.mode)
    if est > args.max_quadratic_gib:
        return Result(status=f"skipped: O(S^2) memory (~{est:.0f} GiB)")
    q0, k0, v0, dout = inputs
    need_grad = cfg.mode != "fwd"
    if need_grad:  # new leaf tensors sharing the same storage
        q, k, v = (t.detach().requires_grad_() for t in (q0, k0, v0))
    else:
        q, k, v = q0, k0, v0
    grads = (q, k, v) if need_grad else ()
    status = "ok"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_backend_context(provider):
                fwd = make_forward(provider, cfg.causal, cfg.S, cfg.S, cfg.D, q.device)
                key = (provider, cfg.causal, need_grad)
                if ref is not None and key not in check_cache:
                    check_cache[key] = check_provider(fwd, q, k, v, dout, ref, need_grad, dtype)
                status = check_cache.get(key, "ok")
                if status != "ok":
                    return Result(status=status)
                ms, peak = time_call(fwd, q, k, v, dout, cfg.mode, timer)
        except Exception as exc:  # noqa: BLE001 -- every failure becomes a status
            status = classify_error(exc, caught)
            # A traceback keeps the frame (and its tensors) alive: drop it before freeing.
            exc = None  # noqa: F841
    for t in grads:
        t.grad = None
    if status != "ok":
        free_memory()
        return Result(status=status)
    if provider in QUADRATIC_PROVIDERS:
        free_memory()  # give the S^2 buffers back to the other providers
    flops = attention_flops(cfg.B, cfg.H, cfg.S, cfg.S, cfg.D, cfg.causal, cfg.mode)
    return Result(ms=ms, tflops=tflops_from_ms(flops, ms), peak_gib=peak, status="ok")


# ----------------------------------------------------------------------------------------
# Progress bar
# ----------------------------------------------------------------------------------------

class Progress:
    """tqdm when importable, else a one-line bar on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.t0 = time.time()
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm  # noqa: WPS433
                self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True,
                                smoothing=0.05)
            except ImportError:
                pass

    def step(self, desc: str):
        self.done += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description_str(desc[:60])
            self.bar.update(1)
            return
        frac = self.done / max(self.total, 1)
        width = 30
        elapsed = time.time() - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        sys.stderr.write(f"\r[{'#' * int(frac * width):<{width}}] {self.done}/{self.total} "
                         f"{elapsed:5.0f}s eta {eta:4.0f}s  {desc[:50]:<50}")
        sys.stderr.flush()

    def write(self, msg: str):
        if self.bar is not None:
            self.bar.write(msg, file=sys.stderr)
        else:
            sys.stderr.write(("\n" if self.enabled else "") + msg + "\n")

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            sys.stderr.write("\n")


# ----------------------------------------------------------------------------------------
# Output: table, CSV, plots, anchors
# ----------------------------------------------------------------------------------------

def markdown_table(grid, providers, results) -> list[str]:
    """One row per config: TFLOPS per provider, then flash_cuda's ratio to each SDPA
    provider in the run. Non-ok cells show a short tag; the reasons follow the table."""
    num = next((p for p in FLASH_PROVIDERS if p in providers), None)
    ratio_to = [p for p in SDPA_PROVIDERS if p in providers] if num else []
    show_wl = len({cfg.workload for cfg in grid}) > 1
    head = (["workload"] if show_wl else []) + ["D", "causal", "mode", "S", "B", "H"] + providers
    head += [f"{'fc' if num == 'flash_cuda' else num}/{RATIO_LABEL[p]}" for p in ratio_to]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---:" for _ in head) + "|"]
    notes = {}
    for cfg in grid:
        cells = ([cfg.workload] if show_wl else []) + [
            str(cfg.D), str(int(cfg.causal)), cfg.mode, fmt_seqlen(cfg.S), str(cfg.B),
            str(cfg.H)]
        for p in providers:
            r = results.get((cfg, p))
            if r is None:
                cells.append("")
            elif r.ok:
                cells.append(f"{r.tflops:.1f}")
            else:
                cells.append(status_tag(r.status))
                notes.setdefault((p, r.status), []).append(cfg)
        for p in ratio_to:
            a, b = results.get((cfg, num)), results.get((cfg, p))
            cells.append(f"{a.tflops / b.tflops:.2f}" if a and b and a.ok and b.ok else "")
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines.append("")
        lines.append("Cells without a number (n/s = unsupported, skip, OOM, WRONG, err, "
                     "n/a = unavailable):")
        for (p, status), cfgs in notes.items():
            lines.append(f"- {p}: {status} ({len(cfgs)} config{'s' if len(cfgs) > 1 else ''})")
    return lines


def csv_rows(grid, providers, results, dtype: torch.dtype):
    dname = str(dtype).replace("torch.", "")
    for cfg in grid:
        for p in providers:
            r = results.get((cfg, p))
            if r is None:
                continue
            yield {"provider": p, "dtype": dname, "D": cfg.D, "causal": int(cfg.causal),
                   "S": cfg.S, "B": cfg.B, "H": cfg.H, "mode": cfg.mode,
                   "ms": f"{r.ms:.4f}" if r.ok else "",
                   "tflops": f"{r.tflops:.1f}" if r.ok else "",
                   "peak_gib": f"{r.peak_gib:.3f}" if r.ok else "",
                   "status": r.status}


def write_csv(path: Path, rows, columns=CSV_COLUMNS) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)


def write_plots(grid, providers, results, out_dir: Path, dtype: torch.dtype) -> list[Path]:
    """TFLOPS vs S, one PNG per (workload, D, causal, mode), one line per provider."""
    try:
        import matplotlib  # noqa: WPS433
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: WPS433
    except ImportError:
        print("(matplotlib not importable: no plots)")
        return []
    plot_dir = out_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)
    groups = {}
    for cfg in grid:
        groups.setdefault((cfg.workload, cfg.D, cfg.causal, cfg.mode), []).append(cfg)
    written = []
    for (wl, D, causal, mode), cfgs in groups.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        seqlens = sorted({c.S for c in cfgs})
        for p in providers:
            pts = [(c.S, results[(c, p)].tflops) for c in cfgs
                   if (c, p) in results and results[(c, p)].ok]
            if not pts:
                continue
            pts.sort()
            flash = p.startswith("flash_cuda")
            ax.plot([s for s, _ in pts], [t for _, t in pts], marker="o",
                    linewidth=2.4 if flash else 1.3, linestyle="-" if flash else "--",
                    label=p)
        if all(c.B * c.S == TOKENS and c.H * c.D == HIDDEN for c in cfgs):
            shape = f"B*S={TOKENS}, H*D={HIDDEN}"
        elif len({(c.B, c.H) for c in cfgs}) == 1:
            shape = f"B={cfgs[0].B}, H={cfgs[0].H}"
        else:
            shape = "B, H vary"
        ax.set_title(f"{DTYPE_SHORT[dtype]}, D={D}, causal={causal}, {mode} ({shape})")
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens)
        ax.set_xticklabels([fmt_seqlen(s) for s in seqlens])
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("TFLOPS")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
        path = plot_dir / f"{wl}_D{D}_causal{int(causal)}_{mode}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def find_anchor_dir(explicit: str | None) -> Path | None:
    candidates = [Path(explicit)] if explicit and explicit != "auto" else []
    candidates += [REPO_ROOT / "shared" / "anchors", REPO_ROOT.parent / "shared" / "anchors"]
    for c in candidates:
        if c.is_dir() and any(c.glob("*.csv")):
            return c
    return None


def load_anchors(anchor_dir: Path) -> dict:
    """(provider, dtype, D, causal, S, B, H, mode) -> tflops from every CSV of the folder."""
    table = {}
    for path in sorted(anchor_dir.glob("*.csv")):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                try:
                    key = (row["provider"], row["dtype"], int(row["D"]), int(row["causal"]),
                           int(row["S"]), int(row["B"]), int(row["H"]), row["mode"])
                    table[key] = float(row["tflops"])
                except (KeyError, ValueError):
                    continue
    return table


def anchor_comparison(grid, providers, results, dtype, anchor_dir: Path) -> list[str]:
    """Our TFLOPS next to the anchors' (sdpa <-> sdpa_default); flash_cuda rows also get
    the best anchored SDPA backend at that config."""
    anchors = load_anchors(anchor_dir)
    dname = str(dtype).replace("torch.", "")
    lines = [f"Anchors from {anchor_dir} (ours / anchor TFLOPS):", "",
             "| D | causal | mode | S | provider | ours | anchor | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    n = 0
    for cfg in grid:
        base = (dname, cfg.D, int(cfg.causal), cfg.S, cfg.B, cfg.H, cfg.mode)
        for p in providers:
            r = results.get((cfg, p))
            if r is None or not r.ok:
                continue
            if p in FLASH_PROVIDERS:
                best = max(((t, a) for (a, *rest), t in anchors.items()
                            if tuple(rest) == base), default=None)
                if best is None:
                    continue
                name, anchor = f"{p} vs {best[1]}", best[0]
            else:
                key = ("sdpa_default" if p == "sdpa" else p,) + base
                if key not in anchors:
                    continue
                name, anchor = p, anchors[key]
            lines.append(f"| {cfg.D} | {int(cfg.causal)} | {cfg.mode} | {fmt_seqlen(cfg.S)} | "
                         f"{name} | {r.tflops:.1f} | {anchor:.1f} | {r.tflops / anchor:.2f} |")
            n += 1
    if n == 0:
        lines.append("| (no config of this run is in the anchors) |||||||")
    return lines


# ----------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python bench/run.py",
        description="Benchmark flash_cuda against PyTorch SDPA backends and naive attention "
                    "(TFLOPS, median of CUDA-event timings, L2 flushed).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: python bench/run.py --quick\n"
               "         python bench/run.py --d 128 --causal 0 --mode fwd --seqlen 4k 16k "
               "--providers flash_cuda sdpa_cudnn")
    p.add_argument("--d", type=int, nargs="+", default=None, metavar="D",
                   help=f"head dims (default {DEFAULT_D})")
    p.add_argument("--causal", type=int, nargs="+", choices=[0, 1], default=None,
                   help="0 and/or 1 (default both)")
    p.add_argument("--mode", nargs="+", choices=MODES, default=None,
                   help="fwd, bwd, fwd_bwd (default all)")
    p.add_argument("--seqlen", nargs="+", default=None, metavar="S",
                   help="sequence lengths, e.g. 4096 or 4k (default 512 1k 2k 4k 8k 16k)")
    p.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPES),
                   help="bf16 (default), fp16, fp32; several -> one results folder each")
    p.add_argument("--providers", nargs="+", default=None, choices=ALL_PROVIDERS,
                   metavar="P", help="subset of: " + ", ".join(ALL_PROVIDERS)
                   + " (default: flash_cuda, the tier the dtype allows, every sdpa*, naive)")
    p.add_argument("--workload", choices=["tokens", "seeds", "all"], default="tokens",
                   help="tokens: B*S=16384, H*D=2048 (default); seeds: B=4, H=8; all: both")
    p.add_argument("--batch", type=int, default=None, help="force B for every config")
    p.add_argument("--heads", type=int, default=None, help="force H for every config")
    p.add_argument("--quick", action="store_true",
                   help="S in {1k, 4k, 16k} and shorter timing (about a minute)")
    p.add_argument("--warmup-ms", type=float, default=None,
                   help="do_bench warm-up budget per cell in ms (default 25, quick 10)")
    p.add_argument("--rep-ms", type=float, default=None,
                   help="do_bench timing budget per cell in ms (default 100, quick 30)")
    p.add_argument("--timer", choices=["auto", "triton", "events"], default="auto",
                   help="auto: triton.testing.do_bench if importable, else own CUDA-event loop")
    p.add_argument("--max-quadratic-gib", type=float, default=40.0,
                   help="skip naive / sdpa_math when their S^2 buffers would exceed this")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--out", default=None,
                   help="results folder (default bench/results/<dtype>; with several dtypes "
                        "OUT/<dtype>)")
    p.add_argument("--compare-anchors", nargs="?", const="auto", default=None, metavar="DIR",
                   help="print our numbers next to the anchor CSVs (default: shared/anchors "
                        "under the repo root)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the inputs")
    p.add_argument("--features", action="store_true",
                   help="benchmark the attention features instead of the grid: sliding window, "
                        "varlen (packed) batches, softcap, ALiBi, each next to the plain call "
                        "(bench/features.py; --d, --causal, --mode narrow it)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the configs, providers and a rough time estimate; run nothing")
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens = [parse_seqlen(s) for s in args.seqlen] if args.seqlen else QUICK_SEQLENS
        args.warmup_ms = 10.0 if args.warmup_ms is None else args.warmup_ms
        args.rep_ms = 30.0 if args.rep_ms is None else args.rep_ms
    else:
        args.seqlens = [parse_seqlen(s) for s in args.seqlen] if args.seqlen else DEFAULT_SEQLENS
        args.warmup_ms = 25.0 if args.warmup_ms is None else args.warmup_ms
        args.rep_ms = 100.0 if args.rep_ms is None else args.rep_ms
    args.d = args.d or DEFAULT_D
    args.causal = args.causal if args.causal is not None else DEFAULT_CAUSAL
    args.mode = args.mode or (["fwd", "bwd"] if args.features else MODES)
    args.workloads = ["tokens", "seeds"] if args.workload == "all" else [args.workload]
    for D in args.d:
        if D % 8 or not 8 <= D <= 256:
            p.error(f"--d {D}: head dims must be multiples of 8 in [8, 256]")
    return args


def make_inputs(B, H, S, D, dtype, seed, device="cuda"):
    """Fresh random q, k, v, dout (B, H, S, D) on the GPU."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, device=device, dtype=dtype, generator=gen)
                 for _ in range(4))


def run_dtype(args, dtype: torch.dtype, timer, header: list[str]) -> None:
    providers = args.providers or default_providers(dtype)
    grid = build_grid(args.d, args.causal, args.mode, args.seqlens, args.workloads,
                      args.batch, args.heads)
    results: dict = {}
    progress = Progress(len(grid) * len(providers), enabled=not args.no_progress)
    t0 = time.time()
    # Inputs are shared by every causal flag and mode of one (workload, D, S).
    groups = {}
    for cfg in grid:
        groups.setdefault((cfg.workload, cfg.D, cfg.S, cfg.B, cfg.H), []).append(cfg)
    for (wl, D, S, B, H), cfgs in groups.items():
        try:
            inputs = make_inputs(B, H, S, D, dtype, args.seed + S + D)
        except torch.cuda.OutOfMemoryError:
            for cfg in cfgs:
                for p in providers:
                    results[(cfg, p)] = Result(status="OOM (inputs)")
                    progress.step(cfg.label())
            free_memory()
            continue
        refs, check_caches = {}, {}
        for cfg in cfgs:
            if not args.no_check and cfg.causal not in refs:
                try:
                    refs[cfg.causal] = compute_reference(*inputs, causal=cfg.causal)
                except torch.cuda.OutOfMemoryError:
                    refs[cfg.causal] = None
                    progress.write(f"warning: no memory for the reference of {cfg.label()}; "
                                   "its cells are not checked")
                    free_memory()
            cache = check_caches.setdefault(cfg.causal, {})
            for p in providers:
                progress.step(f"{cfg.label()} {p}")
                results[(cfg, p)] = run_cell(cfg, p, dtype, inputs, refs.get(cfg.causal),
                                             timer, args, cache)
        del inputs, refs
        free_memory()
    progress.close()
    elapsed = time.time() - t0

    # ---- report ----
    out_dir = Path(args.out_dirs[dtype])
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(grid, providers, results)
    title = (f"## flash_cuda benchmark, {DTYPE_SHORT[dtype]}, workload {args.workload}, "
             f"{len(grid)} configs x {len(providers)} providers ({elapsed:.0f} s)")
    print()
    print(title)
    print()
    print("\n".join(table))
    write_csv(out_dir / "results.csv", csv_rows(grid, providers, results, dtype))
    md = [f"# {title[3:]}", "", "```", *header, "```", "", "TFLOPS (ratios: flash_cuda / "
          "SDPA backend; >1 means flash_cuda is faster)", "", *table]
    if args.compare_anchors:
        anchor_dir = find_anchor_dir(args.compare_anchors)
        if anchor_dir is None:
            print("\n(--compare-anchors: no shared/anchors folder with CSVs found; skipped)")
        else:
            comp = anchor_comparison(grid, providers, results, dtype, anchor_dir)
            print()
            print("\n".join(comp))
            md += ["", *comp]
    (out_dir / "results.md").write_text("\n".join(md) + "\n")
    plots = [] if args.no_plots else write_plots(grid, providers, results, out_dir, dtype)
    print(f"\nwrote {out_dir / 'results.csv'}, {out_dir / 'results.md'}"
          + (f" and {len(plots)} plots in {out_dir / 'plots'}" if plots else ""))


def dry_run(args) -> None:
    """Print the plan and a rough time estimate without touching the GPU."""
    total_tasks, total_s = 0, 0.0
    for name in args.dtype:
        dtype = DTYPES[name]
        providers = args.providers or default_providers(dtype)
        grid = build_grid(args.d, args.causal, args.mode, args.seqlens, args.workloads,
                          args.batch, args.heads)
        secs = sum(estimate_task_seconds(c, p, dtype, args.warmup_ms, args.rep_ms,
                                         args.max_quadratic_gib)
                   for c in grid for p in providers)
        skipped = sum(quadratic_mem_gib(p, c.B, c.H, c.S, dtype, c.mode) > args.max_quadratic_gib
                      for c in grid for p in providers)
        print(f"{DTYPE_SHORT[dtype]}: {len(grid)} configs x {len(providers)} providers = "
              f"{len(grid) * len(providers)} cells ({skipped} skipped for O(S^2) memory)")
        print(f"  providers: {', '.join(providers)}")
        print(f"  D {args.d}, causal {args.causal}, modes {args.mode}, "
              f"S {[fmt_seqlen(s) for s in args.seqlens]}, workloads {args.workloads}")
        print(f"  output: {args.out_dirs[dtype]}")
        print(f"  rough time on an H200: {secs / 60:.1f} min (warmup {args.warmup_ms:g} ms, "
              f"rep {args.rep_ms:g} ms per cell)")
        total_tasks += len(grid) * len(providers)
        total_s += secs
    if len(args.dtype) > 1:
        print(f"total: {total_tasks} cells, rough time {total_s / 60:.1f} min")


def main(argv=None) -> int:
    args = parse_args(argv)
    dtypes = list(dict.fromkeys(DTYPES[d] for d in args.dtype))  # unique, in order
    args.dtype = [DTYPE_SHORT[d] for d in dtypes]
    base = Path(args.out) if args.out else REPO_ROOT / "bench" / "results"
    if args.out and len(dtypes) == 1:
        args.out_dirs = {dtypes[0]: base}
    else:
        args.out_dirs = {d: base / DTYPE_SHORT[d] for d in dtypes}
    if args.features:
        sys.modules.setdefault("run", sys.modules[__name__])  # one copy of this module
        if str(REPO_ROOT / "bench") not in sys.path:
            sys.path.insert(0, str(REPO_ROOT / "bench"))
        import features  # noqa: WPS433 (bench/features.py, next to this script)
        return features.main(args)
    if args.dry_run:
        dry_run(args)
        return 0
    if not torch.cuda.is_available():
        print("bench/run.py needs a CUDA GPU (use --dry-run to see the plan).", file=sys.stderr)
        return 2
    timer = make_timer(args.timer, args.warmup_ms, args.rep_ms)
    header = environment_lines(timer.name)
    print("\n".join(header))
    for dtype in dtypes:
        run_dtype(args, dtype, timer, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
