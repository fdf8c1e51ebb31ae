"""Where steps live on a RAM disk, and the commit protocol.

A host root holds committed steps as folders named by the step number. A step
is written into ``<step>.mtc-tmp-<nonce>/`` and becomes visible only through one
atomic rename to ``<step>/``; deletion renames it to ``<step>.mtc-del-<nonce>/``
first, so a crash never leaves a half-deleted folder that looks committed.
Anything that is not a digits-only folder is never read, and mtc's own
leftovers are removed by :func:`clean_uncommitted`.
"""

from __future__ import annotations

import os
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

TMP_MARK = ".mtc-tmp-"
DEL_MARK = ".mtc-del-"


def host_root(local_dir: str | os.PathLike[str], host: int, subdirs: bool) -> Path:
    """The folder holding ``host``'s steps."""
    return Path(local_dir) / f"host-{host}" if subdirs else Path(local_dir)


def step_dir(root: Path, step: int) -> Path:
    return root / str(step)


def new_tmp_dir(root: Path, step: int) -> Path:
    return root / f"{step}{TMP_MARK}{uuid.uuid4().hex[:12]}"


def committed_steps(root: Path) -> list[int]:
    """Committed steps under ``root``, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and (root / n).is_dir())


def commit(tmp: Path, final: Path) -> None:
    """Publish a fully written step folder. Raises FileExistsError if ``final`` exists."""
    # rename(2) onto an existing empty directory would silently succeed; refuse.
    if final.exists():
        raise FileExistsError(str(final))
    os.rename(tmp, final)


_deleter: ThreadPoolExecutor | None = None


def remove_step(root: Path, step: int, *, background: bool = False) -> bool:
    """Delete a committed step, atomically hiding it first. False if absent.

    With ``background`` the hidden folder is removed on a helper thread: freeing
    a large step takes a noticeable fraction of a second, which a training loop
    should not wait for. Leftovers of a crash are removed by clean_uncommitted.
    """
    global _deleter
    src = step_dir(root, step)
    dst = root / f"{step}{DEL_MARK}{uuid.uuid4().hex[:12]}"
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return False
    if background:
        if _deleter is None:
            _deleter = ThreadPoolExecutor(1, thread_name_prefix="mtc-delete")
        _deleter.submit(shutil.rmtree, dst, ignore_errors=True)
    else:
        shutil.rmtree(dst, ignore_errors=True)
    return True


def clean_uncommitted(root: Path) -> list[str]:
    """Remove mtc's temporary and half-deleted folders; returns their names."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    removed = [n for n in names if TMP_MARK in n or DEL_MARK in n]
    for n in removed:
        shutil.rmtree(root / n, ignore_errors=True)
    return removed
