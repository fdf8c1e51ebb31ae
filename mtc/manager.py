"""``CheckpointManager``: what a custom JAX training loop talks to.

``save`` stages the state into host memory and returns; hosts write, checksum
and commit in the background. ``restore`` plans reads from every host's
manifest and loads the shards into the target shardings, resharding when the
mesh changed. With replicators, ``latest_step`` and ``restore`` consider every
tier (own RAM disk, peers, backup) and say which one each host's data came from.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import jax

from mtc import layout, multihost, orbax_args, runs
from mtc.contract import AgentConfig
from mtc.dispatch import ColocatedDispatch, Dispatch, LocalDispatch, NetworkTier, ProcessDispatch
from mtc.dispatch.process import find_sidecars
from mtc.errors import (
    AgreementError,
    ClosedError,
    ConfigError,
    CorruptShardError,
    DataLossError,
    MtcError,
    ShardUnavailableError,
    StepExistsError,
    StepNotFoundError,
    StorageError,
)
from mtc.inventory import StepInventory
from mtc.lifecycle import Held, track
from mtc.options import Options
from mtc.replicas import ReplicatorTier, credentials, farthest
from mtc.replicator_watch import ReplicatorWatch
from mtc.restore.load import metrics_of
from mtc.restore.plan import SavedStep
from mtc.restore.step import StepReader
from mtc.save.stage import bytes_on_hosts, prepare
from mtc.topology import Topology

if TYPE_CHECKING:
    from mtc.replicas import Prepared

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


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


def _api(fn: Callable[Concatenate[CheckpointManager, P], R]
         ) -> Callable[Concatenate[CheckpointManager, P], R]:
    """A public call: refused once closed; OS errors come out as MtcError naming the file."""
    @functools.wraps(fn)
    def call(self: CheckpointManager, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._held.closed:
            raise ClosedError(f"{fn.__name__}() on a closed CheckpointManager of "
                              f"{self.local_dir}; create a new one")
        try:
            return fn(self, *args, **kwargs)
        except OSError as e:
            raise StorageError(f"{fn.__name__}(): {e.strerror or e}",
                               path=str(e.filename) if e.filename else None) from e
    return call


class CheckpointManager:
    """Multi-tier checkpoints of a JAX training state, newest on the RAM disk.

    Args:
      local_dir: the RAM disk (or, for simulated hosts, the folder holding one
        ``host-<i>`` root per host). One manager at a time may use a host's
        root: a second gets :class:`mtc.DirectoryLockedError`.
      mesh: the mesh the state lives on; its devices define the hosts. Defaults
        to all devices.
      options: see :class:`mtc.Options`.

    Attributes:
      last_restore_tiers: per host served here, where its data of the last
        restore (or of the step ``latest_step`` prepared) came from: ``"local"``,
        ``"peer"`` or ``"backup"``.
      last_restore_tier: the farthest of those (None before any restore).
      last_restore_seconds: the last restore's ``prepare`` (saves finished, the
        replicators' agreement and fetches) and ``load`` seconds.
    """

    def __init__(self, local_dir: str | os.PathLike[str], *, mesh: jax.sharding.Mesh | None = None,
                 options: Options | None = None) -> None:
        self.local_dir = Path(local_dir)
        self.options = options or Options()
        if not isinstance(self.options, Options):
            raise ConfigError(f"options must be mtc.Options, got {type(self.options).__name__}")
        self.mesh = mesh
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()
        pathways = _on_pathways()
        mode = self.options.dispatch
        if mode == "auto":
            mode = "process" if self.options.sidecars else "colocated" if pathways else "local"
        self.topology = Topology.detect(devices, self.options, pathways=pathways)
        self._config = AgentConfig(
            local_dir=str(self.local_dir),
            host_of_device=self.topology.host_of_device,
            slice_of_host=self.topology.slice_of_host,
            subdirs=self.topology.subdirs,
            max_staged_bytes=self.options.max_staged_bytes,
            writer_threads=self.options.writer_threads,
        )
        self._network = self._network_tier() if mode == "local" else None
        dispatch: Dispatch
        # The sidecars take the replicators' credentials (a token, or this
        # process's certificate).
        if mode == "process":
            dispatch = ProcessDispatch.connect(self._config, self.options.sidecars or (),
                                               creds=credentials(self.options))
        elif mode == "colocated":
            sidecars = (find_sidecars(self._config, self.options.sidecars,
                                      creds=credentials(self.options))
                        if self.options.sidecars else None)
            dispatch = ColocatedDispatch(self._config, devices, sidecars)
        else:
            dispatch = LocalDispatch(self._config, self._network)
        # Every RAM-disk operation from here on goes through the dispatcher: the host
        # side (sidecar/) alone touches a RAM disk, here as on separate machines.
        # A reader neither locks nor cleans: a writer may be at work.
        try:
            dispatch.open(self.topology.local_hosts, read_only=self.options.read_only)
        except BaseException:
            dispatch.close()
            raise
        self._dispatch = dispatch
        try:
            self._watch = self._watch_replicators()
        except BaseException:
            dispatch.close()
            raise
        # Hosts whose replicator did not answer the last check: the manager keeps
        # their RAM disks within max_to_keep meanwhile.
        self._unreplicated: frozenset[int] = frozenset()
        self._inventory = StepInventory(dispatch, self.topology)
        self._reader = StepReader(dispatch, self.topology, self._network, self.local_dir,
                                  self._inventory.saved_hosts)
        self._tier_: ReplicatorTier | None = None  # made when first asked (see _tier)
        # What close() releases, apart from the manager, so that a manager never
        # closed is still finished at exit or when collected (mtc.lifecycle).
        self._held = Held(dispatch, str(self.local_dir))
        track(self, self._held)
        # The run identity written into every manifest this manager saves (mtc.runs):
        # fixed now and again after each restore, the same in every process.
        self._run = "" if self.options.read_only else runs.shared_run_id()
        # The step latest_step() answered: restoring it fences off newer steps.
        self._latest: int | None = None
        self._last_saved: int | None = None
        # A step the replicators prepared for latest_step(), not yet restored.
        self._prepared: Prepared | None = None
        self.last_restore_tiers: dict[int, str] = {}
        self.last_restore_tier: str | None = None
        self.last_restore_seconds: dict[str, float] = {}

    def _network_tier(self) -> NetworkTier | None:
        """Multi-controller JAX with a RAM disk per process (no host subfolders): other
        hosts' files are reachable only through the replicators, when there are some."""
        if self.topology.subdirs or not self.options.replicators \
                or self.options.simulated_hosts is not None:
            return None
        host = self.topology.local_hosts[0]
        ranks = self.options.replicator_ranks
        return NetworkTier(tuple(self.options.replicators), credentials(self.options),
                           self.topology.local_hosts,
                           ranks[host] if ranks and host < len(ranks) else host)

    def _saved_ranks(self) -> tuple[int, ...]:
        """Each host's replicator rank, for the manifests, when the job's hosts are not
        ranks 0..n-1 (it came back on other hosts): where each host's data is kept."""
        ranks = tuple(self.options.replicator_ranks or ())
        if not self.options.replicators or not ranks or ranks == tuple(range(len(ranks))):
            return ()
        if len(ranks) != self.topology.num_hosts:
            raise ConfigError(f"{len(ranks)} replicator ranks for {self.topology.num_hosts} "
                              f"hosts")
        return ranks

    def _watch_replicators(self) -> ReplicatorWatch | None:
        """With replicators, a writer checks that each of its hosts' replicators is the
        rank the job states and serves that host's RAM disk (``ConfigError``), and
        watches them at every save (:mod:`mtc.replicator_watch`)."""
        addrs = tuple(self.options.replicators or ())
        ranks = tuple(self.options.replicator_ranks or range(len(addrs)))
        if self.options.read_only or not addrs or len(addrs) != self.topology.num_hosts \
                or len(ranks) != len(addrs):
            return None  # the first restore says what does not match
        hosts = self.topology.local_hosts
        watch = ReplicatorWatch({h: addrs[h] for h in hosts}, {h: ranks[h] for h in hosts},
                                credentials(self.options))
        try:
            watch.start({h: str(self._config.root(h)) for h in hosts},
                        self._dispatch.identify(hosts, create=True),
                        subdirs=self.topology.subdirs)
        except BaseException:
            watch.close()
            raise
        return watch

    @property
    def _tier(self) -> ReplicatorTier:
        """The replicators, made on first use: a manager whose replicator addresses
        do not match its hosts still saves; its first restore says so."""
        if self._tier_ is None:
            self._tier_ = ReplicatorTier(self.options, self.topology)
        return self._tier_

    # -- save -------------------------------------------------------------------

    @_api
    def should_save(self, step: Any) -> bool:
        """Whether ``save(step, ...)`` would write: on the save interval, or at a
        preemption sync point, and after the last step saved or restored here (as
        Orbax's). ``save`` of a step already committed raises StepExistsError."""
        step = layout.as_step(step)
        if self._last_saved is not None and step <= self._last_saved:
            return False
        return self._on_schedule(step)

    def _on_schedule(self, step: int) -> bool:
        return step % self.options.save_interval_steps == 0 or self.reached_preemption(step)

    @_api
    def reached_preemption(self, step: Any) -> bool:
        """Whether every process reached the preemption sync point at ``step``.

        Orbax's equivalent: JAX's ``multihost_utils.reached_preemption_sync_point``
        (the coordination service propagates a preemption notice and picks the
        step); False when JAX runs without the preemption service (a single
        process not started by ``jax.distributed``) and on Pathways. Every
        process must call it at every step."""
        step = layout.as_step(step)
        if _on_pathways() or jax.process_count() == 1:
            return False
        from jax.experimental import multihost_utils

        try:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:  # the preemption service is off
            return False

    @_api
    def is_saving_in_progress(self) -> bool:
        """Whether a save is still being written (raises a finished save's error).

        Through colocated Python (Pathways) the sidecar does not report progress:
        there it waits for the saves and answers False."""
        self._dispatch.raise_background_error()
        agent = getattr(self._dispatch, "agent", None)
        if agent is not None:
            return bool(agent.in_flight())
        self._wait_saves()
        return False

    @_api
    def save(self, step: Any, state: Any = None, *, force: bool = False, metrics: Any = None,
             args: Any = None) -> bool:
        """Stage ``state`` for ``step``; returns once it is in host memory.

        ``step`` is a non-negative integer of any integer type (int, numpy, a 0-d
        JAX array). ``args=ocp.args.StandardSave(state)`` (or ``PyTreeSave``,
        ``JsonSave``, a ``Composite`` of them) may replace ``state``;
        ``metrics`` (scalars or plain values) are kept with the step
        (:meth:`metrics`). Returns False when the step is off the save interval
        and at no preemption sync point (and ``force`` is off), or when
        ``Options.if_busy == "skip"`` and earlier saves still hold the staging
        budget. Errors of earlier background saves are raised here (through
        sidecar processes, a call off the interval asks the hosts at most once a
        second, and only while a save is in flight). In multi-controller JAX
        every process calls it for the same steps (retention agrees on the steps
        committed everywhere).
        """
        self._writable("save")
        if orbax_args.is_orbax_args(state):
            raise ConfigError(orbax_args.positional_hint("save"))
        if args is not None:
            if state is not None:
                raise ConfigError("save() takes the state or args=, not both")
            state = orbax_args.save_state(args)
        elif state is None:
            raise ConfigError("save() needs the state (or args=ocp.args.StandardSave(state))")
        step = layout.as_step(step)
        # Through sidecar processes: requests overlap, and a step off the interval
        # costs no round trip.
        sidecars = self._dispatch if isinstance(self._dispatch, ProcessDispatch) else None
        if sidecars is None:
            self._dispatch.raise_background_error()
        if not (force or self._on_schedule(step)):
            if sidecars is not None:
                sidecars.poll_if_due()
            return False
        if self._watch is not None:
            self._unreplicated = self._watch.poll()
        t0 = time.perf_counter()
        header, arrays = prepare(step, state, skip_if_busy=self.options.if_busy == "skip",
                                 metrics=metrics, run=self._run, ranks=self._saved_ranks())
        if sidecars is not None:
            def before_send() -> None:
                # While the shards are copied into the hosts' areas: one round trip
                # for earlier saves' errors and the hosts' steps, then room on the
                # RAM disks. Nothing is sent to a host before it returned, and
                # nothing at all when it raised.
                held = self._replace_partial(step, sidecars.poll_and_steps(
                    self.topology.local_hosts))
                self._prepared = None
                self._make_room(held)

            staged = sidecars.stage(header, arrays, before_send=before_send)
        else:
            held = self._replace_partial(step, self._dispatch.steps(self.topology.local_hosts))
            self._prepared = None
            self._make_room(held)
            staged = self._dispatch.stage(header, arrays)
        if staged:
            self._last_saved = step
            # The manifests say this job's host count and this run: no host need be asked.
            self._inventory.saved(step, self._run, self.topology.local_hosts)
            log.info("mtc: save step %d: %d bytes of %s staged in %.3fs; writing to %s in the "
                     "background", step,
                     bytes_on_hosts(arrays, self.topology.host_of_device,
                                    len(self.topology.local_hosts)), self._hosts_here(),
                     time.perf_counter() - t0, self._roots_here())
        return staged

    def _hosts_here(self) -> str:
        hosts = self.topology.local_hosts
        return f"host {hosts[0]}" if len(hosts) == 1 else f"{len(hosts)} hosts"

    def _roots_here(self) -> str:
        """Where the hosts this process serves keep their steps, as this process names
        them (a sidecar's or a worker's RAM disk is named, never opened, here)."""
        hosts = self.topology.local_hosts
        if len(hosts) == 1:
            return str(self._config.root(hosts[0]))
        if self.topology.subdirs:
            return f"{self.local_dir}/host-{{{hosts[0]}..{hosts[-1]}}}"
        return f"the RAM disk ({self.local_dir}) of each of {len(hosts)} hosts"

    def _replace_partial(self, step: int, held: dict[int, list[int]]) -> dict[int, list[int]]:
        """``held`` (the hosts' committed steps) once ``step`` may be saved: a step
        committed on every host raises :class:`StepExistsError`; one that a crash
        between hosts' commits left on some hosts only was never a checkpoint, and
        is deleted so that saving it again replaces it."""
        partial = [h for h in self.topology.local_hosts if step in held.get(h, ())]
        if self._inventory.sees_own_host_only or partial:  # the first: collective
            if step in self._inventory.complete_everywhere(held):
                raise StepExistsError("step is already committed", step=step,
                                      host=partial[0] if partial else None)
        if not partial:
            return held
        log.warning("step %d was committed on hosts %s only (or by another run on some); "
                    "replacing it", step, partial)
        self._dispatch.delete(step, partial)
        self._inventory.forget(step)
        return {h: [s for s in steps if s != step] for h, steps in held.items()}

    @_api
    def wait_until_finished(self) -> None:
        """Block until every save is committed; raise the first background error.

        In multi-controller JAX this is collective: it returns once every
        process's saves are committed, so a restore that follows sees them all.
        """
        self._wait_saves()
        self._apply_retention()

    def _wait_saves(self) -> None:
        error: BaseException | None = None
        try:
            self._dispatch.wait()
        except MtcError as e:
            error = e
        multihost.barrier("mtc.wait_until_finished")
        if error is not None:
            raise error

    def _writable(self, call: str) -> None:
        if self.options.read_only:
            raise ConfigError(f"{call}() on a read-only CheckpointManager of {self.local_dir}")

    def _retains(self) -> bool:
        return (self.options.max_to_keep is not None and not self.options.replicators
                and not self.options.read_only)

    def _apply_retention(self, *, before_write: bool = False,
                         held: dict[int, list[int]] | None = None) -> dict[int, tuple[int, int]]:
        """Delete what :func:`mtc.retention.to_delete` says, on every host served here;
        returns each host's (free bytes, bytes of its newest step), as :meth:`space`.
        ``held``: the hosts' committed steps, when the caller has just listed them."""
        if not self._retains():
            return {}
        complete = self._inventory.common(held)
        return self._dispatch.retain(self.topology.local_hosts, complete,
                                     max_to_keep=self.options.max_to_keep,
                                     keep_period=self.options.keep_period,
                                     before_write=before_write)

    def _saves_in_flight(self) -> int:
        """Steps still being written (colocated: unknown, so assume one; sidecar
        processes: those whose save slot no host reported written yet)."""
        if isinstance(self._dispatch, ProcessDispatch):
            return self._dispatch.saves_in_flight()
        agent = getattr(self._dispatch, "agent", None)
        if agent is None:
            return 1
        return -(-int(agent.in_flight()) // max(1, len(self.topology.local_hosts)))

    def _short_of_space(self, space: dict[int, tuple[int, int]] | None = None,
                        steps_coming: int | None = None) -> bool:
        """Whether some host's RAM disk has less room than its newest step takes,
        for the new step and each one still being written.

        The saves in flight are counted before the space is read (``steps_coming``
        comes from before ``space``): a save committing in between then shows in
        the space, and is never missed by both."""
        if steps_coming is None:
            steps_coming = 1 + self._saves_in_flight()
        if space is None:
            space = self._dispatch.space(self.topology.local_hosts)
        return any(newest and free < newest * 1.05 * steps_coming
                   for free, newest in space.values())

    def _retain_unreplicated(self, held: dict[int, list[int]] | None) -> None:
        """A host whose replicator does not answer has nobody cleaning its RAM disk:
        before a step is written, its newest ``max_to_keep`` (2 when None) steps are
        kept, from its own view (the others' progress is the replicators' to know;
        saves go in step, so its newest steps are the job's)."""
        hosts = [h for h in self._unreplicated if h in self.topology.local_hosts]
        if not hosts or self.options.read_only:
            return
        held = held if held is not None else self._dispatch.steps(hosts)
        keep = self.options.max_to_keep or 2
        for h in hosts:
            steps = held.get(h, [])
            if len(steps) >= keep:
                self._dispatch.retain([h], steps, max_to_keep=keep,
                                      keep_period=self.options.keep_period, before_write=True)

    def _make_room(self, held: dict[int, list[int]] | None = None) -> None:
        """Before a step is written: free the oldest step beyond ``max_to_keep - 1``.

        Freeing runs in the background; only when a RAM disk is short of room is
        it waited for, and then for the saves still in flight, whose commit lets
        retention free one more step (never the newest complete one)."""
        self._retain_unreplicated(held)
        if not self._retains():
            return
        coming = 1 + self._saves_in_flight()
        space = self._apply_retention(before_write=True, held=held)
        # Collective in multi-controller JAX: every process takes the same path.
        if not multihost.any_process(self._short_of_space(space, coming)):
            return
        self._dispatch.settle(self.topology.local_hosts)
        if multihost.any_process(self._short_of_space()):
            self._wait_saves()
            self._apply_retention(before_write=True)
            self._dispatch.settle(self.topology.local_hosts)

    # -- inventory --------------------------------------------------------------

    @_api
    def all_steps(self) -> list[int]:
        """Steps committed on every host's RAM disk that saved them (collective in
        multi-controller JAX). Peer copies and backups are not listed here:
        ``latest_step`` and ``restore`` reach them through the replicators."""
        return self._inventory.common()

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
        if not self.options.replicators:
            steps = self.all_steps()
            if not steps:
                self._unrestorable()
            self._latest = steps[-1] if steps else None
            return self._latest
        if self._prepared is None:
            self._wait_saves()  # the replicators see what this job committed
            self._prepared = self._prepare_with_replicators(background=self._may_defer())
        step = self._prepared.step
        if step is None:
            if self._prepared.lost:
                self._unrestorable(self._prepared.lost)
            steps = self.all_steps()
            self._latest = steps[-1] if steps else None
            return self._latest
        if multihost.common_steps([step]) != [step]:
            raise AgreementError("processes were told different steps by their replicators",
                                 step=step)
        log.info("mtc: latest step %d, agreed by every host (tier: %s)", step,
                 self.last_restore_tier)
        self._latest = step
        return step

    def _unrestorable(self, lost: str = "") -> None:
        """No step can be restored: fine when the hosts hold none (a new job); when
        some do (another host's data of every step is gone), a
        :class:`DataLossError` naming what is gone, or with
        ``Options(if_data_lost="start_over")`` those steps deleted on this job's
        hosts, so that it saves their numbers again from scratch."""
        held = {h: steps for h, steps in self._inventory.held().items() if steps}
        if not multihost.any_process(bool(held) or bool(lost)):
            return
        what = lost or "; ".join(f"host {h} holds steps {steps}" for h, steps in
                                 sorted(held.items())) or "other processes' hosts hold steps"
        if self.options.if_data_lost == "raise":
            raise DataLossError(
                f"no step can be restored: the data of some host of every step is gone, "
                f"while others still hold steps ({what}). Bring the data back (restart the "
                f"lost host's replicator, or restore its backup) and retry, or start from "
                f"scratch with Options(if_data_lost='start_over')")
        log.warning("mtc: no step can be restored (%s); starting over as asked "
                    "(if_data_lost='start_over'): deleting this job's unrestorable steps", what)
        if not self.options.read_only:
            for step in sorted({s for steps in held.values() for s in steps}):
                self._dispatch.delete(step, [h for h, steps in held.items() if step in steps])
                self._inventory.forget(step)

    @_api
    def metrics(self, step: Any) -> Any:
        """The ``metrics`` saved with ``step`` (None when none were given)."""
        step = layout.as_step(step)
        return metrics_of(self._reader.saved_step(step))

    @_api
    def delete(self, step: Any) -> None:
        """Delete a committed step on every host this process serves."""
        self._writable("delete")
        step = layout.as_step(step)
        self.wait_until_finished()
        self._dispatch.delete(step, self.topology.local_hosts)
        self._inventory.forget(step)

    # -- restore ----------------------------------------------------------------

    @_api
    def restore(self, step: Any = None, target: Any = None, *, args: Any = None) -> Any:
        """Load ``step`` (default: the latest, from any configured tier) into
        ``target``'s shardings.

        ``target`` is the state's pytree with ``jax.Array`` or
        ``jax.ShapeDtypeStruct`` leaves (a ``ShapeDtypeStruct`` must carry
        ``.sharding``: mtc never guesses where an array goes); numpy arrays or
        None ask for numpy; other leaves are placeholders for saved values.
        Without a target, arrays come back as numpy arrays in nested dicts (of
        the key types saved) and lists. ``args=ocp.args.StandardRestore(target)``
        (or ``PyTreeRestore``, ``JsonRestore``, a ``Composite``) may replace
        ``target``. With replicators and no step, they agree on the step and
        bring each host's data local first (see ``latest_step``).
        """
        if orbax_args.is_orbax_args(target) or orbax_args.is_orbax_args(step):
            raise ConfigError(orbax_args.positional_hint("restore").replace(
                "ocp.args.StandardSave(state)", "ocp.args.StandardRestore(target)"))
        if args is not None and target is not None:
            raise ConfigError("restore() takes target or args=, not both")
        t0 = time.perf_counter()
        self.wait_until_finished()
        requested = None if step is None else layout.as_step(step)
        tiers = {h: "local" for h in self.topology.local_hosts}
        prepared: Prepared | None = None
        if step is not None:
            step = layout.as_step(step)
            if self._prepared is not None and self._prepared.step == step:
                prepared = self._prepared
                tiers = self._tier.host_tiers(prepared)
        elif self.options.replicators:
            # A fresh agreement: hosts may have been lost since latest_step() asked.
            prepared = self._prepared or self._prepare_with_replicators(
                background=self._may_defer())
            step, tiers = prepared.step, self._tier.host_tiers(prepared)
            if step is None:
                self._unrestorable(prepared.lost)
                raise StepNotFoundError("the replicators agree that no step can be restored "
                                        "on this job's hosts (none was saved, or none "
                                        "completely)")
        self._prepared = None
        # Restoring the newest step fences off newer ones: only saves that did not
        # finish on every host can be newer, and the job will save their numbers
        # again (the replicators fence their own hosts when they agree).
        newest = step is None or step == self._latest
        t_prepared = time.perf_counter()
        if step is None:
            steps = self.all_steps()
            if not steps:
                self._unrestorable()
                raise StepNotFoundError(f"no step is committed on every host of this job "
                                        f"({self._where()})")
            step = steps[-1]
        run = prepared.run if prepared is not None and prepared.step == step else ""
        if not run:  # no agreed run: that the hosts' copies are one run's is asked here
            self._inventory.check_one_run(step)
        error: MtcError | None = None
        result: Any = None
        nbytes = 0
        self.last_restore_seconds = {}
        fetched_before = self._dispatch.network_bytes()
        try:
            saved, result = self._load(step, target, args, prepared, run)
            nbytes = sum(m.nbytes for m in saved.manifests.values())
        except MtcError as e:
            error = e
        # A shard that failed verification while loading was quarantined by the
        # host that read it; its replicator fetches a verified copy from another
        # holder when asked to prepare again. Once, within the restore timeout,
        # and every process together (the replicators agree again).
        if self.options.replicators and multihost.any_process(
                isinstance(error, CorruptShardError)):
            left = self.options.restore_timeout_s - (time.perf_counter() - t0)
            log.warning("restore of step %d found a corrupt shard (%s); healing through "
                        "the replicators (%.0fs left)", step, error, left)
            if left > 0:
                try:
                    prepared = self._prepare_with_replicators(timeout_s=left)
                    healed = prepared.step
                    if healed is None or (requested is not None and healed != requested):
                        raise StepNotFoundError(f"after healing, the replicators agree on "
                                                f"step {healed}", step=requested)
                    step, error, tiers = healed, None, self._tier.host_tiers(prepared)
                    saved, result = self._load(step, target, args, run=prepared.run)
                    nbytes = sum(m.nbytes for m in saved.manifests.values())
                except MtcError as e:
                    error = e
        # Every process fails together, or none: a process that restored while
        # another could not would deadlock the job at its next collective.
        if multihost.any_process(error is not None) and error is None:
            error = ShardUnavailableError("another process could not restore this step",
                                          step=step)
        if error is not None:
            raise error
        if self._dispatch.network_bytes() > fetched_before:
            # Regions this process read from other hosts' copies, over the network.
            tiers = {h: farthest({0: t, 1: "peer"}) for h, t in tiers.items()}
        self.last_restore_tiers = tiers
        self.last_restore_tier = farthest(tiers)
        self.last_restore_seconds.update({"prepare": t_prepared - t0,
                                          "load": time.perf_counter() - t_prepared})
        self._last_saved = max(step, self._last_saved or 0)
        if newest and not self.options.replicators and not self.options.read_only:
            self._fence(step)
        self._latest = None
        self._inventory.relearn()
        if not self.options.read_only:
            # Saves from here on are another run's: what this run saved after the
            # restored step (fenced, or never finished) can never mix with them.
            self._run = runs.shared_run_id()
        log.info("mtc: restored step %d: %d bytes in %.3fs from the %s tier (hosts: %s)",
                 step, nbytes, time.perf_counter() - t0, self.last_restore_tier,
                 ", ".join(f"{h}={t}" for h, t in sorted(tiers.items())))
        return result

    def _fence(self, step: int) -> None:
        """Delete this job's hosts' steps newer than ``step`` (the newest complete
        one, just restored): each is a save some host never finished."""
        held = self._inventory.held()
        for s in sorted({s for steps in held.values() for s in steps if s > step}):
            hosts = [h for h in self.topology.local_hosts if s in held.get(h, ())]
            if hosts:
                log.info("mtc: step %d was committed on hosts %s only: deleted (fenced off "
                         "after restoring step %d)", s, hosts, step)
                self._dispatch.delete(s, hosts)
                self._inventory.forget(s)

    def _where(self) -> str:
        """Where this manager's steps are, as the user configured it."""
        if self.options.sidecars:
            return f"the RAM disks behind sidecars {', '.join(self.options.sidecars)}"
        return str(self.local_dir)

    def _load(self, step: int, target: Any, args: Any,
              prepared: Prepared | None = None, run: str = "") -> tuple[SavedStep, Any]:
        """The step's saved tree and ``target`` loaded from it (mtc.restore.step);
        the hosts whose data ``prepared`` says is on its way are waited for only
        where the other hosts' copies do not cover their regions."""
        if prepared is None or not prepared.pending:
            return self._reader.load(step, target, args, run=run)
        tier = self._tier
        return self._reader.load(step, target, args, pending=tier.pending_hosts(prepared),
                                 wait_pending=lambda: tier.wait_local(prepared),
                                 seconds=self.last_restore_seconds, run=run,
                                 pending_timeout_s=self.options.restore_timeout_s)

    def _may_defer(self) -> bool:
        """Whether a restore may start before every host's data is local: this
        process plans the reads of every host (one controller), so it can read a
        replaced host's regions from other hosts' copies."""
        return (self.options.restore_while_fetching and self._network is None
                and len(self.topology.local_hosts) == self.topology.num_hosts)

    def _prepare_with_replicators(self, timeout_s: float | None = None, *,
                                  background: bool = False) -> Prepared:
        """The replicators' agreement and each local host's data made local (or,
        ``background``, on its way): see :meth:`ReplicatorTier.prepare`."""
        prepared = self._tier.prepare(timeout_s, background=background)
        self.last_restore_tiers = self._tier.host_tiers(prepared)
        self.last_restore_tier = farthest(self.last_restore_tiers)
        return prepared

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Finish every save, then release the directory. Later calls raise ClosedError."""
        try:
            self._held.release()
        finally:
            if self._watch is not None:
                self._watch.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        self.close()
