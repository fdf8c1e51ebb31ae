"""The colocated path's costs as Pathways would see them: how many colocated calls
a save and a restore make (fixed, whatever the host count), and that restored
bytes never become controller Python objects.

The calls run on JAX's in-process CPU fallback here (the sidecar processes run
the same programs in tests/test_colocated_hosts.py); what is counted and
instrumented is the controller's side of the seam, ``ColocatedDispatch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mtc
from mtc.dispatch import calls, colocated, colocated_load


def _manager(ramdisk: Path, hosts: int) -> mtc.CheckpointManager:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("replica", "model"))
    return mtc.CheckpointManager(ramdisk, mesh=mesh, options=mtc.Options(
        simulated_hosts=hosts, hosts_per_slice=hosts // 2, dispatch="colocated"))


def _state(mgr: mtc.CheckpointManager, rows: int = 8) -> dict[str, Any]:
    assert mgr.mesh is not None
    w = jax.device_put(np.arange(rows * 16, dtype=np.float32).reshape(rows, 16),
                       NamedSharding(mgr.mesh, PartitionSpec("replica", "model")))
    b = jax.device_put(np.arange(16, dtype=np.int32), NamedSharding(mgr.mesh, PartitionSpec()))
    return {"w": w, "b": b, "step": 3}


def _calls(mgr: mtc.CheckpointManager) -> int:
    return int(mgr._dispatch.calls)  # type: ignore[attr-defined]


@pytest.mark.parametrize("hosts", [4, 8])
def test_a_save_and_a_restore_make_a_fixed_handful_of_calls(ramdisk: Path, hosts: int) -> None:
    with _manager(ramdisk, hosts) as mgr:
        state = _state(mgr)
        made = []
        for step in (1, 2, 3):  # the first, and saves with retention riding along
            before = _calls(mgr)
            assert mgr.save(step, state)
            made.append(_calls(mgr) - before)
        assert made == [2, 2, 2]
        mgr.wait_until_finished()
    # A restarted job: a fresh manager restores the newest step, and a given one.
    with _manager(ramdisk, hosts) as mgr:
        before = _calls(mgr)
        back = mgr.restore(None, _state(mgr))
        newest = _calls(mgr) - before
        before = _calls(mgr)
        mgr.restore(2, _state(mgr))
        given = _calls(mgr) - before
    # The survey and the load: fencing the newest step off reuses the survey's
    # listing (a delete call only where a newer, unfinished save is left).
    assert (newest, given) == (2, 2)
    np.testing.assert_array_equal(np.asarray(back["w"]), np.arange(128).reshape(8, 16))
    np.testing.assert_array_equal(np.asarray(back["b"]), np.arange(16))


def test_a_restore_fences_an_unfinished_save_without_listing_again(ramdisk: Path) -> None:
    """The survey's listing names the newer save some host never finished; the
    restore of the newest complete step deletes it with one call (no listing
    after the load), so the resumed run saves that number afresh. The survey
    brought each host's newest manifest, of the unfinished save on three of
    them, so the load asks for step 1's: survey, survey, load, delete."""
    import shutil

    with _manager(ramdisk, 4) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(mgr))
        mgr.wait_until_finished()
    shutil.rmtree(ramdisk / "host-3" / "2")  # its host died before it committed
    with _manager(ramdisk, 4) as mgr:
        before = _calls(mgr)
        mgr.restore(None, _state(mgr))
        assert _calls(mgr) - before == 4
        assert not any((ramdisk / f"host-{h}" / "2").exists() for h in range(4))
        assert mgr.all_steps() == [1]


def test_calls_do_not_grow_with_hosts(ramdisk: Path) -> None:
    counts = {}
    for hosts in (4, 8):
        root = ramdisk / f"h{hosts}"
        with _manager(root, hosts) as mgr:
            state = _state(mgr)
            before = _calls(mgr)
            mgr.save(1, state)
            mgr.wait_until_finished()
            mgr.restore(1, state)
            counts[hosts] = _calls(mgr) - before
    assert counts[4] == counts[8], counts


