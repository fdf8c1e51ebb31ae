"""Round trips through the RAM-disk tier, on both invocation paths of the host-side code."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.manifest import MANIFEST_NAME, Manifest

DISPATCHES = ["local", "colocated"]


def make_state(mesh: Mesh, scale: float = 1.0) -> dict[str, Any]:
    w = jnp.arange(64 * 16, dtype=jnp.float32).reshape(64, 16) * scale
    return {
        "params": {
            "w": jax.device_put(w, NamedSharding(mesh, P("model"))),
            "emb": jax.device_put(jnp.full((8, 32), scale, jnp.bfloat16),
                                  NamedSharding(mesh, P(None, ("replica", "model")))),
            "bias": jax.device_put(jnp.ones(5) * scale, NamedSharding(mesh, P())),
        },
        "opt": [jnp.int32(3), (jnp.zeros((4,)) + scale,)],
        "step": 11,
        "rng": jax.random.key(7),
        "data": {"global_next_index": 1234},
        "lr": 0.1 + 1e-17,
        "name": "run-\u00e9",
        "blob": b"\x00\x01",
        "hist": np.arange(6, dtype=np.int64) * 2**40,
        "npscalar": np.float16(1.5),
        "nothing": None,
    }


def options(dispatch: str, **kw: Any) -> mtc.Options:
    return mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch=dispatch, **kw)  # type: ignore[arg-type]


def assert_tree_equal(a: Any, b: Any) -> None:
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(x)) == str(jax.random.key_impl(y))
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            assert np.asarray(x).dtype == np.asarray(y).dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert type(x) is type(y) and x == y, (x, y)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_round_trip_same_mesh(ramdisk: Path, mesh: Mesh, dispatch: str) -> None:
    state = make_state(mesh)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(dispatch)) as mgr:
        assert mgr.save(10, state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [10]
        restored = mgr.restore(10, state)
    assert_tree_equal(restored, state)
    w = restored["params"]["w"]
    assert w.sharding == state["params"]["w"].sharding
    # Four hosts, each with its own root and its own committed step folder.
    assert sorted(os.listdir(ramdisk)) == [f"host-{h}" for h in range(4)]
    for h in range(4):
        m = Manifest.from_bytes((ramdisk / f"host-{h}" / "10" / MANIFEST_NAME).read_bytes())
        assert m.step == 10 and m.host == h and m.slice == h // 2 and m.num_hosts == 4
        # host h holds 2 of the 8 devices: w is split over 'model' (4 ways), so a
        # host of slice 0 holds 2 row blocks; the replicated bias is written once.
        leaves = {leaf.path: leaf for leaf in m.leaves}
        assert len(leaves["['params']['w']"].shards) == 2
        assert len(leaves["['params']['bias']"].shards) == 1


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_restore_onto_half_the_devices_and_other_layouts(ramdisk: Path, mesh: Mesh,
                                                         dispatch: str) -> None:
    state = make_state(mesh, scale=3.0)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(dispatch)) as mgr:
        mgr.save(1, state)
        half = Mesh(np.array(jax.devices()[:4]), ("model",))
        one = Mesh(np.array(jax.devices()[5:6]), ("x",))
        wide = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))

        def target(m: Mesh, w_spec: P, emb_spec: P) -> dict[str, Any]:
            t = dict(state)
            t["params"] = {
                "w": jax.ShapeDtypeStruct((64, 16), jnp.float32,
                                          sharding=NamedSharding(m, w_spec)),
                "emb": jax.ShapeDtypeStruct((8, 32), jnp.bfloat16,
                                            sharding=NamedSharding(m, emb_spec)),
                "bias": jax.ShapeDtypeStruct((5,), jnp.float32, sharding=NamedSharding(m, P())),
            }
            return t

        for t in (target(half, P("model"), P(None, "model")),    # fewer devices, stacked rows
                  target(one, P(), P()),                        # everything on one device
                  target(wide, P("a", "b"), P("b", "a")),       # a finer, transposed layout
                  target(half, P(None, "model"), P("model"))):  # columns instead of rows
            restored = mgr.restore(1, t)
            for name in ("w", "emb", "bias"):
                got = restored["params"][name]
                assert got.sharding == t["params"][name].sharding
                np.testing.assert_array_equal(np.asarray(got), np.asarray(state["params"][name]))


def test_restore_without_target_gives_numpy_in_nested_containers(ramdisk: Path,
                                                                  mesh: Mesh) -> None:
    state = make_state(mesh)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options("local")) as mgr:
        mgr.save(4, state)
        got = mgr.restore(as_numpy=True)
        arrays = mgr.restore()
    np.testing.assert_array_equal(got["params"]["w"], np.asarray(state["params"]["w"]))
    assert isinstance(got["params"]["w"], np.ndarray)
    # Without as_numpy, as Orbax's: jax.Arrays laid out as saved on the manager's mesh.
    for name, saved in state["params"].items():
        back = arrays["params"][name]
        assert isinstance(back, jax.Array) and back.sharding == saved.sharding, name
        assert back.dtype == saved.dtype
        np.testing.assert_array_equal(np.asarray(back), np.asarray(saved))
    assert arrays["step"] == 11 and arrays["data"] == {"global_next_index": 1234}
    assert got["opt"][0] == 3 and got["data"] == {"global_next_index": 1234}
    assert got["step"] == 11 and got["nothing"] is None and got["name"] == "run-\u00e9"
    assert jax.random.key_data(got["rng"]).tolist() == jax.random.key_data(
        jax.random.key(7)).tolist()


def test_checkpoint_holds_values_at_save_even_if_step_donates(ramdisk: Path,
                                                              mesh: Mesh) -> None:
    sharding = NamedSharding(mesh, P("model"))
    x = jax.device_put(jnp.ones((1024, 256), jnp.float32), sharding)

    @jax.jit
    def step(a: jax.Array) -> jax.Array:
        return a * 0 + 42

    donating = jax.jit(step, donate_argnums=0)
    # A big save queued first keeps the writer busy, so step 1 is still in host
    # memory, not yet on disk, when the donating step overwrites x's buffers.
    big = jax.device_put(jnp.zeros((8192, 8192), jnp.float32), sharding)
    with mtc.CheckpointManager(ramdisk, mesh=mesh,
                               options=options("local", writer_threads=1)) as mgr:
        assert mgr.save(0, {"x": big})
        assert mgr.save(1, {"x": x})
        # Donation would reuse x's buffers in place; on CPU mtc holds views of
        # them until written, and PJRT declines to donate a viewed buffer.
        y = donating(x)
        y.block_until_ready()
        mgr.wait_until_finished()
        got = mgr.restore(1, {"x": jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=sharding)})
    np.testing.assert_array_equal(np.asarray(got["x"]), np.ones((1024, 256), np.float32))
    np.testing.assert_array_equal(np.asarray(y), np.full((1024, 256), 42, np.float32))


def test_restored_arrays_are_independent_of_the_files(ramdisk: Path, mesh: Mesh) -> None:
    """Restored buffers may map the RAM disk copy-on-write: writes must not reach the files."""
    sharding = NamedSharding(mesh, P("model"))
    x = jax.device_put(jnp.arange(4096.0).reshape(64, 64), sharding)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options("local")) as mgr:
        mgr.save(1, {"x": x})
        a = mgr.restore(1, {"x": x})["x"]
        b = jax.jit(lambda v: v + 1, donate_argnums=0)(a)
        b.block_until_ready()
        again = mgr.restore(1, {"x": x})["x"]
    np.testing.assert_array_equal(np.asarray(again), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(x) + 1)


def test_save_interval_force_and_retention(ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("model")))}
    opts = options("local", save_interval_steps=5, max_to_keep=2)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as mgr:
        saved = [s for s in range(1, 21) if mgr.save(s, state)]
        assert saved == [1, 5, 10, 15, 20]  # 1: the job's first save, as Orbax's
        assert not mgr.save(19, state) and not mgr.save(20, state)  # not newer: as Orbax's
        assert mgr.save(21, state, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 21]
        assert mgr.latest_step() == 21
        with pytest.raises(mtc.StepExistsError):
            mgr.save(21, state, force=True)
        for h in range(4):
            # Old steps are hidden at once and freed in the background; the
            # manager's writer lock (a dot file) is there while it is open.
            names = [n for n in os.listdir(ramdisk / f"host-{h}")
                     if ".mtc-del-" not in n and not n.startswith(".")]
            assert sorted(names) == ["20", "21"]
        mgr.delete(21)
        assert mgr.all_steps() == [20]
        with pytest.raises(mtc.StepNotFoundError, match="no host holds this step"):
            mgr.delete(21)
        assert issubclass(mtc.StepNotFoundError, mtc.MtcError)


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_retention_asks_the_hosts_for_steps_not_manifests(
        ramdisk: Path, mesh: Mesh, dispatch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finishing a save applies retention from the hosts' steps: no host's manifest
    comes to the controller to be parsed; a restore of the newest step after it
    still reads them (and restores the values)."""
    state = make_state(mesh)
    parsed: list[int] = []
    real = Manifest.from_bytes

    def counting(data: bytes, *, path: str = "") -> Manifest:
        m = real(data, path=path)
        parsed.append(m.host)
        return m

    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options(dispatch, max_to_keep=2)
                               ) as mgr:
        for s in (1, 2, 3):
            mgr.save(s, state, force=True)
        monkeypatch.setattr(Manifest, "from_bytes", counting)
        mgr.wait_until_finished()
        assert parsed == [] and mgr.all_steps() == [2, 3]
        assert_tree_equal(mgr.restore(None, target=state), state)
        assert sorted(parsed) == [0, 1, 2, 3]  # the newest step's, once per host


