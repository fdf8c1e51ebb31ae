"""One peer's bytes: files pushed to it and fetched from it, over its data
channel (:mod:`.data_link`) where it has one, else over gRPC's Data service
(:mod:`.grpc_data_client`). Every byte is checked against its size and CRC32C as
it arrives; a file cut short is never left behind. Reached through
:attr:`PeerClient.data <mtc.sidecar.replicator.wire.client.PeerClient.data>`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from mtc.errors import MtcError
from mtc.grpc_errors import PeerError
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.confine import create_fetched, open_beneath
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.transport import Opener
from mtc.sidecar.replicator.wire import grpc_data_client
from mtc.sidecar.replicator.wire.data_link import DataLink
from mtc.sidecar.replicator.wire.socket_files import RECV_CHUNK, recv_into_fd
from mtc.sidecar.storage.checksum import CHUNK

if TYPE_CHECKING:
    from mtc.credentials import Credentials
    from mtc.sidecar.replicator.wire.peer_calls import PeerCalls

T = TypeVar("T")


class PeerData:
    """The bytes to and from one peer (``peer``: its control calls, its address and
    rank, and the data port it said it has): over ``link``, its data channel,
    where it can be had; else over gRPC's Data service."""

    def __init__(self, peer: PeerCalls, creds: Credentials) -> None:
        self.peer = peer
        self.link = DataLink(peer, creds)

    def push_data(self, transfer_id: str, files: list[tuple[int, Path, int, int]]
                  ) -> int | None:
        """Send several files of an offer over the data channel
        (:meth:`.DataLink.push`); None when it cannot be had: the caller pushes
        over gRPC (:meth:`push_files`, :meth:`push_file`)."""
        return self.link.push(transfer_id, files)

    def push_file(self, transfer_id: str, rel: str, path: Path, size: int, crc: int,
                  *, deadline_s: float = 120.0) -> pb.PushAck:
        """One file over gRPC (:func:`.grpc_data_client.push_file`)."""
        return grpc_data_client.push_file(self.peer, transfer_id, rel, path, size, crc,
                                          deadline_s=deadline_s)

    def push_files(self, transfer_id: str, files: list[tuple[int, Path, int, int]],
                   *, deadline_s: float = 120.0) -> pb.PushAck:
        """Several small files in one gRPC call (:func:`.grpc_data_client.push_files`)."""
        return grpc_data_client.push_files(self.peer, transfer_id, files,
                                           deadline_s=deadline_s)

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
            with create_fetched(dest) as out:
                got, value = recv_into_fd(sock, out.fileno(), size,
                                             memoryview(bytearray(min(RECV_CHUNK, size) or 1)))
            if got != size or value != crc:
                raise self.link.bad_copy(step, origin, f, got, value)

        try:
            if self.link.fetch(step, origin, [meta], sink):
                return
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        grpc_data_client.fetch_file(self.peer, step, origin, rel, dest, size, crc, deadline_s)

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
                raise self.link.bad_copy(step, origin, f, got, value)
            done.append(f.path)

        try:
            dest.mkdir(parents=True, exist_ok=True)
            if self.link.fetch(step, origin, files, sink):
                return done, None
        except MtcError as e:
            return done, e
        return grpc_data_client.fetch_files(self.peer, step, origin, files, dest, deadline_s,
                                            done)

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
                raise self.link.bad_copy(step, origin, f, got, value)

        try:
            fetched = self.link.fetch(step, origin, [FileMeta(rel, size, crc)], sink)
        finally:
            view.release()
        if fetched:
            return out
        grpc_data_client.fetch_bytes(self.peer, step, origin, rel, crc, out, deadline_s)
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
