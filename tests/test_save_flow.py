"""mtc.save.flow.SaveFlow alone, over a fake dispatcher (tests/fake_dispatch.py: the
hosts as step tables, no process): what a save sends, what it refuses, what a host
failing mid-save leaves, the schedule, and retention."""

from __future__ import annotations

from typing import Any

import pytest
from fake_dispatch import FakeDispatch, topology

from mtc.errors import StepExistsError, StorageError
from mtc.inventory import StepInventory
from mtc.options import Options
from mtc.save.flow import SaveFlow


def flows(n: int = 2, *, foreign: dict[int, list[int]] | None = None,
          **options: Any) -> tuple[FakeDispatch, SaveFlow, StepInventory]:
    topo = topology(n)
    d = FakeDispatch(topo)
    inv = StepInventory(d, topo)
    return d, SaveFlow(d, topo, Options(**options), inv, None, where="the test's hosts",
                       foreign=foreign), inv


def save(flow: SaveFlow, step: int, *, force: bool = False) -> bool:
    return flow.save(step, {"v": step}, force=force, metrics=None, args=None)


def test_a_host_failing_mid_save_raises_its_error_and_commits_nothing_complete() -> None:
    d, flow, inv = flows(3)
    assert save(flow, 1)
    flow.wait_until_finished()
    assert save(flow, 2)
    d.fail[1] = StorageError("the disk went away", step=2, host=1)
    with pytest.raises(StorageError, match="disk went away") as err:
        flow.wait_until_finished()
    assert (err.value.step, err.value.host) == (2, 1)
    # Hosts 0 and 2 committed their share; step 2 is not a checkpoint anywhere.
    assert d.held() == {0: [1, 2], 1: [1], 2: [1, 2]}
    assert inv.common() == [1] and flow.staged == set()
    # Saved again, the partial copies go first (never mixed with the new save's).
    assert save(flow, 2, force=True)
    assert d.ops("delete") == [(2, (0, 2))]
    flow.wait_until_finished()
    assert inv.common() == [1, 2]


@pytest.mark.parametrize(("held", "step", "deleted"), [
    ({0: [4], 1: [4]}, 4, None),  # committed everywhere: refused
    ({0: [4, 5], 1: [4]}, 5, [(5, (0,))]),  # a crash between hosts' commits: replaced
    ({0: [4], 1: [4, 5]}, 5, [(5, (1,))]),
    ({0: [4], 1: [4]}, 5, []),  # a new step: nothing to delete
])
def test_a_step_is_refused_or_its_partial_copies_replaced(
        held: dict[int, list[int]], step: int, deleted: list[Any] | None) -> None:
    d, flow, _ = flows(2)
    for h, steps in held.items():
        for s in steps:
            d.commit(h, s)
    if deleted is None:
        with pytest.raises(StepExistsError, match="already committed"):
            save(flow, step, force=True)
        assert d.ops("stage") == [] and d.ops("delete") == []  # nothing reached a host
        assert d.held() == held
        return
    assert save(flow, step, force=True)
    assert d.ops("delete") == deleted
    assert d.ops("stage") == [(step, (0, 1))]


def test_a_foreign_step_folder_is_never_replaced() -> None:
    d, flow, _ = flows(2, foreign={1: [7]})
    with pytest.raises(StepExistsError, match="not mtc's") as err:
        save(flow, 7, force=True)
    assert err.value.host == 1
    assert d.calls == []


@pytest.mark.parametrize(("complete", "interval", "step", "due"), [
    ([], 5, 3, True),  # the job's first save
    ([10], 5, 10, False),  # not newer than what the hosts hold
    ([10], 5, 9, False),
    ([10], 5, 12, False),  # off the interval
    ([10], 5, 15, True),
    ([10], 1, 11, True),
])
def test_the_schedule(complete: list[int], interval: int, step: int, due: bool) -> None:
    d, flow, _ = flows(2, save_interval_steps=interval)
    for s in complete:
        d.commit(0, s)
        d.commit(1, s)
    assert flow.should_save(step) is due
    assert save(flow, step) is due
    assert d.ops("stage") == ([(step, (0, 1))] if due else [])


def test_a_read_only_manager_saves_nothing() -> None:
    d, flow, _ = flows(2, read_only=True)
    assert not flow.should_save(1)
    assert not save(flow, 1, force=True)
    assert d.calls == []


def test_a_step_some_hosts_hold_does_not_count_as_the_newest() -> None:
    """Host 1 lost step 10 (never complete): 10 is due again, the first decision made
    from the save's own listing of the hosts."""
    d, flow, _ = flows(2, save_interval_steps=5)
    for h, s in ((0, 5), (1, 5), (0, 10)):
        d.commit(h, s)
    assert save(flow, 10)
    assert d.ops("delete") == [(10, (0,))]


@pytest.mark.parametrize(("keep", "period", "left"), [
    (2, None, [4, 5]),
    (1, None, [5]),
    (2, 2, [2, 4, 5]),  # multiples of keep_period stay
    (None, None, [1, 2, 3, 4, 5]),  # Orbax's default: every step
])
def test_retention_keeps_the_newest(keep: int | None, period: int | None,
                                    left: list[int]) -> None:
    d, flow, inv = flows(2, max_to_keep=keep, keep_period=period)
    for s in range(1, 6):
        assert save(flow, s)
        flow.wait_until_finished()
    assert d.held() == {0: left, 1: left}
    assert inv.common() == left


def test_a_step_saved_before_gets_its_time_from_its_manifest_once_one_can_be_read() -> None:
    """keep_time_interval after a restart: a step this manager did not save has the
    time its manifest records, read once; a read that fails now (no host answers)
    leaves it unknown and is made again; a manifest without a time leaves it
    unknown for good (the time-based policies keep such a step)."""
    from mtc.errors import ShardUnavailableError

    _, flow, _ = flows(2)
    asked: list[int] = []
    answers: dict[int, Any] = {3: ShardUnavailableError("no host answers", step=3),
                               4: None}

    def time_of_step(step: int) -> float | None:
        asked.append(step)
        a = answers.get(step, 100.0 * step)
        if isinstance(a, Exception):
            raise a
        return a

    flow.time_of_step = time_of_step
    assert flow._time_of(2) == 200.0 and flow._time_of(2) == 200.0
    assert flow._time_of(3) is None
    answers[3] = 300.0  # the host answers again
    assert flow._time_of(3) == 300.0
    assert flow._time_of(4) is None and flow._time_of(4) is None
    assert asked == [2, 3, 3, 4]
