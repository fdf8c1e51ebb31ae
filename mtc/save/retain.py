"""Controller side of a manager's retention and of room on the RAM disks: which
steps its policy (``max_to_keep``, ``keep_period``, ``best_fn``, Orbax's
``preservation_policy`` and ``keep_time_interval``) deletes, and freeing room
before a step is written. The policies are pure (:mod:`mtc.retention`,
:mod:`mtc.policies`); :class:`Retention` applies them through the dispatcher, as
part of :class:`mtc.save.flow.SaveFlow`.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any

from mtc import multihost, policies, retention
from mtc.dispatch import Dispatch
from mtc.errors import MtcError
from mtc.inventory import StepInventory
from mtc.options import Options
from mtc.topology import Topology

# The manager's log lines keep one logger name, the one users configure.
log = logging.getLogger("mtc.manager")


def wall_clock() -> float:
    """Seconds since the epoch, read as Orbax reads the time of a save
    (``datetime.datetime.now(tz=utc)``, looked up at each call): the time-based
    policies (``keep_time_interval``, ``EveryNSeconds``, ``minimum_interval_secs``)
    then see the clock a user's test fakes for Orbax (``mock.patch("datetime.datetime")``)
    as Orbax's would, and a step's time is wall time, as Orbax's."""
    return datetime.datetime.now(datetime.UTC).timestamp()


class Retention:
    """The retention half of :class:`mtc.save.flow.SaveFlow`, which sets every
    attribute below."""

    options: Options
    dispatch: Dispatch
    topology: Topology
    inventory: StepInventory
    staged: set[int]
    unreplicated: frozenset[int]
    metrics_of_step: Callable[[int], Any] | None
    time_of_step: Callable[[int], float | None] | None
    _metrics: dict[int, Any]
    _saved_at: dict[int, float]
    _times_read: set[int]
    _saved_since_retention: bool

    def wait_saves(self) -> None:
        raise NotImplementedError  # SaveFlow's

    def _retains(self) -> bool:
        o = self.options
        return ((o.max_to_keep is not None or o.preservation_policy is not None
                 or o.keep_time_interval is not None)
                and not o.replicators and not o.read_only)

    def _policy(self) -> Any:
        """The preservation policy retention applies: the user's, or Orbax's reading of
        its options where ``keep_time_interval`` needs the steps' times or
        ``max_to_keep=0`` keeps only what the others keep (and the newest); else None
        (the hosts apply ``max_to_keep``/``keep_period`` by step numbers alone)."""
        o = self.options
        if o.preservation_policy is not None or (o.keep_time_interval is None
                                                 and o.max_to_keep != 0):
            return o.preservation_policy
        t = o.keep_time_interval
        return policies.from_options(
            max_to_keep=o.max_to_keep, keep_period=o.keep_period,
            keep_time_interval_s=None if t is None else t.total_seconds()
            if isinstance(t, datetime.timedelta) else float(t), best_fn=o.best_fn,
            best_mode=o.best_mode, keep_without_metrics=o.keep_checkpoints_without_metrics)

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
        policy = self._policy()
        if policy is not None:
            self._retain_preserved(complete, policy)
            return {}
        if self.options.best_fn is not None:
            self._retain_best(complete)
            return {}
        return self.dispatch.retain(self.topology.local_hosts, complete,
                                    max_to_keep=self.options.max_to_keep,
                                    keep_period=self.options.keep_period,
                                    before_write=before_write)

    def _retain_best(self, complete: list[int]) -> None:
        """Orbax's ``best_fn`` retention over the complete steps (their metrics read
        once from a manifest each), applied as Orbax does after each commit: while
        a step is written, ``max_to_keep`` others stay."""
        o = self.options
        assert o.best_fn is not None and self.metrics_of_step is not None
        for s in complete:
            if s not in self._metrics:
                self._metrics[s] = self.metrics_of_step(s)
        for s in retention.best_to_delete(
                complete, self._metrics, max_to_keep=o.max_to_keep, keep_period=o.keep_period,
                best_fn=o.best_fn, best_mode=o.best_mode,
                keep_without_metrics=o.keep_checkpoints_without_metrics):
            log.info("mtc: step %d deleted: not among the %s best by best_fn", s, o.max_to_keep)
            self.dispatch.delete(s, self.topology.local_hosts)
            self.inventory.forget(s)
            self._metrics.pop(s, None)

    def _retain_preserved(self, complete: list[int], policy: Any) -> None:
        """Orbax's ``preservation_policy`` over the complete steps (metrics read once
        per step where a ``BestN`` ranks them), deleting what it does not keep. In
        multi-controller JAX a step goes only where every process's policy drops it
        (collective: a step is never deleted on some hosts only)."""
        ranks = policies.uses_metrics(policy)
        if ranks and self.metrics_of_step is not None:
            for s in complete:
                if s not in self._metrics:
                    self._metrics[s] = self.metrics_of_step(s)
        timed = policies.uses_time(policy)
        infos = [policies.StepInfo(s, self._metrics.get(s),
                                   self._time_of(s) if timed else self._saved_at.get(s))
                 for s in sorted(complete)]
        gone = multihost.common_steps(policies.to_delete(policy, infos, now=wall_clock()))
        for s in gone:
            log.info("mtc: step %d deleted: not kept by the preservation_policy (%s)", s,
                     type(policy).__name__)
            self.dispatch.delete(s, self.topology.local_hosts)
            self.inventory.forget(s)
            self._metrics.pop(s, None)
            self._saved_at.pop(s, None)
            self._times_read.discard(s)

    def _time_of(self, step: int) -> float | None:
        """When ``step``'s save began: this manager's record, else (a step saved before
        it) its manifest's, read once; None where neither says (a step saved by an mtc
        that did not record it: time-based policies keep it, and a schedule takes it
        as long ago). A manifest no host can give now is asked for again next time."""
        if step not in self._saved_at and step not in self._times_read \
                and self.time_of_step is not None and step not in self.staged:
            try:
                t = self.time_of_step(step)
            except MtcError as e:
                log.debug("mtc: the save time of step %d is not known yet: %s", step, e)
                return None
            self._times_read.add(step)
            if t is not None:
                self._saved_at[step] = t
        return self._saved_at.get(step)

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
