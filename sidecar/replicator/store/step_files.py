"""A step's files as replicators name and check them: a relative path checked before
any I/O, a size and a CRC32C (:class:`FileMeta`), and the list of a committed step's
files (from its manifest for an mtc step, by reading them for an opaque one)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from mtc import validate
from mtc.errors import FatalError, MtcError, UnsafePathError
from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME, Manifest
from mtc.pool import ThreadPool
from mtc.sidecar.storage.checksum import file_crc


@dataclasses.dataclass(frozen=True)
class FileMeta:
    path: str
    size: int
    crc32c: int

    def to_json(self) -> list[object]:
        return [self.path, self.size, self.crc32c]


def safe_relpath(path: str) -> str:
    """Validate a '/'-separated relative path from a request (:func:`mtc.validate.relpath`)."""
    return validate.relpath(path)


def inside(base: Path, rel: str) -> Path:
    """``base/rel``, refusing anything (symlinks included) that resolves outside ``base``.

    ``rel`` is checked to have no ``..`` or empty part first, so only a symlink
    among its own parts can lead out: those few are looked at (``lstat``), and the
    whole path is resolved only when one is a link. Resolving every path (a
    step's few hundred files, each some ten folders deep) was a third of a
    replicator's CPU after each save."""
    target = base / safe_relpath(rel)
    path = os.fspath(base)
    for part in rel.split("/"):
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return target  # nothing below exists yet: nothing to follow
        except OSError:
            break  # unreadable: resolve it all, as below
        if not stat.S_ISDIR(st.st_mode):
            if stat.S_ISLNK(st.st_mode):
                break
            return target  # a file ends the walk (a part below it cannot exist)
    else:
        return target
    real_base = os.path.realpath(base)
    real = os.path.realpath(target)
    if os.path.commonpath([real_base, real]) != real_base:
        raise UnsafePathError(f"path {rel!r} escapes {base}")
    return target


def fingerprint_of(files: Sequence[FileMeta]) -> int:
    """CRC32C of a file list, in path order: identifies a copy's bytes."""
    text = json.dumps(sorted(f.to_json() for f in files), separators=(",", ":"))
    return crc32c(text.encode())


WALK_THREADS = 4  # an opaque step's files are checksummed this many at a time


def _walk(step_dir: Path) -> list[FileMeta]:
    """An opaque step's files, each read once for its CRC32C: a few at a time (the
    checksum runs outside the GIL), on threads this call starts and joins."""
    paths = []
    for dirpath, _, names in os.walk(step_dir):
        for n in sorted(names):
            p = Path(dirpath) / n
            if p.is_symlink():
                continue  # never follow links out of a step
            paths.append(p)

    def meta(p: Path) -> FileMeta:
        return FileMeta(p.relative_to(step_dir).as_posix(), p.stat().st_size, file_crc(p)[1])

    if len(paths) < 2:
        out = [meta(p) for p in paths]
    else:
        with ThreadPool(min(WALK_THREADS, len(paths)), "mtc-describe", lazy=True) as pool:
            out = list(pool.map(meta, paths))
    return sorted(out, key=lambda m: m.path)


def describe_own(step_dir: Path) -> list[FileMeta]:
    """File list of a committed step; mtc steps take sizes and CRCs from their manifest."""
    manifest = step_dir / MANIFEST_NAME
    if manifest.is_file():
        data = manifest.read_bytes()
        try:
            m = Manifest.from_bytes(data, path=str(manifest))
        except FatalError:
            return _walk(step_dir)
        files = [FileMeta(e.file, e.nbytes, e.crc32c) for e in m.files.values()]
        files.append(FileMeta(MANIFEST_NAME, len(data), crc32c(data)))
        return sorted(files, key=lambda f: f.path)
    return _walk(step_dir)


def not_ours(manifest: bytes | None, path: str, rank: int, step: int, *,
             orbax: bool) -> str | None:
    """Why the step folder ``<root>/<step>`` of rank ``rank``'s RAM disk, whose
    manifest is ``manifest`` (None: it has none), is not this rank's step; None when
    it is. An mtc step is the rank's when its manifest names that rank's host and
    that step; a manifest that cannot be read cannot say whose the step is. A folder
    without a manifest (Orbax's) is the rank's only for a replicator serving Orbax's
    client (``orbax``), as that client has it; beside mtc it is not mtc's."""
    if manifest is None:
        return None if orbax else "it has no mtc manifest (not written by mtc)"
    try:
        m = Manifest.from_bytes(manifest, path=path)
    except MtcError as e:
        return f"its manifest is unreadable ({e})"
    # Host h of a job is rank h, unless its manifests name the ranks (a job that
    # came back on other hosts: host 0 of 2 on rank 2).
    if (m.rank_of(m.host), m.step) != (rank, step):
        return (f"its manifest is host {m.host}'s step {m.step}"
                + (f" (rank {m.rank_of(m.host)})" if m.ranks else ""))
    return None
