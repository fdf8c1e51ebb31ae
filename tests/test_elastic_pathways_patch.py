"""mtc.elastic.patched: pathwaysutils' real Manager works on CPU slices inside the
block (grouping, health check through the real DeviceLossSimulator), and every
global it replaced is back afterwards, also when the block raises."""

from __future__ import annotations

import jax
import pytest
from pathwaysutils.elastic import elastic as pw_elastic
from pathwaysutils.elastic import manager as pw_manager

from mtc.elastic import CachedSliceHealthChecker, patched
from mtc.trainer.faults import SliceLossSimulator


def test_manager_runs_inside_and_globals_come_back() -> None:
    grouping, checker = pw_elastic.get_slice_to_devices, pw_elastic.DefaultSliceHealthChecker
    devices = sorted(jax.devices(), key=lambda d: d.id)
    with patched(devices_per_slice=4):
        assert pw_elastic.DefaultSliceHealthChecker is CachedSliceHealthChecker
        pw = pw_manager.Manager(devices)
        try:
            assert sorted(pw.slice_to_devices) == [0, 1]
            assert [d.id for d in pw.slice_to_devices[1]] == [4, 5, 6, 7]
            assert set(pw.active_slice_indices) == {0, 1}
            with SliceLossSimulator() as sim:
                sim.mark_slice_lost(1, pw.slice_to_devices)
                assert set(pw_elastic.get_active_slice_indices(pw.slice_to_devices)) == {0}
        finally:
            pw.close()
    assert pw_elastic.get_slice_to_devices is grouping
    assert pw_elastic.DefaultSliceHealthChecker is checker


def test_globals_come_back_when_the_block_raises() -> None:
    grouping, checker = pw_elastic.get_slice_to_devices, pw_elastic.DefaultSliceHealthChecker
    with pytest.raises(KeyError), patched(slice_to_devices=lambda ds: {0: list(ds)}):
        assert pw_elastic.get_slice_to_devices(jax.devices()) == {0: jax.devices()}
        raise KeyError("x")
    assert pw_elastic.get_slice_to_devices is grouping
    assert pw_elastic.DefaultSliceHealthChecker is checker
    with pytest.raises(ValueError):
        with patched(devices_per_slice=4, slice_to_devices=lambda ds: {}):
            pass
