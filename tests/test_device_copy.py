"""mtc/save/device_copy.py: the save's copy in device memory, and the paths that use
it (the agent's transfer thread, the colocated stage, the snapshotter).

CI has no accelerator. Where a test needs arrays "on an accelerator" it says so and
stands CPU arrays in for them (``on_accelerator`` patched): the copy, the budget,
the transfer thread and the values are then the real code's; what the device's
runtime does (a donation waiting for a transfer) is measured by
bench/accelerator.py on the chip.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.elastic import InGraphStep, Snapshotter
from mtc.save.device_copy import (
    HEADROOM,
    Account,
    DeviceCopier,
    bytes_per_device,
    copy_in_device_memory,
    fits,
    free_at_peak,
    on_accelerator,
    step_peak,
)


def _as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat this machine's CPU arrays (device memory) as an accelerator's: a stand-in,
    CI has none. Host memory kinds stay host memory."""
    def fake(x: Any) -> bool:
        kind = getattr(getattr(x, "sharding", None), "memory_kind", None)
        return isinstance(x, jax.Array) and not (kind and "host" in kind)

    for module in ("mtc.save.device_copy", "mtc.dispatch.colocated", "mtc.elastic.snapshot"):
        monkeypatch.setattr(f"{module}.on_accelerator", fake)
    monkeypatch.setattr("mtc.sidecar.save.agent._on_cpu", lambda x: False)


def test_cpu_arrays_are_not_an_accelerator_and_are_never_copied(mesh: Mesh) -> None:
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("model")))
    assert not on_accelerator(x) and not on_accelerator(np.ones(3))
    copier = DeviceCopier(1 << 30)
    assert copier.copy([x, np.ones(3)]) is None
    assert (copier.copied, copier.blocked) == (0, 0)


def test_bytes_per_device_count_each_device_its_shards(mesh: Mesh) -> None:
    split = jax.device_put(jnp.ones((8, 4), jnp.float32), NamedSharding(mesh, P("model")))
    whole = jax.device_put(jnp.ones((6,), jnp.int8), NamedSharding(mesh, P()))
    got = bytes_per_device([split, whole])
    assert set(got) == {d.id for d in mesh.devices.flat}
    # 8x4 float32 over 4 devices of 'model' (replicated across 'replica'): 32 bytes each.
    assert all(n == 32 + 6 for n in got.values())


class _Device:
    """A device's memory statistics, as a platform reports them (a stand-in: CPU
    devices report none)."""

    def __init__(self, stats: dict[str, int] | None) -> None:
        self.stats = stats

    def memory_stats(self) -> dict[str, int] | None:
        return self.stats


@pytest.mark.parametrize(("stats", "free"), [
    (None, None),
    ({"bytes_in_use": 5}, None),
    ({"bytes_limit": 1000, "bytes_in_use": 100, "peak_bytes_in_use": 400}, 580),
    ({"bytes_limit": 1000, "bytes_in_use": 100}, 880),
    ({"bytes_limit": 1000, "peak_bytes_in_use": 985}, 0),
    # A program's working memory, reserved apart from the buffers (a TPU's), is
    # the job's too: loaded again after a copy took its room, it failed.
    ({"bytes_limit": 1000, "peak_bytes_in_use": 400, "peak_bytes_reserved": 200}, 380),
])
def test_free_at_peak_leaves_the_jobs_peak_and_headroom(stats: dict[str, int] | None,
                                                         free: int | None) -> None:
    assert HEADROOM == 0.02  # the rows' figures: 20 of 1000 bytes
    assert free_at_peak(_Device(stats)) == free


