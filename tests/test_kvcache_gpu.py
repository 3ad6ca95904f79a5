"""flash_cuda.attention_with_kvcache on the GPU: dense and paged caches, in-place append, every
mask option, splits 1 / n / auto, GQA packing, row chunks, and a CUDA graph replayed at growing
lengths; plus attention()'s decode-shaped calls, which take the same split-KV kernels.

Each output is checked with the FlashAttention rule (tests/attn_check.py: error vs float64 at
most twice the error of naive attention in the same dtype, plus a tiny absolute term), per
sequence against attention_naive over that sequence's cache rows 0 .. L_b - 1. Cache rows past
L_b hold NaN, so a kernel that reads them fails; the appended cache must equal the expected one
bit for bit, and no other cache row may change. Every decode kernel a _run_checked case launches
must fit the opt-in shared memory of the GPU class it was chosen for (FLASH_CUDA_EMULATE_ARCH=86
runs the 99 KiB class's choices on a bigger GPU).
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

import flash_cuda
from flash_cuda.reference import _read_kvcache, _write_kvcache, attention_naive

from attn_check import (smem_class_kib, check_attention, check_varlen_attention, gpu_skip_reason, hopper_skip_reason,
                        make_alibi_slopes, make_varlen_inputs, out_lse_problems)

pytestmark = pytest.mark.skipif(gpu_skip_reason() is not None, reason=str(gpu_skip_reason()))

DEV = "cuda"


def _make_cache(B, Hkv, D, dtype, capacity, page_size, transposed_pool, gen):
    """(k_cache, v_cache, block_table): NaN everywhere (rows never written must never be read)."""
    if page_size is None:
        shape = (B, Hkv, capacity, D)
        k = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
        return k, k.clone(), None
    pages_per_seq = capacity // page_size
    num_pages = B * pages_per_seq + 3
    if transposed_pool:  # a (pages, page_size, Hkv, D) pool seen as (pages, Hkv, page_size, D)
        k = torch.full((num_pages, page_size, Hkv, D), float("nan"), dtype=dtype, device=DEV).transpose(1, 2)
        v = torch.full((num_pages, page_size, Hkv, D), float("nan"), dtype=dtype, device=DEV).transpose(1, 2)
    else:
        k = torch.full((num_pages, Hkv, page_size, D), float("nan"), dtype=dtype, device=DEV)
        v = k.clone()
    perm = torch.randperm(num_pages, generator=gen, device="cpu")[: B * pages_per_seq]
    table = perm.view(B, pages_per_seq).to(torch.int32).to(DEV)
    return k, v, table


def _fill(cache, table, lens, gen):
    """Random values in rows [0, lens[b]) of every sequence."""
    for b, n in enumerate(lens):
        x = torch.randn((cache.shape[1], n, cache.shape[3]), generator=gen, device="cpu")
        _write_kvcache(cache, table, b, 0, x.to(device=DEV, dtype=cache.dtype))


def _run_case(B=2, Hq=8, Hkv=2, Sq=1, D=128, dtype=torch.bfloat16, capacity=512, lens=(300, 77), s_new=1,
              page_size=None, transposed_pool=False, lens_as_tensor=True, is_causal=False, window_size=(-1, -1),
              softcap=0.0, alibi=False, num_splits=0, scale=None, sinks=None, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lens = list(lens)[:B] + [lens[-1]] * max(0, B - len(lens))
    k_cache, v_cache, table = _make_cache(B, Hkv, D, dtype, capacity, page_size, transposed_pool, gen)
    _fill(k_cache, table, lens, gen)
    _fill(v_cache, table, lens, gen)
    q = torch.randn((B, Hq, Sq, D), generator=gen).to(DEV, dtype)
    k_new = v_new = None
    if s_new:
        k_new = torch.randn((B, Hkv, s_new, D), generator=gen).to(DEV, dtype)
        v_new = torch.randn((B, Hkv, s_new, D), generator=gen).to(DEV, dtype)
    slopes = make_alibi_slopes(Hq, batch=B if seed % 2 else None) if alibi else None
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lens):
        if s_new:
            _write_kvcache(expect_k, table, b, n, k_new[b])
            _write_kvcache(expect_v, table, b, n, v_new[b])
    cache_seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV) if lens_as_tensor else lens[0]
    if not lens_as_tensor:
        assert all(n == lens[0] for n in lens)
    out, lse = flash_cuda.attention_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens, block_table=table, is_causal=is_causal,
        window_size=window_size, softcap=softcap, alibi_slopes=slopes, num_splits=num_splits, scale=scale,
        sinks=sinks, return_lse=True)
    torch.cuda.synchronize()
    # The cache: appended rows as expected, every other row untouched (NaN compares by bits).
    assert torch.equal(k_cache.view(torch.int16), expect_k.view(torch.int16)), "k_cache after the append"
    assert torch.equal(v_cache.view(torch.int16), expect_v.view(torch.int16)), "v_cache after the append"
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (B, Hq, Sq)
    problems = []
    for b, n in enumerate(lens):
        L = n + s_new
        kb = _read_kvcache(expect_k, table, b, 0, L).unsqueeze(0)
        vb = _read_kvcache(expect_v, table, b, 0, L).unsqueeze(0)
        sb = None if slopes is None else (slopes[b:b + 1] if slopes.dim() == 2 else slopes)
        opts = dict(is_causal=is_causal, scale=scale, window_size=window_size, softcap=softcap, alibi_slopes=sb)
        ref_o, ref_lse = attention_naive(q[b:b + 1].double(), kb.double(), vb.double(),
                                         **{**opts, "alibi_slopes": None if sb is None else sb.double(),
                                            "sinks": None if sinks is None else sinks.double()})
        nav_o, nav_lse = attention_naive(q[b:b + 1], kb, vb, **opts, sinks=sinks)
        finite = torch.isfinite(ref_lse)
        empty = ~finite
        if bool(empty.any()):
            assert sinks is not None or bool((lse[b:b + 1][empty] == float("-inf")).all()), \
                "rows that see no key: lse -inf"
            assert bool((out[b:b + 1].float()[empty] == 0).all()), "rows that see no key: out 0"
        problems += out_lse_problems(f"[{b}]", out[b:b + 1], lse[b:b + 1], ref_o, ref_lse, nav_o, nav_lse, dtype, D)
    assert not problems, "; ".join(problems)
    return out, lse


def _decode_launches(fn):
    """(fn()'s result, [(kernel name, shared memory bytes)] of the decode kernels it launched),
    from torch.profiler's trace (its kernel events carry static + dynamic shared memory)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    launches = [(e["name"], e.get("args", {}).get("shared memory")) for e in events
                if str(e.get("cat", "")).lower() == "kernel" and "decode_kernel" in e.get("name", "")]
    return result, launches


