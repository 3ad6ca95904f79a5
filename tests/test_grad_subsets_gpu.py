"""Gradients only where asked: when autograd wants the gradient of q alone, the backward runs no
dK / dV kernel and allocates no dK / dV; when it wants k and / or v alone, no dQ kernel, dQ
accumulator or dQ atomics (csrc/include/params.h: bwd_wants_dq / bwd_wants_dkdv; dK and dV come
from the same products, so either one computes both).

For every subset of (q, k, v) the gradients asked for must equal those of the all-gradients run:
bitwise where the same kernels compute them (deterministic=True, and the mma.sync family, whose
backward is always a dK/dV kernel plus a dQ kernel), within a tolerance where the all-gradients
run takes a one-pass kernel with dQ by atomics or reductions (the Hopper warp-specialized kernels
and the fp32 default) and the subset the kernel of its side. Then that the work is skipped: the
memory the backward allocates, and the kernels it launches (torch.profiler). GPU only.
"""

from __future__ import annotations

import re

import pytest
import torch

import flash_cuda

from attn_check import hopper_skip_reason, make_inputs, make_varlen_inputs

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DTYPE_IDS = {F16: "fp16", BF16: "bf16", F32: "fp32"}

# Which of (q, k, v) require grad.
SUBSETS = {"q": (True, False, False), "k": (False, True, False), "v": (False, False, True),
           "kv": (False, True, True), "qv": (True, False, True)}
ALL = (True, True, True)


def _is_sm90() -> bool:
    return hopper_skip_reason("") is None


def _skip_unless_runs(dtype, kernel, D):
    if dtype == F32 and kernel != "auto":
        pytest.skip("float32 runs the simt kernels alone")
    if kernel == "wgmma" and (not _is_sm90() or D > 128):
        pytest.skip("kernel='wgmma' has a backward on sm_90 at head dims 33..128")


def _same_kernels(dtype, kernel, deterministic) -> bool:
    """Whether a subset runs the very kernels of the all-gradients run (bitwise equal results):
    every deterministic path is a dK/dV kernel plus a dQ kernel, and so is the mma.sync family's
    backward (kernel='mma', and kernel='auto' for 16-bit inputs off sm_90)."""
    return deterministic or kernel == "mma" or (dtype != F32 and kernel == "auto" and not _is_sm90())


def _tolerance(dtype) -> float:
    # Relative to the gradient's largest magnitude: the one-pass and two-kernel paths differ by
    # the order of fp32 sums and by the roundings of P and dS to 16 bits.
    return {F16: 1e-2, BF16: 2e-2, F32: 1e-4}[dtype]


def _inputs(dtype, D, varlen, seed):
    """GQA (4 query heads on 2 KV heads), lengths off every block size; packed: an empty
    sequence, one of a single row, Sq != Sk both ways."""
    if varlen:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((0, 130, 1, 77), (5, 140, 1, 200), 4, 2, D, dtype,
                                                         "cuda", seed=seed)
        return (q, k, v), dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    return make_inputs(2, 4, 2, 200, 260, D, dtype, "cuda", layout="bshd", seed=seed), None


def _call(qkv, varlen_args, **options):
    if varlen_args is None:
        return flash_cuda.attention(*qkv, return_lse=True, **options)
    return flash_cuda.varlen_attention(*qkv, **varlen_args, return_lse=True, **options)


def _backward(qkv, wanted, varlen_args, seed, **options):
    """The gradients of (out, lse) with upstream gradients of both (dlse included), for the
    inputs in `wanted`; .grad of the others."""
    leaves = [t.detach().requires_grad_(w) for t, w in zip(qkv, wanted)]
    out, lse = _call(leaves, varlen_args, **options)
    g = torch.Generator(device="cuda").manual_seed(seed)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, device="cuda", generator=g)
    torch.autograd.backward((out, lse), (dout, dlse))
    return [t.grad for t in leaves]


