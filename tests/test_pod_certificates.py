"""Replicators with the certificates cert-manager's CSI driver issues JobSet pods.

Each worker pod's certificate names the pod (``<jobset>-worker-<slice>-<host>-xxxxx``,
and ``*.<jobset>``), not ``mtc-rank-<r>``; the replicator is told how the job names
its pods (``--tls-pod-prefix``, ``--tls-hosts-per-slice``: what mtc-replicator-k8s
passes) and reads such a name as rank ``slice * hosts + host``. Real replicator
processes over mutual TLS on loopback, four hosts in two slices, certificates
issued here as the driver would (plus 127.0.0.1, the address this harness, playing
the controller, dials; in a cluster the controller dials ``<host>.<jobset>``,
which ``*.<jobset>`` covers). They replicate, agree on a restore after a host is
replaced by a pod of another name, and refuse a pod's certificate as any other
rank than its own. A trainer in those pods, told the same pod names, reads
another replicator's copy of a rank's data only when proven that rank's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from hostile_net import plant_forged_copy
from replicators import Cluster, env_with_repo, free_ports, new_cluster
from tls_certs import issue, make_ca

import mtc
from mtc import connect, rank_names
from mtc.contract import AgentConfig
from mtc.credentials import Credentials
from mtc.dispatch import LocalDispatch
from mtc.errors import ConfigError, ShardUnavailableError
from mtc.grpc_errors import PeerError
from mtc.proto import replicator_pb2 as pb
from mtc.rank_names import CONTROLLER_NAME, PodNames
from mtc.replicas import prepare_restore
from mtc.sidecar.replicator.copies import provenance
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.topology import Topology

pytestmark = pytest.mark.process  # replicator processes

JOBSET = "mtc-train"
HOSTS = 2      # per slice
PODS = PodNames(f"{JOBSET}-worker-", HOSTS)


def pod(rank: int, suffix: str) -> str:
    s, h = divmod(rank, HOSTS)
    return f"{JOBSET}-worker-{s}-{h}-{suffix}"


class Pki:
    """The job's CA, and certificate files as the CSI driver mounts them."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.ca = make_ca(f"{JOBSET}-ca")
        base.mkdir()
        self.ca_file = base / "ca.crt"
        self.ca_file.write_bytes(self.ca[0])

    def issue(self, name: str, *, ips: tuple[str, ...] = ("127.0.0.1",),
              more: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """A pod's certificate: its name, and the names peers and the controller dial
        (and ``more``: the controller's role)."""
        files = issue(self.ca, name, dns=(name, f"*.{JOBSET}", f"*.{JOBSET}.default.svc",
                                          *more), ips=ips)
        folder = self.base / name
        folder.mkdir()
        for n, data in files.items():
            (folder / n).write_bytes(data)
        return folder / "tls.crt", folder / "tls.key"

    def creds(self, name: str, *, controller: bool = False) -> Credentials:
        cert, key = self.issue(name, ips=(), more=(CONTROLLER_NAME,) if controller else ())
        return Credentials(tls_cert=cert, tls_key=key, tls_ca=self.ca_file)


def code(creds: Credentials, address: str, rank: int, method: str, req: Any) -> Any:
    """The reply to one call, or the status code it failed with."""
    c = PeerClient(address, creds, rank=rank)
    try:
        return c.call(method, req, attempts=1)
    except PeerError as e:
        return e.code
    finally:
        c.close()


def offer(origin: int, step: int) -> pb.OfferRequest:
    return pb.OfferRequest(copy=pb.StepCopy(step=step, origin_rank=origin, files=[
        pb.FileInfo(path="a.bin", size=1, crc32c=0)]))


def start_refused(base: Path, rank: int, cert: tuple[Path, Path], ca: Path,
                  nodes: list[str]) -> str:
    """stderr of a replicator of ``rank`` started with ``cert``, which must refuse."""
    r = subprocess.run([sys.executable, "-m", "mtc.sidecar.replicator.main",
                        "--local-dir", str(base / f"refused-{rank}"),
                        "--listen", f"127.0.0.1:{free_ports(1)[0]}", "--nodes", ",".join(nodes),
                        "--rank", str(rank), "--nodes-per-slice", str(HOSTS),
                        "--tls-cert", str(cert[0]), "--tls-key", str(cert[1]),
                        "--tls-ca", str(ca), "--tls-pod-prefix", PODS.prefix,
                        "--tls-hosts-per-slice", str(HOSTS)],
                       capture_output=True, text=True, timeout=60, env=env_with_repo())
    assert r.returncode == 2, r.stderr
    return r.stderr


def test_replicators_with_pod_certificates(ramdisk: Path, clusters: list[Cluster],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pki = Pki(ramdisk / "pki")
    certs = {r: pki.issue(pod(r, f"a{r}a{r}a")) for r in range(2 * HOSTS)}
    # The controller: the Pathways head's pod, whose name is no worker's.
    controller = pki.creds(f"{JOBSET}-pathways-head-0-0-h7h7h", controller=True)
    cl = new_cluster(clusters, ramdisk, 2 * HOSTS, HOSTS, creds=controller,
                     extra=("--tls-ca", str(pki.ca_file), "--tls-pod-prefix", PODS.prefix,
                            "--tls-hosts-per-slice", str(HOSTS)),
                     rank_args={r: ("--tls-cert", str(c), "--tls-key", str(k))
                                for r, (c, k) in certs.items()})
    try:
        cl.start_all()
        data = {r: os.urandom(4096) for r in range(cl.n)}
        for r in range(cl.n):
            cl.commit(r, 1, {"a.bin": data[r]})
        cl.wait_replicated(1, timeout=60)  # peers reach each other by their pods' names

        # Host 1 is replaced: a new pod (another name, another key), an empty RAM disk.
        cl.lose_host(1)
        new = pki.issue(pod(1, "n3wp0"))
        cl.rank_args[1] = ("--tls-cert", str(new[0]), "--tls-key", str(new[1]))
        cl.start(1)
        # Every replicator agrees on step 1; the new pod's data comes from its peer.
        prepared = prepare_restore(cl.addrs, token=None, creds=controller, timeout_s=60)
        assert prepared.step == 1
        assert prepared.tiers[cl.addrs[1]] == "peer"
        assert {prepared.tiers[cl.addrs[r]] for r in (0, 2, 3)} == {"local"}
        assert (cl.root(1) / "1" / "a.bin").read_bytes() == data[1]
        # The other ranks learnt the new pod's name: they copy to it again.
        cl.wait_held({(1, 3, 1), (3, 1, 1)}, timeout=30)

        host1 = Credentials(tls_cert=new[0], tls_key=new[1], tls_ca=pki.ca_file)
        denied = grpc.StatusCode.PERMISSION_DENIED
        # A pod's certificate is its rank only: rank 1's, acting for rank 0 or 3.
        assert code(host1, cl.addrs[2], 2, "Offer", offer(0, 7)) == denied
        assert code(host1, cl.addrs[0], 0, "Offer", offer(3, 7)) == denied
        assert code(host1, cl.addrs[0], 0, "Decide",
                    pb.DecideRequest(rank=0, timeout_seconds=1)) == denied
        # Its own copy: offered signed with its key (an unsigned offer proves nothing).
        assert code(host1, cl.addrs[3], 3, "Offer", offer(1, 7)) == denied
        signed = offer(1, 7)
        provenance.Signer(host1).sign(signed.copy, {"a.bin": bytes(32)})
        own = code(host1, cl.addrs[3], 3, "Offer", signed)
        assert isinstance(own, pb.OfferReply) and own.transfer_id
        code(host1, cl.addrs[3], 3, "Abort", pb.AbortRequest(transfer_id=own.transfer_id))
        # Host index 2 of 2 would be slice 1's host 0 by arithmetic: it is no rank.
        beyond = pki.creds(f"{JOBSET}-worker-0-2-b2b2b")
        assert code(beyond, cl.addrs[0], 0, "Offer", offer(2, 7)) == denied
        # Another JobSet's pod of the same indices (and the same CA): no rank here.
        stranger = pki.creds("other-worker-1-0-c5c5c")
        assert code(stranger, cl.addrs[0], 0, "Offer", offer(2, 7)) == denied
        # The controller's reads and restores, never a peer's part.
        assert code(controller, cl.addrs[2], 2, "Offer", offer(0, 7)) == denied
        assert isinstance(code(controller, cl.addrs[3], 3, "GetInventory",
                               pb.InventoryRequest()), pb.Inventory)

        # A replicator reaching peer r takes only a server whose certificate is rank r's.
        monkeypatch.setattr(rank_names, "_pods", None)
        rank_names.use_pod_names(PODS)  # as mtc-replicator's --tls-pod-prefix does
        genuine = PeerClient(cl.addrs[0], host1, rank=0, as_peer=True)
        impostor = PeerClient(cl.addrs[0], host1, rank=2, as_peer=True)
        try:
            assert isinstance(genuine.call("GetInventory", pb.InventoryRequest()),
                              pb.Inventory)
            with pytest.raises(PeerError) as ei:  # rank 0's server, asked as rank 2
                impostor.call("GetInventory", pb.InventoryRequest(), attempts=2)
            assert ei.value.code == grpc.StatusCode.UNAVAILABLE
        finally:
            genuine.close()
            impostor.close()
        assert 7 not in {c.step for r in range(cl.n) for c in cl.inventory(r).copies}

        # A replicator whose pod's certificate is another rank's does not start.
        err = start_refused(ramdisk, 0, certs[3], pki.ca_file, cl.addrs)
        assert "names rank(s) [3]" in err
        err = start_refused(ramdisk, 2, pki.issue("other-worker-1-0-d4d4d"), pki.ca_file,
                            cl.addrs)
        assert "names rank(s) none" in err
    finally:
        for rank in range(cl.n):
            print(f"--- replicator {rank} ---\n{cl.log_text(rank)[-2000:]}")


def test_a_trainer_with_its_pods_certificate_reads_only_proven_copies(
        ramdisk: Path, clusters: list[Cluster], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 57 on Kubernetes: a multi-controller trainer's own peer reads (the
    network tier of ``mtc/dispatch/local.py``, built as the manager builds it),
    with its pod's certificate. Rank 1, holding only its own real pod certificate,
    lists a copy of rank 0's step 777 made of its own bytes, signed with its own
    key. A trainer that cannot read pod names as ranks takes those bytes (as every
    GKE trainer did: it proved nothing); one told the job's pod names
    (``Options.replicator_pod_names``, ``JobSetPlace.pod_names`` in mtc-train-k8s
    and docs/deploy.md) refuses the copy, counts it, and still reads rank 1's
    proven copy of step 5 through rank 0's replicator."""
    pods = PodNames(f"{JOBSET}-worker-", 1)  # two slices of one host
    pki = Pki(ramdisk / "pki")
    certs = {r: pki.issue(f"{pods.prefix}{r}-0-t{r}t{r}t") for r in range(2)}
    cl = new_cluster(clusters, ramdisk / "hosts", 2, 1,
                     creds=pki.creds(f"{JOBSET}-pathways-head-0-0-h7h7h", controller=True),
                     extra=("--tls-ca", str(pki.ca_file), "--tls-pod-prefix", pods.prefix,
                            "--tls-hosts-per-slice", "1"),
                     rank_args={r: ("--tls-cert", str(c), "--tls-key", str(k))
                                for r, (c, k) in certs.items()})
    cl.start_all()
    cl.commit(0, 5, {"a.bin": os.urandom(4096)})
    theirs = cl.commit(1, 5, {"c.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 5), (0, 1, 5)})
    forged = b"rank 1 made this up" * 200
    plant_forged_copy(cl, certs[1][1], certs[1][0], holder=1, origin=0, step=777, data=forged)
    assert (1, 0, 777) in cl.held()  # listed, and served, by rank 1's replicator

    # Host 0's trainer: its pod's certificate, every replicator, its own first.
    topology = Topology({0: 0, 1: 1}, {0: 0, 1: 1}, (0,), False)
    config = AgentConfig(str(ramdisk / "trainer-0"), topology.host_of_device,
                         topology.slice_of_host, False, None, 1)
    tls = (str(certs[0][0]), str(certs[0][1]), str(pki.ca_file))

    def peer_reads(**kw: Any) -> LocalDispatch:
        options = mtc.Options(replicators=tuple(cl.addrs), replicator_tls=tls, **kw)
        connect.read_pod_names(options)  # what the manager does first
        return LocalDispatch(config, connect.network_tier(options, topology))

    monkeypatch.setattr(rank_names, "_pods", None)
    unchecked = peer_reads()  # no pod names: the attack as it was
    try:
        assert unchecked.peers is not None
        assert bytes(unchecked.peers.read(777, 0, "a.bin")) == forged
    finally:
        unchecked.close()

    checked = peer_reads(replicator_pod_names=(pods.prefix, pods.hosts_per_slice))
    try:
        assert checked.peers is not None
        with pytest.raises(ShardUnavailableError):
            checked.peers.read(777, 0, "a.bin")
        assert checked.peers.unproven >= 1  # rank 1's forgery, counted
        assert bytes(checked.peers.read(5, 1, "c.bin")) == theirs["c.bin"]  # proven: read
    finally:
        checked.close()

    # A certificate that names none of the job's pods proves nothing: refused at start.
    stranger = pki.issue("other-worker-0-0-s5s5s", ips=())
    with pytest.raises(ConfigError, match="names no worker pod"):
        connect.read_pod_names(mtc.Options(
            replicators=tuple(cl.addrs), replicator_pod_names=(pods.prefix, 1),
            replicator_tls=(str(stranger[0]), str(stranger[1]), str(pki.ca_file))))
