"""Who may talk to a replicator.

Real replicator processes: a shared token, mutual TLS with certificates made here
(``tests/replicator_certs.py``), the refusal to serve a non-loopback address
without credentials, and a manager reaching replicators that accept mutual TLS
only through its certificate. What a request may name:
``tests/test_replicator_requests.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from replicator_certs import make_ca, make_leaf, tls_cluster, write_pem
from replicator_refusals import assert_serving, code_of
from replicators import Cluster, env_with_repo, free_ports, new_cluster

from mtc.credentials import TOKEN_HEADER, Credentials
from mtc.grpc_errors import PeerError
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.sidecar.replicator.wire.client import FETCH, PUSH, PeerClient

pytestmark = pytest.mark.process  # every test here starts processes


def health(addr: str, cc: grpc.ChannelCredentials | None = None) -> Any:
    ch = grpc.secure_channel(addr, cc) if cc else grpc.insecure_channel(addr)
    try:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                   timeout=5).status
    finally:
        ch.close()


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


def test_mutual_tls(ramdisk: Path, clusters: list[Cluster]) -> None:
    pki = ramdisk / "pki"
    pki.mkdir()
    ca, rogue_ca = make_ca("mtc test CA"), make_ca("someone else's CA")
    ca_pem = write_pem(ca[1], pki / "ca.crt")
    client_crt, client_key = make_leaf(ca, "trainer", pki, controller=True)
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
    trainer_crt, trainer_key = make_leaf(ca, "trainer", pki, controller=True)
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
