"""Compiles flash_cuda's CUDA kernels ahead of time into the cache that their first use reads
(for images and CI), and prints where:

    python3 -m flash_cuda.build                        # see below for the architectures
    python3 -m flash_cuda.build --archs "80;90a"       # e.g. on a machine without a GPU
    FLASH_CUDA_CACHE_DIR=/opt/flash_cuda python3 -m flash_cuda.build

The architectures: --archs, else FLASH_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST, else the visible
GPUs, else 80 and 90a. A process that later finds a build whose architectures include those of
its GPUs loads it, with the same flash_cuda, torch and Python, and the same cache directory
(FLASH_CUDA_CACHE_DIR, else ~/.cache/flash_cuda); it needs neither nvcc nor ninja then.
Nothing is compiled when such a build is there already.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m flash_cuda.build",
        description="Compile flash_cuda's CUDA kernels into the cache that their first use reads.")
    parser.add_argument("--archs", help='GPU architectures, e.g. "80;90a" (default: FLASH_CUDA_ARCHS, '
                                        'TORCH_CUDA_ARCH_LIST, the visible GPUs, else "80;90a")')
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands and output")
    args = parser.parse_args(argv)
    if args.archs:
        os.environ["FLASH_CUDA_ARCHS"] = args.archs

    from . import _build, _ext

    try:
        archs = _build.cuda_archs()
        _, directory = _ext.compile_kernels(archs, verbose=args.verbose)
    except RuntimeError as exc:  # BuildError, or an architecture below 8.0
        print(exc, file=sys.stderr)
        return 1
    print(f"flash_cuda: kernels for {', '.join('sm_' + a for a in archs)} in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
