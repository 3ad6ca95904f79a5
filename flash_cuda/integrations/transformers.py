"""flash_cuda as an attention implementation of Hugging Face transformers.

    import flash_cuda.integrations.transformers as fc_hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=fc_hf.ATTN_IMPLEMENTATION,
                                                 dtype=torch.bfloat16, device_map="cuda")

Importing this module registers two functions with transformers under the name
``ATTN_IMPLEMENTATION``: the attention itself (``AttentionInterface``) and the mask hook
(``AttentionMaskInterface``), which hands the attention the model's 2-D padding mask instead
of a materialised 4-D mask. A third, under ``PAGED_ATTN_IMPLEMENTATION`` (``"paged|fcuda"``),
is the attention of transformers' continuous batching (``model.generate_batch``). The
attention then takes one of three paths:

* no padding: :func:`flash_cuda.attention` on the model's (batch, heads, seq, head_dim) tensors,
  bottom-right causal (a prefill or a decode step against a cache lines up without a mask);
  a decode step (one to sixteen new tokens) runs the split-KV decode kernels;
* a 2-D padding mask: the padded tokens are dropped and the batch runs packed through
  :func:`flash_cuda.varlen_attention`, then the output is scattered back (zeros at the padded
  query positions). A static cache (``cache_implementation="static"``) always comes with the
  mask, which marks the cache's written rows. Under ``torch.compile`` the same result comes
  from a path without data-dependent shapes or host syncs (each row's kept tokens sorted to
  its end, two packed sequences per row), so a compiled decode step over a static cache is
  one graph;
* a padding-free packed batch (one row holding several sequences, either with transformers'
  ``cu_seq_lens_q`` / ``cu_seq_lens_k`` / ``max_length_q`` / ``max_length_k`` keyword
  arguments or with ``position_ids`` that restart): :func:`flash_cuda.varlen_attention` over the
  sequences.

From the model it takes the module's scaling, ``is_causal``, grouped-query heads (k / v are
never repeated), the sliding window (a window of ``w`` tokens sees the ``w - 1`` before it and
itself, as transformers' masks define it), logit softcapping (Gemma-2) and attention dropout
(the module's ``attention_dropout`` in training; a padded batch draws per sequence as
:func:`flash_cuda.varlen_attention` does) and attention sinks (gpt-oss: the module's ``s_aux``,
one logit per query head, goes to flash_cuda as ``sinks`` and gets its gradient).

Continuous batching packs the new tokens of every request into one row; the paged cache
(``cache.update``) returns each request's keys and values, and
:func:`flash_cuda.varlen_attention` attends them with the ``cu_seq_lens_q`` / ``cu_seq_lens_k``
it is given (per layer type for models with sliding and full layers), causal and bottom-right
aligned per request. transformers gives its decode fast path (``flash_attn_with_kvcache`` over
a block table) and CUDA graphs by default only to implementations named like FlashAttention
packages, so ``"paged|fcuda"`` runs every step, prefill and decode, through the packed path.
``generate_batch`` on a model loaded with ``ATTN_IMPLEMENTATION`` switches it to
``"paged|fcuda"`` by itself, unless a FlashAttention package is installed: then transformers
prefers that package; ``model.set_attn_implementation(PAGED_ATTN_IMPLEMENTATION)`` first keeps
flash_cuda.

The name carries no "flash": transformers treats every implementation whose name contains it
as a FlashAttention package to load from its kernel hub. From transformers 5.23 on, continuous
batching accepts no other name (``CONTINUOUS_BATCHING`` is then False).
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import interface

try:
    from transformers import AttentionInterface, AttentionMaskInterface
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "flash_cuda.integrations.transformers needs the transformers package (version 4.48 or newer, "
        "which has AttentionInterface and AttentionMaskInterface): pip install transformers") from exc

ATTN_IMPLEMENTATION = "fcuda"
"""The name to pass as ``attn_implementation`` to ``from_pretrained`` / ``from_config``."""

PAGED_ATTN_IMPLEMENTATION = "paged|" + ATTN_IMPLEMENTATION
"""The name for transformers' continuous batching (``generate_batch``)."""


def _runs_continuous_batching() -> bool:
    from packaging.version import Version  # (a requirement of transformers)

    import transformers
    return Version(transformers.__version__).release < (5, 23)


CONTINUOUS_BATCHING = _runs_continuous_batching()
"""Whether this transformers runs continuous batching through flash_cuda. From 5.23 on its
``generate_batch`` accepts only ``"sdpa"``, ``"paged|eager"`` and implementations named like
FlashAttention packages, which it loads from its kernel hub, and drops the ``"paged|"`` names:
there ``generate_batch`` raises transformers' ValueError for ``PAGED_ATTN_IMPLEMENTATION``.
``generate()``, training and every other path are unaffected."""

