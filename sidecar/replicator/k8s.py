"""``mtc-replicator-k8s``: the replicator in a JobSet pod, configured from its environment.

The replicator needs every node's address in rank order, its own rank, the
hosts per slice, and how the job names its pods (a pod's certificate, which
cert-manager's CSI driver issues for ``${POD_NAME}``, names its rank by that
name: :mod:`~mtc.sidecar.replicator.wire.rank_names`). In a JobSet these follow from
the pod's place in it: the worker replicated job has one Job per slice
(``JOB_INDEX``) and one pod per host of that slice (``JOB_COMPLETION_INDEX``),
and every pod is reachable through the JobSet's headless service as
``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>``. Rank ``r`` is
host ``r % hosts`` of slice ``r // hosts``, the order
:class:`~mtc.sidecar.replicator.config.ReplicatorConfig` expects.

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

With ``--write-jax-init-info`` it also writes ``<local-dir>/jax-init-info.txt``
(line 1: this host's JAX process id, its rank; line 2: the coordinator address,
rank 0's pod on ``--coordinator-port``) before the replicator starts: the file
that GKE's multi-tier checkpointing CSI driver writes on GKE, and that Orbax's
``initialize_multi_tier_checkpointing`` and ``mtc-train-k8s`` wait for.

With ``--health-port`` it serves a second, plaintext gRPC server that answers
only ``grpc.health.v1`` and mirrors the replicator's own health (polled over
its credentials). Kubernetes' ``grpc`` probes cannot present a client
certificate, so with mutual TLS they cannot reach the replicator's port; this
port carries no data and no credentials.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mtc.errors import ConfigError, MtcError
from mtc.lifecycle import Threads
from mtc.sidecar.replicator.wire.security import Credentials, TlsWatch
from mtc.sidecar.storage.publish import write_atomic

log = logging.getLogger("mtc.replicator.k8s")

JAX_INIT_INFO = "jax-init-info.txt"
DEFAULT_PORT = 9470
DEFAULT_COORDINATOR_PORT = 8476
SERVICES = ("", "mtc.replicator.v1.Replicator")
# Computed by this wrapper; giving them as well would contradict the JobSet.
_COMPUTED = ("--nodes", "--rank", "--nodes-per-slice", "--listen", "--tls-pod-prefix",
             "--tls-hosts-per-slice")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


def _str(env: Mapping[str, str], name: str, default: str | None = None) -> str:
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
        jobset = _str(env, "JOBSET_NAME")
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
            num_slices=_int(env, "MTC_NUM_SLICES"),
            hosts_per_slice=_int(env, "MTC_HOSTS_PER_SLICE"),
            subdomain=_str(env, "MTC_SUBDOMAIN", jobset),
            slice_index=_int(env, "JOB_INDEX") if worker else None,
            host_index=_int(env, "JOB_COMPLETION_INDEX") if worker else None,
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

    def addresses(self, port: int) -> list[str]:
        """Every worker's ``host:port``, in rank order."""
        return [f"{self.hostname(r)}:{port}" for r in range(self.num_nodes)]

    def coordinator_address(self, port: int) -> str:
        """JAX's coordinator: process 0, rank 0's pod."""
        return f"{self.hostname(0)}:{port}"


def write_jax_init_info(local_dir: Path, process_id: int, coordinator: str) -> Path:
    """Write ``jax-init-info.txt`` (process id, coordinator address) atomically."""
    local_dir.mkdir(parents=True, exist_ok=True)
    path = local_dir / JAX_INIT_INFO
    write_atomic(path, f"{process_id}\n{coordinator}\n", durable=True)
    return path


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


