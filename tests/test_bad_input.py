"""Bad input gets a typed error that names the step, host and file, and loses nothing."""

from __future__ import annotations

import os
import shutil
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


def opts(**kw: Any) -> mtc.Options:
    return mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local", **kw)


def sharded(mesh: Mesh, shape: tuple[int, ...] = (64, 16)) -> jax.Array:
    return jax.device_put(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape),
                          NamedSharding(mesh, P("model")))


def first_shard_file(ramdisk: Path, step: int, host: int) -> Path:
    m = Manifest.from_bytes((ramdisk / f"host-{host}" / str(step) / MANIFEST_NAME).read_bytes())
    entry = next(s for leaf in m.leaves for s in leaf.shards)
    return ramdisk / f"host-{host}" / str(step) / entry.file


def test_corrupt_shard_is_detected_and_named(ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": sharded(mesh)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(5, state)
        mgr.wait_until_finished()
        victim = first_shard_file(ramdisk, 5, 1)
        data = bytearray(victim.read_bytes())
        data[10] ^= 0xFF
        victim.write_bytes(bytes(data))
        with pytest.raises(mtc.CorruptShardError) as e:
            mgr.restore(5, state)
        assert e.value.step == 5 and e.value.host == 1 and e.value.path == str(victim)
        assert "checksum mismatch" in str(e.value) and str(victim) in str(e.value)
        assert isinstance(e.value, mtc.FatalError)


def test_truncated_and_missing_shards(ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": sharded(mesh)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.wait_until_finished()
        victim = first_shard_file(ramdisk, 1, 3)
        os.truncate(victim, 7)
        with pytest.raises(mtc.CorruptShardError, match="truncated") as e:
            mgr.restore(1, state)
        assert e.value.host == 3 and e.value.step == 1
        first_shard_file(ramdisk, 2, 0).unlink()
        with pytest.raises(mtc.CorruptShardError, match="missing"):
            mgr.restore(2, state)


def test_corrupt_manifest(ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": sharded(mesh)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        path = ramdisk / "host-2" / "1" / MANIFEST_NAME
        path.write_bytes(path.read_bytes().replace(b'"step\\":1', b'"step\\":9'))
        with pytest.raises(mtc.ManifestError, match="checksum") as e:
            mgr.restore(1, state)
        assert e.value.path == str(path)


@pytest.mark.parametrize("bad,match", [
    (jax.ShapeDtypeStruct((64, 8), jnp.float32), "shape"),
    (jax.ShapeDtypeStruct((64, 16), jnp.int32), "dtype"),
])
def test_wrong_shape_or_dtype_on_restore(ramdisk: Path, mesh: Mesh, bad: Any, match: str) -> None:
    state = {"w": sharded(mesh)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(3, state)
        target = {"w": jax.ShapeDtypeStruct(bad.shape, bad.dtype,
                                            sharding=NamedSharding(mesh, P("model")))}
        with pytest.raises(mtc.TargetMismatchError, match=match) as e:
            mgr.restore(3, target)
        assert e.value.step == 3 and "['w']" in str(e.value)
        # Nothing was lost: the right target still restores.
        np.testing.assert_array_equal(np.asarray(mgr.restore(3, state)["w"]),
                                      np.asarray(state["w"]))


def test_target_with_unknown_leaf_and_unknown_step(ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": sharded(mesh)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        with pytest.raises(mtc.StepNotFoundError):
            mgr.restore()
        mgr.save(3, state)
        with pytest.raises(mtc.StepNotFoundError) as e:
            mgr.restore(4, state)
        assert e.value.step == 4
        with pytest.raises(mtc.TargetMismatchError, match="opt"):
            mgr.restore(3, {"w": state["w"], "opt": state["w"]})
        # A target may name a subset of the saved tree.
        assert set(mgr.restore(3, {"w": state["w"]})) == {"w"}


def test_leaf_that_cannot_be_saved(ramdisk: Path, mesh: Mesh) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        with pytest.raises(mtc.UnsupportedLeafError, match=r"\['fn'\]"):
            mgr.save(1, {"w": sharded(mesh), "fn": lambda: 0})
        with pytest.raises(mtc.UnsupportedLeafError, match="dtype object"):
            mgr.save(1, {"names": np.array(["a", None], dtype=object)})
        # Nothing half-written became a step, and the next save works.
        assert mgr.all_steps() == []
        assert mgr.save(1, {"w": sharded(mesh)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]


def test_saving_a_committed_step_again_is_refused(ramdisk: Path, mesh: Mesh) -> None:
    """As Orbax's: a save of a step not newer than the newest returns False; forced,
    a step already committed raises StepExistsError. A new manager knows the
    hosts' steps too."""
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(1, {"w": sharded(mesh)})
        mgr.wait_until_finished()
        assert not mgr.save(1, {"w": sharded(mesh) * 2})
        with pytest.raises(mtc.StepExistsError):
            mgr.save(1, {"w": sharded(mesh) * 2}, force=True)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        assert not mgr.should_save(1) and not mgr.save(1, {"w": sharded(mesh) * 2})
        assert mgr.should_save(2)
        np.testing.assert_array_equal(np.asarray(mgr.restore(1)["w"]), np.asarray(sharded(mesh)))


@pytest.mark.process
def test_full_ram_disk_discards_the_step_and_next_save_succeeds(tiny_tmpfs: Path,
                                                                mesh: Mesh) -> None:
    small = {"w": sharded(mesh, (64, 16))}            # 4 KiB
    big = {"w": sharded(mesh, (1024, 1024))}          # 4 MiB: cannot fit beside anything
    with mtc.CheckpointManager(tiny_tmpfs, mesh=mesh, options=opts(max_to_keep=1)) as mgr:
        assert mgr.save(1, small)
        mgr.wait_until_finished()
        assert mgr.save(2, big)
        with pytest.raises(mtc.RamDiskFullError) as e:
            mgr.wait_until_finished()
        assert e.value.step == 2 and e.value.host is not None and e.value.path
        assert isinstance(e.value, mtc.RetryableError)
        # Where the step did not fit it never became visible, and no temporary
        # folder is left; it is not a committed step, and step 1 was kept.
        failed = tiny_tmpfs / f"host-{e.value.host}"
        assert "2" not in os.listdir(failed)
        for h in range(4):
            names = os.listdir(tiny_tmpfs / f"host-{h}")
            assert "1" in names and not [n for n in names if "tmp" in n], names
        assert mgr.all_steps() == [1]
        np.testing.assert_array_equal(np.asarray(mgr.restore(1, small)["w"]),
                                      np.asarray(small["w"]))
        assert mgr.save(3, small)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]
        np.testing.assert_array_equal(np.asarray(mgr.restore(3, small)["w"]),
                                      np.asarray(small["w"]))


@pytest.mark.process
def test_background_error_surfaces_on_next_save(tiny_tmpfs: Path, mesh: Mesh) -> None:
    big = {"w": sharded(mesh, (1024, 1024))}
    with mtc.CheckpointManager(tiny_tmpfs, mesh=mesh, options=opts()) as mgr:
        assert mgr.save(1, big)
        with pytest.raises(mtc.RamDiskFullError):
            for s in range(2, 50):  # the failure of step 1 is reported by a later call
                mgr.save(s, {"w": sharded(mesh, (8, 8))})
                if s == 49:
                    mgr.wait_until_finished()


def test_skip_policy_when_staging_budget_is_busy(ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": sharded(mesh, (2048, 1024))}  # 8 MiB
    budget = state["w"].nbytes + 1024
    o = opts(if_busy="skip", max_staged_bytes=budget, writer_threads=1)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=o) as mgr:
        results = [mgr.save(s, state) for s in range(1, 6)]
        mgr.wait_until_finished()
        assert results[0] is True
        assert False in results, "saves while the budget was held should be skipped"
        assert mgr.all_steps()[-1] == max(s for s, ok in zip(range(1, 6), results, strict=True)
                                          if ok)
    o = opts(if_busy="wait", max_staged_bytes=budget // 3)  # smaller than one state: streams
    with mtc.CheckpointManager(ramdisk / "w", mesh=mesh, options=o) as mgr:
        assert all(mgr.save(s, state) for s in range(1, 4))
        mgr.wait_until_finished()
        np.testing.assert_array_equal(np.asarray(mgr.restore(3, state)["w"]),
                                      np.asarray(state["w"]))


def test_step_left_on_some_hosts_by_a_crash_is_saved_again(ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": sharded(mesh)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts(max_to_keep=None)) as mgr:
        mgr.save(1, state)
        mgr.save(2, state)
        mgr.wait_until_finished()
    # A crash between the hosts' commits: step 2 exists on hosts 0, 1 and 3 only.
    shutil.rmtree(ramdisk / "host-2" / "2")
    doubled = {"w": state["w"] * 2}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts(max_to_keep=None)) as mgr:
        assert mgr.all_steps() == [1]
        assert mgr.save(2, doubled)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2]
        np.testing.assert_array_equal(np.asarray(mgr.restore(2, state)["w"]),
                                      np.asarray(doubled["w"]))
        assert mgr.last_restore_tiers == {0: "local", 1: "local", 2: "local", 3: "local"}
        assert not mgr.save(2, state)  # complete now: not newer than the newest
        with pytest.raises(mtc.StepExistsError):
            mgr.save(2, state, force=True)
