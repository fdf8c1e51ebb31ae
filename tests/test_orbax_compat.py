"""Orbax's own multi-tier client, unmodified, against mtc's real replicator, on
hosts that share nothing.

Four isolated hosts (``mtc.testing.isolation``: with root each its own network
namespace, an address on a bridge, and a private tmpfs RAM disk; otherwise
separate processes over private folders), 2 slices x 2 hosts. On each host, a
JAX process (2 CPU devices) runs ``tests/workers/orbax_worker.py``: Orbax's
``initialize_multi_tier_checkpointing`` and ``ReplicatorCheckpointManager``,
joined into one job by ``jax.distributed`` over the bridge, talking to its
host's real replicator (``python -m mtc.sidecar.replicator.main`` without
``--rank``) only through the files of the GKE replicator protocol
(``replicator.yaml``, restore markers, step folders) on its own RAM disk. Like
GKE's CSI driver, the test writes ``jax-init-info.txt``; it does so, and
inspects or damages a host's files, from a process inside that host.

Phase 1 trains steps 1..3 and waits until every replicator pushed step 3 to
its peer in the other slice. Phase 2 is a restart after trouble: host 0 is
replaced (every process SIGKILLed, its RAM disk gone, started empty), host 1
holds a bogus NEWER complete step 99 (replicated to its peer too) and host 3 a
half-written ``7.orbax-checkpoint-tmp``. All four restarted processes must be
told the same step (3, the newest on every peer group), see no other step,
restore exactly the saved values (host 0 from data its replicator fetched from
host 2 over the network), and save step 4 together -- a step-set mismatch would
deadlock Orbax's save barrier, which the timeouts turn into a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from replicators import scrape
from xla_flags import cpu_flags

from mtc.ports import free_ports
from mtc.testing.isolation import Hosts
from mtc.testing.replicas import HostReplicators
from mtc.testing.waits import wait_exits

pytestmark = pytest.mark.process  # every test here starts processes

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "workers" / "orbax_worker.py"
RESULT_PREFIX = "ORBAX_RESULT "
HOSTS, PER_SLICE, DEVICES_PER_PROCESS = 4, 2, 2
STEPS = 3
PHASE_TIMEOUT_S = 60.0
FAILURE_GRACE_S = 10.0  # after one process fails, the others are stuck in a collective
REPLICA = ".mtc-replica"
COORDINATOR_PORT, METRICS_PORT = 7300, 7301  # inside the hosts' namespaces


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", MTC_ORBAX_NUM_PROCESSES=str(HOSTS),
               XLA_FLAGS=cpu_flags(DEVICES_PER_PROCESS))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _tail(path: Path, n: int = 3000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text if len(text) <= n else "..." + text[-n:]


# What the test does on a host, run by a Python process inside it (argv[1]: the root).
ON_HOST = {
    "init_info": "open(f'{root}/jax-init-info.txt', 'w').write(arg)",
    "descriptor": "out = json.load(open(f'{root}/.mtc-replica/{arg}.files.json'))",
    "plant_newer": (  # host 1: a complete step 99 nobody else has a counterpart of
        "shutil.copytree(f'{root}/{arg}', f'{root}/.planting', symlinks=True); "
        "os.rename(f'{root}/.planting', f'{root}/99')"),
    "plant_partial": (  # host 3: a half-written step from a crashed save
        "shutil.copytree(f'{root}/{arg}', f'{root}/7.orbax-checkpoint-tmp', symlinks=True); "
        "os.unlink(f'{root}/7.orbax-checkpoint-tmp/commit_success.txt')"),
    "after_restart": (
        "out = {'names': sorted(os.listdir(root)), "
        "'real_step': os.path.realpath(f'{root}/{arg}'), "
        "'real_copy': os.path.realpath(f'{root}/.mtc-replica/0/{arg}'), "
        "'copy_is_dir': os.path.isdir(f'{root}/.mtc-replica/0/{arg}'), "
        "'parked_99': os.path.isdir(f'{root}/.mtc-replica/1/99')}"),
}


class OrbaxHosts(HostReplicators):
    """Four isolated hosts, each with its replicator (Orbax mode: no ``--rank``);
    what they hold and the waits on it are
    :class:`~mtc.testing.replicas.HostReplicators`'."""

    def __init__(self, base: Path) -> None:
        hosts = Hosts(base / "hosts", HOSTS, ramdisk_bytes=512 << 20)
        super().__init__(hosts, [hosts.replicator_address(i) for i in range(HOSTS)], PER_SLICE)
        self.logs = base / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        ns = self.hosts.isolation == "namespaces"
        self.coordinator = COORDINATOR_PORT if ns else free_ports(1)[0]
        self.metrics = [METRICS_PORT] * HOSTS if ns else free_ports(HOSTS)

    def root(self, i: int) -> Path:
        return self.hosts.hosts[i].root

    def start_host(self, *hosts: int) -> None:
        """The hosts' sidecars (each owns its host's namespaces and mounts the RAM
        disk), all at once, then their replicators, each of which serves once Orbax's
        replicator.yaml told it its rank."""
        for i in hosts:
            self.hosts.start_sidecar(i, [h // PER_SLICE for h in range(HOSTS)], env=_env(),
                                     wait=False)
        for i in hosts:
            self.hosts.wait_sidecar(i)
        for i in hosts:
            self.hosts.start_replicator(i, [
                "--local-dir", str(self.root(i)), "--listen", self.addrs[i],
                "--nodes", ",".join(self.addrs), "--replicas", "1", "--poll-seconds", "0.05",
                "--metrics-port", str(self.metrics[i]),
                "--metrics-address", self.hosts.hosts[i].address], env=_env())

    def lose_host(self, i: int) -> None:
        """Every process of host ``i`` SIGKILLed, its RAM disk gone with them."""
        self.hosts.lose(i)

    def on_host(self, i: int, what: str, arg: str = "") -> Any:
        """Run ``ON_HOST[what]`` in a process inside host ``i``; its ``out`` comes back."""
        code = ("import json, os, shutil, sys; root, arg = sys.argv[1], sys.argv[2]; out = None; "
                + ON_HOST[what] + "; print(json.dumps(out))")
        h = self.hosts.hosts[i]
        r = subprocess.run(h.wrap([sys.executable, "-c", code, str(h.root), arg]),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"{what} on host {i}: {r.stderr[-2000:]}"
        return json.loads(r.stdout)

    def worker(self, i: int, phase: str, log: Path) -> subprocess.Popen[bytes]:
        h = self.hosts.hosts[i]
        argv = [sys.executable, str(WORKER), "--local-dir", str(h.root), "--phase", phase,
                "--steps", str(STEPS), "--num-slices", str(HOSTS // PER_SLICE)]
        if self.hosts.isolation == "namespaces":
            # The host's own name resolves to its address, as on a real host (JAX's
            # CPU collectives tell their peers where to connect by it).
            argv = ["unshare", "--uts", "--", "sh", "-c", f'hostname {h.address} && exec "$@"',
                    "sh", *argv]
        with log.open("wb") as fo:
            return subprocess.Popen(
                h.wrap(argv),
                cwd=REPO, env=_env(), stdout=fo, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL)

    def scrape(self, i: int) -> dict[str, float]:
        """Host ``i``'s replicator's Prometheus samples (over the bridge)."""
        return scrape(f"http://{self.hosts.hosts[i].address}:{self.metrics[i]}/metrics")


def run_job(phase: str, cluster: OrbaxHosts, logs: Path) -> list[dict[str, Any]]:
    """One job of HOSTS processes; every one must exit 0 and report. Stragglers are SIGKILLed."""
    coordinator = f"{cluster.hosts.hosts[0].address}:{cluster.coordinator}"
    for i in range(HOSTS):  # what GKE's multi-tier CSI driver does
        cluster.on_host(i, "init_info", f"{i}\n{coordinator}\n")
    procs: list[subprocess.Popen[bytes]] = []
    outs = [logs / f"{phase}-{i}.log" for i in range(HOSTS)]
    try:
        for i in range(HOSTS):
            procs.append(cluster.worker(i, phase, outs[i]))
        wait_exits(procs, PHASE_TIMEOUT_S, grace_s=FAILURE_GRACE_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: JAX traps SIGTERM and waits on a shutdown barrier
            p.wait()
    rcs = [p.returncode for p in procs]
    if any(rc != 0 for rc in rcs):
        detail = "\n".join(f"--- {phase} process {i} rc={rc}\n{_tail(outs[i])}\n"
                           f"--- replicator {i}\n{cluster.log_text(i)[-3000:]}"
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


def descriptor(cluster: OrbaxHosts, holder: int, origin: int, step: int) -> list[Any]:
    found: list[Any] = cluster.on_host(holder, "descriptor", f"{origin}/{step}")
    return found


@pytest.mark.timeout(240)
def test_orbax_client_restarts_on_replicated_step(ramdisk: Path) -> None:
    t0 = time.monotonic()
    logs = ramdisk / "logs"
    cluster = OrbaxHosts(ramdisk)
    peer = {h: (h + PER_SLICE) % HOSTS for h in range(HOSTS)}
    try:
        cluster.start_host(*range(HOSTS))

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
        # Host 0 is replaced: its processes SIGKILLed, its RAM disk gone, started empty.
        cluster.lose_host(0)
        cluster.start_host(0)
        # Host 1 holds a NEWER complete step nobody else has a counterpart of.
        cluster.on_host(1, "plant_newer", str(STEPS))
        cluster.wait_held({(1, 1, 99), (peer[1], 1, 99)}, timeout=30)  # even replicated
        # Host 3 holds a half-written step from a crashed save.
        cluster.on_host(3, "plant_partial", str(STEPS))

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
        seen = {h: cluster.on_host(h, "after_restart", str(STEPS)) for h in range(HOSTS)}
        assert seen[0]["copy_is_dir"]
        assert seen[0]["real_step"] == seen[0]["real_copy"]
        files = descriptor(cluster, 0, 0, STEPS)
        assert files == descriptor(cluster, peer[0], 0, STEPS)
        assert any(f[0].startswith("state/ocdbt.process_0/") for f in files), files
        fetched = {h: cluster.scrape(h).get("mtc_restore_bytes_fetched_total", 0.0)
                   for h in range(HOSTS)}
        assert fetched[0] == sum(f[1] for f in files) > 0, fetched
        assert fetched[1] == fetched[2] == fetched[3] == 0, fetched
        assert "told the client to restore step 3" in cluster.log_text(0)
        # The step no other host has is out of the client's sight and fenced off: a
        # restore of step 3 was agreed, so 99 can only be a save that never finished
        # everywhere, and an Orbax step names no run that would keep a later 99 of
        # the resumed job apart from it.
        assert "99" not in seen[1]["names"]
        assert not seen[1]["parked_99"]
        assert "fenced off steps newer than the agreed step 3" in cluster.log_text(1)
        for h in range(HOSTS):
            marker = [n for n in seen[h]["names"] if n.endswith(".restore")]
            assert marker == [], f"host {h} still has restore markers {marker}"
        if cluster.hosts.isolation == "namespaces":  # nothing of a host is visible here
            assert all(not any(cluster.root(h).iterdir()) for h in range(HOSTS))

        # Replication goes on after the restore dance.
        cluster.wait_replicated(STEPS + 1, timeout=30)
        print(f"phase 1 {t1 - t0:.1f}s, phase 2 {time.monotonic() - t1:.1f}s")
    finally:
        cluster.hosts.down()