__all__ = ["ATTN_IMPLEMENTATION", "PAGED_ATTN_IMPLEMENTATION", "CONTINUOUS_BATCHING", "attention_forward",
           "paged_attention_forward", "padding_mask", "register"]


class _LastResult:
    """Remembers one result computed from a tensor (a padding mask, position ids) while that
    tensor is alive and unmodified. Every layer of a forward gets the same mask object, so the
    host sync of unpadding (the largest sequence length) happens once per forward, not once
    per layer."""

    def __init__(self):
        self._ref: Optional[weakref.ref] = None
        self._key = None
        self._value = None

    def get(self, tensor: Tensor, extra, compute: Callable):
        if torch.compiler.is_compiling():
            return compute()
        key = (tensor._version, extra)
        if self._ref is not None and self._ref() is tensor and self._key == key:
            return self._value
        value = compute()
        self._ref, self._key, self._value = weakref.ref(tensor), key, value
        return value


_UNPAD = _LastResult()
_PACKED = _LastResult()


def _unpad_indices(mask: Tensor) -> Tuple[Tensor, Tensor, int]:
    """Rows of a (batch, length) bool mask that are kept: flat indices, cu_seqlens, longest."""
    lengths = mask.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(mask.reshape(-1)).reshape(-1)
    cu_seqlens = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0


def _unpad_plan(mask: Tensor, q_len: int):
    """(indices_q, cu_q, max_q, indices_k, cu_k, max_k) for a padding mask over the keys.

    Queries are the last ``q_len`` positions of each row (a prefill has them all; a decode step
    with a cache has the newest, left padding keeping them at the end)."""
    indices_k, cu_k, max_k = _unpad_indices(mask)
    if q_len == mask.shape[1]:
        return indices_k, cu_k, max_k, indices_k, cu_k, max_k
    if q_len == 1:
        batch = mask.shape[0]
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device=mask.device)
        return cu_q[:-1].long(), cu_q, 1, indices_k, cu_k, max_k
    indices_q, cu_q, max_q = _unpad_indices(mask[:, -q_len:])
    return indices_q, cu_q, max_q, indices_k, cu_k, max_k


def _packed_plan(position_ids: Tensor) -> Optional[Tuple[Tensor, int]]:
    """cu_seqlens and the longest sequence of one row of packed sequences, or None when the
    positions count up without a restart (a single sequence)."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == pos.min()).reshape(-1)
    if starts.numel() <= 1 and bool((pos[1:] - pos[:-1] == 1).all()):
        return None
    cu = torch.cat([starts.to(torch.int32), torch.tensor([pos.numel()], dtype=torch.int32, device=pos.device)])
    return cu, int((cu[1:] - cu[:-1]).max())


def _window(sliding_window: Optional[int], is_causal: bool) -> Tuple[int, int]:
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    # transformers' window of w tokens: a query sees the w - 1 tokens before it and itself.
    return (sliding_window - 1, 0 if is_causal else sliding_window - 1)


def _options(is_causal: bool, scaling, sliding_window, softcap, dropout, sinks) -> dict:
    """The keyword arguments of flash_cuda.attention / varlen_attention for a module's call."""
    opts = dict(is_causal=is_causal, scale=scaling, window_size=_window(sliding_window, is_causal),
                softcap=float(softcap or 0.0), deterministic=torch.are_deterministic_algorithms_enabled(),
                dropout_p=float(dropout or 0.0))
    if sinks is not None:  # only when the model has them: calls without sinks keep the plain signature
        opts["sinks"] = sinks
    return opts


