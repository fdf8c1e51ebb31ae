"""``CheckpointManager``: what a custom JAX training loop talks to.

``save`` stages the state into host memory and returns; hosts write, checksum
and commit in the background. ``restore`` plans reads from every host's
manifest and loads the shards into the target shardings, resharding when the
mesh changed. With replicators, ``latest_step`` and ``restore`` consider every
tier (own RAM disk, peers, backup) and say which one each host's data came from.

The manager is a facade: the dispatcher reaches the hosts (:mod:`mtc.dispatch`),
:class:`~mtc.save.flow.SaveFlow` saves, :class:`~mtc.inventory.StepInventory`
knows the committed steps, :class:`~mtc.restore.flow.RestoreFlow` restores.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import jax
import numpy as np

from mtc import connect, layout, multihost, orbax_args, orbax_handlers, step_stats
from mtc.contract import AgentConfig
from mtc.errors import ClosedError, ConfigError, MtcError, StorageError
from mtc.inventory import StepInventory
from mtc.lifecycle import Held, track
from mtc.options import Options, local_dir_path
from mtc.orbax_compat_attrs import OrbaxPrivateAttrs
from mtc.orbax_modes import OrbaxItemModes, json_of, root_metadata
from mtc.restore.flow import RestoreFlow
from mtc.restore.step import StepReader
from mtc.save.flow import SaveFlow
from mtc.topology import Topology

# The manager's log lines keep one logger name, the one users configure.
log = logging.getLogger("mtc.manager")

P = ParamSpec("P")
R = TypeVar("R")


def _api(fn: Callable[Concatenate[CheckpointManager, P], R]
         ) -> Callable[Concatenate[CheckpointManager, P], R]:
    """A public call: refused once closed; OS errors come out as MtcError naming the file."""
    @functools.wraps(fn)
    def call(self: CheckpointManager, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._held.closed:
            raise ClosedError(f"{fn.__name__}() on a closed CheckpointManager of "
                              f"{self._where}; create a new one")
        try:
            return fn(self, *args, **kwargs)
        except MtcError:
            raise  # mtc's own (StepNotFoundError is also a FileNotFoundError)
        except OSError as e:
            raise StorageError(f"{fn.__name__}(): {e.strerror or e}",
                               path=str(e.filename) if e.filename else None) from e
    return call


class CheckpointManager(OrbaxItemModes, OrbaxPrivateAttrs):
    """Multi-tier checkpoints of a JAX training state, newest on the RAM disk.

    Args:
      local_dir: the RAM disk (or, for simulated hosts, the folder holding one
        ``host-<i>`` root per host), an absolute local path: a URL (the backup
        tier is the replicators' ``--backup``), a relative path or ``~`` is
        refused with :class:`mtc.ConfigError`. One process at a time may write to a
        host's root: a second process's manager gets
        :class:`mtc.DirectoryLockedError`. Managers of one process share it
        (Orbax's habits: a new manager beside one not closed); a save is refused
        with that error only while another of them has a save there in flight.
      mesh: the mesh the state lives on; its devices define the hosts. Defaults
        to all devices.
      options: see :class:`mtc.Options`.
      item_names: Orbax's: the names of the items saved as an ``ocp.args.Composite``;
        ``restore(step)`` without a target then returns every saved item as an
        ``ocp.args.Composite``.
      metadata: Orbax's root metadata (plain values, kept as JSON on every host
        root): the first writing manager's stays, a later one's is ignored, a
        read-only manager's is answered but not kept (``metadata()``).
      item_handlers: Orbax's, read by :mod:`mtc.orbax_handlers` (none is run): a
        dict of Orbax handlers by item name adds them to ``item_names``, one handler
        makes a single-item manager (not beside ``item_names``); args an item's
        handler does not take are refused with :class:`mtc.ConfigError`.
      logger: Orbax's (an ``AbstractLogger``: anything with ``log_entry(dict)``, such
        as Orbax's ``StandardLogger``, ``CloudLogger``, ``CompositeLogger``): after
        each save that writes and each restore it is given the dict of Orbax's
        ``SaveStepStatistics``/``RestoreStepStatistics`` (:mod:`mtc.step_stats`).
        By default an INFO line of the ``mtc.manager`` logger, as Orbax's default.

    Attributes:
      dispatch_mode: how host-side code is invoked: ``"local"``, ``"colocated"``
        or ``"process"`` (``Options.dispatch``, ``"auto"`` resolved).
      last_restore_tiers: per host served here, where its data of the last
        restore (or of the step ``latest_step`` prepared) came from: ``"local"``,
        ``"peer"`` or ``"backup"``.
      last_restore_tier: the farthest of those (None before any restore).
      last_restore_step: the step the last ``restore`` loaded (None before any).
      last_restore_seconds: the last restore's ``prepare`` (saves finished, the
        replicators' agreement and fetches) and ``load`` seconds.
      foreign_steps: per host served here, the step folders found at start that
        are not mtc's (no mtc manifest: Orbax's, another tool's). mtc leaves them
        alone: never listed, restored, replaced or deleted.
    """

    def __init__(self, local_dir: str | os.PathLike[str], *, mesh: jax.sharding.Mesh | None = None,
                 options: Options | None = None,
                 item_names: Sequence[str] | None = None, metadata: Any = None,
                 item_handlers: Any = None, logger: Any = None) -> None:
        self.local_dir = local_dir_path(local_dir)
        self._logger = step_stats.check_logger(logger)
        # Orbax's item_handlers (mtc.orbax_handlers): they name the items and the args
        # each takes; mtc runs none of them.
        self._handlers, names = orbax_handlers.read(
            item_handlers, orbax_args.check_item_names(item_names))
        self.item_names = orbax_args.check_item_names(names)
        # Orbax's two modes: items of a Composite (item_names, or a first save of one)
        # or one item (one handler given); None until the first save says which.
        self._composite: bool | None = (True if self.item_names else
                                        False if self._handlers else None)
        self.options = options or Options()
        if not isinstance(self.options, Options):
            raise ConfigError(f"options must be mtc.Options, got {type(self.options).__name__}")
        self.mesh = mesh
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()
        pathways = multihost.on_pathways()
        mode = self.options.dispatch
        if mode == "auto" and not self.options.sidecars:
            mode = "colocated" if pathways else "local"
        self.topology = Topology.detect(devices, self.options, pathways=pathways)
        self._config = AgentConfig(
            local_dir=str(self.local_dir),
            host_of_device=self.topology.host_of_device,
            slice_of_host=self.topology.slice_of_host,
            subdirs=self.topology.subdirs,
            max_staged_bytes=self.options.max_staged_bytes,
            writer_threads=self.options.writer_threads,
        )
        self._where = connect.where(self.options, self.topology, self.local_dir)
        connect.read_pod_names(self.options)  # before any certificate is read
        # What ``"auto"`` chose: "local", "colocated" or "process".
        self.dispatch_mode, dispatch = connect.dispatch(mode, self._config, self.options,
                                                        devices, self.topology)
        # Every RAM-disk operation from here on goes through the dispatcher: the host
        # side (sidecar/) alone touches a RAM disk, here as on separate machines.
        # A reader neither locks nor cleans: a writer may be at work. One request to
        # every host answers all the open needs (what is there, whose it is).
        try:
            opened = dispatch.open(self.topology.local_hosts, read_only=self.options.read_only,
                                   identify=connect.watches_replicators(self.options,
                                                                        self.topology),
                                   metadata=json_of(metadata, "metadata")
                                   if self.options.save_root_metadata else None)
        except BaseException:
            dispatch.close()
            raise
        self._dispatch = dispatch
        self._root_metadata, self._metadata_host = root_metadata(
            opened, metadata if self.options.save_root_metadata else None, self._where)
        try:
            self.foreign_steps = connect.note_foreign(opened, self._roots_here())
            self._watch = connect.watch_replicators(self.options, self.topology,
                                                    self._config, opened)
        except BaseException:
            dispatch.close()
            raise
        self._inventory = StepInventory(dispatch, self.topology)
        self._reader = StepReader(dispatch, self.topology, self._where,
                                  self._inventory.saved_hosts,
                                  mesh if mesh is not None else jax.sharding.Mesh(
                                      np.array(devices), ("devices",)))
        self._saves = SaveFlow(dispatch, self.topology, self.options, self._inventory,
                               self._watch, where=self._roots_here(),
                               foreign=self.foreign_steps, directory=str(self.local_dir))
        self._restores = RestoreFlow(dispatch, self.topology, self.options, self._inventory,
                                     self._reader, self._saves, where=self._where)
        # The flows call each other, never the manager: a manager in a reference cycle
        # is freed by the cycle collector, in whichever thread it runs (a writer's),
        # and its finalizer would wait there for the saves that thread writes.
        self._saves.on_new_step = self._restores.new_step_coming
        self._saves.metrics_of_step = self._restores.metrics
        self._saves.time_of_step = self._restores.saved_at
        # What close() releases, apart from the manager, so that a manager never
        # closed is still finished at exit or when collected (mtc.lifecycle).
        self._held = Held(dispatch, str(self.local_dir))
        track(self, self._held)

    def _roots_here(self) -> str:
        return connect.roots_here(self.options, self.topology, self._config, self._where)

    # -- what the last restore did ---------------------------------------------------

    @property
    def last_restore_tiers(self) -> dict[int, str]:
        return self._restores.last_restore_tiers

    @property
    def last_restore_tier(self) -> str | None:
        return self._restores.last_restore_tier

    @property
    def last_restore_step(self) -> int | None:
        return self._restores.last_restore_step

    @property
    def last_restore_seconds(self) -> dict[str, float]:
        return self._restores.last_restore_seconds

    # -- save -------------------------------------------------------------------

    @_api
    def should_save(self, step: Any) -> bool:
        """Whether ``save(step, ...)`` would write, by Orbax's rules: ``step`` is newer
        than the newest step saved, restored, or complete on the hosts, and it is
        on the save interval, at a preemption sync point, or the job's first save
        (no step yet: Orbax's initial save). False on a read-only manager.
        Collective in multi-controller JAX the first time (the hosts' steps)."""
        return self._saves.should_save(layout.as_step(step))

    @_api
    def reached_preemption(self, step: Any) -> bool:
        """Whether every process reached the preemption sync point at ``step``.

        Orbax's equivalent: JAX's ``multihost_utils.reached_preemption_sync_point``
        (the coordination service propagates a preemption notice and picks the
        step); False when JAX runs without the preemption service (a single
        process not started by ``jax.distributed``) and on Pathways. Every
        process must call it at every step."""
        return multihost.reached_preemption(layout.as_step(step))

    @_api
    def is_saving_in_progress(self) -> bool:
        """Whether a save is still being written (raises a finished save's error).

        Where the hosts do not report progress (through colocated Python, on
        Pathways) it waits for the saves and answers False."""
        return self._saves.saving_in_progress()

    @_api
    def save(self, step: Any, state: Any = None, *, force: bool = False, metrics: Any = None,
             args: Any = None, custom_metadata: Any = None) -> bool:
        """Stage ``state`` for ``step``; returns once it is in host memory.

        ``step`` is a non-negative integer of any integer type (int, numpy, a 0-d
        JAX array). ``args=ocp.args.StandardSave(state)`` (or ``PyTreeSave``,
        ``JsonSave``, a ``Composite`` of them) may replace ``state``;
        ``metrics`` (scalars or plain values) are kept with the step
        (:meth:`metrics`), and so is Orbax's ``custom_metadata`` (plain values:
        ``metadata(step).custom_metadata``). Returns False, unless ``force``, when
        :meth:`should_save` says no (as Orbax's: a step not newer than the newest
        saved, restored or on the hosts; off the save interval, at no preemption
        sync point, and not the job's first save), or when
        ``Options.if_busy == "skip"`` and earlier saves still hold the staging
        budget. Errors of earlier background saves are raised here (through
        sidecar processes, a call off the interval asks the hosts at most once a
        second, and only while a save is in flight). In multi-controller JAX
        every process calls it for the same steps (retention agrees on the steps
        committed everywhere).
        """
        composite = self._check_mode(args, "save")
        saved = self._saves.save(step, state, force=force, metrics=metrics, args=args,
                                 custom=json_of(custom_metadata, "custom_metadata"))
        if composite is not None and self._composite is None:
            self._composite = composite
        if saved and not self.options.enable_async_checkpointing:
            self._saves.wait_until_finished()  # Orbax's synchronous save: committed on return
        if saved and self._saves.last_save is not None:
            step_stats.hand(self._logger, step_stats.save_entry(**self._saves.last_save,
                                                                ended=time.time()))
        return saved

    @_api
    def wait_until_finished(self) -> None:
        """Block until every save is committed; raise the first background error.

        In multi-controller JAX this is collective: it returns once every
        process's saves are committed, so a restore that follows sees them all.
        """
        self._saves.wait_until_finished()

    # -- inventory --------------------------------------------------------------

    @_api
    def all_steps(self, read: bool = False) -> list[int]:
        """Steps committed on every host's RAM disk that saved them (collective in
        multi-controller JAX). Peer copies and backups are not listed here:
        ``latest_step`` and ``restore`` reach them through the replicators. A step
        is listed once ``save`` returned, as Orbax's; reading it waits for its save.
        ``read``: Orbax's ``all_steps(read=True)``, a ``reload()`` first (the hosts
        are asked at every call anyway)."""
        if read:
            self.reload()
        return self._restores.steps()

    @_api
    def latest_step(self) -> int | None:
        """The newest step a restore can load, from any configured tier.

        Without replicators: the newest step committed on every host's RAM
        disk. With ``Options(replicators=...)``: the replicators agree on the
        newest step restorable on every host from its RAM disk, a peer or the
        backup, and bring missing data local (a replaced host's in the background
        when other hosts' copies can stand in: see ``restore_while_fetching``);
        ``last_restore_tier(s)`` say from where. That is a round trip to every
        replicator: call it when (re)starting, not every step. Until the next
        ``save`` the answer is kept, and ``restore(step)`` of it needs no second
        round.
        """
        return self._restores.latest_step()

    @_api
    def metrics(self, step: Any) -> Any:
        """The ``metrics`` saved with ``step`` (None when none were given, or when no
        host holds the step, as Orbax's)."""
        step = layout.as_step(step)
        self._saves.finish_step(step)
        return self._restores.metrics(step)

    @_api
    def delete(self, step: Any) -> None:
        """Delete a committed step on every host this process serves; a step no host
        holds raises :class:`StepNotFoundError` (Orbax: ``FileNotFoundError``).
        Collective in multi-controller JAX."""
        self._saves.delete(layout.as_step(step))

    # -- restore ----------------------------------------------------------------

    @_api
    def restore(self, step: Any = None, target: Any = None, *, args: Any = None,
                as_numpy: bool = False,
                directory: str | os.PathLike[str] | None = None,
                restore_kwargs: dict[str, Any] | None = None) -> Any:
        """Load ``step`` (default: the latest, from any configured tier) into
        ``target``'s shardings.

        ``target`` is the state's pytree with ``jax.Array`` or
        ``jax.ShapeDtypeStruct`` leaves (a ``ShapeDtypeStruct`` must carry
        ``.sharding``: mtc never guesses where an array goes); numpy arrays or
        None ask for numpy; other leaves are placeholders for saved values.
        Without a target (also ``StandardRestore()``, a ``Composite`` item of
        None), as Orbax's: arrays come back as ``jax.Array``s with the sharding they
        were saved with where its devices exist, else on the manager's mesh (the
        partition spec saved where the mesh has those axes, else replicated),
        in nested dicts with string keys and lists; with ``as_numpy=True`` as numpy
        arrays with the key types saved (an int-keyed flax NNX pure dict stays
        one). ``args=ocp.args.StandardRestore(target)``
        (or ``PyTreeRestore``, ``JsonRestore``, a ``Composite``) may replace
        ``target``; as Orbax's, such a target names every saved leaf (a placeholder
        ``...`` names one) unless ``PyTreeRestore(..., partial_restore=True)``: one
        left out raises :class:`TargetMismatchError`, where ``restore(step, target)``
        restores the part a target names. With replicators and no step, they agree on the step and
        bring each host's data local first (see ``latest_step``). ``directory``:
        Orbax's restore from another manager's directory (a pretrained checkpoint),
        read through a read-only manager of it with this one's mesh and options.
        ``restore_kwargs``: Orbax's legacy form, ``{item: {"restore_args": ...}}``
        beside a ``target`` dict of items (each as ``PyTreeRestore(target[item],
        restore_args)``).
        """
        if restore_kwargs is not None:
            if args is not None:
                raise ConfigError("restore() takes restore_kwargs= (Orbax's legacy form) or "
                                  "args=, not both")
            # One item's kwargs on a single-item manager (as its saves were, or, before
            # any, as the kwargs read); else {item: kwargs}, as Orbax's legacy form.
            single = self._composite is False or (
                self._composite is None and not self.item_names
                and orbax_args.is_single_item_kwargs(restore_kwargs))
            args, target = (orbax_args.legacy_restore_one(target, restore_kwargs) if single
                            else orbax_args.legacy_restore(target, restore_kwargs)), None
        began = time.time()
        if directory is not None and Path(os.fspath(directory)) != self.local_dir:
            # Orbax's restore from another directory (a pretrained checkpoint): read
            # through a read-only manager of it, on this one's mesh and options.
            with CheckpointManager(directory, mesh=self.mesh, item_names=self.item_names,
                                   options=dataclasses.replace(self.options, read_only=True),
                                   logger=step_stats.Quiet()) as other:
                restored = other.restore(step, target, args=args, as_numpy=as_numpy)
                seconds, step = other.last_restore_seconds, other.last_restore_step
        else:
            self._check_mode(args, "restore")
            if args is None and target is None and self.item_names:
                args = orbax_args.composite_of({})  # every saved item, as Orbax's
            restored = self._restores.restore(step, target, args, as_numpy=as_numpy)
            self._mode_from_step()
            seconds, step = self.last_restore_seconds, self.last_restore_step
        step_stats.hand(self._logger, step_stats.restore_entry(
            step=step, directory=str(directory if directory is not None else self.local_dir),
            began=began, ended=time.time(), load_seconds=seconds.get("load")))
        return restored

    # -- Orbax's other calls ------------------------------------------------------

    @property
    def directory(self) -> Path:
        """Orbax's ``directory``: ``local_dir``."""
        return self.local_dir

    @_api
    def reload(self) -> None:
        """Forget what this manager learnt of the hosts' steps (Orbax's ``reload``):
        the next call asks them again. Steps are listed from the hosts at every
        ``all_steps``/``latest_step`` anyway."""
        self._inventory.relearn()
        self._saves.reload()
        self._restores.reload()

    @_api
    def check_for_errors(self) -> None:
        """Raise the error of a background save that failed, if any (Orbax's)."""
        self._dispatch.raise_background_error()

    @_api
    def best_step(self) -> int | None:
        """The best complete step by ``Options.best_fn`` of its metrics (steps without
        metrics are not ranked); without ``best_fn``, ``latest_step()``, as Orbax's."""
        best_fn = self.options.best_fn
        if best_fn is None:
            return self.latest_step()
        rated = [(s, m) for s in self.all_steps() if (m := self.metrics(s)) is not None]
        if not rated:
            return None
        ranked = sorted(rated, key=lambda sm: best_fn(sm[1]),
                        reverse=self.options.best_mode == "min")
        return ranked[-1][0]

    @_api
    def item_metadata(self, step: Any) -> Any:
        """The saved tree of ``step`` without reading its arrays: a
        ``jax.ShapeDtypeStruct`` per array leaf with the sharding ``restore(step)``
        gives it (:func:`mtc.restore.load.saved_sharding`), plain values as saved;
        a ``Composite`` of the items when saved as one (or ``item_names`` is given),
        as Orbax's."""
        step = layout.as_step(step)
        self._saves.finish_step(step)
        meta = self._reader.item_metadata(step, composite=bool(self.item_names))
        self._mode_from_step()
        return meta

    @_api
    def metadata(self, step: Any = None) -> Any:
        """Orbax's metadata: without a step the root's (``custom_metadata``: what the
        first writing manager of the directory was given as ``metadata=``); of a
        step, its ``item_metadata`` (:meth:`item_metadata`), ``metrics`` ({}: none)
        and the ``custom_metadata`` saved with it. Orbax's classes where Orbax is
        installed (``ocp.metadata.RootMetadata``, ``StepMetadata``)."""
        if step is None:
            return orbax_args.root_metadata(self._root_metadata)
        step = layout.as_step(step)
        self._saves.finish_step(step)
        meta = self._reader.item_metadata(step, composite=bool(self.item_names))
        self._mode_from_step()
        return orbax_args.step_metadata(meta, self._restores.metrics(step) or {},
                                        self._restores.custom_metadata(step))

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Finish every save, then release the directory. Later calls raise ClosedError."""
        try:
            self._held.release()
        finally:
            self._saves.leave()
            if self._watch is not None:
                self._watch.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        if exc is None:
            self.close()
            return
        # The block's error is the one to see: closing after it (saves finishing on
        # a host that is gone) often fails for the same cause, and would mask it.
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - noted on the block's error, not raised
            log.warning("mtc: closing the CheckpointManager after an error failed too: %s", e)
            exc.add_note(f"mtc: closing the CheckpointManager then failed too: "
                         f"{type(e).__name__}: {e}")