def test_a_restore_brings_manifests_longer_than_the_fixed_answer_in_its_first_call(
        ramdisk: Path) -> None:
    """A state of many leaves: each host's manifest outgrows the small fixed-size
    answer (a model's has thousands of shards). The manager that saved it learns
    how long the manifests are from its saves' listings (each sees the last
    save's), a restarted job's from its open, and a restore's first call brings
    them all: 2 calls with the load. One that asked for too little fetches the
    rest in one more call, and asks for enough the next time."""
    from mtc.sidecar.colocated import ANSWER_BYTES

    def restore(mgr: mtc.CheckpointManager) -> int:
        before = _calls(mgr)
        back = mgr.restore(None, state)
        for i in range(160):
            np.testing.assert_array_equal(np.asarray(back[f"layer_{i:03d}"]),
                                          np.full((8, 16), i, dtype=np.float32))
        return _calls(mgr) - before

    with _manager(ramdisk, 4) as mgr:
        assert mgr.mesh is not None
        sharding = NamedSharding(mgr.mesh, PartitionSpec("replica", "model"))
        state = {f"layer_{i:03d}": jax.device_put(
            np.full((8, 16), i, dtype=np.float32), sharding) for i in range(160)}
        for step in (1, 2):  # minutes apart in a job: the first is written
            mgr.save(step, state)
            mgr.wait_until_finished()
        dispatch: Any = mgr._dispatch
        # The second save's listing saw the first's manifests.
        assert restore(mgr) == 2 and not dispatch.answers.fetchers
        dispatch._survey_size = ANSWER_BYTES  # as a manager that saw only small steps
        assert restore(mgr) == 3 and dispatch.answers.fetchers
        assert restore(mgr) == 2  # sized to fit since
    with _manager(ramdisk, 4) as mgr:  # a restarted job
        dispatch = mgr._dispatch
        assert restore(mgr) == 2
        assert not dispatch.answers.fetchers
        assert dispatch.answers.read_bytes > 4 * ANSWER_BYTES  # each manifest outgrew it


