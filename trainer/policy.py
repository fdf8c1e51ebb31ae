"""What the elastic trainer does while slices are missing: a pure function, no JAX
(the demo's driver and the benchmarks import it to offer the same choices)."""

from __future__ import annotations

from collections.abc import Set

PAUSE_POLICIES = ("replacement", "always", "resize")


def pause_seconds(missing: Set[int], replacing: Set[int], timeout: float,
                  policy: str = "replacement") -> float:
    """How long to pause for the ``missing`` slices before resizing without them.

    ``replacement``: the whole ``timeout`` when the cluster is replacing the
    hosts of every missing slice (a restarted pod, a repaired node: back soon,
    and resuming on the full mesh keeps the throughput), none otherwise (a slice
    preempted or failed with nothing on its way: waiting only loses time).
    ``always``: the timeout after every failure. ``resize``: never (training
    goes on at once on the healthy slices while the hosts are replaced, and
    scales back up when they are back: pathwaysutils' own model of elasticity,
    which trades the replacement's start for a resize and a scale-up)."""
    if policy not in PAUSE_POLICIES:
        raise ValueError(f"unknown pause policy {policy!r}")
    if not missing or policy == "resize":
        return 0.0
    if policy == "always":
        return timeout
    return timeout if set(missing) <= set(replacing) else 0.0


RECOVERY_SOURCES = ("mtc", "snapshot", "ramdisks")


def recovery_source(*, full: bool, scale_up: bool, snapshot_step: int | None,
                    last_saved: int | None, failed_saves: Set[int]) -> str:
    """Where the elastic trainer takes the state to continue from after a failure.

    ``snapshot_step``: the step of the in-memory snapshot when the surviving
    devices hold all of it (None when there is none, or it lost a shard).
    ``mtc`` on the full mesh after a failure when there is no usable snapshot,
    or when mtc may hold that same step (its save was handed over, ``last_saved``,
    and did not fail): a tie goes to mtc, whose bytes are checksummed and which
    needs no surviving replica of every shard; the replicators agree on the step
    and bring a wiped host's shards back from its peer or the backup. Otherwise
    the ``snapshot`` (resharded onto a resized mesh); without one, a resize or
    scale-up reads the surviving hosts' ``ramdisks``."""
    tie = (snapshot_step is not None and last_saved == snapshot_step
           and snapshot_step not in failed_saves)
    if full and not scale_up and (snapshot_step is None or tie):
        return "mtc"
    return "snapshot" if snapshot_step is not None else "ramdisks"
