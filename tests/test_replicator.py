"""The replicator with real processes: replication, dedup, restore after host loss,
an unreachable peer, garbage collection, metrics.

Every replicator is a real ``python -m mtc.sidecar.replicator.main`` process, and the
controller reaches each host's RAM disk only through the host's sidecar process
(``Cluster.options``); losing a host means SIGKILL to its replicator and sidecar and
deleting its RAM-disk root. The test plays the host: it reads and wipes the roots.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from jax.sharding import Mesh
from replicators import Cluster, assert_state_equal, make_state, new_cluster

import mtc
from mtc.grpc_errors import PeerError
from mtc.manifest import MANIFEST_NAME, Manifest
from mtc.ports import free_ports
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.copies.replication import COPIES_AGAIN_MAX, RESYNC_S
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process  # every test here starts processes


def save(cl: Cluster, mesh: Mesh, steps: dict[int, dict[str, Any]]) -> None:
    """Save ``steps`` through the cluster's sidecars."""
    with mtc.CheckpointManager(cl.base, mesh=mesh, options=cl.options(max_to_keep=None)) as m:
        for step, state in steps.items():
            assert m.save(step, state)
        m.wait_until_finished()


def prepare_all(cl: Cluster, ranks: list[int], timeout: float = 30.0
                ) -> dict[int, pb.PrepareRestoreReply]:
    """PrepareRestore on ``ranks`` at once, as a restarting job does."""
    def one(r: int) -> pb.PrepareRestoreReply:
        c = cl.client(r)
        try:
            return c.call("PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=timeout),
                          deadline_s=timeout + 10, attempts=1)
        finally:
            c.close()

    with ThreadPoolExecutor(len(ranks)) as ex:
        return dict(zip(ranks, ex.map(one, ranks), strict=True))


def prepare_error(cl: Cluster, rank: int, timeout: float) -> PeerError | None:
    """PrepareRestore on ``rank``; the error it answered, or None."""
    c = cl.client(rank)
    try:
        c.call("PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=timeout),
               deadline_s=timeout + 10, attempts=1)
        return None
    except PeerError as e:
        return e
    finally:
        c.close()


def files_of(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file()}


def wipe(cl: Cluster, rank: int) -> None:
    """Lose a host: SIGKILL its replicator and sidecar, delete its RAM disk."""
    cl.lose_host(rank)


# -- replication --------------------------------------------------------------------


def test_replication_verified_and_deduplicated(ramdisk: Path, mesh: Mesh,
                                               clusters: list[Cluster]) -> None:
    state = make_state(mesh, 1.0)
    # Saved before the replicators start, so every host's own step is there when
    # its peer's copy is offered: the data-parallel shards can only be linked.
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True)
    save(cl, mesh, {1: state})
    cl.start_all()
    cl.wait_replicated(1, timeout=30)

    for origin in range(4):
        holder = (origin + 2) % 4
        src = cl.root(origin) / "1"
        replica = cl.root(holder) / ".mtc-replica" / str(origin) / "1"
        # The inventory lists the copy with the origin's manifest sizes and checksums.
        inv = cl.inventory(holder)
        (copy,) = [c for c in inv.copies if c.origin_rank == origin and c.step == 1]
        manifest = Manifest.from_bytes((src / MANIFEST_NAME).read_bytes())
        listed = {f.path: (f.size, f.crc32c) for f in copy.files}
        assert {p: v for p, v in listed.items() if p != MANIFEST_NAME} == {
            e.file: (e.nbytes, e.crc32c) for e in manifest.files.values()}
        # Byte for byte identical.
        assert files_of(replica) == files_of(src)

        # Dedup: the data-parallel shards the holder saved itself are claims on its
        # own files (one inode: the bytes once on its RAM disk; damage found through
        # either drops both, tests/test_claims.py), the host-unique ones were pushed.
        own = {p.name: p for p in (cl.root(holder) / "1").iterdir()}
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
        m = cl.scrape(rank)
        assert m["mtc_deduplicated_files_total"] >= 1
        # Only the host-unique shards and the manifest crossed the wire: the
        # data-parallel half of the step did not.
        step_bytes = sum(p.stat().st_size for p in (cl.root((rank + 2) % 4) / "1").iterdir())
        assert 0 < m["mtc_replicated_bytes_received_total"] < 0.75 * step_bytes
        assert m["mtc_replicated_bytes_sent_total"] > 0
        assert m["mtc_newest_step{state=committed}"] == 1
        assert m["mtc_newest_step{state=replicated}"] == 1
        assert m["mtc_replication_lag_steps"] == 0


