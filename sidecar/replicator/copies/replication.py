"""A replicator's copies of its own steps to its targets (the hosts of the other
slices that hold this host's data, ``ReplicatorConfig.targets``).

The newest committed step not yet on every target is offered to each target;
files the target already holds identically are linked there, the rest are
pushed (on the data channel, a few streams at once) and verified on receipt;
the step counts as replicated only when the target commits the copy. Older
unreplicated steps are skipped, so lag never grows beyond one step in flight.

Once the newest step is on every target, a kept older step that a target does
not hold (skipped while a newer one was in flight, found damaged by the target's
scrub, lost with a target replaced empty) is pushed to it, one a pass, newest first
(:func:`older_to_restore`), at most ``COPIES_AGAIN_MAX`` times: the redundancy the
job had comes back without a new save.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence, Set
from pathlib import Path

import grpc

from mtc.errors import CorruptShardError, MtcError
from mtc.grpc_errors import PeerError
from mtc.lifecycle import Threads
from mtc.pool import ThreadPool
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.copies.provenance import Signer
from mtc.sidecar.replicator.copies.push_plan import PUSH_STREAMS, push_batches, push_streams
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.selfcheck import PeerReach, ReplicationClock
from mtc.sidecar.replicator.store import claims
from mtc.sidecar.replicator.store.copy_proofs import OwnProofs
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.store.store import LocalStore
from mtc.sidecar.replicator.transport import Peer

log = logging.getLogger(__name__)
RESYNC_S = 2.0  # how often a target's holdings of our steps are re-read
# How often one older step is pushed again to one target: a target that keeps
# fewer copies than this host keeps steps (another --keep) deletes it each time.
COPIES_AGAIN_MAX = 3


def older_to_restore(own: Sequence[int], keep: int, held: Set[int]) -> int | None:
    """The older own step to push to a target once the newest is on it: the newest
    of the steps this host keeps (its newest ``keep``, oldest first in ``own``) but
    the newest that the target does not hold (``held``), or None. Steps older than
    those are the target's to delete, never pushed again."""
    for s in reversed(own[-keep:][:-1]):
        if s not in held:
            return s
    return None


def failure_kind(e: Exception) -> str:
    """A failed push's ``mtc_failures_total`` kind: a peer away or refusing, or the
    error's type."""
    if isinstance(e, PeerError):
        return "peer_unreachable" if e.unreachable else "peer_refused"
    return type(e).__name__


