"""Files that failed verification, moved out of the way and kept for inspection.

A quarantined file leaves its step folder in one rename, so no reader, sender or
deduplicating receiver can use its bytes again, and the step stops counting as
complete until a good copy takes the file's place. It lands in
``<root>/.mtc-quarantine/``: not a digits-only name, so no step listing (mtc's,
the replicator's or Orbax's) ever sees it, and never cleaned as a leftover. Only
the newest :data:`KEEP` are kept: a RAM disk must not fill with bad bytes.

A file with other links under the root (a replicator's claim on bytes its host
already held: one inode for a step's file and a peer's copy of it) takes them
along: they are the same bytes, and whoever found them bad may be the only one
that reads them (silent damage keeps size and mtime, so checksum caches still
vouch for the other names).
"""

from __future__ import annotations

import logging
import os
import stat
import time
import uuid
from pathlib import Path

from mtc.sidecar.confine import is_beneath, is_real_dir, real_dir
from mtc.sidecar.storage.publish import publish

QUARANTINE_DIR = ".mtc-quarantine"
KEEP = 32

log = logging.getLogger(__name__)


def quarantine(root: Path, path: Path, reason: str,
               links: list[Path] | None = None) -> Path | None:
    """Move ``path`` (under ``root``) aside, and every other link to its bytes under
    ``root`` (``links``, when the caller found them already: :func:`links_of`);
    None when it was already gone. A path that does not lie under ``root`` (a
    symlink leading out on the way) is never moved: only the RAM disk's own
    files are."""
    if not is_beneath(root, path.parent) and os.path.realpath(path.parent) != \
            os.path.realpath(root):
        log.error("not quarantining %s: it is not under %s (%s)", path, root, reason)
        return None
    others = links_of(root, path) if links is None else links
    dst = _move(root, path, reason)
    for other in others:
        _move(root, other, f"the same bytes as {path}: {reason}")
    return dst


def links_of(root: Path, path: Path) -> list[Path]:
    """The other names of ``path``'s bytes under ``root`` (hard links: a claim on
    them), found by walking the root without following links; [] for a file with
    one name. Looked for only when a file is found bad."""
    try:
        st = os.lstat(path)
    except OSError:
        return []
    if st.st_nlink < 2 or not stat.S_ISREG(st.st_mode):
        return []
    want = (st.st_dev, st.st_ino)
    out: list[Path] = []
    todo = [os.fspath(root)]
    while todo and len(out) < st.st_nlink - 1:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if e.name != QUARANTINE_DIR:
                        todo.append(e.path)
                elif e.is_file(follow_symlinks=False) and e.inode() == st.st_ino:
                    other = os.lstat(e.path)
                    if (other.st_dev, other.st_ino) == want and e.path != os.fspath(path):
                        out.append(Path(e.path))
            except OSError:
                continue
    return out


def _move(root: Path, path: Path, reason: str) -> Path | None:
    qdir = real_dir(root / QUARANTINE_DIR)
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        rel = path.name
    name = f"{time.time_ns()}-{uuid.uuid4().hex[:6]}-{rel.replace('/', '__')}"[:200]
    dst = qdir / name
    try:
        publish(path, dst)  # moves a symlink itself, never what it points to
    except FileNotFoundError:
        return None
    log.warning("quarantined %s as %s: %s", path, dst.name, reason)
    _trim(qdir)
    return dst


def quarantined(root: Path) -> list[str]:
    """Names of the quarantined files kept under ``root``, oldest first."""
    if not is_real_dir(root / QUARANTINE_DIR):
        return []
    try:
        return sorted(os.listdir(root / QUARANTINE_DIR))
    except FileNotFoundError:
        return []


def _trim(qdir: Path) -> None:
    # By name, relative to the folder's own descriptor (opened without following a
    # link): only the folder's own entries are ever removed.
    fd = os.open(qdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        names = sorted(os.listdir(fd))
        for n in names[:-KEEP]:
            try:
                os.unlink(n, dir_fd=fd)
            except (IsADirectoryError, FileNotFoundError):
                pass
    finally:
        os.close(fd)
