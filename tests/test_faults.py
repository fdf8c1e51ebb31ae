"""mtc.trainer.faults.HostFaults: a lost host's return runs in the background, wakes
whoever waits for it, and ``close`` joins it (its error raised, not lost)."""

from __future__ import annotations

import threading
from pathlib import Path

import jax
import pytest

from mtc.trainer.faults import HostFaults
from mtc.trainer.jsonlog import JsonLog


class Cluster:
    """Stands in for a LocalCluster: a real one starts sidecar and replicator
    processes, and what is tested here is only the returning thread's lifecycle."""

    num_hosts = 4
    hosts_per_slice = 2

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.started: list[list[int]] = []

    def start_hosts(self, hosts: list[int]) -> None:
        if self.fail:
            raise OSError("no room for the replacement's RAM disk")
        self.started.append(hosts)


def returning() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "host-return"]


def test_a_return_wakes_the_waiter_and_close_joins_it(tmp_path: Path) -> None:
    cluster = Cluster()
    log = JsonLog(tmp_path / "log.jsonl")
    faults = HostFaults(cluster, jax.devices(), log)  # type: ignore[arg-type]
    with faults.changed:
        faults.lost_slices.add(1)
    faults.bring_back([2, 3], 1, 0.0)
    assert faults.wait_back({1}, 10)
    assert faults.close(10) is True
    assert cluster.started == [[2, 3]] and faults.returns == 1
    assert returning() == []
    log.close()


def test_a_return_that_failed_raises_its_error_at_close(tmp_path: Path) -> None:
    log = JsonLog(tmp_path / "log.jsonl")
    faults = HostFaults(Cluster(fail=True), jax.devices(), log)  # type: ignore[arg-type]
    faults.bring_back([2, 3], 1, 0.0)
    with pytest.raises(OSError, match="no room"):
        faults.close(10)
    assert returning() == [] and faults.replacing_slices() == {1}  # never came back
    log.close()
