"""Loading of the compiled CUDA extension ``flash_cuda._C``.

``import flash_cuda`` must work on machines without the extension (CPU-only CI, a
checkout that was never built): the import is attempted once, here, and a failure is
remembered instead of raised. :func:`is_available` reports the outcome and
:func:`require` raises a RuntimeError that says how to build the extension.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch

_C: Optional[ModuleType]
_IMPORT_ERROR: Optional[BaseException]

try:  # pragma: no cover - which branch runs depends on the machine
    # import_module (not `from . import _C`) so that a missing extension raises
    # ModuleNotFoundError naming flash_cuda._C rather than a generic ImportError.
    _C = importlib.import_module(__package__ + "._C")

    _IMPORT_ERROR = None
except (ImportError, OSError) as exc:  # not built, or built against another torch
    _C = None
    _IMPORT_ERROR = exc

# A plain bool, so that torch.compile can read it while tracing flash_cuda.attention.
_AVAILABLE: bool = _C is not None

BUILD_HINT = (
    "Build it from the repository root with `pip install --no-build-isolation .` "
    "(needs nvcc from the CUDA toolkit and a CUDA build of PyTorch)."
)


def is_available() -> bool:
    """True when the compiled CUDA extension ``flash_cuda._C`` was imported."""
    return _AVAILABLE


def unavailable_message() -> str:
    """Explains why the extension is missing and how to build it."""
    err = _IMPORT_ERROR
    if isinstance(err, ModuleNotFoundError) and (err.name or "").endswith("_C"):
        reason = "the compiled extension flash_cuda._C is not built"
    elif err is not None:
        reason = f"the compiled extension flash_cuda._C failed to load ({type(err).__name__}: {err})"
    else:
        reason = "the compiled extension flash_cuda._C is not available"
    msg = f"flash_cuda: {reason}. {BUILD_HINT}"
    if torch.version.cuda is None:
        msg += f" The installed torch {torch.__version__} is a CPU-only build."
    return msg


def ablations() -> bool:
    """True when the extension was built with the ablation rungs of OPTIMIZATION.md
    (``FLASH_CUDA_ABLATIONS=1``), whose environment switches it then reads."""
    return _C is not None and bool(getattr(_C, "ablations", False))


def require() -> ModuleType:
    """Returns the extension module or raises RuntimeError with build instructions."""
    if _C is None:
        raise RuntimeError(unavailable_message())
    return _C
