"""A short run of the chaos driver (``make chaos`` runs up to 200 cycles): real
replicator processes, a real trainer process, real SIGKILLs, wipes and damaged
shards; every restore is checked value by value against the function of its step."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_chaos_short_run() -> None:
    base = Path("/dev/shm") / f"mtc-cluster-chaos-test-{uuid.uuid4().hex[:8]}"
    r = subprocess.run([sys.executable, "-m", "mtc_trainer.chaos", "--cycles", "5",
                        "--seconds", "45", "--seed", "3", "--base", str(base)],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(out)
    assert out["cycles"] >= 3
    assert out["corrupt"] == 0 and out["divergent"] == 0 and out["hangs"] == 0, out
    assert out["ok"] + sum(out["errors"].values()) + out["stale"] == out["cycles"], out
    assert out["ok"] >= 1 and out["restore_s"]["max"] > 0
    assert sum(out["faults"].values()) == out["cycles"]
    assert out["isolation"] in ("namespaces", "processes")
    assert not base.exists()  # the cluster was taken down
