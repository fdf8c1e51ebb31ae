"""The elastic trainer's meshes: the devices grouped into slices and hosts, and one
:class:`Trainer` (its compiled programs) per set of slices, kept: coming back to a
mesh costs no compile."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from mtc.trainer.model import Config, Trainer

Slices = tuple[int, ...]


class SliceMeshes:
    """``devices`` (sorted by id) as ``slices`` slices of consecutive devices, each
    of ``hosts_per_slice`` hosts. :meth:`trainer` may be called from the loop and
    the compile-ahead thread."""

    def __init__(self, devices: Sequence[jax.Device], *, slices: int, hosts_per_slice: int,
                 cfg: Config, batch_size: int) -> None:
        self.devices = sorted(devices, key=lambda d: d.id)
        if len(self.devices) % slices or len(self.devices) % (slices * hosts_per_slice):
            raise SystemExit(f"{len(self.devices)} devices do not split into {slices} slices "
                             f"of {hosts_per_slice} hosts")
        self.slices = slices
        self.hosts_per_slice = hosts_per_slice
        self.per_slice = len(self.devices) // slices
        self.per_host = self.per_slice // hosts_per_slice
        self.slice_devices = {s: self.devices[s * self.per_slice:(s + 1) * self.per_slice]
                              for s in range(slices)}
        self.cfg = cfg
        self.batch_size = batch_size
        self._trainers: dict[Slices, Trainer] = {}
        self._lock = threading.Lock()  # guards _trainers

    def group_by_slice(self, devices: Sequence[jax.Device]) -> Mapping[int, Sequence[jax.Device]]:
        """pathwaysutils' ``get_slice_to_devices`` for these CPU devices."""
        index = {d.id: i for i, d in enumerate(self.devices)}
        out: dict[int, list[jax.Device]] = {}
        for d in devices:
            out.setdefault(index[d.id] // self.per_slice, []).append(d)
        return out

    def hosts_of(self, slices: Slices) -> list[int]:
        return [s * self.hosts_per_slice + h for s in slices for h in range(self.hosts_per_slice)]

    def devices_of_slices(self, slices: Slices) -> list[jax.Device]:
        return [d for s in slices for d in self.slice_devices[s]]

    def default_device(self, slices: Slices) -> jax.Device:
        return self.slice_devices[slices[0]][0]

    def trainer(self, slices: Slices) -> Trainer:
        """The trainer of the mesh of these slices: axis ``replica`` across them,
        ``model`` within one."""
        with self._lock:
            if slices not in self._trainers:
                mesh = Mesh(np.array(self.devices_of_slices(slices)).reshape(
                    len(slices), self.per_slice), ("replica", "model"))
                self._trainers[slices] = Trainer(self.cfg, mesh, batch_size=self.batch_size)
            return self._trainers[slices]
