"""flash_cuda.attention_with_kvcache over FP8 (float8_e4m3fn) caches, on CPU through the mock
extension (tests/conftest.py: the binding's contract on the FP8 specification): the call reaches
the extension with the descales as the kernels read them (float32 (batch, kv_heads), contiguous,
whatever form was passed), its result is the specification's, and bad arguments raise a clear
error, naming what is accepted, before anything is written."""

from __future__ import annotations

import pytest
import torch

import flash_cuda
from flash_cuda.reference import attention_with_kvcache_fp8_reference, quantize_e4m3

E4M3 = torch.float8_e4m3fn
PREFIX = "flash_cuda.attention_with_kvcache: "


def _inputs(B=2, Hq=4, Hkv=2, Sq=1, D=32, capacity=64, lens=(40, 9), s_new=1, page_size=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    if page_size is None:
        k_cache = quantize_e4m3(torch.randn(B, Hkv, capacity, D, generator=g), 0.01)
        table = None
    else:
        pages = B * capacity // page_size + 1
        k_cache = quantize_e4m3(torch.randn(pages, Hkv, page_size, D, generator=g), 0.01)
        table = torch.randperm(pages, generator=g)[: B * capacity // page_size].view(B, -1).to(torch.int32)
    v_cache = quantize_e4m3(torch.randn(k_cache.shape, generator=g), 0.02)
    q = torch.randn(B, Hq, Sq, D, generator=g).to(torch.bfloat16)
    k = torch.randn(B, Hkv, s_new, D, generator=g).to(torch.bfloat16) if s_new else None
    v = torch.randn(B, Hkv, s_new, D, generator=g).to(torch.bfloat16) if s_new else None
    return q, k_cache, v_cache, k, v, torch.tensor(lens, dtype=torch.int32), table


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("descales", [(0.01, 0.02), (torch.tensor(0.01), torch.tensor([0.02])),
                                      (torch.full((2, 2), 0.01), torch.full((2, 2), 0.02)), (None, None)])
def test_fp8_call_is_the_specification(mock_kvcache, page_size, descales):
    q, k_cache, v_cache, k, v, lens, table = _inputs(page_size=page_size)
    kd, vd = descales
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_o, ref_lse = attention_with_kvcache_fp8_reference(
        q, ref_k, ref_v, k, v, k_descale=kd, v_descale=vd, cache_seqlens=lens, block_table=table, is_causal=True,
        return_lse=True, block_m=32, block_n=16)
    out, lse = flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                                 is_causal=True, return_lse=True, k_descale=kd, v_descale=vd)
    assert torch.equal(out, ref_o.to(out.dtype)) and torch.equal(lse, ref_lse.float())
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    got_kd, got_vd = mock_kvcache.last_kvcache_descales
    for got, want in ((got_kd, kd), (got_vd, vd)):
        assert got.dtype == torch.float32 and got.shape == (2, 2) and got.is_contiguous()
        assert torch.equal(got, torch.ones(2, 2) if want is None else torch.as_tensor(want).expand(2, 2).float())


def test_fp8_int_lengths_and_prompt_chunks(mock_kvcache):
    """An int cache_seqlens and more than 16 queries take the same FP8 call (no prefill route)."""
    q, k_cache, v_cache, k, v, _, _ = _inputs(Sq=20, s_new=20, lens=(30, 30))
    calls = mock_kvcache.kvcache_calls
    out = flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=30, k_descale=0.01,
                                            v_descale=0.02)
    assert mock_kvcache.kvcache_calls == calls + 1 and out.shape == q.shape


@pytest.mark.parametrize("change,exc,match", [
    (dict(v_cache="bf16"), TypeError, "k_cache and v_cache must both be torch.float8_e4m3fn"),
    (dict(k_cache="e5m2", v_cache="e5m2"), TypeError, "only the e4m3 FP8 format"),
    (dict(k_cache="bf16", v_cache="bf16"), TypeError, "go with FP8 caches"),
    (dict(q="fp32"), TypeError, "float16 or bfloat16"),
    (dict(k_descale="fp16"), TypeError, "k_descale must be float32"),
    (dict(v_descale="shape"), ValueError, r"v_descale must be per tensor .* \(2, 2\)"),
    (dict(k_descale="str"), TypeError, "k_descale must be None, a float or a float32 tensor"),
    (dict(D=40), ValueError, "multiple of 16"),
])
def test_fp8_bad_arguments(mock_kvcache, change, exc, match):
    D = change.get("D", 32)
    q, k_cache, v_cache, k, v, lens, table = _inputs(D=D)
    kd, vd = 0.01, 0.02
    conv = {"bf16": lambda t: t.to(torch.float32).to(torch.bfloat16),
            "e5m2": lambda t: t.to(torch.float32).to(torch.float8_e5m2), "fp32": lambda t: t.float()}
    if "k_cache" in change:
        k_cache = conv[change["k_cache"]](k_cache)
    if "v_cache" in change:
        v_cache = conv[change["v_cache"]](v_cache)
    if "q" in change:
        q = conv[change["q"]](q)
    if change.get("k_descale") == "fp16":
        kd = torch.tensor(0.01, dtype=torch.float16)
    if change.get("k_descale") == "str":
        kd = "0.01"
    if change.get("v_descale") == "shape":
        vd = torch.full((2, 4), 0.02)
    before = k_cache.clone()
    with pytest.raises(exc, match=match) as info:
        flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, k_descale=kd, v_descale=vd)
    assert str(info.value).startswith(PREFIX)
    assert torch.equal(k_cache.view(torch.uint8) if k_cache.dtype == E4M3 else k_cache,
                       before.view(torch.uint8) if before.dtype == E4M3 else before), "nothing written"


