"""Slice loss (replica resize) with ``--gib`` GiB of state: the loss to the first
completed step on the surviving slice. Part of ``bench/recovery.py``'s JSON
(``slice_loss``); the state and mesh are that bench's.

The path is the elastic trainer's (``mtc.trainer.elastic``), its parts real:

* every train step on the full mesh also emits a copy of its new state (the
  per-step snapshot, never donated; ``bench/_placing.py``);
* the surviving slice's step is compiled ahead, before the loss (timed apart);
* t0: while a step runs, slice 1's devices are marked lost in pathwaysutils'
  ``DeviceLossSimulator`` (``mtc.trainer.faults.SliceLossSimulator``); reading
  the step's output raises ``DATA_LOSS`` (``detect``), classified by
  ``is_error_due_to_slice_down``;
* ``wait``: pathwaysutils' slice health check (``get_active_slice_indices``,
  the executables kept by ``mtc.elastic.pathways_patch``) finds slice 0 alone; on this
  CPU it runs behind the interrupted step, which XLA cannot cancel;
* ``restore``: the snapshot of the last completed step, read only from slice
  0's devices, placed onto the one-slice mesh (``snapshot.place``);
* ``first_step``: the compiled-ahead step on it; its output is checked bit for
  bit against the same program run on the saved values before the loss.

Steps lost: 0 (the step the loss interrupted is run again from the snapshot).
Reference in the same run: the median train step on the full mesh and on the
surviving slice.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import jax
import numpy as np
from _placing import place  # bench/, beside this file
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pathwaysutils.elastic import elastic as pw_elastic

from mtc.elastic import pathways_patch
from mtc.elastic.taken import step_copy_sharding
from mtc.trainer.faults import SliceLossSimulator

AXES = ("replica", "model")
SPEC = PartitionSpec("model", None)
TARGET_TOTAL_S = 2.0

State = dict[str, jax.Array]


def _train(state: State) -> State:
    return {k: v * np.float32(0.999) + np.float32(1.0) for k, v in state.items()}


def _train_with_snapshot(state: State) -> tuple[State, State]:
    new = _train(state)
    return new, new  # the second is a copy of its own: the next step donates the first


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - t, out


def run_slice_loss(num_leaves: int, leaf_shape: tuple[int, int], samples: int,
                   make_state: Any, log: Any) -> dict[str, Any]:
    devices = sorted(jax.devices(), key=lambda d: d.id)[:8]
    per_slice = len(devices) // 2
    full = NamedSharding(Mesh(np.array(devices).reshape(2, per_slice), AXES), SPEC)
    small = NamedSharding(Mesh(np.array(devices[:per_slice]).reshape(1, per_slice), AXES), SPEC)
    slices = {0: devices[:per_slice], 1: devices[per_slice:]}
    survivors = {d.id for d in slices[0]}
    pathways_patch.install()
    state_bytes = num_leaves * leaf_shape[0] * leaf_shape[1] * 4
    log(f"slice loss: {num_leaves} leaves ({state_bytes / (1 << 20):.0f} MiB)")

    # The snapshot in host memory where the platform has it, as the trainer's step
    # emits it (a buffer of its own, which the next step's donation leaves alone).
    step_full = jax.jit(_train_with_snapshot, out_shardings=(full, step_copy_sharding(full)),
                        donate_argnums=0)
    abstract = {f"layer_{i:03d}": jax.ShapeDtypeStruct(leaf_shape, np.float32, sharding=small)
                for i in range(num_leaves)}
    t = time.perf_counter()
    step_small = jax.jit(_train, in_shardings=small, out_shardings=small,
                         donate_argnums=0).lower(abstract).compile()
    ahead_s = time.perf_counter() - t
    assert pw_elastic.get_active_slice_indices(slices) == {0, 1}  # its programs built

    state = make_state(num_leaves, full)
    compile_full_s, (state, snap) = _timed(step_full, state)
    full_steps: list[float] = []
    small_steps: list[float] = []
    rows: list[dict[str, Any]] = []
    for i in range(samples):
        for _ in range(2):
            dt, (state, snap) = _timed(step_full, state)
            full_steps.append(dt)
        # What the first step after the loss must produce: the same program on the
        # snapshot's values (the last completed step), computed before the loss.
        dt, out = _timed(step_small, place(snap, dict.fromkeys(snap, small), survivors))
        small_steps.append(dt)
        expect = {k: np.asarray(v).copy() for k, v in out.items()}
        del out
        gc.collect()

        sim = SliceLossSimulator()
        sim.start()
        try:
            in_flight = step_full(state)  # donates state
            del state
            t0 = time.perf_counter()
            for d in slices[1]:
                sim.mark_device_lost(d)
            try:
                jax.block_until_ready(in_flight)
                raise AssertionError("reading the interrupted step raised nothing")
            except jax.errors.JaxRuntimeError as e:
                if not pw_elastic.is_error_due_to_slice_down(e, log_traceback=False):
                    raise
            t_detect = time.perf_counter()
            active = pw_elastic.get_active_slice_indices(slices)
            t_wait = time.perf_counter()
            if set(active) != {0}:
                raise AssertionError(f"health check found slices {sorted(active)}, want [0]")
            restored = place(snap, dict.fromkeys(snap, small), survivors)
            jax.block_until_ready(restored)
            t_restore = time.perf_counter()
            out = step_small(restored)
            jax.block_until_ready(out)
            t_first = time.perf_counter()
        finally:
            sim.stop()
        for k, v in out.items():
            if not v.sharding.is_equivalent_to(small, v.ndim) or \
                    not np.array_equal(np.asarray(v).view(np.uint32), expect[k].view(np.uint32)):
                raise AssertionError(f"slice loss: first step's {k} differs from the expected")
        rows.append({"seconds": {"detect": t_detect - t0, "wait": t_wait - t_detect,
                                 "restore": t_restore - t_wait, "recompile": 0.0,
                                 "first_step": t_first - t_restore, "total": t_first - t0},
                     "steps_lost": 0})
        log(f"slice loss sample {i}: " + " ".join(
            f"{k} {v:.2f}s" for k, v in rows[-1]["seconds"].items()))
        # The slice is back: continue on the full mesh from the first step's output.
        del in_flight, restored, expect, snap
        gc.collect()
        state = jax.device_put(out, full)
        del out
        _, (state, snap) = _timed(step_full, state)
    del state, snap
    gc.collect()

    totals = [r["seconds"]["total"] for r in rows]
    median = {k: statistics.median(r["seconds"][k] for r in rows) for k in rows[0]["seconds"]}
    typical_small = statistics.median(small_steps)
    return {
        "state_bytes": state_bytes,
        "samples": samples,
        "median_seconds": median,
        "worst_seconds": {"total": max(totals)},
        "reference_median_seconds": {"step_full_mesh": statistics.median(full_steps),
                                     "step_surviving_slice": typical_small},
        "ratios": {"total_over_surviving_slice_step": median["total"] / typical_small,
                   "restore_over_surviving_slice_step": median["restore"] / typical_small},
        "compiled_ahead_s": ahead_s,
        "initial_compile_and_step_full_s": compile_full_s,
        "steps_lost_total": 0,
        "target": {"total_s": ("<=", TARGET_TOTAL_S)},
        "meets_target": max(totals) <= TARGET_TOTAL_S,
        "values_checked": True,
        "samples_detail": rows,
    }
