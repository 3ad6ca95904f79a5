"""Attention sinks through ``flash_cuda.attention_with_kvcache`` on CPU: the sinks reach the
binding (float32, contiguous) and the prefill routes, the results are the KV-cache reference's
with the same sinks (dense, paged, decode and prefill), sinks of -inf are no sinks, the custom op
takes them under torch.compile(fullgraph=True), and bad sinks are refused before anything is
written. The kernels' side (csrc: every decode and split merge) is tested on the GPU in
tests/test_sinks_gpu.py."""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda.reference import attention_with_kvcache_reference

BF16 = torch.bfloat16
OP = torch.ops.flash_cuda.fwd_kvcache.default

# (Sq, s_new, page_size, lens): decode with tensor / int lengths, paged, and the prefill routes
# (a dense cache with an int length, an empty cache and one holding keys; pages with tensor
# lengths, gathered), which run attention()'s forward instead of the decode kernels.
CASES = {
    "decode-tensor-lens": (1, 1, None, [5, 30]),
    "decode-int-len": (1, 1, None, 17),
    "spec-paged": (3, 2, 16, [33, 0]),
    "prefill-empty": (20, 20, None, 0),
    "prefill-cached": (20, 20, None, 9),
    "prefill-paged": (20, 20, 16, [30, 3]),
}


def _case(Sq, s_new, page_size, B=2, Hq=4, Hkv=2, D=32, cap=64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(BF16)

    q = rnd(B, Hq, Sq, D)
    k, v = (rnd(B, Hkv, s_new, D), rnd(B, Hkv, s_new, D)) if s_new else (None, None)
    if page_size is None:
        return q, rnd(B, Hkv, cap, D), rnd(B, Hkv, cap, D), k, v, None
    pages = cap // page_size
    num_pages = B * pages + 1
    table = torch.randperm(num_pages, generator=g)[:B * pages].view(B, pages).to(torch.int32)
    return q, rnd(num_pages, Hkv, page_size, D), rnd(num_pages, Hkv, page_size, D), k, v, table


def _lens(lens):
    return torch.tensor(lens, dtype=torch.int32) if isinstance(lens, list) else lens


def _sinks(Hq=4, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(Hq, generator=g) * 4 - 1).to(dtype)  # about the size of the scaled logits


def _clones(*ts):
    return tuple(None if t is None else t.clone() for t in ts)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference_with_sinks(mock_kvcache, name):
    Sq, s_new, page_size, lens = CASES[name]
    q, kc, vc, k, v, table = _case(Sq, s_new, page_size, seed=len(name))
    lens, sinks = _lens(lens), _sinks().to(BF16).float()  # the sinks a bf16 model holds
    rk, rv = _clones(kc, vc)
    expect, expect_lse = attention_with_kvcache_reference(
        q.double(), rk.double(), rv.double(), None if k is None else k.double(), None if v is None else v.double(),
        cache_seqlens=lens, block_table=table, is_causal=True, sinks=sinks.double(), return_lse=True)
    pk, pv = _clones(kc, vc)
    plain = flash_cuda.attention_with_kvcache(q, pk, pv, k, v, cache_seqlens=lens, block_table=table, is_causal=True)
    out, lse = flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table,
                                                 is_causal=True, sinks=sinks.to(BF16), return_lse=True)
    assert (out.double() - expect).abs().max().item() < 2e-2
    assert (lse.double() - expect_lse).abs().max().item() < 1e-3
    assert (out.float() - plain.float()).abs().max().item() > 1e-2, "the sinks made no difference"
    assert torch.equal(kc, pk) and torch.equal(vc, pv), "the append differs from the call without sinks"
    assert (not s_new) or not torch.equal(kc, rk), "no append"


def test_minus_inf_sinks_are_no_sinks(mock_kvcache):
    q, kc, vc, k, v, table = _case(1, 1, None)
    lens = _lens([7, 40])
    plain = flash_cuda.attention_with_kvcache(q, *_clones(kc, vc), k, v, cache_seqlens=lens, is_causal=True)
    none = flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, is_causal=True,
                                             sinks=torch.full((4,), -math.inf))
    assert torch.equal(plain, none)


def test_binding_gets_float32_contiguous_sinks(mock_kvcache):
    q, kc, vc, k, v, _ = _case(1, 1, None)
    wide = _sinks(8, dtype=BF16)
    flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=_lens([3, 9]), sinks=wide[::2])
    got = mock_kvcache.last_kvcache_sinks
    assert got.dtype == torch.float32 and got.is_contiguous() and torch.equal(got, wide[::2].float())


@pytest.mark.parametrize("bad,exc,words", [
    (torch.zeros(3), ValueError, "sinks must be a floating tensor of shape (4,)"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "got dtype int32"),
    ([0.0, 0.0, 0.0, 0.0], TypeError, "sinks must be None or a floating tensor of shape (4,)"),
    (torch.zeros(4, device="meta"), RuntimeError, "sinks must be on q's device"),
])
def test_bad_sinks_are_refused_before_the_append(mock_kvcache, bad, exc, words):
    q, kc, vc, k, v, _ = _case(1, 1, None)
    before = kc.clone()
    with pytest.raises(exc) as info:
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=_lens([3, 9]), sinks=bad)
    assert str(info.value).startswith("flash_cuda.attention_with_kvcache: ") and words in str(info.value)
    assert torch.equal(kc, before) and mock_kvcache.kvcache_calls == 0


def test_kept_signature_still_checks_the_sinks(mock_kvcache):
    """A signature seen with good sinks does not let a call with bad ones skip the checks."""
    q, kc, vc, k, v, _ = _case(1, 1, None)
    lens = _lens([3, 9])
    flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, sinks=_sinks())
    with pytest.raises(TypeError, match="got dtype int32"):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, sinks=torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, sinks=torch.zeros(5))


def _step(q, kc, vc, k, v, lens, table, sinks):
    return flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, is_causal=True,
                                             sinks=sinks, return_lse=True)


@pytest.mark.parametrize("name", ["decode-tensor-lens", "spec-paged", "prefill-cached", "prefill-paged"])
def test_compiled_step_with_sinks(mock_kvcache, name):
    Sq, s_new, page_size, lens = CASES[name]
    q, kc, vc, k, v, table = _case(Sq, s_new, page_size, seed=3)
    lens, sinks = _lens(lens), _sinks()
    ek, ev = _clones(kc, vc)
    expect = _step(q, ek, ev, k, v, lens, table, sinks)
    torch._dynamo.reset()
    got = torch.compile(_step, fullgraph=True, backend="aot_eager")(q, kc, vc, k, v, lens, table, sinks)
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


def test_opcheck_with_sinks(mock_kvcache):
    q, kc, vc, k, v, table = _case(2, 2, 16)
    args = (q, kc, vc, k, v, _lens([33, 0]), 0, table, 1.0 / math.sqrt(q.shape[-1]), -1, 0, 0.0, None, 0, True,
            False, _sinks())
    torch.library.opcheck(OP, args)
