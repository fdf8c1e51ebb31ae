"""Which rank a certificate name is: ``mtc-rank-<r>`` and JobSet pod names, parsed strictly.

Pure tests of :mod:`mtc.rank_names`, and one of how a replicator
learns a peer's pod name from its certificate, against a real gRPC server behind
mutual TLS in this process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_certs import health_server, issue, make_ca

from mtc import rank_names
from mtc.credentials import Credentials
from mtc.errors import ConfigError
from mtc.rank_names import (
    PeerServerName,
    PodNames,
    name_for_rank,
    rank_name,
    rank_of,
    ranks_named,
    server_names,
    use_pod_names,
)

PODS = PodNames("mtc-train-worker-", 2)  # 2 hosts per slice


@pytest.mark.parametrize(("name", "rank"), [
    ("mtc-train-worker-0-0-abcde", 0),
    ("mtc-train-worker-0-1-b7x2k", 1),
    ("mtc-train-worker-1-0-zz9zz", 2),
    ("mtc-train-worker-3-1-22222", 7),
    ("mtc-train-worker-1023-1-q5v8t", 2047),
    ("mtc-rank-0", 0),
    ("mtc-rank-5", 5),
    ("mtc-rank-123456789", 123456789),
])
def test_names_that_are_ranks(name: str, rank: int) -> None:
    assert rank_of(name, PODS) == rank
    assert rank_of(name.encode(), PODS) == rank  # as gRPC's auth context gives them
    assert ranks_named(["*.mtc-train", name, "localhost"], PODS) == {rank}


@pytest.mark.parametrize("name", [
    "mtc-train-worker-0-2-abcde",       # host 2 of 2 would be slice 1's host 0
    "mtc-train-worker-0-9-abcde",
    "mtc-train-worker-01-0-abcde",      # leading zeros: a second spelling of a rank
    "mtc-train-worker-0-00-abcde",
    "mtc-train-worker-1234567-0-abcde",  # digits bounded
    "mtc-train-worker--1-0-abcde",
    "mtc-train-worker-+1-0-abcde",
    "mtc-train-worker-\u0663-0-abcde",  # a digit, but not an ASCII one
    "mtc-train-worker-0-1",             # the pod's host name: no generated suffix
    "mtc-train-worker-0-1-abcd",        # a suffix of 4
    "mtc-train-worker-0-1-abcdef",      # and of 6
    "mtc-train-worker-0-1-ABCDE",
    "mtc-train-worker-0-1-ab_de",
    "mtc-train-worker-0-1-abcde.mtc-train",  # the whole name, not a part
    "mtc-train-worker-0-1-abcde\n",
    " mtc-train-worker-0-1-abcde",
    "x.mtc-train-worker-0-1-abcde",
    "other-worker-0-1-abcde",           # another JobSet's pods
    "mtc-train-pathways-head-0-0-abcde",  # the controller's pod
    "mtc-train-worker-0-0-abcde-0-0-abcde",
    "*.mtc-train",
    "mtc-rank-01",
    "mtc-rank-1234567890",
    "mtc-rank--1",
    "mtc-rank-1\n",
    "mtc-rank-",
    "mtc-rank-1.mtc-train",
    "",
])
def test_names_that_are_no_rank(name: str) -> None:
    assert rank_of(name, PODS) is None
    assert ranks_named([name, "*.mtc-train"], PODS) == set()


def test_too_long_a_name_is_no_rank() -> None:
    long = PodNames("a" * 50 + "-", 2)
    assert long.rank("a" * 50 + "-0-1-abcde") == 1
    assert len("a" * 50 + "-10000-1-abcde") == 64
    assert long.rank("a" * 50 + "-10000-1-abcde") is None  # not a DNS label


def test_every_pod_of_a_job_is_its_own_rank() -> None:
    """Over the whole job: every (slice, host) is one rank, every rank one (slice, host)."""
    for hosts in (1, 2, 3, 16):
        pods = PodNames("llm-a-worker-", hosts)
        got = {pods.rank(f"llm-a-worker-{s}-{h}-x2x2x"): (s, h)
               for s in range(12) for h in range(hosts)}
        assert sorted(got) == list(range(12 * hosts))
        assert all(r == s * hosts + h for r, (s, h) in got.items())


def test_pod_names_need_a_scheme() -> None:
    """Without the scheme a pod's name is no rank (a replicator given no
    --tls-pod-prefix reads only mtc-rank-<r>)."""
    assert rank_names.pod_names() is None
    assert rank_of("mtc-train-worker-0-1-abcde") is None
    assert rank_of("mtc-rank-3") == 3


@pytest.mark.parametrize(("prefix", "hosts"), [
    ("mtc-train-worker", 2),         # no trailing '-'
    ("Mtc-train-worker-", 2),
    ("mtc_train-worker-", 2),
    ("-worker-", 2),
    ("a" * 60 + "-", 2),             # Kubernetes would cut the generated name
    ("mtc-train-worker-", 0),
])
def test_bad_schemes_are_refused(prefix: str, hosts: int) -> None:
    with pytest.raises(ConfigError):
        PodNames(prefix, hosts)


def test_the_scheme_is_set_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_names, "_pods", None)
    use_pod_names(PODS)
    use_pod_names(PodNames("mtc-train-worker-", 2))  # the same again: fine
    assert rank_of("mtc-train-worker-1-1-abcde") == 3
    with pytest.raises(ConfigError, match="already"):
        use_pod_names(PodNames("mtc-train-worker-", 4))
    with pytest.raises(ConfigError, match="already"):
        use_pod_names(PodNames("other-worker-", 2))
    assert rank_of("mtc-train-worker-1-1-abcde") == 3


def test_name_for_rank() -> None:
    names = ["mtc-train-worker-1-0-abcde", "*.mtc-train", "*.mtc-train.ns.svc"]
    assert name_for_rank(names, 2, PODS) == "mtc-train-worker-1-0-abcde"
    assert name_for_rank(names, 1, PODS) is None
    assert name_for_rank(["mtc-rank-2", "localhost"], 2, PODS) == "mtc-rank-2"
    # A certificate naming two ranks is no one's.
    assert name_for_rank([*names, rank_name(3)], 2, PODS) is None
    assert name_for_rank(["*.mtc-train"], 0, PODS) is None


# -- learning a peer's name from its certificate ------------------------------------------------


def _files(folder: Path, files: dict[str, bytes]) -> Credentials:
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return Credentials(tls_cert=folder / "tls.crt", tls_key=folder / "tls.key",
                       tls_ca=folder / "ca.crt")


@pytest.fixture
def pod_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
               ) -> Iterator[tuple[str, Credentials]]:
    """A gRPC health server behind mutual TLS with pod mtc-train-worker-1-0's
    certificate (rank 2), as the CSI driver issues it; the credentials of another pod
    of the job to call it with. This process reads the job's pod names as ranks."""
    monkeypatch.setattr(rank_names, "_pods", None)
    use_pod_names(PODS)
    ca = make_ca("mtc-train-ca")
    served = _files(tmp_path / "server", issue(ca, "mtc-train-worker-1-0-k9z2x", dns=(
        "mtc-train-worker-1-0-k9z2x", "*.mtc-train", "*.mtc-train.default.svc"), ips=()))
    caller = _files(tmp_path / "caller", issue(ca, "mtc-train-worker-0-0-b4b4b", dns=(
        "mtc-train-worker-0-0-b4b4b", "*.mtc-train"), ips=()))
    with health_server(served) as (port, _):
        yield f"127.0.0.1:{port}", caller


