"""Deployment: the JobSet wrapper of the replicator, the images, the manifests (offline).

No cluster and no Docker engine run here. What is checked instead:
- ``mtc.sidecar.replicator.k8s``: ranks and peer addresses from the JobSet
  environment, ``jax-init-info.txt`` written atomically, the plaintext health
  mirror (also over mutual TLS), a real ``mtc-replicator-k8s`` process;
- ``deploy/``: every overlay, and jobs rendered by ``deploy/configure.py`` with
  values unlike the example's, render with ``kubectl kustomize``; core kinds and
  every replicated job's Job template pass ``kubernetes-validate --strict`` at
  Kubernetes 1.32 and the newest version it knows; JobSets and the
  CheckpointConfiguration pass their strict schemas
  (``../shared/schemas/`` beside the clone, or ``$MTC_JOBSET_SCHEMA``,
  ``$MTC_CPC_SCHEMA``); what docs/deploy.md and docs/operations.md promise of
  them holds (failure policies evaluated as JobSet and the Job controller would,
  memory, placement, ownership, metrics, alerts, disruption budget,
  certificates); values that must agree across the manifests do;
- the Dockerfiles: every ``COPY`` source exists and is in the build context;
  both images share the Python base and install the same pinned requirements,
  whose jax and jaxlib are pyproject's; each image's entrypoint and health
  check import and answer ``--help`` here.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from prometheus_client.parser import text_string_to_metric_families
from replicators import env_with_repo, free_ports

from mtc.errors import ConfigError
from mtc.sidecar.replicator import healthcheck
from mtc.sidecar.replicator import main as replicator_main
from mtc.sidecar.replicator.k8s import (
    JAX_INIT_INFO,
    HealthMirror,
    JobSetPlace,
    parse_args,
    read_jax_init_info,
    replicator_argv,
    write_jax_init_info,
)
from mtc.sidecar.replicator.rank_names import PodNames, ranks_named
from mtc.sidecar.replicator.security import Credentials

# Every test here renders the overlays (kubectl kustomize) or runs the images' tools.
pytestmark = pytest.mark.process

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.parent for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
DOCKERFILES = {"sidecar": REPO / "Dockerfile.sidecar", "trainer": REPO / "Dockerfile.trainer"}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
BIN = Path(sys.executable).parent


def worker_env(**over: str) -> dict[str, str]:
    env = {"JOBSET_NAME": "mtc-train", "REPLICATED_JOB_NAME": "worker", "JOB_INDEX": "1",
           "JOB_COMPLETION_INDEX": "0", "MTC_NUM_SLICES": "2", "MTC_HOSTS_PER_SLICE": "3"}
    env.update(over)
    return {k: v for k, v in env.items() if v != ""}


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
    def fail(src: Any, dst: Any) -> None:
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
        deadline = time.monotonic() + 30
        status = ""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = healthcheck.check(f"127.0.0.1:{health_port}", timeout_s=1)
            except grpc.RpcError:
                status = ""
            if status == "SERVING":
                break
            time.sleep(0.2)
        assert status == "SERVING", (tmp_path / "log").read_text()
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
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("mtc.replicator.v1.Replicator", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    sc = creds.server_credentials()
    assert sc is not None
    port = server.add_secure_port("127.0.0.1:0", sc)
    server.start()
    try:
        yield port, servicer, creds
    finally:
        server.stop(grace=None)


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


# -- the manifests ------------------------------------------------------------------------------


def tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]' (pyproject's dev extra)")
    return found


def render(overlay: Path) -> list[dict[str, Any]]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(overlay)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {overlay}:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def configure_module() -> Any:
    sys.path.insert(0, str(DEPLOY))
    try:
        import configure
    finally:
        sys.path.remove(str(DEPLOY))
    return configure


# Jobs rendered by deploy/configure.py, with values unlike the examples' everywhere, so
# that a place the script misses keeps an example's value and a test sees it.
JOBS: dict[str, dict[str, Any]] = {
    "job-pathways": {
        "name": "llm-a", "namespace": "team-x", "mode": "pathways", "project": "acme-ml-123",
        "bucket": "acme-ckpt", "serviceAccount": "trainer-sa",
        "images": {"registry": "europe-docker.pkg.dev/acme-ml-123/ml", "tag": "2.3.4"},
        "tpu": {"type": "v5p", "topology": "2x2x4", "slices": 3}, "ramDisk": "100Gi",
        "memory": {"replicator": "3Gi", "sidecar": "6Gi"}, "headNodePool": "head-pool",
        "monitoring": "prometheus-operator", "monitoringNamespace": "prom",
        "certificates": "cert-manager", "maxRestarts": 7},
    "job-multi-controller": {
        "name": "mc-b", "namespace": "team-y", "mode": "multi-controller",
        "project": "acme-ml-123", "bucket": "acme-ckpt", "images": {"tag": "1.0.0"},
        "tpu": {"type": "v5e", "topology": "4x4", "slices": 2}, "ramDisk": "48Gi",
        "memory": {"trainer": "41Gi"}, "monitoring": "none"},
    "job-pathways-gke-mtc": {
        "name": "gke-c", "namespace": "team-z", "mode": "pathways-gke-mtc",
        "project": "acme-ml-123", "bucket": "acme-ckpt",
        "tpu": {"type": "v5e", "topology": "2x4", "chipsPerHost": 8, "slices": 4},
        "ramDisk": "20Gi"},
}
CASES = [o.name for o in OVERLAYS] + sorted(JOBS)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every overlay as shipped, and every job of JOBS as deploy/configure.py renders it."""
    out = {o.name: render(o) for o in OVERLAYS}
    configure = configure_module()
    for case, data in JOBS.items():
        out[case] = configure.render(configure.Job(data, case))
    return out


def test_overlays_exist() -> None:
    assert {o.name for o in OVERLAYS} >= {"pathways", "pathways-gke-mtc", "multi-controller"}


def jobsets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "JobSet"]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (d,) = [d for d in docs if d["kind"] == kind]
    return d


def job_of(jobset: dict[str, Any], name: str) -> dict[str, Any]:
    (rj,) = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == name]
    return dict(rj)


def pod_of(rj: dict[str, Any]) -> dict[str, Any]:
    return dict(rj["template"]["spec"]["template"]["spec"])


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod.get("containers", [])}


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def arg(c: dict[str, Any], name: str) -> str | None:
    for a in c.get("args", []):
        if a.startswith(name + "="):
            return str(a.split("=", 1)[1])
    return None


def mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


def is_pathways(js: dict[str, Any]) -> bool:
    return any(rj["name"] == "pathways-head" for rj in js["spec"]["replicatedJobs"])


def quantity(q: str) -> int:
    return int(configure_module().quantity_bytes(q))


CORE_GROUPS = {"v1", "apps/v1", "batch/v1", "networking.k8s.io/v1", "policy/v1",
               "scheduling.k8s.io/v1", "rbac.authorization.k8s.io/v1"}


def validator_versions() -> list[str]:
    """The oldest Kubernetes GKE multi-tier checkpointing supports, and the newest the
    validator knows."""
    from kubernetes_validate.utils import latest_version

    return ["1.32.0", latest_version()]


@pytest.mark.parametrize("version", validator_versions())
@pytest.mark.parametrize("case", CASES)
def test_core_kinds_and_job_templates_pass_kubernetes_validate(
        case: str, version: str, rendered: dict[str, list[dict[str, Any]]],
        tmp_path: Path) -> None:
    docs = rendered[case]
    core = [d for d in docs if d["apiVersion"] in CORE_GROUPS]
    assert {d["kind"] for d in core} >= {"NetworkPolicy", "PriorityClass", "ServiceAccount",
                                         "PodDisruptionBudget"}
    # kubernetes-validate knows no JobSet; the pod templates inside are checked as Jobs.
    for js in jobsets(docs):
        for rj in js["spec"]["replicatedJobs"]:
            core.append({"apiVersion": "batch/v1", "kind": "Job",
                         "metadata": {"name": f"{js['metadata']['name']}-{rj['name']}"},
                         "spec": rj["template"]["spec"]})
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", version,
                          str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ERROR" not in out.stdout, out.stdout + out.stderr


def shared_schema(name: str, env: str) -> Path | None:
    override = os.environ.get(env)
    if override:
        if not Path(override).is_file():
            pytest.fail(f"{env}={override} is not a file")
        return Path(override)
    path = REPO.parent / "shared" / "schemas" / name
    return path if path.is_file() else None


