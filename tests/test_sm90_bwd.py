"""The Hopper backward's three shapes (launch.h: sm90_bwd_mode), each held to the float64 rule of
every other kernel (tests/attn_check.py), head dims 33..128 (65..96 on the 128-wide kernels), deterministic=False:
  ws      (default) the warp-specialized kernel, csrc/kernels/sm90_bwd_ws.cuh: a TMA producer,
          5 products per block pair, dQ into an fp32 workspace (dense batches) by a writer warp's
          bulk reductions (one dS^T buffer at d = 64, two at d = 128)
  ws_red  the same kernel with dQ by atomics (FLASH_CUDA_SM90_BWD_DQ_RED=1)
  atomic  the cp.async dK/dV kernel adding dQ by atomics (sm90_bwd.cuh, accumulate_dq_atomic)
  split   the cp.async dK/dV kernel and a dQ kernel (deterministic=True always runs this one)
GPU-only, sm_90 only."""


import pytest
import torch

from attn_check import check_attention, check_varlen_attention, hopper_skip_reason, make_alibi_slopes, \
    make_inputs, make_varlen_inputs


_SKIP = hopper_skip_reason("the Hopper backward")
pytestmark = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))

F16, BF16 = torch.float16, torch.bfloat16


MODES = ["ws", "ws_red", "atomic", "split"]


@pytest.fixture(params=MODES, autouse=True)
def mode(request, monkeypatch):
    monkeypatch.setenv("FLASH_CUDA_SM90_BWD", request.param.replace("_red", ""))
    if request.param == "ws_red":
        monkeypatch.setenv("FLASH_CUDA_SM90_BWD_DQ_RED", "1")
    else:
        monkeypatch.delenv("FLASH_CUDA_SM90_BWD_DQ_RED", raising=False)
    return request.param


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
    # Query blocks no key of a warpgroup sees (Sq > Sk causal: rows with no key at all; a short
    # window), several query heads per CTA with a two-stage ring that wraps many times.
    (1, 4, 1, 1500, 300, 64, True, (-1, -1), None, "bshd"),
    (2, 8, 2, 900, 900, 128, False, (40, 0), None, "bhsd"),
    # Head dims 65..96 on the 128-wide kernel: the columns past d arrive as TMA's zeros.
    (2, 4, 2, 1000, 1100, 96, True, (-1, -1), None, "bshd"),
    (1, 4, 4, 300, 257, 80, False, (-1, -1), "heads", "strided"),
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window,alibi,layout", CASES)
def test_sm90_bwd_gradients(mode, dtype, B, Hq, Hkv, Sq, Sk, D, is_causal, window, alibi, layout):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk)
    slopes = make_alibi_slopes(Hq, device="cuda", seed=Sq) if alibi else None
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, alibi_slopes=slopes,
                    label=f"sm90 bwd {mode}", seed=Sq)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_sm90_bwd_packed_batch(mode, dtype):
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((300, 0, 517, 64), (129, 5, 700, 64), 4, 2, 128, dtype,
                                                           seed=11)
    check_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, label=f"sm90 bwd {mode} varlen")


def test_sm90_bwd_negative_scale_and_large_values(mode):
    q, k, v = make_inputs(1, 4, 2, 600, 600, 128, BF16, "cuda", seed=5)
    check_attention(q * 4, k, v, is_causal=False, scale=-0.2, label=f"sm90 bwd {mode} scale<0", seed=5)


def test_deterministic_ignores_the_switch(mode):
    """deterministic=True keeps the two-kernel path: bitwise equal gradients across runs."""
    import flash_cuda

    q, k, v = make_inputs(1, 4, 2, 1000, 1000, 128, BF16, "cuda", seed=9)
    grads = []
    for _ in range(2):
        qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_cuda.attention(qf, kf, vf, is_causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out, (qf, kf, vf), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("unset", [False, True], ids=["set", "unset"])
def test_each_mode_runs_its_kernels(mode, unset, D, monkeypatch):
    """The route: the profiler sees the kernel each mode names (dQ's own kernel only in split, the
    bulk-reduction variant of the warp-specialized kernel only in ws); with the
    switch unset the warp-specialized kernel runs."""
    import re

    import flash_cuda

    if unset:
        if mode != "ws":
            pytest.skip("the unset switch is the ws default")
        monkeypatch.delenv("FLASH_CUDA_SM90_BWD")
    q, k, v = make_inputs(1, 4, 2, 512, 512, D, BF16, "cuda", seed=3)
    qf, kf, vf = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.attention(qf, kf, vf, is_causal=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(out, (qf, kf, vf), torch.ones_like(out))
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert ("bwd_sm90_ws_kernel" in names) == mode.startswith("ws"), names
    assert ("bwd_dq_sm90_kernel" in names) == (mode == "split"), names
    # WsBwdConfig<BwdTraits<D>, kBulkDq, kStages>: the demangler writes the bool as true or (bool)1.
    bulk = re.search(r"WsBwdConfig<[^<>]*BwdTraits<[^<>]*>\s*,\s*(true|\(bool\)1)", names) is not None
    assert bulk == (mode == "ws"), names
