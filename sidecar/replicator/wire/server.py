"""The replicator's gRPC server: thin servicers over the replicator's parts, each
given as a narrow view (:mod:`.parts`), never the node that composes them.

Domain errors become status codes in one place (:func:`.status.answer`). Shard
bytes use raw-bytes handlers (no protobuf copy): the data channel's
(:mod:`.data_service`) and gRPC's Data service (:mod:`.grpc_data`); control
messages are protobuf.

Everything a request names is checked on arrival (:mod:`..checks`); who may act for
which rank is :class:`~mtc.sidecar.replicator.wire.security.Identity`'s; how many
streams a caller holds, and for how long, :mod:`.limits`'. An incoming copy is
one open transfer per origin rank: a new offer from the same origin (a retry, a
replay) replaces the one it had open, and every open transfer together is sized
against the RAM disk's free space.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mtc import validate
from mtc.credentials import Credentials
from mtc.errors import (
    MtcError,
)
from mtc.grpc_errors import answer
from mtc.lifecycle import Threads
from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.copies.transfers import Transfer
from mtc.sidecar.replicator.wire.client import CHANNEL_OPTIONS, FETCH, PUSH
from mtc.sidecar.replicator.wire.data_service import DataService
from mtc.sidecar.replicator.wire.datachannel import DataServer
from mtc.sidecar.replicator.wire.decode_guard import DecodeGuard
from mtc.sidecar.replicator.wire.grpc_data import GrpcData
from mtc.sidecar.replicator.wire.limits import BoundedHealth, Gate, Limits, Streams
from mtc.sidecar.replicator.wire.security import (
    Identity,
    IdentityGate,
    TokenInterceptor,
    check_listen_address,
)

if TYPE_CHECKING:
    from mtc.sidecar.replicator.wire.parts import Composed, Parts

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
MAX_RESTORE_TIMEOUT_S = 24 * 3600.0
# A request's bytes: data chunks are 4 MiB (a few small files together, at most
# 1 MiB each), an offer of MAX_FILES files a few MiB.
MAX_REQUEST = 16 << 20


def mapped(fn: F) -> F:
    """Turn domain errors of a handler into gRPC statuses; never crash the server."""
    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(self, request, context)
        except (MtcError, OSError, ValueError, KeyError) as e:
            code, msg = answer(e, context)
            context.abort(code, msg)
    return wrapper  # type: ignore[return-value]


class ReplicatorServicer(pb_grpc.ReplicatorServicer):
    def __init__(self, parts: Parts, identity: Identity | None = None,
                 streams: Streams | None = None) -> None:
        self.rank = parts.rank
        self.config = parts.config
        self.store = parts.store
        self.metrics = parts.metrics
        self.shown = parts.shown
        self.agreement = parts.agreement
        self.restores = parts.restores
        self.backups = parts.backups
        self.blanks = parts.blanks
        self.proofs = parts.proofs
        self.identity = identity or Identity(tls=False)
        self.streams = streams or Streams()
        # A rank's ask waits at the coordinator; a restarted replicator asks again
        # before its old call ends. A few restores at once per replicator.
        self.deciding = Gate(2, "Decide asks of this rank")
        self.preparing = Gate(8, "restores")
        # The copy protocol's receiving side (copies/receive.py): this servicer
        # checks who calls, the receiver what is received (its offers' replies name
        # this server's data channel).
        self.receiver = parts.receiver
        self.receiver.data_port = lambda: self.data_port
        self.transfers = self.receiver.transfers
        self.data: DataServer | None = None  # the data channel, when serve() opened one
        self.workers: ThreadPool | None = None  # gRPC's, set by serve()

    @property
    def data_port(self) -> int:
        return self.data.port if self.data is not None else 0

    def stop(self) -> None:
        """No new data-channel connections; the stream watchdog ends (both joined
        by :meth:`close`, and by the process's thread group)."""
        if self.data is not None:
            self.data.stop()
        self.streams.stop()

    def close(self) -> None:
        """After the server stopped: the data channel, the stream watchdog and gRPC's
        worker threads end (gRPC never shuts down the pool it was given; a handler
        still running, such as a Decide waiting for its epoch, ends with the node)."""
        if self.data is not None:
            self.data.close()
        self.streams.close()
        if self.workers is not None:
            self.workers.shutdown(wait=False, cancel_futures=True)

    def transfer(self, tid: str, context: Any) -> Transfer:
        """An open transfer, of this caller's (with TLS: the rank that offered it)."""
        t = self.transfers.get(tid)
        if t is None:
            raise KeyError(f"unknown transfer {tid[:64]!r}")
        self.identity.require(context, t.origin, "a transfer")
        return t

    def expire_transfers(self) -> None:
        self.receiver.expire()

    def incoming(self) -> set[tuple[int, int]]:
        return self.receiver.incoming()

    @mapped
    def GetInventory(self, request: pb.InventoryRequest, context: Any) -> pb.Inventory:
        if request.rank_only:
            return pb.Inventory(rank=self.rank)
        if request.identify:
            return self.shown.identity()
        return self.shown.inventory(frozenset(request.origins) or None,
                                    files=not request.without_files)

    @mapped
    def Offer(self, request: pb.OfferRequest, context: Any) -> pb.OfferReply:
        origin, step, files = checks.offer(request.copy, rank=self.rank,
                                           num_nodes=self.config.num_nodes)
        self.identity.require_peer(context, "Offer")
        self.identity.require(context, origin, "a copy")
        return self.receiver.offer(request.copy, origin, step, files)

    @mapped
    def Link(self, request: pb.LinkRequest, context: Any) -> pb.LinkReply:
        t = self.transfer(request.transfer_id, context)
        return self.receiver.link(t, list(request.paths))

    @mapped
    def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitReply:
        self.transfer(request.transfer_id, context)
        return self.receiver.commit(request.transfer_id)

    @mapped
    def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortReply:
        t = self.transfers.get(request.transfer_id)
        if t is not None:
            self.identity.require(context, t.origin, "Abort")
            self.receiver.abort(request.transfer_id)
        return pb.AbortReply()

    @mapped
    def Decide(self, request: pb.DecideRequest, context: Any) -> pb.DecideReply:
        self.identity.require_peer(context, "Decide")
        self.identity.require(context, request.rank, "Decide")
        timeout = min(_restore_timeout(request.timeout_seconds)
                      or self.config.agreement_timeout_s,
                      self.config.agreement_timeout_s * 10)
        with self.deciding.enter(request.rank):
            return pb.DecideReply(decision=self.agreement.decide_for(
                request.rank, checks.restore_id(request.restore_id), timeout,
                list(request.members), request.started_ns, alive=context.is_active))

    @mapped
    def GetComplete(self, request: pb.CompleteRequest, context: Any) -> pb.CompleteReply:
        return pb.CompleteReply(kept=self.agreement.complete_steps())

    @mapped
    def PrepareRestore(self, request: pb.PrepareRestoreRequest,
                       context: Any) -> pb.PrepareRestoreReply:
        t = _restore_timeout(request.timeout_seconds)
        with self.preparing.enter(None):
            d, tier, seconds, pending = self.restores.prepare_restore_as(
                t or None, checks.restore_id(request.restore_id), list(request.members),
                background=request.background)
        return pb.PrepareRestoreReply(step=d.step, tier=tier, seconds=seconds, epoch=d.epoch,
                                      pending=pending, run=d.run, lost=d.lost)

    @mapped
    def Restored(self, request: pb.RestoredRequest, context: Any) -> pb.RestoredReply:
        rid = checks.restore_id(request.restore_id)
        step = validate.step(request.step)
        return pb.RestoredReply(fetching=self.restores.restored(rid, step))

    @mapped
    def RequestBackup(self, request: pb.BackupRequest, context: Any) -> pb.BackupReply:
        return pb.BackupReply(step=self.backups.request_backup())

    @mapped
    def BackupPart(self, request: pb.BackupPartRequest, context: Any) -> pb.BackupPartReply:
        self.identity.require_peer(context, "BackupPart")  # the backup leader
        checks.backup_part(request, num_nodes=self.config.num_nodes)
        return self.backups.backup_part(request)


def _restore_timeout(t: float) -> float:
    """A request's timeout, refused unless finite and in range: NaN or infinity would
    make a deadline nothing ever passes (found by fuzzing). 0 asks for the default."""
    if not (math.isfinite(t) and 0 <= t <= MAX_RESTORE_TIMEOUT_S):
        raise ValueError(f"timeout_seconds {t} is not in 0..{MAX_RESTORE_TIMEOUT_S:.0f}")
    return t


def _raw(b: bytes) -> bytes:
    return b


def serve(node: Composed, listen: str, creds: Credentials, *, workers: int = 32,
          limits: Limits | None = None, data_port: int | None = 0,
          threads: Threads | None = None
          ) -> tuple[grpc.Server, int, ReplicatorServicer, health.HealthServicer]:
    """Start the server; returns it, the bound port, the servicer (close it after the
    server stopped) and the health servicer (SERVING here; main lowers it when the
    loop stalls or at shutdown). ``workers``: main gives 32 + 2N, room for two
    Decide asks of every member, the restores and data streams :mod:`.limits`
    allows, and calls that answer at once beside them. ``data_port``: the data
    channel's port on the host of ``listen`` (0: any; None: no data channel, the
    bytes go over gRPC's Data service alone). ``threads``: the group the data
    channel's and the stream watchdog's threads start in (main's; else their own)."""
    check_listen_address(listen, creds)
    parts = node.parts
    streams = Streams(limits or Limits(),
                      on_cancel=lambda kind: parts.metrics.skipped.labels(
                          f"{kind}_stream_ended").inc(), threads=threads)
    interceptors: list[grpc.ServerInterceptor] = (
        [TokenInterceptor(creds.token)] if creds.token else [])
    if creds.tls:  # a rank's certificate or the controller's; a stranger's is nobody
        interceptors.append(IdentityGate(lambda who: who is not None, "a replicator"))
    interceptors.append(DecodeGuard())  # malformed protobufs: INVALID_ARGUMENT
    pool = ThreadPool(workers, "mtc-grpc", lazy=True)
    server = grpc.server(pool, interceptors=interceptors,
                         options=[CHANNEL_OPTIONS[0],  # what it sends: as clients take
                                  ("grpc.max_receive_message_length", MAX_REQUEST),
                                  # Never share a port with another server silently.
                                  ("grpc.so_reuseport", 0),
                                  # A peer gone silent mid-call (its link cut) is let
                                  # go within seconds (pinged every 2 s while calls
                                  # are open, unanswered for 3 s): its push no longer
                                  # pins a worker and a half-written file until TCP
                                  # gives up (20 s) or the deadline.
                                  ("grpc.keepalive_time_ms", 2_000),
                                  ("grpc.keepalive_timeout_ms", 3_000),
                                  # Pinged even while it sends nothing: a push's
                                  # receiver sends no data until the stream ends,
                                  # and by default stops pinging after two pings.
                                  ("grpc.http2.max_pings_without_data", 0)],
                         maximum_concurrent_rpcs=workers * 4)
    servicer = ReplicatorServicer(parts, Identity(tls=creds.tls), streams)
    servicer.workers = pool
    if data_port is not None and not listen.startswith("unix"):
        host = listen.rsplit(":", 1)[0]
        service = DataService(parts, servicer.identity, streams, servicer.transfers)
        servicer.data = DataServer(service, host, data_port, creds,
                                   workers=streams.limits.max_streams + 8).start(threads)
        parts.shown.data_port = servicer.data.port
    pb_grpc.add_ReplicatorServicer_to_server(servicer, server)
    raw = GrpcData(parts, streams, servicer.transfer, servicer.receiver.receive)
    data = grpc.method_handlers_generic_handler("mtc.replicator.v1.Data", {
        "Push": grpc.stream_unary_rpc_method_handler(
            raw.push, request_deserializer=_raw,
            response_serializer=pb.PushAck.SerializeToString),
        "Fetch": grpc.unary_stream_rpc_method_handler(
            raw.fetch, request_deserializer=_raw, response_serializer=_raw),
    })
    server.add_generic_rpc_handlers((data,))
    health_servicer = BoundedHealth(streams)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    sc = creds.server_credentials()
    port = server.add_secure_port(listen, sc) if sc else server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("mtc.replicator.v1.Replicator", health_pb2.HealthCheckResponse.SERVING)
    assert PUSH and FETCH  # the names clients use, defined beside them
    return server, port, servicer, health_servicer


SERVICES = ("", "mtc.replicator.v1.Replicator")


class Serving:
    """What :func:`serve` started, as a service (:class:`mtc.lifecycle.Service`):
    serving before anything else starts (its port is written and shown first),
    its data channel's threads in the group ``serve`` was given. ``stop``: health
    says NOT_SERVING, no new calls, the data channel accepts no more; ``close``:
    the calls in flight finished (``grace_s`` at most), every thread and pool ended."""

    def __init__(self, server: grpc.Server, servicer: ReplicatorServicer,
                 health_servicer: health.HealthServicer, *, grace_s: float = 5.0) -> None:
        self.server = server
        self.servicer = servicer
        self.health = health_servicer
        self.grace_s = grace_s
        self._stopped: threading.Event | None = None

    def start(self, threads: Threads) -> None:
        pass  # serve() started it

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()  # probes see NOT_SERVING from now on
        self._stopped = self.server.stop(grace=self.grace_s)
        self.servicer.stop()

    def close(self) -> None:
        if self._stopped is not None:
            self._stopped.wait()
        self.servicer.close()


def set_health(health_servicer: health.HealthServicer, serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in SERVICES:
        health_servicer.set(name, status)
