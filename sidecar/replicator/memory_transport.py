"""The transport seam (``transport.py``) in memory: replicators of one process call
each other's parts directly, no socket, no thread of their own, with faults a test
sets (a link cut, a call dropped, a delay). For tests of the replicator's logic
(the restore agreement, a copy, a fetch); what needs real processes and sockets
(kills, the data channel, TLS, authentication) stays on gRPC (``wire/``).

What a call goes through is what gRPC's does, less the bytes on a wire: the
request is checked as the server checks it (``checks.py``), the receiving side is
the same code (:class:`~.copies.receive.Receiver`, :mod:`.copies.servable`, the
agreement's ``decide_for``), a domain error comes back as a
:class:`~mtc.grpc_errors.PeerError` with the status the server would answer
(``mtc/grpc_errors.py``'s one map), and a call whose answer comes after its
deadline fails ``DEADLINE_EXCEEDED`` whatever the answer was. Calls are not
authenticated here: who may call is ``wire/security.py``'s, tested over gRPC.

    net = Network()
    nodes = {r: Node(config_of(r), root_of(r), Credentials(), peers=net.peers(r, 3))
             for r in range(3)}
    for r, n in nodes.items():
        net.serve(r, Endpoint.of(n))
    net.partition({0, 1}, {2})   # cut every link between the two groups
    net.drop("Commit", times=1)  # the next Commit sent anywhere is lost
    net.lose_answers("Commit")   # the next one is done, and its answer lost
    net.heal()
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc

from mtc.errors import CorruptShardError, MtcError
from mtc.grpc_errors import TRANSIENT, PeerError, to_status
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.confine import create_fetched, open_beneath
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.copies.servable import HELD, serving, stream_verified
from mtc.sidecar.replicator.store.step_files import FileMeta, inside
from mtc.sidecar.replicator.transport import Opener, Pushed
from mtc.sidecar.storage.checksum import CHUNK

if TYPE_CHECKING:
    from mtc.sidecar.replicator.copies.receive import Receiver
    from mtc.sidecar.replicator.wire.parts import Parts

T = TypeVar("T")
DEFAULT_DEADLINE_S = 10.0


class Composed(Protocol):
    """A replicator whose parts a test serves in memory (a
    :class:`~mtc.sidecar.replicator.node.Node`)."""

    @property
    def parts(self) -> Parts: ...

    @property
    def receiver(self) -> Receiver: ...


class Endpoint:
    """One replicator's receiving side, called in memory: what its gRPC servicer does
    with a request once it is decoded and its caller authenticated."""

    def __init__(self, parts: Parts, receiver: Receiver) -> None:
        self.parts = parts
        self.receiver = receiver

    @classmethod
    def of(cls, node: Composed) -> Endpoint:
        return cls(node.parts, node.receiver)

    def inventory(self, req: pb.InventoryRequest) -> pb.Inventory:
        if req.rank_only:
            return pb.Inventory(rank=self.parts.rank)
        if req.identify:
            return self.parts.shown.identity()
        return self.parts.shown.inventory(frozenset(req.origins) or None,
                                          files=not req.without_files)

    def decide(self, req: pb.DecideRequest, alive: Callable[[], bool]) -> pb.DecideReply:
        config = self.parts.config
        timeout = min(req.timeout_seconds or config.agreement_timeout_s,
                      config.agreement_timeout_s * 10)
        return pb.DecideReply(decision=self.parts.agreement.decide_for(
            req.rank, checks.restore_id(req.restore_id), timeout, list(req.members),
            req.started_ns, alive=alive))

    def complete(self) -> pb.CompleteReply:
        return pb.CompleteReply(kept=self.parts.agreement.complete_steps())

    def offer(self, req: pb.OfferRequest) -> pb.OfferReply:
        origin, step, files = checks.offer(req.copy, rank=self.parts.rank,
                                           num_nodes=self.parts.config.num_nodes)
        return self.receiver.offer(req.copy, origin, step, files)

    def link(self, tid: str, paths: list[str]) -> pb.LinkReply:
        return self.receiver.link(self._transfer(tid), paths)

    def push(self, tid: str, files: list[tuple[int, Iterator[bytes]]]) -> int:
        """Files of the offer (by index), each as its bytes: written and verified by
        the receiving side, as a push over gRPC's Data service is."""
        t = self._transfer(tid)
        offered = list(t.files.values())
        total = 0
        for i, chunks in files:
            metas = checks.pushed(offered, [i])
            with t.lock:
                t.verified.difference_update(m.path for m in metas)
            total += self.receiver.receive(t, metas, chunks)
        self.parts.metrics.bytes_received.inc(total)
        return total

    def commit(self, tid: str) -> pb.CommitReply:
        self._transfer(tid)
        return self.receiver.commit(tid)

    def abort(self, tid: str) -> None:
        self.receiver.abort(tid)

    def fetch(self, origin: int, step: int, rels: list[str]) -> Iterator[tuple[FileMeta |
                                                                                None, bytes]]:
        """The bytes of ``rels`` of ``origin``'s ``step`` as this holder serves them
        (:mod:`.copies.servable`: decided whole before the first byte, each held file
        checked as it is read), file by file."""
        req = pb.FetchRequest(origin_rank=origin, step=step, path=rels[0],
                              more_paths=rels[1:])
        origin, step, rels = checks.fetch(req, num_nodes=self.parts.config.num_nodes)
        plan, base = serving(self.parts.store, self.parts.restores.staged, self.parts.rank,
                             origin, step, rels)
        if plan.source == HELD:
            for meta in plan.files:
                for chunk in stream_verified(self.parts.store, origin, step, meta):
                    yield meta, chunk
            return
        for rel in rels:
            with os.fdopen(open_beneath(base, rel), "rb", buffering=0) as f:
                while chunk := f.read(CHUNK):
                    yield None, chunk

    def backup_part(self, req: pb.BackupPartRequest) -> pb.BackupPartReply:
        checks.backup_part(req, num_nodes=self.parts.config.num_nodes)
        return self.parts.backups.backup_part(req)

    def request_backup(self) -> pb.BackupReply:
        return pb.BackupReply(step=self.parts.backups.request_backup())

    def _transfer(self, tid: str) -> Any:
        t = self.receiver.transfers.get(tid)
        if t is None:
            raise KeyError(f"unknown transfer {tid[:64]!r}")
        return t


