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
deterministic=True on some cases. Then the options: a sliding window (about a third of the
cases; one or both sides, from the diagonal alone to wider than the keys), softcap (a
fifth), ALiBi slopes per head or per batch entry (a fifth), and, on about one case in
seven, a packed batch for flash_cuda.varlen_attention (``attn_check.check_varlen_attention``)
of 1-6 sequences of lengths up to Sq / Sk, empty and length-1 sequences included. These
draws come after the others, so a case keeps its shape and flags from before they were
added. A budget on the number of score elements keeps every case small, so gradients are
checked on every case and the default 1000 cases take well under two minutes on an H200.
The test is marked ``slow`` (deselect: -m "not slow").

Environment:
    FLASH_CUDA_FUZZ_SEED   base seed (default 20251121)
    FLASH_CUDA_FUZZ_CASES  number of cases (default 1000)
    FLASH_CUDA_FUZZ_ONLY   comma-separated case indices to run alone (replay)

Replay one failure:
    FLASH_CUDA_FUZZ_SEED=<seed> FLASH_CUDA_FUZZ_ONLY=<idx> python -m pytest tests/test_fuzz.py
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from typing import List, Optional, Tuple

import pytest
import torch

import flash_cuda

from attn_check import (check_attention, check_varlen_attention, make_alibi_slopes, make_inputs,
                        make_varlen_inputs)

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
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: str = "none"  # "none", "heads" (Hq,) or "batch" (B, Hq)
    # Packed batch (varlen_attention): per-sequence lengths, each <= Sq / Sk; None: dense.
    seqlens_q: Optional[Tuple[int, ...]] = None
    seqlens_k: Optional[Tuple[int, ...]] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def batch(self) -> int:
        """Batch entries (dense) or sequences (packed): the first dim of (B, Hq) slopes."""
        return self.B if self.seqlens_q is None else len(self.seqlens_q)

    def describe(self) -> str:
        scale = "default" if self.scale is None else f"{self.scale:.6g}"
        extra = ""
        if self.window != (-1, -1):
            extra += f" window={self.window}"
        if self.softcap:
            extra += f" softcap={self.softcap:.6g}"
        if self.alibi != "none":
            extra += f" alibi={self.alibi}"
        if self.seqlens_q is not None:
            extra += f" varlen seqlens_q={self.seqlens_q} seqlens_k={self.seqlens_k}"
        return (f"dtype={self.dtype} B={self.B} Hq={self.Hq} Hkv={self.Hkv} Sq={self.Sq} "
                f"Sk={self.Sk} D={self.D} causal={self.is_causal} scale={scale} "
                f"layout={self.layout} dlse={self.with_dlse} "
                f"deterministic={self.deterministic}{extra} input_seed={self.seed}")


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


def _draw_window(rng: random.Random, is_causal: bool, Sq: int, Sk: int) -> Tuple[int, int]:
    """A sliding window on about a third of the cases: one or both sides, from 0 (the
    diagonal) to wider than the keys; with causal the right side is -1 or 0."""
    if rng.random() >= 0.35:
        return (-1, -1)

    def side():
        r = rng.random()
        if r < 0.25:
            return -1
        if r < 0.40:
            return rng.choice((0, 1))
        if r < 0.80:
            return rng.randint(2, 130)
        return rng.randint(0, max(Sq, Sk) + 10)

    left, right = side(), side()
    if is_causal:
        right = rng.choice((-1, 0))
    if left == -1 and right == -1:
        left = rng.randint(0, 64)
    return (left, right)


def _draw_softcap(rng: random.Random) -> float:
    if rng.random() >= 0.2:
        return 0.0
    return round(rng.choice((rng.uniform(0.3, 5.0), rng.uniform(5.0, 50.0))), 3)


def _draw_alibi(rng: random.Random) -> str:
    r = rng.random()
    return "heads" if r < 0.1 else "batch" if r < 0.2 else "none"


