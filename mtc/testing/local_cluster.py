"""The local cluster of simulated hosts that share nothing (``mtc-cluster``, the demos,
:class:`mtc.testing.TestCluster`).

Every simulated host is its own processes (:mod:`mtc.testing.isolation`): a
sidecar (``python -m mtc.sidecar.host.main``, the colocated-Python sidecar's
part) that alone, with the host's replicator, sees the host's RAM disk, and one
real ``mtc-replicator`` (peer copies in the other slice, backups to
``<base>/backup``, or with ``backup="gcs-emulator"`` to a bucket in a
fake-gcs-server it starts). With root each host is a network namespace with an
address on a bridge and a private tmpfs RAM disk that no other process sees;
otherwise separate processes over private folders. The trainer reaches a host
through its sidecar's gRPC address and its shared-memory area, and the
replicators over the network, never through a host's folder.

:meth:`LocalCluster.up` writes the hosts (addresses, process ids, namespaces) to
``<base>/cluster.json``; :meth:`LocalCluster.down` reads that file, SIGKILLs every
host's processes (the way a host dies), removes the namespaces, stops the emulator
and removes the folder. A training process finds the cluster through the same file
and uses :class:`LocalCluster` to inject host failures: SIGKILL a host's processes
(its RAM disk goes with them), start it again empty. Here, not in the demo package
(``mtc.trainer.cluster`` is its command line), so that mtc.testing depends on mtc
alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any

from mtc.ports import free_ports
from mtc.testing import gcs_emulator
from mtc.testing.isolation import Hosts, with_checkout
from mtc.testing.replicas import wait_healthy

REPO = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) holding mtc/
STATE = "cluster.json"
GCS_EMULATOR = "gcs-emulator"  # --backup value: start fake-gcs-server, back up there
EMULATOR_BUCKET = "mtc-local"
PORT_FILE_CHECK_S = 0.005  # a stat of a local file: cheap enough to do this often
RAMDISK_BYTES = 4 << 30  # each host's tmpfs: a limit, not an allocation (bench/recovery.py
# at 1 GiB: two own steps and two peer copies of 512 MiB each, and one arriving)


def default_base(name: str) -> Path:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return root / f"mtc-cluster-{name}"


def _env() -> dict[str, str]:
    return with_checkout(dict(os.environ))


@dataclasses.dataclass
class LocalCluster:
    """Isolated hosts under ``<base>/hosts``; persisted in ``<base>/cluster.json``.

    ``addresses`` are the replicators'; :meth:`sidecars` the sidecars'. A host's
    RAM disk, :meth:`root`, is a path only its own processes can read."""

    base: Path
    slices: int
    hosts_per_slice: int
    addresses: list[str]
    machine: dict[str, Any]  # the hosts (mtc.testing.isolation.Hosts.to_json)
    backup: str
    poll_seconds: float = 0.2
    straggler_wait_seconds: float = 2.0
    # The replicators' --nice. The simulated hosts share this machine's cores with
    # the trainer, whose CPU devices stand in for accelerators: the replicators'
    # work after each save (checks, dedup, copies) slows the next step, which on
    # a real host has CPUs the accelerator does not
    # need. Niced (19) it runs in the trainer's gaps instead, but a busy trainer
    # then starves it: a save reaches its peer late, and a host lost meanwhile
    # loses more steps. 0 keeps the peer tier's lag honest; bench/goodput.py
    # measures both (--replicator-nice).
    replicator_nice: int = 0
    emulator: dict[str, Any] | None = None  # the GCS emulator backed up to: url, pid
    # The replicators back up every this many steps (None: hourly, in effect only
    # when asked: ``mtc backup``, a restore that needs the backup).
    backup_every_steps: int | None = None
    _hosts: Hosts | None = dataclasses.field(default=None, repr=False, compare=False)
    _channels: dict[int, Any] = dataclasses.field(default_factory=dict, repr=False,
                                                  compare=False)

    @property
    def num_hosts(self) -> int:
        return self.slices * self.hosts_per_slice

    @property
    def hosts(self) -> Hosts:
        if self._hosts is None:
            self._hosts = Hosts.from_json(self.machine)
        return self._hosts

    @property
    def isolation(self) -> str:
        return self.hosts.isolation

    @property
    def pids(self) -> dict[int, int]:
        """The replicators' process ids, by host."""
        return {h.index: h.replicator_pid for h in self.hosts.hosts
                if h.replicator_pid is not None}

    def root(self, rank: int) -> Path:
        """``rank``'s RAM disk, as its own processes see it (with namespaces an
        empty mount point to everyone else)."""
        return self.hosts.hosts[rank].root

    def sidecars(self, hosts: list[int] | None = None) -> tuple[str, ...]:
        """The sidecars' addresses of ``hosts`` (default: all), in that order."""
        return tuple(self.hosts.hosts[h].sidecar_address
                     for h in (range(self.num_hosts) if hosts is None else hosts))

    def token(self) -> str:
        """The replicators' shared token (they listen off loopback)."""
        return self.hosts.token()

    def token_file(self) -> Path:
        return self.hosts.token_file

    def describe(self) -> dict[str, Any]:
        """How the hosts are kept apart: ``isolation`` and per host its address and pids."""
        return self.hosts.describe()

    def env(self) -> dict[str, str]:
        """The hosts' processes' environment (the emulator's address when backing up to it)."""
        env = _env()
        if self.emulator is not None:
            env["STORAGE_EMULATOR_HOST"] = self.emulator["url"]
        return env

    def compile_cache_dir(self) -> Path:
        """Where trainers on this cluster keep JAX's persistent compilation cache by default."""
        return self.base / "compile-cache"

    def port_file(self, rank: int) -> Path:
        return self.base / "logs" / f"replicator-{rank}.port"

    def log_text(self, rank: int, what: str = "replicator") -> str:
        return self.hosts.log_tail(rank, what, 1 << 20)

    def hosts_of_slice(self, s: int) -> list[int]:
        return list(range(s * self.hosts_per_slice, (s + 1) * self.hosts_per_slice))

    def slice_list(self) -> list[int]:
        return [r // self.hosts_per_slice for r in range(self.num_hosts)]

    # -- persistence ----------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if not f.name.startswith("_")}
        d["base"] = str(self.base)
        d["machine"] = self.hosts.to_json()
        return d

    def save(self) -> None:
        # A temporary name of each writer's own: the trainer's host-return thread
        # saves too. (Not mtc.layout's: this file is the harness's, not a host's.)
        tmp = self.base / f"{STATE}.tmp-{os.getpid()}-{threading.get_ident()}"
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        tmp.replace(self.base / STATE)

    @classmethod
    def load(cls, base: Path) -> LocalCluster:
        d = json.loads((base / STATE).read_text())
        d["base"] = Path(d["base"])
        return cls(**d)

    # -- a host's processes -----------------------------------------------------------

    def start_sidecar(self, rank: int, *, wait: bool = True) -> None:
        """Start ``rank``'s sidecar: a new network and mount namespace with an empty
        RAM disk, where the replicator then joins it."""
        self.hosts.start_sidecar(rank, self.slice_list(), env=self.env(), wait=wait)
        self.save()  # its pid: whoever takes the cluster down reads it from the file

    def start_hosts(self, ranks: list[int]) -> None:
        """Start the hosts ``ranks`` (all their processes gone) and wait until they
        serve: each sidecar, then its replicator beside it as soon as the sidecar
        has made the host's namespaces (while a colocated runtime still starts, as
        a pod's containers start together), then every sidecar and replicator
        serving."""
        for r in ranks:
            self.start_sidecar(r, wait=False)
        for r in ranks:
            self.hosts.wait_started(r)
            self.launch(r)
        for r in ranks:
            self.hosts.wait_sidecar(r)
        self.save()
        for r in ranks:
            self.wait_serving(r)

    def launch(self, rank: int) -> None:
        """Start ``rank``'s replicator in its host's namespaces (its own session: it
        outlives whoever started it)."""
        (self.base / "logs").mkdir(parents=True, exist_ok=True)
        self.port_file(rank).unlink(missing_ok=True)
        self.hosts.start_replicator(rank, [
            "--local-dir", str(self.root(rank)), "--listen", self.addresses[rank],
            "--nodes", ",".join(self.addresses), "--rank", str(rank),
            "--nodes-per-slice", str(self.hosts_per_slice), "--replicas", "1",
            "--backup", self.backup,
            *(("--backup-interval-steps", str(self.backup_every_steps))
              if self.backup_every_steps else ("--backup-interval-minutes", "60")),
            "--poll-seconds", str(self.poll_seconds),
            "--straggler-wait-seconds", str(self.straggler_wait_seconds),
            "--nice", str(self.replicator_nice),
            "--port-file", str(self.port_file(rank))], env=self.env())
        self.save()

    def wait_serving(self, rank: int, timeout: float = 30.0) -> None:
        """Until ``rank``'s replicator serves: it writes its port file once its
        server is up (watched with a stat every few milliseconds, no RPC), then
        one health check confirms."""
        wait_healthy(self.addresses[rank], lambda: self.alive(rank), None,
                     lambda: self.log_text(rank)[-2000:], timeout,
                     ready=self.port_file(rank).exists, poll_s=PORT_FILE_CHECK_S)

    def alive(self, rank: int) -> bool:
        """Whether ``rank``'s replicator runs."""
        return self.hosts.replicator_alive(rank)

    def kill(self, rank: int) -> None:
        """SIGKILL ``rank``'s replicator: no handler runs, nothing is flushed."""
        self.hosts.kill_replicator(rank)

    def lose_host(self, rank: int) -> None:
        """SIGKILL every process of ``rank``: with namespaces its RAM disk (a tmpfs
        of its mount namespace) is gone with the last of them; without, its folder
        is emptied (:meth:`Hosts.lose`)."""
        self._close_channel(rank)
        self.hosts.lose(rank)
        self.save()

    def restart_host(self, rank: int, *, wait: bool = True) -> None:
        """Bring ``rank`` back on its address: a sidecar over a new, empty RAM disk
        and a new replicator."""
        if self.hosts.hosts[rank].sidecar_pid is not None:
            self.lose_host(rank)
        self.root(rank).mkdir(parents=True, exist_ok=True)
        self.start_sidecar(rank)
        self.launch(rank)
        self.save()
        if wait:
            self.wait_serving(rank)

    def inspect(self, rank: int, timeout: float = 5.0) -> dict[str, Any] | None:
        """What ``rank``'s RAM disk holds, asked of its sidecar (the fault injector's
        only view of it): ``committed``, ``writing`` steps and ``replicas`` (origin
        rank -> committed peer copies). None when the host is down."""
        import grpc

        from mtc.contract import decode_reply, encode_request
        from mtc.credentials import TOKEN_HEADER
        from mtc.errors import MtcError

        if self.hosts.hosts[rank].sidecar_pid is None:
            return None
        stub = self._channels.get(rank)
        if stub is None:
            channel = grpc.insecure_channel(self.hosts.hosts[rank].sidecar_address)
            stub = (channel, channel.unary_unary("/mtc.Host/Call", request_serializer=None,
                                                 response_deserializer=None))
            self._channels[rank] = stub
        try:
            reply = decode_reply(stub[1](encode_request("inspect", [rank]), timeout=timeout,
                                         metadata=[(TOKEN_HEADER, self.token())]))
        except (grpc.RpcError, MtcError):
            return None
        return reply if isinstance(reply, dict) else None

    def _close_channel(self, rank: int) -> None:
        stub = self._channels.pop(rank, None)
        if stub is not None:
            stub[0].close()

    # -- whole cluster ------------------------------------------------------------

    @classmethod
    def up(cls, base: Path, *, slices: int = 2, hosts_per_slice: int = 2,
           backup: str | None = None, isolation: str | None = None,
           colocated_devices: int = 0, replicator_nice: int = 0,
           backup_every_steps: int | None = None) -> LocalCluster:
        """``colocated_devices``: the trainer's CPU devices, split among the hosts'
        sidecars, which then also run colocated-Python programs
        (``Options(dispatch="colocated")``); 0: they serve seam requests only.
        ``replicator_nice``: the replicators' ``--nice``; ``backup_every_steps``:
        theirs ``--backup-interval-steps`` (see the fields)."""
        if (base / STATE).exists():
            raise SystemExit(f"a cluster already runs in {base} (take it down first)")
        base.mkdir(parents=True, exist_ok=True)
        n = slices * hosts_per_slice
        backup = backup or (base / "backup").as_uri()
        if backup.startswith("file://"):
            Path(backup.removeprefix("file://")).mkdir(parents=True, exist_ok=True)
        emulator = None
        hosts: Hosts | None = None
        try:
            hosts = Hosts(base / "hosts", n, ramdisk_bytes=RAMDISK_BYTES, isolation=isolation,
                          colocated_devices=colocated_devices)
            if backup == GCS_EMULATOR:
                # In this (the root) namespace, where the hosts reach it over the
                # bridge, as they would a bucket over the network.
                emulator = _start_emulator(base, hosts.gateway)
                backup = f"gs://{EMULATOR_BUCKET}/checkpoints"
            cluster = cls(base, slices, hosts_per_slice,
                          [hosts.replicator_address(r) for r in range(n)], hosts.to_json(),
                          backup, replicator_nice=replicator_nice, emulator=emulator,
                          backup_every_steps=backup_every_steps, _hosts=hosts)
            cluster.start_hosts(list(range(n)))
            # Serving is not reaching: every host must reach every other (and this
            # namespace them), or the cluster says why now, not in a restore later.
            hosts.check_reach(lambda h: h.replicator_port)
        except BaseException:
            if hosts is not None:
                hosts.down()
            if emulator is not None:
                gcs_emulator.stop(emulator["pid"])
            shutil.rmtree(base, ignore_errors=True)
            raise
        return cluster

    def down_latest(self) -> None:
        """Tear down, with the pids a trainer may have changed (it restarts hosts)
        read back from the state file."""
        try:
            current = LocalCluster.load(self.base)
        except (OSError, ValueError):
            current = self
        current.down()

    def down(self) -> None:
        for r in list(self._channels):
            self._close_channel(r)
        self.hosts.down()
        if self.emulator is not None:
            gcs_emulator.stop(self.emulator["pid"])
        shutil.rmtree(self.base, ignore_errors=True)


def _start_emulator(base: Path, host: str) -> dict[str, Any]:
    """The GCS emulator in its own session (it outlives ``up``, as the replicators do)."""
    (base / "logs").mkdir(parents=True, exist_ok=True)
    port = free_ports(1)[0]  # free on every address of this namespace
    url = f"http://{host}:{port}"
    proc = gcs_emulator.start(port, base / "logs" / "gcs-emulator.log", host=host,
                              start_new_session=True)
    try:
        gcs_emulator.wait_ready(proc, url)
        gcs_emulator.create_bucket(url, EMULATOR_BUCKET)
    except BaseException:
        proc.kill()
        raise
    return {"url": url, "pid": proc.pid}
