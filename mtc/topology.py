"""Which host and slice each device belongs to.

On TPU and Pathways a device carries ``slice_index`` and the host is its
process. Multi-controller JAX on CPUs or GPUs has one process per host and no
slices, so slices are formed from ``hosts_per_slice`` consecutive hosts. On one
machine, a single process can group its devices into simulated hosts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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
    def detect(cls, devices: Sequence[jax.Device], options: Options) -> Topology:
        devices = sorted(devices, key=lambda d: d.id)
        if options.simulated_hosts is not None:
            return cls._simulated(devices, options)
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
            subdirs = devices[0].platform == "cpu"
        return cls(host_of, slice_of, local, subdirs)

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
