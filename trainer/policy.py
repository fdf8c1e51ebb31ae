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
