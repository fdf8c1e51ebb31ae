"""One run's bytes per step, and no loss in silence (simulated hosts in this process).

A step whose hosts hold copies written by two runs of the job is never offered nor
restored; restoring the newest step fences off the saves that did not finish on
every host, so the resumed run saves those numbers afresh; when a host's data of
every step is gone while other hosts still hold steps, latest_step() says so with
a typed error (or starts over when asked). The test plays the hosts: it moves and
removes their step folders itself, as a crash or a wiped RAM disk would.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc import runs
from mtc.manifest import MANIFEST_NAME, Manifest


def opts(**kw: Any) -> mtc.Options:
    return mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local", max_to_keep=None,
                       **kw)


def state(mesh: Mesh, seed: float) -> dict[str, Any]:
    x = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) + seed
    return {"w": jax.device_put(x, NamedSharding(mesh, P("model"))), "seed": seed}


def run_of(root: Path, host: int, step: int) -> str:
    return Manifest.from_bytes((root / f"host-{host}" / str(step) / MANIFEST_NAME)
                               .read_bytes()).run


# -- pure ------------------------------------------------------------------------------


def test_run_identities_are_fresh_and_compare_by_key() -> None:
    a, b = runs.new_run_id(), runs.new_run_id()
    assert a != b and len(a) == 16
    assert runs.run_key(a) == runs.run_key(a) != runs.run_key(b)
    assert runs.run_key("") == 0 < runs.run_key(a) < 2**62
    assert runs.one_run({0: a, 1: a}) == a
    assert runs.one_run({0: a, 1: b}) is None
    assert runs.describe_mix({0: a, 1: b, 2: a}) == f"hosts [0, 2] run {a}; hosts [1] run {b}"


# -- the manager -----------------------------------------------------------------------


def test_every_manifest_names_the_run_and_a_restore_starts_another(ramdisk: Path,
                                                                   mesh: Mesh) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(5, state(mesh, 5))
        mgr.wait_until_finished()
        first = {run_of(ramdisk, h, 5) for h in range(4)}
        assert len(first) == 1 and first != {""}
        mgr.restore(5, target=state(mesh, 0))
        mgr.save(6, state(mesh, 6))
        mgr.wait_until_finished()
    second = {run_of(ramdisk, h, 6) for h in range(4)}
    assert len(second) == 1 and second != first  # a restore began another run


def test_a_step_two_runs_committed_is_never_offered_nor_restored(ramdisk: Path,
                                                                 mesh: Mesh) -> None:
    # Run A saves 5 and 10 everywhere; another run saves 10 in another directory;
    # one host of this directory then holds the other run's 10 (a save of that
    # number by a resumed job, on the hosts where the older one did not survive).
    other = ramdisk / "other"
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(5, state(mesh, 5))
        mgr.save(10, state(mesh, 10))
    with mtc.CheckpointManager(other, mesh=mesh, options=opts()) as mgr:
        mgr.save(10, state(mesh, 99))
    shutil.rmtree(ramdisk / "host-3" / "10")
    shutil.move(other / "host-3" / "10", ramdisk / "host-3" / "10")
    assert run_of(ramdisk, 3, 10) != run_of(ramdisk, 0, 10)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        assert mgr.all_steps() == [5]
        assert mgr.latest_step() == 5
        with pytest.raises(mtc.MixedRunError, match=r"hosts \[0, 1, 2\] run .*hosts \[3\]"):
            mgr.restore(10, target=state(mesh, 0))
        back = mgr.restore(5, target=state(mesh, 0))
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(state(mesh, 5)["w"]))


def test_restoring_the_newest_step_fences_off_a_save_some_hosts_never_finished(
        ramdisk: Path, mesh: Mesh) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(20, state(mesh, 20))
        mgr.save(25, state(mesh, 25))
    shutil.rmtree(ramdisk / "host-3" / "25")  # its host died before it committed
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        step = mgr.latest_step()
        assert step == 20
        mgr.restore(step, target=state(mesh, 0))
        # Fenced: the resumed run (other data) saves 25 again on every host.
        assert not any((ramdisk / f"host-{h}" / "25").exists() for h in range(4))
        assert mgr.save(25, state(mesh, 1025))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 25]
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        back = mgr.restore(target=state(mesh, 0))
    assert back["seed"] == 1025
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(state(mesh, 1025)["w"]))


def test_an_older_step_restored_on_purpose_fences_nothing(ramdisk: Path, mesh: Mesh) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        for s in (10, 20):
            mgr.save(s, state(mesh, s))
        mgr.wait_until_finished()
        mgr.restore(10, target=state(mesh, 0))  # rolling back, as Orbax allows
        assert mgr.all_steps() == [10, 20]


def test_a_host_whose_every_step_is_gone_is_a_typed_error_not_a_fresh_start(
        ramdisk: Path, mesh: Mesh) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(20, state(mesh, 20))
        mgr.save(25, state(mesh, 25))
    for s in (20, 25):
        shutil.rmtree(ramdisk / "host-1" / str(s))  # host 1's RAM disk wiped
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        with pytest.raises(mtc.DataLossError, match=r"host 0 holds steps \[20, 25\]"):
            mgr.latest_step()
        with pytest.raises(mtc.DataLossError, match="if_data_lost='start_over'"):
            mgr.restore(target=state(mesh, 0))
    with mtc.CheckpointManager(ramdisk, mesh=mesh,
                               options=opts(if_data_lost="start_over")) as mgr:
        assert mgr.latest_step() is None  # the user chose to start over
        assert mgr.save(20, state(mesh, 7))  # the numbers are free again
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20]


def test_a_new_job_with_nothing_saved_starts_quietly(ramdisk: Path, mesh: Mesh) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        assert mgr.latest_step() is None
        with pytest.raises(mtc.StepNotFoundError, match="no step is committed"):
            mgr.restore(target=state(mesh, 0))
