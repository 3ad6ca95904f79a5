"""pytest configuration of the flash_cuda test suite.

* Tests that need a GPU carry the ``gpu`` marker (``pytestmark = pytest.mark.gpu``); they
  are skipped, with the reason, when CUDA, the compiled extension or an sm_80+ GPU is
  missing. Everything else runs on CPU (CI).
* ``mock_extension`` replaces the compiled extension by a CPU implementation built on
  flash_cuda.reference, so the Python layer (validation, custom ops, autograd,
  torch.compile, opcheck) is exercised without a GPU.
* Running ``python -m pytest tests`` from the repository root puts the checkout first on
  sys.path. When the checkout has no compiled ``flash_cuda/_C*.so`` but an installed copy
  (``pip install --no-build-isolation .``) has one, the installed copy is imported
  instead. Otherwise the checkout is tested: without a compiled extension it compiles its
  kernels from ``csrc/`` at first use into the cache (flash_cuda/_ext.py), the same cache
  entry as an installed ``pip install .`` of the same sources, so the GPU tests do not skip
  for a missing extension. Subprocesses of the tests import the same copy (PYTHONPATH);
  the report header says which copy is tested and where its kernels come from.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# Every GPU test runs with the extension's outputs NaN-filled before each launch, so an
# element a kernel does not write cannot pass by keeping a stale correct value.
os.environ.setdefault("FLASH_CUDA_POISON_OUTPUTS", "1")

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


def _has_compiled_ext(pkg_dir: Path) -> bool:
    return pkg_dir.is_dir() and (any(pkg_dir.glob("_C*.so")) or any(pkg_dir.glob("_C*.pyd")))


def _prefer_built_flash_cuda() -> None:
    if "flash_cuda" in sys.modules or os.environ.get("FLASH_CUDA_TEST_SOURCE_TREE"):
        return
    if _has_compiled_ext(REPO_ROOT / "flash_cuda"):
        return

    def resolved(entry: str) -> Path:
        try:
            return Path(entry or os.getcwd()).resolve()
        except OSError:
            return Path(entry)

    for entry in sys.path:
        if resolved(entry) == REPO_ROOT:
            continue
        if _has_compiled_ext(resolved(entry) / "flash_cuda"):
            sys.path[:] = [e for e in sys.path if resolved(e) != REPO_ROOT]
            return


_prefer_built_flash_cuda()
if importlib.util.find_spec("flash_cuda") is None:  # pytest started outside the checkout
    sys.path.insert(0, str(REPO_ROOT))
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

import torch  # noqa: E402

import flash_cuda  # noqa: E402
from flash_cuda import _ext, kvcache_checks, validation  # noqa: E402
from flash_cuda.reference import (attention_backward_blocked, attention_forward_blocked,  # noqa: E402
                                  attention_varlen_backward_blocked,
                                  attention_varlen_forward_blocked, attention_with_kvcache_fp8_reference,
                                  attention_with_kvcache_reference,
                                  combine_splits, dropout_keep_mask, dropout_keep_masks_varlen)

from attn_check import gpu_skip_reason  # noqa: E402

if Path(flash_cuda.__file__).resolve().parent.parent == REPO_ROOT:
    # The checkout is tested: the tests' subprocesses must not import an installed copy (e.g.
    # `pip install .`'s) instead.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs an sm_80+ NVIDIA GPU and the compiled flash_cuda extension")
    config.addinivalue_line(
        "markers", "slow: long GPU tests (2^31-element tensors, S=65536, the fuzz run); "
        "deselect with -m 'not slow'")


def pytest_report_header(config):
    reason = gpu_skip_reason()
    # is_available() loads the kernels, compiling them if this is their first use.
    kernels = (f"kernels {_ext._C.__file__}" if flash_cuda.is_available()
               else "kernels not loaded")
    return [
        f"flash_cuda: {Path(flash_cuda.__file__).parent} ({kernels})",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}; GPU tests: "
        + ("run" if reason is None else f"skipped ({reason})"),
    ]


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ---------------------------------------------------------------------------------------
# A CPU stand-in for the compiled extension
# ---------------------------------------------------------------------------------------


class MockExtension:
    """Implements the ``_C.fwd`` / ``_C.bwd`` contract on any device with the blocked
    reference (dense and packed layouts), and asserts that the Python layer calls it as the
    binding expects:

        fwd(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, tier, dropout_p=0.0, rng_state=None,
            sinks=None) -> (out, lse, aux)
        bwd(dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap,
            alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            deterministic, tier, need_dq=True, need_dkdv=True) -> (dq, dk, dv)
        merge_partials(a, a_lse, a_stats, b, b_lse, b_stats, out, out_lse, out_stats)
        fwd_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_len, block_table,
                    scale, window_left, window_right, softcap, alibi_slopes, num_splits,
                    return_lse) -> (out, lse or None)

    where dq is None unless need_dq and dk, dv are None unless need_dkdv (the binding
    neither computes nor allocates a gradient not wanted).

    ``aux`` is float32 ``lse.shape + (2,)`` for float32 inputs (here: lse, then a marker
    value, so the backward can tell that it got the forward's aux back unchanged) and
    ``(0,)`` otherwise."""

    AUX_MARK = 7.0

    def __init__(self):
        self.fwd_calls = 0
        self.bwd_calls = 0
        self.merge_calls = 0
        self.kvcache_calls = 0
        self.merge_dtypes = set()  # (a, b, out) of every merge
        self.last_bwd_dlse = "unset"
        self.last_bwd_needs = None  # (need_dq, need_dkdv) of the last bwd call
        self.last_fwd_args = None
        self.last_fwd_sinks = "unset"  # the sinks of the last fwd call

    @staticmethod
    def _check_common(q, k, v, scale, window_left, window_right, softcap, alibi_slopes,
                      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tier):
        """Returns True for the packed (varlen) layout."""
        assert type(scale) is float, type(scale)
        for w in (window_left, window_right):
            assert type(w) is int and w >= -1, w
        assert type(softcap) is float and softcap >= 0.0, softcap
        assert type(tier) is int and tier in (0, 1, 2), tier
        assert type(max_seqlen_q) is int and type(max_seqlen_k) is int
        varlen = cu_seqlens_q is not None
        assert (cu_seqlens_k is not None) == varlen, "cu_seqlens_q and cu_seqlens_k go together"
        for t in (q, k, v):
            assert t.dim() == (3 if varlen else 4) and t.stride(-1) == 1, (t.shape, t.stride())
        heads = q.shape[-2] if varlen else q.shape[1]
        if varlen:
            for cu in (cu_seqlens_q, cu_seqlens_k):
                assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous()
                assert cu.device == q.device and cu.shape[0] >= 2
            assert cu_seqlens_q.shape == cu_seqlens_k.shape
            assert max_seqlen_q > 0 and max_seqlen_k > 0, "empty grids reach the extension"
            assert q.shape[0] > 0 and k.shape[0] > 0, "empty sizes reach the extension"
            batch = cu_seqlens_q.shape[0] - 1
        else:
            assert max_seqlen_q == 0 and max_seqlen_k == 0
            assert q.shape[0] > 0 and q.shape[2] > 0 and k.shape[2] > 0, \
                "empty sizes reach the extension"
            batch = q.shape[0]
        if alibi_slopes is not None:
            assert alibi_slopes.dtype == torch.float32 and alibi_slopes.is_contiguous()
            assert alibi_slopes.device == q.device
            assert tuple(alibi_slopes.shape) in ((heads,), (batch, heads)), alibi_slopes.shape
        return varlen

    @staticmethod
    def _kwargs(scale, window_left, window_right, softcap, alibi_slopes):
        return dict(scale=scale, window_size=(window_left, window_right), softcap=softcap,
                    alibi_slopes=alibi_slopes, block_m=32, block_n=16)

    @staticmethod
    def _like(x, like):
        t = torch.empty_like(like)
        t.copy_(x)
        return t

    def _dropout_mask(self, q, k, dropout_p, rng_state, forward: bool, cu_seqlens=None):
        """The mask of a dropout call (dense; packed: one per sequence): the forward draws a
        seed from torch's CPU generator (so torch.manual_seed reproduces it) and records
        (seed, 0) in rng_state, as the kernels record theirs; the backward reads it back."""
        assert rng_state is not None and rng_state.dtype == torch.int64 and tuple(rng_state.shape) == (2,)
        if forward:
            rng_state.copy_(torch.tensor([int(torch.randint(0, 2 ** 62, (1,)).item()), 0]))
            self.last_rng = rng_state.clone()
        seed, offset = (int(x) for x in rng_state.tolist())
        if cu_seqlens is not None:
            return dropout_keep_masks_varlen(*cu_seqlens, q.shape[1], dropout_p, seed=seed, offset=offset,
                                             device=q.device)
        B, Hq, Sq, _ = q.shape
        return dropout_keep_mask(B, Hq, Sq, k.shape[2], dropout_p, seed=seed, offset=offset, device=q.device)

    def fwd(self, q, k, v, scale, window_left, window_right, softcap, alibi_slopes, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, tier, dropout_p=0.0, rng_state=None, sinks=None,
            sm_margin=0):
        args = (scale, window_left, window_right, softcap, alibi_slopes)
        varlen = self._check_common(q, k, v, *args, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, tier)
        if sinks is not None:  # the binding's checks (csrc/api/flash_api.cpp: check_sinks)
            assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.device == q.device
            assert tuple(sinks.shape) == (q.shape[1],), sinks.shape
        self.last_fwd_sinks = sinks
        assert isinstance(sm_margin, int) and sm_margin >= 0, sm_margin  # (the binding's check)
        self.fwd_calls += 1
        self.last_fwd_args = dict(scale=scale, window=(window_left, window_right),
                                  softcap=softcap, alibi_slopes=alibi_slopes, tier=tier,
                                  max_seqlen=(max_seqlen_q, max_seqlen_k), varlen=varlen)
        drop = {}
        if dropout_p:
            assert type(dropout_p) is float and 0 < dropout_p <= 1
            key = "dropout_masks" if varlen else "dropout_mask"
            drop = {"dropout_p": dropout_p, key: self._dropout_mask(
                q, k, dropout_p, rng_state, True, (cu_seqlens_q, cu_seqlens_k) if varlen else None)}
        if varlen:
            o, lse = attention_varlen_forward_blocked(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                      **self._kwargs(*args), **drop, sinks=sinks)
        else:
            o, lse = attention_forward_blocked(q, k, v, **self._kwargs(*args), **drop, sinks=sinks)
        lse = lse.to(torch.float32).contiguous()
        if q.dtype == torch.float32:
            aux = torch.stack((lse, torch.full_like(lse, self.AUX_MARK)), dim=-1)
        else:
            aux = torch.empty((0,), dtype=torch.float32, device=q.device)
        return self._like(o, q), lse, aux

    def bwd(self, dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap,
            alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic,
            tier, need_dq=True, need_dkdv=True, dropout_p=0.0, rng_state=None):
        args = (scale, window_left, window_right, softcap, alibi_slopes)
        varlen = self._check_common(q, k, v, *args, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, tier)
        assert type(deterministic) is bool
        assert type(need_dq) is bool and type(need_dkdv) is bool
        assert need_dq or need_dkdv, "a backward that wants no gradient reaches the extension"
        assert dout.shape == q.shape and dout.dtype == q.dtype and dout.stride(-1) == 1
        lse_shape = (q.shape[1], q.shape[0]) if varlen else tuple(q.shape[:3])
        assert lse.dtype == torch.float32 and tuple(lse.shape) == lse_shape
        assert aux.dtype == torch.float32
        if q.dtype == torch.float32:
            assert tuple(aux.shape) == lse_shape + (2,), aux.shape
            assert torch.equal(aux[..., 0], lse) and bool((aux[..., 1] == self.AUX_MARK).all()), \
                "aux does not come back unchanged"
        else:
            assert tuple(aux.shape) == (0,), aux.shape
        if dlse is not None:
            assert dlse.dtype == torch.float32 and tuple(dlse.shape) == lse_shape
            assert dlse.is_contiguous()
        self.bwd_calls += 1
        self.last_bwd_dlse = dlse
        self.last_bwd_needs = (need_dq, need_dkdv)
        drop = {}
        if dropout_p:
            key = "dropout_masks" if varlen else "dropout_mask"
            drop = {"dropout_p": dropout_p, key: self._dropout_mask(
                q, k, dropout_p, rng_state, False, (cu_seqlens_q, cu_seqlens_k) if varlen else None)}
        if varlen:
            grads = attention_varlen_backward_blocked(dout, q, k, v, out, lse, cu_seqlens_q,
                                                      cu_seqlens_k, dlse=dlse,
                                                      **self._kwargs(*args), **drop)
        else:
            grads = attention_backward_blocked(dout, q, k, v, out, lse, dlse=dlse,
                                               **self._kwargs(*args), **drop)
        wanted = (need_dq, need_dkdv, need_dkdv)
        return tuple(self._like(g, like) if w else None for g, like, w in zip(grads, (q, k, v), wanted))

    def fwd_kvcache(self, q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_len, block_table, scale,
                    window_left, window_right, softcap, alibi_slopes, num_splits, return_lse, sinks=None,
                    k_descale=None, v_descale=None):
        """The binding's contract on the KV-cache reference: k_new / v_new written into the
        caches in place, then the attention over each sequence's rows; lse only when asked. FP8
        caches (float8_e4m3fn, with both descales float32 (batch, kv_heads)) on the FP8 spec."""
        assert q.dim() == 4 and q.stride(-1) == 1 and q.dtype in (torch.float16, torch.bfloat16)
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        assert fp8 == (k_descale is not None) == (v_descale is not None), "descales go with FP8 caches"
        for c in (k_cache, v_cache):
            assert c.dim() == 4 and c.dtype == (torch.float8_e4m3fn if fp8 else q.dtype) and c.stride(-1) == 1
            assert c.device == q.device
        if fp8:
            for d in (k_descale, v_descale):
                assert d.dtype == torch.float32 and d.is_contiguous() and tuple(d.shape) == (q.shape[0],
                                                                                             k_cache.shape[1])
        assert (k_new is None) == (v_new is None), "k_new and v_new go together"
        assert type(cache_len) is int and cache_len >= 0
        if cache_seqlens is not None:
            assert cache_seqlens.dtype == torch.int32 and cache_seqlens.is_contiguous()
            assert tuple(cache_seqlens.shape) == (q.shape[0],) and cache_len == 0
        if block_table is not None:
            assert block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.stride(1) == 1
        assert type(scale) is float and type(softcap) is float
        assert type(window_left) is int and type(window_right) is int
        assert type(num_splits) is int and 0 <= num_splits <= 256 and type(return_lse) is bool
        if alibi_slopes is not None:
            assert alibi_slopes.dtype == torch.float32 and alibi_slopes.is_contiguous()
        if sinks is not None:  # the binding's checks (csrc/api/flash_api.cpp)
            assert sinks.dtype == torch.float32 and sinks.is_contiguous() and tuple(sinks.shape) == (q.shape[1],)
        self.last_kvcache_sinks = sinks
        self.kvcache_calls += 1
        if fp8:
            self.last_kvcache_descales = (k_descale, v_descale)
            out, lse = attention_with_kvcache_fp8_reference(
                q, k_cache, v_cache, k_new, v_new, k_descale=k_descale, v_descale=v_descale,
                cache_seqlens=cache_len if cache_seqlens is None else cache_seqlens, block_table=block_table,
                scale=scale, window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
                sinks=sinks, num_splits=max(num_splits, 1), return_lse=True, block_m=32, block_n=16)
            return self._like(out, q), (lse.to(torch.float32).contiguous() if return_lse else None)
        out, lse = attention_with_kvcache_reference(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_len if cache_seqlens is None else cache_seqlens,
            block_table=block_table, scale=scale, window_size=(window_left, window_right), softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, num_splits=max(num_splits, 1), return_lse=True, block_m=32,
            block_n=16)
        return self._like(out, q), (lse.to(torch.float32).contiguous() if return_lse else None)

    def merge_partials(self, a, a_lse, a_stats, b, b_lse, b_stats, out, out_lse, out_stats):
        """out (which may be a) = the merge of the partials a and b by their row statistics, in
        float32 or wider, out rounded once; (m, log2 l) pairs merged too where all three come."""
        assert a.dim() == 4 and a.shape == b.shape == out.shape, (a.shape, b.shape, out.shape)
        assert b.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64), b.dtype
        for x in (a, out):
            assert x.dtype in (b.dtype, torch.float32) and x.stride(-1) == 1
        for lse in (a_lse, b_lse, out_lse):
            assert lse.dtype == b_lse.dtype and lse.dtype in (torch.float32, torch.float64)
            assert tuple(lse.shape) == tuple(a.shape[:3]) and lse.stride(-1) == 1
        assert (a_stats is None) == (b_stats is None) == (out_stats is None)
        self.merge_calls += 1
        self.merge_dtypes.add((a.dtype, b.dtype, out.dtype))
        acc = torch.float64 if b.dtype == torch.float64 else torch.float32
        o, lse = combine_splits([a.to(acc), b.to(acc)], [a_lse.to(acc), b_lse.to(acc)], out.dtype)
        if a_stats is not None:
            pairs = torch.stack([a_stats, b_stats]).double()
            m_i = torch.where(pairs[..., 0] == math.inf, -math.inf, pairs[..., 0])
            m = m_i.amax(0)
            empty = m == -math.inf
            m_ref = torch.where(empty, 0.0, m)
            log2l = torch.log2(torch.exp2(m_i - m_ref + pairs[..., 1]).sum(0).clamp_min(1e-300))
            out_stats.copy_(torch.stack([torch.where(empty, math.inf, m), torch.where(empty, 0.0, log2l)], -1))
        out.copy_(o)
        out_lse.copy_(lse)


@pytest.fixture
def mock_extension(monkeypatch):
    """Makes flash_cuda run on CPU tensors through MockExtension; yields the mock."""
    mock = MockExtension()
    monkeypatch.setattr(_ext, "_C", SimpleNamespace(fwd=mock.fwd, bwd=mock.bwd, merge_partials=mock.merge_partials,
                                                    fwd_kvcache=mock.fwd_kvcache))
    monkeypatch.setattr(_ext, "_AVAILABLE", True)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", None)

    def same_device_only(q, k, v, prefix=validation.PREFIX):
        if not (q.device == k.device == v.device):
            raise RuntimeError(f"{prefix}q, k and v must be on the same device")

    monkeypatch.setattr(validation, "check_device", same_device_only)
    yield mock


@pytest.fixture
def mock_kvcache(mock_extension, monkeypatch):
    """mock_extension, and flash_cuda.attention_with_kvcache accepting CPU tensors (its
    CUDA-device check lifted) with no checked signature kept from before or for after the
    test (a CPU call's signature must not let a later call skip the device check)."""
    monkeypatch.setattr(kvcache_checks, "_check_device", lambda q, dev: None)
    monkeypatch.setattr(kvcache_checks, "plans", {})
    monkeypatch.setattr(kvcache_checks, "fp8_plans", {})
    yield mock_extension


@pytest.fixture
def no_extension(monkeypatch):
    """Makes flash_cuda behave as if the extension had not been built."""
    err = ModuleNotFoundError("No module named 'flash_cuda._C'", name="flash_cuda._C")
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", False)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", err)
    yield
