"""flash_cuda under torch.autocast: floating inputs run in the autocast dtype, as SDPA's do, and
gradients come back in the inputs' own dtypes."""

from __future__ import annotations

import pytest
import torch

import flash_cuda

from attn_check import gpu_skip_reason, make_varlen_inputs

pytestmark = pytest.mark.skipif(gpu_skip_reason() is not None, reason=str(gpu_skip_reason()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Sq", [1, 300])
def test_fp32_inputs_run_in_the_autocast_dtype(dtype, Sq):
    torch.manual_seed(0)
    q = torch.randn(2, 8, Sq, 64, device="cuda", requires_grad=True)
    k = torch.randn(2, 2, 300, 64, device="cuda", requires_grad=True)
    v = torch.randn(2, 2, 300, 64, device="cuda", requires_grad=True)
    dout = torch.randn(2, 8, Sq, 64, device="cuda", dtype=dtype)
    with torch.autocast("cuda", dtype=dtype):
        out = flash_cuda.attention(q, k, v, is_causal=True, deterministic=True)  # (bitwise dq below)
    assert out.dtype == dtype
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert all(g.dtype == torch.float32 for g in grads)
    qc, kc, vc = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    ref = flash_cuda.attention(qc, kc, vc, is_causal=True, deterministic=True)
    ref_grads = torch.autograd.grad(ref, (qc, kc, vc), dout)
    assert torch.equal(out, ref)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r.float())


def test_mixed_dtypes_under_autocast_and_outside():
    q = torch.randn(1, 4, 33, 64, device="cuda")
    k = torch.randn(1, 4, 40, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 4, 40, 64, device="cuda", dtype=torch.float16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = flash_cuda.attention(q, k, v)
    assert out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="same dtype"):
        flash_cuda.attention(q, k, v)


def test_varlen_under_autocast():
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs((5, 70), (90, 3), 4, 2, 64, torch.float32, "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out = flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, is_causal=True)
    assert out.dtype == torch.float16
    ref = flash_cuda.varlen_attention(q.half(), k.half(), v.half(), cu_q, cu_k, mq, mk, is_causal=True)
    assert torch.equal(out, ref)
