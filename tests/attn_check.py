"""Shared helpers of the flash_cuda test suites: input factories and the accuracy check.

    from attn_check import make_inputs, check_attention
    q, k, v = make_inputs(2, 8, 2, 113, 127, 64, torch.float16, "cuda", layout="bshd", seed=3)
    check_attention(q, k, v, is_causal=True, scale=None, label="my case")
    check_attention(q, k, v, is_causal=True, scale=None, window_size=(32, -1), softcap=5.0,
                    alibi_slopes=make_alibi_slopes(8, batch=2), label="with options")
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((0, 17, 300), (5, 17, 250), 8, 2,
                                                           64, torch.bfloat16, "cuda")
    check_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, label="packed")

The options (causal, scale, window, softcap, ALiBi slopes) go to flash_cuda and to the
reference (flash_cuda.reference.attention_naive / attention_varlen_naive) alike.

Accuracy rule (the usual FlashAttention test rule). For every checked tensor X (out, lse,
and with ``check_grad`` dq, dk, dv):

    max|X_flash - X_ref64|  <=  2 * max|X_naive - X_ref64|  +  atol

where X_ref64 is :func:`flash_cuda.reference.attention_naive` on float64 copies of the
inputs (the same bits, upcast) and X_naive is the same naive attention computed in the
inputs' own dtype on the same device. ``atol`` is tiny: a per-dtype base (fp32 1e-5,
fp16 1e-3, bf16 1e-2; lse 1e-5 / 1e-4) times the magnitude max(1, max|X_ref64|). The
floor of 1 (the scale of the standard-normal test inputs) matters only where the exact
result is ~0 through cancellation, e.g. dq and dk when every query sees a single key.

For out and the gradients, atol also holds the fp32 rounding that the algorithm cannot
avoid and that the naive computation sometimes avoids by luck (with a single key it is
exact): P is recomputed as exp2(s * scale * log2e - lse * log2e), an fp32 argument of
size up to A = max|lse| (relative error ~A * 2^-24), and dS = P * (dP - delta) subtracts
two fp32 dot products of length D (error ~sqrt(D) * 2^-24). So

    atol = magnitude * (base + 2^-24 * (8 * A + 16 * sqrt(D)))

where the second term is below the fp32 base unless scores are large (scale=1, D=256).
In addition: rows whose reference lse is -inf (no visible key) must have lse exactly -inf
and output exactly 0, every other value must be finite, and nothing may be NaN.
"""

from __future__ import annotations

import math
import os
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

import flash_cuda
from flash_cuda.reference import attention_naive, attention_varlen_naive

__all__ = [
    "LAYOUTS",
    "DTYPES",
    "ATOL_BASE",
    "LSE_ATOL_BASE",
    "make_inputs",
    "make_tensor",
    "make_varlen_inputs",
    "make_alibi_slopes",
    "climb_scores",
    "cu_seqlens_from_lengths",
    "check_attention",
    "check_varlen_attention",
    "rule_error",
    "FP32_EPS",
    "naive_chunked",
    "gpu_skip_reason",
    "dtype_name",
    "WS_FORWARD_KERNELS",
    "OTHER_FORWARD_KERNELS",
    "DECODE_MAX_QUERIES",
    "profiled",
    "assert_ws_forward",
    "ws_tier",
    "ws_fwd",
    "ws_fwd_traced",
]

# "contiguous" is an alias of "bhsd".
LAYOUTS = ("bhsd", "bshd", "strided", "offset", "misaligned")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

ATOL_BASE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
# flash_cuda returns lse in float32 whatever the input dtype.
LSE_ATOL_BASE = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-4, torch.float64: 1e-5}


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
            torch.float64: "fp64"}.get(dtype, str(dtype))


def gpu_skip_reason() -> Optional[str]:
    """None when the flash_cuda GPU tests can run here, else why they cannot."""
    if not torch.cuda.is_available():
        return "CUDA is not available (no GPU, or a CPU-only build of torch)"
    if not flash_cuda.is_available():
        from flash_cuda import _ext

        return f"{_ext.unavailable_message()} (flash_cuda imported from {flash_cuda.__file__})"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 0):
        return f"GPU compute capability {major}.{minor} < 8.0"
    return None


