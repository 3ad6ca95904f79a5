"""flash_cuda.attention_with_kvcache with packed queries on the GPU: a mixed batch (prompt
chunks of 100 and 37 rows, three decode tokens) against a paged cache (pages of 16) and a
dense one, checked per sequence against float64 attention over that sequence's cache rows
0 .. cache_seqlens[b] + chunk_b - 1 with the FlashAttention rule (tests/attn_check.py). Cache
rows never written hold NaN, so a read past a sequence's length fails; the cache after the
append must equal the expected one bit for bit."""

from __future__ import annotations

import pytest
import torch

import flash_cuda
from flash_cuda.reference import _read_kvcache, _write_kvcache, attention_naive

from attn_check import ATOL_BASE, LSE_ATOL_BASE, rule_error

pytestmark = pytest.mark.gpu

DEV = "cuda"
CHUNKS = [100, 1, 37, 1, 1]  # two prompt chunks and three decode tokens, interleaved
CACHED = [200, 300, 0, 77, 5]


def _cache(B, Hkv, D, dtype, capacity, page_size, gen):
    if page_size is None:
        k = torch.full((B, Hkv, capacity, D), float("nan"), dtype=dtype, device=DEV)
        return k, k.clone(), None
    per_seq = capacity // page_size
    num_pages = B * per_seq + 3
    k = torch.full((num_pages, Hkv, page_size, D), float("nan"), dtype=dtype, device=DEV)
    table = torch.randperm(num_pages, generator=gen)[:B * per_seq].view(B, per_seq).to(torch.int32).to(DEV)
    return k, k.clone(), table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("layout", ["paged16", "dense", "dense-unpaged-length"])
def test_mixed_batch_against_float64(layout, is_causal, dtype, Hq=8, Hkv=2, D=128):
    gen = torch.Generator().manual_seed(0)
    page_size = 16 if layout == "paged16" else None
    capacity = 520 if layout == "dense-unpaged-length" else 512
    B, total = len(CHUNKS), sum(CHUNKS)
    k_cache, v_cache, table = _cache(B, Hkv, D, dtype, capacity, page_size, gen)
    for cache in (k_cache, v_cache):
        for b, n in enumerate(CACHED):
            _write_kvcache(cache, table, b, 0, torch.randn(Hkv, n, D, generator=gen).to(DEV, dtype))
    q = torch.randn(total, Hq, D, generator=gen).to(DEV, dtype)
    k = torch.randn(total, Hkv, D, generator=gen).to(DEV, dtype)
    v = torch.randn(total, Hkv, D, generator=gen).to(DEV, dtype)
    cu = torch.tensor([0] + torch.tensor(CHUNKS).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    lens = torch.tensor(CACHED, dtype=torch.int32, device=DEV)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(CHUNKS):
        lo = int(cu[b])
        _write_kvcache(expect_k, table, b, CACHED[b], k[lo:lo + n].transpose(0, 1))
        _write_kvcache(expect_v, table, b, CACHED[b], v[lo:lo + n].transpose(0, 1))

    out, lse = flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cu_seqlens_q=cu, max_seqlen_q=100,
                                                 cache_seqlens=lens, block_table=table, is_causal=is_causal,
                                                 return_lse=True, check_inputs=True)
    torch.cuda.synchronize()
    assert torch.equal(k_cache.view(torch.int16), expect_k.view(torch.int16)), "k_cache after the append"
    assert torch.equal(v_cache.view(torch.int16), expect_v.view(torch.int16)), "v_cache after the append"
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (Hq, total) and lse.dtype == torch.float32
    problems = []
    for b, n in enumerate(CHUNKS):
        lo, L = int(cu[b]), CACHED[b] + n
        kb = _read_kvcache(expect_k, table, b, 0, L).unsqueeze(0)
        vb = _read_kvcache(expect_v, table, b, 0, L).unsqueeze(0)
        qb = q[lo:lo + n].transpose(0, 1).unsqueeze(0)
        ref_o, ref_lse = attention_naive(qb.double(), kb.double(), vb.double(), is_causal=is_causal)
        nav_o, nav_lse = attention_naive(qb, kb, vb, is_causal=is_causal)
        got_o = out[lo:lo + n].transpose(0, 1).unsqueeze(0).double()
        got_lse = lse[:, lo:lo + n].unsqueeze(0).double()
        score_mag = float(ref_lse.abs().max())
        _, pr = rule_error(f"out[{b}]", got_o, ref_o, nav_o.double(), ATOL_BASE[dtype], score_mag=score_mag,
                           head_dim=D)
        problems += [pr] if pr else []
        _, pr = rule_error(f"lse[{b}]", got_lse, ref_lse, nav_lse.double(), LSE_ATOL_BASE[dtype])
        problems += [pr] if pr else []
    assert not problems, "; ".join(problems)
