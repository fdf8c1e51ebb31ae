"""The backup tier with real replicator processes: schedule, on-request backups (RPC, CLI,
``_BACKUP_REQUESTED``), deduplication across data-parallel replicas, retention, restore
after the loss of the whole cluster, the GCS emulator (flat and HNS buckets), and faults.

2 slices x 2 hosts, one peer copy each. Every replicator is a real
``python -m mtc.sidecar.replicator.main`` process, and the controller reaches each host's
RAM disk only through the host's sidecar process (``Cluster.options``); the test plays
the hosts (and the whole cluster's loss), reading and wiping their roots. The GCS
emulator, the fault proxy and the Storage Control double are started by the tests
(tests/gcs_fakes.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from gcs_fakes import Emulator, FakeStorageControl, FaultProxy, free_port
from jax.sharding import Mesh
from replicators import Cluster, assert_state_equal, env_with_repo, make_state

import mtc
from mtc.errors import MtcError
from mtc.grpc_errors import PeerError
from mtc.proto import replicator_pb2 as pb
from mtc.replicas import prepare_restore
from mtc.sidecar.backup.job import MANIFEST
from mtc.sidecar.storage.checksum import file_sha256
from mtc.testing.waits import wait_until

MiB = 1 << 20
# The emulator is started with a preexec_fn (to die with the tests), so Python forks
# after JAX started its threads; the child only calls prctl and execs the emulator.
pytestmark = [pytest.mark.process,
              pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")]


# -- fixtures and helpers -------------------------------------------------------------


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    made: list[Cluster] = []
    yield made
    for c in made:
        c.stop_all()
        for r in range(c.n):
            print(f"--- replicator {r} log tail ---\n{c.log_text(r)[-3000:]}")
            if c.sidecar_log(r):
                print(f"--- sidecar {r} log tail ---\n{c.sidecar_log(r)}")


def new_cluster(clusters: list[Cluster], base: Path, *backup: str, n: int = 4,
                per_slice: int = 2, **kw: Any) -> Cluster:
    c = Cluster(base, n, per_slice, extra=("--replicas", "1", *backup), metrics=True, **kw)
    clusters.append(c)
    c.start_all()
    return c


@pytest.fixture(scope="module")
def emulator() -> Iterator[Emulator]:
    emu = Emulator()
    try:
        yield emu
    finally:
        emu.stop()


def new_bucket(emulator: Emulator) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    emulator.client().create_bucket(name)
    return name


def save(cl: Cluster, mesh: Mesh, step: int, state: dict[str, Any]) -> None:
    """Save ``step`` through the cluster's sidecars."""
    with mtc.CheckpointManager(cl.base, mesh=mesh, options=cl.options(max_to_keep=None)) as m:
        assert m.save(step, state)
        m.wait_until_finished()


def local_committed(bucket: Path) -> list[int]:
    d = bucket / "steps"
    return sorted(int(s) for s in os.listdir(d) if (d / s / MANIFEST).is_file()) \
        if d.is_dir() else []


def prepare_all(cl: Cluster, timeout: float = 30.0) -> dict[int, Any]:
    """PrepareRestore on every rank at once, as a restarting job does; a failed call's
    error is its value."""
    def one(r: int) -> Any:
        c = cl.client(r)
        try:
            return c.call("PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=timeout),
                          deadline_s=timeout + 10, attempts=1)
        except PeerError as e:
            return e
        finally:
            c.close()

    with ThreadPoolExecutor(cl.n) as ex:
        return dict(zip(range(cl.n), ex.map(one, range(cl.n)), strict=True))


def lose_everything(cl: Cluster) -> None:
    """The whole cluster is gone: every replicator and sidecar SIGKILLed, every RAM disk
    wiped."""
    cl.stop_all()
    for r in range(cl.n):
        shutil.rmtree(cl.root(r))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mtc.cli", *args], capture_output=True,
                          text=True, timeout=60, env=env_with_repo())


