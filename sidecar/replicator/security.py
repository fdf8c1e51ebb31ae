"""Peer authentication: mutual TLS from certificate files, a shared token, or both.

Without credentials a replicator serves loopback addresses only.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from mtc.errors import ConfigError

TOKEN_HEADER = "x-mtc-token"
# Unauthenticated on purpose: Kubernetes probes carry no credentials.
OPEN_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


@dataclasses.dataclass(frozen=True)
class Credentials:
    token: str | None = None
    tls_cert: Path | None = None   # this node's certificate chain (PEM)
    tls_key: Path | None = None    # its private key
    tls_ca: Path | None = None     # the CA that signs every peer's certificate

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def any(self) -> bool:
        return bool(self.token) or self.tls

    def __post_init__(self) -> None:
        given = [self.tls_cert, self.tls_key, self.tls_ca]
        if any(given) and not all(given):
            raise ConfigError("mutual TLS needs --tls-cert, --tls-key and --tls-ca together")

    @classmethod
    def from_files(cls, token_file: str | None, cert: str | None, key: str | None,
                   ca: str | None) -> Credentials:
        token = Path(token_file).read_text().strip() if token_file else None
        if token_file and not token:
            raise ConfigError(f"token file {token_file} is empty")
        return cls(token, Path(cert) if cert else None, Path(key) if key else None,
                   Path(ca) if ca else None)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        assert self.tls_cert and self.tls_key and self.tls_ca
        return grpc.ssl_server_credentials(
            [(self.tls_key.read_bytes(), self.tls_cert.read_bytes())],
            root_certificates=self.tls_ca.read_bytes(), require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        assert self.tls_cert and self.tls_key and self.tls_ca
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca.read_bytes(),
            private_key=self.tls_key.read_bytes(),
            certificate_chain=self.tls_cert.read_bytes())

    def call_metadata(self) -> list[tuple[str, str]]:
        return [(TOKEN_HEADER, self.token)] if self.token else []


def is_loopback(listen: str) -> bool:
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen_address(listen: str, creds: Credentials) -> None:
    if not creds.any and not is_loopback(listen):
        raise ConfigError(f"refusing to serve {listen} without credentials: give --token-file "
                          "or --tls-cert/--tls-key/--tls-ca, or listen on 127.0.0.1")


class TokenInterceptor(grpc.ServerInterceptor):
    """Rejects calls that do not carry the shared token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong replicator token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        method = getattr(details, "method", "")
        if method in OPEN_METHODS:
            return continuation(details)
        md = dict(getattr(details, "invocation_metadata", ()) or ())
        given = md.get(TOKEN_HEADER, "")
        given_b = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_b, self._token):
            return continuation(details)
        return self._deny_stream if method.endswith("/Push") else self._deny_unary
