"""A multi-controller job that comes back after a failure never restores a step of
two runs' bytes, and never starts over in silence.

4 isolated hosts in 2 slices of 2 (``mc_cluster``), one JAX process and one
replicator each; the phases are ``tests/workers/mc_restarts.py``'s:

- host 3's process is SIGKILLed after ``save(25)`` returned, before its host
  committed 25; the next start agrees on 20, and 25 is fenced off everywhere
  (every host's RAM disk, every replicator's copies); the resumed job saves 25
  with other data and its next start restores that 25 exactly, every leaf;
- a copy of the first run's 25 planted back on host 1 (nothing fences it):
  restoring 25 is ``MixedRunError`` on every process, and saving it again
  replaces it on every host;
- hosts 1 and 3 (each other's peers) wiped, no backup: ``DataLossError`` on every
  process, naming the ranks and the step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mc_cluster import PHASE_TIMEOUT_S, WORKERS, cluster

pytestmark = pytest.mark.process  # every test here starts processes

RESTARTS = WORKERS / "mc_restarts.py"


@pytest.mark.timeout(3 * PHASE_TIMEOUT_S + 180)
def test_a_killed_save_is_fenced_a_mix_is_refused_and_a_loss_is_loud(tmp_path: Path) -> None:
    everyone = [0, 1, 2, 3]
    with cluster(4, replicators=True) as c:
        results = c.run_job("kill", everyone, tmp_path, worker=RESTARTS,
                            args=("--steps", "20,25"), killed=(3,), min_checks=2)
        assert [r["own_steps"] for r in results] == [[20, 25]] * 3 + [[20]]
        # Hosts 0 to 2 copied their 25 to their peers (hosts 2, 3 and 0).
        c.wait_held({(2, 0, 25), (3, 1, 25), (0, 2, 25)})  # (holder, origin, step)

        results = c.run_job("resume", everyone, tmp_path, worker=RESTARTS,
                            args=("--steps", "20,25"))
        for r in results:
            assert r["latest_step"] == 20
            assert r["fenced"] == {"own": [20], "copies": []}
            assert r["resumed_latest"] == 25
            assert r["planted"] == "MixedRunError"

        # Both copies of host 1's data (and of host 3's) are gone; no backup.
        c.wait_held({(3, 1, 25)})
        c.lose(1)
        c.lose(3)
        c.start([1, 3])
        results = c.run_job("lost", everyone, tmp_path, worker=RESTARTS, min_checks=0)
        for r in results:
            for call in ("latest_step", "restore"):
                kind, message = r[call]
                assert kind == "DataLossError", r
                assert "step 25: data of rank(s) [1, 3] is on no member" in message, message