def _draw_seqlens(rng: random.Random, B: int, Sq: int, Sk: int):
    """1-6 sequences of lengths in [0, Sq] / [0, Sk] (empty and length 1 often), whose
    total scores and rows stay within those of the dense (B, Sq, Sk) case."""
    n = rng.randint(1, 6)

    def length(limit):
        r = rng.random()
        if r < 0.15:
            return 0
        if r < 0.3:
            return min(1, limit)
        return rng.randint(0, limit)

    lq = [length(Sq) for _ in range(n)]
    lk = [lq_b if Sq == Sk and rng.random() < 0.5 else length(Sk) for lq_b in lq]
    while (sum(a * b for a, b in zip(lq, lk)) > B * Sq * Sk
           or max(sum(lq), sum(lk)) > B * max(Sq, Sk)):
        i = max(range(n), key=lambda j: lq[j] * lk[j] + lq[j] + lk[j])
        lq[i], lk[i] = lq[i] // 2, lk[i] // 2
    return tuple(lq), tuple(lk)


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
    fields = dict(
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
        with_dlse=rng.random() < 0.3 or Sk == 1,
        deterministic=rng.random() < 0.25,
    )
    # The options are drawn after everything above, so those fields are what they were
    # before the options existed.
    window = _draw_window(rng, fields["is_causal"], Sq, Sk)
    softcap = _draw_softcap(rng)
    alibi = _draw_alibi(rng)
    seqlens_q = seqlens_k = None
    if rng.random() < 0.15:
        seqlens_q, seqlens_k = _draw_seqlens(rng, B, Sq, Sk)
    # With every row seeing at most one key and no lse gradient, dq and dk are exactly 0
    # (P = 1), where a tolerance relative to max|ref| cannot judge rounding noise: such
    # cases always get a dlse (test_extremes.test_single_key covers them without).
    one_key = Sk == 1 or window == (0, 0) or (window[0] == 0 and fields["is_causal"])
    if seqlens_k is not None:
        one_key = one_key or max(seqlens_k) <= 1
    fields["with_dlse"] = fields["with_dlse"] or one_key
    return FuzzCase(window=window, softcap=softcap, alibi=alibi, seqlens_q=seqlens_q,
                    seqlens_k=seqlens_k, **fields)


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


_VARLEN_LAYOUT = {"bhsd": "contiguous", "bshd": "contiguous", "strided": "strided",
                  "offset": "offset", "misaligned": "misaligned"}


def run_case(case: FuzzCase) -> None:
    """Builds the case's inputs and checks out, lse, dq, dk, dv against float64."""
    slopes = None
    if case.alibi != "none":
        slopes = make_alibi_slopes(case.Hq, batch=case.batch if case.alibi == "batch" else None,
                                   device="cuda", seed=case.seed)
    options = dict(is_causal=case.is_causal, scale=case.scale, window_size=case.window,
                   softcap=case.softcap, alibi_slopes=slopes, check_grad=True,
                   with_dlse=case.with_dlse, deterministic=case.deterministic, seed=case.seed,
                   label=f"fuzz case {case.index}")
    if case.seqlens_q is not None:
        q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(
            case.seqlens_q, case.seqlens_k, case.Hq, case.Hkv, case.D, case.torch_dtype, "cuda",
            layout=_VARLEN_LAYOUT[case.layout], seed=case.seed)
        check_varlen_attention(q, k, v, cu_q, cu_k, mq, mk, **options)
        return
    q, k, v = make_inputs(case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D,
                          case.torch_dtype, "cuda", layout=case.layout, seed=case.seed)
    check_attention(q, k, v, **options)


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
    # The options: valid, and each drawn alone and together.
    for c in cases:
        left, right = c.window
        assert left >= -1 and right >= -1 and not (c.is_causal and right > 0)
        assert c.softcap == 0.0 or 0 < c.softcap < math.inf
        assert c.alibi in ("none", "heads", "batch")
        if c.seqlens_q is not None:
            assert 1 <= len(c.seqlens_q) == len(c.seqlens_k) <= 6
            assert all(0 <= n <= c.Sq for n in c.seqlens_q)
            assert all(0 <= n <= c.Sk for n in c.seqlens_k)
            assert c.Hq * sum(a * b for a, b in zip(c.seqlens_q, c.seqlens_k)) <= SCORE_BUDGET
            assert c.Hq * max(sum(c.seqlens_q), sum(c.seqlens_k)) * c.D <= ELEMENT_BUDGET
        if c.Sk == 1 or c.window == (0, 0):
            assert c.with_dlse
    windows = [c for c in cases if c.window != (-1, -1)]
    assert 0.25 * len(cases) < len(windows) < 0.45 * len(cases)
    assert any(c.window[0] == 0 for c in windows) and any(c.window[1] > 0 for c in windows)
    assert any(c.window[0] == -1 for c in windows) and any(c.is_causal for c in windows)
    assert 0.1 * len(cases) < sum(c.softcap > 0 for c in cases) < 0.3 * len(cases)
    assert {c.alibi for c in cases} == {"none", "heads", "batch"}
    varlen = [c for c in cases if c.seqlens_q is not None]
    assert 0.08 * len(cases) < len(varlen) < 0.25 * len(cases)
    assert any(0 in c.seqlens_q for c in varlen) and any(0 in c.seqlens_k for c in varlen)
    assert any(1 in c.seqlens_q for c in varlen) and any(len(c.seqlens_q) > 3 for c in varlen)
    assert any(c.window != (-1, -1) and c.softcap > 0 and c.alibi != "none" for c in cases)
    assert any(c.window != (-1, -1) and c.seqlens_q is not None for c in cases)


