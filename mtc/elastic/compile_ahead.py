"""Executables ready before they are needed: ahead-of-time compiles on a background
thread, JAX's persistent compilation cache, and a record of where each came from.

Every executable the trainer runs is built by :func:`build` (``jit(...).lower(
abstract args).compile()``) and called as the resulting ``Compiled``. Its
:class:`Built` record says whether XLA compiled it (``compiled``) or JAX found
it in the persistent cache (``cached``), how long that took, and whether it was
built ahead of time by an :class:`AheadCompiler`. A step whose executable was
already built when it first ran reports ``ready``.

Which meshes to build ahead is a pure function, :func:`ahead_meshes`.
:class:`CompileAhead` puts these together for a user's own jitted step: the
meshes replica resize reaches from where training runs, compiled in the
background at low priority, and per mesh whether its executable was ready,
cached or compiled when the loop asked for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

from mtc.lifecycle import Threads
from mtc.pool import name_native_thread

log = logging.getLogger("mtc.elastic.compile_ahead")

# The OS-level name of the background compiler's thread (``/proc/<pid>/task/*/comm``).
COMPILE_THREAD = "mtc-compile"

READY = "ready"  # built before the step needed it (ahead, or by an earlier use)
CACHED = "cached"  # loaded from the persistent compilation cache when needed
COMPILED = "compiled"  # compiled by XLA when needed

_HITS = "/jax/compilation_cache/cache_hits"

Slices = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Built:
    """How one executable came to be."""

    source: str  # CACHED or COMPILED: what building it took
    seconds: float  # lowering + compiling (or loading from the cache)
    ahead: bool  # built by the background compiler before anything asked for it


@dataclasses.dataclass(frozen=True)
class Use:
    """The first time a step ran an executable: ready, cached or compiled."""

    source: str  # READY, CACHED or COMPILED
    compile_s: float  # the executable's build time (spent ahead when READY)
    ahead: bool
    waited_s: float  # how long the step waited for it (a build still running ahead)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the persistent cache -------------------------------------------------------------

_watch = threading.local()
_listening = False
_listen_lock = threading.Lock()


def _on_event(event: str, **_: Any) -> None:
    # JAX reports cache hits in the thread that compiles: count them per thread.
    if event == _HITS:
        _watch.hits = getattr(_watch, "hits", 0) + 1


def _listen() -> None:
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            _listening = True


def enable_cache(path: Path | str | None, *, min_compile_s: float = 0.0) -> str | None:
    """Turn JAX's persistent compilation cache on in ``path`` (a folder, or a URL
    JAX's cache understands such as ``gs://``); ``None`` or ``""`` leaves it off.
    Returns the folder used. Every executable worth building ahead takes longer
    to compile than to load, so small ones are cached too (``min_compile_s``)."""
    _listen()
    if not path:
        return None
    where = str(path)
    if "://" not in where:
        Path(where).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return where


@contextlib.contextmanager
def lowered_priority(nice: int) -> Iterator[None]:
    """Run the body with this thread's ``nice`` raised by ``nice`` (Linux: per
    thread), then put it back where the OS allows (root, or RLIMIT_NICE).

    Only XLA's compile runs lowered: it releases the GIL. Tracing and lowering
    hold the GIL, and a starved thread holding it would stall the training loop
    (priority inversion), so they run at the loop's priority.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        yield
        return
    tid = threading.get_native_id()
    base = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(base + nice, 19))
    except OSError as e:
        log.warning("compiling at normal priority: %s", e)
        yield
        return
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, base)
        except OSError as e:  # not allowed back up: the rest of this thread runs lowered
            log.warning("compile thread stays at nice %d: %s", base + nice, e)


def build(jitted: Any, *args: Any, ahead: bool = False, nice: int = 0) -> tuple[Any, Built]:
    """``jitted`` lowered for ``args`` (arrays or ``ShapeDtypeStruct``s with
    shardings) and compiled (at ``nice`` more than this thread's priority), with
    the record of how."""
    _listen()
    before = getattr(_watch, "hits", 0)
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    with lowered_priority(nice):
        compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    hit = getattr(_watch, "hits", 0) > before
    return compiled, Built(CACHED if hit else COMPILED, seconds, ahead)


