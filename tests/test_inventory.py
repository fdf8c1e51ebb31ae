"""mtc.inventory.StepInventory alone, over a fake dispatcher (tests/fake_dispatch.py:
the hosts as step tables, no process): which steps are complete, what a survey's
facts replace, which copies a restore fences off, and a job with nothing to
restore."""

from __future__ import annotations

import pytest
from fake_dispatch import FakeDispatch, topology

from mtc.dispatch.protocol import Survey
from mtc.errors import DataLossError
from mtc.inventory import StepInventory

# Per host, its steps and the run that wrote each (a third element: how many hosts
# saved the step, when not the job's three).
Copies = dict[int, list[tuple[int, str] | tuple[int, str, int]]]


def step_tables(copies: Copies, n: int = 3) -> tuple[FakeDispatch, StepInventory]:
    """The hosts as step tables (a fake dispatcher, no process) and an inventory over them."""
    topo = topology(n)
    d = FakeDispatch(topo)
    for h, held in copies.items():
        for step, run, *saved in held:
            d.commit(h, step, run=run, num_hosts=saved[0] if saved else None)
    return d, StepInventory(d, topo)


@pytest.mark.parametrize(("copies", "complete"), [
    ({}, []),
    ({0: [(1, "a")], 1: [(1, "a")], 2: [(1, "a")]}, [1]),
    ({0: [(1, "a")], 1: [(1, "a")]}, []),  # host 2 does not hold it
    ({0: [(1, "a")], 1: [(1, "a")], 2: [(1, "b")]}, []),  # two runs' bytes: never a step
    # saved by a job of one host (host 0 alone), restored by a larger one: complete
    ({0: [(1, "a", 1)]}, [1]),
    ({0: [(1, "a", 2)]}, []),  # saved by two hosts, host 1's copy gone
    ({0: [(1, "a"), (2, "a"), (3, "a")], 1: [(2, "a"), (3, "a")],
      2: [(1, "a"), (2, "a"), (3, "b")]}, [2]),
])
def test_complete_steps(copies: Copies, complete: list[int]) -> None:
    _, inv = step_tables(copies)
    assert inv.common() == complete


def test_an_unreadable_manifest_never_offers_its_step() -> None:
    d, inv = step_tables({h: [(1, "a"), (2, "a")] for h in range(3)})
    d.unreadable.add((2, 1))
    assert inv.common() == [1]


def test_a_surveys_facts_replace_what_was_kept() -> None:
    """A step deleted and saved again behind this manager may be another run's: the
    hosts' newer answer wins over what this manager saved."""
    d, inv = step_tables({h: [(1, "a")] for h in range(3)})
    inv.saved(1, "a", [0, 1, 2])
    assert inv.run_of(1, [0, 1, 2]) == "a"
    inv.learn(Survey(None, d.held(), {(1, 2): (3, "b")}))
    assert inv.run_of(1, [0, 1, 2]) is None
    assert inv.runs_of(1, [0, 1, 2]) == {0: "a", 1: "a", 2: "b"}


def test_what_this_manager_saved_needs_no_manifest() -> None:
    d, inv = step_tables({})
    for h in range(3):
        d.commit(h, 4, run="a")
    inv.saved(4, "a", [0, 1, 2])
    assert inv.complete_here({h: [4] for h in range(3)}) == [4]
    assert d.ops("manifest") == []
    inv.forget(4)
    assert inv.complete_here({h: [4] for h in range(3)}) == [4]
    assert d.ops("manifest")  # forgotten: read again


@pytest.mark.parametrize(("copies", "restored", "fenced"), [
    # newer and incomplete, an earlier run's: deleted where it is
    ({0: [(5, "a"), (6, "a")], 1: [(5, "a")], 2: [(5, "a")]}, 5, [(6, (0,))]),
    # newer and complete: stays, whichever step was restored
    ({h: [(5, "a"), (6, "a")] for h in range(3)}, 5, []),
    # this run's own incomplete copies stay (its next save replaces them)
    ({0: [(5, "a"), (6, "now")], 1: [(5, "a")], 2: [(5, "a")]}, 5, []),
    # not newer: left to retention
    ({0: [(4, "a"), (5, "a")], 1: [(5, "a")], 2: [(5, "a")]}, 5, []),
    # a mixed step (two runs) is incomplete: the other run's copies go
    ({0: [(5, "a"), (6, "a")], 1: [(5, "a"), (6, "now")], 2: [(5, "a"), (6, "a")]}, 5,
     [(6, (0, 2))]),
])
def test_fence_after_a_restore(copies: Copies, restored: int,
                               fenced: list[tuple[int, tuple[int, ...]]]) -> None:
    d, inv = step_tables(copies)
    inv.fence_after(restored, "now")
    assert d.ops("delete") == fenced


def test_fencing_keeps_a_copy_whose_manifest_does_not_read() -> None:
    d, inv = step_tables({0: [(5, "a"), (6, "a")], 1: [(5, "a"), (6, "a")], 2: [(5, "a")]})
    d.unreadable.add((6, 1))
    inv.fence_after(5, "now")
    assert d.ops("delete") == [(6, (0,))]  # host 1's copy: unsure, never deleted


def test_nothing_restorable() -> None:
    _, inv = step_tables({})
    inv.nothing_restorable(start_over=False, read_only=False)  # a new job: fine
    d, inv = step_tables({0: [(3, "a")], 1: [(3, "a"), (4, "a")]})
    with pytest.raises(DataLossError, match=r"host 0 holds steps \[3\]; host 1 holds steps "
                                            r"\[3, 4\]"):
        inv.nothing_restorable(start_over=False, read_only=False)
    assert d.ops("delete") == []
    inv.nothing_restorable(start_over=True, read_only=False)
    assert d.ops("delete") == [(3, (0, 1)), (4, (1,))]
    assert d.held() == {0: [], 1: [], 2: []}
