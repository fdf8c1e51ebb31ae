"""gRPC's Data service, called (:mod:`.grpc_data` serves it): a peer's files pushed
and fetched over its control connection when its data channel cannot be had
(:mod:`.peer_data` chooses). A push holds its last chunk back until the file's
CRC32C is known; a fetch checks every file's size and CRC32C as it ends and
removes a file cut short."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from mtc.errors import CorruptShardError, MtcError
from mtc.grpc_errors import PeerError
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.confine import create_fetched, open_beneath, open_own
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.storage.checksum import CHUNK

if TYPE_CHECKING:
    from mtc.sidecar.replicator.wire.peer_calls import PeerCalls


def push_file(peer: PeerCalls, transfer_id: str, rel: str, path: Path, size: int, crc: int,
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
        with open_own(path) as f:
            chunk = f.read(CHUNK)
            while chunk:
                value = crc32c(chunk, value)
                nxt = f.read(CHUNK)
                if not nxt and value != crc:
                    break
                yield chunk
                chunk = nxt
        bad[0] = value != crc

    md = [*peer.metadata, ("x-mtc-transfer", transfer_id), ("x-mtc-path", rel),
          ("x-mtc-size", str(size)), ("x-mtc-crc32c", str(crc))]
    try:
        return peer.retry(lambda: peer.push_stream(chunks(), deadline_s, md),
                          f"push of {rel}", 2)
    except PeerError:
        if bad[0]:
            raise CorruptShardError("local file does not match its checksum",
                                    path=str(path)) from None
        raise


def push_files(peer: PeerCalls, transfer_id: str, files: list[tuple[int, Path, int, int]],
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
            with open_own(path) as f:
                data = f.read(size + 1)
            if len(data) != size or crc32c(data) != crc:
                bad.append(path)
                return
            if data:
                yield data

    md = [*peer.metadata, ("x-mtc-transfer", transfer_id),
          ("x-mtc-files", ",".join(str(i) for i, *_ in files))]
    try:
        return peer.retry(lambda: peer.push_stream(chunks(), deadline_s, md),
                          f"push of {len(files)} files", 2)
    except PeerError:
        if bad:
            raise CorruptShardError("local file does not match its checksum",
                                    path=str(bad[0])) from None
        raise


def fetch_file(peer: PeerCalls, step: int, origin: int, rel: str, dest: Path, size: int,
               crc: int, deadline_s: float) -> None:
    """One file of ``peer``'s copy into ``dest`` (created), verified against its size
    and CRC32C; removed when it is not."""
    req = pb.FetchRequest(step=step, origin_rank=origin, path=rel)
    value = got = 0
    try:
        with create_fetched(dest) as f:
            for chunk in peer.fetch_stream(req, deadline_s):
                got += len(chunk)
                if got > size:
                    break
                value = crc32c(chunk, value)
                f.write(chunk)
    except grpc.RpcError as e:
        os.unlink(dest)
        err = PeerError(f"fetch of {rel} from rank {peer.rank} failed: {e.code().name}: "
                        f"{e.details()}", step=step, host=peer.rank, path=rel)
        err.code = e.code()
        raise err from e
    if got != size or value != crc:
        os.unlink(dest)
        raise CorruptShardError(
            f"copy from rank {peer.rank} does not match: {got} bytes crc32c {value:#010x}, "
            f"expected {size} bytes crc32c {crc:#010x}", step=step, host=origin, path=rel)


def fetch_files(peer: PeerCalls, step: int, origin: int, files: list[FileMeta],
                dest: Path, deadline_s: float, done: list[str]
                ) -> tuple[list[str], MtcError | None]:
    """Several files of ``peer``'s copy in one stream into ``dest`` (each at ``dest /
    path``), each verified as it ends and appended to ``done``; ``done`` and the
    error that ended the stream early (None: all of them). A file cut short is
    removed."""
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
                f"copy from rank {peer.rank} does not match: {got} bytes crc32c "
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
        for chunk in peer.fetch_stream(req, deadline_s):
            if i >= len(files) or got + len(chunk) > files[i].size:
                return done, CorruptShardError(
                    f"rank {peer.rank} sent more than the files' sizes", step=step,
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
                f"rank {peer.rank} ended the stream short of the files' sizes",
                step=step, host=origin, path=files[i].path)
        return done, None
    except grpc.RpcError as e:
        err = PeerError(f"fetch of {len(files)} files from rank {peer.rank} failed at "
                        f"{files[min(i, len(files) - 1)].path}: {e.code().name}: "
                        f"{e.details()}", step=step, host=peer.rank)
        err.code = e.code()
        return done, err
    finally:
        if out is not None:  # a file cut short
            out.close()
            (dest / files[i].path).unlink(missing_ok=True)


def fetch_bytes(peer: PeerCalls, step: int, origin: int, rel: str, crc: int,
                out: bytearray, deadline_s: float) -> None:
    """One file of ``peer``'s copy into ``out`` (its size), verified against its size
    and ``crc``."""
    size = len(out)
    req = pb.FetchRequest(step=step, origin_rank=origin, path=rel)
    view = memoryview(out)
    got = value = 0
    try:
        for chunk in peer.fetch_stream(req, deadline_s):
            if got + len(chunk) > size:
                got += len(chunk)
                break
            value = crc32c(chunk, value)
            view[got:got + len(chunk)] = chunk
            got += len(chunk)
    except grpc.RpcError as e:
        err = PeerError(f"fetch of {rel} from rank {peer.rank} at {peer.address} failed: "
                        f"{e.code().name}: {e.details()}", step=step, host=origin, path=rel)
        err.code = e.code()
        raise err from e
    finally:
        view.release()
    if got != size or value != crc:
        raise CorruptShardError(
            f"copy from rank {peer.rank} does not match: {got} bytes crc32c "
            f"{value:#010x}, expected {size} bytes crc32c {crc:#010x}", step=step,
            host=origin, path=rel)
