"""The accelerator probe behind a save's and a snapshot's capture (issue 65): is a
device-to-host copy still in flight ordered before a step that donates its source,
and what does each way of bringing the state to host memory cost. Prints JSON.

Cases, on a state of ``leaves`` float32 arrays of ``dim`` x ``dim`` (random values):

- ``ordering``: the state's values are read to host memory first (the reference);
  a ``jax.device_put`` to ``pinned_host`` memory is dispatched and not waited for,
  then a jitted step that donates the state and overwrites it in place; the copy
  must hold the values from before the step. Repeated ``trials`` times. mtc's
  snapshot (and a save's direct part, once it stops waiting) relies on this: the
  runtime orders a donating program after the reads of its inputs already
  dispatched.
- ``device_get``: ``copy_to_host_async`` and ``jax.device_get`` into new numpy arrays.
- ``pinned_fresh``: ``jax.device_put`` into new ``pinned_host`` buffers: the call's
  own time (what a caller waits for) and until ready; then ``np.asarray`` of them;
  then releasing them.
- ``pinned_reused``: a jitted copy into ``pinned_host`` that donates the previous
  copy's buffers (whether the runtime reuses them: the output's buffer pointer).

    python bench/probe_capture.py [--leaves 24] [--dim 4096] [--trials 5]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def probe(leaves: int, dim: int, trials: int) -> dict[str, Any]:
    device = jax.devices()[0]
    s = jax.sharding.SingleDeviceSharding(device)
    kinds = {m.kind for m in device.addressable_memories()}
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(),
                           "device_kind": device.device_kind, "jax": jax.__version__,
                           "memory_kinds": sorted(kinds), "leaves": leaves, "dim": dim,
                           "bytes": leaves * dim * dim * 4}
    pinned = s.with_memory_kind("pinned_host") if "pinned_host" in kinds else None

    def state(seed: int) -> list[jax.Array]:
        keys = jax.random.split(jax.random.key(seed), leaves)
        return jax.block_until_ready(
            [jax.random.normal(k, (dim, dim), jnp.float32) for k in keys])

    overwrite = jax.jit(lambda xs: [x * 0.5 + 7.0 for x in xs], donate_argnums=0)
    if pinned is not None:
        bad = 0
        deleted = 0
        for t in range(trials):
            xs = state(t)
            ref = [np.asarray(x) for x in xs]
            copies = jax.device_put(xs, [pinned] * leaves, may_alias=False)
            ys = overwrite(xs)  # donates xs: must run after the copies have read them
            deleted += all(x.is_deleted() for x in xs)
            got = [np.asarray(c) for c in copies]
            bad += sum(not np.array_equal(a, b) for a, b in zip(got, ref, strict=True))
            jax.block_until_ready(ys)
            del xs, ys, copies, got, ref
        out["ordering"] = {"trials": trials, "arrays_checked": trials * leaves,
                           "arrays_with_other_values": bad, "donated_every_trial": deleted}

    xs = state(100)

    def device_get() -> None:
        fresh = jax.block_until_ready([x + 0 for x in xs])
        t0 = time.perf_counter()
        for x in fresh:
            x.copy_to_host_async()
        jax.device_get(fresh)
        device_get.took.append(time.perf_counter() - t0)  # type: ignore[attr-defined]
    device_get.took = []  # type: ignore[attr-defined]
    for _ in range(3):
        device_get()
    out["device_get_s"] = round(statistics.median(device_get.took), 4)  # type: ignore[attr-defined]

    if pinned is not None:
        calls, readies, asarrays, releases = [], [], [], []
        for _ in range(3):
            t0 = time.perf_counter()
            h = jax.device_put(xs, [pinned] * leaves, may_alias=False)
            calls.append(time.perf_counter() - t0)
            jax.block_until_ready(h)
            readies.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            arr = [np.asarray(c) for c in h]
            asarrays.append(time.perf_counter() - t0)
            del arr
            t0 = time.perf_counter()
            del h
            gc.collect()
            releases.append(time.perf_counter() - t0)
        out["pinned_fresh"] = {"call_s": round(statistics.median(calls), 4),
                               "ready_s": round(statistics.median(readies), 4),
                               "asarray_s": round(statistics.median(asarrays), 4),
                               "release_s": round(statistics.median(releases), 4)}
        try:
            into = jax.jit(lambda dst, src: [jnp.copy(x) for x in src], donate_argnums=0,
                           out_shardings=[pinned] * leaves)
            dst = jax.block_until_ready(jax.device_put(xs, [pinned] * leaves, may_alias=False))
            times, same = [], 0
            for _ in range(4):
                before = [d.unsafe_buffer_pointer() for d in dst]
                t0 = time.perf_counter()
                dst = jax.block_until_ready(into(dst, xs))
                times.append(time.perf_counter() - t0)
                same += sum(a == d.unsafe_buffer_pointer() for a, d in zip(before, dst,
                                                                           strict=True))
            ok = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(dst, xs,
                                                                                  strict=True))
            out["pinned_reused"] = {"median_s": round(statistics.median(times[1:]), 4),
                                    "first_s": round(times[0], 4),
                                    "buffers_reused": same, "of": 4 * leaves,
                                    "values_equal": ok}
            del dst
        except Exception as e:  # noqa: BLE001 - a probe: record what the runtime says
            out["pinned_reused"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--leaves", type=int, default=24)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--trials", type=int, default=5)
    a = p.parse_args(argv)
    print(json.dumps(probe(a.leaves, a.dim, a.trials), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
