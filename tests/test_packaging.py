"""The installed distribution claims no generic top-level names: a user's own
``sidecar.py`` or ``trainer.py`` beside their script does not break mtc."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_distribution_top_level_names_are_prefixed() -> None:
    dist = md.distribution("mtc")
    top = set((dist.read_text("top_level.txt") or "").split())
    assert top, "mtc's metadata lists no top-level packages"
    assert top == {"mtc"}, top
    for entry in dist.entry_points:
        assert entry.value.startswith("mtc."), entry


@pytest.mark.process
def test_every_file_imports_under_one_name() -> None:
    """The host side and the trainers are mtc.sidecar and mtc.trainer, nothing else:
    no symlinks, no second top-level name (an ``except`` on one name's error class
    would miss the other's)."""
    for link in ("mtc_sidecar", "mtc_trainer", "mtc/sidecar", "mtc/trainer"):
        assert not (REPO / link).exists(), link
    code = textwrap.dedent("""
        import importlib, importlib.util, sys
        from mtc.sidecar.replicator.wire import client
        from mtc.trainer import cluster
        print(client.__file__, cluster.__file__)
        for name in ("mtc_sidecar", "mtc_trainer", "sidecar", "trainer"):
            assert importlib.util.find_spec(name) is None, name
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    client, cluster = r.stdout.split()
    assert client == str(REPO / "sidecar" / "replicator" / "wire" / "client.py")
    assert cluster == str(REPO / "trainer" / "cluster.py")


@pytest.mark.process
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


def test_the_oldest_lane_installs_the_stated_lower_bounds() -> None:
    """tests/oldest-constraints.txt (``make test-oldest``) pins each version-sensitive
    dependency at the lower bound pyproject.toml states, so the range is what ran."""
    import tomllib

    from packaging.requirements import Requirement

    deps = {Requirement(r).name: Requirement(r) for r in tomllib.loads(
        (REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    pins = dict(line.split("==") for line in (REPO / "tests" / "oldest-constraints.txt")
                .read_text().splitlines() if line and not line.startswith("#"))
    assert set(pins) == {"jax", "jaxlib", "orbax-checkpoint", "pathwaysutils", "grain"}
    for name, version in pins.items():
        lower = [s.version for s in deps[name].specifier if s.operator == ">="]
        assert lower == [version], (name, deps[name].specifier, version)


def test_configure_py_declares_pyyaml_and_says_so_when_it_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/configure.py needs PyYAML, which ``pip install mtc`` does not bring: an
    extra of its own declares it, the page that runs the script installs it, and
    without it the script says which to install instead of a bare ImportError."""
    import importlib.util
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("PyYAML") for d in extras["deploy"]), extras
    assert "mtc[deploy]" in extras["dev"]
    page = (REPO / "docs" / "deploy.md").read_text()
    assert page.index("pip install 'mtc[deploy]'") < page.index("python deploy/configure.py")
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml fails
    spec = importlib.util.spec_from_file_location("configure_without_yaml",
                                                  REPO / "deploy" / "configure.py")
    assert spec is not None and spec.loader is not None
    with pytest.raises(SystemExit, match=r"needs PyYAML: pip install 'mtc\[deploy\]'"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
