"""``make demo``: crash a training process, recover from mtc's RAM-disk tier, check the loss.

Run as ``python -m mtc.trainer.demo --out out/demo``. The demo itself never imports
JAX; it supervises three training processes (``mtc.trainer.train``), each on 8 CPU
devices as 2 slices x 4 devices, checkpointing to 4 simulated hosts (2 per
slice) that share nothing (:mod:`mtc.trainer.isolation`: each its own sidecar
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
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from mtc.trainer.isolation import Hosts, with_checkout
from mtc.trainer.jsonlog import JsonTail
from mtc.trainer.report import max_abs_diff, useful_seconds

REPO = Path(__file__).resolve().parents[1]
DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
POLL_S = 0.02


def child_env() -> dict[str, str]:
    """This process's environment with 8 CPU devices for JAX (set before any JAX import)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*flags, DEVICE_FLAG])
    os.environ["JAX_PLATFORMS"] = "cpu"
    env = with_checkout(dict(os.environ))
    env["PYTHONUNBUFFERED"] = "1"
    return env


# What a training process is doing before its first step, by its last logged event.
PHASES: dict[str | None, str] = {
    None: "starting Python, importing JAX",
    "start": "building the mesh and the checkpoint manager",
    "ready": "initialising or restoring the state",
    "init": "compiling the train step",
    "restore": "compiling the train step",
}


class ChildFailed(RuntimeError):
    pass


@dataclasses.dataclass
class Child:
    """A training process and what it has logged so far."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    out_path: Path
    t_launch: float
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    _tail: JsonTail | None = None

    def poll_log(self) -> list[dict[str, Any]]:
        """New complete lines of the JSON log (a half-written last line waits)."""
        if self._tail is None:
            self._tail = JsonTail(self.log_path)
        new = self._tail.poll()
        self.records.extend(new)
        return new

    @property
    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records if "loss" in r]

    def event(self, name: str) -> dict[str, Any] | None:
        return next((r for r in self.records if r.get("event") == name), None)

    def output_tail(self, lines: int = 25) -> str:
        try:
            text = self.out_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Progress:
    """One live status line on a terminal; occasional plain lines otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stdout.isatty()
        self._last_plain = -1
        self._width = 0
        self._text = ""

    def update(self, child: Child) -> None:
        steps = child.steps
        if not steps:
            events = [r["event"] for r in child.records if "event" in r]
            phase = PHASES.get(events[-1] if events else None, "running")
            text = f"  [{child.name:9}] {phase} ({time.time() - child.t_launch:4.1f}s)"
            step = -1
        else:
            last = steps[-1]
            step = last["step"]
            recent = [s["step_s"] for s in steps[1:][-10:]] or [last["step_s"]]  # not compiling
            rate = len(recent) / max(sum(recent), 1e-9)
            saved = [s["step"] for s in steps if s.get("saved")]
            text = (f"  [{child.name:9}] step {step:4d}/{self.total}  loss {last['loss']:.4f}"
                    f"  {rate:5.1f} steps/s" + (f"  last save {saved[-1]}" if saved else ""))
        if self.tty:
            if text == self._text:
                return
            self._text = text
            pad = max(self._width - len(text), 0)
            sys.stdout.write("\r" + text + " " * pad)
            sys.stdout.flush()
            self._width = len(text)
        elif step >= 0 and step // 25 != self._last_plain // 25:
            print(text, flush=True)
            self._last_plain = step

    def say(self, text: str) -> None:
        if self.tty and self._width:
            sys.stdout.write("\r" + " " * self._width + "\r")
            self._width = 0
            self._text = ""
        print(text, flush=True)


def launch(name: str, out: Path, args: list[str], env: dict[str, str]) -> Child:
    log_path, out_path = out / f"{name}.jsonl", out / f"{name}.log"
    log_path.unlink(missing_ok=True)
    with out_path.open("wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "mtc.trainer.train", "--log", str(log_path),
                                 *args], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    return Child(name, proc, log_path, out_path, time.time())


@dataclasses.dataclass
class Kill:
    t_kill: float
    t_detected: float
    step_seen: int


