"""The upgrade rule of the on-disk format (docs/deploy.md, "Upgrades"): a reader
takes every manifest version up to its own, and refuses a newer one by name.

A step written by the previous format version (1: before manifests named their
run) is made here as version 1 wrote it (the same body without ``run``, checksummed
the same way), on every simulated host, and restored by today's manager.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.integrity import crc32c
from mtc.manifest import MANIFEST_NAME, VERSION, Manifest


def rewrite_as(path: Path, version: int) -> None:
    """The manifest at ``path`` as format ``version`` writes it (version 1: no run)."""
    body = json.loads(json.loads(path.read_bytes())["body"])
    body["version"] = version
    if version == 1:
        body.pop("run")
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    path.write_bytes(json.dumps({"body": text, "crc32c": crc32c(text.encode())}).encode())


def opts() -> mtc.Options:
    return mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local")


def test_a_step_of_the_previous_format_version_restores(ramdisk: Path, mesh: Mesh) -> None:
    x = jax.device_put(jnp.arange(512, dtype=jnp.float32).reshape(32, 16),
                       NamedSharding(mesh, P("model")))
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(3, {"x": x, "n": 3})
    for h in range(4):
        rewrite_as(ramdisk / f"host-{h}" / "3" / MANIFEST_NAME, 1)
    old = Manifest.from_bytes((ramdisk / "host-0" / "3" / MANIFEST_NAME).read_bytes())
    assert (old.version, old.run) == (1, "")
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        assert mgr.latest_step() == 3
        back = mgr.restore(3, target={"x": x, "n": 0})
        # A new save is written in today's version, beside the old step.
        mgr.save(4, {"x": x, "n": 4})
    np.testing.assert_array_equal(np.asarray(back["x"]), np.asarray(x))
    assert back["n"] == 3
    assert Manifest.from_bytes((ramdisk / "host-0" / "4" / MANIFEST_NAME).read_bytes()
                               ).version == VERSION


def test_a_newer_format_version_is_refused_by_name(ramdisk: Path, mesh: Mesh) -> None:
    x = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P()))
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(1, {"x": x})
    path = ramdisk / "host-0" / "1" / MANIFEST_NAME
    rewrite_as(path, VERSION + 1)
    with pytest.raises(mtc.ManifestError, match=f"version {VERSION + 1} is not supported.*"
                                                "upgrade this reader"):
        Manifest.from_bytes(path.read_bytes(), path=str(path))
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        with pytest.raises(mtc.ManifestError, match="upgrade this reader"):
            mgr.restore(1, target={"x": x})