def _compare(part, full, wanted, dtype, bitwise, label):
    for name, got, ref, w in zip("qkv", part, full, wanted):
        if not w:
            assert got is None, f"{label}: d{name} computed although {name} does not require grad"
            continue
        assert got is not None and got.shape == ref.shape and got.dtype == ref.dtype
        assert torch.isfinite(got).all(), f"{label}: d{name} has non-finite elements"
        if bitwise:
            assert torch.equal(got, ref), f"{label}: d{name} differs from the all-gradients run"
        else:
            scale = ref.float().abs().max().item()
            tol = _tolerance(dtype)
            torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * scale,
                                       msg=lambda m: f"{label}: d{name}: {m}")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("kernel", ["auto", "mma", "wgmma"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=DTYPE_IDS.get)
def test_grad_subsets_match_all(dtype, varlen, is_causal, D, kernel, deterministic):
    _skip_unless_runs(dtype, kernel, D)
    qkv, varlen_args = _inputs(dtype, D, varlen, seed=D + is_causal)
    options = dict(is_causal=is_causal, kernel=kernel, deterministic=deterministic)
    full = _backward(qkv, ALL, varlen_args, seed=1, **options)
    bitwise = _same_kernels(dtype, kernel, deterministic)
    for name, wanted in SUBSETS.items():
        part = _backward(qkv, wanted, varlen_args, seed=1, **options)
        _compare(part, full, wanted, dtype, bitwise, f"{name} only ({options})")


@pytest.mark.parametrize("kernel", ["auto", "wgmma"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [F16, BF16], ids=DTYPE_IDS.get)
def test_grad_subsets_softcap(dtype, D, kernel):
    """Softcap's derivative: on sm_90 with deterministic=False kernel='auto' runs the subsets on
    the mma.sync kernels of their side, kernel='wgmma' (the warp-specialized kernel alone)
    computes every gradient and returns the ones asked for."""
    _skip_unless_runs(dtype, kernel, D)
    qkv, _ = _inputs(dtype, D, False, seed=7)
    options = dict(is_causal=True, kernel=kernel, softcap=5.0)
    full = _backward(qkv, ALL, None, seed=2, **options)
    for name, wanted in SUBSETS.items():
        part = _backward(qkv, wanted, None, seed=2, **options)
        _compare(part, full, wanted, dtype, _same_kernels(dtype, kernel, False), f"softcap, {name} only")


@pytest.mark.parametrize("dtype", [F16, F32], ids=DTYPE_IDS.get)
def test_grad_subsets_negative_scale(dtype):
    """A negative scale runs on -q: dQ alone is negated back as in the all-gradients run."""
    qkv, _ = _inputs(dtype, 64, False, seed=3)
    full = _backward(qkv, ALL, None, seed=3, scale=-0.1, deterministic=True)
    for name in ("q", "kv"):
        part = _backward(qkv, SUBSETS[name], None, seed=3, scale=-0.1, deterministic=True)
        _compare(part, full, SUBSETS[name], dtype, True, f"scale < 0, {name} only")


# ---- the work is skipped ----


def _backward_peak_bytes(qkv, wanted, **options):
    """Bytes the backward allocates at its peak beyond what was allocated before it."""
    leaves = [t.detach().requires_grad_(w) for t, w in zip(qkv, wanted)]
    out = flash_cuda.attention(*leaves, **options)
    dout = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out.backward(dout)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("D", [64, 128, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=DTYPE_IDS.get)
def test_grad_subsets_allocate_less(dtype, D, deterministic):
    """dQ alone allocates at least dK + dV less than all three, dK / dV alone at least dQ less
    (and, where the all-gradients run takes a one-pass kernel, no dQ accumulator either).
    Causal: the fp32 dK/dV kernel splits no key range then, so both runs plan no workspace."""
    q, k, v = make_inputs(2, 8, 2, 1024, 1024, D, dtype, "cuda", seed=D)
    options = dict(is_causal=True, deterministic=deterministic)
    peak_all = _backward_peak_bytes((q, k, v), ALL, **options)
    peak_q = _backward_peak_bytes((q, k, v), SUBSETS["q"], **options)
    peak_kv = _backward_peak_bytes((q, k, v), SUBSETS["kv"], **options)
    assert peak_all - peak_q >= k.nbytes + v.nbytes, (peak_all, peak_q)
    assert peak_all - peak_kv >= q.nbytes, (peak_all, peak_kv)


def _backward_kernels(qkv, wanted, **options):
    leaves = [t.detach().requires_grad_(w) for t, w in zip(qkv, wanted)]
    out = flash_cuda.attention(*leaves, **options)
    dout = torch.randn_like(out)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out.backward(dout)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [n for n in names if "flash_cuda" in n]


# Kernel names (csrc/tiers/*/bwd*.cuh): the dK/dV side, the dQ side, and the one-pass kernels
# that compute both.
_DKDV = re.compile(r"dkdv")
_DQ = re.compile(r"bwd_dq|convert_dq")
_ONE_PASS = re.compile(r"bwd_sm90_ws_kernel|bwd_sm90_wide_kernel")


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("kernel", ["auto", "mma"])
@pytest.mark.parametrize("D", [64, 256], ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", [BF16, F32], ids=DTYPE_IDS.get)
def test_grad_subsets_launch_one_side(dtype, D, kernel, deterministic):
    _skip_unless_runs(dtype, kernel, D)
    qkv = make_inputs(1, 4, 2, 512, 512, D, dtype, "cuda", seed=5)
    options = dict(is_causal=False, kernel=kernel, deterministic=deterministic)
    names = _backward_kernels(qkv, ALL, **options)
    if not names:
        pytest.skip("torch.profiler recorded no CUDA kernel here (no CUPTI)")
    q_only = _backward_kernels(qkv, SUBSETS["q"], **options)
    assert any(_DQ.search(n) for n in q_only), q_only
    assert not any(_DKDV.search(n) or _ONE_PASS.search(n) for n in q_only), q_only
    kv_only = _backward_kernels(qkv, SUBSETS["kv"], **options)
    assert any(_DKDV.search(n) for n in kv_only), kv_only
    assert not any(_DQ.search(n) or _ONE_PASS.search(n) for n in kv_only), kv_only
