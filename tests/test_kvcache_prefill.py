"""The prefill route of flash_cuda.attention_with_kvcache for paged caches and tensor lengths
(flash_cuda.kvcache_prefill: append, gather, attention()'s forward), on CPU through the
extension's stand-in (tests/conftest.py: its fwd is the blocked reference, dense and packed).

* Against flash_cuda.reference.attention_with_kvcache_reference with the FlashAttention rule of
  tests/attn_check.py (error vs the float64 reference at most twice that of the reference in
  bfloat16, plus a tiny absolute term; rows that see no key: out 0, lse -inf): pages of 16 and
  256, B 1 and 4, a different cache length per sequence (0 included), Sq 17 / 100 / 300, causal
  and not, GQA, windows, softcap, ALiBi per head and per sequence, sinks, no new keys. The caches
  after the call equal the reference's bit for bit (the append, and nothing else written).
* The route taken: Sq <= 16 runs the decode binding, Sq > 16 with pages or tensor lengths the
  forward (dense for equal lengths, packed otherwise), a dense cache with an int length its own
  route; the op (torch.compile's path) takes the same route.
* Layouts (a transposed pool, q in (B, S, H, D) memory: out laid out like torch.empty_like(q)),
  the gather in groups under a memory budget, and wrong lengths / page ids clamped as the
  kernels clamp them (wrong results, never an index outside the cache).
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda import kvcache_ops, kvcache_prefill
from flash_cuda.reference import attention_with_kvcache_reference

from attn_check import ATOL_BASE, LSE_ATOL_BASE, make_alibi_slopes, rule_error

BF16 = torch.bfloat16
NEG_INF = float("-inf")


def _case(B, Hq, Hkv, Sq, D, cached, page_size, s_new=None, cap_pages=None, transposed_pool=False, seed=0):
    """(q, k_cache, v_cache, k, v, lens, table): a paged pool (or a dense cache for page_size
    None) with random contents everywhere, pages dealt out in a shuffled order, and s_new (default
    Sq) new tokens per sequence (None: no new keys)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(BF16)

    s_new = Sq if s_new is None else s_new
    q = rnd(B, Hq, Sq, D)
    k = rnd(B, Hkv, s_new, D) if s_new else None
    v = rnd(B, Hkv, s_new, D) if s_new else None
    need = max(cached) + s_new
    if page_size is None:
        return q, rnd(B, Hkv, need + 5, D), rnd(B, Hkv, need + 5, D), k, v, _lens(cached), None
    pages = cap_pages or -(-need // page_size)
    num_pages = B * pages + 3
    shape = (num_pages, page_size, Hkv, D) if transposed_pool else (num_pages, Hkv, page_size, D)
    kc, vc = rnd(*shape), rnd(*shape)
    if transposed_pool:
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    table = torch.randperm(num_pages, generator=g)[:B * pages].view(B, pages).to(torch.int32)
    return q, kc, vc, k, v, _lens(cached), table


def _lens(cached):
    return torch.tensor(cached, dtype=torch.int32)


def _up(t):
    return None if t is None else t.double()


def _check(q, kc, vc, k, v, lens, table, **opts):
    """The API call against the reference (float64 truth, bfloat16 for the rule's naive term);
    the caches after the call equal the bfloat16 reference's. Returns (out, lse)."""
    rk, rv = kc.clone(), vc.clone()
    sinks = opts.get("sinks")
    ref_opts = dict(opts)
    slopes = ref_opts.get("alibi_slopes")
    want, want_lse = attention_with_kvcache_reference(
        q.double(), kc.double(), vc.double(), _up(k), _up(v), cache_seqlens=lens, block_table=table,
        return_lse=True, **{**ref_opts, "sinks": _up(sinks), "alibi_slopes": _up(slopes)})
    naive, naive_lse = attention_with_kvcache_reference(q, rk, rv, k, v, cache_seqlens=lens, block_table=table,
                                                        return_lse=True, **ref_opts)
    out, lse = flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                 return_lse=True, **opts)
    assert torch.equal(kc, rk) and torch.equal(vc, rv), "the caches differ from the reference's after the append"
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == torch.empty_like(q).stride()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and lse.is_contiguous()
    finite = torch.isfinite(want_lse)
    if sinks is None:
        assert bool((lse[~finite] == NEG_INF).all()), "rows that see no key: lse -inf"
    assert bool(torch.isfinite(out).all()) and bool((out[~finite] == 0).all()), "rows that see no key: out 0"
    problems = []
    score_mag = float(want_lse[finite].abs().max()) if bool(finite.any()) else 0.0
    _, p = rule_error("out", out.double(), want, naive.double(), ATOL_BASE[BF16], score_mag=score_mag,
                      head_dim=q.shape[-1])
    problems.append(p)
    if bool(finite.any()):
        _, p = rule_error("lse", lse.double(), want_lse, naive_lse.double(), LSE_ATOL_BASE[BF16], mask=finite)
        problems.append(p)
    problems = [p for p in problems if p]
    assert not problems, "; ".join(problems)
    return out, lse


