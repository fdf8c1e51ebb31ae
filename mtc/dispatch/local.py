"""Host-side code in this process: multi-controller JAX (each process is its own host)
and simulated hosts of one process."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mtc.contract import AgentConfig, LeafSpec, ReadTask, SaveHeader, decode_reply
from mtc.credentials import Credentials
from mtc.dispatch.calls import HostCalls
from mtc.operations import Operation, Request
from mtc.save.device_copy import DeviceCopier
from mtc.sidecar.ops import HostOps
from mtc.sidecar.restore.load import ShardLoader, load_leaves
from mtc.sidecar.restore.peers import PeerFiles
from mtc.sidecar.save.agent import HostAgent


@dataclasses.dataclass(frozen=True)
class NetworkTier:
    """Where a process of a multi-controller job gets other hosts' files: the
    replicators (``addresses`` in host order, reached with ``creds``); ``own``: its
    hosts; ``rank``: its host's replicator's rank (asked first: it may hold a copy);
    ``ranks``: the replicator rank at each address (empty: its position), the rank
    its certificate must name under mutual TLS."""

    addresses: tuple[str, ...]
    creds: Credentials
    own: tuple[int, ...]
    rank: int | None = None
    ranks: tuple[int, ...] = ()


class LocalDispatch(HostCalls):
    """Host-side code runs in this process (multi-controller JAX, simulated hosts).

    With ``network`` (multi-controller JAX, each process alone with its RAM disk)
    other hosts' manifests and regions come through their replicators."""

    def __init__(self, config: AgentConfig, network: NetworkTier | None = None, *,
                 copier: DeviceCopier | None = None) -> None:
        self.config = config
        self.agent = HostAgent(config)
        self.copier = copier or DeviceCopier(None)
        self.peers = (PeerFiles(network.addresses, network.creds, near=network.rank,
                                ranks=network.ranks)
                      if network is not None else None)
        self.own = network.own if network is not None else ()
        self.ops = HostOps(config, remote=self.peers.read if self.peers else None,
                           own=self.own)

    def _call(self, op: Operation[Any, Any], hosts: Sequence[int], request: Request
              ) -> list[Any]:
        return [decode_reply(self.ops.handle(op.encode(hosts, request)))]

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        # The last save's device copy is in host memory before this one is made:
        # one copy's worth of device memory at a time.
        self.agent.finish_transfer()
        copied = self.copier.copy(arrays)
        if copied is None:
            return self.agent.stage(header, arrays)
        return self.agent.stage(header, copied.arrays, owned=copied.owned)

    def wait(self) -> None:
        self.agent.wait()

    def raise_background_error(self) -> None:
        self.agent.raise_background_error()

    def saving(self) -> bool | None:
        return bool(self.agent.in_flight())

    def saves_in_flight(self, hosts: Sequence[int]) -> int:
        # The writer counts each host's part of a save.
        return -(-int(self.agent.in_flight()) // max(1, len(hosts)))

    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
        with ShardLoader(step, self.config.root,
                         remote=self.peers.read if self.peers else None,
                         own=self.ops.own_for(step)) as loader:
            return load_leaves(loader, tasks, specs)

    def own_for(self, step: int) -> tuple[int, ...]:
        return self.ops.own_for(step) if self.peers is not None else ()

    def networked(self) -> bool:
        return self.peers is not None

    def network_bytes(self) -> int:
        return self.peers.fetched_bytes if self.peers is not None else 0

    def close(self) -> None:
        try:
            self.agent.close()
        finally:
            self.ops.close()
            if self.peers is not None:
                self.peers.close()
