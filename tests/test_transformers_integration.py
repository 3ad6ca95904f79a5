"""flash_cuda.integrations.transformers without a GPU: registration, the mask hook, the unpad
and packing plans, and whole tiny models (Llama, Mistral, Qwen2, Gemma-2 style) run through
flash_cuda's Python layer on CPU (the ``mock_extension`` fixture stands in for the kernels with
flash_cuda.reference), against transformers' eager attention in float32."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import hf_models
from hf_models import fc_hf, transformers

FAMILIES = list(hf_models.FAMILIES)


@pytest.fixture
def sinks(mock_extension, monkeypatch):
    """flash_cuda on CPU (the mock extension) and, for calls with attention sinks, the stand-in
    of hf_models.SinksStandIn."""
    return hf_models.SinksStandIn(monkeypatch)


def close(a, b, tol=2e-4):
    err = (a.float() - b.float()).abs().max().item()
    scale = b.float().abs().max().item()
    assert err <= tol * max(scale, 1.0), f"max abs error {err:.3g} (reference max {scale:.3g})"


def test_registered_under_a_name_without_flash():
    from transformers import AttentionInterface, AttentionMaskInterface

    name = fc_hf.ATTN_IMPLEMENTATION
    assert "flash" not in name.lower()
    assert AttentionInterface._global_mapping[name] is fc_hf.attention_forward
    assert AttentionMaskInterface._global_mapping[name] is fc_hf.padding_mask
    assert fc_hf.register() == name


def test_padding_mask_hook():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    out = fc_hf.padding_mask(2, 4, 4, attention_mask=mask)
    assert out.dtype == torch.bool and torch.equal(out, mask.bool())
    assert fc_hf.padding_mask(2, 4, 4, attention_mask=torch.ones(2, 4)) is None
    assert fc_hf.padding_mask(2, 4, 4, attention_mask=None) is None
    # A sliding-window cache holds the last kv_length keys: the mask is cut from the right.
    assert fc_hf.padding_mask(2, 1, 3, attention_mask=mask) is None  # the last 3 columns are all ones
    holes = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    assert fc_hf.padding_mask(2, 1, 3, attention_mask=holes).tolist() == [[False, True, True], [True, True, True]]
    # A static cache longer than the mask keeps the mask (it marks the written rows).
    assert torch.equal(fc_hf.padding_mask(2, 1, 6, attention_mask=torch.ones(2, 4)), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="custom pattern"):
        fc_hf.padding_mask(2, 4, 4, attention_mask=mask, use_vmap=True)


def test_unpad_plan_prefill_decode_and_chunk():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    iq, cq, mq, ik, ck, mk = fc_hf._unpad_plan(mask, 5)
    assert ck.tolist() == [0, 3, 8, 9] and mk == 5 and ck.dtype == torch.int32
    assert ik.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 14] and iq is ik and mq == mk
    iq, cq, mq, *_ = fc_hf._unpad_plan(mask, 1)  # one new token per row, the last position
    assert cq.tolist() == [0, 1, 2, 3] and mq == 1 and iq.tolist() == [0, 1, 2]
    iq, cq, mq, *_ = fc_hf._unpad_plan(mask, 2)  # two new tokens per row: the last two positions
    assert cq.tolist() == [0, 2, 4, 5] and mq == 2 and iq.tolist() == [0, 1, 2, 3, 5]


def test_packed_plan_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    cu, longest = fc_hf._packed_plan(pos)
    assert cu.tolist() == [0, 3, 5, 9] and cu.dtype == torch.int32 and longest == 4
    assert fc_hf._packed_plan(torch.arange(7)[None]) is None
    assert fc_hf._packed_plan(torch.arange(5, 12)[None]) is None  # a chunk after a cache: one sequence


def test_window_follows_transformers_definition():
    assert fc_hf._window(None, True) == (-1, -1)
    assert fc_hf._window(8, True) == (7, 0)
    assert fc_hf._window(8, False) == (7, 7)


class _Module(torch.nn.Module):
    is_causal = True


def test_unsupported_requests_raise_before_any_launch():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="2-D padding mask"):
        fc_hf.attention_forward(_Module(), q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="head dim"):
        fc_hf.attention_forward(_Module(), q, q, q[..., :8], None)


def test_module_dropout_reaches_the_kernels(mock_extension):
    """A module in training passes its attention_dropout: the call draws with it (the mask the
    stand-in recorded reproduces the output through the reference)."""
    from flash_cuda import reference as R
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 24, 16, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 24, 16, generator=g).to(torch.bfloat16) for _ in range(2))
    out, _ = fc_hf.attention_forward(_Module(), q, k, v, None, dropout=0.2, scaling=0.25)
    seed, offset = (int(x) for x in mock_extension.last_rng.tolist())
    mask = R.dropout_keep_mask(2, 4, 24, 24, 0.2, seed=seed, offset=offset)
    ref, _ = R.attention_naive(q.double(), k.double(), v.double(), scale=0.25, is_causal=True, dropout_p=0.2,
                               dropout_mask=mask)
    assert torch.allclose(out.transpose(1, 2).double(), ref, atol=3e-2)
    plain, _ = fc_hf.attention_forward(_Module(), q, k, v, None, dropout=0.0, scaling=0.25)
    assert not torch.allclose(out, plain, atol=3e-2)


def test_cache_of_plans_follows_the_mask_object(mock_extension):
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    a = fc_hf._UNPAD.get(mask, 3, lambda: fc_hf._unpad_plan(mask, 3))
    assert fc_hf._UNPAD.get(mask, 3, lambda: pytest.fail("recomputed")) is a
    mask[0, 0] = True  # an in-place change bumps the version: recomputed
    b = fc_hf._UNPAD.get(mask, 3, lambda: fc_hf._unpad_plan(mask, 3))
    assert b[4].tolist() == [0, 3, 6]


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_batch_loss_and_gradients(mock_extension, sinks, family):
    eager, ours = hf_models.build(family, torch.float32, "cpu")
    ids = torch.randint(1, hf_models.VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    le, xe, ge = hf_models.loss_and_grads(eager, input_ids=ids, labels=ids)
    calls = mock_extension.fwd_calls
    lo, xo, go = hf_models.loss_and_grads(ours, input_ids=ids, labels=ids)
    layers = ours.config.num_hidden_layers
    assert mock_extension.fwd_calls - calls + sinks.reference_calls == layers
    assert sinks.sink_calls == (layers if family in hf_models.SINK_FAMILIES else 0)
    if not sinks.reference_calls:
        assert mock_extension.bwd_calls == layers
    close(lo, le)
    close(xo, xe)
    assert ge.keys() == go.keys()
    for name in ge:
        close(go[name], ge[name], tol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_runs_packed(mock_extension, sinks, family):
    eager, ours = hf_models.build(family, torch.float32, "cpu")
    ids, mask, labels = hf_models.left_padded_batch([24, 13, 5], 24, "cpu")
    le, xe, ge = hf_models.loss_and_grads(eager, input_ids=ids, attention_mask=mask, labels=labels)
    lo, xo, go = hf_models.loss_and_grads(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert sinks.last_call == "varlen"
    close(lo, le)
    keep = mask.bool()
    close(xo[keep], xe[keep])
    for name in ge:
        close(go[name], ge[name], tol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens"])
def test_padding_free_packed_batch(mock_extension, sinks, family, how):
    eager, ours = hf_models.build(family, torch.float32, "cpu")
    lengths = [11, 4, 17]
    ids, pos, labels, cu = hf_models.packed_batch(lengths, "cpu")
    # The reference: each sequence alone through the eager model.
    starts = cu.tolist()
    ref = torch.cat([eager(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(starts, starts[1:])], 1)
    extra = {}
    if how == "cu_seq_lens":
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    if family in hf_models.EAGER_IGNORES_PACKING:
        le, xe, ge = hf_models.per_sequence_loss_and_grads(eager, ids, labels, cu)
    else:
        le, xe, ge = hf_models.loss_and_grads(eager, input_ids=ids, position_ids=pos, labels=labels)
    lo, xo, go = hf_models.loss_and_grads(ours, input_ids=ids, position_ids=pos, labels=labels, **extra)
    assert sinks.last_call == "varlen"
    close(xo, ref)
    close(lo, le)
    for name in ge:
        close(go[name], ge[name], tol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_the_default_cache(mock_extension, sinks, family):
    eager, ours = hf_models.build(family, torch.float32, "cpu")
    ids, mask, _ = hf_models.left_padded_batch([12, 7], 12, "cpu", seed=4)
    steps = 6
    with torch.no_grad():
        seq_e, logits_e = hf_models.greedy_steps(eager, ids, mask, steps)
        seq_o, logits_o = hf_models.greedy_steps(ours, ids, mask, steps)
    if family in ("llama", "gemma2"):  # the last layer attends to the whole padded cache: unpadded
        assert mock_extension.last_fwd_args["varlen"]
    close(logits_o, logits_e)
    assert torch.equal(seq_o, seq_e)


def test_greedy_generate_unpadded_decodes_densely(mock_extension):
    eager, ours = hf_models.build("llama", torch.float32, "cpu")
    ids = torch.randint(1, hf_models.VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        seq_e, logits_e = hf_models.greedy_steps(eager, ids, mask, 5)
        seq_o, logits_o = hf_models.greedy_steps(ours, ids, mask, 5)
    assert not mock_extension.last_fwd_args["varlen"]
    close(logits_o, logits_e)
    assert torch.equal(seq_o, seq_e)


def test_from_pretrained_with_the_name(mock_extension, tmp_path):
    eager, _ = hf_models.build("llama", torch.float32, "cpu")
    eager.save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=fc_hf.ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == fc_hf.ATTN_IMPLEMENTATION
    ids = torch.randint(1, hf_models.VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        close(model(input_ids=ids).logits, eager(input_ids=ids).logits)


# ---------------------------------------------------------------------------------------
# Attention sinks (gpt-oss's s_aux)
# ---------------------------------------------------------------------------------------


def test_sinks_reach_flash_cuda_on_every_path(sinks):
    """s_aux goes to flash_cuda as sinks, unchanged, dense, padded and packed alike; the result
    is the reference's attention with those sinks."""
    from flash_cuda import reference as R
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 10, 16, generator=g)
    k, v = (torch.randn(2, 2, 10, 16, generator=g) for _ in range(2))
    s_aux = torch.randn(4, generator=g)
    out, _ = fc_hf.attention_forward(_Module(), q, k, v, None, scaling=0.3, s_aux=s_aux)
    assert sinks.last_sinks is s_aux and sinks.last_call == "attention"
    ref, _ = R.attention_naive(q.double(), k.double(), v.double(), scale=0.3, is_causal=True, sinks=s_aux.double())
    close(out.transpose(1, 2), ref)
    plain, _ = fc_hf.attention_forward(_Module(), q, k, v, None, scaling=0.3)
    assert not torch.allclose(out, plain, atol=1e-3)

    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 10], dtype=torch.bool)
    out, _ = fc_hf.attention_forward(_Module(), q, k, v, mask, scaling=0.3, s_aux=s_aux)
    assert sinks.last_sinks is s_aux and sinks.last_call == "varlen"
    short, _ = R.attention_naive(q[:1, :, 3:].double(), k[:1, :, 3:].double(), v[:1, :, 3:].double(), scale=0.3,
                                 is_causal=True, sinks=s_aux.double())
    close(out[0, 3:].transpose(0, 1), short[0])
    assert not out[0, :3].any()

    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2]])
    out, _ = fc_hf.attention_forward(_Module(), q[:1], k[:1], v[:1], None, scaling=0.3, s_aux=s_aux, position_ids=pos)
    assert sinks.last_sinks is s_aux and sinks.last_call == "varlen"
    first, _ = R.attention_naive(q[:1, :, :4].double(), k[:1, :, :4].double(), v[:1, :, :4].double(), scale=0.3,
                                 is_causal=True, sinks=s_aux.double())
    close(out[0, :4].transpose(0, 1), first[0])


