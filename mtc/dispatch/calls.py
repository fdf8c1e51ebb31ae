"""What every dispatcher offers (:class:`Dispatch`), and the host-call layer the three
dispatchers share (:class:`HostCalls`): each host operation of :mod:`mtc.operations`
as a typed call, over the one request/reply channel a dispatcher provides
(:meth:`HostCalls._call`: how a request reaches the hosts). Every request is made
from the table's typed entry; no dispatcher names an operation by a string."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from mtc.contract import LeafSpec, Piece, ReadTask, SaveHeader
from mtc.dispatch.protocol import BeforeSend, Dispatch, Opened, Survey
from mtc.errors import HostAgentError, ManifestError
from mtc.manifest import MANIFEST_NAME, Manifest
from mtc.operations import (
    DELETE,
    MANIFEST,
    OPEN,
    READ,
    RETAIN,
    SETTLE,
    SPACE,
    STEPS,
    SURVEY,
    NoArgs,
    OpenRequest,
    Operation,
    ReadRequest,
    Request,
    RetainRequest,
    StepRequest,
    SurveyRequest,
)
from mtc.shards import paste

__all__ = ["POLL_INTERVAL_S", "Dispatch", "HostCalls", "Survey", "merged", "poll_due",
           "regions_of"]

# Between saves, how often a save in flight is polled for its background error (by
# the dispatchers whose hosts answer late: a round trip to every host at every
# step, through sidecar processes, is a cost every step pays for an error that is
# rare and may wait a second).
POLL_INTERVAL_S = 1.0


def poll_due(in_flight: bool, polled: float, now: float) -> bool:
    """Whether a call between saves polls the hosts for an earlier save's error: only
    while a save is in flight (one every host reported written can raise nothing
    more), and at most every POLL_INTERVAL_S since the last poll (``polled``, on
    the clock of ``now``), so that its error comes within about a second of the
    write failing without a round trip at every training step."""
    return in_flight and now - polled >= POLL_INTERVAL_S


T = TypeVar("T")
Q = TypeVar("Q", bound=Request)
R = TypeVar("R")


def merged(replies: Sequence[dict[int, T]]) -> dict[int, T]:
    """Replies keyed by host, from every host process that answered, as one."""
    out: dict[int, T] = {}
    for reply in replies:
        out.update(reply)
    return out


def regions_of(tasks: Sequence[ReadTask], reply: Any) -> list[np.ndarray]:
    """The regions of a ``read`` reply: the tasks' bytes end to end."""
    raw, regions, pos = memoryview(reply), [], 0
    for t in tasks:
        dt = jax.numpy.dtype(t.dtype)
        n = math.prod(t.shape) * dt.itemsize
        regions.append(np.frombuffer(raw[pos:pos + n], dtype=dt).reshape(t.shape))
        pos += n
    return regions


def _read_once(tasks: Sequence[ReadTask]) -> tuple[list[ReadTask], dict[int, tuple[int, ...]]]:
    """One task per distinct (leaf, region), and for each (by ``id``) every device
    that needs it. Of the tasks that plan the same region (one per host needing
    it), the one whose pieces' hosts have been given the fewest bytes so far is
    read: the reads spread over the replicas' hosts instead of all going to one."""
    groups: dict[tuple[int, tuple[tuple[int, int], ...]], list[ReadTask]] = {}
    for t in tasks:
        groups.setdefault((t.leaf, t.index), []).append(t)
    given: dict[int, int] = {}
    reads: list[ReadTask] = []
    targets: dict[int, tuple[int, ...]] = {}
    for same in groups.values():
        chosen = min(same, key=lambda t: sum(given.get(p.host, 0) for p in t.pieces))
        nbytes = math.prod(chosen.shape) * jax.numpy.dtype(chosen.dtype).itemsize
        for p in chosen.pieces:
            given[p.host] = given.get(p.host, 0) + nbytes
        reads.append(chosen)
        targets[id(chosen)] = tuple(d for t in same for d in t.device_ids)
    return reads, targets


