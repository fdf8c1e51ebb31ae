"""A replicator's part in restore after agreement: bring this host's data of the
agreed step from its own RAM disk, a peer that holds a copy, or the backup, and
answer Orbax's client with the restore marker. Every byte is verified on arrival."""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from mtc import layout
from mtc.errors import MtcError, StepNotFoundError
from mtc.proto import replicator_pb2 as pb
from sidecar.replicator.store import FileMeta

if TYPE_CHECKING:
    from sidecar.backup.schedule import BackupScheduler
    from sidecar.replicator.client import PeerClient
    from sidecar.replicator.config import ReplicatorConfig
    from sidecar.replicator.metrics import Metrics
    from sidecar.replicator.store import LocalStore

log = logging.getLogger("sidecar.replicator.node")


class RestoreDuties:
    """Mixed into :class:`sidecar.replicator.node.Node`, whose state it uses."""

    rank: int
    config: ReplicatorConfig
    store: LocalStore
    metrics: Metrics
    peers: dict[int, PeerClient]
    backup: BackupScheduler | None
    _pool: ThreadPoolExecutor

    if TYPE_CHECKING:  # provided by Node and BackupDuties
        def agree(self, timeout_s: float | None = None
                  ) -> tuple[int, dict[int, pb.Inventory]]: ...

        def holders(self, invs: dict[int, pb.Inventory]
                    ) -> dict[tuple[int, int], list[tuple[int, pb.StepCopy]]]: ...

        def _from_backup(self, step: int, invs: dict[int, pb.Inventory],
                         tmp: Path) -> list[FileMeta]: ...

    def restore_for_client(self, job: str) -> int:
        """Answer an Orbax client: agree, park every step folder out of its sight,
        bring this host's data of the agreed step, and write the restore marker."""
        from sidecar.replicator import orbax

        step, invs = self.agree()
        for s in self.store.own_steps():
            if (self.store.root / str(s)).is_symlink():
                (self.store.root / str(s)).unlink()
            else:
                self.store.adopt_own(s)
        if step < 0:
            orbax.write_marker(self.store.root, job, 0, self.rank, None)
            return -1
        if (self.rank, step) not in self.store.copies():
            self.materialize(step, invs, into_root=False)
        orbax.write_marker(self.store.root, job, step, self.rank,
                           self.store.copy_dir(self.rank, step))
        return step

    def prepare_restore(self, timeout_s: float | None = None) -> tuple[int, str, float]:
        """Agree on the step and make this host's data for it local."""
        t0 = time.monotonic()
        step, invs = self.agree(timeout_s)
        if step < 0:
            return -1, "none", time.monotonic() - t0
        tier = self.materialize(step, invs, into_root=self.config.framework == "mtc")
        return step, tier, time.monotonic() - t0

    def materialize(self, step: int, invs: dict[int, pb.Inventory], *, into_root: bool) -> str:
        """Make this host's data of ``step`` local; returns the tier it came from."""
        if (self.rank, step) in self.store.copies():
            return "local"
        held = self.holders(invs)
        sources: list[tuple[int, pb.StepCopy]] = []
        for origin in self.config.equivalent(self.rank):
            sources += [(h, c) for h, c in held.get((origin, step), []) if h != self.rank]
            if sources:
                break
        tmp = (layout.new_tmp_dir(self.store.root, step) if into_root
               else self.store.begin_incoming(self.rank, step))
        try:
            if sources:
                files = [FileMeta(f.path, f.size, f.crc32c) for f in sources[0][1].files]
                futs = [self._pool.submit(self._fetch, sources, i, step, f, tmp)
                        for i, f in enumerate(files)]
                for fut in futs:
                    fut.result()
                tier = "peer"
            elif self.backup is not None and step in self.backup.refresh():
                files = self._from_backup(step, invs, tmp)
                tier = "backup"
            else:
                raise StepNotFoundError("no peer or backup holds this host's data", step=step,
                                        host=self.rank)
            self.store.commit_restored(tmp, step, files, into_root=into_root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tier

    def _fetch(self, sources: list[tuple[int, pb.StepCopy]], i: int, step: int, f: FileMeta,
               tmp: Path) -> None:
        """One file from the holders, starting at a different one per file; next on failure."""
        errors = []
        for k in range(len(sources)):
            holder, copy = sources[(i + k) % len(sources)]
            try:
                self.peers[holder].fetch_file(step, copy.origin_rank, f.path, tmp / f.path,
                                              f.size, f.crc32c)
                self.metrics.bytes_fetched.inc(f.size)
                return
            except (MtcError, OSError) as e:
                self.metrics.failures.labels("fetch").inc()
                log.warning("rank %d: %s from rank %d failed: %s", self.rank, f.path, holder, e)
                errors.append(e)
        raise errors[-1]
