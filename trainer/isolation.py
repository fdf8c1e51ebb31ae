"""Simulated hosts that share nothing: each its own processes, RAM disk and address.

With root (here and in CI) every host gets a network namespace with an address
of its own on a bridge this module creates (a private /24, nothing else is ever
addressed), and a mount namespace in which its RAM disk is a private tmpfs: the
trainer's process sees an empty folder where the host's steps are. The host's
sidecar starts the namespaces; its replicator joins them (``nsenter``), as the
containers of one pod share a volume. Without root, each host is separate
processes with a private folder, through the same code paths.

Everything created is removed by :meth:`Hosts.down`: processes (by pid),
namespaces, the bridge, the folders.
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
from collections.abc import Sequence
from pathlib import Path

READY_TIMEOUT_S = 60.0


def namespaces_available() -> bool:
    """Root, and the tools: ip (netns, veth, bridge), unshare, nsenter."""
    return (os.geteuid() == 0 and all(shutil.which(t) for t in ("ip", "unshare", "nsenter"))
            and os.environ.get("MTC_ISOLATION", "namespaces") != "processes")


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


@dataclasses.dataclass
class Host:
    """One simulated host: its address, folders, and the processes it runs."""

    index: int
    address: str  # the host's own address (a namespace's, or loopback)
    root: Path  # its RAM disk: a private tmpfs visible to its processes only
    area: Path  # the shared-memory area between the trainer and its sidecar
    netns: str | None
    sidecar: subprocess.Popen[bytes] | None = None
    sidecar_address: str = ""
    replicator: subprocess.Popen[bytes] | None = None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespaces (those of its running sidecar)."""
        if self.netns is None or self.sidecar is None:
            return list(argv)
        return ["nsenter", f"--target={self.sidecar.pid}", "--mount", "--net", "--", *argv]

    def describe(self) -> dict[str, object]:
        return {"address": self.address,
                "sidecar_pid": self.sidecar.pid if self.sidecar else None,
                "replicator_pid": self.replicator.pid if self.replicator else None}