def test_fuzz_options_keep_the_earlier_draws():
    """The options are drawn last: without them a case is what it was before they existed."""
    base = dict(index=0, seed=1, dtype="float16", B=1, Hq=2, Hkv=1, Sq=3, Sk=4, D=8,
                is_causal=False, scale=None, layout="bhsd", with_dlse=False, deterministic=False)
    assert FuzzCase(**base).window == (-1, -1) and FuzzCase(**base).seqlens_q is None
    c = make_case(DEFAULT_SEED, 5)
    rng = random.Random(f"flash_cuda-fuzz:{DEFAULT_SEED}:5")
    assert c.dtype == rng.choice(DTYPES) and c.D == _draw_head_dim(rng)


def test_sanitize_cases_are_valid():
    """tests/sanitize_cases.py's case list (the compute-sanitizer workload): valid options,
    every tier with the new options, and the --list mode (no GPU needed)."""
    import sanitize_cases as sc

    for c in sc.CASES:
        if c.dtype == "float8_e4m3fn":  # the FP8 forward: its head dims, forward only, softcap the one modifier
            assert c.D in (64, 128, 256) and c.Hq % c.Hkv == 0 and c.softcap >= 0
            assert not (c.dlse or c.alibi or c.dropout or c.sinks or c.deterministic)
            if c.varlen:
                lq, lk = c.varlen
                assert len(lq) == len(lk) == c.B and max(lq) == c.Sq and max(lk) == c.Sk
            continue
        assert c.dtype in DTYPES and c.D % 8 == 0 and 8 <= c.D <= 256 and c.Hq % c.Hkv == 0
        assert c.window[0] >= -1 and c.window[1] >= -1 and not (c.causal and c.window[1] > 0)
        assert c.softcap >= 0 and c.alibi in ("", "heads", "batch") and 0 <= c.dropout < 1
        if c.varlen:
            lq, lk = c.varlen
            assert len(lq) == len(lk) == c.B and max(lq) == c.Sq and max(lk) == c.Sk
        if c.Sk == 1 or c.window == (0, 0) or (c.varlen and max(c.varlen[1]) <= 1):
            assert c.dlse
    for dtype in DTYPES:
        mine = [c for c in sc.CASES if c.dtype == dtype]
        assert any(c.window != (-1, -1) for c in mine) and any(c.softcap for c in mine)
        assert any(c.alibi for c in mine) and any(c.varlen for c in mine) and any(c.dropout for c in mine)
    assert sc.main(["--list"]) == 0
