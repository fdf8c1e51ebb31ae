"""Deployment, the pods the manifests make (offline: no cluster; every overlay and
configured job, rendered once a session by ``tests/deploy_render.py``): what
docs/deploy.md promises of them holds. Each slice is one node pool; failure
policies, evaluated as JobSet and the Job controller would, restart a failed
slice alone; the RAM disk's memory is requested and limited; the Pathways head
and workers restart as stated; pods run as the service account granted the
bucket; every shared folder has one owner. That the manifests validate and agree
with themselves: ``tests/test_deploy_manifests.py``."""

from __future__ import annotations

import re
from typing import Any

import pytest
from deploy_render import (
    CASES,
    REPO,
    containers,
    env_of,
    is_pathways,
    job_of,
    jobset_action,
    jobsets,
    mounts,
    one,
    pod_of,
    quantity,
)

# Every test here renders the overlays (kubectl kustomize) or runs the images' tools.
pytestmark = pytest.mark.process


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
