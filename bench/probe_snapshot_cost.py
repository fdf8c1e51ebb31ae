"""The accelerator probe behind the snapshot's cost to the loop (issue 65): where a
snapshot taken every step costs the model step its time, when the chip is 88%
full and the state fits the device-copy budget. Prints JSON.

On a TPU v5e (2026-12-07) a snapshot kept in numpy cost the loop 0.125x the
state's ``device_get`` time each (65 ms), where a save, whose transfer is the same,
cost 0.008x; the snapshots' pacing (5% of the loop) then kept the newest snapshot
2.6x ``device_get`` old (target 2x). Each case runs the fused model step of
``bench/model_step.py`` ``steps`` times and splits each step into: the snapshot
call, the step's dispatch, the wait for the step's loss to be computed
(``block_until_ready``) and its fetch to host memory (``float``), to tell a
device-side cost (a slower step, a loss queued behind the transfers) from a
host-side one (the loop's thread waiting for the interpreter or the allocator).

Cases: ``plain``; ``snap`` (a snapshot whenever the previous is done: no pacing,
a window of 256 MiB of transfers ahead); ``snap_ahead_64m`` and ``snap_ahead_all``
(the window); ``snap_free_at_once`` (the replaced snapshot's buffers freed all at
once, as before mtc.elastic.snapshot._drop freed them one at a time);
``snap_one_at_a_time`` (each buffer freed alone, 10 ms apart);
``snap_settle`` (``settle`` called right after the step's dispatch, as the
README suggests); ``copy_only`` (the device copy alone, no transfer);
``fetch_fresh`` (a thread copying the state in device memory and bringing the
copy to numpy over and over, dropping each: the transfers' own cost, no
snapshotter); ``snap_paced`` (as users run it). In the snapshot cases
``settle_s`` is the promotion of the last snapshot (``Snapshotter.settle``),
``call_s`` the rest of ``save``.

    python bench/probe_snapshot_cost.py [--fill 0.88] [--steps 40]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np
from _common import log
from model_step import model

from mtc.elastic import InGraphStep, Snapshotter, host_copy, snapshot
from mtc.pool import ThreadPool
from mtc.save import device_copy


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc does not say)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_bytes() -> int:
    """The machine's available memory (a large number where /proc does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 50


