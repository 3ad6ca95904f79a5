"""Loading of flash_cuda's CUDA kernels.

They come from, in order:

1. ``flash_cuda._C``, compiled into the wheel (``pip install --no-build-isolation .``);
2. otherwise a build at first use. ``pip install .`` installs the kernel sources
   (``flash_cuda/_csrc``; a source checkout has them in ``csrc/``), and the first call that
   needs the kernels compiles them with ``torch.utils.cpp_extension.load`` (ninja, MAX_JOBS
   parallel jobs), with setup.py's flags (:mod:`flash_cuda._build`), into a cache:
   ``$FLASH_CUDA_CACHE_DIR``, else ``~/.cache/flash_cuda``. Its directory is keyed by what
   makes two builds differ (flash_cuda's version, a hash of the sources, torch's version and
   CUDA version, the Python ABI, the flags); below it, one build per set of GPU architectures,
   by default those of the visible GPUs (``FLASH_CUDA_ARCHS`` names others). A later process
   loads a cached build whose architectures cover its GPUs, without nvcc or ninja;
   ``python3 -m flash_cuda.build`` fills the cache ahead of time.

``import flash_cuda`` only tries 1., so it is fast and never compiles. The first call of
:func:`is_available` or :func:`require` (e.g. the first attention call) does the rest, once
per process, and prints one line when it compiles. Processes that start at once build once:
torch's builder holds a lock file (``lock``) in the build directory while it compiles, and the
others wait for it (before torch 2.14 a build killed midway leaves the file behind and later
builds wait for it: delete it; from 2.14 the lock is released with its holder).

:func:`is_available` is exact: True once the kernels are loaded, False when they cannot be, with
the reason (what to install) in :func:`unavailable_reason` (``flash_cuda.unavailable_reason()``),
:func:`unavailable_message` and the RuntimeError of :func:`require`: a CPU-only torch, no GPU,
nvcc or ninja missing for a build, CUDA_HOME that is no toolkit, an nvcc of another CUDA major
version than torch's or too old for a GPU (checked before compiling), a failed build (with the
cause and its fix where the compiler's output shows a known one, such as a toolkit header that
torch's headers include). :func:`load_info` says where loaded kernels came from.
A failure is not retried in the same process. Once decided it reads a plain bool, which
torch.compile traces as a constant; while torch.compile traces a function that calls it before
anything decided, it answers True and leaves the loading to the ops' first run (:func:`require`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Sequence, Tuple

import torch

from . import _build

_C: Optional[ModuleType] = None
# Why the kernels are not loaded: the prebuilt extension's import error until a build at first
# use was tried, then that build's BuildError (None once loaded).
_IMPORT_ERROR: Optional[BaseException] = None

try:  # pragma: no cover - which branch runs depends on the machine
    # import_module (not `from . import _C`) so that a missing extension raises
    # ModuleNotFoundError naming flash_cuda._C rather than a generic ImportError.
    _C = importlib.import_module(__package__ + "._C")
except (ImportError, OSError) as exc:  # not built into this installation, or built against another torch
    _IMPORT_ERROR = exc

# True: loaded; False: cannot be (see _IMPORT_ERROR); None: the build at first use is not tried yet.
_AVAILABLE: Optional[bool] = True if _C is not None else None
# Where the loaded kernels came from: "wheel" (flash_cuda._C), "cache" (a build made earlier) or
# "compiled" (by this process), and the build's directory (None for the wheel).
_ORIGIN: Optional[Tuple[str, Optional[Path]]] = ("wheel", None) if _C is not None else None
_LOCK = threading.Lock()

# The module name of builds at first use: csrc/api/flash_api.cpp declares its module as
# PYBIND11_MODULE(TORCH_EXTENSION_NAME, m), which torch's builder defines as this name, and
# registers nothing else by name (the custom ops are registered in Python), so the name only
# has to differ from flash_cuda._C.
JIT_MODULE = "flash_cuda_kernels"


def jit_module_name() -> str:
    """JIT_MODULE, or JIT_MODULE_<namespace> for a build in a namespace of its own
    (FLASH_CUDA_NAMESPACE, _build.namespace_requested): pybind11 keeps one module per name in a
    process and hands the first one out again, so two builds loaded side by side need two names."""
    namespace = _build.namespace_requested()
    return JIT_MODULE if namespace is None else f"{JIT_MODULE}_{namespace}"

BUILD_INFO = "build.json"  # written into a build's directory once it is complete

BUILD_HINT = (
    "`pip install .` installs flash_cuda with its kernel sources, which compile at first use "
    "(that needs a CUDA build of PyTorch, nvcc from the CUDA toolkit and ninja); "
    "`pip install --no-build-isolation .` compiles them into the wheel."
)

# Minutes a build of every kernel for one GPU architecture takes with 16 parallel jobs: the
# estimate in the line printed when a build starts.
_MINUTES_PER_ARCH_16_JOBS = 1


class BuildError(RuntimeError):
    """Why the kernels cannot be loaded or compiled here; the message says what to install."""


def is_available() -> bool:
    """True when flash_cuda's CUDA kernels are loaded: built into the wheel, found in the cache
    of builds made at first use, or compiled now (once; see the module's docstring). False when
    they cannot be, :func:`unavailable_message` says why."""
    if _AVAILABLE is None:
        if torch.compiler.is_compiling():
            # Not decided yet while torch.compile traces a caller: loading (maybe compiling) is
            # no graph operation. The ops' implementations call require() when they first run,
            # which decides; the changed value then retraces the caller once.
            return True
        return _load()
    return _AVAILABLE


def require() -> ModuleType:
    """Returns the extension module (compiling it at first use) or raises RuntimeError that
    says what is missing."""
    if _C is None:
        if _AVAILABLE is None:
            _load()
        if _C is None:
            raise RuntimeError(unavailable_message())
    return _C


def direct_plan(scale: float, window_left: int, window_right: int, softcap: float, tier: int,
                deterministic: bool):
    """The extension's ``DirectPlan`` of a dense call's checked options (flash_cuda/signature.py:
    ``Plan.direct``), loading the kernels if that is not decided yet; None where they cannot be
    loaded or the module in use has no such entry (a test's stand-in): the call then passes the
    options one by one (``Plan.fwd_args``) through the Python autograd node."""
    make = getattr(_module_if_loadable(), "DirectPlan", None)
    return None if make is None else make(scale, window_left, window_right, softcap, tier, deterministic)


def kvcache_direct_plan(scale: float, window_left: int, window_right: int, softcap: float, num_splits: int,
                        return_lse: bool):
    """The extension's ``KvcacheDirectPlan`` of a KV-cache call's checked options
    (flash_cuda/kvcache_checks.py: ``Plan.direct``), or None, as :func:`direct_plan`."""
    make = getattr(_module_if_loadable(), "KvcacheDirectPlan", None)
    return None if make is None else make(scale, window_left, window_right, softcap, num_splits, return_lse)


def _module_if_loadable() -> Optional[ModuleType]:
    """The module in use (a test's stand-in included), loading the kernels first if that is not
    decided yet (not while torch.compile traces); None where they cannot be loaded."""
    if _C is None and (_AVAILABLE is not None or torch.compiler.is_compiling() or not _load()):
        return None
    return _C


def unavailable_reason() -> Optional[str]:
    """None when flash_cuda's CUDA kernels are loaded (loading or compiling them first, as
    :func:`is_available` does), else why they cannot be and what to install or set."""
    return None if is_available() else unavailable_message()


def load_info() -> dict:
    """Where the kernels come from, without loading them: {"origin": "wheel" | "cache" |
    "compiled" | None (not loaded), "module": the extension's file, "directory": the build's
    directory in the cache (None for the wheel), "archs": its GPU targets (from its build.json;
    None for the wheel)}."""
    origin, directory = _ORIGIN or (None, None)
    archs = None
    if directory is not None:
        try:
            archs = json.loads((directory / BUILD_INFO).read_text())["archs"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return {"origin": origin, "module": getattr(_C, "__file__", None) if _C is not None else None,
            "directory": str(directory) if directory is not None else None, "archs": archs}


def unavailable_message() -> str:
    """Explains why the kernels are not loaded and what to install."""
    err = _IMPORT_ERROR
    if isinstance(err, BuildError):
        return str(err)
    if isinstance(err, ModuleNotFoundError) and (err.name or "").endswith("_C"):
        reason = "the compiled extension flash_cuda._C is not built"
    elif err is not None:
        reason = f"the compiled extension flash_cuda._C failed to load ({type(err).__name__}: {err})"
    else:
        reason = "the CUDA kernels are not loaded"
    msg = f"flash_cuda: {reason}. {BUILD_HINT}"
    if torch.version.cuda is None:
        msg += f" The installed torch {torch.__version__} is a CPU-only build."
    return msg


def ablations() -> bool:
    """True when the extension was built with the ablation rungs of OPTIMIZATION.md
    (``FLASH_CUDA_ABLATIONS=1``), whose environment switches it then reads."""
    return is_available() and bool(getattr(_C, "ablations", False))


def _load() -> bool:
    global _C, _AVAILABLE, _IMPORT_ERROR, _ORIGIN
    with _LOCK:
        if _AVAILABLE is None:
            try:
                _C, _ORIGIN = _first_use_build(_IMPORT_ERROR)
                _AVAILABLE, _IMPORT_ERROR = True, None
            except BuildError as exc:
                _AVAILABLE, _IMPORT_ERROR = False, exc
        return _AVAILABLE


def _first_use_build(prebuilt_error: Optional[BaseException]) -> Tuple[ModuleType, Tuple[str, Path]]:
    broken = "" if isinstance(prebuilt_error, ModuleNotFoundError) or prebuilt_error is None else (
        f" (flash_cuda._C, built into this installation, does not load: "
        f"{type(prebuilt_error).__name__}: {prebuilt_error})")
    try:
        _require_sources()
        if torch.version.cuda is None:
            raise BuildError(_build.CPU_TORCH.format(version=torch.__version__))
        try:
            archs = _build.cuda_archs(first_use=True)
        except RuntimeError as exc:  # no GPU, or one older than compute capability 8.0
            raise BuildError(str(exc)) from None
        module, directory, compiled = load_or_compile(archs, reason=broken)
        return module, ("compiled" if compiled else "cache", directory)
    except BuildError as exc:
        if broken:
            raise BuildError(f"{exc}\n{broken.strip()}") from exc
        raise


def sources_dir() -> Optional[Path]:
    """The kernel sources: flash_cuda/_csrc in an installed wheel, csrc/ next to the package in
    a source checkout (or an editable install)."""
    here = Path(__file__).resolve().parent
    for place in _source_places(here):
        if (place / "api" / "flash_api.cpp").is_file():
            return place
    return None


def _source_places(here: Path) -> List[Path]:
    return [here / "_csrc", here.parent / "csrc"]


def _require_sources() -> Path:
    csrc = sources_dir()
    if csrc is None:
        places = " and ".join(str(p) for p in _source_places(Path(__file__).resolve().parent))
        raise BuildError(_build.NO_SOURCES.format(places=places))
    return csrc


def build_directory(archs: Sequence[str]) -> Tuple[Path, Path]:
    """(the cache directory of this installation's builds, the one of a build for ``archs``)."""
    csrc = _require_sources()
    version = importlib.import_module(__package__).__version__
    name = _build.build_name(version, _build.source_digest(csrc), torch.__version__, torch.version.cuda,
                             _build.compile_flags(None))
    base = _build.cache_root() / name
    return base, base / _build.arch_tag(archs)


def cached_build(base: Path, archs: Sequence[str]) -> Optional[Path]:
    """The complete build under ``base`` with machine code for every target of ``archs`` (the
    one with the fewest targets), or None."""
    best, best_archs = None, None
    for info_file in sorted(base.glob(f"*/{BUILD_INFO}")):
        try:
            built = json.loads(info_file.read_text())["archs"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if set(archs) <= set(built) and (best_archs is None or len(built) < len(best_archs)):
            best, best_archs = info_file.parent, built
    return best


def compile_kernels(archs: Sequence[str], verbose: bool = False, reason: str = "") -> Tuple[ModuleType, Path]:
    """Loads the cached build for ``archs`` or compiles one into the cache (the first use, and
    ``python3 -m flash_cuda.build``); returns (module, its directory). Raises BuildError."""
    return load_or_compile(archs, verbose, reason)[:2]


def load_or_compile(archs: Sequence[str], verbose: bool = False, reason: str = "") -> Tuple[ModuleType, Path, bool]:
    """:func:`compile_kernels`, also telling whether it compiled (True) or loaded a cached build."""
    base, directory = build_directory(archs)
    cached = cached_build(base, archs)
    if cached is not None:
        return _import_build(cached), cached, False
    problem = _build.missing_tool(archs)
    if problem is not None:
        raise BuildError(problem)
    csrc = sources_dir()
    flags = _build.compile_flags(archs, ptx=False)  # machine code for these GPUs only
    directory.mkdir(parents=True, exist_ok=True)
    print(_announcement(archs, directory) + reason, file=sys.stderr, flush=True)
    from torch.utils.cpp_extension import load

    try:
        module = load(name=jit_module_name(), sources=[str(csrc / s) for s in _build.compiled_sources(csrc)],
                      extra_cflags=flags["cxx"], extra_cuda_cflags=flags["nvcc"], extra_include_paths=[str(csrc)],
                      build_directory=str(directory), verbose=verbose)
    except (RuntimeError, ImportError, OSError) as exc:
        # A compiler error (its output is in the message), or another process' build that this
        # one waited for failed (its module is missing).
        text = str(exc)
        from torch.utils.cpp_extension import CUDA_HOME

        hint = _build.compile_error_hint(text, CUDA_HOME)
        if len(text) > 6000:
            text = "...\n" + text[-6000:]
        cause = f"\n{hint}" if hint else ""
        raise BuildError(f"flash_cuda: compiling the CUDA kernels in {directory} failed:\n{text}{cause}") from exc
    _write_info(directory, archs, module)
    return module, directory, True


def _lock_file_is_the_lock() -> bool:
    # Before torch 2.14 the builder's lock is the file's existence (a killed build leaves it and
    # later builds wait); from 2.14 it is an operating-system lock on a file that always stays.
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    return major_minor < (2, 14)


def _announcement(archs: Sequence[str], directory: Path) -> str:
    targets = ", ".join(f"sm_{a}" for a in archs)
    if (directory / "lock").exists() and _lock_file_is_the_lock():
        return (f"flash_cuda: waiting for another process that compiles the CUDA kernels for {targets} in "
                f"{directory} (if none does, a build was interrupted: delete {directory / 'lock'})")
    jobs = int(os.environ.get("MAX_JOBS") or 0) or os.cpu_count() or 1
    minutes = max(1, round(_MINUTES_PER_ARCH_16_JOBS * len(archs) * 16 / min(jobs, 16)))
    return (f"flash_cuda: compiling the CUDA kernels for {targets} into {directory}; this is done once "
            f"and takes about {minutes} min with {jobs} parallel jobs (MAX_JOBS)")


def _write_info(directory: Path, archs: Sequence[str], module: ModuleType) -> None:
    info = {"archs": list(archs), "module": module.__name__, "file": os.path.basename(module.__file__),
            "torch": torch.__version__, "cuda": torch.version.cuda}
    tmp = directory / f"{BUILD_INFO}.{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, directory / BUILD_INFO)  # atomic: a reader sees no build or a complete one


def _import_build(directory: Path) -> ModuleType:
    try:
        info = json.loads((directory / BUILD_INFO).read_text())
        spec = importlib.util.spec_from_file_location(info["module"], directory / info["file"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError, ValueError, KeyError, AttributeError) as exc:
        raise BuildError(f"flash_cuda: the cached build in {directory} does not load ({type(exc).__name__}: "
                         f"{exc}); delete that directory to compile it again") from exc
    return module
