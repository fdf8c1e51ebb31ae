"""An Orbax user's habits meet mtc: each one works as in Orbax or is refused with a
ConfigError that says what to use, and nothing of theirs is lost in silence.

Real parts: real Orbax option classes and ``ocp.CheckpointManager`` writing real
step folders, real mtc managers on simulated hosts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.options import local_dir_path


@pytest.mark.parametrize("url", ["gs://bucket/ckpt", "s3://bucket/ckpt", "file:///dev/shm/x",
                                 "hdfs://namenode/ckpt", "gcs+hns://b/c"])
def test_a_url_as_local_dir_is_refused_naming_the_replicators_backup(
        url: str, tmp_path: Path, mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(mtc.ConfigError, match="--backup") as e:
        mtc.CheckpointManager(url, mesh=mesh)
    assert url in str(e.value) and "mtc-replicator" in str(e.value)
    assert list(tmp_path.iterdir()) == []  # no ./gs:/bucket folder made


@pytest.mark.parametrize("path, match", [
    ("ckpt", "must be an absolute path"),
    ("./ckpt", "must be an absolute path"),
    ("~/ckpt", "does not expand"),
    ("~", "does not expand"),
    ("", "empty"),
])
def test_a_relative_or_home_local_dir_is_refused(path: str, match: str, tmp_path: Path,
                                                 mesh: Mesh,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(mtc.ConfigError, match=match):
        mtc.CheckpointManager(path, mesh=mesh)
    with pytest.raises(mtc.ConfigError, match=match):
        mtc.CheckpointManager(Path(path), mesh=mesh) if path else local_dir_path(b"")
    assert list(tmp_path.iterdir()) == []


def test_an_absolute_local_dir_is_taken_as_given(tmp_path: Path) -> None:
    assert local_dir_path(str(tmp_path)) == tmp_path
    assert local_dir_path(tmp_path / "a") == tmp_path / "a"
    assert local_dir_path(os.fsencode(tmp_path)) == tmp_path
    with pytest.raises(mtc.ConfigError, match="is a path"):
        local_dir_path(3)


def test_every_orbax_option_is_an_mtc_option_or_a_config_error_saying_what_to_use() -> None:
    """No Orbax ``CheckpointManagerOptions`` field gives a TypeError: it is an
    ``mtc.Options`` field of the same name, or a ConfigError naming it."""
    mtc_fields = {f.name for f in dataclasses.fields(mtc.Options)}
    orbax_fields = [f.name for f in dataclasses.fields(ocp.CheckpointManagerOptions)]
    assert {"save_interval_steps", "max_to_keep", "keep_period", "read_only"} <= mtc_fields
    refused = 0
    for name in orbax_fields:
        if name in mtc_fields:
            continue
        with pytest.raises(mtc.ConfigError) as e:
            mtc.Options(**{name: None})
        assert f"has no {name} ({name}: use " in str(e.value), e.value
        refused += 1
    assert refused == len(orbax_fields) - len(set(orbax_fields) & mtc_fields) >= 15
    with pytest.raises(mtc.ConfigError, match="no_such_option: no such option"):
        mtc.Options(no_such_option=1)  # type: ignore[call-arg]
    with pytest.raises(mtc.ConfigError, match="at most"):
        mtc.Options(*range(40))  # type: ignore[misc]
    # The fields mtc has still take their values, positionally or by name.
    assert mtc.Options(5).save_interval_steps == 5
    assert mtc.Options(max_to_keep=3).max_to_keep == 3


# -- steps mtc did not write -------------------------------------------------------------


def files_of(path: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``path``: (mtime, bytes)."""
    return {p.relative_to(path).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(path.rglob("*")) if p.is_file()}


def orbax_steps(directory: Path, steps: list[int]) -> dict[int, np.ndarray]:
    """Real Orbax steps written by Orbax's own CheckpointManager."""
    values = {}
    with ocp.CheckpointManager(directory) as mgr:
        for s in steps:
            values[s] = np.arange(16, dtype=np.float32) * s
            mgr.save(s, args=ocp.args.StandardSave({"w": values[s]}))
        mgr.wait_until_finished()
    return values


