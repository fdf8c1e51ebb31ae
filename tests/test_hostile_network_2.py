"""A hostile network, second round (issue 57): the data channel flooded by callers
that never authenticate, sidecars called with another host's certificate, and a
peer's forged listing read by the controller, against real replicator and sidecar
processes on loopback (``tests/replicators.Cluster``), with the shared token and
with mutual TLS; and bytes forged to match a CRC32C (restored, healed from, linked
as a twin), refused by what their origin signed, on whole replicators in one
process under mutual TLS (the in-memory cluster: the rule is the replicators', not
the sockets').

The first round's attacks are ``tests/test_hostile_network.py``'s; the data
channel's listener alone, in this process, ``tests/test_datachannel.py``'s.
"""

from __future__ import annotations

import os
import pickle
import shutil
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from hostile_net import Drip, plant_forged_copy
from replicator_certs import make_ca, make_leaf, tls_cluster, write_pem
from replicators import Cluster, flip, new_cluster

from mtc.contract import decode_reply, encode_request
from mtc.credentials import TOKEN_HEADER, Credentials
from mtc.errors import MtcError, ShardUnavailableError
from mtc.grpc_errors import PeerError, to_status
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.memory_cluster import MemoryCluster
from mtc.sidecar.replicator.wire import data_admission
from mtc.sidecar.replicator.wire import datachannel as dc
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.sidecar.restore.peers import PeerFiles
from mtc.testing.waits import wait_until

MiB = 1 << 20


def _tls_hosts(base: Path, clusters: list[Cluster], **kw: Any
               ) -> tuple[Path, Any, Path, Cluster]:
    """A CA, the controller's certificate (naming its role), and hosts under mutual
    TLS with them: (the certificates' folder, the CA, its PEM, the cluster; ``kw``:
    more of its fields)."""
    pki = base / "pki"
    pki.mkdir()
    ca = make_ca("mtc test CA")
    ca_pem = write_pem(ca[1], pki / "ca.crt")
    crt, key = make_leaf(ca, "trainer", pki, controller=True)
    return pki, ca, ca_pem, tls_cluster(clusters, base / "hosts", ca, ca_pem, pki, crt, key,
                                        **kw)


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
    return (_tls_hosts(base, clusters)[3],
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


@pytest.mark.process
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
        wait_until("the flood at its bound (16 of one address, the rest ended)",
                   lambda: drip.ended >= 40 - data_admission.PENDING_PER_SOURCE, 5,
                   detail=lambda: f"{drip.ended} ended")
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda r: _prepare(cl, r), [0, 1]))
    r0, r1 = replies
    assert isinstance(r0, pb.PrepareRestoreReply), r0
    assert isinstance(r1, pb.PrepareRestoreReply), r1
    assert (r0.step, r0.tier, r1.step, r1.tier) == (5, "peer", 5, "local")
    for name, data in mine.items():
        assert (cl.root(0) / "5" / name).read_bytes() == data, name


# -- the sidecar's identity -----------------------------------------------------------------

SIDECAR_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("hello", {}), ("inspect", {}), ("steps", {}), ("manifest", {"step": 3}),
    ("delete", {"step": 3}),
    ("retain", {"complete": [], "max_to_keep": 1, "keep_period": None,
                "before_write": False}),
    ("read", {"step": 3, "tasks": []}), ("load", {"step": 3, "tasks": []}),
    ("open", {"lock": False, "clean": True}), ("release", {}), ("space", {}),
    ("settle", {}), ("survey", {}), ("poll", {})]


