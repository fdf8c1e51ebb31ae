"""Shared fixtures. Tests run on 8 CPU devices grouped into simulated hosts and slices."""

from __future__ import annotations

import os

from xla_flags import with_fast_compile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Compiled without LLVM's optimisations, here and in every process the tests start
# (tests/xla_flags.py says why).
os.environ["XLA_FLAGS"] = with_fast_compile(os.environ["XLA_FLAGS"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import faulthandler
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import lane_parts
import numpy as np
import pytest
import seam_audit
from jax.sharding import Mesh

# -- the fast lane: a test that starts a process must say so ----------------------------

EXIT_HANG_S = 60.0  # after the session, a process still exiting dumps its stacks

_SPAWN_EVENTS = {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec",
                 "os.spawn", "os.system", "os.startfile"}
_unmarked: list[str] = []  # the test running now, when it lacks the ``process`` marker


def _refuse_unmarked_spawn(event: str, args: tuple[Any, ...]) -> None:
    if _unmarked and event in _SPAWN_EVENTS:
        raise RuntimeError(f"{_unmarked[0]} started a process ({event} {str(args[:1])[:120]}) "
                           "without @pytest.mark.process: `make test-fast` would run it")


sys.addaudithook(_refuse_unmarked_spawn)


# -- the process lane in parts that run at once (tests/lane_parts.py) ---------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    lane_parts.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    lane_parts.configure(config)


_EXIT_STATUS = [0]  # the session's, for an exit that leaves Orbax's threads behind


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS[0] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A lane whose tests have all finished can still hang at exit: Python joins every
    thread not a daemon (and every executor's workers) first. A fast lane sat 4
    minutes there after its last test, several times; the stacks (dumped to stderr
    should the process still be here a minute on, once; faulthandler's watchdog is
    no Python thread) named the thread: Orbax's own ``_SignalingThread`` of one of
    the Orbax saves the side-by-side tests make, waiting out its timeout for a
    "step_directory_creation" signal whose coroutine never ran (Orbax's leak, not
    mtc's: no mtc thread was left). When every thread left is Orbax's, the lane
    exits with its status without joining them, and says so; any other thread
    still holds the exit, as it should (a leak of mtc's shows)."""
    faulthandler.dump_traceback_later(EXIT_HANG_S, file=sys.__stderr__)
    left = [t for t in threading.enumerate() if t.is_alive() and not t.daemon
            and t is not threading.main_thread()]
    if left and all(type(t).__module__.startswith("orbax.") for t in left):
        print(f"conftest: exiting without joining {len(left)} thread(s) of Orbax's own "
              f"({', '.join(sorted({type(t).__name__ for t in left}))}: waiting out a "
              f"timeout of theirs)", file=sys.__stderr__, flush=True)
        sys.stdout.flush()
        os._exit(_EXIT_STATUS[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if item.get_closest_marker("process") is None:
        _unmarked[:] = [item.nodeid]
    try:
        return (yield)
    finally:
        _unmarked.clear()


@pytest.fixture
def shm_base(tmp_path: Path) -> Path:
    """A folder name on the RAM disk for a local cluster (mtc.testing), unique to this
    test and this pytest process: two suites at once on one machine once took each
    other's clusters for their own ("a cluster already runs in /dev/shm/<test>")."""
    return Path("/dev/shm") / f"{tmp_path.name}-{os.getpid()}"


@pytest.fixture
def ramdisk() -> Iterator[Path]:
    """A fresh folder on the machine's RAM disk (/dev/shm), watched by the seam audit:
    the test fails if controller code (``mtc/``) touched anything under it directly,
    or if it left a host writer of this process running (its threads would go on
    writing there: whoever starts a thread joins it)."""
    writers = _writer_threads()
    left: set[Any] = set()
    with seam_audit.watched_root("mtc-test") as path:
        try:
            yield path
        finally:
            left = _writer_threads() - writers  # before the folder goes
    assert not left, f"the test left {len(left)} host writer(s) running: close what it opened"


def _writer_threads() -> set[threading.Thread]:
    """This process's host writers (``mtc.sidecar.save.write.Writer``), by their commit thread."""
    return {t for t in threading.enumerate() if t.name == "mtc-commit"}


@pytest.fixture
def lstats(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every path ``os.lstat`` is asked about during the test (clear it before the
    part measured): for code that must not stat every file it counts."""
    seen: list[str] = []
    real = os.lstat

    def counting(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        seen.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "lstat", counting)
    return seen


@pytest.fixture
def mesh() -> Mesh:
    """2 slices x 4 devices: axis 'replica' across slices, 'model' within a slice."""
    assert len(jax.devices()) == 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs, to fill up. Needs root (CI and the dev machines run as root)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def clusters() -> Iterator[list[Any]]:
    """Replicator clusters a test creates (tests/replicators.py); every replicator
    and sidecar is SIGKILLed at the end and its log tail printed for the failure report."""
    made: list[Any] = []
    yield made
    for c in made:
        c.stop_all()
        for r in range(c.n):
            print(f"--- replicator {r} log tail ---\n{c.log_text(r)[-3000:]}")
            if c.sidecar_log(r):
                print(f"--- sidecar {r} log tail ---\n{c.sidecar_log(r)}")


@pytest.fixture
def memory_cluster(tmp_path: Path) -> Iterator[Any]:
    """Makes clusters of whole replicators in this process over the in-memory transport
    (``mtc.sidecar.replicator.memory_cluster.MemoryCluster``: ``make(n, per_slice,
    **kw)``), each under a folder of its own in ``tmp_path``; every node of every one
    is stopped at the end."""
    from mtc.sidecar.replicator.memory_cluster import MemoryCluster

    made: list[MemoryCluster] = []

    def make(n: int, per_slice: int = 1, **kw: Any) -> MemoryCluster:
        made.append(MemoryCluster(tmp_path / f"cluster-{len(made)}", n, per_slice, **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


# -- four isolated hosts with a sidecar each (tests/replicators.sidecar_hosts) -----------

HOST_SLICES = [0, 0, 1, 1]  # 2 slices of 2 hosts, as the 8 CPU devices are grouped


@pytest.fixture(scope="module")
def _colocated_hosts(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The module's hosts, where it says ``COLOCATED_HOSTS = True``: their sidecars
    also run colocated Python on the 8 CPU devices (each starts JAX: seconds), so
    they are started once for the module's tests, which restart what they stop."""
    if not getattr(request.module, "COLOCATED_HOSTS", False):
        yield None
        return
    from replicators import sidecar_hosts

    name = Path(str(request.module.__file__)).stem.removeprefix("test_").replace("_", "-")
    with sidecar_hosts(name, HOST_SLICES, ramdisk_bytes=64 << 20, colocated_devices=8) as hs:
        yield hs


@pytest.fixture
def hosts(_colocated_hosts: Any) -> Iterator[Any]:
    """Four isolated hosts (``mtc.testing.isolation.Hosts``, slices ``HOST_SLICES``),
    a sidecar each on a 64 MiB RAM disk: fresh for each test, or the module's
    colocated ones (``COLOCATED_HOSTS``)."""
    if _colocated_hosts is not None:
        yield _colocated_hosts
        return
    from replicators import sidecar_hosts

    with sidecar_hosts("iso", HOST_SLICES, ramdisk_bytes=64 << 20) as hs:
        yield hs


@pytest.fixture(scope="session")
def rendered() -> Any:
    """Every deploy/ overlay and example job, rendered once a session
    (tests/deploy_render.py): dict of case -> the objects."""
    from deploy_render import render_cases

    return render_cases()
