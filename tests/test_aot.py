"""Compiling ahead: which meshes, when to pause, the background compiler, where an
executable came from (XLA or the persistent cache)."""

from __future__ import annotations

import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtc.trainer import aot, recovery
from mtc.trainer.policy import pause_seconds
from mtc.trainer.recovery import Recovery


@pytest.mark.parametrize(("active", "total", "depth", "want"), [
    ((0, 1), 2, 1, [(0,), (1,)]),
    ((0, 1), 2, 0, []),
    ((0, 1), 2, 5, [(0,), (1,)]),  # never fewer than one slice
    ((0,), 2, 1, [(0, 1)]),  # the way back up
    ((1,), 2, 1, [(0, 1)]),
    ((0, 1, 2, 3), 4, 1, [(0, 1, 2), (0, 1, 3), (0, 2, 3), (1, 2, 3)]),
    ((0, 2), 4, 1, [(0,), (2,), (0, 1, 2, 3), (0, 1, 2), (0, 2, 3)]),
    ((0, 1, 2), 3, 2, [(0, 1), (0, 2), (1, 2), (0,), (1,), (2,)]),
])
def test_ahead_meshes(active: tuple[int, ...], total: int, depth: int,
                      want: list[tuple[int, ...]]) -> None:
    assert aot.ahead_meshes(active, total, depth) == want


@pytest.mark.parametrize(("missing", "replacing", "policy", "want"), [
    ({1}, {1}, "replacement", 3.0),  # a host being replaced: pause for it
    ({1}, set(), "replacement", 0.0),  # nothing on its way: resize at once
    ({0, 1}, {1}, "replacement", 0.0),
    (set(), set(), "replacement", 0.0),
    ({1}, set(), "always", 3.0),
    ({1}, {1}, "resize", 0.0),  # go on on the healthy slices while it is replaced
    ({0, 1}, {0, 1}, "resize", 0.0),
    (set(), set(), "resize", 0.0),
])
def test_pause_seconds(missing: set[int], replacing: set[int], policy: str,
                       want: float) -> None:
    assert pause_seconds(missing, replacing, 3.0, policy) == want


def test_pause_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="unknown pause policy"):
        pause_seconds({1}, {1}, 3.0, "sometimes")
    with pytest.raises(ValueError, match="unknown pause policy"):
        pause_seconds(set(), set(), 3.0, "sometimes")  # checked even with nothing missing


def test_ahead_compiler_runs_in_order_skips_retargeted_and_joins() -> None:
    ran: list[str] = []
    gate, started = threading.Event(), threading.Event()
    c = aot.AheadCompiler()
    try:
        assert c.submit("a", lambda: (started.set(), gate.wait(10), ran.append("a")))
        assert not c.submit("a", lambda: ran.append("again"))  # queued already
        assert c.submit("b", lambda: ran.append("b"))
        assert c.submit("c", lambda: ran.append("c"))
        c.retarget(["a", "c"])  # b is no longer reachable
        assert started.wait(10)  # a runs, held at its gate: c is behind it
        assert not c.wait("c", 0)
        assert c.wait("never-submitted", 0.0)
        gate.set()
        assert c.wait("c", 10) and c.wait("b", 10)
        assert ran == ["a", "c"] and c.done == ["a", "c"]
        assert not c.submit("a", lambda: ran.append("again"))  # built: nothing to redo
        assert c.submit("b", lambda: ran.append("b")) is True  # skipped before: may come back
        c.retarget(["a", "b", "c"])
        assert c.submit("d", lambda: 1 / 0)
        assert c.wait("b", 10) and ran == ["a", "c", "b"]
        assert c.wait("d", 10) and c.failed == []  # not wanted: skipped, never run
        c.retarget(["d"])
        assert c.submit("d", lambda: 1 / 0)
        assert c.wait("d", 10) and c.failed == ["d"]
    finally:
        assert c.close(timeout=10) is True
    assert not c._thread.is_alive()


class _Interrupt(BaseException):
    """Not an ``Exception``: a job's failure the compiler does not drop."""


def test_the_compiler_thread_is_joined_at_close_and_its_error_raised() -> None:
    c = aot.AheadCompiler(name="t-compile-ahead")
    assert c.submit("a", lambda: None) and c.wait("a", 10)
    assert c.close(10) is True
    assert "t-compile-ahead" not in {t.name for t in threading.enumerate()}

    broken = aot.AheadCompiler(name="t-compile-ahead-broken")
    started = threading.Event()

    def interrupted() -> None:
        started.set()
        raise _Interrupt("compile interrupted")

    assert broken.submit("a", interrupted) and started.wait(10)  # else close skips it
    with pytest.raises(_Interrupt, match="compile interrupted"):  # not lost with its thread
        broken.close(10)
    assert "t-compile-ahead-broken" not in {t.name for t in threading.enumerate()}


