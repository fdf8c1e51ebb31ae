"""The elastic trainer's checkpoint managers: one per mesh, over the sidecars of
that mesh's simulated hosts (this process never sees a RAM disk)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax

import mtc
from mtc.options import Dispatch
from mtc.testing.local_cluster import LocalCluster
from mtc.trainer.meshes import SliceMeshes, Slices
from mtc.trainer.model import State, Trainer

log = logging.getLogger("mtc.elastic")


class MeshCheckpoints:
    """The current mesh's ``mtc.CheckpointManager`` (:attr:`mgr`) and the steps
    whose saves failed with a lost host. Only the training loop's thread uses it."""

    def __init__(self, cluster: LocalCluster, meshes: SliceMeshes, *, dispatch: Dispatch,
                 save_interval: int) -> None:
        self.cluster = cluster
        self.meshes = meshes
        self.dispatch = dispatch
        self.save_interval = save_interval
        self.mgr: mtc.CheckpointManager | None = None
        self.failed_saves: set[int] = set()  # steps whose save failed on some host

    def options(self, slices: Slices, **kw: Any) -> mtc.Options:
        """mtc's options for a mesh of these slices: their hosts' sidecars, in the
        order that numbers the mesh's hosts from 0 (as a resized Pathways mesh
        does); this process never sees a RAM disk."""
        hosts = self.meshes.hosts_of(slices)
        return mtc.Options(simulated_hosts=len(hosts),
                           hosts_per_slice=self.cluster.hosts_per_slice,
                           sidecars=self.cluster.sidecars(hosts), dispatch=self.dispatch,
                           replicator_token=self.cluster.token(), **kw)

    def local_dir(self, slices: Slices) -> Path:
        """mtc's ``local_dir`` here: with sidecars each host has its own RAM disk,
        which only its processes see, so this folder of the trainer's stays empty."""
        return self.cluster.base / "controller"

    def retire(self) -> None:
        """The current manager's saves finished (or failed with its hosts:
        :attr:`failed_saves`) and it closed: called as soon as its mesh is known
        lost (a host's replacement is then awaited without it), else by :meth:`open`."""
        if self.mgr is None:
            return
        mgr, self.mgr = self.mgr, None
        try:
            mgr.wait_until_finished()
        except (mtc.MtcError, OSError) as e:
            # A save the failure cut short (a wiped host's writer): mtc will
            # not offer that step, so a snapshot of it need not wait for mtc.
            log.warning("a save did not complete before the failure: %s", e)
            if isinstance(e, mtc.MtcError) and e.step is not None:
                self.failed_saves.add(e.step)
        try:
            mgr.close()
        except (mtc.MtcError, OSError) as e:
            log.warning("closing the previous checkpoint manager: %s", e)

    def open(self, trainer: Trainer, slices: Slices) -> mtc.CheckpointManager:
        """The manager for this mesh; the previous one retired first (:meth:`retire`)."""
        self.retire()
        full = len(slices) == self.cluster.slices
        self.mgr = mtc.CheckpointManager(
            self.local_dir(slices), mesh=trainer.mesh,
            options=self.options(
                slices, save_interval_steps=self.save_interval, max_to_keep=None,
                # On every slice the replicators agree on restores; on fewer, the
                # missing hosts' replicators are gone and restore reads the RAM disks.
                replicators=tuple(self.cluster.addresses) if full else None,
                restore_timeout_s=60.0))
        return self.mgr

    def restore_from_ramdisks(self, slices: Slices, onto: Trainer) -> State:
        """The newest step committed on every host of ``slices``, read as those
        slices saved it (their own numbering of hosts) and placed onto ``onto``."""
        hosts = self.meshes.hosts_of(slices)
        # Committed on every one of these hosts, asked of their sidecars: also the
        # steps the whole mesh saved, which these slices' hosts hold in full (the
        # state is replicated across slices), though not every host that saved them.
        held = [set((self.cluster.inspect(h) or {}).get("committed", [])) for h in hosts]
        common = set.intersection(*held)
        if not common:
            raise SystemExit(f"no step on the RAM disks of hosts {hosts}")
        src = self.meshes.trainer(slices)
        with mtc.CheckpointManager(self.local_dir(slices), mesh=src.mesh, options=self.options(
                slices, max_to_keep=None, read_only=True)) as reader:
            state = dict(reader.restore(max(common), src.abstract_state()))
        if src is not onto:
            state.update(jax.device_put({k: state[k] for k in Trainer.ARRAYS},
                                        {k: onto.shardings[k] for k in Trainer.ARRAYS}))
        return state

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
