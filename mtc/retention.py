"""Which steps a host deletes: the retention policy, a pure function.

The manager applies it twice per save. Before a new step is written it keeps one
step fewer than ``max_to_keep`` (never fewer than the newest complete step), so
the RAM disk holds at most ``max(max_to_keep, 2)`` steps at any moment, the one
being written included; after a commit it keeps ``max_to_keep``. Steps that are
multiples of ``keep_period`` are never deleted (Orbax's ``keep_period``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any


def to_delete(complete: Sequence[int], held: Sequence[int], *, max_to_keep: int | None,
              keep_period: int | None = None, before_write: bool = False) -> list[int]:
    """Steps of ``held`` (one host's committed steps) to delete.

    ``complete`` are the steps committed on every host. Only steps older than the
    oldest kept complete step go, so a step committed on some hosts only (a
    failed or running save) never costs the newest complete step.
    """
    if max_to_keep is None or not complete:
        return []
    n = max(max_to_keep - 1, 1) if before_write else max_to_keep
    ordered = sorted(complete)
    if len(ordered) < n:
        return []
    oldest_kept = ordered[-n]
    return [s for s in sorted(held)
            if s < oldest_kept and not (keep_period and s % keep_period == 0)]


def best_to_delete(steps: Sequence[int], metrics: Mapping[int, Any], *,
                   max_to_keep: int | None, keep_period: int | None,
                   best_fn: Callable[[Any], float], best_mode: str = "max",
                   keep_without_metrics: bool = True) -> list[int]:
    """Steps to delete when steps are kept by quality (Orbax's ``best_fn``): of
    ``steps`` (complete, committed), the ``max_to_keep`` best by ``best_fn`` of
    their metrics stay (``best_mode`` "max": highest; "min": lowest; ties keep the
    newer), and so do multiples of ``keep_period`` and, with
    ``keep_without_metrics``, steps saved without metrics. Nothing goes while
    there are at most ``max_to_keep`` steps, or with ``max_to_keep`` None."""
    ordered = sorted(steps)
    if max_to_keep is None or len(ordered) <= max_to_keep:
        return []
    rated = [s for s in ordered if metrics.get(s) is not None]
    ranked = sorted(rated, key=lambda s: best_fn(metrics[s]), reverse=best_mode == "min")
    # max(0, ...): fewer rated steps than max_to_keep keeps them all (a negative
    # start would keep only the last few: a step deleted that Orbax keeps).
    keep = set(ranked[max(0, len(ranked) - max_to_keep):]) if max_to_keep else set()
    if keep_without_metrics:
        keep |= {s for s in ordered if metrics.get(s) is None}
    if keep_period:
        keep |= {s for s in ordered if s % keep_period == 0}
    return [s for s in ordered if s not in keep]
