"""Controller side of a colocated restore: one call, and no restored byte in this
process.

The request asks each worker for the target arrays laid out as their target
shardings mapped onto the colocated CPU devices; each worker fills its own
devices' shards from its own files (:mod:`mtc.sidecar.restore.colocated_load`). The
controller then moves them onto the target shardings with ``jax.device_put``
(on Pathways a copy within each worker, from its CPU to its accelerators).

A leaf with a region whose pieces other hosts saved (a restore onto another
mesh, or a replaced host's regions read from another slice's copies) is built on
its target devices instead: a region one host holds whole comes back as an array
of its own on one of that host's CPU devices, which ``device_put`` moves onto
each target device that needs it (nothing is compiled); the pieces of a region
several hosts hold come in one flat buffer per holder on one of its CPU
devices, and JAX slices, reinterprets, moves and places them device to
device. Only the plan (JSON) and the arrays' handles pass through here.

Each worker gets its own part of the plan (:func:`encode`): the outputs' layout,
which every worker needs, and the reads of its own host only, so that a worker
parses what it does, not the whole job's plan (which grows with the hosts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from mtc.contract import LeafSpec, ReadTask, frame, task_to_json
from mtc.dispatch.colocated_moves import move
from mtc.manifest import Index
from mtc.shards import is_single_device_sharding, single_device_sharding

ALIGN = 64  # pieces in a holder's buffer start on this boundary


def supported(specs: dict[int, LeafSpec]) -> bool:
    """Whether every target sharding maps onto colocated CPU devices here."""
    return all(isinstance(s.sharding, NamedSharding) or is_single_device_sharding(s.sharding)
               for s in specs.values())


# Each group of a restore's load calls is this many times the size of the group
# after it (call_groups): the next group's read hides this group's transfer when the
# transfer is at least this much faster than reading and verifying (a TPU v5e host:
# about 12 GB/s onto the chip against 7 GB/s read and verified).
GROWTH = 1.5


def call_groups(specs: dict[int, LeafSpec], call_bytes: int | None,
                max_calls: int, growth: float = GROWTH) -> list[list[int]]:
    """The leaves, in order, cut into the load calls of one restore: each group's
    call reads while the group before it moves onto the accelerator (read and
    verified, then sent, 1 GiB took a TPU v5e host about twice its transfer).

    Reading is the slower half, so a restore takes about its whole read plus the
    transfer of its last group, which nothing overlaps: the groups shrink towards
    the end, the last about ``call_bytes``, each earlier one ``growth`` times the
    one after it (so that its transfer still hides behind the next read), the
    first taking the rest. At most ``max_calls`` groups (each call costs Pathways
    a round trip to every worker); None or a state under twice ``call_bytes``:
    one call."""
    leaves = sorted(specs)
    sizes = [math.prod(specs[leaf].shape) * jnp.dtype(specs[leaf].dtype).itemsize
             for leaf in leaves]
    if call_bytes is None or sum(sizes) < 2 * call_bytes or max_calls < 2:
        return [leaves]
    backwards: list[list[int]] = []
    end, target = len(leaves), float(call_bytes)
    while end > 0 and len(backwards) < max_calls - 1:
        start, filled = end, 0
        # Up to its target, and never past ``growth`` times it for the sake of one
        # large leaf (that leaf starts the group before).
        while start > 0 and filled < target and (
                not filled or filled + sizes[start - 1] <= target * growth):
            start -= 1
            filled += sizes[start]
        backwards.append(leaves[start:end])
        end, target = start, target * growth
    if end > 0:
        first = leaves[:end]
        if sum(sizes[:end]) < call_bytes:  # a call too small to be worth its round trip
            backwards[-1] = first + backwards[-1]
        else:
            backwards.append(first)
    return backwards[::-1]


def _spec_json(spec: Any) -> list[Any]:
    return [list(p) if isinstance(p, tuple) else p for p in spec]


@dataclasses.dataclass
class LoadPlan:
    """One restore's request, and what the controller does with the answer."""

    request: dict[str, Any]
    out_specs: list[jax.ShapeDtypeStruct]
    leaves: list[int]  # output k is leaf leaves[k]
    # (leaf, target device id) -> (its region, the parts it is built from: (holder,
    # part's region)), each part read by its holder into that holder's buffer
    split: dict[tuple[int, int], tuple[Index, list[tuple[int, Index]]]]
    offsets: dict[tuple[int, int, Index], int]  # (leaf, holder, part) -> place in buffer
    holder_position: dict[int, int]  # host -> position of its buffer's device
    # (leaf, holder, region) -> output k: a region its holder read whole, as an array
    whole: dict[tuple[int, int, Index], int] = dataclasses.field(default_factory=dict)


