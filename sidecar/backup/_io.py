"""Copying a stream to or from a backup store with a running CRC32C (a file's own
checksums, renames and temporary names are :mod:`mtc.sidecar.storage`'s)."""

from __future__ import annotations

from typing import IO, Any

from mtc.integrity import crc32c
from mtc.sidecar.storage.checksum import read_buffer

CHUNK = 8 << 20  # a stream to or from a backup store: larger reads, fewer calls


def copy_stream(src: IO[Any], dst: IO[Any], crc: int = 0) -> tuple[int, int]:
    """Copy ``src`` to its end into ``dst``; returns (bytes copied, running CRC32C)."""
    view = read_buffer(src, CHUNK)
    n = 0
    while True:
        k = src.readinto(view) if hasattr(src, "readinto") else _read_into(src, view)
        if not k:
            return n, crc
        crc = crc32c(view[:k], crc)
        dst.write(view[:k])
        n += k


def _read_into(src: IO[Any], view: memoryview) -> int:
    data = src.read(len(view))
    view[: len(data)] = data
    return len(data)

