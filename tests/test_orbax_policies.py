"""Orbax's preservation and save-decision policies, read by mtc (mtc.policies).

Table tests of the pure functions, each case also asked of Orbax's own policy
object where its answer is pure (real orbax-checkpoint): the two must agree.
Then the manager: Options(preservation_policy=..., save_decision_policy=...)
side by side with Orbax's CheckpointManager.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint import checkpoint_managers as cm

import mtc
from mtc import policies
from mtc.policies import StepInfo

NOW = 1_000_000.0


@dataclasses.dataclass
class OrbaxInfo:
    """Orbax's PolicyCheckpointInfo protocol, for asking its policies."""

    step: int
    metrics: Any
    time: datetime.datetime


def infos(steps: list[int], *, metrics: dict[int, Any] | None = None,
          times: dict[int, float] | None = None) -> list[StepInfo]:
    return [StepInfo(s, (metrics or {}).get(s), (times or {}).get(s, NOW - 1000 + s))
            for s in steps]


def orbax_preserves(policy: Any, steps: list[StepInfo]) -> list[bool]:
    as_orbax = [OrbaxInfo(s.step, s.metrics, datetime.datetime.fromtimestamp(
        s.time or 0.0, tz=datetime.UTC)) for s in steps]
    return list(policy.should_preserve(as_orbax, context=cm.PreservationContext()))


LOSS = {1: {"loss": 0.9}, 2: {"loss": 0.1}, 3: {"loss": 0.5}, 5: {"loss": 0.3}}
STEPS = [1, 2, 3, 4, 5, 6, 8, 11]
# (name, policy, steps, kept)
PRESERVE: list[tuple[str, Any, list[StepInfo], list[int]]] = [
    ("all", cm.preservation_policy.PreserveAll(), infos(STEPS), STEPS),
    ("latest 3", cm.LatestN(3), infos(STEPS), [6, 8, 11]),
    ("latest None", cm.LatestN(None), infos(STEPS), STEPS),
    ("latest more than held", cm.LatestN(20), infos(STEPS), STEPS),
    ("every 2 steps, exact", cm.EveryNSteps(2), infos(STEPS), [2, 4, 6, 8]),
    ("every 3 steps, from the first kept", cm.EveryNSteps(3, exact_interval=False),
     infos(STEPS), [1, 4, 8, 11]),
    ("every 2 steps, newest 2 of them", cm.EveryNSteps(2, max_to_keep=2), infos(STEPS), [6, 8]),
    ("closest to multiples of 5, and the newest", cm.EveryNStepsClosest(5), infos(STEPS),
     [1, 5, 11]),
    ("closest, at most 2", cm.EveryNStepsClosest(5, max_to_keep=2), infos(STEPS), [5, 11]),
    ("custom steps", cm.CustomSteps([2, 5, 7]), infos(STEPS), [2, 5]),
    ("best 2, lowest loss first (reverse)", cm.BestN(get_metric_fn=lambda m: m["loss"],
                                                    reverse=True, n=2),
     infos([1, 2, 3, 4, 5], metrics=LOSS), [2, 4, 5]),
    ("best 2, highest; steps without metrics go",
     cm.BestN(get_metric_fn=lambda m: m["loss"], n=2, keep_checkpoints_without_metrics=False),
     infos([1, 2, 3, 4, 5], metrics=LOSS), [1, 3]),
    ("best 0", cm.BestN(get_metric_fn=lambda m: m["loss"], n=0),
     infos([1, 2, 3], metrics=LOSS), []),
    ("every 100 s", cm.EveryNSeconds(100),
     infos([1, 2, 3, 4], times={1: 0.0, 2: 50.0, 3: 120.0, 4: 219.0}), [1, 3]),
    ("any of latest 1 and custom 2", cm.AnyPreservationPolicy([cm.LatestN(1),
                                                               cm.CustomSteps([2])]),
     infos(STEPS), [2, 11]),
]


@pytest.mark.parametrize("name, policy, steps, kept", PRESERVE, ids=[c[0] for c in PRESERVE])
def test_preservation_as_orbax_reads_it(name: str, policy: Any, steps: list[StepInfo],
                                        kept: list[int]) -> None:
    flags = policies.preserved(policy, steps, now=NOW)
    assert [s.step for s, f in zip(steps, flags, strict=True) if f] == kept, name
    assert flags == orbax_preserves(policy, steps), name


