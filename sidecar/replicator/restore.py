"""A replicator's restores: agree on the step (``node_agreement.py``), then bring
this host's data of it from its own RAM disk, a peer that holds a copy, or the
backup, and answer Orbax's client with the restore marker. Every byte is
verified on arrival."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from mtc import layout
from mtc.errors import AgreementError, CorruptShardError, MtcError, StepNotFoundError
from mtc.lifecycle import Threads
from mtc.pool import lower_thread_priority
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar import priority
from mtc.sidecar.replicator.decision import check_members, saving_ranks
from mtc.sidecar.replicator.fetch_plan import fetch_batches, fetch_order, heal_sources
from mtc.sidecar.replicator.node_agreement import holders_of, holding_of
from mtc.sidecar.replicator.provenance import not_signed
from mtc.sidecar.replicator.step_files import FileMeta, inside
from mtc.sidecar.storage.checksum import copy_verified
from mtc.sidecar.storage.names import tmp_dir

if TYPE_CHECKING:
    from mtc.sidecar.backup.duties import BackupDuties
    from mtc.sidecar.replicator.client import PeerClient
    from mtc.sidecar.replicator.config import ReplicatorConfig
    from mtc.sidecar.replicator.metrics import Metrics
    from mtc.sidecar.replicator.node_agreement import NodeAgreement
    from mtc.sidecar.replicator.peer_data import Opener
    from mtc.sidecar.replicator.store import LocalStore
    from mtc.sidecar.reserve import Reserve

log = logging.getLogger("mtc.sidecar.replicator.node")
FETCH_STREAMS = 4  # a restore's streams from one holder: the fetch pool's threads
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
    """One replicator's restores. It owns the fetch pool (``FETCH_STREAMS``
    threads) and the background pool (one thread: data made local after the
    answer), and the steps queued there (``_materializing``, under ``_bg_lock``).
    ``inventory``: its node's own; ``refuse``: raises while the node's
    configuration disagrees with a peer's."""

    def __init__(self, config: ReplicatorConfig, store: LocalStore,
                 peers: Mapping[int, PeerClient], metrics: Metrics, *,
                 agreement: NodeAgreement, backups: BackupDuties,
                 inventory: Callable[[], pb.Inventory], refuse: Callable[[], None],
                 reserve: Reserve) -> None:
        self.rank = config.rank
        # Blank files set aside for this host's own data (a replaced host's fetch:
        # ReplicationLoop.set_aside_for_restore); fetched files take their places.
        self._reserve = reserve
        self.config = config
        self.store = store
        self.peers = peers
        self.metrics = metrics
        self.agreement = agreement
        self.backups = backups
        self.backup = backups.backup
        self._inventory = inventory
        self._refuse = refuse
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(FETCH_STREAMS, thread_name_prefix="mtc-fetch")
        # After the answer: the step made local (one thread) over streams of its own,
        # every thread at the background's priority.
        self._bg_pool = ThreadPoolExecutor(1, thread_name_prefix="mtc-materialize",
                                           initializer=_background_priority)
        self._bg_fetch = ThreadPoolExecutor(FETCH_STREAMS, thread_name_prefix="mtc-fetch-bg",
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
        for pool in (self._bg_pool, self._bg_fetch, self._pool):
            pool.shutdown(wait=True, cancel_futures=True)

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
        if step < 0 or ((self.rank, step) in self.store.copies() and self.holds_own(step, run)):
            return {self.rank: self._inventory()}
        return self.agreement.gather(up=members)

    def holds_own(self, step: int, run: str) -> bool:
        """Whether this host holds its own data of ``step`` as ``run`` wrote it
        (damaged files included: they are healed in place)."""
        if (self.rank, step) not in self.store.copies() and \
                not self.store.damaged(self.rank, step):
            return False
        try:
            return not run or self.store.summary(self.rank, step)[1] == run
        except OSError:
            return False

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
        going at once too (the replaced host held copies of others' steps) cost
        the job's first step after a host loss about 0.4 s here (bench/recovery.py,
        two cores). A notice of another restore than the last one prepared here
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
        for s in self.store.own_steps():
            self.store.adopt_own(s)
        if step < 0:
            orbax.write_marker(self.store.root, job, 0, self.rank, None)
            return -1
        self.materialize(step, invs, into_root=False, run=run)  # verified, healed if need be
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
        local = self.holds_own(step, run)
        if not local and into_root and self.rank not in saving_ranks(
                step, {r: holding_of(i) for r, i in invs.items()}, self.config.num_nodes, run):
            # A job grown onto this host: the step was saved by fewer hosts, none of
            # them this one. Its process reads every region from their copies.
            log.info("rank %d: step %d agreed in %.3fs; this host saved none of it (its "
                     "regions come from the hosts that did)", self.rank, step,
                     time.monotonic() - t0)
            return step, "peer", time.monotonic() - t0, False
        if background and not local:
            # Where its data will come from, said now (and when from nowhere, failed now).
            if self._copies_elsewhere(step, invs, run):
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
            tier = self.materialize(step, invs, into_root=into_root, run=run)
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
        """:meth:`materialize` on the background pool: its failure is logged and
        counted here (nobody may ask for the result); the next restore retries."""
        t0 = time.monotonic()
        try:
            # Queued at the answer: the quiet time after it starts now.
            self._bg_wake.wait(self.config.restore_quiet_s)
            if self._stop.is_set():
                raise StepNotFoundError("the replicator is stopping", step=step, host=self.rank)
            # The whole process yields while it fetches (its threads that serve
            # other hosts too): in a session of its own, its threads' nice does
            # not reach past it, and the job's first step after a host loss took
            # 0.2 s longer (bench/recovery.py).
            with priority.group_yields(BACKGROUND_NICE):
                tier = self.materialize(step, invs, into_root=into_root, run=run,
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

    def materialize(self, step: int, invs: dict[int, pb.Inventory], *, into_root: bool,
                    run: str = "", pool: ThreadPoolExecutor | None = None) -> str:
        """Make this host's data of ``step`` (as ``run`` wrote it; "": whatever run)
        local and verified; returns the tier it came from ("local", "peer" or
        "backup"). A copy held here of another run under the same number is another
        checkpoint: it is removed and this run's fetched.

        A local copy is checked file by file first (for Orbax clients every byte is
        read again: their reader checks nothing); a file that fails is quarantined
        and fetched again, verified, from another holder: the copies of this rank's
        data, then an identical file of another data-parallel replica, then the
        backup. No good copy anywhere: CorruptShardError naming the file. ``pool``:
        the threads that fetch (default: the restore's own)."""
        if not self.holds_own(step, run) and (self.store.copy_dir(self.rank, step).exists()):
            log.warning("rank %d: its copy of step %d was written by another run than the "
                        "agreed one (%s): replaced", self.rank, step, run)
            self.store.remove_copy(self.rank, step)
        if self.holds_own(step, run):
            bad = self.store.verify(self.rank, step, cached=self.config.framework == "mtc")
            if not bad:
                return "local"
            log.warning("rank %d: step %d has %d bad files (%s, ...); healing", self.rank,
                        step, len(bad), bad[0].path)
            tmp = self.store.begin_incoming(self.rank, step)
            try:
                tiers = self._fetch_all(step, self.rank, invs, bad, tmp, run, pool)
                self.store.repair(self.rank, step, {f.path: tmp / f.path for f in bad})
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            self.metrics.healed.inc(len(bad))
            return "backup" if "backup" in tiers else "peer"
        sources = self._copies_elsewhere(step, invs, run)
        tmp = (tmp_dir(self.store.root, step) if into_root
               else self.store.begin_incoming(self.rank, step))
        try:
            if sources:
                files = [FileMeta(f.path, f.size, f.crc32c) for f in sources[0][1].files]
                tiers = self._fetch_all(step, sources[0][1].origin_rank, invs, files, tmp,
                                        run, pool)
                # Its origin's signed SHA-256s, before the step is placed (provenance).
                forged = (not_signed(tmp, sources[0][1], (pool or self._pool).map)
                          if self.agreement.proofs is not None else None)
                if forged is not None:
                    self.metrics.unproven.inc()
                    raise CorruptShardError(f"fetched bytes are not the ones rank "
                                            f"{sources[0][1].origin_rank} signed", step=step,
                                            host=self.rank, path=forged)
                tier = "backup" if "backup" in tiers else "peer"
            elif self.backup is not None and step in self.backup.refresh():
                files = self.backups.from_backup(step, invs, tmp)
                tier = "backup"
            else:
                raise StepNotFoundError("no peer or backup holds this host's data", step=step,
                                        host=self.rank)
            self.store.commit_restored(tmp, step, files, into_root=into_root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            # Served from the committed copy from here on (from_backup staged it).
            self.backups.done_restoring(step)
            self._reserve.forget(self.rank)  # what was set aside for it and not used
        return tier

    def _copies_elsewhere(self, step: int, invs: dict[int, pb.Inventory], run: str = ""
                          ) -> list[tuple[int, pb.StepCopy]]:
        """Other hosts' copies this host's data of ``step`` (of ``run``) can come
        from: of its own data first, else of the first equivalent rank's that has
        some."""
        held = holders_of(invs, run or None)
        for origin in self.config.equivalent(self.rank):
            sources = [(h, c) for h, c in held.get((origin, step), []) if h != self.rank]
            if sources:
                return sources
        return []

    def _fetch_all(self, step: int, origin: int, invs: dict[int, pb.Inventory],
                   files: list[FileMeta], tmp: Path, run: str = "",
                   pool: ThreadPoolExecutor | None = None) -> set[str]:
        """Fetch ``files`` (of ``origin``'s copy of ``step``, this rank's data or a
        stand-in for it, of ``run``) into ``tmp`` on ``pool``'s threads (default:
        the restore's); returns the tiers used."""
        pool = pool or self._pool
        sources = heal_sources(self.rank, step, origin, files, invs, run)
        orders = [fetch_order(self.rank, *sources.get(f.path, ([], [])), i)
                  for i, f in enumerate(files)]
        # The files whose first source is another host come in a few streams (a call
        # per file costs more than its bytes); what a stream did not bring, verified,
        # is fetched file by file from every source, as before.
        batches = fetch_batches([o[0] if o else None for o in orders], self.rank,
                                FETCH_STREAMS)
        futs = {pool.submit(self._fetch_batch, holder, src_origin, step,
                                  [files[k] for k in ks], tmp): ks
                for (holder, src_origin), ks in batches}
        done: set[int] = set()
        for fut, ks in futs.items():
            got = set(fut.result())
            done.update(k for k in ks if files[k].path in got)
        rest = [pool.submit(self._fetch, orders[k], step, files[k], tmp)
                for k in range(len(files)) if k not in done]
        tiers = {fut.result() for fut in rest}
        return tiers | {"peer"} if done else tiers

    def _fetch_batch(self, holder: int, origin: int, step: int, files: list[FileMeta],
                     tmp: Path) -> list[str]:
        """Files of ``origin``'s copy of ``step`` from ``holder`` in one stream; the
        paths that arrived verified."""
        got, err = self.peers[holder].data.fetch_files(step, origin, files, tmp,
                                                       opener=self._opener())
        sizes = {f.path: f.size for f in files}
        self.metrics.bytes_fetched.inc(sum(sizes[p] for p in got))
        if err is not None:
            self.metrics.failures.labels("fetch").inc()
            log.warning("rank %d: %d of %d files of step %d from rank %d (origin %d) in one "
                        "stream; the rest one by one: %s", self.rank, len(got), len(files),
                        step, holder, origin, err)
        return got

    def _opener(self) -> Opener | None:
        """Fetched files of this host's data into the blank files set aside for it
        (pages the RAM disk allocated ahead, written at the speed of memory)."""
        reserve, key = self._reserve, self.rank
        if not reserve.wants(key):
            return None

        def opener(base: Path, rel: str, size: int) -> int:
            return reserve.open_new(base, rel, size, key)
        return opener

    def _fetch(self, sources: list[tuple[int, int]], step: int, f: FileMeta, tmp: Path) -> str:
        """One file from ``sources`` (``(holder, origin)``, in order), then the backup."""
        errors: list[str] = []
        dest = inside(tmp, f.path)  # a holder's path: checked before anything is written
        dest.parent.mkdir(parents=True, exist_ok=True)
        for holder, origin in sources:
            try:
                if holder == self.rank:  # another copy held here (a data-parallel twin)
                    src = self.store.copy_dir(origin, step) / f.path
                    copy_verified(src, dest, f.size, f.crc32c)
                else:
                    self.peers[holder].data.fetch_file(step, origin, f.path, dest, f.size,
                                                  f.crc32c)
                    self.metrics.bytes_fetched.inc(f.size)
                return "peer"
            except (MtcError, OSError) as e:
                self.metrics.failures.labels("fetch").inc()
                log.warning("rank %d: %s of step %d from rank %d (origin %d) failed: %s",
                            self.rank, f.path, step, holder, origin, e)
                errors.append(f"rank {holder}: {_bare(e)}")
        if self.backup is not None:
            try:
                if self.backups.file_from_backup(step, f, dest):
                    return "backup"
                errors.append("backup: not backed up")
            except (MtcError, OSError) as e:
                self.metrics.failures.labels("fetch").inc()
                errors.append(f"backup: {_bare(e)}")
        raise CorruptShardError(f"no good copy on any holder ({'; '.join(errors) or 'none'})",
                                step=step, host=self.rank, path=f.path)


def _bare(e: BaseException) -> str:
    """An error's message without its step/host/file suffix: the error it goes into
    names them once ("(host 1) (host 0) (host 1)" otherwise)."""
    if not isinstance(e, MtcError):
        return str(e)
    return e.message
