"""``python -m mtc.sidecar.host.main``: the sidecar process of one host.

It alone (with the host's replicator) sees the host's RAM disk; the trainer
reaches it over gRPC and hands it bytes through the host's shared-memory area.
It serves until SIGTERM or SIGINT, then finishes the saves in flight and exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from mtc import layout
from mtc.contract import AgentConfig
from mtc.sidecar.host.colocated import ColocatedServer
from mtc.sidecar.host.service import HostService, handler

log = logging.getLogger("mtc.sidecar.host")
MAX_MESSAGE = 256 << 20


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True, type=Path, help="this host's RAM disk")
    p.add_argument("--area", required=True, type=Path, help="the shared-memory area")
    p.add_argument("--host", required=True, type=int, help="this host's rank")
    p.add_argument("--slices", required=True, type=str,
                   help="slice of every host, comma-separated (host order)")
    p.add_argument("--listen", required=True, help="address to serve (host:port or unix:PATH)")
    p.add_argument("--ready-file", type=Path, help="written with the bound address when serving")
    p.add_argument("--writer-threads", type=int, default=2)
    p.add_argument("--colocated-devices", type=int, default=0,
                   help="run colocated-Python programs on this many CPU devices of its own "
                        "(0: none; JAX is then never imported)")
    p.add_argument("--job-devices", type=int, default=0,
                   help="the CPU devices of the whole job, this host's among them")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sidecar %(message)s")

    slices = [int(x) for x in args.slices.split(",")]
    args.root.mkdir(parents=True, exist_ok=True)
    args.area.mkdir(parents=True, exist_ok=True)
    config = AgentConfig(local_dir=str(args.root), host_of_device={},
                         slice_of_host=dict(enumerate(slices)), subdirs=False,
                         max_staged_bytes=None, writer_threads=args.writer_threads)
    colocated = (ColocatedServer(args.host, args.area, args.root, args.colocated_devices,
                                 max(args.job_devices, args.colocated_devices))
                 if args.colocated_devices > 0 else None)
    service = HostService(config, args.host, args.area, colocated)
    pool = ThreadPoolExecutor(8, thread_name_prefix="mtc-sidecar-rpc")
    server = grpc.server(pool, options=[("grpc.max_send_message_length", MAX_MESSAGE),
                                        ("grpc.max_receive_message_length", MAX_MESSAGE)])
    server.add_generic_rpc_handlers((handler(service),))
    port = server.add_insecure_port(args.listen)
    if port == 0:
        raise SystemExit(f"sidecar: cannot listen on {args.listen}")
    server.start()
    bound = args.listen if args.listen.startswith("unix:") else (
        args.listen.rsplit(":", 1)[0] + f":{port}")
    if args.ready_file:
        layout.write_atomic(args.ready_file, json.dumps(
            {"address": bound, "pid": os.getpid(), "area": str(args.area)}))
    log.info("host %d: serving %s on %s", args.host, args.root, bound)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5).wait()
    service.close()
    pool.shutdown()
    if colocated is not None:
        # JAX's distributed client would wait at exit for the process just ended.
        logging.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
