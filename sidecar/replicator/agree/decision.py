"""The restore agreement's decision, as pure functions of what the members hold (the
protocol and its invariant: ``docs/agreement.md``; the coordinator that gathers
the holdings and records the decision: :mod:`.agreement`).

Tested alone, as tables (``tests/test_agreement.py``): :func:`decide` (the step
from every member's holdings, or a typed "cannot decide"), :func:`newest_complete`,
:func:`gc_keeps` (the steps garbage collection leaves), :func:`missing_asks`
(whether an epoch can form) and :func:`supersedes` (which of a rank's asks the
coordinator keeps).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

from mtc.errors import ConfigError
from mtc.sidecar.replicator.agree.attest import Said, unattested
from mtc.sidecar.replicator.agree.book import Decision


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one member reports: complete copies it holds and the backed-up steps."""

    copies: frozenset[tuple[int, int]]  # (origin rank, step)
    backed_up: frozenset[int] = frozenset()
    last: Decision | None = None  # the newest decision this member has read
    saved_hosts: frozenset[tuple[int, int]] = frozenset()  # (step, hosts that saved it)
    # (origin rank, step, run, hosts that saved it) of the copies whose manifest
    # names a run: the copies of one step may be of different runs, and only one
    # run's bytes make a step. A copy not listed here is of run "" (an Orbax step,
    # one saved before runs were recorded) and counts ``saved_hosts``.
    runs: frozenset[tuple[int, int, str, int]] = frozenset()
    # (step, run, ranks) of the copies whose manifest states the saving hosts' ranks
    # (a job that came back on other hosts than 0..n-1 saved it): those ranks' data
    # makes the step, not ranks 0..n-1.
    saving: frozenset[tuple[int, str, tuple[int, ...]]] = frozenset()
    # Who said which hosts saved which step (:mod:`.attest`): under mutual TLS a
    # step counts only as far as the saving hosts' own words carry it.
    said: frozenset[Said] = frozenset()


@dataclasses.dataclass(frozen=True)
class Decided:
    step: int  # -1: nothing restorable anywhere
    run: str = ""  # the run whose bytes make the step ("": not recorded, or the backup's)
    lost: str = ""  # with -1 while members hold data: which ranks' data is gone


@dataclasses.dataclass(frozen=True)
class CannotDecide:
    reason: str
    missing: tuple[int, ...] = ()


def _held_runs(holdings: Mapping[int, Holding]) -> dict[tuple[int, int], dict[str, set[int]]]:
    """(origin, step) -> run -> the members holding a copy of it of that run."""
    held: dict[tuple[int, int], dict[str, set[int]]] = {}
    for member, h in holdings.items():
        named = {(o, s): r for o, s, r, _ in h.runs}
        for c in h.copies:
            held.setdefault(c, {}).setdefault(named.get(c, ""), set()).add(member)
    return held


def _holders(held: Mapping[tuple[int, int], Mapping[str, set[int]]], step: int, run: str,
             origins: Sequence[int]) -> set[int]:
    """The members holding ``step`` of ``run`` of any of ``origins`` (a rank and the
    ranks whose data stands in for it)."""
    return {m for o in origins for m in held.get((o, step), {}).get(run, ())}


def saving_ranks(step: int, holdings: Mapping[int, Holding], num_nodes: int,
                 run: str = "") -> Sequence[int]:
    """The ranks whose data ``step`` of ``run`` needs: those that saved it, as its
    copies' manifests state (their ranks, or the most hosts any copy states: never
    fewer than saved); every node's when none states it (an Orbax step)."""
    for h in holdings.values():
        for s, r, ranks in h.saving:
            if s == step and r == run and ranks:
                return ranks
    stated = [n for h in holdings.values() for _, s, r, n in h.runs
              if s == step and r == run and n > 0]
    if not run:
        stated += [n for h in holdings.values() for s, n in h.saved_hosts if s == step and n > 0]
    return range(max(stated) if stated else num_nodes)


def refused(holdings: Mapping[int, Holding], members: Collection[int]
            ) -> dict[tuple[int, str], str]:
    """(step, run) -> why, for the steps whose saving set the saving hosts' own
    words do not carry for ``members`` (:func:`.attest.unattested`): under mutual
    TLS, a step never restorable on one host's word."""
    return unattested((x for h in holdings.values() for x in h.said), members)


def newest_complete_run(holdings: Mapping[int, Holding], num_nodes: int,
                        equivalent: Callable[[int], Sequence[int]], *,
                        hosts: int = 1, skip: Collection[tuple[int, str]] = ()
                        ) -> tuple[int, str]:
    """The newest step, and its run, whose data of that one run is held (on hosts,
    not in backup) for every rank that saved it (``num_nodes`` ranks, or fewer when
    a smaller job saved it), each rank's by at least ``hosts`` members (2: the step
    survives losing any one host); (-1, "") when none. Copies of one step written
    by different runs never complete each other. ``skip``: (step, run) that do not
    count (:func:`refused`)."""
    held = _held_runs(holdings)
    for s in sorted({s for _, s in held}, reverse=True):
        for run in sorted({r for (_, t), rs in held.items() if t == s for r in rs}):
            if (s, run) not in skip and all(len(_holders(held, s, run, equivalent(r))) >= hosts
                   for r in saving_ranks(s, holdings, num_nodes, run)):
                return s, run
    return -1, ""


def newest_complete(holdings: Mapping[int, Holding], num_nodes: int,
                    equivalent: Callable[[int], Sequence[int]], *, hosts: int = 1,
                    skip: Collection[tuple[int, str]] = ()) -> int:
    """The step of :func:`newest_complete_run`."""
    return newest_complete_run(holdings, num_nodes, equivalent, hosts=hosts, skip=skip)[0]


