"""A tiny state's restore through colocated Python with 4 and with 8 hosts, in one run.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/restore_hosts.py [--samples 31] [--warmup 3]
        [--call-latency-ms 3]

The state is a few KiB: a restore's time is then its colocated calls (each costs
the sidecars' ``--colocated-call-latency-ms``, as the hop through Pathways' proxy
does) and its per-host work. Each host is an isolated sidecar running the
controller's colocated-Python programs as a Pathways worker would. The figure is
``restore_8_over_4``: the median restore with 8 hosts over the median with 4
(target at most 1.3: calls do not grow with hosts). Both clusters are up at
once and their restores alternate round by round, so that drift in the
machine's load hits both alike.

The reference, measured in the same rounds: two no-op colocated calls (the
manager's poll of its workers, as many calls as a restore makes) on each
cluster, ``calls_8_over_4``. And its floor, ``bare_grpc_8_over_4``: two calls
fanned out the same way to as many bare gRPC hosts (``bench/_grpc_echo.py``, a
process each, the same latency per call and no other work). Every host's
sidecar shares this machine's cores, so a call's per-host work (the
transport's, the sidecar's) adds up here where a real cluster's hosts would do
theirs at once; the reference shows how much of the restore's ratio that
alone makes.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import secrets
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from _common import log, run_in_scratch
from _grpc_echo import METHOD as ECHO
from _grpc_echo import TOKEN_KEY
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mtc

TARGET = 1.3


class _BareHosts:
    """``n`` bare gRPC hosts (``bench/_grpc_echo.py``, a process each), called as the
    colocated runtime calls its hosts: one thread per host, every answer awaited."""

    def __init__(self, n: int, latency_ms: float) -> None:
        import grpc

        from mtc.pool import ThreadPool

        self.n = n
        self.seconds: list[float] = []
        token = secrets.token_hex(16)
        self._metadata = ((TOKEN_KEY, token),)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._channels: list[grpc.Channel] = []
        self._pool = ThreadPool(n, f"bench-bare-{n}")
        try:
            for _ in range(n):
                self._procs.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__).with_name("_grpc_echo.py")),
                     "--latency-ms", str(latency_ms)],
                    stdout=subprocess.PIPE, env={**os.environ, "MTC_BENCH_TOKEN": token}))
            ports = [_read_port(proc) for proc in self._procs]
            self._channels = [grpc.insecure_channel(f"127.0.0.1:{port}") for port in ports]
            self._stubs = [c.unary_unary(ECHO) for c in self._channels]
        except BaseException:
            self.close()
            raise

    def two_calls(self, keep: bool) -> None:
        message = bytes(256)  # about what a no-op call's header is
        t0 = time.perf_counter()
        for _ in range(2):
            futures = [self._pool.submit(stub, message, timeout=10, metadata=self._metadata)
                       for stub in self._stubs]
            for f in futures:
                f.result()
        if keep:
            self.seconds.append(time.perf_counter() - t0)

    def close(self) -> None:
        for c in self._channels:
            c.close()
        self._pool.shutdown(wait=True)
        for proc in self._procs:  # ours, by pid
            proc.kill()
            proc.wait()


def _read_port(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> int:
    """The port a bare host printed, within ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line.strip().isdigit():
        raise RuntimeError(f"a bare gRPC host did not start within {timeout_s} s "
                           f"(exit {proc.poll()})")
    return int(line)


