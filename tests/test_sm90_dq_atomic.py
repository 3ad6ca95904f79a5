"""The Hopper backward with dQ added by atomics from the dK/dV kernel (FLASH_CUDA_SM90_DQ=atomic,
head dims 33..64 and 97..128, deterministic=False; csrc/kernels/sm90_bwd.cuh, accumulate_dq_atomic).
Opt-in until it is measured against the two-kernel path; these tests hold its gradients to the
float64 rule of every other kernel (tests/attn_check.py). GPU-only, sm_90 only."""


import pytest
import torch

from attn_check import check_attention, check_varlen_attention, hopper_skip_reason, make_alibi_slopes, \
    make_inputs, make_varlen_inputs


_SKIP = hopper_skip_reason("the Hopper backward")
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def atomic_dq(monkeypatch):
    monkeypatch.setenv("FLASH_CUDA_SM90_DQ", "atomic")


# (B, Hq, Hkv, Sq, Sk, D, is_causal, window, alibi, layout): block edges, Sq != Sk both ways,
# GQA (several query heads add into one K/V block's CTA), windows, ALiBi, strided views, a
# head dim below the bucket.
CASES = [
    (2, 4, 4, 1000, 1000, 128, False, (-1, -1), None, "bhsd"),
    (1, 8, 2, 777, 1029, 128, True, (-1, -1), None, "bshd"),
    (2, 4, 1, 1029, 300, 128, True, (-1, -1), "heads", "strided"),
    (1, 4, 2, 513, 700, 112, False, (100, 37), None, "offset"),
    (1, 2, 2, 65, 1, 128, False, (-1, -1), None, "bhsd"),
    (2, 4, 2, 1000, 1000, 64, True, (-1, -1), None, "bhsd"),
    (1, 6, 3, 300, 1200, 48, False, (64, 64), "heads", "strided"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,alibi,layout", CASES)
def test_atomic_dq_gradients(dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, alibi, layout):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk)
    slopes = make_alibi_slopes(Hq, device="cuda", seed=Sq) if alibi else None
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, alibi_slopes=slopes,
                    label="sm90 atomic dQ", seed=Sq)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_atomic_dq_packed_batch(dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((300, 0, 517, 64), (129, 5, 700, 64), 4, 2, 128, dtype,
                                                           seed=11)
    check_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, label="sm90 atomic dQ varlen")


def test_atomic_dq_negative_scale_and_large_values():
    q, k, v = make_inputs(1, 4, 2, 600, 600, 128, BF16, "cuda", seed=5)
    check_attention(q * 4, k, v, is_causal=False, scale=-0.2, label="sm90 atomic dQ scale<0", seed=5)


def test_deterministic_ignores_the_switch():
    """deterministic=True keeps the two-kernel path: bitwise equal gradients across runs."""
    import flash_cuda

    q, k, v = make_inputs(1, 4, 2, 1000, 1000, 128, BF16, "cuda", seed=9)
    grads = []
    for _ in range(2):
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_cuda.attention(qf, kf, vf, is_causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (qf, kf, vf), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))
