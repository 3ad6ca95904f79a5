"""attention(dropout_p=...) through the Python layer on CPU: the custom ops, the eager path and
autograd with the forward's record of its draws (rng_state) reaching the backward, checked
through the CPU stand-in of the extension (conftest.mock_extension, which draws its mask with
flash_cuda.reference's dropout spec and records it as the kernels do); the validation of
dropout_p.
"""

from __future__ import annotations

import pytest
import torch

import flash_cuda
from flash_cuda import reference as R


def _inputs(dtype=torch.bfloat16, B=2, Hq=4, Hkv=2, S=48, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    do = torch.randn(B, Hq, S, D, generator=g).to(dtype)
    return q, k, v, do


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dropout_forward_backward_use_one_mask(mock_extension, monkeypatch, is_causal, path, dtype):
    if path == "op":  # the torch.library ops instead of the eager autograd Function
        monkeypatch.setattr(flash_cuda.ops, "eager_ok", lambda *t: False)
    q, k, v, do = _inputs(dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_cuda.attention(*leaves, is_causal=is_causal, dropout_p=0.25)
    out.backward(do)
    seed, offset = (int(x) for x in mock_extension.last_rng.tolist())
    mask = R.dropout_keep_mask(2, 4, 48, 48, 0.25, seed=seed, offset=offset)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = R.attention_naive(*ref_leaves, is_causal=is_causal, dropout_p=0.25, dropout_mask=mask)
    ref_grads = torch.autograd.grad((ref * do.double()).sum(), ref_leaves)
    assert torch.allclose(out.double(), ref, atol=3e-2)
    for name, leaf, g in zip("qkv", leaves, ref_grads):
        assert torch.allclose(leaf.grad.double(), g, atol=6e-2, rtol=3e-2), name
    # the mask is not the no-dropout result
    plain, _ = R.attention_naive(q.double(), k.double(), v.double(), is_causal=is_causal)
    assert (out.double() - plain).abs().max() > 0.1


def test_dropout_draws_follow_the_torch_seed(mock_extension):
    q, k, v, _ = _inputs()
    torch.manual_seed(7)
    a = flash_cuda.attention(q, k, v, dropout_p=0.5)
    b = flash_cuda.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(7)
    c = flash_cuda.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, c) and not torch.equal(a, b)


def test_zero_dropout_is_plain_attention(mock_extension):
    q, k, v, _ = _inputs()
    assert torch.equal(flash_cuda.attention(q, k, v, dropout_p=0.0), flash_cuda.attention(q, k, v))


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.1", True, None])
def test_dropout_p_is_checked(mock_extension, bad):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="dropout_p must be a number in \\[0, 1\\]"):
        flash_cuda.attention(q, k, v, dropout_p=bad)


def test_dropout_is_refused_on_the_hopper_kernel_alone(mock_extension):
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="kernel='auto', 'mma' \\(float16 / bfloat16\\) or 'simt'"):
        flash_cuda.attention(q, k, v, dropout_p=0.1, kernel="wgmma")
    flash_cuda.attention(q, k, v, dropout_p=0.1, kernel="mma")
    q, k, v, _ = _inputs(torch.float32)
    for kernel in ("auto", "simt"):
        assert flash_cuda.attention(q, k, v, dropout_p=0.1, kernel=kernel).dtype == torch.float32


@pytest.mark.parametrize("path", ["eager", "op"])
def test_packed_dropout_forward_backward_use_one_mask(mock_extension, monkeypatch, path):
    if path == "op":
        monkeypatch.setattr(flash_cuda.ops, "eager_ok", lambda *t: False)
    g = torch.Generator().manual_seed(4)
    lq, lk = [9, 30, 0, 17], [12, 30, 3, 17]
    cq = torch.tensor([0, 9, 39, 39, 56], dtype=torch.int32)
    ck = torch.tensor([0, 12, 42, 45, 62], dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 16, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(sum(lk), 2, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_cuda.varlen_attention(*leaves, cq, ck, max(lq), max(lk), is_causal=True, dropout_p=0.3)
    out.backward(do)
    seed, offset = (int(x) for x in mock_extension.last_rng.tolist())
    masks = R.dropout_keep_masks_varlen(cq, ck, 4, 0.3, seed=seed, offset=offset)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = R.attention_varlen_naive(*ref_leaves, cq, ck, is_causal=True, dropout_p=0.3, dropout_masks=masks)
    ref_grads = torch.autograd.grad((ref * do.double()).sum(), ref_leaves)
    assert torch.allclose(out.double(), ref, atol=3e-2)
    for name, leaf, gr in zip("qkv", leaves, ref_grads):
        assert torch.allclose(leaf.grad.double(), gr, atol=6e-2, rtol=3e-2), name
