"""The algorithm behind :func:`flash_cuda.distributed.ring_attention` (that module has the public
API, its checks and the documentation of the methods and layouts): which chunks of the sequence
a rank holds, the kernel calls a pair of blocks needs (the mask rewritten in the block's own
coordinates), the block kernels on CUDA (:class:`CudaBlocks`; the CPU ones are
:class:`flash_cuda.cpu_backend.ReferenceBlocks`), the merge of partial results, the ring's
communication, the two methods (``"ring"``, ``"allgather"``) with their autograd Function, and
``method="auto"``'s choice.

:class:`NoComm` is a ring that keeps its blocks in hand: the single-process stand-in with which
the tests check the steps without processes and ``bench/ring.py`` measures the ring's compute
alone.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import _ext, ops
from .validation import ScoreOptions

# Newer torch names the single-tensor collectives *_single and deprecates the older names.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_INF = math.inf

# method="auto": a ring step attends B * Hq * S_local^2 query-key pairs while B * Hkv * S_local
# rows of K and V arrive; below this many (S_local * Hq / Hkv) the transfer of a step is not
# hidden behind its compute on NVLink-class links (about 2 flop per byte of the link's
# bandwidth over the GPU's attention throughput), and one all-gather costs less than W hops.
_AUTO_MIN_RING_WORK = 2048


# ---------------------------------------------------------------------------------------
# Layouts: which chunks of the sequence a rank holds
# ---------------------------------------------------------------------------------------


def chunk_ids(layout: str, world: int, rank: int) -> Tuple[int, ...]:
    """The sequence chunks rank ``rank`` holds, in its local order."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


class _Chunk(NamedTuple):
    start: int  # first global position
    local: int  # first local row
    length: int


def _rank_chunks(layout: str, world: int, rank: int, s_local: int) -> List[_Chunk]:
    n = chunks_per_rank(layout)
    c = s_local // n
    return [_Chunk(cid * c, i * c, c) for i, cid in enumerate(chunk_ids(layout, world, rank))]


def _rank_major_order(layout: str, world: int) -> List[int]:
    """Chunk ids in the order an all-gather of the local slices lays them out."""
    return [cid for r in range(world) for cid in chunk_ids(layout, world, r)]


def to_sequence_order(x: Tensor, dim: int, layout: str, world: int) -> Tensor:
    """Rank-major chunks (as gathered) -> sequence order, along ``dim``."""
    order = _rank_major_order(layout, world)
    if order == sorted(order):
        return x
    n = len(order)
    c = x.shape[dim] // n
    chunks = x.unflatten(dim, (n, c))
    inverse = [0] * n
    for pos, cid in enumerate(order):
        inverse[cid] = pos
    return chunks.index_select(dim, torch.tensor(inverse, device=x.device)).flatten(dim, dim + 1)


def _to_rank_major(x: Tensor, dim: int, layout: str, world: int) -> Tensor:
    """Sequence order -> rank-major chunks (the layout a reduce-scatter splits)."""
    order = _rank_major_order(layout, world)
    n = len(order)
    c = x.shape[dim] // n
    return x.unflatten(dim, (n, c)).index_select(dim, torch.tensor(order, device=x.device)).flatten(dim, dim + 1)


# ---------------------------------------------------------------------------------------
# Block plans: which (query rows, key rows, window) calls a (q chunks, k chunks) pair needs
# ---------------------------------------------------------------------------------------


class _Call(NamedTuple):
    """One kernel call: local query rows [q0, q1) against key rows [k0, k1) of the block in
    hand, with a bottom-right aligned window (-1: unbounded side)."""
    q0: int
    q1: int
    k0: int
    k1: int
    wl: int
    wr: int


def _band(qc: _Chunk, kc: _Chunk, left: int, right: int) -> Tuple[float, float]:
    """Global rule: query at position p sees key t iff p - left <= t <= p + right (the whole
    sequence is square, so bottom-right alignment is the main diagonal). In chunk-local
    coordinates (i, j): lo <= j - i <= hi."""
    d = qc.start - kc.start
    return (-_INF if left < 0 else d - left), (_INF if right < 0 else d + right)


def _clip(lo: float, hi: float, sq: int, sk: int):
    """The offsets j - i of an sq x sk rectangle that the band keeps (None: none). Two bands
    select the same cells of the rectangle iff their clips are equal."""
    lo_c, hi_c = max(lo, -(sq - 1)), min(hi, sk - 1)
    return None if lo_c > hi_c else (lo_c, hi_c)


def _window_band(wl: int, wr: int, sq: int, sk: int) -> Tuple[float, float]:
    """flash_cuda's bottom-right aligned window as a band: i + sk - sq - wl <= j <= i + sk - sq + wr."""
    delta = sk - sq
    return (-_INF if wl < 0 else delta - wl), (_INF if wr < 0 else delta + wr)


