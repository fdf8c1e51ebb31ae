"""A byte's checksum computed once (``sidecar/replicator/store/store.py``): an mtc step's
files are trusted as their manifest's CRC32Cs say, as written, and read again only
once they changed; a data-parallel twin's shard (same path, same step, same size
and CRC32C) is identified as a dedup candidate without a hash pass.

Real files on a real store, in this process; a read is counted by wrapping the
store's one file-checksum function."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from replicators import commit_mtc_step

from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME
from mtc.sidecar.replicator.store import checksums, claims, step_files
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.store.store import LocalStore
from mtc.sidecar.storage import checksum


def mtc_step(root: Path, step: int, data: bytes, *, host: int = 0) -> None:
    commit_mtc_step(root, step, {"w.0": data}, host=host, num_hosts=host + 1,
                    slice_of_host=host)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = checksum.file_crc

    def counted(path: Path) -> tuple[int, int]:
        seen.append(Path(path).name)
        return real(path)

    for module in (checksums, step_files):  # checks, and walks of opaque steps
        monkeypatch.setattr(module, "file_crc", counted)
    return seen


def test_a_written_step_is_trusted_until_a_file_changes(tmp_path: Path,
                                                        reads: list[str]) -> None:
    root = tmp_path / "host-0"
    data = bytes(range(256)) * 64
    mtc_step(root, 3, data)
    s = LocalStore(root, rank=0)
    assert s.verify(0, 3) == []
    assert "w.0" not in reads  # as written: its manifest's CRC32C, never read again
    p = root / "3" / "w.0"
    bad = bytearray(data)
    bad[7] ^= 1
    p.write_bytes(bytes(bad))  # changed after its manifest: read, found bad
    future = os.stat(root / "3" / MANIFEST_NAME).st_mtime_ns + 10**9
    os.utime(p, ns=(future, future))
    assert [f.path for f in s.verify(0, 3)] == ["w.0"]
    assert "w.0" in reads and not p.exists()  # quarantined


def test_a_file_modified_before_the_store_first_looked_is_read(tmp_path: Path,
                                                               reads: list[str]) -> None:
    root = tmp_path / "host-0"
    mtc_step(root, 3, b"\1" * 4096)
    p = root / "3" / "w.0"
    later = os.stat(root / "3" / MANIFEST_NAME).st_mtime_ns + 10**9
    p.write_bytes(b"\2" * 4096)
    os.utime(p, ns=(later, later))  # modified after the manifest was written
    assert [f.path for f in LocalStore(root, rank=0).verify(0, 3)] == ["w.0"]
    assert "w.0" in reads


def test_a_twins_shard_is_identified_without_a_hash(tmp_path: Path) -> None:
    root = tmp_path / "host-2"
    data = b"\3" * 4096
    mtc_step(root, 5, data, host=2)
    s = LocalStore(root, rank=2)
    twin = FileMeta("w.0", len(data), crc32c(data))
    found = claims.find_identical(s, [twin, FileMeta("other.bin", len(data), crc32c(data))], 5)
    assert found["w.0"] == (root / "5" / "w.0", True)  # same path, same step
    assert found["other.bin"] == (root / "5" / "w.0", False)  # a hash must confirm
    assert claims.find_identical(s, [twin], 6)["w.0"][1] is False  # another step's
