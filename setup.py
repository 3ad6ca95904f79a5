"""Build flash_cuda: `pip install --no-build-isolation .` (needs nvcc and a CUDA build of torch).

GPU architectures, in order of precedence:
  FLASH_CUDA_ARCHS="80;86;89;90a;100;120"   explicit list (90a = Hopper with wgmma/setmaxnreg;
                                            80 = A100, 86/89 = RTX 30/40, 120 = RTX 50, 100 = B200)
  TORCH_CUDA_ARCH_LIST="8.0;9.0"
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

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _normalise(arch: str) -> str:
    arch = arch.strip().lower().replace("sm_", "").replace("+ptx", "")
    if "." in arch:
        major, minor = arch.split(".", 1)
        arch = major + minor
    if arch in ("90", "90a"):
        return "90a"
    return arch


def cuda_archs():
    env = os.environ.get("FLASH_CUDA_ARCHS") or os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        archs = [_normalise(a) for a in env.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    else:
        archs = []
        try:
            import torch

            for i in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(i)
                archs.append(_normalise(f"{major}{minor}"))
        except Exception:  # no driver at build time
            archs = []
        if not archs:
            archs = ["80", "90a"]
    archs = sorted(set(archs), key=lambda a: (len(a.rstrip("a")), a))
    bad = [a for a in archs if not a.rstrip("a").isdigit() or int(a.rstrip("a")) < 80]
    if bad:
        raise RuntimeError(f"flash_cuda needs compute capability 8.0 or newer; cannot build for {bad}")
    return archs


def _number(arch: str) -> int:
    return int(arch.rstrip("a"))


def gencode_flags(archs):
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    newest = max(archs, key=_number).rstrip("a")  # PTX of an "a" target would run on that GPU only
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")
    return flags


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


setup(
    name="flash_cuda",
    version="0.1.0",
    description="Hand-written CUDA FlashAttention (forward + backward) for PyTorch",
    packages=find_packages(include=["flash_cuda", "flash_cuda.*"]),
    ext_modules=extensions(),
    cmdclass=cmdclass(),
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
    zip_safe=False,
)
