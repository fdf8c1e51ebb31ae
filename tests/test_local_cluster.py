"""The local cluster (``mtc.testing.local_cluster.LocalCluster``, what ``make demo`` and the
elastic tests run on): up, lose a host, restart it, down; backups to the GCS emulator.

(Apart from tests/test_elastic_demo.py, whose two demo runs take most of a minute
each: the process lane is dealt out by whole files, tests/lane_parts.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.testing.local_cluster import LocalCluster

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.process
def test_cluster_up_kill_restart_down(ramdisk: Path, mesh: Mesh) -> None:
    """Hosts that share nothing: a step saved through the sidecars is on every
    host's RAM disk (the hosts say so) and, with namespaces, invisible here; a
    lost host comes back on its address with an empty RAM disk; ``down`` leaves
    no process, namespace or folder."""
    base = ramdisk / "cluster"
    c = LocalCluster.up(base)
    namespaces = c.isolation == "namespaces"
    try:
        assert LocalCluster.load(base).addresses == c.addresses
        assert all(c.alive(r) for r in range(4))
        x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P(None, "model")))
        with mtc.CheckpointManager(base / "controller", mesh=mesh, options=mtc.Options(
                simulated_hosts=4, hosts_per_slice=2, sidecars=c.sidecars(),
                replicator_token=c.token())) as mgr:
            assert mgr.save(1, {"x": x}, force=True)
        assert all((c.inspect(r) or {}).get("committed") == [1] for r in range(4))
        if namespaces:
            assert all(not any(c.root(r).iterdir()) for r in range(4))
            assert len({h["address"] for h in c.describe()["hosts"]}) == 4
        sidecar = c.sidecars([1])
        c.lose_host(1)
        assert not c.alive(1) and c.inspect(1) is None
        c.restart_host(1)
        assert c.alive(1) and c.sidecars([1]) == sidecar
        assert (c.inspect(1) or {}).get("committed") == []  # its RAM disk went with it
        pids = dict(LocalCluster.load(base).pids)
        assert pids[1] == c.pids[1]
        machine = LocalCluster.load(base).describe()
        assert [h["replicator_pid"] for h in machine["hosts"]] == [c.pids[r] for r in range(4)]
    finally:
        LocalCluster.load(base).down()
    assert not base.exists()
    assert not any(c.alive(r) for r in range(4))
    if namespaces:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert c.hosts.tag not in listed


@pytest.mark.process
def test_cluster_backs_up_to_the_gcs_emulator(ramdisk: Path, mesh: Mesh) -> None:
    """``up --backup gcs-emulator``: a real fake-gcs-server, a bucket, replicators
    pointed at it; ``mtc backup`` lands a step there; ``down`` stops the emulator."""
    base = ramdisk / "cluster"
    c = LocalCluster.up(base, backup="gcs-emulator")
    try:
        assert c.backup == "gs://mtc-local/checkpoints" and c.emulator is not None
        x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P(None, "model")))
        with mtc.CheckpointManager(base / "controller", mesh=mesh, options=mtc.Options(
                simulated_hosts=4, hosts_per_slice=2, sidecars=c.sidecars(),
                replicator_token=c.token())) as mgr:
            assert mgr.save(1, {"x": x}, force=True)
        r = subprocess.run([sys.executable, "-m", "mtc.cli", "backup", "--token-file",
                            str(c.token_file()), "--node", c.addresses[0]],
                           cwd=REPO, env=c.env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "backed up step 1" in r.stdout, r.stdout + r.stderr
        url = c.emulator["url"]
        with urllib.request.urlopen(f"{url}/storage/v1/b/mtc-local/o?prefix=checkpoints/steps/1/",
                                    timeout=10) as resp:
            names = {o["name"] for o in json.load(resp).get("items", [])}
        assert "checkpoints/steps/1/MANIFEST.json" in names
        # x's 4 distinct shards, each uploaded once (the other slice's copies are
        # the same bytes), and each host's manifest.
        assert sum(n.endswith(".bin") for n in names) == 4
        assert sum(n.endswith("/manifest.json") for n in names) == 4
    finally:
        LocalCluster.load(base).down()
    pid = c.emulator["pid"]
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
