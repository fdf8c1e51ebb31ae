"""The goodput benchmark's CPU accounting (bench/_cpu.py): what the hosts'
processes spend is read from /proc of real processes, per kind, per window."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_pinning_moves_every_thread_and_the_trainer_starts_pinned() -> None:
    from bench._pin import Pinner, pinning

    cores = sorted(os.sched_getaffinity(0))
    host, trainer = {cores[-1]}, {cores[0]}
    threads = "import threading, time\n" \
              "[threading.Thread(target=time.sleep, args=(5,)).start() for _ in range(3)]\n" \
              "time.sleep(5)\n"
    hostproc = subprocess.Popen([sys.executable, "-c", threads])
    trainerproc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"],
                                   preexec_fn=pinning(trainer))
    try:
        time.sleep(0.5)  # its threads started
        with Pinner(lambda: [hostproc.pid], host, period_s=0.05) as p:
            deadline = time.monotonic() + 5
            while p.moved < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
        tids = [int(t) for t in os.listdir(f"/proc/{hostproc.pid}/task")]
        assert len(tids) == 4 and all(os.sched_getaffinity(t) == host for t in tids)
        assert os.sched_getaffinity(trainerproc.pid) == trainer
    finally:
        for proc in (hostproc, trainerproc):
            proc.kill()
            proc.wait()


def test_the_machine_probe_measures_memory_and_leaves_nothing(tmp_path: Path) -> None:
    from bench._machine import machine_state

    got = machine_state(tmp_path)
    assert set(got) == {"tmpfs_new_pages_gibps", "tmpfs_held_pages_gibps",
                        "anonymous_new_pages_gibps", "load_1m"}
    assert all(v > 0 for k, v in got.items() if k.endswith("gibps"))
    assert list(tmp_path.iterdir()) == []  # its probe file and folder are gone
