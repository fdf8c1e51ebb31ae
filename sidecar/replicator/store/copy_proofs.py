"""Proofs of copies where they are made and kept (:mod:`.provenance` says what they are).

- :class:`OwnProofs`, on the origin: the signed entry of an own step, made the
  first time it is offered (each file's SHA-256 read once, on a few threads:
  hashlib runs outside the GIL) and remembered while its folder is the same.
- The holder keeps the offer's signed entry beside the copy it received
  (``.mtc-replica/<origin>/<step>.proof``, written before the folder's rename
  by :meth:`LocalStore.commit_incoming`), and :class:`HeldProofs` puts it back
  on the copy's inventory entry.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.store.step_files import FileMeta

HASH_THREADS = 4
MAX_PROOF_BYTES = 64 << 20  # a proof file read back (our own, written by this store)
PROOF_SUFFIX = ".proof"
MAX_REMEMBERED = 1024     # held copies' entries remembered (beyond: read again)
MAX_REMEMBERED_OWN = 16   # own steps' signed entries (a host keeps a few steps)


class Signer(Protocol):
    """What signs an own step's entry (``copies/provenance.py``'s ``Signer``; typed
    here by what it does, so the store does not import the copies it holds)."""

    def sign(self, c: pb.StepCopy, sha256: dict[str, bytes]) -> None: ...


def proof_path(replicas: Path, origin: int, step: int) -> Path:
    return replicas / str(origin) / f"{step}{PROOF_SUFFIX}"


class OwnProofs:
    """Signed entries of this rank's own steps, by step, while the folder is the
    same (by inode). Thread-safe; ``close`` ends its hashing threads."""

    def __init__(self, rank: int, signer: Signer) -> None:
        self._rank = rank
        self._signer = signer
        self._lock = threading.Lock()
        self._made: dict[int, tuple[int, pb.StepCopy]] = {}
        self._pool = ThreadPool(HASH_THREADS, "mtc-sha256", lazy=True)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def cached(self, step: int, folder: Path) -> pb.StepCopy | None:
        """The signed entry of own ``step`` when one was made of this folder."""
        try:
            ino = os.stat(folder).st_ino
        except OSError:
            return None
        with self._lock:
            hit = self._made.get(step)
        return hit[1] if hit is not None and hit[0] == ino else None

    def entry(self, step: int, folder: Path, files: list[FileMeta], *, run: str,
              saved_hosts: int, saving_ranks: list[int], sha256: Callable[[Path], bytes]
              ) -> pb.StepCopy:
        """The signed entry of own ``step`` in ``folder`` with ``files``;
        ``sha256``: a path's SHA-256 (the store's remembered checksums)."""
        ino = os.stat(folder).st_ino
        with self._lock:
            hit = self._made.get(step)
        if hit is not None and hit[0] == ino:
            return hit[1]
        digests = dict(zip([f.path for f in files],
                           self._pool.map(lambda f: sha256(folder / f.path), files),
                           strict=True))
        c = pb.StepCopy(step=step, origin_rank=self._rank, run=run, saved_hosts=saved_hosts,
                        saving_ranks=saving_ranks,
                        files=[pb.FileInfo(path=f.path, size=f.size, crc32c=f.crc32c)
                               for f in files])
        self._signer.sign(c, digests)
        with self._lock:
            self._made[step] = (ino, c)
            for gone in sorted(self._made)[:-MAX_REMEMBERED_OWN]:
                del self._made[gone]  # the oldest: deleted, or offered long ago
        return c


def _stamp(path: Path) -> tuple[int, int]:
    """(inode, mtime) of a proof file; (0, 0) when there is none (a copy kept
    without TLS, or before its proof came: Offer sends it again)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return (0, 0)
    return (st.st_ino, st.st_mtime_ns)


class HeldProofs:
    """The signed entries of copies held here, read once per copy folder (by inode)."""

    def __init__(self, replicas: Path) -> None:
        self._replicas = replicas
        self._lock = threading.Lock()
        # (origin, step) -> ((the copy folder's inode, the proof file's), its entry)
        self._read: dict[tuple[int, int], tuple[tuple[int, tuple[int, int]],
                                                pb.StepCopy | None]] = {}

    def of(self, origin: int, step: int, folder: Path) -> pb.StepCopy | None:
        """The signed entry kept with the copy in ``folder``; None without one."""
        path = proof_path(self._replicas, origin, step)
        try:
            stamp = (os.stat(folder).st_ino, _stamp(path))
        except OSError:
            return None
        with self._lock:
            hit = self._read.get((origin, step))
        if hit is not None and hit[0] == stamp:
            return hit[1]
        entry: pb.StepCopy | None = None
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_PROOF_BYTES + 1)
            if len(data) <= MAX_PROOF_BYTES:
                entry = pb.StepCopy.FromString(data)
        except (OSError, ValueError):
            entry = None  # none kept (a copy made without TLS): listed unproven
        with self._lock:
            if len(self._read) >= MAX_REMEMBERED:
                self._read.clear()  # copies long deleted: read again when asked
            self._read[(origin, step)] = (stamp, entry)
        return entry

    def attach(self, c: pb.StepCopy, folder: Path) -> None:
        """Put the proof kept with the copy in ``folder`` on its entry ``c``."""
        put_proof(c, self.of(c.origin_rank, c.step, folder))


def put_proof(c: pb.StepCopy, entry: pb.StepCopy | None) -> None:
    """Put signed ``entry``'s proof, and the SHA-256 of each file ``c`` lists, on
    the entry ``c`` lists of the same copy (nothing when ``entry`` is None, or is
    of other bytes: a step saved again under its number)."""
    if entry is None or not entry.proof.signature or entry.fingerprint != c.fingerprint:
        return
    c.proof.CopyFrom(entry.proof)
    if c.files:
        shas = {f.path: f.sha256 for f in entry.files}
        for f in c.files:
            f.sha256 = shas.get(f.path, b"")
