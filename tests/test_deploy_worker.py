"""Deployment, the worker side: ``mtc.sidecar.replicator.k8s`` takes ranks and peer
addresses from the JobSet environment, writes ``jax-init-info.txt`` atomically,
mirrors the replicator's health in plaintext (also over mutual TLS), and runs as a
real ``mtc-replicator-k8s`` process. No cluster runs here."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from deploy_render import (
    worker_env,
)
from grpc_health.v1 import health, health_pb2
from replicators import env_with_repo, free_ports, wait_healthy
from tls_certs import health_server

from mtc.credentials import Credentials
from mtc.errors import ConfigError
from mtc.sidecar.replicator import healthcheck
from mtc.sidecar.replicator.k8s import (
    JAX_INIT_INFO,
    HealthMirror,
    JobSetPlace,
    parse_args,
    read_jax_init_info,
    replicator_argv,
    write_jax_init_info,
)

# Every test here runs the wrapper's tools or servers of its own.
pytestmark = pytest.mark.process


# -- ranks and addresses from the JobSet environment ------------------------------------------


def test_rank_and_addresses_follow_the_jobset() -> None:
    place = JobSetPlace.from_env(worker_env())
    assert (place.slice_index, place.host_index, place.rank) == (1, 0, 3)
    assert place.num_nodes == 6
    assert place.addresses(9470) == [
        f"mtc-train-worker-{s}-{h}.mtc-train:9470" for s in range(2) for h in range(3)]
    assert place.coordinator_address(8476) == "mtc-train-worker-0-0.mtc-train:8476"
    # Rank order is the replicator's: host r % per_slice of slice r // per_slice.
    for s in range(2):
        for h in range(3):
            p = JobSetPlace.from_env(worker_env(JOB_INDEX=str(s), JOB_COMPLETION_INDEX=str(h)))
            assert p.addresses(1)[p.rank].startswith(f"mtc-train-worker-{s}-{h}.")


def test_subdomain_and_controller_view() -> None:
    place = JobSetPlace.from_env(worker_env(MTC_SUBDOMAIN="svc"))
    assert place.hostname(0) == "mtc-train-worker-0-0.svc"
    # The Pathways controller is in another replicated job: it knows only where the workers are.
    head = JobSetPlace.from_env({"JOBSET_NAME": "js", "REPLICATED_JOB_NAME": "pathways-head",
                                 "MTC_WORKER_JOB": "worker", "MTC_NUM_SLICES": "2",
                                 "MTC_HOSTS_PER_SLICE": "1"}, worker=False)
    assert head.addresses(5) == ["js-worker-0-0.js:5", "js-worker-1-0.js:5"]
    with pytest.raises(ConfigError, match="no rank"):
        _ = head.rank
    with pytest.raises(ConfigError, match="not to the workers"):
        JobSetPlace.from_env(worker_env(REPLICATED_JOB_NAME="pathways-head",
                                        MTC_WORKER_JOB="worker"))


@pytest.mark.parametrize(("over", "match"), [
    ({"JOBSET_NAME": ""}, "JOBSET_NAME is not set"),
    ({"JOB_INDEX": ""}, "JOB_INDEX is not set"),
    ({"JOB_COMPLETION_INDEX": "x"}, "JOB_COMPLETION_INDEX='x' is not an integer"),
    ({"JOB_INDEX": "2"}, r"JOB_INDEX 2 is not in 0..1"),
    ({"JOB_COMPLETION_INDEX": "3"}, r"JOB_COMPLETION_INDEX 3 is not in 0..2"),
    ({"MTC_HOSTS_PER_SLICE": "0"}, "MTC_HOSTS_PER_SLICE must be >= 1"),
    ({"MTC_NUM_SLICES": ""}, "MTC_NUM_SLICES is not set"),
])
def test_bad_environment_is_named(over: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        JobSetPlace.from_env(worker_env(**over))


def test_replicator_command_line() -> None:
    args, rest = parse_args(["--local-dir", "/local", "--tls-cert", "c", "--tls-key", "k",
                             "--tls-ca", "a", "--replicas", "1", "--keep=3"],
                            env={"MTC_REPLICATOR_PORT": "7000"})
    argv = replicator_argv(args, rest, JobSetPlace.from_env(worker_env()))
    assert argv[:2] == ["--local-dir", "/local"]
    opts = dict(zip(argv[::2], argv[1::2], strict=False))
    assert opts["--listen"] == "0.0.0.0:7000"
    assert opts["--rank"] == "3" and opts["--nodes-per-slice"] == "3"
    assert opts["--nodes"].split(",")[3] == "mtc-train-worker-1-0.mtc-train:7000"
    assert opts["--tls-ca"] == "a" and opts["--replicas"] == "1"
    # A pod's certificate names the pod: how the replicator reads such a name.
    assert opts["--tls-pod-prefix"] == "mtc-train-worker-"
    assert opts["--tls-hosts-per-slice"] == "3"
    # ... the description a trainer in the same pod gives its manager (mtc.jobset).
    assert JobSetPlace.from_env(worker_env()).pod_names == ("mtc-train-worker-", 3)
    assert argv[-1] == "--keep=3"
    from mtc.sidecar.replicator import main as replicator
    parsed = replicator.parse_args(argv)       # mtc-replicator accepts what we pass
    assert parsed.rank == 3 and parsed.keep == 3


@pytest.mark.parametrize("flag", ["--rank=1", "--nodes", "--listen=0.0.0.0:1",
                                  "--tls-pod-prefix=x-", "--tls-hosts-per-slice"])
def test_computed_flags_are_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--local-dir", "/l", flag, "x"], env={})
    assert "computed from the JobSet environment" in capsys.readouterr().err


# -- jax-init-info.txt ----------------------------------------------------------------------------


def test_jax_init_info_is_written_atomically(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jax_init_info(tmp_path / "local", 3, "mtc-train-worker-0-0.mtc-train:8476")
    assert path.read_text() == "3\nmtc-train-worker-0-0.mtc-train:8476\n"
    # What Orbax's initialize_multi_tier_checkpointing reads: the first two lines.
    assert path.read_text().split("\n")[:2] == ["3", "mtc-train-worker-0-0.mtc-train:8476"]
    assert read_jax_init_info(tmp_path / "local") == (3, "mtc-train-worker-0-0.mtc-train:8476")
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == [JAX_INIT_INFO]

    # A write that fails before the rename leaves the old file whole.
    def fail(src: Any, dst: Any, **kw: Any) -> None:
        raise OSError("disk gone")
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk gone"):
        write_jax_init_info(tmp_path / "local", 5, "elsewhere:1")
    assert read_jax_init_info(tmp_path / "local") == (3, "mtc-train-worker-0-0.mtc-train:8476")


def test_bad_jax_init_info_is_refused(tmp_path: Path) -> None:
    (tmp_path / JAX_INIT_INFO).write_text("0\n")
    with pytest.raises(ConfigError, match="coordinator"):
        read_jax_init_info(tmp_path)
    (tmp_path / JAX_INIT_INFO).write_text("zero\nhost:1\n")
    with pytest.raises(ConfigError, match="not an integer"):
        read_jax_init_info(tmp_path)


def test_wrapper_process_writes_init_info_and_mirrors_health(tmp_path: Path) -> None:
    """A real mtc-replicator-k8s: one node (so no peer must resolve), a shared token."""
    port, health_port = free_ports(2)
    (tmp_path / "token").write_text("s3cret\n")
    local = tmp_path / "local"
    env = {**env_with_repo(), **worker_env(JOB_INDEX="0", MTC_NUM_SLICES="1",
                                           MTC_HOSTS_PER_SLICE="1"),
           "MTC_REPLICATOR_PORT": str(port), "MTC_HEALTH_PORT": str(health_port),
           "MTC_WRITE_JAX_INIT_INFO": "1"}
    log = open(tmp_path / "log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtc.sidecar.replicator.k8s", "--local-dir", str(local),
         "--replicas", "0", "--token-file", str(tmp_path / "token")],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"127.0.0.1:{health_port}", lambda: proc.poll() is None, None,
                     lambda: (tmp_path / "log").read_text(), 30)
        assert healthcheck.check(f"127.0.0.1:{health_port}",
                                 "mtc.replicator.v1.Replicator") == "SERVING"
        assert healthcheck.main(["--address", f"127.0.0.1:{health_port}"]) == 0
        assert read_jax_init_info(local) == (0, "mtc-train-worker-0-0.mtc-train:8476")
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        log.close()
    assert rc == 0, (tmp_path / "log").read_text()


# -- the health mirror over mutual TLS ------------------------------------------------------------


def _tls_files(tmp_path: Path) -> dict[str, Path]:
    """A CA and one certificate for ``*.mtc-train`` (the JobSet's headless service)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("mtc-ca")).issuer_name(name("mtc-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("mtc-replicator"))
            .issuer_name(name("mtc-ca")).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("*.mtc-train")]),
                           critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"tls.crt": cert.public_bytes(serialization.Encoding.PEM),
             "tls.key": key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()),
             "ca.crt": ca.public_bytes(serialization.Encoding.PEM)}
    for n, data in files.items():
        (tmp_path / n).write_bytes(data)
    return {n: tmp_path / n for n in files}


