"""Real replicator processes for tests: start, wait until serving, SIGKILL, restart."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from mtc.proto import replicator_pb2 as pb
from mtc_sidecar.replicator.client import PeerClient
from mtc_sidecar.replicator.healthcheck import check
from mtc_sidecar.replicator.security import Credentials
from mtc_trainer.cluster import free_ports

if TYPE_CHECKING:
    from jax.sharding import Mesh


@dataclasses.dataclass
class Cluster:
    """``n`` replicators over ``<base>/host-<rank>``, ``per_slice`` hosts per slice."""

    base: Path
    n: int
    per_slice: int
    extra: tuple[str, ...] = ()
    creds: Credentials = dataclasses.field(default_factory=Credentials)
    metrics: bool = False  # serve Prometheus metrics on self.metrics_ports
    # Orbax mode: no --rank; each replicator learns its rank from the replicator.yaml
    # Orbax's client writes, and serves only after that (use launch, not start).
    orbax: bool = False
    # Environment variables added to every replicator's (STORAGE_EMULATOR_HOST, ...).
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        ports = free_ports(self.n * (2 if self.metrics else 1))
        self.ports = ports[:self.n]
        self.metrics_ports = ports[self.n:]
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs = self.base / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def root(self, rank: int) -> Path:
        return self.base / f"host-{rank}"

    def launch(self, rank: int, *more: str) -> None:
        """Start replicator ``rank`` without waiting for it to serve."""
        log = open(self.logs / f"replicator-{rank}.log", "ab")
        metrics = ("--metrics-port", str(self.metrics_ports[rank])) if self.metrics else ()
        cmd = [sys.executable, "-m", "mtc_sidecar.replicator.main",
               "--local-dir", str(self.root(rank)),
               "--listen", self.addrs[rank], "--nodes", ",".join(self.addrs),
               *(() if self.orbax else ("--rank", str(rank),
                                        "--nodes-per-slice", str(self.per_slice))),
               "--poll-seconds", "0.05", *metrics, *self.extra, *more]
        self.procs[rank] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **self.env} if self.env else None)
        log.close()

    def start(self, rank: int, *more: str) -> None:
        self.launch(rank, *more)
        self.wait_serving(rank)

    def start_all(self) -> None:
        for r in range(self.n):
            self.launch(r)
        for r in range(self.n):
            self.wait_serving(r)

    def alive(self, rank: int) -> bool:
        proc = self.procs.get(rank)
        return proc is not None and proc.poll() is None

    def log_text(self, rank: int) -> str:
        path = self.logs / f"replicator-{rank}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def scrape(self, rank: int) -> dict[str, float]:
        """Rank's Prometheus samples: ``name`` or ``name{label=value,...}`` -> value."""
        url = f"http://127.0.0.1:{self.metrics_ports[rank]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_serving(self, rank: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[rank]
            if proc.poll() is not None:
                raise RuntimeError(f"replicator {rank} exited {proc.returncode}: "
                                   f"{(self.logs / f'replicator-{rank}.log').read_text()[-2000:]}")
            try:
                if check(self.addrs[rank], creds=self.creds, timeout_s=1.0) == "SERVING":
                    return
            except grpc.RpcError:
                time.sleep(0.1)
        raise TimeoutError(f"replicator {rank} not serving after {timeout}s")

    def kill(self, rank: int) -> None:
        proc = self.procs.pop(rank, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def stop_all(self) -> None:
        for r in list(self.procs):
            self.kill(r)

    def client(self, rank: int) -> PeerClient:
        return PeerClient(self.addrs[rank], self.creds, rank=rank)

    def inventory(self, rank: int) -> pb.Inventory:
        c = self.client(rank)
        try:
            return c.call("GetInventory", pb.InventoryRequest())
        finally:
            c.close()

    def held(self) -> set[tuple[int, int, int]]:
        """(holder, origin, step) for every complete copy on every running replicator."""
        out = set()
        for r in range(self.n):
            if self.alive(r):
                out |= {(r, c.origin_rank, c.step) for c in self.inventory(r).copies}
        return out

    def wait_held(self, want: set[tuple[int, int, int]], timeout: float = 60.0) -> None:
        """Until every (holder, origin, step) in ``want`` is held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if want <= self.held():
                return
            time.sleep(0.05)
        raise TimeoutError(f"missing after {timeout}s: {sorted(want - self.held())}")

    def wait_replicated(self, step: int, timeout: float = 60.0) -> None:
        """Until every rank's step is held by every rank's targets (replicas=1, 2 slices)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = set()
            for r in range(self.n):
                if r in self.procs:
                    held |= {(r, c.origin_rank, c.step) for c in self.inventory(r).copies}
            want = {((o + self.per_slice) % self.n, o, step) for o in range(self.n)}
            if want <= held:
                return
            time.sleep(0.1)
        raise TimeoutError(f"step {step} not replicated in {timeout}s")


def env_with_repo() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def commit_raw_step(root: Path, step: int, files: dict[str, bytes]) -> Path:
    """Commit an opaque step (no manifest) the way a client does: write, then rename."""
    tmp = root / f"{step}.test-tmp"
    for rel, data in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    final = root / str(step)
    os.rename(tmp, final)
    return final


def new_cluster(clusters: list[Cluster], base: Path, n: int, per_slice: int,
                **kw: Any) -> Cluster:
    """A cluster registered with the ``clusters`` fixture, which kills it at the end."""
    c = Cluster(base, n, per_slice, **kw)
    clusters.append(c)
    return c


def make_state(mesh: Mesh, scale: float) -> dict[str, Any]:
    """About 2 MiB: ``dp`` is data-parallel (the same shard files in both slices),
    ``own`` is split over every device (unique to each host)."""
    import jax  # here: the process harness above does not need JAX
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    dp = jnp.arange(1024 * 256, dtype=jnp.float32).reshape(1024, 256) * scale
    own = jnp.arange(1024 * 256, dtype=jnp.float32).reshape(1024, 256) * -scale
    return {"dp": jax.device_put(dp, NamedSharding(mesh, P("model"))),
            "own": jax.device_put(own, NamedSharding(mesh, P(("replica", "model")))),
            "n": int(scale)}


def assert_state_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    import numpy as np

    for k in ("dp", "own"):
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
        assert got[k].sharding == want[k].sharding
    assert got["n"] == want["n"]