def test_a_copy_holds_the_values_of_its_moment_and_budget_decides(
        monkeypatch: pytest.MonkeyPatch, mesh: Mesh, caplog: pytest.LogCaptureFixture) -> None:
    _as_accelerator(monkeypatch)
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("model")))
    copier = DeviceCopier(1 << 20)
    got = copier.copy([x, np.ones(2)])
    assert got is not None and copier.copied == 1 and got.owned == {0}
    copy, kept = got.arrays
    assert isinstance(kept, np.ndarray)  # numpy leaves are not the device's
    assert copy.sharding == x.sharding
    assert all(a.data.unsafe_buffer_pointer() != b.data.unsafe_buffer_pointer()
               for a, b in zip(copy.addressable_shards, x.addressable_shards, strict=True))
    x.delete()  # as a donating step does to the state
    np.testing.assert_array_equal(np.asarray(copy), np.arange(32.0).reshape(8, 4))
    # Too small a budget: nothing copied, said once.
    small = DeviceCopier(8)
    y = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("model")))
    with caplog.at_level(logging.WARNING, "mtc.manager"):
        assert small.copy([y]) is None and small.copy([y]) is None
    assert small.blocked == 2
    told = [r for r in caplog.records if "256 of 256 bytes" in r.getMessage()]
    assert len(told) == 1 and "The budget is 8 bytes" in told[0].getMessage()
    assert DeviceCopier(0).copy([y]) is None
    # The automatic budget asks the device: CPU devices report no statistics.
    auto = DeviceCopier(None)
    assert auto.copy([y]) is None and auto.blocked == 1


@pytest.mark.parametrize(("sizes", "budget", "taken"), [
    ([], {0: 10}, set()),
    ([{0: 4}, {0: 4}, {0: 4}], {0: 10}, {0, 1}),  # never all or nothing
    ([{0: 2}, {0: 8}, {0: 3}], {0: 10}, {0, 1}),  # the largest first, then what fits
    ([{0: 2}, {0: 9}, {0: 3}], {0: 10}, {1}),
    ([{0: 11}, {0: 3}], {0: 10}, {1}),  # one too large: the others still copied
    ([{0: 5, 1: 5}, {1: 6}], {0: 10, 1: 10}, {0}),  # must fit every device it is on
    ([{0: 5, 1: 5}, {0: 5}], {0: 10, 1: 4}, {1}),
    ([{0: 1}], {}, set()),  # a device with no room
    ([{0: 0}], {0: 0}, {0}),
])
def test_fits_copies_the_largest_that_fit_every_device(
        sizes: list[dict[int, int]], budget: dict[int, int], taken: set[int]) -> None:
    assert fits(sizes, budget) == taken


@pytest.mark.parametrize(("peak", "last", "want"), [
    (100, None, 100),  # no copy yet: the reported peak is the job's
    (130, (100, 30), 100),  # the copy lived beside the step's peak: it is the copy's
    (120, (100, 30), 100),
    (131, (100, 30), 101),  # more than the copy: the job grew by the rest
    (200, (100, 30), 170),
    (100, (100, 0), 100),
    (101, (100, 0), 101),
])
def test_step_peak_takes_a_rise_up_to_the_last_copy_as_the_copys(
        peak: int, last: tuple[int, int] | None, want: int) -> None:
    assert step_peak(peak, last) == want


def test_a_save_too_large_for_the_budget_copies_what_fits(
        monkeypatch: pytest.MonkeyPatch, mesh: Mesh, caplog: pytest.LogCaptureFixture) -> None:
    _as_accelerator(monkeypatch)
    sharding = NamedSharding(mesh, P("model"))
    big = jax.device_put(jnp.arange(1024.0).reshape(256, 4), sharding)  # 1 KiB a device
    small = jax.device_put(jnp.ones((8, 4)), sharding)  # 32 bytes a device
    copier = DeviceCopier(1080)  # room for the big one and one small one
    with caplog.at_level(logging.WARNING, "mtc.manager"):
        got = copier.copy([small, big, small])
    assert got is not None and got.owned == {0, 1}
    assert got.arrays[2] is small and got.arrays[1] is not big
    assert (copier.copied, copier.blocked) == (1, 1)
    n = len(mesh.devices.flat)
    assert copier.copied_bytes == (1024 + 32) * n and copier.direct_bytes == 32 * n
    assert any(f"{32 * n} of {(1024 + 64) * n} bytes" in r.getMessage()
               and "read from the state itself" in r.getMessage()
               for r in caplog.records)
    big.delete()  # as a donating step does
    np.testing.assert_array_equal(np.asarray(got.arrays[1]), np.arange(1024.0).reshape(256, 4))


