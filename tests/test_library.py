"""The library as a researcher meets it: misuse gets a typed error, nothing is lost
quietly, Orbax's common calls work, and the RAM disk sized as documented is enough.

Real parts throughout: real tmpfs mounts (root), real subprocesses that exit
without close() or are SIGKILLed holding the writer lock, the real ``mtc`` CLI,
real Orbax ``ocp.args`` objects.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from replicators import env_with_repo

import mtc
from mtc import retention
from mtc.ports import free_ports

MiB = 1 << 20


def opts(**kw: Any) -> mtc.Options:
    return mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local", **kw)


def sharded(mesh: Mesh, shape: tuple[int, ...] = (64, 16), scale: float = 1.0) -> jax.Array:
    x = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape) * scale
    return jax.device_put(x, NamedSharding(mesh, P("model")))


def run_py(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env_with_repo())


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Any]:
    """Mount real tmpfs file systems of a given size (and options); needs root."""
    mounted: list[Path] = []

    def mount(size: int, *more: str) -> Path:
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join((f"size={size}", *more)),
                            "tmpfs", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# -- a closed manager ---------------------------------------------------------------


def test_every_call_after_close_is_refused_with_a_typed_error(ramdisk: Path,
                                                              mesh: Mesh) -> None:
    state = {"w": sharded(mesh)}
    mgr = mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts())
    assert mgr.save(1, state)
    mgr.close()
    mgr.close()  # closing twice is fine
    calls = {
        "save": lambda: mgr.save(2, state),
        "wait_until_finished": mgr.wait_until_finished,
        "restore": lambda: mgr.restore(1, state),
        "latest_step": mgr.latest_step,
        "all_steps": mgr.all_steps,
        "delete": lambda: mgr.delete(1),
        "should_save": lambda: mgr.should_save(2),
        "metrics": lambda: mgr.metrics(1),
        "is_saving_in_progress": mgr.is_saving_in_progress,
    }
    for name, call in calls.items():
        with pytest.raises(mtc.ClosedError, match=f"{name}\\(\\) on a closed"):
            call()
    assert issubclass(mtc.ClosedError, mtc.FatalError)
    # close() finished the save; nothing of step 2 was written.
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as again:
        assert again.all_steps() == [1]


# -- steps ---------------------------------------------------------------------------


def test_steps_of_any_integer_type_are_accepted(ramdisk: Path, mesh: Mesh) -> None:
    state = {"w": sharded(mesh)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts(max_to_keep=None)) as mgr:
        assert mgr.save(np.int64(20), state)
        assert mgr.save(jnp.array(40), state)                 # a flax TrainState.step
        assert mgr.save(np.uint8(50), state)
        assert mgr.save(jax.device_put(jnp.int32(60), NamedSharding(mesh, P())), state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [20, 40, 50, 60]
        assert all(type(s) is int for s in mgr.all_steps())
        got = mgr.restore(np.int32(40), state)
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
        mgr.delete(jnp.array(20))
        assert mgr.all_steps() == [40, 50, 60]


@pytest.mark.parametrize("bad", [30.0, -1, np.int64(-5), True, "7", jnp.array([1, 2]),
                                 jnp.array(2.0), None])
def test_other_steps_are_refused_at_save_before_anything_is_written(ramdisk: Path, mesh: Mesh,
                                                                    bad: Any) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        with pytest.raises(mtc.InvalidStepError, match="non-negative integer"):
            mgr.save(bad, {"w": sharded(mesh)})
        mgr.wait_until_finished()
        for h in range(4):
            assert not [n for n in os.listdir(ramdisk / f"host-{h}") if not n.startswith(".")]


# -- one writer per directory ----------------------------------------------------------


HOLD_LOCK = """
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import mtc
    mgr = mtc.CheckpointManager(sys.argv[1] if len(sys.argv) > 1 else {dir!r},
                                options=mtc.Options(simulated_hosts=4, hosts_per_slice=2))
    print("holding", flush=True)
    time.sleep(600)