def failures(cl: Cluster, rank: int, kind: str) -> float:
    return cl.scrape(rank).get(f"mtc_failures_total{{kind={kind}}}", 0.0)


# -- schedule, deduplication, retention ------------------------------------------------


def test_interval_backups_dedup_spread_and_retention(ramdisk: Path, mesh: Mesh,
                                                     clusters: list[Cluster]) -> None:
    bucket = ramdisk / "bucket"
    cl = new_cluster(clusters, ramdisk, "--backup", f"file://{bucket}",
                     "--backup-interval-steps", "2", "--backup-keep", "2",
                     "--backup-keep-every", "4")
    states = {}
    seen: set[int] = set()
    for step in (1, 2, 3, 4, 5, 6, 8, 10):
        states[step] = make_state(mesh, float(step))
        save(cl, mesh, step, states[step])
        if step % 2 == 0:  # every 2 steps: due as soon as every host committed it
            wait_until(f"backup of step {step}", lambda s=step: s in local_committed(bucket))
        seen |= set(local_committed(bucket))
        if step == 5:  # not due: 5 - 4 < 2
            cl.wait_passes(0, loop="backup")  # the leader's, which would back it up
            seen |= set(local_committed(bucket))
    # Only due steps were ever backed up; an odd step was never due.
    assert seen == {2, 4, 6, 8, 10}, seen
    # Retention (keep the newest 2, and every 4th): step 2 went once 6 came, 6 once
    # 10 came; 4 and 8 stay. Retention runs after the publish the loop saw: waited
    # for, bounded (it failed under load when read at once), until the removed
    # steps' data is gone too (their manifests go first, so that a half-deleted
    # step never looks committed: under load a folder outlived its manifest here).
    wait_until("retention after step 10", lambda: local_committed(bucket) == [4, 8, 10]
             and sorted(os.listdir(bucket / "steps")) == ["10", "4", "8"])
    assert local_committed(bucket) == [4, 8, 10]
    # Nothing but committed steps: every step folder has its manifest; no staging left.
    assert sorted(os.listdir(bucket / "steps")) == ["10", "4", "8"]
    assert not list((bucket / "staging").iterdir()) if (bucket / "staging").exists() else True

    manifest = json.loads((bucket / "steps/8" / MANIFEST).read_text())
    assert manifest["step"] == 8 and sorted(manifest["ranks"]) == ["0", "1", "2", "3"]
    entries = {int(r): es for r, es in manifest["ranks"].items()}
    objects = {p.relative_to(bucket / "steps/8").as_posix()
               for p in (bucket / "steps/8/data").rglob("*") if p.is_file()}
    total = sum(len(es) for es in entries.values())
    # Every object a manifest names is there, with the bytes the host saved.
    for r, es in entries.items():
        for e in es:
            assert e["object"] in objects
            host_file = cl.root(r) / "8" / e["path"]
            assert file_sha256(host_file).hex() == e["sha256"]
            assert file_sha256(bucket / "steps/8" / e["object"]).hex() == e["sha256"]
    # Data-parallel shards (same bytes on host 0 and host 2, and on 1 and 3) are
    # uploaded once: fewer objects than files, and some object serves two ranks.
    assert len(objects) < total, (len(objects), total)
    users: dict[str, set[int]] = {}
    for r, es in entries.items():
        for e in es:
            users.setdefault(e["object"], set()).add(r)
    assert {0, 2} in users.values() and {1, 3} in users.values(), users
    # Uploads spread over the hosts, not all through the leader: each host read its own
    # files.
    uploaded = [cl.scrape(r)["mtc_backup_bytes_uploaded_total"] for r in range(4)]
    assert all(b > 0 for b in uploaded), uploaded
    assert len({o.split("/")[1] for o in objects}) >= 2  # data/<rank>/ of several ranks
    m0 = cl.scrape(0)
    assert m0["mtc_newest_step{state=backed_up}"] == 10
    assert failures(cl, 0, "backup") == 0

    # Step 12 is committed on three hosts of four: it is not a step yet, and neither the
    # schedule nor a request backs it up.
    for r in range(3):
        shutil.copytree(cl.root(r) / "10", cl.root(r) / "12.partial")
        os.rename(cl.root(r) / "12.partial", cl.root(r) / "12")
    c = cl.client(1)
    try:
        assert c.call("RequestBackup", pb.BackupRequest(step=-1), deadline_s=30).step == 10
    finally:
        c.close()
    cl.wait_passes(0, loop="backup")  # the leader's schedule saw step 12 on three hosts
    assert local_committed(bucket) == [4, 8, 10]


