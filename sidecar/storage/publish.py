"""Renames on a host: the one place its processes move a name into place.

- :func:`publish`: ``src`` takes the name ``dst``, which nothing may hold: a step's
  commit, a peer copy's, a backup's staging folder. ``rename(2)`` replaces a file
  and an empty folder without a word; ``renameat2(RENAME_NOREPLACE)`` refuses
  anything there, atomically (a check first and a rename after would let a writer
  in between). A file system or C library without it falls back to that check.
- :func:`replace`: ``src`` takes the name ``dst`` whatever held it (a marker the
  client polls, a repaired file, a blank file adopted).
- :func:`write_atomic`: a small file whole or not at all.

Each takes ``durable``: the rename is synced to the disk (its folder, and the
source's when it moved between folders) before it returns; a file written here is
synced before its rename. A RAM disk loses everything with the power anyway, so
steps are published without it; records meant to outlive a reboot (the
agreement's epochs, a backup folder) ask for it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from pathlib import Path
from typing import Any

from mtc.sidecar.storage.names import tmp_name

StrPath = str | os.PathLike[str]

RENAME_NOREPLACE = 1  # linux/fs.h
_AT_FDCWD = -100


def _load_renameat2() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc 2.28+ (or not Linux)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def publish(src: StrPath, dst: StrPath, *, durable: bool = False,
            src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
    """Rename ``src`` to ``dst``, which must not exist: FileExistsError when anything
    is there (a folder, empty or not, a file, a symlink)."""
    if not _noreplace(src, dst, src_dir_fd, dst_dir_fd):
        # Not atomic against a creator of ``dst`` in between; what this path had
        # before renameat2, where the file system refuses the flag.
        if os.path.lexists(dst if dst_dir_fd is None else _at(dst_dir_fd, dst)):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(dst))
        os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    if durable:
        _sync_folders(src, dst, src_dir_fd, dst_dir_fd)


def replace(src: StrPath, dst: StrPath, *, durable: bool = False,
            src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
    """Rename ``src`` to ``dst``, replacing a file there (never following a symlink
    there: the link itself goes)."""
    os.replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    if durable:
        _sync_folders(src, dst, src_dir_fd, dst_dir_fd)


def write_atomic(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Write ``path`` whole or not at all: a temporary name beside it, then one
    :func:`replace`. ``durable`` syncs the bytes, then the rename."""
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        replace(tmp, path, durable=durable)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(path: StrPath, dir_fd: int | None = None) -> None:
    """Sync a folder: the names created, renamed or removed in it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _noreplace(src: StrPath, dst: StrPath, src_dir_fd: int | None,
               dst_dir_fd: int | None) -> bool:
    """``renameat2(RENAME_NOREPLACE)``; False where it is not to be had."""
    if _renameat2 is None:
        return False
    sfd = _AT_FDCWD if src_dir_fd is None else src_dir_fd
    dfd = _AT_FDCWD if dst_dir_fd is None else dst_dir_fd
    # What os.rename tells audit hooks (a test's watch on who touches a RAM disk).
    sys.audit("os.rename", os.fspath(src), os.fspath(dst), -1 if src_dir_fd is None else src_dir_fd,
              -1 if dst_dir_fd is None else dst_dir_fd)
    if _renameat2(sfd, os.fsencode(src), dfd, os.fsencode(dst), RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False  # this file system (or kernel) takes no flags
    raise OSError(err, os.strerror(err), os.fspath(src), None, os.fspath(dst))


def _at(dir_fd: int, path: StrPath) -> str:
    """``path`` relative to the folder open as ``dir_fd``, as a plain path (Linux)."""
    p = os.fspath(path)
    return p if os.path.isabs(p) else f"/proc/self/fd/{dir_fd}/{p}"


def _sync_folders(src: StrPath, dst: StrPath, src_dir_fd: int | None,
                  dst_dir_fd: int | None) -> None:
    src_parent = os.path.dirname(os.fspath(src)) or "."
    dst_parent = os.path.dirname(os.fspath(dst)) or "."
    fsync_dir(dst_parent, dst_dir_fd)
    if (src_parent, src_dir_fd) != (dst_parent, dst_dir_fd):
        fsync_dir(src_parent, src_dir_fd)
