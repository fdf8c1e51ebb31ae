"""mtc.dispatch.remote_colocated's host views of a call's inputs, in this process."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pathwaysutils.test.mock_fault_injection import DeviceLossSimulator

import mtc
from mtc.dispatch.protocol import WorkerLostError
from mtc.dispatch.remote_colocated import host_views


def test_host_views_are_every_shards_bytes_without_a_copy() -> None:
    devices = jax.devices()[:4]
    x = jax.device_put(np.arange(16, dtype=np.int32),
                       NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d")))
    views = host_views("stage", [x], {d.id: i // 2 for i, d in enumerate(devices)})
    assert [i for i, _ in views[id(x)]] == [d.id for d in devices]
    for k, (_, v) in enumerate(views[id(x)]):
        np.testing.assert_array_equal(v, np.arange(4 * k, 4 * k + 4))
    assert all(v.base is not None for _, v in views[id(x)])  # views of JAX's buffers


def test_a_shard_lost_with_its_host_is_a_worker_lost_error_naming_the_host() -> None:
    # No device can fail on this machine: pathwaysutils' DeviceLossSimulator makes
    # reading an array on a "lost" device raise DATA_LOSS, as Pathways does for a
    # worker that died. A save taking its inputs' views then says which host is
    # gone, as every other colocated call does, and is still the runtime's
    # slice-down error.
    devices = jax.devices()[:4]
    x = jax.device_put(np.arange(16, dtype=np.float32),
                       NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d")))
    sim = DeviceLossSimulator()
    sim.start()
    try:
        sim.mark_device_lost(devices[3])
        with pytest.raises(WorkerLostError) as e:
            host_views("stage", [x], {d.id: i // 2 for i, d in enumerate(devices)})
    finally:
        sim.stop()
    assert isinstance(e.value, mtc.MtcError) and e.value.host == 1
    assert f"device {devices[3].id}" in str(e.value) and "stage" in str(e.value)
    assert isinstance(e.value, jax.errors.JaxRuntimeError)
