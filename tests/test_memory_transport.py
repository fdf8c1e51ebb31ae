"""The replicator's logic over the in-memory transport (``memory_transport.py``): no
socket, no process. Whole replicators (``Node``) in one process reach each other
through the transport seam (``transport.py``); the tests run a copy (offer, link,
push, commit, abort), the restore agreement and a replaced host's fetch through it,
with faults (a dropped call, a delay, a partition), and wait on the network's
counters and the calls' outcomes, never on time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import pytest

from mtc.errors import AgreementError
from mtc.grpc_errors import PeerError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.memory_cluster import MemoryCluster as Cluster
from mtc.sidecar.replicator.memory_cluster import at_once, commit_mtc_step
from mtc.sidecar.replicator.memory_transport import MemoryPeer, Network
from mtc.sidecar.replicator.transport import Peer

T = TypeVar("T")


@pytest.fixture
def cluster(memory_cluster: Callable[..., Cluster]) -> Callable[..., Cluster]:
    """Clusters whose nodes are served but run no thread of their own: each test
    drives the copy, the agreement or the fetch by hand and counts its calls."""
    return lambda n, **config: memory_cluster(n, run=False, **config)


def save(c: Cluster, rank: int, step: int, *, num_hosts: int | None = None) -> dict[str, bytes]:
    """Commit host ``rank``'s step as mtc's sidecar does; its files."""
    files = {f"shard.{rank}": bytes([rank, step % 256]) * 4096,
             "shared": b"data-parallel" * 512}
    return commit_mtc_step(c.root(rank), step, files, host=rank, num_hosts=num_hosts or c.n)


def test_memory_peers_are_the_transports_peers() -> None:
    peer: Peer = MemoryPeer(Network(), 0, 1)  # typed: the seam's protocol, structurally
    assert peer.rank == 1


# -- a copy ---------------------------------------------------------------------------

@pytest.mark.parametrize("data_path", [False, True], ids=["batches", "one-stream"])
def test_a_copy_is_offered_pushed_and_committed_verified(
        cluster: Callable[..., Cluster], data_path: bool) -> None:
    c = cluster(2)
    if data_path:  # the target names a data path: the push goes as one stream
        c.nodes[1].receiver.data_port = lambda: 1
    files = save(c, 0, 5)
    c.nodes[0].replication.push_step(5, 1)
    assert (0, 5) in c.nodes[1].store.copies()
    assert c.nodes[1].store.verify(0, 5) == []
    held = c.nodes[1].store.copy_dir(0, 5)
    assert (held / "shard.0").read_bytes() == files["shard.0"]
    assert c.net.calls[("Offer", 0, 1)] == 1 and c.net.calls[("Commit", 0, 1)] == 1
    assert c.net.calls[("Push", 0, 1)] >= 1
    # Offered again: the target holds this very copy, nothing is pushed.
    pushes = c.net.calls[("Push", 0, 1)]
    c.nodes[0].replication.push_step(5, 1)
    assert c.net.calls[("Push", 0, 1)] == pushes


def test_a_file_the_target_holds_identical_is_linked_not_pushed(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(2)
    save(c, 0, 5)
    save(c, 1, 5)  # the same "shared" file (path, size, CRC32C): a data-parallel twin
    c.nodes[0].replication.push_step(5, 1)
    assert c.net.calls[("Link", 0, 1)] == 1
    assert c.nodes[1].metrics.deduplicated_files._value.get() >= 1
    shared = c.nodes[1].store.copy_dir(0, 5) / "shared"
    own = c.nodes[1].store.root / "5" / "shared"
    assert shared.stat().st_ino == own.stat().st_ino  # one inode: a claim, not a copy


def test_a_lost_commit_aborts_the_push_and_the_target_holds_nothing(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(2)
    save(c, 0, 5)
    c.net.drop("Commit", src=0, dst=1, times=3)  # every attempt of one commit
    with pytest.raises(PeerError) as e:
        c.nodes[0].replication.push_step(5, 1)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and e.value.unreachable
    assert c.net.dropped[("Commit", 0, 1)] == 3
    assert c.net.calls[("Abort", 0, 1)] == 1  # the transfer dropped at once, not expired
    assert (0, 5) not in c.nodes[1].store.copies()
    assert c.nodes[1].receiver.incoming() == set()
    c.nodes[0].replication.push_step(5, 1)  # the fault gone: the next pass copies it
    assert (0, 5) in c.nodes[1].store.copies()


def test_a_partitioned_target_is_unreachable_and_sent_nothing(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(2)
    save(c, 0, 5)
    c.net.partition({0}, {1})
    with pytest.raises(PeerError) as e:
        c.nodes[0].replication.push_step(5, 1)
    assert e.value.unreachable
    assert c.net.calls[("Offer", 0, 1)] == 0 and c.net.dropped[("Offer", 0, 1)] >= 1
    c.net.heal()
    c.nodes[0].replication.push_step(5, 1)
    assert (0, 5) in c.nodes[1].store.copies()


def test_a_copy_refused_by_the_target_comes_back_with_its_status(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(2)
    peer = c.net.peers(0, 2)[1]
    with pytest.raises(PeerError) as e:
        peer.commit("no-such-transfer")
    assert e.value.code == grpc.StatusCode.NOT_FOUND  # as the gRPC servicer answers it
    assert not e.value.unreachable


def test_a_call_delayed_past_its_deadline_fails_deadline_exceeded(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(2)
    c.net.delay(5.0, "GetInventory", dst=1)
    peer = c.net.peers(0, 2)[1]
    t0 = time.monotonic()
    with pytest.raises(PeerError) as e:
        peer.inventory(pb.InventoryRequest(rank_only=True), deadline_s=0.3, attempts=1)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 4.0  # failed at its deadline, not after the delay
    c.net.heal()
    assert peer.inventory(pb.InventoryRequest(rank_only=True), deadline_s=1.0).rank == 1


# -- the restore agreement ------------------------------------------------------------

def test_every_member_reads_one_decision_and_newer_steps_are_fenced(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(3)
    for r in range(3):
        save(c, r, 3)
    save(c, 0, 4)
    save(c, 1, 4)  # rank 2 never finished step 4: step 3 is the newest complete
    decisions = at_once(*[lambda r=r: c.nodes[r].agreement.agree_epoch(5.0, "restore-1")
                          for r in range(3)])
    assert {(d.epoch, d.step) for d in decisions} == {(decisions[0].epoch, 3)}
    for r in range(3):
        assert all(s <= 3 for _, s in c.nodes[r].store.copies()), r
    assert c.net.calls[("Decide", 1, 0)] >= 1 and c.net.calls[("Decide", 2, 0)] >= 1


def test_a_partitioned_member_fails_every_restore_typed_and_a_heal_lets_them_decide(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(3, agreement_timeout_s=1.5)
    for r in range(3):
        save(c, r, 3)
    c.net.partition({0, 1}, {2})
    outcomes = at_once(*[lambda r=r: _outcome(lambda: c.nodes[r].agreement.agree_epoch(
        1.5, "restore-1")) for r in range(3)])
    assert all(isinstance(o, AgreementError) for o in outcomes), outcomes
    assert "2" in str(outcomes[0])  # the coordinator names the member missing
    c.net.heal()
    decisions = at_once(*[lambda r=r: c.nodes[r].agreement.agree_epoch(5.0, "restore-2")
                          for r in range(3)])
    assert {d.step for d in decisions} == {3}
    assert len({d.epoch for d in decisions}) == 1


def _outcome(fn: Callable[[], T]) -> T | AgreementError:
    try:
        return fn()
    except AgreementError as e:  # the test compares what each member got
        return e


# -- a fetch -----------------------------------------------------------------------------

def test_a_replaced_host_restores_its_step_from_its_peers_copy(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(2)
    files = save(c, 0, 5)
    save(c, 1, 5)
    c.nodes[0].replication.push_step(5, 1)
    c.nodes[1].replication.push_step(5, 0)
    new = c.replace_host(0)  # host 0 replaced: its RAM disk empty
    assert new.store.copies() == []
    results = at_once(*[lambda r=r: c.nodes[r].restorer.prepare_restore_as(5.0, "restore-1")
                        for r in range(2)])
    (d0, tier0, _, pending0), (d1, tier1, _, _) = results
    assert d0.step == d1.step == 5 and d0.epoch == d1.epoch
    assert (tier0, pending0) == ("peer", False) and tier1 == "local"
    for name, data in files.items():
        assert (new.store.root / "5" / name).read_bytes() == data
    assert c.net.calls[("Fetch", 0, 1)] >= 1


def test_a_commit_whose_answer_is_lost_leaves_the_copy_held_and_offered_again_complete(
        cluster: Callable[..., Cluster]) -> None:
    """The commit ran, its answer never came: the origin's retry finds no transfer
    (one commit per transfer), its push fails; the target holds the copy, verified,
    and the next offer of it is answered complete, nothing pushed again."""
    c = cluster(2)
    save(c, 0, 5)
    c.net.lose_answers("Commit", src=0, dst=1)
    with pytest.raises(PeerError) as e:
        c.nodes[0].replication.push_step(5, 1)
    assert e.value.code == grpc.StatusCode.NOT_FOUND  # the retried commit: none open
    assert c.net.dropped[("Commit", 0, 1)] == 1
    assert (0, 5) in c.nodes[1].store.copies() and c.nodes[1].store.verify(0, 5) == []
    pushes = c.net.calls[("Push", 0, 1)]
    c.nodes[0].replication.push_step(5, 1)
    assert c.net.calls[("Push", 0, 1)] == pushes  # offered: already complete
    assert c.nodes[0].replication.fully_replicated(5)
