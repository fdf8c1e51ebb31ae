"""A file's checksums on a host, and a copy checked as it is made: the one place a
host's processes checksum a file (a buffer's CRC32C is :func:`mtc.integrity.crc32c`,
a pure function the controller uses too). The replicator's store, its data channel,
the backups and the host side all take these from here.

- :data:`CHUNK`: bytes per read (and per receive) of a shard file;
- :func:`file_crc`, :func:`file_sha256`: a file's checksums, one pass;
- :func:`copy_verified`: a new file with another's bytes, checked as copied;
  :func:`copy_stream`: a copy with a running CRC32C (a backup store's too).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import stat
from pathlib import Path
from typing import IO, Any

from mtc.errors import CorruptShardError
from mtc.integrity import crc32c

CHUNK = 4 << 20
# A stream to or from a backup store: larger reads, fewer calls.
STREAM_CHUNK = 8 << 20
FICLONE = 0x40049409  # ioctl: share a file's extents copy-on-write (btrfs, xfs)


def read_buffer(f: Any, chunk: int = CHUNK) -> memoryview:
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


def file_sha256(path: str | os.PathLike[str], chunk: int = CHUNK) -> bytes:
    """SHA-256 digest of a file, read ``chunk`` bytes at a time (through a buffer
    no bigger than the file: see :func:`read_buffer`)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        view = read_buffer(f, chunk)
        while k := f.readinto(view):
            h.update(view[:k])
    return h.digest()


def file_crc(path: str | os.PathLike[str], chunk: int = CHUNK) -> tuple[int, int]:
    """(size, CRC32C) of a file, read ``chunk`` bytes at a time (through a buffer no
    bigger than the file): what a copy's description states, both checked."""
    crc = n = 0
    with open(path, "rb", buffering=0) as f:
        view = read_buffer(f, chunk)
        while k := f.readinto(view):
            crc = crc32c(view[:k], crc)
            n += k
    return n, crc


def copy_verified(src: Path, dst: Path, size: int, crc: int) -> str:
    """Copy ``src`` to a new file ``dst`` and check that the copy has ``size`` bytes
    with CRC32C ``crc``; returns "reflink" or "copy". On a mismatch ``dst`` is
    removed and :class:`CorruptShardError` raised."""
    how = "copy"
    try:
        with open(src, "rb", buffering=0) as fin, open(dst, "xb", buffering=0) as fout:
            try:
                fcntl.ioctl(fout.fileno(), FICLONE, fin.fileno())
                how = "reflink"
            except OSError:  # tmpfs and most file systems: no shared extents
                got, value = copy_stream(fin, fout)
        if how == "reflink":  # the clone's bytes are the source's: check them once
            got, value = file_crc(dst)
        if got != size or value != crc:
            raise CorruptShardError(f"local file has {got} bytes crc32c {value:#010x}, "
                                    f"expected {size} bytes {crc:#010x}", path=str(src))
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
    return how


def copy_stream(src: IO[Any], dst: IO[Any], crc: int = 0,
                chunk: int = CHUNK) -> tuple[int, int]:
    """Copy ``src`` to its end into ``dst``, ``chunk`` bytes at a time; returns
    (bytes copied, running CRC32C from ``crc``). ``src`` may be a file or any
    stream with ``read`` (a backup store's)."""
    view = read_buffer(src, chunk)
    n = 0
    while k := _read_into(src, view):
        crc = crc32c(view[:k], crc)
        dst.write(view[:k])
        n += k
    return n, crc


def _read_into(src: IO[Any], view: memoryview) -> int:
    if hasattr(src, "readinto"):
        return src.readinto(view) or 0
    data = src.read(len(view))
    view[: len(data)] = data
    return len(data)