def _on_cpu(s: jax.sharding.Sharding, cpu_of: dict[int, jax.Device],
            position: dict[jax.Device, int]) -> tuple[jax.sharding.Sharding, dict[str, Any]]:
    """A target sharding mapped onto the colocated CPU devices, and its layout as a
    worker reads it (positions in the call's device list)."""
    if is_single_device_sharding(s):
        only: Any = next(iter(s.device_set))
        cpu_dev = cpu_of[only.id]
        return single_device_sharding(cpu_dev), {"single": position[cpu_dev]}
    assert isinstance(s, NamedSharding)  # supported() admits these two
    # Mapped through the whole job's list: JAX maps a subset of CPU devices (the
    # emulation's) onto the first ones, which are other hosts'.
    grid = np.array([cpu_of[d.id] for d in s.mesh.devices.flat], dtype=object)
    cpu_mesh = jax.sharding.Mesh(grid.reshape(s.mesh.devices.shape), s.mesh.axis_names)
    return NamedSharding(cpu_mesh, s.spec), {
        "mesh": {"shape": list(cpu_mesh.devices.shape), "axes": list(cpu_mesh.axis_names),
                 "pos": [position[d] for d in cpu_mesh.devices.flat]},
        "spec": _spec_json(s.spec)}


def plan(step: int, tasks: Sequence[ReadTask], specs: dict[int, LeafSpec],
         host_of_device: dict[int, int], cpu_of: dict[int, jax.Device],
         cpu_devices: Sequence[jax.Device], rank_of: dict[jax.Device, int]) -> LoadPlan:
    """The request for ``tasks`` (planned per reading host) onto ``specs``.
    ``cpu_of``: each target device's colocated CPU device; ``cpu_devices``: the
    call's device list (what positions index); ``rank_of``: each CPU device's host."""
    position = {d: k for k, d in enumerate(cpu_devices)}
    # A leaf with a region its reading host does not hold is built from parts on
    # every device (no worker returns an array of it: it would carry placeholders
    # for the regions built here).
    built = {t.leaf for t in tasks
             if any(p.host != host_of_device[t.device_ids[0]] for p in t.pieces)}
    leaves = sorted(leaf for leaf in specs if leaf not in built)
    out_of = {leaf: k for k, leaf in enumerate(leaves)}
    outputs: list[dict[str, Any]] = []
    out_specs: list[jax.ShapeDtypeStruct] = []
    # A state's leaves share a few shardings: each mapped once.
    mapped: dict[jax.sharding.Sharding, tuple[jax.sharding.Sharding, dict[str, Any]]] = {}
    for leaf in leaves:
        spec = specs[leaf]
        if spec.sharding not in mapped:
            mapped[spec.sharding] = _on_cpu(spec.sharding, cpu_of, position)
        cpu_sharding, layout = mapped[spec.sharding]
        outputs.append({"shape": list(spec.shape), "dtype": spec.dtype, **layout})
        out_specs.append(jax.ShapeDtypeStruct(spec.shape, jax.numpy.dtype(spec.dtype),
                                              sharding=cpu_sharding))
    by_host: dict[int, list[dict[str, Any]]] = {}
    split: dict[tuple[int, int], tuple[Index, list[tuple[int, Index]]]] = {}
    foreign: dict[int, dict[tuple[int, Index], ReadTask]] = {}  # holder -> its parts
    whole: dict[tuple[int, int, Index], ReadTask] = {}  # regions read whole by a holder
    for t in tasks:
        reader = host_of_device[t.device_ids[0]]
        if t.leaf not in built:
            plain = ReadTask(t.leaf, t.index, t.dtype, (), t.pieces)
            by_host.setdefault(reader, []).append(
                {"task": task_to_json(plain), "out": out_of[t.leaf],
                 "pos": [position[cpu_of[d]] for d in t.device_ids]})
            continue
        held_by = {p.host for p in t.pieces}
        if len(held_by) == 1:  # one host holds it all: it reads the whole region
            h = held_by.pop()
            parts = [(h, t.index)]
            whole[(t.leaf, h, t.index)] = ReadTask(t.leaf, t.index, t.dtype, (), t.pieces)
        else:  # each holder reads its pieces, placed on the target device
            parts = [(p.host, p.entry.index) for p in t.pieces]
            for p in t.pieces:
                foreign.setdefault(p.host, {})[(t.leaf, p.entry.index)] = ReadTask(
                    t.leaf, p.entry.index, t.dtype, (), (p,))
        for d in t.device_ids:
            split[(t.leaf, d)] = (t.index, parts)
    request: dict[str, Any] = {"step": step, "outputs": outputs,
                               "tasks": {str(h): ts for h, ts in by_host.items()}}
    offsets: dict[tuple[int, int, Index], int] = {}
    holder_position: dict[int, int] = {}
    # One CPU device per worker holds what that worker reads for others.
    first: dict[int, jax.Device] = {}
    for d in cpu_devices:
        first.setdefault(rank_of[d], d)
    whole_out: dict[tuple[int, int, Index], int] = {}
    regions: list[dict[str, Any]] = []
    # One sharding object per holder: the load program's specs pickle each object
    # once, and a replaced host's restore declares hundreds of these outputs.
    on_first = {h: single_device_sharding(d) for h, d in first.items()}
    for (leaf, h, index), task in whole.items():
        shape = tuple(b - a for a, b in index)
        whole_out[(leaf, h, index)] = len(out_specs)
        regions.append({"task": task_to_json(task), "pos": position[first[h]],
                        "host": h, "shape": list(shape), "dtype": specs[leaf].dtype})
        out_specs.append(jax.ShapeDtypeStruct(shape, jax.numpy.dtype(specs[leaf].dtype),
                                              sharding=on_first[h]))
    if regions:
        request["regions"] = regions
    if foreign:
        holders = sorted(first)
        sizes = {}
        entries: dict[str, list[dict[str, Any]]] = {}
        for h in holders:
            pos = 0
            for (leaf, index), part in foreign.get(h, {}).items():
                n = math.prod(b - a for a, b in index) * jax.numpy.dtype(
                    specs[leaf].dtype).itemsize
                offsets[(leaf, h, index)] = pos
                entries.setdefault(str(h), []).append({"task": task_to_json(part),
                                                       "offset": pos})
                pos += -(-n // ALIGN) * ALIGN
            sizes[h] = pos
        cap = max(ALIGN, max(sizes.values()))
        buffer_devices = [first[h] for h in holders]
        holder_position = {h: k for k, h in enumerate(holders)}
        mesh = jax.sharding.Mesh(np.array(buffer_devices, dtype=object), ("hosts",))
        request["foreign"] = {"cap": cap, "pieces": entries,
                              "out": {"mesh": {"shape": [len(buffer_devices)], "axes": ["hosts"],
                                               "pos": [position[d] for d in buffer_devices]},
                                      "spec": ["hosts"]}}
        out_specs.append(jax.ShapeDtypeStruct(
            (cap * len(buffer_devices),), np.dtype(np.uint8),
            sharding=NamedSharding(mesh, jax.sharding.PartitionSpec("hosts"))))
    return LoadPlan(request, out_specs, leaves, split, offsets, holder_position, whole_out)


def request_for(plan_: LoadPlan, host: int) -> dict[str, Any]:
    """What worker ``host`` acts on beyond the outputs' layout (which every worker
    needs: :func:`encode` adds it): the reads of its own host, its tasks, the
    regions it reads whole for others (the rest named by position only) and its
    pieces of regions several hosts hold."""
    request = plan_.request
    part: dict[str, Any] = {"tasks": {str(host): request["tasks"].get(str(host), [])}}
    if "regions" in request:
        part["regions"] = [r if r["host"] == host else
                           {k: v for k, v in r.items() if k != "task"}
                           for r in request["regions"]]
    if "foreign" in request:
        foreign = request["foreign"]
        part["foreign"] = {**foreign,
                           "pieces": {str(host): foreign["pieces"].get(str(host), [])}}
    return part


# A request's bytes per device are padded to a power of two, at least this: the
# load function is specialized per input shape, and one specialization per size
# class (not per byte count) keeps workers from loading it anew for every restore.
MIN_REQUEST_BYTES = 4096


def encode(plan_: LoadPlan, hosts: Sequence[int]) -> tuple[int, dict[int, np.ndarray]]:
    """Each of ``hosts``' part of the plan as :func:`mtc.contract.frame`d JSON, one
    size for all of them (returned first): the step and the outputs' layout, then
    :func:`request_for` the host. The layout, alike for every host and as long as
    the state has leaves, is encoded once and joined with each host's own object."""
    common = _json({"step": plan_.request["step"], "outputs": plan_.request["outputs"]})
    texts = {h: common[:-1] + b"," + _json(request_for(plan_, h))[1:] for h in hosts}
    need = 8 + max((len(t) for t in texts.values()), default=0)
    size = max(MIN_REQUEST_BYTES, 1 << (need - 1).bit_length())
    return size, {h: np.frombuffer(frame(text, size), np.uint8) for h, text in texts.items()}


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=256)
def _extract(dtype: str, shape: tuple[int, ...], static_offset: int | None) -> Any:
    """A compiled cut of a part out of a holder's buffer: the slice, the
    reinterpretation and the reshape fused into one copy on the holder's device.
    The offset is an argument, so that every part of one shape and dtype shares
    one executable (a replaced host's restore cuts hundreds of parts, and each
    compile costs tens of milliseconds); only a buffer past 2 GiB, whose offsets
    an int32 cannot hold, compiles one per offset (``static_offset``)."""
    dt = jax.numpy.dtype(dtype)
    n = math.prod(shape) * dt.itemsize

    def cut(buffer: jax.Array, offset: Any) -> jax.Array:
        raw = (jax.lax.slice(buffer, (static_offset,), (static_offset + n,))
               if static_offset is not None else jax.lax.dynamic_slice(buffer, (offset,), (n,)))
        if dt == np.bool_:
            return (raw != 0).reshape(shape)
        if dt.itemsize == 1:
            return jax.lax.bitcast_convert_type(raw, dt).reshape(shape)
        return jax.lax.bitcast_convert_type(raw.reshape(-1, dt.itemsize), dt).reshape(shape)

    return jax.jit(cut)


