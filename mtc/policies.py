"""Orbax's policy objects, read by mtc as pure functions.

An Orbax user passes ``Options(preservation_policy=...)`` (which committed steps
retention keeps) and ``Options(save_decision_policy=...)`` (which steps ``save``
writes) with the objects of ``orbax.checkpoint.checkpoint_managers`` they know:
``LatestN``, ``EveryNSteps``, ``EveryNStepsClosest``, ``EveryNSeconds``,
``LatestDuration``, ``CustomSteps``, ``BestN``, ``PreserveAll``,
``AnyPreservationPolicy``; ``FixedIntervalPolicy``, ``SpecificStepsPolicy``,
``ContinuousCheckpointingPolicy``, ``PreemptionCheckpointingPolicy``,
``InitialSavePolicy``, ``AnySavePolicy``. mtc never calls their methods (Orbax's
continuous policy talks to JAX's coordination service itself); it recognises
each by its class name, as :mod:`mtc.orbax_args` does, reads its fields, and
decides here with the same meaning. Anything else is a ``ConfigError`` naming
what is accepted. Tested alone: ``tests/test_orbax_policies.py``.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any

from mtc.errors import ConfigError

PRESERVATION = ("PreserveAll", "LatestN", "EveryNSteps", "EveryNStepsClosest", "EveryNSeconds",
                "LatestDuration", "CustomSteps", "BestN", "AnyPreservationPolicy")
SAVE_DECISION = ("FixedIntervalPolicy", "SpecificStepsPolicy", "ContinuousCheckpointingPolicy",
                 "PreemptionCheckpointingPolicy", "InitialSavePolicy", "AnySavePolicy")


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a policy knows of a committed step: its number, its ``metrics`` (None:
    saved without), and when it was saved (seconds since the epoch; None: unknown,
    a step saved before mtc recorded it)."""

    step: int
    metrics: Any = None
    time: float | None = None


def _name(policy: Any) -> str:
    return type(policy).__name__


def check(policy: Any, kinds: Sequence[str], option: str) -> None:
    """Raise ConfigError unless ``policy`` (and every policy it combines) is one of ``kinds``."""
    if _name(policy) not in kinds:
        raise ConfigError(f"{option} {_name(policy)} is not one mtc reads; it takes Orbax's "
                          f"{', '.join(kinds)} (orbax.checkpoint.checkpoint_managers)")
    for inner in getattr(policy, "policies", None) or ():
        check(inner, kinds, option)


def _cap(flags: list[bool], max_to_keep: int | None) -> list[bool]:
    """Of the steps ``flags`` keeps, only the newest ``max_to_keep``."""
    if max_to_keep is None:
        return flags
    kept = [i for i, f in enumerate(flags) if f]
    dropped = set(kept[:-max_to_keep]) if max_to_keep else set(kept)
    return [f and i not in dropped for i, f in enumerate(flags)]


def _every_n_steps(steps: Sequence[StepInfo], n: int, exact: bool) -> list[bool]:
    if exact:
        return [s.step % n == 0 for s in steps]
    flags, last = [], None
    for s in steps:
        keep = last is None or s.step - last >= n
        flags.append(keep)
        last = s.step if keep else last
    return flags


def _closest(steps: Sequence[StepInfo], n: int) -> list[bool]:
    """Per multiple k*n, the step nearest it (the newer on a tie); the newest always."""
    best: dict[int, tuple[int, int]] = {}  # k -> (distance, index)
    for i, s in enumerate(steps):
        k = round(s.step / n)
        d = abs(s.step - k * n)
        if k not in best or d <= best[k][0]:
            best[k] = (d, i)
    keep = {i for _, i in best.values()} | ({len(steps) - 1} if steps else set())
    return [i in keep for i in range(len(steps))]


def _every_n_seconds(steps: Sequence[StepInfo], seconds: float) -> list[bool]:
    """The first step, then each one at least ``seconds`` after the last kept; a step
    of unknown time is kept and counts from then on as unknown (nothing is dropped
    on a time nobody recorded)."""
    flags: list[bool] = []
    last: float | None = None
    for s in steps:
        keep = not flags or s.time is None or last is None or s.time - last >= seconds
        flags.append(keep)
        if keep:
            last = s.time
    return flags


def _best(steps: Sequence[StepInfo], policy: Any) -> list[bool]:
    n = policy.n
    if n is None or len(steps) <= n:
        return [True] * len(steps)
    rated = sorted((i for i, s in enumerate(steps) if s.metrics is not None),
                   key=lambda i: policy.get_metric_fn(steps[i].metrics),
                   reverse=bool(policy.reverse))
    keep = set(rated[len(rated) - n:]) if n else set()
    if policy.keep_checkpoints_without_metrics:
        keep |= {i for i, s in enumerate(steps) if s.metrics is None}
    return [i in keep for i in range(len(steps))]


