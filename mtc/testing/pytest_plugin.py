"""mtc's pytest plugin (loaded by pytest wherever ``mtc[testing]`` is installed): the
``mtc_cluster`` and ``mtc_restores`` fixtures.

    @pytest.mark.mtc_cluster(slices=2, hosts_per_slice=2, backup_every_steps=10)
    def test_resumes(mtc_cluster, mtc_restores): ...

The marker's arguments are :func:`mtc.testing.local_cluster`'s, and ``devices``
(default 8): the CPU devices JAX gets in this process. Nothing happens at import
or start-up: the fixtures set the devices and start processes only in the tests
that ask for them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "mtc_cluster(slices=2, hosts_per_slice=2, backup=None, "
        "backup_every_steps=None, devices=8): the shape of the mtc_cluster fixture's cluster")


@pytest.fixture
def mtc_cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A :class:`mtc.testing.TestCluster`, up for the test and taken down after (every
    process SIGKILLed); the hosts' log tails are printed, which pytest shows when the
    test fails."""
    from mtc.testing.checks import use_cpu_devices
    from mtc.testing.cluster import TestCluster

    marker = request.node.get_closest_marker("mtc_cluster")
    kw = dict(marker.kwargs) if marker is not None else {}
    use_cpu_devices(int(kw.pop("devices", 8)))
    cluster = TestCluster.up(**kw)
    try:
        yield cluster
    finally:
        print(cluster.log_tails())
        cluster.down()


@pytest.fixture
def mtc_restores() -> Iterator[list[Any]]:
    """Every ``CheckpointManager.restore`` of the test (:func:`mtc.testing.record_restores`)."""
    from mtc.testing.checks import record_restores

    with record_restores() as seen:
        yield seen
