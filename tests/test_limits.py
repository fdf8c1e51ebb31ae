"""The bounds a caller meets, alone: stream deadlines and rates (:func:`overdue`), the
checks of what requests and peers name (``mtc.validate``, ``replicator/checks.py``,
``sidecar/load.check_tasks``), the paths opened without following a symlink
(``sidecar/confine.py``), and a real in-process gRPC server whose health watches
hold none of its two threads.
"""

from __future__ import annotations

import os
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtc import validate
from mtc.contract import AgentConfig, Piece, ReadTask, SaveHeader, decode_request, encode_request
from mtc.errors import BusyError, InvalidStepError, ProtocolError, UnsafePathError
from mtc.manifest import ShardEntry
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.confine import open_beneath, real_dir
from mtc.sidecar.replicator import checks
from mtc.sidecar.replicator.copies.transfers import Transfer, Transfers
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.wire.decode_guard import DecodeGuard
from mtc.sidecar.replicator.wire.limits import BoundedHealth, Gate, Limits, Streams, overdue
from mtc.sidecar.restore.load import check_tasks
from mtc.sidecar.storage.quarantine import QUARANTINE_DIR, quarantine

LIMITS = Limits(min_rate=1000.0, grace_s=2.0)


@pytest.mark.parametrize(("sent", "expected", "elapsed", "ends"), [
    (0, 0, 1.0, False),          # within its grace
    (0, 0, 3.0, True),           # nothing sent after the grace
    (3000, 0, 3.0, False),       # 1000 bytes/s: the minimum
    (2999, 0, 3.0, True),
    (10_000, 10_000, 11.9, False),  # deadline: grace + 10 s at the minimum rate
    (9_000, 10_000, 12.1, True),
    (1 << 30, 0, 100.0, False),  # an unknown size, fast enough
])
def test_overdue(sent: int, expected: int, elapsed: float, ends: bool) -> None:
    assert (overdue(sent, expected, elapsed, LIMITS) is not None) == ends


class _Context:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_streams_are_bounded_per_caller_and_overdue_ones_cancelled() -> None:
    now = [0.0]
    streams = Streams(Limits(max_streams=3, max_per_peer=2, max_watches=1, min_rate=10,
                             grace_s=1.0, reserved=0, settle_s=100.0), clock=lambda: now[0])
    ctx = [_Context() for _ in range(5)]
    a = streams.acquire("push", "p1", ctx[0])
    b = streams.acquire("fetch", "p1", ctx[1])
    with pytest.raises(BusyError, match="this caller"):
        streams.acquire("push", "p1", ctx[2])
    c = streams.acquire("push", "p2", ctx[2])
    with pytest.raises(BusyError, match="data streams are open"):
        streams.acquire("push", "p3", ctx[3])
    streams.acquire("watch", "p3", ctx[4])
    with pytest.raises(BusyError, match="watches"):
        streams.acquire("watch", "p4", _Context())
    now[0] = 2.0
    a.add(100)
    c.add(15)  # 7.5 bytes/s: under the minimum
    assert {s.kind + s.peer for s in streams.sweep()} == {"fetchp1", "pushp2"}
    assert (ctx[0].cancelled, ctx[1].cancelled, ctx[2].cancelled) == (False, True, True)
    streams.release(a)
    streams.release(b)
    assert streams.count("push") == 0 and streams.count("watch") == 1
    streams.close()


def test_a_reader_flood_leaves_places_to_restores_and_replication() -> None:
    """Issue 66: 16 fetches, each just above the minimum rate, held every data stream
    for minutes, and a replaced host's restore failed ``RESOURCE_EXHAUSTED``. Now
    readers take at most 12 places, a caller's share is one whatever its addresses
    (``peer_of``), and a restore or a push finding no place ends the slowest
    settled reader; a reader of a good rate is never ended for it."""
    now = [0.0]
    lim = Limits(min_rate=10, grace_s=1.0)
    streams = Streams(lim, clock=lambda: now[0])
    readers = []
    for i in range(lim.max_streams - lim.reserved):  # from many addresses
        readers.append(streams.acquire("fetch", f"addr{i // 4}", _Context()))
    with pytest.raises(BusyError, match="data streams are open"):  # no reader settled yet
        streams.acquire("fetch", "addr9", _Context())
    pushes = [streams.acquire("push", "rank 1", _Context(), priority=True)
              for _ in range(lim.reserved)]  # the reserved places: replication's
    now[0] = 5.0
    for r in readers:
        r.add(5 * 300 * 1024)  # 300 KiB/s: above the minimum, below evict_below
    readers[3].add(5 * 64 * 1024 * 1024)  # one reads at 64 MiB/s: never ended
    restore = [streams.acquire("fetch", "rank 0", _Context(), priority=True)
               for _ in range(4)]  # a replaced host's 4 streams, all full: readers end
    assert streams.count() == lim.max_streams and len(restore) == 4
    ended = [r for r in readers if r.context.cancelled]
    assert len(ended) == 4 and not readers[3].context.cancelled and \
        not any(p.context.cancelled for p in pushes)
    # A settled reader's place can go to another reader too (it is the slowest).
    streams.acquire("fetch", "addr9", _Context())
    assert sum(r.context.cancelled for r in readers) == 5
    streams.close()


