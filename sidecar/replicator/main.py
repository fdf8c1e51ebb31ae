"""``mtc-replicator``: the per-host replicator process."""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from mtc.errors import ConfigError, MtcError
from sidecar.replicator import orbax
from sidecar.replicator.config import ReplicatorConfig
from sidecar.replicator.node import Node
from sidecar.replicator.security import Credentials
from sidecar.replicator.server import serve

log = logging.getLogger("mtc.replicator")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mtc-replicator",
        description="Copies this host's committed checkpoint steps to peer hosts in other "
                    "slices and restores a replaced host's data from them.")
    p.add_argument("--local-dir", required=True, help="this host's RAM disk")
    p.add_argument("--listen", required=True, help="HOST:PORT to serve on (PORT 0: any)")
    p.add_argument("--nodes", required=True,
                   help="every node's replicator address, comma-separated, in rank order")
    p.add_argument("--rank", type=int, help="this node's rank (default: from replicator.yaml)")
    p.add_argument("--nodes-per-slice", type=int, default=1, help="hosts per slice")
    p.add_argument("--replicas", type=int, default=1,
                   help="peer copies of each step, in other slices (default 1)")
    p.add_argument("--keep", type=int, default=2, help="own steps kept (default 2)")
    p.add_argument("--backup", help="backup URL (file:///path, gs://bucket/prefix, any fsspec)")
    p.add_argument("--backup-interval-minutes", type=float,
                   help="back up every N minutes (default 30 unless steps are given)")
    p.add_argument("--backup-interval-steps", type=int, help="back up every N steps")
    p.add_argument("--backup-keep", type=int, default=3, help="newest backups kept")
    p.add_argument("--backup-keep-every", type=int, default=0,
                   help="also keep every K-th step's backup (0: none)")
    p.add_argument("--backup-retry-seconds", type=float,
                   help="how long one request to the backup store keeps retrying transient "
                        "failures before the backup counts as failed (gs://; default 120)")
    p.add_argument("--token-file", help="file holding the shared peer token")
    p.add_argument("--tls-cert", help="this node's certificate (PEM), for mutual TLS")
    p.add_argument("--tls-key", help="its private key (PEM)")
    p.add_argument("--tls-ca", help="CA certificate that signs every peer (PEM)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--port-file", help="write the bound gRPC port here once serving")
    p.add_argument("--framework", choices=("mtc", "orbax"), default="mtc")
    p.add_argument("--poll-seconds", type=float, default=0.2)
    p.add_argument("--straggler-wait-seconds", type=float, default=10.0,
                   help="how long restore agreement waits for a node that is down")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s replicator: %(message)s")
    root = Path(args.local_dir)
    root.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    nodes = tuple(args.nodes.split(","))
    rank, per_slice, framework = args.rank, args.nodes_per_slice, args.framework
    request = None
    try:
        if rank is None:
            # Orbax's client tells us who we are through replicator.yaml.
            log.info("waiting for %s in %s", orbax.YAML_NAME, root)
            while request is None:
                if stop.wait(args.poll_seconds):
                    return 0
                request = _take(root)
            rank, per_slice, framework = request.rank, request.nodes_per_slice, "orbax"
            if request.nodes != len(nodes):
                raise ConfigError(f"{orbax.YAML_NAME} says {request.nodes} nodes, --nodes "
                                  f"lists {len(nodes)}")
        config = ReplicatorConfig(rank=rank, nodes=nodes, nodes_per_slice=per_slice,
                                  replicas=args.replicas, keep=args.keep,
                                  poll_s=args.poll_seconds, framework=framework,
                                  straggler_wait_s=args.straggler_wait_seconds)
        creds = Credentials.from_files(args.token_file, args.tls_cert, args.tls_key,
                                       args.tls_ca)
        backup = None
        if args.backup:
            from sidecar.backup.backend import open_backend
            from sidecar.backup.schedule import BackupPolicy, BackupScheduler

            minutes = args.backup_interval_minutes
            steps = args.backup_interval_steps
            if request is not None and (request.backup_interval_minutes or
                                        request.backup_interval_steps):
                minutes = request.backup_interval_minutes
                steps = request.backup_interval_steps
            if minutes is None and steps is None:
                minutes = 30.0
            backend = open_backend(args.backup, retry_deadline_s=args.backup_retry_seconds)
            backup = BackupScheduler(backend, BackupPolicy(
                interval_minutes=minutes, interval_steps=steps, keep=args.backup_keep,
                keep_every=args.backup_keep_every))
        _keep_heap()
        node = Node(config, root, creds, backup)
        server, port, servicer = serve(node, args.listen, creds)
    except (MtcError, OSError, ValueError) as e:
        print(f"mtc-replicator: {e}", file=sys.stderr)
        if framework == "orbax" or request is not None:
            orbax.report(root, f"mtc-replicator cannot start: {e}", fatal=True)
        return 2
    if args.metrics_port:
        node.metrics.serve(args.metrics_port)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    log.info("rank %d serving on port %d, root %s", config.rank, port, args.local_dir)
    loop = threading.Thread(target=node.run, name="mtc-replicate", daemon=True)
    loop.start()
    last_expiry = time.monotonic()
    while True:
        if request is not None:
            _answer(node, root, request)
        if stop.wait(args.poll_seconds):
            break
        request = _take(root) if config.framework == "orbax" else None
        if time.monotonic() - last_expiry > 5.0:
            servicer.expire_transfers()
            last_expiry = time.monotonic()
    node.stop()
    server.stop(grace=2).wait()
    return 0


def _keep_heap() -> None:
    """Stop glibc from trimming and regrowing the heap around every 4 MiB message
    buffer (M_TOP_PAD): measured, it removes ~169k page faults per GiB received
    and a quarter of the receiver's CPU time."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-2, 64 << 20)
    except (OSError, AttributeError):
        pass


def _take(root: Path) -> orbax.ClientRequest | None:
    try:
        return orbax.take_request(root)
    except ConfigError as e:
        orbax.report(root, str(e), fatal=True)
        return None


def _answer(node: Node, root: Path, request: orbax.ClientRequest) -> None:
    """Serve one Orbax client start: agree on a step and write the restore marker."""
    if request.rank != node.rank or request.nodes != node.config.num_nodes:
        orbax.report(root, f"{orbax.YAML_NAME} names rank {request.rank} of {request.nodes}; "
                           f"this replicator is rank {node.rank} of {node.config.num_nodes}",
                     fatal=True)
        return
    try:
        step = node.restore_for_client(request.job_name)
        log.info("rank %d: told the client to restore step %d", node.rank, step)
    except (MtcError, OSError) as e:
        log.exception("restore for the client failed")
        orbax.report(root, f"restore failed: {e}", fatal=True)


if __name__ == "__main__":
    sys.exit(main())
