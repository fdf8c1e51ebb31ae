"""The colocated-Python path, held to what a real Pathways worker allows.

JAX's CPU fallback runs colocated functions in this process and checks nothing,
so these tests call the worker-side object directly, with a job config whose
device map uses ids that do not exist here (as the controller's TPU ids do not
exist on a worker): anything that still looks a shard's host up by device id
fails, instead of passing by accident.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mtc
from mtc.contract import AgentConfig
from mtc.dispatch import ColocatedDispatch
from mtc.errors import HostAgentError
from mtc.save.stage import prepare
from mtc.sidecar.colocated import ColocatedAgent


def _ranks(hosts: list[int]) -> jax.Array:
    devs = jax.devices()
    sharding = NamedSharding(Mesh(np.array(devs), ("hosts",)), PartitionSpec("hosts"))
    return jax.make_array_from_single_device_arrays(
        (len(devs),), sharding,
        [jax.device_put(np.array([h], np.int32), d) for d, h in zip(devs, hosts, strict=True)])


def test_worker_routes_shards_by_its_rank_array_not_controller_ids(ramdisk: Path,
                                                                    mesh: Mesh) -> None:
    config = AgentConfig(local_dir=str(ramdisk),
                         host_of_device={5000 + i: i // 2 for i in range(8)},  # controller ids
                         slice_of_host={0: 0, 1: 0, 2: 1, 3: 1}, subdirs=True,
                         max_staged_bytes=None, writer_threads=1)
    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8),
                       NamedSharding(mesh, PartitionSpec("replica", "model")))
    header, arrays = prepare(3, {"x": x, "n": np.arange(3)}, skip_if_busy=False)
    raw = np.frombuffer(header.to_bytes(), dtype=np.uint8)
    ranks = _ranks([i // 2 for i in range(8)])
    agent = ColocatedAgent(config.to_json())
    ok = agent.stage(jax.device_put(raw, jax.devices()[0]), ranks, list(arrays))
    agent.wait(ranks)
    agent.agent.close()
    # One answer per worker, on that worker's device.
    assert [int(np.asarray(s.data)[0]) for s in ok.addressable_shards] == [1] * 8
    assert {s.device for s in ok.addressable_shards} == set(jax.devices())
    for h in range(4):
        assert (ramdisk / f"host-{h}" / "3" / "manifest.json").is_file()
    opts = mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local")
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        back = mgr.restore(3, target={"x": x, "n": None})
    np.testing.assert_array_equal(np.asarray(back["x"]), np.asarray(x))
    np.testing.assert_array_equal(back["n"], np.arange(3))


def _config(local_dir: Path) -> AgentConfig:
    return AgentConfig(local_dir=str(local_dir), host_of_device={i: i // 2 for i in range(8)},
                       slice_of_host={0: 0, 1: 0, 2: 1, 3: 1}, subdirs=True,
                       max_staged_bytes=None, writer_threads=1)


def test_workers_that_disagree_fail_the_call(ramdisk: Path) -> None:
    disp = ColocatedDispatch(_config(ramdisk), jax.devices())
    with pytest.raises(HostAgentError, match="stage"):
        disp.answers.unanimous(_ranks([1, 1, 1, 0, 1, 1, 1, 1]), "stage")
    assert disp.answers.unanimous(_ranks([1] * 8), "stage") is True


def test_a_failing_worker_comes_back_as_its_typed_error(ramdisk: Path, mesh: Mesh) -> None:
    """A worker's exception would reach a real controller as an untyped runtime
    error: it answers FAILED, and the typed error (step, host, file) is fetched."""
    (ramdisk / "host-1").write_text("a file where host 1's RAM disk should be")
    disp = ColocatedDispatch(_config(ramdisk), jax.devices())
    x = jax.device_put(np.zeros((8, 8), np.float32),
                       NamedSharding(mesh, PartitionSpec("replica", "model")))
    header, arrays = prepare(4, {"x": x}, skip_if_busy=False)
    try:
        with pytest.raises(mtc.StorageError) as e:
            disp.stage(header, list(arrays))
            disp.wait()
    finally:
        disp.close()  # the hosts' writers, joined
    assert e.value.path is not None and e.value.path.endswith("host-1")


def test_typed_errors_keep_step_host_and_file_across_the_colocated_call(
        ramdisk: Path, mesh: Mesh) -> None:
    opts = mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="colocated")
    x = jax.device_put(np.zeros((8, 8), np.float32),
                       NamedSharding(mesh, PartitionSpec("replica", "model")))
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        mgr.save(6, {"x": x})
        mgr.wait_until_finished()
        bad = ramdisk / "host-3" / "6" / "manifest.json"
        bad.write_bytes(bad.read_bytes()[:-7])
        with pytest.raises(mtc.ManifestError) as e:
            mgr.restore(6, target={"x": x})
    assert (e.value.step, e.value.host, e.value.path) == (6, 3, str(bad))


def test_seam_audit_catches_controller_code_touching_a_ramdisk(tmp_path: Path) -> None:
    """The guard behind every ``ramdisk`` fixture fails when it should."""
    import seam_audit

    from mtc import layout

    root = tmp_path / "host-0"
    root.mkdir()
    seam_audit.watch(tmp_path)
    try:
        layout.committed_steps(root)  # controller-package code, no host-side frame
    finally:
        leaks = seam_audit.unwatch(tmp_path)
    assert leaks and "os.listdir" in leaks[0] and "mtc/layout.py" in leaks[0]
    seam_audit.watch(tmp_path)
    try:
        (root / "note").write_text("a test writing on purpose is no leak")
    finally:
        assert seam_audit.unwatch(tmp_path) == []