def test_a_gate_lets_so_many_wait_per_key() -> None:
    gate = Gate(2, "asks")
    with gate.enter(1), gate.enter(1), gate.enter(2):
        with pytest.raises(BusyError, match="2 asks"), gate.enter(1):
            pass
    with gate.enter(1), gate.enter(1):  # released on the way out, errors included
        pass


def test_validate_steps_and_paths() -> None:
    for good in (0, 1, validate.MAX_STEP):
        assert validate.step(good) == good
    for bad in (-1, validate.MAX_STEP + 1, 2**63 - 1, True, 1.0, "1", "../x", None):
        with pytest.raises(InvalidStepError):
            validate.step(bad)
    assert validate.relpath("a/b.bin") == "a/b.bin"
    for bad in ("", "/etc/passwd", "../x", "a/../b", "a//b", "a/./b", "a\\b", "a\x00b",
                "x" * 4200, "d/" + "n" * 256, 5):
        with pytest.raises(UnsafePathError):
            validate.relpath(bad)  # type: ignore[arg-type]



OFFERED = [FileMeta("a", 3, 7), FileMeta("b", 0, 0), FileMeta("c/d", 5, 9)]


@pytest.mark.parametrize("idx, named", [
    ([0], ["a"]), ([2, 0], ["c/d", "a"]), ([1], ["b"]),
    ([], None), ([3], None), ([-1], None), ([0, 0], None), ([0, 1, 2, 0], None),
])
def test_a_push_names_offered_files_each_once(idx: list[int], named: list[str] | None
                                              ) -> None:
    """The one check of both transports (the data channel's request, gRPC's x-mtc-files)."""
    if named is None:
        with pytest.raises(ValueError, match="outside the offer of 3, or twice"):
            checks.pushed(OFFERED, idx)
    else:
        assert [f.path for f in checks.pushed(OFFERED, idx)] == named


@pytest.mark.parametrize("got, value, bad", [
    (3, 7, False), (2, 7, True), (4, 7, True), (3, 8, True), (0, 0, True),
])
def test_a_pushed_file_counts_only_as_offered(got: int, value: int, bad: bool) -> None:
    err = checks.not_as_offered(OFFERED[0], got, value, step=4, origin=1)
    assert (err is not None) == bad
    if err is not None:
        assert (err.step, err.host, err.path) == (4, 1, "a")
        assert f"received {got} bytes" in str(err)

def test_host_requests_name_steps_as_integers() -> None:
    op, hosts, args = decode_request(encode_request("delete", [0], step=5))
    assert (op, hosts, args) == ("delete", [0], {"step": 5})
    for step in ("../x", "/etc", -3, 2**63 - 1, True):
        with pytest.raises(InvalidStepError):
            decode_request(encode_request("delete", [0], step=step))
    with pytest.raises(InvalidStepError):
        decode_request(encode_request("retain", [0], complete=[1, "2"], max_to_keep=1,
                                      keep_period=None, before_write=False))
    with pytest.raises(ProtocolError):
        decode_request(encode_request("steps", ["0"]))
    with pytest.raises(InvalidStepError):
        SaveHeader.from_bytes(b'{"step": "../x", "leaves": [], "array_leaves": [], '
                              b'"skip_if_busy": false}')
    assert AgentConfig  # the seam's vocabulary, imported whole


def _task(index: tuple[tuple[int, int], ...], *pieces: tuple[tuple[int, int], ...],
          dtype: str = "float32") -> ReadTask:
    return ReadTask(0, index, dtype, (0,), tuple(
        Piece(0, ShardEntry(p, f"s{i}", 4 * (p[0][1] - p[0][0]), 0))
        for i, p in enumerate(pieces)))


