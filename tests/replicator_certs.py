"""Certificates for replicators over mutual TLS, as the files their flags name
(``--tls-cert``, ``--tls-key``, ``--tls-ca``): a CA, leaves for loopback that
name replicator ranks (``mtc-rank-<r>``, as each host's must name its own), and a
cluster of replicators using them. (``tls_certs.py`` makes the PEM bytes of a
Kubernetes Secret volume, for the sidecars' and the deployment's tests.)"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from replicators import Cluster, new_cluster

from mtc import certs
from mtc.credentials import Credentials
from mtc.rank_names import CONTROLLER_NAME, rank_name


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A CA for one test run (a day's validity), as ``mtc certs`` makes one."""
    return certs.make_ca(cn, days=1)


def make_leaf(ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], cn: str,
              out: Path, *, ranks: Sequence[int] = (), controller: bool = False,
              expired: bool = False) -> tuple[Path, Path]:
    """A certificate of ``ca`` for loopback; with ``ranks``, naming those replicator
    ranks (``mtc-rank-<r>``), as each host's must name its own; with ``controller``,
    naming the controller's role (``mtc-controller``). Naming neither, it is
    nobody's (a stranger's certificate from the cluster's CA). ``expired``: valid
    until a minute ago."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC) - (datetime.timedelta(days=1, minutes=1)
                                                 if expired else datetime.timedelta(0))
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), *(x509.DNSName(rank_name(r)) for r in ranks),
                *([x509.DNSName(CONTROLLER_NAME)] if controller else []),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    cert_path, key_path = out / f"{cn}.crt", out / f"{cn}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def write_pem(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def tls_cluster(clusters: list[Cluster], base: Path,
                ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], ca_pem: Path,
                pki: Path, client_crt: Path, client_key: Path, n: int = 2,
                **kw: Any) -> Cluster:
    """``n`` replicators over mutual TLS, each with a certificate naming its rank
    (``node<r>.crt`` in ``pki``); the harness calls them with ``client_crt`` (the
    controller's). ``kw``: more of :class:`Cluster`'s fields."""
    certs = {r: make_leaf(ca, f"node{r}", pki, ranks=[r]) for r in range(n)}
    return new_cluster(clusters, base, n, 1,
                       creds=Credentials(tls_cert=client_crt, tls_key=client_key,
                                         tls_ca=ca_pem),
                       extra=("--tls-ca", str(ca_pem), *kw.pop("extra", ())),
                       rank_args={r: ("--tls-cert", str(c), "--tls-key", str(k))
                                  for r, (c, k) in certs.items()}, **kw)
