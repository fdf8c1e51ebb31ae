"""Writing one host's step: shard files, checksums, manifest, atomic commit.

A :class:`HostSave` is opened before its shards are staged and fed shard by
shard, so a state larger than the staging budget streams through it. The
:class:`Writer` runs saves in order on a background thread, writes files on a
small thread pool (into blank RAM-disk files set aside after the last save,
:mod:`mtc.sidecar.storage.reserve`), writes the manifest last and renames the folder
into place.
A failed save removes its temporary folder: a step is visible only if every
byte of it was written and checksummed.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import shutil
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from mtc import layout
from mtc.errors import MtcError, RamDiskFullError, StepExistsError, StorageError
from mtc.integrity import crc32c
from mtc.lifecycle import Threads
from mtc.manifest import MANIFEST_NAME, Index, LeafEntry, Manifest, ShardEntry
from mtc.pool import ThreadPool, lower_thread_priority
from mtc.sidecar.storage import spare
from mtc.sidecar.storage.deleter import writing
from mtc.sidecar.storage.names import tmp_dir
from mtc.sidecar.storage.publish import publish
from mtc.sidecar.storage.reserve import Reserve, fill_while

# A host's blank files for its next save (mtc.sidecar.storage.reserve), beside its steps.
WRITER_RESERVE_DIR = ".mtc-reserve-writer"
# A shard is checksummed and written this much at a time: small enough that the
# write finds the checksummed bytes still in the CPU cache.
WRITE_CHUNK = 1 << 20

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StagedShard:
    """Host bytes of one shard, and how to give their memory back once written."""

    leaf: int
    index: Index
    data: np.ndarray
    release: Callable[[], None]

    @property
    def file(self) -> str:
        return f"{self.leaf:05d}." + "_".join(f"{a}-{b}" for a, b in self.index) + ".bin"


_SEALED = object()


class HostSave:
    """One host's step in flight: metadata now, shards as they are staged."""

    def __init__(self, root: Path, step: int, host: int, slice_: int, num_hosts: int,
                 leaves: list[LeafEntry], run: str = "", ranks: tuple[int, ...] = ()) -> None:
        self.root = root
        self.run = run
        self.ranks = ranks  # each saving host's replicator rank (empty: host h is rank h)
        self.step = step
        self.host = host
        self.slice = slice_
        self.num_hosts = num_hosts
        self.leaves = leaves
        self._shards: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.done: Future[Path] = Future()
        self.ended = False
        # Writing waits until staging is over (or would block on the budget):
        # writer threads competing for the cores and memory bandwidth would
        # stretch the time ``save`` blocks the training loop.
        self.go = threading.Event()

    def add(self, shard: StagedShard) -> None:
        self._shards.put(shard)

    def seal(self) -> None:
        self._shards.put(_SEALED)

    def abort(self, error: BaseException) -> None:
        self._shards.put(error)
        self.go.set()

    def shards(self):  # type: ignore[no-untyped-def]
        while True:
            item = self._shards.get()
            if item is _SEALED or isinstance(item, BaseException):
                self.ended = True
                if isinstance(item, BaseException):
                    raise item
                return
            yield item


def _io_error(e: OSError, save: HostSave, path: Path) -> MtcError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RamDiskFullError("RAM disk full while writing the step; the step was discarded",
                                step=save.step, host=save.host, path=str(path))
    return StorageError(f"cannot write: {e.strerror}", step=save.step, host=save.host,
                        path=str(path))


def _write_file(reserve: Reserve, tmp: Path, name: str, data: np.ndarray, host: int) -> int:
    """``data`` as ``tmp/name`` (into space set aside for it where there is some);
    its CRC32C, taken chunk by chunk just before the chunk is written, so that the
    write finds the bytes in the CPU's cache (one pass over memory, not two)."""
    flat = data.reshape(-1).view(np.uint8) if data.size else np.empty(0, np.uint8)
    view = memoryview(flat.data)
    for attempt in range(2):
        fd = reserve.open_new(tmp, name, len(view), host)
        try:
            crc = 0
            for start in range(0, len(view), WRITE_CHUNK):
                chunk = flat[start:start + WRITE_CHUNK]
                crc = crc32c(chunk, crc)
                written, end = start, start + len(chunk)
                while written < end:
                    written += os.write(fd, view[written:end])
            break
        except OSError as e:
            # Blank files set aside for the next save must never make this one fail:
            # a RAM disk found full drops them, and the file is written again.
            if e.errno != errno.ENOSPC or attempt or not reserve.held_bytes():
                raise
            reserve.drop_all()
            os.unlink(tmp / name)
        finally:
            os.close(fd)
    return crc


