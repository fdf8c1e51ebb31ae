"""An Orbax user's habits meet mtc: each one works as in Orbax or is refused with a
ConfigError that says what to use, and nothing of theirs is lost in silence.

Real parts: real Orbax option classes and ``ocp.CheckpointManager`` writing real
step folders, real mtc managers on simulated hosts.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh

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
    assert refused > 20
    with pytest.raises(mtc.ConfigError, match="no_such_option: no such option"):
        mtc.Options(no_such_option=1)  # type: ignore[call-arg]
    with pytest.raises(mtc.ConfigError, match="at most"):
        mtc.Options(*range(40))  # type: ignore[misc]
    # The fields mtc has still take their values, positionally or by name.
    assert mtc.Options(5).save_interval_steps == 5
    assert mtc.Options(max_to_keep=3).max_to_keep == 3
