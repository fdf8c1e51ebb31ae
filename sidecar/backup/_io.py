"""File helpers the backends share: copying with a running CRC32C, temporary names."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import IO, Any

from mtc.integrity import crc32c
from mtc.sidecar import checksum
from mtc.sidecar.checksum import read_buffer

CHUNK = 8 << 20
TMP_MARK = ".mtc-tmp-"


def tmp_name(path: Path) -> Path:
    """A unique hidden sibling of ``path`` to write before an ``os.replace``."""
    return path.with_name(f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}")


def is_tmp(name: str) -> bool:
    return TMP_MARK in name


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
    return checksum.file_crc(path, CHUNK)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_name(local: Path) -> Path:
    """Where a download of ``local`` accumulates until it is verified."""
    return local.with_name(local.name + ".part")
