"""Controller side of a save: describe the tree and pick what the hosts write.

Array leaves are handed to the hosts as arrays; typed PRNG keys go as their key
data with the implementation's name recorded; numpy arrays are kept by every
host; everything else must be a plain value that the manifest stores inline.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from mtc import treepath
from mtc.contract import SaveHeader
from mtc.errors import UnsupportedLeafError
from mtc.manifest import LeafEntry
from mtc.shards import is_single_device_sharding


def describe_sharding(s: jax.sharding.Sharding) -> dict[str, Any]:
    """A JSON description of a sharding, for people and tools reading manifests."""
    device_set: set[Any] = s.device_set
    if isinstance(s, jax.sharding.NamedSharding):
        return {"type": "named", "axes": list(s.mesh.axis_names),
                "mesh_shape": [int(x) for x in s.mesh.devices.shape],
                "device_ids": [int(d.id) for d in s.mesh.devices.flat],
                "spec": [list(p) if isinstance(p, tuple) else p for p in s.spec]}
    if is_single_device_sharding(s):
        return {"type": "single", "device_ids": [int(next(iter(device_set)).id)]}
    return {"type": type(s).__name__, "device_ids": sorted(int(d.id) for d in device_set)}


def is_prng_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _metric_leaves(metrics: Any) -> list[LeafEntry]:
    """``metrics`` as plain-value leaves under :data:`treepath.METRICS_ROOT`."""
    out = []
    for path, x in treepath.flatten(metrics)[0]:
        name = treepath.METRICS_ROOT + treepath.path_str(path)
        if isinstance(x, (jax.Array, np.ndarray)):
            if x.shape != () or is_prng_key(x):
                raise UnsupportedLeafError(f"metric {name} is an array of shape {x.shape}; "
                                           "metrics must be scalars or plain values")
            x = np.asarray(x)[()]
        keys = (("d", treepath.METRICS_ROOT), *treepath.encode_keys(path))
        out.append(LeafEntry(name, keys, "value", value=treepath.encode_value(x, name)))
    return out


def prepare(step: int, state: Any, *, skip_if_busy: bool, metrics: Any = None, run: str = "",
            ranks: tuple[int, ...] = (), items: Sequence[str] | None = None,
            custom: str | None = None, saved_at: float | None = None
            ) -> tuple[SaveHeader, list[jax.Array | np.ndarray]]:
    """The save header and the arrays, in header order, that hosts must write;
    ``run``: the manager's run identity, written into every host's manifest, as
    ``ranks`` (each host's replicator rank, when host h is not rank h) is;
    ``items``: the item names of an Orbax ``Composite`` save; ``custom``: Orbax's
    ``custom_metadata`` of the step, as JSON text; ``saved_at``: when the save
    began (seconds since the epoch)."""
    flat, _ = treepath.flatten(state)
    leaves: list[LeafEntry] = []
    arrays: list[jax.Array | np.ndarray] = []
    array_leaves: list[int] = []
    for i, (path, x) in enumerate(flat):
        name = treepath.path_str(path)
        keys = treepath.encode_keys(path)
        if is_prng_key(x):
            data = jax.random.key_data(x)
            leaves.append(LeafEntry(name, keys, "prng_key", tuple(data.shape), str(data.dtype),
                                    describe_sharding(data.sharding),
                                    key_impl=str(jax.random.key_impl(x))))
            arrays.append(data)
        elif isinstance(x, jax.Array):
            leaves.append(LeafEntry(name, keys, "array", tuple(x.shape), str(x.dtype),
                                    describe_sharding(x.sharding)))
            arrays.append(x)
        elif isinstance(x, np.ndarray):
            if x.dtype.kind not in "biufc" and x.dtype.name != "bfloat16":
                raise UnsupportedLeafError(f"leaf {name} is a numpy array of dtype {x.dtype}, "
                                           "which mtc cannot save (numeric dtypes only)")
            leaves.append(LeafEntry(name, keys, "numpy", tuple(x.shape), str(x.dtype)))
            arrays.append(x)
        else:
            leaves.append(LeafEntry(name, keys, "value", value=treepath.encode_value(x, name)))
            continue
        array_leaves.append(i)
    if metrics is not None:
        leaves.extend(_metric_leaves(metrics))
    if items is not None:
        leaves.append(LeafEntry(treepath.ITEMS_ROOT, (("d", treepath.ITEMS_ROOT),), "value",
                                value=treepath.encode_value(json.dumps(list(items)),
                                                           treepath.ITEMS_ROOT)))
    if custom is not None:
        leaves.append(LeafEntry(treepath.CUSTOM_ROOT, (("d", treepath.CUSTOM_ROOT),), "value",
                                value=treepath.encode_value(custom, treepath.CUSTOM_ROOT)))
    if saved_at is not None:
        leaves.append(LeafEntry(treepath.SAVED_AT_ROOT, (("d", treepath.SAVED_AT_ROOT),),
                                "value", value=treepath.encode_value(
                                    float(saved_at), treepath.SAVED_AT_ROOT)))
    return SaveHeader(step, tuple(leaves), tuple(array_leaves), skip_if_busy, run, ranks), arrays


def bytes_on_hosts(arrays: Sequence[jax.Array | np.ndarray], host_of_device: Mapping[int, int],
                   num_hosts: int) -> int:
    """Bytes the ``num_hosts`` hosts this process serves write for ``arrays``: each
    region a host holds once (replicas on its devices are written once), numpy
    leaves whole on every host. For the save's log line: this process's share,
    not the job's."""
    total = 0
    for a in arrays:
        if not isinstance(a, jax.Array):
            total += int(a.nbytes) * num_hosts
            continue
        seen: set[tuple[int, tuple[tuple[int, int], ...]]] = set()
        indices: Mapping[Any, Any] = a.sharding.addressable_devices_indices_map(a.shape)
        for d, idx in indices.items():
            key = (host_of_device.get(d.id, -1),
                   tuple(s.indices(n)[:2] for s, n in zip(idx or (), a.shape, strict=False)))
            if key not in seen:
                seen.add(key)
                total += math.prod(b - s for s, b in key[1]) * a.dtype.itemsize
    return total
