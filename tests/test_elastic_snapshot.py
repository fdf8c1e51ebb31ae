"""mtc.elastic.Snapshotter: Orbax's interface (save, join, latest, load), every kind of
leaf round-trips, a lost slice is covered by the other's replica, a shard no device
holds any more falls back to mtc's tiers (or raises Orbax's RuntimeError), and the
in-graph snapshot. Devices are lost through pathwaysutils' DeviceLossSimulator (the
demo's subclass that copes with reused ids): the real fault injector, as no real
slice can fail on this machine."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.elastic import InGraphStep, Snapshotter, SnapshotUnavailableError
from mtc.elastic.taken import is_key
from mtc.trainer.faults import SliceLossSimulator


def elastic_iterator() -> Any:
    ds = grain.MapDataset.range(1000).map(lambda i: np.int32(i))
    return grain.experimental.ElasticIterator(
        ds, 8, grain.sharding.ShardOptions(shard_index=0, shard_count=1),
        read_options=grain.ReadOptions(num_threads=1, prefetch_buffer_size=2))


def make_state(mesh: Mesh, it: Any, scale: float = 1.0) -> dict[str, Any]:
    return {
        "params": {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8) * scale,
                                       NamedSharding(mesh, P(None, "model"))),
                   "b": jax.device_put(jnp.arange(8, dtype=jnp.int32),
                                       NamedSharding(mesh, P()))},
        "rng": jax.device_put(jax.random.key(3), NamedSharding(mesh, P())),
        "step": 7, "lr": 0.5, "name": "run", "data": it.get_state(),
    }


def abstract(state: dict[str, Any], mesh: Mesh) -> dict[str, Any]:
    """``state``'s shape on ``mesh`` (same specs), placeholders for plain values."""
    def one(x: Any) -> Any:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype,
                                        sharding=NamedSharding(mesh, x.sharding.spec))
        return x
    return jax.tree_util.tree_map(one, state)


def assert_same(a: Any, b: Any) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(x)) == str(jax.random.key_impl(y))
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, jax.Array):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert type(x) is type(y) and x == y


@pytest.fixture
def sim() -> Iterator[SliceLossSimulator]:
    s = SliceLossSimulator()
    s.start()
    try:
        yield s
    finally:
        s.stop()


def slice_mesh(mesh: Mesh, s: int) -> Mesh:
    return Mesh(mesh.devices[s:s + 1], mesh.axis_names)


def test_round_trip_every_kind_of_leaf(mesh: Mesh) -> None:
    """Arrays, a PRNG key, ints, floats, strings and a real grain ElasticIterator's
    state come back equal; ``latest.step`` and ``last_load_tier`` say what."""
    it = elastic_iterator()
    for _ in range(3):
        next(it)
    state = make_state(mesh, it)
    snap = Snapshotter()
    assert snap.latest is None
    assert snap.save(7, state)
    snap.join()
    assert snap.latest is not None and snap.latest.step == 7
    back = snap.load(abstract(state, mesh))
    assert_same(back, state)
    assert snap.last_load_tier == "memory"
    fresh = elastic_iterator()
    fresh.set_state(back["data"])
    assert np.array_equal(next(fresh), next(it))  # the same batch next


def test_snapshot_holds_values_at_save_when_the_step_donates(mesh: Mesh) -> None:
    state = make_state(mesh, elastic_iterator())
    want = np.asarray(state["params"]["w"])
    snap = Snapshotter()
    snap.save(1, state)
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x + 1, p), donate_argnums=0)
    state["params"] = step(state["params"])
    snap.join()
    back = snap.load(abstract(state, mesh))
    np.testing.assert_array_equal(np.asarray(back["params"]["w"]), want)


