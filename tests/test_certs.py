"""``mtc certs``: the CA and certificates it writes, and a replicator cluster running
over mutual TLS with them, reached by ``mtc status`` and ``mtc backup`` with the
controller's certificate."""

from __future__ import annotations

import datetime
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from replicators import Cluster, env_with_repo, new_cluster

from mtc import certs
from mtc.credentials import Credentials
from mtc.errors import ConfigError
from mtc.rank_names import CONTROLLER, identity_of, ranks_named


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _names(cert: x509.Certificate) -> list[str]:
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [*ext.get_values_for_type(x509.DNSName),
            *(str(a) for a in ext.get_values_for_type(x509.IPAddress))]


def test_each_rank_is_named_and_the_controller_is_none(tmp_path: Path) -> None:
    files = certs.issue(tmp_path, 3, hosts=["10.0.0.5", "host-1.example", "10.0.0.7"],
                        controller_name="job-7-controller")
    assert sorted(p.name for p in files) == sorted(
        f"{s}.{x}" for s in ("ca", "rank-0", "rank-1", "rank-2", "controller")
        for x in ("crt", "key"))
    ca = _load(tmp_path / "ca.crt")
    for r, host in enumerate(["10.0.0.5", "host-1.example", "10.0.0.7"]):
        leaf = _load(tmp_path / f"rank-{r}.crt")
        leaf.verify_directly_issued_by(ca)
        assert ranks_named(_names(leaf)) == {r}
        assert host in _names(leaf) and "127.0.0.1" in _names(leaf)
    controller = _load(tmp_path / "controller.crt")
    controller.verify_directly_issued_by(ca)
    # The controller's role, whatever its subject; and each rank's certificate is that rank.
    assert identity_of(_names(controller)) == CONTROLLER
    assert controller.subject.rfc4514_string() == "CN=job-7-controller"
    for r in range(3):
        assert identity_of(_names(_load(tmp_path / f"rank-{r}.crt"))) == r
    for p in files:  # private keys are their owner's alone
        mode = stat.S_IMODE(p.stat().st_mode)
        assert (mode & 0o077 == 0) if p.suffix == ".key" else mode == 0o644, (p, oct(mode))
    # A replicator started with rank 1's certificate takes itself for rank 1 only.
    creds = Credentials(tls_cert=tmp_path / "rank-1.crt", tls_key=tmp_path / "rank-1.key",
                        tls_ca=tmp_path / "ca.crt")
    creds.check_names_rank(1)
    with pytest.raises(ConfigError, match="names rank"):
        creds.check_names_rank(0)


@pytest.mark.parametrize(("kw", "match"), [
    ({"ranks": 0}, "at least one replicator"),
    ({"ranks": 2, "hosts": ["a"]}, "1 addresses for 2 ranks"),
    ({"ranks": 2, "controller_name": "mtc-rank-1"}, "names a replicator rank"),
    ({"ranks": 2, "days": 0}, "at least one day"),
    # A host named as an identity would give its rank's certificate a second one.
    ({"ranks": 2, "hosts": ["mtc-controller", "10.0.0.2"]}, "names an identity"),
    ({"ranks": 2, "hosts": ["10.0.0.1", "mtc-rank-0"]}, "names an identity"),
    ({"ranks": 2, "hosts": ["MTC-Rank-1", "10.0.0.2"]}, "names an identity"),
    ({"ranks": 2, "hosts": ["h.example", "H.example"]}, "one address twice"),
])
def test_refused(tmp_path: Path, kw: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        certs.issue(tmp_path / "out", **kw)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_nothing_is_replaced(tmp_path: Path) -> None:
    certs.issue(tmp_path, 1)
    before = (tmp_path / "ca.key").read_bytes()
    with pytest.raises(ConfigError, match="never replaces"):
        certs.issue(tmp_path, 2)
    assert (tmp_path / "ca.key").read_bytes() == before
    assert not (tmp_path / "rank-1.crt").exists()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtc.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env_with_repo())