@pytest.mark.process
def test_a_sidecar_takes_calls_from_its_own_host_and_the_controller_only(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Under mutual TLS, host 0's certificate at host 1's sidecar ran a pickled
    program (``Execute``) and deleted host 1's steps; a certificate of the CA that
    names nobody (``CN=evil``) was taken for the controller's. Now each of 15 calls
    (every operation, and ``Execute``) from either is refused PERMISSION_DENIED,
    even with the hosts' token beside it; host 1's own certificate and the
    controller's (which names the controller's role) are answered."""
    pki, ca, ca_pem, cl = _tls_hosts(ramdisk, clusters)
    cl.start_all()
    cl.start_sidecars()
    cl.commit(1, 3, {"a.bin": os.urandom(1024)})

    def creds(name: str, **kw: Any) -> grpc.ChannelCredentials:
        c, k = make_leaf(ca, name, pki, **kw)
        return grpc.ssl_channel_credentials(ca_pem.read_bytes(), k.read_bytes(),
                                            c.read_bytes())

    md = [(TOKEN_HEADER, cl.hosts.token())]
    address = cl.hosts.hosts[1].sidecar_address

    def answers(cc: grpc.ChannelCredentials) -> list[str]:
        """Each of the 15 calls' outcome at host 1's sidecar: OK or its code."""
        out = []
        with grpc.secure_channel(address, cc) as ch:
            calls = [("/mtc.Host/Call", encode_request(op, [1], **args))
                     for op, args in SIDECAR_CALLS]
            for method, req in [*calls, ("/mtc.Host/Execute", pickle.dumps(("x", 1)))]:
                try:
                    ch.unary_unary(method)(req, timeout=10, metadata=md)
                    out.append("OK")
                except grpc.RpcError as e:
                    out.append(e.code().name)
        return out

    assert len(SIDECAR_CALLS) + 1 == 15
    for stranger in (creds("host0", ranks=[0]), creds("evil"),
                     creds("both", ranks=[1], controller=True)):
        assert answers(stranger) == ["PERMISSION_DENIED"] * 15
    assert (cl.root(1) / "3" / "a.bin").is_file()  # not deleted
    for own in (creds("host1", ranks=[1]), creds("controller", controller=True)):
        with grpc.secure_channel(address, own) as ch:
            reply = decode_reply(ch.unary_unary("/mtc.Host/Call")(
                encode_request("steps", [1]), timeout=10, metadata=md))
        assert reply == {"1": [3]}


@pytest.mark.process
def test_a_certificate_naming_nobody_is_not_the_controller(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """A certificate of the cluster's CA naming no rank (``CN=evil``) was taken for
    the controller's: it read copies and asked for restores and backups. Now every
    replicator call from it, and its data channel requests, are refused
    PERMISSION_DENIED; the controller's certificate (naming the role) is answered."""
    pki, ca, ca_pem, cl = _tls_hosts(ramdisk, clusters)
    cl.start_all()
    data = os.urandom(4096)
    cl.commit(0, 2, {"a.bin": data})
    cl.wait_held({(1, 0, 2)})
    ecrt, ekey = make_leaf(ca, "evil", pki)
    evil = Credentials(tls_cert=ecrt, tls_key=ekey, tls_ca=ca_pem)
    c = PeerClient(cl.addrs[1], evil, rank=1)
    try:
        for name, req in (("GetInventory", pb.InventoryRequest()),
                          ("PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=1)),
                          ("Restored", pb.RestoredRequest(restore_id="r", step=2)),
                          ("RequestBackup", pb.BackupRequest()),
                          ("GetComplete", pb.CompleteRequest())):
            with pytest.raises(PeerError) as ei:
                c.call(name, req, attempts=1)
            assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED, name
        with pytest.raises(PeerError) as ei:  # its bytes, over gRPC
            c.data.fetch_bytes(2, 0, "a.bin", len(data), crc32c(data))
        assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
        # And over the data channel (its port as rank 1 names it to the controller).
        ctl = cl.client(1)
        try:
            c.data_port = ctl.call("GetInventory", pb.InventoryRequest(identify=True)).data_port
        finally:
            ctl.close()
        with pytest.raises(PeerError) as ei:
            c.data.fetch_bytes(2, 0, "a.bin", len(data), crc32c(data))
        assert ei.value.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        c.close()
    ctl = cl.client(1)
    try:
        assert bytes(ctl.data.fetch_bytes(2, 0, "a.bin", len(data), crc32c(data))) == data
    finally:
        ctl.close()


@pytest.mark.process
# -- a copy of another rank's data, forged by a peer with its own certificate --------------

def test_a_peer_cannot_make_another_rank_restore_bytes_it_forged(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Under mutual TLS, rank 1 (its own real certificate) listed a copy of rank 0's
    step 777 made of its own bytes, and rank 0 restored step 777, its ``a.bin``
    holding them. Now rank 0's agreement ignores that copy (its proof is signed by
    rank 1, not rank 0) and counts it, the controller's peer reads refuse it, and
    both hosts restore step 5, rank 0's own bytes."""
    pki, _, _, cl = _tls_hosts(ramdisk, clusters, metrics=True)
    cl.start_all()
    mine = cl.commit(0, 5, {"a.bin": os.urandom(64 << 10)})
    cl.commit(1, 5, {"c.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 5), (0, 1, 5)})
    held = {c.origin_rank: c for c in cl.inventory(1).copies if c.step == 5}
    assert held[0].proof.signature  # rank 0's proof of its copy, kept by rank 1
    cl.commit(1, 777, {"c.bin": os.urandom(4096)})
    forged = b"rank 1 made this up" * 1000
    plant_forged_copy(cl, pki / "node1.key", pki / "node1.crt", holder=1, origin=0, step=777,
                      data=forged)
    assert (1, 0, 777) in cl.held()  # listed, and served, by rank 1's replicator

    # The controller's reads of other hosts' files (multi-controller, sidecar/restore/peers.py).
    peers = PeerFiles(cl.addrs, cl.creds, near=None, deadline_s=10.0)
    try:
        with pytest.raises(ShardUnavailableError):
            peers.read(777, 0, "a.bin")
        assert peers.unproven >= 1
        assert bytes(peers.read(5, 0, "a.bin")) == mine["a.bin"]  # proven: read
    finally:
        peers.close()

    with ThreadPoolExecutor(2) as pool:
        r0, r1 = pool.map(lambda r: _prepare(cl, r), [0, 1])
    assert isinstance(r0, pb.PrepareRestoreReply), r0
    assert isinstance(r1, pb.PrepareRestoreReply), r1
    assert (r0.step, r0.tier, r1.step) == (5, "local", 5)
    assert (cl.root(0) / "5" / "a.bin").read_bytes() == mine["a.bin"]
    assert not (cl.root(0) / "777").exists()
    assert cl.scrape(0).get("mtc_unproven_copies_total", 0) >= 1


def _same_crc(data: bytes, target: int) -> bytes:
    """``data`` with its last 4 bytes changed so that its CRC32C is ``target``: what
    any forger can do (CRC32C is affine over GF(2): the 32 bits of the patch are
    solved for)."""
    head, base = data[:-4], crc32c(data[:-4] + bytes(4))
    basis: dict[int, tuple[int, int]] = {}  # pivot bit -> (CRC change, patch bits)
    for i in range(32):
        v, m = crc32c(head + (1 << i).to_bytes(4, "little")) ^ base, 1 << i
        for b in reversed(range(32)):
            if (v >> b) & 1:
                if b not in basis:
                    basis[b] = (v, m)
                    break
                v, m = v ^ basis[b][0], m ^ basis[b][1]
    v, x = target ^ base, 0
    for b in reversed(range(32)):
        if (v >> b) & 1:
            v, x = v ^ basis[b][0], x ^ basis[b][1]
    assert v == 0
    return head + x.to_bytes(4, "little")


# -- forged bytes under mutual TLS, on whole replicators in one process ------------------


@pytest.fixture
def tls_memory(tmp_path: Path) -> Iterator[Callable[..., MemoryCluster]]:
    """Clusters of whole replicators in one process under mutual TLS: each rank's
    own certificate (naming its rank) signs its copies' proofs, and the CA checks
    the others'. The calls between them are in memory (who may call is
    ``tests/test_replicator_security.py``'s, over gRPC)."""
    made: list[MemoryCluster] = []

    def make(n: int = 2, **kw: Any) -> MemoryCluster:
        pki = tmp_path / f"pki-{len(made)}"
        pki.mkdir()
        ca = make_ca("mtc test CA")
        ca_pem = write_pem(ca[1], pki / "ca.crt")
        creds = {}
        for r in range(n):
            crt, key = make_leaf(ca, f"node{r}", pki, ranks=[r])
            creds[r] = Credentials(tls_cert=crt, tls_key=key, tls_ca=ca_pem)
        made.append(MemoryCluster(tmp_path / f"hosts-{len(made)}", n, 1, rank_creds=creds,
                                  **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


def forge_held_copy(c: Any, before: Callable[[Any], None] = lambda c: None) -> bytes:
    """On two hosts (a cluster of either harness, started) holding each other's step
    5: after ``before``, rank 1 swaps its copy of rank 0's ``a.bin`` for bytes of its
    own with the same size and CRC32C, which every check but the SHA-256 rank 0
    signed passes (the copy stays listed). The forged bytes."""
    mine = c.commit(0, 5, {"a.bin": os.urandom(64 << 10)})
    c.commit(1, 5, {"c.bin": os.urandom(4096)})
    c.wait_held({(1, 0, 5), (0, 1, 5)})
    before(c)
    copy = c.root(1) / ".mtc-replica" / "0" / "5" / "a.bin"
    forged = _same_crc(b"rank 1 made this up".ljust(len(mine["a.bin"]), b"!"),
                       crc32c(mine["a.bin"]))
    assert forged != mine["a.bin"] and crc32c(forged) == crc32c(mine["a.bin"])
    (copy.parent / "a.tmp").write_bytes(forged)
    os.replace(copy.parent / "a.tmp", copy)
    assert (1, 0, 5) in c.held()  # it checks out by CRC32C: still listed
    return forged


def _forged_held_copy(make: Callable[..., MemoryCluster]) -> tuple[MemoryCluster, bytes]:
    """Two TLS hosts in memory, rank 1's copy of rank 0's step 5 forged
    (:func:`forge_held_copy`), rank 0's proof of it signed. The cluster, the bytes."""
    c = make()

    def signed(c: MemoryCluster) -> None:
        held = {x.origin_rank: x for x in c.inventory(1).copies if x.step == 5}
        assert held[0].proof.signature  # rank 0's proof of its copy, kept by rank 1
    return c, forge_held_copy(c, signed)


def test_a_holder_serving_other_bytes_with_the_same_crc_fails_the_restore(
        tls_memory: Callable[..., MemoryCluster]) -> None:
    """Rank 1 holds rank 0's real, proven copy of step 5, and swaps its ``a.bin``
    for bytes of its own with the same size and CRC32C (every check a fetch makes on
    the way passes). Rank 0, replaced empty, restores step 5 from it: the SHA-256
    rank 0 signed refuses those bytes before the step is placed (a typed
    ``DATA_LOSS`` naming the file, nothing in rank 0's root), and it is counted."""
    c, _ = _forged_held_copy(tls_memory)
    c.replace_host(0)
    r0, r1 = c.prepare([0, 1]).values()
    assert isinstance(r1, pb.PrepareRestoreReply) and r1.step == 5, r1
    assert isinstance(r0, MtcError), r0
    assert to_status(r0) == grpc.StatusCode.DATA_LOSS and "signed" in str(r0), r0
    assert not (c.root(0) / "5").exists()
    assert c.scrape(0).get("mtc_unproven_copies_total", 0) >= 1


def test_healing_an_own_file_takes_only_the_bytes_its_host_signed(
        tls_memory: Callable[..., MemoryCluster]) -> None:
    """Rank 1 holds rank 0's real, proven copy of step 5 and swaps its ``a.bin``
    for bytes of its own with the same size and CRC32C; then rank 0's own ``a.bin``
    is damaged. Healing it, as a restore does, took rank 1's bytes (checked by
    CRC32C only) into rank 0's own step. Now they must hash as rank 0 signed them
    (the SHA-256 listed with rank 1's proven copy of its data): the restore fails
    with a typed ``DATA_LOSS``, no forged byte is placed, and it is counted."""
    c, forged = _forged_held_copy(tls_memory)
    own = c.root(0) / "5" / "a.bin"
    flip(own)
    wait_until("rank 0 finding its a.bin damaged",  # its next check
               lambda: 5 in {d.step for d in c.inventory(0).damaged})
    r0, r1 = c.prepare([0, 1]).values()
    assert isinstance(r1, pb.PrepareRestoreReply) and r1.step == 5, r1
    assert isinstance(r0, MtcError), r0
    assert to_status(r0) == grpc.StatusCode.DATA_LOSS and "signed" in str(r0), r0
    assert not own.exists() or own.read_bytes() != forged
    assert c.scrape(0).get("mtc_unproven_copies_total", 0) >= 1


def test_another_ranks_identical_file_does_not_make_a_damaged_step_restorable(
        tls_memory: Callable[..., MemoryCluster]) -> None:
    """Under mutual TLS a damaged own file heals only with bytes that hash as its
    host signed them, known from a proven copy of its data elsewhere. Rank 0's own
    ``dp.0`` of step 5 is damaged and no other host holds a copy of its step 5,
    but rank 1 saved an identical ``dp.0`` (a data-parallel shard). That file used
    to count step 5 as restorable for rank 0, whose heal then could prove nothing
    (a typed DATA_LOSS for the job); now it counts for nothing, and both hosts
    restore step 3, the newest step they can."""
    c = tls_memory()
    shared = os.urandom(32 << 10)
    for step in (3, 5):
        c.commit(0, step, {"dp.0": shared, "a.bin": os.urandom(4096)})
        c.commit(1, step, {"dp.0": shared, "c.bin": os.urandom(4096)})
    c.wait_held({(1, 0, 3), (0, 1, 3), (1, 0, 5), (0, 1, 5)})
    flip(c.root(0) / "5" / "dp.0")
    wait_until("rank 0 finding its dp.0 damaged",  # its next check
               lambda: 5 in {d.step for d in c.inventory(0).damaged})
    replicas = c.root(1) / ".mtc-replica" / "0"
    shutil.rmtree(replicas / "5")  # rank 1's copy of rank 0's step 5, gone
    for name in ("5.files.json", "5.proof"):
        (replicas / name).unlink(missing_ok=True)
    assert (1, 0, 5) not in c.held()
    replies = c.prepared([0, 1])
    assert (replies[0].step, replies[1].step, replies[0].tier) == (3, 3, "local")


def test_a_twin_made_to_match_is_never_linked_into_another_ranks_copy(
        tls_memory: Callable[..., MemoryCluster]) -> None:
    """Deduplication under mutual TLS. Rank 1 saves, as its own data-parallel
    shard, bytes with the path, size and CRC32C of rank 0's ``a.bin`` (which any
    rank reads in an inventory, and matches at will). A holder of rank 1's bytes
    took them for rank 0's file when rank 0 offered its step (the same shard by the
    manifests: no hash), so its copy of rank 0's data held rank 1's bytes and a
    restore from it failed. Now a file held stands for an offered one only with
    the SHA-256 its origin signed: the holders' copies hold rank 0's bytes."""
    c = tls_memory(3, replicas=2)
    mine = os.urandom(64 << 10)
    forged = _same_crc(b"rank 1's shard".ljust(len(mine), b"!"), crc32c(mine))
    c.commit(1, 5, {"a.bin": forged})
    c.wait_held({(2, 1, 5), (0, 1, 5)})
    c.commit(0, 5, {"a.bin": mine})
    c.wait_held({(2, 0, 5), (1, 0, 5)})
    for holder in (1, 2):
        assert (c.root(holder) / ".mtc-replica" / "0" / "5" / "a.bin").read_bytes() == mine
