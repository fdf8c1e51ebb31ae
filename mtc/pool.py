"""A thread pool whose threads all start with it; a thread's priority and name.

``concurrent.futures.ThreadPoolExecutor`` starts its threads as work arrives.
From Python 3.12 the interpreter refuses new threads once it is exiting, so a
save still being written at exit (finished by :mod:`mtc.lifecycle`) could not
get the writer threads it needed, and was lost. This pool's threads exist from
the start: work submitted during interpreter exit runs like any other.

A pool is a lifecycle primitive of its own: its threads are started through a
:class:`~mtc.lifecycle.Threads` group it owns, and :meth:`ThreadPool.shutdown`
joins them (raising a thread's own error, such as its initializer's, as
:meth:`~mtc.lifecycle.Threads.join` does). Whoever creates a pool shuts it down.
Its threads are daemons: an unclosed pool never holds up exit.

Every pool of library code is one of these (``tests/test_lifecycle.py`` forbids
``ThreadPoolExecutor`` elsewhere). ``lazy``: a thread is started when work finds
none idle, up to ``threads`` (as ``ThreadPoolExecutor`` does): for pools sized for
the worst case that rarely comes (a server's workers, a fan-out to every peer),
whose threads would otherwise all exist from the start.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

from mtc.lifecycle import Threads

P = ParamSpec("P")
T = TypeVar("T")

_STOP = object()


class ThreadPool(Executor):
    """``threads`` worker threads, started now (``lazy``: as work needs them);
    ``initializer`` runs in each first. :meth:`shutdown` (``wait``, the default)
    joins them; its creator calls it."""

    def __init__(self, threads: int, name: str,
                 initializer: Callable[[], None] | None = None, *, lazy: bool = False) -> None:
        if threads < 1:
            raise ValueError(f"a pool needs at least one thread, got {threads}")
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()
        self._initializer = initializer
        self._size = threads
        self._name = name
        self._started = 0
        # Released by a thread each time it finishes a task (lazy pools): work that
        # can take one does not start another thread.
        self._idle = threading.Semaphore(0)
        self._lazy = lazy
        self._threads = Threads(name)
        if not lazy:
            for _ in range(threads):
                self._start_one()

    def _start_one(self) -> None:
        i = self._started
        self._started += 1
        # A daemon: a pool nobody shut down must not hold the interpreter at exit
        # (a manager's is finished and shut down by mtc.lifecycle's exit hook).
        self._threads.start(self._run, f"{self._name}_{i}", daemon=True)

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("submit() on a pool that was shut down")
            self._work.put((fut, fn, args, kwargs))
            if self._lazy and not self._idle.acquire(blocking=False) and \
                    self._started < self._size:
                self._start_one()
        return fut

    def queued(self) -> int:
        """Tasks submitted and not yet taken by a thread (approximate: for pacing)."""
        return self._work.qsize()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    item[0].cancel()
            for _ in range(self._started):
                self._work.put(_STOP)
        if wait:
            # Not the calling thread when it is one of the pool's (Threads.wait skips it).
            self._threads.join()

    def _run(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            item = self._work.get()
            if item is _STOP:
                return
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                fut.set_exception(e)
            else:
                fut.set_result(result)
                # Not kept until the next task's result replaces it: a restore's
                # result maps a reply file, whose unmapping would land, holding the
                # GIL, in whatever call this thread runs next (a save's stall).
                del result
            # An idle thread holds nothing of its last task (a buffer it wrote is
            # reused once the last reference to it goes).
            del item, fut, fn, args, kwargs
            if self._lazy:
                self._idle.release()


def lower_thread_priority(by: int = 10) -> None:
    """The calling thread yields the CPU to the training loop and to the requests
    it waits on (Linux: a thread's own nice value, raised by ``by`` over what it
    has, so it holds under a process started with ``nice`` too). Background work
    (host-side writes, deletions) runs at full speed when nothing else wants the CPU."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (OSError, AttributeError):
        pass


def name_native_thread(name: str) -> None:
    """Give the calling thread ``name`` where the OS shows threads (Linux: its
    ``comm``, 15 bytes, as ``top -H`` and ``/proc/<pid>/task/<tid>/comm`` show it):
    Python's thread names stay inside Python, and an operator or a benchmark that
    places or watches threads needs to tell them apart from outside."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_name = 15
        libc.prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass
