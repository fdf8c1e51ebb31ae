"""The data channel: shard bytes between replicators on connections of their own.

gRPC stays the control plane (offers, commits, inventories, agreement). A push or
a fetch of shard bytes is one TCP connection (with mutual TLS, a TLS one) to the
holder's data port, which its identity and its Offer replies name
(``Inventory.data_port``): a few of them per peer at once carry a step. How a
file's bytes go between a socket and the RAM disk is ``socket_files.py``'s.

The wire (``proto/replicator.proto``, ``DataRequest``/``DataStatus``): the caller
sends ``MAGIC``, a little-endian u32 length and a ``DataRequest``; the server
answers a ``DataStatus`` framed the same way (an error ends the connection), then
the bytes flow: a push's files back to back, answered by a last ``DataStatus``;
a fetch's files, each after a ``DataStatus`` of its own (a file the holder finds
damaged as it is about to send it is refused there, typed).

Every connection authenticates before anything it asks is looked at: mutual TLS
(the caller's certificate names its rank, read as gRPC's auth context is), the
shared token in its request (compared in constant time), or both; without
credentials the listener serves loopback only. A connection that has not yet
authenticated holds no worker, and only for a while (:mod:`.data_admission`:
its whole request within ``REQUEST_S``, bounded per source and in all). Only an
authenticated request takes one of the ``workers``; when none is free it is
answered RESOURCE_EXHAUSTED, and the caller sends its bytes over gRPC instead
(``peer_data.py``; the channel's client: ``data_link.py``). A request is bounded
(``MAX_REQUEST``), every read and write has a timeout, and streams are counted
and watched by the same :class:`~mtc.sidecar.replicator.wire.limits.Streams` as the
gRPC data streams.
What a request names is checked by the handler (``data_service.py``) before any I/O.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import BinaryIO, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from mtc.credentials import Credentials, Stamp
from mtc.errors import BusyError, MtcError, UnauthorizedError
from mtc.grpc_errors import to_status, wire_error
from mtc.lifecycle import Threads
from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.rank_names import identity_of
from mtc.sidecar.replicator.wire.data_admission import Pending
from mtc.sidecar.replicator.wire.security import check_listen_address
from mtc.sidecar.replicator.wire.socket_files import RECV_CHUNK, recv_into_fd, send_file

log = logging.getLogger(__name__)
M = TypeVar("M", bound=Message)

MAGIC = b"MTCD\x01"
MAX_REQUEST = 4 << 20    # a push of every file of an offer by index, a fetch's paths
MAX_STATUS = 64 << 10
IO_TIMEOUT_S = 30.0      # one read or write; the Streams watchdog bounds the whole
HANDSHAKE_S = 10.0       # a client's connection set-up: connect, TLS handshake
# A peer gone silent (a cut link: no reset ever comes) is found by the kernel, as
# the control plane's gRPC keepalive finds it: probed after 2 s idle, every 1 s,
# dropped when 5 s pass unanswered, or when sent bytes stay unacknowledged that
# long. A live peer's kernel answers however slowly its process reads, so a
# loaded host is not taken for a dead one; IO_TIMEOUT_S still bounds a peer that
# answers probes and sends nothing.
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTERVAL_S = 1
KEEPALIVE_PROBES = 3
UNACKED_S = 5
_LEN = struct.Struct("<I")


class Caller:
    """One accepted connection, as a handler sees its caller: who it is (the DNS
    names of its certificate, read as gRPC's ``auth_context``), and the socket
    the bytes come and go on. ``cancel`` (the stream watchdog's) ends it."""

    def __init__(self, sock: socket.socket, address: tuple[str, int], names: list[str]
                 ) -> None:
        self.sock = sock
        self.address = address
        self.names = names
        self._buf: memoryview | None = None

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"peer_dns": [n.encode() for n in self.names]} if self.names else {}

    def peer(self) -> str:
        return f"ipv4:{self.address[0]}:{self.address[1]}"

    def cancel(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def status(self, size: int = 0) -> None:
        send_msg(self.sock, pb.DataStatus(code=0, size=size))

    def recv_file(self, fd: int, size: int, progress: Callable[[int], None] | None = None
                  ) -> tuple[int, int]:
        """Receive ``size`` bytes into ``fd``: (bytes got, their CRC32C); short when
        the caller ended early."""
        if self._buf is None:
            self._buf = memoryview(bytearray(RECV_CHUNK))
        return recv_into_fd(self.sock, fd, size, self._buf, progress)

    def send_file(self, f: BinaryIO, size: int,
                  progress: Callable[[int], None] | None = None) -> None:
        send_file(self.sock, f, size, progress)


class Handler(Protocol):
    """What the data channel serves (``data_service.py``'s DataService)."""

    def data_push(self, caller: Caller, req: pb.DataRequest) -> int: ...

    def data_fetch(self, caller: Caller, req: pb.FetchRequest) -> None: ...


# -- framing ---------------------------------------------------------------------------


def watch_liveness(sock: socket.socket) -> None:
    """TCP keepalive and an unacknowledged-data bound on ``sock`` (where the
    platform has them: Linux does)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
                        ("TCP_USER_TIMEOUT", UNACKED_S * 1000)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)


def recv_exact(sock: socket.socket, n: int, wait: Callable[[], float] | None = None
               ) -> bytes:
    """``n`` bytes. ``wait``: before each receive, how long it may wait (it raises
    TimeoutError when the time is over); else the socket's timeout, each receive."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if wait is not None:
            sock.settimeout(wait())
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            if wait is None:
                raise
            continue  # wait() says whether there is time left
        if not k:
            raise ConnectionError(f"connection ended after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_msg(sock: socket.socket, msg: Message) -> None:
    data = msg.SerializeToString()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket, cls: type[M], limit: int,
             wait: Callable[[], float] | None = None) -> M:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size, wait))
    if n > limit:
        raise ValueError(f"a {cls.__name__} of {n} bytes (at most {limit})")
    try:
        return cls.FromString(recv_exact(sock, n, wait))
    except DecodeError as e:
        raise ValueError(f"malformed {cls.__name__}: {e}") from e