@dataclasses.dataclass
class _Fault:
    """Calls matching ``call``/``src``/``dst`` (None: any) are dropped ``times``
    more times (None: until healed), or delayed by ``delay_s``."""

    call: str | None
    src: int | None
    dst: int | None
    times: int | None = None
    delay_s: float = 0.0
    answer: bool = False  # the call runs; its answer is what is lost

    def matches(self, call: str, src: int, dst: int) -> bool:
        return (self.call in (None, call) and self.src in (None, src)
                and self.dst in (None, dst))


class Network:
    """The replicators of one process, by rank, and the faults between them.
    Thread-safe: calls run on their callers' threads. ``calls`` and ``dropped``
    count each (call, src, dst) delivered and lost, for tests to wait on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._served: dict[int, Endpoint] = {}
        self._cut: set[frozenset[int]] = set()
        self._faults: list[_Fault] = []
        self.calls: Counter[tuple[str, int, int]] = Counter()
        self.dropped: Counter[tuple[str, int, int]] = Counter()

    def serve(self, rank: int, endpoint: Endpoint) -> None:
        with self._lock:
            self._served[rank] = endpoint

    def stop_serving(self, rank: int) -> None:
        """Rank ``rank`` is gone (its process killed): every call to it fails."""
        with self._lock:
            self._served.pop(rank, None)

    def serving(self, rank: int) -> Endpoint | None:
        """Who serves ``rank`` now (None: nobody)."""
        with self._lock:
            return self._served.get(rank)

    def peers(self, src: int, num_nodes: int) -> dict[int, MemoryPeer]:
        """Rank ``src``'s peers among ranks ``0..num_nodes-1`` (served now or later)."""
        return {r: MemoryPeer(self, src, r) for r in range(num_nodes) if r != src}

    def partition(self, *groups: Collection[int]) -> None:
        """Cut every link between two ranks of different ``groups``."""
        with self._lock:
            for i, a in enumerate(groups):
                for b in groups[i + 1:]:
                    self._cut.update(frozenset((x, y)) for x in a for y in b)

    def cut(self, a: int, b: int) -> None:
        with self._lock:
            self._cut.add(frozenset((a, b)))

    def drop(self, call: str | None = None, *, src: int | None = None,
             dst: int | None = None, times: int | None = 1) -> None:
        """Lose the next ``times`` calls named ``call`` from ``src`` to ``dst`` (None:
        any; ``times`` None: every one until :meth:`heal`). A dropped call fails
        ``UNAVAILABLE`` without reaching the receiver."""
        with self._lock:
            self._faults.append(_Fault(call, src, dst, times))

    def lose_answers(self, call: str | None = None, *, src: int | None = None,
                     dst: int | None = None, times: int | None = 1) -> None:
        """The next ``times`` matching calls reach the receiver and run, and their
        answers are lost: the caller gets ``UNAVAILABLE`` for what was done."""
        with self._lock:
            self._faults.append(_Fault(call, src, dst, times, answer=True))

    def delay(self, seconds: float, call: str | None = None, *, src: int | None = None,
              dst: int | None = None) -> None:
        """Hold matching calls ``seconds`` before they reach the receiver (one longer
        than its deadline fails ``DEADLINE_EXCEEDED`` at the deadline, unsent)."""
        with self._lock:
            self._faults.append(_Fault(call, src, dst, None, seconds))

    def heal(self) -> None:
        """Every link whole again, every fault gone."""
        with self._lock:
            self._cut.clear()
            self._faults.clear()

    def _route(self, call: str, src: int, dst: int) -> tuple[Endpoint | None, str, float]:
        """The receiver of a call (None: unreachable), why not, and its delay."""
        with self._lock:
            delay = sum(f.delay_s for f in self._faults
                        if f.delay_s and f.matches(call, src, dst))
            for f in self._faults:
                if not f.delay_s and not f.answer and f.matches(call, src, dst) and \
                        f.times != 0:
                    if f.times is not None:
                        f.times -= 1
                    self.dropped[(call, src, dst)] += 1
                    return None, "dropped", delay
            if frozenset((src, dst)) in self._cut:
                self.dropped[(call, src, dst)] += 1
                return None, "partitioned", delay
            endpoint = self._served.get(dst)
            if endpoint is None:
                return None, "not serving", delay
            self.calls[(call, src, dst)] += 1
            return endpoint, "", delay

    def answered(self, call: str, src: int, dst: int) -> bool:
        """Whether the answer of a call that ran reaches its caller."""
        with self._lock:
            if frozenset((src, dst)) in self._cut or dst not in self._served:
                return False
            for f in self._faults:
                if f.answer and f.matches(call, src, dst) and f.times != 0:
                    if f.times is not None:
                        f.times -= 1
                    self.dropped[(call, src, dst)] += 1
                    return False
            return True


