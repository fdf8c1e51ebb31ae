"""Garbage collection: its policy, pure (:func:`gc_plan`: which own steps and peer
copies a replicator deletes), and the pass that gathers its inputs and acts on
the plan (:func:`collect_garbage`, on the replication loop's thread)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtc.sidecar.replicator.metrics import Metrics
    from mtc.sidecar.replicator.replication import Replication
    from mtc.sidecar.replicator.store import LocalStore


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
    needs_coordinator: bool = False  # call again with the coordinator's kept steps


def gc_plan(x: GcInputs, kept: Collection[int] | None) -> GcPlan:
    """What to delete: own steps beyond the newest ``keep``, except the newest fully
    replicated one, busy ones (all, until every target was read once after a
    start) and the steps the coordinator keeps (``kept``: agreement.gc_keeps, the
    newest complete step and the newest one on two hosts); copies beyond the newest
    ``keep`` per origin, except those steps. Anything to delete needs ``kept``."""
    protected = set(x.own[-x.keep:]) | set(x.replicated[-1:]) | x.busy
    if not x.synced:
        protected |= set(x.own)  # the newest replicated step is not known yet
    own = [s for s in x.own if s not in protected]
    reps = [(o, s) for o, steps in x.replicas.items() for s in steps[:-x.keep]
            if o != x.rank or (s not in x.linked and s not in protected)]
    if not own and not reps:
        return GcPlan()
    if kept is None:
        return GcPlan(needs_coordinator=True)
    return GcPlan(tuple(s for s in own if s not in kept),
                  tuple((o, s) for o, s in reps if s not in kept))


def collect_garbage(store: LocalStore, replication: Replication, *, keep: int,
                    busy: set[int], coordinator_keeps: Callable[[], frozenset[int] | None],
                    metrics: Metrics) -> None:
    """One pass: what :func:`gc_plan` says of this host's steps, removed.
    ``busy``: steps being backed up; ``coordinator_keeps``: the coordinator's view
    (asked only when something would be deleted)."""
    rank = replication.rank
    own = store.own_steps()
    replicas = store.replica_steps()
    args = GcInputs(
        own=tuple(own), replicated=tuple(s for s in own if replication.fully_replicated(s)),
        replicas={o: tuple(v) for o, v in replicas.items()}, keep=keep,
        busy=frozenset(busy | replication.busy()), synced=replication.synced(),
        linked=frozenset(s for s in replicas.get(rank, [])
                         if (store.root / str(s)).is_symlink()),
        rank=rank)
    plan = gc_plan(args, None)
    if plan.needs_coordinator:
        # Local rules cannot see that another host failed to commit or replicate a
        # newer step: never delete the newest step every rank can still be restored
        # from, nor the newest one that survives losing any host, as the coordinator
        # sees them after this question.
        kept = coordinator_keeps()
        if kept is None:
            metrics.skipped.labels("gc_no_complete_view").inc()
            return
        plan = gc_plan(args, kept)
    for s in plan.own:
        store.remove_copy(rank, s)
        replication.forget(s)
    for origin, s in plan.replicas:
        store.remove_copy(origin, s)
