"""What a replicator shows of itself: its inventory (the copies it holds, verified,
and its own damaged steps) and its identity (rank, configuration, RAM disk, how its
replication is doing), as ``GetInventory`` answers them and the agreement gathers
them (:class:`~mtc.sidecar.replicator.wire.parts.Shown`)."""

from __future__ import annotations

from collections.abc import Callable

from mtc.layout import root_identity
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.schedule import BackupScheduler
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.copies.provenance import ProofCheck
from mtc.sidecar.replicator.selfcheck import (
    PEER_GRACE_S,
    ConfigCheck,
    PeerReach,
    ReplicationClock,
)
from mtc.sidecar.replicator.store.copy_proofs import OwnProofs, put_proof
from mtc.sidecar.replicator.store.step_files import FileMeta, fingerprint_of
from mtc.sidecar.replicator.store.store import LocalStore


class InventoryService:
    """``last_decision``: the newest restore decision this node read (the
    agreement's); ``data_port``: the data channel's, once it serves (set by
    ``server.serve``)."""

    def __init__(self, config: ReplicatorConfig, store: LocalStore, *,
                 backup: BackupScheduler | None, last_decision: Callable[[], pb.Decision],
                 clock: ReplicationClock, reach: PeerReach, check: ConfigCheck,
                 proofs: ProofCheck | None = None,
                 own_proofs: Callable[[], OwnProofs | None] = lambda: None) -> None:
        self.config = config
        self.rank = config.rank
        self.store = store
        self._backup = backup
        self._last_decision = last_decision
        self._clock = clock
        self._reach = reach
        self._check = check
        self._proofs = proofs
        self._own_proofs = own_proofs
        self.data_port = 0

    def inventory(self, origins: frozenset[int] | None = None, *,
                  files: bool = True) -> pb.Inventory:
        """What this node holds, verified; ``origins``: only copies of those ranks;
        ``files``: with each copy's file list (a fetch needs it, holdings do not:
        about 180 entries per copy, built, sent and parsed on every GC gather)."""
        backed = self._backup.backed_up_steps() if self._backup else []
        inv = pb.Inventory(rank=self.rank, newest_backed_up_step=backed[-1] if backed else -1,
                           backed_up_steps=backed, last_decision=self._last_decision())
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
        if self._proofs is None:
            return  # without mutual TLS nothing is signed
        folder = self.store.copy_dir(c.origin_rank, c.step)
        if c.origin_rank != self.rank:
            self.store.proofs.attach(c, folder)
            return
        own = self._own_proofs()
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
        step, waited, late = self._clock.state()
        return pb.Inventory(
            rank=self.rank, root_id=root_identity(self.store.root),
            config=pb.NodeConfig(nodes=self.config.nodes,
                                 nodes_per_slice=self.config.nodes_per_slice),
            config_error=self._check.error, unreplicated_step=step,
            unreplicated_seconds=waited, replication_late=late,
            quarantined_files=self.store.quarantined_total, data_port=self.data_port,
            unanswered_peers=[
                pb.PeerFault(rank=p, address=self.config.nodes[p], seconds=waited,
                             error=error, target=p in self.config.targets(self.rank))
                for p, waited, error in self._reach.faults(PEER_GRACE_S)])