def _check(address: str, creds: Credentials, name: str) -> int:
    cc = creds.channel_credentials()
    assert cc is not None
    ch = grpc.secure_channel(address, cc, options=[("grpc.ssl_target_name_override", name)])
    try:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                        timeout=5).status)
    finally:
        ch.close()


def test_a_peer_is_reached_by_the_pod_name_its_certificate_bears(
        pod_server: tuple[str, Credentials]) -> None:
    address, caller = pod_server
    assert "mtc-train-worker-1-0-k9z2x" in server_names(address, caller)
    # Asked as rank 2 (slice 1, host 0): its pod's name, which gRPC then checks.
    peer = PeerServerName(address, caller, 2)
    assert peer.name == rank_name(2)  # before it looked
    assert peer.renewed() is True and peer.name == "mtc-train-worker-1-0-k9z2x"
    assert _check(address, caller, peer.name) == health_pb2.HealthCheckResponse.SERVING
    assert peer.renewed() is False  # known: not looked at again until a call fails
    peer.stale()
    assert peer.renewed() is False  # looked again (the same name): no new channel
    # Asked as rank 1, the same server is refused: it is not rank 1, and gRPC's
    # handshake with the name rank 1 would bear fails.
    other = PeerServerName(address, caller, 1)
    assert other.renewed() is False and other.name == rank_name(1)
    with pytest.raises(grpc.RpcError) as ei:
        _check(address, caller, other.name)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_peer_of_another_ca_is_not_looked_at(pod_server: tuple[str, Credentials],
                                               tmp_path: Path) -> None:
    address, _ = pod_server
    stranger = _files(tmp_path / "stranger", issue(make_ca("another CA"),
                                                   "mtc-train-worker-1-0-k9z2x",
                                                   dns=("mtc-train-worker-1-0-k9z2x",), ips=()))
    with pytest.raises(OSError):  # the handshake fails: neither trusts the other's CA
        server_names(address, stranger)
    peer = PeerServerName(address, stranger, 2)
    assert peer.renewed() is False and peer.name == rank_name(2)
