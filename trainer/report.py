"""The report maths the demos and ``bench/goodput.py`` share: which step records
count towards the final model, their ideal time, goodput from launch and in steady
state, and recovery times by kind of failure. Records are the elastic trainer's
JSON-lines entries (:mod:`mtc.trainer.jsonlog`)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any


def final_steps(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The last record of each step: the one that counts towards the final model."""
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        if "loss" in r:
            out[r["step"]] = r
    return out


def goodput(records: list[dict[str, Any]], t_launch: float, t_end: float) -> float:
    """Ideal time of the optimizer steps in the final model over wall time from launch.

    A step's ideal time is what the uninterrupted reference run (no failures, no
    checkpoints, same meshes, same process) took for it; without a reference,
    the median step on its mesh. Compiling, recovering, replaying, saving and
    checkpointing's background work slowing a step down are all overhead."""
    return ideal_seconds(final_steps(records).values(), records) / (t_end - t_launch)


def ideal_seconds(steps: Iterable[dict[str, Any]], records: list[dict[str, Any]], *,
                  reference: bool = True) -> float:
    """The ideal time of ``steps`` (step records): see :func:`goodput`. With
    ``reference=False``, the median step of the run on each mesh."""
    steps = list(steps)
    ref = next((r for r in records if r.get("event") == "reference"), None)
    if reference and ref is not None and "step_s" in ref:
        return sum(ref["step_s"][r["step"] - 1] for r in steps)
    by_mesh: dict[str, list[float]] = {}
    for r in steps:
        by_mesh.setdefault(str(r["slices"]), []).append(r["step_s"])
    return sum(len(v) * statistics.median(v) for v in by_mesh.values())


def steady_state(records: list[dict[str, Any]], t_end: float) -> dict[str, Any]:
    """Goodput without the start-up and the reference run: the ideal time of the
    final model's steps after the first, over the wall time from the end of the
    first step to the end of training, less the time training was held on
    purpose (the demo waits for a compile ahead before it loses a slice)."""
    ordered = sorted(final_steps(records).values(), key=lambda r: r["t"])
    if len(ordered) < 2:
        return {"goodput": None, "definition": "too few steps", "seconds": None}
    later = ordered[1:]
    held = sum(r["seconds"] for r in records if r.get("event") == "waited_for_compile_ahead")
    wall = t_end - ordered[0]["t"] - held
    return {
        "goodput": ideal_seconds(later, records) / wall if wall > 0 else None,
        "definition": "ideal time of the final model's steps after the first (what the "
                      "uninterrupted reference run took for each) / wall time from the end "
                      "of the first step to the end of training, less the seconds the demo "
                      "held training to let a compile ahead finish before a slice loss",
        "seconds": {"wall": wall, "held_for_compile_ahead": held},
    }


def recovery_by_kind(failures: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per failure kind: how many, and the median and worst seconds to recover."""
    out: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(f["kind"] for f in failures):
        totals = [f["seconds"]["total"] for f in failures if f["kind"] == kind]
        out[kind] = {"count": len(totals), "median_s": statistics.median(totals),
                     "worst_s": max(totals),
                     "executables": sorted({str(f.get("executable")) for f in failures
                                            if f["kind"] == kind})}
    return out


def max_abs_diff(a: dict[int, float], b: dict[int, float], steps: range) -> float | None:
    """Largest loss difference over ``steps``; None when either run lacks one of them."""
    if any(s not in a or s not in b for s in steps):
        return None
    return max((abs(a[s] - b[s]) for s in steps), default=0.0)


def useful_seconds(steps: list[dict[str, Any]], keep: range, typical: float) -> float:
    """Time of the steps that count towards the final model; a process's first
    step (tracing and compiling) counts as a typical step."""
    first = steps[0]["step"] if steps else None
    return sum(typical if s["step"] == first else s["step_s"]
               for s in steps if s["step"] in keep)
