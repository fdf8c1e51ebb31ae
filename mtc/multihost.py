"""Agreement across JAX processes in multi-controller runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np

# Steps compared across processes: enough for any sane retention policy.
WINDOW = 64


def common_steps(local: Sequence[int], keys: Mapping[int, int] | None = None) -> list[int]:
    """Steps committed in every process (collective: every process must call it).
    ``keys``: per step a number every process must report alike for the step to be
    common (its run's :func:`mtc.runs.run_key`: one run's bytes on every host)."""
    if jax.process_count() == 1:
        return sorted(local)
    from jax.experimental import multihost_utils

    newest = sorted(local)[-WINDOW:]
    mine = np.full((2, WINDOW), -1, dtype=np.int64)
    mine[0, :len(newest)] = newest
    mine[1, :len(newest)] = [(keys or {}).get(s, 0) for s in newest]
    # As 32-bit halves: without jax_enable_x64 an int64 array crosses as int32.
    everyone = np.asarray(multihost_utils.process_allgather(_halves(mine)))
    common: set[tuple[int, int]] | None = None
    for rows in everyone.reshape(jax.process_count(), 4, WINDOW):
        whole = _whole(rows)
        seen = {(int(s), int(k)) for s, k in zip(whole[0], whole[1], strict=True) if s >= 0}
        common = seen if common is None else common & seen
    return sorted(s for s, _ in common or ())


def _halves(a: np.ndarray) -> np.ndarray:
    """An int64 array (2 rows) as 4 rows of int32: each row's high, then low halves."""
    u = a.astype(np.uint64)
    hi = (u >> np.uint64(32)).astype(np.uint32).view(np.int32)
    lo = (u & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    return np.concatenate([hi, lo]).astype(np.int32)


def _whole(rows: np.ndarray) -> np.ndarray:
    """The inverse of :func:`_halves`."""
    r = np.asarray(rows, dtype=np.int32).view(np.uint32).astype(np.uint64)
    n = r.shape[0] // 2
    return ((r[:n] << np.uint64(32)) | r[n:]).view(np.int64)


def every_value(value: int) -> list[int]:
    """Every process's ``value`` (an int64), in process order (collective)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    mine = _halves(np.array([[value]], dtype=np.int64))
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    return [int(_whole(rows)[0, 0]) for rows in everyone.reshape(jax.process_count(), 2, 1)]


def barrier(name: str) -> None:
    """Wait for every process (no-op with one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true in any process (collective)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.array([int(flag)], np.int32)))
    return bool(flags.any())


def on_pathways() -> bool:
    """Whether JAX runs on Pathways (one controller; every device reports process 0)."""
    import sys

    # Pathways programs import pathwaysutils before they touch JAX; importing it
    # here just to ask would cost every restart half a second.
    if "pathwaysutils" not in sys.modules:
        return False
    try:
        from pathwaysutils import is_pathways_backend_used
    except ImportError:
        return False
    return bool(is_pathways_backend_used())


def reached_preemption(step: int) -> bool:
    """Whether every process reached the preemption sync point at ``step`` (JAX's
    ``multihost_utils.reached_preemption_sync_point``); False without the
    preemption service (JAX answers False when ``jax.distributed`` was never
    started) and on Pathways.

    A single process is asked too, as Orbax asks: one process under
    ``jax.distributed`` (a one-host TPU VM, a one-pod JobSet) gets SIGTERM like
    any other, and answering False there would lose the step Orbax saves."""
    if on_pathways():
        return False
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # the preemption service is off
        return False
