"""A hostile network, second round (issue 57): the data channel flooded by callers
that never authenticate, against real replicator processes on loopback
(``tests/replicators.Cluster``), with the shared token and with mutual TLS.

The first round's attacks are ``tests/test_hostile_network.py``'s; the data
channel's listener alone, in this process, ``tests/test_datachannel.py``'s.
"""

from __future__ import annotations

import os
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hostile_net import Drip
from replicator_certs import make_ca, make_leaf, tls_cluster, write_pem
from replicators import Cluster, new_cluster

from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator import data_admission
from mtc.sidecar.replicator import datachannel as dc
from mtc.sidecar.replicator.client import PeerError
from mtc.sidecar.replicator.security import Credentials

pytestmark = pytest.mark.process  # every test here starts processes

MiB = 1 << 20


def _cluster(auth: str, base: Path, clusters: list[Cluster]) -> tuple[Cluster, bytes]:
    """Two replicators (one host per slice, peers of each other), and what a dripping
    caller sends first: the data request's header, or a TLS record's."""
    if auth == "token":
        token_file = base / "token"
        token_file.write_text("flood-test-token\n")
        cl = new_cluster(clusters, base / "hosts", 2, 1,
                         creds=Credentials(token="flood-test-token"),
                         extra=("--token-file", str(token_file)))
        return cl, dc.MAGIC + struct.pack("<I", 1000)
    pki = base / "pki"
    pki.mkdir()
    ca = make_ca("mtc test CA")
    ca_pem = write_pem(ca[1], pki / "ca.crt")
    crt, key = make_leaf(ca, "trainer", pki)
    return (tls_cluster(clusters, base / "hosts", ca, ca_pem, pki, crt, key),
            b"\x16\x03\x01\x02\x00")  # a TLS handshake record of 512 bytes, to come


def _prepare(cl: Cluster, rank: int) -> pb.PrepareRestoreReply | PeerError:
    c = cl.client(rank)
    try:
        return c.call("PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=30),
                      deadline_s=40, attempts=1)
    except PeerError as e:
        return e
    finally:
        c.close()


@pytest.mark.parametrize("auth", ["token", "tls"])
def test_a_replaced_hosts_restore_succeeds_while_its_holders_data_port_is_flooded(
        ramdisk: Path, clusters: list[Cluster], auth: str) -> None:
    """Host 0 is replaced (its replicator killed, its RAM disk wiped); its step is
    held by host 1, whose data port forty connections drip into meanwhile (the
    request's header, or a TLS record's, then a byte every 0.5 s). Host 0 restores
    its step from host 1, whole: it failed at once with DATA_LOSS ("no good copy
    on any holder") while the drip held every worker of host 1's data channel."""
    cl, head = _cluster(auth, ramdisk, clusters)
    cl.start_all()
    mine = cl.commit(0, 5, {"a.bin": os.urandom(8 * MiB), "b.bin": os.urandom(3 * MiB)})
    cl.commit(1, 5, {"c.bin": os.urandom(MiB)})
    cl.wait_held({(1, 0, 5), (0, 1, 5)})
    c = cl.client(1)
    try:
        port = c.call("GetInventory", pb.InventoryRequest(identify=True)).data_port
    finally:
        c.close()
    assert port
    cl.kill(0)
    shutil.rmtree(cl.root(0))
    cl.start(0)
    with Drip(("127.0.0.1", port), 40, head=head, every=0.5) as drip:
        for _ in range(100):  # until the flood is at its bound (16 of one address)
            if drip.ended >= 40 - data_admission.PENDING_PER_SOURCE:
                break
            time.sleep(0.05)
        assert drip.ended >= 40 - data_admission.PENDING_PER_SOURCE, drip.ended
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda r: _prepare(cl, r), [0, 1]))
    r0, r1 = replies
    assert isinstance(r0, pb.PrepareRestoreReply), r0
    assert isinstance(r1, pb.PrepareRestoreReply), r1
    assert (r0.step, r0.tier, r1.step, r1.tier) == (5, "peer", 5, "local")
    for name, data in mine.items():
        assert (cl.root(0) / "5" / name).read_bytes() == data, name
