"""Fencing: a restore deletes only the newer steps an earlier run left incomplete.

The rule is one pure function (:func:`mtc.fencing.to_fence`), tabled here case by
case; the scenarios run it through real managers on simulated hosts (and, marked
``process``, through a multi-controller job of one JAX process per host): the
sequence of issue 56 (save 1, 2, 3; ``latest_step()``; save 4; restore 3) keeps
every step, while a dead run's half-committed step is deleted, named in the log.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.fencing import Fenced, is_complete, to_fence

A, B, NOW = "run-a", "run-b", "run-now"  # two dead runs' identities, and this run's


def every(steps: list[int], hosts: int = 4) -> dict[int, list[int]]:
    return {h: list(steps) for h in range(hosts)}


# (case, restored, held, saved_hosts, runs, complete (multi-controller) or None,
#  what is deleted as (step, hosts, run))
CASES: list[tuple[str, int, dict[int, list[int]], dict[int, int], dict[int, dict[int, str]],
                  set[int] | None, list[tuple[int, tuple[int, ...], str]]]] = [
    ("this run: a newer step every host committed stays (issue 56, item 1)",
     3, every([1, 2, 3, 4]), {4: 4}, {4: dict.fromkeys(range(4), NOW)}, None, []),
    ("a reopened manager: a dead run's newer complete step stays",
     3, every([1, 2, 3, 4]), {4: 4}, {4: dict.fromkeys(range(4), A)}, None, []),
    ("a restore of an older step keeps every newer complete one",
     1, every([1, 2, 3]), {2: 4, 3: 4},
     {2: dict.fromkeys(range(4), A), 3: dict.fromkeys(range(4), NOW)}, None, []),
    ("a dead run's partial commit is deleted where it is held",
     2, {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2], 3: [1, 2]}, {3: 4},
     {3: {0: A, 1: A}}, None, [(3, (0, 1), A)]),
    ("this run's partial commit stays (a failed save: saving it again replaces it)",
     2, {0: [1, 2, 3], 1: [1, 2]}, {3: 2}, {3: {0: NOW}}, None, []),
    ("a partial commit of two runs: the dead run's copies only",
     2, {0: [2, 3], 1: [2, 3], 2: [2]}, {3: 3}, {3: {0: A, 1: NOW}}, None,
     [(3, (0,), A)]),
    ("every host holds it but two runs wrote it: never a step, the dead run's go",
     2, every([2, 3], 2), {3: 2}, {3: {0: A, 1: B}}, None, [(3, (0,), A), (3, (1,), B)]),
    ("a copy whose manifest did not read is kept (unsure: nothing deleted)",
     2, {0: [2, 3], 1: [2]}, {3: 2}, {3: {}}, None, []),
    ("no saving-host count (no manifest read): incomplete, only known runs go",
     2, {0: [2, 3], 1: [2, 3]}, {}, {3: {0: A}}, None, [(3, (0,), A)]),
    ("steps no newer than the restored one are never fenced, complete or not",
     3, {0: [1, 2, 3], 1: [2, 3]}, {1: 2}, {1: {0: A}}, None, []),
    ("a step saved by a larger job, held by all its hosts (host folders beyond this job)",
     1, every([1, 2], 6), {2: 6}, {2: dict.fromkeys(range(6), A)}, None, []),
    ("... and by a larger job's hosts but one: incomplete",
     1, {h: [1, 2] if h != 5 else [1] for h in range(6)}, {2: 6},
     {2: dict.fromkeys(range(5), A)}, None, [(2, (0, 1, 2, 3, 4), A)]),
    ("multi-controller: complete everywhere (learnt collectively) stays",
     3, {1: [1, 2, 3, 4]}, {}, {4: {1: A}}, {1, 2, 3, 4}, []),
    ("multi-controller: a dead run's step another host lacks is deleted here",
     3, {1: [1, 2, 3, 4]}, {}, {4: {1: A}}, {1, 2, 3}, [(4, (1,), A)]),
    ("multi-controller: this run's step another host lacks stays",
     3, {1: [1, 2, 3, 4]}, {}, {4: {1: NOW}}, {1, 2, 3}, []),
    ("nothing newer: nothing to fence", 4, every([1, 2, 3, 4]), {}, {}, None, []),
]


@pytest.mark.parametrize("case, restored, held, saved, runs, complete, want", CASES,
                         ids=[c[0] for c in CASES])
def test_the_fencing_rule(case: str, restored: int, held: dict[int, list[int]],
                          saved: dict[int, int], runs: dict[int, dict[int, str]],
                          complete: set[int] | None,
                          want: list[tuple[int, tuple[int, ...], str]]) -> None:
    got = to_fence(restored, held, saved, runs, NOW, complete=complete)
    assert [(f.step, f.hosts, f.run) for f in got] == want, case
    assert all(isinstance(f, Fenced) and "incomplete" in f.why for f in got)


def test_completeness_needs_every_saving_host_of_one_run() -> None:
    held = every([5], 2)
    assert is_complete(5, held, 2, {0: A, 1: A})
    assert not is_complete(5, held, 3, {0: A, 1: A})  # a third host saved it
    assert not is_complete(5, held, 2, {0: A, 1: B})
    assert not is_complete(5, held, 2, {0: A})  # host 1's manifest unread
    assert not is_complete(5, held, None, {0: A, 1: A})
    assert not is_complete(5, held, 0, {})


# -- scenarios: real managers on simulated hosts ------------------------------------------


def opts(**kw: Any) -> mtc.Options:
    return mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local", **kw)


def state(mesh: Mesh, seed: float) -> dict[str, Any]:
    x = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) + seed
    return {"w": jax.device_put(x, NamedSharding(mesh, P("model"))), "seed": seed}


def folders(root: Path) -> dict[int, list[int]]:
    return {h: sorted(int(p.name) for p in (root / f"host-{h}").iterdir() if p.name.isdigit())
            for h in range(4)}


@pytest.mark.parametrize("reopen", [False, True], ids=["same manager", "reopened"])
def test_restoring_the_step_latest_step_answered_keeps_newer_committed_steps(
        ramdisk: Path, mesh: Mesh, reopen: bool) -> None:
    """Issue 56, item 1: save 1, 2, 3; latest_step() answers 3; save 4; wait;
    restore(3): step 4 (committed on every host) stays, in the manager that saved
    it and in a reopened one; restoring the newest step or any older one later
    deletes nothing either."""
    mgr = mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts())
    try:
        for s in (1, 2, 3):
            assert mgr.save(s, state(mesh, s))
        mgr.wait_until_finished()
        assert mgr.latest_step() == 3
        assert mgr.save(4, state(mesh, 4))
        mgr.wait_until_finished()
        if reopen:
            mgr.close()
            mgr = mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts())
            assert mgr.latest_step() == 4
        back = mgr.restore(3, target=state(mesh, 0))
        assert back["seed"] == 3
        assert mgr.all_steps() == [1, 2, 3, 4]
        assert folders(ramdisk) == every([1, 2, 3, 4])
        for s in (None, 1, 4, 2):
            mgr.restore(s, target=state(mesh, 0))
        assert mgr.all_steps() == [1, 2, 3, 4] and mgr.latest_step() == 4
    finally:
        mgr.close()


def test_a_dead_runs_partial_step_is_deleted_and_named_once(
        ramdisk: Path, mesh: Mesh, caplog: pytest.LogCaptureFixture) -> None:
    """A run died between hosts' commits of 25 (host 3 never committed it); the
    next run restores 20 (also when it names an older step): 25 goes on hosts 0-2,
    in one INFO line naming it; the complete 30 of an older manager stays."""
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        for s in (10, 20, 25):
            assert mgr.save(s, state(mesh, s))
    shutil.rmtree(ramdisk / "host-3" / "25")  # its host died before it committed
    with caplog.at_level(logging.INFO, logger="mtc.manager"), \
            mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        assert mgr.latest_step() == 20
        mgr.restore(10, target=state(mesh, 0))  # an older step: the partial 25 goes too
        lines = [r.getMessage() for r in caplog.records if "deleted on hosts" in r.getMessage()]
        assert lines == [lines[0]] and "step 25 deleted on hosts [0, 1, 2]" in lines[0], lines
        assert "held by hosts [0, 1, 2] of the 4 that saved it" in lines[0]
        assert [r.levelno for r in caplog.records if r.getMessage() in lines] == [logging.INFO]
        assert folders(ramdisk) == every([10, 20])
        assert mgr.all_steps() == [10, 20]


def test_this_runs_failed_save_is_not_fenced_and_is_replaced_by_the_next(
        ramdisk: Path, mesh: Mesh) -> None:
    """This run's step 25 never committed on host 3 (its copy removed, as a failed
    write leaves it): restoring 20 keeps the other hosts' copies (this run's), and
    saving 25 again replaces them with the new run's bytes."""
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        for s in (20, 25):
            assert mgr.save(s, state(mesh, s))
        mgr.wait_until_finished()
        shutil.rmtree(ramdisk / "host-3" / "25")
        mgr.restore(None, target=state(mesh, 0))
        assert folders(ramdisk) == {0: [20, 25], 1: [20, 25], 2: [20, 25], 3: [20]}
        assert mgr.save(25, state(mesh, 1025))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 25]
        assert mgr.restore(25, target=state(mesh, 0))["seed"] == 1025


@pytest.mark.process
@pytest.mark.timeout(300)
def test_multi_controller_rollback_keeps_every_committed_step(tmp_path: Path) -> None:
    """The item-1 sequence in a job of one JAX process per host (no replicators):
    every process keeps steps 1-4 on its own RAM disk after restoring step 3, also
    from a reopened manager (``tests/workers/mc_worker.py``'s ``rollback``)."""
    from mc_cluster import cluster

    logs = tmp_path / "logs"
    logs.mkdir()
    with cluster(2, replicators=False) as c:
        results = c.run_job("rollback", [0, 1], logs, min_checks=4)
    want = {"all_steps": [1, 2, 3, 4], "own_files": ["1", "2", "3", "4"]}
    for r in results:
        assert r["latest_step"] == 3
        assert r["after_restore"] == want and r["after_reopen"] == want
