"""Splitting the process lane into parts that run at once.

``make test`` runs the tests that start processes in two parts side by side: most
of such a test's time is waiting (for processes to start, for a deadline, for a
peer), so two run in about two thirds of the time of one after the other. A part
runs whole files, so that a module's fixtures are set up once.

``--claims DIR`` (what ``make test-process`` passes both parts: a fresh folder per
run): the parts take files as they go. Both order the files they collected the
same way, the longest first by the seconds each took
(``tests/process_durations.json``, written by ``--durations-out``; a file not listed
counts as the median of those listed, and the part's run names it at the end), and
each, when it is about to finish a file, claims the next file no part has claimed
(a file made with ``O_CREAT | O_EXCL`` in DIR: exactly one part wins it). A part
whose file ran long takes fewer, so stale figures no longer leave one part idle.

``--shard K/N`` (without ``--claims``): part K of a fixed deal by the same figures,
the longest first, each to the part with the least so far: the same files go to the
same part on every machine, whatever order the collection found them in.

Tests that run at once must not meet: every cluster a test starts already takes
random names (folders, network namespaces, its /24) and ports the kernel hands
out, as two ``make test`` runs on one machine need.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

DURATIONS = Path(__file__).with_name("process_durations.json")
UNLISTED = pytest.StashKey[list[str]]()  # this run's files without a figure (select)
RAN = pytest.StashKey[list[str]]()  # the files this part claimed and ran (--claims)


def addoption(parser: pytest.Parser) -> None:
    """The options of the parts (called by the conftest of a folder that has them)."""
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run part K of N of the selected tests, split by file "
                          "(tests/lane_parts.py)")
    parser.addoption("--claims", default=None, type=Path, metavar="DIR",
                     help="run the files no other part sharing DIR has claimed, the "
                          "longest first, claiming each as it goes (tests/lane_parts.py)")
    parser.addoption("--durations-out", default=None, type=Path, metavar="PATH",
                     help="write the seconds each file's tests took to PATH (JSON, merged "
                          "into what it holds): tests/process_durations.json orders the parts")


def configure(config: pytest.Config) -> None:
    """Register the parts' hooks (and ``--durations-out``'s recorder)."""
    if config.getoption("--shard") is not None and config.getoption("--claims") is not None:
        raise pytest.UsageError("--shard and --claims are two ways to split: give one")
    folder = config.getoption("--claims")
    if folder is not None and not folder.is_dir():
        raise pytest.UsageError(f"--claims {folder}: not a folder (make one per run of the parts)")
    path = config.getoption("--durations-out")
    if path is not None:
        config.pluginmanager.register(Durations(path), "mtc-durations")
    config.pluginmanager.register(Parts(), "mtc-lane-parts")


def parse(spec: str) -> tuple[int, int]:
    """``"K/N"`` -> (K, N), 1 <= K <= N."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes K/N, e.g. 1/2: not {spec!r}") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {spec}: K must be 1 to N")
    return k, n


def median(files: Iterable[str], seconds: dict[str, float]) -> float:
    """What a file without a figure counts as: the median of the known ones of
    ``files`` (10 s when none is known)."""
    known = [seconds[f] for f in set(files) if f in seconds]
    return statistics.median(known) if known else 10.0


def order(files: Iterable[str], seconds: dict[str, float]) -> list[str]:
    """``files`` (each once), the longest first, by name on a tie: the order every part
    computes alike. A file without a figure counts as the ``median``."""
    names = set(files)
    default = median(names, seconds)
    return sorted(names, key=lambda f: (-seconds.get(f, default), f))


def deal(files: list[str], seconds: dict[str, float], n: int) -> list[list[str]]:
    """``files`` in ``n`` parts of about equal seconds: in ``order``, each to the part
    with the least so far (the lower part on a tie)."""
    default = median(files, seconds)
    parts: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for f in order(files, seconds):
        i = min(range(n), key=lambda j: (load[j], j))
        parts[i].append(f)
        load[i] += seconds.get(f, default)
    return parts


