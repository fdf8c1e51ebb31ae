"""The pure policies, tested alone: the manager's retention (mtc.retention), the
replicator's garbage-collection plan (gc_plan in mtc.sidecar.replicator.copies.gc) and
which older step it copies again to a peer (older_to_restore in
mtc.sidecar.replicator.copies.replication)."""

from __future__ import annotations

import pytest

from mtc.cli import lost_steps, missing_steps
from mtc.retention import best_to_delete, to_delete
from mtc.sidecar.replicator.copies.gc import GcInputs, GcPlan, gc_plan
from mtc.sidecar.replicator.copies.replication import older_to_restore

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
       linked: frozenset[int] = frozenset(), rank: int = 0, awaiting: int = 2,
       room: int = 0, need: int = 0, size: int = 10) -> GcInputs:
    """Inputs of one pass; every held step and copy ``size`` bytes."""
    sizes = {(rank, s): size for s in own}
    sizes |= {(o, s): size for o, steps in (replicas or {}).items() for s in steps}
    return GcInputs(own, replicated, replicas or {}, keep, busy, synced, linked, rank,
                    awaiting=awaiting, room=room, need=need, sizes=sizes)


TEN = tuple(range(1, 11))


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
    ("before every target was read once, the newest older steps stay (one may be "
     "the newest on the target)", gc(own=(3, 4, 5), synced=False), {5}, GcPlan()),
    # Issue 56, item 7: a target nobody answers (a wrong address) is never read, and
    # every step used to stay until the RAM disk was full.
    ("a target never read: keep and --keep-awaiting bound the steps",
     gc(own=TEN, keep=2, synced=False), {10}, GcPlan(own=(1, 2, 3, 4, 5, 6))),
    ("a target never read: the coordinator's step comes first",
     gc(own=TEN, keep=2, synced=False), {4, 10}, GcPlan(own=(1, 2, 3, 5, 6, 7))),
    ("the coordinator unanswered: only the bound's steps go, and it is asked",
     gc(own=TEN, replicated=TEN, keep=2), None,
     GcPlan(own=(1, 2, 3, 4, 5, 6), needs_coordinator=True)),
    ("the coordinator unanswered within the bound: nothing goes yet",
     gc(own=(7, 8, 9, 10), replicated=(7, 8, 9, 10), keep=2), None,
     GcPlan(needs_coordinator=True)),
    ("--keep-awaiting 0: the newest keep only",
     gc(own=TEN, replicated=(3,), keep=2, awaiting=0), {5},
     GcPlan(own=(1, 2, 3, 4, 5, 6, 7, 8), over=(3, 5))),
    ("busy steps stay beyond the bound, and count in it",
     gc(own=TEN, replicated=(4,), keep=2, busy=frozenset({1, 2})), {5},
     GcPlan(own=(3, 4, 5, 6, 7, 8), over=(4, 5))),
    ("the coordinator's steps before the newest replicated",
     gc(own=TEN, replicated=(2,), keep=2, awaiting=1), {5},
     GcPlan(own=(1, 2, 3, 4, 6, 7, 8), over=(2,))),
    # Room for the next save and copies before older steps: the least valuable first.
    ("short of room: the newest replicated goes before the complete step",
     gc(own=(1, 2, 3, 4), replicated=(2,), keep=2, room=5, need=15), {1},
     GcPlan(own=(2,), over=(2,))),
    ("short of room: both go when one is not enough",
     gc(own=(1, 2, 3, 4), replicated=(2,), keep=2, room=5, need=25), {1},
     GcPlan(own=(1, 2), over=(1, 2))),
    ("short of room: steps going anyway count first",
     gc(own=(1, 2, 3, 4, 5), replicated=(3,), keep=2, room=5, need=15, awaiting=1), {1},
     GcPlan(own=(2, 3), over=(3,))),
    ("short of room: never a busy step nor the newest keep",
     gc(own=(1, 2, 3), keep=1, busy=frozenset({1}), room=0, need=100), {2},
     GcPlan(own=(2,), over=(2,))),
    ("short of room: then the copies kept for the coordinator",
     gc(own=(6,), replicas={1: (4, 5, 6)}, keep=1, room=0, need=15), {4},
     GcPlan(replicas=((1, 4), (1, 5)), over=(4,))),
    ("room enough: nothing more goes",
     gc(own=(1, 2, 3, 4), replicated=(2,), keep=2, room=100, need=15), {1}, GcPlan()),
    ("the coordinator unanswered: copies beyond keep and the bound go",
     gc(own=(10,), replicas={1: TEN}, keep=2), None,
     GcPlan(replicas=tuple((1, s) for s in range(1, 7)), needs_coordinator=True)),
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


