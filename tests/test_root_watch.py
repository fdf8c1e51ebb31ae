"""The replication loop's wake-up (``sidecar/replicator/store/root_watch.py``): a step
renamed into the root ends the loop's wait at once; so does ``wake``; the timeout
still bounds every wait, with or without a watch. The last test runs real
replicators whose poll is a minute: only the watch can start the copy in time."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from replicators import Cluster, new_cluster

from mtc.sidecar.replicator.store.root_watch import RootWatch

LONG = 30.0  # a wait that must be cut short; a test that takes it has failed


def waited(watch: RootWatch, timeout: float, act: threading.Thread | None = None) -> float:
    t0 = time.monotonic()
    if act is not None:
        act.start()
    try:
        watch.wait(timeout)
    finally:
        if act is not None:
            act.join()
    return time.monotonic() - t0


def later(fn: Callable[[], object], delay: float = 0.1) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()
    return threading.Thread(target=run)


def test_a_step_renamed_into_the_root_ends_the_wait(tmp_path: Path) -> None:
    (tmp_path / "7.tmp").mkdir()
    watch = RootWatch(tmp_path)
    try:
        assert watch.watching
        took = waited(watch, LONG, later(lambda: os.rename(tmp_path / "7.tmp", tmp_path / "7")))
        assert took < LONG / 2
        # What woke it is consumed: the next wait lasts its timeout.
        assert waited(watch, 0.2) >= 0.15
    finally:
        watch.close()


def test_a_change_inside_a_step_folder_does_not_wake_it(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    watch = RootWatch(tmp_path)
    try:
        (tmp_path / "7" / "shard.bin").write_bytes(b"x")
        assert waited(watch, 0.3) >= 0.25
    finally:
        watch.close()


def test_wake_ends_the_wait_from_another_thread(tmp_path: Path) -> None:
    watch = RootWatch(tmp_path)
    try:
        assert waited(watch, LONG, later(watch.wake)) < LONG / 2
        watch.wake()
        watch.wake()  # woken twice before a wait: one wait ends at once
        assert waited(watch, LONG) < LONG / 2
    finally:
        watch.close()


def test_without_a_root_to_watch_the_timeout_still_bounds_the_wait(tmp_path: Path) -> None:
    watch = RootWatch(tmp_path / "missing")
    try:
        assert not watch.watching
        took = waited(watch, 0.2)
        assert 0.15 <= took < LONG / 2
        assert waited(watch, LONG, later(watch.wake)) < LONG / 2
    finally:
        watch.close()


def test_a_watch_made_after_a_thousand_open_files_still_waits(tmp_path: Path) -> None:
    """A replicator's descriptors (connections, files) can number past select()'s
    1024; the watch's own then must still work."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this process may open {hard} files at most")  # not counted as passing
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held: list[int] = []
    try:
        base = os.open(tmp_path, os.O_RDONLY)
        held.append(base)
        while held[-1] < 1100:
            held.append(os.dup(base))
        (tmp_path / "7.tmp").mkdir()
        watch = RootWatch(tmp_path)
        try:
            took = waited(watch, LONG, later(
                lambda: os.rename(tmp_path / "7.tmp", tmp_path / "7")))
            assert took < LONG / 2
            assert 0.15 <= waited(watch, 0.2) < LONG / 2
        finally:
            watch.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.process
def test_a_committed_step_is_copied_long_before_the_next_poll(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1, extra=("--poll-seconds", "120"))
    cl.start_all()
    cl.commit(0, 4, {"a.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 4)}, timeout=20.0)
    time.sleep(0.5)  # the pass that copied step 4 is over: the loop waits out its poll
    cl.commit(0, 5, {"a.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 5)}, timeout=20.0)  # TimeoutError without the watch
    assert "steps are found by polling only" not in cl.log_text(0)