def error_status(e: BaseException) -> pb.DataStatus:
    """A handler's error as it travels: the one map's code, the bare message, and
    the step, host and file apart (as gRPC's trailing metadata has them)."""
    code = to_status(e)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error on the data channel", exc_info=e)
        return pb.DataStatus(code=code.value[0],
                             message=f"internal error ({type(e).__name__}; the "
                                     f"replicator's log has it)")
    message, _ = wire_error(e)
    st = pb.DataStatus(code=code.value[0], message=message)
    if isinstance(e, MtcError):
        if e.step is not None:
            st.step = int(e.step)
        if e.host is not None:
            st.host = int(e.host)
        if e.path is not None:  # never a folder of this host's (wire_error's rule)
            st.path = (os.path.basename(str(e.path)) if os.path.isabs(str(e.path))
                       else str(e.path))[:4096]
    return st


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_code(st: pb.DataStatus) -> grpc.StatusCode:
    return _CODES.get(st.code, grpc.StatusCode.UNKNOWN)


# -- TLS -------------------------------------------------------------------------------


class _TlsContexts:
    """An SSL context from the certificate files, made again when they change (a
    rotation): new connections use the new files, open ones keep theirs."""

    def __init__(self, creds: Credentials, make: Callable[[Credentials], ssl.SSLContext]
                 ) -> None:
        self._creds = creds
        self._make = make
        self._lock = threading.Lock()
        self._stamp: Stamp | None = None
        self._ctx: ssl.SSLContext | None = None

    def get(self) -> ssl.SSLContext:
        stamp = self._creds.tls_stamp()
        with self._lock:
            if self._ctx is None or stamp != self._stamp:
                self._ctx, self._stamp = self._make(self._creds), stamp
            return self._ctx


def _server_context(creds: Credentials) -> ssl.SSLContext:
    assert creds.tls_cert and creds.tls_key and creds.tls_ca
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.verify_mode = ssl.CERT_REQUIRED  # mutual: the caller's certificate names its rank
    ctx.load_cert_chain(creds.tls_cert, creds.tls_key)
    ctx.load_verify_locations(cafile=str(creds.tls_ca))
    return ctx


def _client_context(creds: Credentials, *, named: bool) -> ssl.SSLContext:
    """``named``: the server's certificate must bear the name asked for (a peer's
    rank, as gRPC checks it); else only the CA's signature is checked."""
    assert creds.tls_cert and creds.tls_key and creds.tls_ca
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = named
    ctx.load_cert_chain(creds.tls_cert, creds.tls_key)
    ctx.load_verify_locations(cafile=str(creds.tls_ca))
    return ctx


def dns_names(sock: socket.socket) -> list[str]:
    assert isinstance(sock, ssl.SSLSocket)
    cert = sock.getpeercert() or {}
    sans = cert.get("subjectAltName", ())
    return [str(v) for k, v in sans if k == "DNS"] if isinstance(sans, tuple) else []


# -- the server ----------------------------------------------------------------------------


