"""How a local-cluster sidecar makes a colocated call's inputs from the shards it
was sent (mtc.sidecar.host.colocated._input), in this process's CPU devices: each
shard on its own device whatever the sharding's device order, the memory kind
kept, and a shard that is missing or of the wrong size refused."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtc import shards
from mtc.errors import ProtocolError
from mtc.shards import ShardLayout, single_device_sharding
from mtc.sidecar.host import colocated


def _shardings() -> list[Any]:
    devs = jax.devices()
    # The mesh's device order is not the devices' id order: a shard placed by
    # position in any other order than the sharding's lands on another device.
    mesh = Mesh(np.array(devs[::-1]).reshape(2, 4), ("a", "b"))
    return [NamedSharding(mesh, PartitionSpec("a", "b")),
            NamedSharding(mesh, PartitionSpec("b")),  # replicated over "a"
            NamedSharding(mesh, PartitionSpec()),
            NamedSharding(mesh, PartitionSpec("a", "b")).with_memory_kind("pinned_host"),
            single_device_sharding(devs[3])]


def _raw(value: np.ndarray, sharding: Any) -> dict[Any, np.ndarray]:
    """Each device's shard as the bytes a call brings it (uint8, flat)."""
    return {d: np.ascontiguousarray(value[i]).reshape(-1).view(np.uint8)
            for d, i in sharding.addressable_devices_indices_map(value.shape).items()}


@pytest.mark.parametrize("public", [False, True], ids=["jax-batched", "public-calls"])
@pytest.mark.parametrize("k", range(5))
def test_each_shard_lands_on_its_own_device(k: int, public: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    sharding = _shardings()[k]
    # A JAX without the batched placement: the public calls instead.
    monkeypatch.setattr(shards, "JAX_BATCHED", not public)
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    spec = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    got = colocated._input("f", 0, ShardLayout(spec), _raw(value, sharding))
    np.testing.assert_array_equal(np.asarray(got), value)
    assert got.sharding == sharding
    assert got.sharding.memory_kind == sharding.memory_kind
    for s in got.addressable_shards:  # each device holds its own index's values
        np.testing.assert_array_equal(np.asarray(s.data), value[s.index])


def test_a_missing_or_wrong_sized_shard_is_refused() -> None:
    sharding = _shardings()[0]
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    spec = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
    raw = _raw(value, sharding)
    first = next(iter(raw))
    with pytest.raises(ProtocolError, match="without this host's shards"):
        colocated._input("f", 2, ShardLayout(spec),
                         {d: b for d, b in raw.items() if d != first})
    with pytest.raises(ProtocolError, match="input 2's shard is 8 bytes"):
        colocated._input("f", 2, ShardLayout(spec), {**raw, first: raw[first][:8]})
