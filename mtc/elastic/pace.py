"""How often a snapshot asked for every step is taken: as often as the loop can
bear, within a share of its time (the budget, 5% by default).

A snapshot from an accelerator costs the loop what it holds the steps for (the
part of the state whose transfer the next donating step waits on, the host
memory it allocates and frees). Nothing reports that cost directly, so the
pacer reads it off the loop: the time between two asks while a snapshot is in
flight, over the time between two asks while none is (the quiet interval). A
snapshot is due while the cost so far is within the budget of the loop's time so
far; unspent credit is capped at one snapshot's cost, so that a long quiet spell
does not buy a burst of back-to-back snapshots.

:class:`Pacer` is the policy alone (times in, a decision out), tested with a
table; :class:`mtc.elastic.Snapshotter` feeds it.
"""

from __future__ import annotations

import dataclasses

DEFAULT_BUDGET = 0.05
# How much one new quiet interval moves the estimate of a quiet interval.
QUIET_WEIGHT = 0.2


@dataclasses.dataclass
class Pacer:
    """The loop's time and the snapshots' cost, as observed; see the module."""

    budget: float = DEFAULT_BUDGET
    loop_s: float = 0.0  # the loop's time between asks, all of it
    cost_s: float = 0.0  # the part of it snapshots cost
    quiet_s: float | None = None  # a typical interval with no snapshot in flight
    last_cost_s: float = 0.0  # what the newest finished snapshot cost
    _unvalued: list[float] = dataclasses.field(default_factory=list)
    _current: float = 0.0  # the cost of the snapshot in flight so far
    finished: int = 0  # snapshots whose cost has been valued (the first is not charged)
    _open: bool = False  # a snapshot's cost is being counted

    def observe(self, interval: float, busy: bool) -> None:
        """One interval between two asks; ``busy``: a snapshot was in flight at its
        start (taken at that ask, or still on its way)."""
        interval = max(0.0, interval)
        self.loop_s += interval
        if busy:
            self._open = True
            if self.quiet_s is None:
                self._unvalued.append(interval)  # valued once a quiet one is seen
            else:
                self._charge(interval - self.quiet_s)
            return
        self.quiet_s = interval if self.quiet_s is None else (
            (1 - QUIET_WEIGHT) * self.quiet_s + QUIET_WEIGHT * interval)
        for x in self._unvalued:
            self._charge(x - self.quiet_s)
        self._unvalued.clear()
        if self._open:
            self._finish()
        # No credit is saved up: after a quiet spell the next snapshot is due at
        # once, and the one after it once the loop has paid for it.
        if 0 < self.budget < 1 and self.budget * self.loop_s > self.cost_s:
            self.loop_s = self.cost_s / self.budget

    def _finish(self) -> None:
        """The snapshot in flight is done: its cost is known."""
        self.last_cost_s, self._current, self._open = self._current, 0.0, False
        self.finished += 1
        if self.finished == 1:  # the warm-up: compiled and first touched, not charged
            self.cost_s -= self.last_cost_s

    def _charge(self, extra: float) -> None:
        extra = max(0.0, extra)
        self.cost_s += extra
        self._current += extra

    def due(self, taken_before: bool) -> bool:
        """Whether to take a snapshot now. The first is always taken; after it, one
        quiet interval must have been seen (to value what it cost) before the next."""
        if not taken_before or self.budget >= 1:  # 1: the loop's whole time, no pacing
            return True
        if self.quiet_s is None or self.budget <= 0:
            return False
        return self.cost_s <= self.budget * self.loop_s
