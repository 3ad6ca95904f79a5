"""The KV-cache reference (flash_cuda.reference.attention_with_kvcache_reference), on CPU.

* Dense cache: against attention_naive on each sequence's logical keys and values (its
  cache rows 0 .. cache_seqlens[b] - 1 followed by the new k / v), in float64, for one and
  several queries, no / one / several new tokens, GQA, causal, windows, softcap, ALiBi and
  all of them together, with a different cache length per sequence (0 included, and an
  empty sequence: out 0, lse -inf). Cache rows past each sequence's length are NaN and must
  not reach the result.
* The append: the new rows land at cache_seqlens[b] .. cache_seqlens[b] + S_new - 1 and
  nothing else in the cache (nor cache_seqlens) changes.
* Paged cache: shuffled, non-contiguous pages of several sizes in a pool seen through a
  transpose give the dense cache's result on the same logical data, and the append lands
  in the right rows of the right pages.
* Split-KV: any num_splits (more than the key blocks, more than the keys) equals
  num_splits = 1 to float64 rounding, out and lse; num_splits = 1 is the plain blocked
  forward on the sequence's logical keys.
* cache_seqlens as an int or as a tensor: the same result.
"""

from __future__ import annotations

import pytest
import torch

from flash_cuda.reference import (attention_forward_blocked, attention_naive,
                                  attention_with_kvcache_reference, combine_splits,
                                  split_key_ranges)

from attn_check import make_alibi_slopes
from test_reference import assert_close64

F64 = torch.float64
NEG_INF = float("-inf")
NAN = float("nan")


def _randn(*shape, gen, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _make_problem(B, Hq, Hkv, Sq, D, S_max, cached, S_new, seed, dtype=F64):
    """q, a dense (k_cache, v_cache) with random rows below cache_seqlens[b] and NaN from
    there on, the new (k, v) (None when S_new = 0) and cache_seqlens (int32 tensor)."""
    g = torch.Generator().manual_seed(seed)
    q = _randn(B, Hq, Sq, D, gen=g, dtype=dtype)
    k_cache = _randn(B, Hkv, S_max, D, gen=g, dtype=dtype)
    v_cache = _randn(B, Hkv, S_max, D, gen=g, dtype=dtype)
    for b, c in enumerate(cached):
        k_cache[b, :, c:] = NAN
        v_cache[b, :, c:] = NAN
    k = v = None
    if S_new > 0:
        k = _randn(B, Hkv, S_new, D, gen=g, dtype=dtype)
        v = _randn(B, Hkv, S_new, D, gen=g, dtype=dtype)
    return q, k_cache, v_cache, k, v, torch.tensor(cached, dtype=torch.int32)


def _logical_kv(k_cache, v_cache, k, v, b, c):
    """Sequence b's keys and values as (1, Hkv, L_b, D): cache rows [0, c), then the new ones."""
    ks, vs = [k_cache[b:b + 1, :, :c]], [v_cache[b:b + 1, :, :c]]
    if k is not None:
        ks.append(k[b:b + 1])
        vs.append(v[b:b + 1])
    return torch.cat(ks, dim=2), torch.cat(vs, dim=2)


def _naive_kvcache(q, k_cache, v_cache, k, v, cached, opts):
    """The ground truth: attention_naive per sequence on its logical keys (the cache as it
    was before the call), in float64; an empty sequence gives out 0 and lse -inf."""
    outs, lses = [], []
    slopes = opts.get("alibi_slopes")
    for b, c in enumerate(cached):
        kb, vb = _logical_kv(k_cache, v_cache, k, v, b, c)
        qb = q[b:b + 1].to(F64)
        if kb.shape[2] == 0:
            outs.append(torch.zeros_like(qb))
            lses.append(torch.full(qb.shape[:3], NEG_INF, dtype=F64))
            continue
        o, l = attention_naive(qb, kb.to(F64), vb.to(F64), **{
            **opts, "alibi_slopes": None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b])})
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _slopes(kind, B, Hq):
    if kind is None:
        return None
    return make_alibi_slopes(Hq, batch=B if kind == "batch" else None, device="cpu", seed=B + Hq)


