"""The in-memory snapshot, mtc's against Orbax's, in one run: what it costs the
training loop and how fast it loads.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/snapshot.py [--large-mib 1024] [--rounds 3]

Two states on 8 CPU devices as 2 slices x 4 (``replica`` x ``model``, the state
sharded along ``model`` and replicated across slices, as data parallelism has it):

- ``demo``: the demo's model (``mtc.trainer.model``, ``small`` preset, Adam moments),
  its own train step, and its in-graph snapshot program;
- ``large``: ``--large-mib`` MiB of float32 in 64 MiB leaves, a memory-bound step
  (``x * 0.999 + 1``), the in-graph snapshot through ``mtc.elastic.InGraphStep``.

Step time (wall time of a run of steps over their count, median of ``--rounds``
interleaved rounds) with a snapshot every step and every 10 steps, for mtc's
in-graph snapshot, ``mtc.elastic.Snapshotter.save`` and Orbax's
``ocp.v1.training.pathways.Snapshotter.save``, each as a fraction over the
same state's step time without a snapshot (``overhead``). Then ``load`` of the
newest snapshot onto the same mesh and onto one slice fewer, both snapshotters,
``reset_snapshot_state=True`` (their default), as seconds and as Orbax's time
over mtc's (``orbax_over_mtc``: above 1, mtc loads faster).

Targets (``targets``): the in-graph snapshot at every step costs at most 2% of
step time; mtc's ``save`` costs no more than Orbax's; mtc's load is at least as
fast as Orbax's. On this CPU machine "host memory" and "device memory" are the
same RAM: every snapshot is a memcpy competing with the step for memory bandwidth,
where an accelerator copies over its own DMA engines.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common as common
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint.experimental.v1.training.pathways import Snapshotter as OrbaxSnapshotter

from mtc.elastic import InGraphStep, Snapshotter
from mtc.trainer.data import VOCAB, make_iterator
from mtc.trainer.model import Config, Trainer

VARIANTS = ("none", "in_graph", "mtc_save", "orbax_save")
EVERY = (1, 10)
TARGET_IN_GRAPH_OVERHEAD = 0.02
MIB = 1 << 20


class Workload:
    """A state, its step without and with the in-graph copy, and its abstract
    state on a mesh of given slices."""

    def __init__(self, name: str, state: Any, step: Callable[[Any], tuple[Any, Any]],
                 step_copy: Callable[[Any, int], tuple[Any, Any]],
                 abstract: Callable[[Mesh], Any], nbytes: int) -> None:
        self.name, self.state, self.step, self.step_copy = name, state, step, step_copy
        self.abstract, self.nbytes = abstract, nbytes


def meshes() -> tuple[Mesh, Mesh]:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    full = Mesh(np.array(devices).reshape(2, 4), ("replica", "model"))
    return full, Mesh(np.array(devices[:4]).reshape(1, 4), ("replica", "model"))


def demo_workload(full: Mesh, snapshotter: Snapshotter) -> Workload:
    cfg = Config.preset("small", vocab_size=len(VOCAB), total_steps=10_000)
    trainers = {1: Trainer(cfg, meshes()[1], batch_size=16), 2: Trainer(cfg, full, batch_size=16)}
    trainer = trainers[2]
    data = make_iterator(seq_len=cfg.seq_len, global_batch_size=16, seed=0)
    batches = [next(data) for _ in range(8)]
    counter = [0]

    def batch() -> Any:
        counter[0] += 1
        return batches[counter[0] % len(batches)]

    def step(state: Any) -> tuple[Any, Any]:
        return trainer.step(state, batch())

    def step_copy(state: Any, n: int) -> tuple[Any, Any]:
        state, loss, arrays = trainer.step_with_snapshot(state, batch())
        snapshotter.adopt(n, state, jax.tree_util.tree_leaves(arrays))
        return state, loss

    def abstract(mesh: Mesh) -> Any:
        return trainers[mesh.devices.shape[0]].abstract_state()

    state = trainer.init(0)
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(
        {k: state[k] for k in ("params", "opt_state")}))
    return Workload("demo", state, step, step_copy, abstract, nbytes)


def large_workload(full: Mesh, snapshotter: Snapshotter, mib: int) -> Workload:
    leaf = 64 * MIB // 4  # float32 elements in a 64 MiB leaf
    rows = 4096
    n = max(1, mib // 64)

    def sh(mesh: Mesh) -> NamedSharding:
        return NamedSharding(mesh, P(None, "model"))

    shardings = {f"w{i:02d}": sh(full) for i in range(n)}

    def train(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        new = {k: v * np.float32(0.999) + np.float32(1.0) for k, v in state.items()}
        return new, new["w00"][0, 0]

    plain = jax.jit(train, donate_argnums=0, out_shardings=(shardings, None))
    in_graph = InGraphStep(train, snapshotter, state_shardings=shardings)

    def step(state: Any) -> tuple[Any, Any]:
        return plain(state)

    def step_copy(state: Any, k: int) -> tuple[Any, Any]:
        return in_graph(state, snapshot_step=k)

    def abstract(mesh: Mesh) -> Any:
        return {k: jax.ShapeDtypeStruct((rows, leaf // rows), np.float32, sharding=sh(mesh))
                for k in shardings}

    state = {k: jax.device_put(np.full((rows, leaf // rows), i, np.float32), s)
             for i, (k, s) in enumerate(shardings.items())}
    return Workload("large", state, step, step_copy, abstract, n * 64 * MIB)


def run_variant(w: Workload, variant: str, every: int, steps: int, first: int,
                mtc: Snapshotter, orbax: OrbaxSnapshotter) -> tuple[float, int]:
    """Seconds per step over ``steps`` steps (numbered from ``first``), and how many
    snapshots were skipped because one was in flight."""
    skipped = 0
    t0 = time.perf_counter()
    for i in range(first, first + steps):
        take = variant != "none" and i % every == 0
        if variant == "in_graph" and take:
            w.state, loss = w.step_copy(w.state, i)
        else:
            w.state, loss = w.step(w.state)
        float(loss)  # the loop waits for its step, as a training loop logging its loss
        if take and variant == "mtc_save":
            skipped += not mtc.save(i, w.state)
        elif take and variant == "orbax_save":
            skipped += orbax._queue.full()  # what its save is about to skip (it logs only)
            orbax.save(i, w.state)
    seconds = (time.perf_counter() - t0) / steps
    mtc.join()
    orbax.join()
    return seconds, skipped


def step_costs(w: Workload, steps: int, rounds: int, mtc: Snapshotter,
               orbax: OrbaxSnapshotter) -> dict[str, Any]:
    cases = [("none", 1)] + [(v, e) for v in VARIANTS[1:] for e in EVERY]
    samples: dict[str, list[float]] = {}
    skipped: dict[str, int] = {}
    counter = 1_000
    for _ in range(2):  # warm-up: compile every program, touch every buffer
        for v, e in cases:
            run_variant(w, v, e, 10, counter, mtc, orbax)
            counter += 10
    for r in range(rounds):
        for v, e in cases:
            name = v if v == "none" else f"{v}_every_{e}"
            s, k = run_variant(w, v, e, steps, counter, mtc, orbax)
            counter += steps
            samples.setdefault(name, []).append(s)
            skipped[name] = skipped.get(name, 0) + k
            gc.collect()
        common.log(f"{w.name}: round {r + 1} of {rounds}")
    base = statistics.median(samples["none"])
    out: dict[str, Any] = {"step_s": {k: statistics.median(v) for k, v in samples.items()},
                           "step_s_samples": samples, "skipped_saves": skipped}
    out["overhead"] = {k: statistics.median(v) / base - 1 for k, v in samples.items()
                       if k != "none"}
    return out


def timed_load(snap: Any, abstract: Any, samples: int) -> list[float]:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        state = snap.load(abstract)
        jax.block_until_ready([x for x in jax.tree_util.tree_leaves(state)
                               if isinstance(x, jax.Array)])
        out.append(time.perf_counter() - t0)
        if hasattr(snap, "join"):
            snap.join()
        del state
        gc.collect()
    return out


def load_costs(w: Workload, mtc: Snapshotter, orbax: OrbaxSnapshotter,
               samples: int) -> dict[str, Any]:
    full, fewer = meshes()
    mtc.save(1, w.state)
    mtc.join()
    orbax.save(1, w.state)
    orbax.join()
    out: dict[str, Any] = {}
    for where, mesh in (("same_mesh", full), ("one_slice_fewer", fewer)):
        m = timed_load(mtc, w.abstract(mesh), samples)
        o = timed_load(orbax, w.abstract(mesh), samples)
        out[where] = {"mtc_s": statistics.median(m), "orbax_s": statistics.median(o),
                      "mtc_s_samples": m, "orbax_s_samples": o,
                      "orbax_over_mtc": statistics.median(o) / statistics.median(m)}
    return out


def bench_one(w: Workload, args: argparse.Namespace, mtc: Snapshotter,
              orbax: OrbaxSnapshotter, steps: int) -> dict[str, Any]:
    common.log(f"{w.name}: {w.nbytes / MIB:.0f} MiB of state")
    costs = step_costs(w, steps, args.rounds, mtc, orbax)
    loads = load_costs(w, mtc, orbax, args.load_samples)
    ov = costs["overhead"]
    return {"state_bytes": w.nbytes, **costs, "load": loads,
            "targets": {
                "in_graph_every_1_overhead_at_most": TARGET_IN_GRAPH_OVERHEAD,
                "in_graph_every_1_met": ov["in_graph_every_1"] <= TARGET_IN_GRAPH_OVERHEAD,
                "mtc_save_costs_no_more_than_orbax_every_1":
                    ov["mtc_save_every_1"] <= ov["orbax_save_every_1"],
                "mtc_save_costs_no_more_than_orbax_every_10":
                    ov["mtc_save_every_10"] <= ov["orbax_save_every_10"],
                "mtc_load_at_least_as_fast_same_mesh":
                    loads["same_mesh"]["orbax_over_mtc"] >= 1.0,
                "mtc_load_at_least_as_fast_one_slice_fewer":
                    loads["one_slice_fewer"]["orbax_over_mtc"] >= 1.0}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--large-mib", type=int, default=1024,
                   help="the large state's size in MiB (0: leave it out)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--demo-steps", type=int, default=30)
    p.add_argument("--large-steps", type=int, default=20)
    p.add_argument("--load-samples", type=int, default=5)
    args = p.parse_args()
    full, _ = meshes()
    result: dict[str, Any] = {"devices": 8, "mesh": {"replica": 2, "model": 4},
                              "jax": jax.__version__}
    for name in ("demo", "large"):
        if name == "large" and args.large_mib <= 0:
            continue
        mtc, orbax = Snapshotter(), OrbaxSnapshotter()
        if name == "demo":
            w = demo_workload(full, mtc)
            steps = args.demo_steps
        else:
            w = large_workload(full, mtc, args.large_mib)
            steps = args.large_steps
        result[name] = bench_one(w, args, mtc, orbax, steps)
        del w, mtc, orbax
        gc.collect()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
