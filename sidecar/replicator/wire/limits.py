"""What one caller can hold of a replicator: data streams, their life, and health watches.

A push or a fetch occupies a server thread for as long as it lasts, and a caller
decides how long that is (it can send one byte a second). So streams are bounded
in number (all callers together, and per caller), and each must keep up a minimum
rate after a grace period and end by a deadline its size sets; a watchdog thread
cancels the ones that do not. Health ``Watch`` streams occupy no thread (gRPC's
health servicer is non-blocking) but count against the server's concurrent
calls: they are bounded in number and live at most ``watch_s``.

:func:`overdue` is the policy, pure; :class:`Streams` applies it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from grpc_health.v1 import health

from mtc.errors import BusyError
from mtc.lifecycle import Threads
from mtc.sidecar.replicator.wire.security import caller_rank

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Limits:
    max_streams: int = 16        # pushes and fetches at once (each holds a server thread)
    max_per_peer: int = 8        # of those, from one caller
    max_watches: int = 16        # health Watch streams at once
    min_rate: float = 256 << 10  # bytes a second a stream averages once its grace is over
    grace_s: float = 10.0        # a stream's first seconds, before its rate counts
    watch_s: float = 600.0       # a Watch stream's longest life
    sweep_s: float = 0.5         # how often the watchdog looks


def overdue(sent: int, expected: int, elapsed: float, limits: Limits) -> str | None:
    """Why a stream of ``expected`` bytes (0: unknown) that moved ``sent`` in ``elapsed``
    seconds must end now, or None. Its deadline: the grace, plus its bytes at the
    minimum rate; its rate, while bytes are still to come: averaged over its life,
    once the grace is over."""
    if elapsed <= limits.grace_s:
        return None
    if expected and elapsed > limits.grace_s + expected / limits.min_rate:
        return f"past its deadline ({elapsed:.0f}s for {expected} bytes)"
    if expected and sent >= expected:
        return None  # all sent: it is ending (its deadline still holds)
    if sent / elapsed < limits.min_rate:
        return (f"below the minimum rate ({sent / elapsed:.0f} bytes/s, at least "
                f"{limits.min_rate:.0f})")
    return None


class Stream:
    """One open stream: its caller, its progress (the serving thread adds to ``sent``)."""

    def __init__(self, kind: str, peer: str, context: Any, expected: int, now: float) -> None:
        self.kind = kind
        self.peer = peer
        self.context = context
        self.expected = expected
        self.started = now
        self.sent = 0

    def add(self, n: int) -> None:
        self.sent += n


class Streams:
    """The open streams of one server, and the watchdog that ends overdue ones.
    ``_lock`` guards ``_open`` and ``_thread``: the watchdog runs while any stream is
    open (started by the first, in ``threads``: the process's group, else one of
    its own), and :meth:`close` joins it."""

    def __init__(self, limits: Limits = Limits(), *,
                 on_cancel: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 threads: Threads | None = None) -> None:
        self.limits = limits
        self.clock = clock
        self.on_cancel = on_cancel
        self._threads = threads or Threads("mtc-streams")
        self._open: list[Stream] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, kind: str, peer: str, context: Any, expected: int = 0) -> Stream:
        """A place for a stream (:meth:`release` it when it ends); :class:`BusyError`
        when there is none (all taken, or this caller's share)."""
        s = Stream(kind, peer, context, expected, self.clock())
        with self._lock:
            if kind == "watch":
                if sum(1 for x in self._open if x.kind == "watch") >= self.limits.max_watches:
                    raise BusyError(f"{self.limits.max_watches} health watches are open")
            else:
                data = [x for x in self._open if x.kind != "watch"]
                if len(data) >= self.limits.max_streams:
                    raise BusyError(f"{len(data)} data streams are open; try again later")
                if sum(1 for x in data if x.peer == peer) >= self.limits.max_per_peer:
                    raise BusyError(f"{self.limits.max_per_peer} data streams of this caller "
                                    f"are open")
            self._open.append(s)
            if self._thread is None and not self._stop.is_set():
                # Runs while streams are open: an idle server has no watchdog thread.
                # (Refused once the group is shutting down, as stop() is then near.)
                try:
                    self._thread = self._threads.start(self._run, "mtc-stream-watchdog")
                except RuntimeError:
                    pass
        return s

    @contextmanager
    def open(self, kind: str, peer: str, context: Any, expected: int = 0) -> Iterator[Stream]:
        """:meth:`acquire` for the length of the block."""
        s = self.acquire(kind, peer, context, expected)
        try:
            yield s
        finally:
            self.release(s)

    def release(self, s: Stream) -> None:
        with self._lock:
            if s in self._open:
                self._open.remove(s)

    def count(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(1 for s in self._open if kind is None or s.kind == kind)

    def sweep(self) -> list[Stream]:
        """Cancel the streams that must end (their calls fail CANCELLED); returns them."""
        now = self.clock()
        with self._lock:
            streams = list(self._open)
        ended = []
        for s in streams:
            elapsed = now - s.started
            if s.kind == "watch":
                why = (f"open for {elapsed:.0f}s" if elapsed > self.limits.watch_s else None)
            else:
                why = overdue(s.sent, s.expected, elapsed, self.limits)
            if why is None:
                continue
            log.warning("ending a %s stream from %s: %s", s.kind, s.peer, why)
            s.context.cancel()
            self.release(s)
            ended.append(s)
            if self.on_cancel is not None:
                self.on_cancel(s.kind)
        return ended

    def _run(self) -> None:
        while not self._stop.wait(self.limits.sweep_s):
            try:
                self.sweep()
            except Exception:  # never let the watchdog die
                log.exception("stream watchdog")
            with self._lock:
                if not self._open:
                    self._thread = None
                    return

    def stop(self) -> None:
        """The watchdog ends at its next sweep (:meth:`close` joins it)."""
        self._stop.set()

    def close(self) -> None:
        """Stop the watchdog (after the server stopped) and join it."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()


def peer_of(context: Any) -> str:
    """Who calls, for per-caller bounds: the rank its certificate names, else its
    address without the port."""
    rank = caller_rank(context)
    if rank is not None:
        return f"rank {rank}"
    peer = str(context.peer() or "")
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer


class BoundedHealth(health.HealthServicer):
    """gRPC's health servicer (``Watch`` non-blocking: it holds no server thread), with
    its ``Watch`` streams bounded in number and life by ``streams``."""

    def __init__(self, streams: Streams) -> None:
        self._streams = streams
        super().__init__()  # marks this class's Watch non-blocking

    def Watch(self, request: Any, context: Any,
              send_response_callback: Any = None) -> Any:
        try:
            held = self._streams.acquire("watch", peer_of(context), context)
        except BusyError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            raise AssertionError("unreachable") from e
        if not context.add_callback(lambda: self._streams.release(held)):
            self._streams.release(held)  # the call already ended
        return super().Watch(request, context, send_response_callback)


class Gate:
    """Calls that hold a server thread while they wait (a ``Decide`` until its epoch
    forms, a ``PrepareRestore`` until its step's data is local), at most ``per_key``
    at once for one key (an asking rank): beyond, :class:`BusyError` at once, so that
    waiting calls with long timeouts cannot take every thread. ``_lock`` guards
    ``_held``."""

    def __init__(self, per_key: int, what: str) -> None:
        self.per_key = per_key
        self.what = what
        self._held: dict[object, int] = {}
        self._lock = threading.Lock()

    @contextmanager
    def enter(self, key: object) -> Iterator[None]:
        with self._lock:
            if self._held.get(key, 0) >= self.per_key:
                raise BusyError(f"{self.per_key} {self.what} are waiting already")
            self._held[key] = self._held.get(key, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