def test_an_orbax_step_in_local_dir_is_never_offered_replaced_or_deleted(
        ramdisk: Path, mesh: Mesh, caplog: pytest.LogCaptureFixture) -> None:
    """Steps directly in ``local_dir`` (the layout off CPU: one host per process):
    Orbax's steps 3 and 10 there are foreign to mtc. They are logged, never listed
    or restored, a save of their number is refused, retention and delete leave
    them byte for byte, and Orbax still restores them afterwards."""
    values = orbax_steps(ramdisk, [3, 10])
    before = {s: files_of(ramdisk / str(s)) for s in (3, 10)}
    assert all(before.values())
    state = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("model")))}
    options = mtc.Options(host_subdirs=False, dispatch="local", max_to_keep=1)
    with caplog.at_level(logging.WARNING, logger="mtc.manager"), \
            mtc.CheckpointManager(ramdisk, mesh=mesh, options=options) as mgr:
        assert mgr.foreign_steps == {0: [3, 10]}
        assert any("not mtc's" in r.getMessage() and "[3, 10]" in r.getMessage()
                   for r in caplog.records), caplog.text
        assert mgr.latest_step() is None and mgr.all_steps() == []
        with pytest.raises(mtc.StepNotFoundError):
            mgr.restore()
        with pytest.raises(mtc.StepNotFoundError, match="not committed"):
            mgr.restore(10, state)  # not a ManifestError: no mtc step of that number
        with pytest.raises(mtc.StepExistsError, match="not mtc's"):
            mgr.save(10, state)
        for s in (20, 30, 40):  # max_to_keep=1: each save's retention runs
            assert mgr.save(s, state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [40] and mgr.latest_step() == 40
        with pytest.raises(mtc.StepNotFoundError, match="not mtc's"):
            mgr.delete(10)
        np.testing.assert_array_equal(np.asarray(mgr.restore(40, state)["w"]),
                                      np.asarray(state["w"]))
    assert {s: files_of(ramdisk / str(s)) for s in (3, 10)} == before
    assert sorted(n for n in os.listdir(ramdisk) if n.isdigit()) == ["10", "3", "40"]
    with ocp.CheckpointManager(ramdisk, options=ocp.CheckpointManagerOptions(
            read_only=True)) as orbax:
        for s in (3, 10):
            got = orbax.restore(s, args=ocp.args.StandardRestore({"w": values[s]}))
            np.testing.assert_array_equal(got["w"], values[s])


# -- step semantics, side by side with Orbax's own manager ------------------------------


def test_save_decisions_defaults_and_delete_match_orbax(ramdisk: Path, tmp_path: Path,
                                                        mesh: Mesh) -> None:
    """The same calls on Orbax's CheckpointManager and on mtc's, with the options
    an Orbax user has (``save_interval_steps=5``, ``max_to_keep`` left at its
    default): the same saves happen, the same steps stay, and a missing step's
    delete fails in both (mtc: StepNotFoundError, an MtcError)."""
    state = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("model")))}
    assert mtc.Options().max_to_keep is None is ocp.CheckpointManagerOptions().max_to_keep
    # The first save of a job whatever its step (Orbax's initial save), the interval,
    # steps not newer than the newest, force.
    calls = [(3, False), (4, False), (5, False), (6, False), (10, False), (7, False),
             (10, False), (15, False), (12, False), (13, True), (20, False), (22, False)]
    orbax_dir = tmp_path / "orbax"
    with ocp.CheckpointManager(orbax_dir, options=ocp.CheckpointManagerOptions(
            save_interval_steps=5)) as orbax:
        want = [orbax.save(s, args=ocp.args.StandardSave(state), force=f) for s, f in calls]
        orbax.wait_until_finished()
        want_steps = list(orbax.all_steps())
        with pytest.raises(FileNotFoundError):
            orbax.delete(99)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=mtc.Options(
            save_interval_steps=5, simulated_hosts=4, dispatch="local")) as mgr:
        got = [mgr.save(s, args=ocp.args.StandardSave(state), force=f) for s, f in calls]
        mgr.wait_until_finished()
        assert got == want, list(zip(calls, got, want, strict=True))
        assert mgr.all_steps() == sorted(want_steps) == [3, 5, 10, 13, 15, 20]
        with pytest.raises(mtc.StepNotFoundError, match="step 99"):
            mgr.delete(99)
    # A new manager over the same steps: a step not newer than the newest is not
    # saved, nor one off the interval (no initial save: steps exist), in both.
    later = [(18, False), (21, False), (25, False)]
    with ocp.CheckpointManager(orbax_dir, options=ocp.CheckpointManagerOptions(
            save_interval_steps=5)) as orbax:
        want = [orbax.save(s, args=ocp.args.StandardSave(state), force=f) for s, f in later]
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=mtc.Options(
            save_interval_steps=5, simulated_hosts=4, dispatch="local")) as mgr:
        got = [mgr.save(s, args=ocp.args.StandardSave(state), force=f) for s, f in later]
        mgr.wait_until_finished()
        assert got == want == [False, False, True]
        # Deleting the newest step lets its number be saved again, as in Orbax.
        mgr.delete(25)
        assert mgr.save(25, state) and mgr.save(30, state)