# (id, is_causal, window, softcap, alibi kind, scale)
FEATURES = [
    ("plain", False, (-1, -1), 0.0, None, None),
    ("causal", True, (-1, -1), 0.0, None, None),
    ("window-left-causal", True, (3, -1), 0.0, None, None),
    ("window-both", False, (2, 1), 0.0, None, 0.8),
    ("softcap", False, (-1, -1), 0.9, None, 1.5),
    ("alibi-heads", False, (-1, -1), 0.0, "heads", None),
    ("alibi-batch-causal", True, (-1, -1), 0.0, "batch", None),
    ("all", True, (4, 0), 2.0, "batch", 0.7),
]
FEATURE_IDS = [f[0] for f in FEATURES]


def _opts(feature, B, Hq):
    _, is_causal, window, softcap, alibi, scale = feature
    return dict(is_causal=is_causal, window_size=window, softcap=softcap,
                alibi_slopes=_slopes(alibi, B, Hq), scale=scale)


# ---------------------------------------------------------------------------------------
# Dense cache against the naive attention of each sequence
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("feature", FEATURES, ids=FEATURE_IDS)
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("S_new", [0, 1, 3])
@pytest.mark.parametrize("Sq", [1, 4])
def test_dense_matches_naive(feature, Hq, Hkv, S_new, Sq):
    # Sequence 0 holds nothing in the cache (with S_new = 0 it is empty), sequence 1 fewer
    # keys than queries for some cases, sequence 3 fills the cache to its end.
    B, D, S_max = 4, 8, 14
    cached = [0, 2, 9, S_max - S_new]
    q, k_cache, v_cache, k, v, cs = _make_problem(B, Hq, Hkv, Sq, D, S_max, cached, S_new,
                                                  seed=Sq * 100 + S_new * 10 + Hq)
    opts = _opts(feature, B, Hq)
    out_ref, lse_ref = _naive_kvcache(q, k_cache, v_cache, k, v, cached, opts)
    for block_m, block_n in ((64, 64), (2, 4)):
        out, lse = attention_with_kvcache_reference(
            q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=cs, return_lse=True,
            block_m=block_m, block_n=block_n, **opts)
        assert out.dtype == F64 and lse.dtype == F64
        assert out.shape == (B, Hq, Sq, D) and lse.shape == (B, Hq, Sq)
        assert torch.isfinite(out).all(), "a cache row past L_b reached the output"
        assert_close64(out, out_ref, f"out blocks ({block_m}, {block_n})")
        assert_close64(lse, lse_ref, f"lse blocks ({block_m}, {block_n})")
    if S_new == 0:  # the empty sequence
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert (lse[0] == NEG_INF).all()


def test_rows_without_keys():
    """A causal query row above a short sequence's diagonal sees no key: out 0, lse -inf,
    while the other rows of the same call are ordinary."""
    B, Hq, Hkv, Sq, D, S_max = 2, 2, 1, 5, 8, 8
    q, k_cache, v_cache, k, v, cs = _make_problem(B, Hq, Hkv, Sq, D, S_max, [1, 6], 1, seed=7)
    out, lse = attention_with_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=cs,
                                                is_causal=True, return_lse=True)
    # sequence 0 has L = 2: query i sees j <= i - 3, so rows 0..2 see nothing
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    assert (lse[0, :, :3] == NEG_INF).all()
    assert torch.isfinite(lse[0, :, 3:]).all() and torch.isfinite(lse[1]).all()


