"""Reading shard files back, every byte checked against the manifest.

Large files are mapped copy-on-write rather than read: on a RAM disk the pages
are already in memory, so a mapped shard costs one checksum pass and, on CPU
devices, can become a JAX buffer without another copy. Small files are read
(:data:`READ_BELOW`): a mapping costs more system calls than its bytes are
worth (a model's biases, norms and step counters are hundreds of files of a
few KiB). Shards that lie one after another along the leading axis of a target
shard are mapped side by side into one contiguous region, so resharding onto
fewer devices needs no copy either.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mtc.errors import CorruptShardError, StorageError
from mtc.integrity import crc32c
from mtc.manifest import ShardEntry

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_MAP_FIXED = 0x10


GVISOR_VERSION = "Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016"


def prefault_flag(proc_version: str) -> int:
    """``MAP_POPULATE`` under gVisor (``/proc/version`` is its fixed text), else 0.

    Under gVisor each page fault of a fresh mapping is a trip to its kernel in
    user space: a mapped 64 MiB shard verified at 0.6 GB/s, prefaulted at 8 GB/s
    (a TPU v5e host's sandbox; a 1 GiB restore 1.88 s against 0.23 s,
    measured with the device benchmark then). On Linux the kernel maps the pages around each
    fault as the checksum walks the file, and prefaulting a private writable
    mapping copies every page (4x slower here): there it is left out."""
    return getattr(mmap, "MAP_POPULATE", 0) if proc_version.startswith(GVISOR_VERSION) else 0


def _proc_version() -> str:
    try:
        with open("/proc/version", encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


_PREFAULT = prefault_flag(_proc_version())


def read_below(proc_version: str) -> int:
    """Files smaller than this are read, larger ones mapped (:func:`load_verified`).

    Per file on a RAM disk, opened, read or mapped, checksummed and closed: on
    Linux (this 2-core machine) a read takes 8 us at 1 KiB and 17 at 64 KiB
    against 27 and 30 for ``fstat`` and a mapping; they are close from 256 KiB
    and the mapping wins from 4 MiB (and only a mapping lets a CPU device adopt
    the bytes without a copy). Under gVisor (a TPU v5e host) each mapping is a
    trip to its kernel in user space: 162 us at 1 KiB, 313 at 256 KiB and 0.65 to
    3 ms at 4 MiB against a read's 35, 147 and 0.35 to 1 ms; from 16 MiB the mapping
    wins again (2.6 against 4.5 ms; 9 against 73 ms at 64 MiB, whose read lands
    in new memory). The demo model's 109 files restore on that host in 45 ms
    instead of 59 (40 with each opened from its folder's descriptor, :data:`At`)."""
    return (4 << 20) + 1 if proc_version.startswith(GVISOR_VERSION) else 64 << 10


READ_BELOW = read_below(_proc_version())
ADOPT_ALIGN = 64  # a CPU device's buffers: host memory so aligned is used in place


def _check_size(fd: int, path: str | Path, entry: ShardEntry, step: int, host: int) -> None:
    size = os.fstat(fd).st_size
    if size != entry.nbytes:
        raise CorruptShardError(
            f"shard has {size} bytes, manifest says {entry.nbytes} (truncated or replaced)",
            step=step, host=host, path=str(path))


def _verify(view: np.ndarray, path: str | Path, entry: ShardEntry, step: int, host: int) -> None:
    got = crc32c(view) if entry.nbytes else 0
    if got != entry.crc32c:
        raise CorruptShardError(
            f"checksum mismatch: crc32c {got:#010x}, manifest says {entry.crc32c:#010x}",
            step=step, host=host, path=str(path))


# (descriptor of a step folder, a file's name in it): where a file is opened from.
# A name relative to the folder's descriptor is one step of path walk instead of
# the whole path's (under gVisor, 15 us an open against 24 to 50), and the folder
# checked once cannot be swapped for a symlink under the reader afterwards.
At = tuple[int, str]

_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open(path: str | Path, step: int, host: int, at: At | None = None) -> int:
    try:
        # A shard file is never a symlink: one planted in a step leads out of it.
        if at is None:
            return os.open(path, _FILE_FLAGS)
        return os.open(at[1], _FILE_FLAGS, dir_fd=at[0])
    except FileNotFoundError as e:
        raise CorruptShardError("shard file is missing", step=step, host=host,
                                path=str(path)) from e
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptShardError("shard file is a symlink", step=step, host=host,
                                    path=str(path)) from e
        raise StorageError(f"cannot open: {e.strerror}", step=step, host=host,
                           path=str(path)) from e


def open_step_folder(path: str | Path, *, step: int, host: int) -> int:
    """A descriptor of a host's step folder, for :data:`At`: the folder itself, not
    a symlink named as the step (which would lead elsewhere)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise CorruptShardError("step folder is missing or not a folder", step=step,
                                    host=host, path=str(path)) from e
        raise StorageError(f"cannot open: {e.strerror}", step=step, host=host,
                           path=str(path)) from e


def load_verified(path: str | Path, entry: ShardEntry, *, step: int, host: int,
                  at: At | None = None) -> np.ndarray:
    """A writable uint8 view of a shard file's bytes, checksum verified: read into
    memory of its own when smaller than :data:`READ_BELOW`, else mapped
    copy-on-write. Either way nothing written to it reaches the file. With ``at``
    the file is opened from there, and ``path`` only names it."""
    if entry.nbytes < READ_BELOW:
        return read_verified(path, entry, step=step, host=host, at=at)
    return map_verified(path, entry, step=step, host=host, at=at)


def read_verified(path: str | Path, entry: ShardEntry, *, step: int, host: int,
                  at: At | None = None) -> np.ndarray:
    """A shard file read into a new buffer, its size and checksum verified. One byte
    more than the manifest's size is asked for, so that a longer file shows without
    an ``fstat``; a read that stops at exactly the manifest's size is the file's
    end (a regular file's read comes back short only there). Every byte used is
    the checksum's either way. The size is only looked up to name it in an error."""
    # Aligned as a CPU device adopts host memory without a copy (64 bytes; numpy
    # promises 16): a small shard's bytes are copied once, by the read.
    raw = np.empty(entry.nbytes + 1 + ADOPT_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ADOPT_ALIGN
    buf = raw[start:start + entry.nbytes + 1]
    fd = _open(path, step, host, at)
    try:
        got = os.readv(fd, [buf])
        while got < entry.nbytes:  # short: the file's end, or read on
            n = os.readv(fd, [buf[got:]])
            if n == 0:
                break
            got += n
        if got != entry.nbytes:
            _check_size(fd, path, entry, step, host)
            raise CorruptShardError(f"shard changed size while read ({got} bytes read, "
                                    f"manifest says {entry.nbytes})", step=step, host=host,
                                    path=str(path))
    finally:
        os.close(fd)
    view = buf[:entry.nbytes]
    _verify(view, path, entry, step, host)
    return view


def map_verified(path: str | Path, entry: ShardEntry, *, step: int, host: int,
                 at: At | None = None) -> np.ndarray:
    """A writable (copy-on-write) uint8 view of a shard file, checksum verified."""
    fd = _open(path, step, host, at)
    try:
        _check_size(fd, path, entry, step, host)
        if entry.nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        m = mmap.mmap(fd, entry.nbytes, flags=mmap.MAP_PRIVATE | _PREFAULT,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    view = np.frombuffer(m, dtype=np.uint8)
    _verify(view, path, entry, step, host)
    return view


def can_map_side_by_side(entries: Sequence[ShardEntry]) -> bool:
    """Whether the files can be mapped back to back (all but the last page-sized)."""
    return len(entries) > 1 and all(e.nbytes % PAGE == 0 and e.nbytes for e in entries[:-1]) \
        and entries[-1].nbytes > 0


def map_side_by_side(pieces: Sequence[tuple[str | Path, ShardEntry]], *, step: int,
                     hosts: Sequence[int], at: Sequence[At] | None = None) -> np.ndarray:
    """Map several shard files into one contiguous region, each verified (with
    ``at``, each opened from its own there)."""
    total = sum(e.nbytes for _, e in pieces)
    region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(anchor)
    del anchor  # the region must not stay exported, or it could never be unmapped
    offset = 0
    places: Sequence[At | None] = at if at is not None else [None] * len(pieces)
    for (path, entry), host, place in zip(pieces, hosts, places, strict=True):
        fd = _open(path, step, host, place)
        try:
            _check_size(fd, path, entry, step, host)
            # Replace part of our own anonymous mapping with the file, copy-on-write.
            addr = _libc.mmap(base + offset, entry.nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_PRIVATE | _MAP_FIXED | _PREFAULT, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value) or addr != base + offset:
                raise StorageError(f"mmap failed: {os.strerror(ctypes.get_errno())}",
                                   step=step, host=host, path=str(path))
        finally:
            os.close(fd)
        offset += entry.nbytes
    view = np.frombuffer(region, dtype=np.uint8)
    offset = 0
    for (path, entry), host in zip(pieces, hosts, strict=True):
        _verify(view[offset:offset + entry.nbytes], path, entry, step, host)
        offset += entry.nbytes
    return view
