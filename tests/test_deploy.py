"""Deployment: the JobSet wrapper of the replicator, the images, the manifests (offline).

No cluster and no Docker engine run here. What is checked instead:
- ``mtc.sidecar.replicator.k8s``: ranks and peer addresses from the JobSet
  environment, ``jax-init-info.txt`` written atomically, the plaintext health
  mirror (also over mutual TLS), a real ``mtc-replicator-k8s`` process;
- ``deploy/``: every overlay renders with ``kubectl kustomize``; core kinds, and
  every replicated job's Job template, pass ``kubernetes-validate --strict``;
  every JobSet passes ``check-jsonschema`` against the strict JobSet v1alpha2
  schema (``../shared/schemas/jobset-v1alpha2.strict.json`` beside the clone,
  or ``$MTC_JOBSET_SCHEMA``); values that must agree across the manifests do;
- the Dockerfiles: every ``COPY`` source exists and is in the build context;
  both images share the Python base and install the same pinned requirements,
  whose jax and jaxlib are pyproject's; each image's entrypoint and health
  check import and answer ``--help`` here.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
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
from replicators import env_with_repo, free_ports

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
    assert argv[-1] == "--keep=3"
    from mtc.sidecar.replicator import main as replicator
    parsed = replicator.parse_args(argv)       # mtc-replicator accepts what we pass
    assert parsed.rank == 3 and parsed.keep == 3


@pytest.mark.parametrize("flag", ["--rank=1", "--nodes", "--listen=0.0.0.0:1"])
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


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {o.name: render(o) for o in OVERLAYS}


def test_overlays_exist() -> None:
    assert {o.name for o in OVERLAYS} >= {"pathways", "multi-controller"}


def jobsets(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "JobSet"]


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


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_core_kinds_and_job_templates_pass_kubernetes_validate(
        overlay: Path, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    docs = rendered[overlay.name]
    core = [d for d in docs if d["kind"] != "JobSet"]
    assert {d["kind"] for d in core} >= {"NetworkPolicy", "PriorityClass"}
    # kubernetes-validate knows no JobSet; the pod templates inside are checked as Jobs.
    for js in jobsets(docs):
        for rj in js["spec"]["replicatedJobs"]:
            core.append({"apiVersion": "batch/v1", "kind": "Job",
                         "metadata": {"name": f"{js['metadata']['name']}-{rj['name']}"},
                         "spec": rj["template"]["spec"]})
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    out = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def jobset_schema() -> Path | None:
    override = os.environ.get("MTC_JOBSET_SCHEMA")
    if override:
        if not Path(override).is_file():
            pytest.fail(f"MTC_JOBSET_SCHEMA={override} is not a file")
        return Path(override)
    path = REPO.parent / "shared" / "schemas" / "jobset-v1alpha2.strict.json"
    return path if path.is_file() else None


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_jobsets_pass_the_strict_jobset_schema(
        overlay: Path, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    schema = jobset_schema()
    if schema is None:
        pytest.skip("JobSet schema absent: no ../shared/schemas/jobset-v1alpha2.strict.json "
                    "beside the repository and no MTC_JOBSET_SCHEMA; JobSets were not "
                    "validated against it")
    files = []
    for i, js in enumerate(jobsets(rendered[overlay.name])):
        files.append(tmp_path / f"jobset-{i}.json")
        files[-1].write_text(json.dumps(js))
    assert files, f"{overlay.name} renders no JobSet"
    out = subprocess.run([tool("check-jsonschema"), "--schemafile", str(schema),
                          *map(str, files)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_manifests_agree_with_themselves(
        overlay: Path, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[overlay.name]
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
    assert ports == {"replicator": port, "health": health_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert rep[probe]["grpc"]["port"] == health_port, probe

    # Peer TLS from the Secret, mounted where the replicator's flags point.
    volumes = {v["name"]: v for v in pod["volumes"]}
    tls_mount = {m["name"]: m["mountPath"] for m in rep["volumeMounts"]}["replicator-tls"]
    for flag, file in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"),
                       ("--tls-ca", "ca.crt")):
        assert arg(rep, flag) == f"{tls_mount}/{file}"
    secret = volumes["replicator-tls"]["secret"]["secretName"]

    # The RAM disk: mounted at the replicator's --local-dir in the replicator and the writer.
    local = arg(rep, "--local-dir")
    ramdisk = volumes["ramdisk"]
    assert ramdisk.get("emptyDir", {}).get("medium") == "Memory" or \
        ramdisk.get("csi", {}).get("driver") == "multitier-checkpoint.csi.storage.gke.io"
    writer = "colocated-python-sidecar" if "pathways-worker" in cs else "trainer"
    for c in ("replicator", writer):
        assert {m["name"]: m["mountPath"] for m in cs[c]["volumeMounts"]}["ramdisk"] == local

    # Priority for hot swap, from a PriorityClass the overlay ships.
    classes = {d["metadata"]["name"] for d in docs if d["kind"] == "PriorityClass"}
    for rj in js["spec"]["replicatedJobs"]:
        assert pod_of(rj)["priorityClassName"] in classes

    # The NetworkPolicy: the replicator port only from this JobSet's pods.
    (np_,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    label = "jobset.sigs.k8s.io/jobset-name"
    assert np_["spec"]["podSelector"]["matchLabels"] == {label: name}
    for rule in np_["spec"]["ingress"]:
        open_ports = {p["port"] for p in rule.get("ports", [])}
        if "from" in rule:
            assert rule["from"] == [{"podSelector": {"matchLabels": {label: name}}}]
        else:
            assert port not in open_ports and open_ports <= {health_port}

    trainer_pod = pod_of(job_of(js, "pathways-head")) if writer != "trainer" else pod
    trainer = containers(trainer_pod)["trainer"]
    tenv = env_of(trainer)
    assert tenv["MTC_HOSTS_PER_SLICE"] == str(hosts)
    assert tenv["MTC_REPLICATOR_PORT"] == str(port)
    assert arg(trainer, "--ramdisk") == local
    tls_dir = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}["replicator-tls"]
    assert tenv["MTC_TLS_DIR"] == tls_dir
    assert {v["name"]: v for v in trainer_pod["volumes"]}["replicator-tls"]["secret"][
        "secretName"] == secret

    jax_pin = lock()["jax"]  # the images carry the locked jax
    if writer == "trainer":                     # multi-controller
        assert "--write-jax-init-info" in rep["args"]
        assert tenv["MTC_REPLICATOR_PORT"] == str(port)
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
            assert {m["name"]: m["mountPath"] for m in cs[c]["volumeMounts"]}[
                "sidecar-shm"] == shm
        assert volumes["sidecar-shm"]["emptyDir"]["medium"] == "Memory"
        # Pathways' images serve one jax release: the trainer's.
        for c in [*cs.values(), *head.values()]:
            if "cloud-tpu-v2-images/pathways/" in c["image"]:
                assert c["image"].endswith(f":jax-{jax_pin}"), c["image"]
    # Every pod port in one pod is distinct (they share a network namespace).
    for rj in js["spec"]["replicatedJobs"]:
        all_ports = [p["containerPort"] for c in containers(pod_of(rj)).values()
                     for p in c.get("ports", [])]
        assert len(all_ports) == len(set(all_ports)), (rj["name"], all_ports)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_trainer_gives_the_manager_the_replicators_of_its_pods(
        overlay: Path, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``mtc-train-k8s`` as the rendered pod starts it: the manager's ``replicators``
    are exactly the replicators' own ``--nodes`` (same names, same rank order, so
    host h is rank h), reached over mutual TLS with the files the replicators use."""
    from mtc.trainer import k8s as train_k8s

    (js,) = jobsets(rendered[overlay.name])
    worker = job_of(js, "worker")
    pod = pod_of(worker)
    rep = containers(pod)["replicator"]
    is_mc = "pathways-worker" not in containers(pod)
    trainer_pod = pod if is_mc else pod_of(job_of(js, "pathways-head"))
    trainer = containers(trainer_pod)["trainer"]
    # The downward API's values, as Kubernetes would fill them in for slice 1, host 0.
    place_env = worker_env(JOB_INDEX="1", MTC_NUM_SLICES=str(worker["replicas"]),
                           MTC_HOSTS_PER_SLICE=str(worker["template"]["spec"]["completions"]))
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
    assert opts.replicators[3] == "mtc-train-worker-1-1.mtc-train:9470"
    assert opts.replicator_tls == (arg(rep, "--tls-cert"), arg(rep, "--tls-key"),
                                   arg(rep, "--tls-ca"))
    assert opts.hosts_per_slice == int(place_env["MTC_HOSTS_PER_SLICE"])
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
    if "pathways-gke-mtc" not in rendered:
        pytest.skip("no pathways-gke-mtc overlay")
    (plain,), (csi,) = jobsets(rendered["pathways"]), jobsets(rendered["pathways-gke-mtc"])
    for js in (plain, csi):
        for rj in js["spec"]["replicatedJobs"]:
            if rj["name"] == "worker":
                rj["template"]["spec"]["template"]["spec"]["volumes"] = [
                    v for v in pod_of(rj)["volumes"] if v["name"] != "ramdisk"]
    assert plain == csi


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
