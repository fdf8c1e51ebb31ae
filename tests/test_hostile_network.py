"""A hostile network gets nothing: no code run, no byte read or written outside a RAM
disk, no say in what hosts restore, no way to freeze a replicator.

Each test runs attacks of a caller on the same network against real replicator and
sidecar processes on loopback (``tests/replicators.Cluster``), first without
credentials, then holding the shared token or a certificate of the cluster's CA
(docs/security.md says what each may do), and asserts the refusal, that nothing
outside the roots changed (checked on the file system), that the server's memory
stayed bounded (its RSS, from /proc) and that its health check answered throughout.
The network and its checks are ``tests/hostile_net.py``'s; a lying peer replicator,
a colocated call without the token and certificates acting for other ranks are
``tests/test_hostile_peers.py``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import seam_audit
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hostile_net import (
    AUTH,
    WRONG,
    MiB,
    Net,
    code_of,
    details_of,
    offer_of,
    rss,
)

from mtc import errors
from mtc.contract import encode_request
from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.sidecar.replicator.store.store import REPLICA_DIR
from mtc.sidecar.replicator.wire.client import FETCH, PUSH
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process  # every test here starts processes


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    with seam_audit.watched_root("mtc-hostile") as path:
        yield path


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
    # With the token, a request that is not JSON (nested 100,000 deep) is a clear
    # INVALID_ARGUMENT (it was UNKNOWN: a recursion error escaped the handler).
    code, details = details_of(lambda: net.channel(0, sidecar=True).unary_unary(
        "/mtc.Host/Call")(b"[" * 100_000, timeout=5, metadata=AUTH))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not JSON" in details, details
    assert (net.root(0) / "1" / "a.bin").is_file()  # the step the attacker tried to delete
    # With the token, the same sidecar answers: the step is there, and mtc's.
    assert net.call(0, "steps") == {"0": [1]}
    assert net.call(0, "open", lock=False, clean=False) == {
        "0": {"removed": [], "foreign": [], "identity": "", "manifest_bytes":
              (net.root(0) / "1" / MANIFEST_NAME).stat().st_size}}
    net.assert_outside_intact()


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


def test_offers_are_bounded_and_checked(net: Net) -> None:
    """Offers of a million files, of step 2^63-1, of a 2^64-1 byte file, of a path of
    4,200 bytes, of more bytes than the RAM disk has: each refused at once, typed,
    without naming the server's folders, and without holding memory."""
    pid = net.replicator_pid(1)
    stub = pb_grpc.ReplicatorStub(net.channel(1))
    before = rss(pid)
    million = offer_of(9, [pb.FileInfo(path=f"{i}", size=1) for i in range(1_000_000)])
    with net.health():
        for _ in range(3):
            assert code_of(lambda: stub.Offer(million, timeout=60, metadata=AUTH)) == \
                grpc.StatusCode.INVALID_ARGUMENT
        assert rss(pid) - before < 160 * MiB, (before, rss(pid))
        negative = offer_of(9, [pb.FileInfo(path="a", size=1)])
        negative.copy.saved_hosts = -5  # accepted before issue 57
        for req in (negative, offer_of(2**63 - 1, [pb.FileInfo(path="a", size=1)]),
                    offer_of(2**53, [pb.FileInfo(path="a", size=1)]),
                    offer_of(9, [pb.FileInfo(path="a", size=2**64 - 1)]),
                    offer_of(9, [pb.FileInfo(path="a" * 4200, size=1)]),
                    offer_of(9, [pb.FileInfo(path="d/" + "b" * 300, size=1)])):
            code, details = details_of(lambda r=req: stub.Offer(r, timeout=10, metadata=AUTH))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert str(net.base) not in details, details
        code, details = details_of(lambda: stub.Offer(
            offer_of(9, [pb.FileInfo(path="huge.bin", size=1 << 49)]), timeout=10,
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
    offer = offer_of(40, [pb.FileInfo(path="big.bin", size=len(data), crc32c=crc32c(data))])
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
            net.cluster.wait_passes(0)  # a replication pass that saw it
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
    beyond their bound are refused at once; the slow pushes end at their deadline.

    Rank 0's replicator is paused meanwhile: it pushes its older step 1 to rank 1
    again (rank 1 keeps two copies of rank 0's steps, 10 and the 40 of an earlier
    test, and drops step 1), and its offer, from the same origin as the test's,
    replaces the one open transfer of that origin: on CI the test's pushes then all
    found none."""
    ch1 = net.channel(1)
    stub = pb_grpc.ReplicatorStub(ch1)
    watches = []
    with net.paused(0), net.health(ranks=(1,)):
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
        tid = stub.Offer(offer_of(50, [pb.FileInfo(path=f"p{i}", size=len(data),
                                                 crc32c=crc32c(data)) for i in range(36)]),
                         timeout=10, metadata=AUTH).transfer_id
        stop = threading.Event()
        starts: list[float] = []

        def slow(i: int) -> str:
            starts.append(time.monotonic())

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
            # Every stream started and the server already refusing some: the flood is
            # there before the probes (not a sleep a loaded machine may not honour).
            wait_until("every stream started and one refused", lambda: len(starts) >= 36 and any(
                f.done() for f in results), 10, poll_s=0.01,
                detail=lambda: f"{len(starts)} started, refused: "
                               f"{any(f.done() for f in results)}")
            for _ in range(5):  # the server answers while they drip
                t1 = time.monotonic()
                stub.GetInventory(pb.InventoryRequest(), timeout=2, metadata=AUTH)
                assert time.monotonic() - t1 < 2
                time.sleep(0.2)
            codes = [f.result(timeout=20) for f in results]
            took = time.monotonic() - t0
            stop.set()
        # At most 8 streams held at once: each admitted one is ended after its 1 s
        # grace, so streams that arrive over a longer spread (a loaded machine) may
        # find room again once a second.
        generations = 1 + int((max(starts) - min(starts)) // 1.0)
        assert codes.count("RESOURCE_EXHAUSTED") >= 36 - 8 * generations, (codes, generations)
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
        wait_until("host 1's damaged copy healed and listed again", lambda: copy.exists()
                   and copy.read_bytes() == files["a.bin"] and (1, 0, 20) in net.cluster.held(),
                   20, poll_s=0.1)
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
