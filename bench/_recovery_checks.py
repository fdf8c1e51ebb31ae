"""``bench/recovery.py``'s cluster and its checks: the shape (8 devices, 2 slices
of 2 simulated hosts), the replicators' inventories and the waits on them (a step
replicated to every peer, a host's own copy back), the files of one step and their
raw tmpfs read (the reference a restore is compared with), and the check that a
restore is exact, bit for bit, on the expected sharding."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from mtc.contract import shard_index
from mtc.credentials import Credentials
from mtc.proto import replicator_pb2 as pb
from mtc.sidecar.replicator.wire.client import PeerClient
from mtc.testing.local_cluster import LocalCluster

NUM_DEVICES = 8
SLICES = 2
HOSTS_PER_SLICE = 2

State = dict[str, jax.Array]


def verify(label: str, restored: Any, want: dict[str, np.ndarray],
           sharding: NamedSharding) -> None:
    """Fail loudly unless ``restored`` holds exactly ``want`` on ``sharding``."""
    if set(restored) != set(want):
        raise AssertionError(f"{label}: restored keys differ from saved ones")
    for name, arr in restored.items():
        if not isinstance(arr, jax.Array):
            raise AssertionError(f"{label}: {name} is a {type(arr).__name__}, not a jax.Array")
        if not arr.sharding.is_equivalent_to(sharding, arr.ndim):
            raise AssertionError(f"{label}: {name} has sharding {arr.sharding}, "
                                 f"expected {sharding}")
        got = np.asarray(arr)
        w = want[name]
        if got.shape != w.shape or got.dtype != w.dtype or \
                not np.array_equal(got.view(np.uint32), w.view(np.uint32)):
            raise AssertionError(f"{label}: {name} differs from the saved value")


def inventory(addr: str, rank: int, token: str) -> set[tuple[int, int]]:
    """(origin rank, step) of every complete peer copy ``rank``'s replicator holds."""
    c = PeerClient(addr, Credentials(token=token), rank=rank)
    try:
        inv = c.call("GetInventory", pb.InventoryRequest())
    finally:
        c.close()
    return {(cp.origin_rank, cp.step) for cp in inv.copies}


def wait_own_copy(cluster: LocalCluster, host: int, step: int, timeout: float = 120.0
                  ) -> float:
    """Until ``host``'s replicator holds its own data of ``step`` (brought back in the
    background after a restore that read its regions elsewhere); returns seconds."""
    t0 = time.perf_counter()
    while (host, step) not in inventory(cluster.addresses[host], host, cluster.token()):
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"host {host}'s step {step} not local again in {timeout}s")
        time.sleep(0.05)
    return time.perf_counter() - t0


def held(cluster: LocalCluster) -> set[tuple[int, int, int]]:
    """(holder, origin, step) of every complete peer copy the cluster's replicators hold
    (for mtc.testing.replicas.wait_replicated)."""
    return {(r, o, s) for r, addr in enumerate(cluster.addresses)
            for o, s in inventory(addr, r, cluster.token())}


def reference_files(folder: Path, state: State) -> list[Path]:
    """The files the hosts hold of one step, written here (the hosts' RAM disks are
    theirs alone): one per distinct shard of each host, as the raw-read reference."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for leaf, arr in state.items():
        seen: set[Any] = set()
        for shard in arr.addressable_shards:
            key = (shard.device.id // (NUM_DEVICES // (SLICES * HOSTS_PER_SLICE)),
                   shard_index(shard.index, arr.shape))
            if key in seen:
                continue
            seen.add(key)
            p = folder / f"{leaf}-{len(paths)}.bin"
            p.write_bytes(np.asarray(shard.data).tobytes())
            paths.append(p)
    return paths


def raw_read(paths: list[Path]) -> tuple[float, int]:
    """Seconds to read ``paths`` into preallocated buffers, and the bytes read."""
    sizes = [p.stat().st_size for p in paths]
    bufs = [bytearray(s) for s in sizes]
    t0 = time.perf_counter()
    for p, b in zip(paths, bufs, strict=True):
        with open(p, "rb", buffering=0) as f:
            view = memoryview(b)
            got = 0
            while got < len(b):
                k = f.readinto(view[got:])
                if not k:
                    break
                got += k
    return time.perf_counter() - t0, sum(sizes)
