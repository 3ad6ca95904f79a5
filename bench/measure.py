"""What bench/run.py and bench/features.py measure with: the providers, one measured call
(:class:`Call`), its inputs, the correctness check against flash_cuda.reference, the timing, and
the statuses a failure becomes. FlashAttention-4 (`fa4`, `pip install flash-attn-4`) is optional:
without `flash_attn.cute` its cells are skipped, the reason as their status."""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402 (bench/common.py)

sys.path.append(str(C.REPO_ROOT))  # flash_cuda.reference of this checkout where flash_cuda is not installed

TOKENS, HIDDEN = 16384, 2048  # B * S and H * D of every config unless --batch / --heads (FlashAttention's)
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # a backward = 2.5 forwards
FLASH_KERNEL = {"flash_cuda": "auto", "flash_cuda_simt": "simt", "flash_cuda_mma": "mma", "flash_cuda_det": "auto"}
SDPA_BACKEND = {"sdpa": None, "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_math": "MATH"}
OTHER = {"fa4": "FlashAttention-4"}  # other libraries' providers, on (B, S, H, D) tensors
# flash_cuda's FP8 forward (flash_cuda.fp8.attention_fp8): the inputs rounded to e4m3 once, untimed (descales 1: N(0, 1)
# values sit well inside e4m3's range), the output in bfloat16, the forward only.
FP8 = {"flash_cuda_fp8": "e4m3"}
FP8_TOLERANCE = 6e-2  # relative L2 of out: P rounded to e4m3 (3 mantissa bits) on top of the inputs' rounding
PROVIDERS = [*FLASH_KERNEL, *SDPA_BACKEND, *OTHER, *FP8]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_SHORT = {t: name for name, t in DTYPES.items()}
# Relative L2 error allowed against the float32 reference: (output, gradients).
TOLERANCE = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (1e-2, 2e-2), torch.float32: (2e-3, 5e-3)}
UNSUPPORTED_WORDS = ("not supported", "unsupported", "only supports", "no available kernel", "no viable backend")
STATUS_TAGS = {"WRONG": "WRONG", "OOM": "OOM", "unsupported": "n/s", "unavailable": "n/a", "skipped": "skip",
               "error": "err"}


def attention_flops(B, H, S_q, S_k, D, causal, mode="fwd") -> float:
    """4*B*H*S_q*S_k*D for the forward (two matmuls), halved when causal."""
    return 4.0 * B * H * S_q * S_k * D / (2.0 if causal else 1.0) * MODE_FLOP_FACTOR[mode]


def status_tag(status: str) -> str:
    return next((tag for prefix, tag in STATUS_TAGS.items() if status.startswith(prefix)), "?")


def short_text(text, width: int = 80) -> str:  # the first non-empty line
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


@dataclass(frozen=True)
class Call:
    """One measured call: len(seqlens) sequences, dense (B, H, S, D) or packed (total, H, D)."""
    provider: str
    D: int
    H: int
    causal: bool
    mode: str
    seqlens: tuple
    varlen: bool = False
    window: tuple = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    dropout: float = 0.0
    sinks: bool = False  # attention sinks: sink_logits(H), made where the ALiBi slopes are (make_fn, check)
    groups: int = 1  # query heads per KV head (GQA): k and v get H // groups heads

    @property
    def kv_heads(self) -> int:
        return self.H // self.groups

    def options(self) -> dict:
        """attention()'s options but the tensors alibi_slopes and sinks; defaults left out, so plain calls need no
        feature support."""
        return {"is_causal": self.causal, **({"window_size": self.window} if self.window != (-1, -1) else {}),
                **({"softcap": self.softcap} if self.softcap else {}),
                **({"dropout_p": self.dropout} if self.dropout else {})}


class Unavailable(Exception):
    """flash_cuda cannot run at all; the message is the cell's status."""


def load_flash_cuda():
    try:
        import flash_cuda
    except Exception as exc:  # ImportError, a broken extension, ...
        raise Unavailable(f"unavailable: {type(exc).__name__}: {short_text(exc)}") from None
    if not flash_cuda.is_available():
        raise Unavailable("unavailable: flash_cuda.is_available() is False")
    return flash_cuda


