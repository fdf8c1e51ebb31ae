"""Identical bytes held once per host: a peer's copy of bytes this host already
holds verified is a claim on them (a hard link: one inode for both names), not a
second file. Two slices' data-parallel shards are the common case: the same path
of the same step with the same size and CRC32C, which the manifests already
identify as the same content.

- :func:`find_identical`: per offered file, a file held here that may hold its bytes
  (an Offer's dedup candidates);
- :func:`claim`: hold a file's bytes as a claim on an identical file held here,
  checked first (a Link, a reclaim);
- :func:`reclaim`: put a damaged copy's missing files back as claims on a twin's
  identical files held here (before the copy is given up); under mutual TLS only
  where the twin's bytes hash as the copy's origin signed, never into an own step;
- :func:`fold`: make the files of a twin's copy that arrived before this host's own
  save of the same step claims on the own step's files (the other order of the
  two events a Link covers), so the bytes are held once whichever came first
  (under mutual TLS only own files that hash as the copy's origin signed).

Damage found through any name quarantines every name
(:meth:`LocalStore.quarantine_file`), so no copy keeps bytes another one was found
to have lost; each copy then heals from another host as any damaged copy does.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mtc.errors import CorruptShardError, UnsafePathError
from mtc.sidecar.replicator.store.step_files import FileMeta, inside
from mtc.sidecar.storage.checksum import copy_verified
from mtc.sidecar.storage.publish import replace

if TYPE_CHECKING:
    # store.py imports this module: the store is named by what claims use of it.
    from mtc.sidecar.replicator.store.holding import Holding as LocalStore

log = logging.getLogger(__name__)


def find_identical(store: LocalStore, metas: Sequence[FileMeta], step: int | None = None
                   ) -> dict[str, tuple[Path, bool]]:
    """Per offered file, a file held in ``store`` with the same size and CRC32C (a
    dedup candidate), and whether the manifests already say it is the same content:
    a file of the same path in an mtc copy of the same ``step`` (a data-parallel
    twin's shard), which needs no second hash to confirm it. One pass over what is
    held, whatever the number offered."""
    wanted = {(m.size, m.crc32c) for m in metas}
    held: dict[tuple[int, int], Path] = {}
    same: dict[tuple[str, int, int], Path] = {}
    for origin, s in store.copies():
        try:
            described = store.describe(origin, s)
            # Only an mtc step's manifest identifies its files (a shard's path names
            # its leaf and region, its CRC32C was taken as it was written); an
            # opaque step's (Orbax's) are confirmed by hash.
            manifested = s == step and store.summary(origin, s).num_hosts > 0
        except (OSError, ValueError):
            continue
        for f in described:
            key = (f.size, f.crc32c)
            if key not in wanted:
                continue
            held.setdefault(key, store.copy_dir(origin, s) / f.path)
            if manifested:
                same.setdefault((f.path, *key), store.copy_dir(origin, s) / f.path)
    out: dict[str, tuple[Path, bool]] = {}
    for m in metas:
        twin = same.get((m.path, m.size, m.crc32c))
        if twin is not None:
            out[m.path] = (twin, True)
        elif (m.size, m.crc32c) in held:
            out[m.path] = (held[(m.size, m.crc32c)], False)
    return out


def claim(store: LocalStore, src: Path, dst: Path, meta: FileMeta) -> None:
    """Hold ``meta``'s bytes at ``dst`` as a claim on ``src``, an identical file held
    in ``store``: one inode for both, no second copy of bytes this host holds.
    ``src`` is checked first (its checksum as remembered while unchanged); one that
    fails is quarantined with every claim on it and :class:`CorruptShardError`
    raised. The bytes stay while any claim does; damage found through any claim
    drops them all."""
    why = store.checksums.check(src, meta)
    if why is not None:
        if why != "missing":
            store.quarantine_file(src, why)
        raise CorruptShardError(f"the identical file held here fails: {why}",
                                path=meta.path)
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        # A file system without links here: a verified copy (a second copy of the
        # bytes, as before claims).
        copy_verified(src, dst, meta.size, meta.crc32c)
    store.checksums.note_verified(dst, meta)


def reclaim(store: LocalStore, origin: int, step: int, bad: list[FileMeta]) -> bool:
    """Put the bad (quarantined or missing) files of a copy held in ``store`` back as
    claims on identical files held there, verified: the same path of another mtc
    copy of the same step (a data-parallel twin's shard: its manifest says it is
    the same content). True when the copy checks out again; False, leaving it
    damaged, when some file has no such twin here."""
    found = find_identical(store, bad, step)
    base = store.copy_dir(origin, step)
    if not all(f.path in found and found[f.path][1] for f in bad):
        return False
    if store.signed_only and not _as_signed(store, origin, step, bad, found):
        return False
    for f in bad:
        dst = inside(base, f.path)
        if os.path.lexists(dst):
            return False  # a bad file not moved aside: left to a heal from a peer
        # Folders made beneath the copy's only: a copy removed meanwhile (the
        # sidecar's retention) fails here and is never made again, half.
        for d in reversed(dst.relative_to(base).parents[:-1]):
            (base / d).mkdir(exist_ok=True)
        claim(store, found[f.path][0], dst, f)
    log.info("rank %d: %d file(s) of rank %d step %d put back from identical files "
             "held here (%s, ...)", store.rank, len(bad), origin, step, bad[0].path)
    return not store.verify(origin, step)


def _as_signed(store: LocalStore, origin: int, step: int, bad: list[FileMeta],
               found: dict[str, tuple[Path, bool]]) -> bool:
    """Under mutual TLS, whether each twin file ``found`` for ``bad`` (or, folding,
    this host's own file) holds the bytes ``origin`` signed for that path. A
    twin's own proof says only that its origin made it, and size and CRC32C are
    what a forger matches at will, so its SHA-256 must be the one kept with this
    copy (``<step>.proof``, checked at its Offer). An own step keeps no signed
    list here: it is healed from another host instead, checked against this
    rank's signature (:meth:`.materialize.Materializer`)."""
    if origin == store.rank:
        return False
    entry = store.proofs.of(origin, step, store.copy_dir(origin, step))
    signed = {(f.path, f.size, f.crc32c): bytes(f.sha256)
              for f in (entry.files if entry is not None else ()) if len(f.sha256) == 32}
    try:
        return all((sha := signed.get((f.path, f.size, f.crc32c))) is not None
                   and store.checksums.sha256(found[f.path][0]) == sha for f in bad)
    except OSError:
        return False  # gone meanwhile: left to a heal from a peer


def fold(store: LocalStore, step: int, origins: Sequence[int] | None = None) -> int:
    """Make the files of mtc copies of ``step`` held here (of ``origins``, else every
    other host's) that are identical to this host's own files of ``step`` (the same
    path, size and CRC32C: a data-parallel twin's shard) claims on the own files.
    An Offer links a twin's copy to the own step when the own step was committed
    first; when the twin's copy came first (its slice saved and pushed sooner),
    this holds the bytes once all the same. Called as the own step is first seen
    and as a copy is committed, so either order ends with one copy of the bytes.
    Returns how many files were folded. A file that fails its check is left as it
    is (the verifications that find it quarantine it)."""
    held = store.copies()
    if (store.rank, step) not in held:
        return 0  # not committed, or damaged
    try:
        if store.summary(store.rank, step).num_hosts == 0:
            return 0  # an opaque step (Orbax's): its manifest names no content
        own = {f.path: f for f in store.describe(store.rank, step)}
    except (OSError, ValueError):
        return 0  # removed meanwhile
    own_dir = store.copy_dir(store.rank, step)
    own_inodes = _inodes(own_dir)
    folded = 0
    for origin, s in held:
        if s != step or origin == store.rank or (origins is not None and origin not in origins):
            continue
        try:
            if store.summary(origin, s).num_hosts == 0:
                continue
            described = store.describe(origin, s)
            base = store.copy_dir(origin, s)
            folder = os.lstat(base).st_ino
        except (OSError, ValueError):
            continue
        # Files already one (a Link, an earlier fold: after the first call, all of
        # them) are told apart by one listing of each folder; only the rest are
        # looked at one by one.
        held_inodes = _inodes(base)
        same = [f for f in described if (mine := own.get(f.path)) is not None
                and (mine.size, mine.crc32c) == (f.size, f.crc32c)
                and not _one_file(own_inodes, held_inodes, f.path)]
        if same and store.signed_only:  # only own bytes that hash as the copy's origin signed
            same = [f for f in same
                    if _as_signed(store, origin, s, [f], {f.path: (own_dir / f.path, True)})]
        if same:
            folded += _fold_copy(store, own_dir, base, folder, origin, step, same)
    if folded:
        log.info("rank %d: %d file(s) of copies of step %d now held once, as claims on "
                 "this host's own identical files", store.rank, folded, step)
    return folded


def _inodes(folder: Path) -> dict[str, int]:
    """The inode of each regular file directly in ``folder``, from one listing (the
    directory entries carry them); links and folders are left out."""
    try:
        with os.scandir(folder) as entries:
            return {e.name: e.inode() for e in entries if e.is_file(follow_symlinks=False)}
    except OSError:
        return {}


def _one_file(own: dict[str, int], held: dict[str, int], path: str) -> bool:
    """Whether ``path`` names one inode in both listings (already one file). A path
    in a subfolder is not in either listing: the one-by-one check decides it. A
    wrong yes could only keep two copies of the bytes, never fold other bytes."""
    ino = own.get(path)
    return ino is not None and held.get(path) == ino


def _fold_copy(store: LocalStore, own_dir: Path, base: Path, folder: int, origin: int,
               step: int, same: list[FileMeta]) -> int:
    scratch: Path | None = None  # made for the first file to fold: most calls find none
    folded = 0
    try:
        for k, f in enumerate(same):
            try:
                dst, src = inside(base, f.path), inside(own_dir, f.path)
                if os.path.samefile(src, dst):
                    continue  # already one (a Link, or an earlier fold)
                if store.checksums.check(src, f) is not None:
                    continue
                if scratch is None:  # same file system; cleaned at a start
                    scratch = store.begin_incoming(origin, step)
                tmp = scratch / str(k)
                os.link(src, tmp, follow_symlinks=False)
                # The copy's folder is the one described (not replaced by a newer
                # copy under the number since): only then its file is taken over.
                if os.lstat(base).st_ino != folder:
                    return folded
                replace(tmp, dst)
            except UnsafePathError:
                continue  # a path through a link: never followed, never folded
            except OSError as e:
                if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    return folded  # no links here: two copies of the bytes, as before
                continue  # gone meanwhile (retention, a quarantine): nothing to fold
            store.checksums.note_verified(dst, f)
            folded += 1
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return folded
