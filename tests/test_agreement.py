"""Restore agreement's pure parts and its decider over an in-memory transport
(no processes: these run in about a second), and one real node's asks of a
coordinator it cannot reach. The protocol: docs/agreement.md."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from mtc.errors import AgreementError, ConfigError, CorruptShardError, StepNotFoundError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.host.ports import free_ports
from mtc.sidecar.replicator.agreement import (
    Ask,
    CannotDecide,
    Coordinator,
    Decided,
    Fresh,
    Holding,
    check_members,
    decide,
    missing_asks,
    newest_complete,
    supersedes,
)
from mtc.sidecar.replicator.book import Book, Decision, EpochRecord, find_record
from mtc.sidecar.replicator.client import PeerError
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.gc import GcInputs, GcPlan, gc_plan
from mtc.sidecar.replicator.main import healthy
from mtc.sidecar.replicator.node import Node
from mtc.sidecar.replicator.node_agreement import holding_of, repairable
from mtc.sidecar.replicator.security import Credentials
from mtc.sidecar.replicator.status import error_class, is_retryable, to_status


def own_only(r: int) -> list[int]:
    return [r]


def peer_group_of_2(r: int) -> list[int]:  # 2 slices of 1 host: Orbax's equivalence
    return [0, 1]


def h(*copies: tuple[int, int], backed: tuple[int, ...] = ()) -> Holding:
    return Holding(frozenset(copies), frozenset(backed))


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


def hs(*copies: tuple[int, int], saved: tuple[tuple[int, int], ...] = ()) -> Holding:
    return Holding(frozenset(copies), frozenset(), None, frozenset(saved))


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


def hr(*copies: tuple[int, int, str, int]) -> Holding:
    """A member's copies with their runs: (origin, step, run, hosts that saved it)."""
    return Holding(frozenset((o, s) for o, s, _, _ in copies), frozenset(), None, frozenset(),
                   frozenset(copies))


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


def hk(*copies: tuple[int, int, str, tuple[int, ...]]) -> Holding:
    """Copies of a job that saved on ranks other than 0..n-1: (origin, step, run, ranks)."""
    return Holding(frozenset((o, s) for o, s, _, _ in copies), frozenset(), None, frozenset(),
                   frozenset((o, s, r, len(k)) for o, s, r, k in copies),
                   frozenset((s, r, k) for _, s, r, k in copies))


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


def test_a_decision_keeps_its_run_and_loss_across_a_restart(tmp_path: Path) -> None:
    book = Book(tmp_path / "book.json")
    book.record(7, {"r"}, 1.0, members=[0, 1], run="abc")
    book.record(-1, {"s"}, 2.0, members=[0, 1], lost="step 9: gone")
    again = Book(tmp_path / "book.json")
    assert again.find("r") is not None and again.find("r").run == "abc"  # type: ignore[union-attr]
    assert again.find("s").lost == "step 9: gone"  # type: ignore[union-attr]


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


def test_a_smaller_jobs_epoch_needs_its_members_only_and_each_reads_one_record() -> None:
    """Members 0 and 1 of 4 nodes decide among themselves, with a book shared with
    the full membership's coordinator: epoch numbers never repeat across them."""
    m = Members({0: hs((0, 3), (2, 3)), 1: hs((1, 3), (3, 3)), 2: hs(), 3: hs()})
    m.down = {2, 3}
    book = Book()
    small = Coordinator([0, 1], own_only, m.gather, book, retry_s=0.01, num_nodes=4)
    full = Coordinator([0, 1, 2, 3], own_only, m.gather, book, retry_s=0.01, num_nodes=4)
    recs = ask_all(small, [0, 1])
    assert {(x.epoch, x.step) for x in recs if isinstance(x, EpochRecord)} == {(1, 3)}, recs
    # The full membership cannot form while 2 and 3 are down (and their asks are missing).
    errors = ask_all(full, [0, 1], rid="full", timeout=0.3)
    assert all(isinstance(e, AgreementError) and "[2, 3]" in str(e) for e in errors), errors
    # Had a step 2 and 3 alone hold been newer, the smaller job never restores it.
    m.holdings[2] = hs((2, 9))
    m.holdings[3] = hs((3, 9))
    again = ask_all(small, [0, 1], rid="again")
    assert {(x.epoch, x.step) for x in again if isinstance(x, EpochRecord)} == {(2, 3)}
    # A restore id answered for one membership is never read as another's record.
    with pytest.raises(AgreementError, match=r"answered for membership \[0, 1\]"):
        full.decide_for(0, "again", 0.3)


