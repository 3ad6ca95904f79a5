"""A ring for flash_cuda.distributed's step machinery without communication, for tests and the
ring benchmark (bench/ring.py): its compute alone."""

from __future__ import annotations

from flash_cuda.distributed import _Ring


class NoComm(_Ring):
    """Keeps the blocks in hand instead of exchanging them: every rank's step sees its own
    blocks again (a pretend world of ``world`` ranks whose blocks never move)."""

    def __init__(self, world: int, rank: int):
        self.group, self.world, self.rank = None, world, rank

    def exchange(self, send, recv, tag0=0):
        for s, r in zip(send, recv):
            if r.data_ptr() != s.data_ptr():
                r.copy_(s)
        return []