def test_save_is_skipped_while_a_copy_is_in_flight(mesh: Mesh) -> None:
    """The loop never waits: a second save while the first copy waits on a step
    that has not finished is dropped, and the first one lands."""
    gate, entered = threading.Event(), threading.Event()

    def hold(x: np.ndarray) -> np.ndarray:
        entered.set()
        gate.wait(30)  # bounded; the test opens it in any case
        return x

    sh = NamedSharding(mesh, P(None, "model"))
    held = jax.jit(lambda x: jax.pure_callback(
        hold, jax.ShapeDtypeStruct(x.shape, x.dtype), x), out_shardings=sh)
    step = jax.jit(lambda x: x + 1, out_shardings=sh)
    x0 = jax.device_put(jnp.ones((8, 8)), sh)
    step(x0).block_until_ready()  # compiled before the devices are held
    # Dispatched on a thread of its own: since jax 0.12.1 a program with a host
    # callback runs on the calling thread until the callback returns. Before, the
    # call returns at once, and its output is what is saved; since, a step
    # dispatched after it waits behind it on the devices, which run their
    # programs in order, and the step's output is saved.
    out: list[jax.Array] = []
    busy = threading.Thread(target=lambda: out.append(held(x0)))
    busy.start()
    try:
        assert entered.wait(30)
        busy.join(0.5)
        x, want = (out[0], 1.0) if out else (step(x0), 2.0)
        snap = Snapshotter()
        assert snap.save(1, {"x": x})
        assert not snap.save(2, {"x": x}) and snap.skipped == 1
        assert snap.latest is None  # not done yet
    finally:
        gate.set()
        busy.join()
    snap.join()
    assert snap.latest is not None and snap.latest.step == 1
    back = snap.load(abstract({"x": x}, mesh))
    np.testing.assert_array_equal(np.asarray(back["x"]), np.full((8, 8), want))
    assert snap.save(3, {"x": x})


def test_a_lost_slice_is_covered_by_the_other(mesh: Mesh, sim: SliceLossSimulator) -> None:
    state = make_state(mesh, elastic_iterator())
    snap = Snapshotter()
    snap.save(5, state)
    snap.join()
    for d in mesh.devices[1]:
        sim.mark_device_lost(d)
    on0 = slice_mesh(mesh, 0)
    back = snap.load(abstract(state, on0))
    assert snap.last_load_tier == "memory"
    assert back["params"]["w"].sharding.mesh.devices.tolist() == on0.devices.tolist()
    for d in mesh.devices[1]:
        sim.mark_device_connected(d)
    expect = make_state(mesh, elastic_iterator())
    assert_same(back, expect)
    # reset_snapshot_state: the snapshot now lives on slice 0 and loads again.
    assert snap.latest is not None and snap.latest.step == 5
    again = snap.load(abstract(state, mesh))
    np.testing.assert_array_equal(np.asarray(again["params"]["w"]),
                                  np.asarray(expect["params"]["w"]))


def unreplicated(mesh: Mesh) -> dict[str, Any]:
    """A state with a leaf sharded along both axes: no replica on the other slice."""
    return {"w": jax.device_put(jnp.arange(64.0).reshape(8, 8),
                                NamedSharding(mesh, P(("replica", "model")))), "step": 2}


def test_a_shard_no_device_holds_raises_orbaxs_error(mesh: Mesh,
                                                    sim: SliceLossSimulator) -> None:
    snap = Snapshotter()
    with pytest.raises(RuntimeError):  # Orbax: "No snapshots available to restore from."
        snap.load({"w": 0})
    state = unreplicated(mesh)
    snap.save(2, state)
    snap.join()
    sim.mark_device_lost(mesh.devices[0][1])
    with pytest.raises(SnapshotUnavailableError, match=r"\['w'\]") as e:
        snap.load(abstract(state, slice_mesh(mesh, 1)))
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, mtc.MtcError)