@pytest.mark.parametrize("budget", [1 << 24, 5000])
@pytest.mark.parametrize("dispatch", ["local", "colocated"])
def test_a_save_from_its_copy_survives_donation_and_restores_exactly(
        monkeypatch: pytest.MonkeyPatch, ramdisk: Path, mesh: Mesh, dispatch: str,
        budget: int) -> None:
    """With room for the whole state, and (5000 bytes a device) for "z" but not "x"
    beside it: the part copied comes to host memory behind the step, the rest
    before save returns."""
    _as_accelerator(monkeypatch)
    sharding = NamedSharding(mesh, P("model"))
    donating = jax.jit(lambda a: a * 0 + 42, donate_argnums=0)
    options = mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch=dispatch,  # type: ignore[arg-type]
                          save_device_copy_bytes=budget)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options) as mgr:
        for step in (1, 2, 3):  # each save's transfer ends before the next copy
            x = jax.device_put(jnp.full((16, 64), step, jnp.float32), sharding)  # 1 KiB a device
            z = jax.device_put(jnp.full((64, 64), -step, jnp.float32), sharding)  # 4 KiB
            assert mgr.save(step, {"x": x, "z": z, "n": np.arange(3) + step})
            y, w = donating(x), donating(z)  # the state's buffers, donated right after save
            # (x, read from the state on CPU devices standing in for an accelerator, is
            # a host view there: jax 0.10 then does not donate it, 0.12 does.)
            assert z.is_deleted() and (budget == 5000 or x.is_deleted())
        mgr.wait_until_finished()
        copier = mgr._dispatch.copier  # type: ignore[attr-defined]
        assert (copier.copied, copier.blocked) == ((3, 0) if budget > 5000 else (3, 3))
        for step in (2, 3):
            got = mgr.restore(step, {"x": jax.ShapeDtypeStruct((16, 64), jnp.float32,
                                                               sharding=sharding),
                                     "z": jax.ShapeDtypeStruct((64, 64), jnp.float32,
                                                               sharding=sharding),
                                     "n": np.zeros(3, np.int64)})
            np.testing.assert_array_equal(np.asarray(got["x"]), np.full((16, 64), step))
            np.testing.assert_array_equal(np.asarray(got["z"]), np.full((64, 64), -step))
            np.testing.assert_array_equal(got["n"], np.arange(3) + step)
    np.testing.assert_array_equal(np.asarray(w), np.full((64, 64), 42))
    np.testing.assert_array_equal(np.asarray(y), np.full((16, 64), 42))


def test_a_failed_transfer_fails_its_save_and_frees_the_budget(
        monkeypatch: pytest.MonkeyPatch, ramdisk: Path, mesh: Mesh) -> None:
    """A shard that cannot come to host memory (its device lost) fails that save,
    reported at the next call; the staging budget it held is given back."""
    _as_accelerator(monkeypatch)
    sharding = NamedSharding(mesh, P("model"))
    options = mtc.Options(simulated_hosts=4, hosts_per_slice=2, dispatch="local",
                          save_device_copy_bytes=1 << 24)
    real = np.asarray
    calls = {"n": 0}

    def lost_device(a: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(a, jax.Array):
            calls["n"] += 1
            if calls["n"] == 3:
                raise jax.errors.JaxRuntimeError("DATA_LOSS: the device is gone")
        return real(a, *args, **kwargs)

    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=options) as mgr:
        agent = mgr._dispatch.agent  # type: ignore[attr-defined]
        monkeypatch.setattr("mtc.sidecar.save.agent.np.asarray", lost_device)
        x = jax.device_put(jnp.ones((1024, 64), jnp.float32), sharding)
        assert mgr.save(1, {"x": x})
        with pytest.raises(jax.errors.JaxRuntimeError, match="DATA_LOSS"):
            mgr.wait_until_finished()
        monkeypatch.setattr("mtc.sidecar.save.agent.np.asarray", real)
        assert agent.pool.held == 0
        assert mgr.save(2, {"x": x})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]


