"""flash_cuda.attention_with_kvcache over FP8 (float8_e4m3fn) caches on the GPU: dense and paged
caches, the quantized append, GQA packing, splits, masks, softcap, sinks and the head-dim buckets.

The specification is flash_cuda.reference.attention_with_kvcache_fp8_reference: the new rows are
stored as e4m3(x / descale) (checked bit for bit, every other cache row untouched: rows past L_b
hold NaN, so a kernel that reads them fails), and the attention runs on the stored values with
the descales applied. Each output is held to the FlashAttention rule (tests/attn_check.py) against
float64 attention on the dequantized cache, the naive attention being the same in q's dtype on
the dequantized values (exact in 16 bits up to the descale's product).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import flash_cuda
from flash_cuda.reference import _read_kvcache, _write_kvcache, attention_naive, quantize_e4m3

from attn_check import gpu_skip_reason, hopper_skip_reason, out_lse_problems

pytestmark = pytest.mark.skipif(gpu_skip_reason() is not None, reason=str(gpu_skip_reason()))

DEV = "cuda"
E4M3 = torch.float8_e4m3fn


def _fp8_capable() -> bool:
    """Compute capability 8.9 or newer: FLASH_CUDA_EMULATE_ARCH's where it is set (the library
    then refuses FP8 caches as that GPU would), else the device's."""
    if not torch.cuda.is_available():
        return False
    emulated = int(os.environ.get("FLASH_CUDA_EMULATE_ARCH", "0") or 0)
    return (divmod(emulated, 10) if emulated else torch.cuda.get_device_capability()) >= (8, 9)


def _write8(cache, table, b, start, x8):
    """_write_kvcache of e4m3 rows through byte views (indexed writes of every dtype)."""
    _write_kvcache(cache.view(torch.uint8), table, b, start, x8.view(torch.uint8))


def _read8(cache, table, b, start, end):
    return _read_kvcache(cache.view(torch.uint8), table, b, start, end).view(E4M3)


def _cache(B, Hkv, D, capacity, page_size, gen):
    """(k_cache, v_cache, block_table), e4m3 NaN everywhere; pages dealt out in a random order
    over a (pages, page_size, Hkv, D) pool seen as (pages, Hkv, page_size, D)."""
    if page_size is None:
        k = torch.full((B, Hkv, capacity, D), float("nan"), device=DEV).to(E4M3)
        return k, k.clone(), None
    pages_per_seq = capacity // page_size
    num_pages = B * pages_per_seq + 3
    k = torch.full((num_pages, page_size, Hkv, D), float("nan"), device=DEV).to(E4M3).transpose(1, 2)
    v = torch.full((num_pages, page_size, Hkv, D), float("nan"), device=DEV).to(E4M3).transpose(1, 2)
    perm = torch.randperm(num_pages, generator=gen)[: B * pages_per_seq]
    return k, v, perm.view(B, pages_per_seq).to(torch.int32).to(DEV)