# -- what to build ahead --------------------------------------------------------------

def ahead_meshes(active: Slices, total: int, depth: int) -> list[Slices]:
    """The slice sets replica resize can reach next from ``active``, most likely
    first: every set of ``active`` with 1..``depth`` slices fewer (at least one
    slice left), then the way back up: ``active`` with the missing slices back,
    all of them first. ``depth`` 0 builds nothing ahead."""
    if depth <= 0:
        return []
    out: list[Slices] = []
    for k in range(1, min(depth, len(active) - 1) + 1):
        out += [tuple(c) for c in itertools.combinations(sorted(active), len(active) - k)]
    missing = sorted(set(range(total)) - set(active))
    for k in range(len(missing), 0, -1):
        out += [tuple(sorted((*active, *c))) for c in itertools.combinations(missing, k)]
    return out


# -- the background compiler ----------------------------------------------------------

class AheadCompiler:
    """One background thread that runs build jobs in order; ``close`` joins it.

    Jobs are callables that compile at lowered priority (:func:`lowered_priority`,
    ``nice`` passed on by the caller), so the training loop's threads win the CPU
    when they want it. A failing job is logged and dropped (the step then
    compiles when it is needed, as without compiling ahead). Only the thread
    that owns the compiler calls ``submit``, ``retarget`` and ``close``;
    ``wait`` may be called from any thread.
    """

    def __init__(self, *, name: str = "compile-ahead") -> None:
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._queued: set[str] = set()  # names queued and not yet run or skipped
        self._wanted: set[str] | None = None  # None: every job queued
        self._lock = threading.Lock()  # guards _queued, _wanted (two threads)
        self._finished = threading.Condition()  # notified when a job ends or is skipped
        self._ended: set[str] = set()  # guarded by _finished, as is _known
        self._known: set[str] = set()  # every name ever submitted
        self.done: list[str] = []  # job names finished (for reports and tests)
        self.failed: list[str] = []
        # Set while nothing holds the compiler: a recovery does (hold/release), and
        # then no job starts and no job's warm-up runs (they would take the CPU
        # from the restore and the first step, the critical path).
        self._released = threading.Event()
        self._released.set()
        # A daemon: XLA's compile cannot be interrupted, and ``close(timeout)`` may
        # return with one still running; it must not hold the interpreter at exit.
        self._threads = Threads(name)
        self._thread = self._threads.start(self._run, name, daemon=True)

    def submit(self, name: str, job: Callable[[], Any]) -> bool:
        """Queue ``job`` unless a job of this name is queued, or ran and succeeded."""
        with self._lock:
            if name in self._queued or name in self.done or self._stop.is_set():
                return False
            self._queued.add(name)
        with self._finished:
            self._known.add(name)
            self._ended.discard(name)
        self._jobs.put((name, job))
        return True

    def retarget(self, wanted: Sequence[str]) -> None:
        """Skip queued jobs whose names are not in ``wanted`` (the meshes reachable
        from where training now runs); they may be submitted again later."""
        with self._lock:
            self._wanted = set(wanted)

    def wait(self, name: str, timeout: float) -> bool:
        """Wait until the job ``name`` has ended (done, failed or skipped); at
        once when no such job was submitted."""
        with self._finished:
            return self._finished.wait_for(
                lambda: name in self._ended or name not in self._known, timeout)

    def hold(self) -> None:
        """Start no job (and let running ones stop at :meth:`wait_released`) until
        :meth:`release`: speculative work waits while a recovery runs."""
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def wait_released(self) -> None:
        """Called by a job between its steps (after its compile, before its
        warm-up): returns once nothing holds the compiler, or it is closing."""
        self._released.wait()  # close() sets it too

    def close(self, timeout: float | None = None) -> bool:
        """Drop the jobs not started, join the thread (``timeout``: waiting for the
        job running at most that long); whether it ended. The thread's own error
        (a job's is logged and dropped) is raised."""
        self._stop.set()
        self._released.set()
        self._jobs.put(None)
        return self._threads.join(timeout)

    def _end(self, name: str) -> None:
        with self._finished:
            self._ended.add(name)
            self._finished.notify_all()

    def _run(self) -> None:
        # Seen from outside the process, so that a deployment (or bench/goodput.py)
        # can run the compiles on other cores than the steps' devices.
        name_native_thread(COMPILE_THREAD)
        while True:
            item = self._jobs.get()
            if item is None or self._stop.is_set():
                return
            name, job = item
            self.wait_released()
            if self._stop.is_set():
                return
            with self._lock:
                self._queued.discard(name)
                skip = self._wanted is not None and name not in self._wanted
            if skip:
                self._end(name)
                continue
            try:
                job()
                with self._lock:
                    self.done.append(name)
            except Exception:  # the step compiles when it is needed instead
                log.exception("compiling %s ahead failed", name)
                self.failed.append(name)
            self._end(name)