def test_return_lse_flag_and_dtypes():
    """Without return_lse only out comes back; 16-bit and float32 inputs give out in their
    dtype and lse in float32, within rounding of the blocked forward."""
    B, Hq, Hkv, Sq, D, S_max = 2, 4, 2, 3, 16, 20
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k_cache, v_cache, k, v, cs = _make_problem(B, Hq, Hkv, Sq, D, S_max, [5, 11], 2,
                                                      seed=3, dtype=dtype)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        out = attention_with_kvcache_reference(q, k_cache.clone(), v_cache.clone(), k, v,
                                               cache_seqlens=cs, is_causal=True)
        assert isinstance(out, torch.Tensor) and out.dtype == dtype
        out, lse = attention_with_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=cs,
                                                    is_causal=True, return_lse=True, num_splits=2,
                                                    block_n=4)
        assert out.dtype == dtype and lse.dtype == torch.float32
        for b, c in enumerate(cs.tolist()):
            kb, vb = _logical_kv(k_before, v_before, k, v, b, c)
            o_ref, l_ref = attention_forward_blocked(q[b:b + 1], kb, vb, is_causal=True)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[b:b + 1].float(), o_ref.float(), atol=tol, rtol=tol)
            torch.testing.assert_close(lse[b:b + 1], l_ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# The in-place append
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("S_new", [1, 3])
def test_append_in_place(S_new):
    B, Hq, Hkv, Sq, D, S_max = 3, 4, 2, 2, 8, 12
    cached = [0, 4, S_max - S_new]
    q, k_cache, v_cache, k, v, cs = _make_problem(B, Hq, Hkv, Sq, D, S_max, cached, S_new, seed=11)
    # Rows past L_b hold random values here (not NaN) so that "unchanged" is checked bitwise;
    # a second cache with NaN there must give the same output.
    g = torch.Generator().manual_seed(12)
    garbage = _randn(B, Hkv, S_max, D, gen=g)
    for b, c in enumerate(cached):
        k_cache[b, :, c:] = garbage[b, :, c:]
        v_cache[b, :, c:] = -garbage[b, :, c:]
    k_before, v_before, cs_before = k_cache.clone(), v_cache.clone(), cs.clone()
    out = attention_with_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=cs,
                                           is_causal=True)
    assert torch.equal(cs, cs_before), "cache_seqlens must not be modified"
    k_expect, v_expect = k_before.clone(), v_before.clone()
    for b, c in enumerate(cached):
        k_expect[b, :, c:c + S_new] = k[b]
        v_expect[b, :, c:c + S_new] = v[b]
    assert torch.equal(k_cache, k_expect) and torch.equal(v_cache, v_expect)

    k_nan, v_nan = k_before.clone(), v_before.clone()
    for b, c in enumerate(cached):
        k_nan[b, :, c:] = NAN
        v_nan[b, :, c:] = NAN
    out_nan = attention_with_kvcache_reference(q, k_nan, v_nan, k, v, cache_seqlens=cs,
                                               is_causal=True)
    assert torch.isfinite(out_nan).all()
    assert torch.equal(out, out_nan), "rows past L_b influenced the result"
    for b, c in enumerate(cached):  # the NaN rows past L_b are still NaN
        assert torch.isnan(k_nan[b, :, c + S_new:]).all() and torch.isnan(v_nan[b, :, c + S_new:]).all()
        assert torch.equal(k_nan[b, :, :c + S_new], k_expect[b, :, :c + S_new])


