"""Shard reads, mapped or read: every byte and the size verified, with or without
prefaulting a mapping."""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mtc
from mtc.errors import CorruptShardError
from mtc.integrity import crc32c
from mtc.manifest import ShardEntry
from mtc.sidecar.restore import read


def entry_of(path: Path, data: np.ndarray) -> ShardEntry:
    return ShardEntry(file=path.name, index=((0, data.size),), nbytes=int(data.nbytes),
                      crc32c=crc32c(data))


def test_prefault_only_under_gvisor() -> None:
    gvisor = read.GVISOR_VERSION + "\n"
    assert read.prefault_flag(gvisor) == mmap.MAP_POPULATE
    linux = "Linux version 6.18.44-fc-v1272 (gcc) #1 SMP PREEMPT_DYNAMIC\n"
    assert read.prefault_flag(linux) == 0
    assert read.prefault_flag("") == 0


@pytest.mark.parametrize("prefault", [0, mmap.MAP_POPULATE], ids=["faulted", "prefaulted"])
def test_mapped_reads_verify_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        prefault: int) -> None:
    monkeypatch.setattr(read, "_PREFAULT", prefault)
    pages = [np.arange(mmap.PAGESIZE, dtype=np.uint8) + i for i in range(3)]
    pieces = []
    for i, data in enumerate(pages):
        path = tmp_path / f"s{i}"
        data.tofile(path)
        pieces.append((path, entry_of(path, data)))
    one = read.map_verified(pieces[0][0], pieces[0][1], step=4, host=1)
    np.testing.assert_array_equal(one, pages[0])
    one[0] = 99  # copy-on-write: the file keeps its bytes
    assert np.fromfile(pieces[0][0], np.uint8)[0] == pages[0][0]
    joined = read.map_side_by_side(pieces, step=4, hosts=[1, 1, 2])
    np.testing.assert_array_equal(joined, np.concatenate(pages))

    damaged = np.fromfile(pieces[2][0], np.uint8)
    damaged[-1] ^= 1
    damaged.tofile(pieces[2][0])
    with pytest.raises(CorruptShardError, match="checksum mismatch") as e:
        read.map_verified(pieces[2][0], pieces[2][1], step=4, host=2)
    assert e.value.step == 4 and e.value.host == 2 and "s2" in str(e.value)
    with pytest.raises(CorruptShardError, match="checksum mismatch") as e:
        read.map_side_by_side(pieces, step=4, hosts=[1, 1, 2])
    assert e.value.host == 2


def test_small_files_are_read_large_ones_mapped() -> None:
    assert read.read_below("Linux version 6.18.44-fc-v1272 (gcc) #1 SMP\n") == 64 << 10
    assert read.read_below(read.GVISOR_VERSION + "\n") > 4 << 20
    assert read.read_below("") == 64 << 10


