"""Calls to one peer replicator: deadlines on every call, retries on transient errors.
Its files travel through :class:`~mtc.sidecar.replicator.wire.peer_data.PeerData`
(``PeerClient.data``), over the channels and calls kept here."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from mtc.credentials import Credentials, TlsWatch
from mtc.grpc_errors import TRANSIENT, PeerError, where_of
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.rank_names import PeerServerName
from mtc.sidecar.replicator.config import KEEPALIVE_S

T = TypeVar("T")
MAX_MESSAGE = 64 << 20
PUSH = "/mtc.replicator.v1.Data/Push"
FETCH = "/mtc.replicator.v1.Data/Fetch"
_RETRYABLE = TRANSIENT  # the one map's: mtc/grpc_errors.py

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    # A peer that was down (a replaced host takes minutes) is reached again within
    # 2 s of its return; gRPC's default backoff grows to 120 s, and calls fail fast
    # while it lasts. ``min_reconnect_backoff_ms`` is, to gRPC, the least time a
    # connection attempt is given (20 s by default): 2 s, as the sidecars' channels
    # (mtc/dispatch/process.py says why: at 100 ms a loaded peer's first frame
    # came too late).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 2_000),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.service_config", json.dumps({"methodConfig": [{
        "name": [{"service": "mtc.replicator.v1.Replicator"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }]})),
]


# A call's peer gone silent (its link cut: no reset comes) is found by pinging:
# after this many seconds without a frame, unanswered for half as long again, the
# call fails (UNAVAILABLE, retryable). ReplicatorConfig.keepalive_s sets a
# replicator's own (--peer-keepalive-seconds; default KEEPALIVE_S, 10 s).


def keepalive_options(keepalive_s: float) -> list[tuple[str, int]]:
    """gRPC's keepalive options: pinged after ``keepalive_s`` idle, given up on
    when a ping is unanswered for ``keepalive_s / 2``."""
    return [("grpc.keepalive_time_ms", max(1, round(keepalive_s * 1000))),
            ("grpc.keepalive_timeout_ms", max(1, round(keepalive_s * 500)))]


def _identity(b: bytes) -> bytes:
    return b


@dataclasses.dataclass(frozen=True)
class _Channel:
    """One channel to the peer and the calls made on it."""

    channel: grpc.Channel
    stub: pb_grpc.ReplicatorStub
    push: Any
    fetch: Any


class PeerClient:
    """One peer's replicator, reached at ``address``. With mutual TLS, a change of
    the certificate files (a rotation) makes a new channel for the calls after it;
    calls in flight finish on the old one, closed with the client. With ``as_peer``
    (a replicator calling another) and mutual TLS, the server's certificate must
    name ``rank``: what it answers (an inventory, a file) is rank ``rank``'s, not
    whoever's answers at its address. ``data``: its files, pushed and fetched.
    ``keepalive_s``: a call whose peer went silent fails within about 1.5 times it."""

    def __init__(self, address: str, creds: Credentials, *, rank: int,
                 deadline_s: float = 10.0, as_peer: bool = False,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        self.address = address
        self.rank = rank
        self.deadline_s = deadline_s
        self.metadata = creds.call_metadata()
        self._tls = TlsWatch(creds)
        self._options = [*CHANNEL_OPTIONS, *keepalive_options(keepalive_s)]
        # The name the server's certificate must bear: rank ``rank``'s (mtc/rank_names.py).
        self.server_name = PeerServerName(address, creds, rank) if as_peer and creds.tls \
            else None
        self._lock = threading.Lock()
        self._retired: list[grpc.Channel] = []
        self._now = self._open()
        # The peer's data channel (datachannel.py): its port, learnt from its identity
        # or an Offer reply; None: not known (asked before the next transfer), 0: it
        # has none (its bytes go over gRPC's Data service; asked again later).
        from mtc.sidecar.replicator.wire.peer_data import PeerData  # it raises PeerError

        self.data_port: int | None = None
        self.data = PeerData(self, creds)  # its files, pushed and fetched

    def _open(self) -> _Channel:
        channel = self._new_channel()
        return _Channel(channel, pb_grpc.ReplicatorStub(channel),
                        channel.stream_unary(PUSH, request_serializer=_identity,
                                             response_deserializer=pb.PushAck.FromString),
                        channel.unary_stream(FETCH,
                                             request_serializer=pb.FetchRequest.SerializeToString,
                                             response_deserializer=_identity))

    def _current(self) -> _Channel:
        if self._tls.renewed() is not None or (
                self.server_name is not None and self.server_name.renewed()):
            with self._lock:
                self._retired.append(self._now.channel)
                self._now = self._open()
        return self._now

    @property
    def channel(self) -> grpc.Channel:
        return self._current().channel

    @property
    def stub(self) -> pb_grpc.ReplicatorStub:
        return self._current().stub

    def _new_channel(self, *, own_connection: bool = False) -> grpc.Channel:
        """A channel with the current certificate files' credentials. gRPC shares
        connections among a process's channels to one address: a channel of its
        own connection does not inherit the shared one's backoff."""
        cc = self._tls.credentials
        opts = [*self._options, ("grpc.use_local_subchannel_pool", 1)] if own_connection \
            else list(self._options)
        if self.server_name is not None:
            opts.append(("grpc.ssl_target_name_override", self.server_name.name))
        return (grpc.secure_channel(self.address, cc, options=opts)
                if cc else grpc.insecure_channel(self.address, options=opts))

    def push_stream(self, chunks: Iterator[bytes], deadline_s: float,
                    metadata: list[tuple[str, str]]) -> pb.PushAck:
        """One call of gRPC's Data service's Push (raw bytes; ``metadata`` names them)."""
        return self._current().push(chunks, timeout=deadline_s, metadata=metadata)

    def fetch_stream(self, req: pb.FetchRequest, deadline_s: float) -> Iterator[bytes]:
        """One call of gRPC's Data service's Fetch: the raw bytes ``req`` names."""
        return self._current().fetch(req, timeout=deadline_s, metadata=self.metadata)

    def close(self) -> None:
        with self._lock:
            channels = [*self._retired, self._now.channel]
            self._retired.clear()
        for c in channels:
            c.close()

    def call(self, name: str, request: Any, *, deadline_s: float | None = None,
             attempts: int = 3, known_up: bool = False) -> Any:
        """A control call with a deadline, retried with backoff while the peer is unavailable.

        ``known_up``: the caller knows the peer is serving (it has just called us),
        so the call goes over a channel of its own, connected now: the shared one
        may still be backing off from the peer's loss (up to the maximum reconnect
        backoff after its return, every call failing fast meanwhile). One connection
        more per call: for rare calls (a restore's agreement)."""
        if known_up:
            self._current()  # credentials renewed first, if the files changed
            channel = self._new_channel(own_connection=True)
            try:
                once: Callable[..., Any] = getattr(pb_grpc.ReplicatorStub(channel), name)
                return self.retry(lambda: once(request, timeout=deadline_s or self.deadline_s,
                                               metadata=self.metadata), name, attempts)
            finally:
                channel.close()
        # The stub is looked up for each attempt: a renewed certificate or a peer's
        # new name (a replaced pod) makes a new channel between attempts.
        return self.retry(lambda: getattr(self.stub, name)(
            request, timeout=deadline_s or self.deadline_s, metadata=self.metadata),
            name, attempts)

    def retry(self, fn: Callable[[], T], what: str, attempts: int) -> T:
        """``fn()`` (a call to this peer), sent again with backoff while it fails
        transiently, at most ``attempts`` times; a failure as :class:`PeerError`."""
        delay = 0.1
        for attempt in range(attempts):
            try:
                return fn()
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code == grpc.StatusCode.UNAVAILABLE and self.server_name is not None:
                    self.server_name.stale()  # a replaced peer pod has a new name
                if code not in _RETRYABLE or attempt == attempts - 1:
                    raise self._error(what, e, code) from e
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")

    def _error(self, what: str, e: grpc.RpcError, code: grpc.StatusCode | None) -> PeerError:
        """A failed call as a :class:`PeerError`: the peer's own message, and the
        step, host and file its error named (else this peer's rank as the host),
        each once."""
        where = where_of(e.trailing_metadata() if hasattr(e, "trailing_metadata") else None)
        details = e.details() if hasattr(e, "details") else ""
        err = PeerError(f"{what} to {self.address} failed: {code.name if code else e}: "
                        f"{details}", step=where.get("step"),
                        host=where.get("host", self.rank if self.rank >= 0 else None),
                        path=where.get("path"))
        err.code = code
        return err
