"""Moving arrays between an accelerator and its colocated CPU devices, and which CPU
devices those are.

On Pathways the runtime moves a restore's outputs from the worker's CPU devices
onto the accelerator, on the worker: no byte passes through the controller.
Where JAX runs colocated Python in this process (its fallback: the colocated CPU
devices are this process's own CPU client), ``jax.device_put`` from the CPU
client onto the accelerator takes a slow path: measured on a TPU v5e (JAX
0.10.2), 1 GiB went from the CPU devices onto the chip in 1.39 s, where the
same bytes as numpy took 0.087 s. There the bytes go through a host view
instead: a CPU device's buffer is this process's memory, so the view copies
nothing, and it is the worker's own memory, as on Pathways. (The other way,
onto the CPU devices, ``jax.device_put`` is the faster: 0.40 s for 1 GiB against
0.27 s to numpy and 0.42 s more into the CPU devices.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from mtc import multihost


def _own_cpu(devices: Any) -> bool:
    """Whether every one of ``devices`` is a CPU device of this process's own client
    (JAX's colocated-Python fallback), not a Pathways worker's."""
    own = {id(d) for d in jax.local_devices(backend="cpu")}
    return all(d.platform == "cpu" and id(d) in own for d in devices)


def _via_host(sources: Sequence[jax.Array], dests: Sequence[Any]) -> bool:
    """Whether moving ``sources`` onto ``dests`` (shardings or devices) goes from this
    process's CPU client onto an accelerator."""
    if not sources or multihost.on_pathways():
        return False
    dest_devices: list[Any] = [d for x in dests
                               for d in (x.device_set if isinstance(x, jax.sharding.Sharding)
                                         else {x})]
    src_devices: list[Any] = [d for a in sources for d in a.sharding.device_set]
    return _own_cpu(src_devices) and all(d.platform != "cpu" for d in dest_devices)


def move(sources: Sequence[jax.Array], dests: Sequence[Any], *,
         may_alias: bool | None = None) -> list[jax.Array]:
    """``jax.device_put(sources, dests)``, through host views where the move is from
    this process's colocated CPU devices onto an accelerator."""
    if not _via_host(sources, dests):
        return list(jax.device_put(list(sources), list(dests), may_alias=may_alias))
    return list(jax.device_put([np.asarray(a) for a in sources], list(dests)))


def to_workers(x: jax.Array | np.ndarray, cpu_devices: Sequence[Any],
               replicated: NamedSharding) -> jax.Array:
    """``x`` on the colocated CPU devices, over the one device list (``cpu_devices``)
    that colocated calls require; an array on another device list (a scalar on one
    device) is replicated onto it (``replicated``), a numpy array goes as its bytes."""
    if isinstance(x, np.ndarray):  # as bytes: JAX would narrow 64-bit dtypes
        return jax.device_put(np.ascontiguousarray(x).reshape(-1).view(np.uint8), replicated)
    s = x.sharding
    if isinstance(s, NamedSharding):
        cpu_mesh = colocated_cpu_mesh(s.mesh)  # type: ignore[arg-type]
        if list(cpu_mesh.devices.flat) == list(cpu_devices):
            if cpu_mesh is s.mesh or list(s.mesh.devices.flat) == list(cpu_devices):
                return x
            try:  # where the array lives (device, pinned host) goes with it
                cpu = NamedSharding(cpu_mesh, s.spec, memory_kind=s.memory_kind)
            except ValueError:  # a kind the CPU devices do not have
                cpu = NamedSharding(cpu_mesh, s.spec)
            return move([x], [cpu])[0]
    return move([x], [replicated])[0]


def colocated_cpu(devices: Sequence[Any]) -> list[Any]:
    """Each device's colocated CPU device, in order. Where the devices are CPU devices
    (the local cluster and the tests play accelerators with them) each is its own:
    JAX's CPU fallback would map any list onto the process's first CPU devices (a
    mesh of devices 4 to 7 onto 0 to 3, other hosts' devices), where on Pathways
    each device's colocated CPU device is its own host's."""
    from jax.experimental import colocated_python

    if all(d.platform == "cpu" for d in devices):
        return list(devices)
    return list(colocated_python.colocated_cpu_devices(tuple(devices)))


def colocated_cpu_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """``mesh`` over its devices' colocated CPU devices (:func:`colocated_cpu`)."""
    from jax.experimental import colocated_python

    if all(d.platform == "cpu" for d in mesh.devices.flat):
        return mesh
    return colocated_python.colocated_cpu_devices(mesh)