def _trimmed_call(lo: float, hi: float, qc: _Chunk, kc: _Chunk) -> Optional[_Call]:
    """The call for one chunk pair, or None when no query sees a key of it.

    A band of offsets is not always a bottom-right aligned window of the full chunk pair
    (e.g. a sliding window reaching a few keys into an earlier chunk: both its bounds lie on
    the same side of the pair's diagonal). Trimmed to the rows that see a key and the keys
    that are seen, it is: the last such row and the last such key form a cell inside the band
    (if the last row is cut by the band's lower bound, the last key is the pair's last; if the
    last key is cut by the upper bound, the last row is the pair's last), which makes both
    window sides >= 0."""
    sq, sk = qc.length, kc.length
    a0, a1 = max(0, -hi), min(sq, sk - lo)
    if a0 >= a1:
        return None
    b0, b1 = max(0, a0 + lo), min(sk, a1 + hi)
    if b0 >= b1:
        return None
    a0, a1, b0, b1 = int(a0), int(a1), int(b0), int(b1)
    sq2, sk2 = a1 - a0, b1 - b0
    lo2, hi2 = lo - b0 + a0, hi - b0 + a0  # the band in the trimmed rectangle
    delta = sk2 - sq2
    wl = -1 if lo2 <= -(sq2 - 1) else int(delta - lo2)
    wr = -1 if hi2 >= sk2 - 1 else int(hi2 - delta)
    assert wl >= -1 and wr >= -1 and (wl != -1 or lo2 <= -(sq2 - 1)) and (wr != -1 or hi2 >= sk2 - 1)
    return _Call(qc.local + a0, qc.local + a1, kc.local + b0, kc.local + b1, wl, wr)


def _plan(q_chunks: Sequence[_Chunk], k_chunks: Sequence[_Chunk], left: int, right: int) -> List[_Call]:
    """The fewest calls that attend the local queries to a key block exactly.

    Chunk pairs are first judged one by one; neighbouring pairs are then joined into one call
    where an unmasked or causal call over the joined rectangle selects exactly the same cells
    (the zigzag diagonal block: one causal call over both chunks; a key block of an earlier
    rank: one unmasked call with both query chunks, or only the later one)."""
    bands = {(i, j): _band(qc, kc, left, right) for i, qc in enumerate(q_chunks) for j, kc in enumerate(k_chunks)}
    seen = {p: _clip(*bands[p], q_chunks[p[0]].length, k_chunks[p[1]].length) is not None for p in bands}

    def joined(rows: Sequence[int], cols: Sequence[int]) -> Optional[_Call]:
        """One call over rows x cols (consecutive chunks), or None if none is exact."""
        if len(rows) == 1 and len(cols) == 1:
            return _trimmed_call(*bands[rows[0], cols[0]], q_chunks[rows[0]], k_chunks[cols[0]])
        qa, qb = q_chunks[rows[0]].local, q_chunks[rows[-1]].local + q_chunks[rows[-1]].length
        ka, kb = k_chunks[cols[0]].local, k_chunks[cols[-1]].local + k_chunks[cols[-1]].length
        for wl, wr in ((-1, -1), (-1, 0)):
            lo, hi = _window_band(wl, wr, qb - qa, kb - ka)
            exact = True
            for i in rows:
                for j in cols:
                    qc, kc = q_chunks[i], k_chunks[j]
                    shift = (qc.local - qa) - (kc.local - ka)
                    if _clip(lo + shift, hi + shift, qc.length, kc.length) != _clip(*bands[i, j], qc.length,
                                                                                    kc.length):
                        exact = False
                        break
                if not exact:
                    break
            if exact:
                return _Call(qa, qb, ka, kb, wl, wr)
        return None

    def decomposition(groups) -> Optional[List[_Call]]:
        calls = []
        for rows, cols in groups:
            if not any(seen[i, j] for i in rows for j in cols):
                continue
            call = joined(rows, cols)
            if call is None:
                return None
            calls.append(call)
        return calls

    def span(idx: List[int]) -> List[int]:
        return list(range(min(idx), max(idx) + 1)) if idx else []

    nq, nk = len(q_chunks), len(k_chunks)
    candidates = [
        [(list(range(nq)), list(range(nk)))],  # one call
        [([i], span([j for j in range(nk) if seen[i, j]])) for i in range(nq)],  # per query chunk
        [(span([i for i in range(nq) if seen[i, j]]), [j]) for j in range(nk)],  # per key chunk
        [([i], [j]) for i in range(nq) for j in range(nk)],  # per pair (always exact)
    ]
    best = None
    for groups in candidates:
        calls = decomposition([(r, c) for r, c in groups if r and c])
        if calls is not None and (best is None or len(calls) < len(best)):
            best = calls
    return best


# ---------------------------------------------------------------------------------------
# Block kernels: flash_cuda's CUDA kernels, or the reference on CPU (cpu_backend.ReferenceBlocks)
# ---------------------------------------------------------------------------------------


class CudaBlocks:
    """flash_cuda's kernels with the options ``opts`` (its window is set per block). For float32
    inputs the fp32 backward recomputes P from per-row statistics (m, log2 l) rather than from
    lse (the ops' aux); they are merged across blocks as lse is, so that the backward of each
    block sees the row's global statistics."""

    def __init__(self, q: Tensor, opts: ScoreOptions, deterministic: bool, tier: int):
        self.opts, self.deterministic, self.tier = opts, deterministic, tier
        self.acc_dtype = torch.float32
        self.has_stats = q.dtype == torch.float32
        self._no_stats = q.new_empty((0,), dtype=torch.float32)

    def _block_options(self, wl: int, wr: int) -> ScoreOptions:
        return ScoreOptions(self.opts.scale, wl, wr, self.opts.softcap)

    def forward(self, q, k, v, wl, wr, sm_margin=0):
        out, lse, aux = ops.fwd_impl(q, k, v, self._block_options(wl, wr), self.tier, sm_margin=sm_margin)
        return out, lse, (aux if self.has_stats else None)

    def backward(self, dout, q, k, v, out, lse, stats, dlse, wl, wr, need_dq, need_dkdv):
        aux = stats.contiguous() if self.has_stats else self._no_stats
        if dlse is not None:
            dlse = dlse.contiguous()  # a slice of the rows; the binding takes it dense
        return ops.bwd_impl(dout, q, k, v, out, lse, aux, dlse, self._block_options(wl, wr), self.deterministic,
                            self.tier, need_dq, need_dkdv)

    @staticmethod
    def merge(a, a_lse, a_stats, b, b_lse, b_stats, out, out_lse, out_stats):
        """out = the merge of partials a and b (out may be a): one kernel (core/combine.cuh)."""
        _ext.require().merge_partials(a, a_lse, a_stats, b, b_lse, b_stats, out, out_lse, out_stats)