def test_snapshots_move_to_host_memory_behind_the_step(monkeypatch: pytest.MonkeyPatch,
                                                        mesh: Mesh) -> None:
    _as_accelerator(monkeypatch)
    sharding = NamedSharding(mesh, P("model"))
    state = {"w": jax.device_put(jnp.full((256, 8), 1.0), sharding)}
    step = jax.jit(lambda s: {"w": s["w"] + 1}, donate_argnums=0)
    snap = Snapshotter(device_copy_bytes=1 << 24, loop_budget=1.0)  # no pacing here
    assert snap.save(1, state)
    assert snap._copier.copied == 1
    state = step(state)  # donates what was saved
    snap.join()
    assert snap.latest is not None and snap.latest.step == 1
    kept = snap._latest.leaves[0].whole  # type: ignore[union-attr]
    assert kept.sharding.memory_kind == "pinned_host"
    abstract = {"w": jax.ShapeDtypeStruct((256, 8), jnp.float32, sharding=sharding)}
    np.testing.assert_array_equal(
        np.asarray(snap.load(abstract, reset_snapshot_state=False)["w"]), np.full((256, 8), 1.0))
    np.testing.assert_array_equal(np.asarray(state["w"]), np.full((256, 8), 2.0))
    # The next snapshot replaces it; the replaced one's host buffers are dropped on
    # the snapshotter's release thread, which close() joins.
    first = weakref.ref(kept)
    del kept
    assert snap.save(2, state)
    snap.join()
    assert snap.latest is not None and snap.latest.step == 2
    assert snap._releases is not None
    snap.close()
    assert snap._releases is None and first() is None


def test_in_graph_step_takes_no_copy_while_the_last_is_on_its_way(
        monkeypatch: pytest.MonkeyPatch, mesh: Mesh) -> None:
    _as_accelerator(monkeypatch)
    sharding = NamedSharding(mesh, P("model"))
    snap = Snapshotter(device_copy_bytes=1 << 24, loop_budget=1.0)  # room, no pacing
    fn = InGraphStep(lambda s: ({"w": s["w"] * 2},), snap, state_shardings={"w": sharding})
    state = {"w": jax.device_put(jnp.ones((64, 8)), sharding)}
    (state,) = fn(state, snapshot_step=1)
    assert snap._pending is not None and snap._pending.moved and fn.outside == 0
    # The copy's own buffer, moving to host memory: the next step's donation
    # leaves it alone.
    monkeypatch.setattr(Snapshotter, "transferring", property(lambda self: True))
    (state,) = fn(state, snapshot_step=2)
    assert fn.skipped == 1
    monkeypatch.setattr(Snapshotter, "transferring", property(lambda self: False))
    (state,) = fn(state, snapshot_step=3)
    snap.join()
    assert fn.skipped == 1 and snap.latest is not None and snap.latest.step == 3
    abstract = {"w": jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=sharding)}
    np.testing.assert_array_equal(np.asarray(snap.load(abstract)["w"]), np.full((64, 8), 8.0))


