"""gRPC's Data service: the raw bytes of a push into an open transfer, and of a
fetch out of a copy held here (or a restore in progress), for peers without the
data channel (:mod:`.datachannel`, whose twin is :mod:`.data_service`). The same
checks: a push names an open transfer of the caller's rank and files of its
offer, each file written new and counted only once its size and CRC32C match; a
fetch names a rank, a step and paths, each checked, and what of them this host may
serve decided (:mod:`~mtc.sidecar.replicator.copies.servable`, the data channel's
rule too), before any file is opened."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError

from mtc.errors import CorruptShardError, MtcError
from mtc.grpc_errors import answer
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.confine import open_beneath
from mtc.sidecar.replicator.copies.servable import HELD, Serving, serving
from mtc.sidecar.replicator.copies.transfers import Transfer
from mtc.sidecar.replicator.store.step_files import FileMeta, inside, safe_relpath
from mtc.sidecar.replicator.wire import checks
from mtc.sidecar.replicator.wire.limits import Streams, peer_of
from mtc.sidecar.storage.checksum import CHUNK

if TYPE_CHECKING:
    from pathlib import Path

    from mtc.sidecar.replicator.store.store import LocalStore
    from mtc.sidecar.replicator.wire.parts import Parts


class GrpcData:
    """The Data service's two raw-bytes calls (``push``, ``fetch``) on ``parts``
    (the store, the blank files, the restores in progress).
    ``transfer``: an open incoming copy by its id, of the caller's (the servicer's,
    whose Offer opened it); ``streams`` bound how many calls there are and how
    long they take."""

    def __init__(self, parts: Parts, streams: Streams,
                 transfer: Callable[[str, Any], Transfer]) -> None:
        self.parts = parts
        self.streams = streams
        self._transfer = transfer

    def push(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushAck:
        try:
            md = dict(context.invocation_metadata())
            t = self._transfer(str(md.get("x-mtc-transfer", "")), context)
            metas = self._pushed_files(t, md)
            # A place among the streams, and a deadline and a minimum rate for this one.
            with self.streams.open("push", peer_of(context), context,
                                   sum(m.size for m in metas)) as stream:
                # Whatever was there no longer counts, and is unlinked rather than
                # overwritten: a linked (deduplicated) file shares its bytes with a
                # committed step of ours.
                with t.lock:
                    t.verified.difference_update(m.path for m in metas)
                got = self._receive(t, metas, _counted(chunks, stream))
            self.parts.metrics.bytes_received.inc(got)
            return pb.PushAck(path=metas[0].path if len(metas) == 1 else "", size=got)
        except (MtcError, OSError, ValueError, KeyError) as e:
            code, msg = answer(e, context)
            context.abort(code, msg)
            raise AssertionError("unreachable") from e
        except grpc.RpcError:  # cancelled (by the stream watchdog, or the caller)
            context.abort(grpc.StatusCode.CANCELLED, "push cancelled")
            raise AssertionError("unreachable") from None

    @staticmethod
    def _pushed_files(t: Transfer, md: dict[str, Any]) -> list[FileMeta]:
        """The offered files a push carries: one named by x-mtc-path (with its size
        and CRC32C, which must match the offer), or x-mtc-files, indices into the
        offer's file list, sent back to back."""
        if "x-mtc-files" in md:
            try:
                idx = [int(x) for x in str(md["x-mtc-files"]).split(",")]
            except ValueError as e:
                raise ValueError(f"malformed x-mtc-files {md['x-mtc-files']!r}") from e
            return checks.pushed(list(t.files.values()), idx)
        rel = safe_relpath(str(md.get("x-mtc-path", "")))
        meta = t.files.get(rel)
        if meta is None:
            raise ValueError(f"{rel!r} is not part of the offered step")
        if str(md.get("x-mtc-size")) != str(meta.size) or \
                str(md.get("x-mtc-crc32c")) != str(meta.crc32c):
            raise ValueError(f"{rel!r}: size or checksum differ from the offer")
        return [meta]

    def _receive(self, t: Transfer, metas: list[FileMeta], chunks: Iterator[bytes]) -> int:
        """Write ``metas``' bytes from the stream, each file verified (size, CRC32C)
        before it counts; a file cut short or with extra bytes is removed."""
        stream = iter(chunks)
        pending = memoryview(b"")
        total = 0
        for meta in metas:
            dst = inside(t.tmp, meta.path)
            dst.unlink(missing_ok=True)
            value = got = 0
            # New (or set aside for it, mtc.sidecar.storage.reserve), part by part without following
            # a symlink.
            fd = self.parts.blanks.open_new(t.tmp, meta.path, meta.size, t.origin)
            with os.fdopen(fd, "wb", buffering=0) as f:
                try:
                    while got < meta.size:
                        if not pending:
                            nxt = next(stream, None)
                            if nxt is None:
                                break
                            pending = memoryview(nxt)
                        part = pending[:meta.size - got]
                        pending = pending[len(part):]
                        got += len(part)
                        value = crc32c(part, value)
                        f.write(part)
                    bad = checks.not_as_offered(meta, got, value, step=t.step,
                                                origin=t.origin)
                    if bad is not None:
                        raise bad
                except BaseException:
                    dst.unlink(missing_ok=True)
                    raise
            with t.lock:
                t.verified.add(meta.path)
            total += got
        if pending or next(stream, None) is not None:
            with t.lock:
                t.verified.discard(metas[-1].path)
            inside(t.tmp, metas[-1].path).unlink(missing_ok=True)
            raise CorruptShardError(f"peer sent more than the {total} bytes offered",
                                    step=t.step, host=t.origin, path=metas[-1].path)
        return total

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            try:
                req = pb.FetchRequest.FromString(request)
            except DecodeError as e:
                raise ValueError(f"malformed FetchRequest: {e}") from e
            origin, step, rels = checks.fetch(req, num_nodes=self.parts.config.num_nodes)
            # Every path decided before the first byte: a request is refused whole.
            plan, base = serving(self.parts.store, self.parts.restores.staged,
                                 self.parts.rank, origin, step, rels)
            # The bytes it sends (its deadline), as far as they are known here.
            size = max(0, sum(m.size for m in plan.files) - req.offset)
            with self.streams.open("fetch", peer_of(context), context, size) as stream:
                for chunk in self._fetch_chunks(plan, base, origin, step, rels, req.offset):
                    stream.add(len(chunk))
                    yield chunk
        except (MtcError, OSError, ValueError, KeyError) as e:
            code, msg = answer(e, context)
            context.abort(code, msg)

    def _fetch_chunks(self, plan: Serving, base: Path, origin: int, step: int,
                      rels: list[str], offset: int) -> Iterator[bytes]:
        """The files back to back (an offset only in a fetch of one file): of a held
        copy, each checked as it is read (a file that fails is quarantined, never
        sent whole); of a restore in progress, as verified when read from the backup."""
        if plan.source == HELD:
            for meta in plan.files:
                yield from stream_verified(self.parts.store, origin, step, meta, offset)
            return
        for rel in rels:
            with os.fdopen(open_beneath(base, rel), "rb", buffering=0) as f:
                f.seek(offset)
                while chunk := f.read(CHUNK):
                    yield chunk


