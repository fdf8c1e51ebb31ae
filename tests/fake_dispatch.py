"""A fake :class:`mtc.dispatch.Dispatch`: the hosts as in-memory step tables, so the
controller's flows (``mtc/save/flow.py``, ``mtc/restore/flow.py``,
``mtc/inventory.py``) run in a unit test, without processes or RAM disks.

A mock, said here as the guide asks: the real hosts are processes writing files
(tests/test_save_restore.py and the process tests run them). What the flows may
rely on is kept: a save lists the hosts' steps, runs ``before_send`` and sends
nothing when it raises; each host commits its share of a staged save on its own
at :meth:`FakeDispatch.wait` (the hosts' background write), so a host told to
fail (:attr:`FakeDispatch.fail`) commits nothing while the others do, and the
wait raises that host's typed error; retention is the hosts' own
(:func:`mtc.retention.to_delete`, as ``sidecar/ops.py`` applies it). Trees are
plain values only: their leaves live in the manifest, so no array is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from mtc import retention
from mtc.contract import LeafSpec, ReadTask, SaveHeader
from mtc.dispatch.protocol import BeforeSend, Opened, Survey
from mtc.errors import ManifestError, MtcError, StepNotFoundError
from mtc.manifest import LeafEntry, Manifest
from mtc.topology import Topology
from mtc.treepath import encode_value

STEP_BYTES = 1000  # what every committed step takes on a host's RAM disk here


def topology(num_hosts: int, hosts_per_slice: int = 1) -> Topology:
    """One controller serving ``num_hosts`` hosts in host folders (simulated hosts)."""
    return Topology({h: h for h in range(num_hosts)},
                    {h: h // hosts_per_slice for h in range(num_hosts)},
                    tuple(range(num_hosts)), True)


class FakeDispatch:
    """``roots[host][step]``: the manifest of each step a host has committed."""

    def __init__(self, topo: Topology) -> None:
        self.topology = topo
        self.roots: dict[int, dict[int, Manifest]] = {h: {} for h in topo.slice_of_host}
        # Every call that reaches the hosts, in order: (operation, step or None, hosts).
        self.calls: list[tuple[str, int | None, tuple[int, ...]]] = []
        # host -> the error its write of the next staged save raises (then cleared).
        self.fail: dict[int, MtcError] = {}
        # (step, host) whose manifest does not read (a damaged file).
        self.unreadable: set[tuple[int, int]] = set()
        self.free = 1 << 30  # bytes free on every host's RAM disk
        self._staged: list[SaveHeader] = []

    # -- what a test puts on the hosts ---------------------------------------------------

    def commit(self, host: int, step: int, *, run: str = "run-a",
               num_hosts: int | None = None, value: Any = None) -> Manifest:
        """Host ``host`` holds ``step``, written by ``run`` (saved by ``num_hosts``
        hosts, the job's by default); its tree is ``{"v": value}`` (the step's
        number when None)."""
        leaf = LeafEntry("['v']", (("d", "v"),), "value",
                         value=encode_value(step if value is None else value, "v"))
        return self._put(host, step, (leaf,), run, num_hosts)

    def _put(self, host: int, step: int, leaves: tuple[LeafEntry, ...], run: str,
             num_hosts: int | None = None) -> Manifest:
        m = Manifest(step, host, self.topology.slice_of_host[host],
                     self.topology.num_hosts if num_hosts is None else num_hosts,
                     leaves, run=run)
        self.roots[host][step] = m
        return m

    def held(self) -> dict[int, list[int]]:
        return {h: sorted(steps) for h, steps in self.roots.items()}

    def ops(self, op: str) -> list[tuple[int | None, tuple[int, ...]]]:
        """The (step, hosts) of every ``op`` call so far."""
        return [(s, hs) for o, s, hs in self.calls if o == op]

    # -- save ------------------------------------------------------------------------------

    def check_before_save(self, due: bool) -> None:
        pass  # errors of earlier saves come out of wait()

    def save(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray],
             hosts: Sequence[int], before_send: BeforeSend) -> bool:
        before_send(self.survey(hosts, None, manifests=False))
        return self.stage(header, arrays)

    def stage(self, header: SaveHeader, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        assert not arrays, "FakeDispatch holds plain-value trees only"
        self.calls.append(("stage", header.step, self.topology.local_hosts))
        self._staged.append(header)
        return True

    def wait(self) -> None:
        """Each host commits its share of every staged save; a host in ``fail``
        commits nothing of it and its error is raised once all have written."""
        error: MtcError | None = None
        for header in self._staged:
            for h in self.topology.local_hosts:
                failed = self.fail.pop(h, None)
                if failed is not None:
                    error = error or failed
                    continue
                self._put(h, header.step, header.leaves, header.run)
        self._staged.clear()
        if error is not None:
            raise error

    def raise_background_error(self) -> None:
        pass

    def saving(self) -> bool | None:
        return bool(self._staged)

    def saves_in_flight(self, hosts: Sequence[int]) -> int:
        return len(self._staged)

    # -- restore ---------------------------------------------------------------------------

    def load(self, step: int, tasks: Sequence[ReadTask],
             specs: dict[int, LeafSpec]) -> dict[int, jax.Array]:
        raise AssertionError("FakeDispatch holds plain-value trees only: nothing to load")

    def manifest(self, step: int, host: int) -> Manifest:
        self.calls.append(("manifest", step, (host,)))
        if (step, host) in self.unreadable:
            raise ManifestError("manifest does not parse", step=step, host=host)
        try:
            return self.roots[host][step]
        except KeyError:
            raise StepNotFoundError("step is not committed", step=step, host=host) from None

    def read(self, step: int, host: int, tasks: Sequence[ReadTask]) -> list[np.ndarray]:
        raise AssertionError("FakeDispatch holds plain-value trees only: nothing to read")

    def own_for(self, step: int) -> tuple[int, ...]:
        return ()

    def network_bytes(self) -> int:
        return 0

    def networked(self) -> bool:
        return False  # one controller serving every host: no network tier

    # -- the hosts' roots -------------------------------------------------------------------

    def steps(self, hosts: Sequence[int]) -> dict[int, list[int]]:
        self.calls.append(("steps", None, tuple(hosts)))
        return self.held()  # host folders: every root beside the served ones

    def survey(self, hosts: Sequence[int], step: int | None, *,
               manifests: bool = True) -> Survey:
        self.calls.append(("survey", step, tuple(hosts)))
        held = self.held()
        facts = {(s, h): (m.num_hosts, m.run) for h, root in self.roots.items()
                 for s, m in root.items() if (s, h) not in self.unreadable}
        found = {}
        if manifests:
            for h, steps in held.items():
                want = step if step is not None else (steps[-1] if steps else None)
                if want in self.roots[h] and (want, h) not in self.unreadable:
                    found[h] = self.roots[h][want]
        return Survey(step, held, facts, found, self.space(hosts))

    def delete(self, step: int, hosts: Sequence[int]) -> None:
        self.calls.append(("delete", step, tuple(hosts)))
        for h in hosts:
            self.roots[h].pop(step, None)

    def open(self, hosts: Sequence[int], *, read_only: bool,
             identify: bool = False, metadata: str | None = None) -> dict[int, Opened]:
        return {h: Opened() for h in hosts}

    def retain(self, hosts: Sequence[int], complete: Sequence[int], *, max_to_keep: int | None,
               keep_period: int | None, before_write: bool) -> dict[int, tuple[int, int]]:
        for h in hosts:
            for s in retention.to_delete(complete, sorted(self.roots[h]),
                                         max_to_keep=max_to_keep, keep_period=keep_period,
                                         before_write=before_write):
                self.delete(s, [h])
        return self.space(hosts)

    def space(self, hosts: Sequence[int]) -> dict[int, tuple[int, int]]:
        return {h: (self.free, STEP_BYTES if self.roots[h] else 0) for h in hosts}

    def settle(self, hosts: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass
