"""What compiling ahead costs the training loop: step times while the resized
mesh's step compiles in the background, interleaved with windows without it.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/compile_ahead.py [--model small] [--pairs 3]

One process, the elastic demo's model on 8 CPU devices as 2 slices x 4
(``mtc.trainer.model.Trainer``, the step with its snapshot, as ``make demo`` runs
it). After warm-up it alternates two kinds of window, ``--pairs`` times each:

* ``ahead``: a fresh one-slice trainer's step is compiled on the
  :class:`mtc.trainer.aot.AheadCompiler` thread exactly as the elastic trainer does
  it (tracing at the loop's priority, XLA at ``--nice`` lower, then one warm-up
  run), while the loop trains; the window lasts until that job is done;
* ``none``: the loop trains alone for as many steps as the ``ahead`` window
  before it ran.

The persistent compilation cache is off here, so every ahead compile is a real
one. The figure is the median step time in ``ahead`` windows over the median in
``none`` windows (1.0: free), and the time the loop lost over a whole ahead
window (its steps' extra time summed).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _log import logger

from mtc.trainer import aot
from mtc.trainer.data import VOCAB, make_iterator
from mtc.trainer.model import Config, Trainer

log = logger("compile-ahead")


def measure(model: str = "small", pairs: int = 3, warm_steps: int = 10, nice: int = 10,
            batch_size: int = 16) -> dict[str, Any]:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    if len(devices) < 8:
        raise SystemExit(f"need 8 devices, JAX sees {len(devices)}")
    cfg = Config.preset(model, vocab_size=len(VOCAB), total_steps=10_000)
    full = Trainer(cfg, Mesh(np.array(devices[:8]).reshape(2, 4), ("replica", "model")),
                   batch_size=batch_size)
    data = make_iterator(seq_len=cfg.seq_len, global_batch_size=batch_size, seed=0)
    state = full.init(0)

    def step() -> float:
        nonlocal state
        t0 = time.perf_counter()
        state, loss, _ = full.step_with_snapshot(state, next(data))
        float(loss)
        return time.perf_counter() - t0

    for _ in range(warm_steps):
        step()
    compiler = aot.AheadCompiler(name="bench-compile-ahead")
    windows: list[dict[str, Any]] = []
    try:
        for i in range(pairs):
            small = Trainer(cfg, Mesh(np.array(devices[:4]).reshape(1, 4), ("replica", "model")),
                            batch_size=batch_size)
            job: dict[str, float] = {}

            def build(t: Trainer = small, job: dict[str, float] = job) -> None:
                built = t.prepare("snapshot", ahead=True, nice=nice)
                job["compile_s"] = built.seconds
                job["warm_up_s"] = t.warm_up("snapshot")

            name = f"pair-{i}"
            t0 = time.perf_counter()
            compiler.submit(name, build)
            ahead = []
            while not compiler.wait(name, 0.0):
                ahead.append(step())
            wall = time.perf_counter() - t0
            alone = [step() for _ in range(max(len(ahead), 5))]
            windows.append({"ahead_steps_s": ahead, "none_steps_s": alone,
                            "ahead_window_s": wall, **job})
            log(f"pair {i}: compile {job.get('compile_s', 0):.1f}s + warm-up "
                f"{job.get('warm_up_s', 0):.2f}s over {len(ahead)} steps: median step "
                f"{statistics.median(ahead) if ahead else float('nan'):.3f}s vs "
                f"{statistics.median(alone):.3f}s alone")
    finally:
        compiler.close()
    ahead_all = [s for w in windows for s in w["ahead_steps_s"]]
    none_all = [s for w in windows for s in w["none_steps_s"]]
    med_none = statistics.median(none_all)
    med_ahead = statistics.median(ahead_all) if ahead_all else med_none
    lost = [sum(w["ahead_steps_s"]) - len(w["ahead_steps_s"]) * med_none for w in windows]
    return {
        "model": model, "devices": 8, "mesh": {"replica": 2, "model": 4},
        "compiled_ahead_for": {"replica": 1, "model": 4},
        "pairs": pairs, "nice": nice,
        "median_step_s": {"compiling_ahead": med_ahead, "not_compiling": med_none},
        "mean_step_s": {"compiling_ahead": statistics.mean(ahead_all) if ahead_all else None,
                        "not_compiling": statistics.mean(none_all)},
        "ratio_median_step_compiling_ahead_over_not": med_ahead / med_none,
        "ratio_mean_step_compiling_ahead_over_not":
            statistics.mean(ahead_all) / statistics.mean(none_all) if ahead_all else None,
        "loop_seconds_lost_per_ahead_compile": statistics.median(lost),
        "compile_ahead_s_median": statistics.median(w.get("compile_s", 0.0) for w in windows),
        "warm_up_s_median": statistics.median(w.get("warm_up_s", 0.0) for w in windows),
        "windows": windows,
        "cpus": os.cpu_count(),
        "notes": ["the CPU devices are the same 2 cores the compiler runs on: on an "
                  "accelerator the step does not share its compute with XLA's compiler",
                  "loop_seconds_lost_per_ahead_compile: the steps of one ahead window minus "
                  "as many median steps without compiling, once per mesh compiled ahead"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("small", "tiny"), default="small")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--nice", type=int, default=10)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.model, args.pairs, nice=args.nice), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
