"""CPU seconds of a set of processes over time, read from ``/proc``.

The simulated hosts' sidecars and replicators share this machine's cores with
the trainer, whose CPU devices stand in for accelerators: what they spend is
what the steps lose. A benchmark samples them while it runs and reports their
share of a window (``CpuSampler.seconds``)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Self

CLK_TCK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> tuple[int, float] | None:
    """(start time in clock ticks, user + system CPU seconds) of ``pid``, or None
    when it is gone. The start time tells a reused pid from the process before."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # After the command's closing parenthesis: utime, stime are the 12th and 13th
    # fields, starttime the 20th (proc(5), counted from the state field).
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / CLK_TCK


class Periodic:
    """A thread that calls :meth:`tick` every ``period_s`` while entered; whoever
    enters it joins the thread on exit."""

    def __init__(self, name: str, period_s: float) -> None:
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.tick()
            if self._stop.wait(self._period):
                return

    def tick(self) -> None:
        raise NotImplementedError


class CpuSampler(Periodic):
    """Samples, every ``period_s``, the CPU of the processes ``pids()`` names by
    kind (asked anew each time: replaced hosts get new processes). Whoever
    enters it joins its thread on exit. A process counts from its first sample
    to its last, so up to one period of its CPU at either end is missed."""

    def __init__(self, pids: Callable[[], dict[str, list[int]]], period_s: float = 0.5) -> None:
        super().__init__("cpu-sampler", period_s)
        self._pids = pids
        # (pid, start time) -> (kind, [(wall time, CPU seconds)])
        self.series: dict[tuple[int, int], tuple[str, list[tuple[float, float]]]] = {}

    def tick(self) -> None:
        self.sample()

    def sample(self) -> None:
        now = time.time()
        try:
            groups = self._pids()
        except (OSError, ValueError, KeyError):
            return  # the cluster's file is being replaced: next time
        for kind, pids in groups.items():
            for pid in pids:
                got = process_cpu(pid)
                if got is not None:
                    self.series.setdefault((pid, got[0]), (kind, []))[1].append((now, got[1]))

    def seconds(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds per kind spent between wall times ``t0`` and ``t1``."""
        out: dict[str, float] = {}
        for kind, points in self.series.values():
            within = [cpu for t, cpu in points if t0 <= t <= t1]
            out[kind] = out.get(kind, 0.0) + (within[-1] - within[0] if within else 0.0)
        return out
