"""flash_cuda.attention_with_kvcache with packed queries (cu_seqlens_q), on CPU through the
extension's stand-in (tests/conftest.py), against the packed reference; and its argument
checks, each raised before anything is written."""

from __future__ import annotations

import pytest
import torch

import flash_cuda
from flash_cuda import kvcache
from flash_cuda.reference import attention_with_kvcache_packed_reference

BF16 = torch.bfloat16
MIXED = ([37, 1, 0, 20, 1, 1], [5, 60, 9, 0, 100, 3])  # two prompt chunks, decode tokens, an empty chunk
# The stand-in's reference call uses these blocks; the same ones make the comparison bitwise.
BLOCKS = dict(block_m=32, block_n=16)


def _case(chunks, cached, paged, Hq=4, Hkv=2, D=32, page_size=16, cap=128, seed=0, transposed_pool=False):
    g = torch.Generator().manual_seed(seed)
    B, total = len(chunks), sum(chunks)
    q = torch.randn(total, Hq, D, generator=g).to(BF16)
    k = torch.randn(total, Hkv, D, generator=g).to(BF16)
    v = torch.randn(total, Hkv, D, generator=g).to(BF16)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(cached, dtype=torch.int32)
    if paged:
        per_seq = cap // page_size
        num_pages = B * per_seq + 2
        table = torch.randperm(num_pages, generator=g)[:B * per_seq].view(B, per_seq).to(torch.int32)
        shape = (num_pages, page_size, Hkv, D) if transposed_pool else (num_pages, Hkv, page_size, D)
    else:
        table = None
        shape = (B, cap, Hkv, D) if transposed_pool else (B, Hkv, cap, D)
    kc = torch.randn(*shape, generator=g).to(BF16)
    vc = torch.randn(*shape, generator=g).to(BF16)
    if transposed_pool:
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    return q, kc, vc, k, v, cu, lens, table


def _both(chunks, cached, paged, opts=None, with_new=True, **case):
    """(API result, reference result, the API's caches, the reference's caches)."""
    opts = dict(opts or {})
    q, kc, vc, k, v, cu, lens, table = _case(chunks, cached, paged, **case)
    if not with_new:
        k = v = None
    kr, vr = kc.clone(), vc.clone()
    got = flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cu_seqlens_q=cu, max_seqlen_q=max(max(chunks), 1),
                                            cache_seqlens=lens, block_table=table, return_lse=True, **opts)
    num_splits = max(opts.pop("num_splits", 1), 1)
    want = attention_with_kvcache_packed_reference(q, kr, vr, k, v, cu_seqlens_q=cu, cache_seqlens=lens,
                                                   block_table=table, return_lse=True, num_splits=num_splits,
                                                   **opts, **BLOCKS)
    return got, want, (kc, vc), (kr, vr)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("opts", [dict(), dict(is_causal=True), dict(is_causal=True, window_size=(8, 0)),
                                  dict(softcap=5.0, num_splits=3), dict(is_causal=True, sinks=True),
                                  dict(is_causal=True, alibi=True)])
def test_mixed_batch_matches_packed_reference(mock_kvcache, paged, opts):
    opts = dict(opts)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(4)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(len(MIXED[0]), 4)
    (out, lse), (out_r, lse_r), caches, caches_r = _both(*MIXED, paged, opts)
    assert out.shape == (sum(MIXED[0]), 4, 32) and lse.shape == (4, sum(MIXED[0])) and lse.dtype == torch.float32
    assert torch.equal(out, out_r) and torch.equal(lse, lse_r.float())
    assert torch.equal(caches[0], caches_r[0]) and torch.equal(caches[1], caches_r[1])
    # One binding call per distinct non-empty chunk length (37, 20, 1), never one per sequence.
    assert mock_kvcache.kvcache_calls == 3