# ---------------------------------------------------------------------------------------
# Merging partial results
# ---------------------------------------------------------------------------------------


class _Action(NamedTuple):
    """What one call's partial does to the local rows [r0, r1): ``src`` "" stores it as the
    rows' first partial; "T" / "F" merges it with the rows' running result, held in the output
    ("T": the input dtype) or in a float32 accumulator ("F"); ``dst`` is where the result goes.
    A row's last merge writes the output, the ones before it the float32 accumulator, so that
    a row merged n times is rounded to the input dtype once after the kernels' own rounding."""
    r0: int
    r1: int
    src: str
    dst: str


class _Schedule(NamedTuple):
    """The calls of every step (``steps[s]``: the block of rank ``rank - s``; one step for the
    all-gather), the merge actions of each call (``actions[s][i]``) and the rows no call
    touches (output 0, lse -inf)."""
    steps: Tuple[Tuple[_Call, ...], ...]
    actions: Tuple[Tuple[Tuple[_Action, ...], ...], ...]
    untouched: Tuple[Tuple[int, int], ...]


def _schedule(steps: Tuple[Tuple[_Call, ...], ...], s_local: int) -> _Schedule:
    calls = [c for step in steps for c in step]
    bounds = sorted({0, s_local} | {c.q0 for c in calls} | {c.q1 for c in calls})
    segs = list(zip(bounds[:-1], bounds[1:]))
    covers = lambda c, g: c.q0 <= g[0] and g[1] <= c.q1  # noqa: E731
    total = {g: sum(covers(c, g) for c in calls) for g in segs}
    seen = dict.fromkeys(segs, 0)
    state = {}
    actions = []
    for step in steps:
        step_actions = []
        for c in step:
            acts: List[_Action] = []
            for g in segs:
                if not covers(c, g):
                    continue
                seen[g] += 1
                src = "" if seen[g] == 1 else state[g]
                dst = "T" if seen[g] == 1 or seen[g] == total[g] else "F"
                state[g] = dst
                if acts and acts[-1].r1 == g[0] and (acts[-1].src, acts[-1].dst) == (src, dst):
                    acts[-1] = acts[-1]._replace(r1=g[1])
                else:
                    acts.append(_Action(g[0], g[1], src, dst))
            step_actions.append(tuple(acts))
        actions.append(tuple(step_actions))
    untouched = tuple(g for g in segs if total[g] == 0)
    return _Schedule(steps, tuple(actions), untouched)


class _ScheduledRows:
    """The rows of the local queries as a schedule fills them: ``out`` in the input dtype (a
    first part that covers every row is taken as ``out`` itself, no copy) and, where a row is
    merged three or more times, the float32 accumulator between its merges."""

    def __init__(self, like: Tensor, schedule: _Schedule, acc_dtype: torch.dtype):
        self.like, self.schedule, self.acc_dtype = like, schedule, acc_dtype
        self.out = self.f32 = None
        # Inputs whose dtype is the accumulation dtype need no second buffer.
        self.wide = like.dtype != acc_dtype

    def _takes_whole(self, actions: Sequence[_Action], part: Tensor) -> bool:
        return len(actions) == 1 and actions[0] == (0, self.like.shape[2], "", "T") and part.shape == self.like.shape

    def _buffer(self, where: str) -> Tensor:
        if where == "T" or not self.wide:
            return self.out
        if self.f32 is None:
            self.f32 = torch.empty(self.like.shape, dtype=self.acc_dtype, device=self.like.device)
        return self.f32

    @staticmethod
    def _slices(a: _Action, q0: int) -> Tuple[slice, slice]:
        """(the rows in the local queries, the same rows in the call's part)."""
        return slice(a.r0, a.r1), slice(a.r0 - q0, a.r1 - q0)


