"""The shared-memory area between a host's trainer-side process and its sidecar.

On a real Pathways worker, ``pathways-worker`` and the colocated-Python sidecar
container share a memory-backed folder (``/tmp/sidecar``) through which array
bytes cross; on the local cluster each simulated host has such a folder of its
own, beside (never inside) its RAM disk. Bytes for a save are copied into a
*slot* the controller owns and reuses (memory this VM has not touched recently is
slow to fill); bytes of a restore come back through a slot the sidecar owns and
refills only once the arrays here that adopted its mapping are gone
(:mod:`mtc.slots`), or, where none is free, through a fresh file.

Offsets are page-aligned: a page-aligned region becomes a CPU ``jax.Array``
without a copy.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mtc.slots import SlotMaps, SlotPool

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
    """A uint8 view of ``size`` bytes of ``path`` (created or grown when writable).
    An area's files are never symlinks; read-only, ``size`` must be in the file (a
    mapping past its end would fault when read): ValueError otherwise."""
    if size < 0:
        raise ValueError(f"negative size {size} for {path.name}")
    flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        have = os.fstat(fd).st_size
        if writable and have < size:
            os.ftruncate(fd, size)
        elif not writable and have < size:
            raise ValueError(f"{path.name} has {have} bytes, {size} were named")
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


# A message of the colocated-Python runtime (mtc.dispatch.remote_colocated): a JSON
# header, then buffers. Small buffers travel in the message; larger ones in a
# reused slot of the area when one is free (mtc.slots), else in a fresh file of
# the area, which the receiver maps and unlinks, as a restore's reply file
# (bytes cross through shared memory, never through the RAM disk).
INLINE_LIMIT = 1 << 20


def program_id(pickled: bytes) -> str:
    """A colocated program's name on the hosts: a digest of its pickled bytes."""
    return hashlib.sha256(pickled).hexdigest()[:32]
_LENGTH = struct.Struct("<Q")


def _write_file(path: Path, buffers: Sequence[np.ndarray], offsets: list[int],
                total: int) -> None:
    # write(2) into fresh tmpfs pages: about twice as fast here as storing through
    # a new mapping (the kernel allocates and copies in one pass).
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, total)
        for b, off in zip(buffers, offsets, strict=True):
            view = b.data
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], off + done)
    finally:
        os.close(fd)


def pack_message(area: Path, header: dict[str, Any], buffers: Sequence[np.ndarray],
                 slots: SlotPool | None = None) -> bytes:
    """``header`` and ``buffers`` (uint8, contiguous) as one message; the header gains
    ``offsets``, ``size`` and, when the buffers went to a free slot of ``slots``, its
    name ``slot`` and ``use``, or when they went to a fresh file, its name ``file``."""
    offsets, total = layout_regions([b.nbytes for b in buffers])
    header = {**header, "offsets": offsets, "size": total,
              "nbytes": [b.nbytes for b in buffers]}
    slot = slots.take() if slots is not None and total > INLINE_LIMIT else None
    if slot is not None:
        try:  # one copy into memory touched before (the slot's mapping is kept)
            view = slot.ensure(total)
            for b, off in zip(buffers, offsets, strict=True):
                np.copyto(view[off:off + b.nbytes], b)
        except BaseException:
            assert slots is not None
            slots.unsent(slot)
            raise
        head = json.dumps({**header, "slot": slot.name, "use": slot.use}).encode()
        return _LENGTH.pack(len(head)) + head
    if total > INLINE_LIMIT:
        path = area / f"call-{uuid.uuid4().hex[:16]}"
        _write_file(path, buffers, offsets, total)
        head = json.dumps({**header, "file": path.name}).encode()
        return _LENGTH.pack(len(head)) + head
    head = json.dumps(header).encode()
    out = bytearray(_LENGTH.size + len(head) + total)
    _LENGTH.pack_into(out, 0, len(head))
    start = _LENGTH.size + len(head)
    out[_LENGTH.size:start] = head
    for b, off in zip(buffers, offsets, strict=True):
        out[start + off:start + off + b.nbytes] = b.data
    return bytes(out)


def unpack_message(area: Path, message: bytes, slots: SlotMaps | None = None
                   ) -> tuple[dict[str, Any], list[np.ndarray]]:
    """The header and the buffers (read-only uint8 views) of a :func:`pack_message`
    message; a file it names is unlinked (its mapping lives on with the views); a
    slot it names is mapped through ``slots``, busy while the views live.
    Raises ValueError on a malformed message."""
    if len(message) < _LENGTH.size:
        raise ValueError("message shorter than its length field")
    (n,) = _LENGTH.unpack_from(message)
    header = json.loads(message[_LENGTH.size:_LENGTH.size + n])
    if not isinstance(header, dict):
        raise ValueError("message header is not an object")
    size, offsets = int(header["size"]), [int(o) for o in header["offsets"]]
    sizes = [int(x) for x in header["nbytes"]]
    name = header.get("file")
    if "slot" in header:
        if slots is None:
            raise ValueError("message names a slot where none are kept")
        data = slots.view(header["slot"], int(header["use"]), size)
    elif name is not None:
        if not isinstance(name, str) or "/" in name or not name.startswith("call-"):
            raise ValueError(f"message names a bad file {name!r}")
        path = area / name
        data = map_file(path, size, writable=False)
        os.unlink(path)
    else:
        data = np.frombuffer(message, np.uint8, count=size, offset=_LENGTH.size + n)
    if len(sizes) != len(offsets) or any(o < 0 or o + k > data.size
                                         for o, k in zip(offsets, sizes, strict=True)):
        raise ValueError("message buffers lie outside its payload")
    return header, [data[o:o + k] for o, k in zip(offsets, sizes, strict=True)]