def check_schema(schema_name: str, env: str, objs: list[dict[str, Any]], tmp_path: Path) -> None:
    schema = shared_schema(schema_name, env)
    if schema is None:
        pytest.skip(f"schema absent: no ../shared/schemas/{schema_name} beside the "
                    f"repository and no {env}; nothing was validated against it")
    assert objs
    files = []
    for i, obj in enumerate(objs):
        files.append(tmp_path / f"obj-{i}.json")
        files[-1].write_text(json.dumps(obj))
    out = subprocess.run([tool("check-jsonschema"), "--schemafile", str(schema),
                          *map(str, files)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("case", CASES)
def test_jobsets_pass_the_strict_jobset_schema(
        case: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    check_schema("jobset-v1alpha2.strict.json", "MTC_JOBSET_SCHEMA",
                 jobsets(rendered[case]), tmp_path)


@pytest.mark.parametrize("case", [c for c in CASES if c.endswith("pathways-gke-mtc")])
def test_gke_mtc_ships_its_checkpoint_configuration(
        case: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Without a CheckpointConfiguration GKE runs no driver and the pods never start."""
    docs = rendered[case]
    cpc = one(docs, "CheckpointConfiguration")
    check_schema("checkpointconfiguration-v1.strict.json", "MTC_CPC_SCHEMA", [cpc], tmp_path)
    (js,) = jobsets(docs)
    worker = pod_of(job_of(js, "worker"))
    volumes = {v["name"]: v for v in worker["volumes"]}
    assert volumes["ramdisk"]["csi"]["driver"] == "multitier-checkpoint.csi.storage.gke.io"
    # Its driver runs on this job's TPU nodes, tolerating their taint.
    for k, v in cpc["spec"]["nodeSelector"].items():
        assert worker["nodeSelector"][k] == v
    assert any(t["key"] == "google.com/tpu" for t in cpc["spec"]["tolerations"])
    # The backup tier's bucket, and the RAM disk the writers' memory is sized for.
    rep = containers(worker)["replicator"]
    assert arg(rep, "--backup") == f"gs://{cpc['spec']['cloudStorageBucketName']}/mtc-backup"
    size = quantity(cpc["spec"]["inMemoryVolumeSize"])
    assert quantity(rep["resources"]["limits"]["memory"]) > size
    assert "metadata" in cpc and "namespace" not in cpc["metadata"]  # cluster-scoped


@pytest.mark.parametrize("case", CASES)
def test_manifests_agree_with_themselves(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[case]
    (js,) = jobsets(docs)
    name = js["metadata"]["name"]
    assert js["spec"]["network"]["enableDNSHostnames"] is True
    assert js["spec"]["network"]["publishNotReadyAddresses"] is True
    assert "subdomain" not in js["spec"]["network"], "peer names assume subdomain = JobSet name"
    worker = job_of(js, "worker")
    slices, hosts = worker["replicas"], worker["template"]["spec"]["completions"]
    assert worker["template"]["spec"]["parallelism"] == hosts
    assert worker["template"]["spec"]["completionMode"] == "Indexed"
    pod = pod_of(worker)
    cs = containers(pod)
    rep = cs["replicator"]
    assert rep["restartPolicy"] == "Always"          # a native sidecar
    renv = env_of(rep)
    assert renv["MTC_HOSTS_PER_SLICE"] == str(hosts)
    assert "replicatedjob-replicas" in renv["MTC_NUM_SLICES"]["fieldRef"]["fieldPath"]
    port, health_port = int(renv["MTC_REPLICATOR_PORT"]), int(renv["MTC_HEALTH_PORT"])
    ports = {p["name"]: p["containerPort"] for p in rep["ports"]}
    assert ports["replicator"] == port and ports["health"] == health_port
    # The data channel on a fixed, declared port (a strict NetworkPolicy names it).
    assert arg(rep, "--data-port") == str(ports["replicator-data"])
    assert len(set(ports.values())) == len(ports)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert rep[probe]["grpc"]["port"] == health_port, probe

    # Peer TLS from the pod's certificate volume, mounted where the replicator's flags
    # point (test_every_pod_gets_a_certificate_naming_its_rank: what it names).
    volumes = {v["name"]: v for v in pod["volumes"]}
    tls_mount = mounts(rep)["replicator-tls"]
    for flag, file in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"),
                       ("--tls-ca", "ca.crt")):
        assert arg(rep, flag) == f"{tls_mount}/{file}"
    issuer = volumes["replicator-tls"]["csi"]["volumeAttributes"][
        "csi.cert-manager.io/issuer-name"]

    # The RAM disk: mounted at the replicator's --local-dir in the replicator and the writer.
    local = arg(rep, "--local-dir")
    ramdisk = volumes["ramdisk"]
    assert ramdisk.get("emptyDir", {}).get("medium") == "Memory" or \
        ramdisk.get("csi", {}).get("driver") == "multitier-checkpoint.csi.storage.gke.io"
    writer = "colocated-python-sidecar" if "pathways-worker" in cs else "trainer"
    for c in ("replicator", writer):
        assert mounts(cs[c])["ramdisk"] == local

    # Priority for hot swap, from a PriorityClass the overlay ships.
    classes = {d["metadata"]["name"] for d in docs if d["kind"] == "PriorityClass"}
    for rj in js["spec"]["replicatedJobs"]:
        assert pod_of(rj)["priorityClassName"] in classes

    # The NetworkPolicy: the replicator port only from this JobSet's pods.
    np_ = one(docs, "NetworkPolicy")
    label = "jobset.sigs.k8s.io/jobset-name"
    assert np_["spec"]["podSelector"]["matchLabels"] == {label: name}
    for rule in np_["spec"]["ingress"]:
        open_ports = {p["port"] for p in rule.get("ports", [])}
        if rule.get("from") == [{"podSelector": {"matchLabels": {label: name}}}]:
            assert not open_ports
        else:
            assert port not in open_ports and open_ports, rule
            assert ports["replicator-data"] not in open_ports, rule
            assert open_ports <= {health_port, ports["metrics"]}

    trainer_pod = pod_of(job_of(js, "pathways-head")) if writer != "trainer" else pod
    trainer = containers(trainer_pod)["trainer"]
    tenv = env_of(trainer)
    assert tenv["MTC_HOSTS_PER_SLICE"] == str(hosts)
    assert tenv["MTC_REPLICATOR_PORT"] == str(port)
    assert arg(trainer, "--ramdisk") == local
    tls_dir = mounts(trainer)["replicator-tls"]
    assert tenv["MTC_TLS_DIR"] == tls_dir
    assert {v["name"]: v for v in trainer_pod["volumes"]}["replicator-tls"]["csi"][
        "volumeAttributes"]["csi.cert-manager.io/issuer-name"] == issuer

    if writer == "trainer":                     # multi-controller
        assert "--write-jax-init-info" in rep["args"]
        coord = {p["name"]: p["containerPort"] for p in trainer["ports"]}["coordinator"]
        assert env_of(rep)["MTC_COORDINATOR_PORT"] == str(coord)
    else:                                       # Pathways
        assert "--write-jax-init-info" not in rep["args"]
        assert js["spec"]["coordinator"]["replicatedJob"] == "pathways-head"
        assert tenv["MTC_NUM_SLICES"] == str(slices) and tenv["MTC_WORKER_JOB"] == "worker"
        assert tenv["JAX_PLATFORMS"] == "proxy"
        head = containers(trainer_pod)
        assert arg(head["pathways-proxy"], "--num_elastic_slices") == str(slices)
        assert arg(head["pathways-proxy"], "--sidecar_name") == "external"
        assert arg(head["pathways-rm"], "--instance_count") == str(slices)
        side = cs["colocated-python-sidecar"]
        shm = env_of(side)["CLOUD_PATHWAYS_SIDECAR_SHM_DIRECTORY"]
        assert env_of(cs["pathways-worker"])["CLOUD_PATHWAYS_SIDECAR_SHM_DIRECTORY"] == shm
        for c in ("pathways-worker", "colocated-python-sidecar"):
            assert mounts(cs[c])["sidecar-shm"] == shm
        assert volumes["sidecar-shm"]["emptyDir"]["medium"] == "Memory"
        # The slice shape the resource manager expects is the worker job's.
        instance = arg(head["pathways-rm"], "--instance_type")
        assert instance is not None
        topology = instance.split(":")[1]
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
        chips = int(cs["pathways-worker"]["resources"]["limits"]["google.com/tpu"])
        assert math.prod(int(d) for d in topology.split("x")) == chips * hosts
        # Pathways' images serve one jax release: the images' lock's (the job file's
        # images.pathways defaults to it).
        for c in [*cs.values(), *head.values()]:
            if "cloud-tpu-v2-images/pathways/" in c["image"]:
                assert c["image"].endswith(f":jax-{lock()['jax']}"), c["image"]
    # Every pod port in one pod is distinct (they share a network namespace).
    for rj in js["spec"]["replicatedJobs"]:
        all_ports = [p["containerPort"] for c in containers(pod_of(rj)).values()
                     for p in c.get("ports", [])]
        assert len(all_ports) == len(set(all_ports)), (rj["name"], all_ports)


@pytest.mark.parametrize("case", CASES)
def test_each_slice_is_one_node_pool(case: str,
                                     rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Without JobSet's exclusive topology, only the accelerator and topology
    selectors place the pods: one slice's pods could land in two node pools."""
    (js,) = jobsets(rendered[case])
    worker = job_of(js, "worker")
    annotations = worker["template"].get("metadata", {}).get("annotations", {})
    assert annotations.get("alpha.jobset.sigs.k8s.io/exclusive-topology") == \
        "cloud.google.com/gke-nodepool"
    if is_pathways(js):
        head = job_of(js, "pathways-head")["template"]["metadata"]["annotations"]
        assert head["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "kubernetes.io/hostname"


def jobset_action(js: dict[str, Any], replicated_job: str, reason: str) -> str:
    """What JobSet does when a child Job of ``replicated_job`` fails for ``reason``:
    the first rule whose reasons and target jobs match (empty lists match all), else
    RestartJobSet (JobSet's configurable failure policy)."""
    for rule in js["spec"]["failurePolicy"].get("rules", []):
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        if rule.get("targetReplicatedJobs") and \
                replicated_job not in rule["targetReplicatedJobs"]:
            continue
        return str(rule["action"])
    return "RestartJobSet"


def pod_failure_action(job_spec: dict[str, Any], *, condition: str | None = None,
                       container: str | None = None, exit_code: int | None = None) -> str:
    """What the Job does with a failed pod: the first podFailurePolicy rule that
    matches, else Count (Kubernetes' Job controller)."""
    for rule in job_spec.get("podFailurePolicy", {}).get("rules", []):
        if condition and any(c["type"] == condition for c in rule.get("onPodConditions", [])):
            return str(rule["action"])
        codes = rule.get("onExitCodes")
        if codes and exit_code is not None and codes.get("containerName") in (None, container) \
                and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return str(rule["action"])
    return "Count"


@pytest.mark.parametrize("case", CASES)
def test_a_failed_slice_restarts_alone(case: str,
                                       rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Recreating the whole JobSet empties every memory RAM disk: a worker failure
    restarts its own slice's Job only; host maintenance does not count as a failure;
    the pods have time to finish a save (and the replicator to send it on)."""
    (js,) = jobsets(rendered[case])
    policy = js["spec"]["failurePolicy"]
    assert policy.get("restartStrategy", "Recreate") != "InPlaceRestart", \
        "in-place restart needs JobSet's agent in every pod"
    # What JobSet's admission webhook checks of the rules (v0.12.0).
    names = [r["name"] for r in policy["rules"]]
    assert len(names) == len(set(names))
    jobs = {rj["name"] for rj in js["spec"]["replicatedJobs"]}
    for r in policy["rules"]:
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", r["name"]), r["name"]
        assert set(r.get("targetReplicatedJobs", [])) <= jobs, r
        assert set(r.get("onJobFailureReasons", [])) <= {
            "BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
            "MaxFailedIndexesExceeded", "PodFailurePolicy"}, r
    assert policy["maxRestarts"] >= 1
    assert jobset_action(js, "worker", "BackoffLimitExceeded") in (
        "RestartJob", "RestartJobAndIgnoreMaxRestarts")
    # A configuration error (a pod failure policy's FailJob) ends the JobSet at once.
    assert jobset_action(js, "worker", "PodFailurePolicy") == "FailJobSet"
    if is_pathways(js):
        # Google's Pathways manifests: a failed head restarts everything.
        assert jobset_action(js, "pathways-head", "BackoffLimitExceeded") == "RestartJobSet"
    for rj in js["spec"]["replicatedJobs"]:
        spec = rj["template"]["spec"]
        pod = pod_of(rj)
        # Maintenance, preemption, eviction: replaced, not counted as a failure.
        assert pod_failure_action(spec, condition="DisruptionTarget") == "Ignore", rj["name"]
        # The API server accepts a pod failure policy only with restartPolicy Never.
        assert pod["restartPolicy"] == "Never", rj["name"]
        assert pod["terminationGracePeriodSeconds"] >= 60, rj["name"]
        if "trainer" in containers(pod):
            assert pod_failure_action(spec, container="trainer", exit_code=2) == "FailJob"
            assert pod_failure_action(spec, container="trainer", exit_code=1) == "Count"
    assert job_of(js, "worker")["template"]["spec"]["backoffLimit"] == 0


@pytest.mark.parametrize("case", CASES)
def test_ramdisk_memory_is_requested_and_limited(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """RAM-disk pages count against the memory of the container that writes them: the
    pod's requests cover the disk (or the kubelet evicts it first under pressure),
    and no writer's limit is below it (or a full disk OOM-kills the writer)."""
    docs = rendered[case]
    (js,) = jobsets(docs)
    pod = pod_of(job_of(js, "worker"))
    ramdisk = {v["name"]: v for v in pod["volumes"]}["ramdisk"]
    if "emptyDir" in ramdisk:
        size = quantity(ramdisk["emptyDir"]["sizeLimit"])
    else:
        size = quantity(one(docs, "CheckpointConfiguration")["spec"]["inMemoryVolumeSize"])
    writers = [c for c in containers(pod).values() if "ramdisk" in mounts(c)]
    assert {c["name"] for c in writers} >= {"replicator"} and len(writers) == 2
    requests = [quantity(c["resources"]["requests"]["memory"]) for c in writers]
    limits = [quantity(c["resources"]["limits"]["memory"]) for c in writers]
    assert sum(requests) >= size + 2 * 2**30   # the disk and each one's working memory
    for c, req, lim in zip(writers, requests, limits, strict=True):
        assert lim >= size + 2**30, c["name"]
        assert req <= lim, c["name"]


@pytest.mark.parametrize("case", [c for c in CASES if "pathways" in c])
def test_pathways_worker_head_and_restart_policy(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    (js,) = jobsets(rendered[case])
    worker = containers(pod_of(job_of(js, "worker")))["pathways-worker"]
    env = env_of(worker)
    assert {k: env[k] for k in ("XCLOUD_ENVIRONMENT", "TPU_MIN_LOG_LEVEL",
                                "TF_CPP_MIN_LOG_LEVEL", "MEGASCALE_GRPC_ENABLE_XOR_TRACER")} \
        == {"XCLOUD_ENVIRONMENT": "GCP", "TPU_MIN_LOG_LEVEL": "0", "TF_CPP_MIN_LOG_LEVEL": "0",
            "MEGASCALE_GRPC_ENABLE_XOR_TRACER": "false"}
    downward = {"JOBSET_NAME": "metadata.annotations['jobset.sigs.k8s.io/jobset-name']",
                "REPLICATED_JOB_NAME":
                    "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']",
                "MEGASCALE_NUM_SLICES":
                    "metadata.labels['jobset.sigs.k8s.io/replicatedjob-replicas']",
                "MEGASCALE_SLICE_ID": "metadata.labels['jobset.sigs.k8s.io/job-index']",
                "MEGASCALE_COORDINATOR_ADDRESS":
                    "metadata.labels['jobset.sigs.k8s.io/coordinator']",
                "PATHWAYS_HEAD": "metadata.labels['jobset.sigs.k8s.io/coordinator']"}
    for k, path in downward.items():
        assert env[k] == {"fieldRef": {"fieldPath": path}}, k
    head_job = job_of(js, "pathways-head")
    head = pod_of(head_job)
    # On a CPU node pool, never a TPU node; no in-place restart; started first.
    assert head["nodeSelector"].keys() == {"cloud.google.com/gke-nodepool"}
    assert not any("google.com/tpu" in c.get("resources", {}).get("limits", {})
                   for c in containers(head).values())
    assert head["restartPolicy"] == "Never"
    assert head_job["template"]["spec"]["backoffLimit"] == 0
    assert js["spec"]["startupPolicy"]["startupPolicyOrder"] == "InOrder"


@pytest.mark.parametrize("case", CASES)
def test_pods_run_as_the_service_account_granted_the_bucket(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[case]
    sa = one(docs, "ServiceAccount")
    (js,) = jobsets(docs)
    for rj in js["spec"]["replicatedJobs"]:
        assert pod_of(rj)["serviceAccountName"] == sa["metadata"]["name"], rj["name"]
    assert sa["automountServiceAccountToken"] is False
    assert sa["metadata"].get("namespace", "default") == js["metadata"].get("namespace",
                                                                             "default")
    # The guide's IAM binding names the namespace and this account, not "default".
    guide = (REPO / "docs" / "deploy.md").read_text()
    assert "subject/ns/$NAMESPACE/sa/$KSA" in guide


def effective_uid(c: dict[str, Any], pod: dict[str, Any]) -> int:
    """The uid a container runs as; the manifests state it wherever volumes are shared."""
    uid = c.get("securityContext", {}).get("runAsUser",
                                           pod.get("securityContext", {}).get("runAsUser"))
    assert uid is not None, f"{c['name']} does not state its user"
    return int(uid)


@pytest.mark.parametrize("case", CASES)
def test_shared_folders_have_one_owner(case: str,
                                       rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Containers that write one volume run as one user: each must write, rename and
    delete what the other created, whatever umask created it (the root pathways-worker's
    files in /tmp, the sidecar's steps the replicator deletes, GKE's root-owned volume)."""
    (js,) = jobsets(rendered[case])
    for rj in js["spec"]["replicatedJobs"]:
        pod = pod_of(rj)
        writers: dict[str, set[int]] = {}
        for c in containers(pod).values():
            for m in c.get("volumeMounts", []):
                if not m.get("readOnly"):
                    writers.setdefault(m["name"], set()).add(effective_uid(c, pod))
        for volume, uids in writers.items():
            assert len(uids) == 1, f"{rj['name']}: {volume} is written by users {uids}"
    pod = pod_of(job_of(js, "worker"))
    cs = containers(pod)
    if "pathways-worker" in cs:
        # /tmp shared by pathways-worker and the sidecar, as Google's manifests do (an
        # emptyDir here, not the node's /tmp).
        for c in ("pathways-worker", "colocated-python-sidecar"):
            assert mounts(cs[c])["shared-tmp"] == "/tmp"
        assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}["shared-tmp"]
        for c in ("colocated-python-sidecar", "replicator"):
            sc = cs[c]["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"] and \
                sc["allowPrivilegeEscalation"] is False, c
    else:
        assert effective_uid(cs["replicator"], pod) == 10001


@pytest.mark.parametrize("case", CASES)
def test_metrics_are_declared_scraped_and_let_in(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[case]
    (js,) = jobsets(docs)
    name = js["metadata"]["name"]
    pod = pod_of(job_of(js, "worker"))
    rep = containers(pod)["replicator"]
    port = {p["name"]: p["containerPort"] for p in rep["ports"]}["metrics"]
    assert arg(rep, "--metrics-port") == str(port)
    assert arg(rep, "--metrics-address") == "0.0.0.0"
    # Worker pods carry these labels (JobSet sets them).
    labels = {"jobset.sigs.k8s.io/jobset-name": name,
              "jobset.sigs.k8s.io/replicatedjob-name": "worker"}
    kinds = {d["kind"] for d in docs}
    scraper_namespaces = set()
    if "PodMonitoring" in kinds:
        pm = one(docs, "PodMonitoring")
        assert pm["spec"]["selector"]["matchLabels"] == labels
        assert [e["port"] for e in pm["spec"]["endpoints"]] == ["metrics"]
        assert {t["to"] for t in pm["spec"]["targetLabels"]["fromPod"]} >= {"jobset"}
        scraper_namespaces.add("gmp-system")
    if "ServiceMonitor" in kinds:
        svc, sm = one(docs, "Service"), one(docs, "ServiceMonitor")
        assert svc["spec"]["selector"] == labels
        assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        assert [e["port"] for e in sm["spec"]["endpoints"]] == [svc["spec"]["ports"][0]["name"]]
        assert {r["targetLabel"] for r in sm["spec"]["endpoints"][0]["relabelings"]} >= \
            {"jobset"}
        scraper_namespaces.add(JOBS[case]["monitoringNamespace"] if case in JOBS
                               else "monitoring")
    if case in JOBS and JOBS[case].get("monitoring") == "none":
        assert not kinds & {"PodMonitoring", "Rules", "ServiceMonitor", "PrometheusRule"}
    if case in JOBS and JOBS[case].get("monitoring") == "prometheus-operator":
        assert not kinds & {"PodMonitoring", "Rules"}, "GMP's objects need GMP's CRDs"
    # The NetworkPolicy lets each scraper's namespace reach the metrics port, and only it.
    allowed = set()
    for rule in one(docs, "NetworkPolicy")["spec"]["ingress"]:
        if port in {p["port"] for p in rule.get("ports", [])}:
            for peer in rule["from"]:
                allowed.add(peer["namespaceSelector"]["matchLabels"][
                    "kubernetes.io/metadata.name"])
    assert scraper_namespaces <= allowed


def alert_groups(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for kind in ("Rules", "PrometheusRule"):
        found = [d for d in docs if d["kind"] == kind]
        if found:
            return list(found[0]["spec"]["groups"])
    return []


def test_alert_rules_are_one_set_with_runbooks(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    gmp = yaml.safe_load((DEPLOY / "components/monitoring-gmp/rules.yaml").read_text())
    prom = yaml.safe_load(
        (DEPLOY / "components/monitoring-prometheus/prometheusrule.yaml").read_text())
    assert gmp["spec"]["groups"] == prom["spec"]["groups"], "the two rule sets differ"
    rules = [r for g in gmp["spec"]["groups"] for r in g["rules"]]
    alerts = {r["alert"] for r in rules}
    # Replication lag, backup age, quarantined files, failures.
    assert alerts >= {"MtcReplicationLagging", "MtcBackupStale", "MtcNoBackup",
                      "MtcFilesQuarantined", "MtcReplicatorFailing"}
    runbook = (REPO / "docs" / "operations.md").read_text()
    headings = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
                for h in re.findall(r"^#+ (.+)$", runbook, re.M)}
    for r in rules:
        anchor = r["annotations"]["runbook"]
        assert anchor == f"docs/operations.md#{r['alert'].lower()}", anchor
        assert r["alert"].lower() in headings, f"no runbook entry for {r['alert']}"
        assert r["labels"]["severity"] in ("warning", "critical")
    # The shipped overlays and the jobs that ask for it carry the rules.
    for case in ("pathways", "multi-controller", "job-pathways"):
        assert alert_groups(rendered[case]) == gmp["spec"]["groups"], case


def test_alerts_read_what_a_replicator_exports(tmp_path: Path) -> None:
    """Every series the alert rules read is on a real replicator's metrics port, and
    the backup-age series move when a backup is committed."""
    from replicators import Cluster

    rules = yaml.safe_load((DEPLOY / "components/monitoring-gmp/rules.yaml").read_text())
    exprs = " ".join(r["expr"] for g in rules["spec"]["groups"] for r in g["rules"])
    wanted = set(re.findall(r"\bmtc_[a-z_]+", exprs))
    cl = Cluster(tmp_path, 1, 1, metrics=True,
                 extra=("--replicas", "0", "--backup", (tmp_path / "bucket").as_uri(),
                        "--backup-interval-minutes", "30"))
    try:
        cl.start_all()
        before = cl.scrape(0)
        # Families, with or without samples yet (a labelled counter has none until used).
        with urllib.request.urlopen(f"http://127.0.0.1:{cl.metrics_ports[0]}/metrics",
                                    timeout=5) as r:
            families = list(text_string_to_metric_families(r.read().decode()))
        names = {f.name + ("_total" if f.type == "counter" else "") for f in families}
        assert wanted <= names, wanted - names
        assert before["mtc_backup_interval_seconds"] == 1800
        assert before["mtc_backup_last_success_timestamp_seconds"] == 0
        cl.commit(0, 4, {"a.bin": b"x" * 1024})
        client = cl.client(0)
        try:
            from mtc.proto import replicator_pb2 as pb

            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if client.call("RequestBackup", pb.BackupRequest(step=-1),
                               deadline_s=30).step == 4:
                    break
                time.sleep(0.2)
        finally:
            client.close()
        after = cl.scrape(0)
        assert after["mtc_newest_step{state=backed_up}"] == 4
        assert abs(after["mtc_backup_last_success_timestamp_seconds"] - time.time()) < 60
    finally:
        cl.stop_all()


@pytest.mark.parametrize("case", CASES)
def test_disruptions_take_one_host_at_a_time(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Host h of two slices disrupted together loses both copies of rank h's newest
    step; one host down fails its slice: at most one slice is disrupted at a time."""
    docs = rendered[case]
    (js,) = jobsets(docs)
    worker = job_of(js, "worker")
    pods = worker["replicas"] * worker["template"]["spec"]["completions"]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == pods - 1
    assert "maxUnavailable" not in pdb["spec"], "Jobs have no scale subresource"
    assert pdb["spec"]["selector"]["matchLabels"] == {
        "jobset.sigs.k8s.io/jobset-name": js["metadata"]["name"],
        "jobset.sigs.k8s.io/replicatedjob-name": "worker"}


# cert-manager's CSI driver fills in these variables in a volume's attributes and
# refuses a volume naming any other (os.Expand in its request generator).
CSI_VARIABLES = {"POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME"}
# Key usages cert-manager knows (its KeyUsage values); the driver refuses others.
CERT_USAGES = {"signing", "digital signature", "content commitment", "key encipherment",
               "key agreement", "data encipherment", "cert sign", "crl sign",
               "encipher only", "decipher only", "any", "server auth", "client auth",
               "code signing", "email protection", "s/mime", "ipsec end system",
               "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing"}
CSI = "csi.cert-manager.io/"


def certificate_volume(pod: dict[str, Any]) -> dict[str, str]:
    """The attributes of the pod's certificate volume, from cert-manager's CSI driver."""
    v = {v["name"]: v for v in pod["volumes"]}["replicator-tls"]
    assert v["csi"]["driver"] == "csi.cert-manager.io" and v["csi"]["readOnly"] is True
    attrs: dict[str, str] = v["csi"]["volumeAttributes"]
    for value in attrs.values():
        assert set(re.findall(r"\$\{([^}]*)\}", value)) <= CSI_VARIABLES, value
        assert "$" not in re.sub(r"\$\{[^}]*\}", "", value), value
    usages = {u.strip() for u in attrs[CSI + "key-usages"].split(",")}
    assert "client auth" in usages and usages <= CERT_USAGES, usages
    assert attrs[CSI + "key-algorithm"] == "ECDSA" and attrs[CSI + "key-size"] == "256"
    assert re.fullmatch(r"\d+h", attrs[CSI + "duration"])
    return attrs


def dns_names(attrs: dict[str, str], pod: str, namespace: str) -> list[str]:
    """The certificate's DNS names as the CSI driver fills them in for ``pod``."""
    value = attrs[CSI + "dns-names"].replace("${POD_NAME}", pod)
    return [n.strip() for n in value.replace("${POD_NAMESPACE}", namespace).split(",")]


def pod_name(job: str, index: int, suffix: str = "x7k2q") -> str:
    """The name Kubernetes gives pod ``index`` of Indexed Job ``job`` (its prefix cut
    to 58 characters, the index kept, as the Job controller does)."""
    tail = f"-{index}-"
    return (job + tail)[:58 - len(tail)] + tail + suffix if len(job + tail) > 58 \
        else job + tail + suffix


@pytest.mark.parametrize("case", CASES)
def test_every_pod_gets_a_certificate_naming_its_rank(
        case: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Each worker pod's certificate, as cert-manager's CSI driver issues it from the
    job's own CA, names that pod's rank the way its replicator reads names (with the
    flags mtc-replicator-k8s computes from the pod's environment: it refuses to
    start otherwise) and covers the name the controller dials; the controller's
    certificate names no rank."""
    docs = rendered[case]
    (js,) = jobsets(docs)
    name = js["metadata"]["name"]
    ns = js["metadata"].get("namespace", "default")
    issuers = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Issuer"}
    certs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Certificate"}
    assert not [c for c in certs.values() if not c["spec"].get("isCA")], \
        "no certificate shared by pods: each pod's comes from the CSI driver"
    worker = job_of(js, "worker")
    slices, hosts = worker["replicas"], worker["template"]["spec"]["completions"]
    pod = pod_of(worker)
    attrs = certificate_volume(pod)
    assert {u.strip() for u in attrs[CSI + "key-usages"].split(",")} >= {"server auth",
                                                                         "client auth"}
    # Signed by the job's own CA Issuer (a CA shared with another job would make that
    # job's pods ranks here), whose CA cert-manager makes.
    assert attrs[CSI + "issuer-name"] == f"{name}-ca"
    assert attrs.get(CSI + "issuer-kind", "Issuer") == "Issuer"
    issuer = issuers[attrs[CSI + "issuer-name"]]
    (ca,) = [c for c in certs.values()
             if c["spec"]["secretName"] == issuer["spec"]["ca"]["secretName"]]
    assert ca["spec"]["isCA"] is True
    assert "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    # Its files (0440, group fs-group) are readable by every container mounting them.
    group = int(attrs[CSI + "fs-group"])
    for c in containers(pod).values():
        if "replicator-tls" in mounts(c):
            sc = c["securityContext"]
            assert sc["runAsUser"] == 0 or sc["runAsGroup"] == group, c["name"]

    rep = containers(pod)["replicator"]
    renv = {k: v for k, v in env_of(rep).items() if isinstance(v, str)}
    pods = None
    for s in range(slices):
        for h in range(hosts):
            # The pod's environment as the downward API fills it in, and the command
            # line mtc-replicator-k8s makes of it.
            place = JobSetPlace.from_env(worker_env(
                JOBSET_NAME=name, JOB_INDEX=str(s), JOB_COMPLETION_INDEX=str(h),
                MTC_NUM_SLICES=str(slices), MTC_HOSTS_PER_SLICE=renv["MTC_HOSTS_PER_SLICE"]))
            rargs, rest = parse_args([*rep["args"]], env=renv)
            parsed = replicator_main.parse_args(replicator_argv(rargs, rest, place))
            pods = PodNames(parsed.tls_pod_prefix, parsed.tls_hosts_per_slice)
            names = dns_names(attrs, pod_name(f"{name}-worker-{s}", h), ns)
            assert ranks_named(names, pods) == {parsed.rank} == {s * hosts + h}, names
            # The name the controller and the health mirror dial: one wildcard label.
            host = place.hostname(place.rank)
            assert any(fnmatch.fnmatch(host, n) and n.count(".") == host.count(".")
                       for n in names), (host, names)
            assert f"*.{name}.{ns}.svc" in names
    assert pods is not None
    # Another pod of the same slot (a replacement) is the same rank; another job's is none.
    assert ranks_named(dns_names(attrs, pod_name(f"{name}-worker-0", 0, "bbbbb"), ns),
                       pods) == {0}
    assert ranks_named(dns_names(attrs, pod_name(f"x{name}-worker-0", 0), ns), pods) == set()

    if is_pathways(js):
        head = pod_of(job_of(js, "pathways-head"))
        hattrs = certificate_volume(head)
        assert hattrs[CSI + "issuer-name"] == attrs[CSI + "issuer-name"]
        names = dns_names(hattrs, pod_name(f"{name}-pathways-head-0", 0), ns)
        assert ranks_named(names, pods) == set(), names   # the controller: no rank
        assert "server auth" not in hattrs[CSI + "key-usages"]
        trainer = containers(head)["trainer"]
    else:
        # Multi-controller: each trainer uses its pod's certificate, naming its rank.
        trainer = containers(pod)["trainer"]
    assert env_of(trainer)["MTC_TLS_DIR"] == mounts(trainer)["replicator-tls"]


def _hours(duration: str) -> int:
    m = re.fullmatch(r"(\d+)h", duration)
    assert m, duration
    return int(m.group(1))


def test_a_renewed_ca_keeps_its_key(rendered: dict[str, list[dict[str, Any]]],
                                    tmp_path: Path) -> None:
    """cert-manager renews the job's CA with the same key, and before any pod's
    certificate could outlive the old CA certificate: a pod still trusting the old
    one accepts certificates the renewed one signs, so a CA renewal splits no pods
    (docs/operations.md, "Certificates")."""
    for case in CASES:
        docs = rendered[case]
        (ca,) = [d for d in docs if d["kind"] == "Certificate" and d["spec"].get("isCA")]
        assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never", case
        (js,) = jobsets(docs)
        life = _hours(certificate_volume(pod_of(job_of(js, "worker")))[CSI + "duration"])
        assert _hours(ca["spec"]["renewBefore"]) >= life, case

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from tls_certs import issue, make_ca

    old_pem, key = make_ca("mtc-train-ca")
    old = x509.load_pem_x509_certificate(old_pem)
    now = datetime.datetime.now(datetime.UTC)
    renewed = (x509.CertificateBuilder().subject_name(old.subject).issuer_name(old.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(days=2))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(key, hashes.SHA256())).public_bytes(serialization.Encoding.PEM)

    def creds(name: str, files: dict[str, bytes]) -> Credentials:
        folder = tmp_path / name
        folder.mkdir()
        for n, data in {**files, "ca.crt": old_pem}.items():  # trusting the old CA
            (folder / n).write_bytes(data)
        return Credentials(tls_cert=folder / "tls.crt", tls_key=folder / "tls.key",
                           tls_ca=folder / "ca.crt")

    served = creds("server", issue((renewed, key), "mtc-train-worker-0-0-abcde",
                                   dns=("mtc-train-worker-0-0-abcde", "*.mtc-train")))
    renewed_pod = creds("renewed", issue((renewed, key), "mtc-train-worker-1-0-bcdef"))
    new_key_pod = creds("new-key", issue(make_ca("mtc-train-ca"), "mtc-train-worker-1-0-cdefg"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    sc = served.server_credentials()
    assert sc is not None
    port = server.add_secure_port("127.0.0.1:0", sc)
    server.start()
    try:
        address, name = f"127.0.0.1:{port}", "mtc-train-worker-0-0.mtc-train"
        assert healthcheck.check(address, creds=renewed_pod, tls_name=name) == "SERVING"
        with pytest.raises(grpc.RpcError):  # a CA with another key is another CA
            healthcheck.check(address, creds=new_key_pod, tls_name=name, timeout_s=2)
    finally:
        server.stop(grace=None)


def test_secret_certificates_are_refused() -> None:
    """A job file of the shared-Secret days: one certificate cannot name each host's
    rank, so it is refused by key, saying what to do."""
    configure = configure_module()
    data = {**JOBS["job-multi-controller"], "certificates": "secret"}
    with pytest.raises(configure.JobFileError,
                       match=r"job\.yaml: certificates: 'secret' .* must name its rank"):
        configure.Job(data, "job.yaml")


@pytest.mark.parametrize("case", CASES)
def test_trainer_gives_the_manager_the_replicators_of_its_pods(
        case: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``mtc-train-k8s`` as the rendered pod starts it: the manager's ``replicators``
    are exactly the replicators' own ``--nodes`` (same names, same rank order, so
    host h is rank h), reached over mutual TLS with the files the replicators use."""
    from mtc.trainer import k8s as train_k8s

    (js,) = jobsets(rendered[case])
    name = js["metadata"]["name"]
    worker = job_of(js, "worker")
    pod = pod_of(worker)
    rep = containers(pod)["replicator"]
    is_mc = "pathways-worker" not in containers(pod)
    trainer_pod = pod if is_mc else pod_of(job_of(js, "pathways-head"))
    trainer = containers(trainer_pod)["trainer"]
    hosts = worker["template"]["spec"]["completions"]
    # The downward API's values, as Kubernetes would fill them in for slice 1, host 0.
    place_env = worker_env(JOBSET_NAME=name, JOB_INDEX="1",
                           MTC_NUM_SLICES=str(worker["replicas"]),
                           MTC_HOSTS_PER_SLICE=str(hosts))
    plain = {k: v for k, v in env_of(trainer).items() if isinstance(v, str)}
    for k, v in {**place_env, **plain}.items():
        monkeypatch.setenv(k, v)
    if not is_mc:
        monkeypatch.delenv("JOB_INDEX")
        monkeypatch.delenv("JOB_COMPLETION_INDEX")
        monkeypatch.setenv("REPLICATED_JOB_NAME", "pathways-head")
    args = train_k8s.parse_args([a for a in trainer.get("args", [])
                                 if not a.startswith("--mode=")])
    place = JobSetPlace.from_env(worker=is_mc)
    opts = train_k8s.checkpoint_options(args, place)

    rargs, rest = parse_args([*rep["args"]], env={k: v for k, v in env_of(rep).items()
                                                   if isinstance(v, str)})
    rargv = replicator_argv(rargs, rest, JobSetPlace.from_env(place_env))
    ropts = dict(zip(rargv[::2], rargv[1::2], strict=False))
    assert opts.replicators == tuple(ropts["--nodes"].split(","))
    assert len(opts.replicators) == worker["replicas"] * hosts
    assert opts.replicators[hosts + hosts - 1] == \
        f"{name}-worker-1-{hosts - 1}.{name}:9470"
    assert opts.replicator_tls == (arg(rep, "--tls-cert"), arg(rep, "--tls-key"),
                                   arg(rep, "--tls-ca"))
    assert opts.hosts_per_slice == hosts
    # The certificate the replicators serve (*.<subdomain>) covers every address.
    assert all(a.split(":")[0].endswith(f".{place.subdomain}") for a in opts.replicators)

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    off = train_k8s.checkpoint_options(train_k8s.parse_args(
        ["--no-replicators", "--token-file", str(token)]), place)
    assert off.replicators is None and off.replicator_tls is None \
        and off.replicator_token is None
    on = train_k8s.checkpoint_options(train_k8s.parse_args(["--token-file", str(token)]), place)
    assert on.replicator_token == "s3cret"


def test_gke_mtc_component_swaps_only_the_ramdisk(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    (plain,), (csi,) = jobsets(rendered["pathways"]), jobsets(rendered["pathways-gke-mtc"])
    for js in (plain, csi):
        for rj in js["spec"]["replicatedJobs"]:
            if rj["name"] == "worker":
                rj["template"]["spec"]["template"]["spec"]["volumes"] = [
                    v for v in pod_of(rj)["volumes"] if v["name"] != "ramdisk"]
    assert plain == csi
    extra = [d["kind"] for d in rendered["pathways-gke-mtc"] if d["kind"] not in
             {x["kind"] for x in rendered["pathways"]}]
    assert extra == ["CheckpointConfiguration"]


# -- one place to configure: deploy/configure.py ------------------------------------------------


EXAMPLE_VALUES = {
    # name: a pattern that must not match in a configured job's manifests
    "the JobSet's name": r"mtc-train(?![a-z])",
    "the namespace": r"\.default\.|namespace: default\b",
    "the project": r"\bPROJECT\b|my-project",
    "the bucket": r"\bBUCKET\b",
    "the accelerator": r"tpu-v6e-slice",
    "the topology": r"\b2x4\b",
    "the RAM disk size": r"\b64Gi\b",
    "the image tag": r":0\.1\.0\b",
    "the head node pool": r"\bcpu-np\b",
}


@pytest.mark.parametrize("case", ["job-pathways", "job-multi-controller"])
def test_one_job_file_sets_every_place(case: str,
                                       rendered: dict[str, list[dict[str, Any]]]) -> None:
    """A job file's values reach every place they belong, and none of the example's
    stays behind (a value the script forgot would)."""
    text = yaml.safe_dump_all(rendered[case])
    for what, pattern in EXAMPLE_VALUES.items():
        assert not re.search(pattern, text), f"{what} of the example survives: " \
            f"{re.search(pattern, text)}"
    job = JOBS[case]
    docs = rendered[case]
    (js,) = jobsets(docs)
    assert js["metadata"]["name"] == job["name"]
    for d in docs:
        if d["kind"] not in ("PriorityClass", "CheckpointConfiguration"):
            assert d["metadata"]["namespace"] == job["namespace"], d["kind"]
    assert js["spec"]["failurePolicy"]["maxRestarts"] == job.get("maxRestarts", 20)
    images = {c["image"] for rj in js["spec"]["replicatedJobs"]
              for c in containers(pod_of(rj)).values()}
    registry = job.get("images", {}).get("registry", f"us-docker.pkg.dev/{job['project']}/mtc")
    tag = job.get("images", {}).get("tag", "0.1.0")
    mtc_images = {i for i in images if "/pathways/" not in i}
    assert mtc_images and all(i.startswith(registry + "/") and i.endswith(":" + tag)
                              for i in mtc_images), mtc_images
    assert all(i.endswith(f":jax-{lock()['jax']}") for i in images - mtc_images)
    assert f"gs://{job['bucket']}/mtc-backup" in text


def test_job_file_shape_and_memory_follow_the_tpu() -> None:
    configure = configure_module()
    job = configure.Job(JOBS["job-pathways"], "job.yaml")
    # v5p 2x2x4: 16 chips, 4 per host: 4 hosts; Pathways calls v5p "tpuv5".
    assert (job.hosts, job.chips_per_host, job.slices) == (4, 4, 3)
    assert (job.accelerator, job.instance_type) == ("tpu-v5p-slice", "tpuv5:2x2x4")
    v5e = configure.Job(JOBS["job-pathways-gke-mtc"], "job.yaml")
    assert (v5e.hosts, v5e.instance_type) == (1, "tpuv5e1t:2x4")
    assert configure.Job({"project": "acme-ml-123", "bucket": "b-1"}, "j").pathways_tag == \
        f"jax-{lock()['jax']}"


def test_whole_jobset_restarts_where_jobset_lacks_restart_job() -> None:
    """A JobSet controller without the RestartJob feature gate refuses the rule:
    the job file can leave it out, and then a failed slice restarts every Job."""
    configure = configure_module()
    data = {**JOBS["job-multi-controller"], "restartFailedSliceOnly": False}
    (js,) = jobsets(configure.render(configure.Job(data, "job.yaml")))
    assert all(r["action"] not in ("RestartJob", "RestartJobAndIgnoreMaxRestarts")
               for r in js["spec"]["failurePolicy"]["rules"])
    assert jobset_action(js, "worker", "BackoffLimitExceeded") == "RestartJobSet"
    assert jobset_action(js, "worker", "PodFailurePolicy") == "FailJobSet"


def test_configured_memory_adds_the_ramdisk(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (js,) = jobsets(rendered["job-pathways"])
    cs = containers(pod_of(job_of(js, "worker")))
    gi = 2**30
    # 100Gi disk: half of it in each writer's request, all of it in each limit.
    assert quantity(cs["replicator"]["resources"]["requests"]["memory"]) == (3 + 50) * gi
    assert quantity(cs["replicator"]["resources"]["limits"]["memory"]) == (3 + 100) * gi
    side = cs["colocated-python-sidecar"]["resources"]
    assert (quantity(side["requests"]["memory"]), quantity(side["limits"]["memory"])) == \
        ((6 + 50) * gi, (6 + 100) * gi)


@pytest.mark.parametrize(("change", "match"), [
    ({"bucket": None}, r"job\.yaml: bucket is required"),
    ({"project": "PROJECT"}, r"project: 'PROJECT' is not a Google Cloud project id"),
    ({"tpu": {"type": "v5e", "topology": "2x2", "chipsPerHost": 8}},
     r"tpu\.topology: 4 chips are not whole hosts of 8"),
    ({"tpu": {"type": "v6e", "topology": "2x2x2"}}, r"tpu\.topology: '2x2x2' is not a 2-D"),
    ({"tpu": {"type": "v7"}}, r"tpu\.type: 'v7' is not one of"),
    ({"ramDisk": "lots"}, r"ramDisk: 'lots' is not a memory quantity"),
    ({"name": "Mtc_Train"}, r"name: 'Mtc_Train' is not a DNS label"),
    ({"slices": 2}, r"unknown key 'slices'"),
    ({"restartFailedSliceOnly": "yes"}, r"restartFailedSliceOnly: 'yes' is not true or false"),
    ({"images": {"tags": "1"}}, r"images\.tags: unknown key"),
    # Pod names longer than Kubernetes keeps whole would lose the indices (the rank):
    # the longest name with the most slices, and hosts beyond any slice built today.
    ({"name": "a" * 40, "tpu": {"type": "v5p", "topology": "50x50x160", "slices": 1024}},
     r"name: pods named a{40}-worker-1023-99999-xxxxx are longer"),
])
def test_bad_job_files_are_named(change: dict[str, Any], match: str) -> None:
    configure = configure_module()
    data = {"project": "acme-ml-123", "bucket": "acme-ckpt", **change}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(configure.JobFileError, match=match):
        configure.Job(data, "job.yaml")


def test_configure_prints_the_manifests_of_the_example_job(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(DEPLOY / "configure.py"),
                          str(DEPLOY / "job.example.yaml")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {d["kind"] for d in docs} >= {"JobSet", "NetworkPolicy", "PodDisruptionBudget",
                                         "ServiceAccount", "PodMonitoring", "Rules"}
    bad = tmp_path / "job.yaml"
    bad.write_text("project: acme-ml-123\n")
    out = subprocess.run([sys.executable, str(DEPLOY / "configure.py"), str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"{bad}: bucket is required" in out.stderr
    # What it prints is never checked in.
    assert "*.rendered.yaml" in (REPO / ".gitignore").read_text().split()


def test_deploy_guide_lists_the_prerequisites_in_order() -> None:
    """An operator runs the guide top to bottom: each step's command comes after what
    it needs."""
    guide = (REPO / "docs" / "deploy.md").read_text()
    start = guide.index("## From an empty project")
    text = guide[start:guide.index("\n## ", start + 1)]
    steps = ["--cluster-version", "--addons=GcsFuseCsiDriver", "HighScaleCheckpointing",
             "--workload-pool", "node-pools create", "jobset/releases/download", "RestartJob: true",
             "--enable-hierarchical-namespace", "subject/ns/$NAMESPACE/sa/$KSA",
             "gke-checkpointing-multitier-node", "cert-manager", "docker build",
             "deploy/configure.py", "kubectl apply --server-side -f my-job.rendered.yaml"]
    at = [text.find(s) for s in steps]
    missing = [s for s, i in zip(steps, at, strict=True) if i < 0]
    assert not missing, f"docs/deploy.md lacks {missing}"
    assert at == sorted(at), [s for s, _ in sorted(zip(steps, at, strict=True),
                                                   key=lambda x: x[1])]
    assert "1.32" in text   # the oldest GKE version multi-tier checkpointing supports


# -- the images -------------------------------------------------------------------------------


def instructions(dockerfile: Path) -> list[tuple[str, str, str | None]]:
    """(INSTRUCTION, arguments, stage) with continuations joined and comments dropped."""
    out: list[tuple[str, str, str | None]] = []
    stage: str | None = None
    buf = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        word = word.upper()
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
            stage = m.group(1) if m else None
        out.append((word, rest.strip(), stage))
        buf = ""
    return out


def final_stages(dockerfile: Path) -> dict[str | None, list[tuple[str, str]]]:
    """Instructions of each stage that is an image (not the wheel build stage)."""
    stages: dict[str | None, list[tuple[str, str]]] = {}
    for word, rest, stage in instructions(dockerfile):
        stages.setdefault(stage, []).append((word, rest))
    return {s: ins for s, ins in stages.items() if s != "wheel" and any(
        w == "FROM" for w, _ in ins)}


def args_of(dockerfile: Path) -> dict[str, str]:
    return {k: v for w, rest, _ in instructions(dockerfile) if w == "ARG" and "=" in rest
            for k, v in [rest.split("=", 1)]}


def dockerignored(path: str) -> bool:
    """Whether Docker's .dockerignore rules (last match wins, parents count) exclude path."""
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copy_sources_exist_in_the_build_context(name: str) -> None:
    copies = [rest for w, rest, _ in instructions(DOCKERFILES[name])
              if w in ("COPY", "ADD") and "--from=" not in rest]
    assert copies
    for rest in copies:
        *sources, _dest = [a for a in shlex.split(rest) if not a.startswith("--")]
        for src in sources:
            assert (REPO / src).exists(), f"{name}: COPY source {src} does not exist"
            assert not dockerignored(src.rstrip("/")), f"{name}: {src} is in .dockerignore"
            for f in (REPO / src).rglob("*.py") if (REPO / src).is_dir() else []:
                rel = f.relative_to(REPO).as_posix()
                assert not dockerignored(rel), f"{name}: {rel} is left out by .dockerignore"


def test_dockerignore_keeps_the_context_small() -> None:
    for path in (".venv/bin/python", "out/demo", ".git/HEAD", "tests/test_deploy.py",
                 "mtc/__pycache__/x.pyc"):
        assert dockerignored(path), path


def requirement(name: str) -> Requirement:
    for spec in PYPROJECT["project"]["dependencies"]:
        req = Requirement(spec)
        if req.name == name:
            return req
    raise AssertionError(f"{name} is not a dependency in pyproject.toml")


def test_library_states_ranges_and_leaves_the_demo_out() -> None:
    """A library states the versions it works with; exact pins are the images' lock."""
    for name in ("jax", "jaxlib", "orbax-checkpoint", "pathwaysutils"):
        ops = {s.operator for s in requirement(name).specifier}
        assert ops == {">=", "<"}, f"{name}: a range, not {requirement(name).specifier}"
    assert requirement("jax").specifier == requirement("jaxlib").specifier
    names = {Requirement(r).name for r in PYPROJECT["project"]["dependencies"]}
    assert not names & {"optax", "matplotlib"}, "the trainers' dependencies are extras"
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(Requirement(r).name == "optax" for r in extras["trainer"])


def lock() -> dict[str, str]:
    sys.path.insert(0, str(DEPLOY))
    try:
        from check_image import pins
    finally:
        sys.path.remove(str(DEPLOY))
    return pins(DEPLOY / "requirements.txt")


def test_images_share_python_and_pinned_requirements() -> None:
    a, b = args_of(DOCKERFILES["sidecar"]), args_of(DOCKERFILES["trainer"])
    assert a["PYTHON_IMAGE"] == b["PYTHON_IMAGE"]
    assert a["PYTHON_VERSION"] == b["PYTHON_VERSION"]
    m = re.fullmatch(r"python:(\d+\.\d+)[.\d]*-slim.*", a["PYTHON_IMAGE"])
    assert m and m.group(1) == a["PYTHON_VERSION"], a["PYTHON_IMAGE"]
    # Google's colocated-Python sidecar bases are Python 3.12: so is every image.
    assert a["PYTHON_VERSION"] == "3.12"
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(a["PYTHON_VERSION"])
    for df in DOCKERFILES.values():
        for stage, ins in final_stages(df).items():
            text = "\n".join(rest for _, rest in ins)
            assert "requirements.txt" in text and "check_image.py" in text, (df.name, stage)
            assert '--python "$PYTHON_VERSION"' in text, (df.name, stage)
            assert any(w == "ARG" and r.startswith("PYTHON_VERSION") for w, r in ins), stage
    locked = lock()
    assert locked["jax"] == locked["jaxlib"]
    # Every runtime dependency (the trainer image's extra too) is locked at a
    # version pyproject allows.
    for spec in [*PYPROJECT["project"]["dependencies"],
                 *PYPROJECT["project"]["optional-dependencies"]["trainer"]]:
        req = Requirement(spec)
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        assert key in locked, f"{req.name} is not in deploy/requirements.txt"
        assert req.specifier.contains(locked[key], prereleases=True), (req, locked[key])


def test_check_image_guards_the_build(tmp_path: Path) -> None:
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    script = str(DEPLOY / "check_image.py")
    ok = subprocess.run([sys.executable, script, "--python", py, "--requirements",
                         str(DEPLOY / "requirements.txt")], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "req.txt"
    bad.write_text("jax==0.0.1\n")
    out = subprocess.run([sys.executable, script, "--python", "2.7", "--requirements",
                          str(bad)], capture_output=True, text=True)
    assert out.returncode == 1
    assert "Python" in out.stderr and "jax" in out.stderr and "jaxlib is not pinned" in out.stderr
    # PyPI's jaxlib (as here) lacks the colocated-Python client of Google's bases.
    colo = subprocess.run([sys.executable, script, "--python", py, "--requirements",
                           str(DEPLOY / "requirements.txt"), "--colocated-server"],
                          capture_output=True, text=True)
    assert colo.returncode == 1 and "colocated_python_cpu_client" in colo.stderr, colo.stderr


def test_colocated_image_keeps_the_bases_jax() -> None:
    """The colocated-Python target installs mtc under the base's constraints (the base's
    jax, jaxlib, protobuf and grpc stay) and checks them against the trainer's lock."""
    stages = final_stages(DOCKERFILES["sidecar"])
    text = "\n".join(rest for _, rest in stages["colocated-python"])
    assert "server_constraints.txt" in args_of(DOCKERFILES["sidecar"])["BASE_CONSTRAINTS"]
    assert '-c "$BASE_CONSTRAINTS"' in text
    assert "--no-deps -r" not in text, "installing the lock would replace the base's jax"
    assert "--colocated-server" in text
    assert any(w == "FROM" and r.startswith("${COLOCATED_BASE}")
               for w, r in stages["colocated-python"])


def test_images_run_as_non_root_with_health_checks() -> None:
    for df in DOCKERFILES.values():
        for stage, ins in final_stages(df).items():
            users = [r for w, r in ins if w == "USER"]
            assert users and users[-1].split(":")[0] not in ("root", "0"), (df.name, stage)
            assert any(w == "HEALTHCHECK" for w, _ in ins), (df.name, stage)


def _exec_form(rest: str) -> list[str]:
    rest = re.sub(r"^(--\S+\s+)*", "", rest)
    if rest.startswith("CMD "):
        rest = rest[4:]
    return list(json.loads(rest))


def _python_argv(argv: list[str]) -> list[str]:
    """An image command as a command here: console scripts through their module."""
    scripts = PYPROJECT["project"]["scripts"]
    if argv[0] in scripts:
        module = scripts[argv[0]].split(":")[0]
        return [sys.executable, "-m", module, *argv[1:]]
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]]


def _entry_commands() -> list[tuple[str, list[str]]]:
    found = []
    for df in DOCKERFILES.values():
        for stage, ins in final_stages(df).items():
            for w, rest in ins:
                if w in ("ENTRYPOINT", "HEALTHCHECK"):
                    found.append((f"{df.name}:{stage}:{w}", _python_argv(_exec_form(rest))))
    return found


@pytest.mark.parametrize(("where", "argv"), _entry_commands(), ids=lambda x: x
                         if isinstance(x, str) else "")
def test_entrypoints_and_health_checks_answer_help(where: str, argv: list[str]) -> None:
    if argv[1] == "-c":
        # An inline health check: it must at least compile.
        compile(argv[2], where, "exec")
        return
    out = subprocess.run([*argv[:3], "--help"], capture_output=True, text=True, timeout=60,
                         env=env_with_repo(), cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_image_modules_import() -> None:
    """What each image runs imports here: the trainer's loop, the replicator, the host side."""
    modules = ["mtc.trainer.k8s", "mtc.trainer.model", "mtc.trainer.data", "mtc", "mtc.replicas",
               "mtc.sidecar.replicator.k8s", "mtc.sidecar.replicator.main",
               "mtc.sidecar.replicator.healthcheck",
               "mtc.sidecar.agent", "mtc.sidecar.colocated"]
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    out = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True,
                         timeout=120, env={**env_with_repo(), "JAX_PLATFORMS": "cpu"}, cwd=REPO)
    assert out.returncode == 0, out.stderr


def test_image_entrypoints_are_console_scripts() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    assert scripts["mtc-replicator-k8s"] == "mtc.sidecar.replicator.k8s:main"
    assert scripts["mtc-train-k8s"] == "mtc.trainer.k8s:main"
    entry = {df.name: [_exec_form(r) for s, ins in final_stages(df).items()
                       for w, r in ins if w == "ENTRYPOINT"] for df in DOCKERFILES.values()}
    assert entry["Dockerfile.sidecar"] == [["mtc-replicator-k8s"]]
    assert entry["Dockerfile.trainer"] == [["mtc-train-k8s"]]


def test_deploy_guide_is_linked() -> None:
    guide = REPO / "docs" / "deploy.md"
    assert guide.is_file()
    assert "docs/deploy.md" in (REPO / "README.md").read_text()
    text = guide.read_text()
    for overlay in OVERLAYS:
        assert f"deploy/overlays/{overlay.name}" in text, overlay.name
    assert fnmatch.fnmatch(text, "*jax-init-info.txt*")
    # The upgrade rule of the on-disk formats, and the test that holds a release to it.
    assert "\n## Upgrades\n" in text and "tests/test_manifest_upgrade.py" in text
    assert (REPO / "tests" / "test_manifest_upgrade.py").is_file()
    assert "docs/operations.md" in (REPO / "README.md").read_text()
