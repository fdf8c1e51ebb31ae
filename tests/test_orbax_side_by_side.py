"""An Orbax user's habits, each run against both libraries in one test.

Every case is one function of a manager factory: it makes the calls an Orbax
user makes and returns what they saw (values and type names). The same case runs
on a real ``ocp.CheckpointManager`` and on ``mtc.CheckpointManager`` (simulated
hosts in this process), and the two answers must be equal: a difference is a
failing test, not a surprise. Where mtc answers differently on purpose, the
case says so and docs/reference.md's Orbax table names it.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.testing.waits import wait_until

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


# -- the cases ------------------------------------------------------------------------


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


def composite_without_args(make: Make, mesh: Mesh) -> list[Any]:
    """Item 2: restore(step) of a step saved as a Composite gives a Composite."""
    with make("a") as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state(mesh, 1)),
                                            meta=ocp.args.JsonSave({"lr": 0.5})))
        mgr.wait_until_finished()
        r = mgr.restore(1)
        return [kind(r), sorted(r.keys()), values(r.state), r.meta, kind(r.state["w"])]


def steps_right_after_an_async_save(make: Make, mesh: Mesh) -> list[Any]:
    """Item 3: a step is listed as soon as save() returned; restoring it then
    reads the committed step (mtc waits for the save first)."""
    with make("a") as mgr:
        assert mgr.save(1, args=ocp.args.StandardSave(state(mesh, 1)))
        seen = [mgr.latest_step(), list(mgr.all_steps())]
        back = mgr.restore(1, args=ocp.args.StandardRestore(state(mesh, 0)))
        mgr.wait_until_finished()
        return [*seen, values(back), list(mgr.all_steps())]


def item_metadata_of_a_composite(make: Make, mesh: Mesh) -> list[Any]:
    """Item 4: item_metadata of a Composite step is a Composite; each array's shape,
    dtype and sharding are there (Orbax: its ArrayMetadata; mtc: a ShapeDtypeStruct
    with the sharding restore(step) uses, as docs/reference.md says)."""
    with make("a") as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state(mesh, 1))))
        mgr.wait_until_finished()
        md = mgr.item_metadata(1)
        w = md.state["w"]
        return [kind(md), sorted(md.keys()), tuple(w.shape), np.dtype(w.dtype).name,
                w.sharding is not None]


def metrics_of_a_missing_step(make: Make, mesh: Mesh) -> list[Any]:
    """Item 4: metrics() of a step never saved is None; of one saved, its metrics
    (Orbax keeps them with ``best_fn`` only; mtc always, as docs/reference.md says)."""
    with make("a", best_fn=lambda m: m["loss"], best_mode="min") as mgr:
        mgr.save(1, args=ocp.args.StandardSave(state(mesh, 1)), metrics={"loss": 0.25})
        mgr.wait_until_finished()
        return [mgr.metrics(7), mgr.metrics(1)]


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


def restore_args_without_an_item(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, item 1: ``PyTreeRestore(restore_args=...)`` with shardings and no item:
    shapes and dtypes come from the checkpoint, arrays land on the given shardings;
    a placeholder (``...``) leaf is left out and given back; restore_args covering
    more than the item (``partial_restore``) restore the item's leaves."""
    tree = {"a": state(mesh, 1)["w"], "b": jnp.arange(8, dtype=jnp.int32),
            "c": {"d": state(mesh, 2)["w"] * 2, "e": jnp.ones((4,), jnp.float32)}}
    on = {"a": NamedSharding(mesh, P("model")), "b": NamedSharding(mesh, P()),
          "c": {"d": NamedSharding(mesh, P(None, "model")), "e": NamedSharding(mesh, P())}}
    ra = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s), on)
    with make("a", item_names=("params",)) as mgr:
        mgr.save(0, args=ocp.args.Composite(params=ocp.args.PyTreeSave(tree)))
        mgr.wait_until_finished()
        got = mgr.restore(0, args=ocp.args.Composite(
            params=ocp.args.PyTreeRestore(restore_args=ra))).params
        placed = jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), got, on)
    with make("b") as mgr:
        mgr.save(0, args=ocp.args.PyTreeSave(tree))
        mgr.wait_until_finished()
        partial = mgr.restore(0, args=ocp.args.PyTreeRestore(
            {"a": 0, "c": {"d": 0}}, restore_args=ra, partial_restore=True))
    return [values(got), jax.tree.map(lambda x: np.dtype(x.dtype).name, got), placed,
            values(partial)]


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


