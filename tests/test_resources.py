"""flash_cuda.attention as a resource citizen: determinism, memory, streams, threads.

* Determinism: the forward is bitwise identical across repeated runs (several shapes,
  causal, GQA, every dtype); so is the backward with deterministic=True, and with the
  default for float16 / bfloat16 off Hopper (those kernels use no floating-point atomics).
  The float32 default and the Hopper 16-bit default add dQ in a varying order: their dk, dv
  stay bitwise identical and their dq agrees with the deterministic one to rounding.
* No device-memory leak over 10,000 calls (forward only, forward + backward, with lse,
  every dtype): memory_allocated returns to its baseline.
* Workspace: the peak extra memory of the forward is out + lse, of the backward
  dq + dk + dv + delta (float32, B*H*Sq), each plus a small slack; also for transposed
  inputs (no hidden contiguous copies); on Hopper plus the fp32 dQ workspace, for dense and
  packed batches.
* Streams: the kernels run on the current stream: correct behind a long op enqueued on a
  side stream, and complete (and correct) on a side stream while the default stream is
  still busy; two threads and two streams at once give the bitwise results of a serial
  run.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Tuple

import pytest
import torch

import flash_cuda

from attn_check import check_attention, hopper_skip_reason, make_inputs, make_varlen_inputs

pytestmark = pytest.mark.gpu  # conftest skips these, with the reason, without a usable GPU

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DT_IDS = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
MiB = 1 << 20


def _dt(dtype):
    return DT_IDS[dtype]


# The Hopper backward of a 16-bit batch (dense or packed) adds dQ into an fp32 workspace in a
# varying order unless deterministic=True (docs/reference.md, "Reliability": determinism and resources).
_HOPPER = torch.cuda.is_available() and hopper_skip_reason("") is None
_ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 5e-6}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of t (bitwise comparison: -0.0 != 0.0, NaN == NaN of the same bits)."""
    return t.detach().contiguous().view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _run_repro(q, k, v, dout=None, **kw):
    """_run with deterministic=True: bitwise comparable for every dtype (the float32 default
    adds dQ with atomics)."""
    return _run(q, k, v, dout, deterministic=True, **kw)


def _run(q, k, v, dout=None, **kw):
    """flash_cuda forward (+ backward with dout): returns [out, lse] (+ [dq, dk, dv])."""
    want = dout is not None
    qq, kk, vv = (t.detach().requires_grad_(want) for t in (q, k, v))
    out, lse = flash_cuda.attention(qq, kk, vv, return_lse=True, **kw)
    res = [out.detach(), lse.detach()]
    if want:
        res += list(torch.autograd.grad(out, (qq, kk, vv), dout))
    return res


# ---------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------

# (B, Hq, Hkv, Sq, Sk, D, causal, layout)
DET_SHAPES = [
    (2, 4, 4, 257, 257, 64, False, "bhsd"),
    (1, 8, 2, 129, 1031, 128, True, "bshd"),
    (2, 6, 3, 1000, 1000, 40, True, "strided"),
    (1, 2, 1, 1, 2049, 256, False, "bhsd"),
    (1, 4, 1, 700, 300, 96, True, "bhsd"),
]


def _shape_id(s) -> str:
    return "x".join(map(str, s[:6])) + ("-causal" if s[6] else "")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("shape", DET_SHAPES, ids=_shape_id)
def test_forward_and_backward_are_bitwise_reproducible(dtype, shape):
    B, Hq, Hkv, Sq, Sk, D, causal, layout = shape
    q, k, v = make_inputs(B, Hq, Hkv, Sq, Sk, D, dtype, "cuda", layout=layout, seed=Sq + Sk)
    dout = torch.randn(q.shape, dtype=dtype, device="cuda",
                       generator=torch.Generator(device="cuda").manual_seed(1))
    names = ("out", "lse", "dq", "dk", "dv")

    fwd0 = _run(q, k, v, is_causal=causal)
    for rep in range(3):
        fwd = _run(q, k, v, is_causal=causal)
        for name, a, b in zip(names, fwd0, fwd):
            assert _same_bits(a, b), f"forward {name} differs bitwise on repeat {rep + 1}"

    reference = None
    for deterministic in (True, False):
        first = _run(q, k, v, dout, is_causal=causal, deterministic=deterministic)
        # The forward does not depend on the flag.
        assert _same_bits(first[0], fwd0[0]) and _same_bits(first[1], fwd0[1])
        atomic_dq = not deterministic and (dtype == torch.float32 or _HOPPER)
        if reference is None:
            reference = first
        for rep in range(4):
            again = _run(q, k, v, dout, is_causal=causal, deterministic=deterministic)
            for name, a, b in zip(names, first, again):
                if name == "dq" and atomic_dq:
                    # Unordered float sums: equal up to the rounding of the additions (fp32),
                    # then of the one conversion to the 16-bit dtype.
                    torch.testing.assert_close(b, reference[2], rtol=2 * _ULP[dtype], atol=1e-5)
                    continue
                assert _same_bits(a, b), (f"{name} differs bitwise on repeat {rep + 1} "
                                          f"(deterministic={deterministic})")


