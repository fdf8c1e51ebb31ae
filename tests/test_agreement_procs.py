"""Restore agreement with real replicator processes, where the process is the point:
a replicator SIGKILLed and restarted during a restore, the controller's first error
surfacing at once, an Orbax replicator.yaml that reaches a replicator started for
mtc, a graceful SIGTERM, a stalled one's health. Tiny raw steps keep them light.
The agreement's logic between whole replicators (16 members, a member down, one
asking late, one misconfigured) is in ``tests/test_agreement_memory.py``."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from replicators import Cluster, new_cluster

from mtc.errors import CorruptShardError
from mtc.proto import replicator_pb2 as pb
from mtc.proto import replicator_pb2_grpc as pb_grpc
from mtc.replicas import prepare_restore
from mtc.sidecar.replicator import orbax
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process


def commit_everywhere(cl: Cluster, steps: tuple[int, ...]) -> None:
    for r in range(cl.n):
        for s in steps:
            cl.commit(r, s, {"x.bin": os.urandom(256)})


def test_replicator_killed_and_restarted_during_a_restore(ramdisk: Path,
                                                          clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 4, 2, metrics=True)
    commit_everywhere(cl, (1, 2))
    for r in (0, 1, 3):
        cl.launch(r)
    for r in (0, 1, 3):
        cl.wait_serving(r)
    # Rank 2 is not up: the restore waits for it. Meanwhile rank 1, whose request
    # is in flight, is SIGKILLed (its request is lost) and restarted.
    result: dict[str, Any] = {}

    def restore() -> None:
        t0 = time.monotonic()
        try:
            result["prepared"] = prepare_restore(cl.addrs, token=None, timeout_s=40)
        except Exception as e:  # noqa: BLE001 - asserted below
            result["error"] = e
        result["took"] = time.monotonic() - t0

    t = threading.Thread(target=restore)
    t.start()
    cl.wait_sample(1, "mtc_decide_calls_total", 1)  # rank 1 asks the coordinator
    assert t.is_alive(), result
    cl.kill(1)
    cl.start(1)
    cl.start(2)
    t.join(60)
    assert "error" not in result, result
    prepared = result["prepared"]
    assert prepared.step == 2
    assert set(prepared.tiers.values()) == {"local"}
    # Well within the restore timeout: the lost request was issued again and read
    # the epoch's decision as soon as rank 2 answered.
    assert result["took"] < 30, result
    assert "restore step 2" in cl.log_text(1)


class FailingReplicator(pb_grpc.ReplicatorServicer):
    """Stands in for a replicator whose host's data is corrupt: answers PrepareRestore
    with DATA_LOSS at once (a real one only gets there after agreement, which the
    member this test keeps down prevents)."""

    def PrepareRestore(self, request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.DATA_LOSS, "shard x.bin does not match its checksum")


def test_first_error_is_not_held_back_by_slower_replies(ramdisk: Path,
                                                        clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1)
    commit_everywhere(cl, (1,))
    cl.start(0)  # rank 1 never comes: rank 0's reply would take the whole deadline
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_ReplicatorServicer_to_server(FailingReplicator(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(CorruptShardError, match="does not match"):
            prepare_restore([cl.addrs[0], f"127.0.0.1:{port}"], token=None, timeout_s=30)
        assert time.monotonic() - t0 < 10
    finally:
        server.stop(0)


def test_orbax_yaml_to_a_replicator_started_for_mtc_fails_at_once(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        initialization,
    )

    cl = new_cluster(clusters, ramdisk, 2, 1)
    cl.start_all()
    root = cl.root(0)
    # The real client's writer and its wait (what initialize_multi_tier_checkpointing
    # runs after jax.distributed.initialize).
    initialization._create_replicator_file(
        root, run_name="job", num_nodes=2, data_parallelism=2, node_rank=0,
        peer_ranks=[1], backup_interval_minutes=30, backup_interval_steps=None)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="--framework orbax"):
        initialization._wait_for_replicator_file_to_disappear(
            root, timeout_seconds=20)
    assert time.monotonic() - t0 < 10
    assert not (root / orbax.YAML_NAME).exists()


def test_sigterm_shuts_down_gracefully_even_during_a_restore(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1, metrics=True)
    cl.start_all()
    # Rank 1 waits for a decision that cannot come (rank 0 never asks) ...
    errors: list[Exception] = []

    def ask() -> None:
        c = cl.client(1)
        try:
            c.call("PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=60),
                   deadline_s=90, attempts=1)
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)
        finally:
            c.close()

    t = threading.Thread(target=ask)
    t.start()
    cl.wait_sample(1, "mtc_decide_calls_total", 1)
    proc = cl.procs[1]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # ... and is told to stop: it ends the wait and exits
    assert proc.wait(30) == 0
    t.join(30)
    assert time.monotonic() - t0 < 30
    assert errors, "the restore in flight was not ended"
    assert "shutting down" in cl.log_text(1)
    assert cl.alive(0)


def test_health_not_serving_while_the_loop_stalls(ramdisk: Path,
                                                  clusters: list[Cluster]) -> None:
    cl = new_cluster(clusters, ramdisk, 2, 1)
    cl.start(0)
    cl.start(1, "--stall-seconds", "1")
    cl.commit(1, 1, {"y.bin": os.urandom(256)})
    cl.wait_held({(0, 1, 1)})
    # Rank 0 hangs (SIGSTOP): rank 1's loop blocks on its calls to it for up to
    # their deadline, so rank 1 reports NOT_SERVING, then SERVING once rank 0 runs.
    cl.procs[0].send_signal(signal.SIGSTOP)
    try:
        cl.commit(1, 2, {"y.bin": os.urandom(256)})
        cl.wait_health(1, "NOT_SERVING", 30)
    finally:
        cl.procs[0].send_signal(signal.SIGCONT)
    cl.wait_health(1, "SERVING", 30)
    assert "stalled" in cl.log_text(1)


def test_orbax_request_taken_before_a_sigkill_is_served_after_the_restart(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
        initialization,
    )

    cl = new_cluster(clusters, ramdisk, 2, 1, orbax=True, metrics=True)
    for r in range(2):
        cl.commit(r, 3, {"x.bin": os.urandom(256)})
        initialization._create_replicator_file(
            cl.root(r), run_name="job", num_nodes=2, data_parallelism=2, node_rank=r,
            peer_ranks=[1 - r], backup_interval_minutes=30, backup_interval_steps=None)
    cl.launch(0)  # rank 1 is not up: rank 0 takes its yaml and waits for the decision
    wait_until("rank 0 taking its yaml", lambda: not (cl.root(0) / orbax.YAML_NAME).exists(), 30)
    # Rank 0 (the coordinator) waits for rank 1's ask when it is killed.
    cl.wait_sample(0, "mtc_restores_waiting", 1)
    cl.kill(0)  # the client saw its yaml consumed; the request must not be lost
    cl.launch(0)
    cl.launch(1)
    want = {r: cl.root(r) / f"job-s3-n{r}-w0.restore" for r in range(2)}

    def not_failed() -> None:
        assert not (cl.root(0) / orbax.FAILED_NAME).exists(), \
            (cl.root(0) / orbax.FAILED_NAME).read_text()

    wait_until("both ranks' restore links", lambda: all(p.is_symlink() for p in want.values()),
               60, during=not_failed, detail=lambda: list(want.values()))
    # Forgotten once answered: just after the links, not with them.
    wait_until("rank 0 forgetting the request it served",
               lambda: not (cl.root(0) / orbax.PENDING_NAME).exists(), 30)
