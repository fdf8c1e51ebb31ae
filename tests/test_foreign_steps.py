"""A RAM disk that outlives its job holds another rank's steps: the replicator leaves them be.

GKE's multi-tier checkpointing volume is a tmpfs of the node, not of the pod: when
a JobSet is recreated and its pods land on other nodes (or in another rank order),
a host's root may hold steps another rank wrote. An mtc step says whose it is in
its manifest (host, step); the replicator must neither offer nor serve such a step
as its own copy, nor delete it by its retention. Real replicator processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from replicators import Cluster, commit_mtc_step, commit_raw_step, new_cluster

from mtc.grpc_errors import PeerError
from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME, Manifest
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.store.step_files import not_ours
from mtc.sidecar.replicator.store.store import LocalStore
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process


def mtc_step(root: Path, step: int, host: int, num_hosts: int, fill: int) -> dict[str, bytes]:
    """Commit an mtc step as ``host`` would: one shard file and its manifest."""
    return commit_mtc_step(root, step, {"w.0": bytes([fill]) * 4096}, host=host,
                           num_hosts=num_hosts, slice_of_host=host)


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_store_tells_its_steps_from_another_ranks(tmp_path: Path) -> None:
    root = tmp_path / "host-0"
    root.mkdir()
    mtc_step(root, 5, host=0, num_hosts=2, fill=1)
    mtc_step(root, 7, host=1, num_hosts=2, fill=2)   # rank 1's step 7
    mtc_step(root, 8, host=0, num_hosts=2, fill=3)
    (root / "8" / MANIFEST_NAME).write_bytes(          # a manifest of step 6 in folder 8
        Manifest.from_bytes((root / "8" / MANIFEST_NAME).read_bytes()).__class__(
            step=6, host=0, slice=0, num_hosts=2, leaves=()).to_bytes())
    commit_raw_step(root, 9, {"ocdbt.process_0/d": b"orbax"})  # no manifest: Orbax's
    (root / "10").mkdir()
    (root / "10" / MANIFEST_NAME).write_bytes(b"{torn")
    store = LocalStore(root, rank=0)
    # Beside mtc, the manifest-less folder is not mtc's: never offered (or deleted).
    assert store.own.steps() == [5]
    assert store.copies() == [(0, 5)]
    # Serving Orbax's client, it is this host's step, as that client has it.
    assert LocalStore(root, rank=0, orbax=True).own.steps() == [5, 9]
    # Rank 0's step 7 would be in the replica area, never the other rank's folder.
    assert store.copy_dir(0, 7) == root / ".mtc-replica" / "0" / "7"
    store.remove_copy(0, 7)
    store.remove_copy(0, 10)
    assert (root / "7" / "w.0").read_bytes() == bytes([2]) * 4096
    assert (root / "10" / MANIFEST_NAME).read_bytes() == b"{torn"
    # The same store on rank 1 sees step 7 as its own.
    assert LocalStore(root, rank=1).own.steps() == [7]


def test_a_step_of_a_job_back_on_other_ranks_is_the_rank_its_manifest_names(
        tmp_path: Path) -> None:
    root = tmp_path / "host-2"
    root.mkdir()
    # A job of 2 on ranks 2 and 3 saved step 4 here as its host 0.
    mtc_step(root, 4, host=0, num_hosts=2, fill=1)
    m = Manifest.from_bytes((root / "4" / MANIFEST_NAME).read_bytes())
    (root / "4" / MANIFEST_NAME).write_bytes(
        Manifest(step=4, host=0, slice=0, num_hosts=2, leaves=m.leaves,
                 ranks=(2, 3)).to_bytes())
    assert LocalStore(root, rank=2).own.steps() == [4]
    assert LocalStore(root, rank=0).own.steps() == []  # host 0 of that job is rank 2


def test_replicator_neither_serves_nor_deletes_another_ranks_steps(
        tmp_path: Path, clusters: list[Cluster]) -> None:
    """Two slices of one host. Host 0's RAM disk still holds rank 1's steps 3 and 7
    from an earlier job, and an Orbax user's step 4 (no manifest); the job now saves
    steps 5 and 9 on both hosts, keeping one."""
    cl = new_cluster(clusters, tmp_path, 2, 1, extra=("--replicas", "1", "--keep", "1"))
    foreign = {s: mtc_step(cl.root(0), s, host=1, num_hosts=2, fill=s) for s in (3, 7)}
    foreign[4] = {"_CHECKPOINT_METADATA": b'{"step": 4}', "state/ocdbt.process_0/d": b"orbax"}
    commit_raw_step(cl.root(0), 4, foreign[4])
    for rank in (0, 1):
        mtc_step(cl.root(rank), 5, host=rank, num_hosts=2, fill=50 + rank)
    cl.start_all()
    cl.wait_replicated(5)
    inv = cl.inventory(0)
    assert {(c.origin_rank, c.step) for c in inv.copies} == {(0, 5), (1, 5)}
    # Nothing of the other rank's steps was offered to host 0's peer, under either rank.
    assert {(c.origin_rank, c.step) for c in cl.inventory(1).copies} == {(0, 5), (1, 5)}

    # Asked for them as rank 0's copies (or as rank 1's), host 0 has none to serve.
    client = cl.client(0)
    try:
        # (As its own rank's: "not restoring that step"; as rank 1's: "no copy here".)
        for origin, code in ((0, "FAILED_PRECONDITION"), (1, "NOT_FOUND")):
            with pytest.raises(PeerError) as e:
                client.data.fetch_bytes(7, origin, "w.0", 4096, crc32c(foreign[7]["w.0"]))
            assert e.value.code is not None and e.value.code.name == code, e.value
        with pytest.raises(PeerError) as e:  # nor the Orbax step, as its own
            client.data.fetch_bytes(4, 0, "_CHECKPOINT_METADATA", 11, crc32c(b'{"step": 4}'))
        assert e.value.code is not None and e.value.code.name == "FAILED_PRECONDITION"
        prepared = client.call("GetInventory", pb.InventoryRequest(origins=[0, 1]))
        assert all(c.step not in (3, 4, 7) for c in prepared.copies)
    finally:
        client.close()

    # A newer step replicated: retention (--keep 1) deletes step 5 on both hosts, and
    # leaves the other rank's steps, older and newer, as they were.
    for rank in (0, 1):
        mtc_step(cl.root(rank), 9, host=rank, num_hosts=2, fill=90 + rank)
    cl.wait_replicated(9)
    wait_until("step 5 deleted by retention", lambda: not (cl.root(0) / "5").exists()
          and not (cl.root(1) / "5").exists())
    for s, files in foreign.items():
        assert tree(cl.root(0) / str(s)) == files, f"foreign step {s} was changed"
    assert "is not this host's step: its manifest is host 1's step 7" in cl.log_text(0)
    assert "4 is not this host's step: it has no mtc manifest" in cl.log_text(0)
    assert cl.alive(0) and cl.alive(1)


def test_whose_step_a_folder_is_decided_from_its_manifest_alone() -> None:
    def manifest(step: int, host: int, ranks: tuple[int, ...] = ()) -> bytes:
        return Manifest(step=step, host=host, slice=host, num_hosts=2, leaves=(),
                        ranks=ranks).to_bytes()

    assert not_ours(manifest(4, 1), "m", 1, 4, orbax=False) is None
    assert not_ours(manifest(4, 1), "m", 1, 4, orbax=True) is None
    assert not_ours(manifest(4, 1), "m", 0, 4, orbax=False) == "its manifest is host 1's step 4"
    assert not_ours(manifest(3, 1), "m", 1, 4, orbax=False) == "its manifest is host 1's step 3"
    # A job back on other ranks: host 0 of 2 is rank 2.
    assert not_ours(manifest(4, 0, (2, 3)), "m", 2, 4, orbax=False) is None
    assert not_ours(manifest(4, 0, (2, 3)), "m", 0, 4, orbax=False) == \
        "its manifest is host 0's step 4 (rank 2)"
    # No manifest: an Orbax step, this rank's only when serving Orbax's client.
    assert not_ours(None, "", 0, 4, orbax=True) is None
    assert "no mtc manifest" in str(not_ours(None, "", 0, 4, orbax=False))
    assert "unreadable" in str(not_ours(b"{torn", "m", 0, 4, orbax=False))