def test_read_shards_verify_their_size_and_every_byte(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.arange(5000, dtype=np.uint8)
    path = tmp_path / "s0"
    data.tofile(path)
    entry = entry_of(path, data)
    monkeypatch.setattr(read, "READ_BELOW", 5001)
    got = read.load_verified(path, entry, step=3, host=1)
    assert isinstance(got.base, np.ndarray)  # read into memory of its own
    assert got.ctypes.data % read.ADOPT_ALIGN == 0
    placed = jax.device_put(got, jax.devices()[0])  # a CPU device adopts it: no copy
    assert placed.unsafe_buffer_pointer() == got.ctypes.data
    del placed
    np.testing.assert_array_equal(got, data)
    got[0] = 7  # its own memory: the file keeps its bytes
    assert np.fromfile(path, np.uint8)[0] == 0
    monkeypatch.setattr(read, "READ_BELOW", 5000)
    mapped = read.load_verified(path, entry, step=3, host=1)
    assert isinstance(getattr(mapped.base, "obj", None), mmap.mmap)
    np.testing.assert_array_equal(mapped, data)

    monkeypatch.setattr(read, "READ_BELOW", 1 << 20)
    np.concatenate([data, data[:1]]).tofile(path)  # one byte longer
    with pytest.raises(CorruptShardError, match="5001 bytes, manifest says 5000") as e:
        read.load_verified(path, entry, step=3, host=1)
    assert (e.value.step, e.value.host) == (3, 1) and "s0" in str(e.value)
    data[:-1].tofile(path)  # one byte short
    with pytest.raises(CorruptShardError, match="4999 bytes, manifest says 5000"):
        read.load_verified(path, entry, step=3, host=1)
    damaged = data.copy()
    damaged[100] ^= 1
    damaged.tofile(path)
    with pytest.raises(CorruptShardError, match="checksum mismatch"):
        read.load_verified(path, entry, step=3, host=1)
    path.unlink()
    with pytest.raises(CorruptShardError, match="missing"):
        read.load_verified(path, entry, step=3, host=1)


def test_a_loader_opens_each_step_folder_once_from_its_descriptor(tmp_path: Path) -> None:
    """Files are opened from the step folder's descriptor: a folder swapped for a
    symlink after it was opened is not followed, one that is a symlink when it is
    opened is refused, and closing the loader closes every descriptor."""
    from mtc.contract import Piece, ReadTask
    from mtc.sidecar.restore.load import ShardLoader

    root = tmp_path / "host-0"
    (root / "3").mkdir(parents=True)
    parts = [np.arange(10, dtype=np.float32) + i for i in range(2)]
    entries = []
    for i, data in enumerate(parts):
        path = root / "3" / f"s{i}"
        data.tofile(path)
        entries.append(ShardEntry(file=path.name, index=((0, 10),), nbytes=int(data.nbytes),
                                  crc32c=crc32c(data)))
    tasks = [ReadTask(i, ((0, 10),), "float32", (0,), (Piece(0, e),))
             for i, e in enumerate(entries)]
    def folder_fds() -> int:
        """This process's descriptors open on the step folder (where it is now):
        counted by what they name, as other threads open and close their own."""
        names = {str(root / "3"), str(tmp_path / "moved")}
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}") in names
            except OSError:
                continue  # closed since it was listed
        return n

    assert folder_fds() == 0
    with ShardLoader(3, lambda h: root) as loader:
        np.testing.assert_array_equal(loader.read(tasks[0]), parts[0])
        # The folder moved away and a symlink to other bytes put in its place: the
        # loader keeps reading the folder it opened (a path would now lead there).
        (root / "3").rename(tmp_path / "moved")
        (tmp_path / "evil").mkdir()
        (tmp_path / "evil" / "s1").write_bytes(np.zeros(10, np.float32).tobytes())
        (root / "3").symlink_to(tmp_path / "evil")
        np.testing.assert_array_equal(loader.read(tasks[1]), parts[1])
        assert folder_fds() == 1
    assert folder_fds() == 0
    with pytest.raises(CorruptShardError, match="step folder is missing or not a folder"), \
            ShardLoader(3, lambda h: root) as loader:
        loader.read(tasks[0])


