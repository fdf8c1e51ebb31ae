"""The elastic trainer's choice of where to recover from (a pure function), its
fault schedule's life cycle, and its clock of the garbage collector's time."""

from __future__ import annotations

import gc

import pytest

from mtc.trainer.collector import CollectorClock
from mtc.trainer.policy import recovery_source
from mtc.trainer.schedule import FaultSchedule


@pytest.mark.parametrize("full, scale_up, snapshot_step, last_saved, failed, want", [
    # Back on every slice after a failure, no usable snapshot: mtc (peer, backup).
    (True, False, None, 15, set(), "mtc"),
    # mtc may hold the snapshot's step: a tie goes to mtc (checksummed, any shard).
    (True, False, 15, 15, set(), "mtc"),
    # ... unless that save failed with the lost host: the snapshot.
    (True, False, 15, 15, {15}, "snapshot"),
    # The snapshot is newer than anything handed to mtc.
    (True, False, 16, 15, set(), "snapshot"),
    # Resized onto fewer slices: the snapshot, resharded ...
    (False, False, 15, 15, set(), "snapshot"),
    # ... or, without one, the surviving hosts' RAM disks.
    (False, False, None, 15, set(), "ramdisks"),
    # A scale-up never asks mtc to agree: the snapshot, else the RAM disks.
    (True, True, 30, 30, set(), "snapshot"),
    (True, True, None, 30, set(), "ramdisks"),
])
def test_recovery_source(full: bool, scale_up: bool, snapshot_step: int | None,
                         last_saved: int | None, failed: set[int], want: str) -> None:
    assert recovery_source(full=full, scale_up=scale_up, snapshot_step=snapshot_step,
                           last_saved=last_saved, failed_saves=failed) == want


def test_fault_schedule_consumes_its_steps_in_order() -> None:
    plan = FaultSchedule(host_loss_at=[20, 10], slice_loss_at=[30], slice_down_steps=2,
                         steps=50)
    assert not plan.host_loss_due(9) and plan.host_loss_due(10)
    plan.host_lost(10)
    assert not plan.host_loss_due(19) and plan.host_loss_due(25)
    plan.host_lost(25)
    assert not plan.host_loss_due(49) and plan.t_last_fault is not None
    assert not plan.slice_loss_due(29) and plan.slice_loss_due(30)
    plan.slice_lost(1)
    assert not plan.slice_loss_due(31)
    plan.resized_steps += 1
    assert plan.slice_to_bring_back() is None
    plan.resized_steps += 1
    assert plan.slice_to_bring_back() == 1 and plan.slice_to_bring_back() is None


def test_collector_clock_counts_full_collections_and_their_time() -> None:
    clock = CollectorClock()
    try:
        seconds, full = clock.seconds, clock.full
        cycle: list[object] = []
        cycle.append(cycle)  # something for the collector to find
        del cycle
        gc.collect()
        assert clock.full == full + 1 and clock.seconds > seconds
    finally:
        clock.close()
    assert clock._on not in gc.callbacks
