"""Wakes the replication loop when a step is committed on this host's RAM disk.

A step is committed by renaming its folder into the root (the sidecar's writer,
Orbax's local commit, a restore's own copy). The loop polls the root every
``poll_s`` (0.2 s by default) anyway; with this watch it starts a step's copy
as soon as the rename lands, so the time a step has a single copy no longer
includes up to one poll interval.

Linux's inotify (through libc: no dependency) watches the root alone, for
entries renamed into it; the poll stays as the safety net wherever
the watch cannot be had (another OS, the watch limit reached, the root
replaced) and for whatever else the loop does on its own time (collection).
Runs in the replication loop's thread: no thread of its own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
from pathlib import Path

log = logging.getLogger(__name__)

_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_IN_MOVED_TO = 0x80
_DRAIN = 64 << 10  # bytes of events read at a time; what is pending is all dropped


def _libc() -> ctypes.CDLL | None:
    try:  # the process's own symbols: libc is linked in (no library search, no ldconfig)
        lib = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return lib if hasattr(lib, "inotify_init1") else None


class RootWatch:
    """``wait(timeout)`` returns at the timeout, at the first entry renamed
    into ``root`` since the last wait, or at :meth:`wake`, whichever
    comes first. Without inotify it is a plain timed wait."""

    def __init__(self, root: Path) -> None:
        self._wake_r, self._wake_w = os.pipe()  # not inherited by children (PEP 446)
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._fd = -1
        lib = _libc() if os.name == "posix" else None
        if lib is None:
            log.info("no inotify here: steps are found by polling only")
            return
        fd = lib.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.warning("inotify unavailable (%s): steps are found by polling only",
                        os.strerror(ctypes.get_errno()))
            return
        if lib.inotify_add_watch(fd, os.fsencode(root), _IN_MOVED_TO) < 0:
            log.warning("cannot watch %s (%s): steps are found by polling only", root,
                        os.strerror(ctypes.get_errno()))
            os.close(fd)
            return
        self._fd = fd

    @property
    def watching(self) -> bool:
        return self._fd >= 0

    def wait(self, timeout: float) -> None:
        """Until ``timeout`` seconds pass, an entry is renamed into the root, or :meth:`wake`."""
        # poll, not select: a replicator's descriptors (connections, files) may
        # number past select's 1024.
        waiter = select.poll()
        for fd in (self._wake_r, self._fd):
            if fd >= 0:
                waiter.register(fd, select.POLLIN)
        for fd, _ in waiter.poll(max(0.0, timeout) * 1000):
            self._drain(fd)

    def wake(self) -> None:
        """Ends the current (or the next) wait now; safe from any thread."""
        if self._wake_w < 0:
            return  # closed: nobody waits
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # already woken: the pipe holds bytes enough

    def close(self) -> None:
        for fd in (self._fd, self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._fd = self._wake_r = self._wake_w = -1

    @staticmethod
    def _drain(fd: int) -> None:
        """Drop what is pending: the loop looks at the whole root anyway. A watch the
        kernel ended (the root removed) just stops waking the loop; the poll goes on."""
        while True:
            try:
                if not os.read(fd, _DRAIN):
                    return
            except BlockingIOError:
                return
