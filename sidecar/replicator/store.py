"""What a replicator holds on its RAM disk: its host's steps and peers' copies.

Layout under the host's root (the RAM disk):

- ``<step>/``                                  the host's own committed steps (mtc or
                                              Orbax: opaque file trees to the replicator)
- ``.mtc-replica/<origin>/<step>/``            a verified copy of rank ``origin``'s step
- ``.mtc-replica/<origin>/<step>.files.json``  its file list (path, size, CRC32C)
- ``.mtc-replica/<origin>/<step>.mtc-tmp-*/``  a copy being received

A peer copy is committed like a step: its file list is written, then its folder
renamed into place; only then does it count. Committed folders never change, so
their descriptions are computed once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from mtc import layout
from mtc.errors import CorruptShardError, FatalError
from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME, Manifest

REPLICA_DIR = ".mtc-replica"
CHUNK = 4 << 20


class UnsafePathError(FatalError):
    """A path in a request would leave the replicator's root."""


@dataclasses.dataclass(frozen=True)
class FileMeta:
    path: str
    size: int
    crc32c: int

    def to_json(self) -> list[object]:
        return [self.path, self.size, self.crc32c]


def safe_relpath(path: str) -> str:
    """Validate a '/'-separated relative path from a request."""
    if not path or "\x00" in path or path.startswith("/") or "\\" in path:
        raise UnsafePathError(f"refusing path {path!r}")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"refusing path {path!r}")
    return path


def inside(base: Path, rel: str) -> Path:
    """``base/rel``, refusing anything (symlinks included) that resolves outside ``base``."""
    target = base / safe_relpath(rel)
    real_base = os.path.realpath(base)
    real = os.path.realpath(target)
    if os.path.commonpath([real_base, real]) != real_base:
        raise UnsafePathError(f"path {rel!r} escapes {base}")
    return target


def file_crc(path: Path) -> int:
    value = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            value = crc32c(view[:n], value)
    return value


