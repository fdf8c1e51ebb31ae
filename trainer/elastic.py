"""The elastic trainer: one training process that survives losing a host or a slice.

Run as ``python -m mtc.trainer.elastic --cluster BASE --log FILE`` against a local
cluster started with ``python -m mtc.trainer.cluster up``. The process trains the
small LM of :mod:`mtc.trainer.model` on 8 CPU devices arranged as ``--slices`` slices
(mesh axis ``replica``, data parallel) x devices per slice (axis ``model``),
checkpointing with mtc to the cluster's simulated hosts (2 per slice), whose
replicators copy every step to a peer host in the other slice.

Elasticity is pathwaysutils' own: the real ``Manager`` and its
``elastic_retry`` decorator (minimum slice count 1), its slice health checks,
its monitor thread and its scale-up detection. On CPU, devices carry no
``slice_index``: ``pathwaysutils.elastic.elastic.get_slice_to_devices`` is
replaced by a grouping of consecutive devices before the Manager is built.

Failure injection, real where it can be:

- ``host_loss`` (``--host-loss-at STEP[,STEP...]``): after the save of STEP is
  handed to mtc, once it is on the host's peer (``--host-loss-when
  replicated``) or while the host's writer is writing it (``mid-save``), the
  host's sidecar and replicator are SIGKILLed (its RAM disk goes with them), and the
  host's devices are marked lost with pathwaysutils' ``DeviceLossSimulator``:
  reading any array on them raises ``JaxRuntimeError("DATA_LOSS: ...")``, as a
  real slice failure does, and the health check reports the slice down.
  ``--host-return-s`` later the host comes back: a new sidecar and replicator
  over an empty RAM disk, devices healthy. This process saves and restores
  only through the hosts' sidecars and replicators; what a host holds it asks
  of the host's sidecar (``LocalCluster.inspect``).
- ``slice_loss`` (``--slice-loss-at STEP[,STEP...]``): while STEP runs, every
  host of the slice is lost the same way (once the survivors' step is compiled
  ahead: the demo shows recovery in steady state). It comes back after
  ``--slice-down-steps`` steps have run on the survivors.

Every step also emits a snapshot of its new state (``mtc.trainer.snapshot``; off
with ``--no-snapshot``), so a failure replays at most the step it interrupted.

Every program runs as an ahead-of-time executable (:mod:`mtc.trainer.aot`). Once a
mesh trains, a background thread compiles (XLA at lower OS priority) and warms
up the step for every mesh replica resize can reach from it, ``--compile-ahead``
slices fewer, and for the way back up, with the shardings those meshes have; so
the first step after a slice loss runs a ready executable. JAX's persistent
compilation cache (``--compile-cache``, by default in the cluster's folder)
serves a restarted process. Each ``recovered`` entry says whether the first
step's executable was ``ready``, ``cached`` or ``compiled``, and its seconds.

Recovery policy, per elastic attempt (``--pause-policy``, a pure function in
:mod:`mtc.trainer.policy`): pathwaysutils waits for at least one healthy slice;
then, by default (``resize``, pathwaysutils' own model), the trainer *resizes*
onto the healthy slices (new mesh) at once and scales back up when the missing
ones return, also while the cluster replaces their hosts (on this machine a
host loss then costs 0.7 s and the scale-up 0.6 s, against 2.9 s paused for
the replacement, measured in one ``bench/goodput.py`` run each); with
``replacement`` (the demo's), when the cluster is replacing the missing
slices' hosts, it *pauses* up to ``--pause-timeout-s`` for them (woken the
moment they are back, no polling) and otherwise, or after that, resizes. The
state comes from the newest source: the snapshot of the last completed step,
read from the surviving devices, unless mtc holds that same step; then, on
the full mesh, through mtc, which asks the replicators to agree on a step and
fetch what a wiped host lacks from its peer (a snapshot newer than what mtc
restored replaces it). Without a snapshot a resize reads the survivors' RAM
disks, and a scale-up saves the last step there first and reads it back.
While running on fewer slices, every step checks the Manager's
``available_inactive_slices`` (filled by its monitor thread, or at once by one
health check when the cluster says hosts are back) and raises
``ScaleUpSignalError`` to come back onto every slice, again from the snapshot,
losing no step.

Progress is one JSON object per line in ``--log``: events ``start``, ``ready``,
``fault``, ``detected``, ``slices``, ``restored``, ``recovered`` (one per
failure, with the measured phases), one line per step, ``reference`` and
``done``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import Mesh
from pathwaysutils.elastic import elastic as pw_elastic
from pathwaysutils.elastic import manager as pw_manager

import mtc
from mtc.trainer import aot, health
from mtc.trainer.cluster import LocalCluster
from mtc.trainer.data import VOCAB, make_iterator
from mtc.trainer.faults import HostFaults
from mtc.trainer.jsonlog import JsonLog
from mtc.trainer.model import PRESETS, Config, State, Trainer, count_params
from mtc.trainer.policy import PAUSE_POLICIES, pause_seconds
from mtc.trainer.recovery import Recovery
from mtc.trainer.reference import compare, reference_losses
from mtc.trainer.snapshot import Retirer, Snapshot, take

log = logging.getLogger("mtc.elastic")


class ElasticRun:
    def __init__(self, args: argparse.Namespace, jlog: JsonLog) -> None:
        self.args = args
        self.log = jlog
        self.cluster = LocalCluster.load(args.cluster)
        self.devices = sorted(jax.devices(), key=lambda d: d.id)
        n_slices = self.cluster.slices
        if len(self.devices) % n_slices or len(self.devices) % self.cluster.num_hosts:
            raise SystemExit(f"{len(self.devices)} devices do not split into {n_slices} slices "
                             f"of {self.cluster.hosts_per_slice} hosts")
        self.per_slice = len(self.devices) // n_slices
        self.slice_devices = {s: self.devices[s * self.per_slice:(s + 1) * self.per_slice]
                              for s in range(n_slices)}
        # CPU devices carry no slice_index: give pathwaysutils the grouping.
        pw_elastic.get_slice_to_devices = self.group_by_slice
        # Its health check compiles anew on every call (every poll, every attempt).
        health.install()
        self.pw = pw_manager.Manager(self.devices)
        self.cfg = Config.preset(args.model, vocab_size=len(VOCAB), total_steps=args.steps)
        self.trainers: dict[tuple[int, ...], Trainer] = {}
        self._trainers_lock = threading.Lock()  # the loop and the compile-ahead thread
        self.program = "snapshot" if args.snapshot else "step"
        self.ahead = aot.AheadCompiler() if args.compile_ahead > 0 else None
        self.data = make_iterator(seq_len=self.cfg.seq_len, global_batch_size=args.batch_size,
                                  seed=args.seed)
        self.mgr: mtc.CheckpointManager | None = None
        self.snapshot: Snapshot | None = None
        self.retirer = Retirer()
        self.snapshot_lost: set[int] = set()  # devices lost since the snapshot was taken
        self.last_saved: int | None = None  # the newest step handed to mtc
        self.failed_saves: set[int] = set()  # steps whose save failed on some host
        self.faults = HostFaults(self.cluster, self.devices, jlog)
        self.pending: Recovery | None = None
        self.recoveries: list[dict[str, Any]] = []
        self.step_times: dict[tuple[int, ...], list[float]] = {}
        self.schedule: dict[int, tuple[int, ...]] = {}
        self.losses: dict[int, float] = {}
        self.first_losses: dict[int, float] = {}  # losses of steps later replayed
        self.resized_steps = 0
        # The slice a slice loss took, until --slice-down-steps steps ran without it.
        self.slice_down: int | None = None
        self.host_losses = sorted(args.host_loss_at)
        self.t_last_fault: float | None = None  # the last failure injected (or first step)
        self.gc_frozen = False
        self.slice_losses = sorted(args.slice_loss_at)
        self.returns_seen = 0  # HostFaults.returns already acted on
        self.restore_split: dict[str, float] = {}  # the last recovery's mtc restore, split

    # -- topology -------------------------------------------------------------------

    def group_by_slice(self, devices: Sequence[jax.Device]) -> Mapping[int, Sequence[jax.Device]]:
        index = {d.id: i for i, d in enumerate(self.devices)}
        out: dict[int, list[jax.Device]] = {}
        for d in devices:
            out.setdefault(index[d.id] // self.per_slice, []).append(d)
        return out

    def hosts_of(self, slices: tuple[int, ...]) -> list[int]:
        return [h for s in slices for h in self.cluster.hosts_of_slice(s)]

    def trainer(self, slices: tuple[int, ...]) -> Trainer:
        """The compiled step for these slices (kept: coming back to a mesh costs no compile)."""
        with self._trainers_lock:
            if slices not in self.trainers:
                devs = [d for s in slices for d in self.slice_devices[s]]
                mesh = Mesh(np.array(devs).reshape(len(slices), self.per_slice),
                            ("replica", "model"))
                self.trainers[slices] = Trainer(self.cfg, mesh, batch_size=self.args.batch_size)
            return self.trainers[slices]

    def compile_ahead(self, slices: tuple[int, ...]) -> None:
        """Queue the programs of every mesh replica resize can reach from ``slices``
        (and back up) on the background compiler; drop queued ones no longer wanted."""
        if self.ahead is None:
            return
        targets = aot.ahead_meshes(slices, self.cluster.slices, self.args.compile_ahead)
        names = aot.names(targets)
        self.ahead.retarget(names)
        for m, name in zip(targets, names, strict=True):
            def job(m: tuple[int, ...] = m) -> None:
                t = self.trainer(m)
                for program in (self.program, "wrap_rng"):
                    if not t.ready(program):
                        built = t.prepare(program, ahead=True, nice=self.args.compile_ahead_nice)
                        assert self.ahead is not None
                        self.ahead.wait_released()  # no warm-up while a recovery runs
                        warm = t.warm_up(program) if program != "wrap_rng" else 0.0
                        self.log.write(event="compiled_ahead", slices=list(m), program=program,
                                       source=built.source, seconds=built.seconds,
                                       warm_up_s=warm)
            self.ahead.submit(name, job)

    def options(self, slices: tuple[int, ...], **kw: Any) -> mtc.Options:
        """mtc's options for a mesh of these slices: their hosts' sidecars, in the
        order that numbers the mesh's hosts from 0 (as a resized Pathways mesh
        does); this process never sees a RAM disk."""
        hosts = self.hosts_of(slices)
        return mtc.Options(simulated_hosts=len(hosts),
                           hosts_per_slice=self.cluster.hosts_per_slice,
                           sidecars=self.cluster.sidecars(hosts), dispatch=self.args.dispatch,
                           replicator_token=self.cluster.token(), **kw)

    def local_dir(self, slices: tuple[int, ...]) -> Path:
        """mtc's ``local_dir`` here: with sidecars each host has its own RAM disk,
        which only its processes see, so this folder of the trainer's stays empty."""
        return self.cluster.base / "controller"

    def new_manager(self, trainer: Trainer, slices: tuple[int, ...]) -> mtc.CheckpointManager:
        if self.mgr is not None:
            try:
                self.mgr.wait_until_finished()
            except (mtc.MtcError, OSError) as e:
                # A save the failure cut short (a wiped host's writer): mtc will
                # not offer that step, so a snapshot of it need not wait for mtc.
                log.warning("a save did not complete before the failure: %s", e)
                if isinstance(e, mtc.MtcError) and e.step is not None:
                    self.failed_saves.add(e.step)
            try:
                self.mgr.close()
            except (mtc.MtcError, OSError) as e:
                log.warning("closing the previous checkpoint manager: %s", e)
        full = len(slices) == self.cluster.slices
        self.mgr = mtc.CheckpointManager(
            self.local_dir(slices), mesh=trainer.mesh,
            options=self.options(
                slices, save_interval_steps=self.args.save_interval, max_to_keep=None,
                # On every slice the replicators agree on restores; on fewer, the
                # missing hosts' replicators are gone and restore reads the RAM disks.
                replicators=tuple(self.cluster.addresses) if full else None,
                restore_timeout_s=60.0))
        return self.mgr

    # -- failure injection -------------------------------------------------------------

    def _lose(self, hosts: list[int], slice_: int) -> None:
        self.faults.lose(hosts, slice_)
        self.snapshot_lost.update(d.id for h in hosts for d in self.faults.devices_of(h))

    def inject_host_loss(self, step: int) -> None:
        h = self.args.lost_host
        s = h // self.cluster.hosts_per_slice
        if self.args.host_loss_when == "replicated":
            # Once this save is on its peer: the restore shows the peer tier.
            waited = self.faults.wait_on_peer(h, step)
        else:
            # While the host's writer is writing it (not yet committed).
            waited = self.faults.wait_writing(h, step)
        seen = self.cluster.inspect(h) or {"writing": [], "committed": []}
        in_flight, committed = step in seen["writing"], step in seen["committed"]
        t = time.time()
        self.faults.will_replace(s)
        self._lose([h], s)
        detail = {"host": h, "slice": s, "save_step": step, "when": self.args.host_loss_when,
                  "save_committed_on_host_at_loss": committed,
                  "save_in_flight_on_host_at_loss": bool(in_flight),
                  # After the SIGKILL: a copy the dead sender had not committed never is.
                  "save_on_peer_at_loss": self.faults.peer_copy(h, step),
                  "seconds_waited_before_loss": waited}
        self.pending = Recovery("host_loss", step, t, detail)
        self.log.write(event="fault", kind="host_loss", step=step, t=t, **detail)
        self.faults.bring_back([h], s, self.args.host_return_s)

    def wait_compiled_ahead(self, slices: tuple[int, ...], timeout: float = 300.0) -> float:
        """Seconds waited until the compile-ahead job for ``slices`` has ended."""
        if self.ahead is None or not slices:
            return 0.0
        t0 = time.perf_counter()
        self.ahead.wait(aot.names([slices])[0], timeout)
        waited = time.perf_counter() - t0
        self.log.write(event="waited_for_compile_ahead", slices=list(slices), seconds=waited)
        return waited

    def inject_slice_loss(self, step: int, waited_for_compile_ahead: float = 0.0) -> None:
        s = self.args.lost_slice
        hosts = self.cluster.hosts_of_slice(s)
        t = time.time()
        self.resized_steps = 0
        self.slice_down = s
        self._lose(hosts, s)
        detail = {"slice": s, "hosts": hosts, "in_flight_step": step,
                  "seconds_waited_for_compile_ahead": waited_for_compile_ahead}
        self.pending = Recovery("slice_loss", step - 1, t, detail)
        self.log.write(event="fault", kind="slice_loss", step=step - 1, t=t, **detail)

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
        retry = self.pw.elastic_retry(
            minimum_slice_count=1, poll_interval=self.args.poll_s,
            on_elastic_event_callback=self.on_elastic_event,
            retry_policy=lambda attempt, error: attempt <= 10)
        retry(self.attempt)()

    def attempt(self) -> None:
        t_attempt = time.time()
        total = self.cluster.slices
        active = set(self.pw.active_slice_indices)
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
            if pause > 0 and self.faults.wait_back(missing, pause):
                # Back, says the cluster: one health check confirms it.
                rec.t_replaced = self.faults.returned_t
                active = set(pw_elastic.get_active_slice_indices(self.pw.slice_to_devices))
            rec.detail["pause_s_at_most"] = pause
            rec.detail["pause_policy"] = self.args.pause_policy
            self.pw.active_slice_indices = active
        slices = tuple(sorted(active))
        if rec is not None:
            rec.t_slices = time.time()
            rec.t_restore_start = rec.t_slices
            rec.slices_after = slices
        self.log.write(event="slices", active=list(slices))
        # pathwaysutils entered jax.default_device() with the slices active before
        # the pause; the default device is part of JAX's compile cache key, so the
        # same mesh must always run under the same one or its step is recompiled.
        with jax.default_device(self.default_device(slices)):
            self._resume(rec, slices)

    def default_device(self, slices: tuple[int, ...]) -> jax.Device:
        return self.slice_devices[slices[0]][0]

    def _resume(self, rec: Recovery | None, slices: tuple[int, ...]) -> None:
        if rec is None and self.ahead is not None:
            self.ahead.release()  # no recovery to finish first (held by an elastic event)
        t0 = time.perf_counter()
        trainer = self.trainer(slices)
        mgr = self.new_manager(trainer, slices)
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
                                            **self.restore_split}
            rec.resumed_from_step = state["step"]
            self.log.write(event="restored", kind=rec.kind, step=state["step"], tier=rec.tier,
                           seconds=time.perf_counter() - t0, slices=list(slices))
        # After a scale-up the returned hosts hold no step: save one every host
        # holds again, for the replicators to copy, right after the first step
        # (not before it: the save's staging and writes would slow that step).
        resave = rec is not None and rec.kind == "scale_up" and not any(
            state["step"] in (self.cluster.inspect(h) or {}).get("committed", [])
            for h in self.hosts_of(slices))
        self.train(trainer, mgr, state, slices, resave=resave)

    def recover(self, trainer: Trainer, mgr: mtc.CheckpointManager, rec: Recovery | None,
                slices: tuple[int, ...]) -> State:
        """The state to continue from, from the fastest source that has the newest step.

        The snapshot (the last completed step, read from the surviving devices)
        wins unless mtc may hold that same step (its save was handed over and did
        not fail): a tie goes to mtc on the full mesh (pause-and-resume), whose
        bytes are checksummed and which needs no surviving replica of every
        shard. A resize or scale-up reshards the snapshot; without one, a resize
        reads the survivors' RAM disks.
        """
        if rec is None and self.snapshot is None:
            state = trainer.init(self.args.seed)
            self.log.write(event="init", params=count_params(state["params"]))
            mgr.save(0, state, force=True)
            self.last_saved = 0
            return state
        assert rec is not None
        full = len(slices) == self.cluster.slices
        self.restore_split = {}
        if rec.kind == "host_loss":  # the sender is dead: what its peer holds is final
            t0 = time.perf_counter()
            rec.detail["save_on_peer_before_restore"] = self.faults.peer_copy(
                rec.detail["host"], rec.detail["save_step"])
            rec.detail["save_failed"] = rec.detail["save_step"] in self.failed_saves
            self.restore_split["peer_copy_check_s"] = time.perf_counter() - t0
        healthy = {d.id for s in slices for d in self.slice_devices[s]} - self.snapshot_lost
        snap = self.snapshot if self.snapshot is not None and self.snapshot.complete_on(
            healthy) else None
        if self.snapshot is not None and snap is None:
            rec.detail["snapshot_incomplete_on_survivors"] = True
        tie = snap is not None and self.last_saved == snap.step \
            and snap.step not in self.failed_saves
        if full and rec.kind != "scale_up" and (snap is None or tie):
            # The replicators agree on the step and bring a wiped host's shards back
            # from its peer (or the backup).
            t0 = time.perf_counter()
            state = dict(mgr.restore(None, trainer.abstract_state()))
            self.restore_split.update(
                {f"mtc_{k}_s": v for k, v in mgr.last_restore_seconds.items()})
            self.restore_split["mtc_restore_s"] = time.perf_counter() - t0
            tiers = sorted(set(mgr.last_restore_tiers.values()))
            rec.tier = next((t for t in ("backup", "peer", "local") if t in tiers), "local")
            rec.detail["host_tiers"] = {str(self.hosts_of(slices)[h]): t
                                        for h, t in mgr.last_restore_tiers.items()}
            if snap is None or state["step"] >= snap.step:
                return state
            # The save of the snapshot's step did not survive the failure.
            rec.detail["mtc_restored_step"] = state["step"]
        if snap is not None:
            rec.tier = "memory"
            return snap.restore(trainer, healthy)
        # No snapshot, resized: the newest step on every surviving host's RAM disk;
        # scaled up: the newest the slices that kept training saved, resharded.
        rec.tier = "local"
        src = self.schedule[rec.step_at_failure] if rec.kind == "scale_up" else slices
        return self.restore_from_ramdisks(src, trainer)

    def restore_from_ramdisks(self, slices: tuple[int, ...], onto: Trainer) -> State:
        """The newest step committed on every host of ``slices``, read as those
        slices saved it (their own numbering of hosts) and placed onto ``onto``."""
        hosts = self.hosts_of(slices)
        # Committed on every one of these hosts, asked of their sidecars: also the
        # steps the whole mesh saved, which these slices' hosts hold in full (the
        # state is replicated across slices), though not every host that saved them.
        held = [set((self.cluster.inspect(h) or {}).get("committed", [])) for h in hosts]
        common = set.intersection(*held)
        if not common:
            raise SystemExit(f"no step on the RAM disks of hosts {hosts}")
        src = self.trainer(slices)
        with mtc.CheckpointManager(self.local_dir(slices), mesh=src.mesh, options=self.options(
                slices, max_to_keep=None, read_only=True)) as reader:
            state = dict(reader.restore(max(common), src.abstract_state()))
        if src is not onto:
            state.update(jax.device_put({k: state[k] for k in Trainer.ARRAYS},
                                        {k: onto.shardings[k] for k in Trainer.ARRAYS}))
        return state

    def train(self, trainer: Trainer, mgr: mtc.CheckpointManager, state: State,
              slices: tuple[int, ...], resave: bool = False) -> None:
        args = self.args
        total = self.cluster.slices
        times = self.step_times.setdefault(slices, [])
        first = True
        built = trainer.built(self.program)
        # Ready: in memory before the first step here needs it (built ahead, or
        # by an earlier run on this mesh); otherwise that step builds it.
        ready = aot.Use(aot.READY, built.seconds, built.ahead, 0.0) if built else None
        step_end = time.time()  # when the last step here ended (wall clock)
        for step in range(state["step"] + 1, args.steps + 1):
            # Not before this mesh's first step completed: that step closes the
            # recovery that brought training here (its report entry).
            if len(slices) < total and self.pending is None and self.scale_up_available(slices):
                t = time.time()
                back = self.faults.returned_t or t
                self.pending = Recovery("scale_up", state["step"], back,
                                        {"slices": sorted(self.pw.available_inactive_slices)},
                                        t_detect=t, t_in_flight_end=max(step_end, back))
                self.log.write(event="scale_up", step=state["step"],
                               available=sorted(self.pw.available_inactive_slices))
                if not args.snapshot and self.last_saved != state["step"]:
                    # Without a snapshot the state crosses to the new mesh through
                    # the RAM disks: save the last step first, and lose none.
                    mgr.save(state["step"], state, force=True)
                    self.last_saved = state["step"]
                mgr.wait_until_finished()
                raise pw_manager.ScaleUpSignalError()
            waited = 0.0
            slice_loss = bool(self.slice_losses) and step >= self.slice_losses[0] \
                and self.pending is None and not self.faults.lost_slices \
                and len(slices) == total
            if slice_loss:
                # The demo loses the slice in steady state: once what the resize
                # needs is compiled ahead (training waits for it here, logged).
                waited = self.wait_compiled_ahead(
                    tuple(s for s in slices if s != args.lost_slice))
            t0 = time.perf_counter()
            batch = next(self.data)
            snap_arrays = None
            if args.snapshot:
                state, loss_arr, snap_arrays = trainer.step_with_snapshot(state, batch)
            else:
                state, loss_arr = trainer.step(state, batch)
            state["data"] = self.data.get_state()
            if slice_loss:
                self.slice_losses.pop(0)
                self.inject_slice_loss(step, waited)
                self.t_last_fault = time.time()
            loss = float(loss_arr)  # waits for the step; DATA_LOSS if a device is lost
            t1 = time.perf_counter()
            step_end = time.time()
            if snap_arrays is not None:
                self.retirer.retire(self.snapshot)
                self.snapshot = take(state, snap_arrays)
                self.snapshot_lost = set()
            t2 = time.perf_counter()
            saved = mgr.save(step, state)
            if saved:
                self.last_saved = step
            t3 = time.perf_counter()
            if step in self.losses:
                self.first_losses.setdefault(step, self.losses[step])
            self.losses[step] = loss
            self.schedule[step] = slices
            if not first:
                times.append(t1 - t0)
            self.log.write(step=step, loss=loss, step_s=t1 - t0, snapshot_s=t2 - t1,
                           save_s=t3 - t2, saved=saved, slices=list(slices))
            rec = self.pending
            if rec is not None and rec.t_restore_end is not None:
                self.finish_recovery(rec, t1 - t0, ready or trainer.uses.get(self.program))
                self.pending = None
                self.faults.stop_if_healthy()
            if first:
                if resave and not saved:
                    saved = mgr.save(step, state, force=True)
                    self.last_saved = step
                # The mesh runs: build what the next resize (or the way back) needs.
                self.compile_ahead(slices)
            if first and not self.gc_frozen:
                # Everything built so far (JAX, the model, the compiled steps) lives
                # as long as the run: keep it out of the collector's full passes,
                # which otherwise stall a step by 0.1 s every few saves.
                gc.freeze()
                self.gc_frozen = True
            first = False
            if len(slices) < total:
                self.resized_steps += 1
                if (s := self.slice_to_bring_back()) is not None:
                    self.faults.bring_back(self.cluster.hosts_of_slice(s), s, 0.0)
            if self.t_last_fault is None:
                self.t_last_fault = time.time()  # the first step ran: count from here
            if saved and self.pending is None and not self.faults.lost_slices \
                    and self.host_loss_due(step):
                if self.host_losses and step >= self.host_losses[0]:
                    self.host_losses.pop(0)
                self.inject_host_loss(step)
                self.t_last_fault = time.time()
        mgr.wait_until_finished()

    def slice_to_bring_back(self) -> int | None:
        """The slice a slice loss took, once ``--slice-down-steps`` steps ran on the
        survivors (then None again). Never a slice missing for a lost host: its
        replacement is on its way, and bringing all its hosts back would start
        second processes beside the live ones (their address taken, the live
        ones orphaned, the cluster file naming the failed new ones)."""
        s = self.slice_down
        if s is None or self.resized_steps < self.args.slice_down_steps:
            return None
        self.slice_down = None
        return s

    def host_loss_due(self, step: int) -> bool:
        """Whether to lose the host now: ``step`` reached the next of
        ``--host-loss-at``, or ``--host-loss-every-s`` passed since the last
        failure (or the first step). Never at the last step: nothing would be
        left to recover into (and the run's final wait cannot ask the lost host)."""
        if step >= self.args.steps:
            return False
        if self.host_losses and step >= self.host_losses[0]:
            return True
        every = self.args.host_loss_every_s
        return every > 0 and self.t_last_fault is not None \
            and time.time() - self.t_last_fault >= every

    def scale_up_available(self, slices: tuple[int, ...]) -> bool:
        """Whether inactive slices are healthy again: as pathwaysutils' monitor
        thread found on its last poll, or, as soon as the cluster says lost
        hosts are back, by one health check of the inactive slices right now."""
        if self.pw.available_inactive_slices:
            return True
        if self.faults.returns == self.returns_seen:
            return False
        self.returns_seen = self.faults.returns
        inactive = {i: self.pw.slice_to_devices[i]
                    for i in range(self.cluster.slices) if i not in slices}
        found = set(pw_elastic.get_active_slice_indices(inactive)) if inactive else set()
        if found:
            self.pw.available_inactive_slices = frozenset(found)
        return bool(found)

    def finish_recovery(self, rec: Recovery, first_step_s: float, use: aot.Use | None) -> None:
        if self.ahead is not None:
            self.ahead.release()
        times = self.step_times.get(rec.slices_after, [])
        entry = rec.entry(first_step_s, statistics.median(times) if times else None, use)
        self.recoveries.append(entry)
        self.log.write(event="recovered", **entry)

    # -- the reference ---------------------------------------------------------------------

    def reference(self) -> dict[str, Any]:
        """The losses of an uninterrupted run on the same mesh at every step, compared."""
        t0 = time.perf_counter()
        ref, step_s = reference_losses(
            trainer_for=self.trainer, default_device=self.default_device,
            schedule=self.schedule, first=tuple(range(self.cluster.slices)),
            steps=self.args.steps, seed=self.args.seed, batch_size=self.args.batch_size,
            snapshot=self.args.snapshot, devices={d.id for d in self.devices})
        return compare(self.losses, self.first_losses, ref, step_s, time.perf_counter() - t0)


