"""The shared-memory area between a host's trainer-side process and its sidecar.

On a real Pathways worker, ``pathways-worker`` and the colocated-Python sidecar
container share a memory-backed folder (``/tmp/sidecar``) through which array
bytes cross; on the local cluster each simulated host has such a folder of its
own, beside (never inside) its RAM disk. Bytes for a save are copied into a
*slot* the controller owns and reuses (memory this VM has not touched recently is
slow to fill); bytes of a restore come back in a fresh file the sidecar writes
and the controller maps, so that arrays adopting the mapping never see it reused.

Offsets are page-aligned: a page-aligned region becomes a CPU ``jax.Array``
without a copy.
"""

from __future__ import annotations

import mmap
import os
import uuid
from pathlib import Path

import numpy as np

ALIGN = 4096


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_regions(sizes: list[int]) -> tuple[list[int], int]:
    """Page-aligned offsets of regions of ``sizes`` bytes laid end to end, and the total."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += aligned(n)
    return offsets, pos


def map_file(path: Path, size: int, *, writable: bool) -> np.ndarray:
    """A uint8 view of ``size`` bytes of ``path`` (created or grown when writable)."""
    flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
    fd = os.open(path, flags, 0o600)
    try:
        if writable and os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        if size == 0:
            return np.zeros(0, np.uint8)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED,
                       mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8) if not writable else np.ndarray(
        (size,), np.uint8, buffer=mm)


class SaveSlot:
    """A reusable region of the area that one host's staged save occupies until written."""

    def __init__(self, area: Path, name: str) -> None:
        self.path = area / name
        self.name = name
        self.size = 0
        self.view = np.zeros(0, np.uint8)
        self.busy = False

    def ensure(self, size: int) -> np.ndarray:
        if size > self.size:
            self.size = aligned(max(size, 2 * self.size))
            self.view = map_file(self.path, self.size, writable=True)
        return self.view


def new_reply_file(area: Path) -> Path:
    return area / f"reply-{uuid.uuid4().hex[:16]}"