def test_fp8_packed_queries_not_yet(mock_kvcache):
    q, k_cache, v_cache, _, _, lens, _ = _inputs()
    with pytest.raises(NotImplementedError, match="packed queries"):
        flash_cuda.attention_with_kvcache(q[:, :, 0], k_cache, v_cache, cache_seqlens=lens,
                                          cu_seqlens_q=torch.tensor([0, 2, 4], dtype=torch.int32), max_seqlen_q=2,
                                          k_descale=0.01, v_descale=0.02)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("page_size", [None, 16])
def test_fp8_compiled_step_matches_eager(mock_kvcache, backend, page_size):
    """torch.compile(fullgraph=True) of an FP8 decode step: the op flash_cuda::fwd_kvcache with the
    descales, no graph break, the eager step's output and caches (the quantized append kept)."""
    q, k_cache, v_cache, k, v, lens, table = _inputs(page_size=page_size, seed=page_size or 3)
    kd, vd = torch.full((2, 2), 0.01), 0.02

    def step(q, k_cache, v_cache, k, v, lens):
        return flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                                 is_causal=True, return_lse=True, k_descale=kd, v_descale=vd)

    ek, ev = k_cache.clone(), v_cache.clone()
    expect = step(q, ek, ev, k, v, lens)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(q, k_cache.clone(), v_cache.clone(), k, v, lens)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    got = torch.compile(step, fullgraph=True, backend=backend)(q, k_cache, v_cache, k, v, lens)
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    assert torch.equal(k_cache.view(torch.uint8), ek.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ev.view(torch.uint8))


@pytest.mark.parametrize("return_lse", [False, True])
def test_fp8_opcheck(mock_kvcache, return_lse):
    """The op's fake and dispatch with FP8 caches and their descales (opcheck's schema test, which
    perturbs the inputs arithmetically, has no float8 arithmetic on CPU: the 16-bit opchecks of
    tests/test_kvcache_compile.py hold the same schema's mutation declaration)."""
    q, k_cache, v_cache, k, v, lens, table = _inputs(page_size=16)
    kd, vd = torch.full((2, 2), 0.01), torch.full((2, 2), 0.02)
    args = (q, k_cache, v_cache, k, v, lens, 0, table, 32 ** -0.5, -1, 0, 0.0, None, 0, return_lse, False, None, kd,
            vd)
    torch.library.opcheck(torch.ops.flash_cuda.fwd_kvcache.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic"))


def test_fp8_signature_checked_once(mock_kvcache, monkeypatch):
    """A repeated FP8 call skips the metadata checks (kvcache_checks.fp8_plans), a descale of
    another form is a new signature (checked, and rejected when bad), an int cache_seqlens is
    checked on every call, and the outcome equals the first call's."""
    from flash_cuda import kvcache_checks
    calls = []
    real = kvcache_checks.validate
    monkeypatch.setattr(kvcache_checks, "validate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k_cache, v_cache, k, v, lens, _ = _inputs()
    kd = torch.full((2, 2), 0.01)
    first = flash_cuda.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=lens,
                                              k_descale=kd, v_descale=kd)
    for _ in range(2):
        again = flash_cuda.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=lens,
                                                  k_descale=kd, v_descale=kd)
    assert len(calls) == 1 and torch.equal(first, again)
    with pytest.raises(ValueError, match=r"k_descale must be per tensor"):
        flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                          k_descale=torch.full((3, 2), 0.01), v_descale=kd)
    assert len(calls) == 2
    flash_cuda.attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=20, k_descale=kd,
                                      v_descale=kd)
    with pytest.raises(ValueError, match="needs 65 positions, but the cache holds 64"):
        flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=64, k_descale=kd, v_descale=kd)
    assert len(calls) == 3  # (the int length's signature once; its values on every call)
