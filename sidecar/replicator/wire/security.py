"""Peer authentication: mutual TLS from certificate files, a shared token, or both.

Without credentials a replicator (and a host's sidecar) serves loopback addresses
only. With mutual TLS each host's certificate names its replicator rank: a DNS
subject alternative name ``mtc-rank-<r>`` (:func:`rank_name`) or its JobSet pod's
name (:mod:`~mtc.sidecar.replicator.wire.rank_names`, the one place that maps names to
ranks). A server acts for
a caller only as the rank its certificate names (a copy's origin, a ``Decide``'s
rank); the controller's certificate (naming the role ``mtc-controller`` and no
rank) may read and ask for restores, never act as a peer; a certificate of the CA
naming neither is nobody's, refused at every call (:class:`IdentityGate`, which
also keeps a sidecar to its own host and the controller); and a replicator
reaching peer ``r`` accepts only
a server whose certificate names ``r``. A shared token names nobody: its holder
may act as any rank (docs/security.md).

Certificate files are read again when they change, so that a rotation (cert-manager
renews the Secret, the kubelet swaps the mounted files) needs no restart: a server
hands gRPC the current files on every new connection (:meth:`Credentials.server_credentials`),
and a client makes a new channel once it sees them change (:class:`TlsWatch`).
Connections already open keep the certificates they were made with.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from mtc.errors import ConfigError, UnauthorizedError

# rank_name and ranks_named are re-exported: callers name ranks through this module.
from mtc.sidecar.replicator.wire.rank_names import pod_names
from mtc.sidecar.replicator.wire.rank_names import rank_name as rank_name
from mtc.sidecar.replicator.wire.rank_names import ranks_named as ranks_named

log = logging.getLogger(__name__)
CERT_CHECK_S = 1.0  # how often a client looks at the certificate files (one stat each)
# The three files as one version: (inode, size, mtime) of each. The kubelet replaces a
# Secret's files by swapping a symlink, so all three change together.
Stamp = tuple[tuple[int, int, int], ...]

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

    def _tls_paths(self) -> tuple[Path, Path, Path]:
        assert self.tls_cert and self.tls_key and self.tls_ca
        return self.tls_cert, self.tls_key, self.tls_ca

    def tls_stamp(self) -> Stamp | None:
        """The version of the certificate files on disk (None without TLS)."""
        if not self.tls:
            return None
        out = []
        for p in self._tls_paths():
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def read_tls(self) -> tuple[Stamp, bytes, bytes, bytes]:
        """(version, certificate chain, key, CA) read as one version: files that
        change while they are read (a rotation under way) are read again."""
        cert, key, ca = self._tls_paths()
        for _ in range(5):
            before = self.tls_stamp()
            data = cert.read_bytes(), key.read_bytes(), ca.read_bytes()
            after = self.tls_stamp()
            if before == after and after is not None:
                if not all(b"-----BEGIN" in d for d in data):
                    raise ConfigError(f"{cert}, {key} or {ca} holds no PEM block")
                return (after, *data)
            time.sleep(0.05)
        raise ConfigError(f"{cert}, {key} and {ca} kept changing while read")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """Mutual TLS from the certificate files as they are when each connection
        starts (see the module's doc); None without TLS."""
        if not self.tls:
            return None
        certs = ServerCertificates(self)
        return grpc.dynamic_ssl_server_credentials(
            certs.initial, certs.fetch, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials from the certificate files as they are now; a channel
        keeps them (make a new channel when :class:`TlsWatch` says they changed)."""
        if not self.tls:
            return None
        _, cert, key, ca = self.read_tls()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def call_metadata(self) -> list[tuple[str, str]]:
        return [(TOKEN_HEADER, self.token)] if self.token else []

    def own_ranks(self) -> set[int]:
        """The ranks this process's certificate names (none without TLS)."""
        if not self.tls:
            return set()
        assert self.tls_cert is not None
        from cryptography import x509  # google-auth's dependency, always installed

        try:
            cert = x509.load_pem_x509_certificate(self.tls_cert.read_bytes())
            names = cert.extensions.get_extension_for_class(
                x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            names = []
        except ValueError as e:
            raise ConfigError(f"unreadable certificate {self.tls_cert}: {e}") from e
        return ranks_named(names)

    def check_names_rank(self, rank: int) -> None:
        """With mutual TLS, this replicator's certificate must name its rank and no
        other: peers accept its copies and its answers only as that rank's."""
        if not self.tls:
            return
        named = self.own_ranks()
        if named != {rank}:
            pods = pod_names()
            raise ConfigError(
                f"certificate {self.tls_cert} names rank(s) {sorted(named) or 'none'}, this "
                f"replicator is rank {rank}: give each host a certificate with the DNS name "
                f"{rank_name(rank)}"
                + (f" or its pod's name ({pods.prefix}<slice>-<host>-xxxxx, "
                   f"{pods.hosts_per_slice} hosts per slice)" if pods else
                   ", or read pod names as ranks (--tls-pod-prefix, --tls-hosts-per-slice)")
                + " (docs/security.md)")


# The DNS name that makes a certificate the controller's: a role the certificate
# names, as a host's names its rank (docs/deploy.md says how it is issued). A
# certificate of the CA that names neither is nobody's.
CONTROLLER_NAME = "mtc-controller"
CONTROLLER = "controller"
# Who a certificate is: a rank, CONTROLLER, or None (nobody).
Who = int | str | None


def identity_of(names: Iterable[str | bytes]) -> Who:
    """Who a certificate with these DNS names is: the one rank it names, the
    controller (it names ``CONTROLLER_NAME`` and no rank), or None: it names
    neither, several ranks, or a rank and the controller (one certificate is one
    identity)."""
    texts = [n.decode("ascii", errors="replace") if isinstance(n, bytes) else n
             for n in names]
    ranks = ranks_named(texts)
    controller = CONTROLLER_NAME in texts
    if controller and not ranks:
        return CONTROLLER
    if len(ranks) == 1 and not controller:
        return next(iter(ranks))
    return None


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


def describe(who: Who) -> str:
    return (f"rank {who}" if isinstance(who, int) else "the controller" if who else
            "no rank and not the controller")


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


class ServerCertificates:
    """A server's certificate configuration, read again when the files change: gRPC
    asks :meth:`fetch` before every new connection's handshake (on its own threads)."""

    def __init__(self, creds: Credentials) -> None:
        self._creds = creds
        self._lock = threading.Lock()
        self._stamp, config = self._read()
        self._refused: Stamp | None = None  # files found bad: not read again, nor logged
        self.initial = config
        self.reloads = 0

    def _read(self) -> tuple[Stamp, grpc.ServerCertificateConfiguration]:
        stamp, cert, key, ca = self._creds.read_tls()
        return stamp, grpc.ssl_server_certificate_configuration([(key, cert)],
                                                                root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """The new configuration when the files changed since the last one, else None
        (gRPC keeps the current one). Never raises: a file missing or unreadable
        mid-rotation leaves the current certificates in use, and is tried again at
        the next connection."""
        try:
            with self._lock:
                now = self._creds.tls_stamp()
                if now in (self._stamp, self._refused):
                    return None
                try:
                    stamp, config = self._read()
                except ConfigError:
                    self._refused = now
                    raise
                self._stamp = stamp
                self.reloads += 1
            log.info("TLS certificate files changed (%s): new connections use them",
                     self._creds.tls_cert)
            return config
        except (OSError, ConfigError) as e:
            log.warning("TLS certificate files not reloaded, the current ones stay: %s", e)
            return None


class TlsWatch:
    """A client's channel credentials, made again when its certificate files change
    (looked at with one ``stat`` per file, at most every :data:`CERT_CHECK_S`
    seconds). Thread-safe."""

    def __init__(self, creds: Credentials, *, check_s: float = CERT_CHECK_S) -> None:
        self._creds = creds
        self._check_s = check_s
        self._lock = threading.Lock()
        self._stamp: Stamp | None = None
        self._refused: Stamp | None = None  # files found bad: not read again, nor logged
        self.credentials: grpc.ChannelCredentials | None = None
        if creds.tls:
            self._stamp, cert, key, ca = creds.read_tls()
            self.credentials = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert)
        self._next = time.monotonic() + check_s

    def renewed(self) -> grpc.ChannelCredentials | None:
        """New credentials when the files changed since :attr:`credentials` were made
        (they become :attr:`credentials`), else None. Files unreadable mid-rotation
        leave the current credentials, and are looked at again later."""
        if not self._creds.tls:
            return None
        now = time.monotonic()
        with self._lock:
            if now < self._next:
                return None
            self._next = now + self._check_s
            try:
                current = self._creds.tls_stamp()
                if current in (self._stamp, self._refused):
                    return None
                try:
                    stamp, cert, key, ca = self._creds.read_tls()
                except ConfigError:
                    self._refused = current
                    raise
            except (OSError, ConfigError) as e:
                log.warning("TLS certificate files not reloaded, the current ones stay: %s",
                            e)
                return None
            self._stamp = stamp
            self.credentials = grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=key, certificate_chain=cert)
            return self.credentials


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
