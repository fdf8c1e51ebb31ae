"""The goodput benchmark's figures (``bench/goodput.py``), from the trainer's JSON
records: pure functions of the records (and the CPU samples), no process started.

:func:`analyse` is the whole report of one run; :func:`noise_floor` scores the
uninterrupted reference run's own steps as the run's figure scores its steps."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from bench._cpu import CpuSampler
from mtc.trainer.report import final_steps, goodput, ideal_seconds, recovery_by_kind

TARGET_GOODPUT = 0.98
TARGET_FAILURE_EVERY_S = 120.0


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def stages_by_kind(recoveries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind of failure, the median and worst seconds of every recorded stage."""
    out: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(r["kind"] for r in recoveries):
        mine = [r["seconds"] for r in recoveries if r["kind"] == kind]
        keys = dict.fromkeys(k for sec in mine for k in sec)
        out[kind] = {"count": len(mine)} | {
            k: {"median_s": statistics.median(v), "worst_s": max(v)}
            for k in keys if (v := [sec[k] for sec in mine if k in sec])}
    return out


def host_cpu(cpu: CpuSampler, records: list[dict[str, Any]], t0: float, t1: float
             ) -> dict[str, Any]:
    """What the simulated hosts' processes spent between ``t0`` and ``t1``: on these
    cores it is taken from the steps (on a real host it runs beside the accelerators)."""
    used = cpu.seconds(t0, t1)
    hosts = used.get("sidecars", 0.0) + used.get("replicators", 0.0)
    saves = sum(1 for r in records if r.get("saved") and t0 <= r["t"] <= t1)
    cores = os.cpu_count() or 1
    return {"cpu_s": used, "saves": saves, "wall_s": t1 - t0, "cores": cores,
            "hosts_share_of_cores": hosts / ((t1 - t0) * cores),
            "hosts_cpu_s_per_save": hosts / saves if saves else None,
            "definition": "user + system CPU seconds of the sidecars, replicators and "
                          "trainer from /proc, sampled every 0.5 s, over the steady "
                          "state's wall time (held seconds included); share: the hosts' "
                          "processes over wall time x cores"}


def noise_floor(steady: list[dict[str, Any]], ref: dict[str, Any] | None) -> float | None:
    """The uninterrupted reference run's steps numbered as ``steady`` (each on the
    same mesh), scored by the run's median-step ideal: the ideal time of those
    steps (each mesh's median step) over the time they took. A run that saved
    nothing and lost nothing scores this, so the figure held against the target
    cannot exceed it on this machine. None without a reference."""
    if not ref or "step_s" not in ref:
        return None
    by_mesh: dict[str, list[float]] = {}
    for r in steady:
        by_mesh.setdefault(str(r["slices"]), []).append(ref["step_s"][r["step"] - 1])
    took = sum(sum(v) for v in by_mesh.values())
    return sum(len(v) * statistics.median(v) for v in by_mesh.values()) / took if took else None