def refusals_as_orbax_raises_them(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, items 3, 5 and 8: what Orbax refuses is refused at once with the
    built-in exception Orbax raises there (mtc's errors subclass it): a forced save
    of a step in flight or committed (Orbax's own StepAlreadyExistsError, which mtc's
    StepExistsError is too where Orbax is loaded), a single item on a Composite manager and the
    reverse, an item outside item_names (ValueError), a missing step
    (FileNotFoundError); ``restore(directory=)`` reads another manager's folder."""
    def refused(call: Callable[[], Any]) -> str:
        try:
            call()
        except ocp.checkpoint_manager.StepAlreadyExistsError:  # a ValueError: first
            return "StepAlreadyExistsError"
        except ValueError:
            return "ValueError"
        except FileNotFoundError:
            return "FileNotFoundError"
        return "accepted"

    one = ocp.args.StandardSave(state(mesh, 1))
    out: list[Any] = []
    with make("a", item_names=("params",)) as mgr:
        mgr.save(0, args=ocp.args.Composite(params=one))
        out.append(refused(lambda: mgr.save(0, args=ocp.args.Composite(params=one),
                                            force=True)))
        out.append(refused(lambda: mgr.save(1, args=one)))
        out.append(refused(lambda: mgr.save(2, args=ocp.args.Composite(other=one))))
        out.append(refused(lambda: mgr.restore(7, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(state(mesh, 0))))))
        mgr.wait_until_finished()
        out.append(refused(lambda: mgr.save(0, args=ocp.args.Composite(params=one),
                                            force=True)))  # committed now
    with make("b") as mgr:
        mgr.save(0, args=one)
        mgr.wait_until_finished()
        out.append(refused(lambda: mgr.save(1, args=ocp.args.Composite(params=one))))
        out.append(refused(lambda: mgr.restore(0, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(state(mesh, 0))))))
    with make("c", item_names=("params",)) as mgr:
        back = mgr.restore(0, args=ocp.args.Composite(params=ocp.args.StandardRestore(
            state(mesh, 0))), directory=Path(mgr.directory).parent / "a")
        out.append(values(back.params))
    return out


def root_and_step_metadata(make: Make, mesh: Mesh) -> list[Any]:
    """Root metadata (the first writer's stays; a reader's is answered, not kept) and
    a step's metadata: its items, metrics and custom_metadata."""
    with make("a", metadata={"version": 1}) as mgr:
        mgr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state(mesh, 1))),
                 custom_metadata={"lr": 0.5})
        mgr.wait_until_finished()
        first = mgr.metadata().custom_metadata
    with make("a", metadata={"version": 2}) as mgr:
        again = mgr.metadata().custom_metadata
        step = mgr.metadata(0)
        seen = [sorted(step.item_metadata), step.metrics, step.custom_metadata]
    with make("b", metadata={"version": 3}, read_only=True) as reader:
        read_only = reader.metadata().custom_metadata
    with make("b") as mgr:
        after_reader = mgr.metadata().custom_metadata
    return [first, again, *seen, read_only, after_reader]


