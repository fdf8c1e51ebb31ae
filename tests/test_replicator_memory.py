"""The replicator's logic with whole replicators in one process (the in-memory
cluster, ``sidecar/replicator/memory_cluster.py``): replication verified and
deduplicated, restore after host loss, an unreachable peer, garbage collection.

Each host is a replicator with every service running (its loop, GC, the
agreement), a RAM disk of its own, its peers reached only through the in-memory
transport. The test plays the hosts (commits steps, wipes a root, kills a node)
and waits on what the nodes count. What needs real processes (a controller saving
and restoring through the hosts' sidecars, the metrics' HTTP endpoint) stays in
``tests/test_replicator.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import grpc
import pytest

from mtc.errors import AgreementError
from mtc.grpc_errors import to_status
from mtc.manifest import MANIFEST_NAME, Manifest
from mtc.sidecar.replicator.copies import replication
from mtc.sidecar.replicator.copies.replication import COPIES_AGAIN_MAX
from mtc.sidecar.replicator.memory_cluster import MemoryCluster, copies_of, files_of
from mtc.testing.waits import wait_until

Make = Callable[..., MemoryCluster]


@pytest.fixture(autouse=True)
def _quick_resync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Targets' holdings re-read every 0.2 s, not every 2 s (the pace, not a rule:
    a copy a replaced host lost comes back within a resync)."""
    monkeypatch.setattr(replication, "RESYNC_S", 0.2)


@pytest.fixture
def cluster(memory_cluster: Make) -> Make:
    return memory_cluster


def commit_state(c: MemoryCluster, step: int, scale: int) -> dict[int, dict[str, bytes]]:
    """Every host's files of ``step``: a data-parallel shard identical on the hosts of
    one in-slice index (each slice holds the same), and shards unique to each host."""
    out = {}
    for r in range(c.n):
        dp = bytes([r % c.per_slice, scale]) * 32768
        out[r] = c.commit(r, step, {f"dp-{r % c.per_slice}.bin": dp,
                                    f"own-{r}-a.bin": os.urandom(16384),
                                    f"own-{r}-b.bin": os.urandom(16384)})
    return out


# -- replication --------------------------------------------------------------------


def test_replication_verified_and_deduplicated(cluster: Make) -> None:
    # Saved before the replicators start, so every host's own step is there when
    # its peer's copy is offered: the data-parallel shards can only be linked.
    c = cluster(4, 2, start=False)
    for r in range(4):
        c.root(r).mkdir(parents=True)
    commit_state(c, 1, 1)
    c.start_all()
    c.wait_replicated(1)

    for origin in range(4):
        holder = (origin + 2) % 4
        src = c.root(origin) / "1"
        replica = c.root(holder) / ".mtc-replica" / str(origin) / "1"
        # The inventory lists the copy with the origin's manifest sizes and checksums.
        (copy,) = [x for x in c.inventory(holder).copies
                   if x.origin_rank == origin and x.step == 1]
        manifest = Manifest.from_bytes((src / MANIFEST_NAME).read_bytes())
        listed = {f.path: (f.size, f.crc32c) for f in copy.files}
        assert {p: v for p, v in listed.items() if p != MANIFEST_NAME} == {
            e.file: (e.nbytes, e.crc32c) for e in manifest.files.values()}
        assert files_of(replica) == files_of(src)  # byte for byte

        # Dedup: the data-parallel shard the holder saved itself is a claim on its
        # own file (one inode), the host-unique ones were pushed.
        own = {p.name: p for p in (c.root(holder) / "1").iterdir()}
        linked = pushed = 0
        for f in replica.iterdir():
            twin = own.get(f.name)
            if f.name != MANIFEST_NAME and twin is not None and \
                    twin.read_bytes() == f.read_bytes():
                assert f.stat().st_ino == twin.stat().st_ino, f
                linked += 1
            else:
                assert f.stat().st_nlink == 1, f
                pushed += 1
        assert linked >= 1 and pushed >= 2, (linked, pushed)

    for rank in range(4):
        m = c.scrape(rank)
        assert m["mtc_deduplicated_files_total"] >= 1
        # Only the host-unique shards and the manifest crossed: the data-parallel
        # half of the step did not.
        step_bytes = sum(p.stat().st_size for p in (c.root((rank + 2) % 4) / "1").iterdir())
        assert 0 < m["mtc_replicated_bytes_received_total"] < 0.75 * step_bytes
        assert m["mtc_replicated_bytes_sent_total"] > 0
        assert m["mtc_newest_step{state=committed}"] == 1
        assert m["mtc_newest_step{state=replicated}"] == 1
        assert m["mtc_replication_lag_steps"] == 0


