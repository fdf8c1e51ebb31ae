"""Certificates rotate under a running replicator: no restart, no client left behind.

cert-manager renews the peer certificate (90 days by default) and the kubelet
swaps the mounted Secret's files. A replicator serves the files as they are when
each connection starts; a client makes a new channel once its files changed.
Real replicator processes, real certificate files written as a Secret volume is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from replicators import Cluster, new_cluster
from tls_certs import issue, make_ca, mount_secret

from mtc.credentials import CERT_CHECK_S, Credentials
from mtc.grpc_errors import PeerError
from mtc.proto import replicator_pb2 as pb
from mtc.rank_names import rank_name
from mtc.sidecar.replicator.healthcheck import check
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process


def host0(ca: tuple[bytes, Any]) -> dict[str, bytes]:
    """Rank 0's certificate (it names the rank, as a replicator's must)."""
    return issue(ca, "mtc-replicator", dns=("localhost", rank_name(0)))


def creds_of(folder: Path) -> Credentials:
    return Credentials(tls_cert=folder / "tls.crt", tls_key=folder / "tls.key",
                       tls_ca=folder / "ca.crt")


def connects(addr: str, folder: Path) -> bool:
    """Whether a new client with the files in ``folder`` gets an answer (a new
    channel: a new connection, a new handshake)."""
    try:
        return check(addr, creds=creds_of(folder), timeout_s=3.0) == "SERVING"
    except grpc.RpcError:
        return False


def test_replicator_serves_rotated_certificates_without_restart(
        tmp_path: Path, clusters: list[Cluster]) -> None:
    ca1, ca2, ca3 = make_ca("mtc-ca-1"), make_ca("mtc-ca-2"), make_ca("mtc-ca-3")
    first, second, third = (host0(ca) for ca in (ca1, ca2, ca3))
    secret = mount_secret(tmp_path / "secret", first)   # what the replicator mounts
    clients = {n: mount_secret(tmp_path / n, files)     # clients holding one version each
               for n, files in (("v1", first), ("v2", second), ("v3", third))}
    creds = creds_of(secret)
    cl = new_cluster(clusters, tmp_path / "hosts", 1, 1, creds=creds,
                     extra=("--replicas", "0", "--tls-cert", str(creds.tls_cert),
                            "--tls-key", str(creds.tls_key), "--tls-ca", str(creds.tls_ca)))
    cl.start_all()
    pid = cl.procs[0].pid
    addr = cl.addrs[0]
    assert connects(addr, clients["v1"]) and not connects(addr, clients["v2"])

    # A peer's client, made before the rotation with the same mounted files.
    peer = PeerClient(addr, creds, rank=0)
    try:
        assert peer.call("GetInventory", pb.InventoryRequest()).rank == 0

        # cert-manager issued a new CA and certificate; the kubelet swapped the files.
        mount_secret(secret, second)
        wait_until("a client with the new CA connects", lambda: connects(addr, clients["v2"]))
        assert not connects(addr, clients["v1"]), "the old CA is still trusted"
        assert cl.procs[0].pid == pid and cl.alive(0), "the replicator restarted"

        # Files that are not certificates (a rotation gone wrong) change nothing.
        mount_secret(secret, {"tls.crt": b"junk", "tls.key": b"junk", "ca.crt": b"junk"})
        assert connects(addr, clients["v2"])
        # That connection's handshake read the junk (the server looks at its files
        # on each new connection) and refused it.
        wait_until("the junk is read and refused",
                   lambda: "TLS certificate files not reloaded" in cl.log_text(0))
        mount_secret(secret, third)
        wait_until("the next rotation is served", lambda: connects(addr, clients["v3"]))

        # The peer's client sees its files changed and makes a new channel. Its old
        # connection would still work, so the replicator is restarted: a client that
        # kept the first CA could not verify it now.
        cl.kill(0)
        cl.start(0)
        time.sleep(CERT_CHECK_S)
        assert peer.call("GetInventory", pb.InventoryRequest()).rank == 0
    finally:
        peer.close()


def test_a_client_that_keeps_old_certificates_is_refused(tmp_path: Path,
                                                          clusters: list[Cluster]) -> None:
    """What the renewal above prevents: a client whose files are not the server's
    any more cannot connect once the server rotated (so the test above can fail)."""
    ca1, ca2 = make_ca("mtc-ca-1"), make_ca("mtc-ca-2")
    secret = mount_secret(tmp_path / "secret", host0(ca1))
    kept = mount_secret(tmp_path / "kept", host0(ca1))
    creds = creds_of(secret)
    cl = new_cluster(clusters, tmp_path / "hosts", 1, 1, creds=creds,
                     extra=("--replicas", "0", "--tls-cert", str(creds.tls_cert),
                            "--tls-key", str(creds.tls_key), "--tls-ca", str(creds.tls_ca)))
    cl.start_all()
    stale = PeerClient(cl.addrs[0], creds_of(kept), rank=0, deadline_s=2.0)
    try:
        assert stale.call("GetInventory", pb.InventoryRequest()).rank == 0
        mount_secret(secret, host0(ca2))
        cl.kill(0)
        cl.start(0)
        with pytest.raises(PeerError):
            stale.call("GetInventory", pb.InventoryRequest(), attempts=2)
    finally:
        stale.close()


def test_client_credentials_follow_the_files_and_skip_bad_ones(tmp_path: Path) -> None:
    from mtc.credentials import TlsWatch

    secret = mount_secret(tmp_path / "secret", host0(make_ca("mtc-ca-1")))
    watch = TlsWatch(creds_of(secret), check_s=0.0)
    first = watch.credentials
    assert first is not None and watch.renewed() is None           # nothing changed
    mount_secret(secret, {"tls.crt": b"junk", "tls.key": b"junk", "ca.crt": b"junk"})
    assert watch.renewed() is None and watch.credentials is first   # bad files: kept
    mount_secret(secret, host0(make_ca("mtc-ca-2")))
    second = watch.renewed()
    assert second is not None and watch.credentials is second
    assert watch.renewed() is None
