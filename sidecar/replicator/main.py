"""``mtc-replicator``: the per-host replicator process, and its composition root:
:func:`run` starts every service (the node's, the server's, the Orbax client's
answers) with one thread group (:class:`mtc.lifecycle.Services`), watches the
loop's health, and on shutdown stops them, joins every thread and closes them."""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from mtc.credentials import Credentials
from mtc.errors import ConfigError, MtcError
from mtc.lifecycle import Service, Services, SignalStop, Threads
from mtc.rank_names import PodNames, use_pod_names
from mtc.sidecar import priority
from mtc.sidecar.replicator import orbax
from mtc.sidecar.replicator.config import GC_VIEW_INTERVAL_S, KEEPALIVE_S, ReplicatorConfig
from mtc.sidecar.replicator.metrics import MetricsServer
from mtc.sidecar.replicator.node import Node
from mtc.sidecar.replicator.orbax_client import OrbaxClient
from mtc.sidecar.replicator.wire.limits import Limits
from mtc.sidecar.replicator.wire.server import Serving, serve, set_health
from mtc.sidecar.storage.publish import write_atomic

log = logging.getLogger("mtc.replicator")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="mtc-replicator",
        description="Copies this host's committed checkpoint steps to peer hosts in other "
                    "slices and restores a replaced host's data from them.")
    p.add_argument("--local-dir", required=True, help="this host's RAM disk")
    p.add_argument("--listen", required=True, help="HOST:PORT to serve on (PORT 0: any)")
    p.add_argument("--data-port", type=int, default=0,
                   help="port of the data channel (shard bytes between replicators, on the "
                        "host of --listen; 0: any, peers learn it; -1: none, bytes go over "
                        "gRPC)")
    p.add_argument("--nodes", required=True,
                   help="every node's replicator address, comma-separated, in rank order")
    p.add_argument("--rank", type=int,
                   help="this node's rank (without it: Orbax's client's, from its "
                        "replicator.yaml, refused with --framework mtc or --nodes-per-slice)")
    p.add_argument("--nodes-per-slice", type=int,
                   help="hosts per slice (default 1: with one slice, every host a slice of "
                        "its own, so that each host has a peer)")
    p.add_argument("--replicas", type=int, default=1,
                   help="peer copies of each step, in other slices (default 1)")
    p.add_argument("--keep", type=int, default=2, help="own steps kept (default 2)")
    p.add_argument("--keep-awaiting", type=int, default=2, metavar="N",
                   help="older own steps kept beyond --keep at most, while replication or "
                        "a restore still wants them (being copied or backed up, the newest "
                        "complete or fully replicated step); fewer when the RAM disk would "
                        "lack room for the next save (default 2)")
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
    p.add_argument("--tls-pod-prefix", metavar="PREFIX",
                   help="read a certificate naming JobSet pod PREFIX<slice>-<host>-xxxxx "
                        "(<jobset>-<replicated job>-, as cert-manager's CSI driver issues "
                        "${POD_NAME}) as rank slice * --tls-hosts-per-slice + host, beside "
                        "mtc-rank-<r> (mtc-replicator-k8s gives both)")
    p.add_argument("--tls-hosts-per-slice", type=int, metavar="N",
                   help="hosts per slice of --tls-pod-prefix's pod names")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port (0: off)")
    p.add_argument("--metrics-address", default="127.0.0.1",
                   help="address the metrics are served on (default loopback: they carry no "
                        "authentication; the pod's address to let Prometheus scrape them)")
    p.add_argument("--port-file", help="write the bound gRPC port here once serving")
    p.add_argument("--framework", choices=("mtc", "orbax"),
                   help="whose steps: mtc's (default with --rank) or Orbax's client's "
                        "(default without --rank)")
    p.add_argument("--poll-seconds", type=float, default=0.2,
                   help="how often the root is looked at anyway (default 0.2); a step "
                        "renamed into it starts its copy at once where inotify works")
    p.add_argument("--straggler-wait-seconds", type=float, default=None,
                   help="ignored (kept for old command lines): a restore now waits for every "
                        "member, up to --agreement-timeout-seconds")
    p.add_argument("--gc-view-interval-seconds", type=float, default=GC_VIEW_INTERVAL_S,
                   metavar="S",
                   help="the coordinator gathers every member's inventory for garbage "
                        "collection's view of the steps no node may delete at most this "
                        "often (default 1)")
    p.add_argument("--peer-keepalive-seconds", type=float, default=KEEPALIVE_S, metavar="S",
                   help="a call to a peer that went silent mid-call (its link cut: no "
                        "reset comes) fails within about 1.5 times this: pinged after "
                        "S idle, given up when a ping is unanswered for S/2 (default 10)")
    p.add_argument("--agreement-timeout-seconds", type=float, default=60.0,
                   help="how long a restore waits for every member before failing (default 60)")
    p.add_argument("--restore-quiet-seconds", type=float, default=2.0,
                   help="after answering a restore, pushes to peers wait this long, and "
                        "a replaced host's own data (fetched in the background) until the "
                        "job says it has loaded the step (Restored) or this long, so the "
                        "restore's reads and the first train steps run first (default 2; "
                        "0: at once)")
    p.add_argument("--replication-warn-seconds", type=float, default=120.0,
                   help="own steps not on every peer for this long: a WARNING here, "
                        "'late' in mtc status and in the trainers' logs, and "
                        "mtc_unreplicated_seconds (default 120)")
    p.add_argument("--no-reserve", action="store_true",
                   help="set no blank RAM-disk space aside for the next peer copy (by "
                        "default the sizes of each origin's last copy are allocated "
                        "ahead, at background priority, while the RAM disk keeps as "
                        "much free beside them: bench/replicator.py's copies then run "
                        "about 1.7x faster)")
    p.add_argument("--scrub-mib-per-second", type=float, default=64.0, metavar="MIB",
                   help="read every held copy again in the background at most this fast "
                        "on average, so that damage that keeps a file's size and mtime "
                        "(bad memory) is found and healed from another host before a "
                        "restore needs the step (default 64; 0: no scrub)")
    p.add_argument("--scrub-interval-seconds", type=float, default=300.0, metavar="S",
                   help="read a held copy again only once this long has passed since its "
                        "bytes were last read whole: written (a save checksums what it "
                        "writes, a peer copy is verified as it arrives) or scrubbed "
                        "(default 300; 0: round again as soon as the rate allows)")
    p.add_argument("--stall-seconds", type=float, default=120.0,
                   help="health turns NOT_SERVING when the replication loop has not "
                        "passed for this long (default 120)")
    p.add_argument("--nice", type=int, default=0, metavar="N",
                   help="lower this process's CPU priority by N (0: unchanged): where the "
                        "replicator shares the host's cores with the training process, its "
                        "copies, checks and backups yield to the trainer's input pipeline "
                        "and dispatch, and run in the gaps (a restore, when training waits "
                        "for it, is not held back)")
    p.add_argument("--stream-grace-seconds", type=float, default=Limits.grace_s,
                   help="a push or fetch stream's first seconds, after which it must keep "
                        f"up --stream-min-rate or be ended (default {Limits.grace_s:.0f})")
    p.add_argument("--stream-min-rate", type=float, default=Limits.min_rate,
                   help="bytes a second a stream averages once its grace is over (default "
                        f"{Limits.min_rate:.0f})")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def lower_priority(nice: int) -> None:
    """``nice`` for this process and its threads (set before any starts: they
    inherit it). A process in a session of its own (this one is started with
    setsid) is also its own scheduling group where the kernel groups sessions
    (autogroup): groups share the cores equally whatever their members' nice, so
    the group's own nice is lowered too, or the trainer would not get its cores
    back (:mod:`mtc.sidecar.priority`)."""
    os.nice(nice)
    priority.lower_group_priority(nice)


