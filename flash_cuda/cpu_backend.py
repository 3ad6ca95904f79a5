"""The block kernels of :func:`flash_cuda.distributed.ring_attention` on CPU tensors (any device,
float64 included): :mod:`flash_cuda.reference`'s blocked forward / backward and its merge of
partial results, behind the interface the ring expects of a block kernel (``forward``,
``backward``, ``merge``, ``acc_dtype``, ``has_stats``; the CUDA one is
:class:`flash_cuda.ring.CudaBlocks`). :mod:`flash_cuda.reference` itself stays the specification.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .validation import ScoreOptions

__all__ = ["ReferenceBlocks"]


class ReferenceBlocks:
    """flash_cuda.reference's blocked forward / backward with the options ``opts`` (its window
    is set per block; its ALiBi slopes are not supported)."""

    def __init__(self, q: Tensor, opts: ScoreOptions):
        self.opts = opts
        self.acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.has_stats = False

    def forward(self, q, k, v, wl, wr, sm_margin=0):  # (sm_margin: a GPU launch's; unused here)
        out, lse = reference.attention_forward_blocked(q, k, v, scale=self.opts.scale, window_size=(wl, wr),
                                                       softcap=self.opts.softcap)
        return out, lse.to(self.acc_dtype), None

    def backward(self, dout, q, k, v, out, lse, stats, dlse, wl, wr, need_dq, need_dkdv):
        return reference.attention_backward_blocked(dout, q, k, v, out, lse, scale=self.opts.scale,
                                                    window_size=(wl, wr), softcap=self.opts.softcap, dlse=dlse)

    def merge(self, a, a_lse, a_stats, b, b_lse, b_stats, out, out_lse, out_stats):
        o, lse = reference.combine_splits([a.to(self.acc_dtype), b.to(self.acc_dtype)], [a_lse, b_lse.to(a_lse.dtype)],
                                          out.dtype)
        out.copy_(o)
        out_lse.copy_(lse)
