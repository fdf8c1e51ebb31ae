"""bench/accelerator.py keeps running where CI runs it (CPU devices, ``--smoke``); its
figures mean something only on an accelerator (its JSON names the platform)."""

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
