"""A real training step for bench/accelerator.py: what a save and a snapshot cost
a loop whose step is matmul layers with an Adam state, the loss fetched every
step, on a chip as full as a real job keeps it.

The model: ``layers`` dense layers of ``dim`` x ``dim`` float32 (tanh between),
Adam's moments and count beside them (written out: the same state optax's
``adam`` keeps), gradients accumulated over microbatches of ``batch`` rows
drawn on the device, so one step takes at least the state's device-to-host
time (as a real model's step over a real batch does). The step comes two ways:

- ``fused``: one jitted program that donates the state (most loops);
- ``split``: the gradient (reads the state), then the update (donates it): a
  save or snapshot called between the two reads the state while the device
  computes the gradient, so the update, not the loop, waits for what remains.

Other live buffers (``filler``) stand in for the rest of a real job's memory:
they take the chip to ``fill`` of its memory at the step's peak (``fill`` in the
output: (the step's peak + filler) / bytes_limit).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import log

import mtc
from mtc.elastic import InGraphStep, Snapshotter
from mtc.elastic.host_copy import numpy_serves
from mtc.save import device_copy

State = dict[str, Any]
# A snapshot case's length, in the state's device-to-host times (paced_steps).
PACED_WINDOW = 40
# The steps the cases run: ``fused`` (its plain loop always runs: the others'
# reference), ``split``, ``in_graph`` (``InGraphStep`` over the fused step). A job
# runs one; the process's peak is the largest of those that ran (--kinds).
KINDS = ("fused", "split", "in_graph")


def model(layers: int, dim: int, batch: int) -> tuple[Callable[..., Any], ...]:
    def loss_fn(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        h = x
        for i in range(layers):
            h = jnp.tanh(h @ params[f"w{i:02d}"])
        return jnp.mean(h * h)

    def grads(params: dict[str, jax.Array], key: jax.Array, k: int) -> Any:
        def body(carry: Any, kk: jax.Array) -> Any:
            g, total = carry
            x = jax.random.normal(kk, (batch, dim), jnp.float32)
            li, gi = jax.value_and_grad(loss_fn)(params, x)
            return (jax.tree.map(jnp.add, g, gi), total + li), None
        zero = jax.tree.map(jnp.zeros_like, params)
        (g, total), _ = jax.lax.scan(body, (zero, jnp.float32(0)), jax.random.split(key, k))
        return g, total / k

    def update(state: State, g: Any) -> State:
        t = state["count"] + 1
        m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["mu"], g)
        v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, state["nu"], g)
        p = jax.tree.map(lambda p, m, v: p - 1e-4 * m / (jnp.sqrt(v) + 1e-8),
                         state["params"], m, v)
        return {"params": p, "mu": m, "nu": v, "count": t}

    def init(key: jax.Array) -> State:
        ks = jax.random.split(key, 3 * layers)
        p = {f"w{i:02d}": jax.random.normal(ks[i], (dim, dim), jnp.float32) / math.sqrt(dim)
             for i in range(layers)}
        mu = {k: 1e-3 * jax.random.normal(ks[layers + i], v.shape, jnp.float32)
              for i, (k, v) in enumerate(p.items())}
        nu = {k: 1e-6 * jnp.abs(jax.random.normal(ks[2 * layers + i], v.shape, jnp.float32))
              for i, (k, v) in enumerate(p.items())}
        return {"params": p, "mu": mu, "nu": nu, "count": jnp.int32(0)}

    return grads, update, init


def snap_age(snap: Snapshotter) -> Callable[[], Any]:
    return lambda: snap.age


def _ready(x: Any) -> Any:
    return jax.block_until_ready(x)


def run(layers: int, dim: int, batch: int, fills: list[float | None], steps: int,
        root: Path, lengths: tuple[str, ...] = ("long", "short"),
        snapshot_every: tuple[int, ...] = (1, 20), kinds: tuple[str, ...] = KINDS
        ) -> dict[str, Any]:
    device = jax.devices()[0]
    grads, update, init = model(layers, dim, batch)

    def fused(s: State, key: jax.Array, k: int) -> tuple[State, jax.Array]:
        g, loss = grads(s["params"], key, k)
        return update(s, g), loss

    # A mesh of the one device (Orbax's Snapshotter wants named shardings).
    named = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([device]), ("data",)),
                                       jax.sharding.PartitionSpec())
    state = _ready(jax.device_put(init(jax.random.key(0)), named))
    shardings = jax.tree.map(lambda _: named, state)
    fused_j = jax.jit(fused, donate_argnums=0, static_argnums=2,
                      out_shardings=(shardings, named))
    grads_j = jax.jit(grads, static_argnums=2)
    update_j = jax.jit(update, donate_argnums=(0, 1), out_shardings=shardings)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))

    def device_get_s() -> float:
        fresh = _ready(jax.tree.map(lambda x: x + 0, state))
        t0 = time.perf_counter()
        for x in jax.tree.leaves(fresh):
            x.copy_to_host_async()
        jax.device_get(fresh)
        return time.perf_counter() - t0

    in_graph = InGraphStep(fused, Snapshotter(), state_shardings=shardings, static_argnums=2)

    def step(kind: str, s: State, i: int, k: int, between: Callable[[State], Any] | None
             ) -> State:
        key = jax.random.key(i)
        if kind == "in_graph":  # asked for a snapshot every step
            s, loss = in_graph(s, key, k, snapshot_step=i)
        elif kind == "fused":
            if between is not None:
                between(s)
            s, loss = fused_j(s, key, k)
        else:
            g, loss = grads_j(s["params"], key, k)
            if between is not None:
                between(s)  # reads the state while the device computes the gradient
            s = update_j(s, g)
        float(loss)  # the loop logs its loss every step
        return s

    # The split step is compiled and run only where its cases are: its peak (the
    # gradient held beside the state) is the job's from then on, and leaves the
    # fused step's copies no room on a full chip (2026-12-08).
    stepped = ("fused", "split") if "split" in kinds else ("fused",)
    for kind in stepped:
        for k in (1, 4):  # compiled
            state = step(kind, state, 0, k, None)
    took = {}
    for k in (1, 4):
        t0 = time.perf_counter()
        state = step("fused", state, 1, k, None)
        took[k] = time.perf_counter() - t0
    # A microbatch's own time (a step's fixed cost left out), so that the long
    # step outlasts the state's device-to-host time.
    # Where timing noise hides it (tiny models, CPU), the whole step's time is used.
    micro = (took[4] - took[1]) / 3 if took[4] > 1.5 * took[1] else took[1]
    get = statistics.median(device_get_s() for _ in range(3))
    k_long = min(256, max(2, math.ceil((1.2 * get - took[1]) / micro) + 1))
    for kind in stepped:
        state = step(kind, state, 2, k_long, None)
    stats = device.memory_stats() or {}
    limit = int(stats.get("bytes_limit", 0))
    peak = int(stats.get("peak_bytes_in_use", 0))
    out: dict[str, Any] = {
        "state_bytes": nbytes, "layers": layers, "dim": dim, "batch": batch, "kinds": list(kinds),
        "device_get_s": round(get, 6), "microbatch_step_s": round(micro, 6),
        "microbatches_long": k_long, "bytes_limit": limit, "step_peak_bytes": peak,
        # Where mtc's Snapshotter keeps its snapshots of this state (mtc.elastic.host_copy).
        "snapshot_host_copies": "numpy" if numpy_serves(jax.tree.leaves(state))
        else "pinned_host",
        "device_copy_headroom": device_copy.HEADROOM,
        "by_fill": {}}
    filler: list[jax.Array] = []
    for fill in fills:
        filler.clear()
        gc.collect()
        if fill is not None and limit:
            extra = int(fill * limit) - peak
            while extra > 0:
                n = min(256 << 20, extra)
                filler.append(jax.device_put(np.zeros(n // 4, np.float32), device))
                extra -= n
            _ready(filler)
        got_fill = (peak + sum(f.nbytes for f in filler)) / limit if limit else 0.0
        label = "room" if fill is None else f"fill_{fill:g}"
        log(f"model step, {label}: fill {got_fill:.3f}")
        cases, state = _cases(step, state, {"long": k_long, "short": 1}, lengths, steps,
                              root / label, get, in_graph, snapshot_every, kinds)
        out["by_fill"][label] = {"fill": round(got_fill, 3), **cases}
    filler.clear()
    return out


def _cases(step: Callable[..., State], state: State, microbatches: dict[str, int],
           lengths: tuple[str, ...], steps: int, root: Path, get: float,
           in_graph: InGraphStep, snapshot_every: tuple[int, ...], kinds: tuple[str, ...]
           ) -> tuple[dict[str, Any], State]:
    res: dict[str, Any] = {}
    for length in lengths:
        res[length], state = _one_length(step, state, length, microbatches[length], steps,
                                         root, get, in_graph, snapshot_every, kinds)
        log(f"  {length}: {res[length]}")
    return res, state


def _one_length(step: Callable[..., State], state: State, length: str, k: int, steps: int,
                root: Path, get: float, in_graph: InGraphStep,
                snapshot_every: tuple[int, ...], kinds: tuple[str, ...]
                ) -> tuple[dict[str, Any], State]:
    import orbax.checkpoint as ocp
    from orbax.checkpoint.experimental.v1.training.pathways import (
        Snapshotter as OrbaxSnapshotter,
    )

    times: dict[str, list[float]] = {}
    stalls: dict[str, list[float]] = {}
    ages: dict[str, list[float]] = {}
    taken: dict[str, int] = {}

    def loop(name: str, kind: str, n: int, act: Callable[[int, State], Any] | None,
             age_of: Callable[[], Any] | None = None) -> None:
        nonlocal state
        ts, st, ag = [], [], []
        for i in range(n + 2):
            t0 = time.perf_counter()

            def between(s: State, i: int = i) -> None:
                if act is not None:
                    t = time.perf_counter()
                    if act(i, s):
                        st.append(time.perf_counter() - t)
            state = step(kind, state, i, k, between)
            if i >= 2:
                ts.append(time.perf_counter() - t0)
                a = age_of() if age_of is not None else None
                if a is not None:
                    ag.append(a.seconds)
        times[name], stalls[name], ages[name], taken[name] = ts, st, ag, len(st)
        log(f"  {length} {name}: mean {statistics.mean(ts) * 1e3:.1f} ms")

    def paced_steps(kind: str) -> int:
        """Steps for a snapshot case: long enough for the pacing to settle (40 steps
        at least), and for a 5% budget to show over the case, not over one
        snapshot: at least PACED_WINDOW device-to-host times of the state (on a 30
        ms step, 42 steps held two snapshots of 0.36 s each in 1.3 s)."""
        step_s = statistics.mean(times[f"plain_{kind}"])
        return max(steps, 40, min(2000, math.ceil(PACED_WINDOW * get / max(step_s, 1e-6))))

    with mtc.CheckpointManager(root / f"mtc-{length}", options=mtc.Options(
            dispatch="local", max_to_keep=2)) as mgr:
        omgr = ocp.CheckpointManager(root / f"orbax-{length}",
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2))
        base = 10_000_000 * (length == "short")
        try:
            for kind in ("fused", "split"):
                if kind == "split" and kind not in kinds:
                    continue
                loop(f"plain_{kind}", kind, steps, None)  # in_graph's plain too
                if kind not in kinds:
                    continue
                loop(f"mtc_save_every_50_{kind}", kind, 50, lambda i, s: i % 50 == 1 and
                     mgr.save(base + 1000 * len(times) + i, s, force=True))
                mgr.wait_until_finished()
                loop(f"mtc_save_at_link_rate_{kind}", kind, steps, lambda i, s: (
                    not mgr.is_saving_in_progress()) and mgr.save(
                        base + 1000 * len(times) + i, s, force=True))
                mgr.wait_until_finished()
                # Long enough for the pacing to settle: 40 steps at least.
                for every in snapshot_every:
                    snap = Snapshotter()

                    def ask(i: int, s: State, snap: Snapshotter = snap,
                            every: int = every) -> bool:
                        return i % every == 0 and snap.save(i, s)

                    loop(f"mtc_snapshot_every_{'step' if every == 1 else every}_{kind}",
                         kind, paced_steps(kind), ask, snap_age(snap))
                    snap.join()
                    snap.close()
            if "fused" in kinds:
                loop("orbax_save_every_50_fused", "fused", 50, lambda i, s: i % 50 == 1 and
                     omgr.save(base + 1000 * len(times) + i, args=ocp.args.StandardSave(s),
                               force=True))
                omgr.wait_until_finished()
                theirs = OrbaxSnapshotter()
                loop("orbax_snapshot_every_step_fused", "fused", min(steps, 10),
                     lambda i, s: theirs.save(i, s))
                theirs.join()
            if "in_graph" in kinds:
                # Last: its outputs' shardings are the compiler's, not named ones. Both
                # its programs compiled first, on those shardings too, and a fresh
                # snapshotter for the case: a compile charged to a snapshot holds the
                # pacer off for twenty times the compile's time.
                for _ in range(2):
                    for i in range(2):
                        state = step("in_graph", state, i, k, None)
                    in_graph.snapshotter.join()
                in_graph.snapshotter.close()
                in_graph.snapshotter = Snapshotter()
                loop("mtc_in_graph_every_step_fused", "in_graph", paced_steps("fused"), None,
                     snap_age(in_graph.snapshotter))
                in_graph.snapshotter.join()
        finally:
            omgr.close()
    plain = {kind: statistics.mean(times[f"plain_{kind}"]) for kind in ("fused", "split")
             if f"plain_{kind}" in times}
    copier = mgr._dispatch.copier  # type: ignore[attr-defined]
    r: dict[str, Any] = {"step_s": {n: round(statistics.mean(v), 6)
                                    for n, v in times.items()},
                         "saves_or_snapshots_taken": {n: v for n, v in taken.items() if v},
                         # What the manager's saves copied in device memory and what
                         # they read from the state itself (all its saves here).
                         "save_copied_bytes": copier.copied_bytes,
                         "save_direct_bytes": copier.direct_bytes}
    for name, ts in times.items():
        kind = "split" if name.endswith("split") else "fused"  # in_graph: fused
        if not name.startswith("plain"):
            r[f"{name}_mean_over_plain"] = round(statistics.mean(ts) / plain[kind], 3)
        st = stalls[name]
        if st:
            # The call's own time: a manager's first save (compiles its copy, first
            # touches its staging memory) is reported apart; the median is of the rest.
            first = name == "mtc_save_every_50_fused"
            if first:
                r[f"{name}_first_stall_over_device_get"] = round(st[0] / get, 3)
            rest = st[1:] if first and len(st) > 1 else st
            r[f"{name}_stall_over_device_get"] = round(statistics.median(rest) / get, 3)
            # What the loop lost per save or snapshot, wherever it waited (the call,
            # or the next step waiting on the device for a transfer): its time over
            # the plain step's, per one taken.
            r[f"{name}_held_over_device_get"] = round(
                max(0.0, sum(ts) - len(ts) * plain[kind]) / len(st) / get, 3)
        if ages[name]:
            r[f"{name}_age_over_device_get"] = round(statistics.median(ages[name]) / get, 3)
    return r, state