def _check_decode_fits(launches, D, rows):
    """Every decode kernel launched fits the opt-in shared memory of the GPU class the kernels are
    chosen for (smem_class_kib: FLASH_CUDA_EMULATE_ARCH's class under emulation, where the real
    GPU would run a kernel that does not). The 99 KiB class runs the one-stage half-step tiles at
    d > 128 with one 16-row slice (csrc/tiers/mma/decode.cuh: ConfigPolicy); the other classes
    keep the full tiles."""
    assert launches, "torch.profiler recorded no decode kernel"
    # (+1 KiB: kernels compiled for sm_90 and newer list the 1 KiB the driver reserves per block,
    # which lies outside the opt-in budget, and the profile may count it as static memory.)
    budget = smem_class_kib() * 1024 + 1024
    half_steps = D > 128 and rows <= 16 and smem_class_kib() < 100
    for name, smem in launches:
        assert smem is not None, f"{name}: the profile records no shared memory size"
        assert int(smem) <= budget, f"{name}: {smem} B of shared memory, the class allows {budget}"
        assert ("HalfStepConfig" in name) == half_steps, f"{name}: expected half-step tiles: {half_steps}"


def _run_checked(**kw):
    """_run_case, and _check_decode_fits on the kernels it launched."""
    result, launches = _decode_launches(lambda: _run_case(**kw))
    heads = 1 if kw.get("alibi") else kw.get("Hq", 8) // kw.get("Hkv", 2)
    rows = min(kw.get("Sq", 1) * heads, 64)
    _check_decode_fits(launches, kw.get("D", 128), rows)
    return result


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("Hq,Hkv", [(8, 8), (8, 2), (16, 2)])
def test_decode_dense(dtype, D, Hq, Hkv):
    _run_checked(B=3, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype, capacity=1024, lens=(1000, 0, 517), s_new=1, seed=D + Hq)


