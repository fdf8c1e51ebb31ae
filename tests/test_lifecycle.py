"""mtc.lifecycle: a manager nobody closed has its saves finished when it is collected,
never on the thread that dropped it (which may be one its saves need); services are
started in order with one thread group, stopped and closed in reverse with every
thread joined between, and a thread that fails says so; library code starts no
thread outside a group."""

from __future__ import annotations

import ast
import gc
import threading
from pathlib import Path

import pytest

from mtc import lifecycle


class Owner:
    pass


class Dispatch:
    """Stands in for a manager's dispatcher (the lifecycle asks only wait and close)."""

    def __init__(self, writer: threading.Thread) -> None:
        self.writer = writer
        self.waited_on: threading.Thread | None = None
        self.closed = False

    def wait(self) -> None:
        self.waited_on = threading.current_thread()
        # A writer thread waiting for its own saves would never return.
        assert self.waited_on is not self.writer, "waited for its saves on its own writer"

    def close(self) -> None:
        self.closed = True


def test_a_manager_collected_on_its_own_writer_thread_is_finished_on_another() -> None:
    box: list[Owner] = [Owner()]
    dispatch: list[Dispatch] = []

    def writer() -> None:  # the last reference goes on the manager's writer thread
        dispatch.append(Dispatch(threading.current_thread()))
        lifecycle.track(box[0], lifecycle.Held(dispatch[0], "ckpt"))
        box.clear()
        gc.collect()

    t = threading.Thread(target=writer)
    t.start()
    t.join(10)
    assert lifecycle.join_finishing(10)
    d = dispatch[0]
    assert d.closed and d.waited_on is not None and d.waited_on is not d.writer


def test_a_released_manager_is_not_finished_again() -> None:
    owner = Owner()
    d = Dispatch(threading.current_thread())
    held = lifecycle.Held(d, "ckpt")
    lifecycle.track(owner, held)
    held.release()
    assert d.closed
    d.closed = False
    del owner
    gc.collect()
    assert lifecycle.join_finishing(10)
    assert not d.closed and d.waited_on is None


# -- the thread group and the service lifecycle --------------------------------------------


class Looping:
    """A service with one thread that runs until stopped; records its calls in ``log``."""

    def __init__(self, name: str, log: list[str], *, fail_in_thread: bool = False,
                 fail_start: bool = False) -> None:
        self.name = name
        self.log = log
        self.fail_in_thread = fail_in_thread
        self.fail_start = fail_start
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.ran = threading.Event()

    def _run(self) -> None:
        self.ran.set()
        if self.fail_in_thread:
            raise ValueError(f"{self.name} broke")
        self._stop.wait(30)
        self.log.append(f"{self.name} ended")

    def start(self, threads: lifecycle.Threads) -> None:
        self.log.append(f"start {self.name}")
        self.thread = threads.start(self._run, f"test-{self.name}")
        if self.fail_start:
            raise OSError(f"{self.name} cannot listen")

    def stop(self) -> None:
        self.log.append(f"stop {self.name}")
        self._stop.set()

    def close(self) -> None:
        # Closed only once every thread of the group ended.
        assert self.thread is not None and not self.thread.is_alive()
        self.log.append(f"close {self.name}")


def test_services_start_in_order_stop_and_close_in_reverse_and_every_thread_is_joined(
        ) -> None:
    log: list[str] = []
    a, b = Looping("a", log), Looping("b", log)
    services = lifecycle.Services("test", [a, b])
    services.start()
    assert a.ran.wait(10) and b.ran.wait(10)
    assert sorted(services.threads.alive()) == ["test-a", "test-b"]
    assert services.shutdown(10) is True
    assert log[:2] == ["start a", "start b"]
    assert log[2:4] == ["stop b", "stop a"]
    assert sorted(log[4:6]) == ["a ended", "b ended"]  # joined before any close
    assert log[6:] == ["close b", "close a"]
    assert services.threads.alive() == []
    with pytest.raises(RuntimeError, match="shutting down"):  # nothing starts unjoined
        services.threads.start(lambda: None, "late")


