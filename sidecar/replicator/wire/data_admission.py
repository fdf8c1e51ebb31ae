"""Who may hold a data channel connection before it has authenticated.

A connection the data channel (:mod:`.datachannel`) accepted is *pending* until its
whole request (TLS handshake, header, request) has come and authenticated. A pending
connection holds a thread but no worker, and only so long: its request must be
complete within ``REQUEST_S`` of the accept, however slowly it drips in (the first
probe found a 10 s timeout per read, so a byte every 4 s held a worker for ever).
Pending connections are bounded per source address and in all; a new one makes
room by ending the oldest (:func:`make_room`): a caller sends its whole request at
once, in milliseconds, so it is hardly ever the oldest, and a flood must keep
connecting to keep it out, not merely hold connections open.

:func:`make_room` is the policy, pure; :class:`Pending` applies it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping

# A caller sends its request all at once; one that drips it holds a place no longer.
REQUEST_S = 5.0
PENDING_PER_SOURCE = 16  # unauthenticated connections of one address at once
PENDING = 64             # of all addresses
WAIT_S = 0.25            # a pending connection's longest wait before it looks at its time


def make_room(pending: Mapping[str, int], source: str, *,
              per_source: int = PENDING_PER_SOURCE, total: int = PENDING) -> str | None:
    """The source whose oldest pending connection is ended to make room for a new
    one from ``source``, given those pending per source; None: there is room.
    ``source``'s own when it has its share, else, when every place is taken, the
    source holding most."""
    if pending.get(source, 0) >= per_source:
        return source
    if pending and sum(pending.values()) >= total:
        return max(pending, key=lambda s: pending[s])
    return None


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Pending:
    """The pending connections of one listener: each one's source and the time its
    request must be complete by. Thread-safe. A connection leaves by
    :meth:`authenticated`, or is ended (shut down: its thread's next wait fails)
    to make room or when its time is over."""

    def __init__(self, *, request_s: float | None = None,
                 per_source: int = PENDING_PER_SOURCE, total: int = PENDING,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.request_s = REQUEST_S if request_s is None else request_s
        self.per_source, self.total = per_source, total
        self.clock = clock
        self._lock = threading.Lock()
        # Dicts keep their order of insertion: the first of a source is its oldest.
        self._open: dict[socket.socket, tuple[str, float]] = {}
        self.evicted = 0  # ended to make room
        self.expired = 0  # ended when their time was over

    def add(self, sock: socket.socket, source: str) -> None:
        """A connection just accepted; the oldest one of :func:`make_room`'s choice
        is ended to make room for it."""
        with self._lock:
            counts: dict[str, int] = {}
            for src, _ in self._open.values():
                counts[src] = counts.get(src, 0) + 1
            full = make_room(counts, source, per_source=self.per_source, total=self.total)
            oldest = (next((s for s, (src, _) in self._open.items() if src == full), None)
                      if full is not None else None)
            if oldest is not None:
                del self._open[oldest]
                self.evicted += 1
            self._open[sock] = (source, self.clock() + self.request_s)
        if oldest is not None:
            _shutdown(oldest)

    def expire(self) -> None:
        """End the connections whose time is over (a thread not yet started, or one
        blocked where it cannot look: :meth:`waiter` covers the others)."""
        now = self.clock()
        with self._lock:
            late = [s for s, (_, end) in self._open.items() if end <= now]
            for s in late:
                del self._open[s]
            self.expired += len(late)
        for s in late:
            _shutdown(s)

    def authenticated(self, sock: socket.socket) -> bool:
        """Leave the pending connections; False when it was ended meanwhile."""
        with self._lock:
            return self._open.pop(sock, None) is not None

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.pop(sock, None)

    def waiter(self, sock: socket.socket) -> Callable[[], float]:
        """For the thread reading ``sock``'s request: before each wait, how long it
        may wait (at most ``WAIT_S``); TimeoutError once its time is over or it was
        ended. Short waits, each after a look: a shut down socket may still be
        handed the bytes that come after it (Linux), so a drip would go on."""
        with self._lock:
            end = self._open.get(sock, ("", 0.0))[1]

        def wait() -> float:
            left = end - self.clock()
            with self._lock:
                pending = sock in self._open
                if pending and left <= 0:
                    del self._open[sock]
                    self.expired += 1
            if left <= 0 or not pending:
                raise TimeoutError("the request's time is over")
            return min(left, WAIT_S)
        return wait