# -- restore after host loss ------------------------------------------------------


def test_restore_after_host_loss(cluster: Make) -> None:
    c = cluster(4, 2)
    commit_state(c, 1, 1)
    saved = commit_state(c, 2, 2)
    c.wait_replicated(2)

    c.replace_host(1)
    assert not (c.root(1) / "2").exists()
    replies = c.prepared([0, 1, 2, 3])
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {
        0: (2, "local"), 1: (2, "peer"), 2: (2, "local"), 3: (2, "local")}
    assert len({x.epoch for x in replies.values()}) == 1
    assert files_of(c.root(1) / "2") == saved[1]
    # Redundancy comes back without a new save: host 3's copy on the replaced
    # host 1 was lost with it, and host 3 pushes it again.
    c.wait_held({(1, 3, 2), (3, 1, 2)})


@pytest.mark.parametrize("lost", [(0, 3), (0, 1)], ids=["other-slices", "one-slice"])
def test_two_hosts_lost_restore_from_their_peers(cluster: Make, lost: tuple[int, int]) -> None:
    """Two hosts lost at once: each one's data survives on its peer in the other
    slice, and both restore it from there; redundancy comes back after."""
    c = cluster(4, 2)
    commit_state(c, 2, 2)
    saved = commit_state(c, 3, 3)
    c.wait_replicated(3)
    for r in lost:
        c.lose_host(r)
    for r in lost:
        c.start(r)
    replies = c.prepared(range(4))
    assert {x.step for x in replies.values()} == {3}
    assert {r for r, x in replies.items() if x.tier == "peer"} == set(lost)
    for r in lost:
        assert files_of(c.root(r) / "3") == saved[r]
    c.wait_replicated(3)


# -- an unreachable peer ------------------------------------------------------------


def test_peer_unreachable_then_back(cluster: Make) -> None:
    c = cluster(4, 2)
    commit_state(c, 1, 1)
    c.wait_replicated(1)

    c.kill(2)  # host 0's peer, not restarted for now
    for r in (0, 1, 3):
        c.commit(r, 2, {f"own-{r}.bin": os.urandom(4096)})
    # Hosts 1 and 3 are unaffected.
    c.wait_held({(3, 1, 2), (1, 3, 2)})
    c.wait_sample(0, "mtc_failures_total{kind=peer_unreachable}", 2)
    m0 = c.scrape(0)
    assert m0["mtc_newest_step{state=committed}"] == 2
    assert m0["mtc_newest_step{state=replicated}"] == 1
    assert m0["mtc_replication_lag_steps"] == 1
    assert (0, 2, 2) not in c.held()

    # A restore with host 2 down cannot be decided safely (host 2 may hold data
    # nobody else has): every asker gets the typed "cannot decide" (ABORTED) within
    # its deadline, and no host restores anything.
    t0 = time.monotonic()
    errors = c.prepare([0, 1, 3], 2.0)
    assert time.monotonic() - t0 < 2.0 + 8
    for e in errors.values():
        assert isinstance(e, AgreementError) and to_status(e) == grpc.StatusCode.ABORTED, e
        assert "rank(s) [2]" in str(e), e

    # Back: replication completes in both directions, within a resync or two.
    t0 = time.monotonic()
    c.start(2)
    c.commit(2, 2, {"own-2.bin": os.urandom(4096)})
    c.wait_held({(2, 0, 2), (0, 2, 2)})
    assert time.monotonic() - t0 < 10  # reconnect backoff stays short
    wait_until("rank 0's newest replicated step 2",
               lambda: c.scrape(0)["mtc_newest_step{state=replicated}"] == 2, 10)
    assert c.scrape(0)["mtc_replication_lag_steps"] == 0
    # With every member back, the same restore succeeds, on the newest step.
    replies = c.prepared(range(4), rid="restore-2")
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {
        r: (2, "local") for r in range(4)}
    assert len({x.epoch for x in replies.values()}) == 1


