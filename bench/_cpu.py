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


def core_ticks() -> dict[int, tuple[int, int]]:
    """Per core: (steal, all) clock ticks since boot, from ``/proc/stat``. Steal is
    the time a VM's core was ready to run and the hypervisor ran something else:
    on a shared VM, what slows steps that nothing on the machine itself took."""
    out: dict[int, tuple[int, int]] = {}
    with open("/proc/stat") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name[3:].isdigit():
                # user nice system idle iowait irq softirq steal (proc(5)); the guest
                # fields after them are already counted in user and nice.
                ticks = [int(v) for v in rest.split()[:8]]
                out[int(name[3:])] = (ticks[7] if len(ticks) > 7 else 0, sum(ticks))
    return out


class Periodic:
    """A thread that calls :meth:`tick` every ``period_s`` while entered; whoever
    enters it joins the thread on exit."""

    def __init__(self, name: str, period_s: float) -> None:
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.ticks = 0  # ticks done: what a test waits on for a whole round more

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.tick()
            self.ticks += 1
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
        self.cores: list[tuple[float, dict[int, tuple[int, int]]]] = []  # core_ticks()

    def tick(self) -> None:
        self.sample()

    def sample(self) -> None:
        now = time.time()
        try:
            self.cores.append((now, core_ticks()))
        except OSError:
            pass  # no /proc/stat: no steal figures
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

    def steal(self, t0: float, t1: float) -> dict[int, float]:
        """Per core, the share of its time between wall times ``t0`` and ``t1`` that
        the hypervisor gave to others (empty with fewer than two samples there)."""
        within = [ticks for t, ticks in self.cores if t0 <= t <= t1]
        if len(within) < 2:
            return {}
        a, b = within[0], within[-1]
        return {k: (b[k][0] - a[k][0]) / (b[k][1] - a[k][1])
                for k in sorted(b) if k in a and b[k][1] > a[k][1]}
