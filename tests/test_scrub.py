"""The background scrub: every held copy read again, damage that no cache can see
found before a restore needs the step, and healed from another host.

The policy (which copy next, how long to pause) is pure; one copy's scrub runs on
a real store in this process (mtc's steps, and Orbax's for a replicator serving
Orbax's client), its heal a recording stand-in (a heal needs other
hosts); the last test runs whole replicators in one process (the in-memory
cluster), damages a host's own step,
a peer's copy of the newest step and one of an older step in place, silently
(size and mtime kept, as bad memory would), and waits, without any restore, for
all three to be found and made good again.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
from replicators import commit_mtc_step, flip

from mtc.errors import ConfigError
from mtc.integrity import crc32c
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.copies.scrub import MIN_PAUSE_S, Scrubber, due, next_copy, pause_after
from mtc.sidecar.replicator.memory_cluster import MemoryCluster, files_of
from mtc.sidecar.replicator.metrics import Metrics
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.store.store import REPLICA_DIR, LocalStore
from mtc.sidecar.storage.quarantine import quarantined
from mtc.testing.waits import wait_until

STEP = 7
MIB = 1 << 20


def test_next_copy_goes_round_in_order() -> None:
    held = [(2, 9), (0, 5), (2, 7)]
    assert next_copy(held, None) == (0, 5)
    assert next_copy(held, (0, 5)) == (2, 7)
    assert next_copy(held, (2, 7)) == (2, 9)
    assert next_copy(held, (2, 9)) == (0, 5)  # round again
    assert next_copy(held, (1, 0)) == (2, 7)  # the last one scrubbed is gone: the next
    assert next_copy([], (0, 5)) is None


def test_a_copy_is_due_once_the_interval_has_passed_since_it_was_last_read() -> None:
    read_at = {(2, 7): 350.0, (0, 5): 100.0, (1, 3): 90.0}
    # At 400 with 300 s: those read at 100 and 90 are due (in order), (2, 7) in 250 s.
    assert due(read_at, 400.0, 300.0) == ([(0, 5), (1, 3)], pytest.approx(250.0))
    assert due(read_at, 400.0, 0.0) == ([(0, 5), (1, 3), (2, 7)], math.inf)
    assert due({(0, 5): 399.0}, 400.0, 300.0) == ([], pytest.approx(299.0))
    assert due({}, 400.0, 300.0) == ([], math.inf)


@pytest.mark.parametrize("field", ["scrub_rate", "scrub_interval_s"])
def test_a_negative_scrub_setting_is_refused(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ReplicatorConfig(rank=0, nodes=("127.0.0.1:0", "127.0.0.1:1"), nodes_per_slice=1,
                         **{field: -1.0})


def test_pause_keeps_the_average_rate() -> None:
    # 640 MiB at 64 MiB/s is 10 s of budget; reading took 2 s: wait 8 more.
    assert pause_after(640 * MIB, 2.0, 64 * MIB) == pytest.approx(8.0)
    assert pause_after(640 * MIB, 20.0, 64 * MIB) == 0.0  # slower already
    assert pause_after(0, 0.0, 64 * MIB) == 0.0  # the first file at once
    assert pause_after(640 * MIB, 0.0, 0) == 0.0


def test_a_copy_is_read_at_the_rate_file_by_file(tmp_path: Path) -> None:
    store = a_host_with_a_peer_copy(tmp_path)
    s = Scrubber(store, Metrics(), rate=16 * 1024, heal_own=lambda step: None,
                 quiet_until=lambda: 0.0)
    t0 = time.monotonic()
    read = s.scrub_once()  # host 0's copy (5 pages and a manifest) at 16 KiB/s
    took = time.monotonic() - t0
    # Paced before each file after the first: at least every file's but the last's
    # worth of time (the last one's budget is spent between copies).
    sizes = [f.size for f in store.describe(0, STEP)]
    assert read == sum(sizes)
    assert took >= (read - sizes[-1]) / (16 * 1024) * 0.9
    assert MIN_PAUSE_S >= 1.0  # and a small state is not read over and over


def a_host_with_a_peer_copy(tmp_path: Path) -> LocalStore:
    """Host 2 with its own step 7 and a verified copy of host 0's step 7."""
    root = tmp_path / "host-2"
    commit_mtc_step(root, STEP, {"own.2": os.urandom(3 * 4096)}, host=2, num_hosts=4,
                    slice_of_host=1)
    origin = commit_mtc_step(tmp_path / "host-0", STEP, {"own.0": os.urandom(5 * 4096)},
                             host=0, num_hosts=4)
    store = LocalStore(root, rank=2)
    tmp = store.begin_incoming(0, STEP)
    for name, data in origin.items():
        (tmp / name).write_bytes(data)
    store.commit_incoming(tmp, 0, STEP, [FileMeta(n, len(d), crc32c(d))
                                         for n, d in origin.items()])
    # Both read and checked once: from now on the checksum cache vouches for them.
    assert store.verify(2, STEP) == [] and store.verify(0, STEP) == []
    return store


