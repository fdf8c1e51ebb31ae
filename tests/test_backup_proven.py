"""The backup leader commits a step only where each holder's upload hashes as the
origin signed: a holder with a valid certificate may upload another rank's data,
never make it up (mutual TLS; the copies' proofs: sidecar/replicator/copies/provenance.py).

Real parts: the local backend in a folder, the node side's ``upload_part`` reading
real files; the call to the holder is a function here (its gRPC is tested in the
replicator's process tests)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.backend import CorruptBackupError
from mtc.sidecar.backup.job import BackupStore, back_up_step, check_proven, upload_part
from mtc.sidecar.backup.local import LocalBackend
from mtc.sidecar.replicator.store.step_files import FileMeta

STEP = 7


def _copies(tmp_path: Path, forged: bool) -> tuple[dict[int, Path], dict[int, list[FileMeta]],
                                                   dict[tuple[int, str], str]]:
    """Rank 0's and rank 1's data, each held by the other host; with ``forged`` the
    holder of rank 0's copy (host 1) holds other bytes of the same size."""
    dirs, metas, proven = {}, {}, {}
    for origin in (0, 1):
        real = bytes([origin + 1]) * 4096
        d = tmp_path / f"holder-{1 - origin}" / str(origin) / str(STEP)
        d.mkdir(parents=True)
        (d / "a.bin").write_bytes(b"\0" * 4096 if forged and origin == 0 else real)
        dirs[origin] = d
        # The manifest's CRC32C is of what the holder lists (a forger lists its own).
        metas[origin] = [FileMeta("a.bin", 4096, crc32c((d / "a.bin").read_bytes()))]
        proven[(origin, "a.bin")] = hashlib.sha256(real).hexdigest()
    return dirs, metas, proven


@pytest.mark.parametrize("forged", [False, True])
def test_an_upload_that_hashes_otherwise_than_its_origin_signed_is_not_committed(
        tmp_path: Path, forged: bool) -> None:
    dirs, metas, proven = _copies(tmp_path, forged)
    backend = LocalBackend(str(tmp_path / "bucket"))
    store = BackupStore(backend)
    sources = {r: [(1 - r, r, metas[r])] for r in (0, 1)}

    def call(holder: int, req: pb.BackupPartRequest) -> pb.BackupPartReply:
        origin = req.origin_rank
        return upload_part(backend, dirs[origin], {m.path: m for m in metas[origin]}, req)

    if not forged:
        back_up_step(store, STEP, sources, call, proven=proven)
        assert STEP in store.committed_steps()
        return
    with pytest.raises(CorruptBackupError, match="rank 0's file differs") as e:
        back_up_step(store, STEP, sources, call, proven=proven)
    assert e.value.step == STEP and e.value.host == 1 and e.value.path == "a.bin"
    assert STEP not in store.committed_steps()


@pytest.mark.parametrize(("digests", "proven", "bad"), [
    ({(0, "a"): ("aa", True)}, {}, None),  # nothing signed (no TLS): nothing to check
    ({(0, "a"): ("aa", True)}, {(0, "a"): "aa"}, None),
    ({(0, "a"): ("aa", True)}, {(0, "a"): "bb"}, "a"),
    ({(0, "a"): ("aa", False), (1, "b"): ("cc", True)}, {(1, "b"): "dd"}, "b"),  # hashed only
    ({(0, "a"): ("aa", True)}, {(1, "a"): "bb"}, None),  # another origin's file
])
def test_check_proven(digests: dict[tuple[int, str], tuple[str, bool]],
                      proven: dict[tuple[int, str], str], bad: str | None) -> None:
    if bad is None:
        check_proven(digests, proven, {0: 1, 1: 0}, STEP)
        return
    with pytest.raises(CorruptBackupError) as e:
        check_proven(digests, proven, {0: 1, 1: 0}, STEP)
    assert e.value.path == bad