@pytest.mark.parametrize("paged", [False, True])
def test_transposed_pool_and_unpaged_dense_length(mock_kvcache, paged):
    (out, lse), (out_r, lse_r), caches, caches_r = _both(*MIXED, paged, dict(is_causal=True), transposed_pool=True)
    assert torch.equal(out, out_r) and torch.equal(caches[0], caches_r[0]) and torch.equal(caches[1], caches_r[1])
    if not paged:  # a dense length that is no page size: the groups gather their cache rows
        (out, lse), (out_r, lse_r), caches, caches_r = _both(*MIXED, False, dict(is_causal=True), cap=120)
        assert torch.equal(out, out_r) and torch.equal(caches[0], caches_r[0])


def test_decode_only_empty_chunks_and_no_new_keys(mock_kvcache):
    (out, lse), (out_r, lse_r), _, _ = _both([1, 0, 1, 1], [7, 3, 0, 50], True, dict(is_causal=True))
    assert out.shape == (3, 4, 32) and torch.equal(out, out_r) and mock_kvcache.kvcache_calls == 1
    (out, lse), (out_r, lse_r), caches, caches_r = _both([4, 2], [10, 30], True, dict(is_causal=True),
                                                         with_new=False)
    assert torch.equal(out, out_r) and torch.equal(caches[0], caches_r[0])
    (out, lse), _, _, _ = _both([0, 0], [4, 2], False)
    assert out.shape == (0, 4, 32) and lse.shape == (4, 0)


def test_compiled_op_matches(mock_kvcache):
    q, kc, vc, k, v, cu, lens, table = _case(*MIXED, paged=True)
    kr, vr = kc.clone(), vc.clone()
    out, lse = torch.ops.flash_cuda.fwd_kvcache_packed(q, kc, vc, k, v, cu, 37, lens, table, 32 ** -0.5, -1, 0,
                                                       0.0, None, 0, True, True, None)
    want = attention_with_kvcache_packed_reference(q, kr, vr, k, v, cu_seqlens_q=cu, cache_seqlens=lens,
                                                   block_table=table, is_causal=True, return_lse=True, **BLOCKS)
    assert torch.equal(out, want[0]) and torch.equal(kc, kr)
    torch.library.opcheck(torch.ops.flash_cuda.fwd_kvcache_packed,
                          (q, kc, vc, k, v, cu, 37, lens, table, 32 ** -0.5, -1, 0, 0.0, None, 0, True, False,
                           None), test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------------------
# Argument checks: each error comes before the cache is touched
# ----------------------------------------------------------------------------------------


def _raises(kind, match, q, kc, vc, k, v, **kw):
    before = kc.clone()
    with pytest.raises(kind, match=match):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, **kw)
    assert torch.equal(kc, before)


