"""Attention sinks (gpt-oss's learned per-head logit, ``sinks=``) on the GPU, in every forward
tier and the split merges, and their gradient.

Every case runs through tests/attn_check.py's rule (error vs float64 at most twice the error of
naive attention in the inputs' dtype, plus a tiny absolute term) for out, lse, dq, dk, dv and
d(sinks), with flash_cuda.reference's sinks on the reference side. On top of the rule:

* sinks of -inf are no sinks: the results equal those of a call without sinks bit for bit (the
  sink merges into the finished statistics with factors 1 and 0 exactly);
* a sink far above every logit: out relative to its own size (the rule's absolute floor would
  let anything that small pass), and a sink beyond the float range of the logits: lse = sink,
  out ~ 0, nothing NaN;
* rows that see no key: out exactly 0 and lse = the head's sink;
* the split merges (the fp32 forward's last wave, the split-KV decode) add the sink once.

The tiers: kernel='auto' on fp16 / bf16 (on sm_90 the warp-specialized Hopper forward,
GQA-packed at Sq <= 64, head dims 64 / 128 / 192 / 256), kernel='mma', fp32 (simt), the
warp-specialized forward alone (tier 4, sm_90 only), attention()'s decode-shaped calls (split-KV
decode), and the KV-cache binding (fwd_kvcache, dense and paged caches, splits 1 and n).
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda import _ext
from flash_cuda.reference import attention_naive, attention_varlen_naive

from attn_check import (ATOL_BASE, LSE_ATOL_BASE, check_attention, check_varlen_attention, hopper_skip_reason,
                        make_alibi_slopes, make_inputs, make_varlen_inputs, rule_error, ws_fwd)

pytestmark = pytest.mark.gpu

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
DEV = "cuda"


def _sinks(Hq: int, kind: str = "mixed", seed: int = 0, dtype=F32) -> torch.Tensor:
    """(Hq,) sinks. mixed: about the size of the rows' lse (log of a few hundred keys), one head
    -inf; large: ~8 above it (the keys keep a share of ~1e-3 .. 1e-4); small: far below (results
    ~ those without a sink); huge: beyond the float range of the logits (exp2(m - sink) = 0)."""
    g = torch.Generator().manual_seed(1234 + seed)
    base = {"mixed": 4.0, "large": 14.0, "small": -40.0, "huge": 300.0}[kind]
    s = base + 2.0 * torch.randn(Hq, generator=g, dtype=torch.float64)
    if kind == "mixed" and Hq > 1:
        s[Hq // 2] = float("-inf")
    return s.to(dtype).to(DEV)


def _relative_out_check(out, q, k, v, sinks, label, rel, **opts):
    """out against float64 relative to its own size (for outputs far below 1)."""
    ref, _ = attention_naive(q.double(), k.double(), v.double(), sinks=sinks.double(), **opts)
    err = float((out.double() - ref).abs().max())
    mag = float(ref.abs().max())
    assert mag > 0 and err <= rel * mag, f"[{label}] max|out - ref| = {err:.3e} > {rel} * max|ref| {mag:.3e}"


# ---------------------------------------------------------------------------------------
# 16-bit: kernel='auto' (on sm_90 the warp-specialized forward) and kernel='mma'
# ---------------------------------------------------------------------------------------

# (B, Hq, Hkv, Sq, Sk, D, is_causal, window): Sq > 16 (decode-shaped calls take the split-KV
# decode); Hq = 4 Hkv at Sq <= 64 packs the query heads of a group in one tile on sm_90.
CASES_16 = [
    (2, 8, 2, 48, 300, 64, False, (-1, -1)),    # GQA-packed tiles (sm_90), head of row r = r & 3
    (1, 8, 2, 40, 257, 128, True, (-1, -1)),    # GQA-packed, causal
    (2, 4, 2, 300, 300, 128, False, (-1, -1)),  # unpacked, two query blocks
    (1, 4, 1, 200, 333, 192, True, (-1, -1)),
    (1, 2, 1, 129, 260, 256, False, (-1, -1)),
    (2, 6, 3, 150, 190, 64, True, (32, -1)),    # causal + window
]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kernel", ["auto", "mma"])
@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal,window", CASES_16)
def test_sinks_16bit_matches_float64(dtype, kernel, B, Hq, Hkv, Sq, Sk, D, is_causal, window):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, DEV, seed=Sq + D)
    check_attention(q, k, v, is_causal=is_causal, scale=None, window_size=window, kernel=kernel,
                    sinks=_sinks(Hq, seed=D), with_dlse=Sq % 2 == 0, label=f"sinks {kernel}", seed=D)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kernel", ["auto", "mma"])
@pytest.mark.parametrize("kind", ["small", "large", "huge"])
def test_sinks_16bit_extreme_values(dtype, kernel, kind):
    B, Hq, Hkv, Sq, Sk, D = 1, 8, 2, 48, 200, 128
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, DEV, seed=5)
    sinks = _sinks(Hq, kind, seed=3)
    check_attention(q, k, v, is_causal=False, scale=None, kernel=kernel, sinks=sinks, with_dlse=True,
                    label=f"sinks {kind}")
    with torch.no_grad():
        out, lse = flash_cuda.attention(q, k, v, kernel=kernel, sinks=sinks, return_lse=True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    if kind == "large":
        _relative_out_check(out, q, k, v, sinks, f"{kind} {kernel}", 4 * ATOL_BASE[dtype])
    if kind == "huge":  # the keys' share is below the float range: lse is the sink
        torch.testing.assert_close(lse, sinks.view(1, Hq, 1).expand_as(lse), rtol=1e-6, atol=0)
        assert float(out.abs().max()) == 0.0


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
def test_sinks_16bit_softcap_alibi(dtype):
    q, k, v = make_inputs(2, 4, 2, 100, 150, 64, dtype, DEV, seed=11)
    check_attention(q, k, v, is_causal=True, scale=0.3, softcap=8.0, sinks=_sinks(4, seed=1),
                    label="sinks softcap", with_dlse=True)
    check_attention(q, k, v, is_causal=False, scale=None, alibi_slopes=make_alibi_slopes(4, batch=2),
                    sinks=_sinks(4, seed=2), label="sinks alibi")


@pytest.mark.parametrize("dtype,kernel", [(F16, "auto"), (BF16, "mma"), (F32, "auto")])
def test_sinks_rows_without_keys(dtype, kernel):
    """A window that leaves the first query rows without a key (Sq > Sk, bottom-right aligned):
    those rows get out 0 exactly and lse = their head's sink; the gradients still match."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 96, 40, 64
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, DEV, seed=21)
    sinks = _sinks(Hq, seed=4)
    window = (8, 0)
    check_attention(q, k, v, is_causal=False, scale=None, window_size=window, kernel=kernel, sinks=sinks,
                    with_dlse=True, label="sinks no-key rows")
    with torch.no_grad():
        out, lse = flash_cuda.attention(q, k, v, window_size=window, kernel=kernel, sinks=sinks, return_lse=True)
    empty = Sq - Sk  # rows i < Sq - Sk see no key (their window ends left of key 0)
    assert bool((out[:, :, :empty] == 0).all())
    torch.testing.assert_close(lse[:, :, :empty], sinks.view(1, Hq, 1).expand(B, Hq, empty), rtol=1e-6, atol=1e-6)
    assert bool(torch.isfinite(lse[:, torch.isfinite(sinks)]).all())  # a -inf sink's empty rows: -inf


