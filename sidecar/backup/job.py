"""Backing up a step: planning across hosts, parallel uploads, commit, retention.

Layout under the backup URL::

    steps/<step>/MANIFEST.json           written last: the step exists once it is there
    steps/<step>/data/<rank>/<path>      files, each unique content uploaded once
    staging/<step>-<nonce>/...           the same, before an atomic rename (HNS, local)

The leader (the lowest-ranked reachable node) plans a step: every rank's files,
grouped by (size, CRC32C); each rank's files are read by the least-loaded host
holding them, so uploads spread over hosts; each group is uploaded once, and
every other member is confirmed identical by SHA-256 (a member that differs is
uploaded too). The manifest maps each rank's paths to objects. On a store with
atomic folder renames the step is uploaded to a staging folder and published in
one rename; elsewhere the manifest, written last, is the commit.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mtc.errors import HolderIdle as HolderIdle
from mtc.errors import ManifestError, MtcError
from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.backend import Backend, CorruptBackupError
from mtc.sidecar.replicator.store.step_files import FileMeta, safe_relpath
from mtc.sidecar.storage.checksum import file_sha256

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
FORMAT = "mtc-backup"
VERSION = 1


def step_prefix(step: int) -> str:
    return f"steps/{step}"


@dataclasses.dataclass(frozen=True)
class BackupEntry:
    path: str
    size: int
    crc32c: int
    sha256: str
    object: str  # key relative to the step's folder

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class BackupStore:
    """Committed backups in a backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def committed_steps(self) -> list[int]:
        steps = []
        for key in self.backend.list("steps/"):
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == MANIFEST and parts[1].isdigit():
                steps.append(int(parts[1]))
        return sorted(steps)

    def manifest(self, step: int) -> dict[int, list[BackupEntry]]:
        raw = self.backend.get_bytes(f"{step_prefix(step)}/{MANIFEST}")
        if raw is None:
            raise ManifestError("no backup of this step", step=step)
        try:
            d = json.loads(raw)
            if not isinstance(d, dict):
                raise ValueError("not an object")
            if d.get("format") != FORMAT or d.get("version") != VERSION:
                raise ManifestError(f"unsupported backup manifest {d.get('format')} "
                                    f"v{d.get('version')}", step=step)
            return {int(r): [_entry(e) for e in entries]
                    for r, entries in d["ranks"].items()}
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ManifestError(f"malformed backup manifest: {e!r}"[:500], step=step) from e

    def write_manifest(self, prefix: str, step: int,
                       ranks: dict[int, list[BackupEntry]]) -> None:
        body = {"format": FORMAT, "version": VERSION, "step": step, "created": time.time(),
                "ranks": {str(r): [e.to_json() for e in es] for r, es in sorted(ranks.items())}}
        self.backend.put_bytes(f"{prefix}/{MANIFEST}", json.dumps(body).encode())

    def apply_retention(self, keep: int, every: int) -> list[int]:
        """Keep the newest ``keep`` backups and every ``every``-th step; returns deleted."""
        steps = self.committed_steps()
        kept = set(steps[-keep:] if keep > 0 else []) | {s for s in steps
                                                         if every and s % every == 0}
        deleted = [s for s in steps[:-1] if s not in kept]  # never the newest
        for s in deleted:
            # The manifest first: a half-deleted step must not look committed.
            self.backend.delete_prefix(f"{step_prefix(s)}/{MANIFEST}")
            self.backend.delete_prefix(f"{step_prefix(s)}/")
        return deleted

    def clean_leftovers(self, busy: set[str]) -> list[str]:
        """Remove staging folders and uncommitted step folders of interrupted uploads."""
        committed = {step_prefix(s) for s in self.committed_steps()}
        prefixes: set[str] = set()
        for key in self.backend.list("staging/"):
            prefixes.add("/".join(key.split("/")[:2]))
        for key in self.backend.list("steps/"):
            prefixes.add("/".join(key.split("/")[:2]))
        stale = sorted(p for p in prefixes - committed if p not in busy)
        for p in stale:
            self.backend.delete_prefix(p + "/")
        return stale


def _entry(e: Any) -> BackupEntry:
    """One manifest entry, checked: paths and object keys stay inside their folders."""
    if not isinstance(e, dict) or set(e) != {f.name for f in dataclasses.fields(BackupEntry)}:
        raise ValueError(f"bad entry {e!r}"[:200])
    size, crc = e["size"], e["crc32c"]
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (size, crc)) \
            or size < 0 or not 0 <= crc < 2**32:
        raise ValueError(f"bad size or crc32c in {e!r}"[:200])
    if not isinstance(e["sha256"], str) or not isinstance(e["object"], str):
        raise ValueError(f"bad entry {e!r}"[:200])
    return BackupEntry(safe_relpath(e["path"]), size, crc, e["sha256"],
                       safe_relpath(e["object"]))