def supervise(child: Child, progress: Progress, kill_at: int | None = None) -> Kill | None:
    """Follow ``child`` to its exit; SIGKILL it once it logs step ``kill_at``."""
    t_kill: float | None = None
    step_seen = -1
    while True:
        child.poll_log()
        progress.update(child)
        if kill_at is not None and t_kill is None and child.steps \
                and child.steps[-1]["step"] >= kill_at:
            step_seen = child.steps[-1]["step"]
            t_kill = time.time()
            os.kill(child.proc.pid, signal.SIGKILL)
        rc = child.proc.poll()
        if rc is not None:
            t_exit_seen = time.time()
            child.poll_log()
            progress.update(child)
            break
        time.sleep(POLL_S)
    if t_kill is not None:
        if rc != -signal.SIGKILL:
            raise ChildFailed(f"{child.name}: expected death by SIGKILL, exit status {rc}")
        return Kill(t_kill, t_exit_seen, step_seen)
    if rc != 0:
        raise ChildFailed(f"{child.name} exited with status {rc}; its output ends:\n"
                          f"{child.output_tail()}")
    if kill_at is not None:
        raise ChildFailed(f"{child.name} finished before reaching step {kill_at}")
    return None


def losses(child: Child) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in child.steps}


def _wait_detail(resume: Child, kill: Kill) -> dict[str, float | None]:
    """Where the ``wait`` went: relaunch, interpreter and imports, mesh and manager set-up."""
    start, ready = resume.event("start"), resume.event("ready")
    return {
        "relaunch": resume.t_launch - kill.t_detected,
        "python_and_imports": start["t"] - resume.t_launch if start else None,
        "mesh_and_manager": ready["t"] - start["t"] if start and ready else None,
    }


def build_report(args: argparse.Namespace, crash: Child, resume: Child, ref: Child,
                 kill: Kill, params: int | None) -> dict[str, Any]:
    restore_ev = resume.event("restore")
    if restore_ev is None:
        raise ChildFailed("resume run logged no restore")
    resumed_from = int(restore_ev["step"])
    step_at_failure = crash.steps[-1]["step"] if crash.steps else 0
    after = resume.steps
    typical = statistics.median(s["step_s"] for s in after[1:]) if len(after) > 1 else 0.0
    first_after = after[0] if after else None
    restore_start = restore_ev["t"] - restore_ev["seconds"]
    seconds = {
        "detect": kill.t_detected - kill.t_kill,
        "wait": restore_start - kill.t_detected,
        "restore": restore_ev["seconds"],
        "recompile": (first_after["step_s"] - typical) if first_after else None,
        "total": (first_after["t"] - kill.t_kill) if first_after else None,
    }
    final_step = after[-1]["step"] if after else resumed_from
    done = resume.event("done")
    t_end = done["t"] if done else (after[-1]["t"] if after else time.time())
    wall = t_end - crash.t_launch
    useful = (useful_seconds(crash.steps, range(1, resumed_from + 1), typical)
              + useful_seconds(after, range(resumed_from + 1, final_step + 1), typical))

    ref_loss, crash_loss, resume_loss = losses(ref), losses(crash), losses(resume)
    diff_after = max_abs_diff(resume_loss, ref_loss, range(resumed_from + 1, args.steps + 1))
    diff_before = max_abs_diff(crash_loss, ref_loss, range(1, step_at_failure + 1))
    ref_typical = statistics.median(s["step_s"] for s in ref.steps[1:])
    ref_done = ref.event("done")
    ref_wall = (ref_done["t"] if ref_done else ref.steps[-1]["t"]) - ref.t_launch
    return {
        "failures": [{
            "kind": "process_crash",
            "signal": "SIGKILL",
            "step_at_failure": step_at_failure,
            "resumed_from_step": resumed_from,
            "tier": restore_ev.get("tier", "local"),
            "seconds": seconds,
            "steps_lost": step_at_failure - resumed_from,
            # The new process's train step: from the persistent compilation cache
            # the first run filled ("cached"), or compiled again.
            "executable": first_after.get("executable") if first_after else None,
            "compile_s": first_after.get("compile_s") if first_after else None,
            "wait_detail": _wait_detail(resume, kill),
        }],
        "steps_completed": final_step,
        "goodput": useful / wall,
        "final_loss": after[-1]["loss"] if after else None,
        "loss_matches_reference": all(d is not None and d <= args.tolerance
                                      for d in (diff_after, diff_before)),
        "loss_max_abs_diff": {"after_recovery": diff_after, "before_failure": diff_before},
        "reference": "uninterrupted run from step 0, same seed and data order, no checkpoints",
        "reference_goodput": useful_seconds(ref.steps, range(1, args.steps + 1),
                                            ref_typical) / ref_wall,
        "goodput_definition": "time of the optimizer steps in the final model (a process's "
                              "compiling first step counted as a typical step) / wall time "
                              "from the first launch to the end of training",
        "wall_seconds": {"training": wall, "reference": ref_wall,
                         "typical_step": typical},
        "config": {"steps": args.steps, "kill_at": args.kill_at,
                   "save_interval_steps": args.save_interval, "max_to_keep": args.max_to_keep,
                   "seed": args.seed, "params": params, "mesh": {"replica": 2, "model": 4},
                   "simulated_hosts": 4, "hosts_per_slice": 2},
    }