def preserved(policy: Any, steps: Sequence[StepInfo], *, now: float) -> list[bool]:
    """Which of ``steps`` (committed, oldest first) ``policy`` keeps, as Orbax's
    ``should_preserve`` answers; ``now``: the time, for ``LatestDuration``."""
    name = _name(policy)
    if name == "PreserveAll":
        return [True] * len(steps)
    if name == "LatestN":
        n = policy.n
        return [n is None or i >= len(steps) - n for i in range(len(steps))]
    if name in ("EveryNSteps", "EveryNStepsClosest"):
        if not policy.interval_steps:
            raise ConfigError(f"{name}.interval_steps must not be 0")
        flags = (_closest(steps, policy.interval_steps) if name == "EveryNStepsClosest"
                 else _every_n_steps(steps, policy.interval_steps, policy.exact_interval))
        return _cap(flags, policy.max_to_keep)
    if name == "EveryNSeconds":
        return _every_n_seconds(steps, float(policy.interval_secs))
    if name == "LatestDuration":
        span = policy.duration.total_seconds() if isinstance(
            policy.duration, datetime.timedelta) else float(policy.duration)
        first = next((i for i, s in enumerate(steps)
                      if s.time is None or now - s.time <= span), len(steps))
        return [i >= first for i in range(len(steps))]
    if name == "CustomSteps":
        # Orbax keeps CustomSteps' steps in a private set (its field is init-only).
        wanted = set(getattr(policy, "_steps_set", None) or getattr(policy, "steps", None) or ())
        return [s.step in wanted for s in steps]
    if name == "BestN":
        return _best(steps, policy)
    if name == "AnyPreservationPolicy":
        every = [preserved(p, steps, now=now) for p in policy.policies]
        return [any(flags[i] for flags in every) for i in range(len(steps))]
    raise ConfigError(f"preservation_policy {name} is not one mtc reads")


def uses_metrics(policy: Any) -> bool:
    """Whether ``policy`` (or one it combines) ranks steps by their metrics."""
    return _name(policy) == "BestN" or any(
        uses_metrics(p) for p in getattr(policy, "policies", None) or ())


def uses_time(policy: Any) -> bool:
    """Whether ``policy`` (or one it combines) keeps steps by when they were saved."""
    return _name(policy) in ("EveryNSeconds", "LatestDuration") or any(
        uses_time(p) for p in getattr(policy, "policies", None) or ())


def schedule_uses_time(policy: Any) -> bool:
    """Whether the save schedule ``policy`` (or one it combines) asks when the newest
    step was saved (a ``ContinuousCheckpointingPolicy`` with a minimum interval)."""
    return (_name(policy) == "ContinuousCheckpointingPolicy"
            and getattr(policy, "minimum_interval_secs", None) is not None) or any(
        schedule_uses_time(p) for p in getattr(policy, "policies", None) or ())


def to_delete(policy: Any, steps: Sequence[StepInfo], *, now: float) -> list[int]:
    """The committed steps retention deletes under ``policy``: those it does not
    keep, but never the newest one (the step a restore loads now)."""
    flags = preserved(policy, steps, now=now)
    return [s.step for s, keep in zip(steps, flags, strict=True)
            if not keep and s is not steps[-1]]


def save_due(policy: Any, step: int, previous: Sequence[StepInfo], *, now: float,
             saving: bool, preempted: bool) -> bool:
    """Whether ``policy`` saves ``step``, as Orbax's ``should_save`` answers:
    ``previous``, the committed steps (oldest first); ``saving``, whether a save
    is still being written; ``preempted``, whether the job reached the
    preemption sync point at ``step``."""
    name = _name(policy)
    if name == "FixedIntervalPolicy":
        return step % policy.interval == 0
    if name == "SpecificStepsPolicy":
        return step in policy.steps
    if name == "ContinuousCheckpointingPolicy":
        if saving:
            return False
        gap = policy.minimum_interval_secs
        last = previous[-1].time if previous else None
        return gap is None or last is None or now - last >= gap
    if name == "PreemptionCheckpointingPolicy":
        return preempted
    if name == "InitialSavePolicy":
        return not previous
    if name == "AnySavePolicy":
        return any(save_due(p, step, previous, now=now, saving=saving, preempted=preempted)
                   for p in policy.policies)
    raise ConfigError(f"save_decision_policy {name} is not one mtc reads")


# -- Orbax's retention options as the policy Orbax makes of them ----------------------
# mtc's own objects of the names :func:`preserved` reads (Orbax's own need not be
# installed).


@dataclasses.dataclass(frozen=True)
class LatestN:
    n: int | None


@dataclasses.dataclass(frozen=True)
class EveryNSteps:
    interval_steps: int
    exact_interval: bool = True
    max_to_keep: int | None = None


@dataclasses.dataclass(frozen=True)
class EveryNSeconds:
    interval_secs: float


@dataclasses.dataclass(frozen=True)
class BestN:
    get_metric_fn: Any
    reverse: bool
    n: int | None
    keep_checkpoints_without_metrics: bool = True


@dataclasses.dataclass(frozen=True)
class AnyPreservationPolicy:
    policies: tuple[Any, ...]


def from_options(*, max_to_keep: int | None, keep_period: int | None,
                 keep_time_interval_s: float | None, best_fn: Any = None,
                 best_mode: str = "max", keep_without_metrics: bool = True) -> Any:
    """The policy Orbax makes of its retention options (``max_to_keep``,
    ``keep_period``, ``keep_time_interval``, ``best_fn``): a step stays when any of
    them keeps it."""
    kept: list[Any] = []
    if keep_period is not None:
        kept.append(EveryNSteps(keep_period))
    if keep_time_interval_s is not None:
        kept.append(EveryNSeconds(keep_time_interval_s))
    if best_fn is not None:
        kept.append(BestN(best_fn, best_mode == "min", max_to_keep, keep_without_metrics))
    else:
        kept.append(LatestN(max_to_keep))
    return AnyPreservationPolicy(tuple(kept))