def test_records_keep_their_membership_across_a_restart(tmp_path: Path) -> None:
    book = Book(tmp_path / "book.json")
    book.record(3, {"a"}, 1.0, members=[0, 1])
    again = Book(tmp_path / "book.json")
    assert again.find("a") == EpochRecord(1, 3, 1.0, frozenset({"a"}), (0, 1))


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


# -- the coordinator over an in-memory transport ----------------------------------------


class Members:
    """In-memory members: ``holdings[r]`` answers, ``down`` ranks never do."""

    def __init__(self, holdings: dict[int, Holding]) -> None:
        self.holdings = holdings
        self.down: set[int] = set()
        self.asked = 0

    def gather(self, ranks: Sequence[int], deadline: float) -> dict[int, Holding]:
        self.asked += len(ranks)
        return {r: self.holdings[r] for r in ranks if r not in self.down}


def coordinator(m: Members, book: Book | None = None) -> Coordinator:
    return Coordinator(sorted(m.holdings), own_only, m.gather, book or Book(), retry_s=0.01)


def ask_all(c: Coordinator, ranks: Sequence[int], rid: str = "rid",
            timeout: float = 5.0) -> list[EpochRecord | Exception]:
    def one(r: int) -> EpochRecord | Exception:
        try:
            return c.decide_for(r, rid, timeout)
        except AgreementError as e:
            return e
    with ThreadPoolExecutor(len(ranks)) as ex:
        return list(ex.map(one, ranks))


def test_every_member_reads_one_decision_with_o_n_messages() -> None:
    m = Members({r: h((r, 3), (r, 4)) for r in range(8)})
    c = coordinator(m)
    recs = ask_all(c, range(8))
    assert {(x.epoch, x.step) for x in recs if isinstance(x, EpochRecord)} == {(1, 4)}
    assert len(recs) == 8 and all(isinstance(x, EpochRecord) for x in recs)
    assert m.asked == 8  # one inventory per member, once: no round per asker


def test_decides_as_soon_as_everyone_answered() -> None:
    m = Members({r: h((r, 1)) for r in range(4)})
    m.down = {3}
    c = coordinator(m)
    threading.Timer(0.3, lambda: m.down.clear()).start()
    t0 = time.monotonic()
    recs = ask_all(c, range(4), timeout=10.0)
    took = time.monotonic() - t0
    assert {x.step for x in recs if isinstance(x, EpochRecord)} == {1}, recs
    assert took < 5.0, took  # far below the 10 s deadline: no fixed straggler wait