def test_read_tasks_must_be_covered_by_their_pieces() -> None:
    assert check_tasks([_task(((0, 8),), ((0, 4),), ((4, 8),))], step=1, host=0) == 32
    assert check_tasks([_task(((2, 6),), ((0, 4),), ((4, 8),))], step=1, host=0) == 16
    for bad in (_task(((0, 8),)),                                   # no pieces at all
                _task(((0, 8),), ((0, 4),)),                        # half of it
                _task(((0, 1 << 28),)),                             # 1 GiB of nothing
                _task(((0, 8),), ((0, 8),), dtype="object")):       # pointers
        with pytest.raises(ProtocolError):
            check_tasks([bad], step=1, host=0)
    twice = ReadTask(0, ((0, 8),), "float32", (0,), (
        Piece(0, ShardEntry(((0, 8),), "s", 32, 0)),) * 2)
    with pytest.raises(ProtocolError, match="twice"):
        check_tasks([twice], step=1, host=0)
    lying = ReadTask(0, ((0, 8),), "float32", (0,), (
        Piece(0, ShardEntry(((0, 8),), "s", 1 << 30, 0)),))
    with pytest.raises(ProtocolError, match="not its region"):
        check_tasks([lying], step=1, host=0)


def test_offers_and_inventories_are_checked_whole() -> None:
    ok = pb.StepCopy(step=3, origin_rank=0, files=[pb.FileInfo(path="a/b", size=2)])
    assert checks.offer(ok, rank=1, num_nodes=2) == (0, 3, [FileMeta("a/b", 2, 0)])
    for bad in (pb.StepCopy(step=3, origin_rank=1), pb.StepCopy(step=2**63 - 1),
                pb.StepCopy(step=3, files=[pb.FileInfo(path="a", size=2**64 - 1)]),
                pb.StepCopy(step=3, files=[pb.FileInfo(path="../a")]),
                pb.StepCopy(step=3, files=[pb.FileInfo(path="a"), pb.FileInfo(path="a")])):
        with pytest.raises((ProtocolError, InvalidStepError, UnsafePathError)):
            checks.offer(bad, rank=1, num_nodes=2)
    # A name both a file and a folder (found by tests/test_fuzz_grpc.py: the push
    # failed half-way, as an internal error); names that only share a prefix are fine.
    for clash in (["a.bin", "a.bin/extra"], ["x/y/z", "x/y"], ["x", "x/y/z"]):
        with pytest.raises(ProtocolError, match="both as a file and as a folder"):
            checks.offer(pb.StepCopy(step=3, files=[pb.FileInfo(path=f) for f in clash]),
                         rank=1, num_nodes=2)
    fine = pb.StepCopy(step=3, files=[pb.FileInfo(path=f) for f in ("a", "ab/c", "a.b/c")])
    assert len(checks.offer(fine, rank=1, num_nodes=2)[2]) == 3
    inv = pb.Inventory(rank=1, last_decision=pb.Decision(epoch=3, step=2))
    inv.copies.add(step=2, origin_rank=0, files=[pb.FileInfo(path="x", size=1,
                                                             sha256=bytes(32))])
    inv.damaged.add(step=2, origin_rank=1, files=[pb.FileInfo(path="y", size=1)])
    assert checks.inventory(inv, rank=1, num_nodes=2) is inv
    for mutate in (lambda i: setattr(i, "rank", 0),
                   lambda i: setattr(i.last_decision, "epoch", 2**63 - 1),
                   lambda i: i.backed_up_steps.append(-5),
                   lambda i: i.copies[0].files.add(path="/etc/x"),
                   lambda i: setattr(i.copies[0], "origin_rank", 9),
                   lambda i: i.damaged[0].files.add(path="../y"),
                   lambda i: setattr(i.damaged[0], "step", -3),
                   lambda i: setattr(i.damaged[0], "origin_rank", 0),  # not its own
                   lambda i: i.copies[0].files.add(path="x/y"),  # "x" a file and a folder
                   lambda i: i.copies[0].files.add(path="x"),  # twice
                   lambda i: setattr(i.copies[0].files[0], "sha256", bytes(33))):
        bad = pb.Inventory()
        bad.CopyFrom(inv)
        mutate(bad)
        with pytest.raises((ProtocolError, InvalidStepError, UnsafePathError)):
            checks.inventory(bad, rank=1, num_nodes=2)
    for prefix in ("steps/3", "staging/3-0123abcd"):
        checks.backup_part(pb.BackupPartRequest(step=3, prefix=prefix, upload=["a"]),
                           num_nodes=2)
    for prefix in ("steps/4", "steps/3/../4", "staging/4-0123abcd", "x", ""):
        with pytest.raises(ProtocolError):
            checks.backup_part(pb.BackupPartRequest(step=3, prefix=prefix), num_nodes=2)
    with pytest.raises(ProtocolError, match="twice"):
        checks.fetch(pb.FetchRequest(step=1, path="a", more_paths=["a"]), num_nodes=2)
    # The coordinator's garbage-collection view: at most two valid steps.
    assert checks.kept(pb.CompleteReply(kept=[4, 6]), host=0) == {4, 6}
    for kept in ([-1], [2**63 - 1], [1, 2, 3]):
        with pytest.raises((ProtocolError, InvalidStepError)):
            checks.kept(pb.CompleteReply(kept=kept), host=0)


