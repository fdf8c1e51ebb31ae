"""A value computed fresh for whoever asks, shared by those asking at once
(:class:`Fresh`: the coordinator's complete-step view for garbage collection)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from mtc.errors import AgreementError

T = TypeVar("T")


class Fresh(Generic[T]):
    """A value (the newest complete step) computed by a run of ``compute`` that began
    after the caller asked: never older than the question, and every caller waiting
    at once shares the next run, so N askers cost about two runs, not N; and runs
    start at most every ``min_interval_s``, which bounds their cost whatever N is."""

    def __init__(self, compute: Callable[[], T], *, min_interval_s: float = 0.0) -> None:
        self._compute = compute
        self._min_interval_s = min_interval_s  # runs start at most this often
        self._last_start = -1e18
        self._cond = threading.Condition()
        self._started = 0
        self._done = 0
        self._running = False
        self._value: T | None = None
        self._error: BaseException | None = None

    def get(self, timeout_s: float) -> T:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            need = self._started + 1
            while self._done < need:
                if not self._running:
                    self._running = True
                    wait_s = self._last_start + self._min_interval_s - time.monotonic()
                    if wait_s > 0:
                        # Askers arriving meanwhile still count toward this run: it
                        # has not started (``_started`` moves when it does).
                        self._cond.release()
                        try:
                            time.sleep(wait_s)
                        finally:
                            self._cond.acquire()
                    self._started += 1
                    gen = self._started
                    self._last_start = time.monotonic()
                    self._cond.release()
                    try:
                        value, error = self._compute(), None
                    except Exception as e:  # noqa: BLE001 - handed to every waiter
                        value, error = None, e
                    finally:
                        self._cond.acquire()
                    self._value, self._error = value, error
                    self._done, self._running = gen, False
                    self._cond.notify_all()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AgreementError(f"no fresh view within {timeout_s:.1f}s")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error
            return self._value  # type: ignore[return-value]