def scrubber(store: LocalStore, healed: list[int]) -> Scrubber:
    return Scrubber(store, Metrics(), rate=64 * MIB, heal_own=healed.append,
                    quiet_until=lambda: 0.0)


def test_silent_damage_in_an_own_step_is_found_quarantined_and_healed(
        tmp_path: Path) -> None:
    store = a_host_with_a_peer_copy(tmp_path)
    own = store.root / str(STEP) / "own.2"
    flip(own, silent=True)
    assert store.verify(2, STEP) == []  # the cache cannot see it
    healed: list[int] = []
    s = scrubber(store, healed)
    step_bytes = sum(f.stat().st_size for f in (store.root / str(STEP)).iterdir())
    assert s.scrub_once() > 0  # host 0's copy comes first: good
    assert healed == [] and (0, STEP) in store.copies()
    assert s.scrub_once() == step_bytes  # then the own step, every byte read
    assert healed == [STEP]  # healed at once, from another host (here: recorded)
    assert not own.exists() and store.damaged(2, STEP)
    assert len(quarantined(store.root)) == 1
    assert s.metrics.scrub_damaged._value.get() == 1


def test_silent_damage_in_a_peer_copy_stops_it_counting_as_held(tmp_path: Path) -> None:
    store = a_host_with_a_peer_copy(tmp_path)
    copied = store.root / REPLICA_DIR / "0" / str(STEP) / "own.0"
    flip(copied, silent=True)
    healed: list[int] = []
    s = scrubber(store, healed)
    assert s.scrub_once() > 0  # host 0's copy: (0, 7) comes first
    # Not this host's data: no heal here; its origin pushes it again once it sees
    # the copy is no longer held.
    assert healed == []
    assert (0, STEP) not in store.copies() and store.damaged(0, STEP)
    assert len(quarantined(store.root)) == 1
    s.scrub_once()  # the own step: good, nothing more
    assert healed == [] and (2, STEP) in store.copies()