"""


@pytest.mark.process
def test_second_manager_on_a_directory_writes_only_when_the_first_is_idle_and_a_crash_frees_it(
        ramdisk: Path, mesh: Mesh, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(1, {"w": sharded(mesh)})
        # A second manager of this process opens (Orbax's habits: a new manager beside
        # one not closed); it cleans nothing, as the first may be writing.
        inflight = ramdisk / "host-1" / "5.mtc-tmp-inflight"
        inflight.mkdir()
        second = mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts())
        assert inflight.is_dir()
        inflight.rmdir()
        # While the first has a save in flight the second may not write (two writers).
        with monkeypatch.context() as m:
            m.setattr(mgr._dispatch, "saves_in_flight", lambda hosts: 1)
            with pytest.raises(mtc.DirectoryLockedError, match="in flight") as e:
                second.save(2, {"w": sharded(mesh)})
            assert e.value.path == str(ramdisk)
        mgr.wait_until_finished()
        assert second.all_steps() == [1]  # the refused save wrote nothing
        assert second.save(2, {"w": sharded(mesh)})  # the first is idle: the second writes
        second.close()  # the first still holds the lock: nothing released under it
        assert mgr.all_steps() == [1, 2]
        assert mgr.save(3, {"w": sharded(mesh)})
        mgr.wait_until_finished()
        # A read-only manager takes no lock, removes nothing, and writes nothing: save
        # returns False and delete is skipped, each with a warning, as Orbax's.
        leftover = ramdisk / "host-2" / "9.mtc-tmp-inflight"
        leftover.mkdir()
        with mtc.CheckpointManager(ramdisk, mesh=mesh,
                                   options=opts(read_only=True)) as reader:
            mgr.wait_until_finished()
            assert reader.all_steps() == [1, 2, 3]
            with caplog.at_level(logging.WARNING, logger="mtc.manager"):
                assert reader.save(2, {"w": sharded(mesh)}) is False
                reader.delete(1)
            skipped = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
            assert len(skipped) == 2 and "save() skipped" in skipped[0], skipped
            assert reader.all_steps() == [1, 2, 3]
        assert leftover.is_dir()
    # Released by close(): the next manager opens it, and sees the steps.
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        assert mgr.all_steps() == [1, 2, 3]

    # Another process holds it, then dies by SIGKILL: the kernel drops its lock.
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD_LOCK.format(
        dir=str(ramdisk)))], stdout=subprocess.PIPE, text=True, env=env_with_repo())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        with pytest.raises(mtc.DirectoryLockedError, match=f"process {proc.pid}") as e:
            mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts())
        assert e.value.path == str(ramdisk / "host-0")
        assert "host_subdirs=True" in str(e.value)  # Orbax's processes sharing a folder
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        assert mgr.all_steps() == [1, 2, 3]


@pytest.mark.process
def test_unusable_local_dir_gives_an_mtc_error_naming_the_path(ramdisk: Path, mesh: Mesh,
                                                               tmpfs: Any) -> None:
    a_file = ramdisk / "file"
    a_file.write_text("x")
    for where in (a_file, a_file / "below"):
        with pytest.raises(mtc.LocalDirError) as e:
            mtc.CheckpointManager(where, mesh=mesh, options=opts())
        assert str(a_file) in str(e.value)
    read_only = tmpfs(MiB, "ro")
    with pytest.raises(mtc.LocalDirError, match="Read-only") as e:
        mtc.CheckpointManager(read_only / "ckpt", mesh=mesh, options=opts())
    assert str(read_only / "ckpt") in str(e.value)
    assert isinstance(e.value, mtc.MtcError)


# -- the RAM disk, sized as docs/deploy.md says ------------------------------------------


@pytest.mark.parametrize(("complete", "held", "keep", "period", "before", "want"), [
    ([], [1, 2], 2, None, False, []),
    ([1, 2, 3], [1, 2, 3], 2, None, False, [1]),
    ([1, 2, 3], [1, 2, 3], 2, None, True, [1, 2]),        # before a write: keep 1
    ([1, 2, 3], [1, 2, 3], 1, None, True, [1, 2]),        # never the newest complete
    ([1, 2, 3], [1, 2, 3, 4], 2, None, True, [1, 2]),     # 4: partial, newer: kept
    ([2, 3], [1, 2, 3], 2, None, False, [1]),             # 1: partial, older: goes
    ([10, 20, 30, 40], [10, 20, 30, 40], 1, 20, False, [10, 30]),  # keep_period 20
    ([1, 2, 3], [1, 2, 3], None, None, True, []),
])
def test_retention_policy(complete: list[int], held: list[int], keep: int | None,
                          period: int | None, before: bool, want: list[int]) -> None:
    assert retention.to_delete(complete, held, max_to_keep=keep, keep_period=period,
                               before_write=before) == want


@pytest.mark.process
def test_ram_disk_of_the_documented_size_holds_every_save(tmpfs: Any, mesh: Mesh) -> None:
    # One host (all 8 devices), 1 MiB of shards: docs/deploy.md's formula says
    # max(2, max_to_keep) x host shard bytes x 1.15.
    host_bytes = 1 * MiB
    disk = tmpfs(int(2 * host_bytes * 1.15))
    w = sharded(mesh, (256, 1024))  # 1 MiB, float32
    assert w.nbytes == host_bytes
    options = mtc.Options(max_to_keep=2, save_interval_steps=10)
    with mtc.CheckpointManager(disk, mesh=mesh, options=options) as mgr:
        # The README's loop: a save every 10 steps, nobody waits in between.
        for step in range(0, 200):
            mgr.save(step, {"w": w * step, "step": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [180, 190]
        got = mgr.restore(190, {"w": w, "step": 0})
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(w * 190))
    # On CPU devices restored arrays map the step's files: until they are gone,
    # deleting the step frees no RAM-disk space (docs/deploy.md says so).
    del got
    gc.collect()
    # keep_period: multiples of 200 are never deleted.
    with mtc.CheckpointManager(disk, mesh=mesh, options=mtc.Options(
            max_to_keep=1, keep_period=200)) as mgr:
        mgr.save(200, {"w": w, "step": 200})
        mgr.save(201, {"w": w, "step": 201})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [200, 201]


# -- a save in flight at interpreter exit --------------------------------------------------


@pytest.mark.process
def test_save_in_flight_at_exit_is_finished_and_said(ramdisk: Path, mesh: Mesh) -> None:
    r = run_py(f"""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import mtc
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
        x = jax.device_put(jnp.ones((4096, 4096), jnp.float32) * 3,   # 64 MiB
                           NamedSharding(mesh, P("model")))
        mgr = mtc.CheckpointManager({str(ramdisk)!r}, mesh=mesh,
                                    options=mtc.Options(simulated_hosts=4, hosts_per_slice=2))
        assert mgr.save(7, {{"x": x}})
        print("saved", mgr.is_saving_in_progress(), flush=True)
        # no close(): the interpreter exits with the save being written
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "saved True", r.stdout
    assert "was not closed (interpreter exit): finishing its saves" in r.stderr, r.stderr
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        assert mgr.all_steps() == [7]
        got = mgr.restore(7)
    np.testing.assert_array_equal(got["x"], np.full((4096, 4096), 3, np.float32))


