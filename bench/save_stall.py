"""How long ``save`` blocks the training loop for a state of many small leaves.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/save_stall.py [--samples 20] [--warmup 3] [--model small]
        [--dispatch colocated|process]

``bench/save_restore.py`` measures the stall of 1 GiB in 64 MiB leaves, where
the copy decides it. A real model's state is hundreds of leaves, most of them
small (biases, norms and their optimizer moments), and there the per-leaf and
per-host work around the copy decides it: this benchmark saves the demo's own
state (``mtc.trainer.model``, the ``--model`` preset with its Adam moments: the
small preset is 111 array leaves, 180 shards of them on each of 4 simulated
hosts) through isolated hosts' sidecars (``mtc/testing/isolation.py``), as
``make demo`` does, the save interval's worth of writing finished between
samples.

Reference, in the same rounds: copying the same shards the hosts write (each
host's distinct shards, replicas on one host once) into preallocated host
buffers on one thread, what the stall cannot go below on one core.
``save_stall_over_copy`` is the ratio of the medians; each round runs both, so
drift in the machine hits them alike.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from _common import log, run_in_scratch
from jax.sharding import Mesh

import mtc
from mtc.save.stage import is_prng_key, prepare
from mtc.shards import distinct_shards
from mtc.topology import Topology

HOSTS_OF_SLICE = [0, 0, 1, 1]
SETTLE_S = 1.0  # after each save's writes: the next sample starts on quiet hosts


def host_shards(state: Any, host_of: dict[int, int]) -> tuple[list[Any], int]:
    """The shards the hosts write (each host's distinct ones), as device arrays, and
    the number of array leaves."""
    _, arrays = prepare(0, state, skip_if_busy=False)
    out = []
    for a in arrays:
        if isinstance(a, np.ndarray):
            out.extend([a] * len(HOSTS_OF_SLICE))
            continue
        shards = a.addressable_shards
        out.extend(shards[pos].data for pos, _, _, _ in distinct_shards(a, host_of))
    return out, len(arrays)


def host_value(x: Any) -> Any:
    if is_prng_key(x):
        x = jax.random.key_data(x)
    return np.asarray(x) if isinstance(x, (jax.Array, np.ndarray)) else x


def run(samples: int, warmup: int, model: str, dispatch: str, root: Path) -> dict[str, Any]:
    from mtc.testing.isolation import Hosts
    from mtc.trainer.data import VOCAB
    from mtc.trainer.model import Config, Trainer

    cfg = Config.preset(model, vocab_size=len(VOCAB), total_steps=samples + warmup)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
    state = Trainer(cfg, mesh).init(0)
    jax.block_until_ready(state)
    base_options = mtc.Options(simulated_hosts=len(HOSTS_OF_SLICE), hosts_per_slice=2,
                               max_to_keep=2)
    # The manager's own device-to-host map: the reference copies what the hosts write.
    topology = Topology.detect(jax.devices(), base_options)
    srcs, leaves = host_shards(state, topology.host_of_device)
    bufs = [np.empty(s.shape, s.dtype) for s in srcs]
    for b in bufs:
        b.fill(1)  # touched: no sample pays for first-touch pages
    nbytes = sum(int(b.nbytes) for b in bufs)
    log(f"{leaves} array leaves, {len(srcs)} host shards, {nbytes / 1e6:.1f} MB to stage")

    hosts = Hosts(root / "hosts", len(HOSTS_OF_SLICE), ramdisk_bytes=max(64 << 20, 8 * nbytes),
                  colocated_devices=len(jax.devices()) if dispatch == "colocated" else 0)
    stall: list[float] = []
    copy: list[float] = []
    try:
        for i in range(len(HOSTS_OF_SLICE)):
            hosts.start_sidecar(i, HOSTS_OF_SLICE)
        options = dataclasses.replace(
            base_options, sidecars=tuple(h.sidecar_address for h in hosts.hosts),
            replicator_token=hosts.token(), dispatch=dispatch)  # type: ignore[arg-type]
        with mtc.CheckpointManager(root / "controller", mesh=mesh, options=options) as mgr:
            if mgr.dispatch_mode != dispatch:
                raise AssertionError(f"measured {mgr.dispatch_mode}, not {dispatch}")
            for r in range(warmup + samples):
                gc.collect()
                t0 = time.perf_counter()
                for src, buf in zip(srcs, bufs, strict=True):
                    np.copyto(buf, np.asarray(src))
                t1 = time.perf_counter()
                if not mgr.save(r + 1, state):
                    raise AssertionError(f"save of step {r + 1} was skipped")
                t2 = time.perf_counter()
                mgr.wait_until_finished()
                time.sleep(SETTLE_S)
                if r >= warmup:
                    copy.append(t1 - t0)
                    stall.append(t2 - t1)
            # The last step holds the state: a stall that lost bytes measures nothing.
            back = mgr.restore(warmup + samples, target=state)
            for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back), strict=True):
                np.testing.assert_array_equal(host_value(a), host_value(b))
    finally:
        hosts.down()
    med_stall, med_copy = statistics.median(stall), statistics.median(copy)
    return {
        "dispatch": dispatch, "model": model, "array_leaves": leaves,
        "host_shards": len(srcs), "bytes": nbytes,
        "hosts": len(HOSTS_OF_SLICE), "isolation": hosts.isolation, "samples": samples,
        "save_stall_s": {"median": med_stall, "min": min(stall), "max": max(stall)},
        "copy_to_host_s": {"median": med_copy, "min": min(copy), "max": max(copy)},
        "save_stall_over_copy": med_stall / med_copy,
        "values_checked": True,
        "definition": "save_stall: wall time of CheckpointManager.save through the "
                      "sidecars (earlier saves' writes finished); copy_to_host: the same "
                      "host shards copied into preallocated host buffers on one thread",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--samples", type=int, default=20, help="timed saves (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="discarded saves (default 3)")
    p.add_argument("--model", default="small", help="mtc.trainer.model preset (default small)")
    p.add_argument("--dispatch", choices=("colocated", "process"), default="colocated",
                   help="the hosts' path: colocated Python (default, as on Pathways) or the "
                        "process dispatch's seam requests (a test tool)")
    args = p.parse_args(argv)
    if args.samples < 1 or args.warmup < 0:
        p.error("--samples must be >= 1 and --warmup >= 0")
    return run_in_scratch("mtc-bench-stall-",
                          lambda root: run(args.samples, args.warmup, args.model,
                                           args.dispatch, root))


if __name__ == "__main__":
    sys.exit(main())
