"""A restore's peer traffic after a host loss.

Files of one held copy in one stream (``Fetch`` with ``more_paths``): the pure
grouping (:func:`fetch_batches`) alone, then the real client against a real
replicator server in this process, on loopback: every file arrives whole and
verified; a file that does not match its size or CRC32C ends the stream, is not
left behind, and the files before it still count. And a call to a peer known to
be up (``known_up``: the agreement asking a member that just asked) connects
anew instead of waiting out the shared channel's backoff from the peer's loss.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import pytest
from replicators import commit_raw_step
from served_node import ServedNode

from mtc.credentials import Credentials
from mtc.errors import CorruptShardError
from mtc.grpc_errors import PeerError
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.fetch.fetch_plan import fetch_batches
from mtc.sidecar.replicator.node import Node
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.sidecar.replicator.wire.server import serve

FILES = {"a.bin": bytes(range(256)) * 40, "empty.bin": b"", "d-b.bin": b"B" * 10,
         "d/c.bin": zlib.compress(b"c" * 9000) * 3}


@pytest.mark.parametrize(("first", "streams", "want"), [
    ([], 4, []),
    ([None, (0, 0)], 4, []),  # no source, or only this host's own copy: not streamed
    ([(1, 0)] * 3, 4, [((1, 0), [0]), ((1, 0), [1]), ((1, 0), [2])]),
    ([(1, 0)] * 5, 2, [((1, 0), [0, 1, 2]), ((1, 0), [3, 4])]),
    ([(1, 0), (2, 0), (1, 0), (0, 0), (2, 3)], 1,
     [((1, 0), [0, 2]), ((2, 0), [1]), ((2, 3), [4])]),
])
def test_fetch_batches(first: list[tuple[int, int] | None], streams: int,
                       want: list[tuple[tuple[int, int], list[int]]]) -> None:
    assert fetch_batches(first, 0, streams) == want


class Holder(ServedNode):
    """A real replicator (rank 0) holding step 1 of its own, served on loopback."""

    def __init__(self, base: Path) -> None:
        # Orbax's framework: its steps are opaque folders of nested files, no manifest.
        super().__init__(base / "root", Credentials(),
                         lambda root: commit_raw_step(root, 1, FILES), framework="orbax",
                         deadline_s=0.5)
        self.client = PeerClient(f"127.0.0.1:{self.port}", Credentials(), rank=0)

    def close(self) -> None:
        self.client.close()
        super().close()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Holder]:
    h = Holder(tmp_path)
    yield h
    h.close()


def metas(wrong_crc: dict[str, int] | None = None) -> list[FileMeta]:
    """The files as an inventory describes them (``wrong_crc``: as it must not)."""
    wrong = wrong_crc or {}
    return [FileMeta(p, len(b), wrong.get(p, crc32c(b) if b else 0)) for p, b in FILES.items()]


def test_every_file_in_one_stream_verified(holder: Holder, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    got, err = holder.client.data.fetch_files(1, 0, metas(), dest)
    assert err is None
    assert got == list(FILES)
    for p, b in FILES.items():
        assert (dest / p).read_bytes() == b


def test_a_file_that_does_not_match_ends_the_stream(holder: Holder, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    # What the inventory said of d/b.bin is not what the holder has.
    got, err = holder.client.data.fetch_files(1, 0, metas({"d-b.bin": 0x1234}), dest)
    assert isinstance(err, CorruptShardError) and err.path == "d-b.bin"
    assert got == ["a.bin", "empty.bin"]  # the files before it arrived, verified
    assert (dest / "a.bin").read_bytes() == FILES["a.bin"]
    assert not (dest / "d" / "b.bin").exists() and not (dest / "d" / "c.bin").exists()


def test_a_damaged_held_file_is_never_sent_whole(holder: Holder, tmp_path: Path) -> None:
    assert len(holder.node.shown.inventory().copies) == 1  # described (and checked) first
    p = holder.root / "1" / "d" / "c.bin"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF  # flipped after it was committed: the holder finds it as it reads
    p.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    got, err = holder.client.data.fetch_files(1, 0, metas(), dest)
    assert isinstance(err, PeerError), err
    assert got == ["a.bin", "empty.bin", "d-b.bin"]
    assert not (dest / "d" / "c.bin").exists()


def test_a_copy_not_held_sends_nothing(holder: Holder, tmp_path: Path) -> None:
    got, err = holder.client.data.fetch_files(7, 0, metas(), tmp_path / "dest")
    assert got == [] and isinstance(err, PeerError)
    assert not any((tmp_path / "dest").rglob("*.bin"))


def test_only_the_last_restore_starts_the_background_fetch(holder: Holder) -> None:
    """``Restored`` (the job's load is over) starts a background fetch queued
    behind the quiet time, but only for the restore this replicator last
    prepared: a late or replayed notice of another one, or of another step,
    starts nothing. A malformed one is refused, typed. Pushes keep the quiet time."""
    restorer = holder.node.restorer
    # As a PrepareRestore of restore "r1" leaves them, its step 1 queued behind the
    # quiet time (a real one needs rank 1, and a host that lost its data).
    quiet = time.monotonic() + 600
    restorer._last_rid, restorer.quiet_until = "r1", quiet
    restorer._materializing[1] = Future()
    for rid, step in (("r0", 1), ("", 1), ("r1", 2)):
        reply = holder.client.call("Restored", pb.RestoredRequest(restore_id=rid, step=step),
                                   attempts=1)
        assert not reply.fetching and not restorer._bg_wake.is_set(), (rid, step)
    with pytest.raises(PeerError) as e:
        holder.client.call("Restored", pb.RestoredRequest(restore_id="r1", step=-2),
                           attempts=1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not restorer._bg_wake.is_set()
    reply = holder.client.call("Restored", pb.RestoredRequest(restore_id="r1", step=1),
                               attempts=1)
    assert reply.fetching and restorer._bg_wake.is_set()
    assert restorer.quiet_until == quiet
    del restorer._materializing[1]


def test_the_background_fetch_runs_below_the_job() -> None:
    """A replaced host's own copy, fetched after the restore answered, runs on
    threads at nice 19 (each thread its own, on Linux): the job's threads on that
    host go first. The fetch pool that a waiting restore uses keeps its priority."""
    from mtc.sidecar.replicator.fetch.restore import _background_priority

    seen: dict[str, int] = {}

    def probe(name: str, init: bool) -> None:
        if init:
            _background_priority()
        seen[name] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, 0)
    for name, init in (("background", True), ("foreground", False)):
        t = threading.Thread(target=probe, args=(name, init))
        t.start()
        t.join()
    assert seen == {"background": 19, "foreground": base}
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # this thread untouched


def test_a_peer_known_up_is_called_over_a_connection_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A port nothing listens on yet: the peer is lost, the shared channel fails.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = PeerClient(f"127.0.0.1:{port}", Credentials(), rank=0, deadline_s=2.0)
    cfg = ReplicatorConfig(rank=0, nodes=(f"127.0.0.1:{port}", "127.0.0.1:1"),
                           nodes_per_slice=1, deadline_s=0.5, agreement_timeout_s=0.5)
    node = Node(cfg, tmp_path / "root", Credentials())
    made: list[bool] = []
    new_channel = PeerClient._new_channel

    def spy(self: PeerClient, *, own_connection: bool = False) -> Any:
        made.append(own_connection)
        return new_channel(self, own_connection=own_connection)

    monkeypatch.setattr(PeerClient, "_new_channel", spy)
    try:
        with pytest.raises(PeerError) as lost:
            client.call("GetInventory", pb.InventoryRequest(), attempts=1)
        assert lost.value.code == grpc.StatusCode.UNAVAILABLE
        # The replacement serves at the same address.
        server, _, servicer, _ = serve(node, f"127.0.0.1:{port}", Credentials())
        try:
            inv = client.call("GetInventory", pb.InventoryRequest(), attempts=1,
                              known_up=True)
            assert inv.rank == 0
            assert made == [True]  # over a channel of its own, closed again
        finally:
            server.stop(0).wait()
            servicer.close()
    finally:
        client.close()
        node.stop()
        node.close()