# -- restore targets and types ------------------------------------------------------------


class Pair(NamedTuple):
    a: Any
    b: Any


def test_target_without_sharding_is_refused_and_dict_keys_keep_their_type(
        ramdisk: Path, mesh: Mesh) -> None:
    w = sharded(mesh)
    state = {"layers": {0: {"kernel": w}, 1: {"kernel": w * 2}},   # an NNX pure dict
             "seq": [w, (3, 4)], "pair": Pair(1, 2.5), "h": np.arange(3)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(1, state)
        with pytest.raises(mtc.TargetMismatchError, match=r"ShapeDtypeStruct without \.sharding"):
            mgr.restore(1, {"layers": {0: {"kernel": jax.ShapeDtypeStruct(w.shape, w.dtype)}}})
        # With a sharding it is an array; with a numpy target, numpy (asked for).
        got = mgr.restore(1, {"layers": {0: {"kernel": jax.ShapeDtypeStruct(
            w.shape, w.dtype, sharding=w.sharding)}, 1: {"kernel": np.zeros(w.shape, w.dtype)}}})
        assert isinstance(got["layers"][0]["kernel"], jax.Array)
        assert isinstance(got["layers"][1]["kernel"], np.ndarray)
        raw = mgr.restore(1, as_numpy=True)
        orbax_like = mgr.restore(1)
    # Without a target, as Orbax's: arrays on the manager's mesh as saved, string keys.
    assert sorted(orbax_like["layers"]) == ["0", "1"]
    kernel = orbax_like["layers"]["1"]["kernel"]
    assert isinstance(kernel, jax.Array) and kernel.sharding == w.sharding
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(w) * 2)
    assert isinstance(orbax_like["h"], np.ndarray)  # numpy saved, numpy back (as Orbax's)
    # as_numpy=True: numpy, with the key types saved.
    assert set(raw) == {"layers", "seq", "pair", "h"}
    assert isinstance(raw["layers"], dict) and sorted(raw["layers"]) == [0, 1]
    assert all(type(k) is int for k in raw["layers"])
    np.testing.assert_array_equal(raw["layers"][1]["kernel"], np.asarray(w) * 2)
    assert isinstance(raw["seq"], list) and raw["seq"][1] == [3, 4]
    assert isinstance(raw["seq"][0], np.ndarray)
    assert raw["pair"] == {"a": 1, "b": 2.5}


