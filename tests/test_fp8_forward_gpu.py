"""flash_cuda.fp8.attention_fp8 on the GPU (Hopper): the FP8 (e4m3) forward against its specification,
flash_cuda.reference.attention_fp8_forward_blocked, by the 2x rule: out and lse against float64
attention on the dequantized inputs, within twice the error of the naive FP8 attention
(reference.attention_fp8_naive, its products on the FP8 tensor cores as the kernel's are:
test_reference_fp8.py, e4m3_tensor_core_matmul) plus a small term (assert_rule).
Descales per tensor and per (batch, KV head), GQA, causal and windows, softcap, Sq != Sk, lengths that
are no multiple of a tile, head dims 128 and 256, both output dtypes; rows that see no key; packed
batches (varlen_attention_fp8); bad arguments (flash_cuda/fp8.py checks them before the launch)."""

from __future__ import annotations

import pytest
import torch

from flash_cuda.fp8 import attention_fp8, varlen_attention_fp8
from flash_cuda.reference import attention_fp8_varlen_naive, attention_naive

from attn_check import hopper_skip_reason
from test_reference_fp8 import (F64, assert_rule, dequant64, e4m3_tensor_core_matmul, make_fp8, make_varlen_fp8,
                                naive_fp8_on_gpu)

_SKIP = hopper_skip_reason("the FP8 forward")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))]

DEV = "cuda"


def _to_dev(fp8, ds):
    q8, k8, v8 = (t.to(DEV) for t in fp8)
    return (q8, k8, v8), tuple(d if d is None else d.to(DEV) for d in ds)


def _check(B, Hq, Hkv, Sq, Sk, D, *, kind="bhkv", out_dtype=torch.bfloat16, seed=0, **opts):
    fp8, ds = make_fp8(B, Hq, Hkv, Sq, Sk, D, kind=kind, seed=seed)
    (q8, k8, v8), dsd = _to_dev(fp8, ds)
    out, lse = attention_fp8(q8, k8, v8, *dsd, out_dtype=out_dtype, return_lse=True, **opts)
    assert out.dtype == out_dtype and out.shape == (B, Hq, Sq, D) and lse.shape == (B, Hq, Sq)
    nout, nlse = naive_fp8_on_gpu(fp8, ds, out_dtype=out_dtype, **opts)
    rout, rlse = attention_naive(dequant64(fp8[0], ds[0]), dequant64(fp8[1], ds[1]), dequant64(fp8[2], ds[2]),
                                 **opts)
    assert_rule("out", out.cpu(), rout, nout)
    assert_rule("lse", lse.cpu(), rlse, nlse, atol_rel=2.0 ** -18)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk", [(2, 4, 4, 300, 300), (1, 8, 2, 1000, 777), (2, 2, 1, 130, 1029),
                                           (1, 4, 4, 1, 513), (1, 2, 2, 2048, 2048)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_against_spec(D, B, Hq, Hkv, Sq, Sk, is_causal):
    _check(B, Hq, Hkv, Sq, Sk, D, is_causal=is_causal, seed=Sq + Sk + D)


@pytest.mark.parametrize("kind", ["one", "tensor", "saturate"])
def test_descale_forms(kind):
    _check(2, 4, 2, 257, 300, 128, kind=kind, is_causal=True, seed=7)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_out_dtypes(out_dtype):
    _check(1, 4, 4, 400, 400, 128, out_dtype=out_dtype, seed=3)


@pytest.mark.parametrize("window", [(64, 0), (100, 37), (-1, 50)])
def test_windows(window):
    _check(1, 4, 2, 700, 650, 128, window_size=window, seed=window[0] + 5)


@pytest.mark.parametrize("softcap,causal,D", [(30.0, True, 128), (5.0, False, 256), (50.0, False, 64)])
def test_softcap(softcap, causal, D):
    # Softcap on the dequantized logits (scale q_descale k_descale q8.k8), then the mask; the
    # default descales' spread makes logits near 300, so 5 and 30 cap hard.
    _check(2, 4, 2, 333, 517, D, is_causal=causal, softcap=softcap, seed=int(softcap) + D)
    _check(1, 2, 2, 200, 200, D, kind="tensor", softcap=softcap, window_size=(50, 10), seed=3)


def test_rows_without_keys():
    # Sq > Sk under a causal mask: the first Sq - Sk rows see no key (out 0, lse -inf).
    fp8, ds = make_fp8(1, 2, 2, 300, 100, 128, seed=11)
    (q8, k8, v8), dsd = _to_dev(fp8, ds)
    out, lse = attention_fp8(q8, k8, v8, *dsd, is_causal=True, return_lse=True)
    assert torch.all(out[:, :, :200] == 0) and torch.all(torch.isneginf(lse[:, :, :200]))
    _check(1, 2, 2, 300, 100, 128, is_causal=True, seed=11)


def test_strided_views():
    # (B, S, H, D) transposed: rows 16-byte aligned, stride(-1) 1; the same as contiguous inputs.
    fp8, ds = make_fp8(2, 4, 4, 333, 333, 128, seed=21)
    (q8, k8, v8), dsd = _to_dev(fp8, ds)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q8, k8, v8)]
    assert not views[0].is_contiguous()
    a = attention_fp8(q8, k8, v8, *dsd)
    b = attention_fp8(*views, *dsd)
    assert torch.equal(a, b)


