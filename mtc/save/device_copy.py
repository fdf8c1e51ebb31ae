"""The first stage of a save on an accelerator: the values of this moment, copied
within device memory into buffers the training step does not own.

A training step that donates its state cannot reuse a buffer that a
device-to-host transfer still reads: a save that hands the transfer the state's
own buffers holds the next step for the whole copy (about 0.34 s per GiB on a
TPU v5e host, against a 17 ms step). A copy within device memory takes
milliseconds; the transfer then reads the copy, which nothing else touches,
while the next steps run, and the copy is dropped once it is in host memory.

The copy costs device memory for as long as the transfer runs: at most
``budget`` bytes per device (``Options.save_device_copy_bytes``), one save's
copy at a time (the dispatchers make the next copy only once the previous
transfer has ended). A real job fills the chip, so the copy is never all or
nothing: the arrays that fit the budget are copied (the largest first), and
only the rest is read from the state itself, which the save waits for
(:func:`fits`, pure). Said once per manager when part of a save does not fit.

Why the save waits for that rest rather than dispatching its transfer and
letting the next donating step wait for it on the device (the runtime orders a
donating program after the reads already dispatched: 120 of 120 arrays kept
their values in ``bench/probe_capture.py``'s ``ordering`` case on a TPU v5e): the
only buffers such a transfer can go to are new ones in ``pinned_host`` memory,
and on that host 1.5 GiB took 2.02 s to land there against 0.51 s for
``jax.device_get`` (2026-12-07, gVisor). Tried with saves back to back on a chip
88% full, the loop lost 1.87x the state's device-to-host time per save, against
0.44x where the save waits here.

On CPU devices nothing is copied here: a shard's host view is its buffer, which
a donating step leaves alone (:mod:`mtc.sidecar.save.agent`).
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("mtc.manager")

# The share of a device's memory left free by the automatic budget beside what
# the job has ever used at its peak (its buffers, and what the platform reserved
# for its programs) and the copies alive: a margin for the allocator's
# fragmentation and for what the platform does not report. 2% is 338 MB on a TPU
# v5e. A split step's gradient program, loaded again once a snapshot's copy had
# taken the room, once asked for 769 MB "at the bottom of memory" with 424 MB free
# and the job died (RESOURCE_EXHAUSTED, 2026-12-07): the budget did not count the
# programs' reservation then. It does now (``peak_bytes_reserved``, which the TPU
# reports: bench/probe_transfer_memory.py, 2026-12-08), and a device-to-host
# transfer takes no device memory there (the same probe: the peak did not move
# with 512 MiB of transfers under way).
HEADROOM = 0.02


def on_accelerator(x: Any) -> bool:
    """Whether ``x`` is a jax.Array held in an accelerator's memory (not a CPU
    device's, not the host memory of a ``pinned_host`` sharding)."""
    if not isinstance(x, jax.Array):
        return False
    kind = getattr(x.sharding, "memory_kind", None)
    if kind is not None and "host" in kind:
        return False
    device: Any = next(iter(x.sharding.device_set))
    return bool(device.platform != "cpu")


