"""Calls to one peer replicator: deadlines on every call, retries on transient errors."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import grpc

from mtc.errors import CorruptShardError, MtcError, RetryableError
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.sidecar.confine import open_beneath
from mtc.sidecar.files import CHUNK
from mtc.sidecar.replicator import datachannel as dc
from mtc.sidecar.replicator.rank_names import PeerServerName
from mtc.sidecar.replicator.security import Credentials, TlsWatch
from mtc.sidecar.replicator.status import TRANSIENT, error_class, where_of
from mtc.sidecar.replicator.step_files import FileMeta

T = TypeVar("T")
MAX_MESSAGE = 64 << 20
PUSH = "/mtc.replicator.v1.Data/Push"
FETCH = "/mtc.replicator.v1.Data/Fetch"
_RETRYABLE = TRANSIENT  # the one map's: sidecar/replicator/status.py
DATA_REASK_S = 30.0  # a peer without a data channel is asked again this long after

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # A peer that was down (a replaced host takes minutes) is reached again within
    # 2 s of its return; gRPC's default backoff grows to 120 s, and calls fail fast
    # while it lasts.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.service_config", json.dumps({"methodConfig": [{
        "name": [{"service": "mtc.replicator.v1.Replicator"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.1s", "maxBackoff": "1s",
                        "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
    }]})),
]


class PeerError(RetryableError):
    """A peer could not be reached or refused a call; ``code`` is the gRPC status.
    Whether sending it again can help is :func:`~mtc.sidecar.replicator.status.is_retryable`
    (a refusal such as INVALID_ARGUMENT or DATA_LOSS is not), and ``kind`` is the
    domain error the code stands for, from the same map the server used."""

    code: grpc.StatusCode | None = None

    @property
    def unreachable(self) -> bool:
        return self.code in _RETRYABLE or self.code is None

    @property
    def kind(self) -> type[MtcError]:
        return error_class(self.code)


def _identity(b: bytes) -> bytes:
    return b


def _open_own(path: Path) -> BinaryIO:
    """A file of this host's own copy, to send: never through a symlink planted there."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb",
                     buffering=0)


