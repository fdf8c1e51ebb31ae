"""The chaos driver's network faults (:mod:`mtc.trainer.chaos`): a host's link cut,
or the slices partitioned, before a restore or during it, healed after a few
seconds. Only where the hosts run in network namespaces of their own."""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Protocol

# Injected only on isolated hosts (network_of): faults of the network between them.
NET_FAULTS = ("cut_link", "cut_link_in_restore", "partition_in_restore")
NET_WEIGHTS = (2, 2, 2)
HEAL_AFTER_S = (0.5, 4.0)  # how long a network fault lasts (uniform)


class Network(Protocol):
    """What network faults need of the hosts (``mtc.testing.isolation.Hosts`` has it)."""

    def link(self, host: int, up: bool) -> None: ...

    def partition(self, groups: list[list[int]]) -> None: ...

    def heal(self) -> None: ...


def network_of(cluster: Any) -> Network | None:
    """The network namespaces ``cluster``'s hosts run in (``LocalCluster.hosts``),
    or None when they are only separate processes (no network faults then)."""
    hosts = getattr(cluster, "hosts", None)
    if hosts is None or getattr(hosts, "isolation", "namespaces") != "namespaces":
        return None
    if not all(callable(getattr(hosts, m, None)) for m in ("link", "partition", "heal")):
        return None
    return hosts


@dataclasses.dataclass(frozen=True)
class NetFault:
    """One network fault: a host's link cut, or the slices partitioned (``groups``);
    when it starts (``during_restore``: a moment after the restore began) and how
    long until healed."""

    kind: str
    host: int | None
    groups: tuple[tuple[int, ...], ...]
    during_restore: bool
    start_delay_s: float
    heal_after_s: float


def plan_net_fault(kind: str, host: int, slices: list[list[int]], rng: random.Random
                   ) -> NetFault:
    """Pure: what ``kind`` does this cycle. A partition separates the slices whole
    (each slice's hosts still reach each other and the controller)."""
    if kind not in NET_FAULTS:
        raise ValueError(f"not a network fault: {kind}")
    during = kind.endswith("_in_restore")
    return NetFault(kind, None if kind.startswith("partition") else host,
                    tuple(tuple(g) for g in slices) if kind.startswith("partition") else (),
                    during, rng.uniform(0.0, 0.1) if during else 0.0,
                    rng.uniform(*HEAL_AFTER_S))


def cut(net: Network, f: NetFault) -> None:
    if f.host is not None:
        net.link(f.host, False)
    else:
        net.partition([list(g) for g in f.groups])