# -- garbage collection ----------------------------------------------------------------


def test_gc_keeps_newest_fully_replicated_step(cluster: Make) -> None:
    c = cluster(2, keep=2)
    c.commit(0, 1, {"x.bin": os.urandom(4096)})
    c.commit(1, 1, {"y.bin": os.urandom(4096)})
    c.wait_held({(1, 0, 1), (0, 1, 1)})

    c.kill(1)  # the only peer: nothing newer gets fully replicated
    for step in (2, 3, 4, 5):
        c.commit(0, step, {"x.bin": os.urandom(4096)})
        c.wait_passes(0, more=1)
    # The newest 2 plus step 1, the newest fully replicated one.
    wait_until("rank 0 keeping steps 1, 4, 5", lambda: c.own_steps(0) == {1, 4, 5},
               detail=lambda: c.own_steps(0))
    c.wait_passes(0, more=3)  # GC passes later, still there
    assert c.own_steps(0) == {1, 4, 5}

    # The origin's replicator restarting while its peer is still down must not
    # forget which step is the newest replicated one.
    c.kill(0)
    c.start(0)
    c.wait_passes(0)  # a whole pass, GC included, of the new node
    assert 1 in c.own_steps(0)

    # The peer returns: step 5 is replicated, but step 1 is still the newest
    # step that every rank can be restored from (rank 1 has nothing newer).
    c.start(1)
    c.wait_held({(1, 0, 5)})
    c.wait_passes(0, more=3)  # GC passes that saw step 5 on the peer
    assert 1 in c.own_steps(0)
    # Once rank 1 commits step 5 as well, step 5 is complete and step 1 goes.
    c.commit(1, 5, {"y.bin": os.urandom(4096)})
    c.wait_held({(0, 1, 5)})
    wait_until("rank 0 keeping steps 4, 5", lambda: c.own_steps(0) == {4, 5},
               detail=lambda: c.own_steps(0))
    # The peer keeps at most ``keep`` copies per origin: the origin's two (step 4,
    # skipped while the peer was down, pushed once step 5 was on it), step 1 gone.
    wait_until("rank 1 holding rank 0's steps 4 and 5", lambda: copies_of(c, 1, 0) == {4, 5},
               during=lambda: _at_most(copies_of(c, 1, 0), 3),
               detail=lambda: copies_of(c, 1, 0))
    # Step 4 never reached the peer before: late, not a lost copy pushed again.
    got = c.scrape(0)
    assert got.get("mtc_steps_copied_again_total{why=late}") == 1, got
    assert got.get("mtc_steps_copied_again_total{why=lost}", 0) == 0, got


def _at_most(held: set[int], n: int) -> None:
    assert len(held) <= n, held


