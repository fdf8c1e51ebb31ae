"""Agreement across JAX processes in multi-controller runs."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

# Steps compared across processes: enough for any sane retention policy.
WINDOW = 64


def common_steps(local: Sequence[int]) -> list[int]:
    """Steps committed in every process (collective: every process must call it)."""
    if jax.process_count() == 1:
        return sorted(local)
    from jax.experimental import multihost_utils

    mine = np.full(WINDOW, -1, dtype=np.int64)
    newest = sorted(local)[-WINDOW:]
    mine[:len(newest)] = newest
    everyone = np.asarray(multihost_utils.process_allgather(mine))
    common = set(newest)
    for row in everyone.reshape(jax.process_count(), WINDOW):
        common &= {int(s) for s in row if s >= 0}
    return sorted(common)


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
