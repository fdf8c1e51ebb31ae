"""What the hosts a manager serves hold: committed steps, how many hosts saved
each, and which run wrote each host's copy.

A step is complete when every host that saved it holds it and every one of
those copies was written by one run (:mod:`mtc.runs`). Facts read from
manifests are kept: a committed step never changes until it is deleted, and the
manager says so (:meth:`StepInventory.forget`). Only the controller's thread of
a manager uses one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mtc import multihost, runs
from mtc.dispatch import Dispatch
from mtc.errors import MtcError
from mtc.manifest import Manifest
from mtc.topology import Topology

ManifestOf = Callable[[int, int], Manifest]


class StepInventory:
    """The committed steps of the hosts ``dispatch`` reaches, and facts of their
    manifests (read through the dispatcher, cached per step)."""

    def __init__(self, dispatch: Dispatch, topology: Topology) -> None:
        self.dispatch = dispatch
        self.topology = topology
        self._num_hosts: dict[int, int] = {}
        self._runs: dict[int, dict[int, str]] = {}  # step -> host -> run

    def held(self) -> dict[int, list[int]]:
        """Committed steps per host: the local hosts, and with host subfolders
        every ``host-<i>`` beside them (a job restarted with other hosts)."""
        return self.dispatch.steps(self.topology.local_hosts)

    def saved(self, step: int, run: str, hosts: Sequence[int]) -> None:
        """``step`` was just saved by ``run`` on ``hosts`` (of this job's size)."""
        self.forget(step)
        self._num_hosts[step] = self.topology.num_hosts
        self._runs[step] = {h: run for h in hosts}

    def forget(self, step: int) -> None:
        """``step`` was deleted (or is about to be saved again)."""
        self._num_hosts.pop(step, None)
        self._runs.pop(step, None)

    def saved_hosts(self, step: int, holders: Sequence[int],
                    manifest_of: ManifestOf | None = None) -> int:
        """How many hosts took part in saving ``step`` (one holder's manifest)."""
        if step not in self._num_hosts:
            m = (manifest_of or self.dispatch.manifest)(step, holders[0])
            self._num_hosts[step] = m.num_hosts
            self._runs.setdefault(step, {})[holders[0]] = m.run
        return self._num_hosts[step]

    def runs_of(self, step: int, hosts: Sequence[int],
                manifest_of: ManifestOf | None = None) -> dict[int, str]:
        """The run that wrote each of ``hosts``' copy of ``step``."""
        known = self._runs.setdefault(step, {})
        for h in hosts:
            if h not in known:
                m = (manifest_of or self.dispatch.manifest)(step, h)
                known[h] = m.run
                self._num_hosts.setdefault(step, m.num_hosts)
        return {h: known[h] for h in hosts}

    def complete_here(self, listed: dict[int, list[int]] | None = None) -> list[int]:
        """Steps complete as far as this process can see: with host subfolders,
        held by every host that saved them, all of one run; without (each process
        sees its own host only), held by this process's hosts, all of one run
        (:meth:`common` compares them across processes)."""
        by_step: dict[int, list[int]] = {}
        for h, steps in (listed if listed is not None else self.held()).items():
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

    def common(self, listed: dict[int, list[int]] | None = None) -> list[int]:
        """Steps complete on every host (collective in multi-controller JAX: each
        process's complete steps, written by the same run everywhere)."""
        complete = self.complete_here(listed)
        if self.topology.subdirs:
            return multihost.common_steps(complete)
        keys = {s: runs.run_key(runs.one_run(self.runs_of(s, self.topology.local_hosts)) or "")
                for s in complete}
        return multihost.common_steps(complete, keys)

    def run_of(self, step: int, hosts: Sequence[int]) -> str | None:
        """The one run that wrote ``hosts``' copies of ``step`` (None: mixed)."""
        return runs.one_run(self.runs_of(step, hosts))
