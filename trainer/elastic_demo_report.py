"""The elastic demo's report (:mod:`mtc.trainer.elastic_demo`): per failure its
stages and tier, per kind the median and worst recovery, goodput and the loss
check, as ``report.json``, a timeline (``timeline.png``, when matplotlib is
installed) and the lines printed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mtc.trainer.report import final_steps, goodput, recovery_by_kind, steady_state
from mtc.trainer.supervise import ChildFailed

STAGE_COLOR = {"detect": "tab:red", "wait": "tab:orange", "restore": "tab:blue",
               "first_step": "tab:purple"}
STAGE_LABEL = {"detect": "detect", "wait": "wait (pause for slices)", "restore": "restore",
               "first_step": "first step (compile if not ready)"}


def build_report(args: argparse.Namespace, records: list[dict[str, Any]],
                 t_launch: float) -> dict[str, Any]:
    ev = {r["event"]: r for r in records if "event" in r}
    if "trained" not in ev:
        raise ChildFailed("the trainer logged no end of training")
    steps = final_steps(records)
    failures = []
    for r in ev["trained"]["recoveries"]:
        f = {k: r[k] for k in ("kind", "step_at_failure", "resumed_from_step", "tier",
                               "seconds", "steps_lost")}
        f["seconds"] = {k: r["seconds"][k] for k in ("detect", "wait", "restore",
                                                      "recompile", "total")}
        # What the targets are measured against: a host loss beyond its replacement's
        # own start, a scale-up beyond the step in flight when the slice returned.
        f["stages"] = {k: r["seconds"][k] for k in ("replacement", "beyond_replacement",
                                                     "in_flight_step", "beyond_in_flight_step")
                       if k in r["seconds"]}
        f["executable"] = r.get("executable")
        f["compile_s"] = r.get("compile_s")
        f["detail"] = {k: v for k, v in r.items() if k not in f and k != "t"}
        f["detail"]["first_step_seconds"] = r["seconds"]["first_step"]
        failures.append(f)
    t_end = ev["trained"]["t"]
    steady = steady_state(records, t_end)
    ref = ev.get("reference")
    diff = ref["max_abs_diff"] if ref else None
    last = steps[max(steps)] if steps else None
    return {
        "failures": failures,
        "steps_completed": max(steps) if steps else 0,
        "goodput": goodput(records, t_launch, t_end),
        "goodput_steady_state": steady["goodput"],
        "goodput_steady_state_definition": steady["definition"],
        "steady_state_seconds": steady["seconds"],
        "recovery_by_kind": recovery_by_kind(failures),
        "final_loss": last["loss"] if last else None,
        "loss_matches_reference": diff is not None and diff <= args.tolerance,
        "loss_max_abs_diff": diff,
        "loss_max_abs_diff_replayed_steps_first_run":
            ref["max_abs_diff_replayed_first_run"] if ref else None,
        "reference": "uninterrupted run from step 0 in the same process, same seed and data "
                     "order, no failures, no checkpoints, on the same mesh at every step "
                     "(8 devices, 4 while resized)",
        "goodput_definition": "ideal time of the optimizer steps in the final model (what "
                              "the uninterrupted reference run, without checkpoints, took "
                              "for each) / wall time from the trainer's launch to the end "
                              "of training",
        "wall_seconds": {"training": t_end - t_launch,
                         "reference_run": ref["seconds"] if ref else None},
        "config": {"steps": args.steps, "save_interval_steps": args.save_interval,
                   "model": args.model, "snapshot": args.snapshot,
                   "host_loss_at": args.host_loss_at or None,
                   "host_loss_when": args.host_loss_when, "lost_host": args.lost_host,
                   "host_return_s": args.host_return_s, "slice_loss_at": args.slice_loss_at or None,
                   "lost_slice": args.lost_slice, "slice_down_steps": args.slice_down_steps,
                   "pause_timeout_s": args.pause_timeout_s,
                   "pause_policy": args.pause_policy, "seed": args.seed,
                   "params": ev.get("init", {}).get("params"),
                   # the CPU devices' buffers (mtc.trainer.device_memory)
                   "device_memory": ev.get("ready", {}).get("device_memory"),
                   "slices": 2, "hosts_per_slice": 2, "devices": 8,
                   "tolerance": args.tolerance},
    }


def plot(out: Path, records: list[dict[str, Any]], report: dict[str, Any],
         t_launch: float) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r for r in records if "loss" in r]
    t = [r["t"] - t_launch for r in steps]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    ax1.plot(t, [r["loss"] for r in steps], ".", ms=3, color="tab:blue", label="loss per step")
    ax1.set_ylabel("loss (nats/char)")
    # Throughput: optimizer steps completed per 1-second bin (0 while recovering).
    end = max(t, default=0.0)
    edges = list(range(0, int(end) + 2))
    counts = [0] * (len(edges) - 1)
    for x in t:
        counts[min(int(x), len(counts) - 1)] += 1
    ax2.step(edges[:-1], counts, where="post", color="tab:green", lw=1,
             label="steps completed per second")
    runs: list[tuple[float, float]] = []  # each stretch of steps on fewer slices
    start: float | None = None
    for prev, r in zip([None, *steps], steps, strict=False):
        small = len(r["slices"]) < 2
        if small and start is None:
            start = r["t"] - t_launch - r["step_s"]
        elif not small and start is not None and prev is not None:
            runs.append((start, prev["t"] - t_launch))
            start = None
    if start is not None:
        runs.append((start, steps[-1]["t"] - t_launch))
    for i, run in enumerate(runs):
        for ax in (ax1, ax2):
            ax.axvspan(run[0], run[-1], color="tab:gray", alpha=0.12,
                       label="on 1 slice (resized)" if ax is ax2 and i == 0 else None)
    ax2.set_ylabel("steps / s")
    ax2.set_xlabel("seconds since launch")
    # Each failure's stages, back to back from the failure to its first step.
    recovered = [r for r in records if r.get("event") == "recovered"]
    seen: set[str] = set()
    for w in (r for r in records if r.get("event") == "waited_for_compile_ahead"):
        if w["seconds"] > 0.05:
            for ax in (ax1, ax2):
                ax.axvspan(w["t"] - t_launch - w["seconds"], w["t"] - t_launch, fc="0.92",
                           hatch="//", ec="0.5", lw=0.5,
                           label="held for a compile ahead (demo)" if ax is ax2 else None)
    for n, rec in enumerate(recovered):
        sec = rec["seconds"]
        t = rec["t"] - t_launch - sec["total"]
        for stage in ("detect", "wait", "restore", "first_step"):
            width = sec[stage]
            label = None if stage in seen else STAGE_LABEL[stage]
            seen.add(stage)
            for ax in (ax1, ax2):
                ax.axvspan(t, t + width, color=STAGE_COLOR[stage], alpha=0.35, lw=0,
                           label=label if ax is ax2 else None)
            t += width
        exe = rec.get("executable")
        ax1.annotate(f"{rec['kind']}\nstep {rec['step_at_failure']} -> {rec['resumed_from_step']}"
                     f" ({rec['tier']})\n{sec['total']:.2f}s" + (f", {exe}" if exe else ""),
                     xy=(rec["t"] - t_launch - sec["total"], 0.97 - 0.2 * (n % 2)),
                     xycoords=("data", "axes fraction"), va="top", fontsize=7,
                     color="tab:purple" if rec["kind"] == "scale_up" else "tab:red")
    steady = report.get("goodput_steady_state")
    ax1.set_title(f"mtc elastic demo: {report['steps_completed']} steps, goodput "
                  f"{report['goodput']:.0%} from launch"
                  + (f", {steady:.1%} in steady state" if steady is not None else ""))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def print_report(report: dict[str, Any], out: Path, png: Path | None) -> None:
    cfg = report["config"]
    print(f"\nmtc elastic demo: char LM ({cfg['params']:,} params), 2 slices x 4 CPU "
          f"devices, 4 simulated hosts with replicators")
    print(f"  {'failure':<11}{'at':>5}{'from':>6}  {'tier':<7}{'detect':>8}{'wait':>7}"
          f"{'restore':>9}{'recompile':>10}{'total':>7}{'lost':>6}  executable")
    for f in report["failures"]:
        s = f["seconds"]
        exe = f.get("executable") or "?"
        ahead = f["detail"].get("executable_detail", {}).get("ahead")
        if exe == "ready":
            exe += f" (compiled ahead in {f['compile_s']:.1f}s)" if ahead else " (in memory)"
        elif f.get("compile_s") is not None:
            exe += f" ({f['compile_s']:.1f}s)"
        print(f"  {f['kind']:<11}{f['step_at_failure']:>5}{f['resumed_from_step']:>6}  "
              f"{f['tier']:<7}{s['detect']:>7.2f}s{s['wait']:>6.2f}s{s['restore']:>8.2f}s"
              f"{s['recompile']:>9.2f}s{s['total']:>6.2f}s{f['steps_lost']:>6}  {exe}")
        st = f.get("stages", {})
        if "beyond_replacement" in st:
            print(f"{'':13}{st['beyond_replacement']:.2f}s beyond the replacement's own start "
                  f"({st['replacement']:.2f}s)")
        if "beyond_in_flight_step" in st:
            print(f"{'':13}{st['beyond_in_flight_step']:.2f}s beyond the step in flight "
                  f"({st['in_flight_step']:.2f}s)")
    for kind, k in report["recovery_by_kind"].items():
        print(f"  {kind:<11}{k['count']}x: median {k['median_s']:.2f}s, worst {k['worst_s']:.2f}s")
    steady = report["goodput_steady_state"]
    print(f"  training   {report['steps_completed']} steps, final loss "
          f"{report['final_loss']:.4f}, goodput {report['goodput']:.0%} from launch, "
          f"{'n/a' if steady is None else f'{steady:.1%}'} in steady state "
          f"({report['wall_seconds']['training']:.1f}s)")
    d = report["loss_max_abs_diff"]
    print(f"  loss check {'PASS' if report['loss_matches_reference'] else 'FAIL'}: max |diff| "
          f"against an uninterrupted run on the same meshes "
          f"{'n/a' if d is None else f'{d:.3g}'} (tolerance {cfg['tolerance']:.0e})")
    print(f"  wrote      {out / 'report.json'}" + (f", {png}" if png else ""))
