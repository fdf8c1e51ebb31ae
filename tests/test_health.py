"""The slice health check pathwaysutils runs on every poll and elastic attempt:
with :mod:`mtc.elastic.pathways_patch` installed it still finds lost slices (through the
real ``DeviceLossSimulator``) and compiles its programs once, not on every check."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import jax
import pytest
from pathwaysutils.elastic import elastic as pw_elastic

from mtc.elastic import pathways_patch
from mtc.trainer.faults import SliceLossSimulator

_COMPILE = "/jax/core/compile/backend_compile_duration"
_compiles = threading.local()


def _count(event: str, duration: float, **_: Any) -> None:
    if event == _COMPILE:
        _compiles.n = getattr(_compiles, "n", 0) + 1


jax.monitoring.register_event_duration_secs_listener(_count)


def compiled() -> int:
    return int(getattr(_compiles, "n", 0))


@pytest.fixture
def cached_checker() -> Iterator[None]:
    default = pw_elastic.DefaultSliceHealthChecker
    pathways_patch.install()
    try:
        yield
    finally:
        pw_elastic.DefaultSliceHealthChecker = default  # type: ignore[misc]


def test_health_check_compiles_once_and_still_sees_lost_slices(cached_checker: None) -> None:
    devs = sorted(jax.devices(), key=lambda d: d.id)
    slices = {0: devs[:4], 1: devs[4:]}
    assert pw_elastic.get_active_slice_indices(slices) == {0, 1}
    before = compiled()
    for _ in range(3):
        assert pw_elastic.get_active_slice_indices(slices) == {0, 1}
    # pathwaysutils also checks inside its jax.default_device (part of JAX's cache key).
    with jax.default_device(devs[4]):
        assert pw_elastic.get_active_slice_indices(slices) == {0, 1}
    assert compiled() == before, "a repeated health check compiled again"

    sim = SliceLossSimulator()
    sim.start()
    try:
        for d in slices[1]:
            sim.mark_device_lost(d)
        assert pw_elastic.get_active_slice_indices(slices) == {0}
        assert pw_elastic.get_active_slice_indices({1: slices[1]}) == set()
        for d in slices[1]:
            sim.mark_device_connected(d)
        assert pw_elastic.get_active_slice_indices(slices) == {0, 1}
    finally:
        sim.stop()
    assert compiled() == before, "checking a lost or returned slice compiled again"


def test_health_check_refuses_no_devices(cached_checker: None) -> None:
    with pytest.raises(ValueError, match="No devices"):
        pw_elastic.get_active_slice_indices({0: []})
