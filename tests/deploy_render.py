"""What the deployment tests share: where deploy/ is, rendering its overlays and the
example jobs of ``deploy/configure.py`` (once a session: the ``rendered`` fixture of
tests/conftest.py), and reading the rendered objects."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

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


def lock() -> dict[str, str]:
    sys.path.insert(0, str(DEPLOY))
    try:
        from check_image import pins
    finally:
        sys.path.remove(str(DEPLOY))
    return pins(DEPLOY / "requirements.txt")


@functools.cache
def render_cases() -> dict[str, list[dict[str, Any]]]:
    """Every overlay as shipped, and every job of JOBS as deploy/configure.py renders it."""
    out = {o.name: render(o) for o in OVERLAYS}
    configure = configure_module()
    for case, data in JOBS.items():
        out[case] = configure.render(configure.Job(data, case))
    return out
