"""A replaced host's restore writes into RAM disk set aside while its job starts up.

A host that comes up holding no step of its own (a replacement, a wiped RAM disk)
asks the other hosts what they hold of its data and sets blank files of those sizes
aside (``ReplicationLoop.set_aside_for_restore``, mtc.sidecar.storage.reserve); the restore's fetch
then writes into them instead of into new pages. The plan is a pure function;
the replicators are whole ones in one process (the in-memory cluster), the host
loss a killed node and a wiped root.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.agree.node_agreement import holders_of
from mtc.sidecar.replicator.copies.transfers import RESERVE_DIR
from mtc.sidecar.replicator.fetch.fetch_plan import likely_restore
from mtc.sidecar.replicator.memory_cluster import MemoryCluster
from mtc.sidecar.storage.reserve import Reserve
from mtc.testing.waits import wait_until

MIB = 1 << 20


def inv(*copies: tuple[int, int, list[int]]) -> pb.Inventory:
    """An inventory of copies (origin, step, file sizes)."""
    return pb.Inventory(copies=[pb.StepCopy(
        origin_rank=o, step=s, files=[pb.FileInfo(path=f"f{i}.bin", size=n, crc32c=1)
                                      for i, n in enumerate(sizes)])
        for o, s, sizes in copies])


def test_the_newest_copy_of_the_hosts_data_elsewhere_is_what_it_will_fetch() -> None:
    invs = {1: inv((0, 7, [5, 6]), (1, 9, [1])), 2: inv((0, 8, [3, 4, 4])),
            0: inv((0, 99, [1]))}  # what rank 0 itself lists is not elsewhere
    assert likely_restore(0, [0], holders_of(invs)) == (8, [3, 4, 4])


def test_equivalent_ranks_stand_in_in_their_order() -> None:
    invs = {1: inv((2, 5, [1, 2]), (3, 6, [7]))}
    assert likely_restore(0, [0, 3, 2], holders_of(invs)) == (6, [7])  # Orbax's peer group
    assert likely_restore(0, [0], holders_of(invs)) is None  # mtc: only its own data
    assert likely_restore(0, [0], {}) is None  # nobody answered


def test_a_copy_without_files_sets_nothing_aside() -> None:
    assert likely_restore(0, [0], holders_of({1: pb.Inventory(copies=[pb.StepCopy(
        origin_rank=0, step=3)])})) is None  # an inventory asked without file lists


def test_forgetting_a_key_frees_its_files_only(tmp_path: Path) -> None:
    r = Reserve(tmp_path, "reserve", lambda: 1 << 30)
    r.want(0, [10, 20])
    r.want(1, [30])
    r.fill_once()
    assert r.held_bytes() == 60 and r.wants(0)
    r.forget(0)
    assert r.held_bytes() == 30 and not r.wants(0) and r.wants(1)
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "reserve").iterdir()) == ["30"]
    r.forget(0)  # again: nothing to do
    assert r.held_bytes() == 30


def test_files_set_aside_for_a_restore_are_no_room_for_others(tmp_path: Path) -> None:
    """A copy from another origin is offered room: the blank files set aside for this
    host's own restore are not part of it (they stay for the restore)."""
    r = Reserve(tmp_path, "reserve", lambda: 1 << 30)
    r.want(0, [10, 20])  # this host's restore
    r.want(1, [30])  # the next copy from origin 1
    r.fill_once()
    assert r.held_bytes() == 60 and r.room_for_others(0) == 30
    r.forget(0)
    assert r.room_for_others(0) == 30  # nothing set aside for it now
    assert r.room_for_others(1) == 0  # origin 1's own: no room for the others


# -- real replicators ------------------------------------------------------------------

FILES = {"a.bin": os.urandom(3 * MIB), "b.bin": os.urandom(MIB + 7), "c.bin": b"x" * 11}


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[tuple[MemoryCluster, dict[str, bytes]]]:
    """Two replicators in two slices (in one process, blank files set aside as a
    deployment's are), each one's step 5 replicated to the other; and host 0's
    files of it (its manifest too)."""
    with MemoryCluster(tmp_path, 2, 1, reserve=True) as c:
        files = c.commit(0, 5, FILES)
        c.commit(1, 5, {"tiny.bin": b"t" * 64})
        c.wait_replicated(5)
        yield c, files


def reserve(c: MemoryCluster, rank: int) -> tuple[float, float]:
    """(bytes set aside, files used from the reserve) on ``rank``'s replicator."""
    got = c.scrape(rank)
    return got.get("mtc_reserve_bytes", 0.0), got.get("mtc_reserve_files_used_total", 0.0)


def test_a_replaced_host_fetches_its_step_into_space_set_aside_at_its_start(
        two_hosts: tuple[MemoryCluster, dict[str, bytes]]) -> None:
    c, files = two_hosts
    size = sum(len(b) for b in files.values())
    c.replace_host(0)
    # Set aside at start, before any restore is asked for: the sizes of host 1's
    # copy of host 0's step 5.
    wait_until("host 0 sets its restore's files aside", lambda: reserve(c, 0)[0] >= size)
    assert reserve(c, 0) == (size, 0)
    blank = sorted(int(p.name.split(".")[0]) for p in (c.root(0) / RESERVE_DIR).iterdir())
    assert blank == sorted(len(b) for b in files.values())

    replies = c.prepared([0, 1], 20)  # both at once, as a restarting job asks
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {0: (5, "peer"),
                                                                 1: (5, "local")}
    step = c.root(0) / "5"
    assert {p: (step / p).read_bytes() for p in files} == files  # every byte, verified
    # Every fetched file took a blank one's place; none is left set aside.
    assert reserve(c, 0) == (0, len(files))
    assert list((c.root(0) / RESERVE_DIR).iterdir()) == []


def test_a_host_that_saves_anew_without_a_restore_frees_what_it_set_aside(
        two_hosts: tuple[MemoryCluster, dict[str, bytes]]) -> None:
    c, files = two_hosts
    c.replace_host(0)
    wait_until("host 0 sets its restore's files aside",
               lambda: reserve(c, 0)[0] >= sum(len(b) for b in files.values()))
    c.commit(0, 6, {"new.bin": b"n" * 100})  # the job went on without restoring here
    wait_until("the files set aside are freed", lambda: reserve(c, 0)[0] == 0)
    assert reserve(c, 0)[1] == 0
    wait_until("the reserve's folder is empty",
               lambda: not any((c.root(0) / RESERVE_DIR).iterdir()))


def test_a_host_that_keeps_its_own_steps_sets_nothing_aside(
        two_hosts: tuple[MemoryCluster, dict[str, bytes]]) -> None:
    c, _ = two_hosts
    c.kill(0)
    c.start(0)  # a restarted replicator, its RAM disk intact
    # Its loop has passed: a replaced host sets space aside before the first pass.
    c.wait_passes(0)
    assert reserve(c, 0) == (0, 0)
    assert not (c.root(0) / RESERVE_DIR).is_dir() or \
        not any((c.root(0) / RESERVE_DIR).iterdir())
