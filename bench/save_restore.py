"""Save and restore throughput of mtc against raw tmpfs bandwidth and Orbax, in one run.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/save_restore.py [--gib 1.0] [--samples 5] [--warmup 1]
        [--orbax-saves 3] [--hosts colocated|isolated|in-process]

The state is ``--gib`` GiB of float32 leaves of 64 MiB, each sharded along axis 0
over a (2 slices, 4) mesh of 8 CPU devices: 16 shards of 8 MiB per GiB. mtc
treats the 8 devices as 4 simulated hosts in 2 slices: by default isolated hosts
(``mtc/testing/isolation.py``: a sidecar process each, alone with its RAM disk, in
namespaces of its own where root allows) that run the controller's colocated-Python
programs as Pathways workers do (``--hosts colocated``, the path a Pathways job
runs; each call costs the sidecars' ``--colocated-call-latency-ms``); with
``--hosts isolated`` the same sidecars served by seam requests (the process
dispatch, a test tool); with ``--hosts in-process`` host-side code in this
process, reading and writing the RAM disks itself. The JSON's ``dispatch`` names
the path measured. Every figure is measured
in rounds: each round runs every measurement once, so drift in the machine hits
all of them alike; the first ``--warmup`` rounds are discarded. Every ratio is
taken between medians of the same run. Orbax's async save, whose end-to-end
time varies most from save to save, is sampled ``--orbax-saves`` times a round;
``spread`` gives each ratio's range over the rounds (each round's mtc sample
against that round's median Orbax sample) so a reader sees how stable it is.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
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
import numpy as np
from _common import log, run_in_scratch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mtc

MIB = 1 << 20
SHARD_BYTES = 8 * MIB
NUM_DEVICES = 8
LEAF_ROWS = 2048  # 2048 x 8192 float32 = 64 MiB per leaf, 8 MiB per shard
LEAF_COLS = 8192
AXES = ("slice", "data")
SPEC = PartitionSpec(("slice", "data"), None)

TARGETS: dict[str, tuple[str, float]] = {
    "save_stall_over_copy": ("<=", 1.2),
    "save_over_raw_write": (">=", 0.5),
    "save_over_orbax": (">=", 3.0),
    "restore_over_orbax": (">=", 2.0),
    "restore_half_over_orbax": (">=", 2.0),
    "restore_over_raw_read": (">=", 0.5),
    "restore_half_over_raw_read": (">=", 0.5),
}

State = dict[str, jax.Array]


# -- the state ------------------------------------------------------------------------


def make_meshes() -> tuple[Mesh, Mesh]:
    devices = jax.devices()
    if len(devices) < NUM_DEVICES:
        raise SystemExit(f"need {NUM_DEVICES} devices, JAX sees {len(devices)}")
    full = Mesh(np.array(devices[:NUM_DEVICES]).reshape(2, 4), AXES)
    half = Mesh(np.array(devices[:4]).reshape(1, 4), AXES)
    return full, half


def make_state(num_leaves: int, sharding: NamedSharding) -> State:
    """Distinct, deterministic values per leaf, built on the devices that hold them."""

    def leaf(offset: jax.Array) -> jax.Array:
        iota = jax.lax.broadcasted_iota(jnp.uint32, (LEAF_ROWS, LEAF_COLS), 0) * LEAF_COLS \
            + jax.lax.broadcasted_iota(jnp.uint32, (LEAF_ROWS, LEAF_COLS), 1)
        return (iota % jnp.uint32(1_000_003)).astype(jnp.float32) * 0.5 + offset

    build = jax.jit(leaf, out_shardings=sharding)
    state = {f"layer_{i:03d}": build(jnp.float32(i * 1000.25)) for i in range(num_leaves)}
    jax.block_until_ready(state)
    return state


def abstract(state: State, sharding: NamedSharding) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
            for k, v in state.items()}


def expected_leaf(host_copy: dict[str, list[tuple[int, np.ndarray]]], name: str) -> np.ndarray:
    """A leaf's full value from the reference host copies of its shards."""
    return np.concatenate([buf for _, buf in sorted(host_copy[name], key=lambda t: t[0])])


