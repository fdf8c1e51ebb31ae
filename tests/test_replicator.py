"""The replicator with real processes, where the process is the point: a controller
saving through the hosts' sidecars and restoring, with replicators, after two hosts
are lost (SIGKILLed, their RAM disks deleted); the metrics served over HTTP.

Every replicator is a real ``python -m mtc.sidecar.replicator.main`` process, and the
controller reaches each host's RAM disk only through the host's sidecar process
(``Cluster.options``). The replicator's own logic (replication verified and
deduplicated, restore after host loss, an unreachable peer, garbage collection) is
tested on whole replicators in one process: ``tests/test_replicator_memory.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from jax.sharding import Mesh
from replicators import Cluster, assert_state_equal, make_state, new_cluster

import mtc
from mtc.manifest import MANIFEST_NAME

pytestmark = pytest.mark.process  # every test here starts processes


def save(cl: Cluster, mesh: Mesh, steps: dict[int, dict[str, Any]]) -> None:
    """Save ``steps`` through the cluster's sidecars."""
    with mtc.CheckpointManager(cl.base, mesh=mesh, options=cl.options(max_to_keep=None)) as m:
        for step, state in steps.items():
            assert m.save(step, state)
        m.wait_until_finished()


def files_of(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file()}


def wipe(cl: Cluster, rank: int) -> None:
    """Lose a host: SIGKILL its replicator and sidecar, delete its RAM disk."""
    cl.lose_host(rank)


# -- replication --------------------------------------------------------------------


def test_metrics_endpoint_serves_documented_names(ramdisk: Path,
                                                  clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1, metrics=True)
    cl.start_all()
    files = cl.commit(0, 3, {"a.bin": os.urandom(1000), "d-b.bin": os.urandom(10)})
    size = sum(map(len, files.values()))  # the manifest's bytes too
    cl.wait_held({(1, 0, 3)})
    m0, m1 = cl.scrape(0), cl.scrape(1)
    for m in (m0, m1):
        for name in ("mtc_replicated_bytes_sent_total", "mtc_replicated_bytes_received_total",
                     "mtc_restore_bytes_fetched_total", "mtc_deduplicated_files_total",
                     "mtc_replication_lag_steps", "mtc_newest_step{state=committed}",
                     "mtc_newest_step{state=replicated}", "mtc_newest_step{state=backed_up}"):
            assert name in m, (name, sorted(m))
    assert m0["mtc_replicated_bytes_sent_total"] == size
    assert m1["mtc_replicated_bytes_received_total"] == size
    assert m0["mtc_newest_step{state=committed}"] == 3
    assert m0["mtc_newest_step{state=replicated}"] == 3
    assert m1["mtc_newest_step{state=committed}"] == -1
    assert m0["mtc_newest_step{state=backed_up}"] == -1
    # The failure counter is declared even before anything failed.
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{cl.metrics_ports[0]}/metrics") as r:
        assert "# TYPE mtc_failures_total counter" in r.read().decode()


# -- restore after host loss ------------------------------------------------------


@pytest.mark.parametrize("while_fetching", [True, False], ids=["while-fetching", "once-local"])
def test_two_hosts_lost_in_different_slices(ramdisk: Path, mesh: Mesh,
                                            clusters: list[Cluster], while_fetching: bool
                                            ) -> None:
    """Restored while the lost hosts' data still comes (read from their twins), or
    once the replicators made it local: then the hosts' answer taken beside the
    agreement, before their data came, is not the one the restore plans with."""
    cl = new_cluster(clusters, ramdisk, 4, 2)
    cl.start_all()
    s3 = make_state(mesh, 3.0)
    save(cl, mesh, {2: make_state(mesh, 2.0), 3: s3})
    cl.wait_replicated(3, timeout=30)

    # Host 0 (slice 0) and host 3 (slice 1) at once: each one's data survives on
    # its peer in the other slice (host 2 and host 1).
    wipe(cl, 0)
    wipe(cl, 3)
    cl.launch(0)
    cl.launch(3)
    cl.wait_serving(0)
    cl.wait_serving(3)

    # The controller's own path: restore() without a step asks the replicators.
    opts = cl.options(replicators=True, restore_timeout_s=30,
                      restore_while_fetching=while_fetching)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as m:
        assert_state_equal(m.restore(None, s3), s3)
        assert m.last_restore_tiers[0] == m.last_restore_tiers[3] == "peer"
    cl.wait_held({(0, 2, 3), (3, 1, 3), (2, 0, 3), (1, 3, 3)}, timeout=15)
    for r in (0, 3):
        assert (cl.root(r) / "3" / MANIFEST_NAME).is_file()
        assert files_of(cl.root(r) / "3") == files_of(
            cl.root((r + 2) % 4) / ".mtc-replica" / str(r) / "3")


