"""Save and restore through sidecar processes, each alone with its host's RAM disk.

With root, every host is a network namespace of its own (an address on a bridge
the test creates) and its RAM disk a private tmpfs in a mount namespace: this
test process cannot see a single step file, so only the seam can have done the
work. The controller's arrays are on 8 CPU devices grouped into 4 hosts.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from replicators import env_with_repo, save_two_and_restore, wait_healthy

import mtc
from mtc.credentials import Credentials
from mtc.ports import free_ports
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.testing.isolation import Hosts
from mtc.testing.replicas import HostReplicators
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process  # every test here starts processes

SLICES = [0, 0, 1, 1]



def _opts(hs: Hosts, **kw: object) -> mtc.Options:
    kw = {"replicator_token": hs.token(), **kw}  # the sidecars require it
    return mtc.Options(simulated_hosts=4, hosts_per_slice=2,
                       sidecars=tuple(h.sidecar_address for h in hs.hosts), **kw)  # type: ignore[arg-type]


def _state(mesh: Mesh) -> dict[str, object]:
    w = jax.device_put(np.arange(8 * 16, dtype=np.float32).reshape(8, 16),
                       NamedSharding(mesh, PartitionSpec("replica", "model")))
    b = jax.device_put(np.arange(16, dtype=np.int32), NamedSharding(mesh, PartitionSpec()))
    return {"w": w, "b": b, "np": np.arange(5, dtype=np.int64), "step": 7}


def test_save_restore_through_isolated_sidecars(hosts: Hosts, mesh: Mesh,
                                                tmp_path: Path) -> None:
    state = _state(mesh)
    local = tmp_path / "controller-view"
    with mtc.CheckpointManager(local, mesh=mesh, options=_opts(hosts)) as mgr:
        back, moved = save_two_and_restore(mgr, state)
        whole = mgr.restore(2)
    for got in (back, moved, whole):
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
    np.testing.assert_array_equal(np.asarray(back["b"]), np.arange(16))
    np.testing.assert_array_equal(whole["np"], np.arange(5))
    assert whole["step"] == 7
    if hosts.isolation == "namespaces":
        for h in hosts.hosts:  # the RAM disks are private to the hosts' processes
            assert list(h.root.iterdir()) == []
    assert not local.exists() or not any(local.iterdir())


def test_restore_after_host_lost_names_the_host(hosts: Hosts, mesh: Mesh,
                                                tmp_path: Path) -> None:
    state = _state(mesh)
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=_opts(hosts)) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
    hosts.kill(2)  # its processes, and with namespaces its RAM disk
    hosts.start_sidecar(2, SLICES, env=env_with_repo())
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=_opts(hosts)) as mgr:
        if hosts.isolation == "namespaces":
            assert mgr.all_steps() == []  # host 2 came back empty
            with pytest.raises(mtc.StepNotFoundError) as e:
                mgr.restore(1, target=state)
            assert e.value.host == 2
        else:
            assert mgr.all_steps() == [1]  # a private folder survives its processes


class Replicators(HostReplicators):
    """A replicator per host, each in its host's namespaces (it sees its RAM disk
    only, and its peers over the bridge, with a token); the harness's waits."""

    def __init__(self, hosts: Hosts, *, quiet_s: float = 2.0) -> None:
        ports = [7000] * 4 if hosts.isolation == "namespaces" else free_ports(4)
        super().__init__(hosts, [hosts.replicator_address(i, ports[i]) for i in range(4)],
                         per_slice=2)
        self.quiet_s = quiet_s  # --restore-quiet-seconds
        self.env = env_with_repo()
        procs = [self.launch(i) for i in range(4)]  # all at once, as a job's hosts start
        for i, proc in enumerate(procs):
            self.wait_serving(i, proc)

    def launch(self, i: int) -> subprocess.Popen[bytes]:
        return self.hosts.start_replicator(i, [
            "--local-dir", str(self.hosts.hosts[i].root), "--listen", self.addrs[i],
            "--nodes", ",".join(self.addrs), "--rank", str(i), "--nodes-per-slice", "2",
            "--poll-seconds", "0.05", "--agreement-timeout-seconds", "30",
            "--restore-quiet-seconds", str(self.quiet_s)], env=self.env)

    def wait_serving(self, i: int, proc: subprocess.Popen[bytes]) -> None:
        wait_healthy(self.addrs[i], lambda: proc.poll() is None, Credentials(),
                     lambda: self.hosts.log_tail(i, "replicator"), 60.0)

    def start(self, i: int) -> None:
        self.wait_serving(i, self.launch(i))

    def options(self, **kw: object) -> mtc.Options:
        # Built anew after a replacement: its sidecar listens on a new port.
        return _opts(self.hosts, replicators=tuple(self.addrs),
                     replicator_token=self.hosts.token(), restore_timeout_s=30.0, **kw)

    def wait_for_copy(self, holder: int, origin: int, step: int) -> None:
        self.wait_held({(holder, origin, step)})

    def replace(self, i: int) -> None:
        """Lose host ``i`` (SIGKILL) and start it again with an empty RAM disk."""
        self.hosts.kill(i)
        if self.hosts.isolation == "processes":
            shutil.rmtree(self.hosts.hosts[i].root)  # the RAM disk goes with the host
            self.hosts.hosts[i].root.mkdir()
        self.hosts.start_sidecar(i, SLICES, env=self.env)
        self.start(i)

    def assert_no_tracebacks(self) -> None:
        for i in range(4):
            assert "Traceback" not in self.hosts.log_tail(i, "replicator", 100000)


