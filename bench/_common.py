"""Shared by the benchmarks. Importing it lets a benchmark run as
``python bench/<name>.py``: the repository and tests/ (its replicator harness) at
the end of sys.path, and the repository at the end of PYTHONPATH for the replicator
processes it starts with ``python -m`` (``with_checkout``, as the local cluster)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _log import log as log  # the benchmarks import it from here
from _machine import machine_state

from mtc.testing.isolation import with_checkout

REPO = Path(__file__).resolve().parent.parent

# After the installed packages: an installed mtc (a wheel, as on an accelerator
# host) is the one imported, not the checkout's folders, of which only an
# install maps sidecar/ and trainer/ into mtc.
for _p in (str(REPO), str(REPO / "tests")):
    if _p not in sys.path:
        sys.path.append(_p)
# The replicator processes it starts with `python -m`: the local cluster's rule.
os.environ.update(with_checkout(dict(os.environ)))

GB = 1e9


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / GB, 3)


def summary(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    """Every sample, and throughput from the best and the median one."""
    return {"seconds": [round(s, 3) for s in seconds],
            "gbps_best": gbps(nbytes, min(seconds)),
            "gbps_median": gbps(nbytes, statistics.median(seconds))}


def run_in_scratch(prefix: str, bench: Callable[[Path], dict[str, Any]]) -> int:
    """Run ``bench`` in a fresh folder on the RAM disk and print its JSON result,
    with the machine's memory speed before and after it (``machine``).

    SIGTERM (a timeout) unwinds like Ctrl-C, so whatever ``bench`` started is
    cleaned up; on failure the last lines of the logs under ``<folder>/logs``
    are shown; the folder is removed either way."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    base = Path(tempfile.mkdtemp(prefix=prefix,
                                 dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        before = machine_state(base)
        result = bench(base)
        result["machine"] = {"before": before, "after": machine_state(base)}
    except BaseException:
        for f in sorted((base / "logs").glob("*.log")):
            log(f"{f.name}, last lines:\n{f.read_text()[-3000:]}")
        raise
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result, indent=2))
    return 0