# -- Orbax's restore idioms and other calls ---------------------------------------------


def test_orbax_restore_idioms_work(ramdisk: Path, mesh: Mesh) -> None:
    """A Composite restore answers like Orbax's (attribute and item access), a
    missing item is a typed error naming the saved ones, ``restore_args`` (from
    ``construct_restore_args``), ``partial_restore=True`` and a dtype cast work,
    and the manager's Orbax calls answer."""
    sharding = NamedSharding(mesh, P("model"))
    w = jax.device_put(jnp.arange(64.0, dtype=jnp.float32).reshape(16, 4), sharding)
    b = jax.device_put(jnp.ones((8,), jnp.int32), NamedSharding(mesh, P()))
    state = {"w": w, "b": b}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding), state)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, item_names=("state", "meta"),
                               options=mtc.Options(simulated_hosts=4,
                                                   dispatch="local")) as mgr:
        assert mgr.directory == ramdisk
        assert mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave({"lr": 0.5})))
        mgr.check_for_errors()
        mgr.wait_until_finished()
        got = mgr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                     meta=ocp.args.JsonRestore()))
        assert isinstance(got, ocp.args.Composite)
        assert got.meta == got["meta"] == {"lr": 0.5}
        assert got.state["w"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(got.state["w"]), np.asarray(w))
        # item_names: restore(step) gives every item, as Orbax's.
        every = mgr.restore(1)
        assert isinstance(every, ocp.args.Composite) and set(every.keys()) == {"state", "meta"}
        with pytest.raises(mtc.TargetMismatchError,
                           match=r"\['opt'\] were not saved .*\['meta', 'state'\]") as e:
            mgr.restore(1, args=ocp.args.Composite(opt=ocp.args.StandardRestore(abstract)))
        assert isinstance(e.value, mtc.MtcError) and not isinstance(e.value, KeyError)
        # restore_args, as construct_restore_args makes them: with and without item=.
        ra = ocp.checkpoint_utils.construct_restore_args(abstract)
        for args in (ocp.args.PyTreeRestore(item=abstract, restore_args=ra),
                     ocp.args.PyTreeRestore(restore_args=ra)):
            r = mgr.restore(1, args=ocp.args.Composite(state=args))
            assert r.state["w"].sharding == sharding and r.state["b"].dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(r.state["b"]), np.asarray(b))
        # A dtype cast (f32 saved, bf16 wanted), by target or by restore_args, and a
        # subset of the tree with partial_restore=True.
        bf16 = {"w": jax.ShapeDtypeStruct(w.shape, jnp.bfloat16, sharding=sharding)}
        for args in (ocp.args.PyTreeRestore(item=bf16, partial_restore=True),
                     ocp.args.PyTreeRestore(restore_args={"w": ocp.ArrayRestoreArgs(
                         dtype=jnp.bfloat16, sharding=sharding, global_shape=w.shape)},
                         partial_restore=True)):
            r = mgr.restore(1, args=ocp.args.Composite(state=args))
            assert set(r.state) == {"w"} and r.state["w"].dtype == jnp.bfloat16
            assert r.state["w"].sharding == sharding
            np.testing.assert_array_equal(np.asarray(r.state["w"]),
                                          np.asarray(w.astype(jnp.bfloat16)))
        # Across kinds a cast would change values: refused, typed.
        with pytest.raises(mtc.TargetMismatchError, match="casts a float to another float"):
            mgr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(
                {"w": jax.ShapeDtypeStruct(w.shape, jnp.int32, sharding=sharding),
                 "b": abstract["b"]})))
        # Orbax's StandardRestore (and PyTreeRestore without partial_restore) names every
        # saved leaf: one left out is refused, as Orbax's, not silently not restored.
        with pytest.raises(mtc.TargetMismatchError, match=r"do not match.*\['state'\]\['b'\]"):
            mgr.restore(1, args=ocp.args.Composite(state=ocp.args.StandardRestore(
                {"w": abstract["w"]})))
        meta = mgr.item_metadata(1)
        assert meta.state["w"] == jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=sharding)
        assert meta.meta == {"lr": 0.5}
        # Orbax's metadata: the root's (none given: {}), a step's tree, metrics, custom.
        assert mgr.metadata() == ocp.metadata.RootMetadata(custom_metadata={})
        assert mgr.metadata(1).item_metadata.state["w"] == meta.state["w"]
        assert mgr.metadata(1).custom_metadata == {} and mgr.metadata(1).metrics == {}
        assert mgr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
                        custom_metadata={"lr": 1})
        assert mgr.metadata(2).custom_metadata == {"lr": 1}
        with pytest.raises(mtc.ConfigError, match="custom_metadata is kept as JSON"):
            mgr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state)),
                     custom_metadata={"lr": object()})
        mgr.delete(2)
        assert mgr.best_step() == mgr.latest_step() == 1  # no best_fn: the latest, as Orbax's
        mgr.reload()
        assert mgr.all_steps() == [1] and not mgr.save(1, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state)))
    with pytest.raises(mtc.ConfigError, match="distinct item names"):
        mtc.CheckpointManager(ramdisk, mesh=mesh, item_names="state")


