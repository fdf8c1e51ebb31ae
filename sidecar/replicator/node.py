"""One host's replicator, composed: its RAM disk's store, its peers, and the
services that act on them, each in a module of its own:

- ``replication.py``: copies of this host's steps to its targets;
- ``gc.py``: which steps and copies are deleted (a pure plan, and its pass);
- ``node_agreement.py``: the restore agreement (deciding, asking);
- ``restore.py``: bringing the agreed step's data, verified, and healing it;
- ``scrub.py``: every held copy read again in the background, damage healed;
- ``sidecar/backup/duties.py``: the backup tier (leading, uploading, restoring).

This module holds what they share: the inventory a peer is shown, the node's
identity, and whether its configuration disagrees with a peer's.

Threads: ``main.py`` starts and joins them all (:meth:`run`, the backup loop,
the servers). Each service owns its pool (pushes, inventory fan-out, restore
fetches, background restores), so an inventory never queues behind a fetch.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mtc import layout
from mtc.errors import ConfigError
from mtc.layout import root_identity
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.duties import BackupDuties
from mtc.sidecar.backup.schedule import BackupScheduler
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.client import PeerClient
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.copy_proofs import put_proof
from mtc.sidecar.replicator.fetch_plan import likely_restore
from mtc.sidecar.replicator.gc import GcPlan, collect_garbage
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.node_agreement import NodeAgreement, holders_of
from mtc.sidecar.replicator.provenance import ProofCheck, Signer
from mtc.sidecar.replicator.replication import Replication
from mtc.sidecar.replicator.restore import Restorer
from mtc.sidecar.replicator.root_watch import RootWatch
from mtc.sidecar.replicator.scrub import Scrubber
from mtc.sidecar.replicator.security import Credentials
from mtc.sidecar.replicator.selfcheck import PEER_GRACE_S, PeerReach
from mtc.sidecar.replicator.step_files import FileMeta, fingerprint_of
from mtc.sidecar.replicator.store import LocalStore
from mtc.sidecar.replicator.transfers import DISK_SPARE, RESERVE_DIR, room
from mtc.sidecar.reserve import Reserve, reserved_bytes
from mtc.sidecar.write import WRITER_RESERVE_DIR

log = logging.getLogger(__name__)


class Node:
    """One replicator: the composition root of its services."""

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
        self._stop = threading.Event()
        # A step renamed into the root wakes the loop at once (the poll stays).
        self._watch = RootWatch(root)
        self.heartbeat = time.monotonic()  # the replication loop's last pass (health)
        self.data_port = 0  # the data channel's, once serving (server.serve)
        # How this node's flags disagree with a peer's (selfcheck.check_peers, at
        # start): while set, it refuses restores and copies nothing.
        self.config_error = ""
        self._gc_bounded = False  # the GC deleted a step only its bound made it delete
        self._sizes_seen: dict[tuple[int, int], tuple[int, int]] = {}  # GC's, its thread's
        # The inventory fan-out has a pool of its own: never behind a restore's fetches.
        self._inv_pool = ThreadPoolExecutor(16, thread_name_prefix="mtc-inventory")
        shared = (config, self.store, self.peers, self.metrics)
        self.agreement = NodeAgreement(
            config, root, self.store, self.peers, self.metrics,
            inventory=lambda files: self.inventory(files=files),
            refuse=self.refuse_if_misconfigured, stop=self._stop, pool=self._inv_pool,
            proofs=ProofCheck.of(creds))
        self.proofs = self.agreement.proofs  # None without mutual TLS (provenance.py)
        self.backups = BackupDuties(*shared, backup, self.agreement, self._stop)
        # Blank files for the next peer copies and a replaced host's fetch
        # (mtc.sidecar.reserve).
        self.reserve = Reserve(root, RESERVE_DIR, lambda: room(root), enabled=config.reserve,
                               on_take=self.metrics.reserve_used.inc)
        self.metrics.reserve_bytes.set_function(self.reserve.held_bytes)
        self.restorer = Restorer(*shared, agreement=self.agreement, backups=self.backups,
                                 inventory=self.inventory, refuse=self.refuse_if_misconfigured,
                                 stop=self._stop, reserve=self.reserve)
        # Peers that do not answer (the start-up check's asks, replication's).
        self.reach = PeerReach()
        self.replication = Replication(*shared,
                                       quiet_until=lambda: self.restorer.quiet_until,
                                       reach=self.reach, signer=Signer.of(creds))
        self.scrubber = Scrubber(self.store, self.metrics, rate=config.scrub_rate,
                                 interval=config.scrub_interval_s, heal_own=self.heal_own,
                                 quiet_until=lambda: self.restorer.quiet_until,
                                 stop=self._stop)

    def run(self) -> None:
        """The replication loop (its thread is main's): a copy pass, then garbage
        collection; ends when :meth:`stop` is called. First, on a host that holds
        no step of its own, the RAM disk its restore will likely need is set aside."""
        self.set_aside_for_restore()
        while not self._stop.is_set():
            self.heartbeat = time.monotonic()
            if self.reserve.wants(self.rank) and self.store.own_steps():
                # The job saved anew here without restoring: no fetch will come.
                self.reserve.forget(self.rank)
            try:
                trusted = not self.config_error
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
        return (layout.room(self.store.root, DISK_SPARE) + self.reserve.held_bytes()
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
        if not self.reserve.enabled or self.store.own_steps():
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

    def stop(self) -> None:
        """Ask the loops and any restore waiting for its decision to end (main joins
        their threads)."""
        self._stop.set()
        self._watch.wake()
        self.reserve.stop()
        self.restorer.stop()
        self.agreement.close()
        for p in self.peers.values():
            p.close()  # cancels calls in flight (a Decide waiting for its epoch, a push)

    def close(self) -> None:
        """After the loops and the server ended: finish the pools."""
        self.restorer.close()
        self.replication.close()
        self._inv_pool.shutdown(wait=True, cancel_futures=True)
        self.backups.close()
        self._watch.close()

    def heal_own(self, step: int) -> None:
        """Have this host's damaged ``step`` made whole again from other hosts'
        verified copies of the same bytes, as a restore would (the scrub found damage)."""
        self.restorer.heal_in_background(step, self.store.summary(self.rank, step).run)

    def on_copy_received(self, origin: int, step: int) -> None:
        log.info("rank %d: holds a verified copy of rank %d step %d", self.rank, origin, step)

    def inventory(self, origins: frozenset[int] | None = None, *,
                  files: bool = True) -> pb.Inventory:
        """What this node holds, verified; ``origins``: only copies of those ranks;
        ``files``: with each copy's file list (a fetch needs it, holdings do not:
        about 180 entries per copy, built, sent and parsed on every GC gather)."""
        backed = self.backups.backup.backed_up_steps() if self.backups.backup else []
        inv = pb.Inventory(rank=self.rank, newest_backed_up_step=backed[-1] if backed else -1,
                           backed_up_steps=backed,
                           last_decision=self.agreement.last_decision)
        # Only copies whose bytes check out (cached per file): what agreement
        # decides on has been verified, not just listed.
        damaged: list[tuple[int, list[FileMeta]]] = []
        for origin, step, held in self.store.verified_copies(origins, damaged_own=damaged):
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
            self._attach_proof(c)
        self._offer_damaged(inv, damaged)
        inv.quarantined_files = self.store.quarantined_total
        return inv

    def _attach_proof(self, c: pb.StepCopy) -> None:
        """Put the origin's proof (and its files' SHA-256s) on a listed copy: kept
        with a peer's copy; an own step's when it was offered signed already."""
        if self.proofs is None:
            return  # without mutual TLS nothing is signed
        folder = self.store.copy_dir(c.origin_rank, c.step)
        if c.origin_rank != self.rank:
            self.store.proofs.attach(c, folder)
            return
        own = self.replication.own_proofs
        put_proof(c, own.cached(c.step, folder) if own is not None else None)

    def _offer_damaged(self, inv: pb.Inventory,
                       damaged: list[tuple[int, list[FileMeta]]]) -> None:
        """List this node's own damaged steps and their bad files in ``inv``: the
        agreement counts one as held when a member holds each of those files."""
        for step, bad in damaged:
            if len(bad) > checks.MAX_FILES:
                continue
            try:
                summary = self.store.summary(self.rank, step)
            except OSError:
                continue
            d = inv.damaged.add(step=step, origin_rank=self.rank,
                                saved_hosts=summary.num_hosts, run=summary.run,
                                saving_ranks=summary.ranks)
            for f in bad:
                d.files.add(path=f.path, size=f.size, crc32c=f.crc32c)

    def identity(self) -> pb.Inventory:
        """Who this node is, without its copies: rank, configuration, the identity of
        the RAM disk it serves, whether its configuration disagrees with a peer's,
        and how its replication is doing (``GetInventory(identify=true)``)."""
        step, waited, late = self.replication.clock.state()
        return pb.Inventory(
            rank=self.rank, root_id=root_identity(self.store.root, create=False),
            config=pb.NodeConfig(nodes=self.config.nodes,
                                 nodes_per_slice=self.config.nodes_per_slice),
            config_error=self.config_error, unreplicated_step=step,
            unreplicated_seconds=waited, replication_late=late,
            quarantined_files=self.store.quarantined_total, data_port=self.data_port,
            unanswered_peers=[
                pb.PeerFault(rank=p, address=self.config.nodes[p], seconds=waited,
                             error=error, target=p in self.config.targets(self.rank))
                for p, waited, error in self.reach.faults(PEER_GRACE_S)])

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
