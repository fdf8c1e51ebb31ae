"""Hostile callers beyond the shared network's: a colocated call from a caller
without the token (its program must never be unpickled), a peer replicator whose
inventory lies (paths outside the RAM disk, an epoch of 2^63-1), and certificate
holders acting for ranks their certificates do not name.

Real replicator and sidecar processes on loopback (``tests/replicators.Cluster``)
where the listener is the point (credentials, certificates, the server's threads);
the lying inventory's refusal is the replicator's logic, on the in-memory cluster,
the hostile peer an endpoint answering what a real replicator asks it for.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import seam_audit
from hostile_net import (
    AUTH,
    TOKEN,
    WRONG,
    HealthWatch,
    code_of,
    offer_of,
)
from replicator_certs import make_ca, make_leaf, write_pem
from replicators import Cluster, env_with_repo, free_ports

from mtc import transfer
from mtc.credentials import TOKEN_HEADER, Credentials
from mtc.errors import AgreementError, MtcError
from mtc.grpc_errors import PeerError, to_status
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.agree.book import BOOK_NAME
from mtc.sidecar.replicator.copies import provenance
from mtc.sidecar.replicator.memory_cluster import MemoryCluster, at_once
from mtc.sidecar.replicator.memory_transport import Endpoint
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.testing.waits import wait_until


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    with seam_audit.watched_root("mtc-hostile-peers") as path:
        yield path


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


@pytest.mark.process
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
        def alive() -> None:
            assert proc.poll() is None

        wait_until("the sidecar ready", ready.exists, 30, during=alive)
        marker = work / "area" / "pwned"
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            execute = ch.unary_unary("/mtc.Host/Execute")
            for md in ((), WRONG):
                assert code_of(lambda m=md: execute(_evil_program(marker), timeout=10,
                                                    metadata=m)) == \
                    grpc.StatusCode.UNAUTHENTICATED
            # The control: from a caller with the token, the same program's bytes are
            # unpickled on the call's own thread, before it answers (the file appears
            # by then). So the refusals' answers prove that nothing of theirs ran.
            control = work / "area" / "control"
            try:
                execute(_evil_program(control), timeout=30, metadata=AUTH)
            except grpc.RpcError:
                pass  # not a program JAX can run: unpickled all the same
            assert control.exists()
        finally:
            ch.close()
        assert not marker.exists()
        # With the token: a call naming a payload file that is not there is refused,
        # typed, without the server's folders in its answer (it was UNKNOWN, the
        # server's path in its text).
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        try:
            head = json.dumps({"program": "p", "inputs": [], "file": "call-gone",
                               "size": 99, "offsets": [0], "nbytes": [99]}).encode()
            bogus = struct.pack("<Q", len(head)) + head  # transfer's framing
            reply = ch.unary_unary("/mtc.Host/Execute")(bogus, timeout=10,
                                                       metadata=[(TOKEN_HEADER, TOKEN)])
        finally:
            ch.close()
        error = transfer.unpack_message(work / "area", reply)[0]["error"]
        assert error["type"] == "ProtocolError", error
        assert str(work) not in reply.decode(errors="replace"), error
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


# -- a hostile peer --------------------------------------------------------------------------


def _code(call: Callable[[], Any]) -> grpc.StatusCode | None:
    try:
        call()
    except PeerError as e:
        return e.code
    return None


@pytest.mark.process
def test_restores_that_cannot_be_decided_hold_at_most_eight_server_threads(
        base: Path) -> None:
    """Restores asked with an hour's timeout that cannot be decided (rank 1 never
    asks): at most eight wait, holding a server thread each; the rest are refused at
    once, and the replicator answers throughout."""
    work = base / "threads"
    work.mkdir()
    (work / "token").write_text(TOKEN)
    cl = Cluster(work, 2, 1, creds=Credentials(token=TOKEN),
                 extra=("--token-file", str(work / "token"),
                        "--agreement-timeout-seconds", "3"))
    try:
        cl.start(0)
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
        print(cl.log_text(0)[-3000:])
        cl.stop_all()


class HostileEndpoint(Endpoint):
    """Rank 1 as an attacker plays it, in memory: whatever inventory it is told."""

    def __init__(self) -> None:  # no replicator behind it
        self.answer = pb.Inventory(rank=1)

    def inventory(self, req: pb.InventoryRequest) -> pb.Inventory:
        return self.answer


def _restore_in_memory(c: MemoryCluster, rid: str, timeout: float
                       ) -> pb.PrepareRestoreReply | MtcError:
    """PrepareRestore at rank 0, with rank 1's ask (the hostile peer's) sent alongside."""
    ask = c.net.peers(1, 2)[0]

    def hostile_ask() -> None:
        with contextlib.suppress(PeerError):
            ask.decide(pb.DecideRequest(rank=1, restore_id=rid, timeout_seconds=timeout),
                       deadline_s=timeout + 5)

    got, _ = at_once(lambda: c.prepare([0], timeout, rid=rid)[0], hostile_ask)
    return got


def test_a_hostile_peers_inventory_is_refused(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """An inventory naming paths outside the RAM disk, or an epoch of 2^63-1, is refused
    whole: nothing is written, no epoch is recorded; once the peer is honest the hosts
    agree again. A corrupt agreement record is moved aside, not fatal. (Whole
    replicators in one process: the refusal is the replicator's, whatever carried it.)"""
    with MemoryCluster(tmp_path / "hosts", 2, 1, start=False, agreement_timeout_s=3.0) as c:
        c.start(0)
        peer = HostileEndpoint()
        c.net.serve(1, peer)
        (tmp_path / "outside").mkdir()  # where the inventory's paths lead
        evil = pb.Inventory(rank=1)
        for origin in (0, 1):
            evil.copies.add(step=5, origin_rank=origin, files=[
                pb.FileInfo(path="../../../outside/escape", size=3, crc32c=0),
                pb.FileInfo(path="/tmp/escape-abs", size=3, crc32c=0)])
        peer.answer = evil
        # A refused inventory never agrees: each refused restore ends at its timeout
        # (the refusal is logged at the first gather, long before it).
        err = _restore_in_memory(c, "r-paths", 0.8)
        assert isinstance(err, AgreementError) and to_status(err) == grpc.StatusCode.ABORTED, err
        assert not list(tmp_path.rglob("*escape*")) and not Path("/tmp/escape-abs").exists()
        assert "refused the inventory of rank 1" in caplog.text

        peer.answer = pb.Inventory(rank=1, last_decision=pb.Decision(
            epoch=2**63 - 1, step=1, restore_id="x"))
        err = _restore_in_memory(c, "r-epoch", 0.8)
        assert isinstance(err, AgreementError) and to_status(err) == grpc.StatusCode.ABORTED, err
        book = c.root(0) / BOOK_NAME
        assert not book.exists() or all(
            r["epoch"] < 2**53 for r in json.loads(book.read_text()))

        peer.answer = pb.Inventory(rank=1)  # honest again
        reply = _restore_in_memory(c, "r-honest", 3.0)
        assert isinstance(reply, pb.PrepareRestoreReply), reply
        assert reply.step == -1 and 0 < reply.epoch < 2**53
        # A corrupt record file: moved aside at the next start, and agreement goes on.
        c.kill(0)
        (c.root(0) / BOOK_NAME).write_text('[{"epoch": 18446744073709551616, "step"')
        c.start(0)
        reply = _restore_in_memory(c, "r-after-corrupt", 3.0)
        assert isinstance(reply, pb.PrepareRestoreReply), reply
        assert [n for n in os.listdir(c.root(0)) if n.startswith(BOOK_NAME + ".corrupt-")]


# -- certificate holders -----------------------------------------------------------------------


@pytest.mark.process
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
    ctl_crt, ctl_key = make_leaf(ca, "controller", pki, controller=True)
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
        fake = offer_of(1_000_000, [pb.FileInfo(path="a.bin", size=64, crc32c=crc32c(data))])

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
            # Its own rank's copy it may offer, signed with its key (an unsigned offer
            # proves nothing: provenance.py), and then gives it up.
            mine = offer_of(7, [pb.FileInfo(path="a", size=1)], 1)
            assert code(host1, 0, "Offer", mine) == denied
            provenance.Signer(host1).sign(mine.copy, {"a": bytes(32)})
            own = code(host1, 0, "Offer", mine)
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
