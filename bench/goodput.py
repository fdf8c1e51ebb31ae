"""Goodput of the elastic trainer losing a host every ``--failure-every-s`` seconds.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/goodput.py [--steps 1200] [--failure-every-s 120] [--out DIR]
    .venv/bin/python bench/goodput.py --quick   # 480 steps, no reference run (~5 min)
    .venv/bin/python bench/goodput.py --quick --reference   # and this machine's noise floor

It drives the demo's trainer, ``mtc.trainer.elastic``, the way ``make demo`` does (a
:class:`LocalCluster` of 4 replicators in 2 slices, the 3.2M-parameter model,
the per-step snapshot, its CPU devices' buffers reused as an accelerator's pool
reuses them: ``--device-memory``), with host losses only and a save every 20
steps. What training does while the lost host is replaced (``--host-return-s``)
is the trainer's ``--pause-policy``: by default ``resize``, as pathwaysutils' elastic
model has it (go on at once on the surviving slice from the snapshot, scale back
up from it when the host is back); ``replacement`` pauses for the host and
restores through mtc from the peer tier. The JSON says which (``pause_policy``).
Besides the target's figure, ``goodput_steady_state_full_mesh_ideal`` counts
every steady step at the full mesh's median step, so that running slower on
fewer slices counts as lost too. A host is lost at the first save once
``--failure-every-s`` seconds (default 120: the target's "one failure every 2
minutes") have passed since the last failure; the JSON reports the measured
intervals. It scores the run with the demo's own ``goodput`` function: the time
the trainer's uninterrupted reference run (same process, same meshes, no
failures, no checkpoints) took for the steps of the final model, over the wall
time (without the reference, ``--quick``, the run's median step on each mesh
stands in). It also reports the goodput without the one-time start-up (process
start, JAX import, init, the first compile), and in steady state (also without
the one-time compiles ahead of the one-slice meshes that start with the first
step, and without the seconds the fault injector itself held training to stage
a failure: waiting for the save to reach the peer), the figure to hold against
the 98% target; per kind of failure the median and worst recovery and of each
stage, and where each step's executable came from; the hosts' CPU per save
(``cpu_in_steady_state``) and each core's steal (``steal_by_core``: the share
of its time the hypervisor ran something else, in the steady state and while
the reference ran). ``--slice-loss-at`` adds replica resizes (and the
scale-ups after them) to the mix. ``--failure-every-s 0 --save-interval
100000`` saves nothing and loses nothing: what the machine's step-time jitter
alone makes of the figure.

Where the machine has two or more cores, the run is made twice: first pinned as on a
real host (a TPU host's CPUs are not its accelerators: the threads that run the
trainer's CPU devices' programs, standing in for the accelerators, alone on one
core; the hosts' sidecars and replicators, the trainer's compiles and the rest of
the trainer (its Python loop, gRPC, snapshots; ``--loop-cores either``: on any core)
on the others), which gives the figures above, then unpinned (every process where
the scheduler puts it, competing for the same cores), whose goodput figures are
under ``unpinned`` (it loses a host after the same saves as the pinned run: its
steps, on both cores, take less wall time). ``--no-pin``: the unpinned run alone.
Pinned, the hosts' processes also run at nice 19 (``--host-nice``) below the
trainer's loop that shares their cores: on Pathways the loop runs on the controller,
another machine, and no host's work delays it; on a core of their own they keep
every cycle the loop leaves (most: the loop's Python is light).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# After the installed packages (as bench/_common.py): an installed mtc (a wheel, on
# a host with no index) is the one imported; the checkout gives ``bench``.
if (_repo := str(Path(__file__).resolve().parents[1])) not in sys.path:
    sys.path.append(_repo)

from bench._cpu import CpuSampler
from bench._goodput_figures import TARGET_FAILURE_EVERY_S, analyse, read_records
from bench._log import logger
from bench._machine import machine_state
from bench._pin import DEVICE_THREADS, Pinner, pinning
from mtc.elastic.compile_ahead import COMPILE_THREAD
from mtc.testing.local_cluster import STATE, LocalCluster
from mtc.trainer.demo import REPO, child_env
from mtc.trainer.device_memory import DEFAULT as DEVICE_MEMORY
from mtc.trainer.device_memory import MODES as DEVICE_MEMORY_MODES
from mtc.trainer.elastic_demo import DEVICES as TRAINER_DEVICES
from mtc.trainer.policy import PAUSE_POLICIES

# The trainer's compiles (XLA's pool, and the compile-ahead thread) run on the CPUs'
# cores: a real job compiles on its hosts' CPUs (Pathways: on the controller's),
# never on its accelerators.
COMPILE_THREADS = frozenset({"tf_XLACompile", COMPILE_THREAD})


log = logger("goodput")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None,
                   help="steps to train (default 1200; --quick: 480)")
    p.add_argument("--failure-every-s", type=float, default=TARGET_FAILURE_EVERY_S,
                   help="lose a host at the first save once this many seconds passed since "
                        "the last failure (0: off)")
    p.add_argument("--host-loss-every", type=int, default=0,
                   help="also lose a host after the save of every this many steps (0: off)")
    p.add_argument("--quick", action="store_true",
                   help="480 steps and no reference run (the median step is the ideal)")
    p.add_argument("--host-loss-when", choices=("replicated", "mid-save"), default="replicated")
    p.add_argument("--model", choices=("small", "tiny"), default="small")
    p.add_argument("--save-interval", type=int, default=20,
                   help="steps between saves (the per-step snapshot bounds the replay to one "
                        "step whatever this is; saves bound it when the snapshot is gone)")
    p.add_argument("--host-return-s", type=float, default=1.5)
    p.add_argument("--pause-policy", choices=PAUSE_POLICIES, default="resize",
                   help="the trainer's --pause-policy: train on the surviving slice while the "
                        "lost host is replaced and scale back up (resize), or pause for the "
                        "replacement and restore through mtc (replacement)")
    p.add_argument("--slice-loss-at", default="",
                   help="also lose slice 1 at these steps (comma-separated), back after "
                        "--slice-down-steps: replica resize and scale-up in the mix")
    p.add_argument("--slice-down-steps", type=int, default=60)
    p.add_argument("--no-reference", dest="reference", action="store_false", default=None,
                   help="skip the uninterrupted reference run (its step times are the ideal; "
                        "without it, the median step stands in)")
    p.add_argument("--reference", dest="reference", action="store_true",
                   help="run the reference with --quick too: its steps, scored as the run's "
                        "are, give this machine's noise floor (see noise_floor)")
    p.add_argument("--dispatch", choices=("colocated", "process"), default="colocated",
                   help="how the trainer reaches the hosts: colocated Python (Pathways, the "
                        "default, as make demo) or seam requests to their sidecars")
    p.add_argument("--no-snapshot", action="store_true",
                   help="pass --no-snapshot: no per-step host snapshot of the state")
    p.add_argument("--device-memory", choices=DEVICE_MEMORY_MODES, default=DEVICE_MEMORY,
                   help="the trainer's --device-memory: its CPU devices' buffers reused as "
                        "an accelerator's pool reuses them (default), or mapped fresh for "
                        "each as glibc does by default")
    p.add_argument("--replicator-nice", type=int, default=0, metavar="N",
                   help="the replicators' --nice (default 0, as the demo): on these 2 "
                        "cores the trainer's CPU devices stand in for accelerators, and "
                        "the replicators' work after a save takes the cores from them; "
                        "19 measures what that contention costs (a busy trainer then "
                        "starves the peer tier, whose lag grows: see steps_lost)")
    p.add_argument("--host-nice", type=int, default=19, metavar="N",
                   help="pinned: the nice of the hosts' sidecars and replicators (their "
                        "threads' and their scheduling groups'), below the trainer's loop "
                        "that shares their cores: a real job's loop runs elsewhere "
                        "(Pathways: on the controller) and never waits for them; they "
                        "still have every cycle it leaves. 0: left as they start")
    p.add_argument("--loop-cores", choices=("hosts", "either"), default="hosts",
                   help="pinned: where the trainer's threads other than its devices' run "
                        "(its Python loop, gRPC, snapshots): on the hosts' cores (default: "
                        "a real job's loop never runs on its accelerators) or on either")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="one unpinned run only (default, with 2 or more cores: a run with the "
                        "trainer on one core and the hosts' processes on the others, as on a "
                        "real host, then the same run unpinned)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 480 if args.quick else 1200
    if args.reference is None:
        args.reference = not args.quick
    out = args.out or Path(tempfile.mkdtemp(prefix="mtc-goodput-"))
    out.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    before = machine_state()
    if args.pin and len(cores) >= 2:
        # As on a real host: the trainer's devices alone on one core, the hosts'
        # sidecars and replicators on the others; then the same run unpinned.
        result = run_once(args, out / "pinned", ({cores[0]}, set(cores[1:])))
        # Unpinned, the same steps take less wall time (both cores run them): lost
        # every --failure-every-s seconds it could lose no host at all. It loses
        # one after the same saves as the pinned run did instead.
        at = [f["step_at_failure"] for f in result["failures"] if f["kind"] == "host_loss"]
        unpinned = run_once(args, out / "unpinned", None,
                            host_loss_at=at if args.failure_every_s > 0 else None)
        result["unpinned"] = {k: v for k, v in unpinned.items()
                              if k.startswith(("goodput", "noise_floor"))
                              and not k.endswith(("definition", "definition_text"))}
        result["unpinned"]["host_losses_after_saves_of"] = [
            f["step_at_failure"] for f in unpinned["failures"] if f["kind"] == "host_loss"]
    else:
        result = run_once(args, out, None)
    result["pause_policy"] = args.pause_policy
    result["machine"] = {"before": before, "after": machine_state()}
    result["config"] = vars(args) | {"out": str(out), "cpus": os.cpu_count()}
    print(json.dumps(result, indent=2, default=str))
    return 0


def run_once(args: argparse.Namespace, out: Path,
             pin: tuple[set[int], set[int]] | None,
             host_loss_at: list[int] | None = None) -> dict[str, Any]:
    """One run of the trainer against a fresh cluster; ``pin``: (the cores of the
    trainer's devices, the hosts' cores), or None to let the scheduler place
    everything. ``host_loss_at``: lose a host after the saves of these steps
    instead of every ``--failure-every-s`` seconds."""
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "elastic.jsonl"
    jsonl.unlink(missing_ok=True)
    base = Path("/dev/shm") / f"mtc-cluster-goodput-{os.getpid()}-{'pinned' if pin else 'free'}"
    cluster: LocalCluster | None = None
    proc: subprocess.Popen[bytes] | None = None
    # The pinned run's losses (which --host-loss-every's are among) or every N steps.
    losses = host_loss_at if host_loss_at is not None else (
        range(args.host_loss_every, args.steps, args.host_loss_every)
        if args.host_loss_every > 0 else ())
    try:
        cluster = LocalCluster.up(
            base, replicator_nice=args.replicator_nice,
            colocated_devices=TRAINER_DEVICES if args.dispatch == "colocated" else 0)
        cmd = [sys.executable, "-m", "mtc.trainer.elastic", "--cluster", str(base),
               "--log", str(jsonl), "--steps", str(args.steps),
               "--save-interval", str(args.save_interval),
               "--host-loss-at", ",".join(str(s) for s in losses),
               "--host-loss-every-s", str(0.0 if host_loss_at is not None
                                          else args.failure_every_s),
               "--host-loss-when", args.host_loss_when, "--model", args.model,
               "--host-return-s", str(args.host_return_s),
               "--pause-policy", args.pause_policy, "--dispatch", args.dispatch,
               "--compile-cache", str(out / "compile-cache")]
        if args.slice_loss_at:
            cmd += ["--slice-loss-at", args.slice_loss_at,
                    "--slice-down-steps", str(args.slice_down_steps)]
        if args.no_snapshot:
            cmd.append("--no-snapshot")
        cmd += ["--device-memory", args.device_memory]
        if not args.reference:
            cmd.append("--no-reference")
        # Pinned, the trainer's threads start on ``loop`` and those that run its
        # devices' programs move to the devices' cores.
        loop = (pin[1] if args.loop_cores == "hosts" else pin[0] | pin[1]) if pin else set()
        log(" ".join(cmd[1:]) + (f" (pinned: the trainer's devices on cores {sorted(pin[0])}, "
                                 f"the hosts and the trainer's compiles on {sorted(pin[1])}, "
                                 f"the rest of the trainer on {sorted(loop)})" if pin
                                 else " (unpinned)"))

        def pids() -> dict[str, list[int]]:
            hosts = json.loads((base / STATE).read_text())["machine"]["hosts"]
            return {"sidecars": [h["sidecar_pid"] for h in hosts if h.get("sidecar_pid")],
                    "replicators": [h["replicator_pid"] for h in hosts
                                    if h.get("replicator_pid")],
                    "trainer": [proc.pid] if proc is not None else []}

        def host_pids() -> list[int]:
            got = pids()
            return got["sidecars"] + got["replicators"]

        def trainer_pid() -> list[int]:
            return pids()["trainer"]

        t_launch = time.time()  # as elastic_demo: just before the trainer starts
        # Pinned, the threads that run the trainer's devices' programs move to the
        # devices' core, and its compiles to the hosts': a real job's Python, compiles
        # (Pathways: on the controller) and I/O run on CPUs, never on its
        # accelerators. Its other threads (the loop) run on the hosts' cores too, as
        # a real job's loop never runs on its accelerators (``--loop-cores either``:
        # on any core; on this VM the two differ less than its drift: docs/elastic-demo.md).
        devices = (Pinner(trainer_pid, pin[0], named=DEVICE_THREADS) if pin
                   else contextlib.nullcontext())
        compiles = (Pinner(trainer_pid, pin[1], named=COMPILE_THREADS) if pin
                    else contextlib.nullcontext())
        with (out / "elastic.log").open("wb") as f, CpuSampler(pids) as cpu, \
                (Pinner(host_pids, pin[1], nice=args.host_nice or None) if pin
                 else contextlib.nullcontext()), devices, \
                compiles:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                    cwd=REPO, preexec_fn=pinning(loop) if pin else None)
            rc = proc.wait()
        if rc != 0:
            tail = (out / "elastic.log").read_text(errors="replace").splitlines()[-25:]
            raise SystemExit(f"trainer exited {rc}:\n" + "\n".join(tail))
        if pin and isinstance(devices, Pinner) and devices.moved == 0:
            raise SystemExit(f"pinned run: no thread named {sorted(DEVICE_THREADS)} in the "
                             "trainer; this JAX runs its CPU devices elsewhere")
        (out / "t_launch.txt").write_text(f"{t_launch!r}\n")
        result = analyse(read_records(jsonl), t_launch, cpu)
        result["pinned"] = ({"device_cores": sorted(pin[0]), "host_cores": sorted(pin[1]),
                             "trainer_other_threads_cores": sorted(loop),
                             "device_threads": sorted(DEVICE_THREADS),
                             "device_threads_moved": devices.moved,
                             "host_nice": args.host_nice,
                             "compile_threads": sorted(COMPILE_THREADS)}
                            if pin and isinstance(devices, Pinner) else None)
        return result
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if cluster is not None:
            cluster.down_latest()


if __name__ == "__main__":
    sys.exit(main())