def test_one_info_line_per_save_and_restore(ramdisk: Path, mesh: Mesh,
                                            caplog: pytest.LogCaptureFixture) -> None:
    state = {"w": sharded(mesh)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        caplog.set_level(logging.INFO, logger="mtc")
        mgr.save(5, state)
        mgr.restore(5, state)
    lines = [r.getMessage() for r in caplog.records if r.name == "mtc.manager"]
    saves = [m for m in lines if m.startswith("mtc: save step 5:")]
    restores = [m for m in lines if m.startswith("mtc: restored step 5:")]
    assert len(saves) == 1 and len(restores) == 1, lines
    # This process's hosts' bytes (each of the 4 hosts writes the regions it holds:
    # the leaf is replicated over the 2 slices) and where they go.
    assert f"{2 * state['w'].nbytes} bytes of 4 hosts" in saves[0], saves
    assert f"writing to {ramdisk}/host-{{0..3}}" in saves[0], saves
    assert "bytes in" in restores[0] and "from the local tier" in restores[0]


# -- Orbax habits ----------------------------------------------------------------------------


def test_orbax_args_metrics_and_should_save(ramdisk: Path, mesh: Mesh) -> None:
    w = sharded(mesh)
    abstract = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=w.sharding)}
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts(
            save_interval_steps=5, max_to_keep=None)) as mgr:
        # No step yet: any step is the job's first save (Orbax's initial save).
        assert mgr.should_save(5) and mgr.should_save(6)
        assert mgr.save(5, args=ocp.args.StandardSave({"w": w}), metrics={"loss": jnp.float32(
            0.25), "acc": 0.5})
        assert not mgr.should_save(5)  # not again, as Orbax's
        assert not mgr.should_save(6)  # off the interval, now that a step exists
        # Orbax's two modes: this manager saves one item; a Composite is refused (a
        # ValueError, as Orbax's), and the reverse below.
        with pytest.raises(ValueError, match=r"single, unnamed \(default\) checkpointable"):
            mgr.save(10, args=ocp.args.Composite(state=ocp.args.PyTreeSave({"w": w * 2})))
        assert mgr.save(10, args=ocp.args.PyTreeSave({"w": w * 2}))
        assert not mgr.reached_preemption(10)  # one process: no preemption service
        mgr.wait_until_finished()
        assert not mgr.is_saving_in_progress()
        assert mgr.metrics(5) == {"loss": np.float32(0.25), "acc": 0.5}
        assert mgr.metrics(10) is None
        got = mgr.restore(5, args=ocp.args.StandardRestore(abstract))
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(w))
        assert set(mgr.restore(5)) == {"w"}  # metrics are not part of the state
        with mtc.CheckpointManager(ramdisk / "items", mesh=mesh, options=opts(),
                                   item_names=("state", "meta")) as items:
            assert items.save(10, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave({"w": w * 2}), meta=ocp.args.JsonSave({"lr": 0.1})))
            with pytest.raises(ValueError, match="Must provide `args` of type `Composite`"):
                items.save(11, args=ocp.args.PyTreeSave({"w": w}))
            both = items.restore(10, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        assert set(both) == {"state", "meta"} and both["meta"] == {"lr": 0.1}
        assert both["state"]["w"].sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(both["state"]["w"]), np.asarray(w) * 2)
        # A positional ocp.args object, or an option mtc does not have, says what to do.
        with pytest.raises(mtc.ConfigError, match="pass it as args="):
            mgr.save(15, ocp.args.StandardSave({"w": w}))
        with pytest.raises(mtc.ConfigError, match="pass it as args="):
            mgr.restore(5, ocp.args.StandardRestore(abstract))
        with pytest.raises(mtc.ConfigError, match="transforms is not supported"):
            mgr.restore(5, args=ocp.args.PyTreeRestore(item=abstract, transforms={}))
        # Shardings alone: shapes and dtypes are the checkpoint's, as Orbax's.
        alone = mgr.restore(5, args=ocp.args.PyTreeRestore(restore_args={
            "w": ocp.ArrayRestoreArgs(sharding=w.sharding)}))
        assert alone["w"].sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(alone["w"]), np.asarray(w))
        with pytest.raises(mtc.ConfigError, match="needs the state"):
            mgr.save(15)
        with pytest.raises(mtc.ConfigError, match="cannot save NumpyRandomKeySaveArgs"):
            mgr.save(15, args=ocp.args.NumpyRandomKeySave(np.zeros(2)))
        assert mgr.all_steps() == [5, 10]


