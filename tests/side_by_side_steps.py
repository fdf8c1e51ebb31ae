"""The cases of tests/test_orbax_side_by_side.py about steps: saving, listing,
retention, deleting, reopening, preemption and the save schedule (each a function
of a manager factory returning what an Orbax user saw), and the helpers every
case uses."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc

# A factory: (subfolder, Orbax's option fields, item_names) -> a manager.
Make = Callable[..., Any]


def state(mesh: Mesh, seed: float) -> dict[str, Any]:
    w = jnp.arange(64.0, dtype=jnp.float32).reshape(16, 4) + seed
    return {"w": jax.device_put(w, NamedSharding(mesh, P("model")))}


def values(tree: Any) -> Any:
    """A restored tree as plain numbers, for comparing across the libraries."""
    return jax.tree.map(lambda x: np.asarray(x).tolist(), tree)


def kind(x: Any) -> str:
    return type(x).__name__


def rollback(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 56, item 1: restoring the step latest_step() answered, after a newer
    save, keeps every step."""
    with make("a") as mgr:
        for s in (1, 2, 3):
            mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)))
        mgr.wait_until_finished()
        latest = mgr.latest_step()
        mgr.save(4, args=ocp.args.StandardSave(state(mesh, 4)))
        mgr.wait_until_finished()
        back = mgr.restore(3, args=ocp.args.StandardRestore(state(mesh, 0)))
        return [latest, kind(latest), values(back), list(mgr.all_steps())]


def steps_right_after_an_async_save(make: Make, mesh: Mesh) -> list[Any]:
    """Item 3: a step is listed as soon as save() returned; restoring it then
    reads the committed step (mtc waits for the save first)."""
    with make("a") as mgr:
        assert mgr.save(1, args=ocp.args.StandardSave(state(mesh, 1)))
        seen = [mgr.latest_step(), list(mgr.all_steps())]
        back = mgr.restore(1, args=ocp.args.StandardRestore(state(mesh, 0)))
        mgr.wait_until_finished()
        return [*seen, values(back), list(mgr.all_steps())]


def read_only_save_and_delete(make: Make, mesh: Mesh) -> list[Any]:
    """Item 4: on a read-only manager save returns False and delete is skipped."""
    with make("a") as mgr:
        mgr.save(1, args=ocp.args.StandardSave(state(mesh, 1)))
        mgr.wait_until_finished()
    with make("a", read_only=True) as reader:
        saved = reader.save(2, args=ocp.args.StandardSave(state(mesh, 2)))
        deleted = reader.delete(1)
        return [saved, deleted, list(reader.all_steps())]


def save_rules(make: Make, mesh: Mesh) -> list[Any]:
    """Orbax's save decisions: interval, not newer than the newest, force."""
    with make("a", save_interval_steps=2) as mgr:
        got = [mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)), force=f)
               for s, f in ((1, False), (2, False), (3, False), (2, False), (5, True))]
        mgr.wait_until_finished()
        return [got, list(mgr.all_steps())]


def retention_and_keep_period(make: Make, mesh: Mesh) -> list[Any]:
    """max_to_keep with keep_period: the newest steps and the multiples stay."""
    with make("a", max_to_keep=2, keep_period=4) as mgr:
        for s in range(1, 11):
            mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)))
        mgr.wait_until_finished()
        return [list(mgr.all_steps()), mgr.latest_step()]


def reopened_manager(make: Make, mesh: Mesh) -> list[Any]:
    """A reopened manager lists the steps, restores the latest without a step, and
    does not save a step older than the newest (no initial save: steps exist)."""
    with make("a", save_interval_steps=5) as mgr:
        for s in (5, 10):
            mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)))
    with make("a", save_interval_steps=5) as mgr:
        back = mgr.restore(None, args=ocp.args.StandardRestore(state(mesh, 0)))
        return [list(mgr.all_steps()), mgr.latest_step(), values(back),
                mgr.should_save(7), mgr.should_save(15), mgr.is_saving_in_progress()]


def delete_and_reload(make: Make, mesh: Mesh) -> list[Any]:
    """delete() of a step and of a missing one (Orbax: FileNotFoundError, mtc:
    StepNotFoundError, both read here as "not found"); reload() and
    all_steps(read=True) change nothing."""
    with make("a") as mgr:
        for s in (1, 2, 3):
            mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)))
        mgr.wait_until_finished()
        mgr.delete(2)
        try:
            mgr.delete(7)
            missing = "deleted"
        except (FileNotFoundError, mtc.StepNotFoundError):
            missing = "not found"
        mgr.reload()
        return [list(mgr.all_steps()), missing, mgr.latest_step(),
                list(mgr.all_steps(read=True))]  # Orbax's read=: mtc's is a reload()