@pytest.mark.parametrize("dtype,kernel,Sq", [(F16, "auto", 48), (BF16, "mma", 300), (F32, "auto", 300),
                                             (BF16, "auto", 1)])
def test_minus_inf_sinks_are_no_sinks_bitwise(dtype, kernel, Sq):
    """Sinks of -inf change nothing, bit for bit, in every tier (Sq = 1: the split-KV decode)."""
    q, k, v = make_inputs(2, 8, 2, Sq, 700, 128, dtype, DEV, seed=Sq)
    none = torch.full((8,), float("-inf"), device=DEV)
    with torch.no_grad():
        a = flash_cuda.attention(q, k, v, kernel=kernel, return_lse=True)
        b = flash_cuda.attention(q, k, v, kernel=kernel, return_lse=True, sinks=none)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_sinks_in_model_dtype_get_their_gradient():
    """gpt-oss keeps its sinks in bf16: accepted, converted inside, the gradient in bf16."""
    q, k, v = make_inputs(1, 4, 4, 64, 64, 64, BF16, DEV, seed=2)
    s = _sinks(4, seed=5, dtype=BF16).requires_grad_()
    out, lse = flash_cuda.attention(q, k, v, sinks=s, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    s64 = s.detach().double().requires_grad_()
    ro, rl = attention_naive(q.double(), k.double(), v.double(), sinks=s64)
    (ro.sum() + rl.sum()).backward()
    assert s.grad.dtype == BF16
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=3e-2, atol=3e-2)


