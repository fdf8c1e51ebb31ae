"""Restore agreement's decider over an in-memory transport (no processes: these
run in about a second): every member reads one decision, decided once and
recorded in a book that survives restarts, wipes and corruption; a smaller job's
epoch; values computed after the question and shared; and one real node's asks
of a coordinator it cannot reach. The protocol: docs/agreement.md; the pure
parts: ``tests/test_agreement.py``."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from agreement_holdings import h, hs, own_only

from mtc.credentials import Credentials
from mtc.errors import AgreementError, ConfigError
from mtc.ports import free_ports
from mtc.sidecar.replicator.agree.agreement import (
    ALIVE_CHECK_S,
    PROBE_MARGIN_S,
    PROBE_S,
    Coordinator,
)
from mtc.sidecar.replicator.agree.book import Book, Decision, EpochRecord
from mtc.sidecar.replicator.agree.decision import Holding
from mtc.sidecar.replicator.agree.fresh import Fresh
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.node import Node

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


# The probe interval of the coordinators here that probe (PROBE_S in a replicator):
# the tests wait for probes, so they run with a shorter one.
PROBE = 0.2


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


def test_an_ask_whose_call_ended_keeps_its_place_and_is_answered_when_asked_again() -> None:
    """Rank 1's call ends (its asker's per-call limit, or a cut link) before rank 0
    asks: the waiting thread leaves at once, typed, but the ask stands until its
    deadline, so rank 0's ask forms the epoch alone, and rank 1 asking again with
    the same restore id reads that decision."""
    m = Members({r: h((r, 2)) for r in range(2)})
    c = coordinator(m)
    t0 = time.monotonic()
    with pytest.raises(AgreementError, match="stopped waiting"):
        c.decide_for(1, "rid", 30.0, alive=lambda: time.monotonic() - t0 < 0.2)
    assert time.monotonic() - t0 < 0.2 + ALIVE_CHECK_S + 0.5  # not the 30 s deadline
    rec0 = c.decide_for(0, "rid", 5.0)  # rank 1's ask is still live: the epoch forms
    assert rec0.step == 2
    t1 = time.monotonic()
    assert c.decide_for(1, "rid", 5.0) == rec0  # asked again: the recorded decision
    assert time.monotonic() - t1 < 0.5
    assert m.asked == 2  # one gather: the second ask read the book


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
        # Both asks held, rank 0 not yet asking: waited for, not a fixed time (a
        # loaded machine may start the threads later; the old ask would come first).
        deadline = time.monotonic() + 10
        while not {1, 2} <= set(c._asks) and time.monotonic() < deadline:
            time.sleep(0.01)
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


def test_a_member_that_refuses_for_its_configuration_fails_every_ask_at_once_naming_it(
        ) -> None:
    """Issue 56, item 8: a member whose flags disagree with a peer's refuses and never
    asks; the others learn why within a probe, not at their deadline."""
    m = Members({r: h((r, 1)) for r in range(4)})
    probed: list[list[int]] = []

    def faults(ranks: Sequence[int], within_s: float) -> str:
        probed.append(list(ranks))
        return "rank 2's replicator refuses: the node at b:1 says it is rank 1" \
            if 2 in ranks else ""

    c = Coordinator(sorted(m.holdings), own_only, m.gather, Book(), retry_s=0.01,
                    faults=faults, probe_s=PROBE)
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(c.decide_for, r, "rid", 30.0) for r in (0, 1, 3)]
        errors = []
        for f in futs:
            with pytest.raises(ConfigError, match=r"disagree on their configuration.*rank 2's "
                               r"replicator refuses: the node at b:1 says it is rank 1") as e:
                f.result()
            errors.append(e.value)
    took = time.monotonic() - t0
    assert took < PROBE + 3, took  # a probe after an ask waited probe_s, not 30 s
    assert [2] in probed and all(p == [2] for p in probed[-1:]), probed
    assert len(probed) <= 3, probed  # one asker probes at a time, at most every probe_s
    assert c.book.find("rid") is None  # nothing decided


def test_a_probe_of_a_cut_off_member_ends_before_the_askers_deadline() -> None:
    """A member cut off from the coordinator never answers the probe: its call runs
    to the time it is given. The askers' typed error naming it still comes by their
    deadline (a probe given its own 2 s made the asks' calls time out first)."""
    m = Members({r: h((r, 1)) for r in range(3)})
    given: list[float] = []

    def faults(ranks: Sequence[int], within_s: float) -> str:
        given.append(within_s)
        time.sleep(min(2.0, within_s))  # a call to a cut-off member, to its deadline
        return ""

    c = Coordinator(sorted(m.holdings), own_only, m.gather, Book(), retry_s=0.01,
                    faults=faults, probe_s=PROBE)
    t0 = time.monotonic()
    errors = ask_all(c, [0, 1], timeout=1.0)
    took = time.monotonic() - t0
    assert all(isinstance(e, AgreementError) and "request yet from rank(s) [2]" in str(e)
               for e in errors), errors
    # Probed once an ask had waited PROBE, given what is left less the margin.
    assert given and all(g <= 1.0 - PROBE - PROBE_MARGIN_S for g in given), given
    assert took < 1.0 + 0.3, took


def test_a_member_that_asked_once_at_the_start_is_not_named_as_absent() -> None:
    """Issue 68, item 6: the coordinator's own ask is made once, with the whole
    deadline; another member's last call carries only its last second. Only the
    member that never asked is named (not ``[0, 1]``, rank 0 having asked)."""
    m = Members({r: h((r, 1)) for r in range(3)})
    c = coordinator(m)
    with ThreadPoolExecutor(1) as ex:
        first = ex.submit(c.decide_for, 0, "rid", 1.5)
        for timeout in (0.6, 0.3):  # rank 2's calls, each with the time it has left
            with pytest.raises(AgreementError) as e:
                c.decide_for(2, "rid", timeout)
        assert "no restore request yet from rank(s) [1];" in str(e.value), e.value
        with pytest.raises(AgreementError, match=r"rank\(s\) \[1\];"):
            first.result(timeout=10.0)


def test_the_error_names_the_absent_member_as_its_host_not_the_asker() -> None:
    """The second newcomer trial: a job restarted with replicator 1 dead got
    ``... no restore request yet from rank(s) [1] ... (host 2)``: the error's host
    was the member that asked (healthy), so a user read host 2 as the failed one.
    The host is the member that did not ask (the first, when several did not)."""
    m = Members({r: h((r, 1)) for r in range(4)})
    c = coordinator(m)
    with pytest.raises(AgreementError) as e:
        c.decide_for(2, "rid", 0.3)
    assert "no restore request yet from rank(s) [0, 1, 3]" in str(e.value), e.value
    assert e.value.host == 0, e.value
    with ThreadPoolExecutor(3) as ex:
        errs = [ex.submit(c.decide_for, r, "rid2", 0.6) for r in (0, 2, 3)]
        got = []
        for f in errs:
            with pytest.raises(AgreementError) as e:
                f.result(timeout=10.0)
            got.append(e.value)
    assert {x.host for x in got} == {1}, [str(x) for x in got]
    assert all(str(x).endswith("(host 1)") for x in got), [str(x) for x in got]


def test_the_member_that_never_asks_is_named_with_its_address(tmp_path: Path) -> None:
    """A real coordinator node (rank 0) whose member rank 1 is down (a loopback port
    nothing listens on): its ask's error names rank 1's replicator and address, as
    the probe found it."""
    down = free_ports(1)[0]
    cfg = ReplicatorConfig(rank=0, nodes=("127.0.0.1:1", f"127.0.0.1:{down}"),
                           nodes_per_slice=1, deadline_s=0.5, agreement_timeout_s=20.0)
    node = Node(cfg, tmp_path / "root", Credentials())
    try:
        with pytest.raises(AgreementError, match=rf"no restore request yet from rank\(s\) "
                           rf"\[1\] \(rank 1's replicator at 127.0.0.1:{down} does not "
                           rf"answer: UNAVAILABLE"):
            node.agreement.agree_epoch(PROBE_S + 1.5, "rid")
    finally:
        node.stop()


def test_a_member_late_without_a_fault_is_waited_for() -> None:
    m = Members({r: h((r, 1)) for r in range(2)})
    c = Coordinator([0, 1], own_only, m.gather, Book(), retry_s=0.01, faults=lambda *_: "",
                    probe_s=PROBE)
    threading.Timer(PROBE + 0.5, lambda: c.decide_for(1, "rid", 10.0)).start()
    assert c.decide_for(0, "rid", 10.0).step == 1


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


def test_a_decision_keeps_its_run_and_loss_across_a_restart(tmp_path: Path) -> None:
    book = Book(tmp_path / "book.json")
    book.record(7, {"r"}, 1.0, members=[0, 1], run="abc")
    book.record(-1, {"s"}, 2.0, members=[0, 1], lost="step 9: gone")
    again = Book(tmp_path / "book.json")
    assert again.find("r") is not None and again.find("r").run == "abc"  # type: ignore[union-attr]
    assert again.find("s").lost == "step 9: gone"  # type: ignore[union-attr]


def test_records_keep_their_membership_across_a_restart(tmp_path: Path) -> None:
    book = Book(tmp_path / "book.json")
    book.record(3, {"a"}, 1.0, members=[0, 1])
    again = Book(tmp_path / "book.json")
    assert again.find("a") == EpochRecord(1, 3, 1.0, frozenset({"a"}), (0, 1))


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

            def unreachable() -> float:
                return node.metrics.registry.get_sample_value(
                    "mtc_failures_total", {"kind": "coordinator_unreachable"}) or 0.0

            deadline = time.monotonic() + 10
            while unreachable() < 2:  # asking, failing, asking again, failing again
                assert time.monotonic() < deadline and not old.done(), old
                time.sleep(0.01)
            assert not old.done()
            t0 = time.monotonic()
            new = pool.submit(node.agreement.agree_epoch, 1.5, "new-restore")
            with pytest.raises(AgreementError, match="a newer restore on this host") as e:
                old.result(timeout=5.0)
            assert time.monotonic() - t0 < 2.0  # at its next try, not at its deadline
            assert e.value.host == 1
            with pytest.raises(AgreementError, match=rf"no restore decision within .*the "
                               rf"coordinator, rank 0's replicator at 127.0.0.1:{port}, "
                               rf"does not answer"):
                new.result(timeout=10.0)  # the newer one runs to its own deadline
    finally:
        node.stop()


def test_a_member_whose_earlier_ask_lapsed_is_named_not_a_bare_could_not_decide() -> None:
    """A clean-clone run under load: a partial partition's restore failed with "the
    coordinator could not decide" (host 2), naming nobody. The cut-off member's ask
    of the restore before had reached the coordinator in the moment the network
    healed, and lapsed: asked lately, so never named as absent."""
    m = Members({r: h((r, 1)) for r in range(4)})
    c = coordinator(m)
    with pytest.raises(AgreementError):
        c.decide_for(3, "before", 0.2)  # its last ask, ending before the next restore
    errs = ask_all(c, [0, 1, 2], "next", timeout=1.0)
    assert all(isinstance(e, AgreementError) for e in errs), errs
    for e in errs:
        assert "no restore request from rank(s) [3] since their last ended" in str(e), e
        assert e.host == 3, e  # type: ignore[union-attr]