def restore_without_target_keeps_the_saved_sharding(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, item 6: a restore with no target comes back with the sharding it was
    saved with (its devices exist here), not replicated on the manager's mesh."""
    half = Mesh(np.array(jax.devices()[:4]), ("x",))
    on = {"a": NamedSharding(half, P("x")), "b": NamedSharding(mesh, P(None, "model"))}
    tree = {"a": jax.device_put(jnp.arange(32.0).reshape(8, 4), on["a"]),
            "b": jax.device_put(jnp.ones((8, 4)), on["b"])}
    with make("a") as mgr:
        mgr.save(0, args=ocp.args.StandardSave(tree))
        mgr.wait_until_finished()
        back = mgr.restore(0)
    return [values(back), {k: back[k].sharding.is_equivalent_to(on[k], 2) for k in on}]


def array_items(make: Make, mesh: Mesh) -> list[Any]:
    """``ArraySave``/``ArrayRestore`` items beside a pytree and JSON (Orbax's own
    multi-item habit)."""
    with make("a", item_names=("params", "arr", "meta")) as mgr:
        mgr.save(0, args=ocp.args.Composite(params=ocp.args.PyTreeSave(state(mesh, 1)),
                                            arr=ocp.args.ArraySave(np.arange(16)),
                                            meta=ocp.args.JsonSave({"v": 2})))
        mgr.wait_until_finished()
        back = mgr.restore(0, args=ocp.args.Composite(
            params=ocp.args.PyTreeRestore(state(mesh, 0)), arr=ocp.args.ArrayRestore(),
            meta=ocp.args.JsonRestore()))
        return [values(back.params), np.asarray(back.arr).tolist(), back.meta]


def legacy_items_and_restore_kwargs(make: Make, mesh: Mesh) -> list[Any]:
    """Orbax's legacy form: ``save(step, {item: tree})`` and ``restore(step, {item:
    target}, restore_kwargs={item: {"restore_args": ...}})`` (mtc: with item_names,
    the names Orbax's legacy checkpointers dict gives)."""
    ra = {"w": ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P("model")))}
    with make("a", legacy=("params", "meta")) as mgr:
        mgr.save(0, {"params": state(mesh, 1), "meta": {"lr": 0.5}})
        mgr.wait_until_finished()
        back = mgr.restore(0, {"params": {"w": 0}, "meta": None},
                           restore_kwargs={"params": {"restore_args": ra}})
        return [values(back["params"]), back["meta"]]


def item_handlers_name_the_items_and_their_args(make: Make, mesh: Mesh) -> list[Any]:
    """Orbax's ``item_handlers``: a dict names the items, one handler makes a
    single-item manager; args an item's handler does not take are a ValueError, and
    so is one handler beside item_names."""
    def refused(call: Callable[[], Any]) -> str:
        try:
            call()
        except ValueError:
            return "ValueError"
        return "accepted"

    out: list[Any] = []
    with make("a", item_handlers={"params": ocp.StandardCheckpointHandler(),
                                  "meta": ocp.JsonCheckpointHandler()}) as mgr:
        mgr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(state(mesh, 1)),
                                            meta=ocp.args.JsonSave({"lr": 0.5})))
        mgr.wait_until_finished()
        out.append(refused(lambda: mgr.save(1, args=ocp.args.Composite(
            params=ocp.args.PyTreeSave(state(mesh, 1))))))
        back = mgr.restore(0, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(state(mesh, 0)), meta=ocp.args.JsonRestore()))
        out += [values(back.params), back.meta]
    with make("b", item_handlers=ocp.PyTreeCheckpointHandler()) as mgr:
        out.append(refused(lambda: mgr.save(0, args=ocp.args.StandardSave(state(mesh, 2)))))
        # Another step than the refused one: Orbax may still be creating the refused
        # save's temporary folder, and its save of the same step then fails with
        # FileExistsError (seen under load, beside a second suite).
        mgr.save(1, args=ocp.args.PyTreeSave(state(mesh, 2)))
        mgr.wait_until_finished()
        out.append(values(mgr.restore(1, args=ocp.args.PyTreeRestore(state(mesh, 0)))))
    out.append(refused(lambda: make("c", item_names=("x",),
                                    item_handlers=ocp.StandardCheckpointHandler())))
    return out


def root_metadata_not_kept(make: Make, mesh: Mesh) -> list[Any]:
    """``save_root_metadata=False``: the manager's ``metadata=`` is neither kept nor
    answered; one an earlier manager kept is still answered."""
    out: list[Any] = []
    for v, keep in ((1, False), (2, True), (3, False)):
        with make("a", metadata={"v": v}, save_root_metadata=keep) as mgr:
            out.append(mgr.metadata().custom_metadata)
    return out


