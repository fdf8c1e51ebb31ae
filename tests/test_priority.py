"""mtc.sidecar.priority: a host process's background work yields the cores to the
job's processes as a group (autogroup), and gets its share back after."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from mtc.sidecar import priority

REPO = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    from mtc.sidecar import priority
    before = priority.autogroup_nice()
    with priority.group_yields(19) as changed:
        during = priority.autogroup_nice()
    print(before, changed, during, priority.autogroup_nice())
""")


def _run_child(own_session: bool) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         cwd=REPO, start_new_session=own_session, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def _autogroups() -> bool:
    """Whether this process shows a group: not where it is in the kernel's root
    group (CI's runner), whose file reads empty; its children share it."""
    return priority.autogroup_nice() is not None


@pytest.mark.process
def test_a_session_leader_yields_while_the_block_runs_and_gets_its_nice_back() -> None:
    # Its own session is its own group, whichever group this process is in.
    before, changed, during, after = _run_child(own_session=True)
    if before == "None":
        pytest.skip("this kernel shows no autogroups (/proc/self/autogroup)")
    assert int(before) < 19
    assert changed == "True"
    assert int(during) == 19
    assert after == before


@pytest.mark.process
def test_a_process_in_anothers_session_leaves_the_group_alone() -> None:
    """Its group is the session's (a shell's, a trainer's): not this process's to slow."""
    if not _autogroups():
        pytest.skip("this kernel shows no autogroups (/proc/self/autogroup)")
    before, changed, during, after = _run_child(own_session=False)
    assert changed == "False"
    assert during == before == after


class _Group:
    """A stand-in for /proc/self/autogroup (a mock: the kernel's rate limit cannot
    be provoked on purpose, and the real file is this test process's group)."""

    def __init__(self, nice: int, refusals: int) -> None:
        self.nice, self.refusals, self.writes = nice, refusals, 0

    def read_text(self) -> str:
        return f"/autogroup-7 nice {self.nice}\n"

    def write_text(self, text: str) -> int:
        self.writes += 1
        if self.refusals:
            self.refusals -= 1
            raise OSError(errno.EAGAIN, "rate limited")
        self.nice = int(text)
        return len(text)


def _as_session_leader(monkeypatch: Any, group: Any) -> None:
    """This process as one that leads its own session, with ``group`` as its
    /proc/self/autogroup."""
    monkeypatch.setattr(priority, "AUTOGROUP", group)
    monkeypatch.setattr(priority, "_RETRY_S", 0.0)
    monkeypatch.setattr(priority.os, "getsid", lambda pid: 4242)
    monkeypatch.setattr(priority.os, "getpid", lambda: 4242)


def test_the_nice_comes_back_through_the_kernels_rate_limit(monkeypatch: Any) -> None:
    group = _Group(nice=0, refusals=0)
    _as_session_leader(monkeypatch, group)
    with priority.group_yields(19) as changed:
        assert changed and group.nice == 19
        group.refusals = 3  # the change back is refused three times, then taken
    assert group.nice == 0
    assert group.writes == 1 + 4


def test_a_refused_change_leaves_the_group_as_it_was(monkeypatch: Any) -> None:
    group = _Group(nice=2, refusals=1)
    _as_session_leader(monkeypatch, group)
    with priority.group_yields(19) as changed:
        assert not changed and group.nice == 2
    assert group.nice == 2
    assert group.writes == 1  # nothing to give back


def test_a_group_already_below_the_job_is_left_alone(monkeypatch: Any) -> None:
    group = _Group(nice=19, refusals=0)
    _as_session_leader(monkeypatch, group)
    with priority.group_yields(19) as changed:
        assert not changed
    assert group.writes == 0 and group.nice == 19


def test_no_autogroups_no_change(monkeypatch: Any, tmp_path: Path) -> None:
    _as_session_leader(monkeypatch, tmp_path / "absent")
    assert priority.autogroup_nice() is None
    with priority.group_yields(19) as changed:
        assert not changed
    assert not (tmp_path / "absent").exists()


@pytest.mark.process
def test_nice_for_good_leaves_anothers_group_alone() -> None:
    """``--nice`` from a user's shell: the shell's group (the trainer's too) stays."""
    if not _autogroups():
        pytest.skip("this kernel shows no autogroups (/proc/self/autogroup)")
    code = ("from mtc.sidecar import priority\nbefore = priority.autogroup_nice()\n"
            "priority.lower_group_priority(7)\nprint(before, priority.autogroup_nice())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=60, check=True)
    before, after = out.stdout.split()
    assert before == after