def upload_part(backend: Backend, step_dir: Path, files: dict[str, FileMeta],
                req: pb.BackupPartRequest) -> pb.BackupPartReply:
    """Node side: upload and hash the files the leader assigned."""
    reply = pb.BackupPartReply()

    def one(rel: str, upload: bool) -> tuple[str, bytes, bool]:
        meta = files.get(safe_relpath(rel))
        if meta is None:
            raise ManifestError(f"{rel} is not part of rank {req.origin_rank}'s step",
                                step=req.step)
        local = step_dir / rel
        if upload:
            backend.put_file(local, f"{req.prefix}/data/{req.origin_rank}/{rel}",
                             size=meta.size, crc32c=meta.crc32c)
        return rel, file_sha256(local), upload

    jobs = [(p, True) for p in req.upload] + [(p, False) for p in req.hash]
    with ThreadPool(4, "mtc-backup", lazy=True) as pool:
        for rel, digest, uploaded in pool.map(lambda j: one(*j), jobs):
            reply.entries.add(path=rel, sha256=digest, uploaded=uploaded)
    return reply


Caller = Callable[[int, pb.BackupPartRequest], pb.BackupPartReply]


def back_up_step(store: BackupStore, step: int,
                 sources: dict[int, list[tuple[int, int, list[FileMeta]]]],
                 call: Caller, *, proven: Mapping[tuple[int, str], str] | None = None) -> None:
    """Leader side. ``sources[r]``: (holder, origin, files) copies of rank r's data;
    ``call(holder, request)`` runs a part on that node. ``proven``: the SHA-256
    (hex) the origin signed of a file (origin, path): a holder's upload that
    hashes otherwise is another rank's bytes forged, and nothing is committed."""
    atomic = store.backend.can_publish()
    prefix = f"staging/{step}-{uuid.uuid4().hex[:8]}" if atomic else step_prefix(step)
    # Group every rank's files by content key; the first copy of each group uploads.
    groups: dict[tuple[int, int], list[tuple[int, str]]] = defaultdict(list)
    chosen: dict[int, tuple[int, int, dict[str, FileMeta]]] = {}
    load: dict[int, int] = defaultdict(int)  # bytes each holder was given to read

    def least_loaded(rank: int, copies: list[tuple[int, int, list[FileMeta]]]
                     ) -> tuple[int, int, list[FileMeta]]:
        """The least-loaded holder reads a rank's files (its own host on a tie), so
        the uploads spread over the hosts."""
        return min(copies, key=lambda c: (load[c[0]], c[0] != rank, c[0]))

    for rank, copies in sorted(sources.items()):
        holder, origin, files = least_loaded(rank, copies)
        load[holder] += sum(f.size for f in files)
        chosen[rank] = (holder, origin, {f.path: f for f in files})
        for f in files:
            groups[(f.size, f.crc32c)].append((rank, f.path))
    upload: dict[tuple[int, int], list[str]] = defaultdict(list)
    hashing: dict[tuple[int, int], list[str]] = defaultdict(list)
    for members in groups.values():
        first_rank, first_path = members[0]
        holder, origin, _ = chosen[first_rank]
        upload[(holder, origin)].append(first_path)
        for rank, path in members[1:]:
            h, o, _ = chosen[rank]
            hashing[(h, o)].append(path)

    def run(parts: dict[tuple[int, int], tuple[list[str], list[str]]]
            ) -> dict[tuple[int, int], pb.BackupPartReply]:
        with ThreadPool(max(1, len(parts)), "mtc-backup-parts", lazy=True) as pool:
            futs = {key: pool.submit(call, key[0], pb.BackupPartRequest(
                step=step, origin_rank=key[1], prefix=prefix, upload=up, hash=hs))
                for key, (up, hs) in parts.items()}
            return {key: f.result() for key, f in futs.items()}

    keys = set(upload) | set(hashing)
    replies = run({k: (upload.get(k, []), hashing.get(k, [])) for k in keys})
    digests = {(k[1], e.path): (e.sha256.hex(), e.uploaded) for k, r in replies.items()
               for e in r.entries}
    check_proven(digests, proven or {}, {o: h for h, o in keys}, step)
    entries: dict[int, list[BackupEntry]] = {}
    redo: dict[tuple[int, int], tuple[list[str], list[str]]] = {}
    for members in groups.values():
        first_rank, first_path = members[0]
        _, first_origin, _ = chosen[first_rank]
        obj_sha = digests[(first_origin, first_path)][0]
        for rank, path in members:
            holder, origin, by_path = chosen[rank]
            sha = digests[(origin, path)][0]
            f = by_path[path]
            if sha == obj_sha:
                obj = f"data/{first_origin}/{first_path}"
            else:  # same size and CRC32C, different bytes: upload it as well
                redo.setdefault((holder, origin), ([], []))[0].append(path)
                obj = f"data/{origin}/{path}"
            entries.setdefault(rank, []).append(BackupEntry(path, f.size, f.crc32c, sha, obj))
    if redo:
        run(redo)
    # Every object the manifest names must be there before it is written: a rival
    # leader's clean-up, or a store that lost a write, must not yield a committed step
    # with holes.
    present = set(store.backend.list(f"{prefix}/data/"))
    missing = sorted({e.object for es in entries.values() for e in es} -
                     {k[len(prefix) + 1:] for k in present})
    if missing:
        raise MtcError(f"{len(missing)} uploaded objects are missing before the commit, "
                       f"e.g. {missing[0]}", step=step)
    store.write_manifest(prefix, step, entries)
    if atomic and not store.backend.publish(prefix, step_prefix(step)):
        raise MtcError("backup store refused the atomic publish", step=step)
    log.info("backed up step %d: %d objects for %d ranks", step, len(groups), len(entries))


