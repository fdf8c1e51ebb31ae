"""Deduplication and verification costs on the RAM disk; prints one JSON object.

- dedup of a step's files already held: a claim (what mtc does: a hard link
  after the held file's remembered checksum is checked, ``claims.claim``),
  a reflink (where the file system shares extents; tmpfs does not), and a
  verified copy (read, CRC32C, write: what mtc did before claims), against a
  plain kernel file copy (``copy_file_range``) in the same run;
- the RAM disk a host of a two-slice job needs for its own step and its twin's
  copy, built both ways (``--dp-fraction`` of the files data-parallel, the rest
  pushed), as the bytes of the distinct inodes: claims against copies;
- an inventory's verification of an opaque step (Orbax's: no manifest to trust):
  the first pass reads every byte (CRC32C), later ones use the per-file cache
  (one ``stat`` each), against a raw read. (An mtc step's files are trusted as
  their manifest's CRC32Cs say until they change: tests/test_store_checksums.py.)

    python bench/dedup.py [--mib 256] [--files 64] [--samples 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (repository on sys.path)
import numpy as np

from mtc.sidecar.replicator.store import claims
from mtc.sidecar.replicator.store.step_files import FileMeta
from mtc.sidecar.replicator.store.store import LocalStore
from mtc.sidecar.storage.checksum import FICLONE, copy_verified, file_crc


def timed(fn: Any, samples: int) -> float:
    out = []
    for _ in range(samples):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--files", type=int, default=64)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--dp-fraction", type=float, default=0.5,
                   help="the share of a host's files its twin in the other slice saved too")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="mtc-bench-dedup-", dir="/dev/shm"))
    try:
        src = base / "1"
        src.mkdir()
        size = args.mib * (1 << 20) // args.files
        rng = np.random.default_rng(0)
        files = []
        for i in range(args.files):
            f = src / f"{i:04d}.bin"
            f.write_bytes(rng.bytes(size))
            files.append((f, size, file_crc(f)[1]))
        total = size * args.files

        def fresh() -> Path:
            d = base / "dst"
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            return d

        def kernel_copy() -> None:
            d = fresh()
            for f, n, _ in files:
                with open(f, "rb") as a, open(d / f.name, "wb") as b:
                    left = n
                    while left:
                        left -= os.copy_file_range(a.fileno(), b.fileno(), left)

        store = LocalStore(base, 0)

        def claim() -> None:
            d = fresh()
            for f, n, c in files:
                claims.claim(store, f, d / f.name, FileMeta(f.name, n, c))

        def verified() -> None:
            d = fresh()
            for f, n, c in files:
                copy_verified(f, d / f.name, n, c)

        def raw_read() -> None:
            for f, _, _ in files:
                with open(f, "rb", buffering=0) as a:
                    while a.read(4 << 20):
                        pass

        kernel_copy()  # warm-up: touch the pages once
        verified()
        ref = timed(kernel_copy, args.samples)
        link = timed(claim, args.samples)
        ver = timed(verified, args.samples)
        d = fresh()
        with open(files[0][0], "rb") as a, open(d / "probe", "wb") as b:
            try:
                import fcntl
                fcntl.ioctl(b.fileno(), FICLONE, a.fileno())
                reflink = True
            except OSError:
                reflink = False

        # The twin's copy beside the own step: data-parallel files claimed (or copied,
        # as before claims), the rest pushed (a file of its own either way).
        k = round(args.dp_fraction * len(files))

        def twin_copy(claimed: bool) -> int:
            d = fresh()
            for i, (f, n, c) in enumerate(files):
                if claimed and i < k:
                    claims.claim(store, f, d / f.name, FileMeta(f.name, n, c))
                else:
                    copy_verified(f, d / f.name, n, c)
            inodes = {}
            for folder in (src, d):
                for q in folder.iterdir():
                    st = q.stat()
                    inodes[(st.st_dev, st.st_ino)] = st.st_blocks * 512
            return sum(inodes.values())

        with_claims, with_copies = twin_copy(True), twin_copy(False)
        read = timed(raw_read, args.samples)
        opaque = LocalStore(base, 0, orbax=True)
        t0 = time.perf_counter()
        assert opaque.verified_copies(), "the step was not inventoried"
        cold = time.perf_counter() - t0
        warm = timed(opaque.verified_copies, args.samples)
        out = {
            "bytes": total, "files": args.files,
            "kernel_copy_GBps": round(total / ref / 1e9, 2),
            "verified_copy_GBps": round(total / ver / 1e9, 2),
            "verified_copy_over_kernel_copy": round(ref / ver, 2),
            "claim_s": round(link, 5),
            "claim_over_verified_copy_time": round(link / ver, 4),
            "dp_fraction": args.dp_fraction,
            "ramdisk_bytes_two_slices_claims": with_claims,
            "ramdisk_bytes_two_slices_copies": with_copies,
            "ramdisk_claims_over_copies": round(with_claims / with_copies, 3),
            "reflink_available": reflink,
            "inventory_cold_over_raw_read": round(read / cold, 2),
            "inventory_warm_s": round(warm, 5),
            "inventory_warm_over_cold": round(warm / cold, 4),
            "note": "a claim shares one inode between a host's file and a peer's copy of "
                    "the same bytes: damage found through either quarantines both",
        }
        print(json.dumps(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
