"""Who the replicator is and who its peers are (the placement rule:
:mod:`mtc.placement`)."""

from __future__ import annotations

import dataclasses

from mtc.errors import ConfigError
from mtc.placement import peer_group, targets

GC_VIEW_INTERVAL_S = 1.0  # gc_view_interval_s's default (--gc-view-interval-seconds)
KEEPALIVE_S = 10.0  # keepalive_s's default (--peer-keepalive-seconds)


@dataclasses.dataclass(frozen=True)
class ReplicatorConfig:
    rank: int
    nodes: tuple[str, ...]           # every node's replicator address, in rank order
    nodes_per_slice: int
    replicas: int = 1                # copies of each step on peers
    keep: int = 2                    # own steps kept (the newest ones)
    # Older own steps kept beyond ``keep`` at most, while replication or the
    # coordinator's view wants them (gc.py): a target nobody answers never fills the disk.
    keep_awaiting: int = 2
    poll_s: float = 0.2
    # The coordinator gathers every member's inventory for GC's view of the steps no
    # node may delete (``GetComplete``) at most this often: its cost stays bounded
    # whatever the number of nodes (docs/agreement.md).
    gc_view_interval_s: float = GC_VIEW_INTERVAL_S
    deadline_s: float = 10.0
    # A call to a peer that went silent (its link cut mid-call) fails within about
    # 1.5 times this (gRPC keepalive: pinged after it idle, unanswered for half).
    keepalive_s: float = KEEPALIVE_S
    agreement_timeout_s: float = 60.0  # a restore's decision, or AgreementError
    # After answering a restore, copies that can wait (pushes to peers, a replaced
    # host's own data fetched in the background) wait this long: the restore's
    # reads and the first steps after it have the host's cores and network.
    restore_quiet_s: float = 2.0
    # Own steps not on every target for longer than this: a WARNING, the identity's
    # replication_late (mtc status, the managers' logs) and mtc_unreplicated_seconds.
    replication_warn_s: float = 120.0
    # Blank RAM-disk files set aside for the next peer copy (sidecar/storage/reserve.py).
    reserve: bool = True
    # Held copies read again in the background (sidecar/replicator/copies/scrub.py), at
    # most this many bytes a second on average; 0: no scrub.
    scrub_rate: float = 64 * 2**20
    # ... each once this many seconds have passed since its bytes were last read
    # whole (written, or scrubbed): a restore verifies what it reads in any case.
    scrub_interval_s: float = 300.0
    framework: str = "mtc"           # "mtc" or "orbax" (from replicator.yaml)
    job_name: str = "mtc"

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if not 0 <= self.rank < n:
            raise ConfigError(f"rank {self.rank} is not in 0..{n - 1}")
        if self.nodes_per_slice < 1 or n % self.nodes_per_slice:
            raise ConfigError(f"{n} nodes cannot form slices of {self.nodes_per_slice}")
        if not 0 <= self.replicas < max(1, self.num_slices):
            raise ConfigError(f"replicas must be in 0..{self.num_slices - 1} with "
                              f"{self.num_slices} slices, got {self.replicas}")
        if self.keep < 1:
            raise ConfigError("keep must be >= 1")
        if self.keep_awaiting < 0:
            raise ConfigError(f"keep_awaiting must be >= 0, got {self.keep_awaiting}")
        if self.gc_view_interval_s < 0:
            raise ConfigError(f"gc_view_interval_s must be >= 0, got {self.gc_view_interval_s}")
        if self.keepalive_s <= 0:
            raise ConfigError(f"keepalive_s must be > 0, got {self.keepalive_s}")
        if self.restore_quiet_s < 0:
            raise ConfigError(f"restore_quiet_s must be >= 0, got {self.restore_quiet_s}")
        if self.scrub_rate < 0:
            raise ConfigError(f"scrub_rate must be >= 0, got {self.scrub_rate}")
        if self.scrub_interval_s < 0:
            raise ConfigError(f"scrub_interval_s must be >= 0, got {self.scrub_interval_s}")

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_slices(self) -> int:
        return len(self.nodes) // self.nodes_per_slice

    def slice_of(self, rank: int) -> int:
        return rank // self.nodes_per_slice

    def peer_group(self, rank: int) -> list[int]:
        """Ranks with ``rank``'s in-slice index, ``rank`` first, then slice by slice after it."""
        return peer_group(rank, self.num_nodes, self.nodes_per_slice)

    def targets(self, rank: int) -> list[int]:
        """Where ``rank``'s steps are copied."""
        return targets(rank, self.num_nodes, self.nodes_per_slice, self.replicas)

    def equivalent(self, rank: int) -> list[int]:
        """Ranks whose data can stand in for ``rank``'s on restore.

        mtc's manifests name their host, so only ``rank`` itself; Orbax restores
        a host from any member of its peer group.
        """
        return self.peer_group(rank) if self.framework == "orbax" else [rank]

