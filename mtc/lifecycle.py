"""What a checkpoint manager holds until ``close()``, and finishing it when nobody did.

A process that exits (or drops its manager) without ``close()`` would lose the
saves still being written: the writer's threads die with the interpreter. Each
manager's dispatcher (which holds the directory locks) lives in a :class:`Held`; at interpreter
exit every one not released is finished (its saves committed) with a warning,
and a save that cannot be finished is reported as an error on stderr.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

log = logging.getLogger(__name__)

_unreleased: weakref.WeakSet[Held] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hook_installed = False


class Held:
    """A manager's dispatcher; ``release`` (closing it, which lets go of the writer
    locks) is idempotent."""

    def __init__(self, dispatch: Any, where: str) -> None:
        self.dispatch = dispatch
        self.where = where
        self.closed = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            self.dispatch.close()
        finally:
            _unreleased.discard(self)

    def release_unclosed(self, why: str) -> None:
        """Finish the saves of a manager nobody closed, loudly."""
        if self.closed:
            return
        log.warning("mtc: the CheckpointManager of %s was not closed (%s): finishing its "
                    "saves now; call close() or use it as a context manager", self.where, why)
        try:
            self.dispatch.wait()
        except BaseException as e:  # noqa: BLE001 - reported, then the rest is released
            log.error("mtc: a save of %s was lost at %s: %s", self.where, why, e)
        try:
            self.release()
        except BaseException as e:  # noqa: BLE001
            log.error("mtc: closing the CheckpointManager of %s failed: %s", self.where, e)


# Threads finishing collected managers (see :func:`_collected`); joined at exit.
_finishing: set[threading.Thread] = set()
_finishing_lock = threading.Lock()


def _collected(held: Held) -> None:
    """A manager nobody closed was collected. The collector runs this on whatever
    thread dropped the last reference, which may be one of that manager's own writer
    threads: waiting there for its saves would wait for itself. The saves are
    finished on a thread of their own, joined at interpreter exit."""
    if held.closed:
        return

    def finish() -> None:
        try:
            held.release_unclosed("garbage collection")
        finally:
            with _finishing_lock:
                _finishing.discard(threading.current_thread())

    t = threading.Thread(target=finish, name="mtc-finish-unclosed", daemon=True)
    with _finishing_lock:
        _finishing.add(t)
    t.start()


def join_finishing(timeout: float | None = None) -> bool:
    """Wait for collected managers' saves to be finished; whether all were."""
    with _finishing_lock:
        threads = list(_finishing)
    for t in threads:
        t.join(timeout)
    return not any(t.is_alive() for t in threads)


def _at_exit() -> None:
    join_finishing()
    for held in list(_unreleased):
        held.release_unclosed("interpreter exit")


def _install_hook() -> None:
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        _hook_installed = True
    try:
        # Runs before concurrent.futures' own exit hook (these run in reverse order
        # of registration, and concurrent.futures registered when it was imported),
        # so the writer's thread pool still accepts the files of a save in flight.
        # atexit handlers run only after that pool is shut down: too late.
        threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        import atexit

        atexit.register(_at_exit)


def track(owner: object, held: Held) -> None:
    """Finish ``held`` at exit, or when ``owner`` is collected, unless released first."""
    _install_hook()
    _unreleased.add(held)
    finalizer = weakref.finalize(owner, _collected, held)
    finalizer.atexit = False  # exit is the hook's: it runs while threads still work
