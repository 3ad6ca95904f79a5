"""The split-KV decode kernels under compute-sanitizer: flash_cuda.attention_with_kvcache on dense
and paged caches (pages of 16, 48 and 256, a transposed pool), in-place append, every mask
option, splits 1 / n / auto, row chunks, and attention() / varlen_attention() decode-shaped
calls; and the prefill route of prompt chunks (more than 16 queries: core/kv_gather.cuh, then
the query-tiled forward with per-sequence key counts); FP8 (e4m3) caches on GPUs of compute
capability 8.9 and newer. Small sizes (the sanitizer slows kernels 10-100x).

    python tests/sanitize.py --workload kvcache   # the four tools, summarised (or by hand:)
    compute-sanitizer --tool memcheck --padding 256 --kernel-name kns=flash_cuda \\
        python tests/sanitize_kvcache.py            # with a check against float64
    compute-sanitizer --tool racecheck --racecheck-report all --kernel-name kns=flash_cuda \\
        python tests/sanitize_kvcache.py --no-check # (the check's cuBLAS kernels trip racecheck
                                                    #  and initcheck: tests/sanitize.py says why)

The last line is "sanitize_kvcache: P/N cases passed"; exit status 0 when all passed.
"""

from __future__ import annotations

import argparse
import sys

import torch

import flash_cuda
from flash_cuda.reference import attention_with_kvcache_fp8_reference, attention_with_kvcache_reference, quantize_e4m3

CASES = [
    # B, Hq, Hkv, Sq, D, capacity, lens, s_new, page, options
    (2, 8, 2, 1, 128, 512, (300, 0), 1, None, dict(is_causal=True)),
    (2, 8, 2, 1, 64, 512, (511, 17), 1, None, dict(num_splits=5)),
    (3, 8, 2, 4, 128, 768, (700, 3, 400), 4, 16, dict(is_causal=True)),
    (2, 8, 8, 8, 128, 768, (600, 1), 0, 48, dict(is_causal=True, window_size=(40, 0))),
    (2, 16, 2, 1, 256, 512, (400, 100), 1, 256, dict(softcap=20.0)),
    (2, 6, 2, 33, 128, 256, (100, 7), 33, None, dict(is_causal=True)),
    (2, 4, 4, 3, 64, 256, (200, 50), 3, None, dict(alibi=True, is_causal=True)),
    (1, 8, 1, 1, 64, 4096, (4000,), 1, None, dict(num_splits=0)),
    # pages smaller than a step by tensor-map boxes on Hopper: 32-key steps at d 128, d 64's steps
    (2, 8, 2, 8, 128, 768, (700, 50), 8, 16, dict(is_causal=True)),
    (2, 8, 2, 1, 64, 1024, (1000, 64), 1, 32, dict(num_splits=3)),
    # prompt chunks on the prefill route: pages of 16 and 256, a sequence starting empty
    (2, 8, 2, 40, 128, 768, (700, 0), 40, 16, dict(is_causal=True)),
    (3, 4, 2, 24, 64, 512, (300, 5, 0), 24, 256, dict(is_causal=True, window_size=(64, 0), softcap=10.0)),
]


