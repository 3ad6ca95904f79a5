"""The package as pip sees it (no GPU needed): TORCH_CUDA_ARCH_LIST read as torch reads it, the
messages a build gives when torch, a CUDA torch, nvcc or ninja is missing, and an sdist that holds
everything a build from it needs."""

from __future__ import annotations

import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _setup_namespace():
    """setup.py's helpers, without running setup()."""
    src = (ROOT / "setup.py").read_text().split("def extensions")[0]
    ns = {"__file__": str(ROOT / "setup.py")}
    exec(compile(src, "setup.py", "exec"), ns)
    return ns


@pytest.mark.parametrize("env,archs,ptx", [
    ("7.5;8.0;8.6;9.0+PTX", ["80", "86", "90a"], ["90"]),   # a container's list: 7.5 left out
    ("Ampere;Hopper", ["80", "86", "90a"], ["86", "90"]),   # torch's names, their +PTX
    ("8.0;8.6", ["80", "86"], ["86"]),                      # no +PTX: the newest target's PTX
    ("8.0 9.0a+PTX", ["80", "90a"], ["90"]),
])
def test_torch_cuda_arch_list(monkeypatch, env, archs, ptx):
    monkeypatch.delenv("FLASH_CUDA_ARCHS", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", env)
    ns = _setup_namespace()
    with pytest.warns(UserWarning, match="left out") if "7.5" in env else _no_warning():
        got = ns["cuda_archs"]()
    assert got == archs
    assert ns["ptx_archs"](got) == ptx
    flags = ns["gencode_flags"](got)
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
    ns = _setup_namespace()
    got = ns["cuda_archs"]()
    assert got == archs
    flags = ns["gencode_flags"](got)
    assert flags[:-1] == [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    assert flags[-1] == f"-gencode=arch=compute_{ptx},code=compute_{ptx}"


def test_build_rejects_old_targets(monkeypatch):
    monkeypatch.setenv("FLASH_CUDA_ARCHS", "75;80")
    with pytest.raises(RuntimeError, match="compute capability 8.0 or newer"):
        _setup_namespace()["cuda_archs"]()


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_arch_lists_with_nothing_to_build(monkeypatch):
    monkeypatch.delenv("FLASH_CUDA_ARCHS", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Turing")
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="8.0 or newer"):
        _setup_namespace()["cuda_archs"]()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "Hopperish")
    with pytest.raises(RuntimeError, match="8.0 or newer"):
        _setup_namespace()["cuda_archs"]()


def _fake_torch(monkeypatch, cuda, cuda_home="/usr/local/cuda", ninja=True):
    torch = types.ModuleType("torch")
    torch.__version__ = "2.11.0" + ("" if cuda else "+cpu")
    torch.version = types.SimpleNamespace(cuda=cuda)
    utils = types.ModuleType("torch.utils")
    ext = types.ModuleType("torch.utils.cpp_extension")
    ext.CUDA_HOME = cuda_home
    ext.is_ninja_available = lambda: ninja
    torch.utils = utils
    utils.cpp_extension = ext
    for name, mod in (("torch", torch), ("torch.utils", utils), ("torch.utils.cpp_extension", ext)):
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize("case,match", [
    ("no torch", "--no-build-isolation"),
    ("cpu torch", "CPU-only"),
    ("no nvcc", "nvcc"),
    ("no ninja", "pip install ninja"),
])
def test_build_environment_messages(monkeypatch, case, match):
    ns = _setup_namespace()
    if case == "no torch":
        monkeypatch.setitem(sys.modules, "torch", None)
    else:
        _fake_torch(monkeypatch, cuda=None if case == "cpu torch" else "13.0",
                    cuda_home=None if case == "no nvcc" else "/usr/local/cuda", ninja=case != "no ninja")
    with pytest.raises(SystemExit, match=match):
        ns["check_build_environment"]()


def test_sdist_holds_the_sources(tmp_path):
    """An sdist needs neither torch nor nvcc to be made, and holds every header a build from it
    includes, the instance generator and the license."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist",
                           "-d", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (archive,) = tmp_path.glob("flash_cuda-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".cpp", ".py")}
    assert wanted and wanted <= names, sorted(wanted - names)[:10]
    for f in ("LICENSE", "README.md", "pyproject.toml", "setup.py", "flash_cuda/__init__.py", "flash_cuda/kvcache.py"):
        assert f in names, f
