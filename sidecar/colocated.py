"""The host agent behind ``jax.experimental.colocated_python``.

On Pathways the controller's calls run in the colocated-Python sidecar of every
worker, each seeing only its own shards; on CPU devices JAX runs them in the
calling process. Colocated calls take and return only ``jax.Array`` pytrees, so
the save header travels as a replicated ``uint8`` array, and a restore's plan
travels in the (pickled) function itself.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import colocated_python

from sidecar.agent import AgentConfig, HostAgent, SaveHeader
from sidecar.load import LeafSpec, ReadTask, ShardLoader, load_leaves


class ColocatedAgent:
    """Wraps :class:`HostAgent` with array-only methods; one instance per host."""

    def __init__(self, config_json: str) -> None:
        self.agent = HostAgent(AgentConfig.from_json(config_json))

    def stage(self, header: jax.Array, arrays: list[jax.Array]) -> jax.Array:
        raw = np.asarray(header.addressable_shards[0].data).tobytes()
        ok = self.agent.stage(SaveHeader.from_bytes(raw), arrays)
        return jax.device_put(np.uint8(ok), header.sharding)

    def wait(self, token: jax.Array) -> jax.Array:
        self.agent.wait()
        return token

    def poll(self, token: jax.Array) -> jax.Array:
        self.agent.raise_background_error()
        return token


RemoteAgent = colocated_python.colocated_python_class(ColocatedAgent)


def _load(config_json: str, step: int, tasks: Sequence[ReadTask], specs: dict[int, LeafSpec],
          token: jax.Array) -> list[jax.Array]:
    config = AgentConfig.from_json(config_json)
    loader = ShardLoader(step, config.root)
    addressable: set[Any] = token.sharding.addressable_devices
    here = {d.id for d in addressable}
    mine = [t for t in tasks if set(t.device_ids) & here]
    leaves = load_leaves(loader, mine, specs)
    return [leaves[i] for i in sorted(specs)]


def remote_load(config_json: str, step: int, tasks: Sequence[ReadTask],
                specs: dict[int, LeafSpec], token: jax.Array) -> list[jax.Array]:
    """Run a restore's reads on every host; arrays come back on the colocated CPU devices."""
    fn = colocated_python.colocated_python(
        functools.partial(_load, config_json, step, list(tasks), specs))
    out_specs = [jax.ShapeDtypeStruct(specs[i].shape, jax.numpy.dtype(specs[i].dtype),
                                      sharding=specs[i].sharding) for i in sorted(specs)]
    fn = fn.specialize(out_specs_fn=lambda *_: out_specs)
    return list(fn(token))
