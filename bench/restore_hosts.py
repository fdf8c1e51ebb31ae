"""A tiny state's restore through colocated Python with 4 and with 8 hosts, in one run.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/restore_hosts.py [--samples 15] [--warmup 3]
        [--call-latency-ms 3]

The state is a few KiB: a restore's time is then its colocated calls (each costs
the sidecars' ``--colocated-call-latency-ms``, as the hop through Pathways' proxy
does) and its per-host work. Each host is an isolated sidecar running the
controller's colocated-Python programs as a Pathways worker would. The figure is
``restore_8_over_4``: the median restore with 8 hosts over the median with 4
(target at most 1.3: calls do not grow with hosts).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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

import mtc

TARGET = 1.3


def _one(root: Path, hosts_n: int, samples: int, warmup: int, latency_ms: float
         ) -> dict[str, Any]:
    from mtc.trainer.isolation import Hosts

    hosts = Hosts(root / f"hosts-{hosts_n}", hosts_n, ramdisk_bytes=64 << 20,
                  colocated_devices=len(jax.devices()))
    slices = [i * 2 // hosts_n for i in range(hosts_n)]
    try:
        for i in range(hosts_n):
            hosts.start_sidecar(i, slices, wait=False,
                                extra=["--colocated-call-latency-ms", str(latency_ms)])
        for i in range(hosts_n):
            hosts.wait_sidecar(i)
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("slice", "data"))
        options = mtc.Options(simulated_hosts=hosts_n, hosts_per_slice=hosts_n // 2,
                              sidecars=tuple(h.sidecar_address for h in hosts.hosts),
                              replicator_token=hosts.token(), dispatch="colocated")
        state = {"w": jax.device_put(np.arange(8 * 64, dtype=np.float32).reshape(8, 64),
                                     NamedSharding(mesh, PartitionSpec(("slice", "data")))),
                 "b": jax.device_put(np.ones(16, np.float32), NamedSharding(mesh, PartitionSpec())),
                 "step": 1}
        with mtc.CheckpointManager(root / f"controller-{hosts_n}", mesh=mesh,
                                   options=options) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()
            seconds, calls = [], []
            for k in range(warmup + samples):
                c0 = mgr._dispatch.calls  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                jax.block_until_ready(mgr.restore(1, state))
                dt = time.perf_counter() - t0
                if k >= warmup:
                    seconds.append(dt)
                    calls.append(mgr._dispatch.calls - c0)  # type: ignore[attr-defined]
        return {"hosts": hosts_n, "median_s": statistics.median(seconds), "min_s": min(seconds),
                "samples_s": seconds, "calls_per_restore": sorted(set(calls)),
                "isolation": hosts.describe()}
    finally:
        hosts.down()


def run(root: Path, samples: int, warmup: int, latency_ms: float) -> dict[str, Any]:
    t_start = time.perf_counter()
    by_hosts = {}
    for n in (4, 8):
        log(f"{n} hosts")
        by_hosts[n] = _one(root, n, samples, warmup, latency_ms)
    ratio = by_hosts[8]["median_s"] / by_hosts[4]["median_s"]
    return {"dispatch": "colocated",
            "config": {"samples": samples, "warmup": warmup,
                       "colocated_call_latency_ms": latency_ms, "devices": len(jax.devices()),
                       "cpus": os.cpu_count(), "loadavg_1min": os.getloadavg()[0]},
            "hosts_4": by_hosts[4], "hosts_8": by_hosts[8],
            "ratios": {"restore_8_over_4": ratio},
            "targets": {"restore_8_over_4": f"<= {TARGET}"},
            "meets_targets": {"restore_8_over_4": ratio <= TARGET},
            "wall_s": time.perf_counter() - t_start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--samples", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--call-latency-ms", type=float, default=3.0,
                   help="the sidecars' --colocated-call-latency-ms (default 3)")
    args = p.parse_args(argv)
    return run_in_scratch("mtc-bench-hosts-", lambda root: run(root, args.samples, args.warmup,
                                                               args.call_latency_ms))


if __name__ == "__main__":
    sys.exit(main())