def test_lowered_priority_puts_the_thread_back() -> None:
    import os

    tid = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, tid)
    seen: list[int] = []
    with aot.lowered_priority(5):
        seen.append(os.getpriority(os.PRIO_PROCESS, tid))
    assert seen == [min(base + 5, 19)]
    after = os.getpriority(os.PRIO_PROCESS, tid)
    assert after == base or os.geteuid() != 0  # only root may always go back up


def test_build_reports_compiled_then_cached_from_the_persistent_cache(
        tmp_path: Path, mesh: Mesh) -> None:
    """A new jitted function (as in a restarted process, after the in-memory caches
    are cleared) finds the executable the first build wrote to the cache folder."""
    before = jax.config.jax_compilation_cache_dir
    try:
        assert aot.enable_cache(tmp_path / "cache") == str(tmp_path / "cache")
        sh = NamedSharding(mesh, P("replica", "model"))
        arg = jax.ShapeDtypeStruct((16, 16), np.float32, sharding=sh)

        def program() -> object:
            return jax.jit(lambda x: jnp.tanh(x) * 3.0 + x.sum(), out_shardings=sh)

        exe, built = aot.build(program(), arg)
        assert built.source == aot.COMPILED and not built.ahead and built.seconds > 0
        assert any((tmp_path / "cache").iterdir())
        jax.clear_caches()
        exe2, built2 = aot.build(program(), arg, ahead=True)
        assert built2.source == aot.CACHED and built2.ahead
        x = jax.device_put(np.arange(256, dtype=np.float32).reshape(16, 16), sh)
        np.testing.assert_array_equal(np.asarray(exe(x)), np.asarray(exe2(x)))
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        from jax._src import compilation_cache

        compilation_cache.reset_cache()


def test_recovery_record_splits_out_the_replacement_and_the_step_in_flight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A paused host loss: the replacement's own start is its own stage, and what
    recovery took beyond it; a scale-up: the step that was running on the smaller
    mesh when the slice came back (training went on) apart from the rest."""
    monkeypatch.setattr(recovery.time, "time", lambda: 110.0)
    host = Recovery("host_loss", 15, 100.0, {}, t_detect=100.2, t_slices=102.1,
                    t_restore_end=103.0, resumed_from_step=15, t_replaced=102.0)
    sec = host.entry(0.5, 0.5)["seconds"]
    assert sec["total"] == pytest.approx(10.0)
    assert sec["replacement"] == pytest.approx(2.0)
    assert sec["beyond_replacement"] == pytest.approx(8.0)
    assert "in_flight_step" not in sec
    up = Recovery("scale_up", 40, 109.0, {}, t_detect=109.3, t_slices=109.35,
                  t_restore_end=109.4, resumed_from_step=40, t_in_flight_end=109.3)
    sec = up.entry(0.5, 0.5)["seconds"]
    assert sec["in_flight_step"] == pytest.approx(0.3)
    assert sec["beyond_in_flight_step"] == pytest.approx(0.7)
    assert "replacement" not in sec
    assert up.entry(0.5, 0.5)["steps_lost"] == 0


class _SeenBlocking(threading.Event):
    """The compiler's "released" event, telling the test when a wait on it blocks
    (the compiler is held)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        if not self.is_set():
            self.blocked.set()
        return super().wait(timeout)


def test_ahead_compiler_starts_nothing_while_held() -> None:
    """A recovery holds the compiler: no job starts (and a running one waits at
    wait_released) until it is released."""
    ran: list[str] = []
    c = aot.AheadCompiler()
    c._released = released = _SeenBlocking()  # before any job: none waited on the old one
    released.set()
    try:
        c.hold()
        assert c.submit("a", lambda: ran.append("a"))
        assert released.blocked.wait(10)  # the thread took a, and waits: not started
        assert not c.wait("a", 0) and ran == []
        c.release()
        assert c.wait("a", 10)
        assert ran == ["a"]
        c.hold()
        steps: list[str] = []

        def job() -> None:
            steps.append("compiled")
            c.wait_released()
            steps.append("warmed up")

        c.release()
        released.blocked.clear()
        assert c.submit("b", job)
        c.hold()  # may land before or during the job: either way it waits
        assert released.blocked.wait(10)
        assert not c.wait("b", 0) and "warmed up" not in steps
        c.release()
        assert c.wait("b", 10)
        assert steps == ["compiled", "warmed up"]
    finally:
        c.close(10)
