"""What a replicator spends when there is little to do: the simulated hosts share
the trainer's cores, so every idle check and every byte zeroed is taken from the
training (bench/goodput.py measures what that costs; these tests check that the
cheaper paths still give the same answers)."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mtc.errors import UnsafePathError
from mtc.integrity import crc32c
from mtc.sidecar.backup.backend import open_backend
from mtc.sidecar.backup.schedule import BackupPolicy, BackupScheduler
from mtc.sidecar.replicator.store import checksums, step_files, store
from mtc.sidecar.storage.checksum import (
    CHUNK,
    STREAM_CHUNK,
    copy_stream,
    copy_verified,
    file_crc,
    file_sha256,
    read_buffer,
)

REPO = Path(__file__).resolve().parents[1]


class CountingNode:
    """The two questions the scheduler asks a node before backing up (a fake of
    :class:`~mtc.sidecar.backup.duties.BackupDuties`: only what it is asked is
    counted; the real loop runs in tests/test_backup_tier.py)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def leads(self) -> bool:
        self.asked.append("leads")
        return True

    def gather(self) -> dict[int, Any]:
        self.asked.append("gather")
        return {}

    def newest_complete_run(self, invs: dict[int, Any]) -> tuple[int, str]:
        return -1, ""  # nothing complete: nothing is backed up either way


@pytest.mark.parametrize("policy, due", [
    (BackupPolicy(interval_minutes=60.0), False),
    (BackupPolicy(interval_minutes=None, interval_steps=None), False),
    (BackupPolicy(interval_minutes=0.0, interval_steps=5), True),
    (BackupPolicy(interval_minutes=1e-9), True),
])
def test_backup_pass_asks_nobody_until_a_backup_can_be_due(
        tmp_path: Path, policy: BackupPolicy, due: bool) -> None:
    sched = BackupScheduler(open_backend((tmp_path / "b").as_uri()), policy)
    node = CountingNode()
    assert sched.run_once(node) == -1  # type: ignore[arg-type]
    # A time interval not yet passed needs no inventory from anyone (the loop
    # runs twice a second on every node); a step interval needs the newest
    # complete step, so it gathers.
    assert node.asked == (["leads", "gather"] if due else [])
    sched.request()
    assert sched.run_once(node) == -1  # type: ignore[arg-type]
    assert node.asked[-2:] == ["leads", "gather"]  # a request is always acted on


SIZES = [0, 1, 4097, CHUNK - 1, CHUNK, CHUNK + 1, 2 * STREAM_CHUNK + 5]


@pytest.mark.parametrize("size", SIZES)
def test_checksums_and_copies_with_buffers_the_size_of_the_file(tmp_path: Path,
                                                                size: int) -> None:
    data = os.urandom(size)
    src = tmp_path / "src"
    src.write_bytes(data)
    want = crc32c(data)
    assert file_crc(src) == file_crc(src, STREAM_CHUNK) == (size, want)
    assert file_sha256(src) == hashlib.sha256(data).digest()
    assert copy_verified(src, tmp_path / "copy", size, want) in ("copy", "reflink")
    assert (tmp_path / "copy").read_bytes() == data
    with src.open("rb", buffering=0) as f:
        assert len(read_buffer(f, CHUNK)) == max(1, min(size, CHUNK))
    out = io.BytesIO()
    with src.open("rb") as f:
        assert copy_stream(f, out) == (size, want)
    assert out.getvalue() == data
    # A stream of unknown length (no file behind it) is read in whole chunks.
    out = io.BytesIO()
    assert copy_stream(io.BytesIO(data), out, 0) == (size, want)
    assert out.getvalue() == data


def test_a_digest_is_read_once_per_file_version_and_forgotten_with_its_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deduplication asks a replicator for the SHA-256 of its own files twice per
    save (pushing its step, holding its twin's): the second answer comes from
    memory, a rewritten file is read again, and a removed step's entries go."""
    s = store.LocalStore(tmp_path / "root", 0, orbax=True)  # an opaque step is its own
    step = tmp_path / "root" / "5"
    step.mkdir()
    f = step / "a.bin"
    f.write_bytes(b"x" * 1000)
    reads: list[Path] = []
    real = checksums.file_sha256
    monkeypatch.setattr(checksums, "file_sha256", lambda p: reads.append(p) or real(p))
    first = s.checksums.sha256(f)
    assert s.checksums.sha256(f) == first == hashlib.sha256(b"x" * 1000).digest()
    assert reads == [f]
    f.unlink()
    f.write_bytes(b"y" * 1000)  # a new inode: another file under the same name
    assert s.checksums.sha256(f) == hashlib.sha256(b"y" * 1000).digest()
    assert len(reads) == 2
    s.checksums.note_verified(f, step_files.FileMeta("a.bin", 1000, crc32c(b"y" * 1000)))
    assert s.checksums._shas and s.checksums._crcs
    s.remove_copy(0, 5)
    assert not step.exists() and not s.checksums._shas and not s.checksums._crcs


def test_a_cache_of_many_live_files_is_swept_once_per_doubling_not_per_removal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksums, "CACHE_SWEEP", 2)
    s = store.LocalStore(tmp_path / "root", 0)
    live = tmp_path / "root" / "live"
    live.mkdir()
    for i in range(5):  # live files, still held
        (live / f"{i}.bin").write_bytes(b"x")
        s.checksums.note_verified(live / f"{i}.bin",
                                  step_files.FileMeta(f"{i}.bin", 1, crc32c(b"x")))
    # Removed behind the store's back:
    s.checksums._crcs[str(tmp_path / "gone.bin")] = ((0, 1, 0), 0)
    swept: list[str] = []
    real = os.path.lexists
    monkeypatch.setattr(os.path, "lexists", lambda p: swept.append(p) or real(p))
    for step in (7, 8, 9):
        (tmp_path / "root" / str(step)).mkdir()
        s.remove_copy(0, step)
    assert len(swept) == 6  # one sweep of the 6 entries, then none until the cache doubles
    assert sorted(s.checksums._crcs) == sorted(str(live / f"{i}.bin") for i in range(5))


