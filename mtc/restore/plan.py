"""Restore planning: which saved files cover what each target device needs.

The planner reads every host's manifest of the step, checks the target against
the saved tree (structure, shapes, dtypes), and turns each target sharding into
:class:`~mtc.sidecar.restore.load.ReadTask` s: one per distinct region per host, so a
replicated leaf is read once per host. Among the hosts holding a saved shard it
prefers the reading host, then a host of the same slice, then spreads reads
over the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from mtc import runs
from mtc.contract import Piece, ReadTask, shard_index
from mtc.errors import ManifestError, MixedRunError, ShardUnavailableError, TargetMismatchError
from mtc.manifest import Index, LeafEntry, Manifest, ShardEntry
from mtc.topology import Topology


@dataclasses.dataclass
class SavedStep:
    """Every host's manifest of one step, and who holds each saved region."""

    step: int
    manifests: dict[int, Manifest]
    holders: list[dict[Index, list[tuple[int, ShardEntry]]]]
    # The hosts' committed steps as the plan found them (one controller's survey;
    # None where it asked otherwise): what fencing after a restore of the newest
    # step deletes, without asking the hosts again.
    listed: dict[int, list[int]] | None = None

    @property
    def leaves(self) -> tuple[LeafEntry, ...]:
        return next(iter(self.manifests.values())).leaves


def load_step(step: int, hosts: Sequence[int], manifest_of: Callable[[int, int], Manifest],
              *, run: str = "") -> SavedStep:
    """Every host's manifest of ``step`` (``manifest_of(step, host)``, through the
    seam), all written by one run (``run`` when it is given: the one agreed on).
    A step whose hosts' copies two runs wrote is refused: :class:`MixedRunError`."""
    manifests = {h: manifest_of(step, h) for h in hosts}
    written_by = {h: m.run for h, m in manifests.items()}
    one = runs.one_run(written_by)
    if one is None:
        raise MixedRunError(f"the hosts' copies of this step were written by different runs "
                            f"({runs.describe_mix(written_by)}): it is never restored",
                            step=step)
    if run and one != run:
        raise MixedRunError(f"the hosts' copies were written by run {one or '(none)'}, the "
                            f"restore agreed on run {run}", step=step)
    first = next(iter(manifests.values()))
    holders: list[dict[Index, list[tuple[int, ShardEntry]]]] = [
        defaultdict(list) for _ in first.leaves]
    for h, m in manifests.items():
        if [x.path for x in m.leaves] != [x.path for x in first.leaves]:
            raise ManifestError("hosts disagree on the saved tree", step=step, host=h)
        for i, leaf in enumerate(m.leaves):
            for s in leaf.shards:
                holders[i][s.index].append((h, s))
    return SavedStep(step, manifests, holders)


def _overlap(a: Index, b: Index) -> bool:
    return all(max(x0, y0) < min(x1, y1) or (x0 == x1 == y0 == y1)
               for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _volume(index: Index) -> int:
    v = 1
    for a, b in index:
        v *= b - a
    return v


def _intersection(a: Index, b: Index) -> int:
    v = 1
    for (x0, x1), (y0, y1) in zip(a, b, strict=True):
        v *= max(0, min(x1, y1) - max(x0, y0))
    return v


@dataclasses.dataclass
class Planner:
    saved: SavedStep
    topology: Topology
    _turn: Any = dataclasses.field(default_factory=lambda: itertools.count())

    def _choose(self, reader: int, candidates: list[tuple[int, ShardEntry]]
                ) -> tuple[int, ShardEntry]:
        for h, e in candidates:
            if h == reader:
                return h, e
        same = [c for c in candidates
                if self.topology.slice_of_host.get(c[0]) == self.topology.slice_of_host.get(reader)]
        pool = same or candidates
        return pool[next(self._turn) % len(pool)]

    def tasks_for(self, leaf_no: int, leaf: LeafEntry, sharding: jax.sharding.Sharding,
                  shape: tuple[int, ...]) -> dict[int, list[ReadTask]]:
        """Read tasks per host for one array leaf onto ``sharding``."""
        by_host: dict[int, dict[Index, list[int]]] = defaultdict(dict)
        indices: Mapping[Any, Any] = sharding.addressable_devices_indices_map(shape)
        for dev, idx in indices.items():
            host = self.topology.host_of_device.get(dev.id, dev.process_index)
            index = shard_index(idx if idx is not None else (), shape) if shape else ()
            by_host[host].setdefault(index, []).append(dev.id)
        out: dict[int, list[ReadTask]] = defaultdict(list)
        for host, regions in by_host.items():
            for index, devs in regions.items():
                pieces = self.tasks_for_region(leaf_no, leaf, index, host)
                out[host].append(ReadTask(leaf_no, index, leaf.dtype, tuple(devs), pieces))
        return out

    def tasks_for_region(self, leaf_no: int, leaf: LeafEntry, index: Index,
                         host: int) -> tuple[Piece, ...]:
        """The saved pieces ``host`` reads to cover ``index`` of one leaf."""
        holders = self.saved.holders[leaf_no]
        if index in holders:  # a saved region itself (a restore onto the saved sharding)
            return (Piece(*self._choose(host, holders[index])),)
        covering = sorted(i for i in holders if _overlap(i, index))
        covered = sum(_intersection(i, index) for i in covering)
        if covered != _volume(index):
            raise ShardUnavailableError(
                f"no saved copy covers part of {leaf.path} region {list(index)}",
                step=self.saved.step, host=host)
        return tuple(Piece(*self._choose(host, holders[i])) for i in covering)


def check_leaf(step: int, leaf: LeafEntry, target: Any) -> tuple[tuple[int, ...], str]:
    """Validate a target leaf against a saved array leaf; returns (shape, dtype)."""
    shape = tuple(getattr(target, "shape", ()))
    saved_shape = leaf.shape
    if leaf.kind == "prng_key":
        dtype = target.dtype
        if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TargetMismatchError(f"{leaf.path} was saved as a PRNG key; target has {dtype}",
                                      step=step)
        saved_shape = leaf.shape[:len(leaf.shape) - len(jax.random.key_data(
            jax.random.key(0, impl=leaf.key_impl)).shape)]
        if shape != saved_shape:
            raise TargetMismatchError(
                f"{leaf.path}: target shape {shape}, saved {saved_shape}", step=step)
        return leaf.shape, leaf.dtype
    if shape != saved_shape:
        raise TargetMismatchError(f"{leaf.path}: target shape {shape}, saved {saved_shape}",
                                  step=step)
    want = jax.numpy.dtype(target.dtype)
    if str(want) != leaf.dtype and _kind(want) != _kind(jax.numpy.dtype(leaf.dtype)):
        # Within a kind the loaded array is cast to the target's dtype, as Orbax
        # does (f32 saved, bf16 wanted); across kinds it would change values.
        raise TargetMismatchError(
            f"{leaf.path}: target dtype {want}, saved {leaf.dtype} (mtc casts a float to "
            f"another float, an integer to another integer)", step=step)
    return shape, leaf.dtype


def _kind(dtype: Any) -> str:
    """A dtype's family for casts on restore: 'f' (bfloat16 too), 'i' (signed and
    unsigned), 'c', or the dtype itself (bool, anything else: never cast)."""
    if jax.numpy.issubdtype(dtype, jax.numpy.floating):
        return "f"
    if jax.numpy.issubdtype(dtype, jax.numpy.integer):
        return "i"
    if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating):
        return "c"
    return str(dtype)

