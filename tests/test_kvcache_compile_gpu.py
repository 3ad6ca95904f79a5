"""flash_cuda.attention_with_kvcache under torch.compile and CUDA graphs, on the GPU.

* torch.compile(fullgraph=True) of a decode step (inductor, and aot_eager for its functionalized
  graph, where the op runs on copies of the caches that are copied back): dense caches with an
  int and a tensor cache_seqlens, paged caches (also a transposed pool), a q laid out as
  (B, S, H, D).transpose(1, 2), and an int-length prefill into an empty cache (the op's side
  stream inside a compiled graph); a loop of steps leaves the outputs and the caches bit for bit
  as eager calls leave them.
* opcheck of flash_cuda::fwd_kvcache on CUDA tensors.
* torch.cuda.CUDAGraph capture of one decode step (eager, compiled, dense and paged), replayed
  after q, k, v and cache_seqlens change in place: each replay equals an eager call.
* mode="reduce-overhead" of a module whose caches are static buffers (as transformers' static
  cache marks them): inductor's CUDA graphs, not skipped, replay the steps exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = torch.bfloat16
OP = torch.ops.flash_cuda.fwd_kvcache.default


def _caches(B, Hkv, D, cap, page_size, transposed_pool, dtype, gen):
    """(k_cache, v_cache, block_table), random values everywhere."""
    if page_size is None:
        return (torch.randn(B, Hkv, cap, D, generator=gen, device=DEV).to(dtype),
                torch.randn(B, Hkv, cap, D, generator=gen, device=DEV).to(dtype), None)
    pages = cap // page_size
    num_pages = B * pages + 3
    if transposed_pool:
        k = torch.randn(num_pages, page_size, Hkv, D, generator=gen, device=DEV).to(dtype).transpose(1, 2)
        v = torch.randn(num_pages, page_size, Hkv, D, generator=gen, device=DEV).to(dtype).transpose(1, 2)
    else:
        k = torch.randn(num_pages, Hkv, page_size, D, generator=gen, device=DEV).to(dtype)
        v = torch.randn(num_pages, Hkv, page_size, D, generator=gen, device=DEV).to(dtype)
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(num_pages))[:B * pages]
    return k, v, perm.view(B, pages).to(torch.int32).to(DEV)


def _new_tokens(B, Hq, Hkv, Sq, s_new, D, dtype, gen, q_bshd=False):
    if q_bshd:
        q = torch.randn(B, Sq, Hq, D, generator=gen, device=DEV).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(B, Hq, Sq, D, generator=gen, device=DEV).to(dtype)
    k = torch.randn(B, Hkv, s_new, D, generator=gen, device=DEV).to(dtype) if s_new else None
    v = torch.randn(B, Hkv, s_new, D, generator=gen, device=DEV).to(dtype) if s_new else None
    return q, k, v


def _refill(t, gen):
    """New contents, same tensor (a captured graph reads it by address)."""
    t.copy_(torch.randn(t.shape, generator=gen, device=DEV).to(t.dtype))


def _step(q, kc, vc, k, v, lens, table):
    return flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, is_causal=True,
                                             return_lse=True)


def _assert_same(got, want, what):
    for name, a, b in zip(("out", "lse"), got, want):
        assert a.shape == b.shape and a.stride() == b.stride(), f"{what}: {name} layout"
        assert torch.equal(a, b), f"{what}: {name} differs from the eager call's ({(a.float() - b.float()).abs().max()})"


# name: (B, Hq, Hkv, Sq, D, cap, page_size, transposed_pool, int_len, q_bshd, start lengths)
CASES = {
    "dense-int-len": (2, 16, 4, 1, 128, 1024, None, False, True, False, (300, 300)),
    "dense-tensor-lens": (3, 8, 2, 1, 128, 1024, None, False, False, False, (900, 0, 517)),
    "dense-spec-bshd": (2, 8, 8, 4, 64, 512, None, False, False, True, (100, 37)),
    "paged": (3, 8, 2, 1, 128, 768, 64, False, False, False, (700, 3, 400)),
    "paged-transposed-pool": (2, 32, 8, 1, 128, 512, 16, True, False, False, (200, 311)),
    "prefill-empty-int-len": (2, 8, 2, 64, 64, 256, None, False, True, False, (0, 0)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_compiled_decode_loop_matches_eager(name, backend, grad_mode):
    B, Hq, Hkv, Sq, D, cap, page_size, transposed, int_len, q_bshd, start = CASES[name]
    if backend == "aot_eager" and grad_mode == "inference_mode" and name not in ("dense-tensor-lens", "paged"):
        pytest.skip("aot_eager under inference_mode: two cases cover it")
    gen = torch.Generator(device=DEV).manual_seed(len(name) + Sq)
    ctx = torch.no_grad() if grad_mode == "no_grad" else torch.inference_mode()
    with ctx:
        kc, vc, table = _caches(B, Hkv, D, cap, page_size, transposed, BF16, gen)
        ek, ev = kc.clone(), vc.clone()
        before = kc.clone()
        lens = start[0] if int_len else torch.tensor(start, dtype=torch.int32, device=DEV)
        torch._dynamo.reset()
        compiled = torch.compile(_step, fullgraph=True, backend=backend)
        steps = 1 if Sq > 16 else 4
        for it in range(steps):
            q, k, v = _new_tokens(B, Hq, Hkv, Sq, Sq, D, BF16, gen, q_bshd)
            got = compiled(q, kc, vc, k, v, lens, table)
            want = _step(q, ek, ev, k, v, lens, table)
            torch.cuda.synchronize()
            _assert_same(got, want, f"{name}, step {it}")
            assert torch.equal(kc, ek) and torch.equal(vc, ev), f"{name}, step {it}: the caches differ"
            lens = lens + Sq if int_len else lens.add_(Sq)
        assert not torch.equal(kc, before), "nothing was appended"


def test_compiled_step_no_graph_break():
    gen = torch.Generator(device=DEV).manual_seed(0)
    kc, vc, table = _caches(2, 2, 64, 256, 16, False, BF16, gen)
    q, k, v = _new_tokens(2, 8, 2, 1, 1, 64, BF16, gen)
    lens = torch.tensor([10, 100], dtype=torch.int32, device=DEV)
    explanation = torch._dynamo.explain(_step)(q, kc, vc, k, v, lens, table)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


@pytest.mark.parametrize("paged", [False, True])
def test_opcheck_cuda(paged):
    gen = torch.Generator(device=DEV).manual_seed(1)
    kc, vc, table = _caches(2, 2, 64, 256, 32 if paged else None, False, BF16, gen)
    q, k, v = _new_tokens(2, 8, 2, 2, 2, 64, BF16, gen)
    lens = torch.tensor([10, 200], dtype=torch.int32, device=DEV)
    for return_lse in (False, True):
        torch.library.opcheck(OP, (q, kc, vc, k, v, lens, 0, table, 0.125, -1, 0, 0.0, None, 0, return_lse, False))
    torch.library.opcheck(OP, (q, kc, vc, k, v, None, 30, table, 0.125, -1, -1, 0.0, None, 0, True, False))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("how", ["eager", "op", "compiled"])
def test_cuda_graph_replay(paged, how):
    """One captured step (append + attention), replayed after q, k, v and the lengths change in
    place: each replay equals an eager call on a copy of the caches taken just before it."""
    B, Hq, Hkv, D, cap = 2, 16, 4, 128, 2048
    gen = torch.Generator(device=DEV).manual_seed(7)
    kc, vc, table = _caches(B, Hkv, D, cap, 64 if paged else None, False, BF16, gen)
    q, k, v = _new_tokens(B, Hq, Hkv, 1, 1, D, BF16, gen)
    lens = torch.tensor([1000, 37], dtype=torch.int32, device=DEV)
    if how == "op":
        def step():
            return OP(q, kc, vc, k, v, lens, 0, table, 1.0 / math.sqrt(D), -1, 0, 0.0, None, 0, True, False)
    else:
        fn = _step if how == "eager" else torch.compile(_step, fullgraph=True)

        def step():
            return fn(q, kc, vc, k, v, lens, table)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(2):
            step()  # warm-up outside the capture (compilation, allocator, attribute queries)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out_g, lse_g = step()
    for it in range(5):
        for t in (q, k, v):
            _refill(t, gen)
        lens.add_(61 * it + 1)
        ek, ev = kc.clone(), vc.clone()
        graph.replay()
        want = _step(q, ek, ev, k, v, lens, table)
        torch.cuda.synchronize()
        _assert_same((out_g, lse_g), want, f"replay {it}")
        assert torch.equal(kc, ek) and torch.equal(vc, ev), f"replay {it}: the caches differ"


class _StaticCacheDecode(torch.nn.Module):
    def __init__(self, B, Hkv, cap, D, dtype, page_size=None):
        super().__init__()
        gen = torch.Generator(device=DEV).manual_seed(3)
        k, v, table = _caches(B, Hkv, D, cap, page_size, False, dtype, gen)
        self.register_buffer("k_cache", k)
        self.register_buffer("v_cache", v)
        self.table = table
        for t in (self.k_cache, self.v_cache):
            torch._dynamo.mark_static_address(t)

    def forward(self, q, k, v, cache_seqlens):
        return flash_cuda.attention_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=cache_seqlens,
                                                 block_table=self.table, is_causal=True)


@pytest.mark.parametrize("paged", [False, True])
def test_reduce_overhead_decode_loop(paged):
    from torch._dynamo.utils import counters

    B, Hq, Hkv, D, cap = 2, 16, 4, 128, 1024
    with torch.no_grad():
        eager_m = _StaticCacheDecode(B, Hkv, cap, D, BF16, 64 if paged else None)
        comp_m = _StaticCacheDecode(B, Hkv, cap, D, BF16, 64 if paged else None)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(comp_m, mode="reduce-overhead", fullgraph=True)
        gen = torch.Generator(device=DEV).manual_seed(5)
        lens = torch.tensor([500, 9], dtype=torch.int32, device=DEV)
        for it in range(6):
            q, k, v = _new_tokens(B, Hq, Hkv, 1, 1, D, BF16, gen)
            got = compiled(q, k, v, lens).clone()  # the next replay reuses the output's memory
            want = eager_m(q, k, v, lens)
            torch.cuda.synchronize()
            assert torch.equal(got, want), f"step {it}"
            assert torch.equal(comp_m.k_cache, eager_m.k_cache) and torch.equal(comp_m.v_cache, eager_m.v_cache), \
                f"step {it}: the caches differ"
            lens.add_(1)
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_prefill_then_compiled_decode():
    """Prompt through the eager call (int length, empty cache), then compiled decode steps with
    a tensor length: the output of every step matches eager calls on a twin cache."""
    B, Hq, Hkv, D, cap, prompt = 2, 8, 2, 64, 512, 100
    gen = torch.Generator(device=DEV).manual_seed(11)
    kc = torch.zeros(B, Hkv, cap, D, device=DEV, dtype=BF16)
    vc = torch.zeros_like(kc)
    ek, ev = kc.clone(), vc.clone()
    q, k, v = _new_tokens(B, Hq, Hkv, prompt, prompt, D, BF16, gen)
    with torch.no_grad():
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0, is_causal=True)
        flash_cuda.attention_with_kvcache(q, ek, ev, k, v, cache_seqlens=0, is_causal=True)
        lens = torch.full((B,), prompt, dtype=torch.int32, device=DEV)
        torch._dynamo.reset()
        compiled = torch.compile(_step, fullgraph=True)
        for it in range(3):
            q, k, v = _new_tokens(B, Hq, Hkv, 1, 1, D, BF16, gen)
            got = compiled(q, kc, vc, k, v, lens, None)
            want = _step(q, ek, ev, k, v, lens, None)
            torch.cuda.synchronize()
            _assert_same(got, want, f"step {it}")
            lens.add_(1)
        assert torch.equal(kc, ek) and torch.equal(vc, ev)
