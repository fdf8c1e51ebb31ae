"""The replication loop, a service (:class:`mtc.lifecycle.Service`) with one thread:
a copy pass (:mod:`.replication`), then garbage collection (:mod:`.gc`), at every
step renamed into the root (:class:`.root_watch.RootWatch`) and every poll.

Before its first pass, on a host that holds no step of its own, the RAM disk its
restore will likely need is set aside (:meth:`ReplicationLoop.set_aside_for_restore`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from mtc.lifecycle import Threads
from mtc.sidecar.backup.duties import BackupDuties
from mtc.sidecar.replicator.agree.node_agreement import NodeAgreement, holders_of
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.copies.gc import GcPlan, collect_garbage
from mtc.sidecar.replicator.copies.replication import Replication
from mtc.sidecar.replicator.fetch.fetch_plan import likely_restore
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.store.root_watch import RootWatch
from mtc.sidecar.replicator.store.store import LocalStore
from mtc.sidecar.save.write import WRITER_RESERVE_DIR
from mtc.sidecar.storage import spare
from mtc.sidecar.storage.reserve import Reserve, reserved_bytes

log = logging.getLogger(__name__)


class ReplicationLoop:
    """``heartbeat``: the loop's last pass (monotonic; main's health reads it).
    ``trusted()``: whether this node's configuration agrees with its peers' (while
    it does not, nothing is copied and the peers' views are not asked)."""

    def __init__(self, config: ReplicatorConfig, store: LocalStore, metrics: Metrics, *,
                 replication: Replication, agreement: NodeAgreement, backups: BackupDuties,
                 reserve: Reserve, trusted: Callable[[], bool]) -> None:
        self.config = config
        self.rank = config.rank
        self.store = store
        self.metrics = metrics
        self.replication = replication
        self.agreement = agreement
        self.backups = backups
        self.reserve = reserve
        self._trusted = trusted
        self._stop = threading.Event()
        # A step renamed into the root wakes the loop at once (the poll stays).
        self._watch = RootWatch(store.root)
        self.heartbeat = time.monotonic()
        self._gc_bounded = False  # the GC deleted a step only its bound made it delete
        self._sizes_seen: dict[tuple[int, int], tuple[int, int]] = {}  # GC's, its thread's

    def start(self, threads: Threads) -> None:
        threads.start(self.run, "mtc-replicate")

    def stop(self) -> None:
        self._stop.set()
        self._watch.wake()

    def close(self) -> None:
        self._watch.close()

    def run(self) -> None:
        """The loop: a copy pass, then garbage collection; ends when stopped."""
        self.set_aside_for_restore()
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            if self.reserve.wants(self.rank) and self.store.own.steps():
                # The job saved anew here without restoring: no fetch will come.
                self.reserve.forget(self.rank)
            try:
                trusted = self._trusted()
                if trusted:  # copies to the wrong peers help nobody
                    self.replication.replicate_once()
                # Misconfigured, its peers' views are not asked: only what the bound
                # and the room force goes (its saves still come).
                self._note_gc(collect_garbage(
                    self.store, self.replication, keep=self.config.keep,
                    busy=self.backups.busy(),
                    coordinator_keeps=self.agreement.gc_keeps if trusted else lambda: None,
                    metrics=self.metrics, awaiting=self.config.keep_awaiting, room=self.room,
                    sizes_seen=self._sizes_seen))
                if trusted:
                    self.metrics.passes.labels("replication").inc()
            except Exception:
                log.exception("replication pass failed")
                self.metrics.failures.labels("loop").inc()
            self._watch.wait(self.config.poll_s)

    def room(self) -> int:
        """Bytes the RAM disk may still take: free (but its last bytes) and the blank
        files set aside for the next save and copies, which those fill."""
        return (spare.room(self.store.root) + self.reserve.held_bytes()
                + reserved_bytes(self.store.root / WRITER_RESERVE_DIR))

    def _note_gc(self, plan: GcPlan) -> None:
        """Say once (then at INFO) that steps retention would keep went for the bound."""
        if not plan.over:
            return
        level = logging.INFO if self._gc_bounded else logging.WARNING
        self._gc_bounded = True
        log.log(level, "rank %d: steps %s deleted beyond --keep %d though replication or a "
                "restore still wanted them: at most %d more are kept (--keep-awaiting), never "
                "at the cost of the room the next save needs (a target or the coordinator "
                "does not answer, or the RAM disk is small)", self.rank, list(plan.over),
                self.config.keep, self.config.keep_awaiting)

    def set_aside_for_restore(self) -> None:
        """A replaced (or wiped) host holds no step of its own: its job's restore will
        fetch its data from the hosts that hold copies, into new RAM-disk pages that
        the kernel allocates on the fetch's time (less than half the speed of
        written-over pages here). Set files of the sizes of the newest copy of its
        data aside now, in the background, while the job starts up; the fetch takes
        their places (Restorer). Best effort: peers that do not answer within the
        deadline set nothing aside, and a restore then writes new files as before."""
        if not self.reserve.enabled or self.store.own.steps():
            return
        invs = self.agreement.gather_invs(range(self.config.num_nodes),
                                          time.monotonic() + min(2.0, self.config.deadline_s))
        likely = likely_restore(self.rank, self.config.equivalent(self.rank), holders_of(invs))
        if likely is None:
            return
        step, sizes = likely
        log.info("rank %d: holds no step of its own; %d files (%.1f MB) of step %d set aside "
                 "for its restore", self.rank, len(sizes), sum(sizes) / 1e6, step)
        self.reserve.want(self.rank, sizes)
