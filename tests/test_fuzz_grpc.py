"""Fuzzing every gRPC method of a real replicator server, in process, on loopback.

Random and malformed requests (random bytes where a protobuf is expected, random
fields, sizes, offsets, transfer ids, metadata and paths meant to escape the root)
never produce an untyped failure: every refusal is a mapped status (no UNKNOWN,
no INTERNAL, no hang), and nothing is ever written outside the replicator's root.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fuzzing  # noqa: F401  (hypothesis profiles)
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from replicators import commit_mtc_step
from served_node import ServedNode

from mtc.credentials import Credentials
from mtc.proto import replicator_pb2 as pb

UNTYPED = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
           grpc.StatusCode.DEADLINE_EXCEEDED}
SERVICE = "/mtc.replicator.v1.Replicator/"
METHODS = {"GetInventory": pb.InventoryRequest, "Offer": pb.OfferRequest,
           "Link": pb.LinkRequest, "Commit": pb.CommitRequest, "Abort": pb.AbortRequest,
           "Decide": pb.DecideRequest, "GetComplete": pb.CompleteRequest,
           "PrepareRestore": pb.PrepareRestoreRequest,
           "Restored": pb.RestoredRequest, "RequestBackup": pb.BackupRequest,
           "BackupPart": pb.BackupPartRequest}

paths = st.one_of(
    st.sampled_from(["a.bin", "d-b.bin", "../escape", "../../escape", "/etc/passwd", "",
                     ".", "a/../../escape", "a//b", "x\x00y", "..\\escape", "sub/./c",
                     ".mtc-replica/0/1/a.bin", "a.bin/extra"]),
    st.text(max_size=12))
ints = st.one_of(st.integers(-3, 5), st.integers(-2**31, 2**31 - 1))  # fits int32 fields
u32 = st.integers(0, 2**32 - 1)
u64 = st.one_of(st.integers(0, 70), st.integers(0, 2**64 - 1))


class Server(ServedNode):
    def __init__(self, base: Path) -> None:
        self.base = base
        (base / "sentinel").mkdir()
        (base / "sentinel" / "keep").write_text("x")
        super().__init__(base / "root", Credentials(), lambda root: commit_mtc_step(
            root, 1, {"a.bin": b"A" * 5000, "d-b.bin": b"B" * 10}, host=0, num_hosts=2),
            # Its peer (rank 1) is never there, and what asks it is waited out: a
            # GetComplete's view gathers until ``deadline_s`` and is made at most every
            # ``gc_view_interval_s`` (a second: later calls waited for it), a Decide or
            # PrepareRestore waits the agreement's timeout (the request's own, capped
            # at 10 times it). Short here, so these examples are not most of the
            # file's seconds; the fuzzed timeouts (0.01-1 s) still fall on both sides
            # of the cap.
            deadline_s=0.05, agreement_timeout_s=0.02, gc_view_interval_s=0.01)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def close(self) -> None:
        self.channel.close()
        super().close()

    def outside(self) -> list[str]:
        """Anything under the base folder that is not the root or the sentinel."""
        names = sorted(os.listdir(self.base))
        assert (self.base / "sentinel" / "keep").read_text() == "x"
        assert os.listdir(self.base / "sentinel") == ["keep"]
        return [n for n in names if n not in ("root", "sentinel")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("fuzz-grpc"))
    yield s
    s.close()


def call(server: Server, method: str, payload: bytes, metadata: Any = None) -> None:
    rpc = server.channel.unary_unary(SERVICE + method, request_serializer=None,
                                     response_deserializer=None)
    try:
        rpc(payload, timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        assert e.code() not in UNTYPED, (method, e.code(), e.details())


def check_outside(server: Server) -> None:
    assert server.outside() == [], server.outside()


@st.composite
def messages(draw: st.DrawFn) -> tuple[str, bytes]:
    method = draw(st.sampled_from(sorted(METHODS)))
    if draw(st.booleans()):
        return method, draw(st.binary(max_size=64))  # not a valid protobuf, mostly
    tid = draw(st.one_of(st.text(max_size=8), st.just("")))
    files = st.lists(st.builds(pb.FileInfo, path=paths, size=u64, crc32c=u32), max_size=4)
    copy = st.builds(pb.StepCopy, step=ints, origin_rank=ints, files=files)
    msg: Any = {
        "GetInventory": st.just(pb.InventoryRequest()),
        "Offer": st.builds(pb.OfferRequest, copy=copy),
        "Link": st.builds(pb.LinkRequest, transfer_id=st.just(tid),
                          paths=st.lists(paths, max_size=3)),
        "Commit": st.builds(pb.CommitRequest, transfer_id=st.just(tid)),
        "Abort": st.builds(pb.AbortRequest, transfer_id=st.just(tid)),
        "Decide": st.builds(pb.DecideRequest, rank=ints, restore_id=st.text(max_size=8),
                            timeout_seconds=st.one_of(
                                st.floats(0.01, 1.0), st.sampled_from(
                                    [0.0, -1.0, float("nan"), float("inf"), 1e300]))),
        "GetComplete": st.just(pb.CompleteRequest()),
        "PrepareRestore": st.builds(pb.PrepareRestoreRequest, timeout_seconds=st.one_of(
            st.floats(0.01, 1.0), st.sampled_from([0.0, -1.0, float("nan"),
                                                   float("inf"), 1e300]))),
        "Restored": st.builds(pb.RestoredRequest, restore_id=st.text(max_size=8), step=ints),
        "RequestBackup": st.builds(pb.BackupRequest, step=ints),
        "BackupPart": st.builds(pb.BackupPartRequest),
    }[method]
    return method, draw(msg).SerializeToString()


@given(messages())
def test_control_methods(server: Server, m: tuple[str, bytes]) -> None:
    call(server, *m)
    check_outside(server)


@given(st.lists(st.builds(pb.FileInfo, path=paths, size=st.integers(0, 64), crc32c=u32),
                min_size=1, max_size=3, unique_by=lambda f: f.path),
       st.data())
def test_offer_push_link_commit(server: Server, files: list[pb.FileInfo],
                                data: st.DataObject) -> None:
    """A whole transfer driven with random metadata, bytes and paths."""
    offer = pb.OfferRequest(copy=pb.StepCopy(step=data.draw(st.integers(0, 3)),
                                             origin_rank=1, files=files))
    stub = server.channel.unary_unary(SERVICE + "Offer", request_serializer=None,
                                      response_deserializer=pb.OfferReply.FromString)
    try:
        reply = stub(offer.SerializeToString(), timeout=10)
        tid = reply.transfer_id
    except grpc.RpcError as e:
        assert e.code() not in UNTYPED, e.details()
        tid = data.draw(st.text(max_size=6))
    push = server.channel.stream_unary("/mtc.replicator.v1.Data/Push",
                                       request_serializer=None, response_deserializer=None)
    for _ in range(data.draw(st.integers(1, 3))):
        md: list[tuple[str, str]] = [("x-mtc-transfer", tid)]
        if data.draw(st.booleans()):
            md.append(("x-mtc-files", data.draw(st.sampled_from(
                ["0", "0,1", "1,0", "0,0", "-1", "x", "", "99", "0,1,2"]))))
        else:
            f = data.draw(st.sampled_from(files))
            md += [("x-mtc-path", data.draw(st.one_of(st.just(f.path), paths))),
                   ("x-mtc-size", str(data.draw(st.one_of(st.just(f.size), ints)))),
                   ("x-mtc-crc32c", str(data.draw(st.one_of(st.just(f.crc32c), u32))))]
        chunks = data.draw(st.lists(st.binary(max_size=70), max_size=3))
        if not all(v.isascii() and v.isprintable() for _, v in md):
            continue  # gRPC's client refuses to send such metadata at all
        try:
            push(iter(chunks), timeout=10, metadata=md)
        except grpc.RpcError as e:
            assert e.code() not in UNTYPED, e.details()
    link = pb.LinkRequest(transfer_id=tid, paths=data.draw(st.lists(paths, max_size=2)))
    call(server, "Link", link.SerializeToString())
    call(server, "Commit", pb.CommitRequest(transfer_id=tid).SerializeToString())
    call(server, "Abort", pb.AbortRequest(transfer_id=tid).SerializeToString())
    check_outside(server)


@given(st.one_of(st.binary(max_size=40),
                 st.builds(pb.FetchRequest, step=ints, origin_rank=ints, path=paths,
                           offset=st.one_of(u64, st.integers(0, 6000)),
                           more_paths=st.lists(paths, max_size=3)).map(
                     lambda r: r.SerializeToString())))
def test_fetch(server: Server, payload: bytes) -> None:
    fetch = server.channel.unary_stream("/mtc.replicator.v1.Data/Fetch",
                                        request_serializer=None, response_deserializer=None)
    try:
        got = b"".join(fetch(payload, timeout=10))
    except grpc.RpcError as e:
        assert e.code() not in UNTYPED, e.details()
        return
    req = pb.FetchRequest.FromString(payload)
    # Only bytes of files held here: from the offset asked, or several back to back.
    held = {"a.bin": b"A" * 5000, "d-b.bin": b"B" * 10}
    if req.more_paths:
        assert req.offset == 0
        assert got == b"".join(held[p] for p in [req.path, *req.more_paths])
    else:
        assert got == held[req.path][req.offset:]