def test_without_a_covering_snapshot_load_falls_back_to_mtc(ramdisk: Path, mesh: Mesh,
                                                           sim: SliceLossSimulator) -> None:
    """With ``manager=``, the newest step mtc restores (its RAM disks here: 'local')."""
    state = unreplicated(mesh)
    opts = mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local")
    with mtc.CheckpointManager(ramdisk / "local", mesh=mesh, options=opts) as mgr:
        assert mgr.save(2, state, force=True)
        mgr.wait_until_finished()
        snap = Snapshotter(manager=mgr)
        snap.save(2, state)
        snap.join()
        sim.mark_device_lost(mesh.devices[1][3])
        back = snap.load(abstract(state, mesh))
        assert snap.last_load_tier == "local"
        assert snap.latest is not None and snap.latest.step == 2
        assert back["step"] == 2
    for d in mesh.devices.flat:
        sim.mark_device_connected(d)
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(64.0).reshape(8, 8))


def test_in_graph_snapshot_every_step_or_none(mesh: Mesh) -> None:
    """The jitted step emits the copy: the snapshot is the step's new state (extra
    plain values beside it); a step without ``snapshot_step`` leaves it alone."""
    state = {k: v for k, v in make_state(mesh, elastic_iterator()).items()
             if k in ("params", "rng")}
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, state)

    def train_step(s: dict[str, Any], lr: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        rng, _ = jax.random.split(s["rng"])
        params = jax.tree_util.tree_map(lambda p: p + lr.astype(p.dtype), s["params"])
        return {"params": params, "rng": rng}, lr * 2

    snap = Snapshotter()
    step_fn = InGraphStep(train_step, snap, state_shardings=shardings)
    state, _ = step_fn(state, jnp.float32(1.0), snapshot_step=1,
                       snapshot_extra={"data": {"global_next_index": 8}, "step": 1})
    snap.join()  # latest names a snapshot once its copy is done
    assert snap.latest is not None and snap.latest.step == 1
    want = jax.tree_util.tree_map(np.asarray, state["params"])
    want_rng = np.asarray(jax.random.key_data(state["rng"]))
    state, _ = step_fn(state, jnp.float32(1.0))  # no snapshot: donates, snapshot stays
    assert snap.latest.step == 1
    target = {**abstract(state, mesh), "data": {"global_next_index": 0}, "step": 0}
    back = snap.load(target)
    assert back["step"] == 1 and back["data"] == {"global_next_index": 8}
    for k in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(back["params"][k]), want[k])
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(back["rng"])), want_rng)


def test_a_loaded_state_donated_by_the_next_step_leaves_the_snapshot(mesh: Mesh) -> None:
    """``load`` keeps the host-memory stage as the new snapshot (no second copy); the
    device-memory state it returns is a copy the next step may donate."""
    state = make_state(mesh, elastic_iterator())
    want = np.asarray(state["params"]["w"])
    snap = Snapshotter()
    snap.save(7, state)
    snap.join()
    for target in (mesh, slice_mesh(mesh, 0), mesh):
        back = snap.load(abstract(state, target))
        assert back["params"]["w"].sharding.memory_kind == "device"
        step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x * 0, p), donate_argnums=0)
        step(back["params"])
        assert back["params"]["w"].is_deleted()
        assert snap.latest is not None and snap.latest.step == 7
    again = snap.load(abstract(state, mesh))
    np.testing.assert_array_equal(np.asarray(again["params"]["w"]), want)


