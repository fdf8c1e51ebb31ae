"""Deployment, the manifests (offline: no cluster). Every overlay, and jobs rendered
by ``deploy/configure.py`` with values unlike the example's, render with ``kubectl
kustomize``; core kinds and every replicated job's Job template pass
``kubernetes-validate --strict`` at Kubernetes 1.32 and the newest version it
knows; JobSets and the CheckpointConfiguration pass their strict schemas
(``../shared/schemas/`` beside the clone, or ``$MTC_JOBSET_SCHEMA``,
``$MTC_CPC_SCHEMA``); values that must agree across the manifests do (the
trainer's replicators are the replicators' own). What docs/deploy.md promises of
the pods they make (failure policies, memory, placement, ownership):
``tests/test_deploy_pods.py``."""

from __future__ import annotations

import ast
import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_render import (
    CASES,
    CORE_GROUPS,
    OVERLAYS,
    REPO,
    arg,
    containers,
    env_of,
    job_of,
    jobsets,
    lock,
    mounts,
    one,
    pod_of,
    quantity,
    render,
    tool,
    validator_versions,
    worker_env,
)

from mtc.sidecar.replicator.k8s import (
    JobSetPlace,
    parse_args,
    replicator_argv,
)

# Every test here renders the overlays (kubectl kustomize) or runs the images' tools.
pytestmark = pytest.mark.process


def test_overlays_exist() -> None:
    assert {o.name for o in OVERLAYS} >= {"pathways", "pathways-gke-mtc", "multi-controller"}


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
    # Its pods' certificates read as ranks as the replicators read them (proofs checked).
    assert opts.replicator_pod_names == (ropts["--tls-pod-prefix"],
                                         int(ropts["--tls-hosts-per-slice"]))
    # The certificate the replicators serve (*.<subdomain>) covers every address.
    assert all(a.split(":")[0].endswith(f".{place.subdomain}") for a in opts.replicators)

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    off = train_k8s.checkpoint_options(train_k8s.parse_args(
        ["--no-replicators", "--token-file", str(token)]), place)
    assert off.replicators is None and off.replicator_tls is None \
        and off.replicator_token is None and off.replicator_pod_names is None
    on = train_k8s.checkpoint_options(train_k8s.parse_args(["--token-file", str(token)]), place)
    assert on.replicator_token == "s3cret"


def test_gke_mtc_component_swaps_only_the_ramdisk(
        rendered: dict[str, list[dict[str, Any]]]) -> None:
    # Copies: ``rendered`` is the session's, and test_deploy_pods.py reads the volumes.
    (plain,), (csi,) = copy.deepcopy((jobsets(rendered["pathways"]),
                                      jobsets(rendered["pathways-gke-mtc"])))
    for js in (plain, csi):
        for rj in js["spec"]["replicatedJobs"]:
            if rj["name"] == "worker":
                rj["template"]["spec"]["template"]["spec"]["volumes"] = [
                    v for v in pod_of(rj)["volumes"] if v["name"] != "ramdisk"]
    assert plain == csi
    extra = [d["kind"] for d in rendered["pathways-gke-mtc"] if d["kind"] not in
             {x["kind"] for x in rendered["pathways"]}]
    assert extra == ["CheckpointConfiguration"]


OWN_TRAINER = REPO / "deploy" / "examples" / "own-trainer"


