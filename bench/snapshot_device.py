"""The in-memory snapshot on a real accelerator: what each way of taking it costs a step.

Prints one JSON object to stdout (progress goes to stderr)::

    python bench/snapshot_device.py [--mib 256] [--steps 20] [--rounds 3]

``bench/snapshot.py`` runs on CPU devices, where host and device memory are the
same RAM. This one runs on JAX's default backend (every local device, one mesh
axis), where a snapshot is a device-to-host copy: ``--mib`` MiB of float32 in
16 MiB leaves, sharded over the devices, and a memory-bound step (``x * 0.999 +
1``, donating the state). Step time, as the wall time of ``--steps`` steps over
their count (median of ``--rounds`` interleaved rounds), for:

- ``plain``: the step alone;
- ``in_graph``: ``mtc.elastic.InGraphStep`` taking a snapshot every step (the
  step's program also copies its new state into host memory);
- ``save``: the step, then ``Snapshotter.save`` every step (asynchronous; skipped
  while the last copy is in flight, ``save_skipped`` counts them).

References, in the same run: ``jax.device_get`` of the state after
``copy_to_host_async`` of every leaf, the device-to-host copy any snapshot needs
(``device_get_gbps``); the host writing the state's bytes into fresh pages (a
new numpy array, ``host_fresh_pages_gbps``) and into pages it holds (a copy
between two numpy arrays, ``host_held_pages_gbps``). ``in_graph_copy_gbps`` is
the state's bytes over what the copy adds to a step; ``in_graph_copy_over_device_get``
and ``in_graph_copy_over_fresh_pages`` that time over the references'. A
snapshot goes into fresh host buffers every step (XLA does not alias a host
output to a donated input), so on a host that maps fresh pages slowly the
copy runs at about the fresh-pages rate. A snapshot is loaded back after the
next step donated the state, and checked against the values it was taken of.
``platform`` names the backend: on CPU the figures say nothing of an
accelerator.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from _common import log, run_in_scratch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtc.elastic import InGraphStep, Snapshotter
from mtc.elastic.snapshot import step_copy_memory_kind

LEAF_MIB = 16


def _step(state: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], None]:
    return {k: v * 0.999 + 1 for k, v in state.items()}, None


def _state(mib: int, sharding: NamedSharding, n_dev: int) -> dict[str, jax.Array]:
    rows = max(n_dev, (LEAF_MIB << 20) // 4 // 1024 // n_dev * n_dev)
    return {f"w{i:03d}": jax.device_put(np.full((rows, 1024), i, np.float32), sharding)
            for i in range(max(1, mib // LEAF_MIB))}


def run(mib: int, steps: int, rounds: int, root: Path) -> dict[str, Any]:
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("m",))
    sharding = NamedSharding(mesh, PartitionSpec("m"))
    state = _state(mib, sharding, len(devices))
    nbytes = sum(int(x.nbytes) for x in state.values())
    log(f"{len(state)} leaves, {nbytes / (1 << 20):.0f} MiB on {len(devices)} "
        f"{devices[0].platform} device(s)")
    shardings = {k: sharding for k in state}
    plain = jax.jit(_step, donate_argnums=0)
    snap = Snapshotter()
    in_graph = InGraphStep(_step, snap, state_shardings=shardings)
    saver = Snapshotter()

    def timed(kind: str, state: Any) -> tuple[float, Any]:
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for i in range(steps):
            if kind == "plain":
                state, _ = plain(state)
            elif kind == "in_graph":
                state, _ = in_graph(state, snapshot_step=i)
            else:
                state, _ = plain(state)
                saver.save(i, state)
        jax.block_until_ready(state)
        seconds = (time.perf_counter() - t0) / steps
        snap.join()
        saver.join()
        return seconds, state

    for kind in ("plain", "in_graph", "save"):  # compiled, and one warm round each
        _, state = timed(kind, state)
    saver.skipped = 0
    per_step: dict[str, list[float]] = {"plain": [], "in_graph": [], "save": []}
    gets: list[float] = []
    fresh, held = [], []
    src = np.ones(nbytes // 4, np.float32)
    dst = src.copy()  # its pages mapped and held before the first round
    for r in range(rounds):
        for kind in per_step:
            seconds, state = timed(kind, state)
            per_step[kind].append(seconds)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for x in state.values():
            x.copy_to_host_async()
        jax.device_get(state)
        gets.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        new = np.full(nbytes // 4, r, np.float32)
        fresh.append(time.perf_counter() - t0)
        del new
        t0 = time.perf_counter()
        np.copyto(dst, src)
        held.append(time.perf_counter() - t0)
        log(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in
                                            per_step.items()) + f", get {gets[-1] * 1e3:.1f} ms")

    # A snapshot survives the donation of the state it was taken of, and loads back.
    state, _ = in_graph(state, snapshot_step=steps)
    want = {k: np.asarray(v) for k, v in state.items()}
    state, _ = plain(state)
    jax.block_until_ready(state)
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                for k, v in state.items()}
    t0 = time.perf_counter()
    back = jax.block_until_ready(snap.load(abstract))
    load_s = time.perf_counter() - t0
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(back[k]), v)

    med = {k: statistics.median(v) for k, v in per_step.items()}
    get = statistics.median(gets)
    fresh_s, held_s = statistics.median(fresh), statistics.median(held)
    copy_s = med["in_graph"] - med["plain"]
    return {
        "platform": devices[0].platform, "device_kind": devices[0].device_kind,
        "devices": len(devices), "jax": jax.__version__, "bytes": nbytes,
        "leaves": len(state), "steps": steps, "rounds": rounds,
        "snapshot_memory_kind": step_copy_memory_kind(devices) or "device",
        "step_s": {k: round(v, 6) for k, v in med.items()},
        "save_skipped": saver.skipped, "saves": rounds * steps,
        "device_get_s": round(get, 6), "device_get_gbps": round(nbytes / get / 1e9, 3),
        "in_graph_copy_gbps": round(nbytes / copy_s / 1e9, 3) if copy_s > 0 else None,
        "in_graph_copy_over_device_get": round(copy_s / get, 3),
        "host_fresh_pages_gbps": round(nbytes / fresh_s / 1e9, 3),
        "host_held_pages_gbps": round(nbytes / held_s / 1e9, 3),
        "in_graph_copy_over_fresh_pages": round(copy_s / fresh_s, 3),
        "in_graph_over_plain": round(med["in_graph"] / med["plain"], 3),
        "save_over_plain": round(med["save"] / med["plain"], 3),
        "load_s": round(load_s, 6), "values_checked": True,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed run (default 20)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    args = p.parse_args(argv)
    if args.mib < LEAF_MIB or args.steps < 1 or args.rounds < 1:
        p.error(f"--mib must be >= {LEAF_MIB}, --steps and --rounds >= 1")
    return run_in_scratch("mtc-bench-snapshot-device-",
                          lambda root: run(args.mib, args.steps, args.rounds, root))


if __name__ == "__main__":
    sys.exit(main())
