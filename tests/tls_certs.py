"""Certificates for tests: a CA and leaves for mutual TLS, written as a Secret volume is.

The kubelet mounts a Secret as a folder whose files are symlinks through ``..data``,
itself a symlink to a timestamped folder; an update writes a new timestamped folder
and swaps ``..data`` with one rename. :func:`mount_secret` does the same, so a
rotation in a test looks to the reader as one on a node does.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import uuid
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mtc.credentials import Credentials

Pem = bytes


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(cn: str) -> tuple[Pem, ec.EllipticCurvePrivateKey]:
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), key


def issue(ca: tuple[Pem, ec.EllipticCurvePrivateKey], cn: str,
          dns: tuple[str, ...] = ("localhost",),
          ips: tuple[str, ...] = ("127.0.0.1",)) -> dict[str, Pem]:
    """``tls.crt``, ``tls.key`` and ``ca.crt`` of a leaf for server and client use."""
    ca_pem, ca_key = ca
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder().subject_name(_name(cn))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return {"tls.crt": cert.public_bytes(serialization.Encoding.PEM),
            "tls.key": key.private_bytes(serialization.Encoding.PEM,
                                         serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()),
            "ca.crt": ca_pem}


def mount_secret(folder: Path, files: dict[str, bytes]) -> Path:
    """Write (or update) ``folder`` as the kubelet writes a Secret volume."""
    folder.mkdir(parents=True, exist_ok=True)
    version = folder / f"..{uuid.uuid4().hex[:12]}"
    version.mkdir()
    for name, data in files.items():
        (version / name).write_bytes(data)
    tmp = folder / "..data_tmp"
    os.symlink(version.name, tmp)
    os.replace(tmp, folder / "..data")      # the swap: every file changes at once
    for name in files:
        link = folder / name
        if not link.is_symlink():
            os.symlink(f"..data/{name}", link)
    return folder


@contextmanager
def health_server(creds: Credentials, service: str = ""
                  ) -> Iterator[tuple[int, health.HealthServicer]]:
    """A gRPC health service behind mutual TLS with ``creds`` on a loopback port,
    ``service`` SERVING: its port and servicer, stopped on exit."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    sc = creds.server_credentials()
    assert sc is not None
    port = server.add_secure_port("127.0.0.1:0", sc)
    server.start()
    try:
        yield port, servicer
    finally:
        server.stop(grace=None)
