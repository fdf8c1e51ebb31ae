"""The coordinator's records of restore epochs: each decision recorded once, never
changed, and read by every member that asks with one of its restore ids
(``docs/agreement.md``). Written through to the coordinator's RAM disk, so a
replicator restart keeps them; a book that was lost or cannot be read starts
anew, its epoch numbers past every one the members report.

:class:`Decision` is an epoch as a member read it, :class:`EpochRecord` as the
coordinator recorded it, :func:`find_record` (pure) which record answered an
ask, :class:`Book` the records themselves.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

from mtc.errors import AgreementError
from mtc.sidecar.storage.names import aside_name
from mtc.sidecar.storage.publish import replace, write_atomic
from mtc.validate import MAX_EPOCH, MAX_STEP

log = logging.getLogger("mtc.sidecar.replicator.agree.agreement")  # the agreement's log, as before
BOOK_NAME = ".mtc-agreement.json"
KEEP_RECORDS = 16  # recorded epochs kept; older ones can no longer be joined anyway


@dataclasses.dataclass(frozen=True)
class Decision:
    """An epoch's recorded step, as a member read it (reported back in inventories,
    so a coordinator that lost its records rebuilds them before deciding again)."""

    epoch: int
    step: int
    decided_at: float  # unix seconds
    rank: int = -1  # the member that read it
    rid: str = ""  # the restore id it asked with


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    """One decided epoch, immutable: the step, when, and the restore ids of every
    ask it answers (a re-issued ask with one of them reads it again)."""

    epoch: int
    step: int
    decided_at: float
    rids: frozenset[str] = frozenset()
    members: tuple[int, ...] = ()  # the membership it was decided for (): not recorded
    run: str = ""  # the run whose bytes make the step (see Decided)
    lost: str = ""  # step -1 while members hold data: whose data is gone

    def decision(self, rank: int = -1, rid: str = "") -> Decision:
        return Decision(self.epoch, self.step, self.decided_at, rank, rid)


def find_record(records: Sequence[EpochRecord], rid: str) -> EpochRecord | None:
    """The epoch that answered the ask with restore id ``rid``, if one did."""
    for rec in reversed(records):
        if rid in rec.rids:
            return rec
    return None


class Book:
    """The coordinator's epoch records, written through to its RAM disk (a replicator
    restart keeps them). The lock guards ``records``."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.records: list[EpochRecord] = []
        if path is not None:
            self.records = _load(path)

    def find(self, rid: str) -> EpochRecord | None:
        with self._lock:
            return find_record(self.records, rid)

    def record(self, step: int, rids: Iterable[str], now: float,
               reported: Iterable[Decision] = (), members: Sequence[int] = (), *,
               run: str = "", lost: str = "") -> EpochRecord:
        """Record a new epoch's decision: the only place a decision is made. Its
        number is past every epoch this book or any member knows, so a wiped
        coordinator never reuses one."""
        with self._lock:
            # An epoch out of range (a member's report that was never checked) counts
            # for nothing: recorded, it would make every later record unwritable.
            newest = max([r.epoch for r in self.records[-1:]] +
                         [d.epoch for d in reported if 0 <= d.epoch < MAX_EPOCH], default=0)
            if not 0 <= step <= MAX_STEP and step != -1:
                raise AgreementError(f"refusing to record step {step}: out of range")
            rec = EpochRecord(newest + 1, step, now, frozenset(rids), tuple(members), run,
                              lost)
            self.records = [*self.records, rec][-KEEP_RECORDS:]
            self._save()
            return rec

    def _save(self) -> None:
        if self.path is None:
            return
        data = [{"epoch": r.epoch, "step": r.step, "decided_at": r.decided_at,
                 "rids": sorted(r.rids), "members": list(r.members), "run": r.run,
                 "lost": r.lost} for r in self.records]
        write_atomic(self.path, json.dumps(data), durable=True)


def _load(path: Path) -> list[EpochRecord]:
    """The records kept at ``path``. A record out of range (an epoch near 2^63 that a
    member once reported) is dropped; a file that cannot be read at all is moved
    aside (``<name>.corrupt-<ns>``, kept for inspection) and the book starts empty:
    its epoch numbers then continue past every one the members report, and a
    restore whose record is gone is decided again, by every member, as a new one."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, list):
            raise ValueError("not a list of records")
    except FileNotFoundError:
        return []
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        aside = aside_name(path, "corrupt")
        replace(path, aside)
        log.error("agreement records %s are unreadable (%s); moved to %s, starting anew",
                  path, e, aside.name)
        return []
    out = []
    for d in data:
        try:
            rec = EpochRecord(int(d["epoch"]), int(d["step"]), float(d["decided_at"]),
                              frozenset(map(str, d["rids"])),
                              tuple(int(m) for m in d.get("members", ())),
                              str(d.get("run", "")), str(d.get("lost", "")))
            if not (0 < rec.epoch <= MAX_EPOCH and -1 <= rec.step <= MAX_STEP):
                raise ValueError(f"epoch {rec.epoch} step {rec.step} out of range")
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
            log.error("dropping an agreement record of %s: %s", path, e)
            continue
        out.append(rec)
    return out
