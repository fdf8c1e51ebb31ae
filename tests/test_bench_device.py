"""bench/accelerator.py, bench/save_stall_device.py and bench/snapshot_device.py keep
running where CI runs them (CPU devices); their figures mean something only on an
accelerator (their JSON names the platform)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench(name: str, *args: str) -> Any:
    """The benchmark's JSON, run on CPU devices."""
    out = subprocess.run([sys.executable, str(REPO / "bench" / name), *args],
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                         text=True, timeout=240, check=True)
    return json.loads(out.stdout)


@pytest.mark.process
def test_device_stall_bench_runs_and_checks_the_restored_values() -> None:
    result = _bench("save_stall_device.py", "--samples", "1", "--warmup", "0", "--gib", "0.01")
    assert result["platform"] == "cpu" and result["dispatch"] == "local"
    for name, leaves in (("big", 1), ("model", 109)):
        part = result[name]
        assert part["values_checked"] is True and part["leaves"] == leaves
        assert part["save_stall_over_device_get"] > 0 and part["restore_over_device_put"] > 0


@pytest.mark.process
def test_device_snapshot_bench_runs_and_checks_the_loaded_values() -> None:
    result = _bench("snapshot_device.py", "--mib", "16", "--steps", "2", "--rounds", "1")
    assert result["platform"] == "cpu" and result["values_checked"] is True
    assert result["bytes"] == 16 << 20 and result["saves"] == 2
    assert set(result["step_s"]) == {"plain", "in_graph", "save"}
    assert all(v > 0 for v in result["step_s"].values())
    assert result["host_fresh_pages_gbps"] > 0 and result["host_held_pages_gbps"] > 0
    assert result["in_graph_copy_over_fresh_pages"] == pytest.approx(
        (result["step_s"]["in_graph"] - result["step_s"]["plain"])
        * result["host_fresh_pages_gbps"] * 1e9 / result["bytes"], rel=0.05, abs=1e-3)
    # On CPU the step's copy stays in device memory (the same RAM; docs/hosts.md).
    assert result["snapshot_memory_kind"] == "device"


@pytest.mark.process
def test_accelerator_bench_smoke_has_every_figure_and_checks_values() -> None:
    result = _bench("accelerator.py", "--smoke")
    assert result["platform"] == "cpu" and result["device_kind"]
    for dispatch in ("local", "colocated"):
        (part,) = result["dispatch"][dispatch].values()
        assert part["values_checked"] is True
        for key in ("save_stall_over_device_get", "save_over_orbax",
                    "restore_over_device_put", "restore_over_orbax"):
            assert part[key] > 0, (dispatch, key)
        # CPU devices: the state's buffers are host memory, nothing is copied.
        assert part["saves_copied_in_device_memory"] == 0
    snap = result["snapshot"]
    assert snap["values_checked"] is True
    for key in ("snapshot_every_step_median_over_plain", "snapshot_every_step_mean_over_plain",
                "snapshot_every_step_mean_over_orbax", "snapshot_every_20_mean_over_plain",
                "in_graph_mean_over_plain", "save_every_50_mean_over_plain"):
        assert snap[key] > 0, key
