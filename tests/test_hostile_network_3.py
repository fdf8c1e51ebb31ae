"""A hostile network, third round (issue 66), against real replicator processes on
loopback under mutual TLS (``tests/replicators.Cluster``), the attacker holding one
host's real certificate (it runs that host's replicator and owns its RAM disk).

- who saved a step, and how many hosts, is a claim each saving host makes for
  itself: one host's word never has another host restore a step, nor a trainer
  read its bytes as another host's;
- a bad copy, however it is found bad, is skipped for the next holder, then the
  backup, and no error names a folder of a host's RAM disk.

The second round's attacks are ``tests/test_hostile_network_2.py``'s.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from replicators import Cluster, commit_mtc_step
from test_hostile_network_2 import _prepare, _tls_hosts, forge_held_copy

from mtc.credentials import Credentials
from mtc.errors import CorruptShardError, ShardUnavailableError
from mtc.grpc_errors import wire_error
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.fetch.materialize import Materializer
from mtc.sidecar.replicator.wire.client import FETCH
from mtc.sidecar.restore.peers import PeerFiles
from mtc.testing.waits import wait_until

pytestmark = pytest.mark.process  # every test here starts processes


def _genuine_step_5(ramdisk: Path, clusters: list[Cluster]) -> tuple[Cluster, dict[str, bytes]]:
    """Two TLS hosts that saved step 5 together and hold each other's copy of it;
    the cluster and rank 0's files."""
    _, _, _, cl = _tls_hosts(ramdisk, clusters, metrics=True)
    cl.start_all()
    mine = cl.commit(0, 5, {"a.bin": os.urandom(64 << 10)})
    cl.commit(1, 5, {"c.bin": os.urandom(4096)})
    cl.wait_held({(1, 0, 5), (0, 1, 5)})
    return cl, mine


