"""Tiny randomly initialised transformers models (no download) for the integration tests, and
the comparisons they share: a model with flash_cuda's attention against the same weights with
transformers' "eager" attention."""

from __future__ import annotations

import copy

import torch

transformers = __import__("pytest").importorskip(
    "transformers", reason="transformers is not installed (optional; pip install transformers)")

from flash_cuda.integrations import transformers as fc_hf  # noqa: E402

VOCAB = 128
# Every family with grouped-query heads (4 query heads on 2 key / value heads) and head dim 32;
# windows of 8 tokens, shorter than the test sequences, so that the window matters.
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attention_dropout=0.0, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=32, sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    # Gemma-2: logit softcapping, a scale from query_pre_attn_scalar, sliding and full layers.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=32, sliding_window=8, attn_logit_softcapping=50.0, query_pre_attn_scalar=24)),
}


def build(family: str, dtype: torch.dtype, device, seed: int = 0):
    """(eager model, flash_cuda model) with identical weights, in eval mode."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    eager = getattr(transformers, model_name)._from_config(config, attn_implementation="eager")
    # Larger weights than the initializer's 0.02 make the attention far from uniform, so
    # masking mistakes show in the logits.
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    eager = eager.to(device=device, dtype=dtype).eval()
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(fc_hf.ATTN_IMPLEMENTATION)
    assert ours.config._attn_implementation == fc_hf.ATTN_IMPLEMENTATION
    assert eager.config._attn_implementation == "eager"
    return eager, ours


def left_padded_batch(lengths, total, device, seed=1):
    """input_ids, attention_mask and labels of left-padded sequences. Labels are -100 on the
    padding and on each sequence's first token, which would be predicted from a padded
    position (whose output no implementation defines)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), total), generator=g)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, total - n:] = 1
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    for b, n in enumerate(lengths):
        labels[b, total - n] = -100
    return ids.to(device), mask.to(device), labels.to(device)


def packed_batch(lengths, device, seed=2):
    """One row of packed sequences: input_ids, restarting position_ids, labels (the first token
    of each sequence is not predicted from the previous sequence), cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    labels = ids.clone()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    labels[0, cu[:-1].long()] = -100
    return ids.to(device), pos.to(device), labels.to(device), cu.to(device)


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def greedy_steps(model, ids, mask, steps):
    """Greedy generate() with the default cache; returns the sequences and the logits of each
    step (batch, steps, vocab)."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits, dim=1)


def teacher_forced_logits(model, sequences, mask, prompt_len, steps):
    """The logits a model gives, in one forward over prompt + generated tokens, at the positions
    that produced each generated token."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=full_mask, position_ids=pos, use_cache=False).logits
    return logits[:, prompt_len - 1: prompt_len - 1 + steps]
