"""One run's bytes per step through the replicators, and no loss in silence.

2 slices of 2 hosts, one peer copy each. A controller's runs (saving, agreeing
through ``latest_step``, restoring) with real replicator and sidecar processes
(tests/replicators.py), the controller reaching the hosts through their sidecars;
the replicators' own rules (a copy of an older save replaced, a host and its peer
wiped named) on whole replicators in one process. The test plays the hosts: it
removes step folders and peer copies as a host that died before its commit, or a
wiped RAM disk, would leave them.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from jax.sharding import Mesh
from replicators import Cluster, assert_state_equal, make_state, new_cluster

import mtc
from mtc.manifest import MANIFEST_NAME, Manifest
from mtc.sidecar.replicator.memory_cluster import MemoryCluster, files_of
from mtc.sidecar.replicator.store.store import REPLICA_DIR
from mtc.testing.waits import wait_until


def peer_copy(cl: Cluster, origin: int, step: int) -> Path:
    """Where host ``origin``'s step is copied (its peer in the other slice)."""
    return cl.root((origin + cl.per_slice) % cl.n) / ".mtc-replica" / str(origin) / str(step)


def copies_of(cl: Cluster, step: int) -> set[tuple[int, int]]:
    """(holder, origin) of every copy of ``step`` the replicators list."""
    return {(h, o) for h, o, s in cl.held() if s == step}


@pytest.mark.process
def test_a_save_no_host_finished_everywhere_is_fenced_and_saved_again_by_the_next_run(
        ramdisk: Path, mesh: Mesh, clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2)
    cl.start_all()
    opts = cl.options(replicators=True, restore_timeout_s=30)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        mgr.save(20, make_state(mesh, 20.0))
        mgr.save(25, make_state(mesh, 25.0))
        mgr.wait_until_finished()
    cl.wait_replicated(25, timeout=60)
    # Host 3 died before its commit of 25: neither it nor its peer copy exists.
    cl.kill(3)
    shutil.rmtree(cl.root(3) / "25")
    shutil.rmtree(peer_copy(cl, 3, 25))
    cl.start(3)

    # The next run: the replicators agree on 20 and fence 25 off on every host.
    resumed = make_state(mesh, 1025.0)  # other data under the same step number
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        assert mgr.latest_step() == 20
        assert_state_equal(mgr.restore(20, target=make_state(mesh, 0.0)),
                           make_state(mesh, 20.0))
        assert copies_of(cl, 25) == set()
        assert not any((cl.root(h) / "25").exists() for h in range(4))
        assert mgr.save(25, resumed)  # no StepExistsError: 25 is free again
        mgr.wait_until_finished()
    cl.wait_replicated(25, timeout=60)
    runs = {Manifest.from_bytes((cl.root(h) / "25" / MANIFEST_NAME).read_bytes()).run
            for h in range(4)}
    assert len(runs) == 1

    # And the run after it restores the resumed run's 25, whole.
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        assert mgr.latest_step() == 25
        assert_state_equal(mgr.restore(25, target=make_state(mesh, 0.0)), resumed)


@pytest.mark.process
def test_restoring_the_step_latest_step_agreed_on_keeps_the_newer_committed_one(
        ramdisk: Path, mesh: Mesh, clusters: list[Cluster]) -> None:
    """Issue 56, item 1, through the replicators: latest_step() agrees on 3; 4 is
    saved; restore(3) keeps 4 on every host and its peer copies, and the next
    agreement (this manager's, then a reopened one's) is 4, fencing nothing."""
    cl = new_cluster(clusters, ramdisk, 4, 2)
    cl.start_all()
    opts = cl.options(replicators=True, restore_timeout_s=30)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, make_state(mesh, float(s)))
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3
        mgr.save(4, make_state(mesh, 4.0))
        mgr.wait_until_finished()
        assert_state_equal(mgr.restore(3, target=make_state(mesh, 0.0)),
                           make_state(mesh, 3.0))
        assert all((cl.root(h) / "4").is_dir() for h in range(4))
        assert mgr.latest_step() == 4
    cl.wait_replicated(4, timeout=60)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        assert mgr.latest_step() == 4
        assert_state_equal(mgr.restore(3, target=make_state(mesh, 0.0)),
                           make_state(mesh, 3.0))
        assert 4 in mgr.all_steps() and copies_of(cl, 4) == {
            (h, o) for o in range(4) for h in (o, (o + cl.per_slice) % cl.n)}
        assert_state_equal(mgr.restore(target=make_state(mesh, 0.0)), make_state(mesh, 4.0))


# -- on whole replicators in one process (the in-memory cluster) -----------------------


def commit_all(c: MemoryCluster, step: int) -> dict[int, dict[str, bytes]]:
    """Every host's ``step``, new bytes each time (a run's save)."""
    return {h: c.commit(h, step, {f"own-{h}.bin": os.urandom(8192)}) for h in range(c.n)}


def test_a_peer_copy_of_an_older_save_under_the_same_number_is_replaced(
        tmp_path: Path) -> None:
    with MemoryCluster(tmp_path, 4, 2) as c:
        commit_all(c, 5)
        c.wait_replicated(5)
        held = c.root(2) / REPLICA_DIR / "0" / "5" / MANIFEST_NAME  # host 0's peer copy
        old = held.read_bytes()
        # Every host's 5 is saved again by another run (the peers keep the old copies).
        for h in range(4):
            shutil.rmtree(c.root(h) / "5")
        saved = commit_all(c, 5)
        new = saved[0][MANIFEST_NAME]
        wait_until("host 0's peer holding the new save of 5",
                   lambda: held.exists() and held.read_bytes() == new)
        assert new != old
        # A host wiped now gets the new run's data back from its peer.
        c.wait_replicated(5)
        c.replace_host(0)
        replies = c.prepared(range(4))
        assert {x.step for x in replies.values()} == {5}
        assert replies[0].tier == "peer"
        assert files_of(c.root(0) / "5") == saved[0]


def test_a_host_and_its_peer_wiped_is_a_typed_error_naming_them(tmp_path: Path) -> None:
    with MemoryCluster(tmp_path, 4, 2) as c:
        commit_all(c, 20)
        commit_all(c, 25)
        c.wait_replicated(25)
        c.lose_host(1)
        c.lose_host(3)  # host 1's peer: both copies of host 1's data are gone
        c.start(1)
        c.start(3)
        # Every member reads "nothing restorable" with why (the controller raises it
        # as a DataLossError naming them).
        replies = c.prepared(range(4))
        for r, x in replies.items():
            assert (x.step, x.tier) == (-1, "none"), (r, x)
            assert re.search(r"step 25: data of rank\(s\) \[1, 3\] is on no member",
                             x.lost), x
        # Nothing was deleted: the data of hosts 0 and 2 is still there to bring back.
        assert (c.root(0) / "25").is_dir() and (c.root(2) / "20").is_dir()