def hopper_skip_reason(what: str) -> Optional[str]:
    """None when ``what`` (a Hopper-only kernel) can run here: an sm_90 GPU that
    FLASH_CUDA_EMULATE_ARCH does not present as another class."""
    reason = gpu_skip_reason()
    if reason:
        return reason
    emulated = int(os.environ.get("FLASH_CUDA_EMULATE_ARCH", "0") or 0)
    if (emulated and emulated != 90) or torch.cuda.get_device_capability() != (9, 0):
        return f"{what} runs on sm_90 only"
    return None


def smem_class_kib() -> int:
    """The opt-in shared memory per block (KiB) of the GPU class the kernels are chosen for:
    FLASH_CUDA_EMULATE_ARCH's class where it is set (csrc/arch/gpu_class.h), else the device's."""
    emulated = int(os.environ.get("FLASH_CUDA_EMULATE_ARCH", "0") or 0)
    if emulated:
        return 163 if emulated in (80, 87) else 227 if emulated in (90, 100, 103) else 99
    return torch.cuda.get_device_properties(0).shared_memory_per_block_optin // 1024


# ---------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------


def _generator(device, seed: int) -> torch.Generator:
    dev = torch.device(device)
    g = torch.Generator(device=dev if dev.type == "cuda" else "cpu")
    g.manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
    return g


def _randn(shape: Sequence[int], dtype: torch.dtype, device, gen: torch.Generator) -> Tensor:
    # Drawn in float32 then rounded: the same values for every dtype up to rounding.
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32).to(dtype)


def make_tensor(B: int, H: int, S: int, D: int, dtype: torch.dtype, device, layout: str = "bhsd",
                seed: int = 0) -> Tensor:
    """A (B, H, S, D) tensor of fresh standard-normal values with the given memory layout:

    * ``"bhsd"`` / ``"contiguous"``: contiguous.
    * ``"bshd"``: allocated (B, S, H, D) then ``.transpose(1, 2)`` (dense, not contiguous).
    * ``"strided"``: a non-contiguous, non-dense slice of a larger buffer (padded rows,
      every other head, a row offset), stride(-1) == 1, 16-byte aligned.
    * ``"offset"``: contiguous view at a storage offset (a multiple of 8 elements, so the
      data pointer stays 16-byte aligned) into a bigger buffer.
    * ``"misaligned"``: contiguous view at an odd storage offset: the data pointer is not
      16-byte aligned (the extension must cope, e.g. by copying).
    """
    if layout == "contiguous":
        layout = "bhsd"
    gen = _generator(device, seed)
    n = B * H * S * D
    if layout == "bhsd":
        return _randn((B, H, S, D), dtype, device, gen)
    if layout == "bshd":
        return _randn((B, S, H, D), dtype, device, gen).transpose(1, 2)
    if layout == "strided":
        buf = _randn((B, S + 1, 2 * H, D + 16), dtype, device, gen)
        return buf[:, 1:, ::2, 8:8 + D].transpose(1, 2)
    if layout in ("offset", "misaligned"):
        off = 8 * (1 + seed % 4) if layout == "offset" else 1 + 2 * (seed % 3)
        buf = _randn((off + n + 8,), dtype, device, gen)
        return buf[off:off + n].view(B, H, S, D)
    raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS} or 'contiguous'")


