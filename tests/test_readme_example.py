"""The README's training loop, run as written: it resumes from the backup after its
RAM disk is wiped, and ends where an uninterrupted run ends.

The code block is taken from README.md as it stands and run in real Python
processes; the replicator is a real ``mtc-replicator`` process backing up to a
``file://`` bucket. One host (this machine's 8 CPU devices), so one replicator
and no peer (``--replicas 0``): the backup is the only tier left after the wipe.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from doc_blocks import python_block
from jax.sharding import Mesh
from replicators import Cluster, assert_state_equal, env_with_repo, make_state, new_cluster
from xla_flags import cpu_flags

import mtc
import mtc.replicas
from mtc.replicas import prepare_restore
from mtc.sidecar.backup.job import MANIFEST
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process  # every test here starts processes

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    return python_block("README.md", "## Use it in a training loop")


def run_example(code: Path, local_dir: Path, steps: int, replicators: str | None
                ) -> list[str]:
    env = env_with_repo()
    env.update(MTC_DIR=str(local_dir), NUM_STEPS=str(steps),
               XLA_FLAGS=cpu_flags(8), JAX_PLATFORMS="cpu")
    env.pop("MTC_REPLICATORS", None)
    if replicators:
        env["MTC_REPLICATORS"] = replicators
    r = subprocess.run([sys.executable, str(code)], capture_output=True, text=True,
                       timeout=180, env=env)
    assert r.returncode == 0, f"the README's example failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    return r.stdout.strip().splitlines()


def backed_up(bucket: Path) -> list[int]:
    d = bucket / "steps"
    return sorted(int(s) for s in os.listdir(d) if (d / s / MANIFEST).is_file()) \
        if d.is_dir() else []


def test_readme_loop_resumes_from_the_backup_after_a_wiped_ram_disk(
        ramdisk: Path, tmp_path: Path, clusters: list[Cluster]) -> None:
    code = tmp_path / "example.py"
    code.write_text(readme_example())
    bucket = ramdisk / "bucket"
    cl = new_cluster(clusters, ramdisk / "job", 1, 1, extra=(
        "--replicas", "0", "--backup", f"file://{bucket}", "--backup-interval-steps", "10"))
    cl.start_all()
    addrs = ",".join(cl.addrs)

    # First run: nothing anywhere, so it starts at step 0, and saves 1 (the first
    # save of a job, as Orbax's), 10, 20, 30.
    out = run_example(code, ramdisk / "job", 30, addrs)
    assert not any(line.startswith("resumed") for line in out), out
    wait_until("step 30 backed up", lambda: 30 in backed_up(bucket), 60,
               detail=lambda: f"the backup holds {backed_up(bucket)}")

    # The host loses its RAM disk (and its replicator with it), and comes back empty.
    cl.stop_all()
    shutil.rmtree(cl.root(0))
    cl.start_all()
    out = run_example(code, ramdisk / "job", 50, addrs)
    assert out[0] == "resumed from step 30 (backup tier)", out
    resumed_end = out[-1]

    # Where an uninterrupted run of the same program ends, bit for bit.
    reference = run_example(code, ramdisk / "reference", 50, None)
    assert reference[-1].startswith("step 50: sum(w) = "), reference
    assert resumed_end == reference[-1]
    # Without replicators, a restart resumes from its own RAM disk.
    again = run_example(code, ramdisk / "reference", 60, None)
    assert again[0] == "resumed from step 50 (local tier)", again


def test_latest_step_reaches_the_peer_tier_and_says_so(
        ramdisk: Path, mesh: Mesh, clusters: list[Cluster],
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 slices x 2 hosts: host 1 loses its RAM disk; ``latest_step()`` still finds
    the newest step (its data on host 3, its peer), says so, and the restore of that
    step needs no second agreement."""
    cl = new_cluster(clusters, ramdisk, 4, 2, extra=("--replicas", "1"))
    cl.start_all()
    state = make_state(mesh, 2.0)
    # The controller reaches each host through its sidecar process.
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options(max_to_keep=None)) as mgr:
        assert mgr.save(2, state)
    cl.wait_replicated(2, timeout=30)
    cl.lose_host(1)  # its replicator, sidecar and RAM disk
    cl.start(1)
    opts = cl.options(max_to_keep=None)  # host 1's sidecar restarted, empty
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        # The RAM disks alone: host 1's data of every step is gone, others hold step 2.
        with pytest.raises(mtc.DataLossError, match=r"host 0 holds steps \[2\]"):
            mgr.latest_step()
    with_replicators = dataclasses.replace(opts, replicators=tuple(cl.addrs),
                                           restore_timeout_s=30.0)
    caplog.set_level(logging.INFO, logger="mtc")
    rounds: list[str | None] = []  # the real call, counted, by restore id

    def counted(*args: Any, **kw: Any) -> Any:
        got = prepare_restore(*args, **kw)
        assert kw.get("restore_id") in (None, got.restore_id)
        rounds.append(got.restore_id)
        return got

    monkeypatch.setattr(mtc.replicas, "prepare_restore", counted)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=with_replicators) as mgr:
        assert mgr.latest_step() == 2
        assert mgr.last_restore_tiers == {0: "local", 1: "peer", 2: "local", 3: "local"}
        assert mgr.last_restore_tier == "peer"
        assert_state_equal(mgr.restore(2, state), state)
        assert mgr.last_restore_tier == "peer"
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("mtc")]
    assert any(m.startswith("mtc: latest step 2, agreed by every host (tier: peer)")
               for m in lines), lines
    # restore(2) used the agreement latest_step() made: host 1's shards are its own
    # (no other host holds them), so it asked host 1 once more, for the same
    # decision, to wait for them.
    assert len(rounds) == 2 and len(set(rounds)) == 1, rounds
    assert any("waiting for their data" in m for m in lines), lines
    restored = [m for m in lines if m.startswith("mtc: restored step 2:")]
    assert len(restored) == 1 and "from the peer tier" in restored[0] and "1=peer" in restored[0]


def test_the_first_screens_example_resumes_where_it_stopped(tmp_path: Path) -> None:
    """The README's first example (before anything else), as written but for its
    folder and its step count: a second run restores the first's newest step."""
    block = python_block("README.md", "# mtc — multi-tier checkpointing for JAX")
    assert README.read_text().index(block) < README.read_text().index("## Install")
    assert len(block.strip().splitlines()) <= 11, block  # ten lines and a blank
    code = tmp_path / "first.py"
    code.write_text("from mtc.testing import record_restores\n"
                    "recording = record_restores()\nseen = recording.__enter__()\n"
                    + block.replace('"/dev/shm/mtc"', repr(str(tmp_path / "ram")))
                    .replace("1000", "int(__import__('sys').argv[1])")
                    + 'print("at", state["step"], float(state["w"][0, 0]), '
                      '[r.step for r in seen])\n')
    env = {**env_with_repo(), "JAX_PLATFORMS": "cpu"}

    def run(steps: int) -> str:
        r = subprocess.run([sys.executable, str(code), str(steps)], capture_output=True,
                           text=True, timeout=180, env=env)
        assert r.returncode == 0, r.stderr[-4000:]
        return r.stdout.strip().splitlines()[-1]

    assert run(200) == "at 200 200.0 []"
    assert run(300) == "at 300 300.0 [200]"  # restored the first run's newest step
    assert sorted(int(p.name) for p in (tmp_path / "ram").rglob("*")
                  if p.is_dir() and p.name.isdigit()) == [1, 100, 200, 300]