def test_packed_argument_checks(mock_kvcache):
    q, kc, vc, k, v, cu, lens, table = _case(*MIXED, paged=True)
    kw = dict(cu_seqlens_q=cu, max_seqlen_q=37, cache_seqlens=lens, block_table=table)
    _raises(ValueError, "both cu_seqlens_q and max_seqlen_q", q, kc, vc, k, v,
            **{**kw, "max_seqlen_q": None})
    _raises(ValueError, "q must be a 3-D tensor", q[None], kc, vc, k, v, **kw)
    _raises(TypeError, "cu_seqlens_q must be an int32", q, kc, vc, k, v, **{**kw, "cu_seqlens_q": cu.long()})
    _raises(TypeError, "cu_seqlens_q must be a torch.Tensor", q, kc, vc, k, v, **{**kw, "cu_seqlens_q": [0, 1]})
    _raises(ValueError, "shape \\(batch \\+ 1,\\)", q, kc, vc, k, v, **{**kw, "cu_seqlens_q": cu[:1]})
    _raises(TypeError, "max_seqlen_q must be a Python int", q, kc, vc, k, v, **{**kw, "max_seqlen_q": 37.0})
    _raises(ValueError, "max_seqlen_q must be in", q, kc, vc, k, v, **{**kw, "max_seqlen_q": 0})
    _raises(ValueError, "does not fit a cache of 128", q, kc, vc, k, v, **{**kw, "max_seqlen_q": 129})
    _raises(TypeError, "cache_seqlens must be an int32 tensor", q, kc, vc, k, v, **{**kw, "cache_seqlens": 3})
    _raises(ValueError, "cache_seqlens must have shape \\(6,\\)", q, kc, vc, k, v,
            **{**kw, "cache_seqlens": lens[:5]})
    _raises(ValueError, "block_table must have shape \\(6,", q, kc, vc, k, v, **{**kw, "block_table": table[:5]})
    _raises(ValueError, "packed k and v must both have shape", q, kc, vc, k[1:], v[1:], **kw)
    _raises(ValueError, "k must be a 3-D tensor", q, kc, vc, k[None], v, **kw)
    _raises(TypeError, "v must have q's dtype", q, kc, vc, k, v.half(), **kw)
    _raises(ValueError, "both k and v", q, kc, vc, k, None, **kw)
    # Values: cu_seqlens_q is read by today's route, so its values are checked on every call.
    bad = cu.clone()
    bad[2] = bad[1] - 1
    _raises(ValueError, "bad cu_seqlens_q .*decreases", q, kc, vc, k, v, **{**kw, "cu_seqlens_q": bad})
    _raises(ValueError, "not the number of packed rows 60", q, kc, vc, k, v, **{**kw, "cu_seqlens_q": cu.clone()
                                                                             .clamp_max(59)})
    _raises(ValueError, "length 37 > max_seqlen_q = 20", q, kc, vc, k, v, **{**kw, "max_seqlen_q": 20})
    # A chunk that does not fit its pages: found with check_inputs (a sync), before the append.
    full = lens.clone()
    full[0] = 100  # 100 + 37 > 128
    _raises(ValueError, "cache_seqlens\\[0\\] = 100: with 37 new tokens", q, kc, vc, k, v,
            **{**kw, "cache_seqlens": full}, check_inputs=True)
    wild = table.clone()
    wild[3, 0] = 999
    _raises(ValueError, "block_table\\[3\\] names page 999", q, kc, vc, k, v, **{**kw, "block_table": wild},
            check_inputs=True)


def test_packed_valid_call_reaches_the_device_check():
    q, kc, vc, k, v, cu, lens, table = _case(*MIXED, paged=True)
    with pytest.raises(RuntimeError, match="must be CUDA tensors"):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cu_seqlens_q=cu, max_seqlen_q=37, cache_seqlens=lens,
                                          block_table=table)
    assert kvcache.fwd_kvcache_packed is not None


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_compile(mock_kvcache, backend):
    torch._dynamo.reset()
    q, kc, vc, k, v, cu, lens, table = _case(*MIXED, paged=True)
    kr, vr = kc.clone(), vc.clone()

    def step(q, kc, vc, k, v, cu, lens, table):
        return flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cu_seqlens_q=cu, max_seqlen_q=37,
                                                 cache_seqlens=lens, block_table=table, is_causal=True,
                                                 return_lse=True)

    out, lse = torch.compile(step, fullgraph=True, backend=backend)(q, kc, vc, k, v, cu, lens, table)
    want, want_lse = attention_with_kvcache_packed_reference(q, kr, vr, k, v, cu_seqlens_q=cu, cache_seqlens=lens,
                                                             block_table=table, is_causal=True, return_lse=True,
                                                             **BLOCKS)
    assert torch.equal(out, want) and torch.equal(lse, want_lse.float())
    assert torch.equal(kc, kr) and torch.equal(vc, vr)  # the append survives functionalization


def test_cache_slots():
    """Where the packed route's appends land: (page, row) through the block table, page ids
    clamped to the pool as the kernels clamp them; (sequence, position) in a dense cache."""
    from flash_cuda.kvcache_ops import cache_slots

    table = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)
    seq = torch.tensor([0, 0, 1, 1, 1])
    pos = torch.tensor([0, 17, 5, 16, 31])
    first, second = cache_slots(table, 5, 16, seq, pos)
    assert first.tolist() == [3, 1, 0, 4, 4] and second.tolist() == [0, 1, 5, 0, 15]  # page 7 clamped to 4
    assert cache_slots(None, 5, 16, seq, pos) == (seq, pos)
