"""Deduplication and verification costs on the RAM disk; prints one JSON object.

- dedup of a step's files already held: a hard link (what mtc did: one inode for
  two copies), a reflink (where the file system shares extents; tmpfs does not),
  and the verified copy mtc does now (read, CRC32C, write), against a plain
  kernel file copy (``copy_file_range``) in the same run;
- an inventory's verification: the first pass reads every byte (CRC32C), later
  ones use the per-file cache (one ``stat`` each), against a raw read.

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

from mtc.sidecar.files import FICLONE, copy_verified
from mtc.sidecar.replicator.step_files import file_crc
from mtc.sidecar.replicator.store import LocalStore


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
            files.append((f, size, file_crc(f)))
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

        def hard_link() -> None:
            d = fresh()
            for f, _, _ in files:
                os.link(f, d / f.name)

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
        link = timed(hard_link, args.samples)
        ver = timed(verified, args.samples)
        d = fresh()
        with open(files[0][0], "rb") as a, open(d / "probe", "wb") as b:
            try:
                import fcntl
                fcntl.ioctl(b.fileno(), FICLONE, a.fileno())
                reflink = True
            except OSError:
                reflink = False

        store = LocalStore(base, 0)
        read = timed(raw_read, args.samples)
        t0 = time.perf_counter()
        store.verified_copies()
        cold = time.perf_counter() - t0
        warm = timed(store.verified_copies, args.samples)
        out = {
            "bytes": total, "files": args.files,
            "kernel_copy_GBps": round(total / ref / 1e9, 2),
            "verified_copy_GBps": round(total / ver / 1e9, 2),
            "verified_copy_over_kernel_copy": round(ref / ver, 2),
            "hard_link_s": round(link, 5),
            "reflink_available": reflink,
            "inventory_cold_over_raw_read": round(read / cold, 2),
            "inventory_warm_s": round(warm, 5),
            "inventory_warm_over_cold": round(warm / cold, 4),
            "note": "hard links are instant but share one inode between two copies; "
                    "reflinks are not available on tmpfs, so dedup is a verified copy",
        }
        print(json.dumps(out))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
