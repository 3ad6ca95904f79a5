"""Seeded random testing of flash_cuda.attention against float64.

One pytest test draws ``FLASH_CUDA_FUZZ_CASES`` cases (default 1000) from a base seed
(``FLASH_CUDA_FUZZ_SEED``, default fixed), runs each through
``attn_check.check_attention`` (out, lse, dq, dk, dv against float64, error at most twice
the error of naive attention in the same dtype), collects every failure and reports them
all at the end, each with its seed, index, full shape/flags and a one-line replay command.

Each case draws: dtype, head dim D (multiple of 8 in [8, 256]), batch, query heads and
key/value heads (GQA), Sq and Sk in [1, ~2100] (skewed to small and odd lengths and to
block boundaries), causal, scale, the memory layout (contiguous, transposed (B, S, H, D)
storage, non-contiguous strided views, storage offsets into larger buffers, now and then
a misaligned pointer), whether the backward also gets an lse gradient, and
deterministic=True on some cases. A budget on the number of score elements keeps every
case small, so gradients are checked on every case and the default 1000 cases take well
under two minutes on an H200. The test is marked ``slow`` (deselect: -m "not slow").

Environment:
    FLASH_CUDA_FUZZ_SEED   base seed (default 20251121)
    FLASH_CUDA_FUZZ_CASES  number of cases (default 1000)
    FLASH_CUDA_FUZZ_ONLY   comma-separated case indices to run alone (replay)

Replay one failure:
    FLASH_CUDA_FUZZ_SEED=<seed> FLASH_CUDA_FUZZ_ONLY=<idx> python -m pytest tests/test_fuzz.py
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import List, Optional

import pytest
import torch

import flash_cuda

from attn_check import check_attention, make_inputs

_GPU_OK = torch.cuda.is_available() and flash_cuda.is_available()
requires_gpu = pytest.mark.skipif(
    not _GPU_OK, reason="needs a CUDA GPU and the compiled flash_cuda extension"
)

DEFAULT_SEED = 20251121
DEFAULT_CASES = 1000

# Per-case budgets. Scores: B * Hq * Sq * Sk (the naive and float64 references materialise
# them, with their gradients). Elements: B * Hq * max(Sq, Sk) * D per tensor.
SCORE_BUDGET = 1 << 22
ELEMENT_BUDGET = 1 << 21

DTYPES = ("float16", "bfloat16", "float32")
# "misaligned" (data pointer not 16-byte aligned) is drawn less often: it exercises the
# binding's copy path rather than the kernels.
LAYOUTS = ("bhsd", "bshd", "strided", "offset", "misaligned")
LAYOUT_WEIGHTS = (3, 3, 3, 3, 1)
# Head dims around the kernels' buckets (32/64/96/128/192/256) and the smallest ones.
SPECIAL_D = (8, 16, 24, 32, 40, 56, 64, 72, 88, 96, 104, 120, 128, 136, 184, 192, 200, 248, 256)
# Lengths at and around the block sizes the kernels tile by.
SPECIAL_LEN = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193,
               255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, 2049)
MAX_LEN = 2100


@dataclasses.dataclass(frozen=True)
class FuzzCase:
    index: int
    seed: int  # seeds the inputs and everything check_attention draws
    dtype: str
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    is_causal: bool
    scale: Optional[float]
    layout: str
    with_dlse: bool  # the backward also receives a random gradient of lse
    deterministic: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def describe(self) -> str:
        scale = "default" if self.scale is None else f"{self.scale:.6g}"
        return (f"dtype={self.dtype} B={self.B} Hq={self.Hq} Hkv={self.Hkv} Sq={self.Sq} "
                f"Sk={self.Sk} D={self.D} causal={self.is_causal} scale={scale} "
                f"layout={self.layout} dlse={self.with_dlse} "
                f"deterministic={self.deterministic} input_seed={self.seed}")


def _draw_length(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.25:
        n = rng.randint(1, 16)
    elif r < 0.50:
        n = rng.randint(17, 160)
    elif r < 0.70:
        n = rng.choice(SPECIAL_LEN)
        return n  # block boundaries stay as they are (even ones included)
    elif r < 0.90:
        n = rng.randint(161, 700)
    else:
        n = rng.randint(701, MAX_LEN)
    if n % 2 == 0 and rng.random() < 0.6:  # skew to odd lengths
        n -= 1 if n > 1 else -1
    return n


def _draw_head_dim(rng: random.Random) -> int:
    if rng.random() < 0.5:
        return rng.choice(SPECIAL_D)
    return 8 * rng.randint(1, 32)


def _draw_scale(rng: random.Random, d: int) -> Optional[float]:
    r = rng.random()
    if r < 0.6:
        return None
    if r < 0.8:
        return d ** -0.5 * rng.uniform(0.5, 2.0)
    if r < 0.9:
        return 10 ** rng.uniform(-2.0, 0.3)  # 0.01 .. 2
    return 1.0


def _shrink_to_budget(B: int, G: int, Hkv: int, Sq: int, Sk: int, D: int):
    """Reduces batch, then group size, then kv heads, then the longer length until the
    case fits the score and element budgets."""
    def fits():
        hq = G * Hkv
        return (B * hq * Sq * Sk <= SCORE_BUDGET
                and B * hq * max(Sq, Sk) * D <= ELEMENT_BUDGET)

    while not fits():
        if B > 1:
            B -= 1
        elif G > 1:
            G -= 1
        elif Hkv > 1:
            Hkv -= 1
        elif Sq >= Sk:
            Sq = max(1, Sq // 2) | 1
        else:
            Sk = max(1, Sk // 2) | 1
    return B, G, Hkv, Sq, Sk


def make_case(base_seed: int, index: int) -> FuzzCase:
    """Case ``index`` of the run seeded by ``base_seed``: a pure function of both."""
    rng = random.Random(f"flash_cuda-fuzz:{base_seed}:{index}")
    dtype = rng.choice(DTYPES)
    D = _draw_head_dim(rng)
    Sq = _draw_length(rng)
    r = rng.random()
    if r < 0.25:
        Sk = Sq
    elif r < 0.30:
        Sq, Sk = 1, _draw_length(rng)  # decode-like
    else:
        Sk = _draw_length(rng)
    B = rng.choice((1, 1, 1, 2, 2, 3, 4))
    Hkv = rng.choice((1, 1, 2, 3, 4))
    G = rng.choice((1, 1, 2, 3, 4, 8))
    B, G, Hkv, Sq, Sk = _shrink_to_budget(B, G, Hkv, Sq, Sk, D)
    return FuzzCase(
        index=index,
        seed=rng.randrange(1, 2**31 - 1),
        dtype=dtype,
        B=B,
        Hq=G * Hkv,
        Hkv=Hkv,
        Sq=Sq,
        Sk=Sk,
        D=D,
        is_causal=rng.random() < 0.5,
        scale=_draw_scale(rng, D),
        layout=rng.choices(LAYOUTS, weights=LAYOUT_WEIGHTS)[0],
        # With Sk = 1 and no lse gradient dq and dk are exactly 0 (P = 1), where a
        # tolerance relative to max|ref| cannot judge rounding noise: such cases always
        # get a dlse (test_extremes.test_single_key covers them without).
        with_dlse=rng.random() < 0.3 or Sk == 1,
        deterministic=rng.random() < 0.25,
    )


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw, 0) if raw else default


def _selected_indices(n_cases: int) -> List[int]:
    only = os.environ.get("FLASH_CUDA_FUZZ_ONLY", "").strip()
    if only:
        return [int(x) for x in only.replace(" ", "").split(",") if x]
    return list(range(n_cases))


def replay_command(base_seed: int, index: int) -> str:
    return (f"FLASH_CUDA_FUZZ_SEED={base_seed} FLASH_CUDA_FUZZ_ONLY={index} "
            f"python -m pytest tests/test_fuzz.py -q")


def run_case(case: FuzzCase) -> None:
    """Builds the case's inputs and checks out, lse, dq, dk, dv against float64."""
    q, k, v = make_inputs(case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D,
                          case.torch_dtype, "cuda", layout=case.layout, seed=case.seed)
    check_attention(q, k, v, is_causal=case.is_causal, scale=case.scale, check_grad=True,
                    with_dlse=case.with_dlse, deterministic=case.deterministic,
                    seed=case.seed, label=f"fuzz case {case.index}")


