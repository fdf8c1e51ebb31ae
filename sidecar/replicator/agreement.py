"""Restore agreement among replicators: one decider per restore epoch, a decision
recorded once and only read afterwards (the protocol and its invariant:
``docs/agreement.md``).

Pure parts, tested alone (``tests/test_agreement.py``): :func:`decide` (the step
from every member's holdings, or a typed "cannot decide"), :func:`newest_complete`,
:func:`gc_keeps` (the steps garbage collection leaves), :func:`missing_asks`
(whether an epoch can form) and :func:`supersedes` (which of a rank's asks the
coordinator keeps). The stateful parts take their transport as
a function, so the same code runs over gRPC in ``node_agreement.py`` and over an
in-memory transport in ``bench/control_plane.py``: :class:`Coordinator` (every
member asks, gather every member, decide once, recorded in a
:class:`~mtc.sidecar.replicator.book.Book`) and :class:`Fresh` (a value computed
by a gather that began after the caller asked, shared by every caller waiting).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple

from mtc.errors import AgreementError, ConfigError
from mtc.sidecar.replicator.book import Book, Decision, EpochRecord

log = logging.getLogger("mtc.sidecar.replicator.agreement")
# How soon an ask's waiting thread notices that its asker's call has ended.
ALIVE_CHECK_S = 0.5
# An ask waiting this long for members that have not asked has them asked whether
# their configuration disagrees with a peer's (a refusing member never asks), and
# again at most this often while it waits.
PROBE_S = 1.0
# A probe ends this long before its asker's deadline at the latest.
PROBE_MARGIN_S = 0.5


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


def newest_complete_run(holdings: Mapping[int, Holding], num_nodes: int,
                        equivalent: Callable[[int], Sequence[int]], *,
                        hosts: int = 1) -> tuple[int, str]:
    """The newest step, and its run, whose data of that one run is held (on hosts,
    not in backup) for every rank that saved it (``num_nodes`` ranks, or fewer when
    a smaller job saved it), each rank's by at least ``hosts`` members (2: the step
    survives losing any one host); (-1, "") when none. Copies of one step written
    by different runs never complete each other."""
    held = _held_runs(holdings)
    for s in sorted({s for _, s in held}, reverse=True):
        for run in sorted({r for (_, t), rs in held.items() if t == s for r in rs}):
            if all(len(_holders(held, s, run, equivalent(r))) >= hosts
                   for r in saving_ranks(s, holdings, num_nodes, run)):
                return s, run
    return -1, ""


def newest_complete(holdings: Mapping[int, Holding], num_nodes: int,
                    equivalent: Callable[[int], Sequence[int]], *, hosts: int = 1) -> int:
    """The step of :func:`newest_complete_run`."""
    return newest_complete_run(holdings, num_nodes, equivalent, hosts=hosts)[0]


def gc_keeps(holdings: Mapping[int, Holding], num_nodes: int,
             equivalent: Callable[[int], Sequence[int]]) -> frozenset[int]:
    """The steps no replicator may delete, whatever its own retention says: the
    newest complete one (a restore's choice now) and the newest one every rank's
    data of which is on two hosts or more (the choice once any one host is lost:
    a host whose newest step has not reached its peer yet leaves every other host's
    newer steps incomplete without it)."""
    steps = {newest_complete(holdings, num_nodes, equivalent),
             newest_complete(holdings, num_nodes, equivalent, hosts=2)}
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
           num_nodes: int | None = None) -> Decided | CannotDecide:
    """The step every member restores: the newest one each saving rank's data
    exists for (held by a member, or in the backup). ``members`` is the job's
    membership as the job stated it, possibly fewer than the ``num_nodes`` that
    saved (a job that came back smaller: the data of the ranks gone must then be
    held by members). Never on a partial view: every member must have answered,
    or the answer is :class:`CannotDecide` naming who is missing."""
    missing = tuple(sorted(set(members) - set(holdings)))
    if missing:
        return CannotDecide(f"no inventory from rank(s) {list(missing)}", missing)
    extra = sorted(set(holdings) - set(members))
    if extra:
        return CannotDecide(f"inventory from rank(s) {extra} outside the membership")
    backed = max((s for h in holdings.values() for s in h.backed_up), default=-1)
    n = len(members) if num_nodes is None else num_nodes
    step, run = newest_complete_run(holdings, n, equivalent)
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


# -- the decider ----------------------------------------------------------------------

Gather = Callable[[Sequence[int], float], dict[int, Holding]]


class Coordinator:
    """The one decider of a membership (its lowest rank runs it).

    A restore epoch forms when every member has a live ask (each ask holds a lease
    until its asker's deadline); the coordinator then gathers every member's
    holdings (asking again for the missing ones until the deadline; at once when
    all answered), records one decision for all those asks and answers them.
    ``gather(ranks, deadline)`` returns the holdings of those that answered before
    ``deadline`` (monotonic). ``_cond`` guards ``_asks``, ``_deciding``, ``_why``.
    """

    def __init__(self, members: Sequence[int], equivalent: Callable[[int], Sequence[int]],
                 gather: Gather, book: Book, *, retry_s: float = 0.05,
                 clock: Callable[[], float] = time.time, num_nodes: int | None = None,
                 faults: Callable[[Sequence[int], float], str] | None = None) -> None:
        self.members = list(members)
        # Ranks that may have saved: every node, when the membership is a smaller job's.
        self.num_nodes = len(self.members) if num_nodes is None else num_nodes
        self.equivalent = equivalent
        self.gather = gather
        self.book = book
        self.retry_s = retry_s
        self.clock = clock
        self._cond = threading.Condition()
        self._asks: dict[int, Ask] = {}  # rank -> its newest live ask
        self._deciding = False
        self._why = ""  # why the last attempt could not decide
        self._asked_at: dict[int, float] = {}  # rank -> its latest ask (for messages)
        self._closed = False
        # ``faults(ranks, seconds)``: how those members say, within the seconds, that
        # their configuration is wrong ("" when none does); its last answer, and
        # when it may be asked next (one at a time).
        self.faults = faults
        self._fault = ""
        self._probe_next = 0.0
        self._probing = False

    def close(self) -> None:
        """Shutting down: every waiting ask ends now, typed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.waiting_for: tuple[int, ...] = ()

    def decide_for(self, rank: int, rid: str, timeout_s: float,
                   started_ns: int = 0, alive: Callable[[], bool] | None = None
                   ) -> EpochRecord:
        """The decision of the epoch this ask belongs to; :class:`AgreementError` when
        none is recorded before ``timeout_s``, or at once when this rank's live ask is
        of a restore it started later (``started_ns``, see :func:`supersedes`).
        ``alive``: whether the asker still waits for this answer (its call is open);
        when it stops, this returns (typed) within ``ALIVE_CHECK_S``, and the ask
        keeps its lease until ``timeout_s``: the asker asks again with the same
        restore id, on a call of its own, and the epoch never missed it."""
        deadline = time.monotonic() + timeout_s
        rid = rid or f"anon-{uuid.uuid4().hex}"
        with self._cond:
            rec = self._find(rid, rank)
            if rec is not None:
                return rec  # a re-issued ask of a decided epoch
            ask = Ask(rid, deadline, started_ns)
            if not supersedes(ask, self._asks.get(rank), time.monotonic()):
                raise AgreementError("a late ask of an older restore of this rank: the "
                                     "rank has since started a newer one", host=rank)
            self._asks[rank] = ask
            self._asked_at[rank] = time.monotonic()
            while True:
                rec = self._find(rid, rank)
                if rec is not None:
                    return rec
                held = self._asks.get(rank)
                if held is None or held.rid != rid:
                    raise AgreementError("a newer restore request of this rank replaced this "
                                         "one", host=rank)
                now = time.monotonic()
                waiting = missing_asks({r: a.lease_end for r, a in self._asks.items()},
                                       self.members, now)
                if not waiting and not self._deciding:
                    self._decide(deadline)
                    continue
                if self._closed:
                    raise AgreementError("the coordinator is shutting down", host=rank)
                if alive is not None and not alive() and now < deadline:
                    raise AgreementError("the asker stopped waiting; its ask stands until "
                                         "its deadline", host=rank)
                fault = self._probe(waiting, now - self._asked_at[rank] >= PROBE_S,
                                    deadline - now - PROBE_MARGIN_S)
                if fault:
                    if self._asks.get(rank) == ask:
                        del self._asks[rank]
                    raise ConfigError(f"the job's replicators disagree on their configuration, "
                                      f"so no step can be agreed: {fault}; every replicator "
                                      f"must run with the same --nodes (in rank order) and "
                                      f"--nodes-per-slice, and its own --rank", host=rank)
                now = time.monotonic()  # a probe ran without the lock: time moved on
                if now >= deadline:
                    if self._asks.get(rank) == ask:
                        del self._asks[rank]
                    # Who has not asked since the last decision, lately (asks withdrawn
                    # at their own deadline a moment ago still count as asked).
                    absent = [m for m in self.members
                              if self._asked_at.get(m, -1e18) < deadline - 2 * timeout_s]
                    if absent:
                        why = f"no restore request yet from rank(s) {absent}"
                    elif self._deciding:
                        why = f"no inventory yet from rank(s) {list(self.waiting_for)}"
                    else:
                        why = self._why or "the coordinator could not decide"
                    raise AgreementError(f"cannot decide the step to restore within "
                                         f"{timeout_s:.1f}s: {why}; every member must ask "
                                         f"and answer", host=rank)
                wait = deadline - now if alive is None else min(deadline - now, ALIVE_CHECK_S)
                # Woken to probe members that have not asked (none notifies for them).
                self._cond.wait(min(wait, PROBE_S) if self.faults and waiting else wait)

    def _probe(self, waiting: Sequence[int], due: bool, left_s: float) -> str:
        """Called with ``_cond`` held: whether members that have not asked say their
        configuration is wrong (such a member refuses, and never asks), asked when
        ``due``, at most every ``PROBE_S``, by one asker, without the lock, within
        ``left_s`` (an asker busy probing past its deadline would answer its caller
        late: a member cut off from the coordinator made an ask's own call time out
        before the typed error naming that member came)."""
        if self.faults is None or not waiting:
            return ""
        now = time.monotonic()
        if due and left_s > 0 and not self._probing and now >= self._probe_next:
            self._probing, self._probe_next = True, now + PROBE_S
            self._cond.release()
            try:
                fault = self.faults(list(waiting), left_s)
            finally:
                self._cond.acquire()
                self._probing = False
            self._fault = fault
            self._cond.notify_all()
        return self._fault

    def _find(self, rid: str, rank: int) -> EpochRecord | None:
        """The record that answered ``rid``, when it was decided for this membership;
        one decided for another membership is never read as this one's."""
        rec = self.book.find(rid)
        if rec is not None and rec.members and sorted(rec.members) != sorted(self.members):
            raise AgreementError(f"restore id {rid!r} was answered for membership "
                                 f"{list(rec.members)}, not {self.members}", host=rank)
        return rec

    def _decide(self, deadline: float) -> None:
        """Called with ``_cond`` held and every member asking: gather (without the
        lock, so re-issued asks still register) and record, or say why not."""
        asks = dict(self._asks)
        self._deciding = True
        t0 = time.monotonic()
        first_ask = min(self._asked_at.values(), default=t0)
        self._cond.release()
        try:
            holdings = self.gather_all(deadline)
        finally:
            self._cond.acquire()
            self._deciding = False
        t_gathered = time.monotonic()
        result = decide(holdings, self.members, self.equivalent, self.num_nodes)
        if isinstance(result, CannotDecide):
            self._why = result.reason
        else:
            rids = {a.rid for a in asks.values()} | {a.rid for a in self._asks.values()}
            self.book.record(result.step, rids, self.clock(),
                             [h.last for h in holdings.values() if h.last is not None],
                             self.members, run=result.run, lost=result.lost)
            self._asks.clear()
            self._asked_at.clear()  # those asks are answered: they count for no later epoch
            self._why = ""
            log.info("step %d decided: every member asked over %.3fs, holdings gathered in "
                     "%.3fs, recorded in %.3fs", result.step, t0 - first_ask,
                     t_gathered - t0, time.monotonic() - t_gathered)
        self._cond.notify_all()

    def gather_all(self, deadline: float) -> dict[int, Holding]:
        """Every member's holdings; asks again for the missing ones until the deadline.
        Returns at once when all have answered (no fixed wait)."""
        got: dict[int, Holding] = {}
        while True:
            missing = [r for r in self.members if r not in got]
            self.waiting_for = tuple(missing)
            got.update(self.gather(missing, deadline))
            if len(got) == len(self.members) or time.monotonic() >= deadline:
                self.waiting_for = tuple(r for r in self.members if r not in got)
                return got
            time.sleep(min(self.retry_s, max(0.0, deadline - time.monotonic())))