def clear_frames(e: BaseException | None) -> None:
    """Drop the locals of the frames an error and its causes keep (their text
    stays): a kept error must not keep staged bytes alive."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


def _drain(save: HostSave) -> None:
    """Release shards still being staged into a save that already failed."""
    if save.ended:
        return
    try:
        for shard in save.shards():
            shard.release()
    except BaseException:  # noqa: BLE001 - the save's own error is already being raised
        pass


class Writer:
    """Background writer: one save at a time, its files in parallel."""

    def __init__(self, threads: int, *, reserve: bool = True) -> None:
        # Every thread starts now: a save finished at interpreter exit (mtc.lifecycle)
        # gets no new ones from Python 3.12 on.
        self._pool = ThreadPool(threads, "mtc-write", initializer=lower_thread_priority)
        self._jobs: queue.SimpleQueue[HostSave | None] = queue.SimpleQueue()
        # Per root: blank files for its next save, all filled by one thread.
        self._reserve = reserve
        self._reserves: dict[Path, Reserve] = {}
        self._reserves_lock = threading.Lock()
        self._fill_wake = threading.Event()
        self._closing = threading.Event()
        # The commit thread and the reserve's filler, joined by close(). Daemons: the
        # saves of a writer nobody closed are finished at exit by mtc.lifecycle's
        # hook (which closes it); one that hook never reaches must not hold the
        # interpreter up forever.
        self._threads = Threads("mtc-writer")
        self._commit = self._threads.start(self._run, "mtc-commit", daemon=True)
        self._threads.start(self._fill, "mtc-reserve-writer", daemon=True)

    def reserve_for(self, root: Path) -> Reserve:
        """The blank files set aside for the next saves into ``root``."""
        with self._reserves_lock:
            r = self._reserves.get(root)
            if r is None:
                r = self._reserves[root] = Reserve(
                    root, WRITER_RESERVE_DIR, lambda: spare.room(root),
                    enabled=self._reserve, mode=0o644, wake=self._fill_wake)
            return r

    def _fill(self) -> None:
        def reserves() -> list[Reserve]:
            with self._reserves_lock:
                return list(self._reserves.values())
        fill_while(self._closing, self._fill_wake, reserves)

    def submit(self, save: HostSave) -> None:
        self._jobs.put(save)

    def close(self) -> None:
        """Finish the saves submitted, then join every thread of the writer; a
        thread's own error (not a save's: that goes to its future) is raised."""
        self._jobs.put(None)
        self._commit.join()  # its last save still writes on the pool and the reserve
        self._pool.shutdown()
        with self._reserves_lock:
            for r in self._reserves.values():
                r.stop()
        self._closing.set()
        self._fill_wake.set()
        self._threads.join()

    def _run(self) -> None:
        while True:
            save = self._jobs.get()
            if save is None:
                return
            try:
                save.done.set_result(self._write(save))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                # The error is kept until raised; the staged bytes its frames
                # reference are not (a reused buffer is free once its write ended).
                clear_frames(e)
                save.done.set_exception(e)

    def _write(self, save: HostSave) -> Path:
        final = layout.step_dir(save.root, save.step)
        tmp = tmp_dir(save.root, save.step)
        futures: list[tuple[StagedShard, Future[int]]] = []
        committed = drained = False
        save.go.wait()
        writing(tmp, True)
        try:
            try:
                save.root.mkdir(parents=True, exist_ok=True)
                os.mkdir(tmp)
            except OSError as e:
                raise _io_error(e, save, tmp) from e
            reserve = self.reserve_for(save.root)
            for shard in save.shards():
                futures.append((shard, self._pool.submit(self._write_one, reserve, tmp,
                                                         shard, save.host)))
            drained = True
            entries: dict[int, list[ShardEntry]] = {}
            first_error: BaseException | None = None
            for shard, fut in futures:
                try:
                    crc = fut.result()
                except OSError as e:
                    first_error = first_error or _io_error(e, save, tmp / shard.file)
                    continue
                entries.setdefault(shard.leaf, []).append(
                    ShardEntry(shard.index, shard.file, int(shard.data.nbytes), crc))
            if first_error is not None:
                raise first_error
            leaves = [dataclasses.replace(leaf, shards=tuple(entries.get(i, ())))
                      for i, leaf in enumerate(save.leaves)]
            manifest = Manifest(step=save.step, host=save.host, slice=save.slice,
                                num_hosts=save.num_hosts, leaves=tuple(leaves), run=save.run,
                                ranks=save.ranks)
            try:
                (tmp / MANIFEST_NAME).write_bytes(manifest.to_bytes())
            except OSError as e:
                raise _io_error(e, save, tmp / MANIFEST_NAME) from e
            try:
                publish(tmp, final)
            except FileExistsError as e:
                what = ("step is already committed" if layout.is_mtc_step(save.root, save.step)
                        else "a step folder of this number that is not mtc's (no mtc "
                             "manifest: Orbax's or another tool's) is there; mtc leaves it "
                             "alone: save another step number, or move that folder")
                raise StepExistsError(what, step=save.step, host=save.host,
                                      path=str(final)) from e
            committed = True
            # The next save of this host brings files of these sizes again.
            reserve.want(save.host, [e.nbytes for es in entries.values() for e in es])
            return final
        finally:
            for _, fut in futures:
                fut.exception()  # every buffer is released before the save ends
            if not drained:
                _drain(save)
            if not committed:
                shutil.rmtree(tmp, ignore_errors=True)
            writing(tmp, False)

    @staticmethod
    def _write_one(reserve: Reserve, tmp: Path, shard: StagedShard, host: int) -> int:
        try:
            return _write_file(reserve, tmp, shard.file, shard.data, host)
        finally:
            shard.release()
