"""Blank RAM-disk space set aside for the next peer copy, so that it arrives at the
speed of the link.

A tmpfs page costs most when it is first written: the kernel allocates and clears
it on the writer's time. Measured on the 2-core machine the figures in the
README come from, a socket spliced into new tmpfs files moves 1.8 GB/s, into
files whose pages are already allocated 5.0 GB/s (raw loopback TCP: 4.3 GB/s).
A peer copy's files have the sizes of the last copy from the same origin (a
job's arrays keep their shapes), so after each copy is committed this host
allocates blank files of those sizes again (``posix_fallocate``) on a thread at
background priority, and the next copy's files take their places by rename.

Safety: a reserved file is made here, blank, and never read or written while it is
reserved; ``take`` hands each to one caller, who renames it out of the reserve
before writing it, and whose bytes are checked (size and CRC32C) as any received
file's. Files of a step never come back into the reserve (a restore may map them
without copying), so nothing a reader may hold is ever written again.

Room: a file is set aside only while the RAM disk keeps at least as much free
beside the whole reserve as the reserve itself, so the own saves never find the
RAM disk full because of it; the open transfers count the reserve as free (a copy
fills it). ``--no-reserve`` turns it off.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from mtc import layout
from mtc.sidecar.background import lower_this_thread
from mtc.sidecar.confine import open_beneath, real_dir

log = logging.getLogger(__name__)

RESERVE_DIR = ".mtc-reserve"
DISK_SPARE = 64 << 20  # the RAM disk's last bytes, never promised to copies


def room(root: Path) -> int:
    """Bytes of ``root``'s RAM disk that copies may still take."""
    return layout.room(root, DISK_SPARE)
REFILL_S = 5.0  # a refill stopped by a full RAM disk tries again this often


def plan_reserve(wanted: Counter[int], held: Counter[int]) -> tuple[Counter[int], list[int]]:
    """(files to drop by size, sizes to allocate, largest first): what turns the
    reserve ``held`` into ``wanted`` (both: size -> count)."""
    drop = held - wanted
    make = sorted((wanted - held).elements(), reverse=True)
    return drop, make


class Reserve:
    """The blank files of one replicator's RAM disk, by size; :meth:`run` fills it."""

    def __init__(self, root: Path, room: Callable[[], int], *, enabled: bool = True,
                 on_take: Callable[[], None] = lambda: None) -> None:
        self.folder = root / RESERVE_DIR
        self._room = room  # bytes the RAM disk can still take
        self.enabled = enabled
        self._on_take = on_take
        self._lock = threading.Lock()
        self._wanted: dict[int, list[int]] = {}  # origin -> sizes of its last pushed files
        self._held: dict[int, list[Path]] = {}  # size -> blank files
        self._held_bytes = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        if self.folder.exists():  # a previous process's: not trusted, made anew
            shutil.rmtree(self.folder, ignore_errors=True)
        if enabled:
            real_dir(self.folder)

    # -- the copies' side ------------------------------------------------------------

    def want(self, origin: int, sizes: Iterable[int]) -> None:
        """The next copy from ``origin`` will likely bring files of ``sizes``."""
        if not self.enabled:
            return
        with self._lock:
            self._wanted[origin] = sorted(s for s in sizes if s > 0)
        self._wake.set()

    def take(self, size: int, origin: int) -> Path | None:
        """A blank file of exactly ``size`` bytes for a copy from ``origin``, now the
        caller's to rename; None when none is set aside. Not set aside again until
        ``origin``'s next copy is committed (:meth:`want`): a refill during a copy
        would race it for the CPUs."""
        with self._lock:
            sizes = self._wanted.get(origin)
            if sizes is not None and size in sizes:
                sizes.remove(size)
            files = self._held.get(size)
            if not files:
                return None
            path = files.pop()
            self._held_bytes -= size
        self._on_take()
        return path

    def open_new(self, base: Path, rel: str, size: int, origin: int) -> int:
        """A new file ``base/rel`` of ``size`` bytes from ``origin`` to receive, opened
        for reading and writing at its start: a reserved one renamed into place when
        one of that size is set aside, else made empty (``O_EXCL``). Neither follows
        a symlink."""
        blank = self.take(size, origin)
        if blank is not None:
            try:
                return open_beneath(base, rel, os.O_RDWR, makedirs=True, adopt=blank)
            except FileNotFoundError:
                if os.path.lexists(blank):
                    raise
                # The reserve is gone (a wiped RAM disk): forget it; made again later.
                log.warning("the RAM-disk reserve's files are gone (%s); it is made again",
                            blank)
                self._forget()
        return open_beneath(base, rel, os.O_RDWR | os.O_CREAT | os.O_EXCL, makedirs=True)

    def _forget(self) -> None:
        with self._lock:
            self._held.clear()
            self._held_bytes = 0
        self._wake.set()

    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes

    # -- the filling thread -----------------------------------------------------------

    def run(self) -> None:
        """The filling loop (its thread is main's): a refill when a copy was
        committed, and every ``REFILL_S`` (room may have come free); ends at
        :meth:`stop`."""
        if not self.enabled:
            return
        lower_this_thread("the RAM-disk reserve's thread")
        while not self._stop.is_set():
            try:
                self.fill_once()
            except OSError as e:
                log.warning("the RAM-disk reserve is not refilled: %s", e)
            self._wake.wait(REFILL_S)
            self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def fill_once(self) -> None:
        """Drop the blank files no longer wanted, then allocate the missing ones
        while the room rule allows (largest first)."""
        with self._lock:
            wanted = Counter(s for sizes in self._wanted.values() for s in sizes)
            held = Counter({s: len(f) for s, f in self._held.items() if f})
            drop, make = plan_reserve(wanted, held)
            dropped = [self._held[s].pop() for s, n in drop.items() for _ in range(n)]
            self._held_bytes -= sum(drop.elements())
        for path in dropped:
            path.unlink(missing_ok=True)
        keep_free = sum(wanted.elements())
        for size in make:
            if self._stop.is_set() or self._room() - size < keep_free:
                return
            made = self._allocate(size)
            if made is None:
                return
            with self._lock:
                self._held.setdefault(size, []).append(made)
                self._held_bytes += size

    def _allocate(self, size: int) -> Path | None:
        real_dir(self.folder)
        path = self.folder / f"{size}.{uuid.uuid4().hex[:12]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            path.unlink(missing_ok=True)
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                log.info("this RAM disk's file system cannot allocate ahead (%s): no reserve",
                         e.strerror)
                self.enabled = False
            elif e.errno != errno.ENOSPC:
                raise
            return None
        finally:
            os.close(fd)
        return path
