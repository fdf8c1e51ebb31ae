"""Which host and slice each device belongs to.

- Pathways (one controller sees every device, each reporting ``process_index``
  0): a host is a Pathways worker, known by its slice and its task within the
  slice (device attributes ``slice_index`` and ``virtual_task_index`` or
  ``task_id``; older runtimes only print the task in the device's repr).
  Workers are ranked slice-major, as Orbax's colocated checkpointing and the
  replicators' peer groups rank them.
- Multi-controller JAX: a host is a process (``process_index``); TPU devices
  carry ``slice_index``, and on CPUs or GPUs slices are formed from
  ``hosts_per_slice`` consecutive processes.
- One machine: a single process can group its devices into simulated hosts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax

from mtc.errors import ConfigError
from mtc.options import Options


@dataclasses.dataclass(frozen=True)
class Topology:
    """Device-to-host and host-to-slice maps, and the hosts this process serves."""

    host_of_device: dict[int, int]
    slice_of_host: dict[int, int]
    local_hosts: tuple[int, ...]
    subdirs: bool

    @property
    def num_hosts(self) -> int:
        return len(self.slice_of_host)

    @property
    def num_slices(self) -> int:
        return len(set(self.slice_of_host.values()))

    def devices_of_host(self, devices: Sequence[jax.Device], host: int) -> list[jax.Device]:
        return [d for d in devices if self.host_of_device.get(d.id) == host]

    @classmethod
    def detect(cls, devices: Sequence[jax.Device], options: Options, *,
               pathways: bool = False) -> Topology:
        devices = sorted(devices, key=lambda d: d.id)
        if options.simulated_hosts is not None:
            return cls._simulated(devices, options)
        if pathways:
            return cls._pathways(devices)
        host_of = {d.id: d.process_index for d in devices}
        slice_of: dict[int, int] = {}
        for d in devices:
            s = getattr(d, "slice_index", None)
            slice_of[d.process_index] = (
                int(s) if s is not None else d.process_index // options.hosts_per_slice)
        me = jax.process_index()
        local = tuple(sorted({h for d, h in ((d, host_of[d.id]) for d in devices)
                              if d.process_index == me}))
        subdirs = options.host_subdirs
        if subdirs is None:
            # One process per host (multi-controller JAX) keeps its steps at the root of
            # its RAM disk, where the host's replicator looks: the deployment's layout.
            # One process on CPU devices is this machine standing in for a job: host
            # folders, so a RAM disk's root is never mistaken for one host's.
            subdirs = devices[0].platform == "cpu" and jax.process_count() == 1
        return cls(host_of, slice_of, local, subdirs)

    @classmethod
    def _pathways(cls, devices: Sequence[Any]) -> Topology:
        """Workers by (slice, task), ranked slice-major; the controller serves them all."""
        keys = {d.id: pathways_worker(d) for d in devices}
        ranked = sorted(set(keys.values()))
        rank = {k: r for r, k in enumerate(ranked)}
        host_of = {i: rank[k] for i, k in keys.items()}
        slice_of = {rank[k]: k[0] for k in ranked}
        # Every worker has a RAM disk of its own: no host-<i> subfolders.
        return cls(host_of, slice_of, tuple(range(len(ranked))), False)

    @classmethod
    def _simulated(cls, devices: Sequence[jax.Device], options: Options) -> Topology:
        n = options.simulated_hosts or 1
        if jax.process_count() != 1:
            raise ConfigError("simulated_hosts needs a single JAX process; "
                              "with several processes each process is one host")
        if len(devices) % n:
            raise ConfigError(f"{len(devices)} devices cannot be split into {n} simulated hosts")
        if n % options.hosts_per_slice:
            raise ConfigError(f"{n} simulated hosts cannot form slices of "
                              f"{options.hosts_per_slice} hosts")
        per = len(devices) // n
        host_of = {d.id: i // per for i, d in enumerate(devices)}
        slice_of = {h: h // options.hosts_per_slice for h in range(n)}
        subdirs = True if options.host_subdirs is None else options.host_subdirs
        if not subdirs and n > 1:
            raise ConfigError("several simulated hosts need host_subdirs")
        return cls(host_of, slice_of, tuple(range(n)), subdirs)


_TASK_IN_REPR = (re.compile(r"logical_task=(\d+)"), re.compile(r"vtask=(\d+)"))


def pathways_worker(device: Any) -> tuple[int, int]:
    """(slice, task) of the Pathways worker holding ``device``.

    ``process_index`` is 0 for every device on Pathways and says nothing; a
    device without a task cannot be placed, and guessing would merge hosts.
    """
    task: int | None = None
    for attr in ("virtual_task_index", "task_id"):
        value = getattr(device, attr, None)
        if value is not None:
            task = int(value)
            break
    if task is None:
        text = repr(device)
        for pattern in _TASK_IN_REPR:
            m = pattern.search(text)
            if m:
                task = int(m.group(1))
                break
    if task is None:
        raise ConfigError(f"cannot tell which Pathways worker holds {device!r}: "
                          "it has no task attribute (virtual_task_index, task_id)")
    s = getattr(device, "slice_index", None)
    return (int(s) if s is not None else 0, task)
