"""The replicator's fence (``sidecar/replicator/store/fence.py``), tabled, and where
its rule differs from the controller's (:mod:`mtc.fencing`).

After a restore of S is agreed, a replicator deletes every copy it holds of a step
newer than S; a copy of such a step on its way is refused at its commit. The
controller's rule keeps a newer step every host committed, and copies whose run
it cannot read: ``docs/agreement.md`` argues why each rule is the safe one where
it runs, and the last tests here pin the cases where they differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from replicators import commit_mtc_step

from mtc import fencing as controller
from mtc.sidecar.replicator.store import fence
from mtc.sidecar.replicator.store.store import MAX_FENCES_KEPT, LocalStore

Held = list[tuple[int, int]]

# (case, agreed step, copies held as (origin, step), what the fence deletes)
TO_FENCE: list[tuple[str, int, Held, Held]] = [
    ("nothing newer: nothing deleted", 5, [(0, 3), (0, 5), (1, 5)], []),
    ("a newer own step goes", 5, [(0, 5), (0, 6)], [(0, 6)]),
    ("peers' copies of a newer step go as well", 5, [(0, 5), (1, 7), (2, 7)],
     [(1, 7), (2, 7)]),
    ("the agreed step itself stays, every origin's", 5, [(0, 5), (1, 5), (2, 5)], []),
    ("older steps stay (retention's, not the fence's)", 5, [(0, 1), (1, 2), (2, 9)],
     [(2, 9)]),
    ("every newer step, not only the next", 5, [(0, 6), (0, 7), (1, 30)],
     [(0, 6), (0, 7), (1, 30)]),
    ("agreed nothing (-1) is never a fence, but as a rule deletes every step",
     -1, [(0, 0), (1, 2)], [(0, 0), (1, 2)]),
    ("a copy listed twice is deleted once", 5, [(1, 6), (1, 6)], [(1, 6)]),
]


@pytest.mark.parametrize(("case", "agreed", "held", "deleted"), TO_FENCE,
                         ids=[c[0] for c in TO_FENCE])
def test_to_fence(case: str, agreed: int, held: Held, deleted: Held) -> None:
    assert fence.to_fence(agreed, held) == deleted


# (case, step of the copy on its way, steps of the fences since its offer (None:
#  more than remembered), refused at its commit)
AT_COMMIT: list[tuple[str, int, list[int] | None, bool]] = [
    ("no fence since the offer: committed", 9, [], False),
    ("a fence below the step since: refused", 9, [5], True),
    ("a fence at the step: its copies were kept, so is this one", 5, [5], False),
    ("a fence above the step: kept", 4, [5], False),
    ("two fences, the first below the step: refused (the second alone would keep it)",
     15, [10, 20], True),
    ("two fences, both above: kept", 9, [10, 20], False),
    ("more fences than remembered: refused, offered again", 1, None, True),
]


@pytest.mark.parametrize(("case", "step", "since", "refused"), AT_COMMIT,
                         ids=[c[0] for c in AT_COMMIT])
def test_refused_at_commit(case: str, step: int, since: list[int] | None,
                           refused: bool) -> None:
    assert fence.refused_at_commit(step, since) is refused


@pytest.mark.parametrize(("decided", "fresh", "fences"), [
    (5, True, True), (0, True, True),
    (5, False, False),  # a decision read again (the same ask re-issued): fenced already
    (-1, True, False),  # nothing restorable: nothing to keep apart
])
def test_fences_on(decided: int, fresh: bool, fences: bool) -> None:
    assert fence.fences_on(decided, fresh) is fences


# -- the store applies the rule ------------------------------------------------------

def _store(tmp_path: Path) -> LocalStore:
    root = tmp_path / "host-0"
    for step in (10, 15, 20):
        commit_mtc_step(root, step, {"a": bytes([step]) * 64}, host=0, num_hosts=2)
    return LocalStore(root, rank=0)


def test_the_store_deletes_what_the_rule_names(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.fence(10) == [(0, 15), (0, 20)]
    assert store.copies() == [(0, 10)]
    assert not (store.root / "15").exists() and not (store.root / "20").exists()


def test_a_copy_offered_before_two_fences_is_refused_when_the_first_was_below_it(
        tmp_path: Path) -> None:
    store = _store(tmp_path)
    offered = store.fences
    store.fence(10)  # deletes 15 here: a 15 on its way is of those bytes
    store.fence(20)
    assert store.fenced_since(offered, 15)
    assert not store.fenced_since(offered, 10)
    assert not store.fenced_since(store.fences, 15)  # offered after both: a new save


def test_a_copy_offered_before_more_fences_than_remembered_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    offered = store.fences
    for _ in range(MAX_FENCES_KEPT + 1):
        store.fence(100)
    assert store.fenced_since(offered, 1)
    assert not store.fenced_since(offered + 1, 1)  # within memory: no fence below 1


# -- where the replicator's rule and the controller's differ -------------------------

THIS_RUN, DEAD_RUN = "run-now", "run-dead"


def _controller_deletes(restored: int, held: dict[int, list[int]], saved: dict[int, int],
                        runs: dict[int, dict[int, str]]) -> Held:
    return sorted((h, f.step) for f in controller.to_fence(restored, held, saved, runs,
                                                           THIS_RUN) for h in f.hosts)


def _replicator_deletes(agreed: int, held: dict[int, list[int]]) -> Held:
    return fence.to_fence(agreed, [(h, s) for h, steps in held.items() for s in steps])


def test_both_delete_a_dead_runs_unfinished_save() -> None:
    """The case both rules exist for: a save an earlier run finished on some hosts."""
    held = {0: [10, 15], 1: [10, 15], 2: [10]}
    runs = {15: {0: DEAD_RUN, 1: DEAD_RUN}}
    assert _controller_deletes(10, held, {15: 3}, runs) == [(0, 15), (1, 15)]
    assert _replicator_deletes(10, held) == [(0, 15), (1, 15)]


def test_a_newer_step_every_host_committed_the_controller_keeps_the_replicator_deletes(
) -> None:
    """Only a view short of the hosts that saved it can make the replicators agree on
    an older step (a job come back on fewer hosts): for them the step is not whole,
    the job saves its number again, and the members must not keep the old bytes."""
    held = {0: [10, 15], 1: [10, 15]}
    runs = {15: {0: DEAD_RUN, 1: DEAD_RUN}}
    assert _controller_deletes(10, held, {15: 2}, runs) == []
    assert _replicator_deletes(10, held) == [(0, 15), (1, 15)]


def test_a_copy_of_no_known_run_the_controller_keeps_the_replicator_deletes() -> None:
    """An Orbax step (no manifest) or an unreadable one: the controller's loader
    refuses what it cannot read, so keeping is safe there; among replicators a
    run-less copy of an old save is indistinguishable from the new save of the same
    number, and would complete it: deleted."""
    held = {0: [10, 15], 1: [10]}
    assert _controller_deletes(10, held, {15: 2}, {15: {}}) == []
    assert _replicator_deletes(10, held) == [(0, 15)]


def test_this_runs_own_unfinished_save_the_controller_keeps_the_replicator_deletes() -> None:
    """The controller fences with the run saving now, whose failed save is replaced
    by its next; a replicator fences when a restore is agreed, before the run that
    restores has saved anything: no newer copy can be that run's."""
    held = {0: [10, 15], 1: [10]}
    runs = {15: {0: THIS_RUN}}
    assert _controller_deletes(10, held, {15: 2}, runs) == []
    assert _replicator_deletes(10, held) == [(0, 15)]
