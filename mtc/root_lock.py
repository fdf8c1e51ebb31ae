"""A host root opened for a checkpoint manager: made (:func:`prepare_root`), and
its writer lock taken (one manager per root).

A manager holds an exclusive ``flock`` on :data:`~mtc.layout.LOCK_NAME` in the
root while it is open; the kernel drops it when the process dies, so a crash
leaves nothing to clean up. Replicators never take it (they write peer copies
and restored steps beside the manager, by design). The host side takes it on its
root (:mod:`mtc.sidecar.ops`); the process dispatcher on each simulated host's
shared-memory area too (the one folder of that host it may touch), so that a
second controller on the same hosts is refused before it reaches them.

Within one process the rule is by writes, not by managers (Orbax's habits: a
new manager on the directory of one not closed, a restart in process, a reader
beside a writer): the kernel lock is taken once per process and shared by its
managers (:func:`lock_root` counts them; the last one lets go), only the first
cleans what a crash left (a later one may find the earlier one's save in
flight), and a save is refused with :class:`DirectoryLockedError` only while
another manager of this process has a save of that directory in flight
(:class:`Writers`): two managers never write one directory at once, and a new
one writes as soon as the earlier is idle or closed. Between processes
nothing is known of the other's saves: the second is refused at open, as ever.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from mtc.errors import DirectoryLockedError, LocalDirError
from mtc.layout import LOCK_NAME


def prepare_root(root: Path) -> None:
    """Create a host root; raise LocalDirError naming it when that is impossible."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied", str(root))
    except OSError as e:
        raise LocalDirError(f"cannot use the directory: {e.strerror or e}",
                            path=str(e.filename or root)) from e


class _Shared:
    """The kernel lock of one root held by this process, and how many hold it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.count = 0


_held: dict[str, _Shared] = {}  # realpath of a root -> its lock held here
_guard = threading.Lock()


def held_here(root: Path) -> bool:
    """Whether a manager of this process holds ``root``'s writer lock already (it may
    be writing: a later one must not clean what looks left by a crash)."""
    with _guard:
        return os.path.realpath(root) in _held


def lock_root(root: Path) -> int:
    """Take the writer lock of a host root; returns a descriptor to give back to
    :func:`unlock_root`. Managers of this process share one kernel lock (see the
    module's docstring); another process's holder raises DirectoryLockedError."""
    key = os.path.realpath(root)
    with _guard:
        shared = _held.get(key)
        if shared is None:
            shared = _held[key] = _Shared(_lock_file(root))
        shared.count += 1
        return os.dup(shared.fd)


def _lock_file(root: Path) -> int:
    """The kernel's writer lock of a host root; returns the descriptor holding it.

    The holder unlinks the file when it lets go (:func:`unlock_root`), so a lock
    taken on a file that was unlinked meanwhile is retried on the new one."""
    path = root / LOCK_NAME
    for _ in range(100):  # each retry means another manager just let go
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LocalDirError(f"cannot create the lock file: {e.strerror}",
                                path=str(path)) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise DirectoryLockedError(
                f"another checkpoint manager (process {holder}) is using this directory; "
                "close it first, or give each job its own local_dir. Processes of one job on "
                "one machine sharing a local_dir (Orbax's multi-process habit) pass "
                "mtc.Options(host_subdirs=True): each host then keeps its steps in its own "
                "<local_dir>/host-<i>/", path=str(root)) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)
    raise DirectoryLockedError("the writer lock keeps changing hands", path=str(path))


def unlock_root(fd: int, root: Path) -> None:
    """Give back a descriptor of :func:`lock_root`; the last holder in this process
    lets go of the kernel lock: unlinks the file (while holding it), then closes."""
    os.close(fd)
    key = os.path.realpath(root)
    with _guard:
        shared = _held.get(key)
        if shared is None:
            return
        shared.count -= 1
        if shared.count > 0:
            return
        del _held[key]
        _unlock_file(shared.fd, root)


def _unlock_file(fd: int, root: Path) -> None:
    path = root / LOCK_NAME
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)  # closing the last descriptor of the open file drops the flock




class Writers:
    """The managers of this process that may write to one directory (keyed by its
    real path), each answering how many of its saves are in flight: a save is
    refused while another one's is (:meth:`refuse_concurrent`)."""

    # Held weakly both ways: a manager nobody closed is still collected.
    _by_dir: ClassVar[dict[str, weakref.WeakKeyDictionary[
        object, weakref.WeakMethod[Callable[[], int]]]]] = {}

    @classmethod
    def join(cls, directory: str, who: object, in_flight: Callable[[], int]) -> None:
        with _guard:
            group = cls._by_dir.setdefault(os.path.realpath(directory),
                                           weakref.WeakKeyDictionary())
            group[who] = weakref.WeakMethod(in_flight)

    @classmethod
    def leave(cls, directory: str, who: object) -> None:
        with _guard:
            group = cls._by_dir.get(os.path.realpath(directory))
            if group is not None:
                group.pop(who, None)

    @classmethod
    def refuse_concurrent(cls, directory: str, who: object) -> None:
        """Raise DirectoryLockedError when another manager of this process has a save
        of ``directory`` in flight (the two would write it at once)."""
        with _guard:
            others = [f for w, f in (cls._by_dir.get(os.path.realpath(directory)) or {}).items()
                      if w is not who]
        busy = 0
        for ref in others:
            in_flight = ref()
            if in_flight is not None:
                busy += in_flight()
        if busy:
            raise DirectoryLockedError(
                f"another CheckpointManager of this process has {busy} save(s) of this "
                "directory in flight: two managers never write one directory at once; "
                "wait_until_finished() or close() the other one first", path=directory)
