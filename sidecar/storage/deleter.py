"""Removing folders from a host root: hidden first, then removed.

A committed step is renamed to a :func:`~.names.deleted_dir` name before its files
go, so a crash never leaves a half-removed folder under a step's name; what a crash
leaves (half-deleted and half-written folders) :func:`clean_uncommitted` removes.
Freeing a large step takes a noticeable fraction of a second, which a training
loop should not wait for: a :class:`Deleter` removes hidden folders on a thread of
its own, and its owner closes it (waiting for what it was given).
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future, wait
from pathlib import Path

from mtc import layout
from mtc.pool import ThreadPool, lower_thread_priority
from mtc.sidecar.storage.names import deleted_dir
from mtc.sidecar.storage.publish import publish


class Deleter:
    """Removes hidden folders on one low-priority thread, started on first use;
    :meth:`close` waits for them and joins it. Once closed (or where no thread can
    start: the interpreter is exiting) a folder is removed in the caller's thread."""

    def __init__(self, name: str = "mtc-delete") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPool | None = None
        self._pending: list[Future[None]] = []
        self._closed = False

    def remove(self, path: Path) -> None:
        """Remove the folder ``path`` (already under a name nothing reads), soon."""
        with self._lock:
            if self._pool is None and not self._closed:
                try:
                    self._pool = ThreadPool(1, self._name, initializer=lower_thread_priority)
                except RuntimeError:  # the interpreter is exiting: no new threads
                    self._closed = True
            if self._pool is not None and not self._closed:
                self._pending = [f for f in self._pending if not f.done()]
                self._pending.append(self._pool.submit(shutil.rmtree, path, ignore_errors=True))
                return
        shutil.rmtree(path, ignore_errors=True)

    def settle(self) -> None:
        """Wait until every folder given so far is removed (its space free)."""
        with self._lock:
            pending = list(self._pending)
        wait(pending)

    def close(self) -> None:
        """Finish the removals under way and join the thread; later ones run inline."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            self._pending = []
        if pool is not None:
            pool.shutdown(wait=True)

    def __enter__(self) -> Deleter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_step(root: Path, step: int, deleter: Deleter | None = None) -> bool:
    """Delete committed ``step`` under ``root``, atomically hiding it first; False
    when it is not there. Its files are removed by ``deleter`` (in the background)
    when given, else now."""
    hidden = deleted_dir(root, str(step))
    try:
        publish(layout.step_dir(root, step), hidden)
    except FileNotFoundError:
        return False
    if deleter is not None:
        deleter.remove(hidden)
    else:
        shutil.rmtree(hidden, ignore_errors=True)
    return True


# Temporary step folders a writer of this process is filling: a sidecar outlives
# its trainer, and may still be writing a killed trainer's last save when the next
# trainer's manager cleans up. Process-wide, as the folders are: any writer of the
# process may be filling one that any cleaner lists.
_writing: set[Path] = set()
_writing_lock = threading.Lock()


def writing(tmp: Path, busy: bool) -> None:
    """Mark ``tmp`` as being written by this process (``busy``), or no longer."""
    with _writing_lock:
        if busy:
            _writing.add(tmp)
        else:
            _writing.discard(tmp)


def clean_uncommitted(root: Path) -> list[str]:
    """Remove mtc's temporary and half-deleted folders; returns their names. A folder
    a writer of this process is still filling is left to it (it commits or removes it)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    with _writing_lock:
        busy = {p.name for p in _writing if p.parent == root}
    removed = [n for n in names
               if (layout.TMP_MARK in n or layout.DEL_MARK in n) and n not in busy]
    for n in removed:
        shutil.rmtree(root / n, ignore_errors=True)
    return removed