def test_own_trainer_example_swaps_only_the_trainer(
        rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """deploy/examples/own-trainer renders with its own image, command and arguments
    in the trainer container, and is otherwise the multi-controller overlay: the
    replicator, the RAM disk, the certificate and the environment stay."""
    docs = render(OWN_TRAINER)
    check_schema("jobset-v1alpha2.strict.json", "MTC_JOBSET_SCHEMA", jobsets(docs), tmp_path)
    (js,), (mc,) = jobsets(docs), copy.deepcopy(jobsets(rendered["multi-controller"]))
    trainer = containers(pod_of(job_of(js, "worker")))["trainer"]
    assert trainer["image"] == "us-docker.pkg.dev/PROJECT/my-team/my-trainer:2026-12-07"
    assert trainer["command"] == ["python", "-m", "my_team.train"]
    assert trainer["args"][0] == "--local-dir=/local"
    assert mounts(trainer)["ramdisk"] == "/local"
    assert mounts(trainer)["replicator-tls"] == "/etc/mtc/tls"
    demo = containers(pod_of(job_of(mc, "worker")))["trainer"]
    demo.update(image=trainer["image"], command=trainer["command"], args=trainer["args"])
    assert js == mc
    assert [d for d in docs if d["kind"] != "JobSet"] == \
        [d for d in rendered["multi-controller"] if d["kind"] != "JobSet"]


def test_own_trainer_example_names_every_placeholder_left_to_fill_in() -> None:
    """Issue 68, item 9: with kustomize alone, what is left to fill in by hand is
    said: every placeholder of the render (``PROJECT``, ``BUCKET``) and every name
    of the job's own objects (``mtc-train*``) is in the example's comment."""
    text = yaml.safe_dump_all(render(OWN_TRAINER))
    left = set(re.findall(r"\b(PROJECT|BUCKET)\b", text)) | set(
        re.findall(r"\bmtc-train[a-z0-9-]*", text))
    assert {"PROJECT", "BUCKET", "mtc-train", "mtc-train-ca"} <= left, left
    said = (OWN_TRAINER / "kustomization.yaml").read_text()
    comment = "\n".join(x for x in said.splitlines() if x.startswith("#"))
    assert sorted(n for n in left if not re.search(rf"\b{re.escape(n)}\b", comment)) == []


def test_own_trainer_block_of_the_deploy_guide_runs_in_a_pod_environment(
        rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """docs/deploy.md's block for one's own trainer, as written, in the environment the
    rendered worker pod gives (one slice of one host, so that one real
    ``jax.distributed`` process makes the job): its replicators are the rendered
    replicator's own ``--nodes`` and its TLS files the pod's certificate volume."""
    from doc_blocks import python_block

    from mtc.ports import free_ports
    from mtc.sidecar.replicator.k8s import write_jax_init_info

    (js,) = jobsets(rendered["multi-controller"])
    pod = pod_of(job_of(js, "worker"))
    trainer, rep = containers(pod)["trainer"], containers(pod)["replicator"]
    place_env = worker_env(JOB_INDEX="0", MTC_NUM_SLICES="1", MTC_HOSTS_PER_SLICE="1")
    env = {**{k: v for k, v in env_of(trainer).items() if isinstance(v, str)}, **place_env,
           "MTC_LOCAL_DIR": str(tmp_path)}
    (port,) = free_ports(1)
    write_jax_init_info(tmp_path, 0, f"127.0.0.1:{port}")  # as the replicator does
    program = tmp_path / "own.py"
    program.write_text(python_block("docs/deploy.md", "## Your own trainer") +
                       "print(repr((options.replicators, options.replicator_tls, "
                       "options.replicator_pod_names)))\n"
                       "jax.distributed.shutdown()\n")
    from replicators import env_with_repo

    out = subprocess.run([sys.executable, str(program)], capture_output=True, text=True,
                         timeout=120, env={**env_with_repo(), "JAX_PLATFORMS": "cpu", **env})
    assert out.returncode == 0, out.stderr[-4000:]
    replicators, tls, pod_names = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    rargs, rest = parse_args([*rep["args"]], env={k: v for k, v in env_of(rep).items()
                                                   if isinstance(v, str)})
    rargv = replicator_argv(rargs, rest, JobSetPlace.from_env(place_env))
    assert replicators == tuple(dict(zip(rargv[::2], rargv[1::2], strict=False))["--nodes"]
                                .split(","))
    assert tls == (arg(rep, "--tls-cert"), arg(rep, "--tls-key"), arg(rep, "--tls-ca"))
    # Its certificates' pod names read as ranks as its replicator reads them: the copies
    # it reads are proven their origins' (docs/security.md).
    opts = dict(zip(rargv[::2], rargv[1::2], strict=False))
    assert pod_names == (opts["--tls-pod-prefix"], int(opts["--tls-hosts-per-slice"]))