# -- mtc status --------------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtc.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env_with_repo())


@pytest.mark.process
def test_status_reads_a_local_directory_and_fails_when_nodes_are_down(ramdisk: Path,
                                                                      mesh: Mesh) -> None:
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts()) as mgr:
        mgr.save(1, {"w": sharded(mesh)})
        mgr.save(2, {"w": sharded(mesh)})
    (ramdisk / "host-3" / "3.mtc-tmp-abc").mkdir()          # a crash's leftover
    (ramdisk / "host-3" / "3.mtc-tmp-abc" / "x.bin").write_bytes(b"12345")
    (ramdisk / "host-3" / "7").mkdir()                      # another tool's step (no manifest)
    (ramdisk / "host-3" / "7" / "_CHECKPOINT_METADATA").write_bytes(b"{}")
    r = cli("status", "--local-dir", str(ramdisk), "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["on_every_host"] == [1, 2]
    assert [Path(h["root"]).name for h in got["hosts"]] == [f"host-{i}" for i in range(4)]
    for h in got["hosts"]:
        root = Path(h["root"])
        assert h["steps"] == {s: sum(p.stat().st_size for p in (root / s).rglob("*"))
                              for s in ("1", "2")}
        assert all(b > 0 for b in h["steps"].values())
    assert got["hosts"][3]["leftovers"] == {"3.mtc-tmp-abc": 5}
    assert got["hosts"][3]["foreign"] == {"7": 2}
    assert all(h["foreign"] == {} for h in got["hosts"][:3])
    text = cli("status", "--local-dir", str(ramdisk))
    assert text.returncode == 0 and "3.mtc-tmp-abc" in text.stdout, text
    assert "foreign step folder 7 (2 B)" in text.stdout, text.stdout
    # Replicators asked about and down (nothing listens there): not 0.
    addrs = ",".join(f"127.0.0.1:{p}" for p in free_ports(2))
    r = cli("status", "--nodes", addrs)
    assert r.returncode == 1 and "2 of 2 nodes are down" in r.stderr, r
    assert cli("status", "--local-dir", str(ramdisk / "nope")).returncode == 1


def test_manager_collected_unclosed_still_commits_its_save(ramdisk: Path, mesh: Mesh) -> None:
    """A garbage-collected manager that was never closed still commits its save."""
    x = sharded(mesh, (512, 256))
    mgr = mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts())
    mgr.save(3, {"x": x})
    del mgr
    gc.collect()  # the finalizer finishes the save on a thread of its own, then lets go
    from mtc import lifecycle

    assert lifecycle.join_finishing(30)
    again = mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts())
    with again:
        np.testing.assert_array_equal(np.asarray(again.restore(3, {"x": x})["x"]),
                                      np.asarray(x))
