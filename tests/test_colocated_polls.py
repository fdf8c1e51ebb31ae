"""Between saves, the colocated dispatcher polls the hosts' sidecars about a save
in flight in the background, at most every ``POLL_INTERVAL_S``: a training
step's ``save`` off the interval never waits for the round trip, and what a poll
raised comes out of a later ``save``, typed and naming the host. Real sidecar
processes (``tests/replicators.py``'s hosts), each test's manager on hosts of
this module's own."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from replicators import colocated_options

import mtc
from mtc.dispatch.colocated import POLL_INTERVAL_S
from mtc.errors import StorageError
from mtc.testing.isolation import Hosts

pytestmark = pytest.mark.process  # the hosts are sidecar processes

# Each test saves a step newer than the ones before it on the module's hosts.


COLOCATED_HOSTS = True  # the module's hosts: tests/conftest.py


def _saving(hosts: Hosts, mesh: Mesh, tmp_path: Path, interval: int
            ) -> tuple[mtc.CheckpointManager, jax.Array]:
    w = jax.device_put(np.ones((8, 16), np.float32),
                       NamedSharding(mesh, PartitionSpec("replica", "model")))
    opts = dataclasses.replace(colocated_options(hosts), save_interval_steps=interval)
    return mtc.CheckpointManager(tmp_path, mesh=mesh, options=opts), w


def _recorded(mgr: mtc.CheckpointManager, seconds: float,
              fail_at: int | None = None) -> tuple[list[float], Callable[[], None]]:
    """The dispatcher's polls, each taking ``seconds`` (a slow round trip) and the
    ``fail_at``-th raising a host's error: their start times, and how to put the
    real poll back."""
    dispatch = mgr._dispatch  # type: ignore[attr-defined]
    real = dispatch._poll
    polls: list[float] = []

    def slow_poll(*args: object) -> object:
        polls.append(time.monotonic())
        time.sleep(seconds)
        if len(polls) == fail_at:
            raise StorageError("the RAM disk failed", host=2)
        return real(*args)

    dispatch._poll = slow_poll
    return polls, lambda: setattr(dispatch, "_poll", real)


def test_a_poll_between_saves_never_holds_a_training_step(hosts: Hosts, mesh: Mesh,
                                                         tmp_path: Path) -> None:
    """A slow round trip never holds the step; what the poll raised comes out of a
    later ``save``, typed and naming the host."""
    mgr, w = _saving(hosts, mesh, tmp_path, 300)
    with mgr:
        polls, restore = _recorded(mgr, 0.5, fail_at=3)
        assert mgr.save(300, {"w": w})
        longest = 0.0
        t0 = time.monotonic()
        with pytest.raises(StorageError, match="RAM disk failed") as e:
            for step in range(301, 600):  # none due; bounded: 15 s at most
                t = time.monotonic()
                assert not mgr.save(step, {"w": w})
                longest = max(longest, time.monotonic() - t)
                time.sleep(0.05)
        took = time.monotonic() - t0
        restore()
        assert e.value.host == 2
        assert longest < 0.25, longest  # no step waited for a 0.5 s poll
        assert len(polls) == 3 and took < 4 * POLL_INTERVAL_S + 2, (polls, took)
        assert all(b - a >= POLL_INTERVAL_S for a, b in itertools.pairwise(polls))


def test_a_poll_that_waited_behind_a_stage_still_spaces_the_next(hosts: Hosts, mesh: Mesh,
                                                                 tmp_path: Path) -> None:
    """The interval between polls counts from when a poll starts: one that waited
    on the call thread (behind a stage in flight there) is not followed by
    another sooner than POLL_INTERVAL_S after it reached the hosts."""
    mgr, w = _saving(hosts, mesh, tmp_path, 700)
    with mgr:
        polls, restore = _recorded(mgr, 0.2)
        assert mgr.save(700, {"w": w})  # in flight, unwaited: polled off the interval
        # The call thread busy for 0.8 s from just before the first poll is due.
        time.sleep(POLL_INTERVAL_S - 0.1)
        busy = mgr._dispatch._async.submit(time.sleep, 0.8)  # type: ignore[attr-defined]
        for step in range(701, 800):  # none due; bounded: 5 s at most
            assert not mgr.save(step, {"w": w})
            if len(polls) >= 2:
                break
            time.sleep(0.05)
        busy.result()
        restore()
        assert len(polls) >= 2, polls
        assert polls[1] - polls[0] >= POLL_INTERVAL_S, polls
