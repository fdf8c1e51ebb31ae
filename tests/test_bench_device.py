"""bench/save_stall_device.py keeps running where CI runs it (CPU devices); its
figures mean something only on an accelerator (its JSON names the platform)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.process
def test_device_stall_bench_runs_and_checks_the_restored_values() -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "save_stall_device.py"), "--samples", "1",
         "--warmup", "0", "--gib", "0.01"],
        env=env, capture_output=True, text=True, timeout=240, check=True)
    result = json.loads(out.stdout)
    assert result["platform"] == "cpu" and result["dispatch"] == "local"
    for name, leaves in (("big", 1), ("model", 109)):
        part = result[name]
        assert part["values_checked"] is True and part["leaves"] == leaves
        assert part["save_stall_over_device_get"] > 0 and part["restore_over_device_put"] > 0
