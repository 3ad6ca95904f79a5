"""Build flash_cuda.

    python3 -m pip install .                        # kernels compile at first use
    python3 -m pip install --no-build-isolation .   # kernels compiled into the wheel

Which build, FLASH_CUDA_BUILD:
  unset ("auto")   when the build can import torch (pip's --no-build-isolation, with the torch
                   already installed), the kernels are compiled into the wheel (aot); when it
                   cannot (pip's default build isolation hides the installed torch), a
                   pure-Python wheel (jit)
  jit              a pure-Python wheel that carries the kernel sources (flash_cuda/_csrc): the
                   first call that needs the kernels compiles them for the visible GPUs with
                   torch.utils.cpp_extension into ~/.cache/flash_cuda (FLASH_CUDA_CACHE_DIR),
                   once per installation, against the torch it runs with (flash_cuda/_ext.py);
                   `python3 -m flash_cuda.build` does that ahead of time
  aot              flash_cuda._C compiled now against the torch this build imports (needs a CUDA
                   build of torch, nvcc and ninja; says what to install when one is missing).
                   Its wheel also carries the sources, compiled at first use should _C stop
                   loading (e.g. after an upgrade of torch).
Neither pulls in a second torch: pyproject.toml's build requirements have none, and the jit
wheel compiles against whichever torch is installed when it runs.

GPU architectures, in order of precedence (flash_cuda/_build.py holds their parsing, shared
with the build at first use):
  FLASH_CUDA_ARCHS="80;86;89;90a;100;120"   explicit list (90a = Hopper with wgmma/setmaxnreg;
                                            80 = A100, 86/89 = RTX 30/40, 120 = RTX 50, 100 = B200)
  TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"   read as torch reads it: names ("Ampere;Hopper"), "+PTX" (PTX
                                            for that target), entries below 8.0 left out with a warning
  otherwise the GPUs visible at build time; with none visible, "80;90a".
The build at first use reads FLASH_CUDA_ARCHS, else the visible GPUs (not TORCH_CUDA_ARCH_LIST).
sm_90 is always built as the sm_90a target. The newest target of the wheel also embeds PTX
(without the arch-specific "a" features), so that GPUs newer than every target can compile it
at load time; the Hopper-only kernels are inside the sm_90a feature guard and never run from
it. ninja compiles the kernel instances in parallel (MAX_JOBS limits it).

FLASH_CUDA_ABLATIONS=1 also builds the ablation rungs of OPTIMIZATION.md (the kernels each
optimization was measured against) and their environment switches (csrc/include/ablation.h);
production builds leave them out. FLASH_CUDA_PTXAS_VERBOSE=1 prints ptxas' register and
shared-memory use of every kernel (aot).
"""

import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_helpers():
    """flash_cuda/_build.py by its path: importing the package would import torch, which this
    build may not have."""
    path = os.path.join(ROOT, "flash_cuda", "_build.py")
    spec = importlib.util.spec_from_file_location("_flash_cuda_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


B = _load_build_helpers()

# Commands that compile the extension; the others (sdist, egg_info, dist_info: metadata and source
# archives) need neither torch nor nvcc.
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "bdist_egg", "install", "develop", "editable_wheel"}
BUILDING = any(arg in BUILD_COMMANDS for arg in sys.argv[1:])


def build_mode():
    """"aot" (kernels compiled into the wheel) or "jit" (sources in the wheel): FLASH_CUDA_BUILD,
    else aot exactly when torch can be imported."""
    mode = os.environ.get("FLASH_CUDA_BUILD", "").strip().lower() or "auto"
    if mode not in ("auto", "aot", "jit"):
        raise SystemExit(f"FLASH_CUDA_BUILD must be 'aot', 'jit' or unset (auto), got {mode!r}")
    if mode != "auto":
        return mode
    try:
        import torch  # noqa: F401
    except ImportError:  # pip's build isolation: compile at first use, against the installed torch
        return "jit"
    return "aot"


def check_build_environment():
    """What the ahead-of-time build needs, each with the message that says what to install."""
    problem = B.missing_tool()
    if problem is not None:
        raise SystemExit(problem)


def extensions():
    from torch.utils.cpp_extension import CUDAExtension

    sources = [f"csrc/{s}" for s in B.compiled_sources(os.path.join(ROOT, "csrc"))]
    flags = B.compile_flags(B.cuda_archs(), ptx=True,
                            ptxas_verbose=bool(os.environ.get("FLASH_CUDA_PTXAS_VERBOSE")))
    return [
        CUDAExtension(
            name="flash_cuda._C",
            sources=sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args=flags,
        )
    ]


class BuildPyWithKernelSources(build_py):
    """Also copies the kernel sources (csrc/, every file the compiler reads) into the package as
    flash_cuda/_csrc, which the build at first use compiles. An editable install reads csrc/ of
    the source tree instead."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            target = os.path.join(self.build_lib, "flash_cuda", "_csrc")
            if os.path.isdir(target):  # left by an earlier build: files since removed must go
                shutil.rmtree(target)
            for src, dst in self._kernel_files():
                self.mkpath(os.path.dirname(dst))
                self.copy_file(src, dst)

    def _kernel_files(self):
        csrc = os.path.join(ROOT, "csrc")
        target = os.path.join(self.build_lib, "flash_cuda", "_csrc")
        return [(os.path.join(csrc, rel), os.path.join(target, rel)) for rel in B.kernel_sources(csrc)]

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs += [dst for _, dst in self._kernel_files()]
        return outputs


def cmdclass(aot):
    commands = {"build_py": BuildPyWithKernelSources}
    if aot:
        from torch.utils.cpp_extension import BuildExtension

        commands["build_ext"] = BuildExtension.with_options(use_ninja=True)
    return commands


AOT = BUILDING and build_mode() == "aot"
if AOT:
    check_build_environment()


setup(
    name="flash_cuda",
    version="0.1.0",
    description="Hand-written CUDA FlashAttention (forward + backward) for PyTorch",
    packages=find_packages(include=["flash_cuda", "flash_cuda.*"]),
    ext_modules=extensions() if AOT else [],
    cmdclass=cmdclass(AOT),
    python_requires=">=3.9",
    # ninja: the build at first use compiles the kernel instances in parallel with it. torch: the
    # oldest release the test suite runs on (2.11 on GPUs; CI runs the newest, 2.14).
    install_requires=["torch>=2.11", "ninja"],
    extras_require={
        # `pip install .[test]`: what tests/ imports besides torch (transformers for the integration
        # tests; pandas, tqdm, matplotlib for the benchmark tools the tests run; a setuptools that
        # builds wheels itself, 70.1 or newer, for the packaging tests, which build in this
        # environment: a new venv of Python 3.11 has 65.5).
        "test": ["pytest", "numpy", "pandas", "tqdm", "matplotlib", "transformers>=4.48", "setuptools>=70.1"],
        # `pip install .[bench]`: what bench/ needs besides torch (triton, its timer, ships with
        # torch's Linux CUDA wheels).
        "bench": ["numpy", "pandas", "tqdm", "matplotlib", "transformers>=4.48"],
    },
    license="BSD-3-Clause",
    zip_safe=False,
)
