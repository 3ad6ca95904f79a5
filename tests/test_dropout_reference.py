"""Attention dropout in the executable specification (flash_cuda.reference): the counter-based
random numbers every kernel draws alike (Philox4x32-10 and the mapping of an element to a draw),
the keep rate and independence of the mask, and dropout in the naive and the blocked forward and
backward, which must agree exactly in float64 given the same mask. CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from flash_cuda import reference as R

# Random123's known-answer vectors for philox4x32 with 10 rounds (tests/kat_vectors of
# github.com/DEShawResearch/random123): counter, key, result.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers(counter, key, expected):
    got = R.philox4x32_10([torch.tensor(c) for c in counter], key)
    assert tuple(int(w) for w in got) == expected


def test_philox_vectorized_equals_scalar():
    g = torch.Generator().manual_seed(0)
    ctr = [torch.randint(0, 2 ** 32, (50,), generator=g, dtype=torch.int64) for _ in range(4)]
    key = (0x12345678, 0x9ABCDEF0)
    batch = R.philox4x32_10(ctr, key)
    for n in (0, 17, 49):
        one = R.philox4x32_10([c[n] for c in ctr], key)
        assert [int(w[n]) for w in batch] == [int(w) for w in one]


def test_threshold_and_scale():
    assert R.dropout_keep_threshold(0.0) == 65536 and R.dropout_scale(0.0) == 1.0
    assert R.dropout_keep_threshold(1.0) == 0 and R.dropout_scale(1.0) == 0.0
    for p in (0.1, 0.25, 0.5, 0.9, 1e-6):
        t = R.dropout_keep_threshold(p)
        assert abs(t / 65536 - (1 - p)) <= 0.5 / 65536
        assert R.dropout_scale(p) * t / 65536 == pytest.approx(1.0, abs=1e-15)  # unbiased
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="dropout_p"):
            R.dropout_keep_threshold(bad)


def test_mapping_of_an_element_to_its_draw():
    """dropout_random16 follows the mapping the module states, element by element."""
    seed, offset = 0x1234_5678_9ABC, (3 << 32) + 77
    key = (seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF)
    for bh, i, j in [(0, 0, 0), (3, 5, 9), (7, 8, 1), (2, 15, 15), (1, 16, 31), (5, 300, 1000), (4, 41, 22)]:
        words = R.philox4x32_10([torch.tensor(x) for x in ((j // 16) * 4 + (j % 8) // 2, (i // 16) * 8 + i % 8, bh,
                                                          offset & 0xFFFFFFFF)], key)
        word = int(words[((i % 16) // 8) * 2 + (j % 16) // 8])
        expected = (word >> (16 * (j % 2))) & 0xFFFF
        got = R.dropout_random16(torch.tensor(bh), torch.tensor(i), torch.tensor(j), seed, offset)
        assert int(got) == expected, (bh, i, j)


def test_one_draw_covers_the_eight_elements_of_a_thread():
    """Rows r, r + 8 x columns 2c, 2c + 1 of two 8-column tiles: eight distinct 16-bit halves
    of one draw (the tensor-core fragment of one thread in a 16 x 16 block)."""
    rows = torch.tensor([3, 11]).view(2, 1)
    cols = torch.tensor([4, 5, 12, 13]).view(1, 4)
    r = R.dropout_random16(torch.tensor(2), rows, cols, 9, 0).flatten().tolist()
    words = R.philox4x32_10([torch.tensor(x) for x in (2, 3, 2, 0)], (9, 0))
    halves = sorted(int(w) >> s & 0xFFFF for w in words for s in (0, 16))
    assert sorted(r) == halves


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_and_independence(p):
    B, H, S, K = 2, 4, 256, 512
    mask = R.dropout_keep_mask(B, H, S, K, p, seed=2024, offset=8)
    n = mask.numel()
    rate = mask.double().mean().item()
    keep = R.dropout_keep_threshold(p) / 65536
    assert abs(rate - keep) < 6 * math.sqrt(keep * (1 - keep) / n), rate
    # rate per head and per row block: no head or block is off
    per_head = mask.double().mean(dim=(2, 3))
    assert float((per_head - keep).abs().max()) < 6 * math.sqrt(keep * (1 - keep) / (S * K))
    bound = 6 / math.sqrt(n / 2)
    m = mask
    # neighbours inside one draw (column pair, row + 8, the next 8-column tile) and across draws
    for name, a, b in [("column + 1", m[..., :-1], m[..., 1:]), ("column + 8", m[..., :-8], m[..., 8:]),
                       ("column + 16", m[..., :-16], m[..., 16:]), ("row + 1", m[:, :, :-1], m[:, :, 1:]),
                       ("row + 8", m[:, :, :-8], m[:, :, 8:]), ("head + 1", m[:, :-1], m[:, 1:]),
                       ("batch + 1", m[:-1], m[1:])]:
        assert abs(_corr(a, b)) < bound, name
    other = [R.dropout_keep_mask(B, H, S, K, p, seed=2024, offset=9),
             R.dropout_keep_mask(B, H, S, K, p, seed=2025, offset=8),
             R.dropout_keep_mask(B, H, S, K, p, seed=2024, offset=8 + (1 << 32))]
    for name, o in zip(("offset + 1", "seed + 1", "offset + 2^32"), other):
        assert abs(_corr(m, o)) < 6 / math.sqrt(n), name
    assert torch.equal(m, R.dropout_keep_mask(B, H, S, K, p, seed=2024, offset=8))  # a pure function


def test_random16_is_uniform():
    r = R.dropout_random16(torch.arange(8).view(8, 1, 1), torch.arange(64).view(1, 64, 1),
                           torch.arange(256).view(1, 1, 256), 5, 0)
    counts = torch.bincount((r >> 8).flatten(), minlength=256).double()
    expected = r.numel() / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 255 + 6 * math.sqrt(2 * 255), chi2  # 255 degrees of freedom, ~6 sigma


def _inputs(B, Hq, Hkv, Sq, Sk, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(B, Hq, Sq, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, Hq, Sq, generator=g, dtype=torch.float64)
    return q, k, v, do, dlse


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("opts", [dict(), dict(is_causal=True), dict(window_size=(7, 3), softcap=5.0)],
                         ids=["full", "causal", "window_softcap"])
def test_blocked_equals_naive_with_dropout(p, opts):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 37, 53, 16
    q, k, v, do, dlse = _inputs(B, Hq, Hkv, Sq, Sk, D, seed=3)
    mask = R.dropout_keep_mask(B, Hq, Sq, Sk, p, seed=11, offset=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = R.attention_naive(*leaves, dropout_p=p, dropout_mask=mask, **opts)
    loss = (out * do).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()
    ref_grads = torch.autograd.grad(loss, leaves)
    b_out, b_lse = R.attention_forward_blocked(q, k, v, dropout_p=p, dropout_mask=mask, block_m=16, block_n=16,
                                               **opts)
    assert torch.allclose(b_out, out, atol=1e-12) and torch.allclose(b_lse, lse, atol=1e-12)
    grads = R.attention_backward_blocked(do, q, k, v, b_out, b_lse, dlse=dlse, dropout_p=p, dropout_mask=mask,
                                         block_m=16, block_n=32, **opts)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.allclose(got, ref, atol=1e-11), (name, float((got - ref).abs().max()))
    # lse is that of the probabilities before dropout
    _, lse0 = R.attention_naive(q, k, v, **opts)
    assert torch.allclose(lse, lse0, atol=1e-12)


def test_dropout_limits():
    q, k, v, do, _ = _inputs(1, 2, 2, 24, 24, 8, seed=4)
    base, _ = R.attention_naive(q, k, v)
    same, _ = R.attention_naive(q, k, v, dropout_p=0.0)
    assert torch.equal(same, base)
    none_kept, _ = R.attention_naive(q, k, v, dropout_p=1.0)
    assert torch.equal(none_kept, torch.zeros_like(none_kept))
    out, lse = R.attention_forward_blocked(q, k, v, dropout_p=1.0, block_m=8, block_n=8)
    dq, dk, dv = R.attention_backward_blocked(do, q, k, v, out, lse, dropout_p=1.0, block_m=8, block_n=8)
    assert torch.equal(out, torch.zeros_like(out))
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))
    with pytest.raises(ValueError, match="dropout_mask must be bool"):
        R.attention_naive(q, k, v, dropout_p=0.5, dropout_mask=torch.ones(1, 2, 24, 23, dtype=torch.bool))


def test_mean_over_masks_is_the_output_without_dropout():
    """The scale is the inverse of the exact keep rate: averaged over many seeds the output
    approaches the output without dropout (its standard error shrinks as 1 / sqrt(seeds))."""
    q, k, v, _, _ = _inputs(1, 1, 1, 8, 64, 8, seed=5)
    base, _ = R.attention_naive(q, k, v)
    n = 400
    outs = torch.stack([R.attention_naive(q, k, v, dropout_p=0.3,
                                          dropout_mask=R.dropout_keep_mask(1, 1, 8, 64, 0.3, seed=s))[0]
                        for s in range(n)])
    err = (outs.mean(0) - base).abs()
    stderr = outs.std(0) / math.sqrt(n)
    assert bool((err < 6 * stderr + 1e-12).all()), float((err / stderr).max())


def test_packed_batch_draws_as_the_dense_batch():
    """A packed batch of equal lengths is a dense batch: sequence b's mask is batch entry b's."""
    cu = torch.tensor([0, 20, 40, 60], dtype=torch.int32)
    masks = R.dropout_keep_masks_varlen(cu, cu, 3, 0.3, seed=9, offset=2)
    dense = R.dropout_keep_mask(3, 3, 20, 20, 0.3, seed=9, offset=2)
    assert all(torch.equal(m[0], dense[b]) for b, m in enumerate(masks))


@pytest.mark.parametrize("p", [0.2])
def test_varlen_blocked_equals_naive_with_dropout(p):
    g = torch.Generator().manual_seed(6)
    lq, lk = [17, 0, 33, 5], [21, 4, 33, 1]
    cq = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32)
    ck = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lq), 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(sum(lk), 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn_like(q)
    masks = R.dropout_keep_masks_varlen(cq, ck, 4, p, seed=3, offset=8)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = R.attention_varlen_naive(*leaves, cq, ck, is_causal=True, dropout_p=p, dropout_masks=masks)
    ref_grads = torch.autograd.grad((out * do).sum(), leaves)
    b_out, b_lse = R.attention_varlen_forward_blocked(q, k, v, cq, ck, is_causal=True, dropout_p=p,
                                                      dropout_masks=masks, block_m=16, block_n=16)
    assert torch.allclose(b_out, out, atol=1e-12)
    grads = R.attention_varlen_backward_blocked(do, q, k, v, b_out, b_lse, cq, ck, is_causal=True, dropout_p=p,
                                                dropout_masks=masks, block_m=16, block_n=16)
    for got, ref in zip(grads, ref_grads):
        assert torch.allclose(got, ref, atol=1e-11)
    with pytest.raises(ValueError, match="one mask per sequence"):
        R.attention_varlen_naive(q, k, v, cq, ck, dropout_p=p, dropout_masks=masks[:2])
