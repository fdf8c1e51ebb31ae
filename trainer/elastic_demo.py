"""``make demo``: an elastic training job loses a host, then a slice, and comes back.

Run as ``python -m mtc.trainer.elastic_demo --out out/demo``. It:

1. starts a local cluster (``mtc.trainer.cluster``): 2 slices x 2 simulated hosts
   that share nothing, each its own sidecar process and real ``mtc-replicator``
   and a RAM disk only they see (with root: a network namespace and a private
   tmpfs per host), under ``/dev/shm/mtc-cluster-demo-<pid>``, backups to a
   local folder;
2. runs the elastic trainer (``mtc.trainer.elastic``, a 3.2M-parameter LM) on 8
   CPU devices, saving through the hosts' sidecars: twice it loses a host once
   a save is on its peer (the host's processes SIGKILLed, its RAM disk gone
   with them, the slice's devices raise DATA_LOSS), pauses
   until the host's replacement is back empty and restores through mtc, the
   wiped host's shards from its peer; twice it loses a whole slice, continues
   on the other at once from the per-step snapshot (replica resize) with the
   one-slice step compiled ahead, and scales back up when the slice returns,
   losing no step (``--host-loss-at 0`` or ``--slice-loss-at 0`` leaves a kind
   of failure out; ``--host-loss-when mid-save`` loses the host while the save
   is being written). JAX's compilation cache lives in ``<out>/compile-cache``:
   a second run loads what the first compiled;
3. backs the newest step up to the cluster's backup folder (``mtc backup``),
   shows every host's steps on every tier (``mtc status``), takes the cluster
   down, and prints the report: per failure the step at failure, the step
   resumed from, the tier, seconds to detect, wait, restore and recompile,
   steps lost, and whether the step's executable was ready (compiled ahead),
   cached or compiled; per kind of failure the median and worst recovery; for
   the run steps completed, goodput from launch and in steady state, final
   loss, and whether the loss curve equals an uninterrupted run on the same
   meshes.

It writes ``report.json`` (with a ``cluster`` object: ``isolation``,
``"namespaces"`` or ``"processes"``, and per host its ``address``,
``sidecar_pid`` and ``replicator_pid``), ``elastic.jsonl`` (the trainer's log),
``elastic.log`` (its output), ``cluster-status.txt`` and ``timeline.png`` into
``--out``. Exit status: 0 when the losses match, 1 when they do not, 2 when
the trainer failed. The report is built, plotted and printed by
:mod:`mtc.trainer.elastic_demo_report`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from mtc.testing.local_cluster import LocalCluster
from mtc.trainer.demo import child_env
from mtc.trainer.elastic_demo_report import build_report, plot, print_report
from mtc.trainer.jsonlog import JsonTail
from mtc.trainer.policy import PAUSE_POLICIES
from mtc.trainer.supervise import REPO, ChildFailed

DEVICES = 8  # the trainer's CPU devices (mtc.trainer.elastic asks XLA for them)

POLL_S = 0.05

PHASE = {
    "start": "importing JAX",
    "ready": "building the mesh",
    "slices": "restoring the state",
    "init": "compiling the train step",
    "restored": "compiling / first step",
    "fault": "failure injected",
    "detected": "failure detected: waiting for slices",
    "returned": "lost hosts are back",
    "scale_up": "scaling up",
    "trained": "uninterrupted reference run",
}


class Follower:
    """Reads the trainer's JSON log as it grows; keeps one live status line."""

    def __init__(self, path: Path, total: int) -> None:
        self.path = path
        self.total = total
        self._tail = JsonTail(path)
        self.records = self._tail.records
        self.tty = sys.stdout.isatty()
        self._width = 0
        self._last_plain = -1
        self._announced = 0

    def poll(self) -> list[dict[str, Any]]:
        return self._tail.poll()

    def say(self, text: str) -> None:
        if self.tty and self._width:
            sys.stdout.write("\r" + " " * self._width + "\r")
            self._width = 0
        print(text, flush=True)

    def show(self, new: list[dict[str, Any]], t_launch: float) -> None:
        for r in new:
            ev = r.get("event")
            if ev == "fault":
                what = (f"host {r['host']} (slice {r['slice']})" if r["kind"] == "host_loss"
                        else f"slice {r['slice']} (hosts {r['hosts']})")
                self.say(f"  !! {r['kind']}: lost {what} after step {r['step']}: replicator "
                         f"SIGKILLed, RAM disk wiped, devices raise DATA_LOSS")
            elif ev == "returned":
                self.say(f"  .. hosts {r['hosts']} back (empty RAM disk, new replicator)")
            elif ev == "recovered":
                s = r["seconds"]
                self.say(f"  ok {r['kind']}: resumed from step {r['resumed_from_step']} "
                         f"({r['tier']} tier) on slices {r['slices_after']}, "
                         f"{r['steps_lost']} steps lost, back in {s['total']:.1f}s")
        steps = [r for r in self.records if "loss" in r]
        events = [r["event"] for r in self.records if "event" in r]
        if steps and events and events[-1] in ("fault", "detected", "slices", "scale_up",
                                                "trained"):
            text = f"  [{PHASE.get(events[-1], events[-1])}] ({time.time() - t_launch:5.1f}s)"
        elif steps:
            last = steps[-1]
            recent = [s["step_s"] for s in steps[-10:]]
            rate = len(recent) / max(sum(recent), 1e-9)
            text = (f"  step {last['step']:4d}/{self.total}  loss {last['loss']:.4f}  "
                    f"{rate:5.1f} steps/s  slices {last['slices']}  "
                    f"({time.time() - t_launch:5.1f}s)")
        else:
            phase = PHASE.get(events[-1] if events else "start", "starting")
            text = f"  [{phase}] ({time.time() - t_launch:5.1f}s)"
        if self.tty:
            pad = max(self._width - len(text), 0)
            sys.stdout.write("\r" + text + " " * pad)
            sys.stdout.flush()
            self._width = len(text)
        elif steps and steps[-1]["step"] // 25 != self._last_plain // 25:
            print(text, flush=True)
            self._last_plain = steps[-1]["step"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("out/demo"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--model", choices=("small", "tiny"), default="small",
                   help="model preset: small (3.2M parameters) or tiny (0.4M)")
    p.add_argument("--host-loss-at", type=_steps, default=[30, 130],
                   help="lose a host after the save of the first step at or after each of "
                        "these (comma-separated; 0: no host loss)")
    p.add_argument("--host-loss-when", choices=("replicated", "mid-save"), default="replicated",
                   help="lose the host once that step's save is on its peer, or mid-save")
    p.add_argument("--lost-host", type=int, default=1)
    p.add_argument("--host-return-s", type=float, default=1.5)
    p.add_argument("--slice-loss-at", type=_steps, default=[55, 95],
                   help="lose a slice at the first step at or after each of these "
                        "(comma-separated; 0: no slice loss)")
    p.add_argument("--lost-slice", type=int, default=1)
    p.add_argument("--slice-down-steps", type=int, default=15)
    p.add_argument("--pause-timeout-s", type=float, default=10.0,
                   help="how long to pause for a host being replaced before resizing")
    p.add_argument("--pause-policy", choices=PAUSE_POLICIES, default="replacement",
                   help="the trainer's --pause-policy: pause for a host being replaced and "
                        "restore through mtc from its peer (replacement, the demo's story), "
                        "or train on the other slice meanwhile and scale back up (resize)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-6)
    p.add_argument("--dispatch", choices=("process", "colocated"), default="colocated",
                   help="the trainer reaches the sidecars by colocated Python programs they "
                        "run as Pathways workers would (the default: the path a Pathways job "
                        "runs), or by seam requests (process: a test tool, docs/hosts.md)")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                   help="no per-step in-memory snapshot")
    p.add_argument("--compile-ahead", type=int, default=1,
                   help="the trainer's --compile-ahead (0: compile when a mesh is needed)")
    p.add_argument("--compile-cache", default=None,
                   help="JAX persistent compilation cache (default: <out>/compile-cache, kept "
                        "between runs; 'none': off)")
    p.add_argument("--ramdisk-root", type=Path, default=Path("/dev/shm"),
                   help="folder for mtc-cluster-demo-<pid> (a tmpfs)")
    args = p.parse_args(argv)
    for name in ("host_loss_at", "slice_loss_at"):
        steps = [s for s in getattr(args, name) if s]
        if not all(0 < s < args.steps for s in steps):
            p.error(f"need 0 <= --{name.replace('_', '-')} < --steps")
        setattr(args, name, steps)
    return args


def _steps(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = child_env()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("report.json", "elastic.jsonl", "cluster-status.txt"):
        (out / name).unlink(missing_ok=True)
    root = args.ramdisk_root if args.ramdisk_root.is_dir() else Path("/tmp")
    base = root / f"mtc-cluster-demo-{os.getpid()}"

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    cluster: LocalCluster | None = None
    proc: subprocess.Popen[bytes] | None = None
    follower = Follower(out / "elastic.jsonl", args.steps)
    try:
        cluster = LocalCluster.up(
            base, colocated_devices=DEVICES if args.dispatch == "colocated" else 0)
        started = cluster.describe()
        follower.say(f"cluster up: 4 hosts in 2 slices under {base}, kept apart by "
                     f"{cluster.isolation} (each its own sidecar, replicator and RAM disk), "
                     f"replicators {', '.join(cluster.addresses)}")
        cmd = [sys.executable, "-m", "mtc.trainer.elastic", "--cluster", str(base),
               "--log", str(out / "elastic.jsonl"), "--steps", str(args.steps),
               "--seed", str(args.seed), "--save-interval", str(args.save_interval),
               "--model", args.model, "--lost-host", str(args.lost_host),
               "--host-loss-when", args.host_loss_when, "--host-return-s", str(args.host_return_s),
               "--lost-slice", str(args.lost_slice),
               "--slice-down-steps", str(args.slice_down_steps),
               "--pause-timeout-s", str(args.pause_timeout_s),
               "--pause-policy", args.pause_policy, "--dispatch", args.dispatch,
               "--compile-ahead", str(args.compile_ahead),
               "--compile-cache", args.compile_cache or str((out / "compile-cache").resolve())]
        if args.host_loss_at:
            cmd += ["--host-loss-at", ",".join(map(str, args.host_loss_at))]
        if args.slice_loss_at:
            cmd += ["--slice-loss-at", ",".join(map(str, args.slice_loss_at))]
        if not args.snapshot:
            cmd.append("--no-snapshot")
        t_launch = time.time()
        with (out / "elastic.log").open("wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        while True:
            new = follower.poll()
            follower.show(new, t_launch)
            if proc.poll() is not None:
                follower.show(follower.poll(), t_launch)
                break
            time.sleep(POLL_S)
        if proc.returncode != 0:
            tail = (out / "elastic.log").read_text(errors="replace").splitlines()[-25:]
            raise ChildFailed(f"the trainer exited with status {proc.returncode}; its output "
                              "ends:\n" + "\n".join(tail))
        token = ["--token-file", str(cluster.token_file())]
        backup = subprocess.run([sys.executable, "-m", "mtc.cli", "backup", *token, "--node",
                                 cluster.addresses[0]], capture_output=True, text=True,
                                env=env, cwd=REPO, timeout=120)
        follower.say(f"backup tier: {backup.stdout.strip() or backup.stderr.strip()} "
                     f"(to {cluster.backup})")
        status = subprocess.run([sys.executable, "-m", "mtc.cli", "status", *token, "--nodes",
                                 ",".join(cluster.addresses)], capture_output=True, text=True,
                                env=env, cwd=REPO, timeout=60)
        (out / "cluster-status.txt").write_text(status.stdout)
        follower.say("\nmtc status (every host's steps, own and peer copies):\n"
                     + status.stdout.rstrip())
        report = build_report(args, follower.records, t_launch)
        # How the hosts were kept apart, as they are now (replaced hosts' new pids),
        # and as they started.
        report["cluster"] = {**LocalCluster.load(base).describe(),
                             "hosts_at_start": started["hosts"], "dispatch": args.dispatch}
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        png = plot(out, follower.records, report, t_launch)
        print_report(report, out, png)
        return 0 if report["loss_matches_reference"] else 1
    except ChildFailed as e:
        follower.say(f"\nFAILED: {e}")
        return 2
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if cluster is not None:
            cluster.down_latest()


if __name__ == "__main__":
    sys.exit(main())
