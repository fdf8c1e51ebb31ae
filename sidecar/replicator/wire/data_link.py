"""One peer's data channel, as its client (:mod:`.datachannel` serves it): where
the channel is (its port, learnt from the peer's identity, asked again while it
has none), a connection that sent a request and read its first answer, files
pushed over it and fetched from it into a caller's sink, and its failures as
:class:`PeerError`. A channel that cannot be had now (none, refused, busy) says
so, and :mod:`.peer_data` goes over gRPC's Data service instead."""

from __future__ import annotations

import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from mtc.errors import CorruptShardError
from mtc.grpc_errors import PeerError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.confine import open_own
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.wire import datachannel as dc
from mtc.sidecar.replicator.wire.socket_files import send_file

if TYPE_CHECKING:
    from mtc.credentials import Credentials
    from mtc.sidecar.replicator.wire.peer_calls import PeerCalls

log = logging.getLogger(__name__)
DATA_REASK_S = 30.0  # a peer without a data channel is asked again this long after


class DataLink:
    """The data channel of one peer (``peer``: its control calls, its address and
    rank, and the data port it said it has: ``peer.data_port``; None: not known,
    asked before the next transfer; 0: it has none, asked again ``DATA_REASK_S``
    later)."""

    def __init__(self, peer: PeerCalls, creds: Credentials) -> None:
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

    def _error(self, what: str, st: pb.DataStatus) -> PeerError:
        code = dc.status_code(st)
        err = PeerError(f"{what} to {self.address} failed: {code.name}: {st.message}",
                        step=st.step if st.HasField("step") else None,
                        host=st.host if st.HasField("host") else
                        (self.rank if self.rank >= 0 else None),
                        path=st.path if st.HasField("path") else None)
        err.code = code
        return err

    def _lost(self, what: str, e: BaseException, **where: Any) -> PeerError:
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

    def _connect(self, what: str, req: pb.DataRequest
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
            raise self._lost(what, e) from e
        if dc.status_code(st) == grpc.StatusCode.RESOURCE_EXHAUSTED:
            sock.close()
            self.fallbacks += 1
            return None
        return sock, st

    def push(self, transfer_id: str, files: list[tuple[int, Path, int, int]]
                  ) -> int | None:
        """Send several files of an offer (``(index in the offer, path, size,
        crc32c)`` each) over one data connection; the peer writes and verifies
        each, and answers how many bytes it took. A file the peer found
        damaged raises :class:`PeerError` with DATA_LOSS (the caller checks its
        own copy again). None when the data channel cannot be had: the caller
        pushes over gRPC."""
        what = f"push of {len(files)} files"
        got = self._connect(what, pb.DataRequest(transfer_id=transfer_id,
                                                      files=[i for i, *_ in files]))
        if got is None:
            return None
        sock, st = got
        with sock:
            if st.code:
                raise self._error(what, st)
            try:
                for _, path, size, _ in files:
                    with open_own(path) as f:
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
                    raise self._lost(what, e) from e
            if st.code:
                raise self._error(what, st)
            return int(st.size)

    def fetch(self, step: int, origin: int, files: list[FileMeta],
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
        got = self._connect(what, pb.DataRequest(fetch=req))
        if got is None:
            return False
        sock, st = got
        with sock:
            if st.code:
                raise self._error(what, st)
            for f in files:
                try:
                    st = dc.recv_msg(sock, pb.DataStatus, dc.MAX_STATUS)
                    if st.code:
                        raise self._error(f"fetch of {f.path}", st)
                    if st.size != f.size:
                        raise self.bad_copy(step, origin, f, st.size, 0)
                    try:
                        sink(sock, f)
                    except CorruptShardError:
                        if reread:
                            raise
                        self.fetch(step, origin, [f], sink, reread=True)
                except (ConnectionError, TimeoutError, ValueError) as e:
                    raise self._lost(what, e, step=step, path=f.path) from e
        return True

    def bad_copy(self, step: int, origin: int, f: FileMeta, got: int, value: int
                  ) -> CorruptShardError:
        return CorruptShardError(
            f"copy from rank {self.rank} does not match: {got} bytes crc32c {value:#010x}, "
            f"expected {f.size} bytes crc32c {f.crc32c:#010x}", step=step, host=origin,
            path=f.path)
