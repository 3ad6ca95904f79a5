"""flash_cuda.attention_with_kvcache as the custom op flash_cuda::fwd_kvcache, on CPU through the
mock extension of conftest.py (the KV-cache reference behind the ``_C.fwd_kvcache`` contract):

* opcheck of the op (schema with the caches declared mutated, fake implementation, dispatch)
  over the dense and paged caches, tensor and int lengths, the prefill routes, lse and ALiBi;
* torch.compile(fullgraph=True) of a decode step (backends "eager" and "aot_eager"): no graph
  break, the output and the caches as an eager call leaves them, the append kept when the
  output is unused or the caches are a module's buffers, int lengths that change, and
  check_inputs raising at run time inside the compiled graph;
* the host path: the checks run once per signature of the arguments, the eager path skips the
  op's dispatch, and a kept signature never lets an argument through that the checks reject.

The GPU counterpart (the kernels, CUDA graphs, mode="reduce-overhead") is
tests/test_kvcache_compile_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import flash_cuda
from flash_cuda import kvcache, kvcache_checks

F16, BF16 = torch.float16, torch.bfloat16
OP = torch.ops.flash_cuda.fwd_kvcache.default


def _case(B=2, Hq=4, Hkv=2, Sq=1, D=32, cap=64, s_new=1, page_size=None, transposed_pool=False,
          dtype=BF16, seed=0):
    """(q, k_cache, v_cache, k, v, block_table): random caches (dense, or a paged pool whose
    pages are dealt out in a shuffled order)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q = rnd(B, Hq, Sq, D)
    k = rnd(B, Hkv, s_new, D) if s_new else None
    v = rnd(B, Hkv, s_new, D) if s_new else None
    if page_size is None:
        return q, rnd(B, Hkv, cap, D), rnd(B, Hkv, cap, D), k, v, None
    pages = cap // page_size
    num_pages = B * pages + 2
    if transposed_pool:
        kc, vc = rnd(num_pages, page_size, Hkv, D).transpose(1, 2), rnd(num_pages, page_size, Hkv, D).transpose(1, 2)
    else:
        kc, vc = rnd(num_pages, Hkv, page_size, D), rnd(num_pages, Hkv, page_size, D)
    table = torch.randperm(num_pages, generator=g)[:B * pages].view(B, pages).to(torch.int32)
    return q, kc, vc, k, v, table


def _op_args(q, kc, vc, k, v, table, lens, *, is_causal=True, return_lse=False, alibi=None, num_splits=0,
             check_inputs=False):
    """The op's arguments for these inputs, as attention_with_kvcache passes them."""
    tensor_lens = isinstance(lens, torch.Tensor)
    return (q, kc, vc, k, v, lens if tensor_lens else None, 0 if tensor_lens else lens, table,
            1.0 / math.sqrt(q.shape[-1]), -1, 0 if is_causal else -1, 0.0, alibi, num_splits, return_lse,
            check_inputs)


# (Sq, s_new, page_size, transposed_pool, lens): decode, speculative decode, no new keys, paged
# (also a (pages, page_size, Hkv, D) pool seen transposed), the prefill routes of a dense cache
# with an int length (an empty cache, and one that holds keys already), and the gathered prefill
# route (tensor lengths; pages).
CASES = {
    "decode-tensor-lens": (1, 1, None, False, [5, 30]),
    "decode-int-len": (1, 1, None, False, 17),
    "spec-no-new-keys": (3, 0, None, False, [40, 3]),
    "paged": (2, 2, 16, False, [33, 0]),
    "paged-transposed-pool": (1, 1, 16, True, [20, 47]),
    "prefill-empty": (20, 20, None, False, 0),
    "prefill-cached": (20, 20, None, False, 9),
    "prefill-tensor-lens": (20, 20, None, False, [9, 0]),
    "prefill-paged-transposed-pool": (20, 20, 16, True, [30, 3]),
}


def _lens(lens):
    return torch.tensor(lens, dtype=torch.int32) if isinstance(lens, list) else lens


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("return_lse", [False, True])
def test_opcheck_cpu_mock(mock_kvcache, name, return_lse):
    Sq, s_new, page_size, transposed, lens = CASES[name]
    q, kc, vc, k, v, table = _case(Sq=Sq, s_new=s_new, page_size=page_size, transposed_pool=transposed,
                                   seed=Sq + s_new)
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if name.startswith("paged") else None
    torch.library.opcheck(OP, _op_args(q, kc, vc, k, v, table, _lens(lens), return_lse=return_lse, alibi=alibi))
    out, lse = OP(*_op_args(q, kc, vc, k, v, table, _lens(lens), return_lse=return_lse, alibi=alibi))
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == torch.empty_like(q).stride()
    assert lse.dtype == torch.float32 and lse.shape == (tuple(q.shape[:3]) if return_lse else (0,))