def make_inputs(B: int, Hq: int, Hkv: int, Sq: int, Sk: int, D: int, dtype: torch.dtype,
                device="cuda", layout: str = "bhsd", seed: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D): independent standard-normal values (never
    all zeros), each in ``layout`` (see :func:`make_tensor`). Deterministic in ``seed``."""
    q = make_tensor(B, Hq, Sq, D, dtype, device, layout, seed=3 * seed + 0)
    k = make_tensor(B, Hkv, Sk, D, dtype, device, layout, seed=3 * seed + 1)
    v = make_tensor(B, Hkv, Sk, D, dtype, device, layout, seed=3 * seed + 2)
    return q, k, v


def climb_scores(q: Tensor, k: Tensor, rise: float, scale: float) -> Tuple[Tensor, Tensor]:
    """q, k whose scores climb along the keys by ``rise`` (log2 units, the kernels' exp2 domain)
    per 128 keys (falling from a non-negative start for rise < 0): column 0 of q becomes 1 and
    column 0 of k a ramp. It drives a forward's running max through every case of a lagging
    reference max: slow climbs (the max kept while P grows), steep ones (rescaled every block),
    a falling one (never moved after the first block)."""
    Sk = k.shape[-2]
    per_key = rise / 128 / (scale * math.log2(math.e))
    q, k = q.clone(), k.clone()
    q[..., 0] = 1.0
    ramp = per_key * torch.arange(Sk, device=k.device, dtype=torch.float32)
    k[..., 0] = (ramp - ramp.min()).to(k.dtype)
    return q, k


VARLEN_LAYOUTS = ("contiguous", "strided", "offset", "misaligned")


def make_packed_tensor(total: int, H: int, D: int, dtype: torch.dtype, device,
                       layout: str = "contiguous", seed: int = 0) -> Tensor:
    """A packed (total, H, D) tensor of standard-normal values in ``layout``:
    ``"contiguous"``; ``"strided"`` (every other head of a wider buffer with padded rows,
    like a slice of a fused QKV projection; stride(-1) == 1); ``"offset"`` / ``"misaligned"``
    (a contiguous view at a 16-byte aligned / odd storage offset)."""
    gen = _generator(device, seed)
    n = total * H * D
    if layout == "contiguous":
        return _randn((total, H, D), dtype, device, gen)
    if layout == "strided":
        buf = _randn((total, 2 * H, D + 16), dtype, device, gen)
        return buf[:, ::2, 8:8 + D]
    if layout in ("offset", "misaligned"):
        off = 8 * (1 + seed % 4) if layout == "offset" else 1 + 2 * (seed % 3)
        buf = _randn((off + n + 8,), dtype, device, gen)
        return buf[off:off + n].view(total, H, D)
    raise ValueError(f"unknown packed layout {layout!r}; expected one of {VARLEN_LAYOUTS}")


def cu_seqlens_from_lengths(lengths: Sequence[int], device) -> Tensor:
    """int32 (len(lengths) + 1,): 0 and the running sums of ``lengths``."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_varlen_inputs(seqlens_q: Sequence[int], seqlens_k: Sequence[int], Hq: int, Hkv: int,
                       D: int, dtype: torch.dtype, device="cuda", layout: str = "contiguous",
                       seed: int = 0):
    """A packed batch: (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) with
    q (sum(seqlens_q), Hq, D) and k, v (sum(seqlens_k), Hkv, D) in ``layout``
    (:func:`make_packed_tensor`). Deterministic in ``seed``."""
    assert len(seqlens_q) == len(seqlens_k)
    tq, tk = int(sum(seqlens_q)), int(sum(seqlens_k))
    q = make_packed_tensor(tq, Hq, D, dtype, device, layout, seed=3 * seed + 0)
    k = make_packed_tensor(tk, Hkv, D, dtype, device, layout, seed=3 * seed + 1)
    v = make_packed_tensor(tk, Hkv, D, dtype, device, layout, seed=3 * seed + 2)
    return (q, k, v, cu_seqlens_from_lengths(seqlens_q, device),
            cu_seqlens_from_lengths(seqlens_k, device), max(seqlens_q, default=0),
            max(seqlens_k, default=0))


def make_alibi_slopes(Hq: int, batch: Optional[int] = None, device="cuda", scale: float = 1.0,
                      seed: int = 0) -> Tensor:
    """float32 ALiBi slopes: the usual geometric sequence 2^(-8 (h + 1) / Hq) (0.5 down to
    2^-8), times ``scale``; with ``batch``, shape (batch, Hq) with each batch entry's slopes
    scaled by a different factor in [0.5, 1.5]."""
    h = torch.arange(1, Hq + 1, dtype=torch.float64)
    slopes = torch.pow(2.0, -8.0 * h / Hq) * scale
    if batch is not None:
        g = torch.Generator().manual_seed(seed)
        factors = 0.5 + torch.rand(batch, 1, generator=g, dtype=torch.float64)
        slopes = factors * slopes.unsqueeze(0)
    return slopes.to(torch.float32).to(device)