def test_an_older_step_a_peer_keeps_deleting_is_pushed_again_a_bounded_number_of_times(
        cluster: Make) -> None:
    """Rank 1 keeps one copy per origin (another ``keep`` than rank 0's two): rank 0's
    older step, pushed to it once the newest is there, is deleted again each time.
    Rank 0 stops pushing it after COPIES_AGAIN_MAX times instead of for ever."""
    c = cluster(2, rank_config={0: {"keep": 2}, 1: {"keep": 1}}, start=False)
    for r in (0, 1):
        c.root(r).mkdir(parents=True)
    for step in (1, 2):
        c.commit(1, step, {"y.bin": os.urandom(4096)})  # complete on both ranks
        c.commit(0, step, {"x.bin": os.urandom(4096)})
    c.start_all()
    c.wait_held({(1, 0, 2), (0, 1, 2)})

    def pushes() -> dict[str, float]:  # older steps pushed, by why: "lost", "late"
        prefix = "mtc_steps_copied_again_total{why="
        return {k[len(prefix):-1]: v for k, v in c.scrape(0).items() if k.startswith(prefix)}

    wait_until(f"{COPIES_AGAIN_MAX} older steps pushed again",
               lambda: sum(pushes().values()) >= COPIES_AGAIN_MAX)
    # Were it unbounded, a resync would push it again: rank 0's loop passes through
    # three resyncs' time, and once more after it.
    end = time.monotonic() + 3 * replication.RESYNC_S
    while time.monotonic() < end:
        c.wait_passes(0)
    c.wait_passes(0)
    got = pushes()
    assert sum(got.values()) == COPIES_AGAIN_MAX, got
    assert got.get("lost", 0) >= COPIES_AGAIN_MAX - 1, got
    assert copies_of(c, 1, 0) <= {1, 2}


def test_gc_keeps_the_newest_step_every_rank_can_restore(cluster: Make) -> None:
    """A host whose newer step failed elsewhere must not delete the last complete one."""
    c = cluster(2, keep=1)
    for step in (1, 2):
        c.commit(0, step, {"x.bin": os.urandom(4096)})
        c.commit(1, step, {"y.bin": os.urandom(4096)})
    c.wait_held({(1, 0, 2), (0, 1, 2)})
    # Rank 0 commits and replicates step 3; rank 1 never commits it (it crashed).
    c.commit(0, 3, {"x.bin": os.urandom(4096)})
    c.wait_held({(1, 0, 3)})
    c.wait_passes(0, more=3)  # GC passes with keep 1 that saw step 3 on the peer
    assert 2 in c.own_steps(0), "the newest step complete on every rank was deleted"
    # A restore asks every member (agreement needs them all): step 2 everywhere.
    replies = c.prepared([0, 1], 20)
    assert {r: x.step for r, x in replies.items()} == {0: 2, 1: 2}


def test_gc_keeps_the_newest_step_that_survives_losing_the_host_whose_copy_lags(
        cluster: Make) -> None:
    """Rank 1 cannot reach rank 0 (a one-way fault: rank 0 reaches rank 1), so its
    step 3 stays on host 1 alone while rank 0's step 3 reaches host 1. Step 3 is
    complete, and rank 0's own rules (keep 1, its newest replicated step 3) would
    delete its step 2. Host 1 is then lost: its step 3 with it, and rank 0's step 2
    must still be there, or no step is restorable at all."""
    c = cluster(2, keep=1)
    saved = {}
    for step in (1, 2):
        c.commit(0, step, {"x.bin": os.urandom(4096)})
        saved[step] = c.commit(1, step, {"y.bin": os.urandom(4096)})
    c.wait_held({(1, 0, 2), (0, 1, 2)})

    c.net.drop(src=1, dst=0, times=None)  # every call from rank 1 to rank 0 lost
    c.commit(1, 3, {"y.bin": os.urandom(4096)})
    c.commit(0, 3, {"x.bin": os.urandom(4096)})
    c.wait_held({(1, 0, 3)})
    c.wait_passes(0, more=3)  # GC passes with keep 1 that saw step 3 on the peer
    assert c.own_steps(0) == {2, 3}, "the newest step on two hosts was deleted"
    assert (0, 1, 3) not in c.held()  # rank 1's step 3 is on host 1 alone

    c.lose_host(1)  # with its step 3, before rank 1 could ever reach rank 0
    c.net.heal()
    c.start(1)  # the replaced host
    replies = c.prepared([0, 1], 20)
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {0: (2, "local"),
                                                                 1: (2, "peer")}
    assert (c.root(1) / "2" / "y.bin").read_bytes() == saved[2]["y.bin"]


