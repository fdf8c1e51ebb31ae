"""The installed distribution claims no generic top-level names: a user's own
``sidecar.py`` or ``trainer.py`` beside their script does not break mtc."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_distribution_top_level_names_are_prefixed() -> None:
    dist = md.distribution("mtc")
    top = set((dist.read_text("top_level.txt") or "").split())
    assert top, "mtc's metadata lists no top-level packages"
    assert top <= {"mtc", "mtc_sidecar", "mtc_trainer"}, top
    for name in ("sidecar", "trainer"):
        for entry in dist.entry_points:
            assert not entry.value.startswith(name + "."), entry


def test_a_users_sidecar_and_trainer_modules_do_not_shadow_mtc(tmp_path: Path,
                                                               ramdisk: Path) -> None:
    for name in ("sidecar", "trainer"):
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit('the user\\'s {name}.py')\n")
    (tmp_path / "train.py").write_text(textwrap.dedent(f"""
        import numpy as np
        import mtc
        with mtc.CheckpointManager({str(ramdisk)!r}) as mgr:
            mgr.save(1, {{"w": np.arange(4)}})
            mgr.wait_until_finished()
            back = mgr.restore(1)
        assert (back["w"] == np.arange(4)).all()
        print("resumed", mgr.last_restore_tier)
    """))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed local" in r.stdout