def test_a_failing_thread_sets_failed_and_its_error_surfaces_at_shutdown() -> None:
    log: list[str] = []
    ok, bad = Looping("ok", log), Looping("bad", log, fail_in_thread=True)
    services = lifecycle.Services("test", [ok, bad])
    services.start()
    assert services.threads.failed.wait(10)  # the owner learns at once, not at exit
    assert [n for n, _ in services.threads.errors()] == ["test-bad"]
    with pytest.raises(ValueError, match="bad broke"):
        services.shutdown(10)
    # Everything was still stopped, joined and closed before the error was raised.
    assert "ok ended" in log and log[-2:] == ["close bad", "close ok"]


def test_a_service_that_fails_to_start_shuts_down_those_started_before_it() -> None:
    log: list[str] = []
    a, b, c = Looping("a", log), Looping("b", log, fail_start=True), Looping("c", log)
    services = lifecycle.Services("test", [a, b, c])
    with pytest.raises(OSError, match="b cannot listen"):
        services.start()
    assert "start c" not in log
    assert log[-2:] == ["close b", "close a"]  # b's thread (started) was joined too
    assert services.threads.alive() == []


def test_join_waits_for_every_thread_within_its_timeout() -> None:
    group = lifecycle.Threads("test")
    release = threading.Event()
    for i in range(3):
        group.start(release.wait, f"test-w{i}", 30)
    assert group.join(0.05, reraise=False) is False  # still running: said, not hidden
    assert len(group.alive()) == 3
    release.set()
    assert group.join(10) is True and group.alive() == []


# -- no thread started outside the lifecycle ------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
# Where a thread may be made by hand: the group itself.
STARTS_THREADS = {"mtc/lifecycle.py"}


def _threads_made(path: Path) -> list[str]:
    """Where ``path`` makes a thread itself: ``threading.Thread(...)`` or ``Timer``,
    however imported, or a class of its own derived from them."""
    made = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            targets = [node.func]
        elif isinstance(node, ast.ClassDef):
            targets = list(node.bases)
        else:
            continue
        for f in targets:
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) \
                else ""
            if name in ("Thread", "Timer"):
                made.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    return made


def _executors_made(source: str) -> list[int]:
    """The lines where ``source`` makes a ``ThreadPoolExecutor`` (its threads start
    outside any group, and only the interpreter's exit joins them), however imported,
    or derives a class from it."""
    made = []
    for node in ast.walk(ast.parse(source)):
        targets = [node.func] if isinstance(node, ast.Call) else \
            list(node.bases) if isinstance(node, ast.ClassDef) else []
        for f in targets:
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) \
                else ""
            if name == "ThreadPoolExecutor":
                made.append(node.lineno)
    return made


def test_library_pools_are_mtc_pools() -> None:
    """Every pool of library code is :class:`mtc.pool.ThreadPool`: its threads in a
    group, joined by its shutdown (``lazy`` where it is sized for a rare worst case)."""
    found = [f"{p.relative_to(REPO)}:{line}" for top in ("mtc", "sidecar", "trainer")
             for p in sorted((REPO / top).rglob("*.py")) if "_pb2" not in p.name
             for line in _executors_made(p.read_text())]
    assert found == [], "make these mtc.pool.ThreadPool"
    # The check finds what it looks for, in every form.
    assert _executors_made("from concurrent import futures\n"
                           "pool = futures.ThreadPoolExecutor(2)\n") == [2]
    assert _executors_made("from concurrent.futures import ThreadPoolExecutor as T\n"
                           "with ThreadPoolExecutor(1) as p:\n    pass\n") == [2]
    assert _executors_made("class P(ThreadPoolExecutor):\n    pass\n") == [1]


def test_library_threads_are_started_only_through_a_thread_group() -> None:
    found = [f for top in ("mtc", "sidecar", "trainer")
             for p in sorted((REPO / top).rglob("*.py"))
             if str(p.relative_to(REPO)) not in STARTS_THREADS and "_pb2" not in p.name
             for f in _threads_made(p)]
    assert found == [], "start these through mtc.lifecycle.Threads (joined by their owner)"
    # The check finds what it looks for.
    assert [f.split()[-1] for f in _threads_made(REPO / "mtc" / "lifecycle.py")] == ["Thread"]
