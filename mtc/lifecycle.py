"""Lifecycles: the threads a process part starts and joins, and what a checkpoint
manager holds until ``close()``.

A long-lived process (the replicator) is a list of :class:`Service` s, each started
with one :class:`Threads` group, the only place its threads are started; at shutdown
every service is asked to stop, every thread of the group is joined, and then every
service closes (:class:`Services`). A thread that raises ends the process part loudly:
the group's ``failed`` is set, and :meth:`Threads.join` raises the error.

A process that exits (or drops its manager) without ``close()`` would lose the
saves still being written: the writer's threads die with the interpreter. Each
manager's dispatcher (which holds the directory locks) lives in a :class:`Held`; at interpreter
exit every one not released is finished (its saves committed) with a warning,
and a save that cannot be finished is reported as an error on stderr.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

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


class Threads:
    """One thread group: every thread of its owner is started by :meth:`start` and
    joined by :meth:`join` (raft's ``goFunc`` into one WaitGroup). A thread whose
    target raises is logged, its error kept, and ``failed`` set, so that the owner
    ends rather than going on with a part missing; :meth:`join` raises the first
    error once every thread ended. Finished threads are forgotten as new ones start
    (a group may start many short ones)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failed = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._errors: list[tuple[str, BaseException]] = []
        self._joining = False

    def start(self, target: Callable[..., object], name: str, *args: Any,
              daemon: bool = False) -> threading.Thread:
        """Run ``target(*args)`` on a new thread of this group. Refused (RuntimeError)
        once :meth:`join` began: a thread started then would never be joined.
        ``daemon``: for a group whose owner may never join it (nobody closed it), so
        that its thread does not hold the interpreter at exit."""
        def body() -> None:
            try:
                target(*args)
            except BaseException as e:
                log.exception("%s: thread %s failed", self.name, name)
                with self._lock:
                    self._errors.append((name, e))
                self.failed.set()

        t = threading.Thread(target=body, name=name, daemon=daemon)
        with self._lock:
            if self._joining:
                raise RuntimeError(f"{self.name} is shutting down: {name} not started")
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
            t.start()
        return t

    def alive(self) -> list[str]:
        """The names of the threads still running."""
        with self._lock:
            return [t.name for t in self._threads if t.is_alive()]

    def errors(self) -> list[tuple[str, BaseException]]:
        """The threads that raised, by name, and what."""
        with self._lock:
            return list(self._errors)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the threads started so far (``timeout``: in all; more may start
        meanwhile); whether they all ended."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            threads = [t for t in self._threads if t is not threading.current_thread()]
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def join(self, timeout: float | None = None, *, reraise: bool = True) -> bool:
        """Start nothing more, and wait for every thread (``timeout``: in all);
        whether all ended. ``reraise``: then raise the first thread's error."""
        with self._lock:
            self._joining = True
        done = self.wait(timeout)
        errors = self.errors()
        if reraise and errors:
            raise errors[0][1]
        return done


class Service(Protocol):
    """A part of a long-lived process. ``start`` starts its threads in ``threads``
    (none of its own elsewhere); ``stop`` asks them to end and returns at once;
    ``close``, called once every thread of the group ended, lets go of what it
    holds (pools, sockets, files). ``stop`` and ``close`` may come without a
    ``start`` (another service failed to start) and run once each."""

    def start(self, threads: Threads) -> None: ...

    def stop(self) -> None: ...

    def close(self) -> None: ...


class Services:
    """Services started in order with one thread group (``threads``: one that
    threads started in before, such as a server's, else a new one), stopped and
    closed in the reverse order (what started last depends on what started before
    it)."""

    def __init__(self, name: str, services: Sequence[Service], *,
                 threads: Threads | None = None) -> None:
        self.threads = threads or Threads(name)
        self.services = list(services)
        self._started: list[Service] = []

    def start(self) -> None:
        """Start each service; when one fails, those started are shut down again
        and its error raised."""
        for s in self.services:
            try:
                s.start(self.threads)
            except BaseException:
                self._started.append(s)  # its half-started threads are joined too
                self.shutdown(reraise=False)
                raise
            self._started.append(s)

    def shutdown(self, timeout: float | None = None, *, reraise: bool = True) -> bool:
        """Stop every started service, join the group, close them; whether every
        thread ended within ``timeout``. Raises a thread's error (``reraise``) once
        every service is closed."""
        started, self._started = self._started[::-1], []
        for s in started:
            try:
                s.stop()
            except Exception:  # the others still stop
                log.exception("%s: stopping %r failed", self.threads.name, s)
        done = self.threads.join(timeout, reraise=False)
        for s in started:
            try:
                s.close()
            except Exception:
                log.exception("%s: closing %r failed", self.threads.name, s)
        errors = self.threads.errors()
        if reraise and errors:
            raise errors[0][1]
        return done


# Threads finishing collected managers (see :func:`_collected`); joined at exit.
_finishing = Threads("mtc-finish-unclosed")


def _collected(held: Held) -> None:
    """A manager nobody closed was collected. The collector runs this on whatever
    thread dropped the last reference, which may be one of that manager's own writer
    threads: waiting there for its saves would wait for itself. The saves are
    finished on a thread of their own, joined at interpreter exit."""
    if held.closed:
        return

    _finishing.start(held.release_unclosed, "mtc-finish-unclosed", "garbage collection",
                     daemon=True)


def join_finishing(timeout: float | None = None) -> bool:
    """Wait for collected managers' saves to be finished; whether all were."""
    return _finishing.wait(timeout)


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


class SignalStop:
    """A process's stop, asked by ``stop.set()`` or by a signal (SIGTERM, SIGINT):
    what a main loop waits on, with :class:`threading.Event`'s ``wait``/``set``/
    ``is_set``.

    A signal's handler runs in the main thread between two bytecodes, wherever that
    thread is. One that sets a ``threading.Event`` deadlocks when the signal lands
    while the main thread holds that event's lock, inside its ``wait``: a loop of
    ``Event.wait(0)`` hung on 71 of 100 SIGTERMs, and a replicator (polling every
    50 ms) once ignored SIGTERM for 30 s under load. The handler here only notes
    the signal; :meth:`wait` turns it into the event's ``set``, outside any handler,
    at most ``poll_s`` later."""

    def __init__(self, stop: threading.Event | None = None,
                 signals: Sequence[int] | None = None, *, poll_s: float = 0.1) -> None:
        import signal

        self.event = stop if stop is not None else threading.Event()
        self.poll_s = poll_s
        self.signalled: int | None = None  # the signal's number, once one came
        for s in (signal.SIGTERM, signal.SIGINT) if signals is None else signals:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signum  # an attribute: no lock, nothing that can wait

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        return self._noted() or self.event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the stop was asked, waiting up to ``timeout`` (None: until it is),
        in slices of at most ``poll_s`` so that a signal is seen."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._noted():
                return True
            left = self.poll_s if deadline is None else min(self.poll_s,
                                                            deadline - time.monotonic())
            if self.event.wait(max(0.0, left)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return self._noted()

    def _noted(self) -> bool:
        if self.signalled is None:
            return False
        self.event.set()
        return True
