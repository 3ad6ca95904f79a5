"""flash_cuda: hand-written CUDA FlashAttention for PyTorch.

    import flash_cuda
    out = flash_cuda.attention(q, k, v, is_causal=True)          # like F.scaled_dot_product_attention
    out, lse = flash_cuda.attention(q, k, v, return_lse=True)
    out = flash_cuda.attention(q, k, v, is_causal=True, window_size=(255, 0), softcap=30.0)
    out = flash_cuda.varlen_attention(q_packed, k_packed, v_packed, cu_seqlens_q, cu_seqlens_k,
                                      max_seqlen_q, max_seqlen_k, is_causal=True)
    out = flash_cuda.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                            cache_seqlens=lengths, is_causal=True)

``import flash_cuda`` works without the compiled extension (e.g. on a CPU-only machine);
:func:`is_available` tells whether it is loaded, :func:`unavailable_reason` why not (None
when it is), and :func:`attention` raises a RuntimeError with build instructions when it is
not. ``python3 -m flash_cuda`` checks an installation: versions, GPUs, the kernels' build, a
self-test (``--bench``: a short benchmark against SDPA). :mod:`flash_cuda.reference` holds
the pure-PyTorch specification of the kernels (runs anywhere).
"""

from ._ext import is_available, unavailable_reason
from .interface import (KERNELS, MAX_HEAD_DIM, MIN_HEAD_DIM, SUPPORTED_DTYPES, attention,
                        varlen_attention)
from .kvcache import attention_with_kvcache
from .fp8 import attention_fp8, varlen_attention_fp8
from . import reference

__version__ = "0.1.0"

__all__ = [
    "attention",
    "varlen_attention",
    "attention_with_kvcache",
    "attention_fp8",
    "varlen_attention_fp8",
    "is_available",
    "unavailable_reason",
    "reference",
    "KERNELS",
    "SUPPORTED_DTYPES",
    "MIN_HEAD_DIM",
    "MAX_HEAD_DIM",
    "__version__",
]
