"""A bare gRPC host for ``bench/restore_hosts.py``'s floor: one process per host
answering each call with its request after ``--latency-ms`` (the sidecars'
``--colocated-call-latency-ms``), and nothing else. The caller fans its calls
out as the colocated runtime does (a thread per host); what two such calls cost
with 8 hosts over 4 is what gRPC and the shared cores alone make of the ratio.

Run as ``python bench/_grpc_echo.py --latency-ms 3`` with the token in
``MTC_BENCH_TOKEN``: it prints the port it listens on (loopback) and serves until
killed. A call without the token is refused, as every listener here refuses one.
"""

from __future__ import annotations

import argparse
import hmac
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

METHOD = "/mtc.bench.Echo/Call"
TOKEN_KEY = "x-mtc-bench-token"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--latency-ms", type=float, default=0.0)
    args = p.parse_args(argv)
    token = os.environ["MTC_BENCH_TOKEN"].encode()
    latency_s = args.latency_ms / 1e3

    def call(request: bytes, context: grpc.ServicerContext) -> bytes:
        got = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
        if not hmac.compare_digest(str(got).encode(), token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")
        if latency_s:
            time.sleep(latency_s)
        return request

    handler = grpc.method_handlers_generic_handler("mtc.bench.Echo", {
        "Call": grpc.unary_unary_rpc_method_handler(call)})
    server = grpc.server(ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length",
                                                          1 << 16)])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    sys.exit(main())
