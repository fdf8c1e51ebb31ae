"""The receiving side of the copy protocol, beside its sending side (:mod:`.replication`).

An origin offers a copy (its file list, and under mutual TLS its signed entry);
the holder answers with the files it already holds identical bytes of (dedupe:
:func:`~mtc.sidecar.replicator.store.claims.find_identical`), after checking the
proof (:mod:`.provenance`) and making room (the reserve's blank files); the
origin links those (:meth:`Receiver.link`) and pushes the rest (the transport's
data path writes them into the transfer's folder, verified); the commit checks
that every file came, that no fence since the offer deleted the step
(``store/fence.py``), and publishes the copy with its proof.

Who may offer, link, commit or abort a transfer (authentication, the caller's
rank) is the transport's to check before it calls here (``wire/server.py`` over
gRPC); this module sees requests already checked and speaks the protocol's
messages (``mtc.proto``), not any transport's.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from mtc.errors import CorruptShardError, StepNotFoundError, UnauthorizedError
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.copies.provenance import ProofCheck
from mtc.sidecar.replicator.copies.transfers import Transfer, Transfers
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.store import claims
from mtc.sidecar.replicator.store.step_files import FileMeta, inside
from mtc.sidecar.replicator.store.store import LocalStore
from mtc.sidecar.storage.spare import room

log = logging.getLogger(__name__)
TRANSFER_IDLE_S = 300.0


class Blanks(Protocol):
    """The reserve's blank files a copy fills
    (:class:`~mtc.sidecar.storage.reserve.Reserve`), keyed by origin rank."""

    def begin(self, key: int, sizes: Iterable[int]) -> None: ...

    def want(self, key: int, sizes: Iterable[int]) -> None: ...

    def room_for_others(self, key: int) -> int: ...

    def open_new(self, base: Path, rel: str, size: int, key: int) -> int: ...


class Receiver:
    """This host's incoming copies: offers answered, links made, commits checked.
    ``proofs``: the proof check (mutual TLS), else None; ``data_port``: the port
    an offer's reply names for the bytes (0: none, they go over the control
    transport); ``max_files``: the files every open transfer together may list."""

    def __init__(self, rank: int, store: LocalStore, metrics: Metrics, blanks: Blanks,
                 proofs: ProofCheck | None, *, max_files: int,
                 idle_s: float = TRANSFER_IDLE_S,
                 data_port: Callable[[], int] = lambda: 0) -> None:
        self.rank = rank
        self.store = store
        self.metrics = metrics
        self.blanks = blanks
        self.proofs = proofs
        self.data_port = data_port
        self.transfers = Transfers(
            # The reserve's blank files are room a copy fills (mtc.sidecar.storage.reserve),
            # but for those set aside for this host's own restore.
            lambda: room(store.root) + blanks.room_for_others(rank),
            max_files=max_files, idle_s=idle_s)

    def expire(self) -> None:
        dropped = self.transfers.expire()
        if dropped:
            self.metrics.skipped.labels("transfer_expired").inc(dropped)

    def incoming(self) -> set[tuple[int, int]]:
        return self.transfers.incoming()

    def offer(self, copy: pb.StepCopy, origin: int, step: int,
              files: list[FileMeta]) -> pb.OfferReply:
        """Open a transfer of ``copy`` (checked: ``origin``, ``step``, ``files``), or
        answer that this very copy is held already."""
        proof = self._proof(copy)
        store = self.store
        fences = store.fences
        # Complete only when it is this very copy: a copy held of an older save under
        # the same number (saved again after a restore) is replaced at the commit.
        # (With a proof: once the one held has its proof too.)
        if (origin, step) in store.copies() and store.same_copy(origin, step, files) and \
                (not proof or store.proofs.of(origin, step, store.copy_dir(origin, step))):
            return pb.OfferReply(already_complete=True)
        t = Transfer(origin, step, Path(), files, fences)
        t.proof = proof
        reply = pb.OfferReply(data_port=self.data_port())
        signed = {f.path: bytes(f.sha256) for f in copy.files} if proof else {}
        for path, (local, identified) in claims.find_identical(store, files, step).items():
            # Under mutual TLS a file held here stands for the offered one only with
            # the SHA-256 its origin signed: another rank's twin of the same path,
            # size and CRC32C may be bytes made to match (then the copy is pushed).
            try:
                if signed and store.checksums.sha256(local) != signed.get(path):
                    continue
            except OSError:
                continue  # gone meanwhile: pushed
            t.candidates[path] = local
            # The same path of the same step with the same size and CRC32C: the
            # manifests say it is the same shard; no hash pass on either side
            # (under TLS: checked here against the signed list).
            reply.candidates.add(path=path, sha256=b"" if identified or signed
                                 else store.checksums.sha256(local))
        # Blank files this copy cannot fill make room for it now (sidecar/storage/reserve.py).
        self.blanks.begin(origin, [f.size for f in files])
        t.tmp = store.begin_incoming(origin, step)
        try:
            reply.transfer_id = self.transfers.open(t)
        except BaseException:
            shutil.rmtree(t.tmp, ignore_errors=True)
            raise
        return reply

    def _proof(self, c: pb.StepCopy) -> bytes:
        """With mutual TLS, the offered entry, to keep with the copy, once its proof
        is found good (:mod:`.provenance`): an offer without it is refused (a
        copy nobody could use). Without TLS: nothing to keep."""
        proofs = self.proofs
        if proofs is None:
            return b""
        why = proofs.why_not(c)
        if why is not None:
            self.metrics.unproven.inc()
            raise UnauthorizedError(f"an offer of rank {c.origin_rank}'s step {c.step}: {why}")
        return c.SerializeToString()

    def link(self, t: Transfer, paths: Sequence[str]) -> pb.LinkReply:
        """Take the files of ``paths`` (offered as candidates) from the bytes held here."""
        linked = []
        for rel in paths:
            src = t.candidates.get(rel)
            if src is None:
                raise ValueError(f"{rel!r} was not offered as a candidate")
            dst = inside(t.tmp, rel)
            dst.parent.mkdir(parents=True, exist_ok=True)
            meta = t.files[rel]
            dst.unlink(missing_ok=True)
            # A claim on the bytes this host holds (a link), not a second copy of
            # them: damage found through either drops both (claims.claim).
            claims.claim(self.store, src, dst, meta)
            with t.lock:
                t.verified.add(rel)
                t.linked.add(rel)
            linked.append(rel)
        self.metrics.deduplicated_files.inc(len(linked))
        return pb.LinkReply(linked=linked)

    def receive(self, t: Transfer, metas: list[FileMeta], chunks: Iterator[bytes]) -> int:
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
            fd = self.blanks.open_new(t.tmp, meta.path, meta.size, t.origin)
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

    def commit(self, tid: str) -> pb.CommitReply:
        """Publish transfer ``tid``'s copy once every file is verified, unless a fence
        since its offer deleted its step (``store/fence.py``)."""
        t = self.transfers.take(tid)  # one commit: a replayed one finds none
        if t is None:
            raise KeyError(f"unknown transfer {tid[:64]!r}")
        missing = set(t.files) - t.verified
        if missing:
            self.transfers.put_back(tid, t)
            raise CorruptShardError(f"{len(missing)} files not received or not verified, e.g. "
                                    f"{sorted(missing)[0]}", step=t.step, host=t.origin)
        if self.store.fenced_since(t.fences, t.step):
            shutil.rmtree(t.tmp, ignore_errors=True)
            raise StepNotFoundError("a restore of an older step was agreed while this copy "
                                    "was on its way: the step is fenced off", step=t.step,
                                    host=t.origin)
        try:
            self.store.commit_incoming(t.tmp, t.origin, t.step, list(t.files.values()),
                                       t.proof)
        except BaseException:
            shutil.rmtree(t.tmp, ignore_errors=True)
            raise
        log.info("rank %d: holds a verified copy of rank %d step %d", self.rank, t.origin,
                 t.step)
        # The next copy from this origin likely brings files of these sizes again.
        self.blanks.want(t.origin, [m.size for p, m in t.files.items()
                                    if p not in t.linked])
        # Saved here meanwhile (after the Offer found nothing to link): the copy's
        # files identical to the own step's become claims on them (held once).
        self.metrics.deduplicated_files.inc(claims.fold(self.store, t.step, [t.origin]))
        return pb.CommitReply(step=t.step, origin_rank=t.origin)

    def abort(self, tid: str) -> None:
        """Drop transfer ``tid`` and what it received (none open: nothing)."""
        t = self.transfers.take(tid)
        if t is not None:
            shutil.rmtree(t.tmp, ignore_errors=True)
