"""A replicator's restores: agree on the step (``node_agreement.py``), then bring
this host's data of it from its own RAM disk, a peer that holds a copy, or the
backup (``materialize.py``: every byte verified on arrival), now or in the
background after the answer, and answer Orbax's client with the restore marker."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from mtc import layout
from mtc.errors import AgreementError, MtcError, StepNotFoundError
from mtc.lifecycle import Threads
from mtc.pool import ThreadPool, lower_thread_priority
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar import priority
from mtc.sidecar.replicator.agree.decision import check_members, refused, saving_ranks
from mtc.sidecar.replicator.agree.node_agreement import holding_of
from mtc.sidecar.replicator.fetch.materialize import FETCH_STREAMS, Materializer

if TYPE_CHECKING:
    from mtc.sidecar.backup.duties import BackupDuties
    from mtc.sidecar.replicator.agree.node_agreement import NodeAgreement
    from mtc.sidecar.replicator.config import ReplicatorConfig
    from mtc.sidecar.replicator.metrics import Metrics
    from mtc.sidecar.replicator.store.store import LocalStore
    from mtc.sidecar.replicator.transport import Peer
    from mtc.sidecar.storage.reserve import Reserve

log = logging.getLogger(__name__)
BACKGROUND_NICE = 19  # raised by this much (to at most 19)


def _background_priority() -> None:
    """The threads that bring a replaced host's own copy after the restore answered
    run below the job's first steps (and its input pipeline) on the same CPUs: the
    copy takes what they leave, and all of it while they wait. Their nice orders
    them within this process's scheduling group; :meth:`Restorer._materialize_logged`
    has the group yield to the job's too (:mod:`mtc.sidecar.priority`)."""
    lower_thread_priority(BACKGROUND_NICE)


@dataclasses.dataclass
class RestoreAsk:
    """One restore, as the call that carries it (a PrepareRestore, an Orbax client's
    request) hands it to the agreement: its restore id (a re-issued ask reads the
    same decision) and the job's stated membership; the decision read is recorded
    here for the caller. Passed explicitly; owned by that call's thread."""

    rid: str = ""
    members: tuple[int, ...] = ()
    decision: pb.Decision = dataclasses.field(default_factory=pb.Decision)


