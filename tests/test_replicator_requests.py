"""What a request to a replicator may name.

Real replicator processes: paths that try to leave the RAM disk (in offers, in
fetches, through symlinks planted in a copy), and malformed and oversized
requests: each is refused with its status code, and the replicator still serves.
Who may talk to a replicator: ``tests/test_replicator_security.py``.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from replicator_refusals import assert_serving, code_of
from replicators import Cluster, new_cluster

from mtc.grpc_errors import PeerError
from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.sidecar.replicator.store.store import REPLICA_DIR
from mtc.sidecar.replicator.wire.client import FETCH, PUSH

pytestmark = pytest.mark.process  # every test here starts processes

SECRET = b"top secret outside the RAM disk\n"


# -- paths -------------------------------------------------------------------------


BAD_PATHS = ["../x", "/etc/passwd", "a/../../b", "..", "a/./b", "a//b", "", "a\\..\\b",
             "a\x00b", "x/.."]


def test_paths_cannot_leave_the_root(ramdisk: Path, clusters: list[Cluster]) -> None:
    secret = ramdisk / "secret.txt"
    secret.write_bytes(SECRET)
    cl = new_cluster(clusters, ramdisk, 2, 1)
    cl.start_all()
    cl.commit(0, 1, {"a.bin": os.urandom(2048)})
    cl.wait_held({(1, 0, 1)})
    c = cl.client(1)
    ch = grpc.insecure_channel(cl.addrs[1])
    fetch = ch.unary_stream(FETCH)
    try:
        for bad in BAD_PATHS:
            offer = pb.OfferRequest(copy=pb.StepCopy(step=2, origin_rank=0, files=[
                pb.FileInfo(path="ok.bin", size=1, crc32c=0),
                pb.FileInfo(path=bad, size=len(SECRET), crc32c=crc32c(SECRET))]))
            with pytest.raises(PeerError) as ei:
                c.call("Offer", offer, attempts=1)
            assert code_of(ei.value) == grpc.StatusCode.INVALID_ARGUMENT, repr(bad)
            with pytest.raises(grpc.RpcError) as ri:
                list(fetch(pb.FetchRequest(step=1, origin_rank=0, path=bad).SerializeToString(),
                           timeout=5))
            assert ri.value.code() == grpc.StatusCode.INVALID_ARGUMENT, repr(bad)
        # No incoming copy was started for any of them.
        assert not (cl.root(1) / REPLICA_DIR / "0" / "2").exists()
        assert not [n for n in os.listdir(cl.root(1) / REPLICA_DIR / "0") if "tmp" in n]

        # Symlinks planted in a committed copy (a file, and a folder) lead nowhere.
        copy = cl.root(1) / REPLICA_DIR / "0" / "1"
        (copy / "evil").symlink_to(secret)
        (copy / "evil-dir").symlink_to(ramdisk)
        (copy / "passwd").symlink_to("/etc/passwd")
        for rel in ("evil", "evil-dir/secret.txt", "passwd"):
            got = b""
            with pytest.raises(grpc.RpcError) as ri:
                for chunk in fetch(pb.FetchRequest(step=1, origin_rank=0,
                                                   path=rel).SerializeToString(), timeout=5):
                    got += chunk
            assert ri.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                       grpc.StatusCode.NOT_FOUND), rel
            assert got == b"", rel
        # The same on the origin's own step folder.
        (cl.root(0) / "1" / "evil").symlink_to(secret)
        ch0 = grpc.insecure_channel(cl.addrs[0])
        try:
            with pytest.raises(grpc.RpcError) as ri:
                list(ch0.unary_stream(FETCH)(pb.FetchRequest(
                    step=1, origin_rank=0, path="evil").SerializeToString(), timeout=5))
            assert ri.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                       grpc.StatusCode.NOT_FOUND)
        finally:
            ch0.close()
        # The symlinks never entered a description either.
        assert {f.path for x in cl.inventory(1).copies
                for f in x.files} == {"a.bin", MANIFEST_NAME}
        # A real file still comes back whole.
        got = b"".join(fetch(pb.FetchRequest(step=1, origin_rank=0,
                                             path="a.bin").SerializeToString(), timeout=5))
        assert got == (cl.root(0) / "1" / "a.bin").read_bytes()
    finally:
        ch.close()
        c.close()
    assert_serving(cl, 0)
    assert_serving(cl, 1)


# -- malformed requests ----------------------------------------------------------------


def test_malformed_requests_get_errors_not_crashes(ramdisk: Path,
                                                   clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1)
    cl.start_all()
    ch = grpc.insecure_channel(cl.addrs[1], options=[("grpc.max_send_message_length", -1)])
    stub = pb_grpc.ReplicatorStub(ch)
    fetch = ch.unary_stream(FETCH)
    push = ch.stream_unary(PUSH, response_deserializer=pb.PushAck.FromString)

    def rpc_code(fn: Any, *args: Any, **kw: Any) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as ei:
            r = fn(*args, timeout=10, **kw)
            if not isinstance(r, Message):
                list(r)  # drain a stream
        return ei.value.code()

    try:
        # Garbage instead of a FetchRequest.
        assert rpc_code(fetch, b"\xff\xff\xff\xff\x0f") == grpc.StatusCode.INVALID_ARGUMENT
        # A fetch of something not held.
        assert rpc_code(fetch, pb.FetchRequest(step=9, origin_rank=0, path="a").
                        SerializeToString()) == grpc.StatusCode.NOT_FOUND
        # Push without any metadata, and with an unknown transfer.
        assert rpc_code(push, iter([b"abc"])) in (grpc.StatusCode.INVALID_ARGUMENT,
                                                 grpc.StatusCode.NOT_FOUND)
        assert rpc_code(push, iter([b"abc"]), metadata=[
            ("x-mtc-transfer", "nope"), ("x-mtc-path", "a.bin"), ("x-mtc-size", "3"),
            ("x-mtc-crc32c", str(crc32c(b"abc")))]) == grpc.StatusCode.NOT_FOUND
        # Control calls naming nothing valid.
        for name, req in (("Link", pb.LinkRequest(transfer_id="nope", paths=["a"])),
                          ("Commit", pb.CommitRequest(transfer_id="nope"))):
            assert rpc_code(getattr(stub, name), req) == grpc.StatusCode.NOT_FOUND, name
        for origin in (1, -1, 7):  # itself, and ranks that do not exist
            assert rpc_code(stub.Offer, pb.OfferRequest(copy=pb.StepCopy(
                step=1, origin_rank=origin, files=[pb.FileInfo(path="a", size=1)]))) == \
                grpc.StatusCode.INVALID_ARGUMENT, origin
        assert rpc_code(stub.Offer, pb.OfferRequest(copy=pb.StepCopy(
            step=1, origin_rank=0, files=[pb.FileInfo(path="a", size=1),
                                          pb.FileInfo(path="a", size=1)]))) == \
            grpc.StatusCode.INVALID_ARGUMENT

        # A real transfer: push one file correctly, then more bytes than offered.
        data = os.urandom(100_000)
        other = os.urandom(10)
        offer = stub.Offer(pb.OfferRequest(copy=pb.StepCopy(step=3, origin_rank=0, files=[
            pb.FileInfo(path="f.bin", size=len(data), crc32c=crc32c(data)),
            pb.FileInfo(path="g.bin", size=len(other), crc32c=crc32c(other))])), timeout=10)
        tid = offer.transfer_id
        md = [("x-mtc-transfer", tid), ("x-mtc-path", "f.bin"), ("x-mtc-size", str(len(data))),
              ("x-mtc-crc32c", str(crc32c(data)))]
        assert push(iter([data[:50_000], data[50_000:]]), timeout=10, metadata=md).size == \
            len(data)
        # The same path again, now with exactly the offered size of other bytes and
        # then one more: refused, and the earlier good copy no longer counts.
        assert rpc_code(push, iter([os.urandom(len(data)), b"!"]), metadata=md) == \
            grpc.StatusCode.DATA_LOSS
        # Metadata that disagrees with the offer.
        assert rpc_code(push, iter([other]), metadata=[
            ("x-mtc-transfer", tid), ("x-mtc-path", "g.bin"), ("x-mtc-size", "11"),
            ("x-mtc-crc32c", str(crc32c(other)))]) == grpc.StatusCode.INVALID_ARGUMENT
        # A path outside the offer.
        assert rpc_code(push, iter([other]), metadata=[
            ("x-mtc-transfer", tid), ("x-mtc-path", "../g.bin"), ("x-mtc-size", "10"),
            ("x-mtc-crc32c", str(crc32c(other)))]) == grpc.StatusCode.INVALID_ARGUMENT
        gmd = [("x-mtc-transfer", tid), ("x-mtc-path", "g.bin"), ("x-mtc-size", "10"),
               ("x-mtc-crc32c", str(crc32c(other)))]
        assert push(iter([other]), timeout=10, metadata=gmd).size == 10
        # f.bin's good bytes were overwritten by the refused push: no commit.
        assert rpc_code(stub.Commit, pb.CommitRequest(transfer_id=tid)) == \
            grpc.StatusCode.DATA_LOSS
        assert (0, 3) not in {(x.origin_rank, x.step) for x in cl.inventory(1).copies}
        # Pushed again correctly, the copy commits.
        assert push(iter([data]), timeout=10, metadata=md).size == len(data)
        stub.Commit(pb.CommitRequest(transfer_id=tid), timeout=10)
        copy = cl.root(1) / REPLICA_DIR / "0" / "3"
        assert (copy / "f.bin").read_bytes() == data and (copy / "g.bin").read_bytes() == other

        # Several files in one push (x-mtc-files: indices into the offer), split
        # across chunks at any byte; malformed or out-of-offer lists are refused,
        # as are a batch cut short and one with a byte too many.
        parts = [os.urandom(n) for n in (3000, 0, 17, 5000)]
        offer = stub.Offer(pb.OfferRequest(copy=pb.StepCopy(step=6, origin_rank=0, files=[
            pb.FileInfo(path=f"p{i}.bin", size=len(b), crc32c=crc32c(b))
            for i, b in enumerate(parts)])), timeout=10)
        bmd = [("x-mtc-transfer", offer.transfer_id), ("x-mtc-files", "3,0,1,2")]
        stream = parts[3] + parts[0] + parts[1] + parts[2]
        for bad in ("3,x", "4", "-1", "0,0", ""):
            assert rpc_code(push, iter([stream]), metadata=[
                ("x-mtc-transfer", offer.transfer_id), ("x-mtc-files", bad)]) == \
                grpc.StatusCode.INVALID_ARGUMENT, bad
        assert rpc_code(push, iter([stream[:-1]]), metadata=bmd) == grpc.StatusCode.DATA_LOSS
        assert rpc_code(push, iter([stream, b"!"]), metadata=bmd) == grpc.StatusCode.DATA_LOSS
        assert rpc_code(stub.Commit, pb.CommitRequest(transfer_id=offer.transfer_id)) == \
            grpc.StatusCode.DATA_LOSS
        cuts = [0, 1, 2999, 5001, 8010, len(stream)]
        pieces = [stream[a:b] for a, b in itertools.pairwise(cuts)]
        assert push(iter(pieces), timeout=10, metadata=bmd).size == len(stream)
        stub.Commit(pb.CommitRequest(transfer_id=offer.transfer_id), timeout=10)
        copy = cl.root(1) / REPLICA_DIR / "0" / "6"
        assert [(copy / f"p{i}.bin").read_bytes() for i in range(4)] == parts

        # A file the receiver holds itself is linked, not copied; a later push to
        # that path must not write through the link into the receiver's own step.
        mine = os.urandom(4096)
        cl.commit(1, 8, {"mine.bin": mine})
        offer = stub.Offer(pb.OfferRequest(copy=pb.StepCopy(step=8, origin_rank=0, files=[
            pb.FileInfo(path="same.bin", size=len(mine), crc32c=crc32c(mine))])), timeout=10)
        assert [x.path for x in offer.candidates] == ["same.bin"]
        assert list(stub.Link(pb.LinkRequest(transfer_id=offer.transfer_id, paths=["same.bin"]),
                              timeout=10).linked) == ["same.bin"]
        smd = [("x-mtc-transfer", offer.transfer_id), ("x-mtc-path", "same.bin"),
               ("x-mtc-size", str(len(mine))), ("x-mtc-crc32c", str(crc32c(mine)))]
        assert rpc_code(push, iter([bytes(len(mine))]), metadata=smd) == \
            grpc.StatusCode.DATA_LOSS
        assert (cl.root(1) / "8" / "mine.bin").read_bytes() == mine
        assert rpc_code(stub.Commit, pb.CommitRequest(transfer_id=offer.transfer_id)) == \
            grpc.StatusCode.DATA_LOSS

        # Oversized messages: one 65 MiB chunk, and a 65 MiB Offer.
        offer = stub.Offer(pb.OfferRequest(copy=pb.StepCopy(step=4, origin_rank=0, files=[
            pb.FileInfo(path="big.bin", size=65 << 20, crc32c=0)])), timeout=10)
        assert rpc_code(push, iter([bytes(65 << 20)]), metadata=[
            ("x-mtc-transfer", offer.transfer_id), ("x-mtc-path", "big.bin"),
            ("x-mtc-size", str(65 << 20)), ("x-mtc-crc32c", "0")]) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        huge = pb.OfferRequest(copy=pb.StepCopy(step=5, origin_rank=0, files=[
            pb.FileInfo(path="x" * (65 << 20), size=1)]))
        assert rpc_code(stub.Offer, huge) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        ch.close()
    assert_serving(cl, 1)
    assert_serving(cl, 0)
    assert "Traceback" not in cl.log_text(1)
