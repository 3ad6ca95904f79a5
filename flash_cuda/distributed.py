"""Context-parallel attention: one sequence split over the ranks of a torch.distributed group.

    import torch.distributed as dist
    from flash_cuda import distributed as fcd

    dist.init_process_group("nccl")                      # torchrun sets rank / world size
    torch.cuda.set_device(local_rank)
    q, k, v = (fcd.shard(x, dim=2) for x in (q_full, k_full, v_full))   # (B, H, S / W, D)
    out = fcd.ring_attention(q, k, v, is_causal=True)    # this rank's slice of the output
    out_full = fcd.unshard(out, dim=2)                   # every rank: the whole sequence

Each rank holds a slice ``(B, H, S_local, D)`` of q, k and v, cut by :func:`shard` in one of
two layouts:

* ``"zigzag"`` (default): the sequence is cut into ``2W`` chunks of ``S_local / 2``
  positions and rank ``r`` holds chunks ``r`` and ``2W - 1 - r``, in that order. Under a
  causal mask every rank then has the same amount of work.
* ``"contiguous"``: rank ``r`` holds chunk ``r`` of ``W``. Under a causal mask rank ``r``
  works on ``r + 1`` blocks, so the last rank sets the pace.

Two methods compute the same result:

* ``"ring"``: K and V travel around the ring of ranks (``W - 1`` hops, each block sent to
  the next rank while the one in hand is attended). Every step attends the local queries to
  the key block in hand with flash_cuda's kernels, with the mask rewritten in the block's
  own coordinates (a block entirely in the future is skipped, one entirely in the past runs
  without a mask, the diagonal block is plain causal); the partial ``(out, lse)`` pairs are
  merged by log-sum-exp in float32. The backward sends K and V around again; each rank
  keeps its own block's dK and dV parts, and the other ranks' parts accumulate in float32 as
  they travel with the block from its first visitor to its last and then home (``W - 1``
  hops).
* ``"allgather"`` (Llama-3 style, for grouped-query attention whose K / V are small): K and
  V are all-gathered once, each query chunk attends its true key range of the whole
  sequence in one call, and the backward reduce-scatters dK / dV in float32.

``method="auto"`` takes the all-gather when the gathered K and V are no larger than the
local q and out together (``W <= Hq / Hkv``) or when a ring step would be too short to hide
its transfer; else the ring.

Gradients use the global softmax statistics: each block's backward gets the merged lse (and,
for float32 inputs on the GPU, the merged per-row statistics the fp32 kernels read) and the
final output, so that delta = rowsum(dO * O) and P = exp(x - lse) are those of the whole row.

Attention sinks (``sinks=``, as in :func:`flash_cuda.attention`) enter each row once: the
blocks and their merges run without them, and the sink is merged into the whole row's
(out, lse) at the end as one more partial with no value (lse' = logaddexp(lse, sink),
out' = out * exp(lse - lse')). The backward then needs nothing more than the sink-including
statistics; d(sinks) comes from this rank's rows (out, lse, dO, dlse) without communication,
each rank returning its own part (see :func:`ring_attention`).

Communication goes through torch.distributed only: NCCL for CUDA tensors (its own stream per
communicator; the compute stream waits on a transfer only where the received block is first
used), gloo for CPU tensors, where the blocks run :mod:`flash_cuda.reference` (float64 or
float32), so that the whole algorithm is testable without a GPU. Nothing assumes one host, and
no symmetric memory or multicast is used.

Every call, the ranks exchange a small metadata tensor (shapes, dtype, device kind, options):
a rank with bad inputs makes every rank raise a clear error instead of leaving the others
waiting on a transfer that never comes. The first call of a group waits for it before sending
anything. Later calls with short local blocks send their first K / V block before it returns,
sized as the group agreed in its last call (a rank whose inputs changed sends placeholders of
that size), so that its round trip runs under the local block's kernels; nothing received is
read, and nothing is returned, before every rank's metadata has been compared.

This module is the public API and its checks; the algorithm (layouts, block plans, block
kernels, merges, communication, the autograd Function) is :mod:`flash_cuda.ring`.
"""

from __future__ import annotations

import struct
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from . import _ext, ring, validation
from .cpu_backend import ReferenceBlocks
from .validation import ScoreOptions

__all__ = ["ring_attention", "shard", "unshard", "LAYOUTS", "METHODS"]

