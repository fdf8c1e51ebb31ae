"""A replicator's garbage collection stays bounded when replication fails, and the
fault is named (issue 56, item 7).

Real replicator and sidecar processes (tests/replicators.py), 2 slices of 2 hosts,
one peer copy each; the controller reaches the hosts through their sidecars. Host
3's replicator is started with a wrong address for host 1, its copy target: a
loopback port nobody listens on. Its RAM disk is a real tmpfs (root needed, as in
CI) sized for ``max_to_keep + 2`` steps of a healthy host (its own data and its
peer's copy, as a job sizes it). It used to keep every step, waiting for a target
that never answers, until a save failed with ``RamDiskFullError``.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from replicators import Cluster, new_cluster

import mtc
from mtc import cli
from mtc.ports import free_ports
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process  # every test here starts processes

KEEP = 2  # --keep and max_to_keep, as in the trial
AWAITING = 2  # the replicators' --keep-awaiting default
# The target: 500 steps. A save every 20 of them: the replicators collect
# garbage at most as often as the coordinator gathers its complete-step view
# (--gc-view-interval-seconds: once a second by default, which bounds its cost), so
# a job saving faster than that piles steps up on every host, healthy ones too.
# Here the view is gathered 5 times a second: 25 saves at that pace keep this test
# to about 20 s, and are 6 times the steps this RAM disk holds.
STEPS, INTERVAL = 500, 20
GC_VIEW_S = 0.2


def _mount(path: Path, size: int) -> None:
    opts = f"size={size}" if not path.is_mount() else f"remount,size={size}"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")


def _own_steps(root: Path) -> list[int]:
    """The host's committed steps, as the test (playing the host) sees its root."""
    return sorted(int(n) for n in os.listdir(root) if n.isdigit())


def _held_bytes(folder: Path) -> int:
    """Bytes of the pages a step's files take (tmpfs counts whole pages)."""
    page = 4096
    return sum(-(-p.stat().st_size // page) * page for p in folder.rglob("*") if p.is_file())


def _status(cl: Cluster, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main(["status", "--nodes", ",".join(cl.addrs)])
    return rc, capsys.readouterr().out


def test_a_peer_address_nobody_answers_never_fills_the_ram_disk_and_is_named(
        ramdisk: Path, mesh: Mesh, clusters: list[Cluster],
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2, extra=(
        "--keep", str(KEEP), "--gc-view-interval-seconds", str(GC_VIEW_S)))
    dead = f"127.0.0.1:{free_ports(1)[0]}"  # nobody listens there
    nodes = list(cl.addrs)
    nodes[1] = dead
    cl.rank_args[3] = ("--nodes", ",".join(nodes))  # the last --nodes wins
    root3 = cl.root(3)
    root3.mkdir(parents=True)
    _mount(root3, 64 << 20)  # roomy until a healthy step's size is known
    try:
        cl.start_all()
        # Named in mtc status within the replicator's grace (a few asks), not at the
        # 120 s replication warning.
        said: list[tuple[int, str]] = []

        def named() -> bool:
            said[:] = [_status(cl, capsys)]
            return "PEER UNREACHABLE" in said[0][1]

        wait_until("mtc status naming the unreachable peer", named, 30, poll_s=0.2,
                   detail=lambda: said[0][1])
        ((rc, out),) = said
        assert rc == 1, out
        assert f"rank 3: PEER UNREACHABLE: rank 1 at {dead} has not answered" in out, out
        assert "its steps are not copied there" in out, out

        # 128 KiB a host, unique to it (no data-parallel twin to link).
        w = jax.device_put(jnp.arange(8 * 8192, dtype=jnp.float32) / 7,
                           NamedSharding(mesh, P(("replica", "model"))))
        opts = cl.options(replicators=True, max_to_keep=KEEP, save_interval_steps=INTERVAL,
                          restore_timeout_s=30)
        with caplog.at_level(logging.INFO, logger="mtc.manager"), \
                mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
            # The trainer's log names the fault at once (its replicator already does).
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                      and f"cannot reach rank 1 at {dead}" in r.getMessage()]
            assert warned and "host 3's replicator" in warned[0], caplog.text
            assert "this host's steps are not copied to a peer" in warned[0]

            # A healthy step's size on host 3: its own data and host 1's copy.
            assert mgr.save(1, {"w": w}, force=True)
            mgr.wait_until_finished()
            copy = root3 / ".mtc-replica" / "1" / "1"
            wait_until("host 1's step 1 on host 3", copy.is_dir, 30)
            step = _held_bytes(root3 / "1") + _held_bytes(copy)
            _mount(root3, (KEEP + 2) * step)

            most = 0
            for s in range(2, STEPS + 1):
                if not mgr.save(s, {"w": w}):
                    continue  # not on the interval
                mgr.wait_until_finished()  # RamDiskFullError would surface here
                most = max(most, len(_own_steps(root3)))
                # The job trains on while the replicators collect (at most 5 Hz).
                wait_until(f"host 3 keeping at most {KEEP + AWAITING} steps at step {s}",
                           lambda: len(_own_steps(root3)) <= KEEP + AWAITING, 15,
                           detail=lambda: f"it keeps {_own_steps(root3)}")
                own = _own_steps(root3)
        # Bounded: --keep, --keep-awaiting, and the step committed since the last pass.
        assert most <= KEEP + AWAITING + 1, most
        assert own[-KEEP:] == [STEPS - INTERVAL, STEPS], own
        # The other hosts replicate and collect as ever.
        for h in (0, 1, 2):
            assert len(_own_steps(cl.root(h))) <= KEEP + 1
        rc, out = _status(cl, capsys)
        assert rc == 1 and f"rank 3: PEER UNREACHABLE: rank 1 at {dead}" in out, out
    finally:
        cl.stop_all()
        subprocess.run(["umount", "-l", str(root3)], check=False)
