"""Multi-controller JAX: real OS processes, one per host, saving and restoring.

Each case starts N processes (2 CPU devices each) that join one JAX job on
localhost, save two steps of a state with a sharded array, a replicated array,
a typed PRNG key, a numpy array and plain values, and restore them onto the
saved sharding and onto other shardings; then a second job on the same
``local_dir`` (a restart) restores ``latest_step()`` into
``jax.ShapeDtypeStruct`` targets and saves step 3; a third job, after the
last host lost step 3, must agree everywhere on step 2. The workers
(``tests/workers/mc_worker.py``) check every addressable shard against numpy
and report in one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "workers" / "mc_worker.py"
RESULT_PREFIX = "MC_RESULT "
DEVICES_PER_PROCESS = 2
PHASE_TIMEOUT_S = 120.0
# After one process fails, how long the others get to finish before SIGKILL.
FAILURE_GRACE_S = 10.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def run_job(phase: str, num_processes: int, local_dir: Path, logs: Path) -> list[dict[str, Any]]:
    """Run one phase in ``num_processes`` processes; every one must exit 0 and report."""
    port = _free_port()
    env = _env()
    procs: list[subprocess.Popen[bytes]] = []
    outs: list[Path] = []
    errs: list[Path] = []
    try:
        for i in range(num_processes):
            out, err = logs / f"{phase}-{i}.out", logs / f"{phase}-{i}.err"
            outs.append(out)
            errs.append(err)
            with out.open("wb") as fo, err.open("wb") as fe:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), "--phase", phase, "--process-id", str(i),
                     "--num-processes", str(num_processes), "--port", str(port),
                     "--local-dir", str(local_dir)],
                    cwd=REPO, env=env, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                # A failed process leaves its peers stuck in a collective.
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            time.sleep(0.05)
        timed_out = [i for i, p in enumerate(procs) if p.poll() is None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: JAX traps SIGTERM and waits minutes on a barrier
        for p in procs:
            p.wait(timeout=30)

    stdout = [o.read_text(errors="replace") for o in outs]
    stderr = [e.read_text(errors="replace") for e in errs]
    report = "\n".join(
        f"--- {phase} process {i}: rc={p.returncode}\nstdout:\n{_tail(stdout[i])}\n"
        f"stderr:\n{_tail(stderr[i])}" for i, p in enumerate(procs))
    assert not timed_out, f"{phase}: processes {timed_out} still running after " \
                          f"{PHASE_TIMEOUT_S:.0f} s (killed)\n{report}"
    assert all(p.returncode == 0 for p in procs), f"{phase}: a process failed\n{report}"
    results = []
    for i, text in enumerate(stdout):
        lines = [line for line in text.splitlines() if line.startswith(RESULT_PREFIX)]
        assert len(lines) == 1, f"{phase}: process {i} printed no result line\n{report}"
        results.append(json.loads(lines[0][len(RESULT_PREFIX):]))
    return results


def check_results(phase: str, results: list[dict[str, Any]], num_processes: int) -> None:
    assert [r["process_index"] for r in results] == list(range(num_processes))
    for r in results:
        assert r["process_count"] == num_processes
        assert r["num_devices"] == num_processes * DEVICES_PER_PROCESS
        assert len(r["local_devices"]) == DEVICES_PER_PROCESS
    errors = [e for r in results for e in r["errors"]]
    assert not errors, f"{phase}: {len(errors)} mismatches:\n" + "\n".join(errors[:40])
    for r in results:
        assert r["checks"] >= 20, f"{phase}: process {r['process_index']} ran too few checks"


@pytest.fixture
def shm_dir(tmp_path: Path) -> Any:
    """A RAM-disk folder (tmpfs under /dev/shm when there is one), removed afterwards."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="mtc-mc-", dir=base or tmp_path))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(3 * PHASE_TIMEOUT_S + 60)
@pytest.mark.parametrize("num_processes", [2, 4])
def test_save_restore_and_restart(num_processes: int, shm_dir: Path, tmp_path: Path) -> None:
    local_dir = shm_dir / "ramdisk"
    logs = tmp_path / "logs"
    logs.mkdir()

    results = run_job("train", num_processes, local_dir, logs)
    check_results("train", results, num_processes)
    for r in results:
        assert r["all_steps"] == [1, 2]
    # Every process wrote its own host folder, and nothing else is there.
    hosts = sorted(p.name for p in local_dir.iterdir())
    assert hosts == [f"host-{i}" for i in range(num_processes)]
    for h in hosts:
        assert sorted(p.name for p in (local_dir / h).iterdir()) == ["1", "2"], h

    # Job restart: new processes, same local_dir.
    results = run_job("restart", num_processes, local_dir, logs)
    check_results("restart", results, num_processes)
    for r in results:
        assert r["latest_step"] == 2
    for h in hosts:
        assert sorted(p.name for p in (local_dir / h).iterdir()) == ["2", "3"], h

    # The last host lost its newest step (its RAM disk was wiped of it, or its
    # save never committed): a new job must agree everywhere on step 2.
    shutil.rmtree(local_dir / f"host-{num_processes - 1}" / "3")
    results = run_job("partial", num_processes, local_dir, logs)
    check_results("partial", results, num_processes)
    for r in results:
        assert r["all_steps"] == [2] and r["latest_step"] == 2


@pytest.mark.timeout(2 * PHASE_TIMEOUT_S + 60)
def test_restart_on_fewer_processes(shm_dir: Path, tmp_path: Path) -> None:
    """Two hosts save; the job comes back as one process (one host) on the same
    shared ``local_dir``: every shard is still visible there, so the restore
    must read host-1's shards as well as its own."""
    local_dir = shm_dir / "ramdisk"
    logs = tmp_path / "logs"
    logs.mkdir()
    check_results("train", run_job("train", 2, local_dir, logs), 2)
    results = run_job("shrink", 1, local_dir, logs)
    check_results("shrink", results, 1)
    assert results[0]["saved_hosts"] == ["host-0", "host-1"]
    assert results[0]["latest_step"] == 2


@pytest.mark.timeout(PHASE_TIMEOUT_S + 60)
def test_restore_right_after_save_with_a_lagging_process(shm_dir: Path, tmp_path: Path) -> None:
    """Process 0 starts its save 2 s after process 1; with ``max_to_keep=None``
    (the replicator owns retention) no retention collective lines them up, so
    ``wait_until_finished`` and ``restore`` must themselves make a step committed
    on one host readable by the others."""
    logs = tmp_path / "logs"
    logs.mkdir()
    results = run_job("skew", 2, shm_dir / "ramdisk", logs)
    check_results("skew", results, 2)
    for r in results:
        assert r["all_steps"] == [1]