# -- on request; restore after losing the whole cluster; a corrupted object -----------


def test_requested_backups_then_whole_cluster_restore(ramdisk: Path, mesh: Mesh,
                                                      clusters: list[Cluster]) -> None:
    bucket = ramdisk / "bucket"
    # An hour between scheduled backups: whatever is backed up here was asked for.
    backup = ("--backup", f"file://{bucket}", "--backup-interval-minutes", "60")
    cl = new_cluster(clusters, ramdisk, *backup)
    s1, s2, s3 = (make_state(mesh, float(k)) for k in (1, 2, 3))
    save(cl, mesh, 1, s1)
    cl.wait_replicated(1, timeout=20)
    assert local_committed(bucket) == []

    # The CLI, pointed at a host that does not lead: it asks the leader.
    r = cli("backup", "--node", cl.addrs[3])
    assert r.returncode == 0 and r.stdout.strip() == "backed up step 1", r
    assert local_committed(bucket) == [1]
    r = cli("status", "--nodes", ",".join(cl.addrs), "--json")
    assert r.returncode == 0, r
    assert json.loads(r.stdout)["backup"] == [1]

    # An Orbax-style _BACKUP_REQUESTED file in a step folder is a request too: on a
    # host that does not lead (it asks the leader), and on the leader. Each is answered
    # once: the file stays, and the next step is not backed up because of it.
    save(cl, mesh, 2, s2)
    (cl.root(1) / "2" / "_BACKUP_REQUESTED").touch()
    wait_until("backup of step 2", lambda: 2 in local_committed(bucket))
    save(cl, mesh, 3, s3)
    (cl.root(0) / "3" / "_BACKUP_REQUESTED").touch()
    wait_until("backup of step 3", lambda: 3 in local_committed(bucket))
    cl.wait_passes(0, 1, loop="backup")  # passes that see the files again
    save(cl, mesh, 4, make_state(mesh, 4.0))
    cl.wait_replicated(4, timeout=20)
    cl.wait_passes(0, 1, loop="backup")  # would ask for (and lead) step 4's backup
    assert local_committed(bucket) == [1, 2, 3]

    # Everything is lost: every replicator and every RAM disk. Step 4 was never backed
    # up, so the newest step anyone can restore is 3, from the backup.
    lose_everything(cl)
    cl.start_all()
    t0 = time.monotonic()
    replies = prepare_all(cl)
    took = time.monotonic() - t0
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {
        r: (3, "backup") for r in range(4)}, replies
    print(f"whole-cluster restore from the backup took {took:.2f}s")
    # Objects shared by several hosts (data-parallel replicas) crossed from the
    # bucket once: the bytes read from it are the unique objects' bytes, and the
    # other hosts fetched their copies from the host that read them.
    manifest3 = json.loads((bucket / "steps/3" / MANIFEST).read_text())
    unique = {e["object"]: e["size"] for es in manifest3["ranks"].values() for e in es}
    needed = sum(e["size"] for es in manifest3["ranks"].values() for e in es)
    samples = [cl.scrape(r) for r in range(4)]
    read = sum(s.get("mtc_backup_bytes_downloaded_total", 0) for s in samples)
    fetched = sum(s.get("mtc_restore_bytes_fetched_total", 0) for s in samples)
    assert unique and needed > sum(unique.values())
    assert read == sum(unique.values()), (read, unique)
    assert fetched == needed - read
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=cl.options(max_to_keep=None)) as m:
        assert m.all_steps() == [3]
        assert_state_equal(m.restore(3, s3), s3)

    # Lost again, and now one object in the backup is corrupt (a flipped byte): the
    # host whose data it is refuses it; nothing wrong is ever loaded.
    lose_everything(cl)
    manifest = json.loads((bucket / "steps/3" / MANIFEST).read_text())
    victim = max(manifest["ranks"]["1"], key=lambda e: e["size"])
    obj = bucket / "steps/3" / victim["object"]
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF
    obj.write_bytes(bytes(data))
    cl.start_all()
    opts = cl.options(replicators=True, max_to_keep=None, restore_timeout_s=30)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as m, \
            pytest.raises(MtcError) as err:
        m.restore(None, s3)
    print(f"restore refused: {err.value}")
    assert "DATA_LOSS" in str(err.value) and "CRC32C" in str(err.value), err.value
    assert not (cl.root(1) / "3").exists()