def verify(label: str, restored: Any, host_copy: dict[str, list[tuple[int, np.ndarray]]],
           sharding: NamedSharding) -> None:
    """Fail loudly unless ``restored`` holds the saved values on ``sharding``."""
    if set(restored) != set(host_copy):
        raise AssertionError(f"{label}: restored keys {sorted(restored)[:4]}... "
                             f"differ from saved ones")
    for name, arr in restored.items():
        if not isinstance(arr, jax.Array):
            raise AssertionError(f"{label}: {name} is a {type(arr).__name__}, not a jax.Array")
        if not arr.sharding.is_equivalent_to(sharding, arr.ndim):
            raise AssertionError(f"{label}: {name} has sharding {arr.sharding}, "
                                 f"expected {sharding}")
        want = expected_leaf(host_copy, name)
        got = np.asarray(arr)
        if got.shape != want.shape or got.dtype != want.dtype or \
                not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
            bad = int(np.count_nonzero(got.view(np.uint32) != want.view(np.uint32))) \
                if got.shape == want.shape and got.dtype == want.dtype else -1
            raise AssertionError(f"{label}: {name} differs from the saved value "
                                 f"({bad} of {want.size} elements differ)")
    log(f"verified {label}: {len(restored)} leaves equal the saved values")


# -- raw references -------------------------------------------------------------------


def copy_shards(state: State, bufs: list[np.ndarray]) -> None:
    """Every shard into its preallocated host buffer, in ``addressable_shards`` order."""
    it = iter(bufs)
    for arr in state.values():
        for shard in arr.addressable_shards:
            np.copyto(next(it), np.asarray(shard.data))