class Replication:
    """Copies of own steps. ``replicated``/``_replicated_fp``/``_synced`` belong to
    the replication loop's thread; ``_pushing`` is shared (:meth:`busy`), under
    ``_lock``. It owns the push pool. ``quiet_until``: when copies that can wait
    may start again (a restore was just answered)."""

    def __init__(self, config: ReplicatorConfig, store: LocalStore,
                 peers: Mapping[int, Peer], metrics: Metrics, *,
                 quiet_until: Callable[[], float], reach: PeerReach | None = None,
                 signer: Signer | None = None) -> None:
        self.rank = config.rank
        self.config = config
        self.store = store
        self.peers = peers
        self.metrics = metrics
        self._quiet_until = quiet_until
        # Which targets answer (the node's, shown in its identity).
        self.reach = reach if reach is not None else PeerReach()
        self.clock = ReplicationClock(config.replication_warn_s)
        # Read at each scrape, not at the last pass: a pass may be far behind.
        self.metrics.unreplicated.set_function(lambda: self.clock.state()[1])
        self._empty_passes = 0
        self.replicated: dict[int, set[int]] = defaultdict(set)
        # The fingerprint of each own step when ``replicated`` learnt its targets: a
        # step saved again under its number (another run's) is replicated anew.
        self._replicated_fp: dict[int, int] = {}
        self._synced: dict[int, float] = {}  # target -> when its holdings were last read
        self._lock = threading.Lock()
        self._pushing: set[int] = set()
        self._copied_again: dict[tuple[int, int], int] = defaultdict(int)  # (target, step)
        # Own step -> every target seen holding it since this start (``replicated``
        # drops a target that lost its copy; this does not): an older step pushed
        # to a target in it is a lost copy pushed again, else one a newer step
        # went ahead of.
        self._had: dict[int, set[int]] = defaultdict(set)
        self._push_pool = ThreadPool(4, "mtc-push", lazy=True)
        # With mutual TLS: each own step offered with this rank's signed proof.
        self.own_proofs = OwnProofs(self.rank, signer) if signer is not None else None
        self._failing: dict[int, str] = {}  # target -> the kind of its pushes' last failure
        # Target -> until when it is not called: one whose push found nobody there is
        # tried again after RESYNC_S, not at every pass (a call to an address where
        # nobody listens takes its retries' backoff, and the pass's garbage
        # collection waits for it).
        self._away: dict[int, float] = {}

    def start(self, threads: Threads) -> None:
        pass  # no thread of its own: it runs on the loop's, and its push pool

    def stop(self) -> None:
        pass  # its pushes end with the peers' calls (Node.stop closes them)

    def close(self) -> None:
        self._push_pool.shutdown(wait=True, cancel_futures=True)
        if self.own_proofs is not None:
            self.own_proofs.close()

    def busy(self) -> set[int]:
        """Own steps being pushed now."""
        with self._lock:
            return set(self._pushing)

    def synced(self) -> bool:
        """Whether every target's holdings were read since the start."""
        return all(t in self._synced for t in self.config.targets(self.rank))

    def away(self, target: int) -> bool:
        """Whether ``target`` did not answer a moment ago (it is not called meanwhile)."""
        return time.monotonic() < self._away.get(target, 0.0)

    def _held(self, step: int, target: int) -> None:
        self.replicated[step].add(target)
        self._had[step].add(target)

    def forget(self, step: int) -> None:
        """An own step was removed (by garbage collection)."""
        self.replicated.pop(step, None)
        self._had.pop(step, None)
        self._replicated_fp.pop(step, None)
        for key in [k for k in self._copied_again if k[1] == step]:
            del self._copied_again[key]

    def fully_replicated(self, step: int) -> bool:
        return set(self.config.targets(self.rank)) <= self.replicated.get(step, set())

    def sync_targets(self, own: list[int]) -> None:
        """Learn which own steps each target really holds: once after a start (nothing
        is remembered across restarts) and every few seconds after (a replaced
        peer has lost its copies, which must be pushed again)."""
        now = time.monotonic()
        for t in self.config.targets(self.rank):
            if now - self._synced.get(t, -RESYNC_S) < RESYNC_S or self.away(t):
                continue
            try:
                inv = self.peers[t].inventory(
                    pb.InventoryRequest(origins=[self.rank], without_files=True), attempts=1)
            except PeerError as e:
                self.metrics.skipped.labels("target_unanswered").inc()
                if e.unreachable:
                    self.reach.failed(t, e.message)
                else:
                    self.reach.answered(t)  # a refusal is an answer (the log names it)
                continue
            self.reach.answered(t)
            self._away.pop(t, None)
            # Held as saved here: a copy of an older save under the number is not.
            held = {c.step for c in inv.copies if c.origin_rank == self.rank
                    and c.fingerprint == self._own_fingerprint(c.step)}
            for s in own:
                if s in held:
                    self._held(s, t)
                else:
                    self.replicated[s].discard(t)
            self._synced[t] = now

    def replicate_once(self) -> None:
        """One pass: offer the newest own step to every target that lacks it."""
        if time.monotonic() < self._quiet_until():
            return  # a restore was just answered: its reads and steps go first
        own = self.store.own.steps()
        if not own:
            # Nothing of this host's is at risk, but one empty listing does not say
            # so: a folder between two renames (a step saved again) or a listing
            # racing retention reads as none. Only a second empty pass stops the clock.
            self._empty_passes += 1
            if self._empty_passes >= 2:
                self._note_replication(-1, True)
            return
        self._empty_passes = 0
        newest = own[-1]
        fp = self._own_fingerprint(newest)
        if self._replicated_fp.get(newest) != fp:  # saved (again) since it was replicated
            self.replicated[newest] = set()
            self._had.pop(newest, None)
            self._replicated_fp[newest] = fp
            # A twin's copy of the step that arrived before it was saved here: its
            # identical files become claims on the own ones (held once).
            self.metrics.deduplicated_files.inc(claims.fold(self.store, newest))
        self.sync_targets(own)
        self.metrics.newest.labels("committed").set(newest)
        for target in self.config.targets(self.rank):
            if target in self.replicated[newest] or self.away(target):
                continue
            try:
                self.push_step(newest, target)
            except (MtcError, OSError) as e:
                self.metrics.failures.labels(failure_kind(e)).inc()
                if isinstance(e, PeerError) and e.unreachable:
                    self._away[target] = time.monotonic() + RESYNC_S
                # A WARNING when a target starts failing, not at every step while it
                # stays away (the identity names it, mtc_failures_total counts).
                kind = failure_kind(e)
                level = logging.INFO if self._failing.get(target) == kind else logging.WARNING
                self._failing[target] = kind
                log.log(level, "rank %d: step %d not replicated to rank %d: %s",
                        self.rank, newest, target, e)
            else:
                self._failing.pop(target, None)
        if self.fully_replicated(newest):
            self._restore_older(own)
        done = [s for s in own if self.fully_replicated(s)]
        self._note_replication(newest, self.fully_replicated(newest))
        if done:
            self.metrics.newest.labels("replicated").set(done[-1])
        self.metrics.lag.set(sum(1 for s in own if not done or s > done[-1]))

    def _restore_older(self, own: list[int]) -> None:
        """One older kept step pushed to each target that lacks it: it lost its copy,
        or a newer step went first (``mtc_steps_copied_again_total{why}``)."""
        for target in self.config.targets(self.rank):
            if time.monotonic() < self._quiet_until():
                return
            held = {s for s in own if target in self.replicated.get(s, set())
                    or self._copied_again[(target, s)] >= COPIES_AGAIN_MAX}
            step = older_to_restore(own, self.config.keep, held)
            if step is None or self.away(target):
                continue
            self._copied_again[(target, step)] += 1
            lost = target in self._had[step]
            try:
                self.push_step(step, target)
            except (MtcError, OSError) as e:
                self.metrics.failures.labels(failure_kind(e)).inc()
                log.warning("rank %d: older step %d not copied to rank %d: %s",
                            self.rank, step, target, e)
                continue
            self.metrics.copied_again.labels("lost" if lost else "late").inc()
            log.info("rank %d: step %d copied to rank %d, %s", self.rank, step, target,
                     "which had lost it" if lost else "after a newer step")

    def _note_replication(self, newest: int, replicated: bool) -> None:
        self.clock.update(newest, replicated)
        warning = self.clock.warn_once()
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
            offer = pb.OfferRequest(copy=self.entry(step, files))
            reply = peer.offer(offer)
            if reply.already_complete:
                self._held(step, target)
                return
            src = self.store.copy_dir(self.rank, step)
            # A candidate without a hash is the same path of the same step with the
            # same size and CRC32C (a twin's shard): taken as the peer identified it.
            same = [c.path for c in reply.candidates
                    if not c.sha256 or self.store.checksums.sha256(src / c.path) == c.sha256]
            if same:
                peer.link(reply.transfer_id, same)
            linked = set(same)
            todo = [(i, f) for i, f in enumerate(files) if f.path not in linked]
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
                peer.commit(reply.transfer_id)
            except BaseException:
                try:
                    peer.abort(reply.transfer_id)
                except PeerError:
                    self.metrics.skipped.labels("abort_unanswered").inc()
                raise
            self._held(step, target)
            log.info("rank %d: step %d replicated to rank %d (%d files linked, %d pushed)",
                     self.rank, step, target, len(same), len(todo))
        finally:
            with self._lock:
                self._pushing.discard(step)

    def entry(self, step: int, files: list[FileMeta]) -> pb.StepCopy:
        """Own ``step``'s entry as offered: with mutual TLS, signed (:mod:`.provenance`)."""
        if self.own_proofs is None:
            return pb.StepCopy(step=step, origin_rank=self.rank, files=[
                pb.FileInfo(path=f.path, size=f.size, crc32c=f.crc32c) for f in files])
        s = self.store.summary(self.rank, step)
        return self.own_proofs.entry(step, self.store.copy_dir(self.rank, step), files,
                                     run=s.run, saved_hosts=s.num_hosts,
                                     saving_ranks=list(s.ranks),
                                     sha256=self.store.checksums.sha256)

    def _push_batch(self, peer: Peer, tid: str, src: Path,
                    batch: list[tuple[int, FileMeta]]) -> None:
        try:
            peer.push_batch(tid, [(i, f.path, src / f.path, f.size, f.crc32c)
                                  for i, f in batch])
        except CorruptShardError:
            # Damaged since it was last checked: read it again, quarantine what fails.
            where = self.store.locate(src / batch[0][1].path)
            if where is not None:
                self.store.verify(*where, cached=False)
            raise
        self.metrics.bytes_sent.inc(sum(f.size for _, f in batch))

    def _push_stream(self, peer: Peer, tid: str, src: Path,
                     group: list[tuple[int, FileMeta]]) -> None:
        try:
            sent = peer.push(tid, [(i, f.path, src / f.path, f.size, f.crc32c)
                                   for i, f in group])
            if sent is None:  # the data channel could not be had (busy, a flood): gRPC
                for batch in push_batches(group):
                    self._push_batch(peer, tid, src, batch)
                return
        except (PeerError, CorruptShardError) as e:
            if isinstance(e, CorruptShardError) or e.code == grpc.StatusCode.DATA_LOSS:
                # The target found a file damaged: ours, read again, quarantined if so.
                where = self.store.locate(src / group[0][1].path)
                if where is not None:
                    self.store.verify(*where, cached=False)
            raise
        self.metrics.bytes_sent.inc(sum(f.size for _, f in group))