def rankless_start(args: argparse.Namespace) -> None:
    """Without ``--rank`` a replicator waits for Orbax's client's ``replicator.yaml``
    to learn its rank. A command line that says mtc (``--framework mtc``, or
    ``--nodes-per-slice``, which the yaml gives in Orbax's case) and forgot
    ``--rank`` is refused, rather than waiting for a file mtc never writes."""
    if args.rank is not None:
        return
    said = [f for f, given in (("--framework mtc", args.framework == "mtc"),
                               ("--nodes-per-slice", args.nodes_per_slice is not None))
            if given]
    if said:
        raise ConfigError(f"no --rank, but {' and '.join(said)}: give each host's replicator "
                          "its --rank (without --rank a replicator serves Orbax's client, "
                          "which names the rank in its replicator.yaml)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nice:
        lower_priority(args.nice)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s replicator: %(message)s")
    root = Path(args.local_dir)
    root.mkdir(parents=True, exist_ok=True)
    # SIGTERM and SIGINT: a graceful stop (never an Event set in the handler:
    # mtc.lifecycle.SignalStop says why).
    stop = SignalStop(poll_s=args.poll_seconds)
    nodes = tuple(args.nodes.split(","))
    rank, per_slice = args.rank, args.nodes_per_slice or 1
    framework = args.framework or "mtc"
    request = None
    try:
        rankless_start(args)
        if rank is None:
            # Orbax's client tells us who we are through replicator.yaml (or a request
            # taken before a restart and not answered yet: serve it now).
            log.info("waiting for %s in %s", orbax.YAML_NAME, root)
            request = _pending(root)
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
                                  keep_awaiting=args.keep_awaiting,
                                  poll_s=args.poll_seconds, framework=framework,
                                  gc_view_interval_s=args.gc_view_interval_seconds,
                                  keepalive_s=args.peer_keepalive_seconds,
                                  agreement_timeout_s=args.agreement_timeout_seconds,
                                  restore_quiet_s=args.restore_quiet_seconds,
                                  replication_warn_s=args.replication_warn_seconds,
                                  reserve=not args.no_reserve,
                                  scrub_rate=args.scrub_mib_per_second * 2**20,
                                  scrub_interval_s=args.scrub_interval_seconds)
        if (args.tls_pod_prefix is None) != (args.tls_hosts_per_slice is None):
            raise ConfigError("--tls-pod-prefix and --tls-hosts-per-slice go together")
        if args.tls_pod_prefix is not None:
            # Before any certificate is read: how this process maps pod names to ranks.
            use_pod_names(PodNames(args.tls_pod_prefix, args.tls_hosts_per_slice))
        creds = Credentials.from_files(args.token_file, args.tls_cert, args.tls_key,
                                       args.tls_ca)
        creds.check_names_rank(rank)  # with mutual TLS: peers take us for this rank only
        soon = creds.check_valid_now()  # an expired certificate: refused here, not silently
        if soon:
            log.warning("rank %d: %s", rank, soon)
        if creds.token and not creds.tls:
            log.warning("rank %d: a shared token, without mutual TLS: whoever holds the token "
                        "can act as any rank, and offer or list copies of any rank's data "
                        "made of bytes it chose (checked by CRC32C only, not proven whose "
                        "they are); use mutual TLS off a single machine (docs/security.md)",
                        rank)
        backup = None
        if args.backup:
            from mtc.sidecar.backup.backend import open_backend
            from mtc.sidecar.backup.schedule import BackupPolicy, BackupScheduler

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
        if backup is not None:
            node.metrics.backup_interval.set(60 * (backup.policy.interval_minutes or 0))
            node.metrics.backup_interval_steps.set(backup.policy.interval_steps or 0)
        # Every member's Decide waits on a server thread of the coordinator until the
        # epoch forms: two threads per member (an ask and its re-issue), plus 32.
        if not (args.stream_grace_seconds > 0 and args.stream_min_rate > 0):
            raise ConfigError("--stream-grace-seconds and --stream-min-rate must be positive")
        threads = Threads("mtc-replicator")
        server, port, servicer, health_servicer = serve(
            node, args.listen, creds, workers=32 + 2 * len(nodes),
            limits=Limits(grace_s=args.stream_grace_seconds, min_rate=args.stream_min_rate),
            data_port=None if args.data_port < 0 else args.data_port, threads=threads)
    except (MtcError, OSError, ValueError) as e:
        print(f"mtc-replicator: {e}", file=sys.stderr)
        if framework == "orbax" or request is not None:
            orbax.report(root, f"mtc-replicator cannot start: {e}", fatal=True)
        return 2
    extra: list[Service] = []
    if args.metrics_port:
        extra.append(MetricsServer(node.metrics, args.metrics_port, args.metrics_address))
    if args.port_file:
        write_atomic(Path(args.port_file), str(port))
    # Start-up's objects live as long as the process: kept out of every collection
    # (a full one walks them all, and a restore's inventories and plans set them off).
    gc.freeze()
    log.info("rank %d serving on port %d, root %s", config.rank, port, args.local_dir)
    if request is None and config.framework == "orbax":
        request = _pending(root)
    return run(node, Serving(server, servicer, health_servicer), root, request, stop,
               stall_s=args.stall_seconds, threads=threads, extra=extra)


