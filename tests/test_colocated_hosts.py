"""Colocated Python run by the hosts' sidecars, as Pathways workers run it.

The controller uses JAX's real ``colocated_python`` API (``ColocatedDispatch``);
instead of JAX's CPU fallback, which runs the function in this process and checks
nothing, each host's sidecar process gets the program as JAX pickles it, runs it
on CPU devices of its own (numbered differently from this process's), sees only
its own shards, and has its result checked against the declared specs. With
root, each host is also its own network and mount namespace: this process cannot
see a step file.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental import colocated_python
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pathwaysutils.elastic import elastic as pw_elastic
from pathwaysutils.test.mock_fault_injection import DeviceLossSimulator
from replicators import colocated_options, save_two_and_restore, sidecar_hosts

import mtc
from mtc.credentials import Credentials
from mtc.dispatch.process import Sidecar
from mtc.dispatch.protocol import WorkerLostError
from mtc.dispatch.remote_colocated import Runtime
from mtc.errors import ColocatedCallError
from mtc.operations import HELLO, NoArgs
from mtc.testing.isolation import Hosts

pytestmark = pytest.mark.process  # every test here runs on the sidecar processes

SLICES = [0, 0, 1, 1]


COLOCATED_HOSTS = True  # the module's hosts: tests/conftest.py


def _runtime(hs: Hosts) -> Runtime:
    """Device ``i`` on host ``i // 2``, as the manager's simulated hosts group them."""
    creds = Credentials(token=hs.token())
    sidecars = {i: Sidecar(h.sidecar_address, h.area, creds) for i, h in enumerate(hs.hosts)}
    return Runtime(sidecars, {d.id: d.id // 2 for d in jax.devices()})


def _per_host() -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec("d"))


def test_save_restore_through_colocated_sidecars(hosts: Hosts, mesh: Mesh,
                                                 tmp_path: Path) -> None:
    w = jax.device_put(np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
                       NamedSharding(mesh, PartitionSpec("replica", "model")))
    state = {"w": w, "b": jax.device_put(np.arange(16, dtype=np.int32),
                                         NamedSharding(mesh, PartitionSpec())),
             "np": np.arange(5, dtype=np.int64), "step": 7}
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh,
                               options=colocated_options(hosts)) as mgr:
        back, moved = save_two_and_restore(mgr, state)
    for got in (back, moved):
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(back["b"]), np.arange(16))
    np.testing.assert_array_equal(back["np"], np.arange(5))
    assert back["step"] == 7
    if hosts.isolation == "namespaces":
        for h in hosts.hosts:  # the RAM disks are private to the hosts' processes
            assert list(h.root.iterdir()) == []


def test_a_state_in_pinned_host_memory_saves_and_restores(hosts: Hosts, mesh: Mesh,
                                                         tmp_path: Path) -> None:
    # A training step's own copy of its state, in host memory (as the elastic
    # trainer's snapshot is, and saved from while the next step runs): its memory
    # kind crosses to the workers with it. It once reached a sidecar as a
    # pinned-host sharding over device buffers, and the save failed there.
    sharding = NamedSharding(mesh, PartitionSpec("replica", "model"))
    assert "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}
    value = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    w = jax.device_put(value, sharding.with_memory_kind("pinned_host"))
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh,
                               options=colocated_options(hosts)) as mgr:
        assert mgr.save(3, {"w": w}, force=True)
        mgr.wait_until_finished()
        back = mgr.restore(3, {"w": jax.ShapeDtypeStruct((8, 16), np.float32,
                                                         sharding=sharding)})
        pinned = mgr.restore(3, {"w": jax.ShapeDtypeStruct((8, 16), np.float32,
                                                           sharding=w.sharding)})
    np.testing.assert_array_equal(np.asarray(back["w"]), value)
    assert back["w"].sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(pinned["w"]), value)
    assert pinned["w"].sharding.memory_kind == "pinned_host"