class HealthMirror:
    """A plaintext health-only gRPC server reporting the replicator's own health; its
    poll runs on a thread of its group, joined by :meth:`stop`."""

    def __init__(self, target: str, creds: Credentials, *, tls_name: str | None = None,
                 poll_s: float = 2.0, timeout_s: float = 2.0) -> None:
        self.target = target
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self._tls_name = tls_name
        # A certificate rotation makes a new channel (the replicator serves the new
        # files to new connections; see security.py).
        self._tls = TlsWatch(creds)
        self._channel, self._stub = self._connect(self._tls.credentials)
        self.servicer = health.HealthServicer()
        for s in SERVICES:
            self.servicer.set(s, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._threads = Threads("mtc-health-mirror")

    def _connect(self, cc: grpc.ChannelCredentials | None
                 ) -> tuple[grpc.Channel, health_pb2_grpc.HealthStub]:
        options = ([("grpc.ssl_target_name_override", self._tls_name)]
                   if cc and self._tls_name else [])
        channel = (grpc.secure_channel(self.target, cc, options=options) if cc
                   else grpc.insecure_channel(self.target))
        return channel, health_pb2_grpc.HealthStub(channel)

    def poll_once(self) -> dict[str, int]:
        """Ask the replicator for each service's status and mirror it."""
        cc = self._tls.renewed()
        if cc is not None:
            old = self._channel
            self._channel, self._stub = self._connect(cc)
            old.close()
        statuses = {}
        for s in SERVICES:
            try:
                reply = self._stub.Check(health_pb2.HealthCheckRequest(service=s),
                                         timeout=self.timeout_s)
                status = reply.status
            except grpc.RpcError:
                status = health_pb2.HealthCheckResponse.NOT_SERVING
            self.servicer.set(s, status)
            statuses[s] = status
        return statuses

    def start(self, listen: str) -> int:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        port = server.add_insecure_port(listen)
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        server.start()
        self._server = server
        self._threads.start(self._run, "mtc-health-mirror")
        return port

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.poll_s)

    def stop(self) -> None:
        """Stop polling (its thread joined), say NOT_SERVING, stop serving."""
        self._stop.set()
        self._threads.join(reraise=False)
        for s in SERVICES:
            self.servicer.set(s, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._server is not None:
            self._server.stop(grace=1).wait()
        self._channel.close()


def parse_args(argv: Sequence[str] | None = None,
               env: Mapping[str, str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    env = os.environ if env is None else env
    p = argparse.ArgumentParser(
        prog="mtc-replicator-k8s",
        description="Runs mtc-replicator in a JobSet worker pod: computes --rank, --nodes and "
                    "--nodes-per-slice from the JobSet environment (JOBSET_NAME, "
                    "REPLICATED_JOB_NAME, JOB_INDEX, JOB_COMPLETION_INDEX, MTC_NUM_SLICES, "
                    "MTC_HOSTS_PER_SLICE, MTC_SUBDOMAIN). Other options are passed on to "
                    "mtc-replicator (see mtc-replicator --help).")
    p.add_argument("--local-dir", required=True, help="this host's RAM disk")
    p.add_argument("--port", type=int,
                   default=_int(env, "MTC_REPLICATOR_PORT", DEFAULT_PORT),
                   help="replicator port, the same on every node (env MTC_REPLICATOR_PORT, "
                        f"default {DEFAULT_PORT})")
    p.add_argument("--health-port", type=int, default=_int(env, "MTC_HEALTH_PORT", 0),
                   help="serve a plaintext grpc.health.v1 mirror of the replicator's health "
                        "here, for Kubernetes probes (env MTC_HEALTH_PORT; 0: off)")
    p.add_argument("--write-jax-init-info", action="store_true",
                   default=env.get("MTC_WRITE_JAX_INIT_INFO", "").lower() in ("1", "true"),
                   help=f"write <local-dir>/{JAX_INIT_INFO} (JAX process id, coordinator "
                        "address) for multi-controller JAX (env MTC_WRITE_JAX_INIT_INFO=1)")
    p.add_argument("--coordinator-port", type=int,
                   default=_int(env, "MTC_COORDINATOR_PORT", DEFAULT_COORDINATOR_PORT),
                   help="JAX coordinator port on rank 0's pod (env MTC_COORDINATOR_PORT, "
                        f"default {DEFAULT_COORDINATOR_PORT})")
    p.add_argument("--token-file", help="passed on; also used by the health mirror")
    p.add_argument("--tls-cert", help="passed on; also used by the health mirror")
    p.add_argument("--tls-key", help="passed on; also used by the health mirror")
    p.add_argument("--tls-ca", help="passed on; also used by the health mirror")
    p.add_argument("--print-args", action="store_true",
                   help="print the mtc-replicator command line and exit")
    args, rest = p.parse_known_args(argv)
    for flag in _COMPUTED:
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            p.error(f"{flag} is computed from the JobSet environment; do not give it")
    return args, rest


def replicator_argv(args: argparse.Namespace, rest: Sequence[str], place: JobSetPlace
                    ) -> list[str]:
    """The ``mtc-replicator`` command line for this pod."""
    argv = ["--local-dir", args.local_dir,
            "--listen", f"0.0.0.0:{args.port}",
            "--nodes", ",".join(place.addresses(args.port)),
            "--rank", str(place.rank),
            "--nodes-per-slice", str(place.hosts_per_slice),
            # A worker pod's certificate names the pod: that name is its rank.
            "--tls-pod-prefix", place.pod_prefix,
            "--tls-hosts-per-slice", str(place.hosts_per_slice)]
    for flag in ("token_file", "tls_cert", "tls_key", "tls_ca"):
        value = getattr(args, flag)
        if value:
            argv += ["--" + flag.replace("_", "-"), value]
    return argv + list(rest)


def main(argv: Sequence[str] | None = None) -> int:
    from mtc.sidecar.replicator import main as replicator

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s replicator-k8s: %(message)s")
    try:
        args, rest = parse_args(argv)
        place = JobSetPlace.from_env()
        command = replicator_argv(args, rest, place)
    except MtcError as e:
        print(f"mtc-replicator-k8s: {e}", file=sys.stderr)
        return 2
    if args.print_args:
        print(shlex.join(["mtc-replicator", *command]))
        return 0
    if args.write_jax_init_info:
        path = write_jax_init_info(Path(args.local_dir), place.rank,
                                   place.coordinator_address(args.coordinator_port))
        log.info("wrote %s: process %d, coordinator %s", path, place.rank,
                 place.coordinator_address(args.coordinator_port))
    mirror = None
    if args.health_port:
        try:
            creds = Credentials.from_files(args.token_file, args.tls_cert, args.tls_key,
                                           args.tls_ca)
            mirror = HealthMirror(f"127.0.0.1:{args.port}", creds,
                                  tls_name=place.hostname(place.rank))
            mirror.start(f"0.0.0.0:{args.health_port}")
        except (MtcError, OSError) as e:
            print(f"mtc-replicator-k8s: {e}", file=sys.stderr)
            return 2
        log.info("health mirror on port %d", args.health_port)
    try:
        return replicator.main(command)
    finally:
        if mirror is not None:
            mirror.stop()


if __name__ == "__main__":
    sys.exit(main())
