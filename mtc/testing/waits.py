"""The one wait of mtc's tests and of mtc.testing: poll a condition until it holds.

A test waits on a condition (a counter, a listing, a line in a log), never for a
time: a loaded machine honours no time, and a sleep long enough for it wastes the
rest of the time on a quiet one. :func:`wait_until` asks ``condition`` every
``poll_s`` seconds and returns its first truthy answer; after ``timeout_s`` it
raises :class:`WaitTimeout` naming what never came (and, with ``detail``, what
was there instead: a log's tail, the copies held), so the failure's report says
why without a rerun. The timeout is a bound on a hang, not the rule a test
checks: a test that asserts "within N seconds" measures and asserts that itself.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

POLL_S = 0.05  # a few cheap questions a second: a local RPC, a file's stat, a scrape

T = TypeVar("T")


class WaitTimeout(TimeoutError, AssertionError):
    """A condition a test waited on did not come within its bound. Both a
    TimeoutError (what mtc.testing's waits have raised) and an AssertionError (what
    the tests' own deadline loops raised), so callers of either keep working."""


def wait_until(what: str, condition: Callable[[], T], timeout_s: float = 30.0, *,
               poll_s: float = POLL_S, during: Callable[[], object] | None = None,
               detail: Callable[[], object] | None = None) -> T:
    """Until ``condition()`` is truthy; returns that answer. ``during`` runs after
    each falsy answer (a check that must hold all along: it raises to end the wait);
    ``detail()`` is added to the timeout's message. :class:`WaitTimeout` after
    ``timeout_s`` seconds, ``condition`` asked once more at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = condition()
        if got:
            return got
        if during is not None:
            during()
        if time.monotonic() >= deadline:
            got = condition()  # a condition met while the last poll slept counts
            if got:
                return got
            more = f": {detail()}" if detail is not None else ""
            raise WaitTimeout(f"never within {timeout_s:g}s: {what}{more}")
        time.sleep(poll_s)


def timed_wait(what: str, condition: Callable[[], object], timeout_s: float = 30.0, *,
               poll_s: float = POLL_S, during: Callable[[], object] | None = None,
               detail: Callable[[], object] | None = None) -> float:
    """:func:`wait_until`, returning the seconds it waited (for a test whose rule is
    "within so many seconds")."""
    t0 = time.monotonic()
    wait_until(what, condition, timeout_s, poll_s=poll_s, during=during, detail=detail)
    return time.monotonic() - t0


def wait_exits(procs: Sequence[subprocess.Popen[Any]], timeout_s: float, *,
               grace_s: float, expected: Collection[int] = (),
               failed: list[int] | None = None, poll_s: float = POLL_S) -> list[int]:
    """Until every one of a job's ``procs`` has exited, at most ``timeout_s``; once one
    exits non-zero (but those in ``expected``, killed on purpose) the others get
    ``grace_s`` more (a failed process leaves its peers stuck in a collective).
    ``failed`` gets the processes that exited non-zero, in the order seen. Returns
    the indices of those still running (the caller SIGKILLs them): no error here,
    the caller's report names what each process printed."""
    failed = [] if failed is None else failed
    deadline = time.monotonic() + timeout_s
    while True:
        running = [k for k, p in enumerate(procs) if p.poll() is None]
        for k, p in enumerate(procs):
            if p.returncode not in (None, 0) and k not in expected and k not in failed:
                failed.append(k)
                deadline = min(deadline, time.monotonic() + grace_s)
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(poll_s)