def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers' attention interface: query ``(batch, heads, q_len, head_dim)``, key / value
    ``(batch, kv_heads, kv_len, head_dim)``, ``attention_mask`` the 2-D padding mask from
    :func:`padding_mask` (or None). Returns ``(out, None)``, out ``(batch, q_len, heads,
    head_dim)``; attention weights are never materialised."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"flash_cuda takes a 2-D padding mask (batch, kv_len), got a {attention_mask.dim()}-D mask: build the "
            f"model with attn_implementation='{ATTN_IMPLEMENTATION}' so that transformers calls the "
            "flash_cuda mask hook (arbitrary 4-D masks are not supported)")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"flash_cuda needs value's head dim ({value.shape[-1]}) to equal query's "
                         f"({query.shape[-1]})")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    opts = _options(bool(is_causal), scaling, sliding_window, softcap, dropout, s_aux)
    batch, heads, q_len, head_dim = query.shape

    # (batch, heads, seq, dim) views as (batch, seq, heads, dim): the projections' own layout.
    q_bshd = query.transpose(1, 2)
    if attention_mask is not None:
        return _padded(q_bshd, key, value, attention_mask, opts), None

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        cu_q = None
        position_ids = kwargs.get("position_ids")
        if position_ids is not None and batch == 1 and q_len > 1 and position_ids.shape[-1] == q_len:
            plan = _PACKED.get(position_ids, None, lambda: _packed_plan(position_ids))
            if plan is not None:
                cu_q, max_q = plan
                cu_k, max_k = cu_q, max_q
    if cu_q is not None:
        out = interface.varlen_attention(
            q_bshd.reshape(-1, heads, head_dim), key.transpose(1, 2).reshape(-1, key.shape[1], head_dim),
            value.transpose(1, 2).reshape(-1, value.shape[1], head_dim), cu_q.to(torch.int32),
            cu_k.to(torch.int32), int(max_q), int(max_k), **opts)
        return out.view(batch, q_len, heads, head_dim), None

    out = interface.attention(query, key, value, **opts)
    return out.transpose(1, 2), None


def _padded(q_bshd: Tensor, key: Tensor, value: Tensor, mask: Tensor, opts) -> Tensor:
    batch, q_len, heads, head_dim = q_bshd.shape
    if key.shape[2] < mask.shape[1]:
        raise ValueError(f"flash_cuda: the padding mask covers {mask.shape[1]} keys, the cache holds {key.shape[2]}")
    if torch.compiler.is_compiling():
        return _padded_static_shapes(q_bshd, key, value, mask, opts)
    if key.shape[2] > mask.shape[1]:  # a static cache: rows past the mask are unwritten
        key, value = key[:, :, : mask.shape[1]], value[:, :, : mask.shape[1]]
    idx_q, cu_q, max_q, idx_k, cu_k, max_k = _UNPAD.get(mask, q_len, lambda: _unpad_plan(mask, q_len))
    k = key.transpose(1, 2).reshape(-1, key.shape[1], head_dim).index_select(0, idx_k)
    v = value.transpose(1, 2).reshape(-1, value.shape[1], head_dim).index_select(0, idx_k)
    q = q_bshd.reshape(-1, heads, head_dim).index_select(0, idx_q)
    out = interface.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **opts)
    # Padded query positions get zeros, as every FlashAttention integration of transformers does.
    full = out.new_zeros(batch * q_len, heads, head_dim).index_copy(0, idx_q, out)
    return full.view(batch, q_len, heads, head_dim)


def _kept_last(keep: Tensor) -> Tuple[Tensor, Tensor]:
    """For a (batch, n) bool mask: the permutation of each row that puts its dropped positions
    first and its kept ones last, each in their order, and the number kept per row (int32)."""
    order = torch.argsort(keep.to(torch.int8), dim=1, stable=True)
    return order, keep.sum(dim=1, dtype=torch.int32)


def _two_per_row(kept: Tensor, n: int) -> Tensor:
    """cu_seqlens of 2 * batch sequences over rows of n positions: per row, first the dropped
    positions, then the kept ones."""
    ends = torch.arange(1, kept.shape[0] + 1, dtype=torch.int32, device=kept.device) * n
    return F.pad(torch.stack([ends - kept, ends], dim=1).reshape(-1), (1, 0))