class _Routes:
    """Counts the gathered route's calls (the binding's calls are counted by the stand-in)."""

    def __init__(self, monkeypatch):
        self.gathered = 0
        real = kvcache_ops.gathered_prefill

        def counting(*args, **kwargs):
            self.gathered += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(kvcache_ops, "gathered_prefill", counting)


# (id, Hq, Hkv, options)
FEATURES = [
    ("plain-gqa", 8, 2, dict()),
    ("causal-gqa", 8, 2, dict(is_causal=True)),
    ("causal-mha", 4, 4, dict(is_causal=True)),
    ("window-causal-gqa", 6, 2, dict(is_causal=True, window_size=(40, -1))),
    ("window-both", 4, 2, dict(window_size=(25, 7))),
]


# Every feature at Sq 17 and 100; at Sq 300 (the reference's CPU time grows with Sq * L) the
# plain, causal and windowed ones, over shorter caches.
SHAPES = [pytest.param(Sq, f, id=f"{Sq}-{f[0]}") for Sq in (17, 100) for f in FEATURES] + \
    [pytest.param(300, f, id=f"300-{f[0]}") for f in FEATURES if f[0] in ("plain-gqa", "causal-gqa",
                                                                           "window-causal-gqa")]


@pytest.mark.parametrize("Sq,feature", SHAPES)
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("page_size", [16, 256])
def test_paged_prefill_matches_reference(mock_kvcache, monkeypatch, page_size, B, Sq, feature):
    _, Hq, Hkv, opts = feature
    # Lengths that end mid-page, span several pages, and 0 (a new sequence).
    cached = ([0, 300, 17, 529] if Sq < 300 else [0, 90, 17, 160])[:B] if B > 1 else [page_size + 3]
    routes = _Routes(monkeypatch)
    _check(*_case(B, Hq, Hkv, Sq, 32, cached, page_size, seed=Sq + B + page_size), **opts)
    assert routes.gathered == 1 and mock_kvcache.kvcache_calls == 0 and mock_kvcache.fwd_calls == 1
    # One sequence (or equal lengths) runs the dense forward; different lengths the packed one.
    assert mock_kvcache.last_fwd_args["varlen"] == (B > 1)


@pytest.mark.parametrize("name,opts", [
    ("softcap-scale", dict(is_causal=True, softcap=3.0, scale=0.4)),
    ("negative-scale", dict(scale=-0.2)),
    ("alibi-heads", dict(is_causal=True, alibi="heads")),
    ("alibi-batch", dict(alibi="batch", window_size=(60, 0))),
    ("sinks", dict(is_causal=True, sinks=True)),
    ("all", dict(is_causal=True, window_size=(50, 0), softcap=5.0, alibi="batch", sinks=True, num_splits=3)),
])
def test_score_options_pass_through(mock_kvcache, name, opts):
    opts = dict(opts)
    B, Hq = 4, 8
    alibi = opts.pop("alibi", None)
    if alibi:
        opts["alibi_slopes"] = make_alibi_slopes(Hq, batch=B if alibi == "batch" else None, device="cpu", seed=3)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.linspace(-1.0, 2.0, Hq)
    _check(*_case(B, Hq, 2, 33, 64, [0, 70, 16, 5], 16, seed=len(name)), **opts)
    assert mock_kvcache.kvcache_calls == 0 and mock_kvcache.fwd_calls == 1
    if "sinks" in opts:
        assert torch.equal(mock_kvcache.last_fwd_sinks, opts["sinks"])


