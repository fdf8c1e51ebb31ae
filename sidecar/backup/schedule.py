"""When to back up, and who does it.

Every node runs a scheduler; only the leader (the lowest-ranked node that
answers) acts. A backup is due every ``interval_minutes`` or every
``interval_steps`` steps, or on request (the replicator's RPC, the CLI, an
Orbax client's ``_BACKUP_REQUESTED`` file). It takes the newest step held for
every rank, runs on its own thread, and never blocks training or replication.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import TYPE_CHECKING

from mtc.errors import MtcError
from sidecar.backup.backend import Backend
from sidecar.backup.job import BackupStore, back_up_step

if TYPE_CHECKING:
    from sidecar.replicator.node import Node

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BackupPolicy:
    interval_minutes: float | None = 30.0
    interval_steps: int | None = None
    keep: int = 3                 # newest backups kept
    keep_every: int = 0           # and every K-th step (0: none)


class BackupScheduler:
    def __init__(self, backend: Backend, policy: BackupPolicy) -> None:
        self.store = BackupStore(backend)
        self.policy = policy
        self._requested = threading.Event()
        self._lock = threading.Lock()
        self._last_time = time.monotonic()
        self._last_step = -1
        self._busy: set[str] = set()
        self._listing: tuple[float, list[int]] = (0.0, [])

    def request(self) -> None:
        self._requested.set()

    def backed_up_steps(self, max_age_s: float = 2.0) -> list[int]:
        """Committed backups (listing cached briefly: inventories ask often)."""
        t, steps = self._listing
        if time.monotonic() - t > max_age_s:
            steps = self.store.committed_steps()
            self._listing = (time.monotonic(), steps)
        return steps

    def due(self, newest_complete: int) -> bool:
        if newest_complete < 0 or newest_complete <= self._last_step:
            return False
        if self._requested.is_set():
            return True
        p = self.policy
        if p.interval_steps and newest_complete - max(self._last_step, 0) >= p.interval_steps:
            return True
        return bool(p.interval_minutes) and \
            time.monotonic() - self._last_time >= 60 * (p.interval_minutes or 0)

    def run_once(self, node: Node, *, force: bool = False) -> int:
        """If this node leads and a backup is due, back up; returns the step or -1."""
        with self._lock:
            if not node.leads():
                return -1
            invs = node.gather()
            step = node.newest_complete(invs)
            if not (force or self.due(step)) or step < 0:
                return -1
            if step in self.backed_up_steps(max_age_s=0):
                self._last_step = step
                self._requested.clear()
                return step
            self._requested.clear()
            sources = node.backup_sources(step, invs)
            try:
                back_up_step(self.store, step, sources, node.call_backup_part)
            except MtcError:
                self._requested.set()  # try again on the next pass
                raise
            self._last_time = time.monotonic()
            self._last_step = step
            self._listing = (0.0, [])
            node.metrics.newest.labels("backed_up").set(step)
            deleted = self.store.apply_retention(self.policy.keep, self.policy.keep_every)
            if deleted:
                log.info("backup retention deleted steps %s", deleted)
            self.store.clean_leftovers(self._busy)
            return step
