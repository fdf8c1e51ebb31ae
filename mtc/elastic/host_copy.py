"""A snapshot's copy in this process's own host memory (numpy), brought from an
accelerator by ``device_get``, one replica of each shard.

Why not ``pinned_host`` arrays, which a snapshot from an accelerator used before:
on a TPU v5e host (gVisor, 2026-12-07) a ``device_put`` of 1.5 GiB into fresh
``pinned_host`` buffers took 2.02 s against 0.51 s for ``jax.device_get`` of the
same arrays into numpy (``bench/probe_capture.py``), and the newest snapshot's
age is bounded below by that transfer. numpy memory is this process's, so it
serves only where every device of the state is this process's own (a
multi-controller process, one host): on Pathways the controller must never
carry checkpoint bytes, and the workers' ``pinned_host`` memory is where
snapshots stay (:func:`numpy_serves`).

Only buffers no step donates may be read from another thread: the snapshot's
copies in device memory (:mod:`mtc.save.device_copy`) and a compiled step's
own copies (:mod:`mtc.elastic.in_graph`). An array read straight from the state
is read before :meth:`mtc.elastic.Snapshotter.take` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mtc.elastic.placement import Index, shard_indices
from mtc.save.device_copy import on_accelerator

# How many bytes of transfers are under way ahead of the one waited for: issued
# all at once, the transfers of a whole state slowed the steps running meanwhile
# on a TPU v5e (the save's transfer thread keeps the same window: 256 MiB).
AHEAD_BYTES = 256 << 20

Pieces = tuple[tuple[Index, np.ndarray], ...]


def numpy_serves(arrays: Sequence[Any]) -> bool:
    """Whether a snapshot of ``arrays`` is kept in numpy: every array is on an
    accelerator whose devices are all this process's own, and JAX does not run on
    Pathways (one controller for many hosts)."""
    from mtc.multihost import on_pathways

    device = [a for a in arrays if isinstance(a, jax.Array)]
    if not device or not all(on_accelerator(a) for a in device) or on_pathways():
        return False
    me = jax.process_index()
    devices: list[Any] = [d for a in device for d in a.sharding.device_set]
    return all(d.process_index == me for d in devices)


def fetch(arrays: Sequence[jax.Array], *, ahead: int = AHEAD_BYTES,
          ready_first: bool = False) -> list[Pieces]:
    """Each array's distinct shards in numpy, by index (one replica of each: a
    replicated array is kept once, not once per device). Transfers are issued
    ``ahead`` bytes ahead of the one waited for; ``ready_first``: only once every
    array is computed (a compiled step's own copies, which land with its loss: a
    transfer issued before the loop fetches that loss is carried before it, and
    on a TPU v5e host the loop's loss then waited up to 143 ms behind 256 MiB of
    snapshot, 2026-12-07). Raises what reading a shard raises (a device lost, an
    array deleted)."""
    if ready_first:
        jax.block_until_ready(list(arrays))
    jobs: list[tuple[int, Index, jax.Array]] = []
    for i, a in enumerate(arrays):
        where = shard_indices(a.sharding, tuple(a.shape))
        seen: set[Index] = set()
        for s in a.addressable_shards:
            idx = where[s.device]
            if idx not in seen:
                seen.add(idx)
                jobs.append((i, idx, s.data))
    out: list[list[tuple[Index, np.ndarray]]] = [[] for _ in arrays]
    issued = 0  # jobs whose transfer has been started
    under_way = 0  # bytes started and not yet waited for
    for k, (i, idx, data) in enumerate(jobs):
        while issued < len(jobs) and (issued <= k or under_way < ahead):
            jobs[issued][2].copy_to_host_async()
            under_way += jobs[issued][2].nbytes
            issued += 1
        x = np.asarray(data)
        if not on_accelerator(data):
            # A CPU device's host view is its buffer, which a donating step reuses.
            x = x.copy()
        under_way -= data.nbytes
        out[i].append((idx, x))
    return [tuple(p) for p in out]
