"""Orbax's own multi-tier client, unmodified, against mtc's real replicator.

Four JAX processes (2 slices x 2 hosts, 2 CPU devices each) run
``tests/workers/orbax_worker.py``: Orbax's ``initialize_multi_tier_checkpointing``
and ``ReplicatorCheckpointManager``, talking to four real replicator processes
(``python -m mtc_sidecar.replicator.main`` without ``--rank``) only through the
files of the GKE replicator protocol (``replicator.yaml``, restore markers,
step folders). Like GKE's CSI driver, the test writes ``jax-init-info.txt``.

Phase 1 trains steps 1..3 and waits until every replicator pushed step 3 to
its peer in the other slice. Phase 2 is a restart after trouble: host 0 lost
its RAM disk (replicator SIGKILLed, folder wiped, replicator restarted empty),
host 1 holds a bogus NEWER complete step 99 (replicated to its peer too) and
host 3 a half-written ``7.orbax-checkpoint-tmp``. All four restarted processes
must be told the same step (3, the newest on every peer group), see no other
step, restore exactly the saved values (host 0 from data its replicator
fetched from host 2), and save step 4 together -- a step-set mismatch would
deadlock Orbax's save barrier, which the timeouts turn into a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from replicators import Cluster, free_ports

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "workers" / "orbax_worker.py"
RESULT_PREFIX = "ORBAX_RESULT "
HOSTS, PER_SLICE, DEVICES_PER_PROCESS = 4, 2, 2
STEPS = 3
PHASE_TIMEOUT_S = 60.0
FAILURE_GRACE_S = 10.0  # after one process fails, the others are stuck in a collective
REPLICA = ".mtc-replica"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", MTC_ORBAX_NUM_PROCESSES=str(HOSTS),
               XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _tail(path: Path, n: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text if len(text) <= n else "..." + text[-n:]


def run_job(phase: str, cluster: Cluster, logs: Path) -> list[dict[str, Any]]:
    """One job of HOSTS processes; every one must exit 0 and report. Stragglers are SIGKILLed."""
    (port,) = free_ports(1)
    for i in range(HOSTS):  # what GKE's multi-tier CSI driver does
        cluster.root(i).mkdir(parents=True, exist_ok=True)
        (cluster.root(i) / "jax-init-info.txt").write_text(f"{i}\n127.0.0.1:{port}\n")
    procs: list[subprocess.Popen[bytes]] = []
    outs = [logs / f"{phase}-{i}.log" for i in range(HOSTS)]
    try:
        for i in range(HOSTS):
            with outs[i].open("wb") as fo:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), "--local-dir", str(cluster.root(i)),
                     "--phase", phase, "--steps", str(STEPS), "--num-slices",
                     str(HOSTS // PER_SLICE)],
                    cwd=REPO, env=_env(), stdout=fo, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: JAX traps SIGTERM and waits on a shutdown barrier
            p.wait()
    rcs = [p.returncode for p in procs]
    if any(rc != 0 for rc in rcs):
        detail = "\n".join(f"--- {phase} process {i} rc={rc}\n{_tail(outs[i])}\n"
                           f"--- replicator {i}\n{_tail(cluster.logs / f'replicator-{i}.log')}"
                           for i, rc in enumerate(rcs))
        pytest.fail(f"{phase}: exit codes {rcs}\n{detail}")
    results = []
    for i, out in enumerate(outs):
        lines = [ln for ln in out.read_text().splitlines() if ln.startswith(RESULT_PREFIX)]
        assert len(lines) == 1, f"{phase} process {i} reported {len(lines)} results"
        results.append(json.loads(lines[0][len(RESULT_PREFIX):]))
    assert sorted(r["process"] for r in results) == list(range(HOSTS))
    return sorted(results, key=lambda r: r["process"])


def expected_w(step: int, rows: int, cols: int) -> np.ndarray:
    return np.arange(rows * cols, dtype=np.float32).reshape(rows, cols) * 10.0 + step


def check_restored(r: dict[str, Any], step: int) -> None:
    w = expected_w(step, r["rows"], r["cols"])
    s = np.full((r["cols"] // 2,), step, np.int32)
    for name, full in (("w", w), ("step", s)):
        shards = r["shards"][name]
        assert shards, f"process {r['process']}: no {name} shards"
        for sh in shards:
            idx = tuple(slice(a, b) for a, b in sh["index"])
            np.testing.assert_array_equal(np.asarray(sh["data"], full.dtype), full[idx],
                                          err_msg=f"process {r['process']} {name}{idx}")


def descriptor(cluster: Cluster, holder: int, origin: int, step: int) -> list[Any]:
    return json.loads((cluster.root(holder) / REPLICA / str(origin) / f"{step}.files.json")
                      .read_text())


def wait_holds(cluster: Cluster, holders: list[int], origin: int, step: int,
               timeout: float = 30.0) -> None:
    """Until each of ``holders`` (serving replicators) holds ``origin``'s ``step``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(any((c.origin_rank, c.step) == (origin, step)
                   for c in cluster.inventory(h).copies) for h in holders):
            return
        time.sleep(0.05)
    raise TimeoutError(f"{holders} do not hold step {step} of rank {origin} after {timeout}s")


