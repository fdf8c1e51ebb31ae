"""The pure policies, tested alone: the manager's retention (mtc.retention), the
replicator's garbage-collection plan (gc_plan in mtc.sidecar.replicator.gc) and
which older step it copies again to a peer (older_to_restore in
mtc.sidecar.replicator.replication)."""

from __future__ import annotations

import pytest

from mtc.retention import to_delete
from mtc.sidecar.replicator.gc import GcInputs, GcPlan, gc_plan
from mtc.sidecar.replicator.replication import older_to_restore

# (name, complete, held, max_to_keep, keep_period, before_write, deleted)
RETENTION = [
    ("keeps max_to_keep newest", [1, 2, 3, 4], [1, 2, 3, 4], 2, None, False, [1, 2]),
    ("before a write: one fewer", [1, 2, 3, 4], [1, 2, 3, 4], 2, None, True, [1, 2, 3]),
    ("before a write never below one", [3, 4], [3, 4], 1, None, True, [3]),
    ("None keeps everything", [1, 2, 3], [1, 2, 3], None, None, False, []),
    ("nothing complete: nothing goes", [], [1, 2, 3], 1, None, False, []),
    ("fewer complete than kept", [3], [1, 2, 3], 2, None, False, []),
    # A step on some hosts only (a failed or running save) never costs the newest
    # complete one: only steps older than the oldest kept complete step go.
    ("a partial newer step costs nothing", [1, 2], [1, 2, 3], 1, None, False, [1]),
    ("keep_period multiples stay", [10, 20, 25, 30], [10, 20, 25, 30], 1, 20, False, [10, 25]),
    ("held steps the host lacks among complete", [5, 6], [1, 5, 6], 1, None, False, [1, 5]),
]


@pytest.mark.parametrize(("name", "complete", "held", "keep", "period", "before", "want"),
                         RETENTION, ids=[c[0] for c in RETENTION])
def test_retention(name: str, complete: list[int], held: list[int], keep: int | None,
                   period: int | None, before: bool, want: list[int]) -> None:
    assert to_delete(complete, held, max_to_keep=keep, keep_period=period,
                     before_write=before) == want


def gc(own: tuple[int, ...] = (), replicated: tuple[int, ...] = (),
       replicas: dict[int, tuple[int, ...]] | None = None, keep: int = 1,
       busy: frozenset[int] = frozenset(), synced: bool = True,
       linked: frozenset[int] = frozenset(), rank: int = 0) -> GcInputs:
    return GcInputs(own, replicated, replicas or {}, keep, busy, synced, linked, rank)


# (name, inputs, the coordinator's kept steps or None, plan)
GC = [
    ("nothing beyond keep: nothing asked", gc(own=(5,)), None, GcPlan()),
    ("something to delete asks the coordinator first",
     gc(own=(4, 5), replicated=(4, 5)), None, GcPlan(needs_coordinator=True)),
    ("old own steps go", gc(own=(3, 4, 5), replicated=(3, 4, 5)), {5}, GcPlan(own=(3, 4))),
    ("the newest fully replicated step stays",
     gc(own=(3, 4, 5), replicated=(3,)), {5}, GcPlan(own=(4,))),
    ("the complete step stays even when old", gc(own=(3, 4, 5), replicated=(5,)), {3},
     GcPlan(own=(4,))),
    # Another host's step 5 is on that host alone (not replicated yet): 5 is
    # complete, 4 the newest step that survives losing that host.
    ("the newest step on two hosts stays too", gc(own=(3, 4, 5), replicated=(3, 4, 5)),
     {4, 5}, GcPlan(own=(3,))),
    ("busy steps stay", gc(own=(3, 4, 5), replicated=(5,), busy=frozenset({3})), {5},
     GcPlan(own=(4,))),
    ("before every target was read once, no own step goes",
     gc(own=(3, 4, 5), synced=False), {5}, GcPlan()),
    ("copies beyond keep per origin go, not the complete step",
     gc(replicas={1: (2, 3, 4), 2: (3, 4)}), {3}, GcPlan(replicas=((1, 2),))),
    ("nor a peer's copy of the newest step on two hosts",
     gc(replicas={1: (2, 3, 4), 2: (3, 4)}), {2, 4}, GcPlan(replicas=((1, 3), (2, 3)))),
    ("a parked own step a client still links to stays",
     gc(own=(), replicas={0: (1, 2, 3)}, linked=frozenset({1})), {9},
     GcPlan(replicas=((0, 2),))),
    ("keep 2: nothing beyond it", gc(own=(4, 5), keep=2), None, GcPlan()),
    ("keep 2: the newest two, the newest replicated and the complete step stay",
     gc(own=(1, 2, 3, 4, 5), replicated=(1,), keep=2), {2}, GcPlan(own=(3,))),
    ("keep 2: a peer's old copies go, the complete one stays",
     gc(own=(5,), replicas={1: (2, 3, 4, 5)}, keep=2), {2}, GcPlan(replicas=((1, 3),))),
    ("nothing complete anywhere: the local rules alone",
     gc(own=(3, 4, 5), replicated=(5,)), set(), GcPlan(own=(3, 4))),
]


@pytest.mark.parametrize(("name", "inputs", "kept", "want"), GC, ids=[c[0] for c in GC])
def test_gc_plan(name: str, inputs: GcInputs, kept: set[int] | None, want: GcPlan) -> None:
    assert gc_plan(inputs, kept) == want


# (name, own steps oldest first, keep, steps the target holds, step to push again)
OLDER = [
    ("the target holds every kept step", [3, 4], 2, {3, 4}, None),
    ("a kept older copy lost: pushed again", [3, 4], 2, {4}, 3),
    ("newest first", [2, 3, 4], 3, {4}, 3),
    ("then the next", [2, 3, 4], 3, {3, 4}, 2),
    ("never a step beyond keep (the target deletes it)", [1, 2, 3, 4], 2, {4}, 3),
    ("nothing older beyond keep", [1, 2, 3, 4], 2, {3, 4}, None),
    ("keep 1: only the newest, which is not this policy's", [3, 4], 1, {4}, None),
    ("one own step", [4], 2, {4}, None),
]


@pytest.mark.parametrize(("name", "own", "keep", "held", "want"), OLDER,
                         ids=[c[0] for c in OLDER])
def test_older_to_restore(name: str, own: list[int], keep: int, held: set[int],
                          want: int | None) -> None:
    assert older_to_restore(own, keep, held) == want