def test_bad_arguments():
    fp8, ds = make_fp8(1, 2, 2, 64, 64, 128, seed=1)
    (q8, k8, v8), _ = _to_dev(fp8, ds)
    with pytest.raises(ValueError, match="per \\(batch, KV head\\) of shape \\(1, 2\\)"):
        attention_fp8(q8, k8, v8, torch.ones(3, device=DEV))
    with pytest.raises(TypeError, match="float32"):
        attention_fp8(q8, k8, v8, torch.ones((), device=DEV, dtype=torch.float16))
    with pytest.raises(TypeError, match="mixed FP8 / 16-bit"):
        attention_fp8(q8, k8.to(torch.bfloat16), v8)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        attention_fp8(*(t[..., :96] for t in (q8, k8, v8)))


@pytest.mark.parametrize("block_n", ["128", "224"])
@pytest.mark.parametrize("case", [(2, 4, 2, 300, 777, True), (1, 2, 2, 1000, 1000, False)])
def test_key_step_rungs(monkeypatch, block_n, case):
    # The ablation rung FLASH_CUDA_SM90_FP8_BLOCK_N (fwd/ablation.cuh): the d = 128 forward over 128
    # or 224 keys per step (V^T in 128- or 32-key slabs) under the same rule as the default.
    from flash_cuda import _ext
    if not _ext.ablations():
        pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
    monkeypatch.setenv("FLASH_CUDA_SM90_FP8_BLOCK_N", block_n)
    B, Hq, Hkv, Sq, Sk, causal = case
    _check(B, Hq, Hkv, Sq, Sk, 128, is_causal=causal, seed=int(block_n) + Sq)


def _run_varlen(lens_q, lens_k, Hq, Hkv, D, seed=0, **opts):
    """varlen_attention_fp8 on make_varlen_fp8's packed batch: the inputs (CPU), their device
    copies, and (out, lse)."""
    (q8, k8, v8), ds, cu_q, cu_k = make_varlen_fp8(lens_q, lens_k, Hq, Hkv, D, seed=seed)
    dev = [t.to(DEV) for t in (q8, k8, v8)]
    dsd = [d.to(DEV) for d in ds]
    out, lse = varlen_attention_fp8(*dev, cu_q.to(DEV), cu_k.to(DEV), max(lens_q), max(lens_k), *dsd,
                                    return_lse=True, check_cu_seqlens=True, **opts)
    return (q8, k8, v8), ds, cu_q, cu_k, dev, dsd, out, lse


def _check_varlen(lens_q, lens_k, Hq, Hkv, D, seed=0, **opts):
    """varlen_attention_fp8 against float64 attention per sequence, within twice the error of the
    naive FP8 attention on the tensor cores (each sequence as attention_fp8 would take it alone)."""
    (q8, k8, v8), ds, cu_q, cu_k, dev, dsd, out, lse = _run_varlen(lens_q, lens_k, Hq, Hkv, D, seed, **opts)
    assert out.shape == q8.shape and lse.shape == (Hq, sum(lens_q))
    nout, nlse = attention_fp8_varlen_naive(*dev, cu_q.to(DEV), cu_k.to(DEV), *dsd, matmul=e4m3_tensor_core_matmul,
                                            **opts)
    rout = torch.zeros(q8.shape, dtype=F64)
    rlse = torch.full((Hq, sum(lens_q)), float("-inf"), dtype=F64)
    for b in range(len(lens_q)):
        qa, qb, ka, kb = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        seq = [dequant64(t[a:e].transpose(0, 1).unsqueeze(0), d[b:b + 1])
               for t, a, e, d in ((q8, qa, qb, ds[0]), (k8, ka, kb, ds[1]), (v8, ka, kb, ds[2]))]
        o, l = attention_naive(*seq, **opts)
        rout[qa:qb] = o[0].transpose(0, 1)
        rlse[:, qa:qb] = l[0]
    assert_rule("out", out.cpu(), rout, nout.cpu())
    assert_rule("lse", lse.cpu(), rlse, nlse.cpu(), atol_rel=2.0 ** -18)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("opts", [{}, {"is_causal": True}, {"window_size": (70, 20)}, {"softcap": 30.0, "is_causal": True}])
def test_varlen(D, opts):
    # Lengths off the tiles' edges, an empty query sequence, Sq > Sk (rows without keys under the
    # causal mask), one sequence longer than a key step, GQA.
    _check_varlen([5, 0, 300, 129, 40], [9, 3, 257, 400, 1], 4, 2, D, seed=D, **opts)


def test_varlen_one_sequence_is_dense():
    (q8, k8, v8), ds, cu_q, cu_k = make_varlen_fp8([333], [517], 4, 2, 128, seed=5)
    dev = [t.to(DEV) for t in (q8, k8, v8)]
    dsd = [d.to(DEV) for d in ds]
    packed = varlen_attention_fp8(*dev, cu_q.to(DEV), cu_k.to(DEV), 333, 517, *dsd, is_causal=True)
    dense = attention_fp8(*(t.transpose(0, 1).unsqueeze(0) for t in dev), *dsd, is_causal=True)
    assert torch.equal(packed, dense[0].transpose(0, 1))
