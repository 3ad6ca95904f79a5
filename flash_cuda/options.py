"""The checks of the options that shape a call's logits and pick its kernels (scale, window,
softcap, ALiBi slopes, attention sinks, dropout, kernel tier), with the messages they raise, and
:class:`ScoreOptions`, the validated form in which those options travel to the custom ops and the
extension. :mod:`flash_cuda.validation` runs them after the tensor checks (and names them too).
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["ScoreOptions", "KERNELS", "check_scale", "check_window", "check_softcap", "check_alibi", "check_sinks",
           "check_kernel", "check_dropout", "check_score_options", "validate_options"]

# kernel name -> tier id understood by the extension (0 = pick by dtype).
KERNELS = {"auto": 0, "simt": 1, "mma": 2, "wgmma": 3}
MAX_SEQLEN = 2**31 - 1  # sequence positions are int32 inside the kernels
PREFIX = "flash_cuda.attention: "
VARLEN_PREFIX = "flash_cuda.varlen_attention: "


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def is_traced(x) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat)) or torch.compiler.is_compiling()


def check_scale(scale, head_dim: int, prefix: str = PREFIX) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(
            f"{prefix}scale must be a finite real number (Python float or int) or None, "
            f"got {type(scale).__name__}"
        )
    # Written as a comparison (not math.isfinite) so that torch.compile can trace it when
    # it treats the scale as a symbolic float; NaN fails both comparisons.
    if not (-math.inf < scale < math.inf):
        raise ValueError(f"{prefix}scale must be a finite real number, got {scale}")
    return scale if is_traced(scale) else float(scale)


def is_int(x) -> bool:
    return isinstance(x, (int, torch.SymInt)) and not isinstance(x, bool)


def check_window(window_size, is_causal: bool, prefix: str = PREFIX) -> Tuple[int, int]:
    """Returns (window_left, window_right) as the extension takes them: -1 is unbounded and
    is_causal is window_right = 0."""
    if not isinstance(window_size, (tuple, list)):
        raise TypeError(
            f"{prefix}window_size must be a tuple (left, right) of two ints (-1: unbounded on "
            f"that side), got {type(window_size).__name__}"
        )
    if len(window_size) != 2:
        raise ValueError(
            f"{prefix}window_size must have exactly 2 entries (left, right), got "
            f"{len(window_size)}: {tuple(window_size)!r}"
        )
    sides = []
    for side, w in zip(("left", "right"), window_size):
        if not is_int(w):
            raise TypeError(
                f"{prefix}window_size {side} must be a Python int (-1 for unbounded, or a "
                f"number of keys >= 0), got {type(w).__name__}"
            )
        if not (-1 <= w <= MAX_SEQLEN):
            raise ValueError(
                f"{prefix}window_size {side} must be -1 (unbounded) or a number of keys in "
                f"[0, 2^31 - 1], got {w}"
            )
        sides.append(w if is_traced(w) else int(w))
    left, right = sides
    if is_causal:
        if right > 0:
            raise ValueError(
                f"{prefix}is_causal=True means no key after the query's diagonal "
                f"(window_size right = 0), but window_size is ({left}, {right}); pass "
                f"is_causal=False with window_size=({left}, {right}) for a window that reaches "
                f"{right} keys ahead, or a right side of 0 or -1 with is_causal=True"
            )
        right = 0
    return left, right


def check_softcap(softcap, prefix: str = PREFIX) -> float:
    if isinstance(softcap, bool) or not isinstance(softcap, (numbers.Real, torch.SymFloat,
                                                             torch.SymInt)):
        raise TypeError(
            f"{prefix}softcap must be a finite real number >= 0 (0 disables it), got "
            f"{type(softcap).__name__}"
        )
    if not (0 <= softcap < math.inf):  # NaN fails too
        raise ValueError(
            f"{prefix}softcap must be a finite real number >= 0 (0 disables it; the logits "
            f"become softcap * tanh(logits / softcap)), got {softcap}"
        )
    return softcap if is_traced(softcap) else float(softcap)


def check_alibi(alibi_slopes, batch: int, heads: int, prefix: str = PREFIX) -> Optional[Tensor]:
    """Type, dtype and shape of the ALiBi slopes (the device is checked with the others);
    returns them detached (no gradient flows to the slopes) and contiguous."""
    if alibi_slopes is None:
        return None
    accepted = f"float32 slopes of shape ({heads},) or ({batch}, {heads})"
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError(
            f"{prefix}alibi_slopes must be None or a torch.Tensor of {accepted}, got "
            f"{type(alibi_slopes).__name__}"
        )
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(
            f"{prefix}alibi_slopes must be a float32 tensor, got {dtype_name(alibi_slopes.dtype)}"
        )
    shape = tuple(alibi_slopes.shape)
    if shape != (heads,) and shape != (batch, heads):
        raise ValueError(
            f"{prefix}alibi_slopes must have shape ({heads},) (one slope per query head) or "
            f"({batch}, {heads}) (per batch entry and query head), got {shape}"
        )
    return alibi_slopes.detach().contiguous()


def check_sinks(sinks, heads: int, prefix: str = PREFIX) -> Optional[Tensor]:
    """Type, dtype and shape of the attention sinks (the device is checked with the others):
    one logit per query head, shape ``(heads,)``, any floating dtype (gpt-oss keeps them in the
    model's dtype). Returns them as the kernels take them, float32 and contiguous; the
    conversion is differentiable, so a gradient reaches the sinks in their own dtype."""
    if sinks is None:
        return None
    accepted = f"a floating tensor of shape ({heads},) (one logit per query head)"
    if not isinstance(sinks, Tensor):
        raise TypeError(f"{prefix}sinks must be None or {accepted}, got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"{prefix}sinks must be {accepted}, got dtype {dtype_name(sinks.dtype)}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"{prefix}sinks must be {accepted}, got shape {tuple(sinks.shape)}")
    return sinks.to(torch.float32).contiguous()


def check_kernel(kernel, dtype: torch.dtype, features: Sequence[str] = (),
                 prefix: str = PREFIX) -> int:
    """The tier id for ``kernel``; ``features`` names the options in use that the Hopper
    (wgmma) tier does not support yet (softcap with deterministic=True: its backward)."""
    if not isinstance(kernel, str) or kernel not in KERNELS:
        raise ValueError(
            f"{prefix}kernel must be one of 'auto', 'simt', 'mma', 'wgmma', got {kernel!r}"
        )
    if kernel == "simt" and dtype != torch.float32:
        raise ValueError(
            f"{prefix}kernel='simt' is the float32 kernel, but the inputs are "
            f"{dtype_name(dtype)}; use kernel='mma' or 'auto' for float16/bfloat16"
        )
    if kernel in ("mma", "wgmma") and dtype == torch.float32:
        raise ValueError(
            f"{prefix}kernel={kernel!r} is a float16/bfloat16 tensor-core kernel, but the "
            f"inputs are float32; use kernel='simt' or 'auto' for float32"
        )
    if kernel == "wgmma" and features:
        raise ValueError(
            f"{prefix}kernel='wgmma' (the Hopper tier) does not support {', '.join(features)} "
            f"yet; use kernel='mma' or 'auto' (which picks a tier that does)"
        )
    return KERNELS[kernel]


def check_dropout(dropout_p, kernel, prefix: str = PREFIX) -> float:
    """dropout_p as a float in [0, 1]; with dropout, float16 / bfloat16 calls run the mma.sync
    kernels and float32 ones the simt kernels (kernel='wgmma' has no dropout)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{prefix}dropout_p must be a number in [0, 1], got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if dropout_p and kernel == "wgmma":
        raise ValueError(f"{prefix}dropout_p > 0 runs on kernel='auto', 'mma' (float16 / bfloat16) or 'simt' "
                         f"(float32), got kernel='wgmma'")
    return dropout_p


class ScoreOptions(NamedTuple):
    """The validated options that shape the logits, in the form (and the order) the custom ops
    and the extension take them: ``scale``; the window sides (-1 unbounded, is_causal is
    ``window_right = 0``); ``softcap`` (0: off); the ALiBi slopes (None, or float32 and
    contiguous). One value travels from validation to the op call, where ``*opts`` spreads it
    into the op's plain arguments (a torch.library schema takes no Python objects)."""
    scale: float
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None

    def ext_args(self) -> tuple:
        """The extension's arguments for these options, as the binding's types."""
        return (float(self.scale), int(self.window_left), int(self.window_right), float(self.softcap),
                self.alibi_slopes)


def check_score_options(head_dim: int, scale, is_causal: bool, window_size, softcap,
                        prefix: str) -> ScoreOptions:
    """Scale, window and softcap checked (no ALiBi slopes). The defaults take the short way: a
    small call (a decode step) pays for every microsecond."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_scale(scale, head_dim, prefix)
    if type(window_size) is tuple and window_size == (-1, -1):
        left, right = -1, 0 if is_causal else -1
    else:
        left, right = check_window(window_size, is_causal, prefix)
    if softcap != 0.0 or type(softcap) is not float:
        softcap = check_softcap(softcap, prefix)
    return ScoreOptions(scale, left, right, softcap)


def validate_options(q: Tensor, *, batch: int, scale, is_causal: bool, window_size, softcap,
                     alibi_slopes, kernel, varlen: bool, prefix: str,
                     deterministic: bool = False) -> Tuple[ScoreOptions, int]:
    """The checks shared by attention and varlen_attention once the tensors' types, dtypes,
    shapes and strides are known good: scale, window, softcap, ALiBi slopes, kernel. Returns
    (options, tier), tier the extension's kernel id."""
    opts = check_score_options(q.shape[-1], scale, is_causal, window_size, softcap, prefix)
    if alibi_slopes is not None:
        heads = q.shape[-2] if varlen else q.shape[1]
        opts = ScoreOptions(opts.scale, opts.window_left, opts.window_right, opts.softcap,
                            check_alibi(alibi_slopes, batch, heads, prefix))
    if kernel == "auto" and type(kernel) is str:
        return opts, 0
    # The Hopper tier runs windows, softcap, ALiBi and packed batches; softcap's backward only
    # on its warp-specialized kernel, which adds dQ in a varying order: not deterministic=True
    # (kernel='auto' then takes the mma.sync backward).
    features = ["softcap with deterministic=True"] if opts.softcap > 0 and deterministic else []
    return opts, check_kernel(kernel, q.dtype, features, prefix)