def test_metrics_endpoint_serves_documented_names(ramdisk: Path,
                                                  clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1, metrics=True)
    cl.start_all()
    files = cl.commit(0, 3, {"a.bin": os.urandom(1000), "d-b.bin": os.urandom(10)})
    size = sum(map(len, files.values()))  # the manifest's bytes too
    cl.wait_held({(1, 0, 3)})
    m0, m1 = cl.scrape(0), cl.scrape(1)
    for m in (m0, m1):
        for name in ("mtc_replicated_bytes_sent_total", "mtc_replicated_bytes_received_total",
                     "mtc_restore_bytes_fetched_total", "mtc_deduplicated_files_total",
                     "mtc_replication_lag_steps", "mtc_newest_step{state=committed}",
                     "mtc_newest_step{state=replicated}", "mtc_newest_step{state=backed_up}"):
            assert name in m, (name, sorted(m))
    assert m0["mtc_replicated_bytes_sent_total"] == size
    assert m1["mtc_replicated_bytes_received_total"] == size
    assert m0["mtc_newest_step{state=committed}"] == 3
    assert m0["mtc_newest_step{state=replicated}"] == 3
    assert m1["mtc_newest_step{state=committed}"] == -1
    assert m0["mtc_newest_step{state=backed_up}"] == -1
    # The failure counter is declared even before anything failed.
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{cl.metrics_ports[0]}/metrics") as r:
        assert "# TYPE mtc_failures_total counter" in r.read().decode()


# -- restore after host loss ------------------------------------------------------


def test_restore_after_host_loss(ramdisk: Path, mesh: Mesh, clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2)
    cl.start_all()
    s1, s2 = make_state(mesh, 1.0), make_state(mesh, 2.0)
    save(cl, mesh, {1: s1, 2: s2})
    cl.wait_replicated(2, timeout=30)
    before = files_of(cl.root(1) / "2")

    wipe(cl, 1)
    cl.start(1)
    assert not (cl.root(1) / "2").exists()
    t0 = time.monotonic()
    replies = prepare_all(cl, [0, 1, 2, 3])
    assert time.monotonic() - t0 < 20
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {
        0: (2, "local"), 1: (2, "peer"), 2: (2, "local"), 3: (2, "local")}
    assert files_of(cl.root(1) / "2") == before

    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options(max_to_keep=None)) as m:
        assert 2 in m.all_steps()
        assert_state_equal(m.restore(2, s2), s2)
    # Redundancy comes back without a new save: host 3's copy on the replaced
    # host 1 was lost with it, and host 3 pushes it again.
    cl.wait_held({(1, 3, 2), (3, 1, 2)}, timeout=15)


@pytest.mark.parametrize("while_fetching", [True, False], ids=["while-fetching", "once-local"])
def test_two_hosts_lost_in_different_slices(ramdisk: Path, mesh: Mesh,
                                            clusters: list[Cluster], while_fetching: bool
                                            ) -> None:
    """Restored while the lost hosts' data still comes (read from their twins), or
    once the replicators made it local: then the hosts' answer taken beside the
    agreement, before their data came, is not the one the restore plans with."""
    cl = new_cluster(clusters, ramdisk, 4, 2)
    cl.start_all()
    s3 = make_state(mesh, 3.0)
    save(cl, mesh, {2: make_state(mesh, 2.0), 3: s3})
    cl.wait_replicated(3, timeout=30)

    # Host 0 (slice 0) and host 3 (slice 1) at once: each one's data survives on
    # its peer in the other slice (host 2 and host 1).
    wipe(cl, 0)
    wipe(cl, 3)
    cl.launch(0)
    cl.launch(3)
    cl.wait_serving(0)
    cl.wait_serving(3)

    # The controller's own path: restore() without a step asks the replicators.
    opts = cl.options(replicators=True, restore_timeout_s=30,
                      restore_while_fetching=while_fetching)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as m:
        assert_state_equal(m.restore(None, s3), s3)
        assert m.last_restore_tiers[0] == m.last_restore_tiers[3] == "peer"
    cl.wait_held({(0, 2, 3), (3, 1, 3), (2, 0, 3), (1, 3, 3)}, timeout=15)
    for r in (0, 3):
        assert (cl.root(r) / "3" / MANIFEST_NAME).is_file()
        assert files_of(cl.root(r) / "3") == files_of(
            cl.root((r + 2) % 4) / ".mtc-replica" / str(r) / "3")


