"""A replicator's incoming copies while they arrive: one open transfer per origin rank.

An origin pushes one step at a time to a target, so a new offer from an origin
that still has one open (a retry after a lost reply, a replayed offer) replaces
it: its folder is removed and its id no longer answers. Every open transfer
together is bounded in files and sized against the RAM disk's free space, so
offers alone can neither fill memory with file lists nor the RAM disk with bytes.
"""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from mtc.errors import BusyError
from mtc.sidecar.replicator.store.step_files import FileMeta

RESERVE_DIR = ".mtc-reserve"  # the replicator's blank files (mtc.sidecar.storage.reserve)


class Transfer:
    """An incoming copy: its temporary folder, expected files and verified ones."""

    def __init__(self, origin: int, step: int, tmp: Path, files: list[FileMeta],
                 fences: int = 0) -> None:
        self.origin = origin
        self.step = step
        self.fences = fences  # the store's fences when offered (LocalStore.fenced_since)
        self.tmp = tmp
        self.files = {f.path: f for f in files}
        self.nbytes = sum(f.size for f in files)
        self.verified: set[str] = set()
        self.linked: set[str] = set()  # verified as claims on bytes held here (Link)
        self.candidates: dict[str, Path] = {}
        self.proof = b""  # the origin's signed entry (with mutual TLS), kept with the copy
        self.touched = time.monotonic()
        self.lock = threading.Lock()


class Transfers:
    """The open transfers of one server, by id. ``_lock`` guards ``_open``."""

    def __init__(self, free_bytes: Callable[[], int], *, max_files: int,
                 idle_s: float) -> None:
        self.free_bytes = free_bytes  # what the RAM disk can still take for them
        self.max_files = max_files
        self.idle_s = idle_s
        self._open: dict[str, Transfer] = {}
        self._lock = threading.Lock()

    def open(self, t: Transfer) -> str:
        """Register ``t`` as its origin's one open transfer (an older one of the same
        origin is dropped), if every open transfer together still fits; returns its
        id, or raises :class:`BusyError`."""
        with self._lock:
            dropped = [self._open.pop(k) for k, x in list(self._open.items())
                       if x.origin == t.origin]
            others = list(self._open.values())
            files = sum(len(x.files) for x in others) + len(t.files)
            expected = sum(x.nbytes for x in others) + t.nbytes
            if files > self.max_files:
                raise BusyError(f"open transfers would hold {files} files (at most "
                                f"{self.max_files})", step=t.step, host=t.origin)
            free = self.free_bytes()
            if expected > free:
                raise BusyError(f"open transfers would need {expected} bytes, the RAM disk "
                                f"has {max(free, 0)} free for them", step=t.step, host=t.origin)
            tid = uuid.uuid4().hex
            self._open[tid] = t
        for x in dropped:
            shutil.rmtree(x.tmp, ignore_errors=True)
        return tid

    def get(self, tid: str) -> Transfer | None:
        with self._lock:
            t = self._open.get(tid)
        if t is not None:
            t.touched = time.monotonic()
        return t

    def take(self, tid: str) -> Transfer | None:
        """Remove and return an open transfer (one caller gets it)."""
        with self._lock:
            return self._open.pop(tid, None)

    def put_back(self, tid: str, t: Transfer) -> None:
        with self._lock:
            self._open.setdefault(tid, t)

    def expire(self) -> int:
        """Drop the transfers idle for ``idle_s``; returns how many."""
        now = time.monotonic()
        with self._lock:
            stale = [k for k, t in self._open.items() if now - t.touched > self.idle_s]
            dropped = [self._open.pop(k) for k in stale]
        for t in dropped:
            shutil.rmtree(t.tmp, ignore_errors=True)
        return len(dropped)

    def incoming(self) -> set[tuple[int, int]]:
        with self._lock:
            return {(t.origin, t.step) for t in self._open.values()}