def _step(q, kc, vc, k, v, lens, table, return_lse):
    return flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, is_causal=True,
                                             return_lse=return_lse)


def _clones(*ts):
    return tuple(None if t is None else t.clone() for t in ts)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_matches_eager_cpu_mock(mock_kvcache, name, backend):
    """fullgraph=True traces the whole step (any graph break raises); the compiled step returns
    what the eager one does and leaves the caches as the eager one does, appended."""
    Sq, s_new, page_size, transposed, lens = CASES[name]
    q, kc, vc, k, v, table = _case(Sq=Sq, s_new=s_new, page_size=page_size, transposed_pool=transposed,
                                   seed=len(name))
    lens = _lens(lens)
    before = _clones(kc, vc)
    ek, ev = _clones(kc, vc)
    expect = _step(q, ek, ev, k, v, lens, table, True)
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend=backend)
    got = compiled(q, kc, vc, k, v, lens, table, True)
    for a, b in zip(got, expect):
        assert torch.equal(a, b)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)
    assert (not s_new) or not (torch.equal(kc, before[0]) or torch.equal(vc, before[1])), "no append"
    out = compiled(q, kc, vc, k, v, lens, table, False)  # the second structure: out alone
    assert torch.equal(out, expect[0])


def test_no_graph_break_cpu_mock(mock_kvcache):
    lens = torch.tensor([3, 50], dtype=torch.int32)
    for page_size in (None, 16):
        q, kc, vc, k, v, table = _case(page_size=page_size)
        explanation = torch._dynamo.explain(_step)(q, kc, vc, k, v, lens, table, False)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_append_kept_when_output_unused_cpu_mock(mock_kvcache, backend):
    """The op mutates its inputs: it stays in the graph (no dead-code elimination, no dropped
    write-back after functionalization) even when nothing reads its output."""
    q, kc, vc, k, v, _ = _case()
    lens = torch.tensor([7, 60], dtype=torch.int32)
    ek, ev = _clones(kc, vc)
    flash_cuda.attention_with_kvcache(q, ek, ev, k, v, cache_seqlens=lens)

    def append_only(q, kc, vc, k, v, lens):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens)

    torch._dynamo.reset()
    torch.compile(append_only, fullgraph=True, backend=backend)(q, kc, vc, k, v, lens)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