# ---------------------------------------------------------------------------------------
# Memory: no leak, bounded workspace
# ---------------------------------------------------------------------------------------


def test_no_device_memory_leak_over_10000_calls():
    shapes = {dt: make_inputs(1, 2, 1, 17, 33, 32, dt, "cuda", seed=i)
              for i, dt in enumerate(DTYPES)}
    douts = {dt: torch.randn_like(shapes[dt][0]) for dt in DTYPES}

    def call(i: int) -> None:
        dt = DTYPES[i % 3]
        q, k, v = shapes[dt]
        causal = i % 2 == 0
        if i % 10 == 0:  # forward + backward
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out, lse = flash_cuda.attention(qq, kk, vv, is_causal=causal, return_lse=True,
                                            deterministic=i % 20 == 0)
            loss_inputs = (out, lse) if i % 30 == 0 else (out,)
            grads = ((douts[dt], torch.ones_like(lse)) if i % 30 == 0 else (douts[dt],))
            torch.autograd.backward(loss_inputs, grads)
        elif i % 10 == 5:
            flash_cuda.attention(q, k, v, is_causal=causal, return_lse=True)
        else:
            flash_cuda.attention(q, k, v, is_causal=causal)

    for i in range(60):  # warm-up: every kernel loaded, allocator pools populated
        call(i)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for i in range(10_000):
        call(i)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    assert after == base, f"device memory grew by {after - base} bytes over 10,000 calls"


# Slack for the allocator's rounding (512-byte granularity) and tiny temporaries.
SLACK = 1 * MiB


