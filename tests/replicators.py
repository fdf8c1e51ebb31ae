"""Real replicator and sidecar processes for tests: start, wait until serving, SIGKILL,
restart.

Each simulated host of a :class:`Cluster` is its own processes: its replicator
and, once a test asks for :meth:`Cluster.options`, its sidecar (``python -m
mtc.sidecar.host.main``, started through :class:`mtc.testing.isolation.Hosts` in
``"processes"`` mode), the one process through which a controller's
``CheckpointManager`` reaches the host's RAM disk. The controller never reads a
host's root (the ``ramdisk`` fixture's seam audit checks it). The test harness
does: it plays the host (an operator, bad memory, a lost machine), committing
raw steps, flipping bytes and wiping roots to assert outcomes, which is why the
roots stay plain folders this process can see (no private mount namespaces).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from mtc.credentials import Credentials
from mtc.manifest import MANIFEST_NAME, LeafEntry, Manifest, ShardEntry
from mtc.ports import free_ports
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.memory_cluster import commit_mtc_step, commit_raw_step
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.sidecar.storage.checksum import file_crc
from mtc.testing.isolation import Hosts, with_checkout
from mtc.testing.replicas import Replicators, wait_healthy

if TYPE_CHECKING:
    from jax.sharding import Mesh

    import mtc


@dataclasses.dataclass
class Cluster(Replicators):
    """``n`` replicators over ``<base>/host-<rank>``, ``per_slice`` hosts per slice, and
    (from the first :meth:`options`) a sidecar per host over the same root; the
    sidecars' shared-memory areas and logs are under ``<base>/hosts/``. What they
    report and the waits on it (copies held, loop passes, a metric's value) are
    :class:`~mtc.testing.replicas.Replicators`', as for the
    in-memory cluster; this adds the processes (start, SIGKILL, restart)."""

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
    # Arguments of one rank's replicator only (its own certificate, with mutual TLS).
    rank_args: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # The background scrub (on by default in a deployment) is off here unless asked
    # for: tests that damage a file check which reader finds it (a load, a copy's
    # offer), and a scrub finding it first would race them. tests/test_scrub.py
    # runs it, each copy round again at once (``scrub_interval_s``).
    scrub: bool = False
    scrub_interval_s: float | None = None  # None: the replicators' default

    def __post_init__(self) -> None:
        ports = free_ports(self.n * (2 if self.metrics else 1))
        self.ports = ports[:self.n]
        self.metrics_ports = ports[self.n:]
        self.addrs = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs = self.base / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._hosts: Hosts | None = None

    def root(self, rank: int) -> Path:
        return self.base / f"host-{rank}"

    def commit(self, rank: int, step: int, files: dict[str, bytes]) -> dict[str, bytes]:
        """Commit ``files`` as rank ``rank``'s step: with an mtc manifest naming it, or
        opaque for Orbax's client (:attr:`orbax`). Returns every file committed."""
        if self.orbax:
            commit_raw_step(self.root(rank), step, files)
            return dict(files)
        return commit_mtc_step(self.root(rank), step, files, host=rank, num_hosts=self.n,
                               slice_of_host=rank // self.per_slice)

    # -- sidecars: the controller's only way to a host's RAM disk ----------------------

    @property
    def hosts(self) -> Hosts:
        """The hosts' sidecars (none runs before :meth:`start_sidecars`)."""
        if self._hosts is None:
            hs = Hosts(self.base / "hosts", self.n, isolation="processes")
            for h in hs.hosts:  # the root the replicator and the test see
                h.root.rmdir()
                h.root = self.root(h.index)
            if self.creds.token:  # the sidecars take the replicators' token
                (hs.base / "peer-token").write_text(self.creds.token + "\n")
            self._hosts = hs
        return self._hosts

    def sidecar_alive(self, rank: int) -> bool:
        proc = self.hosts.hosts[rank].sidecar
        return proc is not None and proc.poll() is None

    def start_sidecars(self) -> None:
        """Start every host's sidecar that is not running, all at once; until each serves."""
        import seam_audit  # tests/: the conftest's audit

        # From here the controller must not run host-side code in this process either.
        seam_audit.sidecars_only(self.base)
        slices = [r // self.per_slice for r in range(self.n)]
        down = [r for r in range(self.n) if not self.sidecar_alive(r)]
        # With mutual TLS the sidecars take certificates too (the same credentials).
        tls = (("--tls-cert", str(self.creds.tls_cert), "--tls-key", str(self.creds.tls_key),
                "--tls-ca", str(self.creds.tls_ca)) if self.creds.tls else ())
        for r in down:
            self.hosts.start_sidecar(r, slices, env=env_with_repo(), wait=False, extra=tls)
        for r in down:
            self.hosts.wait_sidecar(r)

    def kill_sidecar(self, rank: int) -> None:
        """SIGKILL the sidecar of host ``rank`` if one runs (:meth:`options` restarts it)."""
        if self._hosts is not None:
            self._hosts.kill_sidecar(rank)

    def lose_host(self, rank: int) -> None:
        """Host ``rank`` is gone: its replicator and sidecar SIGKILLed, its RAM disk wiped."""
        self.kill(rank)
        self.kill_sidecar(rank)
        shutil.rmtree(self.root(rank))

    def options(self, *, replicators: bool = False, **kw: Any) -> mtc.Options:
        """Options of a controller that reaches every host through its sidecar (started
        here when not running) and, with ``replicators``, the replicators too."""
        import mtc  # here: the process harness above does not need JAX

        self.start_sidecars()
        kw = {"replicator_token": self.hosts.token(), **kw}  # the sidecars require it
        if replicators:
            kw = {"replicators": tuple(self.addrs), **kw}
        return mtc.Options(simulated_hosts=self.n, hosts_per_slice=self.per_slice,
                           dispatch="process",
                           sidecars=tuple(h.sidecar_address for h in self.hosts.hosts), **kw)

    def sidecar_log(self, rank: int) -> str:
        return self._hosts.log_tail(rank, "sidecar") if self._hosts is not None else ""

    def launch(self, rank: int, *more: str) -> None:
        """Start replicator ``rank`` without waiting for it to serve."""
        log = open(self.logs / f"replicator-{rank}.log", "ab")
        metrics = ("--metrics-port", str(self.metrics_ports[rank])) if self.metrics else ()
        cmd = [sys.executable, "-m", "mtc.sidecar.replicator.main",
               "--local-dir", str(self.root(rank)),
               "--listen", self.addrs[rank], "--nodes", ",".join(self.addrs),
               *(() if self.orbax else ("--rank", str(rank),
                                        "--nodes-per-slice", str(self.per_slice))),
               "--poll-seconds", "0.05", *metrics,
               *(() if self.scrub else ("--scrub-mib-per-second", "0")),
               *(() if self.scrub_interval_s is None
                 else ("--scrub-interval-seconds", str(self.scrub_interval_s))),
               *self.extra, *self.rank_args.get(rank, ()), *more]
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
        """Rank's Prometheus samples: ``name`` or ``name{label=value,...}`` -> value
        (needs ``metrics``: the loop-pass counter and every sample a wait reads)."""
        assert self.metrics, "Cluster(metrics=True) serves the samples"
        return scrape(f"http://127.0.0.1:{self.metrics_ports[rank]}/metrics")

    def wait_serving(self, rank: int, timeout: float = 30.0) -> None:
        self.wait_health(rank, "SERVING", timeout)

    def wait_health(self, rank: int, want: str, timeout: float = 30.0) -> None:
        """Until rank's health check answers ``want`` (its process must stay up)."""
        wait_healthy(self.addrs[rank], lambda: self.procs[rank].poll() is None, self.creds,
                     lambda: self.log_text(rank)[-2000:], timeout, want=want)

    def kill(self, rank: int) -> None:
        proc = self.procs.pop(rank, None)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def stop_all(self) -> None:
        """SIGKILL every replicator and sidecar (their logs stay)."""
        for r in list(self.procs):
            self.kill(r)
        for r in range(self.n):
            self.kill_sidecar(r)

    def client(self, rank: int) -> PeerClient:
        return PeerClient(self.addrs[rank], self.creds, rank=rank)

    def inventory(self, rank: int) -> pb.Inventory:
        c = self.client(rank)
        try:
            return c.call("GetInventory", pb.InventoryRequest())
        finally:
            c.close()


def scrape(url: str) -> dict[str, float]:
    """Prometheus samples at ``url``: ``name`` or ``name{label=value,...}`` -> value."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def env_with_repo() -> dict[str, str]:
    """The environment for the harness's children: the checkout after whatever the
    environment names (the local cluster's rule: an installed mtc wins)."""
    return with_checkout(dict(os.environ))


def write_mtc_manifest(folder: Path, step: int, *, host: int, num_hosts: int,
                       slice_of_host: int = 0) -> None:
    """Write the mtc manifest of the files already in ``folder`` (each one opaque
    uint8 leaf, its CRC32C read from it), last, as mtc's sidecar writes a step's:
    a folder of large files committed as an mtc step without holding its bytes."""
    leaves = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        size, value = file_crc(path)
        leaves.append(LeafEntry(path=rel, keys=(("d", rel),), kind="numpy", shape=(size,),
                                dtype="uint8",
                                shards=(ShardEntry(index=((0, size),), file=rel, nbytes=size,
                                                   crc32c=value),)))
    manifest = Manifest(step=step, host=host, slice=slice_of_host, num_hosts=num_hosts,
                        leaves=tuple(leaves))
    (folder / MANIFEST_NAME).write_bytes(manifest.to_bytes())


def new_cluster(clusters: list[Cluster], base: Path, n: int, per_slice: int,
                **kw: Any) -> Cluster:
    """A cluster registered with the ``clusters`` fixture, which kills it at the end."""
    c = Cluster(base, n, per_slice, **kw)
    clusters.append(c)
    return c


def flip(path: Path, *, silent: bool = False) -> None:
    """Flip one bit in place; ``silent`` keeps the mtime (damage no write explains)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        b = f.read(1)[0]
        f.seek(st.st_size // 2)
        f.write(bytes([b ^ 0x10]))
    if silent:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


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


@contextmanager
def sidecar_hosts(name: str, slices: list[int], **kw: Any) -> Iterator[Hosts]:
    """Isolated hosts under /dev/shm with a sidecar each (``kw`` for :class:`Hosts`);
    taken down after, their sidecars' logs printed for a failure's report."""
    hs = Hosts(Path("/dev/shm") / f"mtc-{name}-{uuid.uuid4().hex[:8]}", len(slices), **kw)
    env = env_with_repo()
    try:
        # All at once, as a job's hosts start: a colocated host's sidecar and the
        # process beside it start JAX (seconds, mostly waiting on each other).
        for i in range(len(slices)):
            hs.start_sidecar(i, slices, env=env, wait=False)
        for i in range(len(slices)):
            hs.wait_sidecar(i)
        yield hs
    finally:
        tails = {i: hs.log_tail(i, "sidecar") for i in range(len(slices))}
        hs.down()
        for i, t in tails.items():
            print(f"--- sidecar {i} ---\n{t}")


def colocated_options(hs: Hosts) -> mtc.Options:
    """Options of a controller whose programs run in ``hs``' sidecars (4 hosts, 2 a
    slice): colocated Python, as on Pathways."""
    import mtc  # here: the process harness above does not need JAX

    return mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="colocated",
                       replicator_token=hs.token(),
                       sidecars=tuple(h.sidecar_address for h in hs.hosts))


def save_two_and_restore(mgr: Any, state: dict[str, Any]) -> tuple[Any, Any]:
    """Save ``state`` as steps 1 and 2, then restore step 2 onto its own layout and,
    with its ``w`` (8 x 16 float32), onto half the devices in another layout (pieces
    from several hosts). Returns both restores."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert mgr.save(1, state)
    assert mgr.save(2, state)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1, 2]
    back = mgr.restore(2, target=state)
    half = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    other = {k: None for k in state} | {"w": jax.ShapeDtypeStruct(
        (8, 16), np.float32, sharding=NamedSharding(half, PartitionSpec("b", "a")))}
    return back, mgr.restore(2, target=other)
