"""flash_cuda as the FLASH_ATTENTION backend of ``torch.nn.functional.scaled_dot_product_attention``.

    import flash_cuda.integrations.sdpa                     # registers the name "flash_cuda"
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    activate_flash_attention_impl("flash_cuda")   # SDPA's flash backend now runs flash_cuda
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    restore_flash_attention_impl()                # back to PyTorch's own flash kernels

PyTorch's flash-attention registry (``torch.nn.attention.register_flash_attention_impl``,
PyTorch 2.10 and newer) lets a library replace the CUDA kernels of the aten flash-attention
ops. Importing this module only adds the name :data:`IMPL_NAME` to that registry (nothing is
replaced until it is activated; importing works on any torch). Activation makes this module's
functions the CUDA kernels of

* ``aten::_scaled_dot_product_flash_attention`` and its ``_backward``: what
  ``scaled_dot_product_attention`` calls when it selects the flash backend (the default choice
  on many GPUs, or forced with ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``), (B, H, S, D);
* ``aten::_flash_attention_forward`` / ``_backward`` (and
  ``_flash_attention_forward_no_dropout_inplace`` where the torch has it): the lower-level ops
  in the (B, S, H, D) or packed (total, H, D) layout behind nested-tensor SDPA and
  ``torch.nn.attention.varlen``.

The ops keep the meaning PyTorch's own FlashAttention-2 kernels give them:

* ``is_causal`` is bottom-right aligned (query ``i`` sees key ``j`` iff ``j <= i + Sk - Sq``),
  as in flash_cuda. ``scaled_dot_product_attention``'s own ``is_causal`` is top-left aligned,
  and SDPA keeps it so by never sending a causal call with ``Sq != Sk`` to the flash backend
  (that call goes to another backend, or fails with "No available kernel" when only flash is
  allowed); ``torch.nn.attention.bias.causal_lower_right`` relies on the bottom-right meaning.
* The window sizes are read as PyTorch's kernels read them (:func:`flash_window`).
* The logsumexp is float32, natural log, (B, H, Sq) dense or (H, total_q) packed; a row that
  sees no key gets ``-inf`` (PyTorch's kernels write ``+inf`` there) and output 0.
* With ``torch.use_deterministic_algorithms(True)`` the backward is flash_cuda's deterministic
  one.

* ``dropout_p > 0`` runs flash_cuda's attention dropout: the forward returns its record of the
  draws (seed, offset) as the ``rng_state`` output (uint64, 2 elements) and the backward, which
  SDPA hands it back to, regenerates the same mask. The numbers are flash_cuda's (its own
  Philox mapping), not those PyTorch's kernels would draw for the same seed.

Not supported, each a RuntimeError that names it: float32 inputs (not a flash-backend dtype; the backward op could not get
flash_cuda's float32 statistics), ``return_debug_mask``, ``alibi_slopes`` (the backward op has
no slopes argument), ``seqused_k`` and ``block_table``. ``num_splits`` is a speed hint and is
ignored.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _ext, ops
from ..validation import ScoreOptions, check_dropout, dtype_name, validate, validate_varlen

__all__ = ["IMPL_NAME", "MIN_TORCH_VERSION", "is_supported", "register", "activate", "deactivate",
           "flash_window"]

IMPL_NAME = "flash_cuda"
MIN_TORCH_VERSION = "2.10"

_PREFIX = "flash_cuda (SDPA flash backend): "
_DTYPES = (torch.float16, torch.bfloat16)
# Where flash_cuda offers what the aten ops' unsupported arguments ask for.
_ALTERNATIVES = {
    "alibi_slopes": "flash_cuda.attention / varlen_attention (alibi_slopes=...)",
    "seqused_k": "flash_cuda.attention_with_kvcache (cache_seqlens=...)",
    "block_table": "flash_cuda.attention_with_kvcache (block_table=...)",
}

# Calls of the forward / backward kernels since import, by kind: lets a caller (and the tests)
# see that SDPA really went through flash_cuda.
_calls: Counter = Counter()
# The handle of the CUDA kernels while they are registered (None otherwise).
_active: Optional["_Handle"] = None


# ---------------------------------------------------------------------------------------
# Argument mapping
# ---------------------------------------------------------------------------------------


def flash_window(is_causal: bool, window_size_left: Optional[int], window_size_right: Optional[int],
                 seqlen_k: int) -> Tuple[int, int]:
    """(window_left, window_right) for flash_cuda from the aten ops' arguments, read the way
    PyTorch's FlashAttention-2 kernels read them: ``None`` or a negative side is unbounded
    (-1), so is a side of at least ``seqlen_k`` keys (the packed ops pass ``max_seqlen_k``), and
    ``is_causal`` sets the right side to 0. Both use flash_cuda's bottom-right alignment."""

    def side(w) -> int:
        if w is None:
            return -1
        w = int(w)
        return -1 if w < 0 or w >= seqlen_k else w

    left = side(window_size_left)
    right = 0 if is_causal else side(window_size_right)
    return left, right