# A CUDA error of this kind poisons the context: every later case would fail the same way.
_FATAL_CUDA = ("illegal memory access", "unspecified launch failure", "misaligned address",
               "illegal instruction", "device-side assert", "illegal address")


def _report(request, line: str) -> None:
    print(line)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


@pytest.mark.gpu
@pytest.mark.slow
@requires_gpu
def test_fuzz_attention_against_float64(request, record_property):
    base_seed = _env_int("FLASH_CUDA_FUZZ_SEED", DEFAULT_SEED)
    n_cases = _env_int("FLASH_CUDA_FUZZ_CASES", DEFAULT_CASES)
    indices = _selected_indices(n_cases)

    failures = []
    ran = 0
    aborted = None
    t0 = time.perf_counter()
    for idx in indices:
        case = make_case(base_seed, idx)
        try:
            run_case(case)
        except Exception as exc:  # noqa: BLE001 - every failure is collected and reported
            msg = f"{type(exc).__name__}: {exc}".strip()
            failures.append((case, msg))
            if any(s in msg for s in _FATAL_CUDA):
                aborted = case.index
                ran += 1
                break
        ran += 1
    elapsed = time.perf_counter() - t0

    summary = (f"flash_cuda fuzz: {ran} cases run, {len(failures)} failed "
               f"(seed {base_seed}, {elapsed:.1f} s)")
    record_property("fuzz_cases_run", ran)
    record_property("fuzz_failures", len(failures))
    _report(request, summary)

    if failures:
        lines = [summary]
        if aborted is not None:
            lines.append(f"stopped after case {aborted}: a CUDA error leaves the context unusable")
        for case, msg in failures[:50]:
            first = msg if len(msg) < 2000 else msg[:2000] + " ..."
            lines.append(f"- case {case.index} (seed {base_seed}): {case.describe()}\n"
                         f"    {first}\n"
                         f"    replay: {replay_command(base_seed, case.index)}")
        if len(failures) > 50:
            lines.append(f"... and {len(failures) - 50} more: indices "
                         + ",".join(str(c.index) for c, _ in failures[50:]))
        pytest.fail("\n".join(lines), pytrace=False)


