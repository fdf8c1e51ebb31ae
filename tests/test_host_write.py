"""The host side's write path, module by module: the staging pool (sidecar/save/buffers.py)
and the writer (sidecar/save/write.py): every byte written and checksummed before the
rename that commits a step, and a failed save leaves nothing behind."""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest

from mtc import layout
from mtc.errors import RamDiskFullError, StepExistsError
from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME, LeafEntry, Manifest, ShardEntry
from mtc.sidecar.save.buffers import StagingPool
from mtc.sidecar.save.write import WRITE_CHUNK, WRITER_RESERVE_DIR, HostSave, StagedShard, Writer
from mtc.testing.waits import wait_until

# -- the staging pool --------------------------------------------------------------------


def test_the_pool_bounds_what_is_held_and_reuses_freed_buffers() -> None:
    pool = StagingPool(100)
    a = pool.acquire(60)
    assert a is not None and pool.held == 60
    assert pool.acquire(60, block=False) is None  # would exceed the budget
    pool.release(60, a)
    b = pool.acquire(60)
    assert b is a  # the freed buffer comes back: warm memory
    pool.release(60, b)
    assert pool.held == 0


def test_a_buffer_larger_than_the_budget_is_allowed_alone() -> None:
    pool = StagingPool(10)
    big = pool.acquire(50)  # a save could never progress otherwise
    assert big is not None and big.nbytes == 50
    assert pool.acquire(1, block=False) is None
    pool.release(50)
    assert pool.acquire(1, block=False) is not None


class _SeenWaiting(threading.Condition):
    """The pool's condition, telling the test that an acquire waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_a_blocked_acquire_wakes_when_memory_is_released() -> None:
    pool = StagingPool(100)
    pool._cv = cv = _SeenWaiting()  # nothing waits on it yet
    first = pool.acquire(80)
    got: list[np.ndarray | None] = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(50)))
    t.start()
    assert cv.waiting.wait(5)  # waiting for room (the release below must wake it)
    assert t.is_alive() and not got
    pool.release(80, first)
    t.join(5)
    assert got and got[0] is not None and pool.held == 50


def test_reserve_and_account_count_without_buffers() -> None:
    pool = StagingPool()
    pool.ensure_capacity(100)
    pool.ensure_capacity(5)  # only the first size counts
    assert pool.capacity == 100
    assert pool.reserve(70) and not pool.reserve(40)
    assert pool.account(30, block=False) and not pool.account(1, block=False)
    assert pool.can_fit_now(0)
    pool.release(100)
    assert pool.held == 0


# -- the writer ---------------------------------------------------------------------------


def leaf(n: int) -> LeafEntry:
    return LeafEntry(f"['x{n}']", (("d", f"x{n}"),), "array", (4,), "float32")


def save_of(root: Path, step: int, shards: list[np.ndarray], run: str = "r1") -> HostSave:
    save = HostSave(root, step, 0, 0, 1, [leaf(i) for i in range(len(shards))], run)
    released: list[int] = []
    for i, data in enumerate(shards):
        save.add(StagedShard(i, ((0, 4),), data, lambda i=i: released.append(i)))
    save.seal()
    save.go.set()
    save.released = released  # type: ignore[attr-defined]
    return save


def shard_entries(final: Path) -> list[ShardEntry]:
    """The shards a committed step's manifest lists, in order."""
    m = Manifest.from_bytes((final / MANIFEST_NAME).read_bytes())
    return [s for lf in m.leaves for s in lf.shards]


def test_a_save_is_committed_with_checksums_manifest_last(tmp_path: Path) -> None:
    writer = Writer(2)
    try:
        shards = [np.arange(4, dtype=np.float32) + i for i in range(3)]
        save = save_of(tmp_path, 7, shards)
        writer.submit(save)
        final = save.done.result(10)
    finally:
        writer.close()
    assert final == tmp_path / "7" and layout.committed_steps(tmp_path) == [7]
    m = Manifest.from_bytes((final / MANIFEST_NAME).read_bytes())
    assert (m.step, m.run) == (7, "r1")
    for i, entry in enumerate(s for lf in m.leaves for s in lf.shards):
        data = (final / entry.file).read_bytes()
        assert data == shards[i].tobytes() and entry.crc32c == crc32c(data)
    assert sorted(save.released) == [0, 1, 2]  # type: ignore[attr-defined]
    assert not [n for n in os.listdir(tmp_path) if layout.TMP_MARK in n]


