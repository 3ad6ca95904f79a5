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
  instead, so the GPU tests do not skip for a missing extension; the report header says
  which copy is tested.
"""

from __future__ import annotations

import importlib.util
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
from flash_cuda import _ext, interface  # noqa: E402
from flash_cuda.reference import attention_backward_blocked, attention_forward_blocked  # noqa: E402

from attn_check import gpu_skip_reason  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs an sm_80+ NVIDIA GPU and the compiled flash_cuda extension")
    config.addinivalue_line(
        "markers", "slow: long GPU tests (2^31-element tensors, S=65536, the fuzz run); "
        "deselect with -m 'not slow'")


def pytest_report_header(config):
    reason = gpu_skip_reason()
    return [
        f"flash_cuda: {Path(flash_cuda.__file__).parent} (extension "
        f"{'loaded' if flash_cuda.is_available() else 'not loaded'})",
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
    reference, and asserts that the Python layer calls it as the binding expects."""

    def __init__(self):
        self.fwd_calls = 0
        self.bwd_calls = 0
        self.last_bwd_dlse = "unset"

    @staticmethod
    def _check_common(q, k, v, scale, is_causal, tier):
        assert type(scale) is float, type(scale)
        assert type(is_causal) is bool, type(is_causal)
        assert type(tier) is int and tier in (0, 1, 2), tier
        for t in (q, k, v):
            assert t.dim() == 4 and t.stride(-1) == 1
        assert q.shape[0] > 0 and q.shape[2] > 0 and k.shape[2] > 0, "empty sizes reach the extension"

    def fwd(self, q, k, v, scale, is_causal, tier):
        self._check_common(q, k, v, scale, is_causal, tier)
        self.fwd_calls += 1
        o, lse = attention_forward_blocked(q, k, v, is_causal=is_causal, scale=scale,
                                           block_m=32, block_n=16)
        out = torch.empty_like(q)
        out.copy_(o)
        return out, lse.to(torch.float32).contiguous()

    def bwd(self, dout, q, k, v, out, lse, dlse, scale, is_causal, deterministic, tier):
        self._check_common(q, k, v, scale, is_causal, tier)
        assert type(deterministic) is bool
        assert dout.shape == q.shape and dout.dtype == q.dtype and dout.stride(-1) == 1
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
        if dlse is not None:
            assert dlse.dtype == torch.float32 and dlse.shape == q.shape[:3] and dlse.is_contiguous()
        self.bwd_calls += 1
        self.last_bwd_dlse = dlse
        dq, dk, dv = attention_backward_blocked(dout, q, k, v, out, lse, is_causal=is_causal,
                                                scale=scale, dlse=dlse, block_m=32, block_n=16)
        res = []
        for g, like in ((dq, q), (dk, k), (dv, v)):
            t = torch.empty_like(like)
            t.copy_(g)
            res.append(t)
        return tuple(res)


@pytest.fixture
def mock_extension(monkeypatch):
    """Makes flash_cuda run on CPU tensors through MockExtension; yields the mock."""
    mock = MockExtension()
    monkeypatch.setattr(_ext, "_C", SimpleNamespace(fwd=mock.fwd, bwd=mock.bwd))
    monkeypatch.setattr(_ext, "_AVAILABLE", True)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", None)

    def same_device_only(q, k, v):
        if not (q.device == k.device == v.device):
            raise RuntimeError("flash_cuda.attention: q, k and v must be on the same device")

    monkeypatch.setattr(interface, "_check_device", same_device_only)
    yield mock


@pytest.fixture
def no_extension(monkeypatch):
    """Makes flash_cuda behave as if the extension had not been built."""
    err = ModuleNotFoundError("No module named 'flash_cuda._C'", name="flash_cuda._C")
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", False)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", err)
    yield
