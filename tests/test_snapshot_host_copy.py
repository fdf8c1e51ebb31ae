"""A snapshot kept in this process's numpy memory (mtc.elastic.host_copy), as a
snapshotter keeps one from a multi-controller process's own accelerator: chosen by
``host_copies="numpy"`` here, on CPU devices, where the automatic choice is
``pinned_host``. The copy in device memory an accelerator makes first
(mtc.save.device_copy) is played by a compiled copy the test hands the
snapshotter's copier (on CPU the copier copies nothing): its fetch runs on the
snapshotter's thread, the state's own arrays are read before ``save`` returns."""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_elastic_snapshot import abstract, assert_same, elastic_iterator, make_state

from mtc.elastic import Snapshotter, host_copy
from mtc.elastic.placement import index_of
from mtc.pool import ThreadPool
from mtc.save.device_copy import Copied, copy_in_device_memory


def with_device_copies(snap: Snapshotter, gate: threading.Event | None = None) -> list[int]:
    """Make ``snap``'s copier copy every array as an accelerator's would (a compiled
    copy the step never donates); ``gate``: each fetch of those copies waits for it.
    Returns a list that counts the fetches begun."""
    began: list[int] = []

    def copy(arrays: Any) -> Copied:
        return Copied(copy_in_device_memory(list(arrays)), frozenset(range(len(arrays))))

    snap._copier.copy = copy  # type: ignore[method-assign]
    if gate is not None:
        fetch = host_copy.fetch

        def held(arrays: Any, **kw: Any) -> Any:
            if arrays:
                began.append(1)
                assert gate.wait(30)
            return fetch(arrays, **kw)

        snap._fetch_pieces = held  # type: ignore[attr-defined]
    return began


def test_every_kind_of_leaf_round_trips_through_numpy(mesh: Mesh) -> None:
    state = make_state(mesh, elastic_iterator())
    snap = Snapshotter(host_copies="numpy")
    assert snap.save(7, state)
    snap.join()
    assert snap.latest is not None and snap.latest.step == 7
    kept = [leaf for leaf in snap._latest.leaves if hasattr(leaf, "host")]  # type: ignore[union-attr]
    assert kept and all(leaf.whole is None and leaf.host for leaf in kept)
    assert all(isinstance(x, np.ndarray) for leaf in kept for _, x in leaf.host)
    assert_same(snap.load(abstract(state, mesh)), state)
    assert snap.last_load_tier == "memory"


def test_a_replicated_array_is_kept_once_and_a_sharded_one_per_shard(mesh: Mesh) -> None:
    n = mesh.devices.size
    rep = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P()))
    split = jax.device_put(jnp.arange(8.0 * n).reshape(8, n),
                           NamedSharding(mesh, P(None, "model")))
    pieces = host_copy.fetch([rep, split], ahead=1)
    assert len(pieces[0]) == 1
    np.testing.assert_array_equal(pieces[0][0][1], np.arange(16.0))
    distinct = {index_of(idx, split.shape)
                for idx in split.sharding.devices_indices_map(split.shape).values()}
    assert len(pieces[1]) == len(distinct)
    whole = np.zeros((8, n))
    for idx, x in pieces[1]:
        whole[tuple(slice(a, b) for a, b in idx)] = x
    np.testing.assert_array_equal(whole, np.asarray(split))


def test_values_of_the_save_survive_a_donating_step_read_directly(mesh: Mesh) -> None:
    """No device copy: the state's own arrays are read before save returns, so the
    step that donates and overwrites them right after leaves the snapshot alone."""
    state = make_state(mesh, elastic_iterator())
    want = np.asarray(state["params"]["w"])
    snap = Snapshotter(host_copies="numpy")
    # The fetch thread busy until the step below has run: whatever the snapshot
    # reads there, it reads after the donation.
    gate = threading.Event()
    snap._fetches = ThreadPool(1, "test-fetch")
    snap._fetches.submit(gate.wait, 30)
    try:
        assert snap.save(1, state)
        step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x + 1, p), donate_argnums=0)
        state["params"] = step(state["params"])
        jax.block_until_ready(state["params"])
    finally:
        gate.set()
    snap.join()
    back = snap.load(abstract(state, mesh))
    np.testing.assert_array_equal(np.asarray(back["params"]["w"]), want)
    snap.close()


def test_device_copies_are_fetched_on_the_thread_and_the_loop_never_waits(mesh: Mesh) -> None:
    state = make_state(mesh, elastic_iterator())
    want = np.asarray(state["params"]["w"])
    gate = threading.Event()
    snap = Snapshotter(host_copies="numpy")
    began = with_device_copies(snap, gate)
    try:
        assert snap.save(1, state)
        step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x + 1, p), donate_argnums=0)
        state["params"] = step(state["params"])
        # save returned with its fetch held: the snapshot is in flight, not done.
        assert not snap.save(2, state) and snap.skipped == 1
        assert snap.latest is None
    finally:
        gate.set()
    snap.join()
    assert began == [1]
    assert snap.latest is not None and snap.latest.step == 1
    back = snap.load(abstract(state, mesh))
    np.testing.assert_array_equal(np.asarray(back["params"]["w"]), want)
    snap.close()