def naive_chunked(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float],
                  dtype: torch.dtype, chunk: int = 1024) -> Tuple[Tensor, Tensor]:
    """attention_naive in ``dtype`` computed over chunks of query rows, so the score matrix
    never exceeds (chunk x Sk) per head. Exactly the naive result: rows are independent.

    For causal masking a chunk of rows [a, b) keeps only the keys [0, b + Sk - Sq): with
    that truncation the bottom-right alignment of the chunk equals the global one.
    """
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    outs, lses = [], []
    for a in range(0, Sq, chunk):
        b = min(Sq, a + chunk)
        qc = q[:, :, a:b].to(dtype)
        if is_causal:
            kend = b + Sk - Sq
            if kend <= 0:  # every row of the chunk sees no key
                outs.append(torch.zeros((B, Hq, b - a, D), dtype=dtype, device=q.device))
                lses.append(torch.full((B, Hq, b - a), float("-inf"), dtype=dtype, device=q.device))
                continue
            kc, vc = k[:, :, :kend].to(dtype), v[:, :, :kend].to(dtype)
        else:
            kc, vc = k.to(dtype), v.to(dtype)
        o, l = attention_naive(qc, kc, vc, is_causal=is_causal, scale=scale)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


# ---------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------


def _max_abs_err(x: Tensor, ref: Tensor, mask: Optional[Tensor] = None) -> float:
    d = (x.detach().to(torch.float64) - ref.detach()).abs()
    if mask is not None:
        d = d[mask]
    if d.numel() == 0:
        return 0.0
    return float(d.max())


def _magnitude(ref: Tensor, mask: Optional[Tensor] = None) -> float:
    r = ref.detach().abs()
    if mask is not None:
        r = r[mask]
    return float(r.max()) if r.numel() else 0.0


FP32_EPS = 2.0 ** -24


def rule_error(name: str, x: Tensor, ref: Tensor, naive: Tensor, base_atol: float,
               mask: Optional[Tensor] = None, min_mag: float = 1.0, score_mag: float = 0.0,
               head_dim: int = 0):
    """Applies the accuracy rule to one tensor.

    Returns (result, problem): result = {"flash", "naive", "tol", "magnitude"} (None when
    x has non-finite values outside ``mask``), problem = None or a description.
    ``mask`` restricts the comparison (e.g. to the finite entries of a reference lse).
    ``score_mag`` (max|lse|, the size of the softmax arguments) and ``head_dim`` add the
    fp32 rounding term of the module docstring; leave them 0 for lse.
    """
    if mask is None and not bool(torch.isfinite(x).all()):
        n_bad = int((~torch.isfinite(x)).sum())
        return None, f"{name}: {n_bad} non-finite values (NaN/inf)"
    err = _max_abs_err(x, ref, mask)
    err_naive = _max_abs_err(naive, ref, mask)
    mag = max(_magnitude(ref, mask), min_mag)
    atol = (base_atol + FP32_EPS * (8 * score_mag + 16 * math.sqrt(head_dim))) * mag
    if not math.isfinite(err_naive):  # the same-dtype naive overflowed: fall back
        err_naive = 0.0
        atol = 50 * atol
    tol = 2.0 * err_naive + atol
    res = {"flash": err, "naive": err_naive, "tol": tol, "magnitude": mag}
    if not err <= tol:  # also catches err == NaN
        return res, (f"{name}: max|flash - ref64| = {err:.3e} > tol {tol:.3e} (= 2 * naive err "
                     f"{err_naive:.3e} + atol {atol:.3e}; max|ref| {mag:.3e})")
    return res, None


def out_lse_problems(tag: str, out: Tensor, lse: Tensor, ref_o: Tensor, ref_lse: Tensor, nav_o: Tensor,
                     nav_lse: Tensor, dtype: torch.dtype, head_dim: int) -> List[str]:
    """The rule applied to one call's out and lse (lse where the float64 reference is finite,
    out with the fp32 term of the softmax's size): the problems found, named ``out<tag>`` /
    ``lse<tag>``."""
    problems = []
    finite = torch.isfinite(ref_lse)
    score_mag = float(ref_lse[finite].abs().max()) if bool(finite.any()) else 0.0
    _, pr = rule_error(f"out{tag}", out.double(), ref_o, nav_o.double(), ATOL_BASE[dtype], score_mag=score_mag,
                       head_dim=head_dim)
    if pr:
        problems.append(pr)
    if bool(finite.any()):
        _, pr = rule_error(f"lse{tag}", lse.double(), ref_lse, nav_lse.double(), LSE_ATOL_BASE[dtype], mask=finite)
        if pr:
            problems.append(pr)
    return problems


