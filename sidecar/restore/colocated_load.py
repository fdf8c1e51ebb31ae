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

Each worker's devices carry its own part of the request (the outputs' layout
and its own host's reads), so a worker parses what it does, whatever the number
of hosts.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtc.contract import ReadTask, task_from_json, unframe
from mtc.errors import ProtocolError
from mtc.shards import device_order, place, single_device_sharding
from mtc.sidecar.dtypes import numpy_dtype
from mtc.sidecar.restore.load import ShardLoader, check_tasks


def hosts_of(ranks: jax.Array) -> dict[jax.Device, int]:
    """Which host each of this worker's devices is (its element of ``ranks``)."""
    return {s.device: int(np.asarray(s.data).reshape(-1)[0]) for s in ranks.addressable_shards}


def requests_of(request: jax.Array, host_of: dict[jax.Device, int]) -> dict[int, dict[str, Any]]:
    """Each host's part of a load request (:func:`mtc.contract.frame`d JSON), read
    from the first of its devices' shards."""
    out: dict[int, dict[str, Any]] = {}
    for s in request.addressable_shards:
        h = host_of.get(s.device)
        if h is None or h in out:
            continue
        raw = np.asarray(s.data).reshape(-1)
        n, payload = unframe(raw)
        if payload is None:
            raise ProtocolError(f"a load request says {n} bytes in a part of {raw.size}",
                                host=h)
        try:
            part = json.loads(payload)
        except ValueError as e:
            raise ProtocolError(f"a load request is not JSON: {e}", host=h) from None
        if not isinstance(part, dict):
            raise ProtocolError("a load request is not an object", host=h)
        out[h] = part
    try:
        steps = {int(p["step"]) for p in out.values()}
    except (KeyError, TypeError, ValueError) as e:
        raise ProtocolError(f"a load request without its step: {e!r}") from None
    if len(steps) > 1:
        raise ProtocolError(f"a load request names steps {sorted(steps)}")
    return out


def spec_from_json(spec: Sequence[Any]) -> PartitionSpec:
    return PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in spec])


def sharding_from_json(d: dict[str, Any], devices: Sequence[jax.Device]) -> jax.sharding.Sharding:
    """The output's sharding over ``devices`` (the call's device list, by position)."""
    if "single" in d:
        return single_device_sharding(devices[int(d["single"])])
    mesh = d["mesh"]
    grid = np.array([devices[int(p)] for p in mesh["pos"]], dtype=object).reshape(
        tuple(int(n) for n in mesh["shape"]))
    return NamedSharding(Mesh(grid, tuple(mesh["axes"])), spec_from_json(d["spec"]))


def load_regions(request: jax.Array, ranks: jax.Array,
                 root_of: Callable[[int], Path]) -> list[jax.Array]:
    """The arrays ``request`` asks for, this worker's shards of them filled from its
    own host's (or, in-process, hosts') files, each host reading its own part of
    the request (:func:`requests_of`); ``ranks`` says which host each of this
    worker's devices is, and its device list is what positions index."""
    host_of = hosts_of(ranks)
    mine = set(host_of.values())
    requests = requests_of(request, host_of)
    if set(requests) != mine:
        raise ProtocolError(f"a load request for hosts {sorted(requests)} reached hosts "
                            f"{sorted(mine)}")
    common = requests[min(mine)]  # the outputs' layout: every host's part has it
    step = int(common["step"])
    devices = list(ranks.sharding.mesh.devices.flat)  # type: ignore[attr-defined]
    position = {d: k for k, d in enumerate(devices)}
    with ShardLoader(step, root_of) as loader:  # its step folders closed after the reads
        # (output, device position) -> the task whose region that device's shard is
        region_of: dict[tuple[int, int], ReadTask] = {}
        for h in mine:
            asked = requests[h]["tasks"].get(str(h), [])
            tasks = [task_from_json(a["task"]) for a in asked]
            check_tasks(tasks, step=step, host=h)
            for a, t in zip(asked, tasks, strict=True):
                if {p.host for p in t.pieces} != {h}:
                    raise ProtocolError("asked to read pieces of another host", step=step, host=h)
                for pos in a["pos"]:
                    region_of[(int(a["out"]), int(pos))] = t
        # id(task) -> its region: each read once, several at once (read_all).
        order = list({id(t): t for t in region_of.values()}.values())
        with contextlib.closing(loader.read_all(order)) as regions:
            read = {id(t): r for t, r in zip(order, regions, strict=True)}
        # Each array made from its shards in one batched placement (hundreds of
        # leaves: JAX's public calls cost more per leaf than their bytes); the
        # devices in the sharding's own order, worked out once per layout.
        outputs: list[jax.Array] = []
        layouts: dict[tuple[str, tuple[int, ...]], tuple[Any, list[jax.Device],
                                                         tuple[int, ...]]] = {}
        for k, out in enumerate(common["outputs"]):
            shape = tuple(int(n) for n in out["shape"])
            dtype = numpy_dtype(out["dtype"])
            key = (json.dumps([out.get("single"), out.get("mesh"), out.get("spec")]), shape)
            if key not in layouts:
                sharding = sharding_from_json(out, devices)
                layouts[key] = (sharding, [d for d in device_order(sharding, shape)
                                           if d in host_of], sharding.shard_shape(shape))
            sharding, own, shard = layouts[key]
            views: list[np.ndarray] = []
            for d in own:
                task = region_of.get((k, position[d]))
                if task is None:  # the controller assembles it from other hosts' pieces
                    views.append(np.zeros(shard, dtype))
                    continue
                region = read[id(task)]
                if region.shape != shard or region.dtype != dtype:
                    raise ProtocolError(f"output {k}: a region of shape {region.shape} "
                                        f"{region.dtype} for a shard of {shard} {dtype}",
                                        step=step, host=host_of[d])
                views.append(region)
            outputs.append(place(shape, dtype, sharding, views, own))
        # A region one host reads whole for others: its task is in that host's part.
        for k, entry in enumerate(common.get("regions", [])):
            d = devices[int(entry["pos"])]
            shape = tuple(int(n) for n in entry["shape"])
            dtype = numpy_dtype(entry["dtype"])
            if d not in host_of:
                outputs.append(place(shape, dtype, single_device_sharding(d), [], []))
                continue
            own_regions = requests[host_of[d]].get("regions", [])
            if k >= len(own_regions) or "task" not in own_regions[k]:
                raise ProtocolError("a region of this host's came without its task",
                                    step=step, host=host_of[d])
            t = task_from_json(own_regions[k]["task"])
            check_tasks([t], step=step, host=host_of[d])
            if {p.host for p in t.pieces} != {host_of[d]}:
                raise ProtocolError("asked to read pieces of another host", step=step,
                                    host=host_of[d])
            region = loader.read(t)
            if region.shape != shape or region.dtype != dtype:
                raise ProtocolError("a region is not the shape it was asked as", step=step)
            outputs.append(place(shape, dtype, single_device_sharding(d), [region], [d]))
    foreign = common.get("foreign")
    if foreign is not None:
        pieces_of = {h: requests[h]["foreign"]["pieces"].get(str(h), []) for h in mine}
        sharding = sharding_from_json(foreign["out"], devices)
        cap = int(foreign["cap"])
        pieces = []
        for d in sharding.addressable_devices:
            buf = np.zeros(cap, np.uint8)
            for entry in pieces_of[host_of[d]]:
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
