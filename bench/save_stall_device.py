"""The save stall on a real accelerator: ``save`` against JAX's own device-to-host copy.

Prints one JSON object to stdout (progress goes to stderr)::

    python bench/save_stall_device.py [--samples 10] [--warmup 2] [--gib 1]

The other benchmarks run on CPU devices, where a shard is already in host memory
and the stall is bookkeeping and a memcpy. On a TPU or GPU the stall is a
device-to-host copy: this one runs on JAX's default backend, in one process with
its own host side (``dispatch="local"``: a multi-controller job's process, one
host), and saves two states:

- ``big``: ``--gib`` GiB in 64 MiB float32 leaves, where the copy decides it;
- ``model``: the demo's small model with its Adam moments (111 leaves, most of
  them small), where the per-leaf work decides it;
- each again, saved from its copy in pinned host memory (``*_from_host_copy``),
  made by a program before the clock starts, as a training step emits its
  snapshot: the elastic trainer saves that copy while the next step runs.
  ``save_stall_over_saving_the_state`` compares the two stalls.

Reference, in the same rounds, on arrays as fresh as the saved ones (JAX caches
an array's host copy, so each round makes new ones): ``jax.device_get`` of every
leaf after ``copy_to_host_async`` of all of them, what the stall of any
checkpointer that takes a host copy cannot go below. ``save_stall_over_device_get``
is the ratio of the medians. The restore of the last step is checked against the
saved values and timed against ``jax.device_put`` of host copies of the same leaves.
``platform`` names the backend: on CPU the figures say nothing of an accelerator.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from _common import log, run_in_scratch

import mtc

LEAF_BYTES = 64 << 20


def big_state(gib: float, device: Any) -> dict[str, jax.Array]:
    n = max(1, round(gib * (1 << 30) / LEAF_BYTES))
    return {f"w{i:02d}": jax.device_put(np.full(LEAF_BYTES // 4, i, np.float32), device)
            for i in range(n)}


def model_state(device: Any) -> dict[str, Any]:
    """Leaves shaped as the demo's small model (d_model 256, 4 layers, d_ff 1024,
    vocabulary 16, 64 positions) with its Adam moments: 109 leaves, most of them
    small. Shapes only: ``mtc.trainer`` needs the demo's dependencies (grain)."""
    d, f, layers, vocab, seq = 256, 1024, 4, 16, 64
    layer = {"ln1": (d,), "wqkv": (d, 3, 4, d // 4), "wo": (4, d // 4, d), "ln2": (d,),
             "w1": (d, f), "b1": (f,), "w2": (f, d), "b2": (d,)}
    shapes = {"embed": (vocab, d), "pos": (seq, d), "ln_f": (d,), "unembed": (d, vocab),
              **{f"layer{i}/{k}": v for i in range(layers) for k, v in layer.items()}}
    rng = np.random.default_rng(0)
    params = {k: rng.standard_normal(v, dtype=np.float32) for k, v in shapes.items()}
    state = {"params": params, "mu": {k: v * 0.1 for k, v in params.items()},
             "nu": {k: v * v for k, v in params.items()}, "count": np.zeros((), np.int32)}
    return jax.device_put(state, device)


def medians(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def host_copy_of(state: Any) -> Any:
    """A program that copies ``state`` into pinned host memory, as a training step
    emits its snapshot (``mtc.elastic.in_graph``); None where the device has none."""
    leaf = jax.tree.leaves(state)[0]
    if "pinned_host" not in {m.kind for m in leaf.devices().pop().addressable_memories()}:
        return None
    shardings = jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), state)
    return jax.jit(lambda t: t, out_shardings=shardings)


