"""Simulated hosts that share nothing: each its own processes, RAM disk and address.

With root (here and in CI) every host gets a network namespace with an address
of its own on a bridge this module creates (a private /24, nothing else is ever
addressed), and a mount namespace in which its RAM disk is a private tmpfs: the
trainer's process sees an empty folder where the host's steps are. The bridge
lives in a namespace of the cluster's own (the "switch"), joined to the caller's
namespace by one link: traffic between hosts never crosses the caller's
firewall (Docker's FORWARD DROP and bridge netfilter on a workstation), and the
caller reaches the hosts as directly connected neighbours (the network is
:mod:`mtc.testing.netns`'s). The host's
sidecar starts the namespaces; its replicator joins them (``nsenter``), as the
containers of one pod share a volume. Without root, each host is separate
processes with a private folder, through the same code paths.

Everything created is removed by :meth:`Hosts.down`: processes (by pid),
namespaces, the bridge, the folders. The whole state is plain data
(:meth:`Hosts.to_json`): another process (the trainer of the local cluster)
takes it up with :meth:`Hosts.from_json` and can lose and replace hosts too.

Every host's sidecar and replicator listen on fixed ports of the host's own
address (:data:`SIDECAR_PORT`, a namespace's: nothing else listens there), so a
replaced host is found where it was, as a pod is behind its stable name; on
loopback the ports are picked free once, when the hosts are made.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mtc.ports import free_ports
from mtc.testing import netns
from mtc.testing.waits import wait_until

READY_TIMEOUT_S = 60.0
FILE_CHECK_S = 0.005  # a stat of a local file: cheap enough to do this often
SIDECAR_PORT = 7100  # inside a host's namespace
REPLICATOR_PORT = 7000


def with_checkout(env: dict[str, str]) -> dict[str, str]:
    """``env`` for the ``python -m`` children of the local cluster and the demos: this
    checkout at the end of ``PYTHONPATH``, and ``PYTHONSAFEPATH`` set, so that a
    child started in the checkout does not put its working folder first either.
    Where mtc is installed from a wheel (an accelerator host with no index), the
    checkout's own folders would shadow it, and only an install maps ``sidecar/``
    and ``trainer/`` into the package."""
    checkout = str(Path(__file__).resolve().parents[2])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return env | {"PYTHONPATH": os.pathsep.join(
        [*parts, checkout] if checkout not in parts else parts), "PYTHONSAFEPATH": "1"}


def namespaces_available() -> bool:
    """Root, and the tools: ip (netns, veth, bridge), unshare, nsenter."""
    return (os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "unshare", "nsenter"))
            and os.environ.get("MTC_ISOLATION", "namespaces") != "processes")


@dataclasses.dataclass
class Host:
    """One simulated host: its address, folders, and the processes it runs."""

    index: int
    address: str  # the host's own address (a namespace's, or loopback)
    root: Path  # its RAM disk: a private tmpfs visible to its processes only
    area: Path  # the shared-memory area between the trainer and its sidecar
    netns: str | None
    sidecar: subprocess.Popen[bytes] | None = None  # when this process started it
    sidecar_address: str = ""
    replicator: subprocess.Popen[bytes] | None = None
    sidecar_port: int = SIDECAR_PORT
    replicator_port: int = REPLICATOR_PORT
    sidecar_pid: int | None = None
    replicator_pid: int | None = None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespaces (those of its running sidecar,
        or replicator)."""
        owner = self.sidecar_pid if self.sidecar_pid is not None else self.replicator_pid
        if self.netns is None or owner is None:
            return list(argv)
        return ["nsenter", f"--target={owner}", "--mount", "--net", "--", *argv]

    def describe(self) -> dict[str, object]:
        return {"address": self.address, "sidecar_pid": self.sidecar_pid,
                "replicator_pid": self.replicator_pid}

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "address": self.address, "root": str(self.root),
                "area": str(self.area), "netns": self.netns,
                "sidecar_address": self.sidecar_address, "sidecar_port": self.sidecar_port,
                "replicator_port": self.replicator_port, "sidecar_pid": self.sidecar_pid,
                "replicator_pid": self.replicator_pid}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Host:
        return cls(d["index"], d["address"], Path(d["root"]), Path(d["area"]), d["netns"],
                   sidecar_address=d["sidecar_address"], sidecar_port=d["sidecar_port"],
                   replicator_port=d["replicator_port"], sidecar_pid=d["sidecar_pid"],
                   replicator_pid=d["replicator_pid"])


