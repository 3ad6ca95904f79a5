"""flash_cuda.integrations.transformers on the GPU: tiny Llama / Mistral / Qwen2 / Gemma-2 style
models in bf16 and fp16 with flash_cuda's kernels, against the same weights in float32 with
eager attention. flash_cuda's error must stay within twice eager attention's own error in the
same dtype (plus a small absolute term): loss, logits, every parameter gradient, and the logits
of each greedy generate() step."""

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