class _Accumulator(_ScheduledRows):
    """The forward's (out, lse[, stats]) from the calls' partials, merged by the kernels'
    merge (float32 inside) where the schedule says."""

    def __init__(self, q: Tensor, kernel, schedule: _Schedule):
        super().__init__(q, schedule, kernel.acc_dtype)
        self.kernel = kernel
        self.lse = self.stats = None

    def _allocate(self) -> None:
        q, kernel = self.like, self.kernel
        B, H, S, _ = q.shape
        self.out = torch.empty_like(q)
        self.lse = torch.empty((B, H, S), dtype=kernel.acc_dtype, device=q.device)
        if kernel.has_stats:
            self.stats = torch.empty((B, H, S, 2), dtype=torch.float32, device=q.device)
        for r0, r1 in self.schedule.untouched:
            self.out[:, :, r0:r1].zero_()
            self.lse[:, :, r0:r1].fill_(-_INF)
            if self.stats is not None:
                self.stats[:, :, r0:r1, 0].fill_(_INF)
                self.stats[:, :, r0:r1, 1].zero_()

    def add(self, actions: Sequence[_Action], q0: int, out_b: Tensor, lse_b: Tensor,
            stats_b: Optional[Tensor]) -> None:
        if self.out is None:
            if self._takes_whole(actions, out_b):
                self.out, self.lse, self.stats = out_b, lse_b, stats_b
                return
            self._allocate()
        stats = self.stats
        for a in actions:
            rows, part = self._slices(a, q0)
            p_stats = None if stats_b is None else stats_b[:, :, part]
            r_stats = None if stats is None else stats[:, :, rows]
            if not a.src:
                self.out[:, :, rows].copy_(out_b[:, :, part])
                self.lse[:, :, rows].copy_(lse_b[:, :, part])
                if r_stats is not None:
                    r_stats.copy_(p_stats)
            else:
                self.kernel.merge(self._buffer(a.src)[:, :, rows], self.lse[:, :, rows], r_stats,
                                  out_b[:, :, part], lse_b[:, :, part], p_stats,
                                  self._buffer(a.dst)[:, :, rows], self.lse[:, :, rows], r_stats)

    def result(self):
        if self.out is None:  # no call at all: every row untouched
            self._allocate()
        return self.out, self.lse, self.stats


class _Sums(_ScheduledRows):
    """The same schedule for gradients, which add: dQ of the local rows from every step's
    calls. A row's first part is stored, its last sum written in the input dtype, the sums
    between in float32."""

    def add(self, actions: Sequence[_Action], q0: int, part_all: Tensor) -> None:
        if self.out is None:
            if self._takes_whole(actions, part_all):
                self.out = part_all
                return
            self.out = torch.empty_like(self.like)
            for r0, r1 in self.schedule.untouched:
                self.out[:, :, r0:r1].zero_()
        for a in actions:
            rows, part = self._slices(a, q0)
            if not a.src:
                self.out[:, :, rows].copy_(part_all[:, :, part])
            else:
                torch.add(self._buffer(a.src)[:, :, rows], part_all[:, :, part], out=self._buffer(a.dst)[:, :, rows])

    def result(self) -> Tensor:
        if self.out is None:
            self.out = torch.zeros_like(self.like)
        return self.out


# ---------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------


class Ring:
    """Batched isend / irecv to the ring neighbours of ``group`` (global ranks for P2POp)."""

    def __init__(self, group, world: int, rank: int):
        self.group, self.world, self.rank = group, world, rank
        self.next = dist.get_global_rank(self._group(), (rank + 1) % world)
        self.prev = dist.get_global_rank(self._group(), (rank - 1) % world)

    def _group(self):
        return self.group if self.group is not None else dist.group.WORLD

    def exchange(self, send: Sequence[Tensor], recv: Sequence[Tensor], tag0: int = 0):
        """Starts sending ``send`` to the next rank and receiving ``recv`` from the previous
        one; returns the handles. Tags keep the tensors of one batch, and the K / V and
        gradient exchanges in flight together, apart on gloo (NCCL matches by issue order,
        which is the same on every rank)."""
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag0 + i) for i, t in enumerate(send)]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag0 + i) for i, t in enumerate(recv)]
        return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(handles) -> None:
        for h in handles:
            h.wait()


class NoComm(Ring):
    """A ring without communication: keeps the blocks in hand instead of exchanging them, so
    that every rank's step sees its own blocks again (a pretend world of ``world`` ranks whose
    blocks never move). The single-process stand-in used to test the ring's steps and to
    measure its compute alone (the kernels and merges, plus a device-local copy in place of
    each transfer)."""

    def __init__(self, world: int, rank: int):
        self.group, self.world, self.rank = None, world, rank

    def exchange(self, send, recv, tag0=0):
        for s, r in zip(send, recv):
            if r.data_ptr() != s.data_ptr():
                r.copy_(s)
        return []


# ---------------------------------------------------------------------------------------
# The two methods
# ---------------------------------------------------------------------------------------


class Config(NamedTuple):
    """One call's setup: the block kernel (:class:`CudaBlocks` or
    :class:`flash_cuda.cpu_backend.ReferenceBlocks`), the ring, the method (``"ring"`` or
    ``"allgather"``), the layout, the window in global positions, and which gradients the
    backward computes."""
    kernel: object
    ring: Ring
    method: str
    layout: str
    left: int
    right: int
    need_dq: bool
    need_dkdv: bool
    # The collective input check in flight (flash_cuda.distributed's; anything with finish()),
    # finished by the forward before its first transfer (None: already done, or none).
    agreement: Optional[object] = None

    @property
    def world(self) -> int:
        return self.ring.world


def _ring_schedule(cfg: Config, s_local: int) -> _Schedule:
    """steps[s]: the calls attending the local queries to the block of rank (rank - s)."""
    return _ring_schedule_of(cfg.layout, cfg.world, cfg.ring.rank, s_local, cfg.left, cfg.right)


def _allgather_schedule(cfg: Config, s_local: int) -> _Schedule:
    return _allgather_schedule_of(cfg.layout, cfg.world, cfg.ring.rank, s_local, cfg.left, cfg.right)


