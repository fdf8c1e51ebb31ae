"""What the data channel (:mod:`.datachannel`) serves: the bytes of a push into an
open transfer, and the files of a copy held here, for a fetch.

The same checks as the gRPC Data service's (``grpc_data.py``), one function each
in :mod:`.checks`: a push names an open transfer of the caller's rank and files of
its offer; a fetch names a rank, a step and paths, each validated, and what of them
this host may serve decided (:mod:`~mtc.sidecar.replicator.copies.servable`), before
any file is opened; files are opened part by part without following a symlink. A
push's bytes are written to new files (blank ones set aside for them,
:mod:`mtc.sidecar.storage.reserve`) and count only once their size and CRC32C match the
offer.
A fetch sends a held copy's files after their check (cached by inode, size and
mtime: a file is read again only when it changed); the receiver checks every
byte again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from mtc.errors import CorruptShardError
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.confine import open_beneath
from mtc.sidecar.replicator.copies.servable import HELD, serving
from mtc.sidecar.replicator.copies.transfers import Transfers
from mtc.sidecar.replicator.store.step_files import FileMeta, inside
from mtc.sidecar.replicator.wire import checks
from mtc.sidecar.replicator.wire.datachannel import Caller
from mtc.sidecar.replicator.wire.limits import Streams, peer_of
from mtc.sidecar.replicator.wire.security import Identity

if TYPE_CHECKING:
    from mtc.sidecar.replicator.wire.parts import Parts


class DataService:
    """The data channel's handler of one replicator's ``parts`` (the store, the blank
    files, the restores in progress; threads: the data server's)."""

    def __init__(self, parts: Parts, identity: Identity, streams: Streams,
                 transfers: Transfers) -> None:
        self.parts = parts
        self.identity = identity
        self.streams = streams
        self.transfers = transfers

    # -- push ------------------------------------------------------------------------

    def data_push(self, caller: Caller, req: pb.DataRequest) -> int:
        t = self.transfers.get(req.transfer_id)
        if t is None:
            raise KeyError(f"unknown transfer {req.transfer_id[:64]!r}")
        self.identity.require(caller, t.origin, "a transfer")
        metas = checks.pushed(list(t.files.values()), list(req.files))
        total = 0
        with self.streams.open("push", peer_of(caller), caller,
                               sum(m.size for m in metas)) as stream:
            # Whatever was there no longer counts (a retried push).
            with t.lock:
                t.verified.difference_update(m.path for m in metas)
            caller.status()  # go: the bytes may come
            for meta in metas:
                dst = inside(t.tmp, meta.path)
                dst.unlink(missing_ok=True)
                # Into space set aside for it where there is some (mtc.sidecar.storage.reserve).
                fd = self.parts.blanks.open_new(t.tmp, meta.path, meta.size, t.origin)
                try:
                    got, value = caller.recv_file(fd, meta.size, stream.add)
                finally:
                    os.close(fd)
                bad = checks.not_as_offered(meta, got, value, step=t.step, origin=t.origin)
                if bad is not None:
                    dst.unlink(missing_ok=True)
                    raise bad
                with t.lock:
                    t.verified.add(meta.path)
                total += got
        self.parts.metrics.bytes_received.inc(total)
        return total

    # -- fetch ------------------------------------------------------------------------

    def data_fetch(self, caller: Caller, req: pb.FetchRequest) -> None:
        """A fetch's files back to back, each after a frame of its own: a file
        found damaged as it is about to be sent is quarantined and refused in its
        frame (the files before it count), never sent whole."""
        origin, step, rels = checks.fetch(req, num_nodes=self.parts.config.num_nodes)
        if req.offset:
            raise ValueError("the data channel sends whole files (no offset)")
        files = self.servable(origin, step, rels)
        total = sum(m.size for _, m, _ in files)
        store = self.parts.store
        with self.streams.open("fetch", peer_of(caller), caller, total) as stream:
            caller.status(total)
            for base, meta, check in files:
                why = (store.checksums.check(inside(base, meta.path), meta, cached=not req.reread)
                       if check else None)
                if why is not None:
                    store.quarantine_file(base / meta.path, why, origin=origin, step=step)
                    raise CorruptShardError("held copy failed its checksum; quarantined",
                                            step=step, host=origin, path=meta.path)
                with os.fdopen(open_beneath(base, meta.path), "rb", buffering=0) as f:
                    if os.fstat(f.fileno()).st_size != meta.size:
                        raise CorruptShardError("changed since it was described", step=step,
                                                host=origin, path=meta.path)
                    caller.status(meta.size)
                    caller.send_file(f, meta.size, stream.add)  # counted as it goes

    def servable(self, origin: int, step: int, rels: list[str]
                 ) -> list[tuple[Path, FileMeta, bool]]:
        """Per path, the folder it is read from, its description and whether it is
        checked before it is sent: a file of a copy held here (checked), or one this
        host has fetched, verified, for a restore in progress (the rule:
        :func:`~mtc.sidecar.replicator.copies.servable.servable`)."""
        plan, base = serving(self.parts.store, self.parts.restores.staged, self.parts.rank,
                             origin, step, rels)
        if plan.source == HELD:
            return [(base, meta, True) for meta in plan.files]
        return [(base, FileMeta(r, os.stat(inside(base, r)).st_size, 0), False)
                for r in rels]
