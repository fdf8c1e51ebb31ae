"""A byte-budgeted pool of host staging buffers.

Staging takes device shards into host memory before ``save`` returns; the pool
bounds how much host memory they may hold until the writer has put them on the
RAM disk: device-to-host copies and, on CPU, views that keep device buffers
alive are counted; numpy leaves are copied into its buffers. Freed buffers are
kept for reuse: memory this VM has not touched recently is several times slower
to fill than memory reused.
"""

from __future__ import annotations

import threading

import numpy as np


class StagingPool:
    """Hands out uint8 buffers while ``held + cached <= capacity``."""

    def __init__(self, capacity: int | None = None) -> None:
        self._capacity = capacity
        self._held = 0
        self._free: dict[int, list[np.ndarray]] = {}
        self._cached = 0
        self._cv = threading.Condition()

    @property
    def capacity(self) -> int | None:
        return self._capacity

    def ensure_capacity(self, nbytes: int) -> None:
        """Set the capacity on first use (``None`` until a state's size is known)."""
        with self._cv:
            if self._capacity is None:
                self._capacity = nbytes
                self._cv.notify_all()

    @property
    def held(self) -> int:
        with self._cv:
            return self._held

    def _fits(self, nbytes: int) -> bool:
        assert self._capacity is not None
        # A buffer larger than the whole budget is allowed when nothing else is
        # held; otherwise such a save could never make progress.
        return self._held + nbytes <= self._capacity or self._held == 0

    def _evict_for(self, nbytes: int) -> None:
        assert self._capacity is not None
        for size in list(self._free):
            while self._free.get(size) and self._held + self._cached + nbytes > self._capacity:
                self._free[size].pop()
                self._cached -= size
            if not self._free.get(size):
                self._free.pop(size, None)

    def acquire(self, nbytes: int, *, block: bool = True,
                reserved: bool = False) -> np.ndarray | None:
        """A buffer of ``nbytes``; waits for space, or returns None if ``block`` is False.
        ``reserved``: its bytes were already counted by :meth:`account`."""
        with self._cv:
            while not reserved and not self._fits(nbytes):
                if not block:
                    return None
                self._cv.wait()
            if not reserved:
                self._held += nbytes
            bucket = self._free.get(nbytes)
            if bucket:
                self._cached -= nbytes
                return bucket.pop()
            self._evict_for(0 if reserved else nbytes)
        return np.empty(nbytes, dtype=np.uint8)

    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` at once if they fit beside what is held; never waits."""
        with self._cv:
            assert self._capacity is not None
            if self._held + nbytes > self._capacity:
                return False
            self._held += nbytes
            return True

    def can_fit_now(self, nbytes: int) -> bool:
        with self._cv:
            return self._fits(nbytes)

    def account(self, nbytes: int, *, block: bool = True) -> bool:
        """Count memory staged outside the pool (a fresh device-to-host copy)."""
        with self._cv:
            while not self._fits(nbytes):
                if not block:
                    return False
                self._cv.wait()
            self._held += nbytes
            return True

    def release(self, nbytes: int, buf: np.ndarray | None = None) -> None:
        with self._cv:
            self._held -= nbytes
            if buf is not None and self._capacity is not None and \
                    self._held + self._cached + nbytes <= self._capacity:
                self._free.setdefault(nbytes, []).append(buf)
                self._cached += nbytes
            self._cv.notify_all()
