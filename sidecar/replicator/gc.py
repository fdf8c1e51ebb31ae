"""Garbage collection's policy, pure: which own steps and peer copies a replicator
deletes (:func:`gc_plan`); ``Node.collect_garbage`` gathers its inputs and acts on
the plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class GcInputs:
    own: tuple[int, ...]                     # own committed steps, oldest first
    replicated: tuple[int, ...]              # those on every target
    replicas: Mapping[int, tuple[int, ...]]  # origin -> copies held (own: parked steps)
    keep: int
    busy: frozenset[int]                     # being pushed or backed up
    synced: bool                             # every target's holdings read since start
    linked: frozenset[int]                   # parked own steps a client still links to
    rank: int


@dataclasses.dataclass(frozen=True)
class GcPlan:
    own: tuple[int, ...] = ()
    replicas: tuple[tuple[int, int], ...] = ()
    needs_complete: bool = False  # call again with the newest complete step


def gc_plan(x: GcInputs, complete: int | None) -> GcPlan:
    """What to delete: own steps beyond the newest ``keep``, except the newest fully
    replicated one, busy ones (all, until every target was read once after a
    start) and the newest complete step; copies beyond the newest ``keep`` per
    origin, except the complete step. Anything to delete needs ``complete``."""
    protected = set(x.own[-x.keep:]) | set(x.replicated[-1:]) | x.busy
    if not x.synced:
        protected |= set(x.own)  # the newest replicated step is not known yet
    own = [s for s in x.own if s not in protected]
    reps = [(o, s) for o, steps in x.replicas.items() for s in steps[:-x.keep]
            if o != x.rank or (s not in x.linked and s not in protected)]
    if not own and not reps:
        return GcPlan()
    if complete is None:
        return GcPlan(needs_complete=True)
    return GcPlan(tuple(s for s in own if s != complete),
                  tuple((o, s) for o, s in reps if s != complete))