def test_replicators_in_host_namespaces_bring_a_lost_host_back(hosts: Hosts, mesh: Mesh,
                                                               tmp_path: Path) -> None:
    """A host lost and replaced empty gets its shards back from its peer in the
    other slice. Its shards are its own (split over the slices): no other host's
    copy covers them, so the restore waits for them to arrive."""
    reps = Replicators(hosts)
    state = _state(mesh)
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=reps.options()) as mgr:
        assert mgr.dispatch_mode == "process"  # "auto": these sidecars run no colocated Python
        mgr.save(3, state)
        mgr.wait_until_finished()
    # Host 1's peer is host 3 (same position, other slice): wait until it holds the copy.
    reps.wait_for_copy(3, 1, 3)
    client = PeerClient(reps.addrs[3], Credentials(token=hosts.token()), rank=-1)
    # A leader election's question: the rank only, no copies checked.
    brief = client.call("GetInventory", pb.InventoryRequest(rank_only=True), attempts=1)
    # A pusher's question (which of my steps do you hold?): its copies alone.
    whole = client.call("GetInventory", pb.InventoryRequest(), attempts=1)
    mine = client.call("GetInventory", pb.InventoryRequest(origins=[1]), attempts=1)
    # Holdings' question (the agreement, GC's complete-step view, a pusher's
    # sync): the same verified copies, without their file lists.
    bare = client.call("GetInventory", pb.InventoryRequest(without_files=True), attempts=1)
    client.close()
    assert brief.rank == 3 and not brief.copies
    assert {c.origin_rank for c in whole.copies} == {1, 3}
    assert [(c.origin_rank, c.step) for c in mine.copies] == [(1, 3)]
    assert list(mine.copies[0].files) == [
        f for c in whole.copies if c.origin_rank == 1 for f in c.files]
    assert [(c.origin_rank, c.step, c.saved_hosts) for c in bare.copies] == [
        (c.origin_rank, c.step, c.saved_hosts) for c in whole.copies]
    assert all(c.files for c in whole.copies) and not any(c.files for c in bare.copies)
    reps.replace(1)
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=reps.options()) as mgr:
        assert mgr.latest_step() == 3
        back = mgr.restore(3, target=state)
        assert mgr.last_restore_tiers[1] == "peer"
        assert "wait_pending" in mgr.last_restore_seconds  # nobody else holds its shards
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(state["w"]))
    reps.assert_no_tracebacks()