LAYOUTS = ("zigzag", "contiguous")
METHODS = ("auto", "ring", "allgather")

_PREFIX = "flash_cuda.distributed.ring_attention: "


def _check_layout(layout, prefix: str) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{prefix}layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _group_size_rank(group, world_size=None, rank=None) -> Tuple[int, int]:
    if world_size is not None or rank is not None:
        if world_size is None or rank is None:
            raise ValueError("pass both world_size and rank, or neither (then the group's are used)")
        if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
        return world_size, rank
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flash_cuda.distributed: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group first (or pass world_size= and rank= to shard)")
    r = dist.get_rank(group)
    if r < 0:
        raise RuntimeError("flash_cuda.distributed: this process is not a member of the given group")
    return dist.get_world_size(group), r


def shard(x: Tensor, dim: int = 2, group=None, layout: str = "zigzag", *,
          world_size: Optional[int] = None, rank: Optional[int] = None) -> Tensor:
    """This rank's slice of the full-sequence tensor ``x`` along ``dim``, as
    :func:`ring_attention` expects it (``dim=2`` for ``(B, H, S, D)``).

    ``layout="zigzag"``: chunks ``r`` and ``2W - 1 - r`` of ``2W`` (a new tensor);
    ``"contiguous"``: chunk ``r`` of ``W`` (a view). The length along ``dim`` must be a
    multiple of ``2W`` (zigzag) or ``W``. ``world_size`` / ``rank`` override the group's
    (to cut data without a process group)."""
    _check_layout(layout, "flash_cuda.distributed.shard: ")
    world, r = _group_size_rank(group, world_size, rank)
    n = ring.chunks_per_rank(layout) * world
    length = x.shape[dim]
    if length % n != 0:
        raise ValueError(
            f"flash_cuda.distributed.shard: the length along dim {dim} ({length}) must be a multiple "
            f"of {n} ({'2 * ' if layout == 'zigzag' else ''}world size {world}) for layout {layout!r}")
    c = length // n
    parts = [x.narrow(dim, cid * c, c) for cid in ring.chunk_ids(layout, world, r)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(x: Tensor, dim: int = 2, group=None, layout: str = "zigzag") -> Tensor:
    """The inverse of :func:`shard`: all-gathers every rank's slice along ``dim`` and puts the
    chunks back in sequence order. Collective (every rank of ``group`` calls it with the same
    shape); the result is the same on every rank and carries no gradient."""
    _check_layout(layout, "flash_cuda.distributed.unshard: ")
    world, _ = _group_size_rank(group)
    dim = dim % x.dim()
    local = x.detach().movedim(dim, 0).contiguous()
    gathered = local.new_empty((world * local.shape[0],) + tuple(local.shape[1:]))
    ring.all_gather(gathered, local, group=group)
    return ring.to_sequence_order(gathered, 0, layout, world).movedim(0, dim)


# ---------------------------------------------------------------------------------------
# Validation, local then collective
# ---------------------------------------------------------------------------------------

_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_FIELDS = (("q shape", 1, 5), ("k / v shape", 5, 9), ("dtype", 9, 10), ("device type", 10, 11),
           ("is_causal", 11, 12), ("window_size", 12, 14), ("layout", 14, 15), ("method", 15, 16),
           ("return_lse", 16, 17), ("deterministic", 17, 18), ("scale", 18, 19), ("softcap", 19, 20),
           # The backward is collective too: every rank must build it, with the same transfers.
           ("which inputs need a gradient (q, k or v)", 20, 22),
           # Sinks on some ranks only would give rows of one sequence different softmaxes.
           ("sinks", 22, 23))
_META_LEN = 23


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_float(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


def _validate_local(q, k, v, *, is_causal, scale, window_size, softcap, layout, method, return_lse,
                    deterministic, sinks, nccl: bool) -> ScoreOptions:
    p = _PREFIX
    validation.check_types(q, k, v, is_causal, return_lse, deterministic, p)
    _check_layout(layout, p)
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"{p}method must be one of {METHODS}, got {method!r}")
    if not (q.device == k.device == v.device):
        raise RuntimeError(f"{p}q, k and v must be on the same device, got q: {q.device}, k: {k.device}, "
                           f"v: {v.device}")
    if q.is_cuda:
        validation.check_dtypes(q, k, v, p)
    else:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype not in _CPU_DTYPES:
                raise TypeError(f"{p}{name} has dtype {t.dtype}; on CPU (flash_cuda.reference) the "
                                f"supported dtypes are float16, bfloat16, float32 and float64")
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"{p}q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    validation.check_shapes(q, k, v, p)
    validation.check_strides(q, k, v, p)
    S = q.shape[2]
    if k.shape[2] != S:
        raise ValueError(
            f"{p}q and k / v must hold the same number of local positions (dim 2): every rank holds "
            f"its slice of one sequence of queries and keys, got q: {S}, k / v: {k.shape[2]}")
    if S == 0:
        raise ValueError(f"{p}the local slice is empty (dim 2 of q is 0)")
    if layout == "zigzag" and S % 2 != 0:
        raise ValueError(
            f"{p}layout='zigzag' holds two equal chunks per rank, so the local length must be even, "
            f"got {S} (cut the sequence with flash_cuda.distributed.shard, or use layout='contiguous')")
    opts = validation.check_score_options(q.shape[-1], scale, is_causal, window_size, softcap, p)
    if sinks is not None:
        validation.check_aux_devices(q, p, sinks=validation.check_sinks(sinks, q.shape[1], p))
    if q.is_cuda:
        if not nccl:
            raise RuntimeError(f"{p}CUDA tensors need a process group with the NCCL backend, got "
                               f"{dist.get_backend()!r}")
        if q.device.index != torch.cuda.current_device():
            raise RuntimeError(
                f"{p}the inputs are on {q.device} but the current CUDA device is "
                f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device({q.device.index}) first "
                f"(NCCL transfers run on the current device)")
        validation.check_device(q, k, v, p)
        if not _ext.is_available():
            raise RuntimeError(_ext.unavailable_message())
    return ScoreOptions(float(opts.scale), opts.window_left, opts.window_right, float(opts.softcap))


def _metadata(ok: bool, q, k, local: Optional[ScoreOptions], is_causal, layout, method, return_lse, deterministic,
              need_dq, need_dkdv, has_sinks) -> List[int]:
    if not ok:
        return [1] + [0] * (_META_LEN - 1)
    return ([0, *q.shape, *k.shape, _DTYPE_CODES[q.dtype], int(q.is_cuda), int(is_causal), local.window_left,
             local.window_right, LAYOUTS.index(layout), METHODS.index(method), int(return_lse), int(deterministic),
             _float_bits(local.scale), _float_bits(local.softcap), int(need_dq), int(need_dkdv), int(has_sinks)])


def _describe(name: str, values) -> str:
    if name == "dtype":
        names = {c: str(d).replace("torch.", "") for d, c in _DTYPE_CODES.items()}
        return names.get(values[0], "?")
    if name == "device type":
        return "cuda" if values[0] else "cpu"
    if name == "layout":
        return repr(LAYOUTS[values[0]])
    if name == "method":
        return repr(METHODS[values[0]])
    if name in ("scale", "softcap"):
        return repr(_bits_float(values[0]))
    if name in ("is_causal", "return_lse", "deterministic"):
        return str(bool(values[0]))
    if name == "sinks":
        return "given" if values[0] else "None"
    if name.startswith("which inputs"):
        return "+".join(n for n, f in zip(("q", "k/v"), values) if f) or "none"
    return str(tuple(values)) if len(values) > 1 else str(values[0])


# How the metadata check of an NCCL group travels (bench/ring.py --check measures both):
# * "gloo": a host-side gloo group of the same ranks (made once per group). Its all-gather of a
#   few integers needs no device synchronization, but its round trip over the host's sockets
#   takes a few hundred microseconds, and the ring's first transfer waits for it.
# * "nccl": the group itself. The all-gather is queued on a side stream (so that it does not
#   wait for kernels the call queues after it) and copied to pinned host memory there; the host
#   waits for that stream alone. On a GPU free of earlier work it takes tens of microseconds; a
#   persistent kernel already running holds every SM, and the all-gather waits for it.
CHECK_TRANSPORTS = ("gloo", "nccl")
CHECK_TRANSPORT = "gloo"

_CHECK_GROUPS: dict = {}


def _check_group(group, ranks: tuple):
    """(group for the metadata all-gather, its tensors' device); ``ranks``: the group's."""
    if "nccl" not in str(dist.get_backend(group)):
        return group, torch.device("cpu")
    if CHECK_TRANSPORT == "nccl":
        return group, torch.device("cuda", torch.cuda.current_device())
    if ranks not in _CHECK_GROUPS:
        # Made by the members alone (no other rank of the world takes part); the first call of
        # ring_attention is collective over them anyway.
        _CHECK_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _CHECK_GROUPS[ranks], torch.device("cpu")


class _Agreed(NamedTuple):
    """What every rank of a group agreed on in its last call: the metadata row, and the K / V
    blocks' shape, dtype and device kind and the method, from which every rank alike knows
    the size of the next call's first transfer before any check."""
    meta: Tuple[int, ...]
    kv_shape: Tuple[int, ...]
    dtype: torch.dtype
    cuda: bool
    method: str


# By the group's ranks. Set only from an all-gathered row that every rank reads alike, so that
# every rank of a group holds the same entry and takes the same path in its next call.
_AGREED: dict = {}

# Whether a call whose group has agreed before sends its first K / V block before the check
# returns (see ring_attention's body); bench/ring.py --speculate measures both. It pays where
# the check's round trip (0.3-0.6 ms) is a large part of a call: local blocks of up to
# SPECULATE_MAX_FLOPS (4 B Hq S_local^2 D, about 2 ms of attention). On 2 x H200 the 8k causal
# forward gained, and at 32k tokens per GPU, where the first transfer then shares the SMs with a
# long local block, the queued calls lost 3-5% (OPTIMIZATION.md, ring attention).
SPECULATE = True
SPECULATE_MAX_FLOPS = 1e12


def _speculates(agreed: Optional["_Agreed"]) -> bool:
    """Whether the next call of a group that agreed on ``agreed`` sends its first block early:
    a function of the agreed entry alone, which every rank holds alike."""
    if not SPECULATE or agreed is None or agreed.method != "ring":
        return False
    B, Hq, S, D = agreed.meta[1:5]
    return 4 * B * Hq * S * S * D <= SPECULATE_MAX_FLOPS


class _Agreement(NamedTuple):
    """The metadata all-gather in flight (_agree_start); finish() waits for it and raises on
    every rank if one rank's inputs failed its local checks or the ranks disagree; else it
    records the row as the group's agreed metadata (``key``, ``agreed``). ``every`` is on the
    host; ``done`` (a CUDA event, or None for a host-side group) is recorded after the copy
    that fills it."""
    every: Tensor
    work: object
    done: Optional[object]
    group: object
    device: torch.device
    error: Optional[BaseException]
    key: Optional[tuple] = None
    agreed: Optional[_Agreed] = None

    def finish(self) -> None:
        if self.done is None:
            self.work.wait()
        else:
            self.done.synchronize()
        _agree_check(self.every, self.group, self.device, self.error)
        if self.key is not None and self.agreed is not None:
            _AGREED[self.key] = self.agreed


def _agree_start(meta: List[int], group, device, error: Optional[BaseException], key=None,
                 agreed: Optional[_Agreed] = None) -> _Agreement:
    """Starts the all-gather of the ranks' metadata; the ring's forward finishes it before its
    first transfer, or (speculative) before its second step."""
    W = dist.get_world_size(group)
    if device.type == "cpu":
        mine = torch.tensor(meta, dtype=torch.int64)
        every = torch.empty(W * _META_LEN, dtype=torch.int64)
        return _Agreement(every, ring.all_gather(every, mine, group=group, async_op=True), None, group, device,
                          error, key, agreed)
    side = ring.side_stream(device)
    mine_host = torch.tensor(meta, dtype=torch.int64, pin_memory=True)
    every = torch.empty(W * _META_LEN, dtype=torch.int64, pin_memory=True)
    with torch.cuda.stream(side):
        mine = mine_host.to(device, non_blocking=True)
        every_dev = torch.empty(W * _META_LEN, dtype=torch.int64, device=device)
        ring.all_gather(every_dev, mine, group=group, async_op=True).wait()  # the side stream waits
        every.copy_(every_dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    return _Agreement(every, None, done, group, device, error, key, agreed)


class _LateAgreement:
    """The check of a call that sends its first block before it (``speculative``): started by
    the forward once its local block's kernels and the first transfer are queued, so that its
    round trip runs under them, and finished before the received block is read."""
    speculative = True

    def __init__(self, start):
        self._start, self._agreement = start, None

    def start(self) -> None:
        if self._agreement is None:
            self._agreement = self._start()

    def finish(self) -> None:
        self.start()
        self._agreement.finish()


def _placeholder_hop(group, world: int, rank: int, agreed: _Agreed) -> None:
    """The first transfer of a call whose metadata is not the group's agreed one (new shapes or
    options, or inputs that failed the local checks): every other rank whose metadata is the
    agreed one sends and receives the agreed K / V blocks before it knows of this rank's
    change, so this rank sends and receives blocks of that size too (placeholders, never read)
    and none of them waits on a transfer that never comes."""
    device = torch.device("cuda", torch.cuda.current_device()) if agreed.cuda else torch.device("cpu")
    send = [torch.empty(agreed.kv_shape, dtype=agreed.dtype, device=device) for _ in range(2)]
    recv = [torch.empty_like(t) for t in send]
    ring.Ring.wait(ring.Ring(group, world, rank).exchange(send, recv))


def _all_gather_text(text: str, group, device) -> List[str]:
    """Every rank's ``text``, through two all-gathers of small tensors (the byte counts, then the
    UTF-8 bytes padded to the longest): no pickling, so no numpy needed either."""
    W = dist.get_world_size(group)
    data = list(text.encode("utf-8"))
    sizes = torch.empty(W, dtype=torch.int64, device=device)
    ring.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    sizes = sizes.tolist()
    longest = max(1, max(sizes))
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.tensor(data, dtype=torch.uint8, device=device)
    every = torch.empty(W * longest, dtype=torch.uint8, device=device)
    ring.all_gather(every, mine, group=group)
    rows = every.view(W, longest).tolist()
    return [bytes(rows[r][:sizes[r]]).decode("utf-8", errors="replace") for r in range(W)]


def _agree_check(every: Tensor, group, device: torch.device, error: Optional[BaseException]) -> None:
    W = dist.get_world_size(group)
    rows = every.view(W, _META_LEN).tolist()
    failed = [r for r in range(W) if rows[r][0] != 0]
    if failed:
        # Only now, as every rank knows that one failed, do they all exchange the messages.
        messages = _all_gather_text("" if error is None else f"{type(error).__name__}: {error}", group, device)
        if error is not None:
            raise error
        details = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        raise RuntimeError(f"{_PREFIX}rank(s) {failed} of the group rejected their inputs, so no rank "
                           f"sent anything ({details})")
    for name, a, b in _FIELDS:
        values = [tuple(row[a:b]) for row in rows]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {r}: {_describe(name, values[r])}" for r in range(W))
            raise ValueError(
                f"{_PREFIX}the ranks of the group disagree on {name} ({shown}); every rank must pass its "
                f"slice of the same sequence (same batch, heads, local length, head dim, dtype) with the "
                f"same options")


# ---------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    layout: str = "zigzag",
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    method: str = "auto",
    deterministic: bool = False,
    sinks: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Attention over a sequence split across the ranks of ``group`` (context parallelism).

    Every rank of ``group`` (default: the world) calls it together with its slice of q, k, v
    and gets its slice of the output: the same values as :func:`flash_cuda.attention` on the
    whole sequence, cut as :func:`shard` cuts it. Differentiable (q, k, v, sinks, and lse
    when returned); the backward of q, k and v is collective too.

    Args:
        q: ``(batch, heads, S_local, head_dim)``, this rank's slice of the queries.
        k, v: ``(batch, kv_heads, S_local, head_dim)``, this rank's slice of the keys and
            values (GQA: ``heads`` a multiple of ``kv_heads``, as in flash_cuda.attention).
            Every rank holds the same ``S_local``; the whole sequence is ``W * S_local``.
            CUDA tensors (float16, bfloat16, float32; process group with NCCL, inputs on the
            current device) run flash_cuda's kernels; CPU tensors (float16 .. float64; gloo)
            run flash_cuda.reference.
        group: the process group the sequence is split over (None: the default group).
        is_causal: causal over the whole sequence (query at global position p sees keys at
            positions <= p).
        scale: as flash_cuda.attention (default ``1 / sqrt(head_dim)``).
        layout: ``"zigzag"`` (default; balanced under a causal mask) or ``"contiguous"``,
            how the sequence is cut (see :func:`shard`).
        window_size: ``(left, right)`` in global positions: the query at position p sees the
            keys at p - left .. p + right (-1: unbounded side), is_causal sets right to 0.
            Works with both methods; blocks outside every window are skipped, though the ring
            still passes every block around.
        softcap: as flash_cuda.attention.
        return_lse: also return lse ``(batch, heads, S_local)`` of the whole row (float32;
            float64 for float64 inputs).
        method: ``"ring"``, ``"allgather"`` or ``"auto"`` (module docstring).
        deterministic: as flash_cuda.attention (the backward kernels' dQ order); the ring
            order and the merges are fixed, so with it the whole call is reproducible.
        sinks: ``None`` or attention sinks as in flash_cuda.attention: one logit per query
            head, a floating tensor ``(heads,)`` on q's device, the same values on every rank
            (a replicated parameter; the values are not compared across ranks, only whether
            sinks are given). Every row's softmax over the whole sequence gets the one term
            ``exp(sinks[h])`` with no value row, merged once per row after the blocks (lse
            includes it). The sinks take the kernels' precision (float32; on CPU the
            accumulation dtype, float64 for float64 inputs). With ``requires_grad`` they get
            their gradient in their own dtype, and it is **this rank's part only**: the sum over
            the rank's own rows (query positions) of ``exp(sinks[h] - lse) * (dlse -
            rowsum(dO * O))``, with no communication. The sequence's gradient is the sum over the
            ranks of the group, which the data-parallel reduction of the parameter's gradient
            over every rank that holds a replica (DDP / FSDP over a mesh that includes the
            context-parallel dimension) adds as it adds the other parameters' per-token
            contributions; all-reduce ``sinks.grad`` over ``group`` yourself otherwise.

    Raises:
        ValueError / TypeError / RuntimeError: on every rank of the group, when any rank's
        inputs are rejected (that rank raises its own error, the others a RuntimeError naming
        it) or the ranks disagree on shapes, dtype or options.
    """
    world, rank = _group_size_rank(group)
    backend = str(dist.get_backend(group))
    nccl = "nccl" in backend
    error, local = None, None
    try:
        local = _validate_local(q, k, v, is_causal=is_causal, scale=scale, window_size=window_size, softcap=softcap,
                                layout=layout, method=method, return_lse=return_lse, deterministic=deterministic,
                                sinks=sinks, nccl=nccl)
    except (TypeError, ValueError, RuntimeError) as exc:
        error = exc
    grad = torch.is_grad_enabled()
    need_dq = error is None and grad and q.requires_grad
    need_dkdv = error is None and grad and (k.requires_grad or v.requires_grad)
    meta = _metadata(error is None, q, k, local, is_causal, layout, method, return_lse, deterministic, need_dq,
                     need_dkdv, sinks is not None)
    chosen = None if error is not None else ring.pick_method(method, q.shape[1], k.shape[1], q.shape[2], world)
    key = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    mine = None if error is not None else _Agreed(tuple(meta), tuple(k.shape), q.dtype, q.is_cuda, chosen)
    # The check's round trip is the longest part of a short call's host time (a few hundred
    # microseconds). Once a group has agreed, each rank expects its next call to match: the
    # forward queues its own block's kernels and sends its first block, sized as agreed, then
    # starts the check and finishes it while the GPU runs them. A rank whose metadata changed
    # sends placeholders of that size and waits for the check, which then stops every rank
    # (disagreement) or lets the call start over (every rank changed alike). Every rank holds
    # the same agreed entry, so every rank issues the same transfers.
    agreed = _AGREED.get(key) if world > 1 else None
    if not _speculates(agreed):
        agreed = None
    if agreed is not None and mine == agreed:
        agreement = _LateAgreement(lambda: _agree_start(meta, *_check_group(group, key), error, key, mine))
    else:
        agreement = _agree_start(meta, *_check_group(group, key), error, key, mine)
        if agreed is not None:
            _placeholder_hop(group, world, rank, agreed)
            agreement.finish()  # raises on every rank unless every rank changed alike
            agreement = None
        elif error is not None:
            agreement.finish()  # raises on this rank; the others raise in theirs

    if q.is_cuda:
        kernel = ring.CudaBlocks(q, local, deterministic, 0)
    else:
        kernel = ReferenceBlocks(q, local)
    cfg = ring.Config(kernel, ring.Ring(group, world, rank), chosen, layout, local.window_left, local.window_right,
                      need_dq, need_dkdv, agreement)
    out, lse = ring.attention(q, k, v, cfg, sinks)
    return (out, lse) if return_lse else out