def test_a_step_not_found_names_the_sidecars_not_a_controller_folder(
        hosts: Hosts, mesh: Mesh, tmp_path: Path) -> None:
    # With sidecars the controller's local_dir holds nothing: the error names what
    # the user configured.
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh,
                               options=colocated_options(hosts)) as mgr:
        with pytest.raises(mtc.StepNotFoundError) as err:
            mgr.restore(123456, {"w": np.zeros(3)})
    assert "sidecars" in str(err.value) and hosts.hosts[0].sidecar_address in str(err.value)
    assert "controller" not in str(err.value)


def test_a_closed_manager_leaves_no_program_in_the_sidecars(hosts: Hosts, mesh: Mesh,
                                                            tmp_path: Path) -> None:
    from mtc.contract import AgentConfig
    from mtc.dispatch import ProcessDispatch

    creds = Credentials(token=hosts.token())
    sidecars = {i: Sidecar(h.sidecar_address, h.area, creds) for i, h in enumerate(hosts.hosts)}
    config = AgentConfig(local_dir=str(tmp_path), host_of_device={},
                         slice_of_host=dict(enumerate(SLICES)), subdirs=False,
                         max_staged_bytes=None, writer_threads=1)
    probe = ProcessDispatch(config, sidecars, creds=creds)

    def programs() -> list[int]:
        return [probe._rpc(h, HELLO, NoArgs()).programs for h in sidecars]

    try:
        w = jax.device_put(np.ones((8, 16), np.float32),
                           NamedSharding(mesh, PartitionSpec("replica", "model")))
        with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh,
                                   options=colocated_options(hosts)) as mgr:
            mgr.save(77, {"w": w})  # the hosts are the module's: a step of its own
            mgr.wait_until_finished()
            assert all(n > 0 for n in programs())
        assert programs() == [0] * len(sidecars)
    finally:
        probe._channels_close()


def test_steady_state_saves_reuse_a_slot_of_each_area(hosts: Hosts, mesh: Mesh,
                                                     tmp_path: Path) -> None:
    """A save's shards cross into a reused slot of each host's area (as a worker
    copies them into host buffers it reuses), never a fresh file per save; the
    slot is refilled only once its save was written, and a closed manager takes
    its slots away."""
    sharding = NamedSharding(mesh, PartitionSpec("replica", "model"))
    opts = dataclasses.replace(colocated_options(hosts), max_to_keep=2)
    areas: list[list[list[str]]] = []
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh, options=opts) as mgr:
        for step in range(100, 104):  # 4 MiB per host: more than a message carries
            w = jax.device_put(np.full((8, 1 << 19), step, np.float32), sharding)
            assert mgr.save(step, {"w": w})
            mgr.wait_until_finished()
            areas.append([sorted(p.name for p in h.area.iterdir()) for h in hosts.hosts])
        back = mgr.restore(103, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype,
                                                           sharding=sharding)})
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(w))
    for files in areas[0]:
        assert len(files) == 1 and files[0].startswith("slot-"), files
    assert all(a == areas[0] for a in areas), areas  # the same slot, save after save
    assert [sorted(p.name for p in h.area.iterdir()) for h in hosts.hosts] == [[]] * 4


def test_a_step_that_donates_the_state_after_save_changes_nothing_saved(
        hosts: Hosts, mesh: Mesh, tmp_path: Path) -> None:
    """A save's stage call may reach the hosts after ``save`` returned (here queued
    behind the save before it); a training step that donates the state's buffers
    at once neither fails that call nor changes what it writes."""
    sharding = NamedSharding(mesh, PartitionSpec("replica", "model"))
    scalar = NamedSharding(mesh, PartitionSpec())
    step = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x * 0 - 1, s), donate_argnums=0)
    opts = dataclasses.replace(colocated_options(hosts), max_to_keep=2)
    steps = (150, 151)  # the hosts are the module's: steps of its own
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh, options=opts) as mgr:
        for n in steps:  # 4 MiB per host each: the first one's stage is still in flight
            state = {"w": jax.device_put(np.full((8, 1 << 19), n, np.float32), sharding),
                     "n": jax.device_put(np.int32(n), scalar)}
            assert mgr.save(n, state)
            state = jax.block_until_ready(step(state))
        mgr.wait_until_finished()
        like = {"w": jax.ShapeDtypeStruct((8, 1 << 19), np.float32, sharding=sharding),
                "n": jax.ShapeDtypeStruct((), np.int32, sharding=scalar)}
        for n in steps:
            back = mgr.restore(n, like)
            assert int(back["n"]) == n
            np.testing.assert_array_equal(np.asarray(back["w"]), np.full((8, 1 << 19), n))


