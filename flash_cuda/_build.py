"""How flash_cuda's CUDA kernels are compiled: the GPU architectures, the compiler flags, the
kernel sources, the cache of builds made at first use, and the messages that say what a build
lacks. One definition for both builds: setup.py (kernels compiled into the wheel) and
flash_cuda._ext (kernels compiled at first use).

setup.py loads this file by its path, in a build that may have no torch: nothing here imports
torch or the rest of flash_cuda at module level.

GPU architectures, in order of precedence:
  FLASH_CUDA_ARCHS="80;86;89;90a;100;120"   explicit list (90a = Hopper with wgmma/setmaxnreg;
                                            80 = A100, 86/89 = RTX 30/40, 120 = RTX 50, 100 = B200)
  TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX"        read as torch reads it: names ("Ampere;Hopper"),
                                            "+PTX", entries below 8.0 left out with a warning
                                            (builds ahead of time only, see cuda_archs)
  otherwise the GPUs visible at build time.
sm_90 is always built as the sm_90a target.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence

MIN_ARCH = 80

# What `pip install .` copies into the wheel (flash_cuda/_csrc) and what the cache key hashes:
# every file the compiler reads. The instance generators (*.py) are not needed to compile.
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")

# TORCH_CUDA_ARCH_LIST's named architectures, as torch.utils.cpp_extension reads them (combined
# names before their parts).
NAMED_ARCHES = [
    ("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"),
]

NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "-lineinfo",  # source lines in Nsight Compute, no runtime cost
    "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]
# The binding (api/flash_api.cpp, the one file that includes torch's headers) is compiled in the C++
# standard torch's cpp_extension picks for the installed torch (C++20 for recent ones), the one
# its headers were written for; the kernels include no torch header and keep C++17.
CXX_FLAGS = ["-O3"]

# ---------------------------------------------------------------------------------------
# What a build lacks, each with what to install
# ---------------------------------------------------------------------------------------

NO_TORCH = """FLASH_CUDA_BUILD=aot compiles flash_cuda's kernels into the wheel against the PyTorch you
already have installed, but this build cannot import torch. If torch is installed, pip's build
isolation hid it: install with

    python3 -m pip install --no-build-isolation .