def unlisted(files: list[str], seconds: dict[str, float]) -> list[str]:
    """The files ``order`` counts as the median: without a figure of their own (a new
    file, or one split off another), they are said at the end of the part's run."""
    return sorted(f for f in set(files) if f not in seconds)


def file_of(nodeid: str) -> str:
    """The test file a test's node id names."""
    return nodeid.split("::", 1)[0]


def by_file(items: list[pytest.Item]) -> dict[str, list[pytest.Item]]:
    """``items`` grouped by file, each file's in the order collected."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(file_of(item.nodeid), []).append(item)
    return groups


def claim(folder: Path, file: str) -> bool:
    """Claim ``file`` for this process: True for exactly one of the processes that try
    (the first to create its marker: ``O_EXCL``, atomic on a local file system)."""
    try:
        fd = os.open(folder / quote(file, safe=""), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, f"{os.getpid()}\n".encode())  # who ran it, for a person reading DIR
    finally:
        os.close(fd)
    return True


class Claims:
    """The files of ``ordered`` this part wins, one at a time, in that order."""

    def __init__(self, folder: Path, ordered: list[str]) -> None:
        self.folder = folder
        self.left = list(ordered)

    def take(self) -> str | None:
        """The next file no part has claimed, now claimed by this one; None when all are."""
        while self.left:
            f = self.left.pop(0)
            if claim(self.folder, f):
                return f
        return None


def seconds_known() -> dict[str, float]:
    """The recorded seconds per file (none when the file is absent)."""
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def select(config: pytest.Config, items: list[pytest.Item], spec: str) -> None:
    """Keep in ``items`` only the tests of part ``spec``; the rest are deselected."""
    k, n = parse(spec)
    seconds = seconds_known()
    files = sorted({file_of(i.nodeid) for i in items})
    config.stash[UNLISTED] = unlisted(files, seconds)
    mine = set(deal(files, seconds, n)[k - 1])
    kept = [i for i in items if file_of(i.nodeid) in mine]
    dropped = [i for i in items if file_of(i.nodeid) not in mine]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def run_claimed(session: pytest.Session, folder: Path) -> None:
    """Run the files this part claims, file by file. The next file is claimed before
    the current file's last test runs, so that test's ``nextitem`` is the first test
    of the next file (None when none is left): pytest tears down the fixtures that
    end with the file then, and the session's only after the part's last test. A
    part that wins no file exits 0 all the same: pytest's "no tests ran" (5) counts
    the tests collected, and each part collects them all."""
    groups = by_file(session.items)
    seconds = seconds_known()
    session.config.stash[UNLISTED] = unlisted(list(groups), seconds)
    ran = session.config.stash[RAN] = []
    claims = Claims(folder, order(groups, seconds))
    current = claims.take()
    while current is not None:
        ran.append(current)
        items = groups[current]
        following: str | None = None
        for i, item in enumerate(items):
            if i + 1 < len(items):
                nextitem: pytest.Item | None = items[i + 1]
            else:
                following = claims.take()
                nextitem = groups[following][0] if following is not None else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        current = following


class Parts:
    """The hooks of ``--shard`` and ``--claims``."""

    @pytest.hookimpl(trylast=True)  # after -m has deselected
    def pytest_collection_modifyitems(self, config: pytest.Config,
                                      items: list[pytest.Item]) -> None:
        spec = config.getoption("--shard")
        if spec is not None:
            select(config, items, spec)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool | None:
        folder = session.config.getoption("--claims")
        if folder is None:
            return None  # pytest's own loop
        if session.testsfailed and not session.config.option.continue_on_collection_errors:
            raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
        if not session.config.option.collectonly:
            run_claimed(session, folder)
        return True

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        summary(config, terminalreporter.write_line)


def summary(config: pytest.Config, write: Callable[[str], object]) -> None:
    """At the end of a part's run: the files it claimed and ran, the files it ordered
    without a figure, and how to record them (else the parts drift apart as files come
    and go)."""
    if RAN in config.stash:
        ran = config.stash[RAN]
        write(f"lane_parts: this part ran {len(ran)} file(s)"
              + (f": {', '.join(ran)}" if ran else " (the other parts claimed them all)"))
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
