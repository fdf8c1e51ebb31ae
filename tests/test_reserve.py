"""Blank RAM-disk space set aside for the next files of known sizes
(``sidecar/storage/reserve.py``).

The plan is a pure function; the reserve is exercised on a real folder (its
files allocated with ``posix_fallocate``), and through a real replicator server
on loopback: a second copy from the same origin lands in the files set aside
after the first, verified byte for byte; a push that ends short leaves nothing
that counts; a wiped RAM disk's reserve is forgotten and the copy goes on.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from replicators import commit_raw_step
from served_node import ServedNode

from mtc.credentials import Credentials
from mtc.errors import UnsafePathError
from mtc.grpc_errors import PeerError
from mtc.integrity import crc32c
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.copies.transfers import RESERVE_DIR
from mtc.sidecar.replicator.wire import datachannel as dc
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.sidecar.storage.reserve import Reserve, plan_reserve, reserved_bytes

MIB = 1 << 20


def test_the_plan_drops_what_is_not_wanted_and_makes_what_is_missing() -> None:
    drop, make = plan_reserve(Counter({8: 2, 3: 1}), Counter({8: 1, 5: 2}))
    assert drop == Counter({5: 2})
    assert make == [8, 3]  # largest first
    assert plan_reserve(Counter({4: 1}), Counter({4: 1})) == (Counter(), [])


def fill(root: Path, room: int) -> Reserve:
    """A reserve whose RAM disk has ``room`` bytes free beside its own files."""
    def left() -> int:
        folder = root / RESERVE_DIR
        return room - sum(f.stat().st_size for f in folder.iterdir()) if folder.exists() \
            else room
    return Reserve(root, RESERVE_DIR, left)


def test_the_reserved_bytes_are_counted_from_one_listing(
        tmp_path: Path, lstats: list[str]) -> None:
    """A complete blank file's size is its name's; a file still being allocated
    (``.new``) or of any other name is asked of the file system."""
    r = fill(tmp_path, 1 << 30)
    r.want(0, [MIB, MIB, 3])
    r.fill_once()
    folder = tmp_path / RESERVE_DIR
    assert reserved_bytes(folder) == r.held_bytes() == 2 * MIB + 3
    assert not [f for f in folder.iterdir() if f.name.endswith(".new")]
    lstats.clear()
    (folder / "5.0123456789ab.new").write_bytes(b"12")  # being allocated: 2 bytes so far
    assert reserved_bytes(folder) == 2 * MIB + 3 + 2
    assert [Path(p).name for p in lstats] == ["5.0123456789ab.new"]
    assert reserved_bytes(tmp_path / "none") == 0


def test_blank_files_of_the_wanted_sizes_are_set_aside_and_taken_once(tmp_path: Path) -> None:
    r = fill(tmp_path, 1 << 30)
    r.want(0, [MIB, MIB, 3])
    r.fill_once()
    assert r.held_bytes() == 2 * MIB + 3
    files = sorted((tmp_path / RESERVE_DIR).iterdir())
    assert sorted(f.stat().st_size for f in files) == [3, MIB, MIB]
    assert all(f.read_bytes() == b"\0" * f.stat().st_size for f in files)  # blank
    taken = r.take(MIB, 0)
    assert taken is not None and taken.stat().st_size == MIB
    assert r.take(7, 0) is None  # no file of that size
    assert r.held_bytes() == MIB + 3
    r.fill_once()  # a copy in flight took it: not set aside again meanwhile
    assert r.held_bytes() == MIB + 3
    r.want(0, [MIB])  # the next commit: only one file of 1 MiB wanted now
    r.fill_once()
    assert r.held_bytes() == MIB
    assert sorted(f.stat().st_size for f in (tmp_path / RESERVE_DIR).iterdir()
                  if f != taken) == [MIB]


def test_a_start_with_other_sizes_frees_what_it_cannot_fill_at_once(tmp_path: Path) -> None:
    r = fill(tmp_path, 1 << 30)
    r.want(0, [MIB, 3, 3])
    r.fill_once()
    r.begin(0, [MIB, 5])  # a copy of other shapes: the 3-byte files are of no use to it
    assert r.held_bytes() == MIB
    assert sorted(f.stat().st_size for f in (tmp_path / RESERVE_DIR).iterdir()) == [MIB]
    r.fill_once()  # nothing made again while it runs
    assert r.held_bytes() == MIB
    r.drop_all()  # a write found the RAM disk full
    assert r.held_bytes() == 0 and list((tmp_path / RESERVE_DIR).iterdir()) == []


def test_the_reserve_leaves_as_much_free_beside_it_as_it_holds(tmp_path: Path) -> None:
    r = fill(tmp_path, 5 * MIB)  # room for the reserve (3 MiB) but not for as much again
    r.want(0, [MIB, MIB, MIB])
    r.fill_once()
    assert r.held_bytes() == 2 * MIB  # 5 - 2 = 3 left free: a third would leave 2 < 3


def test_a_reserve_left_by_a_previous_process_is_not_trusted(tmp_path: Path) -> None:
    (tmp_path / RESERVE_DIR).mkdir()
    (tmp_path / RESERVE_DIR / f"{MIB}.old").write_bytes(b"x" * MIB)
    r = fill(tmp_path, 1 << 30)
    assert not (tmp_path / RESERVE_DIR).exists()  # made again when first filled
    assert r.held_bytes() == 0


def test_a_taken_file_is_placed_without_following_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    r = fill(tmp_path / "root", 1 << 30)
    r.want(0, [10])
    r.fill_once()
    base = tmp_path / "root" / "incoming"
    base.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (base / "d").symlink_to(outside)
    with pytest.raises(UnsafePathError):
        r.open_new(base, "d/x.bin", 10, 0)
    assert list(outside.iterdir()) == []
    fd = r.open_new(base, "e/x.bin", 10, 0)  # a later file: a new one, still confined
    os.close(fd)
    assert (base / "e" / "x.bin").stat().st_size == 0


class Receiver(ServedNode):
    """Rank 0 of two, served on loopback; rank 1 pushes copies to it."""

    def __init__(self, base: Path) -> None:
        super().__init__(base / "root", Credentials(),
                         lambda root: commit_raw_step(root, 1, {"own.bin": b"o"}))
        self.client = PeerClient(f"127.0.0.1:{self.port}", Credentials(), rank=1, as_peer=True)
        self.src = base / "src"
        self.src.mkdir()

    def push(self, step: int, files: dict[str, bytes], short: str = "") -> None:
        """Offer, push and commit a copy of rank 1's ``step`` (``short``: that file's
        bytes end early)."""
        metas = [pb.FileInfo(path=p, size=len(b), crc32c=crc32c(b)) for p, b in files.items()]
        reply = self.client.call("Offer", pb.OfferRequest(copy=pb.StepCopy(
            step=step, origin_rank=1, files=metas)))
        parts = []
        for i, (p, b) in enumerate(files.items()):
            f = self.src / p.replace("/", "_")
            f.write_bytes(b[:len(b) // 2] if p == short else b)
            parts.append((i, f, len(b), crc32c(b)))
        self.client.data.push_data(reply.transfer_id, parts)
        self.client.call("Commit", pb.CommitRequest(transfer_id=reply.transfer_id))

    def used(self) -> float:
        return self.node.metrics.reserve_used._value.get()

    def close(self) -> None:
        self.client.close()
        super().close()


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(tmp_path)
    yield r
    r.close()


def copy_of(tag: bytes) -> dict[str, bytes]:
    return {"a.bin": tag * MIB, "d/b.bin": os.urandom(MIB // 2) + tag, "small.bin": tag * 7}


def test_the_next_copy_lands_in_the_space_set_aside_after_the_last(rx: Receiver) -> None:
    rx.push(3, copy_of(b"3"))
    assert rx.used() == 0 and rx.node.reserve.held_bytes() == 0
    rx.node.reserve.fill_once()  # the reserve's loop, run here in the test's thread
    assert rx.node.reserve.held_bytes() == MIB + MIB // 2 + 1 + 7
    second = copy_of(b"4")
    rx.push(4, second)
    assert rx.used() == 3  # every file of the second copy went into a reserved one
    held = rx.root / ".mtc-replica" / "1" / "4"
    assert {p: (held / p).read_bytes() for p in second} == second
    assert rx.node.reserve.held_bytes() == 0


def test_a_push_that_ends_short_into_reserved_space_never_counts(rx: Receiver) -> None:
    rx.push(3, copy_of(b"3"))
    rx.node.reserve.fill_once()
    files = copy_of(b"4")
    metas = [pb.FileInfo(path=p, size=len(b), crc32c=crc32c(b)) for p, b in files.items()]
    reply = rx.client.call("Offer", pb.OfferRequest(copy=pb.StepCopy(
        step=4, origin_rank=1, files=metas)))
    # A bare push of half of a.bin's bytes, then the end of the stream: the rest of
    # the reserved file is zeros, which must never pass for the offered file.
    with socket.create_connection(("127.0.0.1", rx.servicer.data_port), timeout=5) as s:
        req = pb.DataRequest(transfer_id=reply.transfer_id, files=[0]).SerializeToString()
        s.sendall(dc.MAGIC + struct.pack("<I", len(req)) + req)
        assert not dc.recv_msg(s, pb.DataStatus, dc.MAX_STATUS).code  # go
        s.sendall(files["a.bin"][:MIB // 2])
        s.shutdown(socket.SHUT_WR)
        s.recv(1000)  # the server's answer, or its close
    assert rx.used() == 1  # it went into reserved space
    with pytest.raises(PeerError, match="not received or not verified"):
        rx.client.call("Commit", pb.CommitRequest(transfer_id=reply.transfer_id))
    assert not (rx.root / ".mtc-replica" / "1" / "4").exists()
    incoming = list((rx.root / ".mtc-replica" / "1").glob("4.mtc-tmp-*/a.bin"))
    assert incoming == []  # the short file was removed


def test_a_wiped_reserve_is_forgotten_and_the_copy_goes_on(rx: Receiver) -> None:
    rx.push(3, copy_of(b"3"))
    rx.node.reserve.fill_once()
    for f in (rx.root / RESERVE_DIR).iterdir():
        f.unlink()  # the RAM disk lost them
    second = copy_of(b"4")
    rx.push(4, second)
    held = rx.root / ".mtc-replica" / "1" / "4"
    assert {p: (held / p).read_bytes() for p in second} == second
    assert rx.node.reserve.held_bytes() == 0  # forgotten; refilled by the loop later