def test_damage_another_check_moves_aside_between_the_scrubs_two_reads_is_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scrub reads a suspect file twice; when another check of the copy (an
    offer's, an inventory's) quarantined it in between, the scrub still counts
    the damage it found (the copy is damaged either way), and it is moved aside once."""
    store = a_host_with_a_peer_copy(tmp_path)
    copied = store.root / REPLICA_DIR / "0" / str(STEP) / "own.0"
    flip(copied, silent=True)
    check = store.checksums.check
    reads: list[str] = []

    def racing(path: str, meta: FileMeta, *, cached: bool = True) -> str | None:
        reads.append(path)
        if path == os.fspath(copied) and reads.count(path) == 2:
            assert store.verify(0, STEP, cached=False)  # the other check, in between
        return check(path, meta, cached=cached)

    monkeypatch.setattr(store.checksums, "check", racing)
    s = scrubber(store, [])
    s.scrub_once()
    assert reads.count(os.fspath(copied)) == 3  # the scrub's two reads, the other check's
    assert store.damaged(0, STEP) and len(quarantined(store.root)) == 1
    assert s.metrics.scrub_damaged._value.get() == 1


def test_an_orbax_step_and_its_copy_are_scrubbed_as_mtc_steps_are(tmp_path: Path) -> None:
    """Serving Orbax's client (its steps carry no manifest, files in subfolders): the
    checksums an own step was described with when first listed, and a copy's from
    its origin, are what the scrub reads against."""
    root = tmp_path / "host-0"
    own_files = {"_CHECKPOINT_METADATA": b"{}", "state/d/0.0": os.urandom(4 * 4096),
                 "state/manifest.ocdbt": os.urandom(512)}
    for name, data in own_files.items():
        (root / str(STEP) / name).parent.mkdir(parents=True, exist_ok=True)
        (root / str(STEP) / name).write_bytes(data)
    store = LocalStore(root, rank=0, orbax=True)
    assert store.own.steps() == [STEP]
    assert store.verify(0, STEP) == []  # described (read) once: the checksums to keep
    peer_files = {"_CHECKPOINT_METADATA": b"{}", "state/d/0.1": os.urandom(3 * 4096)}
    tmp = store.begin_incoming(1, STEP)
    for name, data in peer_files.items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    store.commit_incoming(tmp, 1, STEP, [FileMeta(n, len(d), crc32c(d))
                                         for n, d in sorted(peer_files.items())])
    assert sorted(store.copies()) == [(0, STEP), (1, STEP)]
    own = root / str(STEP) / "state" / "d" / "0.0"
    copied = store.copy_dir(1, STEP) / "state" / "d" / "0.1"
    flip(own, silent=True)
    flip(copied, silent=True)
    assert store.verify(0, STEP) == [] and store.verify(1, STEP) == []  # cache: blind
    healed: list[int] = []
    s = scrubber(store, healed)
    assert s.scrub_once() == sum(len(d) for d in own_files.values())
    assert healed == [STEP] and not own.exists() and store.damaged(0, STEP)
    assert s.scrub_once() == sum(len(d) for d in peer_files.values())
    assert healed == [STEP] and (1, STEP) not in store.copies()
    assert len(quarantined(root)) == 2
    assert s.metrics.scrub_damaged._value.get() == 2


def test_a_good_store_is_read_and_left_alone(tmp_path: Path) -> None:
    store = a_host_with_a_peer_copy(tmp_path)
    healed: list[int] = []
    s = scrubber(store, healed)
    total = sum(s.scrub_once() for _ in range(2))
    expected = sum(f.size for c in [(0, STEP), (2, STEP)] for f in store.describe(*c))
    assert total == expected
    assert healed == [] and quarantined(store.root) == []
    assert s.metrics.scrub_bytes._value.get() == total


def test_a_copy_is_read_again_only_once_the_interval_has_passed(tmp_path: Path) -> None:
    """Bytes just written (a save checksums them, a peer copy is verified as it
    arrives) or just scrubbed are not read again before ``interval`` seconds."""
    store = a_host_with_a_peer_copy(tmp_path)
    s = Scrubber(store, Metrics(), rate=64 * MIB, heal_own=lambda step: None,
                 quiet_until=lambda: 0.0, interval=300.0)
    assert s.scrub_once() == 0  # both copies were written just now
    # Host 0's copy written 10 minutes ago: due, and read whole.
    old = time.time() - 600
    os.utime(store.copy_dir(0, STEP), (old, old))
    peer = sum(f.size for f in store.describe(0, STEP))
    assert s.scrub_once() == peer
    assert s.scrub_once() == 0  # read just now: trusted for the interval
    assert s.metrics.scrub_bytes._value.get() == peer
    # Without the interval every copy is due again at once.
    s.interval = 0.0
    assert s.scrub_once() > 0


def held_bytes(root: Path) -> int:
    """The bytes of every file under a host's root: at least what a round of its
    scrub reads (its own steps and the copies it holds, a file linked twice counted
    twice, as the scrub reads it twice)."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_replicators_find_and_heal_silent_damage_before_any_restore(tmp_path: Path) -> None:
    # Whole replicators in one process, scrubbing: each copy read again as soon as
    # the rate allows, not only once the default interval has passed since it was
    # written (tests above hold that).
    with MemoryCluster(tmp_path, 4, 2, scrub_rate=64.0 * MIB, scrub_interval_s=0.0) as c:
        saved: dict[int, dict[int, dict[str, bytes]]] = {}
        for step in (3, 4):  # other values in each step: identical files would be one inode
            dp = os.urandom(64 << 10)
            saved[step] = {h: c.commit(h, step, {"dp.bin": dp if h % 2 == 0 else dp[::-1],
                                                 f"own-{h}.bin": os.urandom(64 << 10)})
                           for h in range(4)}
            c.wait_replicated(step)
        # Host 0's own newest step, host 3's copy of host 1's newest, and host 2's
        # copy of host 0's older step (the replicators keep two): each a file only
        # that host saved (a data-parallel one is a claim on the holder's own bytes).
        own = c.root(0) / "4" / "own-0.bin"
        peer_copy = c.root(3) / REPLICA_DIR / "1" / "4" / "own-1.bin"
        older_copy = c.root(2) / REPLICA_DIR / "0" / "3" / "own-0.bin"
        damaged = [own, peer_copy, older_copy]
        good = [p.read_bytes() for p in damaged]
        scrubbers = (0, 2, 3)
        # What each scrub has read so far, and what it must read at most to have read
        # every copy its host holds whole after the damage: a round of the copies in
        # order (what a scrub in progress reads first counts too, hence twice over).
        read_by = {r: c.scrape(r).get("mtc_scrub_bytes_total", 0.0)
                   + 2 * held_bytes(c.root(r)) for r in scrubbers}
        for p in damaged:
            flip(p, silent=True)

        def whole() -> bool:
            return all(p.exists() and p.read_bytes() == g for p, g in zip(damaged, good,
                                                                            strict=True))

        def not_blind() -> None:
            """A scrub that has read all its host holds without finding the damage
            fails the test at once."""
            samples = {r: c.scrape(r) for r in scrubbers}
            blind = [r for r, s in samples.items()
                     if s.get("mtc_scrub_damaged_files_total", 0) == 0
                     and s.get("mtc_scrub_bytes_total", 0.0) >= read_by[r]]
            assert not blind, f"the scrubs of hosts {blind} read all they hold, found nothing"

        def counted() -> bool:
            # Host 0 counts a copy sent again once its holder acknowledged it: after
            # the file is whole there (a clean-clone run under load read it between).
            s0 = c.scrape(0)
            return (s0.get("mtc_healed_files_total", 0) >= 1
                    and s0.get("mtc_steps_copied_again_total{why=lost}", 0) >= 1)

        wait_until("the damage found by the scrubs and healed", lambda: whole() and [
            c.scrape(r).get("mtc_scrub_damaged_files_total", 0) for r in scrubbers] == [1, 1, 1]
            and counted(),
            60, during=not_blind,
            detail=lambda: ({r: c.scrape(r).get("mtc_scrub_damaged_files_total")
                             for r in scrubbers}, whole(), counted()))
        # Host 0 fetched its file from its peer (healed); host 3's copy of the newest
        # step came again from its origin, and so did host 2's copy of the older one
        # once the newest was on every peer. Every bad file was kept aside.
        assert c.scrape(0)["mtc_healed_files_total"] >= 1
        assert c.scrape(0)["mtc_steps_copied_again_total{why=lost}"] >= 1
        assert [len(quarantined(c.root(r))) for r in (0, 2, 3)] == [1, 1, 1]
        # A restore of the newest step now finds every host's data whole where it is.
        replies = c.prepared(range(4))
        assert {r: (x.step, x.tier) for r, x in replies.items()} == {
            r: (4, "local") for r in range(4)}
        for h in range(4):
            assert files_of(c.root(h) / "4") == saved[4][h]
        assert (2, 0, 3) in c.held(), sorted(c.held())