def _check_supported(op: str, query: Tensor, dropout_p: float, return_debug_mask: bool = False,
                     **unsupported) -> None:
    """The options flash_cuda cannot honour; ``unsupported`` maps argument names to values that
    must be None."""
    check_dropout(dropout_p, "auto", f"{_PREFIX}{op}: ")
    if query.dtype not in _DTYPES:
        raise RuntimeError(
            f"{_PREFIX}{op}: the flash backend takes float16 or bfloat16 inputs, got "
            f"{dtype_name(query.dtype)}")
    if return_debug_mask:
        raise RuntimeError(f"{_PREFIX}{op}: return_debug_mask=True is not supported (flash_cuda "
                           f"never materialises the attention matrix)")
    for name, value in unsupported.items():
        if value is not None:
            raise RuntimeError(f"{_PREFIX}{op}: {name} is not supported through the aten op; "
                               f"pass None, or call {_ALTERNATIVES[name]} directly")


def _layout_like(x: Tensor, like: Tensor) -> Tensor:
    """x with the strides of ``torch.empty_like(like)``, which the ops' meta functions promise
    (torch.compile plans with them). flash_cuda gives that layout whenever ``like`` is dense,
    so this copies only for views of the (B, S, H, D) ops that are not."""
    if x.stride() == like.stride():
        return x
    target = torch.empty_like(like, device="meta")
    if x.stride() == target.stride():
        return x
    res = torch.empty_like(like)
    res.copy_(x)
    return res


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rng_outputs(query: Tensor, rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """(rng_state, unused, debug_attn_mask) as PyTorch's kernels return them: with dropout,
    rng_state is the forward's (seed, offset) record (int64 [2], returned as uint64); without, a
    placeholder that no backward reads."""
    dev = query.device
    return (rng_state.view(torch.uint64) if rng_state is not None else torch.empty((2,), dtype=torch.uint64, device=dev),
            torch.empty((), dtype=torch.uint64, device=dev),
            torch.empty((0,), dtype=query.dtype, device=dev))


def _no_aux(query: Tensor) -> Tensor:
    # flash_cuda's extra softmax statistics exist only for float32 inputs; 16-bit ones have none.
    return torch.empty((0,), dtype=torch.float32, device=query.device)


# ---------------------------------------------------------------------------------------
# The computations, in flash_cuda's layouts: dense (B, H, S, D), packed (total, H, D)
# ---------------------------------------------------------------------------------------


def _dense_forward(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Optional[float],
                   window_left: Optional[int], window_right: Optional[int],
                   dropout_p: float = 0.0) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(out, lse, rng_state), rng_state None without dropout."""
    window = flash_window(is_causal, window_left, window_right, k.shape[2])
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    opts, tier = validate(q, k, v, scale=scale, window_size=window)
    _calls["forward"] += 1
    if dropout_p:
        out, lse, _, rng_state = ops.fwd_dropout_impl(q, k, v, opts, tier, float(dropout_p))
        return out, lse, rng_state
    out, lse, _ = ops.fwd_impl(q, k, v, opts, tier)
    return out, lse, None


def _dense_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    is_causal: bool, scale: Optional[float], window_left: Optional[int],
                    window_right: Optional[int], dropout_p: float = 0.0,
                    rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    wl, wr = flash_window(is_causal, window_left, window_right, k.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = [_last_dim_contiguous(t) for t in (dout, q, k, v, out)]
    _calls["backward"] += 1
    return ops.bwd_impl(*args, lse.contiguous(), _no_aux(q), None, ScoreOptions(scale, wl, wr),
                        torch.are_deterministic_algorithms_enabled(), 0, **_dropout_args(dropout_p, rng_state))


def _dropout_args(dropout_p: float, rng_state: Optional[Tensor]) -> dict:
    """The backward's dropout arguments from what SDPA hands back: the forward's rng_state output."""
    if not dropout_p:
        return {}
    if rng_state is None or rng_state.numel() != 2 or rng_state.element_size() != 8:
        raise RuntimeError(f"{_PREFIX}the backward with dropout_p={dropout_p} needs the forward's rng_state "
                           f"(2 64-bit elements), got {None if rng_state is None else tuple(rng_state.shape)}")
    return ops.dropout_kwargs(dropout_p, rng_state.contiguous().view(torch.int64))


def _packed_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                    max_q: int, max_k: int, is_causal: bool, scale: Optional[float],
                    window_left: Optional[int], window_right: Optional[int],
                    dropout_p: float = 0.0) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    window = flash_window(is_causal, window_left, window_right, int(max_k))
    q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
    opts, tier, max_q, max_k = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_q), int(max_k),
                                               scale=scale, window_size=window)
    _calls["forward"] += 1
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if dropout_p:
        out, lse, _, rng_state = ops.varlen_fwd_dropout_impl(q, k, v, cu_q, cu_k, max_q, max_k, opts, tier, False,
                                                             float(dropout_p))
        return out, lse, rng_state
    out, lse, _ = ops.varlen_fwd_impl(q, k, v, cu_q, cu_k, max_q, max_k, opts, tier, False)
    return out, lse, None


def _packed_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                     cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_q: int, max_k: int,
                     is_causal: bool, scale: Optional[float], window_left: Optional[int],
                     window_right: Optional[int], dropout_p: float = 0.0,
                     rng_state: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    wl, wr = flash_window(is_causal, window_left, window_right, int(max_k))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = [_last_dim_contiguous(t) for t in (dout, q, k, v, out)]
    _calls["backward"] += 1
    return ops.varlen_bwd_impl(*args, lse.contiguous(), _no_aux(q), None, cu_seqlens_q.contiguous(),
                               cu_seqlens_k.contiguous(), int(max_q), int(max_k), ScoreOptions(scale, wl, wr),
                               torch.are_deterministic_algorithms_enabled(), 0, **_dropout_args(dropout_p, rng_state))


# ---------------------------------------------------------------------------------------
# The kernels registered for the aten ops (their schemas' argument names and defaults)
# ---------------------------------------------------------------------------------------


def _sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                        scale=None):
    """aten::_scaled_dot_product_flash_attention: (B, H, S, D) inputs."""
    _check_supported("scaled_dot_product_attention", query, dropout_p, return_debug_mask)
    out, lse, rng = _dense_forward(query, key, value, is_causal, scale, None, None, dropout_p)
    rng_state, unused, debug_mask = _rng_outputs(query, rng)
    return (_layout_like(out, query), lse, None, None, query.shape[2], key.shape[2], rng_state, unused,
            debug_mask)


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                         dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """aten::_scaled_dot_product_flash_attention_backward."""
    _check_supported("scaled_dot_product_attention backward", query, dropout_p)
    grads = _dense_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale, None, None, dropout_p,
                            philox_seed)
    return tuple(_layout_like(g, t) for g, t in zip(grads, (query, key, value)))


def _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                   return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                   seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """aten::_flash_attention_forward: (B, S, H, D) inputs, or packed (total, H, D) ones with
    cum_seq_q / cum_seq_k. ``num_splits`` only tunes PyTorch's kernels: ignored."""
    _check_supported("_flash_attention_forward", query, dropout_p, return_debug_mask,
                     seqused_k=seqused_k, alibi_slopes=alibi_slopes, block_table=block_table)
    if cum_seq_q is None:
        out, lse, rng = _dense_forward(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                       is_causal, scale, window_size_left, window_size_right, dropout_p)
        out = out.transpose(1, 2)
    else:
        out, lse, rng = _packed_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                                        scale, window_size_left, window_size_right, dropout_p)
    return (_layout_like(out, query), lse) + _rng_outputs(query, rng)


