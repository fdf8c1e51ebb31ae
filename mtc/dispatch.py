"""How the controller reaches host-side code: in this process, or colocated Python.

Both dispatchers drive the same :class:`sidecar.agent.HostAgent` and the same
restore loader; they differ only in how arguments travel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sidecar.agent import AgentConfig, HostAgent, SaveHeader
from sidecar.load import LeafSpec, ReadTask, ShardLoader, load_leaves


class Dispatch(Protocol):
    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool: ...
    def wait(self) -> None: ...
    def raise_background_error(self) -> None: ...
    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]: ...
    def close(self) -> None: ...


class LocalDispatch:
    """Host-side code runs in this process (multi-controller JAX, simulated hosts)."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.agent = HostAgent(config)

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
        self.agent.close()


class ColocatedDispatch:
    """Host-side code runs through ``jax.experimental.colocated_python`` (Pathways)."""

    def __init__(self, config: AgentConfig, devices: Sequence[jax.Device]) -> None:
        from jax.experimental import colocated_python

        from sidecar.colocated import RemoteAgent

        self.config = config
        self.cpu_devices = list(colocated_python.colocated_cpu_devices(tuple(devices)))
        self._replicated = NamedSharding(
            jax.sharding.Mesh(np.array(self.cpu_devices), ("hosts",)), PartitionSpec())
        self.remote: Any = RemoteAgent(config.to_json())  # type: ignore[call-arg]

    def _token(self) -> jax.Array:
        return jax.device_put(np.uint8(0), self._replicated)

    def _to_cpu(self, x: jax.Array | np.ndarray) -> jax.Array:
        """The array on the colocated CPU devices, over the one device list that
        colocated calls require; arrays on another device list (a scalar on one
        device) are replicated onto it."""
        from jax.experimental import colocated_python

        if isinstance(x, np.ndarray):  # as bytes: JAX would narrow 64-bit dtypes
            return jax.device_put(np.ascontiguousarray(x).reshape(-1).view(np.uint8),
                                  self._replicated)
        s = x.sharding
        if isinstance(s, NamedSharding):
            cpu_mesh = colocated_python.colocated_cpu_devices(s.mesh)  # type: ignore[arg-type]
            if list(cpu_mesh.devices.flat) == self.cpu_devices:
                if cpu_mesh is s.mesh or list(s.mesh.devices.flat) == self.cpu_devices:
                    return x
                return jax.device_put(x, NamedSharding(cpu_mesh, s.spec))
        return jax.device_put(x, self._replicated)

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        raw = np.frombuffer(header.to_bytes(), dtype=np.uint8)
        header_arr = jax.device_put(raw, self._replicated)
        ok = self.remote.stage(header_arr, [self._to_cpu(a) for a in arrays])
        return bool(np.asarray(ok.addressable_shards[0].data))

    def wait(self) -> None:
        self.remote.wait(self._token()).block_until_ready()

    def raise_background_error(self) -> None:
        self.remote.poll(self._token()).block_until_ready()

    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
        from sidecar.colocated import remote_load

        arrays = remote_load(self.config.to_json(), step, tasks, specs, self._token())
        return dict(zip(sorted(specs), arrays, strict=True))

    def close(self) -> None:
        self.wait()