def test_a_shard_larger_than_a_write_chunk_is_checksummed_whole(tmp_path: Path) -> None:
    # The checksum is taken chunk by chunk as the shard is written: it must be the
    # whole file's, also across a chunk boundary and a short last chunk.
    writer = Writer(1)
    try:
        big = np.random.default_rng(0).integers(0, 1 << 30, (5 * WRITE_CHUNK) // 8,
                                                 dtype=np.int32)
        save = save_of(tmp_path, 3, [big, np.arange(3, dtype=np.float32)])
        writer.submit(save)
        final = save.done.result(10)
    finally:
        writer.close()
    entries = shard_entries(final)
    assert entries[0].nbytes > 2 * WRITE_CHUNK and entries[0].nbytes % WRITE_CHUNK
    for entry, data in zip(entries, (big, np.arange(3, dtype=np.float32)), strict=True):
        assert (final / entry.file).read_bytes() == data.tobytes()
        assert entry.crc32c == crc32c(data.tobytes())


def test_a_step_already_committed_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "keep").write_text("earlier")
    writer = Writer(1)
    try:
        save = save_of(tmp_path, 7, [np.zeros(4, np.float32)])
        writer.submit(save)
        with pytest.raises(StepExistsError):
            save.done.result(10)
    finally:
        writer.close()
    assert (tmp_path / "7" / "keep").read_text() == "earlier"
    assert os.listdir(tmp_path) == ["7"]  # the temporary folder is gone


def _owner(n: int) -> ctypes.Array[ctypes.c_uint8]:
    """Memory whose lifetime a test watches (as a reused area slot is watched): a
    ctypes array exports its bytes and takes weak references on every Python."""
    return (ctypes.c_uint8 * n)()


@pytest.mark.parametrize("fails", [False, True])
def test_a_written_or_failed_save_keeps_no_reference_to_its_bytes(tmp_path: Path,
                                                                  fails: bool) -> None:
    """Once a save ended, written or failed (its error kept to be raised later), no
    thread or kept error refers to its staged bytes: a buffer reused once its last
    reference goes (a colocated call's slot) is free."""
    if fails:
        (tmp_path / "7").mkdir()  # the commit's rename fails
    owners = [_owner(16) for _ in range(3)]
    gone = [weakref.ref(o) for o in owners]
    writer = Writer(2)
    try:
        save = save_of(tmp_path, 7, [np.frombuffer(o, np.float32) for o in owners])
        del owners
        writer.submit(save)
        assert isinstance(save.done.exception(10), StepExistsError) == fails
        assert [g() for g in gone] == [None] * 3
    finally:
        writer.close()


@pytest.mark.process  # mounts a tmpfs
def test_a_full_ram_disk_discards_the_step(tiny_tmpfs: Path) -> None:
    writer = Writer(2)
    try:
        save = save_of(tiny_tmpfs, 3, [np.zeros(1 << 20, np.float32)])  # 4 MiB > room left
        writer.submit(save)
        with pytest.raises(RamDiskFullError):
            save.done.result(10)
    finally:
        writer.close()
    assert os.listdir(tiny_tmpfs) == []  # nothing half-written stays
    assert save.released == [0]  # type: ignore[attr-defined]