def test_latest_duration_and_unknown_times_keep_rather_than_guess() -> None:
    recent = cm.LatestDuration(datetime.timedelta(seconds=100))
    steps = infos([1, 2, 3], times={1: NOW - 500, 2: NOW - 50, 3: NOW - 10})
    assert policies.preserved(recent, steps, now=NOW) == [False, True, True]
    # A step of unknown time (saved before mtc recorded it): kept, and all newer.
    unknown = [StepInfo(1, None, NOW - 500), StepInfo(2, None, None), StepInfo(3, None, NOW)]
    assert policies.preserved(recent, unknown, now=NOW) == [False, True, True]
    assert policies.preserved(cm.EveryNSeconds(100), unknown, now=NOW) == [True, True, True]


def test_retention_never_deletes_the_newest_step() -> None:
    steps = infos([1, 2, 3])
    assert policies.to_delete(cm.CustomSteps([1]), steps, now=NOW) == [2]
    assert policies.to_delete(cm.LatestN(2), steps, now=NOW) == [1]
    assert policies.to_delete(cm.preservation_policy.PreserveAll(), steps, now=NOW) == []


# (name, policy, step, previous, saving, preempted, due)
DECIDE: list[tuple[str, Any, int, list[StepInfo], bool, bool, bool]] = [
    ("interval: on it", cm.FixedIntervalPolicy(5), 10, infos([5]), False, False, True),
    ("interval: off it", cm.FixedIntervalPolicy(5), 11, infos([5]), False, False, False),
    ("specific: listed", cm.SpecificStepsPolicy([3, 7]), 7, [], False, False, True),
    ("specific: not listed", cm.SpecificStepsPolicy([3, 7]), 8, [], False, False, False),
    ("preemption: reached", cm.PreemptionCheckpointingPolicy(), 13, [], False, True, True),
    ("preemption: not reached", cm.PreemptionCheckpointingPolicy(), 13, [], False, False, False),
    ("initial: nothing saved yet", cm.InitialSavePolicy(), 13, [], False, False, True),
    ("initial: a step exists", cm.InitialSavePolicy(), 13, infos([5]), False, False, False),
    ("continuous: the last save finished", cm.ContinuousCheckpointingPolicy(), 4, infos([3]),
     False, False, True),
    ("continuous: a save is being written", cm.ContinuousCheckpointingPolicy(), 4, infos([3]),
     True, False, False),
    ("continuous: sooner than the minimum interval",
     cm.ContinuousCheckpointingPolicy(minimum_interval_secs=60), 4,
     [StepInfo(3, None, NOW - 30)], False, False, False),
    ("continuous: after the minimum interval",
     cm.ContinuousCheckpointingPolicy(minimum_interval_secs=60), 4,
     [StepInfo(3, None, NOW - 61)], False, False, True),
    ("continuous: last save's time unknown", cm.ContinuousCheckpointingPolicy(
        minimum_interval_secs=60), 4, [StepInfo(3, None, None)], False, False, True),
    ("any: interval or preemption", cm.AnySavePolicy([cm.FixedIntervalPolicy(10),
                                                      cm.PreemptionCheckpointingPolicy()]),
     13, infos([10]), False, True, True),
    ("any: neither", cm.AnySavePolicy([cm.FixedIntervalPolicy(10),
                                       cm.PreemptionCheckpointingPolicy()]),
     13, infos([10]), False, False, False),
]


@pytest.mark.parametrize("name, policy, step, previous, saving, preempted, due", DECIDE,
                         ids=[c[0] for c in DECIDE])
def test_save_decision_as_orbax_reads_it(name: str, policy: Any, step: int,
                                         previous: list[StepInfo], saving: bool,
                                         preempted: bool, due: bool) -> None:
    assert policies.save_due(policy, step, previous, now=NOW, saving=saving,
                             preempted=preempted) is due, name
    if type(policy).__name__ not in ("ContinuousCheckpointingPolicy", "AnySavePolicy"):
        # Pure in Orbax too (its continuous policy asks JAX's coordination service).
        context = cm.DecisionContext(is_saving_in_progress=saving, reached_preemption=preempted,
                                     multiprocessing_options=ocp.options.MultiprocessingOptions())
        as_orbax = [OrbaxInfo(s.step, s.metrics, datetime.datetime.fromtimestamp(
            s.time or 0.0, tz=datetime.UTC)) for s in previous]
        assert policy.should_save(OrbaxInfo(step, None, datetime.datetime.now(
            tz=datetime.UTC)), as_orbax, context=context) is due, name