def _part_array(buffer: jax.Array, offset: int, leaf_dtype: str, index: Index) -> jax.Array:
    """A part, on its holder's device, out of that holder's buffer (device ops)."""
    shape = tuple(b - a for a, b in index)
    if buffer.size < 1 << 31:
        return _extract(leaf_dtype, shape, None)(buffer, np.int32(offset))
    return _extract(leaf_dtype, shape, offset)(buffer, np.int32(0))


def _assemble(index: Index, parts: list[tuple[int, Index]], leaf: int, spec: LeafSpec,
              device: jax.Device, plan_: LoadPlan, buffers: dict[int, jax.Array]) -> jax.Array:
    """The ``index`` region of a leaf on ``device``, placed from the holders' parts."""
    def part_of(h: int, part: Index) -> jax.Array:
        return _part_array(buffers[h], plan_.offsets[(leaf, h, part)], spec.dtype, part)

    if len(parts) == 1 and parts[0][1] == index:  # one holder read the whole region
        return jax.device_put(part_of(*parts[0]), device)
    shape = tuple(b - a for a, b in index)
    out = jnp.zeros(shape, jax.numpy.dtype(spec.dtype), device=device)
    for h, part in parts:
        lo = [max(a, pa) for (a, _), (pa, _) in zip(index, part, strict=True)]
        hi = [min(b, pb) for (_, b), (_, pb) in zip(index, part, strict=True)]
        if any(h_ <= lo_ for lo_, h_ in zip(lo, hi, strict=True)):
            continue
        piece = part_of(h, part)
        cut = piece[tuple(slice(a - pa, b - pa)
                          for a, b, (pa, _) in zip(lo, hi, part, strict=True))]
        out = jax.lax.dynamic_update_slice(
            out, jax.device_put(cut, device),
            tuple(a - ra for a, (ra, _) in zip(lo, index, strict=True)))
    return out


