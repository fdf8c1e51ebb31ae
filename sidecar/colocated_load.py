"""A worker's side of a colocated restore: its own files, read and verified, as
arrays on its own colocated CPU devices.

The controller's request names, for each array it asks for, the target sharding
mapped onto the colocated CPU devices (a mesh of positions in the device list of
the call's ``ranks`` array, the axis names and the partition spec), and for each
host the read tasks whose regions go to which of those devices. A worker fills
the shards of its own devices; a region its host does not hold whole (a
resharded restore whose pieces other hosts saved) is left to the controller,
which assembles it on the target device from the holders' pieces: every holder
returns its share of those pieces in one flat buffer on one of its CPU devices.
No byte leaves a worker except as a shard of an array on its own devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from mtc.contract import ReadTask, task_from_json
from mtc.errors import ProtocolError
from mtc.sidecar.dtypes import numpy_dtype
from mtc.sidecar.load import ShardLoader, check_tasks


def spec_from_json(spec: Sequence[Any]) -> PartitionSpec:
    return PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in spec])


def sharding_from_json(d: dict[str, Any], devices: Sequence[jax.Device]) -> jax.sharding.Sharding:
    """The output's sharding over ``devices`` (the call's device list, by position)."""
    if "single" in d:
        return SingleDeviceSharding(devices[int(d["single"])])
    mesh = d["mesh"]
    grid = np.array([devices[int(p)] for p in mesh["pos"]], dtype=object).reshape(
        tuple(int(n) for n in mesh["shape"]))
    return NamedSharding(Mesh(grid, tuple(mesh["axes"])), spec_from_json(d["spec"]))


def load_regions(request: dict[str, Any], ranks: jax.Array,
                 root_of: Callable[[int], Path]) -> list[jax.Array]:
    """The arrays ``request`` asks for, this worker's shards of them filled from its
    own host's (or, in-process, hosts') files; ``ranks`` says which host each of
    this worker's devices is, and its device list is what positions index."""
    step = int(request["step"])
    devices = list(ranks.sharding.mesh.devices.flat)  # type: ignore[attr-defined]
    position = {d: k for k, d in enumerate(devices)}
    host_of = {s.device: int(np.asarray(s.data).reshape(-1)[0]) for s in ranks.addressable_shards}
    mine = set(host_of.values())
    loader = ShardLoader(step, root_of)
    # (output, device position) -> the task whose region that device's shard is
    region_of: dict[tuple[int, int], ReadTask] = {}
    for h in mine:
        asked = request["tasks"].get(str(h), [])
        tasks = [task_from_json(a["task"]) for a in asked]
        check_tasks(tasks, step=step, host=h)
        for a, t in zip(asked, tasks, strict=True):
            if {p.host for p in t.pieces} != {h}:
                raise ProtocolError("asked to read pieces of another host", step=step, host=h)
            for pos in a["pos"]:
                region_of[(int(a["out"]), int(pos))] = t
    read: dict[int, np.ndarray] = {}  # id(task) -> its region, read once
    # Every shard read first, then onto its device in one device_put (hundreds of
    # leaves: one call each cost more than their bytes), then made into its array.
    regions: list[np.ndarray] = []
    places: list[jax.Device] = []
    made: list[tuple[tuple[int, ...], jax.sharding.Sharding, np.dtype[Any], int]] = []
    for k, out in enumerate(request["outputs"]):
        sharding = sharding_from_json(out, devices)
        shape = tuple(int(n) for n in out["shape"])
        dtype = numpy_dtype(out["dtype"])
        count = 0
        for d in sharding.addressable_devices:
            if d not in host_of:
                continue
            task = region_of.get((k, position[d]))
            if task is None:  # the controller assembles it from other hosts' pieces
                region = np.zeros(sharding.shard_shape(shape), dtype)
            else:
                if id(task) not in read:
                    read[id(task)] = loader.read(task)
                region = read[id(task)]
            regions.append(region)
            places.append(d)
            count += 1
        made.append((shape, sharding, dtype, count))
    for entry in request.get("regions", []):  # a region one host reads whole for others
        d = devices[int(entry["pos"])]
        shape = tuple(int(n) for n in entry["shape"])
        dtype = numpy_dtype(entry["dtype"])
        count = 0
        if d in host_of:
            t = task_from_json(entry["task"])
            check_tasks([t], step=step, host=host_of[d])
            if {p.host for p in t.pieces} != {host_of[d]}:
                raise ProtocolError("asked to read pieces of another host", step=step,
                                    host=host_of[d])
            region = loader.read(t)
            if region.shape != shape or region.dtype != dtype:
                raise ProtocolError("a region is not the shape it was asked as", step=step)
            regions.append(region)
            places.append(d)
            count = 1
        made.append((shape, SingleDeviceSharding(d), dtype, count))
    placed = iter(jax.device_put(regions, places) if regions else [])
    outputs: list[jax.Array] = [
        jax.make_array_from_single_device_arrays(shape, sharding,
                                                 [next(placed) for _ in range(count)],
                                                 dtype=dtype)
        for shape, sharding, dtype, count in made]
    foreign = request.get("foreign")
    if foreign is not None:
        sharding = sharding_from_json(foreign["out"], devices)
        cap = int(foreign["cap"])
        pieces = []
        for d in sharding.addressable_devices:
            buf = np.zeros(cap, np.uint8)
            for entry in foreign["pieces"].get(str(host_of[d]), []):
                t = task_from_json(entry["task"])
                check_tasks([t], step=step, host=host_of[d])
                data = np.ascontiguousarray(loader.read(t)).reshape(-1).view(np.uint8)
                off = int(entry["offset"])
                if off + data.nbytes > cap:
                    raise ProtocolError("a piece does not fit its buffer", step=step)
                buf[off:off + data.nbytes] = data
            pieces.append(jax.device_put(buf, d))
        outputs.append(jax.make_array_from_single_device_arrays(
            (cap * math.prod(sharding.mesh.devices.shape),),  # type: ignore[attr-defined]
            sharding, pieces, dtype=np.dtype(np.uint8)))
    return outputs
