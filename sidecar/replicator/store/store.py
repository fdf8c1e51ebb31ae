"""What a replicator holds on its RAM disk: its host's steps and peers' copies.

Layout under the host's root (the RAM disk):

- ``<step>/``                                  the host's own committed steps (mtc's, or
                                              Orbax's opaque trees when serving Orbax's
                                              client); an mtc step whose manifest names
                                              another host or step is not, nor is a folder
                                              without a manifest beside mtc
                                              (:mod:`.own_steps`)
- ``.mtc-replica/<origin>/<step>/``            a verified copy of rank ``origin``'s step
- ``.mtc-replica/<origin>/<step>.files.json``  its file list (path, size, CRC32C)
- ``.mtc-replica/<origin>/<step>.proof``       the origin's signed entry of it, with
                                              mutual TLS (:mod:`.copy_proofs`)
- ``.mtc-replica/<origin>/<step>.mtc-tmp-*/``  a copy being received

A peer copy is committed like a step: its file list is written, then its folder
renamed into place; only then does it count. Committed folders never change, so
their descriptions are computed once.

Bytes are checked, not trusted: a copy counts as held only while every file
matches its description (size and CRC32C; results cached per file by inode, size
and mtime, so a steady-state inventory costs one ``stat`` per file). A file that
fails is quarantined (:mod:`mtc.sidecar.storage.quarantine`) and its copy stops counting until
:meth:`LocalStore.repair` puts a verified file in its place. A peer's copy of
bytes this host already holds claims them (:mod:`.claims`: a hard link, one inode
for both names); damage found through any name quarantines every name
(:meth:`LocalStore.quarantine_file`), so no copy keeps bytes another one was
found to have lost.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from mtc import layout
from mtc.errors import CorruptShardError, MtcError
from mtc.manifest import MANIFEST_NAME, Manifest, Summary
from mtc.sidecar.confine import is_real_dir, real_dir
from mtc.sidecar.replicator.store import claims
from mtc.sidecar.replicator.store import fence as fencing
from mtc.sidecar.replicator.store.checksums import Checksums
from mtc.sidecar.replicator.store.copy_proofs import HeldProofs, proof_path
from mtc.sidecar.replicator.store.own_steps import OwnSteps
from mtc.sidecar.replicator.store.step_files import (
    FileMeta,
    describe_own,
    fingerprint_of,
    inside,
)
from mtc.sidecar.storage.deleter import clean_uncommitted, remove_step
from mtc.sidecar.storage.names import tmp_dir
from mtc.sidecar.storage.publish import publish, replace, write_atomic
from mtc.sidecar.storage.quarantine import links_of, quarantine

log = logging.getLogger(__name__)

REPLICA_DIR = ".mtc-replica"
# Fences remembered for commits of copies offered before them (one per restore
# agreed; a copy offered before more than these is refused, and offered again).
MAX_FENCES_KEPT = 64


class LocalStore:
    """The host's own steps and the peer copies it keeps, with a content index."""

    def __init__(self, root: Path, rank: int, *, orbax: bool = False) -> None:
        self.root = root
        self.rank = rank
        # Which of the root's step folders are this host's (Orbax's client's too, with
        # ``orbax``: its steps carry no manifest).
        self.own = OwnSteps(root, rank, orbax=orbax)
        self.replicas = root / REPLICA_DIR
        self._lock = threading.Lock()
        # (origin, step) -> (inode of the copy's folder, its files): a folder saved
        # again under the same number is a different folder, described anew.
        self._described: dict[tuple[int, int], tuple[tuple[int, int], list[FileMeta]]] = {}
        # Same key: (inode, (hosts that saved it, the run that wrote it)).
        self._summaries: dict[tuple[int, int], tuple[tuple[int, int], Summary]] = {}
        self.checksums = Checksums()  # of files read and checked, or written so
        self.proofs = HeldProofs(self.replicas)  # origins' signed entries of copies
        # Under mutual TLS (set by the node): identical bytes are taken only as signed
        # (claims.reclaim), never by size and CRC32C alone.
        self.signed_only = False
        self._damaged: set[tuple[int, int]] = set()  # copies with a quarantined file
        # Fences so far, and the steps of the newest ones (see :meth:`fence`): a copy
        # offered before a fence of a step below it is refused at its commit.
        self.fences = 0
        self._fenced: deque[int] = deque(maxlen=MAX_FENCES_KEPT)
        self.quarantined_total = 0
        self.on_quarantine: Callable[[], None] | None = None  # counts in metrics
        root.mkdir(parents=True, exist_ok=True)
        real_dir(self.replicas)
        for origin_dir in self.replicas.iterdir():
            if is_real_dir(origin_dir):
                clean_uncommitted(origin_dir)

    # -- paths --------------------------------------------------------------

    def copy_dir(self, origin: int, step: int) -> Path:
        """Where a copy lives. A host's own step is in its root, or in the replica
        area once restored for a client that must not see step folders in the root."""
        if origin == self.rank and self.own.owns(step):
            return self.root / str(step)
        return self.replicas / str(origin) / str(step)

    def _descriptor(self, origin: int, step: int) -> Path:
        return self.replicas / str(origin) / f"{step}.files.json"

    # -- inventory ----------------------------------------------------------

    def replica_steps(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        if not self.replicas.is_dir():
            return out
        for origin_dir in self.replicas.iterdir():
            if not origin_dir.name.isdigit() or not is_real_dir(origin_dir):
                continue
            steps = [s for s in layout.committed_steps(origin_dir)
                     if self._descriptor(int(origin_dir.name), s).is_file()]
            if steps:
                out[int(origin_dir.name)] = steps
        return out

    def copies(self) -> list[tuple[int, int]]:
        """Every (origin, step) held complete here, own steps included (less those
        with a file found bad and not yet repaired)."""
        held = {(self.rank, s) for s in self.own.steps()}
        held |= {(o, s) for o, steps in self.replica_steps().items() for s in steps}
        with self._lock:
            held -= self._damaged
        return sorted(held)

    def damaged(self, origin: int, step: int) -> bool:
        """Whether a file of this copy was quarantined and not repaired yet."""
        with self._lock:
            return (origin, step) in self._damaged

    # -- verification ---------------------------------------------------------

    def verify(self, origin: int, step: int, *, cached: bool = True) -> list[FileMeta]:
        """Check every file of a held copy against its description; quarantine
        the bad ones and return them (empty: the copy is good)."""
        files = self.describe(origin, step)
        base = os.fspath(self.copy_dir(origin, step))
        bad = []
        for f in files:
            why = self.checksums.check(f"{base}/{f.path}", f, cached=cached)
            if why is None:
                continue
            bad.append(f)
            if why != "missing":
                self.quarantine_file(Path(base) / f.path, why, origin=origin, step=step)
        with self._lock:
            if bad:
                self._damaged.add((origin, step))
            else:
                self._damaged.discard((origin, step))
        return bad

    def quarantine_file(self, path: Path, why: str, *, origin: int | None = None,
                        step: int | None = None) -> None:
        """Move a file that failed verification aside and count it; its copy (found
        from the path when not given) no longer counts as held. Every claim on the
        same bytes (another copy's link to this file: :func:`.claims.claim`) goes with it
        (:func:`~mtc.sidecar.storage.quarantine.quarantine`), and its copy is damaged too."""
        if origin is None or step is None:
            where = self.locate(path)
            if where is None:
                return
            origin, step = where
        links = links_of(self.root, path)  # found once: the move takes them along
        others = [(p, self.locate(p)) for p in links]
        moved = quarantine(self.root, path, f"rank {origin} step {step}: {why}", links)
        gone = [(p, w) for p, w in others if not os.path.lexists(p)]
        with self._lock:
            self._damaged.add((origin, step))
            self._damaged.update(w for _, w in gone if w is not None)
            if moved is not None:
                self.quarantined_total += 1 + len(gone)
        for p in [path, *(p for p, _ in gone)]:
            self.checksums.drop(p)
        if moved is not None and self.on_quarantine is not None:
            for _ in range(1 + len(gone)):
                self.on_quarantine()

    def locate(self, path: Path) -> tuple[int, int] | None:
        """(origin, step) of the copy a file under the root belongs to."""
        try:
            parts = path.relative_to(self.root).parts
        except ValueError:
            return None
        if parts and parts[0].isdigit():
            return self.rank, int(parts[0])
        if len(parts) > 2 and parts[0] == REPLICA_DIR and parts[1].isdigit() \
                and parts[2].isdigit():
            return int(parts[1]), int(parts[2])
        return None

    def verified_copies(self, origins: frozenset[int] | None = None, *,
                        damaged_own: list[tuple[int, list[FileMeta]]] | None = None
                        ) -> list[tuple[int, int, list[FileMeta]]]:
        """Every copy held here (of ``origins`` only, when given) whose files all
        check out, with its file list: what an inventory may offer. Bad files found
        on the way are quarantined, and put back from identical files held here
        where they can be (:func:`.claims.reclaim`). ``damaged_own``: appended to,
        in the same pass, with this host's own steps that stay damaged and their
        bad files (what a heal must bring from another host)."""
        out = []
        with self._lock:
            damaged = set(self._damaged)
        # Damaged copies too: one whose folder was replaced (a step saved again under
        # the same number) or repaired checks out again and counts again.
        held = set(self.copies()) | {(o, s) for o, s in damaged if self.copy_dir(o, s).is_dir()}
        for origin, step in sorted(held):
            if origins is not None and origin not in origins:
                continue
            try:
                files = self.describe(origin, step)
                bad = self.verify(origin, step)
                if bad and not claims.reclaim(self, origin, step, bad):
                    if origin == self.rank and damaged_own is not None:
                        damaged_own.append((step, bad))
                    continue
            except (OSError, ValueError, MtcError):
                continue
            out.append((origin, step, files))
        return out

    def repair(self, origin: int, step: int, fixed: dict[str, Path]) -> None:
        """Put verified files (``rel`` -> a file on this RAM disk) in the place of
        quarantined ones, then check the whole copy again."""
        base = self.copy_dir(origin, step)
        metas = {f.path: f for f in self.describe(origin, step)}
        for rel, src in fixed.items():
            dst = inside(base, rel)
            dst.parent.mkdir(parents=True, exist_ok=True)
            replace(src, dst)
            self.checksums.note_verified(dst, metas[rel])
        bad = self.verify(origin, step)
        if bad:
            raise CorruptShardError("copy still fails verification after repair", step=step,
                                    host=origin, path=bad[0].path)

    def describe(self, origin: int, step: int) -> list[FileMeta]:
        key = (origin, step)
        ino = _folder_key(self.copy_dir(origin, step))
        with self._lock:
            hit = self._described.get(key)
            if hit is not None and hit[0] == ino:
                return hit[1]
        if origin == self.rank and self.own.owns(step):
            files = describe_own(self.root / str(step))
            if not (self.root / str(step) / MANIFEST_NAME).is_file():
                for f in files:  # described by reading them: checked already
                    self.checksums.note_verified(self.root / str(step) / f.path, f)
            else:
                self.checksums.trust_written(self.root / str(step), files)
        else:
            raw = json.loads(self._descriptor(origin, step).read_text())
            files = [FileMeta(p, int(s), int(c)) for p, s, c in raw]
        with self._lock:
            self._described[key] = (ino, files)
        return files

    def saved_hosts(self, origin: int, step: int) -> int:
        """How many hosts saved this copy's step (see :meth:`summary`)."""
        return self.summary(origin, step)[0]

    def summary(self, origin: int, step: int) -> Summary:
        """How many hosts saved this copy's step and the run that wrote it, as its
        mtc manifest states (read once per folder); (0, "") when it states none
        (an Orbax step, an unreadable one)."""
        key = (origin, step)
        d = self.copy_dir(origin, step)
        ino = _folder_key(d)
        with self._lock:
            hit = self._summaries.get(key)
            if hit is not None and hit[0] == ino:
                return hit[1]
        try:
            found = Manifest.summary_of((d / MANIFEST_NAME).read_bytes())
        except (OSError, MtcError):
            found = Summary(0, "")
        with self._lock:
            self._summaries[key] = (ino, found)
        return found

    def fenced_since(self, fences: int, step: int) -> bool:
        """Whether a copy of ``step`` offered when :attr:`fences` was ``fences`` has
        been fenced off since (a push that was on its way when a restore was agreed)."""
        with self._lock:
            n = self.fences - fences
            since = list(self._fenced)[len(self._fenced) - n:] if n <= len(self._fenced) \
                else None
        return fencing.refused_at_commit(step, since if n > 0 else [])

    def fingerprint(self, origin: int, step: int) -> int:
        """CRC32C of a held copy's file list: the same for any copy of the same bytes
        (:func:`fingerprint_of`), another for a step saved again under its number."""
        return fingerprint_of(self.describe(origin, step))

    def same_copy(self, origin: int, step: int, files: Sequence[FileMeta]) -> bool:
        """Whether the copy held of (origin, step) has exactly these files (the same
        checkpoint, not an older one saved under the same number)."""
        try:
            held = self.describe(origin, step)
        except (OSError, ValueError):
            return False
        return sorted(held, key=lambda f: f.path) == sorted(files, key=lambda f: f.path)

    def fence(self, step: int) -> list[tuple[int, int]]:
        """Remove every copy held here of a step newer than ``step``, this host's own
        steps and its peers' alike: after a restore of ``step`` is agreed, a newer
        step can only be a save that did not finish on every host, and the job
        will save that number again; its bytes must never meet the new ones."""
        with self._lock:
            self.fences += 1
            self._fenced.append(step)
        held = {(self.rank, s) for s in self.own.steps()}
        held |= {(o, s) for o, steps in self.replica_steps().items() for s in steps}
        gone = fencing.to_fence(step, held)  # the rule: store/fence.py
        for origin, s in gone:
            self.remove_copy(origin, s)
        return gone

    # -- incoming copies ----------------------------------------------------

    def begin_incoming(self, origin: int, step: int) -> Path:
        real_dir(self.replicas)
        d = real_dir(self.replicas / str(origin))
        tmp = tmp_dir(d, step)
        tmp.mkdir()
        return tmp

    def commit_incoming(self, tmp: Path, origin: int, step: int, files: list[FileMeta],
                        proof: bytes = b"") -> None:
        """Publish a verified incoming copy, with ``proof`` (its origin's signed
        entry, written before the folder's rename; none: the copy is unproven)."""
        for f in files:
            p = inside(tmp, f.path)
            if not p.is_file() or p.stat().st_size != f.size:
                raise CorruptShardError("incoming copy is incomplete", step=step, host=origin,
                                        path=f.path)
        final = self.replicas / str(origin) / str(step)
        if os.path.lexists(final):
            if is_real_dir(final) and self.same_copy(origin, step, files) and \
                    self._good(origin, step):
                shutil.rmtree(tmp, ignore_errors=True)  # an earlier good copy; keep it
                if proof:  # with the proof it lacked (Offer sent it again for that)
                    write_atomic(proof_path(self.replicas, origin, step), proof)
                return
            # The copy held is an older checkpoint under the same number (the origin
            # saved the step again after a restore), failed verification (its bad
            # files quarantined: else the same damaged folder would be pushed to again
            # and again), or is not a folder: the verified one received takes its place.
            self._replace_held(origin, step)
        desc = self._descriptor(origin, step)
        write_atomic(desc, json.dumps([f.to_json() for f in files]))
        if proof:
            write_atomic(proof_path(self.replicas, origin, step), proof)
        else:
            proof_path(self.replicas, origin, step).unlink(missing_ok=True)
        publish(tmp, final)
        with self._lock:
            self._described[(origin, step)] = (_folder_key(final), files)
            self._damaged.discard((origin, step))
        for f in files:  # every file was verified on arrival
            self.checksums.note_verified(final / f.path, f)

    def _good(self, origin: int, step: int) -> bool:
        """Whether the held copy checks out now (read again, not from the cache)."""
        try:
            return not self.verify(origin, step, cached=False)
        except (OSError, ValueError, MtcError):
            return False

    def _replace_held(self, origin: int, step: int) -> None:
        """Remove a held copy (its folder, or whatever is in its place) to make room."""
        final = self.replicas / str(origin) / str(step)
        if os.path.islink(final) or not os.path.isdir(final):
            os.unlink(final)
        else:
            remove_step(self.replicas / str(origin), step)
        self._descriptor(origin, step).unlink(missing_ok=True)
        proof_path(self.replicas, origin, step).unlink(missing_ok=True)
        self.checksums.forget(final)
        with self._lock:
            self._described.pop((origin, step), None)
            self._summaries.pop((origin, step), None)

    def commit_restored(self, tmp: Path, step: int, files: list[FileMeta], *,
                        into_root: bool) -> None:
        """Publish this host's data of ``step`` fetched from peers."""
        if not files:  # a holder's listing without files: nothing to place
            raise CorruptShardError("the copy fetched lists no files", step=step,
                                    host=self.rank)
        if into_root:
            for f in files:
                p = inside(tmp, f.path)
                if not p.is_file() or p.stat().st_size != f.size:
                    raise CorruptShardError("restored copy is incomplete", step=step,
                                            host=self.rank, path=f.path)
            publish(tmp, self.root / str(step))
            with self._lock:
                self._described[(self.rank, step)] = (
                    _folder_key(self.root / str(step)), files)
                self._damaged.discard((self.rank, step))
            for f in files:
                self.checksums.note_verified(self.root / str(step) / f.path, f)
        else:
            self.commit_incoming(tmp, self.rank, step, files)

    def adopt_own(self, step: int) -> None:
        """Move an own step folder from the root into the replica area, described."""
        src = self.root / str(step)
        files = self.describe(self.rank, step)
        real_dir(self.replicas)
        d = real_dir(self.replicas / str(self.rank))
        if (d / str(step)).exists():
            remove_step(self.root, step)
            return
        desc = self._descriptor(self.rank, step)
        write_atomic(desc, json.dumps([f.to_json() for f in files]))
        publish(src, d / str(step))
        with self._lock:
            self._described[(self.rank, step)] = (_folder_key(d / str(step)), files)

    def remove_copy(self, origin: int, step: int) -> None:
        in_root = self.root / str(step)
        if origin == self.rank and in_root.is_symlink() and self.own.owns(step):
            in_root.unlink()  # a restored step: the link in the root, data in the replica area
        if origin == self.rank and self.own.owns(step):
            remove_step(self.root, step)
            self.checksums.forget(in_root)
        else:
            remove_step(self.replicas / str(origin), step)
            self._descriptor(origin, step).unlink(missing_ok=True)
            proof_path(self.replicas, origin, step).unlink(missing_ok=True)
            self.checksums.forget(self.replicas / str(origin) / str(step))
        with self._lock:
            self._described.pop((origin, step), None)
            self._summaries.pop((origin, step), None)
            self._damaged.discard((origin, step))


def _folder_key(folder: Path) -> tuple[int, int]:
    """What tells a step's folder from another that took its place: its inode and
    change time. A step saved again under its number is a new folder whose inode
    number the file system may hand out again (ext4 does at once, tmpfs seldom),
    renamed into place at another time."""
    st = os.stat(folder)
    return st.st_ino, st.st_ctime_ns
