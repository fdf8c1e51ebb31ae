"""``wait_until_finished`` called from several threads at once (Orbax's test of
concurrent waiters, which mtc's save errors cannot be injected into): every waiter
returns only once the saves in flight when it called are committed, and each
raises a save's failure; the failure is then cleared, as Orbax's."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mtc
from mtc.sidecar.save import agent as agent_mod
from mtc.sidecar.save import write as write_mod
from mtc.testing.waits import wait_until


def state(mesh: Mesh) -> dict[str, Any]:
    return {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), NamedSharding(mesh, P("model")))}


def manager(ramdisk: Path, mesh: Mesh) -> mtc.CheckpointManager:
    return mtc.CheckpointManager(ramdisk, mesh=mesh, options=mtc.Options(
        simulated_hosts=2, dispatch="local"))


class Gate:
    """Holds every shard write until opened, once ``waiters`` threads are inside the
    hosts' wait (the agent's ``wait``, patched to count them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, waiters: int,
                 fail: bool = False) -> None:
        self.open = threading.Event()
        self.inside = threading.Semaphore(0)
        self.waiters = waiters
        real_write, real_wait = write_mod._write_file, agent_mod.HostAgent.wait

        def write(*a: Any, **kw: Any) -> int:
            assert self.open.wait(30), "the gate never opened"
            if fail:
                raise OSError(5, "injected write failure")
            return real_write(*a, **kw)

        def wait(agent: Any) -> None:
            self.inside.release()
            return real_wait(agent)

        monkeypatch.setattr(write_mod, "_write_file", write)
        monkeypatch.setattr(agent_mod.HostAgent, "wait", wait)

    def open_when_all_inside(self) -> None:
        for _ in range(self.waiters):
            assert self.inside.acquire(timeout=30), "a waiter never reached the hosts' wait"
        self.open.set()


def test_every_concurrent_waiter_returns_only_once_the_save_is_committed(
        ramdisk: Path, mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch, waiters=3)
    committed_at_return: list[bool] = []

    def waiter(mgr: mtc.CheckpointManager) -> None:
        mgr.wait_until_finished()
        committed_at_return.append(all((ramdisk / f"host-{h}" / "0").is_dir()
                                       for h in (0, 1)))

    with manager(ramdisk, mesh) as mgr, futures.ThreadPoolExecutor(3) as pool:
        assert mgr.save(0, state(mesh))
        waiting = [pool.submit(waiter, mgr) for _ in range(3)]
        gate.open_when_all_inside()
        for w in waiting:
            w.result(timeout=60)
        assert committed_at_return == [True, True, True]
        assert mgr.all_steps() == [0]


def test_each_concurrent_waiter_raises_the_failure_then_it_is_cleared(
        ramdisk: Path, mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(monkeypatch, waiters=3, fail=True)
    with manager(ramdisk, mesh) as mgr, futures.ThreadPoolExecutor(3) as pool:
        assert mgr.save(0, state(mesh))
        waiting = [pool.submit(mgr.wait_until_finished) for _ in range(3)]
        gate.open_when_all_inside()
        for w in waiting:
            with pytest.raises(mtc.MtcError, match="injected write failure"):
                w.result(timeout=60)
        mgr.wait_until_finished()  # cleared: raised to each waiter once
        assert mgr.all_steps() == []
        gate.waiters = 0
        monkeypatch.undo()
        assert mgr.save(1, state(mesh))  # the manager goes on
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]


def test_a_failed_save_is_raised_by_the_next_save_once(
        ramdisk: Path, mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """Orbax's test_async_error_subsequent_save, on an mtc save that fails: the next
    save raises the failure (writing nothing), and clears it."""
    gate = Gate(monkeypatch, waiters=0, fail=True)
    gate.open.set()
    with manager(ramdisk, mesh) as mgr:
        assert mgr.save(0, state(mesh))
        agent = mgr._dispatch.agent  # type: ignore[attr-defined]  # the local hosts
        wait_until("the failing save finished", lambda: not agent.in_flight())
        with pytest.raises(mtc.MtcError, match="injected write failure"):
            mgr.save(1, state(mesh))
        monkeypatch.undo()
        mgr.wait_until_finished()  # cleared
        assert mgr.save(2, state(mesh))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]
