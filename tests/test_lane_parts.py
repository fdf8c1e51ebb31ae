"""How the process lane is split into parts that run at once (tests/lane_parts.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
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


@pytest.mark.parametrize("files, seconds, ordered", [
    (["b.py", "a.py", "c.py"], {"a.py": 1.0, "b.py": 3.0, "c.py": 2.0}, ["b.py", "c.py", "a.py"]),
    (["c.py", "a.py", "b.py"], {"a.py": 1.0, "b.py": 3.0, "c.py": 2.0}, ["b.py", "c.py", "a.py"]),
    (["b.py", "a.py"], {"a.py": 5.0, "b.py": 5.0}, ["a.py", "b.py"]),  # a tie: by name
    (["a.py", "new.py", "c.py"], {"a.py": 1.0, "b.py": 9.0, "c.py": 20.0},
     ["c.py", "new.py", "a.py"]),  # new.py as the median, 9 s
    (["z.py", "a.py", "a.py"], {}, ["a.py", "z.py"]),  # nothing known: by name, each once
])
def test_the_parts_order_files_longest_first(files: list[str], seconds: dict[str, float],
                                            ordered: list[str]) -> None:
    assert lane_parts.order(files, seconds) == ordered


def test_a_file_is_claimed_once_and_each_part_takes_the_next_unclaimed(tmp_path: Path) -> None:
    one, two = (lane_parts.Claims(tmp_path, FILES) for _ in range(2))
    assert [one.take(), two.take(), two.take(), one.take()] == ["a.py", "b.py", "c.py", "d.py"]
    assert two.take() == "e.py"
    assert one.take() is None and two.take() is None
    assert lane_parts.Claims(tmp_path, FILES).take() is None  # a late part: nothing left
    assert sorted(os.listdir(tmp_path)) == FILES  # one marker a file, named after it
    assert not lane_parts.claim(tmp_path, "a.py")


def test_claims_from_threads_at_once_take_every_file_exactly_once(tmp_path: Path) -> None:
    files = [f"tests/t{i:03}.py" for i in range(200)]
    won: list[list[str]] = [[] for _ in range(4)]
    start = threading.Barrier(len(won))

    def part(mine: list[str]) -> None:
        claims = lane_parts.Claims(tmp_path, files)
        start.wait(timeout=10)
        while (f := claims.take()) is not None:
            mine.append(f)

    threads = [threading.Thread(target=part, args=(w,)) for w in won]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(f for w in won for f in w) == files
    assert all(w == sorted(w) for w in won)  # each part in the common order


@pytest.mark.parametrize("spec", ["1", "0/2", "3/2", "a/b", "1/2/3"])
def test_a_bad_shard_is_refused(spec: str) -> None:
    with pytest.raises(pytest.UsageError):
        lane_parts.parse(spec)


@pytest.mark.process
def test_the_parts_together_run_every_test_once(tmp_path: Path) -> None:
    """Collected by pytest itself, over a tiny folder of six files with the lane's
    plugin (the lane's own files took half a minute a collection, all of it their
    imports): the two --shard parts are disjoint and together the whole."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    process: x\n")
    (tmp_path / "conftest.py").write_text(
        "import lane_parts\n\n\ndef pytest_addoption(parser):\n"
        "    lane_parts.addoption(parser)\n\n\ndef pytest_configure(config):\n"
        "    lane_parts.configure(config)\n")
    for x in "abcdef":
        (tmp_path / f"test_{x}.py").write_text(
            "import pytest\n\n\n@pytest.mark.process\ndef test_one():\n    pass\n\n\n"
            "@pytest.mark.process\ndef test_two():\n    pass\n")
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(tmp_path)])}
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "--collect-only", "-m", "process", *extra, "."],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=tmp_path, env=env)
            for extra in ((), ("--shard", "1/2"), ("--shard", "2/2"))]
    found = []
    for r in runs:
        out, _ = r.communicate(timeout=120)
        assert r.returncode == 0, out
        found.append({line for line in out.splitlines() if "::" in line})
    whole, one, two = found
    assert len(whole) == 12 and one and two
    assert not one & two
    assert one | two == whole