@pytest.mark.parametrize("page_size", [16, None], ids=["paged", "dense"])
def test_no_new_keys_and_rows_without_keys(mock_kvcache, page_size):
    """k / v None: the queries attend to the cached keys alone; a sequence that holds none (and
    causal rows above a short sequence's diagonal) gets out 0 and lse -inf."""
    case = _case(4, 4, 2, 40, 32, [0, 5, 100, 40], page_size, s_new=0, seed=4)
    before = case[1].clone()
    out, lse = _check(*case, is_causal=True)
    assert torch.equal(case[1], before)
    assert bool((lse[0] == NEG_INF).all()) and bool((out[0] == 0).all())
    assert bool((lse[1, :, :35] == NEG_INF).all()) and bool(torch.isfinite(lse[1, :, 35:]).all())


def test_dense_cache_tensor_lengths_and_equal_lengths(mock_kvcache):
    """A dense cache with a tensor cache_seqlens takes the route too; equal lengths in a batch
    run the dense forward on a (B, Hkv, L, D) view of the gathered rows."""
    _check(*_case(3, 8, 2, 24, 32, [10, 0, 31], None, seed=1), is_causal=True)
    assert mock_kvcache.last_fwd_args["varlen"] and mock_kvcache.kvcache_calls == 0
    _check(*_case(3, 8, 2, 24, 32, [20, 20, 20], 16, seed=2), is_causal=True)
    assert not mock_kvcache.last_fwd_args["varlen"] and mock_kvcache.fwd_calls == 2


@pytest.mark.parametrize("page_size", [16, 256])
def test_first_chunk_into_empty_pages(mock_kvcache, page_size):
    """Every sequence empty (a prompt's first chunk): the dense forward on k / v themselves, the
    chunk appended; and with no new keys at all, every row sees nothing."""
    _check(*_case(3, 8, 2, 40, 32, [0, 0, 0], page_size, seed=11), is_causal=True)
    assert mock_kvcache.fwd_calls == 1 and not mock_kvcache.last_fwd_args["varlen"]
    out, lse = _check(*_case(2, 4, 2, 20, 32, [0, 0], page_size, s_new=0, cap_pages=2, seed=12))
    assert bool((out == 0).all()) and bool((lse == NEG_INF).all()) and mock_kvcache.fwd_calls == 1


def test_int_length_with_pages(mock_kvcache, monkeypatch):
    """An int cache_seqlens with a paged cache: the same route, with no lengths to read back."""
    routes = _Routes(monkeypatch)
    q, kc, vc, k, v, _, table = _case(2, 4, 2, 20, 32, [37, 37], 16, seed=5)
    rk, rv = kc.clone(), vc.clone()
    out = flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=37, block_table=table, is_causal=True)
    want = flash_cuda.attention_with_kvcache(q, rk, rv, k, v, cache_seqlens=_lens([37, 37]), block_table=table,
                                             is_causal=True)
    assert torch.equal(out, want) and torch.equal(kc, rk) and routes.gathered == 2


@pytest.mark.parametrize("Sq,route", [(1, "decode"), (16, "decode"), (17, "gathered")])
@pytest.mark.parametrize("cache", ["paged", "dense-tensor", "dense-int"])
def test_route_taken(mock_kvcache, monkeypatch, Sq, route, cache):
    """Decode-shaped calls (Sq <= 16) keep the decode binding; longer chunks against pages or
    device lengths take the gathered route; a dense cache with an int length its own route (the
    forward on the cache's rows, nothing gathered)."""
    routes = _Routes(monkeypatch)
    q, kc, vc, k, v, lens, table = _case(2, 4, 2, Sq, 32, [9, 30], None if cache.startswith("dense") else 16,
                                         seed=Sq)
    lengths = 9 if cache == "dense-int" else lens
    flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, block_table=table, is_causal=True)
    if route == "decode":
        assert mock_kvcache.kvcache_calls == 1 and mock_kvcache.fwd_calls == 0 and routes.gathered == 0
    elif cache == "dense-int":
        assert mock_kvcache.kvcache_calls == 0 and mock_kvcache.fwd_calls == 1 and routes.gathered == 0
    else:
        assert mock_kvcache.kvcache_calls == 0 and mock_kvcache.fwd_calls == 1 and routes.gathered == 1