def test_new_manager_sees_committed_steps_and_cleans_uncommitted(ramdisk: Path,
                                                                 mesh: Mesh) -> None:
    state = {"w": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("model")))}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options("local")) as mgr:
        mgr.save(3, state)
    # A crash mid-save leaves a temporary folder; an unrelated folder is left alone.
    leftover = ramdisk / "host-1" / "7.mtc-tmp-deadbeef"
    leftover.mkdir()
    (leftover / "00000.0-4.bin").write_bytes(b"partial")
    (ramdisk / "host-1" / "notes").mkdir()
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options("local")) as mgr:
        assert not leftover.exists()
        assert (ramdisk / "host-1" / "notes").exists()
        assert mgr.all_steps() == [3]
        got = mgr.restore(target=state)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.ones((16, 4)))


def test_step_folder_missing_on_one_host_is_not_a_committed_step(ramdisk: Path,
                                                                 mesh: Mesh) -> None:
    state = {"w": jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("model")))}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options("local")) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.wait_until_finished()
        os.rename(ramdisk / "host-2" / "2", ramdisk / "host-2" / "2.mtc-tmp-x")
        assert mgr.all_steps() == [1]
        assert mgr.latest_step() == 1
        with pytest.raises(mtc.StepNotFoundError, match="host 2"):
            mgr.restore(2, state)


def test_replicated_leaf_shared_by_devices_survives_donation(ramdisk: Path, mesh: Mesh) -> None:
    """A replicated leaf is read once per host and its devices may share the bytes;
    a donating step on the restored array must still compute every shard right."""
    x = jax.device_put(jnp.arange(256 * 256, dtype=jnp.float32).reshape(256, 256),
                       NamedSharding(mesh, P()))
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options("local")) as mgr:
        mgr.save(1, {"x": x})
        restored = mgr.restore(1, {"x": x})["x"]
        z = jax.jit(lambda v: v * 2 + 1, donate_argnums=0)(restored)
        for shard in z.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(x) * 2 + 1)
        again = mgr.restore(1, {"x": x})["x"]
    np.testing.assert_array_equal(np.asarray(again), np.asarray(x))