def test_a_holder_slow_to_start_serves_what_it_is_about_to_read(
        ramdisk: Path, mesh: Mesh, clusters: list[Cluster]) -> None:
    """The random-fault case: every host brings the step from the backup in the
    background, and the hosts meant to read the objects their data-parallel twins
    share (ranks 0 and 1) are slow to start (their quiet time). A twin asking one
    for such an object is not refused ("rank 0 is not restoring step 1", then 3 s
    of waiting and a read of its own): its ask starts the holder's restore, it
    waits, and gets the object from it. Each object crosses from the bucket once,
    and the controller's restore loads the step."""
    bucket = ramdisk / "bucket"
    backup = ("--backup", f"file://{bucket}", "--backup-interval-minutes", "60")
    slow, prompt = ("--restore-quiet-seconds", "120"), ("--restore-quiet-seconds", "0")
    cl = new_cluster(clusters, ramdisk, *backup,
                     rank_args={0: slow, 1: slow, 2: prompt, 3: prompt})
    s1 = make_state(mesh, 1.0)
    save(cl, mesh, 1, s1)
    cl.wait_replicated(1, timeout=20)
    r = cli("backup", "--node", cl.addrs[0])
    assert r.returncode == 0 and r.stdout.strip() == "backed up step 1", r

    lose_everything(cl)
    cl.start_all()
    prepared = prepare_restore(cl.addrs, token=None, timeout_s=30, background=True)
    assert prepared.step == 1 and set(prepared.pending) == set(cl.addrs), prepared
    # The prompt twins finish first, with the shared objects from the slow holders.
    wait_until("ranks 2 and 3 restored", lambda: all(
        (cl.root(r) / "1").is_dir() for r in (2, 3)), timeout_s=60)
    manifest = json.loads((bucket / "steps/1" / MANIFEST).read_text())
    unique = {e["object"]: e["size"] for es in manifest["ranks"].values() for e in es}
    needed = sum(e["size"] for es in manifest["ranks"].values() for e in es)
    assert needed > sum(unique.values())  # some objects are shared
    opts = cl.options(replicators=True, max_to_keep=None, restore_timeout_s=60)
    with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as m:
        assert_state_equal(m.restore(None, s1), s1)
    read = sum(cl.scrape(r).get("mtc_backup_bytes_downloaded_total", 0) for r in range(4))
    assert read == sum(unique.values()), (read, unique)
    assert sum(failures(cl, r, "materialize") for r in range(4)) == 0


# -- Google Cloud Storage: the emulator, an HNS bucket through Storage Control ---------


def bucket_keys(emulator: Emulator, bucket: str, prefix: str) -> list[str]:
    return sorted(b.name for b in emulator.client().list_blobs(bucket, prefix=prefix))


def gcs_committed(emulator: Emulator, bucket: str, prefix: str) -> list[int]:
    keys = bucket_keys(emulator, bucket, f"{prefix}/steps/")
    return sorted(int(k.split("/")[-2]) for k in keys if k.endswith("/" + MANIFEST))