# (name, own steps by rank, copies by holder -> origin -> steps, lost)
LOST = [
    ("every host whole", {0: [4, 5], 1: [4, 5]}, {0: {1: [4, 5]}, 1: {0: [4, 5]}}, {}),
    ("a wiped host: its peer's copies are newer than its nothing",
     {0: [4, 5], 1: []}, {0: {1: [4, 5]}, 1: {}}, {1: {4: [0], 5: [0]}}),
    ("a host that kept older steps only", {0: [5], 1: [2]}, {0: {1: [4, 5]}},
     {1: {4: [0], 5: [0]}}),
    ("copies older than the host's own: it saved on, nothing lost",
     {0: [30], 1: [30]}, {1: {0: [20, 25]}}, {}),
    ("a copy is never its holder's own loss", {0: []}, {0: {0: [3]}}, {}),
    ("a rank that did not answer is not judged", {0: [5]}, {0: {1: [5]}}, {}),
    ("several holders named", {0: [], 1: [5], 2: [5]}, {1: {0: [5]}, 2: {0: [5]}},
     {0: {5: [1, 2]}}),
]


@pytest.mark.parametrize(("name", "own", "copies", "want"), LOST, ids=[c[0] for c in LOST])
def test_lost_steps(name: str, own: dict[int, list[int]],
                    copies: dict[int, dict[int, list[int]]],
                    want: dict[int, dict[int, list[int]]]) -> None:
    assert lost_steps(own, copies) == want


# (name, own steps by rank, copies by holder -> origin -> steps, missing)
MISSING = [
    ("every host whole", {0: [4, 5], 1: [4, 5]}, {0: {1: [4, 5]}, 1: {0: [4, 5]}}, {}),
    ("wiped before its steps reached a peer: nobody holds a copy", {0: [4, 5], 1: []},
     {0: {}, 1: {}}, {1: [4, 5]}),
    ("a copy elsewhere: lost_steps names it, not this", {0: [4, 5], 1: []},
     {0: {1: [4, 5]}}, {}),
    ("only the steps every other rank holds", {0: [4, 5], 1: [5], 2: [3]}, {},
     {2: [5]}),
    ("newer steps than its newest only", {0: [4], 1: [6]}, {}, {0: [6]}),
    ("a job of one rank misses nothing", {0: []}, {}, {}),
]


@pytest.mark.parametrize(("name", "own", "copies", "want"), MISSING,
                         ids=[c[0] for c in MISSING])
def test_missing_steps(name: str, own: dict[int, list[int]],
                       copies: dict[int, dict[int, list[int]]],
                       want: dict[int, list[int]]) -> None:
    assert missing_steps(own, copies) == want


BEST = [
    # (name, steps, metrics (loss), max_to_keep, keep_without_metrics, want deleted)
    ("fewer rated than kept: none goes", [0, 1, 2, 3], {0: 3, 2: 4}, 3, True, []),
    ("one rated, three kept", [0, 1, 2, 3, 4], {2: 5}, 3, True, []),
    ("the worst of four rated goes", [0, 1, 2, 3, 4, 5], {0: 3, 2: 4, 4: 1, 5: 2}, 3, True, [2]),
    ("unrated go too without keep_without_metrics", [0, 1, 2, 3], {0: 3, 2: 4}, 3, False,
     [1, 3]),
    ("max_to_keep 1: the best alone", [0, 1, 2], {0: 3, 1: 1, 2: 2}, 1, True, [0, 2]),
    ("no more steps than kept: nothing", [0, 1], {0: 3, 1: 4}, 3, True, []),
]


@pytest.mark.parametrize(("name", "steps", "loss", "keep", "unrated", "want"), BEST,
                         ids=[c[0] for c in BEST])
def test_best_to_delete(name: str, steps: list[int], loss: dict[int, float], keep: int,
                        unrated: bool, want: list[int]) -> None:
    """Orbax's best_fn retention (mode "min"): the ``keep`` lowest losses stay, and
    while fewer steps than that are rated, all of them do."""
    metrics = {s: {"loss": v} for s, v in loss.items()}
    assert best_to_delete(steps, metrics, max_to_keep=keep, keep_period=None,
                          best_fn=lambda m: m["loss"], best_mode="min",
                          keep_without_metrics=unrated) == want, name