# -- an unreachable peer ------------------------------------------------------------


def test_peer_unreachable_then_back(ramdisk: Path, mesh: Mesh, clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True)
    cl.start_all()
    s1 = make_state(mesh, 1.0)
    save(cl, mesh, {1: s1})
    cl.wait_replicated(1, timeout=30)

    cl.kill(2)  # host 0's peer, not restarted for now
    save(cl, mesh, {2: make_state(mesh, 2.0)})
    # Hosts 1 and 3 are unaffected.
    cl.wait_held({(3, 1, 2), (1, 3, 2)}, timeout=30)
    wait_until("rank 0 counting its peer unreachable twice", lambda: cl.scrape(0).get(
        "mtc_failures_total{kind=peer_unreachable}", 0) >= 2, 20, detail=lambda: cl.scrape(0))
    m0 = cl.scrape(0)
    assert m0["mtc_newest_step{state=committed}"] == 2
    assert m0["mtc_newest_step{state=replicated}"] == 1
    assert m0["mtc_replication_lag_steps"] == 1
    assert all(cl.alive(r) for r in (0, 1, 3))
    assert (2, 0, 2) not in cl.held() and (0, 2, 2) not in cl.held()

    # A restore with host 2 down cannot be decided safely (host 2 may hold data
    # nobody else has, and deciding without a member could split the job): every
    # asker gets the typed "cannot decide" (AgreementError, ABORTED) within its
    # deadline, and no host restores anything.
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as ex:
        errors = list(ex.map(lambda r: prepare_error(cl, r, 4.0), [0, 1, 3]))
    assert time.monotonic() - t0 < 4.0 + 8
    for e in errors:
        assert e is not None and e.code == grpc.StatusCode.ABORTED, e
        assert "rank(s) [2]" in str(e), e

    # Back: replication completes in both directions.
    t0 = time.monotonic()
    cl.start(2)
    cl.wait_held({(2, 0, 2), (0, 2, 2)}, timeout=30)
    took = time.monotonic() - t0
    print(f"replication completed {took:.1f}s after the restart")
    assert took < 10  # reconnect backoff stays short
    wait_until("rank 0's newest replicated step 2",
               lambda: cl.scrape(0)["mtc_newest_step{state=replicated}"] == 2, 10)
    assert cl.scrape(0)["mtc_replication_lag_steps"] == 0
    # With every member back, the same restore succeeds, on the newest step.
    replies = prepare_all(cl, [0, 1, 2, 3])
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {
        0: (2, "local"), 1: (2, "local"), 2: (2, "local"), 3: (2, "local")}
    assert len({x.epoch for x in replies.values()}) == 1


# -- garbage collection ----------------------------------------------------------------


def own_steps(root: Path) -> set[int]:
    return {int(n) for n in os.listdir(root) if n.isdigit()}


