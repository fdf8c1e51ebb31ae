"""Where a pod is in a JobSet, read from its environment: the one description of a
JobSet's worker pods that the replicator's wrapper (``mtc-replicator-k8s``) and a
trainer running in the same pods (``mtc-train-k8s``, or your own: docs/deploy.md)
both use. Public: ``from mtc.jobset import JobSetPlace, read_jax_init_info``.

In a JobSet the worker replicated job has one Job per slice (``JOB_INDEX``) and
one pod per host of that slice (``JOB_COMPLETION_INDEX``); every pod is
reachable through the JobSet's headless service as
``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>``, and
Kubernetes names it ``<jobset>-<replicated job>-<job index>-<pod index>-xxxxx``
(the name cert-manager's CSI driver puts in its certificate). Rank ``r`` is host
``r % hosts`` of slice ``r // hosts``.

Environment (JobSet sets the first two as annotations, the manifests in
``deploy/`` copy them and the labels into the environment with the downward
API; Kubernetes sets ``JOB_COMPLETION_INDEX`` in every Indexed Job pod):

| variable | meaning |
|---|---|
| ``JOBSET_NAME`` | the JobSet's name |
| ``REPLICATED_JOB_NAME`` | this pod's replicated job (the workers) |
| ``JOB_INDEX`` | this pod's Job within it: the slice |
| ``JOB_COMPLETION_INDEX`` | this pod's index within its Job: the host in the slice |
| ``MTC_NUM_SLICES`` | Jobs in the replicated job (its ``replicas``) |
| ``MTC_HOSTS_PER_SLICE`` | pods per Job (its ``completions``) |
| ``MTC_SUBDOMAIN`` | the headless service; default: the JobSet's name, as JobSet does |
| ``MTC_WORKER_JOB`` | the workers' replicated job, for a pod of another one (the controller) |
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from mtc.errors import ConfigError

JAX_INIT_INFO = "jax-init-info.txt"


def env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def env_str(env: Mapping[str, str], name: str, default: str | None = None) -> str:
    value = env.get(name) or default
    if not value:
        raise ConfigError(f"environment variable {name} is not set")
    return value


@dataclasses.dataclass(frozen=True)
class JobSetPlace:
    """Where the worker hosts of a JobSet are, and (for a worker pod) which one this is."""

    jobset: str
    worker_job: str
    num_slices: int
    hosts_per_slice: int
    subdomain: str
    slice_index: int | None = None     # None: this pod is not a worker (the controller)
    host_index: int | None = None

    def __post_init__(self) -> None:
        if self.num_slices < 1:
            raise ConfigError(f"MTC_NUM_SLICES must be >= 1, got {self.num_slices}")
        if self.hosts_per_slice < 1:
            raise ConfigError(f"MTC_HOSTS_PER_SLICE must be >= 1, got {self.hosts_per_slice}")
        if self.slice_index is not None and not 0 <= self.slice_index < self.num_slices:
            raise ConfigError(f"JOB_INDEX {self.slice_index} is not in 0..{self.num_slices - 1} "
                              f"(MTC_NUM_SLICES={self.num_slices})")
        if self.host_index is not None and not 0 <= self.host_index < self.hosts_per_slice:
            raise ConfigError(f"JOB_COMPLETION_INDEX {self.host_index} is not in "
                              f"0..{self.hosts_per_slice - 1} "
                              f"(MTC_HOSTS_PER_SLICE={self.hosts_per_slice})")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, worker: bool = True
                 ) -> JobSetPlace:
        """Read the place from the environment; ``worker=False`` for a pod of another
        replicated job, which needs only the workers' addresses."""
        env = os.environ if env is None else env
        jobset = env_str(env, "JOBSET_NAME")
        own_job = env.get("REPLICATED_JOB_NAME", "")
        worker_job = env.get("MTC_WORKER_JOB") or own_job
        if not worker_job:
            raise ConfigError("environment variable REPLICATED_JOB_NAME (or MTC_WORKER_JOB) "
                              "is not set")
        if worker and own_job and own_job != worker_job:
            raise ConfigError(f"this pod belongs to replicated job {own_job!r}, "
                              f"not to the workers ({worker_job!r})")
        return cls(
            jobset=jobset,
            worker_job=worker_job,
            num_slices=env_int(env, "MTC_NUM_SLICES"),
            hosts_per_slice=env_int(env, "MTC_HOSTS_PER_SLICE"),
            subdomain=env_str(env, "MTC_SUBDOMAIN", jobset),
            slice_index=env_int(env, "JOB_INDEX") if worker else None,
            host_index=env_int(env, "JOB_COMPLETION_INDEX") if worker else None,
        )

    @property
    def num_nodes(self) -> int:
        return self.num_slices * self.hosts_per_slice

    @property
    def rank(self) -> int:
        if self.slice_index is None or self.host_index is None:
            raise ConfigError("this pod is not a worker: it has no rank")
        return self.slice_index * self.hosts_per_slice + self.host_index

    def hostname(self, rank: int) -> str:
        """The pod's DNS name in the headless service (resolvable in its namespace)."""
        if not 0 <= rank < self.num_nodes:
            raise ConfigError(f"rank {rank} is not in 0..{self.num_nodes - 1}")
        s, h = divmod(rank, self.hosts_per_slice)
        return f"{self.jobset}-{self.worker_job}-{s}-{h}.{self.subdomain}"

    @property
    def pod_prefix(self) -> str:
        """What every worker pod's name starts with: Kubernetes names the pods of Job
        ``<jobset>-<replicated job>-<slice>`` ``<job>-<host>-xxxxx``, and
        cert-manager's CSI driver puts that name in the pod's certificate."""
        return f"{self.jobset}-{self.worker_job}-"

    @property
    def pod_names(self) -> tuple[str, int]:
        """How a certificate names a worker pod's rank: ``(pod prefix, hosts per
        slice)``, pod ``<prefix><s>-<h>-xxxxx`` being rank ``s * hosts + h``. What
        ``mtc-replicator-k8s`` gives its replicator (``--tls-pod-prefix``,
        ``--tls-hosts-per-slice``) and a trainer gives its manager
        (``Options(replicator_pod_names=...)``): both read the same name as the
        same rank, so the trainer proves the copies it reads as the replicators do."""
        return self.pod_prefix, self.hosts_per_slice

    def addresses(self, port: int) -> list[str]:
        """Every worker's ``host:port``, in rank order."""
        return [f"{self.hostname(r)}:{port}" for r in range(self.num_nodes)]

    def coordinator_address(self, port: int) -> str:
        """JAX's coordinator: process 0, rank 0's pod."""
        return f"{self.hostname(0)}:{port}"



def read_jax_init_info(local_dir: Path) -> tuple[int, str]:
    """The process id and coordinator address of ``jax-init-info.txt``."""
    lines = (local_dir / JAX_INIT_INFO).read_text().split("\n")
    if len(lines) < 2 or not lines[0].strip() or not lines[1].strip():
        raise ConfigError(f"{local_dir / JAX_INIT_INFO} needs a process id and a coordinator "
                          f"address on its first two lines, has {lines[:2]!r}")
    try:
        return int(lines[0]), lines[1].strip()
    except ValueError:
        raise ConfigError(f"{local_dir / JAX_INIT_INFO}: process id {lines[0]!r} is not an "
                          "integer") from None

