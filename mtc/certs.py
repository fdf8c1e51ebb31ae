"""``mtc certs``: the files mutual TLS between replicators, sidecars and the controller
needs, outside Kubernetes (where cert-manager issues them, docs/deploy.md).

In ``--out``: a CA of the job's own (``ca.crt``, ``ca.key``), one certificate per
replicator rank (``rank-<r>.crt``, ``rank-<r>.key``) naming ``mtc-rank-<r>`` as a
DNS subject alternative name (the name a replicator must bear for its rank,
:mod:`mtc.rank_names`) and the addresses the host is dialled
at, and the controller's (``controller.crt``, ``controller.key``), which names the
controller's role, the DNS name ``mtc-controller``
(:data:`~mtc.rank_names.CONTROLLER_NAME`), and no rank; its
subject is ``--controller-name`` (default ``mtc-controller``: only the DNS name
is read). Keys are ECDSA P-256, written readable by their owner only; nothing is
overwritten. Every certificate allows both TLS server and client use.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509  # google-auth's dependency, always installed
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from mtc.errors import ConfigError
from mtc.rank_names import CONTROLLER_NAME, rank_name, ranks_named

LOOPBACK = ("localhost", "127.0.0.1")
CLOCK_SKEW = datetime.timedelta(minutes=5)  # valid a little before now: hosts' clocks differ

Key = ec.EllipticCurvePrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, key: Key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=days)))


def make_ca(name: str, days: int) -> tuple[Key, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(name, _name(name), key, days)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def san(names: Sequence[str]) -> list[x509.GeneralName]:
    """Each name as an IP address where it is one, else a DNS name (in order, once)."""
    out: list[x509.GeneralName] = []
    for n in dict.fromkeys(names):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def make_leaf(ca: tuple[Key, x509.Certificate], subject: str, names: Sequence[str],
              days: int) -> tuple[Key, x509.Certificate]:
    """A certificate of ``ca`` for ``subject``, valid for ``names`` (DNS names or IP
    addresses), for TLS servers and clients."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (_builder(subject, ca_cert.subject, key, days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(san(names)), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return key, cert


def rank_names(rank: int, host: str | None) -> list[str]:
    """What rank ``rank``'s certificate names: its rank, the address its host is
    dialled at (when known) and loopback (a controller on the same host)."""
    return [rank_name(rank), *([host] if host else []), *LOOPBACK]


def check_controller_name(name: str) -> None:
    """The controller's subject must not read as a rank (only its DNS names are
    read today, but a name that says rank 3 would mislead whoever reads it)."""
    if not name or ranks_named([name]):
        raise ConfigError(f"--controller-name {name!r} names a replicator rank: the "
                          "controller's certificate must name none")


def check_hosts(hosts: Sequence[str]) -> None:
    """A host's address must name no identity: a host named ``mtc-controller`` or
    ``mtc-rank-<r>`` would give its rank's certificate the controller's role, or a
    second rank (a certificate naming two identities is nobody's: it fails closed,
    but only once a replicator refuses it). DNS names compare without case."""
    for h in hosts:
        low = h.lower()
        if low == CONTROLLER_NAME or ranks_named([low]):
            raise ConfigError(f"--hosts {h!r} names an identity ({CONTROLLER_NAME} or "
                              "mtc-rank-<r>), not a host's address")
    if len({h.lower() for h in hosts}) != len(hosts):
        raise ConfigError("--hosts names one address twice: each rank's host is its own")


def _write(path: Path, data: bytes, mode: int) -> None:
    # O_NOFOLLOW with O_EXCL: a link planted in the folder is never written through.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _write_pair(out: Path, stem: str, key: Key, cert: x509.Certificate) -> list[Path]:
    crt, pem = out / f"{stem}.crt", out / f"{stem}.key"
    _write(crt, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    _write(pem, key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()), 0o600)
    return [crt, pem]


def issue(out: Path, ranks: int, *, hosts: Sequence[str] = (),
          controller_name: str = CONTROLLER_NAME, days: int = 365,
          ca_name: str = "mtc-ca") -> list[Path]:
    """Write the CA, ``ranks`` rank certificates and the controller's into ``out``
    (made if missing; an existing file is never replaced: a ConfigError before
    anything is written). ``hosts``: the address each rank is dialled at, in rank
    order (empty: loopback only). Returns the files written."""
    if ranks < 1:
        raise ConfigError(f"--ranks {ranks}: at least one replicator")
    if hosts and len(hosts) != ranks:
        raise ConfigError(f"--hosts names {len(hosts)} addresses for {ranks} ranks")
    if days < 1:
        raise ConfigError(f"--days {days}: at least one day")
    check_controller_name(controller_name)
    check_hosts(hosts)
    stems = ["ca", *(f"rank-{r}" for r in range(ranks)), "controller"]
    if out.is_symlink():
        raise ConfigError(f"{out} is a symbolic link: mtc certs writes keys into a real "
                          "folder only")
    if not out.exists():
        out.mkdir(parents=True)
        # Whatever the umask (000 left it 0777): the CA's key is written here.
        os.chmod(out, 0o755)
    # Before anything is written: a name taken (a link planted, even one leading
    # nowhere, counts) stops it with nothing written, never half a set.
    there = [p for s in stems for p in (out / f"{s}.crt", out / f"{s}.key")
             if os.path.lexists(p)]
    if there:
        raise ConfigError(f"{there[0]} exists: mtc certs never replaces a file (a new CA "
                          "needs every certificate again)")
    ca = make_ca(ca_name, days)
    written = _write_pair(out, "ca", *ca)
    for r in range(ranks):
        written += _write_pair(out, f"rank-{r}",
                               *make_leaf(ca, rank_name(r),
                                          rank_names(r, hosts[r] if hosts else None), days))
    written += _write_pair(out, "controller",
                           *make_leaf(ca, controller_name, [CONTROLLER_NAME], days))
    return written