class HostCalls:
    """The host operations, as typed calls over one request/reply channel; a
    dispatcher says how a request reaches the hosts (:meth:`_call`) and how a
    save's and a restore's arrays move (``stage``, ``wait``, ``load``...)."""

    # Whether the host side takes the writer lock of a root: where it runs in the
    # trainer's process the lock dies with that process, as it must. A sidecar
    # outlives its trainer, so there the trainer locks its side of the host.
    host_side_lock = True

    def _call(self, op: Operation[Any, Any], hosts: Sequence[int], request: Request
              ) -> list[Any]:
        """The transport: every answering host process's decoded reply (typed errors
        raised) to ``op``'s ``request`` about ``hosts`` (:meth:`Operation.encode`)."""
        raise NotImplementedError

    def ask(self, op: Operation[Q, R], hosts: Sequence[int], request: Q) -> list[R]:
        """Every answering host process's typed reply to ``request``."""
        return [op.reply(r) for r in self._call(op, hosts, request)]

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        raise NotImplementedError

    def raise_background_error(self) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def check_before_save(self, due: bool) -> None:
        self.raise_background_error()

    def save(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray],
             hosts: Sequence[int], before_send: BeforeSend) -> bool:
        before_send(Survey(None, self.steps(hosts)))
        return self.stage(header, arrays)

    def saving(self) -> bool | None:
        return None

    def saves_in_flight(self, hosts: Sequence[int]) -> int:
        return 1  # not reported by the hosts: assume the last save is still going

    def steps(self, hosts: Sequence[int]) -> dict[int, list[int]]:
        """Committed steps of every host reachable (``hosts``, and with host
        subfolders the roots beside them)."""
        return merged(self.ask(STEPS, hosts, NoArgs()))

    def survey(self, hosts: Sequence[int], step: int | None, *,
               manifests: bool = True) -> Survey:
        held: dict[int, list[int]] = {}
        facts: dict[tuple[int, int], tuple[int, str]] = {}
        found: dict[int, Manifest] = {}
        space: dict[int, tuple[int, int]] = {}
        # Not merged: a host process that reaches other hosts' roots (host folders)
        # lists them too, but sends only its own hosts' manifests and space.
        for reply in self.ask(SURVEY, hosts, SurveyRequest(manifests, step)):
            for h, got in reply.items():
                held[h] = got.steps
                facts.update({(s, h): f for s, f in got.facts.items()})
                if got.manifest is not None:
                    found[h] = self._checked(got.manifest[1].encode(), got.manifest[0], h)
                if got.space is not None:
                    space[h] = got.space
        return Survey(step, held, facts, found, space)

    @staticmethod
    def _checked(data: bytes, step: int, host: int) -> Manifest:
        path = f"host {host}: {step}/{MANIFEST_NAME}"
        m = Manifest.from_bytes(data, path=path)
        if m.step != step or m.host != host:
            raise ManifestError(f"manifest belongs to step {m.step} host {m.host}", step=step,
                                host=host, path=path)
        return m

    def _one(self, op: Operation[Q, R], host: int, request: Q) -> R:
        found = [r for r in self._call(op, [host], request) if r is not None]
        if len(found) != 1:
            raise HostAgentError(f"{op.name}: {len(found)} host processes answered for one "
                                 "host", host=host)
        return op.reply(found[0])

    def manifest(self, step: int, host: int) -> Manifest:
        return self._checked(self._one(MANIFEST, host, StepRequest(step)), step, host)

    def read(self, step: int, host: int, tasks: Sequence[ReadTask]) -> list[np.ndarray]:
        """Regions of leaves from pieces ``host`` holds, verified there."""
        return self._fetch(step, {host: list(tasks)})[host]

    def _fetch(self, step: int, by_host: dict[int, list[ReadTask]]
               ) -> dict[int, list[np.ndarray]]:
        """Each host reads its tasks' regions; the bytes come back in the reply."""
        return {host: regions_of(tasks, self._one(READ, host, ReadRequest(step, tasks)))
                for host, tasks in by_host.items()}

    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
        """Restore's reads onto the target devices: each region from the one host
        holding all its pieces, or assembled here from each holder's pieces
        (resharding across hosts); no host reads another's RAM disk, and no
        target sharding or device id reaches a host.

        A region the devices of several hosts need (a leaf replicated over the
        slices, each slice a data-parallel replica) is read once, by the least
        loaded of the hosts planned to read it, and placed onto all of them: a
        restore reads one replica and broadcasts it, as the controller holds
        every device (on a single-controller job; a multi-controller process
        plans its own hosts only)."""
        reads, targets = _read_once(tasks)
        whole: dict[int, list[ReadTask]] = {}
        split: list[ReadTask] = []
        for t in reads:
            holders = {p.host for p in t.pieces}
            if len(holders) == 1:
                whole.setdefault(holders.pop(), []).append(t)
            else:
                split.append(t)
        parts: dict[int, list[ReadTask]] = {}
        for t in split:
            for p in t.pieces:
                parts.setdefault(p.host, []).append(
                    ReadTask(t.leaf, p.entry.index, t.dtype, (), (p,)))
        asked = {h: whole.get(h, []) + parts.get(h, []) for h in sorted({*whole, *parts})}
        fetched = self._fetch(step, asked)
        regions: dict[int, np.ndarray] = {}  # id(task) -> its region
        got: dict[tuple[int, Piece], np.ndarray] = {}
        for host, ts in asked.items():
            n_whole = len(whole.get(host, []))
            for k, (t, r) in enumerate(zip(ts, fetched[host], strict=True)):
                if k < n_whole:
                    regions[id(t)] = r
                else:
                    got[(t.leaf, t.pieces[0])] = r
        for t in split:
            out = np.empty(t.shape, dtype=jax.numpy.dtype(t.dtype))
            for p in t.pieces:
                paste(out, t.index, got[(t.leaf, p)], p.entry.index)
            regions[id(t)] = out
        devices = {d.id: d for spec in specs.values() for d in spec.sharding.device_set}
        # One batched device_put for every shard: one by one, each pays a dispatch.
        keys = [(t, dev) for t in reads for dev in targets[id(t)]]
        placed = jax.device_put([regions[id(t)] for t, _ in keys],
                                [devices[dev] for _, dev in keys])
        singles = {(t.leaf, dev): a for (t, dev), a in zip(keys, placed, strict=True)}
        arrays: dict[int, jax.Array] = {}
        for leaf, spec in specs.items():
            local = [singles[(leaf, d.id)] for d in spec.sharding.addressable_devices
                     if (leaf, d.id) in singles]
            arrays[leaf] = jax.make_array_from_single_device_arrays(spec.shape, spec.sharding,
                                                                    local)
        return arrays

    def delete(self, step: int, hosts: Sequence[int]) -> None:
        self.ask(DELETE, hosts, StepRequest(step))

    def open(self, hosts: Sequence[int], *, read_only: bool,
             identify: bool = False, metadata: str | None = None) -> dict[int, Opened]:
        """Make the hosts' roots usable; unless ``read_only``, take each root's writer
        lock (another process's manager gets DirectoryLockedError) and remove
        uncommitted folders. Returns what each root holds (:class:`Opened`;
        ``identify``: with its identity, written where none is yet), in one request
        to every host. ``metadata``: root metadata (JSON) to keep where none is kept
        (a writer's only)."""
        return merged(self.ask(OPEN, hosts, OpenRequest(
            lock=self.host_side_lock and not read_only, clean=not read_only,
            identify=identify, metadata=None if read_only else metadata)))

    def retain(self, hosts: Sequence[int], complete: Sequence[int], *, max_to_keep: int | None,
               keep_period: int | None, before_write: bool) -> dict[int, tuple[int, int]]:
        """Each host deletes (in the background) what ``mtc.retention.to_delete`` says of
        its steps; returns what :meth:`space` would, in the same round trip."""
        return merged(self.ask(RETAIN, hosts, RetainRequest(
            list(complete), max_to_keep, keep_period, before_write)))

    def space(self, hosts: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Per host: (bytes free on its RAM disk, bytes of its newest step)."""
        return merged(self.ask(SPACE, hosts, NoArgs()))

    def settle(self, hosts: Sequence[int]) -> None:
        """Wait until the hosts' background deletions have freed their space."""
        self.ask(SETTLE, hosts, NoArgs())

    def own_for(self, step: int) -> tuple[int, ...]:
        """With the network tier (multi-controller JAX, this process alone with its
        host's RAM disk): the saving hosts whose data of ``step`` that RAM disk
        holds (:meth:`mtc.sidecar.ops.HostOps.own_for`). () elsewhere."""
        return ()

    def networked(self) -> bool:
        return False

    def network_bytes(self) -> int:
        """Bytes of other hosts' files this process has read over the network tier
        (multi-controller JAX; 0 elsewhere, where no host reads another's files)."""
        return 0
