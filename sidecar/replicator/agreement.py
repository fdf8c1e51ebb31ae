"""Restore agreement among replicators: one decider per restore epoch, a decision
recorded once and only read afterwards (the protocol and its invariant:
``docs/agreement.md``).

Pure parts, tested alone (``tests/test_agreement.py``): :func:`decide` (the step
from every member's holdings, or a typed "cannot decide"), :func:`newest_complete`
and :func:`choose_epoch` (which recorded epoch a request belongs to). The stateful
parts take their transport as a function, so the same code runs over gRPC in
``node.py`` and over an in-memory transport in ``bench/control_plane.py``:
:class:`Book` (the coordinator's records, persisted), :class:`Coordinator`
(gather every member, decide once) and :class:`Fresh` (a value computed by a
gather that began after the caller asked, shared by every caller waiting).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from mtc.errors import AgreementError

T = TypeVar("T")
BOOK_NAME = ".mtc-agreement.json"
KEEP_RECORDS = 16  # recorded epochs kept; older ones can no longer be joined anyway


@dataclasses.dataclass(frozen=True)
class Holding:
    """What one member reports: complete copies it holds and the backed-up steps."""

    copies: frozenset[tuple[int, int]]  # (origin rank, step)
    backed_up: frozenset[int] = frozenset()
    last: Decision | None = None  # the newest decision this member has read


@dataclasses.dataclass(frozen=True)
class Decision:
    """An epoch's recorded step, as a member read it (reported back in inventories,
    so a coordinator that lost its records rebuilds them before deciding again)."""

    epoch: int
    step: int
    decided_at: float  # unix seconds: the lease is measured from here
    rank: int = -1  # the member that read it
    rid: str = ""  # the restore id it asked with


@dataclasses.dataclass(frozen=True)
class Decided:
    step: int  # -1: nothing restorable anywhere


@dataclasses.dataclass(frozen=True)
class CannotDecide:
    reason: str
    missing: tuple[int, ...] = ()


def newest_complete(holdings: Mapping[int, Holding], num_nodes: int,
                    equivalent: Callable[[int], Sequence[int]]) -> int:
    """The newest step whose data is held (on hosts, not in backup) for every rank."""
    held = {c for h in holdings.values() for c in h.copies}
    for s in sorted({s for _, s in held}, reverse=True):
        if all(any((o, s) in held for o in equivalent(r)) for r in range(num_nodes)):
            return s
    return -1


def decide(holdings: Mapping[int, Holding], members: Collection[int],
           equivalent: Callable[[int], Sequence[int]]) -> Decided | CannotDecide:
    """The step every member restores: the newest one each rank's data exists for,
    on a host or in the backup. Never on a partial view: every member must have
    answered, or the answer is :class:`CannotDecide` naming who is missing."""
    missing = tuple(sorted(set(members) - set(holdings)))
    if missing:
        return CannotDecide(f"no inventory from rank(s) {list(missing)}", missing)
    extra = sorted(set(holdings) - set(members))
    if extra:
        return CannotDecide(f"inventory from rank(s) {extra} outside the membership")
    backed = max((s for h in holdings.values() for s in h.backed_up), default=-1)
    return Decided(max(newest_complete(holdings, len(members), equivalent), backed))


# -- the coordinator's records --------------------------------------------------------


@dataclasses.dataclass
class EpochRecord:
    """One decided epoch: immutable ``epoch``/``step``/``decided_at``; ``rids`` and
    ``consumed`` grow as members read it."""

    epoch: int
    step: int
    decided_at: float
    rids: set[str] = dataclasses.field(default_factory=set)
    consumed: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> rid

    def decision(self, rank: int = -1, rid: str = "") -> Decision:
        return Decision(self.epoch, self.step, self.decided_at, rank, rid)


def choose_epoch(records: Sequence[EpochRecord], rank: int, rid: str, now: float,
                 lease_s: float, members: int) -> EpochRecord | None:
    """The recorded epoch a restore request belongs to, or None for a new one.

    A request naming a restore id (``rid``) already recorded joins that epoch: a
    re-issued request (its replicator restarted) reads the same decision. Otherwise
    it joins the newest epoch while that one's lease runs (``lease_s`` after it was
    decided), the requesting rank has not read it yet, and not every member has;
    any later request starts a new epoch. ``records`` are oldest first.
    """
    if rid:
        for rec in reversed(records):
            if rid in rec.rids:
                return rec
    if not records:
        return None
    rec = records[-1]
    if rank in rec.consumed or len(rec.consumed) >= members:
        return None
    if not 0 <= now - rec.decided_at < lease_s:
        return None
    return rec


class Book:
    """The coordinator's epoch records, written through to its RAM disk (a replicator
    restart keeps them) and rebuilt from members' reports after a host wipe. The
    lock guards ``records``; callers take it through the methods only."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.records: list[EpochRecord] = []
        if path is not None:
            self.records = _load(path)

    def choose(self, rank: int, rid: str, now: float, lease_s: float,
               members: int) -> EpochRecord | None:
        with self._lock:
            return choose_epoch(self.records, rank, rid, now, lease_s, members)

    def newest_epoch(self) -> int:
        with self._lock:
            return self.records[-1].epoch if self.records else 0

    def record(self, step: int, rid: str, now: float) -> EpochRecord:
        """Record a new epoch's decision: the only place a decision is made."""
        with self._lock:
            epoch = (self.records[-1].epoch if self.records else 0) + 1
            rec = EpochRecord(epoch, step, now, {rid} if rid else set())
            self.records = [*self.records, rec][-KEEP_RECORDS:]
            self._save()
            return rec

    def consume(self, rec: EpochRecord, rank: int, rid: str) -> None:
        with self._lock:
            rec.consumed[rank] = rid
            if rid:
                rec.rids.add(rid)
            self._save()

    def adopt(self, reports: Iterable[Decision]) -> None:
        """Rebuild epochs this book lost (a wiped coordinator) from what members read.
        A decision some member read is taken as it was, never decided again."""
        with self._lock:
            known = {r.epoch: r for r in self.records}
            changed = False
            for d in reports:
                if d.epoch <= 0:
                    continue
                rec = known.get(d.epoch)
                if rec is None:
                    rec = known[d.epoch] = EpochRecord(d.epoch, d.step, d.decided_at)
                    changed = True
                elif rec.step != d.step:  # cannot happen: the invariant, checked
                    raise AgreementError(f"epoch {d.epoch}: recorded step {rec.step}, "
                                         f"rank {d.rank} read step {d.step}")
                if d.rank >= 0 and d.rank not in rec.consumed:
                    rec.consumed[d.rank] = d.rid
                    if d.rid:
                        rec.rids.add(d.rid)
                    changed = True
            if changed:
                self.records = sorted(known.values(), key=lambda r: r.epoch)[-KEEP_RECORDS:]
                self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        data = [{"epoch": r.epoch, "step": r.step, "decided_at": r.decided_at,
                 "rids": sorted(r.rids), "consumed": {str(k): v for k, v in r.consumed.items()}}
                for r in self.records]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def _load(path: Path) -> list[EpochRecord]:
    try:
        data = json.loads(path.read_text())
        return [EpochRecord(int(d["epoch"]), int(d["step"]), float(d["decided_at"]),
                            set(map(str, d["rids"])),
                            {int(k): str(v) for k, v in d["consumed"].items()})
                for d in data]
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError) as e:
        # A record we cannot read must not be silently forgotten: members' reports
        # rebuild what they read (Book.adopt), but refuse to guess here.
        raise AgreementError(f"unreadable agreement records {path}: {e}") from e