def finish(plan_: LoadPlan, outputs: Sequence[jax.Array], specs: dict[int, LeafSpec]
           ) -> dict[int, jax.Array]:
    """The workers' arrays onto the target shardings: one ``device_put`` (in place
    where the CPU devices are the targets); the other leaves built device to device
    from the parts their holders read."""
    buffers: dict[int, jax.Array] = {}
    if "foreign" in plan_.request:
        by_device = {s.device: s.data for s in outputs[-1].addressable_shards}
        mesh_devices = list(plan_.out_specs[-1].sharding.mesh.devices.flat)
        for h, k in plan_.holder_position.items():
            buffers[h] = by_device[mesh_devices[k]]
    placed = move(list(outputs[:len(plan_.leaves)]),
                  [specs[leaf].sharding for leaf in plan_.leaves], may_alias=True)
    arrays = dict(zip(plan_.leaves, placed, strict=True))
    # Every region a holder read whole moves onto its target device in one
    # device_put of them all (a replaced host's restore moves hundreds: one call
    # each cost more than their bytes); the others are assembled from their parts.
    built = sorted({leaf for leaf, _ in plan_.split})
    shards: dict[tuple[int, int], jax.Array] = {}
    moves: list[tuple[tuple[int, int], int, jax.Device]] = []
    for leaf in built:
        spec = specs[leaf]
        for d in spec.sharding.addressable_devices:
            index, parts = plan_.split[(leaf, d.id)]
            whole = plan_.whole.get((leaf, parts[0][0], index)) if len(parts) == 1 else None
            if whole is not None and parts[0][1] == index:  # read whole by its holder
                moves.append(((leaf, d.id), whole, d))
            else:
                shards[(leaf, d.id)] = _assemble(index, parts, leaf, spec, d, plan_, buffers)
    if moves:
        moved = move([outputs[k] for _, k, _ in moves], [d for *_, d in moves])
        shards.update((key, a) for (key, _, _), a in zip(moves, moved, strict=True))
    for leaf in built:
        spec = specs[leaf]
        arrays[leaf] = jax.make_array_from_single_device_arrays(
            spec.shape, spec.sharding,
            [shards[(leaf, d.id)] for d in spec.sharding.addressable_devices])
    return arrays
