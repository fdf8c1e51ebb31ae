"""Where the elastic trainer's state comes from after a failure: the source
:func:`~mtc.trainer.policy.recovery_source` picks (mtc's restore, the in-memory
snapshot, or the RAM disks of the slices that kept training), loaded, with what
the report records on the way (the lost save's copies, each tier, the restore's
split)."""

from __future__ import annotations

import argparse
import time

import mtc
import mtc.elastic
from mtc.trainer.checkpoints import MeshCheckpoints
from mtc.trainer.faults import HostFaults
from mtc.trainer.meshes import SliceMeshes, Slices
from mtc.trainer.model import State, Trainer
from mtc.trainer.policy import recovery_source
from mtc.trainer.recovery import Recovery
from mtc.trainer.staging import StagedFaults


class StateSources:
    """The elastic trainer's ways back to a state; :meth:`restore` takes the one the
    policy picks. ``schedule``: the mesh each step ran on (the trainer's, shared)."""

    def __init__(self, args: argparse.Namespace, *, total_slices: int, meshes: SliceMeshes,
                 ckpt: MeshCheckpoints, snapshotter: mtc.elastic.Snapshotter,
                 faults: HostFaults, staged: StagedFaults,
                 schedule: dict[int, Slices]) -> None:
        self.args = args
        self.total_slices = total_slices
        self.meshes = meshes
        self.ckpt = ckpt
        self.snapshotter = snapshotter
        self.faults = faults
        self.staged = staged
        self.schedule = schedule
        self.restore_split: dict[str, float] = {}  # the last recovery's mtc restore, split

    def restore(self, trainer: Trainer, mgr: mtc.CheckpointManager, rec: Recovery,
                slices: Slices, last_saved: int | None) -> State:
        """The state to continue from after ``rec`` (``last_saved``: the newest step
        handed to mtc), onto ``trainer``'s mesh of ``slices``."""
        latest = self.snapshotter.latest
        self.restore_split = {}
        if rec.kind == "host_loss":  # the sender is dead: what its peer holds is final
            t0 = time.perf_counter()
            rec.detail["save_on_peer_before_restore"] = self.faults.peer_copy(
                rec.detail["host"], rec.detail["save_step"])
            # And the save before it: the newest step mtc can restore when the lost
            # save's copy never made it (copies are made after the commit, so a loss
            # soon after one save may find that one's copy unfinished too).
            earlier = rec.detail["save_step"] - self.args.save_interval
            rec.detail["earlier_save_on_peer_before_restore"] = (
                earlier >= 0 and self.faults.peer_copy(rec.detail["host"], earlier))
            rec.detail["save_failed"] = rec.detail["save_step"] in self.ckpt.failed_saves
            self.restore_split["peer_copy_check_s"] = time.perf_counter() - t0
        healthy = [d for d in self.meshes.devices_of_slices(slices)
                   if d.id not in self.staged.snapshot_lost]
        complete = latest is not None and self.snapshotter.covers(healthy)
        if latest is not None and not complete:
            rec.detail["snapshot_incomplete_on_survivors"] = True
        snapshot_step = latest.step if complete and latest is not None else None
        source = recovery_source(full=len(slices) == self.total_slices,
                                 scale_up=rec.kind == "scale_up", snapshot_step=snapshot_step,
                                 last_saved=last_saved, failed_saves=self.ckpt.failed_saves)
        if source == "mtc":
            t0 = time.perf_counter()
            state = dict(mgr.restore(None, trainer.abstract_state()))
            self.restore_split.update(
                {f"mtc_{k}_s": v for k, v in mgr.last_restore_seconds.items()})
            self.restore_split["mtc_restore_s"] = time.perf_counter() - t0
            tiers = sorted(set(mgr.last_restore_tiers.values()))
            rec.tier = next((t for t in ("backup", "peer", "local") if t in tiers), "local")
            rec.detail["host_tiers"] = {str(self.meshes.hosts_of(slices)[h]): t
                                        for h, t in mgr.last_restore_tiers.items()}
            if snapshot_step is None or state["step"] >= snapshot_step:
                return state
            # The save of the snapshot's step did not survive the failure.
            rec.detail["mtc_restored_step"] = state["step"]
            source = "snapshot"
        if source == "snapshot":
            rec.tier = "memory"
            return dict(self.snapshotter.load(trainer.abstract_state(),
                                              reset_snapshot_state=False, devices=healthy))
        # No snapshot, resized: the newest step on every surviving host's RAM disk;
        # scaled up: the newest the slices that kept training saved, resharded.
        rec.tier = "local"
        src = self.schedule[rec.step_at_failure] if rec.kind == "scale_up" else slices
        return self.ckpt.restore_from_ramdisks(src, trainer)
