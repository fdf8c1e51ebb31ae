"""A host's sidecar killed and started again under a controller's colocated runtime
(the local cluster's stand-in for a Pathways worker that restarts): the new
sidecar removes its predecessor's reply slots, and it gets the controller's
programs with its first calls. Hosts of their own: these tests kill them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import grpc
import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from replicators import colocated_options

import mtc
from mtc.testing.isolation import Hosts

pytestmark = pytest.mark.process  # every test here runs on the sidecar processes

SLICES = [0, 0, 1, 1]


COLOCATED_HOSTS = True  # the module's hosts: tests/conftest.py


def test_a_restarted_sidecar_removes_its_predecessors_reply_slots(
        hosts: Hosts, mesh: Mesh, tmp_path: Path) -> None:
    """A killed sidecar's reply slots would hold area memory for ever: its
    successor removes them as it starts, while a restore's arrays over them here
    keep their values (the mapping outlives the file)."""
    from mtc.slots import REPLY_PREFIX

    sharding = NamedSharding(mesh, PartitionSpec("replica", "model"))
    w = jax.device_put(np.full((8, 1 << 19), 7, np.float32), sharding)
    area = hosts.hosts[0].area
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh,
                               options=colocated_options(hosts)) as mgr:
        assert mgr.save(300, {"w": w})
        mgr.wait_until_finished()
        back = mgr.restore(300, {"w": jax.ShapeDtypeStruct(w.shape, w.dtype,
                                                           sharding=sharding)})["w"]
        left = {p.name for p in area.iterdir() if p.name.startswith(REPLY_PREFIX)}
        assert left
        hosts.kill_sidecar(0)
        hosts.start_sidecar(0, SLICES)
        assert not left & {p.name for p in area.iterdir()}
        np.testing.assert_array_equal(np.asarray(back), np.asarray(w))


def test_a_restarted_sidecar_gets_the_programs_with_its_first_calls(
        hosts: Hosts, mesh: Mesh, tmp_path: Path) -> None:
    """A restarted sidecar has none of the controller's programs. Once the runtime
    can tell (a reply from the new sidecar, a call that did not reach the host),
    every program goes with its next call there, not after a round trip that only
    learns that the program is unknown (a replaced host's restore pays each)."""
    from mtc.dispatch.protocol import WorkerLostError
    from mtc.errors import ShardUnavailableError

    sharding = NamedSharding(mesh, PartitionSpec("replica", "model"))
    w = jax.device_put(np.full((8, 64), 4, np.float32), sharding)
    target = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=sharding)}
    with mtc.CheckpointManager(tmp_path / "controller", mesh=mesh,
                               options=colocated_options(hosts)) as mgr:
        assert mgr.save(400, {"w": w})
        mgr.wait_until_finished()
        mgr.restore(400, target)  # every host has both of a restore's programs
        runtime = mgr._dispatch._runtime  # type: ignore[attr-defined]
        real = runtime._stubs[0]
        unknown: list[bool] = []  # per call to host 0: whether it found the program unknown

        def counted(message: bytes, timeout: float) -> bytes:
            reply = real(message, timeout=timeout)
            (n,) = struct.unpack_from("<Q", reply)
            unknown.append(bool(json.loads(reply[8:8 + n]).get("unknown_program")))
            return reply

        runtime._stubs[0] = counted

        def save_and_restore(step: int) -> None:  # four programs: survey, stage, wait, load
            assert mgr.save(step, {"w": w}, force=True)
            mgr.wait_until_finished()
            np.testing.assert_array_equal(np.asarray(mgr.restore(step, target)["w"]), 4)

        # Restarted unseen (its RAM disk with it): the first call learns it from the
        # reply; every other program then goes with its first call.
        hosts.kill_sidecar(0)
        hosts.start_sidecar(0, SLICES)
        save_and_restore(401)
        assert unknown[0] and not any(unknown[1:]), unknown
        # A call that did not reach the host: whoever answers next gets every program.
        unknown.clear()
        hosts.kill_sidecar(0)
        with pytest.raises((ShardUnavailableError, WorkerLostError)):
            mgr.restore(401, target)
        hosts.start_sidecar(0, SLICES)
        # The runtime's channel, which found the host dead, reconnects on its own
        # backoff (0.1 s at first): what this test asks is which programs go with the
        # next calls, not how soon the channel is back.
        grpc.channel_ready_future(runtime._channels[0]).result(timeout=30)
        save_and_restore(402)
        assert unknown and not any(unknown), unknown
