#!/usr/bin/env python
"""Decode against a KV cache: K+V bytes streamed per second by flash_cuda.attention_with_kvcache
(dense and paged caches), against the GPU's copy bandwidth measured in the same run and SDPA's
default backend on the same (dense) keys; and the time of the step captured in a CUDA graph.

    python bench/decode.py                              # the default grid, markdown to stdout
    python bench/decode.py --batch 1 --seqlen 32k --sq 1 --csv out.csv
    python bench/decode.py --quick                      # a few cells
    python bench/decode.py --ablation FLASH_CUDA_DECODE_RING=deep   # a rung against the default

Per cell: q (B, Hq, Sq, D) with Hq = 32 (64 for B = 64's GQA-8 row of the issue is --hq 64),
Hkv = Hq / ratio, every sequence holding Sk tokens, one new token per query row appended
(k / v of Sq rows, as speculative decoding verifies Sq drafted tokens). GB/s counts the cache's
K + V bytes read (B * Hkv * (Sk + Sq) * D * 2 * 2) over the median time of
triton.testing.do_bench (its L2 flush between calls; fresh random inputs). "copy" is a
device-to-device copy of 2 GiB, (read + write bytes) / time. SDPA runs
F.scaled_dot_product_attention(q, k, v, enable_gqa=True) on the dense cache's first Sk + Sq rows
(no append, no mask: at Sq = 1 causal changes nothing; for Sq > 1 both run unmasked); a paged cell
takes SDPA's time on the dense keys of its shape (the dense cell's, when it ran) and reports
"vs_dense", the dense cache's time in the same cell over its own (1.0: pages as fast as a dense
cache). "graph us" is flash_cuda's step (append + attention) captured once in a CUDA graph, per
replay.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402 (bench/common.py: sizes, timer, environment, writers)


def make_step(dtype, D, Hq, Hkv, B, Sk, Sq, kv, cache, splits=0):
    """One decode step over a cache of Sk keys per sequence (random values; "dense" or "pagedN",
    kv "16" or "fp8"): (a function that runs attention_with_kvcache on it, appending Sq rows, and
    its inputs: q, k_cache, v_cache, page)."""
    import torch
    import flash_cuda
    L = Sk + Sq
    page = int(cache[5:]) if cache.startswith("paged") else None
    cap = -(-L // 256) * 256
    if page is None:
        k_cache = torch.randn(B, Hkv, cap, D, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        table = None
    else:
        pages = B * cap // page
        # pages of one sequence scattered over the pool, as an allocator leaves them
        k_cache = torch.randn(pages, page, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
        v_cache = torch.randn(pages, page, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
        table = torch.randperm(pages, device="cuda").to(torch.int32).view(B, cap // page)
    descales = {}
    if kv == "fp8":  # the same random values in e4m3, a descale per (batch, KV head) as serving keeps them
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        descales = dict(k_descale=torch.full((B, Hkv), 0.5, device="cuda"),
                        v_descale=torch.full((B, Hkv), 0.5, device="cuda"))
    q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
    k_new = torch.randn(B, Hkv, Sq, D, device="cuda", dtype=dtype)
    v_new = torch.randn_like(k_new)
    lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")

    def step():
        return flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                                 block_table=table, is_causal=True, num_splits=splits, **descales)
    return step, SimpleNamespace(q=q, k_cache=k_cache, v_cache=v_cache, page=page)


def _switch(text):
    """--ablation's NAME=VALUE, as (NAME, VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or not name.startswith("FLASH_CUDA_") or not value:
        raise argparse.ArgumentTypeError(f"expected FLASH_CUDA_NAME=VALUE, got {text!r}")
    return name, value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16"])
    ap.add_argument("--d", nargs="+", type=int, default=[64, 128])
    ap.add_argument("--ratio", nargs="+", type=int, default=[1, 4, 8], help="Hq / Hkv")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--seqlen", nargs="+", type=C.parse_size, default=[2048, 8192, 32768, 131072])
    ap.add_argument("--sq", nargs="+", type=int, default=[1, 4, 8])
    ap.add_argument("--cache", nargs="+", default=["dense", "paged16", "paged256"])
    ap.add_argument("--kv", nargs="+", default=["16"], choices=["16", "fp8"],
                    help="the cache's element type: q's 16-bit dtype, or float8_e4m3fn (descales per (batch, "
                         "KV head)); fp8 rows report vs_16bit, the 16-bit cell's time over theirs")
    ap.add_argument("--splits", nargs="+", type=int, default=[0],
                    help="num_splits of attention_with_kvcache (0: the planner's choice); several to sweep it")
    ap.add_argument("--max-gib", type=float, default=16.0, help="skip cells whose K+V exceeds this")
    ap.add_argument("--rep", type=int, default=40, help="do_bench rep (ms)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prefill", action="store_true",
                    help="also time prefill (2k-token chunks into an empty dense cache and into paged caches "
                         "already holding tokens, pages 16 and 256, B 1 and 4) against attention() on the same tokens")
    ap.add_argument("--ablation", type=_switch, default=None, metavar="NAME=VALUE",
                    help="also time each cell with this ablation switch set (csrc/include/ablation.h; needs a "
                         "FLASH_CUDA_ABLATIONS=1 build), alternating with the default in one process: "
                         "rung_us and rung_vs (the default's time over the rung's)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("decode.py: needs a CUDA GPU (nothing measured)", file=sys.stderr)
        return 2
    import pandas as pd
    import torch.nn.functional as F

    import flash_cuda
    from flash_cuda import _ext

    if args.ablation and not _ext.ablations():
        print("decode.py: --ablation needs a build with the ablation rungs (FLASH_CUDA_ABLATIONS=1 "
              "python3 -m flash_cuda.build)", file=sys.stderr)
        return 2

    timers = functools.lru_cache(maxsize=None)(lambda rep: C.Timer(25, rep))  # median, L2 flushed

    def do_bench(fn, rep):
        return timers(rep)(fn)

    if args.quick:
        args.dtype, args.d, args.ratio, args.batch = ["bf16"], [128], [8], [1, 8]
        args.seqlen, args.sq, args.cache = [8192, 32768], [1], ["dense", "paged16"]

    buf = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    copy_ms = do_bench(lambda: dst.copy_(buf), rep=200)
    copy_gbs = 2 * buf.numel() / copy_ms / 1e6
    del buf, dst
    env = C.environment(timer=timers(args.rep).name,
                        copy_bandwidth=f"{copy_gbs:.0f} GB/s (read + write of a 2 GiB device copy)")
    print("\n".join(C.env_lines(env)))

    rows = []
    for dt, D, ratio, B, Sk, Sq, splits, kv, cache in itertools.product(
            args.dtype, args.d, args.ratio, args.batch, args.seqlen, args.sq, args.splits, args.kv, args.cache):
        dtype = torch.bfloat16 if dt == "bf16" else torch.float16
        Hq = args.hq
        Hkv = Hq // ratio
        L = Sk + Sq
        kv_bytes = B * Hkv * L * D * 2 * (1 if kv == "fp8" else 2)  # the bytes a step reads
        if kv_bytes > args.max_gib * (1 << 30):
            continue
        step, t = make_step(dtype, D, Hq, Hkv, B, Sk, Sq, kv, cache, splits)
        ms = do_bench(step, rep=args.rep)
        rung_ms = float("nan")
        if args.ablation:  # default, rung, rung, default: the switch is read at every launch
            name, value = args.ablation
            os.environ[name] = value
            try:
                rung_ms = (do_bench(step, rep=args.rep) + do_bench(step, rep=args.rep)) / 2
            finally:
                del os.environ[name]
            ms = (ms + do_bench(step, rep=args.rep)) / 2
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph_ms = do_bench(graph.replay, rep=args.rep)
        sdpa_ms = float("nan")
        if t.page is None or "dense" not in args.cache:  # (a paged cell's from its dense cell: dense_refs)
            if t.page is None and kv == "16":
                k, v = t.k_cache[:, :, :L], t.v_cache[:, :, :L]
            else:
                k = torch.randn(B, Hkv, L, D, device="cuda", dtype=dtype)
                v = torch.randn_like(k)
            try:
                sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(t.q, k, v, enable_gqa=True), args.rep)
            except RuntimeError as exc:  # e.g. out of memory for a backend's workspace
                print(f"sdpa failed: {exc}", file=sys.stderr)
        gbs = kv_bytes / ms / 1e6
        rows.append(dict(dtype=dt, D=D, ratio=ratio, B=B, Sk=Sk, Sq=Sq, splits=splits, kv=kv, cache=cache,
                         kv_mib=kv_bytes / (1 << 20), us=ms * 1e3, gbs=gbs, pct_copy=100 * gbs / copy_gbs,
                         sdpa_us=sdpa_ms * 1e3, vs_sdpa=sdpa_ms / ms, graph_us=graph_ms * 1e3))
        if args.ablation:
            rows[-1].update(rung_us=rung_ms * 1e3, rung_vs=ms / rung_ms)
        r = rows[-1]
        print(f"{dt} D={D} G={ratio} B={B} Sk={Sk} Sq={Sq} splits={splits or 'auto'} kv={kv} {cache}: {r['us']:.1f} us {gbs:.0f} GB/s "
              f"({r['pct_copy']:.0f}% copy) sdpa x{r['vs_sdpa']:.2f} graph {r['graph_us']:.1f} us"
              + (f" rung {r['rung_us']:.1f} us (x{r['rung_vs']:.3f})" if args.ablation else ""), flush=True)
        del step, t, graph
        torch.cuda.empty_cache()

    if args.prefill:
        prefill(torch, do_bench, flash_cuda)
    if not rows:
        return 0
    df = dense_refs(pd.DataFrame(rows))
    if args.csv:
        C.write_csv(df, args.csv, env)
    print(C.markdown(df, floatfmt=".2f"))
    if args.ablation:
        print(f"{'='.join(args.ablation)}: the default's time / the rung's, min {df.rung_vs.min():.3f} "
              f"median {df.rung_vs.median():.3f} max {df.rung_vs.max():.3f}")
    big = df[df.kv_mib >= 64]
    if len(big):
        print(f"\nK+V >= 64 MiB: {len(big)} cells, % of copy bandwidth min {big.pct_copy.min():.1f} "
              f"median {big.pct_copy.median():.1f}")
    dense = df[df.cache == "dense"]
    if len(dense):
        print(f"dense cells: vs SDPA min {dense.vs_sdpa.min():.2f} median {dense.vs_sdpa.median():.2f}")
    fp8 = df[df.kv == "fp8"]
    if fp8.vs_16bit.notna().any():
        print(f"FP8 caches: the 16-bit cache's time / the FP8 one's, min {fp8.vs_16bit.min():.2f} "
              f"median {fp8.vs_16bit.median():.2f}")
    for cache, cells in df[df.cache != "dense"].groupby("cache", sort=False):
        if cells.vs_dense.notna().any():
            print(f"{cache}: dense time / this cache's, min {cells.vs_dense.min():.2f} "
                  f"median {cells.vs_dense.median():.2f}")
    return 0


