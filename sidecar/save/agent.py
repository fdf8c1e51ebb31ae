"""The per-host agent: stages shards into host memory and hands them to the writer.

One agent object serves every host whose devices are addressable where it runs:
one host in the colocated-Python sidecar of a Pathways worker and in a process
of multi-controller JAX; every simulated host when one process plays them all.
The controller invokes it directly (``mtc.dispatch.LocalDispatch``) or through
``jax.experimental.colocated_python`` (``ColocatedDispatch``); the code is the
same.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import TYPE_CHECKING, Any

import numpy as np

from mtc.contract import AgentConfig, SaveHeader
from mtc.errors import MtcError
from mtc.manifest import Index, LeafEntry
from mtc.pool import ThreadPool
from mtc.shards import ShardPlans
from mtc.sidecar.save.buffers import StagingPool
from mtc.sidecar.save.write import HostSave, StagedShard, Writer
from mtc.sidecar.storage.deleter import clean_uncommitted

# The bytes of device shards whose transfers to host memory are under way beside
# the one the transfer thread waits for (one shard at least). The steps running
# meanwhile share the device with them: on a TPU v5e, with 768 MiB of a 4 GiB
# state's shards in flight the step after a save took 1.36x a step (0.56x with one
# 256 MiB shard), while a 1 GiB state's save committed in 0.48 s with 448 MiB in
# flight, 0.62 s with 192 MiB and 0.89 s with one 64 MiB shard.
TRANSFER_AHEAD_BYTES = 256 << 20

if TYPE_CHECKING:
    import jax

log = logging.getLogger(__name__)

# A shard left to the transfer thread: leaf number, index, shape, dtype, source.
Later = tuple[int, "Index", tuple[int, ...], "np.dtype[Any]", Any]


def _is_jax_array(x: Any) -> bool:
    """``isinstance(x, jax.Array)`` without importing JAX: the sidecar process never
    does (it starts a second faster), and where JAX is not loaded nothing is one."""
    jax_ = sys.modules.get("jax")
    return jax_ is not None and isinstance(x, jax_.Array)


def _on_cpu(x: jax.Array) -> bool:
    """Whether an array lives in host memory already (CPU devices)."""
    devices: set[Any] = x.sharding.device_set
    return bool(next(iter(devices)).platform == "cpu")


def _as_numpy_leaf(leaf: LeafEntry, a: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    """A numpy leaf that crossed to a sidecar as a replicated byte array, as numpy again."""
    if leaf.kind != "numpy" or isinstance(a, np.ndarray):
        return a
    raw = np.asarray(a.addressable_shards[0].data)
    return raw.view(np.dtype(leaf.dtype)).reshape(leaf.shape)



def transfers_under_way(sizes: Sequence[int], budget: int) -> int:
    """How many of the shards queued for transfer (their ``sizes``, in order; the
    first is the one waited for next) should have their transfers under way: it,
    the one after it, and those after them while the ones beside it stay within
    ``budget`` bytes."""
    n = min(len(sizes), 2)
    ahead = sum(sizes[1:n])
    while n < len(sizes) and ahead + sizes[n] <= budget:
        ahead += sizes[n]
        n += 1
    return n

class HostAgent:
    """Stages and writes the shards of the hosts it serves."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.pool = StagingPool(config.max_staged_bytes)
        self.writer = Writer(config.writer_threads)
        self._pending: list[HostSave] = []
        self._lock = threading.Lock()
        self._cleaned: set[int] = set()
        self._distinct_shards = ShardPlans()
        # Device-to-host transfers of shards the agent owns (a save's copy in device
        # memory: mtc.save.device_copy), one save at a time, behind ``stage``.
        self._transfers: ThreadPool | None = None
        self._transfer: Future[None] | None = None

    def hosts_of(self, arrays: Sequence[Any], host_of_device: dict[int, int]) -> list[int]:
        """Hosts whose devices hold addressable shards of ``arrays``, here."""
        hosts: set[int] = set()
        for a in arrays:
            if _is_jax_array(a):
                devices: set[Any] = a.sharding.addressable_devices
                hosts.update(host_of_device[d.id] for d in devices)
        return sorted(hosts)

    # -- save -------------------------------------------------------------------

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray],
              hosts: Sequence[int] | None = None, *,
              host_of_device: dict[int, int] | None = None,
              owned: bool | Collection[int] = False) -> bool:
        """Take this host's shards into host memory and queue them for writing.

        Returns once every shard is staged (the state may change afterwards),
        or False, having staged nothing, when ``skip_if_busy`` and the staging
        budget cannot hold the state now. ``host_of_device`` maps the ids of the
        devices the arrays are on here (a colocated worker's own CPU devices);
        by default the controller's map in the config. ``owned``: the arrays (True:
        all; else the positions of those) that are buffers no one else holds (a
        copy in device memory made for this save): their shards on an accelerator
        come to host memory on the agent's transfer thread after this returns,
        and are written as they come; the others are in host memory when it returns.
        """
        self.raise_background_error()
        # One save's device copy at a time: the next is made once this one is in
        # host memory (the dispatcher waits here before copying).
        self.finish_transfer()
        host_of = self.config.host_of_device if host_of_device is None else host_of_device
        hosts = list(hosts) if hosts is not None else self.hosts_of(arrays, host_of)
        if not hosts:  # numpy-only state: every host this agent serves keeps a copy
            hosts = sorted(set(host_of.values()))
        arrays = [_as_numpy_leaf(header.leaves[header.array_leaves[i]], a)
                  for i, a in enumerate(arrays)]
        plans = self._plan(hosts, arrays, host_of)
        total = sum(math.prod(shape) * dtype.itemsize
                    for plan in plans.values() for _, _, shape, dtype, _ in plan)
        self.pool.ensure_capacity(2 * total)
        # One reservation for the whole state when the budget has room (the usual
        # case): a lock per shard costs more than the shard's view on CPU.
        reserved = self.pool.reserve(total)
        if not reserved and header.skip_if_busy and not self.pool.can_fit_now(total):
            return False
        mine_all = set(range(len(arrays))) if owned is True else set(owned or ())
        # The step waits for the transfers of the arrays not owned: overlap them all.
        for leaf, *_, src in (x for plan in plans.values() for x in plan):
            if leaf not in mine_all and _is_jax_array(src) and not _on_cpu(src):
                src.copy_to_host_async()
        opened: list[HostSave] = []
        later: list[tuple[HostSave, list[Later]]] = []  # owned device shards, per save
        handed = 0  # bytes of the reservation now owned by staged shards
        deferred = 0  # bytes of it the transfer thread will own, once it starts
        try:
            for h in hosts:
                self._clean_once(h)
                save = HostSave(self.config.root(h), header.step, h,
                                self.config.slice_of_host[h], len(self.config.slice_of_host),
                                list(header.leaves), header.run, header.ranks)
                self.writer.submit(save)
                opened.append(save)
                with self._lock:
                    self._pending.append(save)
                mine: list[Later] = []
                try:
                    for leaf, index, shape, dtype, src in plans[h]:
                        if leaf in mine_all and _is_jax_array(src) and not _on_cpu(src):
                            mine.append((header.array_leaves[leaf], index, shape, dtype, src))
                            deferred += math.prod(shape) * dtype.itemsize
                            continue
                        if not reserved and not self.pool.can_fit_now(
                                math.prod(shape) * dtype.itemsize):
                            # The budget is held by this save's own shards: let the
                            # writer free it (a state larger than the budget streams).
                            for s in opened:
                                s.go.set()
                        save.add(self._snapshot(header.array_leaves[leaf], index, shape,
                                                dtype, src, reserved))
                        handed += math.prod(shape) * dtype.itemsize
                except BaseException as e:
                    save.abort(e)
                    raise
                if mine:
                    later.append((save, mine))
                else:
                    save.seal()
            handed += deferred
        except BaseException as e:
            for save, _ in later:  # their shards left for the transfer thread never come
                save.abort(e)
            raise
        finally:
            if reserved and handed < total:  # staging failed part-way
                self.pool.release(total - handed)
            for s in opened:
                s.go.set()
        if later:
            if self._transfers is None:
                self._transfers = ThreadPool(1, "mtc-transfer")
            self._transfer = self._transfers.submit(self._pull, later, reserved)
        return True

    def _pull(self, later: list[tuple[HostSave, list[Later]]], reserved: bool) -> None:
        """Bring owned device shards to host memory, shard by shard, handing each to
        its save's writer as it lands (the transfer thread), with the transfers of
        the next TRANSFER_AHEAD_BYTES under way."""
        left = [(save, list(xs)) for save, xs in later]
        queue = [x[4] for _, xs in left for x in xs]  # queue[0]: the next waited for
        sizes = [math.prod(x[2]) * x[3].itemsize for _, xs in left for x in xs]
        issued = 0  # queue[:issued] have their transfers under way (or done)
        try:
            for save, xs in left:
                while xs:
                    leaf, index, shape, dtype, src = xs[0]
                    nbytes = math.prod(shape) * dtype.itemsize
                    wanted = transfers_under_way(sizes, TRANSFER_AHEAD_BYTES)
                    for k in range(issued, wanted):
                        queue[k].copy_to_host_async()
                    issued = max(issued, wanted) - 1
                    del queue[0], sizes[0]
                    host = np.asarray(src)  # waits for this shard's transfer
                    if not reserved:
                        self.pool.account(nbytes)
                    xs.pop(0)
                    save.add(StagedShard(leaf, index, host, self._releaser(nbytes)))
                    del src, host  # the device copy's shard is freed with its last view
                save.seal()
        except BaseException as e:
            if reserved:
                self.pool.release(sum(math.prod(x[2]) * x[3].itemsize
                                      for _, xs in left for x in xs))
            for save, xs in left:
                if xs:
                    save.abort(e)
            raise

    def _releaser(self, nbytes: int) -> Callable[[], None]:
        return lambda: self.pool.release(nbytes)

    def finish_transfer(self) -> None:
        """Wait until the last save's owned shards are all in host memory (their
        errors reach the save, which reports them)."""
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            futures_wait([transfer])

    def stage_views(self, header: SaveHeader, host: int,
                    shards: Sequence[tuple[int, Index, np.ndarray]],
                    on_written: Callable[[BaseException | None], None], *,
                    slice_: int | None = None, num_hosts: int | None = None) -> None:
        """Queue one host's shards that are in host memory already (a sidecar's view
        of the shared-memory area): (leaf number, index, bytes). The memory must
        stay as it is until ``on_written`` is called, with the save's error or None.
        ``slice_`` and ``num_hosts``: the host's place in the saving job (default:
        this agent's configuration)."""
        self.raise_background_error()
        self._clean_once(host)
        save = HostSave(self.config.root(host), header.step, host,
                        self.config.slice_of_host[host] if slice_ is None else slice_,
                        len(self.config.slice_of_host) if num_hosts is None else num_hosts,
                        list(header.leaves), header.run, header.ranks)
        save.done.add_done_callback(lambda f: on_written(f.exception()))
        self.writer.submit(save)
        with self._lock:
            self._pending.append(save)
        for leaf, index, data in shards:
            save.add(StagedShard(leaf, index, data, lambda: None))
        save.seal()
        save.go.set()

    def _plan(self, hosts: Sequence[int], arrays: Sequence[jax.Array | np.ndarray],
              host_of: dict[int, int]
              ) -> dict[int, list[tuple[int, Index, tuple[int, ...], np.dtype[Any], Any]]]:
        """Per host: (array number, index, shape, dtype, source) of each distinct shard
        it holds (which shards those are is worked out once per layout: ShardPlans)."""
        out: dict[int, list[tuple[int, Index, tuple[int, ...], np.dtype[Any], Any]]] = {
            h: [] for h in hosts}
        for i, a in enumerate(arrays):
            if isinstance(a, np.ndarray):
                for h in hosts:
                    out[h].append((i, tuple((0, d) for d in a.shape), a.shape, a.dtype, a))
                continue
            dtype = np.dtype(a.dtype)
            shards = None
            for pos, h, index, shape in self._distinct_shards(a, host_of):
                if h not in out:
                    continue
                if a.is_fully_replicated:  # addressable_data gives one shard for all
                    shards = shards or a.addressable_shards
                    data = shards[pos].data
                else:
                    data = a.addressable_data(pos)
                out[h].append((i, index, shape, dtype, data))
        return out

    def _snapshot(self, leaf: int, index: Index, shape: tuple[int, ...],
                  dtype: np.dtype[Any], src: Any, reserved: bool) -> StagedShard:
        nbytes = math.prod(shape) * dtype.itemsize
        if _is_jax_array(src):
            # Elsewhere than CPU the transfer made a fresh host copy. On CPU devices
            # np.asarray is a view of the device buffer: an external reference, and
            # PJRT never donates a buffer that has one, so a donating step after
            # save() writes new buffers and these bytes stay as they were at save.
            # The view is dropped once written. (tests/test_save_restore.py checks
            # the values.)
            host = np.asarray(src)
            if not reserved:
                self.pool.account(nbytes)
            return StagedShard(leaf, index, host, lambda: self.pool.release(nbytes))
        # A numpy leaf is the caller's mutable memory: copy it into a staging buffer.
        buf = self.pool.acquire(nbytes, reserved=reserved) if nbytes else np.empty(0, np.uint8)
        assert buf is not None
        dst = buf.view(dtype).reshape(shape)
        np.copyto(dst, np.asarray(src), casting="no")
        return StagedShard(leaf, index, dst, lambda: self.pool.release(nbytes, buf))

    def _clean_once(self, host: int) -> None:
        if host not in self._cleaned:
            removed = clean_uncommitted(self.config.root(host))
            if removed:
                log.info("host %d: removed uncommitted folders %s", host, removed)
            self._cleaned.add(host)

    # -- background state -------------------------------------------------------

    def raise_background_error(self) -> None:
        """Raise the first error of a finished background save, once: the other
        hosts' parts of the same step that failed too go with it (one failed save,
        one error, as Orbax's; a later call does not raise it again)."""
        with self._lock:
            for save in self._pending:
                if save.done.done() and save.done.exception() is not None:
                    self._pending = [s for s in self._pending if not s.done.done() or (
                        s.step != save.step and s.done.exception() is not None)]
                    raise save.done.exception()  # type: ignore[misc]
            self._pending = [s for s in self._pending if not s.done.done()]

    def wait(self) -> None:
        """Block until every save queued when called is committed; raise the first
        failure among them. Waiters in several threads each wait for every one of
        those saves (none returns while one is still being written) and each raises
        its failure, as Orbax's do; the failure is then cleared: a later wait (or
        the next save) no longer raises it."""
        with self._lock:
            pending = list(self._pending)
        first: BaseException | None = None
        for save in pending:
            e = save.done.exception()  # blocks until the save is done
            if e is not None and first is None:
                first = e
        with self._lock:
            self._pending = [s for s in self._pending if s not in pending]
        if first is not None:
            raise first

    def in_flight(self) -> int:
        with self._lock:
            return sum(not s.done.done() for s in self._pending)

    def close(self) -> None:
        try:
            self.wait()
        except MtcError as e:
            log.warning("a background save failed before close: %s", e)
        finally:
            try:
                if self._transfers is not None:
                    self._transfers.shutdown(wait=True)
            finally:
                self.writer.close()
