"""The goodput benchmark's CPU accounting (bench/_cpu.py): what the hosts'
processes spend is read from /proc of real processes, per kind, per window."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench._cpu import CpuSampler, process_cpu
from mtc.testing.waits import WaitTimeout, wait_until

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


# Three threads besides the main one, alive until stdin closes; it says when they run
# (a loaded machine may take longer to start a process than any fixed wait: CI's did).
THREADS = """
import sys, threading
done = threading.Event()
[threading.Thread(target=done.wait).start() for _ in range(3)]
print("running", flush=True)
sys.stdin.read()
done.set()
"""


def _threaded(**popen: Any) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", THREADS], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, **popen)
    assert proc.stdout is not None and proc.stdout.readline() == "running\n"
    return proc


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_pinning_moves_every_thread_and_the_trainer_starts_pinned() -> None:
    from bench._pin import Pinner, pinning

    cores = sorted(os.sched_getaffinity(0))
    host, trainer = {cores[-1]}, {cores[0]}
    hostproc = _threaded()
    trainerproc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                   preexec_fn=pinning(trainer))
    try:
        with Pinner(lambda: [hostproc.pid], host, period_s=0.05) as p:
            wait_until("the pinner moving the host's 4 threads", lambda: p.moved >= 4, 5)
        tids = [int(t) for t in os.listdir(f"/proc/{hostproc.pid}/task")]
        assert len(tids) == 4 and all(os.sched_getaffinity(t) == host for t in tids)
        assert os.sched_getaffinity(trainerproc.pid) == trainer
    finally:
        for proc in (hostproc, trainerproc):
            proc.kill()
            proc.communicate()  # and closes its pipes


# A JAX process on CPU devices: it runs programs on 4 devices for about a second and
# prints, per thread name, the CPU ticks its threads spent meanwhile; then it waits to
# be pinned, and prints every thread's name and cores.
JAX_DEVICES = """
import json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp

def ticks():
    got = {}
    for t in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{t}/comm").read().strip()
            fields = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        got[name] = got.get(name, 0) + int(fields[11]) + int(fields[12])
    return got

mesh = jax.make_mesh((4,), ("d",))
x = jax.device_put(jnp.ones((4, 512, 512)), jax.NamedSharding(mesh, jax.P("d")))
step = jax.jit(lambda a: jnp.tanh(a @ a) / 512)
x = step(x).block_until_ready()
before, t = ticks(), time.monotonic()
while time.monotonic() - t < 1.0:
    x = step(x)
x.block_until_ready()
after = ticks()
print(json.dumps({k: after[k] - before.get(k, 0) for k in after}), flush=True)
sys.stdin.readline()
tasks = {}
for t in os.listdir("/proc/self/task"):
    tasks[t] = [open(f"/proc/self/task/{t}/comm").read().strip(),
                sorted(os.sched_getaffinity(int(t)))]
print(json.dumps(tasks), flush=True)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_the_device_threads_run_jaxs_cpu_devices_and_only_they_move() -> None:
    """The pinned goodput run moves only DEVICE_THREADS onto the devices' core: those
    names must be where this JAX runs its CPU devices' programs, or the run would
    measure devices that share the CPUs' core."""
    import json

    from bench._pin import DEVICE_THREADS, Pinner, pinning

    cores = sorted(os.sched_getaffinity(0))
    device, cpus = {cores[0]}, set(cores[1:])
    proc = subprocess.Popen([sys.executable, "-c", JAX_DEVICES], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, preexec_fn=pinning(cpus))
    try:
        assert proc.stdout is not None and proc.stdin is not None
        spent = json.loads(proc.stdout.readline())
        on_devices = sum(v for k, v in spent.items() if k in DEVICE_THREADS)
        assert on_devices >= 0.8 * sum(spent.values()) > 0, spent
        with Pinner(lambda: [proc.pid], device, period_s=0.05, named=DEVICE_THREADS) as p:
            wait_until("the pinner moving a device thread", lambda: p.moved, 5)
            # Two more rounds: one that began after every such thread was there.
            rounds = p.ticks + 2
            wait_until(f"the pinner's round {rounds}", lambda: p.ticks >= rounds, 5,
                       detail=lambda: f"at round {p.ticks}")
        proc.stdin.write("\n")
        proc.stdin.flush()
        tasks = json.loads(proc.stdout.readline())
        names = {name for name, _ in tasks.values()}
        assert DEVICE_THREADS <= names
        for name, on in tasks.values():
            assert set(on) == (device if name in DEVICE_THREADS else cpus), (name, on)
        assert tasks[str(proc.pid)][1] == sorted(cpus)  # the main thread stays
    finally:
        proc.kill()
        proc.wait()