class _StaticCacheAttention(torch.nn.Module):
    """A decode step against caches held as buffers, as transformers' static cache holds them."""

    def __init__(self, B, Hkv, cap, D, dtype):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(B, Hkv, cap, D, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(B, Hkv, cap, D, dtype=dtype))

    def forward(self, q, k, v, cache_seqlens):
        return flash_cuda.attention_with_kvcache(q, self.k_cache, self.v_cache, k, v, cache_seqlens=cache_seqlens,
                                                 is_causal=True)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_decode_loop_on_buffers_cpu_mock(mock_kvcache, backend):
    """A compiled module appends to its buffers step after step, with a tensor length advanced
    in place and with an int length that changes every step."""
    torch.manual_seed(0)
    B, Hq, Hkv, cap, D = 2, 4, 2, 32, 16
    for int_len in (False, True):
        eager_m = _StaticCacheAttention(B, Hkv, cap, D, BF16)
        comp_m = _StaticCacheAttention(B, Hkv, cap, D, BF16)
        torch._dynamo.reset()
        compiled = torch.compile(comp_m, fullgraph=True, backend=backend)
        lens_e = torch.zeros(B, dtype=torch.int32)
        lens_c = lens_e.clone()
        for step in range(5):
            q = torch.randn(B, Hq, 1, D, dtype=BF16)
            k, v = torch.randn(B, Hkv, 1, D, dtype=BF16), torch.randn(B, Hkv, 1, D, dtype=BF16)
            want = eager_m(q, k, v, step if int_len else lens_e)
            got = compiled(q, k, v, step if int_len else lens_c)
            assert torch.equal(got, want), f"step {step}"
            lens_e.add_(1)
            lens_c.add_(1)
        assert torch.equal(comp_m.k_cache, eager_m.k_cache) and torch.equal(comp_m.v_cache, eager_m.v_cache)
        assert not bool((comp_m.k_cache[:, :, :5] == 0).all()) and bool((comp_m.k_cache[:, :, 5:] == 0).all())


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_check_inputs_cpu_mock(mock_kvcache, backend):
    """check_inputs reads the lengths when the compiled step runs, not when it is traced."""
    q, kc, vc, k, v, _ = _case(cap=64)

    def step(q, kc, vc, k, v, lens):
        return flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, check_inputs=True)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    compiled(q, kc, vc, k, v, torch.tensor([3, 63], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 64: with 1 new tokens"):
        compiled(q, kc, vc, k, v, torch.tensor([3, 64], dtype=torch.int32))


def test_compiled_alignment_checked_when_run_cpu_mock(mock_kvcache):
    """Traced tensors have no address: the op checks the caches' alignment when it runs."""
    q, kc, vc, k, v, _ = _case(D=32, cap=64)
    flat = torch.zeros(kc.numel() + 4, dtype=BF16)
    shifted = flat[4:].view(kc.shape)  # 8 bytes past a 16-byte boundary, the same strides
    assert shifted.data_ptr() % 16 == 8

    def step(q, kc, vc, k, v):
        return flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3)

    torch._dynamo.reset()
    with pytest.raises(ValueError, match="16-byte aligned"):
        torch.compile(step, fullgraph=True, backend="eager")(q, shifted, vc, k, v)


def test_compiled_rejects_bad_input_cpu_mock(mock_kvcache):
    q, kc, vc, k, v, _ = _case()
    torch._dynamo.reset()
    compiled = torch.compile(_step, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="cache_seqlens must be an int or an int32 tensor, got int64"):
        compiled(q, kc, vc, k, v, torch.zeros(2, dtype=torch.int64), None, False)


# ---- the host path ----


def test_checks_run_once_per_signature_cpu_mock(mock_kvcache, monkeypatch):
    calls = []
    validate = kvcache_checks.validate

    def counting(*args):
        calls.append(1)
        return validate(*args)

    monkeypatch.setattr(kvcache_checks, "validate", counting)

    def no_op(*args):
        raise AssertionError("a plain eager call went through the op's dispatch")

    monkeypatch.setattr(kvcache, "fwd_kvcache", no_op)
    q, kc, vc, k, v, table = _case(page_size=16)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    for i in range(4):  # new q / k / v tensors of the same signature, a length that moves
        flash_cuda.attention_with_kvcache(q.clone(), kc, vc, k.clone(), v.clone(), cache_seqlens=lens + i,
                                          block_table=table, is_causal=True)
    assert len(calls) == 1
    flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, is_causal=True,
                                      return_lse=True)
    flash_cuda.attention_with_kvcache(q[:1], kc, vc, k[:1], v[:1], cache_seqlens=lens[:1], block_table=table[:1],
                                      is_causal=True)
    for n in (0, 9, 10):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=n, block_table=table, is_causal=True)
    assert len(calls) == 4
    assert mock_kvcache.kvcache_calls == 9


def test_kept_signature_rejects_what_the_checks_reject_cpu_mock(mock_kvcache):
    """After a call passed, calls that differ from it only where the checks would reject them
    still raise the checks' errors."""
    q, kc, vc, k, v, _ = _case(cap=64, D=32)
    lens = torch.tensor([3, 5], dtype=torch.int32)

    def call(q=q, kc=kc, vc=vc, k=k, v=v, **kw):
        kw.setdefault("cache_seqlens", 3)
        return flash_cuda.attention_with_kvcache(q, kc, vc, k, v, **kw)

    call()
    call(cache_seqlens=lens)
    call(cache_seqlens=lens, is_causal=True, window_size=(4, 0), softcap=2.0, scale=0.5, num_splits=2)
    with pytest.raises(ValueError, match="needs 65 positions"):
        call(cache_seqlens=64)
    with pytest.raises(ValueError, match=">= 0"):
        call(cache_seqlens=-1)
    with pytest.raises(TypeError, match="an int or an int32 tensor"):
        call(cache_seqlens=True)
    with pytest.raises(TypeError, match="int32 tensor, got int64"):
        call(cache_seqlens=lens.long())
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        call(cache_seqlens=lens, is_causal=1)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        call(cache_seqlens=lens, return_lse=0)
    with pytest.raises(ValueError, match="num_splits"):
        call(cache_seqlens=lens, num_splits=2.0)
    with pytest.raises(ValueError, match="scale must be a finite"):
        call(cache_seqlens=lens, scale=math.nan)
    with pytest.raises(ValueError, match="softcap must be a finite"):
        call(cache_seqlens=lens, is_causal=True, window_size=(4, 0), softcap=-2.0, scale=0.5, num_splits=2)
    with pytest.raises(ValueError, match="window_size right"):
        call(cache_seqlens=lens, is_causal=True, window_size=(4, 2))
    with pytest.raises(TypeError, match="k_cache must have q's dtype"):
        call(kc=kc.half())
    flat = torch.zeros(kc.numel() + 4, dtype=BF16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        call(kc=flat[4:].view(kc.shape))  # the same shape and strides, 8 bytes off
    with pytest.raises(ValueError, match="both have shape"):
        call(k=k[:, :1], v=v[:, :1])
    with pytest.raises(TypeError, match="softcap must be a finite real number >= 0 .*, got list"):
        call(cache_seqlens=lens, softcap=[2.0])  # unhashable: the checks, not a failed lookup
    # options of other accepted types pass the checks on every call, with the same result
    want = call(cache_seqlens=lens, is_causal=True, window_size=(4, 0))
    assert torch.equal(call(cache_seqlens=lens, is_causal=True, window_size=[4, 0]), want)
    call()  # and the signature that passed still passes


def test_kept_signature_not_used_for_cuda_check(monkeypatch):
    """Without the lifted device check a CPU call raises, whatever calls came before."""
    monkeypatch.setattr(kvcache_checks, "plans", {})
    q, kc, vc, k, v, _ = _case()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="must be CUDA tensors"):
            flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3)
    assert not kvcache_checks.plans