def test_other_policies_are_refused_naming_what_is_read() -> None:
    with pytest.raises(mtc.ConfigError, match="LatestN"):
        mtc.Options(preservation_policy=object())
    with pytest.raises(mtc.ConfigError, match="FixedIntervalPolicy"):
        mtc.Options(save_decision_policy=cm.LatestN(2))
    with pytest.raises(mtc.ConfigError, match="preservation_policy"):
        mtc.Options(preservation_policy=cm.LatestN(2), max_to_keep=3)
    # Beside a save_decision_policy the interval is ignored, as Orbax ignores it.
    assert mtc.Options(save_decision_policy=cm.FixedIntervalPolicy(2),
                       save_interval_steps=3).save_decision_policy == cm.FixedIntervalPolicy(2)
    with pytest.raises(mtc.ConfigError, match="replicators"):
        mtc.Options(preservation_policy=cm.LatestN(2), replicators=("localhost:1",))


# -- the manager, side by side with Orbax's ---------------------------------------------


def test_the_manager_saves_and_keeps_as_orbax_does_with_the_same_policies(
        ramdisk: Path, tmp_path: Path, mesh: Mesh) -> None:
    state = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("model")))}
    kw: dict[str, Any] = dict(
        save_decision_policy=cm.AnySavePolicy([cm.FixedIntervalPolicy(3),
                                               cm.SpecificStepsPolicy([4]),
                                               cm.InitialSavePolicy()]),
        preservation_policy=cm.AnyPreservationPolicy([cm.LatestN(2), cm.CustomSteps([3])]))
    steps = list(range(1, 14))
    with ocp.CheckpointManager(tmp_path / "orbax", options=ocp.CheckpointManagerOptions(
            **kw)) as orbax:
        want = [orbax.save(s, args=ocp.args.StandardSave(state)) for s in steps]
        orbax.wait_until_finished()
        want_steps = list(orbax.all_steps())
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=mtc.Options(
            simulated_hosts=4, dispatch="local", **kw)) as mgr:
        got = [mgr.save(s, args=ocp.args.StandardSave(state)) for s in steps]
        mgr.wait_until_finished()
        assert got == want
        assert mgr.all_steps() == want_steps == [3, 9, 12]


def test_continuous_checkpointing_saves_once_the_last_save_is_done_and_the_gap_passed(
        ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("model")))}
    options = mtc.Options(simulated_hosts=4, dispatch="local",
                          save_decision_policy=cm.ContinuousCheckpointingPolicy())
    with mtc.CheckpointManager(ramdisk / "a", mesh=mesh, options=options) as mgr:
        assert mgr.save(1, state)
        mgr.wait_until_finished()  # nothing being written: the next step saves
        assert mgr.save(2, state) and not mgr.save(2, state)  # not newer: never
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
    options = mtc.Options(simulated_hosts=4, dispatch="local", save_decision_policy=(
        cm.ContinuousCheckpointingPolicy(minimum_interval_secs=3600)))
    with mtc.CheckpointManager(ramdisk / "b", mesh=mesh, options=options) as mgr:
        assert mgr.save(1, state)  # no earlier save
        mgr.wait_until_finished()
        assert not mgr.save(2, state)  # an hour has not passed since step 1's save
        assert mgr.save(3, state, force=True)


@pytest.mark.parametrize(("best", "kept"), [
    (False, [0, 3, 6, 8, 9]),  # max_to_keep=2: the newest two and one each 3 hours
    (True, [0, 1, 2, 3, 6, 9]),  # max_to_keep=3 best by the lowest loss, and 3-hourly
], ids=["newest", "best_fn"])
def test_keep_time_interval_keeps_as_orbax_test_expects(ramdisk: Path, mesh: Mesh,
                                                       best: bool, kept: list[int]) -> None:
    """Orbax's own cases (checkpoint_manager_test's time interval tests): one save an
    hour, keep_time_interval=3h. The hours pass on the clock Orbax reads and its
    tests fake, ``datetime.datetime`` (mtc reads the time of a save there too)."""
    state = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("model")))}
    now = datetime.datetime.now(tz=datetime.UTC)
    extra: dict[str, Any] = ({"max_to_keep": 3, "best_fn": lambda m: m["loss"],
                              "best_mode": "min"} if best else {"max_to_keep": 2})
    with mock.patch("datetime.datetime", autospec=True) as dt, mtc.CheckpointManager(
            ramdisk, mesh=mesh, options=mtc.Options(
                simulated_hosts=4, dispatch="local",
                keep_time_interval=datetime.timedelta(hours=3), **extra)) as mgr:
        for s in range(10):
            dt.now.return_value = now
            assert mgr.save(s, args=ocp.args.StandardSave(state),
                            metrics={"loss": s} if best else None)
            now += datetime.timedelta(hours=1)
        mgr.wait_until_finished()
        assert mgr.all_steps() == kept


