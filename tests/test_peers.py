"""The network tier's reader (``sidecar/restore/peers.py``) and how a host's loader uses it.

Fast tests: which replicator is asked first, that a region of another host is
never looked for on this host's RAM disk but asked of the network tier and
checked against the manifest, and that no holder gives a typed error naming the
host and file. The real replicators serving real hosts are exercised in
``tests/test_multicontroller.py``.
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest

from mtc.contract import Piece, ReadTask
from mtc.errors import CorruptShardError, ShardUnavailableError
from mtc.integrity import crc32c
from mtc.manifest import ShardEntry
from mtc.sidecar.restore.load import ShardLoader
from mtc.sidecar.restore.peers import PeerFiles, order_holders


@pytest.mark.parametrize(("origin", "near", "ranks", "want"), [
    (2, 0, [0, 1, 2, 3], [0, 2, 1, 3]),   # this host's peer copy, the saver's, the rest
    (0, 0, [0, 1, 2, 3], [0, 1, 2, 3]),   # this host saved it
    (3, 1, [0, 1], [1, 0]),               # the saver is gone
    (3, None, [0, -1, 2], [0, 1, 2]),     # unknown rank (did not answer) stays in order
    (1, 0, [1, 0], [1, 0]),               # ranks are the replicators' own, not positions
])
def test_order_holders(origin: int, near: int | None, ranks: list[int], want: list[int]) -> None:
    assert order_holders(origin, near, ranks) == want


def _entry(index: tuple[tuple[int, int], ...], data: bytes, name: str) -> ShardEntry:
    return ShardEntry(index, name, len(data), crc32c(data))


def test_loader_asks_the_network_for_other_hosts_pieces_and_checks_them(tmp_path: Path) -> None:
    """Host 0's loader reads its own piece from its root and host 1's through
    ``remote`` (here a function standing in for the replicators, so the test can
    hand back wrong bytes); a file of host 1's name on host 0's disk is ignored."""
    own = np.arange(4, dtype=np.float32)
    other = np.arange(4, 8, dtype=np.float32)
    e0 = _entry(((0, 4),), own.tobytes(), "a.bin")
    e1 = _entry(((4, 8),), other.tobytes(), "b.bin")
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "a.bin").write_bytes(own.tobytes())
    (tmp_path / "5" / "b.bin").write_bytes(b"\0" * 16)  # never read: not host 0's piece
    asked: list[tuple[int, int, str]] = []
    served = {"b.bin": bytearray(other.tobytes())}

    def remote(step: int, host: int, rel: str) -> bytearray:
        asked.append((step, host, rel))
        return served[rel]

    task = ReadTask(0, ((0, 8),), "float32", (0,), (Piece(0, e0), Piece(1, e1)))
    with ShardLoader(5, lambda h: tmp_path, remote=remote, own=(0,)) as loader:
        np.testing.assert_array_equal(loader.read(task), np.arange(8, dtype=np.float32))
    assert asked == [(5, 1, "b.bin")]

    served["b.bin"] = bytearray(np.arange(4, dtype=np.float32).tobytes())  # wrong bytes
    with pytest.raises(CorruptShardError) as e, \
            ShardLoader(5, lambda h: tmp_path, remote=remote, own=(0,)) as loader:
        loader.read(task)
    assert e.value.host == 1 and e.value.step == 5 and e.value.path == "b.bin"


@pytest.mark.timeout(60)  # bounded: the inventory call has a deadline
def test_no_replicator_holding_a_copy_is_a_typed_error() -> None:
    with socket.socket() as s:  # a port nothing listens on: refused at once
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    peers = PeerFiles([addr], None, near=0, deadline_s=5.0)
    try:
        with pytest.raises(ShardUnavailableError) as e:
            peers.read(7, 2, "manifest.json")
    finally:
        peers.close()
    assert e.value.step == 7 and e.value.host == 2 and e.value.path == "manifest.json"
    assert addr in str(e.value)