def load_fa4():
    """FlashAttention-4's (flash_attn_func, flash_attn_varlen_func); Unavailable, a skipped status, without them."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as exc:  # not installed, or its runtime does not load
        raise Unavailable(f"skipped: flash_attn.cute is not importable ({type(exc).__name__}: {short_text(exc)}; "
                          "pip install flash-attn-4)") from None
    return flash_attn_func, flash_attn_varlen_func


def missing(provider: str) -> str | None:
    """The status of every cell of a provider that cannot run here (FA4 not importable), else None."""
    if provider in OTHER:
        try:
            load_fa4()
        except Unavailable as exc:
            return str(exc)
    return None


def fa4_version() -> str:
    """flash-attn-4's version, or why the fa4 cells are skipped."""
    import importlib.metadata
    try:
        return missing("fa4") or f"flash-attn-4 {importlib.metadata.version('flash-attn-4')}"
    except importlib.metadata.PackageNotFoundError:
        return "flash_attn.cute importable (no flash-attn-4 package metadata)"


def bshd(call: Call) -> bool:
    """Whether the provider takes dense (B, S, H, D) tensors (made once from the (B, H, S, D) inputs, untimed)."""
    return call.provider in OTHER and not call.varlen


def fa4_fn(call: Call, cu, dtype, device):
    """(q, k, v) -> out of FlashAttention-4, (B, S, H, D) or packed (total, H, D); what it lacks raises."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(f"FlashAttention-4 takes fp16 / bf16, not {DTYPE_SHORT[dtype]}")
    if call.alibi or call.dropout:
        raise NotImplementedError(f"FlashAttention-4 has no {'ALiBi' if call.alibi else 'dropout'}")
    dense, varlen = load_fa4()
    opts = {"causal": call.causal, "window_size": tuple(None if w < 0 else w for w in call.window),
            "softcap": call.softcap}
    if call.sinks:  # FA4's backward also computes d(sink) whenever it has one (a small reduction over the rows)
        opts["learnable_sink"] = sink_logits(call.H).to(device)
    m = max(call.seqlens)

    def fwd(q, k, v):
        out = (varlen(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, **opts)
               if call.varlen else dense(q, k, v, **opts))
        return out[0] if isinstance(out, tuple) else out
    return fwd


def alibi_slopes(H: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32)


def sink_logits(H: int) -> torch.Tensor:
    """The sinks rows' attention sinks: one float32 logit per query head, -1 (head 0) to 10 (head H-1). The top
    reaches past log(S * e^0.5), the log of a row's key mass at S = 4k on N(0, 1) inputs, so on head H-1 the sink
    takes most of the softmax and the check (heads 0 and H-1) tells a dropped or misplaced sink."""
    return torch.linspace(-1.0, 10.0, H, dtype=torch.float32)


def make_inputs(call: Call, dtype, seed: int, device="cuda"):
    """Random q, k, v, dout and cu_seqlens (None when dense); None when they do not fit."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def shape(heads):
        return (sum(call.seqlens), heads, call.D) if call.varlen else (len(call.seqlens), heads, call.seqlens[0], call.D)
    cu = torch.tensor([0, *itertools.accumulate(call.seqlens)], dtype=torch.int32, device=device)
    try:  # q, k, v, dout
        return (*(torch.randn(shape(h), device=device, dtype=dtype, generator=gen)
                  for h in (call.H, call.kv_heads, call.kv_heads, call.H)),
                cu if call.varlen else None)
    except torch.cuda.OutOfMemoryError:
        return None


def fp8_fn(call: Call):
    """(q8, k8, v8) -> out of flash_cuda's FP8 forward (e4m3 inputs made by measure()); what it lacks raises."""
    if call.mode != "fwd":
        raise NotImplementedError("the FP8 forward has no backward")
    if call.varlen or call.alibi or call.dropout or call.sinks:
        raise NotImplementedError("the FP8 forward takes dense calls with a causal mask, a window or softcap only")
    load_flash_cuda()
    from flash_cuda.fp8 import attention_fp8
    opts = {"window_size": call.window} if call.window != (-1, -1) else {}
    if call.softcap:
        opts["softcap"] = float(call.softcap)
    return lambda q, k, v: attention_fp8(q, k, v, is_causal=call.causal, **opts)