def bench(name: str, state: Any, root: Path, samples: int, warmup: int,
          copy: Any = None) -> dict[str, Any]:
    """``copy``: save each round's state from its copy in host memory (made by that
    program before the clock starts, as the step's own copy is), not the state."""
    bump = jax.jit(lambda t: jax.tree.map(lambda x: x + 1, t))
    leaves = jax.tree.leaves(state)
    nbytes = sum(int(x.nbytes) for x in leaves)
    log(f"{name}: {len(leaves)} leaves, {nbytes / 1e6:.1f} MB on {leaves[0].devices()}")
    ref, stall, write, load, put = [], [], [], [], []
    options = mtc.Options(dispatch="local", max_to_keep=2)
    with mtc.CheckpointManager(root / name, options=options) as mgr:
        for r in range(warmup + samples):
            fresh_ref = bump(state)
            state = bump(fresh_ref)
            to_save = state if copy is None else copy(state)
            jax.block_until_ready((fresh_ref, state, to_save))
            gc.collect()
            t0 = time.perf_counter()
            for x in jax.tree.leaves(fresh_ref):
                x.copy_to_host_async()
            host = jax.device_get(fresh_ref)
            t1 = time.perf_counter()
            if not mgr.save(r + 1, to_save, force=True):
                raise AssertionError(f"save of step {r + 1} was skipped")
            t2 = time.perf_counter()
            mgr.wait_until_finished()
            t3 = time.perf_counter()
            if r >= warmup:
                ref.append(t1 - t0)
                stall.append(t2 - t1)
                write.append(t3 - t2)
        saved = jax.device_get(state)
        for _ in range(max(1, samples // 3)):
            t0 = time.perf_counter()
            back = mgr.restore(warmup + samples, target=state)
            jax.block_until_ready(back)
            t1 = time.perf_counter()
            jax.block_until_ready(jax.device_put(host, jax.tree.map(lambda x: x.sharding, state)))
            t2 = time.perf_counter()
            load.append(t1 - t0)
            put.append(t2 - t1)
        # A stall that lost bytes measures nothing: the last step holds the state.
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(back), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
    return {
        "leaves": len(leaves), "bytes": nbytes, "samples": samples,
        "save_stall_s": medians(stall), "device_get_s": medians(ref),
        "write_after_stall_s": medians(write),
        "restore_s": medians(load), "device_put_s": medians(put),
        "save_stall_over_device_get": statistics.median(stall) / statistics.median(ref),
        "restore_over_device_put": statistics.median(load) / statistics.median(put),
        "values_checked": True,
        "saved_from": "the state" if copy is None else "its copy in pinned host memory",
    }


def run(samples: int, warmup: int, gib: float, root: Path) -> dict[str, Any]:
    device = jax.devices()[0]
    out: dict[str, Any] = {
        "platform": device.platform, "device_kind": device.device_kind,
        "jax": jax.__version__, "dispatch": "local",
        "definition": "save_stall: wall time of CheckpointManager.save in a process with "
                      "its own host side (earlier saves written); device_get: "
                      "copy_to_host_async of every leaf, then jax.device_get, on "
                      "arrays as fresh; restore: CheckpointManager.restore onto the "
                      "device; device_put: the same leaves' host copies put back",
    }
    out["big"] = bench("big", big_state(gib, device), root, samples, warmup)
    out["model"] = bench("model", model_state(device), root, samples, warmup)
    # The elastic trainer saves a step from the copy the step made of its new state,
    # in host memory where the device has one: what does the save stall then?
    for name, make in (("big", lambda: big_state(gib, device)),
                       ("model", lambda: model_state(device))):
        state = make()
        copy = host_copy_of(state)
        if copy is None:
            out[f"{name}_from_host_copy"] = "no pinned host memory on this device"
            continue
        got = out[f"{name}_from_host_copy"] = bench(f"{name}_from_host_copy", state, root,
                                                    samples, warmup, copy)
        got["save_stall_over_saving_the_state"] = (
            got["save_stall_s"]["median"] / out[name]["save_stall_s"]["median"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--samples", type=int, default=10, help="timed saves (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="discarded saves (default 2)")
    p.add_argument("--gib", type=float, default=1.0, help="size of the big state (default 1)")
    args = p.parse_args(argv)
    if args.samples < 1 or args.warmup < 0 or args.gib <= 0:
        p.error("--samples must be >= 1, --warmup >= 0 and --gib > 0")
    return run_in_scratch("mtc-bench-device-",
                          lambda root: run(args.samples, args.warmup, args.gib, root))


if __name__ == "__main__":
    sys.exit(main())
