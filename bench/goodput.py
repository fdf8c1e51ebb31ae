"""Goodput of the elastic trainer with one host loss and nothing else, in one run.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/goodput.py [--steps 1200] [--host-loss-at 600] [--out DIR]

``trainer.elastic_demo`` always injects a slice loss too (it requires
``0 < --host-loss-at < --slice-loss-at < --steps``), so this drives the same
trainer, ``trainer.elastic``, the way the demo does (a :class:`LocalCluster` of
4 replicators in 2 slices, the same flags) but without ``--slice-loss-at``, and
scores the run with the demo's own ``goodput`` function. It also reports the
goodput without the one-time start-up (process start, JAX import, init, the
first compile), to compare with a target stated per failure interval.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.cluster import LocalCluster
from trainer.demo import REPO, child_env
from trainer.elastic_demo import final_steps, goodput


def log(msg: str) -> None:
    print(f"[goodput {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def analyse(records: list[dict[str, Any]], t_launch: float) -> dict[str, Any]:
    ev: dict[str, dict[str, Any]] = {}
    for r in records:
        if "event" in r:
            ev.setdefault(r["event"], r)
    t_end = ev["trained"]["t"]
    steps = final_steps(records)
    ordered = sorted(steps.values(), key=lambda r: r["t"])
    first = ordered[0]
    typical = statistics.median(r["step_s"] for r in ordered)
    # The demo's definition: steps in the final model / wall time from launch.
    demo = goodput(records, t_launch, t_end)
    # Without the one-time start-up: from the end of the first step (it carries
    # the first compile) to the end of training, useful time of the later steps.
    # The demo's cap (3x the median on the mesh) is applied alike.
    later = [r for r in ordered if r is not first]
    useful_later = sum(min(r["step_s"], 3 * typical) for r in later)
    window = t_end - first["t"]
    recs = ev["trained"]["recoveries"]
    lost_s = [r["seconds"]["total"] for r in recs]
    steps_lost = [r["steps_lost"] for r in recs]
    startup = first["t"] - t_launch
    final_ids = {id(r) for r in steps.values()}
    replayed_s = sum(r["step_s"] for r in records if "loss" in r and id(r) not in final_ids)
    snapshot_s = sum(r.get("snapshot_s", 0.0) for r in records if "loss" in r)
    save_s = sum(r.get("save_s", 0.0) for r in records if "loss" in r)
    failure_s = sum(lost_s)
    return {
        "goodput_demo_definition": demo,
        "goodput_excluding_startup": useful_later / window,
        "goodput_excluding_startup_definition":
            "sum of step_s of the final model's steps after the first (each capped at 3x the "
            "median step, as in elastic_demo.goodput) / wall time from the end of the first "
            "step to the end of training",
        "goodput_demo_definition_text":
            "elastic_demo.goodput: sum of step_s of the final model's steps (a step above 3x "
            "the median on its mesh counted as 3x the median) / wall time from the trainer "
            "process's launch (before its Python start and JAX import) to its 'trained' event",
        "wall_seconds": {
            "launch_to_end": t_end - t_launch,
            "startup_launch_to_first_step_end": startup,
            "first_step_s": first["step_s"],
            "training_after_first_step": window,
            "useful_after_first_step": useful_later,
            "median_step_s": typical,
            "snapshot_s_sum": snapshot_s,
            "save_s_sum": save_s,
            "failure_recovery_s": failure_s,
            "replayed_steps_s": replayed_s,
            "other_loop_overhead_s": window - useful_later - snapshot_s - save_s - failure_s
            - replayed_s,
            "steps_per_s_median": 1.0 / typical,
        },
        "steps_completed": max(steps),
        "steps_executed_incl_replayed": sum(1 for r in records if "loss" in r),
        "failures": [{k: r[k] for k in ("kind", "step_at_failure", "resumed_from_step", "tier",
                                        "steps_lost")}
                     | {"seconds": {k: r["seconds"][k] for k in
                                    ("detect", "wait", "restore", "recompile", "first_step",
                                     "total")}}
                     for r in recs],
        "failure_seconds_total": failure_s,
        "goodput_loss_from_failure_only": (failure_s + replayed_s) / window,
        "steps_lost_total": sum(steps_lost),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--host-loss-at", type=int, default=600)
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--host-return-s", type=float, default=1.5)
    p.add_argument("--reference", action="store_true",
                   help="also run the trainer's uninterrupted reference (doubles the time)")
    p.add_argument("--no-snapshot", action="store_true",
                   help="pass --no-snapshot: no per-step host snapshot of the state")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="mtc-goodput-"))
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "elastic.jsonl"
    jsonl.unlink(missing_ok=True)
    base = Path("/dev/shm") / f"mtc-cluster-goodput-{os.getpid()}"
    cluster: LocalCluster | None = None
    proc: subprocess.Popen[bytes] | None = None
    try:
        cluster = LocalCluster.up(base)
        cmd = [sys.executable, "-m", "trainer.elastic", "--cluster", str(base),
               "--log", str(jsonl), "--steps", str(args.steps),
               "--save-interval", str(args.save_interval),
               "--host-loss-at", str(args.host_loss_at),
               "--host-return-s", str(args.host_return_s)]
        if args.no_snapshot:
            cmd.append("--no-snapshot")
        if not args.reference:
            cmd.append("--no-reference")
        log(" ".join(cmd[1:]))
        t_launch = time.time()  # as elastic_demo: just before the trainer starts
        with (out / "elastic.log").open("wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(),
                                    cwd=REPO)
            rc = proc.wait()
        if rc != 0:
            tail = (out / "elastic.log").read_text(errors="replace").splitlines()[-25:]
            raise SystemExit(f"trainer exited {rc}:\n" + "\n".join(tail))
        (out / "t_launch.txt").write_text(f"{t_launch!r}\n")
        result = analyse(read_records(jsonl), t_launch)
        result["config"] = vars(args) | {"out": str(out), "slice_loss": None,
                                         "cpus": os.cpu_count()}
        print(json.dumps(result, indent=2))
        return 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if cluster is not None:
            cluster.down_latest()


if __name__ == "__main__":
    sys.exit(main())