def test_the_machine_probe_measures_memory_and_leaves_nothing(tmp_path: Path) -> None:
    from bench._machine import machine_state

    got = machine_state(tmp_path)
    assert set(got) == {"tmpfs_new_pages_gibps", "tmpfs_held_pages_gibps",
                        "anonymous_new_pages_gibps", "load_1m"}
    assert all(v > 0 for k, v in got.items() if k.endswith("gibps"))
    assert list(tmp_path.iterdir()) == []  # its probe file and folder are gone


def _lowered(pid: int, nice: int) -> bool:
    from bench._pin import lower

    try:  # asked again every 0.1 s: the kernel's rate limit on group changes
        wait_until(f"pid {pid}'s group at nice {nice}", lambda: lower(pid, nice), 5,
                   poll_s=0.1)
    except WaitTimeout:
        return False
    return True


def _group_nice(pid: int) -> str | None:
    """The nice of ``pid``'s scheduling group; None where the kernel shows none."""
    text = Path(f"/proc/{pid}/autogroup").read_text()
    return text.split()[-1] if text.strip() else None


def test_lowering_a_host_sets_every_thread_and_its_own_group_never_ours() -> None:
    from bench._pin import SELF_GROUP, Pinner

    # A host's process leads its own session (its own scheduling group), as the
    # local cluster starts them; a trainer shares the bench's.
    host = _threaded(start_new_session=True)
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ours = SELF_GROUP.read_text() if SELF_GROUP.exists() else None
    try:
        with Pinner(lambda: [host.pid], set(os.sched_getaffinity(0)), period_s=0.1, nice=7):
            assert _lowered(host.pid, 7)
        tids = [int(t) for t in os.listdir(f"/proc/{host.pid}/task")]
        assert len(tids) == 4
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {7}
        if ours is not None:
            assert _group_nice(host.pid) == "7"  # a session leader's group is its own
            assert _lowered(trainer.pid, 7)  # in our group: its threads only
            assert SELF_GROUP.read_text() == ours
            assert os.getpriority(os.PRIO_PROCESS, trainer.pid) == 7
    finally:
        for p in (host, trainer):
            p.kill()
            p.communicate()  # and closes its pipes


def test_a_host_is_lowered_where_our_own_process_shows_no_group(
        monkeypatch: Any, tmp_path: Path) -> None:
    """CI's runner is in the kernel's root group, whose file reads empty, while the
    hosts it starts lead their own sessions and groups: theirs is still set."""
    import bench._pin as pin

    if not Path("/proc/self/autogroup").exists():
        pytest.skip("this kernel has no autogroups")
    root = tmp_path / "autogroup"
    # A stand-in for the root group's file (a mock: this process is not in the root
    # group, and no process can join it).
    root.write_text("")
    monkeypatch.setattr(pin, "SELF_GROUP", root)
    host = _threaded(start_new_session=True)
    try:
        assert _lowered(host.pid, 7)
        assert _group_nice(host.pid) == "7"
        assert root.read_text() == ""
    finally:
        host.kill()
        host.communicate()