def test_keep_time_interval_knows_the_times_of_steps_saved_before_a_restart(
        ramdisk: Path, mesh: Mesh) -> None:
    """Orbax's restart case (checkpoint_manager_test's time interval test, whose new
    manager Orbax is told the earlier steps' times): mtc's new manager reads them from
    the steps' manifests, so retention goes on as if the job never stopped; a step
    of unknown time would stay for ever (8 here), filling the RAM disk restart by
    restart."""
    state = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("model")))}
    now = datetime.datetime.now(tz=datetime.UTC)
    options = mtc.Options(simulated_hosts=4, dispatch="local", max_to_keep=2,
                          keep_time_interval=datetime.timedelta(hours=3))
    with mock.patch("datetime.datetime", autospec=True) as dt:
        for first, steps, kept in ((True, range(10), [0, 3, 6, 8, 9]),
                                   (False, range(10, 20), [0, 3, 6, 9, 12, 15, 18, 19])):
            with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options) as mgr:
                for s in steps:
                    dt.now.return_value = now
                    assert mgr.save(s, args=ocp.args.StandardSave(state))
                    now += datetime.timedelta(hours=1)
                mgr.wait_until_finished()
                assert mgr.all_steps() == kept, "first run" if first else "after the restart"


def test_a_minimum_interval_counts_from_a_save_made_before_a_restart(
        ramdisk: Path, mesh: Mesh) -> None:
    """ContinuousCheckpointingPolicy(minimum_interval_secs): a restarted job's manager
    reads when the newest step was saved from its manifest, so the interval holds
    across the restart (Orbax reads it from its step metadata)."""
    state = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("model")))}
    now = datetime.datetime.now(tz=datetime.UTC)
    options = mtc.Options(simulated_hosts=4, dispatch="local", save_decision_policy=(
        cm.ContinuousCheckpointingPolicy(minimum_interval_secs=3600)))
    with mock.patch("datetime.datetime", autospec=True) as dt:
        dt.now.return_value = now
        with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options) as mgr:
            assert mgr.save(1, state)
        dt.now.return_value = now + datetime.timedelta(minutes=10)
        with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options) as mgr:
            assert not mgr.save(2, state)  # 10 minutes after step 1's save
            dt.now.return_value = now + datetime.timedelta(hours=2)
            assert mgr.save(3, state)
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 3]


@pytest.mark.parametrize(("policy", "keeps_by_time", "schedule_by_time"), [
    (cm.LatestN(2), False, False),
    (cm.EveryNSeconds(60), True, False),
    (cm.LatestDuration(datetime.timedelta(hours=1)), True, False),
    (cm.AnyPreservationPolicy([cm.LatestN(2), cm.EveryNSeconds(60)]), True, False),
    (policies.from_options(max_to_keep=2, keep_period=None, keep_time_interval_s=60.0),
     True, False),
    (cm.ContinuousCheckpointingPolicy(), False, False),
    (cm.ContinuousCheckpointingPolicy(minimum_interval_secs=5), False, True),
    (cm.AnySavePolicy([cm.FixedIntervalPolicy(3),
                       cm.ContinuousCheckpointingPolicy(minimum_interval_secs=5)]), False, True),
], ids=["LatestN", "EveryNSeconds", "LatestDuration", "Any of them", "keep_time_interval",
        "continuous", "continuous, a minimum interval", "Any save policy"])
def test_which_policies_read_the_steps_save_times(policy: Any, keeps_by_time: bool,
                                                  schedule_by_time: bool) -> None:
    """Only these read a step's save time (from its manifest, for a step saved before
    the manager): the others never read a manifest for it."""
    assert policies.uses_time(policy) is keeps_by_time
    assert policies.schedule_uses_time(policy) is schedule_by_time


def test_orbax_retention_options_as_the_policy_orbax_makes_of_them() -> None:
    policy = policies.from_options(max_to_keep=0, keep_period=3, keep_time_interval_s=5 * 3600)
    infos = [StepInfo(s, None, s * 3600.0) for s in range(9)]
    # Orbax's max_to_keep=0 case keeps [0, 3, 5, 6]; mtc never deletes the newest (8).
    assert policies.to_delete(policy, infos, now=9 * 3600.0) == [1, 2, 4, 7]
    with pytest.raises(mtc.ConfigError, match="preservation_policy replaces"):
        mtc.Options(preservation_policy=cm.LatestN(2), keep_time_interval=60)
    with pytest.raises(mtc.ConfigError, match="keep_time_interval is a positive"):
        mtc.Options(keep_time_interval=0)
