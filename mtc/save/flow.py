"""Controller side of saving: the schedule and handing a staged step to the hosts
through the dispatcher (room on the RAM disks and retention: :mod:`mtc.save.retain`).

Only the controller's thread of a manager uses a :class:`SaveFlow`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mtc import layout, multihost, orbax_args, policies, root_lock, runs
from mtc.dispatch import Dispatch
from mtc.dispatch.protocol import Survey
from mtc.errors import (
    ConfigError,
    MtcError,
    SaveError,
    ShardUnavailableError,
    StepNotFoundError,
)
from mtc.inventory import StepInventory
from mtc.options import Options
from mtc.replicator_watch import ReplicatorWatch
from mtc.save.retain import Retention, wall_clock
from mtc.save.stage import bytes_on_hosts, prepare
from mtc.topology import Topology

# The manager's log lines keep one logger name, the one users configure.
log = logging.getLogger("mtc.manager")


class _NotDue(Exception):
    """A save decided from the hosts' answer to the save's own first call (the
    job's first decision): the step is not due after all."""


class SaveFlow(Retention):
    """Saves of one manager: what it last saved, the run its manifests name, and
    the hosts whose replicators did not answer the last check.

    ``on_new_step`` runs once a save is about to reach the hosts (a step the
    replicators prepared for a restore is stale from then on); ``where`` names,
    for logs, where the hosts served here keep their steps."""

    def __init__(self, dispatch: Dispatch, topology: Topology, options: Options,
                 inventory: StepInventory, watch: ReplicatorWatch | None, *,
                 on_new_step: Callable[[], None] = lambda: None, where: str,
                 foreign: dict[int, list[int]] | None = None,
                 metrics_of_step: Callable[[int], Any] | None = None,
                 directory: str | None = None) -> None:
        self.dispatch = dispatch
        # The directory other managers of this process may write too (mtc.root_lock).
        self.directory = directory
        if directory is not None and not options.read_only:
            root_lock.Writers.join(directory, self, self._saves_in_flight)
        self.topology = topology
        self.options = options
        self.inventory = inventory
        self.watch = watch
        self.on_new_step = on_new_step
        self._where = where
        # The run identity written into every manifest this manager saves (mtc.runs):
        # fixed now and again after each restore, the same in every process.
        self.run = "" if options.read_only else runs.shared_run_id()
        # The newest step saved, restored or (learnt at the first save decision)
        # complete on the hosts: saves of steps up to it return False, as Orbax's.
        self.last_saved: int | None = None
        self._newest_learnt = False
        # Steps staged since the saves were last waited for: listed by all_steps()
        # and latest_step() before they commit, as Orbax's are (a restore, and
        # reading a step's manifests, wait for them first). The same in every
        # process of a multi-controller job, which saves the same steps.
        self.staged: set[int] = set()
        # When each step's save began (wall_clock()): what Orbax's time-based policies
        # read; a step saved before this manager: from its manifest (``_time_of``).
        self._saved_at: dict[int, float] = {}
        # Step folders found at start that are not mtc's (per host): never replaced.
        self.foreign = foreign or {}
        # best_fn retention: each step's metrics, read once from a manifest.
        self.metrics_of_step = metrics_of_step
        # A step's save time from its manifest (a step saved before this manager):
        # read once per step, only by the time-based policies.
        self.time_of_step: Callable[[int], float | None] | None = None
        self._times_read: set[int] = set()
        self._metrics: dict[int, Any] = {}
        if options.max_to_keep is None and not options.replicators and not options.read_only:
            log.info("mtc: max_to_keep=None (Orbax's default): every step stays on the RAM "
                     "disk until it is full (then saves fail with RamDiskFullError); "
                     "Options(max_to_keep=N) keeps the newest N")
        # Hosts whose replicator did not answer the last check: their RAM disks are
        # kept within max_to_keep meanwhile.
        self.unreplicated: frozenset[int] = frozenset()
        # Whether this manager saved since retention last ran (a restore applies it
        # only then: a restarted job's restore asks the hosts nothing it needn't).
        self._saved_since_retention = False
        # Orbax's step statistics (mtc.step_stats): when JAX's preemption sync point
        # was reached at a step, and the phases of the last save that wrote.
        self._preempted_at: dict[int, float] = {}
        self.last_save: dict[str, Any] | None = None
        self._previous_began: float | None = None

    def _preempted(self, step: int) -> bool:
        """JAX's preemption sync point at ``step``, noted for its statistics."""
        if preempted := multihost.reached_preemption(step):
            self._preempted_at.setdefault(step, time.time())
        return preempted

    # -- schedule -------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Orbax's rules: ``step`` newer than the newest step saved, restored or
        complete on the hosts, and on the interval, at a preemption sync point, or
        the job's first save (no step yet: Orbax's initial save). Never when
        read-only. Collective in multi-controller JAX the first time."""
        return not self.options.read_only and self._decide(step)

    def _decide(self, step: int) -> bool:
        newest = self._newest()
        if newest is not None and step <= newest:
            return False
        if self.options.save_decision_policy is not None:
            return self._policy_says(step, newest)
        if self.options.should_save_fn is not None:  # it alone decides, as Orbax's
            return (bool(self.options.should_save_fn(step, newest))
                    or self._preempted(step))
        return newest is None or self.on_schedule(step)

    def _policy_says(self, step: int, newest: int | None) -> bool:
        """``Options.save_decision_policy``'s answer (:func:`mtc.policies.save_due`),
        process 0's in multi-controller JAX (collective: times and saves in flight
        differ between processes)."""
        policy = self.options.save_decision_policy
        previous = [] if newest is None else [policies.StepInfo(
            newest, None, self._time_of(newest) if policies.schedule_uses_time(policy)
            else self._saved_at.get(newest))]
        due = policies.save_due(
            policy, step, previous, now=wall_clock(),
            saving=self._saves_in_flight() > 0, preempted=self._preempted(step))
        return bool(multihost.every_value(int(due))[0])

    def _newest(self) -> int | None:
        """The newest step saved or restored here, or complete on the hosts (asked of
        them once: collective in multi-controller JAX, as the first save is)."""
        if not self._newest_learnt:
            self._learn_newest(None)
        return self.last_saved

    def _learn_newest(self, listed: dict[int, list[int]] | None) -> None:
        steps = self.inventory.common(listed)
        if steps and (self.last_saved is None or steps[-1] > self.last_saved):
            self.last_saved = steps[-1]
        self._newest_learnt = True

    def reload(self) -> None:
        """Forget what was learnt of the hosts' steps: asked again when next needed."""
        self._newest_learnt = False
        self._metrics.clear()

    def on_schedule(self, step: int) -> bool:
        interval = self.options.save_interval_steps
        return ((interval > 0 and step % interval == 0)
                or step in (self.options.save_on_steps or ())
                or self._preempted(step))

    def restored(self, step: int) -> None:
        """``step`` was restored: saves from here on are another run's, so what this
        run saved after it (fenced, or never finished) can never mix with them."""
        # Newer steps than this one (not fenced off: an older step restored on
        # purpose) are asked of the hosts at the next save decision, as Orbax's.
        self.last_saved, self._newest_learnt = step, False
        if not self.options.read_only:
            self.run = runs.shared_run_id()

    def saving_in_progress(self) -> bool:
        self.dispatch.raise_background_error()
        saving = self.dispatch.saving()
        if saving is not None:
            return saving
        self.wait_saves()
        return False

    # -- save -----------------------------------------------------------------------

    def save(self, step: Any, state: Any, *, force: bool, metrics: Any, args: Any,
             custom: str | None = None) -> bool:
        if self.skipped_read_only("save"):
            return False
        if orbax_args.is_orbax_args(state):
            raise ConfigError(orbax_args.positional_hint("save"))
        if args is not None:
            if state is not None:
                raise ConfigError("save() takes the state or args=, not both")
            state = orbax_args.save_state(args)
            items = orbax_args.composite_items(args)
        elif state is None:
            raise ConfigError("save() needs the state (or args=ocp.args.StandardSave(state))")
        else:
            items = None
        step = layout.as_step(step)
        called = time.time()
        self._refuse_foreign(step)
        if force and step in self.staged:
            # At once, as Orbax's StepAlreadyExistsError: not later from a commit.
            raise orbax_args.step_exists("save(force=True) of a step this manager is already "
                                         "saving (or saved): force never overwrites",
                                         step=step)
        # The job's first decision needs the hosts' newest step. One controller
        # learns it from the save's own first call (a save stays two calls); the
        # step is then dropped there if it was not due. Multi-controller JAX asks
        # every process first (collective), as the first save always did.
        deferred = (not force and not self.options.read_only and not self._newest_learnt
                    and not self.inventory.sees_own_host_only)
        due = force or deferred or self._decide(step)
        t_check = time.time()
        try:
            self.dispatch.check_before_save(due)
        except ShardUnavailableError as e:
            raise _save_error(e, step) from e
        checked = (t_check, time.time() - t_check)
        if not due:
            return False
        if self.watch is not None:
            self.unreplicated = self.watch.poll()
        t0 = time.perf_counter()
        began = wall_clock()  # the step's time, as Orbax's: when its save began
        header, arrays = prepare(step, state, skip_if_busy=self.options.if_busy == "skip",
                                 metrics=metrics, run=self.run, ranks=self._saved_ranks(),
                                 items=items, custom=custom, saved_at=began)

        def before_send(survey: Survey) -> None:
            # Nothing is sent to a host before this returned, and nothing at all
            # when it raised.
            self.inventory.learn(survey)
            if deferred:
                self._learn_newest(survey.held)
                if not self._decide(step):
                    raise _NotDue
            held = self._replace_partial(step, survey.held)
            self.on_new_step()
            t_room = time.time()
            self._make_room(held)
            retention.append((t_room, time.time() - t_room))

        hosts = self.topology.local_hosts
        if self.directory is not None:
            root_lock.Writers.refuse_concurrent(self.directory, self)
        retention: list[tuple[float, float]] = []
        t_stage = time.time()
        try:
            staged = self.dispatch.save(header, arrays, hosts, before_send)
        except _NotDue:
            return False
        except ShardUnavailableError as e:
            raise _save_error(e, step) from e
        if staged:
            self._saved_since_retention = True
            self.last_saved = max(step, self.last_saved or 0)
            self.staged.add(step)
            self._saved_at[step] = began
            # The manifests say this job's host count and this run: no host need be asked.
            self.inventory.saved(step, self.run, hosts)
            # Orbax's statistics of this save, but for its end (the manager's).
            self.last_save = dict(
                step=step, directory=self.directory or self._where, began=called,
                checked=checked, staged=(t_stage, time.time() - t_stage),
                retention=retention[0] if retention else None,
                synchronous=not self.options.enable_async_checkpointing,
                preempted_at=self._preempted_at.pop(step, None),
                previous_began=self._previous_began)
            self._previous_began = called
            if log.isEnabledFor(logging.INFO):  # its byte count walks every shard
                log.info("mtc: save step %d: %d bytes of %s staged in %.3fs; writing to %s in "
                         "the background", step,
                         bytes_on_hosts(arrays, self.topology.host_of_device, len(hosts)),
                         f"host {hosts[0]}" if len(hosts) == 1 else f"{len(hosts)} hosts",
                         time.perf_counter() - t0, self._where)
        return staged

    def _refuse_foreign(self, step: int) -> None:
        """A step whose folder is another tool's is never replaced. Where this process
        serves one host of many (multi-controller JAX) that host's write fails instead,
        as any host's failed save does (a refusal here would be this process's alone)."""
        held = [h for h, steps in self.foreign.items() if step in steps]
        if held and not self.inventory.sees_own_host_only:
            raise orbax_args.step_exists(
                "a step folder of this number that is not mtc's (no mtc manifest: Orbax's or "
                "another tool's) is there; mtc leaves it alone: save another step number, or "
                "move that folder", step=step, host=held[0])

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

    def _replace_partial(self, step: int, held: dict[int, list[int]]) -> dict[int, list[int]]:
        """``held`` (the hosts' committed steps) once ``step`` may be saved: a step
        committed on every host raises :class:`StepExistsError`; one that a crash
        between hosts' commits left on some hosts only was never a checkpoint, and
        is deleted so that saving it again replaces it."""
        partial = [h for h in self.topology.local_hosts if step in held.get(h, ())]
        if self.inventory.sees_own_host_only or partial:  # the first: collective
            if step in self.inventory.complete_everywhere(held):
                raise orbax_args.step_exists("step is already committed", step=step,
                                             host=partial[0] if partial else None)
        if not partial:
            return held
        log.warning("step %d was committed on hosts %s only (or by another run on some); "
                    "replacing it", step, partial)
        self.dispatch.delete(step, partial)
        self.inventory.forget(step)
        return {h: [s for s in steps if s != step] for h, steps in held.items()}

    def delete(self, step: int) -> None:
        """Delete a committed step on every host this process serves; a step no host
        holds raises :class:`StepNotFoundError` (collective in multi-controller JAX)."""
        if self.skipped_read_only("delete"):
            return
        self.wait_until_finished()
        held = self.inventory.held()
        if not multihost.any_process(any(step in steps for steps in held.values())):
            foreign = [h for h, steps in self.foreign.items() if step in steps]
            raise StepNotFoundError(
                "no host holds this step, nothing deleted" + (
                    f" (the folder of this number on host {foreign[0]} is not mtc's: no mtc "
                    f"manifest, Orbax's or another tool's; mtc leaves it alone)"
                    if foreign else ""), step=step)
        self.dispatch.delete(step, self.topology.local_hosts)
        self.inventory.forget(step)
        self._metrics.pop(step, None)
        self.staged.discard(step)
        if step == self.last_saved:  # its number may be saved again, as in Orbax
            self.last_saved, self._newest_learnt = None, False

    def leave(self) -> None:
        """The manager closes: no longer one of its directory's writers."""
        if self.directory is not None:
            root_lock.Writers.leave(self.directory, self)

    # -- finishing saves --------------------------------------------------------------

    def wait_until_finished(self) -> None:
        self.wait_saves()
        self._apply_retention()

    def finish_for_restore(self) -> None:
        """Before a restore: every save committed, and retention applied after them
        (not at all when this manager saved nothing since it last ran)."""
        self.wait_saves()
        if self._saved_since_retention:
            self._apply_retention()

    def wait_saves(self) -> None:
        error: BaseException | None = None
        try:
            self.dispatch.wait()
        except ShardUnavailableError as e:
            error = _save_error(e, max(self.staged, default=None))
            error.__cause__ = e
        except MtcError as e:
            error = e
        # Committed now, or failed (the error raised here): listed as the hosts say.
        self.staged.clear()
        multihost.barrier("mtc.wait_until_finished")
        if error is not None:
            raise error

    def finish_step(self, step: int) -> None:
        """Before ``step``'s manifests are read: its save committed on this process's
        hosts, if this manager is still writing it (raises its error). Not a
        collective: this process's own saves only."""
        if step in self.staged:
            try:
                self.dispatch.wait()
            except MtcError:
                self.staged.discard(step)
                raise

    def skipped_read_only(self, call: str) -> bool:
        """Whether ``call`` is skipped: on a read-only manager it logs a warning and
        does nothing, as Orbax's (``save`` then returns False)."""
        if self.options.read_only:
            log.warning("mtc: %s() skipped: the CheckpointManager of %s is read-only",
                        call, self._where)
        return self.options.read_only

def _save_error(e: ShardUnavailableError, step: int | None) -> SaveError:
    """A host the save needed did not answer (the dispatch's "unreachable", a restore's
    word): a save error, naming the step, the host and this process. Steps staged on
    that host since it last answered are not committed there."""
    import jax

    return SaveError(f"save failed in process {jax.process_index()}: host {e.host} did not "
                     f"answer ({e.message}); the step is not committed there (the host, or "
                     f"its sidecar, was lost or restarted: restore to go on)",
                     step=step, host=e.host)
