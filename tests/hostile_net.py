"""What the hostile-network tests share: the two-host network they attack
(:class:`Net`, real replicator and sidecar processes on loopback), a health watch
that must answer throughout, the refusals' status codes, the watched root
every test's files live under (nothing may reach another host's RAM disk), and
a copy of another rank's data forged by a host with its own certificate
(:func:`plant_forged_copy`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from replicators import Cluster, commit_mtc_step

from mtc.contract import decode_reply, encode_request
from mtc.credentials import TOKEN_HEADER, Credentials
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.copies import provenance
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.testing.waits import wait_until

TOKEN = "hostile-network-test-token"
AUTH = [(TOKEN_HEADER, TOKEN)]
WRONG = [(TOKEN_HEADER, "guessed-token")]
OUTSIDE_FILES = 40
MiB = 1 << 20


def rss(pid: int) -> int:
    """Resident bytes of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


class HealthWatch:
    """Asks every address's health service every 0.2 s on a thread of its own (no
    credentials, as a Kubernetes probe); each answer must be SERVING within 2 s."""

    def __init__(self, addresses: list[str], creds: Credentials | None = None) -> None:
        self.addresses = addresses
        self.cc = creds.channel_credentials() if creds is not None else None
        self.failures: list[str] = []
        self.checks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-watch")

    def _run(self) -> None:
        channels = [grpc.secure_channel(a, self.cc) if self.cc else grpc.insecure_channel(a)
                    for a in self.addresses]
        try:
            while True:  # a round at once, then every 0.2 s, and a last one when stopped
                stopping = self._stop.is_set()
                for a, ch in zip(self.addresses, channels, strict=True):
                    self._check(a, ch)
                if stopping:
                    return
                self._stop.wait(0.2)
        finally:
            for ch in channels:
                ch.close()

    def _check(self, address: str, ch: grpc.Channel) -> None:
        t0 = time.monotonic()
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                         timeout=2.0).status
            if status != health_pb2.HealthCheckResponse.SERVING:
                self.failures.append(f"{address}: status {status}")
        except grpc.RpcError as e:
            self.failures.append(f"{address}: {e.code().name} after "
                                 f"{time.monotonic() - t0:.1f}s")
        self.checks += 1

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        assert self.checks > 0
        assert not self.failures, self.failures[:5]


def code_of(fn: Callable[[], Any]) -> grpc.StatusCode:
    """The status a call ends with (a stream drained); it must fail."""
    with pytest.raises(grpc.RpcError) as ei:
        r = fn()
        if not isinstance(r, (bytes, pb.Inventory)) and hasattr(r, "__iter__"):
            list(r)
    return ei.value.code()


def details_of(fn: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        r = fn()
        if hasattr(r, "__iter__") and not isinstance(r, bytes):
            list(r)
    return ei.value.code(), ei.value.details() or ""


def offer_of(step: int, files: list[pb.FileInfo], origin: int = 0) -> pb.OfferRequest:
    """An offer of a copy of ``origin``'s ``step`` holding ``files``."""
    return pb.OfferRequest(copy=pb.StepCopy(step=step, origin_rank=origin, files=files))


class Net:
    """Two hosts (one per slice, peers of each other) on loopback: each a replicator and
    a sidecar taking the shared token, backing up to a folder, streams held to a 1 s
    grace; and files outside every root the attacks aim at."""

    def __init__(self, base: Path) -> None:
        self.base = base
        base.mkdir()
        token_file = base / "token"
        token_file.write_text(TOKEN + "\n")
        self.backup = base / "backup"
        self.backup.mkdir()
        self.cluster = Cluster(base / "hosts", 2, 1, creds=Credentials(token=TOKEN), extra=(
            "--token-file", str(token_file), "--stream-grace-seconds", "1",
            "--stream-min-rate", str(64 << 10), "--backup", self.backup.as_uri(),
            "--backup-interval-minutes", "600"), metrics=True)
        self.outside = base / "outside"
        self.outside.mkdir()
        for i in range(OUTSIDE_FILES):
            (self.outside / f"f{i}").write_text(f"outside file {i}\n")
        self.cluster.start_all()
        self.cluster.start_sidecars()
        self.channels: list[grpc.Channel] = []

    def root(self, rank: int) -> Path:
        return self.cluster.root(rank)

    def channel(self, rank: int, *, sidecar: bool = False) -> grpc.Channel:
        addr = (self.cluster.hosts.hosts[rank].sidecar_address if sidecar
                else self.cluster.addrs[rank])
        ch = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", -1),
                                                  ("grpc.max_receive_message_length", -1)])
        self.channels.append(ch)
        return ch

    def replicator_pid(self, rank: int) -> int:
        return self.cluster.procs[rank].pid

    def sidecar_pid(self, rank: int) -> int:
        pid = self.cluster.hosts.hosts[rank].sidecar_pid
        assert pid is not None
        return pid

    def health(self, ranks: tuple[int, ...] = (0, 1)) -> HealthWatch:
        return HealthWatch([self.cluster.addrs[r] for r in ranks])

    @contextlib.contextmanager
    def paused(self, rank: int) -> Iterator[None]:
        """Rank ``rank``'s replicator stopped (SIGSTOP) for the block, resumed after:
        a test of the other's bounds that must not meet this one's own traffic."""
        pid = self.replicator_pid(rank)
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def assert_outside_intact(self) -> None:
        """Nothing outside the hosts' roots was written, moved or deleted."""
        names = sorted(os.listdir(self.outside))
        assert names == sorted(f"f{i}" for i in range(OUTSIDE_FILES)), names
        for i in range(OUTSIDE_FILES):
            assert (self.outside / f"f{i}").read_text() == f"outside file {i}\n"
        assert not list(self.base.rglob("*escape*")), list(self.base.rglob("*escape*"))

    def call(self, rank: int, op: str, metadata: Any = AUTH, **args: Any) -> Any:
        """One host operation on a sidecar, its reply decoded (a typed error raised)."""
        stub = self.channel(rank, sidecar=True).unary_unary("/mtc.Host/Call")
        return decode_reply(stub(encode_request(op, [rank], **args), timeout=10,
                                 metadata=metadata))

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.cluster.stop_all()