def make_fn(call: Call, cu, device, dtype):
    """(q, k, v) -> out of the call's provider (measure() forces SDPA's backend)."""
    if call.provider in OTHER:
        return fa4_fn(call, cu, dtype, device)
    if call.provider in FP8:
        return fp8_fn(call)
    if call.provider in SDPA_BACKEND:
        if call.sinks:
            raise NotImplementedError("SDPA has no attention sinks")
        gqa = {"enable_gqa": True} if call.groups > 1 else {}
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=call.causal, dropout_p=call.dropout,
                                                               **gqa)
    fc, opts = load_flash_cuda(), call.options()
    if FLASH_KERNEL[call.provider] != "auto":
        opts["kernel"] = FLASH_KERNEL[call.provider]
    if call.provider == "flash_cuda_det":
        opts["deterministic"] = True
    if call.alibi:
        opts["alibi_slopes"] = alibi_slopes(call.H).to(device)
    if call.sinks:  # not requiring grad: the backward times dq / dk / dv only, no d(sinks)
        opts["sinks"] = sink_logits(call.H).to(device)
    if call.varlen:
        m = max(call.seqlens)
        return lambda q, k, v: fc.varlen_attention(q, k, v, cu, cu, m, m, **opts)
    return lambda q, k, v: fc.attention(q, k, v, **opts)


def check(call: Call, fwd, q, k, v, dout, cu, dtype) -> str:
    """'ok' or 'WRONG (...)' against the float32 reference on KV heads 0 and last of the last sequence, with their
    query heads (heads 0 and H-1 without GQA): cheap at any S, and a wrong batch or head offset still shows."""
    from flash_cuda.reference import attention_naive, dropout_keep_mask
    g, kv = call.groups, call.kv_heads
    heads = torch.tensor(sorted({*range(g), *range(call.H - g, call.H)}), device=q.device)  # q, out, dq, dout
    kv_heads = torch.tensor(sorted({0, kv - 1}), device=q.device)  # k, v, dk, dv
    a, b = (int(cu[-2]), int(cu[-1])) if call.varlen else (None, None)

    def view(t, sel=heads):  # -> (1, heads, S, D) float32
        t = t.transpose(1, 2) if bshd(call) else t
        if call.varlen:
            return t.detach()[a:b].float().index_select(1, sel).transpose(0, 1).unsqueeze(0)
        return t.detach()[-1:].float().index_select(1, sel)  # (float first: e4m3 inputs have no index_select)
    opts, need_grad = call.options(), call.mode != "fwd"
    ref_in = [view(q).requires_grad_(), view(k, kv_heads).requires_grad_(), view(v, kv_heads).requires_grad_()]
    if call.alibi:
        opts["alibi_slopes"] = alibi_slopes(call.H)[heads.cpu()].to(q.device)
    if call.sinks:
        opts["sinks"] = sink_logits(call.H)[heads.cpu()].to(q.device)
    if call.dropout:
        if call.provider != "flash_cuda" or call.varlen:
            raise ValueError("the bench checks dropout on flash_cuda's dense calls only (their random numbers)")
        # The call draws with the generator's next (seed, offset): its mask for the checked heads.
        seed, offset = next_philox(q.device)
        mask = dropout_keep_mask(1, call.H, call.seqlens[-1], call.seqlens[-1], call.dropout, seed, offset,
                                 q.device, first_batch=len(call.seqlens) - 1)
        opts["dropout_mask"] = mask.index_select(1, heads)
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.enable_grad():
            ref = attention_naive(*ref_in, **opts)[0]
            want = [ref.detach(), *(torch.autograd.grad(ref, ref_in, view(dout)) if need_grad else ())]
    except torch.cuda.OutOfMemoryError:
        tqdm.write(f"no memory for the reference of {call}: not checked", sys.stderr)
        return "ok"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved_tf32
    out = fwd(q, k, v)
    if out.shape != q.shape:
        return f"WRONG (output shape {tuple(out.shape)})"
    got = [view(out)]
    if need_grad:
        out.backward(dout)
        got += [view(q.grad), view(k.grad, kv_heads), view(v.grad, kv_heads)]
        for t in (q, k, v):
            t.grad = None
    for i, (name, x, w) in enumerate(zip(("out", "dq", "dk", "dv"), got, want)):
        tol = FP8_TOLERANCE if call.provider in FP8 else TOLERANCE[dtype][min(i, 1)]
        err = float((x - w).norm() / w.norm().clamp_min(1e-30)) if x.isfinite().all() else math.inf
        if not err <= tol:
            return f"WRONG ({name} rel err {err:.3g} > {tol:g})"
    return "ok"


