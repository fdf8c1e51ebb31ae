"""Restore agreement among replicators: one decider per restore epoch, a decision
recorded once and only read afterwards (the protocol and its invariant:
``docs/agreement.md``).

The decision itself is pure, in :mod:`.decision`. :class:`Coordinator` (every
member asks, gather every member, decide once, recorded in a
:class:`~mtc.sidecar.replicator.agree.book.Book`) takes its transport as a function,
so the same code runs over gRPC in ``node_agreement.py`` and over an in-memory
transport in ``bench/control_plane.py``.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from mtc.errors import AgreementError, ConfigError
from mtc.sidecar.replicator.agree.book import Book, EpochRecord
from mtc.sidecar.replicator.agree.decision import (
    Ask,
    CannotDecide,
    Holding,
    decide,
    missing_asks,
    refused,
    supersedes,
)

log = logging.getLogger("mtc.sidecar.replicator.agree.agreement")
# How soon an ask's waiting thread notices that its asker's call has ended.
ALIVE_CHECK_S = 0.5
# An ask waiting this long for members that have not asked has them asked whether
# their configuration disagrees with a peer's (a refusing member never asks), and
# again at most this often while it waits.
PROBE_S = 1.0
# A probe ends this long before its asker's deadline at the latest.
PROBE_MARGIN_S = 0.5
# A member whose ask's lease ended longer ago than this (or that never asked since
# the last decision) is named as not asking. Not the ask's own time left: an asker's
# last call carries only its last seconds, and the coordinator's own ask, made once
# at the start, would then count as never made.
ASKED_LATELY_S = 10.0
# A member whose ask ended less than this before another's deadline ended with it
# (the same restore's asks share a deadline); one that ended earlier and has not
# asked again is named when nothing else explains a failed epoch.
ENDED_TOGETHER_S = 0.5


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
                 faults: Callable[[Sequence[int], float], str] | None = None,
                 signed: bool = False,
                 silent: Callable[[Sequence[int]], str] | None = None,
                 probe_s: float = PROBE_S) -> None:
        self.members = list(members)
        # Mutual TLS: a step counts only as far as its saving hosts' own words carry
        # it (``decision.refused``).
        self.signed = signed
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
        self._lease_end: dict[int, float] = {}  # rank -> its latest ask's lease end (idem)
        self._closed = False
        # ``faults(ranks, seconds)``: how those members say, within the seconds, that
        # their configuration is wrong ("" when none does); its last answer, and
        # when it may be asked next (one at a time).
        self.faults = faults
        self.probe_s = probe_s  # PROBE_S; shorter in tests that wait for a probe
        self._fault = ""
        self._probe_next = 0.0
        self._probing = False
        # ``silent(ranks)``: what is known of those members not answering (the last
        # probe's: "rank 1's replicator at a:1 does not answer ..."), for messages.
        self.silent = silent

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
            self._lease_end[rank] = deadline
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
                fault = self._probe(waiting, now - self._asked_at[rank] >= self.probe_s,
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
                              if self._lease_end.get(m, -1e18) < now - ASKED_LATELY_S]
                    # The error names as its host a member that failed to take part,
                    # not this asker: the asker is healthy, and a user reads the
                    # host as the one to look at (all of them are in the text).
                    failed = rank
                    if absent:
                        failed = absent[0]
                        why = f"no restore request yet from rank(s) {absent}"
                        said = self.silent(absent) if self.silent is not None else ""
                        if said:
                            why += f" ({said})"
                    elif self._deciding:
                        why = f"no inventory yet from rank(s) {list(self.waiting_for)}"
                        failed = self.waiting_for[0] if self.waiting_for else rank
                    elif lapsed := [m for m in self.members if m != rank and m not in self._asks
                                    and self._lease_end.get(m, now) < now - ENDED_TOGETHER_S]:
                        # Asked lately (an earlier restore's ask, let through by a
                        # network that came back for a moment), not since: the
                        # member that keeps this epoch from forming.
                        failed = lapsed[0]
                        why = (f"no restore request from rank(s) {lapsed} since their last "
                               f"ended")
                    else:
                        why = self._why or "the coordinator could not decide"
                    raise AgreementError(f"cannot decide the step to restore within "
                                         f"{timeout_s:.1f}s: {why}; every member must ask "
                                         f"and answer", host=failed)
                wait = deadline - now if alive is None else min(deadline - now, ALIVE_CHECK_S)
                # Woken to probe members that have not asked (none notifies for them).
                self._cond.wait(min(wait, self.probe_s) if self.faults and waiting else wait)

    def _probe(self, waiting: Sequence[int], due: bool, left_s: float) -> str:
        """Called with ``_cond`` held: whether members that have not asked say their
        configuration is wrong (such a member refuses, and never asks), asked when
        ``due``, at most every ``probe_s``, by one asker, without the lock, within
        ``left_s`` (an asker busy probing past its deadline would answer its caller
        late: a member cut off from the coordinator made an ask's own call time out
        before the typed error naming that member came)."""
        if self.faults is None or not waiting:
            return ""
        now = time.monotonic()
        if due and left_s > 0 and not self._probing and now >= self._probe_next:
            self._probing, self._probe_next = True, now + self.probe_s
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
        result = decide(holdings, self.members, self.equivalent, self.num_nodes,
                        signed=self.signed)
        if self.signed:
            newer = {k: why for k, why in refused(holdings, self.members).items()
                     if isinstance(result, CannotDecide) or k[0] > result.step}
            if newer:
                log.warning("steps not counted, their saving hosts' own words do not "
                            "carry them for members %s: %s", self.members,
                            "; ".join(f"step {s}: {why}" for (s, _), why in
                                      sorted(newer.items(), reverse=True)[:3])[:2000])
        if isinstance(result, CannotDecide):
            self._why = result.reason
        else:
            rids = {a.rid for a in asks.values()} | {a.rid for a in self._asks.values()}
            self.book.record(result.step, rids, self.clock(),
                             [h.last for h in holdings.values() if h.last is not None],
                             self.members, run=result.run, lost=result.lost)
            self._asks.clear()
            self._asked_at.clear()
            self._lease_end.clear()  # those asks are answered: they count for no later epoch
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
