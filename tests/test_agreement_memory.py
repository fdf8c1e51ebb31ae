"""The restore agreement between whole replicators in one process (the in-memory
cluster, ``sidecar/replicator/memory_cluster.py``): sixteen members through one
decision, a member that asks late waited for across Decide calls, and a member
whose ``--nodes`` is wrong named to every asker within seconds.

What needs processes stays in ``tests/test_agreement_procs.py`` (a replicator
SIGKILLed or SIGTERMed during a restore, a stalled one's health, Orbax's file
protocol across a kill) and ``tests/test_replicator_faults.py`` (what the
controller's calls and ``mtc status`` say over gRPC).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mtc.errors import AgreementError, ConfigError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.agree import node_agreement
from mtc.sidecar.replicator.memory_cluster import MemoryCluster, at_once
from mtc.testing.waits import wait_until


def commit_everywhere(c: MemoryCluster, steps: tuple[int, ...]) -> None:
    for r in range(c.n):
        for s in steps:
            c.commit(r, s, {"x.bin": os.urandom(256)})


def test_sixteen_replicators_one_decision(tmp_path: Path) -> None:
    with MemoryCluster(tmp_path, 16, 8, start=False, poll_s=0.5) as c:
        for r in range(16):
            c.root(r).mkdir(parents=True)
        commit_everywhere(c, (3, 4))
        c.commit(5, 5, {"x.bin": b"only rank 5 has step 5"})
        c.start_all()
        replies = c.prepared(range(16), 60)
        assert {x.step for x in replies.values()} == {4}  # step 5 exists on rank 5 alone
        assert len({x.epoch for x in replies.values()}) == 1
        assert next(iter(replies.values())).epoch >= 1
        assert {x.tier for x in replies.values()} == {"local"}
        assert c.own_steps(5) == {3, 4}  # the newer step no other rank saved: fenced


def test_a_member_that_asks_late_is_waited_for_across_calls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 asks for a restore decision and rank 0 (the coordinator) only later
    than one Decide call lasts: rank 1's ask goes again, holding its place, and
    both restore the same step; a call's time running out is not counted as the
    coordinator being unreachable."""
    monkeypatch.setattr(node_agreement, "DECIDE_CALL_S", 0.5)  # calls end 10x as soon
    with MemoryCluster(tmp_path, 2) as c:
        for r in (0, 1):
            c.commit(r, 4, {f"x{r}.bin": b"x" * 4096})
        c.wait_held({(1, 0, 4), (0, 1, 4)})

        def early() -> dict[int, pb.PrepareRestoreReply]:
            return c.prepared([1], 30)

        def late() -> dict[int, pb.PrepareRestoreReply]:
            # Rank 1's first Decide call ran out and the ask went again.
            c.wait_sample(1, "mtc_decide_calls_total", 2)
            return c.prepared([0], 30)

        first, second = at_once(early, late)
        assert (first[1].step, second[0].step) == (4, 4)
        assert first[1].epoch == second[0].epoch
        assert c.scrape(1)["mtc_decide_calls_total"] >= 2
        failures = {k: v for k, v in c.scrape(1).items() if k.startswith("mtc_failures_total")}
        assert "mtc_failures_total{kind=coordinator_unreachable}" not in failures, failures


def test_every_member_of_a_job_with_swapped_nodes_learns_the_fault_within_seconds(
        tmp_path: Path) -> None:
    """Only rank 2's ``nodes`` is wrong (ranks 0 and 1 swapped): it refuses, and never
    asks for the restore; the others would wait the whole agreement timeout for an
    AgreementError naming rank 2 without saying why. The coordinator asks a member
    that has not asked whether it refuses, and every asker gets ConfigError naming
    rank 2's disagreement."""
    with MemoryCluster(tmp_path, 4, 2, start=False, agreement_timeout_s=60.0) as c:
        for r in (0, 1, 3):
            c.start(r)
        swapped = ("memory:1", "memory:0", "memory:2", "memory:3")
        c.start(2, route={0: 1, 1: 0}, nodes=swapped)
        said = "(rank 0 in this node's --nodes) says it is rank 1"
        wait_until("rank 2 sees the disagreement with the node at its place 0",
                   lambda: said in c.nodes[2].shown.identity().config_error)

        t0 = time.monotonic()
        answers = c.prepare(range(4), 60)
        took = time.monotonic() - t0
        for rank, err in answers.items():
            assert isinstance(err, ConfigError), (rank, err)
            assert said in str(err), (rank, err)
            if rank != 2:  # the others name whose configuration is wrong
                assert "rank 2's replicator refuses" in str(err), (rank, err)
        assert took < 15, took  # seconds, not the 60 s agreement timeout


def test_a_member_down_fails_every_asker_typed_within_the_agreement_timeout(
        tmp_path: Path) -> None:
    with MemoryCluster(tmp_path, 2, agreement_timeout_s=2.0) as c:
        commit_everywhere(c, (1,))
        c.kill(1)
        t0 = time.monotonic()
        (err,) = c.prepare([0], 60).values()
        assert time.monotonic() - t0 < 2.0 + 8
        assert isinstance(err, AgreementError), err
        assert "rank(s) [1]" in str(err), err


def test_an_ask_a_newer_restore_replaced_never_fences_a_step_saved_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 (the coordinator) asks for restore A; the job asks again (restore B)
    on both ranks, which agree on step 4, and then saves step 5 on both. A's ask is
    answered only after that, with B's epoch under A's restore id, as a failed
    restore's ask was in test_network_faults (where it then fenced, deleting the
    step the controller had just saved; the answer is played here, the coordinator
    refusing a replaced ask itself). Rank 0 must not fence again on it: its restore
    was replaced, and it says so."""
    saved = threading.Event()
    with MemoryCluster(tmp_path, 2) as c:
        agreement = c.nodes[0].agreement
        real = agreement.decide_for

        def b_epoch_late_for_a(rank: int, rid: str, *args: Any, **kwargs: Any
                               ) -> pb.Decision:
            if not rid.endswith("restore-a"):
                return real(rank, rid, *args, **kwargs)
            assert saved.wait(30)
            d = agreement.last_decision  # B's
            return pb.Decision(epoch=d.epoch, step=d.step, decided_at=d.decided_at,
                               rank=rank, restore_id=rid, run=d.run)
        monkeypatch.setattr(agreement, "decide_for", b_epoch_late_for_a)
        commit_everywhere(c, (4,))
        c.wait_held({(1, 0, 4), (0, 1, 4)})

        def stale() -> pb.PrepareRestoreReply | Exception:
            return c.prepare([0], 6, rid="restore-a")[0]

        def newer_then_save() -> dict[int, pb.PrepareRestoreReply]:
            c.wait_sample(0, "mtc_restores_waiting", 1)  # A's ask is waiting on rank 0
            replies = c.prepared([0, 1], 30, rid="restore-b")
            commit_everywhere(c, (5,))
            saved.set()
            return replies

        a, b = at_once(stale, newer_then_save)
        assert {x.step for x in b.values()} == {4}
        assert {4, 5} <= c.own_steps(0) and {4, 5} <= c.own_steps(1)
        assert isinstance(a, AgreementError) and "newer restore" in str(a), a
