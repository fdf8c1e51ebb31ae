"""Which distinct shards of an array each host holds: the one rule both the controller
(placing a save's bytes for a sidecar) and the host side (staging in-process) use;
and how an array is made from its shards' bytes (:class:`ShardLayout`), the one way
both halves of the local cluster's colocated runtime make a call's arrays."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from mtc.contract import shard_index
from mtc.manifest import Index

if TYPE_CHECKING:  # the sidecar process never imports JAX (it starts faster)
    import jax

# Arrays placed through JAX's own batched placement where it has one (ShardLayout).
JAX_BATCHED = True


def single_device_sharding(device: jax.Device, memory_kind: str | None = None
                           ) -> jax.sharding.Sharding:
    """A sharding onto one device (jax 0.12.1 deprecates the class's own name)."""
    import jax

    return jax.sharding.make_single_device_sharding(device, memory_kind=memory_kind)


def is_single_device_sharding(s: jax.sharding.Sharding) -> bool:
    """Whether ``s`` is the one-device kind; jax before 0.12.1 has no predicate."""
    import jax

    check = getattr(jax.sharding, "is_single_device_sharding", None)
    if check is not None:
        return bool(check(s))
    return isinstance(s, jax.sharding.SingleDeviceSharding)


def distinct_shards(a: jax.Array, host_of: Mapping[int, int]
                    ) -> list[tuple[int, int, Index, tuple[int, ...]]]:
    """(position among the addressable shards, host, index, shape), one per index a host
    holds: replicas on several devices of one host are written once."""
    seen: set[tuple[int, Index]] = set()
    found = []
    for pos, s in enumerate(a.addressable_shards):
        h = host_of[s.device.id]
        index = shard_index(s.index, a.shape)
        if (h, index) not in seen:
            seen.add((h, index))
            found.append((pos, h, index, tuple(b - a_ for a_, b in index)))
    return found


Plan = list[tuple[int, int, Index, tuple[int, ...]]]
PLANS_KEPT = 4096  # layouts remembered; a job has a few hundred per mesh


class ShardPlans:
    """:func:`distinct_shards`, worked out once per array layout.

    Which shards a host holds depends only on the sharding, the shape and the
    hosts of the sharding's devices; working it out builds a shard object per
    device and its index, for every leaf, inside a save's blocking time, and
    several times what looking the answer up costs. Each save asks again with
    the same layouts, so the answers are remembered
    (at most ``PLANS_KEPT``: a job that keeps resizing its mesh starts over
    rather than grow without bound)."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], Plan] = {}

    def __call__(self, a: jax.Array, host_of: Mapping[int, int]) -> Plan:
        s = a.sharding
        # The hosts are part of the key: one device id may be another host's in
        # another call (a colocated worker numbers its own devices, and its map
        # names only those: the ones addressable there).
        devices: set[Any] = s.addressable_devices
        hosts = tuple(sorted((d.id, host_of[d.id]) for d in devices))
        key = (s, a.shape, hosts)
        found = self._plans.get(key)
        if found is None:
            if len(self._plans) >= PLANS_KEPT:
                self._plans.clear()
            found = self._plans[key] = distinct_shards(a, host_of)
        return found


def paste(out: np.ndarray, out_index: Index, src: np.ndarray, src_index: Index) -> None:
    """Copy the overlap of ``src`` (the ``src_index`` region of a leaf) into ``out`` (its
    ``out_index`` region)."""
    lo = [max(a, c) for (a, _), (c, _) in zip(out_index, src_index, strict=True)]
    hi = [min(b, d) for (_, b), (_, d) in zip(out_index, src_index, strict=True)]
    dst = tuple(slice(x - t, y - t) for x, y, (t, _) in zip(lo, hi, out_index, strict=True))
    sel = tuple(slice(x - s, y - s) for x, y, (s, _) in zip(lo, hi, src_index, strict=True))
    out[dst] = src[sel]


class ShardLayout:
    """How an array of ``spec`` (shape, dtype, sharding) is made from its addressable
    devices' shards, worked out once (a small call's cost is mostly such work): the
    devices in the sharding's own order (a set's order would place shards on the
    wrong devices), the shard's shape, dtype and size."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.devices = list(device_order(spec.sharding, spec.shape))
        self.shard = spec.sharding.shard_shape(spec.shape)
        self.dtype = np.dtype(spec.dtype)
        self.nbytes = math.prod(self.shard) * self.dtype.itemsize

    def array(self, by_device: Mapping[Any, np.ndarray]) -> jax.Array:
        """The array from each device's shard (its bytes, contiguous), as
        :func:`place` makes it."""
        views = [by_device[d].view(self.dtype).reshape(self.shard) for d in self.devices]
        return place(self.spec.shape, self.dtype, self.spec.sharding, views, self.devices)


@functools.lru_cache(maxsize=256)
def device_order(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """The addressable devices of ``sharding`` in its own order (what :func:`place`
    takes; a set's order would place shards on the wrong devices), worked out once
    per layout: for an array of a few bytes it costs more than the placement."""
    return tuple(sharding.addressable_devices_indices_map(shape))


def place(shape: tuple[int, ...], dtype: np.dtype[Any], sharding: jax.sharding.Sharding,
          views: list[np.ndarray], devices: list[Any]) -> jax.Array:
    """The array of ``shape`` on ``sharding`` whose shard on ``devices[i]`` is
    ``views[i]`` (one per addressable device), in the sharding's memory kind (pinned
    host memory stays that memory), placed in one batched step: JAX's own, which
    its public calls wrap in per-call work that a small array otherwise spends most
    of its time on; the public calls where this JAX lacks it. No ``views``: the
    array of a process that holds none of its shards."""
    import jax

    if not views:
        return jax.make_array_from_single_device_arrays(shape, sharding, [], dtype=dtype)
    put = _jax_batched_put() if JAX_BATCHED else None
    if put is not None:
        return put(shape, dtype, sharding, views, devices)
    placed = jax.device_put(views, [single_device_sharding(d, sharding.memory_kind)
                                    for d in devices])
    return jax.make_array_from_single_device_arrays(shape, sharding, placed)


@functools.cache
def _jax_batched_put() -> Callable[..., Any] | None:
    try:
        from jax._src import core
        from jax._src.interpreters import pxla
    except ImportError:
        return None
    put, aval = getattr(pxla, "batched_device_put", None), getattr(core, "ShapedArray", None)
    if put is None or aval is None:
        return None
    return lambda shape, dtype, sharding, views, devices: put(
        aval(shape, dtype), sharding, views, devices)
