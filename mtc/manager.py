"""``CheckpointManager``: what a custom JAX training loop talks to.

``save`` stages the state into host memory and returns; hosts write, checksum
and commit in the background. ``restore`` plans reads from every host's
manifest and loads the shards into the target shardings, resharding when the
mesh changed.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import types
from pathlib import Path
from typing import Any

import jax

from mtc import layout, multihost
from mtc.dispatch import ColocatedDispatch, Dispatch, LocalDispatch
from mtc.errors import (
    ConfigError,
    CorruptShardError,
    MtcError,
    ShardUnavailableError,
    StepExistsError,
    StepNotFoundError,
)
from mtc.options import Options
from mtc.restore.load import restore_tree
from mtc.restore.plan import load_step, read_manifest
from mtc.save.stage import prepare
from mtc.topology import Topology
from sidecar.agent import AgentConfig

log = logging.getLogger(__name__)


def _on_pathways() -> bool:
    # Pathways programs import pathwaysutils before they touch JAX; importing it
    # here just to ask would cost every restart half a second.
    if "pathwaysutils" not in sys.modules:
        return False
    try:
        from pathwaysutils import is_pathways_backend_used
    except ImportError:
        return False
    return bool(is_pathways_backend_used())


class CheckpointManager:
    """Multi-tier checkpoints of a JAX training state, newest on the RAM disk.

    Args:
      local_dir: the RAM disk (or, for simulated hosts, the folder holding one
        ``host-<i>`` root per host).
      mesh: the mesh the state lives on; its devices define the hosts. Defaults
        to all devices.
      options: see :class:`mtc.Options`.
    """

    def __init__(self, local_dir: str | os.PathLike[str], *, mesh: jax.sharding.Mesh | None = None,
                 options: Options | None = None) -> None:
        self.local_dir = Path(local_dir)
        self.options = options or Options()
        self.mesh = mesh
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()
        self.topology = Topology.detect(devices, self.options)
        self._config = AgentConfig(
            local_dir=str(self.local_dir),
            host_of_device=self.topology.host_of_device,
            slice_of_host=self.topology.slice_of_host,
            subdirs=self.topology.subdirs,
            max_staged_bytes=self.options.max_staged_bytes,
            writer_threads=self.options.writer_threads,
        )
        for h in self.topology.local_hosts:
            root = self._config.root(h)
            root.mkdir(parents=True, exist_ok=True)
            removed = layout.clean_uncommitted(root)
            if removed:
                log.info("host %d: removed uncommitted folders %s", h, removed)
        mode = self.options.dispatch
        if mode == "auto":
            mode = "colocated" if _on_pathways() else "local"
        self._dispatch: Dispatch = (ColocatedDispatch(self._config, devices)
                                    if mode == "colocated" else LocalDispatch(self._config))
        self._closed = False
        self._num_hosts: dict[int, int] = {}
        # Where each local host's data of the last restore came from: "local",
        # "peer" or "backup" (set by replicators; "local" without them).
        self.last_restore_tiers: dict[int, str] = {}

    # -- save -------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return step % self.options.save_interval_steps == 0

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Stage ``state`` for ``step``; returns once it is in host memory.

        Returns False when the step is not on the save interval (and ``force``
        is off), or when ``Options.if_busy == "skip"`` and earlier saves still
        hold the staging budget. Errors of earlier background saves are raised
        here. In multi-controller JAX every process calls it for the same steps
        (retention agrees on the steps committed everywhere).
        """
        self._dispatch.raise_background_error()
        if not (force or self.should_save(step)):
            return False
        partial = [h for h in self.topology.local_hosts
                   if layout.step_dir(self._config.root(h), step).is_dir()]
        if partial:
            if step in self._complete_here():
                raise StepExistsError("step is already committed", step=step, host=partial[0])
            # A crash between hosts' commits left the step on some hosts only: it
            # was never a checkpoint, and saving it again replaces it.
            log.warning("step %d was committed on hosts %s only; replacing it", step, partial)
            for h in partial:
                layout.remove_step(self._config.root(h), step)
            self._num_hosts.pop(step, None)
        header, arrays = prepare(step, state, skip_if_busy=self.options.if_busy == "skip")
        self._apply_retention()
        return self._dispatch.stage(header, arrays)

    def wait_until_finished(self) -> None:
        """Block until every save is committed; raise the first background error.

        In multi-controller JAX this is collective: it returns once every
        process's saves are committed, so a restore that follows sees them all.
        """
        error: BaseException | None = None
        try:
            self._dispatch.wait()
        except MtcError as e:
            error = e
        multihost.barrier("mtc.wait_until_finished")
        if error is not None:
            raise error
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Keep the newest ``max_to_keep`` steps committed on every host.

        A host only deletes steps older than the oldest kept one, so a step
        committed on some hosts but not all (a failed or running save) never
        costs the newest complete step.
        """
        keep = self.options.max_to_keep
        if keep is None or self.options.replicators:
            return
        complete = self.all_steps()
        if len(complete) < keep:
            return
        oldest_kept = complete[-keep]
        for h in self.topology.local_hosts:
            root = self._config.root(h)
            for s in layout.committed_steps(root):
                if s < oldest_kept:
                    layout.remove_step(root, s, background=True)

    # -- inventory --------------------------------------------------------------

    def _visible_hosts(self) -> list[int]:
        """Hosts whose roots this process can read: its own, and with host
        subfolders every ``host-<i>`` beside them (simulated hosts, a shared
        file system, a job restarted with fewer or more processes)."""
        hosts = set(self.topology.local_hosts)
        if self.topology.subdirs and self.local_dir.is_dir():
            # A root that is not a folder is no host's (a lost host's placeholder).
            hosts |= {int(n[5:]) for n in os.listdir(self.local_dir)
                      if n.startswith("host-") and n[5:].isdigit()
                      and (self.local_dir / n).is_dir()}
        return sorted(hosts)

    def _saved_hosts(self, step: int, holders: list[int]) -> int:
        """How many hosts took part in saving ``step`` (from a manifest, cached)."""
        if step not in self._num_hosts:
            self._num_hosts[step] = read_manifest(self._config.root(holders[0]), step,
                                                  holders[0]).num_hosts
        return self._num_hosts[step]

    def _complete_here(self) -> list[int]:
        visible = self._visible_hosts()
        held: dict[int, list[int]] = {}
        for h in visible:
            for s in layout.committed_steps(self._config.root(h)):
                held.setdefault(s, []).append(h)
        complete = []
        for s, holders in sorted(held.items()):
            if not self.topology.subdirs:  # other hosts' roots are not visible here
                if set(self.topology.local_hosts) <= set(holders):
                    complete.append(s)
                continue
            try:
                n = self._saved_hosts(s, holders)
            except MtcError:
                continue  # an unreadable manifest: never offered as a step
            if set(range(n)) <= set(holders):
                complete.append(s)
        return complete

    def all_steps(self) -> list[int]:
        """Steps committed on every host that saved them (collective in multi-controller JAX)."""
        return multihost.common_steps(self._complete_here())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def delete(self, step: int) -> None:
        """Delete a committed step on every host this process serves."""
        self.wait_until_finished()
        for h in self.topology.local_hosts:
            layout.remove_step(self._config.root(h), step)
        self._num_hosts.pop(step, None)

    # -- restore ----------------------------------------------------------------

    def restore(self, step: int | None = None, target: Any = None) -> Any:
        """Load ``step`` (default: the latest) into ``target``'s shardings.

        ``target`` is the state's pytree with ``jax.Array`` or
        ``jax.ShapeDtypeStruct`` (with ``.sharding``) leaves; other leaves are
        placeholders for saved values. Without a target, arrays come back as
        numpy arrays in nested dicts and lists.
        """
        self.wait_until_finished()
        start = time.monotonic()
        requested = step
        self.last_restore_tiers = {h: "local" for h in self.topology.local_hosts}
        if step is None and self.options.replicators:
            step = self._prepare_with_replicators()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise StepNotFoundError(f"no committed step under {self.local_dir}")
        error: MtcError | None = None
        result: Any = None
        try:
            result = self._restore_step(step, target)
        except MtcError as e:
            error = e
        # A shard that failed verification while loading was quarantined by the
        # host that read it; its replicator fetches a verified copy from another
        # holder when asked to prepare again. Once, within the restore timeout,
        # and every process together (the replicators agree again).
        if self.options.replicators and multihost.any_process(
                isinstance(error, CorruptShardError)):
            left = self.options.restore_timeout_s - (time.monotonic() - start)
            log.warning("restore of step %d found a corrupt shard (%s); healing through "
                        "the replicators (%.0fs left)", step, error, left)
            if left > 0:
                try:
                    healed = self._prepare_with_replicators(timeout_s=left)
                    if healed is None or (requested is not None and healed != requested):
                        raise StepNotFoundError(f"after healing, the replicators agree on "
                                                f"step {healed}", step=requested)
                    step, error = healed, None
                    result = self._restore_step(step, target)
                except MtcError as e:
                    error = e
        # Every process fails together, or none: a process that restored while
        # another could not would deadlock the job at its next collective.
        if multihost.any_process(error is not None) and error is None:
            error = ShardUnavailableError("another process could not restore this step",
                                          step=step)
        if error is not None:
            raise error
        return result

    def _restore_step(self, step: int, target: Any) -> Any:
        visible = self._visible_hosts()
        holders = [h for h in visible if layout.step_dir(self._config.root(h), step).is_dir()]
        for h in self.topology.local_hosts:
            if h not in holders and not self.topology.subdirs:
                raise StepNotFoundError("step is not committed", step=step, host=h,
                                        path=str(layout.step_dir(self._config.root(h), step)))
        if not holders:
            raise StepNotFoundError(f"step is not committed under {self.local_dir}", step=step)
        n = self._saved_hosts(step, holders)
        missing = [h for h in range(n) if h not in holders and h in visible]
        if missing and self.topology.subdirs:
            h = missing[0]
            raise StepNotFoundError("step is not committed", step=step, host=h,
                                    path=str(layout.step_dir(self._config.root(h), step)))
        saved = load_step(step, [h for h in holders if h < n], self._config.root)
        return restore_tree(saved, target, self.topology, self._dispatch, self._config.root)

    def _prepare_with_replicators(self, timeout_s: float | None = None) -> int | None:
        """Have each local host's replicator agree on a step and make its data local
        (verified, bad files healed from other holders)."""
        from mtc.replicas import prepare_restore
        from sidecar.replicator.client import PeerError

        addrs = self.options.replicators or ()
        if len(addrs) != self.topology.num_hosts:
            raise ConfigError(f"{len(addrs)} replicator addresses for "
                              f"{self.topology.num_hosts} hosts")
        local = [addrs[h] for h in self.topology.local_hosts]
        try:
            prepared = prepare_restore(local, token=self.options.replicator_token,
                                       timeout_s=timeout_s or self.options.restore_timeout_s)
        except PeerError as e:
            if e.code is not None and e.code.name == "DATA_LOSS":
                # No good copy of a file on any holder: the replicator named it.
                raise CorruptShardError(str(e), host=e.host) from e
            raise
        self.last_restore_tiers = {h: prepared.tiers[addrs[h]] for h in self.topology.local_hosts}
        return prepared.step

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._dispatch.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        self.close()