class Drip:
    """``n`` connections to ``address`` that never finish their request: each sends
    ``head`` at once, then one byte every ``every`` seconds (``head`` empty and
    ``every`` 0: nothing at all, as a TLS caller that never says hello). One thread
    keeps them all open, connecting again in place of each that ends, at most
    ``max_connects`` connections in all; it stops when the block ends."""

    def __init__(self, address: tuple[str, int], n: int = 40, *, head: bytes = b"",
                 every: float = 0.5, source: str = "127.0.0.1",
                 max_connects: int = 2000) -> None:
        self.address, self.n, self.head, self.every = address, n, head, every
        self.source = source
        self.max_connects = max_connects
        self.connects = 0
        self.ended = 0  # connections the server ended (or refused)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="drip")

    def _connect(self) -> socket.socket | None:
        if self.connects >= self.max_connects:
            return None
        self.connects += 1
        s = socket.socket()
        try:
            s.bind((self.source, 0))
            s.settimeout(1.0)
            s.connect(self.address)
            s.sendall(self.head)
            return s
        except OSError:
            s.close()
            self.ended += 1
            return None

    def _run(self) -> None:
        socks: list[socket.socket | None] = []
        try:
            socks = [self._connect() for _ in range(self.n)]
            while not self._stop.wait(self.every or 0.5):
                for i, s in enumerate(socks):
                    if s is not None:
                        try:
                            if self.every:
                                s.send(b"\0")
                            else:  # sends nothing: ended when the server closed it
                                s.setblocking(False)
                                if s.recv(1) == b"":
                                    raise ConnectionError("closed")
                            continue
                        except BlockingIOError:
                            continue
                        except OSError:
                            s.close()
                            self.ended += 1
                    socks[i] = self._connect()
        finally:
            for s in socks:
                if s is not None:
                    s.close()

    def __enter__(self) -> Drip:
        self._thread.start()
        # Connected is not admitted: a server may end some at once (``ended``).
        wait_until(f"{self.n} dripping connections made", lambda: self.connects >= self.n,
                   10, poll_s=0.01, detail=lambda: f"{self.connects} made, {self.ended} ended")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def plant_forged_copy(cl: Cluster, key_file: Path, cert_file: Path, *, holder: int,
                      origin: int, step: int, data: bytes) -> None:
    """What a host holding only its own valid certificate (``holder``'s: its
    ``key_file`` and ``cert_file``) can make: on its own RAM disk, a "copy" of
    ``origin``'s ``step`` of bytes it made up, listed with their own CRC32Cs (a
    manifest naming ``origin``'s host), and a proof of it signed with its own key.
    Its replicator (real, running) then lists it and serves it, as a modified one
    would."""
    scratch = cl.base / "forge"
    scratch.mkdir()
    files = commit_mtc_step(scratch, step, {"a.bin": data}, host=origin, num_hosts=cl.n)
    metas = [FileMeta(p, len(b), crc32c(b)) for p, b in sorted(files.items())]
    entry = pb.StepCopy(step=step, origin_rank=origin, saved_hosts=cl.n,
                        files=[pb.FileInfo(path=m.path, size=m.size, crc32c=m.crc32c)
                               for m in metas])
    key = serialization.load_pem_private_key(key_file.read_bytes(), None)
    der = x509.load_pem_x509_certificate(cert_file.read_bytes()).public_bytes(
        serialization.Encoding.DER)
    provenance.sign(entry, {p: hashlib.sha256(b).digest() for p, b in files.items()}, key, [der])
    replicas = cl.root(holder) / ".mtc-replica" / str(origin)
    replicas.mkdir(parents=True, exist_ok=True)
    (replicas / f"{step}.files.json").write_text(json.dumps([m.to_json() for m in metas]))
    (replicas / f"{step}.proof").write_bytes(entry.SerializeToString())
    os.rename(scratch / str(step), replicas / str(step))
