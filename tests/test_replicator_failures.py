"""Replicators killed in the middle of a transfer, and corrupted bytes.

A receiver SIGKILLed mid-copy (a real process: what a kill leaves on its RAM disk
is cleaned by the next one); on whole replicators in one process
(``sidecar/replicator/memory_cluster.py``), a holder lost while a replaced host
fetches from it, a flipped byte in a peer copy, and a sender whose own file went
bad after it was committed. The test plays the host, damaging and wiping its files.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
from replicators import Cluster, new_cluster

from mtc.manifest import MANIFEST_NAME
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.memory_cluster import MemoryCluster, at_once
from mtc.sidecar.replicator.store.store import REPLICA_DIR
from mtc.testing.waits import wait_until

MiB = 1 << 20


def random_files(count: int, size: int, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {f"shard-{i:02d}.bin": rng.bytes(size) for i in range(count)}


def digests(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).digest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def tmp_dirs(d: Path) -> list[Path]:
    try:
        return [d / n for n in os.listdir(d) if ".mtc-tmp-" in n]
    except FileNotFoundError:
        return []


def bytes_under(d: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(d):
        for n in names:
            try:
                total += os.stat(os.path.join(dirpath, n)).st_size
            except FileNotFoundError:
                pass
    return total


def wanted_copies(n: int, per_slice: int, replicas: int, step: int,
                  origins: range | list[int] | None = None) -> set[tuple[int, int, int]]:
    """(holder, origin, step) for every copy the configuration asks for."""
    addrs = tuple(f"x:{i}" for i in range(n))
    out = set()
    for o in origins if origins is not None else range(n):
        cfg = ReplicatorConfig(rank=o, nodes=addrs, nodes_per_slice=per_slice, replicas=replicas)
        out |= {(t, o, step) for t in cfg.targets(o)}
    return out


# -- a receiver killed mid-copy -------------------------------------------------------


@pytest.mark.process
def test_receiver_killed_mid_copy(ramdisk: Path, clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1)
    cl.start_all()
    files = random_files(8, 32 * MiB, seed=1)  # 256 MiB: long enough to be caught
    want = {k: hashlib.sha256(v).digest() for k, v in files.items()}
    incoming = cl.root(1) / REPLICA_DIR / "0"

    manifest = cl.commit(0, 7, files)[MANIFEST_NAME]
    want[MANIFEST_NAME] = hashlib.sha256(manifest).digest()
    del files
    # Polled every millisecond: the copy in progress is caught before it completes.
    wait_until("a copy in progress (bytes in its temporary folder)",
               lambda: (tmps := tmp_dirs(incoming)) and bytes_under(tmps[0]) > 0, 30,
               poll_s=0.001)
    # Mid-copy: the inventory does not list it.
    assert (0, 7) not in {(c.origin_rank, c.step) for c in cl.inventory(1).copies}
    cl.kill(1)
    leftovers = tmp_dirs(incoming)
    assert leftovers, "the kill came after the copy completed"
    partial = sum(bytes_under(t) for t in leftovers)
    assert partial < 256 * MiB, "the kill came after the copy completed"
    assert not (incoming / "7").exists() and not (incoming / "7.files.json").exists()

    cl.start(1)
    for t in leftovers:  # cleaned before the restarted replicator serves
        assert not t.exists(), f"leftover {t} not cleaned on restart"
    # The partial copy never counts: until the copy is listed, no committed folder;
    # once listed, it is complete.
    wait_until("the copy complete after the restart", lambda: (0, 7) in {
        (c.origin_rank, c.step) for c in cl.inventory(1).copies}, 60, poll_s=0.02)
    assert digests(incoming / "7") == want
    assert tmp_dirs(incoming) == []
    assert "replicated to rank 1" in cl.log_text(0)


# -- a holder lost while a replaced host fetches from it ------------------------------


def test_holder_lost_during_restore_fetch(tmp_path: Path) -> None:
    # 3 slices of 1 host, 2 copies of every step: host 0's data lives on hosts 1 and 2.
    with MemoryCluster(tmp_path, 3, 1, replicas=2) as c:
        files = c.commit(0, 4, random_files(32, 256 << 10, seed=2))  # 8 MiB, and its manifest
        size = sum(map(len, files.values()))
        for r in (1, 2):
            c.commit(r, 4, random_files(2, 4096, seed=10 + r))
        c.wait_held(wanted_copies(3, 1, 2, 4))
        want = digests(c.root(0) / "4")
        c.replace_host(0)
        # Each file host 1 serves takes a while: the fetch from it is caught midway.
        c.net.delay(0.05, "Fetch", src=0, dst=1)

        def lose_holder_mid_fetch() -> None:
            wait_until("host 0 fetching from host 1", lambda: c.net.calls[("Fetch", 0, 1)] >= 3)
            c.kill(1)

        replies, _ = at_once(lambda: c.prepare([0, 1, 2]), lose_holder_mid_fetch)
        r0, r2 = replies[0], replies[2]
        assert isinstance(r0, pb.PrepareRestoreReply), r0
        assert isinstance(r2, pb.PrepareRestoreReply), r2
        assert (r0.step, r0.tier) == (4, "peer")
        assert (r2.step, r2.tier) == (4, "local")
        assert digests(c.root(0) / "4") == want
        assert tmp_dirs(c.root(0)) == []
        # Some files came from host 1 until it was lost, the rest from host 2.
        assert 3 <= c.net.calls[("Fetch", 0, 1)] < len(files) - 1
        assert c.net.calls[("Fetch", 0, 2)] >= 1
        m0 = c.scrape(0)
        assert m0.get("mtc_failures_total{kind=fetch}", 0) >= 1, m0
        assert m0["mtc_restore_bytes_fetched_total"] == size


# -- a corrupted peer copy --------------------------------------------------------------


def test_corrupted_peer_copy_detected_on_restore(tmp_path: Path) -> None:
    # 4 slices of 1 host, 2 copies of every step.
    with MemoryCluster(tmp_path, 4, 1, replicas=2) as c:
        shared = random_files(1, 64 << 10, seed=5)  # a data-parallel shard: linked
        for r in range(4):
            c.commit(r, 5, {**shared, **{f"own-{r}-{k}": v for k, v in
                                         random_files(3, 32 << 10, seed=20 + r).items()}})
        c.wait_held(wanted_copies(4, 1, 2, 5))
        c.replace_host(0)
        # Flip a byte in every file of host 1's copy of host 0's data that is not a
        # hard link to host 1's own data (a deduplicated file is host 1's own too).
        flipped = 0
        for f in (c.root(1) / REPLICA_DIR / "0" / "5").iterdir():
            if f.stat().st_nlink == 1:
                data = bytearray(f.read_bytes())
                data[len(data) // 2] ^= 0x40
                f.write_bytes(bytes(data))
                flipped += 1
        assert flipped >= 2

        replies = c.prepared(range(4))
        assert {r: (x.step, x.tier) for r, x in replies.items()} == {
            0: (5, "peer"), 1: (5, "local"), 2: (5, "local"), 3: (5, "local")}
        # Host 1 checked its copy before offering it: the flipped files are
        # quarantined (it no longer lists the copy), so host 0 fetched from host 2.
        assert c.scrape(1)["mtc_quarantined_files_total"] == flipped
        assert c.net.calls[("Fetch", 0, 2)] >= 1
        # If host 1 lists the copy again (pushed again since), it is whole: listed
        # first, then read.
        if (0, 5) in {(x.origin_rank, x.step) for x in c.inventory(1).copies}:
            assert digests(c.root(1) / REPLICA_DIR / "0" / "5") == \
                digests(c.root(2) / REPLICA_DIR / "0" / "5")
        assert digests(c.root(0) / "5") == digests(c.root(2) / REPLICA_DIR / "0" / "5")


# -- the sender's own file corrupted after commit ----------------------------------------


def test_corrupted_own_file_not_replicated(tmp_path: Path) -> None:
    with MemoryCluster(tmp_path, 2, 1, start=False) as c:
        for r in (0, 1):
            c.root(r).mkdir(parents=True)
            c.commit(r, 3, random_files(2, 64 << 10, seed=30 + r))
        # Host 0's shard goes bad after the commit (its manifest still has the old CRC).
        shard = next(p for p in (c.root(0) / "3").iterdir() if p.name != MANIFEST_NAME)
        data = bytearray(shard.read_bytes())
        data[7] ^= 0x01
        shard.write_bytes(bytes(data))

        c.start_all()
        c.wait_held({(0, 1, 3)})  # the healthy direction works
        wait_until("three failures counted", lambda: sum(
            v for k, v in c.scrape(0).items() if k.startswith("mtc_failures_total")) >= 3,
            detail=lambda: c.scrape(0))
        # Found by host 0 before it offered anything: no target had to refuse it.
        assert c.scrape(0)["mtc_failures_total{kind=CorruptShardError}"] >= 3
        assert c.net.calls[("Offer", 0, 1)] == 0
        assert (1, 0, 3) not in c.held()
        assert not (c.root(1) / REPLICA_DIR / "0" / "3").exists()
        m0 = c.scrape(0)
        assert m0["mtc_newest_step{state=replicated}"] == -1
        # Named for what happened: the local data is corrupt, the peer is fine.
        assert m0.get("mtc_failures_total{kind=peer_unreachable}", 0) == 0, m0
        assert m0.get("mtc_failures_total{kind=peer_refused}", 0) == 0, m0
        assert c.alive(0) and c.alive(1)
