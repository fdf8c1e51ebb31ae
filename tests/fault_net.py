"""What the network-fault tests share (``tests/test_network_faults.py``): the
isolated cluster (:class:`Net`: four hosts in network namespaces, their
replicators' addresses, the emulated bucket and the controller's options), the
states they save and the exact check of a restore, what a process is doing read
from /proc, and bounded waits and triggers."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from replicators import env_with_repo, scrape, wait_healthy

import mtc
from mtc.credentials import Credentials
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.backend import open_backend
from mtc.sidecar.backup.job import BackupStore
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.testing.isolation import Hosts
from mtc.testing.replicas import HostReplicators

SLICES = [0, 0, 1, 1]
PORT = 7000  # inside namespaces this module made: nothing else listens there
METRICS_PORT = 7001  # each replicator's Prometheus metrics, at its host's address
TIMEOUT_S = 6.0  # the restore's and the agreement's deadline
# The restore deadline of a restore the test expects to fail (a partition, a stopped
# peer): that it ends there, typed, is what is tested, and every second of it is
# waited out; restores expected to succeed keep TIMEOUT_S.
FAIL_TIMEOUT_S = 2.5
# A call whose peer's link is cut fails within 1.5 times this (the replicators'
# --peer-keepalive-seconds; 10 by default): the cut tests wait it out.
KEEPALIVE_S = 2.0
SLACK_S = 15.0  # what a bounded wait may take beyond its deadline on a loaded machine
BUCKET = "mtc-net"


# -- the cluster ------------------------------------------------------------------------


class Net:
    """The hosts, their replicators' addresses, the emulator and the controller's options."""

    def __init__(self, hosts: Hosts, emulator_url: str) -> None:
        self.hosts = hosts
        self.emulator_url = emulator_url
        self.addrs = [hosts.replicator_address(i, PORT) for i in range(4)]
        self.token = hosts.token()
        self.env = env_with_repo() | {"STORAGE_EMULATOR_HOST": emulator_url}

    def start_replicator(self, i: int) -> None:
        h = self.hosts
        h.start_replicator(i, [
            "--local-dir", str(h.hosts[i].root), "--listen", self.addrs[i],
            "--nodes", ",".join(self.addrs), "--rank", str(i), "--nodes-per-slice", "2",
            "--poll-seconds", "0.05", "--agreement-timeout-seconds", str(TIMEOUT_S),
            "--peer-keepalive-seconds", str(KEEPALIVE_S),
            "--metrics-port", str(METRICS_PORT), "--metrics-address", h.hosts[i].address,
            "--backup", f"gs://{BUCKET}/b", "--backup-interval-minutes", "100000",
            "--backup-retry-seconds", "20"], env=self.env)

    def wait_serving(self, i: int) -> None:
        h, proc = self.hosts, self.hosts.hosts[i].replicator
        assert proc is not None
        wait_healthy(self.addrs[i], lambda: proc.poll() is None, None,
                     lambda: h.log_tail(i, "replicator"), 60.0)

    def options(self, restore_timeout_s: float = TIMEOUT_S) -> mtc.Options:
        return mtc.Options(simulated_hosts=4, hosts_per_slice=2,
                           sidecars=tuple(h.sidecar_address for h in self.hosts.hosts),
                           replicators=tuple(self.addrs), replicator_token=self.token,
                           restore_timeout_s=restore_timeout_s)

    def client(self, i: int) -> PeerClient:
        return PeerClient(self.addrs[i], Credentials(token=self.token), rank=i, deadline_s=5.0)

    def inventory(self, i: int) -> pb.Inventory:
        c = self.client(i)
        try:
            return c.call("GetInventory", pb.InventoryRequest(), attempts=1)
        finally:
            c.close()

    def restores_waiting(self, i: int) -> float:
        """Restores host ``i``'s replicator is waiting on a decision for (its
        ``mtc_restores_waiting``): one a test gave up on still waits out its deadline."""
        return scrape(f"http://{self.hosts.hosts[i].address}:{METRICS_PORT}/metrics") \
            .get("mtc_restores_waiting", 0.0)

    def held(self, i: int) -> set[tuple[int, int]]:
        return {(c.origin_rank, c.step) for c in self.inventory(i).copies}

    def log(self, i: int) -> str:
        return self.hosts.log_tail(i, "replicator", 1 << 22)

    def pid(self, i: int) -> int:
        p = self.hosts.hosts[i].replicator
        assert p is not None
        return p.pid

    def backups(self) -> BackupStore:
        """The bucket, read by this process (the emulator is in its namespace)."""
        old = os.environ.get("STORAGE_EMULATOR_HOST")
        os.environ["STORAGE_EMULATOR_HOST"] = self.emulator_url
        try:
            return BackupStore(open_backend(f"gs://{BUCKET}/b", retry_deadline_s=10))
        finally:
            if old is None:
                del os.environ["STORAGE_EMULATOR_HOST"]
            else:
                os.environ["STORAGE_EMULATOR_HOST"] = old

    def wait_replicated(self, step: int, timeout_s: float = 60.0) -> None:
        """Until every host's data of ``step`` is on its peer (host i <-> i +- 2): the
        harness's wait (a host cut off or restarting is asked again)."""
        HostReplicators(self.hosts, self.addrs, 2).wait_replicated(step, timeout_s)


