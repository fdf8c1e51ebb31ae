"""Peer copy and peer restore throughput of the replicator against raw references, in one run.

Prints one JSON object to stdout (progress goes to stderr)::

    .venv/bin/python bench/replicator.py [--gib 1.0] [--samples 3] [--warmup 1]

Measured in the same run, on this machine's loopback and RAM disk:

- ``raw_tcp``: a preallocated buffer sent over one loopback TCP connection in 4 MiB
  ``sendall`` calls to a receiver thread doing ``recv_into`` a preallocated 4 MiB
  buffer; timed to the receiver's one-byte acknowledgement.
- ``raw_file_copy``: a plain copy between RAM disks: the step's files ``sendfile``d
  over loopback TCP to a receiver thread that CRC32Cs each 4 MiB and writes it to a
  new file (``peer_copy_over_raw_file_copy``). A new tmpfs file's pages are
  allocated and cleared as they are first written, which bounds it well below the
  link; the replicator receives into blank files it set aside after the origin's
  last copy (``sidecar/storage/reserve.py``), so it can beat this reference.
- ``peer_copy``: two real replicator processes (2 slices x 1 host, ``--replicas 1
  --keep 1``). A step of ``--gib`` GiB (8 MiB files of distinct pseudo-random words,
  each step distinct too, so nothing is deduplicated) is written under a temporary
  name in host 0's root with its mtc manifest (sizes and CRC32Cs, taken as the
  sidecar writes them: off the clock) and renamed into place; timed from the
  rename until host 1's verified copy is committed (its folder renamed into
  ``.mtc-replica/0/<step>``). The sender trusts the manifest's CRC32Cs (no pass
  over the bytes before the copy): ``describe_pass`` times its description
  in-process (``describe_own``: the manifest read), and host 1's replica folder is
  watched so the copy splits
  into: until the Offer (the incoming folder appears), until the first pushed file
  appears, and the transfer (first file to commit; ``peer_transfer_over_raw_tcp``).
  Before each copy the bench waits until host 1 has set aside the last copy's
  sizes (``mtc_reserve_bytes``; none before the warm-up copy), as it has between a
  job's saves, minutes apart; ``--no-reserve`` measures without it.
- ``peer_restore``: host 0's root is wiped and its replicator restarted; once it
  has set aside RAM disk for the files host 1 holds of its data (it does so at
  start, as a replaced host's replicator does while its job starts up: seconds to
  minutes on a real cluster; ``reserve_ready_seconds``, here well under one),
  ``PrepareRestore`` is called on both replicators at once and host 0 fetches its
  step back from host 1. Timed from the calls to host 0's reply (agreement
  included; the process restart is reported apart). ``--no-reserve``: into new
  pages, as a restore that comes before the reserve is ready.
- ``local_read``: the same files read from the RAM disk with ``readinto`` into
  preallocated, warmed buffers.
- ``raw_fetch``: the floor of that restore on this machine (``_loopback.RawFetch``):
  the same files over as many loopback connections as a restore's fetch uses, each
  ``sendfile``d and ``splice``d into a new file of an emptied folder, then CRC32C'd
  (``peer_restore_over_raw_fetch``), into files allocated before the clock starts
  as the restore's are (``--no-reserve``: new pages, which the kernel clears as
  they are first written: that bounds both well below a read of held pages).
- ``host_cpu_s_per_gb``: CPU seconds (from ``/proc``) both hosts' replicators spend
  per GB of a step, from its commit on host 0 until the copy is committed on host
  1, the previous copy deleted, host 1's reserve refilled and the sender settled
  (the median sample).

Each measurement is interleaved with its reference, round by round (raw TCP, a peer
copy, a raw file copy; a local read then a restore), so drift in the machine's load
hits both alike; the first ``--warmup`` rounds are discarded. Throughputs are in GB/s
(1e9 bytes); ratios are taken between the best samples.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import importlib
import os
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import GB, gbps, log, run_in_scratch, summary  # also puts the repository on the path
from _cpu import process_cpu
from _loopback import TCP_CHUNK, RawFetch, RawFileCopy, RawTcp

from mtc.integrity import crc32c
from mtc.layout import TMP_MARK
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.fetch.materialize import FETCH_STREAMS
from mtc.sidecar.replicator.store.step_files import describe_own
from mtc.sidecar.replicator.store.store import REPLICA_DIR

replicators: Any = importlib.import_module("replicators")  # tests/replicators.py

MIB = 1 << 20
FILE_BYTES = 8 * MIB
TARGETS = {"peer_copy_over_raw_tcp": 0.6, "peer_restore_over_local_read": 0.5}
CEILINGS = {"host_cpu_s_per_gb": 1.5}  # at most


# -- steps on the RAM disk ------------------------------------------------------------------


def write_all(path: Path, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    finally:
        os.close(fd)


def write_step(root: Path, step: int, payload: memoryview, nfiles: int) -> Path:
    """``nfiles`` files of ``payload`` under a temporary name; each starts with (step, i)
    so no file equals one of another step or of this one. Returns the temporary folder."""
    tmp = root / f"{step}.tmp"
    tmp.mkdir()
    for i in range(nfiles):
        part = payload[i * FILE_BYTES:(i + 1) * FILE_BYTES]
        fd = os.open(tmp / f"shard_{i:05d}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, struct.pack("<QQ", step, i))
            done = 16
            while done < len(part):
                done += os.write(fd, part[done:])
        finally:
            os.close(fd)
    # An mtc step, as the sidecar writes it: its manifest (sizes and CRC32Cs) last.
    replicators.write_mtc_manifest(tmp, step, host=0, num_hosts=2)
    return tmp


def wait_for(path: Path, timeout: float, what: str) -> float:
    """Polls until ``path`` exists; returns the time it was first seen."""
    deadline = time.perf_counter() + timeout
    while not path.exists():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what}: {path} did not appear within {timeout} s")
        time.sleep(0.002)
    return time.perf_counter()


def step_files(step_dir: Path) -> list[Path]:
    return sorted(step_dir.glob("shard_*.bin"))


def crc_files(paths: list[Path]) -> int:
    """The same pass the replicator makes to describe an opaque step (4 MiB reads + CRC)."""
    buf = bytearray(4 * MIB)
    view = memoryview(buf)
    total = 0
    for p in paths:
        value = 0
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                value = crc32c(view[:n], value)
        total ^= value
    return total


def read_files(paths: list[Path], bufs: list[np.ndarray]) -> None:
    for path, buf in zip(paths, bufs, strict=True):
        view = buf.data.cast("B")
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{path}: short read ({got} of {len(view)} bytes)")
                got += n


def check_restored(step_dir: Path, step: int, payload: memoryview, nfiles: int) -> None:
    paths = step_files(step_dir)
    if len(paths) != nfiles:
        raise AssertionError(f"restored {len(paths)} files, expected {nfiles}")
    for i, p in enumerate(paths):
        want = struct.pack("<QQ", step, i) + bytes(payload[i * FILE_BYTES + 16:
                                                           (i + 1) * FILE_BYTES])
        if p.read_bytes() != want:
            raise AssertionError(f"restored {p} differs from what was written")


# -- the benchmark --------------------------------------------------------------------------


def make_payload(nbytes: int) -> np.ndarray:
    """Distinct 8-byte words (a multiplicative hash of their index): no two files equal."""
    words = np.arange(nbytes // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words ^= words >> np.uint64(29)
    return words.view(np.uint8)


@dataclasses.dataclass
class CopyTimes:
    """Seconds from the commit on host 0 (the rename) to each event seen on host 1."""

    offer: float  # the incoming folder exists: discovery, describe pass and Offer done
    first_file: float  # the first pushed file exists: the data starts flowing
    commit: float  # the verified copy is committed
    describe: float  # the sender's describe pass, timed again in-process afterwards
    cpu: list[float]  # CPU seconds of each host's replicator, from the rename to settled
    reserved_before: int  # host 1's blank bytes set aside when the copy started
    refill: float  # seconds from the commit until host 1's reserve was full again


def host_cpu(pids: list[int]) -> list[float]:
    """CPU seconds (user + system) each of the processes ``pids`` has spent, from /proc."""
    out = []
    for pid in pids:
        got = process_cpu(pid)
        if got is None:
            raise RuntimeError(f"process {pid} is gone")
        out.append(got[1])
    return out


def reserved(cl: Any, want: int, timeout: float, host: int = 1) -> tuple[int, float]:
    """(``host``'s reserve in bytes, seconds waited): polled until it holds ``want``
    bytes (the last copy's size; 0: whatever it holds) or ``timeout``."""
    t0 = time.perf_counter()
    while True:
        held = int(cl.scrape(host).get("mtc_reserve_bytes", 0))
        if held >= want or time.perf_counter() - t0 > timeout:
            return held, time.perf_counter() - t0
        time.sleep(0.01)


def copy_sample(cl: Any, step: int, payload: memoryview, nfiles: int,
                pids: list[int], reserve: int) -> CopyTimes:
    """Commit a step on host 0 and watch host 1's replica folder until its copy
    commits, then until host 1 has set aside ``reserve`` bytes for the next copy."""
    h0, h1 = cl.root(0), cl.root(1)
    tmp = write_step(h0, step, payload, nfiles)
    time.sleep(0.3)  # let the writes settle and the replicators idle
    cpu0 = host_cpu(pids)
    held_before, _ = reserved(cl, 0, 0)
    area = h1 / REPLICA_DIR / "0"
    final, prefix = str(step), f"{step}{TMP_MARK}"
    offer = first = 0.0
    t0 = time.perf_counter()
    os.rename(tmp, h0 / str(step))
    while True:  # a listing every 2 ms: cheap next to the copy
        now = time.perf_counter()
        try:
            names = os.listdir(area)
        except FileNotFoundError:
            names = []
        if final in names:
            break
        incoming = [n for n in names if n.startswith(prefix)]
        if incoming and not offer:
            offer = now
        if incoming and not first:
            try:
                if os.listdir(area / incoming[0]):
                    first = now
            except FileNotFoundError:
                pass
        if now - t0 > 120:
            raise TimeoutError(f"copy of step {step}: not committed on host 1 in 120 s")
        time.sleep(0.002)
    done = now
    time.sleep(0.5)  # garbage collection of the previous step, off the clock
    # The refill of host 1's reserve (its CPU counts here) and the sender's sync of
    # the target's holdings included.
    _, refill = reserved(cl, reserve, 60)
    cpu = [b - a for a, b in zip(cpu0, host_cpu(pids), strict=True)]
    t2 = time.perf_counter()
    describe_own(h0 / str(step))
    describe = time.perf_counter() - t2
    return CopyTimes(offer=(offer or done) - t0, first_file=(first or done) - t0,
                     commit=done - t0, describe=describe, cpu=cpu,
                     reserved_before=held_before, refill=0.5 + refill)


def restore_sample(cl: Any, h0: Path, step: int, reserve: int
                   ) -> tuple[float, Any, Any, float, float]:
    """Replace host 0 (SIGKILL, wipe, restart); wait until its replicator has set
    ``reserve`` bytes aside for the restore (0: no wait), as it does while a real
    job starts up; then PrepareRestore on both hosts at once. Returns (seconds to
    host 0's reply, host 0's reply, host 1's reply, restart seconds, seconds from
    the restart until the reserve was ready)."""
    cl.kill(0)
    shutil.rmtree(h0)
    t0 = time.perf_counter()
    cl.start(0)
    restart = time.perf_counter() - t0
    ready = 0.0
    if reserve:
        held, ready = reserved(cl, reserve, 60, host=0)
        if held < reserve:
            raise AssertionError(f"host 0 set {held} of {reserve} bytes aside for its "
                                 "restore in 60 s")
    clients = [cl.client(0), cl.client(1)]
    done: dict[int, float] = {}

    def prepare(rank: int) -> Any:
        reply = clients[rank].call("PrepareRestore", pb.PrepareRestoreRequest(), deadline_s=120)
        done[rank] = time.perf_counter()
        return reply

    try:
        with cf.ThreadPoolExecutor(2) as ex:
            t0 = time.perf_counter()
            r0, r1 = ex.map(prepare, (0, 1))
    finally:
        for c in clients:
            c.close()
    if r0.step != step or r0.tier != "peer":
        raise AssertionError(f"host 0 restored step {r0.step} from {r0.tier!r}, "
                             f"expected {step} from 'peer'")
    return done[0] - t0, r0, r1, restart, ready


def run(gib: float, samples: int, warmup: int, base: Path, *,
        reserve: bool = True) -> dict[str, Any]:
    t_start = time.perf_counter()
    nfiles = max(1, round(gib * 1024 * MIB / FILE_BYTES))
    nbytes = nfiles * FILE_BYTES
    rounds = samples + warmup
    log(f"{nfiles} files of 8 MiB ({nbytes / GB:.2f} GB), {samples} samples after "
        f"{warmup} warm-up, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    payload_arr = make_payload(nbytes)
    payload = payload_arr.data.cast("B")
    tcp_s: list[float] = []
    file_s: list[float] = []
    copies: list[CopyTimes] = []
    crc_s: list[float] = []
    restore_s: list[float] = []
    server_s: list[float] = []
    restart_s: list[float] = []
    ready_s: list[float] = []
    read_s: list[float] = []
    fetch_s: list[float] = []
    tiers: list[str] = []
    bufs = [np.empty(FILE_BYTES, np.uint8) for _ in range(nfiles)]
    for b in bufs:
        b.fill(1)  # warmed: every page mapped before timing

    raw = RawTcp(payload)
    rawcopy = RawFileCopy(base / "raw-copy")
    rawfetch = RawFetch(base / "raw-fetch", FETCH_STREAMS, held=reserve)
    cl = replicators.Cluster(base, 2, 1, extra=("--replicas", "1", "--keep", "1",
                                              *(() if reserve else ("--no-reserve",))),
                             metrics=True, scrub=True)  # scrubbing, as deployed
    h0, h1 = cl.root(0), cl.root(1)
    try:
        cl.start_all()
        # Rounds interleave each measurement with its reference, so drift in the load
        # of the machine hits both alike.
        step = 0
        for r in range(rounds):
            step = 100 + r
            t_tcp = raw.sample()
            c = copy_sample(cl, step, payload, nfiles, [cl.procs[0].pid, cl.procs[1].pid],
                            nbytes if reserve else 0)
            paths = step_files(h0 / str(step))
            t_file = rawcopy.sample(paths)
            t0 = time.perf_counter()
            crc_files(paths)
            t_crc = time.perf_counter() - t0
            tag = " (warm-up)" if r < warmup else ""
            log(f"raw TCP {gbps(nbytes, t_tcp)} GB/s; raw file copy {gbps(nbytes, t_file)} "
                f"GB/s; copy of step {step}: {c.commit:.3f} s = "
                f"{gbps(nbytes, c.commit)} GB/s (offer at {c.offer:.3f} s, first file at "
                f"{c.first_file:.3f} s; describe pass {c.describe:.3f} s; "
                f"{c.reserved_before / GB:.2f} GB set aside before it, refilled in "
                f"{c.refill:.2f} s){tag}")
            if r >= warmup:
                tcp_s.append(t_tcp)
                file_s.append(t_file)
                copies.append(c)
                crc_s.append(t_crc)
        mem = payload_arr[:256 * MIB]
        t0 = time.perf_counter()
        crc32c(mem)
        crc_mem_gbps = gbps(len(mem), time.perf_counter() - t0)

        last = step
        # host 1 needs a step of its own for `last` to be restorable: a tiny one
        tiny = h1 / f"{last}.tmp"
        tiny.mkdir()
        write_all(tiny / "tiny.bin", memoryview(os.urandom(4096)))
        replicators.write_mtc_manifest(tiny, last, host=1, num_hosts=2, slice_of_host=1)
        os.rename(tiny, h1 / str(last))
        wait_for(h0 / REPLICA_DIR / "1" / str(last), 60, "copy of host 1's step")

        for r in range(rounds):
            t0 = time.perf_counter()  # host 0's own copy: as written, or as last restored
            read_files(step_files(h0 / str(last)), bufs)
            t_read = time.perf_counter() - t0
            t_fetch = rawfetch.sample(step_files(h0 / str(last)))
            t_restore, r0, r1, restart, ready = restore_sample(cl, h0, last,
                                                               nbytes if reserve else 0)
            check_restored(h0 / str(last), last, payload, nfiles)
            tag = " (warm-up)" if r < warmup else ""
            log(f"local read {gbps(nbytes, t_read)} GB/s; raw fetch {gbps(nbytes, t_fetch)} "
                f"GB/s; restore "
                f"{t_restore:.3f} s = {gbps(nbytes, t_restore)} GB/s (server {r0.seconds:.3f}"
                f" s, host 1 {r1.tier} {r1.seconds:.3f} s; restart {restart:.2f} s, set "
                f"aside {ready:.2f} s after it){tag}")
            if r >= warmup:
                restore_s.append(t_restore)
                server_s.append(r0.seconds)
                restart_s.append(restart)
                ready_s.append(ready)
                tiers.append(f"{r0.tier}/{r1.tier}")
                read_s.append(t_read)
                fetch_s.append(t_fetch)
    finally:
        cl.stop_all()
        raw.close()
        rawcopy.close()
    copy_s = [c.commit for c in copies]
    data_s = [c.commit - c.first_file for c in copies]
    result: dict[str, Any] = {
        "bytes": nbytes,
        "files": nfiles,
        "file_mib": FILE_BYTES // MIB,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "samples": samples,
        "warmup": warmup,
        "reserve": reserve,
        "raw_tcp": {**summary(nbytes, tcp_s), "chunk_mib": TCP_CHUNK // MIB},
        "raw_file_copy": summary(nbytes, file_s),
        "peer_copy": {
            **summary(nbytes, copy_s),
            # the split, from host 1's replica folder: until the incoming folder appears
            # (discovery, the sender's describe pass, Offer), until the first file
            # appears, and the data transfer itself (first file to commit)
            "until_offer_seconds": [round(c.offer, 3) for c in copies],
            "until_first_file_seconds": [round(c.first_file, 3) for c in copies],
            "transfer": summary(nbytes, data_s),
            "describe_pass": summary(nbytes, [c.describe for c in copies]),
            # host 1's blank space set aside from the last copy's sizes (sidecar/storage/reserve.py;
            # none before the first), and how long its refill took after the commit
            "reserved_bytes_before": [c.reserved_before for c in copies],
            "refill_seconds": [round(c.refill, 2) for c in copies],
            "crc_of_files_gbps": summary(nbytes, crc_s)["gbps_best"],
            "crc_in_memory_gbps": crc_mem_gbps,
        },
        "peer_restore": {**summary(nbytes, restore_s),
                         "server_seconds": [round(s, 3) for s in server_s],
                         "restart_seconds": [round(s, 2) for s in restart_s],
                         # from the restart until the replaced host had set the
                         # restore's RAM disk aside (sidecar/storage/reserve.py; 0: --no-reserve)
                         "reserve_ready_seconds": [round(s, 2) for s in ready_s],
                         "tiers_host0_host1": tiers},
        "local_read": summary(nbytes, read_s),
        "raw_fetch": {**summary(nbytes, fetch_s), "streams": FETCH_STREAMS},
        "peer_copy_over_raw_tcp": round(min(tcp_s) / min(copy_s), 3),
        "peer_transfer_over_raw_tcp": round(min(tcp_s) / min(data_s), 3),
        "peer_copy_over_raw_file_copy": round(min(file_s) / min(copy_s), 3),
        "peer_restore_over_local_read": round(min(read_s) / min(restore_s), 3),
        "peer_restore_over_raw_fetch": round(min(fetch_s) / min(restore_s), 3),
        # Both hosts' replicators (the step is written by the bench, as Orbax writes
        # one: no sidecar), per GB of a step committed, copied and verified:
        # median over the samples.
        "host_cpu_s_per_gb": round(sorted(sum(c.cpu) for c in copies)[len(copies) // 2]
                                   / (nbytes / GB), 3),
        "host_cpu_seconds_sender_receiver": [[round(x, 3) for x in c.cpu] for c in copies],
        "targets": {**{k: f">= {v}" for k, v in TARGETS.items()},
                    **{k: f"<= {v}" for k, v in CEILINGS.items()}},
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    result["meets_targets"] = {**{k: result[k] >= v for k, v in TARGETS.items()},
                               **{k: result[k] <= v for k, v in CEILINGS.items()}}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--gib", type=float, default=1.0, help="step size in GiB (default 1)")
    p.add_argument("--samples", type=int, default=3, help="kept samples per figure")
    p.add_argument("--warmup", type=int, default=1, help="discarded samples per figure")
    p.add_argument("--no-reserve", action="store_true",
                   help="the replicators set no RAM-disk space aside (as before it existed)")
    args = p.parse_args(argv)
    if args.samples < 1 or args.warmup < 0:
        p.error("--samples must be >= 1 and --warmup >= 0")
    return run_in_scratch("mtc-bench-replicator-",
                          lambda base: run(args.gib, args.samples, args.warmup, base,
                                           reserve=not args.no_reserve))


if __name__ == "__main__":
    sys.exit(main())
