"""``mtc status`` tells a node that refuses its certificate from a node that is down
(issue 68, item 7): no certificate where the node requires mutual TLS, or one of
another CA, is said as such; nothing listening is still DOWN; a rank wiped before
its steps reached a peer is not "up to date". And ``mtc backup`` takes status's
``--nodes`` (item 8). A node in-process (a gRPC server behind mutual TLS on
loopback), or none: no process is started."""

from __future__ import annotations

from pathlib import Path

import pytest
from tls_certs import health_server

from mtc import certs, cli
from mtc.cli import main
from mtc.credentials import Credentials
from mtc.ports import free_ports


def tls_flags(folder: Path) -> list[str]:
    return ["--tls-cert", str(folder / "controller.crt"), "--tls-key",
            str(folder / "controller.key"), "--tls-ca", str(folder / "ca.crt")]


def test_status_says_a_certificate_it_cannot_use_not_every_node_down(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    certs.issue(tmp_path / "job", 1)
    certs.issue(tmp_path / "foreign", 1, ca_name="another-ca")
    job = tmp_path / "job"
    node = Credentials(None, job / "rank-0.crt", job / "rank-0.key", job / "ca.crt")
    nobody = free_ports(1)[0]
    with health_server(node) as (port, _):
        nodes = f"127.0.0.1:{port},127.0.0.1:{nobody}"

        assert main(["status", "--nodes", nodes]) == 1
        out, err = capsys.readouterr()
        assert (f"127.0.0.1:{port}        REFUSED THIS COMMAND'S CREDENTIALS: it requires "
                f"mutual TLS and no certificate was given: pass --tls-cert") in out, out
        assert f"127.0.0.1:{nobody}" in out and "DOWN" in out.split(f":{nobody}")[1]
        assert "1 of 2 nodes refused this command's credentials" in err, err
        assert "1 of 2 nodes are down" in err, err

        assert main(["status", "--nodes", nodes, *tls_flags(tmp_path / "foreign")]) == 1
        out, err = capsys.readouterr()
        assert ("REFUSED THIS COMMAND'S CREDENTIALS: it listens, and its certificate is not "
                f"signed by --tls-ca {tmp_path / 'foreign' / 'ca.crt'}") in out, out
        assert "1 of 2 nodes refused" in err and "1 of 2 nodes are down" in err, err

        # Our CA is the job's, our certificate another CA's: the node refuses it.
        mixed = [*tls_flags(tmp_path / "foreign")[:4], "--tls-ca", str(job / "ca.crt")]
        assert main(["status", "--nodes", nodes, *mixed]) == 1
        out, _ = capsys.readouterr()
        assert "it listens, and refused this command's certificate" in out or \
            "the TLS handshake failed" in out, out


@pytest.mark.parametrize("cmd", [["status", "--nodes", "127.0.0.1:1"],
                                 ["backup", "--nodes", "127.0.0.1:1"]])
def test_a_key_of_another_certificate_names_the_flags_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], cmd: list[str]) -> None:
    """The second newcomer trial: ``--tls-key`` of another certificate printed
    ``mtc: [X509: KEY_VALUES_MISMATCH] key values mismatch (_ssl.c:3917)``, no file
    named; a CA file that is no certificate the same. Each names its flag's file."""
    certs.issue(tmp_path, 1)
    wrong_key = ["--tls-cert", str(tmp_path / "controller.crt"), "--tls-key",
                 str(tmp_path / "rank-0.key"), "--tls-ca", str(tmp_path / "ca.crt")]
    assert main([*cmd, *wrong_key]) == 1
    err = capsys.readouterr().err
    assert (f"--tls-cert {tmp_path / 'controller.crt'} and --tls-key "
            f"{tmp_path / 'rank-0.key'}") in err, err
    assert "not a certificate and its key" in err, err

    bad_ca = [*tls_flags(tmp_path)[:4], "--tls-ca", str(tmp_path / "rank-0.key")]
    assert main([*cmd, *bad_ca]) == 1
    err = capsys.readouterr().err
    assert f"--tls-ca {tmp_path / 'rank-0.key'}" in err, err


def test_a_wiped_rank_whose_steps_never_reached_a_peer_is_not_up_to_date(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1's RAM disk was wiped before its steps 10 and 20 reached rank 0: no copy
    says it lost them, and its replicator has nothing left to copy."""
    own = {0: [10, 20], 1: []}

    def row(rank: int, addr: str, creds: Credentials) -> tuple[dict[str, object], list[int]]:
        return {"rank": rank, "address": addr, "up": True, "local": own[rank],
                "peer_copies": {}, "quarantined": 0, "replication": "up to date",
                "config_error": "", "unanswered_peers": []}, []

    monkeypatch.setattr(cli, "_row", row)
    assert cli.status(["a:1", "b:1"], Credentials(), as_json=False) == 1
    out, err = capsys.readouterr()
    line = next(x for x in out.splitlines() if "b:1" in x)
    assert "up to date" not in line and "MISSING steps" in line, out
    assert "rank 1: MISSING STEPS: it holds none of its own steps while every other rank " \
           "holds step(s) [10, 20]" in out, out
    assert "1 of 2 nodes miss steps the others hold" in err, err


def test_backup_takes_the_nodes_flag_of_status_and_asks_the_first_that_answers(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/multi-controller.md: "``mtc backup`` with the same flags" as ``mtc status
    --nodes ...``: it takes them, and a node down is passed over."""
    import grpc

    from mtc import replicas
    from mtc.grpc_errors import PeerError

    asked: list[str] = []

    def request_backup(address: str, **_: object) -> int:
        asked.append(address)
        if address == "a:1":
            e = PeerError(f"RequestBackup to {address} failed: UNAVAILABLE")
            e.code = grpc.StatusCode.UNAVAILABLE
            raise e
        return 20

    monkeypatch.setattr(replicas, "request_backup", request_backup)
    assert main(["backup", "--nodes", "a:1,b:1,c:1"]) == 0
    assert asked == ["a:1", "b:1"]
    out, err = capsys.readouterr()
    assert out.strip() == "backed up step 20" and "a:1 did not answer" in err, (out, err)
    assert main(["backup", "--node", "b:1"]) == 0
    with pytest.raises(SystemExit):
        main(["backup", "--node", "b:1", "--nodes", "b:1"])  # one or the other
