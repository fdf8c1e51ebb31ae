"""Files that failed verification, moved out of the way and kept for inspection.

A quarantined file leaves its step folder in one rename, so no reader, sender or
deduplicating receiver can use its bytes again, and the step stops counting as
complete until a good copy takes the file's place. It lands in
``<root>/.mtc-quarantine/``: not a digits-only name, so no step listing (mtc's,
the replicator's or Orbax's) ever sees it, and never cleaned as a leftover. Only
the newest :data:`KEEP` are kept: a RAM disk must not fill with bad bytes.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

QUARANTINE_DIR = ".mtc-quarantine"
KEEP = 32

log = logging.getLogger(__name__)


def quarantine(root: Path, path: Path, reason: str) -> Path | None:
    """Move ``path`` (under ``root``) aside; None when it was already gone."""
    qdir = root / QUARANTINE_DIR
    qdir.mkdir(exist_ok=True)
    try:
        rel = path.relative_to(root).as_posix()
    except ValueError:
        rel = path.name
    dst = qdir / f"{time.time_ns()}-{uuid.uuid4().hex[:6]}-{rel.replace('/', '__')}"
    try:
        os.rename(path, dst)
    except FileNotFoundError:
        return None
    log.warning("quarantined %s as %s: %s", path, dst.name, reason)
    _trim(qdir)
    return dst


def quarantined(root: Path) -> list[str]:
    """Names of the quarantined files kept under ``root``, oldest first."""
    try:
        return sorted(os.listdir(root / QUARANTINE_DIR))
    except FileNotFoundError:
        return []


def _trim(qdir: Path) -> None:
    names = sorted(os.listdir(qdir))
    for n in names[:-KEEP]:
        try:
            os.unlink(qdir / n)
        except (IsADirectoryError, FileNotFoundError):
            pass
