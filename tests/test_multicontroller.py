"""Multi-controller JAX on hosts that share nothing: real OS processes, one per host.

Every JAX process runs on a host of its own (``mtc.testing.isolation.Hosts``):
with root, inside that host's network and mount namespaces (nsenter into the
host's sidecar, which owns them), its RAM disk a private tmpfs no other host
sees, its address on a bridge, ``jax.distributed`` and the collectives over that
bridge; without root, separate processes with private folders, same code. Each
host also runs its replicator, the only way bytes cross between hosts.

The main case, on 4 hosts (2 CPU devices each, 2 slices): save and restore onto
the saved sharding and onto other layouts (other hosts' rows come through the
replicators); a restarted job restores the step the replicators agree on and
saves step 3; the last host is replaced empty and gets step 3 back from its
peer; the job comes back as 2 processes on hosts 2 and 3, the regions of the 2
hosts gone coming from their peer copies, saves and restarts; then it grows back
onto all 4 hosts, the 2 empty ones reading their regions from the others. The
workers (``tests/workers/mc_worker.py``) check every addressable shard against
numpy and report in one JSON line. The harness is ``tests/mc_cluster.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mc_cluster import PHASE_TIMEOUT_S, WORKERS, cluster

pytestmark = pytest.mark.process  # every test here starts processes


@pytest.mark.timeout(7 * PHASE_TIMEOUT_S + 240)
def test_isolated_hosts_save_restore_restart_replace_and_shrink(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    with cluster(4, replicators=True) as c:
        everyone = [0, 1, 2, 3]
        results = c.run_job("train", everyone, logs)
        for r in results:
            assert r["all_steps"] == [1, 2] and r["own_files"] == ["1", "2"]
            # The saved layout is each host's own rows: nothing crossed the network.
            # Other layouts need other hosts' manifests and rows.
            assert r["fetched_for_saved"] == []
            assert "manifest.json" in r["fetched_files"] and len(r["fetched_files"]) > 1
        c.assert_private()

        results = c.run_job("restart", everyone, logs)
        for r in results:
            assert r["latest_step"] == 2 and r["tier"] == "local"

        # Host 3 is replaced empty; its peer (host 1, same place in the other
        # slice) holds its step 3. Host 2's peer copy (on host 0) serves later.
        c.wait_held({(1, 3, 3), (0, 2, 3)})  # (holder, origin, step)
        c.lose(3)
        c.start([3])
        results = c.run_job("replaced", everyone, logs)
        for r in results:
            assert r["steps_before"] == [] and r["latest_step"] == 3
        # Before its replicator prepared step 3, the replaced host read it through
        # the replicators (from its peer's copy): the peer tier.
        assert [r["early_tier"] for r in results] == ["local"] * 3 + ["peer"]
        assert results[3]["tier"] == "peer" and results[3]["own_files"] == ["3"]
        assert [r["tier"] for r in results[:3]] == ["local"] * 3

        # Hosts 0 and 1 are gone; the job comes back on hosts 2 and 3 (replicator
        # ranks 2 and 3, stated by its managers), the data of hosts 0 and 1 coming
        # from their peer copies on hosts 2 and 3.
        c.wait_held({(2, 0, 3), (3, 1, 3)})
        c.lose(0)
        c.lose(1)
        results = c.run_job("shrink", [2, 3], logs)
        assert [r["latest_step"] for r in results] == [3, 3]
        assert {0, 1} <= {o for r in results for o in r["fetched_from"]}
        c.assert_private()
        c.assert_partial_membership_fails(ask=3, gone=1)
        # It restarts: step 4, which only its own two hosts saved (as hosts 0 and 1
        # of a job of 2, on ranks 2 and 3), is agreed on.
        results = c.run_job("shrunk", [2, 3], logs)
        assert [r["latest_step"] for r in results] == [4, 4]

        # Hosts 0 and 1 come back empty and the job grows back onto all 4: step 4
        # restores on every process, hosts 0 and 1 reading theirs from hosts 2 and 3.
        c.start([0, 1])
        results = c.run_job("grow", everyone, logs, worker=WORKERS / "mc_restarts.py",
                            args=("--steps", "4"))
        assert [r["latest_step"] for r in results] == [4] * 4
        assert [r["tiers"] for r in results[:2]] == [{"0": "peer"}, {"1": "peer"}]
        assert {2, 3} <= {o for r in results[:2] for o in r["fetched_from"]}


@pytest.mark.timeout(PHASE_TIMEOUT_S + 120)
def test_restore_right_after_save_with_a_lagging_process(tmp_path: Path) -> None:
    """Process 0 starts its save 2 s after process 1; with ``max_to_keep=None``
    no retention collective lines them up, so ``wait_until_finished`` and
    ``restore`` must themselves make a step committed on one host readable by
    the others. Without replicators a layout that needs another host's rows
    fails, typed: nothing reads another host's RAM disk."""
    logs = tmp_path / "logs"
    logs.mkdir()
    with cluster(2, replicators=False) as c:
        results = c.run_job("skew", [0, 1], logs)
        c.assert_private()
    for r in results:
        assert r["all_steps"] == [1]
        assert r["no_network_error"] == "ShardUnavailableError"
