"""Probe (not a benchmark): candidate ways to capture a training state on a full chip
(bench/model_step.py's model; docs/hosts.md keeps what it found).

Prints JSON lines to stdout. A model of L matmul layers (D x D float32) with an
Adam state, gradient accumulation over K microbatches, the loss fetched every
step; filler buffers take the chip to --fill of its memory at the step's peak.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import model_step
import numpy as np


def emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--klong", type=int, default=0, help="0: as many as the transfer needs")
    ap.add_argument("--fill", type=float, default=0.88)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--cases", default="all")
    a = ap.parse_args()
    dev = jax.devices()[0]
    emit(device=str(dev.device_kind), jax=jax.__version__, platform=dev.platform)
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    grads_of, update, init = model_step.model(a.layers, a.dim, a.batch)

    def fused(state: dict, key: jax.Array, K: int) -> tuple[dict, jax.Array]:
        g, lv = grads_of(state["params"], key, K)
        return update(state, g), lv

    fused_j = jax.jit(fused, donate_argnums=0, static_argnums=2)
    grad_j = jax.jit(grads_of, static_argnums=2)
    upd_j = jax.jit(update, donate_argnums=(0, 1))
    state = jax.block_until_ready(init(jax.random.key(0)))
    leaves = jax.tree.leaves(state)
    nbytes = sum(x.nbytes for x in leaves)
    emit(state_bytes=nbytes)

    def fresh_get() -> float:
        s2 = jax.block_until_ready(jax.tree.map(lambda x: x + 0, state))
        t0 = time.perf_counter()
        for x in jax.tree.leaves(s2):
            x.copy_to_host_async()
        jax.device_get(s2)
        return time.perf_counter() - t0

    def run_step(kind: str, st: dict, i: int, K: int) -> tuple[dict, float]:
        key = jax.random.key(i)
        if kind == "fused":
            st, lv = fused_j(st, key, K)
        else:
            g, lv = grad_j(st["params"], key, K)
            st = upd_j(st, g)
        return st, float(lv)

    # Step times and the peak.
    t_get = statistics.median([fresh_get() for _ in range(3)])
    emit(device_get_s=t_get)
    for kind in ("fused", "split"):
        for K in (1, 2):
            state, _ = run_step(kind, state, 0, K)
    t0 = time.perf_counter()
    state, _ = run_step("fused", state, 1, 1)
    t1 = time.perf_counter() - t0
    K = a.klong or max(2, int(np.ceil(1.2 * t_get / t1)))
    state, _ = run_step("fused", state, 1, K)
    state, _ = run_step("split", state, 1, K)
    stats = dev.memory_stats() or {}
    limit, peak = int(stats.get("bytes_limit", 0)), int(stats.get("peak_bytes_in_use", 0))
    emit(step1_s=t1, klong=K, bytes_limit=limit, peak=peak, in_use=stats.get("bytes_in_use"))

    # Captures.
    def cap_dput(st: dict, dst: Any) -> Any:
        return jax.device_put(jax.tree.leaves(st), [host] * len(jax.tree.leaves(st)),
                              may_alias=False)

    def copy_into(dst: list, src: list) -> list:
        return list(src)

    into_j = jax.jit(copy_into, donate_argnums=0,
                     out_shardings=[host] * len(leaves))

    def cap_donated(st: dict, dst: Any) -> Any:
        src = jax.tree.leaves(st)
        if dst is None:
            return jax.device_put(src, [host] * len(src), may_alias=False)
        return into_j(dst, src)

    copy_dev_j = jax.jit(lambda xs: [jnp.copy(x) for x in xs])

    def cap_devcopy(st: dict, dst: Any) -> Any:
        c = copy_dev_j(jax.tree.leaves(st))
        return jax.device_put(c, [host] * len(c), may_alias=False)

    caps = {"dput_host": cap_dput, "donated_host": cap_donated, "devcopy": cap_devcopy}

    # Standalone capture times (fresh state each).
    for name in ("dput_host", "donated_host"):
        ts = []
        dst = None
        for r in range(4):
            s2 = jax.block_until_ready(jax.tree.map(lambda x: x + 0, state))
            t0 = time.perf_counter()
            out = jax.block_until_ready(caps[name](s2, dst))
            ts.append(time.perf_counter() - t0)
            dst = out
            if name == "donated_host" and r == 3:
                emit(donated_reused=bool(len(out) and True),
                     same_value=bool(np.asarray(out[-1])[0, 0] == np.asarray(
                         jax.tree.leaves(s2)[-1])[0, 0]))
            del s2
        emit(case="standalone", capture=name, times=ts)
    del dst, out

    # copy_to_host_async then donate: can the host copy still be read?
    try:
        s2 = jax.block_until_ready(jax.tree.map(lambda x: x + 0, state))
        x0 = jax.tree.leaves(s2)[-1]
        shard = x0.addressable_shards[0].data
        want = float(jnp.sum(x0))
        x0.copy_to_host_async()
        shard.copy_to_host_async()
        s2, _ = run_step("fused", s2, 5, 1)
        res: dict[str, Any] = {}
        for nm, arr in (("array", x0), ("shard", shard)):
            try:
                res[nm] = float(np.asarray(arr).sum()) - want
            except Exception as e:  # noqa: BLE001
                res[nm] = repr(e)[:200]
        emit(case="async_then_donate", result=res)
        del s2, x0, shard
    except Exception as e:  # noqa: BLE001
        emit(case="async_then_donate", error=repr(e)[:300])

    # Filler to reach the fill at the step's peak.
    filler = []
    if a.fill > 0 and limit:
        want_free = int(limit * (1 - a.fill))
        extra = limit - peak - want_free
        chunk = 256 << 20
        while extra > 0:
            n = min(chunk, extra)
            filler.append(jax.device_put(np.zeros(n // 4, np.float32), dev))
            extra -= n
        jax.block_until_ready(filler)
    stats = dev.memory_stats() or {}
    emit(filler_bytes=sum(f.nbytes for f in filler), in_use=stats.get("bytes_in_use"),
         free_now=limit - int(stats.get("bytes_in_use", 0)))

    def loop(kind: str, Kx: int, cap: str | None, every: int, steps: int) -> dict:
        nonlocal state
        times, taken, ages = [], 0, []
        pending = None  # (handle, step, t_started, ref)
        dst = None
        checked = None
        for i in range(steps + 3):
            t0 = time.perf_counter()
            if pending is not None and all(x.is_ready() for x in pending[0]):
                taken += 1
                ages.append(time.perf_counter() - pending[2])
                dst = pending[0] if cap == "donated_host" else None
                if checked is None:
                    got = float(np.asarray(pending[0][1]).astype(np.float64).sum())
                    checked = abs(got - pending[3]) <= 1e-3 * max(1.0, abs(pending[3]))
                pending = None
            if cap is not None and i % every == 0 and pending is None:
                ref = float(jnp.sum(jax.tree.leaves(state)[1]).astype(jnp.float64)) \
                    if checked is None else 0.0
                h = caps[cap](state, dst)
                dst = None
                pending = (h, i, time.perf_counter(), ref)
            state, _ = run_step(kind, state, i, Kx)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        if pending is not None:
            jax.block_until_ready(pending[0])
            taken += 1
        return {"mean": statistics.mean(times), "median": statistics.median(times),
                "max": max(times), "taken": taken, "age_median": (
                    statistics.median(ages) if ages else None), "values_ok": checked}

    results = {}
    for Kx, label in ((K, "long"), (1, "short")):
        for kind in ("fused", "split"):
            plain = loop(kind, Kx, None, 1, a.steps)
            emit(case="loop", step=label, kind=kind, capture="plain", **plain)
            results[(label, kind, "plain")] = plain
            for cap in ("dput_host", "donated_host"):
                for every in (1,):
                    try:
                        got = loop(kind, Kx, cap, every, a.steps)
                    except Exception as e:  # noqa: BLE001
                        emit(case="loop", step=label, kind=kind, capture=cap,
                             error=repr(e)[:300])
                        continue
                    emit(case="loop", step=label, kind=kind, capture=cap, every=every,
                         over_plain=got["mean"] / plain["mean"],
                         age_over_get=(got["age_median"] or 0) / t_get, **got)
    return 0


if __name__ == "__main__":
    sys.exit(main())
