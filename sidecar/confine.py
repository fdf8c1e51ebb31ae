"""Files under a RAM disk's root, opened without following a symlink out of it.

A path from the network is checked as a string first (:func:`mtc.validate.relpath`);
these helpers then open it part by part from a folder the caller trusts (the root,
a step folder it listed), each part with ``O_NOFOLLOW``, relative to the descriptor
of the part before (``openat``): a symlink planted anywhere below, even between the
check and the open, ends the open with :class:`UnsafePathError`, and nothing above
the trusted folder is looked at. Internal folders (``.mtc-replica``,
``.mtc-quarantine``, ...) are made and checked as real directories: one that is a
symlink is removed (the link, never what it points to) and made again.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path
from typing import BinaryIO

from mtc.errors import LocalDirError, UnsafePathError
from mtc.sidecar.storage.publish import replace
from mtc.validate import relpath

log = logging.getLogger(__name__)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def is_real_dir(path: Path | str) -> bool:
    """A directory that is not a symlink to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def real_dir(path: Path) -> Path:
    """``path`` as a real directory, made if missing (its parent must exist). A
    symlink in its place is removed first (only the link): an internal folder that
    led elsewhere would have files moved or deleted there."""
    for _ in range(3):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                os.mkdir(path)
            except FileExistsError:
                continue  # made meanwhile: look again
            return path
        if stat.S_ISDIR(st.st_mode):
            return path
        if stat.S_ISLNK(st.st_mode):
            log.warning("%s was a symlink (to %s); removed and made a folder", path,
                        os.readlink(path))
            os.unlink(path)
            continue
        raise LocalDirError("an internal folder's name is taken by a file", path=str(path))
    raise LocalDirError("an internal folder keeps changing", path=str(path))


def open_beneath(base: Path | str, rel: str, flags: int = os.O_RDONLY, mode: int = 0o600,
                 *, makedirs: bool = False, adopt: Path | None = None) -> int:
    """A descriptor of ``base/rel``, every part of ``rel`` opened with ``O_NOFOLLOW``
    from the one before (missing folders made with ``makedirs``). ``base`` is trusted
    as it is. ``adopt``: a file of the same file system renamed to ``base/rel``
    first (through the folder's descriptor, so a symlink planted meanwhile is never
    followed), then opened. Raises :class:`UnsafePathError` when a part is a symlink
    (or a file where a folder is needed), FileNotFoundError when one is missing."""
    parts = relpath(rel).split("/")
    fd = os.open(base, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not makedirs:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(f"{rel!r}: {part!r} is a symlink or not a folder "
                                          f"under {base}") from None
                raise
            os.close(fd)
            fd = nxt
        if adopt is not None:
            replace(adopt, parts[-1], dst_dir_fd=fd)
        try:
            return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePathError(f"{rel!r} is a symlink under {base}") from None
            raise
    finally:
        os.close(fd)


def is_beneath(base: Path, path: Path) -> bool:
    """Whether ``path`` lies under ``base`` once every symlink in both is resolved."""
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    return real != real_base and os.path.commonpath([real_base, real]) == real_base


def open_own(path: Path) -> BinaryIO:
    """A file of this host's own copy, to send: never through a symlink planted in
    its place (its last part; the folders above are the store's own)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb",
                     buffering=0)


def create_fetched(dest: Path) -> BinaryIO:
    """A file fetched into a restore's folder: a symlink in its place is not followed
    (open for reading too: the data channel checks the bytes it wrote there)."""
    return os.fdopen(os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644), "wb", buffering=0)
