"""A hostile network gets nothing: no code run, no byte read or written outside a RAM
disk, no say in what hosts restore, no way to freeze a replicator.

Each test runs attacks of a caller on the same network against real replicator and
sidecar processes on loopback (``tests/replicators.Cluster``), first without
credentials, then holding the shared token or a certificate of the cluster's CA
(docs/security.md says what each may do), and asserts the refusal, that nothing
outside the roots changed (checked on the file system), that the server's memory
stayed bounded (its RSS, from /proc) and that its health check answered throughout.
The one stand-in: a hostile peer replicator, played in this process by a gRPC
server answering the inventory a real replicator asks it for.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import seam_audit
from grpc_health.v1 import health_pb2, health_pb2_grpc
from replicators import Cluster, env_with_repo, free_ports
from test_replicator_security import make_ca, make_leaf, write_pem

from mtc import errors, transfer
from mtc.contract import decode_reply, encode_request
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.sidecar.replicator.book import BOOK_NAME
from mtc.sidecar.replicator.client import FETCH, PUSH, PeerClient, PeerError
from mtc.sidecar.replicator.security import TOKEN_HEADER, Credentials
from mtc.sidecar.replicator.store import REPLICA_DIR

pytestmark = pytest.mark.process  # every test here starts processes

TOKEN = "hostile-network-test-token"
AUTH = [(TOKEN_HEADER, TOKEN)]
WRONG = [(TOKEN_HEADER, "guessed-token")]
OUTSIDE_FILES = 40
MiB = 1 << 20


# -- the harness ----------------------------------------------------------------------


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
            "--backup-interval-minutes", "600"))
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

    def health(self) -> HealthWatch:
        return HealthWatch(list(self.cluster.addrs))

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


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    path = Path("/dev/shm") / f"mtc-hostile-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    seam_audit.watch(path)
    try:
        yield path
    finally:
        leaks = seam_audit.unwatch(path)
        shutil.rmtree(path, ignore_errors=True)
    assert not leaks, leaks[:10]


@pytest.fixture(scope="module")
def net(base: Path) -> Iterator[Net]:
    n = Net(base / "net")
    try:
        yield n
    finally:
        for r in range(2):
            print(f"--- replicator {r} ---\n{n.cluster.log_text(r)[-3000:]}")
            print(f"--- sidecar {r} ---\n{n.cluster.sidecar_log(r)}")
        n.close()


# -- no credentials -----------------------------------------------------------------------


def test_callers_without_the_token_get_nothing(net: Net) -> None:
    """Every replicator method, the raw data plane, and every sidecar operation refuse a
    caller without the token (or with a guessed one); health alone answers."""
    net.cluster.commit(0, 1, {"a.bin": os.urandom(4096)})
    net.cluster.wait_held({(1, 0, 1)})
    with net.health():
        for md in ((), WRONG):
            ch = net.channel(1)
            stub = pb_grpc.ReplicatorStub(ch)
            for name, req in (
                    ("GetInventory", pb.InventoryRequest()),
                    ("Offer", pb.OfferRequest(copy=pb.StepCopy(step=2, origin_rank=0))),
                    ("Link", pb.LinkRequest()), ("Commit", pb.CommitRequest()),
                    ("Abort", pb.AbortRequest()),
                    ("Decide", pb.DecideRequest(rank=1, timeout_seconds=1)),
                    ("GetComplete", pb.CompleteRequest()),
                    ("PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=1)),
                    ("Restored", pb.RestoredRequest(restore_id="r", step=1)),
                    ("RequestBackup", pb.BackupRequest()),
                    ("BackupPart", pb.BackupPartRequest(step=1, prefix="steps/1"))):
                assert code_of(lambda n=name, r=req, s=stub, m=md: getattr(s, n)(
                    r, timeout=5, metadata=m)) == grpc.StatusCode.UNAUTHENTICATED, name
            fetch = pb.FetchRequest(step=1, origin_rank=0, path="a.bin").SerializeToString()
            assert code_of(lambda c=ch, f=fetch, m=md: c.unary_stream(FETCH)(
                f, timeout=5, metadata=m)) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda c=ch, m=md: c.stream_unary(PUSH)(
                iter([b"x" * 10]), timeout=5, metadata=m)) == grpc.StatusCode.UNAUTHENTICATED
            # The sidecar: not one operation, least of all those naming paths.
            sidecar = net.channel(0, sidecar=True)
            for op, args in (("hello", {}), ("inspect", {}), ("steps", {}),
                             ("delete", {"step": 1}), ("retain", {
                                 "complete": [], "max_to_keep": 1, "keep_period": None,
                                 "before_write": False}),
                             ("read", {"step": 1, "tasks": []}),
                             ("load", {"step": 1, "tasks": []})):
                req = encode_request(op, [0], **args)
                assert code_of(lambda q=req, c=sidecar, m=md: c.unary_unary("/mtc.Host/Call")(
                    q, timeout=5, metadata=m)) == grpc.StatusCode.UNAUTHENTICATED, op
            assert code_of(lambda c=sidecar, m=md: c.unary_unary("/mtc.Host/Execute")(
                b"\0" * 64, timeout=5, metadata=m)) == grpc.StatusCode.UNAUTHENTICATED
    assert (net.root(0) / "1" / "a.bin").is_file()  # the step the attacker tried to delete
    # With the token, the same sidecar answers: the step is there, and mtc's.
    assert net.call(0, "steps") == {"0": [1]}
    assert net.call(0, "foreign") == {"0": []}
    net.assert_outside_intact()


def _evil_program(marker: Path) -> bytes:
    """A colocated call whose program, unpickled, runs a shell command."""

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    pickled = pickle.dumps(Evil())
    pid = transfer.program_id(pickled)
    area = marker.parent
    return transfer.pack_message(area, {"program": pid, "pickled": True, "name": "evil",
                                        "devices": [0], "own": [0], "inputs": []},
                                 [np.frombuffer(pickled, np.uint8)])


def test_sidecar_needs_credentials_to_listen_and_to_run_code(base: Path) -> None:
    """A sidecar without credentials serves loopback only and runs no colocated Python;
    with them, a colocated call from a caller without the token is refused before its
    program's bytes are unpickled (the program would create a file)."""
    work = base / "coloc"
    (work / "root").mkdir(parents=True)
    (work / "area").mkdir()
    port = free_ports(1)[0]
    common = [sys.executable, "-m", "mtc.sidecar.host.main", "--root", str(work / "root"),
              "--area", str(work / "area"), "--host", "0", "--slices", "0"]
    for listen, extra in ((f"0.0.0.0:{port}", []),
                          (f"127.0.0.1:{port}", ["--colocated-devices", "1"])):
        r = subprocess.run([*common, "--listen", listen, *extra], capture_output=True,
                           text=True, timeout=60, env=env_with_repo())
        assert r.returncode == 2, r.stderr
        assert "--token-file" in r.stderr and "Traceback" not in r.stderr, r.stderr
    (work / "token").write_text(TOKEN)
    ready = work / "ready"
    proc = subprocess.Popen([*common, "--listen", f"127.0.0.1:{port}", "--ready-file",
                             str(ready), "--token-file", str(work / "token"),
                             "--colocated-devices", "1", "--job-devices", "1"],
                            env=env_with_repo(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        marker = work / "area" / "pwned"
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            execute = ch.unary_unary("/mtc.Host/Execute")
            for md in ((), WRONG):
                assert code_of(lambda m=md: execute(_evil_program(marker), timeout=10,
                                                    metadata=m)) == \
                    grpc.StatusCode.UNAUTHENTICATED
        finally:
            ch.close()
        time.sleep(0.2)
        assert not marker.exists()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


# -- a token holder, at a host's sidecar ---------------------------------------------------------


BAD_STEPS = ["../x", "/etc", "1/../../x", "", -1, 2**63 - 1, 2**53, True, 1.5, None, [1]]


def test_a_step_is_an_integer_and_a_path_stays_inside(net: Net) -> None:
    """Every field naming a step is an integer in range, checked before any I/O: no
    delete, read, manifest, load or stage reaches a folder outside the RAM disk; a
    shard that is a symlink is never read, nor anything outside moved to quarantine."""
    sibling = net.root(0).parent / "x"
    sibling.mkdir(exist_ok=True)
    (sibling / "keep").write_text("keep")
    with net.health():
        for step in BAD_STEPS:
            for op, args in (("delete", {}), ("manifest", {}),
                             ("read", {"tasks": []}), ("load", {"tasks": []})):
                with pytest.raises(errors.InvalidStepError):
                    net.call(0, op, step=step, **args)
        for step in ("../escape", "/escape", -1, 2**63 - 1):
            header = json.dumps({"step": step, "leaves": [], "array_leaves": [],
                                 "skip_if_busy": False})
            with pytest.raises(errors.InvalidStepError):
                net.call(0, "stage", header=header, slot="save-0", size=0, shards=[],
                         slice=0, num_hosts=2)
        # A piece naming a file outside its step folder, or an object dtype.
        piece = {"host": 0, "entry": {"index": [[0, 4]], "file": "../../outside/f0",
                                      "nbytes": 16, "crc32c": 0}}
        task = {"leaf": 0, "index": [[0, 4]], "dtype": "float32", "devices": [0],
                "pieces": [piece]}
        with pytest.raises(errors.ProtocolError):
            net.call(0, "read", step=1, tasks=[task])
        good = {"host": 0, "entry": {"index": [[0, 4]], "file": "f0", "nbytes": 16,
                                     "crc32c": 1}}
        with pytest.raises(errors.ProtocolError, match="object"):
            net.call(0, "read", step=1, tasks=[{**task, "dtype": "object", "pieces": [good]}])
        # A step folder planted as a symlink to the outside: a read that fails there
        # quarantines nothing (9 of 40 outside files were once lost this way).
        (net.root(0) / "55").symlink_to(net.outside)
        try:
            for _ in range(3):
                with pytest.raises(errors.CorruptShardError):
                    net.call(0, "read", step=55, tasks=[{**task, "pieces": [good]}])
            assert 55 not in net.call(0, "steps")["0"]
        finally:
            (net.root(0) / "55").unlink()
    assert (sibling / "keep").read_text() == "keep"
    net.assert_outside_intact()


def test_sidecar_reads_are_bounded_and_never_uninitialized(net: Net) -> None:
    """A region no piece covers is refused (it was answered with np.empty's memory); a
    1 GiB request costs the sidecar no memory and leaves no reply file behind."""
    pid = net.sidecar_pid(0)
    area = net.cluster.hosts.hosts[0].area
    before = rss(pid)
    empty = {"leaf": 0, "index": [[0, 1 << 28]], "dtype": "float32", "devices": [0],
             "pieces": []}
    claims = {**empty, "pieces": [{"host": 0, "entry": {
        "index": [[0, 1 << 28]], "file": "big.bin", "nbytes": 1 << 30, "crc32c": 0}}]}
    with net.health():
        for op in ("read", "load"):
            with pytest.raises(errors.ProtocolError, match="cover"):
                net.call(0, op, step=1, tasks=[empty])
            with pytest.raises(errors.ProtocolError, match="cover"):
                net.call(0, op, step=1, tasks=[{**empty, "index": [[0, 3]]}])
        # Pieces that claim to cover it, but no such file: refused when opened.
        with pytest.raises((errors.CorruptShardError, errors.ProtocolError)):
            net.call(0, "load", step=1, tasks=[claims])
        with pytest.raises(errors.ProtocolError):  # more than one reply may carry
            net.call(0, "read", step=1, tasks=[claims])
    assert not [n for n in os.listdir(area) if n.startswith("reply-")]
    assert rss(pid) - before < 64 * MiB, (before, rss(pid))
    net.assert_outside_intact()


# -- a token holder, at a replicator ---------------------------------------------------------------


def _offer(step: int, files: list[pb.FileInfo], origin: int = 0) -> pb.OfferRequest:
    return pb.OfferRequest(copy=pb.StepCopy(step=step, origin_rank=origin, files=files))


def test_offers_are_bounded_and_checked(net: Net) -> None:
    """Offers of a million files, of step 2^63-1, of a 2^64-1 byte file, of a path of
    4,200 bytes, of more bytes than the RAM disk has: each refused at once, typed,
    without naming the server's folders, and without holding memory."""
    pid = net.replicator_pid(1)
    stub = pb_grpc.ReplicatorStub(net.channel(1))
    before = rss(pid)
    million = _offer(9, [pb.FileInfo(path=f"{i}", size=1) for i in range(1_000_000)])
    with net.health():
        for _ in range(3):
            assert code_of(lambda: stub.Offer(million, timeout=60, metadata=AUTH)) == \
                grpc.StatusCode.INVALID_ARGUMENT
        assert rss(pid) - before < 160 * MiB, (before, rss(pid))
        for req in (_offer(2**63 - 1, [pb.FileInfo(path="a", size=1)]),
                    _offer(2**53, [pb.FileInfo(path="a", size=1)]),
                    _offer(9, [pb.FileInfo(path="a", size=2**64 - 1)]),
                    _offer(9, [pb.FileInfo(path="a" * 4200, size=1)]),
                    _offer(9, [pb.FileInfo(path="d/" + "b" * 300, size=1)])):
            code, details = details_of(lambda r=req: stub.Offer(r, timeout=10, metadata=AUTH))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert str(net.base) not in details, details
        code, details = details_of(lambda: stub.Offer(
            _offer(9, [pb.FileInfo(path="huge.bin", size=1 << 49)]), timeout=10,
            metadata=AUTH))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert not [n for n in os.listdir(net.root(1) / REPLICA_DIR / "0") if "tmp" in n]
    net.assert_outside_intact()


def _push(ch: grpc.Channel, tid: str, path: str, data: bytes) -> pb.PushAck:
    md = [*AUTH, ("x-mtc-transfer", tid), ("x-mtc-path", path),
          ("x-mtc-size", str(len(data))), ("x-mtc-crc32c", str(crc32c(data)))]
    return ch.stream_unary(PUSH, response_deserializer=pb.PushAck.FromString)(
        iter([data[i:i + 4 * MiB] for i in range(0, len(data), 4 * MiB)]), timeout=30,
        metadata=md)


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def test_replayed_offers_and_commits_open_no_second_transfer(net: Net) -> None:
    """One open transfer per origin: an offer replayed (or retried) replaces the one
    open, so pushes into open transfers never hold more than one copy's bytes; a
    replayed commit finds nothing."""
    ch = net.channel(1)
    stub = pb_grpc.ReplicatorStub(ch)
    data = os.urandom(16 * MiB)
    offer = _offer(40, [pb.FileInfo(path="big.bin", size=len(data), crc32c=crc32c(data))])
    incoming = net.root(1) / REPLICA_DIR / "0"
    with net.health():
        first = stub.Offer(offer, timeout=10, metadata=AUTH).transfer_id
        assert _push(ch, first, "big.bin", data).size == len(data)
        second = stub.Offer(offer, timeout=10, metadata=AUTH).transfer_id
        assert second != first
        assert code_of(lambda: _push(ch, first, "big.bin", data)) == grpc.StatusCode.NOT_FOUND
        assert _push(ch, second, "big.bin", data).size == len(data)
        tmps = [n for n in os.listdir(incoming) if "tmp" in n]
        assert len(tmps) == 1, tmps
        assert _disk_bytes(incoming) < len(data) + MiB
        stub.Commit(pb.CommitRequest(transfer_id=second), timeout=10, metadata=AUTH)
        assert code_of(lambda: stub.Commit(pb.CommitRequest(transfer_id=second), timeout=10,
                                           metadata=AUTH)) == grpc.StatusCode.NOT_FOUND
        assert code_of(lambda: stub.Commit(pb.CommitRequest(transfer_id=first), timeout=10,
                                           metadata=AUTH)) == grpc.StatusCode.NOT_FOUND
    assert (incoming / "40" / "big.bin").read_bytes() == data
    assert not [n for n in os.listdir(incoming) if "tmp" in n]
    net.assert_outside_intact()


def test_fetches_are_bounded_and_follow_no_symlink(net: Net) -> None:
    """Fetch ranges cost no memory (offset = size - 1 of a 64 MiB file, four at once);
    a fetch naming one file many times is refused before a byte is sent; a step folder
    that is a symlink is neither pushed nor served."""
    big = os.urandom(64 * MiB)
    net.cluster.commit(0, 10, {"big.bin": big, "s.bin": b"small"})
    net.cluster.wait_held({(1, 0, 10)})
    pid = net.replicator_pid(1)
    ch = net.channel(1)
    fetch = ch.unary_stream(FETCH)
    before = rss(pid)
    with net.health():
        req = pb.FetchRequest(step=10, origin_rank=0, path="big.bin",
                              offset=len(big) - 1).SerializeToString()
        with futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda _: b"".join(fetch(req, timeout=60, metadata=AUTH)),
                                range(4)))
        assert got == [big[-1:]] * 4
        assert rss(pid) - before < 40 * MiB, (before, rss(pid))
        for repeats in (1000, 100_000):
            req = pb.FetchRequest(step=10, origin_rank=0, path="s.bin",
                                  more_paths=["s.bin"] * repeats).SerializeToString()
            received: list[bytes] = []
            code = code_of(lambda r=req, got=received: got.extend(
                fetch(r, timeout=30, metadata=AUTH)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert received == []
        # A step folder that is a symlink to the outside.
        (net.root(0) / "77").symlink_to(net.outside)
        try:
            time.sleep(0.5)  # several replication passes
            req = pb.FetchRequest(step=77, origin_rank=0, path="f0").SerializeToString()
            received = []
            assert code_of(lambda got=received: got.extend(net.channel(0).unary_stream(FETCH)(
                req, timeout=5, metadata=AUTH))) in (grpc.StatusCode.NOT_FOUND,
                                                     grpc.StatusCode.FAILED_PRECONDITION)
            assert received == []
            assert 77 not in {c.step for c in net.cluster.inventory(0).copies}
            assert (1, 0, 77) not in net.cluster.held()
            assert not (net.root(1) / REPLICA_DIR / "0" / "77").exists()
        finally:
            (net.root(0) / "77").unlink()
    net.assert_outside_intact()


def test_streams_cannot_freeze_a_replicator(net: Net) -> None:
    """Forty health Watch streams (no credentials) and thirty-six pushes at one byte a
    second (with the token): health Check and inventories still answer; the streams
    beyond their bound are refused at once; the slow pushes end at their deadline."""
    ch1 = net.channel(1)
    stub = pb_grpc.ReplicatorStub(ch1)
    watches = []
    with net.health():
        watch_ch = net.channel(1)
        for _ in range(40):
            call = health_pb2_grpc.HealthStub(watch_ch).Watch(health_pb2.HealthCheckRequest(),
                                                             timeout=30)
            watches.append(call)
        accepted = refused = 0
        for w in watches:  # each answers its first status, or is refused
            try:
                assert next(w).status == health_pb2.HealthCheckResponse.SERVING
                accepted += 1
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                refused += 1
        assert accepted == 16 and refused == 40 - 16, (accepted, refused)
        t0 = time.monotonic()
        stub.GetInventory(pb.InventoryRequest(), timeout=2, metadata=AUTH)
        assert time.monotonic() - t0 < 2
        for w in watches:
            w.cancel()

        data = os.urandom(64)
        tid = stub.Offer(_offer(50, [pb.FileInfo(path=f"p{i}", size=len(data),
                                                 crc32c=crc32c(data)) for i in range(36)]),
                         timeout=10, metadata=AUTH).transfer_id
        stop = threading.Event()

        def slow(i: int) -> str:
            def drip() -> Iterator[bytes]:
                for b in data:
                    if stop.wait(1.0):
                        return
                    yield bytes([b])
            md = [*AUTH, ("x-mtc-transfer", tid), ("x-mtc-path", f"p{i}"),
                  ("x-mtc-size", str(len(data))), ("x-mtc-crc32c", str(crc32c(data)))]
            try:
                ch1.stream_unary(PUSH)(drip(), timeout=30, metadata=md)
                return "OK"
            except grpc.RpcError as e:
                return e.code().name

        with futures.ThreadPoolExecutor(36) as pool:
            t0 = time.monotonic()
            results = [pool.submit(slow, i) for i in range(36)]
            time.sleep(0.5)
            for _ in range(5):  # the server answers while they drip
                t1 = time.monotonic()
                stub.GetInventory(pb.InventoryRequest(), timeout=2, metadata=AUTH)
                assert time.monotonic() - t1 < 2
                time.sleep(0.2)
            codes = [f.result(timeout=20) for f in results]
            took = time.monotonic() - t0
            stop.set()
        assert codes.count("RESOURCE_EXHAUSTED") >= 36 - 8, codes
        assert codes.count("CANCELLED") >= 1 and "OK" not in codes, codes
        assert took < 10, took  # ended by the server: 1 s grace, 64 KiB/s minimum rate
        stub.Abort(pb.AbortRequest(transfer_id=tid), timeout=5, metadata=AUTH)
    net.assert_outside_intact()


def test_a_damaged_peer_copy_is_quarantined_and_fetched_again(net: Net) -> None:
    """A flipped byte in a peer copy: the file is quarantined (into a real folder, even
    when the quarantine was planted as a symlink to the outside) and a good copy takes
    its place, instead of being pushed over a folder that stays damaged."""
    files = {"a.bin": os.urandom(3000), "b.bin": os.urandom(5000)}
    net.cluster.commit(0, 20, files)
    net.cluster.wait_held({(1, 0, 20)})
    qdir = net.root(1) / ".mtc-quarantine"
    if qdir.is_dir() and not qdir.is_symlink():
        shutil.rmtree(qdir)
    qdir.symlink_to(net.outside)
    copy = net.root(1) / REPLICA_DIR / "0" / "20" / "a.bin"
    with net.health():
        damaged = bytearray(copy.read_bytes())
        damaged[100] ^= 0xFF
        copy.write_bytes(bytes(damaged))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if copy.exists() and copy.read_bytes() == files["a.bin"] and \
                    (1, 0, 20) in net.cluster.held():
                break
            time.sleep(0.1)
        assert copy.read_bytes() == files["a.bin"]
        assert (net.root(1) / REPLICA_DIR / "0" / "20" / "b.bin").read_bytes() == files["b.bin"]
    assert qdir.is_dir() and not qdir.is_symlink()
    assert any(n.endswith("a.bin") for n in os.listdir(qdir))
    pushes = net.cluster.log_text(0).count("step 20 replicated to rank 1")
    assert pushes <= 3, pushes  # the first copy and the one that healed it
    net.assert_outside_intact()


def test_committed_backup_objects_are_never_overwritten(net: Net) -> None:
    """BackupPart can write into a step's own uncommitted folder only: never into a
    committed backup, another step's folder, or a path twice."""
    for r in range(2):
        net.cluster.commit(r, 30, {"w.bin": os.urandom(2048)})
    net.cluster.wait_held({(1, 0, 30), (0, 1, 30)})
    stub0 = pb_grpc.ReplicatorStub(net.channel(0))
    assert stub0.RequestBackup(pb.BackupRequest(step=-1), timeout=60, metadata=AUTH).step == 30
    manifest = json.loads((net.backup / "steps" / "30" / "MANIFEST.json").read_text())
    objects = {e["object"]: e["sha256"] for es in manifest["ranks"].values() for e in es}
    stub1 = pb_grpc.ReplicatorStub(net.channel(1))
    with net.health():
        for prefix, upload in (("steps/30", ["w.bin"]), ("steps/31", ["w.bin"]),
                               ("steps/30/../31", ["w.bin"]), ("staging/31-0123abcd", ["w.bin"]),
                               ("elsewhere", ["w.bin"]), ("steps/30", ["w.bin", "w.bin"]),
                               ("steps/30", ["../w.bin"])):
            req = pb.BackupPartRequest(step=30, origin_rank=0, prefix=prefix, upload=upload)
            assert code_of(lambda r=req: stub1.BackupPart(r, timeout=10, metadata=AUTH)) == \
                grpc.StatusCode.INVALID_ARGUMENT, prefix
    for obj, sha in objects.items():
        data = (net.backup / "steps" / "30" / obj).read_bytes()
        assert hashlib.sha256(data).hexdigest() == sha, obj
    assert not (net.backup / "steps" / "31").exists()
    net.assert_outside_intact()


# -- a hostile peer --------------------------------------------------------------------------


class HostilePeer(pb_grpc.ReplicatorServicer):
    """Rank 1 as an attacker holding the token plays it: whatever inventory it is told."""

    def __init__(self) -> None:
        self.inventory = pb.Inventory(rank=1)

    def GetInventory(self, request: pb.InventoryRequest, context: Any) -> pb.Inventory:
        return self.inventory


def _restore(cl: Cluster, rid: str, timeout: float) -> tuple[str, Any]:
    """PrepareRestore at rank 0, with rank 1's ask (the hostile peer's) sent alongside."""
    c0 = PeerClient(cl.addrs[0], cl.creds, rank=0, deadline_s=timeout + 5)
    try:
        with futures.ThreadPoolExecutor(1) as pool:
            ask = pool.submit(c0.call, "Decide", pb.DecideRequest(
                rank=1, restore_id=rid, timeout_seconds=timeout), attempts=1)
            try:
                reply = c0.call("PrepareRestore", pb.PrepareRestoreRequest(
                    timeout_seconds=timeout, restore_id=rid), attempts=1)
                ask.result()
                return "ok", reply
            except PeerError as e:
                return "refused", e
            finally:
                try:
                    ask.result()
                except PeerError:
                    pass
    finally:
        c0.close()


def _code(call: Callable[[], Any]) -> grpc.StatusCode | None:
    try:
        call()
    except PeerError as e:
        return e.code
    return None


def test_a_hostile_peers_inventory_is_refused(base: Path) -> None:
    """An inventory naming paths outside the RAM disk, or an epoch of 2^63-1, is refused
    whole: nothing is written, no epoch is recorded; once the peer is honest the hosts
    agree again. A corrupt agreement record is moved aside, not fatal. Restores that
    wait for ever take at most a few of the server's threads."""
    work = base / "peer"
    work.mkdir()
    (work / "token").write_text(TOKEN)
    cl = Cluster(work, 2, 1, creds=Credentials(token=TOKEN),
                 extra=("--token-file", str(work / "token"),
                        "--agreement-timeout-seconds", "3"))
    peer = HostilePeer()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_ReplicatorServicer_to_server(peer, server)
    server.add_insecure_port(cl.addrs[1])
    server.start()
    (work / "outside").mkdir()  # where the inventory's paths lead
    try:
        cl.start(0)
        with HealthWatch([cl.addrs[0]]):
            evil = pb.Inventory(rank=1)
            for origin in (0, 1):
                evil.copies.add(step=5, origin_rank=origin, files=[
                    pb.FileInfo(path="../../../outside/escape", size=3, crc32c=0),
                    pb.FileInfo(path="/tmp/escape-abs", size=3, crc32c=0)])
            peer.inventory = evil
            outcome, err = _restore(cl, "r-paths", 2.0)
            assert outcome == "refused" and err.code == grpc.StatusCode.ABORTED, err
            assert not list(work.rglob("*escape*")) and not Path("/tmp/escape-abs").exists()
            assert "refused the inventory of rank 1" in cl.log_text(0)

            poisoned = pb.Inventory(rank=1, last_decision=pb.Decision(
                epoch=2**63 - 1, step=1, restore_id="x"))
            peer.inventory = poisoned
            outcome, err = _restore(cl, "r-epoch", 2.0)
            assert outcome == "refused" and err.code == grpc.StatusCode.ABORTED, err
            book = cl.root(0) / BOOK_NAME
            assert not book.exists() or all(
                r["epoch"] < 2**53 for r in json.loads(book.read_text()))

            peer.inventory = pb.Inventory(rank=1)  # honest again
            outcome, reply = _restore(cl, "r-honest", 3.0)
            assert outcome == "ok", reply
            assert reply.step == -1 and 0 < reply.epoch < 2**53
        # A corrupt record file: moved aside at the next start, and agreement goes on.
        cl.kill(0)
        (cl.root(0) / BOOK_NAME).write_text('[{"epoch": 18446744073709551616, "step"')
        cl.start(0)
        outcome, reply = _restore(cl, "r-after-corrupt", 3.0)
        assert outcome == "ok", reply
        assert [n for n in os.listdir(cl.root(0)) if n.startswith(BOOK_NAME + ".corrupt-")]
        # Restores asked with an hour's timeout that cannot be decided (rank 1 never
        # asks): at most eight wait, holding a thread each; the rest are refused at once,
        # and the replicator answers throughout.
        with HealthWatch([cl.addrs[0]]):
            c0 = PeerClient(cl.addrs[0], cl.creds, rank=0, deadline_s=3.0)
            try:
                with futures.ThreadPoolExecutor(12) as pool:
                    held = list(pool.map(lambda i: _code(lambda: c0.call(
                        "PrepareRestore", pb.PrepareRestoreRequest(
                            timeout_seconds=3600, restore_id=f"hold-{i}"), attempts=1)),
                        range(12)))
                    t0 = time.monotonic()
                    c0.call("GetInventory", pb.InventoryRequest(), attempts=1)
                    assert time.monotonic() - t0 < 2
            finally:
                c0.close()
        assert held.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 4, held
        # The eight held end at the caller's deadline, or at the replicator's own
        # --agreement-timeout-seconds (3 here, whatever the hour asked), typed.
        assert held.count(grpc.StatusCode.DEADLINE_EXCEEDED) + \
            held.count(grpc.StatusCode.ABORTED) == 8, held
    finally:
        server.stop(0).wait()
        print(cl.log_text(0)[-3000:])
        cl.stop_all()


# -- certificate holders -----------------------------------------------------------------------


def test_a_certificate_acts_only_for_the_rank_it_names(base: Path) -> None:
    """With mutual TLS a certificate of the cluster's CA is not every rank: a copy, a
    Decide or a backup part only for the rank the certificate names (none for a
    controller's), and a replicator takes a peer's answers only from the rank it
    asked; a replicator whose certificate names another rank does not start."""
    pki = base / "pki"
    pki.mkdir()
    ca = make_ca("hostile test CA")
    ca_pem = write_pem(ca[1], pki / "ca.crt")
    certs = {r: make_leaf(ca, f"node{r}", pki, ranks=[r]) for r in range(2)}
    ctl_crt, ctl_key = make_leaf(ca, "controller", pki)
    controller = Credentials(tls_cert=ctl_crt, tls_key=ctl_key, tls_ca=ca_pem)
    cl = Cluster(base / "tls", 2, 1, creds=controller, extra=("--tls-ca", str(ca_pem)),
                 rank_args={r: ("--tls-cert", str(c), "--tls-key", str(k))
                            for r, (c, k) in certs.items()})
    try:
        cl.start_all()
        cl.commit(0, 1, {"a.bin": os.urandom(1024)})
        cl.wait_held({(1, 0, 1)}, timeout=30)  # the genuine peers reach each other
        host1 = Credentials(tls_cert=certs[1][0], tls_key=certs[1][1], tls_ca=ca_pem)
        data = os.urandom(64)
        fake = _offer(1_000_000, [pb.FileInfo(path="a.bin", size=64, crc32c=crc32c(data))])

        def code(creds: Credentials, rank: int, name: str, req: Any) -> Any:
            c = PeerClient(cl.addrs[rank], creds, rank=rank)
            try:
                return c.call(name, req, attempts=1)
            except PeerError as e:
                return e.code
            finally:
                c.close()

        with HealthWatch(list(cl.addrs), controller):
            denied = grpc.StatusCode.PERMISSION_DENIED
            # Host 1's certificate, acting for rank 0.
            assert code(host1, 1, "Offer", fake) == denied
            assert code(host1, 0, "Decide", pb.DecideRequest(rank=0, timeout_seconds=1)) == \
                denied
            # Its own rank's copy it may offer (and then gives it up).
            own = code(host1, 0, "Offer", _offer(7, [pb.FileInfo(path="a", size=1)], 1))
            assert isinstance(own, pb.OfferReply) and own.transfer_id
            assert code(controller, 0, "Abort", pb.AbortRequest(
                transfer_id=own.transfer_id)) == denied  # not the controller's transfer
            assert isinstance(code(host1, 0, "Abort", pb.AbortRequest(
                transfer_id=own.transfer_id)), pb.AbortReply)
            # The controller's certificate: reads and restores, never a peer's part.
            assert code(controller, 1, "Offer", fake) == denied
            assert code(controller, 0, "Decide", pb.DecideRequest(
                rank=1, timeout_seconds=1)) == denied
            assert code(controller, 1, "BackupPart", pb.BackupPartRequest(
                step=1, origin_rank=0, prefix="steps/1", upload=["a.bin"])) == denied
            inv = code(controller, 1, "GetInventory", pb.InventoryRequest())
            assert (0, 1) in {(c.origin_rank, c.step) for c in inv.copies}
            # A replicator asking rank 1 accepts only a server whose certificate names it.
            impostor = PeerClient(cl.addrs[0], host1, rank=1, as_peer=True)
            try:
                with pytest.raises(PeerError) as ei:
                    impostor.call("GetInventory", pb.InventoryRequest(), attempts=1)
                assert ei.value.code == grpc.StatusCode.UNAVAILABLE
            finally:
                impostor.close()
        assert 1_000_000 not in {c.step for c in cl.inventory(1).copies}
        # A certificate naming another rank than the replicator's: it does not start.
        port = free_ports(1)[0]
        r = subprocess.run([sys.executable, "-m", "mtc.sidecar.replicator.main",
                            "--local-dir", str(base / "tls" / "wrong"),
                            "--listen", f"127.0.0.1:{port}", "--nodes", ",".join(cl.addrs),
                            "--rank", "0", "--tls-cert", str(certs[1][0]), "--tls-key",
                            str(certs[1][1]), "--tls-ca", str(ca_pem)],
                           capture_output=True, text=True, timeout=60, env=env_with_repo())
        assert r.returncode == 2 and "names rank(s) [1]" in r.stderr, r.stderr
    finally:
        for rank in range(2):
            print(f"--- tls replicator {rank} ---\n{cl.log_text(rank)[-2000:]}")
        cl.stop_all()
