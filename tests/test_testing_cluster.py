"""mtc.testing's cluster as a user's test drives it: the context manager, each fault,
the waits, and the tier every host restores from after it (real sidecars and
replicators, SIGKILLs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.testing import (
    ScriptError,
    TestCluster,
    assert_same_values,
    assert_tiers,
    local_cluster,
    record_restores,
)

pytestmark = pytest.mark.process  # every test here starts hosts


def train(cluster: TestCluster, num_steps: int) -> dict[str, Any]:
    """Resume from the newest step, train to ``num_steps``, saving every 10."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    w = jnp.arange(32 * 8, dtype=jnp.float32).reshape(32, 8)
    state = {"w": jax.device_put(w, NamedSharding(mesh, P("data"))), "step": 0}
    opts = cluster.options(save_interval_steps=10, restore_timeout_s=60)
    with mtc.CheckpointManager(cluster.local_dir, mesh=mesh, options=opts) as mgr:
        if (step := mgr.latest_step()) is not None:
            state = mgr.restore(step, target=state)
        for step in range(state["step"], num_steps):
            state = {"w": jnp.cos(state["w"]) * 2 + step, "step": step + 1}
            mgr.save(step + 1, state)
    return state


SCRIPT = """
import sys

import jax
import numpy as np
from jax.sharding import Mesh

import mtc
from mtc.testing import TestCluster

mesh = Mesh(np.array(jax.devices()), ("data",))
cluster = TestCluster.from_env()  # the cluster that runs this script
options = cluster.options(save_interval_steps=10)
with mtc.CheckpointManager(cluster.local_dir, mesh=mesh, options=options) as mgr:
    step = mgr.latest_step()
    state = mgr.restore(step)
    print("resumed", step, mgr.last_restore_tier)
    assert mgr.save(int(sys.argv[1]), state)
"""


def restored_after(cluster: TestCluster, num_steps: int) -> tuple[dict[str, Any], dict[int, str]]:
    with record_restores() as seen:
        state = train(cluster, num_steps)
    assert len(seen) == 1 and seen[0].step == num_steps, seen
    return state, seen[0].tiers


def test_each_fault_restores_from_the_tier_it_leaves(tmp_path: Path, shm_base: Path) -> None:
    with local_cluster(slices=2, hosts_per_slice=2, base=shm_base
                       ) as cluster:
        if cluster.local.isolation == "namespaces":  # partitions need root
            cluster.partition([0, 1], [2, 3])
            with pytest.raises(RuntimeError, match=r"host 0 \(\S+\) cannot reach .*:7000"):
                cluster.local.hosts.check_reach(lambda h: h.replicator_port)
            cluster.heal()
            cluster.local.hosts.check_reach(lambda h: h.replicator_port)
        at_20 = train(cluster, 20)
        cluster.wait_replicated(20, timeout=30)
        # The same copies through the harness's own waits (mtc's tests' HostReplicators).
        cluster.replicators.wait_held({(2, 0, 20), (1, 3, 20)}, timeout=5)
        assert {(2, 0, 20), (0, 2, 20)} <= cluster.replicators.held()
        assert cluster.request_backup() == 20
        cluster.wait_backed_up(20, timeout=30)
        assert 20 in cluster.backed_up()

        # Processes restarted, RAM disks kept: every host's own copy.
        cluster.restart_host(2)
        cluster.kill_replicator(0)
        cluster.start_replicator(0)
        assert (2, 20) in cluster.held()[2] and (0, 20) in cluster.held()[0]
        got, tiers = restored_after(cluster, 20)
        assert_tiers(tiers, "local")
        assert_same_values(got, at_20)

        # A slice lost and replaced empty: its hosts' data from the other slice.
        cluster.lose_slice(1)
        assert set(cluster.held()) == {0, 1}
        cluster.restart_host(2)
        cluster.restart_host(3)
        got, tiers = restored_after(cluster, 20)
        assert_tiers(tiers, {0: "local", 1: "local", 2: "peer", 3: "peer"})
        assert_same_values(got, at_20)

        # Every machine restarted: only the backup is left.
        cluster.wipe_ram_disk(0, 1, 2, 3)
        assert not any(cluster.held().values())
        got, tiers = restored_after(cluster, 20)
        assert_tiers(tiers, "backup")
        assert_same_values(got, at_20)

        # A training script run as the cluster's controller, on the same options.
        script = tmp_path / "train.py"
        script.write_text(SCRIPT)
        out = cluster.run_script([str(script), "30"]).stdout.split()
        assert out == ["resumed", "20", "local"], out
        cluster.wait_replicated(30, timeout=30)
        with pytest.raises(ScriptError, match=r"(?s)exit status 3.*--- stderr ---\n.*no such"):
            cluster.run_script(["-c", "import sys; print('no such thing', file=sys.stderr); "
                                      "sys.exit(3)"])


def test_a_host_lost_mid_run_fails_the_next_save_once_naming_it(tmp_path: Path,
                                                                 shm_base: Path) -> None:
    """kill_host of a host a job is running on: the job's next save raises one
    SaveError naming the step, the host and the process (not a restore's
    ShardUnavailableError), and leaving the manager's block raises nothing over it.
    restart_host of a running host: the saves after it reach its new sidecar."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    state = {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("data")))}
    with local_cluster(slices=2, hosts_per_slice=1,
                       base=shm_base) as cluster:
        with pytest.raises(mtc.SaveError) as raised:
            with mtc.CheckpointManager(cluster.local_dir, mesh=mesh,
                                       options=cluster.options()) as mgr:
                mgr.save(1, state, force=True)
                mgr.wait_until_finished()
                cluster.kill_host(1)
                mgr.save(2, state, force=True)
                mgr.wait_until_finished()
        error = raised.value
        assert (error.step, error.host) == (2, 1), error
        assert "save failed in process 0: host 1 did not answer" in str(error), error
        assert isinstance(error.__cause__, mtc.ShardUnavailableError)
        assert "closing the CheckpointManager then failed too" in "".join(
            getattr(error, "__notes__", []))

        cluster.restart_host(1)  # down: back empty
        with mtc.CheckpointManager(cluster.local_dir, mesh=mesh,
                                   options=cluster.options()) as mgr:
            mgr.save(11, state, force=True)
            mgr.wait_until_finished()
            cluster.restart_host(1)  # running: its sidecar and replicator restart
            mgr.save(12, state, force=True)
            mgr.wait_until_finished()
            assert 12 in mgr.all_steps()
