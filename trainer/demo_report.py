"""The crash demo's report (:mod:`mtc.trainer.demo`): the failure's stages, goodput
and the loss check against the uninterrupted run, as ``report.json``, a plot
(``loss.png``, when matplotlib is installed) and the lines printed."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from mtc.trainer.report import max_abs_diff, useful_seconds
from mtc.trainer.supervise import Child, ChildFailed, Kill


def losses(child: Child) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in child.steps}


def wait_detail(resume: Child, kill: Kill) -> dict[str, float | None]:
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
            "wait_detail": wait_detail(resume, kill),
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
