"""Host files read to checksum or copy them: host-side code (only a host's
processes touch its RAM disk), shared by the replicator's store and the backups."""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Any

from mtc.integrity import crc32c


def read_buffer(f: Any, chunk: int) -> memoryview:
    """A buffer to read an open file through: ``chunk`` bytes, but no more than a
    regular file holds. A new bytearray is zero-filled, and a step is hundreds of
    small shard files: a chunk-sized buffer for each was most of a replicator's
    CPU after a save (0.7 GB filled for a 19 MB step, on the cores the trainer
    uses). A stream of unknown length (a pipe, a socket, no file at all) gets the
    whole chunk."""
    try:
        st = os.fstat(f.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is a ValueError
        return memoryview(bytearray(chunk))
    size = st.st_size if stat.S_ISREG(st.st_mode) else chunk
    return memoryview(bytearray(max(1, min(chunk, size))))


def file_sha256(path: str | os.PathLike[str], chunk: int) -> bytes:
    """SHA-256 digest of a file, read ``chunk`` bytes at a time (through a buffer
    no bigger than the file: see :func:`read_buffer`)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        view = read_buffer(f, chunk)
        while k := f.readinto(view):
            h.update(view[:k])
    return h.digest()


def file_crc(path: str | os.PathLike[str], chunk: int) -> tuple[int, int]:
    """(size, CRC32C) of a file, read ``chunk`` bytes at a time."""
    crc = n = 0
    with open(path, "rb", buffering=0) as f:
        view = read_buffer(f, chunk)
        while k := f.readinto(view):
            crc = crc32c(view[:k], crc)
            n += k
    return n, crc