@pytest.fixture
def splits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ``addressable_shards`` taken of arrays (jax.Array's own property)."""
    calls: list[int] = []
    cls = type(jax.numpy.zeros(1))
    orig = cls.__dict__["addressable_shards"]

    def counted(arr: Any) -> Any:
        calls.append(id(arr))
        return orig.fget(arr)
    monkeypatch.setattr(cls, "addressable_shards", property(counted))
    return calls


def test_a_snapshot_is_not_taken_apart_until_a_load_needs_its_shards(
        mesh: Mesh, splits: list[int]) -> None:
    """Taking a snapshot (``save``, the in-graph ``adopt``) costs nothing per device:
    a snapshot is taken every step, and a split is a Python object per shard
    (leaves x devices). Only a load takes the arrays apart, to ask which shards
    survive."""
    state = make_state(mesh, elastic_iterator())
    snap = Snapshotter()
    for step in range(3):
        assert snap.save(step, state)
        snap.join()
    arrays = {k: state[k] for k in ("params", "rng")}
    copies = jax.device_put([jax.random.key_data(x) if is_key(x) else x
                             for x in jax.tree_util.tree_leaves(arrays)])
    snap.adopt(3, {**state, "step": 3}, copies)
    assert snap.latest is not None and snap.latest.step == 3
    assert splits == []
    back = snap.load(abstract(state, slice_mesh(mesh, 0)))
    assert splits  # the load asked for the shards
    assert back["step"] == 3
    np.testing.assert_array_equal(np.asarray(back["params"]["w"]),
                                  np.asarray(state["params"]["w"]))


def test_a_runtime_that_will_not_split_a_damaged_array_falls_back(
        ramdisk: Path, mesh: Mesh, sim: SliceLossSimulator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the runtime refuses to take apart an array with a failed device (what
    Pathways does there is for a real cluster to show), no shard of it counts as
    surviving: the load falls back to mtc's tiers, and without a manager raises
    Orbax's error; it never fails with the runtime's own."""
    state = make_state(mesh, elastic_iterator())
    cls = type(state["params"]["w"])
    orig = cls.__dict__["addressable_shards"]

    def refusing(arr: Any) -> Any:
        if sim.is_array_corrupted(arr):
            raise jax.errors.JaxRuntimeError("DATA_LOSS: cannot disassemble")
        return orig.fget(arr)
    opts = mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local")
    with mtc.CheckpointManager(ramdisk / "local", mesh=mesh, options=opts) as mgr:
        assert mgr.save(7, state, force=True)
        mgr.wait_until_finished()
        alone = Snapshotter()
        snap = Snapshotter(manager=mgr)
        for s in (alone, snap):
            s.save(7, state)
            s.join()
        monkeypatch.setattr(cls, "addressable_shards", property(refusing))
        for d in mesh.devices[1]:
            sim.mark_device_lost(d)
        with pytest.raises(SnapshotUnavailableError, match=r"\['params'\]\['b'\]"):
            alone.load(abstract(state, slice_mesh(mesh, 0)))
        back = snap.load(abstract(state, slice_mesh(mesh, 0)))
        assert snap.last_load_tier == "local"
        assert back["step"] == 7
    for d in mesh.devices[1]:
        sim.mark_device_connected(d)
    np.testing.assert_array_equal(np.asarray(back["params"]["w"]),
                                  np.asarray(make_state(mesh, elastic_iterator())["params"]["w"]))


def test_settle_releases_the_replaced_snapshot_without_waiting(mesh: Mesh) -> None:
    """``settle`` (called by a loop right after dispatching its next step) promotes
    the snapshot whose copy is done and releases the one it replaces there and then;
    it never waits for a copy in flight."""
    import weakref

    state = {k: v for k, v in make_state(mesh, elastic_iterator()).items()
             if k in ("params", "rng")}
    snap = Snapshotter()

    def copies(s: dict[str, Any]) -> list[jax.Array]:
        return [jax.device_put(jax.random.key_data(x) if is_key(x) else x, x.sharding,
                               may_alias=False) for x in jax.tree_util.tree_leaves(s)]

    first = copies(state)
    released = [weakref.ref(a) for a in first]
    snap.adopt(1, state, first)
    del first
    second = copies(state)
    jax.block_until_ready(second)
    snap.adopt(2, state, second)  # step 1 becomes the newest; 2 is pending
    del second
    assert all(r() is not None for r in released)  # step 1's copies: the newest snapshot
    snap.settle()  # step 2's copies are done: it is the newest, step 1's are released
    assert all(r() is None for r in released)
    assert snap.latest is not None and snap.latest.step == 2

    class InFlight:  # a copy not done yet: settle leaves everything as it is
        def is_ready(self) -> bool:
            return False

    snap._pending_arrays = [InFlight()]  # type: ignore[list-item]
    pending = snap._pending = snap._latest
    snap.settle()
    assert snap._pending is pending
