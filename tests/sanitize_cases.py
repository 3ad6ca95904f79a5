"""The workload that tests/sanitize.py runs under compute-sanitizer (also a test by itself).

Every case runs flash_cuda.attention forward and backward and checks out, lse, dq, dk, dv
against float64 with attn_check's rule, so a sanitized run is also an accuracy test. The
cases cover every kernel tier (fp32 SIMT, fp16 and bf16 tensor-core), every head-dim
bucket (D = 8, 32, 40, 72, 96, 128, 160, 192, 256), odd lengths (1, 17, 127, 1000,
including Sq != Sk both ways and causal rows that see no key), GQA, every memory layout
(contiguous, transposed, strided views, storage offsets, a misaligned pointer), an lse
gradient (dlse), and deterministic=True; then the options on every tier: sliding windows
(causal and two-sided, rows whose window holds no key), softcap, ALiBi slopes per head and
per batch entry, packed batches (flash_cuda.varlen_attention) with empty and length-1
sequences, and attention dropout (checked with the mask its draws give, from the generator's
seed and offset before the call). Sizes are small: compute-sanitizer slows kernels down 10-100x.

Usage:
    python tests/sanitize_cases.py            # run every case (needs a GPU)
    python tests/sanitize_cases.py --list     # print the cases (no GPU needed)
    python tests/sanitize_cases.py --only 0,5 # run some of them
    python tests/sanitize_cases.py --no-check # flash_cuda only, no reference comparison

Exit status: 0 when every case passed, 1 when a case failed, 2 when no GPU / extension.
The last line is "sanitize_cases: P/N cases passed" (tests/sanitize.py reads it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from typing import List, Optional, Tuple

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _TESTS_DIR)  # attn_check
try:  # an installed flash_cuda first; else the checkout this script lives in
    import flash_cuda  # noqa: F401
except ImportError:
    sys.path.append(os.path.dirname(_TESTS_DIR))


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str  # "float32" (SIMT tier), "float16" / "bfloat16" (MMA tier)
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    causal: bool
    layout: str = "bhsd"
    dlse: bool = False  # also on every Sk = 1 case: without it dq, dk are exactly 0
    deterministic: bool = False
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str = ""  # "", "heads" (Hq,) or "batch" (B, Hq) slopes
    # Packed batch for varlen_attention: (seqlens_q, seqlens_k); B, Sq, Sk are then the
    # number of sequences and the longest lengths.
    varlen: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
    # Environment switches set for this case only (csrc/tiers/*/config.h), as (name, value) pairs.
    env: Tuple[Tuple[str, str], ...] = ()
    # The inputs that require grad: "qkv", or a subset ("q", "kv") that runs one side of the
    # backward; a subset is checked against the same call with every gradient.
    grads: str = "qkv"
    dropout: float = 0.0
    sinks: bool = False  # one learned sink logit per query head (attention sinks)

    def describe(self) -> str:
        flags = [f"{self.dtype:8s}", f"B={self.B} Hq={self.Hq} Hkv={self.Hkv}",
                 f"Sq={self.Sq:4d} Sk={self.Sk:4d} D={self.D:3d}",
                 "causal" if self.causal else "full  ", f"{self.layout:10s}"]
        if self.dlse:
            flags.append("dlse")
        if self.deterministic:
            flags.append("deterministic")
        if self.window != (-1, -1):
            flags.append(f"window={self.window}")
        if self.softcap:
            flags.append(f"softcap={self.softcap:g}")
        if self.alibi:
            flags.append(f"alibi={self.alibi}")
        if self.varlen:
            flags.append(f"varlen q={self.varlen[0]} k={self.varlen[1]}")
        for name, value in self.env:
            flags.append(f"{name}={value}")
        if self.grads != "qkv":
            flags.append(f"grads={self.grads}")
        if self.dropout:
            flags.append(f"dropout={self.dropout:g}")
        if self.sinks:
            flags.append("sinks")
        return " ".join(flags).rstrip()


def _varlen_case(dtype, Hq, Hkv, seqlens_q, seqlens_k, D, causal, layout="bhsd", **kw) -> "Case":
    return Case(dtype, len(seqlens_q), Hq, Hkv, max(seqlens_q), max(seqlens_k), D, causal, layout,
                varlen=(tuple(seqlens_q), tuple(seqlens_k)), **kw)


F32, F16, BF16 = "float32", "float16", "bfloat16"

CASES: List[Case] = [
    # ---- fp32, SIMT tier (buckets 32 / 64 / 128 / 256) ----
    Case(F32, 1, 2, 1, 17, 17, 8, False, "bhsd"),
    Case(F32, 1, 2, 2, 127, 1000, 40, True, "bshd"),
    Case(F32, 1, 1, 1, 1000, 127, 128, True, "strided"),  # 873 rows see no key
    Case(F32, 1, 2, 1, 300, 1000, 104, False, "bshd"),  # outer-product kernel, 16 key blocks
    Case(F32, 1, 48, 2, 300, 300, 128, False, "bhsd"),  # 144 query blocks: last wave split
    Case(F32, 1, 4, 1, 1000, 1000, 128, True, "strided"),  # causal half-blocks on the diagonal
    Case(F32, 2, 4, 1, 1, 1000, 256, False, "offset"),
    Case(F32, 1, 1, 1, 1000, 1000, 64, True, "bhsd", dlse=True, deterministic=True),
    Case(F32, 1, 2, 1, 127, 127, 32, False, "misaligned"),
    # ---- fp16, tensor-core tier (buckets 32 / 64 / 96 / 128 / 192 / 256) ----
    Case(F16, 1, 1, 1, 1, 1, 8, False, "bhsd", dlse=True),
    Case(F16, 1, 4, 2, 1000, 1000, 40, True, "bshd"),
    Case(F16, 1, 2, 1, 17, 1000, 128, True, "strided"),
    Case(F16, 1, 2, 2, 127, 127, 256, False, "offset", dlse=True),
    Case(F16, 1, 2, 1, 1000, 17, 72, True, "bhsd"),  # 983 rows see no key
    Case(F16, 1, 1, 1, 127, 1, 160, False, "misaligned", dlse=True),
    Case(F16, 2, 2, 2, 1000, 1000, 64, False, "bhsd"),
    # ---- bf16, tensor-core tier ----
    Case(BF16, 1, 6, 2, 1000, 127, 8, False, "bshd"),
    Case(BF16, 2, 1, 1, 17, 17, 40, True, "strided"),
    Case(BF16, 1, 1, 1, 1000, 1000, 128, True, "bhsd", deterministic=True),
    Case(BF16, 1, 4, 1, 1, 1000, 256, True, "bshd"),  # decode
    Case(BF16, 1, 2, 1, 127, 1000, 96, False, "offset"),
    Case(BF16, 1, 2, 2, 17, 127, 192, True, "bhsd", dlse=True),
    Case(BF16, 1, 1, 1, 1, 1, 64, True, "bhsd", dlse=True),
    # ---- sliding window, softcap, ALiBi (every tier) ----
    Case(F32, 1, 4, 2, 300, 1000, 64, True, "bshd", window=(128, 0), softcap=5.0, alibi="batch"),
    Case(F32, 1, 2, 1, 127, 127, 128, False, "strided", dlse=True, deterministic=True,
         window=(17, 9)),
    Case(F32, 2, 2, 2, 1000, 127, 256, False, "bhsd", window=(0, 0), dlse=True),  # rows w/o key
    Case(F16, 1, 4, 1, 1000, 1000, 96, True, "bhsd", window=(64, 0), alibi="heads"),
    Case(F16, 1, 2, 2, 127, 1000, 256, False, "offset", dlse=True, window=(200, 50), softcap=3.0),
    Case(F16, 2, 2, 1, 17, 127, 40, True, "misaligned", softcap=20.0, alibi="batch"),
    Case(BF16, 2, 4, 2, 129, 65, 128, False, "bshd", softcap=2.0, alibi="batch"),
    Case(BF16, 1, 2, 1, 1000, 1000, 64, True, "strided", deterministic=True, window=(100, -1),
         softcap=30.0, alibi="heads"),
    # ---- packed batches (varlen_attention), empty and length-1 sequences ----
    _varlen_case(F32, 4, 2, (0, 1, 127, 300), (17, 1, 127, 200), 128, True, "strided",
                 window=(50, 0), alibi="batch"),
    _varlen_case(F32, 2, 1, (1000, 0, 5), (1000, 9, 0), 64, False, dlse=True, deterministic=True),
    _varlen_case(F16, 4, 2, (0, 1, 17, 300, 64), (5, 1, 20, 200, 64), 64, True, dlse=True,
                 window=(30, 0)),
    _varlen_case(F16, 2, 2, (127, 1), (1000, 1), 192, False, "offset", softcap=4.0),
    _varlen_case(BF16, 8, 2, (513, 17, 0), (200, 129, 3), 128, True, "strided", softcap=3.0,
                 alibi="heads"),
    _varlen_case(BF16, 2, 1, (1, 1, 1), (1, 1, 1), 256, False, dlse=True),
    # ---- more query tiles than an H100/H200 has SMs: persistent Hopper CTAs run several ----
    Case(BF16, 2, 16, 4, 640, 1000, 128, True, "bhsd"),
    # ---- d = 64 from Sq = 2048: the Hopper forward's 192-row tiles (three consumer warpgroups) ----
    Case(F16, 1, 2, 1, 4100, 4200, 64, True, "bshd"),
    # ---- d = 96, unmasked, from Sq = 2048: the same tiles in 80-key steps (partial last tile and step) ----
    Case(BF16, 1, 2, 1, 2100, 2150, 96, False, "bshd"),
    # ---- d = 192 / 256 and softcap / ALiBi on the warp-specialized Hopper forward ----
    Case(BF16, 1, 4, 2, 700, 900, 256, True, "bhsd"),
    Case(F16, 1, 2, 2, 300, 500, 192, False, "bshd", softcap=5.0, alibi="heads"),
    # ---- a packed batch on the warp-specialized Hopper backward: blocks that run past their
    # sequence (rows zeroed in shared memory), key blocks past a short sequence, GQA ----
    _varlen_case(BF16, 4, 2, (100, 0, 1, 77, 200), (90, 3, 1, 150, 260), 128, True, "strided",
                 window=(64, 0), dlse=True),
    # ---- packed batches on the warp-specialized Hopper forward: boxes that read on into the next
    #      sequence (the producer warp zeroes a partial last V block), tiles past a sequence's end
    #      (skipped), more tiles than SMs ----
    _varlen_case(BF16, 8, 2, (700, 1, 0, 129, 300, 64, 513), (650, 3, 5, 200, 129, 64, 1), 128, True,
                 window=(200, 0)),
    _varlen_case(F16, 4, 2, (129, 77, 200), (129, 200, 77), 64, False, "strided", softcap=5.0,
                 alibi="batch"),
    # ---- softcap's derivative on the warp-specialized Hopper backward: d = 96 (96-wide tiles,
    # tile_policy.h: kBwdD96Native), GQA, a causal window, ALiBi, P^T / dS^T in 16-query slices ----
    Case(F16, 1, 4, 2, 300, 500, 96, True, "bshd", dlse=True, window=(128, 0), softcap=5.0, alibi="heads"),
    # d = 72 on the same tiles: K's last 16-column slab wholly past d (TMA's zero fill), V's and
    # Q's last 32-column slab partly past it
    Case(BF16, 1, 2, 1, 200, 300, 72, True, "bshd", dlse=True),
    # ---- the wide warp-specialized Hopper backward (the default at d 129..256): d = 256 with GQA,
    # causal rows that see no key, partial 64-row key and query blocks; d = 160 on the 192 bucket
    # (columns past d as TMA's zeros, the second warpgroup's 64 columns partly past d) ----
    Case(BF16, 1, 4, 2, 300, 200, 256, True, "bhsd", dlse=True),
    Case(F16, 1, 2, 1, 129, 300, 160, False, "bshd", window=(64, 16)),
    Case(BF16, 2, 2, 1, 200, 129, 192, True, "strided"),
    # ---- its extended instances: packed sequences ending mid-block (the producer zeroes the next
    # sequence's rows), an empty one, GQA, ALiBi per batch entry; d = 160 on the 192 bucket with a
    # window and per-head ALiBi ----
    _varlen_case(BF16, 4, 2, (300, 0, 129), (129, 5, 300), 256, True, "strided", dlse=True, alibi="batch"),
    _varlen_case(F16, 2, 1, (65, 200), (300, 64), 160, False, window=(64, 16), alibi="heads"),
    # ---- its softcap instances: P^T / dS^T in 8-query slices written into the exchange tiles,
    # packed sequences ending mid-block, an empty one, GQA, with ALiBi per head ----
    _varlen_case(BF16, 4, 2, (200, 0, 129), (129, 5, 300), 256, True, dlse=True, softcap=5.0, alibi="heads"),
    # ---- GQA-packed tiles of the Hopper forward (the default for Sq <= 64): row r of a tile is
    # query r / G of head r % G; a partial last tile, causal rows that see no key, G = 4 and 8 ----
    Case(BF16, 2, 8, 2, 50, 700, 64, True, "bhsd", dlse=True),
    Case(F16, 1, 16, 2, 64, 300, 128, False, "bshd"),
    # ---- one side of the backward (only q, or only k / v, requires grad): the dQ or the dK/dV
    # kernel alone, no buffers for the other side; the fp32 dK/dV kernel without dQ atomics ----
    Case(F32, 1, 4, 2, 300, 500, 64, True, "bshd", dlse=True, grads="q"),
    Case(F32, 1, 2, 1, 127, 300, 128, False, "strided", grads="kv"),
    Case(F16, 1, 4, 2, 300, 500, 128, True, "bhsd", dlse=True, grads="q"),
    Case(BF16, 1, 4, 2, 300, 200, 256, True, "bshd", grads="kv"),
    _varlen_case(BF16, 4, 2, (100, 0, 77, 200), (90, 3, 150, 260), 64, True, "strided", window=(64, 0),
                 grads="kv"),
    Case(F16, 1, 2, 1, 129, 300, 96, False, "offset", deterministic=True, softcap=5.0, grads="q"),
    # ---- attention dropout: fp32 (one draw per element), fp16 / bf16 (one per eight), dense and
    # packed, GQA, causal rows that see no key, a window, the deterministic backward ----
    Case(F32, 1, 4, 2, 127, 300, 64, True, "bshd", deterministic=True, dropout=0.2),
    Case(F16, 1, 4, 2, 300, 200, 128, True, "strided", window=(64, 0), dropout=0.3),
    Case(BF16, 2, 2, 1, 257, 257, 64, False, "bhsd", dropout=0.1),
    Case(BF16, 1, 2, 2, 129, 300, 96, False, "offset", deterministic=True, dropout=0.5),
    _varlen_case(F16, 4, 2, (100, 0, 1, 77), (90, 3, 1, 150), 64, True, dropout=0.25),
    # ---- head dims 8..32 on the Hopper kernels (64-wide tiles, products 32 deep): Sq != Sk, a
    # window, GQA, the forward's 192-row tiles (Sq >= 2048) ----
    Case(BF16, 1, 4, 2, 2100, 2200, 32, True, "bshd", window=(300, 0)),
    Case(F16, 2, 2, 1, 300, 257, 16, False, "strided", dlse=True),
    # ---- attention sinks: merged once per row before normalize_output, in every forward tier
    # (SIMT, MMA, the warp-specialized Hopper forward, split-KV decode) and a packed batch ----
    Case(F32, 1, 4, 2, 127, 300, 64, True, "bshd", dlse=True, sinks=True),
    Case(BF16, 1, 4, 2, 300, 500, 128, True, "bhsd", dlse=True, window=(128, 0), sinks=True),
    Case(F16, 1, 4, 1, 1, 1000, 128, False, "bshd", sinks=True),
    Case(BF16, 1, 2, 1, 129, 300, 256, False, "strided", softcap=5.0, sinks=True),
    _varlen_case(BF16, 4, 2, (100, 0, 77, 200), (90, 3, 150, 260), 96, True, sinks=True),
    # ---- the Hopper backward's 80-query steps (d 97..128, Sq >= 4096): a partial last step,
    # causal rows past Sk, a window, GQA ----
    Case(BF16, 1, 2, 1, 4100, 300, 128, True, "bshd"),
    Case(F16, 1, 4, 2, 4096, 333, 112, False, "strided", window=(100, 20)),
    # ---- the backward's lanes rung (FLASH_CUDA_SM90_BWD_STATS=lanes; an ablation build reads it,
    # any other runs the default, bulk-copied (lse, delta) pairs): a partial last block ----
    Case(BF16, 1, 4, 2, 300, 500, 128, True, "bshd", env=(("FLASH_CUDA_SM90_BWD_STATS", "lanes"),)),
    # ---- the forward's 192-row tiles in 128-key steps at d = 64 (Sq >= 2048): a partial last
    # tile and key block, GQA; and their former 96-key steps (FLASH_CUDA_WS_TALL_BLOCK_N=96,
    # FLASH_CUDA_WS_BLOCK_M=192 below the threshold) ----
    Case(BF16, 1, 4, 2, 2100, 2200, 64, True, "bshd"),
    Case(BF16, 1, 4, 2, 500, 700, 64, True, "bshd",
         env=(("FLASH_CUDA_WS_BLOCK_M", "192"), ("FLASH_CUDA_WS_TALL_BLOCK_N", "96"))),
    # ---- the backward's CTAs longest first over sections of pairs (bwd_ws.cuh: bwd_tile_section):
    # GQA, a partial last key block, 10 pairs: sections of 8 and 2 ----
    Case(BF16, 5, 4, 2, 700, 650, 128, True, "bhsd"),
    # ---- the FP8 forward (flash_cuda.fp8.attention_fp8; Hopper): V laid out for the P V product, GQA,
    # partial blocks, Sq != Sk, rows without keys; d = 256 with a window ----
    Case("float8_e4m3fn", 2, 4, 2, 300, 200, 128, True),
    Case("float8_e4m3fn", 1, 2, 2, 257, 700, 256, False, window=(100, 30)),
    # ---- the FP8 forward with softcap (its kExt kernel), and a packed FP8 batch (V in one slot per
    # sequence; an empty query sequence, boxes that read into the next sequence) ----
    Case("float8_e4m3fn", 2, 4, 2, 333, 517, 128, True, softcap=30.0),
    Case("float8_e4m3fn", 4, 4, 2, 300, 400, 128, True, varlen=((5, 0, 300, 129), (9, 3, 257, 400))),
    # ---- the FP8 forward at d = 64 (Q and K in one 64-byte-swizzled slab), a window, partial blocks ----
    Case("float8_e4m3fn", 2, 4, 2, 300, 437, 64, False, window=(150, 40)),
]


def _parse_indices(raw: Optional[str]) -> List[int]:
    if not raw:
        return list(range(len(CASES)))
    idx = [int(x) for x in raw.replace(" ", "").split(",") if x]
    for i in idx:
        if not 0 <= i < len(CASES):
            raise SystemExit(f"--only: case {i} does not exist (0..{len(CASES) - 1})")
    return idx


_VARLEN_LAYOUT = {"bhsd": "contiguous", "bshd": "contiguous", "strided": "strided",
                  "offset": "offset", "misaligned": "misaligned"}


def run_case(case: Case, index: int, check: bool) -> None:
    saved = {name: os.environ.get(name) for name, _ in case.env}
    os.environ.update(dict(case.env))
    try:
        run = _run_fp8_case if case.dtype == "float8_e4m3fn" else _run_dropout_case if case.dropout else _run_case
        run(case, index, check)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_dropout_case(case: Case, index: int, check: bool) -> None:
    """Forward and backward with dropout, against float64 (and the naive rule) given the mask
    the call's draws give: (seed, offset) are the CUDA generator's before the call."""
    import torch

    import flash_cuda
    from attn_check import ATOL_BASE, make_inputs, make_varlen_inputs, rule_error
    from flash_cuda import reference as R

    dtype = getattr(torch, case.dtype)
    options = dict(is_causal=case.causal, window_size=case.window, deterministic=case.deterministic,
                   dropout_p=case.dropout)
    if case.varlen:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(case.varlen[0], case.varlen[1], case.Hq, case.Hkv, case.D,
                                                         dtype, "cuda", layout=_VARLEN_LAYOUT[case.layout],
                                                         seed=1000 + index)
        fn = lambda *t: flash_cuda.varlen_attention(*t, cu_q, cu_k, mq, mk, **options)  # noqa: E731
    else:
        q, k, v = make_inputs(case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D, dtype, "cuda",
                              layout=case.layout, seed=1000 + index)
        fn = lambda *t: flash_cuda.attention(*t, **options)  # noqa: E731
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    seed, offset = gen.initial_seed(), gen.get_offset()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    dout = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(index), device="cuda",
                       dtype=out.dtype)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    torch.cuda.synchronize()
    if not check:
        return

    def reference(dt):
        ref_leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        if case.varlen:
            masks = R.dropout_keep_masks_varlen(cu_q.cpu(), cu_k.cpu(), case.Hq, case.dropout, seed, offset, "cuda")
            o, _ = R.attention_varlen_naive(*ref_leaves, cu_q, cu_k, is_causal=case.causal, window_size=case.window,
                                            dropout_p=case.dropout, dropout_masks=masks)
        else:
            mask = R.dropout_keep_mask(case.B, case.Hq, case.Sq, case.Sk, case.dropout, seed, offset, "cuda")
            o, _ = R.attention_naive(*ref_leaves, is_causal=case.causal, window_size=case.window,
                                     dropout_p=case.dropout, dropout_mask=mask)
        return [o, *torch.autograd.grad(o, ref_leaves, dout.to(dt))]

    ref, naive = reference(torch.float64), reference(dtype)
    problems = [problem for name, x, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive)
                for _, problem in [rule_error(name, x.double(), r, n.double(), ATOL_BASE[dtype])] if problem]
    if problems:
        raise AssertionError(f"sanitize case {index} (dropout): " + "; ".join(problems))


def _run_fp8_case(case: Case, index: int, check: bool) -> None:
    """flash_cuda.fp8.attention_fp8 (forward only) on e4m3 inputs with (B, Hkv) descales, against float64
    attention on the dequantized values within twice the naive FP8 attention's error, its products
    on the tensor cores (the rule of tests/test_reference_fp8.py)."""
    import torch

    from flash_cuda.fp8 import attention_fp8
    from flash_cuda.reference import attention_naive
    from test_reference_fp8 import assert_rule, dequant64, make_fp8, naive_fp8_on_gpu

    options = dict(is_causal=case.causal, window_size=case.window, softcap=case.softcap)
    if case.varlen is not None:  # varlen_attention_fp8 (tests/test_fp8_forward_gpu.py: _check_varlen checks it)
        from test_fp8_forward_gpu import _check_varlen, _run_varlen
        if check:
            _check_varlen(*case.varlen, case.Hq, case.Hkv, case.D, seed=index, **options)
        else:
            _run_varlen(*case.varlen, case.Hq, case.Hkv, case.D, seed=index, **options)
            torch.cuda.synchronize()
        return
    fp8, ds = make_fp8(case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D, seed=index)
    dev = [t.to("cuda") for t in fp8]
    out, lse = attention_fp8(*dev, *(d.to("cuda") for d in ds), return_lse=True, **options)
    torch.cuda.synchronize()
    if not check:
        return
    nout, nlse = naive_fp8_on_gpu(fp8, ds, **options)
    rout, rlse = attention_naive(*(dequant64(t, d) for t, d in zip(fp8, ds)), **options)
    assert_rule(f"sanitize case {index} (fp8) out", out.cpu(), rout, nout)
    assert_rule(f"sanitize case {index} (fp8) lse", lse.cpu(), rlse, nlse, atol_rel=2.0 ** -18)


def _run_case(case: Case, index: int, check: bool) -> None:
    import torch

    import flash_cuda
    from attn_check import (check_attention, check_varlen_attention, make_alibi_slopes,
                            make_inputs, make_varlen_inputs)

    dtype = getattr(torch, case.dtype)
    slopes = None
    if case.alibi:
        slopes = make_alibi_slopes(case.Hq, batch=case.B if case.alibi == "batch" else None,
                                   device="cuda", seed=index)
    options = dict(is_causal=case.causal, scale=None, window_size=case.window,
                   softcap=case.softcap, alibi_slopes=slopes)
    if case.sinks:
        options["sinks"] = torch.randn(case.Hq, generator=torch.Generator().manual_seed(index)).to("cuda")
    if case.varlen:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(
            case.varlen[0], case.varlen[1], case.Hq, case.Hkv, case.D, dtype, "cuda",
            layout=_VARLEN_LAYOUT[case.layout], seed=1000 + index)
        if check and case.grads == "qkv":
            check_varlen_attention(q, k, v, cu_q, cu_k, mq, mk, check_grad=True,
                                   with_dlse=case.dlse, deterministic=case.deterministic,
                                   seed=index, label=f"sanitize case {index}", **options)
            return
        fn = lambda *t: flash_cuda.varlen_attention(*t, cu_q, cu_k, mq, mk, return_lse=True,  # noqa: E731
                                                    deterministic=case.deterministic, **options)
    else:
        q, k, v = make_inputs(case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D, dtype, "cuda",
                              layout=case.layout, seed=1000 + index)
        if check and case.grads == "qkv":
            check_attention(q, k, v, check_grad=True, with_dlse=case.dlse,
                            deterministic=case.deterministic, seed=index,
                            label=f"sanitize case {index}", **options)
            return
        fn = lambda *t: flash_cuda.attention(*t, return_lse=True,  # noqa: E731
                                             deterministic=case.deterministic, **options)
    gen = torch.Generator(device="cuda").manual_seed(index)

    def grads_of(names):
        leaves = [t.detach().requires_grad_(n in names) for t, n in zip((q, k, v), "qkv")]
        out, lse = fn(*leaves)
        outputs, upstream = [out], [torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)]
        if case.dlse:
            outputs.append(lse)
            upstream.append(torch.randn(lse.shape, generator=gen, device="cuda", dtype=lse.dtype))
        wanted = [t for t in leaves if t.requires_grad]
        return dict(zip([n for n in "qkv" if n in names], torch.autograd.grad(outputs, wanted, upstream)))

    got = grads_of(case.grads)
    if check and case.grads != "qkv":  # one side of the backward: as the full backward gives it
        gen.manual_seed(index)
        full = grads_of("qkv")
        for name, g in got.items():
            torch.testing.assert_close(g, full[name], rtol=2e-2, atol=2e-2 * float(full[name].abs().max()),
                                       msg=lambda m: f"sanitize case {index}, d{name}: {m}")
    torch.cuda.synchronize()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--only", metavar="I,J", help="run only these case indices")
    parser.add_argument("--no-check", action="store_true",
                        help="run flash_cuda forward + backward without the float64 comparison")
    args = parser.parse_args(argv)
    indices = _parse_indices(args.only)

    if args.list:
        for i in indices:
            print(f"{i:3d}  {CASES[i].describe()}")
        return 0

    import torch

    import flash_cuda

    if not (torch.cuda.is_available() and flash_cuda.is_available()):
        print("sanitize_cases: needs a CUDA GPU and the compiled flash_cuda extension "
              f"(cuda available: {torch.cuda.is_available()}, extension: "
              f"{flash_cuda.is_available()})", file=sys.stderr)
        print(f"sanitize_cases: 0/{len(indices)} cases passed")
        return 2

    torch.backends.cuda.matmul.allow_tf32 = False
    failed, skipped = [], []
    emulated = int(os.environ.get("FLASH_CUDA_EMULATE_ARCH", "0") or 0)
    hopper = torch.cuda.get_device_capability() == (9, 0) and emulated in (0, 90)
    for n, i in enumerate(indices):
        case = CASES[i]
        t0 = time.perf_counter()
        if case.dtype == "float8_e4m3fn" and not hopper:  # the FP8 forward runs on Hopper only
            skipped.append(i)
            print(f"[{n + 1:2d}/{len(indices)}] case {i:2d} skip {case.describe()} (the FP8 forward needs sm_90)",
                  flush=True)
            continue
        try:
            run_case(case, i, check=not args.no_check)
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - every failure is reported
            status = "FAIL"
            failed.append((i, case, exc))
            traceback.print_exc()
        print(f"[{n + 1:2d}/{len(indices)}] case {i:2d} {status:4s} {case.describe()} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)

    for i, case, exc in failed:
        print(f"FAILED case {i}: {case.describe()}\n    {type(exc).__name__}: {exc}")
    if skipped:
        print(f"sanitize_cases: skipped (not run, not counted) {skipped}", flush=True)
    ran = len(indices) - len(skipped)
    print(f"sanitize_cases: {ran - len(failed)}/{ran} cases passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