def test_no_new_tokens_leaves_cache_alone():
    B, Hq, Hkv, Sq, D, S_max = 2, 2, 2, 3, 8, 10
    q, k_cache, v_cache, _, _, cs = _make_problem(B, Hq, Hkv, Sq, D, S_max, [4, 10], 0, seed=5)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    attention_with_kvcache_reference(q, k_cache, v_cache, cache_seqlens=cs)
    torch.testing.assert_close(k_cache, k_before, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_before, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------
# Paged cache
# ---------------------------------------------------------------------------------------


def _paged_from_dense(k_cache, v_cache, cached, page_size, seed):
    """A paged copy of a dense cache: pages in shuffled order (plus spare pages, NaN) in a
    (num_pages, page_size, Hkv, D) storage seen as (num_pages, Hkv, page_size, D) through
    .transpose(1, 2); rows past each sequence's cached length are NaN."""
    B, Hkv, S_max, D = k_cache.shape
    max_pages = -(-S_max // page_size)
    spare = 3
    num_pages = B * max_pages + spare
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g)
    block_table = perm[:B * max_pages].reshape(B, max_pages).to(torch.int32)
    pools = []
    for cache in (k_cache, v_cache):
        storage = torch.full((num_pages, page_size, Hkv, D), NAN, dtype=cache.dtype)
        pool = storage.transpose(1, 2)
        for b, c in enumerate(cached):
            for p in range(c):
                pool[int(block_table[b, p // page_size]), :, p % page_size] = cache[b, :, p]
        pools.append(pool)
    return pools[0], pools[1], block_table


def _pool_rows(pool, block_table, b, n):
    """Logical rows [0, n) of sequence b read back from a pool: (Hkv, n, D)."""
    ps = pool.shape[2]
    rows = [pool[int(block_table[b, p // ps]), :, p % ps] for p in range(n)]
    if not rows:
        return pool.new_empty((pool.shape[1], 0, pool.shape[3]))
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("page_size", [16, 48, 256])
@pytest.mark.parametrize("feature", [FEATURES[0], FEATURES[2], FEATURES[7]],
                         ids=[FEATURES[0][0], FEATURES[2][0], FEATURES[7][0]])
@pytest.mark.parametrize("Sq,S_new", [(1, 1), (4, 3), (4, 0)])
def test_paged_matches_dense(page_size, feature, Sq, S_new):
    B, Hq, Hkv, D = 3, 4, 2, 8
    # lengths that end mid-page, on a page boundary, and span several pages
    cached = [0, page_size, 2 * page_size + page_size // 2 - S_new]
    S_max = 3 * page_size
    q, k_cache, v_cache, k, v, cs = _make_problem(B, Hq, Hkv, Sq, D, S_max, cached, S_new,
                                                  seed=page_size + Sq + S_new)
    k_pool, v_pool, block_table = _paged_from_dense(k_cache, v_cache, cached, page_size, seed=Sq)
    assert not k_pool.is_contiguous()
    k_pool_before, v_pool_before = k_pool.clone(), v_pool.clone()
    storage = k_pool.transpose(1, 2)  # the (num_pages, page_size, Hkv, D) tensor itself
    opts = _opts(feature, B, Hq)

    out_d, lse_d = attention_with_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=cs,
                                                    return_lse=True, **opts)
    out_p, lse_p = attention_with_kvcache_reference(q, k_pool, v_pool, k, v, cache_seqlens=cs,
                                                    block_table=block_table, return_lse=True,
                                                    **opts)
    assert torch.isfinite(out_p).all()
    assert_close64(out_p, out_d, "out paged vs dense", atol=1e-12)
    assert_close64(lse_p, lse_d, "lse paged vs dense", atol=1e-12)

    # The append, page by page: exactly the rows [c, c + S_new) of each sequence changed.
    k_expect, v_expect = k_pool_before.clone(), v_pool_before.clone()
    for b, c in enumerate(cached):
        for i in range(S_new):
            p = c + i
            k_expect[int(block_table[b, p // page_size]), :, p % page_size] = k[b, :, i]
            v_expect[int(block_table[b, p // page_size]), :, p % page_size] = v[b, :, i]
    torch.testing.assert_close(k_pool, k_expect, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_pool, v_expect, rtol=0, atol=0, equal_nan=True)
    assert storage.data_ptr() == k_pool.data_ptr() and storage.is_contiguous()
    for b, c in enumerate(cached):  # the logical view of both caches agrees after the append
        assert torch.equal(_pool_rows(k_pool, block_table, b, c + S_new), k_cache[b, :, :c + S_new])
        assert torch.equal(_pool_rows(v_pool, block_table, b, c + S_new), v_cache[b, :, :c + S_new])


def test_paged_table_entries_past_length_unused():
    """Block-table entries past a sequence's last page are never looked up (here they point
    at pages full of NaN, and at a page index out of range)."""
    B, Hq, Hkv, Sq, D, ps = 2, 2, 1, 2, 8, 16
    q, k_cache, v_cache, k, v, cs = _make_problem(B, Hq, Hkv, Sq, D, 4 * ps, [5, 20], 2, seed=9)
    k_pool, v_pool, block_table = _paged_from_dense(k_cache, v_cache, [5, 20], ps, seed=1)
    block_table[0, 1:] = k_pool.shape[0] + 100
    block_table[1, 2:] = -1
    out_p = attention_with_kvcache_reference(q, k_pool, v_pool, k, v, cache_seqlens=cs,
                                             block_table=block_table)
    out_d = attention_with_kvcache_reference(q, k_cache, v_cache, k, v, cache_seqlens=cs)
    assert_close64(out_p, out_d, "out", atol=1e-12)


# ---------------------------------------------------------------------------------------
# Split-KV
# ---------------------------------------------------------------------------------------


def test_split_key_ranges():
    assert split_key_ranges(10, 1, 4) == [(0, 10)]
    assert split_key_ranges(10, 2, 4) == [(0, 4), (4, 10)]
    assert split_key_ranges(10, 3, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split_key_ranges(3, 5, 1) == [(0, 0), (0, 1), (1, 1), (1, 2), (2, 3)]
    assert split_key_ranges(0, 3, 4) == [(0, 0)] * 3
    for n, splits, bn in ((37, 7, 4), (5, 9, 2), (64, 3, 16)):
        r = split_key_ranges(n, splits, bn)
        assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
        assert all(lo % bn == 0 and lo <= hi for lo, hi in r)


def test_combine_splits_empty_and_single():
    o = torch.randn(2, 3, 4, dtype=F64)
    lse = torch.tensor([[0.5, NEG_INF, 1.0], [NEG_INF, NEG_INF, 2.0]], dtype=F64)
    out, l = combine_splits([o], [lse], F64)
    assert torch.equal(l, lse)
    assert torch.equal(out[lse != NEG_INF], o[lse != NEG_INF])
    assert torch.equal(out[lse == NEG_INF], torch.zeros_like(out[lse == NEG_INF]))
    # an empty part changes nothing; two all-empty parts give 0 / -inf
    empty_o, empty_l = torch.zeros_like(o), torch.full_like(lse, NEG_INF)
    out2, l2 = combine_splits([empty_o, o, empty_o], [empty_l, lse, empty_l], F64)
    assert torch.equal(l2, l) and torch.equal(out2, out)
    out3, l3 = combine_splits([empty_o, empty_o], [empty_l, empty_l], F64)
    assert (l3 == NEG_INF).all() and torch.equal(out3, torch.zeros_like(out3))


@pytest.mark.parametrize("block_n", [1, 4])
@pytest.mark.parametrize("feature", [FEATURES[0], FEATURES[3], FEATURES[7]],
                         ids=[FEATURES[0][0], FEATURES[3][0], FEATURES[7][0]])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_num_splits_equal_one_split(block_n, feature, paged):
    B, Hq, Hkv, Sq, D, S_max, S_new = 4, 4, 2, 4, 8, 32, 2
    cached = [0, 3, 13, S_max - S_new]  # L_b = 2, 5, 15, 32
    q, k_cache, v_cache, k, v, cs = _make_problem(B, Hq, Hkv, Sq, D, S_max, cached, S_new,
                                                  seed=block_n + len(feature[0]))
    block_table = None
    if paged:
        k_cache, v_cache, block_table = _paged_from_dense(k_cache, v_cache, cached, 16, seed=4)
    opts = _opts(feature, B, Hq)

    def run(num_splits):
        return attention_with_kvcache_reference(
            q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=cs, block_table=block_table,
            num_splits=num_splits, return_lse=True, block_m=2, block_n=block_n, **opts)

    out1, lse1 = run(1)
    out_ref, lse_ref = _naive_kvcache(
        q, *_dense_view(k_cache, v_cache, block_table, cached, S_max), k, v, cached, opts)
    assert_close64(out1, out_ref, "num_splits=1 vs naive")
    assert_close64(lse1, lse_ref, "num_splits=1 vs naive")
    for num_splits in (2, 3, 7, 40):  # 40: more splits than keys (and than key blocks)
        out, lse = run(num_splits)
        assert_close64(out, out1, f"out num_splits={num_splits}", atol=1e-13)
        assert_close64(lse, lse1, f"lse num_splits={num_splits}", atol=1e-13)


def _dense_view(k_cache, v_cache, block_table, cached, S_max):
    """The dense cache (rows [0, cached[b]) filled) behind a cache that may be paged."""
    if block_table is None:
        return k_cache, v_cache
    B, Hkv, D = len(cached), k_cache.shape[1], k_cache.shape[3]
    dense = []
    for pool in (k_cache, v_cache):
        d = torch.full((B, Hkv, S_max, D), NAN, dtype=pool.dtype)
        for b, c in enumerate(cached):
            d[b, :, :c] = _pool_rows(pool, block_table, b, c)
        dense.append(d)
    return dense[0], dense[1]


@pytest.mark.parametrize("feature", [FEATURES[0], FEATURES[7]], ids=[FEATURES[0][0], FEATURES[7][0]])
def test_one_split_is_blocked_forward(feature):
    """num_splits = 1 is attention_forward_blocked on each sequence's logical keys, block for
    block: the same tiles, the same steps."""
    B, Hq, Hkv, Sq, D, S_max, S_new = 3, 4, 2, 5, 8, 24, 3
    cached = [2, 10, 21]
    q, k_cache, v_cache, k, v, cs = _make_problem(B, Hq, Hkv, Sq, D, S_max, cached, S_new, seed=21)
    opts = _opts(feature, B, Hq)
    out, lse = attention_with_kvcache_reference(q, k_cache.clone(), v_cache.clone(), k, v,
                                                cache_seqlens=cs, return_lse=True, block_m=4,
                                                block_n=8, **opts)
    slopes = opts.pop("alibi_slopes")
    for b, c in enumerate(cached):
        kb, vb = _logical_kv(k_cache, v_cache, k, v, b, c)
        o, l = attention_forward_blocked(
            q[b:b + 1], kb, vb, block_m=4, block_n=8,
            alibi_slopes=None if slopes is None else slopes[b], **opts)
        assert_close64(out[b:b + 1], o, f"out b={b}", atol=1e-14)
        assert_close64(lse[b:b + 1], l, f"lse b={b}", atol=1e-14)


# ---------------------------------------------------------------------------------------
# cache_seqlens as an int
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_cache_seqlens_int_equals_tensor(paged):
    B, Hq, Hkv, Sq, D, S_max, S_new, c = 3, 4, 1, 3, 8, 20, 2, 7
    q, k_cache, v_cache, k, v, _ = _make_problem(B, Hq, Hkv, Sq, D, S_max, [c] * B, S_new, seed=31)
    block_table = None
    if paged:
        k_cache, v_cache, block_table = _paged_from_dense(k_cache, v_cache, [c] * B, 16, seed=2)
    results, caches = [], []
    for cs in (c, torch.full((B,), c, dtype=torch.int32)):
        kc, vc = k_cache.clone(), v_cache.clone()
        results.append(attention_with_kvcache_reference(
            q, kc, vc, k, v, cache_seqlens=cs, block_table=block_table, is_causal=True,
            return_lse=True, num_splits=2, block_n=4))
        caches.append((kc, vc))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    for a, b in zip(caches[0], caches[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
