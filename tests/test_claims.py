"""A peer's copy of bytes this host already holds is a claim on them, not a second
file (``LocalStore.claim``): two slices' data-parallel shards take the RAM disk
once per host. The bytes stay while any claim does; damage found through any
claim drops every claim (each copy then counts as damaged, its other files
intact) and the copies are healed from another host, as any damaged copy.

Real files on a real store, in this process (the replicators' Link, which
calls it, runs in tests/test_replicator.py and tests/test_heal.py)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
from replicators import commit_mtc_step

from mtc.errors import CorruptShardError
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.store import claims
from mtc.sidecar.replicator.store.copy_proofs import proof_path
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.store.store import REPLICA_DIR, LocalStore
from mtc.sidecar.storage.quarantine import quarantine, quarantined

SHARED = bytes(range(256)) * 64  # a data-parallel shard: both hosts saved it
STEP = 5


def meta(name: str, data: bytes) -> FileMeta:
    return FileMeta(name, len(data), crc32c(data))


def holder_with_a_claimed_copy(tmp_path: Path) -> tuple[LocalStore, Path, Path]:
    """Host 2 (its own step 5) holding host 0's step 5: the shared shard claimed,
    the rest written. Returns the store and the own and claimed paths."""
    origin = commit_mtc_step(tmp_path / "host-0", STEP, {"dp.0": SHARED, "own.0": b"zero" * 99},
                             host=0, num_hosts=4)
    root = tmp_path / "host-2"
    commit_mtc_step(root, STEP, {"dp.0": SHARED, "own.2": b"two" * 99}, host=2,
                    num_hosts=4, slice_of_host=1)
    store = LocalStore(root, rank=2)
    assert store.verify(2, STEP) == []
    candidates = claims.find_identical(store, [meta(n, d) for n, d in origin.items()], STEP)
    assert set(candidates) == {"dp.0"} and candidates["dp.0"][1]  # identified, no hash
    tmp = store.begin_incoming(0, STEP)
    for name, data in origin.items():
        if name in candidates:
            claims.claim(store, candidates[name][0], tmp / name, meta(name, data))
        else:
            (tmp / name).write_bytes(data)
    store.commit_incoming(tmp, 0, STEP, [meta(n, d) for n, d in origin.items()])
    return store, root / str(STEP) / "dp.0", root / REPLICA_DIR / "0" / str(STEP) / "dp.0"


def test_a_claimed_file_is_one_inode_and_both_copies_verify(tmp_path: Path) -> None:
    store, own, claimed = holder_with_a_claimed_copy(tmp_path)
    assert os.stat(own).st_ino == os.stat(claimed).st_ino
    assert os.stat(own).st_nlink == 2  # the bytes once on the RAM disk
    assert store.verify(0, STEP) == [] and store.verify(2, STEP) == []
    assert {(0, STEP), (2, STEP)} <= set(store.copies())
    # Retention removes the own step: the claim keeps the bytes.
    store.remove_copy(2, STEP)
    assert claimed.read_bytes() == SHARED and os.stat(claimed).st_nlink == 1
    assert store.verify(0, STEP) == []


@pytest.mark.parametrize("found_through", ["own", "claim"])
def test_damage_found_through_any_claim_drops_every_claim(tmp_path: Path,
                                                          found_through: str) -> None:
    store, own, claimed = holder_with_a_claimed_copy(tmp_path)
    # Damaged in place, silently (size and mtime kept): found only by a read.
    st = os.stat(own)
    with open(own, "r+b") as f:
        f.seek(9)
        f.write(bytes([SHARED[9] ^ 0xFF]))
    os.utime(own, ns=(st.st_atime_ns, st.st_mtime_ns))
    origin = 2 if found_through == "own" else 0
    assert [f.path for f in store.verify(origin, STEP, cached=False)] == ["dp.0"]
    assert not own.exists() and not claimed.exists()  # both quarantined
    assert store.damaged(0, STEP) and store.damaged(2, STEP)
    assert not {(0, STEP), (2, STEP)} & set(store.copies())
    assert store.quarantined_total == 2
    # The copies' other files are intact: a heal brings the one file back.
    assert (claimed.parent / "own.0").read_bytes() == b"zero" * 99


def test_a_damaged_file_is_never_claimed(tmp_path: Path) -> None:
    store, own, _ = holder_with_a_claimed_copy(tmp_path)
    own.write_bytes(SHARED[:-1] + b"x")  # changed (mtime too): read when checked
    with pytest.raises(CorruptShardError, match="fails"):
        claims.claim(store, own, tmp_path / "elsewhere", meta("dp.0", SHARED))
    assert not (tmp_path / "elsewhere").exists()
    assert not own.exists() and store.damaged(2, STEP)


def test_a_copy_missing_a_twins_file_is_put_back_from_the_twin_held_here(
        tmp_path: Path) -> None:
    store, own, claimed = holder_with_a_claimed_copy(tmp_path)
    claimed.unlink()  # the claim gone (the twin's own file intact)
    assert store.verify(0, STEP) and store.damaged(0, STEP)
    held = {(o, s) for o, s, _ in store.verified_copies()}
    assert (0, STEP) in held and not store.damaged(0, STEP)  # a claim again
    assert os.stat(claimed).st_ino == os.stat(own).st_ino
    # A file no copy here shares (host 0's own shard) is not put back.
    (claimed.parent / "own.0").unlink()
    assert (0, STEP) not in {(o, s) for o, s, _ in store.verified_copies()}
    assert store.damaged(0, STEP)


def test_the_sidecars_quarantine_takes_every_claim_along(tmp_path: Path) -> None:
    """A load that finds silent damage quarantines the file it read (the sidecar's
    side, sidecar/restore/load.py): the replicator's claim on the same bytes goes too, or
    the replicator, whose cache vouches for it, would serve or put back bad bytes."""
    store, own, claimed = holder_with_a_claimed_copy(tmp_path)
    assert store.verify(0, STEP) == []  # remembered as good
    quarantine(store.root, own, "checksum mismatch on load")
    assert not own.exists() and not claimed.exists()
    assert len(quarantined(store.root)) == 2
    assert (0, STEP) not in {(o, s) for o, s, _ in store.verified_copies()}
    assert (2, STEP) not in {(o, s) for o, s, _ in store.verified_copies()}


def test_a_copy_removed_meanwhile_is_never_made_again_half(tmp_path: Path) -> None:
    store, _, claimed = holder_with_a_claimed_copy(tmp_path)
    bad = [meta("dp.0", SHARED)]
    folder = claimed.parent
    shutil.rmtree(folder)  # gone between its verification and the put-back
    with pytest.raises(OSError):
        claims.reclaim(store, 0, STEP, bad)
    assert not folder.exists()


def test_a_twins_copy_that_came_before_the_own_save_is_folded_into_claims(
        tmp_path: Path) -> None:
    """The other order: host 0's copy arrives whole before host 2 saves its own
    step 5 (host 0's slice saved and pushed first). Once host 2's step is there,
    the copy's identical files become claims on it: the bytes once either way."""
    origin = commit_mtc_step(tmp_path / "host-0", STEP,
                             {"dp.0": SHARED, "dp.1": SHARED[::-1], "own.0": b"zero" * 99},
                             host=0, num_hosts=4)
    root = tmp_path / "host-2"
    root.mkdir()
    store = LocalStore(root, rank=2)
    tmp = store.begin_incoming(0, STEP)
    for name, data in origin.items():
        (tmp / name).write_bytes(data)
    store.commit_incoming(tmp, 0, STEP, [meta(n, d) for n, d in origin.items()])
    assert claims.fold(store, STEP) == 0  # nothing of its own yet
    # dp.1 differs here (another run's bytes under the same path): never folded.
    commit_mtc_step(root, STEP, {"dp.0": SHARED, "dp.1": SHARED, "own.2": b"two" * 99},
                    host=2, num_hosts=4, slice_of_host=1)
    copy = root / REPLICA_DIR / "0" / str(STEP)
    own = root / str(STEP)
    assert os.stat(copy / "dp.0").st_ino != os.stat(own / "dp.0").st_ino

    assert claims.fold(store, STEP) == 1
    assert os.stat(copy / "dp.0").st_ino == os.stat(own / "dp.0").st_ino
    assert os.stat(copy / "dp.1").st_ino != os.stat(own / "dp.1").st_ino
    assert (copy / "dp.1").read_bytes() == SHARED[::-1]
    assert store.verify(0, STEP, cached=False) == [] and store.verify(2, STEP, cached=False) == []
    assert claims.fold(store, STEP) == 0  # already one
    assert sorted(p.name for p in (root / REPLICA_DIR / "0").iterdir()) == [
        str(STEP), f"{STEP}.files.json"]  # no scratch left behind
    # A claim like any other: damage found through it drops both names.
    store.remove_copy(2, STEP)
    assert (copy / "dp.0").read_bytes() == SHARED and store.verify(0, STEP) == []


def test_a_damaged_own_file_is_never_folded_into(tmp_path: Path) -> None:
    origin = commit_mtc_step(tmp_path / "host-0", STEP, {"dp.0": SHARED}, host=0, num_hosts=4)
    root = tmp_path / "host-2"
    root.mkdir()
    store = LocalStore(root, rank=2)
    tmp = store.begin_incoming(0, STEP)
    (tmp / "dp.0").write_bytes(origin["dp.0"])
    store.commit_incoming(tmp, 0, STEP, [meta("dp.0", SHARED)])
    commit_mtc_step(root, STEP, {"dp.0": SHARED}, host=2, num_hosts=4, slice_of_host=1)
    own = root / str(STEP) / "dp.0"
    own.write_bytes(SHARED[:-1] + b"x")  # changed after its manifest: read when checked
    assert claims.fold(store, STEP) == 0
    copy = root / REPLICA_DIR / "0" / str(STEP) / "dp.0"
    assert copy.read_bytes() == SHARED and os.stat(copy).st_nlink == 1


def test_a_copy_held_once_already_is_not_looked_at_file_by_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every save folds its step's copies; once a copy's files are one with the own
    ones (a Link, an earlier fold) one listing of each folder says so, and no file
    is checked on its own (for 180 shards that took 6 ms a call)."""
    store, own, claimed = holder_with_a_claimed_copy(tmp_path)
    assert os.stat(own).st_ino == os.stat(claimed).st_ino
    looked_at: list[str] = []
    real_inside = claims.inside

    def counting(base: Path, rel: str) -> Path:
        looked_at.append(rel)
        return real_inside(base, rel)

    monkeypatch.setattr(claims, "inside", counting)
    assert claims.fold(store, STEP) == 0
    assert looked_at == []
    # A file that is not one yet still is (the listing only skips what is one).
    os.unlink(claimed)
    claimed.write_bytes(SHARED)
    assert claims.fold(store, STEP) == 1
    assert set(looked_at) == {"dp.0"} and os.stat(own).st_ino == os.stat(claimed).st_ino


def _keep_proof(store: LocalStore, origin: int, shas: dict[str, bytes],
                files: dict[str, bytes]) -> None:
    """The entry ``origin`` signed of its step, kept beside the copy as an Offer
    keeps it (only its files' SHA-256s are read back here)."""
    entry = pb.StepCopy(step=STEP, origin_rank=origin, files=[
        pb.FileInfo(path=n, size=len(d), crc32c=crc32c(d), sha256=shas[n])
        for n, d in sorted(files.items())])
    path = proof_path(store.replicas, origin, STEP)
    (path.parent / "proof.tmp").write_bytes(entry.SerializeToString())
    os.replace(path.parent / "proof.tmp", path)


def test_under_mutual_tls_a_twin_puts_back_only_the_bytes_the_origin_signed(
        tmp_path: Path) -> None:
    """A twin's file of the same path, size and CRC32C is what a forger can make
    (CRC32C is chosen at will): under mutual TLS a copy's missing file is put back
    from it only when its SHA-256 is the one the copy's origin signed."""
    store, own, claimed = holder_with_a_claimed_copy(tmp_path)
    store.signed_only = True
    files = {"dp.0": SHARED, "own.0": b"zero" * 99}
    claimed.unlink()

    def held() -> set[tuple[int, int]]:
        return {(o, s) for o, s, _ in store.verified_copies()}

    assert (0, STEP) not in held()  # no proof kept with the copy: nothing to check against
    _keep_proof(store, 0, {"dp.0": hashlib.sha256(b"other bytes").digest(),
                           "own.0": hashlib.sha256(files["own.0"]).digest()}, files)
    assert (0, STEP) not in held() and not claimed.exists()  # signed for other bytes
    _keep_proof(store, 0, {n: hashlib.sha256(d).digest() for n, d in files.items()}, files)
    assert (0, STEP) in held() and not store.damaged(0, STEP)
    assert os.stat(claimed).st_ino == os.stat(own).st_ino


@pytest.mark.parametrize("signed_only", [False, True])
def test_under_mutual_tls_an_own_step_is_never_put_back_from_a_twin(
        tmp_path: Path, signed_only: bool) -> None:
    """Host 2's own file lost, host 0's identical one held here: without TLS it is
    put back from it; under mutual TLS the own step stays damaged, for a heal from
    another host checked against host 2's own signature (materialize.py)."""
    store, own, _ = holder_with_a_claimed_copy(tmp_path)
    store.signed_only = signed_only
    own.unlink()
    damaged: list[tuple[int, list[FileMeta]]] = []
    held = {(o, s) for o, s, _ in store.verified_copies(damaged_own=damaged)}
    assert ((2, STEP) in held) is not signed_only
    assert [(s, [f.path for f in bad]) for s, bad in damaged] == \
        ([(STEP, ["dp.0"])] if signed_only else [])
    assert own.exists() is not signed_only
