"""Lets a benchmark run as ``python bench/<name>.py``: the repository and tests/
(its replicator harness) on sys.path, and the repository on PYTHONPATH for the
replicator processes it starts with ``python -m``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

for _p in (str(REPO), str(REPO / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
