"""Checkpointing on a real accelerator: what a save costs the step, how fast a restore
is, and what a snapshot costs the loop, against JAX and Orbax in the same run.

Prints one JSON object to stdout (progress goes to stderr)::

    python bench/accelerator.py [--gib 1 4] [--rounds 3] [--steps 60]
    python bench/accelerator.py --smoke     # CPU, small: CI keeps it running

Run it where the accelerator is (``make bench-device`` says how); one process,
JAX's default backend, mtc and Orbax on the same RAM disk (``/dev/shm``). The
state is 16 float32 leaves on the first device; each figure is the median of
``--rounds`` rounds on fresh arrays (JAX caches an array's host copy: a second
transfer of the same array measures nothing), after one warm-up round.

Per dispatch (``local``: the host side in this process, as a multi-controller
process runs it; ``colocated``: through ``jax.experimental.colocated_python``,
the code path Pathways runs, which JAX runs in this process here) and per size:

- ``save_stall_over_device_get``: the time ``save`` blocks, over
  ``copy_to_host_async`` + ``jax.device_get`` of as many fresh bytes. The step
  right after ``save`` donates the saved arrays (``step_after_save_over_step``);
- ``save_over_orbax``: Orbax's ``CheckpointManager`` save to committed (async,
  otherwise default, the same donation after it) over mtc's (above 1: mtc is faster);
- ``restore_over_device_put``: ``restore`` onto the device over ``jax.device_put``
  of host copies of the same leaves;
- ``restore_over_orbax``: Orbax's restore over mtc's (above 1: mtc is faster).
  The restored values are checked against the saved ones, saved with donation.

The snapshot, with a train step that donates its state (``--passes`` memory
passes over it), per step of the loop (the step and what the loop does after it):
plain; ``mtc.elastic.Snapshotter.save`` and Orbax's ``Snapshotter.save`` every
step and every 20 steps; ``InGraphStep`` asked for a snapshot every step and every
20; ``CheckpointManager.save`` (mtc's and Orbax's) every 50 steps. Ratios are of
means (and of medians where named) over the plain step's.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import logging
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import model_step
import numpy as np
from _common import log, run_in_scratch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mtc
from mtc.elastic import InGraphStep, Snapshotter

LEAVES = 16
State = dict[str, jax.Array]


def make_state(nbytes: int, sharding: NamedSharding) -> State:
    """Random normal values: weights do not compress, and Orbax writes compressed
    chunks by default (a constant state made its save twice as fast)."""
    n = max(1024, nbytes // LEAVES // 4)
    return {f"w{i:02d}": jax.device_put(jax.random.normal(jax.random.key(i), (n,), jnp.float32),
                                        sharding) for i in range(LEAVES)}


def steps_of(passes: int) -> tuple[Callable[[State], State], Callable[[State], State]]:
    """A train step that donates its state (``passes`` memory passes, kept apart by a
    loop so that XLA cannot fuse them into one), and one that makes fresh arrays."""

    def train(s: State) -> State:
        def body(_: int, t: State) -> State:
            return {k: v * 0.999 + 1 for k, v in t.items()}
        return jax.lax.fori_loop(0, passes, body, s)

    return (jax.jit(train, donate_argnums=0),
            jax.jit(lambda s: {k: v + 1 for k, v in s.items()}))


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def ready(x: Any) -> Any:
    return jax.block_until_ready(x)


def device_get_s(state: State) -> float:
    t0 = time.perf_counter()
    for x in state.values():
        x.copy_to_host_async()
    jax.device_get(state)
    return time.perf_counter() - t0


# -- save and restore -------------------------------------------------------------


def mtc_save_restore(dispatch: str, nbytes: int, rounds: int, root: Path,
                     sharding: NamedSharding, train: Any, fresh: Any) -> dict[str, Any]:
    state = ready(make_state(nbytes, sharding))
    got: dict[str, list[float]] = {k: [] for k in (
        "device_get", "stall", "committed", "step_after_save", "step", "restore", "put")}
    options = mtc.Options(dispatch=dispatch, max_to_keep=2)  # type: ignore[arg-type]
    with mtc.CheckpointManager(root / f"mtc-{dispatch}-{nbytes}", options=options) as mgr:
        for r in range(rounds + 1):
            state = ready(fresh(state))
            ref = ready(fresh(state))
            ref_s = device_get_s(ref)
            del ref
            gc.collect()
            t0 = time.perf_counter()
            if not mgr.save(r + 1, state, force=True):
                raise AssertionError(f"save of step {r + 1} was skipped")
            t1 = time.perf_counter()
            state = ready(train(state))  # donates what was just saved
            t2 = time.perf_counter()
            mgr.wait_until_finished()
            t3 = time.perf_counter()
            state = ready(train(state))
            t4 = time.perf_counter()
            if r:  # the first round compiles and maps fresh memory
                for k, v in (("device_get", ref_s), ("stall", t1 - t0), ("committed", t3 - t0),
                             ("step_after_save", t2 - t1), ("step", t4 - t3)):
                    got[k].append(v)
        # Exact values, saved with the same donation after save.
        state = ready(fresh(state))
        want = jax.device_get(state)
        last = rounds + 2
        mgr.save(last, state, force=True)
        state = ready(train(state))
        mgr.wait_until_finished()
        del state
        gc.collect()
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                    for k, v in want.items()}
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            back = ready(mgr.restore(last, target=abstract))
            t1 = time.perf_counter()
            if r == 0:
                for k, v in want.items():
                    np.testing.assert_array_equal(np.asarray(back[k]), v, err_msg=k)
            del back
            t2 = time.perf_counter()
            put = ready(jax.device_put(want, {k: sharding for k in want}))
            t3 = time.perf_counter()
            del put
            if r:
                got["restore"].append(t1 - t0)
                got["put"].append(t3 - t2)
        copier = mgr._dispatch.copier  # type: ignore[attr-defined]
        copied, blocked = copier.copied, copier.blocked
    shutil.rmtree(root / f"mtc-{dispatch}-{nbytes}")  # the RAM disk holds the next phase's
    m = {k: med(v) for k, v in got.items()}
    return {"seconds": {k: round(v, 6) for k, v in m.items()},
            "saves_copied_in_device_memory": copied, "saves_that_blocked": blocked,
            "save_stall_over_device_get": round(m["stall"] / m["device_get"], 3),
            "step_after_save_over_step": round(m["step_after_save"] / m["step"], 3),
            "restore_over_device_put": round(m["restore"] / m["put"], 3),
            "values_checked": True}


def orbax_save_restore(nbytes: int, rounds: int, root: Path, sharding: NamedSharding,
                       train: Any, fresh: Any) -> dict[str, float]:
    import orbax.checkpoint as ocp

    state = ready(make_state(nbytes, sharding))
    saves, restores = [], []
    mgr = ocp.CheckpointManager(root / f"orbax-{nbytes}",
                                options=ocp.CheckpointManagerOptions(max_to_keep=2))
    try:
        for r in range(rounds + 1):
            state = ready(fresh(state))
            t0 = time.perf_counter()
            mgr.save(r + 1, args=ocp.args.StandardSave(state))
            state = ready(train(state))
            mgr.wait_until_finished()
            if r:
                saves.append(time.perf_counter() - t0)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                    for k, v in state.items()}
        del state
        for r in range(rounds + 1):
            t0 = time.perf_counter()
            back = ready(mgr.restore(rounds + 1, args=ocp.args.StandardRestore(abstract)))
            if r:
                restores.append(time.perf_counter() - t0)
            del back
    finally:
        mgr.close()
        shutil.rmtree(root / f"orbax-{nbytes}", ignore_errors=True)
    return {"save_committed": round(med(saves), 6), "restore": round(med(restores), 6)}


# -- the per-step snapshot --------------------------------------------------------


def loop(steps: int, state: State, one: Callable[[int, State], State]) -> tuple[list[float], State]:
    """Seconds of each of ``steps`` iterations (``one(i, state)`` and the wait for
    its new state), after as many untimed ones as warm-up."""
    times = []
    for i in range(2 * steps):
        t0 = time.perf_counter()
        state = ready(one(i, state))
        if i >= steps:
            times.append(time.perf_counter() - t0)
    return times, state


def snapshot_costs(nbytes: int, steps: int, root: Path, mesh: Mesh, train: Any,
                   passes: int, save_steps: int = 100) -> dict[str, Any]:
    """The loop's step times per case; the saves every 50 steps are timed over
    ``max(steps, save_steps)`` steps (100: two saves in the window; 50, the least
    that holds one, for ``--smoke``)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint.experimental.v1.training.pathways import (
        Snapshotter as OrbaxSnapshotter,
    )

    sharding = NamedSharding(mesh, PartitionSpec())
    state = ready(make_state(nbytes, sharding))
    shardings = {k: sharding for k in state}

    def body(s: State) -> tuple[State, None]:
        def one(_: int, t: State) -> State:
            return {k: v * 0.999 + 1 for k, v in t.items()}
        return jax.lax.fori_loop(0, passes, one, s), None

    cases: dict[str, Callable[[int, State], State]] = {}
    cases["plain"] = lambda i, s: train(s)
    mine, theirs = Snapshotter(), OrbaxSnapshotter()
    counts: dict[str, int] = {}

    def with_save(snap: Any, every: int) -> Callable[[int, State], State]:
        def one(i: int, s: State) -> State:
            s = train(s)
            if i % every == 0:
                snap.save(i, s)
            return s
        return one

    cases["mtc_every_step"] = with_save(mine, 1)
    cases["orbax_every_step"] = with_save(theirs, 1)
    cases["mtc_every_20"] = with_save(mine, 20)
    cases["orbax_every_20"] = with_save(theirs, 20)
    in_graph = InGraphStep(body, Snapshotter(), state_shardings=shardings)

    def graph(every: int) -> Callable[[int, State], State]:
        return lambda i, s: in_graph(s, snapshot_step=i if i % every == 0 else None)[0]

    cases["in_graph_every_step"] = graph(1)
    cases["in_graph_every_20"] = graph(20)
    mgr = mtc.CheckpointManager(root / "every50-mtc",
                                options=mtc.Options(dispatch="local", max_to_keep=2))
    omgr = ocp.CheckpointManager(root / "every50-orbax",
                                 options=ocp.CheckpointManagerOptions(max_to_keep=2))

    def every_50(save: Callable[[int, State], Any]) -> Callable[[int, State], State]:
        def one(i: int, s: State) -> State:
            s = train(s)
            if i % 50 == 0:
                save(i + 1_000_000 * len(counts), s)
            return s
        return one

    cases["mtc_save_every_50"] = every_50(lambda i, s: mgr.save(i, s, force=True))
    cases["orbax_save_every_50"] = every_50(
        lambda i, s: omgr.save(i, args=ocp.args.StandardSave(s), force=True))
    times: dict[str, list[float]] = {}
    try:
        for name, one in cases.items():
            n = max(steps, save_steps) if "every_50" in name else steps
            skipped = (mine.skipped, in_graph.skipped)
            times[name], state = loop(n, state, one)
            counts[name] = (mine.skipped - skipped[0]) + (in_graph.skipped - skipped[1])
            mine.join()
            theirs.join()
            mgr.wait_until_finished()
            omgr.wait_until_finished()
            log(f"snapshot {name}: median {med(times[name]) * 1e3:.1f} ms, mean "
                f"{statistics.mean(times[name]) * 1e3:.1f} ms, max "
                f"{max(times[name]) * 1e3:.1f} ms")
        # The newest snapshot holds the values it was taken of, after a donating step.
        state = ready(train(state))
        want = jax.device_get(state)
        mine.save(1, state)
        state = ready(train(state))
        mine.join()
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                    for k, v in want.items()}
        back = ready(mine.load(abstract))
        for k, v in want.items():
            np.testing.assert_array_equal(np.asarray(back[k]), v, err_msg=k)
    finally:
        mgr.close()
        omgr.close()
        mine.close()
        in_graph.snapshotter.close()
    mean = {k: statistics.mean(v) for k, v in times.items()}
    median = {k: med(v) for k, v in times.items()}
    plain_mean, plain_med = mean["plain"], median["plain"]
    return {
        "step_s": {k: {"median": round(median[k], 6), "mean": round(mean[k], 6),
                       "max": round(max(times[k]), 6)} for k in times},
        "skipped_while_in_flight": {k: v for k, v in counts.items() if v},
        "snapshot_every_step_median_over_plain": round(median["mtc_every_step"] / plain_med, 3),
        "snapshot_every_step_mean_over_plain": round(mean["mtc_every_step"] / plain_mean, 3),
        "snapshot_every_step_mean_over_orbax": round(
            mean["mtc_every_step"] / mean["orbax_every_step"], 3),
        "orbax_snapshot_every_step_mean_over_plain": round(
            mean["orbax_every_step"] / plain_mean, 3),
        "snapshot_every_20_mean_over_plain": round(mean["mtc_every_20"] / plain_mean, 3),
        "orbax_snapshot_every_20_mean_over_plain": round(mean["orbax_every_20"] / plain_mean, 3),
        "in_graph_mean_over_plain": round(mean["in_graph_every_step"] / plain_mean, 3),
        "in_graph_every_20_mean_over_plain": round(mean["in_graph_every_20"] / plain_mean, 3),
        "save_every_50_mean_over_plain": round(mean["mtc_save_every_50"] / plain_mean, 3),
        "orbax_save_every_50_mean_over_plain": round(
            mean["orbax_save_every_50"] / plain_mean, 3),
        "values_checked": True,
    }


