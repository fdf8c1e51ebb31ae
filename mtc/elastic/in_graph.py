"""The in-graph snapshot: the compiled train step itself emits the snapshot copy.

``Snapshotter.save(step, state)`` copies the state after the step, as separate
programs the runtime schedules beside the next step (and skips while one is in
flight). :class:`InGraphStep` instead compiles the copy into the step: the new
state goes out once more, into a second buffer in device memory (at the
device's memory bandwidth: a small part of a step), never donated, so it stays
valid while the next step runs in place. On an accelerator the snapshotter then moves that copy to
host memory while the next steps run; a step asked for a snapshot while the
last one is still on its way runs without the copy (``skipped`` counts them):
snapshots are taken as often as the device-to-host link carries them, and no
step waits for the link. (A copy into ``pinned_host`` inside the step made the
step wait for the transfer into fresh host pages: 0.3 to 2 s per GiB there.)
On CPU devices the copy is the snapshot, and every one asked for is taken.
The cost is a second program (a step without the copy) and the copy's
device-memory bandwidth inside the step.

Usage (``train_step(state, batch) -> (new_state, loss)``, ``state`` a pytree of
arrays, PRNG keys included)::

    step_fn = mtc.elastic.InGraphStep(train_step, snapshotter, state_shardings=shardings)
    state, loss = step_fn(state, batch, snapshot_step=step if step % N == 0 else None,
                          snapshot_extra={"data": iterator.get_state()})

``snapshot_extra`` (a dict of plain values) joins the snapshot beside the new
state (which must then be a dict): load it with an abstract state of that shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mtc.elastic.snapshot import Snapshotter
from mtc.elastic.taken import is_key, step_copy_sharding


class InGraphStep:
    """``fn`` jitted twice: as is, and also emitting a copy of its new state (its
    first output) that ``snapshotter`` adopts as the snapshot of ``snapshot_step``.
    ``jit_kwargs`` go to ``jax.jit`` (``donate_argnums`` defaults to the state)."""

    def __init__(self, fn: Callable[..., Any], snapshotter: Snapshotter, *,
                 state_shardings: Any, **jit_kwargs: Any) -> None:
        self.snapshotter = snapshotter
        self.skipped = 0  # snapshots asked for and not taken (in flight, or paced)
        self.outside = 0  # snapshots taken after the step, for want of room in it
        jit_kwargs.setdefault("donate_argnums", 0)
        self._plain = jax.jit(fn, **jit_kwargs)
        host = jax.tree_util.tree_map(step_copy_sharding, state_shardings)

        def with_copy(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            new = out[0]
            leaves = jax.tree_util.tree_leaves(new)
            dests = jax.tree_util.tree_structure(new).flatten_up_to(host)  # type: ignore[attr-defined]
            # jnp.copy: a buffer of the copy's own even where the destination is
            # the new state's own memory.
            copies = [jax.device_put(jnp.copy(jax.random.key_data(x) if is_key(x) else x), d)
                      for x, d in zip(leaves, dests, strict=True)]
            return (*out, copies)

        self._with_copy = jax.jit(with_copy, **jit_kwargs)

    @property
    def age(self) -> Any:
        """The newest complete snapshot's age (:attr:`Snapshotter.age`)."""
        return self.snapshotter.age

    @property
    def jitted(self) -> tuple[Any, Any]:
        """The two programs (without, with the copy): to compile ahead."""
        return self._plain, self._with_copy

    def __call__(self, *args: Any, snapshot_step: int | None = None,
                 snapshot_extra: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        if snapshot_step is not None and not self.snapshotter.wants(snapshot_step,
                                                                    in_graph=True):
            # The link still carries the last one, or the loop's budget is spent.
            self.skipped += 1
            snapshot_step = None
        if snapshot_step is not None and args and not self.snapshotter.room_for(args[0]):
            # No room on the device for a second copy of the state beside the step
            # (a full chip): the snapshot is taken from the new state after the step,
            # the part that fits copied in device memory, the rest read from it.
            out = self._plain(*args, **kwargs)
            new = out[0]
            self.snapshotter.take(snapshot_step, {**new, **snapshot_extra} if snapshot_extra
                                  else new)
            self.outside += 1
            return out
        if snapshot_step is None:
            return self._plain(*args, **kwargs)
        *out, copies = self._with_copy(*args, **kwargs)
        new = out[0]
        if snapshot_extra:
            if not isinstance(new, dict):
                raise TypeError("snapshot_extra needs the step's new state to be a dict")
            # Array leaves first (the copies' order), then the plain values.
            self.snapshotter.adopt(snapshot_step, {**new, **snapshot_extra}, _reorder(
                new, snapshot_extra, copies))
        else:
            self.snapshotter.adopt(snapshot_step, new, copies)
        return tuple(out)


def _reorder(new: dict[str, Any], extra: dict[str, Any], copies: list[Any]) -> list[Any]:
    """``copies`` (in ``new``'s leaf order) in the leaf order of ``{**new, **extra}``
    (dict keys are sorted when flattened, so the two orders may differ)."""
    mine = iter(copies)
    by_key = {k: [next(mine) for _ in jax.tree_util.tree_leaves(new[k])] for k in sorted(new)}
    merged = {**new, **extra}
    out: list[Any] = []
    for k in sorted(merged):
        if k in by_key and k not in extra:
            out.extend(by_key[k])
        else:
            out.extend(x for x in jax.tree_util.tree_leaves(merged[k]) if isinstance(x, jax.Array))
    return out
