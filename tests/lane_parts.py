"""Splitting the process lane into parts that run at once (``--shard K/N``).

``make test`` runs the tests that start processes in two parts side by side: most
of such a test's time is waiting (for processes to start, for a deadline, for a
peer), so two run in about two thirds of the time of one after the other. A part
is a set of whole files, so that a module's fixtures are set up once. Files are
dealt out by the seconds they took (``tests/process_durations.json``, written by
``--durations-out``; a file not listed counts as the median of those listed, and
the part's run names it at the end),
the longest first, each to the part with the least so far: the same files go to
the same part on every machine, whatever order the collection found them in.

Tests that run at once must not meet: every cluster a test starts already takes
random names (folders, network namespaces, its /24) and ports the kernel hands
out, as two ``make test`` runs on one machine need.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("process_durations.json")
UNLISTED = pytest.StashKey[list[str]]()  # this run's files without a figure (select)


def parse(spec: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N), 1 <= K <= N."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes K/N, e.g. 1/2: not {spec!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {spec}: K must be 1 to N")
    return k, n


def deal(files: list[str], seconds: dict[str, float], n: int) -> list[list[str]]:
    """``files`` in ``n`` parts of about equal seconds: the longest first, each to the
    part with the least so far (the lower part on a tie). A file without a figure
    counts as the median of the known ones (10 s when none is known)."""
    known = [seconds[f] for f in files if f in seconds]
    default = statistics.median(known) if known else 10.0
    parts: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for f in sorted(files, key=lambda f: (-seconds.get(f, default), f)):
        i = min(range(n), key=lambda j: (load[j], j))
        parts[i].append(f)
        load[i] += seconds.get(f, default)
    return parts


def unlisted(files: list[str], seconds: dict[str, float]) -> list[str]:
    """The files ``deal`` counts as the median: without a figure of their own (a new
    file, or one split off another), they are said at the end of the part's run."""
    return sorted(f for f in set(files) if f not in seconds)


def file_of(nodeid: str) -> str:
    """The test file a test's node id names."""
    return nodeid.split("::", 1)[0]


def select(config: pytest.Config, items: list[pytest.Item], spec: str) -> None:
    """Keep in ``items`` only the tests of part ``spec``; the rest are deselected."""
    k, n = parse(spec)
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    files = sorted({file_of(i.nodeid) for i in items})
    config.stash[UNLISTED] = unlisted(files, seconds)
    mine = set(deal(files, seconds, n)[k - 1])
    kept = [i for i in items if file_of(i.nodeid) in mine]
    dropped = [i for i in items if file_of(i.nodeid) not in mine]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def summary(config: pytest.Config, write: Callable[[str], object]) -> None:
    """At the end of a part's run: the files it dealt out without a figure, and how
    to record them (else the parts drift apart as files come and go)."""
    missing = config.stash.get(UNLISTED, [])
    if missing:
        write(f"lane_parts: {len(missing)} file(s) not in {DURATIONS.name}, each counted "
              f"as the median: {', '.join(missing)} (record them: pytest -m process "
              f"--durations-out {DURATIONS.relative_to(DURATIONS.parents[1])} FILE...)")


class Durations:
    """Seconds per file of the tests run (setup, call and teardown), written to
    ``path`` at the end of the session, merged into what it held."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = {}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        f = file_of(report.nodeid)
        self.seconds[f] = self.seconds.get(f, 0.0) + report.duration

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        old = json.loads(self.path.read_text()) if self.path.exists() else {}
        merged = {**old, **{f: round(s, 1) for f, s in self.seconds.items()}}
        self.path.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")