def bytes_per_device(arrays: Sequence[jax.Array]) -> dict[int, int]:
    """What a copy of ``arrays`` takes on each device that holds a shard of them."""
    out: dict[int, int] = {}
    for a in arrays:
        shard = math.prod(a.sharding.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
        devices: set[Any] = a.sharding.addressable_devices
        for d in devices:
            out[d.id] = out.get(d.id, 0) + shard
    return out


def memory_of(device: Any) -> tuple[int, int] | None:
    """(bytes_limit, the job's peak use) as the platform reports them: the peak of
    its buffers and, where the platform reports it, the peak it reserved for
    programs (a TPU loads a program's working memory apart from its buffers, and
    loads it again after making room); None where it reports no statistics."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - platforms without statistics raise anything
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return (int(stats["bytes_limit"]),
            int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))
            + int(stats.get("peak_bytes_reserved", 0)))


def free_at_peak(device: Any) -> int | None:
    """Device memory the job has never used, less :data:`HEADROOM`: a copy of that
    size fits beside the largest step this job has run. None where the platform
    reports no memory statistics."""
    got = memory_of(device)
    return None if got is None else room_beside(*got)


def room_beside(limit: int, peak: int) -> int:
    return max(0, limit - peak - int(HEADROOM * limit))


def step_peak(peak: int, last: tuple[int, int] | None) -> int:
    """The job's own peak use on a device, without this copier's copies, from the
    peak the platform reports (which never goes down) and ``last``: (the job's peak
    before the last copy, the most bytes of copies alive at once since). A copy
    lives while the next steps run, so the reported peak may count it: up to the
    copies' bytes of a rise are theirs, and only the rest is the job's.

    Why not all of a larger rise, as before: on a TPU v5e chip 88% full the rise
    beside a snapshot's first copy was larger than the copy (by how much the run
    did not record; the peak read counts what the platform reserved for programs,
    and a program loaded once the copy had taken the room reserves its own), and
    read as the job's, all of it, it left no room for any later copy: 3 snapshots
    of 4 were read whole from the state, each holding the loop (2026-12-08). The
    reading is the one a rise within the copies' bytes always had: the copies
    alive beside the job's peak; :data:`HEADROOM` covers a reading wrong by less."""
    if last is None:
        return peak
    before, copied = last
    return max(before, peak - copied)


class Account:
    """Every device-memory copy this process holds, whoever made it (a manager's
    save, a snapshotter's snapshot), and the job's own peak use read beside them.

    One per process (:data:`ACCOUNT`): a copier that read the platform's peak on its
    own took another copier's copies, alive while a step ran, for the job's (a TPU
    v5e run, 2026-12-07: the snapshotter's room fell from 1.15 GB to 0.55 GB after
    the manager's saves), and could not leave room for copies still alive beside
    the one it makes. Copies are counted from when they are made until their last
    reference goes (a finalizer; transfers drop them on any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live: dict[int, int] = {}  # per device: bytes of copies alive now
        # Per device: the job's peak use without copies (step_peak), and (that peak,
        # the most bytes of copies alive at once since it was read).
        self.peaks: dict[int, int] = {}
        self.last: dict[int, tuple[int, int]] = {}

    def room(self, device: int, limit: int, peak: int) -> int:
        """Room for a new copy on ``device``: beside the job's own peak (the
        reported ``peak`` less what copies may have added) and every copy alive."""
        with self._lock:
            job = step_peak(peak, self.last.get(device))
            self.peaks[device] = job
            return max(0, room_beside(limit, job) - self.live.get(device, 0))

    def made(self, copies: Sequence[jax.Array], *, track_peak: bool) -> None:
        """Count ``copies`` until each is freed; ``track_peak``: the room was read
        from the platform's peak (:meth:`room`), which they may now raise."""
        for c in copies:
            sizes = bytes_per_device([c])
            with self._lock:
                for d, n in sizes.items():
                    self.live[d] = self.live.get(d, 0) + n
                    if track_peak and d in self.peaks:
                        before, most = self.last.get(d, (self.peaks[d], 0))
                        if before != self.peaks[d]:  # the job's peak moved: a new window
                            most = 0
                        self.last[d] = (self.peaks[d], max(most, self.live[d]))
            weakref.finalize(c, self._freed, sizes)

    def _freed(self, sizes: dict[int, int]) -> None:
        with self._lock:
            for d, n in sizes.items():
                self.live[d] = self.live.get(d, 0) - n


ACCOUNT = Account()


@jax.jit
def _copy(xs: list[jax.Array]) -> list[jax.Array]:
    return [jnp.copy(x) for x in xs]