def names(meshes: Sequence[Slices]) -> list[str]:
    return ["-".join(map(str, m)) for m in meshes]


# -- for a user's own step ----------------------------------------------------------------

class CompileAhead:
    """Compiles ``build_for(slices)`` (a jitted function and its abstract arguments,
    ``ShapeDtypeStruct``s with shardings, for the mesh of those slices) ahead, for
    every mesh replica resize can reach, on one background thread at ``nice``
    lower priority; :meth:`executable` hands the loop the executable of a mesh
    (built now if it is not yet), :attr:`report` says per mesh how it came.
    ``close`` joins the thread. Only the loop's thread calls the methods.
    """

    def __init__(self, build_for: Callable[[Slices], tuple[Any, tuple[Any, ...]]], *,
                 total_slices: int, depth: int = 1, nice: int = 10,
                 cache_dir: Path | str | None = None) -> None:
        self.cache_dir = enable_cache(cache_dir)
        self._build_for = build_for
        self._total = total_slices
        self._depth = depth
        self._nice = nice
        self._built: dict[Slices, tuple[Any, Built]] = {}
        self._lock = threading.Lock()  # guards _built (the loop and the compile thread)
        self._compiler = AheadCompiler(name="mtc-compile-ahead")
        self.report: dict[str, str] = {}  # mesh name -> READY, CACHED or COMPILED

    def _build(self, slices: Slices, ahead: bool) -> tuple[Any, Built]:
        with self._lock:
            done = self._built.get(slices)
        if done is not None:
            return done
        jitted, args = self._build_for(slices)
        made = build(jitted, *args, ahead=ahead, nice=self._nice if ahead else 0)
        with self._lock:
            return self._built.setdefault(slices, made)

    def reach(self, active: Slices) -> list[Slices]:
        """Queue the meshes reachable from ``active`` (and drop queued ones that are
        not); returns them, most likely first."""
        targets = ahead_meshes(tuple(sorted(active)), self._total, self._depth)
        self._compiler.retarget(names(targets))
        for m, name in zip(targets, names(targets), strict=True):
            self._compiler.submit(name, functools.partial(self._build, m, ahead=True))
        return targets

    def executable(self, slices: Slices, timeout: float = 600.0) -> Any:
        """The compiled step for ``slices``: built ahead (``ready``), else waited
        for if its build is running, else built now (``cached`` or ``compiled``)."""
        slices = tuple(sorted(slices))
        name = names([slices])[0]
        with self._lock:
            ready = slices in self._built
        if not ready:
            self._compiler.wait(name, timeout)
            with self._lock:
                ready = slices in self._built
        exe, built = self._build(slices, ahead=False)
        self.report.setdefault(name, READY if ready else built.source)
        return exe

    def close(self) -> None:
        self._compiler.close()

    def __enter__(self) -> CompileAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