def test_op_takes_the_route(mock_kvcache, monkeypatch):
    """The custom op (torch.compile's path) runs the same route, with its fake's outputs."""
    routes = _Routes(monkeypatch)
    q, kc, vc, k, v, lens, table = _case(2, 4, 2, 20, 32, [9, 30], 16, seed=6)
    ek, ev = kc.clone(), vc.clone()
    args = (q, kc, vc, k, v, lens, 0, table, 1.0 / math.sqrt(32), -1, 0, 0.0, None, 0, True, False)
    out, lse = torch.ops.flash_cuda.fwd_kvcache(*args)
    want, want_lse = flash_cuda.attention_with_kvcache(q, ek, ev, k, v, cache_seqlens=lens, block_table=table,
                                                       is_causal=True, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and torch.equal(kc, ek) and routes.gathered == 2
    torch.library.opcheck(torch.ops.flash_cuda.fwd_kvcache.default, args)


@pytest.mark.parametrize("q_bshd", [False, True])
def test_layouts(mock_kvcache, q_bshd):
    """A (pages, page_size, Hkv, D) pool seen transposed, and q in (B, S, H, D) memory: out is
    laid out like torch.empty_like(q) (the packed forward's rows are q's layout then: no copy)."""
    q, kc, vc, k, v, lens, table = _case(3, 8, 2, 19, 32, [3, 40, 0], 16, transposed_pool=True, seed=7)
    if q_bshd:
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
        k = k.transpose(1, 2).contiguous().transpose(1, 2)  # k / v with strides the int64 view takes too
    storage = kc.transpose(1, 2)
    _check(q, kc, vc, k, v, lens, table, is_causal=True)
    assert storage.is_contiguous() and storage.data_ptr() == kc.data_ptr()


def test_unaligned_new_keys(mock_kvcache):
    """k / v whose rows the int64 view cannot take (an odd offset into their storage): appended
    element by element, the same result."""
    q, kc, vc, k, v, lens, table = _case(2, 4, 2, 18, 32, [5, 21], 16, seed=8)
    flat_k, flat_v = torch.empty(k.numel() + 1, dtype=BF16), torch.empty(v.numel() + 1, dtype=BF16)
    k_odd, v_odd = flat_k[1:].view(k.shape), flat_v[1:].view(v.shape)
    k_odd.copy_(k)
    v_odd.copy_(v)
    _check(q, kc, vc, k_odd, v_odd, lens, table, is_causal=True)


def test_gather_in_groups(mock_kvcache, monkeypatch):
    """Under a small memory budget the sequences are gathered and attended in consecutive groups
    (one forward each, the largest sequence alone), with the same results."""
    row_bytes = 2 * 2 * 32 * 2  # K and V, 2 KV heads of 32 bfloat16 values
    monkeypatch.setattr(kvcache_prefill, "GATHER_BUDGET_BYTES", 120 * row_bytes)
    cached = [10, 20, 100, 0, 50]  # L_b = 30, 40, 120, 20, 70: groups [0, 2), [2, 3), [3, 5)
    case = _case(5, 4, 2, 20, 32, cached, 16, seed=9)
    _check(*case, is_causal=True)
    assert mock_kvcache.fwd_calls == 3


def test_wrong_lengths_and_pages_are_clamped(mock_kvcache):
    """Values the kernels trust and clamp (a length outside [0, capacity - s_new], a page id
    outside the pool) are clamped here too: the call runs (no index error) and equals the call
    with the clamped values."""
    q, kc, vc, k, v, lens, table = _case(3, 4, 2, 20, 32, [5, 40, 0], 16, cap_pages=4, seed=10)
    capacity = 4 * 16
    bad_lens = torch.tensor([-7, 500, 3], dtype=torch.int32)
    bad_table = table.clone()
    bad_table[2, 0] = 10_000
    bad_table[0, 1] = -3
    ek, ev = kc.clone(), vc.clone()
    out = flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=bad_lens, block_table=bad_table,
                                           is_causal=True)
    num_pages = kc.shape[0]
    want = flash_cuda.attention_with_kvcache(q, ek, ev, k, v, cache_seqlens=bad_lens.clamp(0, capacity - 20),
                                             block_table=bad_table.clamp(0, num_pages - 1), is_causal=True)
    assert torch.equal(out, want) and torch.equal(kc, ek) and torch.equal(vc, ev)


def test_cache_slots():
    table = torch.tensor([[3, 1], [0, 7]], dtype=torch.int32)
    seq = torch.tensor([0, 0, 1, 1, 1])
    pos = torch.tensor([0, 17, 5, 16, 31])
    first, second = kvcache_prefill.cache_slots(table, 5, 16, seq, pos)
    assert first.tolist() == [3, 1, 0, 4, 4] and second.tolist() == [0, 1, 5, 0, 15]  # page 7 clamped to 4
    assert kvcache_prefill.cache_slots(None, 5, 16, seq, pos) == (seq, pos)
