"""mtc.orbax_compat_attrs: Orbax's private CheckpointManager attributes, read-only,
with Orbax's meaning (kept for code that reads them): ``_default_item``,
``_root_metadata_file_path()``, ``_checkpoints``."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.orbax_compat_attrs import CheckpointInfo


def manager(ramdisk: Path, mesh: Mesh, sub: str = "a", **kw: Any) -> mtc.CheckpointManager:
    options = {k: kw.pop(k) for k in list(kw) if k in {f.name for f in
                                                        dataclasses.fields(mtc.Options)}}
    return mtc.CheckpointManager(ramdisk / sub, mesh=mesh, options=mtc.Options(
        simulated_hosts=2, dispatch="local", **options), **kw)


def state(mesh: Mesh, seed: float = 0.0) -> dict[str, Any]:
    return {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4) + seed,
                                NamedSharding(mesh, P("model")))}


def test_default_item_says_the_mode_and_what_locks_it_in(ramdisk: Path, mesh: Mesh) -> None:
    with manager(ramdisk, mesh) as mgr:
        assert mgr._default_item.get() is None  # not known before the first save
        assert mgr.save(0, args=ocp.args.StandardSave(state(mesh)))
        assert mgr._default_item.get() is True
        mgr.wait_until_finished()
    with manager(ramdisk, mesh, "b", item_names=("params",)) as mgr:
        assert mgr._default_item.get() is False
    with manager(ramdisk, mesh, "c", item_handlers=ocp.StandardCheckpointHandler()) as mgr:
        assert mgr._default_item.get() is True
    # A fresh manager over a one-item step: a restore locks the mode in, as Orbax's,
    # and a Composite save is then refused.
    with manager(ramdisk, mesh) as fresh:
        assert fresh._default_item.get() is None
        fresh.restore(0)
        assert fresh._default_item.get() is True
        with pytest.raises(mtc.ConfigError, match="Cannot provide `args` of type `Composite`"):
            fresh.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(state(mesh))))
    # ... and so does reading a step's metadata (a Composite step: False).
    with manager(ramdisk, mesh, "d") as mgr:
        assert mgr.save(0, args=ocp.args.Composite(params=ocp.args.StandardSave(state(mesh))))
        mgr.wait_until_finished()
    with manager(ramdisk, mesh, "d") as fresh:
        fresh.metadata(0)
        assert fresh._default_item.get() is False
    with pytest.raises(AttributeError):
        fresh._default_item = None  # type: ignore[misc]  # read-only


def test_root_metadata_file_path_names_the_file_kept(ramdisk: Path, mesh: Mesh) -> None:
    with manager(ramdisk, mesh) as mgr:
        with pytest.raises(ValueError, match="Metadata directory is not initialized"):
            mgr._root_metadata_file_path()
    with manager(ramdisk, mesh, "b", read_only=True, save_interval_steps=0,
                 metadata={"v": 1}) as reader:
        with pytest.raises(ValueError, match="Metadata directory is not initialized"):
            reader._root_metadata_file_path()  # a reader's is answered, never kept
        assert reader.metadata().custom_metadata == {"v": 1}
    with manager(ramdisk, mesh, "b", metadata={"v": 2}) as writer:
        path = writer._root_metadata_file_path()
        assert path.parent == ramdisk / "b" / "host-0"
        assert json.loads(path.read_text()) == {"v": 2}
    with manager(ramdisk, mesh, "b", read_only=True, save_interval_steps=0) as reader:
        assert reader._root_metadata_file_path() == path
        with pytest.raises(ValueError, match="legacy"):
            reader._root_metadata_file_path(legacy=True)


def test_checkpoints_are_the_steps_with_their_times_and_metrics(ramdisk: Path,
                                                                 mesh: Mesh) -> None:
    before = datetime.datetime.now(datetime.UTC)
    with manager(ramdisk, mesh, max_to_keep=2) as mgr:
        for s in range(3):
            assert mgr.save(s, state(mesh, s), metrics={"loss": float(s)})
        mgr.wait_until_finished()
        infos = mgr._checkpoints
        assert isinstance(infos, tuple) and [i.step for i in infos] == [1, 2]
        assert [i.metrics for i in infos] == [{"loss": 1.0}, {"loss": 2.0}]
        after = datetime.datetime.now(datetime.UTC)
        assert all(i.time is not None and before <= i.time <= after for i in infos)
        with pytest.raises(dataclasses.FrozenInstanceError):
            infos[0].time = before  # type: ignore[misc]  # never steers retention
    # A restarted manager reads them from the steps' manifests.
    with manager(ramdisk, mesh, max_to_keep=2) as again:
        assert again._checkpoints == infos
        assert isinstance(again._checkpoints[0], CheckpointInfo)