# A case stops once this process holds more host memory than this, or the machine
# has less than AVAILABLE_FLOOR left (the device machine is given back, with
# every result, when its memory runs out).
RSS_LIMIT = 20 << 30
AVAILABLE_FLOOR = 8 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--fill", type=float, default=0.88)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--headroom", type=float, default=None,
                   help="the copy budget's margin, a share of the chip (default: mtc's, "
                        "mtc.save.device_copy.HEADROOM; the 2026-12-07 runs used 0.02)")
    p.add_argument("--model", type=int, nargs=3, default=[8, 4096, 4096])
    p.add_argument("--kind", choices=["fused", "split", "in_graph"], default="fused",
                   help="the step: one program, the gradient then the update (the "
                        "snapshot asked between them), or InGraphStep (its own copy)")
    p.add_argument("--short", action="store_true",
                   help="one microbatch a step (shorter than the state's transfer); "
                        "snapshot cases then last 40 device-to-host times")
    p.add_argument("--cases", nargs="+", default=[
        "plain", "snap_paced", "snap_free_at_once", "plain"])
    args = p.parse_args(argv)
    if args.headroom is not None:
        device_copy.HEADROOM = args.headroom
    layers, dim, batch = args.model
    device = jax.devices()[0]
    grads, update, init = model(layers, dim, batch)

    def fused(s: Any, key: jax.Array, k: int) -> Any:
        g, loss = grads(s["params"], key, k)
        return update(s, g), loss

    named = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([device]), ("data",)),
                                       jax.sharding.PartitionSpec())
    state = jax.block_until_ready(jax.device_put(init(jax.random.key(0)), named))
    shardings = jax.tree.map(lambda _: named, state)
    step_j = jax.jit(fused, donate_argnums=0, static_argnums=2,
                     out_shardings=(shardings, named))
    grads_j = jax.jit(grads, static_argnums=2)
    update_j = jax.jit(update, donate_argnums=(0, 1), out_shardings=shardings)
    in_graph = InGraphStep(fused, Snapshotter(), state_shardings=shardings, static_argnums=2)

    def get_s() -> float:
        fresh = jax.block_until_ready(jax.tree.map(lambda x: x + 0, state))
        t0 = time.perf_counter()
        for x in jax.tree.leaves(fresh):
            x.copy_to_host_async()
        jax.device_get(fresh)
        return time.perf_counter() - t0

    took = {}
    for k in (1, 4):
        state, loss = step_j(state, jax.random.key(0), k)
        float(loss)
        t0 = time.perf_counter()
        state, loss = step_j(state, jax.random.key(1), k)
        float(loss)
        took[k] = time.perf_counter() - t0
    micro = (took[4] - took[1]) / 3 if took[4] > 1.5 * took[1] else took[1]
    get = statistics.median(get_s() for _ in range(3))
    k = 1 if args.short else min(256, max(2, math.ceil((1.2 * get - took[1]) / micro) + 1))
    state, loss = step_j(state, jax.random.key(2), k)
    float(loss)
    g, loss = grads_j(state["params"], jax.random.key(3), k)
    state = update_j(state, g)
    float(loss)
    if args.kind == "in_graph":  # both its programs compiled, then a fresh snapshotter
        for i in range(4):
            state, loss = in_graph(state, jax.random.key(4), k, snapshot_step=i % 2)
            float(loss)
            in_graph.snapshotter.join()
        in_graph.snapshotter.close()
    stats = device.memory_stats() or {}
    limit, peak = int(stats.get("bytes_limit", 0)), int(stats.get("peak_bytes_in_use", 0))
    filler = []
    extra = int(args.fill * limit) - peak if limit else 0
    while extra > 0:
        n = min(256 << 20, extra)
        filler.append(jax.device_put(np.zeros(n // 4, np.float32), device))
        extra -= n
    jax.block_until_ready(filler)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    out: dict[str, Any] = {
        "date": datetime.date.today().isoformat(), "device_kind": device.device_kind,
        "jax": jax.__version__, "path": f"one process, one device, the {args.kind} model step",
        "kind": args.kind, "short": args.short,
        "state_bytes": nbytes, "device_get_s": round(get, 4), "microbatches": k,
        "fill": round((peak + sum(f.nbytes for f in filler)) / limit, 3) if limit else 0,
        "headroom": device_copy.HEADROOM,
        # What the platform reports (whether it says what it reserves for programs:
        # mtc.save.device_copy.memory_of counts ``peak_bytes_reserved`` where it does).
        "memory_stats": {k: v for k, v in stats.items() if isinstance(v, int)},
        "cases": {}}
    log(f"probe: state {nbytes / 1e9:.2f} GB, get {get:.3f} s, k {k}, fill {out['fill']}")

    def loop(name: str, act: Any, snap: Snapshotter | None = None,
             settle_after_dispatch: bool = False, steps: int | None = None
             ) -> dict[str, Any]:
        nonlocal state
        steps = args.steps if steps is None else steps
        rows = []
        ages: list[float] = []
        seen: set[int] = set()
        taken = 0
        most = 0
        before = device.memory_stats() or {}
        for i in range(steps + 2):
            most = max(most, rss_bytes())
            if most > RSS_LIMIT or available_bytes() < AVAILABLE_FLOOR:
                log(f"  {name}: stopped at step {i}: {most / 2**30:.1f} GiB resident, "
                    f"{available_bytes() / 2**30:.1f} GiB available")
                break
            t = time.perf_counter()
            if snap is not None and not settle_after_dispatch:
                snap.settle()
            if args.kind == "in_graph" and act is not None:
                # The compiled step asks for its snapshot (its own copy, no call).
                t0 = t1 = time.perf_counter()
                state, loss = in_graph(state, jax.random.key(i), k, snapshot_step=i)
                latest = in_graph.snapshotter.latest
                if latest is not None:
                    seen.add(latest.step)
                taken = len(seen)
            elif args.kind == "split":
                # The gradient dispatched first, the snapshot asked while it runs.
                g, loss = grads_j(state["params"], jax.random.key(i), k)
                t0 = time.perf_counter()
                if act is not None and act(i, state):
                    taken += 1
                t1 = time.perf_counter()
                state = update_j(state, g)
            else:
                t0 = time.perf_counter()
                if act is not None and act(i, state):
                    taken += 1
                t1 = time.perf_counter()
                state, loss = step_j(state, jax.random.key(i), k)
            if snap is not None and settle_after_dispatch:
                snap.settle()
            t2 = time.perf_counter()
            loss.block_until_ready()
            t3 = time.perf_counter()
            float(loss)
            t4 = time.perf_counter()
            if i >= 2:
                rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t, t0 - t))
                age = snap.age if snap is not None else None
                if age is not None:
                    ages.append(age.seconds)
        if not rows:
            return {"taken": taken, "steps": 0, "stopped": True}
        cols = list(zip(*rows, strict=True))
        r = {"taken": taken, "steps": len(rows), "rss_max_gib": round(most / 2**30, 2),
             "available_gib": round(available_bytes() / 2**30, 2),
             "mean_s": round(statistics.mean(cols[4]), 5),
             "settle_s": round(statistics.mean(cols[5]), 5),
             "call_s": round(statistics.mean(cols[0]), 5),
             "dispatch_s": round(statistics.mean(cols[1]), 5),
             "compute_wait_s": round(statistics.mean(cols[2]), 5),
             "loss_fetch_s": round(statistics.mean(cols[3]), 5),
             "loss_fetch_max_s": round(max(cols[3]), 5),
             "step_max_s": round(max(cols[4]), 5)}
        if ages:
            r["age_over_get"] = round(statistics.median(ages) / get, 3)
        # What the copy budget reads rose by over the case (mtc.save.device_copy
        # .memory_of): a rise beyond the copies' bytes leaves later copies less room.
        after = device.memory_stats() or {}
        for key in ("peak_bytes_in_use", "peak_bytes_reserved"):
            if key in after:
                r[f"{key}_rise"] = int(after[key]) - int(before.get(key, 0))
        r["job_peak_read"] = dict(device_copy.ACCOUNT.peaks)
        log(f"  {name}: {r}")
        return r

    def snap_case(budget: float, ahead: int | None) -> tuple[Any, Snapshotter]:
        snap = Snapshotter(loop_budget=budget)
        if ahead is not None:
            snap._fetch_pieces = functools.partial(host_copy.fetch, ahead=ahead)
        return (lambda i, s: snap.save(i, s)), snap

    results = out["cases"]
    plain_runs = []
    for name in args.cases:
        gc.collect()
        if name == "plain":
            r = loop(name, None)
            if "mean_s" in r:
                plain_runs.append(r["mean_s"])
            results[f"plain_{len(plain_runs)}"] = r
            continue
        # Snapshot cases of a short step last 40 of the state's device-to-host times.
        steps = (max(args.steps, math.ceil(40 * get / plain_runs[0]))
                 if args.short and plain_runs else args.steps)
        if args.kind == "in_graph":
            if name != "snap_paced":
                raise SystemExit("--kind in_graph runs plain and snap_paced")
            in_graph.snapshotter = Snapshotter()
            r = loop(name, True, in_graph.snapshotter, steps=steps)
            in_graph.snapshotter.join()
            r["paced"], r["skipped"] = in_graph.snapshotter.paced, in_graph.snapshotter.skipped
            in_graph.snapshotter.close()
            results[name] = r
            continue
        if name.startswith("snap"):
            ahead = {"snap_ahead_64m": 64 << 20, "snap_ahead_all": 1 << 40}.get(name)
            act, snap = snap_case(0.05 if name == "snap_paced" else 1.0, ahead)
            drop = snapshot._drop
            if name == "snap_free_at_once":
                def at_once(holder: list[Any], behind: Any = None) -> None:
                    holder.clear()
                snapshot._drop = at_once
            elif name == "snap_one_at_a_time":
                gap = snapshot.RELEASE_BYTES
                snapshot.RELEASE_BYTES = 1
            try:
                r = loop(name, act, snap, settle_after_dispatch=name == "snap_settle",
                         steps=steps)
                snap.join()
                snap.close()
            finally:
                snapshot._drop = drop
                if name == "snap_one_at_a_time":
                    snapshot.RELEASE_BYTES = gap
            r["paced"], r["skipped"] = snap.paced, snap.skipped
            r["copied_bytes"] = snap._copier.copied_bytes
            r["direct_bytes"] = snap._copier.direct_bytes
            del snap
        elif name == "copy_only":
            copier = device_copy.DeviceCopier(None, setting="probe")

            def copy_only(i: int, s: Any, copier: Any = copier) -> bool:
                c = copier.copy(jax.tree.leaves(s))
                return c is not None
            r = loop(name, copy_only)
        elif name == "fetch_fresh":
            fetched = [0]
            stop = [False]
            copier = device_copy.DeviceCopier(None, setting="probe")

            def spin(stop: list[bool] = stop, fetched: list[int] = fetched,
                     copier: Any = copier) -> None:
                while not stop[0] and fetched[0] < 1000:
                    c = copier.copy(jax.tree.leaves(state))
                    if c is not None:
                        host_copy.fetch([c.arrays[i] for i in sorted(c.owned)])
                    fetched[0] += 1
            pool = ThreadPool(1, "probe-fetch")
            pool.submit(spin)
            try:
                r = loop(name, None)
            finally:
                stop[0] = True
                pool.shutdown(wait=True)
            r["taken"] = fetched[0]
        else:
            raise SystemExit(f"unknown case {name}")
        results[name] = r
    plain = statistics.mean(plain_runs) if plain_runs else float("nan")
    out["plain_mean_s"] = round(plain, 5)
    for name, r in results.items():
        if "mean_s" not in r:
            continue
        r["mean_over_plain"] = round(r["mean_s"] / plain, 4)
        if r.get("taken") and not name.startswith("plain"):
            # What each snapshot (or fetch) cost the loop, over the state's get time.
            r["cost_each_over_get"] = round(
                max(0.0, (r["mean_s"] - plain) * r["steps"] / r["taken"]) / get, 4)
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
