"""Bad arguments to flash_cuda.attention_with_kvcache raise a clear Python exception before anything
is written or launched. Runs without a GPU: CPU tensors pass every check but the last (they are
not CUDA tensors), so each error below is raised by the check it names."""

from __future__ import annotations

import pytest
import torch

import flash_cuda

BF16 = torch.bfloat16


def _args(B=2, Hq=8, Hkv=2, Sq=1, D=64, cap=128, s_new=1, dtype=BF16):
    q = torch.randn(B, Hq, Sq, D, dtype=dtype)
    kc = torch.randn(B, Hkv, cap, D, dtype=dtype)
    vc = torch.randn(B, Hkv, cap, D, dtype=dtype)
    k = torch.randn(B, Hkv, s_new, D, dtype=dtype) if s_new else None
    v = torch.randn(B, Hkv, s_new, D, dtype=dtype) if s_new else None
    return q, kc, vc, k, v


def _raises(kind, match, *args, **kwargs):
    kwargs.setdefault("cache_seqlens", 3)
    with pytest.raises(kind, match=match):
        flash_cuda.attention_with_kvcache(*args, **kwargs)


def test_valid_call_reaches_the_device_check():
    _raises(RuntimeError, "must be CUDA tensors", *_args())


def test_types_and_ranks():
    q, kc, vc, k, v = _args()
    _raises(TypeError, "q must be a torch.Tensor", q.tolist(), kc, vc, k, v)
    _raises(ValueError, "k_cache must be a 4-D tensor", q, kc[0], vc, k, v)
    _raises(ValueError, "contiguous last dimension", q, kc.transpose(2, 3), vc, k, v)
    _raises(TypeError, "float16 or bfloat16", q.float(), kc.float(), vc.float(), k.float(), v.float())
    _raises(TypeError, "k_cache must have q's dtype", q, kc.half(), vc, k, v)
    _raises(TypeError, "v must have q's dtype", q, kc, vc, k, v.half())


def test_shapes():
    q, kc, vc, k, v = _args()
    _raises(ValueError, "same shape", q, kc, vc[:, :, :64], k, v)
    _raises(ValueError, "head dim", q, kc[..., :32].contiguous(), vc[..., :32].contiguous(), k, v)
    _raises(ValueError, "multiple of the caches' kv heads", q[:, :7], kc, vc, k, v)
    _raises(ValueError, "q's batch size", q[:1], kc, vc, k[:1], v[:1])
    _raises(ValueError, "at least one query", q[:, :, :0], kc, vc, k, v)
    _raises(ValueError, "both have shape", q, kc, vc, k[:, :1], v[:, :1])
    _raises(ValueError, "both k and v", q, kc, vc, k, None)
    q2, kc2, vc2, k2, v2 = _args(D=12)
    _raises(ValueError, "unsupported head dim 12", q2, kc2, vc2, k2, v2)


def test_cache_lengths():
    q, kc, vc, k, v = _args(cap=128, s_new=2)
    _raises(ValueError, "needs 129 positions", q, kc, vc, k, v, cache_seqlens=127)
    _raises(ValueError, ">= 0", q, kc, vc, k, v, cache_seqlens=-1)
    _raises(TypeError, "int32 tensor, got int64", q, kc, vc, k, v, cache_seqlens=torch.zeros(2, dtype=torch.int64))
    _raises(ValueError, r"shape \(2,\)", q, kc, vc, k, v, cache_seqlens=torch.zeros(3, dtype=torch.int32))
    _raises(TypeError, "an int or an int32 tensor", q, kc, vc, k, v, cache_seqlens=1.5)
    _raises(TypeError, "an int or an int32 tensor", q, kc, vc, k, v, cache_seqlens=True)


def test_paged_cache():
    q, _, _, k, v = _args()
    pool = torch.randn(10, 2, 16, 64, dtype=BF16)
    table = torch.zeros(2, 8, dtype=torch.int32)
    _raises(RuntimeError, "must be CUDA tensors", q, pool, pool.clone(), k, v, block_table=table)
    _raises(TypeError, "block_table must be an int32", q, pool, pool.clone(), k, v, block_table=table.long())
    _raises(ValueError, r"block_table must have shape \(2, ", q, pool, pool.clone(), k, v, block_table=table[:1])
    odd = torch.randn(10, 2, 24, 64, dtype=BF16)
    _raises(ValueError, "multiple of 16, got 24", q, odd, odd.clone(), k, v, block_table=table)
    # capacity = 8 pages * 16 = 128 positions per sequence
    _raises(ValueError, "holds 128 per", q, pool, pool.clone(), k, v, block_table=table, cache_seqlens=128)


def test_alignment_of_the_cache():
    q, kc, vc, k, v = _args(D=64)
    wide = torch.randn(2, 2, 128, 72, dtype=BF16)[..., 4:68]  # rows start 8 bytes off
    _raises(ValueError, "16-byte aligned", q, wide, wide.clone(), k, v)


def test_options():
    args = _args()
    _raises(ValueError, r"num_splits must be an int in \[0, 256\]", *args, num_splits=-1)
    _raises(ValueError, "num_splits", *args, num_splits=1000)
    _raises(ValueError, "num_splits", *args, num_splits=2.0)
    _raises(TypeError, "is_causal must be a bool", *args, is_causal=1)
    _raises(TypeError, "return_lse must be a bool", *args, return_lse=None)
    _raises(ValueError, "window_size right", *args, is_causal=True, window_size=(4, 2))
    _raises(ValueError, "softcap must be a finite", *args, softcap=-1.0)
    _raises(ValueError, "scale must be a finite", *args, scale=float("nan"))
    _raises(ValueError, "alibi_slopes must have shape", *args, alibi_slopes=torch.ones(3))
    _raises(TypeError, "alibi_slopes must be a float32", *args, alibi_slopes=torch.ones(8, dtype=torch.float64))


def test_devices_compared_by_type_and_index():
    """A cache on another device type with the same index (a meta tensor beside CPU ones: both
    report get_device() == -1, as cuda:0 and xpu:0 both report 0) is named as on another device,
    not taken for q's device (nor served a signature kept for q's device)."""
    q, kc, vc, k, v = _args()
    _raises(RuntimeError, "must be CUDA tensors", q, kc, vc, k, v)  # the signature of CPU tensors, seen once
    _raises(RuntimeError, "k_cache must be on q's device", q, kc.to("meta"), vc, k, v)
    _raises(RuntimeError, "v_cache must be on q's device", q, kc, vc.to("meta"), k, v)
