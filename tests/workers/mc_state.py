"""What a process of the multi-controller test job saves and how it checks what it
restored (``mc_worker.py``'s :class:`~mc_worker.Worker` and the workers built on
it): the process's meshes, the state of each step (its values in numpy, its
``jax.Array`` leaves, restore targets of ``jax.ShapeDtypeStruct`` leaves on each
layout), and checks of a restored state, shard by shard, and of the files a
process wrote. Checks never stop at the first mismatch and never skip a
collective; mismatches are collected in ``summary["errors"]``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ROWS, COLS = 16, 8
# Shards of a page multiple: restoring onto fewer row shards maps saved files side by side.
EMB = (64, 1024)


def describe(got: Any, want: Any) -> str:
    """How ``got`` differs from the numpy array ``want``, briefly."""
    import numpy as np

    if not isinstance(got, np.ndarray):
        return f"got {type(got).__name__} {got!r:.200}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {got.shape} {got.dtype}, wanted {want.shape} {want.dtype}"
    bad = np.argwhere(got != want)
    first = tuple(int(i) for i in bad[0]) if len(bad) else ()
    opts = {"threshold": 20, "edgeitems": 3}
    return (f"{len(bad)} of {got.size} elements differ, first at {first}: "
            f"got {got[first]!r}, wanted {want[first]!r}; got "
            f"{np.array2string(got, **opts)}, wanted {np.array2string(want, **opts)}")


class MeshState:
    """A process's meshes, its state at each step, and the checks of what it restored."""

    def __init__(self, args: argparse.Namespace) -> None:
        import jax
        import numpy as np
        from jax.sharding import Mesh

        self.args = args
        self.pid = jax.process_index()
        self.nproc = jax.process_count()
        self.devices = sorted(jax.devices(), key=lambda d: d.id)
        self.mesh = Mesh(np.array(self.devices), ("x",))
        # The same devices in another order and shape: every process's
        # devices need rows that another process saved.
        self.mesh2d = Mesh(np.array(self.devices[::-1]).reshape(2, -1), ("a", "b"))
        self.errors: list[str] = []
        self.summary: dict[str, Any] = {
            "process_index": self.pid, "process_count": self.nproc,
            "num_devices": len(self.devices),
            "local_devices": [d.id for d in jax.local_devices()], "checks": 0,
            "errors": self.errors,
        }

    # -- the state -----------------------------------------------------------

    def shardings(self, kind: str) -> dict[str, Any]:
        """Shardings of the array leaves: as saved, or one of the restore layouts."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        m, m2 = self.mesh, self.mesh2d
        if kind == "saved":
            return {"w": NamedSharding(m, P("x")), "b": NamedSharding(m, P()),
                    "emb": NamedSharding(m, P("x")), "key": NamedSharding(m, P())}
        if kind == "cols":  # along the other axis; the replicated leaf sharded
            return {"w": NamedSharding(m, P(None, "x")), "b": NamedSharding(m, P("x")),
                    "emb": NamedSharding(m, P(None, "x")), "key": NamedSharding(m, P())}
        if kind == "replicated":
            return {"w": NamedSharding(m, P()), "b": NamedSharding(m, P()),
                    "emb": NamedSharding(m, P()), "key": NamedSharding(m, P())}
        if kind == "mesh2d":  # 2-D mesh, devices reversed, both axes split
            return {"w": NamedSharding(m2, P("b", "a")), "b": NamedSharding(m2, P("a")),
                    "emb": NamedSharding(m2, P("a")), "key": NamedSharding(m2, P())}
        raise ValueError(kind)

    @staticmethod
    def expected(step: int, seed: int = 0) -> dict[str, Any]:
        """Host (numpy) values of the state saved at ``step``; differ per step, and
        per ``seed`` (another run's data under the same step number) in every leaf."""
        import jax
        import numpy as np

        return {
            "w": (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
                  + np.float32(1000 * step + 100_000 * seed)),
            "b": np.arange(COLS, dtype=np.int32) * np.int32(step) - 3 + np.int32(500 * seed),
            "emb": (np.arange(EMB[0] * EMB[1], dtype=np.float32).reshape(EMB)
                    - np.float32(7 * step + 3 * seed)),
            "key": np.asarray(jax.random.key_data(jax.random.key(step + 7919 * seed))),
            "counts": np.arange(6, dtype=np.int64) * step + seed,
            "step": 10 * step,
            "data": {"global_next_index": 4 * step + 1},  # 5 at step 1, 9 at step 2
        }

    def state(self, step: int, seed: int = 0) -> dict[str, Any]:
        import jax

        exp = self.expected(step, seed)
        sh = self.shardings("saved")
        w = jax.make_array_from_callback(exp["w"].shape, sh["w"], lambda idx: exp["w"][idx])
        b = jax.make_array_from_callback(exp["b"].shape, sh["b"], lambda idx: exp["b"][idx])
        emb = jax.make_array_from_callback(EMB, sh["emb"], lambda idx: exp["emb"][idx])
        key = jax.jit(lambda: jax.random.key(step + 7919 * seed), out_shardings=sh["key"])()
        return {"params": {"w": w, "b": b, "emb": emb}, "rng": key, "counts": exp["counts"],
                "step": exp["step"], "data": dict(exp["data"])}

    def target_from_structs(self, kind: str) -> dict[str, Any]:
        """A restore target of ``jax.ShapeDtypeStruct`` leaves with ``kind`` shardings."""
        import jax
        import numpy as np

        sh = self.shardings(kind)
        key_dtype = jax.eval_shape(lambda: jax.random.key(0)).dtype
        return {
            "params": {"w": jax.ShapeDtypeStruct((ROWS, COLS), np.float32, sharding=sh["w"]),
                       "b": jax.ShapeDtypeStruct((COLS,), np.int32, sharding=sh["b"]),
                       "emb": jax.ShapeDtypeStruct(EMB, np.float32, sharding=sh["emb"])},
            "rng": jax.ShapeDtypeStruct((), key_dtype, sharding=sh["key"]),
            "counts": np.zeros(6, np.int64),
            "step": 0,
            "data": {"global_next_index": 0},
        }

    # -- checks --------------------------------------------------------------

    def check(self, ok: bool, what: str) -> None:
        self.summary["checks"] += 1
        if not ok:
            self.errors.append(f"process {self.pid}: {what}")

    def check_array(self, label: str, got: Any, want: Any, sharding: Any, gather: bool) -> None:
        """Every addressable shard, and (``gather``) the gathered global array, equal
        ``want`` exactly. ``gather`` must be the same on every process (a collective)."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        if not isinstance(got, jax.Array):
            self.check(False, f"{label}: expected a jax.Array, got {type(got).__name__}")
            return
        typed_key = jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
        if typed_key:
            self.check(str(jax.random.key_impl(got)) == str(jax.random.key_impl(
                jax.random.key(0))), f"{label}: key impl {jax.random.key_impl(got)}")
            data = jax.random.key_data(got)
        else:
            data = got
        self.check(got.sharding.is_equivalent_to(sharding, got.ndim),
                   f"{label}: sharding {got.sharding}, wanted {sharding}")
        self.check(data.shape == want.shape and data.dtype == want.dtype,
                   f"{label}: {data.shape} {data.dtype}, wanted {want.shape} {want.dtype}")
        mine = {d.id for d in sharding.addressable_devices}
        self.check({s.device.id for s in data.addressable_shards} == mine,
                   f"{label}: shards on devices {[s.device.id for s in data.addressable_shards]}"
                   f", wanted {sorted(mine)}")
        for s in data.addressable_shards:
            local = np.asarray(s.data)
            ref = want[s.index]
            self.check(local.shape == ref.shape and np.array_equal(local, ref),
                       f"{label}: shard {s.index} on device {s.device.id}: {describe(local, ref)}")
        if not gather:
            return
        whole = np.asarray(multihost_utils.process_allgather(data, tiled=True))
        self.check(whole.shape == want.shape and np.array_equal(whole, want),
                   f"{label}: gathered array: {describe(whole, want)}")

    def check_restored(self, label: str, got: Any, step: int, kind: str,
                       seed: int = 0) -> None:
        """Check a restored state; ``got`` is None when the restore raised (reported)."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        exp = self.expected(step, seed)
        sh = self.shardings(kind)
        try:
            arrays = [got["params"]["w"], got["params"]["b"], got["params"]["emb"], got["rng"]]
        except (TypeError, KeyError):
            arrays = []
        complete = len(arrays) == 4 and all(isinstance(a, jax.Array) for a in arrays)
        # Gather the global arrays only if every process has them (else the
        # collectives would not match up); decided by one collective everywhere.
        flags = multihost_utils.process_allgather(np.array([complete], dtype=np.int32))
        gather = bool(np.all(np.asarray(flags)))
        if got is None:
            return
        self.check(isinstance(got, dict) and set(got) == {"params", "rng", "counts", "step",
                                                          "data"},
                   f"{label}: restored tree {type(got).__name__} "
                   f"{sorted(got) if isinstance(got, dict) else ''}")
        if len(arrays) != 4:
            self.check(False, f"{label}: restored tree lacks array leaves: {got!r:.300}")
            return
        for name, value, want in zip(("w", "b", "emb", "key"), arrays,
                                     (exp["w"], exp["b"], exp["emb"], exp["key"]), strict=True):
            # Per-shard checks cover every leaf; gathering (a compile each) only ``w``.
            self.check_array(f"{label} {name}", value, want, sh[name], gather and name == "w")
        counts = got["counts"]
        self.check(isinstance(counts, np.ndarray) and counts.dtype == np.int64
                   and np.array_equal(counts, exp["counts"]),
                   f"{label} counts: {counts!r}, wanted {exp['counts']!r}")
        self.check(type(got["step"]) is int and got["step"] == exp["step"],
                   f"{label} step: {got['step']!r}, wanted {exp['step']!r}")
        self.check(got["data"] == exp["data"]
                   and type(got["data"]["global_next_index"]) is int,
                   f"{label} data: {got['data']!r}, wanted {exp['data']!r}")

    def check_layout(self, step: int) -> None:
        """This process wrote exactly its own shards, under <its RAM disk>/<step>/."""
        from mtc.manifest import MANIFEST_NAME, Manifest

        root = Path(self.args.local_dir) / str(step)
        path = root / MANIFEST_NAME
        if not path.is_file():
            self.check(False, f"no manifest at {path}")
            return
        m = Manifest.from_bytes(path.read_bytes())
        self.check(m.step == step and m.host == self.pid and m.num_hosts == self.nproc,
                   f"manifest of {root}: step {m.step} host {m.host} num_hosts {m.num_hosts}")
        by_path = {leaf.path: leaf for leaf in m.leaves}
        w = by_path.get("['params']['w']")
        if w is None:
            self.check(False, f"manifest of {root} has no params.w leaf: {sorted(by_path)}")
            return
        rows = ROWS // len(self.devices)
        local = sorted(d.id for d in self.devices if d.process_index == self.pid)
        pos = {d.id: i for i, d in enumerate(self.devices)}
        want = sorted(((pos[d] * rows, (pos[d] + 1) * rows), (0, COLS)) for d in local)
        got = sorted(s.index for s in w.shards)
        self.check(got == want, f"host {self.pid} saved w shards {got}, wanted {want}")
        for s in w.shards:
            f = root / s.file
            self.check(f.is_file() and f.stat().st_size == s.nbytes,
                       f"shard file {f} missing or of the wrong size")
        # A replicated leaf: written once per host, whole.
        b = by_path["['params']['b']"]
        self.check([s.index for s in b.shards] == [((0, COLS),)],
                   f"host {self.pid} saved b shards {[s.index for s in b.shards]}")