class Restorer:
    """One replicator's restores. It owns the placing (``_place``: its fetch pool)
    and the background pool (one thread: data made local after the answer, over
    ``FETCH_STREAMS`` streams of its own), and the steps queued there
    (``_materializing``, under ``_bg_lock``).
    ``inventory``: its node's own; ``refuse``: raises while the node's
    configuration disagrees with a peer's."""

    def __init__(self, config: ReplicatorConfig, store: LocalStore,
                 peers: Mapping[int, Peer], metrics: Metrics, *,
                 agreement: NodeAgreement, backups: BackupDuties,
                 inventory: Callable[[], pb.Inventory], refuse: Callable[[], None],
                 reserve: Reserve) -> None:
        self.rank = config.rank
        self.config = config
        self.store = store
        self.metrics = metrics
        self.agreement = agreement
        self.backups = backups
        self.backup = backups.backup
        self._inventory = inventory
        self._refuse = refuse
        self._stop = threading.Event()
        self._place = Materializer(config, store, peers, metrics, proofs=agreement.proofs,
                                   backups=backups, reserve=reserve)
        # After the answer: the step made local (one thread) over streams of its own,
        # every thread at the background's priority.
        self._bg_pool = ThreadPool(1, "mtc-materialize", _background_priority, lazy=True)
        self._bg_fetch = ThreadPool(FETCH_STREAMS, "mtc-fetch-bg", lazy=True,
                                            initializer=_background_priority)
        self._bg_lock = threading.Lock()
        self._materializing: dict[int, Future[str]] = {}
        self._bg_wake = threading.Event()  # ends the background fetch's quiet time early
        self.quiet_until = 0.0  # monotonic: copies that can wait wait until then
        self._last_rid = ""  # the restore id of the last PrepareRestore (under _bg_lock)

    def start(self, threads: Threads) -> None:
        pass  # no thread of its own: its pools', and its callers'

    def stop(self) -> None:
        """A background fetch waiting out its quiet time starts (and finds the stop)."""
        self._stop.set()
        self._bg_wake.set()

    def close(self) -> None:
        """After the servers ended: the background restore first (it waits on the
        fetch pool's calls), then the fetch pool."""
        for pool in (self._bg_pool, self._bg_fetch):
            pool.shutdown(wait=True, cancel_futures=True)
        self._place.close()

    # -- agree --------------------------------------------------------------------------

    def agree(self, timeout_s: float | None = None, *, ask: RestoreAsk | None = None
              ) -> tuple[pb.Decision, dict[int, pb.Inventory]]:
        """The epoch's decision (its step and run), and inventories to find its data
        with (only this node's when its data is local: the decision itself costs
        O(N) messages). ``ask``: the restore this is for (its id and membership;
        the decision read is recorded on it)."""
        ask = ask if ask is not None else RestoreAsk()
        d = self.agreement.agree_epoch(timeout_s, ask.rid, ask.members)
        ask.decision = d
        return d, self._invs_for(d.step, d.run, ask.members or range(self.config.num_nodes))

    def _invs_for(self, step: int, run: str, members: Collection[int]
                  ) -> dict[int, pb.Inventory]:
        """Only this node's inventory when its data of the step is here and whole
        (nothing to fetch); else every node's (where to fetch from, or heal). The
        epoch's ``members`` have just asked: each is up, asked over a connection
        of its own (a member that came back a moment ago must not be skipped, or
        hosts restoring from the backup plan who reads which object apart)."""
        if step < 0 or ((self.rank, step) in self.store.copies()
                        and self._place.holds_own(step, run)):
            return {self.rank: self._inventory()}
        return self.agreement.gather(up=members)

    # -- the calls that restore -----------------------------------------------------------

    def prepare_restore_as(self, timeout_s: float | None, rid: str,
                           members: Sequence[int] = (), *, background: bool = False
                           ) -> tuple[pb.Decision, str, float, bool]:
        """PrepareRestore with a restore id and the job's membership:
        :meth:`prepare_restore` (agree, then make this host's data of the step
        local), and the decision it read."""
        self._refuse()
        check_members(members, self.config.num_nodes, self.rank)  # typed, before waiting
        ask = RestoreAsk(rid, tuple(members))
        step, tier, seconds, pending = self.prepare_restore(timeout_s, background=background,
                                                            ask=ask)
        d = ask.decision
        with self._bg_lock:
            self._last_rid = rid
        self.quiet_until = time.monotonic() + self.config.restore_quiet_s
        if d.step != step:  # the invariant, checked where it is cheap
            raise AgreementError(f"decided step {d.step}, prepared step {step}",
                                 host=self.rank)
        return d, tier, seconds, pending

    def restored(self, rid: str, step: int) -> bool:
        """The job has loaded ``step``, restored as ``rid``: a background fetch of
        the step waiting out the quiet time (kept so that the job's load had this
        host's CPUs) starts now, at the background's priority. Returns whether one
        does. Pushes to peers still wait out the quiet time: every host's pushes
        going at once too (the replaced host held copies of others' steps) would
        compete with the job's first step after a host loss for the host's CPUs
        (bench/recovery.py measures that step). A notice of another restore than
        the last one prepared here
        (late, replayed) changes nothing."""
        with self._bg_lock:
            if not rid or rid != self._last_rid:
                return False
            fetching = step in self._materializing
        if fetching:
            self._bg_wake.set()
            log.info("rank %d: the job loaded step %d; its background fetch starts",
                     self.rank, step)
        return fetching

    def staged(self, step: int) -> tuple[Path, set[str]] | None:
        """This host's files of ``step`` read so far for a restore in progress (its
        folder, and the paths there verified), served to other restoring hosts;
        None when it restores none of it. A restore answered and queued but not
        started (its quiet time) starts now, and the asker is told to ask again
        (:class:`StepNotFoundError`): it is about to hold what was asked."""
        staged = self.backups.staged(step)
        if staged is not None:
            return staged
        with self._bg_lock:
            queued = step in self._materializing
        if queued:
            self._bg_wake.set()
            raise StepNotFoundError("this host's restore of the step is starting: not read "
                                    "yet", step=step, host=self.rank)
        return None

    def restore_for_client(self, job: str, ask: RestoreAsk | None = None) -> int:
        """Answer an Orbax client: agree, park every step folder out of its sight,
        bring this host's data of the agreed step, and write the restore marker.
        ``ask``: the client's request (its restore id: re-served, it reads its
        decision again)."""
        from mtc.sidecar.replicator import orbax

        decision, invs = self.agree(ask=ask)
        step, run = decision.step, decision.run
        for name in os.listdir(self.store.root):  # a client's renamed markers: links
            if layout.step_of_name(name) is not None and \
                    os.path.islink(self.store.root / name):
                (self.store.root / name).unlink()
        for s in self.store.own.steps():
            self.store.adopt_own(s)
        if step < 0:
            orbax.write_marker(self.store.root, job, 0, self.rank, None)
            return -1
        self._place.materialize(step, invs, into_root=False, run=run)  # verified, healed if need be
        orbax.write_marker(self.store.root, job, step, self.rank,
                           self.store.copy_dir(self.rank, step))
        return step

    def prepare_restore(self, timeout_s: float | None = None, *, background: bool = False,
                        ask: RestoreAsk | None = None) -> tuple[int, str, float, bool]:
        """Agree on the step and make this host's data for it local; returns the
        step, the tier the data came from, the seconds taken and whether it is
        still on its way.

        ``background``: a host holding no copy of the step (a replaced host)
        answers once the step is agreed and fetches its data in the background
        (``pending``); the controller reads the same regions from other hosts'
        copies meanwhile. A local copy is still checked (and healed) first."""
        t0 = time.monotonic()
        decision, invs = self.agree(timeout_s, ask=ask)
        step, run = decision.step, decision.run
        if step < 0:
            return -1, "none", time.monotonic() - t0, False
        t_agreed = time.monotonic()
        into_root = self.config.framework == "mtc"
        local = self._place.holds_own(step, run)
        holdings = {r: holding_of(i) for r, i in invs.items()}
        # Under mutual TLS this host is left out of the step only on the saving hosts'
        # own words (never one host's): else it must find its own data of it.
        if not local and into_root and self.rank not in saving_ranks(
                step, holdings, self.config.num_nodes, run) and (
                self.agreement.proofs is None
                or (step, run) not in refused(holdings, [self.rank])):
            # A job grown onto this host: the step was saved by fewer hosts, none of
            # them this one. Its process reads every region from their copies.
            log.info("rank %d: step %d agreed in %.3fs; this host saved none of it (its "
                     "regions come from the hosts that did)", self.rank, step,
                     time.monotonic() - t0)
            return step, "peer", time.monotonic() - t0, False
        if background and not local:
            # Where its data will come from, said now (and when from nowhere, failed now).
            if self._place.copies_elsewhere(step, invs, run):
                coming_from = "peer"
            elif self.backup is not None and step in self.backup.refresh():
                coming_from = "backup"
            else:
                raise StepNotFoundError("no peer or backup holds this host's data", step=step,
                                        host=self.rank)
            with self._bg_lock:
                running = self._materializing.get(step)
                if running is None:
                    self._bg_wake.clear()
                    running = self._bg_pool.submit(self._materialize_logged, step, invs,
                                                   into_root, run)
                    self._materializing[step] = running
            log.info("rank %d: step %d agreed in %.3fs; its data comes from the %s tier in "
                     "the background", self.rank, step, t_agreed - t0, coming_from)
            return step, coming_from, time.monotonic() - t0, True
        with self._bg_lock:
            running = self._materializing.get(step)
        tier = None
        if running is not None:
            # Asked to wait: the background fetch's outcome (starting now, its quiet
            # time cut short: training waits for it), or a try of its own.
            self._bg_wake.set()
            try:
                tier = running.result()
            except (MtcError, OSError):  # logged there; this caller gets its own error
                pass
        if tier is None:
            tier = self._place.materialize(step, invs, into_root=into_root, run=run)
        t_end = time.monotonic()
        log.info("rank %d: step %d prepared from the %s tier: agreed in %.3fs, local in %.3fs",
                 self.rank, step, tier, t_agreed - t0, t_end - t_agreed)
        return step, tier, t_end - t0, False

    def heal_in_background(self, step: int, run: str) -> None:
        """Heal this host's damaged ``step`` (found by the scrub) from other hosts'
        copies, queued as the step's background fetch: one at a time, and a restore
        that asks for the step meanwhile waits for it instead of healing it twice."""
        with self._bg_lock:
            if step in self._materializing:
                return  # a fetch of the step is under way: it heals too
        invs = self.agreement.gather()  # where the good copies are (not under the lock)
        with self._bg_lock:
            if step not in self._materializing:
                self._materializing[step] = self._bg_pool.submit(
                    self._materialize_logged, step, invs, self.config.framework == "mtc", run)

    def _materialize_logged(self, step: int, invs: dict[int, pb.Inventory],
                            into_root: bool, run: str = "") -> str:
        """:meth:`.Materializer.materialize` on the background pool: its failure is logged and
        counted here (nobody may ask for the result); the next restore retries."""
        t0 = time.monotonic()
        try:
            # Queued at the answer: the quiet time after it starts now.
            self._bg_wake.wait(self.config.restore_quiet_s)
            if self._stop.is_set():
                raise StepNotFoundError("the replicator is stopping", step=step, host=self.rank)
            # The whole process yields while it fetches (its threads that serve
            # other hosts too): in a session of its own, its threads' nice does
            # not reach past it, and the fetch slowed the job's first step after a
            # host loss (bench/recovery.py).
            with priority.group_yields(BACKGROUND_NICE):
                tier = self._place.materialize(step, invs, into_root=into_root, run=run,
                                        pool=self._bg_fetch)
        except Exception as e:
            self.metrics.failures.labels("materialize").inc()
            log.error("rank %d: step %d could not be made local in the background: %s",
                      self.rank, step, e)
            raise
        finally:
            with self._bg_lock:
                self._materializing.pop(step, None)
        log.info("rank %d: step %d local from the %s tier in %.3fs (background)",
                 self.rank, step, tier, time.monotonic() - t0)
        return tier
