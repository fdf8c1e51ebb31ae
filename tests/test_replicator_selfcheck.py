"""What a replicator checks of itself and what a manager checks of its replicator,
as pure functions: configurations that disagree, replication that is late, a
replicator that serves another folder or is another rank, and errors that cross
gRPC naming their step, host and file once."""

from __future__ import annotations

import re
import threading

import pytest

from mtc.errors import AgreementError
from mtc.grpc_errors import where_of, wire_error
from mtc.manifest import Manifest
from mtc.proto import replicator_pb2 as pb
from mtc.replicator_watch import Seen, mismatch
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.selfcheck import (
    PeerReach,
    ReplicationClock,
    check_peers,
    disagreement,
)

NODES = ("a:1", "b:1", "c:1", "d:1")
ME = ReplicatorConfig(rank=0, nodes=NODES, nodes_per_slice=2)


def ident(rank: int, nodes: tuple[str, ...] = NODES, per_slice: int = 2, root_id: str = ""
          ) -> pb.Inventory:
    return pb.Inventory(rank=rank, root_id=root_id,
                        config=pb.NodeConfig(nodes=nodes, nodes_per_slice=per_slice))


@pytest.mark.parametrize(("peer", "reply", "want"), [
    (1, ident(1), ""),
    (1, pb.Inventory(rank=1), ""),  # an older replicator cannot say: no verdict
    (2, ident(1), r"the node at c:1 \(rank 2 in this node's --nodes\) says it is rank 1"),
    (1, ident(1, ("b:1", "x:1", "c:1", "d:1")), ""),  # its own view of the addresses
    (1, ident(1, ("a:1", "b:1")), "rank 1's --nodes lists 2 nodes, this node's 4"),
    (3, ident(3, per_slice=1), "rank 3's --nodes-per-slice is 1, this node's 2"),
])
def test_a_peer_whose_flags_disagree_is_named(peer: int, reply: pb.Inventory, want: str) -> None:
    got = disagreement(ME, peer, reply)
    if want:
        assert got and re.search(want, got), got
    else:
        assert got == ""


def test_every_peer_is_asked_until_it_answers_and_each_disagreement_reported() -> None:
    answers = {1: [None, ident(1)], 2: [ident(2, per_slice=1)], 3: [None, None, ident(3)]}
    asked: list[int] = []
    reported: list[str] = []

    def ask(peer: int) -> pb.Inventory | None:
        asked.append(peer)
        return answers[peer].pop(0)

    stop = threading.Event()
    import mtc.sidecar.replicator.selfcheck as selfcheck

    old, selfcheck.RETRY_S = selfcheck.RETRY_S, 0.0
    try:
        check_peers(ME, ask, reported.append, stop)
    finally:
        selfcheck.RETRY_S = old
    assert sorted(asked) == [1, 1, 2, 3, 3, 3]  # never itself; each until it answered
    assert len(reported) == 1 and "rank 2's --nodes-per-slice is 1" in reported[0]


def test_replication_is_late_from_the_first_step_left_behind_until_the_newest_is_copied() -> None:
    now = [0.0]
    clock = ReplicationClock(warn_s=10.0, clock=lambda: now[0])
    clock.update(5, replicated=True)
    assert clock.state() == (-1, 0.0, False)
    clock.update(10, replicated=False)
    now[0] = 6.0
    clock.update(15, replicated=False)  # a newer step: the clock keeps running
    assert clock.state() == (15, 6.0, False) and clock.warn_once() == ""
    now[0] = 11.0
    assert clock.state() == (15, 11.0, True)
    assert "step 15 is not on every peer: this host's steps have not reached them for 11s" \
        in clock.warn_once()
    assert clock.warn_once() == ""  # once per step
    clock.update(15, replicated=True)
    assert clock.state() == (-1, 0.0, False)


