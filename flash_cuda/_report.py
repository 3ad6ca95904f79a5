"""What ``python3 -m flash_cuda`` reports about an installation: versions, the GPUs and the class
flash_cuda treats each as, the kernel families that run on it per dtype, and where the kernels
come from (or why they cannot be loaded). Only public API and the build helpers are used.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
from typing import List, Optional, Tuple

import torch

from . import _build, _ext

# The GPU classes flash_cuda chooses tile configurations for (csrc/arch/gpu_class.h; the
# README's GPU table): compute capabilities, name, the shared memory one block may opt into
# that its tiles are checked against (KiB), the kernel families per dtype (``kernel=`` names).
GPU_CLASSES = (
    ((90,), "Hopper", 227, ("wgmma", "mma"), ("simt",)),
    ((100, 103), "Blackwell datacenter", 227, ("mma",), ("simt",)),
    ((80, 87), "Ampere datacenter", 163, ("mma",), ("simt",)),
    ((86, 89), "Ampere / Ada consumer", 99, ("mma",), ("simt",)),
    ((120, 121), "Blackwell consumer", 99, ("mma",), ("simt",)),
)
# Another GPU of compute capability 8.0 or newer gets the consumer budget (gpu_class.h).
OTHER_CLASS = ("other sm_80+ (tiles for 99 KiB)", 99, ("mma",), ("simt",))
KERNEL_NOTES = {
    "wgmma": "Hopper tier: warp-specialized TMA kernels (forward, backward) and wgmma",
    "mma": "mma.sync tensor cores",
    "simt": "float32 FMA",
}
DTYPES = ("float16", "bfloat16", "float32")


def gpu_class(arch: int) -> Tuple[str, Optional[int], Tuple[str, ...], Tuple[str, ...]]:
    """(class name, shared memory budget in KiB, fp16/bf16 kernels, fp32 kernels) of a compute
    capability written as major * 10 + minor; no kernels below 8.0."""
    if arch < 80:
        return "unsupported (compute capability below 8.0)", None, (), ()
    for archs, name, smem, half, single in GPU_CLASSES:
        if arch in archs:
            return name, smem, half, single
    return OTHER_CLASS


def emulated_arch() -> int:
    """FLASH_CUDA_EMULATE_ARCH (csrc/arch/gpu_class.h): the class the kernels are chosen for; 0: off."""
    try:
        return max(0, int(os.environ.get("FLASH_CUDA_EMULATE_ARCH", "0") or 0))
    except ValueError:
        return 0


def gpus(build_archs: Optional[List[str]] = None) -> List[dict]:
    """One entry per visible GPU. ``build_archs``: the loaded build's targets, where known (the
    wgmma kernels need the sm_90a target)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        arch = p.major * 10 + p.minor
        chosen = emulated_arch() or arch
        name, budget, half, single = gpu_class(chosen)
        if "wgmma" in half and build_archs is not None and "90a" not in build_archs:
            half = tuple(k for k in half if k != "wgmma")
        optin = getattr(p, "shared_memory_per_block_optin", None)
        out.append({
            "index": i, "name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "smem_per_block_optin_kib": None if optin is None else optin // 1024,
            "gpu_class": name, "smem_budget_kib": budget, "emulated_arch": emulated_arch() or None,
            "supported": arch >= 80,
            "kernels": {"float16": list(half), "bfloat16": list(half), "float32": list(single)},
        })
    return out


def driver() -> dict:
    """The NVIDIA driver's version and the CUDA version it supports (None where not found)."""
    version = None
    try:
        with open("/proc/driver/nvidia/version") as f:
            found = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", f.read())
            version = found.group(1) if found else None
    except OSError:
        pass
    if version is None:
        try:
            version = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip() or None
        except (OSError, subprocess.SubprocessError):
            pass
    cuda = None
    try:
        lib = ctypes.CDLL("nvcuda.dll" if platform.system() == "Windows" else "libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 and v.value:
            cuda = f"{v.value // 1000}.{v.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return {"version": version, "cuda": cuda}


def toolkit() -> dict:
    """The CUDA toolkit a build at first use would compile with: its directory (CUDA_HOME as
    torch's builder finds it), its nvcc and nvcc's release (None where not found)."""
    home = None
    if torch.version.cuda is not None:
        from torch.utils import cpp_extension

        home = cpp_extension.CUDA_HOME
    home = home or _build.find_cuda_home()
    nvcc = _build.nvcc_of(home)
    return {"cuda_home": home, "nvcc": nvcc, "nvcc_version": _build.nvcc_release(nvcc) if nvcc else None}


def wheel_archs(module: Optional[str]) -> Optional[List[str]]:
    """The GPU targets whose machine code an extension module holds, by the toolkit's cuobjdump
    (None without one)."""
    tool = _build.nvcc_of(toolkit()["cuda_home"])
    tool = os.path.join(os.path.dirname(tool), "cuobjdump") if tool else None
    if not module or not tool or not os.path.isfile(tool):
        return None
    try:
        out = subprocess.run([tool, "--list-elf", module], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = sorted(set(re.findall(r"\.sm_(\d+a?)\.", out)), key=lambda a: (int(a.rstrip("a")), a))
    return found or None


def versions() -> dict:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    drv = driver()
    import flash_cuda

    return {"flash_cuda": flash_cuda.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": cudnn, "driver": drv["version"], "driver_cuda": drv["cuda"], **toolkit(),
            "python": platform.python_version()}


def build(found: Optional[dict] = None) -> dict:
    """Where the kernels come from (loading or compiling them first, as their first use does):
    {"available", "origin": "wheel" | "cache" | "compiled" | None, "module", "directory", "archs",
    "cache_root", "sources", "reason" (None when available), "toolkit_problem" (what a build
    would lack: None when nothing or torch is CPU-only)}. ``found``: :func:`versions`' answer."""
    reason = _ext.unavailable_reason()
    info = _ext.load_info()
    if info["origin"] == "wheel":
        info["archs"] = wheel_archs(info["module"])
    sources = _ext.sources_dir()
    tk = found or toolkit()
    problem = None
    if torch.version.cuda is not None:
        problem = (_build.NO_NVCC.format(cuda=torch.version.cuda) if not tk["cuda_home"] else
                   _build.toolkit_problem(tk["cuda_home"], torch.version.cuda, torch.__version__)
                   or _build.header_problem(tk["cuda_home"]))
    return {"available": reason is None, **info, "cache_root": str(_build.cache_root()),
            "sources": str(sources) if sources is not None else None, "reason": reason,
            "toolkit_problem": problem}