def test_a_restores_arrays_come_back_through_reply_slots_never_refilled_under_them(
        hosts: Hosts, mesh: Mesh, tmp_path: Path) -> None:
    """A restore's arrays cross back through slots the hosts reuse, and adopt their
    mapping here (no copy): a slot is refilled only once every array over it is
    gone. Restores whose arrays are all still held keep their values, however
    many follow; once they are dropped, the next restore reuses a slot."""
    from mtc.slots import REPLY_PREFIX

    sharding = NamedSharding(mesh, PartitionSpec("replica", "model"))
    target = {"w": jax.ShapeDtypeStruct((8, 1 << 19), np.float32, sharding=sharding)}

    def names() -> set[str]:
        return {p.name for h in hosts.hosts for p in h.area.iterdir()}

    opts = dataclasses.replace(colocated_options(hosts), max_to_keep=2)
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh, options=opts) as mgr:
        for step in (200, 201):  # 4 MiB per host: more than a message carries
            assert mgr.save(step, {"w": jax.device_put(
                np.full((8, 1 << 19), step, np.float32), sharding)})
        mgr.wait_until_finished()
        saved = names()
        held = [(step, mgr.restore(step, target)["w"]) for step in (200, 201, 200, 201)]
        for step, w in held:  # each restore's values, whatever came after it
            assert np.all(np.asarray(w) == step), step
        replies = names() - saved
        assert replies and all(n.startswith(REPLY_PREFIX) for n in replies), replies
        assert len(replies) <= 2 * len(hosts.hosts)  # busy slots: fresh files instead
        del held, w
        for step in (201, 200):
            assert np.all(np.asarray(mgr.restore(step, target)["w"]) == step)
        assert names() - saved == replies  # refilled, not made anew
    assert [sorted(p.name for p in h.area.iterdir()) for h in hosts.hosts] == [[]] * 4


def test_two_managers_over_the_same_devices_each_reach_their_own_hosts(
        hosts: Hosts, mesh: Mesh, tmp_path: Path) -> None:
    """Two managers open at once over the same CPU devices, each with its own
    sidecars (two clusters from one controller): a program JAX first compiles
    for one of them (a restore's load, after the other opened) goes to that
    manager's hosts, never to the newer manager's."""
    sharding = NamedSharding(mesh, PartitionSpec("replica", "model"))
    target = {"w": jax.ShapeDtypeStruct((8, 16), np.float32, sharding=sharding)}
    with sidecar_hosts("coloc2", SLICES, ramdisk_bytes=64 << 20,
                       colocated_devices=8) as other, \
            mtc.CheckpointManager(tmp_path / "a", mesh=mesh, options=colocated_options(hosts)) as a:
        assert a.save(500, {"w": jax.device_put(np.full((8, 16), 1, np.float32), sharding)})
        a.wait_until_finished()
        with mtc.CheckpointManager(tmp_path / "b", mesh=mesh,
                                   options=colocated_options(other)) as b:
            assert b.save(500, {"w": jax.device_put(np.full((8, 16), 2, np.float32),
                                                    sharding)})
            b.wait_until_finished()
            assert np.all(np.asarray(a.restore(500, target)["w"]) == 1)
            assert np.all(np.asarray(b.restore(500, target)["w"]) == 2)


def test_prng_keys_cross_a_call_as_jax_converts_them(hosts: Hosts) -> None:
    """JAX's compile step sends a PRNG key array as its key data and wraps it back on
    either side; the local runtime does the same instead of refusing it."""

    @colocated_python.colocated_python
    def split_first(k: jax.Array) -> jax.Array:
        assert jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key)  # a key on the worker
        return k

    keys = jax.device_put(jax.random.split(jax.random.key(7), 8), _per_host())
    out_spec = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=keys.sharding)
    runtime = _runtime(hosts)
    try:
        got = split_first.specialize(out_specs_fn=lambda _: out_spec)(keys)
    finally:
        runtime.close()
    assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)),
                                  np.asarray(jax.random.key_data(keys)))


