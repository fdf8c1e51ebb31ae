"""The optional per-step in-memory snapshot: at most one step replayed after a failure.

Every step emits a copy of its new state (:meth:`Trainer.step_with_snapshot`),
in host memory where the platform has it. The copy is part of the compiled step,
so taking it costs the loop nothing; the next step donates the state, never the
snapshot. After a failure the snapshot is read back from the devices that
survived: with data parallelism across slices every shard has a replica on each
slice, so one whole slice (or one host of each shard) is enough.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Set
from typing import Any

import jax
import numpy as np

from mtc.trainer.model import State, Trainer


class SnapshotLostError(RuntimeError):
    """No surviving device holds some shard of the snapshot."""


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The state after ``step``: its arrays as the step emitted them, and its plain values."""

    step: int
    data: dict[str, Any]
    arrays: dict[str, Any]  # params, opt_state, rng (as key data)

    def complete_on(self, healthy: Set[int]) -> bool:
        """Whether the devices with these ids hold every shard of every array."""
        leaves = jax.tree_util.tree_leaves(self.arrays)
        if all({d.id for d in a.sharding.device_set} <= healthy for a in leaves):
            return True  # nothing it was on is lost (a scale-up): no shard to count
        return all(_covered(a, healthy) for a in leaves)

    def restore(self, trainer: Trainer, healthy: Set[int]) -> State:
        """The state on ``trainer``'s mesh, read only from the devices in ``healthy``.

        Each target device gets its shard straight from a surviving replica of
        that same shard (one device-to-device copy, preferring the replica on the
        target device itself); only a target shard that no saved shard equals
        (a mesh that splits the arrays differently) is assembled on the host from
        the parts that overlap it. Nothing else goes through host memory.
        """
        sh = trainer.shardings
        placed = place(self.arrays, {"params": sh["params"], "opt_state": sh["opt_state"],
                                     "rng": trainer.replicated}, healthy)
        rng = trainer.wrap_rng(placed["rng"])
        return {"params": placed["params"], "opt_state": placed["opt_state"], "rng": rng,
                "step": self.step, "data": dict(self.data)}


def place(arrays: Any, shardings: Any, healthy: Set[int]) -> Any:
    """The pytree ``arrays`` laid out per the matching pytree ``shardings``, read
    only from shards on the devices in ``healthy`` (see :meth:`Snapshot.restore`)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    targets = jax.tree_util.tree_structure(arrays).flatten_up_to(shardings)  # type: ignore[attr-defined]
    items = [(a, s, jax.tree_util.keystr(path))
             for (path, a), s in zip(leaves, targets, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, _place_all(items, healthy))


class Retirer:
    """Drops replaced snapshots on a background thread.

    Freeing a snapshot's hundreds of buffers takes milliseconds (2 ms for the
    3.2M-parameter model here, about 1% of its step); the loop need not wait."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Snapshot | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="snapshot-retire", daemon=True).start()

    def retire(self, snap: Snapshot | None) -> None:
        if snap is not None:
            self._queue.put(snap)

    def _run(self) -> None:
        while True:
            snap = self._queue.get()
            del snap  # the last reference: its buffers are freed here


def take(state: State, arrays: dict[str, Any]) -> Snapshot:
    """The snapshot of ``state``, whose arrays ``step_with_snapshot`` returned as ``arrays``."""
    return Snapshot(int(state["step"]), dict(state["data"]), arrays)


def _index(s: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(sl.indices(n)[:2] for sl, n in zip(s.index, shape, strict=True))


def _covered(a: jax.Array, healthy: Set[int]) -> bool:
    seen = {_index(s, a.shape) for s in a.addressable_shards if s.device.id in healthy}
    return sum(int(np.prod([b - e for e, b in idx])) for idx in seen) == a.size


def _place_all(items: list[tuple[jax.Array, jax.sharding.Sharding, str]],
               healthy: Set[int]) -> list[jax.Array]:
    """Each ``(array, sharding, name)``'s array laid out per its sharding, read
    only from shards on ``healthy`` devices. Every piece of every array moves in
    one ``device_put`` (one dispatch for the hundreds of shards of a model's
    state, not one each)."""
    sources: list[Any] = []
    dests: list[jax.sharding.Sharding] = []
    counts = []
    for a, sharding, name in items:
        pieces = _pieces(a, sharding, healthy, name)
        sources.extend(src for src, _ in pieces)
        dests.extend(dst for _, dst in pieces)
        counts.append(len(pieces))
    # Copies, even onto the device a shard is on: the step after a restore
    # donates its input, and an alias would take the snapshot with it (a second
    # failure during that step would find no snapshot to restore).
    moved = jax.device_put(sources, dests, may_alias=False)
    out: list[jax.Array] = []
    start = 0
    for (a, sharding, _), n in zip(items, counts, strict=True):
        out.append(jax.make_array_from_single_device_arrays(
            a.shape, sharding, moved[start:start + n]))
        start += n
    return out


def _pieces(a: jax.Array, sharding: jax.sharding.Sharding, healthy: Set[int],
            name: str) -> list[tuple[Any, jax.sharding.Sharding]]:
    """Per device of ``sharding`` (in its order): where that device's shard of
    ``a`` comes from (a surviving replica of the same shard, preferring one on
    the device itself, else the region assembled on the host) and where it goes."""
    by_index: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for s in a.addressable_shards:
        if s.device.id in healthy:
            by_index.setdefault(_index(s, a.shape), []).append(s)
    pieces: list[tuple[Any, jax.sharding.Sharding]] = []
    for device, idx in sharding.addressable_devices_indices_map(a.shape).items():
        want = tuple(sl.indices(n)[:2] for sl, n in zip(idx or (), a.shape, strict=True))
        # The target's memory (the snapshot sits in host memory where there is one).
        dst = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
        same = by_index.get(want)
        if same:
            src = next((s for s in same if s.device == device), same[0])
            pieces.append((src.data, dst))
        else:
            pieces.append((_region(a, by_index, want, healthy, name), dst))
    return pieces


def _region(a: jax.Array, by_index: dict[tuple[tuple[int, int], ...], list[Any]],
            want: tuple[tuple[int, int], ...], healthy: Set[int], name: str) -> np.ndarray:
    """The region ``want`` of ``a`` assembled on the host from the healthy shards
    that overlap it (one replica of each)."""
    shape = tuple(b - e for e, b in want)
    out = np.empty(shape, a.dtype)
    filled = 0
    for idx, shards in by_index.items():
        lo = [max(e, c) for (e, _), (c, _) in zip(want, idx, strict=True)]
        hi = [min(b, d) for (_, b), (_, d) in zip(want, idx, strict=True)]
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            continue
        part = np.asarray(shards[0].data)
        out[tuple(slice(low - w, h - w) for low, h, (w, _) in zip(lo, hi, want, strict=True))] = \
            part[tuple(slice(low - c, h - c) for low, h, (c, _) in zip(lo, hi, idx, strict=True))]
        filled += int(np.prod([h - low for low, h in zip(lo, hi, strict=True)]))
    if filled != int(np.prod(shape)):  # shards of one replica are disjoint: a gap is lost
        raise SnapshotLostError(f"snapshot leaf {name}: no surviving device holds some of its "
                                f"shards (devices {sorted(healthy)} hold {filled} of "
                                f"{int(np.prod(shape))} elements of region {list(want)})")
    return out
