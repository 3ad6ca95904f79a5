"""flash_cuda.fp8.attention_fp8's argument checks that need no GPU (flash_cuda/fp8.py): each bad argument
is refused with a message that names it and what is accepted, before anything reaches the device."""

from __future__ import annotations

import pytest
import torch

from flash_cuda.fp8 import attention_fp8, varlen_attention_fp8

E4M3 = torch.float8_e4m3fn


def _t(*shape, dtype=E4M3):
    return torch.zeros(shape).to(dtype)


def test_dtypes():
    q = _t(1, 2, 8, 128)
    with pytest.raises(TypeError, match="only the e4m3 FP8 format"):
        attention_fp8(q, q.to(torch.float8_e5m2), q)
    with pytest.raises(TypeError, match="mixed FP8 / 16-bit operands"):
        attention_fp8(q, _t(1, 2, 8, 128, dtype=torch.bfloat16), q)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        attention_fp8(q, q, None)


def test_shapes():
    with pytest.raises(ValueError, match="must be 4-d"):
        attention_fp8(_t(2, 8, 128), _t(2, 8, 128), _t(2, 8, 128))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attention_fp8(_t(1, 2, 8, 128), _t(1, 2, 8, 128), _t(1, 2, 9, 128))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        attention_fp8(_t(1, 3, 8, 128), _t(1, 2, 8, 128), _t(1, 2, 8, 128))
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 128, 256\)"):
        attention_fp8(_t(1, 2, 8, 96), _t(1, 2, 8, 96), _t(1, 2, 8, 96))


def test_options():
    q = _t(1, 2, 8, 128)
    with pytest.raises(TypeError, match="out_dtype must be torch.bfloat16 or torch.float16"):
        attention_fp8(q, q, q, out_dtype=torch.float32)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        attention_fp8(q, q, q, is_causal=1)
    with pytest.raises(ValueError, match="window"):
        attention_fp8(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap must be a finite real number >= 0"):
        attention_fp8(q, q, q, softcap=-1.0)
    with pytest.raises(TypeError, match="softcap must be a finite real number"):
        attention_fp8(q, q, q, softcap="30")


def test_no_backward_and_cuda_only():
    q = _t(1, 2, 8, 128)
    qg = q.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="no backward"):
        attention_fp8(qg, q, q)
    with pytest.raises(RuntimeError, match="must be CUDA tensors"):
        attention_fp8(q, q, q)


def test_attention_points_fp8_inputs_to_attention_fp8():
    import flash_cuda
    q = _t(1, 2, 8, 128)
    with pytest.raises(TypeError, match=r"float8_e4m3fn.*flash_cuda\.attention_fp8, forward only, on Hopper"):
        flash_cuda.attention(q, q, q)
    with pytest.raises(TypeError, match="supported dtypes") as e5m2:
        flash_cuda.attention(*(q.to(torch.float8_e5m2),) * 3)
    assert "attention_fp8" not in str(e5m2.value)


def test_varlen_checks():
    q = _t(10, 2, 128)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"varlen_attention_fp8: q, k, v must be 3-d \(total, heads, head_dim\)"):
        varlen_attention_fp8(_t(1, 10, 2, 128), q, q, cu, cu, 6, 6)
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 tensor"):
        varlen_attention_fp8(q, q, q, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="same length"):
        varlen_attention_fp8(q, q, q, cu, cu[:2], 6, 6)
    with pytest.raises(TypeError, match="max_seqlen_k must be a Python int"):
        varlen_attention_fp8(q, q, q, cu, cu, 6, 6.0)
    with pytest.raises(TypeError, match="only the e4m3 FP8 format"):
        varlen_attention_fp8(q, q.to(torch.float8_e5m2), q, cu, cu, 6, 6)
    with pytest.raises(RuntimeError, match="must be CUDA tensors"):
        varlen_attention_fp8(q, q, q, cu, cu, 6, 6)


def test_batch_times_kv_heads_is_bounded():
    # V's layout launch takes a (batch, KV head) per grid z index: refused before anything runs.
    q = torch.empty(0).to(E4M3).new_empty((65536, 1, 1, 128))
    with pytest.raises(ValueError, match=r"batch \* kv_heads \(65536 \* 1\) must be at most 65535"):
        attention_fp8(q, q, q)