def test_one_host_saying_it_alone_saved_a_step_has_no_other_host_restore_it(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Rank 1 (its own real certificate, its own RAM disk) commits "its" step 900
    with a manifest saying that one host saved it, rank 1 (``saving_ranks=[1]``,
    ``saved_hosts=1``). Its replicator lists it as its own step and signs its copy
    with its own key. The coordinator decided step 900 over step 5, which both hosts
    saved, and rank 0 took rank 1's bytes for its state "from the host that saved
    it". Rank 0 never said it was left out of step 900: the step counts for rank 0
    only on rank 0's word, so both hosts restore step 5, rank 0 its own bytes."""
    cl, mine = _genuine_step_5(ramdisk, clusters)
    commit_mtc_step(cl.root(1), 900, {"c.bin": b"rank 1's state for everyone" * 100},
                    host=0, num_hosts=1, ranks=(1,))
    cl.wait_held({(1, 1, 900)})  # listed by rank 1's replicator as its own step
    with ThreadPoolExecutor(2) as pool:
        r0, r1 = pool.map(lambda r: _prepare(cl, r), [0, 1])
    assert isinstance(r0, pb.PrepareRestoreReply), r0
    assert isinstance(r1, pb.PrepareRestoreReply), r1
    assert (r0.step, r1.step, r0.tier) == (5, 5, "local")
    assert (cl.root(0) / "5" / "a.bin").read_bytes() == mine["a.bin"]


def test_one_host_saying_it_saved_another_hosts_part_is_not_read_as_that_host(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Both hosts saved step 777, rank 0 as host 0. Rank 1 commits its own step 777
    with a manifest saying host 0's data is kept by rank 1 (``saving_ranks=[1,0]``),
    its ``a.bin`` made up. A multi-controller trainer's read of host 0's ``a.bin``
    (``PeerFiles.read(777, 0, ...)``) took the saving ranks from any copy that listed
    them, asked rank 1 for its own data (which needs no proof) and returned rank
    1's bytes. Now a saving host's rank counts only when every saving host says the
    same: the read never returns the made-up bytes."""
    cl, _ = _genuine_step_5(ramdisk, clusters)
    mine = cl.commit(0, 777, {"a.bin": os.urandom(32 << 10)})
    forged = b"rank 1 says this is host 0's" * 100
    commit_mtc_step(cl.root(1), 777, {"a.bin": forged}, host=0, num_hosts=2, ranks=(1, 0))
    cl.wait_held({(1, 1, 777), (0, 0, 777)})
    peers = PeerFiles(cl.addrs, cl.creds, near=None, deadline_s=10.0)
    try:
        try:
            got = bytes(peers.read(777, 0, "a.bin"))
        except ShardUnavailableError as e:
            assert "disagree" in str(e) or "say" in str(e), e
        else:
            assert got == mine["a.bin"]
        assert bytes(peers.read(5, 0, "a.bin")) != forged  # an agreed step reads as before
    finally:
        peers.close()


# -- a bad copy is skipped for the next holder, then the backup ---------------------------

def _forged_held_copy(ramdisk: Path, clusters: list[Cluster],
                      before: Callable[[Cluster], None] = lambda cl: None, **kw: Any
                      ) -> tuple[Cluster, bytes]:
    """:func:`forge_held_copy` on two TLS replicator processes (the backup needs
    processes). ``kw``: more of the cluster's fields."""
    _, _, _, cl = _tls_hosts(ramdisk, clusters, metrics=True, **kw)
    cl.start_all()
    return cl, forge_held_copy(cl, before)


def test_a_holder_serving_other_bytes_with_the_same_crc_is_skipped_for_the_backup(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Step 5 is backed up; then rank 1 swaps its copy of rank 0's ``a.bin`` for
    bytes of its own with the same size and CRC32C. Rank 0, replaced empty,
    restored nothing: the SHA-256 rank 0 signed refused the bytes and the restore
    failed ``DATA_LOSS`` without trying the backup (a wrong CRC32C did fall back).
    Now a file that does not hash as signed is a bad copy like any other: rank 0
    restores step 5 from the backup, its own bytes, and the forgery is counted."""
    bucket = ramdisk / "bucket"
    bucket.mkdir()

    def back_up(cl: Cluster) -> None:
        c = cl.client(0)
        try:
            assert c.call("RequestBackup", pb.BackupRequest(step=-1), deadline_s=60).step == 5
        finally:
            c.close()

    cl, forged = _forged_held_copy(
        ramdisk, clusters, before=back_up,
        extra=("--backup", bucket.as_uri(), "--backup-interval-minutes", "60"))
    mine = (cl.root(0) / "5" / "a.bin").read_bytes()
    cl.kill(0)
    shutil.rmtree(cl.root(0))
    cl.start(0)
    with ThreadPoolExecutor(2) as pool:
        r0, r1 = pool.map(lambda r: _prepare(cl, r), [0, 1])
    assert isinstance(r0, pb.PrepareRestoreReply), r0
    assert isinstance(r1, pb.PrepareRestoreReply), r1
    assert (r0.step, r0.tier, r1.step) == (5, "backup", 5)
    assert (cl.root(0) / "5" / "a.bin").read_bytes() == mine != forged
    assert cl.scrape(0).get("mtc_unproven_copies_total", 0) >= 1


def test_a_listing_without_files_is_no_source() -> None:
    """A holder listing rank 0's step 5 with its genuine proof but no files (the
    signed statement names the files' digest, not the files) was the restore's
    first source: nothing was fetched, and the restore failed ``NOT_FOUND`` naming
    the RAM disk's folder. Now such a listing is no source: the next holder is."""
    full = pb.StepCopy(step=5, origin_rank=0, files=[pb.FileInfo(path="a.bin", size=3)])
    empty = pb.StepCopy(step=5, origin_rank=0, fingerprint=full.fingerprint)
    invs = {1: pb.Inventory(rank=1, copies=[empty]), 2: pb.Inventory(rank=2, copies=[full])}
    me = SimpleNamespace(rank=0, config=SimpleNamespace(equivalent=lambda r: [r]))
    assert [h for h, _ in Materializer.copies_elsewhere(me, 5, invs)] == [2]  # type: ignore[arg-type]
    assert Materializer.copies_elsewhere(me, 5, {1: invs[1]}) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("error", [
    FileNotFoundError(2, "No such file or directory", "/dev/shm/job/host-0/5.tmp-x"),
    CorruptShardError("restored copy is incomplete", step=5, host=0,
                      path="/dev/shm/job/host-0/5.tmp-x/a.bin"),
])
def test_no_error_a_caller_is_told_names_a_folder_of_the_host(error: Exception) -> None:
    message, where = wire_error(error)
    told = message + " ".join(str(v) for _, v in where)
    assert "/dev/shm" not in told and "host-0" not in told, told


# -- a reader cannot hold the data path ---------------------------------------------------

def _reader(address: str, creds: Credentials, rank: int) -> grpc.Channel:
    """A reader's channel to replicator ``rank``: with a flow-control window of its
    own (no BDP probing), so that the holder's stream lasts as long as the reader
    reads, as a reader on a real network makes it."""
    return grpc.secure_channel(address, creds.channel_credentials(), options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.ssl_target_name_override", f"mtc-rank-{rank}"),
        ("grpc.use_local_subchannel_pool", 1)])


def _slow_reader(channel: grpc.Channel, req: pb.FetchRequest, rate: float,
                 stop: threading.Event, reading: list[int] | None = None) -> int:
    """Read ``req``'s bytes at ``rate`` bytes a second (above the minimum the holder
    asks) until ``stop``; the bytes read. ``reading`` gets an entry once the first
    bytes came (the stream holds a place)."""
    got, t0 = 0, time.monotonic()
    call = channel.unary_stream(FETCH, request_serializer=pb.FetchRequest.SerializeToString,
                                response_deserializer=lambda b: b)(req, timeout=600.0)
    try:
        for chunk in call:
            if not got and reading is not None:
                reading.append(1)
            got += len(chunk)
            while got / rate > time.monotonic() - t0:
                if stop.wait(0.05):
                    return got
            if stop.is_set():
                return got
    except grpc.RpcError:
        pass  # ended by the holder (for a restore, or its deadline)
    finally:
        call.cancel()
    return got


def test_a_reader_flood_leaves_a_replaced_hosts_restore_its_streams(
        ramdisk: Path, clusters: list[Cluster]) -> None:
    """Sixteen fetches of rank 1's own step read from it just above the minimum rate
    (300 KiB/s), eight with the controller's certificate and eight with rank 2's:
    every data stream rank 1 had was taken for minutes, and rank 0, replaced empty,
    failed to restore its step from rank 1 (``RESOURCE_EXHAUSTED``, then
    ``DATA_LOSS``). Now readers take 12 places at most and a restore of a host's own
    data ends the slowest of them when it needs to: rank 0 restores its step, whole,
    in about the time it takes without the flood, and a new step of rank 0 reaches
    rank 1 within 5 s, the flood going on."""
    pki, _, _, cl = _tls_hosts(ramdisk, clusters, n=3)
    cl.start_all()
    mine = cl.commit(0, 5, {"a.bin": os.urandom(16 << 20)})
    cl.commit(1, 5, {"c.bin": os.urandom(32 << 20)})
    cl.commit(2, 5, {"e.bin": os.urandom(1 << 20)})
    cl.wait_held({(1, 0, 5)})  # rank 0's copy, on rank 1

    def replaced_restore() -> float:
        cl.kill(0)
        shutil.rmtree(cl.root(0))
        cl.start(0)
        t0 = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            replies = list(pool.map(lambda r: _prepare(cl, r), [0, 1, 2]))
        took = time.monotonic() - t0
        for r in replies:
            assert isinstance(r, pb.PrepareRestoreReply) and r.step == 5, r
        assert replies[0].tier == "peer", replies[0]
        assert (cl.root(0) / "5" / "a.bin").read_bytes() == mine["a.bin"]
        return took

    quiet = replaced_restore()
    rank2 = Credentials(tls_cert=pki / "node2.crt", tls_key=pki / "node2.key",
                        tls_ca=pki / "ca.crt")
    readers = [_reader(cl.addrs[1], creds, 1) for creds in (cl.creds, rank2)]
    req = pb.FetchRequest(step=5, origin_rank=1, path="c.bin")
    stop = threading.Event()
    try:
        with ThreadPoolExecutor(16) as pool:
            reading: list[int] = []
            flood = [pool.submit(_slow_reader, readers[i % 2], req, 300 << 10, stop, reading)
                     for i in range(16)]
            try:
                # The readers hold their places (before: all 16 held every place).
                wait_until("12 readers reading", lambda: len(reading) >= 12, 30)
                assert sum(not f.done() for f in flood) >= 12
                flooded = replaced_restore()
                # Replication into the flooded host goes on: pushes have places of their own.
                cl.commit(0, 6, {"a.bin": os.urandom(4 << 20)})
                t0 = time.monotonic()
                cl.wait_held({(1, 0, 6)}, timeout=30)
                replicated = time.monotonic() - t0
            finally:
                stop.set()
    finally:
        for c in readers:
            c.close()
    print(f"replaced host's restore of 16 MiB: {quiet:.2f}s quiet, {flooded:.2f}s flooded; "
          f"a new step replicated into the flooded host in {replicated:.2f}s")
    assert flooded < max(2 * quiet, quiet + 3.0), (quiet, flooded)
    assert replicated < 5.0, replicated
