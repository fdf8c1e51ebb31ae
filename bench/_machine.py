"""How fast this machine's memory is right now, beside a benchmark's figures.

Imported by the benchmarks (and a test) without side effects: unlike ``_common``,
it changes neither ``sys.path`` nor the environment."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

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
