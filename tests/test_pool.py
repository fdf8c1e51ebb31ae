"""mtc.pool.ThreadPool: every thread starts with the pool, so work submitted while
the interpreter exits still runs (Python 3.12 and newer refuse new threads then)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import weakref

import pytest

from mtc.pool import ThreadPool
from mtc.testing.waits import wait_until


def test_threads_start_with_the_pool_and_are_joined_on_shutdown() -> None:
    before = threading.active_count()
    pool = ThreadPool(3, "t-pool")
    assert threading.active_count() == before + 3
    assert [f.result(5) for f in [pool.submit(pow, 2, i) for i in range(6)]] == \
        [1, 2, 4, 8, 16, 32]
    pool.shutdown()
    assert threading.active_count() == before
    with pytest.raises(RuntimeError):
        pool.submit(pow, 2, 2)


def test_an_error_comes_back_through_the_future() -> None:
    pool = ThreadPool(1, "t-pool")
    try:
        with pytest.raises(ZeroDivisionError):
            pool.submit(lambda: 1 / 0).result(5)
        assert pool.submit(lambda: 7).result(5) == 7  # the thread survived it
    finally:
        pool.shutdown()


class _Result:
    """A task's result that can be watched for being freed (a reply file's mapping)."""


def test_an_idle_thread_keeps_nothing_of_its_last_result() -> None:
    """Once the caller drops a task's future, the result goes at once: an idle
    thread that kept it would free it (a restore's mapping: an unmapping that holds
    the GIL) inside whatever task it runs next."""
    pool = ThreadPool(1, "t-pool")
    try:
        fut = pool.submit(_Result)
        ref = weakref.ref(fut.result(5))
        del fut
        # The thread lets go right after answering (bounded: it still holds it then).
        wait_until("the pool's thread letting go of its last task's result",
                   lambda: ref() is None, 5, poll_s=0.01)
    finally:
        pool.shutdown()


def test_cancelled_work_never_runs() -> None:
    started, gate = threading.Event(), threading.Event()
    ran: list[int] = []
    pool = ThreadPool(1, "t-pool")

    def hold() -> bool:
        started.set()
        return gate.wait(5)

    first = pool.submit(hold)
    later = pool.submit(ran.append, 1)
    assert started.wait(5)
    threading.Timer(0.2, gate.set).start()
    pool.shutdown(cancel_futures=True)  # while the only thread is held by ``first``
    assert first.result(5) is True
    assert later.cancelled() and ran == []


@pytest.mark.process
def test_work_submitted_at_interpreter_exit_runs() -> None:
    code = textwrap.dedent("""
        import threading
        from mtc.pool import ThreadPool
        pool = ThreadPool(2, "exit-pool")
        def at_exit():
            print(sum(f.result(10) for f in [pool.submit(pow, 3, i) for i in range(4)]))
        threading._register_atexit(at_exit)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "40"


def test_shutdown_joins_the_threads_and_raises_an_initializer_error() -> None:
    def broken() -> None:
        raise OSError("no such priority")

    pool = ThreadPool(2, "t-pool-init")
    names = {"t-pool-init_0", "t-pool-init_1"}
    assert names <= {t.name for t in threading.enumerate()}
    pool.shutdown()
    assert not names & {t.name for t in threading.enumerate()}

    bad = ThreadPool(1, "t-pool-bad", initializer=broken)
    with pytest.raises(OSError, match="no such priority"):  # not lost with its thread
        bad.shutdown()
    assert "t-pool-bad_0" not in {t.name for t in threading.enumerate()}


def test_a_lazy_pool_starts_a_thread_only_when_work_finds_none_idle() -> None:
    before = threading.active_count()
    pool = ThreadPool(8, "t-lazy", lazy=True)
    try:
        assert threading.active_count() == before  # nothing asked yet: no thread
        for i in range(5):  # one at a time: the one thread, idle again, takes each
            assert pool.submit(pow, 2, i).result(5) == 2 ** i
        assert threading.active_count() == before + 1
        release = threading.Event()
        started = threading.Semaphore(0)

        def hold() -> None:
            started.release()
            release.wait(10)
        held = [pool.submit(hold) for _ in range(3)]  # three at once: three threads
        for _ in range(3):
            assert started.acquire(timeout=5)
        assert threading.active_count() == before + 3
        release.set()
        for f in held:
            f.result(5)
    finally:
        pool.shutdown()
    assert threading.active_count() == before  # every thread it started, joined
