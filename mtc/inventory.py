"""What the hosts a manager serves hold: committed steps, how many hosts saved
each, and which run wrote each host's copy.

A step is complete when every host that saved it holds it and every one of
those copies was written by one run (:mod:`mtc.runs`). Facts read from
manifests are kept: a committed step never changes until it is deleted, and the
manager says so (:meth:`StepInventory.forget`). Only the controller's thread of
a manager uses one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from mtc import fencing, multihost, runs
from mtc.dispatch import Dispatch
from mtc.dispatch.protocol import Survey
from mtc.errors import DataLossError, MixedRunError, MtcError
from mtc.manifest import Manifest
from mtc.topology import Topology

# The manager's log lines keep one logger name, the one users configure.
log = logging.getLogger("mtc.manager")

ManifestOf = Callable[[int, int], Manifest]


class StepInventory:
    """The committed steps of the hosts ``dispatch`` reaches, and facts of their
    manifests (read through the dispatcher, cached per step)."""

    def __init__(self, dispatch: Dispatch, topology: Topology) -> None:
        self.dispatch = dispatch
        self.topology = topology
        self._num_hosts: dict[int, int] = {}
        self._runs: dict[int, dict[int, str]] = {}  # step -> host -> run
        # Multi-controller JAX: the steps complete on every host, learnt collectively
        # (None: not yet, or not since the last restore; see :meth:`complete_everywhere`).
        self._everywhere: set[int] | None = None
        # The answer of the last :meth:`held` (one controller): a restore that
        # picked its step from it reads the step's manifests from it too.
        self.last_survey: Survey | None = None

    @property
    def sees_own_host_only(self) -> bool:
        """Each process sees its own host's RAM disk only (multi-controller JAX):
        whether a step is complete is a question for every process."""
        import jax

        return not self.topology.subdirs and jax.process_count() > 1

    def held(self, *, manifests: bool = False) -> dict[int, list[int]]:
        """Committed steps per host: the local hosts, and with host subfolders
        every ``host-<i>`` beside them (a job restarted with other hosts). One
        controller asks every host once for its steps and what each step's
        manifest says (:meth:`learn`); with ``manifests`` (a restore of the newest
        step, which reads them next) also each host's manifest of its newest step,
        and keeps that answer as ``last_survey``. Without, the controller has no
        manifest to parse (a model's has thousands of shards per host): what
        retention, fencing and listing steps need."""
        if self.sees_own_host_only:
            return self.dispatch.steps(self.topology.local_hosts)
        survey = self.dispatch.survey(self.topology.local_hosts, None, manifests=manifests)
        self.learn(survey)
        self.last_survey = survey if manifests else None
        return survey.held

    def learn(self, survey: Survey) -> None:
        """What the hosts' manifests say of each step they hold (fresher than
        anything kept: a step deleted and saved again may be another run's)."""
        for (step, host), (num_hosts, run) in survey.facts.items():
            self._num_hosts[step] = num_hosts
            self._runs.setdefault(step, {})[host] = run

    def saved(self, step: int, run: str, hosts: Sequence[int]) -> None:
        """``step`` was just saved by ``run`` on ``hosts`` (of this job's size)."""
        self.forget(step)
        self._num_hosts[step] = self.topology.num_hosts
        self._runs[step] = {h: run for h in hosts}
        if self._everywhere is not None:
            self._everywhere.add(step)

    def forget(self, step: int) -> None:
        """``step`` was deleted (or is about to be saved again)."""
        self.last_survey = None
        self._num_hosts.pop(step, None)
        self._runs.pop(step, None)
        if self._everywhere is not None:
            self._everywhere.discard(step)

    def relearn(self) -> None:
        """The hosts' steps may have changed behind this manager (a restore: the
        replicators fenced or fetched): :meth:`complete_everywhere` asks again."""
        self.last_survey = None
        self._everywhere = None

    def complete_everywhere(self, listed: dict[int, list[int]]) -> set[int]:
        """Steps complete on every host of the job (``listed``: this process's hosts'
        committed steps). Multi-controller JAX: asked of every process once (a
        collective) at the first call after the manager started or restored (every
        process saves the same steps, so every one calls it then), then kept as
        this manager saves and deletes; elsewhere as :meth:`complete_here` sees it."""
        if not self.sees_own_host_only:
            return set(self.complete_here(listed))
        if self._everywhere is None:
            self._everywhere = set(self.common(listed))
        return self._everywhere

    def saved_hosts(self, step: int, holders: Sequence[int],
                    manifest_of: ManifestOf | None = None) -> int:
        """How many hosts took part in saving ``step`` (one holder's manifest)."""
        if step not in self._num_hosts:
            m = (manifest_of or self.dispatch.manifest)(step, self._copy_of(step, holders[0]))
            self._num_hosts[step] = m.num_hosts
            self._runs.setdefault(step, {})[holders[0]] = m.run
        return self._num_hosts[step]

    def runs_of(self, step: int, hosts: Sequence[int],
                manifest_of: ManifestOf | None = None) -> dict[int, str]:
        """The run that wrote each of ``hosts``' copy of ``step``."""
        known = self._runs.setdefault(step, {})
        for h in hosts:
            if h not in known:
                m = (manifest_of or self.dispatch.manifest)(step, self._copy_of(step, h))
                known[h] = m.run
                self._num_hosts.setdefault(step, m.num_hosts)
        return {h: known[h] for h in hosts}

    def _copy_of(self, step: int, host: int) -> int:
        """The saving host whose data of ``step`` local host ``host``'s RAM disk holds:
        itself, but in multi-controller JAX after a job came back on other hosts
        (host 0 of this job may hold host 2's data of a step the larger job saved)."""
        own = self.dispatch.own_for(step) if self.sees_own_host_only else ()
        return own[0] if own else host

    def complete_here(self, listed: dict[int, list[int]] | None = None, *,
                      manifests: bool = False) -> list[int]:
        """Steps complete as far as this process can see: with host subfolders,
        held by every host that saved them, all of one run; without (each process
        sees its own host only), held by this process's hosts, all of one run
        (:meth:`common` compares them across processes)."""
        by_step: dict[int, list[int]] = {}
        if listed is None:
            listed = self.held(manifests=manifests)
        for h, steps in listed.items():
            for s in steps:
                by_step.setdefault(s, []).append(h)
        complete = []
        for s, holders in sorted(by_step.items()):
            try:
                if not self.topology.subdirs:  # other hosts' roots are not visible here
                    need: Sequence[int] = self.topology.local_hosts
                    if not set(need) <= set(holders):
                        continue
                else:
                    need = range(self.saved_hosts(s, holders))
                    if not set(need) <= set(holders):
                        continue
                if runs.one_run(self.runs_of(s, need)) is None:
                    continue  # two runs' bytes under one number: never a step
            except MtcError:
                continue  # an unreadable manifest: never offered as a step
            complete.append(s)
        return complete

    def common(self, listed: dict[int, list[int]] | None = None, *,
               manifests: bool = False) -> list[int]:
        """Steps complete on every host (collective in multi-controller JAX: each
        process's complete steps, written by the same run everywhere); ``manifests``
        as :meth:`held` says."""
        complete = self.complete_here(listed, manifests=manifests)
        if self.topology.subdirs:
            return multihost.common_steps(complete)
        keys = {s: runs.run_key(runs.one_run(self.runs_of(s, self.topology.local_hosts)) or "")
                for s in complete}
        return multihost.common_steps(complete, keys)

    def run_of(self, step: int, hosts: Sequence[int]) -> str | None:
        """The one run that wrote ``hosts``' copies of ``step`` (None: mixed)."""
        return runs.one_run(self.runs_of(step, hosts))

    def check_one_run(self, step: int) -> None:
        """Raise :class:`MixedRunError` unless every copy of ``step`` the job's hosts
        hold was written by one run. In multi-controller JAX each process sees its
        own host: asked of every process (collective), before anything is read; a
        host holding none (a job grown onto hosts that did not save it, reading
        through the replicators) has no say. Elsewhere the loader sees every host's
        manifest and checks them itself."""
        if not self.sees_own_host_only:
            return
        held = self.held()
        mine = [h for h in self.topology.local_hosts if step in held.get(h, ())]
        key = -1  # no copy here (or an unreadable one: the loader names it)
        if mine:
            try:
                one = self.run_of(step, mine)
                key = -2 if one is None else runs.run_key(one)
            except MtcError:
                pass
        keys = multihost.every_value(key)
        if len({k for k in keys if k != -1}) > 1:
            by_key: dict[int, list[int]] = {}
            for process, k in enumerate(keys):
                if k != -1:
                    by_key.setdefault(k, []).append(process)
            raise MixedRunError(
                f"the processes' hosts hold copies of this step written by different runs "
                f"(processes {' / '.join(str(p) for p in by_key.values())} each hold one "
                f"run's): it is never restored", step=step)

    # -- steps that cannot be restored ------------------------------------------------

    def fence_after(self, step: int, this_run: str,
                    listed: dict[int, list[int]] | None = None) -> None:
        """After ``step`` was restored: delete this job's hosts' copies of newer steps
        that an earlier run left incomplete (:func:`mtc.fencing.to_fence`: a step
        every host that saved it holds is never deleted here), each step named in
        one INFO line. ``listed``: the hosts' steps as the restore's own survey found
        them (else asked now); ``this_run``: the run saving now. Collective in
        multi-controller JAX (whether a step is complete is asked of every process)."""
        held = listed if listed is not None else self.held()
        complete: set[int] | None = None
        if self.sees_own_host_only:
            complete = set(self.common(held))  # every process calls it: restore is collective
        newer = sorted({s for steps in held.values() for s in steps if s > step})
        saved: dict[int, int] = {}
        copies: dict[int, dict[int, str]] = {}
        for s in newer:
            holders = sorted(h for h, steps in held.items() if s in steps)
            try:
                if complete is None:
                    saved[s] = self.saved_hosts(s, holders)
                copies[s] = self._readable_runs(s, holders)
            except MtcError as e:  # unsure what it is: never deleted
                log.debug("mtc: step %d kept after restoring step %d: %s", s, step, e)
        for f in fencing.to_fence(step, held, saved, copies, this_run, complete=complete):
            hosts = [h for h in f.hosts if h in self.topology.local_hosts]
            if not hosts:
                continue
            log.info("mtc: step %d deleted on hosts %s after restoring step %d: %s",
                     f.step, hosts, step, f.why)
            self.dispatch.delete(f.step, hosts)
            self.forget(f.step)

    def _readable_runs(self, step: int, hosts: Sequence[int]) -> dict[int, str]:
        """The run of each of ``hosts``' copies of ``step`` whose manifest reads."""
        found: dict[int, str] = {}
        for h in hosts:
            try:
                found.update(self.runs_of(step, [h]))
            except MtcError as e:
                log.debug("mtc: host %d's manifest of step %d: %s", h, step, e)
        return found

    def nothing_restorable(self, lost: str = "", *, start_over: bool,
                           read_only: bool) -> None:
        """No step can be restored: fine when the hosts hold none (a new job); when
        some do (another host's data of every step is gone), a
        :class:`DataLossError` naming what is gone, or with ``start_over``
        (``Options(if_data_lost="start_over")``) those steps deleted on this job's
        hosts, so that it saves their numbers again from scratch."""
        held = {h: steps for h, steps in self.held().items() if steps}
        if not multihost.any_process(bool(held) or bool(lost)):
            return
        what = lost or "; ".join(f"host {h} holds steps {steps}" for h, steps in
                                 sorted(held.items())) or "other processes' hosts hold steps"
        if not start_over:
            raise DataLossError(
                f"no step can be restored: the data of some host of every step is gone, "
                f"while others still hold steps ({what}). Bring the data back (restart the "
                f"lost host's replicator, or restore its backup) and retry, or start from "
                f"scratch with Options(if_data_lost='start_over')")
        log.warning("mtc: no step can be restored (%s); starting over as asked "
                    "(if_data_lost='start_over'): deleting this job's unrestorable steps", what)
        if not read_only:
            for step in sorted({s for steps in held.values() for s in steps}):
                self.dispatch.delete(step, [h for h, steps in held.items() if step in steps])
                self.forget(step)