def test_best_fn_keeps_the_best_steps_as_orbax_does(ramdisk: Path, tmp_path: Path,
                                                    mesh: Mesh) -> None:
    state = {"w": jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("model")))}
    losses = {1: 0.9, 2: 0.3, 3: 0.8, 4: 0.1, 5: 0.7, 6: 0.2, 7: None, 8: 0.95, 9: 0.4,
              10: 0.5}
    for mode, keep_without in (("min", True), ("max", False)):
        kw: dict[str, Any] = dict(max_to_keep=3, keep_period=5, best_fn=lambda m: m["loss"],
                                  best_mode=mode, keep_checkpoints_without_metrics=keep_without)
        orbax_dir, local = tmp_path / f"orbax-{mode}", ramdisk / mode
        with ocp.CheckpointManager(orbax_dir, options=ocp.CheckpointManagerOptions(
                **kw)) as orbax, mtc.CheckpointManager(local, mesh=mesh, options=mtc.Options(
                    simulated_hosts=4, dispatch="local", **kw)) as mgr:
            for s, loss in losses.items():
                metrics = None if loss is None else {"loss": loss}
                assert orbax.save(s, args=ocp.args.StandardSave(state), metrics=metrics)
                assert mgr.save(s, args=ocp.args.StandardSave(state), metrics=metrics)
            orbax.wait_until_finished()
            mgr.wait_until_finished()
            assert mgr.all_steps() == list(orbax.all_steps()), mode
            assert len(mgr.all_steps()) < len(losses)  # retention deleted steps
            assert mgr.best_step() == orbax.best_step(), mode
    with pytest.raises(mtc.ConfigError, match="best_mode"):
        mtc.Options(best_fn=lambda m: m, best_mode="lowest")  # type: ignore[arg-type]
