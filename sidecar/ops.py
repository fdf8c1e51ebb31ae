"""The host side of every host operation but stage/wait/load: the only code that
lists, reads, renames or deletes anything under a RAM disk on the controller's behalf.

The controller never touches a RAM disk; it sends a request (``mtc.contract``)
through its dispatcher, and whichever process runs on the host (this process for
multi-controller JAX, a colocated-Python sidecar on Pathways) answers it here.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mtc import layout, operations, retention, root_lock
from mtc.contract import (
    AgentConfig,
    Raw,
    decode_request,
    encode_error,
    encode_reply,
    task_from_json,
    typed_error,
)
from mtc.errors import (
    LocalDirError,
    ManifestError,
    MtcError,
    ProtocolError,
    StepNotFoundError,
)
from mtc.manifest import MANIFEST_NAME, Manifest, Summary
from mtc.operations import Side
from mtc.sidecar.restore.load import Remote, ShardLoader, check_tasks
from mtc.sidecar.save.write import WRITER_RESERVE_DIR
from mtc.sidecar.storage import spare
from mtc.sidecar.storage.deleter import Deleter, clean_uncommitted, remove_step
from mtc.sidecar.storage.publish import write_atomic
from mtc.sidecar.storage.reserve import reserved_bytes

log = logging.getLogger(__name__)


class HostOps:
    """Answers host requests for the hosts a process serves.

    ``hosts`` in a request are the ones it is asked about; with host subfolders
    (simulated hosts, or processes of one machine sharing a RAM disk) the roots
    beside them are reachable too and are listed by ``steps``.

    ``remote``: in multi-controller JAX, where the files of hosts other than
    this process's own come from: the network tier, never their RAM disks. Which
    saving host's data of a step this host's RAM disk holds is what its manifest
    there says (:meth:`own_for`): a job that came back on other hosts than it
    saved on holds another host's (host 2 of 4 is host 0 of a job of 2), and a
    host it grew onto holds none.
    """

    def __init__(self, config: AgentConfig, *, remote: Remote | None = None,
                 own: Sequence[int] = (), max_reply_bytes: int | None = None) -> None:
        self.config = config
        self.remote = remote
        self.own = tuple(own)
        # The most a ``read`` may answer with (a process whose replies have a size limit).
        self.max_reply_bytes = max_reply_bytes
        # Every operation on a host's root (mtc.operations), by its method here.
        self._ops: dict[str, Callable[..., Any]] = {
            name: getattr(self, f"_{name}") for name in operations.names([Side.ROOT])}
        self._locks: dict[int, int] = {}  # host -> descriptor holding its writer lock
        self._sizes: dict[tuple[int, int], int] = {}  # (host, step) -> bytes on disk
        # (host, step) -> (version of its manifest file, the summary read from it)
        self._summaries: dict[tuple[int, int], tuple[tuple[int, int, int], Summary]] = {}
        # Removes the steps retention drops, behind the saves (:meth:`close` joins it).
        self._deleter = Deleter()

    def own_for(self, step: int) -> tuple[int, ...]:
        """The saving hosts whose data of ``step`` this process's RAM disks hold:
        with the network tier, the one this host's manifest of it names (none when
        it holds no copy); else the hosts it serves."""
        if self.remote is None or len(self.own) != 1:
            return self.own
        try:
            return (self._summary(self.own[0], step)[1].host,)
        except (OSError, ManifestError):
            return ()  # no readable copy here: every host's data comes from the network

    def _summary(self, host: int, step: int, *, data: bool = False
                 ) -> tuple[bytes, Summary]:
        """``host``'s manifest of ``step`` (its bytes with ``data``, else maybe b"") and its
        summary, checked as :meth:`Manifest.summary_of` checks it. A summary is read
        once per version of the file (inode, size, mtime): a committed manifest is
        replaced by a rename, never rewritten in place. Bytes read are always
        checked: those of a step a caller loads (``data``) are read again, and
        when the version is the one summarised, their checksum says whether they
        are still the bytes summarised (the body is not parsed again: a restore's
        controller parses it, and a model's manifest has thousands of shards).
        Raises OSError or ManifestError (naming the file)."""
        path = layout.step_dir(self._root(host), step) / MANIFEST_NAME
        with open(path, "rb") as f:  # the version and the bytes of one and the same file
            st = os.fstat(f.fileno())
            version = (st.st_ino, st.st_size, st.st_mtime_ns)
            hit = self._summaries.get((host, step))
            if hit is not None and hit[0] == version and not data:
                return b"", hit[1]
            raw = f.read()
        if hit is not None and hit[0] == version:
            Manifest.check_bytes(raw, path=str(path))
            return raw, hit[1]
        summary = Manifest.summary_of(raw, path=str(path))
        self._summaries[(host, step)] = (version, summary)
        return raw, summary

    def _forget_gone(self, host: int, steps: Sequence[int]) -> None:
        """Drop what is remembered of ``host``'s steps that are gone (kept: ``steps``)."""
        kept = set(steps)
        for cache in (self._summaries, self._sizes):
            for key in [k for k in cache if k[0] == host and k[1] not in kept]:
                del cache[key]

    def handle(self, request: bytes, serves: Sequence[int] | None = None
               ) -> bytes | bytearray:
        """One request in, one reply out; never raises for a bad request or a failed op.

        ``serves``: the hosts whose RAM disks this process has (a colocated worker:
        its own). A request about none of them gets a null reply.
        """
        try:
            op, hosts, args = decode_request(request)
            if op not in self._ops:
                raise ProtocolError(f"unknown host operation {op!r}"[:120])
            if serves is not None:
                hosts = [h for h in hosts if h in serves]
                if not hosts:
                    return encode_reply(None)
            return encode_reply(self._ops[op](hosts, **args))
        except (MtcError, OSError, TypeError, KeyError, ValueError, IndexError) as e:
            # The last four: wrong arguments.
            return encode_error(typed_error(e, storage="host operation failed"))

    def _root(self, host: int) -> Path:
        return self.config.root(host)

    def _reachable(self, hosts: Sequence[int]) -> list[int]:
        found = set(hosts)
        base = Path(self.config.local_dir)
        if self.config.subdirs and base.is_dir():
            # A root that is not a folder is no host's (a lost host's placeholder).
            found |= {int(n[5:]) for n in os.listdir(base)
                      if n.startswith("host-") and n[5:].isdigit() and (base / n).is_dir()}
        return sorted(found)

    def _steps(self, hosts: Sequence[int]) -> dict[str, list[int]]:
        """mtc's committed steps (foreign step folders are nobody's business here)."""
        return {str(h): layout.mtc_steps(self._root(h)) for h in self._reachable(hosts)}

    def _survey(self, hosts: Sequence[int], step: int | None = None, manifest: bool = True
                ) -> dict[str, dict[str, Any]]:
        """What a restore asks first, in one answer: each host's committed steps,
        the run and host count of each (from its manifest's summary, read once
        per version of the file: a step whose manifest is unreadable has none,
        and is never offered), and the whole manifest of ``step`` (None: of its
        newest step) where it holds it (unless not ``manifest``), read and
        checked now, its space as :meth:`_space` says, and the size of its newest
        step's manifest (a save's listing tells the controller how long a
        restore's answer must be)."""
        out: dict[str, dict[str, Any]] = {}
        for h in self._reachable(hosts):
            steps = layout.mtc_steps(self._root(h))
            self._forget_gone(h, steps)
            want = step if step is not None else (steps[-1] if steps else None)
            text = None
            if manifest and want is not None and want in steps and h in hosts:
                try:  # first: the facts of ``want`` below are then of the bytes sent
                    text = bytes(self._manifest([h], want)).decode()
                except ManifestError:
                    if step is not None:
                        raise  # the step asked for: its error names the file
            facts: dict[str, list[Any]] = {}
            for s in steps:
                try:
                    summary = self._summary(h, s)[1]
                except (OSError, ManifestError):
                    continue
                facts[str(s)] = [summary.num_hosts, summary.run]
            # The newest manifest's size, from the version just read for its facts.
            newest = self._summaries.get((h, steps[-1])) if steps and h in hosts else None
            _ino, manifest_bytes, _mtime = newest[0] if newest is not None else (0, 0, 0)
            out[str(h)] = {"steps": steps, "facts": facts, "step": want, "manifest": text,
                           "space": self._space_of(h, steps) if h in hosts else None,
                           "manifest_bytes": manifest_bytes}
        return out

    def _manifest(self, hosts: Sequence[int], step: int) -> bytes:
        host = hosts[0]
        path = layout.step_dir(self._root(host), step) / MANIFEST_NAME
        # Checked here, where the file is, so that an error names it: its checksum,
        # format and whose it is. Its leaves are the caller's to parse (once: a
        # model's manifest has thousands of shards).
        try:
            if self.remote is not None and host not in self.own_for(step):
                path = Path(f"host-{host}:{step}") / MANIFEST_NAME  # named, never opened
                data = bytes(self.remote(step, host, MANIFEST_NAME))
                m = Manifest.summary_of(data, path=str(path))
            else:
                data, m = self._summary(host, step, data=True)
        except ManifestError as e:
            raise ManifestError(e.message, step=step, host=host, path=str(path)) from e
        except MtcError:
            raise  # the network tier's own answer (a StepNotFoundError is a FileNotFoundError)
        except FileNotFoundError as e:
            raise ManifestError("committed step has no manifest", step=step, host=host,
                                path=str(path)) from e
        if m.step != step or m.host != host:
            raise ManifestError(f"manifest belongs to step {m.step} host {m.host}", step=step,
                                host=host, path=str(path))
        return data

    def _delete(self, hosts: Sequence[int], step: int) -> bool:
        for h in hosts:
            root = self._root(h)
            if layout.step_dir(root, step).is_dir() and not layout.is_mtc_step(root, step):
                raise StepNotFoundError("this step folder is not mtc's (no manifest: Orbax's "
                                        "or another tool's); mtc never deletes it", step=step,
                                        host=h, path=str(layout.step_dir(root, step)))
        return any([remove_step(self._root(h), step) for h in hosts])

    def _open(self, hosts: Sequence[int], lock: bool, clean: bool, identify: bool = False,
              metadata: str | None = None) -> dict[str, dict[str, Any]]:
        """Make each root usable: create it, take its writer lock (one manager per
        root; the kernel drops it when the process dies), remove what a crash left
        (``clean``). Answers, per host, all a manager's open needs in one round trip:
        the folders removed, the step folders without mtc's manifest (Orbax's,
        another tool's: left alone) and (``identify``) the root's identity, written
        now when it has none, which the replicator serving the same folder reports
        back, and the size of the newest step's manifest (a restore's first call
        brings the manifests: the controller sizes its answer by it). ``metadata``:
        Orbax's root metadata (JSON) a writer keeps where none is kept yet (the
        first one stays, as Orbax's); every open answers what is kept."""
        if metadata is not None and not isinstance(metadata, str):
            raise ProtocolError(f"root metadata is JSON text, got {type(metadata).__name__}")
        if metadata is not None and len(metadata.encode()) > layout.ROOT_METADATA_MAX:
            raise ProtocolError(f"root metadata of {len(metadata.encode())} bytes: at most "
                                f"{layout.ROOT_METADATA_MAX}")
        out: dict[str, dict[str, Any]] = {}
        try:
            for h in hosts:
                root = self._root(h)
                root_lock.prepare_root(root)
                # A manager of this process holding the root already may be writing:
                # what looks left by a crash may be its save in flight.
                first = not root_lock.held_here(root)
                if lock and h not in self._locks:
                    self._locks[h] = root_lock.lock_root(root)
                removed: list[str] = []
                try:
                    if clean and first:
                        removed = clean_uncommitted(root)
                    foreign = layout.foreign_steps(root)
                except OSError as e:
                    raise LocalDirError(f"cannot read the directory: {e.strerror}",
                                        host=h, path=str(root)) from e
                if removed:
                    log.info("host %d: removed uncommitted folders %s", h, removed)
                kept = layout.root_metadata(root)
                if metadata is not None and not kept:
                    write_atomic(root / layout.ROOT_METADATA_NAME, metadata)
                    kept = metadata
                out[str(h)] = {"removed": removed, "foreign": foreign, "identity":
                               ensure_root_identity(root) if identify else "",
                               "manifest_bytes": _newest_manifest_bytes(
                                   root, layout.mtc_steps(root))}
                if kept:
                    out[str(h)]["metadata"] = kept
        except BaseException:
            self._release(hosts)
            raise
        return out

    def _release(self, hosts: Sequence[int]) -> None:
        for h in hosts:
            fd = self._locks.pop(h, None)
            if fd is not None:
                root_lock.unlock_root(fd, self._root(h))

    def release_all(self) -> None:
        self._release(list(self._locks))

    def close(self) -> None:
        """Let go of every root, finish the deletions under way and join their thread."""
        try:
            self.release_all()
        finally:
            self._deleter.close()

    def _retain(self, hosts: Sequence[int], complete: list[int], max_to_keep: int | None,
                keep_period: int | None, before_write: bool) -> dict[str, list[int]]:
        """Delete (in the background) what the retention policy says of each host's
        steps; answers with :meth:`_space`, saving the caller a round trip."""
        space: dict[str, list[int]] = {}
        for h in hosts:
            root = self._root(h)
            steps = layout.mtc_steps(root)
            gone = retention.to_delete(complete, steps, max_to_keep=max_to_keep,
                                       keep_period=keep_period, before_write=before_write)
            for s in gone:
                remove_step(root, s, self._deleter)
            # The steps left, without listing the root again (a save waits for this).
            space[str(h)] = self._space_of(h, [s for s in steps if s not in gone])
        return space

    def _space(self, hosts: Sequence[int]) -> dict[str, list[int]]:
        """Per host: bytes free on its RAM disk for the next save, and bytes of its
        newest step (0: none)."""
        return {str(h): self._space_of(h, layout.mtc_steps(self._root(h))) for h in hosts}

    def _space_of(self, host: int, steps: Sequence[int]) -> list[int]:
        """:meth:`_space` of one host whose committed ``steps`` were just listed."""
        root = self._root(host)
        key = (host, steps[-1]) if steps else None
        if key is not None and key not in self._sizes:
            try:  # its manifest's sum: a stat of every file is a system call (slow in gVisor)
                self._sizes[key] = self._summary(host, steps[-1])[1].nbytes
            except (OSError, ManifestError):
                self._sizes[key] = layout.folder_bytes(layout.step_dir(root, steps[-1]))
        # Blank files set aside for the next save are room it fills (write.py).
        free = spare.free_bytes(root) + reserved_bytes(root / WRITER_RESERVE_DIR)
        return [free, self._sizes[key] if key else 0]

    def _settle(self, hosts: Sequence[int]) -> None:
        """Wait until background deletions have freed their space."""
        self._deleter.settle()

    def _read(self, hosts: Sequence[int], step: int,
              tasks: list[dict[str, Any]] | dict[str, list[dict[str, Any]]]) -> Raw:
        """Regions' bytes end to end, from pieces this host holds, each verified.
        ``tasks`` by host: a request to every worker at once, each reading its own."""
        if isinstance(tasks, dict):
            if len(hosts) != 1:
                raise ProtocolError(f"tasks by host read by one host, not {list(hosts)}",
                                    step=step)
            tasks = tasks.get(str(hosts[0]), [])
        if not isinstance(tasks, list):
            raise ProtocolError("tasks is a list", step=step)
        parsed = [task_from_json(d) for d in tasks]
        for t in parsed:
            strangers = {p.host for p in t.pieces} - set(hosts)
            if strangers:
                raise ProtocolError(f"asked to read pieces held by hosts {sorted(strangers)}",
                                    step=step, host=hosts[0])
        # Checked whole before anything is read: what is asked is bounded by the
        # pieces' own bytes, and by what this process may answer with.
        total = check_tasks(parsed, step=step, host=hosts[0] if hosts else -1)
        if self.max_reply_bytes is not None and total > self.max_reply_bytes:
            raise ProtocolError(f"a read of {total} bytes answers with more than "
                                f"{self.max_reply_bytes}: ask for fewer regions at once",
                                step=step, host=hosts[0] if hosts else None)
        with ShardLoader(step, self._root, remote=self.remote,
                         own=self.own_for(step)) as loader:
            out = [np.ascontiguousarray(loader.read(t)).reshape(-1).view(np.uint8).data
                   for t in parsed]
        return Raw(out)  # joined once, into the reply itself


def ensure_root_identity(root: Path) -> str:
    """The identity of host root ``root`` (:func:`mtc.layout.root_identity`), written
    now when it has none (a manager's open: the replicator serving the same folder
    reports it back)."""
    found = layout.root_identity(root)
    if found:
        return found
    new = uuid.uuid4().hex
    write_atomic(root / layout.ROOT_ID_NAME, new)
    return layout.root_identity(root) or new


def _newest_manifest_bytes(root: Path, steps: Sequence[int]) -> int:
    """The size of the newest of ``steps``' manifests in ``root`` (0: none)."""
    if not steps:
        return 0
    try:
        return (layout.step_dir(root, steps[-1]) / MANIFEST_NAME).stat().st_size
    except OSError:
        return 0
