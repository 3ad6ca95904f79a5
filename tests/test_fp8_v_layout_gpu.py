"""V laid out for the FP8 forward's P V product (csrc/core/fp8_v_layout.cuh): each head dim's keys
contiguous, every group of 32 keys in the order of P's e4m3 A fragments (csrc/core/fragment.cuh:
e4m3_pv_key), zeros past the sequence; a packed batch's V in one slot of max_seqlen_k keys per
sequence. The layout is the kernel's business (the users pass V as it is), so its statement lives
here, beside the test: byte for byte against that statement."""

from __future__ import annotations

import pytest
import torch

from flash_cuda import _ext

gpu = pytest.mark.gpu


def e4m3_pv_key(c: int) -> int:
    """The key at column c of a 32-key k-step: a thread's A-fragment register holds its own
    accumulator columns 2t, 2t + 1, 8 + 2t, 9 + 2t (and the same 16 keys on) as A columns
    4t .. 4t + 3."""
    return 16 * (c // 16) + 8 * ((c % 4) // 2) + 2 * ((c % 16) // 4) + (c % 2)


def expected_layout(v: torch.Tensor) -> torch.Tensor:
    """(B, Hkv, Sk, D) e4m3 -> (B, Hkv, D, Sk rounded up to 32) as bytes."""
    B, H, S, D = v.shape
    S_pad = (S + 31) // 32 * 32
    padded = torch.zeros((B, H, S_pad, D), dtype=torch.uint8, device=v.device)
    padded[:, :, :S] = v.view(torch.uint8)
    order = torch.tensor([32 * (j // 32) + e4m3_pv_key(j % 32) for j in range(S_pad)], dtype=torch.long,
                         device=v.device)
    return padded[:, :, order, :].transpose(2, 3).contiguous()


def test_key_order_is_a_permutation_of_each_k_step():
    assert sorted(e4m3_pv_key(c) for c in range(32)) == list(range(32))
    # thread t's A columns 4t .. 4t + 3 are its accumulator keys 2t, 2t + 1, 8 + 2t, 9 + 2t
    for t in range(4):
        assert [e4m3_pv_key(4 * t + i) for i in range(4)] == [2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t]
        assert [e4m3_pv_key(16 + 4 * t + i) for i in range(4)] == [16 + 2 * t, 17 + 2 * t, 24 + 2 * t, 25 + 2 * t]


def _random_e4m3(shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # every byte pattern but the NaNs (0x7f, 0xff), so that equal bytes are all the test compares
    x = torch.randint(0, 255, shape, generator=g, device="cuda", dtype=torch.uint8)
    x[x == 0x7F] = 0x7E
    return x.view(torch.float8_e4m3fn)


@gpu
@pytest.mark.parametrize("B,H,S,D", [(1, 1, 32, 16), (2, 3, 100, 64), (1, 2, 257, 128), (2, 1, 1000, 256),
                                     (1, 1, 1, 128), (1, 2, 64, 96), (3, 2, 0, 64)])
def test_layout_byte_for_byte(B, H, S, D):
    C = _ext.require()
    v = _random_e4m3((B, H, S, D), seed=S + D)
    got = C.fp8_v_layout(v)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (B, H, D, (S + 31) // 32 * 32)
    assert torch.equal(got.view(torch.uint8), expected_layout(v))


@gpu
def test_strided_views():
    C = _ext.require()
    # (B, S, H, D) transposed, and a slice of a wider tensor: rows 16-byte aligned, stride(-1) 1
    base = _random_e4m3((2, 300, 4, 160), seed=7)
    v = base[..., 16:144].transpose(1, 2)
    assert not v.is_contiguous()
    assert torch.equal(C.fp8_v_layout(v).view(torch.uint8), expected_layout(v.contiguous()))


@gpu
def test_rejects_bad_inputs():
    C = _ext.require()
    with pytest.raises(RuntimeError, match="must be float8_e4m3fn"):
        C.fp8_v_layout(torch.zeros((1, 1, 32, 64), device="cuda", dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        C.fp8_v_layout(_random_e4m3((1, 1, 32, 24), seed=1))
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        C.fp8_v_layout(_random_e4m3((1, 1, 33, 80), seed=2)[..., 8:72])


@gpu
@pytest.mark.parametrize("lens,max_k,D", [((5, 0, 300, 129), 300, 128), ((33,), 33, 256), ((7, 64, 1), 100, 128),
                                          ((40, 90), 50, 128)])
def test_packed_layout_byte_for_byte(lens, max_k, D):
    # Sequence b's keys (at most max_k of them: a longer one is cut, as the kernel cuts it) in slot b,
    # its positions from 0, zeros after them.
    C = _ext.require()
    v = _random_e4m3((sum(lens), 2, D), seed=sum(lens) + D)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    got = C.fp8_v_layout_packed(v, cu, max_k)
    S_pad = (max_k + 31) // 32 * 32
    assert got.dtype == torch.float8_e4m3fn and got.shape == (len(lens), 2, D, S_pad)
    dense = torch.zeros((len(lens), 2, max_k, D), dtype=torch.uint8, device="cuda")
    for b, n in enumerate(lens):
        a, m = int(cu[b]), min(n, max_k)
        dense[b, :, :m] = v[a:a + m].view(torch.uint8).transpose(0, 1)
    assert torch.equal(got.view(torch.uint8), expected_layout(dense.view(torch.float8_e4m3fn)))
