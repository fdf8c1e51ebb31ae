"""What a snapshot holds and where it lives: :class:`Taken` (one snapshot),
:class:`Latest` and :class:`Age` (what :class:`mtc.elastic.Snapshotter` reports,
the age also as Prometheus gauges), and the memory kinds a snapshot's copies go
to (``pinned_host`` where the devices have it; a compiled step's copy stays in
device memory)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Latest:
    """What ``Snapshotter.latest`` returns (Orbax: ``CheckpointMetadata``): the step."""

    step: int


@dataclasses.dataclass(frozen=True)
class Age:
    """How old the newest complete snapshot is: in steps (the newest step asked for,
    less the snapshot's) and in seconds (since it was asked for). A slice lost now
    costs the loop about ``steps`` steps of recomputation."""

    steps: int
    seconds: float


_GAUGES: Any = None


def age_gauges() -> Any:
    """The process's Prometheus gauges of the newest snapshot's age (made once, in
    prometheus_client's default registry, which the application exports)."""
    global _GAUGES
    if _GAUGES is None:
        from prometheus_client import Gauge
        _GAUGES = (Gauge("mtc_snapshot_age_seconds",
                         "Seconds since the newest complete in-memory snapshot was asked for"),
                   Gauge("mtc_snapshot_age_steps",
                         "Steps between the newest step asked for and the newest complete "
                         "in-memory snapshot"))
    return _GAUGES


@dataclasses.dataclass(frozen=True)
class Taken:
    """One snapshot: the state's tree, its leaves (a :class:`Shards` per array,
    PRNG keys as their key data; other leaves as values), each key's impl."""

    step: int
    treedef: Any
    leaves: tuple[Any, ...]
    key_impls: tuple[Any, ...]  # None for a leaf that is not a PRNG key
    moved: bool = False  # its copies came from an accelerator's memory
    at: float = 0.0  # time.monotonic() when it was asked for


def host_memory_kind(devices: Any) -> str | None:
    """``pinned_host`` where every device has it, else None (the device's own)."""
    kinds = [{m.kind for m in d.addressable_memories()} for d in devices]
    return "pinned_host" if kinds and all("pinned_host" in k for k in kinds) else None


def step_copy_memory_kind(devices: Any) -> str | None:
    """The memory a compiled step's snapshot copy goes out into: the devices' own
    (None), on every platform. A copy within device memory runs at the device's
    memory bandwidth, a small part of a step; a step whose copy went out into
    ``pinned_host`` itself waited for the device-to-host transfer into fresh host
    pages, orders of magnitude slower (measured on a TPU host when this was chosen).
    :meth:`Snapshotter.adopt` moves the copy to
    host memory after the step, while the next steps run. (On CPU, host memory
    kinds were never used: jax 0.12.1's CPU client cannot copy a compiled
    program's output in one, "Unsupported layout used for PjRt CPU buffers".)"""
    del devices
    return None


def step_copy_sharding(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """``s`` in the memory of a compiled step's snapshot copy (:func:`step_copy_memory_kind`)."""
    kind = step_copy_memory_kind(s.device_set)
    return s.with_memory_kind(kind) if kind is not None else s


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host_sharding(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
    kind = host_memory_kind(s.device_set)
    return s.with_memory_kind(kind) if kind is not None else s
