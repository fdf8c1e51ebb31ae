"""A process's credentials between mtc's processes: mutual TLS from certificate
files, a shared token, or both; shared by the replicators, the hosts' sidecars and
the controller, which reach each other with them (who may call what is the servers'
check: :mod:`mtc.sidecar.replicator.wire.security`).

Certificate files are read again when they change, so that a rotation (cert-manager
renews the Secret, the kubelet swaps the mounted files) needs no restart: a server
hands gRPC the current files on every new connection (:meth:`Credentials.server_credentials`),
and a client makes a new channel once it sees them change (:class:`TlsWatch`).
Connections already open keep the certificates they were made with.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import time
from pathlib import Path

import grpc

from mtc.errors import ConfigError
from mtc.rank_names import identity_of, pod_names, rank_name, ranks_named

log = logging.getLogger(__name__)
CERT_CHECK_S = 1.0  # how often a client looks at the certificate files (one stat each)
# The three files as one version: (inode, size, mtime) of each. The kubelet replaces a
# Secret's files by swapping a symlink, so all three change together.
Stamp = tuple[tuple[int, int, int], ...]

TOKEN_HEADER = "x-mtc-token"


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

    def check_files(self) -> None:
        """A ConfigError naming the flag and file when the TLS files are not a
        certificate, its own key and a CA (a command's flags, checked before any
        call: gRPC would otherwise fail every call alike, as if every node were down,
        and ``ssl`` names no file)."""
        if not self.tls:
            return
        import ssl

        cert, key, ca = self._tls_paths()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_verify_locations(cafile=str(ca))
        except ssl.SSLError as e:
            raise ConfigError(f"--tls-ca {ca}: not a CA certificate (PEM): "
                              f"{e.reason or e}") from e
        try:
            ctx.load_cert_chain(str(cert), str(key))
        except ssl.SSLError as e:
            raise ConfigError(f"--tls-cert {cert} and --tls-key {key} are not a certificate "
                              f"and its key: {e.reason or e}") from e

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

    def own_names(self) -> list[str]:
        """The DNS names this process's certificate bears (none without TLS)."""
        if not self.tls:
            return []
        assert self.tls_cert is not None
        from cryptography import x509  # google-auth's dependency, always installed

        try:
            cert = x509.load_pem_x509_certificate(self.tls_cert.read_bytes())
            names: list[str] = cert.extensions.get_extension_for_class(
                x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
        except x509.ExtensionNotFound:
            names = []
        except ValueError as e:
            raise ConfigError(f"unreadable certificate {self.tls_cert}: {e}") from e
        return names

    def own_ranks(self) -> set[int]:
        """The ranks this process's certificate names (none without TLS)."""
        return ranks_named(self.own_names())

    def check_valid_now(self, now: datetime.datetime | None = None) -> str:
        """With mutual TLS: a :class:`ConfigError` when this process's own certificate
        has expired (every peer refuses it: a process that starts with it serves
        nobody, silently); a warning's text when it is not valid yet or expires
        within six hours; "" otherwise."""
        if not self.tls:
            return ""
        assert self.tls_cert is not None
        from cryptography import x509

        try:
            cert = x509.load_pem_x509_certificate(self.tls_cert.read_bytes())
        except (OSError, ValueError) as e:
            raise ConfigError(f"unreadable certificate {self.tls_cert}: {e}") from e
        now = now or datetime.datetime.now(datetime.UTC)
        after, before = cert.not_valid_after_utc, cert.not_valid_before_utc
        if now > after:
            raise ConfigError(f"certificate {self.tls_cert} expired at {after:%Y-%m-%d %H:%M} "
                              "UTC: every peer refuses it; issue a new one (docs/security.md)")
        if now < before:
            return (f"certificate {self.tls_cert} is not valid before "
                    f"{before:%Y-%m-%d %H:%M} UTC (this host's clock, or the CA's?)")
        if after - now < datetime.timedelta(hours=6):
            return f"certificate {self.tls_cert} expires at {after:%Y-%m-%d %H:%M} UTC"
        return ""

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


def names_read_here(creds: Credentials | None) -> bool:
    """Whether, under mutual TLS, this process reads whom its own certificate names
    (a rank or the controller's role): then it reads its peers' names too. A pod's
    certificate names its pod, a rank only where the job's pod names were given
    (:func:`~mtc.rank_names.use_pod_names`, a replicator's flags)."""
    if creds is None or not creds.tls:
        return False
    try:
        return identity_of(creds.own_names()) is not None
    except (OSError, ConfigError):
        return False