def best_step(make: Make, mesh: Mesh) -> list[Any]:
    """best_fn: the best step, and the steps kept."""
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3}
    with make("a", max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min") as mgr:
        for s, loss in losses.items():
            mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)), metrics={"loss": loss})
        mgr.wait_until_finished()
        return [mgr.best_step(), list(mgr.all_steps()), mgr.metrics(4)]


def save_on_preemption(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, item 4: one process asks JAX's preemption sync point (under
    ``jax.distributed`` a one-host job gets SIGTERM too) and saves the step it names."""
    with mock.patch.object(multihost_utils, "reached_preemption_sync_point",
                           side_effect=lambda step: step == 2), make("a",
                                                                   save_interval_steps=4) as mgr:
        for s in range(10):
            mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)))
        mgr.wait_until_finished()
        return [list(mgr.all_steps())]


def save_schedule_options(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, item 7 and the schedule options: ``save_on_steps`` beside the interval;
    ``should_save_fn`` alone decides (no first save of its own); a
    ``save_decision_policy`` beside ``save_interval_steps`` other than 1 ignores the
    interval; ``enable_async_checkpointing=False`` commits before ``save`` returns;
    ``save_interval_steps=0`` on a read-only manager (Orbax sets it so itself)."""
    out: list[Any] = []
    with make("a", save_interval_steps=10000, save_on_steps=frozenset({1, 3})) as mgr:
        out.append([mgr.save(s, args=ocp.args.StandardSave(state(mesh, s))) for s in range(5)])
        mgr.wait_until_finished()
        out.append(list(mgr.all_steps()))
    with make("b", should_save_fn=lambda step, latest: step % 3 == 2) as mgr:
        out.append([mgr.should_save(s) for s in range(6)])
    with make("c", save_interval_steps=5, enable_async_checkpointing=False,
              save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(2)) as mgr:
        out.append([mgr.save(s, args=ocp.args.StandardSave(state(mesh, s))) for s in range(5)])
        out.append(mgr.is_saving_in_progress())
    with make("a", save_interval_steps=0, read_only=True) as reader:
        out.append([reader.should_save(7), list(reader.all_steps())])
    return out


def second_manager_in_process(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, item 2: a new manager on the directory of one not closed (Orbax's
    restart in process) reads and, the first being idle, writes; the first then
    sees its steps after ``reload()``, and closing it spoils nothing."""
    with make("a", max_to_keep=2) as first:
        for s in (1, 2):
            first.save(s, args=ocp.args.StandardSave(state(mesh, s)))
        first.wait_until_finished()
        second = make("a", max_to_keep=2)
        seen = [list(second.all_steps()), second.latest_step()]
        for s in (3, 4):
            second.save(s, args=ocp.args.StandardSave(state(mesh, s)))
        second.wait_until_finished()
        first.reload()
        seen.append(list(first.all_steps()))
    back = second.restore(4, args=ocp.args.StandardRestore(state(mesh, 0)))
    second.close()
    return [*seen, values(back)]


def keep_time_interval_on_the_clock_orbax_reads(make: Make, mesh: Mesh) -> list[Any]:
    """keep_time_interval beside max_to_keep and beside best_fn, one save an hour on
    the clock Orbax reads and its users' tests fake (``datetime.datetime``)."""
    out: list[Any] = []
    now = datetime.datetime.now(tz=datetime.UTC)
    hours3 = datetime.timedelta(hours=3)
    for sub, kw in (("a", {"max_to_keep": 2}),
                    ("b", {"max_to_keep": 3, "best_fn": lambda m: m["loss"],
                           "best_mode": "min"})):
        with mock.patch("datetime.datetime", autospec=True) as dt, make(
                sub, item_names=("params",), keep_time_interval=hours3, **kw) as mgr:
            for s in range(10):
                dt.now.return_value = now
                mgr.save(s, args=ocp.args.Composite(params=ocp.args.StandardSave(
                    state(mesh, s))), metrics={"loss": s})
                now += datetime.timedelta(hours=1)
            mgr.wait_until_finished()
            out.append(list(mgr.all_steps()))
    return out
