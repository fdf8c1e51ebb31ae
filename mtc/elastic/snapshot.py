"""The in-memory snapshot of a training state, with Orbax's ``Snapshotter`` interface.

:class:`Snapshotter` keeps the newest state a training loop handed it in host
memory (``pinned_host`` where the platform has it) on every device that held the
state, so that after losing a slice or a host the loop reloads it onto whatever
mesh is left. Its methods mean what ``ocp.v1.training.pathways.Snapshotter``'s
do: ``save`` is asynchronous and skipped while a copy is in flight; ``load``
reshards onto ``abstract_state``'s shardings; ``latest.step``; ``join``.

What it adds: given an :class:`mtc.CheckpointManager` (``manager=``), ``load``
falls back, when the surviving devices do not hold every shard, to the newest
step that manager restores from any tier, and ``last_load_tier`` says from
where (``"memory"``, ``"local"``, ``"peer"``, ``"backup"``). Without one it
raises :class:`SnapshotUnavailableError`, a ``RuntimeError`` as Orbax raises.

Where the snapshot lives: where every device of the state is this process's own
accelerator (a multi-controller process), in this process's numpy memory, one
replica of each shard, brought from the copy in device memory by
``device_get`` on a thread of the snapshotter's (``mtc-snapshot-fetch``:
:mod:`mtc.elastic.host_copy` says why); on Pathways in ``pinned_host`` memory on
each device's host, as Orbax's does, by a ``device_put`` left to the runtime (on
CPU devices, whose memory is the host's, the same way). ``host_copies`` chooses ("numpy",
"pinned"; None: as said).

Threads: a save's copy is dispatched and left to the runtime or the fetch
thread; the next ``save``, ``latest`` or ``join`` sees whether it is done. One
thread (the training loop) calls every method. A snapshot replaced in host
memory that came from an accelerator is released on a thread of the
snapshotter's own (started with the first, joined by :meth:`Snapshotter.close`
with the fetch thread): on a TPU v5e host freeing 1 GiB of pinned host memory
took 0.3 to 0.55 s, which the loop would wait for. It frees in bursts spread
out in time, since freeing holds the GIL (:func:`_drop`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import jax

from mtc.elastic import host_copy
from mtc.elastic.pace import DEFAULT_BUDGET, Pacer
from mtc.elastic.placement import Shards, SnapshotUnavailableError, covered, place, surviving
from mtc.elastic.taken import (
    Age,
    Latest,
    Taken,
    age_gauges,
    is_key,
    to_host_sharding,
)
from mtc.pool import ThreadPool
from mtc.save.device_copy import DeviceCopier, on_accelerator

if TYPE_CHECKING:
    from mtc.manager import CheckpointManager

# How a replaced snapshot is freed (_drop): bursts of at most this many bytes, this
# far apart (6.4 GB/s), and without pauses while another release waits behind it,
# so that releases never pile up (each holds a snapshot's host memory).
RELEASE_BYTES = 64 << 20
RELEASE_GAP_S = 0.01

log = logging.getLogger("mtc.elastic")

MEMORY = "memory"


class Snapshotter:
    """Keeps the newest training state in host memory across the devices; see the
    module's documentation. ``manager`` may be replaced between loads (the
    loop's mesh, and so its checkpoint manager, changes on every resize)."""

    def __init__(self, *, replica_axis_index: int = 0,
                 manager: CheckpointManager | None = None,
                 device_copy_bytes: int | None = None,
                 loop_budget: float = DEFAULT_BUDGET,
                 host_copies: str | None = None) -> None:
        if host_copies not in (None, "numpy", "pinned"):
            raise ValueError(f"host_copies is 'numpy', 'pinned' or None, not {host_copies!r}")
        self.host_copies = host_copies
        # Kept for Orbax's signature: shards are kept per device, so any replica
        # of any axis serves, and the axis is never needed to find one.
        self.replica_axis_index = replica_axis_index
        self.manager = manager
        # On an accelerator a save copies the state within device memory first, so
        # that the next step, donating the state, waits for that copy only and not
        # for the transfer to host memory (the budget: as Options.save_device_copy_bytes).
        self._copier = DeviceCopier(device_copy_bytes, setting="Snapshotter(device_copy_bytes=...)")
        self._latest: Taken | None = None
        self._pending: Taken | None = None  # copied, maybe not yet done
        self._pending_arrays: list[jax.Array] = []
        self._releases: ThreadPool | None = None  # see the module's documentation
        self._fetches: ThreadPool | None = None  # brings numpy snapshots (host_copy)
        # The pending snapshot's numpy pieces, by position in its leaves, once fetched.
        self._pending_fetch: Future[dict[int, host_copy.Pieces]] | None = None
        self._fetch_pieces = host_copy.fetch  # what the fetch thread runs
        self.last_load_tier: str | None = None
        self.skipped = 0  # saves skipped while a copy was in flight
        # From an accelerator, snapshots asked for every step are taken as often as
        # they cost the loop at most ``loop_budget`` of its time (mtc.elastic.pace);
        # ``paced`` counts those left out for it. On CPU devices every one is taken.
        self.pacer = Pacer(loop_budget)
        self.paced = 0
        self._asked: tuple[int, float] | None = None  # the newest ask: step, time
        self._busy = False  # a snapshot was in flight at the newest ask

    # -- saving ------------------------------------------------------------------------

    def wants(self, step: int, *, in_graph: bool = False) -> bool:
        """Whether a snapshot of ``step``, asked for now, is taken: not while the last
        one is in flight (``in_graph``: on its way from an accelerator; a compiled
        step's copy on CPU is the snapshot already), and (from an accelerator) not
        beyond the loop's budget. Every ask counts towards the loop's time and the
        snapshot's age."""
        now = time.monotonic()
        if self._asked is not None:
            self.pacer.observe(now - self._asked[1], self._busy)
        self._asked = (int(step), now)
        in_flight = self.transferring if in_graph else not self._settle()
        self._busy = in_flight
        self._report_age()
        if in_flight:
            self.skipped += 1
            # Asked every step on an accelerator, most are skipped: a line each
            # would drown the log (``skipped`` counts them).
            log.log(logging.INFO if self.skipped == 1 else logging.DEBUG,
                    "snapshotter busy: skipping the snapshot of step %d (and, at DEBUG, "
                    "every later one while a copy is in flight; Snapshotter.skipped "
                    "counts them)", step)
            return False
        latest = self._latest
        if latest is not None and latest.moved and not self.pacer.due(True):
            self.paced += 1
            return False
        self._busy = True  # the caller takes it now
        return True

    @property
    def age(self) -> Age | None:
        """The newest complete snapshot's :class:`Age` (None before the first)."""
        self._settle()
        latest, asked = self._latest, self._asked
        if latest is None:
            return None
        newest = max(latest.step, asked[0]) if asked is not None else latest.step
        return Age(newest - latest.step, max(0.0, time.monotonic() - latest.at))

    def _report_age(self) -> None:
        age = self.age
        if age is not None:
            seconds, steps = age_gauges()
            seconds.set(age.seconds)
            steps.set(age.steps)

    def save(self, step: int, state: Any) -> bool:
        """Copy ``state`` to host memory without waiting for the copy; skipped (False)
        while the previous save's copy is still in flight, or (from an accelerator)
        while snapshots would cost the loop more than its budget (:meth:`wants`)."""
        if not self.wants(step):
            return False
        self.take(step, state)
        return True

    def take(self, step: int, state: Any) -> None:
        """Copy ``state`` to host memory now (what :meth:`save` does once
        :meth:`wants` said yes): the arrays that fit the device-memory budget are
        copied there first, the rest read from the state itself."""
        leaves, treedef = jax.tree_util.tree_flatten(state)
        arrays = [jax.random.key_data(x) if is_key(x) else x
                  for x in leaves if isinstance(x, jax.Array)]
        copied = self._copier.copy(arrays)
        source = arrays if copied is None else copied.arrays
        moved = any(on_accelerator(a) for a in arrays)
        if self._in_numpy(arrays):
            owned = frozenset() if copied is None else copied.owned
            self._hold_in_numpy(step, treedef, leaves, source, owned, moved=moved)
            return
        copies = iter(jax.device_put(source, [to_host_sharding(a.sharding) for a in arrays],
                                     may_alias=False))
        self._hold(step, treedef, leaves, copies, moved=moved)

    def _in_numpy(self, arrays: Sequence[Any]) -> bool:
        if self.host_copies is not None:
            return self.host_copies == "numpy"
        return host_copy.numpy_serves(arrays)

    def _hold_in_numpy(self, step: int, treedef: Any, leaves: list[Any],
                       source: Sequence[jax.Array], owned: frozenset[int], *,
                       moved: bool, ready_first: bool = False) -> None:
        """Hold a snapshot kept in numpy: ``source[i]`` for i in ``owned`` is a copy
        no step donates, fetched on the fetch thread; every other array is the
        caller's own, which the next step may donate, fetched now. ``ready_first``:
        the fetch thread issues its transfers once the copies are computed
        (:func:`host_copy.fetch`)."""
        now = [i for i in range(len(source)) if i not in owned]
        direct = dict(zip(now, host_copy.fetch([source[i] for i in now]), strict=True))
        later = sorted(owned)
        if self._fetches is None:
            self._fetches = ThreadPool(1, "mtc-snapshot-fetch")
        mine = [source[i] for i in later]
        fetched: Future[dict[int, host_copy.Pieces]] = self._fetches.submit(
            lambda: {**direct, **dict(zip(later, self._fetch_pieces(
                mine, ready_first=ready_first), strict=True))})
        # Placeholders (no ``whole``, no ``host``) until the fetch lands: _settle
        # fills them in.
        shapes = iter(source)
        self._hold(step, treedef, leaves, iter(
            Shards(tuple(a.shape), a.dtype, None) for a in shapes), moved=moved)
        self._pending_fetch = fetched

    def room_for(self, state: Any) -> bool:
        """Whether a second copy of ``state``'s accelerator arrays fits the
        device-memory budget (an in-graph copy needs one; none on CPU)."""
        arrays = [jax.random.key_data(x) if is_key(x) else x
                  for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array)]
        return self._copier.fits_whole(arrays)

    @property
    def transferring(self) -> bool:
        """Whether the pending snapshot is still on its way from an accelerator's
        memory to host memory (``InGraphStep`` takes no copy meanwhile)."""
        pending = self._pending
        return pending is not None and pending.moved and not self._settle()

    def adopt(self, step: int, state: Any, copies: Any) -> None:
        """Take as the snapshot of ``step`` the copies a compiled step already made
        of ``state``'s arrays (:func:`mtc.elastic.in_graph`): ``copies`` is the
        list of ``state``'s array leaves, in order, keys as key data. Copies in an
        accelerator's memory go on to host memory (where it has some), dispatched,
        not waited for: buffers of the snapshot's own, which no step donates."""
        self._settle()
        leaves, treedef = jax.tree_util.tree_flatten(state)
        copies = list(copies)
        moving = any(on_accelerator(c) for c in copies)
        if moving and self._in_numpy(copies):
            # The step's own copies: no step donates them, all fetched on the thread.
            self._hold_in_numpy(step, treedef, leaves, copies, frozenset(range(len(copies))),
                                moved=True, ready_first=True)
            return
        if moving:
            copies = list(jax.device_put(copies, [to_host_sharding(c.sharding) for c in copies],
                                         may_alias=False))
        self._hold(step, treedef, leaves, iter(copies), moved=moving)

    def _hold(self, step: int, treedef: Any, leaves: list[Any], copies: Any, *,
              moved: bool = False) -> None:
        kept: list[Any] = []
        impls: list[Any] = []
        made: list[jax.Array] = []
        for x in leaves:
            if isinstance(x, jax.Array):
                c = next(copies)
                if isinstance(c, Shards):  # a placeholder for a snapshot in numpy
                    kept.append(c)
                else:
                    made.append(c)
                    kept.append(Shards.of(c))
                impls.append(jax.random.key_impl(x) if is_key(x) else None)
            else:
                kept.append(copy.deepcopy(x))  # a later step may change a mutable value
                impls.append(None)
        at = self._asked[1] if self._asked is not None and self._asked[0] == int(step) \
            else time.monotonic()
        self._pending = Taken(int(step), treedef, tuple(kept), tuple(impls), moved, at)
        self._pending_arrays = made
        self._pending_fetch = None

    def _settle(self, wait: bool = False) -> bool:
        """Promote the pending snapshot once its copy is done (``wait``: wait for
        it); True when no copy is in flight any more."""
        pending = self._pending
        if pending is None:
            return True
        if self._pending_fetch is not None:
            return self._settle_fetch(pending, wait)
        try:
            if not wait and not all(a.is_ready() for a in self._pending_arrays):  # type: ignore[attr-defined]
                return False
        except RuntimeError:  # a copy deleted under it (donated by the caller): failed
            pass
        self._pending, self._pending_arrays = None, []
        arrays = [leaf for leaf in pending.leaves if isinstance(leaf, Shards)]
        try:
            # One wait per array: it raises when any device of the array failed
            # before or during the copy (only then are its shards asked one by one).
            jax.block_until_ready([a.whole for a in arrays])
            ok = True
        except (jax.errors.JaxRuntimeError, RuntimeError):
            # Some device failed before or during the copy: the snapshot still
            # serves if the pieces that did land hold every shard.
            ok = all(covered(a, by_index) for a, by_index in zip(
                arrays, surviving(arrays), strict=True))
        if ok:
            self._promote(pending)
        else:
            log.error("the snapshot of step %d lost some shard before it completed: keeping "
                      "step %s", pending.step, self._latest.step if self._latest else None)
        return True

    def _settle_fetch(self, pending: Taken, wait: bool) -> bool:
        """:meth:`_settle` for a snapshot kept in numpy."""
        fetch = self._pending_fetch
        assert fetch is not None
        if not wait and not fetch.done():
            return False
        self._pending, self._pending_fetch = None, None
        try:
            pieces = fetch.result()
        except (jax.errors.JaxRuntimeError, RuntimeError) as e:
            # A device failed (or an array was deleted) before its shards landed:
            # nothing of this snapshot counts.
            log.error("the snapshot of step %d failed before it completed (%s): keeping "
                      "step %s", pending.step, e, self._latest.step if self._latest else None)
            return True
        arrays = iter(sorted(pieces.items()))
        leaves = tuple(dataclasses.replace(leaf, host=next(arrays)[1])
                       if isinstance(leaf, Shards) else leaf for leaf in pending.leaves)
        self._promote(dataclasses.replace(pending, leaves=leaves))
        return True

    def _promote(self, done: Taken) -> None:
        old, self._latest = self._latest, done
        if old is not None and old.moved:
            self._release([old])
        del old

    def settle(self) -> None:
        """Promote the pending snapshot if its copy is done, releasing the one it
        replaces; never waits. Every method does this first; a loop that takes its
        snapshot after waiting for a step may call it right after dispatching the
        next one, so that releasing the replaced snapshot's buffers (milliseconds
        for a model of a hundred leaves on 8 devices) happens while the devices
        compute, not between steps."""
        self._settle()

    def join(self) -> None:
        """Wait for the save in flight, if any."""
        self._settle(wait=True)

    def _release(self, holder: list[Taken]) -> None:
        """Drop the buffers of the snapshot in ``holder`` on the release thread, not
        the loop's (in a list the thread empties: the task's arguments stay
        referenced until it returns, and with them every buffer at once)."""
        if self._releases is None:
            self._releases = ThreadPool(1, "mtc-snapshot-release")
        self._releases.submit(_drop, holder, self._releases.queued)

    def close(self) -> None:
        """Join the release thread (the snapshots stay loadable)."""
        if self._fetches is not None:
            self._settle(wait=True)
            self._fetches.shutdown(wait=True)
            self._fetches = None
        if self._releases is not None:
            self._releases.shutdown(wait=True)
            self._releases = None

    @property
    def latest(self) -> Latest | None:
        """The step of the newest completed snapshot (None before the first)."""
        self._settle()
        return None if self._latest is None else Latest(self._latest.step)

    # -- loading -----------------------------------------------------------------------

    def covers(self, devices: Collection[jax.Device] | None = None) -> bool:
        """Whether the newest snapshot can be loaded from memory: its shards that can
        still be read (on ``devices`` only, when given) hold every array whole."""
        self._settle()
        snap = self._latest
        if snap is None:
            return False
        arrays = [leaf for leaf in snap.leaves if isinstance(leaf, Shards)]
        ids = None if devices is None else {d.id for d in devices}
        return all(covered(a, by_index) for a, by_index in zip(
            arrays, surviving(arrays, ids), strict=True))

    def load(self, abstract_state: Any, *, reset_snapshot_state: bool = True,
             devices: Collection[jax.Device] | None = None) -> Any:
        """The newest snapshot placed per ``abstract_state``'s shardings (arrays or
        ``ShapeDtypeStruct``s with ``.sharding``; other leaves are placeholders
        for the saved values). When the surviving devices lack some shard: with a
        manager, its newest restorable step; without, :class:`SnapshotUnavailableError`.
        ``reset_snapshot_state``: the loaded state becomes the snapshot, on the
        new mesh (so a second failure before the next save still finds one).
        ``devices`` (beyond Orbax's interface): read shards on these devices only
        (those the caller knows healthy); by default, every shard that can be read."""
        self._settle()
        snap = self._latest
        try:
            if snap is None:
                raise SnapshotUnavailableError("no snapshot available to restore from")
            state, kept = self._place(snap, abstract_state, devices)
            step, tier = snap.step, MEMORY
        except SnapshotUnavailableError as e:
            if self.manager is None:
                raise
            log.warning("the snapshot cannot be loaded (%s): restoring through mtc", e)
            step, state = self._from_manager(abstract_state)
            kept = None
            tier = self.manager.last_restore_tier or "local"
        self.last_load_tier = tier
        if reset_snapshot_state:
            self._pending, self._pending_arrays, self._pending_fetch = None, [], None
            if kept is not None:  # the host-memory stage of the load is the new snapshot
                self._latest = kept
            else:
                self.save(step, state)
        return state

    def _place(self, snap: Taken, abstract_state: Any,
               devices: Collection[jax.Device] | None) -> tuple[Any, Taken | None]:
        targets, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        if treedef != snap.treedef:
            raise ValueError(f"abstract_state's tree differs from the snapshot's:\n"
                             f"{treedef}\nagainst\n{snap.treedef}")
        arrays, shardings, names, where = [], [], [], []
        for i, ((path, target), leaf) in enumerate(zip(targets, snap.leaves, strict=True)):
            if isinstance(leaf, Shards):
                sharding = getattr(target, "sharding", None)
                if sharding is None:
                    raise ValueError(f"abstract_state{jax.tree_util.keystr(path)}: no sharding")
                arrays.append(leaf)
                shardings.append(sharding)
                names.append(jax.tree_util.keystr(path))
                where.append(i)
        ids = None if devices is None else {d.id for d in devices}
        host = [to_host_sharding(x) for x in shardings]
        staged: list[jax.Array] | None = None
        if all(a.host is not None for a in arrays):
            # In this process's memory, which a load leaves as it is: one copy each
            # onto the targets, and the snapshot stays the newest.
            loaded = place(arrays, shardings, names, ids)
        elif all(h.memory_kind != x.memory_kind for h, x in zip(host, shardings, strict=True)):
            # Two stages, as Orbax's load: into host memory on the new mesh (no copy
            # where a shard already is on its target device), which is the new
            # snapshot, then one copy each into device memory, which steps donate.
            staged = place(arrays, host, names, ids, may_alias=True)
            loaded = jax.device_put(staged, shardings, may_alias=False)
        else:
            loaded = place(arrays, shardings, names, ids)
        placed = dict(zip(where, loaded, strict=True))
        out = []
        for i, leaf in enumerate(snap.leaves):
            if i in placed:
                impl = snap.key_impls[i]
                x = placed[i]
                out.append(jax.random.wrap_key_data(x, impl=impl) if impl is not None else x)
            else:
                out.append(copy.deepcopy(leaf))
        kept = snap if arrays and all(a.host is not None for a in arrays) else None
        if staged is not None:
            by_leaf = dict(zip(where, staged, strict=True))
            kept = Taken(snap.step, snap.treedef, tuple(
                Shards.of(by_leaf[i]) if i in by_leaf else leaf
                for i, leaf in enumerate(snap.leaves)), snap.key_impls, at=snap.at)
        return jax.tree_util.tree_unflatten(snap.treedef, out), kept

    def _from_manager(self, abstract_state: Any) -> tuple[int, Any]:
        assert self.manager is not None
        step = self.manager.latest_step()
        if step is None:
            raise SnapshotUnavailableError("the snapshot cannot be loaded and mtc holds no "
                                           "restorable step")
        return step, self.manager.restore(step, abstract_state)