def next_philox(device) -> tuple[int, int]:
    """(seed, offset) the next dropout call on ``device`` draws with: torch's CUDA generator's
    current seed and Philox offset (flash_cuda's binding takes them as torch's kernels do)."""
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return gen.initial_seed(), gen.get_offset()


def time_call(fwd, q, k, v, dout, mode: str, timer) -> tuple[float, float]:
    """(median ms, peak GiB above the allocation before); bwd alone runs after a forward outside the timed region."""
    grads = (q, k, v) if mode != "fwd" else ()
    if mode == "bwd":
        out = fwd(q, k, v)
        fn = lambda: out.backward(dout, retain_graph=True)  # noqa: E731
    else:
        fn = (lambda: fwd(q, k, v)) if mode == "fwd" else (lambda: fwd(q, k, v).backward(dout))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = max(torch.cuda.max_memory_allocated() - base, 0) / 2**30
    ms = timer(fn, grad_to_none=grads)
    for t in grads:
        t.grad = None
    return ms, peak


def classify_error(exc: BaseException) -> str:
    msg = str(exc)
    if isinstance(exc, Unavailable):
        return msg
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in msg.lower():
        return "OOM"
    if isinstance(exc, (NotImplementedError, ValueError)) or any(w in msg.lower() for w in UNSUPPORTED_WORDS):
        return "unsupported: " + short_text(msg)
    return f"error: {type(exc).__name__}: {short_text(msg)}"


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def measure(call: Call, inputs, flops: float, dtype, timer, check_first: bool = True) -> dict:
    """{ms, tflops, peak_gib, status} of the call on new leaves of inputs; a failure becomes the status."""
    if inputs is None:
        return {"status": "OOM (inputs)"}
    q, k, v, dout = (t.transpose(1, 2).contiguous() if bshd(call) else t for t in inputs[:4])
    q, k, v = (t.detach().requires_grad_(call.mode != "fwd") for t in (q, k, v))
    if call.provider in FP8 and call.mode == "fwd":
        q, k, v = (t.to(torch.float8_e4m3fn) for t in (q, k, v))  # the reference (check) reads these values
    cu = inputs[4]
    with warnings.catch_warnings():  # SDPA warns why each backend refused; the status says it is unsupported
        warnings.simplefilter("ignore")
        try:
            backend = SDPA_BACKEND.get(call.provider)
            with sdpa_kernel(getattr(SDPBackend, backend)) if backend else contextlib.nullcontext():
                fwd = make_fn(call, cu, q.device, dtype)
                status = check(call, fwd, q, k, v, dout, cu, dtype) if check_first else "ok"
                if status == "ok":
                    ms, peak = time_call(fwd, q, k, v, dout, call.mode, timer)
        except Exception as exc:  # noqa: BLE001 -- every failure becomes a status
            status = classify_error(exc)
    if status != "ok":
        free_memory()
        return {"status": status}
    return {"ms": ms, "tflops": flops / ms / 1e9, "peak_gib": peak, "status": "ok"}


def measure_all(flops: dict, dtype, timer, seed: int, check_first: bool, device="cuda") -> dict:
    """{call: measure()} for flops ({call: FLOP count}); the calls of one shape share one set of inputs. A provider
    that cannot run here (missing()) is not measured: its reason is the status."""
    groups, results = collections.defaultdict(list), {}
    absent = {p: missing(p) for p in dict.fromkeys(c.provider for c in flops)}
    for c in flops:
        if absent[c.provider]:
            results[c] = {"status": absent[c.provider]}
        else:
            groups[c.varlen, c.D, c.H, c.kv_heads, c.seqlens].append(c)
    bar = tqdm(total=len(flops) - len(results), disable=None, file=sys.stderr,  # off where not a terminal
               dynamic_ncols=True)
    for i, group in enumerate(groups.values()):
        inputs = make_inputs(group[0], dtype, seed + i, device)
        for c in group:
            bar.set_description_str(f"{c.provider} D={c.D} S={max(c.seqlens)} {c.mode}", refresh=False)
            bar.update()
            results[c] = measure(c, inputs, flops[c], dtype, timer, check_first)
        del inputs
        free_memory()
    bar.close()
    return results