def test_a_member_down_is_a_typed_error_within_the_deadline_and_nothing_recorded() -> None:
    m = Members({r: h((r, 1)) for r in range(4)})
    m.down = {2}
    book = Book()
    c = coordinator(m, book)
    t0 = time.monotonic()
    errors = ask_all(c, range(4), timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    assert all(isinstance(e, AgreementError) and "rank(s) [2]" in str(e) for e in errors), \
        errors
    assert book.records == []
    m.down.clear()  # it returns: the next restore succeeds
    assert {x.step for x in ask_all(c, range(4), rid="again")} == {1}  # type: ignore[union-attr]


def test_a_late_ask_of_an_abandoned_restore_never_replaces_the_newer_one() -> None:
    """Rank 2's retry of a restore it started first reaches the coordinator after
    its newer restore's ask (held up by a partition that has just healed): it is
    refused at once, and the newer restore still decides (CI failure of
    test_slice_partition_fails_typed_within_the_deadline_then_restores)."""
    m = Members({r: h((r, 1)) for r in range(3)})
    c = coordinator(m)
    t = time.time_ns()
    with ThreadPoolExecutor(3) as ex:
        newer = [ex.submit(c.decide_for, r, "new", 5.0, t) for r in (1, 2)]
        time.sleep(0.2)  # both asks held, rank 0 not yet asking
        with pytest.raises(AgreementError, match="older restore of this rank") as e:
            c.decide_for(2, "old", 5.0, t - 10**9)
        assert e.value.host == 2
        newer.append(ex.submit(c.decide_for, 0, "new", 5.0, t))
        assert {f.result(timeout=5.0).step for f in newer} == {1}
    assert [sorted(r.rids) for r in c.book.records] == [["new"]]


def test_a_member_that_never_asks_blocks_the_epoch() -> None:
    m = Members({r: h((r, 1)) for r in range(3)})
    errors = ask_all(coordinator(m), [0, 1], timeout=0.3)
    assert all(isinstance(e, AgreementError) and "request yet from rank(s) [2]" in str(e)
               for e in errors), errors


def test_a_late_or_restarted_asker_reads_the_same_record_not_a_newer_view() -> None:
    m = Members({r: h((r, 5)) for r in range(3)})
    c = coordinator(m)
    first = ask_all(c, range(3), rid="restore-1")
    # New data, then rank 1's replicator restarted and asks again with the same id.
    m.holdings = {r: h((r, 5), (r, 6)) for r in range(3)}
    again = c.decide_for(1, "restore-1", 1.0)
    assert (again.epoch, again.step) == (1, 5) == (first[0].epoch, first[0].step)  # type: ignore[union-attr]
    # A new restore (new id from everyone) decides anew.
    assert {x.step for x in ask_all(c, range(3), rid="restore-2")} == {6}  # type: ignore[union-attr]


def test_decision_is_immutable_across_a_coordinator_restart(tmp_path: Path) -> None:
    m = Members({r: h((r, 5)) for r in range(3)})
    first = ask_all(coordinator(m, Book(tmp_path / "book.json")), range(3), rid="x")
    m.holdings = {r: h((r, 5), (r, 6)) for r in range(3)}
    restarted = coordinator(m, Book(tmp_path / "book.json"))  # its RAM disk kept the book
    got = restarted.decide_for(2, "x", 1.0)
    assert (got.epoch, got.step) == (first[0].epoch, 5)  # type: ignore[union-attr]


def test_a_wiped_coordinator_never_reuses_an_epoch_number() -> None:
    m = Members({r: h((r, 5)) for r in range(3)})
    first = ask_all(coordinator(m), range(3))[0]
    d = first.decision()  # type: ignore[union-attr]
    m.holdings = {r: Holding(frozenset({(r, 5)}), frozenset(),
                             Decision(d.epoch, d.step, d.decided_at, r, "rid"))
                  for r in range(3)}
    m.holdings[0] = h((0, 5))  # the coordinator's host was wiped: no records
    again = ask_all(coordinator(m), range(3), rid="next")
    assert {x.epoch for x in again} == {d.epoch + 1}  # type: ignore[union-attr]


def test_unreadable_book_is_moved_aside_and_the_book_starts_anew(tmp_path: Path) -> None:
    """A corrupt record file is not fatal: kept aside for inspection, the book starts
    empty, and its next epoch is past every one the members report."""
    (tmp_path / "book.json").write_text("{not json")
    book = Book(tmp_path / "book.json")
    assert book.records == []
    assert [p.name.split(".corrupt-")[0] for p in tmp_path.iterdir()] == ["book.json"]
    assert (next(tmp_path.iterdir())).read_text() == "{not json"
    rec = book.record(7, ["r"], 1.0, [Decision(41, 5, 0.0)])
    assert (rec.epoch, rec.step) == (42, 7)
    assert [r.epoch for r in Book(tmp_path / "book.json").records] == [42]


def test_out_of_range_epochs_are_never_recorded_and_dropped_when_read(tmp_path: Path) -> None:
    """A member reporting epoch 2^63-1 does not push the book past what an int64 holds;
    a file that already holds such a record (written before this check) is read
    without it, and deciding goes on."""
    book = Book(tmp_path / "book.json")
    rec = book.record(3, ["a"], 1.0, [Decision(2**63 - 1, 1, 0.0), Decision(9, 1, 0.0)])
    assert rec.epoch == 10
    records = json.loads((tmp_path / "book.json").read_text())
    records.append({"epoch": 2**63, "step": 4, "decided_at": 2.0, "rids": ["b"],
                    "members": []})
    (tmp_path / "book.json").write_text(json.dumps(records))
    again = Book(tmp_path / "book.json")
    assert [r.epoch for r in again.records] == [10]
    assert again.record(5, ["c"], 3.0).epoch == 11
    with pytest.raises(AgreementError, match="out of range"):
        again.record(2**63 - 1, ["d"], 4.0)


def test_fresh_value_is_computed_after_the_question_and_shared() -> None:
    runs: list[float] = []
    gate = threading.Event()

    def compute() -> int:
        runs.append(time.monotonic())
        gate.wait(0.2)
        return len(runs)

    f = Fresh(compute)
    asked = []
    with ThreadPoolExecutor(16) as ex:
        def ask(_: int) -> int:
            asked.append(time.monotonic())
            return f.get(5.0)
        got = list(ex.map(ask, range(16)))
    assert len(runs) <= 3, runs  # 16 askers, at most the run in flight plus two
    assert min(got) >= 1


# -- garbage collection's plan ----------------------------------------------------------


def gc_in(own: tuple[int, ...], replicated: tuple[int, ...] = (), keep: int = 2,
          replicas: dict[int, tuple[int, ...]] | None = None, synced: bool = True,
          busy: frozenset[int] = frozenset()) -> GcInputs:
    return GcInputs(own=own, replicated=replicated, replicas=replicas or {}, keep=keep,
                    busy=busy, synced=synced, linked=frozenset(), rank=0)


GC_CASES = [
    ("nothing to delete", gc_in((4, 5)), None, GcPlan()),
    ("asks for the complete step first", gc_in((1, 2, 3, 4, 5), (1,)), None,
     GcPlan(needs_complete=True)),
    ("keeps newest, replicated, complete", gc_in((1, 2, 3, 4, 5), (1,)), 2, GcPlan((3,))),
    ("not synced: keeps all own", gc_in((1, 2, 3), synced=False), 2, GcPlan()),
    ("busy kept", gc_in((1, 2, 3, 4), busy=frozenset({1})), 3, GcPlan((2,))),
    ("old copies of a peer go, complete kept", gc_in((5,), replicas={1: (2, 3, 4, 5)}), 2,
     GcPlan((), ((1, 3),))),
]


@pytest.mark.parametrize(("name", "x", "complete", "want"), GC_CASES,
                         ids=[c[0] for c in GC_CASES])
def test_gc_plan(name: str, x: GcInputs, complete: int | None, want: GcPlan) -> None:
    assert gc_plan(x, complete) == want


# -- the one status map ---------------------------------------------------------------


def peer_error(code: grpc.StatusCode | None) -> PeerError:
    e = PeerError("x")
    e.code = code
    return e


def test_status_map_both_ways_and_retry_rule() -> None:
    for err, code, back in [
        (CorruptShardError("x"), grpc.StatusCode.DATA_LOSS, CorruptShardError),
        (StepNotFoundError("x"), grpc.StatusCode.NOT_FOUND, StepNotFoundError),
        (AgreementError("x"), grpc.StatusCode.ABORTED, AgreementError),
    ]:
        assert to_status(err) == code
        assert error_class(code) is back
    assert to_status(ValueError("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert to_status(RuntimeError("x")) == grpc.StatusCode.INTERNAL
    assert is_retryable(peer_error(grpc.StatusCode.UNAVAILABLE))
    assert is_retryable(peer_error(None))
    assert not is_retryable(peer_error(grpc.StatusCode.INVALID_ARGUMENT))
    assert not is_retryable(peer_error(grpc.StatusCode.DATA_LOSS))
    assert not is_retryable(CorruptShardError("x"))
    assert is_retryable(AgreementError("x"))


def test_health_follows_the_loop() -> None:
    assert healthy(100.0, 101.0, 5.0)
    assert not healthy(100.0, 106.0, 5.0)


def test_fresh_runs_start_at_most_every_min_interval() -> None:
    starts: list[float] = []
    f = Fresh(lambda: starts.append(time.monotonic()) or len(starts), min_interval_s=0.2)
    assert f.get(5.0) == 1
    assert f.get(5.0) == 2  # a question after a run gets a newer run, never the old value
    assert starts[1] - starts[0] >= 0.2


def test_an_older_restore_stops_asking_when_a_newer_one_starts_on_its_host(
        tmp_path: Path) -> None:
    """A real node (rank 1) whose coordinator (rank 0, a loopback port nothing
    listens on) is unreachable: a restore that outlived its caller keeps asking
    until its deadline. Once the coordinator is back, its late ask would replace
    the newer restore's (one ask per rank) and fail that one instead of saying who
    is missing. It stops as soon as the newer restore starts."""
    port = free_ports(1)[0]
    cfg = ReplicatorConfig(rank=1, nodes=(f"127.0.0.1:{port}", "127.0.0.1:1"),
                           nodes_per_slice=1, deadline_s=0.5, agreement_timeout_s=20.0)
    node = Node(cfg, tmp_path / "root", Credentials())
    try:
        with ThreadPoolExecutor(2) as pool:
            old = pool.submit(node.agreement.agree_epoch, 20.0, "old-restore")
            time.sleep(0.5)  # asking, failing, asking again
            assert not old.done()
            t0 = time.monotonic()
            new = pool.submit(node.agreement.agree_epoch, 1.5, "new-restore")
            with pytest.raises(AgreementError, match="a newer restore on this host") as e:
                old.result(timeout=5.0)
            assert time.monotonic() - t0 < 2.0  # at its next try, not at its deadline
            assert e.value.host == 1
            with pytest.raises(AgreementError, match="no restore decision within"):
                new.result(timeout=10.0)  # the newer one runs to its own deadline
    finally:
        node.stop()
