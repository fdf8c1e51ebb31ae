"""A multi-controller job whose replicators disagree on their configuration learns
it on every process within seconds (issue 56, item 8).

4 isolated hosts in 2 slices of 2 (``mc_cluster``), one JAX process and one
replicator each; host 2's replicator was started with the addresses of ranks 0
and 1 swapped in its ``--nodes``. It alone sees the disagreement (a node answers
as another rank than its place in its list) and refuses restores; the other
processes used to wait the whole agreement timeout (30 s here, the manager's
``restore_timeout_s`` 60) for an ``AgreementError`` naming rank 2 without saying
why. The phase is ``tests/workers/mc_config.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mc_cluster import PHASE_TIMEOUT_S, WORKERS, cluster

pytestmark = pytest.mark.process  # every test here starts processes


def _swapped(addrs: list[str]) -> dict[int, list[str]]:
    nodes = [addrs[1], addrs[0], *addrs[2:]]
    return {2: ["--nodes", ",".join(nodes)]}


@pytest.mark.timeout(PHASE_TIMEOUT_S + 120)
def test_every_process_of_a_misconfigured_job_gets_config_error_within_seconds(
        tmp_path: Path) -> None:
    with cluster(4, replicators=True, replicator_args=_swapped) as c:
        said = f"the node at {c.addrs[1]} (rank 0 in this node's --nodes) says it is rank 1"
        results = c.run_job("misconfigured", [0, 1, 2, 3], tmp_path,
                            worker=WORKERS / "mc_config.py", min_checks=0)
        for r in results:
            kind, message = r["latest_step"]
            assert kind == "ConfigError", r
            assert said in message, message
            if r["process_index"] != 2:
                assert "rank 2's replicator refuses" in message, message
            # Seconds (the coordinator asks who has not asked), not the agreement's 30.
            assert r["waited"] < 15, r
