"""Build flash_cuda: `pip install --no-build-isolation .` (needs nvcc and a CUDA build of torch).

GPU architectures, in order of precedence:
  FLASH_CUDA_ARCHS="80;86;89;90a;100;120"   explicit list (90a = Hopper with wgmma/setmaxnreg;
                                            80 = A100, 86/89 = RTX 30/40, 120 = RTX 50, 100 = B200)
  TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"   read as torch reads it: names ("Ampere;Hopper"), "+PTX" (PTX
                                            for that target), entries below 8.0 left out with a warning
  otherwise the GPUs visible at build time; with none visible, "80;90a".
sm_90 is always built as the sm_90a target. The newest target also embeds PTX (without the
arch-specific "a" features), so that GPUs newer than every target can compile it at load time;
the Hopper-only kernels are inside the sm_90a feature guard and never run from it. ninja
compiles the kernel instances in parallel (MAX_JOBS limits it).

FLASH_CUDA_ABLATIONS=1 also builds the ablation rungs of OPTIMIZATION.md (the kernels each
optimization was measured against) and their environment switches (csrc/include/ablation.h);
production builds leave them out.
"""

import glob
import os
import sys
import warnings

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
MIN_ARCH = 80

# TORCH_CUDA_ARCH_LIST's named architectures, as torch.utils.cpp_extension reads them (combined
# names before their parts).
NAMED_ARCHES = [
    ("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
]


def _normalise(arch: str) -> str:
    arch = arch.strip().lower().replace("sm_", "").replace("+ptx", "")
    if "." in arch:
        major, minor = arch.split(".", 1)
        arch = major + minor
    if arch in ("90", "90a"):
        return "90a"
    return arch


def _entries():
    """[(arch, wants_ptx)] of the environment's list and which variable it came from (None: neither
    is set). TORCH_CUDA_ARCH_LIST takes torch's names and "+PTX" markers."""
    own = os.environ.get("FLASH_CUDA_ARCHS")
    env, source = (own, "FLASH_CUDA_ARCHS") if own else (os.environ.get("TORCH_CUDA_ARCH_LIST"), "TORCH_CUDA_ARCH_LIST")
    if not env or env.strip() == "native":
        return [], None
    if source == "TORCH_CUDA_ARCH_LIST":
        for name, value in NAMED_ARCHES:
            env = env.replace(name, value)
    items = [a for a in env.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    return [(_normalise(a), a.strip().lower().endswith("+ptx")) for a in items], source


def _number(arch: str) -> int:
    return int(arch.rstrip("a"))


def cuda_archs():
    entries, source = _entries()
    archs = [a for a, _ in entries]
    if source is None:
        try:
            import torch

            for i in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(i)
                archs.append(_normalise(f"{major}{minor}"))
        except Exception:  # no driver at build time
            archs = []
        if not archs:
            archs = ["80", "90a"]
    bad = [a for a in archs if not a.rstrip("a").isdigit()]
    old = [a for a in archs if a not in bad and _number(a) < MIN_ARCH]
    if source == "TORCH_CUDA_ARCH_LIST" and old and not bad:
        # A list written for every GPU a container may meet: build the ones flash_cuda supports.
        warnings.warn(f"flash_cuda needs compute capability 8.0 or newer: TORCH_CUDA_ARCH_LIST's {old} are left out")
        archs = [a for a in archs if a not in old]
        old = []
    if bad or old or not archs:
        raise RuntimeError(f"flash_cuda needs compute capability 8.0 or newer; cannot build for {bad + old or archs} "
                           f"({source or 'the visible GPUs'})")
    return sorted(set(archs), key=lambda a: (len(a.rstrip("a")), a))


def ptx_archs(archs):
    """The targets that also embed PTX: TORCH_CUDA_ARCH_LIST's "+PTX" entries where it has any, else
    the newest target (so that GPUs newer than every target can compile it at load time). PTX of an
    "a" target would run on that GPU only: it is embedded without the "a" features."""
    entries, source = _entries()
    marked = sorted({a.rstrip("a") for a, ptx in entries if ptx and a in archs}, key=int)
    if source == "TORCH_CUDA_ARCH_LIST" and marked:
        return marked
    return [max(archs, key=_number).rstrip("a")]


def gencode_flags(archs):
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    flags += [f"-gencode=arch=compute_{a},code=compute_{a}" for a in ptx_archs(archs)]
    return flags


# Commands that compile the extension; the others (sdist, egg_info, dist_info: metadata and source
# archives) need neither torch nor nvcc.
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "bdist_egg", "install", "develop", "editable_wheel"}
BUILDING = any(arg in BUILD_COMMANDS for arg in sys.argv[1:])

NO_TORCH = """flash_cuda compiles against the PyTorch you already have installed, but this build cannot import
torch. If torch is installed, pip's build isolation hid it: install with

    python3 -m pip install --no-build-isolation .

(and `python3 -m pip install ninja` first if ninja is missing). Otherwise install a CUDA build of
PyTorch first (https://pytorch.org/get-started/locally/)."""

CPU_TORCH = """flash_cuda needs a CUDA build of PyTorch; this torch ({version}) is CPU-only. Install a CUDA
wheel of torch (https://pytorch.org/get-started/locally/, e.g. `pip install torch --index-url
https://download.pytorch.org/whl/cu128`), then build again."""

NO_NVCC = """flash_cuda's kernels are compiled with nvcc from the CUDA toolkit ({cuda} for this torch), which
was not found: install the toolkit (https://developer.nvidia.com/cuda-downloads) and set CUDA_HOME
(or put nvcc on PATH)."""

NO_NINJA = """flash_cuda's build uses ninja to compile its kernel instances in parallel, and ninja was not
found: `python3 -m pip install ninja`, then build again."""


def check_build_environment():
    """What a build needs, each with the message that says what to install."""
    try:
        import torch
    except ImportError:
        raise SystemExit(NO_TORCH)
    if torch.version.cuda is None:
        raise SystemExit(CPU_TORCH.format(version=torch.__version__))
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise SystemExit(NO_NVCC.format(cuda=torch.version.cuda))
    if not cpp_extension.is_ninja_available():
        raise SystemExit(NO_NINJA)


def extensions():
    from torch.utils.cpp_extension import CUDAExtension

    sources = ["csrc/api/flash_api.cpp"] + sorted(glob.glob("csrc/instances/*.cu"))
    nvcc_flags = [
        "-O3",
        "-std=c++17",
        "-lineinfo",  # source lines in Nsight Compute, no runtime cost
        "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ] + gencode_flags(cuda_archs())
    if os.environ.get("FLASH_CUDA_PTXAS_VERBOSE"):
        nvcc_flags.append("-Xptxas=-v")
    cxx_flags = ["-O3", "-std=c++17"]
    if os.environ.get("FLASH_CUDA_ABLATIONS", "0") not in ("", "0"):
        nvcc_flags.append("-DFLASH_CUDA_ABLATIONS")
        cxx_flags.append("-DFLASH_CUDA_ABLATIONS")
    return [
        CUDAExtension(
            name="flash_cuda._C",
            sources=sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        )
    ]


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


if BUILDING:
    check_build_environment()


setup(
    name="flash_cuda",
    version="0.1.0",
    description="Hand-written CUDA FlashAttention (forward + backward) for PyTorch",
    packages=find_packages(include=["flash_cuda", "flash_cuda.*"]),
    ext_modules=extensions() if BUILDING else [],
    cmdclass=cmdclass() if BUILDING else {},
    python_requires=">=3.9",
    install_requires=["torch>=2.4"],
    license="BSD-3-Clause",
    zip_safe=False,
)