def _cache(B, Hkv, D, cap, page, dtype, gen):
    if page is None:
        k = torch.randn(B, Hkv, cap, D, generator=gen, device="cuda").to(dtype)
        return k, torch.randn_like(k), None
    pages = B * (cap // page) + 2
    # a (pages, page_size, Hkv, D) pool seen as (pages, Hkv, page_size, D)
    k = torch.randn(pages, page, Hkv, D, generator=gen, device="cuda").to(dtype).transpose(1, 2)
    v = torch.randn(pages, page, Hkv, D, generator=gen, device="cuda").to(dtype).transpose(1, 2)
    perm = torch.randperm(pages, generator=gen, device="cuda")[: B * (cap // page)]
    return k, v, perm.view(B, cap // page).to(torch.int32)


def run_case(i, case, check: bool) -> bool:
    B, Hq, Hkv, Sq, D, cap, lens, s_new, page, opts = case
    opts = dict(opts)
    gen = torch.Generator(device="cuda").manual_seed(i)
    dtype = torch.bfloat16 if i % 2 else torch.float16
    k_cache, v_cache, table = _cache(B, Hkv, D, cap, page, dtype, gen)
    q = torch.randn(B, Hq, Sq, D, generator=gen, device="cuda").to(dtype)
    k = v = None
    if s_new:
        k = torch.randn(B, Hkv, s_new, D, generator=gen, device="cuda").to(dtype)
        v = torch.randn(B, Hkv, s_new, D, generator=gen, device="cuda").to(dtype)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = torch.rand(B, Hq, generator=gen, device="cuda") * 0.1
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref_k, ref_v = k_cache.double(), v_cache.double()
    out = flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens_t, block_table=table,
                                            **opts)
    torch.cuda.synchronize()
    if not check:
        return True
    ref_opts = {kk: vv for kk, vv in opts.items() if kk != "num_splits"}
    if "alibi_slopes" in ref_opts:
        ref_opts["alibi_slopes"] = ref_opts["alibi_slopes"].double()
    ref = attention_with_kvcache_reference(q.double(), ref_k, ref_v, None if k is None else k.double(),
                                           None if v is None else v.double(), cache_seqlens=lens_t, block_table=table,
                                           **ref_opts)
    err = (out.double() - ref).abs().max().item()
    tol = (2e-2 if dtype == torch.bfloat16 else 3e-3) * max(1.0, ref.abs().max().item())
    cache_ok = torch.equal(k_cache.double(), ref_k) and torch.equal(v_cache.double(), ref_v)
    ok = err <= tol and cache_ok
    print(f"case {i}: max err {err:.2e} (tol {tol:.1e}), cache {'ok' if cache_ok else 'DIFFERS'}", flush=True)
    return ok


# FP8 caches: B, Hq, Hkv, Sq, D, capacity, lens, s_new, page, options
FP8_CASES = [
    (2, 8, 2, 1, 128, 512, (300, 0), 1, None, dict(is_causal=True)),
    (3, 8, 2, 4, 64, 768, (700, 3, 400), 4, 16, dict(is_causal=True, num_splits=3)),
    (2, 16, 2, 1, 256, 768, (600, 1), 1, 48, dict(softcap=20.0)),
    (2, 8, 2, 1, 128, 768, (700, 40), 1, 16, dict(is_causal=True)),
]


def run_fp8_case(i, case, check: bool) -> bool:
    B, Hq, Hkv, Sq, D, cap, lens, s_new, page, opts = case
    gen = torch.Generator(device="cuda").manual_seed(100 + i)
    dtype = torch.bfloat16 if i % 2 else torch.float16
    k16, v16, table = _cache(B, Hkv, D, cap, page, torch.float32, gen)
    k_cache, v_cache = quantize_e4m3(k16, 0.01), quantize_e4m3(v16, 0.02)
    q = torch.randn(B, Hq, Sq, D, generator=gen, device="cuda").to(dtype)
    k = torch.randn(B, Hkv, s_new, D, generator=gen, device="cuda").to(dtype) if s_new else None
    v = torch.randn(B, Hkv, s_new, D, generator=gen, device="cuda").to(dtype) if s_new else None
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out = flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens_t, block_table=table,
                                            k_descale=0.01, v_descale=0.02, **opts)
    torch.cuda.synchronize()
    if not check:
        return True
    ref_opts = {kk: vv for kk, vv in opts.items() if kk != "num_splits"}
    ref = attention_with_kvcache_fp8_reference(q, ref_k, ref_v, k, v, k_descale=0.01, v_descale=0.02,
                                               cache_seqlens=lens_t, block_table=table, **ref_opts)
    err = (out.double() - ref.double()).abs().max().item()
    tol = (2e-2 if dtype == torch.bfloat16 else 3e-3) * max(1.0, ref.double().abs().max().item())
    cache_ok = torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8)) and \
        torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))
    ok = err <= tol and cache_ok
    print(f"fp8 case {i}: max err {err:.2e} (tol {tol:.1e}), cache {'ok' if cache_ok else 'DIFFERS'}", flush=True)
    return ok


def run_attention_cases(check: bool) -> bool:
    """attention() and varlen_attention() decode-shaped calls (forward only)."""
    gen = torch.Generator(device="cuda").manual_seed(99)
    q = torch.randn(2, 8, 3, 64, generator=gen, device="cuda").half()
    k = torch.randn(2, 2, 900, 64, generator=gen, device="cuda").half()
    v = torch.randn_like(k)
    out = flash_cuda.attention(q, k, v, is_causal=True)
    cu_q = torch.tensor([0, 1, 4, 4], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 700, 705, 1800], dtype=torch.int32, device="cuda")
    qv = torch.randn(4, 8, 64, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(1800, 2, 64, generator=gen, device="cuda").bfloat16()
    outv = flash_cuda.varlen_attention(qv, kv, kv.clone(), cu_q, cu_k, 3, 1095, is_causal=True)
    torch.cuda.synchronize()
    if not check:
        return True
    from flash_cuda.reference import attention_naive
    ref, _ = attention_naive(q.double(), k.double(), v.double(), is_causal=True)
    err = (out.double() - ref).abs().max().item()
    ok = err <= 3e-3 * max(1.0, ref.abs().max().item()) and bool(torch.isfinite(outv.float()).all())
    print(f"attention decode-shaped: max err {err:.2e}", flush=True)
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not flash_cuda.is_available():
        print("sanitize_kvcache: needs a GPU and the extension", file=sys.stderr)
        return 2
    passed = sum(run_case(i, c, not args.no_check) for i, c in enumerate(CASES))
    passed += run_attention_cases(not args.no_check)
    total = len(CASES) + 1
    if torch.cuda.get_device_capability() >= (8, 9):
        passed += sum(run_fp8_case(i, c, not args.no_check) for i, c in enumerate(FP8_CASES))
        total += len(FP8_CASES)
    print(f"sanitize_kvcache: {passed}/{total} cases passed")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
