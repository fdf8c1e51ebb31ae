"""The ``make demo`` job, shortened: a SIGKILLed training process comes back from the RAM disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from xla_flags import without_fast_compile

pytestmark = pytest.mark.process  # every test here starts processes

REPO = Path(__file__).resolve().parents[1]


# About 40 s on an idle 2-core machine; the limits leave room for a busy CI runner.
@pytest.mark.timeout(240)
def test_demo_recovers_from_a_crash_with_the_reference_loss_curve(tmp_path: Path,
                                                                 ramdisk: Path) -> None:
    out = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "mtc.trainer.demo", "--out", str(out), "--steps", "40",
         "--model", "tiny", "--kill-at", "25", "--save-interval", "10",
         "--ramdisk-root", str(ramdisk)],
        cwd=REPO, capture_output=True, text=True, timeout=230,
        # Three runs of 40 steps each: LLVM's passes pay here (tests/xla_flags.py).
        env={**os.environ, "XLA_FLAGS": without_fast_compile(os.environ["XLA_FLAGS"])})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())

    assert report["cluster"]["dispatch"] == "colocated"  # as on Pathways, chosen by "auto"
    assert len(report["failures"]) == 1
    f = report["failures"][0]
    assert f["kind"] == "process_crash" and f["tier"] == "local"
    assert f["step_at_failure"] >= 25
    assert f["resumed_from_step"] <= f["step_at_failure"]
    assert f["resumed_from_step"] % 10 == 0
    assert 0 <= f["steps_lost"] <= 10
    assert f["steps_lost"] == f["step_at_failure"] - f["resumed_from_step"]
    s = f["seconds"]
    assert set(s) >= {"detect", "wait", "restore", "recompile", "total"}
    assert all(v is not None and v >= 0 for k, v in s.items() if k != "recompile")
    assert s["total"] >= s["detect"] + s["wait"] + s["restore"]

    # The restarted process found the train step in the persistent compilation
    # cache the first process filled (the first process compiled it).
    assert f["executable"] == "cached" and f["compile_s"] >= 0
    crash_first = next(json.loads(line) for line in (out / "crash.jsonl").read_text()
                       .splitlines() if '"loss"' in line)
    assert crash_first["executable"] == "compiled"
    assert any((out / "compile-cache").iterdir())

    assert report["steps_completed"] == 40
    assert report["loss_matches_reference"] is True
    assert report["loss_max_abs_diff"]["after_recovery"] <= 1e-6
    assert 0 < report["goodput"] < 1
    assert report["final_loss"] < 3.0
    for run in ("crash", "resume", "reference"):
        lines = (out / f"{run}.jsonl").read_text().splitlines()
        assert any('"loss"' in line for line in lines)
    # The trainers reached the hosts only through their sidecars, one process each.
    cluster = report["cluster"]
    assert cluster["isolation"] in ("namespaces", "processes")
    assert len({h["sidecar_pid"] for h in cluster["hosts"]}) == 4
    assert list(ramdisk.iterdir()) == [], "the demo leaves its RAM-disk folder behind"
