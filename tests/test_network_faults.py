"""Network faults on the isolated cluster: link cuts during a peer copy and during
a backup upload, one slice partitioned from the other, a peer slower than the
deadline; then heal.

Four hosts (2 slices x 2), each a network namespace with an address on a bridge
this module creates (``mtc/testing/isolation.py``), a private RAM disk, a sidecar
and a replicator; the real fake-gcs-server in this namespace, at the bridge's
address, as the backup store. This process is the controller
(``mtc.CheckpointManager`` over the sidecars and replicators). Faults: a host's
veth down (``Hosts.link``: it goes silent for everyone), blackhole routes
between the slices' hosts (``Hosts.partition``: the slices lose each other, the
controller still reaches all), SIGSTOP of a replicator. There is no tc netem
here; a process stopped past the deadline is the slow peer.

Asserts: nothing partial is ever counted (a copy in the receiver's inventory,
a backup in the bucket's listing) before it is complete and verified; every
wait ends within its deadline with a typed error; no two hosts read different
decisions; after healing, the copy, the backup and the restore complete, and
every restored value is exact.

The cluster, its states and the /proc probes are ``tests/fault_net.py``'s; a
backup store that stalls or forgets an upload (no cluster) is
``tests/test_backup_store_faults.py``'s.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fault_net import (
    BUCKET,
    FAIL_TIMEOUT_S,
    SLACK_S,
    SLICES,
    TIMEOUT_S,
    Net,
    assert_exact,
    big_state,
    open_positions,
    queued_to,
    small_state,
    when,
)
from jax.sharding import Mesh

import mtc
from mtc.errors import MtcError
from mtc.grpc_errors import PeerError
from mtc.ports import free_ports
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.job import step_prefix
from mtc.testing import gcs_emulator
from mtc.testing.isolation import Hosts, namespaces_available
from mtc.testing.waits import timed_wait, wait_until


def _notable(log: str) -> list[str]:
    marks = ("WARNING", "ERROR", "Traceback", "Exception")
    return [ln[:400] for ln in log.splitlines() if any(m in ln for m in marks)][-60:]


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    if not namespaces_available():
        pytest.skip("network faults need network namespaces (root, ip, nsenter)")
    hosts = Hosts(Path("/dev/shm") / f"mtc-netfault-{uuid.uuid4().hex[:8]}", 4,
                  ramdisk_bytes=768 << 20)
    emu: subprocess.Popen[bytes] | None = None
    try:
        bridge = f"{hosts.subnet}.1"
        port = free_ports(1, bridge)[0]
        url = f"http://{bridge}:{port}"
        # The emulator listens on the bridge's address (its own namespace's), so the
        # hosts reach it over their links; its upload URLs name that address too.
        emu = subprocess.Popen(
            [str(gcs_emulator.binary()), "-scheme", "http", "-backend", "memory",
             "-host", bridge, "-port", str(port), "-external-url", url,
             "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        gcs_emulator.wait_ready(emu, url)
        gcs_emulator.create_bucket(url, BUCKET)
        n = Net(hosts, url)
        with ThreadPoolExecutor(4) as pool:  # the hosts start at once, as real ones do
            list(pool.map(lambda i: hosts.start_sidecar(i, SLICES, env=n.env), range(4)))
        for i in range(4):
            n.start_replicator(i)
        for i in range(4):
            n.wait_serving(i)
        yield n
    finally:
        # For a failure's report: every warning and error, then the log's tail.
        tails = {i: "\n".join(_notable(hosts.log_tail(i, "replicator", 1 << 24)))
                 + "\n...\n" + hosts.log_tail(i, "replicator") for i in range(4)}
        for h in hosts.hosts:  # a test that failed while one was stopped
            if h.replicator is not None and h.replicator.poll() is None:
                os.kill(h.replicator.pid, signal.SIGCONT)
        hosts.down()
        if emu is not None:
            gcs_emulator.stop(emu.pid)
            emu.wait(10)
        for i, t in tails.items():
            print(f"--- replicator {i} ---\n{t}")


@pytest.fixture
def healed(net: Net) -> Iterator[Net]:
    """The cluster, healed again however the test ends."""
    try:
        yield net
    finally:
        for i in range(4):
            h = net.hosts.hosts[i]
            if h.replicator is not None and h.replicator.poll() is None:
                os.kill(h.replicator.pid, signal.SIGCONT)
        net.hosts.heal()
        # A restore the test saw fail may still wait on its decision on some host
        # (until its own deadline): answered by the next test's restore, it would
        # fence off the next test's newer saves there. The next test starts once
        # none waits.
        wait_until("no restore waiting on any host",
                   lambda: not any(net.restores_waiting(i) for i in range(4)),
                   TIMEOUT_S + SLACK_S,
                   detail=lambda: [net.restores_waiting(i) for i in range(4)])


# -- 1. a link cut during a peer copy ----------------------------------------------------


@pytest.mark.process
def test_link_cut_during_peer_copy_is_never_counted_and_completes_after_heal(
        healed: Net, mesh: Mesh, tmp_path: Path) -> None:
    net, hosts = healed, healed.hosts
    # Host 1's copy goes to host 3 (same position, other slice). The moment host 3
    # is writing it, the two lose each other: the copy is cut midway.
    incoming = "/.mtc-replica/1/{step}.mtc-tmp-"
    size = 24 << 20
    # A copy that finished before the cut landed, or faster than the watcher saw it
    # midway (a few milliseconds on a quiet machine): again, with the next step.
    for step in (10, 11, 12, 13, 14):
        needle = incoming.format(step=step)
        cut_at_s: list[float] = []
        # Hosts 1 and 3 lose each other (every packet between them dropped); the
        # controller still reaches both, as its requests may still be in flight.
        done = threading.Event()
        trigger, fired = when(
            lambda n=needle: any(0 < p < size // 2 for p in open_positions(net.pid(3), n)),
            lambda c=cut_at_s: (hosts.cut(1, 3), c.append(time.monotonic())), 60.0, done)
        try:
            with mtc.CheckpointManager(tmp_path, mesh=mesh, options=net.options()) as mgr:
                mgr.save(step, big_state(mesh, step), force=True)
                mgr.wait_until_finished()
            # Until the watcher cut the copy, or host 3 holds it whole (missed).
            timed_wait(f"step {step} on host 3, cut or whole",
                     lambda s=step, f=fired: f.is_set() or (1, s) in net.held(3), 60.0)
        finally:
            done.set()
            trigger.join()
        if not fired.is_set():
            print(f"step {step}: copied whole before the watcher saw it midway")
            continue
        if (1, step) not in net.held(3):
            print(f"step {step}: cut at {open_positions(net.pid(3), needle)}")
            break
        hosts.heal()
    else:
        raise AssertionError("every copy completed before the cut took effect")
    cut_at = len(net.log(1))

    def never_counted() -> None:
        assert (1, step) not in net.held(3), "a partial copy was counted"

    # The receiver lets go of the half-written file soon (its keepalive finds the
    # sender gone: pinged every 2 s, unanswered for 3 s), not when TCP gives up
    # (20 s) or at the push's 120 s deadline: a link that flaps must not pin server
    # threads and RAM disk. Meanwhile the receiver never lists the copy.
    timed_wait("the receiver dropping the cut stream",
             lambda: not open_positions(net.pid(3), needle), 60.0, during=never_counted)
    dropped = time.monotonic() - cut_at_s[0]
    print(f"the receiver dropped the cut stream {dropped:.1f}s after the cut")
    assert dropped < 8.0, dropped
    # The sender's push fails within its own keepalive (fault_net.KEEPALIVE_S,
    # unanswered for half as long: no reset comes over a dead link), typed. (Timed
    # apart from the receiver: a sender held by flow control when the link went
    # finds out only by pinging.)
    failed = f"rank 1: step {step} not replicated to rank 3"
    waited = timed_wait("the cut copy's failure", lambda: failed in net.log(1)[cut_at:], 60.0,
                      during=never_counted)
    print(f"the sender's push failed {dropped + waited:.1f}s after the cut")
    never_counted()
    assert f"step {step} replicated to rank 3" not in net.log(1)[cut_at:]
    hosts.heal()
    timed_wait("the copy after the heal", lambda: (1, step) in net.held(3), 60.0)
    inv = net.inventory(3)
    copy = next(c for c in inv.copies if (c.origin_rank, c.step) == (1, step))
    assert sum(f.size for f in copy.files) >= 48 << 20  # the whole step, verified
    assert inv.quarantined_files == 0
    for i in range(4):
        assert "Traceback" not in net.log(i), net.log(i)[-3000:]


# -- 2. a link cut during a backup upload --------------------------------------------


@pytest.mark.process
def test_link_cut_during_backup_upload_lists_no_partial_backup(
        healed: Net, mesh: Mesh, tmp_path: Path) -> None:
    net, hosts = healed, healed.hosts
    bridge, port = net.emulator_url.removeprefix("http://").split(":")
    store = net.backups()
    step = 20
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=net.options()) as mgr:
        mgr.save(step, big_state(mesh, step), force=True)
        mgr.wait_until_finished()
    net.wait_replicated(step)  # from here host 1 sends bulk bytes only to the bucket
    # Host 1 uploads its own shards (the leader spreads uploads over the holders);
    # the moment they are on the wire, its link goes down.
    trigger, fired = when(
        lambda: queued_to(net.pid(1), bridge, int(port)) > 0 and
        bool(open_positions(net.pid(1), f"/ramdisk/{step}/")),
        lambda: hosts.link(1, False), 60.0)
    answer: list[Any] = []

    def request() -> None:
        c = net.client(0)
        try:
            answer.append(c.call("RequestBackup", pb.BackupRequest(step=-1), deadline_s=120,
                                 attempts=1).step)
        except PeerError as e:
            answer.append(e)
        finally:
            c.close()

    t0 = time.monotonic()
    requester = threading.Thread(target=request)
    requester.start()
    requester.join(120 + SLACK_S)
    trigger.join()
    assert fired.is_set(), "host 1 never uploaded"
    took = time.monotonic() - t0
    print(f"RequestBackup after the cut: {answer} in {took:.1f}s")
    assert answer, "RequestBackup did not end within its deadline"
    # Cut mid-upload: the leader's call for host 1's part fails within the channel's
    # keepalive (typed: retryable), and the request is tried again (gRPC retries
    # UNAVAILABLE), the leader then reading host 1's data from its peer copy on host 3.
    assert isinstance(answer[0], PeerError) or answer[0] == step, answer
    assert took < 120 + SLACK_S

    def no_partial_backup() -> None:
        for s in store.committed_steps():
            manifest = store.manifest(s)
            present = set(store.backend.list(f"{step_prefix(s)}/"))
            for entries in manifest.values():
                for e in entries:
                    assert f"{step_prefix(s)}/{e.object}" in present, (s, e)

    # The leader retries (from the peer copy of host 1's data, or after the heal);
    # whatever the bucket lists meanwhile is complete.
    timed_wait("a backup failure", lambda: "backup failed" in net.log(0), 60.0,
             during=no_partial_backup)
    no_partial_backup()
    hosts.link(1, True)
    timed_wait("the backup after the heal", lambda: step in store.committed_steps(), 60.0,
             during=no_partial_backup)
    manifest = store.manifest(step)
    assert sorted(manifest) == [0, 1, 2, 3]
    out = tmp_path / "check"
    for rank, entries in manifest.items():  # every object, size and CRC32C checked
        for e in entries:
            local = out / str(rank) / e.path
            local.parent.mkdir(parents=True, exist_ok=True)
            store.backend.get_file(f"{step_prefix(step)}/{e.object}", local, size=e.size,
                                   crc32c=e.crc32c)
    assert sum(e.size for es in manifest.values() for e in es) >= 4 * (48 << 20)
    timed_wait("the leader's listing", lambda: step in net.inventory(0).backed_up_steps, 20.0)


# -- 3. one slice partitioned from the other ------------------------------------------


def decisions(net: Net) -> set[tuple[int, int]]:
    """(epoch, step) of the newest decision each host read. Asked again for a few
    seconds while a host is unreachable: right after a heal, gRPC fails calls fast
    until its next connection attempt (backoff) gets through."""
    deadline = time.monotonic() + SLACK_S
    while True:
        try:
            return {(inv.last_decision.epoch, inv.last_decision.step)
                    for inv in (net.inventory(i) for i in range(4))}
        except PeerError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def restore_failing(net: Net, mgr: mtc.CheckpointManager, target: Any) -> MtcError:
    """A restore of ``mgr``'s directory that must fail, typed, within its deadline:
    by a second manager (a reader beside ``mgr``) whose deadline is FAIL_TIMEOUT_S."""
    t0 = time.monotonic()
    with mtc.CheckpointManager(mgr.directory, mesh=mgr.mesh,
                               options=net.options(FAIL_TIMEOUT_S)) as short:
        with pytest.raises(MtcError) as e:
            short.restore(None, target)
    took = time.monotonic() - t0
    print(f"restore failed in {took:.1f}s: {e.value!r}")
    assert took < FAIL_TIMEOUT_S + SLACK_S, took
    return e.value


@pytest.mark.process
def test_slice_partition_fails_typed_within_the_deadline_then_restores(
        healed: Net, mesh: Mesh, tmp_path: Path) -> None:
    net, hosts = healed, healed.hosts
    step = 30
    state = small_state(mesh, step)
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=net.options()) as mgr:
        mgr.save(step, state, force=True)
        mgr.wait_until_finished()
        net.wait_replicated(step)
        before = decisions(net)
        # Each slice's hosts reach each other and the controller, not the other slice.
        hosts.partition([[0, 1], [2, 3]])
        err = restore_failing(net, mgr, state)
        assert isinstance(err, mtc.AgreementError), repr(err)
        assert decisions(net) == before  # nothing was decided, by anyone
        # A partial partition: only host 3 and the coordinator lose each other.
        hosts.heal()
        hosts.cut(0, 3)
        err = restore_failing(net, mgr, state)
        assert isinstance(err, mtc.AgreementError), repr(err)
        assert re.search(r"rank(\(s\))? (\[[\d, ]*\b)?3\b", str(err)), err  # names host 3
        assert decisions(net) == before
        hosts.heal()
        back = mgr.restore(None, state)
        assert_exact(back, state)
        after = decisions(net)
        assert len(after) == 1 and after.pop()[1] == step  # one decision, read by all
    for i in range(4):
        assert "Traceback" not in net.log(i), net.log(i)[-3000:]


# -- 4. a peer slower than the deadline -----------------------------------------------


@pytest.mark.parametrize("stopped", [0, 2], ids=["coordinator", "member"])
@pytest.mark.process
def test_peer_slower_than_the_deadline_fails_typed_then_restores(
        healed: Net, mesh: Mesh, tmp_path: Path, stopped: int) -> None:
    net = healed
    step = 40 + stopped
    state = small_state(mesh, step)
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=net.options()) as mgr:
        mgr.save(step, state, force=True)
        mgr.wait_until_finished()
        net.wait_replicated(step)
        before = decisions(net)
        os.kill(net.pid(stopped), signal.SIGSTOP)  # alive, connected, answering nothing
        try:
            err = restore_failing(net, mgr, state)
            assert isinstance(err, mtc.AgreementError), repr(err)
        finally:
            os.kill(net.pid(stopped), signal.SIGCONT)
        assert decisions(net) == before
        back = mgr.restore(None, state)
        assert_exact(back, state)
        after = decisions(net)
        assert len(after) == 1 and after.pop()[1] == step


# -- 5. the chaos driver's network faults, on these hosts -------------------------------


@pytest.mark.process
def test_chaos_link_cuts_lose_nothing_and_never_diverge(
        healed: Net, mesh: Mesh, tmp_path: Path) -> None:
    """The chaos driver's link cuts (its own plan and cut, on real isolated hosts:
    before the restore, and during its reads from the hosts), healed while the
    restore runs: the restore ends within its deadline, exact and of the newest
    replicated step, or with a typed error; once healed every host reads one
    decision."""
    import random

    from mtc.trainer import chaos_net

    net, rng = healed, random.Random(11)
    slices = [[0, 1], [2, 3]]
    outcomes = []
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=net.options()) as mgr:
        # The partition is the driver's too; its restore is over before a plan's
        # delay (agreement takes milliseconds), and the test above covers it.
        for k, kind in enumerate(("cut_link", "cut_link_in_restore")):
            step = 50 + k
            # 48 MiB a host for the cut during the restore: the restore reads for a
            # second or two, so the fault planned for its middle lands there.
            state = (big_state if kind.endswith("_in_restore") else small_state)(mesh, step)
            mgr.save(step, state, force=True)
            mgr.wait_until_finished()
            net.wait_replicated(step)
            f = chaos_net.plan_net_fault(kind, rng.randrange(4), slices, rng)
            got: list[Any] = []

            def restore(target: Any = state, got: list[Any] = got) -> None:
                t0 = time.monotonic()
                try:
                    got.append(mgr.restore(None, target))
                except MtcError as e:
                    got.append(e)
                got.append(time.monotonic() - t0)

            if not f.during_restore:
                chaos_net.cut(net.hosts, f)
            t = threading.Thread(target=restore)
            t.start()
            try:
                if f.during_restore:
                    time.sleep(f.start_delay_s)
                    chaos_net.cut(net.hosts, f)
                time.sleep(f.heal_after_s)
            finally:
                net.hosts.heal()
                t.join(TIMEOUT_S + 2 * SLACK_S)
            assert not t.is_alive(), f"{kind}: the restore did not end"
            result, took = got
            print(f"{kind} {f}: {result if isinstance(result, MtcError) else 'ok'} "
                  f"in {took:.1f}s", flush=True)
            assert took < TIMEOUT_S + 2 * SLACK_S, (kind, took)
            if isinstance(result, MtcError):
                outcomes.append((kind, type(result).__name__))
                back = mgr.restore(None, state)  # healed: it restores now
            else:
                outcomes.append((kind, "ok"))
                back = result
            assert_exact(back, state)  # nothing lost: the newest replicated step, exact
            after = decisions(net)
            assert len(after) == 1 and after.pop()[1] == step, (kind, after)
    print("network faults:", outcomes)
