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

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

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


CUDA_HOME_NOWHERE = """flash_cuda's kernels are compiled with the CUDA toolkit in CUDA_HOME, which is {cuda_home}
(from {source}){what}. Set CUDA_HOME to the toolkit's directory, the one holding bin/nvcc and
include/ (e.g. /usr/local/cuda-{cuda}){candidates}, or install the CUDA toolkit {cuda}
(https://developer.nvidia.com/cuda-downloads)."""

NVCC_MISMATCH = """flash_cuda's kernels must be compiled by an nvcc of the CUDA major version this torch was built
with: this torch ({torch}) is built with CUDA {cuda}, and {nvcc} is CUDA {release}. Install the CUDA
toolkit {major}.x and set CUDA_HOME to it (e.g. /usr/local/cuda-{cuda}){candidates}, or install a
torch built for CUDA {release_major}.x (https://pytorch.org/get-started/locally/)."""

NVCC_TOO_OLD = """{nvcc} is CUDA {release}, which cannot compile for {targets}: that needs CUDA {needed} or
newer. Install a newer CUDA toolkit (of the major version torch is built with, {cuda}) and set
CUDA_HOME to it, or build for other GPUs (FLASH_CUDA_ARCHS)."""

MISSING_HEADERS = """The CUDA toolkit in {cuda_home} lacks {headers}, which torch's CUDA headers
include (ATen/cuda/CUDAContextLight.h, compiled into flash_cuda's binding). Install the toolkit's
development files for them: the full CUDA toolkit {release}, or the packages {packages} of
NVIDIA's repository; or put a directory holding them on CPATH.{found}"""

# The headers torch's ATen/cuda/CUDAContext.h (included by csrc/api/flash_api.cpp) includes from
# the CUDA toolkit, and the development package of NVIDIA's repositories that holds each.
TOOLKIT_HEADERS = {"cuda_runtime_api.h": "cuda-cudart-dev", "cusparse.h": "libcusparse-dev",
                   "cublas_v2.h": "libcublas-dev", "cublasLt.h": "libcublas-dev", "cusolverDn.h": "libcusolver-dev"}

# The first CUDA release whose nvcc compiles for each target that needs more than CUDA 11.8.
MIN_NVCC_FOR_ARCH = {"90a": (12, 0), "100": (12, 8), "120": (12, 8), "103": (12, 9), "121": (12, 9)}


def missing_tool(archs: Optional[Sequence[str]] = None) -> Optional[str]:
    """What the compiler toolchain lacks (torch, a CUDA build of it, nvcc of torch's CUDA major
    version, ninja), as the message that says what to install; None when nothing is missing.
    With ``archs``, also whether this nvcc compiles for them."""
    try:
        import torch
    except ImportError:
        return NO_TORCH
    if torch.version.cuda is None:
        return CPU_TORCH.format(version=torch.__version__)
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return NO_NVCC.format(cuda=torch.version.cuda)
    problem = toolkit_problem(cpp_extension.CUDA_HOME, torch.version.cuda, torch.__version__, archs)
    if problem is not None:
        return problem  # (missing headers are only named when a compile fails: header_problem)
    put_ninja_on_path()
    if not cpp_extension.is_ninja_available():
        return NO_NINJA
    return None


def cuda_home_source(cuda_home: str) -> str:
    """Where torch's builder took ``cuda_home`` from (it reads these in this order)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return f"${var}"
    nvcc = shutil.which("nvcc")
    if nvcc and os.path.dirname(os.path.dirname(nvcc)) == str(cuda_home):
        return f"the nvcc on PATH, {nvcc}"
    return "the default location"


def find_cuda_home() -> Optional[str]:
    """The CUDA toolkit directory as torch's builder finds it ($CUDA_HOME, $CUDA_PATH, the nvcc on
    PATH, /usr/local/cuda), without asking torch (whose answer is None in a CPU-only build)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(nvcc))
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda") else None


def nvcc_of(cuda_home: Optional[str]) -> Optional[str]:
    """CUDA_HOME/bin/nvcc when it exists, else None."""
    if not cuda_home:
        return None
    nvcc = os.path.join(cuda_home, "bin", "nvcc.exe" if sys.platform == "win32" else "nvcc")
    return nvcc if os.path.isfile(nvcc) else None


