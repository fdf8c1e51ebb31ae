"""The recovery case: a restore onto the accelerator in a new process, against a
bare ``jax.device_put`` of the same bytes and Orbax's restore, in that process.

Two runs, one after the other (one program holds the chip at a time)::

    python bench/restore_fresh.py save DIR [--gib 1]   # mtc (both dispatches) and Orbax
    python bench/restore_fresh.py restore DIR          # a new process: prints JSON

``save`` writes a random-valued state of 16 float32 leaves with mtc (local and
colocated dispatch) and Orbax into DIR (on the RAM disk) and the leaves' sums;
``restore`` restores each once (the first restore of a new process is the one
recovery waits for), checks the sums, then times ``jax.device_put`` of host
copies of the same leaves, and Orbax's restore.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import logging
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mtc

LEAVES = 16
DISPATCHES = ("local", "colocated")


def _sharding() -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def save(root: Path, gib: float) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    n = max(1024, int(gib * (1 << 30)) // LEAVES // 4)
    s = _sharding()
    state = {f"w{i:02d}": jax.device_put(jax.random.normal(jax.random.key(i), (n,)), s)
             for i in range(LEAVES)}
    sums = {k: float(jnp.sum(v.astype(jnp.float32))) for k, v in state.items()}
    for d in DISPATCHES:
        with mtc.CheckpointManager(root / d, options=mtc.Options(dispatch=d)) as mgr:  # type: ignore[arg-type]
            mgr.save(1, state, force=True)
            mgr.wait_until_finished()
    omgr = ocp.CheckpointManager(root / "orbax")
    omgr.save(1, args=ocp.args.StandardSave(state))
    omgr.wait_until_finished()
    omgr.close()
    meta = {"n": n, "sums": sums}
    (root / "meta.json").write_text(json.dumps(meta))
    return meta


def restore(root: Path, dispatches: tuple[str, ...] = DISPATCHES,
            profile: Path | None = None) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    meta = json.loads((root / "meta.json").read_text())
    s = _sharding()
    abstract = {f"w{i:02d}": jax.ShapeDtypeStruct((meta["n"],), jnp.float32, sharding=s)
                for i in range(LEAVES)}
    out: dict[str, Any] = {"date": datetime.date.today().isoformat(),
                           "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
                           "path": "a new process, one device; the RAM disk is /dev/shm",
                           "bytes": 4 * meta["n"] * LEAVES}
    seconds: dict[str, float] = {}
    host = None
    for d in dispatches:
        with mtc.CheckpointManager(root / d, options=mtc.Options(dispatch=d)) as mgr:  # type: ignore[arg-type]
            prof = cProfile.Profile() if profile is not None else None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            got = jax.block_until_ready(mgr.restore(1, abstract))
            seconds[d] = time.perf_counter() - t0
            if prof is not None and profile is not None:
                prof.disable()
                text = io.StringIO()
                stats = pstats.Stats(prof, stream=text)
                stats.sort_stats("cumulative").print_stats(40)
                stats.sort_stats("tottime").print_stats(25)
                profile.write_text(text.getvalue())
        for k, v in got.items():
            if abs(float(jnp.sum(v)) - meta["sums"][k]) > 1e-3 * max(1.0, abs(meta["sums"][k])):
                raise AssertionError(f"{d}: leaf {k} restored other values")
        if host is None:
            host = {k: np.array(v) for k, v in got.items()}  # fresh host copies
        del got
    assert host is not None
    puts = []
    for _ in range(3):
        t0 = time.perf_counter()
        put = jax.block_until_ready(jax.device_put(host, {k: s for k in host}))
        puts.append(time.perf_counter() - t0)
        del put
    seconds["device_put"] = sorted(puts)[1]
    omgr = ocp.CheckpointManager(root / "orbax")
    t0 = time.perf_counter()
    jax.block_until_ready(omgr.restore(1, args=ocp.args.StandardRestore(abstract)))
    seconds["orbax"] = time.perf_counter() - t0
    omgr.close()
    out["seconds"] = {k: round(v, 4) for k, v in seconds.items()}
    for d in dispatches:
        out[f"restore_new_process_over_device_put_{d}"] = round(
            seconds[d] / seconds["device_put"], 3)
        out[f"restore_new_process_over_orbax_{d}"] = round(seconds[d] / seconds["orbax"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("phase", choices=["save", "restore"])
    p.add_argument("dir", type=Path)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--dispatch", choices=DISPATCHES, nargs="+", default=list(DISPATCHES),
                   help="restore: whose restore is timed (one a process: the first)")
    p.add_argument("--profile", type=Path, default=None,
                   help="restore: write the timed restore's profile (cProfile, text) here")
    p.add_argument("--read-threads", type=int, default=None,
                   help="restore: threads reading and verifying shards (default: "
                        "mtc.sidecar.restore.load.READ_THREADS)")
    a = p.parse_args(argv)
    if a.read_threads is not None:
        from mtc.sidecar.restore import load

        load.READ_THREADS = a.read_threads
    logging.getLogger("absl").setLevel(logging.ERROR)
    a.dir.mkdir(parents=True, exist_ok=True)
    got = save(a.dir, a.gib) if a.phase == "save" else restore(a.dir, tuple(a.dispatch), a.profile)
    if a.phase == "restore":
        from mtc.sidecar.restore import load

        got["read_threads"] = load.READ_THREADS
    print(json.dumps(got if a.phase == "restore" else {"saved": str(a.dir)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