def run(node: Node, serving: Serving, root: Path, request: orbax.ClientRequest | None,
        stop: threading.Event | SignalStop, *, stall_s: float, threads: Threads | None = None,
        extra: Sequence[Service] = ()) -> int:
    """The composition root's life: start every service (``threads``: the group the
    server's threads started in; ``extra``: the metrics server), watch the loop's
    health, and on ``stop`` (SIGTERM) or a service's thread failing, shut down
    gracefully: NOT_SERVING, stop accepting, finish the calls in flight, join
    every thread. Returns 1 when a thread failed (its error logged), else 0."""
    client = OrbaxClient(root, node.rank, node.config.num_nodes, node.restorer)
    # Stopped in the reverse order: the Orbax answers, then the server (no new
    # calls), then the node's services (the calls in flight waiting on them end).
    services = Services("mtc-replicator", [node, serving, client, *extra], threads=threads)
    services.start()
    if request is not None:
        client.put(request)
    config = node.config
    last_expiry = time.monotonic()
    serving_ok = True
    try:
        while not stop.wait(config.poll_s) and not services.threads.failed.is_set():
            if config.framework == "orbax":
                req = _take(root)
                if req is not None:
                    client.put(req)
            elif (root / orbax.YAML_NAME).exists():
                _refuse(root, node.rank, config.framework)
            if time.monotonic() - last_expiry > 5.0:
                serving.servicer.expire_transfers()
                last_expiry = time.monotonic()
            ok = healthy(node.loop.heartbeat, time.monotonic(), stall_s)
            if ok != serving_ok:
                log.warning("rank %d: replication loop %s", node.rank,
                            "passes again" if ok else f"stalled for over {stall_s:.0f}s")
                set_health(serving.health, ok)
                node.metrics.stalled.set(0 if ok else 1)
                serving_ok = ok
    finally:
        log.info("rank %d: shutting down", node.rank)
        stop.set()
        services.shutdown(reraise=False)
    failed = services.threads.errors()
    if failed:  # each logged with its traceback as it happened
        log.error("rank %d: ended because thread %s failed: %r", node.rank, *failed[0])
    return 1 if failed else 0


def healthy(heartbeat: float, now: float, stall_s: float) -> bool:
    """The loop is alive when it passed within ``stall_s``."""
    return now - heartbeat <= stall_s


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
        log.error("%s", e)  # take_request wrote replicator.failed before consuming it
        return None


def _pending(root: Path) -> orbax.ClientRequest | None:
    try:
        return orbax.pending_request(root)
    except ConfigError as e:
        log.error("%s", e)
        return None


def _refuse(root: Path, rank: int, framework: str) -> None:
    """A replicator.yaml reached a replicator started for mtc (``--rank``,
    ``--framework mtc``): tell the client at once why nobody will answer it."""
    orbax.refuse_request(root, (
        f"this replicator (rank {rank}) was started with --rank and --framework "
        f"{framework}, so it does not serve Orbax's {orbax.YAML_NAME}: start "
        f"mtc-replicator without --rank (it learns its rank from {orbax.YAML_NAME}) or "
        f"with --framework orbax"))


if __name__ == "__main__":
    sys.exit(main())
