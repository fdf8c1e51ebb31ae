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
from xla_flags import without_fast_compile

REPO = Path(__file__).resolve().parent.parent


def _bench(name: str, *args: str) -> Any:
    """The benchmark's JSON, run on CPU devices, compiled as users' programs are (not
    as the tests' own: tests/xla_flags.py; the benchmark runs its programs many times)."""
    flags = without_fast_compile(os.environ.get("XLA_FLAGS", ""))
    out = subprocess.run([sys.executable, str(REPO / "bench" / name), *args],
                         env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags},
                         capture_output=True,
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
    # The model step (tiny on CPU): every case, fused and split, named per step length.
    model = result["model_step"]
    (case,) = model["by_fill"].values()
    for length in ("long", "short"):
        got = case[length]
        for kind in ("fused", "split"):
            for key in (f"mtc_save_every_50_{kind}_mean_over_plain",
                        f"mtc_save_at_link_rate_{kind}_mean_over_plain",
                        f"mtc_snapshot_every_step_{kind}_mean_over_plain",
                        f"mtc_snapshot_every_step_{kind}_age_over_device_get",
                        f"mtc_snapshot_every_20_{kind}_mean_over_plain"):
                assert got[key] > 0, (length, key)
        for key in ("orbax_save_every_50_fused_mean_over_plain",
                    "orbax_snapshot_every_step_fused_mean_over_plain",
                    "mtc_in_graph_every_step_fused_mean_over_plain"):
            assert got[key] > 0, (length, key)
        # The loop's time lost per save, beside the call's own time; the manager's
        # first save (its warm-up) apart; what the saves copied and read directly.
        for key in ("mtc_save_every_50_fused_held_over_device_get",
                    "mtc_save_at_link_rate_split_held_over_device_get",
                    "mtc_save_every_50_fused_first_stall_over_device_get"):
            assert got[key] >= 0, (length, key)
        assert got["save_copied_bytes"] == got["save_direct_bytes"] == 0  # CPU: no copy
        # CPU devices: every snapshot asked for is taken (no pacing off an accelerator).
        assert got["saves_or_snapshots_taken"]["mtc_snapshot_every_step_fused"] >= 40


@pytest.mark.process
def test_the_model_steps_kinds_run_alone() -> None:
    """``--kinds``: a kind not asked for is neither compiled nor run (its peak would be
    the process's, and the copy budget the next cases read), the fused plain loop
    always (the others' reference)."""
    result = _bench("accelerator.py", "--smoke", "--only-model", "--kinds", "in_graph",
                    "--lengths", "short", "--snapshot-every", "1")
    model = result["model_step"]
    assert model["kinds"] == ["in_graph"]
    (case,) = model["by_fill"].values()
    assert set(case["short"]["step_s"]) == {"plain_fused", "mtc_in_graph_every_step_fused"}
    assert case["short"]["mtc_in_graph_every_step_fused_mean_over_plain"] > 0


@pytest.mark.process
def test_restore_in_a_new_process_checks_values_against_device_put_and_orbax(
        tmp_path: Path) -> None:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, str(REPO / "bench" / "restore_fresh.py"), "save",
                    str(tmp_path), "--gib", "0.002"], env=env, capture_output=True,
                   timeout=240, check=True)
    got = _bench("restore_fresh.py", "restore", str(tmp_path), "--dispatch", "local")
    assert got["restore_new_process_over_device_put_local"] > 0
    assert got["restore_new_process_over_orbax_local"] > 0
    assert set(got["seconds"]) == {"local", "device_put", "orbax"}