class MemoryPeer:
    """Rank ``dst`` as rank ``src`` calls it over ``net`` (:class:`~.transport.Peer`)."""

    def __init__(self, net: Network, src: int, dst: int) -> None:
        self._net = net
        self._src = src
        self.rank = dst
        self.address = f"memory:rank-{dst}"

    def _call(self, name: str, fn: Callable[[Endpoint, Callable[[], bool]], T], *,
              deadline_s: float | None = None, attempts: int = 1) -> T:
        """``fn(endpoint, alive)`` on the receiver, through the faults; a failure as
        :class:`PeerError` with the status gRPC would carry; sent again (at most
        ``attempts`` times) while it fails transiently."""
        for attempt in range(attempts):
            try:
                return self._once(name, fn, deadline_s or DEFAULT_DEADLINE_S)
            except PeerError as e:
                if e.code not in TRANSIENT or attempt == attempts - 1:
                    raise
                time.sleep(0.05)  # a retry's backoff, as PeerClient.retry's (shortened)
        raise AssertionError("unreachable")

    def _once(self, name: str, fn: Callable[[Endpoint, Callable[[], bool]], T],
              deadline_s: float) -> T:
        deadline = time.monotonic() + deadline_s
        endpoint, why, delay = self._net._route(name, self._src, self.rank)
        if delay:
            time.sleep(min(delay, deadline_s))
            if delay >= deadline_s:
                raise self._error(name, grpc.StatusCode.DEADLINE_EXCEEDED, "delayed past "
                                  "its deadline")
        if endpoint is None:
            raise self._error(name, grpc.StatusCode.UNAVAILABLE, why)
        try:
            out = fn(endpoint, lambda: time.monotonic() < deadline)
        except RuntimeError as e:
            if self._net.serving(self.rank) is endpoint:
                raise
            # Its node was stopped under the call (its pools shut): the call was cut
            # as a killed process's connection is.
            raise self._error(name, grpc.StatusCode.UNAVAILABLE, "its replicator "
                              "stopped during the call") from e
        except (MtcError, OSError, ValueError, KeyError) as e:
            if time.monotonic() >= deadline:
                raise self._error(name, grpc.StatusCode.DEADLINE_EXCEEDED, "no answer "
                                  "within its deadline") from e
            raise self._answer(name, e) from e
        if time.monotonic() >= deadline:
            raise self._error(name, grpc.StatusCode.DEADLINE_EXCEEDED, "answered after "
                              "its deadline")
        if not self._net.answered(name, self._src, self.rank):
            raise self._error(name, grpc.StatusCode.UNAVAILABLE, "the answer was lost")
        return out

    def _error(self, name: str, code: grpc.StatusCode, why: str, **where: Any) -> PeerError:
        err = PeerError(f"{name} to rank {self.rank} failed: {code.name}: {why}",
                        host=where.get("host", self.rank), step=where.get("step"),
                        path=where.get("path"))
        err.code = code
        return err

    def _answer(self, name: str, e: BaseException) -> PeerError:
        """The receiver's error as the caller gets it over gRPC: its status, its
        message, the step, host and file it named."""
        code = to_status(e)
        if isinstance(e, MtcError):
            return self._error(name, code, e.message, step=e.step,
                               host=self.rank if e.host is None else e.host, path=e.path)
        return self._error(name, code, str(e))

    # -- the seam's calls ---------------------------------------------------------------

    def inventory(self, req: pb.InventoryRequest, *, deadline_s: float | None = None,
                  attempts: int = 3, known_up: bool = False) -> pb.Inventory:
        return self._call("GetInventory", lambda ep, _: ep.inventory(req),
                          deadline_s=deadline_s, attempts=attempts)

    def decide(self, req: pb.DecideRequest, *, deadline_s: float) -> pb.DecideReply:
        return self._call("Decide", lambda ep, alive: ep.decide(req, alive),
                          deadline_s=deadline_s)

    def complete(self, *, deadline_s: float) -> pb.CompleteReply:
        return self._call("GetComplete", lambda ep, _: ep.complete(), deadline_s=deadline_s)

    def offer(self, req: pb.OfferRequest) -> pb.OfferReply:
        return self._call("Offer", lambda ep, _: ep.offer(req), attempts=3)

    def link(self, transfer_id: str, paths: list[str]) -> pb.LinkReply:
        return self._call("Link", lambda ep, _: ep.link(transfer_id, paths), attempts=3)

    def push(self, transfer_id: str, files: Pushed) -> int | None:
        return self._call("Push", lambda ep, _: ep.push(
            transfer_id, [(i, _read(path)) for i, _, path, _, _ in files]), deadline_s=120.0)

    def push_batch(self, transfer_id: str, files: Pushed) -> None:
        self.push(transfer_id, files)

    def commit(self, transfer_id: str) -> pb.CommitReply:
        return self._call("Commit", lambda ep, _: ep.commit(transfer_id), attempts=3)

    def abort(self, transfer_id: str) -> None:
        self._call("Abort", lambda ep, _: ep.abort(transfer_id))

    def fetch(self, step: int, origin: int, rel: str, dest: Path, size: int,
              crc: int) -> None:
        self._fetch_one(step, origin, FileMeta(rel, size, crc), dest)

    def fetch_many(self, step: int, origin: int, files: list[FileMeta], dest: Path, *,
                   opener: Opener | None = None) -> tuple[list[str], MtcError | None]:
        """As the data path's, file by file, each written where ``opener`` says (a
        blank file set aside for it) or into a new one."""
        done: list[str] = []
        try:
            for f in files:  # one stream's worth, file by file: what came, verified
                self._fetch_one(step, origin, f, inside(dest, f.path),
                                None if opener is None else functools.partial(
                                    opener, dest, f.path, f.size))
                done.append(f.path)
        except MtcError as e:
            return done, e
        return done, None

    def backup_part(self, req: pb.BackupPartRequest) -> pb.BackupPartReply:
        return self._call("BackupPart", lambda ep, _: ep.backup_part(req), deadline_s=3600.0)

    def request_backup(self) -> pb.BackupReply:
        return self._call("RequestBackup", lambda ep, _: ep.request_backup(),
                          deadline_s=3600.0)

    def _fetch_one(self, step: int, origin: int, f: FileMeta, target: Path,
                   open_fd: Callable[[], int] | None = None) -> None:
        def one(ep: Endpoint, _: Callable[[], bool]) -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_verified(ep.fetch(origin, step, [f.path]), target, f, step, origin,
                            self.rank, open_fd)
        self._call("Fetch", one, deadline_s=120.0)


def _read(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


def _write_verified(chunks: Iterator[tuple[FileMeta | None, bytes]], dest: Path,
                    meta: FileMeta, step: int, origin: int, holder: int,
                    open_fd: Callable[[], int] | None = None) -> None:
    """A fetched file's bytes into ``dest`` (or the descriptor ``open_fd`` opens for
    it), kept only when its size and CRC32C are the ones the caller expects (as the
    data path's fetch does)."""
    got = value = 0
    out_file = create_fetched(dest) if open_fd is None else \
        os.fdopen(open_fd(), "wb", buffering=0)
    with out_file as out:
        try:
            for _, chunk in chunks:
                out.write(chunk)
                got += len(chunk)
                value = crc32c(chunk, value)
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
    if got != meta.size or value != meta.crc32c:
        dest.unlink(missing_ok=True)
        raise CorruptShardError(f"copy from rank {holder} does not match: {got} bytes crc32c "
                                f"{value:#010x}, expected {meta.size} bytes "
                                f"{meta.crc32c:#010x}", step=step, host=origin, path=meta.path)


if TYPE_CHECKING:
    from mtc.sidecar.replicator.transport import Peer

    def _is_a_peer(p: MemoryPeer) -> Peer:  # mypy checks it implements the seam
        return p
