"""Restore agreement's pure parts (no processes: these run in about a second): the
step decided from every member's holdings (newest complete, smaller jobs, runs,
the ranks that saved), a stated membership checked, when an epoch can form, which
of a rank's asks is kept, what a damaged step may be repaired from. The protocol:
docs/agreement.md. Its decider over an in-memory transport, and one real node:
``tests/test_agreement_coordinator.py``; the replicator's other pure rules
(garbage collection, status codes, health): ``tests/test_replicator_rules.py``."""

from __future__ import annotations

import pytest
from agreement_holdings import h, hk, hr, hs, own_only, peer_group_of_2

from mtc.errors import ConfigError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.agree.book import EpochRecord, find_record
from mtc.sidecar.replicator.agree.decision import (
    Ask,
    CannotDecide,
    Decided,
    Holding,
    check_members,
    decide,
    gc_keeps,
    missing_asks,
    newest_complete,
    supersedes,
)
from mtc.sidecar.replicator.agree.node_agreement import holding_of, repairable

# -- decide: the step from every member's holdings ------------------------------------

DECIDE_CASES = [
    # (name, holdings, members, equivalent, expected)
    ("all hold 5", {0: h((0, 5)), 1: h((1, 5))}, [0, 1], own_only, Decided(5)),
    ("newest common", {0: h((0, 4), (0, 5)), 1: h((1, 4))}, [0, 1], own_only, Decided(4)),
    ("held on a peer", {0: h((0, 3), (1, 3)), 1: h()}, [0, 1], own_only, Decided(3)),
    ("nothing anywhere", {0: h(), 1: h()}, [0, 1], own_only, Decided(-1)),
    ("backup newer", {0: h((0, 2)), 1: h((1, 2), backed=(7,))}, [0, 1], own_only, Decided(7)),
    ("peer group stands in", {0: h((0, 6)), 1: h()}, [0, 1], peer_group_of_2, Decided(6)),
    ("a member silent", {0: h((0, 5))}, [0, 1], own_only,
     CannotDecide("no inventory from rank(s) [1]", (1,))),
    ("all silent but one of 4", {2: h()}, [0, 1, 2, 3], own_only,
     CannotDecide("no inventory from rank(s) [0, 1, 3]", (0, 1, 3))),
    ("a stranger answers", {0: h(), 1: h(), 5: h()}, [0, 1], own_only,
     CannotDecide("inventory from rank(s) [5] outside the membership")),
]


@pytest.mark.parametrize(("name", "holdings", "members", "equivalent", "want"), DECIDE_CASES,
                         ids=[c[0] for c in DECIDE_CASES])
def test_decide(name: str, holdings: dict[int, Holding], members: list[int],
                equivalent: object, want: Decided | CannotDecide) -> None:
    assert decide(holdings, members, equivalent) == want  # type: ignore[arg-type]


def test_newest_complete_ignores_backup_and_needs_every_rank() -> None:
    hs = {0: h((0, 1), (0, 2), (1, 1)), 1: h((1, 1), backed=(9,)), 2: h((2, 1), (2, 2))}
    assert newest_complete(hs, 3, own_only) == 1
    hs[1] = h((1, 1), (1, 2))
    assert newest_complete(hs, 3, own_only) == 2