def test_each_host_sees_its_own_shards_on_devices_of_its_own(hosts: Hosts) -> None:
    """A worker's function reads only its addressable shards, on its own devices."""

    @colocated_python.colocated_python
    def where(x: jax.Array) -> jax.Array:
        pieces = [jax.device_put(np.array([[int(np.asarray(s.data)[0]), s.device.id,
                                            len(x.addressable_shards), os.getpid()]], np.int32),
                                 s.device)
                  for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays((x.shape[0], 4), x.sharding, pieces)

    sharding = _per_host()
    x = jax.device_put(np.arange(8, dtype=np.int32) * 10, sharding)
    out_spec = jax.ShapeDtypeStruct((8, 4), np.int32, sharding=sharding)
    runtime = _runtime(hosts)
    try:
        got = np.asarray(where.specialize(out_specs_fn=lambda _: out_spec)(x))
    finally:
        runtime.close()
    np.testing.assert_array_equal(got[:, 0], np.arange(8) * 10)  # each device its own shard
    assert set(got[:, 2]) == {2}  # a host's function sees its two shards only
    pids = got[:, 3]
    assert len(set(pids)) == 4 and os.getpid() not in pids  # four sidecar processes
    assert all(pids[2 * h] == pids[2 * h + 1] for h in range(4))
    assert all(got[i, 1] != i for i in range(8))  # worker ids are not the controller's


def test_a_result_in_pinned_host_memory_comes_back_in_that_memory(hosts: Hosts) -> None:
    """An output declared in pinned host memory is placed there on the controller,
    as its input was on the workers (the runtime keeps a sharding's memory kind)."""

    @colocated_python.colocated_python
    def doubled(x: jax.Array) -> jax.Array:
        return jax.device_put(x * 2, x.sharding)

    sharding = _per_host().with_memory_kind("pinned_host")
    x = jax.device_put(np.arange(8, dtype=np.int32), sharding)
    spec = jax.ShapeDtypeStruct((8,), np.int32, sharding=sharding)
    runtime = _runtime(hosts)
    try:
        got = doubled.specialize(out_specs_fn=lambda _: spec)(x)
    finally:
        runtime.close()
    assert got.sharding.memory_kind == "pinned_host"
    assert {s.data.sharding.memory_kind for s in got.addressable_shards} == {"pinned_host"}
    np.testing.assert_array_equal(np.asarray(got), np.arange(8) * 2)


@pytest.mark.parametrize(("wrong", "error"), [
    ("dtype", r"output 0 is float32\[8\], declared int32\[8\]"),
    ("sharding", r"output 0 is not on its declared sharding")])
def test_a_result_that_breaks_its_declared_spec_fails_the_call(hosts: Hosts, wrong: str,
                                                               error: str) -> None:
    # Defined here, not at module level: a sidecar cannot import this test module,
    # so the function must travel by value.
    @colocated_python.colocated_python
    def wrong_dtype(x: jax.Array) -> jax.Array:
        return x.astype(np.float32)

    @colocated_python.colocated_python
    def replicated(x: jax.Array) -> jax.Array:
        """Right dtype and shape, but whole on every device where the spec splits it."""
        whole = NamedSharding(x.sharding.mesh, PartitionSpec())
        pieces = [jax.device_put(np.arange(8, dtype=np.int32), s.device)
                  for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape, whole, pieces)

    fun = wrong_dtype if wrong == "dtype" else replicated
    sharding = _per_host()
    x = jax.device_put(np.arange(8, dtype=np.int32), sharding)
    spec = jax.ShapeDtypeStruct((8,), np.int32, sharding=sharding)
    runtime = _runtime(hosts)
    try:
        with pytest.raises(ColocatedCallError, match=error):
            fun.specialize(out_specs_fn=lambda _: spec)(x)
    finally:
        runtime.close()


def test_a_controller_device_id_in_a_closure_fails_on_the_worker(hosts: Hosts) -> None:
    """Placing a result by a controller id lands on a device that is not the host's."""
    controller_ids = [d.id for d in jax.devices()]

    @colocated_python.colocated_python
    def by_controller_id(x: jax.Array) -> jax.Array:
        devices = {d.id: d for d in jax.devices()}
        pieces = [jax.device_put(np.asarray(s.data), devices[controller_ids[k]])
                  for k, s in enumerate(x.addressable_shards)]
        return jax.make_array_from_single_device_arrays(x.shape, x.sharding, pieces)

    sharding = _per_host()
    x = jax.device_put(np.arange(8, dtype=np.int32), sharding)
    spec = jax.ShapeDtypeStruct((8,), np.int32, sharding=sharding)
    runtime = _runtime(hosts)
    try:
        with pytest.raises(ColocatedCallError) as e:
            by_controller_id.specialize(out_specs_fn=lambda _: spec)(x)
    finally:
        runtime.close()
    assert "not present in the sharding" in e.value.message and e.value.host is not None


def test_a_device_outside_the_program_does_not_resolve_on_the_worker(hosts: Hosts) -> None:
    """A closure holding a controller sharding beyond the call's devices (as a TPU
    sharding would be) fails on the worker, not silently in this process."""
    far = NamedSharding(Mesh(np.array(jax.devices()[4:]), ("d",)), PartitionSpec())

    @colocated_python.colocated_python
    def holds_far(x: jax.Array) -> jax.Array:
        assert far.spec == PartitionSpec()  # captured: pickled with the function
        return x

    near = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("d",)), PartitionSpec("d"))
    x = jax.device_put(np.arange(4, dtype=np.int32), near)
    spec = jax.ShapeDtypeStruct((4,), np.int32, sharding=near)
    runtime = _runtime(hosts)
    try:
        with pytest.raises(ColocatedCallError, match="Invalid device ID"):
            holds_far.specialize(out_specs_fn=lambda _: spec)(x)
    finally:
        runtime.close()