def _padded_static_shapes(q_bshd: Tensor, key: Tensor, value: Tensor, mask: Tensor, opts) -> Tensor:
    """:func:`_padded` without data-dependent shapes or host syncs, for torch.compile (a compiled
    decode step over a static cache captures whole). A stable sort moves each row's kept keys
    (and kept queries) to the end of the row, so every row is two sequences of one packed batch
    over all batch * kv_len keys: its dropped positions (computed, then discarded), then its
    kept ones, bottom-right aligned as in :func:`_padded`. Keys past the mask (a static cache's
    unwritten rows) are dropped."""
    batch, q_len, heads, head_dim = q_bshd.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    keep_q = mask[:, mask.shape[1] - q_len:]
    keep_k = F.pad(mask, (0, kv_len - mask.shape[1]))
    order_q, kept_q = _kept_last(keep_q)
    order_k, kept_k = _kept_last(keep_k)
    rows = torch.arange(batch, device=mask.device).unsqueeze(1)
    q = q_bshd[rows, order_q].reshape(batch * q_len, heads, head_dim)
    k = key.transpose(1, 2)[rows, order_k].reshape(batch * kv_len, kv_heads, head_dim)
    v = value.transpose(1, 2)[rows, order_k].reshape(batch * kv_len, kv_heads, head_dim)
    out = interface.varlen_attention(q, k, v, _two_per_row(kept_q, q_len), _two_per_row(kept_k, kv_len),
                                     int(q_len), int(kv_len), **opts)
    out = out.view(batch, q_len, heads, head_dim)
    full = torch.empty_like(out).index_put_((rows, order_q), out)
    return torch.where(keep_q[:, :, None, None], full, full.new_zeros(()))


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Optional[Callable] = None,
    attention_mask: Optional[Tensor] = None,
    use_vmap: bool = False,
    **kwargs,
) -> Optional[Tensor]:
    """transformers' mask hook: the 2-D padding mask over the ``kv_length`` keys the layer sees,
    or None when nothing is padded. The causal pattern and sliding window come from the
    attention's own arguments; pattern changes that only a dense mask can express (transformers
    passes them as extra mask functions, e.g. bidirectional image tokens) are refused."""
    if use_vmap:
        raise ValueError(
            "flash_cuda cannot express this model's mask (it adds a custom pattern to the causal mask); use "
            "attn_implementation='sdpa' for it")
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    # Under torch.compile the mask is always handed on: whether it is all ones is a value the
    # graph cannot branch on, and the compiled padded path gives the same result either way.
    if mask.shape[1] == kv_length and not torch.compiler.is_compiling() and bool(mask.all()):
        return None
    return mask


def paged_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                            attention_mask: Optional[Tensor], **kwargs) -> Tuple[Tensor, None]:
    """transformers' continuous batching (``generate_batch``, ``attn_implementation=
    "paged|fcuda"``): query ``(1, heads, total_q, head_dim)`` holds the new tokens of every
    request of the batch, key / value ``(1, kv_heads, total_q, head_dim)`` theirs. The paged
    cache stores the new keys and returns each request's whole keys / values packed
    ``(total_k, kv_heads, head_dim)``; :func:`flash_cuda.varlen_attention` attends them with
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (per layer type when the model mixes sliding and full
    layers), causal and bottom-right aligned per request. Returns ``(out, None)``, out
    ``(total_q, heads, head_dim)``."""
    # The model's options (dropout, scaling, sliding_window, softcap, s_aux) and the batch's
    # (cache, cu_seq_lens_*, max_seqlen_*, read / write indices, block_table) come as keywords.
    cache, block_table = kwargs.get("cache"), kwargs.get("block_table")
    cu_seq_lens_q, cu_seq_lens_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_seqlen_q, max_seqlen_k = kwargs.get("max_seqlen_q"), kwargs.get("max_seqlen_k")
    sliding_window = kwargs.get("sliding_window")
    if cache is None or cu_seq_lens_q is None or cu_seq_lens_k is None:
        raise ValueError(
            f"'paged|{ATTN_IMPLEMENTATION}' is continuous batching's attention (generate_batch), called with its "
            f"paged cache and packed batch; for a plain forward or generate() use '{ATTN_IMPLEMENTATION}'")
    if block_table is not None:
        raise ValueError("flash_cuda's paged attention reads the cache through cache.update, not a block table "
                         "(continuous batching's decode fast path is for FlashAttention packages)")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"flash_cuda needs value's head dim ({value.shape[-1]}) to equal query's "
                         f"({query.shape[-1]})")
    if isinstance(cu_seq_lens_k, dict):  # a model with sliding and full layers: one set of lengths per kind
        layer_type = "sliding_attention" if sliding_window is not None and sliding_window > 0 else "full_attention"
        cu_seq_lens_k, max_seqlen_k = cu_seq_lens_k[layer_type], max_seqlen_k[layer_type]
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                              read_index=kwargs["read_index"], write_index=kwargs["write_index"])
    opts = _options(True, kwargs.get("scaling"), sliding_window, kwargs.get("softcap"), kwargs.get("dropout", 0.0),
                    kwargs.get("s_aux"))
    out = interface.varlen_attention(
        query.transpose(1, 2).squeeze(0), key, value, cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32),
        int(max_seqlen_q), int(max_seqlen_k), **opts)
    return out, None


def register() -> str:
    """Registers flash_cuda with transformers (importing this module already did) and returns
    the implementation name. ``"paged|" + ATTN_IMPLEMENTATION`` is registered too, for
    continuous batching."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)
    AttentionInterface.register(PAGED_ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION


register()
