"""Peer authentication: who may call a replicator or a host's sidecar, checked on
every call, with the credentials of :mod:`mtc.credentials` (mutual TLS, a shared
token, or both).

Without credentials a replicator (and a host's sidecar) serves loopback addresses
only. With mutual TLS each host's certificate names its replicator rank: a DNS
subject alternative name ``mtc-rank-<r>`` or its JobSet pod's name
(:mod:`mtc.rank_names`, the one place that maps names to ranks). A server acts for
a caller only as the rank its certificate names (a copy's origin, a ``Decide``'s
rank); the controller's certificate (naming the role ``mtc-controller`` and no
rank) may read and ask for restores, never act as a peer; a certificate of the CA
naming neither is nobody's, refused at every call (:class:`IdentityGate`, which
also keeps a sidecar to its own host and the controller); and a replicator
reaching peer ``r`` accepts only
a server whose certificate names ``r``. A shared token names nobody: its holder
may act as any rank (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
from collections.abc import Callable
from typing import Any

import grpc

from mtc.credentials import TOKEN_HEADER, Credentials
from mtc.errors import ConfigError, UnauthorizedError
from mtc.rank_names import Who, describe, identity_of

# Unauthenticated on purpose: Kubernetes probes carry no credentials.
OPEN_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


def caller_identity(context: Any) -> Who:
    """Who the caller's certificate is (:func:`identity_of`); None without TLS."""
    try:
        auth = context.auth_context() or {}
    except (AttributeError, ValueError):
        return None
    return identity_of(auth.get("peer_dns", ()))


def caller_rank(context: grpc.ServicerContext) -> int | None:
    """The one rank the caller's certificate names; None when it names none, several,
    the controller, or the call came without TLS."""
    who = caller_identity(context)
    return who if isinstance(who, int) else None


class IdentityGate(grpc.ServerInterceptor):
    """With mutual TLS: every call but health's from a caller whose certificate is
    not one ``allow`` admits (:func:`identity_of`) is refused PERMISSION_DENIED
    before its handler runs. Whom a handler then acts for is its own check
    (:class:`Identity`)."""

    def __init__(self, allow: Callable[[Who], bool], where: str) -> None:
        self._allow = allow
        self._where = where

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        h = continuation(details)
        if h is None or getattr(details, "method", "") in OPEN_METHODS:
            return h  # health: untouched (Watch keeps its non-blocking mark)

        def guard(behavior: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
            def checked(request: Any, context: Any) -> Any:
                who = caller_identity(context)
                if not self._allow(who):
                    context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                  f"{self._where} takes no call from a certificate of "
                                  f"{describe(who)}")
                return behavior(request, context)
            return checked

        kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        return h._replace(**{k: guard(getattr(h, k)) for k in kinds
                             if getattr(h, k) is not None})


@dataclasses.dataclass(frozen=True)
class Identity:
    """Who a server lets act for which rank: with mutual TLS (``tls``), only the rank
    the caller's certificate names; with a token alone, anyone holding it."""

    tls: bool

    def require(self, context: grpc.ServicerContext, rank: int, what: str) -> None:
        """Refuse (:class:`UnauthorizedError`) a caller acting for ``rank`` unless it is."""
        if not self.tls:
            return
        got = caller_rank(context)
        if got != rank:
            raise UnauthorizedError(f"{what} for rank {rank} from a caller whose certificate "
                                    f"names {'rank ' + str(got) if got is not None else 'no rank'}")

    def require_peer(self, context: grpc.ServicerContext, what: str) -> int | None:
        """The caller's rank; with TLS, refuse one whose certificate names none."""
        got = caller_rank(context)
        if self.tls and got is None:
            raise UnauthorizedError(f"{what}: only a peer replicator may call (its certificate "
                                    f"names no rank)")
        return got


def is_loopback(listen: str) -> bool:
    """Whether ``listen`` is reachable only from this machine (loopback, a unix socket)."""
    if listen.startswith("unix:") or listen.startswith("unix-abstract:"):
        return True
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
