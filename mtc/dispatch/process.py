"""Host-side code in a sidecar process per host, reached over gRPC (the local cluster).

Each simulated host is its own processes: a sidecar (``python -m mtc.sidecar.host.main``)
that alone sees the host's RAM disk, and the host's replicator. This dispatcher
is what the controller holds instead of host-side objects: a request per host
operation, and the array bytes through each host's shared-memory area.

Save: the distinct shards of each host are copied into a slot of that host's area
(the copy is the save's stall, as the device-to-host copy is on a TPU) and the
sidecar writes them from there; a slot is reused once the sidecar reports the
save written. The stage requests' answers are awaited by the next request, not
by the save (a refusal is raised there, like a background write's error).
Restore: the host holding each piece reads it, verified, into a fresh reply file
of its area, which the controller maps onto its devices.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import jax
import numpy as np

from mtc import root_lock, transfer
from mtc.contract import AgentConfig, ReadTask, SaveHeader, decode_reply, encode_request
from mtc.dispatch.calls import POLL_INTERVAL_S as POLL_INTERVAL_S  # its name here too
from mtc.dispatch.calls import HostCalls, merged, poll_due
from mtc.dispatch.protocol import BeforeSend, Opened, Survey
from mtc.errors import ConfigError, MtcError, SaveInProgressError, ShardUnavailableError
from mtc.operations import (
    HELLO,
    LOAD,
    POLL,
    STAGE,
    STEPS,
    WAIT,
    NoArgs,
    Operation,
    ReadRequest,
    Request,
    StageRequest,
)
from mtc.pool import ThreadPool
from mtc.shards import ShardPlans

if TYPE_CHECKING:
    from mtc.credentials import Credentials

METHOD = "/mtc.Host/Call"
Call = tuple[Operation[Any, Any], Request]  # a request to one host: its operation, arguments
MAX_MESSAGE = 256 << 20
SLOTS_PER_HOST = 2
WAIT_DEADLINE_S = 600.0  # a host's writes of its part of one save, at the slowest


@dataclasses.dataclass(frozen=True)
class Sidecar:
    """Where one host's sidecar listens, its shared-memory area (as the trainer sees it),
    the credentials it takes, and whether it runs colocated-Python programs (a
    Pathways worker's, started with ``--colocated-devices``)."""

    address: str
    area: Path
    creds: Credentials | None = None
    colocated: bool = False


def channels(sidecars: dict[int, Sidecar], method: str, creds: Credentials | None = None
             ) -> tuple[dict[int, grpc.Channel], dict[int, Any]]:
    """A channel to each host's sidecar, and a raw-bytes stub of ``method`` on it that
    presents ``creds`` (the replicators' token, or this process's certificate)."""
    # A sidecar restarted on its host serves again within a second or two; with
    # gRPC's default reconnect backoff (1 s, growing to 2 min) a channel that found it
    # dead kept failing calls at once with the old "connection refused" for seconds
    # after it served again. Retried every 0.1 s at first, at most every 2 s.
    # ``min_reconnect_backoff_ms`` is, to gRPC, the least time a connection attempt
    # is given (20 s by default): at 100 ms, a sidecar on a loaded machine that took
    # longer to answer its first HTTP/2 frame failed the manager's first call
    # ("connection attempt timed out before receiving SETTINGS frame", a clean-clone
    # run, 2026-12-07). 2 s: a host cut off is still told within seconds.
    opts = [("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 2000),
            ("grpc.max_reconnect_backoff_ms", 2000)]
    cc = creds.channel_credentials() if creds is not None else None
    chans = {h: grpc.secure_channel(s.address, cc, options=opts) if cc else
             grpc.insecure_channel(s.address, options=opts) for h, s in sidecars.items()}
    metadata = tuple(creds.call_metadata()) if creds is not None else ()
    return chans, {h: _with_metadata(c.unary_unary(method, request_serializer=None,
                                                   response_deserializer=None), metadata)
                   for h, c in chans.items()}


def _with_metadata(stub: Any, metadata: tuple[tuple[str, str], ...]) -> Any:
    if not metadata:
        return stub

    def call(request: bytes, **kw: Any) -> Any:
        return stub(request, metadata=metadata, **kw)

    return call


class ProcessDispatch(HostCalls):
    """Talks to one sidecar process per host. Not thread-safe: the manager's thread.

    The writer lock of a host is taken here, on the trainer's side of the host's
    shared-memory area: it dies with the trainer, while the sidecar lives on."""

    host_side_lock = False

    def __init__(self, config: AgentConfig, sidecars: dict[int, Sidecar],
                 *, deadline_s: float = 120.0, creds: Credentials | None = None) -> None:
        missing = sorted(set(config.slice_of_host) - set(sidecars))
        if missing:
            raise ConfigError(f"no sidecar for hosts {missing}")
        self.config = config
        self.sidecars = sidecars
        self.deadline_s = deadline_s
        self._channels, self._stubs = channels(sidecars, METHOD, creds)
        self._locks: dict[int, int] = {}  # host -> descriptor of the area's writer lock
        self._slots = {h: [transfer.SaveSlot(s.area, f"save-{k}") for k in range(SLOTS_PER_HOST)]
                       for h, s in sidecars.items()}
        # Requests to the hosts at once (two per host: a save's poll and listing go
        # together), and apart from them each host's copy into its save slot, so
        # that requests made while the copies run do not queue behind them.
        # Threads started now: saves are still waited for at interpreter exit.
        self._pool = ThreadPool(max(1, 2 * len(sidecars)), "mtc-hosts")
        self._copy_pool = ThreadPool(max(1, len(sidecars)), "mtc-copy")
        # The last save's stage requests, answered or not: joined before any other
        # request goes to a host (so nothing overtakes them), their errors raised then.
        self._staging: dict[int, Future[Any]] = {}
        self._staging_slots: dict[int, transfer.SaveSlot] = {}
        self._polled = 0.0  # time.monotonic() of the last poll of every host
        self._plans = ShardPlans()  # which shards each host writes, per array layout

    @classmethod
    def connect(cls, config: AgentConfig, addresses: Sequence[str],
                deadline_s: float = 120.0, creds: Credentials | None = None
                ) -> ProcessDispatch:
        return cls(config, find_sidecars(config, addresses, deadline_s, creds),
                   deadline_s=deadline_s, creds=creds)

    def _channels_close(self) -> None:
        self._pool.shutdown(wait=True)  # no request is left in flight
        self._copy_pool.shutdown(wait=True)
        for c in self._channels.values():
            c.close()

    # -- requests -------------------------------------------------------------------

    def _rpc(self, host: int, op: Operation[Any, Any], request: Request) -> Any:
        """``op``'s typed reply from one host."""
        return op.reply(self._all({host: (op, request)})[host])

    def _join_staging(self) -> None:
        """Wait for the last save's stage requests. A host that refused (or did not
        answer) never reads its slot, which is free again; the first error is raised
        here, on the call after the save, as a background write's error would be."""
        if not self._staging:
            return
        pending, slots = self._staging, self._staging_slots
        self._staging, self._staging_slots = {}, {}
        accepted: dict[int, Any] = {}
        try:
            accepted, error = self._gather(pending)
        finally:
            for h in pending:
                if h not in accepted:
                    slots[h].busy = False
        if error is not None:
            raise error

    def _fan_out(self, calls: dict[int, Call], timeout: float | None
                 ) -> tuple[dict[int, Any], MtcError | None]:
        """Requests to several hosts at once (``timeout`` seconds each, None: no limit);
        every reply awaited. Returns the replies of the hosts that answered, and the
        first error (in host order) or None. The last save's stage requests are
        answered first (:meth:`_join_staging`)."""
        self._join_staging()
        # Not wait_for_ready: a host whose sidecar is gone (connection refused) is
        # reported at once, as unavailable, instead of when the deadline ends.
        # Blocking calls on a pool of this object's own: a gRPC future starts a
        # thread per call, a cost paid again on every save's stall.
        futures = {h: self._pool.submit(self._request, h, op.name, request.args(), timeout)
                   for h, (op, request) in calls.items()}
        return self._gather(futures)

    def _request(self, host: int, op: str, args: dict[str, Any], timeout: float | None) -> Any:
        """The wire: one host's decoded reply to the request ``op`` with ``args`` (the
        typed ``request.args()`` of a table entry), which names the one host it asks."""
        return decode_reply(self._stubs[host](encode_request(op, [host], **args),
                                              timeout=timeout))

    @staticmethod
    def _gather(futures: dict[int, Future[Any]]) -> tuple[dict[int, Any], MtcError | None]:
        wait(futures.values())  # every call ended, whatever the first one raised
        out: dict[int, Any] = {}
        first: MtcError | None = None
        for h, fut in futures.items():
            try:
                out[h] = fut.result()
            except grpc.RpcError as e:
                first = first or ShardUnavailableError(
                    f"sidecar unreachable: {e.code().name}: {e.details()}", host=h)
            except MtcError as e:
                first = first or e
        return out, first

    def _all(self, calls: dict[int, Call]) -> dict[int, Any]:
        out, error = self._fan_out(calls, self.deadline_s)
        if error is not None:
            raise error
        return out

    def _call(self, op: Operation[Any, Any], hosts: Sequence[int], request: Request
              ) -> list[Any]:
        replies = self._all({h: (op, request) for h in hosts if h in self.sidecars})
        return [replies[h] for h in sorted(replies)]

    # -- save -----------------------------------------------------------------------

    def _release(self, host: int, written: list[str]) -> None:
        for slot in self._slots[host]:
            if slot.name in written:
                slot.busy = False

    def _free_slot(self, host: int, *, block: bool) -> transfer.SaveSlot | None:
        for _ in range(2):
            free = [s for s in self._slots[host] if not s.busy]
            if free:
                return free[0]
            self._release(host, self._rpc(host, WAIT if block else POLL, NoArgs()))
        return None

    def saves_in_flight(self, hosts: Sequence[int] = ()) -> int:
        """Saves staged on some host and not yet reported written there (at most):
        each holds its host's slot until a poll or wait says it was written."""
        return max((sum(s.busy for s in slots) for slots in self._slots.values()), default=0)

    def poll_and_steps(self, hosts: Sequence[int]) -> dict[int, list[int]]:
        """:meth:`raise_background_error` and :meth:`steps` in one round trip: both
        requests to every host at once. A background error is raised first, as
        if the poll had come alone; slots reported written are free again."""
        self._join_staging()
        calls = [(h, POLL) for h in self.sidecars] + [(h, STEPS) for h in hosts
                                                      if h in self.sidecars]
        futures = [self._pool.submit(self._request, h, op.name, {}, self.deadline_s)
                   for h, op in calls]
        polled, poll_error = self._gather({h: f for (h, op), f in zip(calls, futures,
                                                                      strict=True)
                                           if op is POLL})
        listed, list_error = self._gather({h: f for (h, op), f in zip(calls, futures,
                                                                      strict=True)
                                           if op is STEPS})
        self._polled = time.monotonic()
        for h, names in polled.items():
            self._release(h, POLL.reply(names))
        if poll_error is not None:
            raise poll_error
        if list_error is not None:
            raise list_error
        return merged([STEPS.reply(listed[h]) for h in sorted(listed)])

    def check_before_save(self, due: bool) -> None:
        # A save that follows asks every host for earlier errors while its shards
        # are copied (:meth:`save`); a call off the interval costs no round trip.
        if not due:
            self.poll_if_due()

    def save(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray],
             hosts: Sequence[int], before_send: BeforeSend) -> bool:
        """:meth:`stage`, the hosts polled and listed while the copies run."""
        return self.stage(header, arrays,
                          before_send=lambda: before_send(
                              Survey(None, self.poll_and_steps(hosts))))

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray], *,
              before_send: Callable[[], None] | None = None) -> bool:
        """Copy each host's shards into a free slot of its area, then ask every host
        to write them. ``before_send`` runs on the caller's thread while the copies
        run (the manager asks the hosts for earlier saves' errors and their steps,
        and frees room on the RAM disks then: round trips the copies hide); the
        hosts are asked to write only once it returned, and not when it raised.

        Returns once the shards are in the areas and the requests sent: the state
        may change from then on. The hosts' answers are not awaited here (that
        round trip was most of the stall beyond the copy): the next request to the
        hosts waits for them first, and raises a refusal, as the next call raises
        a background write's error. A step is committed only by its host's writer,
        once every byte is written and checksummed, as before."""
        self._join_staging()
        host_of = self.config.host_of_device
        per_host: dict[int, list[tuple[int, Any, tuple[int, ...], np.dtype[Any], Any]]] = {
            h: [] for h in self.sidecars}
        for i, a in enumerate(arrays):
            leaf = header.array_leaves[i]
            if isinstance(a, np.ndarray):  # every host keeps a copy of a numpy leaf
                for h in per_host:
                    per_host[h].append((leaf, tuple((0, d) for d in a.shape), a.shape,
                                        a.dtype, a))
                continue
            shards = a.addressable_shards
            for pos, h, index, shape in self._plans(a, host_of):
                per_host[h].append((leaf, index, shape, np.dtype(a.dtype), shards[pos].data))
        slots: dict[int, transfer.SaveSlot] = {}
        for h in per_host:
            slot = self._free_slot(h, block=not header.skip_if_busy)
            if slot is None:
                if header.skip_if_busy:
                    return False
                raise SaveInProgressError("no save slot freed up", step=header.step, host=h)
            slots[h] = slot
        encoded = header.to_bytes().decode()

        def copy(h: int, items: list[Any]) -> StageRequest:
            # One host's shards into its slot (numpy copies without the GIL: the
            # hosts' copies run side by side).
            sizes = [int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                     for _, _, shape, dt, _ in items]
            offsets, total = transfer.layout_regions(sizes)
            slot = slots[h]
            view = slot.ensure(total)
            table = []
            for (leaf, index, shape, dt, src), off, n in zip(items, offsets, sizes, strict=True):
                dst = view[off:off + n].view(dt).reshape(shape)
                np.copyto(dst, np.asarray(src), casting="no")
                table.append([leaf, [list(p) for p in index], dt.str, list(shape), off])
            return StageRequest(encoded, slot.name, slot.size, table,
                                self.config.slice_of_host[h], len(self.config.slice_of_host))

        staged = {h: items for h, items in per_host.items() if items}
        copies = {h: self._copy_pool.submit(copy, h, items) for h, items in staged.items()}
        try:
            if before_send is not None:
                before_send()  # this save is not in flight yet (its slots not busy)
        finally:
            wait(copies.values())  # no copy is left writing into a slot
        requests = {h: f.result() for h, f in copies.items()}
        # Every stage request once every copy is done: a sidecar writing its
        # host's save would take CPU from the copies still running (the stall).
        for h in staged:
            slots[h].busy = True
        self._staging_slots = {h: slots[h] for h in staged}
        self._staging = {h: self._pool.submit(self._request, h, STAGE.name, req.args(),
                                              self.deadline_s)
                         for h, req in requests.items()}
        return True

    def _each(self, op: Operation[NoArgs, list[str]]) -> None:
        """``poll`` or ``wait`` on every host; slots they report written are free again
        (those of the hosts that answered, even when another one failed)."""
        # A wait lasts as long as the writes, but not forever: a host whose link is
        # gone never answers (no reset crosses a dead link).
        written, error = self._fan_out({h: (op, NoArgs()) for h in self.sidecars},
                                       max(WAIT_DEADLINE_S, self.deadline_s) if op is WAIT
                                       else self.deadline_s)
        self._polled = time.monotonic()
        for h, names in written.items():
            self._release(h, op.reply(names))
        if error is not None:
            raise error

    def wait(self) -> None:
        self._each(WAIT)

    def raise_background_error(self) -> None:
        self._each(POLL)

    def poll_if_due(self) -> None:
        """:meth:`raise_background_error` for a call between saves: only while a
        save is in flight (one whose every host reported it written can raise
        nothing more: a failed write keeps its slot until the poll that raises it),
        and at most every ``POLL_INTERVAL_S``. So its error comes within about a
        second of the write failing, instead of at the very next step."""
        if poll_due(bool(self._staging) or self.saves_in_flight() > 0, self._polled,
                    time.monotonic()):
            self._each(POLL)

    # -- restore --------------------------------------------------------------------

    def _fetch(self, step: int, by_host: dict[int, list[ReadTask]]
               ) -> dict[int, list[np.ndarray]]:
        """Regions each host reads from its own pieces, mapped from its reply file."""
        replies = self._all({h: (LOAD, ReadRequest(step, ts)) for h, ts in by_host.items()})
        out: dict[int, list[np.ndarray]] = {}
        for host, raw in replies.items():
            reply = LOAD.reply(raw)
            name = reply.file
            if "/" in name or not name.startswith("reply-"):
                raise MtcError(f"sidecar named a bad reply file {name!r}", host=host)
            path = self.sidecars[host].area / name
            view = transfer.map_file(path, reply.size, writable=False)
            os.unlink(path)  # the mapping lives on as long as arrays use it
            regions = []
            for t, off in zip(by_host[host], reply.offsets, strict=True):
                dt = jax.numpy.dtype(t.dtype)
                n = int(np.prod(t.shape, dtype=np.int64)) * dt.itemsize
                regions.append(view[off:off + n].view(dt).reshape(t.shape))
            out[host] = regions
        return out

    def open(self, hosts: Sequence[int], *, read_only: bool,
             identify: bool = False, metadata: str | None = None) -> dict[int, Opened]:
        if not read_only:
            try:
                for h in hosts:
                    if h not in self._locks:
                        self._locks[h] = root_lock.lock_root(self.sidecars[h].area)
            except BaseException:
                self._unlock()
                raise
        return super().open(hosts, read_only=read_only, identify=identify, metadata=metadata)

    def _unlock(self) -> None:
        for h, fd in self._locks.items():
            root_lock.unlock_root(fd, self.sidecars[h].area)
        self._locks.clear()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._unlock()
            self._channels_close()


def find_sidecars(config: AgentConfig, addresses: Sequence[str], deadline_s: float = 120.0,
                  creds: Credentials | None = None) -> dict[int, Sidecar]:
    """Ask each sidecar (in rank order: the i-th address serves this job's host i,
    whichever host it is in a larger cluster) where its area is."""
    if len(addresses) != len(config.slice_of_host):
        raise ConfigError(f"{len(addresses)} sidecars for {len(config.slice_of_host)} hosts")
    sidecars = {h: Sidecar(a, Path()) for h, a in enumerate(addresses)}
    probe = ProcessDispatch(config, sidecars, deadline_s=deadline_s, creds=creds)
    try:
        for h in sidecars:
            hello = probe._rpc(h, HELLO, NoArgs())
            if hello.rank != h:
                raise ConfigError(f"sidecar at {addresses[h]} did not take rank {h}", host=h)
            sidecars[h] = Sidecar(addresses[h], Path(hello.area), creds, hello.colocated)
    finally:
        probe._channels_close()
    return sidecars
