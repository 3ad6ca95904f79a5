"""The packed (varlen) KV-cache reference: a batch of prompt chunks and decode tokens of
different sequences is, row for row, the dense reference run on each sequence alone."""

from __future__ import annotations

import pytest
import torch

from flash_cuda.reference import attention_with_kvcache_packed_reference, attention_with_kvcache_reference

BF16 = torch.bfloat16


def _case(chunks, cached, paged, Hq=4, Hkv=2, D=32, page_size=16, cap=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(chunks)
    total = sum(chunks)
    q = torch.randn(total, Hq, D, generator=g).to(BF16)
    k = torch.randn(total, Hkv, D, generator=g).to(BF16)
    v = torch.randn(total, Hkv, D, generator=g).to(BF16)
    cu = torch.tensor([0] + list(torch.tensor(chunks).cumsum(0).tolist()), dtype=torch.int32)
    lens = torch.tensor(cached, dtype=torch.int32)
    if paged:
        per_seq = cap // page_size
        num_pages = B * per_seq + 3
        table = torch.randperm(num_pages, generator=g)[:B * per_seq].view(B, per_seq).to(torch.int32)
        kc = torch.randn(num_pages, Hkv, page_size, D, generator=g).to(BF16)
        vc = torch.randn(num_pages, Hkv, page_size, D, generator=g).to(BF16)
    else:
        table = None
        kc = torch.randn(B, Hkv, cap, D, generator=g).to(BF16)
        vc = torch.randn(B, Hkv, cap, D, generator=g).to(BF16)
    return q, kc, vc, k, v, cu, lens, table


MIXED = ([37, 1, 0, 20, 1], [5, 60, 9, 0, 100])  # prompt chunks, decode tokens, an empty chunk


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("opts", [dict(), dict(is_causal=True), dict(is_causal=True, window_size=(8, 0)),
                                  dict(softcap=5.0, num_splits=3), dict(is_causal=True, sinks="sinks"),
                                  dict(alibi="per-seq", is_causal=True)])
def test_packed_equals_per_sequence_dense_calls(paged, opts):
    opts = dict(opts)
    chunks, cached = MIXED
    q, kc, vc, k, v, cu, lens, table = _case(chunks, cached, paged)
    if opts.pop("sinks", None):
        opts["sinks"] = torch.randn(q.shape[1])
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = torch.rand(len(chunks), q.shape[1])
    kc2, vc2 = kc.clone(), vc.clone()
    out, lse = attention_with_kvcache_packed_reference(q, kc, vc, k, v, cu_seqlens_q=cu, cache_seqlens=lens,
                                                       block_table=table, return_lse=True, **opts)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    alibi = opts.pop("alibi_slopes", None)
    for b, n in enumerate(chunks):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if n == 0:
            continue
        o_b, lse_b = attention_with_kvcache_reference(
            q[lo:hi].transpose(0, 1)[None], kc2 if paged else kc2[b:b + 1], vc2 if paged else vc2[b:b + 1],
            k[lo:hi].transpose(0, 1)[None], v[lo:hi].transpose(0, 1)[None], cache_seqlens=int(lens[b]),
            block_table=None if table is None else table[b:b + 1],
            alibi_slopes=None if alibi is None else alibi[b:b + 1], return_lse=True, **opts)
        assert torch.equal(out[lo:hi], o_b[0].transpose(0, 1))
        assert torch.equal(lse[:, lo:hi], lse_b[0])
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the same appends, in place


@pytest.mark.parametrize("paged", [False, True])
def test_append_writes_exactly_each_chunk(paged):
    chunks, cached = MIXED
    q, kc, vc, k, v, cu, lens, table = _case(chunks, cached, paged)
    kc0, vc0 = kc.clone(), vc.clone()
    attention_with_kvcache_packed_reference(q, kc, vc, k, v, cu_seqlens_q=cu, cache_seqlens=lens,
                                            block_table=table, is_causal=True)
    expect_k, expect_v = kc0.clone(), vc0.clone()
    page_size = kc.shape[2]
    for b, n in enumerate(chunks):
        for i in range(n):
            r, p = int(cu[b]) + i, int(lens[b]) + i
            if paged:
                page, row = int(table[b, p // page_size]), p % page_size
                expect_k[page, :, row], expect_v[page, :, row] = k[r], v[r]
            else:
                expect_k[b, :, p], expect_v[b, :, p] = k[r], v[r]
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


def test_decode_tokens_and_empty_chunks():
    # Only decode tokens and empty chunks: every row sees its sequence's cache plus itself.
    chunks, cached = [1, 0, 1, 0], [7, 3, 0, 0]
    q, kc, vc, k, v, cu, lens, table = _case(chunks, cached, paged=True)
    out, lse = attention_with_kvcache_packed_reference(q, kc, vc, k, v, cu_seqlens_q=cu, cache_seqlens=lens,
                                                       block_table=table, is_causal=True, return_lse=True)
    assert out.shape == (2, 4, 32) and lse.shape == (4, 2) and torch.isfinite(lse).all()
    # All chunks empty: nothing computed, nothing written.
    q, kc, vc, k, v, cu, lens, table = _case([0, 0], [4, 2], paged=False)
    kc0 = kc.clone()
    out, lse = attention_with_kvcache_packed_reference(q, kc, vc, k, v, cu_seqlens_q=cu, cache_seqlens=lens,
                                                       return_lse=True)
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0) and torch.equal(kc, kc0)


def test_without_new_keys_reads_the_cache_only():
    chunks, cached = [3, 1], [10, 4]
    q, kc, vc, _, _, cu, lens, table = _case(chunks, cached, paged=True)
    kc0 = kc.clone()
    out = attention_with_kvcache_packed_reference(q, kc, vc, cu_seqlens_q=cu, cache_seqlens=lens,
                                                  block_table=table, is_causal=True)
    ref = attention_with_kvcache_reference(q[:3].transpose(0, 1)[None], kc, vc, cache_seqlens=10,
                                           block_table=table[:1], is_causal=True)
    assert torch.equal(out[:3], ref[0].transpose(0, 1)) and torch.equal(kc, kc0)