def _steps(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cluster", type=Path, required=True,
                   help="the local cluster's folder (holding cluster.json)")
    p.add_argument("--log", type=Path, required=True, help="JSON-lines output")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--model", choices=sorted(PRESETS), default="small",
                   help="model size preset (small: 3.2M parameters; tiny: 0.4M, for tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (kept on resize)")
    p.add_argument("--save-interval", type=int, default=5)
    p.add_argument("--host-loss-at", type=_steps, default=[],
                   help="lose --lost-host after the save of the first step at or after each "
                        "of these (comma-separated) steps")
    p.add_argument("--host-loss-every-s", type=float, default=0.0, metavar="S",
                   help="also lose --lost-host after the first save once S seconds have "
                        "passed since the last failure (or the first step); 0: off")
    p.add_argument("--host-loss-when", choices=("replicated", "mid-save"), default="replicated",
                   help="lose the host once that save is on its peer, or while it is written")
    p.add_argument("--lost-host", type=int, default=1)
    p.add_argument("--host-return-s", type=float, default=1.5,
                   help="seconds until the lost host is back (empty)")
    p.add_argument("--slice-loss-at", type=_steps, default=[],
                   help="lose --lost-slice while the first step at or after each of these "
                        "(comma-separated) runs on every slice")
    p.add_argument("--lost-slice", type=int, default=1)
    p.add_argument("--slice-down-steps", type=int, default=25,
                   help="the lost slice comes back after this many steps on the survivors")
    p.add_argument("--pause-timeout-s", type=float, default=10.0,
                   help="how long to wait for missing slices whose hosts are being replaced "
                        "before resizing without them (woken when they are back)")
    p.add_argument("--pause-policy", choices=PAUSE_POLICIES, default="resize",
                   help="pause for missing slices only while the cluster replaces their hosts "
                        "(replacement), after every failure (always), or never: train on "
                        "the healthy slices meanwhile and scale back up (resize)")
    p.add_argument("--poll-s", type=float, default=0.2,
                   help="pathwaysutils health-check and monitor interval")
    p.add_argument("--compile-ahead", type=int, default=1, metavar="N",
                   help="compile the step ahead, in the background, for every mesh with up "
                        "to N slices fewer than the one training runs on, and for the way "
                        "back up (0: compile when needed)")
    p.add_argument("--compile-ahead-nice", type=int, default=10, metavar="N",
                   help="compile ahead at this much lower OS priority than the loop")
    p.add_argument("--compile-cache", default="",
                   help="JAX persistent compilation cache folder or URL (default: "
                        "<cluster>/compile-cache; 'none': off)")
    p.add_argument("--no-snapshot", dest="snapshot", action="store_false",
                   help="no per-step in-memory snapshot (resize restores from mtc)")
    p.add_argument("--dispatch", choices=("process", "colocated"), default="process",
                   help="how mtc reaches the hosts' sidecars: seam requests, or colocated "
                        "Python programs they run (a cluster up with --colocated-devices)")
    p.add_argument("--no-reference", dest="reference", action="store_false")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.raiseExceptions = True  # as pathwaysutils recommends
    jlog = JsonLog(args.log)
    jlog.write(event="start", pid=os.getpid())
    cache = args.compile_cache or str(LocalCluster.load(args.cluster).compile_cache_dir())
    cache_dir = aot.enable_cache(None if cache == "none" else cache)
    run = ElasticRun(args, jlog)
    jlog.write(event="ready", slices=run.cluster.slices, devices=len(run.devices),
               compile_cache=cache_dir, compile_ahead=args.compile_ahead,
               pause_policy=args.pause_policy)
    t0 = time.perf_counter()
    try:
        run.run()
    finally:
        if run.ahead is not None:
            run.ahead.close()
    if run.mgr is not None:
        run.mgr.close()
    if run.faults.returning is not None:
        run.faults.returning.join()
    jlog.write(event="trained", seconds=time.perf_counter() - t0,
               final_step=max(run.losses, default=0), recoveries=run.recoveries)
    if args.reference:
        jlog.write(event="reference", **run.reference())
    jlog.write(event="done")
    jlog.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