# The tiny folder's tests: a session fixture and a module fixture that log their
# setups and teardowns, and tests that wait (bounded) until both parts have claimed a
# file, so that each part runs some of them whatever order the parts started in.
TINY_CONFTEST = """
import lane_parts
import os
from pathlib import Path

import pytest


def pytest_addoption(parser):
    lane_parts.addoption(parser)


def pytest_configure(config):
    lane_parts.configure(config)


def log(line):
    with open(os.environ["TINY_LOG"], "a") as f:
        f.write(f"{os.getpid()} {line}\\n")


@pytest.fixture(scope="session")
def part():
    log("session-up")
    yield
    log("session-down")


@pytest.fixture(scope="module")
def module(request, part):
    name = Path(request.node.nodeid).name
    log(f"module-up {name}")
    yield name
    log(f"module-down {name}")
"""

TINY_TEST = """
import os
import time
from pathlib import Path

from conftest import log


def both_parts_claimed():
    folder = Path(os.environ["TINY_CLAIMS"])
    return len({p.read_text() for p in folder.iterdir()}) >= 2


def test_one(module):
    deadline = time.monotonic() + 60
    while not both_parts_claimed():
        assert time.monotonic() < deadline, "the other part claimed no file in 60 s"
        time.sleep(0.05)
    log(f"ran {module}::one")


def test_two(module):
    log(f"ran {module}::two")
"""


@pytest.mark.process
def test_two_parts_claiming_as_they_go_run_every_file_once(tmp_path: Path) -> None:
    """Two pytest sessions on one claim folder, over a tiny folder of four files: every
    file's tests ran once, in one part, with its module fixture set up once and torn
    down after its last test, one session fixture a part; a third part finds every
    file claimed, runs none, and exits 0 too; --shard with --claims is refused."""
    tiny, claims, log = tmp_path / "tiny", tmp_path / "claims", tmp_path / "log"
    tiny.mkdir()
    claims.mkdir()
    (tiny / "pytest.ini").write_text("[pytest]\n")  # the tiny folder is the rootdir
    (tiny / "conftest.py").write_text(TINY_CONFTEST)
    files = [f"test_{x}.py" for x in "abcd"]
    for f in files:
        (tiny / f).write_text(TINY_TEST)
    env = {**os.environ, "TINY_LOG": str(log), "TINY_CLAIMS": str(claims),
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # hypothesis's alone takes 2 s to import
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(tiny)])}

    def part(*extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 "--claims", str(claims), *extra, "."], cwd=tiny, env=env,
                                text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    outs = []
    for r in [part(), part()]:
        out, _ = r.communicate(timeout=120)
        assert r.returncode == 0, out
        outs.append(out)
    late = part()
    late_out, _ = late.communicate(timeout=120)
    assert late.returncode == 0, late_out
    assert "this part ran 0 file(s)" in late_out
    both = part("--shard", "1/2")
    both_out, _ = both.communicate(timeout=120)
    assert both.returncode == pytest.ExitCode.USAGE_ERROR, both_out
    assert "give one" in both_out

    lines = [line.split(" ", 1) for line in log.read_text().splitlines()]
    ran = sorted(what for _, what in lines if what.startswith("ran "))
    assert ran == sorted(f"ran {f}::{t}" for f in files for t in ("one", "two"))
    pids = {pid for pid, _ in lines}
    assert len(pids) == 2  # both parts ran files; the late one none
    for pid in pids:
        mine = [what for p, what in lines if p == pid]
        assert mine[0] == "session-up" and mine[-1] == "session-down", mine
        assert mine.count("session-up") == 1
        for f in {w.split()[1].split("::")[0] for w in mine if w.startswith("ran ")}:
            at = [i for i, w in enumerate(mine) if f in w]  # its fixture wraps its tests
            assert mine[at[0]] == f"module-up {f}" and mine[at[-1]] == f"module-down {f}"
            assert len(at) == 4
    said = [line for out in outs for line in out.splitlines() if "this part ran" in line]
    assert sorted(f for line in said for f in line.rsplit(": ", 1)[1].split(", ")) == files