def legacy_single_item_restore_kwargs(make: Make, mesh: Mesh) -> list[Any]:
    """Orbax's legacy single-item form: ``CheckpointManager(directory, checkpointer)``,
    ``save(step, tree)``, ``restore(step, restore_kwargs={"restore_args": ...})`` (the
    one item's kwargs, not ``{item: kwargs}``), on the saving manager and a fresh one."""
    ra = {"w": ocp.ArrayRestoreArgs(sharding=NamedSharding(mesh, P("model")))}
    out: list[Any] = []
    with make("a", legacy_one=True) as mgr:
        mgr.save(0, state(mesh, 1))
        mgr.wait_until_finished()
        back = mgr.restore(0, restore_kwargs={"restore_args": ra})
        out += [values(back), kind(back["w"]), str(back["w"].sharding.spec)]
    with make("a", legacy_one=True) as mgr:
        out.append(values(mgr.restore(0, restore_kwargs={"restore_args": ra})))
    return out


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


def a_target_leaving_out_saved_leaves(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, third round: Orbax's PyTreeRestore (without partial_restore=True) and
    StandardRestore name every saved leaf; a target leaving one out is a ValueError
    in Orbax's words, not a silent partial restore. partial_restore=True restores the
    part named; placeholders (...) name leaves left as they are; an item of
    RestoreArgs leaves is read as the restore_args."""
    def outcome(call: Callable[[], Any]) -> Any:
        try:
            return values(call())
        except ValueError as e:
            return ["ValueError", "User-provided restore item and on-disk value" in str(e)]

    tree = {"a": state(mesh, 1)["w"], "c": {"d": state(mesh, 2)["w"], "e": 3}}
    sharding = tree["a"].sharding
    out: list[Any] = []
    with make("a") as mgr:
        mgr.save(0, args=ocp.args.PyTreeSave(tree))
        mgr.wait_until_finished()
        part = {"a": state(mesh, 0)["w"]}
        out.append(outcome(lambda: mgr.restore(0, args=ocp.args.PyTreeRestore(part))))
        out.append(outcome(lambda: mgr.restore(0, args=ocp.args.PyTreeRestore(
            part, partial_restore=True))))
        out.append(outcome(lambda: mgr.restore(0, args=ocp.args.PyTreeRestore(
            {"a": state(mesh, 0)["w"], "c": {"d": ..., "e": ...}}))))
        out.append(outcome(lambda: mgr.restore(0, args=ocp.args.PyTreeRestore(
            {"a": ocp.ArrayRestoreArgs(sharding=sharding),
             "c": {"d": ocp.ArrayRestoreArgs(sharding=sharding), "e": ocp.RestoreArgs()}}))))
    with make("b") as mgr:
        mgr.save(0, args=ocp.args.StandardSave(tree))
        mgr.wait_until_finished()
        out.append(outcome(lambda: mgr.restore(0, args=ocp.args.StandardRestore(
            {"a": state(mesh, 0)["w"]}))))
    return out


def step_statistics_to_the_logger(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, third round: a logger given to the manager gets Orbax's step
    statistics after each save that writes and each restore (the same fields)."""
    class Recorder:
        def __init__(self) -> None:
            self.entries: list[dict[str, Any]] = []

        def log_entry(self, entry: dict[str, Any]) -> None:
            self.entries.append(entry)

    rec = Recorder()
    with make("a", logger=rec) as mgr:
        mgr.save(0, args=ocp.args.StandardSave(state(mesh, 0)))
        mgr.save(0, args=ocp.args.StandardSave(state(mesh, 0)))  # not written
        mgr.wait_until_finished()
        mgr.restore(0)
        directory = str(mgr.directory)
    return [[(sorted(e), e["step"], e["event_type"], e["directory"] == directory,
              e.get("synchronous"), e.get("reached_preemption"),
              [k for k, v in e.items() if v is None]) for e in rec.entries]]


def private_attributes_orbax_code_reads(make: Make, mesh: Mesh) -> list[Any]:
    """Issue 67, third round (mtc.orbax_compat_attrs): Orbax's private attributes read
    as Orbax's: ``_default_item`` (unknown, then one item once a save, a restore or a
    step's metadata locks the mode in: a Composite save is then refused),
    ``_root_metadata_file_path()`` (a ValueError where none is kept),
    ``_checkpoints`` (the steps and their metrics)."""
    def outcome(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ValueError:
            return "ValueError"

    out: list[Any] = []
    with make("a") as mgr:
        out.append(mgr._default_item.get())
        mgr.save(0, args=ocp.args.StandardSave(state(mesh, 0)))
        out.append(mgr._default_item.get())
        mgr.wait_until_finished()
        out.append(outcome(lambda: mgr._root_metadata_file_path().exists()))
    with make("a") as fresh:
        out.append(fresh._default_item.get())
        fresh.restore(0)
        out.append(fresh._default_item.get())
        out.append(outcome(lambda: fresh.save(1, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state(mesh, 1))))))
    with make("b", metadata={"v": 1}) as mgr:
        out.append(outcome(lambda: mgr._root_metadata_file_path().exists()))
    with make("c", max_to_keep=2) as mgr:
        for s in range(3):
            mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)), metrics={"loss": s})
        mgr.wait_until_finished()
        out.append([(i.step, i.metrics) for i in mgr._checkpoints])
    return out


