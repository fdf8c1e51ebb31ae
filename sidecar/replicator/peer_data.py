"""One peer's bytes: files pushed to it and fetched from it, over its data
channel (:mod:`.datachannel`) where it has one, else over gRPC's Data service
(:class:`PeerData`). Every byte is checked against its size and CRC32C as it
arrives; a file cut short is never left behind. Reached through
:attr:`PeerClient.data <mtc.sidecar.replicator.client.PeerClient.data>`."""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import grpc

from mtc.errors import CorruptShardError, MtcError
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.confine import open_beneath
from mtc.sidecar.replicator import datachannel as dc
from mtc.sidecar.replicator.client import PeerError
from mtc.sidecar.replicator.socket_files import RECV_CHUNK, recv_into_fd, send_file
from mtc.sidecar.replicator.step_files import FileMeta
from mtc.sidecar.storage.checksum import CHUNK

if TYPE_CHECKING:
    from mtc.sidecar.replicator.client import PeerClient
    from mtc.sidecar.replicator.security import Credentials

log = logging.getLogger(__name__)
T = TypeVar("T")
# Opens a fetched file's descriptor for writing at its start: (folder, path, size).
Opener = Callable[[Path, str, int], int]
DATA_REASK_S = 30.0  # a peer without a data channel is asked again this long after


def _open_own(path: Path) -> BinaryIO:
    """A file of this host's own copy, to send: never through a symlink planted there."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb",
                     buffering=0)


def _create(dest: Path) -> BinaryIO:
    """A file fetched into a restore's folder: a symlink in its place is not followed
    (open for reading too: the data channel checks the bytes it wrote there)."""
    return os.fdopen(os.open(dest, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o644), "wb", buffering=0)


class PeerData:
    """The bytes to and from one peer (``peer``: its control calls, its address and
    rank, and the data port it said it has). The peer's data channel: its port,
    learnt from its identity or an Offer reply (``peer.data_port``; None: not known,
    asked before the next transfer; 0: it has none, its bytes go over gRPC's Data
    service, asked again ``DATA_REASK_S`` later)."""

    def __init__(self, peer: PeerClient, creds: Credentials) -> None:
        self.peer = peer
        self._channel = dc.DataClient(creds, lambda: peer.server_name.name
                                      if peer.server_name is not None else None)
        self._asked = -DATA_REASK_S
        self.fallbacks = 0  # transfers sent over gRPC: the data channel could not be had

    @property
    def address(self) -> str:
        return self.peer.address

    @property
    def rank(self) -> int:
        return self.peer.rank

    def data_address(self) -> tuple[str, int] | None:
        """(host, port) of the peer's data channel, or None when it has none (or
        does not answer): then the bytes go over gRPC."""
        port = self.peer.data_port
        now = time.monotonic()
        if port is None or (port == 0 and now - self._asked > DATA_REASK_S):
            self._asked = now
            try:
                inv = self.peer.call("GetInventory", pb.InventoryRequest(identify=True),
                                     deadline_s=min(self.peer.deadline_s, 5.0), attempts=1)
            except PeerError:
                return None
            port = self.peer.data_port = int(inv.data_port)
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

    def _forget_port(self) -> None:
        """A restarted peer has another port and, a pod, another name: asked again."""
        self.peer.data_port = None
        if self.peer.server_name is not None:
            self.peer.server_name.stale()

    def _data_connect(self, what: str, req: pb.DataRequest
                      ) -> tuple[Any, pb.DataStatus] | None:
        """A data connection that sent ``req`` and its first answer; None when the
        peer's data channel cannot be had now: none, refused, closed before it
        answered (a flood it makes room for), or busy. The caller then goes over
        gRPC, whose calls a flood of the data port does not reach. A peer that does
        not answer at all (a cut link: the connection times out) is its own error,
        as before: gRPC would only wait for it again."""
        addr = self.data_address()
        if addr is None:
            return None
        try:
            sock, st = self._channel.connect(*addr, req)
        except (ConnectionError, ssl.SSLEOFError) as e:  # refused, reset, closed
            if isinstance(e, ConnectionRefusedError):
                self._forget_port()
            log.info("%s to %s: data channel not had (%s); over gRPC", what, self.address, e)
            self.fallbacks += 1
            return None
        except (OSError, ValueError) as e:  # timed out, a TLS failure
            self._forget_port()
            raise self._data_lost(what, e) from e
        if dc.status_code(st) == grpc.StatusCode.RESOURCE_EXHAUSTED:
            sock.close()
            self.fallbacks += 1
            return None
        return sock, st

    def push_data(self, transfer_id: str, files: list[tuple[int, Path, int, int]]
                  ) -> int | None:
        """Send several files of an offer (``(index in the offer, path, size,
        crc32c)`` each) over one data connection; the peer writes and verifies
        each, and answers how many bytes it took. A file the peer found
        damaged raises :class:`PeerError` with DATA_LOSS (the caller checks its
        own copy again). None when the data channel cannot be had: the caller
        pushes over gRPC."""
        what = f"push of {len(files)} files"
        got = self._data_connect(what, pb.DataRequest(transfer_id=transfer_id,
                                                      files=[i for i, *_ in files]))
        if got is None:
            return None
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
                        send_file(sock, f, size)
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

        md = [*self.peer.metadata, ("x-mtc-transfer", transfer_id), ("x-mtc-path", rel),
              ("x-mtc-size", str(size)), ("x-mtc-crc32c", str(crc))]
        try:
            return self.peer.retry(lambda: self.peer.push_stream(chunks(), deadline_s, md),
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

        md = [*self.peer.metadata, ("x-mtc-transfer", transfer_id),
              ("x-mtc-files", ",".join(str(i) for i, *_ in files))]
        try:
            return self.peer.retry(lambda: self.peer.push_stream(chunks(), deadline_s, md),
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
                got, value = recv_into_fd(sock, out.fileno(), size,
                                             memoryview(bytearray(min(RECV_CHUNK, size) or 1)))
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
                for chunk in self.peer.fetch_stream(req, deadline_s):
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
                    *, deadline_s: float = 120.0, opener: Opener | None = None
                    ) -> tuple[list[str], MtcError | None]:
        """Download several files of a peer's copy in one stream into ``dest``
        (each at ``dest / path``), each verified against its size and CRC32C as it
        ends. Returns the paths written and verified, in order, and the error that
        ended the stream early (None: all of them); a file cut short is removed.
        ``opener(dest, path, size)``: the new file's descriptor, open for writing at
        its start (a blank file set aside for it, :meth:`Reserve.open_new`); default
        a new empty file."""
        if not files:
            return [], None
        done: list[str] = []
        buf = memoryview(bytearray(RECV_CHUNK))

        def sink(sock: Any, f: FileMeta) -> None:
            fd = opener(dest, f.path, f.size) if opener is not None else open_beneath(
                dest, f.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, makedirs=True)
            try:
                got, value = recv_into_fd(sock, fd, f.size, buf)
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
            for chunk in self.peer.fetch_stream(req, deadline_s):
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
            for chunk in self.peer.fetch_stream(req, deadline_s):
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