# ---------------------------------------------------------------------------------------
# The case generator itself (pure Python: runs without a GPU).
# ---------------------------------------------------------------------------------------


def test_fuzz_cases_are_reproducible_and_valid():
    cases = [make_case(DEFAULT_SEED, i) for i in range(DEFAULT_CASES)]
    assert cases == [make_case(DEFAULT_SEED, i) for i in range(DEFAULT_CASES)]
    assert make_case(DEFAULT_SEED, 3) != make_case(DEFAULT_SEED + 1, 3)
    for c in cases:
        assert c.dtype in DTYPES and c.layout in LAYOUTS
        assert c.D % 8 == 0 and 8 <= c.D <= 256
        assert 1 <= c.Sq <= MAX_LEN and 1 <= c.Sk <= MAX_LEN
        assert c.Hkv >= 1 and c.Hq % c.Hkv == 0 and c.B >= 1
        assert c.B * c.Hq * c.Sq * c.Sk <= SCORE_BUDGET
        assert c.B * c.Hq * max(c.Sq, c.Sk) * c.D <= ELEMENT_BUDGET
        assert c.scale is None or c.scale > 0
    # The draw covers what it is meant to cover.
    assert {c.dtype for c in cases} == set(DTYPES)
    assert {c.layout for c in cases} == set(LAYOUTS)
    assert {True, False} == {c.is_causal for c in cases}
    assert any(c.Hq > c.Hkv for c in cases) and any(c.B > 1 for c in cases)
    assert any(c.Sq == 1 for c in cases) and any(c.Sk == 1 for c in cases)
    assert any(c.Sq > c.Sk and c.is_causal for c in cases)  # rows that see no key
    assert max(max(c.Sq, c.Sk) for c in cases) > 1500
    assert sum(c.Sq % 2 for c in cases) > 0.55 * len(cases)
    assert {8, 256} <= {c.D for c in cases}
    assert any(c.scale is not None for c in cases) and any(c.scale is None for c in cases)
    assert any(c.with_dlse for c in cases) and any(c.deterministic for c in cases)