CASES = [rollback, composite_without_args, steps_right_after_an_async_save,
         item_metadata_of_a_composite, metrics_of_a_missing_step, read_only_save_and_delete,
         save_rules, retention_and_keep_period, reopened_manager, delete_and_reload, best_step,
         save_on_preemption, restore_args_without_an_item,
         save_schedule_options, second_manager_in_process,
         refusals_as_orbax_raises_them, root_and_step_metadata,
         restore_without_target_keeps_the_saved_sharding, array_items,
         legacy_items_and_restore_kwargs, keep_time_interval_on_the_clock_orbax_reads,
         item_handlers_name_the_items_and_their_args, root_metadata_not_kept,
         legacy_single_item_restore_kwargs, a_target_leaving_out_saved_leaves,
         step_statistics_to_the_logger, private_attributes_orbax_code_reads]


# -- the two libraries ----------------------------------------------------------------


def orbax_maker(base: Path) -> Make:
    def make(sub: str, item_names: tuple[str, ...] | None = None, metadata: Any = None,
             legacy: tuple[str, ...] | None = None, item_handlers: Any = None,
             legacy_one: bool = False, logger: Any = None, **kw: Any) -> Any:
        if legacy_one:  # Orbax's legacy single-item form: one checkpointer
            return ocp.CheckpointManager(base / sub, ocp.Checkpointer(
                ocp.PyTreeCheckpointHandler()), options=ocp.CheckpointManagerOptions(**kw))
        if legacy is not None:  # Orbax's legacy form: a checkpointer per item
            return ocp.CheckpointManager(base / sub, {
                n: ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) for n in legacy},
                options=ocp.CheckpointManagerOptions(**kw))
        return ocp.CheckpointManager(base / sub, item_names=item_names, metadata=metadata,
                                     item_handlers=item_handlers, logger=logger,
                                     options=ocp.CheckpointManagerOptions(**kw))
    return make


def mtc_maker(base: Path, mesh: Mesh) -> Make:
    def make(sub: str, item_names: tuple[str, ...] | None = None, metadata: Any = None,
             legacy: tuple[str, ...] | None = None, item_handlers: Any = None,
             legacy_one: bool = False, logger: Any = None, **kw: Any) -> Any:
        # Orbax's legacy checkpointers name the items: mtc is given the names (one
        # checkpointer, legacy_one: nothing).
        return mtc.CheckpointManager(base / sub, mesh=mesh, item_names=legacy or item_names,
                                     metadata=metadata, item_handlers=item_handlers,
                                     logger=logger,
                                     options=mtc.Options(simulated_hosts=4, dispatch="local",
                                                         **kw))
    return make


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_mtc_answers_as_orbax_does(case: Callable[[Make, Mesh], list[Any]], tmp_path: Path,
                                   ramdisk: Path, mesh: Mesh) -> None:
    logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's per-save INFO lines
    want = case(orbax_maker(tmp_path), mesh)
    got = case(mtc_maker(ramdisk, mesh), mesh)
    assert got == want, f"{case.__name__}: mtc {got} != Orbax {want}"


