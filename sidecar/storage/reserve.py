"""Blank RAM-disk space set aside for the next files of known sizes, so that they
are written at the speed of memory.

A tmpfs page costs most when it is first written: the kernel allocates it on
the writer's time. Measured on the 2-core machine the README's figures come
from: ``write(2)`` into new tmpfs files moves 2.3 GB/s, into files whose pages
are already allocated 6.7 GB/s; a socket spliced into them 1.8 against 5.0 GB/s
(raw loopback TCP: 4.3 GB/s). A job's arrays keep their shapes, so the next save
of a host, and the next peer copy from an origin, bring files of the sizes the
last one brought. After each, the process that wrote it allocates blank files of
those sizes again (``posix_fallocate``) on a thread at background priority, and
the next one's files take their places by rename. The work is the same; it is
done between saves, not while a step waits to be committed.

Used by the sidecar's writer (own steps) and by the replicator (peer copies),
each with a folder of its own in the root.

Safety: a reserved file is made here, blank, and never read or written while it is
reserved; ``take`` hands each to one caller, who renames it out of the reserve
before writing it and whose bytes are checked as any file's (a save's CRC32C is
taken from the bytes it writes; a copy's file counts only once its size and
CRC32C match the offer). Files of a step never come back into the reserve (a
restore may map them without copying), so nothing a reader may hold is ever
written again.

Room: a file is set aside only while the RAM disk keeps at least as much free
beside the whole reserve as the reserve itself, so neither the own saves nor a
copy ever find the RAM disk full because of it; when a save or a copy starts,
held files of sizes it does not bring are dropped at once (:meth:`Reserve.begin`),
and its writer counts the rest as free space (it fills them).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from mtc.lifecycle import Threads
from mtc.pool import lower_thread_priority
from mtc.sidecar.confine import open_beneath, real_dir
from mtc.sidecar.storage.names import tmp_name
from mtc.sidecar.storage.publish import publish

log = logging.getLogger(__name__)

REFILL_S = 5.0  # a refill stopped by a full RAM disk tries again this often

# A blank file whose allocation is complete: its size, then a random name. One
# being allocated has a temporary name until it is complete.
_BLANK = re.compile(r"(\d{1,19})\.[0-9a-f]{12}")


def reserved_bytes(folder: Path) -> int:
    """Bytes of the blank files in a reserve ``folder`` (0 when there is none), for
    a host's free space. One listing: a complete file's size is its name's
    (:meth:`Reserve._allocate` gives it that name once its allocation is done, and
    a reserved file is never written), so only other names (one being allocated)
    cost a ``stat`` each. A save's survey asked this of a hundred files one
    ``lstat`` at a time: 1.8 ms under gVisor, against 0.12 for the listing."""
    try:
        names = os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    total = 0
    for name in names:
        blank = _BLANK.fullmatch(name)
        if blank is not None:
            total += int(blank[1])
            continue
        try:
            total += os.lstat(os.path.join(folder, name)).st_size
        except FileNotFoundError:
            continue
    return total


def plan_reserve(wanted: Counter[int], held: Counter[int]) -> tuple[Counter[int], list[int]]:
    """(files to drop by size, sizes to allocate, largest first): what turns the
    reserve ``held`` into ``wanted`` (both: size -> count)."""
    drop = held - wanted
    make = sorted((wanted - held).elements(), reverse=True)
    return drop, make


def fill_while(stop: threading.Event, wake: threading.Event,
               reserves: Callable[[], Iterable[Reserve]]) -> None:
    """Fill ``reserves()`` (:meth:`Reserve.fill_once`) whenever ``wake`` is set (a
    save or a copy was committed) and every ``REFILL_S`` (room may have come free),
    at background priority, until ``stop``. The loop of a filling thread."""
    lower_thread_priority(19)  # behind the job's threads, the saves and copies
    while not stop.is_set():
        for r in reserves():
            try:
                r.fill_once()
            except OSError as e:
                log.warning("blank files in %s are not set aside: %s", r.folder, e)
        wake.wait(REFILL_S)
        wake.clear()


class Reserve:
    """One process's blank files in one RAM disk (``root/name``), by size; each
    writer of files into it is a ``key`` (a host, an origin rank). :meth:`run`
    (or :meth:`fill_once`) fills it."""

    def __init__(self, root: Path, name: str, room: Callable[[], int], *,
                 enabled: bool = True, mode: int = 0o600,
                 on_take: Callable[[], None] = lambda: None,
                 wake: threading.Event | None = None) -> None:
        self.folder = root / name
        self._room = room  # bytes the RAM disk can still take
        self.enabled = enabled
        self._mode = mode  # of the files handed out (a step's are read by other processes)
        self._on_take = on_take
        self._lock = threading.Lock()
        self._wanted: dict[int, list[int]] = {}  # key -> sizes of its last files
        self._held: dict[int, list[Path]] = {}  # size -> blank files
        # Set when there is filling to do: the owner's loop (run, or its own over
        # several reserves) waits on it.
        self._wake = wake or threading.Event()
        self._stop = threading.Event()
        if self.folder.exists():  # a previous process's: not trusted, made anew
            shutil.rmtree(self.folder, ignore_errors=True)

    # -- the writers' side ------------------------------------------------------------

    def want(self, key: int, sizes: Iterable[int]) -> None:
        """``key``'s next save or copy will likely bring files of ``sizes`` (those of
        the one just committed): set them aside."""
        if not self.enabled:
            return
        with self._lock:
            self._wanted[key] = sorted(s for s in sizes if s > 0)
        self._wake.set()

    def begin(self, key: int, sizes: Iterable[int]) -> None:
        """``key``'s save or copy of files of ``sizes`` starts: only what it can use
        stays wanted, and held files of no wanted size are removed now, so that
        their room is its. Nothing is set aside again until :meth:`want`."""
        with self._lock:
            usable = Counter(self._wanted.get(key, ())) & Counter(sizes)
            self._wanted[key] = sorted(usable.elements())
            dropped = self._drop_unwanted()
        for path in dropped:
            path.unlink(missing_ok=True)

    def take(self, size: int, key: int) -> Path | None:
        """A blank file of exactly ``size`` bytes for ``key``'s save or copy, now the
        caller's to rename; None when none is set aside. Not set aside again until
        ``key``'s next one is committed (:meth:`want`): a refill meanwhile would
        race it for the CPUs."""
        with self._lock:
            sizes = self._wanted.get(key)
            if sizes is not None and size in sizes:
                sizes.remove(size)
            files = self._held.get(size)
            if not files:
                return None
            path = files.pop()
        self._on_take()
        return path

    def open_new(self, base: Path, rel: str, size: int, key: int) -> int:
        """A new file ``base/rel`` of ``size`` bytes for ``key`` to write, opened for
        reading and writing at its start: a reserved one renamed into place when one
        of that size is set aside, else made empty (``O_EXCL``). Neither follows a
        symlink."""
        blank = self.take(size, key)
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
        return open_beneath(base, rel, os.O_RDWR | os.O_CREAT | os.O_EXCL, self._mode,
                            makedirs=True)

    def forget(self, key: int) -> None:
        """``key`` will bring no files after all: its sizes are no longer wanted, and
        the blank files set aside for them only are removed now."""
        with self._lock:
            if self._wanted.pop(key, None) is None:
                return
            dropped = self._drop_unwanted()
        for path in dropped:
            path.unlink(missing_ok=True)

    def wants(self, key: int) -> bool:
        """Whether files are set aside (or to be) for ``key``."""
        with self._lock:
            return bool(self._wanted.get(key))

    def drop_all(self) -> None:
        """Remove every blank file now (a write found the RAM disk full); set aside
        again after the next :meth:`want`."""
        with self._lock:
            self._wanted.clear()
        for path in self._release_all():
            path.unlink(missing_ok=True)

    def _forget(self) -> None:
        """The blank files are gone already (a wiped RAM disk): made again."""
        self._release_all()
        self._wake.set()

    def _release_all(self) -> list[Path]:
        with self._lock:
            released = [p for files in self._held.values() for p in files]
            self._held.clear()
        return released

    def held_bytes(self) -> int:
        with self._lock:
            return self._held_total()

    def room_for_others(self, key: int) -> int:
        """Held bytes a writer other than ``key`` may count as room: all of them but
        as many as are set aside for ``key`` alone (a replaced host's restore keeps
        its blank files while copies from other origins arrive)."""
        with self._lock:
            held = self._held_total()
            return held - min(held, sum(self._wanted.get(key, ())))

    def _held_total(self) -> int:
        """Under ``_lock``: the bytes of every blank file held."""
        return sum(size * len(files) for size, files in self._held.items())

    # -- the filling thread -----------------------------------------------------------

    def start(self, threads: Threads) -> None:
        """As a service (:class:`mtc.lifecycle.Service`): :meth:`run` on a thread of
        ``threads``."""
        if self.enabled:
            threads.start(self.run, "mtc-reserve")

    def run(self) -> None:
        """The filling loop, on a thread of its owner's (:func:`fill_while`)."""
        if self.enabled:
            fill_while(self._stop, self._wake, lambda: [self])

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        pass  # the blank files stay: the next process's start removes them

    def fill_once(self) -> None:
        """Drop the blank files no longer wanted, then allocate the missing ones
        while the room rule allows (largest first)."""
        if not self.enabled:
            return
        with self._lock:
            dropped = self._drop_unwanted()
            wanted = self._all_wanted()
            _, make = plan_reserve(wanted, self._held_sizes())
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

    def _all_wanted(self) -> Counter[int]:
        return Counter(s for sizes in self._wanted.values() for s in sizes)

    def _held_sizes(self) -> Counter[int]:
        return Counter({s: len(f) for s, f in self._held.items() if f})

    def _drop_unwanted(self) -> list[Path]:
        """Under ``_lock``: forget the held files beyond what is wanted; returns them
        (the caller removes them outside the lock)."""
        drop, _ = plan_reserve(self._all_wanted(), self._held_sizes())
        return [self._held[s].pop() for s, n in drop.items() for _ in range(n)]

    def _allocate(self, size: int) -> Path | None:
        real_dir(self.folder)
        path = self.folder / f"{size}.{uuid.uuid4().hex[:12]}"
        # Named by its size only once it has it (reserved_bytes counts by name).
        new = tmp_name(path)
        fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     self._mode)
        try:
            os.posix_fallocate(fd, 0, size)
            publish(new, path)
        except OSError as e:
            new.unlink(missing_ok=True)
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