def test_gc_keeps_newest_fully_replicated_step(ramdisk: Path, clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1, extra=("--keep", "2"), metrics=True)
    cl.start_all()
    cl.commit(0, 1, {"x.bin": os.urandom(4096)})
    cl.commit(1, 1, {"y.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 1), (0, 1, 1)})

    cl.kill(1)  # the only peer: nothing newer gets fully replicated
    for step in (2, 3, 4, 5):
        cl.commit(0, step, {"x.bin": os.urandom(4096)})
        time.sleep(0.2)
    # The newest 2 plus step 1, the newest fully replicated one.
    # A bound, not a pace: a pass while the peer is down waits on its failed offers,
    # and a loaded machine (CI beside other work) stretches passes.
    wait_until("rank 0 keeping steps 1, 4, 5", lambda: own_steps(cl.root(0)) == {1, 4, 5}, 30,
               detail=lambda: own_steps(cl.root(0)))
    cl.wait_passes(0, more=3)  # GC passes later, still there
    assert own_steps(cl.root(0)) == {1, 4, 5}

    # The origin's replicator restarting while its peer is still down must not
    # forget which step is the newest replicated one.
    cl.kill(0)
    cl.start(0)
    cl.wait_passes(0)  # a whole pass, GC included, of the new process
    assert 1 in own_steps(cl.root(0))

    # The peer returns: step 5 is replicated, but step 1 is still the newest
    # step that every rank can be restored from (rank 1 has nothing newer).
    cl.start(1)
    cl.wait_held({(1, 0, 5)}, timeout=30)
    cl.wait_passes(0, more=3)  # GC passes that saw step 5 on the peer
    assert 1 in own_steps(cl.root(0))
    # Once rank 1 commits step 5 as well, step 5 is complete and step 1 goes.
    cl.commit(1, 5, {"y.bin": os.urandom(4096)})
    cl.wait_held({(0, 1, 5)}, timeout=30)
    wait_until("rank 0 keeping steps 4, 5", lambda: own_steps(cl.root(0)) == {4, 5}, 30,
               detail=lambda: own_steps(cl.root(0)))
    # The peer keeps at most --keep copies per origin: the origin's two (step 4,
    # skipped while the peer was down, pushed once step 5 was on it), step 1 gone.
    deadline = time.monotonic() + 15
    while (held := {c.step for c in cl.inventory(1).copies if c.origin_rank == 0}) != {4, 5}:
        assert time.monotonic() < deadline and len(held) <= 3, held
        time.sleep(0.05)
    # Step 4 never reached the peer before: late, not a lost copy pushed again.
    got = cl.scrape(0)
    assert got.get("mtc_steps_copied_again_total{why=late}") == 1, got
    assert got.get("mtc_steps_copied_again_total{why=lost}", 0) == 0, got


def test_an_older_step_a_peer_keeps_deleting_is_pushed_again_a_bounded_number_of_times(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Rank 1 keeps one copy per origin (another --keep than rank 0's two): rank 0's
    older step, pushed to it once the newest is there, is deleted again each time.
    Rank 0 stops pushing it after COPIES_AGAIN_MAX times instead of for ever."""
    cl = new_cluster(clusters, ramdisk, 2, 1, metrics=True,
                     rank_args={0: ("--keep", "2"), 1: ("--keep", "1")})
    cl.start_all()
    for step in (1, 2):
        cl.commit(1, step, {"y.bin": os.urandom(4096)})  # complete on both ranks
        cl.commit(0, step, {"x.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 2), (0, 1, 2)})

    def pushes() -> dict[str, float]:  # older steps pushed, by why: "lost", "late"
        prefix = "mtc_steps_copied_again_total{why="
        return {k[len(prefix):-1]: v for k, v in cl.scrape(0).items() if k.startswith(prefix)}

    wait_until(f"{COPIES_AGAIN_MAX} older steps pushed again",
               lambda: sum(pushes().values()) >= COPIES_AGAIN_MAX, 30,
               detail=lambda: cl.log_text(0)[-2000:])
    # Were it unbounded, a resync (every RESYNC_S) would push it again: rank 0's
    # loop passes through three resyncs' time, and once more after it.
    end = time.monotonic() + 3 * RESYNC_S
    while time.monotonic() < end:
        cl.wait_passes(0)
    cl.wait_passes(0)
    got = pushes()
    assert sum(got.values()) == COPIES_AGAIN_MAX, got
    # The first may be late (step 2 went ahead of step 1); the peer deleted every
    # one after it had held it.
    assert got.get("lost", 0) >= COPIES_AGAIN_MAX - 1, got
    assert {c.step for c in cl.inventory(1).copies if c.origin_rank == 0} <= {1, 2}


def test_gc_keeps_the_newest_step_every_rank_can_restore(ramdisk: Path,
                                                         clusters: list[Cluster]) -> None:
    """A host whose newer step failed elsewhere must not delete the last complete one."""
    cl = new_cluster(clusters, ramdisk, 2, 1, extra=("--keep", "1"), metrics=True)
    cl.start_all()
    for step in (1, 2):
        cl.commit(0, step, {"x.bin": os.urandom(4096)})
        cl.commit(1, step, {"y.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 2), (0, 1, 2)})
    # Rank 0 commits and replicates step 3; rank 1 never commits it (it crashed).
    cl.commit(0, 3, {"x.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 3)})
    cl.wait_passes(0, more=3)  # GC passes with --keep 1 that saw step 3 on the peer
    assert 2 in own_steps(cl.root(0)), "the newest step complete on every rank was deleted"
    # A restore asks every member (agreement needs them all): step 2 everywhere.
    replies = prepare_all(cl, [0, 1], timeout=20)
    assert {r: x.step for r, x in replies.items()} == {0: 2, 1: 2}


def test_gc_keeps_the_newest_step_that_survives_losing_the_host_whose_copy_lags(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Rank 1 cannot reach rank 0 (a one-way partition: rank 0 reaches rank 1), so
    its step 3 stays on host 1 alone while rank 0's step 3 reaches host 1. Step 3 is
    complete, and rank 0's own rules (--keep 1, its newest replicated step 3) would
    delete its step 2. Host 1 is then lost: its step 3 with it, and rank 0's step 2
    must still be there, or no step is restorable at all (what a random-fault run
    found: every step of a job lost with one host)."""
    cl = new_cluster(clusters, ramdisk, 2, 1, extra=("--keep", "1"), metrics=True)
    cl.start_all()
    saved = {}
    for step in (1, 2):
        cl.commit(0, step, {"x.bin": os.urandom(4096)})
        saved[step] = cl.commit(1, step, {"y.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 2), (0, 1, 2)})

    cl.kill(1)
    dead = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens: rank 0 out of reach
    cl.start(1, "--nodes", f"{dead},{cl.addrs[1]}")
    cl.commit(1, 3, {"y.bin": os.urandom(4096)})
    cl.commit(0, 3, {"x.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 3)})
    cl.wait_passes(0, more=3)  # GC passes with --keep 1 that saw step 3 on the peer
    assert own_steps(cl.root(0)) == {2, 3}, "the newest step on two hosts was deleted"
    assert (0, 1, 3) not in cl.held()  # rank 1's step 3 is on host 1 alone

    wipe(cl, 1)
    cl.start(1)  # the replaced host, on the job's true addresses
    replies = prepare_all(cl, [0, 1], timeout=20)
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {0: (2, "local"),
                                                                 1: (2, "peer")}
    assert (cl.root(1) / "2" / "y.bin").read_bytes() == saved[2]["y.bin"]


def test_a_damaged_step_a_member_can_repair_is_not_given_up(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Four slices of one host; hosts 0 and 2 saved one shard identically (a
    data-parallel replica's), each host its own other files. Host 0's file of it
    is found bad (moved aside) and its peer (host 1, which holds host 0's copy) is
    lost: no member holds host 0's step 7 complete, yet host 2's own file holds the
    missing bytes. The agreement counts the step as held, and host 0 restores it
    healed from that file, not the older step 6 (tests/test_heal.py heals the same
    way when the damage is found during the restore)."""
    cl = new_cluster(clusters, ramdisk, 4, 1)
    cl.start_all()
    for step in (6, 7):
        dp = os.urandom(8192)
        for r in range(4):
            cl.commit(r, step, {"dp.bin": dp if r in (0, 2) else os.urandom(8192),
                                f"own-{r}.bin": os.urandom(4096)})
        cl.wait_replicated(step)
    victim = cl.root(0) / "7" / "dp.bin"
    good = victim.read_bytes()
    victim.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    inv = cl.inventory(0)  # found, quarantined: offered as damaged, with that file
    assert (0, 7) not in {(c.origin_rank, c.step) for c in inv.copies}
    assert [(d.step, [f.path for f in d.files]) for d in inv.damaged] == [(7, ["dp.bin"])]
    assert not victim.exists()
    cl.kill(1)
    held = cl.held()
    assert not any(o == 0 and s == 7 for _, o, s in held), held  # no complete copy left

    members = [0, 2, 3]

    def one(r: int) -> pb.PrepareRestoreReply:
        c = cl.client(r)
        try:
            return c.call("PrepareRestore", pb.PrepareRestoreRequest(
                timeout_seconds=20, members=members), deadline_s=30, attempts=1)
        finally:
            c.close()

    with ThreadPoolExecutor(len(members)) as ex:
        replies = dict(zip(members, ex.map(one, members), strict=True))
    assert {r: x.step for r, x in replies.items()} == {0: 7, 2: 7, 3: 7}, replies
    assert replies[0].tier == "peer"
    assert victim.read_bytes() == good
    assert (0, 7) in {(c.origin_rank, c.step) for c in cl.inventory(0).copies}
    assert cl.inventory(0).damaged == []
