"""One host's replicator: replication loop, garbage collection, restore agreement
(bringing the agreed step's data is ``sidecar/replicator/restore.py``).

Replication: the newest committed step not yet on every target is offered to
each target; files the target already holds identically are linked there, the
rest are pushed and verified on receipt; the step counts as replicated only
when the target commits the copy. Older unreplicated steps are skipped, so lag
never grows beyond one step in flight.

Restore: every node gathers every reachable node's inventory, computes the
newest step whose data exists for every rank somewhere, and proposes it to all
nodes; each decides the smallest proposal of the nodes it reached. Each restore
is an epoch of its own, so a quick restart never decides on the proposals of the
previous one. No node is special, so any one may be down. A host missing its data fetches it file by
file from the holders, spreading reads over them, verifying every byte.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mtc.errors import CorruptShardError, MtcError
from mtc.proto import replicator_pb2 as pb
from sidecar.backup.duties import BackupDuties
from sidecar.backup.schedule import BackupScheduler
from sidecar.replicator.agreement import Agreement
from sidecar.replicator.client import PeerClient, PeerError
from sidecar.replicator.config import ReplicatorConfig
from sidecar.replicator.metrics import Metrics
from sidecar.replicator.restore import RestoreDuties
from sidecar.replicator.security import Credentials
from sidecar.replicator.store import FileMeta, LocalStore, file_sha256

log = logging.getLogger(__name__)
RESYNC_S = 2.0  # how often a target's holdings of our steps are re-read
BATCH_BYTES = 4 << 20  # small files travel together, up to this many bytes a call
BATCH_FILES = 512  # and this many files (their indices ride in the call's metadata)


class Node(BackupDuties, RestoreDuties):
    def __init__(self, config: ReplicatorConfig, root: Path, creds: Credentials,
                 backup: BackupScheduler | None = None) -> None:
        self.config = config
        self.rank = config.rank
        self.store = LocalStore(root, config.rank)
        self.metrics = Metrics()
        self.store.on_quarantine = self.metrics.quarantined.inc
        self.agreement = Agreement()
        self.peers = {r: PeerClient(a, creds, rank=r, deadline_s=config.deadline_s)
                      for r, a in enumerate(config.nodes) if r != config.rank}
        self.replicated: dict[int, set[int]] = defaultdict(set)
        self._synced: dict[int, float] = {}  # target -> when its holdings were last read
        self._pushing: set[int] = set()
        self._incoming: Any = None  # set by main: callable returning (origin, step) in transfer
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="mtc-push")
        self.backup = backup
        self._backing_up: set[int] = set()
        # Steps being restored from the backup: their folder and verified files,
        # served to other restoring hosts that share objects with this one.
        self.restoring: dict[int, tuple[Path, set[str]]] = {}
        self._complete_at: tuple[float, int] = (-1e9, -1)  # (when, newest complete step)

    # -- inventory ----------------------------------------------------------------

    def inventory(self) -> pb.Inventory:
        backed = self.backup.backed_up_steps() if self.backup else []
        inv = pb.Inventory(rank=self.rank, newest_backed_up_step=backed[-1] if backed else -1,
                           backed_up_steps=backed)
        # Only copies whose bytes check out (cached per file): what agreement
        # decides on has been verified, not just listed.
        for origin, step, files in self.store.verified_copies():
            c = inv.copies.add(step=step, origin_rank=origin)
            for f in files:
                c.files.add(path=f.path, size=f.size, crc32c=f.crc32c)
        inv.quarantined_files = self.store.quarantined_total
        return inv

    # -- replication ----------------------------------------------------------------

    def run(self) -> None:
        if self.backup is not None:
            threading.Thread(target=self._backup_loop, name="mtc-backup", daemon=True).start()
        while not self._stop.is_set():
            try:
                self.replicate_once()
                self.collect_garbage()
            except Exception:
                log.exception("replication pass failed")
                self.metrics.failures.labels("loop").inc()
            self._stop.wait(self.config.poll_s)

    def newest_complete(self, invs: dict[int, pb.Inventory]) -> int:
        """The newest step whose data is held (on hosts, not in backup) for every rank."""
        held = self.holders(invs)
        for s in sorted({s for _, s in held}, reverse=True):
            if all(any((o, s) in held for o in self.config.equivalent(r))
                   for r in range(self.config.num_nodes)):
                return s
        return -1

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in self.peers.values():
            p.close()

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
                inv = self.peers[t].call("GetInventory", pb.InventoryRequest(), attempts=1)
            except PeerError:
                continue
            held = {c.step for c in inv.copies if c.origin_rank == self.rank}
            for s in own:
                if s in held:
                    self.replicated[s].add(t)
                else:
                    self.replicated[s].discard(t)
            self._synced[t] = now

    def replicate_once(self) -> None:
        own = self.store.own_steps()
        if not own:
            return
        self.sync_targets(own)
        newest = own[-1]
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
        if done:
            self.metrics.newest.labels("replicated").set(done[-1])
        self.metrics.lag.set(sum(1 for s in own if not done or s > done[-1]))

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
            same = [c.path for c in reply.candidates
                    if file_sha256(src / c.path).digest() == c.sha256]
            if same:
                peer.call("Link", pb.LinkRequest(transfer_id=reply.transfer_id, paths=same))
            linked = set(same)
            todo = [(i, f) for i, f in enumerate(files) if f.path not in linked]
            try:
                futs = [self._pool.submit(self._push_batch, peer, reply.transfer_id, src, batch)
                        for batch in _batches(todo)]
                for fut in futs:
                    fut.result()
                peer.call("Commit", pb.CommitRequest(transfer_id=reply.transfer_id))
            except BaseException:
                try:
                    peer.call("Abort", pb.AbortRequest(transfer_id=reply.transfer_id),
                              attempts=1)
                except PeerError:
                    pass
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

    def on_copy_received(self, origin: int, step: int) -> None:
        log.info("rank %d: holds a verified copy of rank %d step %d", self.rank, origin, step)

    # -- garbage collection -------------------------------------------------------

    def collect_garbage(self) -> None:
        keep = self.config.keep
        own = self.store.own_steps()
        replicated = [s for s in own if self.fully_replicated(s)]
        protected = set(own[-keep:]) | set(replicated[-1:])
        if any(t not in self._synced for t in self.config.targets(self.rank)):
            protected |= set(own)  # the newest replicated step is not known yet
        with self._lock:
            protected |= self._pushing | self._backing_up
        replicas = self.store.replica_steps()
        doomed = [s for s in own if s not in protected]
        doomed += [s for steps in replicas.values() for s in steps[:-keep]]
        if doomed:
            # Local rules cannot see that another host failed to commit or
            # replicate a newer step: never delete the newest step that every
            # rank can still be restored from, as the cluster sees it now.
            now = time.monotonic()
            # An inventory round per second at most; always fresh before a step
            # newer than the last known complete one could be deleted.
            if now - self._complete_at[0] > 1.0 or max(doomed) > self._complete_at[1]:
                self._complete_at = (now, self.newest_complete(self.gather()))
            complete = self._complete_at[1]
            protected.add(complete)
        else:
            complete = -1
        for s in own:
            if s not in protected:
                self.store.remove_copy(self.rank, s)
                self.replicated.pop(s, None)
        for origin, steps in replicas.items():
            if origin == self.rank:
                # Own steps parked for a client (Orbax) or restored: keep the ones
                # still linked from the root and the newest.
                linked = {s for s in steps if (self.store.root / str(s)).is_symlink()}
                for s in steps[:-keep]:
                    if s not in linked and s not in protected:
                        self.store.remove_copy(origin, s)
                continue
            for s in steps[:-keep]:
                if s != complete:
                    self.store.remove_copy(origin, s)

    # -- restore --------------------------------------------------------------------

    def gather(self) -> dict[int, pb.Inventory]:
        invs = {self.rank: self.inventory()}
        futs = {r: self._pool.submit(p.call, "GetInventory", pb.InventoryRequest(),
                                     deadline_s=self.config.deadline_s, attempts=2)
                for r, p in self.peers.items()}
        for r, fut in futs.items():
            try:
                invs[r] = fut.result()
            except PeerError as e:
                log.warning("rank %d: no inventory from rank %d: %s", self.rank, r, e)
        return invs

    def holders(self, invs: dict[int, pb.Inventory]
                ) -> dict[tuple[int, int], list[tuple[int, pb.StepCopy]]]:
        """(origin, step) -> [(holder rank, its copy)]."""
        out: dict[tuple[int, int], list[tuple[int, pb.StepCopy]]] = defaultdict(list)
        for holder, inv in invs.items():
            for c in inv.copies:
                out[(c.origin_rank, c.step)].append((holder, c))
        return out

    def restorable(self, invs: dict[int, pb.Inventory]) -> int:
        """Newest step every rank can get: from a host, or from the backup."""
        backed = {s for inv in invs.values() for s in inv.backed_up_steps}
        return max(self.newest_complete(invs), max(backed, default=-1))

    def agree(self, timeout_s: float | None = None) -> tuple[int, dict[int, pb.Inventory]]:
        """The step every reachable node decides, and the inventories it was based on."""
        start = time.monotonic()
        deadline = start + (timeout_s or self.config.agreement_timeout_s)
        # A node that is not up yet may hold data nobody else has: give it a
        # moment before deciding without it.
        straggler_deadline = min(deadline, start + self.config.straggler_wait_s)
        invs = self.gather()
        while len(invs) < self.config.num_nodes and time.monotonic() < straggler_deadline:
            time.sleep(0.2)
            invs = self.gather()
        mine = self.restorable(invs)
        # Which epoch: the round a peer is in, else the one after the newest finished.
        states = []
        for p in self.peers.values():
            try:
                reply = p.call("Propose", pb.ProposeRequest(rank=self.rank, epoch=0),
                               deadline_s=self.config.deadline_s, attempts=1)
            except PeerError:
                continue
            states.append((reply.epoch, reply.active))
        epoch = self.agreement.begin(states)
        try:
            while True:
                self.agreement.record(self.rank, epoch, mine)
                reached = {self.rank}
                for r, p in self.peers.items():
                    try:
                        reply = p.call("Propose",
                                       pb.ProposeRequest(rank=self.rank, epoch=epoch, step=mine),
                                       deadline_s=self.config.deadline_s, attempts=1)
                    except PeerError:
                        continue
                    reached.add(r)
                    if reply.active and reply.epoch > epoch:
                        self.agreement.join(reply.epoch)  # we were behind
                    for prop in reply.seen:  # kept: the peer may decide and move on
                        self.agreement.record(prop.rank, prop.epoch, prop.step)
                if self.agreement.state()[0] != epoch:
                    epoch = self.agreement.state()[0]
                    log.info("rank %d: joining restore epoch %d", self.rank, epoch)
                    continue
                seen = self.agreement.current()
                if reached <= set(seen) or time.monotonic() > deadline:
                    decided = min(seen[r] for r in reached if r in seen)
                    log.info("rank %d: restore step %d in epoch %d (proposals %s)",
                             self.rank, decided, epoch, seen)
                    if decided != mine:
                        invs = self.gather()
                    return decided, invs
                time.sleep(0.1)
        finally:
            self.agreement.decided()


def _batches(files: list[tuple[int, FileMeta]]) -> list[list[tuple[int, FileMeta]]]:
    """Large files one per call (streamed, in parallel); small ones together, up to
    BATCH_BYTES or BATCH_FILES a call (their index in the offer travels as metadata)."""
    out: list[list[tuple[int, FileMeta]]] = []
    batch: list[tuple[int, FileMeta]] = []
    held = 0
    for i, f in files:
        if f.size >= BATCH_BYTES // 4:
            out.append([(i, f)])
            continue
        if batch and (held + f.size > BATCH_BYTES or len(batch) == BATCH_FILES):
            out.append(batch)
            batch, held = [], 0
        batch.append((i, f))
        held += f.size
    if batch:
        out.append(batch)
    return out
