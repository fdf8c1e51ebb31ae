"""The elastic trainer: one training process that survives losing a host or a slice.

Run as ``python -m mtc.trainer.elastic --cluster BASE --log FILE`` against a local
cluster started with ``python -m mtc.trainer.cluster up``. It trains the small LM
of :mod:`mtc.trainer.model` on 8 CPU devices (``replica`` axis across slices,
``model`` within one) under pathwaysutils' real ``Manager`` and ``elastic_retry``,
checkpointing with mtc to the cluster's simulated hosts, and injects host and
slice losses (``--help``). It is a user of :mod:`mtc.elastic`: the in-memory
snapshot is an ``mtc.elastic.Snapshotter`` fed by the compiled step's own copy;
ahead-of-time builds are ``mtc.elastic.compile_ahead``'s (queued by
:mod:`mtc.trainer.ahead`); pathwaysutils is patched
for CPU slices by ``mtc.elastic.patched`` for the run and put back after.

The loop waits for each step's loss, then dispatches the next step before doing
the finished one's host side: its copy becomes the pending snapshot and, when
due, mtc saves it from that copy (which no step donates), so snapshot and save
run while the devices compute. A failure interrupts the step in flight, as
before; the staged host loss follows its save before the next step is dispatched.

The demo's own parts: the fault schedule (:mod:`mtc.trainer.schedule`) and its
staging (:mod:`mtc.trainer.staging`), the meshes
(:mod:`mtc.trainer.meshes`), where to recover from
(:func:`mtc.trainer.policy.recovery_source`, taken by :mod:`mtc.trainer.resume`)
and the report
(:mod:`mtc.trainer.report`). What it does, failure by failure: docs/elastic-demo.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
from pathwaysutils.elastic import elastic as pw_elastic
from pathwaysutils.elastic import manager as pw_manager

import mtc
import mtc.elastic
from mtc.elastic import compile_ahead as aot
from mtc.testing.local_cluster import LocalCluster
from mtc.trainer.ahead import queue_ahead
from mtc.trainer.checkpoints import MeshCheckpoints
from mtc.trainer.collector import CollectorClock
from mtc.trainer.data import VOCAB, make_iterator
from mtc.trainer.device_memory import configure as configure_device_memory
from mtc.trainer.elastic_args import parse_args
from mtc.trainer.faults import HostFaults
from mtc.trainer.jsonlog import JsonLog
from mtc.trainer.meshes import SliceMeshes, Slices
from mtc.trainer.model import Config, State, Trainer, count_params
from mtc.trainer.policy import pause_seconds
from mtc.trainer.recovery import Recovery
from mtc.trainer.reference import against_reference
from mtc.trainer.resume import StateSources
from mtc.trainer.schedule import FaultSchedule
from mtc.trainer.staging import StagedFaults

log = logging.getLogger("mtc.elastic")


@dataclasses.dataclass(frozen=True)
class Finished:
    """A completed step whose host side (snapshot, save, record) is still to do."""

    step: int
    loss: float
    step_s: float
    t: float  # when it ended (wall clock)
    slices: Slices
    trainer: Trainer
    state: State  # its arrays are the next step's to donate
    copies: dict[str, Any] | None  # the step's own copy of them (``rng`` as key data)


class ElasticRun:
    def __init__(self, args: argparse.Namespace, jlog: JsonLog) -> None:
        self.args = args
        self.log = jlog
        self.cluster = LocalCluster.load(args.cluster)
        cfg = Config.preset(args.model, vocab_size=len(VOCAB), total_steps=args.steps)
        self.meshes = SliceMeshes(jax.devices(), slices=self.cluster.slices,
                                  hosts_per_slice=self.cluster.hosts_per_slice, cfg=cfg,
                                  batch_size=args.batch_size)
        self.devices = self.meshes.devices
        self.pw: pw_manager.Manager | None = None  # made in run(), with pathwaysutils patched
        self.program = "snapshot" if args.snapshot else "step"
        self.ahead = aot.AheadCompiler() if args.compile_ahead > 0 else None
        self.data = make_iterator(seq_len=cfg.seq_len, global_batch_size=args.batch_size,
                                  seed=args.seed)
        self.ckpt = MeshCheckpoints(self.cluster, self.meshes, dispatch=args.dispatch,
                                    save_interval=args.save_interval)
        self.snapshotter = mtc.elastic.Snapshotter()
        self.last_saved: int | None = None  # the newest step handed to mtc
        self.faults = HostFaults(self.cluster, self.devices, jlog)
        self.plan = FaultSchedule(host_loss_at=args.host_loss_at,
                                  host_loss_every_s=args.host_loss_every_s,
                                  slice_loss_at=args.slice_loss_at,
                                  slice_down_steps=args.slice_down_steps, steps=args.steps)
        self.staged = StagedFaults(args, self.faults, self.plan, self.ahead, jlog)
        self.pending: Recovery | None = None
        self.recoveries: list[dict[str, Any]] = []
        self.step_times: dict[Slices, list[float]] = {}
        self.schedule: dict[int, Slices] = {}  # the mesh each step ran on
        self.losses: dict[int, float] = {}
        self.first_losses: dict[int, float] = {}  # losses of steps later replayed
        self.sources = StateSources(args, total_slices=self.cluster.slices, meshes=self.meshes,
                                    ckpt=self.ckpt, snapshotter=self.snapshotter,
                                    faults=self.faults, staged=self.staged,
                                    schedule=self.schedule)
        self.gc_frozen = False
        self.collector = CollectorClock()  # the collector's share of each restore
        # The last completed step, its host side (snapshot, save, record) not done
        # yet: with the per-step snapshot it is done while the next step runs.
        self.unfinished: Finished | None = None

    @property
    def manager(self) -> pw_manager.Manager:
        assert self.pw is not None, "pathwaysutils' Manager lives inside run()"
        return self.pw

    def trainer(self, slices: Slices) -> Trainer:
        return self.meshes.trainer(slices)

    def compile_ahead(self, slices: Slices) -> None:
        """Queue what replica resize can reach from ``slices`` (:mod:`mtc.trainer.ahead`)."""
        if self.ahead is not None:
            queue_ahead(self.ahead, self.meshes, slices, total=self.cluster.slices,
                        depth=self.args.compile_ahead, program=self.program,
                        nice=self.args.compile_ahead_nice, log=self.log)

    # -- the elastic loop ------------------------------------------------------------------

    def on_elastic_event(self) -> None:
        t = time.time()
        if self.ahead is not None:
            self.ahead.hold()  # recovery first; released once its first step ran
        rec = self.pending
        if rec is not None and rec.t_detect is None:
            rec.t_detect = t
        self.log.write(event="detected", kind=rec.kind if rec else "unknown", t=t)

    def run(self) -> None:
        with mtc.elastic.patched(slice_to_devices=self.meshes.group_by_slice):
            self.pw = pw_manager.Manager(self.devices)
            retry = self.pw.elastic_retry(
                minimum_slice_count=1, poll_interval=self.args.poll_s,
                on_elastic_event_callback=self.on_elastic_event,
                retry_policy=lambda attempt, error: attempt <= 10)
            retry(self.attempt)()

    def attempt(self) -> None:
        t_attempt = time.time()
        total = self.cluster.slices
        active = set(self.manager.active_slice_indices)
        rec = self.pending
        if rec is not None and rec.t_detect is not None:
            # pathwaysutils' part of the wait: its cleanup and health checks.
            rec.detail["attempt_after_detect_s"] = t_attempt - rec.t_detect
        if rec is not None and len(active) < total and rec.kind != "scale_up":
            # Pause for the missing slices when a replacement is on its way (the
            # cluster says so), woken when it is back; else resize at once.
            missing = set(range(total)) - active
            pause = pause_seconds(missing, self.faults.replacing_slices(),
                                  self.args.pause_timeout_s, self.args.pause_policy)
            # The lost mesh's manager is done with: its last save is settled and its
            # programs released in the hosts while the replacement starts, not after.
            self.ckpt.retire()
            if pause > 0:
                # Idle until the replacement is back: the full collection a restore
                # would otherwise run into (a walk of every object) is done now, for free.
                gc.collect()
                if self.faults.wait_back(missing, pause):
                    # Back, says the cluster: one health check confirms it.
                    rec.t_replaced = self.faults.returned_t
                    active = set(pw_elastic.get_active_slice_indices(
                        self.manager.slice_to_devices))
            rec.detail["pause_s_at_most"] = pause
            rec.detail["pause_policy"] = self.args.pause_policy
            self.manager.active_slice_indices = active
        slices = tuple(sorted(active))
        if rec is not None:
            rec.t_slices = time.time()
            rec.t_restore_start = rec.t_slices
            rec.slices_after = slices
        self.log.write(event="slices", active=list(slices))
        # pathwaysutils entered jax.default_device() with the slices active before
        # the pause; the default device is part of JAX's compile cache key, so the
        # same mesh must always run under the same one or its step is recompiled.
        with jax.default_device(self.meshes.default_device(slices)):
            self._resume(rec, slices)

    def _resume(self, rec: Recovery | None, slices: Slices) -> None:
        if rec is None and self.ahead is not None:
            self.ahead.release()  # no recovery to finish first (held by an elastic event)
        t0 = time.perf_counter()
        collected_s, full = self.collector.seconds, self.collector.full
        trainer = self.trainer(slices)
        mgr = self.ckpt.open(trainer, slices)
        t_mgr = time.perf_counter()
        state = self.recover(trainer, mgr, rec, slices)
        jax.block_until_ready({k: state[k] for k in Trainer.ARRAYS})
        self.data.set_state(state["data"])
        if rec is not None:
            rec.t_restore_end = time.time()
            # Where the restore stage went: the checkpoint manager for the mesh
            # (the previous one's saves finished first), then the state itself.
            rec.detail["restore_detail"] = {"checkpoint_manager_s": t_mgr - t0,
                                            "state_s": time.perf_counter() - t_mgr,
                                            **self.sources.restore_split,
                                            # Within both: the garbage collector's.
                                            "collector_s": self.collector.seconds - collected_s,
                                            "full_collections": self.collector.full - full}
            rec.resumed_from_step = state["step"]
            self.log.write(event="restored", kind=rec.kind, step=state["step"], tier=rec.tier,
                           seconds=time.perf_counter() - t0, slices=list(slices))
        # After a scale-up the returned hosts hold no step: save one every host
        # holds again, for the replicators to copy, right after the first step
        # (not before it: the save's staging and writes would slow that step).
        resave = rec is not None and rec.kind == "scale_up" and not any(
            state["step"] in (self.cluster.inspect(h) or {}).get("committed", [])
            for h in self.meshes.hosts_of(slices))
        self.train(trainer, mgr, state, slices, resave=resave)

    def recover(self, trainer: Trainer, mgr: mtc.CheckpointManager, rec: Recovery | None,
                slices: Slices) -> State:
        """The state to continue from: a new one at the start, else from the source
        :func:`~mtc.trainer.policy.recovery_source` picks (:mod:`mtc.trainer.resume`)."""
        if rec is None and self.snapshotter.latest is None:
            state = trainer.init(self.args.seed)
            self.log.write(event="init", params=count_params(state["params"]))
            mgr.save(0, state, force=True)
            self.last_saved = 0
            return state
        assert rec is not None
        return self.sources.restore(trainer, mgr, rec, slices, self.last_saved)

    def train(self, trainer: Trainer, mgr: mtc.CheckpointManager, state: State,
              slices: Slices, resave: bool = False) -> None:
        args = self.args
        total = self.cluster.slices
        times = self.step_times.setdefault(slices, [])
        first = True
        built = trainer.built(self.program)
        # Ready: in memory before the first step here needs it (built ahead, or
        # by an earlier run on this mesh); otherwise that step builds it.
        ready = aot.Use(aot.READY, built.seconds, built.ahead, 0.0) if built else None
        step_end = time.time()  # when the last step here ended (wall clock)
        try:
            for step in range(state["step"] + 1, args.steps + 1):
                if step == args.steps and len(slices) < total and self.pending is None:
                    self.staged.wait_for_return(slices)
                # Not before this mesh's first step completed: that step closes the
                # recovery that brought training here (its report entry).
                if len(slices) < total and self.pending is None \
                        and self.staged.scale_up_available(self.manager, slices):
                    self.finish_step(mgr)
                    self.signal_scale_up(mgr, state, step_end)
                last = self.unfinished
                if last is not None and self.staged.host_loss_follows(
                        last.step, recovering=self.pending is not None) \
                        and mgr.should_save(last.step):
                    # The staged host loss follows the save before the next step is
                    # dispatched: that step is the one in flight it interrupts.
                    self.finish_step(mgr)
                waited = 0.0
                slice_loss = self.staged.slice_loss_due(step, recovering=self.pending is not None,
                                                        slices=slices)
                if slice_loss:
                    # The demo loses the slice in steady state: once what the resize
                    # needs is compiled ahead (training waits for it here, logged).
                    waited = self.staged.wait_compiled_ahead(
                        tuple(s for s in slices if s != args.lost_slice))
                t0 = time.perf_counter()
                batch = next(self.data)
                snap_arrays = None
                if args.snapshot:
                    state, loss_arr, snap_arrays = trainer.step_with_snapshot(state, batch)
                else:
                    state, loss_arr = trainer.step(state, batch)
                state["data"] = self.data.get_state()
                if snap_arrays is not None:
                    # The last step's snapshot becomes the newest, and the one before
                    # it is released, while the devices run this step.
                    self.snapshotter.settle()
                # The last step's snapshot, save and record, while this one runs.
                self.finish_step(mgr)
                if slice_loss:
                    self.pending = self.staged.lose_slice(step, waited)
                loss = float(loss_arr)  # waits for the step; DATA_LOSS if a device is lost
                t1 = time.perf_counter()
                step_end = time.time()
                if step in self.losses:
                    self.first_losses.setdefault(step, self.losses[step])
                self.losses[step] = loss
                self.schedule[step] = slices
                if not first:
                    times.append(t1 - t0)
                self.unfinished = Finished(step, loss, t1 - t0, step_end, slices, trainer,
                                           state, snap_arrays)
                rec = self.pending
                if rec is not None and rec.t_restore_end is not None:
                    self.finish_recovery(rec, t1 - t0, ready or trainer.uses.get(self.program))
                    self.pending = None
                    self.faults.stop_if_healthy()
                if first or snap_arrays is None:
                    # Without copies, the step's arrays are the next step's to
                    # donate: saved now. So is a mesh's first step, which the
                    # resave and the compiles ahead below follow.
                    saved = self.finish_step(mgr)
                if first:
                    if resave and not saved:
                        mgr.save(step, state, force=True)
                        self.last_saved = step
                    # The mesh runs: build what the next resize (or the way back) needs.
                    self.compile_ahead(slices)
                if first and not self.gc_frozen:
                    # Everything built so far (JAX, the model, the compiled steps) lives
                    # as long as the run: keep it out of the collector's full passes,
                    # which otherwise walk all of it and stall a step every few saves.
                    gc.freeze()
                    self.gc_frozen = True
                first = False
                if len(slices) < total:
                    self.plan.resized_steps += 1
                    if (s := self.plan.slice_to_bring_back()) is not None:
                        self.faults.bring_back(self.cluster.hosts_of_slice(s), s, 0.0)
                self.plan.stepped()
            self.finish_step(mgr)
        except BaseException:
            # A step that completed stays in the report and in the snapshot (its
            # copies are checked when a recovery loads them); unsaved. What failed
            # is raised as itself: pathwaysutils recovers by its type.
            try:
                self.finish_step(mgr, save=False)
            except Exception:
                log.exception("the last completed step's snapshot was not taken")
            raise
        mgr.wait_until_finished()

    def finish_step(self, mgr: mtc.CheckpointManager, *, save: bool = True) -> bool:
        """The host side of the last completed step, if not done yet: its copies
        become the pending snapshot, it is saved when due (from those copies,
        which no later step donates), and it is logged; the demo's host loss
        follows a save when one is due. Returns whether it saved."""
        done, self.unfinished = self.unfinished, None
        if done is None:
            return False
        t0 = t1 = time.perf_counter()
        saved = False
        try:
            if done.copies is not None:
                self.snapshotter.adopt(done.step, done.state,
                                       jax.tree_util.tree_leaves(done.copies))
                self.staged.snapshot_taken()
            t1 = time.perf_counter()
            if save:
                saved = mgr.save(done.step, done.state if done.copies is None else
                                 done.trainer.state_of_copies(done.state, done.copies))
                if saved:
                    self.last_saved = done.step
        finally:
            t2 = time.perf_counter()
            self.log.write(step=done.step, loss=done.loss, step_s=done.step_s,
                           snapshot_s=t1 - t0, save_s=t2 - t1, saved=saved,
                           slices=list(done.slices), t=done.t)
        if saved and self.staged.host_loss_follows(done.step,
                                                   recovering=self.pending is not None):
            self.pending = self.staged.lose_host(done.step)
        return saved

    def signal_scale_up(self, mgr: mtc.CheckpointManager, state: State,
                        step_end: float) -> None:
        """Start the recovery that brings training back onto every slice."""
        t = time.time()
        back = self.faults.returned_t or t
        available = sorted(self.manager.available_inactive_slices)
        self.pending = Recovery("scale_up", state["step"], back, {"slices": available},
                                t_detect=t, t_in_flight_end=max(step_end, back))
        self.log.write(event="scale_up", step=state["step"], available=available)
        if not self.args.snapshot and self.last_saved != state["step"]:
            # Without a snapshot the state crosses to the new mesh through
            # the RAM disks: save the last step first, and lose none.
            mgr.save(state["step"], state, force=True)
            self.last_saved = state["step"]
        mgr.wait_until_finished()
        raise pw_manager.ScaleUpSignalError()

    def finish_recovery(self, rec: Recovery, first_step_s: float, use: aot.Use | None) -> None:
        if self.ahead is not None:
            self.ahead.release()
        times = self.step_times.get(rec.slices_after, [])
        entry = rec.entry(first_step_s, statistics.median(times) if times else None, use)
        self.recoveries.append(entry)
        self.log.write(event="recovered", **entry)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.raiseExceptions = True  # as pathwaysutils recommends
    # Before the first device buffer: every one after comes from the pool.
    device_memory = configure_device_memory(args.device_memory)
    jlog = JsonLog(args.log)
    jlog.write(event="start", pid=os.getpid())
    cache = args.compile_cache or str(LocalCluster.load(args.cluster).compile_cache_dir())
    cache_dir = aot.enable_cache(None if cache == "none" else cache)
    run = ElasticRun(args, jlog)
    jlog.write(event="ready", slices=run.cluster.slices, devices=len(run.devices),
               compile_cache=cache_dir, compile_ahead=args.compile_ahead,
               pause_policy=args.pause_policy, device_memory=device_memory)
    t0 = time.perf_counter()
    try:
        run.run()
    finally:
        if run.ahead is not None:
            run.ahead.close()
        run.collector.close()  # the reference run below is not a recovery's
    run.ckpt.close()
    run.faults.close()
    jlog.write(event="trained", seconds=time.perf_counter() - t0,
               final_step=max(run.losses, default=0), recoveries=run.recoveries)
    if args.reference:
        jlog.write(event="reference", **against_reference(
            run.losses, run.first_losses, trainer_for=run.trainer,
            default_device=run.meshes.default_device, schedule=run.schedule,
            first=tuple(range(run.cluster.slices)), steps=args.steps, seed=args.seed,
            batch_size=args.batch_size, snapshot=args.snapshot))
    jlog.write(event="done")
    jlog.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
