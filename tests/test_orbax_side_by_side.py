"""An Orbax user's habits, each run against both libraries in one test (the cases:
tests/side_by_side_steps.py, steps; tests/side_by_side_items.py, items and metadata).

Every case is one function of a manager factory: it makes the calls an Orbax
user makes and returns what they saw (values and type names). The same case runs
on a real ``ocp.CheckpointManager`` and on ``mtc.CheckpointManager`` (simulated
hosts in this process), and the two answers must be equal: a difference is a
failing test, not a surprise. Where mtc answers differently on purpose, the
case says so and docs/reference.md's Orbax table names it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh
from side_by_side_items import (
    a_target_leaving_out_saved_leaves,
    array_items,
    composite_without_args,
    item_handlers_name_the_items_and_their_args,
    item_metadata_of_a_composite,
    legacy_items_and_restore_kwargs,
    legacy_single_item_restore_kwargs,
    metrics_of_a_missing_step,
    private_attributes_orbax_code_reads,
    refusals_as_orbax_raises_them,
    restore_args_without_an_item,
    restore_without_target_keeps_the_saved_sharding,
    root_and_step_metadata,
    root_metadata_not_kept,
    step_statistics_to_the_logger,
)
from side_by_side_steps import (
    Make,
    best_step,
    delete_and_reload,
    keep_time_interval_on_the_clock_orbax_reads,
    read_only_save_and_delete,
    reopened_manager,
    retention_and_keep_period,
    rollback,
    save_on_preemption,
    save_rules,
    save_schedule_options,
    second_manager_in_process,
    state,
    steps_right_after_an_async_save,
    values,
)

import mtc
from mtc.testing.waits import wait_until

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
