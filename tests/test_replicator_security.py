"""Who may talk to a replicator, and what a request may name.

Real replicator processes: a shared token, mutual TLS with certificates made here,
paths that try to leave the RAM disk, malformed and oversized requests, and the
refusal to serve a non-loopback address without credentials.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from replicators import Cluster, env_with_repo, free_ports, new_cluster

from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.sidecar.replicator.client import FETCH, PUSH, PeerClient, PeerError
from mtc.sidecar.replicator.security import TOKEN_HEADER, Credentials, rank_name
from mtc.sidecar.replicator.store import REPLICA_DIR

pytestmark = pytest.mark.process  # every test here starts processes

SECRET = b"top secret outside the RAM disk\n"




def code_of(e: BaseException | None) -> grpc.StatusCode | None:
    """The status code of an RpcError, or of the RpcError behind a PeerError."""
    while e is not None and not isinstance(e, grpc.RpcError):
        e = e.__cause__
    return e.code() if e is not None else None


def health(addr: str, cc: grpc.ChannelCredentials | None = None) -> Any:
    ch = grpc.secure_channel(addr, cc) if cc else grpc.insecure_channel(addr)
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                   timeout=5).status
    finally:
        ch.close()


def assert_serving(cl: Cluster, rank: int) -> None:
    assert cl.alive(rank), cl.log_text(rank)[-2000:]
    cl.inventory(rank)  # answers a real call


# -- shared token -----------------------------------------------------------------------


def test_token_required(ramdisk: Path, clusters: list[Cluster]) -> None:
    token_file = ramdisk / "token"
    token_file.write_text("s3cret-token\n")
    good = Credentials(token="s3cret-token")
    cl = new_cluster(clusters, ramdisk, 2, 1, extra=("--token-file", str(token_file)),
                     creds=good)
    cl.start_all()
    cl.commit(0, 1, {"a.bin": os.urandom(2048)})
    cl.wait_held({(1, 0, 1)})  # the peers themselves present the token

    for creds in (Credentials(), Credentials(token="wrong-token")):
        c = PeerClient(cl.addrs[1], creds, rank=1)
        try:
            for name, req in (("GetInventory", pb.InventoryRequest()),
                              ("Decide", pb.DecideRequest(rank=0, timeout_seconds=1)),
                              ("GetComplete", pb.CompleteRequest()),
                              ("PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=1))):
                with pytest.raises(PeerError) as ei:
                    c.call(name, req, attempts=1)
                assert code_of(ei.value) == grpc.StatusCode.UNAUTHENTICATED, name
        finally:
            c.close()

    # The raw data plane too: no bytes without the token.
    ch = grpc.insecure_channel(cl.addrs[1])
    try:
        fetch = ch.unary_stream(FETCH)
        with pytest.raises(grpc.RpcError) as ei:
            list(fetch(pb.FetchRequest(step=1, origin_rank=0, path="a.bin").SerializeToString(),
                       timeout=5))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        push = ch.stream_unary(PUSH)
        with pytest.raises(grpc.RpcError) as ei:
            push(iter([b"x" * 10]), timeout=5,
                 metadata=[("x-mtc-transfer", "t"), ("x-mtc-path", "a.bin")])
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the token, the same fetch returns the bytes.
        got = b"".join(fetch(pb.FetchRequest(step=1, origin_rank=0,
                                             path="a.bin").SerializeToString(),
                             timeout=5, metadata=[(TOKEN_HEADER, "s3cret-token")]))
        assert got == (cl.root(0) / "1" / "a.bin").read_bytes()
    finally:
        ch.close()

    # Health checks stay open (Kubernetes probes carry no credentials).
    assert health(cl.addrs[1]) == health_pb2.HealthCheckResponse.SERVING
    inv = cl.inventory(1)  # with the token
    assert {(c.origin_rank, c.step) for c in inv.copies} == {(0, 1)}
    assert_serving(cl, 0)


# -- mutual TLS ------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def make_leaf(ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], cn: str,
              out: Path, *, ranks: Sequence[int] = ()) -> tuple[Path, Path]:
    """A certificate of ``ca`` for loopback; with ``ranks``, naming those replicator
    ranks (``mtc-rank-<r>``), as each host's must name its own."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), *(x509.DNSName(rank_name(r)) for r in ranks),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = out / f"{cn}.crt", out / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def write_pem(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def tls_cluster(clusters: list[Cluster], base: Path,
                ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], ca_pem: Path,
                pki: Path, client_crt: Path, client_key: Path, n: int = 2) -> Cluster:
    """``n`` replicators over mutual TLS, each with a certificate naming its rank; the
    harness calls them with ``client_crt`` (naming none, as a controller's)."""
    certs = {r: make_leaf(ca, f"node{r}", pki, ranks=[r]) for r in range(n)}
    return new_cluster(clusters, base, n, 1,
                       creds=Credentials(tls_cert=client_crt, tls_key=client_key,
                                         tls_ca=ca_pem),
                       extra=("--tls-ca", str(ca_pem)),
                       rank_args={r: ("--tls-cert", str(c), "--tls-key", str(k))
                                  for r, (c, k) in certs.items()})


