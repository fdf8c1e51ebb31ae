"""Controller side of a restore, one step: the manifests of the hosts that hold
it, then the target loaded from them (planned and read by mtc.restore.load).

A restore whose replicators still bring a replaced host's data plans without
that host first (its regions read from other hosts' copies of the same
regions), and only where those do not cover a region waits for the data.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax

from mtc import orbax_args, treepath
from mtc.dispatch import Dispatch
from mtc.dispatch.protocol import Survey
from mtc.errors import ShardUnavailableError, StepNotFoundError, TargetMismatchError
from mtc.manifest import Manifest
from mtc.restore.load import restore_tree, saved_items, saved_sharding
from mtc.restore.plan import SavedStep, load_step
from mtc.topology import Topology

log = logging.getLogger(__name__)

# How many hosts saved a step, from one of its holders' manifests (the
# manager's cache, shared with its save path).
SavedHosts = Callable[[int, list[int], Callable[[int, int], Manifest]], int]
PENDING_TIMEOUT_S = 120.0  # Options.restore_timeout_s default
PENDING_POLL_S = 0.2


def _covers(survey: Survey, step: int) -> bool:
    """Whether ``survey`` holds the manifest of ``step`` of every host holding it."""
    holders = [h for h, steps in survey.held.items() if step in steps]
    return bool(holders) and all(
        h in survey.manifests and survey.manifests[h].step == step for h in holders)


class StepReader:
    """Reads a committed step into a target from the hosts ``dispatch`` reaches
    (:meth:`Dispatch.networked`: other hosts' files come over the replicators, in
    multi-controller JAX); ``where`` names, in errors, what the user configured
    (sidecars, a folder)."""

    def __init__(self, dispatch: Dispatch, topology: Topology, where: str,
                 saved_hosts: SavedHosts,
                 mesh: jax.sharding.Mesh | None = None) -> None:
        self.dispatch = dispatch
        # Where arrays restored without a target go (None: numpy, as saved).
        self.mesh = mesh
        self.topology = topology
        self.where = where  # where the steps are, as the user configured it (for errors)
        self._saved_hosts = saved_hosts
        # Whether the last step restored or described was saved as a Composite: what
        # locks in a manager's mode (one item or a Composite) when no save did, as
        # Orbax's restore and metadata do.
        self.saved_composite: bool | None = None

    def load(self, step: int, target: Any, args: Any, *,
             pending: frozenset[int] = frozenset(),
             wait_pending: Callable[[], None] | None = None,
             seconds: dict[str, float] | None = None, run: str = "",
             survey: Survey | None = None,
             pending_timeout_s: float = PENDING_TIMEOUT_S,
             as_numpy: bool = False) -> tuple[SavedStep, Any]:
        """The step's saved tree and ``target`` loaded from it.

        ``pending``: hosts whose data is still on its way (replaced hosts whose
        replicators fetch it in the background), left out of the plan: their
        devices' regions are read from other hosts' copies of the same regions
        (data-parallel replicas). Where those do not cover a region,
        ``wait_pending()`` waits for their data (its seconds in
        ``seconds["wait_pending"]``) and the step is planned again.

        In multi-controller JAX with the network tier, this host's own manifest
        comes first: a target laid out as saved needs nothing else, and no byte
        crosses the network (a job of a thousand hosts does not fetch a million
        manifests to restore where it saved). Only when the target needs a region
        another host saved are every saving host's manifests fetched and the plan
        made again. Every manifest read must name one run (``run``, when the
        replicators agreed on one): else :class:`MixedRunError`. ``survey``: the
        hosts' answer the step was picked from, read again only where it lacks
        the step's manifests.

        A pending host's data was promised by the agreement: until
        ``pending_timeout_s`` has passed since the wait began, a pending host that
        does not list the step yet (its sidecar answering late, the data
        committed a moment after its replicator answered) is asked again, never
        reported as a step that is not committed. After the wait the hosts are
        asked anew (the survey predates the pending hosts' data)."""
        if pending and wait_pending is not None:
            try:
                saved = self.saved_step(step, pending=pending, run=run, survey=survey)
                return saved, self.restore_from(saved, target, args, as_numpy)
            except (ShardUnavailableError, StepNotFoundError) as e:
                # Planned again from the start: nothing was placed on a device yet.
                log.info("mtc: the other hosts' copies of step %d do not cover hosts %s (%s): "
                         "waiting for their data", step, sorted(pending), e)
            t = time.perf_counter()
            wait_pending()
            saved = self._saved_once_listed(step, run, pending, t + pending_timeout_s)
            if seconds is not None:
                seconds["wait_pending"] = time.perf_counter() - t
        else:
            saved = self.saved_step(step, run=run, survey=survey)
        if not self.dispatch.networked():
            return saved, self.restore_from(saved, target, args, as_numpy)
        try:
            return saved, self.restore_from(saved, target, args, as_numpy)
        except ShardUnavailableError:
            pass  # planned on this host's files alone: nothing was read from elsewhere
        log.info("mtc: restore of step %d needs regions other hosts saved: their manifests "
                 "and files come through the replicators", step)
        saved = self.saved_step(step, every_host=True, run=run)
        return saved, self.restore_from(saved, target, args, as_numpy)

    def _saved_once_listed(self, step: int, run: str, pending: frozenset[int],
                           deadline: float) -> SavedStep:
        """:meth:`saved_step` once every pending host lists ``step``, asked again
        until ``deadline`` (``time.perf_counter``) while one does not."""
        while True:
            try:
                return self.saved_step(step, run=run)
            except StepNotFoundError as e:
                if e.host not in pending or time.perf_counter() >= deadline:
                    raise
                log.info("mtc: host %d does not list step %d yet although its replicator "
                         "made it local: asking again", e.host, step)
            time.sleep(PENDING_POLL_S)

    def restore_from(self, saved: SavedStep, target: Any, args: Any,
                     as_numpy: bool = False) -> Any:
        """``target`` (or Orbax ``args``' targets) loaded from ``saved``; without a
        target, arrays onto ``mesh`` unless ``as_numpy`` (:func:`restore_tree`)."""
        mesh = None if as_numpy else self.mesh
        self.saved_composite = saved_items(saved) is not None

        def load(t: Any, prefix: tuple[str, Any] | None = None,
                 name_all: bool | tuple[str, Any] = False) -> Any:
            if isinstance(t, orbax_args.Whole):  # Orbax's args: every saved leaf named
                t, name_all = t.item, name_all or True
            return restore_tree(saved, t, self.topology, self.dispatch, prefix=prefix,
                                mesh=mesh, name_all=name_all)

        if args is None and target is None and saved_items(saved) is not None:
            # Saved as a Composite: every item, as a Composite, as Orbax's restore(step).
            items = {name: load(None, ("d", name))[name] for name in saved_items(saved) or ()}
            return orbax_args.composite_of(items)
        if args is None:
            return load(target)
        request = orbax_args.restore_targets(args)
        if isinstance(request, tuple):
            return load(request[1])
        names = sorted({str(leaf.keys[0][1]) for leaf in saved.leaves
                        if leaf.keys and leaf.keys[0][0] == "d"
                        and not treepath.is_own_leaf(leaf.path)})
        request = request or {name: None for name in names}  # Composite(): every item
        unknown = [name for name in request if name not in names]
        if unknown:
            raise TargetMismatchError(f"Composite items {unknown} were not saved with this "
                                      f"step; its items: {names}", step=saved.step)
        out = {}
        for name, t in request.items():
            out[name] = (load(None, ("d", name)) if t is None else
                         load({name: t.item}, name_all=("d", name)) if isinstance(
                             t, orbax_args.Whole) else load({name: t}))[name]
        return orbax_args.composite_result(args, out)

    def item_metadata(self, step: int, *, composite: bool) -> Any:
        """The saved tree of ``step`` without its arrays: a ``jax.ShapeDtypeStruct``
        per array leaf, with the sharding a restore without a target gives it on the
        manager's mesh (:func:`saved_sharding`), plain values as saved; a
        ``Composite`` of the items when saved as one or ``composite``."""
        saved = self.saved_step(step)
        self.saved_composite = saved_items(saved) is not None

        def meta(leaf: Any) -> Any:
            if leaf.kind == "value":
                return treepath.decode_value(leaf.value)
            dtype = jax.numpy.dtype(leaf.dtype)
            if leaf.kind == "array" and self.mesh is not None:
                return jax.ShapeDtypeStruct(leaf.shape, dtype,
                                            sharding=saved_sharding(leaf, self.mesh))
            return jax.ShapeDtypeStruct(leaf.shape, dtype)

        tree = treepath.unflatten_from_keys([(leaf.keys, meta(leaf)) for leaf in saved.leaves
                                             if not treepath.is_own_leaf(leaf.path)])
        if composite or saved_items(saved) is not None:
            return orbax_args.composite_of(tree or {}, metadata=True)
        return tree

    def saved_step(self, step: int, *, every_host: bool = False,
                   pending: frozenset[int] = frozenset(), run: str = "",
                   survey: Survey | None = None) -> SavedStep:
        """Manifests of ``step``: of every host this process reaches (but the
        ``pending`` hosts, whose data is on its way); ``every_host``
        (multi-controller JAX with the network tier) of every host that saved it.
        One controller asks every host for its steps and its manifest of ``step``
        at once (or reuses ``survey`` where it holds them)."""
        if self.dispatch.networked():
            held = self.dispatch.steps(self.topology.local_hosts)
            holders = sorted(h for h, steps in held.items()
                             if step in steps and h not in pending)
            return self._saved_over_network(step, holders, every_host, run)
        if survey is None or not _covers(survey, step):
            survey = self.dispatch.survey(self.topology.local_hosts, step)
        held = survey.held
        holders = sorted(h for h, steps in held.items() if step in steps and h not in pending)
        for h in self.topology.local_hosts:
            if h not in holders and h not in pending and not self.topology.subdirs:
                raise StepNotFoundError("step is not committed", step=step, host=h)
        if not holders:
            raise StepNotFoundError(f"step is not committed on {self.where}", step=step)
        # Each host's manifest fetched and parsed once per restore, though read twice.
        fetched: dict[int, Manifest] = {h: m for h, m in survey.manifests.items()
                                        if m.step == step}

        def manifest_of(s: int, h: int) -> Manifest:
            if h not in fetched:
                fetched[h] = self.dispatch.manifest(s, h)
            return fetched[h]

        n = self._saved_hosts(step, holders, manifest_of)
        missing = [h for h in range(n) if h not in holders and h in held and h not in pending]
        if missing and self.topology.subdirs:
            raise StepNotFoundError("step is not committed", step=step, host=missing[0])
        saved = load_step(step, [h for h in holders if h < n], manifest_of, run=run)
        saved.listed = held
        return saved

    def _saved_over_network(self, step: int, holders: list[int], every_host: bool,
                            run: str) -> SavedStep:
        """Multi-controller JAX with the network tier, each process alone with its RAM
        disk: this host's manifest of the step, or (``every_host``, or when this host
        saved none of it: a job grown onto more hosts, a host replaced empty) every
        saving host's, which this host's side gets from the network tier. Without
        replicators only this host's files are known (the caller's other path)."""
        fetched: dict[int, Manifest] = {}

        def manifest_of(s: int, h: int) -> Manifest:
            if h not in fetched:
                fetched[h] = self.dispatch.manifest(s, h)
            return fetched[h]

        mine = list(self.dispatch.own_for(step)) if holders else []
        n = self._saved_hosts(step, mine or [0], manifest_of)
        if every_host or not mine:
            return load_step(step, range(n), manifest_of, run=run)
        return load_step(step, mine, manifest_of, run=run)
