"""A replicator's part in the backup tier: leading backups, uploading its share,
and restoring from the backup with shared objects read from the bucket once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from mtc.errors import ConfigError, MtcError, StepExistsError, StepNotFoundError
from mtc.grpc_errors import PeerError
from mtc.lifecycle import Threads
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.backend import CorruptBackupError
from mtc.sidecar.replicator.agree.node_agreement import holders_of
from mtc.sidecar.replicator.store.step_files import FileMeta

if TYPE_CHECKING:
    from mtc.sidecar.backup.schedule import BackupScheduler
    from mtc.sidecar.replicator.agree.node_agreement import NodeAgreement
    from mtc.sidecar.replicator.config import ReplicatorConfig
    from mtc.sidecar.replicator.metrics import Metrics
    from mtc.sidecar.replicator.store.store import LocalStore
    from mtc.sidecar.replicator.transport import Peer

log = logging.getLogger(__name__)


class BackupDuties:
    """One replicator's part in the backup tier. It owns the steps it is uploading
    (``busy``: never garbage-collected meanwhile) and the steps it is restoring
    from the backup (``staged``: served to other restoring hosts), under ``_lock``.
    A service (:class:`mtc.lifecycle.Service`): its loop (:meth:`run`) has a thread
    when there is a backup store."""

    def __init__(self, config: ReplicatorConfig, store: LocalStore,
                 peers: Mapping[int, Peer], metrics: Metrics,
                 scheduler: BackupScheduler | None, agreement: NodeAgreement) -> None:
        self.rank = config.rank
        self.config = config
        self.store = store
        self.peers = peers
        self.metrics = metrics
        self.backup = scheduler
        self._agreement = agreement
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._backing_up: set[int] = set()
        # Steps being restored from the backup: their folder and verified files,
        # served to other restoring hosts that share objects with this one.
        self._restoring: dict[int, tuple[Path, set[str]]] = {}

    def start(self, threads: Threads) -> None:
        if self.backup is not None:
            threads.start(self.run, "mtc-backup")

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """After the loops and the servers ended: the scheduler's listing thread."""
        if self.backup is not None:
            self.backup.close()

    def busy(self) -> set[int]:
        """Steps whose copies are being uploaded now."""
        with self._lock:
            return set(self._backing_up)

    def staged(self, step: int) -> tuple[Path, set[str]] | None:
        """This host's data of ``step`` being restored from the backup: its folder
        and the paths there read and verified; None when it restores none."""
        with self._lock:
            return self._restoring.get(step)

    def done_restoring(self, step: int) -> None:
        """The restore of ``step`` committed or gave up its folder."""
        with self._lock:
            self._restoring.pop(step, None)

    # The scheduler's questions (sidecar/backup/schedule.py).
    def gather(self) -> dict[int, pb.Inventory]:
        return self._agreement.gather()

    def newest_complete_run(self, invs: dict[int, pb.Inventory]) -> tuple[int, str]:
        return self._agreement.newest_complete_run(invs)

    def run(self) -> None:
        """The backup loop; returns at once without a backup store, else when
        stopped."""
        if self.backup is not None:
            self._backup_loop()

    def _backup_loop(self) -> None:
        from mtc.sidecar.replicator.orbax import backup_requested

        assert self.backup is not None
        answered = -1  # the newest step whose _BACKUP_REQUESTED file was acted on
        while not self._stop.wait(max(self.config.poll_s, 0.5)):
            try:
                for s in self.store.own.steps()[-1:]:
                    # An Orbax client's request, on any host: once per step (the file
                    # stays), passed to the leader when this host does not lead.
                    if s > answered and backup_requested(self.store.copy_dir(self.rank, s)):
                        if self.leads():
                            self.backup.request()
                        else:
                            self.request_backup()
                        answered = s
                self.backup.run_once(self)
                self.metrics.passes.labels("backup").inc()
            except (MtcError, OSError) as e:
                self.metrics.failures.labels("backup").inc()
                log.warning("rank %d: backup failed: %s", self.rank, e)
            except Exception:  # never let the backup thread die
                self.metrics.failures.labels("backup").inc()
                log.exception("rank %d: backup failed", self.rank)

    def leads(self) -> bool:
        """The backup leader is the lowest-ranked node that answers."""
        for r in range(self.rank):
            try:
                # Generous: a busy leader that answers late must not get a rival.
                # Rank only: every node asks this twice a second, and a whole
                # inventory checks every file the leader holds.
                self.peers[r].inventory(pb.InventoryRequest(rank_only=True), deadline_s=5.0,
                                        attempts=1)
                return False
            except PeerError:
                continue
        return True

    def backup_sources(self, step: int, invs: dict[int, pb.Inventory], run: str = ""
                       ) -> tuple[dict[int, list[tuple[int, int, list[FileMeta]]]],
                                  dict[tuple[int, str], str]]:
        """Per rank, the copies its data of ``step`` can be uploaded from: those
        ``run`` wrote (the step's complete run), never another run's; and the
        SHA-256 (hex) of each file (origin, path) its origin signed, where the
        copies came with proofs (mutual TLS: the gather dropped copies of other
        ranks without one), which every upload must match."""
        held = holders_of(invs, run or None)
        out: dict[int, list[tuple[int, int, list[FileMeta]]]] = {}
        proven: dict[tuple[int, str], str] = {}
        for r in range(self.config.num_nodes):
            copies = []
            for o in self.config.equivalent(r):
                for h, c in held.get((o, step), []):
                    copies.append((h, o, [FileMeta(f.path, f.size, f.crc32c) for f in c.files]))
                    if c.HasField("proof"):
                        proven.update(((o, f.path), f.sha256.hex()) for f in c.files
                                      if f.sha256)
            if not copies:
                raise StepNotFoundError("no host holds this rank's data", step=step, host=r)
            out[r] = copies
        return out, proven

    def call_backup_part(self, holder: int, req: pb.BackupPartRequest) -> pb.BackupPartReply:
        if holder == self.rank:
            return self.backup_part(req)
        return self.peers[holder].backup_part(req)

    def backup_part(self, req: pb.BackupPartRequest) -> pb.BackupPartReply:
        from mtc.sidecar.backup.job import MANIFEST, step_prefix, upload_part

        if self.backup is None:
            raise ConfigError("this replicator has no backup store (--backup)")
        with self._lock:
            self._backing_up.add(req.step)
        try:
            if (req.origin_rank, req.step) not in self.store.copies():
                raise StepNotFoundError("copy is gone", step=req.step, host=req.origin_rank)
            if req.prefix == step_prefix(req.step) and \
                    self.backup.store.backend.get_bytes(f"{req.prefix}/{MANIFEST}") is not None:
                # A committed backup's objects are never written again: its manifest's
                # SHA-256 of each must stay true.
                raise StepExistsError("the backup of this step is committed", step=req.step,
                                      host=req.origin_rank)
            files = {f.path: f for f in self.store.describe(req.origin_rank, req.step)}
            reply = upload_part(self.backup.store.backend,
                                self.store.copy_dir(req.origin_rank, req.step), files, req)
            self.metrics.backup_bytes.inc(sum(files[e.path].size for e in reply.entries
                                              if e.uploaded))
            return reply
        finally:
            with self._lock:
                self._backing_up.discard(req.step)

    def request_backup(self) -> int:
        """Back up now if leading; otherwise ask the leader."""
        if self.backup is None:
            raise ConfigError("this replicator has no backup store (--backup)")
        if self.leads():
            try:
                return self.backup.run_once(self, force=True)
            except MtcError as e:
                # The caller gets the typed error; the operator gets it here too
                # (a cut link mid-upload, a holder gone): the loop tries again.
                self.metrics.failures.labels("backup").inc()
                log.warning("rank %d: requested backup failed: %s", self.rank, e)
                raise
        for r in range(self.rank):
            try:
                return int(self.peers[r].request_backup().step)
            except PeerError:
                continue
        return self.backup.run_once(self, force=True)

    def from_backup(self, step: int, invs: dict[int, pb.Inventory], tmp: Path
                     ) -> list[FileMeta]:
        """This host's data from the backup; objects several restoring hosts share
        are read from the bucket by one of them and fetched from it by the rest."""
        from mtc.sidecar.backup.job import HolderIdle, Shared, download_rank, plan_shared

        assert self.backup is not None
        held = holders_of(invs)
        restoring = [r for r in invs  # reachable hosts whose data no host holds
                     if not any((o, step) in held for o in self.config.equivalent(r))]
        manifest = self.backup.store.manifest(step)

        def fetch(holder: int, path: str, local: Path, e: Any) -> None:
            try:
                self.peers[holder].fetch(step, holder, path, local, e.size, e.crc32c)
            except PeerError as err:
                if err.code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise HolderIdle(str(err), step=step, host=holder) from err
                raise
            self.metrics.bytes_fetched.inc(e.size)

        shared = Shared(plan_shared(manifest, restoring), fetch)
        # Served to the other restoring hosts from now until the caller (restore.py's
        # materialize) has committed the folder or given it up (done_restoring): a
        # file read and verified here is never refused to them meanwhile.
        with self._lock:
            self._restoring[step] = (tmp, shared.ready)
        return download_rank(self.backup.store, step, self.rank, tmp,
                             self.config.equivalent(self.rank), shared,
                             on_bytes=self.metrics.backup_bytes_downloaded.inc)

    def file_from_backup(self, step: int, f: FileMeta, dest: Path) -> bool:
        """One file of this rank's ``step`` from the backup into ``dest``, checked
        against the backup manifest's size, CRC32C and SHA-256 and against ``f``;
        False when the backup does not have it."""
        from mtc.sidecar.backup.job import step_prefix
        from mtc.sidecar.storage.checksum import file_sha256

        assert self.backup is not None
        if step not in self.backup.refresh():
            return False
        manifest = self.backup.store.manifest(step)
        for r in self.config.equivalent(self.rank):
            entry = next((e for e in manifest.get(r, []) if e.path == f.path), None)
            if entry is None or (entry.size, entry.crc32c) != (f.size, f.crc32c):
                continue
            dest.unlink(missing_ok=True)
            self.backup.store.backend.get_file(f"{step_prefix(step)}/{entry.object}", dest,
                                               size=entry.size, crc32c=entry.crc32c)
            if file_sha256(dest).hex() != entry.sha256:
                dest.unlink(missing_ok=True)
                raise CorruptBackupError("object differs from its manifest's SHA-256",
                                         step=step, host=r, path=entry.object)
            self.metrics.backup_bytes_downloaded.inc(entry.size)
            return True
        return False
