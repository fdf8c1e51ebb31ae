"""mtc.restore.flow.RestoreFlow alone (without replicators), over a fake dispatcher
(tests/fake_dispatch.py: the hosts as step tables, no process): which step a
restore picks, what it refuses, and what it deletes after."""

from __future__ import annotations

from typing import Any

import pytest
from fake_dispatch import FakeDispatch, topology

from mtc.errors import DataLossError, MixedRunError, StepNotFoundError
from mtc.inventory import StepInventory
from mtc.options import Options
from mtc.restore.flow import RestoreFlow
from mtc.restore.step import StepReader
from mtc.save.flow import SaveFlow

# Per host, its steps and the run that wrote each.
Copies = dict[int, list[tuple[int, str]]]


def job(copies: Copies, n: int = 2, **options: Any) -> tuple[FakeDispatch, RestoreFlow]:
    topo = topology(n)
    d = FakeDispatch(topo)
    for h, held in copies.items():
        for step, run in held:
            d.commit(h, step, run=run)
    opts = Options(**options)
    inv = StepInventory(d, topo)
    saves = SaveFlow(d, topo, opts, inv, None, where="the test's hosts")
    reader = StepReader(d, topo, "the test's hosts", inv.saved_hosts)
    return d, RestoreFlow(d, topo, opts, inv, reader, saves, where="the test's hosts")


def restore(flow: RestoreFlow, step: int | None = None) -> Any:
    return flow.restore(step, None, None)


@pytest.mark.parametrize(("copies", "newest"), [
    ({0: [(1, "a"), (2, "a"), (3, "a")], 1: [(1, "a"), (2, "a")]}, 2),  # 3: host 0's only
    ({0: [(1, "a"), (2, "a")], 1: [(1, "a"), (2, "b")]}, 1),  # 2: two runs' bytes
    ({0: [(1, "a"), (4, "b")], 1: [(1, "a"), (4, "b")]}, 4),  # another run's, whole
    ({0: [(7, "a")], 1: [(7, "a"), (9, "a")]}, 7),
])
def test_the_newest_step_every_host_holds_is_restored(copies: Copies, newest: int) -> None:
    _, flow = job(copies)
    assert flow.steps()[-1] == newest
    assert flow.latest_step() == newest
    assert restore(flow) == {"v": newest}
    assert flow.last_restore_tiers == {0: "local", 1: "local"}
    assert flow.last_restore_tier == "local"


def test_after_a_restore_newer_incomplete_steps_go_and_complete_ones_stay() -> None:
    d, flow = job({0: [(1, "a"), (2, "a"), (3, "a")], 1: [(1, "a"), (2, "a")]})
    assert restore(flow, 1) == {"v": 1}  # an older step, on purpose
    # Step 2 is complete: never deleted by a restore. Step 3 never finished: fenced.
    assert d.ops("delete") == [(3, (0,))]
    assert d.held() == {0: [1, 2], 1: [1, 2]}


def test_a_step_of_two_runs_is_never_restored() -> None:
    d, flow = job({0: [(1, "a"), (2, "a")], 1: [(1, "a"), (2, "b")]})
    with pytest.raises(MixedRunError, match="different runs"):
        restore(flow, 2)
    assert d.ops("delete") == []


def test_a_step_a_host_lacks_is_not_found_naming_it() -> None:
    _, flow = job({0: [(1, "a"), (2, "a")], 1: [(1, "a")]})
    with pytest.raises(StepNotFoundError) as err:
        restore(flow, 2)
    assert (err.value.step, err.value.host) == (2, 1)


def test_a_new_job_has_nothing_to_restore() -> None:
    _, flow = job({})
    assert flow.latest_step() is None
    with pytest.raises(StepNotFoundError, match="no step is committed on every host"):
        restore(flow)


def test_hosts_holding_only_incomplete_steps_lost_data() -> None:
    d, flow = job({0: [(3, "a")], 1: [(4, "a")]})
    with pytest.raises(DataLossError, match="no step can be restored"):
        flow.latest_step()
    with pytest.raises(DataLossError):
        restore(flow)
    assert d.held() == {0: [3], 1: [4]}  # raise: nothing deleted


def test_start_over_deletes_the_unrestorable_steps() -> None:
    d, flow = job({0: [(3, "a")], 1: [(4, "a")]}, if_data_lost="start_over")
    assert flow.latest_step() is None
    assert d.held() == {0: [], 1: []}


def test_a_staged_step_is_listed_before_it_commits_and_restored_after() -> None:
    d, flow = job({0: [(1, "a"), (3, "a")], 1: [(1, "a"), (3, "a")]})
    assert flow.saves.save(5, {"v": 5}, force=False, metrics=None, args=None)
    assert d.held() == {0: [1, 3], 1: [1, 3]}  # still being written
    assert flow.steps() == [1, 3, 5]  # listed once save returned, as Orbax's
    assert restore(flow) == {"v": 5}  # the restore waited for its commit
    # A staged step older than the newest complete one is listed only once the
    # hosts hold it.
    assert flow.saves.save(2, {"v": 2}, force=True, metrics=None, args=None)
    assert flow.steps() == [1, 3, 5]
    flow.saves.wait_until_finished()
    assert flow.steps() == [1, 2, 3, 5]
