"""A replicator started without ``--rank``: Orbax's client's (its rank from
replicator.yaml), unless the rest of the command says mtc, which is refused at once
instead of waiting for a file mtc never writes."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from mtc.errors import ConfigError
from mtc.sidecar.replicator.main import main, parse_args, rankless_start

BASE = ["--local-dir", "/dev/shm/x", "--listen", "127.0.0.1:0", "--nodes", "a:1,b:1"]


@pytest.mark.parametrize(("extra", "refused"), [
    ([], None),  # Orbax's client names the rank
    (["--framework", "orbax"], None),
    (["--rank", "0"], None),
    (["--rank", "1", "--nodes-per-slice", "1", "--framework", "mtc"], None),
    (["--framework", "mtc"], "no --rank, but --framework mtc:"),
    (["--nodes-per-slice", "2"], "no --rank, but --nodes-per-slice:"),
    (["--nodes-per-slice", "1", "--framework", "mtc"],
     "no --rank, but --framework mtc and --nodes-per-slice:"),
])
def test_rankless_start(extra: list[str], refused: str | None) -> None:
    args = parse_args([*BASE, *extra])
    if refused is None:
        rankless_start(args)
    else:
        with pytest.raises(ConfigError, match=refused):
            rankless_start(args)


def test_refused_before_waiting(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    # main() takes SIGTERM and SIGINT for its process: not this one's.
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    assert main(["--local-dir", str(tmp_path), "--listen", "127.0.0.1:0", "--nodes",
                 "127.0.0.1:1,127.0.0.1:2", "--nodes-per-slice", "1"]) == 2
    assert "give each host's replicator its --rank" in capsys.readouterr().err
    assert not (tmp_path / "replicator.failed").exists()  # not Orbax's: no marker for it