def test_sinks_with_dropout():
    """Dropout acts on the keys' probabilities only: lse (which the sink is part of) is that of
    the same call without dropout, and d(sinks) comes out finite."""
    q, k, v = make_inputs(2, 4, 2, 128, 128, 64, BF16, DEV, seed=8)
    s = _sinks(4, seed=6)
    with torch.no_grad():
        _, lse_plain = flash_cuda.attention(q, k, v, sinks=s, return_lse=True)
    sl = s.clone().requires_grad_()
    out, lse = flash_cuda.attention(q, k, v, sinks=sl, return_lse=True, dropout_p=0.3)
    torch.testing.assert_close(lse, lse_plain, rtol=0, atol=1e-4)
    out.float().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(sl.grad).all()


# ---------------------------------------------------------------------------------------
# The warp-specialized Hopper forward alone (attn_check.ws_fwd: the profile shows it ran), GQA-packed and not
# ---------------------------------------------------------------------------------------

_WS_SKIP = hopper_skip_reason("the warp-specialized forward")


@pytest.mark.skipif(_WS_SKIP is not None, reason=str(_WS_SKIP))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("Hq,Hkv,Sq,Sk,D,is_causal", [(8, 2, 48, 300, 64, False), (16, 2, 64, 200, 128, True),
                                                      (4, 4, 300, 300, 128, True), (4, 2, 130, 250, 192, False),
                                                      (2, 1, 200, 129, 256, True)])
def test_sinks_ws_forward_alone(dtype, Hq, Hkv, Sq, Sk, D, is_causal):
    B = 2
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, DEV, seed=D + Hq)
    sinks = _sinks(Hq, seed=Hq)
    scale = 1.0 / math.sqrt(D)
    wr = 0 if is_causal else -1
    out, lse, _ = ws_fwd(q, k, v, scale, -1, wr, 0.0, None, None, None, 0, 0, sinks=sinks)
    ref, ref_lse = attention_naive(q.double(), k.double(), v.double(), is_causal=is_causal, sinks=sinks.double())
    naive, naive_lse = attention_naive(q, k, v, is_causal=is_causal, sinks=sinks.to(dtype))
    finite = torch.isfinite(ref_lse)  # (-inf: rows without a key of the -inf sink's head)
    assert torch.equal(torch.isfinite(lse), finite)
    for name, x, r, n, base, mask in (("out", out, ref, naive, ATOL_BASE[dtype], None),
                                      ("lse", lse, ref_lse, naive_lse, LSE_ATOL_BASE[dtype], finite)):
        _, problem = rule_error(name, x, r, n, base, mask=mask, head_dim=D if name == "out" else 0)
        assert problem is None, f"ws Hq={Hq} Hkv={Hkv} Sq={Sq} D={D}: {problem}"


# ---------------------------------------------------------------------------------------
# fp32 (simt), with the split of its last wave
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("B,Hq,Hkv,Sq,Sk,D,is_causal", [(2, 4, 2, 100, 130, 64, False), (1, 4, 1, 257, 200, 128, True),
                                                       (1, 2, 2, 64, 64, 256, False)])
def test_sinks_fp32(B, Hq, Hkv, Sq, Sk, D, is_causal):
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, F32, DEV, seed=Sq)
    check_attention(q, k, v, is_causal=is_causal, scale=None, sinks=_sinks(Hq, seed=Sq), with_dlse=True,
                    label="sinks fp32")