def stream_verified(store: LocalStore, origin: int, step: int, meta: FileMeta,
                    offset: int = 0) -> Iterator[bytes]:
    """A file of a copy held in ``store`` (``meta``: as the copy describes it): its
    bytes from ``offset``, CRC32C checked as they are read; the last chunk is held
    back until the check passes, so a reader never gets a whole file that fails (the
    file is quarantined and CorruptShardError raised)."""
    rel = meta.path
    if not 0 <= offset <= meta.size:
        raise ValueError(f"offset {offset} outside {rel} ({meta.size} bytes)")
    folder = store.copy_dir(origin, step)
    path = folder / rel
    value = 0
    # Opened part by part without following a symlink: nothing outside the copy
    # is ever sent, whatever was planted in it.
    under = folder.relative_to(store.root).as_posix()
    with os.fdopen(open_beneath(store.root, f"{under}/{rel}"), "rb", buffering=0) as f:
        done = 0
        while done < offset:  # the part before the offset, checked in chunks too
            part = f.read(min(CHUNK, offset - done))
            if not part:
                break
            value = crc32c(part, value)
            done += len(part)
        held = f.read(CHUNK)
        while held:
            value = crc32c(held, value)
            nxt = f.read(CHUNK)
            if not nxt:
                break
            yield held
            held = nxt
        size = f.tell()
    if size != meta.size or value != meta.crc32c:
        store.quarantine_file(path, f"{size} bytes crc32c {value:#010x} when sent, "
                                   f"expected {meta.size} bytes {meta.crc32c:#010x}",
                             origin=origin, step=step)
        raise CorruptShardError("held copy failed its checksum; quarantined", step=step,
                                host=origin, path=rel)
    if held:
        yield held


def _counted(chunks: Iterator[bytes], stream: Any) -> Iterator[bytes]:
    for c in chunks:
        stream.add(len(c))
        yield c