def nvcc_release(nvcc: str) -> Optional[str]:
    """The CUDA release of ``nvcc`` ("12.8"), from `nvcc --version`; None when it does not run."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return f"{found.group(1)}.{found.group(2)}" if found else None


def _version(text: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def _toolkit_candidates(cuda: str) -> List[str]:
    """Toolkit directories on this machine whose nvcc is of CUDA major version ``cuda``'s."""
    found = []
    for home in sorted(glob.glob("/usr/local/cuda*")) + sorted(glob.glob("/opt/cuda*")):
        nvcc = nvcc_of(home)
        release = nvcc_release(nvcc) if nvcc else None
        if release and _version(release)[0] == _version(cuda)[0] and os.path.realpath(home) not in {
                os.path.realpath(f) for f in found}:
            found.append(home)
    return found


def _candidates_text(cuda: str) -> str:
    found = _toolkit_candidates(cuda)
    return f"; this machine has {', '.join(found)}" if found else ""


def include_dirs(cuda_home: str) -> List[str]:
    """Where the compilers look for the toolkit's headers: CUDA_HOME/include (and its targets/),
    $CUDA_INC_PATH, $CPATH, $CPLUS_INCLUDE_PATH, $C_INCLUDE_PATH and the system's directories."""
    dirs = [os.path.join(cuda_home, "include")] + sorted(glob.glob(os.path.join(cuda_home, "targets", "*", "include")))
    for var in ("CUDA_INC_PATH", "CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"):
        dirs += [d for d in os.environ.get(var, "").split(os.pathsep) if d]
    return dirs + ["/usr/include", "/usr/local/include"]


def missing_headers(cuda_home: str) -> List[str]:
    """The toolkit headers torch's CUDA headers include that no include directory holds."""
    dirs = include_dirs(cuda_home)
    return [h for h in TOOLKIT_HEADERS if not any(os.path.isfile(os.path.join(d, h)) for d in dirs)]


def _pip_header_dirs(headers: Sequence[str]) -> List[str]:
    """Directories of NVIDIA's pip packages (nvidia/*/include, installed with torch) that hold
    some of ``headers``."""
    found = []
    for entry in sys.path:
        for d in sorted(glob.glob(os.path.join(entry or ".", "nvidia", "*", "include"))):
            if d not in found and any(os.path.isfile(os.path.join(d, h)) for h in headers):
                found.append(d)
    return found


def toolkit_problem(cuda_home: str, cuda: str, torch_version: str,
                    archs: Optional[Sequence[str]] = None) -> Optional[str]:
    """What the CUDA toolkit in ``cuda_home`` lacks for a build against torch's CUDA ``cuda`` (a
    directory that is no toolkit, an nvcc of another major version, or too old for ``archs``), as
    the message that says what to do; None when nothing. These fail every build: they are
    checked before one starts. The headers (:func:`header_problem`) are searched where the
    compilers usually look, which may miss a place they are told of; they are named when a
    compile fails."""
    source = cuda_home_source(cuda_home)
    if not os.path.isdir(cuda_home):
        return CUDA_HOME_NOWHERE.format(cuda_home=cuda_home, source=source, what=", which does not exist",
                                        cuda=cuda, candidates=_candidates_text(cuda))
    nvcc = nvcc_of(cuda_home)
    if nvcc is None:
        return CUDA_HOME_NOWHERE.format(cuda_home=cuda_home, source=source, what=", which has no bin/nvcc",
                                        cuda=cuda, candidates=_candidates_text(cuda))
    release = nvcc_release(nvcc)
    if release is None:
        return CUDA_HOME_NOWHERE.format(cuda_home=cuda_home, source=source,
                                        what=f"; its {nvcc} does not run or print its release", cuda=cuda,
                                        candidates=_candidates_text(cuda))
    if _version(release)[0] != _version(cuda)[0]:
        return NVCC_MISMATCH.format(torch=torch_version, cuda=cuda, nvcc=nvcc, release=release,
                                    major=_version(cuda)[0], release_major=_version(release)[0],
                                    candidates=_candidates_text(cuda))
    too_new = [a for a in archs or () if _version(release) < MIN_NVCC_FOR_ARCH.get(a, (0, 0))]
    if too_new:
        needed = max(MIN_NVCC_FOR_ARCH[a] for a in too_new)
        return NVCC_TOO_OLD.format(nvcc=nvcc, release=release, targets=", ".join(f"sm_{a}" for a in too_new),
                                   needed=".".join(map(str, needed)), cuda=cuda)
    return None