# (name, holdings, num_nodes, equivalent, the steps garbage collection leaves)
GC_KEEPS_CASES = [
    ("replicated everywhere: the newest step alone",
     {0: h((0, 4), (0, 5), (1, 4), (1, 5)), 1: h((1, 4), (1, 5), (0, 4), (0, 5))}, 2,
     own_only, {5}),
    # What a random-fault run lost: rank 1 committed 5 and 6 and was wiped before
    # they reached its peer; rank 0 had deleted its 4 (newer steps complete) and
    # nothing was restorable. Step 4 is the newest that survives losing any host.
    ("a host's newest steps on it alone: the newest step on two hosts as well",
     {0: h((0, 4), (0, 5), (0, 6), (1, 4)), 1: h((1, 4), (1, 5), (1, 6), (0, 4), (0, 5),
                                                 (0, 6))}, 2, own_only, {4, 6}),
    ("no step on two hosts: the complete one only",
     {0: h((0, 5)), 1: h((1, 5))}, 2, own_only, {5}),
    ("nothing complete", {0: h((0, 5)), 1: h()}, 2, own_only, set()),
    # Orbax's data-parallel twins hold the same data: the twin's own step is the
    # second host of it.
    ("a twin's own copy is the second host",
     {0: h((0, 5)), 1: h((1, 5))}, 2, peer_group_of_2, {5}),
    ("copies of two runs never make one step's two hosts",
     {0: hr((0, 5, "a", 2), (1, 5, "b", 2), (0, 4, "a", 2), (1, 4, "a", 2)),
      1: hr((1, 5, "a", 2), (0, 5, "b", 2), (1, 4, "a", 2), (0, 4, "a", 2))}, 2, own_only,
     {4, 5}),
]


@pytest.mark.parametrize(("name", "holdings", "num_nodes", "equivalent", "want"),
                         GC_KEEPS_CASES, ids=[c[0] for c in GC_KEEPS_CASES])
def test_gc_keeps_the_newest_complete_step_and_the_newest_on_two_hosts(
        name: str, holdings: dict[int, Holding], num_nodes: int, equivalent: object,
        want: set[int]) -> None:
    assert gc_keeps(holdings, num_nodes, equivalent) == want  # type: ignore[arg-type]


# (name, holdings, members, num_nodes, expected): a job of fewer hosts than saved.
SMALLER_JOB_CASES = [
    ("the gone hosts' data on members' peer copies",
     {0: hs((0, 3), (2, 3)), 1: hs((1, 3), (3, 3))}, [0, 1], 4, Decided(3)),
    ("a gone host's data nowhere: an older step",
     {0: hs((0, 2), (0, 3), (2, 2), (2, 3)), 1: hs((1, 2), (1, 3), (3, 2))}, [0, 1], 4,
     Decided(2)),
    ("held only by a host outside the job: does not count",
     {0: hs((0, 3), (2, 3)), 1: hs((1, 3))}, [0, 1], 4,
     Decided(-1, lost="step 3: data of rank(s) [3] is on no member and not in the backup "
                      "(rank(s) [0, 1, 2] still hold theirs)")),
    ("a step the smaller job saved: its own hosts' data suffice",
     {0: hs((0, 3), (2, 3), (0, 4), saved=((3, 4), (4, 2))),
      1: hs((1, 3), (3, 3), (1, 4), saved=((3, 4), (4, 2)))}, [0, 1], 4, Decided(4)),
    ("one copy states more saving hosts: the most is needed",
     {0: hs((0, 4), saved=((4, 2),)), 1: hs((1, 4), saved=((4, 3),))}, [0, 1], 4,
     Decided(-1, lost="step 4: data of rank(s) [2] is on no member and not in the backup "
                      "(rank(s) [0, 1] still hold theirs)")),
    ("a member silent: never a partial view",
     {0: hs((0, 3), (2, 3))}, [0, 1], 4, CannotDecide("no inventory from rank(s) [1]", (1,))),
]


# (name, holdings, members, num_nodes, expected): steps saved by more than one run.
RUN_CASES = [
    ("one run everywhere",
     {0: hr((0, 5, "a", 2)), 1: hr((1, 5, "a", 2))}, [0, 1], 2, Decided(5, "a")),
    ("a step two runs committed on different hosts is never complete",
     {0: hr((0, 4, "a", 2), (0, 5, "a", 2)), 1: hr((1, 4, "a", 2), (1, 5, "b", 2))}, [0, 1], 2,
     Decided(4, "a")),
    ("a stale copy of another run beside a complete run",
     {0: hr((0, 5, "b", 2), (1, 5, "a", 2)), 1: hr((1, 5, "b", 2))}, [0, 1], 2, Decided(5, "b")),
    ("a smaller run's step: its own saving hosts, not the bigger run's",
     {0: hr((0, 5, "small", 2), (2, 5, "big", 4)), 1: hr((1, 5, "small", 2))}, [0, 1], 4,
     Decided(5, "small")),
    ("every copy mixed: nothing to restore, said",
     {0: hr((0, 5, "a", 2)), 1: hr((1, 5, "b", 2))}, [0, 1], 2,
     Decided(-1, lost="step 5 (run a): data of rank(s) [1] is on no member and not in the "
                      "backup (rank(s) [0] still hold theirs); step 5 (run b): data of rank(s) "
                      "[0] is on no member and not in the backup (rank(s) [1] still hold "
                      "theirs)")),
]


