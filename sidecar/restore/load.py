"""Host side of a restore: read the shards a plan names and put them on devices.

A :class:`ReadTask` is one distinct target shard on one host: the region of a
leaf that one or more of the host's devices need, and the saved pieces that
cover it. A task whose region equals a saved shard maps that file (reads it
when small: :mod:`mtc.sidecar.restore.read`); one whose region is saved shards stacked
along the leading axis maps them side by side; anything else is assembled by
copying the overlapping parts.

A piece another host saved is never read through a filesystem: with ``remote``
(multi-controller JAX, each process its own host) its file comes over the
network tier (:mod:`mtc.sidecar.restore.peers`) and is checked against the manifest here.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mtc.contract import LeafSpec, Piece, ReadTask
from mtc.errors import CorruptShardError, ProtocolError
from mtc.integrity import crc32c
from mtc.pool import ThreadPool
from mtc.shards import paste
from mtc.sidecar.dtypes import numpy_dtype
from mtc.sidecar.replicator.store.store import REPLICA_DIR
from mtc.sidecar.restore.read import (
    At,
    can_map_side_by_side,
    load_verified,
    map_side_by_side,
    open_step_folder,
)
from mtc.sidecar.storage.quarantine import quarantine

if TYPE_CHECKING:  # only the in-process paths put arrays on devices; a sidecar never does
    import jax


def _stacked_on_leading_axis(task: ReadTask) -> bool:
    """Pieces tile the region one after another along axis 0 (row-major contiguous)."""
    if len(task.pieces) < 2 or not task.index:
        return False
    pos = task.index[0][0]
    for p in task.pieces:
        idx = p.entry.index
        if idx[1:] != task.index[1:] or idx[0][0] != pos:
            return False
        pos = idx[0][1]
    return pos == task.index[0][1]


# (step, saving host, file relative to the step folder) -> the file's bytes
Remote = Callable[[int, int, str], bytearray]

# A restore's regions are read and verified by this many threads, this many bytes
# ahead of the one being sent (ShardLoader.read_all). On a TPU v5e host, 1 GiB read
# and verified in one thread, then sent in batches, took 2.1x the transfer alone.
READ_THREADS = min(4, os.cpu_count() or 1)
READ_AHEAD_BYTES = 256 << 20


class ShardLoader:
    """Executes read tasks for one step; each file is verified at most once.

    ``remote``: where pieces of hosts other than ``own`` come from (the network
    tier); without it every host's root is a folder here (simulated hosts). Each
    host's step folder is opened once and its files from there: :meth:`close` it
    (or use it as a context manager); what it read stays valid after."""

    def __init__(self, step: int, root_of: Callable[[int], Path], *,
                 remote: Remote | None = None, own: Collection[int] = ()) -> None:
        self.step = step
        self.root_of = root_of
        self.remote = remote
        self.own = frozenset(own)
        self._mapped: dict[tuple[int, str], np.ndarray] = {}
        # host -> (descriptor of its step folder, the folder's path): opened once; the
        # path a string, as errors join it with hundreds of file names
        self._folders: dict[int, tuple[int, str]] = {}

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        folders, self._folders = self._folders, {}
        for fd, _ in folders.values():
            os.close(fd)

    def _folder(self, host: int) -> tuple[int, str]:
        found = self._folders.get(host)
        if found is None:
            path = self.root_of(host) / str(self.step)
            fd = open_step_folder(path, step=self.step, host=host)
            found = self._folders[host] = (fd, f"{path}{os.sep}")
        return found

    def _path(self, p: Piece) -> str:
        return self._folder(p.host)[1] + p.entry.file  # a manifest's file name has no separator

    def _at(self, p: Piece) -> At:
        return self._folder(p.host)[0], p.entry.file

    def _is_remote(self, p: Piece) -> bool:
        return self.remote is not None and p.host not in self.own

    def _map(self, p: Piece) -> np.ndarray:
        key = (p.host, p.entry.file)
        if key not in self._mapped:
            if self._is_remote(p):
                self._mapped[key] = self._fetch(p)
            else:
                with self._quarantining():
                    self._mapped[key] = load_verified(self._path(p), p.entry, step=self.step,
                                                     host=p.host, at=self._at(p))
        return self._mapped[key]

    def _fetch(self, p: Piece) -> np.ndarray:
        """Another host's shard file over the network tier, checked against the manifest
        (the holder's inventory vouched for its bytes, the manifest for its meaning)."""
        assert self.remote is not None
        data = self.remote(self.step, p.host, p.entry.file)
        got = crc32c(data) if data else 0
        if len(data) != p.entry.nbytes or got != p.entry.crc32c:
            raise CorruptShardError(
                f"copy from the network tier has {len(data)} bytes crc32c {got:#010x}, "
                f"manifest says {p.entry.nbytes} bytes {p.entry.crc32c:#010x}",
                step=self.step, host=p.host, path=p.entry.file)
        return np.frombuffer(data, dtype=np.uint8)

    @contextlib.contextmanager
    def _quarantining(self) -> Iterator[None]:
        """A shard that fails verification on a host whose replicator can heal it
        (it keeps peer copies there) is moved aside, so the replicator sees the
        damage and fetches a good copy when the restore is retried."""
        try:
            yield
        except CorruptShardError as e:
            if e.path is not None and e.host is not None:
                root = self.root_of(e.host)
                if (root / REPLICA_DIR).is_dir() and Path(e.path).is_file():
                    quarantine(root, Path(e.path), str(e))
            raise

    def read_all(self, tasks: Sequence[ReadTask], *, threads: int | None = None,
                 window: int | None = None) -> Generator[np.ndarray, None, None]:
        """Each task's region, in order, read and verified by ``threads`` threads at
        most ``window`` bytes ahead of the region taken (one task at least): the
        caller sends one while the next are read, and the checksums of several
        run at once (the GIL released). Pieces from the network tier are read
        one at a time. Defaults: READ_THREADS, READ_AHEAD_BYTES. Close the
        iterator (``contextlib.closing``) to join the threads where it is not run
        to its end."""
        threads = READ_THREADS if threads is None else threads
        window = READ_AHEAD_BYTES if window is None else window
        if threads < 2 or len(tasks) < 2 or any(self._is_remote(p)
                                                for t in tasks for p in t.pieces):
            for t in tasks:
                yield self.read(t)
            return
        for t in tasks:  # opened here, not raced by the readers
            for p in t.pieces:
                self._folder(p.host)
        sizes = [_volume(t.index) * numpy_dtype(t.dtype).itemsize for t in tasks]
        pool = ThreadPool(min(threads, len(tasks)), "mtc-read")
        pending: collections.deque[Future[np.ndarray]] = collections.deque()
        nxt = ahead = 0
        try:
            for k in range(len(tasks)):
                while nxt < len(tasks) and (nxt == k or ahead + sizes[nxt] <= window):
                    pending.append(pool.submit(self.read, tasks[nxt]))
                    ahead += sizes[nxt]
                    nxt += 1
                region = pending.popleft().result()
                ahead -= sizes[k]
                yield region
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def read(self, task: ReadTask) -> np.ndarray:
        dtype = numpy_dtype(task.dtype)
        shape = task.shape
        pieces = task.pieces
        if len(pieces) == 1 and pieces[0].entry.index == task.index:
            return self._map(pieces[0]).view(dtype).reshape(shape)
        if (_stacked_on_leading_axis(task) and not any(self._is_remote(p) for p in pieces)
                and can_map_side_by_side([p.entry for p in pieces])):
            with self._quarantining():
                region = map_side_by_side([(self._path(p), p.entry) for p in pieces],
                                          step=self.step, hosts=[p.host for p in pieces],
                                          at=[self._at(p) for p in pieces])
            return region.view(dtype).reshape(shape)
        # Zeroed, not empty: a region the pieces leave a gap in (a request's, not a
        # plan's) must not carry this process's old memory to whoever asked.
        out = np.zeros(shape, dtype=dtype)
        for p in pieces:
            src_idx = p.entry.index
            src = self._map(p).view(dtype).reshape(tuple(b - a for a, b in src_idx))
            paste(out, task.index, src, src_idx)
        return out


def check_tasks(tasks: Sequence[ReadTask], *, step: int, host: int) -> int:
    """The bytes ``tasks`` (from a request) read, once they are checked to be a plan's:
    every piece's bytes those of its region, no piece named twice in a task, and the
    pieces covering each task's region (a region is only ever made of bytes read
    from files; whoever serves the request bounds the total). Raises
    :class:`ProtocolError` naming the leaf."""
    total = 0
    for t in tasks:
        try:
            itemsize = numpy_dtype(t.dtype).itemsize
        except TypeError as e:
            raise ProtocolError(f"leaf {t.leaf}: {e}", step=step, host=host) from None
        seen: set[tuple[int, str]] = set()
        covered = 0
        for p in t.pieces:
            idx = p.entry.index
            if len(idx) != len(t.index) or any(a > b for a, b in idx) or \
                    p.entry.nbytes != _volume(idx) * itemsize:
                raise ProtocolError(f"leaf {t.leaf}: piece {p.entry.file} holds "
                                    f"{p.entry.nbytes} bytes, not its region {list(idx)}",
                                    step=step, host=host)
            key = (p.host, p.entry.file)
            if key in seen:
                raise ProtocolError(f"leaf {t.leaf}: piece {p.entry.file} named twice",
                                    step=step, host=host)
            seen.add(key)
            covered += _intersection(idx, t.index)
        region = _volume(t.index)
        if covered < region:
            raise ProtocolError(f"leaf {t.leaf}: the pieces named cover {covered} of the "
                                f"{region} elements of region {list(t.index)}", step=step,
                                host=host)
        total += region * itemsize
    return total


def _volume(index: Sequence[tuple[int, int]]) -> int:
    return math.prod(b - a for a, b in index)


def _intersection(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> int:
    return math.prod(max(0, min(x1, y1) - max(x0, y0))
                     for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def to_device(host: np.ndarray, device: jax.Device) -> jax.Array:
    """Put host bytes on a device. On a CPU device JAX adopts suitably aligned host
    memory (a mapped shard is page-aligned) without copying; the mapping is
    copy-on-write, so nothing written to the array reaches the file."""
    import jax

    return jax.device_put(host, device)


# Shards read are sent to their devices in batches of about this many bytes: one
# dispatch for a state's hundreds of small shards, and an accelerator's transfer of
# one batch overlapping the checksum of the next (read and verified first, then
# sent, a restore took about twice the transfer alone).
PUT_BATCH_BYTES = 64 << 20


def load_tasks(loader: ShardLoader, tasks: Sequence[ReadTask],
               devices: dict[int, jax.Device]) -> dict[tuple[int, int], jax.Array]:
    """Single-device arrays keyed by (leaf, device id), sent by ``device_put`` in
    batches (:data:`PUT_BATCH_BYTES`; host memory is adopted as :func:`to_device`
    says)."""
    import jax

    out: dict[tuple[int, int], jax.Array] = {}
    keys: list[tuple[int, int]] = []
    hosts: list[np.ndarray] = []
    pending = 0

    def send() -> None:
        nonlocal pending
        placed = jax.device_put(hosts, [devices[k[1]] for k in keys])  # asynchronous
        out.update(zip(keys, placed, strict=True))
        keys.clear()
        hosts.clear()
        pending = 0

    with contextlib.closing(loader.read_all(tasks)) as regions:
        for task, host in zip(tasks, regions, strict=True):
            for dev_id in task.device_ids:
                keys.append((task.leaf, dev_id))
                hosts.append(host)
                pending += host.nbytes
            if pending >= PUT_BATCH_BYTES:
                send()
    if keys:
        send()
    return out


def load_leaves(loader: ShardLoader, tasks: Sequence[ReadTask],
                specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
    """Global arrays (leaf number -> array) built from this host's devices' shards."""
    import jax

    device_sets: list[set[Any]] = [spec.sharding.device_set for spec in specs.values()]
    devices: dict[int, Any] = {d.id: d for ds in device_sets for d in ds}
    singles = load_tasks(loader, tasks, devices)
    out: dict[int, jax.Array] = {}
    for leaf, spec in specs.items():
        addressable: set[Any] = spec.sharding.addressable_devices
        local = [singles[(leaf, d.id)] for d in addressable if (leaf, d.id) in singles]
        out[leaf] = jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, local)
    return out