def header_problem(cuda_home: Optional[str]) -> Optional[str]:
    """The toolkit headers torch's CUDA headers include that none of :func:`include_dirs` holds,
    as the message that says what to install; None when all are found (or no toolkit)."""
    missing = missing_headers(cuda_home) if cuda_home else []
    if not missing:
        return None
    nvcc = nvcc_of(cuda_home)
    release = nvcc_release(nvcc) if nvcc else None
    suffix = "-" + release.replace(".", "-") if release else "-<major>-<minor>"
    packages = sorted({TOOLKIT_HEADERS[h] + suffix for h in missing})
    pip_dirs = _pip_header_dirs(missing)
    found = (f" NVIDIA's pip packages have some of them in {os.pathsep.join(pip_dirs)}: "
             f"`export CPATH={os.pathsep.join(pip_dirs)}` adds them." if pip_dirs else "")
    return MISSING_HEADERS.format(cuda_home=cuda_home, headers=", ".join(missing),
                                  release=release or "of torch's CUDA version", packages=", ".join(packages),
                                  found=found)


def compile_error_hint(text: str, cuda_home: Optional[str] = None) -> Optional[str]:
    """The cause and fix of a failed compilation that its output shows (a missing toolkit
    header, with :func:`header_problem`'s message for the toolkit in ``cuda_home``; an nvcc too
    old for a target; a host compiler nvcc does not support), or None."""
    header = re.search(r"fatal error: ([\w./+-]+\.h(?:pp)?): No such file", text)
    if header:
        name = os.path.basename(header.group(1))
        problem = header_problem(cuda_home) if name in TOOLKIT_HEADERS else None
        if problem:
            return problem
        package = TOOLKIT_HEADERS.get(name)
        where = (f" (the CUDA toolkit's {package} development files)" if package else "")
        return (f"The compiler did not find {header.group(1)}{where}: install it, or put a directory "
                f"that holds it on CPATH.")
    arch = re.search(r"Unsupported gpu architecture '(compute|sm)_(\w+)'", text)
    if arch:
        return (f"This nvcc cannot compile for sm_{arch.group(2)}: install a newer CUDA toolkit (of torch's "
                f"major version) and set CUDA_HOME to it, or build for other GPUs (FLASH_CUDA_ARCHS).")
    if re.search(r"unsupported (GNU|clang) version", text):
        return ("nvcc does not support this host compiler version: install one this CUDA release supports "
                "and point nvcc at it, e.g. NVCC_PREPEND_FLAGS='-ccbin /usr/bin/g++-12'.")
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


def namespace_requested() -> Optional[str]:
    """FLASH_CUDA_NAMESPACE=NAME compiles the kernels and the binding in namespace NAME instead of
    flash_cuda (the preprocessor renames the namespace: every kernel's symbol and name changes,
    nothing else) and names its module flash_cuda_kernels_NAME (_ext.jit_module_name). pybind11
    keeps one module per name in a process, so a second build of the same name loaded beside the
    first would hand out the first one's functions; bench/ab_builds.py --one-process gives each
    build a name of its own, and the kernel names show which build a call ran."""
    name = os.environ.get("FLASH_CUDA_NAMESPACE", "")
    if not name or name == "flash_cuda":
        return None
    if not name.isidentifier() or not name.isascii():
        raise ValueError(f"FLASH_CUDA_NAMESPACE={name!r}: expected a C++ identifier such as flash_cuda_ab_base")
    return name


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
    namespace = namespace_requested()
    if namespace is not None:
        nvcc.append(f"-Dflash_cuda={namespace}")
        cxx.append(f"-Dflash_cuda={namespace}")
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