@pytest.mark.parametrize(("name", "holdings", "members", "num_nodes", "want"), RUN_CASES,
                         ids=[c[0] for c in RUN_CASES])
def test_decide_never_combines_two_runs(name: str, holdings: dict[int, Holding],
                                        members: list[int], num_nodes: int,
                                        want: Decided) -> None:
    assert decide(holdings, members, own_only, num_nodes) == want


# (name, holdings, members, num_nodes, expected): steps saved by a job on ranks 2 and 3.
RANKS_CASES = [
    ("a job of 2 on ranks 2 and 3: their data makes its step, not ranks 0 and 1's",
     {2: hk((2, 4, "s", (2, 3)), (0, 3, "b", ())), 3: hk((3, 4, "s", (2, 3)))}, [2, 3], 4,
     Decided(4, "s")),
    ("its step without rank 3's data is not complete",
     {2: hk((2, 4, "s", (2, 3))), 3: hk()}, [2, 3], 4,
     Decided(-1, lost="step 4: data of rank(s) [3] is on no member and not in the backup "
                      "(rank(s) [2] still hold theirs)")),
    ("the job grown back onto all 4 restores it: ranks 0 and 1 saved none of it",
     {0: hk(), 1: hk(), 2: hk((2, 4, "s", (2, 3))), 3: hk((3, 4, "s", (2, 3)))},
     [0, 1, 2, 3], 4, Decided(4, "s")),
]


@pytest.mark.parametrize(("name", "holdings", "members", "num_nodes", "want"), RANKS_CASES,
                         ids=[c[0] for c in RANKS_CASES])
def test_decide_on_the_ranks_that_saved(name: str, holdings: dict[int, Holding],
                                        members: list[int], num_nodes: int,
                                        want: Decided) -> None:
    assert decide(holdings, members, own_only, num_nodes) == want


@pytest.mark.parametrize(("name", "holdings", "members", "num_nodes", "want"),
                         SMALLER_JOB_CASES, ids=[c[0] for c in SMALLER_JOB_CASES])
def test_decide_for_a_smaller_job(name: str, holdings: dict[int, Holding], members: list[int],
                                  num_nodes: int, want: Decided | CannotDecide) -> None:
    assert decide(holdings, members, own_only, num_nodes) == want


