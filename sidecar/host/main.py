"""``python -m mtc.sidecar.host.main``: the sidecar process of one host.

It alone (with the host's replicator) sees the host's RAM disk; the trainer
reaches it over gRPC and hands it bytes through the host's shared-memory area.
It serves until SIGTERM or SIGINT, then finishes the saves in flight and exits.

Every call is authenticated with the replicators' credentials (``--token-file``,
or mutual TLS): without any it serves a loopback address only, and runs no
colocated Python at all (a program is code it would run as sent).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
from pathlib import Path

import grpc

from mtc.contract import AgentConfig
from mtc.credentials import Credentials
from mtc.errors import ConfigError
from mtc.lifecycle import SignalStop
from mtc.pool import ThreadPool
from mtc.rank_names import CONTROLLER
from mtc.sidecar.host.colocated import ColocatedServer
from mtc.sidecar.host.service import MAX_MESSAGE, HostService, handler
from mtc.sidecar.replicator.wire.security import (
    IdentityGate,
    TokenInterceptor,
    check_listen_address,
)
from mtc.sidecar.storage.publish import write_atomic

log = logging.getLogger("mtc.sidecar.host")


def _interceptors(creds: Credentials, host: int) -> list[grpc.ServerInterceptor]:
    """The token, and with mutual TLS the identities a sidecar takes calls from: its
    own host's certificate (``mtc-rank-<host>``) and the controller's, nobody
    else's (another host's certificate ran code and deleted steps here)."""
    out: list[grpc.ServerInterceptor] = [TokenInterceptor(creds.token)] if creds.token else []
    if creds.tls:
        out.append(IdentityGate(lambda who: who in (host, CONTROLLER),
                                f"host {host}'s sidecar"))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, type=Path, help="this host's RAM disk")
    p.add_argument("--area", required=True, type=Path, help="the shared-memory area")
    p.add_argument("--host", required=True, type=int, help="this host's rank")
    p.add_argument("--slices", required=True, type=str,
                   help="slice of every host, comma-separated (host order)")
    p.add_argument("--listen", required=True, help="address to serve (host:port or unix:PATH)")
    p.add_argument("--ready-file", type=Path, help="written with the bound address when serving")
    p.add_argument("--started-file", type=Path,
                   help="written at once, before the colocated runtime starts: the host's "
                        "other processes may join its namespaces meanwhile")
    p.add_argument("--writer-threads", type=int, default=2)
    p.add_argument("--colocated-devices", type=int, default=0,
                   help="run colocated-Python programs on this many CPU devices of its own "
                        "(0: none; JAX is then never imported)")
    p.add_argument("--colocated-call-latency-ms", type=float, default=3.0,
                   help="what each colocated call costs beyond its work, as the hop through "
                        "Pathways' proxy does (a few ms): call counts show in every timing")
    p.add_argument("--job-devices", type=int, default=0,
                   help="the CPU devices of the whole job, this host's among them")
    p.add_argument("--token-file", help="file holding the shared token every caller presents")
    p.add_argument("--tls-cert", help="this host's certificate (PEM), for mutual TLS")
    p.add_argument("--tls-key", help="its private key (PEM)")
    p.add_argument("--tls-ca", help="CA certificate that signs every caller's (PEM)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sidecar %(message)s")

    try:
        creds = Credentials.from_files(args.token_file, args.tls_cert, args.tls_key,
                                       args.tls_ca)
        check_listen_address(args.listen, creds)
        if args.colocated_devices > 0 and not creds.any:
            raise ConfigError("--colocated-devices runs the programs callers send: give "
                              "--token-file or --tls-cert/--tls-key/--tls-ca")
    except (ConfigError, OSError) as e:
        p.exit(2, f"sidecar: {e}\n")
    slices = [int(x) for x in args.slices.split(",")]
    args.root.mkdir(parents=True, exist_ok=True)
    args.area.mkdir(parents=True, exist_ok=True)
    if args.started_file:
        write_atomic(args.started_file, json.dumps({"pid": os.getpid()}))
    config = AgentConfig(local_dir=str(args.root), host_of_device={},
                         slice_of_host=dict(enumerate(slices)), subdirs=False,
                         max_staged_bytes=None, writer_threads=args.writer_threads)
    colocated = (ColocatedServer(args.host, args.area, args.root, args.colocated_devices,
                                 max(args.job_devices, args.colocated_devices),
                                 latency_s=max(0.0, args.colocated_call_latency_ms) / 1000)
                 if args.colocated_devices > 0 else None)
    service = HostService(config, args.host, args.area, colocated)
    pool = ThreadPool(8, "mtc-sidecar-rpc", lazy=True)
    server = grpc.server(pool, options=[("grpc.max_send_message_length", MAX_MESSAGE),
                                        ("grpc.max_receive_message_length", MAX_MESSAGE),
                                        ("grpc.so_reuseport", 0)],
                         interceptors=_interceptors(creds, args.host),
                         # Calls beyond these are refused at once, not queued behind
                         # the pool: a flood of them holds no memory here.
                         maximum_concurrent_rpcs=32)
    server.add_generic_rpc_handlers((handler(service),))
    sc = creds.server_credentials()
    port = server.add_secure_port(args.listen, sc) if sc else server.add_insecure_port(args.listen)
    if port == 0:
        raise SystemExit(f"sidecar: cannot listen on {args.listen}")
    server.start()
    bound = args.listen if args.listen.startswith("unix:") else (
        args.listen.rsplit(":", 1)[0] + f":{port}")
    if colocated is not None:
        # Ready when its colocated runtime is: a Pathways worker's sidecar serves
        # programs from its start, and a restore must not wait for this one's JAX.
        colocated.wait_ready()
    # What start-up built (JAX, its runtime, the server) lives as long as the process:
    # kept out of every collection. A full collection walked it all, and a
    # restore's hundreds of read tasks set collections off: the walks took much
    # of a sidecar's CPU in restores.
    gc.freeze()
    if args.ready_file:
        write_atomic(args.ready_file, json.dumps(
            {"address": bound, "pid": os.getpid(), "area": str(args.area)}))
    log.info("host %d: serving %s on %s", args.host, args.root, bound)

    # SIGTERM and SIGINT: a graceful stop (never an Event set in the handler:
    # mtc.lifecycle.SignalStop says why).
    SignalStop().wait()
    server.stop(grace=5).wait()
    service.close()
    pool.shutdown()
    if colocated is not None:
        # JAX's distributed client would wait at exit for the process just ended.
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