def _drop(holder: list[Taken], behind: Callable[[], int] = lambda: 0) -> None:
    """Free the buffers of the snapshot in ``holder`` in bursts of at most
    :data:`RELEASE_BYTES`, :data:`RELEASE_GAP_S` apart, with no pause while
    ``behind()`` (releases waiting their turn) is not 0. Freeing a buffer holds the
    GIL for as long as the system takes to unmap it, and a release starts when the
    loop's thread is busiest (in :meth:`Snapshotter.save`, then dispatching its
    step). On a TPU v5e host (gVisor, 2026-12-07, ``bench/probe_snapshot_cost.py``,
    a 1.6 GB snapshot in 64 MiB buffers beside a 0.63 s step): freed at once, the
    loop's thread lost 75 ms a snapshot, in ``save``; one buffer at a time with
    only a yield between them, 48 ms, in the step's dispatch. Spread out, a free
    rarely meets the few milliseconds the loop's thread holds the GIL a step, as
    a save's buffers, freed by its writer as each is written, do not."""
    old = holder.pop()
    arrays = [leaf for leaf in old.leaves if isinstance(leaf, Shards)]
    buffers: list[Any] = [x for a in arrays for _, x in a.host or ()]
    buffers += [a.whole for a in arrays if a.whole is not None]
    del old, arrays
    while buffers:
        freed = 0
        while buffers and freed < RELEASE_BYTES:
            freed += int(getattr(buffers[-1], "nbytes", 0))
            buffers.pop()  # the last reference, unless a load still holds it
        if buffers and not behind():
            time.sleep(RELEASE_GAP_S)
