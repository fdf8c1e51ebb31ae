"""The uninterrupted run a recovered run's losses are checked against."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from mtc.elastic import Snapshotter
from mtc.trainer.data import make_iterator
from mtc.trainer.model import Trainer

Slices = tuple[int, ...]


def reference_losses(*, trainer_for: Callable[[Slices], Trainer],
                     default_device: Callable[[Slices], jax.Device],
                     schedule: Mapping[int, Slices], first: Slices, steps: int, seed: int,
                     batch_size: int, snapshot: bool
                     ) -> tuple[dict[int, float], dict[int, float]]:
    """Losses and step times of steps 1..``steps`` from a fresh start, no failures,
    no checkpoints, each step on the mesh the recovered run used for it
    (``schedule``), moving between meshes the way the run did: through a
    snapshot, with the same step function (``snapshot``), so every executable is
    the run's own. A step's time is measured as the run measures it (next batch
    to loss on the host): the ideal time of that step on this machine."""
    cfg = trainer_for(first).cfg
    data = make_iterator(seq_len=cfg.seq_len, global_batch_size=batch_size, seed=seed)
    slices = schedule.get(1, first)
    trainer = trainer_for(slices)
    with jax.default_device(default_device(slices)):
        state = trainer.init(seed)
    ref: dict[int, float] = {}
    step_s: dict[int, float] = {}
    snapshotter = Snapshotter()
    for step in range(1, steps + 1):
        want = schedule.get(step, slices)
        if want != slices and snapshotter.latest is not None:
            slices, trainer = want, trainer_for(want)
            state = dict(snapshotter.load(trainer.abstract_state(), reset_snapshot_state=False))
        with jax.default_device(default_device(slices)):
            t0 = time.perf_counter()
            batch = next(data)
            if snapshot:
                state, loss_arr, arrays = trainer.step_with_snapshot(state, batch)
            else:
                state, loss_arr = trainer.step(state, batch)
                arrays = {"params": state["params"], "opt_state": state["opt_state"],
                          "rng": jax.random.key_data(state["rng"])}
        state["data"] = data.get_state()
        ref[step] = float(loss_arr)
        step_s[step] = time.perf_counter() - t0
        if schedule.get(step + 1, slices) != slices:  # the next step moves: through memory
            snapshotter.adopt(step, state, jax.tree_util.tree_leaves(arrays))
    return ref, step_s


def compare(losses: Mapping[int, float], first_losses: Mapping[int, float],
            ref: Mapping[int, float], step_s: Mapping[int, float],
            seconds: float) -> dict[str, Any]:
    """The largest differences from the reference: of the final losses (None when a
    step is missing), and of the first runs of steps that were later replayed."""
    diffs = {s: abs(losses[s] - ref[s]) for s in ref if s in losses}
    replayed = {s: abs(v - ref[s]) for s, v in first_losses.items() if s in ref}
    return {
        "max_abs_diff": max(diffs.values()) if len(diffs) == len(ref) else None,
        "max_abs_diff_replayed_first_run": max(replayed.values(), default=0.0),
        "steps_compared": len(diffs),
        "seconds": seconds,
        "losses": [ref[s] for s in sorted(ref)],
        "step_s": [step_s[s] for s in sorted(step_s)],
    }


def against_reference(losses: Mapping[int, float], first_losses: Mapping[int, float],
                      **run: Any) -> dict[str, Any]:
    """A trained run's losses (``first_losses``: of the first runs of steps later
    replayed) against an uninterrupted run on the same meshes (``run``: the
    arguments of :func:`reference_losses`), timed."""
    t0 = time.perf_counter()
    ref, step_s = reference_losses(**run)
    return compare(losses, first_losses, ref, step_s, time.perf_counter() - t0)