CELL = ["dtype", "D", "ratio", "B", "Sk", "Sq", "splits", "kv"]


def dense_refs(df):
    """Each paged cell against the dense cell of its shape, where that one ran: SDPA's time (and
    vs_sdpa) taken from it, and vs_dense = the dense cache's time / this cell's (1.0: as fast)."""
    dense = df[df.cache == "dense"].set_index(CELL)
    df = df.copy()
    df["vs_dense"] = float("nan")
    for i, row in df.iterrows():
        key = tuple(row[c] for c in CELL)
        if key not in dense.index:
            continue
        ref = dense.loc[key]
        df.at[i, "vs_dense"] = ref["us"] / row["us"]
        if row["cache"] != "dense" and ref["sdpa_us"] == ref["sdpa_us"]:  # (not NaN)
            df.at[i, "sdpa_us"] = ref["sdpa_us"]
            df.at[i, "vs_sdpa"] = ref["sdpa_us"] / row["us"]
    df["vs_16bit"] = float("nan")
    sixteen = df[df.kv == "16"].set_index(CELL[:-1] + ["cache"])
    for i, row in df[df.kv == "fp8"].iterrows():
        key = tuple(row[c] for c in CELL[:-1]) + (row["cache"],)
        if key in sixteen.index:
            df.at[i, "vs_16bit"] = sixteen.loc[key]["us"] / row["us"]
    return df