def _pick_dlse(q: Tensor, k: Tensor, label: str) -> bool:
    """Deterministic, varied choice of the calls that also send a random dlse."""
    key = f"{tuple(q.shape)}{tuple(k.shape)}{q.dtype}{label}".encode()
    return zlib.crc32(key) % 3 == 0


def _features_desc(window_size, softcap, alibi_slopes) -> str:
    parts = []
    if tuple(window_size) != (-1, -1):
        parts.append(f"window={tuple(window_size)}")
    if softcap:
        parts.append(f"softcap={softcap}")
    if alibi_slopes is not None:
        parts.append(f"alibi={tuple(alibi_slopes.shape)}"
                     f"[{float(alibi_slopes.min()):.3g}..{float(alibi_slopes.max()):.3g}]")
    return " ".join(parts)


def _check_against_references(desc: str, q: Tensor, k: Tensor, v: Tensor, flash_fn, ref_fn, *,
                              lse_shape: Tuple[int, ...], out_rows, check_grad: bool,
                              with_dlse: bool, seed: int, what: str,
                              sinks: Optional[Tensor] = None) -> Dict[str, Dict[str, float]]:
    """The body of check_attention / check_varlen_attention.

    ``flash_fn(q, k, v) -> (out, lse)`` runs flash_cuda, ``ref_fn(q, k, v) -> (out, lse)``
    the naive reference (called on float64 copies and on the inputs' dtype); ``out_rows``
    maps an lse-shaped bool mask to the matching rows of out (the layouts differ).
    ``sinks`` (attention sinks, (Hq,)): both functions then take them as a fourth argument
    (flash_cuda float32, the references float64 / the inputs' dtype), lse is finite where
    the reference's is, and with ``check_grad`` d(sinks) is checked as well.
    """
    dtype = q.dtype
    D = q.shape[-1]
    problems = []

    # ---- flash_cuda ----
    qf = q.detach().requires_grad_(check_grad)
    kf = k.detach().requires_grad_(check_grad)
    vf = v.detach().requires_grad_(check_grad)
    leaves = (qf, kf, vf)
    if sinks is not None:
        sf = sinks.detach().to(torch.float32).requires_grad_(check_grad)
        leaves = leaves + (sf,)
    out, lse = flash_fn(*leaves)
    if out.shape != q.shape or out.dtype != dtype or out.device != q.device:
        problems.append(f"out metadata: shape {tuple(out.shape)} dtype {out.dtype} device {out.device}")
    if out.stride() != torch.empty_like(q).stride():
        problems.append(f"out strides {out.stride()} != empty_like(q) strides "
                        f"{torch.empty_like(q).stride()}")
    if tuple(lse.shape) != tuple(lse_shape) or lse.dtype != torch.float32 or not lse.is_contiguous():
        problems.append(f"lse metadata: shape {tuple(lse.shape)} (expected {tuple(lse_shape)}) "
                        f"dtype {lse.dtype} contiguous {lse.is_contiguous()}")
        raise AssertionError(f"{what} mismatch {desc}\n  " + "\n  ".join(problems))

    gen = _generator(q.device, 7919 * seed + zlib.crc32(desc.encode()))
    dout = dlse = None
    grads = ()
    if check_grad:
        dout = _randn(out.shape, dtype, q.device, gen)
        if with_dlse:
            dlse = _randn(lse.shape, torch.float32, q.device, gen)
        outputs, grad_outputs = ((out, lse), (dout, dlse)) if with_dlse else ((out,), (dout,))
        grads = torch.autograd.grad(outputs, leaves, grad_outputs)

    # ---- references: float64 ground truth and naive in the inputs' dtype ----
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        refs = {}
        for name, rdtype in (("ref64", torch.float64), ("naive", dtype)):
            qr = q.detach().to(rdtype).requires_grad_(check_grad)
            kr = k.detach().to(rdtype).requires_grad_(check_grad)
            vr = v.detach().to(rdtype).requires_grad_(check_grad)
            leaves_r = (qr, kr, vr)
            if sinks is not None:
                leaves_r = leaves_r + (sinks.detach().to(rdtype).requires_grad_(check_grad),)
            o_r, l_r = ref_fn(*leaves_r)
            g_r = ()
            if check_grad:
                outs_r = (o_r, l_r) if with_dlse else (o_r,)
                gouts_r = ((dout.to(rdtype), dlse.to(rdtype)) if with_dlse else (dout.to(rdtype),))
                g_r = torch.autograd.grad(outs_r, leaves_r, gouts_r, allow_unused=True)
                g_r = tuple(torch.zeros_like(t) if g is None else g
                            for g, t in zip(g_r, leaves_r))
            refs[name] = (o_r.detach(), l_r.detach(), tuple(g.detach() for g in g_r))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32

    out64, lse64, grads64 = refs["ref64"]
    outn, lsen, gradsn = refs["naive"]
    results: Dict[str, Dict[str, float]] = {}

    # ---- masked rows: exact -inf / 0, and the finiteness pattern ----
    ref_neginf = lse64 == float("-inf")
    if not torch.equal(lse.detach() == float("-inf"), ref_neginf):
        bad = int(((lse.detach() == float("-inf")) != ref_neginf).sum())
        problems.append(f"lse: -inf pattern differs from the reference at {bad} rows")
    if torch.isnan(lse).any() or (torch.isinf(lse) & ~ref_neginf).any():
        problems.append("lse: NaN or unexpected inf values")
    if ref_neginf.any() and not bool((out.detach()[out_rows(ref_neginf)] == 0).all()):
        problems.append("out: rows without a visible key are not exactly 0")

    finite = torch.isfinite(lse64)
    score_mag = _magnitude(lse64, finite)

    def compare(name, x, ref, naive, base_atol, mask=None, min_mag=1.0, score_mag=score_mag,
                head_dim=D):
        res, problem = rule_error(name, x, ref, naive, base_atol, mask=mask, min_mag=min_mag,
                                  score_mag=score_mag, head_dim=head_dim)
        if res is not None:
            results[name] = res
        if problem:
            problems.append(problem)

    compare("out", out, out64, outn, ATOL_BASE[dtype])
    compare("lse", lse, lse64, lsen, LSE_ATOL_BASE[dtype], mask=finite, min_mag=1.0, score_mag=0.0,
            head_dim=0)
    if check_grad:
        # dq and dk come from dS = P * (dP - delta), a difference that cancels exactly in
        # degenerate cases (a single visible key: dS = 0 in exact arithmetic, and the naive
        # same-dtype gradient is then exactly 0 too). The rounding of that difference scales
        # with the gradients' overall size, so the absolute term uses the largest of the
        # three gradient magnitudes rather than the (possibly zero) one being checked.
        grad_mag = max([1.0] + [_magnitude(g64) for g64 in grads64[:3]])
        for name, g, g64, gn in zip(("dq", "dk", "dv"), grads, grads64, gradsn):
            if g.shape != g64.shape or g.dtype != dtype:
                problems.append(f"{name} metadata: shape {tuple(g.shape)} dtype {g.dtype}")
                continue
            compare(name, g, g64, gn, ATOL_BASE[dtype], min_mag=grad_mag)
        if sinks is not None:
            # d(sinks) sums P_sink * (dlse - rowsum(dO * O)) over every row of a head: its
            # own magnitude, and float32 arithmetic from the rounded out and dout.
            g, g64, gn = grads[3], grads64[3], gradsn[3]
            if g.shape != g64.shape or g.dtype != torch.float32:
                problems.append(f"dsinks metadata: shape {tuple(g.shape)} dtype {g.dtype}")
            else:
                compare("dsinks", g, g64, gn, ATOL_BASE[dtype])

    if problems:
        table = "\n".join(f"    {n}: flash {r['flash']:.3e}  naive {r['naive']:.3e}  tol {r['tol']:.3e}"
                          f"  max|ref| {r['magnitude']:.3e}" for n, r in results.items())
        raise AssertionError(f"{what} mismatch {desc}\n  " + "\n  ".join(problems)
                             + f"\n  errors vs float64:\n{table}")
    return results


