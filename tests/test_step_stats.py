"""Orbax's step statistics (mtc.step_stats): after each save that writes and each
restore, the manager's logger (Orbax's ``logger=``) gets a dict with the fields of
Orbax's ``SaveStepStatistics``/``RestoreStepStatistics``; by default an INFO line
whose dict ``ast.literal_eval`` reads back, as Orbax's StandardLogger writes it."""

from __future__ import annotations

import ast
import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint.logging import step_statistics

import mtc
from mtc import step_stats


class Recorder:
    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []

    def log_entry(self, entry: dict[str, Any]) -> None:
        self.entries.append(entry)


def fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def manager(ramdisk: Path, mesh: Mesh, **kw: Any) -> mtc.CheckpointManager:
    return mtc.CheckpointManager(ramdisk, mesh=mesh, options=mtc.Options(
        simulated_hosts=2, dispatch="local", max_to_keep=2), **kw)


def state(mesh: Mesh) -> dict[str, Any]:
    return {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("model")))}


def test_each_save_and_restore_gives_orbax_statistics_to_the_logger(
        ramdisk: Path, mesh: Mesh) -> None:
    rec = Recorder()
    with manager(ramdisk, mesh, logger=rec) as mgr:
        assert mgr.save(0, args=ocp.args.StandardSave(state(mesh)))
        assert not mgr.save(0, args=ocp.args.StandardSave(state(mesh)))  # not written: none
        assert mgr.save(1, args=ocp.args.StandardSave(state(mesh)))
        mgr.wait_until_finished()
        mgr.restore(1)
    first, second, restored = rec.entries
    assert set(first) == fields(step_statistics.SaveStepStatistics)
    assert set(restored) == fields(step_statistics.RestoreStepStatistics)
    assert (first["step"], second["step"], restored["step"]) == (0, 1, 1)
    assert (first["event_type"], restored["event_type"]) == ("save", "restore")
    assert first["directory"] == restored["directory"] == str(ramdisk)
    assert first["synchronous"] is False and first["reached_preemption"] is False
    assert first["preemption_received_at"] is None
    assert first["time_between_consecutive_saves_sec"] is None
    assert second["time_between_consecutive_saves_sec"] == pytest.approx(
        second["checkpoint_manager_blocking_start_time"]
        - first["checkpoint_manager_blocking_start_time"])
    for e in (first, second):
        start = e["checkpoint_manager_blocking_start_time"]
        end = start + e["checkpoint_manager_blocking_duration_secs"]
        for phase in ("wait_for_prev", "checkpointer_blocking", "get_old_steps"):
            t, d = e[f"{phase}_start_time"], e[f"{phase}_duration_secs"]
            assert start <= t and d >= 0 and t + d <= end + 1e-6, (phase, e)
    start = restored["checkpoint_manager_start_time"]
    assert 0 <= restored["checkpointer_duration_secs"] <= \
        restored["checkpoint_manager_duration_secs"]
    assert restored["checkpointer_start_time"] >= start


def test_a_synchronous_save_says_so(ramdisk: Path, mesh: Mesh) -> None:
    rec = Recorder()
    with mtc.CheckpointManager(ramdisk, mesh=mesh, logger=rec, options=mtc.Options(
            simulated_hosts=2, dispatch="local", enable_async_checkpointing=False)) as mgr:
        assert mgr.save(0, state(mesh))
    assert rec.entries[0]["synchronous"] is True


def test_the_default_logs_a_line_orbax_readers_parse(ramdisk: Path, mesh: Mesh,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    with manager(ramdisk, mesh) as mgr, caplog.at_level(logging.INFO, logger="mtc.manager"):
        assert mgr.save(0, state(mesh))
        line = [r.getMessage() for r in caplog.records if "step statistics" in r.getMessage()]
        entry = ast.literal_eval(line[-1][line[-1].find("{"):])
        assert entry["step"] == 0 and entry["event_type"] == "save"
        mgr.wait_until_finished()
        mgr.restore(0)
        last = caplog.records[-1].getMessage()
        assert ast.literal_eval(last[last.find("{"):])["event_type"] == "restore"


def test_orbax_loggers_are_taken(ramdisk: Path, mesh: Mesh,
                                 caplog: pytest.LogCaptureFixture) -> None:
    logger = ocp.logging.CompositeLogger(ocp.logging.StandardLogger())
    # Orbax's StandardLogger writes through absl's logger (another test may have quieted it).
    with manager(ramdisk, mesh, logger=logger) as mgr, caplog.at_level(logging.INFO, "absl"):
        assert mgr.save(0, state(mesh))
        assert any("'event_type': 'save'" in r.getMessage() for r in caplog.records)


def test_a_failing_logger_never_fails_the_save(ramdisk: Path, mesh: Mesh,
                                               caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        def log_entry(self, entry: dict[str, Any]) -> None:
            raise RuntimeError("logging backend down")

    with manager(ramdisk, mesh, logger=Broken()) as mgr:
        assert mgr.save(0, state(mesh))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0]
    assert any("logger failed" in r.getMessage() and "logging backend down" in r.getMessage()
               for r in caplog.records)


def test_a_logger_without_log_entry_is_refused(ramdisk: Path, mesh: Mesh) -> None:
    with pytest.raises(mtc.ConfigError, match="log_entry"):
        manager(ramdisk, mesh, logger=print)


def test_entries_alone() -> None:
    e = step_stats.save_entry(step=3, directory="/d", began=10.0, ended=12.0,
                              checked=(10.1, 0.1), staged=(10.2, 1.5), retention=None,
                              synchronous=False, preempted_at=10.05, previous_began=4.0)
    assert e["reached_preemption"] is True and e["preemption_received_at"] == 10.05
    assert e["time_between_consecutive_saves_sec"] == 6.0
    assert e["get_old_steps_start_time"] is None
    assert e["checkpoint_manager_blocking_duration_secs"] == 2.0
    r = step_stats.restore_entry(step=3, directory="/d", began=1.0, ended=4.0,
                                 load_seconds=2.0)
    assert (r["checkpointer_start_time"], r["checkpointer_duration_secs"]) == (2.0, 2.0)
    assert r["checkpoint_manager_duration_secs"] == 3.0