def analyse(records: list[dict[str, Any]], t_launch: float,
            cpu: CpuSampler | None = None) -> dict[str, Any]:
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
    # the first compile) to the end of training, ideal time of the later steps.
    later = [r for r in ordered if r is not first]
    useful_later = ideal_seconds(later, records)
    # What the steps took beyond the ideal: mostly checkpointing's background work.
    slowed = sum(r["step_s"] for r in later) - useful_later
    ref = ev.get("reference")
    ref_step = statistics.mean(ref["step_s"][1:]) if ref else None
    # The same with the run's own median step as the ideal: immune to the machine
    # being faster or slower while the reference ran, but it counts the skew of
    # this VM's step times (mean above median) as overhead.
    median_later = ideal_seconds(later, records, reference=False)
    median_all = ideal_seconds(steps.values(), records, reference=False)
    window = t_end - first["t"]
    recs = ev["trained"]["recoveries"]
    lost_s = [r["seconds"]["total"] for r in recs]
    faults = [r["t"] for r in records if r.get("event") == "fault"]
    intervals = [b - a for a, b in zip([first["t"], *faults], [*faults, t_end], strict=True)]
    steps_lost = [r["steps_lost"] for r in recs]
    startup = first["t"] - t_launch
    final_ids = {id(r) for r in steps.values()}
    replayed_s = sum(r["step_s"] for r in records if "loss" in r and id(r) not in final_ids)
    snapshot_s = sum(r.get("snapshot_s", 0.0) for r in records if "loss" in r)
    save_s = sum(r.get("save_s", 0.0) for r in records if "loss" in r)
    failure_s = sum(lost_s)
    failures = [{k: r[k] for k in ("kind", "step_at_failure", "resumed_from_step", "tier",
                                   "steps_lost")}
                | {"executable": r.get("executable"), "compile_s": r.get("compile_s")}
                | {"seconds": {k: r["seconds"][k] for k in
                               ("detect", "wait", "restore", "recompile", "first_step",
                                "total")}}
                for r in recs]
    ahead = [r for r in records if r.get("event") == "compiled_ahead"]
    # Steady state: after the start-up, which ends once the first step ran and
    # the compiles ahead it started are done (each mesh compiles once per job),
    # and never after the first failure.
    t_ready = max([first["t"], *(r["t"] for r in ahead)])
    t_ready = min([t_ready, *faults]) if faults else t_ready
    steady = [r for r in ordered if r["t"] - r["step_s"] >= t_ready]
    if not steady:
        raise SystemExit(
            f"no step started in steady state: training ended {t_end - t_ready:+.1f} s after "
            f"the start-up did (the first step and the compiles ahead it started, done "
            f"{t_ready - t_launch:.1f} s after launch); train more steps (--steps)")
    # Training held by the fault injector to stage a failure (not recovery):
    # waiting for the save to reach the peer, or for a compile ahead to finish.
    held = [r.get("seconds_waited_before_loss", 0.0) for r in records
            if r.get("event") == "fault" and r["t"] >= t_ready] + \
        [r["seconds"] for r in records
         if r.get("event") == "waited_for_compile_ahead" and r["t"] >= t_ready]
    steady_window = t_end - t_ready - sum(held)
    by_ref = ideal_seconds(steady, records) / steady_window
    by_median = ideal_seconds(steady, records, reference=False) / steady_window
    # Every steady step at the full mesh's median step: what the window would have
    # trained had no slice been missing. A resize keeps training on fewer slices,
    # whose steps the two ideals above count at their own mesh's speed; this one
    # counts what running slower cost (on these 2 cores a one-slice step is about
    # as fast as a two-slice one; on real slices it is not).
    widest = max(len(r["slices"]) for r in steady)
    full_mesh = statistics.median(r["step_s"] for r in steady if len(r["slices"]) == widest)
    by_full_mesh = len(steady) * full_mesh / steady_window
    resized_steps = sum(1 for r in steady if len(r["slices"]) < widest)
    # The reference runs after training, in the same process: on a shared machine
    # whose load changed meanwhile its steps are no ideal (a goodput above 1 says
    # so). The figure held against the target is the lower of the two ideals.
    ref_skew = ref_step / typical - 1.0 if ref_step else None
    floor = noise_floor(steady, ref)
    return {
        "goodput_steady_state": min(by_ref, by_median),
        # The reference's own steps (no failures, no checkpoints) scored as the run's
        # are by the median-step ideal: what this machine's step-time jitter alone
        # costs that figure. None without the reference (--quick: pass --reference).
        "noise_floor": floor,
        "goodput_steady_state_median_step_ideal_over_noise_floor":
            None if floor is None else by_median / floor,
        "goodput_steady_state_reference_ideal": by_ref,
        "goodput_steady_state_median_step_ideal": by_median,
        "reference_step_over_run_median_step": None if ref_step is None else ref_step / typical,
        "reference_trusted": ref_skew is not None and abs(ref_skew) <= 0.1,
        "goodput_steady_state_definition":
            "ideal time of the final model's steps that started after the start-up (the first "
            "step, and the compiles ahead it started; cut at the first failure) / wall time "
            "from then to the end of training, less the seconds the fault injector held "
            "training to stage a failure; the reference run excluded; the lower of two "
            "ideals: each step's time in the uninterrupted reference run, and the run's own "
            "median step on each mesh (mean above median on a noisy machine counts as loss)",
        "goodput_steady_state_full_mesh_ideal": by_full_mesh,
        "goodput_steady_state_full_mesh_ideal_definition":
            "steady steps x the full mesh's median steady step / the same wall time: also "
            "counts as lost what steps on fewer slices (a resize) ran slower",
        "steady_steps_on_fewer_slices": resized_steps,
        "steady_state_window_s": steady_window,
        "cpu_in_steady_state": None if cpu is None else host_cpu(cpu, records, t_ready, t_end),
        # How the trainer's CPU devices' buffers were had (mtc.trainer.device_memory).
        "device_memory": ev.get("ready", {}).get("device_memory"),
        # The share of each core's time the hypervisor ran something else (steal):
        # in the steady state, and while the reference run (the noise floor) ran.
        "steal_by_core": None if cpu is None else {
            "steady_state": cpu.steal(t_ready, t_end),
            "reference": cpu.steal(ref["t"] - ref["seconds"], ref["t"]) if ref else None,
            "definition": "steal clock ticks over all ticks of each core in /proc/stat, "
                          "sampled every 0.5 s"},
        "injector_held_s": sum(held),
        "target": {"goodput_steady_state": (">=", TARGET_GOODPUT),
                   "failure_every_s": TARGET_FAILURE_EVERY_S},
        "meets_target": min(by_ref, by_median) >= TARGET_GOODPUT,
        "recovery_stages_by_kind": stages_by_kind(recs),
        "startup_incl_compile_ahead_s": t_ready - t_launch,
        "recovery_by_kind": recovery_by_kind(failures),
        "compiled_ahead": [{k: r[k] for k in ("slices", "program", "source", "seconds")}
                           | {"warm_up_s": r.get("warm_up_s"),
                              "done_after_first_step_s": r["t"] - first["t"]}
                           for r in ahead],
        "goodput_demo_definition": demo,
        "goodput_excluding_startup": useful_later / window,
        "goodput_median_step_definition": median_all / (t_end - t_launch),
        "goodput_excluding_startup_median_step_definition": median_later / window,
        "goodput_excluding_startup_definition":
            "ideal time of the final model's steps after the first (what the uninterrupted "
            "reference run without checkpoints took for each, as in elastic_demo.goodput) / "
            "wall time from the end of the first step to the end of training",
        "goodput_demo_definition_text":
            "elastic_demo.goodput: ideal time of the final model's steps (what the "
            "uninterrupted reference run without checkpoints took for each) / wall time from "
            "the trainer process's launch (before its Python start and JAX import) to its "
            "'trained' event",
        "wall_seconds": {
            "launch_to_end": t_end - t_launch,
            "startup_launch_to_first_step_end": startup,
            "first_step_s": first["step_s"],
            "training_after_first_step": window,
            "useful_after_first_step": useful_later,
            "median_step_s": typical,
            "reference_mean_step_s": ref_step,
            "snapshot_s_sum": snapshot_s,
            "save_s_sum": save_s,
            "failure_recovery_s": failure_s,
            "replayed_steps_s": replayed_s,
            "steps_beyond_ideal_s": slowed,
            "other_loop_overhead_s": window - useful_later - slowed - snapshot_s - save_s
            - failure_s - replayed_s,
            "steps_per_s_median": 1.0 / typical,
        },
        "steps_completed": max(steps),
        "steps_executed_incl_replayed": sum(1 for r in records if "loss" in r),
        "failures": failures,
        "failure_seconds_total": failure_s,
        "seconds_between_failures": intervals,
        "goodput_loss_from_failure_only": (failure_s + replayed_s) / window,
        "steps_lost_total": sum(steps_lost),
    }