class Hosts:
    """``n`` isolated hosts under ``base`` (folders for areas, logs and ready files)."""

    def __init__(self, base: Path, n: int, *, ramdisk_bytes: int = 1 << 30,
                 isolation: str | None = None, colocated_devices: int = 0) -> None:
        self.base = base
        self.n = n
        self.ramdisk_bytes = ramdisk_bytes
        # The job's CPU devices, split evenly among the hosts' colocated-Python
        # servers (0: the sidecars run none).
        self.colocated_devices = colocated_devices
        self.isolation = isolation or ("namespaces" if namespaces_available() else "processes")
        # In every interface and namespace name (15 characters at most): random, so
        # that two clusters on one machine (two test runs) do not meet.
        self.tag = uuid.uuid4().hex[:5]
        rng = random.SystemRandom()  # not the process's generator, which tests may seed
        self.subnet = f"10.{200 + rng.randrange(50)}.{rng.randrange(256)}"
        self.bridge = f"mtcb{self.tag}"
        self.switch = f"mtc{self.tag}sw"  # the namespace the bridge lives in
        self.hosts: list[Host] = []
        base.mkdir(parents=True, exist_ok=True)
        self._blackholes = netns.Blackholes()
        if self.isolation == "namespaces":
            netns.make_switch(self.tag, self.switch, self.bridge, self.subnet)
        for i in range(n):
            hd = base / f"host-{i}"
            ns = f"mtc{self.tag}h{i}" if self.isolation == "namespaces" else None
            addr = f"{self.subnet}.{10 + i}" if ns else "127.0.0.1"
            h = Host(i, addr, hd / "ramdisk", hd / "area", ns)
            if ns is None:  # loopback: ports of its own, picked once
                h.sidecar_port, h.replicator_port = free_ports(2)
            h.root.mkdir(parents=True, exist_ok=True)
            h.area.mkdir(parents=True, exist_ok=True)
            if ns:
                netns.add_host(self.tag, self.switch, self.bridge, i, ns, addr)
            self.hosts.append(h)

    # -- state ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"base": str(self.base), "n": self.n, "ramdisk_bytes": self.ramdisk_bytes,
                "isolation": self.isolation, "tag": self.tag, "subnet": self.subnet,
                "colocated_devices": self.colocated_devices,
                "bridge": self.bridge, "switch": self.switch,
                "hosts": [h.to_json() for h in self.hosts]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Hosts:
        """The hosts another process made (their network stays as it is)."""
        self = cls.__new__(cls)
        self.base, self.n, self.ramdisk_bytes = Path(d["base"]), d["n"], d["ramdisk_bytes"]
        self.isolation, self.tag, self.subnet = d["isolation"], d["tag"], d["subnet"]
        self.bridge, self.switch = d["bridge"], d["switch"]
        self.colocated_devices = int(d.get("colocated_devices", 0))
        self.hosts = [Host.from_json(h) for h in d["hosts"]]
        self._blackholes = netns.Blackholes()
        return self

    # -- network ----------------------------------------------------------------------

    @property
    def gateway(self) -> str:
        """The address at which hosts reach this (the caller's) namespace: its end
        of the uplink to the switch."""
        return f"{self.subnet}.1" if self.isolation == "namespaces" else "127.0.0.1"

    def link(self, host: int, up: bool) -> None:
        """Cut or restore a host's link (its port on the switch's bridge)."""
        netns.set_link(self.tag, self.switch, host, up)

    def check_reach(self, port_of: Callable[[Host], int], timeout_s: float = 2.0) -> None:
        """Every host reaches every other at ``port_of(host)``, and this namespace
        each, or a RuntimeError within seconds (:func:`netns.check_reach`)."""
        if self.isolation == "namespaces":
            netns.check_reach({h.index: (h.netns or "", f"{h.address}:{port_of(h)}")
                               for h in self.hosts}, self.switch, self.subnet, timeout_s)

    # -- processes --------------------------------------------------------------------

    def start_sidecar(self, i: int, slices: Sequence[int], *, env: dict[str, str] | None = None,
                      writer_threads: int = 2, wait: bool = True,
                      extra: Sequence[str] = ()) -> Host:
        """Start host ``i``'s sidecar (its own session), which makes the host's
        namespaces and mounts its RAM disk; with ``wait``, until it serves.
        ``extra``: more arguments of the sidecar (its certificate, for mutual TLS).

        While the host's replicator still runs (the sidecar alone died), the new
        sidecar joins the replicator's namespaces: the RAM disk is as it was, as
        a pod's volume outlives one of its containers."""
        h = self.hosts[i]
        ready = self.ready_file(i)
        ready.unlink(missing_ok=True)
        self.started_file(i).unlink(missing_ok=True)
        listen = f"{h.address}:{h.sidecar_port}"
        cmd = [sys.executable, "-m", "mtc.sidecar.host.main", "--root", str(h.root),
               "--area", str(h.area), "--host", str(i), "--slices",
               ",".join(str(s) for s in slices), "--listen", listen,
               "--ready-file", str(ready), "--started-file", str(self.started_file(i)),
               "--writer-threads", str(writer_threads),
               # Every caller presents the hosts' token (the replicators' too).
               "--token-file", str(self.token_file), *extra]
        if self.colocated_devices:
            cmd += ["--colocated-devices", str(self.colocated_devices // self.n),
                    "--job-devices", str(self.colocated_devices)]
        if h.netns and _alive(h.replicator_pid, h.replicator):
            cmd = ["nsenter", f"--target={h.replicator_pid}", "--mount", "--net", "--", *cmd]
        elif h.netns:
            # A private tmpfs at the root, seen by this process and whoever joins it.
            script = (f"mount -t tmpfs -o size={self.ramdisk_bytes},mode=0700 tmpfs "
                      f"'{h.root}' && exec \"$@\"")
            cmd = ["ip", "netns", "exec", h.netns, "unshare", "--mount",
                   "--propagation", "private", "--", "sh", "-c", script, "sh", *cmd]
        log = open(self.log_path(i, "sidecar"), "ab")
        h.sidecar = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        h.sidecar_pid = h.sidecar.pid
        h.sidecar_address = listen
        if wait:
            self.wait_sidecar(i)
        return h

    def ready_file(self, i: int) -> Path:
        return self.base / f"host-{i}" / "mtc.sidecar.ready"

    def started_file(self, i: int) -> Path:
        return self.base / f"host-{i}" / "mtc.sidecar.started"

    def wait_started(self, i: int, timeout: float = READY_TIMEOUT_S) -> None:
        """Until host ``i``'s sidecar runs in the host's namespaces (its RAM disk
        mounted), before it serves: its replicator may start beside it while a
        colocated runtime still starts."""
        started = self.started_file(i)
        self._wait_sidecar_file(i, lambda: started.exists() or self.ready_file(i).exists(),
                                "running in its namespaces", timeout)

    def wait_sidecar(self, i: int, timeout: float = READY_TIMEOUT_S) -> None:
        """Until host ``i``'s sidecar serves (it writes its ready file; a stat every
        few milliseconds, no RPC)."""
        h, ready = self.hosts[i], self.ready_file(i)
        self._wait_sidecar_file(i, ready.exists, "serving", timeout)
        h.sidecar_address = json.loads(ready.read_text())["address"]

    def _wait_sidecar_file(self, i: int, there: Callable[[], bool], what: str,
                           timeout: float) -> None:
        """Until ``there()`` (a file the sidecar writes: a stat every few milliseconds,
        no RPC); a RuntimeError with its log as soon as the sidecar is dead."""
        h = self.hosts[i]

        def alive() -> None:
            if not _alive(h.sidecar_pid, h.sidecar):
                raise RuntimeError(f"sidecar of host {i} did not start: "
                                   f"{self.log_tail(i, 'sidecar')}")

        wait_until(f"sidecar of host {i} {what}", there, timeout, poll_s=FILE_CHECK_S,
                   during=alive, detail=lambda: self.log_tail(i, "sidecar"))

    def replicator_address(self, i: int, port: int | None = None) -> str:
        """Where host ``i``'s replicator listens: a fixed port on the host's own
        address (default: the host's), so every peer can be told every address
        before any starts. On loopback a given ``port`` must be free."""
        h = self.hosts[i]
        return f"{h.address}:{h.replicator_port if port is None else port}"

    def start_replicator(self, i: int, argv: Sequence[str], *,
                         env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start host ``i``'s replicator (``argv``: the arguments after ``python -m
        mtc.sidecar.replicator.main``) inside the host's namespaces, with the token
        peers off loopback must present (:attr:`token_file`). Returns at once: the
        caller waits for it to serve."""
        h = self.hosts[i]
        if h.netns and h.sidecar_pid is None and h.replicator_pid is None:
            raise RuntimeError(f"host {i}: start its sidecar first (it owns the namespaces)")
        cmd = h.wrap([sys.executable, "-m", "mtc.sidecar.replicator.main", *argv,
                      "--token-file", str(self.token_file)])
        log = open(self.log_path(i, "replicator"), "ab")
        h.replicator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        log.close()
        h.replicator_pid = h.replicator.pid
        return h.replicator

    @property
    def token_file(self) -> Path:
        """The hosts' shared token: every sidecar requires it, and every replicator
        (the controller presents it to both)."""
        p = self.base / "peer-token"
        if not p.exists():
            # Hosts may be started from several threads at once: the first link wins.
            tmp = p.with_name(f".peer-token.{uuid.uuid4().hex}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(16).hex() + "\n")
            try:
                os.link(tmp, p)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        return p

    def token(self) -> str:
        return self.token_file.read_text().strip()

    def log_path(self, i: int, what: str) -> Path:  # what: "replicator", "sidecar"
        return self.base / f"host-{i}" / f"{what}.log"

    def log_tail(self, i: int, what: str, n: int = 3000) -> str:
        p = self.log_path(i, what)
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def kill(self, i: int) -> None:
        """SIGKILL a host's processes: with namespaces its RAM disk goes with them."""
        self.kill_replicator(i)
        h = self.hosts[i]
        _kill(h.sidecar_pid, h.sidecar)
        h.sidecar, h.sidecar_pid = None, None

    def lose(self, i: int) -> None:
        """Host ``i`` is lost: its processes SIGKILLed and its RAM disk gone with them
        (with namespaces its tmpfs; without, its folder emptied here), its root left
        as an empty folder, as a namespaced host's mount point is, for a host
        started in its place."""
        self.kill(i)
        if self.isolation != "namespaces":
            root = self.hosts[i].root
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)

    def kill_sidecar(self, i: int) -> None:
        """SIGKILL a host's sidecar alone (its replicator keeps the RAM disk)."""
        h = self.hosts[i]
        _kill(h.sidecar_pid, h.sidecar)
        h.sidecar, h.sidecar_pid = None, None

    def kill_replicator(self, i: int) -> None:
        h = self.hosts[i]
        _kill(h.replicator_pid, h.replicator)
        h.replicator, h.replicator_pid = None, None

    def replicator_alive(self, i: int) -> bool:
        h = self.hosts[i]
        return _alive(h.replicator_pid, h.replicator)

    def describe(self) -> dict[str, object]:
        return {"isolation": self.isolation, "colocated_devices": self.colocated_devices,
                "hosts": [h.describe() for h in self.hosts]}

    def down(self) -> None:
        for i in range(self.n):
            self.kill(i)
        if self.isolation == "namespaces":
            netns.remove(self.tag, self.switch, [h.netns for h in self.hosts if h.netns])
        shutil.rmtree(self.base, ignore_errors=True)

    # -- partitions (appended: network faults between hosts) --------------------------

    def partition(self, groups: Sequence[Sequence[int]]) -> None:
        """Split the hosts into ``groups`` that reach each other but no other group
        (a host in no group reaches every host). Links stay up, so this process
        (the controller, the GCS emulator at the bridge address) still reaches
        every host: what a switch failing between two racks does. Each host drops
        what it sends to the other groups' addresses (a blackhole route in its
        namespace): new connections fail at once, open ones go silent. Cumulative;
        :meth:`heal` removes every route added."""
        if self.isolation != "namespaces":
            raise RuntimeError("partitions need network namespaces (root)")
        group_of = {h: g for g, members in enumerate(groups) for h in members}
        for a in self.hosts:
            for b in self.hosts:
                ga, gb = group_of.get(a.index), group_of.get(b.index)
                if ga is not None and gb is not None and ga != gb:
                    assert a.netns is not None
                    self._blackholes.add(a.netns, b.address)

    def cut(self, a: int, b: int) -> None:
        """Cut hosts ``a`` and ``b`` off each other only (a partial partition: each
        still reaches everyone else)."""
        if self.isolation != "namespaces":
            raise RuntimeError("partitions need network namespaces (root)")
        for x, y in ((a, b), (b, a)):
            ns = self.hosts[x].netns
            assert ns is not None
            self._blackholes.add(ns, self.hosts[y].address)

    def heal(self) -> None:
        """Undo every :meth:`partition` and :meth:`cut`, and bring every link up."""
        self._blackholes.clear()
        if self.isolation == "namespaces":
            for i in range(self.n):
                self.link(i, True)


def _state_of(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "X"
    return stat.rsplit(")", 1)[1].split()[0]


def _alive(pid: int | None, proc: subprocess.Popen[bytes] | None) -> bool:
    """Whether a process runs (not a zombie): our child, or one another process started."""
    if proc is not None:
        return proc.poll() is None
    if pid is None:
        return False
    try:
        if os.waitpid(pid, os.WNOHANG)[0]:  # our child after all: reaped
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return _state_of(pid) not in ("Z", "X")


def _kill(pid: int | None, proc: subprocess.Popen[bytes] | None, timeout: float = 30.0) -> None:
    """SIGKILL one process we (or the process that made the hosts) started; until it is gone."""
    if proc is not None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=timeout)
        return
    if pid is None or not _alive(pid, None):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _alive(pid, None) and time.monotonic() < deadline:
        time.sleep(0.005)
