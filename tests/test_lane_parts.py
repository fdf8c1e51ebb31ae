"""How the process lane is split into parts that run at once (tests/lane_parts.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lane_parts
import pytest

FILES = ["a.py", "b.py", "c.py", "d.py", "e.py"]


def test_every_file_goes_to_exactly_one_part_longest_first() -> None:
    seconds = {"a.py": 40.0, "b.py": 30.0, "c.py": 20.0, "d.py": 15.0, "e.py": 10.0}
    parts = lane_parts.deal(FILES, seconds, 2)
    assert sorted(f for p in parts for f in p) == FILES
    assert parts == [["a.py", "d.py"], ["b.py", "c.py", "e.py"]]  # 55 s and 60 s


def test_the_split_does_not_depend_on_the_order_files_were_found_in() -> None:
    seconds = {"a.py": 5.0, "b.py": 5.0, "c.py": 9.0}
    assert lane_parts.deal(FILES, seconds, 3) == lane_parts.deal(FILES[::-1], seconds, 3)


def test_a_file_without_a_figure_counts_as_the_median() -> None:
    seconds = {"a.py": 1.0, "b.py": 100.0, "c.py": 50.0}
    parts = lane_parts.deal(["a.py", "b.py", "c.py", "new.py"], seconds, 2)
    assert parts == [["b.py", "a.py"], ["c.py", "new.py"]]  # new.py as 50 s


@pytest.mark.parametrize("files, seconds, missing", [
    (["a.py", "b.py"], {"a.py": 1.0, "b.py": 2.0}, []),
    (["b.py", "new.py", "a.py"], {"a.py": 1.0}, ["b.py", "new.py"]),
    (["a.py"], {"a.py": 1.0, "gone.py": 9.0}, []),  # a figure of a file gone: unused
    (["a.py"], {}, ["a.py"]),
])
def test_the_files_without_a_figure_are_named(files: list[str], seconds: dict[str, float],
                                              missing: list[str]) -> None:
    assert lane_parts.unlisted(files, seconds) == missing


@pytest.mark.parametrize("spec", ["1", "0/2", "3/2", "a/b", "1/2/3"])
def test_a_bad_shard_is_refused(spec: str) -> None:
    with pytest.raises(pytest.UsageError):
        lane_parts.parse(spec)


@pytest.mark.process
def test_the_parts_together_run_every_test_once() -> None:
    """Collected by pytest itself, over the whole process lane: its two parts are
    disjoint and together the lane (the three collections at once)."""
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "--collect-only", "-m", "process", *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=Path(__file__).parent.parent)
            for extra in ((), ("--shard", "1/2"), ("--shard", "2/2"))]
    found = []
    for r in runs:
        out, _ = r.communicate(timeout=120)
        assert r.returncode == 0, out
        found.append({line for line in out.splitlines() if "::" in line})
    whole, one, two = found
    assert whole and one and two
    assert not one & two
    assert one | two == whole
