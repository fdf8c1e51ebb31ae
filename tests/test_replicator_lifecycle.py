"""A replicator's life as ``main.run`` leads it, in-process: every service started
with one thread group (mtc.lifecycle), and at shutdown every thread of it joined;
a service whose thread fails ends the replicator, its error said. Real parts: a
real Node over a RAM-disk folder, its real gRPC server and data channel on
loopback (its one peer's address is a port nothing listens on)."""

from __future__ import annotations

import threading
from pathlib import Path

from mtc.credentials import Credentials
from mtc.lifecycle import Threads
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator import main
from mtc.sidecar.replicator.config import ReplicatorConfig
from mtc.sidecar.replicator.metrics import MetricsServer
from mtc.sidecar.replicator.node import Node
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.sidecar.replicator.wire.server import Serving, serve
from mtc.testing.waits import wait_until

# The threads main's group starts (the scrub's, with a rate; the reserve's, enabled).
GROUP = {"mtc-replicate", "mtc-scrub", "mtc-reserve", "mtc-config-check",
         "mtc-orbax-client", "mtc-data-accept", "mtc-metrics"}


class Breaks:
    """A service whose thread raises once ``go`` is set."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.closed = False

    def _run(self) -> None:
        self.go.wait(30)
        raise RuntimeError("the disk vanished")

    def start(self, threads: Threads) -> None:
        threads.start(self._run, "test-breaks")

    def stop(self) -> None:
        self.go.set()

    def close(self) -> None:
        self.closed = True


def replicator(tmp_path: Path) -> tuple[Node, Serving, Threads, int]:
    cfg = ReplicatorConfig(rank=0, nodes=("127.0.0.1:0", "127.0.0.1:1"), nodes_per_slice=1,
                           deadline_s=0.5, agreement_timeout_s=0.5, poll_s=0.05)
    node = Node(cfg, tmp_path / "root", Credentials())
    threads = Threads("mtc-replicator")
    server, port, servicer, health = serve(node, "127.0.0.1:0", Credentials(), threads=threads)
    return node, Serving(server, servicer, health, grace_s=1.0), threads, port


def passes(node: Node) -> float:
    return node.metrics.registry.get_sample_value(
        "mtc_loop_passes_total", {"loop": "replication"}) or 0.0


def group_threads() -> set[threading.Thread]:
    """The live threads named as the group's (other tests' servers may run some too:
    each test compares with what ran before it started)."""
    return {t for t in threading.enumerate() if t.name in GROUP and t.is_alive()}


def test_every_thread_of_the_replicator_is_started_in_its_group_and_joined_at_shutdown(
        tmp_path: Path) -> None:
    before = group_threads()
    node, serving, threads, port = replicator(tmp_path)
    stop = threading.Event()
    metrics = MetricsServer(node.metrics, 0)
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(main.run(
        node, serving, tmp_path / "root", None, stop, stall_s=60, threads=threads,
        extra=[metrics])))
    runner.start()
    try:
        def running() -> None:
            assert runner.is_alive()

        # The loop ran twice: everything is up.
        wait_until("two passes of the loop", lambda: passes(node) >= 2, 20, during=running)
        assert set(threads.alive()) >= GROUP - {"mtc-config-check"}  # it may be done
        client = PeerClient(f"127.0.0.1:{port}", Credentials(), rank=0)
        try:  # and it serves
            assert client.call("GetInventory", pb.InventoryRequest(rank_only=True)).rank == 0
        finally:
            client.close()
    finally:
        stop.set()
        runner.join(30)
    assert not runner.is_alive() and result == [0]
    assert threads.alive() == [] and group_threads() <= before
    assert threads.errors() == []


def test_a_service_whose_thread_fails_ends_the_replicator_with_its_error(
        tmp_path: Path) -> None:
    before = group_threads()
    node, serving, threads, _ = replicator(tmp_path)
    breaks = Breaks()
    result: list[int] = []
    runner = threading.Thread(target=lambda: result.append(main.run(
        node, serving, tmp_path / "root", None, threading.Event(), stall_s=60,
        threads=threads, extra=[breaks])))
    runner.start()
    def running() -> None:
        assert runner.is_alive()

    wait_until("a pass of the loop", lambda: passes(node) >= 1, 20, during=running)
    breaks.go.set()  # its thread raises: nobody asked the replicator to stop
    runner.join(30)
    assert not runner.is_alive() and result == [1]
    assert [(n, str(e)) for n, e in threads.errors()] == [("test-breaks", "the disk vanished")]
    assert breaks.closed and threads.alive() == [] and group_threads() <= before