def test_a_step_retention_freed_before_the_saves_were_waited_for_is_not_listed(
        ramdisk: Path, mesh: Mesh) -> None:
    """Listed from save() on, a step is still listed only while the hosts hold it:
    with max_to_keep=1 the save of 3 frees 1 (committed, never waited for)."""
    def committed(step: int) -> None:
        wait_until(f"step {step} committed on every host", lambda: all(
            (ramdisk / "a" / f"host-{h}" / str(step)).is_dir() for h in range(4)), 30,
            poll_s=0.01)

    with mtc_maker(ramdisk, mesh)("a", max_to_keep=1) as mgr:
        for s in (1, 2):
            assert mgr.save(s, state(mesh, s))
            committed(s)
        assert mgr.save(3, state(mesh, 3))
        assert mgr.latest_step() == 3
        wait_until("step 1 freed in the background", lambda: mgr.all_steps() == [2, 3], 30,
                   poll_s=0.01, detail=mgr.all_steps)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]


# -- where mtc answers otherwise on purpose (docs/reference.md: Orbax's own tests) ----------


def test_what_orbax_refuses_or_hides_that_mtc_answers(ramdisk: Path, mesh: Mesh) -> None:
    """Each a failing case of Orbax's checkpoint_manager_test, pinned: mtc lists the
    hosts' steps at every call (no reload() needed to see another manager's save);
    a fresh manager knows a step's items (metadata and Composite(item=None) restores
    need no restore first); mtc's own restore(step, target) restores the part of the
    tree a target names (Orbax's args want partial_restore=True for that: the case
    a_target_leaving_out_saved_leaves); a placeholder standing for a subtree is a
    ValueError."""
    make = mtc_maker(ramdisk, mesh)
    with make("a", item_names=("state", "extra")) as first:
        first.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave(state(mesh, 1)),
                                              extra=ocp.args.JsonSave({"n": 1})))
        first.wait_until_finished()
        with make("a", item_names=("state", "extra")) as second:
            second.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state(mesh, 2)),
                                                   extra=ocp.args.JsonSave({"n": 2})))
            second.wait_until_finished()
            assert first.all_steps() == [0, 1]  # Orbax: [0] until first.reload()
    with make("a") as fresh:
        assert sorted(fresh.metadata(0).item_metadata) == ["extra", "state"]  # Orbax: None
        only = fresh.restore(0, args=ocp.args.Composite(extra=None))  # Orbax: ValueError
        assert only.extra == {"n": 1} and "state" not in only
    with make("b") as mgr:
        tree = {"a": state(mesh, 1)["w"], "c": {"d": state(mesh, 2)["w"]}}
        mgr.save(0, args=ocp.args.PyTreeSave(tree))
        mgr.wait_until_finished()
        part = mgr.restore(0, {"a": state(mesh, 0)["w"]})  # mtc's call, not Orbax's args
        assert values(part) == values({"a": tree["a"]})
        with pytest.raises(ValueError, match="User-provided restore item and on-disk value"):
            mgr.restore(0, args=ocp.args.PyTreeRestore({"a": ..., "c": ...}))


def test_what_mtc_keeps_or_raises_otherwise_than_orbax(ramdisk: Path, mesh: Mesh) -> None:
    """max_to_keep=0 keeps what keep_period keeps and the newest complete step, which
    mtc never deletes (the one a restore after a failure needs; Orbax keeps none);
    a forced save of a step in flight raises mtc's StepExistsError, a ValueError and,
    Orbax being loaded, Orbax's own StepAlreadyExistsError too."""
    with mtc_maker(ramdisk, mesh)("zero", max_to_keep=0, keep_period=3) as mgr:
        for s in range(8):
            assert mgr.save(s, args=ocp.args.StandardSave(state(mesh, s)))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 3, 6, 7]  # Orbax: [0, 3, 6]
    with mtc_maker(ramdisk, mesh)("a") as mgr:
        mgr.save(0, args=ocp.args.StandardSave(state(mesh, 1)))
        with pytest.raises(mtc.StepExistsError) as e:
            mgr.save(0, args=ocp.args.StandardSave(state(mesh, 1)), force=True)
        assert isinstance(e.value, ValueError)
        assert isinstance(e.value, ocp.checkpoint_manager.StepAlreadyExistsError)
        assert e.value.step == 0 and "step 0" in str(e.value)
        mgr.wait_until_finished()