def plot(out: Path, crash: Child, resume: Child, ref: Child, report: dict[str, Any]) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = report["failures"][0]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ref_l = losses(ref)
    ax.plot(list(ref_l), list(ref_l.values()), color="0.6", lw=3, alpha=0.6,
            label="reference (uninterrupted)")
    kept = {s: v for s, v in losses(crash).items() if s <= f["resumed_from_step"]}
    lost = {s: v for s, v in losses(crash).items() if s > f["resumed_from_step"]}
    ax.plot(list(kept), list(kept.values()), color="tab:blue", lw=1.3, label="run 1")
    ax.axvspan(f["resumed_from_step"], f["step_at_failure"], color="tab:red", alpha=0.12,
               lw=0, label=f"lost work ({f['steps_lost']} steps, recomputed)")
    ax.plot(list(lost), list(lost.values()), color="tab:red", lw=0, marker="x", ms=5,
            label="run 1 after the last checkpoint")
    res = losses(resume)
    ax.plot(list(res), list(res.values()), color="tab:green", lw=1.3,
            label=f"run 2, restored step {f['resumed_from_step']}")
    ax.axvline(f["step_at_failure"], color="tab:red", lw=1)
    ax.axvline(f["resumed_from_step"], color="tab:green", lw=1, ls="--")
    ax.annotate(f"SIGKILL at step {f['step_at_failure']}\nback in {f['seconds']['total']:.1f}s",
                xy=(f["step_at_failure"], 0.6), xycoords=("data", "axes fraction"),
                xytext=(6, 0), textcoords="offset points", color="tab:red", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/char)")
    ax.set_title("mtc demo: process crash, restore from the RAM-disk tier")
    ax.legend(loc="upper right", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "loss.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def print_report(report: dict[str, Any], out: Path, png: Path | None, ramdisk: Path) -> None:
    f = report["failures"][0]
    s = f["seconds"]
    cfg = report["config"]
    ok = report["loss_matches_reference"]
    d = report["loss_max_abs_diff"]
    print(f"\nmtc demo: char LM ({cfg['params']:,} params), mesh 2 slices x 4 CPU devices, "
          f"4 simulated hosts, RAM disk {ramdisk}")
    print(f"  failure    {f['kind']} ({f['signal']}) at step {f['step_at_failure']}; "
          f"resumed from step {f['resumed_from_step']} ({f['tier']} tier), "
          f"{f['steps_lost']} steps lost")
    print(f"  recovery   detect {s['detect']:.2f}s  wait {s['wait']:.2f}s  "
          f"restore {s['restore']:.2f}s  recompile {s['recompile']:.2f}s  "
          f"total {s['total']:.2f}s; train step {f.get('executable')} "
          f"({f.get('compile_s') or 0:.2f}s)")
    print(f"  training   {report['steps_completed']} steps, final loss "
          f"{report['final_loss']:.4f}, goodput {report['goodput']:.0%} "
          f"(no-failure reference: {report['reference_goodput']:.0%})")
    def fmt(x: float | None) -> str:
        return "n/a (steps missing)" if x is None else f"{x:.3g}"

    print(f"  loss check {'PASS' if ok else 'FAIL'}: after recovery max |diff| "
          f"{fmt(d['after_recovery'])}, before failure {fmt(d['before_failure'])} "
          f"(tolerance {cfg.get('tolerance', 1e-6):.0e})")
    print(f"  wrote      {out / 'report.json'}" + (f", {png}" if png else
                                                   " (no plot: matplotlib not installed)"))


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