def _peak_extra(fn) -> Tuple[int, object]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    res = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, res


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_workspace_is_outputs_plus_row_stats(dtype, layout, deterministic):
    B, Hq, Hkv, S, D = 2, 8, 2, 1024, 128
    q, k, v = make_inputs(B, Hq, Hkv, S, S, D, dtype, "cuda", layout=layout, seed=9)
    dout = torch.randn(q.shape, dtype=dtype, device="cuda")
    row_stats = B * Hq * S * 4  # one float32 per query row (lse, delta)

    # Forward without autograd: out + lse.
    extra, (out, lse) = _peak_extra(lambda: flash_cuda.attention(q, k, v, return_lse=True))
    bound = out.numel() * out.element_size() + row_stats + SLACK
    assert extra <= bound, f"forward peak extra {extra / MiB:.2f} MiB > {bound / MiB:.2f} MiB"
    del out, lse

    # Forward with autograd (the saved tensors are the inputs, out and lse).
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    extra, out = _peak_extra(lambda: flash_cuda.attention(qq, kk, vv, is_causal=True,
                                                          deterministic=deterministic))
    assert extra <= bound, f"forward (grad) peak extra {extra / MiB:.2f} MiB > {bound / MiB:.2f} MiB"

    # Backward: dq + dk + dv + delta, and on Hopper without deterministic=True dQ in fp32
    # (B * Hq * S rounded up to 128 * D * 4 bytes).
    extra, grads = _peak_extra(lambda: torch.autograd.grad(out, (qq, kk, vv), dout))
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    hopper_dq = _HOPPER and dtype != torch.float32 and not deterministic
    dq_accum = B * Hq * -(-S // 128) * 128 * D * 4 if hopper_dq else 0
    bound = grad_bytes + row_stats + dq_accum + SLACK
    assert extra <= bound, (f"backward peak extra {extra / MiB:.2f} MiB > {bound / MiB:.2f} MiB "
                            f"(grads {grad_bytes / MiB:.2f} MiB + delta {row_stats / MiB:.2f} MiB)")


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_packed_backward_workspace(D, deterministic):
    """A packed batch's backward: dq + dk + dv + delta (Hq * total_q floats), and on Hopper
    without deterministic=True the fp32 dQ tiles of the warp-specialized kernel: per head
    total_q // M + B + 1 tiles of M rows x the head-dim bucket (M = 128 at D = 64, 64 at D = 128;
    csrc/tiers/wgmma/family.h: WgmmaFamily::plan; tile_policy.h: bwd_block_m)."""
    lens_q, lens_k = (300, 1, 0, 700, 129, 64), (200, 64, 5, 700, 1000, 1)
    Hq, Hkv, dtype = 8, 2, torch.bfloat16
    q, k, v, cu_q, cu_k, mq, mk = make_varlen_inputs(lens_q, lens_k, Hq, Hkv, D, dtype, "cuda", seed=5)
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = flash_cuda.varlen_attention(qq, kk, vv, cu_q, cu_k, mq, mk, is_causal=True,
                                      deterministic=deterministic)
    dout = torch.randn_like(out)
    extra, grads = _peak_extra(lambda: torch.autograd.grad(out, (qq, kk, vv), dout))
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    total_q, B = sum(lens_q), len(lens_q)
    row_stats = Hq * total_q * 4
    block_m, bucket_d = (128, 64) if D <= 64 else (64, 128)
    hopper_dq = _HOPPER and not deterministic
    dq_accum = Hq * (total_q // block_m + B + 1) * block_m * bucket_d * 4 if hopper_dq else 0
    bound = grad_bytes + row_stats + dq_accum + SLACK
    assert extra <= bound, (f"packed backward peak extra {extra / MiB:.2f} MiB > {bound / MiB:.2f} MiB "
                            f"(grads {grad_bytes / MiB:.2f} MiB + delta {row_stats / MiB:.2f} MiB + "
                            f"dQ workspace {dq_accum / MiB:.2f} MiB)")


# ---------------------------------------------------------------------------------------
# Streams and threads
# ---------------------------------------------------------------------------------------


def _cycles_per_second() -> float:
    """Calibrates torch.cuda._sleep (a spin of N GPU clock cycles)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 50_000_000
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return n / (start.elapsed_time(end) / 1e3)


def _problem(dtype, seed, causal=True):
    q, k, v = make_inputs(2, 4, 2, 301, 517, 64, dtype, "cuda", layout="bshd", seed=seed)
    dout = torch.randn(q.shape, dtype=dtype, device="cuda",
                       generator=torch.Generator(device="cuda").manual_seed(seed))
    expected = _run_repro(q, k, v, dout, is_causal=causal)
    torch.cuda.synchronize()
    return (q, k, v, dout), expected


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_runs_on_current_stream_behind_a_long_op(dtype):
    (q, k, v, dout), expected = _problem(dtype, seed=1)
    check_attention(q, k, v, is_causal=True, scale=None, label="stream problem")
    side = torch.cuda.Stream()
    cycles = int(0.2 * _cycles_per_second())  # ~200 ms
    q2 = torch.empty_like(q)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        q2.fill_(float("nan"))
        torch.cuda._sleep(cycles)  # the copy below lands ~200 ms later
        q2.copy_(q)
        got = _run_repro(q2, k, v, dout, is_causal=True)
        same = torch.stack([(_bits(a) == _bits(b)).all() for a, b in zip(got, expected)])
    side.synchronize()
    assert bool(same.all()), "results on a side stream differ: a kernel ran before its input was ready"
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
def test_side_stream_does_not_wait_for_default_stream(dtype):
    (q, k, v, dout), expected = _problem(dtype, seed=2)
    side = torch.cuda.Stream()
    # Warm-up on the side stream: its allocator pool then holds every block the timed call
    # needs, so that call does no cudaMalloc (which may synchronize the device).
    with torch.cuda.stream(side):
        warm = _run_repro(q, k, v, dout, is_causal=True)
        torch.stack([(_bits(a) == _bits(b)).all() for a, b in zip(warm, expected)]).all().item()
    del warm
    cycles = int(1.5 * _cycles_per_second())  # the default stream stays busy ~1.5 s
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)  # on the default stream
    t0 = time.perf_counter()
    with torch.cuda.stream(side):
        got = _run_repro(q, k, v, dout, is_causal=True)
        same = torch.stack([(_bits(a) == _bits(b)).all() for a, b in zip(got, expected)])
        ok = bool(same.all())  # synchronizes the side stream only
    elapsed = time.perf_counter() - t0
    default_busy = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    assert ok, "side-stream results are wrong: work went to another stream"
    assert default_busy and elapsed < 1.0, (
        f"the side-stream call took {elapsed:.2f} s and the default stream was "
        f"{'still busy' if default_busy else 'idle'}: flash_cuda waited for the default "
        f"stream (device synchronization or a launch on the default stream)")


def _serial_results(dtypes: List[torch.dtype]) -> Dict[int, tuple]:
    return {i: _problem(dt, seed=10 + i) for i, dt in enumerate(dtypes)}


@pytest.mark.parametrize("streams", ["default", "separate"])
def test_two_threads_at_once(streams):
    problems = _serial_results([torch.float16, torch.bfloat16, torch.float32, torch.float16])
    n_threads, iters = 2, 25
    barrier = threading.Barrier(n_threads)
    errors: List[str] = []

    def worker(tid: int) -> None:
        try:
            stream = torch.cuda.Stream() if streams == "separate" else torch.cuda.default_stream()
            barrier.wait()
            with torch.cuda.stream(stream):
                for it in range(iters):
                    idx = (tid + 2 * it) % len(problems)
                    (q, k, v, dout), expected = problems[idx]
                    got = _run_repro(q, k, v, dout, is_causal=True)
                    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
                        if not _same_bits(a, b):
                            errors.append(f"thread {tid} iteration {it} problem {idx}: {name}")
                stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(f"thread {tid}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    torch.cuda.synchronize()
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    assert not errors, "\n".join(errors[:20])


def test_two_streams_at_once():
    problems = _serial_results([torch.float16, torch.float32, torch.bfloat16, torch.float32])
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    pending = []
    torch.cuda.synchronize()
    for it in range(10):
        for j, s in enumerate((s1, s2)):
            idx = (2 * it + j) % len(problems)
            (q, k, v, dout), expected = problems[idx]
            with torch.cuda.stream(s):
                got = _run_repro(q, k, v, dout, is_causal=True)
            pending.append((it, idx, got, expected))
    torch.cuda.synchronize()
    for it, idx, got, expected in pending:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
            assert _same_bits(a, b), f"iteration {it} problem {idx}: {name} differs"