def test_mutual_tls(ramdisk: Path, clusters: list[Cluster]) -> None:
    pki = ramdisk / "pki"
    pki.mkdir()
    ca, rogue_ca = make_ca("mtc test CA"), make_ca("someone else's CA")
    ca_pem = write_pem(ca[1], pki / "ca.crt")
    client_crt, client_key = make_leaf(ca, "trainer", pki)
    rogue_crt, rogue_key = make_leaf(rogue_ca, "intruder", pki, ranks=[1])

    cl = tls_cluster(clusters, ramdisk, ca, ca_pem, pki, client_crt, client_key)
    cl.start_all()
    cl.commit(0, 1, {"a.bin": os.urandom(2048)})
    cl.wait_held({(1, 0, 1)})  # peers authenticate each other

    # Another certificate from the same CA is accepted.
    c = PeerClient(cl.addrs[1], Credentials(tls_cert=client_crt, tls_key=client_key,
                                            tls_ca=ca_pem), rank=1)
    try:
        assert {(x.origin_rank, x.step) for x in c.call("GetInventory",
                                                        pb.InventoryRequest()).copies} == {(0, 1)}
    finally:
        c.close()

    ca_bytes = ca_pem.read_bytes()
    refused = {
        # A certificate signed by another CA (trusting the server's CA to get that far).
        "rogue cert": grpc.ssl_channel_credentials(ca_bytes, rogue_key.read_bytes(),
                                                   rogue_crt.read_bytes()),
        # No client certificate at all.
        "no cert": grpc.ssl_channel_credentials(ca_bytes),
    }
    for what, cc in refused.items():
        ch = grpc.secure_channel(cl.addrs[1], cc)
        try:
            with pytest.raises(grpc.RpcError) as ei:
                pb_grpc.ReplicatorStub(ch).GetInventory(pb.InventoryRequest(), timeout=5)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, what
            with pytest.raises(grpc.RpcError):
                list(ch.unary_stream(FETCH)(pb.FetchRequest(
                    step=1, origin_rank=0, path="a.bin").SerializeToString(), timeout=5))
        finally:
            ch.close()
    # Plaintext is refused too.
    ch = grpc.insecure_channel(cl.addrs[1])
    try:
        with pytest.raises(grpc.RpcError):
            pb_grpc.ReplicatorStub(ch).GetInventory(pb.InventoryRequest(), timeout=5)
    finally:
        ch.close()
    # A client that trusts only the rogue CA does not accept the server either.
    c = PeerClient(cl.addrs[1], Credentials(tls_cert=rogue_crt, tls_key=rogue_key,
                                            tls_ca=write_pem(rogue_ca[1], pki / "rogue.crt")),
                   rank=1)
    try:
        with pytest.raises(PeerError):
            c.call("GetInventory", pb.InventoryRequest(), attempts=1)
    finally:
        c.close()
    assert_serving(cl, 1)


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


# -- listening without credentials ----------------------------------------------------------


@pytest.mark.parametrize("listen", ["0.0.0.0", "[::]"])
def test_non_loopback_listen_needs_credentials(tmp_path: Path, listen: str) -> None:
    port = free_ports(1)[0]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mtc.sidecar.replicator.main",
                        "--local-dir", str(tmp_path / "root"), "--listen", f"{listen}:{port}",
                        "--nodes", f"127.0.0.1:{port},127.0.0.1:1", "--rank", "0"],
                       capture_output=True, text=True, timeout=60, env=env_with_repo())
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "refusing to serve" in r.stderr and "without credentials" in r.stderr, r.stderr
    assert "--token-file" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 30


def test_manager_agrees_with_tls_replicators_through_its_certificate(
        ramdisk: Path, tmp_path: Path, mesh: Any, clusters: list[Cluster]) -> None:
    """``Options(replicator_tls=...)`` (what ``mtc-train-k8s`` passes from its TLS
    folder): the manager's restore agreement reaches replicators that accept mutual
    TLS only; the same manager without a certificate is refused, typed: by the sidecars
    at once, by the replicators at its deadline."""
    from replicators import assert_state_equal, make_state

    import mtc

    pki = tmp_path  # the controller's files, not on any host's RAM disk
    ca = make_ca("mtc test CA")
    ca_pem = write_pem(ca[1], pki / "ca.crt")
    trainer_crt, trainer_key = make_leaf(ca, "trainer", pki)
    cl = tls_cluster(clusters, ramdisk, ca, ca_pem, pki, trainer_crt, trainer_key)
    cl.start_all()
    tls = (str(trainer_crt), str(trainer_key), str(ca_pem))
    s1 = make_state(mesh, 1.0)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options(
            replicators=True, replicator_tls=tls, restore_timeout_s=30)) as m:
        assert m.save(1, s1)
    cl.wait_replicated(1, timeout=30)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options(
            replicators=True, replicator_tls=tls, restore_timeout_s=30)) as m:
        assert m.latest_step() == 1
        assert m.last_restore_tiers == {0: "local", 1: "local"}
        assert_state_equal(m.restore(None, s1), s1)
    # Without a certificate: the sidecars (same credentials) refuse the manager, and
    # the replicators its restore, typed, at its deadline.
    with pytest.raises(mtc.ShardUnavailableError, match="sidecar unreachable"):
        mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options(
            replicators=True, restore_timeout_s=2))
    from mtc.replicas import prepare_restore
    with pytest.raises(mtc.AgreementError, match="did not answer"):
        prepare_restore(cl.addrs, token=None, timeout_s=2)
