"""Host-side code in this process: multi-controller JAX (each process is its own host)
and simulated hosts of one process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mtc.contract import AgentConfig, LeafSpec, ReadTask, SaveHeader, decode_reply, encode_request
from mtc.dispatch.calls import HostCalls
from mtc_sidecar.agent import HostAgent
from mtc_sidecar.load import ShardLoader, load_leaves
from mtc_sidecar.ops import HostOps


class LocalDispatch(HostCalls):
    """Host-side code runs in this process (multi-controller JAX, simulated hosts)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.agent = HostAgent(config)
        self.ops = HostOps(config)

    def _call(self, op: str, hosts: Sequence[int], **args: Any) -> list[Any]:
        return [decode_reply(self.ops.handle(encode_request(op, hosts, **args)))]

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        return self.agent.stage(header, arrays)

    def wait(self) -> None:
        self.agent.wait()

    def raise_background_error(self) -> None:
        self.agent.raise_background_error()

    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
        return load_leaves(ShardLoader(step, self.config.root), tasks, specs)

    def close(self) -> None:
        try:
            self.agent.close()
        finally:
            self.ops.release_all()