def _flash_forward_no_dropout_inplace(out, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k,
                                      dropout_p, is_causal, return_debug_mask, *, scale=None,
                                      window_size_left=None, window_size_right=None, seqused_k=None,
                                      alibi_slopes=None, block_table=None, num_splits=None):
    """aten::_flash_attention_forward_no_dropout_inplace: writes the output into ``out``,
    returns the logsumexp."""
    res, lse, *_ = _flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                                  is_causal, return_debug_mask, scale=scale,
                                  window_size_left=window_size_left,
                                  window_size_right=window_size_right, seqused_k=seqused_k,
                                  alibi_slopes=alibi_slopes, block_table=block_table)
    out.copy_(res)
    return lse


def _flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                    dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                    window_size_right=None):
    """aten::_flash_attention_backward."""
    _check_supported("_flash_attention_backward", query, dropout_p)
    if cum_seq_q is None:
        t = [x.transpose(1, 2) for x in (grad_out, query, key, value, out)]
        grads = _dense_backward(*t, logsumexp, is_causal, scale, window_size_left, window_size_right, dropout_p,
                                rng_state)
        grads = [g.transpose(1, 2) for g in grads]
    else:
        grads = _packed_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
                                 max_k, is_causal, scale, window_size_left, window_size_right, dropout_p,
                                 rng_state)
    return tuple(_layout_like(g, x) for g, x in zip(grads, (query, key, value)))