def gc_keeps(holdings: Mapping[int, Holding], num_nodes: int,
             equivalent: Callable[[int], Sequence[int]], *, signed: bool = False
             ) -> frozenset[int]:
    """The steps no replicator may delete, whatever its own retention says: the
    newest complete one (a restore's choice now) and the newest one every rank's
    data of which is on two hosts or more (the choice once any one host is lost:
    a host whose newest step has not reached its peer yet leaves every other host's
    newer steps incomplete without it). ``signed`` (mutual TLS): only steps the
    saving hosts' words carry for every node (:func:`refused`) count."""
    skip = refused(holdings, range(num_nodes)) if signed else {}
    steps = {newest_complete(holdings, num_nodes, equivalent, skip=skip),
             newest_complete(holdings, num_nodes, equivalent, hosts=2, skip=skip)}
    return frozenset(steps - {-1})


def describe_loss(holdings: Mapping[int, Holding], num_nodes: int,
                  equivalent: Callable[[int], Sequence[int]], *, newest: int = 3) -> str:
    """Why no step is complete while members hold data: per newest step held
    anywhere, the ranks whose data of it no member holds. "" when nothing is held."""
    held = _held_runs(holdings)
    lines = []
    for s in sorted({s for _, s in held}, reverse=True)[:newest]:
        runs = sorted({r for (_, t), rs in held.items() if t == s for r in rs})
        for run in runs:
            gone = [r for r in saving_ranks(s, holdings, num_nodes, run)
                    if not any(run in held.get((o, s), ()) for o in equivalent(r))]
            holders = sorted(o for (o, t), rs in held.items() if t == s and run in rs)
            lines.append(f"step {s}{f' (run {run})' if len(runs) > 1 else ''}: data of "
                         f"rank(s) {gone} is on no member and not in the backup "
                         f"(rank(s) {holders} still hold theirs)")
    return "; ".join(lines)


def decide(holdings: Mapping[int, Holding], members: Collection[int],
           equivalent: Callable[[int], Sequence[int]],
           num_nodes: int | None = None, *, signed: bool = False) -> Decided | CannotDecide:
    """The step every member restores: the newest one each saving rank's data
    exists for (held by a member, or in the backup). ``members`` is the job's
    membership as the job stated it, possibly fewer than the ``num_nodes`` that
    saved (a job that came back smaller: the data of the ranks gone must then be
    held by members). Never on a partial view: every member must have answered,
    or the answer is :class:`CannotDecide` naming who is missing. ``signed``
    (mutual TLS): a step counts only as far as its saving hosts' own words carry
    it for every member (:func:`refused`): never on one host's word."""
    missing = tuple(sorted(set(members) - set(holdings)))
    if missing:
        return CannotDecide(f"no inventory from rank(s) {list(missing)}", missing)
    extra = sorted(set(holdings) - set(members))
    if extra:
        return CannotDecide(f"inventory from rank(s) {extra} outside the membership")
    backed = max((s for h in holdings.values() for s in h.backed_up), default=-1)
    n = len(members) if num_nodes is None else num_nodes
    skip = refused(holdings, members) if signed else {}
    step, run = newest_complete_run(holdings, n, equivalent, skip=skip)
    if backed > step:
        return Decided(backed)  # the backup's run: its hosts' manifests say (checked on load)
    if step < 0:
        return Decided(-1, lost=describe_loss(holdings, n, equivalent))
    return Decided(step, run)


def check_members(members: Sequence[int], num_nodes: int, rank: int | None = None
                  ) -> tuple[int, ...]:
    """A stated membership, validated: distinct ranks among the ``num_nodes``
    (``rank``, the asker, one of them); empty means every node. Raises
    :class:`ConfigError` naming what is wrong: a membership is never guessed."""
    got = tuple(sorted(members)) if members else tuple(range(num_nodes))
    if len(set(got)) != len(got):
        raise ConfigError(f"membership {list(members)} names a rank twice")
    outside = [m for m in got if not 0 <= m < num_nodes]
    if outside:
        raise ConfigError(f"membership {list(members)}: rank(s) {outside} are not among the "
                          f"replicators' {num_nodes} nodes (0..{num_nodes - 1})")
    if rank is not None and rank not in got:
        raise ConfigError(f"rank {rank} asked with membership {list(got)}, which does not "
                          f"include it: state each host's replicator rank "
                          f"(Options.replicator_ranks)")
    return got


def missing_asks(asks: Mapping[int, float], members: Collection[int], now: float
                 ) -> tuple[int, ...]:
    """The members without a live ask (``asks``: rank -> when its ask's lease ends).
    An epoch forms only when this is empty: every member asked, and none of those
    asks has outlived its asker's deadline."""
    return tuple(sorted(m for m in members if asks.get(m, -1.0) <= now))


class Ask(NamedTuple):
    """A rank's ask for a decision, as the coordinator holds it."""
    rid: str
    lease_end: float  # monotonic: the asker's deadline
    started_ns: int = 0  # when the asker started this restore (its wall clock); 0: unknown


def supersedes(new: Ask, held: Ask | None, now: float) -> bool:
    """Whether ``new`` takes the place of its rank's ``held`` ask (one ask per rank).
    It does unless ``held`` is live, of another restore, and started later: then
    ``new`` is a retry of an abandoned restore that arrived late (held up by a
    partition) and must not push the newer restore out. An ask without a start time
    goes by arrival."""
    if held is None or held.rid == new.rid or held.lease_end <= now:
        return True
    return not (new.started_ns and held.started_ns and new.started_ns < held.started_ns)