def test_gpt_oss_sinks_get_gradients(sinks):
    """Every layer's sinks get a gradient through flash_cuda, that of eager attention."""
    eager, ours = hf_models.build("gpt_oss", torch.float32, "cpu")
    ids = torch.randint(1, hf_models.VOCAB, (2, 20), generator=torch.Generator().manual_seed(9))
    _, _, ge = hf_models.loss_and_grads(eager, input_ids=ids, labels=ids)
    _, _, go = hf_models.loss_and_grads(ours, input_ids=ids, labels=ids)
    names = [n for n in ge if n.endswith("sinks")]
    assert len(names) == ours.config.num_hidden_layers
    for name in names:
        assert go[name].abs().max() > 0
        close(go[name], ge[name], tol=1e-3)


# ---------------------------------------------------------------------------------------
# Static cache and torch.compile
# ---------------------------------------------------------------------------------------


def _attention_inputs(batch, q_len, kv_len, seed, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, q_len, 16, generator=g)
    k, v = (torch.randn(batch, 2, kv_len, 16, generator=g) for _ in range(2))
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("case", ["prefill", "holes", "static_decode", "static_chunk", "sliding"])
def test_static_shapes_padded_path_matches_the_unpadded_one(sinks, case, with_sinks):
    """The padded path that torch.compile runs (no data-dependent shapes) gives the eager
    path's outputs and gradients: left padding, holes, a static cache longer than the mask."""
    masks = {
        "prefill": ([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8, [0] * 7 + [1]], 8, 8),
        "holes": ([[1, 0, 1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1], [1] * 8], 8, 8),
        "static_decode": ([[0, 0, 1, 1, 1, 1], [1] * 6, [0] * 5 + [1]], 1, 11),
        "static_chunk": ([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 1, 0, 1, 1, 1]], 3, 11),
        "sliding": ([[0, 1, 1, 1, 1, 1], [1] * 6, [0] * 3 + [1] * 3], 2, 6),
    }
    rows, q_len, kv_len = masks[case]
    mask = torch.tensor(rows, dtype=torch.bool)
    q, k, v = _attention_inputs(3, q_len, kv_len, seed=10, requires_grad=True)
    window = 3 if case == "sliding" else None
    s_aux = torch.randn(4).requires_grad_() if with_sinks else None
    opts = fc_hf._options(True, 0.25, window, None, 0.0, s_aux)
    leaves = [q, k, v] + ([s_aux] if with_sinks else [])
    results = []
    for path in (fc_hf._padded, fc_hf._padded_static_shapes):
        out = path(q.transpose(1, 2), k, v, mask, opts)
        (grads) = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), leaves)
        results.append((out.detach(), grads))
    (out_a, grads_a), (out_b, grads_b) = results
    close(out_b, out_a, tol=1e-5)
    for ga, gb in zip(grads_a, grads_b):
        close(gb, ga, tol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_with_a_static_cache(sinks, family):
    """generate() with cache_implementation="static" (not compiled on CPU): the padded path over
    the static cache's written rows gives eager attention's logits."""
    eager, ours = hf_models.build(family, torch.float32, "cpu")
    ids, mask, _ = hf_models.left_padded_batch([12, 7], 12, "cpu", seed=4)
    steps = 6
    with torch.no_grad():
        seq_e, logits_e = hf_models.greedy_steps(eager, ids, mask, steps)
        seq_o, logits_o = hf_models.greedy_steps(ours, ids, mask, steps, cache_implementation="static")
    close(logits_o, logits_e)
    assert torch.equal(seq_o, seq_e)


def trace_static_shapes_path(monkeypatch):
    """A list that gets an entry each time the compile-time padded path runs (is traced)."""
    calls, path = [], fc_hf._padded_static_shapes

    def counting(*args):
        calls.append(1)
        return path(*args)

    monkeypatch.setattr(fc_hf, "_padded_static_shapes", counting)
    return calls


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_compiled_decode_over_a_static_cache_is_one_graph(sinks, monkeypatch, family):
    """A decode step over transformers' StaticCache compiles with fullgraph=True (no graph
    break in the integration, the mask hook included; the custom ops traced with fake tensors)
    and gives eager attention's logits."""
    eager, ours = hf_models.build(family, torch.float32, "cpu")
    ids, mask, _ = hf_models.left_padded_batch([12, 7], 12, "cpu", seed=4)
    steps = 4
    with torch.no_grad():
        _, logits_e = hf_models.greedy_steps(eager, ids, mask, steps)
        torch._dynamo.reset()
        traced = trace_static_shapes_path(monkeypatch)
        counter = CompileCounterWithBackend("aot_eager")
        step = torch.compile(ours.forward, fullgraph=True, backend=counter)
        cache = transformers.StaticCache(config=ours.config, max_cache_len=24)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = ours(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for i in range(steps - 1):
            token = logits[-1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            pos = pos[:, -1:] + 1
            out = step(input_ids=token, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    close(torch.stack(logits, 1), logits_e)
    assert counter.frame_count >= 1 and traced
    if family in hf_models.SINK_FAMILIES:
        assert sinks.sink_calls > 0


# ---------------------------------------------------------------------------------------
# Continuous batching ("paged|fcuda")
# ---------------------------------------------------------------------------------------


def test_paged_name_is_registered():
    from transformers import AttentionInterface

    assert fc_hf.PAGED_ATTN_IMPLEMENTATION == "paged|" + fc_hf.ATTN_IMPLEMENTATION
    assert AttentionInterface._global_mapping[fc_hf.PAGED_ATTN_IMPLEMENTATION] is fc_hf.paged_attention_forward
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="continuous batching"):
        fc_hf.paged_attention_forward(_Module(), q, q, q, None)


def continuous_batching(model, prompts, new_tokens, monkeypatch):
    """Greedy generate_batch() on CPU: the tokens generated for each prompt, in order."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching import cache as cb_cache

    # Without psutil transformers sees no CPU memory for the paged cache: give it 8 GiB.
    monkeypatch.setattr(cb_cache, "get_device_and_memory_breakdown",
                        lambda: (torch.device("cpu"), 8 << 30, 0, 0))
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # Pages of 16 tokens: the longer prompts span several.
    cb_config = ContinuousBatchingConfig(block_size=16, num_blocks=32, max_batch_tokens=64)
    out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb_config,
                               progress_bar=False)
    return [out[key].generated_tokens for key in sorted(out, key=lambda r: int(r.split("_")[-1]))]


@hf_models.needs_continuous_batching
@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_gives_the_tokens_of_paged_sdpa(sinks, mock_extension, monkeypatch, family):
    """generate_batch() with "paged|fcuda" (packed prefill and decode over transformers' paged
    cache through varlen_attention) generates the tokens of "paged|sdpa" ("paged|eager" for
    gpt-oss, which has no SDPA path), prompts longer than the sliding windows included."""
    eager, ours = hf_models.build(family, torch.float32, "cpu")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, hf_models.VOCAB, (n,), generator=g).tolist() for n in (5, 21, 3, 12)]
    eager.set_attn_implementation("paged|eager" if family in hf_models.SINK_FAMILIES else "paged|sdpa")
    ours.set_attn_implementation(fc_hf.PAGED_ATTN_IMPLEMENTATION)
    with torch.no_grad():
        expected = continuous_batching(eager, prompts, 8, monkeypatch)
        calls = mock_extension.fwd_calls + sinks.reference_calls
        got = continuous_batching(ours, prompts, 8, monkeypatch)
    assert mock_extension.fwd_calls + sinks.reference_calls > calls and sinks.last_call == "varlen"
    assert [len(t) for t in got] == [8] * len(prompts)
    assert got == expected


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_generate_compiles_its_static_cache_decode_steps(sinks, monkeypatch, family):
    """generate(cache_implementation="static") with a fullgraph compile config (transformers
    compiles the decode steps on CUDA by itself; here it is told to on CPU): the tokens and
    logits of eager attention."""
    from transformers import CompileConfig

    eager, ours = hf_models.build(family, torch.float32, "cpu")
    ids, mask, _ = hf_models.left_padded_batch([12, 7], 12, "cpu", seed=4)
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True
    traced = trace_static_shapes_path(monkeypatch)
    torch._dynamo.reset()
    with torch.no_grad():
        seq_e, logits_e = hf_models.greedy_steps(eager, ids, mask, 5)
        seq_o, logits_o = hf_models.greedy_steps(ours, ids, mask, 5, cache_implementation="static",
                                                 compile_config=config)
    assert hasattr(ours, "_compiled_call") and traced
    close(logits_o, logits_e)
    assert torch.equal(seq_o, seq_e)


@pytest.mark.skipif(fc_hf.CONTINUOUS_BATCHING, reason="this transformers runs continuous batching through flash_cuda")
def test_continuous_batching_is_refused_by_transformers_from_5_23(mock_extension, monkeypatch):
    """transformers >= 5.23 refuses "paged|fcuda" in generate_batch (fc_hf.CONTINUOUS_BATCHING's
    documented limitation) with its own ValueError, before any token is generated."""
    _, ours = hf_models.build("llama", torch.float32, "cpu")
    ours.set_attn_implementation(fc_hf.PAGED_ATTN_IMPLEMENTATION)
    with torch.no_grad(), pytest.raises(ValueError, match="not supported for continuous batching"):
        continuous_batching(ours, [[1, 2, 3]], 2, monkeypatch)


@hf_models.needs_continuous_batching
def test_generate_batch_switches_the_model_to_the_paged_name(sinks, mock_extension, monkeypatch):
    """A model loaded with "fcuda" runs continuous batching as "paged|fcuda" (without a
    FlashAttention package installed, which transformers would prefer) and gets "fcuda" back."""
    import transformers.generation.continuous_batching.continuous_api as cb_api

    monkeypatch.setattr(cb_api, "is_flash_attn_3_available", lambda **kw: False)
    monkeypatch.setattr(cb_api, "is_flash_attn_2_available", lambda **kw: False)
    eager, ours = hf_models.build("llama", torch.float32, "cpu")
    prompts = [[5, 6, 7, 8], [9, 10]]
    eager.set_attn_implementation("paged|sdpa")
    with torch.no_grad():
        expected = continuous_batching(eager, prompts, 4, monkeypatch)
        calls = mock_extension.fwd_calls
        got = continuous_batching(ours, prompts, 4, monkeypatch)
    assert mock_extension.fwd_calls > calls and sinks.last_call == "varlen"
    assert got == expected
    assert ours.config._attn_implementation == fc_hf.ATTN_IMPLEMENTATION
