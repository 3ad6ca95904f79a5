"""The merge of two partial results (core/combine.cuh: merge_partials_kernel), which
context-parallel attention (flash_cuda.distributed) runs after each ring step: the partials of
the same rows over two halves of the keys, merged, must give the attention over all keys (out,
lse, and for float32 the per-row (m, log2 l) statistics the fp32 backward reads), with out in
float32 or the input dtype, in place over the first partial, on strided row slices, and with rows
that one partial never saw. GPU only.
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda import _ext, ops
from flash_cuda.validation import ScoreOptions
from flash_cuda.reference import combine_splits

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
_EPS = {F16: 2.0 ** -11, BF16: 2.0 ** -8, F32: 2.0 ** -20}  # half an ulp at 1 (fp32: the kernels use approximate exp2)


def _partials(dtype, B=2, H=3, S=40, D=64, split=29, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, H, S if i == 0 else 70, D, device="cuda", generator=g).to(dtype) for i in range(3))
    scale = D ** -0.5
    run = lambda kk, vv: ops.fwd_impl(q, kk, vv, ScoreOptions(scale), 0)  # noqa: E731
    return run(k[:, :, :split], v[:, :, :split]), run(k[:, :, split:], v[:, :, split:]), run(k, v)


def _merge(a, b, out, with_stats):
    (oa, la, sa), (ob, lb, sb), (oo, lo, so) = a, b, out
    _ext.require().merge_partials(oa, la, sa if with_stats else None, ob, lb, sb if with_stats else None, oo, lo,
                                  so if with_stats else None)


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("out_f32", [False, True], ids=["out_input_dtype", "out_fp32"])
@pytest.mark.parametrize("a_f32", [False, True], ids=["a_input_dtype", "a_fp32"])
def test_merge_equals_attention_over_all_keys(dtype, out_f32, a_f32):
    (oa, la, sa), (ob, lb, sb), (o, lse, stats) = _partials(dtype)
    if a_f32:
        oa = oa.float()
    out = torch.full(o.shape, math.nan, device="cuda", dtype=F32 if out_f32 else dtype)
    out_lse = torch.full_like(lse, math.nan)
    with_stats = dtype == F32
    out_stats = torch.full_like(stats, math.nan) if with_stats else None
    _merge((oa, la, sa), (ob, lb, sb), (out, out_lse, out_stats), with_stats)
    ref_o, ref_lse = combine_splits([oa.float(), ob.float()], [la, lb], out.dtype)
    # One rounding of out apart (none for float32 out) from the float64-exact combine of the
    # same partials; and against attention over every key, the roundings of the two partials,
    # of out and of the single call's output.
    scale = float(o.float().abs().max())
    assert (out.float() - ref_o.float()).abs().max() <= (2e-6 if out.dtype == F32 else 2 * _EPS[dtype]) * scale
    assert torch.allclose(out_lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert (out.float() - o.float()).abs().max() <= 6 * _EPS[dtype] * scale
    assert torch.allclose(out_lse, lse, atol=1e-4, rtol=1e-5)
    if with_stats:
        assert torch.equal(out_stats[..., 0], stats[..., 0])  # the max of the two maxima
        assert torch.allclose(out_stats[..., 1], stats[..., 1], atol=1e-5)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "fp32"])
def test_merge_in_place_on_row_slices(dtype):
    """out is a itself, and every operand a slice of rows of a larger tensor (the ring merges
    the rows a call covers in place)."""
    (oa, la, sa), (ob, lb, sb), (o, lse, stats) = _partials(dtype, S=48)
    rows = slice(8, 40)
    acc_o, acc_l, acc_s = oa.clone(), la.clone(), sa.clone()
    with_stats = dtype == F32
    cut = lambda t: t[:, :, rows] if t.dim() > 1 else None  # noqa: E731  (bf16: no stats)
    view = (cut(acc_o), cut(acc_l), cut(acc_s))
    _merge(view, (cut(ob), cut(lb), cut(sb)), view, with_stats)
    assert (acc_o[:, :, rows].float() - o[:, :, rows].float()).abs().max() <= 6 * _EPS[dtype] * float(o.abs().max())
    assert torch.allclose(acc_l[:, :, rows], lse[:, :, rows], atol=1e-4, rtol=1e-5)
    # Rows outside the slice untouched.
    for got, before in ((acc_o, oa), (acc_l, la)):
        assert torch.equal(got[:, :, :8], before[:, :, :8]) and torch.equal(got[:, :, 40:], before[:, :, 40:])


def test_rows_one_partial_never_saw():
    """lse = -inf marks a row a partial never saw: its O is not read (NaN there stays out),
    the other partial's O comes through exactly; a row neither saw gets O = 0 and lse = -inf."""
    (oa, la, sa), (ob, lb, sb), _ = _partials(BF16)
    oa, la, ob, lb = oa.clone(), la.clone(), ob.clone(), lb.clone()
    oa[:, :, :5] = math.nan
    la[:, :, :5] = -math.inf
    ob[:, :, 3:9] = math.nan
    lb[:, :, 3:9] = -math.inf
    out = torch.empty_like(oa)
    out_lse = torch.empty_like(la)
    _merge((oa, la, None), (ob, lb, None), (out, out_lse, None), False)
    # (lse goes through log2 units and back: equal to a rounding)
    assert torch.equal(out[:, :, :3], ob[:, :, :3]) and torch.allclose(out_lse[:, :, :3], lb[:, :, :3], rtol=1e-6)
    assert bool((out[:, :, 3:5] == 0).all()) and bool((out_lse[:, :, 3:5] == -math.inf).all())
    assert torch.equal(out[:, :, 5:9], oa[:, :, 5:9]) and torch.allclose(out_lse[:, :, 5:9], la[:, :, 5:9], rtol=1e-6)
    assert bool(torch.isfinite(out).all())


def test_merge_rejects_bad_operands():
    """The binding's checks raise, with the shapes in the message."""
    (oa, la, _), (ob, lb, _), _ = _partials(BF16)
    C = _ext.require()
    with pytest.raises(RuntimeError, match=r"same shape, got \[2, 3, 10, 64\]"):
        C.merge_partials(oa[:, :, :10], la[:, :, :10], None, ob, lb, None, ob, lb, None)
    with pytest.raises(RuntimeError, match="dtype"):
        C.merge_partials(oa.half(), la, None, ob, lb, None, ob, lb, None)
    with pytest.raises(RuntimeError, match="lse"):
        C.merge_partials(oa, la.double(), None, ob, lb, None, ob, lb, None)
    assert flash_cuda.is_available()