# -- the decider ----------------------------------------------------------------------

Gather = Callable[[Sequence[int], float], dict[int, Holding]]


class Coordinator:
    """The one decider of a membership (its lowest rank runs it).

    ``gather(ranks, deadline)`` returns the holdings of those of ``ranks`` that
    answered before ``deadline`` (monotonic); :meth:`decide_for` asks again for the
    missing ones until all answer or the deadline passes. One decision is made at a
    time (``_deciding``); requests that arrive meanwhile wait, then join it.
    """

    def __init__(self, members: Sequence[int], equivalent: Callable[[int], Sequence[int]],
                 gather: Gather, book: Book, *, lease_s: float,
                 retry_s: float = 0.2, clock: Callable[[], float] = time.time) -> None:
        self.members = list(members)
        self.equivalent = equivalent
        self.gather = gather
        self.book = book
        self.lease_s = lease_s
        self.retry_s = retry_s
        self.clock = clock
        self.holders: dict[int, dict[int, Holding]] = {}  # epoch -> holdings it saw
        self._deciding = threading.Lock()

    def decide_for(self, rank: int, rid: str, timeout_s: float) -> EpochRecord:
        deadline = time.monotonic() + timeout_s
        if not self._deciding.acquire(timeout=max(0.0, timeout_s)):
            raise AgreementError(f"no decision within {timeout_s:.1f}s: the coordinator is "
                                 f"still gathering inventories", host=rank)
        try:
            n = len(self.members)
            rec = self.book.choose(rank, rid, self.clock(), self.lease_s, n)
            if rec is None:
                holdings = self.gather_all(deadline)
                result = decide(holdings, self.members, self.equivalent)
                if isinstance(result, CannotDecide):
                    raise AgreementError(f"cannot decide the step to restore within "
                                         f"{timeout_s:.1f}s: {result.reason}; every member "
                                         f"must answer", host=rank)
                self.book.adopt(h.last for h in holdings.values() if h.last is not None)
                rec = self.book.choose(rank, rid, self.clock(), self.lease_s, n)
                if rec is None:
                    rec = self.book.record(result.step, rid, self.clock())
                    self.holders = {rec.epoch: holdings}
            self.book.consume(rec, rank, rid)
            return rec
        finally:
            self._deciding.release()

    def gather_all(self, deadline: float) -> dict[int, Holding]:
        """Every member's holdings; asks again for the missing ones until the deadline.
        Returns at once when all have answered (no fixed wait)."""
        got: dict[int, Holding] = {}
        while True:
            missing = [r for r in self.members if r not in got]
            got.update(self.gather(missing, deadline))
            if len(got) == len(self.members) or time.monotonic() >= deadline:
                return got
            time.sleep(min(self.retry_s, max(0.0, deadline - time.monotonic())))


class Fresh(Generic[T]):
    """A value (the newest complete step) computed by a run of ``compute`` that began
    after the caller asked: never older than the question, and every caller waiting
    at once shares the next run, so N askers cost about two runs, not N."""

    def __init__(self, compute: Callable[[], T]) -> None:
        self._compute = compute
        self._cond = threading.Condition()
        self._started = 0
        self._done = 0
        self._running = False
        self._value: T | None = None
        self._error: BaseException | None = None

    def get(self, timeout_s: float) -> T:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            need = self._started + 1
            while self._done < need:
                if not self._running:
                    self._running = True
                    self._started += 1
                    gen = self._started
                    self._cond.release()
                    try:
                        value, error = self._compute(), None
                    except Exception as e:  # noqa: BLE001 - handed to every waiter
                        value, error = None, e
                    finally:
                        self._cond.acquire()
                    self._value, self._error = value, error
                    self._done, self._running = gen, False
                    self._cond.notify_all()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AgreementError(f"no fresh view within {timeout_s:.1f}s")
                self._cond.wait(left)
            if self._error is not None:
                raise self._error
            return self._value  # type: ignore[return-value]
