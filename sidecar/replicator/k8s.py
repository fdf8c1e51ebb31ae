"""``mtc-replicator-k8s``: the replicator in a JobSet pod, configured from its environment.

The replicator needs every node's address in rank order, its own rank, the
hosts per slice, and how the job names its pods (a pod's certificate, which
cert-manager's CSI driver issues for ``${POD_NAME}``, names its rank by that
name: :mod:`~mtc.rank_names`). In a JobSet these follow from
the pod's place in it, read from its environment by :class:`mtc.jobset.JobSetPlace`
(which says which variables), the same description a trainer in the same pods
reads.

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
import logging
import os
import shlex
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mtc.credentials import Credentials, TlsWatch
from mtc.errors import MtcError
from mtc.jobset import JAX_INIT_INFO as JAX_INIT_INFO
from mtc.jobset import JobSetPlace as JobSetPlace
from mtc.jobset import env_int
from mtc.jobset import read_jax_init_info as read_jax_init_info
from mtc.lifecycle import Threads
from mtc.pool import ThreadPool
from mtc.sidecar.storage.publish import write_atomic

log = logging.getLogger("mtc.replicator.k8s")

DEFAULT_PORT = 9470
DEFAULT_COORDINATOR_PORT = 8476
SERVICES = ("", "mtc.replicator.v1.Replicator")
# Computed by this wrapper; giving them as well would contradict the JobSet.
_COMPUTED = ("--nodes", "--rank", "--nodes-per-slice", "--listen", "--tls-pod-prefix",
             "--tls-hosts-per-slice")


def write_jax_init_info(local_dir: Path, process_id: int, coordinator: str) -> Path:
    """Write ``jax-init-info.txt`` (process id, coordinator address) atomically."""
    local_dir.mkdir(parents=True, exist_ok=True)
    path = local_dir / JAX_INIT_INFO
    write_atomic(path, f"{process_id}\n{coordinator}\n", durable=True)
    return path


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
        # files to new connections; see mtc/credentials.py).
        self._tls = TlsWatch(creds)
        self._channel, self._stub = self._connect(self._tls.credentials)
        self.servicer = health.HealthServicer()
        for s in SERVICES:
            self.servicer.set(s, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._threads = Threads("mtc-health-mirror")
        self._pool = ThreadPool(2, "mtc-health-rpc", lazy=True)  # the server's handlers

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
        server = grpc.server(self._pool)
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
        self._pool.shutdown(wait=False, cancel_futures=True)  # gRPC never shuts it down
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
                   default=env_int(env, "MTC_REPLICATOR_PORT", DEFAULT_PORT),
                   help="replicator port, the same on every node (env MTC_REPLICATOR_PORT, "
                        f"default {DEFAULT_PORT})")
    p.add_argument("--health-port", type=int, default=env_int(env, "MTC_HEALTH_PORT", 0),
                   help="serve a plaintext grpc.health.v1 mirror of the replicator's health "
                        "here, for Kubernetes probes (env MTC_HEALTH_PORT; 0: off)")
    p.add_argument("--write-jax-init-info", action="store_true",
                   default=env.get("MTC_WRITE_JAX_INIT_INFO", "").lower() in ("1", "true"),
                   help=f"write <local-dir>/{JAX_INIT_INFO} (JAX process id, coordinator "
                        "address) for multi-controller JAX (env MTC_WRITE_JAX_INIT_INFO=1)")
    p.add_argument("--coordinator-port", type=int,
                   default=env_int(env, "MTC_COORDINATOR_PORT", DEFAULT_COORDINATOR_PORT),
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
            # A worker pod's certificate names the pod: that name is its rank (read
            # as a trainer in the same pods reads it: JobSetPlace.pod_names).
            "--tls-pod-prefix", place.pod_names[0],
            "--tls-hosts-per-slice", str(place.pod_names[1])]
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
