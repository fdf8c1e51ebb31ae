"""The goodput benchmark's CPU accounting (bench/_cpu.py): what the hosts'
processes spend is read from /proc of real processes, per kind, per window."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench._cpu import CpuSampler, process_cpu

pytestmark = pytest.mark.process  # every test here starts processes

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_cpu_is_counted_per_kind_within_the_window_and_across_replaced_processes() -> None:
    burners = [subprocess.Popen([sys.executable, "-c", BURN.format(s=0.6)])]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
    current = {"busy": burners[0]}
    try:
        with CpuSampler(lambda: {"busy": [current["busy"].pid], "idle": [sleeper.pid]},
                        period_s=0.05) as cpu:
            t0 = time.time()
            burners[0].wait()
            # The "host" is replaced: a new process of the same kind, a new pid.
            current["busy"] = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.6)])
            burners.append(current["busy"])
            current["busy"].wait()
            t1 = time.time()
        used = cpu.seconds(t0, t1)
        before = cpu.seconds(0.0, t0 - 1.0)
    finally:
        for p in [*burners, sleeper]:
            p.kill()
            p.wait()
    # Both burners' CPU (less up to one period at either end of each), none of
    # the sleeper's, and nothing before the window.
    assert 0.9 <= used["busy"] <= 1.3, used
    assert used["idle"] < 0.1, used
    assert before == {"busy": 0.0, "idle": 0.0}
    assert len({key for key in cpu.series}) == 3  # two burners and the sleeper
    assert process_cpu(sleeper.pid) is None  # reaped: gone


def test_a_window_without_samples_counts_nothing() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    cpu = CpuSampler(lambda: {"x": [proc.pid]})
    cpu.sample()  # gone: nothing recorded
    assert cpu.seconds(0.0, time.time()) == {}