def test_a_host_error_comes_back_typed_with_its_host(hosts: Hosts) -> None:
    @colocated_python.colocated_python
    def fails(x: jax.Array) -> jax.Array:
        raise mtc.StorageError("disk gone", step=3, path="/x")

    sharding = _per_host()
    x = jax.device_put(np.arange(8, dtype=np.int32), sharding)
    spec = jax.ShapeDtypeStruct((8,), np.int32, sharding=sharding)
    runtime = _runtime(hosts)
    try:
        with pytest.raises(mtc.StorageError) as e:
            fails.specialize(out_specs_fn=lambda _: spec)(x)
    finally:
        runtime.close()
    assert e.value.step == 3 and e.value.host in range(4) and e.value.path == "/x"


def test_a_lost_hosts_answer_is_mtcs_error_and_the_runtimes_slice_down(
        hosts: Hosts, mesh: Mesh, tmp_path: Path) -> None:
    # No device can fail on this machine: pathwaysutils' DeviceLossSimulator makes
    # reading an array on a "lost" device raise DATA_LOSS, as Pathways does for a
    # worker that died. A manager's call after the loss reads the workers' answers
    # (and its inputs on them): what it raises names the host for a caller that
    # decides by mtc's errors (an elastic loop closing the manager of the failed
    # mesh), and is still the runtime's slice-down error, so that pathwaysutils'
    # elastic_retry handles it as the same event, not as a second one.
    w = jax.device_put(np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
                       NamedSharding(mesh, PartitionSpec("replica", "model")))
    sim = DeviceLossSimulator()
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh,
                               options=colocated_options(hosts)) as mgr:
        assert mgr.save(1, {"w": w}, force=True)
        mgr.wait_until_finished()
        sim.start()
        try:
            for d in jax.devices()[2:4]:  # host 1's
                sim.mark_device_lost(d)
            with pytest.raises(WorkerLostError) as e:
                mgr.all_steps()
        finally:
            sim.stop()
        assert 1 in mgr.all_steps()  # the host was not really lost
    assert isinstance(e.value, mtc.MtcError) and e.value.host == 1
    assert isinstance(e.value, jax.errors.JaxRuntimeError)
    assert pw_elastic.is_error_due_to_slice_down(e.value, log_traceback=False)