def test_in_graph_step_on_a_full_device_snapshots_after_the_step(
        monkeypatch: pytest.MonkeyPatch, mesh: Mesh) -> None:
    """No room for a second copy of the state beside the step (a full chip): the
    step runs without the copy and the snapshot is taken of its new state after it."""
    _as_accelerator(monkeypatch)
    sharding = NamedSharding(mesh, P("model"))
    snap = Snapshotter(device_copy_bytes=64, loop_budget=1.0)  # 256 bytes a device needed
    fn = InGraphStep(lambda s: ({"w": s["w"] * 2},), snap, state_shardings={"w": sharding})
    state = {"w": jax.device_put(jnp.ones((64, 8)), sharding)}
    (state,) = fn(state, snapshot_step=1)
    assert fn.outside == 1 and snap._copier.direct_bytes > 0
    (state,) = fn(state, snapshot_step=None)  # donates the state the snapshot read
    snap.join()
    age = fn.age
    assert snap.latest is not None and snap.latest.step == 1 and age is not None
    abstract = {"w": jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=sharding)}
    np.testing.assert_array_equal(np.asarray(snap.load(abstract)["w"]), np.full((64, 8), 2.0))


def test_snapshots_from_an_accelerator_are_paced_to_the_loops_budget(
        monkeypatch: pytest.MonkeyPatch, mesh: Mesh) -> None:
    """Asked every step, the snapshotter takes the first, then waits for a quiet
    interval to value its cost, then takes one whenever the cost so far is within
    the budget of the loop's time (the clock stands in for the loop's steps)."""
    _as_accelerator(monkeypatch)
    sharding = NamedSharding(mesh, P("model"))
    clock = {"t": 0.0}
    monkeypatch.setattr("mtc.elastic.snapshot.time.monotonic", lambda: clock["t"])
    snap = Snapshotter(device_copy_bytes=1 << 24, loop_budget=0.05)
    state = {"w": jax.device_put(jnp.ones((64, 8)), sharding)}
    taken = []
    for step in range(60):
        busy = snap._busy
        # A step takes 1 s; with a snapshot in flight at its start, 2 s (1 s of cost).
        clock["t"] += 2.0 if busy and step else 1.0
        if snap.save(step, state):
            taken.append(step)
            snap.join()
    assert taken[0] == 0 and snap.paced > 0
    # One snapshot costs 1 s: within 5% of the loop's time, about one every 20 s.
    assert 2 <= len(taken) <= 5, taken
    assert snap.pacer.cost_s <= 0.05 * snap.pacer.loop_s + 1.0
    age = snap.age
    assert age is not None and age.steps == 59 - taken[-1]
    assert age.seconds == pytest.approx(clock["t"] - snap._latest.at)  # type: ignore[union-attr]


def test_the_account_leaves_room_for_live_copies_and_does_not_take_them_for_the_job(
        monkeypatch: pytest.MonkeyPatch, mesh: Mesh) -> None:
    """One account per process: a copy another copier made, still alive, is
    subtracted from the room; the reported peak it raised is not the job's; once it
    is freed the room comes back. (Device statistics played: CPU devices report
    none.)"""
    _as_accelerator(monkeypatch)
    account = Account()
    x = jax.device_put(jnp.ones((64, 4)), NamedSharding(mesh, P("model")))  # 64 B a device
    d = next(iter(x.sharding.device_set)).id
    limit, job = 100_000, 50_000
    headroom = int(HEADROOM * limit)
    assert account.room(d, limit, job) == limit - job - headroom
    first = copy_in_device_memory([x])
    account.made(first, track_peak=True)
    size = bytes_per_device(first)[d]
    # The first copy alive: a second copier's room leaves it out...
    assert account.room(d, limit, job) == limit - job - headroom - size
    # ...and a step ran beside it: the platform's peak rose by the copy, not the job.
    assert account.room(d, limit, job + size) == limit - job - headroom - size
    second = copy_in_device_memory([x])
    account.made(second, track_peak=True)
    # Both alive during a step: a rise of both copies is still theirs.
    assert account.room(d, limit, job + 2 * size) == limit - job - headroom - 2 * size
    del first, second
    assert account.live[d] == 0
    assert account.room(d, limit, job + 2 * size) == limit - job - headroom
    # A rise beyond every copy alive at once: the rest is the job's own (a program
    # loaded beside the copies, reserving more).
    assert account.room(d, limit, job + 3 * size) == limit - job - size - headroom