def check_attention(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, scale: Optional[float],
                    window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, check_grad: bool = True,
                    kernel: str = "auto", label: str = "", with_dlse: Optional[bool] = None,
                    deterministic: bool = False, seed: int = 0,
                    sinks: Optional[Tensor] = None) -> Dict[str, Dict[str, float]]:
    """Runs flash_cuda.attention(return_lse=True) (and its backward with a random dout and,
    when ``with_dlse`` — by default on about a third of the calls — a random dlse) and
    checks every result against the float64 reference with the rule of this module. The
    options (causal, scale, window, softcap, ALiBi slopes, attention sinks) go to flash_cuda
    and to the reference alike; with ``sinks`` also d(sinks) is checked.

    Raises AssertionError listing every failing quantity with the case description.
    Returns {name: {"flash": err, "naive": err, "tol": tol}} for the caller's records.
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if with_dlse is None:
        with_dlse = _pick_dlse(q, k, label)
    with_dlse = bool(with_dlse and check_grad)
    desc = (f"[{label}] B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D} dtype={dtype_name(q.dtype)} "
            f"causal={is_causal} scale={scale} {_features_desc(window_size, softcap, alibi_slopes)} "
            f"kernel={kernel} dlse={with_dlse} "
            f"deterministic={deterministic} q.stride={tuple(q.stride())} "
            f"q.offset={q.storage_offset()} k.stride={tuple(k.stride())}"
            + ("" if sinks is None else f" sinks=[{float(sinks.min()):.3g}..{float(sinks.max()):.3g}]"))
    opts = dict(is_causal=is_causal, scale=scale, window_size=tuple(window_size), softcap=softcap,
                alibi_slopes=alibi_slopes)

    def flash_fn(qf, kf, vf, sf=None):
        return flash_cuda.attention(qf, kf, vf, return_lse=True, kernel=kernel,
                                    deterministic=deterministic, sinks=sf, **opts)

    def ref_fn(qr, kr, vr, sr=None):
        return attention_naive(qr, kr, vr, sinks=sr, **opts)

    return _check_against_references(desc, q, k, v, flash_fn, ref_fn, lse_shape=(B, Hq, Sq),
                                      out_rows=lambda m: m, check_grad=check_grad,
                                      with_dlse=with_dlse, seed=seed,
                                      what="flash_cuda.attention", sinks=sinks)


def check_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                           cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                           is_causal: bool = False, scale: Optional[float] = None,
                           window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, check_grad: bool = True,
                           kernel: str = "auto", label: str = "", with_dlse: Optional[bool] = None,
                           deterministic: bool = False, check_cu_seqlens: bool = False,
                           seed: int = 0, sinks: Optional[Tensor] = None) -> Dict[str, Dict[str, float]]:
    """check_attention for flash_cuda.varlen_attention: out, lse ((Hq, total_q)) and the
    gradients of the packed batch against flash_cuda.reference.attention_varlen_naive in
    float64 and in the inputs' dtype, with the same rule (the maxima run over every
    sequence of the batch)."""
    total_q, Hq, D = q.shape
    Hkv = k.shape[1]
    if with_dlse is None:
        with_dlse = _pick_dlse(q, k, label)
    with_dlse = bool(with_dlse and check_grad)
    lens_q = torch.diff(cu_seqlens_q.cpu()).tolist()
    lens_k = torch.diff(cu_seqlens_k.cpu()).tolist()
    shown = lambda x: x if len(x) <= 16 else x[:8] + ["..."] + x[-8:]  # noqa: E731
    desc = (f"[{label}] varlen B={len(lens_q)} seqlens_q={shown(lens_q)} seqlens_k={shown(lens_k)} "
            f"max_seqlen=({max_seqlen_q}, {max_seqlen_k}) Hq={Hq} Hkv={Hkv} D={D} "
            f"dtype={dtype_name(q.dtype)} causal={is_causal} scale={scale} "
            f"{_features_desc(window_size, softcap, alibi_slopes)} kernel={kernel} "
            f"dlse={with_dlse} deterministic={deterministic} q.stride={tuple(q.stride())} "
            f"q.offset={q.storage_offset()} k.stride={tuple(k.stride())}"
            + ("" if sinks is None else f" sinks=[{float(sinks.min()):.3g}..{float(sinks.max()):.3g}]"))
    opts = dict(is_causal=is_causal, scale=scale, window_size=tuple(window_size), softcap=softcap,
                alibi_slopes=alibi_slopes)

    def flash_fn(qf, kf, vf, sf=None):
        return flash_cuda.varlen_attention(qf, kf, vf, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, return_lse=True, kernel=kernel,
                                           deterministic=deterministic,
                                           check_cu_seqlens=check_cu_seqlens, sinks=sf, **opts)

    def ref_fn(qr, kr, vr, sr=None):
        return attention_varlen_naive(qr, kr, vr, cu_seqlens_q, cu_seqlens_k, sinks=sr, **opts)

    return _check_against_references(desc, q, k, v, flash_fn, ref_fn, lse_shape=(Hq, total_q),
                                      out_rows=lambda m: m.transpose(0, 1),
                                      check_grad=check_grad, with_dlse=with_dlse, seed=seed,
                                      what="flash_cuda.varlen_attention", sinks=sinks)


# ---------------------------------------------------------------------------------------
# Which kernel ran (torch.profiler)
# ---------------------------------------------------------------------------------------

# The warp-specialized Hopper forward kernels (csrc/tiers/wgmma/fwd/kernel.cuh) and the other
# forwards (mma.sync, split-KV decode, fp32 SIMT); a profile's kernel names contain these.
WS_FORWARD_KERNELS = ("fwd_sm90_ws_kernel", "fwd_sm90_ws_gqa_kernel", "fwd_sm90_ws_dropout_kernel")
OTHER_FORWARD_KERNELS = ("fwd_mma_kernel", "decode_kernel", "flash_fwd_simt_kernel", "flash_fwd_simt_outer_kernel")

# kernel='auto' sends attention() calls with at most this many queries to the split-KV decode
# kernels (csrc/tiers/mma/family.h: decode::kMaxDecodeQueries).
DECODE_MAX_QUERIES = 16


def profiled(fn):
    """(fn()'s result, the names of the CUDA kernels it launched, space-separated)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, " ".join(e.name for e in prof.events())


def assert_ws_forward(names: str, what: str = "the call") -> None:
    """A warp-specialized forward kernel is among ``names`` (profiled's) and no other forward is."""
    assert names, f"{what}: torch.profiler recorded no CUDA kernel, so nothing tells which forward ran"
    assert any(k in names for k in WS_FORWARD_KERNELS), f"{what}: no warp-specialized forward ran: {names}"
    others = [k for k in OTHER_FORWARD_KERNELS if k in names]
    assert not others, f"{what}: {others} ran besides the warp-specialized forward: {names}"


def ws_tier(q: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: int) -> int:
    """The tier id (flash_cuda.validation.KERNELS) under which the extension's forward runs the
    warp-specialized kernel for such a q: kernel='auto', except for decode-shaped calls (at most
    DECODE_MAX_QUERIES queries), which 'auto' gives the decode kernels and 'wgmma' (head dims
    33..128) keeps on the Hopper family."""
    sq = max_seqlen_q if cu_seqlens_q is not None else q.shape[-2]
    if sq > DECODE_MAX_QUERIES:
        return flash_cuda.KERNELS["auto"]
    assert 33 <= q.shape[-1] <= 128, (f"a decode-shaped call (Sq {sq}) at head dim {q.shape[-1]}: no kernel= "
                                      "runs the warp-specialized forward there")
    return flash_cuda.KERNELS["wgmma"]


def ws_fwd_traced(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k, **kwargs):
    """The extension's forward (out, lse, aux) on the warp-specialized Hopper kernels, and the
    profile's kernel names: the tier from ws_tier, one profile, and a failure unless a
    warp-specialized forward ran and no other forward did. kwargs: dropout_p, rng_state."""
    from flash_cuda import _ext

    tier = ws_tier(q, cu_seqlens_q, max_seqlen_q)
    result, names = profiled(lambda: _ext.require().fwd(q, k, v, scale, window_left, window_right, softcap,
                                                        alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                        max_seqlen_k, tier, **kwargs))
    assert_ws_forward(names, f"fwd (tier {tier}, q {tuple(q.shape)}, max_seqlen_q {max_seqlen_q})")
    return result, names


def ws_fwd(*args, **kwargs):
    """ws_fwd_traced's (out, lse, aux) alone."""
    return ws_fwd_traced(*args, **kwargs)[0]
