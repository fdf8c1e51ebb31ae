"""docs/testing.md's test, run as written: its code block is a user's test file, run
by pytest in a process of its own with the plugin mtc installs (the ``mtc_cluster``
and ``mtc_restores`` fixtures), on a real local cluster."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from doc_blocks import python_block
from replicators import env_with_repo

pytestmark = pytest.mark.process  # it starts pytest, which starts hosts

MAX_USER_LINES = 40  # the page's promise: a test of one's own loop in under 40 lines


def doc_test() -> str:
    return python_block("docs/testing.md", "## One test, start to end")


def test_the_page_says_under_40_lines() -> None:
    assert len(doc_test().splitlines()) < MAX_USER_LINES


def test_the_docs_test_passes_as_written(tmp_path: Path) -> None:
    (tmp_path / "test_my_loop.py").write_text(doc_test())
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "test_my_loop.py"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=280, env=env_with_repo())
    assert r.returncode == 0, f"docs/testing.md's test failed:\n{r.stdout[-6000:]}\n{r.stderr}"
    assert re.search(r"\b1 passed\b", r.stdout), r.stdout
