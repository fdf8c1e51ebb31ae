"""mtc.testing's conditions and assertions, alone (table tests: no cluster; one test starts
processes of its own, standing in for a job's)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtc.errors import ConfigError
from mtc.testing import Restore, TestCluster, assert_same_values, assert_tiers, jobs
from mtc.testing.checks import record_restores, tier_problems, value_problems


@pytest.mark.parametrize(("got", "want", "problems"), [
    ({0: "local", 1: "peer"}, {0: "local", 1: "peer"}, []),
    ({0: "local", 1: "peer"}, {1: "peer"}, []),  # hosts left out are not checked
    ({0: "local", 1: "peer"}, "local", ["host 1: peer (wanted local)"]),
    ({0: "local"}, {1: "backup"}, ["host 1: nothing restored (wanted backup)"]),
])
def test_tier_problems(got: dict[int, str], want: dict[int, str] | str,
                       problems: list[str]) -> None:
    assert tier_problems(got, want) == problems


def test_an_unknown_tier_is_refused() -> None:
    with pytest.raises(ValueError, match="'disk'"):
        tier_problems({0: "local"}, "disk")


def test_assert_tiers_names_the_host() -> None:
    assert_tiers(Restore(3, {0: "local", 1: "peer"}), {1: "peer"})
    with pytest.raises(AssertionError, match=r"host 1: peer \(wanted local\)"):
        assert_tiers(Restore(3, {0: "local", 1: "peer"}), "local")


def test_value_problems_name_the_leaf() -> None:
    a = {"w": jnp.arange(6.0).reshape(2, 3), "step": 3, "n": [np.float32(np.nan)]}
    assert value_problems(a, {"w": jnp.arange(6.0).reshape(2, 3), "step": 3,
                              "n": [np.float32(np.nan)]}) == []  # NaN equals NaN
    assert value_problems(a, {**a, "w": a["w"].at[1, 2].add(1e-6)}) == [
        "['w']: 1 of 6 elements differ"]
    assert value_problems(a, {**a, "w": a["w"].astype(jnp.int32)}) == [
        "['w']: float32[2, 3] != int32[2, 3]"]
    assert value_problems(a, {**a, "step": 4}) == ["['step']: 3 != 4"]
    assert value_problems(a, {"w": a["w"]})[0].startswith("tree structure differs")
    with pytest.raises(AssertionError, match=r"\['step'\]"):
        assert_same_values(a, {**a, "step": 4})


class _NoHosts:
    """A LocalCluster of 2 slices x 2 hosts that refuses to be touched: a fault call
    with a bad host index must be refused before it reaches any host."""

    slices, hosts_per_slice, num_hosts = 2, 2, 4

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"a fault with a bad host reached the cluster ({name})")


@pytest.mark.parametrize("call", [
    lambda c: c.kill_host(-1), lambda c: c.kill_host(4), lambda c: c.kill_host(7),
    lambda c: c.kill_host(True), lambda c: c.kill_host(1.0),
    lambda c: c.wipe_ram_disk(0, 9), lambda c: c.restart_host(-2),
    lambda c: c.kill_replicator(4), lambda c: c.start_replicator(-1),
    lambda c: c.partition([0, 9]), lambda c: c.partition([0, 1], [1, 2]),
])
def test_a_fault_on_no_host_is_refused_naming_the_range(call: Callable[[TestCluster], None]
                                                        ) -> None:
    with pytest.raises(ConfigError, match=r"host .*(hosts are 0 \.\. 3|two groups)"):
        call(TestCluster(_NoHosts()))  # type: ignore[arg-type]


@pytest.mark.parametrize("slice_", [-1, 2, 9])
def test_losing_no_slice_is_refused_naming_the_range(slice_: int) -> None:
    with pytest.raises(ConfigError, match=rf"slice {slice_}: this cluster's slices are 0 \.\. 1"):
        TestCluster(_NoHosts()).lose_slice(slice_)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [-5, -1, True, 2.0, "20"])
@pytest.mark.parametrize("wait", ["wait_replicated", "wait_backed_up"])
def test_waiting_on_no_step_is_refused_at_once(wait: str, step: object) -> None:
    """The second newcomer trial: ``wait_replicated(-5)`` polled the hosts for its
    whole timeout (60 s), then a TimeoutError said step -5 was not on its peer."""
    with pytest.raises(ConfigError, match=rf"step {step!r}: a step is an integer >= 0"):
        getattr(TestCluster(_NoHosts()), wait)(step)  # type: ignore[arg-type]


class _Host3Down(_NoHosts):
    """Hosts 0..2 up, host 3 lost (``kill_host(3)``: no sidecar, no replicator)."""

    def __init__(self) -> None:
        up, down = (SimpleNamespace(sidecar_pid=p, replicator_pid=p) for p in (1, None))
        self.hosts = SimpleNamespace(hosts=[up, up, up, down])


def test_a_job_on_a_host_that_is_down_or_on_no_host_is_refused() -> None:
    """The second newcomer trial: ``run_job`` after ``kill_host(3)`` ran process 3
    outside any host, where it never joined; after the job's whole timeout (300 s)
    every process was named as still running. And ``hosts=[]`` was an IndexError."""
    cluster = TestCluster(_Host3Down())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"host 3 is down .*restart_host\(3\)"):
        cluster.run_job(["job.py"])
    with pytest.raises(ConfigError, match=r"host 3 is down"):
        cluster.run_job(["job.py"], hosts=[3, 1])
    with pytest.raises(ConfigError, match=r"hosts \[\]: a job runs on one host or more"):
        cluster.run_job(["job.py"], hosts=[])
    # The hosts that are up are not refused: the job goes on to start (here, the
    # stand-in cluster refuses to be touched further).
    with pytest.raises(AssertionError, match="reached the cluster"):
        cluster.run_job(["job.py"], hosts=[0, 1, 2])


class _Lost(_NoHosts):
    """A cluster whose hosts are lost without touching anything (``lose_host``)."""

    def __init__(self) -> None:
        self.lost: list[int] = []

    def lose_host(self, host: int) -> None:
        self.lost.append(host)


@pytest.mark.process
def test_a_host_lost_during_a_job_takes_its_job_process_with_it() -> None:
    """The second newcomer trial: ``kill_host(3)`` while ``run_job`` ran left the
    job's process on host 3 running (it holds the host's namespaces, and its RAM
    disk with them): the job ended with no error at all. A lost host's job process
    is SIGKILLed with the host's sidecar and replicator; the job's error names it."""
    local = _Lost()
    cluster = TestCluster(local)  # type: ignore[arg-type]
    procs = {h: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
             for h in (2, 3)}
    try:
        for h, p in procs.items():
            cluster.job_started(h, p)
        cluster.kill_host(3)
        assert procs[3].wait(timeout=10) == -9
        assert local.lost == [3] and procs[2].poll() is None
        assert cluster.lost_during_job(3) and not cluster.lost_during_job(2)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    done = [subprocess.CompletedProcess([], 1, "", ""), subprocess.CompletedProcess([], -9, "", "")]
    error = jobs.job_error(done, [1, 0], ["host 2 (10.0.0.3)", "host 3 (10.0.0.4)"],
                           ["job.py"], 60, lost=[1])
    assert error is not None
    assert str(error).startswith("process 1 on host 3 (10.0.0.4) failed first, with exit "
                                 "status -9 (SIGKILLed: its host was lost while it ran)"
                                 ), str(error)


def _nan(payload: int) -> np.float32:
    return np.array([0x7FC00000 | payload], np.uint32).view(np.float32)[0]


@pytest.mark.parametrize(("got", "want", "problem"), [
    (0.0, -0.0, "0.0 != -0.0 (bits 0000000000000000 != 0000000000000080)"),
    (np.zeros(3, np.float32), -np.zeros(3, np.float32), "3 of 3 elements differ"),
    (jnp.zeros(2).at[1].set(-0.0), jnp.zeros(2), "1 of 2 elements differ"),
    (np.array([_nan(1)]), np.array([_nan(2)]), "1 of 1 elements differ"),
    (_nan(1), _nan(2), "nan != nan (bits 0100c07f != 0200c07f)"),
    (5, np.int64(5), "int != numpy.int64"),
    (0.1, np.float64(0.1), "float != numpy.float64"),
    (np.float32(1), np.float64(1), "numpy.float32 != numpy.float64"),
    (True, 1, "bool != int"),
    (np.arange(3), np.arange(3, dtype=np.int32), "int64[3] != int32[3]"),
])
def test_values_are_compared_bit_for_bit(got: object, want: object, problem: str) -> None:
    assert value_problems({"x": got}, {"x": want}) == [f"['x']: {problem}"]
    with pytest.raises(AssertionError, match="values differ"):
        assert_same_values({"x": got}, {"x": want})


@pytest.mark.parametrize("same", [
    np.array([_nan(3), 1.0], np.float32), _nan(3), 0.1, -0.0, 5, np.int64(5), "s", b"b",
    None, jnp.arange(4.0), jax.random.key(3), jax.random.PRNGKey(3),
    np.array(["a", "bc"]), 10**30,
])
def test_equal_bits_are_the_same_values(same: object) -> None:
    assert value_problems({"x": same}, {"x": same}) == []


def test_record_restores_names_the_step_a_restore_without_one_loaded(tmp_path: Path) -> None:
    import mtc

    options = mtc.Options(simulated_hosts=2, hosts_per_slice=1, dispatch="local")
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("d",))
    state = {"w": jax.device_put(jnp.arange(8.0 * len(jax.devices())),
                                 NamedSharding(mesh, P("d")))}
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=options) as mgr:
        for step in (5, 10):
            mgr.save(step, state, force=True)
        mgr.wait_until_finished()
        with record_restores() as seen:
            mgr.restore(target=state)
            mgr.restore(5, target=state)
        assert mgr.last_restore_step == 5
    assert seen == [Restore(10, {0: "local", 1: "local"}), Restore(5, {0: "local", 1: "local"})]