# aten op -> kernel. The first two are in every torch that has the registry; an op the running
# torch does not define is skipped.
_KERNELS = (
    ("_scaled_dot_product_flash_attention", _sdpa_flash_forward),
    ("_scaled_dot_product_flash_attention_backward", _sdpa_flash_backward),
    ("_flash_attention_forward", _flash_forward),
    ("_flash_attention_backward", _flash_backward),
    ("_flash_attention_forward_no_dropout_inplace", _flash_forward_no_dropout_inplace),
)


# ---------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------


class _Handle:
    """What activation returns to torch's registry: ``remove()`` drops the kernels again, and
    the ops fall back to PyTorch's own."""

    def __init__(self, lib):
        self._lib = lib

    def remove(self) -> None:
        global _active
        if self._lib is not None:
            # Destroyed now rather than when the Library object is collected.
            self._lib._destroy()
            self._lib = None
        if _active is self:
            _active = None


def _install(dispatch_key: str = "CUDA") -> _Handle:
    """Registers the kernels for ``dispatch_key`` (the registry calls it with the default,
    CUDA, on activation)."""
    if not _ext.is_available():
        raise RuntimeError(f"{_PREFIX}cannot be activated: {_ext.unavailable_message()}")
    lib = torch.library.Library("aten", "IMPL", dispatch_key)
    try:
        with warnings.catch_warnings():
            # Replacing PyTorch's kernels is the point; the dispatcher warns about each one.
            warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
            for name, fn in _KERNELS:
                if hasattr(torch.ops.aten, name):
                    lib.impl(name, fn, dispatch_key)
    except BaseException:
        lib._destroy()
        raise
    handle = _Handle(lib)
    if dispatch_key == "CUDA":
        global _active
        _active = handle
    return handle


def is_supported() -> bool:
    """True when the running torch has the flash-attention registry (PyTorch 2.10 and newer)."""
    attn = torch.nn.attention
    return hasattr(attn, "register_flash_attention_impl") and hasattr(attn, "activate_flash_attention_impl")


def _require_registry():
    if not is_supported():
        raise RuntimeError(
            f"{_PREFIX}torch {torch.__version__} has no flash-attention registry "
            f"(torch.nn.attention.register_flash_attention_impl, PyTorch {MIN_TORCH_VERSION} and "
            f"newer); upgrade torch, or call flash_cuda.attention / flash_cuda.varlen_attention "
            f"directly")
    return torch.nn.attention


def register() -> None:
    """Adds :data:`IMPL_NAME` to torch's flash-attention registry (done on import where torch
    has the registry; calling it again is harmless). Replaces no kernel: that is
    ``torch.nn.attention.activate_flash_attention_impl(IMPL_NAME)``, or :func:`activate`.

    Raises RuntimeError, naming the PyTorch version needed, on a torch without the registry."""
    _require_registry().register_flash_attention_impl(IMPL_NAME, register_fn=_install)


def activate() -> None:
    """Registers and activates flash_cuda as SDPA's flash backend (the same as
    ``activate_flash_attention_impl(IMPL_NAME)`` after :func:`register`); undone by
    :func:`deactivate`. Raises RuntimeError without the registry or the compiled extension."""
    register()
    torch.nn.attention.activate_flash_attention_impl(IMPL_NAME)


def deactivate() -> None:
    """Gives the flash ops back to PyTorch's kernels if flash_cuda's are registered (through
    ``torch.nn.attention.restore_flash_attention_impl`` where torch has it and flash_cuda is
    the active implementation); otherwise does nothing."""
    attn = _require_registry()
    current = getattr(attn, "current_flash_attention_impl", lambda: None)()
    if current == IMPL_NAME and hasattr(attn, "restore_flash_attention_impl"):
        attn.restore_flash_attention_impl()
    if _active is not None:  # a registry without restore (or one that lost track of it)
        _active.remove()


if is_supported():
    register()