def test_the_next_save_is_written_into_blank_files_set_aside_after_the_last(
        tmp_path: Path) -> None:
    """After a save, blank files of its sizes are allocated ahead (the next save of
    the same arrays writes into allocated pages: no page allocation on its time);
    the next save's files are those, renamed into place, with its bytes and
    readable as any step file."""
    writer = Writer(1)
    try:
        first = save_of(tmp_path, 7, [np.arange(4, dtype=np.float32) + i for i in range(3)])
        writer.submit(first)
        first.done.result(10)
        reserve = writer.reserve_for(tmp_path)
        wait_until("three blank files", lambda: reserve.held_bytes() == 3 * 16)
        blank = {os.stat(p).st_ino for p in (tmp_path / WRITER_RESERVE_DIR).iterdir()}
        assert len(blank) == 3
        shards = [np.arange(4, dtype=np.float32) * 10 + i for i in range(3)]
        second = save_of(tmp_path, 8, shards)
        writer.submit(second)
        final = second.done.result(10)
    finally:
        writer.close()
    entries = shard_entries(final)
    assert {os.stat(final / e.file).st_ino for e in entries} == blank
    for i, e in enumerate(entries):
        data = (final / e.file).read_bytes()
        assert data == shards[i].tobytes() and e.crc32c == crc32c(data)
        assert os.stat(final / e.file).st_mode & 0o044  # the replicator reads it too


@pytest.mark.process  # mounts a tmpfs
def test_blank_files_set_aside_never_make_a_save_fail_for_room(tiny_tmpfs: Path) -> None:
    """A save of other sizes on a RAM disk that holds it only without the blank
    files: they are dropped and the save is written."""
    writer = Writer(1)
    try:
        first = save_of(tiny_tmpfs, 1, [np.ones(1 << 18, np.float32)])  # 1 MiB
        writer.submit(first)
        first.done.result(10)
        reserve = writer.reserve_for(tiny_tmpfs)
        wait_until("1 MiB set aside", lambda: reserve.held_bytes() == 1 << 20)
        big = np.full(5 << 17, 2, np.float32)  # 2.5 MiB: fits only without the 1 MiB
        second = save_of(tiny_tmpfs, 2, [big])
        writer.submit(second)
        final = second.done.result(10)
    finally:
        writer.close()
    assert (final / shard_entries(final)[0].file).read_bytes() == big.tobytes()
    assert layout.committed_steps(tiny_tmpfs) == [1, 2]


def test_a_save_aborted_while_staging_releases_its_shards(tmp_path: Path) -> None:
    writer = Writer(1)
    try:
        save = HostSave(tmp_path, 1, 0, 0, 1, [leaf(0)])
        released: list[int] = []
        save.add(StagedShard(0, ((0, 4),), np.zeros(4, np.float32), lambda: released.append(0)))
        writer.submit(save)
        save.abort(RuntimeError("staging failed"))
        with pytest.raises(RuntimeError, match="staging failed"):
            save.done.result(10)
    finally:
        writer.close()
    assert os.listdir(tmp_path) == [] and released == [0]


# -- the writer's threads ------------------------------------------------------------------


def test_close_joins_every_thread_the_writer_started(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    writer = Writer(2)
    started = set(threading.enumerate()) - before
    assert sorted(t.name for t in started) == ["mtc-commit", "mtc-reserve-writer",
                                               "mtc-write_0", "mtc-write_1"]
    try:
        save = save_of(tmp_path, 1, [np.arange(4, dtype=np.float32)])
        writer.submit(save)
        save.done.result(10)
    finally:
        writer.close()
    assert [t.name for t in started if t.is_alive()] == []


def test_a_writer_thread_that_failed_raises_its_error_at_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The filler's loop catches the OSErrors filling can meet; no real fault makes
    # it raise, so the loop itself is replaced by one that does.
    def broken(*args: object) -> None:
        raise RuntimeError("filler broke")

    monkeypatch.setattr("mtc.sidecar.save.write.fill_while", broken)
    before = set(threading.enumerate())
    writer = Writer(1)
    started = set(threading.enumerate()) - before
    with pytest.raises(RuntimeError, match="filler broke"):
        writer.close()
    assert [t.name for t in started if t.is_alive()] == []  # joined before it was raised
