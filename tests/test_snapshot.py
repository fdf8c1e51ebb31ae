"""The per-step snapshot the demo's train step emits, kept by mtc.elastic.Snapshotter:
what it holds, and reading it back from the devices that survived a failure."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench._placing import place  # the benchmarks' helper: not the wheel's
from mtc.elastic import Snapshotter, SnapshotUnavailableError
from mtc.elastic.taken import step_copy_memory_kind
from mtc.trainer.data import VOCAB, make_iterator
from mtc.trainer.model import Config, Trainer


def _trainer(devices: list[jax.Device], replicas: int) -> Trainer:
    """The module's trainer on ``devices`` in ``replicas`` slices, one per layout: a
    trainer compiles its programs ahead of time, per instance, on first use (most
    of a test's time here), and no test changes a trainer, only the states it runs
    through one."""
    return _trainer_on(tuple(d.id for d in devices), replicas)


@functools.cache
def _trainer_on(ids: tuple[int, ...], replicas: int) -> Trainer:
    by_id = {d.id: d for d in jax.devices()}
    cfg = Config.preset("tiny", vocab_size=len(VOCAB), total_steps=10)
    mesh = Mesh(np.array([by_id[i] for i in ids]).reshape(replicas, len(ids) // replicas),
                ("replica", "model"))
    return Trainer(cfg, mesh, batch_size=8)


def _host(tree: dict) -> dict:
    return jax.tree_util.tree_map(np.asarray, tree)


def take(state: dict, arrays: dict) -> Snapshotter:
    """A snapshotter holding the step's own copy ``arrays`` of ``state``."""
    snap = Snapshotter()
    snap.adopt(state["step"], state, jax.tree_util.tree_leaves(arrays))
    snap.join()
    return snap


def _on(devices: list[jax.Device], ids: set[int]) -> list[jax.Device]:
    return [d for d in devices if d.id in ids]


def _restore(snap: Snapshotter, trainer: Trainer, healthy: list[jax.Device]) -> dict:
    return dict(snap.load(trainer.abstract_state(), reset_snapshot_state=False,
                          devices=healthy))


def test_snapshot_keeps_its_step_and_restores_from_one_surviving_slice() -> None:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    full = _trainer(devices, 2)
    data = make_iterator(seq_len=full.cfg.seq_len, global_batch_size=8, seed=0)
    state = full.init(0)
    state, _, arrays = full.step_with_snapshot(state, next(data))
    state["data"] = data.get_state()
    snap = take(state, arrays)
    want = _host({"params": state["params"], "opt_state": state["opt_state"],
                  "rng": jax.random.key_data(state["rng"])})
    leaf = jax.tree_util.tree_leaves(arrays)[0]  # the copy the snapshotter keeps
    assert leaf.sharding.memory_kind == (step_copy_memory_kind(devices) or "device")

    # The next step donates the state it started from; the snapshot is not part of it.
    state, _, _ = full.step_with_snapshot(state, next(data))
    after = _host(state["params"])
    assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree_util.tree_leaves(after), jax.tree_util.tree_leaves(want["params"]),
        strict=True))

    # Slice 0 (devices 0-3) is lost: slice 1 alone holds every shard.
    survivors = {d.id for d in devices[4:]}
    assert snap.covers(_on(devices, survivors))
    small = _trainer(devices[4:], 1)
    got = _restore(snap, small, _on(devices, survivors))
    assert got["step"] == 1 and got["data"] == {"global_next_index": 8}
    got_host = _host({"params": got["params"], "opt_state": got["opt_state"],
                      "rng": jax.random.key_data(got["rng"])})
    for a, b in zip(jax.tree_util.tree_leaves(got_host), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert {d.id for d in got["params"]["embed"].devices()} == survivors


def test_snapshot_missing_every_replica_of_a_shard_is_refused_by_name() -> None:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    full = _trainer(devices, 2)
    data = make_iterator(seq_len=full.cfg.seq_len, global_batch_size=8, seed=0)
    state, _, arrays = full.step_with_snapshot(full.init(0), next(data))
    snap = take(state, arrays)
    # Devices 1 and 5 hold the same model shard in the two slices: both lost.
    healthy = {d.id for d in devices} - {1, 5}
    assert not snap.covers(_on(devices, healthy))
    with pytest.raises(SnapshotUnavailableError,
                       match=r"snapshot leaf \[.+\]: no surviving device"):
        _restore(snap, full, _on(devices, healthy))


def test_snapshot_restores_shard_by_shard_onto_devices_and_regroups_other_layouts() -> None:
    """Onto the same layout, each device's shard comes from a surviving replica of
    that shard (no whole-array assembly); onto a mesh that splits the arrays
    differently (2 model shards instead of 4), each target shard is put together
    from the surviving parts that overlap it."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    full = _trainer(devices, 2)
    data = make_iterator(seq_len=full.cfg.seq_len, global_batch_size=8, seed=0)
    state, _, arrays = full.step_with_snapshot(full.init(0), next(data))
    state["data"] = data.get_state()
    snap = take(state, arrays)
    want = _host(arrays)
    survivors = _on(devices, {d.id for d in devices[:4]})  # slice 1 lost
    small = _trainer(devices[:4], 1)
    for target in (small, _trainer(devices[:4], 2), full):
        got = _restore(snap, target, survivors)
        got_host = _host({"params": got["params"], "opt_state": got["opt_state"],
                          "rng": jax.random.key_data(got["rng"])})
        for a, b in zip(jax.tree_util.tree_leaves(got_host), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_array_equal(a, b)
        for leaf, sh in zip(jax.tree_util.tree_leaves(got["params"]),
                            jax.tree_util.tree_leaves(target.shardings["params"]), strict=True):
            assert leaf.sharding == sh and leaf.sharding.memory_kind == "device"
    # The next step runs on what was restored (shardings match the compiled step).
    got = _restore(snap, small, survivors)
    _, loss, _ = small.step_with_snapshot(got, next(data))
    assert np.isfinite(float(loss))


def test_placed_arrays_are_copies_that_a_donating_step_cannot_take_with_it() -> None:
    """The step after a restore donates its input: had the placement aliased the
    snapshot's buffers (same device, same memory), the snapshot would be gone
    with it, and a second failure during that step would find nothing to restore."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    full = NamedSharding(Mesh(np.array(devices).reshape(2, 4), ("replica", "model")),
                         P("model"))
    small = NamedSharding(Mesh(np.array(devices[:4]).reshape(1, 4), ("replica", "model")),
                          P("model"))
    snap = {"w": jax.device_put(np.arange(64, dtype=np.float32), full)}
    placed = place(snap, {"w": small}, {d.id for d in devices[:4]})
    assert placed["w"].sharding == small
    out = jax.jit(lambda t: {"w": t["w"] + 1}, donate_argnums=0)(placed)
    assert placed["w"].is_deleted()  # donated, as the trainer's step does
    assert not snap["w"].is_deleted()
    np.testing.assert_array_equal(np.asarray(snap["w"]), np.arange(64, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(64, dtype=np.float32) + 1)


def test_a_state_saved_from_the_steps_copies_is_that_step_after_the_next_donates_it() -> None:
    """The elastic trainer saves a step from the copies it made of its new state
    while the next step runs in place: once that step donated the state, the
    saveable state is still the step's, leaf for leaf, key as a key of the same
    implementation, laid out as the state was (in host memory where there is one)."""
    devices = sorted(jax.devices(), key=lambda d: d.id)
    full = _trainer(devices, 2)
    data = make_iterator(seq_len=full.cfg.seq_len, global_batch_size=8, seed=0)
    state, _, copies = full.step_with_snapshot(full.init(0), next(data))
    want = _host({"params": state["params"], "opt_state": state["opt_state"],
                  "rng": jax.random.key_data(state["rng"])})
    impl = jax.random.key_impl(state["rng"])
    nxt, _, _ = full.step_with_snapshot(state, next(data))  # donates ``state``
    assert state["params"]["embed"].is_deleted()
    # Built after the donation, as the trainer builds it once the next step runs.
    saveable = full.state_of_copies(state, copies)
    assert saveable["step"] == 1 and nxt["step"] == 2
    assert jax.random.key_impl(saveable["rng"]) == impl
    got = _host({"params": saveable["params"], "opt_state": saveable["opt_state"],
                 "rng": jax.random.key_data(saveable["rng"])})
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    for leaf, sh in zip(jax.tree_util.tree_leaves(saveable["params"]),
                        jax.tree_util.tree_leaves(full.shardings["params"]), strict=True):
        assert leaf.sharding.spec == sh.spec and leaf.sharding.mesh == sh.mesh
    # The next step's own state differs: the copies are not its buffers.
    assert not np.array_equal(np.asarray(jax.tree_util.tree_leaves(nxt["params"])[0]),
                              jax.tree_util.tree_leaves(got["params"])[0])