def write_files(folder: Path, bufs: list[np.ndarray]) -> list[Path]:
    paths = [folder / f"{i:05d}.bin" for i in range(len(bufs))]
    for path, buf in zip(paths, bufs, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = buf.reshape(-1).view(np.uint8).data
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        finally:
            os.close(fd)
    return paths


def read_files(paths: list[Path], bufs: list[np.ndarray]) -> None:
    for path, buf in zip(paths, bufs, strict=True):
        view = buf.reshape(-1).view(np.uint8).data
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{path}: short read ({got} of {len(view)} bytes)")
                got += n


# -- measurement helpers --------------------------------------------------------------


class Samples:
    """Named lists of timings; the first ``warmup`` of each are discarded."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.warmups: dict[str, int] = {}  # names sampled more than once a round
        self.raw: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.raw.setdefault(name, []).append(seconds)

    def kept(self, name: str) -> list[float]:
        return self.raw[name][self.warmups.get(name, self.warmup):]

    def median(self, name: str) -> float:
        return statistics.median(self.kept(name))

    def min(self, name: str) -> float:
        return min(self.kept(name))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


# -- the benchmark --------------------------------------------------------------------


def run(gib: float, samples: int, warmup: int, root: Path, hosts_mode: str,
        orbax_saves: int = 3) -> dict[str, Any]:
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    import orbax.checkpoint as ocp

    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        from absl import logging as absl_logging
        absl_logging.set_verbosity(absl_logging.ERROR)
    except ImportError:
        pass

    leaf_bytes = LEAF_ROWS * LEAF_COLS * 4
    num_leaves = max(1, round(gib * (1 << 30) / leaf_bytes))
    full_mesh, half_mesh = make_meshes()
    full = NamedSharding(full_mesh, SPEC)
    half = NamedSharding(half_mesh, SPEC)

    log(f"building state: {num_leaves} leaves of {leaf_bytes // MIB} MiB on {NUM_DEVICES} devices")
    state = make_state(num_leaves, full)
    total_bytes = sum(int(v.nbytes) for v in state.values())
    shards = [(name, s.index[0].start or 0, s.data)
              for name, arr in state.items() for s in arr.addressable_shards]
    shard_sizes = {int(a.nbytes) for _, _, a in shards}
    if shard_sizes != {SHARD_BYTES}:
        raise AssertionError(f"expected shards of {SHARD_BYTES} bytes, got {shard_sizes}")

    # Every host buffer up front, and touched, so no sample pays for first-touch pages.
    copy_bufs = [np.empty(a.shape, np.float32) for _, _, a in shards]
    read_bufs = [np.empty(a.shape, np.float32) for _, _, a in shards]
    for b in (*copy_bufs, *read_bufs):
        b.fill(1.0)
    host_copy: dict[str, list[tuple[int, np.ndarray]]] = {}
    for (name, row, _), buf in zip(shards, copy_bufs, strict=True):
        host_copy.setdefault(name, []).append((row, buf))

    raw_dir = root / "raw"
    read_dir = root / "raw-read"
    raw_dir.mkdir()
    read_dir.mkdir()
    mtc_dir = root / "mtc"
    orbax_dir = root / "orbax"

    full_target = abstract(state, full)
    half_target = abstract(state, half)

    hosts = None
    if hosts_mode in ("isolated", "colocated"):
        from mtc.testing.isolation import Hosts

        # Room for the steps retention keeps, plus the one being written.
        hosts = Hosts(root / "hosts", 4, ramdisk_bytes=int(total_bytes / 4 * 3.5),
                      colocated_devices=len(jax.devices()) if hosts_mode == "colocated" else 0)
        for i in range(4):
            hosts.start_sidecar(i, [0, 0, 1, 1])
        mtc_options = mtc.Options(max_to_keep=2, simulated_hosts=4, hosts_per_slice=2,
                                  sidecars=tuple(h.sidecar_address for h in hosts.hosts),
                                  replicator_token=hosts.token(),
                                  dispatch="colocated" if hosts_mode == "colocated" else "auto")
        log(f"isolated hosts: {hosts.describe()}")
    else:
        mtc_options = mtc.Options(max_to_keep=2, simulated_hosts=4, hosts_per_slice=2,
                                  dispatch="local")
    mgr = mtc.CheckpointManager(mtc_dir, mesh=full_mesh, options=mtc_options)
    # Colocated calls of each operation (the last round's), where the dispatcher counts.
    call_counts: dict[str, int] = {}

    def calls_made() -> int:
        return int(getattr(mgr._dispatch, "calls", 0))
    # Default options except retention, so the tmpfs does not fill (as for mtc).
    omgr = ocp.CheckpointManager(orbax_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2))

    s = Samples(warmup)
    # Orbax's saves are several a round: its warm-up is as many rounds' worth.
    s.warmups["orbax_save"] = s.warmups["orbax_save_call"] = warmup * orbax_saves
    rounds = warmup + samples
    step = 0
    ostep = 0
    read_paths = write_files(read_dir, copy_bufs)  # read back in every round
    try:
        for r in range(rounds):
            tag = "warm-up" if r < warmup else f"sample {r - warmup + 1}/{samples}"
            log(f"round {r + 1}/{rounds} ({tag})")
            first = r == 0

            # Reference: device shards into preallocated host buffers.
            dt, _ = timed(lambda: copy_shards(state, copy_bufs))
            s.add("copy_to_host", dt)

            # Reference: raw tmpfs write of the same bytes into fresh files.
            sample_dir = raw_dir / f"r{r}"
            sample_dir.mkdir()
            dt, _ = timed(lambda d=sample_dir: write_files(d, copy_bufs))  # type: ignore[misc]
            s.add("raw_write", dt)
            shutil.rmtree(sample_dir)

            # Reference: raw tmpfs read of files written once.
            dt, _ = timed(lambda: read_files(read_paths, read_bufs))
            s.add("raw_read", dt)

            # mtc save: stall, then end to end.
            step += 1
            gc.collect()
            c0 = calls_made()
            t0 = time.perf_counter()
            ok = mgr.save(step, state, force=True)
            t1 = time.perf_counter()
            c1 = calls_made()
            mgr.wait_until_finished()
            t2 = time.perf_counter()
            call_counts["save"], call_counts["wait_until_finished"] = c1 - c0, calls_made() - c1
            if not ok:
                raise AssertionError(f"mtc save of step {step} returned False")
            s.add("mtc_save_stall", t1 - t0)
            s.add("mtc_save", t2 - t0)

            # mtc restore onto the same mesh, then onto half the devices.
            def mtc_restore(target: dict[str, jax.ShapeDtypeStruct], st: int = step) -> Any:
                return jax.block_until_ready(mgr.restore(st, target))

            c0 = calls_made()
            dt, out = timed(lambda: mtc_restore(full_target))
            call_counts["restore"] = calls_made() - c0
            s.add("mtc_restore", dt)
            if first:
                verify("mtc restore (same mesh)", out, host_copy, full)
            del out
            dt, out = timed(lambda: mtc_restore(half_target))
            s.add("mtc_restore_half", dt)
            if first:
                verify("mtc restore (4 devices)", out, host_copy, half)
            del out

            # Orbax: async save (call, then end to end), ``orbax_saves`` times a
            # round: its end-to-end time varies by 2x from save to save here
            # (compression, fresh host buffers, its deletions), so the reference is
            # the median of more samples than mtc's own; every one is kept.
            for _ in range(orbax_saves):
                ostep += 1
                gc.collect()
                t0 = time.perf_counter()
                omgr.save(ostep, args=ocp.args.StandardSave(state))
                t1 = time.perf_counter()
                omgr.wait_until_finished()
                t2 = time.perf_counter()
                s.add("orbax_save_call", t1 - t0)
                s.add("orbax_save", t2 - t0)

            def orbax_restore(target: dict[str, jax.ShapeDtypeStruct], st: int = ostep) -> Any:
                return jax.block_until_ready(
                    omgr.restore(st, args=ocp.args.StandardRestore(target)))

            dt, out = timed(lambda: orbax_restore(full_target))
            s.add("orbax_restore", dt)
            if first:
                verify("orbax restore (same mesh)", out, host_copy, full)
            del out
            dt, out = timed(lambda: orbax_restore(half_target))
            s.add("orbax_restore_half", dt)
            if first:
                verify("orbax restore (4 devices)", out, host_copy, half)
            del out
            gc.collect()
    finally:
        mgr.close()
        omgr.close()
        if hosts is not None:
            hosts.down()

    gb = total_bytes / 1e9

    def gbps(name: str) -> float:
        return gb / s.median(name)

    def gbps_max(name: str) -> float:
        return gb / s.min(name)

    result: dict[str, Any] = {
        "config": {
            "gib": gib, "bytes": total_bytes, "leaves": num_leaves, "shards": len(shards),
            "shard_bytes": SHARD_BYTES, "devices": NUM_DEVICES, "mesh": [2, 4],
            "half_mesh": [1, 4], "simulated_hosts": 4, "hosts_per_slice": 2,
            "warmup_rounds": warmup, "samples": samples, "orbax_saves_per_round": orbax_saves,
            "jax": jax.__version__,
            "orbax": getattr(ocp, "__version__", "?"), "mtc": mtc.__version__,
            "cpus": os.cpu_count(),
            "mtc_options": repr(mtc_options),
            "hosts": hosts.describe() if hosts is not None else "in-process",
            "orbax_options": "CheckpointManagerOptions(max_to_keep=2), async, otherwise default",
            # Other work on this machine skews every figure: ratios hold up better.
            "loadavg_1min_start_end": [load_start, os.getloadavg()[0]],
        },
        "seconds": {name: {"median": s.median(name), "min": s.min(name),
                           "samples": s.kept(name)} for name in s.raw},
        "gbps": {name: {"median": gbps(name), "max": gbps_max(name)}
                 for name in ("copy_to_host", "raw_write", "raw_read", "mtc_save",
                              "mtc_restore", "mtc_restore_half", "orbax_save",
                              "orbax_restore", "orbax_restore_half")},
        "copy_to_host_s": s.median("copy_to_host"),
        "save_stall_s": s.median("mtc_save_stall"),
        "orbax_save_call_s": s.median("orbax_save_call"),
        "raw_write_gbps": gbps("raw_write"),
        "raw_read_gbps": gbps("raw_read"),
        "mtc_save_gbps": gbps("mtc_save"),
        "mtc_restore_gbps": gbps("mtc_restore"),
        "mtc_restore_half_gbps": gbps("mtc_restore_half"),
        "orbax_save_gbps": gbps("orbax_save"),
        "orbax_restore_gbps": gbps("orbax_restore"),
        "orbax_restore_half_gbps": gbps("orbax_restore_half"),
    }
    ratios = {
        "save_stall_over_copy": s.median("mtc_save_stall") / s.median("copy_to_host"),
        "save_over_raw_write": gbps("mtc_save") / gbps("raw_write"),
        "save_over_orbax": gbps("mtc_save") / gbps("orbax_save"),
        "restore_over_orbax": gbps("mtc_restore") / gbps("orbax_restore"),
        "restore_half_over_orbax": gbps("mtc_restore_half") / gbps("orbax_restore_half"),
        "restore_over_raw_read": gbps("mtc_restore") / gbps("raw_read"),
        "restore_half_over_raw_read": gbps("mtc_restore_half") / gbps("raw_read"),
    }
    result["ratios"] = ratios
    result["dispatch"] = {"colocated": "colocated", "isolated": "process",
                          "in-process": "local"}[hosts_mode]
    if hosts_mode == "colocated":
        result["colocated_calls"] = call_counts
    osaves = s.kept("orbax_save")
    per_round = [statistics.median(osaves[i * orbax_saves:(i + 1) * orbax_saves]) / t
                 for i, t in enumerate(s.kept("mtc_save"))]
    stalls = [st / c for st, c in zip(s.kept("mtc_save_stall"), s.kept("copy_to_host"),
                                      strict=True)]
    result["spread"] = {"save_over_orbax": [min(per_round), max(per_round)],
                        "save_stall_over_copy": [min(stalls), max(stalls)]}
    result["targets"] = {k: f"{op} {v}" for k, (op, v) in TARGETS.items()}
    result["meets_targets"] = {
        k: (ratios[k] <= v if op == "<=" else ratios[k] >= v) for k, (op, v) in TARGETS.items()}
    result["wall_s"] = time.perf_counter() - t_start
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    p.add_argument("--samples", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="discarded rounds (default 1)")
    p.add_argument("--orbax-saves", type=int, default=3,
                   help="Orbax saves a round: the reference's median is of samples x this "
                        "(default 3)")
    p.add_argument("--hosts", choices=("colocated", "isolated", "in-process"),
                   default="colocated",
                   help="sidecar processes with private RAM disks running the controller's "
                        "colocated-Python programs (default: Pathways' path), the same "
                        "served by seam requests (the process dispatch), or this process")
    args = p.parse_args(argv)
    if args.samples < 1 or args.warmup < 1 or args.gib <= 0 or args.orbax_saves < 1:
        p.error("--samples, --warmup and --orbax-saves must be >= 1 and --gib > 0")
    return run_in_scratch("mtc-bench-",
                          lambda root: run(args.gib, args.samples, args.warmup, root,
                                           args.hosts, args.orbax_saves))


if __name__ == "__main__":
    sys.exit(main())