# Plans depend on a few integers only and cost more host time than a step's kernel launches at
# a few thousand tokens per GPU: computed once per shape.
@functools.lru_cache(maxsize=256)
def _ring_plans_of(layout: str, W: int, r: int, s_local: int, left: int, right: int):
    mine = _rank_chunks(layout, W, r, s_local)
    return tuple(tuple(_plan(mine, _rank_chunks(layout, W, (r - s) % W, s_local), left, right)) for s in range(W))


@functools.lru_cache(maxsize=256)
def _ring_schedule_of(layout: str, W: int, r: int, s_local: int, left: int, right: int) -> _Schedule:
    return _schedule(_ring_plans_of(layout, W, r, s_local, left, right), s_local)


@functools.lru_cache(maxsize=256)
def _allgather_schedule_of(layout: str, W: int, r: int, s_local: int, left: int, right: int) -> _Schedule:
    mine = _rank_chunks(layout, W, r, s_local)
    return _schedule((tuple(_plan(mine, [_Chunk(0, 0, s_local * W)], left, right)),), s_local)


@functools.lru_cache(maxsize=256)
def dkv_travels_in_input_dtype(layout: str, W: int, s_local: int, left: int, right: int) -> bool:
    """Whether dK / dV may travel in the input dtype: on two ranks, where every key row gets at
    most one part per rank (one call per step on both ranks), the sum is rounded once, as a
    float32 sum rounded at the end is; else they travel in float32 (twice the bytes)."""
    return W == 2 and all(len(step) <= 1 for r in range(W) for step in _ring_plans_of(layout, W, r, s_local, left,
                                                                                       right))


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device):
    """The stream from which the ring issues work that must not queue behind the kernels of the
    current stream (one per device)."""
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return side


def _first_hop(ring: Ring, send, recv, ready):
    """The first exchange, issued after step 0's kernels are queued but ordered after ``ready``
    alone (an event recorded before them: the caller's k / v and the fresh receive buffers are
    ready there): issued from a side stream, so that NCCL, which orders a transfer after the
    issuing stream's work, starts it at once instead of after the local block's attention."""
    if ready is None:
        return ring.exchange(send, recv)
    side = side_stream(send[0].device)
    side.wait_event(ready)
    with torch.cuda.stream(side):
        return ring.exchange(send, recv)


# The SMs the forward's persistent kernels leave free while a K / V transfer runs beside them
# (bench/ring.py --sm-margin). A persistent CTA holds its SM to the end of its launch, so NCCL's
# transfer kernel cannot start on a GPU it fills; but on two GPUs the first hop is issued late
# anyway (the host's send follows the input check), and a margin paid for a whole step costs
# more than the transfer it uncovers at 32k tokens per GPU: 0, measured in OPTIMIZATION.md.
SM_MARGIN = 0

