"""One host's replicator: the replication loop and garbage collection, composed
with the restore agreement (``node_agreement.py``), the restore of the agreed
step's data (``restore.py``) and the backup (``sidecar/backup/duties.py``).

Replication: the newest committed step not yet on every target is offered to
each target; files the target already holds identically are linked there, the
rest are pushed and verified on receipt; the step counts as replicated only
when the target commits the copy. Older unreplicated steps are skipped, so lag
never grows beyond one step in flight.

Threads: ``main.py`` starts and joins them all (:meth:`run`, the backup loop,
the servers). Each duty has its own pool: pushes, inventory fan-out, restore
fetches (``_pool``), so an inventory never queues behind a file fetch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from mtc.errors import (
    AgreementError,
    ConfigError,
    CorruptShardError,
    MtcError,
    StepNotFoundError,
)
from mtc.layout import root_identity
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.duties import BackupDuties
from mtc.sidecar.backup.schedule import BackupScheduler
from mtc.sidecar.replicator.agreement import (
    check_members,
)
from mtc.sidecar.replicator.client import PeerClient, PeerError
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.gc import GcInputs, gc_plan
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.node_agreement import NodeAgreement
from mtc.sidecar.replicator.push_plan import PUSH_STREAMS, push_batches, push_streams
from mtc.sidecar.replicator.restore import RestoreDuties
from mtc.sidecar.replicator.security import Credentials
from mtc.sidecar.replicator.selfcheck import ReplicationClock
from mtc.sidecar.replicator.step_files import FileMeta, fingerprint_of
from mtc.sidecar.replicator.store import LocalStore

log = logging.getLogger(__name__)
RESYNC_S = 2.0  # how often a target's holdings of our steps are re-read


class Node(BackupDuties, RestoreDuties):
    """One replicator's state. ``replicated``/``_synced`` belong to the replication
    loop's thread; ``_pushing``/``_backing_up``/``restoring`` are shared, under
    ``_lock``; the agreement records are the coordinator's (own locks)."""

    def __init__(self, config: ReplicatorConfig, root: Path, creds: Credentials,
                 backup: BackupScheduler | None = None) -> None:
        self.config = config
        self.rank = config.rank
        self.store = LocalStore(root, config.rank, orbax=config.framework == "orbax")
        self.metrics = Metrics()
        self.store.on_quarantine = self.metrics.quarantined.inc
        self.peers = {r: PeerClient(a, creds, rank=r, deadline_s=config.deadline_s,
                                    as_peer=True)
                      for r, a in enumerate(config.nodes) if r != config.rank}
        self.replicated: dict[int, set[int]] = defaultdict(set)
        # The fingerprint of each own step when ``replicated`` learnt its targets: a
        # step saved again under its number (another run's) is replicated anew.
        self._replicated_fp: dict[int, int] = {}
        self._synced: dict[int, float] = {}  # target -> when its holdings were last read
        self._pushing: set[int] = set()
        self._incoming: Any = None  # set by main: callable returning (origin, step) in transfer
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # A pool per duty: pushes, inventory fan-out, restore fetches (restore.py's _pool).
        self._push_pool = ThreadPoolExecutor(4, thread_name_prefix="mtc-push")
        self._inv_pool = ThreadPoolExecutor(16, thread_name_prefix="mtc-inventory")
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="mtc-fetch")
        # A restore answered before its data arrived (restore.py): one at a time.
        self._bg_pool = ThreadPoolExecutor(1, thread_name_prefix="mtc-materialize")
        self._bg_lock = threading.Lock()
        self._materializing: dict[int, Future[str]] = {}
        self._bg_wake = threading.Event()
        self.quiet_until = 0.0  # monotonic: copies that can wait wait until then
        self.backup = backup
        self._backing_up: set[int] = set()
        # Steps being restored from the backup: their folder and verified files,
        # served to other restoring hosts that share objects with this one.
        self.restoring: dict[int, tuple[Path, set[str]]] = {}
        self.heartbeat = time.monotonic()  # the replication loop's last pass (health)
        self.data_port = 0  # the data channel's, once serving (server.serve)
        # How this node's flags disagree with a peer's (selfcheck.check_peers, at
        # start): while set, it refuses restores and copies nothing.
        self.config_error = ""
        self.replication = ReplicationClock(config.replication_warn_s)
        # The restore agreement: deciding, asking, and the inventories both gather.
        self.agreement = NodeAgreement(
            config, root, self.store, self.peers, self.metrics,
            inventory=lambda files: self.inventory(files=files),
            refuse=self.refuse_if_misconfigured, stop=self._stop, pool=self._inv_pool)

    # -- inventory ----------------------------------------------------------------

    def inventory(self, origins: frozenset[int] | None = None, *,
                  files: bool = True) -> pb.Inventory:
        """What this node holds, verified; ``origins``: only copies of those ranks;
        ``files``: with each copy's file list (a fetch needs it, holdings do not:
        about 180 entries per copy, built, sent and parsed on every GC gather)."""
        backed = self.backup.backed_up_steps() if self.backup else []
        inv = pb.Inventory(rank=self.rank, newest_backed_up_step=backed[-1] if backed else -1,
                           backed_up_steps=backed,
                           last_decision=self.agreement.last_decision)
        # Only copies whose bytes check out (cached per file): what agreement
        # decides on has been verified, not just listed.
        for origin, step, held in self.store.verified_copies(origins):
            try:
                summary = self.store.summary(origin, step)
            except OSError:
                continue  # deleted since it was verified
            c = inv.copies.add(step=step, origin_rank=origin, saved_hosts=summary.num_hosts,
                               run=summary.run, fingerprint=fingerprint_of(held),
                               saving_ranks=summary.ranks)
            if files:
                for f in held:
                    c.files.add(path=f.path, size=f.size, crc32c=f.crc32c)
        inv.quarantined_files = self.store.quarantined_total
        return inv

    def identity(self) -> pb.Inventory:
        """Who this node is, without its copies: rank, configuration, the identity of
        the RAM disk it serves, whether its configuration disagrees with a peer's,
        and how its replication is doing (``GetInventory(identify=true)``)."""
        step, waited, late = self.replication.state()
        return pb.Inventory(
            rank=self.rank, root_id=root_identity(self.store.root, create=False),
            config=pb.NodeConfig(nodes=self.config.nodes,
                                 nodes_per_slice=self.config.nodes_per_slice),
            config_error=self.config_error, unreplicated_step=step,
            unreplicated_seconds=waited, replication_late=late,
            quarantined_files=self.store.quarantined_total, data_port=self.data_port)

    def disagrees(self, problem: str) -> None:
        """A peer's configuration disagrees with this node's (selfcheck.check_peers)."""
        self.config_error = "; ".join(filter(None, [self.config_error, problem]))
        self.metrics.config_mismatch.set(1)
        log.error("rank %d: configuration disagrees with a peer's (%s): this node refuses "
                  "restores and copies nothing until every replicator runs with the same "
                  "--nodes and --nodes-per-slice and its own --rank", self.rank, problem)

    def refuse_if_misconfigured(self) -> None:
        if self.config_error:
            raise ConfigError(f"replicator configuration disagrees with a peer's: "
                              f"{self.config_error}", host=self.rank)

    # -- replication ----------------------------------------------------------------

    def run(self) -> None:
        """The replication loop (its thread is main's); ends when :meth:`stop` is called."""
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            try:
                if not self.config_error:  # copies to the wrong peers help nobody
                    self.replicate_once()
                    self.collect_garbage()
            except Exception:
                log.exception("replication pass failed")
                self.metrics.failures.labels("loop").inc()
            self._stop.wait(self.config.poll_s)

    def backup_loop(self) -> None:
        """The backup loop (its thread is main's); returns at once without a backup store."""
        if self.backup is not None:
            self._backup_loop()

    def gather(self) -> dict[int, pb.Inventory]:
        """Every reachable node's inventory (the backup's question)."""
        return self.agreement.gather()

    def newest_complete_run(self, invs: dict[int, pb.Inventory]) -> tuple[int, str]:
        """The newest step held whole on hosts, and its run (the backup's question)."""
        return self.agreement.newest_complete_run(invs)

    def stop(self) -> None:
        """Ask the loops and any restore waiting for its decision to end (main joins
        their threads)."""
        self._stop.set()
        self._bg_wake.set()
        self.agreement.close()
        for p in self.peers.values():
            p.close()  # cancels calls in flight (a Decide waiting for its epoch, a push)

    def close(self) -> None:
        """After the loops and the server ended: finish the pools."""
        # The background restore first: it waits on the fetch pool's calls.
        for pool in (self._bg_pool, self._push_pool, self._inv_pool, self._pool):
            pool.shutdown(wait=True, cancel_futures=True)

    def fully_replicated(self, step: int) -> bool:
        return set(self.config.targets(self.rank)) <= self.replicated.get(step, set())

    def sync_targets(self, own: list[int]) -> None:
        """Learn which own steps each target really holds: once after a start (nothing
        is remembered across restarts) and every few seconds after (a replaced
        peer has lost its copies, which must be pushed again)."""
        now = time.monotonic()
        for t in self.config.targets(self.rank):
            if now - self._synced.get(t, -RESYNC_S) < RESYNC_S:
                continue
            try:
                inv = self.peers[t].call(
                    "GetInventory", pb.InventoryRequest(origins=[self.rank], without_files=True),
                    attempts=1)
            except PeerError:
                self.metrics.skipped.labels("target_unanswered").inc()
                continue
            # Held as saved here: a copy of an older save under the number is not.
            held = {c.step for c in inv.copies if c.origin_rank == self.rank
                    and c.fingerprint == self._own_fingerprint(c.step)}
            for s in own:
                if s in held:
                    self.replicated[s].add(t)
                else:
                    self.replicated[s].discard(t)
            self._synced[t] = now

    def replicate_once(self) -> None:
        if time.monotonic() < self.quiet_until:
            return  # a restore was just answered: its reads and steps go first
        own = self.store.own_steps()
        if not own:
            self._note_replication(-1, True)
            return
        newest = own[-1]
        fp = self._own_fingerprint(newest)
        if self._replicated_fp.get(newest) != fp:  # saved (again) since it was replicated
            self.replicated[newest] = set()
            self._replicated_fp[newest] = fp
        self.sync_targets(own)
        self.metrics.newest.labels("committed").set(newest)
        for target in self.config.targets(self.rank):
            if target in self.replicated[newest]:
                continue
            try:
                self.push_step(newest, target)
            except (MtcError, OSError) as e:
                if isinstance(e, PeerError):
                    kind = "peer_unreachable" if e.unreachable else "peer_refused"
                else:
                    kind = type(e).__name__
                self.metrics.failures.labels(kind).inc()
                log.warning("rank %d: step %d not replicated to rank %d: %s",
                            self.rank, newest, target, e)
        done = [s for s in own if self.fully_replicated(s)]
        self._note_replication(newest, self.fully_replicated(newest))
        if done:
            self.metrics.newest.labels("replicated").set(done[-1])
        self.metrics.lag.set(sum(1 for s in own if not done or s > done[-1]))

    def _note_replication(self, newest: int, replicated: bool) -> None:
        self.replication.update(newest, replicated)
        self.metrics.unreplicated.set(self.replication.state()[1])
        warning = self.replication.warn_once()
        if warning:
            log.warning("rank %d: %s (targets: ranks %s)", self.rank, warning,
                        self.config.targets(self.rank))

    def _own_fingerprint(self, step: int) -> int:
        try:
            return self.store.fingerprint(self.rank, step)
        except (OSError, ValueError):
            return -1  # deleted meanwhile

    def push_step(self, step: int, target: int) -> None:
        """Copy one own step to ``target``; returns once the target committed it."""
        peer = self.peers[target]
        with self._lock:
            self._pushing.add(step)
        try:
            files = self.store.describe(self.rank, step)
            bad = self.store.verify(self.rank, step)  # never offer bytes that fail
            if bad:
                raise CorruptShardError("own copy fails verification; quarantined, not "
                                        "offered", step=step, host=self.rank, path=bad[0].path)
            offer = pb.OfferRequest(copy=pb.StepCopy(
                step=step, origin_rank=self.rank,
                files=[pb.FileInfo(path=f.path, size=f.size, crc32c=f.crc32c) for f in files]))
            reply = peer.call("Offer", offer)
            if reply.already_complete:
                self.replicated[step].add(target)
                return
            src = self.store.copy_dir(self.rank, step)
            # A candidate without a hash is the same path of the same step with the
            # same size and CRC32C (a twin's shard): taken as the peer identified it.
            same = [c.path for c in reply.candidates
                    if not c.sha256 or self.store.checksums.sha256(src / c.path) == c.sha256]
            if same:
                peer.call("Link", pb.LinkRequest(transfer_id=reply.transfer_id, paths=same))
            linked = set(same)
            todo = [(i, f) for i, f in enumerate(files) if f.path not in linked]
            if reply.data_port:
                peer.data_port = reply.data_port
            try:
                if reply.data_port and todo:
                    # The data channel: a few connections, each files back to back.
                    futs = [self._push_pool.submit(self._push_stream, peer, reply.transfer_id,
                                                   src, group)
                            for group in push_streams(todo, PUSH_STREAMS)]
                else:
                    futs = [self._push_pool.submit(self._push_batch, peer, reply.transfer_id,
                                                   src, batch) for batch in push_batches(todo)]
                for fut in futs:
                    fut.result()
                peer.call("Commit", pb.CommitRequest(transfer_id=reply.transfer_id))
            except BaseException:
                try:
                    peer.call("Abort", pb.AbortRequest(transfer_id=reply.transfer_id),
                              attempts=1)
                except PeerError:
                    self.metrics.skipped.labels("abort_unanswered").inc()
                raise
            self.replicated[step].add(target)
            log.info("rank %d: step %d replicated to rank %d (%d files linked, %d pushed)",
                     self.rank, step, target, len(same), len(todo))
        finally:
            with self._lock:
                self._pushing.discard(step)

    def _push_batch(self, peer: PeerClient, tid: str, src: Path,
                    batch: list[tuple[int, FileMeta]]) -> None:
        try:
            if len(batch) == 1:
                f = batch[0][1]
                peer.push_file(tid, f.path, src / f.path, f.size, f.crc32c)
            else:
                peer.push_files(tid, [(i, src / f.path, f.size, f.crc32c) for i, f in batch])
        except CorruptShardError:
            # Damaged since it was last checked: read it again, quarantine what fails.
            where = self.store.locate(src / batch[0][1].path)
            if where is not None:
                self.store.verify(*where, cached=False)
            raise
        self.metrics.bytes_sent.inc(sum(f.size for _, f in batch))

    def _push_stream(self, peer: PeerClient, tid: str, src: Path,
                     group: list[tuple[int, FileMeta]]) -> None:
        try:
            peer.push_data(tid, [(i, src / f.path, f.size, f.crc32c) for i, f in group])
        except (PeerError, CorruptShardError) as e:
            if isinstance(e, CorruptShardError) or e.code == grpc.StatusCode.DATA_LOSS:
                # The target found a file damaged: ours, read again, quarantined if so.
                where = self.store.locate(src / group[0][1].path)
                if where is not None:
                    self.store.verify(*where, cached=False)
            raise
        self.metrics.bytes_sent.inc(sum(f.size for _, f in group))

    def staged(self, step: int) -> tuple[Path, set[str]] | None:
        """This host's files of ``step`` read so far for a restore in progress (its
        folder, and the paths there verified), served to other restoring hosts;
        None when it restores none of it. A restore answered and queued but not
        started (its quiet time) starts now, and the asker is told to ask again
        (:class:`StepNotFoundError`): it is about to hold what was asked."""
        with self._lock:
            staged = self.restoring.get(step)
        if staged is not None:
            return staged
        with self._bg_lock:
            queued = step in self._materializing
        if queued:
            self._bg_wake.set()
            raise StepNotFoundError("this host's restore of the step is starting: not read "
                                    "yet", step=step, host=self.rank)
        return None

    def on_copy_received(self, origin: int, step: int) -> None:
        log.info("rank %d: holds a verified copy of rank %d step %d", self.rank, origin, step)

    # -- garbage collection -------------------------------------------------------

    def collect_garbage(self) -> None:
        own = self.store.own_steps()
        replicas = self.store.replica_steps()
        with self._lock:
            busy = self._pushing | self._backing_up
        args = GcInputs(
            own=tuple(own), replicated=tuple(s for s in own if self.fully_replicated(s)),
            replicas={o: tuple(v) for o, v in replicas.items()}, keep=self.config.keep,
            busy=frozenset(busy),
            synced=all(t in self._synced for t in self.config.targets(self.rank)),
            linked=frozenset(s for s in replicas.get(self.rank, [])
                             if (self.store.root / str(s)).is_symlink()),
            rank=self.rank)
        plan = gc_plan(args, None)
        if plan.needs_complete:
            # Local rules cannot see that another host failed to commit or replicate a
            # newer step: never delete the newest step every rank can still be
            # restored from, as the coordinator sees it after this question.
            complete = self.agreement.complete_step()
            if complete is None:
                self.metrics.skipped.labels("gc_no_complete_view").inc()
                return
            plan = gc_plan(args, complete)
        for s in plan.own:
            self.store.remove_copy(self.rank, s)
            self.replicated.pop(s, None)
            self._replicated_fp.pop(s, None)
        for origin, s in plan.replicas:
            self.store.remove_copy(origin, s)

    # -- restore: agree (node_agreement.py), then bring the data (restore.py) --------

    def agree(self, timeout_s: float | None = None, *, ask: RestoreAsk | None = None
              ) -> tuple[pb.Decision, dict[int, pb.Inventory]]:
        """The epoch's decision (its step and run), and inventories to find its data
        with (only this node's when its data is local: the decision itself costs
        O(N) messages). ``ask``: the restore this is for (its id and membership;
        the decision read is recorded on it)."""
        ask = ask if ask is not None else RestoreAsk()
        d = self.agreement.agree_epoch(timeout_s, ask.rid, ask.members)
        ask.decision = d
        return d, self._invs_for(d.step, d.run)

    def _invs_for(self, step: int, run: str) -> dict[int, pb.Inventory]:
        """Only this node's inventory when its data of the step is here and whole
        (nothing to fetch); else every node's (where to fetch from, or heal)."""
        if step < 0 or ((self.rank, step) in self.store.copies() and self.holds_own(step, run)):
            return {self.rank: self.inventory()}
        return self.agreement.gather()

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

    def prepare_restore_as(self, timeout_s: float | None, rid: str,
                           members: Sequence[int] = (), *, background: bool = False
                           ) -> tuple[pb.Decision, str, float, bool]:
        """PrepareRestore with a restore id and the job's membership: restore.py's
        ``prepare_restore`` (agree, then make this host's data of the step local),
        and the decision it read."""
        self.refuse_if_misconfigured()
        check_members(members, self.config.num_nodes, self.rank)  # typed, before waiting
        ask = RestoreAsk(rid, tuple(members))
        step, tier, seconds, pending = self.prepare_restore(timeout_s, background=background,
                                                            ask=ask)
        d = ask.decision
        self.quiet_until = time.monotonic() + self.config.restore_quiet_s
        if d.step != step:  # the invariant, checked where it is cheap
            raise AgreementError(f"decided step {d.step}, prepared step {step}",
                                 host=self.rank)
        return d, tier, seconds, pending


@dataclasses.dataclass
class RestoreAsk:
    """One restore, as the call that carries it (a PrepareRestore, an Orbax client's
    request) hands it to the agreement: its restore id (a re-issued ask reads the
    same decision) and the job's stated membership; the decision read is recorded
    here for the caller. Passed explicitly; owned by that call's thread."""

    rid: str = ""
    members: tuple[int, ...] = ()
    decision: pb.Decision = dataclasses.field(default_factory=pb.Decision)