def test_inside_looks_only_at_the_parts_below_the_base_and_still_refuses_escapes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The containment check resolves a whole path only when one of the relative
    path's own parts is a link: the answers are those of resolving every path."""
    real_base = tmp_path / "deep" / "er" / "base"
    (real_base / "d").mkdir(parents=True)
    (real_base / "d" / "f.bin").write_bytes(b"x")
    base = tmp_path / "link-to-base"  # the base itself may be reached through a link
    base.symlink_to(real_base)
    outside = tmp_path / "outside"
    outside.mkdir()
    (real_base / "out-dir").symlink_to(outside)
    (real_base / "out-file").symlink_to(outside / "secret")
    (real_base / "in-dir").symlink_to(real_base / "d")
    resolved: list[str] = []
    real = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p: resolved.append(p) or real(p))
    assert step_files.inside(base, "d/f.bin") == base / "d" / "f.bin"
    assert step_files.inside(base, "d/new/g.bin") == base / "d" / "new" / "g.bin"
    assert step_files.inside(base, "new/g.bin") == base / "new" / "g.bin"
    assert resolved == []  # no link among the parts: nothing resolved
    assert step_files.inside(base, "in-dir/f.bin") == base / "in-dir" / "f.bin"
    for rel in ("out-dir/x", "out-file", "out-dir"):
        with pytest.raises(UnsafePathError):
            step_files.inside(base, rel)
    for rel in ("../x", "d/../../x", "/etc/passwd", "d//f.bin", ""):
        with pytest.raises(UnsafePathError):
            step_files.inside(base, rel)


def test_the_host_count_is_read_without_building_the_manifest() -> None:
    from mtc.errors import ManifestError
    from mtc.manifest import Manifest

    data = Manifest(step=3, host=1, slice=0, num_hosts=4, leaves=()).to_bytes()
    assert Manifest.num_hosts_of(data) == Manifest.from_bytes(data).num_hosts == 4
    for bad in (data.replace(b'"num_hosts', b'"num_hostz'), b"{}", b"not json",
                Manifest(step=3, host=0, slice=0, num_hosts=1, leaves=()).to_bytes()
                .replace(b'\\"host\\":0', b'\\"host\\":5')):
        with pytest.raises(ManifestError):
            Manifest.num_hosts_of(bad)
        with pytest.raises(ManifestError):
            Manifest.from_bytes(bad)


@pytest.mark.process
def test_copy_from_a_pipe_is_not_read_a_byte_at_a_time(tmp_path: Path) -> None:
    r, w = os.pipe()
    data = os.urandom(3 << 20)
    with os.fdopen(w, "wb") as fw:
        writer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.buffer.write("
                                   "sys.stdin.buffer.read())"], stdin=subprocess.PIPE,
                                  stdout=fw)
    assert writer.stdin is not None
    writer.stdin.write(data)
    writer.stdin.close()
    reads: list[int] = []
    with os.fdopen(r, "rb", buffering=0) as fr:

        class Counting(io.RawIOBase):
            def readinto(self, b: Any) -> int:
                n = fr.readinto(b)
                reads.append(n or 0)
                return n or 0

            def fileno(self) -> int:
                return fr.fileno()

        out = io.BytesIO()
        assert copy_stream(Counting(), out) == (len(data), crc32c(data))
    assert writer.wait(30) == 0
    assert out.getvalue() == data
    assert len(reads) < 1000  # 3 MiB through a pipe: its buffer's size per read, not 1 byte


@pytest.mark.process
def test_replicator_nice_lowers_the_process_and_its_session_group() -> None:
    """``--nice``: where sessions are scheduling groups (autogroup), a process's
    nice alone does not give the other sessions their cores back."""
    code = ("import os\nfrom mtc.sidecar.replicator.main import lower_priority\n"
            "lower_priority(7)\nprint(os.nice(0))\n"
            "p = '/proc/self/autogroup'\n"
            "print(open(p).read().split('nice')[1].strip() if os.path.exists(p) else 'none')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, start_new_session=True, timeout=60, check=True)
    nice, group = out.stdout.split()
    assert int(nice) == min(19, os.nice(0) + 7)
    if group != "none":
        assert int(group) >= 7