@pytest.mark.process
def test_a_cluster_runs_on_them_and_the_cli_reaches_it(ramdisk: Path,
                                                       clusters: list[Cluster]) -> None:
    pki = ramdisk / "pki"
    r = _cli("certs", "--out", str(pki), "--ranks", "2")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 8
    tls = ("--tls-cert", str(pki / "controller.crt"), "--tls-key", str(pki / "controller.key"),
           "--tls-ca", str(pki / "ca.crt"))
    bucket = ramdisk / "bucket"
    cl = new_cluster(clusters, ramdisk / "job", 2, 1,
                     creds=Credentials(tls_cert=pki / "controller.crt",
                                       tls_key=pki / "controller.key", tls_ca=pki / "ca.crt"),
                     extra=("--tls-ca", str(pki / "ca.crt"), "--backup", f"file://{bucket}"),
                     rank_args={r: ("--tls-cert", str(pki / f"rank-{r}.crt"),
                                    "--tls-key", str(pki / f"rank-{r}.key")) for r in (0, 1)})
    cl.start_all()
    cl.commit(0, 3, {"a.bin": os.urandom(4096)})
    cl.commit(1, 3, {"b.bin": os.urandom(4096)})
    cl.wait_replicated(3, timeout=30)  # the peers took each other's certificates

    nodes = ",".join(cl.addrs)
    r = _cli("status", "--nodes", nodes, "--json", *tls)
    assert r.returncode == 0, r.stdout + r.stderr
    hosts = json.loads(r.stdout)["hosts"]
    assert [(h["up"], h["local"], h["peer_copies"]) for h in hosts] == [
        (True, [3], {"1": [3]}), (True, [3], {"0": [3]})]
    r = _cli("backup", "--node", cl.addrs[1], *tls)
    assert (r.returncode, r.stdout.strip()) == (0, "backed up step 3"), r.stderr
    # Without the controller's certificate the CLI reaches nobody.
    r = _cli("status", "--nodes", nodes, "--json")
    assert r.returncode == 1
    assert not any(h["up"] for h in json.loads(r.stdout)["hosts"])
    # ... and says why: they are up, and require a certificate (not "down").
    assert all("requires mutual TLS and no certificate was given" in h["refused"]
               for h in json.loads(r.stdout)["hosts"]), r.stdout


def test_the_folder_is_not_left_open_whatever_the_umask(tmp_path: Path) -> None:
    """Under umask 000 the folder holding the CA's key was left 0777."""
    old = os.umask(0)
    try:
        certs.issue(tmp_path / "out", 1)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "out" / "ca.key").stat().st_mode) == 0o600


def test_a_planted_link_stops_it_before_anything_is_written(tmp_path: Path) -> None:
    """A link planted where a key goes (even one leading nowhere, which ``exists``
    does not see) stopped ``mtc certs`` half-way, leaving a partial set; now it is
    found before anything is written, and nothing is written through it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank-1.key").symlink_to(tmp_path / "elsewhere.key")
    with pytest.raises(ConfigError, match="exists"):
        certs.issue(out, 2)
    assert sorted(p.name for p in out.iterdir()) == ["rank-1.key"]
    assert not (tmp_path / "elsewhere.key").exists()
    link = tmp_path / "linked"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        certs.issue(link, 1)
    assert not (tmp_path / "real").exists()


@pytest.mark.process
def test_a_replicator_with_its_own_certificate_expired_does_not_start(
        tmp_path: Path) -> None:
    """A replicator started with its own certificate expired ran without a word (every
    peer refused it). Now it refuses to start, naming the certificate and when it
    expired; a token without mutual TLS is warned about at start."""
    from replicator_certs import make_ca, make_leaf, write_pem

    from mtc.ports import free_ports

    ca = make_ca("expiry CA")
    ca_pem = write_pem(ca[1], tmp_path / "ca.crt")
    crt, key = make_leaf(ca, "node0", tmp_path, ranks=[0], expired=True)
    ports = free_ports(2)
    base = [sys.executable, "-m", "mtc.sidecar.replicator.main", "--listen",
            f"127.0.0.1:{ports[0]}", "--nodes", f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
            "--rank", "0"]
    r = subprocess.run([*base, "--local-dir", str(tmp_path / "root"), "--tls-cert", str(crt),
                        "--tls-key", str(key), "--tls-ca", str(ca_pem)],
                       capture_output=True, text=True, timeout=60, env=env_with_repo())
    assert r.returncode == 2 and "expired at" in r.stderr and str(crt) in r.stderr, r.stderr
    creds = Credentials(tls_cert=crt, tls_key=key, tls_ca=ca_pem)
    leaf = _load(crt)
    assert creds.check_valid_now(leaf.not_valid_before_utc + datetime.timedelta(minutes=1)) == ""
    assert "expires at" in creds.check_valid_now(leaf.not_valid_after_utc
                                                 - datetime.timedelta(hours=1))
    assert "not valid before" in creds.check_valid_now(leaf.not_valid_before_utc
                                                       - datetime.timedelta(hours=1))


@pytest.mark.process
def test_a_replicator_on_a_token_alone_says_it_is_unprotected(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    token = ramdisk / "token"
    token.write_text("a-token\n")
    cl = new_cluster(clusters, ramdisk / "hosts", 2, 1, creds=Credentials(token="a-token"),
                     extra=("--token-file", str(token)))
    cl.start(0)
    assert "without mutual TLS" in cl.log_text(0) and "forged" not in cl.log_text(0)
