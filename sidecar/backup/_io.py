"""File helpers the backends share: copying with a running CRC32C, temporary names."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

from mtc.integrity import crc32c
from mtc.sidecar import files
from mtc.sidecar.files import TMP_MARK as TMP_MARK
from mtc.sidecar.files import is_tmp as is_tmp
from mtc.sidecar.files import read_buffer
from mtc.sidecar.files import tmp_name as tmp_name

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


def file_crc(path: Path) -> tuple[int, int]:
    """(size, CRC32C) of a file, read in chunks."""
    return files.file_crc(path, CHUNK)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_name(local: Path) -> Path:
    """Where a download of ``local`` accumulates until it is verified."""
    return local.with_name(local.name + ".part")