@pytest.fixture
def tls_health_server(tmp_path: Path) -> Iterator[tuple[int, health.HealthServicer, Credentials]]:
    """A health service behind mutual TLS, as on the replicator's port."""
    f = _tls_files(tmp_path)
    creds = Credentials(tls_cert=f["tls.crt"], tls_key=f["tls.key"], tls_ca=f["ca.crt"])
    with health_server(creds, "mtc.replicator.v1.Replicator") as (port, servicer):
        yield port, servicer, creds


def test_health_mirror_follows_a_tls_replicator(
        tls_health_server: tuple[int, health.HealthServicer, Credentials]) -> None:
    port, servicer, creds = tls_health_server
    serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                            health_pb2.HealthCheckResponse.NOT_SERVING)
    # A plaintext client (what the kubelet's grpc probe is) cannot reach the TLS port.
    with pytest.raises(grpc.RpcError):
        healthcheck.check(f"127.0.0.1:{port}", timeout_s=1)
    # The pod's own name verifies against the *.mtc-train certificate.
    assert healthcheck.check(f"127.0.0.1:{port}", creds=creds,
                             tls_name="mtc-train-worker-1-0.mtc-train") == "SERVING"
    mirror = HealthMirror(f"127.0.0.1:{port}", creds, tls_name="mtc-train-worker-1-0.mtc-train",
                          poll_s=0.1)
    mirror_port = mirror.start("127.0.0.1:0")
    try:
        assert mirror.poll_once() == {"": serving, "mtc.replicator.v1.Replicator": serving}
        assert healthcheck.check(f"127.0.0.1:{mirror_port}") == "SERVING"
        servicer.set("mtc.replicator.v1.Replicator", not_serving)
        assert mirror.poll_once()["mtc.replicator.v1.Replicator"] == not_serving
        assert healthcheck.main(["--address", f"127.0.0.1:{mirror_port}",
                                 "--service", "mtc.replicator.v1.Replicator"]) == 1
    finally:
        mirror.stop()
    # A wrong name fails verification: the mirror reports NOT_SERVING, never SERVING.
    wrong = HealthMirror(f"127.0.0.1:{port}", creds, tls_name="elsewhere.example", timeout_s=1)
    try:
        assert wrong.poll_once()[""] == not_serving
    finally:
        wrong.stop()
