"""Tiny randomly initialised transformers models (no download) for the integration tests, and
the comparisons they share: a model with flash_cuda's attention against the same weights with
transformers' "eager" attention."""

from __future__ import annotations

import copy

import torch

transformers = __import__("pytest").importorskip(
    "transformers", reason="transformers is not installed (optional; pip install transformers)")

from flash_cuda.integrations import transformers as fc_hf  # noqa: E402

# The continuous-batching tests: transformers >= 5.23 runs generate_batch only through
# implementations named like FlashAttention packages (fc_hf.CONTINUOUS_BATCHING says why).
needs_continuous_batching = __import__("pytest").mark.skipif(
    not fc_hf.CONTINUOUS_BATCHING, reason=f"transformers {transformers.__version__} runs continuous batching only "
    "through implementations named like FlashAttention packages (fc_hf.CONTINUOUS_BATCHING)")

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
    # gpt-oss: attention sinks, sliding and full layers, a mixture of experts. Every token takes
    # both experts, so the routing weights change smoothly with the hidden states (a top-k that
    # drops experts could pick differently under two attentions' rounding).
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(head_dim=32, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                     num_local_experts=2, num_experts_per_tok=2,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
# Families whose attention has sinks (one logit per query head, transformers' s_aux).
SINK_FAMILIES = ("gpt_oss",)
# Families whose eager masks ignore restarting position_ids (gpt-oss builds its masks without
# them): their reference for a packed row is each sequence run alone.
EAGER_IGNORES_PACKING = ("gpt_oss",)


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
            elif name.endswith("sinks"):  # sinks comparable to the logits, so that they change the outputs
                p.uniform_(-1.0, 2.0)
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


def per_sequence_loss_and_grads(model, ids, labels, cu):
    """loss_and_grads of a packed row (packed_batch) with each sequence run alone: the same
    token-mean cross entropy over the labels, the logits concatenated."""
    model.zero_grad(set_to_none=True)
    starts = cu.tolist()
    total, count, logits = 0.0, 0, []
    for a, b in zip(starts, starts[1:]):
        out = model(input_ids=ids[:, a:b], use_cache=False).logits
        targets = labels[0, a + 1: b]
        total = total + torch.nn.functional.cross_entropy(out[0, :-1].float(), targets, ignore_index=-100,
                                                          reduction="sum")
        count += int((targets != -100).sum())
        logits.append(out.detach())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), torch.cat(logits, dim=1), grads


def greedy_steps(model, ids, mask, steps, **generate_kwargs):
    """Greedy generate() (the default cache unless generate_kwargs choose another); returns the
    sequences and the logits of each step (batch, steps, vocab)."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0,
                         **generate_kwargs)
    return out.sequences, torch.stack(out.logits, dim=1)


def teacher_forced_logits(model, sequences, mask, prompt_len, steps):
    """The logits a model gives, in one forward over prompt + generated tokens, at the positions
    that produced each generated token."""
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], steps)], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=full_mask, position_ids=pos, use_cache=False).logits
    return logits[:, prompt_len - 1: prompt_len - 1 + steps]


class SinksStandIn:
    """Stands in for flash_cuda.attention / varlen_attention as the integration calls them
    (``flash_cuda.interface``), for the CPU tests: a call with ``sinks`` runs
    flash_cuda.reference's naive attention when flash_cuda's own functions do not take sinks,
    else flash_cuda's functions (on CPU behind the mock extension); a call without sinks always
    runs flash_cuda's functions. Counts the calls with sinks and those the reference ran, and
    remembers which function the last call was ("attention" or "varlen")."""

    def __init__(self, monkeypatch):
        import inspect

        from flash_cuda import interface

        self.native = "sinks" in inspect.signature(interface.attention).parameters
        self.sink_calls = 0
        self.reference_calls = 0
        self.last_sinks = None
        self.last_call = None
        self._attention, self._varlen = interface.attention, interface.varlen_attention
        monkeypatch.setattr(interface, "attention", self.attention)
        monkeypatch.setattr(interface, "varlen_attention", self.varlen_attention)

    def _reference_options(self, kwargs):
        kwargs = dict(kwargs)
        kwargs.pop("deterministic", None)
        if kwargs.pop("dropout_p", 0.0):
            raise NotImplementedError("the sinks stand-in runs without dropout")
        return kwargs

    def attention(self, q, k, v, *, sinks=None, **kwargs):
        self.last_call = "attention"
        if sinks is None:
            return self._attention(q, k, v, **kwargs)
        self.sink_calls += 1
        self.last_sinks = sinks
        if self.native:
            return self._attention(q, k, v, sinks=sinks, **kwargs)
        from flash_cuda import reference

        self.reference_calls += 1
        return reference.attention_naive(q, k, v, sinks=sinks, **self._reference_options(kwargs))[0]

    def varlen_attention(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, sinks=None,
                         **kwargs):
        assert type(max_seqlen_q) is int and type(max_seqlen_k) is int
        self.last_call = "varlen"
        if sinks is None:
            return self._varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)
        self.sink_calls += 1
        self.last_sinks = sinks
        if self.native:
            return self._varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks=sinks,
                                **kwargs)
        from flash_cuda import reference

        self.reference_calls += 1
        opts = self._reference_options(kwargs)
        if torch.compiler.is_compiling():  # the reference loops over the sequences: opaque to the graph
            return _reference_varlen_op(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, opts["is_causal"],
                                        opts["scale"], list(opts["window_size"]), opts["softcap"])
        return reference.attention_varlen_naive(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks=sinks, **opts)[0]


@torch.library.custom_op("flash_cuda_tests::reference_varlen_sinks", mutates_args=())
def _reference_varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, sinks: torch.Tensor, is_causal: bool, scale: float | None,
                         window_size: list[int], softcap: float) -> torch.Tensor:
    """SinksStandIn's packed call as one op, for torch.compile (forward only)."""
    from flash_cuda import reference

    return reference.attention_varlen_naive(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks=sinks, is_causal=is_causal,
                                            scale=scale, window_size=window_size, softcap=softcap)[0].contiguous()


@_reference_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, is_causal, scale, window_size, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
