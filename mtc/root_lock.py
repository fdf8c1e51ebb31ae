"""A host root opened for a checkpoint manager: made (:func:`prepare_root`), and
its writer lock taken (one manager per root).

A manager holds an exclusive ``flock`` on :data:`~mtc.layout.LOCK_NAME` in the
root while it is open; the kernel drops it when the process dies, so a crash
leaves nothing to clean up. Replicators never take it (they write peer copies
and restored steps beside the manager, by design). The host side takes it on its
root (:mod:`mtc.sidecar.ops`); the process dispatcher on each simulated host's
shared-memory area too (the one folder of that host it may touch), so that a
second controller on the same hosts is refused before it reaches them.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

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


def lock_root(root: Path) -> int:
    """Take the writer lock of a host root; returns the descriptor holding it.

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
    """Let go of the writer lock: unlink the file (while holding it), then close."""
    path = root / LOCK_NAME
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)  # closing the last descriptor of the open file drops the flock