def test_a_damaged_step_a_member_can_repair_is_not_given_up(cluster: Make) -> None:
    """Four slices of one host; hosts 0 and 2 saved one shard identically (a
    data-parallel replica's), each host its own other files. Host 0's file of it
    is found bad (moved aside) and its peer (host 1, which holds host 0's copy) is
    lost: no member holds host 0's step 7 complete, yet host 2's own file holds the
    missing bytes. The agreement counts the step as held, and host 0 restores it
    healed from that file, not the older step 6."""
    c = cluster(4)
    for step in (6, 7):
        dp = os.urandom(8192)
        for r in range(4):
            c.commit(r, step, {"dp.bin": dp if r in (0, 2) else os.urandom(8192),
                               f"own-{r}.bin": os.urandom(4096)})
        c.wait_replicated(step)
    victim = c.root(0) / "7" / "dp.bin"
    good = victim.read_bytes()
    victim.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    inv = c.inventory(0)  # found, quarantined: offered as damaged, with that file
    assert (0, 7) not in {(x.origin_rank, x.step) for x in inv.copies}
    assert [(d.step, [f.path for f in d.files]) for d in inv.damaged] == [(7, ["dp.bin"])]
    assert not victim.exists()
    c.kill(1)
    held = c.held()
    assert not any(o == 0 and s == 7 for _, o, s in held), held  # no complete copy left

    replies = c.prepared([0, 2, 3], 20, members=[0, 2, 3])
    assert {r: x.step for r, x in replies.items()} == {0: 7, 2: 7, 3: 7}, replies
    assert replies[0].tier == "peer"
    assert victim.read_bytes() == good
    assert (0, 7) in {(x.origin_rank, x.step) for x in c.inventory(0).copies}
    assert c.inventory(0).damaged == []


def test_a_target_that_never_answers_keeps_the_steps_bounded_and_is_named(
        cluster: Make) -> None:
    """Host 3's copy target (rank 1, its place 1) never answers: its replicator names
    it as a peer fault (what ``mtc status`` prints) within its grace, and keeps at
    most ``keep`` + ``keep_awaiting`` own steps (and the one committed since its
    last pass) however many the job saves, instead of every step until the RAM disk
    is full; the other hosts replicate and collect as ever. (The same on a real
    tmpfs, with 500 steps saved through the sidecars, the trainer's warning and
    ``mtc status``: ``tests/test_replicator_gc.py``.)"""
    keep, awaiting = 2, 2
    c = cluster(4, 2, keep=keep, keep_awaiting=awaiting, start=False)
    for r in (0, 1, 2):
        c.start(r)
    c.start(3, route={1: 99})  # no rank 99: nothing ever answers there
    wait_until("rank 3 naming rank 1 as unanswered", lambda: [
        (p.rank, p.target) for p in c.nodes[3].shown.identity().unanswered_peers] == [(1, True)])
    most = 0
    for step in range(1, 13):  # more than twice the steps the bound keeps
        for h in range(4):
            c.commit(h, step, {f"own-{h}.bin": os.urandom(4096)})
        c.wait_passes(3, more=1)
        most = max(most, len(c.own_steps(3)))
        assert len(c.own_steps(3)) <= keep + awaiting + 1, (step, c.own_steps(3))
    c.wait_passes(3)
    own = sorted(c.own_steps(3))
    assert most <= keep + awaiting + 1 and len(own) <= keep + awaiting, (most, own)
    assert own[-keep:] == [11, 12], own
    c.wait_held({(2, 0, 12), (3, 1, 12), (0, 2, 12)})  # the others replicate...
    for h in (0, 1, 2):  # ... and collect
        c.wait_passes(h)
        assert len(c.own_steps(h)) <= keep + 1, (h, c.own_steps(h))