def test_plans_are_bounded_cpu_mock(mock_kvcache, monkeypatch):
    monkeypatch.setattr(kvcache_checks, "_MAX_PLANS", 4)
    q, kc, vc, k, v, _ = _case(Sq=10, cap=64)
    for sq in range(1, 11):  # ten signatures
        flash_cuda.attention_with_kvcache(q[:, :, :sq], kc, vc, cache_seqlens=5)
        assert 0 < len(kvcache_checks.plans) <= 4


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("int_lens", [False, True])
def test_repeated_call_takes_the_fast_path_cpu_mock(mock_kvcache, monkeypatch, paged, int_lens):
    """From the second call of a signature on, attention_with_kvcache's own lookup answers (its key
    is kvcache_checks._signature's, built in flash_cuda.kvcache): plan_call, the general path's, is
    not called again; the outputs and the caches written are the general path's."""
    calls = []
    real = kvcache.plan_call
    monkeypatch.setattr(kvcache, "plan_call", lambda *args: calls.append(1) or real(*args))
    q, kc, vc, k, v, table = _case(page_size=16 if paged else None)
    lens = 5 if int_lens else torch.tensor([3, 5], dtype=torch.int32)
    options = dict(cache_seqlens=lens, block_table=table, is_causal=True, return_lse=True)
    results = []
    for _ in range(3):
        kc1, vc1 = kc.clone(), vc.clone()
        out, lse = flash_cuda.attention_with_kvcache(q, kc1, vc1, k, v, **options)
        results.append((out, lse, kc1, vc1))
    assert len(calls) == 1
    for first, again in zip(results[0], results[2]):
        assert torch.equal(first, again)
    assert not torch.equal(results[0][2], kc)  # the append happened
    with pytest.raises(ValueError, match="needs 65 positions" if not paged else "cache_seqlens = 64"):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, **{**options, "cache_seqlens": 64})
    if int_lens:
        assert len(calls) == 2  # an int length that does not fit: the general path's check raises


def test_env_check_applies_to_known_signatures_cpu_mock(mock_kvcache, monkeypatch):
    """FLASH_CUDA_CHECK_KVCACHE, read on every call, turns the value checks on for a signature the
    fast path knows (and off again)."""
    from flash_cuda import kvcache_ops

    checked = []
    real = kvcache_ops.check_values
    monkeypatch.setattr(kvcache_ops, "check_values", lambda *args: checked.append(1) or real(*args))
    q, kc, vc, k, v, _ = _case(cap=8)
    good, bad = torch.tensor([3, 7], dtype=torch.int32), torch.tensor([3, 8], dtype=torch.int32)
    for _ in range(2):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=good)
    assert not checked
    monkeypatch.setenv(kvcache_checks.ENV_CHECK, "1")
    flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=good)
    assert len(checked) == 1
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 8"):
        flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=bad)
    monkeypatch.setenv(kvcache_checks.ENV_CHECK, "0")
    flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=good)
    monkeypatch.delenv(kvcache_checks.ENV_CHECK)
    flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=good)
    assert len(checked) == 2
