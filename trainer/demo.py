"""``make demo``: crash a training process, recover from mtc's RAM-disk tier, check the loss.

Run as ``python -m mtc.trainer.demo --out out/demo``. The demo itself never imports
JAX; it supervises three training processes (``mtc.trainer.train``), each on 8 CPU
devices as 2 slices x 4 devices, checkpointing to 4 simulated hosts (2 per
slice) that share nothing (:mod:`mtc.testing.isolation`: each its own sidecar
process and RAM disk, with root a network namespace and a private tmpfs) under
``/dev/shm/mtc-demo-<pid>``; the training processes reach them only through the
sidecars, which outlive a crashed trainer as a host outlives its program:

1. ``crash``: trains, saving every ``--save-interval`` steps, and is SIGKILLed
   once it has logged step ``--kill-at`` (a real crash: no handler runs, saves in
   flight are cut off);
2. ``resume``: a new process restores mtc's latest committed step, and the data
   iterator's position stored with it, and trains to ``--steps``;
3. ``reference``: an uninterrupted run from step 0 with the same seed and no
   checkpointing. Data order and dropout RNG are part of the checkpointed state,
   so the resumed losses must equal the reference's (within ``--tolerance``).

It prints a live progress line, then a report, and writes ``report.json``, the
per-step logs (``<run>.jsonl``), each process's output (``<run>.log``) and, when
matplotlib is installed, ``loss.png`` into ``--out``. Exit status: 0 when the
losses match, 1 when they do not, 2 when a training process failed.

Its parts: the training processes it supervises (:mod:`mtc.trainer.supervise`)
and the report (:mod:`mtc.trainer.demo_report`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path
from types import FrameType

from mtc.testing.isolation import Hosts, with_checkout
from mtc.trainer.demo_report import build_report, plot, print_report
from mtc.trainer.supervise import REPO, Child, ChildFailed, Progress, launch, supervise

__all__ = ["REPO", "ChildFailed", "child_env", "main"]

DEVICE_FLAG = "--xla_force_host_platform_device_count=8"


def child_env() -> dict[str, str]:
    """This process's environment with 8 CPU devices for JAX (set before any JAX import)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, DEVICE_FLAG])
    os.environ["JAX_PLATFORMS"] = "cpu"
    env = with_checkout(dict(os.environ))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("out/demo"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--model", choices=("small", "tiny"), default="small",
                   help="model size preset (small: 3.2M parameters; tiny: 0.4M)")
    p.add_argument("--kill-at", type=int, default=75,
                   help="SIGKILL the first run once it has logged this step")
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--max-to-keep", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-6)
    p.add_argument("--ramdisk-root", type=Path, default=Path("/dev/shm"),
                   help="folder for mtc-demo-<pid> (a tmpfs)")
    p.add_argument("--compile-cache", default=None,
                   help="JAX persistent compilation cache the processes share (default: "
                        "<out>/compile-cache, kept between runs; 'none': off)")
    args = p.parse_args(argv)
    if not 0 < args.kill_at < args.steps:
        p.error("need 0 < --kill-at < --steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = child_env()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").unlink(missing_ok=True)
    root = args.ramdisk_root if args.ramdisk_root.is_dir() else Path("/tmp")
    ramdisk = root / f"mtc-demo-{os.getpid()}"
    cache = args.compile_cache or str((out / "compile-cache").resolve())
    common = ["--steps", str(args.steps), "--seed", str(args.seed), "--model", args.model,
              "--compile-cache", "" if cache == "none" else cache]
    progress = Progress(args.steps)
    children: list[Child] = []
    hosts: Hosts | None = None

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        # Each sidecar runs the job's colocated-Python programs on a quarter of
        # its 8 CPU devices, as a Pathways worker would: the trainer's manager
        # ("auto") takes the colocated dispatch.
        hosts = Hosts(ramdisk, 4, colocated_devices=8)
        for i in range(4):
            hosts.start_sidecar(i, [0, 0, 1, 1], env=env, wait=False)
        for i in range(4):
            hosts.wait_sidecar(i)
        progress.say(f"hosts: 4 sidecars, kept apart by {hosts.isolation}")
        ckpt = [*common, "--ramdisk", str(ramdisk / "controller"),
                "--sidecars", ",".join(h.sidecar_address for h in hosts.hosts),
                "--token-file", str(hosts.token_file),
                "--save-interval", str(args.save_interval), "--max-to-keep",
                str(args.max_to_keep)]
        progress.say(f"run 1: train, SIGKILL after step {args.kill_at} "
                     f"(checkpoints every {args.save_interval} steps in {ramdisk})")
        crash = launch("crash", out, ckpt, env)
        children.append(crash)
        kill = supervise(crash, progress, kill_at=args.kill_at)
        assert kill is not None
        progress.say(f"  SIGKILL pid {crash.proc.pid} after it logged step "
                     f"{crash.steps[-1]['step']}")

        progress.say("run 2: new process restores the latest step and trains on")
        resume = launch("resume", out, [*ckpt, "--resume"], env)
        children.append(resume)
        supervise(resume, progress)
        ev = resume.event("restore") or {}
        progress.say(f"  restored step {ev.get('step')} in {ev.get('seconds', 0):.2f}s, "
                     f"trained to step {resume.steps[-1]['step'] if resume.steps else '?'}")

        progress.say("run 3: uninterrupted reference from step 0")
        ref = launch("reference", out, [*common, "--no-checkpoint"], env)
        children.append(ref)
        supervise(ref, progress)
        progress.say(f"  reference done, final loss {ref.steps[-1]['loss']:.4f}")

        init = crash.event("init") or {}
        report = build_report(args, crash, resume, ref, kill, init.get("params"))
        report["config"]["tolerance"] = args.tolerance
        report["cluster"] = hosts.describe()
        ready = resume.event("ready")
        report["cluster"]["dispatch"] = ready.get("dispatch") if ready else None
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        png = plot(out, crash, resume, ref, report)
        print_report(report, out, png, ramdisk)
        return 0 if report["loss_matches_reference"] else 1
    except ChildFailed as e:
        progress.say(f"\nFAILED: {e}")
        return 2
    finally:
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        if hosts is not None:
            hosts.down()
        shutil.rmtree(ramdisk, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