# Head dims 192 and 256 (Gemma's) on every class: on the 99 KiB one (RTX 30 / 40 / 50, A10, L40)
# a single 16-row slice runs the half-step tiles, more rows the full 32- and 64-row tiles.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [192, 256])
@pytest.mark.parametrize("case", [
    dict(Sq=1, Hq=8, Hkv=2, page_size=None, num_splits=0),                      # GQA, auto splits
    dict(Sq=1, Hq=4, Hkv=1, page_size=None, num_splits=7),                      # forced splits
    dict(Sq=4, Hq=8, Hkv=2, page_size=48, num_splits=0, is_causal=True),        # pages: a lookup per row
    dict(Sq=4, Hq=8, Hkv=2, page_size=256, num_splits=3, is_causal=True),       # pages holding whole steps
    dict(Sq=2, Hq=16, Hkv=2, page_size=64, num_splits=2, transposed_pool=True),  # 16 packed rows
    dict(Sq=8, Hq=8, Hkv=2, page_size=None, num_splits=0, is_causal=True),      # 32 rows: the 32-row tile
    dict(Sq=16, Hq=8, Hkv=2, page_size=None, num_splits=2, is_causal=True),     # 64 rows: the 64-row tile
])
def test_wide_head_dims(dtype, D, case):
    page = case["page_size"]
    capacity = 1536 if page is None else page * (1536 // page)
    _run_checked(B=2, D=D, dtype=dtype, capacity=capacity, lens=(1500, 3), s_new=case["Sq"], seed=D + case["Hq"],
                 **case)


# Pages smaller than a step at the other head-dim buckets: on Hopper the cached steps come in by one
# bulk copy per row (tiers/mma/decode.cuh: bulk_key_block) with 16 rows (Sq 1) and 32 (Sq 8).
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("Sq,s_new", [(1, 1), (8, 8)])
def test_decode_small_pages_head_dims(D, Sq, s_new):
    _run_case(B=3, Hq=8, Hkv=2, Sq=Sq, D=D, capacity=16 * (768 // 16), lens=(700, 3, 400), s_new=s_new,
              page_size=16, transposed_pool=True, is_causal=True, seed=D + Sq)


@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("transposed_pool", [False, True])
@pytest.mark.parametrize("Sq,s_new", [(1, 1), (4, 4), (8, 0)])
def test_decode_paged(page_size, transposed_pool, Sq, s_new):
    _run_case(B=3, Hq=8, Hkv=2, Sq=Sq, D=128, capacity=page_size * (768 // page_size), lens=(700, 3, 400),
              s_new=s_new, page_size=page_size, transposed_pool=transposed_pool, is_causal=True, seed=page_size + Sq)


# Pages of 16 / 32 / 48 rows smaller than a step: on Hopper, 32-key steps (17-32 packed rows) come
# in as tensor-map boxes of 16 rows (tiers/mma/decode.cuh: box_key_block); 64-key steps at d <= 128
# by cp.async with the step's page ids read first, as on every other GPU. Both pool layouts, head
# dims below their bucket's (a box's columns past d arrive as zeros), splits forced and not.
@pytest.mark.parametrize("D", [48, 64, 96, 128])
@pytest.mark.parametrize("page_size", [16, 32, 48])
@pytest.mark.parametrize("transposed_pool", [False, True])
@pytest.mark.parametrize("Sq,num_splits", [(1, 0), (8, 3)])
def test_small_pages_route(D, page_size, transposed_pool, Sq, num_splits):
    kw = dict(B=3, Hq=8, Hkv=2, Sq=Sq, D=D, capacity=page_size * (1536 // page_size), lens=(1400, 3, 777),
              s_new=Sq, page_size=page_size, transposed_pool=transposed_pool, is_causal=True,
              num_splits=num_splits, seed=D + page_size + Sq)
    _, launches = _decode_launches(lambda: _run_case(**kw))
    names = [name for name, _ in launches]
    block_n = 64 if Sq * 4 <= 16 else 32  # keys per step of the 16- / 32-row tiles
    boxes = hopper_skip_reason("the box fill") is None and page_size % block_n != 0 and block_n == 32
    assert names, "no decode kernel launched"
    for n in names:
        assert ("decode_kernel_page_boxes" in n) == boxes, (boxes, n)
        assert boxes or ", false>(" in n, f"expected the cp.async kernel: {n}"


# The deep-ring ablation rung (FLASH_CUDA_DECODE_RING=deep, an ablation build only): d 128 with
# one 16-row slice runs a ring of 3 steps where at most 2 CTAs share an SM, 4 where 1 does; the
# same splits and results as the two-step ring.
@pytest.mark.parametrize("B,lens,page_size,num_splits", [
    (1, (1500,), None, 0),          # few CTAs: 4 steps deep
    (3, (1400, 3, 777), 16, 2),     # pages of 16 by cp.async
    (2, (1500, 64), 256, 40),       # pages holding whole steps; 160 CTAs: 3 steps deep
])
def test_decode_deep_ring_rung(monkeypatch, B, lens, page_size, num_splits):
    from flash_cuda import _ext
    if not _ext.ablations():
        pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
    if hopper_skip_reason("the deep-ring rung") is not None:
        pytest.skip(hopper_skip_reason("the deep-ring rung"))
    monkeypatch.setenv("FLASH_CUDA_DECODE_RING", "deep")
    kw = dict(B=B, Hq=8, Hkv=2, Sq=1, D=128, capacity=1536, lens=lens, s_new=1, page_size=page_size,
              is_causal=True, num_splits=num_splits, seed=B + (page_size or 0))
    _, launches = _decode_launches(lambda: _run_case(**kw))
    assert launches and all("DeepRingConfig" in name for name, _ in launches), launches


# The warp-rows rung (FLASH_CUDA_DECODE_WARP_ROWS, an ablation build only): 1, each warp copies the
# key rows its own products read and waits for them alone at every head dim (production: d 256); 0,
# the CTA-wide wait per step at every head dim. Dense and paged caches (pages of 16 and 256), a
# partial last step with new keys, splits, windows, softcap, fp16, the three head-dim buckets, and
# Sq 8 (two 16-row slices: the CTA-wide wait, unchanged).
@pytest.mark.parametrize("rung", ["1", "0"])
@pytest.mark.parametrize("case", [
    dict(B=2, lens=(1500, 64), num_splits=0),
    dict(B=3, lens=(1400, 3, 777), num_splits=3, page_size=16),
    dict(B=2, lens=(1500, 200), num_splits=5, page_size=256, window_size=(300, 0)),
    dict(B=2, lens=(900, 1201), D=64, dtype=torch.float16, softcap=20.0),
    dict(B=2, lens=(700, 33), D=256, num_splits=2),
    dict(B=3, lens=(1500, 5, 700), D=192, num_splits=0, page_size=16),
    dict(B=2, lens=(900, 1200), Sq=8, s_new=8, Hq=16, num_splits=2),
])
def test_decode_warp_rows_rung(monkeypatch, case, rung):
    from flash_cuda import _ext
    if not _ext.ablations():
        pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
    monkeypatch.setenv("FLASH_CUDA_DECODE_WARP_ROWS", rung)
    page = case.get("page_size")
    kw = dict(Hq=8, Hkv=2, Sq=1, s_new=1, D=128, capacity=1536 if page is None else page * (1536 // page),
              is_causal=True, seed=len(case["lens"]) + case.get("num_splits", 0))
    kw.update(case)
    _, launches = _decode_launches(lambda: _run_case(**kw))
    names = [name for name, _ in launches]
    wrapper = "WarpRows" if rung == "1" else "CtaRows"
    assert names and all(wrapper in n for n in names), names


# The cluster-merge rung (FLASH_CUDA_DECODE_MERGE=cluster, an ablation build on Hopper only): the
# splits of a row chunk in one thread-block cluster, merged by its rank 0 through distributed shared
# memory (no merge kernel); splits forced up to the cluster limit and planned (capped at 8), ranges
# without keys, sinks, pages, 16- and 32-row tiles.
@pytest.mark.parametrize("case", [
    dict(B=1, lens=(1500,), num_splits=0),
    dict(B=3, lens=(1400, 0, 777), num_splits=8, page_size=16),
    dict(B=2, lens=(1500, 3), num_splits=3, sinks=True),
    dict(B=2, lens=(900, 1200), num_splits=2, Sq=8, s_new=8, D=64),
])
def test_decode_cluster_merge_rung(monkeypatch, case):
    from flash_cuda import _ext
    if not _ext.ablations():
        pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
    if hopper_skip_reason("the cluster-merge rung") is not None:
        pytest.skip(hopper_skip_reason("the cluster-merge rung"))
    monkeypatch.setenv("FLASH_CUDA_DECODE_MERGE", "cluster")
    case = dict(case)
    if case.pop("sinks", False):
        case["sinks"] = torch.linspace(-1.0, 3.0, 8, device=DEV)
    page = case.get("page_size")
    kw = dict(Hq=8, Hkv=2, Sq=1, s_new=1, D=128, capacity=1536 if page is None else page * (1536 // page),
              is_causal=True, seed=len(case["lens"]) + case["num_splits"])
    kw.update(case)
    _, launches = _decode_launches(lambda: _run_case(**kw))
    names = [name for name, _ in launches]
    assert names and all("decode_kernel_cluster_merge" in n for n in names), names


# The small-page fill rung (FLASH_CUDA_DECODE_PAGES, an ablation build on Hopper only): each fill
# forced on the tiles that can take it, the results those of the policy's fill.
@pytest.mark.parametrize("fill", ["boxes", "bulk", "cp_async"])
@pytest.mark.parametrize("D,Sq", [(64, 1), (128, 1), (128, 8)])
def test_decode_small_page_fill_rung(monkeypatch, fill, D, Sq):
    from flash_cuda import _ext
    if not _ext.ablations():
        pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
    if hopper_skip_reason("the small-page fill rung") is not None:
        pytest.skip(hopper_skip_reason("the small-page fill rung"))
    monkeypatch.setenv("FLASH_CUDA_DECODE_PAGES", fill)
    kw = dict(B=3, Hq=8, Hkv=2, Sq=Sq, D=D, capacity=16 * 96, lens=(1400, 3, 777), s_new=Sq, page_size=16,
              transposed_pool=True, is_causal=True, seed=D + Sq)
    _, launches = _decode_launches(lambda: _run_case(**kw))
    names = [name for name, _ in launches]
    expect = {"boxes": "decode_kernel_page_boxes", "bulk": ", true>(", "cp_async": ", false>("}[fill]
    assert names and all(expect in n for n in names), (fill, names)


# The whole-page boxes rung (FLASH_CUDA_DECODE_WHOLE_PAGES=boxes, an ablation build on Hopper):
# pages that hold whole steps filled by tensor-map boxes; lengths that end inside a page, the last
# step's new keys, GQA groups of 8 with Sq 4 (32-key steps) and 1.
@pytest.mark.parametrize("page_size", [64, 256])
@pytest.mark.parametrize("D,Sq", [(128, 1), (128, 4), (64, 4)])
def test_decode_whole_page_boxes_rung(monkeypatch, page_size, D, Sq):
    from flash_cuda import _ext
    if not _ext.ablations():
        pytest.skip("an ablation rung: this build has none (FLASH_CUDA_ABLATIONS=1 builds them)")
    if hopper_skip_reason("the whole-page boxes rung") is not None:
        pytest.skip(hopper_skip_reason("the whole-page boxes rung"))
    monkeypatch.setenv("FLASH_CUDA_DECODE_WHOLE_PAGES", "boxes")
    kw = dict(B=3, Hq=16, Hkv=2, Sq=Sq, D=D, capacity=page_size * 24, lens=(1400, 3, 777), s_new=Sq,
              page_size=page_size, transposed_pool=True, is_causal=True, seed=D + Sq + page_size)
    _, launches = _decode_launches(lambda: _run_case(**kw))
    names = [name for name, _ in launches]
    assert names and all("decode_kernel_page_boxes" in n for n in names), names


@pytest.mark.parametrize("num_splits", [0, 1, 2, 7, 64])
@pytest.mark.parametrize("lens", [(2047, 5), (0, 0), (1, 2000)])
def test_splits(num_splits, lens):
    _run_case(B=2, Hq=4, Hkv=1, D=64, dtype=torch.float16, capacity=2048, lens=lens, s_new=1,
              num_splits=num_splits, seed=num_splits)


@pytest.mark.parametrize("Sq,Hq,Hkv", [(4, 8, 2), (8, 32, 8), (16, 8, 1), (33, 6, 2), (7, 14, 2), (200, 4, 4)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_speculative_and_chunks(Sq, Hq, Hkv, is_causal):
    """Sq > 1 (speculative decoding, prefill), group sizes that are not powers of two, and more
    packed rows than one tile (several row chunks)."""
    _run_case(B=2, Hq=Hq, Hkv=Hkv, Sq=Sq, D=128, capacity=640, lens=(400, 37), s_new=Sq, is_causal=is_causal,
              seed=Sq * 3 + is_causal)


@pytest.mark.parametrize("window_size,is_causal", [((16, 0), False), ((100, -1), True), ((-1, 3), False),
                                                   ((0, 0), False)])
@pytest.mark.parametrize("Sq", [1, 5])
def test_windows(window_size, is_causal, Sq):
    _run_case(B=2, Hq=8, Hkv=4, Sq=Sq, capacity=512, lens=(300, 9), s_new=Sq, window_size=window_size,
              is_causal=is_causal, seed=Sq)


@pytest.mark.parametrize("softcap,alibi", [(30.0, False), (0.0, True), (5.0, True)])
@pytest.mark.parametrize("Sq", [1, 8])
def test_score_mods(softcap, alibi, Sq):
    _run_case(B=2, Hq=8, Hkv=2, Sq=Sq, capacity=1024, lens=(900, 70), s_new=Sq, is_causal=True, softcap=softcap,
              alibi=alibi, seed=Sq + int(alibi))


@pytest.mark.parametrize("scale", [0.0, -0.3, 2.0])
def test_scale(scale):
    _run_case(B=2, Hq=4, Hkv=2, capacity=256, lens=(200, 100), s_new=1, scale=scale, seed=3)


def test_int_cache_seqlens_and_no_new_keys():
    _run_case(B=3, Hq=8, Hkv=2, Sq=2, capacity=512, lens=(384, 384, 384), s_new=0, lens_as_tensor=False,
              is_causal=True)
    _run_case(B=2, Hq=8, Hkv=2, Sq=3, capacity=512, lens=(100, 100), s_new=3, lens_as_tensor=False,
              page_size=64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 96, 192])
def test_head_dim_buckets(dtype, D):
    _run_checked(B=2, Hq=4, Hkv=4, D=D, dtype=dtype, capacity=300, lens=(299, 150), s_new=1, is_causal=True, seed=D)


def test_prefill_into_empty_cache():
    """Prompt processing through the cache: every token new, causal."""
    _run_case(B=2, Hq=8, Hkv=2, Sq=300, D=64, capacity=512, lens=(0, 0), s_new=300, is_causal=True, seed=11)


@pytest.mark.parametrize("cached", [0, 100])
def test_prefill_with_known_length(cached):
    """An int cache_seqlens and a dense cache: prompt-sized calls run attention()'s forward."""
    _run_case(B=2, Hq=8, Hkv=2, Sq=200, D=128, capacity=512, lens=(cached, cached), s_new=200, is_causal=True,
              lens_as_tensor=False, seed=12 + cached)
    _run_case(B=2, Hq=8, Hkv=2, Sq=40, D=64, capacity=512, lens=(cached, cached), s_new=0, window_size=(30, 0),
              lens_as_tensor=False, seed=13 + cached)


# ---- the prefill route (csrc/core/kv_gather.cuh, then the query-tiled forward with per-sequence key
#      counts): pages or tensor lengths, Sq > 16 ----


def _paged_capacity(page_size, lens, Sq):
    return page_size * -(-(max(lens) + Sq) // page_size)


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("B,lens", [(1, (2900,)), (4, (2900, 0, 517, 1203))])
@pytest.mark.parametrize("Sq", [17, 100, 300])
@pytest.mark.parametrize("is_causal", [False, True])
def test_prefill_paged(page_size, B, lens, Sq, is_causal):
    """A prompt chunk appended to a paged cache that holds thousands of tokens (and an empty
    sequence; the pool's unwritten rows are NaN poison): the append, the dense layout and the
    forward against float64 attention over each sequence's rows; no decode kernel runs."""
    capacity = _paged_capacity(page_size, lens, Sq)
    _, launches = _decode_launches(lambda: _run_case(
        B=B, Hq=8, Hkv=2, Sq=Sq, D=128, capacity=capacity, lens=lens, s_new=Sq, page_size=page_size,
        is_causal=is_causal, seed=Sq + page_size + B))
    assert not launches, f"a prompt chunk ran the decode kernels: {launches}"


@pytest.mark.parametrize("page_size,transposed_pool", [(16, True), (256, False)])
@pytest.mark.parametrize("B", [1, 4])
def test_prefill_paged_2k_chunk(page_size, transposed_pool, B):
    """The serving shape: a 2048-token chunk into pages already holding ~2k tokens, GQA 4."""
    lens = (2000, 1500, 0, 2047)[:B]
    _run_case(B=B, Hq=16, Hkv=4, Sq=2048, D=128, capacity=_paged_capacity(page_size, lens, 2048), lens=lens,
              s_new=2048, page_size=page_size, transposed_pool=transposed_pool, is_causal=True, seed=B)


@pytest.mark.parametrize("case", [
    dict(is_causal=True, window_size=(100, -1)),
    dict(window_size=(64, 8), softcap=30.0),
    dict(is_causal=True, alibi=True, seed=1),   # per-sequence slopes (odd seed)
    dict(is_causal=True, alibi=True, seed=2),   # per-head slopes
    dict(is_causal=True, sinks=True, scale=0.3),
    dict(is_causal=True, s_new=0),              # no new keys: a sequence with no key, rows above the diagonal
    dict(is_causal=True, lens_as_tensor=False),  # an int length with pages: no lengths to read back
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_paged_options(case, dtype):
    case = dict(case)
    if case.pop("sinks", False):
        case["sinks"] = torch.linspace(-1.0, 3.0, 8, device=DEV)
    Sq = 64
    s_new = case.pop("s_new", Sq)
    int_len = case.get("lens_as_tensor") is False
    lens = (700, 700, 700) if int_len else (700, 0, 33)
    _, launches = _decode_launches(lambda: _run_case(
        B=3, Hq=8, Hkv=2, Sq=Sq, D=128, dtype=dtype, capacity=_paged_capacity(16, lens, Sq), lens=lens,
        s_new=s_new, page_size=16, **{"seed": 3, **case}))
    assert not launches


def test_prefill_tensor_lengths_dense_cache():
    """A dense cache with a tensor cache_seqlens: the prefill route too, reading the cache in
    place (its rows past each length are NaN poison: the forward must not let them into O)."""
    _, launches = _decode_launches(lambda: _run_case(B=3, Hq=8, Hkv=2, Sq=200, D=64, capacity=1024,
                                                     lens=(800, 0, 77), s_new=200, is_causal=True, seed=4))
    assert not launches


@pytest.mark.parametrize("Sq,decode", [(1, True), (16, True), (17, False)])
def test_prefill_route_by_query_count(Sq, decode):
    """Decode-shaped calls (Sq <= 16) keep the split-KV decode kernels; Sq > 16 does not."""
    _, launches = _decode_launches(lambda: _run_case(B=2, Hq=8, Hkv=2, Sq=Sq, D=128, capacity=1024, lens=(900, 5),
                                                     s_new=Sq, page_size=16, is_causal=True, seed=Sq))
    assert bool(launches) == decode, launches


def test_prefill_chunk_under_cuda_graph_capture():
    """The prefill route reads no length on the host: a captured prompt chunk takes it too, and
    each replay, with the lengths grown in place, equals an eager call at those lengths."""
    gen = torch.Generator(device="cpu").manual_seed(9)
    B, Hq, Hkv, D, Sq, page = 2, 8, 2, 128, 48, 16
    k_cache, v_cache, table = _make_cache(B, Hkv, D, torch.bfloat16, 1024, page, False, gen)
    # Rows past the starting lengths filled too: the replays below grow the lengths by 0, 1, 2, so
    # they read rows the first call did not write (unfilled rows are poison, and NaN != NaN).
    _fill(k_cache, table, (610, 50), gen)
    _fill(v_cache, table, (610, 50), gen)
    lens = torch.tensor([600, 40], dtype=torch.int32, device=DEV)
    q = torch.randn((B, Hq, Sq, D), generator=gen).to(DEV, torch.bfloat16)
    k_new = torch.randn((B, Hkv, Sq, D), generator=gen).to(DEV, torch.bfloat16)
    v_new = torch.randn((B, Hkv, Sq, D), generator=gen).to(DEV, torch.bfloat16)

    def step(kc, vc):
        return flash_cuda.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table,
                                                 is_causal=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(k_cache.clone(), v_cache.clone())  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    kc, vc = k_cache.clone(), v_cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = step(kc, vc)
    for it in range(3):
        lens.add_(it)
        kc.copy_(k_cache)
        vc.copy_(v_cache)
        ek, ev = k_cache.clone(), v_cache.clone()
        graph.replay()
        want = step(ek, ev)
        torch.cuda.synchronize()
        assert torch.isfinite(want).all(), f"replay {it}"
        assert torch.equal(out_g, want), f"replay {it}"
        assert torch.equal(kc.view(torch.int16), ek.view(torch.int16)), f"replay {it}: the cache"


def test_cuda_graph_decode_loop():
    """One captured decode step (append + attention) replayed as the cache grows: each replay
    matches an eager call at that length."""
    torch.manual_seed(0)
    B, Hq, Hkv, D, cap = 2, 16, 4, 128, 4096
    dtype = torch.bfloat16
    k_cache = torch.randn(B, Hkv, cap, D, device=DEV, dtype=dtype)
    v_cache = torch.randn(B, Hkv, cap, D, device=DEV, dtype=dtype)
    lens = torch.tensor([1000, 37], dtype=torch.int32, device=DEV)
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=dtype)
    k_new = torch.randn(B, Hkv, 1, D, device=DEV, dtype=dtype)
    v_new = torch.randn(B, Hkv, 1, D, device=DEV, dtype=dtype)

    def step():
        return flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                                 is_causal=True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture (allocator, attribute queries)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = step()
    for it in range(6):
        q.copy_(torch.randn_like(q))
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        lens.add_(97 * it + 1)
        kc, vc = k_cache.clone(), v_cache.clone()
        graph.replay()
        eager = flash_cuda.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, is_causal=True)
        torch.cuda.synchronize()
        assert torch.equal(out_g, eager), f"replay {it} differs from the eager call"
        assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc), f"replay {it}: cache differs"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Sq,Sk,Hq,Hkv", [(1, 4096, 8, 2), (1, 333, 8, 8), (4, 1500, 16, 2), (16, 700, 6, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_decode_shapes(dtype, Sq, Sk, Hq, Hkv, is_causal):
    """attention() with few queries runs the split-KV kernels: forward and (regular) backward."""
    gen = torch.Generator(device=DEV).manual_seed(Sq * Sk)
    q = torch.randn(2, Hq, Sq, 64, device=DEV, dtype=dtype, generator=gen)
    k = torch.randn(2, Hkv, Sk, 64, device=DEV, dtype=dtype, generator=gen)
    v = torch.randn(2, Hkv, Sk, 64, device=DEV, dtype=dtype, generator=gen)
    check_attention(q, k, v, is_causal=is_causal, scale=None, label=f"decode-shaped {Sq}x{Sk}")


def test_splits_are_deterministic():
    outs = [_run_case(B=1, Hq=8, Hkv=1, capacity=8192, lens=(8000,), s_new=0, num_splits=0, seed=5)[0]
            for _ in range(2)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lens_q,lens_k,Hq,Hkv", [((1, 0, 16, 3), (700, 5, 1500, 0), 8, 2),
                                                  ((1, 1, 1), (4000, 1, 333), 32, 8),
                                                  ((5, 2), (90, 2000), 6, 6)])
@pytest.mark.parametrize("is_causal,window_size,softcap,alibi", [(True, (-1, -1), 0.0, False),
                                                                 (False, (64, 8), 10.0, False),
                                                                 (True, (-1, -1), 0.0, True)])
def test_varlen_decode_shapes(dtype, lens_q, lens_k, Hq, Hkv, is_causal, window_size, softcap, alibi):
    """varlen_attention() with few queries per sequence runs the split-KV kernels too."""
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, Hq, Hkv, 128, dtype, "cuda", layout="strided",
                                                     seed=len(lens_q))
    slopes = make_alibi_slopes(Hq, batch=len(lens_q)) if alibi else None
    check_varlen_attention(q, k, v, cu_q, cu_k, mq, mk, is_causal=is_causal, window_size=window_size,
                           softcap=softcap, alibi_slopes=slopes, label="varlen decode-shaped")