(and `python3 -m pip install ninja` first if ninja is missing). Without FLASH_CUDA_BUILD=aot,
`pip install .` installs the kernel sources instead, which compile at first use. If torch is not
installed, install a CUDA build of PyTorch first (https://pytorch.org/get-started/locally/)."""

CPU_TORCH = """flash_cuda needs a CUDA build of PyTorch; this torch ({version}) is CPU-only. Install a CUDA
wheel of torch (https://pytorch.org/get-started/locally/, e.g. `pip install torch --index-url
https://download.pytorch.org/whl/cu128`), then try again."""

NO_NVCC = """flash_cuda's kernels are compiled with nvcc from the CUDA toolkit ({cuda} for this torch), which
was not found: install the toolkit (https://developer.nvidia.com/cuda-downloads) and set CUDA_HOME
(or put nvcc on PATH)."""

NO_NINJA = """flash_cuda's build uses ninja to compile its kernel instances in parallel, and ninja was not
found: `python3 -m pip install ninja`, then try again."""

NO_GPU = """flash_cuda compiles its kernels at first use for the GPUs it sees, and torch sees none
(torch.cuda.is_available() is False: no NVIDIA GPU, a driver older than this torch's CUDA, or
CUDA_VISIBLE_DEVICES hides them). flash_cuda runs on GPUs of compute capability 8.0 or newer;
to compile for them on a machine without one, set FLASH_CUDA_ARCHS (e.g. "80;90a") and run
`python3 -m flash_cuda.build`."""

NO_SOURCES = """flash_cuda's kernels are neither built into this installation (flash_cuda._C) nor
installed as sources to compile at first use: reinstall flash_cuda with `python3 -m pip install .`
from its source tree. (Looked for the sources in {places}.)"""


def missing_tool() -> Optional[str]:
    """What the compiler toolchain lacks (torch, a CUDA build of it, nvcc, ninja), as the message
    that says what to install; None when nothing is missing."""
    try:
        import torch
    except ImportError:
        return NO_TORCH
    if torch.version.cuda is None:
        return CPU_TORCH.format(version=torch.__version__)
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return NO_NVCC.format(cuda=torch.version.cuda)
    put_ninja_on_path()
    if not cpp_extension.is_ninja_available():
        return NO_NINJA
    return None


def put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH. The ninja package (a requirement of flash_cuda)
    installs it next to the interpreter, which is not on PATH when a virtual environment's
    python runs without the environment activated: add that directory."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # the PyPI package: BIN_DIR is where its command was installed
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", "")
    if bin_dir and shutil.which("ninja", path=bin_dir):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


# ---------------------------------------------------------------------------------------
# GPU architectures
# ---------------------------------------------------------------------------------------


def _normalise(arch: str) -> str:
    arch = arch.strip().lower().replace("sm_", "").replace("+ptx", "")
    if "." in arch:
        major, minor = arch.split(".", 1)
        arch = major + minor
    if arch in ("90", "90a"):
        return "90a"
    return arch


def _entries(torch_list: bool = True):
    """[(arch, wants_ptx)] of the environment's list and which variable it came from (None: no
    variable read is set). TORCH_CUDA_ARCH_LIST takes torch's names and "+PTX" markers."""
    own = os.environ.get("FLASH_CUDA_ARCHS")
    if own:
        env, source = own, "FLASH_CUDA_ARCHS"
    elif torch_list:
        env, source = os.environ.get("TORCH_CUDA_ARCH_LIST"), "TORCH_CUDA_ARCH_LIST"
    else:
        return [], None
    if not env or env.strip() == "native":
        return [], None
    if source == "TORCH_CUDA_ARCH_LIST":
        for name, value in NAMED_ARCHES:
            env = env.replace(name, value)
    items = [a for a in env.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    return [(_normalise(a), a.strip().lower().endswith("+ptx")) for a in items], source


def _number(arch: str) -> int:
    return int(arch.rstrip("a"))


def visible_archs() -> List[str]:
    """The targets of the GPUs torch sees ([] with no GPU or no driver)."""
    try:
        import torch

        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    except Exception:  # no driver, or no torch at build time
        return []
    return [_normalise(f"{major}{minor}") for major, minor in sorted(caps)]


def cuda_archs(first_use: bool = False) -> List[str]:
    """The targets to build, sorted. Ahead of time (setup.py, `python3 -m flash_cuda.build`):
    FLASH_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST, else the visible GPUs, else 80 and 90a.
    At first use (``first_use``): FLASH_CUDA_ARCHS, else the visible GPUs (NO_GPU without one).
    TORCH_CUDA_ARCH_LIST is left to the builds ahead of time: containers set it for every GPU
    they may meet, and a build at first use should cost the time of the GPUs at hand.
    Raises RuntimeError for a target below compute capability 8.0 or an unknown name."""
    entries, source = _entries(torch_list=not first_use)
    archs = [a for a, _ in entries]
    if source is None:
        archs = visible_archs()
        if not archs:
            if first_use:
                raise RuntimeError(NO_GPU)
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


def ptx_archs(archs: Sequence[str]) -> List[str]:
    """The targets that also embed PTX in a wheel: TORCH_CUDA_ARCH_LIST's "+PTX" entries where it
    has any, else the newest target (so that GPUs newer than every target can compile it at
    load time). PTX of an "a" target would run on that GPU only: it is embedded without the "a"
    features (the Hopper-only kernels are inside the sm_90a feature guard and never run from it)."""
    entries, source = _entries()
    marked = sorted({a.rstrip("a") for a, ptx in entries if ptx and a in archs}, key=int)
    if source == "TORCH_CUDA_ARCH_LIST" and marked:
        return marked
    return [max(archs, key=_number).rstrip("a")]


def gencode_flags(archs: Sequence[str], ptx: bool = True) -> List[str]:
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if ptx:
        flags += [f"-gencode=arch=compute_{a},code=compute_{a}" for a in ptx_archs(archs)]
    return flags


# ---------------------------------------------------------------------------------------
# Flags and sources
# ---------------------------------------------------------------------------------------


def ablations_requested() -> bool:
    """FLASH_CUDA_ABLATIONS=1 also builds the ablation rungs of OPTIMIZATION.md (the kernels each
    optimization was measured against) and their environment switches (csrc/include/ablation.h)."""
    return os.environ.get("FLASH_CUDA_ABLATIONS", "0") not in ("", "0")


def compile_flags(archs: Optional[Sequence[str]], ptx: bool = True,
                  ptxas_verbose: bool = False) -> Dict[str, List[str]]:
    """{"cxx": host compiler flags, "nvcc": nvcc flags}; archs None leaves out the -gencode flags."""
    nvcc = list(NVCC_FLAGS)
    cxx = list(CXX_FLAGS)
    if archs is not None:
        nvcc += gencode_flags(archs, ptx)
    if ptxas_verbose:
        nvcc.append("-Xptxas=-v")
    if ablations_requested():
        nvcc.append("-DFLASH_CUDA_ABLATIONS")
        cxx.append("-DFLASH_CUDA_ABLATIONS")
    return {"cxx": cxx, "nvcc": nvcc}


def kernel_sources(csrc: Path) -> List[str]:
    """Every file of the kernel source tree the compiler may read, as sorted relative paths."""
    csrc = Path(csrc)
    return sorted(p.relative_to(csrc).as_posix() for p in csrc.rglob("*")
                  if p.suffix in SOURCE_SUFFIXES and p.is_file())


def compiled_sources(csrc: Path) -> List[str]:
    """The translation units: the binding and one file per kernel instance (relative paths)."""
    instances = sorted(p.name for p in (Path(csrc) / "instances").glob("*.cu"))
    return ["api/flash_api.cpp"] + [f"instances/{name}" for name in instances]


def source_digest(csrc: Path) -> str:
    h = hashlib.sha256()
    for rel in kernel_sources(csrc):
        h.update(rel.encode() + b"\0")
        h.update((Path(csrc) / rel).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------------------------------
# The cache of builds made at first use
# ---------------------------------------------------------------------------------------


def cache_root() -> Path:
    """$FLASH_CUDA_CACHE_DIR, else $XDG_CACHE_HOME/flash_cuda, else ~/.cache/flash_cuda."""
    own = os.environ.get("FLASH_CUDA_CACHE_DIR")
    if own:
        return Path(own).expanduser().absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flash_cuda"


def build_name(version: str, digest: str, torch_version: str, cuda_version: Optional[str],
               flags: Dict[str, List[str]]) -> str:
    """The cache directory of every build of these sources for this torch: what makes two builds
    differ except their GPU architectures (each set of those is a subdirectory, arch_tag).
    The Python ABI is part of it because the module is a CPython extension."""
    parts = [version, digest, torch_version, str(cuda_version), sys.implementation.cache_tag,
             " ".join(flags["cxx"]), " ".join(flags["nvcc"])]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return f"{version}-torch{torch_version}-{key}"


def arch_tag(archs: Sequence[str]) -> str:
    return "-".join(f"sm_{a}" for a in archs)
