"""The cases of tests/test_orbax_side_by_side.py about items, arguments and
metadata: composites, item handlers, legacy forms, targets, refusals, the step
statistics logger and the attributes Orbax code reads (each a function of a
manager factory returning what an Orbax user saw)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from side_by_side_steps import Make, kind, state, values


def composite_without_args(make: Make, mesh: Mesh) -> list[Any]:
    """Item 2: restore(step) of a step saved as a Composite gives a Composite."""
    with make("a") as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state(mesh, 1)),
                                            meta=ocp.args.JsonSave({"lr": 0.5})))
        mgr.wait_until_finished()
        r = mgr.restore(1)
        return [kind(r), sorted(r.keys()), values(r.state), r.meta, kind(r.state["w"])]


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
