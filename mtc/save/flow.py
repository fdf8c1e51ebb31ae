"""Controller side of saving: the schedule, room on the RAM disks, retention, and
handing a staged step to the hosts through the dispatcher.

Only the controller's thread of a manager uses a :class:`SaveFlow`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from mtc import layout, multihost, orbax_args, runs
from mtc.dispatch import Dispatch
from mtc.dispatch.protocol import Survey
from mtc.errors import ConfigError, MtcError, StepExistsError
from mtc.inventory import StepInventory
from mtc.options import Options
from mtc.replicator_watch import ReplicatorWatch
from mtc.save.stage import bytes_on_hosts, prepare
from mtc.topology import Topology

# The manager's log lines keep one logger name, the one users configure.
log = logging.getLogger("mtc.manager")


class SaveFlow:
    """Saves of one manager: what it last saved, the run its manifests name, and
    the hosts whose replicators did not answer the last check.

    ``on_new_step`` runs once a save is about to reach the hosts (a step the
    replicators prepared for a restore is stale from then on); ``where`` names,
    for logs, where the hosts served here keep their steps."""

    def __init__(self, dispatch: Dispatch, topology: Topology, options: Options,
                 inventory: StepInventory, watch: ReplicatorWatch | None, *,
                 on_new_step: Callable[[], None], where: str) -> None:
        self.dispatch = dispatch
        self.topology = topology
        self.options = options
        self.inventory = inventory
        self.watch = watch
        self._on_new_step = on_new_step
        self._where = where
        # The run identity written into every manifest this manager saves (mtc.runs):
        # fixed now and again after each restore, the same in every process.
        self.run = "" if options.read_only else runs.shared_run_id()
        self.last_saved: int | None = None
        # Hosts whose replicator did not answer the last check: their RAM disks are
        # kept within max_to_keep meanwhile.
        self.unreplicated: frozenset[int] = frozenset()
        # Whether this manager saved since retention last ran (a restore applies it
        # only then: a restarted job's restore asks the hosts nothing it needn't).
        self._saved_since_retention = False

    # -- schedule -------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        if self.last_saved is not None and step <= self.last_saved:
            return False
        return self.on_schedule(step)

    def on_schedule(self, step: int) -> bool:
        return (step % self.options.save_interval_steps == 0
                or multihost.reached_preemption(step))

    def restored(self, step: int) -> None:
        """``step`` was restored: saves from here on are another run's, so what this
        run saved after it (fenced, or never finished) can never mix with them."""
        self.last_saved = max(step, self.last_saved or 0)
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

    def save(self, step: Any, state: Any, *, force: bool, metrics: Any, args: Any) -> bool:
        self.writable("save")
        if orbax_args.is_orbax_args(state):
            raise ConfigError(orbax_args.positional_hint("save"))
        if args is not None:
            if state is not None:
                raise ConfigError("save() takes the state or args=, not both")
            state = orbax_args.save_state(args)
        elif state is None:
            raise ConfigError("save() needs the state (or args=ocp.args.StandardSave(state))")
        step = layout.as_step(step)
        due = force or self.on_schedule(step)
        self.dispatch.check_before_save(due)
        if not due:
            return False
        if self.watch is not None:
            self.unreplicated = self.watch.poll()
        t0 = time.perf_counter()
        header, arrays = prepare(step, state, skip_if_busy=self.options.if_busy == "skip",
                                 metrics=metrics, run=self.run, ranks=self._saved_ranks())

        def before_send(survey: Survey) -> None:
            # Nothing is sent to a host before this returned, and nothing at all
            # when it raised.
            self.inventory.learn(survey)
            held = self._replace_partial(step, survey.held)
            self._on_new_step()
            self._make_room(held)

        hosts = self.topology.local_hosts
        staged = self.dispatch.save(header, arrays, hosts, before_send)
        if staged:
            self._saved_since_retention = True
            self.last_saved = step
            # The manifests say this job's host count and this run: no host need be asked.
            self.inventory.saved(step, self.run, hosts)
            log.info("mtc: save step %d: %d bytes of %s staged in %.3fs; writing to %s in the "
                     "background", step,
                     bytes_on_hosts(arrays, self.topology.host_of_device, len(hosts)),
                     f"host {hosts[0]}" if len(hosts) == 1 else f"{len(hosts)} hosts",
                     time.perf_counter() - t0, self._where)
        return staged

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
                raise StepExistsError("step is already committed", step=step,
                                      host=partial[0] if partial else None)
        if not partial:
            return held
        log.warning("step %d was committed on hosts %s only (or by another run on some); "
                    "replacing it", step, partial)
        self.dispatch.delete(step, partial)
        self.inventory.forget(step)
        return {h: [s for s in steps if s != step] for h, steps in held.items()}

    def delete(self, step: int) -> None:
        """Delete a committed step on every host this process serves."""
        self.writable("delete")
        self.wait_until_finished()
        self.dispatch.delete(step, self.topology.local_hosts)
        self.inventory.forget(step)

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
        except MtcError as e:
            error = e
        multihost.barrier("mtc.wait_until_finished")
        if error is not None:
            raise error

    def writable(self, call: str) -> None:
        if self.options.read_only:
            raise ConfigError(f"{call}() on a read-only CheckpointManager of {self._where}")

    # -- room and retention -----------------------------------------------------------

    def _retains(self) -> bool:
        return (self.options.max_to_keep is not None and not self.options.replicators
                and not self.options.read_only)

    def _apply_retention(self, *, before_write: bool = False,
                         held: dict[int, list[int]] | None = None) -> dict[int, tuple[int, int]]:
        """Delete what :func:`mtc.retention.to_delete` says, on every host served here;
        returns each host's (free bytes, bytes of its newest step), as ``space``.
        ``held``: the hosts' committed steps, when the caller has just listed them."""
        if not self._retains():
            return {}
        if not before_write:
            self._saved_since_retention = False
        complete = self.inventory.common(held)
        return self.dispatch.retain(self.topology.local_hosts, complete,
                                    max_to_keep=self.options.max_to_keep,
                                    keep_period=self.options.keep_period,
                                    before_write=before_write)

    def _saves_in_flight(self) -> int:
        return self.dispatch.saves_in_flight(self.topology.local_hosts)

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
            space = self.dispatch.space(self.topology.local_hosts)
        return any(newest and free < newest * 1.05 * steps_coming
                   for free, newest in space.values())

    def _retain_unreplicated(self, held: dict[int, list[int]] | None) -> None:
        """A host whose replicator does not answer has nobody cleaning its RAM disk:
        before a step is written, its newest ``max_to_keep`` (2 when None) steps are
        kept, from its own view (the others' progress is the replicators' to know;
        saves go in step, so its newest steps are the job's)."""
        hosts = [h for h in self.unreplicated if h in self.topology.local_hosts]
        if not hosts or self.options.read_only:
            return
        held = held if held is not None else self.dispatch.steps(hosts)
        keep = self.options.max_to_keep or 2
        for h in hosts:
            steps = held.get(h, [])
            if len(steps) >= keep:
                self.dispatch.retain([h], steps, max_to_keep=keep,
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
        self.dispatch.settle(self.topology.local_hosts)
        if multihost.any_process(self._short_of_space()):
            self.wait_saves()
            self._apply_retention(before_write=True)
            self.dispatch.settle(self.topology.local_hosts)