def test_a_fetch_that_fails_keeps_the_previous_snapshot(mesh: Mesh) -> None:
    state = make_state(mesh, elastic_iterator())
    snap = Snapshotter(host_copies="numpy")
    assert snap.save(1, state)
    snap.join()

    def broken(arrays: Any, **kw: Any) -> Any:
        raise RuntimeError("Array has been deleted (played: a copy lost under the fetch)")

    with_device_copies(snap)
    snap._fetch_pieces = broken  # type: ignore[attr-defined]
    assert snap.save(2, {**state, "step": 8})
    snap.join()
    assert snap.latest is not None and snap.latest.step == 1
    assert_same(snap.load(abstract(state, mesh)), state)
    snap.close()


def test_a_load_keeps_the_numpy_snapshot_as_the_newest(mesh: Mesh) -> None:
    """The load copies onto the devices; the step that donates what it loaded
    leaves the snapshot, which a second load still reads."""
    state = make_state(mesh, elastic_iterator())
    want = np.asarray(state["params"]["w"])
    snap = Snapshotter(host_copies="numpy")
    snap.save(3, state)
    snap.join()
    back = snap.load(abstract(state, mesh))
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x * 0, p), donate_argnums=0)
    step(back["params"])
    assert snap.latest is not None and snap.latest.step == 3
    again = snap.load(abstract(state, mesh))
    np.testing.assert_array_equal(np.asarray(again["params"]["w"]), want)


@pytest.mark.parametrize("choice", [None, "pinned"])
def test_cpu_devices_keep_pinned_snapshots_unless_asked(mesh: Mesh, choice: str | None) -> None:
    state = make_state(mesh, elastic_iterator())
    assert not host_copy.numpy_serves([state["params"]["w"]])  # CPU: not an accelerator
    snap = Snapshotter(host_copies=choice)
    snap.save(1, state)
    snap.join()
    assert all(leaf.whole is not None for leaf in snap._latest.leaves  # type: ignore[union-attr]
               if hasattr(leaf, "whole"))


def test_an_unknown_host_copy_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="host_copies"):
        Snapshotter(host_copies="gpu")


def test_a_replaced_snapshot_is_freed_in_bounded_bursts(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Freeing holds the GIL, so the release thread frees RELEASE_BYTES at most
    between two pauses (all at once, a 1.6 GB snapshot cost the loop's thread 75 ms
    on a TPU v5e host), and in the end frees every buffer."""
    import weakref

    from mtc.elastic import snapshot
    from mtc.elastic.placement import Shards
    from mtc.elastic.taken import Taken

    mib = 1 << 20
    buffers = [np.ones(mib // 8) for _ in range(10)]  # 1 MiB each
    alive = [weakref.ref(b) for b in buffers]
    index = ((0, mib // 8),)
    leaves = tuple(Shards((mib // 8,), np.float64, None, host=((index, b),)) for b in buffers)
    holder = [Taken(3, None, leaves, (None,) * len(leaves), True, 0.0)]
    del buffers, leaves
    monkeypatch.setattr(snapshot, "RELEASE_BYTES", 3 * mib)
    at_pause: list[int] = []
    monkeypatch.setattr(snapshot.time, "sleep",
                        lambda s: at_pause.append(sum(r() is not None for r in alive)))
    snapshot._drop(holder)
    assert holder == []
    assert at_pause == [7, 4, 1]  # three buffers freed a burst, a pause between two
    assert not any(r() is not None for r in alive)

    # Behind another release waiting its turn: no pause, so releases never pile up.
    more = [np.ones(mib // 8) for _ in range(4)]
    alive = [weakref.ref(b) for b in more]
    holder = [Taken(4, None, tuple(Shards((mib // 8,), np.float64, None, host=((index, b),))
                                   for b in more), (None,) * 4, True, 0.0)]
    del more
    at_pause.clear()
    snapshot._drop(holder, lambda: 1)
    assert at_pause == [] and not any(r() is not None for r in alive)


def test_a_compiled_steps_copies_are_fetched_once_computed(
        mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled step's copies land with its loss: their transfers are issued once
    they are computed, after the loss the loop fetched (on a TPU v5e host the loss
    waited up to 143 ms behind them). A save's copy in device memory is computed
    before the step it precedes, and its transfers are issued at once."""
    monkeypatch.setattr("mtc.elastic.snapshot.on_accelerator",
                        lambda x: isinstance(x, jax.Array))
    state = make_state(mesh, elastic_iterator())
    snap = Snapshotter(host_copies="numpy", loop_budget=1.0)
    with_device_copies(snap)
    asked: list[bool] = []
    fetch = host_copy.fetch

    def recording(arrays: Any, **kw: Any) -> Any:
        asked.append(kw.get("ready_first", False))
        return fetch(arrays, **kw)

    snap._fetch_pieces = recording  # type: ignore[attr-defined]
    assert snap.save(1, state)
    snap.join()
    arrays = [x for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
    copies = [jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
              else x for x in arrays]
    snap.adopt(2, state, [jnp.copy(c) for c in copies])
    snap.join()
    assert asked == [False, True]
    assert snap.latest is not None and snap.latest.step == 2
    assert_same(snap.load(abstract(state, mesh)), state)
    snap.close()

    waited: list[int] = []
    monkeypatch.setattr(host_copy.jax, "block_until_ready",
                        lambda xs: waited.append(len(xs)) or xs)
    host_copy.fetch(copies[:2])
    assert waited == []
    host_copy.fetch(copies[:2], ready_first=True)
    assert waited == [2]