@pytest.mark.parametrize("kind", ["mixed", "large"])
def test_sinks_fp32_split_last_wave(kind):
    """One and a half waves of 128-row query blocks (as tests/test_attention_gpu.py's
    test_fp32_split_last_wave): the last wave's blocks are cut into key ranges whose merge
    (core/combine.cuh) adds the sink once. A sink added per piece would count it num_splits
    times and fail the lse check."""
    D, Sq, Sk = 128, 300, 1000
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    Hq = -(-(3 * sms // 2 + 3) // -(-Sq // 128))
    q, k, v = make_inputs(1, Hq, 1, Sq, Sk, D, F32, DEV, seed=Sq)
    sinks = _sinks(Hq, kind, seed=9)
    check_attention(q, k, v, is_causal=False, scale=None, sinks=sinks, with_dlse=True, label=f"sinks split {kind}")
    if kind == "large":
        with torch.no_grad():
            out = flash_cuda.attention(q, k, v, sinks=sinks)
        _relative_out_check(out, q, k, v, sinks, "fp32 split large", 1e-4)


# ---------------------------------------------------------------------------------------
# Packed (varlen) batches
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,kernel", [(BF16, "auto"), (F16, "mma"), (F32, "auto")])
def test_sinks_varlen(dtype, kernel):
    """Sequences of different lengths, one with no key (its rows: out 0, lse = sink)."""
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen_inputs((37, 100, 20, 64), (50, 130, 0, 64), 8, 2, 64, dtype,
                                                           DEV, seed=4)
    sinks = _sinks(8, seed=7)
    check_varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, kernel=kernel, sinks=sinks,
                           with_dlse=True, label="sinks varlen")
    with torch.no_grad():
        out, lse = flash_cuda.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True, kernel=kernel,
                                               sinks=sinks, return_lse=True)
    rows = slice(137, 157)  # the third sequence: no key
    assert bool((out[rows] == 0).all())
    torch.testing.assert_close(lse[:, rows], sinks.view(8, 1).expand(8, 20), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------
# The split-KV decode: attention()'s decode-shaped calls and the KV-cache binding
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("Sq,Sk,kind", [(1, 4000, "mixed"), (8, 1500, "large"), (3, 70, "mixed"), (1, 3000, "huge")])
def test_sinks_decode_shaped_attention(dtype, Sq, Sk, kind):
    """Sq <= 16 runs the split-KV decode (several key ranges for long keys, merged with the sink
    once; one range for short ones, normalize_output adding it)."""
    q, k, v = make_inputs(2, 8, 2, Sq, Sk, 128, dtype, DEV, seed=Sk)
    sinks = _sinks(8, kind, seed=Sq)
    check_attention(q, k, v, is_causal=True, scale=None, sinks=sinks, with_dlse=True, label=f"sinks decode {kind}")
    with torch.no_grad():
        out, lse = flash_cuda.attention(q, k, v, is_causal=True, sinks=sinks, return_lse=True)
    if kind == "large":
        _relative_out_check(out, q, k, v, sinks, "decode large", 4 * ATOL_BASE[dtype], is_causal=True)
    if kind == "huge":
        torch.testing.assert_close(lse, sinks.view(1, 8, 1).expand_as(lse), rtol=1e-6, atol=0)


def _kvcache_case(B, Hq, Hkv, D, dtype, lens, s_new, page_size, seed):
    """(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, keys, values): caches
    holding lens[b] tokens (paged when page_size), and the keys each sequence attends after the
    append (its first lens[b] cache rows, then k_new)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=DEV).to(dtype)  # noqa: E731
    capacity = max(lens) + s_new + 32
    capacity = -(-capacity // 64) * 64
    q = rnd(B, Hq, s_new if s_new else 1, D)
    keys = [rnd(Hkv, L, D) for L in lens]
    values = [rnd(Hkv, L, D) for L in lens]
    k_new = rnd(B, Hkv, s_new, D) if s_new else None
    v_new = rnd(B, Hkv, s_new, D) if s_new else None
    # Rows past a sequence's keys hold NaN: a kernel that reads them fails.
    k_cache = torch.full((B, Hkv, capacity, D), float("nan"), dtype=dtype, device=DEV)
    v_cache = k_cache.clone()
    for b, L in enumerate(lens):
        k_cache[b, :, :L] = keys[b]
        v_cache[b, :, :L] = values[b]
    block_table = None
    if page_size is not None:  # the same rows, page by page, at shuffled page ids
        pages = capacity // page_size
        perm = torch.randperm(B * pages, generator=torch.Generator().manual_seed(seed)).to(torch.int32)
        block_table = perm.view(B, pages).to(DEV)
        k_pool = torch.empty(B * pages, Hkv, page_size, D, dtype=dtype, device=DEV)
        v_pool = torch.empty_like(k_pool)
        ids = perm.view(B, pages).long().to(DEV)
        k_pool[ids.flatten()] = k_cache.view(B, Hkv, pages, page_size, D).transpose(1, 2).reshape(-1, Hkv, page_size, D)
        v_pool[ids.flatten()] = v_cache.view(B, Hkv, pages, page_size, D).transpose(1, 2).reshape(-1, Hkv, page_size, D)
        k_cache, v_cache = k_pool, v_pool
    if s_new:
        keys = [torch.cat([keys[b], k_new[b]], dim=1) for b in range(B)]
        values = [torch.cat([values[b], v_new[b]], dim=1) for b in range(B)]
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, k_new, v_new, lens_t, block_table, keys, values


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("num_splits", [1, 4, 0], ids=["splits1", "splits4", "planned"])
@pytest.mark.parametrize("s_new,kind", [(1, "mixed"), (4, "large"), (0, "small")])
@pytest.mark.parametrize("route", ["binding", "public"])
def test_sinks_fwd_kvcache(dtype, paged, num_splits, s_new, kind, route):
    """The binding's fwd_kvcache (positional, sinks after return_lse) and
    flash_cuda.attention_with_kvcache(sinks=...): every sequence against float64 attention over
    its own keys with the same sinks; with num_splits > 1 the key ranges' merge adds the sink once."""
    B, Hq, Hkv, D = 3, 8, 2, 128
    lens = [700, 0, 1300] if s_new else [700, 64, 1300]
    q, k_cache, v_cache, k_new, v_new, lens_t, block_table, keys, values = _kvcache_case(
        B, Hq, Hkv, D, dtype, lens, s_new, 16 if paged else None, seed=s_new + 10 * num_splits)
    sinks = _sinks(Hq, kind, seed=s_new)
    scale = 1.0 / math.sqrt(D)
    if route == "binding":
        out, lse = _ext.require().fwd_kvcache(q, k_cache, v_cache, k_new, v_new, lens_t, 0, block_table, scale, -1,
                                              0, 0.0, None, num_splits, True, sinks)
    else:
        new = k_new is not None and k_new.shape[2] > 0
        out, lse = flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k_new if new else None,
                                                     v_new if new else None, cache_seqlens=lens_t,
                                                     block_table=block_table, is_causal=True, scale=scale,
                                                     num_splits=num_splits, sinks=sinks, return_lse=True)
    for b in range(B):
        kb, vb = keys[b].unsqueeze(0), values[b].unsqueeze(0)
        qb = q[b:b + 1]
        ref, ref_lse = attention_naive(qb.double(), kb.double(), vb.double(), is_causal=True, scale=scale,
                                       sinks=sinks.double())
        naive, naive_lse = attention_naive(qb, kb, vb, is_causal=True, scale=scale, sinks=sinks.to(dtype))
        label = f"kvcache b={b} L={lens[b]} s_new={s_new} paged={paged} splits={num_splits} {kind}"
        for name, x, r, n, base in (("out", out[b:b + 1], ref, naive, ATOL_BASE[dtype]),
                                    ("lse", lse[b:b + 1], ref_lse, naive_lse, LSE_ATOL_BASE[dtype])):
            _, problem = rule_error(name, x, r, n, base, head_dim=D if name == "out" else 0)
            assert problem is None, f"{label}: {problem}"
        if kind == "large" and kb.shape[2] > 0:
            err = float((out[b:b + 1].double() - ref).abs().max())
            assert err <= 4 * ATOL_BASE[dtype] * float(ref.abs().max()), f"{label}: relative out error {err:.3e}"