def _run(B=3, Hq=8, Hkv=2, Sq=1, D=128, dtype=torch.bfloat16, capacity=768, lens=(700, 3, 400), s_new=1,
         page_size=None, is_causal=True, window_size=(-1, -1), softcap=0.0, num_splits=0, sinks=False,
         per_head_descale=True, q_scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lens = list(lens)[:B]
    k_cache, v_cache, table = _cache(B, Hkv, D, capacity, page_size, gen)
    if per_head_descale:
        kd = (torch.rand((B, Hkv), generator=gen) * 0.02 + 0.005).to(DEV)
        vd = (torch.rand((B, Hkv), generator=gen) * 0.02 + 0.005).to(DEV)
    else:
        kd = vd = 0.0125
    kd_t = torch.as_tensor(kd, dtype=torch.float32, device=DEV).expand(B, Hkv)
    vd_t = torch.as_tensor(vd, dtype=torch.float32, device=DEV).expand(B, Hkv)
    for b, n in enumerate(lens):  # cached rows: e4m3 of N(0, 1) / descale
        for cache, d in ((k_cache, kd_t), (v_cache, vd_t)):
            x = torch.randn((Hkv, n, D), generator=gen).to(DEV)
            _write8(cache, table, b, 0, quantize_e4m3(x, d[b].view(Hkv, 1, 1)))
    # q_scale: one factor, or one per query head (cycled): the products run in fp16, so bf16
    # queries beyond fp16's range, tiny ones and heads of very different sizes in one tile
    scales = torch.tensor(q_scale if isinstance(q_scale, tuple) else (q_scale,), dtype=torch.float64)
    q = (torch.randn((B, Hq, Sq, D), generator=gen, dtype=torch.float64)
         * scales.repeat(Hq)[:Hq].view(1, Hq, 1, 1)).to(DEV, dtype)
    k_new = v_new = None
    if s_new:
        k_new = torch.randn((B, Hkv, s_new, D), generator=gen).to(DEV, dtype)
        v_new = torch.randn((B, Hkv, s_new, D), generator=gen).to(DEV, dtype)
    sink = torch.randn(Hq, generator=gen).to(DEV) if sinks else None
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens):
        if s_new:
            _write8(expect_k, table, b, n, quantize_e4m3(k_new[b].float(), kd_t[b].view(Hkv, 1, 1)))
            _write8(expect_v, table, b, n, quantize_e4m3(v_new[b].float(), vd_t[b].view(Hkv, 1, 1)))
    out, lse = flash_cuda.attention_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=DEV),
        block_table=table, is_causal=is_causal, window_size=window_size, softcap=softcap, sinks=sink,
        num_splits=num_splits, return_lse=True, k_descale=kd, v_descale=vd)
    torch.cuda.synchronize()
    assert torch.equal(k_cache.view(torch.uint8), expect_k.view(torch.uint8)), "k_cache after the quantized append"
    assert torch.equal(v_cache.view(torch.uint8), expect_v.view(torch.uint8)), "v_cache after the quantized append"
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, Hq, Sq)
    problems = []
    for b, n in enumerate(lens):
        L = n + s_new
        kb = (_read8(expect_k, table, b, 0, L).float() * kd_t[b].view(Hkv, 1, 1)).unsqueeze(0)
        vb = (_read8(expect_v, table, b, 0, L).float() * vd_t[b].view(Hkv, 1, 1)).unsqueeze(0)
        opts = dict(is_causal=is_causal, window_size=window_size, softcap=softcap)
        ref_o, ref_lse = attention_naive(q[b:b + 1].double(), kb.double(), vb.double(), **opts,
                                         sinks=None if sink is None else sink.double())
        nav_o, nav_lse = attention_naive(q[b:b + 1], kb.to(dtype), vb.to(dtype), **opts, sinks=sink)
        problems += out_lse_problems(f"[{b}]", out[b:b + 1], lse[b:b + 1], ref_o, ref_lse, nav_o, nav_lse, dtype, D)
    assert not problems, "; ".join(problems)


needs_fp8 = pytest.mark.skipif(not _fp8_capable(), reason="FP8 KV caches need compute capability 8.9 or newer")


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("page_size", [None, 16, 48, 256])
def test_fp8_decode(dtype, D, page_size):
    _run(D=D, dtype=dtype, page_size=page_size, seed=D + (page_size or 0))


