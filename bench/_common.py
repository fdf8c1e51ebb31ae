"""Shared by the benchmarks. Importing it lets a benchmark run as
``python bench/<name>.py``: the repository and tests/ (its replicator harness) on
sys.path, and the repository on PYTHONPATH for the replicator processes it starts
with ``python -m``."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

for _p in (str(REPO), str(REPO / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)

GB = 1e9


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / GB, 3)


def summary(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    """Every sample, and throughput from the best and the median one."""
    return {"seconds": [round(s, 3) for s in seconds],
            "gbps_best": gbps(nbytes, min(seconds)),
            "gbps_median": gbps(nbytes, statistics.median(seconds))}
