"""Attention dropout's random numbers on the GPU (csrc/core/dropout.cuh) against the executable
spec (flash_cuda.reference.dropout_keep_mask): the kernels' Philox draws and the mapping of an
element to its draw must give the reference's mask bit for bit, for any shape, 64-bit seeds and
offsets. GPU only.
"""

from __future__ import annotations

import pytest
import torch

from flash_cuda import _ext
from flash_cuda import reference as R

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(1, 1, 16, 16), (2, 3, 37, 53), (1, 2, 130, 257)], ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("seed,offset", [(0, 0), (2024, 8), (2 ** 64 - 1, (5 << 32) + 12), (0x1234_5678_9ABC, 4)])
def test_kernel_mask_equals_reference(shape, p, seed, offset):
    B, H, Sq, Sk = shape
    like = torch.empty(0, device="cuda")
    got = _ext.require().dropout_mask(B, H, Sq, Sk, R.dropout_keep_threshold(p), seed, offset, like)
    ref = R.dropout_keep_mask(B, H, Sq, Sk, p, seed=seed, offset=offset, device="cuda")
    assert got.shape == ref.shape and torch.equal(got.bool(), ref)


def test_mask_op_rejects_a_bad_threshold():
    with pytest.raises(RuntimeError, match="threshold must be in \\[0, 65536\\], got 70000"):
        _ext.require().dropout_mask(1, 1, 4, 4, 70000, 0, 0, torch.empty(0, device="cuda"))