def test_one_open_transfer_per_origin_sized_against_the_disk(tmp_path: Path) -> None:
    free = [100]
    table = Transfers(lambda: free[0], max_files=3, idle_s=60)

    def t(origin: int, size: int, n: int = 1) -> Transfer:
        d = tmp_path / f"t{origin}-{size}-{n}-{time.monotonic_ns()}"
        d.mkdir()
        return Transfer(origin, 1, d, [FileMeta(f"f{i}", size, 0) for i in range(n)])

    first = t(0, 60)
    a = table.open(first)
    b = table.open(t(0, 60))  # a replay: replaces the first
    assert table.get(a) is None and table.get(b) is not None and not first.tmp.exists()
    with pytest.raises(BusyError, match="bytes"):
        table.open(t(1, 60))  # together with the one open, more than the disk has
    with pytest.raises(BusyError, match="files"):
        table.open(t(1, 1, n=3))
    assert table.take(b) is not None and table.take(b) is None


def test_paths_open_without_following_a_symlink(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "d").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("secret")
    (root / "d" / "f").write_text("ok")
    (root / "link").symlink_to(outside)
    (root / "d" / "flink").symlink_to(outside / "secret")
    with os.fdopen(open_beneath(root, "d/f")) as f:
        assert f.read() == "ok"
    for rel in ("link/secret", "d/flink", "../outside/secret"):
        with pytest.raises(UnsafePathError):
            open_beneath(root, rel)
    fd = open_beneath(root, "new/deep/file", os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                      makedirs=True)
    os.close(fd)
    assert (root / "new" / "deep" / "file").is_file()
    # An internal folder planted as a symlink: the link goes, a folder takes its place;
    # a file quarantined there lands in it, and nothing outside is touched.
    (root / QUARANTINE_DIR).symlink_to(outside)
    bad = root / "d" / "f"
    moved = quarantine(root, bad, "test")
    assert moved is not None and moved.parent == root / QUARANTINE_DIR
    assert not (root / QUARANTINE_DIR).is_symlink() and os.listdir(outside) == ["secret"]
    assert quarantine(root, outside / "secret", "outside") is None
    assert (outside / "secret").read_text() == "secret"
    assert real_dir(root / "fresh").is_dir()


class _Never:
    """A servicer whose one method never needs to answer: it only proves threads."""


def test_health_watches_hold_no_server_thread() -> None:
    """A real server of two threads behind the replicator's interceptors: four open
    Watch streams leave both threads free, so Check answers at once (gRPC's health
    Watch is non-blocking; an interceptor that rewraps it would make it hold one)."""
    streams = Streams()
    pool = futures.ThreadPoolExecutor(2)
    server = grpc.server(pool, interceptors=[DecodeGuard()])
    health = BoundedHealth(streams)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    watches: list[Any] = []
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        for _ in range(4):
            w = stub.Watch(health_pb2.HealthCheckRequest(), timeout=20)
            assert next(w).status == health_pb2.HealthCheckResponse.SERVING
            watches.append(w)
        t0 = time.monotonic()
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=3).status == \
            health_pb2.HealthCheckResponse.SERVING
        assert time.monotonic() - t0 < 2
        assert streams.count("watch") == 4
    finally:
        for w in watches:
            w.cancel()
        ch.close()
        server.stop(0).wait()
        streams.close()
        pool.shutdown(wait=True)
