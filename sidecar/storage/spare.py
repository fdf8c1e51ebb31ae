"""The RAM disk's spare: its last bytes, never promised to a save, a copy or a
blank file set aside; the room left beside it.

A full RAM disk fails whatever writes next (a manifest, an agreement record, a
peer's copy half received): the spare keeps that from being what a promise made.
"""

from __future__ import annotations

import os
from pathlib import Path

SPARE = 64 << 20  # bytes; at most a sixteenth of a small file system (see room)


def free_bytes(path: Path) -> int:
    """Bytes free on the file system holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def room(path: Path, spare: int = SPARE) -> int:
    """Bytes that may still be written on ``path``'s file system, leaving ``spare``
    free (at most a sixteenth of it, on a small one: a test's tmpfs of a few MiB
    would otherwise have no room at all). Negative once the spare is eaten into."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize - min(spare, st.f_blocks * st.f_frsize // 16)