def big_state(mesh: Mesh, step: int) -> dict[str, Any]:
    """48 MiB a host (two 24 MiB shards, different on every host): copies and
    uploads that take long enough to be cut midway."""
    w = np.arange(24576 * 2048, dtype=np.float32).reshape(24576, 2048) + step
    return {"w": jax.device_put(w, NamedSharding(mesh, PartitionSpec(("replica", "model")))),
            "step": step}


def small_state(mesh: Mesh, step: int) -> dict[str, Any]:
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) * (step + 1)
    dp = np.arange(16, dtype=np.int32) + step
    return {"w": jax.device_put(w, NamedSharding(mesh, PartitionSpec(("replica", "model")))),
            "dp": jax.device_put(dp, NamedSharding(mesh, PartitionSpec())), "step": step}


def assert_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert int(got["step"]) == int(want["step"])
    for k in want:
        if k != "step":
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


# -- what a process is doing, from /proc (this process is root) -----------------------


def open_positions(pid: int, needle: str) -> list[int]:
    """File offsets of ``pid``'s open files whose path contains ``needle``."""
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            if needle not in os.readlink(f"/proc/{pid}/fd/{fd}"):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                out += [int(line.split()[1]) for line in f if line.startswith("pos:")]
        except (OSError, ValueError, IndexError):
            continue
    return out


def queued_to(pid: int, address: str, port: int) -> int:
    """Bytes ``pid``'s namespace has queued (sent, not acknowledged) on TCP
    connections to ``address:port``."""
    want = "".join(f"{int(b):02X}" for b in reversed(address.split("."))) + f":{port:04X}"
    total = 0
    try:
        with open(f"/proc/{pid}/net/tcp") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[2] == want:
                    total += int(cols[4].split(":")[0], 16)
    except (OSError, StopIteration, ValueError, IndexError):
        return 0
    return total


def when(condition: Callable[[], bool], then: Callable[[], None], timeout_s: float,
         stop: threading.Event | None = None) -> tuple[threading.Thread, threading.Event]:
    """On a thread: poll ``condition`` (bounded by ``timeout_s``, or until ``stop`` is
    set) and call ``then`` the moment it holds; the event is set once ``then`` ran.
    Joined by the caller."""
    fired = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
            if condition():
                then()
                fired.set()
                return
            time.sleep(0.001)

    t = threading.Thread(target=watch, name="fault-trigger")
    t.start()
    return t, fired
