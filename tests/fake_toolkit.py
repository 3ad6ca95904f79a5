"""A stand-in CUDA toolkit for the tests of the build's toolkit checks: a directory with a
``bin/nvcc`` script that prints a chosen release and the headers torch's CUDA headers include."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Optional, Sequence

from flash_cuda import _build

ALL_HEADERS = tuple(_build.TOOLKIT_HEADERS)


def make_toolkit(root: Path, release: Optional[str] = "12.8", headers: Sequence[str] = ALL_HEADERS) -> Path:
    """A toolkit in ``root``: nvcc prints ``release`` (None: no bin/nvcc) and include/ has ``headers``."""
    root = Path(root)
    (root / "include").mkdir(parents=True, exist_ok=True)
    for h in headers:
        (root / "include" / h).write_text("#pragma once\n")
    if release is not None:
        (root / "bin").mkdir(exist_ok=True)
        nvcc = root / "bin" / "nvcc"
        nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                        f"echo 'Cuda compilation tools, release {release}, V{release}.0'\n")
        nvcc.chmod(0o755)
    return root


_SHARED = {}


def shared_toolkit(release: str = "12.8") -> str:
    """A complete toolkit of ``release``, made once per test process."""
    if release not in _SHARED:
        _SHARED[release] = str(make_toolkit(Path(tempfile.mkdtemp(prefix="fake-cuda-")), release))
    return _SHARED[release]
