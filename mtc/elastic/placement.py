"""Placing a snapshot's shards onto a mesh, reading only shards that survived.

A snapshot keeps each array whole (:class:`Shards`); a load takes it apart into
each device's shard as its own single-device array and asks each of them
whether it can still be read (a shard on a lost device raises, as any array on
it does), then gives every
target device its shard straight from a surviving replica of that same shard
(one device-to-device copy, preferring the replica on the target device). Only a
target shard that no saved shard equals (a mesh that splits the array
differently) is assembled on the host from the surviving pieces that overlap it.
Every piece of every array moves in one ``device_put``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from typing import Any

import jax
import numpy as np

from mtc.errors import SnapshotUnavailableError as SnapshotUnavailableError
from mtc.shards import single_device_sharding

Index = tuple[tuple[int, int], ...]  # per dimension, [start, stop)


@dataclasses.dataclass(frozen=True)
class Shards:
    """One array of a snapshot: its shape and dtype, and the array (``whole``).
    Each device's shard, as a single-device array of its own, is taken from it
    only when a load asks which shards survive (:attr:`pieces`), never when the
    snapshot is taken: that split costs a Python object per device and leaf,
    and a snapshot is taken every step, in the loop's stall (leaves x devices
    objects: on a real mesh, many)."""

    shape: tuple[int, ...]
    dtype: Any
    whole: jax.Array | None
    # Kept in this process's host memory instead (mtc.elastic.host_copy): one numpy
    # copy of each distinct shard, by index; ``whole`` is then None.
    host: tuple[tuple[Index, np.ndarray], ...] | None = None

    @classmethod
    def of(cls, a: jax.Array) -> Shards:
        return cls(tuple(a.shape), a.dtype, a)

    @functools.cached_property
    def pieces(self) -> tuple[tuple[Index, Any], ...]:
        """(index, single-device array) of every addressable shard, in the array's
        device order (numpy copies, for a snapshot in host memory). A shard on a
        device lost since raises when read, as the whole array does; the others
        read as before the loss."""
        if self.host is not None:
            return self.host
        assert self.whole is not None
        where = shard_indices(self.whole.sharding, self.shape)
        return tuple((where[s.device], s.data) for s in self.whole.addressable_shards)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))


def index_of(idx: Any, shape: Sequence[int]) -> Index:
    return tuple(sl.indices(n)[:2] for sl, n in zip(idx or (), shape, strict=True))


@functools.lru_cache(maxsize=1024)
def shard_indices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[Any, Index]:
    """Each addressable device's index of an array of ``shape`` laid out per
    ``sharding``: the same for every step's snapshot, so worked out once (a
    snapshot is taken every step, of every leaf)."""
    return {d: index_of(idx, shape)
            for d, idx in sharding.addressable_devices_indices_map(shape).items()}


def readable(piece: jax.Array) -> bool:
    """Whether this shard can still be read (its device is alive, its copy done)."""
    try:
        jax.block_until_ready(piece)
        return True
    except (jax.errors.JaxRuntimeError, RuntimeError):
        return False


def surviving(arrays: Sequence[Shards], devices: Collection[int] | None = None
              ) -> list[dict[Index, list[Any]]]:
    """Per array, the readable shards by index (one list per distinct index); only
    shards on ``devices`` (ids) when given."""
    dead: set[int] = set()  # devices found lost: their other shards are not asked
    out = []
    for a in arrays:
        by_index: dict[Index, list[Any]] = {}
        out.append(by_index)
        if a.host is not None:  # this process's own memory: readable while it runs
            for idx, piece in a.host:
                by_index.setdefault(idx, []).append(piece)
            continue
        assert a.whole is not None
        try:
            pieces = a.pieces
        except (jax.errors.JaxRuntimeError, RuntimeError):
            # A runtime that will not take apart an array some of whose devices
            # failed: none of it counts as surviving (a load then falls back to
            # mtc's tiers, never reads a guess).
            continue
        # Every device of the array alive: no shard needs asking on its own.
        whole_alive = (devices is None or {d.id for d in a.whole.devices()} <= set(devices)
                       ) and readable(a.whole)
        for idx, piece in pieces:
            if not whole_alive:
                dev = next(iter(piece.devices()))
                if dev.id in dead or (devices is not None and dev.id not in devices):
                    continue
                if not readable(piece):
                    dead.add(dev.id)
                    continue
            by_index.setdefault(idx, []).append(piece)
    return out


def covered(a: Shards, by_index: dict[Index, list[jax.Array]]) -> bool:
    """Whether the surviving shards hold every element (shards of one index are
    replicas; distinct indices of one array are disjoint)."""
    return sum(int(np.prod([b - e for e, b in idx])) for idx in by_index) == a.size


def place(arrays: Sequence[Shards], shardings: Sequence[jax.sharding.Sharding],
          names: Sequence[str], devices: Collection[int] | None = None, *,
          may_alias: bool = False) -> list[jax.Array]:
    """Each array laid out per its sharding from its surviving shards (on
    ``devices`` only, when given); raises :class:`SnapshotUnavailableError`
    (naming the leaf) when some part of an array survives nowhere. ``may_alias``:
    a shard already where its target is (device and memory) is used as it is,
    not copied (only for targets no step donates)."""
    alive = surviving(arrays, devices)
    for a, by_index, name in zip(arrays, alive, names, strict=True):
        if not covered(a, by_index):
            held = (len(a.host or ()) if a.whole is None
                    else len(a.whole.sharding.addressable_devices))
            raise SnapshotUnavailableError(
                f"snapshot leaf {name}: no surviving device holds some of its shards "
                f"({sum(len(v) for v in by_index.values())} of {held} shards readable)")
    sources: list[Any] = []
    dests: list[jax.sharding.Sharding] = []
    counts = []
    for a, by_index, sharding, name in zip(arrays, alive, shardings, names, strict=True):
        pieces = _pieces(a, by_index, sharding, name)
        sources.extend(src for src, _ in pieces)
        dests.extend(dst for _, dst in pieces)
        counts.append(len(pieces))
    # Unless asked, copies even onto the device a shard is on: the step after a
    # load donates its input, and an alias would take the snapshot with it.
    moved = jax.device_put(sources, dests, may_alias=may_alias)
    out: list[jax.Array] = []
    start = 0
    for a, sharding, n in zip(arrays, shardings, counts, strict=True):
        out.append(jax.make_array_from_single_device_arrays(
            a.shape, sharding, moved[start:start + n]))
        start += n
    return out


def _pieces(a: Shards, by_index: dict[Index, list[jax.Array]],
            sharding: jax.sharding.Sharding, name: str
            ) -> list[tuple[Any, jax.sharding.Sharding]]:
    pieces: list[tuple[Any, jax.sharding.Sharding]] = []
    for device, idx in sharding.addressable_devices_indices_map(a.shape).items():
        want = index_of(idx, a.shape)
        dst = single_device_sharding(device, sharding.memory_kind)
        same = by_index.get(want)
        if same:
            src = next((s for s in same if isinstance(s, jax.Array)
                        and next(iter(s.devices())) == device), same[0])
            pieces.append((src, dst))
        else:
            pieces.append((_region(a, by_index, want, name), dst))
    return pieces


def _region(a: Shards, by_index: dict[Index, list[jax.Array]], want: Index,
            name: str) -> np.ndarray:
    """The region ``want`` assembled on the host from one replica of each
    surviving shard that overlaps it."""
    shape = tuple(b - e for e, b in want)
    out = np.empty(shape, a.dtype)
    filled = 0
    for idx, shards in by_index.items():
        lo = [max(e, c) for (e, _), (c, _) in zip(want, idx, strict=True)]
        hi = [min(b, d) for (_, b), (_, d) in zip(want, idx, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        part = np.asarray(shards[0])
        out[tuple(slice(low - w, h - w) for low, h, (w, _) in zip(lo, hi, want, strict=True))] = \
            part[tuple(slice(low - c, h - c) for low, h, (c, _) in zip(lo, hi, idx, strict=True))]
        filled += int(np.prod([h - low for low, h in zip(lo, hi, strict=True)]))
    if filled != int(np.prod(shape)):
        raise SnapshotUnavailableError(f"snapshot leaf {name}: region {list(want)} is "
                                       f"{filled} of {int(np.prod(shape))} elements")
    return out