def test_gcs_hns_backup_and_restore(ramdisk: Path, mesh: Mesh, emulator: Emulator,
                                    clusters: list[Cluster]) -> None:
    bucket = new_bucket(emulator)
    control = FakeStorageControl(emulator, hns={bucket})
    try:
        env = {"STORAGE_EMULATOR_HOST": emulator.url,
               "MTC_STORAGE_CONTROL_ENDPOINT": control.endpoint}
        cl = new_cluster(clusters, ramdisk, "--backup", f"gs://{bucket}/ckpt",
                         "--backup-interval-steps", "1", "--backup-keep", "1", env=env)
        s1, s2 = make_state(mesh, 1.0), make_state(mesh, 2.0)
        save(cl, mesh, 1, s1)
        wait_until("backup of step 1", lambda: gcs_committed(emulator, bucket, "ckpt") == [1])
        save(cl, mesh, 2, s2)
        wait_until("backup of step 2", lambda: gcs_committed(emulator, bucket, "ckpt") == [2])
        wait_until("step 1 deleted", lambda: not bucket_keys(emulator, bucket, "ckpt/steps/1/")
                 and not any(f.startswith("ckpt/steps/1/") for f in control.folders[bucket]))

        # Each step was uploaded into a staging folder and published by one RenameFolder;
        # retention (keep 1) deleted step 1 and its folders; nothing is left in staging.
        renames = [arg for name, arg in control.calls if name == "RenameFolder"]
        assert len(renames) == 2, control.calls
        for step, arg in zip((1, 2), renames, strict=True):
            src, dst = arg.split(" -> ")
            assert src.startswith(f"ckpt/staging/{step}-") and dst == f"ckpt/steps/{step}/"
        assert ("GetStorageLayout", bucket) in control.calls
        assert bucket_keys(emulator, bucket, "ckpt/staging/") == []
        assert not any(f.startswith("ckpt/staging/") and f != "ckpt/staging/"
                       for f in control.folders[bucket]), control.folders[bucket]
        keys = bucket_keys(emulator, bucket, "ckpt/")
        assert keys and all(k.startswith("ckpt/steps/2/") for k in keys), keys
        manifest = json.loads(emulator.client().bucket(bucket).blob(
            f"ckpt/steps/2/{MANIFEST}").download_as_bytes())
        n_files = sum(len(es) for es in manifest["ranks"].values())
        assert len(keys) - 1 < n_files  # deduplicated, as on any store

        # The whole cluster is lost: the controller's restore() comes back from GCS.
        lose_everything(cl)
        cl.start_all()
        opts = cl.options(replicators=True, max_to_keep=None, restore_timeout_s=30)
        with mtc.CheckpointManager(ramdisk, mesh=mesh, options=opts) as m:
            assert_state_equal(m.restore(None, s2), s2)
            assert m.last_restore_tiers == {h: "backup" for h in range(4)}
    finally:
        control.stop()


# -- faults -------------------------------------------------------------------------------


def commit_everywhere(cl: Cluster, step: int, unique: int = 64 << 10,
                      shared: bytes = b"") -> None:
    """A raw step on every host: a file of its own, and one the same on every host."""
    for r in range(cl.n):
        cl.commit(r, step, {"own.bin": os.urandom(unique),
                                           "shared.bin": shared or b"s" * 4096})