@pytest.mark.parametrize(("seen", "root_id", "subdirs", "want"), [
    (Seen(0, "a:1", 0, ident(0, root_id="r1")), "r1", False, ""),
    (Seen(0, "a:1", 0, None, "refused"), "r1", False, ""),  # down: a warning, not this
    (Seen(0, "a:1", 0, pb.Inventory(rank=0)), "r1", False, ""),  # too old to say
    (Seen(1, "b:1", 2, ident(1, root_id="r1")), "r1", False,
     r"host 1's replicator at b:1 is rank 1, the job states rank 2"),
    (Seen(0, "a:1", 0, ident(0, root_id="")), "r1", True,
     r"host 0's steps are saved in /dev/shm/x/host-0, but its replicator at a:1 \(rank 0\) "
     r"serves another folder \(no manager writes there\): start it with --local-dir "
     r"/dev/shm/x/host-0, or if it serves the folder above it, set "
     r"Options\(host_subdirs=False\)"),
    (Seen(0, "a:1", 0, ident(0, root_id="r2")), "r1", False,
     r"a different RAM disk.*a host-<i> folder beside it, set Options\(host_subdirs=True\)"),
])
def test_a_replicator_of_another_rank_or_folder_is_told_apart_at_start(
        seen: Seen, root_id: str, subdirs: bool, want: str) -> None:
    got = mismatch(seen, "/dev/shm/x/host-0", root_id, subdirs)
    if want:
        assert re.search(want, got), got
    else:
        assert got == ""


def test_an_error_crosses_grpc_as_its_bare_message_and_where() -> None:
    e = AgreementError("cannot decide", step=5, host=1, path="a/b")
    message, where = wire_error(e)
    assert message == "cannot decide" and "(host" not in message
    assert where_of(where) == {"step": 5, "host": 1, "path": "a/b"}
    assert wire_error(ValueError("bad")) == ("bad", ())
    # Whatever the network sends that does not parse is dropped, never raised.
    assert where_of([("x-mtc-error-host", "one"), ("x-mtc-error-step", "9" * 40),
                     ("x-other", "1"), ("x-mtc-error-path-bin", b"p" * 10_000), "junk"]) == {}
    # Any file name crosses (as bytes): gRPC refuses other characters in a text value.
    assert where_of(wire_error(AgreementError("x", path="caf\u00e9\n"))[1]) == {
        "path": "caf\u00e9\n"}
    assert where_of(None) == {} and where_of(7) == {}


def test_manifests_name_the_saving_hosts_ranks_only_when_they_are_not_0_to_n() -> None:
    m = Manifest(step=4, host=0, slice=0, num_hosts=2, leaves=(), run="r", ranks=(2, 3))
    again = Manifest.from_bytes(m.to_bytes())
    assert again.ranks == (2, 3) and again.rank_of(1) == 3
    assert Manifest.summary_of(m.to_bytes()) == (2, "r", (2, 3), 0, m.step, len(m.to_bytes()))
    plain = Manifest(step=4, host=1, slice=0, num_hosts=2, leaves=())
    assert b"ranks" not in plain.to_bytes()
    assert Manifest.from_bytes(plain.to_bytes()).rank_of(1) == 1
    with pytest.raises(ValueError, match="are not 2 distinct ranks"):
        Manifest(step=4, host=0, slice=0, num_hosts=2, leaves=(), ranks=(2, 2)).to_bytes()


def test_a_peer_unanswered_beyond_the_grace_is_a_fault_until_it_answers() -> None:
    now = [0.0]
    reach = PeerReach(clock=lambda: now[0])
    reach.failed(1, "refused")
    now[0] = 2.0
    reach.failed(1, "refused again")  # the clock runs from the first unanswered ask
    reach.failed(2, "timeout")
    assert reach.faults(grace_s=3.0) == []  # a peer starting a moment late is no fault
    now[0] = 3.5
    assert reach.faults(grace_s=3.0) == [(1, 3.5, "refused again")]
    reach.answered(1)
    now[0] = 5.5
    assert reach.faults(grace_s=3.0) == [(2, 3.5, "timeout")]