def prefill(torch, do_bench, flash_cuda) -> None:
    """Prompt chunks through the cache against attention() on the same tokens (S = 2048 new tokens
    per sequence, causal, bf16, Hq = 32, Hkv = 8, D = 128), B = 1 and 4:

    * into an empty dense cache, cache_seqlens as an int (attention()'s forward over the filled
      rows) and as a tensor (the prefill route: the append by csrc/core/kv_gather.cuh, then the
      forward over the cache in place with per-sequence key counts);
    * appended to a paged cache that already holds C tokens per sequence (pages of 16 and 256
      dealt out over the pool in a random order, cache_seqlens a tensor: the append and a dense
      copy of the C + S keys by one kernel, then the forward), against attention() on q and the same C + S keys and
      values held as dense (B, Hkv, C + S, D) tensors. The outputs are compared too (max |diff|).

    ratio = attention() time / attention_with_kvcache time (1 = as fast; the goal is >= 0.9)."""
    S, Hq, Hkv, D = 2048, 32, 8, 128
    bf16 = torch.bfloat16
    print(f"\nprefill: S = {S} new tokens into an empty cache (capacity {2 * S}), causal, bf16, Hq {Hq}, Hkv {Hkv}, "
          f"D {D}")
    print("| B | attention() us | with_kvcache int us | ratio | with_kvcache tensor us | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for B in (1, 4):
        q = torch.randn(B, Hq, S, D, device="cuda", dtype=bf16)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=bf16)
        v = torch.randn_like(k)
        kc = torch.zeros(B, Hkv, 2 * S, D, device="cuda", dtype=bf16)
        vc = torch.zeros_like(kc)
        lens = torch.zeros(B, dtype=torch.int32, device="cuda")
        with torch.no_grad():
            t_attn = do_bench(lambda: flash_cuda.attention(q, k, v, is_causal=True), rep=100)
            t_int = do_bench(lambda: flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0, is_causal=True),
                             rep=100)
            t_dev = do_bench(lambda: flash_cuda.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens,
                                                                       is_causal=True), rep=100)
        print(f"| {B} | {t_attn * 1e3:.0f} | {t_int * 1e3:.0f} | {t_attn / t_int:.3f} | {t_dev * 1e3:.0f} | "
              f"{t_attn / t_dev:.3f} |", flush=True)
        del q, k, v, kc, vc
    print(f"\nprefill chunks into a paged cache: S = {S} new tokens appended to C cached ones per sequence, causal, "
          f"bf16, Hq {Hq}, Hkv {Hkv}, D {D}")
    print("| B | page | C | attention() us | with_kvcache us | ratio | max abs diff |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for B, page, C in itertools.product((1, 4), (16, 256), (2048, 8192)):
        L = C + S
        q = torch.randn(B, Hq, S, D, device="cuda", dtype=bf16)
        keys = torch.randn(B, Hkv, L, D, device="cuda", dtype=bf16)  # the sequence's C cached + S new keys
        values = torch.randn_like(keys)
        k_new, v_new = keys[:, :, C:], values[:, :, C:]
        per_seq = -(-L // page)
        pages = B * per_seq
        table = torch.randperm(pages, device="cuda").to(torch.int32).view(B, per_seq)
        kc = torch.empty(pages, page, Hkv, D, device="cuda", dtype=bf16).transpose(1, 2)  # a vLLM-style pool
        vc = torch.empty_like(kc)
        pos = torch.arange(C, device="cuda")
        for b in range(B):  # the cached tokens, page by page as an allocator placed them
            kc[table[b, pos // page].long(), :, pos % page] = keys[b, :, :C].transpose(0, 1)
            vc[table[b, pos // page].long(), :, pos % page] = values[b, :, :C].transpose(0, 1)
        lens = torch.full((B,), C, dtype=torch.int32, device="cuda")

        def chunk():  # re-appends the same chunk at C on every call: the cache's contents stay put
            return flash_cuda.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table,
                                                     is_causal=True)

        with torch.no_grad():
            want = flash_cuda.attention(q, keys, values, is_causal=True)
            diff = (chunk().float() - want.float()).abs().max().item()
            t_attn = do_bench(lambda: flash_cuda.attention(q, keys, values, is_causal=True), rep=100)
            t_kv = do_bench(chunk, rep=100)
        print(f"| {B} | {page} | {C} | {t_attn * 1e3:.0f} | {t_kv * 1e3:.0f} | {t_attn / t_kv:.3f} | {diff:.2e} |",
              flush=True)
        del q, keys, values, kc, vc, table
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
