"""Restore agreement under network faults, with real network namespaces.

Three replicators, each in a network namespace this test creates (and removes),
linked pairwise by veth pairs, so one link can be cut alone (``ip link set ...
down``; tc netem is not available here): a partial partition where A reaches C
and B does not. The test process reaches every replicator over a control link
of its own that no fault touches. Asserts: no two hosts ever answer different
(epoch, step), every wait is bounded, a typed error when a member cannot take
part, and success once the link is back.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from replicators import commit_mtc_step, env_with_repo

from mtc.credentials import Credentials
from mtc.errors import AgreementError
from mtc.proto import replicator_pb2 as pb
from mtc.replicas import Prepared, prepare_restore
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process
N = 3
PORT = 7000  # inside namespaces this test made: nothing else listens there
TIMEOUT_S = 5.0


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Net:
    """Namespaces ``ns[i]``, a veth pair per pair of hosts, a control link per host."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.octet = random.randint(100, 250)
        self.ns = [f"m11a{tag}{i}" for i in range(N)]
        self.links: dict[tuple[int, int], tuple[str, str]] = {}
        self.addr: dict[tuple[int, int], str] = {}  # (from, to) -> to's address on their link
        self.control: list[str] = []
        self.tag = tag

    def up(self) -> None:
        for ns in self.ns:
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
        k = 0
        for i in range(N):
            for j in range(i + 1, N):
                a, b = f"v{self.tag}{i}{j}", f"w{self.tag}{i}{j}"
                ip("link", "add", a, "type", "veth", "peer", "name", b)
                ip("link", "set", a, "netns", self.ns[i])
                ip("link", "set", b, "netns", self.ns[j])
                ip("-n", self.ns[i], "addr", "add", f"10.{self.octet}.{k}.1/30", "dev", a)
                ip("-n", self.ns[j], "addr", "add", f"10.{self.octet}.{k}.2/30", "dev", b)
                ip("-n", self.ns[i], "link", "set", a, "up")
                ip("-n", self.ns[j], "link", "set", b, "up")
                self.links[(i, j)] = (a, b)
                self.addr[(i, j)] = f"10.{self.octet}.{k}.2"
                self.addr[(j, i)] = f"10.{self.octet}.{k}.1"
                k += 1
        for i in range(N):
            host, inner = f"c{self.tag}{i}", f"d{self.tag}{i}"
            ip("link", "add", host, "type", "veth", "peer", "name", inner)
            ip("link", "set", inner, "netns", self.ns[i])
            ip("addr", "add", f"10.{self.octet}.{100 + i}.1/30", "dev", host)
            ip("-n", self.ns[i], "addr", "add", f"10.{self.octet}.{100 + i}.2/30", "dev", inner)
            ip("link", "set", host, "up")
            ip("-n", self.ns[i], "link", "set", inner, "up")
            self.control.append(f"10.{self.octet}.{100 + i}.2:{PORT}")

    def set_link(self, i: int, j: int, up: bool) -> None:
        a, _ = self.links[(min(i, j), max(i, j))]
        ip("-n", self.ns[min(i, j)], "link", "set", a, "up" if up else "down")

    def nodes_for(self, i: int) -> str:
        return ",".join(f"127.0.0.1:{PORT}" if j == i else f"{self.addr[(i, j)]}:{PORT}"
                        for j in range(N))

    def down(self) -> None:
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for i in range(N):  # normally gone with their namespace's end
            subprocess.run(["ip", "link", "del", f"c{self.tag}{i}"], capture_output=True)


@pytest.fixture
def net() -> Iterator[Net]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    n = Net()
    try:
        n.up()
    except subprocess.CalledProcessError as e:
        n.down()
        pytest.skip(f"cannot create network namespaces here: {e.stderr}")
    try:
        yield n
    finally:
        n.down()


