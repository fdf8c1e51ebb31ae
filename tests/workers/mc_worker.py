"""One process of a multi-controller JAX job, driven by tests/test_multicontroller.py.

Each process is one host, alone with its RAM disk (``--local-dir``: its host's
private tmpfs, or a private folder without root); it joins the job through
``jax.distributed.initialize`` at the coordinator's address (host 0's, over the
bridge), builds a mesh over every device of every process, and exercises
``mtc.CheckpointManager``. Regions a process does not hold come from the
replicators (``--replicators``), never from another host's RAM disk. Phases:

- ``train``: save steps 1 and 2, check the inventory and the on-disk layout,
  restore step 2 (and 1) onto the saved sharding and onto other shardings;
- ``restart``: a fresh job restores ``latest_step()`` (agreed by the
  replicators) into targets built from ``jax.ShapeDtypeStruct``, then saves step 3;
- ``replaced``: the last host was replaced empty: its RAM disk holds nothing, so
  no step is on every host's; ``restore(3)`` reads its regions from its peer's
  copy through the replicators; ``latest_step()`` has its replicator bring step 3
  back from its peer, and every layout restores;
- ``shrink``: a job of fewer processes than saved has the replicators of its
  own hosts agree on step 3 (its membership, stated by the manager, is its own
  hosts); the regions of hosts no longer in the job come from their peer copies,
  through the replicators of the hosts left; it then saves step 4;
- ``shrunk``: that smaller job restarts: its replicators agree on step 4, which
  only its own hosts saved;
- ``skew``: with ``max_to_keep=None`` and no replicators, process 0 runs a few
  seconds behind the others; ``save``, ``wait_until_finished`` and ``restore``
  of that step must still work on every process; a layout needing another
  host's regions fails with ShardUnavailableError (no network tier to get them);
- ``rollback``: no replicators; save 1, 2, 3, ``latest_step()``, save 4, then
  restore 3 (the step ``latest_step`` answered), then again from a reopened
  manager: every step stays (a step every host committed is never fenced off).

Checks never stop at the first mismatch and never skip a collective (so every
process stays in step); mismatches are collected and printed, with what was
run, as one JSON line prefixed by ``MC_RESULT``. An exception from mtc exits
non-zero with its traceback on stderr. The state and its checks are
``mc_state.py``'s (imported by plain name: this folder is the script's sys.path[0]).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mc_state import MeshState, describe

RESULT_PREFIX = "MC_RESULT "


def parse_args(phases: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", required=True, choices=list(phases))
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--coordinator", required=True, help="HOST:PORT of process 0")
    p.add_argument("--local-dir", required=True, help="this host's RAM disk")
    p.add_argument("--replicators", default="", help="every host's replicator, in order")
    p.add_argument("--token-file", help="the replicators' shared token")
    p.add_argument("--hosts-per-slice", type=int, default=1)
    p.add_argument("--replicator-ranks", default="",
                   help="each process's host's replicator rank (default: its process index)")
    p.add_argument("--steps", default="", help="the steps a phase saves or expects")
    return p.parse_args()


def main(worker_class: type[Worker] | None = None) -> int:
    """Run one phase of ``worker_class`` (a :class:`Worker` with more phases, or this one)."""
    cls = worker_class or Worker
    args = parse_args(cls.PHASES)
    import jax

    if args.phase in cls.RECOVERABLE:  # a process of the job dies: the others live on
        jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=60)
    try:
        worker = cls(args)
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


class Worker(MeshState):
    PHASES: tuple[str, ...] = ("train", "restart", "replaced", "shrink", "shrunk", "skew",
                               "rollback")
    RECOVERABLE: tuple[str, ...] = ()  # phases in which a process dies on purpose

    # -- phases --------------------------------------------------------------

    def manager(self, *, max_to_keep: int | None = 2, replicators: bool = True) -> Any:
        import mtc

        addrs = tuple(a for a in self.args.replicators.split(",") if a) if replicators else ()
        token = Path(self.args.token_file).read_text().strip() if self.args.token_file else None
        ranks = tuple(int(r) for r in self.args.replicator_ranks.split(",") if r)
        # The layout is the default one: one process per host, its steps at the root
        # of its RAM disk, where its replicator looks.
        return mtc.CheckpointManager(self.args.local_dir, mesh=self.mesh, options=mtc.Options(
            max_to_keep=max_to_keep, hosts_per_slice=self.args.hosts_per_slice,
            replicators=addrs or None, replicator_ranks=ranks if addrs and ranks else None,
            replicator_token=token if addrs else None, restore_timeout_s=60.0))

    def fetched(self, mgr: Any) -> None:
        """Bytes of other hosts' files that reached this host over the network tier."""
        peers = getattr(mgr._dispatch, "peers", None)
        self.summary["fetched_bytes"] = int(peers.fetched_bytes) if peers is not None else 0
        self.summary["fetched_files"] = sorted({f for _, _, f in peers.fetched}) if peers else []
        self.summary["fetched_from"] = sorted({o for _, o, _ in peers.fetched}) if peers else []

    def restore_checked(self, label: str, mgr: Any, step: int, kind: str,
                        seed: int = 0) -> None:
        import mtc

        got = None
        try:
            got = mgr.restore(step, target=self.target_from_structs(kind))
        except mtc.MtcError as e:
            self.check(False, f"{label}: restore({step}) onto {kind} failed: {e!r}")
        self.check_restored(label, got, step, kind, seed)

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
            for step in (1, 2):
                self.check_layout(step)
            self.summary["own_files"] = sorted(p.name for p in Path(self.args.local_dir).iterdir()
                                               if p.name.isdigit())

            # Same sharding, the live step-1 arrays as target: values must come
            # from the checkpoint, not from the target.
            got = mgr.restore(2, target=s1)
            self.check_restored("step 2 onto saved sharding", got, 2, "saved")
            self.fetched(mgr)
            self.summary["fetched_for_saved"] = self.summary["fetched_files"]
            # Other layouts need rows other hosts saved: over the network tier.
            for kind in ("cols", "replicated", "mesh2d"):
                self.restore_checked(f"step 2 onto {kind}", mgr, 2, kind)
            self.restore_checked("step 1 onto saved sharding", mgr, 1, "saved")

            # Without a target, as_numpy: whole numpy arrays, from every host's files.
            raw = mgr.restore(2, as_numpy=True)
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
            self.fetched(mgr)
        finally:
            mgr.close()

    def restart(self) -> None:
        mgr = self.manager()
        try:
            steps = mgr.all_steps()
            latest = mgr.latest_step()
            self.summary["all_steps"] = steps
            self.summary["latest_step"] = latest
            self.summary["tier"] = mgr.last_restore_tier
            self.check(steps == [1, 2], f"after restart all_steps() {steps}, wanted [1, 2]")
            self.check(latest == 2, f"after restart latest_step() {latest}, wanted 2")
            step = latest if latest is not None else 2
            self.restore_checked("restart onto saved sharding", mgr, step, "saved")
            self.restore_checked("restart onto cols", mgr, step, "cols")

            # Training goes on: save the next step (retention is the replicators').
            self.check(mgr.save(3, self.state(3)) is True, "save(3) returned False")
            mgr.wait_until_finished()
            steps = mgr.all_steps()
            self.check(steps[-1:] == [3] and 2 in steps,
                       f"after save(3) all_steps() {steps}, wanted 2 and 3")
            self.check_layout(3)
            self.restore_checked("step 3 onto mesh2d", mgr, 3, "mesh2d")
        finally:
            mgr.close()

    def replaced(self) -> None:
        mgr = self.manager()
        try:
            # The replaced host's RAM disk is empty: no step is on every host's.
            before = mgr.all_steps()
            self.summary["steps_before"] = before
            self.check(before == [], f"all_steps() {before} with host {self.nproc - 1} "
                                     f"replaced empty, wanted []")
            # Asked for step 3 before its replicator brings it back: the replaced
            # host reads its regions from its peer's copy, through the replicators.
            self.restore_checked("step 3 before the replicators prepared it", mgr, 3, "saved")
            self.summary["early_tier"] = mgr.last_restore_tier
            latest = mgr.latest_step()
            self.summary["latest_step"] = latest
            self.summary["tier"] = mgr.last_restore_tier
            self.check(latest == 3, f"latest_step() {latest}, wanted 3 (from the peer copy)")
            step = latest if latest is not None else 3
            for kind in ("saved", "mesh2d"):
                self.restore_checked(f"step 3 onto {kind} after a host was replaced", mgr, step,
                                     kind)
            self.summary["own_files"] = sorted(p.name for p in Path(self.args.local_dir).iterdir()
                                               if p.name.isdigit())
            self.fetched(mgr)
        finally:
            mgr.close()

    def shrink(self) -> None:
        """The job came back smaller: the replicators of its own hosts agree (the
        membership is the job's, stated by its manager), the data of the hosts gone
        coming from their peer copies; it trains on and saves step 4."""
        mgr = self.manager()
        try:
            steps = mgr.all_steps()
            self.summary["all_steps"] = steps
            self.check(3 in steps, f"all_steps() {steps} lacks step 3")
            latest = mgr.latest_step()
            self.summary["latest_step"] = latest
            self.summary["tier"] = mgr.last_restore_tier
            self.check(latest == 3, f"latest_step() {latest} on fewer processes, wanted 3")
            step = latest if latest is not None else 3
            for kind in ("saved", "cols"):
                self.restore_checked(f"step {step} onto {kind} on fewer processes", mgr, step,
                                     kind)
            self.fetched(mgr)
            self.check(mgr.save(4, self.state(4)) is True, "save(4) returned False")
            mgr.wait_until_finished()
        finally:
            mgr.close()

    def shrunk(self) -> None:
        """The smaller job restarts: the step it saved itself (on fewer hosts than
        the replicators have nodes) is the one its replicators agree on."""
        mgr = self.manager()
        try:
            latest = mgr.latest_step()
            self.summary["latest_step"] = latest
            self.check(latest == 4, f"latest_step() {latest} after the smaller job saved 4")
            self.restore_checked("step 4 of the smaller job", mgr, latest or 4, "saved")
        finally:
            mgr.close()

    def skew(self) -> None:
        import mtc

        lag_s = 2.0
        mgr = self.manager(max_to_keep=None, replicators=False)
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
                    f"synchronizes the processes, so this process looked for step 1 "
                    f"before process 0 had committed it"))
            self.check_restored("step 1 restored right after saving", got, 1, "saved")
            steps = mgr.all_steps()
            self.summary["all_steps"] = steps
            self.check(steps == [1], f"all_steps() {steps}, wanted [1]")
            # Columns need every host's rows: without replicators nothing may fetch
            # them (another host's RAM disk is not a folder here), so the restore
            # fails, typed, on every process.
            try:
                mgr.restore(1, target=self.target_from_structs("cols"))
                self.check(False, "restore onto cols succeeded without a network tier")
            except mtc.ShardUnavailableError as e:
                self.summary["no_network_error"] = type(e).__name__
        finally:
            mgr.close()

    def rollback(self) -> None:
        def steps_here(label: str, mgr: Any) -> None:
            steps = mgr.all_steps()
            own = sorted(p.name for p in Path(self.args.local_dir).iterdir()
                         if p.name.isdigit())
            self.summary[label] = {"all_steps": steps, "own_files": own}
            self.check(steps == [1, 2, 3, 4] and own == ["1", "2", "3", "4"],
                       f"{label}: all_steps() {steps}, own step folders {own}")

        mgr = self.manager(max_to_keep=None, replicators=False)
        try:
            for step in (1, 2, 3):
                self.check(mgr.save(step, self.state(step)) is True, f"save({step}) False")
            mgr.wait_until_finished()
            self.summary["latest_step"] = latest = mgr.latest_step()
            self.check(latest == 3, f"latest_step() {latest}, wanted 3")
            self.check(mgr.save(4, self.state(4)) is True, "save(4) returned False")
            mgr.wait_until_finished()
            self.restore_checked("step 3 after saving 4", mgr, 3, "saved")
            steps_here("after_restore", mgr)
        finally:
            mgr.close()
        mgr = self.manager(max_to_keep=None, replicators=False)
        try:
            self.restore_checked("step 3 from a reopened manager", mgr, 3, "saved")
            steps_here("after_reopen", mgr)
        finally:
            mgr.close()


if __name__ == "__main__":
    sys.exit(main())