class Hosts:
    """``n`` isolated hosts under ``base`` (folders for areas, logs and ready files)."""

    def __init__(self, base: Path, n: int, *, ramdisk_bytes: int = 1 << 30,
                 isolation: str | None = None) -> None:
        self.base = base
        self.n = n
        self.ramdisk_bytes = ramdisk_bytes
        self.isolation = isolation or ("namespaces" if namespaces_available() else "processes")
        self.tag = f"{os.getpid() % 1000:03d}{random.randrange(100):02d}"
        self.subnet = f"10.{200 + random.randrange(50)}.{random.randrange(256)}"
        self.bridge = f"mtcb{self.tag}"
        self.hosts: list[Host] = []
        base.mkdir(parents=True, exist_ok=True)
        if self.isolation == "namespaces":
            self._make_network()
        for i in range(n):
            hd = base / f"host-{i}"
            ns = f"mtc{self.tag}h{i}" if self.isolation == "namespaces" else None
            addr = f"{self.subnet}.{10 + i}" if ns else "127.0.0.1"
            h = Host(i, addr, hd / "ramdisk", hd / "area", ns)
            h.root.mkdir(parents=True, exist_ok=True)
            h.area.mkdir(parents=True, exist_ok=True)
            if ns:
                self._add_host_network(h)
            self.hosts.append(h)

    # -- network ----------------------------------------------------------------------

    def _make_network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def _add_host_network(self, h: Host) -> None:
        assert h.netns is not None
        outer, inner = f"mtv{self.tag}{h.index}a", f"mtv{self.tag}{h.index}b"
        _run("ip", "netns", "add", h.netns)
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", outer, "master", self.bridge)
        _run("ip", "link", "set", outer, "up")
        _run("ip", "link", "set", inner, "netns", h.netns)
        for cmd in (("ip", "addr", "add", f"{h.address}/24", "dev", inner),
                    ("ip", "link", "set", inner, "up"), ("ip", "link", "set", "lo", "up")):
            _run("ip", "netns", "exec", h.netns, *cmd)

    def link(self, host: int, up: bool) -> None:
        """Cut or restore a host's link (its veth on the bridge)."""
        _run("ip", "link", "set", f"mtv{self.tag}{host}a", "up" if up else "down")

    # -- processes --------------------------------------------------------------------

    def start_sidecar(self, i: int, slices: Sequence[int], *, env: dict[str, str] | None = None,
                      writer_threads: int = 2) -> Host:
        h = self.hosts[i]
        ready = self.base / f"host-{i}" / "mtc_sidecar.ready"
        ready.unlink(missing_ok=True)
        listen = f"{h.address}:0"
        cmd = [sys.executable, "-m", "mtc_sidecar.host.main", "--root", str(h.root),
               "--area", str(h.area), "--host", str(i), "--slices",
               ",".join(str(s) for s in slices), "--listen", listen,
               "--ready-file", str(ready), "--writer-threads", str(writer_threads)]
        if h.netns:
            # A private tmpfs at the root, seen by this process and whoever joins it.
            script = (f"mount -t tmpfs -o size={self.ramdisk_bytes},mode=0700 tmpfs "
                      f"'{h.root}' && exec \"$@\"")
            cmd = ["ip", "netns", "exec", h.netns, "unshare", "--mount",
                   "--propagation", "private", "--", "sh", "-c", script, "sh", *cmd]
        log = open(self.base / f"host-{i}" / "sidecar.log", "ab")
        h.sidecar = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if h.sidecar.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sidecar of host {i} did not start: "
                                   f"{self.log_tail(i, 'sidecar')}")
            time.sleep(0.02)
        h.sidecar_address = json.loads(ready.read_text())["address"]
        return h

    def replicator_address(self, i: int, port: int) -> str:
        """Where host ``i``'s replicator listens: a fixed port on the host's own
        address (a namespace's: nothing else listens there), so every peer can be
        told every address before any starts. On loopback ``port`` must be free."""
        return f"{self.hosts[i].address}:{port}"

    def start_replicator(self, i: int, argv: Sequence[str], *,
                         env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start host ``i``'s replicator (``argv``: the arguments after ``python -m
        mtc_sidecar.replicator.main``) inside the host's namespaces, with the token
        peers off loopback must present (:attr:`token_file`). Returns at once: the
        caller waits for it to serve."""
        h = self.hosts[i]
        if h.netns and h.sidecar is None:
            raise RuntimeError(f"host {i}: start its sidecar first (it owns the namespaces)")
        cmd = h.wrap([sys.executable, "-m", "mtc_sidecar.replicator.main", *argv,
                      "--token-file", str(self.token_file)])
        log = open(self.base / f"host-{i}" / "replicator.log", "ab")
        h.replicator = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        log.close()
        return h.replicator

    @property
    def token_file(self) -> Path:
        """The peers' shared token (replicators off loopback require one)."""
        p = self.base / "peer-token"
        if not p.exists():
            tmp = p.with_suffix(".tmp")
            tmp.write_text(os.urandom(16).hex() + "\n")
            os.chmod(tmp, 0o600)
            tmp.replace(p)
        return p

    def token(self) -> str:
        return self.token_file.read_text().strip()

    def log_tail(self, i: int, what: str, n: int = 3000) -> str:
        p = self.base / f"host-{i}" / f"{what}.log"
        return p.read_text(errors="replace")[-n:] if p.exists() else ""

    def kill(self, i: int) -> None:
        """SIGKILL a host's processes: with namespaces its RAM disk goes with them."""
        h = self.hosts[i]
        for p in (h.replicator, h.sidecar):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(timeout=30)
        h.replicator = h.sidecar = None

    def describe(self) -> dict[str, object]:
        return {"isolation": self.isolation, "hosts": [h.describe() for h in self.hosts]}

    def down(self) -> None:
        for i in range(self.n):
            self.kill(i)
        if self.isolation == "namespaces":
            for h in self.hosts:
                if h.netns:
                    subprocess.run(["ip", "netns", "del", h.netns], capture_output=True,
                                   check=False)
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
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
        cuts: list[tuple[str, str]] = getattr(self, "_cuts", [])
        for a in self.hosts:
            for b in self.hosts:
                ga, gb = group_of.get(a.index), group_of.get(b.index)
                if ga is None or gb is None or ga == gb or (a.netns, b.address) in cuts:
                    continue
                assert a.netns is not None
                _run("ip", "-n", a.netns, "route", "add", "blackhole", f"{b.address}/32")
                cuts.append((a.netns, b.address))
        self._cuts = cuts

    def cut(self, a: int, b: int) -> None:
        """Cut hosts ``a`` and ``b`` off each other only (a partial partition: each
        still reaches everyone else)."""
        if self.isolation != "namespaces":
            raise RuntimeError("partitions need network namespaces (root)")
        cuts: list[tuple[str, str]] = getattr(self, "_cuts", [])
        for x, y in ((a, b), (b, a)):
            ns, addr = self.hosts[x].netns, self.hosts[y].address
            assert ns is not None
            if (ns, addr) not in cuts:
                _run("ip", "-n", ns, "route", "add", "blackhole", f"{addr}/32")
                cuts.append((ns, addr))
        self._cuts = cuts

    def heal(self) -> None:
        """Undo every :meth:`partition` and :meth:`cut`, and bring every link up."""
        cuts: list[tuple[str, str]] = getattr(self, "_cuts", [])
        while cuts:
            ns, addr = cuts.pop()
            subprocess.run(["ip", "-n", ns, "route", "del", "blackhole", f"{addr}/32"],
                           capture_output=True, check=False)
        if self.isolation == "namespaces":
            for i in range(self.n):
                self.link(i, True)
