"""mtc.elastic.CompileAhead: a user's jitted step compiled in the background for the
meshes replica resize reaches; per mesh, ready (built ahead), cached (from the
persistent compilation cache) or compiled; the thread joined on close."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtc.elastic import CACHED, COMPILED, READY, CompileAhead
from mtc.elastic.compile_ahead import COMPILE_THREAD


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[Path]:
    before = jax.config.jax_compilation_cache_dir
    try:
        yield tmp_path / "cache"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        from jax._src import compilation_cache

        compilation_cache.reset_cache()


def builder(mesh: Mesh, scale: float) -> Any:
    """``build_for``: the step on the mesh of the given slices (rows of ``mesh``);
    ``scale`` makes the program differ between tests (nothing cached across them)."""
    def build_for(slices: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
        m = Mesh(mesh.devices[list(slices)], mesh.axis_names)
        sh = NamedSharding(m, P("replica", "model"))
        fn = jax.jit(lambda x: jnp.tanh(x) * scale + x.sum(), out_shardings=sh)
        return fn, (jax.ShapeDtypeStruct((8, 16), np.float32, sharding=sh),)
    return build_for


def test_reached_meshes_are_ready_others_compiled_then_cached(mesh: Mesh,
                                                              cache: Path) -> None:
    with CompileAhead(builder(mesh, 1.25), total_slices=2, cache_dir=cache) as ahead:
        assert ahead.reach((0, 1)) == [(0,), (1,)]
        exe = ahead.executable((0,))  # waits for its job if it is still running
        assert ahead.report == {"0": READY}
        full = ahead.executable((0, 1))  # not reachable from (0, 1) itself: built now
        assert ahead.report["0-1"] == COMPILED
        x = jax.device_put(np.ones((8, 16), np.float32),
                           NamedSharding(Mesh(mesh.devices[[0]], mesh.axis_names),
                                         P("replica", "model")))
        np.testing.assert_allclose(np.asarray(exe(x)), np.tanh(1.0) * 1.25 + 128.0)
        assert full is not None
        thread = ahead._compiler._thread
    assert not thread.is_alive()  # joined on close
    jax.clear_caches()
    # A restarted process (new function objects): the persistent cache serves it.
    with CompileAhead(builder(mesh, 1.25), total_slices=2, cache_dir=cache) as again:
        again.executable((0, 1))
        assert again.report == {"0-1": CACHED}


def test_compiles_at_lower_priority_on_its_own_thread(mesh: Mesh, cache: Path) -> None:
    seen: list[tuple[str, int]] = []
    os_names: list[str] = []
    inner = builder(mesh, 2.5)

    def build_for(slices: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
        seen.append((threading.current_thread().name, slices[0]))
        # Named for the OS too, so a deployment can place it on its own cores.
        os_names.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm")
                        .read_text().strip())
        return inner(slices)

    with CompileAhead(build_for, total_slices=2, nice=5, cache_dir=cache) as ahead:
        ahead.reach((0, 1))
        ahead.executable((1,))
        ahead.executable((0,))
        assert ahead.report == {"1": READY, "0": READY}
    assert {name for name, _ in seen} == {"mtc-compile-ahead"}
    assert set(os_names) == {COMPILE_THREAD}