def test_a_replaced_host_is_restored_from_its_replica_while_its_data_comes_back(
        hosts: Hosts, mesh: Mesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state is replicated over the slices: host 3 holds the regions host 1's
    devices need. After host 1 is replaced empty, the restore reads nothing from
    it and does not wait for its peer fetch; its replicator makes its own data
    local in the background, verified, and the next restore finds it there. The
    fetch starts when the job says its load is over, not when the replicator's
    quiet time (here far longer than the test) runs out."""
    from mtc.dispatch.process import ProcessDispatch

    real = ProcessDispatch._request
    loads: dict[int, int] = {}

    def request(self: ProcessDispatch, host: int, op: str, args: dict[str, object],
                timeout: float | None) -> object:
        if op == "load":
            loads[host] = loads.get(host, 0) + 1
        return real(self, host, op, args, timeout)

    reps = Replicators(hosts, quiet_s=600.0)
    replicated = NamedSharding(mesh, PartitionSpec(None, "model"))
    state = {f"w{i}": jax.device_put(np.arange(i, i + 32 * 32, dtype=np.float32).reshape(
        32, 32), replicated) for i in range(4)}
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=reps.options()) as mgr:
        assert mgr.save(4, state, force=True)
        mgr.wait_until_finished()
    reps.wait_for_copy(3, 1, 4)
    reps.replace(1)
    monkeypatch.setattr(ProcessDispatch, "_request", request)
    with mtc.CheckpointManager(tmp_path, mesh=mesh, options=reps.options()) as mgr:
        back = mgr.restore(None, target=state)
        assert mgr.last_restore_tiers == {0: "local", 1: "peer", 2: "local", 3: "local"}
        assert "wait_pending" not in mgr.last_restore_seconds
        assert 1 not in loads and sorted(loads) == [0, 2, 3]  # host 1 read nothing
        for k, a in state.items():
            for shard in back[k].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data),
                                              np.asarray(a)[shard.index])
        # Host 1's own copy arrives in the background (its replicator told the load
        # is over, not waiting out its quiet time), committed and listed by its sidecar.
        wait_until("host 1 holding step 4 again", lambda: 4 in mgr._inventory.held().get(1, []),
                   60, detail=lambda: hosts.log_tail(1, "replicator"))
        loads.clear()
        again = mgr.restore(None, target=state)
        assert mgr.last_restore_tiers == {h: "local" for h in range(4)}
        assert 1 in loads  # its own copy is read again
    for k, a in state.items():
        np.testing.assert_array_equal(np.asarray(again[k]), np.asarray(a))
    log1 = hosts.log_tail(1, "replicator", 100000)
    assert "in the background" in log1
    assert "the job loaded step 4; its background fetch starts" in log1
    reps.assert_no_tracebacks()


def test_a_refused_stage_is_raised_on_the_next_call_and_never_committed(
        hosts: Hosts, mesh: Mesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``save`` returns once the shards are in the hosts' areas and the requests are
    sent; the hosts' answers are awaited by the next call. A host's refusal (here
    its real sidecar refusing a malformed stage request, the one fault injected on
    the controller's side) is raised, typed and naming the host, by the next call;
    that host never commits the step, no later request overtakes the refused one,
    and its slot is free again: the next save commits on every host."""
    from mtc.dispatch.process import ProcessDispatch
    from mtc.errors import ProtocolError

    real = ProcessDispatch._request
    bad = {"step": 2, "host": 1}

    def request(self: ProcessDispatch, host: int, op: str, args: dict[str, object],
                timeout: float | None) -> object:
        if op == "stage" and host == bad["host"] and f'"step": {bad["step"]}' in str(
                args.get("header", "")):
            args = {**args, "slot": "../elsewhere"}
        return real(self, host, op, args, timeout)

    monkeypatch.setattr(ProcessDispatch, "_request", request)
    state = _state(mesh)
    with mtc.CheckpointManager(tmp_path / "controller-view", mesh=mesh,
                               options=_opts(hosts, max_to_keep=None)) as mgr:
        assert mgr.save(1, state)
        # Nothing sent after a save overtakes its stage requests: every host has
        # committed the step when wait_until_finished returns.
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
        assert mgr.save(2, state) is True  # the refusal is not awaited here
        with pytest.raises(ProtocolError, match="bad slot name") as e:
            mgr.wait_until_finished()
        assert e.value.host == 1
        mgr.wait_until_finished()  # raised once; the others' writes finished
        assert mgr.all_steps() == [1]  # step 2 is on hosts 0, 2, 3 only: not a step
        held = mgr._dispatch.steps(mgr.topology.local_hosts)
        assert [2 in held[h] for h in range(4)] == [True, False, True, True]
        assert mgr.save(3, state)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]
        np.testing.assert_array_equal(np.asarray(mgr.restore(3, target=state)["w"]),
                                      np.asarray(state["w"]))
        # The hosts are asked for their steps while the shards are copied into
        # their areas: a step committed everywhere is still refused (nothing is
        # sent, its slots stay free) and one on some hosts only is replaced.
        with pytest.raises(mtc.StepExistsError):
            mgr.save(3, state, force=True)
        doubled = {**state, "w": state["w"] * 2}  # type: ignore[operator]
        bad["step"] = -1  # host 1 takes step 2 this time
        assert mgr.save(2, doubled, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3]
        np.testing.assert_array_equal(np.asarray(mgr.restore(2, target=state)["w"]),
                                      2 * np.asarray(state["w"]))
        np.testing.assert_array_equal(np.asarray(mgr.restore(3, target=state)["w"]),
                                      np.asarray(state["w"]))


