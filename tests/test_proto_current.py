"""The generated protobuf code in mtc/proto/ matches proto/ (regenerate: scripts/gen_proto.sh)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # every test here starts processes

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(out)], check=True,
                   cwd=ROOT, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    checked_in = {p.name: p.read_text() for p in (ROOT / "mtc" / "proto").iterdir()
                  if p.is_file()}
    fresh = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    assert set(fresh) == set(checked_in), "run scripts/gen_proto.sh"
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale generated code {stale}: run scripts/gen_proto.sh"
