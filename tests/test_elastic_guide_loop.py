"""The README's elastic loop (the Pathways guide's, with mtc.elastic.Snapshotter and an
mtc.CheckpointManager), run as written on CPU slices of the local cluster.

It loses a slice and goes on with the other (the snapshot, from memory), scales
back up (memory), then loses a host of slice 0 while slice 1's devices fail too:
no surviving device holds that host's shards of the snapshot, so the loop
resumes through mtc from the host's peer copy (``peer``). Every step's loss and
the final state equal an uninterrupted run's.

Real parts: the cluster's sidecars and replicators are processes (the lost host's
are SIGKILLed, its RAM disk gone; it comes back empty); pathwaysutils' real
``Manager``, ``elastic_retry`` and monitor thread. Devices fail through
pathwaysutils' ``DeviceLossSimulator`` (the demo's subclass), as no device can
fail on this machine; here it also holds, as real hardware does, that every
array on a device is gone once the device is, even after it comes back.
"""

from __future__ import annotations

import gc
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from doc_blocks import python_block
from jax.sharding import Mesh
from pathwaysutils.elastic import elastic as pw_elastic

from mtc.testing.local_cluster import LocalCluster
from mtc.testing.waits import wait_until
from mtc.trainer.faults import SliceLossSimulator

pytestmark = pytest.mark.process  # the cluster's hosts are processes

README = Path(__file__).resolve().parent.parent / "README.md"
STEPS = 36


def readme_loop() -> str:
    return python_block("README.md", "## Elastic training: the Pathways guide's loop")


class MemoryLoss(SliceLossSimulator):
    """A lost device loses every array on it, also those no one has read yet
    (the simulator otherwise learns of an array at its first use)."""

    def lose(self, devices: Sequence[jax.Device]) -> None:
        for o in gc.get_objects():
            if isinstance(o, jax.Array) and not isinstance(o, jax.core.Tracer):
                try:
                    self.track_array(o)
                except Exception:  # noqa: BLE001 (an array being torn down)
                    pass
        for d in devices:
            self.mark_device_lost(d)


def peer_holds(cluster: LocalCluster, host: int, step: int) -> bool:
    for p in range(cluster.num_hosts):
        seen = cluster.inspect(p) if p != host else None
        if seen is not None and step in seen["replicas"].get(str(host), []):
            return True
    return False


def test_guide_loop_loses_a_slice_scales_up_and_resumes_a_lost_host_from_its_peer(
        ramdisk: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    base = ramdisk / "cluster"
    cluster = LocalCluster.up(base)
    sim = MemoryLoss()
    sim.start()
    returning: list[threading.Thread] = []
    try:
        monkeypatch.setenv("MTC_CLUSTER", str(base))
        monkeypatch.setenv("NUM_STEPS", str(STEPS))
        monkeypatch.setenv("POLL_S", "0.2")
        ns: dict[str, Any] = {"__name__": "readme_elastic_loop"}
        exec(compile(readme_loop(), "README.md (elastic loop)", "exec"), ns)
        devices = ns["devices"]
        slice1 = devices[4:]
        host1 = devices[2:4]  # host 1: the second of slice 0's two hosts

        # Health checks (the loop's and the monitor thread's) see a fault whole.
        checks = threading.Lock()
        check = pw_elastic.get_active_slice_indices

        slice1_found = threading.Event()  # a health check found slice 1 back

        def locked_check(*a: Any, **kw: Any) -> Any:
            with checks:
                found = check(*a, **kw)
            if 1 in found:
                slice1_found.set()
            return found

        monkeypatch.setattr(pw_elastic, "get_active_slice_indices", locked_check)
        batch = ns["batch"]
        phase = [0]
        events: list[str] = []

        def bring_back_host_and_slice() -> None:
            cluster.restart_host(1)  # a new sidecar and replicator, an empty RAM disk
            with checks:
                for d in [*host1, *slice1]:
                    sim.mark_device_connected(d)

        def faulty_batch(step: int, mesh: Mesh) -> jax.Array:
            slices = mesh.devices.shape[0]
            if phase[0] == 0 and slices == 2 and step == 6:
                with checks:
                    sim.lose(slice1)
                events.append(f"slice 1 lost at step {step}")
                phase[0] = 1
            elif phase[0] == 1 and slices == 1 and step >= 12:
                with checks:
                    slice1_found.clear()
                    for d in slice1:
                        sim.mark_device_connected(d)
                events.append(f"slice 1 back at step {step}")
                phase[0] = 2
            elif phase[0] == 2 and slices == 1:
                # Steps are milliseconds here: hold them until the Manager's monitor
                # has seen slice 1 (the loop then scales up at its next step).
                assert slice1_found.wait(30), "the monitor never found slice 1 back"
            elif phase[0] == 2 and slices == 2 and step >= 26:
                saved = (step // 5) * 5  # the newest step the manager saved (every 5)
                wait_until(f"step {saved} on host 1's peer",
                           lambda: peer_holds(cluster, 1, saved), 60)
                with checks:
                    cluster.lose_host(1)  # SIGKILL: its RAM disk goes with it
                    sim.lose([*host1, *slice1])
                events.append(f"host 1 and slice 1 lost at step {step}")
                t = threading.Thread(target=bring_back_host_and_slice, name="host-return")
                t.start()
                returning.append(t)
                phase[0] = 3
            return batch(step, mesh)

        ns["batch"] = faulty_batch
        final = ns["main"]()
        for t in returning:
            t.join(60)
        out = capsys.readouterr().out
        assert phase[0] == 3, events
        loads = re.findall(r"step (\d+) loaded from (\w+) onto slices \[([\d, ]+)\]", out)
        assert [(tier, sl) for _, tier, sl in loads] == [
            ("memory", "0"), ("memory", "0, 1"), ("peer", "0, 1")], out
        assert int(loads[-1][0]) == 25  # the step the manager saved before the loss
        assert final["step"] == STEPS
    finally:
        sim.stop()
        for t in returning:
            t.join(60)
        LocalCluster.load(base).down()

    # The same steps uninterrupted, on every slice.
    mesh = Mesh(np.array(devices).reshape(2, 4), ("replica", "model"))
    state = ns["init_state"](mesh)
    expected: dict[int, float] = {}
    for step in range(STEPS):
        arrays, loss = ns["train_step"]({"w": state["w"], "rng": state["rng"]},
                                        batch(step, mesh))
        state = {**arrays, "step": step + 1}
        expected[step + 1] = float(loss)
    assert ns["losses"] == expected
    np.testing.assert_array_equal(np.asarray(final["w"]), np.asarray(state["w"]))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(final["rng"])),
                                  np.asarray(jax.random.key_data(state["rng"])))