def test_shards_go_to_devices_in_batches_and_restore_exactly(
        ramdisk: Path, mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch is sent once its bytes reach PUT_BATCH_BYTES: with a bound of one
    byte every read task is its own ``device_put``, and the values are the same."""
    from mtc.sidecar.restore import load

    calls: list[int] = []
    put = jax.device_put

    def counting(x: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(x) if isinstance(x, list) else 1)
        return put(x, *args, **kwargs)

    sharded = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    state = {f"w{i}": jax.device_put(np.arange(64 * 16, dtype=np.float32).reshape(64, 16) + i,
                                     sharded) for i in range(3)}
    options = mtc.Options(dispatch="local", simulated_hosts=4, hosts_per_slice=2)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options) as mgr:
        mgr.save(1, state, force=True)
        mgr.wait_until_finished()
        monkeypatch.setattr(load, "PUT_BATCH_BYTES", 1)
        monkeypatch.setattr(jax, "device_put", counting)
        back = mgr.restore(1, state)
    assert len(calls) >= 3 * len(mesh.devices.flat) and set(calls) == {1}, calls
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(v))
        assert back[k].sharding.is_equivalent_to(v.sharding, v.ndim)


def _tasks_on_disk(root: Path, n: int) -> tuple[list[Any], list[np.ndarray]]:
    from mtc.contract import Piece, ReadTask

    (root / "3").mkdir(parents=True)
    parts = [np.arange(256, dtype=np.float32) * (i + 1) for i in range(n)]
    tasks = []
    for i, data in enumerate(parts):
        (root / "3" / f"s{i}").write_bytes(data.tobytes())
        entry = ShardEntry(file=f"s{i}", index=((0, 256),), nbytes=int(data.nbytes),
                           crc32c=crc32c(data))
        tasks.append(ReadTask(i, ((0, 256),), "float32", (0,), (Piece(0, entry),)))
    return tasks, parts


@pytest.mark.parametrize(("threads", "window"), [(1, 1 << 20), (4, 1), (4, 1 << 20), (3, 2048)])
def test_regions_read_by_several_threads_come_in_order_within_the_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int, window: int) -> None:
    """``read_all`` yields each task's region in the tasks' order, whatever order the
    readers finish in, and never starts a read more than ``window`` bytes ahead
    of the region taken (one task at least)."""
    import threading

    from mtc.sidecar.restore.load import ShardLoader

    tasks, parts = _tasks_on_disk(tmp_path, 8)
    started: list[int] = []
    lock = threading.Lock()
    with ShardLoader(3, lambda h: tmp_path) as loader:
        plain = loader.read

        def read(task: Any) -> np.ndarray:
            with lock:
                started.append(task.leaf)
            return plain(task)

        monkeypatch.setattr(loader, "read", read)
        regions = loader.read_all(tasks, threads=threads, window=window)
        for k, region in enumerate(regions):
            np.testing.assert_array_equal(region, parts[k])
            # Started so far: at most the taken one and those within the window.
            assert len(started) <= k + 1 + max(1, window // 1024), (k, started)
    assert sorted(started) == list(range(8))
    if threads > 1 and window == 1:
        assert started == list(range(8))  # one at a time: each a whole window


def test_a_corrupt_region_read_ahead_fails_its_own_task_and_the_readers_end(
        tmp_path: Path) -> None:
    import threading

    from mtc.sidecar.restore.load import ShardLoader

    tasks, parts = _tasks_on_disk(tmp_path, 6)
    (tmp_path / "3" / "s4").write_bytes(b"\0" * parts[4].nbytes)
    before = threading.active_count()
    got = []
    with ShardLoader(3, lambda h: tmp_path) as loader, \
            pytest.raises(CorruptShardError, match="checksum mismatch") as e:
        for region in loader.read_all(tasks, threads=4, window=1 << 20):
            got.append(region)
    assert len(got) == 4 and e.value.step == 3 and "s4" in str(e.value)
    assert threading.active_count() == before  # the readers were joined


@pytest.mark.parametrize(("sizes", "budget", "under_way"), [
    ([], 100, 0),
    ([64], 100, 1),  # the one waited for
    ([64, 64], 0, 2),  # and the next, whatever the budget
    ([64] * 8, 256, 5),  # and those beside it within the budget
    ([256] * 8, 256, 2),
    ([256] * 8, 512, 3),
    ([64, 300, 64], 256, 2),  # the next one alone exceeds the budget
])
def test_transfers_under_way_stay_within_the_budget(sizes: list[int], budget: int,
                                                   under_way: int) -> None:
    from mtc.sidecar.save.agent import transfers_under_way

    assert transfers_under_way(sizes, budget) == under_way
