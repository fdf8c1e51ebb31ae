"""Restore heals from good copies: real replicator processes, real corruption.

A shard of the newest step damaged on its host (a bit flip, a truncation, or
"silent" damage that keeps the file's size and mtime, as bad memory would) is
quarantined and fetched again, verified, from another holder: the peer's copy,
else the same shard saved by another data-parallel replica. A peer's copy of
bytes its holder saved itself is a claim on them (one file): damage found
through either drops both, and both come back from other hosts. With no good
copy anywhere the restore fails with a typed error naming the file.

The controller reaches every host's RAM disk only through the host's sidecar
process (``Cluster.options``): a load that finds damage does so in the sidecar,
and its typed error crosses the seam. The test plays the host's bad memory,
damaging the files in place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import Mesh
from replicators import Cluster, assert_state_equal, flip, make_state, new_cluster

import mtc
from mtc import cli
from mtc.errors import CorruptShardError
from mtc.manifest import MANIFEST_NAME
from mtc.sidecar.replicator.store.store import REPLICA_DIR
from mtc.sidecar.storage.checksum import file_crc
from mtc.sidecar.storage.quarantine import QUARANTINE_DIR, quarantined

QUARANTINED = "mtc_quarantined_files_total"


def options(cl: Cluster) -> mtc.Options:
    return cl.options(replicators=True, max_to_keep=None, restore_timeout_s=60)


def save_steps(ramdisk: Path, mesh: Mesh, cl: Cluster, steps: dict[int, float]
               ) -> dict[int, dict[str, object]]:
    states = {s: make_state(mesh, scale) for s, scale in steps.items()}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options(max_to_keep=None)) as m:
        for s, state in states.items():  # each replicated before the next (only the
            m.save(s, state)             # newest step is pushed)
            m.wait_until_finished()
            cl.wait_replicated(s, timeout=60)
    return states


def shards(root: Path, step: int) -> dict[str, Path]:
    return {p.name: p for p in sorted((root / str(step)).iterdir()) if p.name != MANIFEST_NAME}


def data_parallel(cl: Cluster, step: int, host: int) -> tuple[list[str], list[str]]:
    """(names ``host`` shares with its twin in the other slice, names only it has)."""
    mine = shards(cl.root(host), step)
    twin = shards(cl.root((host + 2) % 4), step)
    shared = sorted(n for n in mine if n in twin and
                    mine[n].read_bytes() == twin[n].read_bytes())
    return shared, sorted(n for n in mine if n not in twin)


def truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 3)


@pytest.mark.process
def test_flip_and_truncation_healed_from_peer(ramdisk: Path, mesh: Mesh,
                                              clusters: list[Cluster],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True)
    cl.start_all()
    states = save_steps(ramdisk, mesh, cl, {1: 1.0, 2: 2.0})
    _, own0 = data_parallel(cl, 2, 0)
    _, own1 = data_parallel(cl, 2, 1)
    victim0 = shards(cl.root(0), 2)[own0[0]]
    victim1 = shards(cl.root(1), 2)[own1[0]]
    good0, good1 = victim0.read_bytes(), victim1.read_bytes()
    flip(victim0)
    truncate(victim1)

    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(cl)) as m:
        got = m.restore(None, states[2])
        tiers = m.last_restore_tiers
    assert_state_equal(got, states[2])  # the newest step, exact, not the older one
    assert tiers == {0: "peer", 1: "peer", 2: "local", 3: "local"}, tiers
    # The bad files were moved aside and counted; good ones took their place.
    assert victim0.read_bytes() == good0 and victim1.read_bytes() == good1
    for r in (0, 1):
        assert cl.scrape(r)[QUARANTINED] == 1
        assert len(quarantined(cl.root(r))) == 1
        assert cl.scrape(r)["mtc_healed_files_total"] == 1
    for r in (2, 3):
        assert cl.scrape(r)[QUARANTINED] == 0
    # `mtc status` shows them.
    assert cli.main(["status", "--nodes", ",".join(cl.addrs), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["hosts"]
    assert [r["quarantined"] for r in rows] == [1, 1, 0, 0]
    assert [r["local"] for r in rows] == [[1, 2]] * 4


@pytest.mark.process
def test_silent_damage_found_on_load_healed_and_retried(ramdisk: Path, mesh: Mesh,
                                                        clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True)
    cl.start_all()
    states = save_steps(ramdisk, mesh, cl, {3: 3.0})
    cl.inventory(0)  # the replicator has read and checked its files once
    _, own = data_parallel(cl, 3, 0)
    victim = shards(cl.root(0), 3)[own[0]]
    good = victim.read_bytes()
    flip(victim, silent=True)  # same inode, size and mtime: the replicator's cache says good

    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(cl)) as m:
        got = m.restore(None, states[3])
        tiers = m.last_restore_tiers
    assert_state_equal(got, states[3])
    # The loader found it, quarantined it; the replicator healed it from the peer
    # when the manager prepared again, and the second load succeeded.
    assert tiers[0] == "peer", tiers
    assert victim.read_bytes() == good
    assert len(quarantined(cl.root(0))) == 1
    assert "heal" in cl.log_text(0)


@pytest.mark.process
def test_healed_from_data_parallel_twin(ramdisk: Path, mesh: Mesh,
                                        clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True)
    cl.start_all()
    states = save_steps(ramdisk, mesh, cl, {4: 4.0})
    for r in range(4):
        cl.inventory(r)
    shared, _ = data_parallel(cl, 4, 0)
    assert shared, "no data-parallel shard in the state"
    name = shared[0]
    victim = shards(cl.root(0), 4)[name]
    good = victim.read_bytes()
    # Host 0's file is damaged and the peer's copy of it is gone (its claim on
    # host 2's own file removed): only host 2's own file of the same shard (saved
    # by the other data-parallel replica) holds it.
    peer_copy = cl.root(2) / REPLICA_DIR / "0" / "4" / name
    assert os.stat(peer_copy).st_ino == os.stat(shards(cl.root(2), 4)[name]).st_ino
    flip(victim, silent=True)
    peer_copy.unlink()

    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(cl)) as m:
        got = m.restore(None, states[4])
    assert_state_equal(got, states[4])
    assert victim.read_bytes() == good
    assert shards(cl.root(2), 4)[name].read_bytes() == good  # the twin was never harmed
    assert cl.scrape(2)[QUARANTINED] == 0


@pytest.mark.process
def test_damage_through_a_claim_drops_both_copies_then_both_come_back(
        ramdisk: Path, mesh: Mesh, clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True)
    cl.start_all()
    states = save_steps(ramdisk, mesh, cl, {5: 5.0})
    assert cl.scrape(2)["mtc_deduplicated_files_total"] >= 1
    shared, _ = data_parallel(cl, 5, 0)
    source = shards(cl.root(2), 5)[shared[0]]  # host 2's own file
    copy = cl.root(2) / REPLICA_DIR / "0" / "5" / shared[0]  # its claim for host 0's copy
    assert os.stat(source).st_ino == os.stat(copy).st_ino  # the bytes once
    flip(source)
    # Found, quarantined with its claim: neither copy is offered any more.
    inv = cl.inventory(2)
    held = {(c.origin_rank, c.step) for c in inv.copies}
    assert (2, 5) not in held and (0, 5) not in held, held
    assert inv.quarantined_files == 2
    assert (cl.root(2) / QUARANTINE_DIR).is_dir()
    # Host 0's data comes back to host 2 (its replication sees the copy gone), and a
    # restore heals host 2's own step from its peer: the newest step, exact.
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(cl)) as m:
        got = m.restore(None, states[5])
    assert_state_equal(got, states[5])
    assert file_crc(source) == file_crc(shards(cl.root(0), 5)[shared[0]])
    cl.wait_replicated(5, timeout=60)
    assert (0, 5) in {(c.origin_rank, c.step) for c in cl.inventory(2).copies}


@pytest.mark.process
def test_damage_on_every_holder_is_a_typed_error(ramdisk: Path, mesh: Mesh,
                                                 clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True)
    cl.start_all()
    states = save_steps(ramdisk, mesh, cl, {6: 6.0})
    for r in range(4):
        cl.inventory(r)
    _, own = data_parallel(cl, 6, 0)
    name = own[0]  # a shard only host 0 saved: no data-parallel twin
    flip(shards(cl.root(0), 6)[name], silent=True)
    flip(cl.root(2) / REPLICA_DIR / "0" / "6" / name, silent=True)

    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(cl)) as m, \
            pytest.raises(CorruptShardError) as err:
        m.restore(None, states[6])
    assert name in str(err.value), err.value
    assert "no good copy" in str(err.value), err.value
    assert cl.scrape(2)[QUARANTINED] == 1
    assert np.asarray(states[6]["own"]).size  # the state itself was fine


@pytest.mark.process
def test_damage_on_every_peer_healed_from_backup(ramdisk: Path, mesh: Mesh,
                                                 clusters: list[Cluster]) -> None:
    from mtc.proto import replicator_pb2 as pb

    bucket = ramdisk / "bucket"
    bucket.mkdir()
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True,
                     extra=("--backup", bucket.as_uri(), "--backup-interval-minutes", "60"))
    cl.start_all()
    states = save_steps(ramdisk, mesh, cl, {7: 7.0})
    c = cl.client(0)
    try:
        assert c.call("RequestBackup", pb.BackupRequest(step=-1), deadline_s=60).step == 7
    finally:
        c.close()
    for r in range(4):
        cl.inventory(r)
    _, own = data_parallel(cl, 7, 0)
    victim = shards(cl.root(0), 7)[own[0]]
    good = victim.read_bytes()
    flip(victim, silent=True)
    flip(cl.root(2) / REPLICA_DIR / "0" / "7" / own[0], silent=True)

    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(cl)) as m:
        got = m.restore(None, states[7])
        tiers = m.last_restore_tiers
    assert_state_equal(got, states[7])
    assert tiers[0] == "backup", tiers
    assert victim.read_bytes() == good
    assert cl.scrape(0)["mtc_backup_bytes_downloaded_total"] == len(good)


# -- the source order, a pure function ---------------------------------------------------


def _inv(rank: int, copies: list[tuple[int, int, list[tuple[str, int, int]]]]) -> object:
    from mtc.proto import replicator_pb2 as pb

    inv = pb.Inventory(rank=rank)
    for origin, step, files in copies:
        c = inv.copies.add(step=step, origin_rank=origin)
        for p, n, crc in files:
            c.files.add(path=p, size=n, crc32c=crc)
    return inv


def test_heal_sources_and_order() -> None:
    from mtc.sidecar.replicator.fetch.fetch_plan import fetch_order, heal_sources
    from mtc.sidecar.replicator.store.step_files import FileMeta

    a, b = ("a.bin", 10, 1), ("b.bin", 20, 2)
    invs = {
        0: _inv(0, [(0, 5, [a, b]), (2, 5, [a, ("b.bin", 20, 99)])]),  # 0's own (being healed)
        1: _inv(1, [(1, 5, [a])]),                                    # a twin of a.bin
        2: _inv(2, [(0, 5, [a, b]), (2, 5, [a])]),                    # the peer's copy of 0's
        3: _inv(3, [(0, 4, [a, b])]),                                 # another step: never
    }
    files = [FileMeta(*a), FileMeta(*b)]
    src = heal_sources(0, 5, 0, files, invs)  # type: ignore[arg-type]
    # Copies of rank 0's data first (not host 0's own), then same-content twins;
    # b.bin of rank 2 differs (CRC), so it is no source.
    assert src["a.bin"] == ([(2, 0)], [(0, 2), (1, 1), (2, 2)])
    assert src["b.bin"] == ([(2, 0)], [])
    own = [(0, 2), (2, 0), (3, 0)]
    assert fetch_order(0, own, [(2, 2), (0, 1)], 0) == [(0, 2), (2, 0), (3, 0), (0, 1), (2, 2)]
    assert fetch_order(0, own, [], 1) == [(0, 2), (3, 0), (2, 0)]  # remote ones rotated
    assert fetch_order(0, [], [], 3) == []
