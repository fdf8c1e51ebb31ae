"""``python -m mtc.sidecar.replicator.healthcheck``: exit 0 when a gRPC health service says SERVING.

The images' ``HEALTHCHECK`` (Docker, Podman) runs it against the replicator's
plaintext health mirror. Kubernetes ignores ``HEALTHCHECK``; the manifests use
native ``grpc`` probes on the same port instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mtc.credentials import Credentials
from mtc.errors import MtcError


def check(address: str, service: str = "", *, creds: Credentials | None = None,
          tls_name: str | None = None, timeout_s: float = 3.0) -> str:
    """The status name the health service at ``address`` gives for ``service``."""
    cc = creds.channel_credentials() if creds else None
    options = [("grpc.ssl_target_name_override", tls_name)] if cc and tls_name else []
    channel = (grpc.secure_channel(address, cc, options=options) if cc
               else grpc.insecure_channel(address))
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    finally:
        channel.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtc.sidecar.replicator.healthcheck",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--address", default="127.0.0.1:9471",
                   help="HOST:PORT of the health service (default: the replicator's health "
                        "mirror, 127.0.0.1:9471)")
    p.add_argument("--service", default="", help="service name ('' is the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--tls-ca")
    p.add_argument("--tls-name", help="name to verify the server's certificate against")
    args = p.parse_args(argv)
    try:
        creds = Credentials.from_files(None, args.tls_cert, args.tls_key, args.tls_ca)
        status = check(args.address, args.service, creds=creds, tls_name=args.tls_name,
                       timeout_s=args.timeout)
    except grpc.RpcError as e:
        print(f"unhealthy: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except (MtcError, OSError) as e:
        print(f"unhealthy: {e}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
