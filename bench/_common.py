"""Shared by the benchmarks. Importing it lets a benchmark run as
``python bench/<name>.py``: the repository and tests/ (its replicator harness) on
sys.path, and the repository on PYTHONPATH for the replicator processes it starts
with ``python -m``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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


PROBE_BYTES = 64 << 20


def machine_state(folder: Path | None = None) -> dict[str, float]:
    """How fast this machine's memory is right now, beside a benchmark's figures: this
    VM's page cost changes by 2 to 3x within and between sessions, and a ratio
    whose reference and measurement met different page costs moves with it. GiB/s
    writing ``PROBE_BYTES`` into new tmpfs pages (in ``folder``, the RAM disk) and
    into the same pages again, and filling new anonymous memory; the load average."""
    import numpy as np

    where = Path(tempfile.mkdtemp(prefix="mtc-probe-", dir=folder or
                                  ("/dev/shm" if os.path.isdir("/dev/shm") else None)))
    data = np.ones(PROBE_BYTES, np.uint8)
    out: dict[str, float] = {}
    try:
        path = where / "probe"
        for name, flags in (("tmpfs_new_pages_gibps", os.O_CREAT | os.O_EXCL),
                            ("tmpfs_held_pages_gibps", 0)):
            fd = os.open(path, os.O_WRONLY | flags, 0o600)
            try:
                t = time.perf_counter()
                view, done = data.data, 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], done)
                out[name] = round(PROBE_BYTES / (time.perf_counter() - t) / 2**30, 2)
            finally:
                os.close(fd)
        t = time.perf_counter()
        fresh = np.empty(PROBE_BYTES, np.uint8)
        fresh.fill(1)
        out["anonymous_new_pages_gibps"] = round(PROBE_BYTES / (time.perf_counter() - t)
                                                 / 2**30, 2)
        del fresh
    finally:
        shutil.rmtree(where, ignore_errors=True)
    out["load_1m"] = round(os.getloadavg()[0], 2)
    return out


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