def start(net: Net, ramdisk: Path) -> tuple[list[subprocess.Popen[bytes]], str]:
    """A replicator in each namespace, each host with steps 1 and 2 committed."""
    token = ramdisk / "token"
    token.write_text("netns-test-token")
    procs = []
    for i in range(N):
        root = ramdisk / f"host-{i}"
        for s in (1, 2):
            commit_mtc_step(root, s, {"x.bin": os.urandom(512)}, host=i, num_hosts=N)
        log = open(ramdisk / f"replicator-{i}.log", "wb")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", net.ns[i], sys.executable, "-m",
             "mtc.sidecar.replicator.main", "--local-dir", str(root),
             "--listen", f"0.0.0.0:{PORT}", "--nodes", net.nodes_for(i),
             "--rank", str(i), "--token-file", str(token), "--poll-seconds", "0.2",
             "--agreement-timeout-seconds", str(TIMEOUT_S),
             "--port-file", str(ramdisk / f"port-{i}")],
            stdout=log, stderr=subprocess.STDOUT, env=env_with_repo()))
        log.close()
    def exited() -> None:
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]

    wait_until("every replicator started", lambda: all(
        (ramdisk / f"port-{i}").exists() for i in range(N)), 60, during=exited)
    return procs, token.read_text()


def stop(procs: list[subprocess.Popen[bytes]], ramdisk: Path) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
    for i in range(N):
        print(f"--- replicator {i} ---")
        path = ramdisk / f"replicator-{i}.log"
        print(path.read_text(errors="replace")[-2000:] if path.exists() else "")


def test_partial_partition_never_splits_the_decision(net: Net, ramdisk: Path) -> None:
    procs, token = start(net, ramdisk)
    try:
        def restore() -> tuple[Prepared | AgreementError, float]:
            t0 = time.monotonic()
            try:
                got: Prepared | AgreementError = prepare_restore(
                    net.control, token=token, timeout_s=TIMEOUT_S)
            except AgreementError as e:
                got = e
            return got, time.monotonic() - t0

        first, took = restore()
        assert isinstance(first, Prepared) and first.step == 2, first
        assert took < TIMEOUT_S + 10

        # B and C cut from each other; both still reach the coordinator (A): one
        # decision, read by all.
        net.set_link(1, 2, up=False)
        got, took = restore()
        assert isinstance(got, Prepared), got
        assert (got.step, got.epoch > first.epoch) == (2, True)
        assert took < TIMEOUT_S + 10

        # C cut from the coordinator, B not: no epoch forms, everyone gets a typed
        # error within the deadline, and nothing is decided.
        net.set_link(1, 2, up=True)
        net.set_link(0, 2, up=False)
        failed, took = restore()
        assert isinstance(failed, AgreementError), failed
        assert "rank(s) [2]" in str(failed) or "rank 2" in str(failed), failed
        assert took < TIMEOUT_S + 10, took
        book = (ramdisk / "host-0" / ".mtc-agreement.json").read_text()
        assert f'"epoch": {got.epoch + 1}' not in book

        # Healed: the next restore decides, once, for everyone.
        net.set_link(0, 2, up=True)
        healed, took = restore()
        assert isinstance(healed, Prepared) and healed.step == 2, healed
        assert healed.epoch == got.epoch + 1
    finally:
        stop(procs, ramdisk)


def held_by(net: Net, token: str, holder: int) -> set[tuple[int, int]]:
    c = PeerClient(net.control[holder], Credentials(token=token), rank=holder)
    try:
        inv = c.call("GetInventory", pb.InventoryRequest(), deadline_s=5)
    finally:
        c.close()
    return {(x.origin_rank, x.step) for x in inv.copies}


def test_copy_over_a_cut_link_is_not_counted_then_completes_when_healed(
        net: Net, ramdisk: Path) -> None:
    procs, token = start(net, ramdisk)
    try:
        # Rank 0's steps go to rank 1.
        wait_until("rank 1 holding rank 0's step 2", lambda: (0, 2) in held_by(net, token, 1), 30)
        net.set_link(0, 1, up=False)
        commit_mtc_step(ramdisk / "host-0", 3, {"x.bin": os.urandom(1 << 20)}, host=0,
                        num_hosts=N)
        # Every attempt over the cut link fails within its deadline; the step is not
        # counted as replicated, and no partial copy shows up at the target.
        log0 = ramdisk / "replicator-0.log"
        wait_until("a bounded failure over the cut link", lambda: "step 3 not replicated to "
                   "rank 1" in log0.read_text(errors="replace"), 40)
        assert (0, 3) not in held_by(net, token, 1)
        net.set_link(0, 1, up=True)
        wait_until("step 3 replicated after the link came back",
                   lambda: (0, 3) in held_by(net, token, 1), 40)
    finally:
        stop(procs, ramdisk)