def test_restored_bytes_never_become_controller_objects(ramdisk: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam where bytes would enter controller Python (a host's reply decoded
    into regions, or a region read by host) refuses to run; every answer the
    controller reads is counted, and is far smaller than the state."""
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("restored bytes passed through the controller")

    with _manager(ramdisk, 4) as mgr:
        state = _state(mgr, rows=1024)  # 64 KiB of w
        mgr.save(1, state)
        mgr.wait_until_finished()
        monkeypatch.setattr(calls, "regions_of", refuse)
        monkeypatch.setattr(colocated, "regions_of", refuse)
        monkeypatch.setattr(colocated.ColocatedDispatch, "_fetch", refuse)
        monkeypatch.setattr(calls.HostCalls, "_fetch", refuse)
        dispatch: Any = mgr._dispatch
        read_before = dispatch.answers.read_bytes
        back = mgr.restore(1, state)
        # Onto half the devices, in another layout: regions other hosts saved are
        # built on their target devices from the holders' pieces.
        half = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
        other = {"w": jax.ShapeDtypeStruct((1024, 16), np.float32,
                                           sharding=NamedSharding(half, PartitionSpec("b", "a"))),
                 "b": state["b"], "step": 0}
        moved = mgr.restore(1, other)
        read = dispatch.answers.read_bytes - read_before
        # Onto the devices in reverse order: every region is one that another host
        # saved whole; it comes back as an array of its own on that host and is
        # moved onto its target device, nothing sliced or compiled here.
        rev = Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("replica", "model"))
        built: list[Any] = []
        assemble = colocated_load._assemble
        monkeypatch.setattr(colocated_load, "_assemble",
                            lambda *a: built.append(a) or assemble(*a))
        swapped = mgr.restore(1, {"w": jax.ShapeDtypeStruct(
            (1024, 16), np.float32, sharding=NamedSharding(rev, PartitionSpec("replica", "model"))),
            "b": state["b"], "step": 0})
    want = np.arange(1024 * 16, dtype=np.float32).reshape(1024, 16)
    np.testing.assert_array_equal(np.asarray(back["w"]), want)
    np.testing.assert_array_equal(np.asarray(moved["w"]), want)
    assert moved["w"].sharding == other["w"].sharding
    np.testing.assert_array_equal(np.asarray(swapped["w"]), want)
    assert swapped["w"].sharding.mesh == rev and built == []
    np.testing.assert_array_equal(np.asarray(moved["b"]), np.arange(16))
    # Two restores' answers (steps and manifests): a fraction of one copy of w (the
    # manifests' own leaves, such as a step's save time, are a constant per host:
    # 15.5 KB of them here, 17 KB once the save time was kept, against 64 KB of w).
    assert 0 < read < want.nbytes // 3, read


def test_a_mesh_of_some_devices_reaches_their_own_hosts_cpu_devices() -> None:
    """A job resized onto slice 1 (devices 4 to 7) asks slice 1's hosts. JAX's CPU
    fallback maps any device list onto the process's first CPU devices (slice 0's:
    a lost host's devices, whose arrays raise DATA_LOSS); each device is its own."""
    from mtc.dispatch.colocated_moves import colocated_cpu, colocated_cpu_mesh

    devices = jax.devices()[4:8]
    assert [d.id for d in colocated_cpu(devices)] == [4, 5, 6, 7]
    mesh = Mesh(np.array(devices).reshape(2, 2), ("replica", "model"))
    assert colocated_cpu_mesh(mesh) is mesh


def test_each_worker_gets_its_own_hosts_reads_only(ramdisk: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A load request's part for a worker names that worker's host's reads and no
    other's (every worker parses what it does): with twice the hosts, each part is
    about half as long, where one request for all grew with the hosts."""
    import json

    from mtc.contract import unframe

    sent: list[dict[int, dict[str, Any]]] = []
    encode = colocated_load.encode

    def keep(plan_: Any, hosts: Any) -> Any:
        size, parts = encode(plan_, hosts)
        sent.append({h: json.loads(unframe(p)[1] or b"") for h, p in parts.items()})
        assert all(p.size == size for p in parts.values())
        return size, parts

    monkeypatch.setattr(colocated_load, "encode", keep)
    longest = {}
    for hosts in (4, 8):
        with _manager(ramdisk / f"h{hosts}", hosts) as mgr:
            state = _state(mgr, rows=64)
            mgr.save(1, state)
            mgr.wait_until_finished()
            back = mgr.restore(1, state)
            np.testing.assert_array_equal(np.asarray(back["w"]),
                                          np.arange(64 * 16).reshape(64, 16))
        parts = sent[-1]
        assert sorted(parts) == list(range(hosts))
        for h, part in parts.items():
            assert list(part["tasks"]) == [str(h)]
            read = {p["host"] for t in part["tasks"][str(h)] for p in t["task"]["pieces"]}
            assert read == {h}, (h, read)
            assert part["outputs"] == parts[0]["outputs"]
        longest[hosts] = max(len(json.dumps(p["tasks"])) for p in parts.values())
    assert longest[8] < 0.75 * longest[4], longest


def test_a_load_request_whose_output_disagrees_with_its_reads_is_refused(
        ramdisk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker places the regions it read as the shards of the arrays the request
    names; a request whose output shape disagrees with the regions its reads give
    (a malformed or foreign request) is refused with the shapes named, before any
    array is made of them."""
    import json

    from mtc.contract import frame, unframe
    from mtc.errors import ProtocolError

    encode = colocated_load.encode

    def skew(plan_: Any, hosts: Any) -> Any:
        size, parts = encode(plan_, hosts)
        out = {}
        for h, p in parts.items():
            part = json.loads(unframe(p)[1] or b"")
            for o in part["outputs"]:
                if o["shape"] == [8, 16]:
                    o["shape"] = [16, 16]
            raw = json.dumps(part).encode()
            out[h] = np.frombuffer(frame(raw, size + 64), np.uint8)
        return size + 64, out

    with _manager(ramdisk, 4) as mgr:
        state = _state(mgr)
        mgr.save(1, state)
        mgr.wait_until_finished()
        monkeypatch.setattr(colocated_load, "encode", skew)
        with pytest.raises(ProtocolError, match=r"a region of shape \(4, 4\) float32 for a "
                                                r"shard of \(8, 4\) float32 \(step 1, host"):
            mgr.restore(1, state)


def test_a_malformed_load_request_part_is_refused() -> None:
    """A length that overruns its part, a part that is not JSON, parts naming two steps."""
    from mtc.errors import ProtocolError
    from mtc.sidecar.restore.colocated_load import hosts_of, requests_of

    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("hosts",))
    sharding = NamedSharding(mesh, PartitionSpec("hosts"))
    host_of = hosts_of(jax.make_array_from_single_device_arrays(
        (2,), sharding, [jax.device_put(np.array([h], np.int32), d)
                         for h, d in enumerate(devices)]))

    def request(parts: list[bytes]) -> jax.Array:
        return jax.make_array_from_single_device_arrays(
            (64 * len(parts),), sharding,
            [jax.device_put(np.frombuffer(p.ljust(64, b"\0"), np.uint8), d)
             for p, d in zip(parts, devices, strict=True)])

    def part(text: bytes, n: int | None = None) -> bytes:
        return np.array([len(text) if n is None else n], "<u8").tobytes() + text

    ok = requests_of(request([part(b'{"step": 3}'), part(b'{"step": 3}')]), host_of)
    assert ok == {0: {"step": 3}, 1: {"step": 3}}
    with pytest.raises(ProtocolError, match="says 1000 bytes"):
        requests_of(request([part(b'{"step": 3}', 1000), part(b'{"step": 3}')]), host_of)
    with pytest.raises(ProtocolError, match="not JSON"):
        requests_of(request([part(b'{"step": 3'), part(b'{"step": 3}')]), host_of)
    with pytest.raises(ProtocolError, match="names steps"):
        requests_of(request([part(b'{"step": 3}'), part(b'{"step": 4}')]), host_of)


def test_a_framed_payload_states_its_whole_length_where_it_is_cut() -> None:
    """A colocated call's answer: the length of the whole reply, as much of it as
    fits; a reader takes it whole only where it fits."""
    from mtc.contract import frame, unframe
    from mtc.errors import ProtocolError

    for size, payload in [(16, b""), (16, b"12345678"), (16, b"123456789"), (4096, b"x" * 100)]:
        buf = frame(payload, size)
        assert len(buf) == size
        n, got = unframe(np.frombuffer(buf, np.uint8))
        assert n == len(payload)
        assert got == (payload if len(payload) <= size - 8 else None)
    assert bytes(frame(b"123456789", 16)[8:]) == b"12345678"
    with pytest.raises(ProtocolError, match="no length"):
        unframe(b"1234")


def test_a_surveys_answer_size_holds_the_manifest_within_bounds() -> None:
    from mtc.sidecar.colocated import ANSWER_BYTES, MAX_ANSWER_BYTES

    assert colocated.answer_size_for(0) == ANSWER_BYTES
    for manifest in (20_000, 100_000, 1_000_000):
        size = colocated.answer_size_for(manifest)
        assert size & (size - 1) == 0 and size >= manifest * 3 // 2 + 4096
    assert colocated.answer_size_for(100 << 20) == MAX_ANSWER_BYTES  # the rest: a second call
    assert colocated.answer_size_for((ANSWER_BYTES - 4096) * 2 // 3) == ANSWER_BYTES
    assert colocated.answer_size_for((ANSWER_BYTES - 4096) * 2 // 3 + 2) == 2 * ANSWER_BYTES


def test_a_large_restore_loads_in_groups_of_leaves_each_exact(ramdisk: Path) -> None:
    """Onto an accelerator a restore loads in calls of LOAD_CALL_BYTES or more, each
    group moving while the next is read; here the threshold is lowered so that the
    CPU devices take the same path: one call per group, every value exact."""
    with _manager(ramdisk, 4) as mgr:
        state = _state(mgr)
        mgr.save(1, state)
        mgr.wait_until_finished()
        dispatch = mgr._dispatch  # type: ignore[attr-defined]
        before = _calls(mgr)
        whole = mgr.restore(1, _state(mgr))
        one_call = _calls(mgr) - before
        dispatch.load_call_bytes = 64  # w (512 bytes) and b (64 bytes): two groups
        before = _calls(mgr)
        back = mgr.restore(1, _state(mgr))
        assert _calls(mgr) - before == one_call + 1
    for got in (whole, back):
        np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(128).reshape(8, 16))
        np.testing.assert_array_equal(np.asarray(got["b"]), np.arange(16))
        assert got["w"].sharding == state["w"].sharding


@pytest.mark.parametrize(("sizes", "call_bytes", "max_calls", "groups"), [
    ([100] * 4, None, 4, [[0, 1, 2, 3]]),  # no threshold: one call
    ([100] * 4, 300, 4, [[0, 1, 2, 3]]),  # under twice the threshold: one call
    ([100] * 4, 100, 4, [[0], [1, 2], [3]]),  # shrinking towards the end
    ([100] * 8, 100, 4, [[0, 1], [2, 3, 4], [5, 6], [7]]),  # at most max_calls
    ([256] * 16, 256, 6, [list(range(6)), [6, 7, 8, 9], [10, 11, 12], [13, 14], [15]]),
    ([100] * 5, 100, 8, [[0, 1], [2, 3], [4]]),  # fewer than max_calls suffice
    ([50, 400, 100], 100, 3, [[0, 1], [2]]),  # a first group under call_bytes: merged
    ([400, 10, 10, 10], 100, 4, [[0], [1, 2, 3]]),  # a large leaf fills a group alone
    ([10, 10, 10, 400], 20, 2, [[0, 1, 2], [3]]),
    ([100] * 4, 100, 1, [[0, 1, 2, 3]]),
])
def test_call_groups_cut_the_leaves_in_order(sizes: list[int], call_bytes: int | None,
                                             max_calls: int, groups: list[list[int]]) -> None:
    from mtc.contract import LeafSpec

    specs = {k: LeafSpec((n,), "uint8", None) for k, n in enumerate(sizes)}
    assert colocated_load.call_groups(specs, call_bytes, max_calls) == groups
