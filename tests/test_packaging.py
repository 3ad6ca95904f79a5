"""The package as pip sees it (no GPU needed): TORCH_CUDA_ARCH_LIST read as torch reads it, the
wheel that `pip install .` builds without torch (pure Python, with every kernel source), the one
that needs torch (and what it says when torch, a CUDA torch, nvcc or ninja is missing), an sdist
that holds everything a build from it needs, and the build of the kernels at first use: its
cache key, its messages, its cache."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest
import torch

import flash_cuda
from fake_toolkit import shared_toolkit
from flash_cuda import _ext

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"


def _build_helpers():
    """flash_cuda/_build.py loaded by its path, as setup.py loads it (without flash_cuda)."""
    spec = importlib.util.spec_from_file_location("_flash_cuda_build_test", ROOT / "flash_cuda" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


B = _build_helpers()


# ---------------------------------------------------------------------------------------
# Architectures
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("env,archs,ptx", [
    ("7.5;8.0;8.6;9.0+PTX", ["80", "86", "90a"], ["90"]),   # a container's list: 7.5 left out
    ("Ampere;Hopper", ["80", "86", "90a"], ["86", "90"]),   # torch's names, their +PTX
    ("8.0;8.6", ["80", "86"], ["86"]),                      # no +PTX: the newest target's PTX
    ("8.0 9.0a+PTX", ["80", "90a"], ["90"]),
])
def test_torch_cuda_arch_list(monkeypatch, env, archs, ptx):
    monkeypatch.delenv("FLASH_CUDA_ARCHS", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
    with pytest.warns(UserWarning, match="left out") if "7.5" in env else _no_warning():
        got = B.cuda_archs()
    assert got == archs
    assert B.ptx_archs(got) == ptx
    flags = B.gencode_flags(got)
    assert flags == [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs] + \
        [f"-gencode=arch=compute_{p},code=compute_{p}" for p in ptx]


@pytest.mark.parametrize("env,archs,ptx", [
    ("80;86;89;90a;100;120", ["80", "86", "89", "90a", "100", "120"], "120"),
    ("8.6", ["86"], "86"),
    ("9.0", ["90a"], "90"),          # sm_90 builds as sm_90a; its PTX drops the "a" features
    ("sm_80,sm_90", ["80", "90a"], "90"),
])
def test_flash_cuda_archs(monkeypatch, env, archs, ptx):
    """FLASH_CUDA_ARCHS accepts every supported class, and the newest target also embeds PTX
    (so GPUs newer than every target can compile it when the module loads)."""
    monkeypatch.setenv("FLASH_CUDA_ARCHS", env)
    got = B.cuda_archs()
    assert got == archs
    assert B.cuda_archs(first_use=True) == archs
    flags = B.gencode_flags(got)
    assert flags[:-1] == [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    assert flags[-1] == f"-gencode=arch=compute_{ptx},code=compute_{ptx}"
    assert B.gencode_flags(got, ptx=False) == flags[:-1]


def test_build_rejects_old_targets(monkeypatch):
    monkeypatch.setenv("FLASH_CUDA_ARCHS", "75;80")
    with pytest.raises(RuntimeError, match="compute capability 8.0 or newer"):
        B.cuda_archs()


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_arch_lists_with_nothing_to_build(monkeypatch):
    monkeypatch.delenv("FLASH_CUDA_ARCHS", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Turing")
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="8.0 or newer"):
        B.cuda_archs()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopperish")
    with pytest.raises(RuntimeError, match="8.0 or newer"):
        B.cuda_archs()


def test_first_use_archs_are_the_visible_gpus(monkeypatch):
    """At first use TORCH_CUDA_ARCH_LIST (set in containers for every GPU they may meet) is not
    read: the build is for the GPUs present, and needs one."""
    monkeypatch.delenv("FLASH_CUDA_ARCHS", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;8.6;9.0;10.0;12.0+PTX")
    _fake_gpus(monkeypatch, [(9, 0), (9, 0), (8, 0)])
    assert B.cuda_archs(first_use=True) == ["80", "90a"]
    assert B.cuda_archs() == ["80", "86", "90a", "100", "120"]
    _fake_gpus(monkeypatch, [])
    with pytest.raises(RuntimeError, match="torch sees none"):
        B.cuda_archs(first_use=True)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert B.cuda_archs() == ["80", "90a"]  # ahead of time without a GPU: the default pair


def _fake_gpus(monkeypatch, caps):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: caps[i])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))


# ---------------------------------------------------------------------------------------
# What a build lacks
# ---------------------------------------------------------------------------------------


def _fake_torch(monkeypatch, cuda, cuda_home="toolkit", ninja=True):
    fake = types.ModuleType("torch")
    fake.__version__ = "2.11.0" + ("" if cuda else "+cpu")
    fake.version = types.SimpleNamespace(cuda=cuda)
    utils = types.ModuleType("torch.utils")
    ext = types.ModuleType("torch.utils.cpp_extension")
    ext.CUDA_HOME = shared_toolkit(cuda or "13.0") if cuda_home == "toolkit" else cuda_home
    ext.is_ninja_available = lambda: ninja
    fake.utils = utils
    utils.cpp_extension = ext
    for name, mod in (("torch", fake), ("torch.utils", utils), ("torch.utils.cpp_extension", ext)):
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize("case,match", [
    ("no torch", "--no-build-isolation"),
    ("cpu torch", "CPU-only"),
    ("no nvcc", "set CUDA_HOME"),
    ("no ninja", "pip install ninja"),
    ("complete", None),
])
def test_missing_tool_messages(monkeypatch, case, match):
    if case == "no torch":
        monkeypatch.setitem(sys.modules, "torch", None)
    else:
        _fake_torch(monkeypatch, cuda=None if case == "cpu torch" else "13.0",
                    cuda_home=None if case == "no nvcc" else "toolkit", ninja=case != "no ninja")
    problem = B.missing_tool()
    if match is None:
        assert problem is None
    else:
        assert problem is not None and match in problem


def test_ninja_of_an_inactive_venv_is_found(monkeypatch, tmp_path):
    """pip puts the ninja package's command next to the venv's python, which is not on PATH when
    that python runs without the venv activated; torch's builder looks for it on PATH."""
    (tmp_path / "bin").mkdir()
    exe = tmp_path / "bin" / "ninja"
    exe.write_text("#!/bin/sh\necho 1.13.0\n")
    exe.chmod(0o755)
    monkeypatch.setitem(sys.modules, "ninja", types.SimpleNamespace(BIN_DIR=str(tmp_path / "bin")))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    B.put_ninja_on_path()
    assert shutil.which("ninja") == str(exe)


