"""flash_cuda.integrations.transformers on the GPU: tiny Llama / Mistral / Qwen2 / Gemma-2 /
gpt-oss (attention sinks) style models in bf16 and fp16 with flash_cuda's kernels, against the
same weights in float32 with eager attention. flash_cuda's error must stay within twice eager
attention's own error in the same dtype (plus a small absolute term): loss, logits, every
parameter gradient (the sinks' included), and the logits of each greedy generate() step, with
transformers' default cache and with a static cache under torch.compile. Continuous batching
("paged|fcuda") must generate the tokens of transformers' own paged attention (float32)."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_models
from hf_models import fc_hf

pytestmark = pytest.mark.gpu

FAMILIES = list(hf_models.FAMILIES)
DTYPES = [torch.bfloat16, torch.float16]


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def within_twice_eager(ours, eager, ref, what, atol=1e-3):
    scale = ref.float().abs().max().item()
    e_ours, e_eager = _err(ours, ref), _err(eager, ref)
    assert e_ours <= 2 * e_eager + atol * max(scale, 1.0), \
        f"{what}: flash_cuda error {e_ours:.3g}, eager error {e_eager:.3g} (reference max {scale:.3g})"


def models(family, dtype):
    eager, ours = hf_models.build(family, dtype, "cuda")
    return eager, ours, copy.deepcopy(eager).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", ["dense", "padded", "packed"])
def test_loss_logits_and_every_gradient(family, dtype, batch):
    eager, ours, ref = models(family, dtype)
    if batch == "dense":
        ids = torch.randint(1, hf_models.VOCAB, (2, 96), device="cuda")
        inputs, keep = dict(input_ids=ids, labels=ids), (slice(None),)
    elif batch == "padded":
        ids, mask, labels = hf_models.left_padded_batch([96, 70, 9], 96, "cuda")
        inputs, keep = dict(input_ids=ids, attention_mask=mask, labels=labels), (mask.bool(),)
    else:
        ids, pos, labels, _ = hf_models.packed_batch([40, 7, 49], "cuda")
        inputs, keep = dict(input_ids=ids, position_ids=pos, labels=labels), (slice(None),)
    if batch == "packed" and family in hf_models.EAGER_IGNORES_PACKING:
        # Eager attention would let the sequences see each other: each runs alone instead.
        cu = hf_models.packed_batch([40, 7, 49], "cuda")[3]
        lr, xr, gr = hf_models.per_sequence_loss_and_grads(ref, ids, labels, cu)
        le, xe, ge = hf_models.per_sequence_loss_and_grads(eager, ids, labels, cu)
    else:
        lr, xr, gr = hf_models.loss_and_grads(ref, **inputs)
        le, xe, ge = hf_models.loss_and_grads(eager, **inputs)
    lo, xo, go = hf_models.loss_and_grads(ours, **inputs)
    within_twice_eager(lo, le, lr, "loss")
    within_twice_eager(xo[keep], xe[keep], xr[keep], "logits")
    assert go.keys() == gr.keys()
    for name in gr:
        within_twice_eager(go[name], ge[name], gr[name], f"grad of {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_step_by_step(family):
    eager, ours, ref = models(family, torch.bfloat16)
    ids, mask, _ = hf_models.left_padded_batch([48, 30, 11], 48, "cuda", seed=7)
    steps = 12
    with torch.no_grad():
        seq, step_logits = hf_models.greedy_steps(ours, ids, mask, steps)
        assert torch.equal(seq[:, -steps:], step_logits.argmax(-1))
        # Every step's logits against float32 eager attention fed the same tokens.
        ref_tf = hf_models.teacher_forced_logits(ref, seq, mask, ids.shape[1], steps)
        eager_tf = hf_models.teacher_forced_logits(eager, seq, mask, ids.shape[1], steps)
    for i in range(steps):
        within_twice_eager(step_logits[:, i], eager_tf[:, i], ref_tf[:, i], f"generate step {i}", atol=2e-3)


def test_decode_steps_run_the_decode_kernels():
    _, ours, _ = models("llama", torch.bfloat16)
    ids = torch.randint(1, hf_models.VOCAB, (2, 40), device="cuda")
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ours.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                      do_sample=False, pad_token_id=0)
    names = [e.name for e in prof.events()]
    assert any("decode" in n.lower() for n in names), sorted(set(names))[:40]


def test_autocast_training_step():
    """fp32 weights under autocast: the attention gets the autocast dtype, as SDPA would."""
    eager, ours = hf_models.build("llama", torch.float32, "cuda")
    ids = torch.randint(1, hf_models.VOCAB, (2, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        le, _, ge = hf_models.loss_and_grads(eager, input_ids=ids, labels=ids)
        lo, _, go = hf_models.loss_and_grads(ours, input_ids=ids, labels=ids)
    assert abs(lo.item() - le.item()) < 2e-2 * max(abs(le.item()), 1.0)
    for name in ge:
        assert go[name].dtype == torch.float32
        assert _err(go[name], ge[name]) <= 5e-2 * max(ge[name].abs().max().item(), 1e-6), name


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_compiled_generate_with_a_static_cache(family, mode):
    """generate() with cache_implementation="static" compiles its decode steps (transformers
    does on CUDA) with fullgraph=True, so that any graph break fails; "reduce-overhead" also
    replays them as CUDA graphs. Every step's logits as in test_greedy_generate_step_by_step."""
    from transformers import CompileConfig

    eager, ours, ref = models(family, torch.bfloat16)
    ids, mask, _ = hf_models.left_padded_batch([48, 30, 11], 48, "cuda", seed=7)
    steps = 12
    torch._dynamo.reset()
    with torch.no_grad():
        seq, step_logits = hf_models.greedy_steps(ours, ids, mask, steps, cache_implementation="static",
                                                  compile_config=CompileConfig(fullgraph=True, mode=mode))
        assert hasattr(ours, "_compiled_call"), "generate() did not compile the decode steps"
        assert torch.equal(seq[:, -steps:], step_logits.argmax(-1))
        ref_tf = hf_models.teacher_forced_logits(ref, seq, mask, ids.shape[1], steps)
        eager_tf = hf_models.teacher_forced_logits(eager, seq, mask, ids.shape[1], steps)
    for i in range(steps):
        within_twice_eager(step_logits[:, i], eager_tf[:, i], ref_tf[:, i], f"generate step {i}", atol=2e-3)


@hf_models.needs_continuous_batching
@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_gives_the_tokens_of_paged_sdpa(family):
    """generate_batch() with "paged|fcuda" generates, greedily in float32, the tokens of
    "paged|sdpa" ("paged|eager" for gpt-oss, which has no SDPA path)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    eager, ours = hf_models.build(family, torch.float32, "cuda")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, hf_models.VOCAB, (n,), generator=g).tolist() for n in (5, 70, 3, 33, 17)]
    eager.set_attn_implementation("paged|eager" if family in hf_models.SINK_FAMILIES else "paged|sdpa")
    ours.set_attn_implementation(fc_hf.PAGED_ATTN_IMPLEMENTATION)
    config = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1, pad_token_id=0)
    results = []
    for model in (eager, ours):
        cb_config = ContinuousBatchingConfig(block_size=32, num_blocks=64, max_batch_tokens=128)
        with torch.no_grad():
            out = model.generate_batch(inputs=prompts, generation_config=config,
                                       continuous_batching_config=cb_config, progress_bar=False)
        results.append([out[key].generated_tokens for key in sorted(out, key=lambda r: int(r.split("_")[-1]))])
    expected, got = results
    assert [len(t) for t in got] == [16] * len(prompts)
    assert got == expected
