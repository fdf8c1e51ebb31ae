"""The garbage collector's share of a trainer's time (:class:`CollectorClock`).

A full collection walks every object the process tracks; in a trainer that is
JAX's, the model's and the compiled steps' Python objects, a pause of a step's
order each time. The elastic trainer freezes what it built before its first step (they live
as long as the run) and runs a full collection while it waits for a replacement
host, when it has nothing else to do, so that the restore after the wait does
not pay for one. The clock says what the collector took of a stretch (a
restore's ``collector_s``).
"""

from __future__ import annotations

import gc
import time
from typing import Any


class CollectorClock:
    """Seconds the collector has run, and its full collections, since it was made
    (every thread's: a collection stops the process). One collection runs at a
    time, so its start and end pair up without a lock."""

    def __init__(self) -> None:
        self._began = 0.0
        self.seconds = 0.0
        self.full = 0
        gc.callbacks.append(self._on)

    def _on(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        elif self._began:
            self.seconds += now - self._began
            self.full += info.get("generation") == 2
            self._began = 0.0

    def close(self) -> None:
        if self._on in gc.callbacks:
            gc.callbacks.remove(self._on)