def test_bucket_unreachable_then_5xx_then_back(ramdisk: Path, emulator: Emulator,
                                               clusters: list[Cluster]) -> None:
    bucket = new_bucket(emulator)
    port = free_port()  # nothing listens here yet: the bucket is unreachable
    cl = new_cluster(clusters, ramdisk, "--backup", f"gs://{bucket}/x",
                     "--backup-interval-steps", "1", "--backup-retry-seconds", "1",
                     env={"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}"})
    commit_everywhere(cl, 1)
    # Replication goes on; the leader counts failed backups; nothing crashes.
    cl.wait_held({((r + 2) % 4, r, 1) for r in range(4)}, timeout=20)
    wait_until("a failed backup", lambda: failures(cl, 0, "backup") >= 1)
    commit_everywhere(cl, 2)
    cl.wait_held({((r + 2) % 4, r, 2) for r in range(4)}, timeout=20)
    # A restore still agrees, promptly, from the hosts alone.
    t0 = time.monotonic()
    replies = prepare_all(cl, timeout=20)
    assert {r: (x.step, x.tier) for r, x in replies.items()} == {
        r: (2, "local") for r in range(4)}, replies
    assert time.monotonic() - t0 < 10
    assert all(cl.alive(r) for r in range(4))
    assert gcs_committed(emulator, bucket, "x") == []

    # The store answers now, but only with 503s: still failing, still nothing committed.
    proxy = FaultProxy(emulator.port, port=port)
    try:
        proxy.fail_always = True
        before = failures(cl, 0, "backup")
        wait_until("503s", lambda: proxy.failed > 0 and failures(cl, 0, "backup") > before)
        assert gcs_committed(emulator, bucket, "x") == []
        # Healthy again: the newest step is backed up without anyone asking.
        proxy.fail_always = False
        wait_until("backup after recovery", lambda: gcs_committed(emulator, bucket, "x") == [2])
        assert all(cl.alive(r) for r in range(4))
        wait_until("the gauge", lambda: cl.scrape(0)["mtc_newest_step{state=backed_up}"] == 2)
        # One leader all along: the others never tried.
        assert [failures(cl, r, "backup") for r in (1, 2, 3)] == [0, 0, 0]
    finally:
        proxy.close()


def test_leader_killed_mid_upload_leftovers_cleaned(ramdisk: Path, emulator: Emulator,
                                                    clusters: list[Cluster]) -> None:
    bucket = new_bucket(emulator)
    proxy = FaultProxy(emulator.port)
    try:
        cl = new_cluster(clusters, ramdisk, "--backup", f"gs://{bucket}/x",
                         "--backup-interval-minutes", "60", "--backup-retry-seconds", "5",
                         env={"STORAGE_EMULATOR_HOST": proxy.url})
        size = 24 * MiB  # a 96 MiB step: resumable uploads in 16 MiB chunks
        commit_everywhere(cl, 1, unique=size)
        cl.wait_held({((r + 2) % 4, r, 1) for r in range(4)}, timeout=30)

        # Hold every upload at the proxy, ask for a backup, and SIGKILL the leader while
        # its upload is in flight.
        proxy.release.clear()
        asked = threading.Thread(target=lambda: cli("backup", "--node", cl.addrs[0]))
        asked.start()
        wait_until("uploads in flight", lambda: proxy.held >= 4)
        cl.kill(0)
        asked.join(30)
        # The other hosts' parts finish into the uncommitted step folder (a flat bucket:
        # no staging, the manifest is the commit); that step does not exist.
        proxy.release.set()
        wait_until("the other hosts' uploads", lambda: all(
            cl.scrape(r).get("mtc_backup_bytes_uploaded_total", 0) >= size for r in (1, 2, 3)),
            timeout_s=30)
        left = bucket_keys(emulator, bucket, "x/steps/1/")
        assert left and f"x/steps/1/{MANIFEST}" not in left, left
        assert gcs_committed(emulator, bucket, "x") == []
        assert all(list(cl.inventory(r).backed_up_steps) == [] for r in (1, 2, 3))

        # The leader is back; the next backup commits, and the leftovers are cleaned.
        cl.start(0)
        commit_everywhere(cl, 2)
        r = cli("backup", "--node", cl.addrs[2])
        assert r.returncode == 0 and r.stdout.strip() == "backed up step 2", r
        assert gcs_committed(emulator, bucket, "x") == [2]
        keys = bucket_keys(emulator, bucket, "x/")
        assert keys and all(k.startswith("x/steps/2/") for k in keys), keys
    finally:
        proxy.close()
