"""mtc/elastic/pace.py: how often a snapshot asked for every step is taken."""

from __future__ import annotations

import pytest

from mtc.elastic.pace import Pacer

# The first snapshot (the warm-up: it compiles the copy) is not charged.
WARM = [(9.0, True), (1.0, False)]


@pytest.mark.parametrize(("intervals", "budget", "due"), [
    # (interval, busy) in order; whether a snapshot is due after them.
    ([], 0.05, True),  # nothing taken yet: always (the first)
    ([(9.0, True)], 0.05, False),  # taken, no quiet interval yet to value it
    (WARM, 0.05, True),  # the warm-up is not charged
    ([*WARM, (2.0, True), (1.0, False)], 0.05, False),  # cost 1 s of 3 s: over 5%
    ([*WARM, (2.0, True)] + [(1.0, False)] * 17, 0.05, False),  # 1 s of 19 s
    ([*WARM, (2.0, True)] + [(1.0, False)] * 18, 0.05, True),  # 1 s of 20 s
    ([*WARM, (1.0, True), (1.0, False)], 0.05, True),  # cost nothing: at once
    ([*WARM, (1.05, True), (1.0, False)], 0.05, True),
    ([*WARM, (2.0, True), (1.0, False)], 1.0, True),  # the loop's whole time: no pacing
    ([(1.0, True), (1.0, False)], 0.0, False),  # no budget: only the first
])
def test_due_within_the_budget_of_the_loops_time(
        intervals: list[tuple[float, bool]], budget: float, due: bool) -> None:
    p = Pacer(budget)
    for interval, busy in intervals:
        p.observe(interval, busy)
    assert p.due(taken_before=bool(intervals)) is due


def test_a_long_quiet_spell_buys_no_burst() -> None:
    p = Pacer(0.05)
    for interval, busy in WARM:
        p.observe(interval, busy)
    p.observe(3.0, True)  # a snapshot that cost 2 s
    for _ in range(1000):
        p.observe(1.0, False)
    assert p.last_cost_s == pytest.approx(2.0)
    assert p.due(True)
    p.observe(3.0, True)  # another: spends the capped credit
    p.observe(1.0, False)
    assert not p.due(True)


def test_costs_seen_before_any_quiet_interval_are_valued_once_one_is() -> None:
    p = Pacer(0.05)
    p.observe(5.0, True)
    p.observe(5.0, True)
    assert p.cost_s == 0.0 and p.quiet_s is None
    p.observe(1.0, False)
    # Valued at 8 s, and not charged: the first snapshot is the warm-up.
    assert p.last_cost_s == pytest.approx(8.0) and p.cost_s == 0.0 and p.finished == 1
    p.observe(3.0, True)
    p.observe(1.0, False)
    assert p.cost_s == pytest.approx(2.0) and p.finished == 2


def test_a_snapshot_that_cost_nothing_still_counts_as_one() -> None:
    p = Pacer(0.05)
    for interval, busy in [(1.0, False), (1.0, True), (1.0, False), (3.0, True), (1.0, False)]:
        p.observe(interval, busy)
    assert p.finished == 2 and p.cost_s == pytest.approx(2.0)