# Whether the forward's first hop is issued before the local block's kernels (the host then waits
# for the input check first) rather than after them (the check's round trip runs under the local
# block, and the transfer starts once the host has sent it). bench/ring.py --hop-first.
HOP_FIRST = False


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, cfg: Config):
    kernel, ring, W = cfg.kernel, cfg.ring, cfg.world
    sched = _ring_schedule(cfg, q.shape[2])
    acc = _Accumulator(q, kernel, sched)
    kv = (k.contiguous(), v.contiguous())
    spare, ready = None, None  # the other half of the double buffer; the first hop's event
    first = None  # the first hop's handles, where it is issued before the local block
    # Whether the first hop goes before the input check returns, sized as the group agreed in
    # its last call (flash_cuda.distributed.ring_attention): the check is then started once
    # the local block and the hop are queued and finished before the received block is read.
    speculative = getattr(cfg.agreement, "speculative", False)
    if W > 1:
        # Allocated before step 0's kernels are queued, so that the side stream's transfer into
        # them is ordered after every earlier use of their memory.
        spare = (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
        if q.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        if HOP_FIRST:
            if cfg.agreement is not None and not speculative:
                cfg.agreement.finish()
            first = _first_hop(ring, kv, spare, ready)
    for step in range(W):
        handles = first if step == 0 else None
        if 0 < step < W - 1:
            spare = spare or (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            handles = ring.exchange(kv, spare)
        margin = SM_MARGIN if step < W - 1 else 0  # a transfer runs beside every step but the last
        for c, actions in zip(sched.steps[step], sched.actions[step]):
            acc.add(actions, c.q0, *kernel.forward(q[:, :, c.q0:c.q1], kv[0][:, :, c.k0:c.k1],
                                                   kv[1][:, :, c.k0:c.k1], c.wl, c.wr, sm_margin=margin))
        if step == 0 and first is None:
            # Step 0 attends the local block: the collective check is waited for while the GPU
            # runs it, and (unless speculative) no rank sends anything before every rank has
            # passed it.
            if cfg.agreement is not None and not speculative:
                cfg.agreement.finish()
            if W > 1:
                handles = _first_hop(ring, kv, spare, ready)
        if step == 0 and speculative:
            try:
                cfg.agreement.finish()  # before anything reads the received block
            except BaseException:
                # Every rank sends and receives the first block (a changed rank placeholders of
                # its size), so this hop completes: wait for it before its buffers go, or a
                # CPU group's receive dropped while pending takes a later hop's message.
                if handles is not None:
                    ring.wait(handles)
                raise
        if handles is not None:
            ring.wait(handles)
            # The block just attended becomes the next receive buffer, except the caller's own
            # k / v (the first step's), which is never written.
            kv, spare = spare, (kv if step > 0 else None)
    return acc.result()


def _ring_backward(dout, q, k, v, out, lse, stats, dlse, cfg: Config):
    """K and V travel around the ring again. Each rank keeps its own block's dK / dV parts (step
    0) at home; the parts of the other ranks travel with the block from its first visitor (rank
    r + 1, step 1) to its last (rank r - 1, step W - 1), each visitor adding its own, and the sum
    comes home after the last step: W - 1 hops of dK / dV."""
    kernel, ring, W = cfg.kernel, cfg.ring, cfg.world
    S = q.shape[2]
    sched = _ring_schedule(cfg, S)
    dq = _Sums(q, sched, kernel.acc_dtype) if cfg.need_dq else None
    travel = (k.dtype if dkv_travels_in_input_dtype(cfg.layout, W, S, cfg.left, cfg.right) else kernel.acc_dtype)
    kv = (k.contiguous(), v.contiguous())
    spare = None
    own = None  # this rank's parts of its own block's dK / dV
    dkv = None  # the visitors' sums of the block in hand (None at steps 0 and 1: none yet)
    dkv_handles = None

    def zeros():
        return (torch.zeros(k.shape, dtype=travel, device=k.device), torch.zeros(v.shape, dtype=travel, device=v.device))

    for step in range(W):
        kv_handles = None
        if step + 1 < W:
            spare = spare or (torch.empty_like(kv[0]), torch.empty_like(kv[1]))
            kv_handles = ring.exchange(kv, spare)
        mine = None  # the block's sums with this step's parts added
        for c, actions in zip(sched.steps[step], sched.actions[step]):
            rows, keys = slice(c.q0, c.q1), slice(c.k0, c.k1)
            dq_b, dk_b, dv_b = kernel.backward(
                dout[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], out[:, :, rows],
                lse[:, :, rows], None if stats is None else stats[:, :, rows],
                None if dlse is None else dlse[:, :, rows], c.wl, c.wr, cfg.need_dq, cfg.need_dkdv)
            if dq is not None:
                dq.add(actions, c.q0, dq_b)
            if cfg.need_dkdv:
                if mine is None and dkv is None and (c.k0, c.k1) == (0, S) and dk_b.dtype == travel:
                    mine = (dk_b, dv_b)  # the first parts, whole: taken as they are
                    continue
                if mine is None:
                    if dkv is not None:
                        # The visitors' sums arrived during the step before; the compute stream
                        # waits for them only here, after this step's first kernel is queued.
                        ring.wait(dkv_handles)
                    mine = dkv or zeros()
                mine[0][:, :, keys] += dk_b
                mine[1][:, :, keys] += dv_b
        if cfg.need_dkdv and step == 0:
            own = mine
        elif cfg.need_dkdv:
            if mine is None:  # no call on this block: pass the sums on as they came
                if dkv is not None:
                    ring.wait(dkv_handles)
                mine = dkv or zeros()
            # On to the next rank (after the last step: the block's owner); the sums of the
            # next block arrive from the rank before.
            dkv = (torch.empty_like(mine[0]), torch.empty_like(mine[1]))
            dkv_handles = ring.exchange(mine, dkv, tag0=2)
        if kv_handles is not None:
            ring.wait(kv_handles)
            kv, spare = spare, (kv if step > 0 else None)
    dk = dv = None
    if cfg.need_dkdv:
        if dkv is not None:  # the visitors' sums of this rank's own block
            ring.wait(dkv_handles)
            if own is None:
                own = dkv
            else:
                own[0].add_(dkv[0])
                own[1].add_(dkv[1])
        dk, dv = own if own is not None else zeros()
    return (dq.result() if dq is not None else None), dk, dv


def _gather_kv(k: Tensor, v: Tensor, cfg: Config) -> Tuple[Tensor, Tensor]:
    """The whole sequence's K and V, in sequence order."""
    W = cfg.world
    if W == 1:
        return k, v
    out = []
    handles = []
    for t in (k, v):
        t = t.contiguous()
        g = t.new_empty((W * t.shape[0],) + tuple(t.shape[1:]))
        handles.append(all_gather(g, t, group=cfg.ring.group, async_op=True))
        out.append(g)
    for h in handles:
        h.wait()
    B = k.shape[0]
    # (W * B, H, S_local, D) -> (B, H, W * S_local, D) rank-major -> sequence order
    return tuple(to_sequence_order(g.unflatten(0, (W, B)).permute(1, 2, 0, 3, 4).flatten(2, 3), 2, cfg.layout, W)
                 for g in out)


def _allgather_forward(q: Tensor, k: Tensor, v: Tensor, cfg: Config):
    kernel = cfg.kernel
    if cfg.agreement is not None:
        cfg.agreement.finish()
    k_all, v_all = _gather_kv(k, v, cfg)
    sched = _allgather_schedule(cfg, q.shape[2])
    acc = _Accumulator(q, kernel, sched)
    for c, actions in zip(sched.steps[0], sched.actions[0]):
        acc.add(actions, c.q0, *kernel.forward(q[:, :, c.q0:c.q1], k_all[:, :, c.k0:c.k1], v_all[:, :, c.k0:c.k1],
                                               c.wl, c.wr))
    return acc.result()


def _allgather_backward(dout, q, k, v, out, lse, stats, dlse, cfg: Config):
    kernel, W = cfg.kernel, cfg.world
    acc = kernel.acc_dtype
    k_all, v_all = _gather_kv(k, v, cfg)  # gathered again: the forward keeps only the local slices
    sched = _allgather_schedule(cfg, q.shape[2])
    dq = _Sums(q, sched, acc) if cfg.need_dq else None
    dk_all = torch.zeros(k_all.shape, dtype=acc, device=k.device) if cfg.need_dkdv else None
    dv_all = torch.zeros(v_all.shape, dtype=acc, device=v.device) if cfg.need_dkdv else None
    for c, actions in zip(sched.steps[0], sched.actions[0]):
        rows, keys = slice(c.q0, c.q1), slice(c.k0, c.k1)
        dq_b, dk_b, dv_b = kernel.backward(
            dout[:, :, rows], q[:, :, rows], k_all[:, :, keys], v_all[:, :, keys], out[:, :, rows], lse[:, :, rows],
            None if stats is None else stats[:, :, rows], None if dlse is None else dlse[:, :, rows], c.wl, c.wr,
            cfg.need_dq, cfg.need_dkdv)
        if dq is not None:
            dq.add(actions, c.q0, dq_b)
        if cfg.need_dkdv:
            dk_all[:, :, keys] += dk_b
            dv_all[:, :, keys] += dv_b
    dq = dq.result() if dq is not None else None
    dk = dv = None
    if cfg.need_dkdv:
        if W == 1:
            dk, dv = dk_all, dv_all
        else:
            res = []
            for g in (dk_all, dv_all):
                # sequence order -> rank-major, rank as the leading dim: each rank gets the sum
                # over ranks of its own chunks' rows.
                g = _to_rank_major(g, 2, cfg.layout, W).unflatten(2, (W, k.shape[2])).permute(2, 0, 1, 3, 4)
                part = g.new_empty(g.shape[1:])
                _reduce_scatter(part, g.contiguous().flatten(0, 1), group=cfg.ring.group)
                res.append(part)
            dk, dv = res
    return dq, dk, dv


# Whether a speculative ring forward (flash_cuda.distributed.ring_attention: a group that agreed
# in its last call, a short local block) is replayed from a CUDA graph of its steps, one per
# shape: the host then issues three input copies, one replay and two output copies instead of
# every launch and transfer (about 0.5 ms of host time at 8k tokens per GPU, most of it
# torch.distributed's point-to-point issue). Off by default: it pays where the host bounds a
# synchronized call, and each graph holds its own copy of a shape's inputs, outputs and blocks
# (OPTIMIZATION.md, item 36; bench/ring.py --graphs).
GRAPHS = False
_GRAPHS: "collections.OrderedDict" = collections.OrderedDict()
_GRAPHS_KEPT = 2


class _GraphedForward:
    """A ring forward captured once for one shape (inputs copied into its own buffers, outputs
    copied out of them). Captured after an eager call of the same shape whose input check has
    passed on every rank, so that every rank captures at the same call; every rank then holds
    the same graphs, keyed alike, and replays them at the same calls."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, cfg: Config):
        self.inputs = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        for mine, t in zip(self.inputs, (q, k, v)):
            mine.copy_(t)
        plain = cfg._replace(agreement=None)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out, self.lse, self.stats = _ring_forward(*self.inputs, plain)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, agreement):
        for mine, t in zip(self.inputs, (q, k, v)):
            mine.copy_(t)
        self.graph.replay()
        # The replay's first transfer is sized as agreed; its result leaves the graph's buffers
        # only if every rank's inputs are the agreed ones.
        agreement.finish()
        return self.out.clone(), self.lse.clone(), None if self.stats is None else self.stats.clone()


def drop_graphs() -> None:
    """Frees the CUDA graphs held by GRAPHS (and their buffers)."""
    _GRAPHS.clear()


def _graph_key(q: Tensor, k: Tensor, cfg: Config) -> tuple:
    kernel = cfg.kernel
    return (tuple(q.shape), tuple(k.shape), q.dtype, q.device, cfg.layout, cfg.world, cfg.ring.rank,
            id(cfg.ring.group), cfg.left, cfg.right, kernel.opts, kernel.tier, SM_MARGIN, HOP_FIRST)


def _ring_forward_graphed(q: Tensor, k: Tensor, v: Tensor, cfg: Config):
    """The ring forward of a speculative call, from its shape's CUDA graph where one is held;
    else eagerly, and the graph captured after it (its check then passed on every rank)."""
    key = _graph_key(q, k, cfg)
    graphed = _GRAPHS.get(key)
    if graphed is not None:
        _GRAPHS.move_to_end(key)
        return graphed(q, k, v, cfg.agreement)
    result = _ring_forward(q, k, v, cfg)
    # Captured on a side stream after the eager call's work (torch.cuda.graph's own), its
    # transfers recorded, not run.
    _GRAPHS[key] = _GraphedForward(q, k, v, cfg)
    while len(_GRAPHS) > _GRAPHS_KEPT:
        _GRAPHS.popitem(last=False)
    return result


def _forward(q: Tensor, k: Tensor, v: Tensor, cfg: Config):
    """(out, lse, stats) of ``cfg``'s method, without autograd."""
    if cfg.method != "ring":
        return _allgather_forward(q, k, v, cfg)
    if (GRAPHS and q.is_cuda and cfg.world > 1 and getattr(cfg.agreement, "speculative", False)
            and not torch.cuda.is_current_stream_capturing()):
        return _ring_forward_graphed(q, k, v, cfg)
    return _ring_forward(q, k, v, cfg)


_LOG2E = 1.4426950408889634


def merge_sink(out: Tensor, lse: Tensor, stats: Optional[Tensor], sinks: Tensor, acc: torch.dtype):
    """(out, lse, stats) of whole rows with the attention sink merged in, once per row (the
    blocks and their merges leave it out, as the kernels' split pieces do): the sink is one
    more partial with lse = sinks[h] and no output, so lse' = logaddexp(lse, sink) and
    out' = out * exp(lse - lse'), computed in ``acc`` and rounded once into ``out`` (in place).
    The fp32 kernels' (m, log2 l) statistics (m = +inf: a row that saw no key) take the sink as
    the piece (sink log2 e, 0), as core/softmax.cuh's merge_sink does, so that the backward's
    P recomputed from them sums with the sink's share to 1. A -inf sink changes nothing, bit
    for bit; a row that sees no key gets out 0 and lse = its sink."""
    sink = sinks.detach().to(acc).view(1, -1, 1)
    lse_new = torch.logaddexp(lse, sink)
    no_mass = lse_new == -_INF  # no key and a -inf sink: out stays 0
    out.mul_(torch.exp(lse - torch.where(no_mass, torch.zeros_like(lse_new), lse_new)).unsqueeze(-1))
    if stats is not None:
        s2 = sink.to(torch.float32) * _LOG2E
        seen = stats[..., 0] != _INF
        m = torch.where(seen, stats[..., 0], -_INF)
        m_new = torch.maximum(m, s2)
        empty = m_new == -_INF
        ref = torch.where(empty, torch.zeros_like(m_new), m_new)
        # log2 l' = log2(l 2^(m - m') + 2^(sink - m')), with m - m' = 0 exactly where the sink
        # does not raise the max, so that a -inf sink leaves log2 l as it was.
        log2l = torch.logaddexp2((m - ref) + stats[..., 1], s2 - ref)
        stats = torch.stack((torch.where(empty, _INF, m_new), torch.where(empty, torch.zeros_like(log2l), log2l)),
                            dim=-1)
    return out, lse_new, stats


def _forward_with_sinks(q: Tensor, k: Tensor, v: Tensor, cfg: Config, sinks: Optional[Tensor]):
    out, lse, stats = _forward(q, k, v, cfg)
    if sinks is not None:
        out, lse, stats = merge_sink(out, lse, stats, sinks, cfg.kernel.acc_dtype)
    return out, lse, stats


class RingAttention(torch.autograd.Function):
    """``apply(q, k, v, cfg[, sinks])`` -> (out, lse). Gradients: dq, dk, dv by the ring's (or
    the all-gather's) collective backward, which runs only where ``cfg`` asks for one of them;
    d(sinks) from this rank's rows alone, with no communication (the caller's data-parallel
    reduction adds the ranks' parts, as it does for every replicated parameter)."""

    @staticmethod
    def forward(ctx, q, k, v, cfg: Config, sinks: Optional[Tensor] = None):
        out, lse, stats = _forward_with_sinks(q, k, v, cfg, sinks)
        # Every block's backward sees the whole row's statistics, the sink's share included (as
        # the single-GPU backward does): P = exp(x - lse') and delta = rowsum(dO * out').
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cfg, ctx.stats = cfg._replace(agreement=None), stats
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cfg = ctx.cfg
        acc = cfg.kernel.acc_dtype
        if dlse is not None:
            dlse = dlse.to(lse.dtype if acc == torch.float64 else torch.float32).contiguous()
        need_sinks = sinks is not None and ctx.needs_input_grad[4]
        dsinks = ops.sinks_grad(sinks, out, dout, lse, dlse, False, acc).to(sinks.dtype) if need_sinks else None
        dq = dk = dv = None
        if cfg.need_dq or cfg.need_dkdv:
            # A rank whose output took no part in the loss still runs its share of the transfers.
            dout = torch.zeros_like(out) if dout is None else dout
            if dout.stride(-1) != 1:
                dout = dout.contiguous()
            bwd = _ring_backward if cfg.method == "ring" else _allgather_backward
            dq, dk, dv = bwd(dout, q, k, v, out, lse, ctx.stats, dlse, cfg)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        return (dq.to(q.dtype) if need_q else None, dk.to(k.dtype) if need_k else None,
                dv.to(v.dtype) if need_v else None, None, dsinks)


def pick_method(method: str, Hq: int, Hkv: int, s_local: int, world: int) -> str:
    """The method ``method="auto"`` takes for these shapes (any other ``method`` as it is)."""
    if method != "auto":
        return method
    if world == 1:
        return "ring"  # no transfer either way; the ring path does no collective at all
    group_size = Hq // Hkv
    if (group_size > 1 and world <= group_size) or s_local * group_size < _AUTO_MIN_RING_WORK:
        return "allgather"
    return "ring"


def attention(q: Tensor, k: Tensor, v: Tensor, cfg: Config, sinks: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) of ``cfg``'s method, with the attention ``sinks`` ((Hq,) or None) merged into
    every row once: through :class:`RingAttention` where a gradient is needed (``cfg.need_dq``
    / ``cfg.need_dkdv``, or sinks that require one), else the forward alone."""
    need_sinks = sinks is not None and sinks.requires_grad and torch.is_grad_enabled()
    if cfg.need_dq or cfg.need_dkdv or need_sinks:
        return RingAttention.apply(q, k, v, cfg, sinks)
    out, lse, _ = _forward_with_sinks(q, k, v, cfg, sinks)
    return out, lse
