"""Restore heals from good copies: real corruption.

A shard of the newest step damaged on its host (a bit flip, a truncation, or
"silent" damage that keeps the file's size and mtime, as bad memory would) is
quarantined and fetched again, verified, from another holder: the peer's copy,
else the same shard saved by another data-parallel replica. A peer's copy of
bytes its holder saved itself is a claim on them (one file): damage found
through either drops both, and both come back from other hosts. With no good
copy anywhere the restore fails with a typed error naming the file.

The replicators' heal on whole replicators in one process (the in-memory
cluster): a flip and a truncation healed from the peer, a shard healed from its
data-parallel twin, damage through a claim, damage on every holder. With real
replicator and sidecar processes, where the seam is the point: the controller
reaches every host's RAM disk only through the host's sidecar process
(``Cluster.options``), so a load that finds silent damage does so in the sidecar
and its typed error crosses the seam; and a heal from the backup. The test plays
the host's bad memory, damaging the files in place.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from jax.sharding import Mesh
from replicators import Cluster, assert_state_equal, flip, make_state, new_cluster

import mtc
from mtc.errors import CorruptShardError
from mtc.manifest import MANIFEST_NAME
from mtc.sidecar.replicator.memory_cluster import MemoryCluster
from mtc.sidecar.replicator.store.store import REPLICA_DIR
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


# -- the replicators' heal, on whole replicators in one process -----------------------


@pytest.fixture
def mem(tmp_path: Path) -> Iterator[MemoryCluster]:
    """2 slices of 2 hosts in memory: host h's peer and data-parallel twin is h+2."""
    with MemoryCluster(tmp_path, 4, 2) as c:
        yield c


def commit_dp(c: MemoryCluster, step: int) -> dict[int, dict[str, bytes]]:
    """Every host's step: a shard identical on the two hosts of one in-slice index
    (a data-parallel replica's: ``dp.bin``) and one of its own (``own-<h>.bin``);
    replicated before it returns."""
    out = {}
    dp = {i: os.urandom(16384) for i in range(c.per_slice)}
    for h in range(c.n):
        out[h] = c.commit(h, step, {"dp.bin": dp[h % c.per_slice],
                                    f"own-{h}.bin": os.urandom(16384)})
    c.wait_replicated(step)
    return out


def test_flip_and_truncation_healed_from_peer(mem: MemoryCluster) -> None:
    commit_dp(mem, 1)
    saved = commit_dp(mem, 2)
    victim0, victim1 = mem.root(0) / "2" / "own-0.bin", mem.root(1) / "2" / "own-1.bin"
    flip(victim0)
    truncate(victim1)

    replies = mem.prepared(range(4))
    # The newest step, exact, not the older one.
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {
        0: (2, "peer"), 1: (2, "peer"), 2: (2, "local"), 3: (2, "local")}
    # The bad files were moved aside and counted; good ones took their place.
    assert victim0.read_bytes() == saved[0]["own-0.bin"]
    assert victim1.read_bytes() == saved[1]["own-1.bin"]
    for r in (0, 1):
        assert mem.scrape(r)[QUARANTINED] == 1
        assert len(quarantined(mem.root(r))) == 1
        assert mem.scrape(r)["mtc_healed_files_total"] == 1
        assert mem.inventory(r).quarantined_files == 1  # what `mtc status` shows
    for r in (2, 3):
        assert mem.scrape(r)[QUARANTINED] == 0
    assert {r: mem.own_steps(r) for r in range(4)} == {r: {1, 2} for r in range(4)}


def test_healed_from_data_parallel_twin(mem: MemoryCluster) -> None:
    saved = commit_dp(mem, 4)
    for r in range(4):
        mem.inventory(r)  # every file read and checked once
    victim = mem.root(0) / "4" / "dp.bin"
    # Host 0's file is damaged and the peer's copy of it is gone (its claim on
    # host 2's own file removed): only host 2's own file of the same shard (saved
    # by the other data-parallel replica) holds it.
    peer_copy = mem.root(2) / REPLICA_DIR / "0" / "4" / "dp.bin"
    assert os.stat(peer_copy).st_ino == os.stat(mem.root(2) / "4" / "dp.bin").st_ino
    flip(victim)
    peer_copy.unlink()

    replies = mem.prepared(range(4))
    assert {x.step for x in replies.values()} == {4}
    assert replies[0].tier == "peer"
    assert victim.read_bytes() == saved[0]["dp.bin"]
    assert (mem.root(2) / "4" / "dp.bin").read_bytes() == saved[2]["dp.bin"]  # unharmed
    assert mem.scrape(2)[QUARANTINED] == 0


def test_damage_through_a_claim_drops_both_copies_then_both_come_back(
        mem: MemoryCluster) -> None:
    saved = commit_dp(mem, 5)
    assert mem.scrape(2)["mtc_deduplicated_files_total"] >= 1
    source = mem.root(2) / "5" / "dp.bin"  # host 2's own file
    copy = mem.root(2) / REPLICA_DIR / "0" / "5" / "dp.bin"  # its claim for host 0's copy
    assert os.stat(source).st_ino == os.stat(copy).st_ino  # the bytes once
    flip(source)
    # Found, quarantined with its claim: neither copy is offered any more.
    inv = mem.inventory(2)
    held = {(c.origin_rank, c.step) for c in inv.copies}
    assert (2, 5) not in held and (0, 5) not in held, held
    assert inv.quarantined_files == 2
    assert (mem.root(2) / QUARANTINE_DIR).is_dir()
    # A restore heals host 2's own step from its peer (the newest step, exact), and
    # host 0's data comes back to host 2 (its replication sees the copy gone).
    replies = mem.prepared(range(4))
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {
        0: (5, "local"), 1: (5, "local"), 2: (5, "peer"), 3: (5, "local")}
    assert source.read_bytes() == saved[2]["dp.bin"]
    mem.wait_replicated(5)
    assert (0, 5) in {(c.origin_rank, c.step) for c in mem.inventory(2).copies}


def test_damage_on_every_holder_is_a_typed_error(mem: MemoryCluster) -> None:
    commit_dp(mem, 6)
    for r in range(4):
        mem.inventory(r)
    name = "own-0.bin"  # a shard only host 0 saved: no data-parallel twin
    flip(mem.root(0) / "6" / name)  # found by host 0's next check
    # Silent damage (size and mtime kept): found only when the copy is read whole,
    # as its holder serves it to the heal.
    flip(mem.root(2) / REPLICA_DIR / "0" / "6" / name, silent=True)
    replies = mem.prepare(range(4))
    err = replies[0]
    assert isinstance(err, CorruptShardError), replies
    assert name in str(err) and "no good copy" in str(err), err
    assert mem.scrape(2)[QUARANTINED] == 1


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