def copy_in_device_memory(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """New buffers holding ``arrays``' values, in the same shardings; dispatched,
    not waited for. One compiled copy of them all: on a TPU v5e it read and wrote
    1 GiB in 4.4 ms, where ``jax.device_put(..., may_alias=False)`` took 108 ms."""
    return _copy(list(arrays))


def fits(sizes: Sequence[dict[int, int]], budget: dict[int, int]) -> frozenset[int]:
    """Which arrays to copy in device memory: ``sizes[i]`` is array i's bytes per
    device, ``budget`` each device's room. The largest first (fewest bytes left for
    the save to wait on), each taken while it fits on every device it is on;
    smaller ones fill what is left."""
    left = dict(budget)
    taken: set[int] = set()
    for i in sorted(range(len(sizes)), key=lambda i: (-sum(sizes[i].values()), i)):
        if all(n <= left.get(d, 0) for d, n in sizes[i].items()):
            for d, n in sizes[i].items():
                left[d] = left.get(d, 0) - n
            taken.add(i)
    return frozenset(taken)


class Copied(NamedTuple):
    """A save's arrays with those copied in device memory replaced by their copies
    (``owned``: their positions; the others are the caller's own arrays)."""

    arrays: list[Any]
    owned: frozenset[int]


class DeviceCopier:
    """Copies a save's accelerator arrays within device memory, within a budget per
    device (``budget``: bytes; None: what :func:`free_at_peak` leaves; 0: never)."""

    def __init__(self, budget: int | None,
                 setting: str = "Options(save_device_copy_bytes=...)") -> None:
        self.budget = budget
        self.setting = setting  # what sets the budget, for the warning
        self.copied = 0  # saves of which some array was copied
        self.blocked = 0  # saves of which some array was read from the state itself
        self.copied_bytes = 0  # bytes copied in device memory, all saves
        self.direct_bytes = 0  # accelerator bytes read from the state itself, all saves
        self._told = False
        self.account = ACCOUNT  # the process's copies and the job's peak, shared

    def copy(self, arrays: Sequence[jax.Array | np.ndarray]) -> Copied | None:
        """``arrays`` with each accelerator array that fits the budget replaced by a
        copy of it in device memory (dispatched, not waited for), or None when none
        is on an accelerator or none fits."""
        where = [i for i, a in enumerate(arrays) if isinstance(a, jax.Array)
                 and on_accelerator(a)]
        if not where:
            return None
        sizes = [bytes_per_device([arrays[i]]) for i in where]  # type: ignore[list-item]
        room, why = self._room({d for s in sizes for d in s})
        chosen = fits(sizes, room)
        owned = frozenset(where[k] for k in chosen)
        total = [sum(s.values()) for s in sizes]
        direct = sum(n for k, n in enumerate(total) if k not in chosen)
        self.direct_bytes += direct
        self.copied_bytes += sum(total) - direct
        if direct:
            self.blocked += 1
            if not self._told:
                self._told = True
                log.warning(
                    "mtc: %d of %d bytes of this save are read from the state itself: the "
                    "next step that donates it waits for their device-to-host transfer "
                    "(the rest is copied in device memory first). %s (%s sets the budget); "
                    "said once", direct, sum(total), why, self.setting)
        if not owned:
            return None
        self.copied += 1
        made = copy_in_device_memory([arrays[i] for i in sorted(owned)])  # type: ignore[misc]
        self.account.made(made, track_peak=self.budget is None)
        copies = iter(made)
        return Copied([next(copies) if i in owned else a for i, a in enumerate(arrays)], owned)

    def fits_whole(self, arrays: Sequence[jax.Array | np.ndarray]) -> bool:
        """Whether a copy of every accelerator array of ``arrays`` fits the budget."""
        device = [a for a in arrays if isinstance(a, jax.Array) and on_accelerator(a)]
        if not device:
            return True
        need = bytes_per_device(device)
        room, _ = self._room(set(need))
        return all(n <= room[d] for d, n in need.items())

    def _room(self, devices: set[int]) -> tuple[dict[int, int], str]:
        """Each device's room for copies, and what sets it (for the warning)."""
        if self.budget is not None:
            return {d: self.budget for d in devices}, f"The budget is {self.budget} bytes"
        by_id = {d.id: d for d in jax.devices()}
        room: dict[int, int] = {}
        for d in devices:
            got = memory_of(by_id[d]) if d in by_id else None
            if got is None:
                return {d: 0 for d in devices}, "The device reports no memory statistics"
            room[d] = self.account.room(d, *got)
        return room, (f"{min(room.values())} bytes are free beside the job's peak use "
                      f"and the copies alive on the fullest device")