class _Cluster:
    """``n`` isolated hosts, and a manager of a tiny state saved on them."""

    def __init__(self, root: Path, n: int, latency_ms: float) -> None:
        from mtc.testing.isolation import Hosts

        self.n = n
        self.hosts = Hosts(root / f"hosts-{n}", n, ramdisk_bytes=64 << 20,
                           colocated_devices=len(jax.devices()))
        self.mgr: mtc.CheckpointManager | None = None
        self.seconds: list[float] = []
        self.call_seconds: list[float] = []
        self.calls: set[int] = set()
        try:
            self._start(root, latency_ms)
        except BaseException:
            self.close()  # nothing of a cluster that did not start is left
            raise

    def _start(self, root: Path, latency_ms: float) -> None:
        n = self.n
        slices = [i * 2 // n for i in range(n)]
        for i in range(n):
            self.hosts.start_sidecar(i, slices, wait=False,
                                     extra=["--colocated-call-latency-ms", str(latency_ms)])
        for i in range(n):
            self.hosts.wait_sidecar(i)
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("slice", "data"))
        options = mtc.Options(simulated_hosts=n, hosts_per_slice=n // 2,
                              sidecars=tuple(h.sidecar_address for h in self.hosts.hosts),
                              replicator_token=self.hosts.token(), dispatch="colocated")
        self.state = {
            "w": jax.device_put(np.arange(8 * 64, dtype=np.float32).reshape(8, 64),
                                NamedSharding(mesh, PartitionSpec(("slice", "data")))),
            "b": jax.device_put(np.ones(16, np.float32), NamedSharding(mesh, PartitionSpec())),
            "step": 1}
        self.mgr = mtc.CheckpointManager(root / f"controller-{n}", mesh=mesh, options=options)
        self.mgr.save(1, self.state)
        self.mgr.wait_until_finished()

    def restore(self, keep: bool) -> None:
        assert self.mgr is not None
        c0 = self.mgr._dispatch.calls  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        jax.block_until_ready(self.mgr.restore(1, self.state))
        dt = time.perf_counter() - t0
        if keep:
            self.seconds.append(dt)
            self.calls.add(self.mgr._dispatch.calls - c0)  # type: ignore[attr-defined]

    def two_calls(self, keep: bool) -> None:
        """Two no-op colocated calls (a poll of every worker each): the reference."""
        assert self.mgr is not None
        t0 = time.perf_counter()
        for _ in range(2):
            self.mgr._dispatch.raise_background_error()
        if keep:
            self.call_seconds.append(time.perf_counter() - t0)

    def result(self) -> dict[str, Any]:
        return {"hosts": self.n, "median_s": statistics.median(self.seconds),
                "min_s": min(self.seconds), "samples_s": self.seconds,
                "two_calls_median_s": statistics.median(self.call_seconds),
                "calls_per_restore": sorted(self.calls), "isolation": self.hosts.describe()}

    def close(self) -> None:
        try:
            if self.mgr is not None:
                self.mgr.close()
        finally:
            self.hosts.down()


def run(root: Path, samples: int, warmup: int, latency_ms: float) -> dict[str, Any]:
    """Both clusters up at once, their restores interleaved round by round, so that
    drift in the machine's load hits both alike (the idle cluster's processes
    wait on their sockets)."""
    t_start = time.perf_counter()
    clusters: dict[int, _Cluster] = {}
    bare: dict[int, _BareHosts] = {}
    try:
        for n in (4, 8):
            log(f"{n} hosts")
            clusters[n] = _Cluster(root, n, latency_ms)
            bare[n] = _BareHosts(n, latency_ms)
        log(f"{warmup} warm-up and {samples} timed rounds")
        for k in range(warmup + samples):
            order = (4, 8) if k % 2 == 0 else (8, 4)  # neither always follows the other
            for n in order:
                clusters[n].restore(keep=k >= warmup)
                clusters[n].two_calls(keep=k >= warmup)
                bare[n].two_calls(keep=k >= warmup)
        by_hosts = {n: c.result() | {"bare_grpc_two_calls_median_s":
                                     statistics.median(bare[n].seconds)}
                    for n, c in clusters.items()}
    finally:
        for c in clusters.values():
            c.close()
        for b in bare.values():
            b.close()
    ratio = by_hosts[8]["median_s"] / by_hosts[4]["median_s"]
    calls = by_hosts[8]["two_calls_median_s"] / by_hosts[4]["two_calls_median_s"]
    floor = (by_hosts[8]["bare_grpc_two_calls_median_s"]
             / by_hosts[4]["bare_grpc_two_calls_median_s"])
    beyond = {n: by_hosts[n]["median_s"] - by_hosts[n]["two_calls_median_s"] for n in (4, 8)}
    return {"dispatch": "colocated",
            "config": {"samples": samples, "warmup": warmup,
                       "colocated_call_latency_ms": latency_ms, "devices": len(jax.devices()),
                       "cpus": os.cpu_count(), "loadavg_1min": os.getloadavg()[0],
                       "rounds": "interleaved: one restore and two no-op calls of each cluster "
                                 "a round"},
            "hosts_4": by_hosts[4], "hosts_8": by_hosts[8],
            "ratios": {"restore_8_over_4": ratio,
                       # the reference: two no-op calls, 8 hosts over 4
                       "calls_8_over_4": calls,
                       # the floor: two calls to bare gRPC hosts (the same latency,
                       # no work), 8 over 4: what gRPC and shared cores alone make
                       "bare_grpc_8_over_4": floor,
                       # what a restore adds to its two calls, 8 hosts over 4
                       "beyond_calls_8_over_4": beyond[8] / beyond[4]},
            "targets": {"restore_8_over_4": f"<= {TARGET}"},
            "meets_targets": {"restore_8_over_4": ratio <= TARGET},
            "wall_s": time.perf_counter() - t_start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--samples", type=int, default=31)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--call-latency-ms", type=float, default=3.0,
                   help="the sidecars' --colocated-call-latency-ms (default 3)")
    args = p.parse_args(argv)
    return run_in_scratch("mtc-bench-hosts-", lambda root: run(root, args.samples, args.warmup,
                                                               args.call_latency_ms))


if __name__ == "__main__":
    sys.exit(main())
