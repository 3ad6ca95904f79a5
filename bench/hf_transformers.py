"""flash_cuda inside transformers models, against SDPA and eager attention in the same run.

    python bench/hf_transformers.py                 # accuracy per family + training step + decode token
    python bench/hf_transformers.py --only accuracy
    python bench/hf_transformers.py --only speed --layers 8 --batch 4 --seqlen 4096

Accuracy: tiny random-initialised Llama / Mistral / Qwen2 / Gemma-2 style models (as in the
tests), bf16, against the same weights in float32 with eager attention: the loss difference,
the largest parameter-gradient difference (relative to the largest gradient of that
parameter), and the largest logit difference of each greedy generate() step, each next to
eager attention's own bf16 error.

Speed: one Llama-style model (bf16), its attention switched between implementations with
``set_attn_implementation`` so that every timing uses the same weights; rounds interleave the
implementations and the median is reported. A training step is forward + backward + AdamW
step on fresh random tokens; a decode token is one forward of one new token per sequence
against transformers' default cache (DynamicCache) after a prompt.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import transformers  # noqa: E402

import common  # noqa: E402
import hf_models  # noqa: E402
from flash_cuda.integrations import transformers as fc_hf  # noqa: E402

IMPLS = (fc_hf.ATTN_IMPLEMENTATION, "sdpa")


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def accuracy(dtype=torch.bfloat16, steps=8):
    rows = []
    for family in hf_models.FAMILIES:
        eager, ours = hf_models.build(family, dtype, "cuda")
        ref = copy.deepcopy(eager).float()
        ids, mask, labels = hf_models.left_padded_batch([64, 41, 17], 64, "cuda")
        inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
        lr, _, gr = hf_models.loss_and_grads(ref, **inputs)
        le, _, ge = hf_models.loss_and_grads(eager, **inputs)
        lo, _, go = hf_models.loss_and_grads(ours, **inputs)

        def worst(grads):
            return max(_err(grads[n], gr[n]) / max(gr[n].abs().max().item(), 1e-30) for n in gr)

        with torch.no_grad():
            seq, step_logits = hf_models.greedy_steps(ours, ids[:2, -41:], mask[:2, -41:], steps)
            ref_tf = hf_models.teacher_forced_logits(ref, seq, mask[:2, -41:], 41, steps)
            eager_tf = hf_models.teacher_forced_logits(eager, seq, mask[:2, -41:], 41, steps)
        per_step = [_err(step_logits[:, i], ref_tf[:, i]) for i in range(steps)]
        rows.append(dict(
            family=family, loss_ref=lr.item(), loss_diff=abs(lo.item() - lr.item()),
            eager_loss_diff=abs(le.item() - lr.item()), grad_rel=worst(go), eager_grad_rel=worst(ge),
            step_logit_err=" ".join(f"{e:.3f}" for e in per_step),
            eager_step_logit_err=f"{_err(eager_tf, ref_tf):.3f}"))
    return rows


def speed(layers, batch, seqlen, decode_batch, prompt, repeats):
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=max(seqlen, prompt + 256))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    vocab = config.vocab_size

    def train_step():
        ids = torch.randint(0, vocab, (batch, seqlen), device="cuda")
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    prompts = torch.randint(0, vocab, (decode_batch, prompt), device="cuda")

    def decode_tokens(n=32):
        cache = transformers.DynamicCache(config=config)
        with torch.no_grad():
            out = model(input_ids=prompts, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
            end.record()
            torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    times = {(impl, what): [] for impl in IMPLS for what in ("train", "decode")}
    model.train()
    for impl in IMPLS:  # warm-up: kernels, allocator, autotuning
        model.set_attn_implementation(impl)
        common.loop_ms(train_step, 2)
    model.eval()
    for impl in IMPLS:
        model.set_attn_implementation(impl)
        decode_tokens(4)
    for _ in range(repeats):  # interleaved rounds
        for impl in IMPLS:
            model.set_attn_implementation(impl)
            model.train()
            times[(impl, "train")].append(common.loop_ms(train_step, 3))
            model.eval()
            times[(impl, "decode")].append(decode_tokens())
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["accuracy", "speed"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | transformers {transformers.__version__}"
          f" | flash_cuda {common.git_commit()}")
    if args.only in (None, "accuracy"):
        print("\n## Accuracy, bf16 against float32 eager (same weights); eager bf16's own error beside\n")
        print("| family | loss (fp32) | loss diff | eager loss diff | max grad diff / max grad | eager | "
              "generate: logit error per step | eager |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
        for r in accuracy():
            print(f"| {r['family']} | {r['loss_ref']:.4f} | {r['loss_diff']:.2e} | {r['eager_loss_diff']:.2e} | "
                  f"{r['grad_rel']:.2e} | {r['eager_grad_rel']:.2e} | {r['step_logit_err']} | "
                  f"{r['eager_step_logit_err']} |")
    if args.only in (None, "speed"):
        t = speed(args.layers, args.batch, args.seqlen, args.decode_batch, args.prompt, args.repeats)
        ours, sdpa = IMPLS
        print(f"\n## Llama-style, {args.layers} layers, hidden 2048, 16 heads / 8 KV heads (D = 128), bf16; "
              f"median of {args.repeats} interleaved rounds\n")
        print("| step | flash_cuda ms | SDPA ms | SDPA time / ours |")
        print("| --- | ---: | ---: | ---: |")
        print(f"| training step (B = {args.batch}, S = {args.seqlen}, fwd + bwd + AdamW) | "
              f"{t[(ours, 'train')]:.1f} | {t[(sdpa, 'train')]:.1f} | {t[(sdpa, 'train')] / t[(ours, 'train')]:.3f} |")
        print(f"| decode token (B = {args.decode_batch}, prompt {args.prompt}, DynamicCache) | "
              f"{t[(ours, 'decode')]:.2f} | {t[(sdpa, 'decode')]:.2f} | "
              f"{t[(sdpa, 'decode')] / t[(ours, 'decode')]:.3f} |")


if __name__ == "__main__":
    main()