@pytest.mark.parametrize(("members", "rank", "match"), [
    ([0, 0, 1], 0, "names a rank twice"),
    ([0, 4], 0, r"rank\(s\) \[4\] are not among the replicators' 4 nodes"),
    ([-1, 0], 0, "are not among"),
    ([2, 3], 0, "rank 0 asked with membership \\[2, 3\\], which does not include it"),
])
def test_a_stated_membership_is_checked_never_guessed(members: list[int], rank: int,
                                                      match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_members(members, 4, rank)


def test_stated_memberships_sorted_and_empty_means_every_node() -> None:
    assert check_members([3, 1], 4, 1) == (1, 3)
    assert check_members([], 4, 2) == (0, 1, 2, 3)


# -- when an epoch can form, which record answers an ask ---------------------------------

ASK_CASES = [
    # (name, asks: rank -> lease end, now, missing)
    ("nobody asked", {}, 10.0, (0, 1, 2)),
    ("all asked", {0: 20.0, 1: 20.0, 2: 11.0}, 10.0, ()),
    ("one missing", {0: 20.0, 2: 20.0}, 10.0, (1,)),
    ("an ask whose asker gave up", {0: 20.0, 1: 9.0, 2: 20.0}, 10.0, (1,)),
    ("a stranger does not count", {0: 20.0, 1: 20.0, 7: 20.0}, 10.0, (2,)),
]


@pytest.mark.parametrize(("name", "asks", "now", "want"), ASK_CASES,
                         ids=[c[0] for c in ASK_CASES])
def test_missing_asks(name: str, asks: dict[int, float], now: float,
                      want: tuple[int, ...]) -> None:
    assert missing_asks(asks, [0, 1, 2], now) == want


SUPERSEDE_CASES = [
    # (name, new ask, held ask, whether the new one takes the rank's place); now = 10
    ("nothing held", Ask("b", 20.0, 200), None, True),
    ("a re-issued ask of the same restore", Ask("a", 20.0, 100), Ask("a", 15.0, 100), True),
    ("a newer restore", Ask("b", 20.0, 200), Ask("a", 20.0, 100), True),
    ("a late retry of an older restore", Ask("a", 20.0, 100), Ask("b", 20.0, 200), False),
    ("an older restore after the newer's asker gave up", Ask("a", 20.0, 100),
     Ask("b", 9.0, 200), True),
    ("no start time: by arrival", Ask("a", 20.0, 0), Ask("b", 20.0, 200), True),
    ("held without a start time: by arrival", Ask("a", 20.0, 100), Ask("b", 20.0, 0), True),
]


@pytest.mark.parametrize(("name", "new", "held", "want"), SUPERSEDE_CASES,
                         ids=[c[0] for c in SUPERSEDE_CASES])
def test_supersedes(name: str, new: Ask, held: Ask | None, want: bool) -> None:
    assert supersedes(new, held, 10.0) is want


def _copy(origin: int, step: int, run: str, *files: tuple[str, int, int]) -> pb.StepCopy:
    return pb.StepCopy(origin_rank=origin, step=step, run=run, saved_hosts=3,
                       files=[pb.FileInfo(path=p, size=n, crc32c=c) for p, n, c in files])


def test_a_damaged_step_is_repairable_only_from_identical_bytes_of_its_step_and_run(
        ) -> None:
    twin = pb.Inventory(rank=2, copies=[_copy(2, 7, "r", ("dp", 8, 11), ("own2", 4, 5)),
                                        _copy(2, 6, "r", ("dp6", 8, 12))])
    cases = {
        "held by the twin": (_copy(0, 7, "r", ("dp", 8, 11)), True),
        "another crc": (_copy(0, 7, "r", ("dp", 8, 99)), False),
        "another size": (_copy(0, 7, "r", ("dp", 9, 11)), False),
        "another path": (_copy(0, 7, "r", ("dp2", 8, 11)), False),
        "another step's file": (_copy(0, 7, "r", ("dp6", 8, 12)), False),
        "another run's step": (_copy(0, 7, "q", ("dp", 8, 11)), False),
        "one of two files": (_copy(0, 7, "r", ("dp", 8, 11), ("x", 1, 1)), False),
        "no files named": (_copy(0, 7, "r"), False),
    }
    for name, (damaged, want) in cases.items():
        own = pb.Inventory(rank=0, damaged=[damaged])
        got = repairable({0: own, 2: twin})
        assert (got == {0: [damaged]}) is want and (got == {}) is not want, name
        held = holding_of(own, got.get(0, ()))
        assert ((0, 7) in held.copies) is want, name
        assert ((0, 7, damaged.run, 3) in held.runs) is want, name
    # A damaged copy repairs nothing, its own included.
    other = pb.Inventory(rank=1, damaged=[_copy(1, 7, "r", ("dp", 8, 11))])
    assert repairable({0: pb.Inventory(rank=0, damaged=[_copy(0, 7, "r", ("dp", 8, 11))]),
                       1: other}) == {}


def test_find_record_by_restore_id() -> None:
    recs = [EpochRecord(1, 4, 0.0, frozenset({"a", "b"})), EpochRecord(2, 5, 1.0,
                                                                      frozenset({"c"}))]
    assert find_record(recs, "b") == recs[0]
    assert find_record(recs, "c") == recs[1]
    assert find_record(recs, "z") is None