class DataServer:
    """The data channel's listener: an accept thread, and a pool of threads, one
    per connection. A connection is pending until its request has come and
    authenticated (:class:`~.data_admission.Pending` bounds those, and their
    life); then it takes one of ``workers`` places, or is answered
    RESOURCE_EXHAUSTED. :meth:`close` joins every thread."""

    def __init__(self, handler: Handler, host: str, port: int, creds: Credentials, *,
                 workers: int = 24, request_s: float | None = None) -> None:
        check_listen_address(f"{host}:{port}", creds)
        self._handler = handler
        self._tls = _TlsContexts(creds, _server_context) if creds.tls else None
        self._token = creds.token.encode() if creds.token else None
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.create_server((host.strip("[]"), port), family=family,
                                          backlog=64)
        self._sock.settimeout(0.25)  # the accept loop looks at _closed this often
        self.port: int = self._sock.getsockname()[1]
        self.pending = Pending(request_s=request_s)
        self._slots = threading.BoundedSemaphore(workers)
        # Pending connections hold a thread each, authenticated ones a worker.
        self._pool = ThreadPool(workers + self.pending.total, "mtc-data", lazy=True)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.busy = 0  # authenticated requests answered busy (no worker free)
        self._thread: threading.Thread | None = None

    def start(self, threads: Threads | None = None) -> DataServer:
        """Accept connections on a thread of ``threads`` (the process's group; else
        one of its own). A daemon as well: a server nobody closed (a test) must not
        hold the interpreter."""
        group = threads or Threads("mtc-data")
        self._thread = group.start(self._accept, "mtc-data-accept", daemon=True)
        return self

    def stop(self) -> None:
        """No new connections (the accept thread ends within its timeout)."""
        self._closed.set()

    def close(self) -> None:
        """No new connections; the open ones are ended; every thread joined."""
        self._closed.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
        self._sock.close()
        with self._lock:
            socks = list(self._open)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _accept(self) -> None:
        while not self._closed.is_set():
            self.pending.expire()
            try:
                sock, addr = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._closed.is_set():
                    return
                log.warning("data channel: accept failed: %s", e)
                self._closed.wait(0.1)
                continue
            with self._lock:
                self._open.add(sock)
            self.pending.add(sock, addr[0])
            try:
                self._pool.submit(self._serve, sock, addr)
            except RuntimeError:  # shut down meanwhile
                self._done(sock)
                return

    def _done(self, sock: socket.socket) -> None:
        self.pending.forget(sock)
        with self._lock:
            self._open.discard(sock)
        sock.close()

    def _serve(self, raw: socket.socket, addr: tuple[str, int]) -> None:
        sock: socket.socket = raw
        try:
            wait = self.pending.waiter(raw)
            raw.settimeout(wait())
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            watch_liveness(raw)
            names: list[str] = []
            if self._tls is not None:
                tls = self._tls.get().wrap_socket(raw, server_side=True,
                                                  do_handshake_on_connect=False)
                sock = tls
                while True:
                    tls.settimeout(wait())
                    try:
                        tls.do_handshake()
                        break
                    except TimeoutError:
                        continue  # on from where it stopped, while time is left
                names = dns_names(sock)
            if recv_exact(sock, len(MAGIC), wait) != MAGIC:
                return  # not our protocol: nothing is answered
            req = recv_msg(sock, pb.DataRequest, MAX_REQUEST, wait)
            if not self.pending.authenticated(raw):
                return  # ended meanwhile
            caller = Caller(sock, addr, names)
            try:
                if self._token is not None and not hmac.compare_digest(
                        req.token.encode(), self._token):
                    raise UnauthorizedError("missing or wrong replicator token")
                if self._tls is not None and identity_of(names) is None:
                    raise UnauthorizedError("a certificate of no rank, not the controller's")
                sock.settimeout(IO_TIMEOUT_S)
                if not self._slots.acquire(blocking=False):
                    self.busy += 1
                    raise BusyError("every data channel worker is busy; send over gRPC")
                try:
                    self._handle(caller, req)
                finally:
                    self._slots.release()
            except (ConnectionError, TimeoutError, ssl.SSLError):
                raise  # the connection itself failed: nothing can be answered
            except (MtcError, OSError, ValueError, KeyError) as e:
                send_msg(sock, error_status(e))
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            log.debug("data channel connection from %s ended: %s", addr[0], e)
        except Exception:
            log.exception("data channel connection from %s", addr[0])
        finally:
            if sock is not raw:
                try:
                    sock.close()
                except OSError:
                    pass
            self._done(raw)

    def _handle(self, caller: Caller, req: pb.DataRequest) -> None:
        if req.HasField("fetch"):
            self._handler.data_fetch(caller, req.fetch)
        elif req.transfer_id:
            caller.status(self._handler.data_push(caller, req))
        else:
            raise ValueError("a data request names neither a transfer nor a fetch")


# -- the client -----------------------------------------------------------------------------


class DataClient:
    """Connections to one peer's data channel at ``host``:``port``."""

    def __init__(self, creds: Credentials, server_name: Callable[[], str | None]) -> None:
        self._creds = creds
        self._server_name = server_name
        self._named = _TlsContexts(creds, lambda c: _client_context(c, named=True))
        self._unnamed = _TlsContexts(creds, lambda c: _client_context(c, named=False))

    def connect(self, host: str, port: int, req: pb.DataRequest, *,
                timeout_s: float = IO_TIMEOUT_S) -> tuple[socket.socket, pb.DataStatus]:
        """A connection that sent ``req``, and the server's first answer (an error
        answer is returned as it is: the caller raises it with its context)."""
        if self._creds.token:
            req.token = self._creds.token
        raw = socket.create_connection((host, port), timeout=min(timeout_s, HANDSHAKE_S))
        sock: socket.socket = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            watch_liveness(raw)
            if self._creds.tls:
                name = self._server_name()
                ctx = (self._named if name is not None else self._unnamed).get()
                sock = ctx.wrap_socket(raw, server_hostname=name or host)
            sock.settimeout(timeout_s)
            data = req.SerializeToString()
            sock.sendall(MAGIC + _LEN.pack(len(data)) + data)
            return sock, recv_msg(sock, pb.DataStatus, MAX_STATUS)
        except BaseException:
            sock.close()
            raise
