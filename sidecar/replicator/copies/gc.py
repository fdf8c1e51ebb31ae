"""Garbage collection: its policy, pure (:func:`gc_plan`: which own steps and peer
copies a replicator deletes), and the pass that gathers its inputs and acts on
the plan (:func:`collect_garbage`, on the replication loop's thread).

Bounded whatever fails: a replicator keeps its newest ``keep`` own steps (the
user's ``--keep``) and at most ``awaiting`` older ones (``--keep-awaiting``)
that replication or the coordinator's view still wants (being copied or backed
up, the newest step every rank can restore, the newest on two hosts, the newest
fully replicated, the candidates for it while a target has not answered); fewer
when the RAM disk would otherwise lack the room its next save and copies need.
A target nobody answers (a wrong address) or a coordinator that does not answer
therefore never fills the RAM disk (issue 56, item 7): they used to keep every step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from mtc import layout

if TYPE_CHECKING:
    from mtc.sidecar.replicator.copies.replication import Replication
    from mtc.sidecar.replicator.metrics import Metrics
    from mtc.sidecar.replicator.store.store import LocalStore


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
    awaiting: int = 2                        # older own steps kept beyond ``keep``, at most
    room: int = 0                            # bytes the RAM disk may still take now
    need: int = 0                            # bytes its next save and next copies take
    sizes: Mapping[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    # (origin, step) -> bytes of a held step or copy (own steps under this rank)


@dataclasses.dataclass(frozen=True)
class GcPlan:
    own: tuple[int, ...] = ()
    replicas: tuple[tuple[int, int], ...] = ()
    needs_coordinator: bool = False  # call again with the coordinator's kept steps
    # Of ``own`` and ``replicas``' steps, those the coordinator keeps or the newest fully
    # replicated, deleted for the bound or for room (logged: the price of a fault
    # elsewhere or of a small RAM disk; candidates standing in for an unknown view
    # are not counted).
    over: tuple[int, ...] = ()


def _wanted(x: GcInputs, kept: Collection[int] | None) -> list[int]:
    """The own steps older than the newest ``keep`` that are worth keeping, the most
    valuable first: busy ones, the coordinator's, the newest fully replicated, and
    (while a target's holdings or the coordinator's view are unknown) the newest
    older ones, one of which may be the newest on the target or complete."""
    older = x.own[:-x.keep] if len(x.own) > x.keep else ()
    order: list[int] = []
    for group in (sorted(x.busy, reverse=True), sorted(kept or (), reverse=True),
                  x.replicated[-1:],
                  reversed(older) if kept is None or not x.synced else ()):
        order += [s for s in group if s in older and s not in order]
    return order


def _plan(x: GcInputs, kept: Collection[int] | None) -> GcPlan:
    """The plan with the coordinator's ``kept`` steps, or without them (None: only
    what the bound and the room force; the newest older steps stand in for them)."""
    wanted = _wanted(x, kept)
    busy = [s for s in wanted if s in x.busy]
    extra = busy + [s for s in wanted if s not in x.busy][:max(0, x.awaiting - len(busy))]
    keeping = set(x.own[-x.keep:]) | set(extra)
    own = [s for s in x.own if s not in keeping]
    reps: list[tuple[int, int]] = []
    rep_extra: list[tuple[int, int]] = []  # copies beyond keep kept for now, oldest first
    for o, steps in x.replicas.items():
        spare = x.awaiting
        for s in reversed(steps[:-x.keep]):
            if o == x.rank and (s in x.linked or s in keeping):
                continue
            if (s in kept) if kept is not None else spare > 0:
                spare -= 1
                rep_extra.insert(0, (o, s))
            else:
                reps.append((o, s))
    reps.sort()
    # What was wanted for sure (not a candidate standing in for an unknown) and goes.
    sure = set(kept or ()) | set(x.replicated[-1:])
    over = [s for s in wanted if s not in extra and s in sure]
    # Room for the next save and copies comes before older steps: the least
    # valuable goes first, never a busy one (its bytes stay held while it is read).
    freed = sum(x.sizes.get((x.rank, s), 0) for s in own) + \
        sum(x.sizes.get(c, 0) for c in reps)
    droppable = [s for s in reversed(extra) if s not in x.busy]
    while x.room + freed < x.need and (droppable or rep_extra):
        if droppable:
            s = droppable.pop(0)
            own.append(s)
            freed += x.sizes.get((x.rank, s), 0)
        else:
            c = rep_extra.pop(0)
            reps.append(c)
            freed += x.sizes.get(c, 0)
            s = c[1]
        if s in sure:
            over.append(s)
    return GcPlan(tuple(sorted(own)), tuple(sorted(reps)), over=tuple(sorted(set(over))))


def gc_plan(x: GcInputs, kept: Collection[int] | None) -> GcPlan:
    """What to delete: own steps beyond the newest ``keep`` and ``awaiting`` more that
    are worth keeping (see :func:`_wanted`; the coordinator's ``kept``, agreement.gc_keeps:
    the newest complete step and the newest one on two hosts), fewer when the room
    falls short of the need; copies beyond the newest ``keep`` per origin, except
    the coordinator's steps. Without ``kept`` (None): what the bound and the room
    force, and ``needs_coordinator`` when more may go once the coordinator is asked."""
    if kept is not None:
        return _plan(x, kept)
    if _plan(x, frozenset()) == GcPlan():
        return GcPlan()  # nothing could go, whatever the coordinator keeps
    return dataclasses.replace(_plan(x, None), needs_coordinator=True)


def collect_garbage(store: LocalStore, replication: Replication, *, keep: int,
                    busy: set[int], coordinator_keeps: Callable[[], frozenset[int] | None],
                    metrics: Metrics, awaiting: int = 2,
                    room: Callable[[], int] = lambda: 0,
                    sizes_seen: dict[tuple[int, int], tuple[int, int]] | None = None) -> GcPlan:
    """One pass: what :func:`gc_plan` says of this host's steps, removed (the plan
    returned: the caller says what ``over`` cost).
    ``busy``: steps being backed up; ``coordinator_keeps``: the coordinator's view
    (asked only when something would be deleted); ``room``: the bytes the RAM disk
    may still take (the next save's and copies' need is the size of the newest own
    step and of each origin's newest copy); ``sizes_seen``: the caller's record of
    the held folders' sizes, kept from pass to pass."""
    rank = replication.rank
    own = store.own.steps()
    replicas = store.replica_steps()
    sizes = _sizes(store, rank, own, replicas, {} if sizes_seen is None else sizes_seen)
    need = sizes.get((rank, own[-1]), 0) if own else 0
    need += sum(sizes.get((o, v[-1]), 0) for o, v in replicas.items() if o != rank and v)
    args = GcInputs(
        own=tuple(own), replicated=tuple(s for s in own if replication.fully_replicated(s)),
        replicas={o: tuple(v) for o, v in replicas.items()}, keep=keep,
        busy=frozenset(busy | replication.busy()), synced=replication.synced(),
        linked=frozenset(s for s in replicas.get(rank, [])
                         if (store.root / str(s)).is_symlink()),
        rank=rank, awaiting=awaiting, room=room() if need else 0, need=need, sizes=sizes)
    plan = gc_plan(args, None)
    if plan.needs_coordinator:
        # Local rules cannot see that another host failed to commit or replicate a
        # newer step: never delete the newest step every rank can still be restored
        # from, nor the newest one that survives losing any host, as the coordinator
        # sees them after this question. Without its answer, only what the bound and
        # the room force goes (the newest older steps stand in for its choice).
        kept = coordinator_keeps()
        if kept is None:
            metrics.skipped.labels("gc_no_complete_view").inc()
        else:
            plan = gc_plan(args, kept)
    for s in plan.own:
        store.remove_copy(rank, s)
        replication.forget(s)
    for origin, s in plan.replicas:
        store.remove_copy(origin, s)
    return plan


def _sizes(store: LocalStore, rank: int, own: list[int], replicas: Mapping[int, list[int]],
           seen: dict[tuple[int, int], tuple[int, int]]) -> dict[tuple[int, int], int]:
    """Bytes of every held step and copy: their files' sizes (stat, never read),
    found once per folder (``seen``: (origin, step) -> (inode, bytes), pruned to
    what is held)."""
    out: dict[tuple[int, int], int] = {}
    for origin, steps in [(rank, own), *replicas.items()]:
        for s in steps:
            folder = store.copy_dir(origin, s)
            try:
                ino = os.stat(folder).st_ino
            except OSError:
                continue  # deleted meanwhile
            hit = seen.get((origin, s))
            if hit is None or hit[0] != ino:
                hit = seen[(origin, s)] = (ino, layout.folder_bytes(folder))
            out[(origin, s)] = hit[1]
    for key in seen.keys() - out.keys():
        del seen[key]
    return out
