"""Scrubbing: every copy this host holds is read again, slowly, in the background,
so that damage is found and healed while good copies still exist elsewhere, not
when a restore needs the step.

Checksums are trusted by inode, size and mtime (:mod:`.checksums`): damage that
keeps them (a bit flipped by bad memory) is invisible to every check but one that
reads the bytes. The scrubber reads one held copy at a time, in (origin, step)
order and round again, file by file at most ``rate`` bytes a second on average
(a copy of many GB is never read in one burst), with at least ``MIN_PAUSE_S``
between copies, at background priority, and never while a restore was just
answered (its reads go first).

A copy is read again only once ``interval`` seconds have passed since its bytes
were last read whole: by this scrub, or when it was written (its folder's mtime:
a save checksums every byte it writes, a peer copy is verified as it arrives).
Damage builds up with the time bytes sit in memory, and a restore verifies every
byte it reads in any case; without the interval a small state's copies, saved
every few seconds, were read again the moment after they were written, over and
over: CPU taken from the job for bytes just checked.

A file that fails is checked once more, and quarantined only if its copy is still
the one that was read (a copy replaced meanwhile, a step saved again, is not
damage). Then:

- an own step is healed at once, file by file, from another host's verified copy
  of the same bytes (its peer's copy, a data-parallel twin's identical file, the
  backup), exactly as a restore heals it, queued as the step's background fetch
  (:meth:`.restore.Restorer.heal_in_background`): a restore asking for the step
  meanwhile waits for it;
- a peer's copy no longer counts as held: its origin, which re-reads its targets'
  holdings every few seconds, pushes it again (its newest step at once, an older
  one it keeps once the newest is on every target: :mod:`.replication`).

What a scrub finds is counted (``mtc_scrub_damaged_files_total``, besides the
quarantine's and the heal's own counters); what it read, in
``mtc_scrub_bytes_total``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from mtc.errors import MtcError
from mtc.lifecycle import Threads
from mtc.pool import lower_thread_priority
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.store.store import LocalStore

log = logging.getLogger(__name__)

IDLE_S = 5.0  # with nothing held, how often to look again
# At least this long between two copies: a small state is not read over and over
# (each pass lists, describes and opens every file of a copy).
MIN_PAUSE_S = 1.0

Copy = tuple[int, int]  # (origin rank, step)


def due(read_at: Mapping[Copy, float], now: float, interval: float
        ) -> tuple[list[Copy], float]:
    """The copies due a scrub at ``now`` (``read_at``: each held copy's time its
    bytes were last read whole), and the seconds until the next of the others is
    due (``math.inf``: none)."""
    ready: list[Copy] = []
    wait = math.inf
    for copy, t in read_at.items():
        left = t + interval - now
        if left <= 0:
            ready.append(copy)
        else:
            wait = min(wait, left)
    return sorted(ready), wait


def next_copy(held: Sequence[Copy], last: Copy | None) -> Copy | None:
    """The copy to scrub after ``last``: the first held one after it in (origin,
    step) order, round again from the first; None when nothing is held."""
    ordered = sorted(held)
    if not ordered:
        return None
    if last is not None:
        for c in ordered:
            if c > last:
                return c
    return ordered[0]


def pause_after(nbytes: int, took_s: float, rate: float) -> float:
    """Seconds to wait after reading ``nbytes`` in ``took_s`` so that reading
    averages at most ``rate`` bytes a second (0: it is slower already, or no rate)."""
    if rate <= 0:
        return 0.0
    return max(0.0, nbytes / rate - took_s)


class Scrubber:
    """One replicator's scrub, a service (:class:`mtc.lifecycle.Service`): :meth:`run`
    is its thread's loop, :meth:`scrub_once` one copy. ``heal_own(step)``: make an own
    step whole again from other hosts' copies; ``quiet_until()``: monotonic time
    until which a restore's reads go first."""

    def __init__(self, store: LocalStore, metrics: Metrics, *, rate: float,
                 heal_own: Callable[[int], None], quiet_until: Callable[[], float],
                 interval: float = 0.0) -> None:
        self.store = store
        self.metrics = metrics
        self.rate = rate  # bytes a second, on average; 0: off
        self.interval = interval  # seconds a copy's bytes stay trusted once read whole
        self._heal_own = heal_own
        self._quiet_until = quiet_until
        self._stop = threading.Event()
        self._last: Copy | None = None
        # When each copy's bytes were last read whole here (wall clock, as mtimes are).
        self._read_at: dict[Copy, float] = {}

    def start(self, threads: Threads) -> None:
        if self.rate > 0:
            threads.start(self.run, "mtc-scrub")

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        pass

    def run(self) -> None:
        if self.rate <= 0:
            return
        lower_thread_priority(19)  # behind the job's threads, saves and copies
        while not self._stop.is_set():
            wait = self._quiet_until() - time.monotonic()
            if wait > 0:
                self._stop.wait(wait)
                continue
            try:
                copy, wait = self._next()
                if copy is None:
                    self._stop.wait(min(wait, IDLE_S))
                    continue
                nbytes = self._scrub(copy)
            except Exception:  # the next copy is scrubbed all the same
                log.exception("rank %d: scrubbing failed", self.store.rank)
                self.metrics.failures.labels("scrub").inc()
                nbytes = 0
            self._stop.wait(MIN_PAUSE_S if nbytes else IDLE_S)

    def scrub_once(self) -> int:
        """Read the next due copy again (:meth:`_scrub`); 0 when none is due."""
        copy, _ = self._next()
        return 0 if copy is None else self._scrub(copy)

    def _next(self) -> tuple[Copy | None, float]:
        """The next due copy after the last one read, in order; or None and the
        seconds until one is due."""
        held = self.store.copies()
        self._read_at = {c: t for c, t in self._read_at.items() if c in held}
        read_at: dict[Copy, float] = {}
        for c in held:
            if c in self._read_at:
                read_at[c] = self._read_at[c]
                continue
            try:  # not read here yet: as old as its writing
                read_at[c] = os.stat(self.store.copy_dir(*c)).st_mtime
            except OSError:
                pass  # gone since the listing
        ready, wait = due(read_at, time.time(), self.interval)
        return next_copy(ready, self._last), wait

    def _scrub(self, copy: Copy) -> int:
        """Read a held copy again, every byte, file by file at no more than the rate
        (a copy of many GB is never read in one burst); quarantine what fails twice
        and heal an own step. Returns the bytes read."""
        self._last = copy
        origin, step = copy
        started = time.time()
        try:
            folder = self.store.copy_dir(origin, step)
            ino = os.stat(folder).st_ino
            files = self.store.describe(origin, step)
        except (OSError, ValueError, MtcError):
            return 0  # removed (retention) or replaced since it was listed
        base = os.fspath(folder)
        suspects = []
        nbytes = 0
        t0 = time.monotonic()
        for f in files:
            if self._stop.wait(pause_after(nbytes, time.monotonic() - t0, self.rate)):
                break
            why = self.store.checksums.check(f"{base}/{f.path}", f, cached=False)
            nbytes += f.size
            self.metrics.scrub_bytes.inc(f.size)
            if why is not None and why != "missing":
                suspects.append(f)
        if self._stop.is_set():
            return nbytes
        self._read_at[copy] = started  # damage from now on shows after the interval
        if not suspects or not self._same_copy(folder, ino):
            return nbytes
        bad = []
        raced = 0  # moved aside meanwhile by another check of the copy: found all the same
        for f in suspects:  # read once more: only what fails twice is moved aside
            why = self.store.checksums.check(f"{base}/{f.path}", f, cached=False)
            if why is not None and why != "missing":
                self.store.quarantine_file(Path(base) / f.path, why, origin=origin, step=step)
                bad.append(f)
            elif why == "missing" and self.store.damaged(origin, step):
                raced += 1
        self.metrics.scrub_damaged.inc(len(bad) + raced)
        if not bad:
            return nbytes
        log.warning("rank %d: scrub found %d bad files in rank %d's step %d (%s, ...)",
                    self.store.rank, len(bad), origin, step, bad[0].path)
        if origin == self.store.rank:
            try:
                self._heal_own(step)  # queued; its outcome is logged where it runs
            except (MtcError, OSError) as e:
                self.metrics.failures.labels("scrub_heal").inc()
                log.error("rank %d: step %d, damaged, could not be healed now (a restore "
                          "tries again): %s", self.store.rank, step, e)
        return nbytes

    @staticmethod
    def _same_copy(folder: os.PathLike[str], ino: int) -> bool:
        """Whether ``folder`` is still the copy that was read (not one saved again)."""
        try:
            return os.stat(folder).st_ino == ino
        except OSError:
            return False