def check_proven(digests: Mapping[tuple[int, str], tuple[str, bool]],
                 proven: Mapping[tuple[int, str], str], holder_of: Mapping[int, int],
                 step: int) -> None:
    """Every file hashed by a holder whose origin signed its SHA-256 hashes so:
    else :class:`CorruptBackupError` naming the holder (a holder may upload
    another rank's data, never make it up)."""
    for (origin, path), (sha, _) in sorted(digests.items()):
        want = proven.get((origin, path))
        if want is not None and sha != want:
            raise CorruptBackupError(
                f"the upload of rank {origin}'s file differs from the SHA-256 its origin "
                f"signed: not committed", step=step, host=holder_of.get(origin, origin),
                path=path)


@dataclasses.dataclass
class Shared:
    """Restoring from the backup on several hosts at once: who reads which object.

    ``downloader[object]`` is the host that reads a shared object from the store;
    the others get it from that host (``fetch(holder, holder_path, local)``), so
    each object crosses from the bucket once. ``ready`` lists the files this
    host has verified, which its replicator serves to the others meanwhile.
    """

    downloader: dict[str, tuple[int, str]]
    fetch: Callable[[int, str, Path, BackupEntry], None]
    ready: set[str] = dataclasses.field(default_factory=set)
    wait_s: float = 60.0      # for a holder that is restoring
    idle_wait_s: float = 3.0  # for one that has not started, or gave up


def plan_shared(manifest: dict[int, list[BackupEntry]], restoring: list[int]
                ) -> dict[str, tuple[int, str]]:
    """object -> (lowest restoring rank that needs it, its path there)."""
    out: dict[str, tuple[int, str]] = {}
    for r in sorted(restoring):
        for e in manifest.get(r, []):
            out.setdefault(e.object, (r, e.path))
    return out


def download_rank(store: BackupStore, step: int, rank: int, dest: Path,
                  ranks: list[int], shared: Shared | None = None,
                  on_bytes: Callable[[int], None] | None = None) -> list[FileMeta]:
    """Fetch one rank's files of a backed-up step into ``dest`` (first of ``ranks``
    present in the manifest: Orbax peers can stand in for each other). Every file
    is checked against the manifest's size, CRC32C and SHA-256."""
    manifest = store.manifest(step)
    entries = next((manifest[r] for r in ranks if r in manifest), None)
    if entries is None:
        raise ManifestError(f"backup has no data for rank {rank}", step=step, host=rank)

    def verify(local: Path, e: BackupEntry) -> None:
        if file_sha256(local).hex() != e.sha256:
            local.unlink(missing_ok=True)
            raise CorruptBackupError("object differs from its manifest's SHA-256",
                                     step=step, host=rank, path=e.object)

    def from_store(e: BackupEntry, local: Path) -> None:
        store.backend.get_file(f"{step_prefix(step)}/{e.object}", local, size=e.size,
                               crc32c=e.crc32c)
        verify(local, e)
        if on_bytes:
            on_bytes(e.size)

    def one(e: BackupEntry) -> None:
        local = dest / safe_relpath(e.path)
        local.parent.mkdir(parents=True, exist_ok=True)
        holder = shared.downloader.get(e.object) if shared else None
        if shared is not None and holder is not None and holder[0] != rank:
            start = time.monotonic()
            while True:  # the holder may not have read it yet
                try:
                    shared.fetch(holder[0], holder[1], local, e)
                    verify(local, e)
                    break
                except MtcError as err:
                    waited = time.monotonic() - start
                    limit = shared.idle_wait_s if isinstance(err, HolderIdle) else shared.wait_s
                    if waited > limit:
                        log.warning("rank %d: %s not had from rank %d (%s); reading the "
                                    "store", rank, e.path, holder[0], err)
                        from_store(e, local)
                        break
                    time.sleep(0.2)
        else:
            from_store(e, local)
        if shared is not None:
            shared.ready.add(e.path)

    # Own objects first, so the hosts waiting for them are served early.
    mine_first = sorted(entries, key=lambda e: shared is not None and
                        shared.downloader.get(e.object, (rank, ""))[0] != rank)
    with ThreadPool(8, "mtc-restore", lazy=True) as pool:
        list(pool.map(one, mine_first))
    return [FileMeta(e.path, e.size, e.crc32c) for e in entries]
