"""What the servicers (``server.py``, ``grpc_data.py``, ``data_service.py``) are given
of their replicator: narrow views of its services, each naming only the calls a
servicer makes, never the :class:`~mtc.sidecar.replicator.node.Node` that composes
them (Orbax's ``p2p/service.py`` over ``protocol.py``). The store and the metrics
are given as they are: a servicer reads and writes the store's copies, and counts.

A test can hand a servicer any object with these calls; the node hands it its
own services (:meth:`Node.parts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from mtc.proto import replicator_pb2 as pb
    from mtc.sidecar.replicator.config import ReplicatorConfig
    from mtc.sidecar.replicator.copies.provenance import ProofCheck
    from mtc.sidecar.replicator.copies.receive import Blanks, Receiver
    from mtc.sidecar.replicator.metrics import Metrics
    from mtc.sidecar.replicator.store.store import LocalStore


class Shown(Protocol):
    """What this host holds, as a peer or the controller is shown it
    (:class:`~mtc.sidecar.replicator.inventory_service.InventoryService`);
    ``data_port``: the data channel's, set once it serves."""

    data_port: int

    def inventory(self, origins: frozenset[int] | None = None, *,
                  files: bool = True) -> pb.Inventory: ...

    def identity(self) -> pb.Inventory: ...


class Deciding(Protocol):
    """The restore agreement, as the coordinator's servicer asks it
    (:class:`~mtc.sidecar.replicator.agree.node_agreement.NodeAgreement`)."""

    def decide_for(self, rank: int, rid: str, timeout_s: float,
                   members: Sequence[int] = (), started_ns: int = 0,
                   alive: Callable[[], bool] | None = None) -> pb.Decision: ...

    def complete_steps(self) -> list[int]: ...


class Restores(Protocol):
    """Restores of this host's data (:class:`~mtc.sidecar.replicator.fetch.restore.Restorer`);
    ``staged``: what a restore in progress holds verified, served to other hosts."""

    def prepare_restore_as(self, timeout_s: float | None, rid: str,
                           members: Sequence[int] = (), *, background: bool = False
                           ) -> tuple[pb.Decision, str, float, bool]: ...

    def restored(self, rid: str, step: int) -> bool: ...

    def staged(self, step: int) -> tuple[Path, set[str]] | None: ...


class Backups(Protocol):
    """The backup tier's calls (:class:`~mtc.sidecar.backup.duties.BackupDuties`)."""

    def request_backup(self) -> int: ...

    def backup_part(self, req: pb.BackupPartRequest) -> pb.BackupPartReply: ...


@dataclasses.dataclass(frozen=True)
class Parts:
    """Everything a servicer may reach of its replicator."""

    config: ReplicatorConfig
    store: LocalStore
    metrics: Metrics
    shown: Shown
    agreement: Deciding
    restores: Restores
    backups: Backups
    blanks: Blanks
    # The copy protocol's receiving side (copies/receive.py), one per replicator:
    # whichever transport brings a copy, it is received here.
    receiver: Receiver
    # With mutual TLS, what proves a copy its origin's (.provenance); None without.
    proofs: ProofCheck | None = None

    @property
    def rank(self) -> int:
        return self.config.rank


class Composed(Protocol):
    """What :func:`~mtc.sidecar.replicator.wire.server.serve` is given: something that
    hands out its parts (a :class:`~mtc.sidecar.replicator.node.Node`)."""

    @property
    def parts(self) -> Parts: ...