@pytest.mark.timeout(240)
def test_orbax_client_restarts_on_replicated_step(ramdisk: Path) -> None:
    t0 = time.monotonic()
    logs = ramdisk / "logs"
    cluster = Cluster(ramdisk, HOSTS, PER_SLICE, extra=("--replicas", "1"), metrics=True,
                      orbax=True)
    peer = {h: (h + PER_SLICE) % HOSTS for h in range(HOSTS)}
    try:
        for h in range(HOSTS):
            cluster.root(h).mkdir(parents=True)
            cluster.launch(h)  # serves once Orbax's replicator.yaml told it its rank

        # -- phase 1: a fresh job trains steps 1..3 -------------------------------------
        first = run_job("train", cluster, logs)
        for r in first:
            assert r["steps_at_start"] == [] and r["latest_at_start"] is None, r
            assert max(r["steps_at_end"]) == STEPS, r
        cluster.wait_replicated(STEPS, timeout=30)
        for o in range(HOSTS):
            assert descriptor(cluster, peer[o], o, STEPS), f"no copy of {o}'s step on its peer"
        t1 = time.monotonic()

        # -- trouble between the jobs ----------------------------------------------------
        # Host 0 is replaced: its RAM disk is gone, its replicator starts empty.
        cluster.kill(0)
        shutil.rmtree(cluster.root(0))
        cluster.root(0).mkdir()
        cluster.launch(0)
        # Host 1 holds a NEWER complete step nobody else has a counterpart of.
        bogus = cluster.root(1) / ".planting"
        shutil.copytree(cluster.root(1) / str(STEPS), bogus, symlinks=True)
        os.rename(bogus, cluster.root(1) / "99")
        wait_holds(cluster, [1, peer[1]], origin=1, step=99)  # even replicated
        # Host 3 holds a half-written step from a crashed save.
        partial = cluster.root(3) / "7.orbax-checkpoint-tmp"
        shutil.copytree(cluster.root(3) / str(STEPS), partial, symlinks=True)
        (partial / "commit_success.txt").unlink()

        # -- phase 2: the restarted job --------------------------------------------------
        second = run_job("restart", cluster, logs)
        for r in second:
            # Every host was told the same step, the newest every peer group holds,
            # and saw no other step folder (not 99, not the partial 7).
            assert r["restored_step"] == STEPS, r
            assert r["steps_at_start"] == [STEPS] and r["latest_at_start"] == STEPS, r
            assert [n for n in r["visible_at_start"] if n.isdigit()] == [str(STEPS)], r
            assert r["shardings_ok"], r
            check_restored(r, STEPS)
            # The save after the restore went through Orbax's barriers on every host.
            assert max(r["steps_at_end"]) == STEPS + 1, r

        # Host 0's data came from its peer (host 2), byte for byte what host 0 saved.
        copy = cluster.root(0) / REPLICA / "0" / str(STEPS)
        assert copy.is_dir()
        assert os.path.realpath(cluster.root(0) / str(STEPS)) == os.path.realpath(copy)
        files = descriptor(cluster, 0, 0, STEPS)
        assert files == descriptor(cluster, peer[0], 0, STEPS)
        assert any(f[0].startswith("state/ocdbt.process_0/") for f in files), files
        fetched = {h: cluster.scrape(h).get("mtc_restore_bytes_fetched_total", 0.0)
                   for h in range(HOSTS)}
        assert fetched[0] == sum(f[1] for f in files) > 0, fetched
        assert fetched[1] == fetched[2] == fetched[3] == 0, fetched
        assert "told the client to restore step 3" in cluster.log_text(0)
        # The bogus step is parked out of the client's sight, not deleted or used.
        assert not (cluster.root(1) / "99").exists()
        assert (cluster.root(1) / REPLICA / "1" / "99").is_dir()
        for h in range(HOSTS):
            marker = [n for n in os.listdir(cluster.root(h)) if n.endswith(".restore")]
            assert marker == [], f"host {h} still has restore markers {marker}"

        # Replication goes on after the restore dance.
        cluster.wait_replicated(STEPS + 1, timeout=30)
        print(f"phase 1 {t1 - t0:.1f}s, phase 2 {time.monotonic() - t1:.1f}s")
    finally:
        cluster.stop_all()
