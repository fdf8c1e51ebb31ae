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
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from mtc.errors import MtcError
from mtc.pool import ThreadPool
from mtc.sidecar.backup.backend import Backend
from mtc.sidecar.backup.job import BackupStore, back_up_step

if TYPE_CHECKING:
    from mtc.sidecar.backup.duties import BackupDuties

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
        self._listing_lock = threading.Lock()
        self._refreshing: Future[list[int]] | None = None
        self._list_failed = False
        # The listing behind an inventory's back: one thread, joined by close().
        self._lister = ThreadPool(1, "mtc-backup-list", lazy=True)

    def close(self) -> None:
        """Wait for a listing in flight (bounded by the backend's own timeouts)."""
        self._lister.shutdown(wait=True, cancel_futures=True)

    def request(self) -> None:
        self._requested.set()

    def refresh(self) -> list[int]:
        """List the committed backups now (raises when the store cannot be read)."""
        steps = self.store.committed_steps()
        with self._listing_lock:
            self._listing = (time.monotonic(), steps)
            if self._list_failed:
                log.info("backup store readable again")
            self._list_failed = False
        return steps

    def backed_up_steps(self, max_age_s: float = 2.0, wait_s: float = 1.0) -> list[int]:
        """Committed backups, as last listed (inventories ask often). A listing older
        than ``max_age_s`` is refreshed on a thread of its own and waited for at most
        ``wait_s`` seconds: an unreachable or slow store never holds up or fails an
        inventory (and with it leader choice, replication bookkeeping and restore
        agreement); the last listing stands meanwhile."""
        with self._listing_lock:
            t, steps = self._listing
            if time.monotonic() - t <= max_age_s:
                return steps
            if self._list_failed:
                wait_s = 0.0  # the store is down: answer at once, keep trying behind
            fut = self._refreshing
            if fut is None:
                fut = self._refreshing = Future()
                try:
                    self._lister.submit(self._refresh_into, fut)
                except RuntimeError:  # closed: the last listing stands
                    self._refreshing = None
                    return steps
        try:
            return fut.result(timeout=wait_s)
        except FutureTimeout:
            return steps
        except Exception:  # noqa: BLE001 - logged by _refresh_into; the last listing stands
            return steps

    def _refresh_into(self, fut: Future[list[int]]) -> None:
        try:
            fut.set_result(self.refresh())
        except Exception as e:  # noqa: BLE001 - handed to the waiters through the future
            with self._listing_lock:
                if not self._list_failed:
                    log.warning("cannot list the backups: %s", e)
                self._list_failed = True
            fut.set_exception(e)
        finally:
            with self._listing_lock:
                self._refreshing = None

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

    def may_be_due(self) -> bool:
        """Whether a backup can be due now, asked before anything is gathered: on
        request, on a step interval (then only the newest complete step says), or
        once the time interval passed. The backup loop runs twice a second, and
        gathering costs every node an inventory, which checks every file it holds."""
        p = self.policy
        if self._requested.is_set() or p.interval_steps:
            return True
        return bool(p.interval_minutes) and \
            time.monotonic() - self._last_time >= 60 * (p.interval_minutes or 0)

    def run_once(self, node: BackupDuties, *, force: bool = False) -> int:
        """If this node leads and a backup is due, back up; returns the step or -1."""
        with self._lock:
            if not (force or self.may_be_due()) or not node.leads():
                return -1
            invs = node.gather()
            step, run = node.newest_complete_run(invs)
            if not (force or self.due(step)) or step < 0:
                return -1
            if step in self.refresh():
                self._last_step = step
                self._requested.clear()
                return step
            self._requested.clear()
            sources, proven = node.backup_sources(step, invs, run)
            try:
                back_up_step(self.store, step, sources, node.call_backup_part, proven=proven)
            except MtcError:
                self._requested.set()  # try again on the next pass
                raise
            self._last_time = time.monotonic()
            self._last_step = step
            with self._listing_lock:
                self._listing = (0.0, sorted({*self._listing[1], step}))
            node.metrics.newest.labels("backed_up").set(step)
            node.metrics.backup_committed.set_to_current_time()
            deleted = self.store.apply_retention(self.policy.keep, self.policy.keep_every)
            if deleted:
                log.info("backup retention deleted steps %s", deleted)
            self.store.clean_leftovers(self._busy)
            return step