def test_steps_off_the_interval_ask_the_hosts_only_while_a_save_is_in_flight(
        hosts: Hosts, mesh: Mesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``save`` off the save interval is called at every training step: with
    nothing in flight it sends no request at all, and while a save is in flight
    it polls at most every ``POLL_INTERVAL_S``, so a host's refusal still comes
    out of it, typed and naming the host, within about that long."""
    from mtc.dispatch import process
    from mtc.dispatch.process import ProcessDispatch
    from mtc.errors import ProtocolError

    real = ProcessDispatch._request
    sent: list[str] = []

    def request(self: ProcessDispatch, host: int, op: str, args: dict[str, object],
                timeout: float | None) -> object:
        sent.append(op)
        if op == "stage" and host == 2 and '"step": 8' in str(args.get("header", "")):
            args = {**args, "slot": "../elsewhere"}  # host 2 refuses step 8
        return real(self, host, op, args, timeout)

    monkeypatch.setattr(ProcessDispatch, "_request", request)
    state = _state(mesh)
    with mtc.CheckpointManager(tmp_path / "controller-view", mesh=mesh,
                               options=_opts(hosts, save_interval_steps=4,
                                             max_to_keep=None)) as mgr:
        assert mgr.save(4, state)
        mgr.wait_until_finished()
        sent.clear()
        assert [mgr.save(s, state) for s in (5, 6, 7)] == [False] * 3
        assert sent == []  # nothing in flight: not one round trip per step
        assert mgr.save(8, state)
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="bad slot name") as e:
            for _ in range(400):  # bounded: 20 s at most
                mgr.save(9, state)  # off the interval
                time.sleep(0.05)
        took = time.monotonic() - t0
        assert e.value.host == 2
        assert took < 10 * process.POLL_INTERVAL_S
        polls = sent.count("poll")
        assert 0 < polls <= 4 * (took / process.POLL_INTERVAL_S + 2)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4]  # step 8 never became a step


def test_a_region_both_slices_need_is_read_once_and_the_reads_spread(
        hosts: Hosts, mesh: Mesh, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both slices save their data-parallel replica; a restore reads each region
    once, by one of the hosts holding it, and places it onto both slices'
    devices: half the bytes of reading every host's own copy, spread over all
    four hosts, and the same values on every device."""
    from mtc.dispatch.process import ProcessDispatch

    real = ProcessDispatch._request
    asked: dict[int, int] = {}

    def request(self: ProcessDispatch, host: int, op: str, args: dict[str, object],
                timeout: float | None) -> object:
        if op == "load":
            for t in args["tasks"]:  # type: ignore[attr-defined]
                n = int(np.prod([b - a for a, b in t["index"]])) * 4
                asked[host] = asked.get(host, 0) + n
        return real(self, host, op, args, timeout)

    monkeypatch.setattr(ProcessDispatch, "_request", request)
    replicated = NamedSharding(mesh, PartitionSpec(None, "model"))  # same on both slices
    state = {f"w{i}": jax.device_put(np.arange(i, i + 64 * 64, dtype=np.float32).reshape(
        64, 64), replicated) for i in range(8)}
    with mtc.CheckpointManager(tmp_path / "controller-view", mesh=mesh,
                               options=_opts(hosts)) as mgr:
        assert mgr.save(1, state, force=True)
        mgr.wait_until_finished()
        back = mgr.restore(1, target=state)
    state_bytes = sum(int(a.nbytes) for a in state.values())
    assert sum(asked.values()) == state_bytes  # once, not once per slice
    assert sorted(asked) == [0, 1, 2, 3] and max(asked.values()) == state_bytes // 4
    for k, a in state.items():
        assert back[k].sharding == replicated
        for shard in back[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data),
                                          np.asarray(a)[shard.index])