def run(sizes: list[float], rounds: int, steps: int, passes: int, snapshot_gib: float,
        root: Path, save_steps: int = 100, model: dict[str, Any] | None = None,
        only_model: bool = False) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    logging.getLogger("absl").setLevel(logging.ERROR)
    device = jax.devices()[0]
    mesh = Mesh(np.array([device]), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec())
    train, fresh = steps_of(passes)
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "platform": device.platform,
        "device_kind": device.device_kind, "jax": jax.__version__,
        "orbax": getattr(ocp, "__version__", "?"), "mtc": mtc.__version__,
        "path": "one process, one device; the RAM disk is /dev/shm",
        "rounds": rounds, "leaves": LEAVES,
        "definitions": {
            "save_stall_over_device_get": "save() wall time / copy_to_host_async + "
                                          "jax.device_get of as many fresh bytes",
            "save_over_orbax": "Orbax save to committed / mtc save to committed",
            "restore_over_device_put": "restore() onto the device / jax.device_put of "
                                       "host copies",
            "restore_over_orbax": "Orbax restore / mtc restore",
            "*_over_plain": "loop iteration time with it / the plain step's"},
    }
    if model is not None:
        log("the model step")
        out["model_step"] = model_step.run(root=root / "model", **model)
    if only_model:
        return out
    by_dispatch: dict[str, dict[str, Any]] = {"local": {}, "colocated": {}}
    for gib in sizes:
        nbytes = int(gib * (1 << 30))
        label = f"{gib:g}GiB"
        theirs = orbax_save_restore(nbytes, rounds, root, sharding, train, fresh)
        for dispatch in by_dispatch:
            log(f"save and restore, {label}, {dispatch} dispatch")
            got = mtc_save_restore(dispatch, nbytes, rounds, root, sharding, train, fresh)
            got["orbax_seconds"] = theirs
            got["save_over_orbax"] = round(
                theirs["save_committed"] / got["seconds"]["committed"], 3)
            got["restore_over_orbax"] = round(theirs["restore"] / got["seconds"]["restore"], 3)
            by_dispatch[dispatch][label] = got
            gc.collect()
    out["dispatch"] = by_dispatch
    log("the per-step snapshot")
    out["snapshot"] = {"bytes": int(snapshot_gib * (1 << 30)), "passes": passes,
                       "dispatch": "local", **snapshot_costs(
                           int(snapshot_gib * (1 << 30)), steps, root, mesh, train, passes,
                           save_steps)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0],
                   help="state sizes for save and restore (default 1 4)")
    p.add_argument("--snapshot-gib", type=float, default=1.0,
                   help="state size for the snapshot's step times (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per case (default 60)")
    p.add_argument("--passes", type=int, default=6,
                   help="memory passes of the train step over its state (default 6)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes, 1 round, 10 steps (50 for the saves every 50): "
                        "that it runs (CI, on CPU)")
    p.add_argument("--model", type=int, nargs=3, default=[8, 4096, 4096],
                   metavar=("LAYERS", "DIM", "BATCH"),
                   help="the model step: layers, width, microbatch rows (default 8 4096 4096)")
    p.add_argument("--fills", type=float, nargs="*", default=[0.88, 0.5],
                   help="shares of the chip's memory in use at the step's peak, besides a "
                        "case with room (default 0.88 0.5)")
    p.add_argument("--model-steps", type=int, default=12, help="timed steps per model case")
    p.add_argument("--lengths", nargs="+", choices=["long", "short"], default=["long", "short"],
                   help="the model step's lengths (default long short)")
    p.add_argument("--snapshot-every", type=int, nargs="+", default=[1, 20],
                   help="the model step's snapshot cases: one every N steps (default 1 20)")
    p.add_argument("--headroom", type=float, default=None,
                   help="the share of device memory the automatic device-copy budget leaves "
                        "free beside the job's peak (default: mtc's, "
                        "mtc.save.device_copy.HEADROOM)")
    p.add_argument("--kinds", nargs="+", choices=list(model_step.KINDS),
                   default=list(model_step.KINDS),
                   help="the model step's kinds (default fused split in_graph); each kind "
                        "raises the process's peak use, which the copy budget reads, for the "
                        "cases after it: a job runs one")
    p.add_argument("--no-room", action="store_true",
                   help="the model step on the --fills alone, not also with room")
    p.add_argument("--no-model", action="store_true", help="skip the model step")
    p.add_argument("--only-model", action="store_true", help="the model step alone")
    args = p.parse_args(argv)
    if args.headroom is not None:
        from mtc.save import device_copy
        device_copy.HEADROOM = args.headroom
    save_steps = 100
    if args.smoke:
        args.gib, args.snapshot_gib, args.rounds, args.steps = [1 / 64], 1 / 64, 1, 10
        save_steps = 50  # one save in the timed window, not two: half the loop
        args.model, args.fills, args.model_steps = [2, 64, 16], [], 3
    model = None if args.no_model else {
        "layers": args.model[0], "dim": args.model[1], "batch": args.model[2],
        "fills": [*args.fills, *([] if args.no_room else [None])], "steps": args.model_steps,
        "lengths": tuple(args.lengths), "snapshot_every": tuple(args.snapshot_every),
        "kinds": tuple(args.kinds)}
    if args.rounds < 1 or args.steps < 1 or args.passes < 1 or min(args.gib) <= 0:
        p.error("--rounds, --steps and --passes must be >= 1, sizes > 0")
    return run_in_scratch("mtc-bench-accelerator-", lambda root: run(
        args.gib, args.rounds, args.steps, args.passes, args.snapshot_gib, root, save_steps,
        model, args.only_model))


if __name__ == "__main__":
    sys.exit(main())