# ---------------------------------------------------------------------------------------
# Wheels and the sdist
# ---------------------------------------------------------------------------------------

SOURCE_TREE = ["setup.py", "pyproject.toml", "MANIFEST.in", "LICENSE", "README.md", "OPTIMIZATION.md",
               "flash_cuda", "csrc"]


def _copy_source_tree(dest: Path) -> Path:
    """The files a build from the checkout reads, without build outputs."""
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "_csrc", "*.egg-info")
    for name in SOURCE_TREE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def _env_without_torch(tmp_path: Path, **extra) -> dict:
    """A build environment where `import torch` fails, as in pip's isolated build."""
    shim = tmp_path / "shim" / "torch"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text("raise ImportError('torch is hidden from this build')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_CUDA_")}
    env["PYTHONPATH"] = str(tmp_path / "shim")
    env.update(extra)
    return env


def _pep517_wheel(src: Path, out: Path, env: dict) -> subprocess.CompletedProcess:
    """What pip does to build a wheel: setuptools' PEP 517 backend, in the source directory."""
    code = f"from setuptools import build_meta; print(build_meta.build_wheel({str(out)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=src, env=env, capture_output=True, text=True,
                          timeout=600)


def _check_source_wheel(out: Path):
    """A pure-Python wheel: the package, every kernel source under flash_cuda/_csrc, no binary,
    ninja and torch as requirements."""
    (wheel,) = out.glob("flash_cuda-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    wanted = {f"flash_cuda/_csrc/{rel}" for rel in B.kernel_sources(CSRC)}
    assert "flash_cuda/_csrc/api/flash_api.cpp" in wanted and len(wanted) > 100
    assert wanted <= names, sorted(wanted - names)[:10]
    assert not [n for n in names if n.endswith((".so", ".pyd", ".o"))]
    for f in ("flash_cuda/__init__.py", "flash_cuda/_ext.py", "flash_cuda/_build.py", "flash_cuda/build.py",
              "flash_cuda/kvcache.py"):
        assert f in names, f
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert "ninja" in requires and any(r.startswith("torch") for r in requires), requires


def test_wheel_without_torch_carries_the_kernel_sources(tmp_path):
    """`pip install .` builds in isolation, without torch: a pure-Python wheel whose kernels
    compile at first use."""
    src = _copy_source_tree(tmp_path / "src")
    proc = _pep517_wheel(src, tmp_path / "dist", _env_without_torch(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_source_wheel(tmp_path / "dist")


def test_wheel_leaves_out_stale_sources(tmp_path):
    """A kernel source removed since an earlier build of the same tree leaves the next wheel."""
    src = _copy_source_tree(tmp_path / "src")
    env = _env_without_torch(tmp_path)
    assert _pep517_wheel(src, tmp_path / "d1", env).returncode == 0
    (src / "csrc" / "include" / "ablation.h").rename(src / "csrc" / "include" / "gone.txt")
    proc = _pep517_wheel(src, tmp_path / "d2", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with zipfile.ZipFile(next((tmp_path / "d2").glob("*.whl"))) as zf:
        names = set(zf.namelist())
    assert "flash_cuda/_csrc/include/ablation.h" not in names
    assert "flash_cuda/_csrc/include/params.h" in names


def test_aot_build_without_torch_says_no_build_isolation(tmp_path):
    src = _copy_source_tree(tmp_path / "src")
    env = _env_without_torch(tmp_path, FLASH_CUDA_BUILD="aot")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "bdist_wheel", "-d", str(tmp_path / "dist")],
                          cwd=src, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--no-build-isolation" in proc.stderr and "cannot import torch" in proc.stderr, proc.stderr[-2000:]


def test_build_mode_is_checked(tmp_path):
    src = _copy_source_tree(tmp_path / "src")
    env = _env_without_torch(tmp_path, FLASH_CUDA_BUILD="fast")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "bdist_wheel", "-d", str(tmp_path / "dist")],
                          cwd=src, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "FLASH_CUDA_BUILD must be" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA: the build would compile")
def test_build_with_cpu_torch_says_what_to_install(tmp_path):
    """With torch importable (`pip install --no-build-isolation .`) the kernels are compiled into
    the wheel, which a CPU-only torch cannot do."""
    src = _copy_source_tree(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASH_CUDA_")}
    proc = subprocess.run([sys.executable, "setup.py", "-q", "bdist_wheel", "-d", str(tmp_path / "dist")],
                          cwd=src, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "CPU-only" in proc.stderr and torch.__version__ in proc.stderr, proc.stderr[-2000:]


def test_sdist_holds_the_sources_and_builds_a_wheel(tmp_path):
    """An sdist needs neither torch nor nvcc to be made, holds every header a build from it
    includes, the instance generator and the license, and builds the source wheel."""
    env = _env_without_torch(tmp_path)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist",
                           "-d", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (archive,) = tmp_path.glob("flash_cuda-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        if hasattr(tarfile, "data_filter"):
            tar.extractall(tmp_path / "unpacked", filter="data")
        else:
            tar.extractall(tmp_path / "unpacked")
    wanted = {str(p.relative_to(ROOT)) for p in CSRC.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp", ".py")}
    assert wanted and wanted <= names, sorted(wanted - names)[:10]
    for f in ("LICENSE", "README.md", "pyproject.toml", "setup.py", "flash_cuda/__init__.py", "flash_cuda/kvcache.py",
              "flash_cuda/_build.py", "flash_cuda/build.py"):
        assert f in names, f
    (src,) = (tmp_path / "unpacked").iterdir()
    proc = _pep517_wheel(src, tmp_path / "dist", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_source_wheel(tmp_path / "dist")


# ---------------------------------------------------------------------------------------
# The build at first use
# ---------------------------------------------------------------------------------------


@pytest.fixture
def first_use(monkeypatch, tmp_path):
    """flash_cuda as just imported without flash_cuda._C, with an empty cache in tmp_path."""
    err = ModuleNotFoundError("No module named 'flash_cuda._C'", name="flash_cuda._C")
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", None)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", err)
    monkeypatch.setenv("FLASH_CUDA_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("FLASH_CUDA_ARCHS", "FLASH_CUDA_ABLATIONS", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


def _cuda_machine(monkeypatch, caps=((9, 0),), cuda_home="toolkit", ninja=True):
    """This torch as a CUDA torch on a machine with these GPUs, nvcc (a complete stand-in toolkit
    unless ``cuda_home`` names another or is None) and ninja."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    _fake_gpus(monkeypatch, list(caps))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", shared_toolkit("12.8") if cuda_home == "toolkit" else cuda_home)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: ninja)


def _fake_load(calls):
    """Stands in for torch.utils.cpp_extension.load: writes a Python module where the extension
    would be and imports it."""

    def load(name, sources, extra_cflags, extra_cuda_cflags, extra_include_paths, build_directory, verbose):
        calls.append(dict(name=name, sources=sources, extra_cflags=extra_cflags,
                          extra_cuda_cflags=extra_cuda_cflags, extra_include_paths=extra_include_paths,
                          build_directory=build_directory))
        path = Path(build_directory) / f"{name}.py"
        path.write_text(f"built_for = {extra_cuda_cflags!r}\n")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def test_import_does_not_compile():
    code = ("import sys, flash_cuda; from flash_cuda import _ext; "
            "assert 'torch.utils.cpp_extension' not in sys.modules, 'imported the builder'; "
            "assert _ext._AVAILABLE is (True if _ext._C is not None else None), _ext._AVAILABLE; print('OK')")
    env = dict(os.environ, PYTHONPATH=str(Path(flash_cuda.__file__).resolve().parents[1]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("case,match", [
    ("cpu torch", "CPU-only"),
    ("no gpu", "torch sees none"),
    ("old gpu", "compute capability 8.0 or newer"),
    ("no nvcc", "set CUDA_HOME"),
    ("no ninja", "pip install ninja"),
])
def test_first_use_says_what_to_install(monkeypatch, first_use, case, match):
    if case != "cpu torch":
        _cuda_machine(monkeypatch, caps={"no gpu": (), "old gpu": ((7, 5),)}.get(case, ((9, 0),)),
                      cuda_home=None if case == "no nvcc" else "toolkit", ninja=case != "no ninja")
    else:
        monkeypatch.setattr(torch.version, "cuda", None)
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("compiled although a tool is missing"))
    assert flash_cuda.is_available() is False
    assert match in _ext.unavailable_message()
    with pytest.raises(RuntimeError, match=match):
        _ext.require()
    with pytest.raises(RuntimeError, match=match):  # the custom op reaches the same message
        torch.ops.flash_cuda.fwd(*[torch.zeros(1, 1, 1, 8)] * 3, 0.25, -1, -1, 0.0, None, False, 0)


def test_first_use_compiles_once_into_the_cache(monkeypatch, first_use, capsys):
    """The first call compiles setup.py's sources with setup.py's flags (machine code for the
    visible GPUs) into the cache and says so; a later process loads that build, without nvcc."""
    _cuda_machine(monkeypatch, caps=((9, 0),))
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", _fake_load(calls))
    module = _ext.require()
    assert flash_cuda.is_available() and _ext.require() is module and len(calls) == 1
    (call,) = calls
    csrc = _ext.sources_dir()
    assert call["name"] == _ext.JIT_MODULE
    assert call["sources"] == [str(csrc / "api" / "flash_api.cpp")] + sorted(
        str(p) for p in (csrc / "instances").glob("*.cu"))
    assert call["extra_include_paths"] == [str(csrc)]
    flags = B.compile_flags(["90a"], ptx=False)
    assert call["extra_cuda_cflags"] == flags["nvcc"] and call["extra_cflags"] == flags["cxx"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags["nvcc"]
    directory = Path(call["build_directory"])
    assert directory.parent.parent == first_use and directory.name == "sm_90a"
    assert json.loads((directory / _ext.BUILD_INFO).read_text())["archs"] == ["90a"]
    line = capsys.readouterr().err
    assert "compiling the CUDA kernels for sm_90a" in line and str(directory) in line and "once" in line

    # Another process: no nvcc, no builder; the cached build loads.
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", None)
    _cuda_machine(monkeypatch, caps=((9, 0),), cuda_home=None, ninja=False)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("compiled again"))
    assert _ext.require().built_for == flags["nvcc"]
    assert capsys.readouterr().err == ""

    # A GPU the cached build has no machine code for needs a build of its own.
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", None)
    _cuda_machine(monkeypatch, caps=((9, 0), (8, 0)), cuda_home=None)
    assert not flash_cuda.is_available() and "nvcc" in _ext.unavailable_message()


def test_build_ahead_of_time_serves_the_first_use(monkeypatch, first_use, capsys):
    """`python3 -m flash_cuda.build` on a machine without a GPU, for the arch list of an image;
    then the first use on an H100 loads that build."""
    from flash_cuda import build

    _cuda_machine(monkeypatch, caps=())
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", _fake_load(calls))
    monkeypatch.setenv("FLASH_CUDA_ARCHS", "80")  # replaced by --archs
    assert build.main(["--archs", "80;90a"]) == 0
    out = capsys.readouterr().out
    assert "sm_80, sm_90a" in out and str(first_use) in out and len(calls) == 1
    monkeypatch.delenv("FLASH_CUDA_ARCHS")
    assert not flash_cuda.is_available() and "torch sees none" in _ext.unavailable_message()  # no GPU here

    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", None)
    _cuda_machine(monkeypatch, caps=((9, 0),), cuda_home=None)
    assert flash_cuda.is_available() and len(calls) == 1
    assert "-gencode=arch=compute_80,code=sm_80" in _ext.require().built_for


def test_build_cli_reports_what_is_missing(monkeypatch, first_use, capsys):
    from flash_cuda import build

    monkeypatch.setattr(torch.version, "cuda", None)
    assert build.main(["--archs", "90a"]) == 1
    assert "CPU-only" in capsys.readouterr().err
    assert build.main(["--archs", "75"]) == 1
    assert "8.0 or newer" in capsys.readouterr().err


def test_cache_key(monkeypatch, first_use, tmp_path):
    """The cache directory changes with the sources, flash_cuda's, torch's and CUDA's versions,
    and the ablation flag; the architectures pick a directory below it."""
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    monkeypatch.setattr(_ext, "sources_dir", lambda: csrc)
    base, directory = _ext.build_directory(["90a"])
    assert base.parent == first_use and directory.parent == base
    assert _ext.build_directory(["80", "90a"])[0] == base
    assert _ext.build_directory(["80", "90a"])[1] != directory
    assert _ext.build_directory(["90a"]) == (base, directory)  # deterministic

    seen = {base}

    def changed():
        new = _ext.build_directory(["90a"])[0]
        assert new not in seen
        seen.add(new)

    (csrc / "generator.py").write_text("# not compiled\n")  # not a kernel source: same key
    assert _ext.build_directory(["90a"])[0] == base
    with open(csrc / "include" / "params.h", "a") as f:
        f.write("\n// changed\n")
    changed()
    (csrc / "include" / "new.cuh").write_text("#pragma once\n")
    changed()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".post1")
    changed()
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    changed()
    monkeypatch.setenv("FLASH_CUDA_ABLATIONS", "1")
    changed()
    monkeypatch.setattr(flash_cuda, "__version__", flash_cuda.__version__ + ".dev1")
    changed()


def test_missing_sources_say_how_to_reinstall(monkeypatch, first_use):
    _cuda_machine(monkeypatch)
    monkeypatch.setattr(_ext, "sources_dir", lambda: None)
    assert not flash_cuda.is_available()
    assert "pip install ." in _ext.unavailable_message() and "_csrc" in _ext.unavailable_message()


def test_torch_compile_traces_an_undecided_is_available(monkeypatch, first_use):
    """Before anything decided, a traced is_available() answers True (loading is no graph
    operation; the ops decide when they run); once decided, the caller is traced again."""
    monkeypatch.setattr(torch.version, "cuda", None)  # decides without compiling, on any machine

    def f(x):
        return x + 1 if _ext.is_available() else x - 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    x = torch.zeros(2)
    assert compiled(x).tolist() == [1.0, 1.0]
    assert _ext._AVAILABLE is None  # tracing loaded nothing
    assert flash_cuda.is_available() is False
    assert compiled(x).tolist() == [-1.0, -1.0]
    torch._dynamo.reset()


def test_namespace_build_renames_the_namespace_and_the_module(monkeypatch):
    # FLASH_CUDA_NAMESPACE (bench/ab_builds.py --one-process): the preprocessor renames the C++
    # namespace in the kernels and the binding, and the module gets a name of its own, since
    # pybind11 hands out the first module of a name again.
    monkeypatch.delenv("FLASH_CUDA_NAMESPACE", raising=False)
    plain = B.compile_flags(None)
    assert not any("-Dflash_cuda=" in f for f in plain["nvcc"] + plain["cxx"])
    assert _ext.jit_module_name() == _ext.JIT_MODULE
    monkeypatch.setenv("FLASH_CUDA_NAMESPACE", "flash_cuda_ab_new")
    flags = B.compile_flags(None)
    assert "-Dflash_cuda=flash_cuda_ab_new" in flags["nvcc"] and "-Dflash_cuda=flash_cuda_ab_new" in flags["cxx"]
    assert _ext.jit_module_name() == "flash_cuda_kernels_flash_cuda_ab_new"
    assert B.build_name("0", "d", "2", "13", flags) != B.build_name("0", "d", "2", "13", plain)
    monkeypatch.setenv("FLASH_CUDA_NAMESPACE", "flash_cuda")
    assert B.compile_flags(None) == plain
    monkeypatch.setenv("FLASH_CUDA_NAMESPACE", "1 bad")
    with pytest.raises(ValueError, match="C\\+\\+ identifier"):
        B.compile_flags(None)