def _create(dest: Path) -> BinaryIO:
    """A file fetched into a restore's folder: a symlink in its place is not followed
    (open for reading too: the data channel checks the bytes it wrote there)."""
    return os.fdopen(os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644), "wb", buffering=0)


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
    whoever's answers at its address."""

    def __init__(self, address: str, creds: Credentials, *, rank: int,
                 deadline_s: float = 10.0, as_peer: bool = False) -> None:
        self.address = address
        self.rank = rank
        self.deadline_s = deadline_s
        self._metadata = creds.call_metadata()
        self._tls = TlsWatch(creds)
        self._options = list(CHANNEL_OPTIONS)
        # The name the server's certificate must bear: rank ``rank``'s (rank_names.py).
        self._server_name = PeerServerName(address, creds, rank) if as_peer and creds.tls \
            else None
        self._lock = threading.Lock()
        self._retired: list[grpc.Channel] = []
        self._now = self._open()
        # The peer's data channel (datachannel.py): its port, learnt from its identity
        # or an Offer reply; None: not known (asked before the next transfer), 0: it
        # has none (its bytes go over gRPC's Data service; asked again later).
        self._data = dc.DataClient(creds, lambda: self._server_name.name
                                   if self._server_name is not None else None)
        self.data_port: int | None = None
        self._data_asked = -DATA_REASK_S

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
                self._server_name is not None and self._server_name.renewed()):
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
        if self._server_name is not None:
            opts.append(("grpc.ssl_target_name_override", self._server_name.name))
        return (grpc.secure_channel(self.address, cc, options=opts)
                if cc else grpc.insecure_channel(self.address, options=opts))

    def _stream(self, chunks: Iterator[bytes], deadline_s: float,
                 metadata: list[tuple[str, str]]) -> pb.PushAck:
        return self._current().push(chunks, timeout=deadline_s, metadata=metadata)

    def _fetch(self, req: pb.FetchRequest, deadline_s: float) -> Iterator[bytes]:
        return self._current().fetch(req, timeout=deadline_s,
                                     metadata=self._metadata)

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
                return self._retry(lambda: once(request, timeout=deadline_s or self.deadline_s,
                                                metadata=self._metadata), name, attempts)
            finally:
                channel.close()
        # The stub is looked up for each attempt: a renewed certificate or a peer's
        # new name (a replaced pod) makes a new channel between attempts.
        return self._retry(lambda: getattr(self.stub, name)(
            request, timeout=deadline_s or self.deadline_s, metadata=self._metadata),
            name, attempts)

    def _retry(self, fn: Callable[[], T], what: str, attempts: int) -> T:
        delay = 0.1
        for attempt in range(attempts):
            try:
                return fn()
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code == grpc.StatusCode.UNAVAILABLE and self._server_name is not None:
                    self._server_name.stale()  # a replaced peer pod has a new name
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

    # -- the data channel ------------------------------------------------------------

    def data_address(self) -> tuple[str, int] | None:
        """(host, port) of the peer's data channel, or None when it has none (or
        does not answer): then the bytes go over gRPC."""
        port = self.data_port
        now = time.monotonic()
        if port is None or (port == 0 and now - self._data_asked > DATA_REASK_S):
            self._data_asked = now
            try:
                inv = self.call("GetInventory", pb.InventoryRequest(identify=True),
                                deadline_s=min(self.deadline_s, 5.0), attempts=1)
            except PeerError:
                return None
            port = self.data_port = int(inv.data_port)
        if not port:
            return None
        return self.address.rsplit(":", 1)[0].strip("[]"), port

    def _data_error(self, what: str, st: pb.DataStatus) -> PeerError:
        code = dc.status_code(st)
        err = PeerError(f"{what} to {self.address} failed: {code.name}: {st.message}",
                        step=st.step if st.HasField("step") else None,
                        host=st.host if st.HasField("host") else
                        (self.rank if self.rank >= 0 else None),
                        path=st.path if st.HasField("path") else None)
        err.code = code
        return err

    def _data_lost(self, what: str, e: BaseException, **where: Any) -> PeerError:
        """A data connection that failed (reset, timed out, refused)."""
        err = PeerError(f"{what} to {self.address} failed: UNAVAILABLE: {e}",
                        host=where.pop("host", self.rank if self.rank >= 0 else None), **where)
        err.code = grpc.StatusCode.UNAVAILABLE
        return err

    def _data_connect(self, what: str, req: pb.DataRequest
                      ) -> tuple[Any, pb.DataStatus] | None:
        """A data connection that sent ``req`` and its first answer; None when the
        peer's data channel cannot be reached (the caller goes over gRPC)."""
        addr = self.data_address()
        if addr is None:
            return None
        try:
            return self._data.connect(*addr, req)
        except (OSError, ValueError) as e:  # refused, reset, a TLS failure
            self.data_port = None  # a restarted peer has another port: asked again
            if self._server_name is not None:
                self._server_name.stale()
            raise self._data_lost(what, e) from e

    def push_data(self, transfer_id: str, files: list[tuple[int, Path, int, int]]) -> int:
        """Send several files of an offer (``(index in the offer, path, size,
        crc32c)`` each) over one data connection; the peer writes and verifies
        each, and answers how many bytes it took. A file the peer found
        damaged raises :class:`PeerError` with DATA_LOSS (the caller checks its
        own copy again). :class:`PeerError` UNAVAILABLE without a data channel."""
        what = f"push of {len(files)} files"
        got = self._data_connect(what, pb.DataRequest(transfer_id=transfer_id,
                                                      files=[i for i, *_ in files]))
        if got is None:
            err = PeerError(f"{what} to {self.address}: no data channel")
            err.code = grpc.StatusCode.UNAVAILABLE
            raise err
        sock, st = got
        with sock:
            if st.code:
                raise self._data_error(what, st)
            try:
                for _, path, size, _ in files:
                    with _open_own(path) as f:
                        if os.fstat(f.fileno()).st_size != size:
                            raise CorruptShardError(f"local file is not {size} bytes",
                                                    path=str(path))
                        dc.send_file(sock, f, size)
                st = dc.recv_msg(sock, pb.DataStatus, dc.MAX_STATUS)
            except (OSError, ValueError) as e:
                # The peer may have refused a file and closed: its answer says why.
                try:
                    sock.settimeout(1.0)
                    st = dc.recv_msg(sock, pb.DataStatus, dc.MAX_STATUS)
                except (OSError, ValueError):
                    raise self._data_lost(what, e) from e
            if st.code:
                raise self._data_error(what, st)
            return int(st.size)

    def _fetch_data(self, step: int, origin: int, files: list[FileMeta],
                    sink: Callable[[Any, FileMeta], None], *, reread: bool = False) -> bool:
        """Fetch ``files`` of ``origin``'s copy of ``step`` over one data connection,
        handing the socket to ``sink`` for each file in turn (it reads the file's
        bytes and verifies them); False when the peer has no data channel.

        The holder sends a file its cache says is good without reading it; a file
        whose bytes do not match is asked for once more, ``reread``: the holder
        reads it against its checksum first, and quarantines and refuses it
        (DATA_LOSS) when it fails there, else sends it again."""
        req = pb.FetchRequest(step=step, origin_rank=origin, path=files[0].path,
                              more_paths=[f.path for f in files[1:]], reread=reread)
        what = f"fetch of {len(files)} files"
        got = self._data_connect(what, pb.DataRequest(fetch=req))
        if got is None:
            return False
        sock, st = got
        with sock:
            if st.code:
                raise self._data_error(what, st)
            for f in files:
                try:
                    st = dc.recv_msg(sock, pb.DataStatus, dc.MAX_STATUS)
                    if st.code:
                        raise self._data_error(f"fetch of {f.path}", st)
                    if st.size != f.size:
                        raise self._bad_copy(step, origin, f, st.size, 0)
                    try:
                        sink(sock, f)
                    except CorruptShardError:
                        if reread:
                            raise
                        self._fetch_data(step, origin, [f], sink, reread=True)
                except (ConnectionError, TimeoutError, ValueError) as e:
                    raise self._data_lost(what, e, step=step, path=f.path) from e
        return True

    def _bad_copy(self, step: int, origin: int, f: FileMeta, got: int, value: int
                  ) -> CorruptShardError:
        return CorruptShardError(
            f"copy from rank {self.rank} does not match: {got} bytes crc32c {value:#010x}, "
            f"expected {f.size} bytes crc32c {f.crc32c:#010x}", step=step, host=origin,
            path=f.path)

    def push_file(self, transfer_id: str, rel: str, path: Path, size: int, crc: int,
                  *, deadline_s: float = 120.0) -> pb.PushAck:
        """Stream one file's raw bytes; the peer acknowledges only verified bytes.

        The last chunk is held back until the file's CRC32C is known: when our own
        copy went bad after it was committed, the peer gets a short file it refuses,
        and this raises :class:`CorruptShardError` (a local fault, not a peer's).
        """
        bad = [False]

        def chunks() -> Iterator[bytes]:
            value = 0
            bad[0] = False
            with _open_own(path) as f:
                chunk = f.read(CHUNK)
                while chunk:
                    value = crc32c(chunk, value)
                    nxt = f.read(CHUNK)
                    if not nxt and value != crc:
                        break
                    yield chunk
                    chunk = nxt
            bad[0] = value != crc

        md = [*self._metadata, ("x-mtc-transfer", transfer_id), ("x-mtc-path", rel),
              ("x-mtc-size", str(size)), ("x-mtc-crc32c", str(crc))]
        try:
            return self._retry(lambda: self._stream(chunks(), deadline_s, md),
                               f"push of {rel}", 2)
        except PeerError:
            if bad[0]:
                raise CorruptShardError("local file does not match its checksum",
                                        path=str(path)) from None
            raise

    def push_files(self, transfer_id: str, files: list[tuple[int, Path, int, int]],
                   *, deadline_s: float = 120.0) -> pb.PushAck:
        """Stream several small files back to back in one call: ``(index in the
        offer, path, size, crc32c)`` each. One call per file costs more CPU than
        the bytes of a small shard. A file whose bytes no longer match its CRC32C
        ends the stream short (the peer refuses it) and raises
        :class:`CorruptShardError`."""
        bad: list[Path] = []

        def chunks() -> Iterator[bytes]:
            # One message per file as read (joining them would copy every byte
            # again); the receiver splits the stream by the offered sizes anyway.
            bad.clear()
            for _, path, size, crc in files:
                with _open_own(path) as f:
                    data = f.read(size + 1)
                if len(data) != size or crc32c(data) != crc:
                    bad.append(path)
                    return
                if data:
                    yield data

        md = [*self._metadata, ("x-mtc-transfer", transfer_id),
              ("x-mtc-files", ",".join(str(i) for i, *_ in files))]
        try:
            return self._retry(lambda: self._stream(chunks(), deadline_s, md),
                               f"push of {len(files)} files", 2)
        except PeerError:
            if bad:
                raise CorruptShardError("local file does not match its checksum",
                                        path=str(bad[0])) from None
            raise

    def fetch_file(self, step: int, origin: int, rel: str, dest: Path, size: int, crc: int,
                   *, deadline_s: float = 120.0) -> None:
        """Download one file of a peer's copy into ``dest``, verifying size and CRC32C;
        asked again, a few times, while the peer has no stream free for it."""
        _while_busy(lambda: self._fetch_file(step, origin, rel, dest, size, crc, deadline_s))

    def _fetch_file(self, step: int, origin: int, rel: str, dest: Path, size: int, crc: int,
                    deadline_s: float) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        meta = FileMeta(rel, size, crc)

        def sink(sock: Any, f: FileMeta) -> None:
            with _create(dest) as out:
                got, value = dc.recv_into_fd(sock, out.fileno(), size,
                                             memoryview(bytearray(min(dc.RECV_CHUNK, size) or 1)))
            if got != size or value != crc:
                raise self._bad_copy(step, origin, f, got, value)

        try:
            if self._fetch_data(step, origin, [meta], sink):
                return
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        req = pb.FetchRequest(step=step, origin_rank=origin, path=rel)
        value = got = 0
        try:
            with _create(dest) as f:
                for chunk in self._fetch(req, deadline_s):
                    got += len(chunk)
                    if got > size:
                        break
                    value = crc32c(chunk, value)
                    f.write(chunk)
        except grpc.RpcError as e:
            os.unlink(dest)
            err = PeerError(f"fetch of {rel} from rank {self.rank} failed: {e.code().name}: "
                            f"{e.details()}", step=step, host=self.rank, path=rel)
            err.code = e.code()
            raise err from e
        if got != size or value != crc:
            os.unlink(dest)
            raise CorruptShardError(
                f"copy from rank {self.rank} does not match: {got} bytes crc32c {value:#010x}, "
                f"expected {size} bytes crc32c {crc:#010x}", step=step, host=origin, path=rel)

    def fetch_files(self, step: int, origin: int, files: list[FileMeta], dest: Path,
                    *, deadline_s: float = 120.0) -> tuple[list[str], MtcError | None]:
        """Download several files of a peer's copy in one stream into ``dest``
        (each at ``dest / path``), each verified against its size and CRC32C as it
        ends. Returns the paths written and verified, in order, and the error that
        ended the stream early (None: all of them); a file cut short is removed."""
        if not files:
            return [], None
        done: list[str] = []
        buf = memoryview(bytearray(dc.RECV_CHUNK))

        def sink(sock: Any, f: FileMeta) -> None:
            fd = open_beneath(dest, f.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC,
                              makedirs=True)
            try:
                got, value = dc.recv_into_fd(sock, fd, f.size, buf)
            except BaseException:
                os.close(fd)
                (dest / f.path).unlink(missing_ok=True)
                raise
            os.close(fd)
            if got != f.size or value != f.crc32c:
                (dest / f.path).unlink(missing_ok=True)
                raise self._bad_copy(step, origin, f, got, value)
            done.append(f.path)

        try:
            dest.mkdir(parents=True, exist_ok=True)
            if self._fetch_data(step, origin, files, sink):
                return done, None
        except MtcError as e:
            return done, e
        req = pb.FetchRequest(step=step, origin_rank=origin, path=files[0].path,
                              more_paths=[f.path for f in files[1:]])
        i = got = value = 0
        out: Any = None

        def finish() -> MtcError | None:
            nonlocal i, got, value, out
            f = files[i]
            if out is not None:
                out.close()
                out = None
            if got != f.size or value != f.crc32c:
                os.unlink(dest / f.path)
                return CorruptShardError(
                    f"copy from rank {self.rank} does not match: {got} bytes crc32c "
                    f"{value:#010x}, expected {f.size} bytes crc32c {f.crc32c:#010x}",
                    step=step, host=origin, path=f.path)
            done.append(f.path)
            i, got, value = i + 1, 0, 0
            return None

        def start() -> None:
            nonlocal out
            out = os.fdopen(open_beneath(dest, files[i].path,
                                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC, makedirs=True),
                            "wb", buffering=0)

        try:
            dest.mkdir(parents=True, exist_ok=True)
            start()
            while i < len(files) and files[i].size == 0:  # nothing of theirs is sent
                if (err := finish()) is not None:
                    return done, err
                if i < len(files):
                    start()
            for chunk in self._fetch(req, deadline_s):
                if i >= len(files) or got + len(chunk) > files[i].size:
                    return done, CorruptShardError(
                        f"rank {self.rank} sent more than the files' sizes", step=step,
                        host=origin, path=files[min(i, len(files) - 1)].path)
                value = crc32c(chunk, value)
                out.write(chunk)
                got += len(chunk)
                while i < len(files) and got == files[i].size:
                    if (err := finish()) is not None:
                        return done, err
                    if i < len(files):
                        start()
            if i < len(files):
                return done, CorruptShardError(
                    f"rank {self.rank} ended the stream short of the files' sizes",
                    step=step, host=origin, path=files[i].path)
            return done, None
        except grpc.RpcError as e:
            err = PeerError(f"fetch of {len(files)} files from rank {self.rank} failed at "
                            f"{files[min(i, len(files) - 1)].path}: {e.code().name}: "
                            f"{e.details()}", step=step, host=self.rank)
            err.code = e.code()
            return done, err
        finally:
            if out is not None:  # a file cut short
                out.close()
                (dest / files[i].path).unlink(missing_ok=True)

    def fetch_bytes(self, step: int, origin: int, rel: str, size: int, crc: int,
                    *, deadline_s: float = 120.0) -> bytearray:
        """One file of a copy this peer holds, into memory, verified against the size
        and CRC32C its inventory gave (a restore reading another host's region);
        asked again, a few times, while the peer has no stream free for it."""
        return _while_busy(lambda: self._fetch_bytes(step, origin, rel, size, crc, deadline_s))

    def _fetch_bytes(self, step: int, origin: int, rel: str, size: int, crc: int,
                     deadline_s: float) -> bytearray:
        out = bytearray(size)  # filled in place: no growing, no join
        view = memoryview(out)

        def sink(sock: Any, f: FileMeta) -> None:
            got = value = 0
            while got < size:
                n = sock.recv_into(view[got:], min(CHUNK, size - got))
                if not n:
                    break
                value = crc32c(view[got:got + n], value)
                got += n
            if got != size or value != crc:
                raise self._bad_copy(step, origin, f, got, value)

        try:
            if self._fetch_data(step, origin, [FileMeta(rel, size, crc)], sink):
                view.release()
                return out
        except BaseException:
            view.release()
            raise
        req = pb.FetchRequest(step=step, origin_rank=origin, path=rel)
        view = memoryview(out)
        got = value = 0
        try:
            for chunk in self._fetch(req, deadline_s):
                if got + len(chunk) > size:
                    got += len(chunk)
                    break
                value = crc32c(chunk, value)
                view[got:got + len(chunk)] = chunk
                got += len(chunk)
        except grpc.RpcError as e:
            err = PeerError(f"fetch of {rel} from rank {self.rank} at {self.address} failed: "
                            f"{e.code().name}: {e.details()}", step=step, host=origin, path=rel)
            err.code = e.code()
            raise err from e
        finally:
            view.release()
        if got != size or value != crc:
            raise CorruptShardError(
                f"copy from rank {self.rank} does not match: {got} bytes crc32c "
                f"{value:#010x}, expected {size} bytes crc32c {crc:#010x}", step=step,
                host=origin, path=rel)
        return out


BUSY_ATTEMPTS = 6  # about 6 s of backoff in all


def _while_busy(fn: Callable[[], T]) -> T:
    """``fn()``, called again with backoff while the peer answers RESOURCE_EXHAUSTED
    (all its streams taken, for now): a restore's fetch waits for a free stream
    rather than fail over to another holder at once."""
    delay = 0.2
    for attempt in range(BUSY_ATTEMPTS):
        try:
            return fn()
        except PeerError as e:
            if e.code != grpc.StatusCode.RESOURCE_EXHAUSTED or attempt == BUSY_ATTEMPTS - 1:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 2.0)
    raise AssertionError("unreachable")