def file_sha256(path: Path) -> hashlib._Hash:
    """SHA-256 of a file: the proof that two files with equal CRC32C are the same bytes."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h


def _walk(step_dir: Path) -> list[FileMeta]:
    out = []
    for dirpath, _, names in os.walk(step_dir):
        for n in sorted(names):
            p = Path(dirpath) / n
            if p.is_symlink():
                continue  # never follow links out of a step
            rel = p.relative_to(step_dir).as_posix()
            out.append(FileMeta(rel, p.stat().st_size, file_crc(p)))
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


class LocalStore:
    """The host's own steps and the peer copies it keeps, with a content index."""

    def __init__(self, root: Path, rank: int) -> None:
        self.root = root
        self.rank = rank
        self.replicas = root / REPLICA_DIR
        self._lock = threading.Lock()
        self._described: dict[tuple[int, int], list[FileMeta]] = {}
        root.mkdir(parents=True, exist_ok=True)
        self.replicas.mkdir(exist_ok=True)
        for origin_dir in self.replicas.iterdir():
            if origin_dir.is_dir():
                layout.clean_uncommitted(origin_dir)

    # -- paths --------------------------------------------------------------

    def copy_dir(self, origin: int, step: int) -> Path:
        """Where a copy lives. A host's own step is in its root, or in the replica
        area once restored for a client that must not see step folders in the root."""
        if origin == self.rank and (self.root / str(step)).is_dir():
            return self.root / str(step)
        return self.replicas / str(origin) / str(step)

    def _descriptor(self, origin: int, step: int) -> Path:
        return self.replicas / str(origin) / f"{step}.files.json"

    # -- inventory ----------------------------------------------------------

    def own_steps(self) -> list[int]:
        return layout.committed_steps(self.root)

    def replica_steps(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        if not self.replicas.is_dir():
            return out
        for origin_dir in self.replicas.iterdir():
            if not origin_dir.name.isdigit():
                continue
            steps = [s for s in layout.committed_steps(origin_dir)
                     if self._descriptor(int(origin_dir.name), s).is_file()]
            if steps:
                out[int(origin_dir.name)] = steps
        return out

    def copies(self) -> list[tuple[int, int]]:
        """Every (origin, step) held complete here, own steps included."""
        held = {(self.rank, s) for s in self.own_steps()}
        held |= {(o, s) for o, steps in self.replica_steps().items() for s in steps}
        return sorted(held)

    def describe(self, origin: int, step: int) -> list[FileMeta]:
        key = (origin, step)
        with self._lock:
            if key in self._described:
                return self._described[key]
        if origin == self.rank and (self.root / str(step)).is_dir():
            files = describe_own(self.root / str(step))
        else:
            raw = json.loads(self._descriptor(origin, step).read_text())
            files = [FileMeta(p, int(s), int(c)) for p, s, c in raw]
        with self._lock:
            self._described[key] = files
        return files

    def find_identical(self, metas: Sequence[FileMeta]) -> dict[str, Path]:
        """Per offered file, a file held here with the same size and CRC32C (a dedup
        candidate): one pass over what is held, whatever the number offered."""
        wanted = {(m.size, m.crc32c) for m in metas}
        held: dict[tuple[int, int], Path] = {}
        for origin, step in self.copies():
            try:
                files = self.describe(origin, step)
            except (OSError, ValueError):
                continue
            for f in files:
                key = (f.size, f.crc32c)
                if key in wanted and key not in held:
                    held[key] = self.copy_dir(origin, step) / f.path
        return {m.path: held[(m.size, m.crc32c)] for m in metas if (m.size, m.crc32c) in held}

    # -- incoming copies ----------------------------------------------------

    def begin_incoming(self, origin: int, step: int) -> Path:
        d = self.replicas / str(origin)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{step}{layout.TMP_MARK}{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        return tmp

    def commit_incoming(self, tmp: Path, origin: int, step: int, files: list[FileMeta]) -> None:
        for f in files:
            p = inside(tmp, f.path)
            if not p.is_file() or p.stat().st_size != f.size:
                raise CorruptShardError("incoming copy is incomplete", step=step, host=origin,
                                        path=str(p))
        final = self.replicas / str(origin) / str(step)
        if final.exists():  # an earlier identical copy; keep it
            shutil.rmtree(tmp, ignore_errors=True)
            return
        desc = self._descriptor(origin, step)
        tmp_desc = desc.with_suffix(".tmp")
        tmp_desc.write_text(json.dumps([f.to_json() for f in files]))
        os.replace(tmp_desc, desc)
        os.rename(tmp, final)
        with self._lock:
            self._described[(origin, step)] = files

    def commit_restored(self, tmp: Path, step: int, files: list[FileMeta], *,
                        into_root: bool) -> None:
        """Publish this host's data of ``step`` fetched from peers."""
        if into_root:
            for f in files:
                p = inside(tmp, f.path)
                if not p.is_file() or p.stat().st_size != f.size:
                    raise CorruptShardError("restored copy is incomplete", step=step,
                                            host=self.rank, path=str(p))
            layout.commit(tmp, self.root / str(step))
            with self._lock:
                self._described[(self.rank, step)] = files
        else:
            self.commit_incoming(tmp, self.rank, step, files)

    def adopt_own(self, step: int) -> None:
        """Move an own step folder from the root into the replica area, described."""
        src = self.root / str(step)
        files = self.describe(self.rank, step)
        d = self.replicas / str(self.rank)
        d.mkdir(parents=True, exist_ok=True)
        if (d / str(step)).exists():
            layout.remove_step(self.root, step)
            return
        desc = self._descriptor(self.rank, step)
        desc.with_suffix(".tmp").write_text(json.dumps([f.to_json() for f in files]))
        os.replace(desc.with_suffix(".tmp"), desc)
        os.rename(src, d / str(step))
        with self._lock:
            self._described[(self.rank, step)] = files

    def remove_copy(self, origin: int, step: int) -> None:
        in_root = self.root / str(step)
        if origin == self.rank and in_root.is_symlink():
            in_root.unlink()  # a restored step: the link in the root, data in the replica area
        if origin == self.rank and in_root.is_dir():
            layout.remove_step(self.root, step)
        else:
            layout.remove_step(self.replicas / str(origin), step)
            self._descriptor(origin, step).unlink(missing_ok=True)
        with self._lock:
            self._described.pop((origin, step), None)
