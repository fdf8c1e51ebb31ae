"""Restore agreement state: epochs (restore rounds) and the proposals received."""

from __future__ import annotations

import threading


class Agreement:
    """Restore rounds ("epochs") and the proposals this node has, by rank.

    Each restore (a job start) is a new epoch. A node keeps answering with the
    proposals of the epoch it decided, for slower nodes of that round, so a
    proposal counts only in its own epoch: a quick restart must never decide on
    the proposals of the previous one. A node starting a round joins the epoch a
    peer is active in, else starts the one after the newest any node finished; a
    restarted replicator (it remembers no epoch) learns it from its peers.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.active = False
        self._props: dict[int, tuple[int, int]] = {}  # rank -> (epoch, step)
        self._lock = threading.Lock()

    def begin(self, peers: list[tuple[int, bool]]) -> int:
        """Enter a round, given the (epoch, active) answers of the peers reached."""
        with self._lock:
            epoch = self.epoch + 1
            for e, active in peers:
                epoch = max(epoch, e if active else e + 1)
            self.epoch, self.active = epoch, True
            return epoch

    def join(self, epoch: int) -> None:
        """A peer is active in a newer epoch than ours: ours is stale, move to it."""
        with self._lock:
            if epoch > self.epoch:
                self.epoch = epoch

    def decided(self) -> None:
        with self._lock:
            self.active = False

    def state(self) -> tuple[int, bool]:
        with self._lock:
            return self.epoch, self.active

    def record(self, rank: int, epoch: int, step: int) -> None:
        with self._lock:
            if epoch > 0 and epoch >= self._props.get(rank, (0, 0))[0]:
                self._props[rank] = (epoch, step)

    def proposals(self) -> dict[int, tuple[int, int]]:
        """rank -> (epoch, step), the newest proposal of each rank."""
        with self._lock:
            return dict(self._props)

    def current(self) -> dict[int, int]:
        """rank -> step, the proposals of this node's epoch."""
        with self._lock:
            return {r: s for r, (e, s) in self._props.items() if e == self.epoch}
