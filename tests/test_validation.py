"""Input validation of flash_cuda.attention and the behaviour without the extension (CPU).

Every check raises before anything is allocated or launched, with a message naming the
problem and what is accepted. Shapes/dtypes/strides/scale/kernel errors are raised
before the device check, so they are exercised here with CPU or meta tensors; the
device, GPU-capability and build errors are exercised with CPU tensors and patches.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flash_cuda
from flash_cuda import _ext, validation

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def qkv(B=1, Hq=2, Hkv=2, Sq=4, Sk=4, D=16, dtype=F16, device="cpu"):
    q = torch.randn(B, Hq, Sq, D, device=device).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, device=device).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, device=device).to(dtype)
    return q, k, v


def meta(*shape, dtype=F16):
    return torch.empty(shape, dtype=dtype, device="meta")


def raises(exc, match, q, k, v, **kw):
    with pytest.raises(exc, match=match) as info:
        flash_cuda.attention(q, k, v, **kw)
    assert str(info.value).startswith("flash_cuda.attention: ") or exc is RuntimeError
    return str(info.value)


# ---------------------------------------------------------------------------------------
# Import and build
# ---------------------------------------------------------------------------------------


def test_import_without_extension_subprocess():
    """`import flash_cuda` works when flash_cuda._C cannot be imported; attention() then
    raises a RuntimeError explaining how to build it."""
    code = textwrap.dedent("""
        import sys
        sys.modules["flash_cuda._C"] = None   # any import of the extension fails
        import torch, flash_cuda
        from flash_cuda import _ext, validation
        _ext.sources_dir = lambda: None   # nor kernel sources to compile at first use
        assert flash_cuda.is_available() is False
        validation.check_device = lambda q, k, v: None   # CPU tensors reach the build check
        q = torch.randn(1, 1, 4, 8)
        try:
            flash_cuda.attention(q, q, q)
        except RuntimeError as e:
            msg = str(e)
        else:
            raise SystemExit("no error raised")
        assert "flash_cuda._C" in msg and "pip install ." in msg, msg
        print("OK")
    """)
    env = dict(os.environ)
    pkg_parent = str(Path(flash_cuda.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_parent, env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=env)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr


def test_is_available_is_bool():
    assert isinstance(flash_cuda.is_available(), bool)
    assert flash_cuda.is_available() == (_ext._C is not None)


def test_public_api():
    assert callable(flash_cuda.attention)
    assert flash_cuda.attention.__doc__ and "bottom-right" in flash_cuda.attention.__doc__
    assert set(flash_cuda.KERNELS) == {"auto", "simt", "mma", "wgmma"}
    assert flash_cuda.SUPPORTED_DTYPES == (F16, BF16, F32)
    assert hasattr(torch.ops.flash_cuda, "fwd") and hasattr(torch.ops.flash_cuda, "bwd")
    assert hasattr(torch.ops.flash_cuda, "varlen_fwd") and hasattr(torch.ops.flash_cuda, "varlen_bwd")
    assert callable(flash_cuda.varlen_attention) and "cu_seqlens" in flash_cuda.varlen_attention.__doc__
    for name in ("window_size", "softcap", "alibi_slopes"):
        assert name in flash_cuda.attention.__doc__ and name in flash_cuda.varlen_attention.__doc__


def test_attention_without_extension_raises_build_message(no_extension, monkeypatch):
    monkeypatch.setattr(validation, "check_device", lambda q, k, v: None)
    q, k, v = qkv()
    with pytest.raises(RuntimeError) as info:
        flash_cuda.attention(q, k, v)
    msg = str(info.value)
    assert "not built" in msg
    assert "pip install --no-build-isolation ." in msg
    assert "nvcc" in msg and "CUDA build of PyTorch" in msg


def test_unavailable_message_reports_load_failure(monkeypatch):
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_AVAILABLE", False)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", ImportError("undefined symbol: _ZN2at6Tensor"))
    msg = _ext.unavailable_message()
    assert "failed to load" in msg and "undefined symbol" in msg
    assert "pip install --no-build-isolation ." in msg


def test_ops_without_extension_raise(no_extension):
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="pip install --no-build-isolation"):
        torch.ops.flash_cuda.fwd(q, k, v, 0.25, -1, -1, 0.0, None, False, 0)


def test_cpu_tensors_rejected():
    q, k, v = qkv()
    msg = raises(RuntimeError, "must be CUDA tensors", q, k, v)
    assert "cpu" in msg


def test_meta_tensors_rejected_as_non_cuda():
    raises(RuntimeError, "must be CUDA tensors", meta(1, 2, 4, 16), meta(1, 2, 4, 16), meta(1, 2, 4, 16))


def test_different_devices():
    q, k, v = qkv()
    msg = raises(RuntimeError, "same device", q, meta(1, 2, 4, 16), v)
    assert "meta" in msg and "cpu" in msg


def test_capability_below_8_rejected(monkeypatch):
    monkeypatch.setattr(validation, "device_capability", lambda device: (7, 5))
    with pytest.raises(RuntimeError, match=r"compute capability 8\.0 or newer.*7\.5"):
        validation.check_capability(torch.device("cuda", 0))


def test_capability_8_accepted(monkeypatch):
    for cap in ((8, 0), (8, 6), (9, 0), (10, 0)):
        monkeypatch.setattr(validation, "device_capability", lambda device, cap=cap: cap)
        validation.check_capability(torch.device("cuda", 0))


# ---------------------------------------------------------------------------------------
# Types and dtypes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_not_a_tensor(which):
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].tolist()
    msg = raises(TypeError, f"{which} must be a torch.Tensor", args["q"], args["k"], args["v"])
    assert "list" in msg


@pytest.mark.parametrize("flag", ["is_causal", "return_lse", "deterministic"])
def test_flags_must_be_bool(flag):
    q, k, v = qkv()
    raises(TypeError, f"{flag} must be a bool", q, k, v, **{flag: 1})


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8, torch.complex64, torch.bool])
def test_unsupported_dtype(dtype):
    q, k, v = (torch.zeros(1, 2, 4, 16, dtype=dtype) for _ in range(3))
    msg = raises(TypeError, "unsupported dtype", q, k, v)
    assert "float16" in msg and "bfloat16" in msg and "float32" in msg


@pytest.mark.parametrize("dtypes", [(F16, BF16, F16), (F32, F32, F16), (BF16, F16, F16)])
def test_mixed_dtypes(dtypes):
    q, k, v = (torch.zeros(1, 2, 4, 16, dtype=d) for d in dtypes)
    msg = raises(TypeError, "same dtype", q, k, v)
    assert "q:" in msg and "k:" in msg and "v:" in msg


# ---------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("ndim", [3, 5])
def test_ndim(which, ndim):
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].flatten(0, 1) if ndim == 3 else args[which].unsqueeze(0)
    msg = raises(ValueError, f"{which} must be a 4-D tensor", args["q"], args["k"], args["v"])
    assert f"{ndim}-D" in msg


def test_batch_mismatch():
    q, _, _ = qkv(B=2)
    _, k, v = qkv(B=3)
    raises(ValueError, "same batch size", q, k, v)
    q, k, _ = qkv(B=2)
    _, _, v = qkv(B=1)
    raises(ValueError, "same batch size", q, k, v)


def test_head_dim_mismatch():
    q, _, _ = qkv(D=16)
    _, k, v = qkv(D=32)
    msg = raises(ValueError, "same head dim", q, k, v)
    assert "16" in msg and "32" in msg
    q, k, _ = qkv(D=16)
    _, _, v = qkv(D=24)
    raises(ValueError, "same head dim", q, k, v)


def test_k_v_heads_differ():
    q, k, _ = qkv(Hq=4, Hkv=2)
    _, _, v = qkv(Hq=4, Hkv=1)
    raises(ValueError, "k and v must have the same shape", q, k, v)


def test_k_v_seqlen_differ():
    q, k, _ = qkv(Sk=5)
    _, _, v = qkv(Sk=6)
    msg = raises(ValueError, "k and v must have the same shape", q, k, v)
    assert "(1, 2, 5, 16)" in msg and "(1, 2, 6, 16)" in msg


@pytest.mark.parametrize("hq,hkv", [(3, 2), (4, 3), (2, 4), (5, 2)])
def test_heads_not_multiple(hq, hkv):
    q, k, v = qkv(Hq=hq, Hkv=hkv)
    raises(ValueError, f"query heads \\({hq}\\) must be a multiple of .*\\({hkv}\\)", q, k, v)


def test_zero_heads():
    raises(ValueError, "at least 1", meta(1, 0, 4, 16), meta(1, 0, 4, 16), meta(1, 0, 4, 16))
    raises(ValueError, "at least 1", meta(1, 2, 4, 16), meta(1, 0, 4, 16), meta(1, 0, 4, 16))


@pytest.mark.parametrize("d", [0, 4, 12, 20, 100, 250, 264, 512])
def test_bad_head_dim(d):
    q, k, v = (torch.zeros(1, 1, 4, d, dtype=F16) for _ in range(3))
    msg = raises(ValueError, "unsupported head dim", q, k, v)
    assert "multiple of 8 in [8, 256]" in msg


@pytest.mark.parametrize("d", [8, 16, 40, 72, 136, 256])
def test_good_head_dims_pass_to_device_check(d):
    q, k, v = (torch.zeros(1, 1, 4, d, dtype=BF16) for _ in range(3))
    raises(RuntimeError, "must be CUDA tensors", q, k, v)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_last_dim_not_contiguous(which):
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v}
    t = args[which]
    args[which] = t.transpose(2, 3).contiguous().transpose(2, 3)  # same values, stride(-1) != 1
    msg = raises(ValueError, f"{which} must have a contiguous last dimension",
                 args["q"], args["k"], args["v"])
    assert ".contiguous()" in msg and "stride(-1) == 1" in msg


def test_non_contiguous_with_unit_last_stride_is_fine():
    q, k, v = qkv()
    q = torch.randn(1, 4, 2, 16, dtype=F16).transpose(1, 2)  # bshd view
    k = torch.randn(1, 2, 8, 32, dtype=F16)[:, :, ::2, :16]  # strided slice
    assert not q.is_contiguous() and not k.is_contiguous()
    raises(RuntimeError, "must be CUDA tensors", q, k, v)


def test_batch_too_large():
    raises(ValueError, "batch size \\(65536\\).*at most 65535",
           meta(65536, 1, 1, 8), meta(65536, 1, 1, 8), meta(65536, 1, 1, 8))


def test_heads_too_large():
    raises(ValueError, "query heads \\(65536\\).*at most 65535",
           meta(1, 65536, 1, 8), meta(1, 1, 1, 8), meta(1, 1, 1, 8))


def test_grid_limits_accepted():
    # 65535 is still fine: the error is the device one
    raises(RuntimeError, "must be CUDA tensors",
           meta(65535, 1, 1, 8), meta(65535, 1, 1, 8), meta(65535, 1, 1, 8))


def test_seqlen_q_too_long():
    raises(ValueError, "below 2\\^31", meta(1, 1, 2**31, 8), meta(1, 1, 4, 8), meta(1, 1, 4, 8))


def test_seqlen_k_too_long():
    raises(ValueError, "below 2\\^31", meta(1, 1, 4, 8), meta(1, 1, 2**31, 8), meta(1, 1, 2**31, 8))


# ---------------------------------------------------------------------------------------
# scale and kernel
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_scale_not_finite(scale):
    q, k, v = qkv()
    raises(ValueError, "scale must be a finite real number", q, k, v, scale=scale)


@pytest.mark.parametrize("scale", ["0.1", torch.tensor(0.1), [0.1], True, 1j])
def test_scale_not_a_real_number(scale):
    q, k, v = qkv()
    raises(TypeError, "scale must be a finite real number", q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [None, 0.1, 1, 2.5, -0.3, 0.0])
def test_scale_accepted(scale):
    q, k, v = qkv()
    raises(RuntimeError, "must be CUDA tensors", q, k, v, scale=scale)


def test_default_scale():
    assert validation.check_scale(None, 64) == 1.0 / math.sqrt(64)
    assert validation.check_scale(3, 64) == 3.0


@pytest.mark.parametrize("kernel", ["fast", "MMA", "", None, 1])
def test_unknown_kernel(kernel):
    q, k, v = qkv()
    msg = raises(ValueError, "kernel must be one of", q, k, v, kernel=kernel)
    assert "'auto'" in msg and "'simt'" in msg and "'mma'" in msg and "'wgmma'" in msg


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_simt_needs_fp32(dtype):
    q, k, v = qkv(dtype=dtype)
    raises(ValueError, "kernel='simt' is the float32 kernel", q, k, v, kernel="simt")


@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
def test_tensor_core_kernels_need_16bit(kernel):
    q, k, v = qkv(dtype=F32)
    raises(ValueError, f"kernel='{kernel}' is a float16/bfloat16", q, k, v, kernel=kernel)


@pytest.mark.parametrize("dtype,kernel,tier", [(F32, "auto", 0), (F32, "simt", 1), (F16, "auto", 0),
                                               (F16, "mma", 2), (BF16, "mma", 2), (F16, "wgmma", 3),
                                               (BF16, "wgmma", 3)])
def test_kernel_tiers(dtype, kernel, tier):
    assert validation.check_kernel(kernel, dtype) == tier


# ---------------------------------------------------------------------------------------
# Accepted inputs reach the device check (nothing else rejects them)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_requires_grad_and_gqa_accepted(dtype):
    q, k, v = qkv(Hq=8, Hkv=2, Sq=3, Sk=7, dtype=dtype)
    q.requires_grad_()
    k.requires_grad_()
    raises(RuntimeError, "must be CUDA tensors", q, k, v, is_causal=True, return_lse=True)


@pytest.mark.parametrize("B,Sq,Sk", [(0, 4, 4), (1, 0, 4), (1, 4, 0), (0, 0, 0)])
def test_empty_sizes_accepted(B, Sq, Sk):
    q, k, v = qkv(B=B, Sq=Sq, Sk=Sk)
    raises(RuntimeError, "must be CUDA tensors", q, k, v)


def test_validation_before_extension_check(no_extension):
    """Bad inputs are reported as such even when the extension is missing."""
    q, k, v = qkv(D=12)
    raises(ValueError, "unsupported head dim", q, k, v)
