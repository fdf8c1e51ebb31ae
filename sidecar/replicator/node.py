"""One host's replicator, composed: its RAM disk's store, its peers, and the
services that act on them, each in a module of its own:

- ``loop.py``: the replication loop (a copy pass, then garbage collection);
- ``replication.py``: copies of this host's steps to its targets;
- ``gc.py``: which steps and copies are deleted (a pure plan, and its pass);
- ``node_agreement.py``: the restore agreement (deciding, asking);
- ``restore.py``: asking for the agreed step's data, now or in the background,
  over ``materialize.py``: bringing it, verified, and healing it;
- ``scrub.py``: every held copy read again in the background, damage healed;
- ``inventory_service.py``: what this node shows a peer (inventory, identity);
- ``selfcheck.py``: whether its configuration disagrees with a peer's;
- ``sidecar/backup/duties.py``: the backup tier (leading, uploading, restoring);
- ``sidecar/storage/reserve.py``: blank files set aside for the next copies.

The node only composes: it builds them, hands the servicers their narrow views
(:attr:`Node.parts`, :mod:`.parts`), and is itself a service
(:class:`mtc.lifecycle.Service`) made of them: started in order with the
process's one thread group, stopped and closed in the reverse order. Each
service owns its pools (pushes, inventory fan-out, restore fetches, background
restores), so an inventory never queues behind a fetch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from mtc.credentials import Credentials
from mtc.lifecycle import Service, Threads
from mtc.sidecar.backup.duties import BackupDuties
from mtc.sidecar.backup.schedule import BackupScheduler
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.agree.node_agreement import NodeAgreement
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.copies.provenance import ProofCheck, Signer
from mtc.sidecar.replicator.copies.receive import Receiver
from mtc.sidecar.replicator.copies.replication import Replication
from mtc.sidecar.replicator.copies.scrub import Scrubber
from mtc.sidecar.replicator.copies.transfers import RESERVE_DIR
from mtc.sidecar.replicator.fetch.restore import Restorer
from mtc.sidecar.replicator.inventory_service import InventoryService
from mtc.sidecar.replicator.loop import ReplicationLoop
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.selfcheck import ConfigCheck, PeerReach, identify
from mtc.sidecar.replicator.store.store import LocalStore
from mtc.sidecar.replicator.transport import Peers
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.sidecar.replicator.wire.grpc_peer import GrpcPeer
from mtc.sidecar.replicator.wire.parts import Parts
from mtc.sidecar.storage import spare
from mtc.sidecar.storage.reserve import Reserve

log = logging.getLogger(__name__)


class Node:
    """One replicator: the composition root of its services."""

    def __init__(self, config: ReplicatorConfig, root: Path, creds: Credentials,
                 backup: BackupScheduler | None = None, *,
                 peers: Peers | None = None) -> None:
        self.config = config
        self.rank = config.rank
        self.store = LocalStore(root, config.rank, orbax=config.framework == "orbax")
        self.metrics = Metrics()
        self.store.on_quarantine = self.metrics.quarantined.inc
        self.store.signed_only = creds.tls  # copies are proven (provenance.py)
        # Its peers' gRPC clients; every part of the replicator (and its backup
        # tier) reaches them through the transport seam (transport.py): over
        # these, or in memory when a test hands its own ``peers``
        # (memory_transport.py: no gRPC client then).
        self.clients = {r: PeerClient(a, creds, rank=r, deadline_s=config.deadline_s,
                                      as_peer=True, keepalive_s=config.keepalive_s)
                        for r, a in enumerate(config.nodes)
                        if r != config.rank and peers is None}
        self.peers: Peers = peers if peers is not None else {
            r: GrpcPeer(c) for r, c in self.clients.items()}
        # Peers that do not answer (the start-up check's asks, replication's).
        self.reach = PeerReach()
        # How this node's flags disagree with a peer's (asked at start): while they
        # do, it refuses restores and copies nothing.
        self.check = ConfigCheck(config, lambda p: identify(self.peers[p], self.reach, p),
                                 on_mismatch=lambda: self.metrics.config_mismatch.set(1))
        shared = (config, self.store, self.peers, self.metrics)
        self.agreement = NodeAgreement(
            config, root, self.store, self.peers, self.metrics,
            inventory=lambda files: self.shown.inventory(files=files),
            refuse=self.check.refuse_if_misconfigured, proofs=ProofCheck.of(creds))
        self.proofs = self.agreement.proofs  # None without mutual TLS (provenance.py)
        self.backups = BackupDuties(*shared, backup, self.agreement)
        # Blank files for the next peer copies and a replaced host's fetch
        # (mtc.sidecar.storage.reserve).
        self.reserve = Reserve(root, RESERVE_DIR, lambda: spare.room(root), enabled=config.reserve,
                               on_take=self.metrics.reserve_used.inc)
        self.metrics.reserve_bytes.set_function(self.reserve.held_bytes)
        self.restorer = Restorer(*shared, agreement=self.agreement, backups=self.backups,
                                 inventory=lambda: self.shown.inventory(),
                                 refuse=self.check.refuse_if_misconfigured,
                                 reserve=self.reserve)
        self.replication = Replication(*shared,
                                       quiet_until=lambda: self.restorer.quiet_until,
                                       reach=self.reach, signer=Signer.of(creds))
        self.shown = InventoryService(
            config, self.store, backup=backup,
            last_decision=lambda: self.agreement.last_decision,
            clock=self.replication.clock, reach=self.reach, check=self.check,
            proofs=self.proofs, own_proofs=lambda: self.replication.own_proofs)
        self.scrubber = Scrubber(self.store, self.metrics, rate=config.scrub_rate,
                                 interval=config.scrub_interval_s, heal_own=self.heal_own,
                                 quiet_until=lambda: self.restorer.quiet_until)
        self.loop = ReplicationLoop(config, self.store, self.metrics,
                                    replication=self.replication, agreement=self.agreement,
                                    backups=self.backups, reserve=self.reserve,
                                    trusted=lambda: not self.check.error)
        # The copy protocol's receiving side, whichever transport brings a copy.
        self.receiver = Receiver(config.rank, self.store, self.metrics, self.reserve,
                                 self.proofs, max_files=checks.MAX_OPEN_FILES)
        self.parts = Parts(config=config, store=self.store, metrics=self.metrics,
                           shown=self.shown, agreement=self.agreement,
                           restores=self.restorer, backups=self.backups, blanks=self.reserve,
                           receiver=self.receiver, proofs=self.proofs)
        # Start order; stopped and closed in the reverse one (a restore's fetches
        # end before the agreement's pool, the loop before what it calls).
        self.services: tuple[Service, ...] = (
            self.agreement, self.backups, self.replication, self.restorer, self.reserve,
            self.scrubber, self.loop, self.check)

    def start(self, threads: Threads) -> None:
        """Start every service's threads in ``threads`` (main's group)."""
        for s in self.services:
            s.start(threads)

    def stop(self) -> None:
        """Ask every service to end (main joins the group's threads), and cancel the
        calls to peers in flight (a Decide waiting for its epoch, a push)."""
        for s in reversed(self.services):
            s.stop()
        for p in self.clients.values():
            p.close()

    def close(self) -> None:
        """After the threads and the server ended: every service lets go of its pools."""
        for s in reversed(self.services):
            s.close()

    def heal_own(self, step: int) -> None:
        """Have this host's damaged ``step`` made whole again from other hosts'
        verified copies of the same bytes, as a restore would (the scrub found damage)."""
        self.restorer.heal_in_background(step, self.store.summary(self.rank, step).run)