# ---------------------------------------------------------------------------------------
# The binding's own checks and its answer to calls without keys
# ---------------------------------------------------------------------------------------


def test_binding_checks_the_sinks():
    """What the kernels' memory safety rests on: float32, contiguous, on q's device, Hq values."""
    C = _ext.require()
    q, k, v = make_inputs(1, 4, 2, 20, 30, 64, BF16, DEV, seed=1)
    args = (q, k, v, 0.125, -1, -1, 0.0, None, None, None, 0, 0, 0)
    for bad in (torch.zeros(4, dtype=BF16, device=DEV), torch.zeros(5, device=DEV), torch.zeros(8, device=DEV)[::2],
                torch.zeros(4)):
        with pytest.raises(RuntimeError, match="sinks must be a contiguous float32 tensor"):
            C.fwd(*args, sinks=bad)
    cache = torch.zeros(1, 2, 64, 64, dtype=BF16, device=DEV)
    lens = torch.tensor([10], dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="sinks must be a contiguous float32 tensor"):
        C.fwd_kvcache(q[:, :, :1], cache, cache.clone(), None, None, lens, 0, None, 0.125, -1, 0, 0.0, None, 1, True,
                      torch.zeros(3, device=DEV))
    # keys: none at all (answered without a launch): out 0, lse the sinks
    s = _sinks(4, seed=1)
    out, lse, _ = C.fwd(q, k[:, :, :0], v[:, :, :0], 0.125, -1, -1, 0.0, None, None, None, 0, 0, 0, sinks=s)
    assert bool((out == 0).all()) and torch.equal(lse, s.view(1, 4, 1).expand_as(lse))
