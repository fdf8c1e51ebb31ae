"""Deployment, one place to configure: ``deploy/configure.py`` renders a job file
into every place of the manifests (no example value left behind), derives shape
and memory from the TPU, and names a bad job file's error; docs/deploy.md lists
the prerequisites in order."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_render import (
    DEPLOY,
    JOBS,
    REPO,
    configure_module,
    containers,
    job_of,
    jobset_action,
    jobsets,
    lock,
    pod_of,
    quantity,
)

# Every test here renders the overlays (kubectl kustomize) or runs the images' tools.
pytestmark = pytest.mark.process


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


@pytest.mark.parametrize("mode", ["multi-controller", "pathways"])
def test_job_file_sets_the_replicators_and_an_own_trainer(mode: str) -> None:
    """The job file's replicator and trainer keys reach the containers: the
    replicators' flags in place of the base's, the trainer's image, command and
    arguments in place of the demo's (on Pathways, the head's trainer)."""
    configure = configure_module()
    image = "europe-docker.pkg.dev/acme-ml-123/team/own-trainer:7.1"
    data = {**JOBS["job-multi-controller"], "mode": mode,
            "replicator": {"keep": 3, "replicas": 0, "backupIntervalSteps": 500,
                           "backupKeep": 5},
            "trainer": {"image": image, "command": ["python", "-m", "team.train"],
                        "args": ["--steps=7"]}}
    (js,) = jobsets(configure.render(configure.Job(data, "job.yaml")))
    rep = containers(pod_of(job_of(js, "worker")))["replicator"]
    flags = [a for a in rep["args"] if a.startswith(("--keep", "--replicas", "--backup-"))]
    assert sorted(flags) == ["--backup-interval-steps=500", "--backup-keep=5", "--keep=3",
                             "--replicas=0"]
    trainer_job = "worker" if mode == "multi-controller" else "pathways-head"
    trainer = containers(pod_of(job_of(js, trainer_job)))["trainer"]
    assert (trainer["image"], trainer["command"], trainer["args"]) == \
        (image, ["python", "-m", "team.train"], ["--steps=7"])
    # Without the keys: the base's flags and the demo trainer, as before.
    plain = {k: v for k, v in data.items() if k not in ("replicator", "trainer")}
    (js,) = jobsets(configure.render(configure.Job(plain, "job.yaml")))
    rep = containers(pod_of(job_of(js, "worker")))["replicator"]
    assert {"--keep=1", "--replicas=1", "--backup-interval-minutes=30"} <= set(rep["args"])
    trainer = containers(pod_of(job_of(js, trainer_job)))["trainer"]
    assert "command" not in trainer and trainer["image"].endswith(":1.0.0")
    assert trainer["args"][0] == f"--mode={mode}"


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
    ({"replicator": {"kept": 1}}, r"replicator\.kept: unknown key"),
    ({"replicator": {"keep": 0}}, r"replicator\.keep: 0 is not an integer >= 1"),
    ({"replicator": {"backupIntervalMinutes": 10, "backupIntervalSteps": 5}},
     r"backupIntervalMinutes and backupIntervalSteps exclude each other"),
    ({"trainer": {"image": "my trainer"}}, r"trainer\.image: 'my trainer' is not an image"),
    ({"trainer": {"args": "--steps=1"}}, r"trainer\.args: not a list of strings"),
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


def test_the_example_job_file_shows_every_key() -> None:
    """Every key configure.py knows, at the top and in each mapping, is in
    deploy/job.example.yaml (set, or shown in a comment): the keys are read from
    configure.py's own refusal of an unknown one."""
    configure = configure_module()
    example = (DEPLOY / "job.example.yaml").read_text()

    def known(data: dict[str, Any]) -> list[str]:
        with pytest.raises(configure.JobFileError) as e:
            configure.Job({"project": "acme-ml-123", "bucket": "acme-ckpt", **data}, "j")
        m = re.search(r"\(known: ([^)]*)\)", str(e.value))
        assert m, str(e.value)
        return m.group(1).split(", ")

    top = known({"zzz": 1})
    assert {"replicator", "trainer", "ramDisk"} <= set(top)
    for key in top:
        assert re.search(rf"^{key}:", example, re.M), f"job.example.yaml lacks {key}"
    for section in ("images", "tpu", "memory", "replicator", "trainer"):
        for key in known({section: {"zzz": 1}}):
            assert re.search(rf"^  (# )?{key}:", example, re.M), \
                f"job.example.yaml lacks {section}.{key}"


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