@needs_fp8
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Sq", [1, 8])
def test_fp8_small_pages_route(D, Sq):
    """On Hopper, e4m3 pages of 16 come in as tensor-map boxes at d 64 / 128 (csrc/tiers/mma/decode.cuh:
    box_key_block); d 256's padded line is wider than a box and keeps the bulk copies."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _run(D=D, Sq=Sq, s_new=Sq, page_size=16, seed=D + Sq)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "decode_kernel" in e.name]
    boxes = hopper_skip_reason("the box fill") is None and D <= 128
    assert names and all(("decode_kernel_page_boxes" in n) == boxes for n in names), (boxes, names)


@needs_fp8
@pytest.mark.parametrize("case", [
    dict(Sq=4, s_new=4),                                  # speculative decoding: 16 packed rows
    dict(Sq=8, s_new=8, Hq=16),                           # 64 rows: the 64-row tile
    dict(Sq=40, s_new=40, capacity=1024),                 # a prompt chunk: several row chunks
    dict(Sq=1, s_new=0),                                  # no append
    dict(Sq=1, Hq=8, Hkv=8),                              # no GQA
    dict(num_splits=1), dict(num_splits=7),               # splits: none, forced
    dict(window_size=(100, 0)), dict(softcap=30.0), dict(sinks=True), dict(is_causal=False),
    dict(per_head_descale=False),                         # one descale per tensor
    dict(q_scale=3e5), dict(q_scale=1e-7),                # bf16 queries past fp16's range / tiny
    dict(q_scale=(2e3, 3e-4)), dict(q_scale=(5e3, 1e-6), Sq=8, s_new=8, Hq=16),  # heads apart in one tile
])
def test_fp8_options(case):
    _run(**{"page_size": 16, **case}, seed=len(str(case)))


# FP8 steps of 32 keys per warp at d 64 on sm_90 (128-key steps: one 16-row slice), 16 elsewhere
# and at d 128; the 16-keys-per-warp rung at d 64 (FLASH_CUDA_DECODE_FP8_SUBN=16, an ablation build
# only). The results are checked by _run; the profile shows which configuration ran.
@needs_fp8
@pytest.mark.parametrize("D,sub_n,rung", [(64, 32, None), (128, 16, None), (64, 16, "16")])
@pytest.mark.parametrize("case", [dict(), dict(page_size=16), dict(page_size=256, capacity=1024),
                                  dict(Sq=8, s_new=8, Hq=16, num_splits=3), dict(window_size=(100, 0), num_splits=1)])
def test_fp8_keys_per_warp(monkeypatch, D, sub_n, rung, case):
    from flash_cuda import _ext
    if rung is not None:
        if not _ext.ablations():
            pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
        monkeypatch.setenv("FLASH_CUDA_DECODE_FP8_SUBN", rung)
    if hopper_skip_reason("32 keys per warp") is not None:  # (sm_90 alone, emulation included)
        sub_n = 16
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _run(**{"D": D, **case}, seed=D + len(str(case)))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "decode_kernel" in e.name]
    assert names and all(re.search(rf"Fp8Config<[^>]*,\s*(\(int\))?{sub_n}>", n) for n in names), names


@pytest.mark.skipif(not torch.cuda.is_available() or _fp8_capable(), reason="a GPU below compute capability 8.9")
def test_fp8_needs_ada_or_newer():
    q = torch.randn(1, 2, 1, 64, device=DEV, dtype=torch.bfloat16)
    c = torch.zeros(1, 2, 32, 64, device=DEV).to(E4M3)
    with pytest.raises(RuntimeError, match="compute capability 8.9"):
        flash_cuda.attention_with_kvcache(q, c, c.clone(), cache_seqlens=4, k_descale=1.0, v_descale=1.0)


@needs_fp8
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_step_in_a_cuda_graph(compiled):
    """An FP8 decode step captured once (by hand, or by torch.compile's reduce-overhead mode) and
    replayed at growing lengths equals the eager steps on a twin cache, byte for byte."""
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, D, cap = 2, 8, 2, 128, 512
    k_cache, v_cache, table = _cache(B, Hkv, D, cap, 16, gen)
    for b in range(B):
        for cache in (k_cache, v_cache):
            _write8(cache, table, b, 0, quantize_e4m3(torch.randn((Hkv, 100, D), generator=gen).to(DEV), 0.01))
    kd = torch.full((B, Hkv), 0.01, device=DEV)
    twin_k, twin_v = k_cache.clone(), v_cache.clone()
    lens = torch.tensor([100, 100], dtype=torch.int32, device=DEV)
    q = torch.empty(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
    k_new = torch.empty(B, Hkv, 1, D, device=DEV, dtype=torch.bfloat16)
    v_new = torch.empty_like(k_new)

    def step(kc, vc):
        return flash_cuda.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table,
                                                 is_causal=True, k_descale=kd, v_descale=kd)

    if compiled:
        torch._dynamo.reset()
        run = torch.compile(step, mode="reduce-overhead", fullgraph=True)
        replay = lambda: run(k_cache, v_cache)  # noqa: E731
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(k_cache.clone(), v_cache.clone())  # (warm-up on copies: the caches keep their bytes)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = step(k_cache, v_cache)
        replay = lambda: (graph.replay(), out_g)[1]  # noqa: E731
    for t in range(4):
        q.copy_(torch.randn(q.shape, generator=gen).to(DEV, q.dtype))
        k_new.copy_(torch.randn(k_new.shape, generator=gen).to(DEV, k_new.dtype))
        v_new.copy_(torch.randn(v_new.shape, generator=gen).to(DEV, v_new.dtype))
        got = replay().clone()
        expect = step(twin_k, twin_v)
        torch.cuda.synchronize()
        assert torch.equal(got, expect), f"step {t}"
        assert torch.equal(k_cache.view(torch.uint8), twin_k.view(torch.uint8)), f"step {t}: k_cache"
        lens += 1
