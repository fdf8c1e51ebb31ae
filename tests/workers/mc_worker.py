"""One process of a multi-controller JAX job, driven by tests/test_multicontroller.py.

Each process is one host: it joins the job through ``jax.distributed.initialize``
on localhost, builds a mesh over every device of every process, and exercises
``mtc.CheckpointManager``. Phases:

- ``train``: save steps 1 and 2, check the inventory and the on-disk layout,
  restore step 2 (and 1) onto the saved sharding and onto other shardings;
- ``restart``: a fresh job on the same ``local_dir`` restores ``latest_step()``
  into targets built from ``jax.ShapeDtypeStruct``, then saves step 3;
- ``partial``: the last host has lost step 3 (the test deleted it): every
  process must agree that step 2 is the newest complete step, and restore it;
- ``skew``: with ``max_to_keep=None`` (a replicator owns cleanup), process 0
  runs a few seconds behind the others; ``save``, ``wait_until_finished`` and
  ``restore`` of that step must still work on every process;
- ``shrink``: a restart on fewer processes than saved (a smaller job on the
  same shared ``local_dir``) restores step 2 from every saved host folder.

Checks never stop at the first mismatch and never skip a collective (so every
process stays in step); mismatches are collected and printed, with what was
run, as one JSON line prefixed by ``MC_RESULT``. An exception from mtc exits
non-zero with its traceback on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROWS, COLS = 16, 8
# Shards of a page multiple: restoring onto fewer row shards maps saved files side by side.
EMB = (64, 1024)
RESULT_PREFIX = "MC_RESULT "


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", required=True,
                   choices=["train", "restart", "partial", "skew", "shrink"])
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--local-dir", required=True)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    import jax

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=60)
    try:
        worker = Worker(args)
        t0 = time.perf_counter()
        getattr(worker, args.phase)()
        worker.summary["seconds"] = round(time.perf_counter() - t0, 3)
        print(RESULT_PREFIX + json.dumps(worker.summary), flush=True)
    except BaseException:  # noqa: BLE001 - reported on stderr, then a non-zero exit
        traceback.print_exc()
        sys.stderr.flush()
        # A collective would now hang or abort in the peers: leave without the
        # distributed shutdown barrier, the test kills whoever is left.
        os._exit(1)
    jax.distributed.shutdown()
    return 0


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


class Worker:
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
    def expected(step: int) -> dict[str, Any]:
        """Host (numpy) values of the state saved at ``step``; differ per step."""
        import jax
        import numpy as np

        return {
            "w": (np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
                  + np.float32(1000 * step)),
            "b": np.arange(COLS, dtype=np.int32) * np.int32(step) - 3,
            "emb": (np.arange(EMB[0] * EMB[1], dtype=np.float32).reshape(EMB)
                    - np.float32(7 * step)),
            "key": np.asarray(jax.random.key_data(jax.random.key(step))),
            "counts": np.arange(6, dtype=np.int64) * step,
            "step": 10 * step,
            "data": {"global_next_index": 4 * step + 1},  # 5 at step 1, 9 at step 2
        }

    def state(self, step: int) -> dict[str, Any]:
        import jax

        exp = self.expected(step)
        sh = self.shardings("saved")
        w = jax.make_array_from_callback(exp["w"].shape, sh["w"], lambda idx: exp["w"][idx])
        b = jax.make_array_from_callback(exp["b"].shape, sh["b"], lambda idx: exp["b"][idx])
        emb = jax.make_array_from_callback(EMB, sh["emb"], lambda idx: exp["emb"][idx])
        key = jax.jit(lambda: jax.random.key(step), out_shardings=sh["key"])()
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

    def check_restored(self, label: str, got: Any, step: int, kind: str) -> None:
        """Check a restored state; ``got`` is None when the restore raised (reported)."""
        import jax
        import numpy as np
        from jax.experimental import multihost_utils

        exp = self.expected(step)
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
        """This process wrote exactly its own shards, under host-<process_index>/<step>/."""
        from mtc.manifest import MANIFEST_NAME, Manifest

        root = Path(self.args.local_dir) / f"host-{self.pid}" / str(step)
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

    # -- phases --------------------------------------------------------------

    def manager(self) -> Any:
        import mtc

        return mtc.CheckpointManager(self.args.local_dir, mesh=self.mesh,
                                     options=mtc.Options(max_to_keep=2))

    def train(self) -> None:
        import jax
        import numpy as np

        mgr = self.manager()
        try:
            self.check(mgr.topology.local_hosts == (self.pid,),
                       f"local hosts {mgr.topology.local_hosts}")
            self.check(mgr.all_steps() == [] and mgr.latest_step() is None,
                       f"fresh dir: steps {mgr.all_steps()}")
            s1 = self.state(1)
            self.check(mgr.save(1, s1) is True, "save(1) returned False")
            s2 = self.state(2)
            self.check(mgr.save(2, s2) is True, "save(2) returned False")
            mgr.wait_until_finished()
            steps = mgr.all_steps()
            self.summary["all_steps"] = steps
            self.check(steps == [1, 2], f"all_steps() {steps}, wanted [1, 2]")
            self.check(mgr.latest_step() == 2, f"latest_step() {mgr.latest_step()}")
            for step in (1, 2):
                self.check_layout(step)

            # Same sharding, the live step-1 arrays as target: values must come
            # from the checkpoint, not from the target.
            got = mgr.restore(2, target=s1)
            self.check_restored("step 2 onto saved sharding", got, 2, "saved")
            for kind in ("cols", "replicated", "mesh2d"):
                got = mgr.restore(2, target=self.target_from_structs(kind))
                self.check_restored(f"step 2 onto {kind}", got, 2, kind)
            got = mgr.restore(1, target=self.target_from_structs("saved"))
            self.check_restored("step 1 onto saved sharding", got, 1, "saved")

            # Without a target: whole numpy arrays, assembled from every host's files.
            raw = mgr.restore(2)
            exp = self.expected(2)
            for label, value, want in (("w", raw["params"]["w"], exp["w"]),
                                       ("b", raw["params"]["b"], exp["b"]),
                                       ("emb", raw["params"]["emb"], exp["emb"]),
                                       ("counts", raw["counts"], exp["counts"])):
                self.check(isinstance(value, np.ndarray) and np.array_equal(value, want),
                           f"untargeted restore {label}: {describe(value, want)}")
            self.check(raw["step"] == 20 and raw["data"] == exp["data"],
                       f"untargeted restore values: {raw['step']!r} {raw['data']!r}")
            rng = raw["rng"]
            self.check(np.array_equal(np.asarray(jax.random.key_data(rng)), exp["key"]),
                       f"untargeted restore rng: {rng!r}")
        finally:
            mgr.close()

    def restart(self) -> None:
        mgr = self.manager()
        try:
            steps = mgr.all_steps()
            latest = mgr.latest_step()
            self.summary["all_steps"] = steps
            self.summary["latest_step"] = latest
            self.check(steps == [1, 2], f"after restart all_steps() {steps}, wanted [1, 2]")
            self.check(latest == 2, f"after restart latest_step() {latest}, wanted 2")
            step = latest if latest is not None else 2
            got = mgr.restore(step, target=self.target_from_structs("saved"))
            self.check_restored("restart onto saved sharding", got, 2, "saved")
            got = mgr.restore(step, target=self.target_from_structs("cols"))
            self.check_restored("restart onto cols", got, 2, "cols")

            # Training goes on: save the next step; retention keeps the newest two.
            self.check(mgr.save(3, self.state(3)) is True, "save(3) returned False")
            mgr.wait_until_finished()
            steps = mgr.all_steps()
            self.check(steps == [2, 3], f"after save(3) all_steps() {steps}, wanted [2, 3]")
            self.check_layout(3)
            got = mgr.restore(3, target=self.target_from_structs("mesh2d"))
            self.check_restored("step 3 onto mesh2d", got, 3, "mesh2d")
        finally:
            mgr.close()

    def partial(self) -> None:
        import mtc

        mgr = self.manager()
        try:
            steps = mgr.all_steps()
            latest = mgr.latest_step()
            self.summary["all_steps"] = steps
            self.summary["latest_step"] = latest
            self.check(steps == [2], f"step 3 is missing on host {self.nproc - 1}: "
                                     f"all_steps() {steps}, wanted [2] on every process")
            self.check(latest == 2, f"latest_step() {latest}, wanted 2 on every process")
            got = mgr.restore(2, target=self.target_from_structs("replicated"))
            self.check_restored("step 2 onto replicated after losing step 3", got, 2,
                                "replicated")
            try:
                mgr.restore(3, target=self.target_from_structs("saved"))
                self.check(False, "restore(3) succeeded although host "
                                  f"{self.nproc - 1} has no step 3")
            except mtc.StepNotFoundError:
                self.check(True, "")
            # Step 3 of the other hosts is kept: it is not this process's to drop.
            mine = Path(self.args.local_dir) / f"host-{self.pid}"
            self.check((mine / "3").is_dir() == (self.pid != self.nproc - 1),
                       f"{mine}: {sorted(p.name for p in mine.iterdir())}")
        finally:
            mgr.close()

    def skew(self) -> None:
        import mtc

        lag_s = 2.0
        mgr = mtc.CheckpointManager(self.args.local_dir, mesh=self.mesh,
                                    options=mtc.Options(max_to_keep=None))
        try:
            state = self.state(1)
            if self.pid == 0:
                time.sleep(lag_s)  # a slow host: its peers run ahead
            self.check(mgr.save(1, state) is True, "save(1) returned False")
            mgr.wait_until_finished()
            got = None
            try:
                got = mgr.restore(1, target=self.target_from_structs("saved"))
            except mtc.MtcError as e:
                self.check(False, (
                    f"restore(1) right after save(1) and wait_until_finished() failed on a "
                    f"process that ran {lag_s:.0f} s ahead of process 0: {e!r}. With "
                    f"max_to_keep=None nothing in save/wait_until_finished/restore "
                    f"synchronizes the processes, so this process read host-0's folder "
                    f"before process 0 had committed step 1"))
            self.check_restored("step 1 restored right after saving", got, 1, "saved")
            steps = mgr.all_steps()
            self.summary["all_steps"] = steps
            self.check(steps == [1], f"all_steps() {steps}, wanted [1]")
        finally:
            mgr.close()

    def shrink(self) -> None:
        import mtc

        saved_hosts = sorted(p.name for p in Path(self.args.local_dir).iterdir())
        self.summary["saved_hosts"] = saved_hosts
        mgr = self.manager()
        try:
            latest = mgr.latest_step()
            self.summary["latest_step"] = latest
            self.check(latest == 2, f"latest_step() {latest}, wanted 2")
            for kind in ("saved", "cols"):
                got = None
                try:
                    got = mgr.restore(2, target=self.target_from_structs(kind))
                except mtc.MtcError as e:
                    self.check(False, (
                        f"restore(2) onto {kind} with {self.nproc} process(es) of a job saved "
                        f"by {len(saved_hosts)} hosts ({saved_hosts} all under "
                        f"{self.args.local_dir}) failed: {e!r}. CheckpointManager.restore only "
                        f"reads host folders 0..{self.nproc - 1} (range(topology.num_hosts)), "
                        f"so shards saved by the other hosts are never considered"))
                self.check_restored(f"step 2 onto {kind} on fewer processes", got, 2, kind)
        finally:
            mgr.close()


if __name__ == "__main__":
    sys.exit(main())
